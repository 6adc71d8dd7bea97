"""Stage 2: the generative span reward model (Text2Grad paper Sec. 3.4, Alg. 3).

A causal LM learns to write, for a (prompt, response) pair, the critique c and then the span JSON A(y): one
autoregressive output z = [c ; A(y)], trained by teacher forcing with the loss on z only (labels are -100 on the
prompt and on padding). The prompt comes from common.build_rm_prompt, the one builder that 03_train_policy.py and
04_evaluate.py also use, so training and inference prompts cannot drift apart. The model is LoRA (peft) on any causal
LM; training runs on transformers.Trainer (gradient accumulation, bf16, activation checkpointing, checkpoints and
--resume, DDP under torchrun). Afterwards the saved reward model is reloaded exactly as stage 3 loads it and scored on
the validation split: JSON parse rate, unmatched-span rate, token-level precision/recall/F1 of its delta in {+1, -1}
against the annotated spans (paper Tables 1 and 6), span exact/partial matches, critique length -> eval.json. Should
fewer than --min-parse-rate (half) of its critiques parse, it ends with exit 1, the model kept (infra/reward_models.py).

CPU demo (zero flags; reads runs/demo/annotations.jsonl and runs/demo/base from 01_annotate.py, ~2 min on 2 cores):
    python 02_train_reward.py
    python 02_train_reward.py --resume                  # continue an interrupted run from its last checkpoint
    torchrun --nproc_per_node 2 02_train_reward.py      # the same run as 2 DDP processes (gloo on CPU)
    python 02_train_reward.py --rm-format spans-only --output-dir runs/demo/rm_spans_only   # w/o CoT (Table 2)

GPU, the paper's settings (LoRA r=16, alpha=32 on q/v, lr 1e-5, 3 epochs; bf16 is on by default on CUDA):
    python 02_train_reward.py --task summarization --model meta-llama/Llama-3.1-8B-Instruct \\
        --data runs/summarization/annotations.jsonl --output-dir runs/summarization/reward_model \\
        --batch-size 4 --grad-accum 8 --gradient-checkpointing
    torchrun --nproc_per_node 8 02_train_reward.py --task code --model Qwen/Qwen2.5-7B-Instruct --batch-size 2

The paper's scalar baselines (§4.3, App. N) train here too, on a scalar head (sequence classification) of the same LM,
with the same Trainer set-up (infra/training.py) and saving (infra/reward_models.py); their code and flags are in
baselines/scalar_rm.py (main_scalar):
    python 02_train_reward.py --objective pairwise --data pairs.jsonl --output-dir runs/demo/bt_rm   # PPO's RM
    python 02_train_reward.py --objective pairwise --data HuggingFaceH4/ultrafeedback_binarized --split train_prefs
    python 02_train_reward.py --objective prm --data runs/demo/annotations.jsonl --output-dir runs/demo/prm  # PRM-PPO's
pairwise: a Bradley-Terry reward model on chosen / rejected pairs; prm: a process reward model on step labels. 03 takes
them as --critic scalar-rm and --critic prm, and refuses each where the other kind is needed (reward_model.json's
objective).

The output directory holds the LoRA adapter (adapter_config.json + weights), the tokenizer, reward_model.json (base
model, format, the input and critique budgets that 03 and 04 use it with, training summary), eval.json,
eval_samples.jsonl and checkpoints/; infra.models.load_model(DIR) and `03_train_policy.py --reward-model DIR` need
nothing else. It reads top to bottom: the presets and arguments; the data, encoded with the loss on the critique and
spans only; the evaluation of span recovery; main().
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
from infra import cli, distributed, models, reward_models, trainable, training
from infra.data import load_annotations, split_records

# ----------------------------------------------------------------------------------------------------------------------
# Arguments. Every training default comes from the --task preset below; any flag overrides its preset value.
# ----------------------------------------------------------------------------------------------------------------------

PAPER = dict(  # the paper's reward-model recipe: LoRA r=16, alpha=32 on the q/v projections, lr 1e-5, 3 epochs
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
# The 0.6M-parameter demo model, sized to ~2.5 min on 2 CPU cores. What limited its poor-span recall (rm_levers,
# bench/README.md): LoRA first (r32: recall 0.16 where full fine-tuning got 0.53),
# then data and training length, not depth or width. On 2000 annotations it memorised (train loss 0.01); 16000 fresh
# examples (01_annotate.py) and full fine-tuning at a high lr teach it the rule (is each quoted word in the post?),
# wrong facts last. Examples are drawn with replacement: in two paired runs on the same 8000 examples that reached a
# lower held-out loss than shuffled epochs (0.09 vs 0.17 after 700 steps, 0.23 vs 0.30 after 300).
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
    a("--output-dir", help="adapter, tokenizer, eval.json, checkpoints (default runs/<task>/reward_model)")
    a("--seed", type=int, default=0, help="seed of the train/val split, LoRA init and data order")
    a("--val-frac", type=float, help="share of records held out for eval loss and span metrics (preset)")
    a("--eval-limit", type=int, help="at most this many val records are critiqued for span metrics")
    a(
        "--max-len",
        type=int,
        help="max tokens of input + target; the input gets --max-len minus --max-new-tokens (encode_example)",
    )
    a(
        "--rm-format",
        default="critique+spans",
        choices=common.RM_FORMATS,
        help="critique+spans: the paper's z = [c ; A(y)]; spans-only: its w/o-CoT ablation (Table 2)",
    )
    a(
        "--objective",
        default="generative",
        choices=list(common.RM_OBJECTIVES),
        help="generative: the span reward "
        "model (Sec. 3.4); pairwise, prm: the scalar baselines (baselines/scalar_rm.py)",
    )
    # --- LoRA (peft)
    a("--lora-r", type=int, help="LoRA rank (paper: 16); 0 = full fine-tuning (the demo's small model)")
    a("--lora-alpha", type=int, help="LoRA alpha (paper: 32)")
    a("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    a("--lora-targets", help="comma-separated module names, or 'all-linear' (paper: q_proj,v_proj)")
    a("--modules-to-save", help="comma-separated modules trained in full and saved with the adapter, e.g. 'norm'")
    # --- optimisation (transformers.Trainer: infra/training.py)
    a("--lr", type=float, help="peak learning rate (paper: 1e-5)")
    a("--lr-schedule", choices=["cosine", "linear", "constant"], help="decay after the linear warmup")
    a("--epochs", type=float, help="passes over the train split (paper: 3)")
    a("--max-steps", type=int, help="optimizer steps; overrides --epochs when > 0 (-1: use --epochs)")
    a("--batch-size", type=int, help="examples per device per micro-batch")
    a("--grad-accum", type=int, help="micro-batches per optimizer step")
    a("--warmup", type=float, help="linear warmup, as a fraction of all steps")
    a(
        "--sampling",
        choices=["epochs", "replacement"],
        help="draw training examples in shuffled epochs, or independently with replacement",
    )
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("--gradient-checkpointing", action="store_true", help="recompute activations to save memory")
    a("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 (default: on with CUDA)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to train")
    # --- bookkeeping
    a("--logging-steps", type=int, help="log train loss every N steps")
    a("--eval-steps", type=int, help="eval loss on the val split every N steps")
    a("--save-steps", type=int, help="checkpoint every N steps (the last 2 are kept)")
    a("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT_DIR/checkpoints")
    a(
        "--overwrite",
        action="store_true",
        help="a fresh run replaces the reward model in --output-dir (infra/reward_models.py: check_output_dir)",
    )
    # --- the span metrics: the reward model's critiques of the val split (critics.learned.rm_critique, as in 03)
    a("--max-new-tokens", type=int, help="max critique tokens: at evaluation, and 03's and 04's default")
    a("--gen-batch-size", type=int, default=32, help="critiques generated per batch at evaluation")
    for add_args in (
        training.add_args,
        functools.partial(distributed.add_args, rollouts=False),
        reward_models.add_args,
        scalar_rm.add_train_args,
    ):  # the variants' groups
        add_args(p)
    args = p.parse_args(argv)
    args.zero_flag = not (sys.argv[1:] if argv is None else argv)  # only this command may replace the demo's model
    for key, value in PRESETS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.data = args.data or f"runs/{args.task}/annotations.jsonl"
    args.output_dir = args.output_dir or f"runs/{args.task}/reward_model"
    if Path(args.model).is_dir():  # the adapter names its base by this path: absolute, to load from any directory
        args.model = str(Path(args.model).resolve())
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bf16 is None:
        args.bf16 = args.device == "cuda" and torch.cuda.is_bf16_supported()
    scalar_rm.check_train_args(args)
    if args.max_new_tokens >= args.max_len:
        raise common.DataError(
            f"--max-new-tokens {args.max_new_tokens}: must be below --max-len {args.max_len} (the "
            "reward model's input gets the rest)"
        )
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Data: annotations (infra.data.load_annotations, split_records) -> (input_ids, labels), the loss on the target z only
# ----------------------------------------------------------------------------------------------------------------------


def encode_example(
    tokenizer, rec: dict, max_len: int, max_prompt_tokens: int | None = None, rm_format: str = "critique+spans"
) -> tuple[dict | None, str]:
    """({"input_ids", "labels"}, status) for one record; status is "ok", "truncated" or "too_long" (then None).

    input = build_rm_prompt(prompt, response) ++ z ++ EOS, where z = format_rm_target(critique, spans) (Sec. 3.4), or
    the span JSON alone with rm_format "spans-only" (w/o CoT).
    Prompt and target are tokenized separately, exactly as the model sees them at inference (it generates z after the
    prompt's last token). The input is cut as 03 and 04 cut it (infra.reward_models.rm_prompt) to max_prompt_tokens,
    main()'s --max-len minus --max-new-tokens (reward_model.json; 03 and 04 cut it there too), and further where a
    longer target would not fit in max_len beside it. Cutting loses the start of the task prompt: never the
    instruction, the response or the target, which the spans are quoted from. If even an empty task prompt does not
    fit, the example is dropped.
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
    """Right-pad a batch: input_ids (B, T) with pad_id, labels (B, T) with -100, attention_mask (B, T).

    targets_only: the LM head runs only from the position before the batch's first target token to the end
    (`logits_to_keep`, labels cut to match): the prompt's logits have no loss, and on a real vocabulary they are most
    of the (B, T, V) float32 tensor (128k x 2048 x 4 B = 1 GB per row for Llama-3.1). The loss is the same."""
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
    keep = width - max(first - 1, 0)  # logits at position t predict token t + 1: keep the one before the first target
    return {"input_ids": ids, "labels": labels[:, -keep:], "attention_mask": mask, "logits_to_keep": keep}


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation: greedy critiques of the val split (critics.learned.rm_critique, as in stage 3) against the annotations
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
    """(metrics, raw outputs) of the reward model on `records` (infra.reward_models.rm_span_metrics, paper Tables 1
    and 6). Its input is cut as in training and in 03 and 04 (infra.reward_models.rm_prompt) to max_prompt_tokens.

    Tokens are the response's own tokens under the reward model's tokenizer, with intervals from decode_with_offsets;
    gold delta comes from the annotated spans through span_rewards, predicted delta from the parsed critique.
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
# Main: data -> LoRA model -> Trainer (train, eval loss, checkpoints) -> save -> reload as stage 3 does -> span metrics
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
    model.config.use_cache = False  # no KV cache while training (and required by activation checkpointing)
    if args.lora_r > 0:
        model = trainable.add_lora(
            model, args.lora_r, args.lora_alpha, args.lora_targets, args.lora_dropout, args.modules_to_save
        )
    model = distributed.shard_for_trainer(model, args)  # --shard fsdp: parameters, gradients, Adam states sharded
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"model {args.model}: "
        + (
            f"LoRA r={args.lora_r} alpha={args.lora_alpha} on {args.lora_targets}, "
            if args.lora_r > 0
            else "full fine-tuning, "
        )
        + f"{n_train:,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters"
    )

    max_prompt_tokens = args.max_len - args.max_new_tokens  # the input's budget, in use as in training (rm_settings)
    train_set, train_counts = encode_all(tokenizer, train_recs, args.max_len, max_prompt_tokens, args.rm_format)
    val_set, _ = encode_all(tokenizer, val_recs, args.max_len, max_prompt_tokens, args.rm_format)
    if not train_set:
        raise common.DataError(f"{data}: no training example fits in --max-len {args.max_len}")
    log(
        f"max_len {args.max_len}, input <= {max_prompt_tokens} tokens: {train_counts['truncated']} train examples cut "
        f"at the prompt's start, {train_counts['too_long']} dropped (response + target alone too long)"
    )

    # ---- training (teacher forcing; the loss is the mean NLL of the target tokens, labels -100 elsewhere) ----
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
    # the mean over ranks: HF adds the loss since its last logging step to train_loss unreduced (rank 0's alone)
    train_loss = (
        distributed.all_sum(torch.tensor(result.training_loss, device=trainer.args.device)).item()
        / trainer.args.world_size
    )
    final_eval = trainer.evaluate() if val_set else {}
    train_s = time.time() - t0
    state_dict = distributed.full_state_dict(model)  # --shard fsdp: gathered whole on every rank, saved by rank 0
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
        # how 03 and 04 use it (infra.reward_models.rm_settings): the input cut to this many tokens, as in training;
        # critiques of up to max_new_tokens, as in the evaluation below
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
        common.write_jsonl(
            out / "eval_samples.jsonl",
            [
                {
                    "id": r.get("id"),
                    "prompt": r["prompt"],
                    "response": r["response"],
                    "output": o,
                    "gold_good_spans": r["good_spans"],
                    "gold_poor_spans": r["poor_spans"],
                }
                for r, o in zip(eval_recs, outputs)
            ],
        )
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
        sys.exit(reward_models.parse_rate_check(main(args), args))  # a critic that mostly does not parse: exit 1
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
