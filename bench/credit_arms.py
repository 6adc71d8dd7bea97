"""The reward arms of bench/credit.py, as --critic python: plug-ins (tasks/plugin.py). Each is the demo's exact critic
with only the form of its reward changed: the intervals it flags (tasks/demo.py: demo_labels' verdicts, merged by
demo_intervals), returned as located intervals with their rewards, so no quote is ever widened to be unique and every
arm labels exactly the characters the critic flags:

    span            the paper's delta: +1 on good intervals, -1 on poor ones (a poor one wins where they meet);
                    with 03 --reward-mode scalar its sum sits on the last token (App. A, the summed-delta scalar),
                    with --center-delta it loses its batch mean
    poor_only       the poor intervals alone, reward -1: delta_t = min(span's delta_t, 0). With 03 --reward-mode
                    scalar its sum, -(poor tokens), sits on the last token: the mistake-only terminal score
    clause_scores   a perfect process reward model: each clause (baselines/scalar_rm.py: split_steps, as 02
                    --objective prm cuts steps) scores +1 when no poor interval overlaps it and -1 when one does, on
                    the clause's last token, where PRM-PPO puts a learned PRM's 2 * sigmoid(s) - 1 (step_deltas)
"""
from __future__ import annotations

import re

from tasks.demo import demo_intervals, demo_labels

_UNIT = re.compile(r"\w+|[^\w\s]")  # a word or one punctuation mark: what ends a clause on the policy's tokens


def _judged(records, responses, arm):
    out = []
    for rec, response in zip(records, responses):
        try:
            flagged = demo_intervals(response, demo_labels(rec["prompt"], response))
        except ValueError as e:  # not a demo post: that response gets no delta, as with --critic program
            out.append({"error": str(e)})
            continue
        out.append({"critique": "", "spans": arm(response, flagged)})
    return out


def _span(response: str, flagged: dict) -> list[dict]:
    return [{"start": a, "end": b, "reward": r} for label, r in (("good", 1.0), ("poor", -1.0))
            for a, b in flagged[label]]


def _poor(response: str, flagged: dict) -> list[dict]:
    return [{"start": a, "end": b, "reward": -1.0} for a, b in flagged["poor"]]


def _clauses(response: str, flagged: dict) -> list[dict]:
    from baselines.scalar_rm import split_steps
    spans = []
    for s, e in split_steps(response, "clause"):
        right = not any(a < e and s < b for a, b in flagged["poor"])
        last = list(_UNIT.finditer(response, s, e))[-1]  # a step holds a non-space character, so at least one unit
        spans.append({"start": last.start(), "end": last.end(), "reward": 1.0 if right else -1.0})
    return spans


def span(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit_arms.py:span"""
    return _judged(records, responses, _span)


def poor_only(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit_arms.py:poor_only"""
    return _judged(records, responses, _poor)


def clause_scores(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit_arms.py:clause_scores"""
    return _judged(records, responses, _clauses)
