"""Rollout speed: eager generate() against static-cache compiled decoding (03 --compile-generation), as ratios.

    python bench/speed/rollout_speed.py                              # all (~20 min on a free core, ~45 on a busy one)
    python bench/speed/rollout_speed.py --sections decode critic     # a part

Sections, each measured interleaved (the two sides alternate rep by rep, or iteration by iteration, so both see the
same machine load; read the ratios, the seconds move with the load):
  decode  seconds per decoding step, at the demo's shape (the demo base, 32 rows, its ~33-token prompts) and at
          SmolLM2-135M-Instruct's (16 rows, chat-templated demo prompts): model.generate (what 03 ran before, and
          runs with --no-compile-generation), infra.decoding.generate_static eager (the static cache alone) and compiled.
          A step is the slope between N1 and N2 forced new tokens (min = max new tokens): prefill and setup cancel.
          The tokens of the three must be identical (checked, same seed). compile_s: the first call of the compiled
          path, less a warm one (the inductor caches are off in this process, so it is the cold price, paid once per
          shape). On a CPU, for SmolLM2 at 1 thread: its decoding step / its arithmetic, the time of the matrix
          multiplies and the attention kernels inside one step by the profiler (the issue's goal: <= 1.5). On a GPU:
          the step / the HBM bound, the time to read the weights once at the bandwidth a device copy reaches.
  critic  the demo reward model's greedy critiques of 32 SFT-data responses per batch: greedy_generate as it was
          (eager, a finished row leaves the batch and its KV cache) against compile=True (static cache, compiled
          step, finished rows kept and masked). Same critiques checked.
  ppo     seconds per PPO iteration (03's time/step_s) of 03 eager, 03 --compile-generation and 03 with
          --compile-generation --compile-update ("all": the scoring forwards and the update compiled too, AdamW
          fused), each in its own worker process, one iteration each in turn, and each phase's (time/*_s); at
          bench/speed/vs_trl.py's workload also TRL 0.11.4's PPOTrainer with its
          generate handed the whole batch (vs_trl's worker and environment). Workloads: vs_trl (the demo base, full
          fine-tuning, 16 rows, 16-token prompts, 32 forced new tokens, 1 epoch of 4 minibatches), demo (the demo
          preset: 32 rows, up to 32 new tokens, LoRA r=16, 2 epochs of 2 minibatches) and smollm2 (SmolLM2 with
          the demo preset's settings at 16 rows); all with the demo's exact program critic. The first --warmup
          iterations are dropped (compiled: the compile); compile_s = its first iteration less its median.
          metrics_identical: eager vs --compile-generation (must be all); all_metrics_max_rel_diff: eager vs all
          (--compile-update rounds otherwise: small, unless a rounding flips a sampled token and the runs part).
Prints one JSON object last.
"""

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/speed
import common  # noqa: E402
from critics import learned  # noqa: E402
from infra import decoding, models, reward_models, runs  # noqa: E402

OUT = ROOT / "bench" / "out" / "rollout_speed"
HOW = ("generate", "static_eager", "static_compiled")


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct converted by tools/smollm2.py (the tests' cache), converted here if missing."""
    spec = importlib.util.spec_from_file_location("smollm2", ROOT / "tools" / "smollm2.py")
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    cache = Path(os.environ.get("T2G_CACHE") or Path.home() / ".cache" / "text2grad")
    return smollm2.export(cache / "smollm2-135m-instruct")


def demo_base() -> str:
    """The demo base model of bench/speed/vs_trl.py and bench/span_vs_scalar/span_vs_scalar.py (built once, ~1 min)."""
    from infra.tiny_model import build_demo_base

    base = ROOT / "bench" / "out" / "span_vs_scalar" / "base"
    if not (base / "config.json").is_file():
        build_demo_base(base)
    return str(base)


# ----------------------------------------------------------------------------------------------------------------------
# decode: seconds per decoding step
# ----------------------------------------------------------------------------------------------------------------------


def new_tokens(model, ids, mask, n, how, seed=0):
    """n forced new tokens (min = max = n, temperature 1, no top-k) by `how`; (ids (B, n), seconds)."""
    import torch

    config = models.generation_config(model, n, 1.0, 1.0, min_new_tokens=n)
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.no_grad():
        if how == "generate":
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
        else:
            out = decoding.generate_static(model, ids, mask, config, compile=how == "static_compiled")
    return out, time.perf_counter() - t


ARITHMETIC = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
)


