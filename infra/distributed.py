"""torchrun, --shard and --dtype: the process group (dist_init), the collectives stage 3 needs (gather_rows, all_sum,
barrier), bf16 / fp16 compute (autocast, grad_scaler), and FSDP2 sharding (shard). `torchrun --nproc_per_node N
03_train_policy.py` and --dtype send a reader here: with one process every collective is the identity, so the
single-process code path is the same.

--shard ddp (the default) keeps a whole copy of the model on every rank and sums the ranks' gradients (all_sum), as
PyTorch's DistributedDataParallel does; --shard fsdp shards every parameter, gradient and Adam state over the ranks
with PyTorch's own FSDP2 (torch.distributed.fsdp.fully_shard): each decoder layer one group, then the root (the
embeddings, the final norm and the output head: one group, so tied embeddings stay one weight, kept gathered after
the forward, whose output the loss needs at once). The reduce-scatter sums, as all_sum does (03 scales each rank's
loss by its share of the global batch's tokens). With LoRA the frozen base is sharded too; with full fine-tuning the
frozen reference copy is. --dtype bf16 / fp16: a MixedPrecisionPolicy computes in it and reduces in float32.
A rollout gathers the policy whole once (gathered) and decodes as one process does: faster than FSDP's per-layer
gather on every decode step (bench/speed/README.md, FSDP), costing of one whole copy of the weights during the rollout;
--fsdp-generate layers gathers one layer at a time instead, for a policy whose weights one GPU cannot hold (70B).
Checkpoints gather full state dicts (runs.save_checkpoint: the same file a single process writes, one per run), and
the saved policy is a plain adapter or model folder that one process loads.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

import common
from infra import models


def add_args(p, rollouts: bool = True) -> None:
    g = p.add_argument_group("torchrun (infra/distributed.py)")
    g.add_argument(
        "--shard",
        default="ddp",
        choices=["ddp", "fsdp"],
        help="ddp: a whole model per rank; fsdp: parameters, gradients and optimizer states sharded (FSDP2)",
    )
    if rollouts:
        g.add_argument(
            "--fsdp-generate",
            default="whole",
            choices=["whole", "layers"],
            help="--shard fsdp rollouts: "
            "gather the policy once, or each layer at every decode step (past one GPU's memory)",
        )


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators seeded alike."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def autocast(device: str, dtype: str):
    """bf16/fp16 compute over float32 master weights for full fine-tuning (a bf16 weight does not move by a 1e-6
    step); for LoRA the frozen base is stored in `dtype` and autocast only matches the adapter's float32 to it."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=models.torch_dtype(dtype))


def grad_scaler(device: str, dtype: str):
    """Loss scaling for fp16 (its gradients underflow without it); a no-op otherwise."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "fp16")


def dist_init(device: str) -> tuple[int, int, str]:
    """(rank, world size, this rank's device). Under torchrun (even with one process, so its collectives run) it starts
    the process group: gloo on CPU; on GPU nccl for CUDA tensors and gloo for CPU ones, each rank on GPU LOCAL_RANK."""
    if "WORLD_SIZE" in os.environ and device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size(), device) if dist.is_initialized() else (0, 1, device)


def gather_rows(x):
    """The (B, ...) tensors of every rank stacked along B, (B, T) ones padded with zeros to the longest T."""
    if not dist.is_initialized():
        return x
    if x.dim() == 2:
        width = torch.tensor([x.shape[1]], device=x.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        x = torch.nn.functional.pad(x, (0, int(width) - x.shape[1]))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_sum(x):
    """Sum of a tensor over ranks (in place). An FSDP-sharded one (a DTensor: this rank's shard) is left as it is: its
    reduction is FSDP's own (ppo_update's gradient sum passes every gradient here)."""
    if dist.is_initialized() and not hasattr(x, "to_local"):
        dist.all_reduce(x)
    return x


def clip_grad_norm(params, max_norm: float, all_sum=all_sum):
    """torch.nn.utils.clip_grad_norm_, also over FSDP's sharded gradients (a DTensor shard per rank, their squares
    summed over ranks by all_sum) beside whole ones (the value head): 03 passes it to ppo_update under --shard fsdp."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(hasattr(g, "to_local") for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    shards = torch.stack([x.float().pow(2).sum() for g, x in zip(grads, local) if x is not g]).sum()
    total = (all_sum(shards) + sum(g.float().pow(2).sum() for g, x in zip(grads, local) if x is g)).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for x in local:
        x.mul_(coef)
    return total


def barrier(timeout_h: float | None = None) -> None:
    """Wait for every rank. timeout_h: a long wait (rank 0 training the SFT warm start alone), on a gloo group of its
    own, since nccl's collectives give up after 10 minutes."""
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=timeout_h)) if timeout_h else None
        dist.barrier(group=group)
        if group is not None:
            dist.destroy_process_group(group)


# ----------------------------------------------------------------------------------------------------------------------
# --shard fsdp: FSDP2 over the decoder layers, then the root
# ----------------------------------------------------------------------------------------------------------------------


def decoder_layers(model) -> list:
    """The model's repeated blocks: the longest ModuleList whose modules are all of one class (Llama's, Qwen's,
    Mistral's model.layers), sharded or not, or []."""
    lists = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({unsharded_class(x) for x in m}) == 1
    ]
    return list(max(lists, key=len)) if lists else []


