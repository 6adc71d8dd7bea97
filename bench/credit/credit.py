"""When does per-token credit beat a well-built scalar reward? Every arm tuned alike, on the demo's exact critic.

    nice -n 10 python bench/credit/credit.py --jobs 2            # everything, one process per core (~15 CPU-hours); cached:
                                                          # rerun the same command to continue after a stop
    python bench/credit/credit.py --stop-after grid --jobs 2     # phase 1 only (the tuning grid)
    python bench/credit/credit.py --steps 3 --lrs 1e-3 --kl-coefs 0.05 --grid-seeds 1 --confirm-seeds 1 --sweep-seeds 1 \
        --eval-posts 8 --ks 1 --out /tmp/credit           # every arm end to end at tiny shapes
    nice -n 10 python bench/credit/credit.py --jobs 2 --from-selection bench/credit/credit_selection.json --ks 2 4 \
        --results bench/credit/credit_sweep_results.json         # the K sweep alone, at the committed selection (issue 65)

Only the form of the reward differs between arms. Every arm's critic is the demo's exact critic (tasks/demo.py), its
flagged intervals exactly (bench/credit/credit_arms.py: no quote widened), so the spans are right and the same for all; what
changes is how they become per-token rewards delta_t (03 step 3):
    span           the paper's delta in {-1, 0, +1} on every token (credit_arms: span)
    poor_span      -1 inside poor spans only, no +1 for good ones (credit_arms: poor_only)
    span_centred   the paper's delta minus its batch mean per response token (03 --center-delta): no reward mean left
    poor_scalar    -(poor tokens) at EOS: a mistake-only terminal score (poor_only + 03 --reward-mode scalar)
    summed_scalar  the paper's delta summed at EOS through GAE (App. A; README's "scalar PPO" until this bench)
    clause         a perfect process reward model: +1 / -1 per clause on its last token (credit_arms: clause_scores)
Each goes through the same PPO (03's demo preset: GAE, the value head, whitened advantages, batch 32, LoRA r 16).

Phases (--stop-after ends after one):
 1. grid     every arm x --lrs x --kl-coefs x --grid-seeds selection seeds, --steps iterations each.
 2. select   per arm, the setting with the fewest median steps to a smoothed training mistake rate <= 0.15 (the exact
             critic on the training rollouts, 03's exact/mistake_rate; bench/span_vs_scalar/span_vs_scalar.py's threshold); ties: the
             lower final training rate. It reads the grid's metrics.jsonl and nothing else: no evaluation post.
             The best scalar arm (the reference of every ratio) is chosen here too, on the same numbers.
 3. confirm  --confirm-seeds fresh seeds of each arm's chosen setting, each policy judged by 04_evaluate.py on
             --eval-posts held-out posts at T = 1 (exact critic): mistake rate, ROUGE-L, KL to the SFT start.
 4. sweep    K pets per post (tasks/demo.py --pets): the tuned span, poor_span and best scalar arms on --ks, with
             --sweep-seeds seeds, --max-new-tokens 32 K (the world is in the posts: 03's critic reads K off
             each); steps to threshold as a ratio to the scalar arm per K (a run that never gets there counts --steps),
             the final training rate's paired difference to it (seeds resampled), and the same for the mistakes per
             answer and the share of facts stated in the last logged samples (sample_scores), with the answers'
             length: at K = 4 an empty answer makes no mistake.
    --from-selection FILE: phases 1-3 skipped, the sweep run at FILE's settings (a committed OUT/selection.json).
    Since issue 65 every sweep policy is judged on --eval-posts held-out posts of its K too (04, as in phase 3).
Every model here is built and trained on one thread (one_thread): a torch model trained on 2 threads is other bytes
than on 1, and the start all runs share must be the same on any machine. Each world's start (base + SFT) is recorded
by its checksum (start_checksum) in the results, and a run is keyed by it: a rebuilt start is a new run.
Writes OUT/results.json, --results (the tables' numbers) and its *_per_post.json (each evaluated run's 0/1 mistake
per held-out post, so every interval recomputes from the repository), prints the tables and one JSON line last.
KL: "train_kl" is 03's objective/kl over the last 10 iterations, "heldout_kl" the sequence KL to the SFT start on the
held-out answers.
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its own study: bench/credit
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from cached_runs import evaluate, post_mistakes, ppo, sequence_kl  # noqa: E402
from demo_start import ROOT, THRESHOLD, WINDOW, run_side_by_side, shared_start, steps_to_threshold  # noqa: E402

import common  # noqa: E402  (demo_start put the repository on sys.path)
from tasks.demo import demo_dataset  # noqa: E402

PLUGIN = "python:bench/credit/credit_arms.py:"
ARMS = {
    "span": ["--critic", PLUGIN + "span"],
    "poor_span": ["--critic", PLUGIN + "poor_only"],
    "span_centred": ["--critic", PLUGIN + "span", "--center-delta"],
    "poor_scalar": ["--critic", PLUGIN + "poor_only", "--reward-mode", "scalar"],
    "summed_scalar": ["--critic", PLUGIN + "span", "--reward-mode", "scalar"],
    "clause": ["--critic", PLUGIN + "clause_scores"],
}
SCALAR_ARMS = ("poor_scalar", "summed_scalar")
SWEEP_ARMS = ("span", "poor_span")  # and the best scalar arm
PHASES = ("grid", "select", "confirm", "sweep")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="the arms to run")
    p.add_argument("--lrs", nargs="+", type=float, default=[5e-4, 1e-3, 2e-3], help="the grid's learning rates")
    p.add_argument("--kl-coefs", nargs="+", type=float, default=[0.05, 0.2], help="the grid's KL coefficients beta")
    p.add_argument("--grid-seeds", type=int, default=3, help="selection seeds per grid cell (seeds 1..N)")
    p.add_argument("--confirm-seeds", type=int, default=10, help="fresh seeds per arm (seeds 101..100+N)")
    p.add_argument("--sweep-seeds", type=int, default=5, help="seeds per arm and K (seeds 101..100+N)")
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4], help="pets per post in the sweep")
    p.add_argument("--steps", type=int, default=150, help="PPO iterations per run")
    p.add_argument("--eval-posts", type=int, default=1000, help="held-out posts each confirmed policy is judged on")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (one per core; logs in OUT/logs)")
    p.add_argument("--stop-after", choices=PHASES, default="sweep", help="the last phase to run")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap intervals")
    p.add_argument("--out", default="bench/out/credit", help="work dir (base, SFT, runs, evaluations)")
    p.add_argument("--results", default="bench/credit/credit_results.json", help="the committed summary ('' : none)")
    p.add_argument("--from-selection", help="skip phases 1-3: the sweep at this selection.json's settings")
    p.add_argument("--sweep-arms", nargs="+", help="the sweep's arms (default: span, poor_span, the best scalar)")
    p.add_argument("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for every run")
    return p.parse_args(argv)


def one_thread() -> None:
    """Every model of the bench built and trained on one thread, this process's and every command's it runs (they
    inherit OMP_NUM_THREADS; run_side_by_side keeps the environment's): the same bytes on any machine of this kind."""
    import torch

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)


