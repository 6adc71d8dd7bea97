"""Per-token credit, decided (issue 77): at K = 4, tuned alike, which way of turning the same critiques into gradients
learns best held out and fastest: span rewards, a fair scalar, or the critique as a self-teacher. The plan, committed
before any run of this study: bench/credit/credit_k4.md.

    nice -n 10 python bench/credit/credit_k4.py --jobs 2             # everything; cached: the same command continues it
    python bench/credit/credit_k4.py --stop-after starts --jobs 2    # phases 0-1: the reproducibility check and the starts
    python bench/credit/credit_k4.py --tiny --out /tmp/k4            # every phase end to end at tiny shapes (the tests')
    python bench/credit/credit_k4.py --report                        # the page's tables, from the committed results

Every process of the study runs on one thread and one CPU kernel path (pin_kernels: torch's AVX2 kernels, MKL's
COMPATIBLE branch, oneDNN at most AVX2), so a start and a run are the same bytes under any kernel path of one machine,
not across CPU vendors (bench/credit/credit_k4.md, plan v2: the runs start from the committed starts, each recording
its CPU). Phases (--stop-after ends after one):
 0. reproduce  start seed 0 and a 20-iteration span run built twice, by children started under two other kernel
               paths: the same bytes, or the study stops.
 1. starts     seeds 0, 1, ... (at most --max-start-seeds) built at the registered recipe (a base of m x 250 steps, an
               SFT start of m x 200 steps on answers and revision examples); a start counts when its iteration-0
               imperfect rate is <= --start-gate; the first --starts of them are the study's. Each one's self-teacher
               gate: 04 --reflect --reflect-critic program on --gate-posts held-out posts (the policy given the critique
               of its own answer) against its answers without it; self_distill runs when any start passes.
 2. grid       on the first start: every arm x --lrs x --kl-coefs, --grid-seeds seeds; chosen per arm by the final
               smoothed training imperfect rate, then its mean over the run; a choice at the grid's edge adds the next
               learning rate beyond it for every arm (--max-extensions rounds).
 3. confirm    --confirm-seeds fresh seeds (101, ...) of each arm's choice on every start, each policy judged by 04
               on --eval-posts held-out posts at T = 1; the registered comparisons (bench/credit/credit_k4.md).
Writes OUT/results.json, --results (every table's numbers, per seed and per iteration) and its _per_post.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its own study: bench/credit
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from credit import PLUGIN, execute, plan, start_checksum  # noqa: E402
from credit_matched import answer_scores, curve, digits, eval_records, holm, interval, judge, sign_flip_p  # noqa: E402
from credit_matched import difficulty, grid_markdown, spread, without_extreme  # noqa: E402
from cached_runs import evaluate, generations  # noqa: E402
from run_cache import check_settings  # noqa: E402
from demo_start import ROOT, run  # noqa: E402

import common  # noqa: E402
from baselines.reflection_data import revision_examples  # noqa: E402
from tasks.demo import demo_critic, demo_dataset  # noqa: E402

K = 4  # pets per post: four-sentence answers
PINNED = {  # one thread and one kernel path for every process of the study (pin_kernels)
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own kernels: the same instructions on any CPU with AVX2 and FMA
    "MKL_CBWR": "COMPATIBLE",  # MKL's one branch that is the same on Intel and AMD (its AVX2 branch is Intel's only)
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
ARMS = {  # every reward divided by K (credit_arms.per_pet) but self_distill's, whose delta is a log-ratio per token
    "fair_scalar": ["--critic", PLUGIN + "fair_scalar_per_pet"],  # facts stated - mistakes at EOS: the reference
    "poor_scalar": ["--critic", PLUGIN + "poor_only_per_pet", "--reward-mode", "scalar"],
    "span": ["--critic", PLUGIN + "span_per_pet"],  # the paper's delta
    "poor_span": ["--critic", PLUGIN + "poor_only_per_pet"],
    "poor_facts": ["--critic", PLUGIN + "poor_facts_per_pet"],
    "clause": ["--critic", PLUGIN + "clause_scores_per_pet"],
    "self_distill": ["--critic", "program", "--reward-mode", "self_distill", "--advantage", "token"],  # SDPO
}
REFERENCE = "fair_scalar"
FAMILY = [(a, REFERENCE) for a in ("span", "poor_span", "poor_facts", "clause", "self_distill")] + [
    ("span", "self_distill")
]  # the registered comparisons: each per-token arm and self_distill against the fair scalar; span against SDPO
MARGIN = 0.03  # the registered equivalence margin of both endpoints (imperfect rates)
PHASES = ("reproduce", "starts", "grid", "confirm")
MEASURES = ("heldout_mistakes", "heldout_facts", "heldout_length", "heldout_kl", "train_kl", "final")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--m", type=int, default=2, help="the recipe's step multiple (issue 65's calibration: m = 2 at K = 4)")
    a("--n-texts", type=int, default=3000, help="posts the base model is pretrained on")
    a("--starts", type=int, default=4, help="starts of the study (strata)")
    a("--max-start-seeds", type=int, default=12, help="seeds tried for them, in order")
    a("--start-gate", type=float, default=0.8, help="a start's iteration-0 imperfect rate must be at most this")
    a("--calib-posts", type=int, default=512, help="training prompts each start is sampled on at iteration 0")
    a("--gate-posts", type=int, default=256, help="held-out posts of the self-teacher gate")
    a("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="the arms")
    a("--self-distill", default="gate", choices=["gate", "always"], help="run self_distill as its gate says, or always")
    a("--lrs", nargs="+", type=float, default=[5e-4, 1e-3, 2e-3], help="the grid's learning rates")
    a("--kl-coefs", nargs="+", type=float, default=[0.05, 0.2], help="the grid's KL coefficients")
    a("--grid-seeds", type=int, default=1, help="selection seeds per grid cell (1..N)")
    a("--max-extensions", type=int, default=2, help="rounds of learning rates added beyond the grid's edge")
    a("--confirm-seeds", type=int, default=3, help="fresh seeds per arm and start (101..100+N)")
    a("--steps", type=int, default=150, help="PPO iterations per run (the budget)")
    a("--eval-posts", type=int, default=1000, help="held-out posts each confirmed policy is judged on")
    a("--jobs", type=int, default=1, help="processes side by side (one a core; logs: OUT/logs)")
    a("--stop-after", choices=PHASES, default="confirm", help="the last phase to run")
    a("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap intervals")
    a("--tiny", action="store_true", help="tiny shapes for a test (every phase, minutes)")
    a("--out", default="bench/out/credit_k4", help="work dir (starts, runs, evaluations)")
    a("--results", default="bench/credit/credit_k4_results.json", help="the committed summary ('': none)")
    a("--store", default="bench/credit/k4_store", help="committed copy of --out's finished work ('': none)")
    a("--save", action="store_true", help="copy --out's finished work into --store and exit (safe while it runs)")
    a("--report", action="store_true", help="print --results' tables as markdown and exit")
    a("--repro-child", action="store_true", help=argparse.SUPPRESS)  # phase 0's builder, in a process of its own
    a("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for every run")
    args = p.parse_args(argv)
    args.pretrain_steps, args.sft_steps, args.repro_steps = 250 * args.m, 200 * args.m, 20
    if args.tiny:  # every phase, nothing of the numbers
        args.pretrain_steps, args.sft_steps, args.repro_steps, args.n_texts = 4, 2, 2, 40
        args.calib_posts, args.gate_posts, args.eval_posts, args.steps, args.starts = 8, 8, 8, 2, 2
        args.lrs, args.kl_coefs, args.confirm_seeds, args.max_start_seeds = [1e-3], [0.05], 1, 4  # (tune: its own test)
        args.start_gate = 1.0  # (a tiny start makes nothing but mistakes)
        args.ppo_args = ["--batch-size", "4", "--num-minibatches", "2", "--ppo-epochs", "1", *args.ppo_args]
    return args


def pin_kernels(strict: bool = True) -> None:
    """PINNED in this process (before torch runs a kernel: its kernel path is fixed at the first) and every process it
    starts. strict: exit with one line if torch runs another path here (a CPU without AVX2, or torch already ran)."""
    import torch

    os.environ.update(PINNED)
    torch.set_num_threads(1)
    got = torch.backends.cpu.get_cpu_capability()
    if got != "AVX2" and strict:
        sys.exit(f"torch runs its {got} kernels here, not AVX2: the study's bytes would be another machine's")


# --- the starts


def build_start(out: Path, seed: int, args) -> dict:
    """One start in OUT/s<seed> (run_cache: refused if that folder was made otherwise): the base model (pretrained
    --pretrain-steps on K-pet posts) and the SFT start (--sft-steps on 2,000 answers, 55% with 1-2 mistakes, and
    2,000 revision examples: a draft with mistakes at 80%, its exact critique, the ideal answer; shuffled together).
    Returns {"dir", "sft", "flags" (03's for every run from it), "checksum"}."""
    world = out / f"s{seed}"
    recipe = {"pets": K, "pretrain_steps": args.pretrain_steps, "n_texts": args.n_texts, "seed": seed}
    check_settings(world / "base", recipe)
    if not (world / "base" / "config.json").is_file():  # in a child: its kernels are pinned from its first one
        code = "import sys; from infra.tiny_model import build_demo_base as b; b(sys.argv[1], *map(int, sys.argv[2:]))"
        run(["-c", code, str(world / "base"), *map(str, (args.pretrain_steps, args.n_texts, seed, K))])
    common.write_jsonl(world / "prompts.jsonl", demo_dataset("train", 1000, pets=K))
    drafts = [{**r, **demo_critic(r["prompt"], r["response"])} for r in demo_dataset("revise", 2000, 0.8, pets=K)]
    sft = demo_dataset("sft", 2000, pets=K) + revision_examples(drafts, flawed_only=False)
    random.Random("credit-k4-sft").shuffle(sft)
    common.write_jsonl(world / "sft.jsonl", sft)
    extra = ["--trace-samples", "0", "--max-new-tokens", str(32 * K), *args.ppo_args]
    argv = [
        *("03_train_policy.py", "--model", str(world / "base"), "--sft-data", str(world / "sft.jsonl")),
        *("--sft-output-dir", str(world / "sft"), "--sft-steps", str(args.sft_steps), "--seed", str(seed)),
        *("--critic", "program", "--prompts", str(world / "prompts.jsonl"), "--scalar-baseline-dir", ""),
        *(*extra, "--steps", "0", "--output-dir", str(world / "sft_only")),
    ]
    check_settings(world / "sft", {"argv": argv})
    if not (world / "sft" / "config.json").is_file():
        run([*argv, "--overwrite"])
    flags = ["--model", str(world / "sft"), "--sft-steps", "0", "--prompts", str(world / "prompts.jsonl")]
    flags += ["--scalar-baseline-dir", "", *extra]
    return {"dir": world, "sft": world / "sft", "flags": flags, "checksum": start_checksum(world)}


def paired(a, b, rng, resamples: int = 10_000) -> dict:
    """mean(a - b) over posts paired by index, with a 95% bootstrap interval over the posts."""
    d = np.asarray(a, float) - np.asarray(b, float)
    return {
        "difference": float(d.mean()),
        "interval": interval(d[rng.integers(0, len(d), (resamples, len(d)))].mean(1)),
    }


def teacher_gate(out: Path, world: dict, args, rng) -> dict:
    """The self-teacher gate of one start: on --gate-posts held-out posts, its answers at T = 1 and its revisions of
    them given the exact critique (04 --reflect --reflect-critic program: the teacher's context, sampled), and given
    an empty critique (the control, descriptive). Passes when the revisions make fewer mistakes per answer than the
    answers, the 95% interval of the paired difference below 0."""
    records = demo_dataset("gate", args.gate_posts, pets=K)
    train = {r["prompt"] for r in common.read_jsonl(world["dir"] / "prompts.jsonl")}
    if any(r["prompt"] in train for r in records):
        sys.exit("a gate post is also a training prompt")
    data = out / f"gate_k{K}_{len(records)}.jsonl"
    common.write_jsonl(data, records)
    rows = {}
    for critic in ("program", "none"):
        flags = ["--max-new-tokens", str(32 * K), "--reflect", "--reflect-critic", critic]
        ev = evaluate(out / "gate", {"sft": str(world["sft"])}, data, flags)
        for name in ("sft", "sft+reflect"):
            gens = generations(ev["dir"] / "eval" / f"{name}.generations.jsonl", records)
            rows[name if name == "sft" else f"reflect_{critic}"] = [
                answer_scores(r["prompt"], g["response"], K) for r, g in zip(records, gens)
            ]
    col = lambda name, k: [x[k] for x in rows[name]]  # noqa: E731
    out = {name: {k: statistics.fmean(col(name, k)) for k in ("mistakes", "imperfect", "facts")} for name in rows}
    for name in ("reflect_program", "reflect_none"):
        out[name]["vs_answers"] = {k: paired(col(name, k), col("sft", k), rng) for k in ("mistakes", "imperfect")}
    out["passes"] = out["reflect_program"]["vs_answers"]["mistakes"]["interval"][1] < 0
    return out


def choose_starts(out: Path, args, rng) -> dict:
    """Phase 1: seeds in order until --starts of them pass the start gate; each start's calibration and self-teacher
    gate. Returns {"tried": {seed: calibration}, "starts": {name: seed}, "gates": {name: gate}, "worlds"}."""
    tried, worlds, gates = {}, {}, {}
    for seed in range(args.max_start_seeds):
        world = build_start(out, seed, args)
        tried[seed] = difficulty(out, world, K, args)
        print(f"start seed {seed}: imperfect {tried[seed]['imperfect']:.3f} at iteration 0", flush=True)
        if tried[seed]["imperfect"] <= args.start_gate:
            name = "ABCDEFGHIJKL"[len(worlds)]
            worlds[name], gates[name] = world, teacher_gate(out, world, args, rng)
            print(f"  start {name}; self-teacher gate {'passed' if gates[name]['passes'] else 'failed'}", flush=True)
        if len(worlds) == args.starts:
            break
    if len(worlds) < args.starts:
        sys.exit(f"only {len(worlds)} of {args.max_start_seeds} seeds pass the start gate: the study stops there")
    return {"tried": tried, "starts": {n: int(w["dir"].name[1:]) for n, w in worlds.items()}, "gates": gates,
            "worlds": worlds}  # fmt: skip


# --- the runs


def runs_of(out: Path, world: dict, phase: str, cells: dict, args) -> dict:
    """{key: run_dir} for cells {key: (arm, lr, kl, seed)} from `world`'s start, --steps each, run where not finished
    (under the start's checksum: a rebuilt start never reuses them)."""
    folder = out / "runs" / world["checksum"][:16] / phase
    flags = lambda arm, lr, kl: [*world["flags"], *ARMS[arm], "--lr", f"{lr:g}", "--kl-coef", f"{kl:g}"]  # noqa: E731
    runs = {key: (f"{arm}_lr{lr:g}_kl{kl:g}", seed, flags(arm, lr, kl)) for key, (arm, lr, kl, seed) in cells.items()}
    planned = {k: (d, None if kept(d, args.steps) else cmd) for k, (d, cmd) in plan(folder, runs, args.steps).items()}
    for run_dir, cmd in planned.values():  # plan v2: the CPU of each invocation (a run is its bytes again on it)
        if cmd:  # before it runs, so a session stopped mid-batch leaves its finished runs' CPU recorded
            made, resumes = run_dir / "machine.json", (run_dir / "checkpoint.pt").is_file()
            held = json.loads(made.read_text())["cpus"] if made.is_file() and resumes else []
            run_dir.mkdir(parents=True, exist_ok=True)
            common.write_json(made, {"cpus": [*held, machine()["cpu"]]})
    execute(planned, args, out / "logs")
    return {key: run_dir for key, (run_dir, _) in planned.items()}


def training(run_dir: Path, steps: int) -> dict:
    """credit_matched.curve's numbers and the primary's training twin, the mean imperfect rate over the run (auc)."""
    c = curve(run_dir, steps)
    return {**c, "auc": statistics.fmean(c["imperfect_curve"])}


def reproduce(out: Path, args) -> dict:
    """Phase 0: start seed 0 and `span` (lr 1e-3, beta 0.2, seed 1) for --repro-steps iterations, built by two children
    whose environments ask for other kernel paths (the native one, and torch's DEFAULT with MKL's AUTO); each pins
    its own. Their checksums (the start; the run's metrics but timings, and its policy) must be equal."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    outer = [{}, {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "ALL"}]

    def child(i):
        argv = [__file__, "--repro-child", "--out", str(out / "reproduce" / str(i)), *(["--tiny"] * args.tiny)]
        proc = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, env={**env, **outer[i]}, capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(f"phase 0, child {i}: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.splitlines()[-1])

    with ThreadPoolExecutor(min(args.jobs, 2)) as pool:
        got = list(pool.map(child, range(2)))
    result = {"outer_environments": outer, "children": got, "same": got[0] == got[1]}
    if not result["same"]:
        sys.exit(f"phase 0: the two kernel paths built other bytes: {got}")
    return result


def repro_child(args) -> None:
    """Phase 0's child: one start and one short run, printed as checksums (one JSON line)."""
    import hashlib

    out = Path(args.out)
    world = build_start(out, 0, args)
    args.steps = args.repro_steps
    run_dir = runs_of(out, world, "reproduce", {"r": ("span", 1e-3, 0.2, 1)}, args)["r"]
    rows = [
        {k: v for k, v in r.items() if not k.startswith("time/")} for r in common.read_jsonl(run_dir / "metrics.jsonl")
    ]
    weights = sorted(p for p in (run_dir / "policy").rglob("*") if p.suffix in (".safetensors", ".pt"))
    policy = hashlib.sha256(b"".join(f.read_bytes() for f in weights))  # (the configs name their folders)
    metrics = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    print(json.dumps({"start": world["checksum"], "metrics": metrics, "policy": policy.hexdigest(), "rows": len(rows)}))


def select(grid: dict) -> dict:
    """{arm: {"lr", "kl_coef", "score": (final, auc), "cells"}}: the lowest mean final smoothed training imperfect rate
    over a cell's seeds, then the lowest mean over the run."""
    chosen = {}
    for arm in dict.fromkeys(a for a, *_ in grid):
        cells = {}
        for (a, lr, kl, _), c in grid.items():
            if a == arm:
                cells.setdefault((lr, kl), []).append(c)
        scores = {k: tuple(statistics.fmean(c[m] for c in cs) for m in ("final", "auc")) for k, cs in cells.items()}
        (lr, kl), score = min(scores.items(), key=lambda kv: kv[1])
        cells = [{"lr": a, "kl_coef": b, "final": f, "auc": u} for (a, b), (f, u) in sorted(scores.items())]
        chosen[arm] = {"lr": lr, "kl_coef": kl, "score": list(score), "cells": cells}
    return chosen


def tune(out: Path, world: dict, arms: list[str], args) -> tuple[dict, dict, list]:
    """Phase 2: the grid, then up to --max-extensions rounds, each adding for every arm the learning rate beyond each
    edge of the grid that some arm's choice sits on (x2 above, /2 below). Returns (grid, selection, lrs)."""
    lrs = sorted(args.lrs)
    for extension in range(args.max_extensions + 1):
        cells = {(a, lr, kl, s): (a, lr, kl, s) for a in arms for lr in lrs for kl in args.kl_coefs
                 for s in range(1, args.grid_seeds + 1)}  # fmt: skip
        grid = {key: training(d, args.steps) for key, d in runs_of(out, world, "grid", cells, args).items()}
        chosen = select(grid)
        top, bottom = (any(c["lr"] == edge for c in chosen.values()) for edge in (lrs[-1], lrs[0]))
        if extension == args.max_extensions or not (top or bottom):
            break
        lrs = sorted([*([lrs[0] / 2] if bottom else []), *lrs, *([lrs[-1] * 2] if top else [])])
    return grid, chosen, lrs


# --- the store: finished work committed, so a session on a fresh machine continues where the last one stopped

# a run's resume state, files rebuilt each session, and phase 0 (it checks this machine: rebuilt on every one)
SKIP = ("checkpoint.pt", "logs", "report.html", "prompts.jsonl", "sft.jsonl", "reproduce")
REBUILT = ("calib", "gate_k", "eval_k")  # data files every session writes again (the same bytes)


def finished(run_dir: Path, steps: int) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and len(common.read_jsonl(run_dir / "metrics.jsonl")) >= steps


def kept(run_dir: Path, steps: int) -> bool:
    """A finished grid run saved without its policy (only its curves are read): policy.sha256 holds the weights'."""
    return (run_dir / "policy.sha256").is_file() and finished(run_dir, steps)


def save(out: Path, store: Path) -> int:
    """Copy out's finished work into store: the starts, the evaluations, every finished run (a grid run without its
    policy, which only its checksum stands for); never an unfinished run, a checkpoint or a file rebuilt each
    session. Each file is written to a temporary name and renamed. Returns how many files were copied."""
    import hashlib
    import shutil

    runs = {m.parent for pattern in ("metrics.jsonl", "machine.json") for m in out.rglob(pattern)}  # (or waiting)
    done = {
        d
        for d in runs
        if (d / "config.json").is_file() and finished(d, json.loads((d / "config.json").read_text())["steps"])
    }
    starts = [d for d in out.glob("s*") if d.name[1:].isdigit()]  # build_start's folders, s<seed>
    building = {d / m for d in starts for m in ("base", "sft") if not (d / m / "config.json").is_file()}
    copied = 0
    for f in sorted(out.rglob("*")):
        rel = f.relative_to(out)
        run = next((d for d in runs if d in f.parents), None)
        if not f.is_file() or any(p in SKIP for p in rel.parts) or rel.name.startswith(REBUILT) or run in runs - done:
            continue
        if building & set(f.parents) or rel.parts == ("results.json",):  # a start still training; the summary
            continue  # (each phase's end rewrites results.json)
        if run and run.parent.name == "grid" and "policy" in rel.relative_to(run.relative_to(out)).parts:
            continue  # a grid run's curves are all the study reads
        to = store / rel
        if not to.is_file() or to.read_bytes() != f.read_bytes():
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, to.with_name(to.name + ".tmp"))
            os.replace(to.with_name(to.name + ".tmp"), to)
            copied += 1
    for run in done:
        weights = sorted(p for p in (run / "policy").rglob("*.safetensors"))
        if run.parent.name == "grid" and weights:
            digest = hashlib.sha256(b"".join(w.read_bytes() for w in weights)).hexdigest()
            common.write_json(store / run.relative_to(out) / "policy.sha256", {"sha256": digest})
    return copied


def restore(store: Path, out: Path) -> None:
    """Copy into out each file of store that out lacks (what earlier sessions finished)."""
    import shutil

    for f in sorted(store.rglob("*")) if store.is_dir() else []:
        to = out / f.relative_to(store)
        if f.is_file() and not to.exists():
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, to)


