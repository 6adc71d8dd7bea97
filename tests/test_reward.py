"""02_train_reward.py: serialisation (labels, shared prompt builder, truncation), span metrics, training, resume,
bad input."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import forkserver
from conftest import ROOT, import_script

import common
from critics.learned import rm_critique
from infra import models, reward_models
from infra.data import load_annotations, split_records
from tasks.demo import demo_critic, demo_dataset

rm = import_script("02_train_reward")


def annotations(n: int, split: str = "annotate") -> list[dict]:
    """What 01_annotate.py writes for the demo: demo records critiqued by the demo critic."""
    return [{**ex, **demo_critic(ex["prompt"], ex["response"]), "status": "ok"} for ex in demo_dataset(split, n)]


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------------------------------------------------
# Serialisation
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["plain-template", "chat-template"])
def test_labels_mask_exactly_the_prompt(chat, tiny_model_dir, tiny_chat_model_dir):
    tok = tokenizer_of(tiny_chat_model_dir if chat else tiny_model_dir)
    rec = annotations(1)[0]
    ex, status = rm.encode_example(tok, rec, max_len=1024)
    prompt_ids = models.encode_prompt(tok, common.build_rm_prompt(tok, rec["prompt"], rec["response"]))
    n = len(prompt_ids)
    assert status == "ok"
    assert ex["input_ids"][:n] == prompt_ids
    assert ex["labels"][:n] == [-100] * n
    assert ex["labels"][n:] == ex["input_ids"][n:]  # every target token is learned, EOS included
    assert ex["labels"][-1] == tok.eos_token_id
    target = common.format_rm_target(rec["critique"], rec["good_spans"], rec["poor_spans"])
    assert tok.decode(ex["labels"][n:-1]) == target
    if chat:
        assert tok.decode(prompt_ids).endswith("assistant: ")  # the template's generation prompt, not the fallback
    else:
        assert tok.decode(prompt_ids).endswith("### Critique\n")

    short = {"input_ids": [5, 6], "labels": [-100, 6]}
    batch = rm.collate([ex, short], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(ex["input_ids"]))
    assert batch["labels"][1].tolist() == [-100, 6] + [-100] * (len(ex["input_ids"]) - 2)  # padding is masked
    assert batch["attention_mask"][1].tolist() == [1, 1] + [0] * (len(ex["input_ids"]) - 2)
    assert (batch["input_ids"][1, 2:] == tok.pad_token_id).all()


def test_prompt_builder_is_the_shared_one(tiny_model_dir, monkeypatch):
    """Training serialises through common.build_rm_prompt, the function stage 3 calls (critics.learned.rm_critique)."""
    tok = tokenizer_of(tiny_model_dir)
    rec = annotations(1)[0]
    shared, calls = common.build_rm_prompt, []

    def spy(tokenizer, prompt, response, rm_format="critique+spans"):
        calls.append((prompt, response))
        return "MARK " + shared(tokenizer, prompt, response, rm_format)

    monkeypatch.setattr(common, "build_rm_prompt", spy)
    ex, _ = rm.encode_example(tok, rec, max_len=1024)
    assert calls == [(rec["prompt"], rec["response"])]
    assert tok.decode(ex["input_ids"]).startswith("MARK " + common.RM_INSTRUCTION)


def test_long_prompt_is_cut_from_its_start_and_counted(tiny_model_dir):
    tok = tokenizer_of(tiny_model_dir)
    rec = annotations(1)[0]
    words = [f"w{i}" for i in range(300)]
    long_rec = {**rec, "prompt": "post: " + " ".join(words) + "\nsummary:"}
    full, _ = rm.encode_example(tok, long_rec, max_len=10_000)
    max_len = len(full["input_ids"]) - 200
    ex, status = rm.encode_example(tok, long_rec, max_len=max_len)
    assert status == "truncated" and len(ex["input_ids"]) <= max_len
    text = tok.decode(ex["input_ids"])
    assert text.startswith(common.RM_INSTRUCTION)  # the instruction stays
    assert "w299\nsummary:" in text and " w0 " not in text and "post:" not in text  # the prompt lost its start
    n_target = sum(label != -100 for label in ex["labels"])
    assert ex["labels"][-n_target:] == full["labels"][-n_target:]  # the target is intact
    assert f"### Response\n{rec['response']}\n\n" in text  # and so is the response

    tight = len(rm.encode_example(tok, {**rec, "prompt": ""}, 10_000)[0]["input_ids"])
    assert rm.encode_example(tok, long_rec, max_len=tight)[1] == "truncated"
    assert rm.encode_example(tok, long_rec, max_len=tight - 1) == (None, "too_long")
    examples, counts = rm.encode_all(tok, [rec, long_rec, long_rec], max_len=max_len)
    assert counts == {"ok": 1, "truncated": 2, "too_long": 0} and len(examples) == 3


@pytest.mark.parametrize("preset", ["demo", "summarization"])
def test_training_input_is_cut_as_the_input_in_use(tiny_model_dir, preset):
    """With a preset's defaults, the reward model's training input is cut by the rule 03 and 04 use (infra.reward_models.rm_prompt
    at reward_model.json's max_prompt_tokens, max_len minus max_new_tokens), never to max_len minus the target's own
    length: an input a little over that budget, which would fit beside its target, is cut in training as in use. A
    target longer than max_new_tokens cuts its own input further, so that the example still fits max_len."""
    tok = tokenizer_of(tiny_model_dir)
    args = rm.parse_args(["--task", preset, "--device", "cpu"])
    budget, rec = args.max_len - args.max_new_tokens, annotations(1)[0]
    prompt_of = lambda k: "post: " + " ".join(f"w{i}" for i in range(k)) + "\nsummary:"  # noqa: E731
    size = lambda k: len(reward_models.rm_prompt(tok, prompt_of(k), rec["response"])[0])  # noqa: E731
    lo, hi = 0, 4 * args.max_len  # the fewest words whose whole input is over the budget by 10 tokens or more
    while lo < hi:
        lo, hi = (lo, (lo + hi) // 2) if size((lo + hi) // 2) >= budget + 10 else ((lo + hi) // 2 + 1, hi)
    n_target = (
        len(
            tok(
                common.format_rm_target(rec["critique"], rec["good_spans"], rec["poor_spans"]), add_special_tokens=False
            )["input_ids"]
        )
        + 1
    )
    assert budget < size(lo) <= args.max_len - n_target  # it would fit beside its target: the old rule kept it whole
    for k, want in ((3, "ok"), (lo, "truncated")):
        ex, status = rm.encode_example(tok, {**rec, "prompt": prompt_of(k)}, args.max_len, budget)
        assert (ex["input_ids"][:-n_target], status) == (
            reward_models.rm_prompt(tok, prompt_of(k), rec["response"], budget)[::2]
        ) and status == want
    long = {**rec, "prompt": prompt_of(lo), "critique": "long"}
    while (
        len(tok(common.format_rm_target(long["critique"], rec["good_spans"], rec["poor_spans"]))["input_ids"])
        <= args.max_new_tokens
    ):  # a target over max_new_tokens
        long["critique"] += " long"
    ex, status = rm.encode_example(tok, long, args.max_len, budget)
    assert status == "truncated" and len(ex["input_ids"]) <= args.max_len
    assert len(ex["input_ids"]) - sum(label != -100 for label in ex["labels"]) < budget


def test_split_is_deterministic_and_disjoint():
    recs = [{"id": str(i)} for i in range(50)]
    train, val = split_records(recs, 0.2, seed=3)
    assert len(val) == 10 and len(train) == 40
    assert {r["id"] for r in train} | {r["id"] for r in val} == {str(i) for i in range(50)}
    assert split_records(recs, 0.2, seed=3) == (train, val)
    assert split_records(recs, 0.2, seed=4)[1] != val


# ----------------------------------------------------------------------------------------------------------------------
# Span metrics against hand-computed numbers
# ----------------------------------------------------------------------------------------------------------------------


def word_tokens(text: str):
    """(text, offsets) with one token per word, carrying its leading space like a byte-level BPE token."""
    import re

    starts = [m.start() for m in re.finditer(r"\s*\S+", text)]
    return text, list(zip(starts, starts[1:] + [len(text)]))


def test_metrics_match_hand_computed_precision_and_recall():
    t1, o1 = word_tokens("tom from york has a red dog called rex")  # 9 tokens
    t2, o2 = word_tokens("ann has a cat and a cat")  # 7 tokens
    items = [
        {"text": t1, "offsets": o1, "good_spans": ["tom from york", "red dog"], "poor_spans": ["rex"]},
        {"text": t2, "offsets": o2, "good_spans": ["ann"], "poor_spans": ["a cat"]},
    ]
    outputs = [
        'It gets tom right but not the dog.\n{"good_spans": ["tom", "york has"], "poor_spans": '
        '["dog called rex", "cow"]}',
        "no JSON here at all",
    ]
    m = reward_models.rm_span_metrics(items, outputs)
    # item 1 gold: +1 on tom from york red dog (5 tokens), -1 on rex (1)
    #        pred: +1 on tom york has (3; tp 2), -1 on dog called rex (3; tp 1); "cow" unmatched
    # item 2 gold: +1 on ann (1), -1 on the first "a cat" (2); pred: nothing (unparseable)
    assert m["n"] == 2 and m["parse_rate"] == 0.5
    assert m["quotes"] == 4 and m["unmatched_span_rate"] == 0.25
    assert (m["pos_tokens_gold"], m["pos_tokens_pred"], m["pos_tokens_tp"]) == (6, 3, 2)
    assert (m["neg_tokens_gold"], m["neg_tokens_pred"], m["neg_tokens_tp"]) == (3, 3, 1)
    assert m["pos_precision"] == pytest.approx(2 / 3) and m["pos_recall"] == pytest.approx(2 / 6)
    assert m["neg_precision"] == pytest.approx(1 / 3) and m["neg_recall"] == pytest.approx(1 / 3)
    assert m["pos_f1"] == pytest.approx(2 * (2 / 3) * (1 / 3) / (2 / 3 + 1 / 3))
    # spans: "tom" overlaps gold "tom from york" (partial), "york has" overlaps it too (partial),
    # "dog called rex" overlaps "red dog" (other polarity: no) and "rex" (partial)
    assert m["spans"] == {
        "good": {"gold": 3, "pred": 2, "exact": 0, "partial": 2},
        "poor": {"gold": 2, "pred": 1, "exact": 0, "partial": 1},
    }
    assert m["critique_words"] == 8

    perfect = reward_models.rm_span_metrics(
        items[:1], [common.format_rm_target("ok", items[0]["good_spans"], items[0]["poor_spans"])]
    )
    assert perfect["pos_precision"] == perfect["pos_recall"] == perfect["neg_f1"] == 1.0
    assert perfect["spans"]["good"]["exact"] == 2 and perfect["unmatched_span_rate"] == 0.0
    empty = reward_models.rm_span_metrics(items[:1], ['{"good_spans": [], "poor_spans": []}'])
    assert empty["pos_precision"] is None and empty["pos_recall"] == 0.0 and empty["unmatched_span_rate"] is None


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: one clear line naming file and line, non-zero exit, nothing written
# ----------------------------------------------------------------------------------------------------------------------


def test_bad_annotations_give_clear_errors(tmp_path):
    recs = annotations(3)
    path = tmp_path / "ann.jsonl"
    path.write_text(json.dumps(recs[0]) + "\n\n" + json.dumps({**recs[1], "poor_spans": "x"}) + "\n")
    with pytest.raises(common.DataError, match=rf"^{path}:3: field 'poor_spans' must be a list of strings$"):
        load_annotations(path)
    path.write_text(json.dumps(recs[0]) + "\n" + '{"id": "x", "prompt": \n')
    with pytest.raises(common.DataError, match=rf"^{path}:2: not valid JSON"):
        load_annotations(path)
    path.write_text("".join(json.dumps({**r, "status": "failed", "reason": "timeout"}) + "\n" for r in recs))
    with pytest.raises(common.DataError, match="no usable records .*3 with status 'failed'"):
        load_annotations(path)
    path.write_text(json.dumps({**recs[0], "status": "failed"}) + "\n" + json.dumps(recs[1]) + "\n")
    assert load_annotations(path) == ([recs[1]], 1)


@pytest.mark.parametrize("case", ["broken-line", "no-weights"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, tiny_model_dir, case):
    from conftest import model_variant

    path = tmp_path / "ann.jsonl"
    path.write_text(json.dumps(annotations(1)[0]) + ("\nnot json\n" if case == "broken-line" else "\n"))
    model = (
        tiny_model_dir if case == "broken-line" else model_variant(tiny_model_dir, tmp_path / "nowts", weights=False)
    )
    out = tmp_path / "rm"
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "02_train_reward.py"),
            "--data",
            str(path),
            "--model",
            model,
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last == f"error: {path}:2: not valid JSON (Expecting value)"
        if case == "broken-line"
        else last.startswith(f"error: {model}: cannot load the model: ")
    )
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------------
# Training: learns the format, saves a loadable reward model, resumes
# ----------------------------------------------------------------------------------------------------------------------


# The LoRA recipe these tests train with (the demo's before it moved to full fine-tuning): every projection plus
# lm_head and embed_tokens, trainable norms, LoRA+.
LORA = (
    "--lora-r",
    "32",
    "--lora-alpha",
    "64",
    "--lora-targets",
    "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head,embed_tokens",
    "--modules-to-save",
    "norm",
    "--loraplus-ratio",
    "16",
    "--lr",
    "5e-4",
    "--epochs",
    "3",
)


def run_args(tmp_path, model_dir, data, out, *extra):
    return rm.parse_args(
        [
            "--model",
            model_dir,
            "--data",
            str(data),
            "--output-dir",
            str(out),
            "--seed",
            "0",
            "--batch-size",
            "8",
            "--logging-steps",
            "10",
            "--eval-steps",
            "1000",
            "--save-steps",
            "1000",
            *LORA,
            *extra,
        ]
    )


def test_training_learns_to_emit_parseable_json(tmp_path, tiny_model_dir):
    """A hundred LoRA steps (the demo preset's LoRA: every projection and lm_head, trainable norms, LoRA+) on a small
    synthetic set: the untrained tiny model never closes a JSON object, the trained one mostly does."""
    data = tmp_path / "ann.jsonl"
    recs = [
        {**r, "critique": "It is checked.", "good_spans": r["good_spans"][:1], "poor_spans": r["poor_spans"][:1]}
        for r in annotations(200)
    ]
    recs[7] = {
        "id": recs[7]["id"],
        "prompt": recs[7]["prompt"],
        "response": recs[7]["response"],
        "status": "failed",
        "reason": "critic returned no JSON",
    }
    common.write_jsonl(data, recs)
    args = run_args(
        tmp_path,
        tiny_model_dir,
        data,
        tmp_path / "rm",
        "--max-steps",
        "120",
        "--val-frac",
        "0.1",
        "--eval-limit",
        "16",
        "--max-new-tokens",
        "40",
    )
    _, val = split_records(load_annotations(data)[0], args.val_frac, args.seed)
    model, tok = models.load_model(tiny_model_dir)  # step 0: LoRA starts as the identity (B = 0)
    before, _ = rm.evaluate_rm(model, tok, val[:16], max_new_tokens=40)
    after = rm.main(args)
    assert after["parse_rate"] > before["parse_rate"] and after["parse_rate"] >= 0.5
    assert after["eval_loss"] < 2.0 and after["steps"] == 120

    out = tmp_path / "rm"
    info = json.loads((out / "reward_model.json").read_text())
    assert info["base_model"] == tiny_model_dir and info["train"]["failed_skipped"] == 1
    assert info["train"]["records"] == 179 and info["train"]["val_records"] == 20
    assert json.loads((out / "eval.json").read_text())["parse_rate"] == after["parse_rate"]
    assert len(common.read_jsonl(out / "eval_samples.jsonl")) == 16
    model, tok = models.load_model(str(out))  # what `03_train_policy.py --reward-model DIR` does
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert len(rm_critique(model, tok, [val[0]["prompt"]], [val[0]["response"]], max_new_tokens=8)) == 1


def test_full_fine_tuning_saves_a_plain_model(tmp_path, tiny_model_dir):
    """--lora-r 0 (the demo's setting): every weight trains, and the output is a plain model directory that stage 3
    loads like any model."""
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(64))
    out = tmp_path / "rm"
    result = rm.main(
        run_args(
            tmp_path,
            tiny_model_dir,
            data,
            out,
            "--lora-r",
            "0",
            "--lr",
            "1e-3",
            "--max-steps",
            "4",
            "--eval-limit",
            "2",
            "--max-new-tokens",
            "8",
        )
    )
    assert result["steps"] == 4 and not (out / "adapter_config.json").exists()
    info = json.loads((out / "reward_model.json").read_text())
    assert info["adapter"] is None and info["lora"]["r"] == 0
    # the budgets 03 and 04 use it with: the input cut to max_len (the preset's) minus the critique budget
    assert (info["max_prompt_tokens"], info["max_new_tokens"]) == (rm.DEMO["max_len"] - 8, 8)
    assert reward_models.rm_settings(out)["max_prompt_tokens"] == rm.DEMO["max_len"] - 8
    model, tok = models.load_model(str(out))
    base, _ = models.load_model(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    trained, before = dict(model.named_parameters()), dict(base.named_parameters())
    assert trained.keys() == before.keys()
    assert all(not torch.equal(trained[k], before[k]) for k in trained)  # every weight moved
    assert len(rm_critique(model, tok, ["post: x"], [" y"], max_new_tokens=4)) == 1


def test_merge_writes_a_plain_model_folder_a_server_can_serve(tmp_path, tiny_model_dir):
    """--merge DIR: the LoRA reward model (LORA: lm_head, embed_tokens, trainable norms) as a plain model folder, the
    adapter merged into the weights: the same logits as the adapter on its base, its tokenizer, a generation_config of
    stop ids only (a server applies whatever it holds), and its reward_model.json, so that --reward-model DIR uses it
    with the same input cut and critique budget."""
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(16))
    rm.main(
        run_args(
            tmp_path,
            tiny_model_dir,
            data,
            tmp_path / "rm",
            "--max-steps",
            "3",
            "--eval-limit",
            "0",
            "--lr",
            "5e-3",
            "--merge",
            str(tmp_path / "merged"),
        )
    )
    merged = tmp_path / "merged"
    assert not (merged / "adapter_config.json").exists() and (merged / "model.safetensors").is_file()
    assert {f.stat().st_mode & 0o777 for f in merged.iterdir()} == {0o666 & ~common._UMASK}
    info, src = (json.loads((d / "reward_model.json").read_text()) for d in (merged, tmp_path / "rm"))
    assert info == {**src, "merged_from": str(tmp_path / "rm")}
    assert reward_models.rm_settings(merged) == reward_models.rm_settings(tmp_path / "rm")
    assert json.loads((merged / "generation_config.json").read_text()).keys() <= {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "transformers_version",
        "_from_model_config",
    }
    adapter, tok = models.load_model(str(tmp_path / "rm"))
    plain, plain_tok = models.load_model(str(merged))
    assert type(plain).__name__ == "LlamaForCausalLM" and plain_tok.get_vocab() == tok.get_vocab()
    ids = torch.tensor([reward_models.rm_prompt(tok, "post: ann has a cat.\nsummary:", " ann has a dog.")[0]])
    with torch.no_grad():
        want, got = adapter(input_ids=ids).logits, plain(input_ids=ids).logits
    assert not torch.allclose(want, models.load_model(tiny_model_dir)[0](input_ids=ids).logits)  # it trained
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def adapter_weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_resume_continues_from_the_last_checkpoint(tmp_path, tiny_model_dir):
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(48))
    a, b = tmp_path / "a", tmp_path / "b"
    common_flags = ("--max-steps", "6", "--save-steps", "3", "--eval-limit", "0", "--lora-dropout", "0.1")
    rm.main(run_args(tmp_path, tiny_model_dir, data, a, *common_flags))  # uninterrupted: checkpoints 3 and 6
    rm.main(run_args(tmp_path, tiny_model_dir, data, b, *common_flags))
    shutil.rmtree(b / "checkpoints" / "checkpoint-6")  # as if killed between step 3 and step 6
    (b / "reward_model.json").unlink()
    result = rm.main(run_args(tmp_path, tiny_model_dir, data, b, *common_flags, "--resume"))
    info = json.loads((b / "reward_model.json").read_text())
    assert info["train"]["resumed_from"].endswith("checkpoint-3") and result["steps"] == 6
    wa, wb = adapter_weights(a), adapter_weights(b)
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:  # same data order, same dropout masks, same optimizer state: the same adapter
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(wa[k], adapter_weights(b / "checkpoints" / "checkpoint-3")[k]) for k in wa)

    # The resumed run really starts from the checkpoint's weights: shift them and the result moves too.
    from safetensors.torch import save_file

    c = tmp_path / "c"
    shutil.copytree(b / "checkpoints" / "checkpoint-3", c / "checkpoints" / "checkpoint-3")
    save_file(
        {k: v + 0.5 for k, v in adapter_weights(c / "checkpoints" / "checkpoint-3").items()},
        str(c / "checkpoints" / "checkpoint-3" / "adapter_model.safetensors"),
    )
    rm.main(run_args(tmp_path, tiny_model_dir, data, c, *common_flags, "--resume"))
    wc = adapter_weights(c)
    assert all((wc[k] - wa[k]).abs().max() > 0.1 for k in wa if "lora_B" in k)


@pytest.mark.slow  # 2 gloo ranks under torchrun
def test_torchrun_two_processes(tmp_path, tiny_model_dir):
    """Stage 2 under torchrun (2 CPU processes, gloo): Trainer's DDP trains one adapter with a global batch of 2 x 4,
    and rank 0 alone saves and evaluates it."""
    import os
    import socket

    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(64))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rm"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        str(ROOT / "02_train_reward.py"),
        "--model",
        tiny_model_dir,
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--batch-size",
        "4",
        "--max-steps",
        "4",
        "--eval-limit",
        "4",
        "--max-new-tokens",
        "8",
        "--save-steps",
        "2",
        "--eval-steps",
        "2",
        "--val-frac",
        "0.05",
        "--device",
        "cpu",
        "--min-parse-rate",
        "0",
        *LORA,
    ]  # 4 steps teach no format: its critiques need not parse here
    proc = forkserver.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("saved reward model to") == 1  # rank 0 only
    info = json.loads((out / "reward_model.json").read_text())
    assert info["train"]["steps"] == 4 and info["train"]["batch_size"] == 8  # 2 processes x 4 examples
    assert json.loads((out / "eval.json").read_text())["n"] == 3  # round(0.05 x 64) val records
    model, tok = models.load_model(str(out))
    assert type(model).__name__ == "PeftModelForCausalLM"


def _torchrun_rm(tmp_path, argv, nproc):
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        str(ROOT / "02_train_reward.py"),
        *argv,
    ]
    proc = forkserver.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # 2 gloo ranks under torchrun
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_fsdp_two_ranks_train_as_one_process(tmp_path, tiny_model_dir, lora):
    """02 --shard fsdp on 2 gloo ranks (4 examples each) trains the weights that one process trains on the same 8
    examples a step, within float rounding, and saves them whole: an adapter (LoRA on lm_head and the tied embeddings,
    the norms trained too) or the full tied model, each loading in one process (what each rank holds while it trains:
    tests/test_fsdp.py). Its train_loss is the one process's too: logged every step (lora), or never (full: HF's
    unlogged loss is each rank's own, and train_loss was rank 0's)."""
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(40))
    flags = [
        "--model",
        tiny_model_dir,
        "--data",
        str(data),
        "--seed",
        "0",
        "--max-steps",
        "2",
        "--eval-limit",
        "0",
        "--save-steps",
        "1000",
        "--eval-steps",
        "1000",
        "--val-frac",
        "0.1",
        "--device",
        "cpu",
        "--warmup",
        "0",
        "--logging-steps",
        "1" if lora else "1000",
        *(LORA if lora else ("--lora-r", "0", "--lr", "1e-3")),
        # SGD: each weight moves by lr times its gradient, so the summation order of two ranks stays a rounding
        # difference. Adam's lr * m / (sqrt(v) + eps) turns one gradient's rounding near eps into up to ~lr, a
        # difference that depends on the CPU's kernel path (AVX-512: 2.5e-5 on one weight of 38,400, issue 80)
        *("--optim", "sgd", "--loraplus-ratio", "0"),  # LoRA+ builds its own AdamW
    ]
    one = tmp_path / "one"
    _torchrun_rm(tmp_path, [*flags, "--batch-size", "8", "--output-dir", str(one)], nproc=1)
    two = tmp_path / "two"
    proc = _torchrun_rm(tmp_path, [*flags, "--batch-size", "4", "--shard", "fsdp", "--output-dir", str(two)], nproc=2)
    assert proc.stdout.count("saved reward model to") == 1
    info = [json.loads((d / "reward_model.json").read_text())["train"] for d in (one, two)]
    assert info[0]["batch_size"] == info[1]["batch_size"] == 8
    assert info[1]["train_loss"] == pytest.approx(info[0]["train_loss"], rel=1e-5)
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if lora else "model.safetensors"
    wa, wb = (load_file(str(d / name)) for d in (one, two))
    assert wa.keys() == wb.keys() and len(wa) > 4
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    moved = 0
    eps = torch.finfo(torch.float32).eps
    for k in wa:  # the step (what the update moved) agrees to 1e-4 of its largest element, each weight to 2 ulps more
        start = base[k] if k in base else torch.zeros_like(wa[k])  # the adapter's B starts at 0 (its A is random)
        step = (wa[k] - start).abs().max()
        allowed = 1e-4 * step + 2 * eps * torch.maximum(wa[k].abs(), wb[k].abs())
        worst = ((wb[k] - wa[k]).abs() / allowed).max().item()
        assert worst <= 1, f"{k}: two ranks differ by {worst:.1f} x the allowed rounding (largest step {step:.2e})"
        moved += not torch.equal(wa[k], start)
    assert moved > 4  # the weights moved (LoRA: B, and A wherever B was already nonzero... or full fine-tuning)
    model, _ = models.load_model(str(two))
    assert type(model).__name__ == ("PeftModelForCausalLM" if lora else "LlamaForCausalLM")


def test_fsdp_outside_torchrun_is_one_line(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(8))
    with pytest.raises(common.DataError, match=r"torchrun --nproc_per_node N 02_train_reward.py --shard fsdp"):
        rm.main(run_args(tmp_path, tiny_model_dir, data, tmp_path / "rm", "--shard", "fsdp", "--max-steps", "1"))
    assert not (tmp_path / "rm").exists()


@pytest.mark.slow  # 2 gloo ranks under torchrun
def test_fsdp_resume_is_exact(tmp_path, tiny_model_dir):
    """02 --shard fsdp killed after checkpoint 2 of 4 and resumed gives the uninterrupted run's adapter, to the bit: the
    gathered weights, Adam and scheduler states (fsdp_state.pt) and every rank's RNG (dropout) come back into the
    shards."""
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(40))
    flags = [
        "--model",
        tiny_model_dir,
        "--data",
        str(data),
        "--seed",
        "0",
        "--max-steps",
        "4",
        "--save-steps",
        "2",
        "--eval-limit",
        "0",
        "--eval-steps",
        "1000",
        "--val-frac",
        "0.1",
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--lora-dropout",
        "0.1",
        "--shard",
        "fsdp",
        *LORA,
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    _torchrun_rm(tmp_path, [*flags, "--output-dir", str(a)], nproc=2)
    _torchrun_rm(tmp_path, [*flags, "--output-dir", str(b)], nproc=2)
    shutil.rmtree(b / "checkpoints" / "checkpoint-4")  # as if killed between step 2 and step 4
    (b / "reward_model.json").unlink()
    _torchrun_rm(tmp_path, [*flags, "--output-dir", str(b), "--resume"], nproc=2)
    assert json.loads((b / "reward_model.json").read_text())["train"]["resumed_from"].endswith("checkpoint-2")
    wa, wb, w2 = adapter_weights(a), adapter_weights(b), adapter_weights(b / "checkpoints" / "checkpoint-2")
    assert wa.keys() == wb.keys() and len(wa) > 4
    assert all(torch.equal(wb[k], wa[k]) for k in wa)  # to the bit: the same ranks, data order and reductions
    assert not all(torch.equal(wa[k], w2[k]) for k in wa)


def test_targets_only_batches_give_the_same_loss_and_gradients(tiny_model_dir):
    """02 trains on targets-only batches (the LM head runs from the first target on): the same loss and gradients as
    the full logits, on a right-padded batch whose prompts and targets have different lengths."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer_of(tiny_model_dir)
    recs = annotations(3)
    recs[1] = {**recs[1], "prompt": recs[1]["prompt"] + " the end is near, the end is here."}
    feats = [rm.encode_example(tok, r, max_len=1024)[0] for r in recs]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full, cut = rm.collate(feats, tok.pad_token_id), rm.collate(feats, tok.pad_token_id, targets_only=True)
    assert cut["logits_to_keep"] < full["input_ids"].shape[1] and cut["labels"].shape[1] == cut["logits_to_keep"]
    assert (cut["labels"] != -100).sum() == (full["labels"] != -100).sum()
    grads = []
    for batch in (full, cut):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-7)


def test_a_reward_model_that_never_parses_ends_non_zero_and_stays_saved(tmp_path, tiny_model_dir):
    """One training step and 4 critique tokens: none of its held-out critiques can parse. Stage 2 ended with exit 0,
    and stage 3 trained on delta = 0 from it; now it ends with exit 1 and one line saying where the model is, its
    parse rate and what to do. The model and eval.json stay on disk; --min-parse-rate 0 accepts it."""
    data, out = tmp_path / "ann.jsonl", tmp_path / "rm"
    common.write_jsonl(data, annotations(16))
    cmd = [
        sys.executable,
        str(ROOT / "02_train_reward.py"),
        "--model",
        tiny_model_dir,
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        "--batch-size",
        "4",
        "--val-frac",
        "0.25",
        "--eval-limit",
        "2",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    ]
    proc = forkserver.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert reward_models.MIN_PARSE_RATE == 0.5
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: the reward model's critiques parsed on 0 of 2 held-out examples (parse rate 0.00, below "
        f"--min-parse-rate 0.5): as a critic it would give most rollouts delta = 0. It is saved in {out} (its "
        "outputs in eval_samples.jsonl); train it longer (--max-steps, --epochs), on more annotations or with a "
        "larger --max-new-tokens, then rerun with --overwrite; --min-parse-rate 0 accepts it as it is"
    )
    assert (out / "reward_model.json").is_file() and json.loads((out / "eval.json").read_text())["parse_rate"] == 0
    proc = forkserver.run(cmd + ["--overwrite", "--min-parse-rate", "0"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_reward_model_trained_from_a_relative_path_loads_from_any_directory(tmp_path, tiny_model_dir, monkeypatch):
    """`--model runs/smollm2` is how a user names a local base. The adapter records its base by that path, so it must
    be absolute: stage 3 and the benches load the reward model from other working directories."""
    shutil.copytree(tiny_model_dir, tmp_path / "work" / "base")
    common.write_jsonl(
        tmp_path / "work" / "ann.jsonl",
        [{**ex, **demo_critic(ex["prompt"], ex["response"]), "status": "ok"} for ex in demo_dataset("annotate", 8)],
    )
    monkeypatch.chdir(tmp_path / "work")
    rm.main(
        rm.parse_args(
            [
                "--model",
                "base",
                "--data",
                "ann.jsonl",
                "--output-dir",
                "rm",
                "--max-steps",
                "1",
                "--batch-size",
                "4",
                "--eval-limit",
                "0",
                "--device",
                "cpu",
                *LORA,
            ]
        )
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    reward_models.check_reward_model(str(tmp_path / "work" / "rm"))  # raised: "base ... no such directory"
    model, _ = models.load_model(str(tmp_path / "work" / "rm"))
    assert model is not None


def test_a_crash_while_saving_leaves_the_previous_reward_model_whole(tmp_path, tiny_model_dir, monkeypatch):
    """Stage 2 writes the new reward model in a temp folder and renames it into place: killed while saving, the folder
    still holds the previous reward model, every file of it, and no temp folder is left behind."""
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(16))
    out = tmp_path / "rm"
    rm.main(run_args(tmp_path, tiny_model_dir, data, out, "--max-steps", "1", "--eval-limit", "0"))
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    assert "reward_model.json" in before

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tokenizer_of(tiny_model_dir)), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        rm.main(run_args(tmp_path, tiny_model_dir, data, out, "--max-steps", "2", "--eval-limit", "0", "--overwrite"))
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ann.jsonl", "rm"]


def test_a_stage2_output_is_required_where_one_is_expected(tmp_path, tiny_model_dir):
    """A folder without reward_model.json (a plain model, or a save that never finished) is not a reward model: 03
    --critic local and 04 refuse it in one line, before anything is trained or generated."""
    with pytest.raises(
        common.DataError,
        match=rf"--reward-model {tiny_model_dir}: no reward_model\.json \(not a "
        r"stage-2 output; run 02_train_reward\.py\)",
    ):
        reward_models.check_reward_model(tiny_model_dir)
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            tiny_model_dir,
            "--critic",
            "local",
            "--reward-model",
            tiny_model_dir,
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "no reward_model.json" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_stage2_never_deletes_what_it_did_not_write(tmp_path, tiny_model_dir):
    """--output-dir holding files stage 2 did not write (its own --data, beside it) is refused in one line, exit 2,
    before any training, and nothing there is touched (the save used to replace the whole folder). A folder holding a
    reward model follows 03's rule: a fresh run is refused, --resume continues it (refused without a checkpoint),
    --overwrite replaces it."""
    x = tmp_path / "x"
    common.write_jsonl(x / "annotations.jsonl", annotations(8))
    data = (x / "annotations.jsonl").read_bytes()
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "02_train_reward.py"),
            "--model",
            tiny_model_dir,
            "--data",
            str(x / "annotations.jsonl"),
            "--output-dir",
            str(x),
            "--max-steps",
            "1",
            "--eval-limit",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: --output-dir {x}: holds files that a save there did not write (annotations.jsonl); a save replaces "
        "only its own files: name another folder"
    ]
    assert [p.name for p in x.iterdir()] == ["annotations.jsonl"] and (x / "annotations.jsonl").read_bytes() == data

    out, flags = tmp_path / "rm", ("--max-steps", "2", "--save-steps", "1", "--eval-limit", "0")
    rm.main(run_args(tmp_path, tiny_model_dir, x / "annotations.jsonl", out, *flags))
    weights = (out / "adapter_model.safetensors").read_bytes()
    with pytest.raises(
        common.DataError,
        match=rf"^{out} holds a run \(reward_model\.json, checkpoints\): --resume "
        r"continues it from its checkpoint, --overwrite replaces it$",
    ):
        rm.main(run_args(tmp_path, tiny_model_dir, x / "annotations.jsonl", out, *flags))
    assert (out / "adapter_model.safetensors").read_bytes() == weights and (out / "checkpoints").is_dir()
    rm.main(run_args(tmp_path, tiny_model_dir, x / "annotations.jsonl", out, *flags, "--resume"))  # at its last step
    assert json.loads((out / "reward_model.json").read_text())["train"]["resumed_from"].endswith("checkpoint-2")
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(common.DataError, match=r"^--resume: no checkpoints/ in .*rm, which holds a run"):
        rm.main(run_args(tmp_path, tiny_model_dir, x / "annotations.jsonl", out, *flags, "--resume"))
    rm.main(
        run_args(
            tmp_path,
            tiny_model_dir,
            x / "annotations.jsonl",
            out,
            "--max-steps",
            "1",
            "--eval-limit",
            "0",
            "--overwrite",
        )
    )
    assert json.loads((out / "reward_model.json").read_text())["train"]["steps"] == 1


