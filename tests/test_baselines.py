"""The paper's baselines (§4.3, App. N): preference pairs and the Bradley-Terry reward model (02 --objective pairwise),
the process reward model (02 --objective prm), their critics in 03 (--critic scalar-rm, prm), all four in
baselines/scalar_rm.py; DPO (baselines/dpo.py)
and SFT + reflection (baselines/reflection_data.py, 04 --reflect). Losses against hand-computed values; the scalar
reward model's scores against transformers' own pooling; bad input as one line."""

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import forkserver
from conftest import import_script

import common
from infra import models, reward_models, runs
from infra.data import load_annotations, split_records
from tasks.demo import demo_critic, demo_dataset

ROOT = Path(__file__).resolve().parents[1]
rm = import_script("02_train_reward")
ppo = import_script("03_train_policy")
sys.path.insert(0, str(ROOT / "baselines"))
dpo = import_script("dpo")
reflection = import_script("reflection_data")
from baselines import scalar_rm  # noqa: E402
from critics.scalar import step_deltas  # noqa: E402


def annotated(prompt, response, rid):
    return {"id": rid, "prompt": prompt, "response": response, **demo_critic(prompt, response), "status": "ok"}


def pool(n: int) -> list[dict]:
    """Two annotated answers per demo post: its noisy summary and its reference (the demo critic judges both)."""
    return [
        annotated(ex["prompt"], resp, f"{ex['id']}/{k}") | {"reference": ex["reference"]}
        for ex in demo_dataset("annotate", n)
        for k, resp in (("a", ex["response"]), ("b", " " + ex["reference"]))
    ]


# ----------------------------------------------------------------------------------------------------------------------
# The losses, against values computed by hand
# ----------------------------------------------------------------------------------------------------------------------


def test_bradley_terry_loss_matches_hand_values():
    # -log sigmoid(1 - 0) = log(1 + e^-1) = 0.313262; -log sigmoid(0 - 2) = log(1 + e^2) = 2.126928
    loss = scalar_rm.bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]))
    assert loss.item() == pytest.approx((0.313262 + 2.126928) / 2, abs=1e-6)
    assert scalar_rm.bradley_terry_loss(torch.tensor([3.0]), torch.tensor([3.0])).item() == pytest.approx(math.log(2))


def test_prm_loss_matches_hand_values():
    # BCE with logits: label 1, s = 0 -> log 2; label 0, s = 2 -> log(1 + e^2) = 2.126928; the masked step counts not
    scores, labels = torch.tensor([[0.0, 2.0, 9.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    loss = scalar_rm.prm_loss(scores, labels, torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx((math.log(2) + 2.126928) / 2, abs=1e-6)


def test_dpo_loss_matches_hand_values():
    # beta 0.1: r_c = 0.1 * (-1 - -1.5) = 0.05, r_r = 0.1 * (-2 - -1.5) = -0.05; loss = log(1 + e^-0.1) = 0.644397
    loss, r_c, r_r = dpo.dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]), beta=0.1
    )
    assert (r_c.item(), r_r.item()) == pytest.approx((0.05, -0.05))
    assert loss.item() == pytest.approx(0.644397, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Pairs and steps
# ----------------------------------------------------------------------------------------------------------------------


def test_preference_pairs_fewer_poor_spans_wins_and_ties_give_none():
    p = "post: tom has a red dog called rex. the dog likes the park. it eats fish.\nsummary:"
    good = " tom has a red dog called rex that likes the park and eats fish."
    bad = " tom has a blue dog called rex that likes the park and eats fish fish."
    recs = [
        annotated(p, bad, "a"),
        annotated(p, good, "b"),  # a pair: b is chosen
        annotated(p + " ", good, "c"),
        annotated(p + " ", good, "d"),  # a tie: no pair
        annotated(p + "  ", good, "e"),
        {**annotated(p + "  ", bad, "f"), "status": "failed"},
    ]  # one usable answer
    pairs = scalar_rm.preference_pairs(recs)
    assert [(x["chosen_id"], x["rejected_id"]) for x in pairs] == [("b", "a")]
    assert pairs[0]["chosen"] == good and pairs[0]["rejected"] == bad


def test_preference_pairs_tests_passed_win_over_fewer_poor_spans():
    recs = [
        {"id": "x", "prompt": "q", "response": "a", "poor_spans": [], "passed": False},
        {"id": "y", "prompt": "q", "response": "b", "poor_spans": ["b"], "passed": True},
    ]
    assert [(x["chosen_id"], x["rejected_id"]) for x in scalar_rm.preference_pairs(recs)] == [("y", "x")]


def test_dataset_pairs_take_strings_and_chats(tmp_path):
    path = tmp_path / "prefs.jsonl"
    common.write_jsonl(
        path,
        [
            {"prompt": "hi", "chosen": "good", "rejected": "bad"},
            {
                "prompt": "yo",
                "chosen": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "fine"}],
                "rejected": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "no"}],
            },
        ],
    )
    pairs, source = scalar_rm.load_pairs(str(path))
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [("hi", "good", "bad"), ("yo", "fine", "no")]
    assert source == "the dataset's pairs"


