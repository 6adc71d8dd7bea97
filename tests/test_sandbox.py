"""tasks/sandbox.py: the sandbox for model-written code (run_sandboxed) and the test runner whose verdict the code
cannot forge (run_tests_sandboxed). The code critic built on them is tested in test_code.py."""

import os
import socket
import sys
import threading
import time

import pytest

from tasks import sandbox

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
needs_landlock = pytest.mark.skipif(not sandbox.landlock_abi(), reason="the kernel has no Landlock")
TESTS = (
    "from solution import add\n\ndef test_small():\n    assert add(1, 2) == 3\n\ndef test_big():\n"
    "    assert add(20, 22) == 42\n"
)
# Time limits. Code that ends by itself gets PATIENT seconds: far more than any load needs, and it costs nothing. Code
# that never ends gets hang_limit(): it must first get to its endless part, so the limit grows with the machine's load.
PATIENT = 120.0


def hang_limit(base: float) -> float:
    """`base` seconds plus ten times what a sandboxed test run takes right now (~0.15 s on an idle core, ~1.4 s with
    4% of one), so that a loaded machine leaves the code as much headroom as an idle one."""
    took = run_tests("def add(a, b):\n    return a + b\n", TESTS)["duration_s"]
    return round(base + 10 * took, 1)


def run_tests(solution: str, test, **kw) -> dict:
    return sandbox.run_tests_sandboxed(solution, test, **{"timeout_s": PATIENT, **kw})


def python(code: str, **kw) -> dict:
    return sandbox.run_sandboxed({"main.py": code}, [sys.executable, "main.py"], **{"timeout_s": PATIENT, **kw})


# ---------------------------------------------------------------------------------------------------------------------
# The verdict comes from the runner's report, never from the exit status
# ---------------------------------------------------------------------------------------------------------------------


def test_passed_needs_a_report_not_just_exit_code_zero():
    assert not run_tests("import os\nos._exit(0)\n", TESTS)["passed"]
    assert not run_tests("def add(a, b):\n    return a + b\n", "x = 1\n")["passed"]  # no tests
    assert run_tests("def add(a, b):\n    return a + b\n", TESTS)["passed"]


# ---------------------------------------------------------------------------------------------------------------------
# The fast runner keeps pytest's semantics; files that use pytest features run under real pytest
# ---------------------------------------------------------------------------------------------------------------------


def test_plain_test_files_take_the_fast_runner_and_the_rest_take_pytest():
    assert sandbox._plain_tests(TESTS)
    assert sandbox._plain_tests("class TestAdd:\n    def test_a(self):\n        assert True\n")
    for test in [
        "import pytest\ndef test_a():\n    pass\n",
        "def test_a(tmp_path):\n    pass\n",
        "def setup_module():\n    pass\n",
        "import unittest\nclass TestA(unittest.TestCase):\n    pass\n",
        "class TestA:\n    def setup_method(self):\n        pass\n",
        "def test_a(:\n",
    ]:
        assert not sandbox._plain_tests(test), test


@pytest.mark.parametrize(
    "solution,passed", [("def add(a, b):\n    return a + b\n", True), ("def add(a, b):\n    return a - b\n", False)]
)
def test_runner_and_pytest_agree(solution, passed):
    classes = "from solution import add\n\nclass TestAdd:\n    def test_one(self):\n        assert add(2, 2) == 4\n"
    fixture = (
        "import pytest\nfrom solution import add\n\n@pytest.mark.parametrize('a', [1, 2])\n"
        "def test_one(a):\n    assert add(a, a) == 2 * a\n"
    )
    for test in (TESTS, classes, fixture):
        result = run_tests(solution, test)
        assert result["passed"] is passed, result["output"]
        assert "site-packages" not in result["output"]  # only the two files' frames are kept
    if not passed:
        assert "assert 0 == 4" in run_tests(solution, classes)["output"]


# ---------------------------------------------------------------------------------------------------------------------
# Hostile code
# ---------------------------------------------------------------------------------------------------------------------


def test_no_secret_reaches_the_sandbox(monkeypatch):
    secret = "sk-test-" + os.urandom(8).hex()
    for name in ("OPENAI_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MY_PASSWORD", "PYTHONPATH"):
        monkeypatch.setenv(name, secret)
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for pid in (os.getppid(), 1):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n        print('denied', e)\n"
    )
    result = python(code)
    assert result["returncode"] == 0 and "HOME" in result["stdout"]
    assert secret not in result["stdout"] + result["stderr"]


