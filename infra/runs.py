"""Run folders: saves that never leave half a model and never replace files they did not write (save_pretrained,
check_save_dir), how a run starts (start_kind: --resume, --overwrite), content fingerprints of models and data.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import common


def content_fingerprint(path, head_bytes: int = 1 << 20) -> str:
    """A short hash of what a file, or the files directly in a folder (a saved model: weights, config, tokenizer;
    not its checkpoints/), hold: each one's name, size and first MiB. Caches key a model by it, not by its path, so
    a model retrained or rebuilt in the same folder is a new key. An adapter's base model is hashed in too. Cheap: a
    retrained model's weights differ in their first MiB (the safetensors header, then the first tensors)."""
    import hashlib

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]:
        with open(f, "rb") as fh:
            h.update(f"{f.name}:{f.stat().st_size}:".encode() + fh.read(head_bytes))
    base = path / "adapter_config.json"
    if base.is_file():
        base = json.loads(base.read_text()).get("base_model_name_or_path") or ""
        h.update(content_fingerprint(base, head_bytes).encode() if Path(base).exists() else base.encode())
    return h.hexdigest()[:12]


def share_files(folder) -> None:
    """Give a saved model folder and its files the permissions the umask gives any new file (0644 and 0755 under
    umask 022): mkdtemp makes 0700 folders and safetensors writes its weights 0600, which a server run as another user
    (or in a container) cannot read."""
    folder = Path(folder)
    os.chmod(folder, 0o777 & ~common._UMASK)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~common._UMASK)


SAVE_RECORD = "saved_files.json"  # in a folder save_pretrained wrote: the names it owns there


# What a model folder saved before SAVE_RECORD existed holds (transformers', peft's and our own files): such a folder
# counts as a save's own only where it also holds the save's marker file (foreign_files)
_MODEL_FILE = re.compile(r"(config|generation_config|adapter_config|tokenizer(_config)?|special_tokens_map|"
                         r"added_tokens|chat_template|vocab|reward_model|sft)\.json|.*\.safetensors(\.index\.json)?|"
                         r"tokenizer\.model|merges\.txt|chat_template\.jinja|value_head\.pt|README\.md")


def foreign_files(folder, owns=(), marker: str = "config.json") -> list[str]:
    """The entries of `folder` that a save into it did not write, and so must never replace or delete: all but those
    its previous save recorded (SAVE_RECORD) and `owns` (what the caller writes there itself: eval.json,
    checkpoints/). A folder saved before saves kept a record counts as one when it holds `marker`, the file that
    this kind of save writes (reward_model.json, sft.json): its model files (_MODEL_FILE) are then its own."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names, record = sorted(p.name for p in folder.iterdir()), folder / SAVE_RECORD
    if record.is_file():
        owned = {SAVE_RECORD, *json.loads(record.read_text())["files"]}
    else:
        owned = {n for n in names if _MODEL_FILE.fullmatch(n)} if (folder / marker).is_file() else set()
    return [n for n in names if n not in owned and n not in owns]


def check_save_dir(folder, owns=(), marker: str = "config.json", flag: str = "") -> None:
    """DataError, one line, when a save into `folder` would replace files it did not write (foreign_files): called
    by save_pretrained, and by a stage before it trains anything. `flag` prefixes the message, as the user typed."""
    foreign = foreign_files(folder, owns, marker)
    if foreign:
        listed = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise common.DataError(f"{flag}{folder}: holds files that a save there did not write ({listed}); a save replaces "
                        "only its own files: name another folder")


def save_pretrained(out_dir, model, tokenizer, files: dict | None = None, keep: tuple[str, ...] = (),
                    owns: tuple[str, ...] = (), **kwargs) -> Path:
    """model.save_pretrained(**kwargs), the tokenizer and `files` ({name: a state dict, torch.save; or for a .json
    name, a dict}) into a temp dir that then replaces out_dir, whose entries named in `keep` it takes over: a reader
    finds the old folder whole or the new one whole (for an instant, none), never half a model. Only a save's own
    files are replaced: out_dir holding anything else (check_save_dir; marker: the first of `files`, else the model's
    config or adapter config) is refused,
    before anything is written. SAVE_RECORD lists what it owns: what it wrote, `keep`, and `owns` (files the caller
    writes there afterwards, e.g. eval.json: the next save drops them with the old model)."""
    import shutil

    import torch
    out_dir = Path(out_dir)
    marker = next(iter(files or {}), "adapter_config.json" if hasattr(model, "peft_config") else "config.json")
    check_save_dir(out_dir, (*keep, *owns), marker)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
        for name, obj in (files or {}).items():
            if name.endswith(".json"):
                common.write_json(tmp / name, obj)
            else:
                torch.save(obj, tmp / name)
        common.write_json(tmp / SAVE_RECORD, {"files": sorted({*(p.name for p in tmp.iterdir()), *keep, *owns})})
        share_files(tmp)  # mkdtemp makes 0700 dirs, safetensors 0600 weights: the usual permissions
    except BaseException:
        shutil.rmtree(tmp)
        raise
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)  # two renames: a directory cannot replace a non-empty one in one
    os.replace(tmp, out_dir)
    for name in keep:
        if (old / name).exists():
            os.replace(old / name, out_dir / name)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def start_kind(out_dir, resume: bool, overwrite: bool, held: list[str], checkpoint: str, resumable: bool,
               replaceable: bool = False) -> str:
    """How a training run starts in out_dir (02, 03), decided before anything is trained: "resume" (--resume, and
    `resumable`: its `checkpoint` is there), "fresh" (`held`, the names of a run's files there, is empty) or "replace"
    (a run there, which --overwrite gives up, or `replaceable`: the zero-flag demo rerun in its own folder). Anything
    else is refused (DataError): a run is never lost to a start that did not ask for it."""
    if resume and resumable:
        return "resume"
    if not held:
        return "fresh"
    if overwrite or replaceable:
        return "replace"
    if resume:
        raise common.DataError(f"--resume: no {checkpoint} in {out_dir}, which holds a run ({', '.join(held)}): "
                        "--overwrite replaces it")
    raise common.DataError(f"{out_dir} holds a run ({', '.join(held)}): --resume continues it from its checkpoint, "
                    "--overwrite replaces it")