def test_split_steps_cuts_clauses_and_code_blocks():
    text = " tom has a red dog called rex that likes the park, and eats fish."
    steps = scalar_rm.split_steps(text)
    assert [text[a:b] for a, b in steps] == ["tom has a red dog called rex", "that likes the park,", "and eats fish."]
    code = "import os\n\ndef f(x):\n    if x:\n        return 1\n    else:\n        return 2\nprint(f(1))\n"
    assert [code[a:b] for a, b in scalar_rm.split_steps(code, "block")] == [
        "import os",
        "def f(x):\n    if x:\n        return 1\n    else:\n        return 2",
        "print(f(1))",
    ]


def test_step_labels_mark_the_steps_a_poor_span_falls_in():
    p = "post: tom has a red dog called rex. the dog likes the park. it eats fish.\nsummary:"
    text = " tom has a red dog called rex that likes the beach and eats fish fish."
    fb = demo_critic(p, text)  # poor: " beach" (wrong), the second " fish" (repeated)
    assert scalar_rm.step_labels(text, scalar_rm.split_steps(text), fb["good_spans"], fb["poor_spans"]) == [1, 0, 0]


def test_step_deltas_put_each_reward_on_the_steps_last_token():
    offsets = [(0, 4), (4, 8), (8, 13), (13, 13)]  # " tom", " has", " fish", EOS
    assert step_deltas(offsets, [(8, 0.5), (13, -0.25)]) == [0.0, 0.5, -0.25, 0.0]
    assert step_deltas(offsets, [(None, 2.0)]) == [0.0, 0.0, 0.0, 2.0]  # the scalar RM: the last token (EOS)


# ----------------------------------------------------------------------------------------------------------------------
# The scalar reward model: its scores, training (02 --objective pairwise / prm), use in 03, refusals
# ----------------------------------------------------------------------------------------------------------------------


def test_scores_are_read_at_the_eos_as_transformers_pools_them(tiny_model_dir):
    """score_responses (left-padded batches, the score at each row's EOS) against transformers' own pooled logits of
    each input alone (the last token, the EOS: the tiny tokenizer's pad is a distinct token)."""
    model, tok = models.load_model(tiny_model_dir, scalar_head=True)
    prompts = ["post: tom has a dog.\nsummary:", "post: a much longer post about anna and her cat.\nsummary:"]
    responses = [" tom has a dog.", " anna"]
    ours = [s[0] for s in scalar_rm.score_responses(model, tok, prompts, responses, batch_size=2)]
    for p, r, s in zip(prompts, responses, ours):
        ids = scalar_rm.scalar_rm_input(tok, p, r)[0]
        assert ids[-1] == tok.eos_token_id
        with torch.no_grad():
            assert s == pytest.approx(model(input_ids=torch.tensor([ids])).logits[0, 0].item(), abs=1e-5)


