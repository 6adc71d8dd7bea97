"""02 --loraplus-ratio, --sampling, --resume and the Trainer's other flags: the transformers.Trainer that stage 2
trains both kinds of reward model with (make_trainer): the generative one (02_train_reward.py) and the paper's scalar
baselines (baselines/scalar_rm.py: main_scalar, its loss passed in as loss_fn). It brings gradient accumulation, bf16,
activation checkpointing (--gradient-checkpointing), DDP under torchrun, the eval loss on the val split every
--eval-steps, and checkpoints in OUTPUT_DIR/checkpoints every --save-steps (the last 2 kept): a fresh run clears them,
--resume continues from the last.

Two changes to a plain Trainer. --sampling replacement draws every training example independently
(replacement_sampler) where a Trainer draws shuffled epochs: on the demo, in two paired runs on the same 8000
examples, that reached a lower held-out loss (02's DEMO preset). --loraplus-ratio R > 0 (LoRA+, Hayou et al. 2024)
gives the B matrices of the LoRA adapter R times the learning rate of the A matrices (peft's
create_loraplus_optimizer); 0 is plain LoRA, the paper's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from common import DataError
from infra import distributed, tracking


def add_args(p) -> None:
    tracking.add_args(p)  # --report-to: the Trainer's own callbacks (infra/tracking.py)
    g = p.add_argument_group("the optimizer (infra/training.py)")
    g.add_argument("--optim", help="the Trainer's optimizer: adamw_torch, sgd, adafactor, ... (default: AdamW)")
    g.add_argument(
        "--loraplus-ratio",
        type=float,
        help="the B matrices learn this many times faster than A; 0 = plain LoRA (paper)",
    )


def make_trainer(args, model, train_set, val_set, collator, log, rank0: bool, loss_fn=None):
    """(transformers.Trainer of this run, the checkpoint it resumes from or None): checkpoints in
    OUTPUT_DIR/checkpoints (a fresh run clears them; --resume continues from the last), the eval loss on val_set,
    --sampling, LoRA+ (--loraplus-ratio). loss_fn(model, inputs) -> mean loss replaces the model's own loss (the
    scalar objectives: baselines/scalar_rm.py)."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    sharded = getattr(args, "shard", "ddp") == "fsdp"  # infra/distributed.shard_for_trainer sharded the model
    ckpt_dir = Path(args.output_dir) / "checkpoints"
    resume_from = get_last_checkpoint(str(ckpt_dir)) if args.resume and ckpt_dir.is_dir() else None
    if args.resume and resume_from is None:
        log(f"--resume: no checkpoint in {ckpt_dir}, starting from scratch")
    if not args.resume and ckpt_dir.is_dir() and rank0:
        shutil.rmtree(ckpt_dir)  # a fresh run: old checkpoints would otherwise be mixed with the new ones
    report_to = tracking.parse(getattr(args, "report_to", "none"))  # (02's; a caller without the flag: none)
    if "tensorboard" in report_to:  # the callback's folder, kept with the run
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(ckpt_dir / "tensorboard"))
    targs = TrainingArguments(
        output_dir=str(ckpt_dir),
        seed=args.seed,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        lr_scheduler_type={"constant": "constant_with_warmup"}.get(args.lr_schedule, args.lr_schedule),
        weight_decay=args.weight_decay,
        **({"optim": args.optim} if getattr(args, "optim", None) else {}),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        bf16=args.bf16,
        use_cpu=args.device == "cpu",
        activation_checkpointing=args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if val_set else "no",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to=report_to or "none",  # transformers' callbacks
        remove_unused_columns=False,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        save_only_model=sharded,
    )  # (the Trainer asks it of a model that shards itself; FSDPCheckpoints saves the rest)
    FSDPCheckpoints = _fsdp_checkpoints() if sharded else None
    optimizer = None  # None: Trainer's AdamW
    if args.loraplus_ratio and args.lora_r > 0:
        if getattr(args, "optim", None):
            raise DataError(
                f"--optim {args.optim}: LoRA+ (--loraplus-ratio {args.loraplus_ratio:g}) builds its own AdamW"
            )
        from peft.optimizers import create_loraplus_optimizer

        optimizer = create_loraplus_optimizer(
            model, torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay, loraplus_lr_ratio=args.loraplus_ratio
        )

    class SamplingTrainer(FSDPCheckpoints if sharded else Trainer):
        def _get_train_sampler(self, *a, **k):
            return replacement_sampler(self) if args.sampling == "replacement" else super()._get_train_sampler(*a, **k)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if loss_fn is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = loss_fn(model, inputs)
            return (loss, {}) if return_outputs else loss

    trainer = SamplingTrainer(
        model=model,
        args=targs,
        optimizers=(optimizer, None),
        train_dataset=train_set,
        eval_dataset=val_set or None,
        data_collator=collator,
    )
    if loss_fn is not None:  # loss_fn's loss is a mean: Trainer then divides it by the micro-batches it accumulates
        trainer.model_accepts_loss_kwargs = False
    return trainer, resume_from


def _fsdp_checkpoints():
    """--shard fsdp: a Trainer whose checkpoints hold the gathered trainable weights, optimizer and scheduler states
    (fsdp_state.pt, written by rank 0, read by every rank) besides the plain adapter or model folder; --resume loads
    them back into the shards. The Trainer saves no optimizer state of a model that shards itself."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from transformers import Trainer

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)

    class FSDPCheckpoints(Trainer):
        def _save(self, output_dir=None, state_dict=None):
            state = distributed.full_state_dict(self.model)  # every rank gathers; rank 0 writes
            if self.args.should_save:
                super()._save(output_dir, state_dict=state)

        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            out = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            weights = {n: distributed.full(p).cpu() for n, p in self.model.named_parameters() if p.requires_grad}
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=whole)
            if self.args.should_save:
                torch.save(
                    {"model": weights, "optimizer": optim, "scheduler": self.lr_scheduler.state_dict()},
                    out / "fsdp_state.pt",
                )
            self._save_rng_state(str(out))

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            self._fsdp_state = torch.load(Path(resume_from_checkpoint) / "fsdp_state.pt", weights_only=True)
            set_model_state_dict(
                self.model, self._fsdp_state["model"], options=StateDictOptions(full_state_dict=True, strict=False)
            )

        def _load_optimizer_and_scheduler(self, checkpoint):
            if checkpoint is not None:
                set_optimizer_state_dict(
                    self.model,
                    self.optimizer,
                    self._fsdp_state["optimizer"],
                    options=StateDictOptions(full_state_dict=True),
                )
                self.lr_scheduler.load_state_dict(self._fsdp_state["scheduler"])

    return FSDPCheckpoints


def replacement_sampler(trainer):
    """--sampling replacement: every training example drawn independently (a Trainer draws shuffled epochs)."""
    args = trainer.args
    n = (
        args.max_steps * args.train_batch_size * args.gradient_accumulation_steps * args.world_size
        if args.max_steps > 0
        else int(args.num_train_epochs * len(trainer.train_dataset))
    )
    return torch.utils.data.RandomSampler(
        trainer.train_dataset, replacement=True, num_samples=n, generator=torch.Generator().manual_seed(args.seed)
    )
