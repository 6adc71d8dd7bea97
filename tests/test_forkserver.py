"""tests/forkserver.py, which starts the tests' stage runs from a process that has already imported torch,
transformers and peft: a forked script must be the script a fresh interpreter runs (its exit code, stdout and stderr,
byte for byte), and what a fork cannot stand for gets a fresh interpreter."""

import os
import subprocess
import sys
import warnings

import forkserver
import pytest
from conftest import ROOT

SCRIPT = """import os, sys
print("argv", sys.argv, "cwd", os.getcwd(), "path0", sys.path[0], "X", os.environ.get("X"))
import helper  # from PYTHONPATH
print("helper", helper.WHERE)
left_open = open("unclosed.txt", "w")  # never closed: the interpreter's shutdown flushes it
left_open.write("flushed at exit")
case = sys.argv[1]
if case == "bad":
    print("error: --x 3: must be 1 or 2", file=sys.stderr)
    sys.exit(2)
if case == "message":
    sys.exit("a message instead of a code")
if case == "raise":
    def inner():
        raise ValueError("boom")
    inner()
"""


def both(tmp_path, cmd, **kw):
    """(fresh interpreter, fork) results of cmd, each in a folder of its own; as (returncode, stdout, stderr, file)."""
    out = []
    for name, run in (("fresh", subprocess.run), ("fork", forkserver.run)):
        cwd = tmp_path / name
        cwd.mkdir()
        proc = run(cmd, capture_output=True, text=True, cwd=cwd, **kw)
        unclosed = cwd / "unclosed.txt"
        out.append(
            (
                proc.returncode,
                proc.stdout.replace(str(cwd), "CWD"),
                proc.stderr,
                unclosed.is_file() and unclosed.read_text(),
            )
        )
    return out


@pytest.mark.parametrize("case", ["ok", "bad", "message", "raise"])
def test_a_forked_script_exits_and_prints_as_a_fresh_interpreter(tmp_path, case):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("WHERE = 'lib'\n")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "X": "set by the test", "PYTHONPATH": str(tmp_path / "lib")}
    fresh, fork = both(tmp_path, [sys.executable, str(script), case], env=env)
    assert fork == fresh
    assert fork[0] == {"ok": 0, "bad": 2, "message": 1, "raise": 1}[case]
    assert fork[3] == "flushed at exit"
    if case == "raise":
        assert fork[2].startswith("Traceback (most recent call last):\n") and fork[2].endswith("ValueError: boom\n")


def test_python_dash_c_is_forked_too(tmp_path):
    code = "import sys; print(sys.argv, repr(sys.path[0])); sys.exit(int(sys.argv[1]))"
    fresh, fork = both(tmp_path, [sys.executable, "-c", code, "3"])
    assert fork == fresh and fork[:2] == (3, "['-c', '3'] ''\n")


@pytest.mark.parametrize(
    "script,argv,line",
    [
        ("01_annotate.py", ["--dataset", "gone.jsonl"], "error: gone.jsonl: no such file"),
        ("02_train_reward.py", ["--data", "gone.jsonl"], "error: --model runs/demo/base: no such directory"),
        ("03_train_policy.py", ["--temperature", "0"], "error: --temperature 0: must be "),
        ("04_evaluate.py", ["--data", "gone.jsonl"], "error: gone.jsonl: no such file"),
    ],
)
def test_each_stages_bad_input_is_the_same_exit_2_and_line_forked_or_fresh(tmp_path, script, argv, line):
    """The suite's bad-input tests run their stage through the fork server; here each stage also runs in a fresh
    interpreter, as a user starts it: the same exit code 2 and the same one line on stderr."""
    fresh, fork = both(tmp_path, [sys.executable, str(ROOT / script), *argv])
    assert fork[:3] == fresh[:3]
    assert fork[0] == 2 and len(fork[2].strip().splitlines()) == 1 and fork[2].startswith(line), fork