def test_scores_ignore_a_pad_that_equals_eos(tiny_model_dir):
    """With pad == EOS (SmolLM2), transformers' pooling reads the token before the EOS; ours still reads the EOS."""
    model, tok = models.load_model(tiny_model_dir, scalar_head=True)
    ids = scalar_rm.scalar_rm_input(tok, "post: tom.\nsummary:", " tom")[0]
    with torch.no_grad():
        at = scalar_rm.scalar_rm_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        model.config.pad_token_id = tok.eos_token_id
        pooled = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert pooled == pytest.approx(at[-2].item(), abs=1e-5) and pooled != pytest.approx(at[-1].item(), abs=1e-3)
    tok.pad_token = tok.eos_token
    assert scalar_rm.score_responses(model, tok, ["post: tom.\nsummary:"], [" tom"])[0][0] == pytest.approx(
        at[-1].item(), abs=1e-5
    )


@pytest.fixture(scope="module")
def bt_reward_model(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("bt")
    common.write_jsonl(tmp / "ann.jsonl", pool(60))
    common.write_jsonl(
        tmp / "sft.jsonl", [{"prompt": ex["prompt"], "response": ex["response"]} for ex in demo_dataset("sft", 20)]
    )
    args = rm.parse_args(
        [
            "--objective",
            "pairwise",
            "--model",
            tiny_model_dir,
            "--data",
            str(tmp / "ann.jsonl"),
            "--output-dir",
            str(tmp / "rm"),
            "--max-steps",
            "40",
            "--batch-size",
            "8",
            "--lr",
            "1e-3",
            "--val-frac",
            "0.2",
            "--norm-data",
            str(tmp / "sft.jsonl"),
            "--device",
            "cpu",
        ]
    )
    return str(tmp / "rm"), rm.main(args), tmp


def test_pairwise_reward_model_trains_normalises_and_reports(bt_reward_model):
    """02 --objective pairwise: the saved model says what it is; its held-out Bradley-Terry loss, computed on the
    reloaded model one answer at a time (score_responses), equals the Trainer's eval loss on collated batches; the
    demonstrations' mean score is what 03 subtracts."""
    path, metrics, tmp = bt_reward_model
    info = json.loads(Path(path, "reward_model.json").read_text())
    assert info["objective"] == "pairwise" and reward_models.rm_settings(path)["objective"] == "pairwise"
    assert metrics["n"] == round(0.2 * len(scalar_rm.preference_pairs(pool(60))))  # the held-out pairs
    assert metrics["bt_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-4)
    assert metrics["pairwise_accuracy"] > 0.5  # 40 steps: the clean reference beats the noisy answer
    model, tok = models.load_model(path, scalar_head=True)
    demos = common.read_jsonl(tmp / "sft.jsonl")
    scores = scalar_rm.score_responses(model, tok, [d["prompt"] for d in demos], [d["response"] for d in demos])
    assert info["score_bias"] == pytest.approx(sum(s[0] for s in scores) / len(scores), abs=1e-4)


def test_scalar_rm_critic_puts_the_normalised_score_on_the_last_token(bt_reward_model):
    path, _, _ = bt_reward_model
    args = ppo.parse_args(["--critic", "scalar-rm", "--reward-model", path, "--device", "cpu"])
    critic = ppo.make_critic(args)
    model, tok = models.load_model(path, scalar_head=True)
    p, texts = "post: tom has a red dog called rex.\nsummary:", [" tom has a red dog.", " rex"]
    fbs = critic([{"prompt": p}] * 2, texts)
    bias = reward_models.rm_settings(path)["score_bias"]
    for text, fb in zip(texts, fbs):
        with torch.no_grad():
            raw = model(input_ids=torch.tensor([scalar_rm.scalar_rm_input(tok, p, text)[0]])).logits[0, 0].item()
        assert fb["step_rewards"] == [(None, pytest.approx(raw - bias, abs=1e-5))]
        std = reward_models.rm_settings(path)["norm_score_std"]
        assert std > 0 and ppo.make_critic(
            ppo.parse_args(
                ["--critic", "scalar-rm", "--reward-model", path, "--score-norm", "mean-std", "--device", "cpu"]
            )
        )([{"prompt": p}], [text])[0]["step_rewards"] == [(None, pytest.approx((raw - bias) / std, abs=1e-5))]
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        d = ppo.span_deltas([text], [common.decode_with_offsets(tok, ids)[1]], [fb], torch.ones(1, len(ids)))[0]
        assert d[0, :-1].abs().sum() == 0 and d[0, -1].item() == pytest.approx(raw - bias, abs=1e-5)


def test_prm_trains_and_its_critic_scores_each_step(tmp_path, tiny_model_dir):
    common.write_jsonl(tmp_path / "ann.jsonl", pool(30))
    metrics = rm.main(
        rm.parse_args(
            [
                "--objective",
                "prm",
                "--model",
                tiny_model_dir,
                "--data",
                str(tmp_path / "ann.jsonl"),
                "--output-dir",
                str(tmp_path / "prm"),
                "--max-steps",
                "10",
                "--batch-size",
                "8",
                "--val-frac",
                "0.2",
                "--device",
                "cpu",
            ]
        )
    )
    assert metrics["n"] == 12 and metrics["n_steps"] >= 12 and 0.0 <= metrics["step_accuracy"] <= 1.0
    assert reward_models.rm_settings(tmp_path / "prm")["step_unit"] == "clause"
    critic = ppo.make_critic(
        ppo.parse_args(
            ["--critic", "prm", "--reward-model", str(tmp_path / "prm"), "--model", tiny_model_dir, "--device", "cpu"]
        )
    )
    # the held-out step accuracy, recomputed from 03's critic on the same held-out answers: a step is predicted
    # right where its reward 2 sigmoid(s) - 1 > 0, and is right where no poor span of the annotation falls in it
    _, val = split_records(load_annotations(tmp_path / "ann.jsonl")[0], 0.2, 0)
    pred = [r > 0 for fb in critic(val, [v["response"] for v in val]) for _, r in fb["step_rewards"]]
    gold = [
        not any(a < e and s < b for a, b in common.locate_spans(v["response"], [], v["poor_spans"])[1])
        for v in val
        for s, e in scalar_rm.split_steps(v["response"])
    ]
    assert metrics["n_steps"] == len(gold) == len(pred) and metrics["wrong_steps_gold"] == gold.count(False)
    assert metrics["step_accuracy"] == pytest.approx(sum(p == g for p, g in zip(pred, gold)) / len(gold))
    text = " tom has a red dog called rex that likes the park and eats fish."
    (fb,) = critic([{"prompt": "post: tom.\nsummary:"}], [text])
    assert [e for e, _ in fb["step_rewards"]] == [e for _, e in scalar_rm.split_steps(text)]
    assert all(-1 < r < 1 for _, r in fb["step_rewards"])


@pytest.mark.parametrize("case", ["scalar-for-critiques-03", "scalar-for-critiques-04", "generative-for-scalar"])
def test_the_wrong_kind_of_reward_model_is_refused_in_one_line(
    tmp_path, bt_reward_model, tiny_reward_model, tiny_model_dir, case
):
    bt, model = bt_reward_model[0], ["--model", tiny_model_dir]  # 03 checks --model first (issue 80): one that exists
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 2))
    cmd = {
        "scalar-for-critiques-03": ["03_train_policy.py", *model, "--critic", "local", "--reward-model", bt],
        "scalar-for-critiques-04": [
            "04_evaluate.py",
            "--reward-model",
            bt,
            "--policy",
            f"x={bt}",
            "--data",
            str(tmp_path / "eval.jsonl"),
        ],
        "generative-for-scalar": [
            "03_train_policy.py",
            *model,
            "--critic",
            "scalar-rm",
            "--reward-model",
            tiny_reward_model[0],
        ],
    }[case]
    proc = forkserver.run([sys.executable, str(ROOT / cmd[0]), *cmd[1:]], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("error: --reward-model ")
    assert ("needs a generative one" in last[0]) == (case != "generative-for-scalar")
    assert ("needs a scalar one trained on preference pairs" in last[0]) == (case == "generative-for-scalar")


@pytest.mark.parametrize("script", ["02_train_reward.py", "baselines/dpo.py"])
def test_pairs_with_a_missing_field_exit_2_naming_file_line_and_field(tmp_path, tiny_model_dir, script):
    path = tmp_path / "prefs.jsonl"
    common.write_jsonl(path, [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}])
    extra = ["--objective", "pairwise"] if script.startswith("02") else []
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / script),
            "--data",
            str(path),
            "--model",
            tiny_model_dir,
            "--output-dir",
            str(tmp_path / "out"),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: {path}:2: missing field 'rejected'"
    assert not (tmp_path / "out").exists()


