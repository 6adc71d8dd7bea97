"""--dataset, --data, --prompts: dataset layouts. Records from a local .jsonl / .json / .parquet file or a hub id
(read_rows), each error naming the file and line (01 --dataset, 04 --data); stage 3's prompts (read_prompts: 03
--prompts). Stage 1's side: each --task preset's fields (FIELDS, to_records: 01 --prompt-field, --response-field,
--id-field) and the zero-flag demo's inputs (prepare_demo: 01 --demo-dir, --build-base); and its annotations as stage 2
and the baselines read them (load_annotations, split_records: 02 --data, --val-frac).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import common


DATA_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")  # read_rows reads these locally; else: a hub id


def read_rows(data: str, split: str = "test", required: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """[(where, record)] from a local .jsonl / .jsonl.gz / .json / .parquet file or, through `datasets`, a hub
    dataset id; each `required` field a string. `where` names the file and line (or record) for error messages; a
    failure is a one-line DataError. A .json may hold a list of records, the paper's {id: record}, or JSON Lines."""
    path = Path(data)
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return [(f"{path}:{n}", r) for n, r in common.iter_jsonl(path, required)]
    if path.name.endswith(DATA_FILE_SUFFIXES):
        if not path.is_file():
            raise common.DataError(f"{path}: no such file")
        rows = _read_json_or_parquet(path)
    else:
        try:
            from datasets import load_dataset
            rows = [(f"{data}[{split}] record {i}", dict(r)) for i, r in enumerate(load_dataset(data, split=split))]
        except Exception as e:  # noqa: BLE001 - offline, no such repo or split, gated: one line, not a traceback
            raise common.DataError(f"{data}[{split}]: cannot load it ({type(e).__name__}: "
                                   f"{common.first_line(e)})") from None
    for where, row in rows:
        for f in required:
            if f not in row:
                raise common.DataError(f"{where}: missing field '{f}'")
            if not isinstance(row[f], str):
                raise common.DataError(f"{where}: field '{f}' must be a string")
    return rows


