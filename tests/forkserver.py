"""Start a script as `python script.py ARGS` does, from a process that has already imported torch, transformers and
peft: a fork server. A fresh interpreter spends 3-11 s on those imports on this 2-core machine; a fork of one that
holds them starts the script in milliseconds. The tests' stage runs go through `run`, a drop-in for `subprocess.run`.

What makes a forked child stand for a fresh `python script.py`:
- the script runs as `__main__` (runpy) with sys.argv, sys.path[0] (its folder), PYTHONPATH, the working directory
  and the environment of the request;
- its stdin, stdout and stderr are the caller's own file descriptors, passed over the socket (SCM_RIGHTS), so a pipe,
  a file, /dev/null or an inherited terminal behave as under subprocess;
- an uncaught exception prints its traceback (from the script's frames) and exits 1, SystemExit exits with its code;
  then the interpreter's shutdown up to its module teardown: non-daemon threads joined, atexit run, the files the
  script opened flushed. The teardown is skipped (os._exit): in a fork it writes to every page shared with the
  server, 13-15 s on the loaded 2-core machine, and nothing a test reads depends on it;
- what the imports printed in the server (a FutureWarning, say) is printed again on the child's stdout / stderr, as
  a fresh interpreter's imports would print it;
- `random`, numpy's and torch's global generators are reseeded from the OS, as a fresh interpreter's are.

What a fork cannot stand for falls back to a real subprocess, so no test checks less:
- a variable read when a library is imported (HF_*, TRANSFORMERS_*, TORCH*, OMP_*, PYTHON* but PYTHONPATH, HOME,
  locale ...) that differs from the server's: HF_HUB_OFFLINE=1, say, is fixed in huggingface_hub's constants at import;
- interpreter flags (`python -u`, `-m`), a command that is neither `sys.executable SCRIPT.py ...` nor
  `sys.executable -c CODE ...`, stdin input;
- T2G_NO_FORKSERVER set (every run a fresh interpreter, to check that the two agree).
Tests whose point is a signal (Ctrl-C, kill -9) start their process with subprocess.Popen themselves."""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

PRELOAD = (  # what the stages import, slowest first on a loaded core: rouge_score (nltk) ~16 s, torch ~10 s, ...
    "torch",
    "transformers",
    "peft",
    "numpy",
    "safetensors.torch",
    "tokenizers",
    "openai",
    "matplotlib.pyplot",
    "rouge_score.rouge_scorer",
    "sacrebleu.metrics",
)
PRELOAD_ATTRS = (  # transformers' lazy module: these pull in the model, trainer and generation code the stages use
    ("transformers", "AutoModelForCausalLM"),
    ("transformers", "AutoTokenizer"),
    ("transformers", "LlamaForCausalLM"),
    ("transformers", "PreTrainedModel"),
    ("transformers", "Trainer"),
    ("peft", "get_peft_model"),
)
# variables a library reads once, at import: a request that sets one otherwise than the server did gets a fresh
# interpreter instead
IMPORT_TIME = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS", "CUDA", "TOKENIZERS",
    "PYTHON", "HOME", "XDG_", "LANG", "LC_", "LD_", "MALLOC", "TMPDIR", "NUMEXPR", "GOTO", "MPL", "NLTK", "SACREBLEU",
    "OPENAI_API_TYPE", "OPENAI_API_VERSION", "OPENAI_LOG", "AZURE_OPENAI", "ATEN_", "ONEDNN_", "DNNL_",
)  # fmt: skip


