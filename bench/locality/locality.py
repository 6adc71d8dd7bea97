"""Where does the NL-gradient go? Per-token update locality, span vs scalar rewards (paper abstract, Sec. 1, Sec. 4.6)

    python bench/locality/locality.py --lams 0.95 0            # both critics, 3 seeds x states 0 20 40 60, ~40 min on 2 cores
    python bench/locality/locality.py --critics program --seeds 1 --iterations 0 10   # a quick look

The paper says span rewards make "precise, feedback-conditioned adjustments instead of global nudges". This measures
it. Take one state of a Text2Grad run of the demo: the SFT start (iteration 0) or its checkpoint after k iterations
(policy, value head, optimizer, beta, RNG). From two copies of it, 03_train_policy.py --resume runs the next iteration
once per --reward-mode. Both copies sample the same rollouts (the same RNG), get the same critique, delta, KL term
and values, and shuffle the same minibatches: only the advantages differ. 03's --trace-samples records, after each
update, Delta_t = log pi_new(y_t | x, y_<t) - log pi_old(y_t | x, y_<t) for every response token of the batch, and
sums it per token group (infra/locality.py), the groups read off the delta_t the update used:
    poor             inside a poor span (delta < 0)
    good             inside a good span (delta > 0)
    outside, flawed  outside every span, in an answer with a poor span
    outside, clean   outside every span, in an answer without one
The locality ratio is mean |Delta| in poor spans / mean |Delta| outside the spans of the same (flawed) answers: 1 is a
global nudge, large is an update aimed at the words the critic quoted.
Critics: the demo's exact program critic (program) and the reward model that stages 1-2 train at their zero-flag
settings (local), each with bench/span_vs_scalar/span_vs_scalar.py's settings and shared start. States: --iterations of the seed's
Text2Grad run. Reported over seeds x states: median [min, max]. Goals (issue 36): span mode's locality ratio >= 3x
scalar mode's; span mode's mean Delta inside poor spans < 0 in every state.
Prints the tables and one JSON line; writes OUT/results.json (after each critic: a later one that stops leaves the
earlier ones' measurements) and bench/locality/locality.png.
"""

import argparse
import importlib
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # bench/shared: what the benches share
from demo_start import shared_start  # noqa: E402

import common  # noqa: E402  (on the path from demo_start)

ppo = importlib.import_module("03_train_policy")
GROUPS = {
    "poor": "poor spans",
    "good": "good spans",
    "outside_flawed": "outside, flawed",
    "outside_clean": "outside, clean",
}
SAME = ("tokens", "delta", "kl", "values", "logprobs_old")  # what both modes' traced rollout must share


def train(flags: list[str]) -> None:
    """One 03_train_policy.py run, in this process (its train(), as the CLI runs it)."""
    ppo.train(ppo.parse_args(flags))


def states(flags: list[str], seed: int, iterations: list[int], run_dir: Path) -> dict[int, Path | None]:
    """The seed's Text2Grad run, checkpointed at each of `iterations` (kept as run_dir/checkpoint_<k>.pt; resumed
    bit-exactly between them, so it is one run). Returns {k: checkpoint}, None for k = 0 (the SFT start)."""
    out = {}
    for k in sorted(iterations):
        keep = run_dir / f"checkpoint_{k}.pt"
        if k > 0 and not keep.is_file():
            train(
                [
                    *flags,
                    "--seed",
                    str(seed),
                    "--output-dir",
                    str(run_dir),
                    "--steps",
                    str(k),
                    "--save-every",
                    str(k),
                    "--resume",
                ]
            )
            step = torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"]
            if step != k:
                sys.exit(f"{run_dir}/checkpoint.pt is at iteration {step}, not {k}: remove {run_dir} and rerun")
            shutil.copy(run_dir / "checkpoint.pt", keep)
        out[k] = keep if k > 0 else None
    return out