def arithmetic_step(model, ids, mask, n1, n2) -> float:
    """Seconds of arithmetic in one compiled decoding step: the self time of the matrix-multiply and attention
    kernels (torch.profiler) of a warm call with n2 forced new tokens, less that of one with n1, over n2 - n1."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(n):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            new_tokens(model, ids, mask, n, "static_compiled")
        return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ARITHMETIC) * 1e-6

    return (kernels(n2) - kernels(n1)) / (n2 - n1)


def hbm_bound(model) -> float:
    """Seconds to read the weights once at the bandwidth a 1 GiB device-to-device copy reaches (read + write)."""
    import torch

    x = torch.empty(2**28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 2 * x.numel() * 4 * 10 / (time.perf_counter() - t)  # bytes / s
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights / bandwidth


def decode_section(name, model, ids, mask, n1, n2, reps, profile_arith):
    """One shape's row of the decode section."""
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True  # the cold compile, as a first run on a fresh machine pays it
    _, first = new_tokens(model, ids, mask, n2, "static_compiled")
    _, warm = new_tokens(model, ids, mask, n2, "static_compiled")
    ref = new_tokens(model, ids, mask, n2, "generate")[0]
    same = all(torch.equal(new_tokens(model, ids, mask, n2, how)[0], ref) for how in HOW[1:])
    new_tokens(model, ids, mask, n1, "static_compiled")  # n1's cache is shorter: its own graph, compiled here
    times = {how: [] for how in HOW}
    for _ in range(reps):
        for how in HOW:
            t1 = new_tokens(model, ids, mask, n1, how)[1]
            t2 = new_tokens(model, ids, mask, n2, how)[1]
            times[how].append((t2 - t1) / (n2 - n1))
    step = {how: statistics.median(v) for how, v in times.items()}
    row = {
        "shape": name,
        "rows": ids.shape[0],
        "prompt_tokens": ids.shape[1],
        "new_tokens": [n1, n2],
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_identical": bool(same),
        **{f"{how}_step_s": round(v, 6) for how, v in step.items()},
        "ratio_compiled_vs_generate": round(step["static_compiled"] / step["generate"], 3),
        "ratio_static_eager_vs_generate": round(step["static_eager"] / step["generate"], 3),
        "compile_s": round(first - warm, 2),
    }
    if profile_arith and ids.device.type == "cpu":
        arith = arithmetic_step(model, ids, mask, n1, n2)
        row.update(
            arithmetic_step_s=round(arith, 6),
            ratio_compiled_vs_arithmetic=round(step["static_compiled"] / arith, 3),
            ratio_generate_vs_arithmetic=round(step["generate"] / arith, 3),
        )
    if ids.device.type == "cuda":
        bound = hbm_bound(model)
        row.update(
            hbm_bound_s=round(bound, 6),
            ratio_compiled_vs_hbm_bound=round(step["static_compiled"] / bound, 3),
            ratio_generate_vs_hbm_bound=round(step["generate"] / bound, 3),
        )
    print(json.dumps(row), flush=True)
    return row


def demo_prompts(tok, n, chat: bool):
    from tasks.demo import demo_dataset

    return models.left_pad(
        [models.policy_prompt(tok, r["prompt"], "auto" if chat else "off") for r in demo_dataset("train", n)],
        tok.pad_token_id,
    )


def run_decode(args):
    import torch

    rows = []
    for name in args.shapes:
        path, n_rows = (demo_base(), 32) if name == "demo" else (smollm2_dir(), 16)
        model, tok = models.load_model(
            path, device=args.device, dtype="bf16" if args.device.startswith("cuda") else "float32"
        )
        ids, mask = (x.to(args.device) for x in demo_prompts(tok, n_rows, chat=name == "smollm2"))
        rows.append(
            decode_section(name, model, ids, mask, 8, 32 if name == "demo" else 24, args.reps, profile_arith=True)
        )
        del model
        torch._dynamo.reset()
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# critic: greedy critiques, eager (rows leave the batch) against compiled (static batch, rows masked)
# ----------------------------------------------------------------------------------------------------------------------


def run_critic(args):
    rm_dir = Path(args.reward_model)
    if not (rm_dir / "reward_model.json").is_file():
        print(f"critic: skipped, no reward model at {rm_dir} (python 01_annotate.py && python 02_train_reward.py)")
        return None
    rm, tok = models.load_model(str(rm_dir), device=args.device)
    settings = reward_models.rm_settings(str(rm_dir))
    records = common.read_jsonl(args.sft_data)
    batches = [records[i * 32 : (i + 1) * 32] for i in range(args.critic_batches + 1)]

    def critique(batch, compile):
        t = time.perf_counter()
        out = learned.rm_critique(
            rm,
            tok,
            [r["prompt"] for r in batch],
            [r["response"] for r in batch],
            settings["max_new_tokens"] or 96,
            max_prompt_tokens=settings["max_prompt_tokens"],
            rm_format=settings["rm_format"],
            compile=compile,
        )
        return out, time.perf_counter() - t

    critique(batches[0], False)
    # the warm-up batch pays the compile (cold after the decode section, which turned the inductor caches off)
    _, first = critique(batches[0], True)
    times, same = {False: [], True: []}, 0
    for batch in batches[1:]:
        eager, t_eager = critique(batch, False)
        compiled, t_compiled = critique(batch, True)
        times[False].append(t_eager)
        times[True].append(t_compiled)
        same += sum(a == b for a, b in zip(eager, compiled))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "batches": len(batches) - 1,
        "rows": 32,
        "eager_shrink_s": round(med[False], 4),
        "compiled_static_s": round(med[True], 4),
        "ratio_compiled_vs_eager": round(med[True] / med[False], 3),
        "critiques_identical": f"{same}/{32 * (len(batches) - 1)}",
        "first_compiled_batch_s": round(first, 2),
    }
    print(json.dumps(row), flush=True)
    return row


