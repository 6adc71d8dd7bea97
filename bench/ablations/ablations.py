"""The paper's ablations and a critic-free estimator, side by side on one bench (paper Table 2, App. A, App. I.1)

    python bench/ablations/ablations.py                   # exact critic: 8 rows x 3 seeds x 150 iterations, ~30 min on one core
    python bench/ablations/ablations.py --rows "span + RLOO" "scalar + RLOO"        # some rows only (the rest stay on disk)
    python bench/ablations/ablations.py --critic local    # the zero-flag stage-2 reward model as critic: 9 rows, ~45 min
    python bench/ablations/ablations.py --critic local --reward-model runs/demo/smol_rm --steps 60 \\
        --spans-only-reward-model runs/demo/smol_rm_spans_only    # the pretrained critic (bench/real_critic/real_critic.py)
    # on a GPU: the shared start, then all 27 (row, seed) runs side by side, one process each, then the table
    python bench/ablations/ablations.py --critic local --reward-model R --spans-only-reward-model R_SPANS_ONLY --steps 60 --jobs 27

Every row starts from the same SFT checkpoint (bench/span_vs_scalar/span_vs_scalar.py's shared start, built once in --out), with the
same critic, seeds, iterations, batch of rollouts and hyperparameters; a row changes only its own flags:
    span                 Text2Grad: delta_t from the quoted spans, GAE (03's defaults)
    scalar               the same delta summed onto the last token (App. A, --reward-mode scalar)
    span + linear-decay  within-span weighting (App. I, --span-weighting linear-decay)
    dense labels         every token labelled: -1 inside a poor span, +1 elsewhere (App. I.1, --labels dense)
    spans-only RM        learned critic only: a reward model trained to write the span JSON without its critique
                         (Table 2's "w/o CoT", 02 --rm-format spans-only), else the same recipe as --reward-model's
    span + RLOO          no value head: reward-to-go minus the leave-one-out mean return of the other samples of the
                         prompt (--advantage rloo, k = 4 samples per prompt, the same 32 rollouts per iteration)
    scalar + RLOO        plain RLOO (the whole reward on the last token)
    span + RLOO position     span + RLOO, each token's reward-to-go compared with the other samples' at the same
                             position instead of their whole return (--rloo-baseline position)
    span + RLOO mean-reward  span + RLOO, the other samples' mean reward per token subtracted from each reward before
                             summing (--rloo-baseline mean-reward; not PRIME's masked_rloo, README)
Judged as bench/span_vs_scalar/span_vs_scalar.py judges: the exact critic on each run's own rollouts (03's exact/mistake_rate, never
trained on), smoothed over 10 iterations; steps to a mistake rate <= 0.15 (a run that never gets there counts its
full length, shown as "> N" and ranked above every run that got there), the final mistake rate (mean of the last 10
iterations) and the final sum of the exact critic's delta (good words +1, wrong ones -1: an answer that drops facts
scores less, one that only avoids mistakes does not). Median [min, max] over seeds. Every run, the SFT start and the
reward models are reused from --out only when the same commands made them (bench/shared/run_cache.py).
Nothing is tuned per row. Prints the table and one JSON line; writes OUT/results.json.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from demo_start import THRESHOLD, WINDOW, ppo_run, run, shared_start, steps_to_threshold  # noqa: E402

import common  # noqa: E402  (on the path from demo_start)
from infra import reward_models  # noqa: E402
from run_cache import check_settings  # noqa: E402

ROWS = {  # row -> (03 flags, the paper's direction against "span")
    "span": ([], "the method (reference row)"),
    "scalar": (["--reward-mode", "scalar"], "worse: slower, lower scores (App. A)"),
    "span + linear-decay": (["--span-weighting", "linear-decay"], "the method uses uniform weights (App. I)"),
    "dense labels": (["--labels", "dense"], "worse: ROUGE-L 0.196 vs 0.291 (App. I.1)"),
    "spans-only RM": ([], "worse without the critique (Table 2, w/o CoT)"),
    "span + RLOO": (["--advantage", "rloo", "--rloo-k", "4"], "none (not in the paper)"),
    "scalar + RLOO": (["--reward-mode", "scalar", "--advantage", "rloo", "--rloo-k", "4"], "none (not in the paper)"),
    "span + RLOO position": (
        ["--advantage", "rloo", "--rloo-k", "4", "--rloo-baseline", "position"],
        "none (not in the paper)",
    ),
    "span + RLOO mean-reward": (
        ["--advantage", "rloo", "--rloo-k", "4", "--rloo-baseline", "mean-reward"],
        "none (not in the paper)",
    ),
}
SPAN_RLOO = ["span + RLOO", "span + RLOO position", "span + RLOO mean-reward"]  # each against scalar + RLOO


def spread(xs, fmt):
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs))}, {fmt(max(xs))}]"


def steps_cell(hits: list[int | None], steps: int) -> str:
    """Steps to the threshold over seeds, "median [min, max]": a run that never got there (None) shows as "> steps"
    and ranks above every run that did, one that got there at its last step shows that step."""
    return spread([math.inf if h is None else h for h in hits], lambda v: f"> {steps}" if v == math.inf else f"{v:g}")


def spans_only_reward_model(out: Path, given: str | None, reward_model: str | None) -> Path:
    """The w/o-CoT reward model of the "spans-only RM" row. Given (--spans-only-reward-model): a stage-2 output trained
    with --rm-format spans-only, used as it is (nothing is trained into it). Else 02 --rm-format spans-only at its
    zero-flag settings on the shared start's annotations, trained once in OUT/reward_model_spans_only (run_cache)."""
    if given:
        path = Path(given).resolve()
        if not (path / "reward_model.json").is_file():
            sys.exit(
                f"--spans-only-reward-model {given}: no reward_model.json (a stage-2 output of 02_train_reward.py "
                "--rm-format spans-only, with --reward-model's recipe)"
            )
        if (fmt := reward_models.rm_settings(path)["rm_format"]) != "spans-only":
            sys.exit(f"--spans-only-reward-model {given}: rm_format {fmt!r}, not spans-only (its reward_model.json)")
        return path
    if reward_model:
        sys.exit(
            "--reward-model given: pass --spans-only-reward-model too, trained with that model's recipe and "
            "02 --rm-format spans-only"
        )
    path = out / "reward_model_spans_only"
    cmd = [
        "02_train_reward.py",
        "--data",
        str(out / "annotations.jsonl"),
        "--model",
        str(out / "base"),
        "--rm-format",
        "spans-only",
        "--output-dir",
        str(path),
    ]
    check_settings(path, {"argv": cmd})
    if not (path / "reward_model.json").is_file():
        run(cmd)
    return path.resolve()


