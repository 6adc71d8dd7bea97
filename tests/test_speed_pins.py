"""Behaviour pins for the speed work (issue 17): what an optimisation must leave exactly as it was.

- a fixed-seed PPO run (full fine-tuning and LoRA) logs the same losses, KL, rewards and parameters as the code before
  the optimisations did (tests/speed_pins.json, recorded from that code);
- the reward model's greedy critiques are the ones plain `model.generate` gives, token for token.
No timings here: those live in bench/ (vs_trl.py, annotate_throughput.py, the demo's time/* metrics).

To re-record the PPO pins after a deliberate change of behaviour:
    T2G_RECORD_PINS=1 python -m pytest tests/test_speed_pins.py
"""

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
from critics.learned import rm_critique
from infra import decoding, models, trainable
from infra.tiny_model import build_tiny_base
from tasks.demo import demo_dataset, make_demo_example
from conftest import import_script

ppo = import_script("03_train_policy")
PINS = Path(__file__).with_name("speed_pins.json")


def _ppo_run(tmp_path, model_dir, lora_r, *extra):
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    run = tmp_path / f"run{lora_r}"
    args = ppo.parse_args(
        [
            "--model",
            model_dir,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--critic",
            "program",
            "--output-dir",
            str(run),
            "--scalar-baseline-dir",
            "",
            "--steps",
            "2",
            "--batch-size",
            "8",
            "--num-minibatches",
            "2",
            "--ppo-epochs",
            "2",
            "--max-new-tokens",
            "8",
            "--sft-steps",
            "0",
            "--device",
            "cpu",
            "--lora-r",
            str(lora_r),
            "--lora-alpha",
            "8",
            "--lr",
            "1e-3",
            "--kl-coef",
            "0.1",
            "--seed",
            "3",
            "--temperature",
            "1.0",
            "--dump-rollouts",
            str(run / "dump"),
            *extra,
        ]
    )
    ppo.train(args)
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in common.read_jsonl(run / "metrics.jsonl")]
    checksums = [torch.load(run / "dump" / f"step{s}_rank0.pt", weights_only=False)["param_checksum"] for s in (1, 2)]
    return {"metrics": rows, "param_checksums": checksums}


@pytest.mark.parametrize("lora_r,extra", [(0, ()), (4, ()), (4, ("--compile-generation",))])
def test_ppo_run_matches_the_recorded_one(tmp_path, tiny_model_dir, lora_r, extra):
    """(--compile-generation: the rollouts of infra.decoding.static_decode, which must leave the run exactly as it was.)"""
    got = _ppo_run(tmp_path, tiny_model_dir, lora_r, *extra)
    pins = json.loads(PINS.read_text()) if PINS.is_file() else {}
    if os.environ.get("T2G_RECORD_PINS") and not extra:
        pins[f"ppo_lora{lora_r}"] = got
        PINS.write_text(json.dumps(pins, indent=1) + "\n")
        pytest.skip("recorded")
    # a float-rounding difference (another CPU's kernels) is ~1e-7; a behaviour change is not
    _assert_close(got, pins[f"ppo_lora{lora_r}"], rel=1e-5, abs=1e-6, checksum_rel=1e-6)


@pytest.mark.slow  # ~100 s: the compiles of a cold inductor cache (forward, backward; static, then dynamic widths)
def test_compiled_update_moves_the_run_within_float_rounding(tmp_path, tiny_model_dir, lora_r=4):
    """--compile-update (the scoring forwards and the update's forward and backward under torch.compile, AdamW fused)
    is not bit for bit: inductor's fused kernels round otherwise. The LoRA run pinned above: every metric within 1e-4
    (relative, or 1e-6 absolute; measured: 1.6e-5 at most), the parameters' checksums within 1e-6 (measured 2e-7).
    LoRA: pi_ref is the compiled policy with its adapter switched off, a second graph (one that kept the adapter
    would give KL = 0 at step 2). Full fine-tuning's compiled frozen copy: bench/speed/rollout_speed.py's ppo section."""
    got = _ppo_run(tmp_path, tiny_model_dir, lora_r, "--compile-update")
    _assert_close(got, json.loads(PINS.read_text())[f"ppo_lora{lora_r}"], rel=1e-4, abs=1e-6, checksum_rel=1e-6)


def _assert_close(got, want, rel, abs, checksum_rel):
    assert len(got["metrics"]) == len(want["metrics"]) and len(got["param_checksums"]) == len(want["param_checksums"])
    assert all(set(w) <= set(g) for g, w in zip(got["metrics"], want["metrics"]))  # new metrics may be added
    for g, w in zip(got["metrics"], want["metrics"]):
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=rel, abs=abs), (g["step"], key)
    assert got["param_checksums"] == pytest.approx(want["param_checksums"], rel=checksum_rel)


