"""The quotes a program critic writes for the character intervals it means (the demo's and the code task's critics,
and interval plug-ins in stage 1: critics.quotes): each interval's own text, where a quote of it lands back on it."""

from __future__ import annotations

from common import locate_spans


def unambiguous_quotes(text, good_iv, poor_iv) -> tuple[list[str], list[str], list[dict]]:
    """(good quotes, poor quotes, ambiguous) for a critic that knows the intervals it means (tasks/: the demo's and
    the code task's program critics, and interval plug-ins in stage 1): each interval's own text, kept where
    common.locate_spans puts every quote back on exactly its interval. An interval whose text occurs earlier,
    unclaimed by an identical quote, cannot be quoted: the quote would label that occurrence. It is never widened to
    be unique (that labels words the critic did not flag: " yellow cat" for a repeated " yellow", issue 56): it goes
    to `ambiguous` as {"start", "end", "label", "reason"}, and the other quotes stay."""
    ivs, ambiguous = {"good": list(good_iv), "poor": list(poor_iv)}, []
    while True:
        quotes = {k: [text[a:b] for a, b in v] for k, v in ivs.items()}
        got = dict(zip(("good", "poor"), locate_spans(text, quotes["good"], quotes["poor"])[:2]))
        wrong = next(
            ((k, i) for k in ("good", "poor") for i, iv in enumerate(ivs[k]) if i >= len(got[k]) or got[k][i] != iv),
            None,
        )
        if wrong is None:
            return quotes["good"], quotes["poor"], ambiguous
        k, i = wrong
        (a, b) = ivs[k].pop(i)
        ambiguous.append(
            {
                "start": a,
                "end": b,
                "label": k,
                "reason": f"{text[a:b]!r} occurs earlier, where a quote of it would land",
            }
        )
