"""The sandbox for model-written code: run_sandboxed runs untrusted code under every isolation layer this machine
offers, and run_tests_sandboxed runs a solution's tests there with a verdict the code cannot forge. The code task
(tasks/code.py) runs every completion through it: 01's and 03's program critic, 04's pass@k. Nothing here imports the
rest of the project.
"""

from __future__ import annotations

import ast
import json
import os
import re
import tempfile
import threading
from pathlib import Path

# A tiny launcher (trusted code, no preexec_fn: safe from threads) sets the sandbox up and forks; the child applies the
# per-process layers and execs the command, the launcher stays behind as its supervisor. Layers:
#   always       a fresh temp dir as cwd/HOME/TMPDIR; an allowlisted environment (no keys, tokens or proxies); rlimits
#                on address space, CPU time, file size and core dumps; output kept head and tail; at the time limit and
#                when the command ends, every process it started is killed (see the last three layers).
#   landlock     (Linux >= 5.13, detected at run time) writes only inside the temp dir; reads only the Python
#                installation, system libraries, /dev, /proc and /sys; no TCP bind/connect (ABI >= 4); no signals or
#                abstract sockets outside the sandbox (ABI >= 6); other processes' /proc/PID/environ out of reach.
#   no-capabilities   as root, every capability is dropped (uid 0 stays so an interpreter under /root stays readable).
#   pid-namespace     the command is PID 1 of its own namespace: when it ends or is killed, the kernel kills every
#                process left in it, setsid() and double forks included. Fallback "subreaper": the supervisor adopts
#                orphans and kills all its descendants.
#   seccomp-no-sockets   socket() of every family, and io_uring, fail with EACCES: no TCP, UDP, ICMP or unix socket
#                reaches the host, not even one at a path (/var/run/docker.sock), which no network namespace hides.
#                socketpair() stays (asyncio, multiprocessing.Pipe). For x86-64 and arm64.
#   no-network   also a network namespace with no interface up, where namespaces are allowed.
#   pids-cgroup  a cgroup with pids.max (v2 or v1, where writable): a fork bomb stops at SANDBOX_MAX_PROCESSES.
#                Fallback "nproc-rlimit" (not for root, whom the kernel exempts from RLIMIT_NPROC).
# A layer the machine lacks is skipped with a RuntimeWarning (once) and result["sandbox"] lists the layers applied. A
# layer that was detected but fails to apply runs nothing: RuntimeError.

SANDBOX_MAX_PROCESSES = 64  # pids.max / RLIMIT_NPROC of one run: tests may start a few processes, not a fork bomb


