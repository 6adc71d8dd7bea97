"""--report-to (issue 79): a run watched live in TensorBoard, W&B or Trackio, with the values transformers' and TRL's
`report_to` takes: none (the default), tensorboard, wandb, trackio, or a comma list of them.

Stage 2 hands the list to its Trainer (transformers' own callbacks). Stage 3 calls open_run once before its first
iteration, log with every metrics.jsonl row (the same keys, its iteration as the step) and finish at the end, on rank
0 only. A run remembers its trackers in OUTPUT_DIR/tracking.json (W&B's run id, the run's name), so a --resume
continues the same run rather than a new one: TensorBoard drops the events after the checkpoint's iteration
(purge_step), W&B and Trackio resume their run by id and name. Nothing is sent anywhere unless the tracker is set up
to: W&B reads WANDB_MODE (offline: files under OUTPUT_DIR/wandb) and WANDB_PROJECT, Trackio writes a local database
(TRACKIO_DIR) and serves its dashboard with `trackio show`. docs/tracking.md has the commands.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

import common

CHOICES = ("tensorboard", "wandb", "trackio")
PROJECT = "text2grad"  # W&B's and Trackio's project, unless WANDB_PROJECT / TRACKIO_PROJECT says otherwise


def add_args(p) -> None:
    p.add_argument("--report-to", default="none", help="none, tensorboard, wandb, trackio, or a comma list")


def parse(value: str) -> list[str]:
    """The trackers of a --report-to value ([] for none); DataError naming a value that is none of them."""
    kinds = [v.strip() for v in (value or "none").split(",") if v.strip()]
    bad = [k for k in kinds if k not in (*CHOICES, "none")]
    if bad or ("none" in kinds and len(kinds) > 1):
        raise common.DataError(f"--report-to {value}: takes none, or a comma list of {', '.join(CHOICES)}")
    return [k for k in kinds if k != "none"]


def check(value: str) -> None:
    """Before any work: a --report-to value names known trackers whose packages import (each tracker's package has
    its name), else one line (parse's, or the pip install)."""
    for kind in parse(value):
        try:
            __import__(kind)
        except ImportError:
            raise common.DataError(f"--report-to {kind}: pip install {kind}") from None


def open_run(kinds: list[str], out_dir: Path, config: dict, last_step: int, rank: int = 0) -> dict:
    """{kind: handle} for stage 3's run in out_dir ({} on other ranks, or with none). last_step: the iteration the
    run continues after (0 for a new run); a new run writes its name and W&B id to tracking.json, a resumed one reads
    them back, so its trackers continue the same run."""
    if rank != 0 or not kinds:
        return {}
    out_dir, state_file = Path(out_dir), Path(out_dir) / "tracking.json"
    state = json.loads(state_file.read_text()) if last_step and state_file.is_file() else {}
    state.setdefault("name", f"{out_dir.resolve().parent.name}/{out_dir.name}")
    config = {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool)) or v is None}
    runs = {}
    if "tensorboard" in kinds:
        from torch.utils.tensorboard import SummaryWriter

        runs["tensorboard"] = SummaryWriter(
            str(out_dir / "tensorboard"), purge_step=last_step + 1 if last_step else None
        )
        if not last_step:  # the run's flags, once (W&B and Trackio: their config)
            runs["tensorboard"].add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(config.items())), 0)
    if "wandb" in kinds:
        import wandb

        state.setdefault("wandb_id", uuid.uuid4().hex[:8])  # W&B's own kind of run id
        project = os.environ.get("WANDB_PROJECT", PROJECT)
        runs["wandb"] = wandb.init(
            project=project, name=state["name"], id=state["wandb_id"], resume="allow", dir=str(out_dir), config=config
        )
    if "trackio" in kinds:
        import trackio

        project = os.environ.get("TRACKIO_PROJECT", PROJECT)
        runs["trackio"] = trackio.init(project=project, name=state["name"], config=config, resume="allow")
    common.write_json(state_file, state)
    return runs


def log(runs: dict, row: dict, step: int) -> None:
    """One metrics.jsonl row, its numbers under their own keys, at `step` (its iteration)."""
    numbers = {
        k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    numbers = {k: v for k, v in numbers.items() if math.isfinite(v)}
    if "tensorboard" in runs:
        for k, v in numbers.items():
            runs["tensorboard"].add_scalar(k, v, step)
        runs["tensorboard"].flush()  # live: TensorBoard reads what is on disk
    if "wandb" in runs:
        runs["wandb"].log(numbers, step=step)
    if "trackio" in runs:
        runs["trackio"].log(numbers, step=step)


def run_of(policy_path: str) -> Path | None:
    """The stage-3 run a policy folder was saved by (03 writes OUTPUT_DIR/policy beside OUTPUT_DIR/metrics.jsonl)."""
    for folder in (Path(policy_path), Path(policy_path).parent):
        if (folder / "metrics.jsonl").is_file():
            return folder
    return None


def log_results(report_to: str, results: dict, table: list[list[str]], out_dir: Path) -> list[Path]:
    """04 --report-to: the results table, and a policy's own metrics as eval/METRIC at its last iteration, in the
    stage-3 run each policy came from (the same run: its tracking.json); a policy of no stage-3 run (the SFT start, a
    hub model) is in the table only. No policy of a run: one run in out_dir, each policy's as eval/POLICY/METRIC.
    Returns the runs' folders."""
    kinds = parse(report_to)
    if not kinds:
        return []
    sources = {name: run_of(p["path"]) for name, p in results["policies"].items()}
    folders = {f: [n for n, g in sources.items() if g == f] for f in sources.values() if f} or {Path(out_dir): None}
    width = len(table[0])
    header, rows = table[0], [r + [""] * (width - len(r)) for r in table[1:]]  # a judge row has one cell
    text = "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * width, *rows])  # TensorBoard: markdown
    for folder, names in folders.items():
        metrics = common.read_jsonl(folder / "metrics.jsonl") if names else []
        step = metrics[-1]["step"] if metrics else 0
        runs = open_run(kinds, folder, results, step)  # (a new run's config: the results' scalars)
        own = {
            f"eval/{k}" if names else f"eval/{name}/{k}": m["value"]
            for name in names or results["policies"]
            for k, m in results["policies"][name]["metrics"].items()
        }
        log(runs, own, step)
        if "tensorboard" in runs:
            runs["tensorboard"].add_text("eval/results", text, step)
        if "wandb" in runs:
            import wandb

            runs["wandb"].log({"eval/results": wandb.Table(columns=header, data=rows)}, step=step)
        if "trackio" in runs:
            import trackio

            runs["trackio"].log({"eval/results": trackio.Table(columns=header, data=rows)}, step=step)
        finish(runs)
    return list(folders)


def finish(runs: dict) -> None:
    if "tensorboard" in runs:
        runs["tensorboard"].close()
    if "wandb" in runs:
        runs["wandb"].finish()
    if "trackio" in runs:
        runs["trackio"].finish()