@needs_landlock
def test_writes_outside_the_temp_dir_are_refused(tmp_path):
    outside = [tmp_path / "escape.txt", "/tmp/t2g-escape-test.txt", os.path.join(os.getcwd(), "escape.txt")]
    code = (
        "import os\nopen('inside.txt', 'w').write('ok')\nos.makedirs('sub/dir')\nprint('inside ok')\n"
        f"for path in {[str(p) for p in outside] + ['../escape.txt']!r}:\n"
        "    try:\n        open(path, 'w').write('escaped')\n        print('WROTE', path)\n"
        "    except OSError as e:\n        print('refused', path, e.errno)\n"
    )
    result = python(code)
    assert "inside ok" in result["stdout"] and "WROTE" not in result["stdout"], result
    for path in outside:
        assert not os.path.exists(path)


@needs_landlock
def test_reads_of_private_files_are_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    code = f"try:\n    print(open({str(secret)!r}).read())\nexcept OSError as e:\n    print('refused', e.errno)\n"
    result = python(code)
    assert "hunter2" not in result["stdout"] and "refused" in result["stdout"]


@pytest.mark.skipif(sandbox.landlock_abi() < 4, reason="Landlock TCP rules need ABI >= 4")
def test_network_and_signals_are_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = (
        "import os, socket\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e)\n"
        f"try:\n    os.kill({os.getpid()}, 0)\n    print('SIGNALLED')\n"
        "except OSError as e:\n    print('refused', e)\n"
    )
    try:
        result = python(code)
    finally:
        server.close()
    assert "CONNECTED" not in result["stdout"] and "refused" in result["stdout"]
    if sandbox.landlock_abi() >= 6:
        assert "SIGNALLED" not in result["stdout"]


