"""Per-token credit where it should matter (issue 65): long answers with sparse mistakes at matched difficulty, a scalar
that an empty answer cannot win, and starts that reproduce. The plan, fixed before any run: bench/credit/credit.md.

    nice -n 10 python bench/credit/credit_matched.py --stop-after calibrate     # the worlds' starts and their difficulty
    nice -n 10 python bench/credit/credit_matched.py --jobs 2                    # everything; cached: rerun to continue
    python bench/credit/credit_matched.py --tiny --out /tmp/cm                   # every phase end to end at tiny shapes
    python bench/credit/credit_matched.py --report                               # the results' tables, as bench/credit/credit.md's

Worlds (tasks/demo.py's K pets per post, the answer one sentence per pet): K = 1 at the demo's recipe (a base model
pretrained 250 steps, an SFT start of 100 steps), and K = 4 at m times both, m the first of --ladder whose start makes
as many mistakes per sentence as K = 1's (the one number the choice reads). Start A is seed 0, start B the same
recipe at seed 1. Every model is built and trained on one thread (credit.one_thread): the same bytes on any machine
of this kind; each start's checksum (credit.start_checksum) names the folder its runs live in, so runs of two starts
never mix.

Phases (--stop-after ends after one):
 0. calibrate  each start sampled at T = 1 on --calib-posts training prompts (04): mistakes per sentence and per
               answer, facts stated, the imperfect rate, length.
 1. grid       at K = 4, start A: ARMS x --lrs x --kl-coefs x --grid-seeds selection seeds (1..N), --steps each.
 2. select     per arm, the setting with the fewest median steps to a smoothed training imperfect rate <= 0.15
               (03's exact/imperfect_rate: answers that miss a fact or make a mistake); ties: the lower final rate.
 3. confirm    --confirm-seeds fresh seeds of each chosen setting, the first half on start A, the rest on start B; each
               policy judged by 04 on --eval-posts held-out posts; every per-token arm against fair_scalar.
 4. k1         K = 1 on its one-thread start: fair_scalar's grid (--k1-lrs), then --k1-seeds seeds of fair_scalar,
               span and poor_scalar (span and poor_scalar at bench/credit/credit_selection.json's settings).
Every arm's rewards are divided by K (credit_arms.per_pet; the same at K = 1), and K's grid is one step below K = 1's
(bench/credit/credit.md, amendments 1 and 2: the probes that showed why).
Writes OUT/results.json, bench/credit/credit_matched_results.json (every table's numbers, per seed) and
bench/credit/credit_matched_per_post.json (each judged policy's outcome per held-out post), prints the tables.
"""

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its own study: bench/credit
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
import credit  # noqa: E402
from credit import PLUGIN, execute, one_thread, per_post_path, plan, start_checksum  # noqa: E402
from cached_runs import evaluate, generations, sequence_kl  # noqa: E402
from run_cache import check_settings  # noqa: E402
from demo_start import ROOT, WINDOW, run, steps_to_threshold  # noqa: E402

import common  # noqa: E402
from infra.tiny_model import build_demo_base  # noqa: E402
from tasks.demo import demo_dataset, demo_facts, demo_mistakes  # noqa: E402