def check_same_batch(span: dict, scalar: dict) -> None:
    """The premise of the comparison: both updates saw the same rollouts, labels, KL, values and log-probs."""
    pairs = [(f"sample {key}", a[key], b[key]) for a, b in zip(span["samples"], scalar["samples"]) for key in SAME]
    pairs += [
        ("beta", span["kl_coef"], scalar["kl_coef"]),
        ("advantages", span["advantage_locality"], scalar["advantage_locality"]),
    ]
    pairs += [(f"{g} tokens", span["locality"][g]["tokens"], scalar["locality"][g]["tokens"]) for g in GROUPS]
    for what, a, b in pairs:
        if a != b:
            raise SystemExit(f"not the same batch in both modes ({what} differs): the comparison would be void")


def one_update(flags: list[str], seed: int, k: int, ckpt: Path | None, work: Path) -> dict[str, dict]:
    """Iteration k + 1 from state k, once per reward mode, each from its own copy of the checkpoint (none: a fresh
    start, the same in both); flags end with the update's own (--lam). Returns {mode: its trace.jsonl row}."""
    rows = {}
    for mode in ("span", "scalar"):
        run_dir = work / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        if ckpt:
            shutil.copy(ckpt, run_dir / "checkpoint.pt")
        train(
            [
                *flags,
                "--seed",
                str(seed),
                "--reward-mode",
                mode,
                "--output-dir",
                str(run_dir),
                "--steps",
                str(k + 1),
                "--resume",
                "--trace-samples",
                "1",
            ]
        )
        rows[mode] = common.read_jsonl(run_dir / "trace.jsonl")[-1]
        assert rows[mode]["step"] == k + 1 and rows[mode]["reward_mode"] == mode
    check_same_batch(rows["span"], rows["scalar"])
    return rows


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def summarize(measured: list[dict]) -> dict:
    """measured: [{"seed", "iteration", "span": locality, "scalar": locality, "advantages": {mode: locality}}] (03's
    locality_summary) -> per mode and token group, median [min, max] over the states of mean Delta, mean |Delta|, the
    share of tokens made less likely, and the advantages' mean; the locality ratios of Delta and of |A|; span's ratio /
    scalar's per state; the goals."""

    def over_states(get):
        return spread([v for v in map(get, measured) if v is not None])

    out = {"states": len(measured)}
    for mode in ("span", "scalar"):
        out[mode] = {
            g: {stat: over_states(lambda m: m[mode][g][stat]) for stat in ("mean", "mean_abs", "down")} for g in GROUPS
        }
        out[mode]["ratio"] = over_states(lambda m: m[mode]["ratio"])
        out[mode]["advantage"] = {
            g: {stat: over_states(lambda m: m["advantages"][mode][g][stat]) for stat in ("mean", "mean_abs", "down")}
            for g in GROUPS
        }
        out[mode]["advantage"]["ratio"] = over_states(lambda m: m["advantages"][mode]["ratio"])
    per_state = [
        m["span"]["ratio"] / m["scalar"]["ratio"] for m in measured if m["span"]["ratio"] and m["scalar"]["ratio"]
    ]
    out["span_over_scalar_ratio"] = spread(per_state)
    push = [m["span"]["poor"]["mean"] / m["scalar"]["poor"]["mean"] for m in measured if m["scalar"]["poor"]["mean"]]
    out["span_over_scalar_poor_mean"] = spread(push)  # how much harder span mode pushes the flagged tokens down
    out["scalar_poor_mean_positive_states"] = sum(
        m["scalar"]["poor"]["mean"] > 0 for m in measured if m["scalar"]["poor"]["mean"] is not None
    )
    poor = [m["span"]["poor"]["mean"] for m in measured if m["span"]["poor"]["mean"] is not None]
    out["goal_ratio_3x"] = bool(per_state) and statistics.median(per_state) >= 3
    out["goal_ratio_3x_every_state"] = bool(per_state) and min(per_state) >= 3
    out["goal_poor_mean_negative"] = bool(poor) and max(poor) < 0
    out["span_poor_mean_negative_states"] = f"{sum(x < 0 for x in poor)}/{len(poor)}"
    return out