# ---------------------------------------------------------------------------------------------------------------------
# Greedy critiques: the reward model's outputs are those of plain model.generate (greedy, up to EOS)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_critic_dir(tmp_path_factory):
    """A tiny model taught (briefly, imperfectly: a few seconds) to answer a summary with a critique line and a span
    JSON of 1-3 quotes, then EOS, or, when the summary is followed by "!", a remark after the JSON: its outputs end
    at different steps, with the JSON then EOS, the JSON then more text, or no JSON. Every path of greedy_generate."""
    import random

    from conftest import tiny_corpus

    rng, pairs = random.Random(0), []
    for _ in range(300):
        ex = make_demo_example(rng)
        words = ex["response"].split()
        quotes = [" " + w.strip(".") for w in rng.sample(words, rng.randint(1, 3))]
        more = rng.random() < 0.3  # asked for with a "!" after the response; the answer then starts with "hm"
        target = f"{'hm' if more else 'ok'} {words[0]}.\n" + json.dumps(
            {"good_spans": quotes[1:], "poor_spans": quotes[:1]}
        )
        pairs.append((ex["response"] + ("!\n" if more else "\n"), target + (" it rained." if more else "")))
    return build_tiny_base(
        tmp_path_factory.mktemp("critic") / "m",
        tiny_corpus(),
        vocab_size=600,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        pretrain_texts=pairs,
        pretrain_steps=200,
        lr=5e-3,
    )


def _reference_greedy(model, tok, prompts, max_new_tokens):
    """The code before issue 17: model.generate, greedy, whole left-padded batch, cut at the first EOS."""
    ids, mask = models.left_pad([models.encode_prompt(tok, p) for p in prompts], tok.pad_token_id)
    with torch.no_grad():
        seqs = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    out = []
    for row in seqs[:, ids.shape[1] :].tolist():
        cut = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
        out.append([t for t in row[:cut] if t != tok.pad_token_id])
    return out