# --- the comparisons: seeds within starts (strata), then posts


def stratified_draws(starts: list[str], rng, resamples: int = 10_000):
    """Bootstrap draws of seed indices: within each start its own seeds, with replacement; the starts are never
    resampled (they are strata, not a sample of two)."""
    groups = [np.flatnonzero(np.array(starts) == g) for g in dict.fromkeys(starts)]
    for _ in range(resamples):
        yield np.concatenate([rng.choice(g, len(g)) for g in groups])


def verdict(diff: float, lo: float, hi: float, p_holm: float | None) -> str:
    """The registered reading of arm - other (lower is better): better or worse when the Holm p is below 0.05 and the
    interval excludes 0, equivalent when the interval lies within the margin, else undecided."""
    if p_holm is not None and p_holm < 0.05 and (hi < 0 or lo > 0):
        return "better" if diff < 0 else "worse"
    return "equivalent" if -MARGIN < lo and hi < MARGIN else "undecided"


def compare(a: dict, b: dict, starts: list[str], rng, resamples: int = 10_000) -> dict:
    """a against b, seeds paired by number within each start: the held-out imperfect rate (per post, primary) and the
    mean training imperfect rate over the run (auc, secondary), each a mean difference with a 95% stratified interval
    (seeds, then posts), an exact sign-flip p on the per-seed differences, and again without the most extreme seed;
    the uncorrected measures with the same interval."""
    draws = list(stratified_draws(starts, rng, resamples))
    diff = np.array(a["imperfect"], float) - np.array(b["imperfect"], float)  # (S, P)
    posts = rng.integers(0, diff.shape[1], (resamples, diff.shape[1]))
    out = {"heldout_imperfect": {"interval": interval([diff[s][:, p].mean() for s, p in zip(draws, posts)])}}
    per_seed = {"heldout_imperfect": diff.mean(1), "auc": np.array(a["auc"]) - np.array(b["auc"])}
    out["auc"] = {"interval": interval([per_seed["auc"][s].mean() for s in draws])}
    for key, d in per_seed.items():
        drop, keep = without_extreme(d)
        out[key].update(difference=float(d.mean()), p=sign_flip_p(d), per_seed=d.tolist(), extreme_seed=drop,
                        without_extreme=float(d[keep].mean()) if keep.any() else float("nan"))  # fmt: skip
    out["uncorrected"] = {}
    for key in MEASURES:
        d = np.array(a[key], float) - np.array(b[key], float)
        out["uncorrected"][key] = {"difference": float(d.mean()), "interval": interval([d[s].mean() for s in draws])}
    return out


