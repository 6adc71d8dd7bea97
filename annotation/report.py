"""--overwrite: 01 --output, what made it and its summary. OUTPUT.made_by.json, written before the first record
(start_output), records the settings that shape the annotations (made_by: --task, --annotator, --model, the dataset's
content, field overrides, --generate-with, --use-human-feedback); a rerun resumes only a run made with the same ones,
and is refused in one line naming each that differs (check_made_by), before anything is written: a rerun with
another critic or dataset kept the old annotations in silence, or mixed two runs' records in one file. --overwrite
starts the output afresh instead. The same dataset is its content, not its path (a copy resumes), and for a local
file all of it (a larger --limit resumes); a hub dataset is its id and split. An output written before this record
existed is resumed with a warning.
OUTPUT.summary.json and the lines a run ends with (summarize, print_summary), and no failure left quiet
(report_failures): records and failed ones, spans per record, the unmatched-span rate (App. L), tokens and the
estimated cost (annotation/annotator.py: prices_usd); a warning for timed-out requests, and for a failed share above
FAIL_WARN_SHARE, an error when nothing was annotated, each saying why.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import common
from annotation import annotator


def add_args(p) -> None:
    g = p.add_argument_group("the output (annotation/report.py)")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start --output afresh, whatever settings made the annotations it holds",
    )


# ----------------------------------------------------------------------------------------------------------------------
# What made the output: OUTPUT.made_by.json, and a rerun with other settings refused
# ----------------------------------------------------------------------------------------------------------------------

FLAGS = {
    "task": "--task",
    "annotator": "--annotator",
    "model": "--model",
    "dataset_fingerprint": "--dataset",
    "prompt_field": "--prompt-field",
    "response_field": "--response-field",
    "id_field": "--id-field",
    "generate_with": "--generate-with",
    "use_human_feedback": "--use-human-feedback",
}  # compared, in this order


def made_by_path(output: Path) -> Path:
    return Path(output).with_suffix(".made_by.json")


def dataset_fingerprint(args, rows: list[tuple[str, dict]]) -> str:
    """The dataset's identity: "sha256:..." of every row read from a local file or folder (its content: a copy at
    another path is the same dataset, and --limit is applied after the rows are read); "hub:ID[SPLIT]" for a hub
    dataset (its rows are read up to --limit); "demo" for the demo's records."""
    if args.dataset is None:
        return "demo"
    if not Path(args.dataset).exists():
        return f"hub:{args.dataset}[{args.split}]"
    h = hashlib.sha256()
    for _, row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
    return f"sha256:{h.hexdigest()[:16]}"


def made_by(args, rows: list[tuple[str, dict]]) -> dict:
    """The settings that shape the annotations (FLAGS), and the dataset as given (shown, not compared)."""
    return {
        "task": args.task,
        "annotator": args.annotator,
        "model": args.model if args.annotator == "openai" else None,
        "dataset": args.dataset,
        "dataset_fingerprint": dataset_fingerprint(args, rows),
        "prompt_field": args.prompt_field,
        "response_field": args.response_field,
        "id_field": args.id_field,
        "generate_with": args.generate_with,
        "use_human_feedback": args.use_human_feedback,
    }


def _shown(key: str, info: dict) -> str:
    value = info.get(key)
    if key == "dataset_fingerprint":
        return f"{info.get('dataset') or 'the demo'} ({value})"
    return {None: "(none)", True: "on", False: "off"}.get(value, value) if not isinstance(value, str) else value


def check_made_by(output: Path, now: dict, overwrite: bool) -> None:
    """Before anything is written: DataError, one line naming each setting that differs, when --output holds records
    made with other settings (OUTPUT.made_by.json); nothing to check with --overwrite, for a new or empty output, or
    for one written before the record existed (a warning: resumed as this run's)."""
    output = Path(output)
    if overwrite or not output.is_file() or not output.stat().st_size:
        return
    path = made_by_path(output)
    if not path.is_file():
        print(
            f"warning: {output} has no {path.name} (written before 01 recorded what made it): resuming it as made "
            "with this run's settings",
            file=sys.stderr,
        )
        return
    try:
        then = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise common.DataError(f"{path}: not valid JSON ({e}); --overwrite starts {output} afresh") from None
    differ = [
        f"{flag} {_shown(k, then)}, not {_shown(k, now)}"
        for k, flag in FLAGS.items()
        if k in then and then[k] != now[k]
    ]
    if differ:
        with open(output, "rb") as f:
            n = sum(1 for line in f if line.strip())
        raise common.DataError(
            f"{output} holds {n} records made with other settings: {'; '.join(differ)}. A rerun "
            "resumes only the run that made it: --overwrite starts it afresh, or choose another "
            "--output"
        )


