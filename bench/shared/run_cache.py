"""The benches' cache of finished work, keyed by the settings that made it.

A bench that skips a run already on disk (a PPO run, an SFT start, a reward model, a whole chain) calls
check_settings(folder, settings) first: the settings (the exact command lines, seeds, ...) are recorded next to the
folder, in FOLDER.settings.json, and a folder holding output made with other settings, or whose settings were never
recorded, stops the bench with one line. So a cached run is reused only for the very command that made it, and two
benches (or one bench with two critics) pointed at one --out never mix their runs. A command line ("argv") is keyed
also by the content of the models and data it reads (inputs_content): a reward model retrained in the same folder
makes the runs made from the old one stale, refused like any other change.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
from infra import runs  # noqa: E402


def settings_path(folder) -> Path:
    """Where a folder's settings are recorded: beside it, so a stage that replaces the folder keeps them."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".settings.json")


def difference(there, now, where: str = "") -> str:
    """The first place where two JSON values differ, as "where: X there, Y now"."""
    if isinstance(there, dict) and isinstance(now, dict):
        key = next((k for k in [*there, *now] if there.get(k) != now.get(k)), None)
        return difference(there.get(key), now.get(key), f"{where}.{key}" if where else str(key))
    if isinstance(there, list) and isinstance(now, list):
        i = next((i for i, (a, b) in enumerate(zip(there, now)) if a != b), min(len(there), len(now)))
        item = lambda xs: xs[i] if i < len(xs) else None  # noqa: E731  (None: the list ends before i)
        return difference(item(there), item(now), f"{where}[{i}]")
    return f"{where}: {there!r} there, {now!r} now"


INPUTS = ("--model", "--reward-model", "--ref-adapter", "--sft-data", "--prompts", "--data", "--norm-data")


def inputs_content(argv: list[str], cwd=None) -> dict:
    """{path: infra.runs.content_fingerprint(path)} of each model or data file or folder that a command line names after
    an input flag (INPUTS), relative paths read from `cwd` (the command's own working directory; default this
    process's). Outputs (--output-dir, ...) are left out: they change as the command runs."""
    base = Path(cwd or ".")
    return {
        value: runs.content_fingerprint(base / value)
        for flag, value in zip(argv, argv[1:])
        if flag in INPUTS and value and (base / value).exists()
    }


def check_settings(folder, settings: dict, cwd=None) -> None:
    """Exit with one line if `folder` holds output made with other settings than `settings`, or with none recorded;
    otherwise record them (the caller then reuses what is finished there, and runs what is not). A command line in
    settings["argv"] adds its "inputs" (inputs_content; `cwd`: where the command runs)."""
    folder, path = Path(folder), settings_path(folder)
    if "argv" in settings:
        settings = {**settings, "inputs": inputs_content(list(settings["argv"]), cwd)}
    settings = json.loads(json.dumps(settings))  # as the file holds them: tuples are lists
    there = json.loads(path.read_text()) if path.is_file() else None
    if folder.is_dir() and any(folder.iterdir()) and there != settings:
        sys.exit(
            f"{folder}: holds output whose settings were not recorded; delete it or pick another --out"
            if there is None
            else f"{folder}: made with other settings ({difference(there, settings)}); delete it or pick another --out"
        )
    common.write_json(path, settings)