THRESHOLD = 0.15  # of the smoothed training imperfect rate (the primary endpoint)
ENDPOINT = "exact/imperfect_rate"
# every arm's rewards divided by K (credit_arms.per_pet; bench/credit/credit.md, amendment 1): the same at K = 1
ARMS = {
    "fair_scalar": ["--critic", PLUGIN + "fair_scalar_per_pet"],  # facts stated - mistakes, at EOS: the reference
    "poor_scalar": ["--critic", PLUGIN + "poor_only_per_pet", "--reward-mode", "scalar"],  # the best mistake-only
    "span": ["--critic", PLUGIN + "span_per_pet"],  # the paper's delta
    "poor_span": ["--critic", PLUGIN + "poor_only_per_pet"],
    "poor_facts": ["--critic", PLUGIN + "poor_facts_per_pet"],  # poor_span + the facts stated at EOS
    "clause": ["--critic", PLUGIN + "clause_scores_per_pet"],
}  # a perfect PRM
REFERENCE, PER_TOKEN = "fair_scalar", ("span", "poor_span", "poor_facts", "clause")
PHASES = ("calibrate", "grid", "select", "confirm", "k1")
# reported without correction (bench/credit/credit.md): arm - fair_scalar, per seed, with the two-level interval
UNCORRECTED = (
    *("heldout_mistakes", "heldout_facts", "heldout_length", "heldout_kl"),
    *("train_kl", "final", "final_mistake_rate", "mistake_steps"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4, help="pets per post of the matched world")
    p.add_argument("--ladder", nargs="+", type=int, default=[1, 2, 4, 8], help="step multiples m tried for K")
    p.add_argument("--pretrain-steps", type=int, default=250, help="K = 1's base model steps (demo's recipe)")
    p.add_argument("--sft-steps", type=int, default=100, help="K = 1's SFT steps (03's demo preset)")
    p.add_argument("--n-texts", type=int, default=3000, help="posts the base model is pretrained on")
    p.add_argument("--calib-posts", type=int, default=512, help="training prompts each start is sampled on")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="the arms to run")
    p.add_argument("--lrs", nargs="+", type=float, default=[2.5e-4, 5e-4, 1e-3], help="K's grid's learning rates")
    p.add_argument("--k1-lrs", nargs="+", type=float, default=[5e-4, 1e-3, 2e-3], help="K = 1's learning rates")
    p.add_argument("--kl-coefs", nargs="+", type=float, default=[0.05, 0.2], help="the grid's KL coefficients")
    p.add_argument("--grid-seeds", type=int, default=2, help="selection seeds per grid cell (seeds 1..N)")
    p.add_argument("--confirm-seeds", type=int, default=10, help="fresh seeds per arm (101..100+N; half on start B)")
    p.add_argument("--k1-seeds", type=int, default=5, help="seeds per arm at K = 1 (101..100+N)")
    p.add_argument("--steps", type=int, default=150, help="PPO iterations per run")
    p.add_argument("--eval-posts", type=int, default=1000, help="held-out posts each confirmed policy is judged on")
    p.add_argument("--jobs", type=int, default=1, help="runs and judges side by side (one a core; logs: OUT/logs)")
    p.add_argument("--stop-after", choices=PHASES, default="k1", help="the last phase to run")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap intervals")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a test (every phase, minutes)")
    p.add_argument("--out", default="bench/out/credit_matched", help="work dir (worlds, runs, evaluations)")
    p.add_argument(
        "--results", default="bench/credit/credit_matched_results.json", help="the committed summary ('': none)"
    )
    p.add_argument("--report", action="store_true", help="print --results' tables as markdown and exit")
    p.add_argument("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for every run")
    args = p.parse_args(argv)
    if args.tiny:  # every phase, nothing of the numbers
        args.ladder, args.pretrain_steps, args.sft_steps, args.n_texts, args.calib_posts = [1, 2], 4, 2, 40, 8
        args.lrs, args.kl_coefs, args.grid_seeds, args.confirm_seeds, args.k1_seeds = [1e-3], [0.05], 1, 2, 1
        args.k1_lrs, args.steps, args.eval_posts, args.k = [1e-3], 2, 8, 2
        args.ppo_args = ["--batch-size", "4", "--num-minibatches", "2", "--ppo-epochs", "1", *args.ppo_args]
    return args


# --- the worlds: a base model and an SFT start per (K, m, seed), each on one thread


def pet_flags(pets: int) -> list[str]:
    return credit.pet_flags(pets)


