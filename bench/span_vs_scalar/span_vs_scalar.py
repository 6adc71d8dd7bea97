"""Does span-level credit learn faster than the same information as one scalar? (paper Sec. 3.6, App. A)

    python bench/span_vs_scalar/span_vs_scalar.py                    # 3 seeds x 2 modes x 150 iterations, ~7 min on 2 CPU cores
    python bench/span_vs_scalar/span_vs_scalar.py --critic local     # the paper's setting: the stage-2 reward model is the critic
    python bench/span_vs_scalar/span_vs_scalar.py --seeds 1 --steps 30 --out bench/out/smoke   # a quick look

Both modes start from the same SFT checkpoint of the demo task, the same critic, the same seeds and the same
hyperparameters; only --reward-mode differs (span: delta_t on every token; scalar: sum of delta on the last token).
The critic: --critic program, the demo's exact programmatic critic; --critic local, the reward model that
01_annotate.py + 02_train_reward.py train at their zero-flag settings (built once in --out), the setting the paper uses.

Measure, in both settings judged by the exact critic on the training rollouts themselves (sampled at temperature 1;
with the learned critic that is 03's exact/mistake_rate, logged and never trained on): the mistake rate, the share of
rollouts with at least one poor span, smoothed over 10 iterations. The threshold is fixed before any run: 0.15. The SFT start must not
already meet it (checked). Steps-to-threshold is the first iteration whose smoothed rate is <= 0.15; a run that never
gets there counts its full length and reports reached = false (the ratio is then a bound).
Prints a table, writes bench/span_vs_scalar/span_vs_scalar.png (mean curve with a min-max band over seeds), and prints one JSON line.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from demo_start import ROOT, THRESHOLD, WINDOW, ppo_run, shared_start, smoothed, steps_to_threshold  # noqa: E402


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
        help="--critic local: this stage-2 reward model (e.g. bench/real_critic/real_critic.py's "
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
