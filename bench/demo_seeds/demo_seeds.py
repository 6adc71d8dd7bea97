"""Does the zero-flag demo's gain hold on every run? The four-stage chain, 3 seeds x {1, 2} threads.

    python bench/demo_seeds/demo_seeds.py                        # 6 chains, ~5 min each on 2 CPU cores, one at a time
    python bench/demo_seeds/demo_seeds.py --seeds 1 --threads 1  # one chain

Each run is the zero-flag chain (`python 01_annotate.py && ... && python 04_evaluate.py`) in its own folder, with
`--seed S` given to every stage and OMP_NUM_THREADS=T. Nothing is selected by the exact critic: it only judges the
final policies (stage 4's demo/mistake_rate on 200 held-out posts, sampled at T = 1). The claims checked:
  - every run: Text2Grad's mistake rate <= 0.8 x the SFT start's;
  - the median run: Text2Grad's mistake rate < the scalar baseline's.
Prints a table (median and range over runs) with the package versions, and one JSON line last.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from chains import POLICIES, ROOT, packages, run_chain, summary_table, value  # noqa: E402

KEYS = {
    "demo/mistake_rate": "mistake rate (exact critic)",
    "demo/delta_sum": "delta-sum (exact critic)",
    "demo/exact_match": "exact match",
    "rougeL": "ROUGE-L",
    "rm/delta_sum": "delta-sum (reward model)",
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="OMP_NUM_THREADS values")
    p.add_argument("--out", default="bench/out/demo_seeds", help="one folder per run")
    args = p.parse_args()

    runs = {}
    for seed in range(1, args.seeds + 1):
        for threads in args.threads:
            runs[(seed, threads)] = run_chain(ROOT / args.out / f"seed{seed}_threads{threads}", seed, threads)

    print(
        f"\n{'seed':>4} {'thr':>3} "
        + " ".join(f"{p + ' mistakes':>18}" for p in POLICIES)
        + f" {'t2g/sft':>8} {'RM neg P/R':>11} {'chain s':>8}"
    )
    rows = []
    for (seed, threads), r in runs.items():
        m = {pol: value(r, pol, "demo/mistake_rate") for pol in POLICIES}
        ev = r["rm_eval"]
        wall = sum(r["timing"].values()) if r["timing"] else float("nan")
        rows.append(
            {
                "seed": seed,
                "threads": threads,
                **m,
                "ratio": m["text2grad"] / m["sft"],
                "rm_neg_precision": ev["neg_precision"],
                "rm_neg_recall": ev["neg_recall"],
                "rm_pos_precision": ev["pos_precision"],
                "rm_pos_recall": ev["pos_recall"],
                "rm_parse_rate": ev["parse_rate"],
                "chain_s": wall,
            }
        )
        print(
            f"{seed:>4} {threads:>3} "
            + " ".join(f"{m[p]:>18.3f}" for p in POLICIES)
            + f" {rows[-1]['ratio']:>8.2f} {ev['neg_precision'] or 0:>5.2f}/{ev['neg_recall'] or 0:<5.2f} {wall:>8.0f}"
        )
    summary = summary_table(list(runs.values()), KEYS)
    pkgs = packages()
    print("packages: " + ", ".join(f"{k} {v}" for k, v in pkgs.items()))
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    result = {
        "runs": len(rows),
        "every_run_t2g_le_0.8_sft": all(r["ratio"] <= 0.8 for r in rows),
        "worst_t2g_over_sft": max(r["ratio"] for r in rows),
        "median_t2g_below_scalar": med("text2grad") < med("scalar"),
        "median_mistakes": {p: med(p) for p in POLICIES},
        "rm_neg_precision_min": min(r["rm_neg_precision"] or 0 for r in rows),
        "rm_neg_recall_min": min(r["rm_neg_recall"] or 0 for r in rows),
        "chain_s_max": max(r["chain_s"] for r in rows),
        "packages": pkgs,
        "per_run": rows,
        "summary": summary,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