def build_world(out: Path, pets: int, m: int, seed: int, args) -> dict:
    """The base model (m x --pretrain-steps) and the SFT start (m x --sft-steps) of one world, built once in
    OUT/k<K>_m<m>_s<seed> (run_cache: refused if that folder was made otherwise). Returns {"dir", "sft", "flags" (03's
    for every run from it), "checksum"}."""
    world = out / f"k{pets}_m{m}_s{seed}"
    recipe = {"pets": pets, "pretrain_steps": m * args.pretrain_steps, "n_texts": args.n_texts, "seed": seed}
    check_settings(world / "base", recipe)
    if not (world / "base" / "config.json").is_file():
        build_demo_base(
            world / "base", pretrain_steps=recipe["pretrain_steps"], n_texts=args.n_texts, seed=seed, pets=pets
        )
    common.write_jsonl(world / "prompts.jsonl", demo_dataset("train", 1000, pets=pets))
    common.write_jsonl(world / "sft.jsonl", demo_dataset("sft", 2000, pets=pets))
    extra = ["--trace-samples", "0", *pet_flags(pets), *args.ppo_args]
    sft = [
        "03_train_policy.py",
        "--model",
        str(world / "base"),
        "--sft-data",
        str(world / "sft.jsonl"),
        "--sft-output-dir",
        str(world / "sft"),
        "--sft-steps",
        str(m * args.sft_steps),
        "--seed",
        str(seed),
        "--critic",
        "program",
        "--prompts",
        str(world / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        *extra,
        "--steps",
        "0",
        "--output-dir",
        str(world / "sft_only"),
    ]
    check_settings(world / "sft", {"argv": sft})
    if not (world / "sft" / "config.json").is_file():
        run([*sft, "--overwrite"])
    flags = [
        "--model",
        str(world / "sft"),
        "--sft-steps",
        "0",
        "--prompts",
        str(world / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        *extra,
    ]
    return {"dir": world, "sft": world / "sft", "flags": flags, "checksum": start_checksum(world)}


def answer_scores(prompt: str, response: str, pets: int) -> dict:
    """One answer by the exact critic: mistakes (flagged intervals), facts stated of the post's, imperfect (a fact
    missed or a mistake made)."""
    mistakes, (stated, facts) = demo_mistakes(prompt, response), demo_facts(prompt, response)
    return {"mistakes": mistakes, "facts": stated / facts, "imperfect": float(mistakes > 0 or stated < facts)}


def judged(gens_path: Path, records: list[dict], pets: int) -> dict:
    """04's cached answers to `records`, scored: per post lists of mistakes, facts, imperfect and length (tokens)."""
    rows = [
        {**answer_scores(r["prompt"], g["response"], pets), "length": len(g["response_ids"])}
        for r, g in zip(records, generations(gens_path, records))
    ]
    return {k: [row[k] for row in rows] for k in ("mistakes", "facts", "imperfect", "length")}


def difficulty(out: Path, world: dict, pets: int, args) -> dict:
    """A start's difficulty at iteration 0: its answers to the first --calib-posts training prompts, sampled by 04 at
    T = 1 as the first PPO iteration samples them: means of judged()'s columns, and mistakes per sentence (/ K)."""
    records = common.read_jsonl(world["dir"] / "prompts.jsonl")[: args.calib_posts]
    data = world["dir"] / f"calib{len(records)}.jsonl"
    common.write_jsonl(data, records)
    ev = evaluate(out / "calib", {"sft": str(world["sft"])}, data, pet_flags(pets))
    cols = judged(ev["dir"] / "eval" / "sft.generations.jsonl", records, pets)
    row = {k: statistics.fmean(v) for k, v in cols.items()}
    return {**row, "mistakes_per_sentence": row["mistakes"] / pets, "checksum": world["checksum"]}


def calibrate(out: Path, args) -> dict:
    """Phase 0: K = 1's start, then K's up the ladder until its mistakes per sentence are at most K = 1's; m is that
    step or the one before it, whichever is closer to K = 1's (the last one tried if none gets there); start B at
    that m. Returns {"k1": difficulty, "kK": {m: difficulty}, "m", "start_B": difficulty, "worlds"}."""
    k1 = build_world(out, 1, 1, 0, args)
    cal, ladder = {"k1": difficulty(out, k1, 1, args)}, {}
    target = cal["k1"]["mistakes_per_sentence"]
    for m in args.ladder:
        ladder[m] = build_world(out, args.k, m, 0, args)
        cal.setdefault(f"k{args.k}", {})[m] = difficulty(out, ladder[m], args.k, args)
        print(
            f"K={args.k} m={m}: {cal[f'k{args.k}'][m]['mistakes_per_sentence']:.3f} mistakes per sentence "
            f"(K=1: {target:.3f})",
            flush=True,
        )
        if cal[f"k{args.k}"][m]["mistakes_per_sentence"] <= target:
            break
    cal["m"] = min(list(ladder)[-2:], key=lambda m: abs(cal[f"k{args.k}"][m]["mistakes_per_sentence"] - target))
    starts = {"A": ladder[cal["m"]], "B": build_world(out, args.k, cal["m"], 1, args)}
    cal["start_B"] = difficulty(out, starts["B"], args.k, args)
    return {**cal, "worlds": {"k1": k1, **starts}}


# --- the runs and their numbers


def runs_of(out: Path, world: dict, phase: str, cells: dict, args, steps: int) -> dict:
    """{key: run_dir} for cells {key: (arm, lr, kl, seed)} from `world`'s start, `steps` iterations each, run where
    not finished. A start's runs live under its checksum: a rebuilt start (other bytes) never reuses them."""
    folder = out / "runs" / world["checksum"][:16] / phase
    planned = plan(
        folder,
        {
            key: (
                f"{arm}_lr{lr:g}_kl{kl:g}",
                seed,
                [*world["flags"], *ARMS[arm], "--lr", f"{lr:g}", "--kl-coef", f"{kl:g}"],
            )
            for key, (arm, lr, kl, seed) in cells.items()
        },
        steps,
    )
    execute(planned, args, out / "logs")
    return {key: run_dir for key, (run_dir, _) in planned.items()}


def curve(run_dir: Path, steps: int) -> dict:
    """A run's training numbers: steps to a smoothed imperfect rate <= THRESHOLD (its length when never reached), the
    final smoothed rates (imperfect, mistake), mistakes, facts, length and KL over the last WINDOW iterations."""
    rows = common.read_jsonl(run_dir / "metrics.jsonl")[:steps]
    imperfect = [r[ENDPOINT] for r in rows]
    hit = steps_to_threshold(imperfect)  # demo_start's: the first smoothed value <= 0.15 (THRESHOLD)
    last = lambda k: statistics.fmean(r[k] for r in rows[-WINDOW:])  # noqa: E731
    return {
        "steps": hit or steps,
        "reached": hit is not None,
        "final": last(ENDPOINT),
        "final_mistake_rate": last("exact/mistake_rate"),
        "mistakes": last("exact/mistakes"),
        "facts": last("exact/facts_stated"),
        "length": last("response/length"),
        "train_kl": last("objective/kl"),
        "mistake_steps": steps_to_threshold([r["exact/mistake_rate"] for r in rows]) or steps,
        "imperfect_curve": imperfect,
    }


def select(grid: dict) -> dict:
    """{arm: {"lr", "kl_coef", "score": (median steps, mean final rate), "cells"}}: the lowest score per arm."""
    return credit.select(grid)


def judge(out: Path, name: str, policy: Path, world: dict, eval_data: Path, records: list[dict], pets: int) -> dict:
    """04 on the held-out posts (cached): judged()'s per-post columns and the sequence KL to the policy's SFT start."""
    ev = evaluate(out / "evals", {name: str(policy)}, eval_data, pet_flags(pets))
    gens, kl_file = ev["dir"] / "eval" / f"{name}.generations.jsonl", ev["dir"] / "kl.json"
    if not kl_file.is_file():
        common.write_json(kl_file, {"kl": sequence_kl(str(policy), str(world["sft"]), records, gens, 32 * pets)})
    return {**judged(gens, records, pets), "heldout_kl": json.loads(kl_file.read_text())["kl"]}


def eval_records(out: Path, world: dict, pets: int, n: int) -> tuple[Path, list[dict]]:
    records = demo_dataset("eval", n, pets=pets)
    path = out / f"eval_k{pets}_{n}.jsonl"
    common.write_jsonl(path, records)
    train = {r["prompt"] for r in common.read_jsonl(world["dir"] / "prompts.jsonl")}
    if any(r["prompt"] in train for r in records):
        sys.exit(f"{path}: a held-out post is also a training prompt")
    return path, records


# --- statistics: seeds nested in starts, a test per comparison, Holm over a family


def seed_draws(starts: list[str], rng, resamples: int = 10_000):
    """Two-level bootstrap draws of seed indices: the starts resampled, then the seeds within each drawn start."""
    groups = [np.flatnonzero(np.array(starts) == g) for g in dict.fromkeys(starts)]
    for _ in range(resamples):
        yield np.concatenate([rng.choice(groups[g], len(groups[g])) for g in rng.integers(0, len(groups), len(groups))])


def sign_flip_p(d) -> float:
    """Exact two-sided p-value of a paired sign-flip test on per-seed differences d (S,): the share of the 2^S sign
    assignments whose mean is at least as far from 0 as the observed one."""
    d = np.asarray(d, float)
    signs = np.array(np.meshgrid(*[[-1, 1]] * len(d))).reshape(len(d), -1).T  # (2^S, S)
    return float(np.mean(np.abs((signs * d).mean(1)) >= abs(d.mean()) - 1e-12))


def holm(pvalues: dict) -> dict:
    """Holm-adjusted p-values of a family {name: p}."""
    order, adjusted, running = sorted(pvalues, key=pvalues.get), {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[name]))
        adjusted[name] = running
    return adjusted


def interval(xs) -> list[float]:
    return [float(np.quantile(xs, 0.025)), float(np.quantile(xs, 0.975))]


def without_extreme(d) -> tuple[int, np.ndarray]:
    """(the index of the seed whose difference is farthest from the mean, a mask keeping the others)."""
    d = np.asarray(d, float)
    i = int(np.argmax(np.abs(d - d.mean())))
    return i, np.arange(len(d)) != i


def kept_mean(x: np.ndarray, keep: np.ndarray) -> float:
    """The mean of x over the kept seeds; NaN when none is left (one seed)."""
    return float(x[keep].mean()) if keep.any() else float("nan")


def compare(arm: dict, ref: dict, starts: list[str], rng, resamples: int = 10_000) -> dict:
    """arm against ref, seeds paired by number (so by start): the primary, mean steps arm / ref with a two-level
    interval and a sign-flip p on the per-seed step differences; the held-out imperfect rate difference (seeds within
    starts, then posts); each again without the seed of the most extreme difference; the per-seed values."""
    steps, ref_steps = np.array(arm["steps"], float), np.array(ref["steps"], float)
    draws = list(seed_draws(starts, rng, resamples))
    drop, keep = without_extreme(steps - ref_steps)
    out = {
        "steps_ratio": {
            "ratio": float(steps.mean() / ref_steps.mean()),
            "interval": interval([steps[s].mean() / ref_steps[s].mean() for s in draws]),
            "p": sign_flip_p(steps - ref_steps),
            "per_seed": [steps.tolist(), ref_steps.tolist()],
            "without_extreme": kept_mean(steps, keep) / kept_mean(ref_steps, keep),
            "extreme_seed": drop,
        }
    }
    differences = {k: np.array(arm[k], float) - np.array(ref[k], float) for k in UNCORRECTED if k in arm}
    out["uncorrected"] = {
        k: {"difference": float(d.mean()), "interval": interval([d[s].mean() for s in draws])}
        for k, d in differences.items()
    }
    if "imperfect" in arm:  # (S, P) 0/1 per held-out post
        diff = np.array(arm["imperfect"], float) - np.array(ref["imperfect"], float)
        per_seed = diff.mean(1)
        drop, keep = without_extreme(per_seed)
        posts = rng.integers(0, diff.shape[1], (resamples, diff.shape[1]))
        out["heldout_imperfect"] = {
            "difference": float(diff.mean()),
            "p": sign_flip_p(per_seed),
            "interval": interval([diff[s][:, p].mean() for s, p in zip(draws, posts)]),
            "per_seed": per_seed.tolist(),
            "without_extreme": kept_mean(per_seed, keep),
            "extreme_seed": drop,
        }
    return out


# --- the phases

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def digits(xs) -> str:
    """Small counts (0..35; larger ones written as 35) one character each: the per-post and per-iteration data the
    results commit, compact enough for the repository."""
    return "".join(DIGITS[min(int(round(x)), 35)] for x in xs)


def seed_table(runs: dict, curves: dict, judged_runs: dict, arm: str, seeds) -> dict:
    """One arm's row: per seed, the training numbers (curve) and, where judged, the held-out means; the per-post 0/1
    imperfect matrix under "imperfect" (for compare; the results keep it as per-post bits)."""
    row = {
        k: [curves[arm, s][k] for s in seeds]
        for k in (
            "steps",
            "reached",
            "final",
            "final_mistake_rate",
            "mistake_steps",
            "mistakes",
            "facts",
            "length",
            "train_kl",
        )
    }
    if judged_runs:
        js = [judged_runs[arm, s] for s in seeds]
        row.update(
            {f"heldout_{k}": [statistics.fmean(j[k]) for j in js] for k in ("imperfect", "mistakes", "facts", "length")}
        )
        row["heldout_kl"] = [j["heldout_kl"] for j in js]
        row["imperfect"] = [j["imperfect"] for j in js]
    return row


def run_phase(
    out: Path, worlds: dict, phase: str, chosen: dict, seeds_of: dict, pets: int, steps: int, args, result: dict, rng
) -> dict:
    """Runs each arm's chosen setting on its seeds (seeds_of: {start name: seeds}), judges every policy and the SFT
    starts on --eval-posts held-out posts, compares every arm with fair_scalar. Returns {arm: row} + comparisons."""
    runs, start_of = {}, {s: name for name, seeds in seeds_of.items() for s in seeds}
    for name, seeds in seeds_of.items():
        cells = {(arm, s): (arm, c["lr"], c["kl_coef"], s) for arm, c in chosen.items() for s in seeds}
        runs.update(runs_of(out, worlds[name], phase, cells, args, steps))
    seeds = sorted(start_of)
    eval_data, records = eval_records(out, worlds[next(iter(seeds_of))], pets, args.eval_posts)
    curves = {key: curve(d, steps) for key, d in runs.items()}
    # every policy and each start's SFT model judged, --jobs at a time (04 and the KL: one thread each, so the
    # same bytes in any order)
    judges = {(arm, s): (f"{phase}_{arm}_s{s}", d / "policy", worlds[start_of[s]]) for (arm, s), d in runs.items()}
    judges.update({("sft", name): (f"{phase}_sft_{name}", worlds[name]["sft"], worlds[name]) for name in seeds_of})
    with ThreadPoolExecutor(args.jobs) as pool:
        done = pool.map(lambda j: judge(out, *j, eval_data, records, pets), judges.values())
        judged = dict(zip(judges, done))
    judged_runs = {key: judged[key] for key in runs}
    table = {
        "sft": {
            name: {k: (statistics.fmean(v) if isinstance(v, list) else v) for k, v in judged["sft", name].items()}
            for name in seeds_of
        },
        "seeds": seeds,
        "starts": [start_of[s] for s in seeds],
    }
    for arm in chosen:
        table[arm] = {
            "lr": chosen[arm]["lr"],
            "kl_coef": chosen[arm]["kl_coef"],
            **seed_table(runs, curves, judged_runs, arm, seeds),
        }
        pp = result.setdefault("per_post", {})
        for s, j in zip(seeds, (judged_runs[arm, s] for s in seeds)):
            pp[f"{phase}/{arm}/seed{s}"] = {
                "imperfect": digits(j["imperfect"]),
                "mistakes": digits(j["mistakes"]),
                "facts_stated": digits(round(f * 6 * pets) for f in j["facts"]),
            }
        result.setdefault("curves", {}).update(
            {f"{phase}/{arm}/seed{s}": digits(x * 32 for x in curves[arm, s]["imperfect_curve"]) for s in seeds}
        )
    if REFERENCE in chosen:
        table["versus_fair_scalar"] = {
            arm: compare(table[arm], table[REFERENCE], table["starts"], rng) for arm in chosen if arm != REFERENCE
        }
        family = [a for a in PER_TOKEN if a in chosen]
        for key in ("steps_ratio", "heldout_imperfect"):
            adjusted = holm({a: table["versus_fair_scalar"][a][key]["p"] for a in family})
            for a, p in adjusted.items():
                table["versus_fair_scalar"][a][key]["p_holm"] = p
    for arm in chosen:
        table[arm].pop("imperfect", None)
    return table


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        return print(markdown(json.loads((ROOT / args.results).read_text())))
    one_thread()
    out, rng = Path(args.out), np.random.default_rng(args.bootstrap_seed)
    result = {
        "command": " ".join(["python", "bench/credit/credit_matched.py", *(argv or sys.argv[1:])]),
        "endpoint": ENDPOINT,
        "threshold": THRESHOLD,
        "window": WINDOW,
        "k": args.k,
    }

    # --- 0. calibrate: the worlds and their difficulty at iteration 0
    cal = calibrate(out, args)
    worlds = cal.pop("worlds")
    result.update(calibration=cal, starts={name: w["checksum"] for name, w in worlds.items()})
    print_calibration(cal, args)
    if args.stop_after == "calibrate":
        return finish(result, args)

    steps = args.steps
    result["steps"] = steps

    # --- 1. grid at K, start A
    cells = {
        (arm, lr, kl, s): (arm, lr, kl, s)
        for arm in args.arms
        for lr in args.lrs
        for kl in args.kl_coefs
        for s in range(1, args.grid_seeds + 1)
    }
    grid = {key: curve(d, steps) for key, d in runs_of(out, worlds["A"], "grid", cells, args, steps).items()}
    result["grid"] = {
        "/".join(map(str, key)): {k: c[k] for k in ("steps", "reached", "final")} for key, c in grid.items()
    }
    result["curves"] = {
        "grid/" + "/".join(map(str, key)): digits(x * 32 for x in c["imperfect_curve"]) for key, c in grid.items()
    }
    if args.stop_after == "grid":
        return finish(result, args)

    # --- 2. select, on the grid's training curves alone
    chosen = select(grid)
    result["selection"] = chosen
    print_selection(chosen)
    if args.stop_after == "select":
        return finish(result, args)

    # --- 3. confirm: fresh seeds, the first half on start A, the rest on start B, judged held out
    seeds = list(range(101, 101 + args.confirm_seeds))
    half = (len(seeds) + 1) // 2
    result["confirm"] = run_phase(
        out, worlds, "confirm", chosen, {"A": seeds[:half], "B": seeds[half:]}, args.k, steps, args, result, rng
    )
    print_phase("confirm", result["confirm"])
    if args.stop_after == "confirm":
        return finish(result, args)

    # --- 4. K = 1 on its one-thread start: fair_scalar tuned on the same grid, span and poor_scalar at phase 3's
    k1 = {"k1": worlds["k1"]}
    cells = {
        (REFERENCE, lr, kl, s): (REFERENCE, lr, kl, s)
        for lr in args.k1_lrs
        for kl in args.kl_coefs
        for s in range(1, args.grid_seeds + 1)
    }
    k1_grid = {key: curve(d, steps) for key, d in runs_of(out, k1["k1"], "k1_grid", cells, args, steps).items()}
    phase3 = json.loads((ROOT / "bench" / "credit" / "credit_selection.json").read_text())["selection"]
    k1_chosen = {
        **select(k1_grid),
        **{a: {k: phase3[a][k] for k in ("lr", "kl_coef")} for a in ("span", "poor_scalar")},
    }
    result["k1_selection"] = k1_chosen
    result["k1"] = run_phase(
        out, k1, "k1", k1_chosen, {"k1": list(range(101, 101 + args.k1_seeds))}, 1, steps, args, result, rng
    )
    print_phase("k1", result["k1"])
    return finish(result, args)


# --- printing and the record


def print_calibration(cal: dict, args) -> None:
    print("\ncalibration: each start sampled at T = 1 (04) on training prompts")
    rows = (
        [("K=1", cal["k1"])]
        + [(f"K={args.k} m={m}", d) for m, d in cal[f"k{args.k}"].items()]
        + [(f"K={args.k} m={cal['m']} start B", cal["start_B"])]
    )
    for name, d in rows:
        print(
            f"  {name:<20} mistakes/sentence {d['mistakes_per_sentence']:.3f}  per answer {d['mistakes']:.2f}  "
            f"facts {d['facts']:.3f}  imperfect {d['imperfect']:.3f}  length {d['length']:.1f}  "
            f"start {d['checksum'][:12]}"
        )
    print(f"  chosen: m = {cal['m']}")


def print_selection(chosen: dict) -> None:
    print(f"\nselection (training curves only; median steps to imperfect <= {THRESHOLD}, then the final rate)")
    for arm, c in chosen.items():
        print(
            f"  {arm:<12} lr {c['lr']:<7g} beta {c['kl_coef']:<5g} median steps {c['score'][0]:>6} "
            f"final {c['score'][1]:.3f}"
        )


def spread(xs, fmt="{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def print_phase(phase: str, table: dict) -> None:
    print(f"\n{phase}: median [min, max] over seeds {table['seeds']} (starts {''.join(table['starts'])})\n")
    print("\n".join(phase_markdown(table)))


def holm_text(row: dict) -> str:
    return f"{row['p_holm']:.3f}" if "p_holm" in row else "not in the family"


# --- the tables of bench/credit/credit.md, from the committed results (tests/bench/test_credit.py checks that they match)


def sci(x: float) -> str:
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def grid_markdown(selection: dict, steps: bool = False) -> list[str]:
    """A grid's mean final smoothed training imperfect rate per arm and cell (after its median steps to the threshold
    if `steps`), the chosen cell in bold; arms chosen without a grid are left out."""
    selection = {arm: sel for arm, sel in selection.items() if "cells" in sel}
    cells = [(c["lr"], c["kl_coef"]) for c in next(iter(selection.values()))["cells"]]
    lines = [
        "| arm | "
        + " | ".join(
            ("lr " if i == 0 else "") + f"{sci(lr)}, " + ("β " if i == 0 else "") + f"{kl:g}"
            for i, (lr, kl) in enumerate(cells)
        )
        + " |",
        "| --- " * (len(cells) + 1) + "|",
    ]
    text = lambda c: (f"{c['median_steps']:g} steps, " if steps else "") + f"{c['final']:.3f}"  # noqa: E731
    for arm, sel in selection.items():
        bold = lambda c, t: f"**{t}**" if (c["lr"], c["kl_coef"]) == (sel["lr"], sel["kl_coef"]) else t  # noqa: E731
        lines.append(f"| {arm} | " + " | ".join(bold(c, text(c)) for c in sel["cells"]) + " |")
    return lines


def phase_markdown(table: dict) -> list[str]:
    """A confirmed phase: each arm's numbers (median [min, max] over seeds), its comparison with fair_scalar (the
    registered families, Holm-adjusted, each without its most extreme seed), the uncorrected differences, and the
    per-seed values behind every interval."""
    arms = [a for a in table if isinstance(table[a], dict) and "steps" in table[a]]
    lines = [
        "| arm (lr, β) | reached | final training imperfect | held-out imperfect | mistakes / answer | facts stated"
        " | length | held-out KL |",
        "| --- " * 8 + "|",
    ]
    for name, sft in table["sft"].items():
        lines.append(
            f"| SFT start {name} | | | {sft['imperfect']:.3f} | {sft['mistakes']:.2f} | {sft['facts']:.3f} "
            f"| {sft['length']:.0f} | 0 |"
        )
    for arm in arms:
        r = table[arm]
        lines.append(
            f"| {arm} ({sci(r['lr'])}, {r['kl_coef']:g}) | {sum(r['reached'])}/{len(r['reached'])} | "
            f"{spread(r['final'])} | {spread(r['heldout_imperfect'])} | {spread(r['heldout_mistakes'], '{:.2f}')} | "
            f"{spread(r['heldout_facts'])} | {spread(r['heldout_length'], '{:.0f}')} | "
            f"{spread(r['heldout_kl'], '{:.2f}')} |"
        )
    vs = table.get("versus_fair_scalar", {})
    lines += [
        "",
        "| against fair_scalar | steps ratio [95%] | p (Holm) | without the extreme seed | held-out imperfect "
        "difference [95%] | p (Holm) | without the extreme seed |",
        "| --- " * 7 + "|",
    ]
    for arm, v in vs.items():
        st, h = v["steps_ratio"], v["heldout_imperfect"]
        lines.append(
            f"| {arm} | {st['ratio']:.2f} [{st['interval'][0]:.2f}, {st['interval'][1]:.2f}] | {st['p']:.3f} "
            f"({holm_text(st)}) | {st['without_extreme']:.2f} (seed {table['seeds'][st['extreme_seed']]}) | "
            f"{h['difference']:+.3f} [{h['interval'][0]:+.3f}, {h['interval'][1]:+.3f}] | {h['p']:.3f} "
            f"({holm_text(h)}) | {h['without_extreme']:+.3f} (seed {table['seeds'][h['extreme_seed']]}) |"
        )
    measures = list(next(iter(vs.values()), {}).get("uncorrected", {}))
    lines += ["", "| arm − fair_scalar, uncorrected | " + " | ".join(measures) + " |"]
    lines.append("| --- " * (len(measures) + 1) + "|")
    for arm, v in vs.items():
        u = v["uncorrected"]
        lines.append(
            f"| {arm} | "
            + " | ".join(
                f"{u[k]['difference']:+.3g} [{u[k]['interval'][0]:+.3g}, {u[k]['interval'][1]:+.3g}]" for k in measures
            )
            + " |"
        )
    seeds = table["seeds"]
    lines += ["", "| per seed | " + " | ".join(f"{s} ({start})" for s, start in zip(seeds, table["starts"])) + " |"]
    lines.append("| --- " * (len(seeds) + 1) + "|")
    for arm in arms:
        for key, fmt in (("final", "{:.3f}"), ("heldout_imperfect", "{:.3f}"), ("steps", "{:g}")):
            lines.append(f"| {arm} {key} | " + " | ".join(fmt.format(x) for x in table[arm][key]) + " |")
    for arm, v in vs.items():
        per_seed = v["heldout_imperfect"]["per_seed"]
        lines.append(f"| {arm} − fair_scalar held out | " + " | ".join(f"{x:+.3f}" for x in per_seed) + " |")
    return lines


def by_start_markdown(table: dict) -> list[str]:
    """Each arm's held-out means per start (added after the runs were seen: the starts sit on either side of the
    copying skill, bench/credit/credit.md)."""
    starts = list(dict.fromkeys(table["starts"]))
    mean = lambda xs, g: statistics.fmean(x for x, t in zip(xs, table["starts"]) if t == g)  # noqa: E731
    keys = (("heldout_imperfect", "imperfect", "{:.3f}"), ("heldout_mistakes", "mistakes", "{:.2f}"))
    keys += (("heldout_facts", "facts", "{:.3f}"), ("heldout_length", "length", "{:.0f}"))
    head = [f"{name} ({g})" for _, name, _ in keys for g in starts]
    lines = ["| held-out mean per start | " + " | ".join(head) + " |", "| --- " * (len(head) + 1) + "|"]
    for name, sft in table["sft"].items():
        cells = [fmt.format(sft[label]) if g == name else "" for _, label, fmt in keys for g in starts]
        lines.append(f"| SFT start {name} | " + " | ".join(cells) + " |")
    for arm in (a for a in table if isinstance(table[a], dict) and "heldout_imperfect" in table[a]):
        cells = [fmt.format(mean(table[arm][k], g)) for k, _, fmt in keys for g in starts]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    """bench/credit/credit.md's result tables, in its order: the grid, the confirmation and its means per start, then K = 1's
    grid and confirmation (each where `result` has it)."""
    parts = [grid_markdown(result["selection"])] if "selection" in result else []
    if "confirm" in result:
        parts += [phase_markdown(result["confirm"]), by_start_markdown(result["confirm"])]
    if "k1" in result:
        parts += [grid_markdown(result["k1_selection"], steps=True), phase_markdown(result["k1"])]
    return "\n\n".join("\n".join(p) for p in parts)


def finish(result: dict, args) -> dict:
    import torch
    import transformers

    result["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    per_post = result.pop("per_post", None)
    common.write_json(Path(args.out) / "results.json", {**result, "per_post": per_post})
    if args.results:
        common.write_json(ROOT / args.results, result)
        if per_post:
            common.write_json(ROOT / per_post_path(args.results), per_post)
    print(json.dumps({k: result[k] for k in ("starts", "selection") if k in result}, default=str))
    return result


if __name__ == "__main__":
    main()
