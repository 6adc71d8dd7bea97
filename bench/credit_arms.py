"""The reward arms of bench/credit.py that are --critic python: plug-ins (tasks/plugin.py). Each is the demo's exact
critic (tasks/demo.py: demo_critic) with only the form of its reward changed, returned as located intervals, so its
quotes land where --critic program puts them (common.locate_spans: good quotes claim occurrences first):

    poor_only       the poor spans alone, reward -1: delta_t = min(the paper's delta_t, 0). With 03 --reward-mode
                    scalar its sum, -(poor tokens), sits on the last token: the mistake-only terminal score.
    clause_scores   a perfect process reward model: each clause (baselines/scalar_rm.py: split_steps, as 02 --objective
                    prm cuts steps) scores +1 when no poor span falls in it and -1 when one does (step_labels), on the
                    clause's last token, as PRM-PPO puts a learned PRM's 2 * sigmoid(s) - 1 there (step_deltas).
"""
from __future__ import annotations

import re

from common import locate_spans
from tasks.demo import demo_critic

_UNIT = re.compile(r"\w+|[^\w\s]")  # a word or one punctuation mark: what ends a clause on the policy's tokens


def _judged(records, responses, arm):
    out = []
    for rec, response in zip(records, responses):
        try:
            fb = demo_critic(rec["prompt"], response)
        except ValueError as e:  # not a demo post: that response gets no delta, as with --critic program
            out.append({"error": str(e)})
            continue
        out.append({"critique": fb["critique"], "spans": arm(response, fb)})
    return out


def _poor(response: str, fb: dict) -> list[dict]:
    return [{"start": a, "end": b, "reward": -1.0}
            for a, b in locate_spans(response, fb["good_spans"], fb["poor_spans"])[1]]


def _clauses(response: str, fb: dict) -> list[dict]:
    from baselines.scalar_rm import split_steps, step_labels
    steps = split_steps(response, "clause")
    spans = []
    for (s, e), right in zip(steps, step_labels(response, steps, fb["good_spans"], fb["poor_spans"])):
        last = list(_UNIT.finditer(response, s, e))[-1]  # a step holds a non-space character, so at least one unit
        spans.append({"start": last.start(), "end": last.end(), "reward": 1.0 if right else -1.0})
    return spans


def poor_only(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit_arms.py:poor_only"""
    return _judged(records, responses, _poor)


def clause_scores(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit_arms.py:clause_scores"""
    return _judged(records, responses, _clauses)
