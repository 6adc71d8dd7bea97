"""--lora-r, --lora-alpha, --lora-targets, --ref-adapter, --gradient-checkpointing, --compile-update,
--forward-batch-size: a model loaded by infra/models.py made ready to train. A trainable LoRA adapter (add_lora:
stages 2 and 3, the SFT warm start, the baselines); stage 3's policy (build_policy: LoRA or full fine-tuning, the
reference adapter of load_ref_adapter, the value head) and its optimizer (make_optimizer); stage 3's forwards:
compiled (compile_update) and, with no grad, in chunks of as many rows as memory allows (forward_rows, scoring_rows).
"""

from __future__ import annotations

import copy

import torch

from infra import decoding, distributed, models
from infra.models import peft_wraps_quietly


def add_args(p) -> None:
    """03's flags of the policy's parameters (build_policy) and of its no-grad forwards (scoring_rows)."""
    g = p.add_argument_group("the policy's parameters (infra/trainable.py)")
    g.add_argument("--lora-r", type=int, help="LoRA rank; 0 = full fine-tuning (then the reference is a frozen copy)")
    g.add_argument("--lora-alpha", type=int, help="LoRA alpha")
    g.add_argument("--lora-targets", default="all-linear", help="comma-separated module names, or all-linear")
    g.add_argument("--ref-adapter", help="a LoRA adapter the policy starts from; it is also the reference policy")
    g.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for memory")
    g.add_argument(
        "--forward-batch-size", type=int, help="rows per no-grad forward (default: what 256 MB of logits allow)"
    )


def load_ref_adapter(model, path: str):
    """03 --ref-adapter: the model with the adapter at `path` loaded twice: "ref" (frozen, pi_ref) and "default"
    (trainable, the policy), the policy's active. 03's reference_forward switches to "ref" for pi_ref."""
    from peft import PeftModel

    with peft_wraps_quietly():
        model = PeftModel.from_pretrained(model, path, adapter_name="ref")
    model.load_adapter(path, adapter_name="default", is_trainable=True)
    model.set_adapter("default")
    return model


def add_lora(
    model,
    r: int,
    alpha: int,
    targets: str = "all-linear",
    dropout: float = 0.0,
    modules_to_save: str = "",
    task_type: str = "CAUSAL_LM",
):
    """The model with a trainable LoRA adapter (peft): `targets` is "all-linear" or comma-separated module names,
    `modules_to_save` comma-separated modules trained in full and saved with the adapter. task_type "SEQ_CLS" (a
    scalar reward model): peft trains and saves the score head in full too."""
    from peft import LoraConfig, get_peft_model

    with peft_wraps_quietly():
        return get_peft_model(
            model,
            LoraConfig(
                r=r,
                lora_alpha=alpha,
                lora_dropout=dropout,
                task_type=task_type,
                target_modules=targets if targets == "all-linear" else targets.split(","),
                modules_to_save=[m for m in modules_to_save.split(",") if m] or None,
            ),
        )


def frozen_copy(model, dtype: str):
    """pi_ref for full fine-tuning (03, DPO): a copy of the model in eval mode, its weights frozen and in `dtype` (a
    reference needs no float32 master weights)."""
    return copy.deepcopy(model).to(models.torch_dtype(dtype)).eval().requires_grad_(False)


def build_policy(args, model):
    """Wrap the (SFT) model for PPO: LoRA (reference = adapter off) or full fine-tuning (reference = frozen copy)."""
    ref_model = None
    if args.ref_adapter:  # the policy starts as the adapter, which is also pi_ref (its copy named "ref", frozen)
        model = load_ref_adapter(model, args.ref_adapter)
    elif args.lora_r > 0:
        model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_targets)
    else:  # full fine-tuning: pi_ref is a frozen copy
        ref_model = frozen_copy(model, args.dtype)
    if args.gradient_checkpointing:
        # (it also makes the embeddings' output require grad, by a hook: calling that again would add a second one)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    value_head = torch.nn.Linear(model.get_input_embeddings().weight.shape[1], 1, device=args.device)
    torch.nn.init.zeros_(value_head.weight)  # zero-init: V = 0 at the start, so early advantages are the returns
    torch.nn.init.zeros_(value_head.bias)
    return model, ref_model, value_head


def make_optimizer(params, args):
    """AdamW over the trainable parameters, and its learning rate per iteration: a linear warmup over --warmup-steps,
    then constant, or linearly annealed to 0 (--anneal-lr). scheduler.get_last_lr() is the next update's."""
    # FSDP's sharded weights and the whole value head in separate groups: foreach/fused AdamW (CUDA's) cannot mix them
    groups = [
        {"params": g}
        for g in (
            [p for p in params if distributed.is_sharded(p)],
            [p for p in params if not distributed.is_sharded(p)],
        )
        if g
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-5, fused=args.compile_update or None)  # one kernel
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda it: min(1.0, (it + 1) / max(args.warmup_steps, 1)) * (1.0 - it / args.steps if args.anneal_lr else 1.0),
    )
    return optimizer, scheduler


def compile_update(model, ref_model, args):
    """--compile-update: (model, ref_model) as forward() should call them in steps 4 and 6, under torch.compile
    (inductor; the same modules and weights, so the rollout, the save and everything else still see the eager ones).
    torch decides per shape: static first, dynamic in the dims that change (the response width, the rows)."""
    import torch

    if not args.compile_update:
        return model, ref_model
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # train/eval, adapter on/off
    from torch._inductor import config as inductor_config

    inductor_config.fallback_random = True  # a dropout draws from torch's generator, as eager: same random stream
    decoding.inductor_cache_per_kernel_path()
    return torch.compile(model), ref_model if ref_model is None else torch.compile(ref_model)


def forward_rows(batch: int, micro: int, n_resp: int, vocab: int, n_logits: int = 1, budget: int = 2**26) -> int:
    """Rows per no-grad forward of step 4: the whole batch in one call when its logits (n_logits tensors of rows x
    (n_resp + 1) x vocab floats) fit in `budget` elements (256 MB of fp32), else as many as fit, at least the training
    micro-batch. A row's log-probs do not depend on its batch-mates (a kernel picked by shape may round by ~1e-7)."""
    return max(micro, min(batch, budget // (n_logits * (n_resp + 1) * vocab)))


def scoring_rows(mask, micro: int, model, args) -> int:
    """Rows per no-grad forward of a batch of response mask (B, T) (steps 4 and the trace): --forward-batch-size,
    else forward_rows for its shape (two logits tensors with --kl-estimator full)."""
    (B, T) = mask.shape
    return args.forward_batch_size or forward_rows(
        B, micro, T, model.config.vocab_size, 2 if args.kl_estimator == "full" else 1
    )