def _read_json_or_parquet(path: Path) -> list[tuple[str, dict]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return [(f"{path}: record {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    text = "\n".join(common.decode_utf8(line, path, n) for n, line in enumerate(path.read_bytes().split(b"\n"), 1))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines under a .json name
            return [(f"{path}:{n}", r) for n, r in common.iter_jsonl(path)]
        raise common.DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        data = [{"id": k, **v} for k, v in data.items()]  # {id: record}, as the paper's own files are laid out
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise common.DataError(f"{path}: expected a list of JSON objects or an object of objects keyed by id")
    return [(f"{path}: record {i}", r) for i, r in enumerate(data)]


def read_prompts(path: str, task: str) -> list[dict]:
    """The prompt records, read before anything is written: a JSONL file with a "prompt" field or, for --task code,
    a code benchmark in any layout (tasks.code.read_code_problems), each prompt with its tests for a critic that runs
    them: a hub dataset, a .json or .parquet file, or a JSONL file whose first record holds tests."""
    if task == "code" and _holds_tests(path):
        from tasks.code import read_code_problems
        numbered = list(enumerate(read_code_problems(path), 1))
    else:
        numbered = list(common.iter_jsonl(path, required=("prompt",)))  # (line number, record)
    records = [rec for _, rec in numbered]
    if not records:
        raise common.DataError(f"{path}: no prompts")
    if task == "demo":  # its exact critic and monitor read the facts off each post: own prompts fail here, not mid-run
        from tasks.demo import demo_post_facts
        for lineno, rec in numbered:
            try:
                demo_post_facts(rec["prompt"])
            except ValueError:
                raise common.DataError(f"{path}:{lineno}: prompt: not a demo post (--task demo reads the demo's facts "
                                       "off each post; --task summarization or qa for your own prompts)") from None
    return records


def _holds_tests(path: str) -> bool:
    """True unless `path` is a JSONL file whose first record holds no tests ("test", "test_list", "entry_point"): a
    plain file of prompts."""
    if not Path(path).name.endswith((".jsonl", ".jsonl.gz")) or not Path(path).is_file():
        return True
    first = next(iter(common.iter_jsonl(path)), (0, {}))[1]
    return any(k in first for k in ("test", "test_list", "entry_point"))


def load_split(data: str, prompt_field: str, reference_field=None, split="test", limit=None):
    """Stage 4's held-out split (04 --data): [{"id", "prompt", "reference"?}] from a JSONL file, a .json/.parquet
    file or a hub dataset (read_rows); errors name the file, line and field."""
    raw = [rec for _, rec in read_rows(data, split, tuple(f for f in (prompt_field, reference_field) if f))]
    raw = raw[:limit] if limit is not None else raw
    if not raw:
        raise common.DataError(f"{data}: no records to evaluate (empty split)")
    records, seen = [], set()
    for i, rec in enumerate(raw):
        rid = str(rec.get("id", i))
        if rid in seen:
            raise common.DataError(f"{data}: duplicate id {rid!r}")
        seen.add(rid)
        records.append({"id": rid, "prompt": rec[prompt_field],
                        **({"reference": rec[reference_field]} if reference_field else {})})
    return records


# ----------------------------------------------------------------------------------------------------------------------
# Stage 1's records: rows of 01 --dataset (or the demo's), then the --task preset's fields -> {"id", "prompt",
# "response", ...}
# ----------------------------------------------------------------------------------------------------------------------

FIELDS = {  # --task -> what --prompt-field, --response-field and --id-field default to (to_records applies them)
    "demo": dict(prompt_field="prompt", response_field="response", id_field="id"),
    "summarization": dict(prompt_field="subreddit, title, post: TL;DR", response_field="generated_summary_for_feedback",
                          id_field="id"),
    "code": dict(prompt_field="the layout's", response_field="the layout's solution", id_field="question_id, task_id"),
    "qa": dict(prompt_field="instruction", response_field="completions (a record each)", id_field="id")}
DEMO_FILES = {"sft": ("sft", 2000), "prompts": ("train", 1000), "eval": ("eval", 200)}  # name: (demo split, size)
# The reward model's data: 16000 summaries. On 2000 the demo's reward model memorised its examples and found 1 mistake
# in 5: the rule "is this word in the post?" needs many fresh examples (bench/README.md, "What the demo's reward model
# needed").
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
        return "the demo", [(f"demo record {i}", r) for i, r in enumerate(demo_dataset(split, args.limit or n,
                                                                                        mistakes))]
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
            raise common.DataError(f"{args.dataset}[{args.split}]: cannot load it ({type(e).__name__}: "
                                   f"{common.first_line(e)})") from None
        return f"{args.dataset}[{args.split}]", read_rows(local)
    split = args.split if args.limit is None else f"{args.split}[:{args.limit}]"
    local = path.name.endswith(DATA_FILE_SUFFIXES)
    return args.dataset if local else f"{args.dataset}[{split}]", read_rows(args.dataset, split)


def field(row: dict, name: str, where: str) -> str:
    if name not in row:
        raise common.DataError(f"{where}: missing field '{name}'")
    if not isinstance(row[name], str):
        raise common.DataError(f"{where}: field '{name}' must be a string, got {type(row[name]).__name__}")
    return row[name]


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
        problem = layout and code_problem(row, where, layout, need_reference=need_response and not
                                          args.response_field, prompt_field=args.prompt_field)
        if problem:  # code: the benchmark's prompt, its reference solution as the response, its tests
            prompt = problem["prompt"]
        elif args.prompt_field:
            prompt = field(row, args.prompt_field, where)
        elif args.task == "summarization":  # the TL;DR prompt of "Learning to summarize from human feedback"
            prompt = (f"SUBREDDIT: r/{row.get('subreddit', '')}\nTITLE: {field(row, 'title', where)}\n"
                      f"POST: {field(row, 'post', where)}\nTL;DR:")
        else:
            prompt = field(row, {"code": "question", "qa": "instruction"}.get(args.task, "prompt"), where)
        if problem and not args.response_field:
            out = [(rid, problem["reference"] if need_response else "")]
        elif args.response_field or args.task != "qa" or not need_response:
            name = args.response_field or {"summarization": "generated_summary_for_feedback"}.get(args.task,
                                                                                                   "response")
            out = [(rid, field(row, name, where) if need_response else "")]
        else:  # UltraFeedback: one record per completion
            completions = row.get("completions")
            if not isinstance(completions, list) or not completions:
                raise common.DataError(f"{where}: field 'completions' must be a non-empty list")
            out = [(f"{rid}-{k}", field(c if isinstance(c, dict) else {}, "response", f"{where} completions[{k}]"))
                   for k, c in enumerate(completions)]
        extra = {"test": problem["test"]} if problem else {}
        if args.task == "summarization":
            extra = {k: row[src] for k, src in (("reference", "ideal_human_summary"), ("human_feedback", "feedback"))
                     if isinstance(row.get(src), str)}
            if args.use_human_feedback and "human_feedback" not in extra:
                raise common.DataError(f"{where}: missing field 'feedback' (needed by --use-human-feedback)")
        if isinstance(row.get("reference"), str):
            extra["reference"] = row["reference"]
        for key, response in out:
            if key in seen:
                raise common.DataError(f"{where}: duplicate id {key!r} (first at {seen[key]}); pass --id-field")
            seen[key] = where
            records.append({"id": key, "prompt": prompt, "response": response, **extra})
    return records[:args.limit] if args.limit is not None else records


def add_demo_args(p) -> None:
    g = p.add_argument_group("the zero-flag demo's inputs: --task demo without --dataset (tasks/data.py: prepare_demo)")
    g.add_argument("--demo-dir", default=None, help="where base/ and data/ go (default: the folder of --output)")
    g.add_argument("--build-base", action=argparse.BooleanOptionalAction, default=True,
                   help="build <demo-dir>/base (the tiny pretrained model) if it is missing")


def prepare_demo(args) -> None:
    """The zero-flag demo's inputs for later stages: the tiny base model and the SFT/prompt/eval files."""
    from tasks.demo import build_demo_base, demo_dataset
    demo_dir = Path(args.demo_dir or Path(args.output).parent)
    for name, (split, n) in DEMO_FILES.items():
        common.write_jsonl(demo_dir / "data" / f"{name}.jsonl", demo_dataset(split, n))
    base = demo_dir / "base"
    if args.build_base and not ((base / "config.json").is_file() and (base / "tokenizer.json").is_file()):
        print(f"building the demo base model in {base} (tokenizer + 0.6M-parameter Llama, ~25 s on CPU)")
        shutil.rmtree(base, ignore_errors=True)  # what an interrupted build left (the tokenizer is saved last)
        build_demo_base(base, seed=args.seed)


# ----------------------------------------------------------------------------------------------------------------------
# Stage 1's annotations as stage 2 and the baselines read them: the usable records, a deterministic train/val split
# ----------------------------------------------------------------------------------------------------------------------


def load_annotations(path) -> tuple[list[dict], int]:
    """(usable records, number of status == "failed" records). DataError 'file:line: ...' on a malformed record."""
    records = list(common.iter_jsonl(path, required=("prompt", "response")))
    usable, failed = [], 0
    for lineno, rec in records:
        if rec.get("status", "ok") == "failed":
            failed += 1
            continue
        if not isinstance(rec.get("critique"), str):
            raise common.DataError(f"{path}:{lineno}: field 'critique' must be a string")
        for name in ("good_spans", "poor_spans"):
            if not isinstance(rec.get(name), list) or not all(isinstance(s, str) for s in rec[name]):
                raise common.DataError(f"{path}:{lineno}: field '{name}' must be a list of strings")
        usable.append(rec)
    if not usable:
        raise common.DataError(f"{path}: no usable records ({len(records)} read, {failed} with status 'failed')")
    return usable, failed


def split_records(records: list[dict], val_frac: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, val): a seeded shuffle, then the first round(val_frac * n) records (at least 1) are held out."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = min(max(1, round(val_frac * len(records))), len(records) - 1) if val_frac > 0 and len(records) > 1 else 0
    return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]
