"""Revision SFT data for the SFT + reflection baseline (§4.3): (prompt, flawed answer, critique) -> reference.

    python baselines/reflection_data.py --data runs/demo/pairs_annotations.jsonl --output runs/demo/revisions.jsonl
    python 03_train_policy.py --model runs/demo/sft --sft-data runs/demo/revisions.jsonl --sft-output-dir \\
        runs/demo/reviser --steps 0 --output-dir runs/demo/reviser_run         # trains the reviser (03's SFT), no PPO
    python 04_evaluate.py --policy sft=runs/demo/sft --reflect --reviser runs/demo/reviser --reflect-critic program

The paper prompts an instruction-tuned LLM to revise its answer with the reward model's critique; the demo's toy
policy cannot follow a critique it was never trained on, so it learns to: each annotated answer with a poor span
(--all: every answer) becomes one SFT example whose prompt is revision_prompt(prompt, answer, critique), the
text 04 --reflect builds, and whose target is the record's reference, laid out as the answer is (its leading
whitespace). Annotations come from 01_annotate.py (the demo's carry its reference); records that failed or have no
reference are skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from infra.data import load_annotations  # noqa: E402


def revision_prompt(prompt: str, response: str, critique: str) -> str:
    """SFT + reflection (§4.3): what a policy revises its answer from, given a critique of it; the same in the
    revision SFT data (revision_examples) and in 04 --reflect."""
    return f"{prompt}{response}\ncritique: {critique.strip()}\nrevision:"


def revision_examples(records: list[dict], reference_field: str = "reference", flawed_only: bool = True) -> list[dict]:
    """[{"id", "prompt", "response"}] for 03 --sft-data: the revision prompt of each usable record (status not
    failed, a string reference; with flawed_only, at least one poor span) and its reference as the target."""
    out = []
    for rec in records:
        if rec.get("status", "ok") == "failed" or not isinstance(rec.get(reference_field), str):
            continue
        if flawed_only and not rec["poor_spans"]:
            continue
        lead = rec["response"][: len(rec["response"]) - len(rec["response"].lstrip())]
        out.append(
            {
                "id": rec.get("id"),
                "prompt": revision_prompt(rec["prompt"], rec["response"], rec["critique"]),
                "response": lead + rec[reference_field].lstrip(),
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="annotations JSONL of 01_annotate.py, with a reference per record")
    p.add_argument("--reference-field", default="reference", help="the field holding the revision's target")
    p.add_argument("--all", action="store_true", help="every annotated answer, not only those with a poor span")
    p.add_argument("--output", required=True, help="revision SFT data JSONL (prompt, response), for 03 --sft-data")
    args = p.parse_args(argv)
    records, _ = load_annotations(args.data)  # the same checks as stage 2's: file, line and field named
    examples = revision_examples(records, args.reference_field, not args.all)
    if not examples:
        raise common.DataError(
            f"{args.data}: no record with a '{args.reference_field}' field" + ("" if args.all else " and a poor span")
        )
    common.write_jsonl(args.output, examples)
    print(f"wrote {len(examples)} revision examples of {len(records)} records to {args.output}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
