"""--curves, --report-samples: OUTPUT_DIR/report.html, the one self-contained page 04 writes, and its console table.

render_report draws, top to bottom: the metrics (grouped by prefix, METRICS' labels and directions; the best policy in
bold only where its 95% interval overlaps no other's, best_marks), the LLM judge's win/tie/loss, stage 3's training
curves (--curves: each run's metrics.jsonl, the learned critic's reward and mistake rate with the exact critic's
dashed beside them where a run logs it, the demo's; each title names what is drawn; the iterations where the critic
did not judge are marked, with no value drawn: plot_curves; the whole run's failed critiques under them:
training_counts, results.json's "training"), where stage 3's updates went token by token (its --trace-samples:
trace.jsonl beside each metrics.jsonl, render_update_section), and
sample answers (--report-samples of them, those where the policies differ most: pick_samples) with the critique's good
and poor spans highlighted at their character positions (highlight: the paper's Figure 2), the exact critic's verdict
under them where the task has one, and each --monitor critic's, its spans highlighted and its critique
(monitor_block). Everything is escaped; the plots are inline PNGs, so the page fetches nothing. print_table is the
same metrics on the console. A policy whose reward-model critiques mostly did not parse (results.json's critic_failed,
evaluation/__init__.py) has its critic's metrics shown "n/a (k of n critiques failed)", never as the 0.000 of delta = 0
(nor the best), with a warning on stderr and a banner at the top of the page (critic_banner).
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path

from evaluation import table4


def add_args(p) -> None:
    g = p.add_argument_group("the report (evaluation/report.py)")
    g.add_argument(
        "--curves",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="stage 3 metrics.jsonl to plot (repeatable; default: the demo's runs)",
    )
    g.add_argument("--report-samples", type=int, default=8, help="prompts shown with highlighted responses")


# ----------------------------------------------------------------------------------------------------------------------
# The metrics' labels, groups and order
# ----------------------------------------------------------------------------------------------------------------------

METRICS = {  # key -> (label in the report, direction: +1 higher is better, -1 lower is better, 0 neutral)
    "rouge1": ("ROUGE-1 F1", 1),
    "rouge2": ("ROUGE-2 F1", 1),
    "rougeL": ("ROUGE-L F1", 1),
    "bleu": ("BLEU", 1),
    "bertscore_f1": ("BERTScore F1", 1),
    "pass@1": ("pass@1", 1),
    "pass@10": ("pass@10", 1),
    "demo/delta_sum": ("delta-sum per response", 1),
    "demo/mistake_rate": ("mistake rate (≥ 1 poor span)", -1),
    "demo/facts_right": ("share of facts right", 1),
    "demo/exact_match": ("exact match with reference", 1),
    "rm/delta_sum": ("delta-sum per response", 1),
    "rm/delta_mean": ("mean delta per token", 1),
    "rm/poor_token_frac": ("share of tokens in poor spans", -1),
    "rm/good_token_frac": ("share of tokens in good spans", 1),
    "rm/parse_rate": ("critique parse rate", 1),
    "rm/unmatched_span_rate": ("unmatched-quote rate", -1),
    "rm_vs_critic/poor_precision": ("poor-token precision", 1),
    "rm_vs_critic/poor_recall": ("poor-token recall", 1),
    "rm_vs_critic/good_precision": ("good-token precision", 1),
    "rm_vs_critic/good_recall": ("good-token recall", 1),
    "rm_vs_critic/mistakes_flagged": ("real mistakes the RM flags", 1),
    "rm_vs_critic/mistakes_missed": ("real mistakes the RM misses", -1),
    "rm_vs_critic/flagged_wrong": ("wrong facts the RM flags (only the post shows them)", 1),
    "rm_vs_critic/flagged_irrelevant": ("irrelevant asides the RM flags", 1),
    "rm_vs_critic/flagged_repeated": ("repeats the RM flags", 1),
    "rm_vs_critic/poor_invented": ("RM poor spans on no real mistake", -1),
    "gen/tokens": ("response length (tokens)", 0),
    "monitor/flagged_rate": ("answers it flags (a token of delta < 0)", -1),
    "monitor/delta_sum": ("its delta-sum per answer", 1),
    "monitor/error_rate": ("answers it cannot judge", -1),
}
GROUPS = {
    "demo": "demo critic (ground truth)",
    "rm": "reward-model critique",
    "gen": "generation",
    "rm_vs_critic": "reward model vs the exact critic (reward-hacking monitor)",
}
# --monitor-reward-model NAME=DIR adds the monitor's rows for that reward model as rm_vs_critic[NAME]/...; --monitor
# python:FILE:FUNCTION adds that critic's rows as monitor[FILE:FUNCTION]/...


def base_key(key: str) -> str:
    """The METRICS key a metric is an instance of: rm_vs_critic[toy]/poor_recall -> rm_vs_critic/poor_recall."""
    return re.sub(r"\[[^\]]*\]", "", key)


def group_label(group: str) -> str:
    name = re.search(r"\[([^\]]*)\]", group)
    if name and group.startswith("rm["):
        return f"reward model '{name[1]}' (--monitor-reward-model): its critiques"
    if name and group.startswith("monitor["):
        return f"your critic {name[1]} (--monitor: its own judgement; nothing is trained on it)"
    return GROUPS.get(group) or (f"reward model '{name[1]}' vs the exact critic (monitor only)" if name else group)


def metric_keys(policies: dict) -> list[str]:
    """Metric names present in any policy, in METRICS order (a monitor reward model's rows after the main one's), then
    any others."""
    present, order, first = {k for p in policies.values() for k in p["metrics"]}, {}, {}
    for i, k in enumerate(METRICS):
        order[k], first[k.split("/")[0]] = i, first.get(k.split("/")[0], i)
    known = sorted(
        (k for k in present if base_key(k) in order),  # by group (its first row), then within the group
        key=lambda k: (first[base_key(k).split("/")[0]], k.split("/")[0], order[base_key(k)]),
    )
    return known + sorted(present - set(known))


# ----------------------------------------------------------------------------------------------------------------------
# Stage 3's training curves (--curves) and the answers' highlighted spans
# ----------------------------------------------------------------------------------------------------------------------

# Stage 3's training curves (metrics.jsonl): the learned critic's and, dashed where a run logs it (the demo's
# exact critic), the exact critic's; a panel's title names the dashed line only where one is drawn
CURVE_KEYS = {
    "objective/span_reward": "reward: critic",
    "critic/flagged_rate": "answers flagged: critic",
    "objective/kl": "KL to the reference",
    "objective/entropy": "entropy",
}
# the demo's exact critic beside the learned one: what it flags are the post's real mistakes
EXACT_CURVES = {"objective/span_reward": "exact/span_reward", "critic/flagged_rate": "exact/mistake_rate"}
CRITIC_CURVES = ("objective/span_reward", "critic/flagged_rate")  # from the critic's delta: none where it did not judge
UNJUDGED = "critic did not judge"
COLORS = ["#1a7f37", "#8250df", "#0969da", "#bc4c00", "#cf222e", "#57606a"]


def read_curves(specs: dict[str, str]) -> dict[str, list[dict]]:
    """Rows of each stage 3 metrics.jsonl; a torn last line (a run still going) is skipped, not fatal."""
    runs = {}
    for name, path in specs.items():
        if not Path(path).is_file():
            print(f"warning: no training curves for {name!r}: {path} not found", file=sys.stderr)
            continue
        rows = []
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a run still writing
        runs[name] = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), (int, float))]
        for r in runs[name]:  # a run from before issue 80 logged the critic's flagged share as critic/mistake_rate
            if "critic/mistake_rate" in r:
                r.setdefault("critic/flagged_rate", r.pop("critic/mistake_rate"))
    return runs


def training_counts(runs: dict[str, list[dict]], specs: dict[str, str]) -> dict:
    """results.json's "training": each stage-3 run's critic failures over all its iterations (its metrics.jsonl rows,
    resumed segments included; infra.runs.critic_failures), counted with the batch size in config.json beside it."""
    from infra.runs import critic_failures

    out = {}
    for name, rows in runs.items():
        config = Path(specs[name]).parent / "config.json"
        settings = json.loads(config.read_text()) if config.is_file() else {}
        out[name] = {**critic_failures(rows, settings.get("batch_size")), "temperature": settings.get("temperature")}
    return out


def curves_decoding(training: dict) -> str:
    """How the curves' rollouts were sampled: each run's stage-3 temperature (config.json beside its metrics.jsonl)."""
    temps = {name: t.get("temperature") for name, t in training.items()}
    if not temps or None in temps.values():
        return "Stage 3's own rollouts, sampled at its --temperature."
    if len(set(temps.values())) == 1:
        return f"Stage 3's own rollouts, sampled at T = {next(iter(temps.values())):g} (training, not held out)."
    return "Stage 3's own rollouts (training, not held out), sampled at " + ", ".join(
        f"T = {t:g} ({html.escape(n)})" for n, t in temps.items()
    )


def training_note(training: dict) -> str:
    """Under the curves: each run whose critic failed, the whole run's count and the iterations it did not judge."""
    notes = []
    for name, t in training.items():
        if not t["failed"] and not t["unjudged"]:
            continue
        count = f"{t['failed']} of {t['critiques']} critiques failed" if t["critiques"] else "critiques failed"
        steps = ", ".join(map(str, t["unjudged"][:20])) + (", …" if len(t["unjudged"]) > 20 else "")
        notes.append(
            f"{html.escape(name)}: {count} over its {t['iterations']} iterations (resumed ones included)"
            + (f"; the critic did not judge iterations {steps} (× on the curves, no value drawn)" if steps else "")
        )
    return f"<p class='note'>{'<br>'.join(notes)}</p>" if notes else ""


