"""Mutation testing of the method and its scale-out (issue 68): does a test fail when a feature is gone?

    nice -n 10 python bench/mutants.py                  # every target and hand-written mutant, then the score
    python bench/mutants.py --targets common --list     # the mutants of one target, not run
    python bench/mutants.py --targets pure --jobs 2     # one target, two mutants at a time

Automatic mutants: the operators below applied one at a time to each named function of a target (the function's
source, parsed with ast): an arithmetic, comparison or boolean operator swapped, a small constant changed, a unary
operator dropped, a call statement or an augmented assignment deleted. Hand-written mutants (MANUAL): what a tool
cannot write, a feature removed by its meaning (a shard that shards nothing, the KL dropped from r_t, ...), each a
text replacement in one file. Every mutant runs its target's tests in a scratch copy of the working tree (tracked and
untracked files, no run folders), under a time limit: "killed" when they fail, "survived" when they pass, "timeout"
(counted as killed: the tests did not pass). The clean copy must pass each target's tests first.

Survivors are read by hand: each gets a verdict in bench/mutants_verdicts.json ({mutant id: "equivalent: why" or
"killed by <test> since <commit>"}); the score and the verdicts go in docs/tests.md. Writes bench/mutants_results.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# target: (file, [functions], pytest arguments). The tests are the ones that cover those functions.
TARGETS = {
    "common": (
        "common.py",
        [
            "_find_feedback",
            "_balanced_end",
            "_decode_object",
            "_is_placeholder",
            "_span_list",
            "_read_feedback",
            "parse_feedback",
            "_normalize",
            "_quote_variants",
            "_is_word",
            "_find_bounded",
            "find_span",
            "locate_spans",
            "decode_with_offsets",
            "_core",
            "span_rewards",
            "_token_labels",
            "interval_rewards",
        ],
        ["tests/test_common.py", "tests/test_parse_snapshot.py"],
    ),
}
MANUAL: list[dict] = []  # {"id", "file", "old", "new", "tests": [pytest args], "why"}: filled per feature below
SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Pow: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass
class Mutant:
    id: str  # target:function:line:col:operator
    file: str
    start: tuple[int, int]  # (line, byte column) of the replaced text
    end: tuple[int, int]
    new: str  # the replacement text
    tests: list[str]
    old: str = ""


def replacements(node: ast.AST) -> list[tuple[str, ast.AST | str]]:
    """(operator name, the node's replacement: an ast node or a statement's text) for one node."""
    out = []
    if isinstance(node, ast.BinOp) and type(node.op) in SWAPS:
        out.append(
            (
                f"{type(node.op).__name__}->{SWAPS[type(node.op)].__name__}",
                ast.BinOp(node.left, SWAPS[type(node.op)](), node.right),
            )
        )
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAPS:
        new = SWAPS[type(node.ops[0])]
        out.append((f"{type(node.ops[0]).__name__}->{new.__name__}", ast.Compare(node.left, [new()], node.comparators)))
    elif isinstance(node, ast.BoolOp):
        out.append(
            (
                f"{type(node.op).__name__}->{SWAPS[type(node.op)].__name__}",
                ast.BoolOp(SWAPS[type(node.op)](), node.values),
            )
        )
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((f"drop {type(node.op).__name__}", node.operand))
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        out.append((f"{node.value}->{not node.value}", ast.Constant(not node.value)))
    elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        v = node.value
        out.append((f"{v!r}->{v + 1!r}", ast.Constant(v + 1)))
        if v not in (0, 1):
            out.append((f"{v!r}->0", ast.Constant(type(v)(0))))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        out.append(("drop call", "pass"))
    elif isinstance(node, ast.AugAssign):
        out.append(("drop augmented assignment", "pass"))
    return out


def functions(tree: ast.Module, names: list[str]) -> list[ast.AST]:
    found = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    missing = [n for n in names if n not in found]
    if missing:
        sys.exit(f"bench/mutants.py: no function {missing[0]!r} to mutate (TARGETS is out of date)")
    return [found[n] for n in names]


def automatic(target: str) -> list[Mutant]:
    """Every automatic mutant of a target, in source order."""
    path, names, tests = TARGETS[target]
    source = (ROOT / path).read_bytes()
    tree = ast.parse(source)
    out = []
    for fn in functions(tree, names):
        docstring = ast.get_docstring(fn, clean=False) is not None
        skip = {id(n) for n in ast.walk(fn.body[0])} if docstring else set()
        for node in ast.walk(fn):
            if id(node) in skip:
                continue
            for op, new in replacements(node):
                text = new if isinstance(new, str) else f"({ast.unparse(new)})"
                start, end = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)
                out.append(
                    Mutant(f"{target}:{fn.name}:{node.lineno}:{node.col_offset}:{op}", path, start, end, text, tests)
                )
    return out


def splice(source: bytes, m: Mutant) -> bytes:
    """source with the text between m.start and m.end (ast's lines from 1, byte columns) replaced by m.new."""
    lines = source.splitlines(keepends=True)
    offset = lambda line, col: sum(len(x) for x in lines[: line - 1]) + col  # noqa: E731
    a, b = offset(*m.start), offset(*m.end)
    m.old = source[a:b].decode()
    return source[:a] + m.new.encode() + source[b:]


def manual() -> list[Mutant]:
    out = []
    for spec in MANUAL:
        source = (ROOT / spec["file"]).read_text()
        if source.count(spec["old"]) != 1:
            sys.exit(
                f"bench/mutants.py: manual mutant {spec['id']}: its text occurs {source.count(spec['old'])} times "
                f"in {spec['file']} (MANUAL is out of date)"
            )
        line = source[: source.index(spec["old"])].count("\n") + 1
        out.append(Mutant(spec["id"], spec["file"], (line, 0), (line, 0), spec["new"], spec["tests"], spec["old"]))
    return out


def scratch_copy() -> Path:
    """The working tree's files (tracked and untracked, not ignored) copied to a temporary folder."""
    files = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    dst = Path(tempfile.mkdtemp(prefix="t2g-mutants-"))
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    return dst


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """("passed" | "failed" | "timeout", seconds) of pytest on `tests` in the copy, one process, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.time()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:randomly",
                *tests,
            ],
            cwd=copy,
            env=env,
            capture_output=True,
            timeout=timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - start
    return ("passed" if proc.returncode == 0 else "failed"), time.time() - start


def apply(copy: Path, m: Mutant) -> bytes:
    """Write the mutant into the copy; returns the file's clean bytes (to restore)."""
    path = copy / m.file
    clean = path.read_bytes()
    if m.old and m.start == m.end:  # manual: a text replacement
        path.write_bytes(clean.replace(m.old.encode(), m.new.encode(), 1))
    else:
        path.write_bytes(splice(clean, m))
    return clean


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", default=[*TARGETS, "manual"], help="targets to mutate (or 'manual')")
    p.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    p.add_argument("--limit", type=int, help="the first N mutants only (a quick look)")
    p.add_argument("--results", default="bench/mutants_results.json", help="where the outcomes go ('': nowhere)")
    args = p.parse_args(argv)
    mutants = [m for t in args.targets if t != "manual" for m in automatic(t)]
    mutants += manual() if "manual" in args.targets else []
    mutants = mutants[: args.limit] if args.limit else mutants
    if args.list:
        for m in mutants:
            print(m.id, "->", m.new.replace("\n", " ")[:80])
        print(f"{len(mutants)} mutants")
        return
    copy = scratch_copy()
    results, clean_s = {}, {}
    try:
        for tests in dict.fromkeys(tuple(m.tests) for m in mutants):  # each test set passes on the clean copy first
            status, clean_s[tests] = run_tests(copy, list(tests), 3600)
            if status != "passed":
                sys.exit(f"bench/mutants.py: the clean tree fails {' '.join(tests)}: fix that first")
        for i, m in enumerate(mutants, 1):
            clean = apply(copy, m)
            try:
                status, seconds = run_tests(copy, m.tests, max(60.0, 3 * clean_s[tuple(m.tests)]))
            finally:
                (copy / m.file).write_bytes(clean)
            status = {"passed": "survived", "failed": "killed"}.get(status, status)  # a timeout: not passed
            results[m.id] = {"status": status, "old": m.old, "new": m.new, "seconds": round(seconds, 1)}
            print(f"[{i}/{len(mutants)}] {status:<8} {m.id}  {m.old!r} -> {m.new!r}"[:200], flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    verdicts_path = ROOT / "bench" / "mutants_verdicts.json"
    verdicts = json.loads(verdicts_path.read_text()) if verdicts_path.is_file() else {}
    survived = [k for k, r in results.items() if r["status"] == "survived"]
    killed = len(results) - len(survived)
    explained = [k for k in survived if k in verdicts]
    summary = {
        "mutants": len(results),
        "killed": killed,
        "survived": len(survived),
        "explained": len(explained),
        "score": killed / len(results) if results else None,
        "unexplained": [k for k in survived if k not in verdicts],
    }
    print(json.dumps(summary))
    if args.results:
        (ROOT / args.results).write_text(json.dumps({"summary": summary, "mutants": results}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