def fmt(s: dict | None, f: str = "+.4f") -> str:
    return "-" if s is None else f"{s['median']:{f}} [{s['min']:{f}}, {s['max']:{f}}]"


def print_tables(critic: str, summary: dict, measured: list[dict]) -> None:
    print(
        f"\ncritic: {critic}; {summary['states']} states (seeds x iterations); median [min, max] over them\n"
        f"Delta = log pi_new - log pi_old per token; 'down': the share of the group's tokens made less likely"
    )
    for mode in ("span", "scalar"):
        print(f"\n{mode + ' rewards':<17}{'mean Δ':>30}{'mean |Δ|':>30}{'down':>24}{'mean A (advantage)':>30}")
        for g, label in GROUPS.items():
            s = summary[mode][g]
            print(
                f"{label:<17}{fmt(s['mean']):>30}{fmt(s['mean_abs']):>30}{fmt(s['down'], '.2f'):>24}"
                f"{fmt(summary[mode]['advantage'][g]['mean'], '+.3f'):>30}"
            )
        print(
            f"{'locality ratio':<17}{fmt(summary[mode]['ratio'], '.2f'):>60}{'':>24}"
            f"{fmt(summary[mode]['advantage']['ratio'], '.2f'):>30}  (of |A|)"
        )
    print(
        f"span's ratio / scalar's, per state: {fmt(summary['span_over_scalar_ratio'], '.2f')}; span's mean Δ in "
        f"poor spans / scalar's, per state: {fmt(summary['span_over_scalar_poor_mean'], '.2f')}; scalar's > 0 in "
        f"{summary['scalar_poor_mean_positive_states']} of {summary['states']} states"
    )
    print(
        f"goals: span ratio >= 3x scalar's (median state): {summary['goal_ratio_3x']}, in every state: "
        f"{summary['goal_ratio_3x_every_state']}; span mean Δ in poor spans < 0 in every state: "
        f"{summary['goal_poor_mean_negative']} ({summary['span_poor_mean_negative_states']})"
    )
    print(
        f"\n{'seed':>4}{'iteration':>10}{'poor tokens':>12}{'span ratio':>12}{'scalar ratio':>14}"
        f"{'span poor Δ':>13}{'scalar poor Δ':>15}"
    )
    for m in measured:
        r = [m[mode]["ratio"] for mode in ("span", "scalar")]
        p = [m[mode]["poor"]["mean"] for mode in ("span", "scalar")]
        cell = lambda v, f: "-" if v is None else f"{v:{f}}"  # noqa: E731
        print(
            f"{m['seed']:>4}{m['iteration']:>10}{m['span']['poor']['tokens']:>12}{cell(r[0], '.2f'):>12}"
            f"{cell(r[1], '.2f'):>14}{cell(p[0], '+.4f'):>13}{cell(p[1], '+.4f'):>15}"
        )


