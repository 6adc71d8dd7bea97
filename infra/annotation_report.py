"""01 --output's summary: OUTPUT.summary.json and the lines a run ends with (summarize, print_summary), and no failure
left quiet (report_failures): records and failed ones, spans per record, the unmatched-span rate (App. L), tokens and
the estimated cost (infra/annotator.py: prices_usd); a warning for timed-out requests, and for a failed share above
FAIL_WARN_SHARE, an error when nothing was annotated, each saying why.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import common
from infra import annotator


def summarize(path: Path, args, this_run: Counter, elapsed_s: float, annotate_s: float) -> dict:
    recs = common.read_jsonl(path) if path.exists() else []
    ok = [r for r in recs if r.get("status") == "ok"]
    good, poor = sum(len(r["good_spans"]) for r in ok), sum(len(r["poor_spans"]) for r in ok)
    unmatched = sum(len(r["unmatched_spans"]) for r in ok)
    tokens = Counter()
    for r in recs:
        tokens.update(r.get("usage", {}))
    prices = annotator.prices_usd(args)
    cost = None if prices is None else (tokens["prompt_tokens"] * prices[0] + tokens["completion_tokens"] * prices[1]
                                        ) / 1e6
    return {"records": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
            "good_spans_per_record": round(good / max(1, len(ok)), 3),
            "poor_spans_per_record": round(poor / max(1, len(ok)), 3),
            "unmatched_span_rate": round(unmatched / max(1, good + poor + unmatched), 4),
            "ambiguous_spans": sum(len(r.get("ambiguous_spans", [])) for r in ok),  # flagged, but no quote reaches them
            "prompt_tokens": tokens["prompt_tokens"], "completion_tokens": tokens["completion_tokens"],
            "estimated_cost_usd": (None if cost is None else round(cost, 4)) if args.annotator == "openai" else 0.0,
            "this_run": {"annotated": this_run["ok"] + this_run["failed"], "failed": this_run["failed"],
                         "timed_out": this_run["timed_out"], "elapsed_s": round(elapsed_s, 3),
                         "annotate_s": round(annotate_s, 3)}}


def print_summary(output: Path, summary: dict, this_run: Counter, args) -> None:
    """The summary in one line, and a warning when requests timed out (what to change: --concurrency, --max-tokens or
    --timeout)."""
    print(f"{summary['records']} records ({summary['failed']} failed) in {output}; spans per record: "
          f"{summary['good_spans_per_record']} good, {summary['poor_spans_per_record']} poor; unmatched-span rate "
          f"{summary['unmatched_span_rate']:.2%}; tokens {summary['prompt_tokens']} in / "
          f"{summary['completion_tokens']} out" + ("" if summary["estimated_cost_usd"] is None else
                                                    f", ~${summary['estimated_cost_usd']:.2f}"))
    if this_run["timed_out"]:
        print(f"warning: {this_run['timed_out']} requests timed out after --timeout {args.timeout:g} s: the server "
              f"takes longer than that for --concurrency {args.concurrency} requests of up to --max-tokens "
              f"{args.max_tokens} at once. Lower --concurrency (to what the server runs in parallel) or --max-tokens, "
              "or raise --timeout; --retry-failed redoes them", file=sys.stderr)


FAIL_WARN_SHARE = 0.10  # more failed records than this share is a loud warning; none ok is an error (exit 1)
FAILURE_KINDS = {"unparseable": "the critic's outputs do not parse", "timed out": "requests timed out",
                 "HTTP": "the server refused requests"}  # a reason's start -> what the summary line calls it


def failure_note(path: Path, order: dict) -> str:
    """Why the records of `path` failed, in one line: the most common kind of reason, and the first failure in the
    input's order (`order`: id -> position; the file is in the order the critic answered, which varies run to run)."""
    failed = sorted((r for r in common.read_jsonl(path) if r.get("status") == "failed"),
                    key=lambda r: order.get(r.get("id"), len(order)))
    kinds = Counter(next((v for k, v in FAILURE_KINDS.items() if r.get("reason", "").startswith(k)),
                         "the critic failed") for r in failed)
    first = " ".join(str(failed[0].get("reason", "")).split())
    return f"{kinds.most_common(1)[0][0]}; first failure ({failed[0]['id']}): {first[:300]}"


def report_failures(path: Path, summary: dict, ids: list) -> None:
    """No failure stays quiet: none annotated is an error line (01's caller exits 1), a failed share above
    FAIL_WARN_SHARE a warning; both say why (failure_note). ids: the input records' ids, in order."""
    n, failed, order = summary["records"], summary["failed"], {i: k for k, i in enumerate(ids)}
    if n and not summary["ok"]:
        print(f"error: 0 of {n} records annotated: {failure_note(path, order)}", file=sys.stderr)
    elif n and failed / n > FAIL_WARN_SHARE:
        print(f"warning: {failed} of {n} records failed ({failed / n:.0%}): {failure_note(path, order)}. Stage 2 "
              "skips them; --retry-failed redoes them", file=sys.stderr)
