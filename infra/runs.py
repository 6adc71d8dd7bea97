"""--output-dir, --resume, --overwrite: run folders. Saves that never leave half a model and never replace files they
did not write (save_pretrained, check_save_dir), how a run starts (start_kind: --resume, --overwrite), content
fingerprints of models and data; and stage 3's run folder: its checkpoint (save_checkpoint, load_checkpoint: everything
a run needs to continue bit-exactly, every rank's random states included), how it starts or resumes (policy_run_kind,
start_or_resume), and the order of the prompts over the passes (batch_indices: the same after a resume).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import common
from infra import distributed


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
_MODEL_FILE = re.compile(
    r"(config|generation_config|adapter_config|tokenizer(_config)?|special_tokens_map|"
    r"added_tokens|chat_template|vocab|reward_model|sft)\.json|.*\.safetensors(\.index\.json)?|"
    r"tokenizer\.model|merges\.txt|chat_template\.jinja|value_head\.pt|README\.md"
)


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
        raise common.DataError(
            f"{flag}{folder}: holds files that a save there did not write ({listed}); a save "
            "replaces only its own files: name another folder"
        )


def save_pretrained(
    out_dir,
    model,
    tokenizer,
    files: dict | None = None,
    keep: tuple[str, ...] = (),
    owns: tuple[str, ...] = (),
    **kwargs,
) -> Path:
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


def start_kind(
    out_dir, resume: bool, overwrite: bool, held: list[str], checkpoint: str, resumable: bool, replaceable: bool = False
) -> str:
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
        raise common.DataError(
            f"--resume: no {checkpoint} in {out_dir}, which holds a run ({', '.join(held)}): --overwrite replaces it"
        )
    raise common.DataError(
        f"{out_dir} holds a run ({', '.join(held)}): --resume continues it from its checkpoint, --overwrite replaces it"
    )


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The prompt indices of an iteration: consecutive slices of a fresh permutation per pass over the data, derived
    from (seed, step) alone so a resumed run draws exactly the same prompts."""
    out, pos = [], step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset : offset + batch_size - len(out)]
        out += take
        pos += len(take)
    return out


def rng_state() -> dict:
    """This process's random states, as a checkpoint keeps them."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def save_checkpoint(
    path,
    step: int,
    model,
    value_head,
    optimizer,
    scheduler,
    scaler,
    kl_coef: float,
    config: dict,
    rank: int = 0,
    rng: dict | None = None,
):
    """The run's checkpoint: the trainable parameters, value head, optimizer, scheduler, loss scaler (fp16), beta,
    its settings (config) and every rank's RNG states (now's, or `rng`: rng_state() as iteration step + 1 began, for
    a save after that iteration drew its rollouts and then failed), all a run needs to continue bit-exactly. Called
    on every rank (their RNG states are gathered); rank 0 writes it, atomically. The parameters are the same on
    every rank."""
    rngs = [rng or rng_state()]
    if dist.is_initialized():
        rngs, rng = [None] * dist.get_world_size(), rngs[0]
        dist.all_gather_object(rngs, rng)
    sharded = any(distributed.is_sharded(p) for p in model.parameters())  # --shard fsdp: gathered on every rank
    if rank == 0 or sharded:  # (in one order), whole
        trainable = {n: distributed.full(p).cpu() for n, p in model.named_parameters() if p.requires_grad}
        optim = optimizer.state_dict()
        optim["state"] = {
            i: {k: distributed.full(v).cpu() if torch.is_tensor(v) else v for k, v in st.items()}
            for i, st in optim["state"].items()
        }
    if rank == 0:
        state = {
            "step": step,
            "kl_coef": kl_coef,
            "args": config,
            "rng": rngs,
            "trainable": trainable,
            "value_head": value_head.state_dict(),
            "optimizer": optim,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
        }
        with common.atomic_open(path, "wb") as f:
            torch.save(state, f)


def load_checkpoint(
    path, model, value_head, optimizer, scheduler, scaler, rank: int = 0, world: int = 1
) -> tuple[int, float]:
    """Restore what save_checkpoint saved, this rank's RNG states included: (step, beta). Another world size cannot
    continue exactly (each rank's sampler state is saved): DataError."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if len(state["rng"]) != world:
        raise common.DataError(
            f"{path}: saved by {len(state['rng'])} process(es), resumed with {world}; resume with "
            f"the same world size (torchrun --nproc_per_node {len(state['rng'])})"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state["trainable"].items():
            params[name].copy_(distributed.shard_like(tensor, params[name]))
    value_head.load_state_dict(state["value_head"])
    order = [p for group in optimizer.param_groups for p in group["params"]]  # the state's indices (sharded: as saved)
    optim = state["optimizer"]
    optim["state"] = {
        i: {k: distributed.shard_like(v, order[int(i)]) if torch.is_tensor(v) and v.dim() else v for k, v in st.items()}
        for i, st in optim["state"].items()
    }
    optimizer.load_state_dict(optim)
    scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):  # {} when loss scaling is off (not fp16)
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"][rank]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"], state["kl_coef"]