def plot(results: dict, png: str) -> None:
    """Mean |Delta| per token group, span vs scalar, one panel per critic and lambda (bars: median; whiskers: min-max
    over the states)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (f"{critic} critic, {setting}", s) for critic, by in results["critics"].items() for setting, s in by.items()
    ]
    cols = min(2, len(panels))
    fig, axes = plt.subplots(
        (len(panels) + cols - 1) // cols, cols, figsize=(5.6 * cols, 3.4 * len(panels) / cols), squeeze=False
    )
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    for ax, (title, s) in zip(axes.flat, panels):
        for j, (mode, color) in enumerate((("span", "#1a7f37"), ("scalar", "#cf222e"))):
            cells = [s[mode][g]["mean_abs"] for g in GROUPS]
            x = [i + (j - 0.5) * 0.38 for i in range(len(GROUPS))]
            med = [c["median"] if c else 0 for c in cells]
            err = [
                [m - c["min"] if c else 0 for m, c in zip(med, cells)],
                [c["max"] - m if c else 0 for m, c in zip(med, cells)],
            ]
            ratio = s[mode]["ratio"]
            ax.bar(
                x,
                med,
                0.38,
                yerr=err,
                color=color,
                alpha=0.85,
                capsize=3,
                label=f"{mode}: locality ratio {ratio['median']:.2f}" if ratio else mode,
            )
        ax.set_xticks(range(len(GROUPS)), list(GROUPS.values()), fontsize=9)
        ax.set_title(f"mean |log π_new − log π_old| per token ({title})", fontsize=9.5)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=9, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--critics",
        nargs="+",
        default=["program", "local"],
        choices=["program", "local"],
        help="program: the demo's exact critic; local: the stage-2 reward model (trained once in --out)",
    )
    p.add_argument("--reward-model", help="--critics local: this stage-2 reward model instead of the zero-flag one")
    p.add_argument("--seeds", type=int, default=3, help="seeds (one Text2Grad run each)")
    p.add_argument(
        "--iterations",
        type=int,
        nargs="+",
        default=[0, 20, 40, 60],
        help="states along each run: 0 = the SFT start, k = after k iterations",
    )
    p.add_argument("--out", default="bench/out/locality", help="work dir (base model, SFT, reward model, runs)")
    p.add_argument(
        "--lams",
        type=float,
        nargs="+",
        default=[0.95],
        help="GAE lambda of the measured update (the "
        "runs keep 03's 0.95):\n0.95 is 03's default; 0 makes A_t = r_t + V_{t+1} - V_t, one token's",
    )
    p.add_argument("--png", default="bench/locality/locality.png", help="the picture")
    p.add_argument(
        "--tables-only",
        action="store_true",
        help="print the tables and draw the picture from OUT/results.json, running nothing",
    )
    p.add_argument("ppo_args", nargs="*", help="extra 03_train_policy.py flags after --, for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    results = {"seeds": args.seeds, "iterations": args.iterations, "critics": {}}
    if args.tables_only:
        results = json.loads((out / "results.json").read_text())
    for critic in [] if args.tables_only else args.critics:
        flags = shared_start(out, critic, args.reward_model, max(args.iterations) + 1, args.ppo_args)
        flags = ["--model", str(out / "sft"), "--sft-steps", "0", *flags]
        measured = {f"lam {lam:g}": [] for lam in args.lams}
        for seed in range(1, args.seeds + 1):
            work = out / critic / f"seed{seed}"
            for k, ckpt in states(flags, seed, args.iterations, work / "run").items():
                for lam in args.lams:
                    rows = one_update([*flags, "--lam", str(lam)], seed, k, ckpt, work / f"from{k}_lam{lam:g}")
                    measured[f"lam {lam:g}"].append(
                        {
                            "seed": seed,
                            "iteration": k,
                            "advantages": rows["span"]["advantage_locality"],
                            **{m: r["locality"] for m, r in rows.items()},
                        }
                    )
        results["critics"][critic] = {}
        for setting, rows in measured.items():
            results["critics"][critic][setting] = {**summarize(rows), "measured": rows}
            print_tables(f"{critic}, measured update's GAE {setting}", results["critics"][critic][setting], rows)
        common.write_json(out / "results.json", results)  # now: a later critic that stops must not lose this one
    for critic, by in results["critics"].items() if args.tables_only else ():
        for setting, s in by.items():
            by[setting] = {**summarize(s["measured"]), "measured": s["measured"]}
            print_tables(f"{critic}, measured update's GAE {setting}", by[setting], s["measured"])
    common.write_json(out / "results.json", results)
    plot(results, args.png)
    brief = {
        c: {setting: {k: v for k, v in s.items() if k != "measured"} for setting, s in by.items()}
        for c, by in results["critics"].items()
    }
    print(json.dumps({**results, "critics": brief}))


if __name__ == "__main__":
    main()