def test_annotations_without_two_answers_per_prompt_give_no_pairs_in_one_line(tmp_path):
    path = tmp_path / "ann.jsonl"
    common.write_jsonl(path, [annotated(ex["prompt"], ex["response"], ex["id"]) for ex in demo_dataset("annotate", 3)])
    with pytest.raises(common.DataError, match=r"no preference pairs: no prompt has two responses"):
        scalar_rm.load_pairs(str(path))


# ----------------------------------------------------------------------------------------------------------------------
# DPO and SFT + reflection
# ----------------------------------------------------------------------------------------------------------------------


def test_dpo_raises_the_chosen_answers_implicit_reward_over_the_rejected(tmp_path, tiny_model_dir):
    """A few DPO steps on pairs: the implicit reward margin beta * [(log pi - log ref)(y_c) - (...)(y_r)] starts at
    0 (pi = ref) and turns positive on the training pairs, and the loss falls below log 2."""
    common.write_jsonl(tmp_path / "ann.jsonl", pool(16))
    metrics = dpo.main(
        [
            "--model",
            tiny_model_dir,
            "--data",
            str(tmp_path / "ann.jsonl"),
            "--output-dir",
            str(tmp_path / "dpo"),
            "--epochs",
            "6",
            "--batch-size",
            "8",
            "--lr",
            "3e-3",
            "--val-frac",
            "0",
            "--device",
            "cpu",
        ]
    )
    rows = common.read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    assert rows[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-6) and rows[0]["loss"] == pytest.approx(math.log(2))
    assert rows[-1]["rewards/margin"] > 0 and rows[-1]["loss"] < math.log(2)
    assert rows[-1]["rewards/chosen"] > rows[-1]["rewards/rejected"]
    assert metrics["n"] == 0 and (tmp_path / "dpo" / "policy" / "adapter_config.json").is_file()