RUN_FILES = ("metrics.jsonl", "samples.jsonl", "trace.jsonl", "checkpoint.pt", "policy")  # what a run writes


def save_policy(folder, model, tokenizer, value_head, rank: int = 0) -> None:
    """The trained policy (03's policy/): its adapter (or full weights), tokenizer and value head, a folder that
    models.load_model loads in one process. A sharded model (--shard fsdp) is gathered whole first, on every rank
    (only rank 0's slice would be saved otherwise: accelerate #4206); rank 0 writes."""
    peft = hasattr(model, "peft_config")  # an adapter: its own weights alone are gathered
    state = distributed.full_state_dict(model)
    if rank == 0:
        save_pretrained(
            folder,
            model,
            tokenizer,
            {"value_head.pt": value_head.state_dict()},
            **({"selected_adapters": ["default"]} if peft else {}),
            **({"state_dict": state} if state is not None else {}),
        )


def policy_run_kind(out_dir, resume: bool, overwrite: bool, demo_dirs=()) -> str:
    """How a stage-3 run starts in out_dir (start_kind): "resume" (--resume, and a checkpoint there), "fresh" (no run
    there) or "replace" (a run there, which --overwrite gives up, or one of `demo_dirs`: the zero-flag demo's own two
    folders, given only on a rerun of the literal zero-flag command; a command with any flag never replaces them).
    Anything else is refused (DataError)."""
    out_dir = Path(out_dir)
    return start_kind(
        out_dir,
        resume,
        overwrite,
        [name for name in RUN_FILES if (out_dir / name).exists()],
        "checkpoint.pt",
        (out_dir / "checkpoint.pt").is_file(),
        out_dir.resolve() in [Path(d).resolve() for d in demo_dirs],
    )


MAY_DIFFER = (
    "steps",
    "log_every",
    "save_every",
    "trace_samples",
    "dump_rollouts",
    "report_to",
    "critic_concurrency",
    "resume",
    "overwrite",
    "zero_flag",
    "scalar_baseline_dir",
    "max_fail_share",
    "max_fail_iterations",  # what a resumed run may change: no result depends on it
    "device",
)  # and where it runs (config.json's segments record each invocation's device)


