"""--dataset, --data, --prompts: dataset layouts. Records from a local .jsonl / .json / .parquet file or a hub id
(read_rows), each error naming the file and line (01 --dataset, 04 --data); stage 3's prompts (read_prompts: 03
--prompts).
"""
from __future__ import annotations

import json
from pathlib import Path

import common
from tasks import plugin


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


def read_prompts(path: str, task: str, critic: str) -> list[dict]:
    """The prompt records, read before anything is written: a JSONL file with a "prompt" field or, for --task code
    --critic program or python:..., any benchmark layout (tasks.code.read_code_problems), whose tests the critic
    runs."""
    if task == "code" and (critic == "program" or plugin.is_plugin(critic)):
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