# set by libraries in the tests' own process when they are imported or used, not by a test: torch's inductor (its
# default cache folder, the first time it is asked for), lm_eval (HF_XET_HIGH_PERFORMANCE) and alpaca_eval (KMP_*)
# at import. Each then differed from the server's in every later request of that worker and sent the rest of the
# suite to fresh interpreters under xdist; a script that imports them sets them again itself.
SET_IN_PROCESS = ("TORCHINDUCTOR_CACHE_DIR", "HF_XET_HIGH_PERFORMANCE", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")


class ForkServerFallback(UserWarning):
    """This worker's own environment changed since the tests started (a library or a test set a variable read at
    import): its runs fork from a server of that environment, one more start; past MAX_SERVERS of them, each run is a
    fresh interpreter that pays the imports again."""


def _import_time(key: str) -> bool:
    return key.startswith(IMPORT_TIME) and key not in (
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        *SET_IN_PROCESS,
    )  # the child sets PYTHON*


# ---------------------------------------------------------------------------------------------------------------------
# The client: a drop-in for subprocess.run
# ---------------------------------------------------------------------------------------------------------------------

# a server per environment of the variables read at import, started on first use: {key: (Popen, socket path, env)}.
# A run that sets one otherwise (a bench's pinned CPU kernel path, HF_HUB_OFFLINE) forks from a server that imported
# everything under it, as a fresh interpreter would have.
_servers = {}
MAX_SERVERS = 4
_lock = threading.Lock()
_BASE_ENV = dict(os.environ)  # the environment when the tests started, not one a test has patched meanwhile
_subprocess_run = subprocess.run  # the real one: a nested run replaces subprocess.run with `run` below
RUN_KW = {"capture_output", "text", "cwd", "env", "timeout", "stdout", "stderr", "check", "stdin"}


def _key(env: dict) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if _import_time(k))


