"""The sandbox for model-written code (common.run_sandboxed / run_tests_sandboxed) and the code critic built on it."""
import os
import socket
import sys
import threading
import time

import pytest

import common

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
needs_landlock = pytest.mark.skipif(not common.landlock_abi(), reason="the kernel has no Landlock")
TESTS = "from solution import add\n\ndef test_small():\n    assert add(1, 2) == 3\n\ndef test_big():\n" \
        "    assert add(20, 22) == 42\n"
# Time limits. Code that ends by itself gets PATIENT seconds: far more than any load needs, and it costs nothing. Code
# that never ends gets hang_limit(): it must first get to its endless part, so the limit grows with the machine's load.
PATIENT = 120.0


def hang_limit(base: float) -> float:
    """`base` seconds plus ten times what a sandboxed test run takes right now (~0.15 s on an idle core, ~1.4 s with
    4% of one), so that a loaded machine leaves the code as much headroom as an idle one."""
    took = run_tests("def add(a, b):\n    return a + b\n", TESTS)["duration_s"]
    return round(base + 10 * took, 1)


def critic(code: str, test: str = TESTS, timeout_s: float = PATIENT) -> dict:
    fb = common.code_critic("Write add(a, b).", code, test, timeout_s=timeout_s)
    good, poor, unmatched = common.locate_spans(code, fb["good_spans"], fb["poor_spans"])
    assert unmatched == [] and len(good) == len(fb["good_spans"]) and len(poor) == len(fb["poor_spans"])
    for quote in fb["good_spans"] + fb["poor_spans"]:  # exact quotes, never paraphrases
        assert quote in code
    return fb


def run_tests(solution: str, test, **kw) -> dict:
    return common.run_tests_sandboxed(solution, test, **{"timeout_s": PATIENT, **kw})


def python(code: str, **kw) -> dict:
    return common.run_sandboxed({"main.py": code}, [sys.executable, "main.py"], **{"timeout_s": PATIENT, **kw})


# ---------------------------------------------------------------------------------------------------------------------
# The code critic on code that passes, fails an assertion, raises, loops forever, or allocates without bound
# ---------------------------------------------------------------------------------------------------------------------


def test_critic_passing_code_praises_the_result_line():
    fb = critic("def add(a, b):\n    total = a + b\n    return total\n")
    assert fb["critique"].startswith("All 2 unit tests pass") and "`add`" in fb["critique"]
    assert fb["good_spans"] == ["return total"] and fb["poor_spans"] == []


def test_critic_names_the_failing_assertion_and_quotes_the_wrong_line():
    code = "def add(a, b):\n    if a > 10:\n        return a - b\n    return a + b\n"
    fb = critic(code)
    assert "`test_big`" in fb["critique"] and "assert add(20, 22) == 42" in fb["critique"]
    assert "assert -2 == 42" in fb["critique"]  # the runner explains the comparison, like pytest's rewriting
    assert fb["poor_spans"] == ["return a - b"] and fb["good_spans"] == []  # only test_big runs it: Ochiai 1.0


def test_critic_names_the_raising_line():
    fb = critic("def add(a, b):\n    values = [a, b]\n    return values[0] + values[2]\n")
    assert "IndexError" in fb["critique"] and "line 3" in fb["critique"]
    assert fb["poor_spans"] == ["return values[0] + values[2]"]


def test_critic_stops_an_endless_loop_and_quotes_it():
    code = "def add(a, b):\n    n = 0\n    while n != -1:\n        n += 2\n    return a + b\n"
    limit = hang_limit(1.0)
    fb = critic(code, timeout_s=limit)  # returns at all: the loop was stopped
    assert fb["status"] == "timeout" and f"did not finish within {limit:g} s" in fb["critique"]
    assert "`test_small`" in fb["critique"] and "while n != -1:" in fb["poor_spans"]  # from the stack at the limit


def test_critic_reports_unbounded_allocation():
    # bytes(n) is calloc'd: the address-space limit is hit at once, without touching (slow) pages
    code = "def add(a, b):\n    hoard = []\n    while True:\n        hoard.append(bytes(10 ** 8))\n"
    fb = critic(code)
    assert "out of memory" in fb["critique"] and "hoard.append(bytes(10 ** 8))" in fb["poor_spans"]