def confirm(out: Path, worlds: dict, chosen: dict, args, result: dict, rng) -> dict:
    """Phase 3: --confirm-seeds seeds of each chosen setting on every start, judged held out; the registered family,
    Holm-adjusted per endpoint, with each comparison's verdict."""
    seeds = list(range(101, 101 + args.confirm_seeds))
    runs = {}
    for name, world in worlds.items():
        cells = {(arm, name, s): (arm, c["lr"], c["kl_coef"], s) for arm, c in chosen.items() for s in seeds}
        runs.update(runs_of(out, world, "confirm", cells, args))
    eval_data, records = eval_records(out, next(iter(worlds.values())), K, args.eval_posts)
    judges = {key: (f"{key[0]}_{key[1]}_s{key[2]}", d / "policy", worlds[key[1]]) for key, d in runs.items()}
    judges.update({("sft", name, 0): (f"sft_{name}", w["sft"], w) for name, w in worlds.items()})
    with ThreadPoolExecutor(args.jobs) as pool:
        judged = dict(zip(judges, pool.map(lambda j: judge(out, *j, eval_data, records, K), judges.values())))
    order = [(name, s) for name in worlds for s in seeds]
    table = {"seeds": [s for _, s in order], "starts": [n for n, _ in order], "arms": {}, "sft": {}}
    for name in worlds:
        table["sft"][name] = {
            k: statistics.fmean(judged["sft", name, 0][k]) for k in ("imperfect", "mistakes", "facts")
        }
    for arm, c in chosen.items():
        curves = [training(runs[arm, n, s], args.steps) for n, s in order]
        js = [judged[arm, n, s] for n, s in order]
        row = {k: [x[k] for x in curves] for k in ("final", "auc", "train_kl", "length", "mistakes", "facts")}
        row.update({f"heldout_{k}": [statistics.fmean(j[k]) for j in js] for k in ("imperfect", "mistakes", "facts")})
        row.update(heldout_length=[statistics.fmean(j["length"]) for j in js], heldout_kl=[j["heldout_kl"] for j in js])
        row["cpu"] = [ran_on(runs[arm, n, s]) for n, s in order]
        table["arms"][arm] = {"lr": c["lr"], "kl_coef": c["kl_coef"], **row, "imperfect": [j["imperfect"] for j in js]}
        for (n, s), j, x in zip(order, js, curves):
            result.setdefault("per_post", {})[f"confirm/{arm}/{n}/seed{s}"] = {
                "imperfect": digits(j["imperfect"]), "mistakes": digits(j["mistakes"]),
                "facts_stated": digits(round(f * 6 * K) for f in j["facts"]),
            }  # fmt: skip
            result.setdefault("curves", {})[f"confirm/{arm}/{n}/seed{s}"] = digits(v * 32 for v in x["imperfect_curve"])
    table["comparisons"] = comparisons(table["arms"], table["starts"], rng)
    for arm in table["arms"].values():
        arm.pop("imperfect")
    return table


