"""Stage 2: the generative span reward model (Text2Grad paper Sec. 3.4, Alg. 3).

A causal LM learns to write, for a (prompt, response) pair, the critique c and then the span JSON
A(y): one output z = [c ; A(y)], trained by teacher forcing with the loss on z only (labels -100 on
the prompt and padding). The prompt is common.build_rm_prompt, the builder 03 and 04 also use, so
training and inference prompts cannot drift apart. LoRA (peft) on any causal LM, trained by
transformers.Trainer (gradient accumulation, bf16, checkpoints, --resume, DDP under torchrun). The
saved model is then reloaded as stage 3 loads it and scored on the validation split (paper Tables 1
and 6: parse rate, unmatched spans, token precision/recall/F1 of its delta) -> eval.json; below
--min-parse-rate it exits 1, the model kept.

CPU demo (zero flags; reads stage 1's runs/demo/annotations.jsonl and runs/demo/base, ~2 min):
    python 02_train_reward.py
    python 02_train_reward.py --resume                  # continue an interrupted run
    python 02_train_reward.py --rm-format spans-only --output-dir runs/demo/rm_spans_only   # w/o CoT

GPU, the paper's settings (LoRA r=16, alpha=32 on q/v, lr 1e-5, 3 epochs; bf16 on CUDA):
    python 02_train_reward.py --task summarization --model meta-llama/Llama-3.1-8B-Instruct \\
        --data runs/summarization/annotations.jsonl --output-dir runs/summarization/reward_model \\
        --batch-size 4 --grad-accum 8 --gradient-checkpointing

The paper's scalar baselines (§4.3, App. N) train here too, on a scalar head of the same LM
(--objective pairwise: Bradley-Terry on chosen / rejected pairs; prm: a process reward model on
step labels; baselines/scalar_rm.py). 03 takes them as --critic scalar-rm and --critic prm.

The output directory holds the adapter, the tokenizer, reward_model.json (base model, format, the
budgets 03 and 04 use it with, training summary), eval.json, eval_samples.jsonl and checkpoints/.
It reads top to bottom: the presets and arguments; the data, encoded with the loss on the critique
and spans only; the evaluation of span recovery; main().
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

import common
from baselines import scalar_rm
from critics.learned import rm_critique
from infra import cli, distributed, models, reward_models, tracking, trainable, training
from infra.data import load_annotations, split_records

# ----------------------------------------------------------------------------------------------------------------------
# Arguments. Every training default comes from the --task preset below; a flag overrides it.
# ----------------------------------------------------------------------------------------------------------------------

PAPER = dict(  # the paper's recipe: LoRA r=16, alpha=32 on the q/v projections, lr 1e-5, 3 epochs
    model="meta-llama/Llama-3.1-8B-Instruct",
    lora_r=16,
    lora_alpha=32,
    lora_targets="q_proj,v_proj",
    modules_to_save="",
    loraplus_ratio=0.0,
    lr=1e-5,
    lr_schedule="cosine",
    epochs=3.0,
    max_steps=-1,
    batch_size=4,
    grad_accum=8,
    max_len=2048,
    warmup=0.03,
    val_frac=0.05,
    eval_limit=500,
    max_new_tokens=512,
    logging_steps=10,
    eval_steps=200,
    save_steps=200,
    sampling="epochs",
)
# The 0.6M-parameter demo model, sized to ~2.5 min on 2 CPU cores. Its poor-span recall was limited by
# LoRA (r32: 0.16, full fine-tuning 0.53), then data and length, not depth or width; 16000 fresh
# examples at a high lr teach it the rule. Drawn with replacement: a lower held-out loss than shuffled
# epochs in two paired runs (0.09 vs 0.17 after 700 steps). Measured: bench/rm_levers/README.md.
DEMO = dict(
    model="runs/demo/base",
    lora_r=0,
    lora_alpha=0,
    lora_targets="all-linear",
    modules_to_save="",
    loraplus_ratio=0.0,
    lr=3e-3,
    lr_schedule="linear",
    epochs=1.0,
    max_steps=600,
    batch_size=32,
    grad_accum=1,
    max_len=256,
    warmup=0.05,
    val_frac=0.025,
    eval_limit=200,
    max_new_tokens=96,
    logging_steps=50,
    eval_steps=300,
    save_steps=300,
    sampling="replacement",
)
PRESETS = {"demo": DEMO, "summarization": PAPER, "code": PAPER, "qa": PAPER}


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.parser(__doc__, {"summarization, code, qa (paper)": PAPER, "demo": DEMO})
    a = p.add_argument
    a("--task", default="demo", choices=sorted(PRESETS), help="preset of defaults (table below)")
    a("--data", help="annotations JSONL from 01_annotate.py (default runs/<task>/annotations.jsonl)")
    a("--model", help="base causal LM: hub id or local path (preset)")
    a("--output-dir", help="adapter, tokenizer, eval.json (default runs/<task>/reward_model)")
    a("--seed", type=int, default=0, help="seed of the train/val split, LoRA init and data order")
    a("--val-frac", type=float, help="share of records held out for eval loss and span metrics")
    a("--eval-limit", type=int, help="val records critiqued for span metrics, at most")
    a("--max-len", type=int, help="max tokens of input + target (input: minus --max-new-tokens)")
    a("--rm-format", default="critique+spans", choices=common.RM_FORMATS, help="spans-only: the w/o-CoT ablation")
    a("--objective", default="generative", choices=list(common.RM_OBJECTIVES), help="pairwise, prm: scalar RMs")
    # --- LoRA (peft)
    a("--lora-r", type=int, help="LoRA rank (paper: 16); 0 = full fine-tuning (the demo's)")
    a("--lora-alpha", type=int, help="LoRA alpha (paper: 32)")
    a("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    a("--lora-targets", help="comma-separated module names, or 'all-linear' (paper: q_proj,v_proj)")
    a("--modules-to-save", help="comma-separated modules trained in full, e.g. 'norm'")
    # --- optimisation (transformers.Trainer: infra/training.py)
    a("--lr", type=float, help="peak learning rate (paper: 1e-5)")
    a("--lr-schedule", choices=["cosine", "linear", "constant"], help="decay after the linear warmup")
    a("--epochs", type=float, help="passes over the train split (paper: 3)")
    a("--max-steps", type=int, help="optimizer steps; > 0 overrides --epochs")
    a("--batch-size", type=int, help="examples per device per micro-batch")
    a("--grad-accum", type=int, help="micro-batches per optimizer step")
    a("--warmup", type=float, help="linear warmup, as a fraction of all steps")
    a("--sampling", choices=["epochs", "replacement"], help="shuffled epochs, or with replacement")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("--gradient-checkpointing", action="store_true", help="recompute activations (memory)")
    a("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 (default: on with CUDA)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to train")
    # --- bookkeeping
    a("--logging-steps", type=int, help="log train loss every N steps")
    a("--eval-steps", type=int, help="eval loss on the val split every N steps")
    a("--save-steps", type=int, help="checkpoint every N steps (the last 2 are kept)")
    a("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoints' last")
    a("--overwrite", action="store_true", help="a fresh run replaces the reward model in --output-dir")
    # --- the span metrics: the reward model's critiques of the val split (as in 03)
    a("--max-new-tokens", type=int, help="max critique tokens: at evaluation, and 03's and 04's default")
    a("--gen-batch-size", type=int, default=32, help="critiques generated per batch at evaluation")
    training.add_args(p)  # the variants' groups
    distributed.add_args(p, rollouts=False)
    reward_models.add_args(p)
    scalar_rm.add_train_args(p)
    args = p.parse_args(argv)
    args.zero_flag = not (sys.argv[1:] if argv is None else argv)  # may replace the demo's model
    for key, value in PRESETS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.data = args.data or f"runs/{args.task}/annotations.jsonl"
    args.output_dir = args.output_dir or f"runs/{args.task}/reward_model"
    if Path(args.model).is_dir():  # the adapter names its base by it: absolute, to load from anywhere
        args.model = str(Path(args.model).resolve())
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bf16 is None:
        args.bf16 = args.device == "cuda" and torch.cuda.is_bf16_supported()
    scalar_rm.check_train_args(args)
    tracking.check(args.report_to)  # --report-to: known trackers, their packages installed
    if args.max_new_tokens >= args.max_len:
        raise common.DataError(
            f"--max-new-tokens {args.max_new_tokens}: must be below --max-len {args.max_len} (the "
            "reward model's input gets the rest)"
        )
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Data: annotations -> (input_ids, labels), the loss on the target z only
# ----------------------------------------------------------------------------------------------------------------------


def encode_example(
    tokenizer, rec: dict, max_len: int, max_prompt_tokens: int | None = None, rm_format: str = "critique+spans"
) -> tuple[dict | None, str]:
    """({"input_ids", "labels"}, status) for one record; status "ok", "truncated" or "too_long" (None).

    input = build_rm_prompt(prompt, response) ++ z ++ EOS, z = format_rm_target(critique, spans)
    (Sec. 3.4), or the span JSON alone with rm_format "spans-only" (w/o CoT). Prompt and target are
    tokenized apart, as the model sees them at inference. The input is cut as 03 and 04 cut it
    (infra.reward_models.rm_prompt) to max_prompt_tokens, and further where the target would not fit
    in max_len beside it: the task prompt loses its start, never the instruction, the response or
    the target. If even an empty task prompt does not fit, the example is dropped.
    """
    target = tokenizer(
        common.format_rm_target(rec["critique"], rec["good_spans"], rec["poor_spans"], rm_format),
        add_special_tokens=False,
    )["input_ids"] + [tokenizer.eos_token_id]
    budget = min(max_prompt_tokens or max_len, max_len - len(target))
    prompt_ids, _, status = reward_models.rm_prompt(tokenizer, rec["prompt"], rec["response"], budget, rm_format)
    if status == "too_long":
        return None, status
    return {"input_ids": prompt_ids + target, "labels": [-100] * len(prompt_ids) + target}, status


def encode_all(
    tokenizer,
    records: list[dict],
    max_len: int,
    max_prompt_tokens: int | None = None,
    rm_format: str = "critique+spans",
) -> tuple[list[dict], dict]:
    """Encoded examples and {"ok", "truncated", "too_long"} counts."""
    examples, counts = [], {"ok": 0, "truncated": 0, "too_long": 0}
    for rec in records:
        ex, status = encode_example(tokenizer, rec, max_len, max_prompt_tokens, rm_format)
        counts[status] += 1
        if ex is not None:
            examples.append(ex)
    return examples, counts


def collate(features: list[dict], pad_id: int, targets_only: bool = False) -> dict:
    """Right-pad a batch: input_ids (B, T) with pad_id, labels (B, T) with -100, attention_mask.

    targets_only: the LM head runs only from the position before the batch's first target token
    (`logits_to_keep`, labels cut to match): the prompt's logits have no loss, and they are most of
    the (B, T, V) float32 tensor (1 GB per row for Llama-3.1). The loss is the same."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), pad_id, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    if not targets_only:
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    first = min((next((i for i, t in enumerate(f["labels"]) if t != -100), width) for f in features))
    keep = width - max(first - 1, 0)  # position t predicts token t + 1: from the one before
    return {"input_ids": ids, "labels": labels[:, -keep:], "attention_mask": mask, "logits_to_keep": keep}


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation: greedy critiques of the val split (as in stage 3) against the annotations
# ----------------------------------------------------------------------------------------------------------------------


