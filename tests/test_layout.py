"""The layout the stages keep: no module below them imports a stage script (01_annotate.py .. 04_evaluate.py),
directly or through importlib, runpy or a string naming it; only the stage scripts, bench/ and tests/ may. A helper a
module needs from a stage is passed in, or the module keeps its own copy pinned by a test. Read with ast, so an import
inside a function or behind importlib counts too."""
import ast
import re

from conftest import ROOT

STAGE = re.compile(r"0[1-4]_\w+(\.py)?")
ENTRY = re.compile(r"^(0[1-4]_\w+\.py|bench/.*|tests/.*)$")  # what may import a stage: the stages, benches, tests


def stage_imports(source: str) -> list[tuple[int, str]]:
    """(line, what) of each place `source` imports a stage script or names one in a string (importlib, runpy)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if STAGE.fullmatch(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and STAGE.fullmatch(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and STAGE.fullmatch(node.value):
            found.append((node.lineno, repr(node.value)))
    return found


def test_the_check_sees_every_way_to_import_a_stage():
    source = ("import importlib\nx = importlib.import_module('02_train_reward')\n"
              "def f():\n    import runpy\n    runpy.run_path('03_train_policy.py')\n"
              "doc = 'see 03_train_policy.py for the loop'\n")
    assert [line for line, _ in stage_imports(source)] == [2, 5]  # a sentence naming the file is no import


def test_no_module_below_the_stages_imports_one():
    modules = [p for p in ROOT.rglob("*.py") if ".git" not in p.parts and "runs" not in p.parts
               and not ENTRY.match(p.relative_to(ROOT).as_posix())]
    assert len(modules) >= 20  # common.py, infra/, tasks/, baselines/, tools/
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in modules
             for line, what in stage_imports(p.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)