def comparisons(arms: dict, starts: list[str], rng) -> dict:
    """The registered family (FAMILY, of the arms that ran), each with its Holm p over the family and its verdict, per
    endpoint; then every other arm against fair_scalar (poor_scalar), outside the family: no Holm p, no verdict."""
    family = [(a, b) for a, b in FAMILY if a in arms and b in arms]
    outside = [(a, REFERENCE) for a in arms if a != REFERENCE and (a, REFERENCE) not in family]
    vs = {f"{a} - {b}": compare(arms[a], arms[b], starts, rng) for a, b in family + outside}
    for key in ("heldout_imperfect", "auc"):
        for name, p in holm({f"{a} - {b}": vs[f"{a} - {b}"][key]["p"] for a, b in family}).items():
            v = vs[name][key]
            v.update(p_holm=p, verdict=verdict(v["difference"], *v["interval"], p))
    return vs


# --- the phases


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        return print(markdown(json.loads((ROOT / args.results).read_text())))
    if args.save:
        return print(f"{save(Path(args.out), Path(args.store))} files saved to {args.store}")
    pin_kernels(strict=not args.tiny)  # tiny: a test's own process has run torch already
    if args.repro_child:
        return repro_child(args)
    out, rng = Path(args.out), np.random.default_rng(args.bootstrap_seed)
    committed = committed_results(args)  # earlier sessions' phases: kept until this one rewrites them
    command = " ".join(["python", "bench/credit/credit_k4.py", *(argv or sys.argv[1:])])
    result = {**committed, "command": command, "k": K, "margin": MARGIN, "machine": machine()}
    if args.store:  # what earlier sessions finished (plan v2: the committed starts, whatever CPU built them)
        restore(Path(args.store), out)
    result["reproduce"] = reproduce(out, args)
    result["machines"] = machines(committed, result)
    finish(result, args)  # each phase's end: the results so far written
    if args.stop_after == "reproduce":
        return result
    chosen_starts = choose_starts(out, args, rng)
    worlds = chosen_starts.pop("worlds")
    result["machines"][-1]["store"] = same_machine(out, result["reproduce"])
    checksums = committed_starts(committed, worlds)
    result.update(starts=chosen_starts, checksums=checksums)
    applicable = any(g["passes"] for g in chosen_starts["gates"].values()) or args.self_distill == "always"
    arms = [a for a in args.arms if a != "self_distill" or applicable]
    result["self_distill"] = "applicable" if applicable else "not applicable at this scale (no start passed its gate)"
    finish(result, args)  # each phase's end: the results so far written
    if args.stop_after == "starts":
        return result
    if "selection" in committed:  # plan v2: the committed grid's choices stand (its run folders were never stored)
        result.update({k: committed[k] for k in ("grid", "grid_curves", "selection", "lrs")})
    else:
        grid, chosen, lrs = tune(out, next(iter(worlds.values())), arms, args)
        result["grid"] = {"/".join(map(str, k)): {m: c[m] for m in ("final", "auc")} for k, c in grid.items()}
        result["grid_curves"] = {
            "/".join(map(str, k)): digits(v * 32 for v in c["imperfect_curve"]) for k, c in grid.items()
        }
        result.update(selection=chosen, lrs=lrs)
    chosen = {arm: result["selection"][arm] for arm in arms}
    finish(result, args)  # each phase's end: the results so far written
    if args.stop_after == "grid":
        return result
    result["confirm"] = confirm(out, worlds, chosen, args, result, rng)
    return finish(result, args)