_SAFE_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT")  # an allowlist: nothing secret-looking can leak
_SANDBOX_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONUNBUFFERED": "1",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # third-party pytest plugins cost ~2 s of startup
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_LL_READ, _LL_FILE_RW, _LL_ALL = 1 | 4 | 8, 2 | 4 | 1 << 14, (1 << 16) - 1  # exec+read file+read dir; rw+truncate
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py").read_text(encoding="utf-8")  # run as `python -c` text
_LANDLOCK_ABI = None
_NAMESPACES = None
_PIDS_CGROUP = None
_PROBING = threading.Lock()  # the probes below run once per process, also when the first runs start from threads


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (not Linux, kernel < 5.13, or Landlock disabled)."""
    global _LANDLOCK_ABI
    with _PROBING:  # set once, complete: a thread that saw a half-done probe would run without Landlock
        if _LANDLOCK_ABI is None:
            abi = 0
            if os.uname().sysname == "Linux":
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall.restype = ctypes.c_long
                abi = max(0, libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))
            _LANDLOCK_ABI = abi
    return _LANDLOCK_ABI


def sandbox_namespaces() -> int:
    """Clone flags for a PID + network namespace (plus a user namespace when not root) if this machine allows them,
    else 0. Probed once, in a throwaway process."""
    global _NAMESPACES
    with _PROBING:
        if _NAMESPACES is None:
            flags = _CLONE_NEWPID | _CLONE_NEWNET | (0 if os.geteuid() == 0 else _CLONE_NEWUSER)
            probe = (
                f"import ctypes, os, sys\nif ctypes.CDLL(None).unshare({flags}) != 0: sys.exit(1)\n"
                f"if {flags} & {_CLONE_NEWUSER}:\n    open('/proc/self/setgroups', 'w').write('deny')\n"
                f"    open('/proc/self/uid_map', 'w').write(f'{{os.geteuid()}} {{os.geteuid()}} 1')\n"
                "sys.exit(0 if os.fork() == 0 else os.waitstatus_to_exitcode(os.wait()[1]))\n"
            )
            _NAMESPACES = flags if os.uname().sysname == "Linux" and _probe_ok(probe) else 0
    return _NAMESPACES


def _probe_ok(code: str) -> bool:
    """Does `code` exit 0 in a fresh interpreter?"""
    import subprocess
    import sys

    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _pids_cgroup_parent() -> str | None:
    """A cgroup directory (v2, or v1's pids controller) under which this process may create a child cgroup, set its
    pids.max and move a process into it; or None. Probed once, with a throwaway cgroup and process."""
    global _PIDS_CGROUP
    with _PROBING:
        if _PIDS_CGROUP is None:
            _PIDS_CGROUP = next((p for p in _cgroup_candidates() if _cgroup_works(p)), "")
    return _PIDS_CGROUP or None


def _cgroup_candidates() -> list[str]:
    try:
        mounts = [line.split(" - ")[1].split() + line.split()[4:5] for line in open("/proc/self/mountinfo")]
        own = [line.rstrip("\n").split(":", 2) for line in open("/proc/self/cgroup")]
    except (OSError, IndexError):
        return []
    return [
        os.path.join(mount, path.lstrip("/"))
        for fstype, _, options, mount in mounts
        for _, controllers, path in own
        if (fstype == "cgroup2" and controllers == "")
        or (fstype == "cgroup" and "pids" in controllers.split(",") and "pids" in options.split(","))
    ]


def _cgroup_works(parent: str) -> bool:
    probe = os.path.join(parent, f"t2g-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        Path(probe, "pids.max").write_text("8")
        return _probe_ok(f"open({os.path.join(probe, 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))")
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def _seccomp_target() -> list | None:
    """[audit arch, socket syscall number] for the seccomp network filter, where this architecture is known."""
    return {"x86_64": [0xC000003E, 41], "aarch64": [0xC00000B7, 198]}.get(os.uname().machine)


def _landlock_rules(work: str) -> list:
    """[path, rights]: read the interpreter and system libraries, read+write /dev/null, everything inside `work`."""
    import site
    import sys

    reads = [
        "/usr",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/bin",
        "/sbin",
        "/dev",
        "/proc",
        "/sys",
        "/etc/ld.so.cache",
        "/etc/localtime",
        "/etc/passwd",
        "/etc/group",
        "/etc/nsswitch.conf",
        "/etc/os-release",
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *getattr(site, "getsitepackages", list)(),
        site.getusersitepackages(),
    ]
    return [[p, _LL_READ] for p in dict.fromkeys(reads) if os.path.exists(p)] + [
        ["/dev/null", _LL_FILE_RW],
        [work, _LL_ALL],
    ]


def _own_processes() -> int:
    """How many processes this uid runs (RLIMIT_NPROC counts them all, not just the sandbox's)."""
    uid, n = os.geteuid(), 0
    for d in os.listdir("/proc"):
        try:
            n += d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid
        except OSError:
            pass
    return n


def _sandbox_plan(work: str, timeout_s: float, memory_mb: int) -> tuple[dict, list[str], list[str]]:
    """(launcher config, layers applied, layers missing) for one run on this machine."""
    linux, root = os.uname().sysname == "Linux", os.geteuid() == 0
    abi, clone = landlock_abi(), sandbox_namespaces() if linux else 0
    cgroup_parent = _pids_cgroup_parent() if linux else None
    seccomp = _seccomp_target() if linux else None
    cpu = int(timeout_s) + 2
    rlimits = {
        "RLIMIT_AS": [memory_mb << 20] * 2,
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_FSIZE": [64 << 20] * 2,
        "RLIMIT_CORE": [0, 0],
    }
    nproc = linux and not cgroup_parent and not root
    if nproc:
        rlimits["RLIMIT_NPROC"] = [_own_processes() + SANDBOX_MAX_PROCESSES] * 2
    config = {
        "landlock_abi": abi,
        "rules": _landlock_rules(work) if abi else [],
        "clone": clone,
        "cgroup": None,
        "seccomp": seccomp,
        "drop_caps": linux and (root or bool(clone & _CLONE_NEWUSER)),
        "rlimits": rlimits,
        "pass_fds": [],
    }
    layers = {
        f"landlock-v{abi}": abi,
        "no-capabilities": config["drop_caps"],
        "pid-namespace": clone,
        "subreaper": linux and not clone,
        "no-network": clone,
        "seccomp-no-sockets": seccomp,
        "pids-cgroup": cgroup_parent,
        "nproc-rlimit": nproc,
    }
    missing = [
        name
        for name, ok in (
            ("landlock", abi),
            ("pid-namespace", clone),
            ("no-sockets", seccomp),
            ("process-limit", cgroup_parent or nproc),
        )
        if not ok
    ]
    return config, [name for name, ok in layers.items() if ok], missing


_WARNED = set()


def _kill(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Streams:
    """stdout and stderr of a process, read as they come: the first and last `limit` / 2 bytes of each are kept (a
    verdict or a traceback sits at the end), the middle is counted and dropped, so endless output costs no memory."""

    def __init__(self, proc, limit: int):
        import selectors

        self.half, self.fds = limit // 2, [proc.stdout.fileno(), proc.stderr.fileno()]
        self.head, self.tail, self.cut = (
            {fd: b"" for fd in self.fds},
            {fd: b"" for fd in self.fds},
            dict.fromkeys(self.fds, 0),
        )
        self.files = {proc.stdout.fileno(): proc.stdout, proc.stderr.fileno(): proc.stderr}
        self.sel, self.open = selectors.DefaultSelector(), set(self.fds)
        for fd in self.fds:
            self.sel.register(fd, selectors.EVENT_READ)

    def drain(self, deadline: float) -> bool:
        """Read until both streams are closed (True) or `deadline` (time.monotonic) passes (False)."""
        import time

        while self.open and (left := deadline - time.monotonic()) > 0:
            for key, _ in self.sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    self.close(key.fd)
                    continue
                room = self.half - len(self.head[key.fd])
                self.head[key.fd] += chunk[: max(room, 0)]
                tail = self.tail[key.fd] + chunk[max(room, 0) :]
                self.cut[key.fd] += max(0, len(tail) - self.half)
                self.tail[key.fd] = tail[-self.half :] if self.half else b""
        return not self.open

    def close(self, *fds) -> None:
        for fd in fds or list(self.open):
            self.sel.unregister(fd)
            self.open.discard(fd)
            self.files[fd].close()

    def text(self, fd: int, strip: list[str]) -> str:
        """What was kept, decoded, with a note where the middle was cut, and `strip` prefixes (temp paths) removed."""
        note = f"\n[... {self.cut[fd]} bytes cut ...]\n" if self.cut[fd] else ""
        text = (self.head[fd] + note.encode() + self.tail[fd]).decode("utf-8", "replace")
        for prefix in strip:
            text = text.replace(prefix, "")
        return text


def run_sandboxed(
    files: dict[str, str],
    command: list[str],
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_chars: int = 10_000,
    pass_fds: tuple[int, ...] = (),
) -> dict:
    """Run untrusted code: `files` are written to a fresh temp dir and `command` runs there under the layers listed
    above, with a wall-clock limit after which every process it started is killed. `pass_fds` are inherited by the
    command (the test runner's private channel). Returns {"returncode", "stdout", "stderr", "timed_out",
    "duration_s", "sandbox"}: stdout/stderr keep their head and tail, "sandbox" lists the layers applied. Raises
    RuntimeError if the sandbox itself cannot be set up (the code then never runs)."""
    import shutil
    import signal
    import subprocess
    import sys
    import time
    import warnings

    with tempfile.TemporaryDirectory(prefix="t2g-sandbox-", ignore_cleanup_errors=True) as work:
        config, layers, missing = _sandbox_plan(work, timeout_s, memory_mb)
        if missing and tuple(missing) not in _WARNED:
            _WARNED.add(tuple(missing))
            warnings.warn(
                f"sandbox layers unavailable on this machine: {', '.join(missing)}"
                + (" (Landlock is unavailable: no filesystem confinement)" if "landlock" in missing else "")
                + f"; model-written code runs with: {', '.join(layers) or 'rlimits only'}",
                RuntimeWarning,
                stacklevel=2,
            )
        for name, text in files.items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"sandbox file names must stay inside its directory: {name!r}")
            path = Path(work, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        env = {k: os.environ[k] for k in _SAFE_ENV if k in os.environ}
        env.update(_SANDBOX_ENV, HOME=work, TMPDIR=work)
        cgroup = None
        if "pids-cgroup" in layers:
            cgroup = os.path.join(_pids_cgroup_parent(), f"t2g-{os.getpid()}-{os.urandom(4).hex()}")
            os.mkdir(cgroup)
            Path(cgroup, "pids.max").write_text(str(SANDBOX_MAX_PROCESSES))
        config.update(cgroup=cgroup, pass_fds=list(pass_fds))
        status_r, status_w = os.pipe()
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(status_w), json.dumps(config), *command],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_w, *pass_fds),
            )
        finally:
            os.close(status_w)
        streams = _Streams(proc, max_output_chars)
        timed_out = not streams.drain(start + timeout_s)
        if timed_out:  # ask for a stack dump (the supervisor forwards SIGUSR1), then kill everything the code started
            for sig, grace in ((signal.SIGUSR1, 0.5), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                _kill(proc.pid, sig)
                if streams.drain(time.monotonic() + grace):
                    break
        streams.close()  # a process that escaped every layer may still hold the pipes: stop listening
        proc.wait()
        duration = time.monotonic() - start
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # belt and braces: anything left in the session's process group
        except (ProcessLookupError, PermissionError):
            pass
        if cgroup:
            for _ in range(50):
                try:
                    os.rmdir(cgroup)
                    break
                except OSError:  # members still exiting
                    for pid in Path(cgroup, "cgroup.procs").read_text().split():
                        _kill(int(pid), signal.SIGKILL)
                    time.sleep(0.02)
        with os.fdopen(status_r, "rb") as f:
            setup_error = f.read().decode("utf-8", "replace")
        shutil.rmtree(work, ignore_errors=True)
    if setup_error:
        raise RuntimeError(f"sandbox could not start {command[0]!r}: {setup_error}")

    out, err = (streams.text(fd, [work + os.sep, os.path.realpath(work) + os.sep]) for fd in streams.fds)
    return {
        "returncode": proc.returncode,
        "stdout": out,
        "stderr": err,
        "timed_out": timed_out,
        "duration_s": duration,
        "sandbox": layers,
    }


# The test runner. Three styles, one verdict channel:
#   "pytest"       plain pytest files (test_* functions and Test* classes without fixtures, marks or hooks) run by a
#                  fast in-process runner with pytest's semantics: ~0.1 s instead of pytest's ~0.6 s startup.
#   "pytest-real"  files that use pytest features run under pytest itself, with a plugin that reports the outcomes.
#   "script"       benchmark tests (HumanEval's check(), MBPP's asserts) run in the solution's own namespace, exactly
#                  as the official harnesses exec `program + tests` in one namespace.
# The verdict never comes from the output or the exit status, which the code controls. The runner reads a per-run
# nonce and the test source from a private file descriptor before any solution code runs (then closes it), and writes
# the counts, tagged with the nonce, to a second descriptor: an unnamed file the code cannot open by path. A code that
# prints "N passed" or ends the process early yields no verdict: failed. The runner's state lives in closures, not in
# module globals. (What no in-process harness can rule out: code written against this runner's internals, walking the
# interpreter's frames to reach them. HumanEval's and EvalPlus's harnesses share that limit.)
# trace=True (the critic's second run, on failing code only) adds what fault localisation needs: every assert is its
# own test case and execution goes on after a failed one; per case, the solution lines it executed, the first call
# from the tests into the solution with its arguments and return value, and the expected and actual values.
# Both runners dump the stack on SIGUSR1 (sent at the time limit) to a copy of stderr, so the critic can name the line
# a hung test is stuck on.
_TEST_RUNNER = Path(__file__).with_name("sandbox_test_runner.py").read_text(encoding="utf-8")  # run as `python -c` text


TRACEBACK_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)', re.M)
_PYTEST_HOOKS = {
    "setup",
    "teardown",
    "setup_module",
    "teardown_module",
    "setup_function",
    "teardown_function",
    "setup_method",
    "teardown_method",
    "setup_class",
    "teardown_class",
    "__init__",
}


# CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread: two threads inside
# ast.parse at once (01's thread pool, under load) end in "SystemError: AST constructor recursion depth mismatch".
# Re-entrant: a collection inside ast.parse may run a finalizer that parses on the same thread.
_AST_LOCK = threading.RLock()


def parse_python(source: str) -> ast.Module:
    """ast.parse, one thread at a time (_AST_LOCK): what the critic and the sandbox parse, from any thread."""
    with _AST_LOCK:
        return ast.parse(source)


def _plain_tests(test: str) -> bool:
    """True when `test` needs nothing from pytest but collection: no pytest/unittest import, fixtures, marks, hooks."""
    try:
        tree = parse_python(test)
    except SyntaxError:
        return False  # let pytest report it
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if any(n.split(".")[0] in ("pytest", "_pytest", "unittest", "hypothesis") for n in names):
            return False

    def plain(fn, n_args: int) -> bool:
        return fn.name not in _PYTEST_HOOKS and not (
            fn.name.startswith("test")
            and (
                isinstance(fn, ast.AsyncFunctionDef)
                or fn.decorator_list
                or len(fn.args.args) != n_args
                or fn.args.vararg
                or fn.args.kwarg
                or fn.args.kwonlyargs
                or fn.args.posonlyargs
            )
        )

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not plain(node, 0):
            return False
        if (
            isinstance(node, ast.ClassDef)
            and node.name.startswith("Test")
            and (
                node.bases
                or node.keywords
                or node.decorator_list
                or not all(plain(f, 1) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
            )
        ):
            return False
    return True


def _reopen(f, flags: int) -> int:
    """A second descriptor on an open file, with other access rights (through /proc on Linux; else a duplicate)."""
    try:
        return os.open(f"/proc/self/fd/{f.fileno()}", flags | os.O_CLOEXEC)
    except OSError:
        return os.dup(f.fileno())


def run_tests_sandboxed(
    solution: str, test, timeout_s: float = 10.0, memory_mb: int = 1024, trace: bool = False, max_cases: int = 500
) -> dict:
    """Run `test` against `solution` in the sandbox. `test` is a pytest-style file that imports from `solution`
    (KodCode), or a benchmark test {"script": code run in the solution's namespace, "entry_point"?} (HumanEval, MBPP).
    Returns run_sandboxed's dict plus "status" ("passed" | "failed" | "timeout" | "error": the tests themselves cannot
    run), "passed", "counts" {"passed", "failed", "errors"} (None without a verdict), "problem_error", "output" (the
    test report) and, with trace=True, "cases" (per test case: ok, covered solution lines, call, values; see above)."""
    import secrets
    import sys

    if isinstance(test, dict):
        style, test_src = "script", test["script"]
    else:
        style, test_src = ("pytest" if _plain_tests(test) else "pytest-real"), test
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryFile() as settings, tempfile.TemporaryFile() as verdict:  # unnamed files: no path to open
        theirs = [_reopen(settings, os.O_RDONLY), _reopen(verdict, os.O_WRONLY | os.O_APPEND)]  # the runner's ends:
        try:  # it can neither rewrite its settings nor read the nonce back from what it reported
            settings.write(
                json.dumps(
                    {
                        "nonce": nonce,
                        "result_fd": theirs[1],
                        "style": style,
                        "trace": trace,
                        "test": test_src,
                        "max_cases": max_cases,
                        "entry_point": test.get("entry_point") if isinstance(test, dict) else None,
                    }
                ).encode()
            )
            settings.flush()
            result = run_sandboxed(
                {"solution.py": solution, "test_solution.py": test_src},
                [sys.executable, "-c", _TEST_RUNNER, str(theirs[0])],
                timeout_s=timeout_s,
                memory_mb=memory_mb,
                pass_fds=tuple(theirs),
            )
        finally:
            for fd in theirs:
                os.close(fd)
        verdict.seek(0)
        events = []
        for line in verdict.read().decode("utf-8", "replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("nonce") == nonce:  # anything else was written by the code
                events.append(event)
    summary = next((e["summary"] for e in events if "summary" in e), None)
    problem = next((e["problem_error"] for e in events if "problem_error" in e), None)
    result["passed"] = bool(summary and summary["passed"] > 0 and not summary["failed"] and not summary["errors"])
    result["status"] = (
        "error" if problem else "passed" if result["passed"] else "timeout" if result["timed_out"] else "failed"
    )
    result.update(
        counts=summary, problem_error=problem, output=_own_frames(result["stdout"] + "\n" + result["stderr"]).strip()
    )
    if trace:
        result["cases"] = [e["case"] for e in events if "case" in e]
    return result


def _own_frames(report: str) -> str:
    """A test report without the traceback frames of pytest, pluggy or the runner: only the two files' frames."""
    out, skipping = [], None
    for line in report.splitlines():
        indent = len(line) - len(line.lstrip())
        if skipping is not None and line.strip() and indent > skipping:
            continue  # the source and caret lines under a dropped frame
        m = TRACEBACK_FRAME.match(line)
        skipping = indent if m and m.group(1) not in ("solution.py", "test_solution.py") else None
        if skipping is None:
            out.append(line)
    return "\n".join(out)