def unsharded_class(module) -> type:
    """The module's class before fully_shard, which swaps it for FSDP<Class>(FSDPModule, Class): a list of layers
    sharded only in part is still one list of one class (issue 80: a probe found none, and said [])."""
    cls = type(module)
    base = cls.__bases__[-1]
    return base if cls.__name__ == f"FSDP{base.__name__}" else cls


def shard(model, ref_model, args):
    """(model, ref_model) for 03: as they are (--shard ddp, or one process), or fully_shard-ed (--shard fsdp, the
    module docstring): the policy, and the frozen reference copy of full fine-tuning. DataError, one line, where it
    cannot shard: not under torchrun, fp16 (its loss scaler does not unscale sharded gradients), or no repeated
    layers."""
    if args.shard != "fsdp":
        return model, ref_model
    if args.fsdp_generate == "layers" and args.compile_generation:
        raise common.DataError(
            "--fsdp-generate layers with --compile-generation: the compiled decoder needs the "
            "policy whole (--fsdp-generate whole)"
        )
    if not dist.is_initialized():
        raise common.DataError(
            "--shard fsdp shards over torchrun's processes: torchrun --nproc_per_node N "
            "03_train_policy.py --shard fsdp ... (N = 1 runs it on one GPU)"
        )
    if args.dtype == "fp16":
        raise common.DataError(
            "--shard fsdp with --dtype fp16: use bf16 (fp16's loss scaling does not reach sharded gradients)"
        )
    for m in [model] + [ref_model] * (ref_model is not None):
        fully_shard_model(m, args.dtype)
    return model, ref_model


def fully_shard_model(model, dtype: str = "float32", summed: bool = True):
    """fully_shard every decoder layer, then the root (kept gathered after its forward); summed reductions (03), or
    averaged as DDP's (summed=False: 02's Trainer)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    layers = decoder_layers(model)
    if not layers:
        raise common.DataError(f"--shard fsdp: {type(model).__name__} has no repeated layers to shard one by one")
    mp = (
        MixedPrecisionPolicy(param_dtype=models.torch_dtype(dtype), reduce_dtype=torch.float32)
        if dtype != "float32"
        else MixedPrecisionPolicy()
    )
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    if hasattr(model, "generate"):  # generate() enters through the root as forward() does (FSDP's lazy init, gather)
        register_fsdp_forward_method(model, "generate")
    for m in model.modules() if summed else ():
        if isinstance(m, FSDPModule):  # a sum, as all_sum's: 03's loss is already each rank's share of the mean
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # (gloo has no pre-multiplied sum; torch >= 2.9)
                m.set_force_sum_reduction_for_comms(True)
    return model


def shard_for_trainer(model, args):
    """02 --shard fsdp: the model sharded as 03's (fully_shard_model; the ranks' gradients averaged, as DDP's), marked
    as a model that shards itself, so that the Trainer neither wraps it in DDP nor reduces its gradients again
    (transformers' flag for a model sharded at load time). Accelerate's own FSDP (TrainingArguments(fsdp=...)) runs
    on GPUs only: on a CPU it falls back to DDP without a word, so it could not be tested here."""
    if args.shard != "fsdp":
        return model
    if "WORLD_SIZE" not in os.environ:
        raise common.DataError(
            "--shard fsdp shards over torchrun's processes: torchrun --nproc_per_node N "
            "02_train_reward.py --shard fsdp ... (N = 1 runs it on one GPU)"
        )
    dist_init(args.device)
    fully_shard_model(model, "bf16" if args.bf16 else "float32", summed=False)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    base._is_distributed_loading_by_transformers = True  # read by Trainer: no DDP wrap, no second reduction
    return model


def full_state_dict(model):
    """A sharded model's state dict gathered whole (every rank must call it), its adapter's alone under LoRA; None
    for a model that is not sharded (save_pretrained then reads its own). Saving a sharded
    model's own state dict would keep only this rank's slice (accelerate #4206)."""
    if not any(is_sharded(p) for p in model.parameters()):
        return None
    peft, first, whole = hasattr(model, "peft_config"), {}, {}
    tied = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    for n, x in model.state_dict().items():
        if not peft or "lora_" in n or "modules_to_save" in n:  # tied weights (one parameter, two names) stay one
            whole[n] = whole[tied[n]] if tied.get(n, n) in whole else full(x).cpu()  # tensor: saved once
    return whole


def is_sharded(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def full(x):
    """A tensor whole: a sharded one gathered from every rank (every rank must call it, in the same order)."""
    return x.detach().full_tensor() if is_sharded(x) else x.detach()


def shard_like(value, like):
    """`value`, a whole tensor, sharded as the sharded tensor `like` is (or as it is, where `like` is not sharded)."""
    if not is_sharded(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.detach().to(like.device_mesh.device_type), like.device_mesh, like.placements)


@contextlib.contextmanager
def gathered(model, whole: bool = True):
    """A sharded model gathered whole for the block (a rollout: generate() then runs as in one process), resharded
    after; anything else, or whole=False (--fsdp-generate layers: FSDP gathers each layer as it runs), as it is."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule) and whole]
    for m in groups:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)  # else each layer's forward shards it again
    try:
        yield
    finally:
        for m in groups:
            m.set_reshard_after_forward(m is not model, recurse=False)  # as fully_shard_model set them
            m.reshard()
