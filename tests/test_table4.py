"""The paper's Table 4 columns in 04 (evaluation/table4.py): ARC-Challenge through EleutherAI's harness on a local
ARC-format task, AlpacaEval 2.0's raw and length-controlled win rates against the alpaca_eval package's own function,
MT-Bench's two-turn answers and FastChat's single-answer grading through the fake OpenAI-compatible judge, the report's
Table 4 with its caveats, and one-line errors. Nothing is downloaded: the harness reads a local data_files task and the
package's hub table (df_gamed.csv) is a fixture."""

import hashlib
import importlib
import json
import math
import os
import random
import sys
from pathlib import Path

import pytest
import forkserver
from conftest import ROOT, import_script

import common
from evaluation import alpaca_lc, judge, lm_eval_tasks, mt_bench, table4
from infra import models

ev = import_script("04_evaluate")


def need(module: str):
    """An optional package of requirements-eval.txt; the test skips, saying why, where it is missing, and fails
    under CI, whose .ci/run installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{module}: {e}: pip install -r requirements-eval.txt")


def arc_rows() -> list[dict]:
    """Each of 2 questions 3 times, its gold answer A, then B, then C: whatever a model prefers, exactly one copy of
    each is right, so acc = acc_norm = 2 / 6 by hand."""
    questions = [
        ("Which one is a colour?", ["red", "seven", "table"]),
        ("What do bees make?", ["honey", "bricks", "rain clouds"]),
    ]
    return [
        {"id": f"q{i}-{gold}", "question": q, "choices": {"text": texts, "label": ["A", "B", "C"]}, "answerKey": gold}
        for i, (q, texts) in enumerate(questions)
        for gold in "ABC"
    ]


def arc_task(tmp_path, text: str | None = None) -> str:
    """A folder with an ARC-format task, arc_local: the harness's own arc_easy.yaml (its prompt, choices and metrics)
    reading a local JSONL, arc.jsonl: arc_rows(), or `text` as it is."""
    harness = need("lm_eval")
    data = tmp_path / "arc.jsonl"
    if text is None:
        common.write_jsonl(data, arc_rows())
    else:
        data.write_text(text)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "arc_local.yaml").write_text(
        f"include: {Path(harness.__file__).parent / 'tasks/arc/arc_easy.yaml'}\ntask: arc_local\ndataset_path: json\n"
        f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    train: {data}\n    test: {data}\n"
        "validation_split: null\ntag: []\n"
    )
    return str(tasks)


# ----------------------------------------------------------------------------------------------------------------------
# ARC-Challenge: the harness's Python API on each policy, a plain folder and a LoRA adapter
# ----------------------------------------------------------------------------------------------------------------------


def test_arc_through_04_on_a_local_task_matches_a_hand_count(tiny_model_dir, adapter_dir, tmp_path, monkeypatch):
    tasks = arc_task(tmp_path)
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "p0", "instruction": "Say hi."}])
    argv = [
        "--task",
        "qa",
        "--data",
        str(data),
        "--policy",
        f"base={tiny_model_dir}",
        "--policy",
        f"lora={adapter_dir}",
        "--reward-model",
        "none",
        "--max-new-tokens",
        "2",
        "--lm-eval-tasks",
        "arc_local",
        "--lm-eval-include-path",
        tasks,
        "--lm-eval-fewshot",
        "0",
        "--lm-eval-batch-size",
        "6",
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--bootstrap",
        "50",
    ]
    results = ev.main(argv)
    arc = results["table4"]["lm_eval"]
    assert arc["harness"] == "0.4.13" and arc["num_fewshot"] == 0 and set(arc["policies"]) == {"base", "lora"}
    hand_stderr = math.sqrt((2 * (2 / 3) ** 2 + 4 * (1 / 3) ** 2) / 5 / 6)  # sample std (n - 1) / sqrt(n)
    for name in ("base", "lora"):
        res = arc["policies"][name]["arc_local"]
        assert res["n"] == 6 and res["n_shot"] == 0 and res["harness"] == "0.4.13"
        for metric in ("acc", "acc_norm"):
            assert res[metric]["value"] == pytest.approx(2 / 6)
            assert res[metric]["stderr"] == pytest.approx(hand_stderr)
            lo, hi = res[metric]["ci95"]
            assert lo <= 2 / 6 <= hi and lo < hi
    per = {n: common.read_jsonl(tmp_path / f"out/eval/{n}.lm_eval.jsonl")[0] for n in ("base", "lora")}
    for name, row in per.items():  # one copy of each question right, whatever the model prefers
        assert [sum(q[0] for q in row["per_question"][i : i + 3]) for i in (0, 3)] == [1, 1]
    assert per["base"]["fingerprint"] != per["lora"]["fingerprint"]
    page = (tmp_path / "out/report.html").read_text()
    assert "Table 4: AlpacaEval 2.0, ARC-Challenge, MT-Bench" in page and "arc_local acc_norm" in page
    assert "0-shot, not 25-shot" in page and "lm-evaluation-harness 0.4.13, arc_local, 0-shot" in page

    import lm_eval

    def boom(*a, **k):
        raise AssertionError("a rerun must not run the harness")

    monkeypatch.setattr(lm_eval, "simple_evaluate", boom)
    monkeypatch.setattr(models, "load_model", boom)
    assert ev.main(argv)["table4"] == results["table4"]  # served from eval/<name>.lm_eval.jsonl


def test_an_adapter_runs_as_its_base_plus_peft(adapter_dir, tiny_model_dir, tmp_path):
    assert lm_eval_tasks.model_args(tiny_model_dir, "bf16") == {"pretrained": tiny_model_dir, "dtype": "bfloat16"}
    assert lm_eval_tasks.model_args(adapter_dir, "float32") == {
        "pretrained": tiny_model_dir,
        "peft": adapter_dir,
        "dtype": "float32",
    }
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    with pytest.raises(common.DataError, match="adapter_config.json: missing field 'base_model_name_or_path'"):
        lm_eval_tasks.model_args(str(bad), "float32")


def test_an_unknown_task_or_a_missing_package_is_one_line_before_any_generation(tmp_path, monkeypatch, tiny_model_dir):
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "p0", "instruction": "Say hi.", "output": "Hi."}])
    base = [
        "--task",
        "qa",
        "--data",
        str(data),
        "--policy",
        f"base={tiny_model_dir}",
        "--reward-model",
        "none",
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
    ]
    tasks = arc_task(tmp_path)
    own = lm_eval_tasks.task_manager(
        ev.parse_args(["--lm-eval-tasks", "arc_local", "--lm-eval-include-path", tasks]),
        need("lm_eval.tasks").TaskManager,
    )
    assert "arc_local" in own.all_tasks and "arc_challenge" not in own.all_tasks  # the ~20 s index not built
    monkeypatch.setattr(lm_eval_tasks, "task_manager", lambda *a: own)  # here: the built-in tasks left out
    with pytest.raises(common.DataError, match="no_such_task: not a task the harness knows"):
        ev.main(base + ["--lm-eval-tasks", "no_such_task", "--lm-eval-include-path", tasks])
    with pytest.raises(common.DataError, match=r"^--mt-bench needs a judge: --judge-base-url"):
        ev.main(base + ["--mt-bench"])
    with pytest.raises(common.DataError, match=r"^--alpaca-eval needs the reference's answers: --reference-field"):
        ev.main(base + ["--alpaca-eval", "--judge-base-url", "http://127.0.0.1:9/v1"])
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # not installed
    with pytest.raises(common.DataError, match=r"--lm-eval-tasks needs .*: pip install -r requirements-eval.txt$"):
        ev.main(base + ["--lm-eval-tasks", "arc_challenge"])
    for module in ("alpaca_eval", "alpaca_eval.metrics"):  # imported above, for the reference-field check
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(common.DataError, match=r"--alpaca-eval needs the alpaca_eval package .*requirements-eval"):
        ev.main(base + ["--alpaca-eval", "--judge-base-url", "http://127.0.0.1:9/v1", "--reference-field", "output"])
    assert not (tmp_path / "out").exists()


def bad_arc(case: str) -> str:
    """arc.jsonl's text for one way of being malformed (issue 68: each a 70-116 line traceback after every
    generation, exit 1)."""
    lines = [json.dumps(r) for r in arc_rows()]
    if case == "answer_key":
        lines[1] = json.dumps({**arc_rows()[1], "answerKey": "D"})
    elif case == "json":
        lines[2] = '{"id": "q0-C", "question": "Which one is a colour?",'
    elif case == "empty":
        lines = []
    return "".join(line + "\n" for line in lines)


BAD_ARC = {  # case -> (--lm-eval-fewshot, the one line)
    "answer_key": ("0", r"arc\.jsonl:2: field 'answerKey' is 'D', not one of the labels in 'choices' \(A, B, C\)"),
    "json": ("0", r"arc\.jsonl:3: not valid JSON"),
    "empty": ("0", r"arc\.jsonl: no questions"),
    "shots": ("7", r"arc\.jsonl: 6 questions in split 'train' of task arc_local, fewer than --lm-eval-fewshot 7 takes"),
}


@pytest.mark.parametrize("case", list(BAD_ARC))
def test_a_malformed_arc_file_is_one_line_before_any_generation(case, tmp_path, tiny_model_dir, monkeypatch):
    """Issue 68: an answerKey not among the labels, a bad JSON line, an empty file, too few questions for the shots:
    one line naming the file, line and field (or the flag), before any policy generates or the harness runs."""
    shots, message = BAD_ARC[case]
    tasks = arc_task(tmp_path, None if case == "shots" else bad_arc(case))
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "p0", "instruction": "Say hi."}])

    def boom(*a, **k):
        raise AssertionError("generated before the ARC file was checked")

    import lm_eval

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(lm_eval, "simple_evaluate", boom)
    with pytest.raises(common.DataError, match=message) as e:
        ev.main(
            [
                "--task",
                "qa",
                "--data",
                str(data),
                "--policy",
                f"base={tiny_model_dir}",
                "--reward-model",
                "none",
                "--lm-eval-tasks",
                "arc_local",
                "--lm-eval-include-path",
                tasks,
                "--lm-eval-fewshot",
                shots,
                "--output-dir",
                str(tmp_path / "out"),
                "--device",
                "cpu",
            ]
        )
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_a_malformed_arc_file_exits_2_with_one_line(tmp_path, tiny_model_dir):
    tasks = arc_task(tmp_path, bad_arc("answer_key"))
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "p0", "instruction": "Say hi."}])
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "04_evaluate.py"),
            "--task",
            "qa",
            "--data",
            str(data),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            "none",
            "--lm-eval-tasks",
            "arc_local",
            "--lm-eval-include-path",
            tasks,
            "--lm-eval-fewshot",
            "0",
            "--output-dir",
            str(tmp_path / "out"),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'arc.jsonl'}:2: field 'answerKey' is 'D', not one of the labels in 'choices' (A, B, C) "
        "(task arc_local)"
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------------
# AlpacaEval 2.0: 04's verdicts and the answers' lengths through the package's own GLM
# ----------------------------------------------------------------------------------------------------------------------


def verdict_fixture(n: int = 80, seed: int = 0, exploit: bool = False):
    """(records, the policy's answers, 04's judge rows) of n prompts with answers of random lengths: verdicts at
    random, ties and invalid ones among them; or (exploit) a judge that cares for length alone, preferring the longer
    answer the more the longer it is (P = logistic(3 tanh(difference / 200 characters))), to a policy that writes
    150 characters more than the reference on average: its raw win rate is high, its quality at equal length even."""
    rng = random.Random(seed)
    records, answers, verdicts = [], [], []
    for i in range(n):
        ref = rng.randint(200, 600)
        ans = max(10, int(ref + rng.gauss(150, 200))) if exploit else rng.randint(50, 600)
        if exploit:
            winner = "pol" if rng.random() < 1 / (1 + math.exp(-3 * math.tanh((ans - ref) / 200))) else "ref"
        else:
            winner = rng.choice(["pol", "pol", "ref", "tie", None])
        records.append({"id": f"p{i}", "prompt": f"instruction {i}", "reference": "r" * ref})
        answers.append("a" * ans)
        verdicts.append({"id": f"p{i}", "winner": winner})
    return records, answers, verdicts


def package_annotations(records, answers, verdicts):
    """The package's annotation layout, written out by hand from its docs: preference 1 when the baseline
    (generator_1) wins, 2 when the model to compare (generator_2) wins, 1.5 for a draw."""
    code = {"ref": 1.0, "pol": 2.0, "tie": 1.5}
    return [
        {
            "index": i,
            "instruction": r["prompt"],
            "output_1": r["reference"],
            "output_2": a,
            "generator_1": "ref",
            "generator_2": "pol",
            "annotator": "judge",
            "preference": code[v["winner"]],
        }
        for i, (r, a, v) in enumerate(zip(records, answers, verdicts))
        if v["winner"]
    ]


@pytest.fixture
def hub_table(tmp_path, monkeypatch):
    """The package's hub table (df_gamed.csv: each instruction's difficulty, and the annotations of two length-gamed
    baselines that length_controlled_v1 regularises towards), as a local fixture."""
    glm_winrate = need("alpaca_eval.metrics.glm_winrate")
    import pandas as pd

    rng = random.Random(1)
    rows = [
        {
            "model": m,
            "index": i,
            "instruction_difficulty": rng.gauss(0, 1),
            "preference": rng.random(),
            "std_delta_len": rng.gauss(0, 1),
            "not_gamed_baseline": False,
        }
        for m in ("gamed_verbose", "gamed_concise")
        for i in range(80)
    ]
    path = tmp_path / "df_gamed.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    monkeypatch.setattr(glm_winrate, "hf_hub_download", lambda *a, **k: str(path))
    return glm_winrate


@pytest.mark.parametrize("glm", ["length_controlled_v1", "length_controlled_minimal"])
def test_alpaca_eval_win_rates_are_the_package_s_own(hub_table, glm):
    import pandas as pd

    records, answers, verdicts = verdict_fixture()
    rows = alpaca_lc.annotations(records, answers, verdicts, "pol", "ref", "judge")
    assert len(rows) == sum(v["winner"] is not None for v in verdicts) < len(records)  # invalid ones left out
    got = alpaca_lc.length_controlled(rows, glm)
    want = hub_table.get_length_controlled_winrate(
        pd.DataFrame(package_annotations(records, answers, verdicts)),
        glm_info=hub_table.GLM_INFO[glm],
        save_weights_dir=None,
    )
    assert got["win_rate"] == pytest.approx(want["win_rate"])
    assert got["length_controlled_winrate"] == pytest.approx(want["length_controlled_winrate"])
    assert got["lc_standard_error"] == pytest.approx(want["lc_standard_error"])
    wins = sum(v["winner"] == "pol" for v in verdicts) + 0.5 * sum(v["winner"] == "tie" for v in verdicts)
    assert got["win_rate"] == pytest.approx(100 * wins / len(rows))  # raw: wins + ties / 2, by hand


@pytest.mark.parametrize("glm", ["length_controlled_v1", "length_controlled_minimal"])
def test_the_lc_win_rate_s_interval_is_a_bootstrap_over_prompts_that_refits_the_glm(hub_table, glm):
    """Issue 68: the interval was +-1.96 times the package's lc_standard_error, the spread of its predictions over the
    instructions, which the minimal GLM makes equal: 85.29 [85.29, 85.29], standard error 3.4e-15. Now: the package's
    own function refitted on prompts drawn with replacement, its 2.5/97.5 percentiles."""
    import numpy as np
    import pandas as pd

    records, answers, verdicts = verdict_fixture()
    rows = alpaca_lc.annotations(records, answers, verdicts, "pol", "ref", "judge")
    got = alpaca_lc.length_controlled(rows, glm, n_boot=30, seed=4)
    lo, hi = got["lc_ci95"]
    assert lo < got["length_controlled_winrate"] < hi and hi - lo > 5  # 68 prompts: several points wide
    table = pd.DataFrame(package_annotations(records, answers, verdicts))
    draws = np.random.default_rng(4).integers(0, len(table), size=(30, len(table)))
    want = [
        hub_table.get_length_controlled_winrate(
            table.iloc[i].reset_index(drop=True), glm_name=glm, save_weights_dir=None
        )["length_controlled_winrate"]
        for i in draws
    ]
    assert [lo, hi] == pytest.approx(list(np.percentile(want, [2.5, 97.5])))
    assert got["lc_resamples"] == 30 and got["lc_boot_stderr"] == pytest.approx(np.std(want, ddof=1))
    if glm == "length_controlled_minimal":
        assert got["lc_standard_error"] < 1e-9  # the package's own: zero by construction, never an interval


def test_an_lc_interval_that_cannot_be_had_is_n_a_with_the_reason(hub_table):
    records, answers, verdicts = verdict_fixture()
    rows = alpaca_lc.annotations(records, answers, verdicts, "pol", "ref", "judge")
    got = alpaca_lc.length_controlled(rows, "length_controlled_minimal", n_boot=0)
    assert got["lc_ci95"] is None and got["lc_ci95_na"] == "no resamples (--bootstrap 0)"
    res = {
        "policies": {"pol": {}},
        "table4": {
            "alpaca_eval": {
                "reference": "ref",
                "judge": "j",
                "glm": "length_controlled_minimal",
                "n_prompts": 80,
                "policies": {
                    "pol": {
                        "lc_win_rate": {"value": 55.0, "ci95": None, "ci95_na": got["lc_ci95_na"]},
                        "win_rate": {"value": 60.0, "ci95": [50.0, 70.0]},
                        "invalid": 0,
                    }
                },
            }
        },
    }
    lines = table4.console_lines(res)
    assert any(line.split()[-2:] == ["55.00", "[n/a]"] for line in lines if line.startswith("AlpacaEval 2.0 LC"))
    assert "note: AlpacaEval pol: LC win rate's interval n/a: no resamples (--bootstrap 0)" in lines
    assert "[n/a]" in table4.render_html(res)
    wins = alpaca_lc.annotations(records, answers, [{**v, "winner": "pol"} for v in verdicts], "pol", "ref", "judge")
    got = alpaca_lc.length_controlled(wins, "length_controlled_minimal", n_boot=20)
    assert got["lc_ci95"] is None and got["lc_ci95_na"] == "all 80 verdicts are wins: every resample is the same data"


def test_a_judge_that_prefers_longer_answers_gets_a_lower_lc_than_raw_win_rate(hub_table):
    records, answers, verdicts = verdict_fixture(n=200, exploit=True)
    got = alpaca_lc.length_controlled(
        alpaca_lc.annotations(records, answers, verdicts, "pol", "ref", "judge"), "length_controlled_minimal"
    )
    assert got["win_rate"] > 60 and got["length_controlled_winrate"] < got["win_rate"] - 10
    assert got["length_controlled_winrate"] == pytest.approx(50, abs=5)  # even at equal length, as built


def step_judge(records, answers) -> list[dict]:
    """A judge that prefers the longer answer on every pair (a tie at equal length)."""
    return [
        {
            "id": r["id"],
            "winner": "pol" if len(a) > len(r["reference"]) else "ref" if len(a) < len(r["reference"]) else "tie",
        }
        for r, a in zip(records, answers)
    ]


def test_a_judge_that_prefers_the_longer_answer_on_every_pair_is_not_undone_by_lc(hub_table):
    """docs/table4.md, measured: LC removes a length preference as far as its GLM's form (a logistic in tanh of the
    length difference) describes it (the test above). A judge that decides by length alone is a step, which the GLM
    separates perfectly and cannot pin down: on three draws of 805 prompts, the raw rate stays at 76-78 while LC swings
    over 50 points, once above raw (the independent check of issue 68: LC 85.29, raw 81.40), its intervals wide."""
    lcs, raws = [], []
    for seed in (0, 1, 2):
        records, answers, _ = verdict_fixture(n=805, seed=seed, exploit=True)
        rows = alpaca_lc.annotations(records, answers, step_judge(records, answers), "pol", "ref", "judge")
        got = alpaca_lc.length_controlled(rows, "length_controlled_minimal", n_boot=20)
        raws.append(got["win_rate"])
        lcs.append(got["length_controlled_winrate"])
        lo, hi = got["lc_ci95"]
        assert hi - lo > 15
    assert all(75 < r < 78 for r in raws) and max(lcs) - min(lcs) > 50 and max(lcs) > max(raws)
    doc = " ".join((ROOT / "docs/table4.md").read_text().split())
    assert "raises the raw rate and not the LC one" not in doc
    assert all(f"{v:.2f}" in doc for v in lcs + raws), "docs/table4.md quotes these numbers"


def test_the_minimal_glm_reads_no_hub_table(monkeypatch):
    glm_winrate = need("alpaca_eval.metrics.glm_winrate")

    def no_download(*a, **k):
        pytest.fail("no hub download")

    monkeypatch.setattr(glm_winrate, "hf_hub_download", no_download)
    records, answers, verdicts = verdict_fixture(n=900)  # more prompts than AlpacaEval has
    rows = alpaca_lc.annotations(records, answers, verdicts, "pol", "ref", "judge")
    assert 0 < alpaca_lc.length_controlled(rows, "length_controlled_minimal")["length_controlled_winrate"] < 100
    assert glm_winrate.hf_hub_download is no_download  # put back as it was


def test_the_glm_and_the_caveats_follow_the_setting():
    args = ev.parse_args(["--data", "data/alpaca_eval_gpt4_baseline.json", "--alpaca-eval"])
    assert alpaca_lc.glm_name(args) == "length_controlled_v1"
    assert alpaca_lc.glm_name(ev.parse_args(["--data", "mine.jsonl"])) == "length_controlled_minimal"
    paper = {
        "reference": "gpt4_1106_preview",
        "judge": "gpt-4-1106-preview",
        "n_prompts": 805,
        "glm": "length_controlled_v1",
    }
    assert alpaca_lc.not_comparable(paper) == []
    other = alpaca_lc.not_comparable({**paper, "judge": "qwen2.5-72b", "reference": "llama", "n_prompts": 100})
    assert [line.split(" ")[0] for line in other] == ["reference", "judge", "100"]
    assert judge.judge_pair_list("none", ["a", "b"]) == []


# ----------------------------------------------------------------------------------------------------------------------
# MT-Bench: two-turn answers, FastChat's prompts and score pattern, invalid verdicts
# ----------------------------------------------------------------------------------------------------------------------


def question_file(tmp_path) -> str:
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it sadder."]},
        {"question_id": 2, "category": "math", "turns": ["What is 2 + 3?", "And times 4?"]},
    ]
    common.write_jsonl(tmp_path / "q.jsonl", rows)
    common.write_jsonl(tmp_path / "ref.jsonl", [{"question_id": 2, "choices": [{"turns": ["5", "20"]}]}])
    return str(tmp_path / "q.jsonl"), str(tmp_path / "ref.jsonl")


def grader(body, n):
    """The fake judge: a verdict per (question, turn), one of them without any rating."""
    user = body["messages"][1]["content"]
    second = "<|The Start of Assistant A's Conversation" in user
    if "haiku" in user:
        return "Vivid. Rating: [[7]]" if not second else "Sadder indeed. [[8.5]]"
    return "Correct, [3] points" if not second else "I cannot rate this."


def test_mt_bench_grades_each_turn_with_fastchat_s_prompts(tmp_path, fake_openai):
    questions = mt_bench.read_questions(*question_file(tmp_path))
    assert questions[0]["reference"] is None and questions[1]["reference"] == ["5", "20"]
    answers = [
        {"id": "1", "turns": ["Rain falls soft", "Rain falls, no one comes"]},
        {"id": "2", "turns": ["It is 5.", "It is 20."]},
    ]
    args = ev.parse_args(["--judge-model", "judge-x", "--judge-concurrency", "2"])
    with fake_openai(grader) as server:
        args.judge_base_url = server.base_url
        verdicts = mt_bench.judge_turns("pol", questions, answers, "fp", args, tmp_path / "eval")
    assert [(v["id"], v["prompt"], v["score"]) for v in verdicts] == [
        ("1/1", "single-v1", 7.0),
        ("1/2", "single-v1-multi-turn", 8.5),
        ("2/1", "single-math-v1", 3.0),
        ("2/2", "single-math-v1-multi-turn", None),
    ]
    prompts = mt_bench.read_prompts()
    sent = {(r["body"]["messages"][1]["content"]): r["body"] for r in server.requests}
    for body in sent.values():
        assert body["model"] == "judge-x" and body["temperature"] == 0 and body["max_tokens"] == 2048
    math_two = next(b for u, b in sent.items() if "And times 4?" in u and "Reference Answer" in u)
    assert math_two["messages"][0]["content"] == prompts["single-math-v1-multi-turn"]["system_prompt"]
    user = math_two["messages"][1]["content"]
    assert user == prompts["single-math-v1-multi-turn"]["prompt_template"].format(
        question_1="What is 2 + 3?",
        question_2="And times 4?",
        answer_1="It is 5.",
        answer_2="It is 20.",
        ref_answer_1="5",
        ref_answer_2="20",
    )
    scores = mt_bench.summarize(verdicts, n_boot=100)
    assert scores["turn1"]["value"] == pytest.approx(5.0) and scores["turn1"]["n"] == 2
    assert scores["turn2"]["value"] == pytest.approx(8.5) and scores["turn2"]["n"] == 1
    assert scores["mean"]["value"] == pytest.approx((7 + 8.5 + 3) / 3)
    assert scores["invalid"] == {"turn1": 0, "turn2": 1}
    lo, hi = scores["turn1"]["ci95"]
    assert lo == pytest.approx(3.0) and hi == pytest.approx(7.0)


def test_parse_score_reads_as_fastchat_does():
    assert mt_bench.parse_score("Rating: [[7]]") == 7.0 and mt_bench.parse_score("[[6.5]] then [[9]]") == 6.5
    assert mt_bench.parse_score("I'd say [4] overall") == 4.0 and mt_bench.parse_score("[[4]] or [9]") == 4.0
    assert mt_bench.parse_score("seven out of ten") is None and mt_bench.parse_score("") is None


def test_turn_two_is_asked_after_turn_one_and_the_policy_s_own_answer(tiny_chat_model_dir, tmp_path, monkeypatch):
    questions = mt_bench.read_questions(*question_file(tmp_path))
    args = ev.parse_args(["--mt-bench-max-new-tokens", "4", "--seed", "3"])
    seen = []

    def answer(model, tok, prompts, max_new_tokens, temperature, *a, **k):  # each answer says which call wrote it
        seen.append(([tok.decode(p) for p in prompts], temperature, max_new_tokens))
        return [tok(f" answer {len(seen)}.{j} ", add_special_tokens=False)["input_ids"] for j in range(len(prompts))]

    monkeypatch.setattr(models, "generate", answer)
    answers, _ = mt_bench.answer_turns(
        "pol", tiny_chat_model_dir, questions, args, tmp_path, lambda path: models.load_model(path)
    )
    assert [(len(p), t, m) for p, t, m in seen] == [(1, 0.0, 4), (1, 0.7, 4), (1, 0.0, 4), (1, 0.7, 4)]  # FastChat's
    assert {a["id"]: a["turns"] for a in answers} == {
        "2": ["answer 1.0", "answer 3.0"],  # temperatures: math 0
        "1": ["answer 2.0", "answer 4.0"],
    }  # writing 0.7
    assert seen[2][0] == ["<s>user: What is 2 + 3?\n<s>assistant: answer 1.0\n<s>user: And times 4?\n<s>assistant: "]
    assert seen[0][0] == ["<s>user: What is 2 + 3?\n<s>assistant: "]


def test_bad_question_files_are_one_line_naming_file_line_and_field(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"question_id": 1, "category": "writing", "turns": ["a", "b"]}\n'
        '{"question_id": 2, "category": "writing", "turns": ["only one"]}\n'
    )
    with pytest.raises(common.DataError, match=r"q.jsonl:2: field 'turns' must be a list of two strings"):
        mt_bench.read_questions(path)
    path.write_text('{"question_id": 7, "category": "math", "turns": ["a", "b"]}\n')
    with pytest.raises(common.DataError, match=r"q.jsonl:1: a math question needs a reference answer .* 7"):
        mt_bench.read_questions(path)


@pytest.mark.parametrize(
    "flag, value, least",
    [
        ("--mt-bench-limit", "0", 1),
        ("--mt-bench-limit", "-2", 1),
        ("--lm-eval-limit", "0", 1),
        ("--lm-eval-fewshot", "-1", 0),
    ],
)
def test_a_limit_below_its_least_is_one_line_naming_the_flag_before_any_generation(
    flag, value, least, tmp_path, tiny_model_dir, monkeypatch
):
    """Issue 68: --mt-bench-limit 0 generated every answer first, then failed with "no such file"."""
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "p0", "instruction": "Say hi."}])

    def boom(*a, **k):
        raise AssertionError("generated before the flags were checked")

    monkeypatch.setattr(models, "load_model", boom)
    with pytest.raises(common.DataError, match=rf"^{flag} {value}: at least {least}"):
        ev.main(
            [
                "--task",
                "qa",
                "--data",
                str(data),
                "--policy",
                f"base={tiny_model_dir}",
                "--reward-model",
                "none",
                "--mt-bench",
                "--judge-base-url",
                "http://127.0.0.1:9/v1",
                flag,
                value,
                "--output-dir",
                str(tmp_path / "out"),
                "--device",
                "cpu",
            ]
        )
    assert not (tmp_path / "out").exists()


def test_fastchat_s_files_are_its_own():
    """tasks/mt_bench/ holds FastChat's files unchanged (lm-sys/FastChat at 0e6d3e4b, fastchat/llm_judge/data/)."""
    want = {
        "question.jsonl": "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        "reference_gpt-4.jsonl": "f957a5bc977badb66885ec970e6cd08527845780313f0995764260e5777b9b3f",
        "judge_prompts.jsonl": "fd283293406d024f44c174b094ef48031d0687a4682fd3a56b29b138f80281b6",
    }
    for name, digest in want.items():
        assert hashlib.sha256((ROOT / "tasks/mt_bench" / name).read_bytes()).hexdigest() == digest, name
    questions = mt_bench.read_questions(mt_bench.DATA / "question.jsonl", mt_bench.DATA / "reference_gpt-4.jsonl")
    assert len(questions) == 80 and sum(q["reference"] is not None for q in questions) == 30


# ----------------------------------------------------------------------------------------------------------------------
# All of it through 04 with the fake judge: results.json, the console table, the report
# ----------------------------------------------------------------------------------------------------------------------


def test_alpaca_eval_and_mt_bench_through_04(tiny_chat_model_dir, tmp_path, fake_openai, capsys, monkeypatch):
    need("alpaca_eval.metrics.glm_winrate")
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(
        data, [{"id": f"p{i}", "instruction": f"Name a fruit, {i}.", "output": "x" * (5 + 7 * i)} for i in range(16)]
    )
    questions, refs = question_file(tmp_path)

    def reply(body, n):
        user = body["messages"][-1]["content"]
        if "### Response A" in user:  # 04's pairwise judge: the longer answer wins, a tie now and then
            a, b = user.split("### Response A\n", 1)[1].split("\n\n### Response B\n")
            b = b.split("\n\nExplain briefly")[0]
            return "Winner: tie" if len(a) == len(b) else f"Winner: {'A' if len(a) > len(b) else 'B'}"
        return grader(body, n)

    with fake_openai(reply) as server:
        argv = [
            "--task",
            "qa",
            "--data",
            str(data),
            "--reference-field",
            "output",
            "--policy",
            f"pol={tiny_chat_model_dir}",
            "--reward-model",
            "none",
            "--max-new-tokens",
            "6",
            "--judge-base-url",
            server.base_url,
            "--judge-model",
            "fake-judge",
            "--alpaca-eval",
            "--mt-bench",
            "--mt-bench-questions",
            questions,
            "--mt-bench-references",
            refs,
            "--mt-bench-max-new-tokens",
            "3",
            "--output-dir",
            str(tmp_path / "out"),
            "--device",
            "cpu",
            "--bootstrap",
            "50",
        ]
        results = ev.main(argv)
    t4 = json.loads((tmp_path / "out/results.json").read_text())["table4"]
    assert t4 == json.loads(json.dumps(results["table4"]))
    ae = t4["alpaca_eval"]
    assert ae["glm"] == "length_controlled_minimal" and ae["reference"] == "gpt4_1106_preview"
    pol = ae["policies"]["pol"]
    assert pol["win_rate"]["n"] == 16 and pol["invalid"] == 0
    assert pol["win_rate"]["ci95"][0] <= pol["win_rate"]["value"] <= pol["win_rate"]["ci95"][1]
    lo, hi = pol["lc_win_rate"]["ci95"]
    assert lo <= pol["lc_win_rate"]["value"] <= hi and hi - lo > 1  # a bootstrap that refits the GLM: never zero-wide
    mt = t4["mt_bench"]["policies"]["pol"]
    assert mt["turn1"]["value"] == pytest.approx(5.0) and mt["invalid"] == {"turn1": 0, "turn2": 1}
    out = capsys.readouterr().out
    assert "AlpacaEval 2.0 LC win rate (%)" in out and "MT-Bench turn 2" in out
    assert "note: MT-Bench: not comparable with the paper's Table 4: judge fake-judge" in out
    assert "note: AlpacaEval 2.0: not comparable with the paper's Table 4: 16 prompts" in out
    assert "MT-Bench pol: invalid verdicts (no [[rating]]): turn 1: 0, turn 2: 1" in out
    page = (tmp_path / "out/report.html").read_text()
    assert "MT-Bench score" in page and "GLM length_controlled_minimal" in page and "class='caveats'" in page
    assert table4.console_lines({"policies": {}}) == [] and table4.render_html({"policies": {}}) == ""
