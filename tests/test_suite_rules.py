"""The suite's own rules, checked on its source.

A test fails on a wrong result, never on a busy machine: at a load average of ~10 the zero-flag demo's fixture ran
one stage past its `timeout=900` and 6 tests errored (issue 68). So no test gives a run of the project's code a
wall-clock limit (subprocess.run / forkserver.run / communicate / wait with a timeout), and no test waits on a fixed
deadline (deadline = time.monotonic() + N): a wait ends when what it waits for happens or its process exits. Where
a limit is the feature under test (a sandbox's, a client's) it is the code's own argument, not the run's."""

import ast
import re
import types
from pathlib import Path

from conftest import ROOT

TESTS = ROOT / "tests"
# (file, function): why a wall-clock limit there checks a result and not the machine's speed
ALLOWED = {
    ("test_forkserver.py", "test_a_timeout_kills_the_child_as_subprocess_does"): "the timeout is what it tests",
    ("test_sandbox.py", "_wait_gone"): "killed processes leaving: no work that load slows",
    (
        "forkserver.py",
        "limited",
    ): "issue 80, item 8: a torchrun test's hang guard, 20 minutes against its ~10-45 s (27x)",
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


SLOW_CALLS = re.compile(r"_torchrun\(|_torchrun_rm\(|torch\.distributed\.run|[\"']torchrun[\"']")


def unmarked_slow_tests(path: Path) -> list[str]:
    """Tests that start torchrun (2 gloo ranks: a minute or more of a worker) or read the zero-flag demo chain's
    fixture, without @pytest.mark.slow: they would put CI's tier (make test: -m "not slow") over its 15 minutes."""
    src = path.read_text()
    found = []
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            heavy = SLOW_CALLS.search(ast.get_source_segment(src, node)) or "demo" in [a.arg for a in node.args.args]
            marks = [ast.unparse(d) for d in node.decorator_list] + module_marks(src)
            if heavy and not any("mark.slow" in m for m in marks):
                found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def module_marks(src: str) -> list[str]:
    return [line for line in src.splitlines() if line.startswith("pytestmark")]


def test_torchrun_and_the_demo_chain_are_marked_slow():
    found = [
        f
        for path in sorted(TESTS.glob("test_*.py"))
        if path.name != "test_suite_rules.py"
        for f in unmarked_slow_tests(path)
    ]
    assert found == [], "marked slow, or the fast tier runs them:\n" + "\n".join(found)


def test_the_slow_rule_finds_an_unmarked_torchrun_test(tmp_path):
    old = tmp_path / "test_old.py"
    old.write_text(
        "import pytest\n"
        "def test_ranks(tmp_path):\n    _torchrun(tmp_path, [])\n"
        "@pytest.mark.slow\ndef test_marked(tmp_path):\n    _torchrun(tmp_path, [])\n"
        "def test_chain(demo):\n    pass\n"
    )
    assert unmarked_slow_tests(old) == ["test_old.py:2 test_ranks", "test_old.py:7 test_chain"]


def test_a_module_fixture_keeps_its_module_on_one_worker_and_the_longest_go_first():
    """conftest's hook (pytest.ini: --dist loadgroup): a test reading a module-scoped fixture joins its module's
    xdist group, so one worker builds the fixture once; the demo chain's tests come first, then the slow ones."""
    import conftest
    import pytest

    def item(nodeid, scopes, slow=False):
        defs = {f"f{i}": [types.SimpleNamespace(scope=s)] for i, s in enumerate(scopes)}
        it = types.SimpleNamespace(nodeid=nodeid, _fixtureinfo=types.SimpleNamespace(name2fixturedefs=defs), marks=[])
        it.fixturenames = ["demo"] if "demo" in nodeid else []
        it.add_marker = it.marks.append
        it.get_closest_marker = lambda name: pytest.mark.slow if slow and name == "slow" else None
        return it

    fast = item("tests/test_a.py::test_fast", ["function"])
    grouped = item("tests/test_b.py::test_reads_a_module_fixture", ["session", "module"])
    slow = item("tests/test_c.py::test_torchrun", ["function"], slow=True)
    chain = item("tests/test_demo.py::test_demo_chain", ["module"], slow=True)
    items = [fast, grouped, slow, chain]
    conftest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [chain.nodeid, slow.nodeid, fast.nodeid, grouped.nodeid]
    assert [m.kwargs.get("name", m.args and m.args[0]) for m in grouped.marks] == ["tests/test_b.py"]
    assert fast.marks == [] and slow.marks == []
    assert [m.args[0] for m in chain.marks] == ["tests/test_demo.py"]


def test_a_module_fixture_is_built_once_on_the_suites_two_workers(tmp_path):
    """The marks above reach xdist's scheduler: a real pytest on 2 workers with pytest.ini's options and conftest's
    hook builds a module-scoped fixture once. pytest 9.2 broke this silently (pytest-xdist#1386: loadgroup's group
    was written to a node id field pytest no longer reads), and the zero-flag demo's chain ran on both workers, 360 s
    each; requirements.txt keeps pytest below 9.2 until xdist follows."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        f"import importlib.util, sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
    )
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\n@pytest.fixture(scope='module')\ndef built():\n"
        "    with open('built.log', 'a') as f:\n        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        + "".join(f"def test_{i}(built):\n    pass\n" for i in range(4))
    )
    (tmp_path / "test_other.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(20)))
    options = next(line for line in (ROOT / "pytest.ini").read_text().splitlines() if line.startswith("addopts"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *options.split("=", 1)[1].split(), "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len((tmp_path / "built.log").read_text().split()) == 1, "built on both workers"