def plot_curves(runs: dict[str, list[dict]]) -> str | None:
    """The report's curves: base64 PNG with one panel per curve present (reward, mistakes, KL, entropy), or None. The
    critic's curves draw no value on an iteration where it did not judge (critic/parse_fail_rate 1.0: delta = 0 on
    every rollout, which would read as a flawless batch), and an × marks it at the foot of the panel."""
    present = {k for rows in runs.values() for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    keys = [k for k in CURVE_KEYS if k in present] or sorted(present - {"step"})[:4]
    if not keys:
        return None
    import base64
    import io
    import itertools

    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols, rows = min(2, len(keys)), (len(keys) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.1 * rows), dpi=110, squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.remove()
    for ax, key in zip(axes.flat, keys):
        dashed, marked = False, False
        for color, (name, rows) in zip(itertools.cycle(COLORS), runs.items()):
            unjudged = {r["step"] for r in rows if (r.get("critic/parse_fail_rate") or 0) >= 1.0}
            # the learned critic's curve, and dashed the exact critic's on the same rollouts (the demo's
            # reward-hacking monitor: a rising critic reward over a flat exact one means the critic is being gamed)
            for k, style, label in ((key, "-", name), (EXACT_CURVES.get(key), "--", None)):
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
                if not pts:
                    continue
                x, y = map(np.asarray, zip(*pts))
                y = y.astype(float)
                if style == "-" and key in CRITIC_CURVES:
                    y[np.isin(x, list(unjudged))] = np.nan  # no value where the critic did not judge
                w = max(1, len(y) // 15)  # moving average over ~7% of the run; raw values drawn faintly behind
                valid = ~np.isnan(y)
                sums = np.convolve(np.where(valid, y, 0.0), np.ones(w), mode="valid")
                smooth = sums / np.maximum(np.convolve(valid, np.ones(w), mode="valid"), 1)
                smooth[~valid[w - 1 :]] = np.nan  # the average of the judged ones, none at an unjudged iteration
                if style == "-":
                    ax.plot(x, y, color=color, alpha=0.2, lw=1)
                ax.plot(x[w - 1 :], smooth, style, color=color, lw=2 if style == "-" else 1.5, label=label)
                dashed = dashed or style == "--"
                if style == "-" and key in CRITIC_CURVES and unjudged:  # an x at the panel's foot, named once
                    marks, label = sorted(unjudged), "_nolegend_" if marked else UNJUDGED
                    ax.plot(
                        marks, [0.02] * len(marks), "x", color=color, transform=ax.get_xaxis_transform(), label=label
                    )
                    marked = True
        title = CURVE_KEYS.get(key, key)
        ax.set_title(title + " (solid), exact critic (dashed)" if dashed else title, fontsize=11)
        ax.set_xlabel("PPO iteration", fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.25)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].legend(fontsize=9, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def highlight(text: str, good: list[tuple[int, int]], poor: list[tuple[int, int]]) -> str:
    """HTML of `text` with <mark class="good|poor"> over the character intervals (poor overrides good, as in delta)."""
    label = [0] * len(text)
    for lab, intervals in ((1, good), (2, poor)):
        for a, b in intervals:
            label[a:b] = [lab] * (b - a)
    out, i = [], 0
    for lab, run in itertools.groupby(label):
        j = i + len(list(run))
        piece = html.escape(text[i:j])
        out.append(f'<mark class="{"good" if lab == 1 else "poor"}">{piece}</mark>' if lab else piece)
        i = j
    return "".join(out)


# ----------------------------------------------------------------------------------------------------------------------
# "Where the update went": stage 3's --trace-samples (trace.jsonl beside each metrics.jsonl), drawn token by token
# ----------------------------------------------------------------------------------------------------------------------

STRIP_ROWS = [  # (label, what it is, its values from {mode: sample}, scale: the rows coloured alike)
    (
        "π<sub>old</sub>(y<sub>t</sub>)",
        "pi_old(y_t), the sampled token's probability before the update",
        lambda s, m: [round(math.exp(x), 4) for x in s["logprobs_old"]],
        "p",
    ),
    ("δ<sub>t</sub>", "delta_t, the critic's label", lambda s, m: s["delta"], "delta"),
    ("A<sub>t</sub> span", "A_t under span rewards", lambda s, m: s["advantages"]["span"], "A"),
    ("A<sub>t</sub> scalar", "A_t under scalar rewards", lambda s, m: s["advantages"]["scalar"], "A"),
    (
        "Δ<sub>t</sub> span",
        "Delta_t = log pi_new - log pi_old, span update",
        lambda s, m: m.get("span") and [b - a for a, b in zip(m["span"]["logprobs_old"], m["span"]["logprobs_new"])],
        "Delta",
    ),
    (
        "Δ<sub>t</sub> scalar",
        "Delta_t = log pi_new - log pi_old, scalar update",
        lambda s, m: (
            m.get("scalar") and [b - a for a, b in zip(m["scalar"]["logprobs_old"], m["scalar"]["logprobs_new"])]
        ),
        "Delta",
    ),
]


def read_traces(curve_specs: dict[str, str]) -> dict[str, list[dict]]:
    """Stage 3's trace.jsonl beside each run's metrics.jsonl (--trace-samples), where there is one."""
    paths = {name: str(Path(path).with_name("trace.jsonl")) for name, path in curve_specs.items()}
    return {
        name: rows for name, rows in read_curves({n: p for n, p in paths.items() if Path(p).is_file()}).items() if rows
    }


def paired_samples(traces: dict[str, list[dict]]) -> tuple[int | None, list[dict], bool]:
    """(step, samples, flagged): the first traced iteration of the span-rewards run in which the critic flagged a
    token (delta < 0; flagged False when none did: then its first iteration), and its samples, each as {mode: sample}
    with the scalar run's sample of the same iteration where it is the same rollout (so at iteration 1, where both
    runs start from the same state and seed: the same rollouts, delta, KL and values, only the update differs). An
    iteration of nothing flagged has nothing to show: every strip's delta, and the span run's update, are 0."""
    first = {}
    for rows in traces.values():
        mode = rows[0].get("reward_mode")
        if mode in ("span", "scalar") and mode not in first:
            first[mode] = rows
    if not first:
        return None, [], False
    lead = first.get("span") or first["scalar"]
    chosen = next((r for r in lead if any(d < 0 for s in r["samples"] for d in s["delta"])), None)
    step, samples = (chosen or lead[0])["step"], (chosen or lead[0])["samples"]
    other = "scalar" if lead is first.get("span") else "span"
    twin = next((r["samples"] for r in first.get(other, []) if r["step"] == step), [])
    key = lambda s: json.dumps([s["row"], s["tokens"], s["delta"]])  # noqa: E731
    twins = {key(s): s for s in twin}
    return (
        step,
        [{lead[0]["reward_mode"]: s, **({other: twins[key(s)]} if key(s) in twins else {})} for s in samples],
        chosen is not None,
    )


def cell_color(v: float, scale: float) -> str:
    """A diverging colour: green for v > 0, red for v < 0, stronger with |v| / scale; none for 0."""
    if not v or not scale:
        return "transparent"
    alpha = min(1.0, abs(v) / scale) ** 0.5 * 0.85 + 0.08  # sqrt: small values stay visible next to a large one
    return f"rgba(26,127,55,{alpha:.3f})" if v > 0 else f"rgba(207,34,46,{alpha:.3f})"


def render_strip(modes: dict[str, dict]) -> str:
    """One sampled response as a strip of its tokens, with a row of coloured cells per STRIP_ROWS entry (the exact
    value on hover)."""
    esc, s = html.escape, next(iter(modes.values()))
    rows = [(label, what, values, scale) for label, what, get, scale in STRIP_ROWS if (values := get(s, modes))]
    scales = {
        scale: max((abs(v) for _, _, values, sc in rows if sc == scale for v in values), default=0)
        for scale in {r[3] for r in rows}
    }
    scales["delta"] = 1.0 if scales.get("delta") else 0.0
    color = lambda v, scale: (  # noqa: E731
        f"rgba(9,105,218,{(1 - v) * 0.8 + 0.04:.3f})"
        if scale == "p"  # noqa: E731
        else cell_color(v, scales[scale])
    )  # p: bluer where the token was less likely
    shown = [t if t.strip() else "·" for t in s["tokens"]]  # a token of no visible text: the EOS, or a space
    if s["has_eos"] and not s["tokens"][-1].strip():
        shown[-1] = "⟨eos⟩"
    heads = "".join(f"<th title='{esc(repr(t))}'>{esc(x)}</th>" for t, x in zip(s["tokens"], shown))
    body = "".join(
        f"<tr><th class='what' title='{esc(what)}'>{label}</th>"
        + "".join(
            f"<td class='cell {scale}' data-v='{v!r}' title='{esc(what)} = {v:+.6g}' style='background:"
            f"{color(v, scale)}'></td>"
            for v in values
        )
        + "</tr>"
        for label, what, values, scale in rows
    )
    critique = f"<div class='critique'>critic: {esc(s['critique'])}</div>" if s.get("critique") else ""
    return (
        f"<div class='strip'><pre class='prompt'>{esc(s['prompt'])}</pre>{critique}<div class='scroll'>"
        f"<table class='tokens'><tr><th class='what'>token</th>{heads}</tr>{body}</table></div></div>"
    )


def plot_locality(traces: dict[str, list[dict]]) -> str | None:
    """The locality ratio of each run's own update at every traced iteration (base64 PNG), or None."""
    series = {
        name: [(r["step"], r["locality"]["ratio"]) for r in rows if r.get("locality", {}).get("ratio")]
        for name, rows in traces.items()
    }
    series = {name: pts for name, pts in series.items() if pts}
    if not series:
        return None
    import base64
    import io
    import itertools

    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 2.8), dpi=110)
    for color, (name, pts) in zip(itertools.cycle(COLORS), series.items()):
        x, y = map(np.asarray, zip(*pts))
        w = max(1, len(y) // 10)  # a running median: a ratio of two small means has outliers both ways
        ax.plot(x, y, "o-", color=color, alpha=0.25, lw=1, ms=2.5)
        ax.plot(
            x,
            [np.median(y[max(0, i - w + 1) : i + 1]) for i in range(len(y))],
            color=color,
            lw=2,
            label=f"{name} (median {np.median(y):.1f})",
        )
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_title(
        "locality ratio: mean |Δ| in poor spans / mean |Δ| outside spans of the same answers\n(each "
        "run's own update; running median over ~10% of the run)",
        fontsize=9.5,
    )
    ax.set_xlabel("PPO iteration", fontsize=9.5)
    ax.tick_params(labelsize=8.5)
    ax.grid(alpha=0.25)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=8.5, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_update_section(traces: dict[str, list[dict]], max_samples: int = 3) -> str:
    """The report's "Where the update went": sample strips of the first traced iteration with a token the critic
    flagged (paired_samples; else the first, and a line saying none has one), both runs' updates side by side where
    they share the rollout, then the locality ratio over training with its medians per run."""
    esc = html.escape
    step, samples, flagged = paired_samples(traces)
    if not samples:
        return ""
    both, start = any(len(m) == 2 for m in samples), step == min(rows[0]["step"] for rows in traces.values())
    parts = [
        "<h2 id='where-update'>Where the update went</h2><p class='note'>"
        + (
            ""
            if flagged
            else "Note: no traced iteration has a token the critic flagged (δ<sub>t</sub> &lt; 0), "
            "so these strips show no mistake to move away from. "
        )
        + f"Iteration {step}: "
        + (
            "both runs start from the same state and seed, so they sample the same rollouts and see the same "
            "δ, KL and values; only the rewards' placement differs (span: δ<sub>t</sub> on every token; scalar: "
            "Σδ on the last). "
            if both and start
            else "both runs traced these rollouts, with the same δ. "
            if both
            else ""
        )
        + "Rows: the critic's δ<sub>t</sub>, the whitened advantages A<sub>t</sub> under each reward mode, and "
        "Δ<sub>t</sub> = log π<sub>new</sub> − log π<sub>old</sub>, how far one PPO update moved each token's "
        "log-probability. <span style='color:#1a7f37'>Green</span> &gt; 0, <span style='color:#cf222e'>red"
        "</span> &lt; 0, stronger with the magnitude (one scale per kind of row); hover for the number. The "
        "first row, π<sub>old</sub>(y<sub>t</sub>), is bluer where the sampled token was less likely: a "
        "token the policy was sure of (π ≈ 1) can barely move, whatever its advantage.</p>"
    ]
    parts += [render_strip(m) for m in samples[:max_samples]]
    png = plot_locality(traces)
    if png:
        rows = []
        for name, trace in traces.items():
            loc, cells = [r["locality"] for r in trace if r.get("locality")], []
            for get in (
                lambda x: x["ratio"],
                lambda x: x["poor"]["mean"],
                lambda x: x["poor"]["mean_abs"],
                lambda x: x["outside_flawed"]["mean_abs"],
            ):
                values = [v for v in map(get, loc) if v is not None]
                cells.append(f"<td>{statistics.median(values):.3g}</td>" if values else "<td>–</td>")
            rows.append(
                f"<tr><td>{esc(name)} ({esc(str(trace[0].get('reward_mode')))} rewards)</td>{''.join(cells)}"
                f"<td>{len(loc)}</td></tr>"
            )
        parts.append(
            f"<img class='curves locality' alt='locality ratio over training' src='data:image/png;base64,"
            f"{png}'><table><tr><th>run (its own update, median over iterations)</th><th>locality ratio</th>"
            f"<th>mean Δ poor</th><th>mean |Δ| poor</th><th>mean |Δ| outside, flawed</th><th>iterations"
            f"</th></tr>{''.join(rows)}</table><p class='note'>Each run's own update on its own batch, every "
            "iteration. The same update from the same state in both modes, over seeds and iterations: "
            "<code>bench/locality/locality.py</code>.</p>"
        )
    return "".join(parts)


# ----------------------------------------------------------------------------------------------------------------------
# The page: metrics, the judge, curves, updates and highlighted samples; and the same metrics as a table
# ----------------------------------------------------------------------------------------------------------------------

CSS = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--soft:#f6f8fa;--good:#d2f4da;--good-b:#1a7f37;--poor:#ffe0dd;
--poor-b:#cf222e;--mono:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}*{box-sizing:border-box}
body{margin:0;color:var(--fg);font:15px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",sans-serif}
main{max-width:1100px;margin:0 auto;padding:36px 28px 72px}h1{font-size:26px;margin:0 0 6px;letter-spacing:-.01em}
h2{font-size:18px;margin:40px 0 14px;padding-bottom:8px;border-bottom:1px solid var(--line)}
.sub,.note{color:var(--muted);font-size:13.5px}.ci{display:block;color:var(--muted);font-size:11.5px;font-weight:400}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums;font-size:14px}td.best{font-weight:700}
td.tie::before{content:"≈ ";color:var(--muted)}
th,td{padding:7px 14px;border-bottom:1px solid var(--line);text-align:right;vertical-align:top}
th{font-weight:600;background:var(--soft)}th:first-child,td:first-child{text-align:left}
tr.group td{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.05em;padding-top:16px}
img.curves{max-width:100%;border:1px solid var(--line);border-radius:8px}
.legend{display:flex;gap:18px;font-size:13.5px;color:var(--muted);margin:4px 0 8px}
mark{color:inherit;border-radius:3px;padding:1px 0}.unmatched{color:var(--poor-b)}
mark.good{background:var(--good);box-shadow:inset 0 -2px var(--good-b)}
mark.poor{background:var(--poor);box-shadow:inset 0 -2px var(--poor-b)}
.sample{border:1px solid var(--line);border-radius:10px;padding:18px 22px;margin:18px 0}
.sample-head{display:flex;justify-content:space-between;color:var(--muted);font-size:12.5px;margin-bottom:8px}
.prompt{white-space:pre-wrap;background:var(--soft);border-radius:6px;padding:10px 12px;margin:0 0 6px;
font:13px/1.5 var(--mono)}
.reference{font-size:13.5px;color:var(--muted);margin:6px 0 4px}.exact,.monitor{font-size:13px;margin-top:4px}
.pname{font-weight:600;font-size:14px}
.row{display:grid;grid-template-columns:110px 1fr;gap:14px;padding:12px 0 4px;border-top:1px solid #eaeef2;
margin-top:8px}
.pname .score{display:block;font-weight:400;color:var(--muted);font-size:12px;font-variant-numeric:tabular-nums}
.response{white-space:pre-wrap}.code .response,.response.mono{font:13px/1.5 var(--mono)}
.critique{color:var(--muted);font-size:13px;margin-top:6px}
.strip{border:1px solid var(--line);border-radius:10px;padding:14px 18px;margin:14px 0}.scroll{overflow-x:auto}
table.tokens{width:auto;border-collapse:separate;border-spacing:2px;margin-top:8px;font-size:12.5px}
table.tokens th{background:none;font:12.5px var(--mono);padding:2px 4px;white-space:pre;border:0;text-align:center}
table.tokens th.what{font:12px system-ui,sans-serif;color:var(--muted);text-align:right;padding-right:8px}
table.tokens td.cell{height:18px;min-width:26px;padding:0;border:1px solid #eaeef2;border-radius:3px}
.banner{margin:18px 0 0;padding:12px 16px;border:1px solid var(--poor-b);border-radius:8px;background:var(--poor)}
td.na{color:var(--poor-b)}
"""


def voided(policy: dict, key: str) -> dict | None:
    """The policy's critic_failed entry, or a monitor_failed one (evaluation/__init__.py), that voids metric `key`."""
    return next(
        (
            f
            for f in (policy.get("critic_failed"), *(policy.get("monitor_failed") or {}).values())
            if f and key in f["metrics"]
        ),
        None,
    )


def failed_note(failed: dict) -> str:
    return f"{failed['failed']} of {failed['n']} critiques failed"


def metric_cell(m: dict | None, mark: str, failed: dict | None) -> str:
    """One cell of the metric table: the value over its 95% interval, "n/a" over why (critic_failed), or "–"."""
    if failed:
        return f"<td class='na'>n/a<span class='ci'>{failed_note(failed)}</span></td>"
    return (
        f"<td class='{mark}'>{fmt(m['value'])}<span class='ci'>[{fmt(m['ci95'][0])}, {fmt(m['ci95'][1])}]</span></td>"
        if m
        else "<td>–</td>"
    )


def critic_banner(policies: dict) -> str:
    """The page's top line when a policy's reward-model critiques mostly did not parse: which ones, and why their
    critic's rows read n/a."""
    failed = {n: p["critic_failed"] for n, p in policies.items() if p.get("critic_failed")}
    if not failed:
        return ""
    which = ", ".join(f"<b>{html.escape(n)}</b> ({failed_note(f)})" for n, f in failed.items())
    floor = next(iter(failed.values()))["floor"]
    return (
        f"<div class='banner'>The reward model's critiques mostly did not parse for {which}: fewer than {floor:g} "
        "of them parsed. A critique that does not parse quotes nothing (δ = 0 on every token), which would read "
        "as a flawless answer, so these policies' reward-model rows read n/a (results.json keeps the numbers, "
        "under <code>critic_failed</code>). Train the reward model further, or check <code>--reward-model"
        "</code>: stage 2 ends with exit 1 below its <code>--min-parse-rate</code>.</div>"
    )


MIN_MARKED = 20  # a rate over fewer cases than this is never marked best ("1.000 [1.000, 1.000]" over 4 mistakes)
HEADLINE = ("demo/mistake_rate", "pass@1", "rougeL", "monitor/flagged_rate", "rm/delta_sum")  # the first present


def best_marks(ms: list, direction: int) -> list[str]:
    """Each metric cell's class: "best" for the best value when its 95% interval overlaps no other policy's; else
    "tie" for it and every value whose interval overlaps its interval (a lead within the noise is no lead). A value
    over fewer than MIN_MARKED cases takes no part."""
    marks = [""] * len(ms)
    vals = [(i, m) for i, m in enumerate(ms) if m and m["value"] is not None and m.get("n", MIN_MARKED) >= MIN_MARKED]
    if not direction or len(vals) < 2:
        return marks
    lead, best = (max if direction > 0 else min)(vals, key=lambda x: x[1]["value"])
    lo, hi = best["ci95"]
    tied = [
        i
        for i, m in vals
        if i != lead and (None in (lo, hi, *m["ci95"]) or (m["ci95"][0] <= hi and lo <= m["ci95"][1]))
    ]
    for i in tied + [lead] if tied else []:
        marks[i] = "tie"
    marks[lead] = marks[lead] or "best"
    return marks


def verdicts(pol: dict, decoding: str) -> str:
    """The report's first lines: the headline metric (HEADLINE's first present) and, for each pair of policies, which
    is better by it, or that their 95% intervals overlap (no difference detected), each with its value and interval."""
    names = [n for n in pol if not pol[n].get("critic_failed")]
    key = next((k for h in HEADLINE for k in metric_keys(pol) if base_key(k) == h), None)
    if key is None or len(names) < 2:
        return ""
    label, direction = METRICS[base_key(key)]
    got = {n: pol[n]["metrics"].get(key) for n in names}
    show = lambda n: f"{html.escape(n)} {fmt(got[n]['value'])} [{fmt(got[n]['ci95'][0])}, {fmt(got[n]['ci95'][1])}]"  # noqa: E731
    lines = []
    for a, b in itertools.combinations([n for n in names if got[n] and got[n]["value"] is not None], 2):
        (alo, ahi), (blo, bhi) = got[a]["ci95"], got[b]["ci95"]
        if None in (alo, ahi, blo, bhi) or (alo <= bhi and blo <= ahi):
            lines.append(f"{show(b)} vs {show(a)}: the intervals overlap, no difference detected")
        else:
            better, worse = (b, a) if (got[b]["value"] - got[a]["value"]) * direction > 0 else (a, b)
            lines.append(f"<b>{html.escape(better)}</b> is better: {show(better)} vs {show(worse)}")
    n = got[names[0]]["n"] if got[names[0]] else "?"
    head = f"<h2>Verdict: {html.escape(label)} ({'lower' if direction < 0 else 'higher'} is better)</h2>"
    return (
        head
        + f"<ul class='verdict'>{''.join(f'<li>{x}</li>' for x in lines)}</ul><p class='note'>{n} "
        + (f"held-out prompts, {decoding} decoding; 95% bootstrap intervals, each policy's own (the table below).</p>")
    )


def fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"  # BLEU and lengths: one decimal


def render_report(
    results: dict,
    shown: dict[str, list[dict]],
    records: list[dict],
    curves_png: str | None,
    sample_ids: list[str],
    task: str,
    traces: dict[str, list[dict]] | None = None,
) -> str:
    esc, pol, gen = html.escape, results["policies"], results["generation"]
    names, rows, group = list(pol), [], None
    for key in metric_keys(pol):  # the metric table: grouped by prefix, the best policy per row in bold
        label, direction = METRICS.get(base_key(key), (key, 0))
        if (g := key.split("/")[0] if "/" in key else "task metrics") != group:
            group = g
            rows.append(f"<tr class='group'><td colspan='{len(names) + 1}'>{esc(group_label(g))}</td></tr>")
        ms = [None if voided(pol[n], key) else pol[n]["metrics"].get(key) for n in names]  # n/a: never the best
        cells = "".join(
            metric_cell(m, mark, voided(pol[n], key)) for n, m, mark in zip(names, ms, best_marks(ms, direction))
        )
        arrow = {1: " ↑", -1: " ↓", 0: ""}[direction]
        rows.append(f"<tr><td title='{esc(key)}'>{esc(label)}{arrow}</td>{cells}</tr>")
    head = "".join(f"<th>{esc(n)}<span class='ci'>n = {pol[n]['n']}</span></th>" for n in names)
    decoding = "greedy" if not gen["temperature"] else f"T = {gen['temperature']:g}"
    parts = [
        verdicts(pol, decoding),
        f"<h2>Metrics</h2><table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table><p class='note'>Held out, "
        f"{decoding} decoding. Each value has its 95% bootstrap interval below it; ↑ higher is better, ↓ lower is "
        f"better. The best is in bold where its interval overlaps no other's; where it does, ≈ marks the values tied "
        f"with it; a value over fewer than {MIN_MARKED} cases is never marked.</p>",
    ]
    if (results.get("judge") or {}).get("pairs"):  # --judge-pairs none: the judge served Table 4 only
        jrows = "".join(
            f"<tr><td>{esc(j['a'])} vs {esc(j['b'])}</td>"
            + "".join(
                f"<td>{fmt(j[k]['value'])}<span class='ci'>[{fmt(j[k]['ci95'][0])}, {fmt(j[k]['ci95'][1])}]</span></td>"
                for k in ("win", "tie", "loss")
            )
            + f"<td>{j['n']}</td><td>{j['invalid']}</td></tr>"
            for j in results["judge"]["pairs"].values()
        )
        parts.append(
            f"<h2>LLM judge: {esc(results['judge']['model'])}</h2><table><tr><th>pair</th><th>win</th><th>tie"
            f"</th><th>loss</th><th>n</th><th>invalid</th></tr>{jrows}</table><p class='note'>The answers' "
            f"order was random per prompt (seed {results['judge']['seed']}) and undone before scoring. Rates "
            "are over the n valid verdicts, with 95% bootstrap intervals; an invalid verdict (no 'Winner:' "
            "line) counts nowhere.</p>"
        )
    parts.append(table4.render_html(results))  # AlpacaEval 2.0, ARC-Challenge, MT-Bench, where computed
    parts.append(
        "<h2>Training curves</h2>"
        + (
            f"<img class='curves' alt='training curves' src='data:image/png;base64,{curves_png}'>"
            if curves_png
            else "<p class='note'>No stage 3 metrics.jsonl found.</p>"
        )
        + (f"<p class='note'>{curves_decoding(results['training'])}</p>" if results.get("training") else "")
        + training_note(results.get("training") or {})
    )
    parts.append(render_update_section(traces or {}))
    parts.append(
        "<h2>Samples</h2><div class='legend'><span><mark class='good'>good span</mark> δ = +1</span><span>"
        "<mark class='poor'>poor span</mark> δ = −1</span><span>quoted by the critique shown below each "
        "response (also on hover)"
        + ("; the exact critic's verdict under it" if task == "demo" else "")
        + "</span></div>"
    )
    index = {r["id"]: i for i, r in enumerate(records)}
    for rid in sample_ids:
        rec, answers = records[index[rid]], []
        for n in names:
            s = shown[n][index[rid]]
            score = "" if s["delta_sum"] is None else f"<span class='score'>δ-sum {s['delta_sum']:+g}</span>"
            missed = (
                f"<br><span class='unmatched'>not found in the response: "
                f"{', '.join('“' + esc(u) + '”' for u in s['unmatched'])}</span>"
                if s["unmatched"]
                else ""
            )
            critique = (
                f"<div class='critique'>{esc(s['source'])}: {esc(s['critique'])}{missed}</div>" if s["source"] else ""
            )
            if s.get("exact"):  # where the task has an exact critic, its verdict on the same answer
                x = s["exact"]
                critique += (
                    f"<div class='exact'>exact critic: {highlight(s['response'], x['good'], x['poor'])}"
                    f"<br>{esc(x['critique'])}</div>"
                )
            critique += "".join(monitor_block(s["response"], m) for m in s.get("monitors", []))
            mono = " mono" if looks_like_code(s["response"]) else ""  # a qa answer's code keeps its columns
            answers.append(
                f"<div class='row'><div class='pname'>{esc(n)}{score}</div><div><div class='response{mono}' "
                f"data-policy='{esc(n)}' data-id='{esc(rid)}' title='{esc(s['critique'])}'>"
                f"{highlight(s['response'], s['good'], s['poor'])}</div>{critique}</div></div>"
            )
        ref = f"<div class='reference'>reference: {esc(rec['reference'])}</div>" if rec.get("reference") else ""
        parts.append(
            f"<section class='sample'><div class='sample-head'><span>prompt</span><span>{esc(rid)}</span>"
            f"</div><pre class='prompt'>{esc(rec['prompt'])}</pre>{ref}{''.join(answers)}</section>"
        )
    sub = (
        f"task <b>{esc(results['task'])}</b> · {results['n_prompts']} held-out prompts from <code>"
        f"{esc(results['data'])}</code> · {decoding} decoding, ≤ {gen['max_new_tokens']} new tokens · reward "
        f"model <code>{esc(results['reward_model'] or 'none')}</code> · {esc(results['created'])}"
    )
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><meta name='viewport' content='width=device-"
        f"width, initial-scale=1'><title>Text2Grad evaluation</title><style>{CSS}</style></head><body class='"
        f"{esc(task)}'><main><h1>Text2Grad evaluation</h1><div class='sub'>{sub}</div>{critic_banner(pol)}"
        f"{''.join(parts)}</main>"
        f"</body></html>\n"
    )


def looks_like_code(text: str) -> bool:
    """A fenced block or an indented line (Markdown's two kinds of code): the answer is shown in monospace."""
    return "```" in text or re.search(r"^(?: {4}|\t)\S", text, re.M) is not None


def monitor_block(response: str, m: dict) -> str:
    """A --monitor critic's view of one sample answer (evaluation/monitors.py: monitor_view), labelled with its name:
    the spans it quoted, highlighted (the answer itself is shown once, above), and its critique; or why it could not
    judge it."""
    esc = html.escape
    if m["error"]:
        return f"<div class='monitor'>your critic {esc(m['name'])}: could not judge it: {esc(m['error'])}</div>"
    score = "" if m["score"] is None else f" (score {m['score']:+g})"
    marks = [(a, b, "good") for a, b in m["good"]] + [(a, b, "poor") for a, b in m["poor"]]
    quoted = " · ".join(f'<mark class="{k}">{esc(response[a:b])}</mark>' for a, b, k in sorted(marks)) or "no spans"
    return f"<div class='monitor'>your critic {esc(m['name'])}{score}: {quoted}<br>{esc(m['critique'])}</div>"


def pick_samples(records, outputs: dict[str, list[str]], k: int) -> list[str]:
    """Up to k prompt ids, preferring prompts where the policies' answers differ most; in data order."""
    spread = [len({outputs[n][i] for n in outputs}) for i in range(len(records))]
    chosen = sorted(sorted(range(len(records)), key=lambda i: -spread[i])[:k])
    return [records[i]["id"] for i in chosen]


def results_table(results: dict) -> list[list[str]]:
    """The results as text: a header row, then a row per metric (value [95% interval] per policy) and per judge pair;
    what print_table prints, and what 04 --report-to logs (infra/tracking.py: log_results)."""
    pol = results["policies"]
    cell = lambda m: f"{fmt(m['value'])} [{fmt(m['ci95'][0])}, {fmt(m['ci95'][1])}]" if m else "–"  # noqa: E731
    table = [["metric", *[f"{n} (n={p['n']})" for n, p in pol.items()]]]
    table += [
        [
            k,
            *[
                f"n/a ({failed_note(voided(p, k))})" if voided(p, k) else cell(p["metrics"].get(k))
                for p in pol.values()
            ],
        ]
        for k in metric_keys(pol)
    ]
    for name, j in (results.get("judge") or {}).get("pairs", {}).items():
        invalid = f"; {j['invalid']} of {j['n'] + j['invalid']} verdicts invalid" if j["invalid"] else ""
        table.append(
            [
                f"judge {name} win/tie/loss",
                f"{fmt(j['win']['value'])}/{fmt(j['tie']['value'])}/"
                f"{fmt(j['loss']['value'])} (n={j['n']} valid{invalid})",
            ]
        )
    return table


def print_table(results: dict) -> None:
    pol, table = results["policies"], results_table(results)
    for name, f in ((n, p["critic_failed"]) for n, p in pol.items() if p.get("critic_failed")):
        print(
            f"warning: {name}: {f['failed']} of {f['n']} of the reward model's critiques of its answers did not "
            f"parse (rm/parse_rate {f['parse_rate']:.3f}, below {f['floor']:g}): its rm/ and rm_vs_critic/ metrics "
            "read n/a (results.json keeps them, under critic_failed)",
            file=sys.stderr,
        )
    for name, mon, f in ((n, m, f) for n, p in pol.items() for m, f in (p.get("monitor_failed") or {}).items()):
        print(
            f"warning: {name}: {f['failed']} of {f['n']} of --monitor-reward-model {mon}'s critiques did not parse "
            f"(below {f['floor']:g}): its rm_vs_critic[{mon}]/ metrics read n/a (results.json: monitor_failed)",
            file=sys.stderr,
        )
    for name, j in (results.get("judge") or {}).get("pairs", {}).items():
        if j["invalid"]:  # a judge that mostly does not answer in format must not read as a verdict
            print(
                f"warning: judge {name}: {j['invalid']} of {j['n'] + j['invalid']} verdicts invalid (no 'Winner: "
                f"A', 'B' or 'tie' line; the replies are in eval/judge.{name}.jsonl): the win rates rest on {j['n']}",
                file=sys.stderr,
            )
    widths = [max(len(r[c]) for r in table if c < len(r)) for c in range(len(table[0]))]
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for line in table4.console_lines(results):  # AlpacaEval 2.0, ARC-Challenge, MT-Bench, where computed
        print(line)
