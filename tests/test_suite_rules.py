"""The suite's own rules, checked on its source.

A test fails on a wrong result, never on a busy machine: at a load average of ~10 the zero-flag demo's fixture ran
one stage past its `timeout=900` and 6 tests errored (issue 68). So no test gives a run of the project's code a
wall-clock limit (subprocess.run / forkserver.run / communicate / wait with a timeout), and no test waits on a fixed
deadline (deadline = time.monotonic() + N): a wait ends when what it waits for happens or its process exits. Where
a limit is the feature under test (a sandbox's, a client's) it is the code's own argument, not the run's."""

import ast
from pathlib import Path

from conftest import ROOT

TESTS = ROOT / "tests"
# (file, function): why a wall-clock limit there checks a result and not the machine's speed
ALLOWED = {
    ("test_forkserver.py", "test_a_timeout_kills_the_child_as_subprocess_does"): "the timeout is what it tests",
    ("test_sandbox.py", "_wait_gone"): "killed processes leaving: no work that load slows",
    ("browser.py", "inspect_page"): "SIGTERM's grace before SIGKILL: it ends a process, it fails nothing",
    ("conftest.py", "stop_server"): "SIGTERM's grace before SIGKILL: it ends a process, it fails nothing",
    ("vllm_server.py", "stop"): "SIGTERM's grace before SIGKILL: it ends a process, it fails nothing",
}
RUNS = {"run", "communicate", "wait", "check_output", "check_call"}


def functions(tree):
    """(function name, node) for every node, the innermost enclosing function's name."""
    out = []

    def walk(node, name):
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            out.append((here, child))
            walk(child, here)

    walk(tree, "<module>")
    return out


def wall_clock_limits(path: Path) -> list[str]:
    found = []
    for func, node in functions(ast.parse(path.read_text())):
        if (path.name, func) in ALLOWED:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RUNS:
            if any(k.arg == "timeout" for k in node.keywords) or (node.func.attr == "wait" and node.args):
                found.append(f"{path.name}:{node.lineno} ({func}): {ast.unparse(node.func)}(timeout=...)")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Add):
            clock = ast.unparse(node.value.left)
            if clock in ("time.monotonic()", "time.time()") and isinstance(node.value.right, ast.Constant):
                found.append(f"{path.name}:{node.lineno} ({func}): {ast.unparse(node)}")
    return found


def test_no_test_puts_a_wall_clock_limit_on_a_run():
    found = [f for path in sorted(TESTS.glob("*.py")) for f in wall_clock_limits(path)]
    assert found == [], "a limit that a loaded machine reaches, with no wrong result:\n" + "\n".join(found)


def test_the_rule_finds_the_limit_that_failed_under_load(tmp_path):
    """The demo fixture as it was (timeout=900 on each stage), and a fixed deadline: both found."""
    old = tmp_path / "test_old.py"
    old.write_text(
        "import subprocess, sys, time\n"
        "def demo():\n"
        "    subprocess.run([sys.executable, 'x.py'], capture_output=True, text=True, timeout=900)\n"
        "def kill():\n"
        "    deadline = time.monotonic() + 120\n"
    )
    assert [f.split(" ", 1)[0] for f in wall_clock_limits(old)] == ["test_old.py:3", "test_old.py:5"]