def _dpo_policy(tiny_model_dir, *flags):
    """(policy, reference, tokenizer, args) as baselines/dpo.py builds them, the same LoRA init every call."""
    args = dpo.parse_args(
        ["--model", tiny_model_dir, "--data", "unused", "--device", "cpu", "--lora-r", "4", "--lora-alpha", "8", *flags]
    )
    model, tok = models.load_model(tiny_model_dir)
    torch.manual_seed(0)
    policy, ref = dpo.build_policy(args, model)
    with torch.no_grad():  # move the adapter off zero, so that pi != ref and every gradient is non-trivial
        for name, w in policy.named_parameters():
            if "lora_B" in name:
                w.normal_(0, 0.05)
    policy.train()
    return policy, ref, tok, args


def test_micro_batched_dpo_equals_one_batch(tiny_model_dir):
    """DPO's batch accumulated over micro-batches of one pair (each its own forward and backward, nothing of it kept
    but its two summed log-probs), with activation checkpointing, gives the one-forward batch's loss, statistics and
    gradients (pair_stats: all pairs in one forward); so do the held-out statistics, scored a pair at a time."""
    pairs = scalar_rm.preference_pairs(pool(12))[:4]
    one, ref, tok, args = _dpo_policy(tiny_model_dir)
    batch = dpo.encode_pairs(tok, pairs, "auto", 1024, 64)
    assert len(batch) == 4 and len({len(q) for q, _, _ in batch}) > 1  # the prompts' left padding differs by batch
    loss, want = dpo.pair_stats(one, ref, batch, tok.pad_token_id, args)
    loss.backward()
    micro, ref2, _, args2 = _dpo_policy(tiny_model_dir, "--micro-batch-size", "1", "--gradient-checkpointing")
    assert any(getattr(m, "gradient_checkpointing", False) for m in micro.modules())
    got = dpo.run_pairs(micro, ref2, batch, tok.pad_token_id, args2, backward=lambda x: x.backward())
    assert got.keys() == want.keys() and got == pytest.approx(want, rel=1e-5, abs=1e-6)
    grads = {n: p.grad for n, p in micro.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    for name, p in one.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        held_out = dpo.run_pairs(micro, ref2, batch, tok.pad_token_id, args2)
    assert held_out == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_dpo_takes_its_split_from_stage2s_preset(tmp_path):
    """DPO holds out exactly the pairs that 02 --objective pairwise holds out: the same --val-frac by --task preset
    (0.05 outside the demo, where DPO once defaulted to the demo's 0.025) and the same seed."""
    for task in ("demo", "qa", "summarization"):
        assert (
            dpo.parse_args(["--data", "x", "--task", task]).val_frac
            == rm.parse_args(["--task", task, "--objective", "pairwise"]).val_frac
        )
    assert dpo.parse_args(["--data", "x", "--task", "qa", "--val-frac", "0.3"]).val_frac == 0.3
    assert dpo.parse_args(["--data", "x"]).split_seed == rm.parse_args([]).seed


def test_dpos_split_fractions_are_stage2s_presets():
    """DPO's copy of 02's --val-frac presets (VAL_FRAC, its --task choices) is 02's, for every task."""
    assert dpo.VAL_FRAC == {task: preset["val_frac"] for task, preset in rm.PRESETS.items()}


@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_dpos_policy_and_log_probs_are_03s(tiny_model_dir, lora_r):
    """DPO's copies of 03's build_policy, forward and reference_forward (baselines/dpo.py: build_policy,
    token_logprobs, reference_logprobs) give 03's: the same trainable weights from the same seed, and the same
    log-probs of left-padded queries and right-padded answers, bit for bit, under the policy and the reference (the
    adapter off, or the frozen copy of full fine-tuning), summed as sequence_logprobs sums them."""
    args = dpo.parse_args(
        ["--model", tiny_model_dir, "--data", "unused", "--device", "cpu", "--lora-r", lora_r, "--lora-alpha", "8"]
    )
    built = []
    for build in (
        lambda m: dpo.build_policy(args, m),
        lambda m: ppo.build_policy(argparse.Namespace(**vars(args), ref_adapter=None), m)[:2],
    ):
        torch.manual_seed(0)
        policy, ref = build(models.load_model(tiny_model_dir)[0])
        torch.manual_seed(1)
        with torch.no_grad():  # the same step off the start for both, so that pi != ref
            for name, w in sorted(policy.named_parameters()):
                if w.requires_grad and ("lora_B" in name or lora_r == "0"):
                    w.add_(torch.randn_like(w) * 0.05)
        built.append((policy, ref))
    (ours, our_ref), (theirs, their_ref) = built
    trainable = lambda m: {n: w for n, w in m.named_parameters() if w.requires_grad}  # noqa: E731
    assert trainable(ours).keys() == trainable(theirs).keys() and trainable(ours)
    assert all(torch.equal(w, trainable(theirs)[n]) for n, w in trainable(ours).items())
    assert (our_ref is None) == (their_ref is None) == (lora_r != "0")
    tok = models.load_model(tiny_model_dir)[1]
    queries = [tok("tom has a red dog.")["input_ids"], tok("anna")["input_ids"]]
    answers = [
        tok(" rex likes the park", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
        tok(" a cat", add_special_tokens=False)["input_ids"],
    ]
    query, query_mask = models.left_pad(queries, tok.pad_token_id)
    T = max(map(len, answers))
    response, mask = torch.full((2, T), tok.pad_token_id), torch.zeros(2, T)
    for i, y in enumerate(answers):
        response[i, : len(y)], mask[i, : len(y)] = torch.tensor(y), 1.0
    ids, attn = torch.cat([query, response], 1), torch.cat([query_mask, mask.long()], 1)
    with torch.no_grad():
        lp, ref_lp = dpo.token_logprobs(ours, ids, attn, T), dpo.reference_logprobs(ours, our_ref, ids, attn, T)
        want, want_ref = (
            ppo.forward(theirs, None, ids, attn, T, 1.0)[0],
            ppo.reference_forward(theirs, their_ref, ids, attn, T, 1.0)[0],
        )
        summed = dpo.sequence_logprobs(ours, our_ref, queries, answers, tok.pad_token_id, "cpu", "float32")
    assert torch.equal(lp, want) and torch.equal(ref_lp, want_ref) and not torch.equal(lp, ref_lp)
    assert torch.equal(summed[0], (want * mask).sum(1)) and torch.equal(summed[1], (want_ref * mask).sum(1))


def test_dpo_writes_its_config_before_training_and_its_held_out_metrics(tmp_path, tiny_model_dir):
    """config.json is written before the first step (a run that dies still says what it was), eval.json after the
    held-out pairs are scored in micro-batches."""
    common.write_jsonl(tmp_path / "ann.jsonl", pool(16))
    seen = {}
    step = dpo.run_pairs

    def spy(*a, **k):
        seen.setdefault("config", (tmp_path / "dpo" / "config.json").is_file())
        return step(*a, **k)

    import unittest.mock

    with unittest.mock.patch.object(dpo, "run_pairs", spy):
        metrics = dpo.main(
            [
                "--model",
                tiny_model_dir,
                "--data",
                str(tmp_path / "ann.jsonl"),
                "--output-dir",
                str(tmp_path / "dpo"),
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--micro-batch-size",
                "3",
                "--val-frac",
                "0.25",
                "--device",
                "cpu",
            ]
        )
    assert seen["config"] and json.loads((tmp_path / "dpo" / "config.json").read_text())["micro_batch_size"] == 3
    held_out = split_records(scalar_rm.preference_pairs(pool(16)), 0.25, 0)[1]
    assert metrics["n"] == len(held_out) > 1 and json.loads((tmp_path / "dpo" / "eval.json").read_text()) == metrics


def test_revision_examples_map_flawed_answers_and_their_critique_to_the_reference():
    recs = pool(5)
    examples = reflection.revision_examples(recs)
    flawed = [r for r in recs if r["poor_spans"]]
    assert len(examples) == len(flawed) > 0
    for ex, rec in zip(examples, flawed):
        assert ex["prompt"] == reflection.revision_prompt(rec["prompt"], rec["response"], rec["critique"])
        assert rec["critique"] in ex["prompt"] and ex["response"] == " " + rec["reference"]


def _spy_generate(monkeypatch) -> list[list[str]]:
    """The prompts of each infra.models.generate call (04's generations) as text, the real generate still doing the work."""
    calls, generate = [], models.generate

    def spy(model, tok, prompts, *a, **k):
        calls.append([p if isinstance(p, str) else tok.decode(p, skip_special_tokens=True) for p in prompts])
        return generate(model, tok, prompts, *a, **k)

    monkeypatch.setattr(models, "generate", spy)
    return calls


def test_reflect_adds_a_revised_row_from_the_critique_and_needs_a_critic(
    tmp_path, tiny_model_dir, monkeypatch, fake_openai
):
    """04 --reflect: each answer is revised from a prompt holding the prompt, the answer and the critic's critique of
    that very answer (here the demo's exact critic); the revised row is a policy like any other: judged by default
    against the others, nameable in --judge-pairs, and among the report's sample answers."""
    ev = import_script("04_evaluate")
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 3))
    calls = _spy_generate(monkeypatch)
    with fake_openai(lambda body, n: "Winner: A") as judge:
        results = ev.main(
            [
                "--data",
                str(tmp_path / "eval.jsonl"),
                "--policy",
                f"sft={tiny_model_dir}",
                "--reflect",
                "--reflect-critic",
                "program",
                "--reward-model",
                "none",
                "--output-dir",
                str(tmp_path / "ev"),
                "--max-new-tokens",
                "8",
                "--bootstrap",
                "10",
                "--judge-base-url",
                judge.base_url,
                "--judge-model",
                "j",
            ]
        )
    assert list(results["policies"]) == ["sft", "sft+reflect"]
    answers = [g["response"] for g in common.read_jsonl(tmp_path / "ev" / "eval" / "sft.generations.jsonl")]
    revised = [p for call in calls for p in call if p.endswith("\nrevision:")]
    assert len(revised) == 3
    for rec, answer, prompt in zip(demo_dataset("eval", 3), answers, revised):
        critique = demo_critic(rec["prompt"], answer)["critique"].strip()
        assert critique and prompt.startswith(rec["prompt"] + answer) and f"critique: {critique}\n" in prompt
    assert list(results["judge"]["pairs"]) == ["sft+reflect_vs_sft"]  # the default pairs hold the revised row
    assert "data-policy='sft+reflect'" in (tmp_path / "ev" / "report.html").read_text()
    with fake_openai(lambda body, n: "Winner: B") as judge:
        results = ev.main(
            [
                "--data",
                str(tmp_path / "eval.jsonl"),
                "--policy",
                f"sft={tiny_model_dir}",
                "--reflect",
                "--reflect-critic",
                "program",
                "--reward-model",
                "none",
                "--output-dir",
                str(tmp_path / "ev"),
                "--max-new-tokens",
                "8",
                "--bootstrap",
                "10",
                "--judge-base-url",
                judge.base_url,
                "--judge-model",
                "j2",
                "--judge-pairs",
                "sft:sft+reflect",
            ]
        )
    assert results["judge"]["pairs"]["sft_vs_sft+reflect"]["n"] == 3
    with pytest.raises(common.DataError, match="--reflect-critic reward-model: no --reward-model"):
        ev.main(
            [
                "--data",
                str(tmp_path / "eval.jsonl"),
                "--policy",
                f"sft={tiny_model_dir}",
                "--reflect",
                "--reward-model",
                "none",
                "--output-dir",
                str(tmp_path / "ev2"),
            ]
        )