# ----------------------------------------------------------------------------------------------------------------------
# A new user's first day (issue 46): the evaluation says what it measured
# ----------------------------------------------------------------------------------------------------------------------


def test_raw_outputs_count_their_words_where_nothing_parses(capsys):
    """A reward model that writes ~40 words that do not parse reported "critique 0.0 words": the words of its raw
    outputs are counted and shown beside the parsed critiques'."""
    t, o = word_tokens("tom has a red dog")
    items = [{"text": t, "offsets": o, "good_spans": ["tom"], "poor_spans": []}] * 2
    m = reward_models.rm_span_metrics(items, ["the response is fine and it is " * 5, "one two three"])
    assert m["critique_words"] == 0.0 and m["output_words"] == (35 + 3) / 2
    reward_models.print_table({**m, "gold_critique_words": 4.0})
    assert "raw outputs 19.0 words" in capsys.readouterr().out


def test_fewer_examples_than_eval_limit_say_why(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(data, annotations(40))
    metrics = rm.main(
        rm.parse_args(
            [
                "--model",
                tiny_model_dir,
                "--data",
                str(data),
                "--output-dir",
                str(tmp_path / "rm"),
                "--max-steps",
                "1",
                "--batch-size",
                "4",
                "--val-frac",
                "0.05",
                "--eval-limit",
                "8",
                "--max-new-tokens",
                "8",
                "--device",
                "cpu",
            ]
        )
    )
    assert metrics["n"] == 2
    assert (
        "span metrics on 2 val examples, not --eval-limit 8: the val split holds 2 (--val-frac 0.05 of 40 "
        "usable records)"
    ) in capsys.readouterr().out


def test_a_typo_in_a_local_model_path_is_one_line_at_once(tmp_path):
    (tmp_path / "runs").mkdir()
    common.write_jsonl(tmp_path / "ann.jsonl", annotations(4))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "02_train_reward.py"),
            "--model",
            "runs/smolm2",
            "--data",
            "ann.jsonl",
            "--output-dir",
            "runs/rm",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --model runs/smolm2: no such directory"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []
