"""Bring your own critic (critics/: the contract; critics/plugin.py): one Python function drives 03's PPO (--critic
python:...), annotates in 01 (--annotator) and judges policies in 04 (--monitor); a record it raises on never ends a
run; a bad plug-in is one line, exit 2, before any work."""

import math
import sys

import pytest
import torch
from transformers import AutoTokenizer

import common
import critics
from critics import plugin
from tasks.demo import demo_critic, demo_dataset
import forkserver
from conftest import ROOT, import_script

ppo = import_script("03_train_policy")
annotate = import_script("01_annotate")
ev = import_script("04_evaluate")

# A user's critic, written outside the project: every third word of an answer is -1, the whole answer +0.25 (the two
# overlap: the lowest reward wins), the first word +1 (overlapped by the +0.25: it gets 0.25). It raises on the records
# whose id ends in an odd digit.
MY_CRITIC = """
import re

def critic(records, responses):
    out = []
    for rec, response in zip(records, responses):
        if rec.get("id", "0")[-1] in "13579":
            raise RuntimeError(f"cannot judge {rec['id']}")
        words = list(re.finditer(r"\\w+", response))
        spans = [{"start": 0, "end": len(response), "reward": 0.25}]
        spans += [{"start": m.start(), "end": m.end(), "reward": 1.0} for m in words[:1]]
        spans += [{"start": m.start(), "end": m.end(), "reward": -1.0} for m in words[2::3]]
        out.append({"critique": f"{len(words)} words", "spans": spans})
    return out
"""


@pytest.fixture
def my_critic(tmp_path_factory):
    path = tmp_path_factory.mktemp("elsewhere") / "my_critic.py"
    path.write_text(MY_CRITIC)
    return f"python:{path}:critic"


def expected_delta(text: str, offsets, spans) -> list:
    """The documented rule, written out: a token takes the lowest reward of the intervals its non-whitespace part
    (a whitespace-only token: all of it) lies inside; one straddling a negative interval's edge is never above 0; 0
    elsewhere. Empty tokens (part of a character): None."""
    out = []
    for s, e in offsets:
        piece = text[s:e]
        if s == e:
            out.append(None)
            continue
        if piece.strip():
            s, e = s + len(piece) - len(piece.lstrip()), e - (len(piece) - len(piece.rstrip()))
        inside = [x["reward"] for x in spans if x["start"] <= s and e <= x["end"]]
        straddles = [
            0.0
            for x in spans
            if x["reward"] < 0 and x["start"] < e and s < x["end"] and not (x["start"] <= s and e <= x["end"])
        ]
        out.append(min(inside + straddles, default=0.0))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The rule: intervals with real rewards -> delta_t
# ---------------------------------------------------------------------------------------------------------------------


def test_interval_rewards_lowest_wins_and_straddling_tokens_get_nothing():
    text = " tom has a red dog"
    offsets = [(0, 4), (4, 8), (8, 10), (10, 14), (14, 18)]  # " tom", " has", " a", " red", " dog"
    spans = [(0, 18, 0.5), (9, 14, -0.3), (11, 18, 0.9), (15, 17, -1.0)]
    # " tom": only the whole (0.5); " has": 0.5; " a": inside 0.5 and -0.3 -> -0.3; " red": 0.5, -0.3 and 0.9 ->
    # -0.3; " dog": 0.5 and 0.9, and it straddles the -1.0 interval "do" -> 0.
    assert common.interval_rewards(text, offsets, spans) == [0.5, 0.5, -0.3, -0.3, 0.0]
    assert common.interval_rewards(text, offsets, [{"start": 11, "end": 14, "reward": 0.7}]) == [0, 0, 0, 0.7, 0]
    assert common.interval_rewards(text, offsets, [(11, 11, -1.0)]) == [0.0] * 5  # an empty interval labels nothing


def test_plus_and_minus_one_intervals_are_span_rewards():
    text, good, poor = " tom has a red dog called rex rex.", [" tom has", " red dog called"], [" rex", "dog called"]
    offsets = [(0, 4), (4, 8), (8, 10), (10, 14), (14, 18), (18, 25), (25, 29), (29, 33), (33, 34)]
    good_iv, poor_iv, _ = common.locate_spans(text, good, poor)
    spans = [(a, b, 1.0) for a, b in good_iv] + [(a, b, -1.0) for a, b in poor_iv]
    assert common.interval_rewards(text, offsets, spans) == common.span_rewards(text, offsets, good, poor)[0]