def start_output(output: Path, now: dict, overwrite: bool) -> None:
    """Before the first record: --overwrite removes the output and its summary; OUTPUT.made_by.json records `now`."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for path in (output, output.with_suffix(".summary.json")):
            path.unlink(missing_ok=True)
    common.write_json(made_by_path(output), now)


# ----------------------------------------------------------------------------------------------------------------------
# The summary
# ----------------------------------------------------------------------------------------------------------------------


def summarize(path: Path, args, this_run: Counter, elapsed_s: float, annotate_s: float) -> dict:
    recs = common.read_jsonl(path) if path.exists() else []
    ok = [r for r in recs if r.get("status") == "ok"]
    good, poor = sum(len(r["good_spans"]) for r in ok), sum(len(r["poor_spans"]) for r in ok)
    unmatched = sum(len(r["unmatched_spans"]) for r in ok)
    tokens = Counter()
    for r in recs:
        tokens.update(r.get("usage", {}))
    prices = annotator.prices_usd(args)
    cost = (
        None
        if prices is None
        else (tokens["prompt_tokens"] * prices[0] + tokens["completion_tokens"] * prices[1]) / 1e6
    )
    made = made_by_path(path)
    return {
        "records": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "good_spans_per_record": round(good / max(1, len(ok)), 3),
        "poor_spans_per_record": round(poor / max(1, len(ok)), 3),
        "unmatched_span_rate": round(unmatched / max(1, good + poor + unmatched), 4),
        "ambiguous_spans": sum(len(r.get("ambiguous_spans", [])) for r in ok),  # flagged, but no quote reaches them
        "prompt_tokens": tokens["prompt_tokens"],
        "completion_tokens": tokens["completion_tokens"],
        "estimated_cost_usd": (None if cost is None else round(cost, 4)) if args.annotator == "openai" else 0.0,
        "this_run": {
            "annotated": this_run["ok"] + this_run["failed"],
            "failed": this_run["failed"],
            "timed_out": this_run["timed_out"],
            "elapsed_s": round(elapsed_s, 3),
            "annotate_s": round(annotate_s, 3),
        },
        "made_by": json.loads(made.read_text(encoding="utf-8")) if made.is_file() else None,
    }


def print_summary(output: Path, summary: dict, this_run: Counter, args) -> None:
    """The summary in one line, and a warning when requests timed out (what to change: --concurrency, --max-tokens or
    --timeout)."""
    print(
        f"{summary['records']} records ({summary['failed']} failed) in {output}; spans per record: "
        f"{summary['good_spans_per_record']} good, {summary['poor_spans_per_record']} poor; unmatched-span rate "
        f"{summary['unmatched_span_rate']:.2%}; tokens {summary['prompt_tokens']} in / "
        f"{summary['completion_tokens']} out"
        + ("" if summary["estimated_cost_usd"] is None else f", ~${summary['estimated_cost_usd']:.2f}")
    )
    if this_run["timed_out"]:
        print(
            f"warning: {this_run['timed_out']} requests timed out after --timeout {args.timeout:g} s: the server "
            f"takes longer than that for --concurrency {args.concurrency} requests of up to --max-tokens "
            f"{args.max_tokens} at once. Lower --concurrency (to what the server runs in parallel) or --max-tokens, "
            "or raise --timeout; --retry-failed redoes them",
            file=sys.stderr,
        )


FAIL_WARN_SHARE = 0.10  # more failed records than this share is a loud warning; none ok is an error (exit 1)
FAILURE_KINDS = {
    "unparseable": "the critic's outputs do not parse",
    "timed out": "requests timed out",
    "HTTP": "the server refused requests",
}  # a reason's start -> what the summary line calls it


def failure_note(path: Path, order: dict) -> str:
    """Why the records of `path` failed, in one line: the most common kind of reason, and the first failure in the
    input's order (`order`: id -> position; the file is in the order the critic answered, which varies run to run)."""
    failed = sorted(
        (r for r in common.read_jsonl(path) if r.get("status") == "failed"),
        key=lambda r: order.get(r.get("id"), len(order)),
    )
    kinds = Counter(
        next((v for k, v in FAILURE_KINDS.items() if r.get("reason", "").startswith(k)), "the critic failed")
        for r in failed
    )
    first = " ".join(str(failed[0].get("reason", "")).split())
    return f"{kinds.most_common(1)[0][0]}; first failure ({failed[0]['id']}): {first[:300]}"


def report_failures(path: Path, summary: dict, ids: list) -> None:
    """No failure stays quiet: none annotated is an error line (01's caller exits 1), a failed share above
    FAIL_WARN_SHARE a warning; both say why (failure_note). ids: the input records' ids, in order."""
    n, failed, order = summary["records"], summary["failed"], {i: k for k, i in enumerate(ids)}
    if n and not summary["ok"]:
        print(f"error: 0 of {n} records annotated: {failure_note(path, order)}", file=sys.stderr)
    elif n and failed / n > FAIL_WARN_SHARE:
        print(
            f"warning: {failed} of {n} records failed ({failed / n:.0%}): {failure_note(path, order)}. Stage 2 "
            "skips them; --retry-failed redoes them",
            file=sys.stderr,
        )
