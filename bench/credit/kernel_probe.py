"""Which op makes credit_k4's bytes differ between two CPUs (issue 77, item 2): every kind of op the study's model runs,
at its shapes, on fixed inputs, under the study's pin (credit_k4.pin_kernels), each as a checksum. The pin gives one
machine's kernel paths the same bytes, but an Intel Xeon and an AMD EPYC other ones; run this on each and diff.

    python bench/credit/kernel_probe.py                     # this CPU's checksums: bench/credit/kernel_probe/<cpu>.json
    python bench/credit/kernel_probe.py --diff A.json B.json  # the ops whose bytes differ between two CPUs

Each op's inputs come from one seeded generator, so an op's checksum moves only with its kernel (and its inputs'
generator, `randn`). `model_grad` is a forward and backward of the committed start seed 0's base (the study's model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # its own study: bench/credit
from credit_k4 import PINNED, machine, pin_kernels  # noqa: E402

BASE = HERE / "k4_store" / "s0" / "base"  # start A's base model, committed with its checksum


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(seed: int = 0) -> dict:
    """{op: the first 16 hex digits of its output's sha256}, each op on inputs drawn from one generator seeded with seed; the shapes are the
    study's model's (hidden 128, MLP 512, 4 heads of 32, vocabulary 637, 4 x 128 tokens)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 128, generator=g)  # (tokens, hidden)
    w = torch.randn(512, 128, generator=g) * 0.05  # (MLP, hidden)
    logits = torch.randn(512, 637, generator=g) * 3  # (tokens, vocabulary)
    q, k, v = (torch.randn(4, 4, 128, 32, generator=g) for _ in range(3))  # (B, heads, T, head_dim)
    labels = torch.randint(0, 637, (512,), generator=g)
    ops = {
        "randn": lambda: x,
        "matmul": lambda: x @ w.T,  # MKL's SGEMM (N, N)
        "matmul_t": lambda: w.T @ (x @ w.T).T,  # the backward's (T, N)
        "bmm": lambda: q @ k.transpose(-1, -2),
        "exp": lambda: torch.exp(logits),
        "log": lambda: torch.log(logits.abs() + 1e-3),
        "tanh": lambda: torch.tanh(logits),
        "silu": lambda: F.silu(x @ w.T),
        "rsqrt_mean": lambda: torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),  # RMSNorm's
        "cos_sin": lambda: torch.cat([torch.cos(logits), torch.sin(logits)]),  # RoPE's
        "softmax": lambda: torch.softmax(logits, -1),
        "log_softmax": lambda: torch.log_softmax(logits, -1),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "cross_entropy": lambda: F.cross_entropy(logits, labels),
        "sum": lambda: logits.sum(-1),
    }
    got = {name: digest(op()) for name, op in ops.items()}
    lin = torch.nn.Linear(128, 512)
    with torch.no_grad():
        lin.weight.copy_(w), lin.bias.zero_()
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    F.cross_entropy(lin(x), labels % 512).backward()
    opt.step()
    got["linear_backward_adamw"] = digest(lin.weight, lin.bias)
    if (BASE / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
        ids = torch.randint(0, model.config.vocab_size, (4, 128), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        got["model_grad"] = digest(*(p.grad for p in model.parameters()))
    return got


def mkl_branch() -> str:
    """MKL's own line for one SGEMM under the pin (its build, the branch it runs, its thread count)."""
    code = "import torch; torch.set_num_threads(1); torch.ones(64, 64) @ torch.ones(64, 64)"
    env = {**os.environ, **PINNED, "MKL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    lines = [line for line in out.splitlines() if line.startswith("MKL_VERBOSE")]
    head = next((line for line in lines if "oneMKL" in line or "Intel(R) MKL" in line), "")
    cnr = next((m.group(0) for line in lines for m in [re.search(r"CNR:\S+.*NThr:\d+", line)] if m), "")
    return f"{head.removeprefix('MKL_VERBOSE ')} | {cnr}".strip(" |")


def diff(a: dict, b: dict) -> list[str]:
    """The ops whose checksums differ (or that only one file has), in a's order."""
    return [op for op in {**a["ops"], **b["ops"]} if a["ops"].get(op) != b["ops"].get(op)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--diff", nargs=2, type=Path, metavar=("A", "B"), help="two machines' files: the ops that differ")
    p.add_argument("--out", type=Path, default=HERE / "kernel_probe", help="where this CPU's file goes")
    args = p.parse_args(argv)
    if args.diff:
        a, b = (json.loads(f.read_text()) for f in args.diff)
        ops = diff(a, b)
        print(f"{a['machine']['cpu']} against {b['machine']['cpu']}: {len(ops)} of {len(a['ops'])} ops differ")
        return print("\n".join(f"  {op}: {a['ops'].get(op)} / {b['ops'].get(op)}" for op in ops))
    pin_kernels()
    result = {"machine": machine(), "mkl": mkl_branch(), "ops": fingerprint()}  # machine(): the pin too
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["machine"]["cpu"]).strip("_").lower()
    path = args.out / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(result, indent=1) + "\n")
    os.replace(path.with_suffix(".tmp"), path)
    print(json.dumps(result["ops"], indent=1), f"\n{result['mkl']}\nwritten to {path}")


if __name__ == "__main__":
    main()