# ----------------------------------------------------------------------------------------------------------------------
# ppo: seconds per iteration, 03 eager / 03 compiled / TRL, one worker process each, one iteration each in turn
# ----------------------------------------------------------------------------------------------------------------------


def ppo_worker(argv: list[str]) -> None:
    """03's train() on argv; after each iteration (at its checkpoint hook) one JSON line with that iteration's
    metrics row, then it waits for the next "step" line on stdin."""
    import torch

    ppo = importlib.import_module("03_train_policy")
    run_args = ppo.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    metrics = Path(run_args.output_dir) / "metrics.jsonl"

    def hook(*a, **k):  # 03 calls save_checkpoint at the end of every iteration (--save-every 1), after time/step_s
        print(json.dumps(common.read_jsonl(metrics)[-1]), flush=True)
        if sys.stdin.readline().strip() != "step":
            sys.exit(0)

    runs.save_checkpoint = hook
    if sys.stdin.readline().strip() == "step":
        ppo.train(run_args)


def ppo_argv(workload: str, iterations: int, out: Path, seed: int) -> list[str]:
    """03's flags for a workload (see the module docstring), less --compile-generation; writes its prompts."""
    import vs_trl

    prompts = vs_trl.write_prompts(demo_base(), out)
    if workload == "vs_trl":
        return vs_trl.ours_argv(demo_base(), prompts, iterations, seed, out)
    model, rows = (demo_base(), 32) if workload == "demo" else (smollm2_dir(), 16)
    return [
        "--model",
        model,
        "--prompts",
        str(prompts),
        "--critic",
        "program",
        "--steps",
        str(iterations),
        "--sft-steps",
        "0",
        "--scalar-baseline-dir",
        "",
        "--batch-size",
        str(rows),
        "--seed",
        str(seed),
        "--device",
        "cpu",
        "--save-every",
        "1",
        "--log-every",
        "1000000",
        "--overwrite",
    ]  # throwaway timing runs


def start(cmd: list[str], log: Path, threads: int):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True
    )


def step(worker, name: str) -> dict:
    worker.stdin.write("step\n")
    worker.stdin.flush()
    reply = worker.stdout.readline()
    if not reply:
        sys.exit(f"the {name} worker died; see {OUT / (name + '.log')}")
    return json.loads(reply)


SIDES = {
    "eager": ["--no-compile-generation"],
    "compiled": ["--compile-generation"],
    "all": ["--compile-generation", "--compile-update"],
}  # all: the update's and the scoring forwards too
PHASES = ("generate", "critic", "forward", "update")  # 03's time/*_s of an iteration


def max_rel_diff(a: list[dict], b: list[dict]) -> float:
    """The largest relative difference between two runs' logged metrics (time/* aside), iteration by iteration, for
    values of magnitude >= 1e-3 (a policy loss of 1e-6, the mean of whitened advantages, has no relative digits)."""
    return max(
        (
            abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]))
            for x, y in zip(a, b)
            for k in x
            if not k.startswith("time/")
            and isinstance(x[k], float)
            and isinstance(y.get(k), float)
            and max(abs(x[k]), abs(y[k])) >= 1e-3
        ),
        default=0.0,
    )


