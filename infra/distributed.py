"""torchrun and --dtype: the process group (dist_init), the collectives stage 3 needs (gather_rows, all_sum, barrier),
bf16 / fp16 compute (autocast, grad_scaler). `torchrun --nproc_per_node N 03_train_policy.py` and --dtype send a reader
here: with one process every collective is the identity, so the single-process code path is the same.
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from infra import models


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
    """Sum of a tensor over ranks (in place)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier(timeout_h: float | None = None) -> None:
    """Wait for every rank. timeout_h: a long wait (rank 0 training the SFT warm start alone), on a gloo group of its
    own, since nccl's collectives give up after 10 minutes."""
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=timeout_h)) if timeout_h else None
        dist.barrier(group=group)
        if group is not None:
            dist.destroy_process_group(group)
