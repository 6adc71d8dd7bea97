"""Seconds per PPO iteration, span vs scalar rewards, same critic, measured in one process.

    python bench/speed/step_overhead.py            # ~2 min on 2 CPU cores

Both modes run the same code path except where the critic's delta is placed (compute_rewards), so the ratio should be
~1.0 (the paper reports +9-11% per step for its implementation). Responses are forced to a fixed length
(--min-new-tokens = --max-new-tokens) so both modes do identical work; the rounds alternate span/scalar so drift in
machine load hits both. The first iteration of each run (warm-up) is dropped. Prints one JSON line last.
"""

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra.tiny_model import build_demo_base  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

ppo = importlib.import_module("03_train_policy")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating span/scalar runs per mode")
    p.add_argument("--steps", type=int, default=8, help="PPO iterations per run")
    p.add_argument("--out", default="bench/out/step_overhead", help="work dir")
    p.add_argument("--base", default="bench/out/span_vs_scalar/base", help="the demo base model (built if missing)")
    args = p.parse_args()
    out = Path(args.out)
    if not (Path(args.base) / "config.json").is_file():
        build_demo_base(args.base)
    common.write_jsonl(out / "prompts.jsonl", demo_dataset("train", 256))
    times = {"span": [], "scalar": []}
    for r in range(args.rounds):
        for mode in ("span", "scalar") if r % 2 == 0 else ("scalar", "span"):
            run_args = ppo.parse_args(
                [
                    "--model",
                    args.base,
                    "--prompts",
                    str(out / "prompts.jsonl"),
                    "--critic",
                    "program",
                    "--reward-mode",
                    mode,
                    "--steps",
                    str(args.steps),
                    "--sft-steps",
                    "0",
                    "--scalar-baseline-dir",
                    "",
                    "--max-new-tokens",
                    "24",
                    "--min-new-tokens",
                    "24",
                    "--output-dir",
                    str(out / f"{mode}{r}"),
                    "--save-every",
                    "1000",
                    "--device",
                    "cpu",
                    "--overwrite",
                ]
            )
            ppo.train(run_args)
            rows = common.read_jsonl(out / f"{mode}{r}" / "metrics.jsonl")
            times[mode] += [row["time/step_s"] for row in rows[1:]]
    span_s, scalar_s = statistics.median(times["span"]), statistics.median(times["scalar"])
    print(f"span {span_s:.3f} s/iteration, scalar {scalar_s:.3f} s/iteration over {len(times['span'])} iterations each")
    print(
        json.dumps(
            {
                "span_s": span_s,
                "scalar_s": scalar_s,
                "ratio": span_s / scalar_s,
                "iterations": len(times["span"]),
                "batch_size": 32,
                "new_tokens": 24,
            }
        )
    )


if __name__ == "__main__":
    main()