def evaluate_rm(
    model,
    tokenizer,
    records: list[dict],
    max_new_tokens: int,
    batch_size: int = 32,
    max_prompt_tokens: int | None = None,
    rm_format: str = "critique+spans",
):
    """(metrics, raw outputs) of the reward model on `records` (infra.reward_models.rm_span_metrics,
    Tables 1 and 6), its input cut to max_prompt_tokens as in training and in 03 and 04. Tokens: the
    response's own under the reward model's tokenizer (decode_with_offsets); gold delta from the
    annotated spans (span_rewards), predicted delta from the parsed critique.
    """
    outputs = rm_critique(
        model,
        tokenizer,
        [r["prompt"] for r in records],
        [r["response"] for r in records],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        desc="critique val split",
        max_prompt_tokens=max_prompt_tokens,
        rm_format=rm_format,
    )
    items = []
    for rec in records:
        text, offsets = common.decode_with_offsets(
            tokenizer, tokenizer(rec["response"], add_special_tokens=False)["input_ids"]
        )
        items.append({"text": text, "offsets": offsets, **{k: rec[k] for k in ("good_spans", "poor_spans")}})
    metrics = reward_models.rm_span_metrics(items, outputs)
    metrics["gold_critique_words"] = sum(len(r["critique"].split()) for r in records) / max(1, len(records))
    return metrics, outputs