# ---------------------------------------------------------------------------------------------------------------------
# Items, failures, bad plug-ins
# ---------------------------------------------------------------------------------------------------------------------


def test_a_record_the_critic_raises_on_fails_alone():
    def fussy(records, responses):
        if any("bad" in r for r in responses):
            raise RuntimeError("bad\nand a second line")
        return [{"good_spans": [r.split()[0]], "poor_spans": []} for r in responses]

    items = critics.call(fussy, "m:fussy", [{"prompt": "p"}] * 3, ["fine one", "bad one", "fine two"])
    assert [i["good_spans"] for i in items] == [["fine"], [], ["fine"]]
    assert items[1]["critique"] is None and items[1]["critic_error"] == "m:fussy raised RuntimeError: bad"
    wrong = critics.call(lambda recs, texts: [{"spans": [{"start": 0, "end": 99, "reward": -1}]}], "m:f", [{}], ["x"])
    assert wrong[0]["critic_error"].startswith("m:f returned a bad item: span [0, 99) is not a character interval")


BAD = {
    "does-not-import": (
        "import no_such_module_t2g\ndef critic(records, responses):\n    return []\n",
        "LABEL: PATH does not import (ModuleNotFoundError: No module named 'no_such_module_t2g')",
    ),
    "missing-function": ("def other(records, responses):\n    return []\n", "LABEL: PATH has no function 'critic'"),
    "wrong-length": (
        "def critic(records, responses):\n    return []\n",
        "LABEL: returned 0 items for 2 responses (the first record twice; one per response)",
    ),
    "one-item-whatever-the-batch": (  # issue 80, item 7: passed a one-record preflight, failed after the SFT start
        "def critic(records, responses):\n    return [{'good_spans': [], 'poor_spans': []}]\n",
        "LABEL: returned 1 items for 2 responses (the first record twice; one per response)",
    ),
    "wrong-shape": (
        "def critic(records, responses):\n    return [{'spans': [[0, 3, -1]]} for _ in responses]\n",
        "LABEL: a span must be {'start', 'end', 'reward'}, got [0, 3, -1]",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_plugin_is_one_line_exit_2_before_any_training(tmp_path, tiny_model_dir, case):
    source, message = BAD[case]
    path = tmp_path / "my_bad.py"
    path.write_text(source)
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            tiny_model_dir,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--sft-data",
            str(tmp_path / "prompts.jsonl"),
            "--critic",
            f"python:{path}:critic",
            "--output-dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = message.replace("LABEL", f"{path}:critic").replace("PATH", str(path))
    assert proc.stderr.strip().splitlines()[-1] == f"error: --critic {message}"
    assert not (tmp_path / "run").exists()  # before the SFT warm start, before anything is written
    with pytest.raises(common.DataError, match=r"^--annotator .*my_bad\.py:critic"):
        annotate.main(
            [
                "--dataset",
                str(tmp_path / "prompts.jsonl"),
                "--annotator",
                f"python:{path}:critic",
                "--output",
                str(tmp_path / "a.jsonl"),
            ]
        )
    with pytest.raises(common.DataError, match=r"^--monitor .*my_bad\.py:critic"):
        ev.main(
            [
                "--data",
                str(tmp_path / "prompts.jsonl"),
                "--policy",
                f"p={tiny_model_dir}",
                "--reward-model",
                "none",
                "--monitor",
                f"python:{path}:critic",
                "--output-dir",
                str(tmp_path / "ev"),
            ]
        )
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "ev" / "results.json").exists()


def test_program_is_the_tasks_own_plugin():
    rec = demo_dataset("train", 1)[0]
    fn, label = plugin.load_critic("program", "demo", "--critic")
    assert label == "tasks.demo:critic" and fn([rec], [rec["response"]]) == [
        demo_critic(rec["prompt"], rec["response"])
    ]
    assert critics.call(fn, label, [{"prompt": "no post"}], ["x"])[0]["critic_error"].startswith("not a demo post")
    with pytest.raises(common.DataError, match="no programmatic critic for --task qa"):
        plugin.load_critic("program", "qa", "--critic")


# ---------------------------------------------------------------------------------------------------------------------
# One module, three stages
# ---------------------------------------------------------------------------------------------------------------------


def test_a_critic_outside_the_project_drives_ppo_annotates_and_monitors(tmp_path, tiny_model_dir, my_critic):
    prompts = tmp_path / "prompts.jsonl"
    common.write_jsonl(prompts, demo_dataset("train", 16))
    args = ppo.parse_args(
        [
            "--model",
            tiny_model_dir,
            "--prompts",
            str(prompts),
            "--critic",
            my_critic,
            "--output-dir",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--num-minibatches",
            "2",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "8",
            "--sft-steps",
            "0",
            "--device",
            "cpu",
            "--lora-r",
            "4",
            "--lora-alpha",
            "8",
            "--log-every",
            "1",
            "--trace-samples",
            "4",
        ]
    )
    critics.check_critic(args)
    ppo.train(args)
    samples = common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    traced = [s for row in common.read_jsonl(tmp_path / "run" / "trace.jsonl") for s in row["samples"]]
    assert len(samples) == len(traced) == 8
    failed = [s for s in samples if s.get("critic_error")]
    assert failed and len(failed) < 8  # a raise is that rollout's, never the run's
    fn, _ = plugin.load_critic(my_critic, "demo", "--critic")
    labelled = 0
    for t in traced:
        text, offsets, pos = "".join(t["tokens"]), [], 0
        for piece in t["tokens"]:
            offsets.append((pos, pos + len(piece)))
            pos += len(piece)
        sample = next(s for s in samples if s["response"] == text and s["prompt"] == t["prompt"])
        if sample.get("critic_error"):
            assert sample["critic_error"].startswith(f"{my_critic[7:]} raised RuntimeError: cannot judge demo-train-")
            assert set(t["delta"]) == {0.0} and sample["span_reward"] == 0.0 and sample["critique"] is None
            continue
        spans = fn([{"id": "0"}], [text])[0]["spans"]
        assert sample["spans"] == spans  # kept in samples.jsonl as the critic returned them
        want = expected_delta(text, offsets, spans)
        assert [d for d, w in zip(t["delta"], want) if w is not None] == [w for w in want if w is not None]
        labelled += sum(d != 0 for d in t["delta"])
    assert labelled  # the intervals landed on tokens

    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, demo_dataset("eval", 6))
    annotate.main(["--dataset", str(data), "--annotator", my_critic, "--output", str(tmp_path / "a.jsonl")])
    recs = {r["id"]: r for r in common.read_jsonl(tmp_path / "a.jsonl")}
    assert sorted(recs) == [f"demo-eval-{i}" for i in range(6)]
    for i, rec in enumerate(recs[f"demo-eval-{i}"] for i in range(6)):
        if i % 2:
            assert (
                rec["status"] == "failed"
                and rec["reason"] == f"{my_critic[7:]} raised RuntimeError: cannot judge demo-eval-{i}"
            )
            continue
        assert rec["status"] == "ok" and rec["spans"] == fn([{"id": "0"}], [rec["response"]])[0]["spans"]
        assert rec["good_spans"][0] == rec["response"] and rec["poor_spans"]  # the intervals as quotes too
        assert all(q in rec["response"] for q in rec["good_spans"] + rec["poor_spans"])

    results = ev.main(
        [
            "--data",
            str(data),
            "--policy",
            f"p={tiny_model_dir}",
            "--reward-model",
            "none",
            "--monitor",
            my_critic,
            "--max-new-tokens",
            "8",
            "--output-dir",
            str(tmp_path / "ev"),
            "--bootstrap",
            "50",
            "--device",
            "cpu",
        ]
    )
    metrics = results["policies"]["p"]["metrics"]
    assert metrics["monitor[my_critic.py:critic]/error_rate"]["value"] == 0.5  # the odd ids
    assert metrics["monitor[my_critic.py:critic]/flagged_rate"]["n"] == 6
    assert "your critic my_critic.py:critic" in (tmp_path / "ev" / "report.html").read_text()


