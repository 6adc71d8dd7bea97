"""Nothing a user types changes meaning: every stage command in the READMEs (README.md, docs/, bench/README.md and its pages,
baselines/README.md, as they stood when the snapshot was taken) and each stage's zero-flag run parse to exactly the
settings they parsed to then: vars(parse_args(argv)), or the one-line error its checks raise. Each is parsed in a
fresh interpreter, in an empty folder (no runs/ to read), the files the command names stubbed out as test_readme
stubs them.

    python tests/test_parse_snapshot.py --write     # re-record, only where a flag's meaning changes on purpose
"""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT  # noqa: E402
from test_readme import readme_commands  # noqa: E402

SNAPSHOT = Path(__file__).with_name("parse_snapshot.json")
STAGES = ("01_annotate.py", "02_train_reward.py", "03_train_policy.py", "04_evaluate.py")
DOCS = [
    "README.md",
    "bench/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").glob("*/README.md")),
    "baselines/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]

RUNNER = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
import common
for home in ("common", "infra.models", "infra.reward_models"):  # check_model_path, check_reward_model: the
    try:                                                           # README's files are not here
        mod = importlib.import_module(home)
    except ImportError:
        continue
    for name in ("check_model_path", "check_reward_model"):
        if hasattr(mod, name):
            setattr(mod, name, lambda *a, **k: None)
script, argvs = json.loads(sys.argv[2])
stage, out = importlib.import_module(script[:-3]), []
for argv in argvs:
    try:
        out.append(dict(sorted(vars(stage.parse_args(argv)).items())))
    except common.DataError as e:
        out.append({"error": str(e)})
    except SystemExit as e:
        out.append({"exit": e.code})
print(json.dumps(out, default=repr))
"""


def parse(script: str, argvs: list[list[str]], cwd) -> list[dict]:
    """vars(parse_args(argv)) of each argv, in one interpreter per script."""
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(ROOT), json.dumps([script, argvs])],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONHASHSEED": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_all(entries: list[tuple[str, list[str]]], cwd) -> list[dict]:
    by_script = {}
    for i, (script, argv) in enumerate(entries):
        by_script.setdefault(script, []).append((i, argv))
    out = [None] * len(entries)
    for script, items in by_script.items():
        for (i, _), parsed in zip(items, parse(script, [argv for _, argv in items], cwd)):
            out[i] = parsed
    return out


def commands() -> list[tuple[str, list[str]]]:
    found = [(s, []) for s in STAGES]
    for doc in DOCS:
        found += [(s, a) for s, a in readme_commands((ROOT / doc).read_text(encoding="utf-8")) if s in STAGES]
    return list({json.dumps(c): c for c in found}.values())


def test_every_stage_command_parses_as_it_did(tmp_path):
    snapshot = json.loads(SNAPSHOT.read_text())
    assert len(snapshot) >= 40  # the READMEs' commands were found when it was taken
    changed = []
    for entry, now in zip(snapshot, parse_all([(e["script"], e["argv"]) for e in snapshot], tmp_path)):
        then = entry["parsed"]  # a flag added since is new ground; every recorded setting must stay as it was
        diff = {k: (then[k], now.get(k, "(gone)")) for k in then if now.get(k, "(gone)") != then[k]}
        if diff or ("error" in now) != ("error" in then):
            changed.append(f"{entry['script']} {' '.join(entry['argv'])}: {diff or now}")
    assert not changed, "\n".join(changed)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = commands()
        rows = [{"script": s, "argv": a, "parsed": p} for (s, a), p in zip(found, parse_all(found, tmp))]
    SNAPSHOT.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(rows)} commands recorded in {SNAPSHOT}")
