"""--task's fields (--prompt-field, --response-field, --id-field), --dataset, --split, --limit, --demo-dir,
--build-base: stage 1's records. Rows of 01 --dataset (infra/data.py: read_rows), or the demo's without it, and the
--task preset's fields applied to them -> {"id", "prompt", "response", ...} (dataset_rows, to_records); and the
zero-flag demo's inputs for the later stages, the tiny base model and the SFT / prompt / eval files (prepare_demo).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import common
from infra.data import DATA_FILE_SUFFIXES, field, read_rows

FIELDS = {  # --task -> what --prompt-field, --response-field and --id-field default to (to_records applies them)
    "demo": dict(prompt_field="prompt", response_field="response", id_field="id"),
    "summarization": dict(
        prompt_field="subreddit, title, post: TL;DR", response_field="generated_summary_for_feedback", id_field="id"
    ),
    "code": dict(prompt_field="the layout's", response_field="the layout's solution", id_field="question_id, task_id"),
    "qa": dict(prompt_field="instruction", response_field="completions (a record each)", id_field="id"),
}
DEMO_FILES = {"sft": ("sft", 2000), "prompts": ("train", 1000), "eval": ("eval", 200)}  # name: (demo split, size)
# The reward model's data: 16000 summaries. On 2000 the demo's reward model memorised its examples and found 1 mistake
# in 5: the rule "is this word in the post?" needs many fresh examples (bench/rm_levers/README.md, "What the demo's
# reward model needed").
DEMO_ANNOTATE = ("annotate", 16000, 0.55)  # (demo split, size, share with mistakes)


def dataset_rows(args) -> list[tuple[str, dict]]:
    """[(where, row)] of --dataset, or of the demo's records without it: `where` names the file and line (or record)
    for error messages (read_rows). DataError "no records in FILE" for a file that holds none (empty, or blank lines
    only): a run with nothing to annotate would write an empty output and end as if it had succeeded."""
    source, rows = _dataset_source_rows(args)
    if not rows:
        raise common.DataError(f"no records in {source}")
    return rows


def _dataset_source_rows(args) -> tuple[str, list[tuple[str, dict]]]:
    """(what was read: the file, or the hub id and split; its rows) for dataset_rows."""
    if args.dataset is None:
        from tasks.demo import demo_dataset

        split, n, mistakes = DEMO_ANNOTATE
        return "the demo", [
            (f"demo record {i}", r) for i, r in enumerate(demo_dataset(split, args.limit or n, mistakes))
        ]
    path = Path(args.dataset)
    if path.is_dir():
        found = [path / f"{args.split}{ext}" for ext in (".jsonl", ".json", ".parquet")]
        path = next((f for f in found if f.is_file()), None)
        if path is None:
            raise common.DataError(f"{args.dataset}: no {args.split}.jsonl, .json or .parquet in this folder")
        return str(path), read_rows(str(path))
    if args.task == "summarization" and not path.name.endswith(DATA_FILE_SUFFIXES):
        try:  # SLF5K's loading script no longer runs: fetch its <split>.jsonl directly
            from huggingface_hub import hf_hub_download

            local = hf_hub_download(args.dataset, f"{args.split}.jsonl", repo_type="dataset")
        except Exception as e:  # noqa: BLE001 - offline, no such repo or split, gated...: one line, not a traceback
            raise common.DataError(
                f"{args.dataset}[{args.split}]: cannot load it ({type(e).__name__}: {common.first_line(e)})"
            ) from None
        return f"{args.dataset}[{args.split}]", read_rows(local)
    split = args.split if args.limit is None else f"{args.split}[:{args.limit}]"
    local = path.name.endswith(DATA_FILE_SUFFIXES)
    return args.dataset if local else f"{args.dataset}[{split}]", read_rows(args.dataset, split)


def to_records(rows, args) -> list[dict]:
    """Apply the task's field preset (overridable with --prompt-field/--response-field/--id-field)."""
    need_response = args.generate_with is None
    if args.task == "code":
        from tasks.code import code_layout, code_problem
    layout = code_layout(rows[0][1]) if args.task == "code" and rows else None  # kodcode, humaneval, mbpp
    id_field = args.id_field or {"code": "question_id" if layout == "kodcode" else "task_id"}.get(args.task, "id")
    records, seen = [], {}
    for i, (where, row) in enumerate(rows):
        rid = str(row[id_field]) if id_field in row else f"{args.split}-{i}"
        problem = layout and code_problem(
            row, where, layout, need_reference=need_response and not args.response_field, prompt_field=args.prompt_field
        )
        if problem:  # code: the benchmark's prompt, its reference solution as the response, its tests
            prompt = problem["prompt"]
        elif args.prompt_field:
            prompt = field(row, args.prompt_field, where, "--prompt-field")
        elif args.task == "summarization":  # the TL;DR prompt of "Learning to summarize from human feedback"
            prompt = (
                f"SUBREDDIT: r/{row.get('subreddit', '')}\nTITLE: {field(row, 'title', where, '--prompt-field')}"
                f"\nPOST: {field(row, 'post', where, '--prompt-field')}\nTL;DR:"
            )
        else:
            prompt = field(
                row, {"code": "question", "qa": "instruction"}.get(args.task, "prompt"), where, "--prompt-field"
            )
        if problem and not args.response_field:
            out = [(rid, problem["reference"] if need_response else "")]
        elif args.response_field or args.task != "qa" or not need_response:
            name = args.response_field or {"summarization": "generated_summary_for_feedback"}.get(args.task, "response")
            out = [(rid, field(row, name, where, "--response-field") if need_response else "")]
        else:  # UltraFeedback: one record per completion
            completions = row.get("completions")
            if not isinstance(completions, list) or not completions:
                raise common.DataError(f"{where}: field 'completions' must be a non-empty list")
            out = [
                (f"{rid}-{k}", field(c if isinstance(c, dict) else {}, "response", f"{where} completions[{k}]"))
                for k, c in enumerate(completions)
            ]
        extra = {"test": problem["test"]} if problem else {}
        if args.task == "summarization":
            extra = {
                k: row[src]
                for k, src in (("reference", "ideal_human_summary"), ("human_feedback", "feedback"))
                if isinstance(row.get(src), str)
            }
            if args.use_human_feedback and "human_feedback" not in extra:
                raise common.DataError(f"{where}: missing field 'feedback' (needed by --use-human-feedback)")
        if isinstance(row.get("reference"), str):
            extra["reference"] = row["reference"]
        for key, response in out:
            if key in seen:
                raise common.DataError(f"{where}: duplicate id {key!r} (first at {seen[key]}); pass --id-field")
            seen[key] = where
            records.append({"id": key, "prompt": prompt, "response": response, **extra})
    return records[: args.limit] if args.limit is not None else records