# ----------------------------------------------------------------------------------------------------------------------
# Main: data -> LoRA model -> Trainer -> save -> reload as stage 3 does -> span metrics
# ----------------------------------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> dict:
    from transformers import set_seed

    models.check_model_path(args.model, "--model ")  # a typo'd folder: one line, at once
    reward_models.check_output_dir(args)
    if args.objective != "generative":  # a scalar reward model: the paper's PPO and PRM-PPO baselines
        return scalar_rm.main_scalar(args)
    t0 = time.time()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    log = print if rank0 else (lambda *a, **k: None)
    out, data = Path(args.output_dir), Path(args.data)
    if not data.is_file() and args.task == "demo" and args.data == "runs/demo/annotations.jsonl":
        raise common.DataError(f"{data}: no such file (run `python 01_annotate.py` first)")
    records, n_failed = load_annotations(data)
    train_recs, val_recs = split_records(records, args.val_frac, args.seed)
    log(
        f"{data}: {len(records)} usable records ({n_failed} failed, skipped) -> {len(train_recs)} train, "
        f"{len(val_recs)} val"
    )

    # ---- model: base causal LM + LoRA adapter (Alg. 3: only the adapter is trained) ----
    set_seed(args.seed)
    model, tokenizer = models.load_model(args.model, dtype="bf16" if args.bf16 else "float32")
    model.config.use_cache = False  # no KV cache while training (activation checkpointing needs it)
    if args.lora_r > 0:
        model = trainable.add_lora(
            model, args.lora_r, args.lora_alpha, args.lora_targets, args.lora_dropout, args.modules_to_save
        )
    model = distributed.shard_for_trainer(model, args)  # --shard fsdp: parameters, gradients, Adam
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trained = "full fine-tuning"
    if args.lora_r > 0:
        trained = f"LoRA r={args.lora_r} alpha={args.lora_alpha} on {args.lora_targets}"
    n_all = sum(p.numel() for p in model.parameters())
    log(f"model {args.model}: {trained}, {n_train:,} trainable of {n_all:,} parameters")

    max_prompt_tokens = args.max_len - args.max_new_tokens  # the input's budget, in use as in training
    train_set, train_counts = encode_all(tokenizer, train_recs, args.max_len, max_prompt_tokens, args.rm_format)
    val_set, _ = encode_all(tokenizer, val_recs, args.max_len, max_prompt_tokens, args.rm_format)
    if not train_set:
        raise common.DataError(f"{data}: no training example fits in --max-len {args.max_len}")
    log(
        f"max_len {args.max_len}, input <= {max_prompt_tokens} tokens: {train_counts['truncated']} train examples cut "
        f"at the prompt's start, {train_counts['too_long']} dropped (response + target alone too long)"
    )

    # ---- training (teacher forcing: the mean NLL of the target tokens, labels -100 elsewhere) ----
    trainer, resume_from = training.make_trainer(
        args,
        model,
        train_set,
        val_set,
        functools.partial(collate, pad_id=tokenizer.pad_token_id, targets_only=True),
        log,
        rank0,
    )
    result = trainer.train(resume_from_checkpoint=resume_from)
    # the mean over ranks: HF adds the loss since its last log to train_loss unreduced (rank 0's)
    train_loss = (
        distributed.all_sum(torch.tensor(result.training_loss, device=trainer.args.device)).item()
        / trainer.args.world_size
    )
    final_eval = trainer.evaluate() if val_set else {}
    train_s = time.time() - t0
    state_dict = distributed.full_state_dict(model)  # --shard fsdp: whole on every rank, rank 0 saves
    if not trainer.is_world_process_zero():
        return {}

    # ---- save first, evaluate second: a crash in evaluation must not cost the training run ----
    summary = {
        "base_model": args.model,
        "adapter": "peft LoRA" if args.lora_r > 0 else None,
        "task": args.task,
        "data": str(data),
        "objective": "generative",
        "rm_format": args.rm_format,
        "prompt_format": common.RM_PROMPT_FORMAT,
        "target_format": common.RM_TARGET_FORMAT,
        # how 03 and 04 use it (infra.reward_models.rm_settings): the input cut to this many tokens,
        # as in training; critiques of up to max_new_tokens, as in the evaluation below
        "max_prompt_tokens": max_prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "lora": {
            "r": args.lora_r,
            "alpha": args.lora_alpha,
            "dropout": args.lora_dropout,
            "targets": args.lora_targets,
            "modules_to_save": args.modules_to_save,
            "loraplus_ratio": args.loraplus_ratio,
        },
        "train": {
            "records": len(train_recs),
            "examples": len(train_set),
            "val_records": len(val_recs),
            "failed_skipped": n_failed,
            "truncated": train_counts["truncated"],
            "too_long_dropped": train_counts["too_long"],
            "max_len": args.max_len,
            "lr": args.lr,
            "lr_schedule": args.lr_schedule,
            "sampling": args.sampling,
            "epochs": args.epochs,
            "steps": trainer.state.global_step,
            "resumed_from": resume_from,
            "batch_size": args.batch_size * args.grad_accum * trainer.args.world_size,
            "seed": args.seed,
            "train_loss": train_loss,
            "eval_loss": final_eval.get("eval_loss"),
            "train_s": round(train_s, 1),
        },
    }
    reward_models.save_reward_model(model, args, out, summary, state_dict)
    log(f"saved reward model to {out} (eval loss {final_eval.get('eval_loss', float('nan')):.4f})")
    del trainer, model

    # ---- span metrics of the saved reward model, loaded exactly as stage 3 loads it ----
    eval_recs = val_recs[: args.eval_limit]
    if len(eval_recs) < args.eval_limit:  # say why fewer than asked
        log(
            f"span metrics on {len(eval_recs)} val examples, not --eval-limit {args.eval_limit}: the val split holds "
            f"{len(val_recs)} (--val-frac {args.val_frac:g} of {len(records)} usable records)"
        )
    metrics = {"n": 0}
    if eval_recs:
        rm, rm_tok = models.load_model(str(out), device=args.device, dtype="bf16" if args.bf16 else "float32")
        t1 = time.time()
        metrics, outputs = evaluate_rm(
            rm, rm_tok, eval_recs, args.max_new_tokens, args.gen_batch_size, max_prompt_tokens, args.rm_format
        )
        metrics["critique_s"] = round(time.time() - t1, 1)
        samples = []
        for r, o in zip(eval_recs, outputs):
            sample = {"id": r.get("id"), "prompt": r["prompt"], "response": r["response"], "output": o}
            samples.append({**sample, "gold_good_spans": r["good_spans"], "gold_poor_spans": r["poor_spans"]})
        common.write_jsonl(out / "eval_samples.jsonl", samples)
        reward_models.print_table(metrics)
    metrics.update(
        eval_loss=final_eval.get("eval_loss"),
        train_loss=train_loss,
        steps=summary["train"]["steps"],
        train_s=round(train_s, 1),
        wall_s=round(time.time() - t0, 1),
    )
    common.write_json(out / "eval.json", metrics)
    log(f"wrote {out / 'eval.json'} ({metrics['wall_s']:.0f} s in all)")
    if args.merge:
        merged = reward_models.merge_reward_model(out, args.merge, "bf16" if args.bf16 else "float32")
        log(f"merged for serving: {merged}")
    return metrics


if __name__ == "__main__":
    try:
        args = parse_args()
        sys.exit(reward_models.parse_rate_check(main(args), args))  # mostly unparsed critiques: exit 1
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