def start_checksum(world: Path) -> str:
    """sha256 over every file of a world's base model and SFT start (their paths and whole contents), but sft.json,
    the SFT's record of how it was made (it names the folders, which differ from machine to machine)."""
    h = hashlib.sha256()
    for f in sorted(p for d in ("base", "sft") for p in (world / d).rglob("*") if p.is_file() and p.name != "sft.json"):
        h.update(f"{f.relative_to(world)}:".encode() + f.read_bytes())
    return h.hexdigest()


def start(out: Path, pets: int, args) -> list[str]:
    """03's flags shared by every run of one world (K pets): demo_start's shared start (bench/shared) built in OUT/k<K>."""
    world = out / f"k{pets}"
    shared_start(
        world, "program", None, args.steps, ["--trace-samples", "0", *pet_flags(pets), *args.ppo_args], pets=pets
    )
    STARTS[f"k{pets}"] = start_checksum(world)
    return [
        "--model",
        str((world / "sft").resolve()),
        "--sft-steps",
        "0",
        "--prompts",
        str(world / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        "--trace-samples",
        "0",
        *pet_flags(pets),
        *args.ppo_args,
    ]


STARTS = {}  # world -> start_checksum, recorded in the results


def pet_flags(pets: int) -> list[str]:
    """K = 1 is the demo as it is (no flag at all, so its runs are the same commands as ever)."""
    return [] if pets == 1 else ["--max-new-tokens", str(32 * pets)]


def setting_flags(arm: str, lr: float, kl: float) -> list[str]:
    return [*ARMS[arm], "--lr", f"{lr:g}", "--kl-coef", f"{kl:g}"]


def plan(folder: Path, runs: dict, steps: int) -> dict:
    """{key: (run_dir, argv or None)} for runs {key: (name, seed, flags)} (cached_runs.ppo: cached by flags and
    the content of what they name, the SFT start among them)."""
    return {key: ppo(folder, name, seed, steps, flags) for key, (name, seed, flags) in runs.items()}


def execute(planned: dict, args, logs: Path) -> None:
    todo = {run_dir.name: cmd for run_dir, cmd in planned.values() if cmd}
    if todo:
        print(f"{len(todo)} of {len(planned)} runs to do", flush=True)
        run_side_by_side(todo, args.jobs, logs)


def curve(run_dir: Path, steps: int) -> dict:
    """A run's training numbers: steps to threshold (its length when never reached), the final smoothed rate, KL and
    the median seconds per iteration."""
    rows = common.read_jsonl(run_dir / "metrics.jsonl")[:steps]
    mistakes = [r["exact/mistake_rate"] for r in rows]
    hit = steps_to_threshold(mistakes)
    return {
        "steps": hit or steps,
        "reached": hit is not None,
        "final": statistics.fmean(mistakes[-WINDOW:]),
        "start": mistakes[0],
        "train_kl": statistics.fmean(r["objective/kl"] for r in rows[-WINDOW:]),
        "length": statistics.fmean(r["response/length"] for r in rows[-WINDOW:]),
        "step_s": statistics.median(r["time/step_s"] for r in rows),
        "mistake_curve": [round(x, 5) for x in mistakes],  # every iteration's: a rerun compares with it
    }


def sample_scores(run_dir: Path, from_step: int) -> dict:
    """In 03's logged samples (4 answers every 10 iterations) from iteration from_step on: "mistakes" per answer (the
    exact critic's flagged intervals, demo_mistakes) and "facts", the share of the post's facts each answer states
    (04's demo/facts_right). The sweep's measures added once K = 4 was seen: its SFT start makes a mistake in nearly
    every answer, and an empty answer makes none."""
    from tasks.demo import demo_mistakes, demo_scores

    rows = [r for r in common.read_jsonl(run_dir / "samples.jsonl") if r["step"] >= from_step]
    facts = [demo_scores(r["prompt"], r["response"], {}, [])["demo/facts_right"] for r in rows]
    return {
        "mistakes": statistics.fmean(demo_mistakes(r["prompt"], r["response"]) for r in rows),
        "facts": sum(n for n, _ in facts) / sum(d for _, d in facts),
    }


def select(grid: dict) -> dict:
    """Phase 2, from the grid's training curves alone: {arm: {"lr", "kl_coef", "score": (median steps, mean final
    rate), "cells": every cell's score}}, the lowest score per arm."""
    chosen = {}
    for arm in dict.fromkeys(a for a, *_ in grid):
        cells = {}
        for (a, lr, kl, _), c in grid.items():
            if a == arm:
                cells.setdefault((lr, kl), []).append(c)
        scores = {
            k: (statistics.median(c["steps"] for c in cs), statistics.fmean(c["final"] for c in cs))
            for k, cs in cells.items()
        }
        (lr, kl), score = min(scores.items(), key=lambda kv: kv[1])
        chosen[arm] = {
            "lr": lr,
            "kl_coef": kl,
            "score": list(score),
            "cells": [{"lr": a, "kl_coef": b, "median_steps": s, "final": f} for (a, b), (s, f) in scores.items()],
        }
    return chosen


def interval(xs) -> list[float]:
    return [float(np.quantile(xs, 0.025)), float(np.quantile(xs, 0.975))]


def step_ratio(arm: list[int], ref: list[int], rng, resamples: int = 10_000) -> dict:
    """mean steps of an arm / mean steps of the reference arm, seeds paired (the same seed numbers), with a 95%
    bootstrap interval over seeds."""
    a, r = np.array(arm, float), np.array(ref, float)
    idx = rng.integers(0, len(a), (resamples, len(a)))
    return {"ratio": float(a.mean() / r.mean()), "interval": interval(a[idx].mean(1) / r[idx].mean(1))}


def paired_difference(arm, ref, rng, resamples: int = 10_000) -> dict:
    """Held-out mistake rate, arm - reference, from 0/1 outcomes (S seeds, P posts) paired by seed and post: the mean
    and a 95% interval that resamples seeds and posts."""
    diff = np.array(arm, float) - np.array(ref, float)  # (S, P)
    posts = rng.integers(0, diff.shape[1], (resamples, diff.shape[1]))  # (R, P)
    seeds = rng.integers(0, diff.shape[0], (resamples, diff.shape[0]))  # (R, S)
    per_seed = diff[:, posts].mean(-1)  # (S, R)
    return {"difference": float(diff.mean()), "interval": interval(np.take_along_axis(per_seed.T, seeds, 1).mean(-1))}


def judge(out: Path, name: str, policy: Path, sft: Path, eval_data: Path, records: list[dict], pets: int) -> dict:
    """04 on the held-out posts (cached): the mistake rate, ROUGE-L, KL to the SFT start, and the 0/1 per post."""
    ev = evaluate(out / "evals", {name: str(policy)}, eval_data, pet_flags(pets))
    gens = ev["dir"] / "eval" / f"{name}.generations.jsonl"
    kl_file = ev["dir"] / "kl.json"
    if not kl_file.is_file():
        kl = sequence_kl(str(policy), str(sft), records, gens, 32 * pets)
        common.write_json(kl_file, {"kl": kl})
    per_post = post_mistakes(gens, records)
    return {
        "mistake_rate": statistics.fmean(per_post),
        "rougeL": ev["table"][name]["rougeL"],
        "heldout_kl": json.loads(kl_file.read_text())["kl"],
        "per_post": per_post,
    }


def eval_records(out: Path, pets: int, n: int) -> tuple[Path, list[dict]]:
    records = demo_dataset("eval", n, pets=pets)
    path = out / f"k{pets}" / f"eval{n}.jsonl"
    common.write_jsonl(path, records)
    train = {r["prompt"] for r in common.read_jsonl(out / f"k{pets}" / "prompts.jsonl")}
    if any(r["prompt"] in train for r in records):  # never judged on a post it trained on
        sys.exit(f"{path}: a held-out post is also a training prompt")
    return path, records


def main(argv=None):
    args = parse_args(argv)
    one_thread()
    out, rng = Path(args.out), np.random.default_rng(args.bootstrap_seed)
    logs, result = (
        out / "logs",
        {
            "command": " ".join(["python", "bench/credit/credit.py", *(argv or sys.argv[1:])]),
            "threshold": THRESHOLD,
            "window": WINDOW,
            "steps": args.steps,
            "starts": STARTS,
        },
    )
    if args.from_selection:  # phases 1-3 done before: the sweep at their selection
        saved = json.loads(Path(args.from_selection).read_text())
        chosen, best_scalar = saved["selection"], saved["best_scalar"]
        result.update(selection=chosen, best_scalar=best_scalar, from_selection=args.from_selection)
    else:
        chosen, best_scalar = phases_1_to_3(out, args, logs, result, rng)
        if args.stop_after != "sweep" or best_scalar is None:
            return result if args.stop_after == "grid" else finish(result, args)

    # --- 4. sweep: K pets per post
    sweep = {}
    for pets in args.ks:
        f = start(out, pets, args)
        arms = [a for a in args.sweep_arms or (*SWEEP_ARMS, best_scalar) if a in chosen]
        seeds = range(101, 101 + args.sweep_seeds)
        runs = {
            (arm, s): (
                f"{arm}_lr{chosen[arm]['lr']:g}_kl{chosen[arm]['kl_coef']:g}",
                s,
                [*f, *setting_flags(arm, chosen[arm]["lr"], chosen[arm]["kl_coef"])],
            )
            for arm in arms
            for s in seeds
        }
        planned = plan(out / ("confirm" if pets == 1 else f"sweep_k{pets}"), runs, args.steps)
        execute(planned, args, logs)
        eval_data, records = eval_records(out, pets, args.eval_posts)
        name = lambda arm, s: f"{arm}_s{s}" if pets == 1 else f"k{pets}_{arm}_s{s}"  # noqa: E731  (K = 1: phase 3's)
        curves = {
            key: {
                **curve(run_dir, args.steps),
                **sample_scores(run_dir, args.steps - 40),  # the last 5 logged
                **judge(out, name(*key), run_dir / "policy", Path(f[1]), eval_data, records, pets),
            }
            for key, (run_dir, _) in planned.items()
        }
        sft_eval = judge(out, "sft" if pets == 1 else f"k{pets}_sft", Path(f[1]), Path(f[1]), eval_data, records, pets)
        sweep[pets] = {"sft": {k: sft_eval[k] for k in ("mistake_rate", "rougeL", "heldout_kl")}}
        for arm in arms:
            sweep[pets][arm] = {
                **{k: [curves[arm, s][k] for s in seeds] for k in SWEEP_KEYS},
                "step_s": statistics.median(curves[arm, s]["step_s"] for s in seeds),
            }
            result.setdefault("per_post", {}).update(
                {f"k{pets}/{arm}/seed{s}": bits(curves[arm, s]["per_post"]) for s in seeds}
            )
        result.setdefault("per_post", {})[f"k{pets}/sft"] = bits(sft_eval["per_post"])
        result.setdefault("curves", {}).update(
            {f"k{pets}/{arm}/seed{s}": curves[arm, s]["mistake_curve"] for arm in arms for s in seeds}
        )
        for arm in arms if best_scalar in arms else ():  # steps: censored at --steps where never reached
            r, ref = sweep[pets][arm], sweep[pets][best_scalar]
            r["versus_scalar"] = step_ratio(r["steps"], ref["steps"], rng)
            for k in ("final", "mistakes", "facts"):  # paired by seed
                r[f"{k}_versus_scalar"] = paired_difference([[x] for x in r[k]], [[x] for x in ref[k]], rng)
            r["heldout_versus_scalar"] = paired_difference(
                [curves[arm, s]["per_post"] for s in seeds], [curves[best_scalar, s]["per_post"] for s in seeds], rng
            )
    result["sweep"] = sweep
    print_sweep(sweep, best_scalar)
    return finish(result, args)


SWEEP_KEYS = ("steps", "reached", "final", "mistakes", "facts", "length", "train_kl", "mistake_rate", "heldout_kl")


def phases_1_to_3(out: Path, args, logs: Path, result: dict, rng) -> tuple[dict, str | None]:
    """The grid, the selection from its training curves alone, and the confirmation on fresh seeds judged held out
    (result gets each phase's numbers). Returns (chosen settings per arm, the best scalar arm)."""
    flags = start(out, 1, args)

    # --- 1. grid
    cells = {
        (arm, lr, kl, s): (f"{arm}_lr{lr:g}_kl{kl:g}", s, [*flags, *setting_flags(arm, lr, kl)])
        for arm in args.arms
        for lr in args.lrs
        for kl in args.kl_coefs
        for s in range(1, args.grid_seeds + 1)
    }
    planned = plan(out / "grid", cells, args.steps)
    execute(planned, args, logs)
    grid = {key: curve(run_dir, args.steps) for key, (run_dir, _) in planned.items()}
    if statistics.fmean(c["start"] for c in grid.values()) <= THRESHOLD:
        sys.exit(f"the SFT start's mistake rate is already <= {THRESHOLD}: the steps to it would be void")
    if args.stop_after == "grid":
        print(f"grid done: {len(grid)} runs in {out / 'grid'}")
        return {}, None

    # --- 2. select, on the training curves alone
    chosen = select(grid)
    scalars = [a for a in SCALAR_ARMS if a in chosen]
    best_scalar = min(scalars, key=lambda a: chosen[a]["score"]) if scalars else None
    result.update(selection=chosen, best_scalar=best_scalar)
    common.write_json(out / "selection.json", {"selection": chosen, "best_scalar": best_scalar})
    print_selection(chosen, best_scalar)
    if args.stop_after == "select":
        return chosen, best_scalar

    # --- 3. confirm: fresh seeds of each arm's setting, judged on held-out posts
    eval_data, records = eval_records(out, 1, args.eval_posts)
    seeds = range(101, 101 + args.confirm_seeds)
    runs = {
        (arm, s): (f"{arm}_lr{c['lr']:g}_kl{c['kl_coef']:g}", s, [*flags, *setting_flags(arm, c["lr"], c["kl_coef"])])
        for arm, c in chosen.items()
        for s in seeds
    }
    planned = plan(out / "confirm", runs, args.steps)
    execute(planned, args, logs)
    sft = Path(flags[1])
    runs = {
        key: {
            **curve(run_dir, args.steps),
            **judge(out, f"{key[0]}_s{key[1]}", run_dir / "policy", sft, eval_data, records, 1),
        }
        for key, (run_dir, _) in planned.items()
    }
    sft_eval = judge(out, "sft", sft, sft, eval_data, records, 1)
    result["confirm"] = confirm_table(runs, chosen, best_scalar, sft_eval, rng)
    result["per_post"] = {
        "sft": bits(sft_eval["per_post"]),
        **{f"{a}/seed{s}": bits(r["per_post"]) for (a, s), r in runs.items()},
    }
    return chosen, best_scalar


def bits(per_post) -> str:
    return "".join(str(int(x)) for x in per_post)


def confirm_table(runs: dict, chosen: dict, best_scalar, sft_eval: dict, rng) -> dict:
    """Phase 3's numbers per arm, each against the best scalar arm: steps ratio (paired seeds) and the held-out
    mistake rate difference (paired seeds and posts)."""
    table = {"sft": {k: sft_eval[k] for k in ("mistake_rate", "rougeL", "heldout_kl")}}
    arms = list(chosen)
    seeds = sorted({s for _, s in runs})
    for arm in arms:
        rs = [runs[arm, s] for s in seeds]
        row = {
            "lr": chosen[arm]["lr"],
            "kl_coef": chosen[arm]["kl_coef"],
            "steps": [r["steps"] for r in rs],
            "reached": [r["reached"] for r in rs],
            "final_train": [r["final"] for r in rs],
            **{k: [r[k] for r in rs] for k in ("mistake_rate", "rougeL", "heldout_kl", "train_kl")},
            "step_s": statistics.median(r["step_s"] for r in rs),
        }
        if best_scalar:
            ref = [runs[best_scalar, s] for s in seeds]
            row["versus_scalar"] = {
                "steps": step_ratio(row["steps"], [r["steps"] for r in ref], rng),
                "mistakes": paired_difference([r["per_post"] for r in rs], [r["per_post"] for r in ref], rng),
            }
        table[arm] = row
    print_confirm(table, best_scalar)
    return table


def med(xs, fmt="{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def print_selection(chosen: dict, best_scalar) -> None:
    print(f"\nselection (training curves only; score = median steps to <= {THRESHOLD}, then the final rate)")
    for arm, c in chosen.items():
        print(
            f"  {arm:<14} lr {c['lr']:<7g} beta {c['kl_coef']:<5g} median steps {c['score'][0]:>6} final "
            f"{c['score'][1]:.3f}" + ("   <- best scalar arm" if arm == best_scalar else "")
        )


def print_confirm(table: dict, best_scalar) -> None:
    print(f"\nconfirmation: median [min, max] over seeds; ratios and differences against {best_scalar}")
    print(
        f"{'arm':<14}{'steps':>18}{'ratio [95%]':>22}{'held-out mistakes':>26}{'diff [95%]':>26}{'ROUGE-L':>9}"
        f"{'KL':>7}{'s/it':>7}"
    )
    sft = table["sft"]
    print(f"{'sft':<14}{'':>18}{'':>22}{sft['mistake_rate']:>26.3f}{'':>26}{sft['rougeL']:>9.3f}{0:>7.2f}")
    for arm, r in table.items():
        if arm == "sft":
            continue
        vs = r.get("versus_scalar", {})
        ratio = (
            f"{vs['steps']['ratio']:.2f} [{vs['steps']['interval'][0]:.2f}, {vs['steps']['interval'][1]:.2f}]"
            if vs
            else ""
        )
        diff = (
            (
                f"{vs['mistakes']['difference']:+.3f} [{vs['mistakes']['interval'][0]:+.3f}, "
                f"{vs['mistakes']['interval'][1]:+.3f}]"
            )
            if vs
            else ""
        )
        print(
            f"{arm:<14}{med(r['steps'], '{:g}'):>18}{ratio:>22}{med(r['mistake_rate']):>26}{diff:>26}"
            f"{statistics.median(r['rougeL']):>9.3f}{statistics.median(r['heldout_kl']):>7.2f}{r['step_s']:>7.2f}"
        )


def print_sweep(sweep: dict, best_scalar) -> None:
    print(f"\nK sweep: steps to <= {THRESHOLD}, median [min, max]; against {best_scalar} [95%]")
    for pets, arms in sweep.items():
        print(f"  K={pets} sft: held-out mistakes {arms['sft']['mistake_rate']:.3f}")
        for arm, r in arms.items():
            if arm == "sft":
                continue
            print(
                f"  K={pets} {arm:<14}{med(r['steps'], '{:g}'):>18}  reached {sum(r['reached'])}/{len(r['reached'])}"
                f"  final train {med(r['final'])}  mistakes/answer {med(r['mistakes'], '{:.2f}')}  facts "
                f"{med(r['facts'], '{:.2f}')}  length {med(r['length'], '{:.0f}')}  train KL "
                f"{statistics.median(r['train_kl']):.2f}  held out {med(r['mistake_rate'])}  held-out KL "
                f"{statistics.median(r['heldout_kl']):.2f}  s/it {r['step_s']:.2f}"
            )
            if "versus_scalar" in r:
                print(
                    f"{'':>22}ratio {interval_text(r['versus_scalar'], 'ratio', '.2f')}  final train "
                    f"{interval_text(r['final_versus_scalar'], 'difference', '+.3f')}  mistakes/answer "
                    f"{interval_text(r['mistakes_versus_scalar'], 'difference', '+.2f')}  held out "
                    f"{interval_text(r['heldout_versus_scalar'], 'difference', '+.3f')}"
                )


def interval_text(row: dict, key: str, fmt: str) -> str:
    return f"{row[key]:{fmt}} [{row['interval'][0]:{fmt}}, {row['interval'][1]:{fmt}}]"


def per_post_path(results: str) -> Path:
    path = Path(results)
    return path.with_name(path.name.replace("_results", "_per_post"))


def finish(result: dict, args) -> dict:
    import torch
    import transformers

    result["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    per_post = result.pop("per_post", None)
    common.write_json(Path(args.out) / "results.json", {**result, "per_post": per_post})
    if args.results:
        common.write_json(ROOT / args.results, result)
        if per_post:  # credit_results.json -> credit_per_post.json
            common.write_json(ROOT / per_post_path(args.results), per_post)
    print(json.dumps({k: result[k] for k in ("best_scalar", "selection") if k in result}, default=str))
    return result


if __name__ == "__main__":
    main()
