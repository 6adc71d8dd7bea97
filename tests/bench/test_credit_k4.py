"""bench/credit/credit_k4.py (issue 77): per-token credit, decided. Its starts and runs on one pinned CPU kernel path, its
statistics (seeds resampled within each start, the registered verdicts) by hand, and every phase at tiny shapes."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

sys.path[:0] = [str(ROOT / "bench" / "credit"), str(ROOT / "bench" / "shared")]
import credit_k4 as k4  # noqa: E402


@pytest.fixture(autouse=True)
def environ_restored():
    """os.environ as it was before each test: pin_kernels sets the bench's kernel path in its own process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


BUILD = """
import sys
from pathlib import Path
sys.path[:0] = ["bench/credit", "bench/shared"]
import credit_k4 as k4
args = k4.parse_args(["--tiny", "--out", sys.argv[1]])
if sys.argv[2] == "pinned":
    k4.pin_kernels()
print(k4.build_start(Path(sys.argv[1]), 0, args)["checksum"])
"""


@pytest.mark.slow  # 84 s of a worker (2026-12-03): a start built twice, under two kernel paths
def test_a_start_is_other_bytes_under_two_kernel_paths_unpinned(tmp_path):
    """Issue 77, item 2, the instrument: a tiny start built by processes whose environments ask for two kernel paths
    (AVX2 and torch's DEFAULT with MKL's AUTO) is other bytes without pin_kernels, so phase 0 of the tiny study below
    (the same start, metrics and policy from two children asking for two paths, each pinned) sees what it claims."""

    def build(folder, path, pinned):
        env = {k: v for k, v in os.environ.items() if k not in k4.PINNED}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", ATEN_CPU_CAPABILITY=path, MKL_CBWR="AUTO")
        proc = subprocess.run(
            [sys.executable, "-c", BUILD, str(tmp_path / folder), "pinned" if pinned else "as asked"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()[-1]

    assert build("c", "avx2", False) != build("d", "default", False)


def test_the_bootstrap_resamples_seeds_within_each_start_only():
    """Starts are strata: a draw keeps each start's count of seeds and draws only its own (never start B twice, the
    two-level bootstrap's (B, B) draws that pinned every upper bound of issue 65 at 0)."""
    starts = ["A", "A", "A", "B", "B", "C"]
    for draw in k4.stratified_draws(starts, np.random.default_rng(0), 200):
        assert [starts[i] for i in draw] == starts


def test_the_registered_verdicts_by_hand():
    assert k4.verdict(-0.05, -0.08, -0.02, 0.01) == "better"
    assert k4.verdict(+0.05, +0.02, +0.08, 0.01) == "worse"
    assert k4.verdict(-0.05, -0.08, -0.02, 0.06) == "undecided"  # Holm's p not below 0.05
    assert k4.verdict(-0.01, -0.02, +0.025, 0.5) == "equivalent"  # inside the margin of 0.03
    assert k4.verdict(-0.01, -0.035, +0.01, 0.5) == "undecided"  # reaches past it


def test_compare_against_hand_computed_values():
    """Two starts of two seeds: the held-out difference of 0/1 posts, its sign-flip p over the 4 seed differences, the
    training mean's difference (auc), the seed left out as most extreme, and an interval that never mixes starts
    (every post of a start's seeds alike: the ends are the start-wise means)."""
    rng = np.random.default_rng(0)
    arm = {"imperfect": [[0, 0], [0, 0], [1, 1], [1, 1]], "auc": [0.5, 0.5, 0.6, 0.8]}
    ref = {"imperfect": [[1, 1], [1, 1], [1, 1], [1, 1]], "auc": [0.6, 0.6, 0.6, 0.6]}
    for m in k4.MEASURES:
        arm[m], ref[m] = [0.0] * 4, [0.0] * 4
    out = k4.compare(arm, ref, ["A", "A", "B", "B"], rng, resamples=500)
    h, auc = out["heldout_imperfect"], out["auc"]
    assert h["difference"] == -0.5 and h["per_seed"] == [-1.0, -1.0, 0.0, 0.0]
    assert h["p"] == k4.sign_flip_p([-1, -1, 0, 0]) and h["interval"] == pytest.approx([-0.5, -0.5])
    assert auc["difference"] == pytest.approx(0.0) and auc["extreme_seed"] == 3  # -0.1, -0.1, 0, +0.2
    assert auc["without_extreme"] == pytest.approx(-0.2 / 3)


def synthetic_arm(rate: float, seeds: int, posts: int, rng) -> dict:
    """One confirmed arm's row as confirm builds it: per seed, posts imperfect at `rate`, and its other measures."""
    row = {"imperfect": (rng.random((seeds, posts)) < rate).astype(int).tolist(), "lr": 1e-3, "kl_coef": 0.2}
    row["heldout_imperfect"] = [float(np.mean(x)) for x in row["imperfect"]]
    row.update({m: rng.random(seeds).tolist() for m in ("auc", *k4.MEASURES)})
    return row


def test_holm_runs_over_the_registered_family_only_and_the_page_shows_every_comparison():
    """span, poor_scalar and fair_scalar on two starts of three seeds: span - fair_scalar is the family (its Holm p
    is its own p, a family of one), poor_scalar - fair_scalar is reported outside it, with no Holm p and no verdict;
    the page shows both, each endpoint, every per-seed value, the SFT starts and each start's mean."""
    rng = np.random.default_rng(0)
    arms = {a: synthetic_arm(r, 6, 200, rng) for a, r in (("fair_scalar", 0.6), ("span", 0.3), ("poor_scalar", 0.6))}
    starts = ["A"] * 3 + ["B"] * 3
    vs = k4.comparisons(arms, starts, rng)
    assert list(vs) == ["span - fair_scalar", "poor_scalar - fair_scalar"]
    for key in ("heldout_imperfect", "auc"):
        assert vs["span - fair_scalar"][key]["p_holm"] == vs["span - fair_scalar"][key]["p"]
        assert "p_holm" not in vs["poor_scalar - fair_scalar"][key]
    assert vs["span - fair_scalar"]["heldout_imperfect"]["p"] == 2 / 2**6  # every seed better: the test's floor
    assert vs["span - fair_scalar"]["heldout_imperfect"]["verdict"] == "better"  # 0.031 < 0.05, interval below 0
    table = {"seeds": [101, 102, 103] * 2, "starts": starts, "arms": arms, "comparisons": vs}
    table["sft"] = {n: {"imperfect": x, "mistakes": 1.0, "facts": 0.9} for n, x in (("A", 0.7), ("B", 0.8))}
    page = "\n".join(k4.confirm_markdown(table))
    assert "| SFT start | 0.750 | 0.700 | 0.800 | | |" in page
    assert "| span - fair_scalar | held-out imperfect | " in page and "| **better** |" in page
    assert page.count("| poor_scalar - fair_scalar | ") == 3  # both endpoints and the uncorrected row
    assert "| outside |  |" in page  # neither a Holm p nor a verdict
    per_seed = vs["span - fair_scalar"]["heldout_imperfect"]["per_seed"]
    assert "| span - fair_scalar held out | " + " | ".join(f"{x:+.3f}" for x in per_seed) + " |" in page
    span_b = np.mean(arms["span"]["heldout_imperfect"][3:])
    assert f"| span (0.001, 0.2) | {np.mean(arms['span']['heldout_imperfect']):.3f} | " in page
    assert f" | {span_b:.3f} | " in page


def test_the_grid_extends_beyond_an_edge_for_every_arm(monkeypatch):
    """A choice at the grid's top learning rate adds the next one above it (x2) for every arm, one at its bottom the
    next below (/2), each round, --max-extensions rounds at most; an interior choice ends it. Training is replaced by
    a score per (arm, lr): "a" is best at the highest rate it is given, "b" at 5e-4."""
    best = {"a": lambda lr: -lr, "b": lambda lr: abs(lr - 5e-4)}
    monkeypatch.setattr(k4, "runs_of", lambda out, world, phase, cells, args: dict(zip(cells, cells)))
    monkeypatch.setattr(k4, "training", lambda key, steps: {"final": best[key[0]](key[1]), "auc": 0.0})
    args = k4.parse_args(["--lrs", "1e-3", "2e-3", "--kl-coefs", "0.05", "--max-extensions", "2"])
    grid, chosen, lrs = k4.tune(None, None, ["a", "b"], args)
    assert lrs == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3]  # round 1: b at the bottom, a at the top; round 2: a again
    assert chosen["a"]["lr"] == 8e-3 and chosen["b"]["lr"] == 5e-4  # a still at the edge after 2 rounds: said so
    assert sorted(k[1] for k in grid if k[0] == "a") == sorted(k[1] for k in grid if k[0] == "b") == lrs


def test_a_start_restored_from_another_machine_is_compared_with_phase_0s_and_must_be_the_committed_one(tmp_path):
    """The store's start seed 0 against what phase 0 built on this machine: the same bytes or other bytes, recorded
    (plan v2: another CPU's build is other bytes, the runs still start from the store's); and every start must be
    the committed results' bytes, else the study stops (a start rebuilt here would mix two studies' runs)."""
    for d, text in (("base", "weights"), ("sft", "more weights")):
        (tmp_path / "s0" / d).mkdir(parents=True)
        (tmp_path / "s0" / d / "model.safetensors").write_text(text)
    here = k4.start_checksum(tmp_path / "s0")
    assert k4.same_machine(tmp_path, {"children": [{"start": here}]})
    assert not k4.same_machine(tmp_path, {"children": [{"start": "0" * 64}]})
    worlds = {"A": {"checksum": here}}
    assert k4.committed_starts({"checksums": {"A": here}}, worlds) == {"A": here} == k4.committed_starts({}, worlds)
    with pytest.raises(SystemExit, match="the starts here are not the committed ones"):
        k4.committed_starts({"checksums": {"A": "0" * 64}}, worlds)


def test_the_machines_phase_0_passed_on_are_kept_one_row_a_cpu_and_shown(tmp_path):
    """The committed results' machine (the format before the list) is kept beside this one; a second session on the
    same CPU replaces its row; the page shows every row, and whether the store's start was checked against it."""
    amd = {"cpu": "AMD EPYC", "kernels": "AVX2", "torch": "2.13.0+cpu"}
    sums = {"start": "a" * 64, "metrics": "b" * 64, "policy": "c" * 64, "rows": 20}
    (tmp_path / "r.json").write_text(json.dumps({"machine": amd, "reproduce": {"children": [sums]}}))
    args = k4.parse_args(["--results", str(tmp_path / "r.json")])  # (an absolute path: ROOT / it is it)
    committed = lambda: k4.committed_results(args)  # noqa: E731
    intel = {"machine": {**amd, "cpu": "Intel Xeon"}, "reproduce": {"children": [sums], "same": True,
             "outer_environments": [{}, {}]}}  # fmt: skip
    rows = k4.machines(committed(), intel)
    assert [m["cpu"] for m in rows] == ["AMD EPYC", "Intel Xeon"]
    (tmp_path / "r.json").write_text(json.dumps({"machines": rows}))
    assert [m["cpu"] for m in k4.machines(committed(), intel)] == ["AMD EPYC", "Intel Xeon"]  # the same CPU: one row
    rows[-1]["store"] = True
    page = k4.markdown({**intel, "machines": rows})
    assert (
        "| AMD EPYC | AVX2 | 2.13.0+cpu | aaaaaaaaaaaaaaaa | bbbbbbbbbbbbbbbb | cccccccccccccccc | built there |"
        in page
    )
    assert (
        "| Intel Xeon | AVX2 | 2.13.0+cpu | aaaaaaaaaaaaaaaa | bbbbbbbbbbbbbbbb | cccccccccccccccc | the same |" in page
    )
    rows[-1]["store"] = False
    assert "| cccccccccccccccc | **other bytes** |" in k4.markdown({**intel, "machines": rows})
    del rows[-1]["store"]
    assert "| cccccccccccccccc | (not checked) |" in k4.markdown({**intel, "machines": rows})


@pytest.mark.slow  # ~3-5 minutes of a worker: every phase's stage runs at tiny shapes
def test_credit_k4_runs_every_phase_at_tiny_shapes_and_a_fresh_machine_continues_from_its_store(
    forked_stages, tmp_path, capsys
):
    """Phase 0 (two children under two kernel paths: the same start, metrics and policy), the starts with their
    self-teacher gates, the grid, the confirmation on two starts judged by 04, and
    the registered comparisons with Holm and a verdict each; per-post outcomes and every run's curve recorded.
    Then --save copies the finished work into a store (no checkpoint, no grid policy), and the same command on an
    emptied --out (a fresh machine's clone) restores it and runs nothing again: the same results."""
    argv = ["--tiny", "--results", "", "--arms", "fair_scalar", "span", "self_distill", "--self-distill", "always"]
    argv += ["--max-extensions", "0", "--store", str(tmp_path / "store")]
    result = k4.main([*argv, "--out", str(tmp_path / "k4")])
    assert result["reproduce"]["same"] and result["reproduce"]["children"][0]["rows"] == 2
    assert result["checksums"]["A"] == result["reproduce"]["children"][0]["start"]  # phase 0 built start A's bytes
    assert set(result["starts"]["gates"]) == {"A", "B"} and "passes" in result["starts"]["gates"]["A"]
    assert len(result["grid"]) == 3  # every arm got its cell (the grid and its extension: the test above)
    comparisons = result["confirm"]["comparisons"]
    assert set(comparisons) == {"span - fair_scalar", "self_distill - fair_scalar", "span - self_distill"}
    for c in comparisons.values():
        assert c["heldout_imperfect"]["verdict"] in ("better", "worse", "equivalent", "undecided")
        assert len(c["heldout_imperfect"]["per_seed"]) == 2 and "p_holm" in c["auc"]
    saved = json.loads((tmp_path / "k4" / "results.json").read_text())
    assert len(saved["per_post"]) == 3 * 2 and len(saved["curves"]) == 3 * 2
    assert all(len(v["imperfect"]) == 8 for v in saved["per_post"].values())
    k4.main([*argv, "--out", str(tmp_path / "k4"), "--save"])
    stored = [p.relative_to(tmp_path / "store") for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert not [p for p in stored if p.name == "checkpoint.pt" or ("grid" in p.parts and "policy" in p.parts)]
    assert not [p for p in stored if "reproduce" in p.parts]  # phase 0 checks each machine: never restored
    assert sum(p.name == "policy.sha256" for p in stored) == 3 and sum(p.name == "kl.json" for p in stored) == 3 * 2 + 2
    shutil.copytree(tmp_path / "k4" / "reproduce", tmp_path / "reproduce")  # phase 0 ran above: kept, for its minute
    shutil.rmtree(tmp_path / "k4")  # a fresh machine: its clone's --out is empty, at the same path (bench/out/...)
    shutil.copytree(tmp_path / "reproduce", tmp_path / "k4" / "reproduce")  # (not from the store: never stored)
    capsys.readouterr()
    again = k4.main([*argv, "--out", str(tmp_path / "k4")])
    assert "runs to do" not in capsys.readouterr().out  # every run was restored, none run again (phase 0 aside)
    assert {k: v for k, v in again.items() if k != "command"} == {k: v for k, v in result.items() if k != "command"}


def test_the_page_shows_the_committed_results_as_report_prints_them():
    """bench/credit/credit_k4.md's result tables are credit_k4.py --report of the committed results, not copies that
    can drift: phase 0's checksums (and each later phase's tables as they land)."""
    results = json.loads((ROOT / "bench/credit/credit_k4_results.json").read_text())
    assert results["reproduce"]["same"]
    assert k4.markdown(results) in (ROOT / "bench/credit/credit_k4.md").read_text()


def per_seed_from_bits(per_post: dict, arm: str, table: dict) -> list[float]:
    """An arm's held-out imperfect rate per seed, from the committed per-post bits alone (its own arithmetic)."""
    keys = [f"confirm/{arm}/{n}/seed{s}" for n, s in zip(table["starts"], table["seeds"])]
    return [per_post[k]["imperfect"].count("1") / len(per_post[k]["imperfect"]) for k in keys]


def test_the_committed_per_post_bits_give_the_pages_per_seed_rates_and_its_family_p():
    """The confirmation's committed per-post outcomes rebuild every arm's per-seed held-out rate, and each registered
    comparison's exact sign-flip p over those 12 differences, counted here by enumerating all 2^12 sign patterns."""
    import itertools

    results = json.loads((ROOT / "bench/credit/credit_k4_results.json").read_text())
    per_post = json.loads((ROOT / "bench/credit/credit_k4_per_post.json").read_text())
    table = results["confirm"]
    for arm, row in table["arms"].items():
        assert per_seed_from_bits(per_post, arm, table) == pytest.approx(row["heldout_imperfect"], abs=1e-12), arm
    signs = np.array(list(itertools.product((1, -1), repeat=len(table["seeds"]))))
    for name, v in table["comparisons"].items():
        a, b = name.split(" - ")
        d = np.subtract(per_seed_from_bits(per_post, a, table), per_seed_from_bits(per_post, b, table))
        p = np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-9)
        assert p == pytest.approx(v["heldout_imperfect"]["p"], abs=1e-9), name


def test_git_tracks_every_file_save_writes_into_the_committed_store(tmp_path):
    """The store is committed so a fresh machine continues: a file git ignores there is lost with the session's machine.
    (The root .gitignore's unanchored runs/ once swallowed every stored run: the grid's 48 folders.) Each kind of
    path save writes, a start's, an evaluation's and a run's, checked with git check-ignore at the store's place."""
    out = tmp_path / "out"
    run = out / "runs" / ("ab" * 8) / "confirm" / "span_lr0.001_kl0.05" / "seed101"
    files = {
        run / "metrics.jsonl": "{}\n",
        run / "config.json": '{"steps": 1}',
        run / "policy" / "adapter.safetensors": "w",
    }
    files.update({out / "s0" / "base" / "config.json": "{}", out / "gate" / "eval-1" / "kl.json": "{}"})
    for f, text in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    k4.save(out, tmp_path / "store")
    stored = [p.relative_to(tmp_path / "store") for p in (tmp_path / "store").rglob("*") if p.is_file()]
    stored = [f"bench/credit/k4_store/{p}" for p in stored]
    assert len(stored) == 5
    ignored = subprocess.run(["git", "check-ignore", *stored], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == []


def test_a_session_stopped_after_phase_0_keeps_the_committed_phases_in_the_results(tmp_path, monkeypatch):
    """Each phase's end rewrites the results: a session that stops after phase 0 (another CPU's starts, a killed
    process) must leave the earlier sessions' starts and grid choices there, which the next session reads."""
    sums = {"start": "a" * 64, "metrics": "b" * 64, "policy": "c" * 64, "rows": 20}
    monkeypatch.setattr(k4, "pin_kernels", lambda strict=True: None)
    monkeypatch.setattr(k4, "reproduce", lambda out, args: {"children": [sums, sums], "same": True})
    monkeypatch.setattr(k4, "choose_starts", lambda out, args, rng: sys.exit("stopped in phase 1"))
    committed = {"starts": {"starts": {"A": 0}}, "selection": {"span": {"lr": 1e-3}}, "checksums": {"A": "a" * 64}}
    (tmp_path / "r.json").write_text(json.dumps(committed))
    with pytest.raises(SystemExit, match="stopped in phase 1"):
        k4.main(["--results", str(tmp_path / "r.json"), "--store", "", "--out", str(tmp_path / "out")])
    kept = json.loads((tmp_path / "r.json").read_text())
    assert {k: kept[k] for k in committed} == committed and kept["reproduce"]["same"]


def test_each_run_records_the_cpu_of_each_invocation_before_it_runs(tmp_path, monkeypatch):
    """Plan v2: a run's CPU is recorded before 03 runs (a session stopped mid-batch leaves its finished runs' CPU);
    resumed from its checkpoint on another CPU it names both, started again from scratch only the new one."""
    run_dir, seen = tmp_path / "run", []
    monkeypatch.setattr(
        k4, "plan", lambda folder, runs, steps: {key: (run_dir, ["03_train_policy.py"]) for key in runs}
    )
    monkeypatch.setattr(k4, "execute", lambda planned, args, logs: seen.append(k4.ran_on(run_dir)))
    cell = {"k": ("span", 1e-3, 0.05, 101)}

    def again():
        return k4.runs_of(tmp_path, {"checksum": "a" * 64, "flags": []}, "confirm", cell, k4.parse_args([]))

    monkeypatch.setattr(k4, "machine", lambda: {"cpu": "AMD EPYC"})
    assert k4.ran_on(run_dir) == "?" and again() == {"k": run_dir} and seen == ["AMD EPYC"]
    (run_dir / "checkpoint.pt").write_text("")  # the session stopped mid-run; the next one resumes it elsewhere
    monkeypatch.setattr(k4, "machine", lambda: {"cpu": "Intel Xeon"})
    again()
    assert seen[-1] == "AMD EPYC + Intel Xeon"
    (run_dir / "checkpoint.pt").unlink()  # killed before its first checkpoint: 03 starts it again from scratch
    again()
    assert seen[-1] == "Intel Xeon"


def test_save_stores_no_record_of_a_run_that_has_not_run(tmp_path):
    """runs_of records a run's CPU before 03 starts it: a run still waiting (machine.json alone) or still running
    (no full metrics yet) is not stored, a finished one is, with its record."""
    confirm = tmp_path / "out" / "runs" / ("ab" * 8) / "confirm"
    for name, rows in (("waiting", None), ("running", 1), ("finished", 2)):
        (confirm / name).mkdir(parents=True)
        (confirm / name / "machine.json").write_text('{"cpus": ["Intel Xeon"]}')
        if rows is not None:
            (confirm / name / "config.json").write_text('{"steps": 2}')
            (confirm / name / "metrics.jsonl").write_text('{"step": 1}\n' * rows)
    k4.save(tmp_path / "out", tmp_path / "store")
    stored = sorted(
        p.relative_to(tmp_path / "store").parts[-2:] for p in (tmp_path / "store").rglob("*") if p.is_file()
    )
    assert stored == [("finished", "config.json"), ("finished", "machine.json"), ("finished", "metrics.jsonl")]


def test_save_stores_a_start_only_once_its_models_are_finished(tmp_path):
    """A session that stops (and saves) while start seed 0's SFT start trains: its base model is stored, the
    half-written SFT folder (no config.json yet) is not, so a fresh machine trains it again from the start; nor is
    the summary results.json."""
    out = tmp_path / "out"
    for folder, files in (("s0/base", ("config.json", "model.safetensors")), ("s0/sft", ("checkpoint-100.bin",))):
        (out / folder).mkdir(parents=True)
        for name in files:
            (out / folder / name).write_text(name)
    (out / "results.json").write_text("{}")  # the summary each phase's end rewrites: never stored
    k4.save(out, tmp_path / "store")
    stored = sorted(str(p.relative_to(tmp_path / "store")) for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert stored == ["s0/base/config.json", "s0/base/model.safetensors"]