def same_machine(out: Path, phase0: dict) -> bool:
    """Whether start seed 0, as restored from the store (built on another machine) or built here, is the bytes that
    phase 0's children built on this machine. (Plan v2: where it is not, this CPU builds other starts and runs; the
    runs still start from the committed starts, and each records its CPU.)"""
    return phase0["children"][0]["start"] == start_checksum(out / "s0")


def ran_on(run_dir: Path) -> str:
    """The CPU a run ran on, or its CPUs joined by " + " where it was resumed on another (plan v2: runs_of records
    each invocation's); "?" for a run made before the record."""
    made = run_dir / "machine.json"
    return " + ".join(dict.fromkeys(json.loads(made.read_text())["cpus"])) if made.is_file() else "?"


def committed_starts(committed: dict, worlds: dict) -> dict:
    """The starts' checksums {name: sha256}, which must be the committed results' (plan v2: every run, on any CPU,
    starts from the committed starts' bytes); exits with one line otherwise."""
    here = {n: w["checksum"] for n, w in worlds.items()}
    if committed.get("checksums", here) != here:
        sys.exit(f"the starts here are not the committed ones: {here} != {committed['checksums']}")
    return here


def committed_results(args) -> dict:
    """The committed results (--results), what earlier sessions' phases wrote; {} for none."""
    path = ROOT / args.results if args.results else None
    return json.loads(path.read_text()) if path and path.is_file() else {}


