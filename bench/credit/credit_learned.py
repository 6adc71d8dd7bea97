"""Issue 58, part 1: bench/credit/credit.py's question with learned critics. Each arm bench/credit/credit.py tuned on the exact
critic (bench/credit/credit_selection.json: its learning rate and beta) gets the SmolLM2 reward model of its form, all three
trained by bench/paper_baselines/paper_baselines.py's one recipe on one budget (--pairs preference pairs = 2x annotated answers of
the SFT policy, judged by the exact critic):

    Text2Grad              the span reward model's quotes, delta in {-1, 0, +1} (03 --critic local)      span's setting
    Text2Grad, poor only   the same critic, delta_t = min(delta_t, 0) (03 --labels poor)          poor_span's setting
    PRM-PPO                the process reward model's step rewards (03 --critic prm)                 clause's setting
    PPO (BT RM, unit std)  the Bradley-Terry score at EOS, unit std (03 --critic scalar-rm)   the best scalar arm's

    python bench/credit/credit_learned.py --stop-after data             # on a CPU: the SFT start and the budget (minutes)
    python bench/credit/credit_learned.py --stop-after train --jobs 16  # on a GPU (bench/speed/gpu_issue58.sh learned): the models
    python bench/credit/credit_learned.py                               # the table (04 on held-out posts; a CPU will do)

The start is bench/credit/credit.py's (OUT/k1, the same commands); --rm-base is a pretrained model (tools/smollm2.py).
Measured as bench/credit/credit.py's phase 3: steps to a smoothed training mistake rate <= 0.15 (the exact critic on the
rollouts, never trained on), the held-out mistake rate on --eval-posts posts (04 at T = 1), ROUGE-L, KL to the SFT
start; every arm against each scalar row (steps ratio over paired seeds, mistake difference over paired seeds and
posts, 95% bootstrap). Cached by the settings and content of what made each artefact, so a killed run resumes.
Writes OUT/results.json and --results (the numbers and each run's 0/1 mistake per held-out post).
"""

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its own study: bench/credit
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from credit import bits, curve, eval_records, med, paired_difference, start, step_ratio  # noqa: E402
from budget import budget, pool_annotations, reward_model, rm_flags, slug  # noqa: E402
from cached_runs import evaluate, post_mistakes, ppo, sequence_kl  # noqa: E402
from demo_start import ROOT, THRESHOLD, WINDOW, run_side_by_side  # noqa: E402

import common  # noqa: E402  (demo_start put the repository on sys.path)

ARMS = {  # row -> (bench/credit/credit.py's arm whose tuned setting it takes, its reward model, 03's critic flags)
    "Text2Grad": ("span", "span_rm", ["--critic", "local"]),
    "Text2Grad, poor only": ("poor_span", "span_rm", ["--critic", "local", "--labels", "poor"]),
    "PRM-PPO": ("clause", "prm", ["--critic", "prm"]),
    "PPO (BT RM, unit std)": ("best scalar", "bt_rm", ["--critic", "scalar-rm", "--score-norm", "mean-std"]),
}
SCALARS = ("PRM-PPO", "PPO (BT RM, unit std)")  # the references of every ratio and difference
PHASES = ("data", "train", "eval")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rm-base", default="runs/smollm2", help="the reward models' pretrained base (tools/smollm2.py)")
    p.add_argument("--rm-steps", type=int, default=0, help="02 --max-steps of each reward model (0: the recipe's 600)")
    p.add_argument("--rm-min-parse-rate", type=float, help="02 --min-parse-rate (tiny test settings: 0)")
    p.add_argument("--pool", type=int, default=4000, help="posts the SFT policy answers twice")
    p.add_argument("--pairs", type=int, default=1000, help="the budget: preference pairs (2x answers)")
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds per arm (101..100+N, as bench/credit/credit.py's phase 3)"
    )
    p.add_argument("--steps", type=int, default=60, help="PPO iterations per run")
    p.add_argument("--eval-posts", type=int, default=1000, help="held-out posts each policy is judged on")
    p.add_argument("--jobs", type=int, default=1, help="reward models, then runs, side by side (logs in OUT/logs)")
    p.add_argument(
        "--selection", default="bench/credit/credit_selection.json", help="bench/credit/credit.py's chosen settings"
    )
    p.add_argument("--stop-after", choices=PHASES, default="eval", help="the last phase to run")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap intervals")
    p.add_argument("--out", default="bench/out/credit_learned", help="work dir (start, budget, models, runs)")
    p.add_argument(
        "--results", default="bench/credit/credit_learned_results.json", help="the committed summary ('': none)"
    )
    p.add_argument("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for every run")
    return p.parse_args(argv)