def test_decoding_loops_pass_the_kv_cache_by_its_current_name(tiny_critic_dir):
    """greedy_generate and static_decode hand the KV cache to the model as `cache`: transformers 5.24 renamed it from
    `past_key_values`, which is deprecated (a FutureWarning) and goes in 5.40; before 5.24 `cache` was silently
    ignored (static_decode then decoded without its cache: other tokens), hence requirements.txt's transformers>=5.24."""
    import warnings

    model, tok = models.load_model(tiny_critic_dir)
    prompts = [r["response"] + "\n" for r in demo_dataset("eval", 4)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        assert decoding.greedy_generate(model, tok, prompts, 8) == _reference_greedy(model, tok, prompts, 8)


def test_greedy_generate_gives_model_generate_tokens(tiny_critic_dir):
    model, tok = models.load_model(tiny_critic_dir)
    prompts = [r["response"] + ("!\n" if i % 3 else "\n") for i, r in enumerate(demo_dataset("eval", 36))]
    prompts += ["zz", "post: it rained on monday.", "{"]  # off the task: no JSON, or JSON the model never closes
    want = _reference_greedy(model, tok, prompts, 40)
    assert len({len(w) for w in want}) > 3  # rows end at different steps: finished rows leave the batch
    assert decoding.greedy_generate(model, tok, prompts, 40, batch_size=32) == want
    assert decoding.greedy_generate(model, tok, prompts, 40, batch_size=7) == want  # ragged last chunk

    # stop=feedback_complete: a row also ends where its span JSON closes; the text is the same whenever the JSON was
    # the end of the output (EOS next), else it is the output up to the JSON's end
    got = decoding.greedy_generate(model, tok, prompts, 40, stop=common.feedback_complete)
    texts = [tok.decode(x, skip_special_tokens=True) for x in want]
    got_texts = [tok.decode(x, skip_special_tokens=True) for x in got]
    kinds = set()
    assert len(got_texts) == len(texts) == len(prompts)
    for g, w in zip(got_texts, texts):
        if common.feedback_complete(w):
            kinds.add("json then EOS")
            assert g == w
        elif g != w:
            kinds.add("json then more")
            assert w.startswith(g) and common.feedback_complete(g)
            assert common.parse_feedback(g)["poor_spans"] == common.parse_feedback(w)["poor_spans"]
        else:
            kinds.add("no json")
    assert kinds >= {"json then EOS", "json then more"}, kinds


def test_compiled_greedy_generate_gives_the_same_critiques(tiny_critic_dir):
    """compile=True (static_decode: a static KV cache, the step compiled, ended rows kept in the batch, masked): the
    tokens of plain greedy decoding, and with stop=feedback_complete those of the eager loop, row for row."""
    model, tok = models.load_model(tiny_critic_dir)
    prompts = [r["response"] + ("!\n" if i % 3 else "\n") for i, r in enumerate(demo_dataset("eval", 36))]
    prompts += ["zz", "post: it rained on monday.", "{"]
    want = _reference_greedy(model, tok, prompts, 40)
    n = len(prompts)  # one chunk: one shape to compile (the eager test above covers a ragged last chunk)
    assert decoding.greedy_generate(model, tok, prompts, 40, batch_size=n, compile=True) == want
    eager = decoding.greedy_generate(model, tok, prompts, 40, batch_size=n, stop=common.feedback_complete)
    got = decoding.greedy_generate(model, tok, prompts, 40, batch_size=n, stop=common.feedback_complete, compile=True)
    assert got == eager and got != want  # the stop ended some rows early, in both


@pytest.mark.parametrize("chat", [False, True])
def test_rm_critique_is_plain_greedy_decoding(tiny_model_dir, tiny_chat_model_dir, chat):
    model, tok = models.load_model(tiny_chat_model_dir if chat else tiny_model_dir)
    recs = demo_dataset("eval", 6)
    want = tok.batch_decode(
        _reference_greedy(model, tok, [common.build_rm_prompt(tok, r["prompt"], r["response"]) for r in recs], 12),
        skip_special_tokens=True,
    )
    assert rm_critique(model, tok, [r["prompt"] for r in recs], [r["response"] for r in recs], 12) == want


def test_feedback_complete():
    done = 'It gets ben right.\n{"good_spans": [" ben"], "poor_spans": []}'
    assert common.feedback_complete(done) and common.feedback_complete(done + "\n ")
    assert not common.feedback_complete(done[:-1])  # not closed yet
    assert not common.feedback_complete('It gets {"x": 1} right')  # prose continues
    assert not common.feedback_complete('Code: {"good_spans": []}')  # one list only: not the format
    assert not common.feedback_complete('{"good_spans": ["a}"], "poor_spans": ["b')  # a brace inside a string
    assert common.feedback_complete('{"good_spans": ["a}"], "poor_spans": ["{b"]}')
    assert not common.feedback_complete("")


def test_rollout_forwards_over_the_whole_batch_equal_micro_batches(tiny_model_dir):
    """The no-grad forwards of the rollout phase take the whole batch in one call instead of micro-batches: the same
    numbers (bit for bit here with micro-batches of 4; an odd batch size can take a GEMM path that rounds otherwise)."""
    model, tok = models.load_model(tiny_model_dir)
    ids, mask = models.left_pad(
        [tok(r["prompt"] + r["response"])["input_ids"] for r in demo_dataset("eval", 8)], tok.pad_token_id
    )
    value_head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():
        whole = ppo.forward(model, value_head, ids, mask, 10, 0.7)
        parts = [ppo.forward(model, value_head, ids[s : s + 4], mask[s : s + 4], 10, 0.7) for s in range(0, 8, 4)]
        odd = [ppo.forward(model, value_head, ids[s : s + 3], mask[s : s + 3], 10, 0.7) for s in range(0, 8, 3)]
    for a, b, c in zip(whole, zip(*parts), zip(*odd)):
        assert torch.equal(a, torch.cat(b))
        assert torch.allclose(a, torch.cat(c), rtol=1e-5, atol=1e-6)
    assert trainable.forward_rows(16, 4, 32, 640) == 16  # the demo: one call
    assert trainable.forward_rows(64, 4, 256, 128_256) == 4  # an 8B vocabulary: the training micro-batch
    assert trainable.forward_rows(64, 1, 64, 128_256, n_logits=2) == 4  # --kl-estimator full keeps both models' logits


COMPILED_RUN = """
import argparse, sys, torch
from infra import trainable
model = torch.nn.Linear(4, 4)  # 03's --compile-update entry point, on a module that compiles in seconds
compiled, _ = trainable.compile_update(model, None, argparse.Namespace(compile_update=True))
print(compiled(torch.ones(2, 4)).sum().item())
"""


@pytest.mark.slow  # two cold compiles of a Linear, ~10 s each (of a PPO run: ~50 s each)
def test_inductor_keeps_a_cache_per_kernel_path(tmp_path):
    """Inductor's cache key leaves out torch's CPU kernel path: kernels it compiled under one path (avx2) and loaded
    under another sampled from NaN probabilities in the next iteration's rollouts (issue 80: the suite under
    ATEN_CPU_CAPABILITY=avx2 after a run on AVX-512). infra.decoding.inductor_cache_per_kernel_path gives each path a
    folder of its own under inductor's default one (here in TMPDIR), unless TORCHINDUCTOR_CACHE_DIR is set: 03's
    --compile-update calls it (run here), and so does --compile-generation's compiled decode step."""
    from infra import decoding

    assert "inductor_cache_per_kernel_path" in decoding._compiled_decode_forward.__wrapped__.__code__.co_names
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    for i, path in enumerate(("avx2", "default")):
        proc = subprocess.run(
            [sys.executable, "-c", COMPILED_RUN],
            cwd=Path(__file__).resolve().parents[1],
            env={**env, "TMPDIR": str(tmp_path), "ATEN_CPU_CAPABILITY": path},
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"under {path}: {proc.stderr[-1500:]}"
    assert {"avx2", "default"} <= {p.name for p in (tmp_path / f"torchinductor_{getpass.getuser()}").iterdir()}
