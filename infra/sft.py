"""03 --sft-data: the SFT warm start before PPO, supervised fine-tuning of --model on (prompt, --sft-field) pairs, the
paper's SLF5K policy start. The loss is on the response and its EOS only; batches are drawn with replacement and
left-padded as in generation; LoRA (--sft-lora-r > 0, default --lora-r) is merged into the weights afterwards.

It trains once, on rank 0 (the others wait), and saves full weights to --sft-output-dir with sft.json, the settings
that made it. A later run with the same settings (the scalar baseline, a resume, another seed) reuses it; one with
other settings is refused unless --overwrite retrains it, and a resumed run never retrains it, since its checkpoint
belongs to the start it began from. A folder holding files a save did not write is refused (infra/runs.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

import common
from infra import distributed, models, runs, trainable


def add_args(p) -> None:
    g = p.add_argument_group("SFT warm start (infra/sft.py)")
    g.add_argument(
        "--sft-data", help="JSONL with 'prompt' and --sft-field: SFT before PPO (reused where sft.json matches)"
    )
    g.add_argument("--sft-field", default="response", help="the SFT target field")
    g.add_argument("--sft-steps", type=int, help="SFT optimizer steps")
    g.add_argument("--sft-lr", type=float, help="SFT learning rate")
    g.add_argument("--sft-batch-size", type=int, default=32, help="SFT batch size")
    g.add_argument(
        "--sft-lora-r", type=int, help="LoRA rank for SFT, merged afterwards; 0 = full fine-tuning (default: --lora-r)"
    )
    g.add_argument("--sft-output-dir", help="where the SFT model (merged, full weights) is saved; PPO starts from it")


def check_data(args) -> None:
    """Before any training: the SFT data is there (the demo preset's is written by stage 1)."""
    if args.sft_data and args.sft_steps > 0 and not Path(args.sft_data).is_file():
        raise common.DataError(
            f"--sft-data {args.sft_data}: no such file (stage 1 writes the demo's; --sft-steps 0 skips the warm start)"
        )


def sft_warm_start(args, rank: int, resuming: bool = False, demo_dir: str | None = None) -> str:
    """Supervised fine-tuning of --model on (prompt, --sft-field) of --sft-data before PPO, the loss on the response
    and its EOS only: --sft-steps AdamW steps on batches drawn with replacement, left-padded as in generation; LoRA
    (--sft-lora-r > 0) is merged into the weights afterwards. Trained once, on rank 0 (the others wait), and saved to
    --sft-output-dir as full weights that later runs (the scalar baseline among them) reuse (resuming: only reused,
    never trained, reuse_sft). demo_dir: the literal zero-flag demo's own SFT folder, which its rerun retrains.
    Returns that folder."""
    from tqdm.auto import tqdm

    sft_dir, device, dtype = Path(args.sft_output_dir), args.device, args.dtype
    lora_r = args.lora_r if args.sft_lora_r is None else args.sft_lora_r
    settings = sft_settings(args, lora_r)
    retrain = (
        args.overwrite
        or getattr(args, "zero_flag", False)
        and demo_dir is not None
        and sft_dir.resolve() == Path(demo_dir).resolve()
    )  # the literal zero-flag demo's own SFT start
    if reuse_sft(sft_dir, settings, retrain, print if rank == 0 else (lambda *a: None), resuming):
        return str(sft_dir)
    distributed.barrier()  # every rank has decided before rank 0 replaces the folder
    if rank == 0:
        model, tokenizer = models.load_model(
            args.model, device=device, dtype=dtype if lora_r > 0 else "float32"
        )  # full FT: fp32 master weights
        if lora_r > 0:  # LoRA for the warm start, merged into the weights afterwards
            model = trainable.add_lora(model, lora_r, 2 * lora_r, args.lora_targets)
        records = common.read_jsonl(args.sft_data, required=("prompt", args.sft_field))
        if not records:
            raise common.DataError(f"{args.sft_data}: no records")
        examples = [
            (
                models.policy_prompt(tokenizer, r["prompt"], args.chat_template, args.max_prompt_tokens),
                tokenizer(r[args.sft_field], add_special_tokens=False)["input_ids"][: args.max_new_tokens]
                + [tokenizer.eos_token_id],
            )
            for r in records
        ]
        model.train()
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.sft_lr)
        scaler, gen = distributed.grad_scaler(device, dtype), torch.Generator().manual_seed(args.seed)
        for _ in (bar := tqdm(range(args.sft_steps), desc="SFT warm start")):
            batch = [examples[i] for i in torch.randint(len(examples), (args.sft_batch_size,), generator=gen).tolist()]
            ids, attn = models.left_pad([p + y for p, y in batch], tokenizer.pad_token_id)
            labels = ids.masked_fill(attn == 0, -100)
            for i, (p, y) in enumerate(batch):
                labels[i, : ids.shape[1] - len(y)] = -100  # no loss on the prompt
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            with distributed.autocast(device, dtype):
                loss = model(
                    input_ids=ids.to(device),
                    attention_mask=attn.to(device),
                    position_ids=pos.to(device),
                    labels=labels.to(device),
                ).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()
        runs.save_pretrained(
            sft_dir, model.merge_and_unload() if lora_r > 0 else model, tokenizer, files={"sft.json": settings}
        )
    distributed.barrier(timeout_h=24)  # the other ranks wait for rank 0's SFT, however long it takes
    return str(sft_dir)


