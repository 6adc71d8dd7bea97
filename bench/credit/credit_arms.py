"""The reward arms of bench/credit/credit.py, as --critic python: plug-ins (critics/plugin.py). Each is the demo's exact critic
with only the form of its reward changed: the intervals it flags (tasks/demo.py: demo_labels' verdicts, merged by
demo_intervals), returned as located intervals with their rewards, so no quote is ever widened to be unique and every
arm labels exactly the characters the critic flags:

    span            the paper's delta: +1 on good intervals, -1 on poor ones (a poor one wins where they meet);
                    with 03 --reward-mode scalar its sum sits on the last token (App. A, the summed-delta scalar),
                    with --center-delta it loses its batch mean
    poor_only       the poor intervals alone, reward -1: delta_t = min(span's delta_t, 0). With 03 --reward-mode
                    scalar its sum, -(poor tokens), sits on the last token: the mistake-only terminal score
    fair_scalar     one score at EOS: facts stated - mistakes (tasks/demo.py: demo_facts, demo_mistakes), a scalar
                    that an empty answer cannot win (issue 65: a mistake-only score is won by saying nothing)
    poor_facts      poor_only's -1 on the poor intervals, plus the facts stated as one score at EOS: the per-token
                    analogue of fair_scalar (the mistakes located, the facts counted at the end)
    ..._per_pet     each of these with every reward divided by the post's K (per_pet: bench/credit/credit_matched.py)
    clause_scores   a perfect process reward model: each clause (baselines/scalar_rm.py: split_steps, as 02
                    --objective prm cuts steps) scores +1 when no poor interval overlaps it and -1 when one does, on
                    the clause's last token, where PRM-PPO puts a learned PRM's 2 * sigmoid(s) - 1 (step_deltas)
"""

from __future__ import annotations

import re

from tasks.demo import demo_facts, demo_intervals, demo_labels, demo_post_pets

_UNIT = re.compile(r"\w+|[^\w\s]")  # a word or one punctuation mark: what ends a clause on the policy's tokens


def _judged(records, responses, arm, score=None):
    """arm(response, flagged) -> the located intervals with their rewards; score(prompt, response, flagged) -> one
    number at EOS (or None: no score)."""
    out = []
    for rec, response in zip(records, responses):
        try:
            flagged = demo_intervals(response, demo_labels(rec["prompt"], response))
        except ValueError as e:  # not a demo post: that response gets no delta, as with --critic program
            out.append({"error": str(e)})
            continue
        item = {"critique": "", "spans": arm(response, flagged) if arm else []}
        if score:
            item["score"] = float(score(rec["prompt"], response, flagged))
        out.append(item)
    return out


def _facts(prompt: str, response: str, flagged: dict) -> int:
    return demo_facts(prompt, response)[0]


def _facts_less_mistakes(prompt: str, response: str, flagged: dict) -> int:
    return demo_facts(prompt, response)[0] - len(flagged["poor"])  # len(poor intervals): demo_mistakes


def _span(response: str, flagged: dict) -> list[dict]:
    return [
        {"start": a, "end": b, "reward": r} for label, r in (("good", 1.0), ("poor", -1.0)) for a, b in flagged[label]
    ]


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
    """--critic python:bench/credit/credit_arms.py:span"""
    return _judged(records, responses, _span)


def poor_only(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit/credit_arms.py:poor_only"""
    return _judged(records, responses, _poor)


def clause_scores(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit/credit_arms.py:clause_scores"""
    return _judged(records, responses, _clauses)


def per_pet(arm):
    """The arm with every reward divided by the post's K (its pets): returns on K = 1's scale at any K, the same form.
    bench/credit/credit.md, amendment 1: at K = 4 the undivided returns (up to 24 at EOS) let the value head, which shares
    the policy's LoRA, rewrite the language model within 4-20 iterations at every learning rate probed."""

    def scaled(records: list[dict], responses: list[str]) -> list[dict]:
        out = arm(records, responses)
        for rec, item in zip(records, out):
            if "error" in item:
                continue
            k = len(demo_post_pets(rec["prompt"])[0])
            item["spans"] = [{**x, "reward": x["reward"] / k} for x in item.get("spans", [])]
            if "score" in item:
                item["score"] /= k
        return out

    scaled.__doc__ = f"--critic python:bench/credit/credit_arms.py:{arm.__name__}_per_pet ({arm.__name__}, rewards / K)"
    return scaled


def fair_scalar(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit/credit_arms.py:fair_scalar"""
    return _judged(records, responses, None, _facts_less_mistakes)


def poor_facts(records: list[dict], responses: list[str]) -> list[dict]:
    """--critic python:bench/credit/credit_arms.py:poor_facts"""
    return _judged(records, responses, _poor, _facts)


# bench/credit/credit_matched.py's arms: each of the above with its rewards divided by K (per_pet)
span_per_pet = per_pet(span)
poor_only_per_pet = per_pet(poor_only)
clause_scores_per_pet = per_pet(clause_scores)
fair_scalar_per_pet = per_pet(fair_scalar)
poor_facts_per_pet = per_pet(poor_facts)
