"""--monitor, --monitor-reward-model: judges of 04's policies beside --reward-model, which train nothing.

--monitor-reward-model NAME=DIR (demo): another reward model whose critiques of every answer the demo's monitor also
scores against the exact critic (tasks.demo.demo_rm_agreement), as it scores --reward-model's: its rows are
rm_vs_critic[NAME]/..., e.g. toy=runs/demo/reward_model beside a real reward model, to see which one is gamed.

--monitor python:MODULE_OR_FILE:FUNCTION: your own critic (critics/plugin.py, as 03 --critic takes it) judges each
policy's answers: the share it flags (a token of delta < 0, as 03's critic/flagged_rate), its delta-sum per answer (as
03 trains on it) and the share it cannot judge, under monitor[FILE:FUNCTION]/ (monitor_rows); and under each sample
answer of report.html, the spans it quoted and its critique, or why it could not judge it (monitor_view), as the
reward model's are shown. It is trusted code, run in this process, and checked on the first record (twice, in one
batch) before any generation (load_monitors), so a module that does not import, a missing function or a wrong
return stops the run in one line.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import critics
from common import locate_spans
from critics import plugin


def add_args(p) -> None:
    g = p.add_argument_group("monitors that train nothing (evaluation/monitors.py)")
    g.add_argument(
        "--monitor-reward-model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="demo: another reward model the exact critic's monitor also scores (repeatable)",
    )
    g.add_argument(
        "--monitor",
        action="append",
        default=[],
        type=critics.choice(),
        metavar="python:MODULE_OR_FILE:FUNCTION",
        help="your own critic's judgement of the answers (repeatable; critics/plugin.py)",
    )


def load_monitors(specs: list[str], task: str, records: list[dict]) -> list[tuple]:
    """--monitor's plug-ins as (function, label), each called on the first record twice, in one batch (preflight)."""
    watchers = [plugin.load_critic(spec, task, "--monitor") for spec in specs]
    for fn, label in watchers if records else ():
        critics.preflight(fn, label, records[0], critics.probe_response(records[0]), "--monitor")
    return watchers


def monitor_rows(records, gens, monitors, shown: list[dict] | None = None) -> dict[str, list]:
    """--monitor python:...: each plug-in critic's own judgement of one policy's answers, per sample (numerator,
    denominator) under monitor[FILE:FUNCTION]/: an answer it flags (a token of delta < 0, as 03's
    critic/flagged_rate), its delta-sum (critics.delta, as 03 trains on it), one it cannot judge. shown: 04's
    per-sample report entries (its score_policy's), each given its "monitors" views (monitor_view)."""
    rows = defaultdict(list)
    for fn, label in monitors:
        key = f"monitor[{Path(label).name}]"  # no "/" in a metric's group
        for i, (gen, fb) in enumerate(zip(gens, critics.call(fn, label, records, [g["response"] for g in gens]))):
            if shown is not None:
                shown[i].setdefault("monitors", []).append(monitor_view(Path(label).name, gen["response"], fb))
            judged = not fb.get("critic_error")
            d = critics.delta(gen["response"], gen["offsets"], fb)[0]
            rows[f"{key}/flagged_rate"].append((float(min(d, default=0.0) < 0), 1) if judged else (0.0, 0))
            rows[f"{key}/delta_sum"].append((sum(d), 1) if judged else (0.0, 0))
            rows[f"{key}/error_rate"].append((float(not judged), 1))
    return rows


def monitor_view(name: str, response: str, fb: dict) -> dict:
    """What report.html shows of a monitor's judgement of one answer: {"name", "good", "poor" (character intervals,
    as the reward model's: quotes located as 01 and 03 locate them, intervals by the sign of their reward), "critique",
    "score" (a one-number critic's, else None), "error" (why it could not judge it, else None)}."""
    if fb.get("critic_error"):
        return {"name": name, "good": [], "poor": [], "critique": "", "score": None, "error": fb["critic_error"]}
    if "spans" in fb:
        good = [(x["start"], x["end"]) for x in fb["spans"] if x["reward"] > 0]
        poor = [(x["start"], x["end"]) for x in fb["spans"] if x["reward"] < 0]
    else:
        good, poor, _ = locate_spans(response, fb["good_spans"], fb["poor_spans"])
    score = fb["step_rewards"][0][1] if fb.get("step_rewards") else None
    return {
        "name": name,
        "good": good,
        "poor": poor,
        "critique": fb.get("critique") or "",
        "score": score,
        "error": None,
    }