def tuned(selection: dict) -> dict:
    """row -> (lr, beta) from bench/credit/credit.py's selection."""
    pick = lambda arm: selection["selection"][selection["best_scalar"] if arm == "best scalar" else arm]  # noqa: E731
    return {row: (pick(arm)["lr"], pick(arm)["kl_coef"]) for row, (arm, _, _) in ARMS.items()}


def main(argv=None):
    args = parse_args(argv)
    out, rng = Path(args.out), np.random.default_rng(args.bootstrap_seed)
    logs = out / "logs"
    flags = start(out, 1, args)  # bench/credit/credit.py's start: base, prompts, SFT (OUT/k1)
    world, sft = out / "k1", Path(flags[1])

    # --- data: the SFT policy's answers to the pool, judged by the exact critic; the first --pairs pairs
    data = budget(pool_annotations(out, sft, args.pool), args.pairs, out)
    print(f"budget: {data}", flush=True)
    if args.stop_after == "data":
        return None

    # --- train (where a GPU is): the three reward models side by side, then every arm x seed side by side. Its
    # record, OUT/runs.json, is what the eval phase reads: the runs, wherever they ran (their keys hash the reward
    # models' content, which need not travel back)
    settings, seeds = tuned(json.loads((ROOT / args.selection).read_text())), range(101, 101 + args.seeds)
    made_with = {
        "steps": args.steps,
        "seeds": args.seeds,
        "pool": args.pool,
        "pairs": args.pairs,
        "rm_steps": args.rm_steps,
        "rm_base": args.rm_base,
        "settings": settings,
        "ppo_args": args.ppo_args,
    }
    made = json.loads((out / "runs.json").read_text()) if (out / "runs.json").is_file() else {}
    if args.stop_after == "train" or made.get("made_with") != json.loads(json.dumps(made_with)):
        rms = {
            name: reward_model(out / "rms", name, f)
            for name, f in rm_flags(args, data, world / "sft.jsonl", world / "base").items()
        }
        run_side_by_side({name: cmd for name, (_, cmd) in rms.items() if cmd}, args.jobs, logs)
        runs = {
            (row, s): ppo(
                out / "runs",
                slug(row),
                s,
                args.steps,
                [
                    *flags,
                    *critic,
                    "--reward-model",
                    str(rms[rm][0]),
                    "--lr",
                    f"{settings[row][0]:g}",
                    "--kl-coef",
                    f"{settings[row][1]:g}",
                ],
            )
            for row, (_, rm, critic) in ARMS.items()
            for s in seeds
        }
        made = {
            "made_with": made_with,
            "runs": {f"{row}/{s}": str(d) for (row, s), (d, _) in runs.items()},
            "reward_models": {n: json.loads((d / "eval.json").read_text()) for n, (d, _) in rms.items()},
        }
        common.write_json(out / "runs.json", made)  # before the runs: a stopped one is found and resumed
        todo = {run_dir.name: cmd for run_dir, cmd in runs.values() if cmd}
        print(f"{len(todo)} of {len(runs)} runs to do", flush=True)
        run_side_by_side(todo, args.jobs, logs)
    if args.stop_after == "train":
        return None

    # --- eval (from OUT/runs.json: the runs the train phase made, wherever it ran): 04 on held-out posts, the
    # training curves, each arm against each scalar row
    dirs = {(row, s): Path(made["runs"][f"{row}/{s}"]) for row in ARMS for s in seeds}
    unfinished = [
        str(d)
        for d in dirs.values()
        if not (d / "policy").is_dir()
        or not (d / "metrics.jsonl").is_file()
        or len(common.read_jsonl(d / "metrics.jsonl")) < args.steps
    ]
    if unfinished:
        sys.exit(
            f"{out / 'runs.json'}: {len(unfinished)} runs unfinished (resume them: --stop-after train), "
            f"e.g. {unfinished[0]}"
        )
    eval_data, records = eval_records(out, 1, args.eval_posts)
    judged = judge(
        out,
        {"sft": str(sft), **{f"{slug(row)}_s{s}": str(d / "policy") for (row, s), d in dirs.items()}},
        sft,
        eval_data,
        records,
    )
    got = {key: {**curve(d, args.steps), **judged[f"{slug(key[0])}_s{key[1]}"]} for key, d in dirs.items()}
    sft_eval = judged["sft"]
    table = {"SFT": {k: sft_eval[k] for k in ("mistake_rate", "rougeL", "kl")}}
    for row in ARMS:
        rs = [got[row, s] for s in seeds]
        table[row] = {
            "lr": settings[row][0],
            "kl_coef": settings[row][1],
            "steps": [r["steps"] for r in rs],
            "reached": [r["reached"] for r in rs],
            "final_train": [r["final"] for r in rs],
            **{k: [r[k] for r in rs] for k in ("mistake_rate", "rougeL", "kl")},
            "step_s": statistics.median(r["step_s"] for r in rs),
            "versus": {
                ref: {
                    "steps": step_ratio([r["steps"] for r in rs], [got[ref, s]["steps"] for s in seeds], rng),
                    "mistakes": paired_difference(
                        [r["per_post"] for r in rs], [got[ref, s]["per_post"] for s in seeds], rng
                    ),
                }
                for ref in SCALARS
                if ref != row
            },
        }
    result = {
        "command": " ".join(["python", "bench/credit/credit_learned.py", *(argv or sys.argv[1:])]),
        "threshold": THRESHOLD,
        "window": WINDOW,
        "steps": args.steps,
        "pairs": args.pairs,
        "eval_posts": args.eval_posts,
        "table": table,
        "reward_models": made["reward_models"],
        "devices": {
            f"{row}/seed{s}": json.loads((d / "config.json").read_text()).get("device") for (row, s), d in dirs.items()
        },
        "eval_versions": {
            m.__name__: m.__version__ for m in map(importlib.import_module, ("torch", "transformers", "peft"))
        },
    }
    print_table(table, args.steps)
    per_post = {
        "sft": bits(sft_eval["per_post"]),
        **{f"{row}/seed{s}": bits(got[row, s]["per_post"]) for row in ARMS for s in seeds},
    }
    common.write_json(out / "results.json", {**result, "per_post": per_post})
    if args.results:
        common.write_json(ROOT / args.results, {**result, "per_post": per_post})
    return result