def machines(old: dict, result: dict) -> list[dict]:
    """Every machine phase 0 has passed on, oldest first: the committed results' list (or its one machine, before
    the list) and this one, each with its children's checksums; "store" is added once start seed 0 as restored
    from the store (another machine's bytes, where an earlier session ran elsewhere) is compared with them."""
    seen = old.get("machines") or ([{**old["machine"], **old["reproduce"]["children"][0]}] if "machine" in old else [])
    here = {**result["machine"], **result["reproduce"]["children"][0]}
    return [*(m for m in seen if (m["cpu"], m["kernels"]) != (here["cpu"], here["kernels"])), here]  # one row a CPU


def machine() -> dict:
    """This machine: its CPU, torch's kernel path, and the versions a run's bytes could depend on (a start's models
    record only transformers' and peft's)."""
    import platform
    from importlib.metadata import version

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    versions = {name: version(name) for name in ("transformers", "peft", "tokenizers", "numpy", "safetensors")}
    return {"cpu": cpu, "kernels": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "versions": versions, "pinned": PINNED}  # fmt: skip


def finish(result: dict, args) -> dict:
    """Write the results so far (each phase's end writes them: a later session's phases add to them)."""
    per_post, rest = result.get("per_post"), {k: v for k, v in result.items() if k != "per_post"}
    common.write_json(Path(args.out) / "results.json", result)
    if args.results:
        common.write_json(ROOT / args.results, rest)
        if per_post:
            common.write_json(ROOT / args.results.replace("_results.json", "_per_post.json"), per_post)
    print(json.dumps({k: result[k] for k in ("checksums", "self_distill", "selection") if k in result}, default=str))
    return result