def test_reflect_revisions_are_keyed_by_the_critiques_they_read(tmp_path, tiny_model_dir, monkeypatch):
    """The revisions' cache is keyed by the revision prompts themselves: another critique budget
    (--rm-max-new-tokens) gives other critiques, so the revisions are made again from them, never reused stale."""
    ev = import_script("04_evaluate")
    model, tok = models.load_model(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():  # weights jolted: its greedy critiques are text up to the budget's end, not blank lines
        for w in model.parameters():
            w.add_(torch.randn_like(w) * 0.5)
    rm_dir = str(runs.save_pretrained(tmp_path / "rm", model, tok, {"reward_model.json": {"base_model": "tiny"}}))
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 2))
    calls = _spy_generate(monkeypatch)
    fps, revised = [], []
    for budget in ("3", "12"):
        results = ev.main(
            [
                "--data",
                str(tmp_path / "eval.jsonl"),
                "--policy",
                f"sft={tiny_model_dir}",
                "--reflect",
                "--reward-model",
                rm_dir,
                "--rm-max-new-tokens",
                budget,
                "--output-dir",
                str(tmp_path / "ev"),
                "--max-new-tokens",
                "8",
                "--bootstrap",
                "10",
            ]
        )
        fps.append(results["policies"]["sft+reflect"]["fingerprint"])
        revised.append([p for call in calls for p in call if p.endswith("\nrevision:")])
        calls.clear()
    assert len(revised[0]) == len(revised[1]) == 2  # the second run generated its revisions: none was reused
    assert revised[0] != revised[1] and fps[0] != fps[1]


def test_a_plain_sequence_classifier_is_a_scalar_reward_model(tmp_path, tiny_model_dir):
    """A reward model trained elsewhere (TRL's RewardTrainer saves a sequence classifier, no reward_model.json) is
    taken by --critic scalar-rm, unnormalised, and refused where critiques are needed."""
    model, tok = models.load_model(tiny_model_dir, scalar_head=True)
    runs.save_pretrained(tmp_path / "trl_rm", model, tok)
    settings = reward_models.rm_settings(tmp_path / "trl_rm")
    assert settings["objective"] == "pairwise" and settings["score_bias"] == 0.0
    assert reward_models.rm_settings(tiny_model_dir)["objective"] == "generative"  # a causal LM
    ppo.parse_args(["--critic", "scalar-rm", "--reward-model", str(tmp_path / "trl_rm")])
    with pytest.raises(common.DataError, match="needs a generative one"):
        reward_models.check_reward_model(str(tmp_path / "trl_rm"))