@pytest.mark.skipif(not ROOT_USER, reason="capabilities are only dropped when running as root")
def test_root_keeps_no_capabilities():
    result = python("print(open('/proc/self/status').read())")
    caps = dict(line.split(":\t") for line in result["stdout"].splitlines() if line.startswith("Cap"))
    assert caps["CapEff"].strip() == caps["CapPrm"].strip() == caps["CapInh"].strip() == "0" * 16
    assert "NoNewPrivs:\t1" in result["stdout"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def test_output_is_truncated_and_paths_are_relative():
    result = python("import os\nprint('x' * 100000)\nprint(os.getcwd())\n", max_output_chars=500)
    assert len(result["stdout"]) < 600 and "t2g-sandbox-" in result["stdout"][-100:]  # head and tail kept
    result = python("raise ValueError('boom')\n")
    assert 'File "main.py", line 1' in result["stderr"] and "t2g-sandbox-" not in result["stderr"]


def test_sandbox_that_cannot_be_set_up_runs_nothing(monkeypatch, tmp_path):
    if not sandbox.landlock_abi():
        pytest.skip("the kernel has no Landlock")
    marker = tmp_path / "ran"
    monkeypatch.setattr(sandbox, "_landlock_rules", lambda work: [["/", 0]])  # an empty rule: the kernel refuses it
    with pytest.raises(RuntimeError, match="landlock|add_rule"):
        python(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert not marker.exists()


def test_the_first_runs_from_threads_all_get_landlock(monkeypatch):
    # 01 runs the critic from a thread pool, so the first sandbox runs probe the machine from several threads at once.
    # A thread must never see a half-done probe (the old probe stored 0 first: that run went without Landlock).
    if not sandbox.landlock_abi():
        pytest.skip("the kernel has no Landlock")
    import ctypes

    want, real_cdll = sandbox.landlock_abi(), ctypes.CDLL

    def slow_cdll(*args, **kw):  # widens the probe's window, so the race shows every time rather than now and then
        time.sleep(0.05)
        return real_cdll(*args, **kw)

    monkeypatch.setattr(ctypes, "CDLL", slow_cdll)
    monkeypatch.setattr(sandbox, "_LANDLOCK_ABI", None)
    barrier, got = threading.Barrier(4), []

    def probe():
        barrier.wait()
        got.append(sandbox.landlock_abi())

    threads = [threading.Thread(target=probe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4


def test_plain_tests_is_safe_from_two_threads():
    # 01 runs the code critic from a thread pool. CPython 3.11 keeps the AST constructor's recursion depth per
    # interpreter, so two threads inside ast.parse at once end in "SystemError: AST constructor recursion depth
    # mismatch" (3 of 6 HumanEval runs under load). A thread switch inside ast.parse needs Python code to run there:
    # a collection that calls a finalizer which gives up the GIL makes it happen every few calls, not now and then.
    import gc

    class GivesUpTheGil:
        def __del__(self):
            time.sleep(0)

    source = "from solution import f\n" + "".join(
        f"def test_{i}():\n    assert f({i}) == [{i}, ({i}, {{'k': {i}}})]\n" for i in range(40)
    )
    errors, threshold, interval = [], gc.get_threshold(), sys.getswitchinterval()

    def hammer():
        for _ in range(200):
            for _ in range(20):
                cycle = GivesUpTheGil()
                cycle.me = cycle  # garbage only a collection frees, finalizer included
            try:
                assert sandbox._plain_tests(source)
            except SystemError as e:
                errors.append(str(e))
                return

    gc.set_threshold(50)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
        gc.collect()
    assert errors == []


def test_without_landlock_it_still_runs_with_the_other_limits(monkeypatch):
    monkeypatch.setattr(sandbox, "_LANDLOCK_ABI", 0)
    with pytest.warns(RuntimeWarning, match="Landlock is unavailable"):
        result = python("import os\nprint(os.environ.get('OPENAI_API_KEY'), os.getcwd())\n")
        big = python("x = bytearray(2 * 1024 ** 3)\n", memory_mb=256)
    assert result["returncode"] == 0 and result["stdout"].startswith("None")
    assert not any(layer.startswith("landlock") for layer in result["sandbox"])
    assert big["returncode"] != 0 and "MemoryError" in big["stderr"]


# ---------------------------------------------------------------------------------------------------------------------
# Gaps closed by issue 14: escaping processes, fork bombs, non-TCP network, long output (forged verdicts: test_code.py)
# ---------------------------------------------------------------------------------------------------------------------


def _procs_with(marker: str) -> list[int]:
    """Live host pids whose command line holds `marker` (works whatever PID namespace they run in)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read() and _alive(int(d)):
                        found.append(int(d))
            except OSError:
                pass
    return found


def _wait_gone(marker: str, seconds: float = 60.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _procs_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(params=["namespaces", "fallback"])
def layers(request, monkeypatch):
    """Each hostile test runs twice: with this machine's namespaces, and with the fallbacks used where there are none
    (a subreaper that kills all descendants, a seccomp filter on sockets)."""
    if request.param == "namespaces" and not sandbox.sandbox_namespaces():
        pytest.skip("this machine allows no PID/network namespaces")
    if request.param == "fallback":
        monkeypatch.setattr(sandbox, "_NAMESPACES", 0)
    return request.param


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc scan")
@pytest.mark.parametrize("loop", [False, True])
def test_setsid_and_double_fork_survivors_are_killed(loop, layers):
    marker = "t2g-escapee-" + os.urandom(6).hex()
    code = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"  # in the group
        "if os.fork() == 0:\n"  # double fork + setsid: the grandchild leaves the session and process group
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "print('forked', flush=True)\n" + ("while True:\n    pass\n" if loop else "")
    )
    try:
        result = python(code, timeout_s=hang_limit(2.0) if loop else PATIENT)
        assert _wait_gone(marker) == []
        assert "forked" in result["stdout"] and result["timed_out"] is loop
        assert ("pid-namespace" if layers == "namespaces" else "subreaper") in result["sandbox"]
    finally:
        for pid in _procs_with(marker):  # never leave a stray process behind, even when the test fails
            os.kill(pid, 9)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process limits")
def test_fork_bomb_is_bounded():
    # A bounded bomb: it stops by itself at 300 processes, so on an unprotected sandbox the test fails, not the machine.
    marker = "t2g-bomb-" + os.urandom(6).hex()
    code = (
        "import os, sys, time\n"
        "n = 0\n"
        "for _ in range(300):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        f"    if pid == 0:\n        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    n += 1\n"
        "print('forked', n, flush=True)\n"
    )
    try:
        result = python(code, timeout_s=60.0)
        forked = int(result["stdout"].split()[1])
        assert forked <= sandbox.SANDBOX_MAX_PROCESSES, result
        assert any(layer.startswith("pids") or layer == "nproc-rlimit" for layer in result["sandbox"])
        assert _wait_gone(marker) == []
    finally:
        for pid in _procs_with(marker):
            os.kill(pid, 9)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces and seccomp are Linux's")
def test_udp_and_other_non_tcp_sockets_cannot_reach_out(layers, tmp_path):
    # host-side listeners: UDP, a unix socket at a path (as /var/run/docker.sock is: no network namespace hides it)
    # and an abstract unix socket
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix, abstract = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "host.sock"))
    abstract.bind("\0t2g-" + os.urandom(6).hex())
    for s in (udp, unix, abstract):
        s.setblocking(False)
    for s in (unix, abstract):
        s.listen()
    code = (
        "import asyncio, socket\n"
        "def attempt(name, family, kind, addr):\n"
        "    try:\n"
        "        s = socket.socket(family, kind)\n"
        "        s.sendto(b'leak', addr) if kind == socket.SOCK_DGRAM else s.connect(addr)\n"
        "        print('REACHED', name)\n"
        "    except OSError as e:\n"
        "        print('refused', name, e)\n"
        f"attempt('udp', socket.AF_INET, socket.SOCK_DGRAM, {udp.getsockname()!r})\n"
        f"attempt('unix', socket.AF_UNIX, socket.SOCK_STREAM, {unix.getsockname()!r})\n"
        f"attempt('abstract', socket.AF_UNIX, socket.SOCK_STREAM, {abstract.getsockname()!r})\n"
        "a, b = socket.socketpair()\n"  # local pairs stay: asyncio's self-pipe, multiprocessing.Pipe
        "a.sendall(b'ok')\n"
        "print('pair', b.recv(2), asyncio.run(asyncio.sleep(0, 'loop')))\n"
    )
    try:
        result = python(code)
        arrived = []  # whatever got through is queued by now: the sandboxed code has ended
        for name, take in (("udp", lambda: udp.recv(100)), ("unix", unix.accept), ("abstract", abstract.accept)):
            try:
                arrived.append((name, take()))
            except BlockingIOError:
                pass
    finally:
        for s in (udp, unix, abstract):
            s.close()
    assert arrived == [] and "REACHED" not in result["stdout"], result
    assert result["stdout"].count("refused") == 3 and "pair b'ok' loop" in result["stdout"], result
    assert "seccomp-no-sockets" in result["sandbox"] and ("no-network" in result["sandbox"]) is (layers == "namespaces")


def test_a_correct_solution_that_prints_a_lot_still_passes():
    result = run_tests("print('x' * 20000)\ndef add(a, b):\n    return a + b\n", TESTS)
    assert result["passed"], result["output"][-500:]
    long = python("print('head')\nprint('x' * 50000)\nprint('tail')\n", max_output_chars=1000)
    assert long["stdout"].startswith("head") and long["stdout"].rstrip().endswith("tail")
    assert len(long["stdout"]) <= 1100 and "bytes cut" in long["stdout"]


# ---------------------------------------------------------------------------------------------------------------------
# The verdict channel: a private descriptor the code cannot read the nonce back from
# ---------------------------------------------------------------------------------------------------------------------


def test_code_cannot_read_the_nonce_back_from_the_verdict_channel():
    # a thread that polls every descriptor for the runner's nonce and, once seen, writes a passing summary with it
    spy = (
        "import os, re, threading, time\n"
        "def spy():\n"
        "    for _ in range(2000):\n"
        "        for fd in range(3, 32):\n"
        "            try:\n"
        "                os.lseek(fd, 0, 0)\n"
        '                m = re.search(rb\'"nonce": "(\\w+)"\', os.read(fd, 1 << 16))\n'
        "            except OSError:\n"
        "                continue\n"
        "            if m:\n"
        '                line = b\'{"nonce": "\' + m.group(1) + b\'", "summary": {"passed": 9, "failed": 0, \'\n'
        "                os.write(fd, line + b'\"errors\": 0}}\\n')\n"
        "                return\n"
        "        time.sleep(0.001)\n"
        "threading.Thread(target=spy, daemon=True).start()\n"
        "def add(a, b):\n    time.sleep(0.2)\n    return a - b\n"
    )
    result = run_tests(spy, TESTS, trace=True)  # trace mode reports as it goes
    assert result["counts"] == {"passed": 0, "failed": 2, "errors": 0}, result["counts"]