def markdown(result: dict) -> str:
    """The page's tables from the committed results (filled in as the phases land)."""
    lines = []
    if "reproduce" in result:  # phase 0: each child's checksums, the environment its parent gave it, the machine
        m = result["machine"]
        lines += [f"Phase 0 on {m['cpu']} (torch {m['torch']}, pinned to {m['kernels']}):", ""]
        lines += ["| child asked for | start | metrics | policy | iterations |", "| --- | --- | --- | --- | --- |"]
        for env, c in zip(result["reproduce"]["outer_environments"], result["reproduce"]["children"]):
            asked = ", ".join(f"{k}={v}" for k, v in env.items()) or "the native path"
            lines.append(f"| {asked} | {c['start'][:16]} | {c['metrics'][:16]} | {c['policy'][:16]} | {c['rows']} |")
        lines += ["", f"The same bytes: **{'yes' if result['reproduce']['same'] else 'no'}**.", ""]
    if len(result.get("machines", [])) > 1:  # the same checksums on every machine phase 0 has passed on
        lines += ["| machine phase 0 passed on | kernels | torch | start | metrics | policy | the store's start |"]
        lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
        for i, m in enumerate(result["machines"]):
            held = (
                "built there"
                if i == 0
                else {True: "the same", False: "**other bytes**"}.get(m.get("store"), "(not checked)")
            )
            row = [m["cpu"], m["kernels"], m["torch"], m["start"][:16], m["metrics"][:16], m["policy"][:16], held]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    starts = result.get("starts", {})
    if not starts:
        return "\n".join(lines)
    lines.append("| start | seed | iteration-0 imperfect | self-teacher gate: mistakes, revisions − answers [95%] |")
    lines.append("| --- | --- | --- | --- |")
    for name, seed in starts.get("starts", {}).items():
        g = starts["gates"][name]["reflect_program"]["vs_answers"]["mistakes"]
        lines.append(
            f"| {name} | {seed} | {starts['tried'][str(seed)]['imperfect']:.3f} | {g['difference']:+.3f} "
            f"[{g['interval'][0]:+.3f}, {g['interval'][1]:+.3f}] |"
        )
    if "selection" in result:  # phase 2: every cell's final training imperfect rate, the chosen one in bold
        lines += ["", "Tuning on start A (selection seed 1, the budget's iterations): each cell's final training imperfect rate",
                  "(the mean of its last 10 iterations), the chosen cell in bold.", ""]  # fmt: skip
        lines += grid_markdown(result["selection"])
    if "confirm" in result:
        lines += ["", *confirm_markdown(result["confirm"])]
    return "\n".join(lines)


