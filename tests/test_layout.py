"""The layout the stages keep: no module below them imports a stage script (01_annotate.py .. 04_evaluate.py),
directly or through importlib, runpy or a string naming it; only the stage scripts, bench/ and tests/ may. A helper a
module needs from a stage is passed in, or the module keeps its own copy pinned by a test. Below the stages, each
module imports only from its own package and the floors below it (FLOORS: tasks/ nothing above it, infra/ neither
the critic nor the stages' packages). Read with ast, so an import inside a function counts too."""

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
    source = (
        "import importlib\nx = importlib.import_module('02_train_reward')\n"
        "def f():\n    import runpy\n    runpy.run_path('03_train_policy.py')\n"
        "doc = 'see 03_train_policy.py for the loop'\n"
    )
    assert [line for line, _ in stage_imports(source)] == [2, 5]  # a sentence naming the file is no import


def test_no_module_below_the_stages_imports_one():
    modules = [
        p
        for p in ROOT.rglob("*.py")
        if not any(part.startswith(".") or part == "runs" for part in p.relative_to(ROOT).parts)  # .venv, .git
        and not ENTRY.match(p.relative_to(ROOT).as_posix())
    ]
    assert len(modules) >= 20  # common.py, infra/, tasks/, baselines/, tools/
    found = [
        f"{p.relative_to(ROOT)}:{line}: {what}"
        for p in modules
        for line, what in stage_imports(p.read_text(encoding="utf-8"))
    ]
    assert not found, "\n".join(found)


# The floors, lowest first: a module imports only from its own package and the floors below it. tasks/ holds a
# task's own parts (the demo world, the code benchmarks, the sandbox); infra/ the machinery a run needs; baselines/
# the paper's baselines; critics/ the critic of step 2; annotation/, policy/ and evaluation/ the parts of stages 1, 3, 4.
FLOORS = {
    "common": 0,
    "tasks": 1,
    "infra": 2,
    "baselines": 3,
    "critics": 4,
    "annotation": 5,
    "evaluation": 5,
    "policy": 5,
}


def project_imports(source: str) -> list[tuple[int, str]]:
    """(line, top-level name) of each import of one of FLOORS' packages in `source`, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        found += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in FLOORS]
    return found


def wrong_way(package: str, source: str) -> list[tuple[int, str]]:
    """The imports of `source`, a module of `package`, that go up a floor or sideways into another package."""
    return [(line, to) for line, to in project_imports(source) if to != package and FLOORS[to] >= FLOORS[package]]


def test_the_floor_check_sees_an_import_up_or_sideways():
    source = "import common\nfrom infra import runs\ndef f():\n    from critics import plugin\n    import evaluation\n"
    assert wrong_way("infra", source) == [(4, "critics"), (5, "evaluation")]
    assert wrong_way("annotation", source) == [(5, "evaluation")]  # one floor, two packages: neither imports the other
    assert wrong_way("tasks", "from tasks.demo import demo_dataset\nimport common\n") == []


def test_every_import_runs_down_the_floors():
    """No arrow from tasks/ up into infra/, none from infra/ into the critic or the stages' packages, and so on."""
    found = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        package = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if package in FLOORS:
            found += [f"{rel}:{line}: imports {to}" for line, to in wrong_way(package, p.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


# bench/: one folder per study (its script(s), results, figures and README.md), bench/shared what several share. A
# study imports only its own folder's modules, bench/shared's and the project's; bench/shared imports no study.
def bench_imports(source: str) -> list[tuple[int, str]]:
    """(line, top-level name) of each absolute import in `source`, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def cross_study(folder: str, source: str, modules: dict[str, str]) -> list[tuple[int, str]]:
    """The imports of `source`, a module of bench/<folder>/, of another study's module (modules: {name: its folder})."""
    allowed = {folder} if folder == "shared" else {folder, "shared"}
    return [(line, name) for line, name in bench_imports(source) if modules.get(name, folder) not in allowed]


def test_the_bench_check_sees_an_import_of_another_study():
    modules = {
        "credit": "credit",
        "credit_matched": "credit",
        "run_cache": "shared",
        "span_vs_scalar": "span_vs_scalar",
    }
    source = "import common\nimport run_cache\nfrom credit import PLUGIN\ndef f():\n    import span_vs_scalar\n"
    assert cross_study("credit", source, modules) == [(5, "span_vs_scalar")]
    assert cross_study("shared", source, modules) == [(3, "credit"), (5, "span_vs_scalar")]


def test_bench_is_one_folder_per_study_and_no_study_imports_another():
    bench = ROOT / "bench"
    assert not list(bench.glob("*.py")), "a bench script belongs in its study's folder, bench/<study>/"
    files = sorted(p for p in bench.glob("*/*.py") if p.parent.name != "out")
    modules = {p.stem: p.parent.name for p in files}
    assert len(modules) == len(files), "two bench modules of one name: the one first on sys.path would win"
    studies = {p.parent.name for p in files} - {"shared"}
    assert len(studies) >= 12 and not [s for s in studies if not (bench / s / "README.md").is_file()]
    found = [
        f"{p.relative_to(ROOT)}:{line}: imports {name} (bench/{modules[name]}/)"
        for p in files
        for line, name in cross_study(p.parent.name, p.read_text(encoding="utf-8"), modules)
    ]
    assert not found, "\n".join(found)