def test_critic_on_syntax_errors_signatures_missing_code_and_fenced_answers():
    fb = critic("def add(a, b)\n    return a + b\n")
    assert "does not compile" in fb["critique"] and fb["poor_spans"] == ["def add(a, b)"]
    fb = critic("def add(a):\n    return a\n")
    assert "TypeError" in fb["critique"] and fb["poor_spans"] == ["def add(a):"]
    assert critic("Sorry, I cannot help.\n")["poor_spans"] == ["Sorry, I cannot help."]  # prose does not compile
    assert critic("")["critique"] == "The response contains no code to test."
    answer = "Here is my solution:\n```python\ndef add(a, b):\n    return a * b\n```\nIt multiplies.\n"
    fb = critic(answer)  # the quote comes from inside the fence, located in the whole response
    assert fb["poor_spans"] == ["return a * b"] and answer.index("return a * b") > answer.index("```python")


def test_critic_makes_repeated_lines_unambiguous():
    code = "def sub(a, b):\n    return a + b\n\ndef add(a, b):\n    return a - b\n"
    test = "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    fb = critic(code, test)
    _, poor, _ = common.locate_spans(code, [], fb["poor_spans"])
    assert code[poor[0][0]:poor[0][1]].endswith("return a - b")


def test_passed_needs_a_report_not_just_exit_code_zero():
    assert not run_tests("import os\nos._exit(0)\n", TESTS)["passed"]
    assert not run_tests("def add(a, b):\n    return a + b\n", "x = 1\n")["passed"]  # no tests
    assert run_tests("def add(a, b):\n    return a + b\n", TESTS)["passed"]


# ---------------------------------------------------------------------------------------------------------------------
# The fast runner keeps pytest's semantics; files that use pytest features run under real pytest
# ---------------------------------------------------------------------------------------------------------------------


def test_plain_test_files_take_the_fast_runner_and_the_rest_take_pytest():
    assert common._plain_tests(TESTS)
    assert common._plain_tests("class TestAdd:\n    def test_a(self):\n        assert True\n")
    for test in ["import pytest\ndef test_a():\n    pass\n", "def test_a(tmp_path):\n    pass\n",
                 "def setup_module():\n    pass\n", "import unittest\nclass TestA(unittest.TestCase):\n    pass\n",
                 "class TestA:\n    def setup_method(self):\n        pass\n", "def test_a(:\n"]:
        assert not common._plain_tests(test), test


@pytest.mark.parametrize("solution,passed", [("def add(a, b):\n    return a + b\n", True),
                                             ("def add(a, b):\n    return a - b\n", False)])
def test_runner_and_pytest_agree(solution, passed):
    classes = "from solution import add\n\nclass TestAdd:\n    def test_one(self):\n        assert add(2, 2) == 4\n"
    fixture = "import pytest\nfrom solution import add\n\n@pytest.mark.parametrize('a', [1, 2])\n" \
              "def test_one(a):\n    assert add(a, a) == 2 * a\n"
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
    code = ("import os\nprint(dict(os.environ))\n"
            "for pid in (os.getppid(), 1):\n"
            "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError as e:\n        print('denied', e)\n")
    result = python(code)
    assert result["returncode"] == 0 and "HOME" in result["stdout"]
    assert secret not in result["stdout"] + result["stderr"]


@needs_landlock
def test_writes_outside_the_temp_dir_are_refused(tmp_path):
    outside = [tmp_path / "escape.txt", "/tmp/t2g-escape-test.txt", os.path.join(os.getcwd(), "escape.txt")]
    code = ("import os\nopen('inside.txt', 'w').write('ok')\nos.makedirs('sub/dir')\nprint('inside ok')\n"
            f"for path in {[str(p) for p in outside] + ['../escape.txt']!r}:\n"
            "    try:\n        open(path, 'w').write('escaped')\n        print('WROTE', path)\n"
            "    except OSError as e:\n        print('refused', path, e.errno)\n")
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