def sft_settings(args, lora_r: int) -> dict:
    """What an SFT start is made of (sft.json in --sft-output-dir): its flags, the SFT data's content hash and, for a
    local --model, its content (infra.runs.content_fingerprint: a base rebuilt in the same folder is another start)."""
    keys = (
        "model",
        "sft_field",
        "sft_steps",
        "sft_lr",
        "sft_batch_size",
        "lora_targets",
        "seed",
        "max_new_tokens",
        "max_prompt_tokens",
        "chat_template",
        "dtype",
        "max_grad_norm",
    )
    content = runs.content_fingerprint(args.model) if Path(args.model).exists() else None  # a hub id: its name
    return json.loads(
        json.dumps(
            {
                **{k: getattr(args, k) for k in keys},
                "sft_lora_r": lora_r,  # as sft.json reads
                "sft_data_sha256": hashlib.sha256(Path(args.sft_data).read_bytes()).hexdigest(),
                "model_content": content,
            }
        )
    )


def reuse_sft(sft_dir: Path, settings: dict, retrain: bool, log, resuming: bool = False) -> bool:
    """Whether the SFT start in sft_dir is used as it is (every rank decides the same, before anything is trained):
    a model there made by these settings (sft.json), or made elsewhere (no sft.json). One made by other settings is
    refused (DataError), unless `retrain` (--overwrite, or the zero-flag demo's own runs/demo/sft): then trained again.
    A folder without a model is trained into, unless it holds files an SFT save did not write (refused: a save
    replaces only its own files). `resuming` (--resume from a checkpoint): never trained, since the checkpoint's
    weights belong to the start it began from. log: rank 0's print."""
    if not (sft_dir / "config.json").is_file():
        if resuming:
            raise common.DataError(
                f"--resume: the run's SFT start {sft_dir} is gone: its checkpoint cannot continue "
                "on another one (--overwrite starts the run again)"
            )
        runs.check_save_dir(sft_dir, marker="sft.json", flag="--sft-output-dir ")
        return False
    made = json.loads((sft_dir / "sft.json").read_text()) if (sft_dir / "sft.json").is_file() else None
    if made is None or made == settings:
        log(f"SFT start: {sft_dir}, reused" + ("" if made else " (no sft.json: a model made elsewhere, used as it is)"))
        return True
    diff = "; ".join(
        "--sft-data: other content"
        if k == "sft_data_sha256"
        else "--model: other content"
        if k == "model_content"
        else f"--{k.replace('_', '-')}: {made.get(k)} there, {v} here"
        for k, v in settings.items()
        if made.get(k) != v
    )
    if retrain and not resuming:
        log(f"SFT start: {sft_dir} was made with other settings ({diff}): trained again")
        return False
    raise common.DataError(
        f"--sft-output-dir {sft_dir} holds an SFT start made with other settings ({diff}): "
        + (
            "--resume continues a run only on the start it began from"
            if resuming
            else "--overwrite retrains it, or name another --sft-output-dir"
        )
    )