def _start(env: dict) -> tuple | None:
    """The server of env's import-time variables (started now if needed), or None past MAX_SERVERS."""
    with _lock:
        server = _servers.get(_key(env))
        if server is None and len(_servers) >= MAX_SERVERS:
            return None
        if server is None or server[0].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="t2g-fork-"), "sock")
            env = dict(env)
            proc = subprocess.Popen(
                [sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
            atexit.register(proc.kill)
            while not os.path.exists(path + ".ready"):  # the imports: ~10 s idle, minutes on a loaded machine
                if proc.poll() is not None:
                    raise RuntimeError(f"the fork server did not start (exit {proc.returncode})")
                time.sleep(0.05)
            _servers[_key(env)] = (proc, path, env)
        return _servers[_key(env)]


def _forkable(cmd, kw) -> bool:
    """cmd is `sys.executable [-u] SCRIPT.py ARGS` or `sys.executable [-u] -c CODE ARGS`, with arguments the fork
    server takes, and T2G_NO_FORKSERVER is not set."""
    if os.environ.get("T2G_NO_FORKSERVER") or set(kw) - RUN_KW:
        return False
    if not (isinstance(cmd, (list, tuple)) and len(cmd) >= 2 and cmd[0] == sys.executable):
        return False
    rest = [str(c) for c in cmd[1:]]
    rest = rest[1:] if rest[0] == "-u" and len(rest) > 1 else rest
    return rest[0].endswith(".py") or (rest[0] == "-c" and len(rest) >= 2)


def _env_differs(server_env: dict, env: dict) -> list[str]:
    keys = {k for k in set(server_env) | set(env) if _import_time(k)}
    return sorted(k for k in keys if server_env.get(k) != env.get(k))


def run(cmd, *, env=None, nested=False, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kw) for cmd = [sys.executable, SCRIPT.py, ARGS...] (or -c CODE, or -u), the script
    started by a fork of a process that already imported torch, transformers and peft. Anything else, and a command
    whose environment sets a variable read at import otherwise forks from a server of that environment.
    nested=True: the script's own subprocess.run of such commands (a bench starting the stages) is forked too."""
    full_env = dict(os.environ if env is None else env)
    if list(cmd[1:3]) == ["-m", "torch.distributed.run"] and kw.get("timeout") is None:
        return limited(cmd, TORCHRUN_LIMIT_S, env=env, **kw)  # a hung collective must not hang the suite
    if not _forkable(cmd, kw):
        return _subprocess_run(cmd, env=env, **kw)
    differs = _env_differs(_BASE_ENV, full_env)
    leaked = [k for k in differs if full_env.get(k) == os.environ.get(k) != _BASE_ENV.get(k)]
    if leaked:  # not asked for by this run: said once per run, in pytest's warnings summary
        warnings.warn(f"{', '.join(leaked)} changed in this worker since the tests started", ForkServerFallback)
    server = _start(full_env if differs else _BASE_ENV)
    if server is None:
        return _subprocess_run(cmd, env=env, **kw)
    return _run_forked(server[1], cmd, full_env, nested, **kw)


TORCHRUN_LIMIT_S = 1200  # a torchrun command of the tests at most: each takes ~10-45 s here, so only a hang gets there


def _descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun's ranks run in sessions of their own: a process group misses them)."""
    try:
        kids = [
            int(c)
            for t in os.listdir(f"/proc/{pid}/task")
            for c in open(f"/proc/{pid}/task/{t}/children").read().split()
        ]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def limited(cmd, limit: float, *, capture_output=False, check=False, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kw), but past `limit` seconds the command and every process below it are killed and an
    AssertionError says so, with the end of its stderr: a torchrun test whose ranks wait on a collective one of them
    never reaches (issue 80: FSDP with reshard_after_forward=False hung the suite with no output) fails, in time."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    with subprocess.Popen(cmd, **kw) as p:
        try:
            out, err = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            out, err = p.communicate()
            tail = (err if isinstance(err, str) else (err or b"").decode(errors="replace"))[-2000:]
            raise AssertionError(
                f"{' '.join(map(str, cmd[:4]))} ... ran past its limit of {limit:g} s (a hang: a rank waiting on a "
                f"collective another never reaches?), killed with every process below it; its stderr ended:\n{tail}"
            ) from None
    done = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _fd(spec, default: int, closers: list) -> int:
    if spec is None:
        return default
    if spec == subprocess.DEVNULL:
        f = open(os.devnull, "r+b")
        closers.append(f)
        return f.fileno()
    if isinstance(spec, int):
        return spec
    return spec.fileno()


def _run_forked(
    path, cmd, env, nested, capture_output=False, text=False, cwd=None, timeout=None, stdout=None, stderr=None,
    stdin=None, check=False,
):  # fmt: skip
    closers, captured = [], {}
    try:
        fds = [_fd(stdin if stdin is not None else subprocess.DEVNULL, 0, closers)]  # never the tests' own stdin
        for name, spec, default in (("stdout", stdout, 1), ("stderr", stderr, 2)):
            if capture_output or spec == subprocess.PIPE:
                f = tempfile.TemporaryFile()  # a file, not a pipe: nobody has to drain it while the child runs
                closers.append(f)
                captured[name] = f
                fds.append(f.fileno())
            elif spec == subprocess.STDOUT:
                fds.append(fds[1])
            else:
                fds.append(_fd(spec, default, closers))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            argv = [str(c) for c in cmd[1:]]
            request = json.dumps({"argv": argv, "cwd": str(cwd or os.getcwd()), "env": env, "nested": nested})
            request = request.encode()
            socket.send_fds(s, [len(request).to_bytes(8, "big") + request], fds)
            lines = _lines(s)
            pid = int(next(lines))
            s.settimeout(timeout)
            try:
                returncode = int(next(lines))
            except TimeoutError:
                os.kill(pid, 9)  # as subprocess.run does on a timeout: kill the child, then raise
                s.settimeout(None)
                next(lines, None)
                raise subprocess.TimeoutExpired(cmd, timeout, *_read(captured, text)) from None
        out, err = _read(captured, text)
    finally:
        for c in closers:
            c.close()
    proc = subprocess.CompletedProcess(cmd, returncode, out, err)
    if check:
        proc.check_returncode()
    return proc


def _lines(s: socket.socket):
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = s.recv(64)
            if not chunk:
                raise ConnectionError("the fork server went away")
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield line.decode()


def _read(captured: dict, text: bool):
    out = []
    for name in ("stdout", "stderr"):
        f = captured.get(name)
        if f is None:
            out.append(None)
            continue
        f.seek(0)
        data = f.read()
        out.append(data.decode() if text else data)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The server: import once, then fork one child per request and report its exit status
# ---------------------------------------------------------------------------------------------------------------------


def _serve(path: str) -> None:
    import importlib

    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            for module, attr in PRELOAD_ATTRS:
                getattr(sys.modules[module], attr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, target in zip(saved, (1, 2)):
                os.dup2(fd, target)
                os.close(fd)
        out.seek(0)
        err.seek(0)
        said = (out.read(), err.read())  # what the imports printed (a FutureWarning, say): each child prints it again
    pythonpath = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    base_path = [p for p in sys.path[1:] if p not in pythonpath]
    parent, waiting = os.getppid(), {}  # waiting: {pidfd: (pid, connection)} of the children still running
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(16)
        open(path + ".ready", "w").close()
        while os.getppid() == parent:  # the pytest process that started it is gone: so is the server
            ready, _, _ = select.select([listener, *waiting], [], [], 5)
            for fd in ready:
                if fd is listener:
                    conn, _ = listener.accept()
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                    size = int.from_bytes(msg[:8], "big")
                    msg = msg[8:]
                    while len(msg) < size:
                        msg += conn.recv(size - len(msg))
                    request = json.loads(msg)
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        conn.close()
                        for pidfd, (_, other) in waiting.items():
                            os.close(pidfd)
                            other.close()
                        _child(request, fds, base_path, said, path)  # never returns: it exits as the script does
                    for f in fds:
                        os.close(f)
                    conn.sendall(f"{pid}\n".encode())
                    waiting[os.pidfd_open(pid)] = (pid, conn)
                else:  # a child ended: its exit status to its client
                    pid, conn = waiting.pop(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    with conn:
                        try:
                            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                        except OSError:  # the client went away (its test timed out or was killed)
                            pass


def _child(request: dict, fds: list[int], base_path: list[str], said: tuple[bytes, bytes], path: str) -> None:
    import builtins
    import io
    import random
    import runpy
    import signal
    import traceback
    import types

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    unbuffered = argv[0] == "-u" or bool(os.environ.get("PYTHONUNBUFFERED"))
    script, *args = argv[1:] if argv[0] == "-u" else argv
    if script == "-c":  # python -c CODE ARGS: argv[0] is "-c", sys.path[0] the working directory
        source, *args = args
    sys.argv = [script, *args]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = "" if script == "-c" else os.path.dirname(os.path.realpath(script))
    sys.path[:] = [first, *map(os.path.abspath, pythonpath), *base_path]
    # stdout and stderr as the interpreter makes them: block-buffered stdout (line-buffered on a terminal),
    # line-buffered stderr, both unbuffered under -u or PYTHONUNBUFFERED
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    for stream, text in zip((sys.stdout, sys.stderr), said):  # as a fresh interpreter importing them would
        stream.buffer.write(text)
        stream.flush()
    random.seed()  # a fresh interpreter's generators start from the OS, not from the server's state
    sys.modules["numpy"].random.seed()
    sys.modules["torch"].seed()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if request["nested"]:  # the script's own `python X.py` runs: forks of this server too
        import subprocess as sp

        _servers.clear()  # the server's own, from its start (_BASE_ENV: its environment)
        _servers[_key(_BASE_ENV)] = (types.SimpleNamespace(poll=lambda: None), path, _BASE_ENV)
        sp.run = run
    _track_open()
    try:
        if script == "-c":
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__builtins__ = builtins
            exec(compile(source, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter reads it: None is 0, a number its code, anything else printed and 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # as the interpreter does: the traceback from the script's frames on, then exit 1
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename not in (script, "<string>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        code = 1
        if isinstance(e, KeyboardInterrupt):  # the interpreter ends by SIGINT then
            _shutdown()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    _shutdown()
    os._exit(code)


_opened = None  # the child's files opened with open() / io.open, flushed before it exits


def _track_open() -> None:
    import builtins
    import functools
    import io
    import weakref

    global _opened
    _opened = weakref.WeakSet()
    plain = io.open

    @functools.wraps(plain)
    def tracked(*args, **kw):
        f = plain(*args, **kw)
        _opened.add(f)
        return f

    builtins.open = io.open = staticmethod(tracked)  # as the builtin: never bound as a method (class X: open = open)


def _shutdown() -> None:
    """The interpreter's shutdown up to its module teardown: non-daemon threads joined, atexit run, files flushed.
    The teardown itself is skipped: in a fork it writes to every page the server shares (copy on write), which took
    13-15 s on the loaded 2-core machine, and a fresh interpreter's took 9 s."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for f in list(_opened):  # what teardown would close: files the script left open, written but not flushed
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    _serve(sys.argv[1])