def run_ppo(args):
    rows = []
    for workload in args.workloads:
        out = OUT / workload
        out.mkdir(parents=True, exist_ok=True)
        workers = {}
        iterations = args.smollm2_iterations if workload == "smollm2" else args.iterations
        argv = ppo_argv(workload, iterations, out, args.seed)
        for side, flags in SIDES.items():
            side_argv = argv + ["--output-dir", str(out / side), *flags]
            workers[side] = start(
                [sys.executable, __file__, "--ppo-worker", json.dumps(side_argv)],
                OUT / f"{workload}_{side}.log",
                args.threads,
            )
        if workload == "vs_trl":
            import vs_trl

            python = vs_trl.venv_python()
            workers["trl"] = start(
                [
                    str(python),
                    str(ROOT / "bench" / "speed" / "vs_trl.py"),
                    "--trl-worker",
                    "--base",
                    demo_base(),
                    "--out",
                    str(out),
                    "--threads",
                    str(args.threads),
                    "--seed",
                    str(args.seed),
                ],
                OUT / "trl.log",
                args.threads,
            )
            if not json.loads(workers["trl"].stdout.readline() or "{}").get("ready"):
                sys.exit(f"the TRL worker did not start; see {OUT / 'trl.log'}")
        seen = {side: [] for side in workers}
        try:
            for _ in range(iterations):
                for side, worker in workers.items():
                    seen[side].append(step(worker, f"{workload}_{side}"))
        finally:
            for worker in workers.values():
                worker.stdin.close()
                worker.wait(timeout=120)
        med = {
            side: statistics.median(r["step_s" if side == "trl" else "time/step_s"] for r in v[args.warmup :])
            for side, v in seen.items()
        }
        part = {
            (side, p): statistics.median(r[f"time/{p}_s"] for r in v[args.warmup :])
            for side, v in seen.items()
            if side != "trl"
            for p in PHASES
        }
        gen = {side: part[side, "generate"] for side in SIDES}
        same = [
            a["objective/span_reward"] == b["objective/span_reward"] and a["objective/kl"] == b["objective/kl"]
            for a, b in zip(seen["eager"], seen["compiled"])
        ]
        row = {
            "workload": workload,
            "iterations": iterations - args.warmup,
            "eager_step_s": round(med["eager"], 4),
            "compiled_step_s": round(med["compiled"], 4),
            "ratio_compiled_vs_eager": round(med["compiled"] / med["eager"], 3),
            "eager_generate_s": round(gen["eager"], 4),
            "compiled_generate_s": round(gen["compiled"], 4),
            "ratio_generate_compiled_vs_eager": round(gen["compiled"] / gen["eager"], 3),
            "compile_s": round(seen["compiled"][0]["time/step_s"] - med["compiled"], 2),
            "metrics_identical": f"{sum(same)}/{len(same)} iterations",
            "all_step_s": round(med["all"], 4),
            "ratio_all_vs_eager": round(med["all"] / med["eager"], 3),
            "ratio_all_vs_compiled": round(med["all"] / med["compiled"], 3),
            "all_compile_s": round(seen["all"][0]["time/step_s"] - med["all"], 2),
            "all_metrics_max_rel_diff": max_rel_diff(seen["eager"], seen["all"]),
            "phases_s": {side: {p: round(part[side, p], 4) for p in PHASES} for side in SIDES},
        }
        if "trl" in med:
            row.update(
                trl_step_s=round(med["trl"], 4),
                ratio_eager_vs_trl=round(med["eager"] / med["trl"], 3),
                ratio_compiled_vs_trl=round(med["compiled"] / med["trl"], 3),
                ratio_all_vs_trl=round(med["all"] / med["trl"], 3),
                trl="0.11.4",
            )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sections",
        nargs="+",
        default=["decode", "critic", "ppo"],
        choices=["decode", "critic", "ppo"],
        help="what to measure",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["demo", "smollm2"],
        choices=["demo", "smollm2"],
        help="decode: the models and shapes",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["vs_trl", "demo", "smollm2"],
        choices=["vs_trl", "demo", "smollm2"],
        help="ppo: the workloads",
    )
    p.add_argument("--reps", type=int, default=7, help="decode: interleaved repetitions (median)")
    p.add_argument("--iterations", type=int, default=14, help="ppo: iterations per side")
    p.add_argument("--smollm2-iterations", type=int, default=5, help="ppo: iterations per side, smollm2 workload")
    p.add_argument("--warmup", type=int, default=2, help="ppo: first iterations of each side not counted")
    p.add_argument("--critic-batches", type=int, default=8, help="critic: batches of 32 (after one warm-up)")
    p.add_argument("--reward-model", default="runs/demo/reward_model", help="critic: a stage-2 reward model")
    p.add_argument("--sft-data", default="runs/demo/data/sft.jsonl", help="critic: prompts and responses to critique")
    p.add_argument("--threads", type=int, default=1, help="torch threads (each side, each worker)")
    p.add_argument("--device", default="cpu", help="decode, critic: cpu or cuda")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ppo-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ppo_worker:
        ppo_worker(json.loads(args.ppo_worker))
        return
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    load = [round(x, 2) for x in os.getloadavg()]
    result = {
        "decode": run_decode(args) if "decode" in args.sections else None,
        "critic": run_critic(args) if "critic" in args.sections else None,
        "ppo": run_ppo(args) if "ppo" in args.sections else None,
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_avg_1m_start_end": [load[0], round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