def records_fingerprint(records: list[dict]) -> dict:
    """{"records": how many, "sha256": a hash of each one's JSON (keys sorted)}: a data set's content, whatever file or
    layout holds it (the same records rewritten are the same prompts; one record changed, cut or added is not)."""
    import hashlib

    h = hashlib.sha256()
    for rec in records:
        h.update(json.dumps(rec, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
    return {"records": len(records), "sha256": h.hexdigest()[:16]}


def check_same_run(config_file: Path, config: dict) -> None:
    """--resume continues the run it finds with the settings that run was trained with: DataError, one line naming the
    first flag whose value differs (config.json's against `config`), unless it is in MAY_DIFFER: --steps, the flags
    that change no result (logging, saving, tracing, how many critic requests are in flight) and --device (a run may
    continue on another machine); and the prompts' content ("prompts_content", records_fingerprint: the file at the
    same path, edited, would draw other prompts). A setting the run's config.json lacks (a flag added since, or a run
    from before prompts_content) is not compared."""
    if not config_file.is_file():
        return
    there, now = json.loads(config_file.read_text()), json.loads(json.dumps(config, default=str))
    for key, value in now.items():
        if key == "prompts_content" and there.get(key, value) != value:
            raise common.DataError(
                f"--resume: --prompts {now['prompts']}: {value['records']} prompts now, {there[key]['records']} "
                f"when this run began (content {value['sha256']} now, {there[key]['sha256']} then): a resumed run "
                "draws the same prompts in the same order; restore the file, or --overwrite starts the run again"
            )
        if key in there and key not in MAY_DIFFER and there[key] != value:
            raise common.DataError(
                f"--resume: --{key.replace('_', '-')} was {there[key]} in this run, {value} now: a "
                "resumed run keeps every setting that shapes training (only --steps and logging, "
                "saving and tracing flags may differ); --overwrite starts it again"
            )


def start_or_resume(
    out_dir, kind: str, config: dict, model, value_head, optimizer, scheduler, scaler, rank: int, world: int
) -> dict:
    """The run dir: {"step": the last step done, 0 for a fresh start; "kl_coef": the resumed run's beta; "rows": the
    metrics.jsonl rows of the iterations done, what the run's failure limits and counts start from}. kind
    (policy_run_kind) "resume" restores the checkpoint (load_checkpoint) and cuts metrics.jsonl, samples.jsonl and
    trace.jsonl back to its step; a fresh start removes the run it replaces. Rank 0 writes config.json: config, the
    run's settings, the world size, and one segment per invocation (first step, device, world size; a resume carries
    the earlier ones over)."""
    out_dir, last, saved, rows = Path(out_dir), 0, {}, []
    if kind == "resume":  # refused before anything is written; read on every rank before rank 0 rewrites it
        check_same_run(out_dir / "config.json", config)
        rows = common.read_jsonl(out_dir / "metrics.jsonl") if (out_dir / "metrics.jsonl").is_file() else []
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    if kind == "resume":
        last, saved["kl_coef"] = load_checkpoint(
            out_dir / "checkpoint.pt", model, value_head, optimizer, scheduler, scaler, rank, world
        )
    for path in [out_dir / name for name in RUN_FILES] if rank == 0 else ():
        if last and path.suffix == ".jsonl":  # drop the rows logged after the checkpoint
            common.write_jsonl(
                path, [r for r in common.read_jsonl(path) if r["step"] <= last] if path.is_file() else []
            )
        elif not last and path.is_dir():
            shutil.rmtree(path)
        elif not last:
            path.unlink(missing_ok=True)
    if rank == 0 and last:
        print(f"resumed from {out_dir / 'checkpoint.pt'} at step {last}")
    elif rank == 0 and kind == "replace":
        print(f"{out_dir}: the run there is replaced (--overwrite, or a rerun of the zero-flag demo)", file=sys.stderr)
    if rank == 0:  # one segment per invocation, so a run resumed elsewhere still says where its iterations ran
        config_file = out_dir / "config.json"
        old = json.loads(config_file.read_text()) if kind == "resume" and config_file.is_file() else {}
        if "device" in old and "segments" not in old:  # a run from before segments: its one invocation
            old["segments"] = [{"from_step": 1, "device": old["device"], "world_size": old.get("world_size", 1)}]
        this = {"from_step": last + 1, "device": config.get("device"), "world_size": world}
        common.write_json(config_file, {**config, "world_size": world, "segments": [*old.get("segments", []), this]})
    return {"step": last, **saved, "rows": [r for r in rows if r["step"] <= last]}


def critic_failures(rows: list[dict], batch_size: int | None) -> dict:
    """The critic's failures over stage-3 metrics rows (metrics.jsonl's: a whole run, resumed segments included):
    {"iterations", "critiques" (iterations x batch_size), "failed" (critic/parse_fail_rate x batch_size, summed),
    "unjudged": the steps where no critique gave a signal (critic/parse_fail_rate 1.0)}. Without batch_size (a
    metrics.jsonl alone, no config.json beside it) critiques and failed are None."""
    rates = [(r["step"], r.get("critic/parse_fail_rate")) for r in rows]
    return {
        "iterations": len(rows),
        "critiques": len(rows) * batch_size if batch_size else None,
        "failed": round(sum(x or 0.0 for _, x in rates) * batch_size) if batch_size else None,
        "unjudged": [step for step, x in rates if x is not None and x >= 1.0],
    }


_RUN = {}  # the stage-3 run a Ctrl-C would stop (its settings) and the command line that started it


def on_interrupt(args, argv: list[str]) -> None:
    """Remember the run main() is about to train and its command line (the script, then its arguments), for
    interrupted()."""
    _RUN.update(args=args, argv=list(argv))


def exit_interrupted() -> None:
    """Ctrl-C in stage 3: the one line (interrupted), then exit 130 at once, and nothing after it. Another Ctrl-C is
    ignored meanwhile, and the interpreter's teardown is skipped: a second Ctrl-C there printed a KeyboardInterrupt
    traceback (tqdm's, torch's finalizers), and a hung plug-in's own threads would hold the exit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(interrupted(), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def interrupted() -> str:
    """The one line a Ctrl-C of stage 3 prints: the iterations metrics.jsonl holds, the last checkpoint, and the
    command that continues the run (--resume; --overwrite dropped, since the two are refused together)."""
    return f"interrupted {where_it_stands()}"


def where_it_stands() -> str:
    """ "after iteration N of S; last checkpoint: ...; continue with: python ... --resume" for the stage-3 run under
    way (on_interrupt): what a Ctrl-C prints, and a server that dies mid-run (infra/vllm_rollouts.py)."""
    import shlex

    out_dir, steps = (Path(_RUN["args"].output_dir), _RUN["args"].steps) if _RUN else (Path("."), 0)
    metrics, ckpt = out_dir / "metrics.jsonl", out_dir / "checkpoint.pt"
    done = len(common.read_jsonl(metrics)) if metrics.is_file() else 0
    saved = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False)["step"] if ckpt.is_file() else None
    argv = [a for a in _RUN.get("argv", []) if a not in ("--overwrite", "--resume")]
    again = shlex.join(["python", *argv, "--resume" if saved else "--overwrite"])
    return (
        f"after iteration {done} of {steps}; last checkpoint: "
        + (f"iteration {saved} ({ckpt})" if saved else "none yet (--save-every)")
        + f"; continue with: {again}"
    )
