"""Seconds per PPO iteration at 2 ranks on this CPU: --shard ddp, --shard fsdp, and --shard fsdp --fsdp-generate
layers, as ratios measured in one run (issue 57).

    python bench/speed/fsdp.py --base runs/demo/sft    # ~5 min on 2 CPU cores

Each configuration is `torchrun --nproc_per_node 2 03_train_policy.py` (gloo, one thread per rank) on the demo's
shapes (--base: the demo's SFT model, runs/demo/sft after the zero-flag demo, else a demo base built here; the demo's
LoRA r 16 policy, batch 32, 24 new tokens forced by --min-new-tokens so every configuration does the same work) with
the exact program critic, so the critic's cost is not in it. The rounds alternate the order
of the configurations, so drift in the machine's load hits each; the first iteration of each run (warm-up) is dropped.
Prints one JSON line last: the median seconds per iteration of each part, and the ratios to ddp.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra.tiny_model import build_demo_base  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

CONFIGS = {
    "ddp": ["--shard", "ddp"],
    "fsdp": ["--shard", "fsdp"],
    "fsdp_layers": ["--shard", "fsdp", "--fsdp-generate", "layers"],
}
PARTS = ("time/step_s", "time/generate_s", "time/forward_s", "time/update_s")


def run(out: Path, base: str, name: str, steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
        str(ROOT / "03_train_policy.py"),
        "--model",
        base,
        "--prompts",
        str(out / "prompts.jsonl"),
        "--critic",
        "program",
        "--steps",
        str(steps),
        "--sft-steps",
        "0",
        "--scalar-baseline-dir",
        "",
        "--max-new-tokens",
        "24",
        "--min-new-tokens",
        "24",
        "--save-every",
        "1000",
        "--trace-samples",
        "0",
        "--device",
        "cpu",
        "--output-dir",
        str(out / name),
        "--overwrite",
        *CONFIGS[name],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return common.read_jsonl(out / name / "metrics.jsonl")[1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="runs per configuration, in alternating order")
    p.add_argument("--steps", type=int, default=6, help="PPO iterations per run")
    p.add_argument("--out", default="bench/out/fsdp", help="work dir")
    p.add_argument("--base", default="bench/out/span_vs_scalar/base", help="the demo base model (built if missing)")
    args = p.parse_args()
    out = Path(args.out)
    if not (Path(args.base) / "config.json").is_file():
        build_demo_base(args.base)
    common.write_jsonl(out / "prompts.jsonl", demo_dataset("train", 256))
    rows = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name in list(CONFIGS)[:: 1 if r % 2 == 0 else -1]:
            rows[name] += run(out, args.base, name, args.steps)
            print(f"round {r}: {name} {statistics.median(x['time/step_s'] for x in rows[name]):.2f} s/iteration")
    med = {name: {k.split("/")[1]: statistics.median(x[k] for x in rs) for k in PARTS} for name, rs in rows.items()}
    for name, m in med.items():
        print(f"{name:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
    print(
        json.dumps(
            {
                "median_s": med,
                "iterations": len(rows["ddp"]),
                "batch_size": 32,
                "new_tokens": 24,
                "ratio_to_ddp": {name: {k: m[k] / med["ddp"][k] for k in m} for name, m in med.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