@pytest.mark.parametrize("flag", [[], ["-u"]])
def test_stdout_and_stderr_are_buffered_as_in_a_fresh_interpreter(tmp_path, flag):
    """Block-buffered stdout and line-buffered stderr (both unbuffered under -u), into one file: the same order."""
    code = "import sys\nfor i in range(3):\n    print('out', i)\n    print('err', i, file=sys.stderr)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = []
    for run in (subprocess.run, forkserver.run):
        proc = run([sys.executable, *flag, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out.append(proc.stdout.decode())
    assert out[0] == out[1] and out[0].startswith("out 0\nerr 0\n" if flag else "err 0\nerr 1\n"), out


def test_nested_runs_fork_the_scripts_own_python_runs_too(tmp_path):
    """A bench started with nested=True starts its stages (`python -u X.py`) as forks of the server as well."""
    code = (
        "import os, subprocess, sys\n"
        "child = subprocess.run([sys.executable, '-u', '-c', 'import os; print(os.getppid())'], capture_output=True)\n"
        "print(os.getpid(), child.stdout.decode().strip(), child.returncode)"
    )
    for nested in (False, True):
        me, parent, code_ = forkserver.run(
            [sys.executable, "-c", code], capture_output=True, text=True, nested=nested, env=dict(forkserver._BASE_ENV)
        ).stdout.split()
        assert code_ == "0" and (me != parent) == nested


def test_a_nested_run_that_cannot_fork_is_a_plain_subprocess(tmp_path):
    """Inside a nested run subprocess.run is the fork server's run: a command it cannot fork (not python, python -m)
    falls back to the real subprocess.run, not to itself (it recursed until RecursionError)."""
    code = (
        "import subprocess, sys\n"
        "print(subprocess.run(['echo', 'plain'], capture_output=True, text=True).stdout.strip())\n"
        "print(subprocess.run([sys.executable, '-m', 'this'], capture_output=True).returncode)\n"
    )
    proc = forkserver.run(
        [sys.executable, "-c", code], capture_output=True, text=True, nested=True, env=dict(forkserver._BASE_ENV)
    )
    assert (proc.returncode, proc.stdout.split()) == (0, ["plain", "0"]), proc.stderr[-2000:]


def test_each_fork_draws_fresh_random_numbers(tmp_path):
    """A fork copies the server's generators: each child reseeds them from the OS, as a fresh interpreter starts."""
    code = "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.rand(1).item())"
    draws = [forkserver.run([sys.executable, "-c", code], capture_output=True, text=True).stdout for _ in range(2)]
    assert all(a != b for a, b in zip(*(d.split() for d in draws))), draws


def test_a_variable_read_at_import_gets_a_server_of_its_own(monkeypatch):
    """HF_HUB_OFFLINE is fixed in huggingface_hub's constants when it is imported, which the base server did without
    it: a run that sets it forks from a server started with it (a fork of the base one would see it unset), and
    every run under T2G_NO_FORKSERVER is a fresh interpreter."""
    code = "import os; from huggingface_hub import constants; print(constants.HF_HUB_OFFLINE, os.getppid())"
    run = lambda env: forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout  # noqa: E731
    base = dict(forkserver._BASE_ENV)  # the server's: what another test of this worker may have leaked is not in it
    # room for its server, whatever servers this worker's earlier tests started (CI: credit_k4's pinned ones filled it)
    monkeypatch.setattr(forkserver, "MAX_SERVERS", len(forkserver._servers) + 1)
    with warnings.catch_warnings():  # asked for by the run itself: no warning
        warnings.simplefilter("error", forkserver.ForkServerFallback)
        offline, parent = run({**base, "HF_HUB_OFFLINE": "1"}).split()
        online, base_parent = run(base).split()
    assert (offline, online) == ("True", "False") and len({int(parent), int(base_parent), os.getpid()}) == 3
    assert run({**base, "HF_HUB_OFFLINE": "1"}).split()[1] == parent  # the same server again
    monkeypatch.setenv("T2G_NO_FORKSERVER", "1")
    assert int(run(base).split()[1]) == os.getpid()


def test_a_pinned_cpu_kernel_path_is_the_forks_own():
    """torch fixes its CPU kernel path (ATEN_CPU_CAPABILITY) at its first kernel: a bench that pins it (credit_k4)
    gets it in every stage it starts, from a server that never ran under another path (a fork of the base server
    holds only as long as no import there runs a kernel)."""
    code = "import os, torch; torch.ones(2).exp(); print(torch.backends.cpu.get_cpu_capability(), os.getppid())"
    run = lambda env: forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)  # noqa: E731
    pinned, base = run({**forkserver._BASE_ENV, "ATEN_CPU_CAPABILITY": "default"}), run(dict(forkserver._BASE_ENV))
    assert pinned.stdout.split()[0] == "DEFAULT", pinned.stderr[-2000:]
    assert pinned.stdout.split()[1] != base.stdout.split()[1]  # another server


def test_past_the_servers_limit_a_run_is_a_fresh_interpreter(monkeypatch):
    monkeypatch.setattr(forkserver, "MAX_SERVERS", len(forkserver._servers))
    code = [sys.executable, "-c", "import os; print(os.getppid())"]
    env = {**forkserver._BASE_ENV, "HF_HUB_OFFLINE": "another"}
    assert int(forkserver.run(code, capture_output=True, text=True, env=env).stdout) == os.getpid()


def test_a_variable_leaked_into_the_workers_environment_is_reported(monkeypatch):
    """Twice a library's import-time variable, set in a worker's own environment, sent the rest of that worker's
    runs to fresh interpreters and nothing said so: it is a warning in pytest's summary (and now one server more)."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "leaked")
    code = [sys.executable, "-c", "import os; print(os.environ['TOKENIZERS_PARALLELISM'])"]
    with pytest.warns(forkserver.ForkServerFallback, match="TOKENIZERS_PARALLELISM changed in this worker"):
        assert forkserver.run(code, capture_output=True, text=True).stdout == "leaked\n"


@pytest.mark.parametrize(
    "key, value",
    [("TORCHINDUCTOR_CACHE_DIR", None), ("HF_XET_HIGH_PERFORMANCE", "1"), ("KMP_INIT_AT_FORK", "FALSE")],
)
def test_what_libraries_set_in_the_tests_own_process_still_forks(key, value):
    """torch's inductor writes TORCHINDUCTOR_CACHE_DIR into os.environ the first time its cache folder is asked for
    (called here for real); lm_eval and alpaca_eval set the others at import (set here as they do). After any test
    that did so, every run of that worker went to a fresh interpreter: the fork server's gain lost under xdist, and
    this module's tests failed in the suite but not alone."""
    if value is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        value = os.environ.get(key) or (cache_dir(), os.environ[key])[1]
    env = {**forkserver._BASE_ENV, key: value}
    out = forkserver.run(
        [sys.executable, "-c", "import os; print(os.getppid())"], capture_output=True, text=True, env=env
    )
    assert int(out.stdout) != os.getpid()


def test_a_timeout_kills_the_child_as_subprocess_does(tmp_path):
    code = "import time; open('started', 'w').close(); time.sleep(3600)"
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, "-c", code], cwd=tmp_path, timeout=1, capture_output=True)
    assert forkserver.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout == "1\n"


@pytest.mark.slow  # a real torchrun (its start, then the limit)
def test_a_hung_torchrun_fails_at_its_limit_with_a_message_and_leaves_no_rank_behind(tmp_path, monkeypatch):
    """Issue 80, item 8: with reshard_after_forward=False tests/test_fsdp.py's stage-3 test hung with no output. A
    torchrun command of the tests now runs under forkserver.TORCHRUN_LIMIT_S (20 minutes; each takes ~10-45 s): a
    rank that never returns is killed with the launcher, and the test fails saying so."""
    from conftest import torchrun

    script = tmp_path / "hang.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(str(os.getpid()))\n"
        "print('rank up', file=sys.stderr, flush=True)\n"
        "time.sleep(3600)\n"
    )
    monkeypatch.setattr(forkserver, "TORCHRUN_LIMIT_S", 30)  # its start: ~5-15 s here
    with pytest.raises(AssertionError, match=r"ran past its limit of 30 s \(a hang") as e:
        forkserver.run([*torchrun(2), str(script), str(tmp_path)], capture_output=True, text=True)
    assert "rank up" in str(e.value)  # the end of its stderr
    pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()]