def test_the_readme_critic_flags_a_repeated_word(tmp_path):
    import re

    block = next(
        b
        for b in re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
        if b.startswith('"""my_critic.py')
    )
    (tmp_path / "my_critic.py").write_text(block)
    fn, label = plugin.load_critic(f"python:{tmp_path / 'my_critic.py'}:critic", "demo", "--critic")
    response = " tom has a red dog called rex rex."
    item = critics.preflight(fn, label, {"prompt": "post: ..."}, response, "--critic")
    assert item["spans"] == [{"start": 30, "end": 33, "reward": -1.0}]  # the second "rex", the word only


def test_a_score_per_response_lands_on_its_last_token(tmp_path, tiny_model_dir):
    """docs/from_trl.md: a per-completion reward function ({"score": float}, TRL's one float per completion) is a critic:
    its score is delta on the response's last token only, as a scalar reward model's (baselines/scalar_rm.py:
    step_deltas), and 03 trains on it; a score that is not a finite number is a bad item."""
    item = critics.check_item({"score": -2.5}, "a b c")
    assert critics.delta("a b c", [(0, 1), (1, 3), (3, 5)], item)[0] == [0.0, 0.0, -2.5]
    for bad in (float("nan"), "1", True, None):
        with pytest.raises(ValueError, match="score"):
            critics.check_item({"score": bad}, "a b c")
    (tmp_path / "my_reward.py").write_text(
        "def critic(records, responses):\n    return [{'score': -float(len(y.split()) > 4)} for y in responses]\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    common.write_jsonl(prompts, demo_dataset("train", 8))
    args = ppo.parse_args(
        [
            "--model",
            tiny_model_dir,
            "--prompts",
            str(prompts),
            "--critic",
            f"python:{tmp_path / 'my_reward.py'}:critic",
            "--output-dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--num-minibatches",
            "2",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "8",
            "--sft-steps",
            "0",
            "--device",
            "cpu",
            "--lora-r",
            "4",
            "--lora-alpha",
            "8",
            "--dump-rollouts",
            str(tmp_path / "dump"),
        ]
    )
    ppo.train(args)
    dump = torch.load(tmp_path / "dump" / "step1_rank0.pt", weights_only=False)
    for text, d, m in zip(dump["texts"], dump["delta"], dump["mask"]):
        n = int(m.sum())
        assert d[: n - 1].abs().sum() == 0 and d[n - 1] == -float(len(text.split()) > 4)


def test_a_score_beside_intervals_adds_to_the_last_tokens_reward(tmp_path, tiny_model_dir):
    """An item with "spans" and a "score" (the credit bench's poor_facts: -1 on each mistake, the facts stated at
    EOS): the intervals' rewards, and the score added on the last token, in the plug-in's delta and in 03's step 3."""
    item = critics.check_item({"spans": [{"start": 2, "end": 3, "reward": -1.0}], "score": 4.0}, "a b c")
    assert critics.delta("a b c", [(0, 1), (1, 3), (3, 5)], item)[0] == [0.0, -1.0, 4.0]
    item = critics.check_item({"spans": [{"start": 4, "end": 5, "reward": -1.0}], "score": 4.0}, "a b c")
    assert critics.delta("a b c", [(0, 1), (1, 3), (3, 5)], item)[0] == [0.0, 0.0, 3.0]  # on the same token: summed
    (tmp_path / "both.py").write_text(
        "def critic(records, responses):\n"
        "    return [{'spans': [{'start': 0, 'end': len(y), 'reward': -1.0}], 'score': 2.0} for y in responses]\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    common.write_jsonl(prompts, demo_dataset("train", 8))
    args = ppo.parse_args(
        [
            "--model",
            tiny_model_dir,
            "--prompts",
            str(prompts),
            "--critic",
            f"python:{tmp_path / 'both.py'}:critic",
            "--output-dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--num-minibatches",
            "2",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "8",
            "--sft-steps",
            "0",
            "--device",
            "cpu",
            "--lora-r",
            "4",
            "--lora-alpha",
            "8",
            "--dump-rollouts",
            str(tmp_path / "dump"),
        ]
    )
    ppo.train(args)
    dump = torch.load(tmp_path / "dump" / "step1_rank0.pt", weights_only=False)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text, ids, d, m in zip(dump["texts"], dump["response"], dump["delta"], dump["mask"]):
        n = int(m.sum())
        text, offsets = common.decode_with_offsets(tok, ids[:n].tolist())
        want = common.interval_rewards(text, offsets, [{"start": 0, "end": len(text), "reward": -1.0}])
        want[-1] += 2.0
        assert d[:n].tolist() == want and d[n:].abs().sum() == 0


def test_from_trl_maps_batch_size_as_trl_computes_it(tmp_path, monkeypatch):
    """Issue 67, item 5: TRL's PPOTrainer (0.12 and later, trl/trainer/ppo_trainer.py) sets local_batch_size =
    per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches and batch_size = local_batch_size *
    world_size, its rollouts per iteration. docs/from_trl.md left num_mini_batches out of 03's --batch-size, so a TRL
    config with num_mini_batches > 1 became fewer rollouts per iteration here, and smaller micro-batches."""
    trl = {"per_device_train_batch_size": 4, "world size": 2, "gradient_accumulation_steps": 3, "num_mini_batches": 5}
    trl_batch_size = (
        trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] * trl["num_mini_batches"]
    ) * trl["world size"]
    table = (ROOT / "docs/from_trl.md").read_text(encoding="utf-8")
    row = next(line for line in table.splitlines() if line.startswith("| ") and "| `--batch-size` |" in line)
    product = row.split(" | ")[0].strip("| ").split("(")[0]  # "`a` × world size × `b` ..."
    mapped = math.prod(trl[term.strip(" `")] for term in product.split("×"))
    assert mapped == trl_batch_size
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ppo.parse_args(
        [
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--batch-size",
            str(mapped),
            "--num-minibatches",
            "5",
            "--grad-accum",
            "3",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    micro = args.batch_size // 2 // args.num_minibatches // args.grad_accum  # 03's rows per forward with grad
    assert micro == trl["per_device_train_batch_size"]


def test_a_plugin_that_returns_the_wrong_number_of_items_mid_run_stops_the_run(tmp_path, tiny_model_dir):
    """Issue 56, item 2: a plug-in that returns two items whatever the batch passes the preflight (a batch of two;
    one item whatever the batch stops there: issue 80, above); on the first real batch it is a plug-in error (exit 2,
    one line naming MODULE:FUNCTION, the call and the lengths), not a run with every delta zero and "0 of 16
    critiques failed"."""
    path = tmp_path / "short.py"
    path.write_text("def short(records, responses):\n    return [{'good_spans': [], 'poor_spans': []}] * 2\n")
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 8))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            tiny_model_dir,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--sft-steps",
            "0",
            "--critic",
            f"python:{path}:short",
            "--output-dir",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--batch-size",
            "8",
            "--max-new-tokens",
            "8",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {path}:short: returned 2 items for 8 responses on its "
        "call 1 (one item per response): a plug-in error, not a failed "
        "record"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(common.DataError, match="returned a dict, not a list"):
        critics.call(lambda recs, texts: {"spans": []}, "m:f", [{}] * 2, ["a", "b"])


def test_a_critic_that_never_works_stops_stage_3(tmp_path, tiny_model_dir):
    """Issue 56, item 1: a critic whose every critique fails gives delta = 0 to every rollout, which reads as a flawless
    batch. Stage 3 stops with exit 2 and one line once most critiques failed --max-fail-iterations iterations in a
    row, its checkpoint saved there (fix the critic, --resume); and a run whose failures never come in such a row
    but add up to more than --max-fail-share still saves its policy, then exits 2 saying so."""
    path = tmp_path / "broken.py"
    path.write_text(
        "import itertools\nCALLS = itertools.count()\n"
        "def never(records, responses):\n    return [{'error': 'no answer'} for _ in responses]\n"
        "def mostly(records, responses):\n"
        "    ok = next(CALLS) % 3 == 2  # one batch in three is judged\n"
        "    return [{'good_spans': [], 'poor_spans': []} if ok else {'error': 'no answer'} "
        "for _ in responses]\n"
    )
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 8))
    base = [
        sys.executable,
        str(ROOT / "03_train_policy.py"),
        "--model",
        tiny_model_dir,
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--sft-steps",
        "0",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
        "--save-every",
        "100",
    ]
    proc = forkserver.run(
        [*base, "--critic", f"python:{path}:never", "--output-dir", str(tmp_path / "never"), "--steps", "10"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(
            "error: stage 3 stopped at iteration 3: most critiques failed (over --max-fail-share "
            "0.5) 3 iterations in a row"
        )
        and "no answer" in last
        and "--resume" in last
    ), last
    assert torch.load(tmp_path / "never" / "checkpoint.pt", weights_only=False)["step"] == 3
    assert len(common.read_jsonl(tmp_path / "never" / "metrics.jsonl")) == 3
    proc = forkserver.run(
        [*base, "--critic", f"python:{path}:mostly", "--output-dir", str(tmp_path / "mostly"), "--steps", "6"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: stage 3 finished, but 16 of 24 critiques failed (67%, over --max-fail-share 0.5)")
    )
    assert (tmp_path / "mostly" / "policy" / "adapter_config.json").is_file()