@pytest.mark.skipif(common.landlock_abi() < 4, reason="Landlock TCP rules need ABI >= 4")
def test_network_and_signals_are_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = ("import os, socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('CONNECTED')\n"
            "except OSError as e:\n    print('refused', e)\n"
            f"try:\n    os.kill({os.getpid()}, 0)\n    print('SIGNALLED')\n"
            "except OSError as e:\n    print('refused', e)\n")
    try:
        result = python(code)
    finally:
        server.close()
    assert "CONNECTED" not in result["stdout"] and "refused" in result["stdout"]
    if common.landlock_abi() >= 6:
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
    if not common.landlock_abi():
        pytest.skip("the kernel has no Landlock")
    marker = tmp_path / "ran"
    monkeypatch.setattr(common, "_landlock_rules", lambda work: [["/", 0]])  # an empty rule: the kernel refuses it
    with pytest.raises(RuntimeError, match="landlock|add_rule"):
        python(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert not marker.exists()


def test_the_first_runs_from_threads_all_get_landlock(monkeypatch):
    # 01 runs the critic from a thread pool, so the first sandbox runs probe the machine from several threads at once.
    # A thread must never see a half-done probe (the old probe stored 0 first: that run went without Landlock).
    if not common.landlock_abi():
        pytest.skip("the kernel has no Landlock")
    import ctypes
    want, real_cdll = common.landlock_abi(), ctypes.CDLL

    def slow_cdll(*args, **kw):  # widens the probe's window, so the race shows every time rather than now and then
        time.sleep(0.05)
        return real_cdll(*args, **kw)
    monkeypatch.setattr(ctypes, "CDLL", slow_cdll)
    monkeypatch.setattr(common, "_LANDLOCK_ABI", None)
    barrier, got = threading.Barrier(4), []

    def probe():
        barrier.wait()
        got.append(common.landlock_abi())
    threads = [threading.Thread(target=probe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4


def test_without_landlock_it_still_runs_with_the_other_limits(monkeypatch):
    monkeypatch.setattr(common, "_LANDLOCK_ABI", 0)
    with pytest.warns(RuntimeWarning, match="Landlock is unavailable"):
        result = python("import os\nprint(os.environ.get('OPENAI_API_KEY'), os.getcwd())\n")
        big = python("x = bytearray(2 * 1024 ** 3)\n", memory_mb=256)
    assert result["returncode"] == 0 and result["stdout"].startswith("None")
    assert not any(layer.startswith("landlock") for layer in result["sandbox"])
    assert big["returncode"] != 0 and "MemoryError" in big["stderr"]


# ---------------------------------------------------------------------------------------------------------------------
# Gaps closed by issue 14: escaping processes, fork bombs, non-TCP network, forged verdicts, long output
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
    if request.param == "namespaces" and not common.sandbox_namespaces():
        pytest.skip("this machine allows no PID/network namespaces")
    if request.param == "fallback":
        monkeypatch.setattr(common, "_NAMESPACES", 0)
    return request.param


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc scan")
@pytest.mark.parametrize("loop", [False, True])
def test_setsid_and_double_fork_survivors_are_killed(loop, layers):
    marker = "t2g-escapee-" + os.urandom(6).hex()
    code = ("import os, subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"  # in the group
            "if os.fork() == 0:\n"  # double fork + setsid: the grandchild leaves the session and process group
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "    os._exit(0)\n"
            "time.sleep(0.5)\n"
            "print('forked', flush=True)\n" + ("while True:\n    pass\n" if loop else ""))
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
    code = ("import os, sys, time\n"
            "n = 0\n"
            "for _ in range(300):\n"
            "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
            f"    if pid == 0:\n        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "    n += 1\n"
            "print('forked', n, flush=True)\n")
    try:
        result = python(code, timeout_s=60.0)
        forked = int(result["stdout"].split()[1])
        assert forked <= common.SANDBOX_MAX_PROCESSES, result
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
    code = ("import asyncio, socket\n"
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
            "print('pair', b.recv(2), asyncio.run(asyncio.sleep(0, 'loop')))\n")
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


FORGED = ("import os, sys\n"
          "print('1 passed in 0.01s')\n"
          "print('===== 3 passed in 0.05s =====')\n"
          "for fd in range(3, 64):\n"  # try every descriptor the runner might report through
          "    try:\n        os.write(fd, b'1 passed in 0.01s\\n{\"passed\": true, \"failed\": 0, \"errors\": 0}\\n')\n"
          "    except OSError:\n        pass\n"
          "sys.stdout.flush()\n"
          "os._exit(0)\n")


@pytest.mark.parametrize("test", [TESTS, "import pytest\nfrom solution import add\n\n@pytest.mark.parametrize('a', [1])\n"
                                         "def test_one(a):\n    assert add(a, a) == 2 * a\n"])
def test_code_cannot_forge_a_pass(test):
    result = run_tests(FORGED, test)
    assert not result["passed"], result
    fb = critic(FORGED, test)
    assert fb["good_spans"] == [] and not fb["critique"].startswith("All")


@pytest.mark.parametrize("completion", [
    "    import os\n    print('1 passed in 0.01s', flush=True)\n    os._exit(0)\n",  # forges when check() calls it
    f"```python\n{FORGED}```\n"])  # a chat answer whose whole program forges as it loads
def test_a_humaneval_completion_cannot_forge_a_pass(completion):
    # the issue's example, the way 04 scores it (run_completion) and 03's program critic judges it
    prompt = "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n"
    test = common.code_problem({"task_id": "T/0", "prompt": prompt, "entry_point": "add",
                                "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}, "t")["test"]
    result = common.run_completion(completion, test, timeout_s=PATIENT)
    assert not result["passed"] and result["status"] == "failed" and "1 passed" in result["output"], result
    fb = critic(completion, test)
    assert not fb["passed"] and fb["good_spans"] == [] and not fb["critique"].startswith("All"), fb


def test_a_correct_solution_that_prints_a_lot_still_passes():
    result = run_tests("print('x' * 20000)\ndef add(a, b):\n    return a + b\n", TESTS)
    assert result["passed"], result["output"][-500:]
    long = python("print('head')\nprint('x' * 50000)\nprint('tail')\n", max_output_chars=1000)
    assert long["stdout"].startswith("head") and long["stdout"].rstrip().endswith("tail")
    assert len(long["stdout"]) <= 1100 and "bytes cut" in long["stdout"]


# ---------------------------------------------------------------------------------------------------------------------
# The critic on benchmark-style tests: calls through an alias (HumanEval's candidate), the prompt as prefix
# ---------------------------------------------------------------------------------------------------------------------


def test_critic_blames_the_buggy_line_when_the_tests_call_an_alias():
    test = ("from solution import count_positive as candidate\n\n"
            "def test_cases():\n    assert candidate([1, -2, 3]) == 2\n    assert candidate([-1]) == 0\n"
            "    assert candidate([]) == 0\n    assert candidate([0, 6]) == 1\n")
    code = ("def count_positive(xs):\n    n = 0\n    for x in xs:\n        if x > 0:\n            n += 1\n"
            "        elif x == 0:\n            n = n + 1\n    return n\n")
    fb = critic(code, test)
    assert fb["poor_spans"] == ["n = n + 1"]  # the old critic gave none: `candidate` is no name of the code
    assert "`count_positive([0, 6])` returns 2, expected 1" in fb["critique"]


def test_critic_on_a_humaneval_problem_names_input_expected_and_actual():
    prompt = "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n"
    test = common.code_problem({"task_id": "T/0", "prompt": prompt, "entry_point": "add",
                                "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
                                        "    assert candidate(0, 0) == 0\n    assert candidate(5, 1) == 6\n"}, "t")["test"]
    completion = "    if a > 3:\n        return a * b\n    return a + b\n"
    fb = critic(completion, test)
    assert fb["poor_spans"] == ["return a * b"] and not fb["passed"]
    assert "`add(5, 1)` returns 5, expected 6" in fb["critique"] and "1 of 3 test cases fail" in fb["critique"]
    assert "line 2 `return a * b`" in fb["critique"]  # lines count from the completion, not the prompt
    good = critic("    return a + b\n", test)
    assert good["passed"] and good["good_spans"] == ["return a + b"] and good["poor_spans"] == []
    chat = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n"  # a chat model's whole function, fenced
    assert critic(chat, test)["passed"]


def test_tests_that_cannot_run_are_an_error_not_a_failed_solution():
    missing = "import no_such_module_t2g\nfrom solution import add\n\ndef test_a():\n    assert add(1, 2) == 3\n"
    result = run_tests("def add(a, b):\n    return a + b\n", missing)
    assert result["status"] == "error" and "no_such_module_t2g" in result["problem_error"] and not result["passed"]
    broken = {"script": "def check(candidate)\n    pass\n"}
    assert run_tests("x = 1\n", broken)["status"] == "error"
    fb = critic("def add(a, b):\n    return a + b\n", missing)
    assert fb["status"] == "error" and fb["poor_spans"] == [] and fb["good_spans"] == [] and "cannot run" in \
        fb["critique"]
    # the solution's own missing import is the solution's failure, as in the official harnesses
    assert run_tests("import no_such_module_t2g\n", TESTS)["status"] == "failed"


def test_code_cannot_read_the_nonce_back_from_the_verdict_channel():
    # a thread that polls every descriptor for the runner's nonce and, once seen, writes a passing summary with it
    spy = ("import os, re, threading, time\n"
           "def spy():\n"
           "    for _ in range(2000):\n"
           "        for fd in range(3, 32):\n"
           "            try:\n"
           "                os.lseek(fd, 0, 0)\n"
           "                m = re.search(rb'\"nonce\": \"(\\w+)\"', os.read(fd, 1 << 16))\n"
           "            except OSError:\n"
           "                continue\n"
           "            if m:\n"
           "                line = b'{\"nonce\": \"' + m.group(1) + b'\", \"summary\": {\"passed\": 9, \"failed\": 0, '\n"
           "                os.write(fd, line + b'\"errors\": 0}}\\n')\n"
           "                return\n"
           "        time.sleep(0.001)\n"
           "threading.Thread(target=spy, daemon=True).start()\n"
           "def add(a, b):\n    time.sleep(0.2)\n    return a - b\n")
    result = run_tests(spy, TESTS, trace=True)  # trace mode reports as it goes
    assert result["counts"] == {"passed": 0, "failed": 2, "errors": 0}, result["counts"]
