"""--dataset, --data, --prompts: dataset layouts. Records from a local .jsonl / .json / .parquet file or a hub id
(read_rows), each error naming the file and line (01 --dataset, 04 --data); the code benchmarks in their layouts
(read_code_problems: tasks/code.py's code_problem per record); stage 3's prompts (read_prompts: 03 --prompts); stage
4's held-out split (load_split); stage 1's annotations as stage 2 and the baselines read them (load_annotations,
split_records: 02 --data, --val-frac). Stage 1's own side (each --task preset's fields, the zero-flag demo's inputs):
annotation/records.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import common
from tasks.code import code_layout, code_problem


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
            raise common.DataError(
                f"{data}[{split}]: cannot load it ({type(e).__name__}: {common.first_line(e)})"
            ) from None
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
    a code benchmark in any layout (read_code_problems), each prompt with its tests for a critic that runs
    them: a hub dataset, a .json or .parquet file, or a JSONL file whose first record holds tests."""
    if task == "code" and _holds_tests(path):
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
                raise common.DataError(
                    f"{path}:{lineno}: prompt: not a demo post (--task demo reads the demo's facts "
                    "off each post; --task summarization or qa for your own prompts)"
                ) from None
    return records


def read_code_problems(data: str, split: str = "test", limit: int | None = None, **fields) -> list[dict]:
    """Code problems from a .jsonl / .jsonl.gz / .json / .parquet file or a hub dataset id, in any layout above.
    Records without an id get their index."""
    rows = read_rows(data, split)
    rows = rows[:limit] if limit is not None else rows
    if not rows:
        raise common.DataError(f"{data}: no records (empty split)")
    layout, seen, problems = code_layout(rows[0][1]), set(), []
    for i, (where, row) in enumerate(rows):
        prob = code_problem(row, where, layout, **fields)
        prob["id"] = prob.get("id", str(i))
        if prob["id"] in seen:
            raise common.DataError(f"{where}: duplicate id {prob['id']!r}")
        seen.add(prob["id"])
        problems.append(prob)
    return problems


def _holds_tests(path: str) -> bool:
    """True unless `path` is a JSONL file whose first record holds no tests ("test", "test_list", "entry_point"): a
    plain file of prompts."""
    if not Path(path).name.endswith((".jsonl", ".jsonl.gz")) or not Path(path).is_file():
        return True
    first = next(iter(common.iter_jsonl(path)), (0, {}))[1]
    return any(k in first for k in ("test", "test_list", "entry_point"))


def field(row: dict, name: str, where: str, flag: str | None = None) -> str:
    """row[name], a string; DataError naming the record and field, and `flag` (the one that picks another field)."""
    if name not in row:
        raise common.DataError(f"{where}: missing field '{name}'" + (f" (set {flag})" if flag else ""))
    if not isinstance(row[name], str):
        raise common.DataError(f"{where}: field '{name}' must be a string, got {type(row[name]).__name__}")
    return row[name]


def load_split(data: str, prompt_field: str, reference_field=None, split="test", limit=None):
    """Stage 4's held-out split (04 --data): [{"id", "prompt", "reference"?}] from a JSONL file, a .json/.parquet
    file or a hub dataset (read_rows); errors name the file, line and field, and the flag that picks a missing one."""
    rows = read_rows(data, split)
    for where, rec in rows:  # the task preset's field (--task qa: instruction) may not be the data's
        field(rec, prompt_field, where, "--prompt-field")
        if reference_field:
            field(rec, reference_field, where, "--reference-field")
    raw = [rec for _, rec in rows]
    raw = raw[:limit] if limit is not None else raw
    if not raw:
        raise common.DataError(f"{data}: no records to evaluate (empty split)")
    records, seen = [], set()
    for i, rec in enumerate(raw):
        rid = str(rec.get("id", i))
        if rid in seen:
            raise common.DataError(f"{data}: duplicate id {rid!r}")
        seen.add(rid)
        records.append(
            {"id": rid, "prompt": rec[prompt_field], **({"reference": rec[reference_field]} if reference_field else {})}
        )
    return records


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
