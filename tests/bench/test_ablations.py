"""bench/ablations/ablations.py: the paper's ablations and RLOO on one bench."""

import json
import subprocess
import sys

import pytest
from bench_helpers import _never, bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)

import common

bench_path("ablations")
import ablations  # noqa: E402


def test_a_given_spans_only_reward_model_must_be_one(tmp_path, monkeypatch):
    """bench/ablations/ablations.py --spans-only-reward-model DIR: DIR must be a stage-2 output trained with --rm-format
    spans-only; nothing is ever trained into a folder the user named."""
    monkeypatch.setattr(ablations, "run", _never)
    given = tmp_path / "smol_rm_spans_only"
    given.mkdir()
    with pytest.raises(SystemExit, match=rf"^--spans-only-reward-model {given}: no reward_model\.json"):
        ablations.spans_only_reward_model(tmp_path / "out", str(given), "runs/demo/smol_rm")
    common.write_json(given / "reward_model.json", {"rm_format": "critique+spans"})
    with pytest.raises(SystemExit, match=r"rm_format 'critique\+spans', not spans-only"):
        ablations.spans_only_reward_model(tmp_path / "out", str(given), "runs/demo/smol_rm")
    common.write_json(given / "reward_model.json", {"rm_format": "spans-only"})
    assert ablations.spans_only_reward_model(tmp_path / "out", str(given), "runs/demo/smol_rm") == given.resolve()


def test_ablations_show_a_run_that_reached_the_threshold_at_its_last_step():
    """A run that got there at exactly step N shows N; only one that never did shows "> N"."""
    assert ablations.steps_cell([150, 120, None], 150) == "150 [120, > 150]"
    assert ablations.steps_cell([None, None, None], 150) == "> 150 [> 150, > 150]"


def _fake_shared_start(built: list):
    """bench/ablations/ablations.py's shared_start without the training: it records its out dir, leaves the SFT start's marker
    and returns the 03 flags every row shares."""

    def fake_start(o, critic, reward_model, steps, ppo_args):
        built.append(o)
        (o / "sft").mkdir(parents=True, exist_ok=True)
        (o / "sft" / "config.json").write_text("{}")
        return ["--critic", critic, "--reward-model", reward_model, "--steps", str(steps), *ppo_args]

    return fake_start


def test_ablations_run_one_seed_side_by_side_after_the_start(tmp_path, monkeypatch):
    """bench/ablations/ablations.py --start-only builds the shared start (and reward models) and runs nothing; --only S runs seed
    S's runs of the chosen rows and writes no table, and refuses before the shared start exists: side-by-side --only
    calls would race to build it."""
    out, built, ran = tmp_path / "out", [], []
    monkeypatch.setattr(ablations, "shared_start", _fake_shared_start(built))
    monkeypatch.setattr(ablations, "spans_only_reward_model", lambda o, given, rm: given)
    monkeypatch.setattr(ablations, "ppo_run", lambda o, run_dir, seed, steps, flags: ran.append((run_dir.name, flags)))
    argv = [
        "--critic",
        "local",
        "--reward-model",
        "rm",
        "--spans-only-reward-model",
        "so",
        "--steps",
        "4",
        "--out",
        str(out),
    ]
    with pytest.raises(SystemExit, match=rf"^{out}: no shared start yet; build it once with --start-only"):
        ablations.main([*argv, "--only", "2"])
    assert built == [] and ran == []
    assert ablations.main([*argv, "--start-only"]) == 0
    assert built == [out] and ran == []
    assert ablations.main([*argv, "--only", "2", "--rows", "span", "spans-only RM"]) == 0
    assert ran == [
        ("span_seed2", ["--critic", "local", "--reward-model", "rm", "--steps", "4"]),
        ("spans_only_RM_seed2", ["--reward-model", "so", "--critic", "local", "--steps", "4"]),
    ]
    assert not (out / "results.json").exists()


def test_ablations_jobs_run_each_row_and_seed_in_its_own_process_then_the_table(tmp_path, monkeypatch):
    """bench/ablations/ablations.py --jobs N builds the shared start once, runs every (row, seed) as its own `--rows R --only S`
    process, at most N at a time, the 03 flags after -- passed on, then prints the table from the finished runs; a run
    that fails stops it with its log named, and no table is written."""
    out, built, ran, launched = tmp_path / "out", [], [], []

    def fake_run(o, run_dir, seed, steps, flags):
        ran.append((run_dir.name, flags))
        return {"mistakes": [0.5] * steps, "reward": [1.0] * steps, "kl": [0.0] * steps, "length": [9.0] * steps}

    def fake_launch(cmd, log, env, fail=None):  # the child's own main, run here; a real process gives the exit code
        assert cmd[:2] == [sys.executable, ablations.__file__] and log.parent == out / "logs"
        launched.append(cmd[2:])
        assert ablations.main(cmd[2:]) == 0
        row_seed = (cmd[cmd.index("--rows") + 1], cmd[cmd.index("--only") + 1])
        return subprocess.run([sys.executable, "-c", f"raise SystemExit({int(row_seed == fail)})"]).returncode

    monkeypatch.setattr(ablations, "shared_start", _fake_shared_start(built))
    monkeypatch.setattr(ablations, "spans_only_reward_model", lambda o, given, rm: given)
    monkeypatch.setattr(ablations, "ppo_run", fake_run)
    monkeypatch.setattr(ablations, "launch", fake_launch)
    argv = [
        "--critic",
        "local",
        "--reward-model",
        "rm",
        "--spans-only-reward-model",
        "so",
        "--steps",
        "12",
        "--out",
        str(out),
        "--seeds",
        "2",
        "--rows",
        "span",
        "scalar",
        "--jobs",
        "3",
        "--",
        "--lr",
        "1e-5",
    ]
    assert ablations.main(argv) == 0
    assert built == [out] * 5  # the start, then each child's (run_cache makes those no-ops for real)
    assert sorted((c[c.index("--rows") + 1], c[c.index("--only") + 1]) for c in launched) == [
        ("scalar", "1"),
        ("scalar", "2"),
        ("span", "1"),
        ("span", "2"),
    ]
    flags = ["--critic", "local", "--reward-model", "rm", "--steps", "12", "--lr", "1e-5"]
    children = sorted(ran[:4])
    assert children == [
        ("scalar_seed1", ["--reward-mode", "scalar", *flags]),
        ("scalar_seed2", ["--reward-mode", "scalar", *flags]),
        ("span_seed1", flags),
        ("span_seed2", flags),
    ]
    assert sorted(ran[4:]) == children  # the table reads the finished runs
    assert json.loads((out / "results.json").read_text())["rows"].keys() == {"span", "scalar"}

    (out / "results.json").unlink()
    monkeypatch.setattr(ablations, "launch", lambda cmd, log, env: fake_launch(cmd, log, env, ("scalar", "2")))
    with pytest.raises(SystemExit, match=r"^1 of 4 runs failed: scalar seed 2 \(its log: .*scalar_seed2\.log\)"):
        ablations.main(argv)
    assert not (out / "results.json").exists()
