"""Does span-level credit learn faster than the same information as one scalar? (paper Sec. 3.6, App. A)

    python bench/span_vs_scalar.py                    # 3 seeds x 2 modes x 150 iterations, ~7 min on 2 CPU cores
    python bench/span_vs_scalar.py --critic local     # the paper's setting: the stage-2 reward model is the critic
    python bench/span_vs_scalar.py --seeds 1 --steps 30 --out bench/out/smoke   # a quick look

Both modes start from the same SFT checkpoint of the demo task, the same critic, the same seeds and the same
hyperparameters; only --reward-mode differs (span: delta_t on every token; scalar: sum of delta on the last token).
The critic: --critic program, the demo's exact programmatic critic; --critic local, the reward model that
01_annotate.py + 02_train_reward.py train at their zero-flag settings (built once in --out), the setting the paper uses.

Measure, in both settings judged by the exact critic on the training rollouts themselves (sampled at temperature 1;
with the learned critic that is 03's exact/mistake_rate, logged and never trained on): the mistake rate, the share of
rollouts with at least one poor span, smoothed over 10 iterations. The threshold is fixed before any run: 0.15. The SFT start must not
already meet it (checked). Steps-to-threshold is the first iteration whose smoothed rate is <= 0.15; a run that never
gets there counts its full length and reports reached = false (the ratio is then a bound).
Prints a table, writes bench/span_vs_scalar.png (mean curve with a min-max band over seeds), and prints one JSON line.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra import reward_models  # noqa: E402
from run_cache import check_settings  # noqa: E402
from infra.tiny_model import build_demo_base  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

THRESHOLD, WINDOW = 0.15, 10


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run([sys.executable, "-u", *cmd], cwd=ROOT, check=True)


def run_side_by_side(cmds: dict, jobs: int, logs: Path) -> None:
    """{name: a script's argv} run like run(), at most `jobs` at a time, each one's output in LOGS/NAME.log; exits
    naming the failed ones' logs. Each process gets its share of the cores (OMP_NUM_THREADS) unless the environment
    sets it: N torch processes with a thread per core each would thrash."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    if jobs <= 1:
        for cmd in cmds.values():
            run(cmd)
        return
    import os

    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs)), **os.environ, "PYTHONUNBUFFERED": "1"}
    logs.mkdir(parents=True, exist_ok=True)

    def launch(name, cmd):
        print(f"+ {' '.join(cmd)}  (log: {logs / name}.log)", flush=True)
        with open(logs / f"{name}.log", "w") as f:
            return subprocess.run(
                [sys.executable, "-u", *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env
            ).returncode

    with ThreadPoolExecutor(jobs) as pool:  # threads only wait: each command is its own process
        futures = {pool.submit(launch, name, cmd): name for name, cmd in cmds.items()}
        failed = []
        for done, future in enumerate(as_completed(futures), 1):
            failed += [futures[future]] if future.result() else []
            print(f"{done}/{len(futures)} done: {futures[future]}{' FAILED' if future.result() else ''}", flush=True)
    if failed:
        sys.exit(f"{len(failed)} of {len(cmds)} failed: " + "; ".join(f"{n} (its log: {logs / n}.log)" for n in failed))


def smoothed(xs, w=WINDOW):
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def steps_to_threshold(mistakes: list[float]) -> int | None:
    """The first iteration (from 1) whose mistake rate, smoothed over WINDOW iterations, is <= THRESHOLD; None if
    none is."""
    return next((i + 1 for i, x in enumerate(smoothed(mistakes)) if i + 1 >= WINDOW and x <= THRESHOLD), None)


def shared_start(
    out: Path, critic: str, reward_model: str | None, steps: int, ppo_args: list[str], pets: int = 1
) -> list[str]:
    """The start every run shares, built once in `out`: the demo base model, prompts, the SFT warm start (03 with
    --steps 0 trains and saves it) and, for critic "local" without reward_model, stages 1 and 2 at their zero-flag
    settings on this base. Each is keyed by the commands that made it (run_cache). Returns 03's flags for every run
    (critic, prompts, steps). pets: the demo world's K (tasks/demo.py), 1 as the demo is."""
    if not (out / "base" / "config.json").is_file():
        build_demo_base(out / "base", pets=pets)
    common.write_jsonl(out / "prompts.jsonl", demo_dataset("train", 1000, pets=pets))
    common.write_jsonl(out / "sft.jsonl", demo_dataset("sft", 2000, pets=pets))
    flags = ["--critic", "program", "--kl-coef", "0.05"]  # the exact critic cannot be gamed: a looser KL leash
    if critic == "local":  # stages 1 and 2 at their zero-flag settings, on this base model (or --reward-model)
        rm_dir = Path(reward_model).resolve() if reward_model else out / "reward_model"
        if reward_model:
            reward_models.check_reward_model(str(rm_dir))
        else:
            stages = [
                ["01_annotate.py", "--output", str(out / "annotations.jsonl"), "--demo-dir", str(out)],
                [
                    "02_train_reward.py",
                    "--data",
                    str(out / "annotations.jsonl"),
                    "--model",
                    str(out / "base"),
                    "--output-dir",
                    str(rm_dir),
                ],
            ]
            check_settings(rm_dir, {"commands": stages})
            for cmd in stages if not (rm_dir / "reward_model.json").is_file() else ():
                run(cmd)
        flags = ["--critic", "local", "--reward-model", str(rm_dir)]  # and the demo's own KL setting
    flags += ["--prompts", str(out / "prompts.jsonl"), "--scalar-baseline-dir", ""]
    # the SFT start depends on neither the critic nor --steps: both critics of one --out share it
    sft = [
        "03_train_policy.py",
        "--model",
        str(out / "base"),
        "--sft-data",
        str(out / "sft.jsonl"),
        "--sft-output-dir",
        str(out / "sft"),
        "--critic",
        "program",
        "--prompts",
        str(out / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        *ppo_args,
        "--steps",
        "0",
        "--output-dir",
        str(out / "sft_only"),
    ]
    check_settings(out / "sft", {"argv": sft})
    if not (out / "sft" / "config.json").is_file():
        run([*sft, "--overwrite"])
    return [*flags, "--steps", str(steps), "--save-every", str(steps), *ppo_args]


def ppo_command(out: Path, run_dir: Path, seed: int, flags: list[str]) -> list[str]:
    """03's command line for one PPO run from the shared SFT start."""
    return [
        "03_train_policy.py",
        "--model",
        str(out / "sft"),
        "--sft-steps",
        "0",
        "--seed",
        str(seed),
        "--output-dir",
        str(run_dir),
        *flags,
    ]


def ppo_run(out: Path, run_dir: Path, seed: int, steps: int, flags: list[str]) -> dict:
    """One PPO run from the shared SFT start (skipped when run_dir already holds `steps` iterations of the very same
    command, refused when it holds a run of another: run_cache): its curves as judged by the exact critic on its own
    rollouts (03's exact/* monitor), its KL and response length."""
    cmd, metrics = ppo_command(out, run_dir, seed, flags), run_dir / "metrics.jsonl"
    check_settings(run_dir, {"argv": cmd})
    if not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        run([*cmd, "--overwrite"])  # an unfinished run of this command: started again
    rows = common.read_jsonl(metrics)[:steps]
    return {
        "mistakes": [r["exact/mistake_rate"] for r in rows],
        "reward": [r["exact/span_reward"] for r in rows],
        "kl": [r["objective/kl"] for r in rows],
        "length": [r["response/length"] for r in rows],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds per mode")
    p.add_argument("--steps", type=int, default=150, help="PPO iterations per run")
    p.add_argument(
        "--critic",
        default="program",
        choices=["program", "local"],
        help="program: the demo's exact critic; local: the stage-2 reward model (trained once in --out)",
    )
    p.add_argument(
        "--reward-model",
        help="--critic local: this stage-2 reward model (e.g. bench/real_critic.py's "
        "SmolLM2 one) instead of training the zero-flag one in --out",
    )
    p.add_argument(
        "--out", help="work dir (base model, SFT, reward model, runs); default bench/out/span_vs_scalar[_local]"
    )
    p.add_argument("--png", help="the curves (default bench/span_vs_scalar[_local].png)")
    p.add_argument("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for both modes")
    args = p.parse_args()
    suffix = "" if args.critic == "program" else "_local"
    out = Path(args.out or f"bench/out/span_vs_scalar{suffix}")
    args.png = args.png or f"bench/span_vs_scalar{suffix}.png"

    common_flags = shared_start(out, args.critic, args.reward_model, args.steps, args.ppo_args)

    # --- the runs, one at a time (two jobs sharing 2 cores would distort nothing but wall time; still, keep it clean)
    curves = {"span": [], "scalar": []}
    for seed in range(1, args.seeds + 1):
        for mode in ("span", "scalar"):
            curves[mode].append(
                ppo_run(out, out / f"{mode}_seed{seed}", seed, args.steps, ["--reward-mode", mode, *common_flags])
            )

    # --- steps to threshold, final values
    start = statistics.fmean(c["mistakes"][0] for cs in curves.values() for c in cs)
    if start <= THRESHOLD:
        sys.exit(f"the SFT start already has mistake rate {start:.2f} <= {THRESHOLD}: the benchmark would be void")
    result = {
        "critic": args.critic,
        "threshold": THRESHOLD,
        "window": WINDOW,
        "steps": args.steps,
        "seeds": args.seeds,
        "start_mistake_rate": start,
    }
    print(f"\n{'mode':<8}{'seed':>5}{'steps to <=0.15':>17}{'final mistakes':>16}{'final reward':>14}{'final KL':>10}")
    for mode, cs in curves.items():
        steps, finals, rewards, reached = [], [], [], []
        for seed, c in enumerate(cs, 1):
            hit = steps_to_threshold(c["mistakes"])
            steps.append(hit or args.steps)
            reached.append(hit is not None)
            finals.append(statistics.fmean(c["mistakes"][-WINDOW:]))
            rewards.append(statistics.fmean(c["reward"][-WINDOW:]))
            print(
                f"{mode:<8}{seed:>5}{(hit or f'>{args.steps}'):>17}{finals[-1]:>16.3f}{rewards[-1]:>14.2f}"
                f"{statistics.fmean(c['kl'][-WINDOW:]):>10.2f}"
            )
        result[f"{mode}_steps"] = statistics.median(steps)
        result[f"{mode}_final"] = statistics.fmean(finals)
        result[f"{mode}_final_reward"] = statistics.fmean(rewards)
        result[f"{mode}_reached"] = 2 * sum(reached) > len(reached)  # the median run got there
    result["ratio"] = result["span_steps"] / result["scalar_steps"]

    # --- the picture
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, color in (("span", "#2e7d32"), ("scalar", "#c62828")):
        for ax, key, smooth in ((axes[0], "mistakes", True), (axes[1], "reward", True)):
            series = [smoothed(c[key]) if smooth else c[key] for c in curves[mode]]
            x = range(1, len(series[0]) + 1)
            mean = [statistics.fmean(v) for v in zip(*series)]
            ax.plot(x, mean, color=color, label=f"{mode} ({len(series)} seeds)")
            ax.fill_between(x, [min(v) for v in zip(*series)], [max(v) for v in zip(*series)], color=color, alpha=0.2)
    axes[0].axhline(THRESHOLD, color="grey", ls="--", lw=1)
    axes[0].set(title="mistake rate, smoothed over 10 (exact critic)", xlabel="PPO iteration")
    axes[1].set(title="sum of delta per response, smoothed (exact critic)", xlabel="PPO iteration")
    axes[0].legend()
    fig.suptitle(
        "PPO's critic: "
        + (
            "the demo's exact program critic"
            if args.critic == "program"
            else "the stage-2 reward model (the exact critic only judges)"
        ),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(ROOT / args.png, dpi=120)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