def judge(out: Path, policies: dict, sft: Path, eval_data: Path, records: list[dict]) -> dict:
    """bench/credit/credit.py's judge for every policy at once (one 04 process, each policy sampled with the same seed):
    {name: its held-out mistake rate, ROUGE-L, KL to the SFT start and 0/1 mistake per post}. Cached."""
    ev = evaluate(out / "evals", policies, eval_data)
    kl_file = ev["dir"] / "kl.json"
    kl = json.loads(kl_file.read_text()) if kl_file.is_file() else {}
    got = {}
    for name, policy in policies.items():
        gens = ev["dir"] / "eval" / f"{name}.generations.jsonl"
        if name not in kl:  # sum over tokens of log pi - log pi_SFT on pi's samples
            kl[name] = 0.0 if policy == str(sft) else sequence_kl(policy, str(sft), records, gens, 32)
            common.write_json(kl_file, kl)
        per_post = post_mistakes(gens, records)
        got[name] = {
            "mistake_rate": statistics.fmean(per_post),
            "rougeL": ev["table"][name]["rougeL"],
            "kl": kl[name],
            "per_post": per_post,
        }
    return got


def print_table(table: dict, steps: int) -> None:
    print(
        f"\nmedian [min, max] over seeds; steps to <= {THRESHOLD} (never: {steps}); against each scalar row: steps "
        f"ratio and held-out mistake difference [95%]"
    )
    sft = table["SFT"]
    print(f"{'SFT':<24}{'':>16}{sft['mistake_rate']:>24.3f}{sft['rougeL']:>9.3f}")
    for row, r in table.items():
        if row == "SFT":
            continue
        vs = "; ".join(
            f"{ref}: x{v['steps']['ratio']:.2f} [{v['steps']['interval'][0]:.2f}, "
            f"{v['steps']['interval'][1]:.2f}], {v['mistakes']['difference']:+.3f} "
            f"[{v['mistakes']['interval'][0]:+.3f}, {v['mistakes']['interval'][1]:+.3f}]"
            for ref, v in r["versus"].items()
        )
        print(
            f"{row:<24}{med(r['steps'], '{:g}'):>16}{med(r['mistake_rate']):>24}"
            f"{statistics.median(r['rougeL']):>9.3f}{statistics.median(r['kl']):>7.2f}{r['step_s']:>7.2f}  {vs}"
        )


if __name__ == "__main__":
    main()