def add_demo_args(p) -> None:
    g = p.add_argument_group(
        "the zero-flag demo's inputs: --task demo without --dataset (annotation/inputs.py: prepare_demo)"
    )
    g.add_argument("--demo-dir", default=None, help="where base/ and data/ go (default: the folder of --output)")
    g.add_argument(
        "--build-base",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build <demo-dir>/base (the tiny pretrained model) if it is missing",
    )


def prepare_demo(args) -> None:
    """The zero-flag demo's inputs for later stages: the tiny base model and the SFT/prompt/eval files."""
    from infra.tiny_model import build_demo_base
    from tasks.demo import demo_dataset

    demo_dir = Path(args.demo_dir or Path(args.output).parent)
    for name, (split, n) in DEMO_FILES.items():
        common.write_jsonl(demo_dir / "data" / f"{name}.jsonl", demo_dataset(split, n))
    base = demo_dir / "base"
    if args.build_base and not ((base / "config.json").is_file() and (base / "tokenizer.json").is_file()):
        print(f"building the demo base model in {base} (tokenizer + 0.6M-parameter Llama, ~25 s on CPU)")
        shutil.rmtree(base, ignore_errors=True)  # what an interrupted build left (the tokenizer is saved last)
        build_demo_base(base, seed=args.seed)