def confirm_markdown(table: dict) -> list[str]:
    """Phase 3: each arm's endpoints (mean over its seeds, then each start's mean), the registered family with its
    Holm p and verdict (and poor_scalar outside it), the uncorrected differences, and every per-seed value."""
    starts = list(dict.fromkeys(table["starts"]))
    by_start = lambda xs: [statistics.fmean(x for x, n in zip(xs, table["starts"]) if n == s) for s in starts]  # noqa: E731
    lines = ["| arm (lr, β) | held-out imperfect | " + " | ".join(f"start {s}" for s in starts)
             + " | AUC (training imperfect) | final training imperfect |", "| --- " * (len(starts) + 4) + "|"]  # fmt: skip
    sft = [table["sft"][s]["imperfect"] for s in starts]
    lines.append(f"| SFT start | {statistics.fmean(sft):.3f} | " + " | ".join(f"{x:.3f}" for x in sft) + " | | |")
    for arm, r in table["arms"].items():
        cells = [
            f"{statistics.fmean(r['heldout_imperfect']):.3f}",
            *(f"{x:.3f}" for x in by_start(r["heldout_imperfect"])),
        ]
        cells += [f"{statistics.fmean(r['auc']):.3f}", spread(r["final"])]
        lines.append(f"| {arm} ({r['lr']:g}, {r['kl_coef']:g}) | " + " | ".join(cells) + " |")
    seeds = [f"{n}/{s}" for n, s in zip(table["starts"], table["seeds"])]
    head = (
        "| comparison | endpoint | difference [95%] | sign-flip p | Holm p | verdict | without its most extreme seed |"
    )
    lines += ["", head, "| --- " * 7 + "|"]
    for name, v in table["comparisons"].items():
        for key, label in (("heldout_imperfect", "held-out imperfect"), ("auc", "AUC")):
            e = v[key]
            holm_p, word = (f"{e['p_holm']:.4f}", f"**{e['verdict']}**") if "p_holm" in e else ("outside", "")
            lines.append(
                f"| {name} | {label} | {e['difference']:+.3f} [{e['interval'][0]:+.3f}, {e['interval'][1]:+.3f}] | "
                f"{e['p']:.4f} | {holm_p} | {word} | {e['without_extreme']:+.3f} (without {seeds[e['extreme_seed']]}) |"
            )
    measures = list(next(iter(table["comparisons"].values()))["uncorrected"])
    lines += [
        "",
        "| uncorrected, difference [95%] | " + " | ".join(measures) + " |",
        "| --- " * (len(measures) + 1) + "|",
    ]
    for name, v in table["comparisons"].items():
        u = v["uncorrected"]
        fmt = lambda d: f"{d['difference']:+.3g} [{d['interval'][0]:+.3g}, {d['interval'][1]:+.3g}]"  # noqa: E731
        lines.append(f"| {name} | " + " | ".join(fmt(u[k]) for k in measures) + " |")
    lines += ["", "| per seed (start/seed) | " + " | ".join(seeds) + " |", "| --- " * (len(seeds) + 1) + "|"]
    for arm, r in table["arms"].items():
        for key in ("heldout_imperfect", "auc"):
            lines.append(f"| {arm} {key} | " + " | ".join(f"{x:.3f}" for x in r[key]) + " |")
    ran = [sorted({r["cpu"][i] for r in table["arms"].values() if "cpu" in r}) for i in range(len(seeds))]
    lines.append("| ran on (the CPU of each seed's runs) | " + " | ".join(" / ".join(c) for c in ran) + " |")
    for name, v in table["comparisons"].items():
        lines.append(
            f"| {name} held out | " + " | ".join(f"{x:+.3f}" for x in v["heldout_imperfect"]["per_seed"]) + " |"
        )
    return lines


if __name__ == "__main__":
    main()