def slug(row: str) -> str:
    return row.replace(" + ", "_").replace(" ", "_").replace("-", "_")


def launch(cmd: list[str], log: Path, env: dict) -> int:
    """Run one command to the end, its output in `log`; its exit code."""
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def side_by_side(args, rows: list[str], seeds, out: Path) -> None:
    """Every (row, seed) run as its own `--rows R --only S` process, at most --jobs at a time, logs in OUT/logs; stops
    with the failed runs' logs named. Run after the shared start exists, so the children only reuse it."""
    common_argv = ["--critic", args.critic, "--steps", str(args.steps), "--out", str(out), "--jobs", "1"]
    for flag, value in (
        ("--reward-model", args.reward_model),
        ("--spans-only-reward-model", args.spans_only_reward_model),
    ):
        common_argv += [flag, value] if value else []
    # each process gets its share of the cores unless told: 27 torch processes with 16 threads each would thrash
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs)), **os.environ, "PYTHONUNBUFFERED": "1"}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    failed, runs = [], {}
    with ThreadPoolExecutor(args.jobs) as pool:  # threads only wait: each run is its own process
        for seed in seeds:
            for row in rows:
                log = out / "logs" / f"{slug(row)}_seed{seed}.log"
                cmd = [sys.executable, __file__, *common_argv, "--rows", row, "--only", str(seed), "--", *args.ppo_args]
                runs[pool.submit(launch, cmd, log, env)] = (row, seed, log)
        for done, future in enumerate(as_completed(runs), 1):
            row, seed, log = runs[future]
            if future.result() != 0:
                failed.append((row, seed, log))
            print(f"{done}/{len(runs)} runs done: {row} seed {seed}{' FAILED' if future.result() else ''}", flush=True)
    if failed:
        sys.exit(
            f"{len(failed)} of {len(runs)} runs failed: "
            + "; ".join(f"{row} seed {seed} (its log: {log})" for row, seed, log in failed)
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--critic",
        default="program",
        choices=["program", "local"],
        help="program: the demo's exact critic; local: a stage-2 reward model (the zero-flag one, trained "
        "once in --out, or --reward-model)",
    )
    p.add_argument("--reward-model", help="--critic local: this reward model (e.g. runs/demo/smol_rm)")
    p.add_argument(
        "--spans-only-reward-model",
        help="--critic local: the spans-only one for its row; default: 02 "
        "--rm-format spans-only at its zero-flag settings, trained in --out (without --reward-model only)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per row")
    p.add_argument("--steps", type=int, default=150, help="PPO iterations per run")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), help="run only these rows (default: all that apply)")
    p.add_argument("--out", help="work dir; default bench/out/ablations[_local]")
    p.add_argument(
        "--start-only",
        action="store_true",
        help="build the shared start (toy base, SFT, reward models) and stop: once, before side-by-side --only calls",
    )
    p.add_argument(
        "--only",
        type=int,
        metavar="S",
        help="run seed S's runs of the chosen rows and stop, no table (to "
        "run rows and seeds side by side, one process each; a later call without --only reads the runs)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run this many (row, seed) runs at once, each in its own "
        "process (logs in OUT/logs), then the table; e.g. 27 on one GPU. 1: one after another, in this one",
    )
    p.add_argument("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for every row")
    args = p.parse_args(argv)
    out = Path(args.out or f"bench/out/ablations{'' if args.critic == 'program' else '_local'}")
    if args.only is not None and not (out / "sft" / "config.json").is_file():
        sys.exit(
            f"{out}: no shared start yet; build it once with --start-only (side-by-side --only calls would race "
            "to build it)"
        )
    flags = shared_start(out, args.critic, args.reward_model, args.steps, args.ppo_args)
    rows = [r for r in (args.rows or ROWS) if args.critic == "local" or r != "spans-only RM"]

    if "spans-only RM" in rows:  # the w/o-CoT reward model: the same data and settings as the critic's, spans only
        spans_only = spans_only_reward_model(out, args.spans_only_reward_model, args.reward_model)
        i = flags.index("--reward-model")
        flags_without_rm = flags[:i] + flags[i + 2 :]
    if args.start_only:
        print(f"the shared start is ready in {out}")
        return 0
    seeds = [args.only] if args.only is not None else range(1, args.seeds + 1)
    if args.jobs > 1 and args.only is None:
        side_by_side(args, rows, seeds, out)  # the runs below are then read from disk, not run again
    curves = {}
    for row in rows:
        row_flags = ["--reward-model", str(spans_only)] if row == "spans-only RM" else ROWS[row][0]
        base = flags_without_rm if row == "spans-only RM" else flags
        curves[row] = [
            ppo_run(out, out / f"{slug(row)}_seed{seed}", seed, args.steps, [*row_flags, *base]) for seed in seeds
        ]
    if args.only is not None:
        return 0

    start = statistics.fmean(c["mistakes"][0] for cs in curves.values() for c in cs)
    if start <= THRESHOLD:
        sys.exit(f"the SFT start already has mistake rate {start:.2f} <= {THRESHOLD}: the benchmark would be void")
    result = {
        "critic": args.critic,
        "reward_model": args.reward_model,
        "threshold": THRESHOLD,
        "window": WINDOW,
        "steps": args.steps,
        "seeds": args.seeds,
        "start_mistake_rate": round(start, 3),
        "rows": {},
    }
    print(
        f"\ncritic: {args.critic}{' ' + args.reward_model if args.reward_model else ''}; SFT start {start:.2f}; "
        f"{args.seeds} seeds x {args.steps} iterations\n"
    )
    print(
        f"{'row':<26}{'steps to <= 0.15':>18}{'final mistake rate':>28}{'final exact sum delta':>24}"
        f"{'final length':>20}   paper's direction vs span"
    )
    for row, cs in curves.items():
        hits = [steps_to_threshold(c["mistakes"]) for c in cs]
        steps = [h or args.steps for h in hits]
        finals = [statistics.fmean(c["mistakes"][-WINDOW:]) for c in cs]
        result["rows"][row] = {
            "steps": steps,
            "reached": [h is not None for h in hits],
            "final": finals,
            "final_kl": [statistics.fmean(c["kl"][-WINDOW:]) for c in cs],
            "final_length": [statistics.fmean(c["length"][-WINDOW:]) for c in cs],
            "final_delta_sum": [statistics.fmean(c["reward"][-WINDOW:]) for c in cs],
            "steps_median": statistics.median(steps),
            "final_median": statistics.median(finals),
        }
        shown = steps_cell(hits, args.steps)
        length = spread(result["rows"][row]["final_length"], lambda v: f"{v:.1f}")
        delta_sum = spread(result["rows"][row]["final_delta_sum"], lambda v: f"{v:.2f}")
        print(
            f"{row:<26}{shown:>18}{spread(finals, lambda v: f'{v:.3f}'):>28}{delta_sum:>24}{length:>20}   "
            f"{ROWS[row][1]}"
        )
    r = result["rows"]
    for row in [row for row in SPAN_RLOO if row in r and "scalar + RLOO" in r]:
        ratio = r[row]["steps_median"] / r["scalar + RLOO"]["steps_median"]
        result.setdefault("rloo_steps_ratio", {})[row] = ratio
        bounds = [f"{name} did not always get there" for name in (row, "scalar + RLOO") if not all(r[name]["reached"])]
        print(
            f"{row} / scalar + RLOO steps (medians): {ratio:.2f}"
            + (f" (not a ratio: {'; '.join(bounds)})" if bounds else "")
        )
    common.write_json(out / "results.json", result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
