"""bench/: a finished run is reused only when the settings that made it are the ones asked for (bench/shared/run_cache.py);
a folder made otherwise, or whose settings were never recorded, is refused in one line, never mixed into a result."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from conftest import ROOT

import common
import critics
from critics import plugin

sys.path.insert(0, str(ROOT / "bench"))
import ablations  # noqa: E402
import demo_seeds  # noqa: E402
import real_critic  # noqa: E402
import span_vs_scalar  # noqa: E402


@pytest.fixture(autouse=True)
def environ_restored():
    """os.environ as it was before each test: credit.one_thread pins OMP_NUM_THREADS and MKL_NUM_THREADS for the
    bench's own process, and in a test worker that outlived the test, sending every later stage run of the worker to
    a fresh interpreter (tests/forkserver.py: a variable read at import that differs from the fork server's)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_every_bench_module_imports_first():
    """Each bench module imported first in a fresh interpreter (the others not yet loaded): an import cycle
    (paper_baselines -> real_critic -> paper_baselines) stops `python bench/credit/credit.py` while the suite, which had
    imported real_critic first, passes."""
    code = (
        "import importlib, pathlib, sys\nnames = [p.stem for p in pathlib.Path('.').glob('*.py')]\n"
        "for name in names:\n    for n in names:\n        sys.modules.pop(n, None)\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "bench",
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "bench")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _metrics(run_dir, n):
    common.write_jsonl(
        run_dir / "metrics.jsonl",
        [
            {
                "step": i + 1,
                "exact/mistake_rate": 0.5,
                "exact/span_reward": 1.0,
                "objective/kl": 0.0,
                "response/length": 9.0,
            }
            for i in range(n)
        ],
    )


def _never(*a, **k):
    raise AssertionError("a cached run must not be run again")


def test_settings_are_recorded_then_matched(tmp_path):
    """check_settings records a folder's settings next to it; the same settings pass, other ones exit naming the first
    difference; a folder holding output without recorded settings exits too. An empty folder takes any settings."""
    import run_cache

    folder = tmp_path / "run"
    run_cache.check_settings(folder, {"argv": ["a", "b"], "seed": 1})
    _metrics(folder, 1)
    run_cache.check_settings(folder, {"argv": ["a", "b"], "seed": 1})
    with pytest.raises(
        SystemExit,
        match=rf"^{folder}: made with other settings \(argv\[1\]: 'b' there, 'c' now\);"
        r" delete it or pick another --out$",
    ):
        run_cache.check_settings(folder, {"argv": ["a", "c"], "seed": 1})
    with pytest.raises(SystemExit, match=r"\(seed: 1 there, 2 now\)"):
        run_cache.check_settings(folder, {"argv": ["a", "b"], "seed": 2})
    run_cache.settings_path(folder).unlink()
    with pytest.raises(
        SystemExit,
        match=rf"^{folder}: holds output whose settings were not recorded; delete it "
        r"or pick another --out$",
    ):
        run_cache.check_settings(folder, {"argv": ["a", "b"], "seed": 1})


def test_a_cached_ppo_run_is_reused_only_with_its_own_flags(tmp_path, monkeypatch):
    """bench/span_vs_scalar/span_vs_scalar.py's runs (and bench/ablations/ablations.py's, which are the same function): a finished run made by
    other flags, e.g. another critic, is refused; one made by these flags is read, not run again."""
    out, run_dir = tmp_path / "out", tmp_path / "out" / "span_seed1"
    _metrics(run_dir, 3)  # a finished run whose flags nobody recorded
    monkeypatch.setattr(span_vs_scalar, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        span_vs_scalar.ppo_run(out, run_dir, 1, 3, ["--critic", "local", "--reward-model", "smol_rm"])
    import run_cache

    made = span_vs_scalar.ppo_command(out, run_dir, 1, ["--critic", "program"])
    common.write_json(
        run_cache.settings_path(run_dir),  # as if this bench had made it
        {"argv": made, "inputs": run_cache.inputs_content(made)},
    )
    with pytest.raises(SystemExit, match="made with other settings"):
        span_vs_scalar.ppo_run(out, run_dir, 1, 3, ["--critic", "local", "--reward-model", "smol_rm"])
    curves = span_vs_scalar.ppo_run(out, run_dir, 1, 3, ["--critic", "program"])
    assert curves["mistakes"] == [0.5] * 3


def test_a_cached_demo_chain_is_reused_only_with_its_own_stages(tmp_path, monkeypatch):
    """bench/demo_seeds/demo_seeds.py and bench/real_critic/real_critic.py: a chain folder that other stages made is refused."""
    work = tmp_path / "seed1_threads1"
    common.write_json(work / "runs/demo/results.json", {"policies": {}})
    common.write_json(work / "runs/demo/reward_model/eval.json", {})
    monkeypatch.setattr(demo_seeds.subprocess, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        demo_seeds.run_chain(work, 1, 1)
    import run_cache

    common.write_json(run_cache.settings_path(work), demo_seeds.chain_settings(1, 1, demo_seeds.STAGES))
    assert demo_seeds.run_chain(work, 1, 1)["policies"] == {}
    smol = [("03_train_policy.py", ["--critic", "local", "--reward-model", "runs/demo/smol_rm"])]
    with pytest.raises(SystemExit, match="made with other settings"):
        demo_seeds.run_chain(work, 1, 1, smol)
    with pytest.raises(SystemExit, match="made with other settings"):
        demo_seeds.run_chain(work, 2, 1)


def test_a_continued_scalar_run_is_keyed_too(tmp_path, monkeypatch):
    """bench/real_critic/real_critic.py --scalar-steps N: a scalar_toN folder that another command made is refused."""
    work = tmp_path / "seed1"
    _metrics(work / "runs/demo/scalar_to5", 5)
    monkeypatch.setattr(real_critic.subprocess, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        real_critic.extend_scalar(
            work, 1, "runs/demo/smol_rm", real_critic.parse_args(["--scalar-steps", "5", "--threads", "1"])
        )


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


def test_gpu_recipe_runs_the_readme_recipe_path_on_a_cpu(tmp_path):
    """bench/gpu_recipe/gpu_recipe.py (the 8B recipe's measurement, issue 34) on its tiny shapes: stage 2's reward model is stage
    3's critic, both built from a config without weight files, every phase timed, the responses forced to full
    length, the first iteration's KL 0, and a decode step against its bound."""
    import json
    import subprocess

    out = tmp_path / "gpu"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/gpu_recipe/gpu_recipe.py",
            "--tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--out",
            str(out),
            "--phases",
            "stage2,stage3,decode",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((out / "base").glob("*.safetensors"))  # random weights, built on the spot
    stage2, stage3, decode = (json.loads((out / f"{n}.json").read_text()) for n in ("stage2", "stage3", "decode"))
    assert stage2["steps"] == 3 and all(s > 0 for s in stage2["s_per_step"])
    assert json.loads((out / "rm" / "reward_model.json").read_text())["train"]["steps"] == 3
    assert set(stage3["last_iteration"]) == {"rollout", "critic", "score_rollouts", "ppo_update"}
    assert all(len(v) == 2 and all(x["s"] > 0 for x in v) for v in stage3["all_iterations"].values())
    rows = [json.loads(x) for x in (out / "stage3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["response/length"] for r in rows] == [8.0, 8.0] and rows[0]["objective/kl"] == 0.0
    assert decode["bound_ms_weights"] > 0 and all(
        decode[h]["step_ms"] > 0 for h in ("eager", "eager-no-lora", "static")
    )


def test_real_critic_chains_keep_their_stages_and_pass_the_policy_flags(tmp_path):
    """bench/real_critic/real_critic.py: without the new flags a seed's stages are the ones its chains were made with (so their
    folders stay valid); --policy-model and the GPU flags reach 03 (and its --scalar-steps continuation) and 04."""
    smol, rm = tmp_path / "smollm2", str(tmp_path / "rm")
    stages = real_critic.chain_stages(real_critic.parse_args(["--reward-model", rm]), smol, rm)
    assert stages == [
        ("01_annotate.py", []),
        ("02_train_reward.py", []),
        ("03_train_policy.py", ["--critic", "local", "--reward-model", rm, "--steps", "60"]),
        ("04_evaluate.py", ["--reward-model", rm, "--monitor-reward-model", "toy=runs/demo/reward_model"]),
    ]
    args = real_critic.parse_args(
        [
            "--reward-model",
            rm,
            "--policy-model",
            str(smol),
            "--no-toy",
            "--dtype",
            "bf16",
            "--compile-generation",
            "--gen-batch-size",
            "200",
            "--device",
            "cuda",
            "--sft-steps",
            "50",
            "--eval-limit",
            "20",
        ]
    )
    ppo = [
        "--model",
        str(smol),
        "--sft-lr",
        "0.0001",
        "--lr",
        "0.0002",
        "--sft-steps",
        "50",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--compile-generation",
    ]
    assert real_critic.chain_stages(args, smol, rm) == [
        ("01_annotate.py", []),
        ("03_train_policy.py", ["--critic", "local", "--reward-model", rm, "--steps", "60", *ppo]),
        (
            "04_evaluate.py",
            [
                "--reward-model",
                rm,
                "--device",
                "cuda",
                "--limit",
                "20",
                "--dtype",
                "bf16",
                "--batch-size",
                "200",
                "--rm-batch-size",
                "200",
            ],
        ),
    ]
    assert real_critic.policy_flags(args) == ppo
    train_rm = real_critic.chain_stages(real_critic.parse_args(["--gen-batch-size", "200"]), smol, "x")[2]
    assert train_rm[0] == "02_train_reward.py" and train_rm[1][-2:] == ["--gen-batch-size", "200"]


def test_a_chains_stages_keep_the_callers_pythonpath(tmp_path, monkeypatch):
    """Issue 34, found on a GPU: run_chain (and real_critic's scalar continuation) replaced PYTHONPATH by the repo, so
    packages installed with `pip install --target DIR` + PYTHONPATH=DIR (the GPU machine's newer transformers) were
    gone in every stage: the stages ran another transformers than the one the chain was started with."""
    import os

    seen = []
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, env, **k: seen.append(env["PYTHONPATH"]))
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    work = tmp_path / "seed1"
    with pytest.raises(FileNotFoundError):  # the stub runs nothing, so there is no results.json to read
        demo_seeds.run_chain(work, 1, 1, [("01_annotate.py", [])])
    (tmp_path / "seed2/runs/demo/scalar").mkdir(parents=True)  # what the continuation copies
    real_critic.extend_scalar(tmp_path / "seed2", 1, "rm", real_critic.parse_args(["--scalar-steps", "5"]))
    assert seen == [f"{ROOT}{os.pathsep}/opt/site"] * 2


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


def test_versus_best_pairs_text2grad_with_the_best_baseline_post_by_post():
    """bench/paper_baselines/paper_baselines.py's decisive comparison, against a plain loop: the best baseline is the one with the
    lowest median held-out mistake rate (the oracle row never counts); each seed's difference is the mean over posts of
    Text2Grad's mistake minus the baseline's on the same post (an unseeded baseline pairs with every seed); the
    intervals hold their estimate, and one clearly below 0 excludes 0."""
    import paper_baselines

    rows = {
        r: [{"mistake_rate": m}]
        for r, m in [
            ("SFT", 0.5),
            ("SFT + reflection, RM critique", 0.3),
            ("SFT + reflection, oracle critique", 0.0),
            ("SFT + revision, no critique", 0.4),
        ]
    }
    rows.update(
        {
            r: [{"mistake_rate": 0.6}] * 2
            for r in [*paper_baselines.DPO_ROWS, "PPO (BT RM)", "PPO (BT RM, unit std)", "PRM-PPO"]
        }
    )
    base = [1.0] * 30 + [0.0] * 70  # the reflection row: no seeds
    t2g = [[0.0] * 100, [1.0] * 10 + [0.0] * 90]  # two seeds
    per_post = {"SFT + reflection, RM critique": [base], "Text2Grad": t2g}
    res = paper_baselines.versus_best(rows, per_post, seed=0, resamples=2000)
    assert res["best_baseline"] == "SFT + reflection, RM critique"
    for i, seed in enumerate(res["per_seed"]):
        expected = sum(a - b for a, b in zip(t2g[i], base)) / len(base)
        assert seed["difference"] == pytest.approx(expected)
        assert seed["interval"][0] <= seed["difference"] <= seed["interval"][1] < 0
    assert res["mean_difference"] == pytest.approx((-0.30 - 0.20) / 2)
    assert res["interval"][0] <= res["mean_difference"] <= res["interval"][1] < 0


def test_the_on_task_comparison_skips_a_baseline_that_left_the_task():
    """A baseline can win the mistake rate by leaving the task (issue 44's BT-PPO: ROUGE-L 0.11 against SFT's 0.94,
    KL 122): on_task_baselines keeps the rows whose median ROUGE-L is at least the SFT start's, and versus_best
    among those picks the best of them."""
    import paper_baselines

    rows = {
        "SFT": [{"mistake_rate": 0.5, "rougeL": 0.90}],
        "SFT + reflection, RM critique": [{"mistake_rate": 0.3, "rougeL": 0.95}],
        "SFT + revision, no critique": [{"mistake_rate": 0.4, "rougeL": 0.92}],
        "PPO (BT RM)": [{"mistake_rate": 0.05, "rougeL": 0.1}, {"mistake_rate": 0.1, "rougeL": 0.2}],
        "PPO (BT RM, unit std)": [{"mistake_rate": 0.2, "rougeL": 0.91}, {"mistake_rate": 0.2, "rougeL": 0.89}],
        "PRM-PPO": [{"mistake_rate": 0.6, "rougeL": 0.97}] * 2,
    }
    rows.update({r: [{"mistake_rate": 0.6, "rougeL": 0.5}] * 2 for r in paper_baselines.DPO_ROWS})
    kept = paper_baselines.on_task_baselines(rows)
    assert "PPO (BT RM)" not in kept and "PPO (BT RM, unit std)" in kept and "PRM-PPO" in kept
    assert not set(paper_baselines.DPO_ROWS) & set(kept)
    per_post = {r: [[0.0] * 10] * 2 for r in ("Text2Grad", "PPO (BT RM)", "PPO (BT RM, unit std)")}
    assert paper_baselines.versus_best(rows, per_post, 0, 200)["best_baseline"] == "PPO (BT RM)"
    assert paper_baselines.versus_best(rows, per_post, 0, 200, kept)["best_baseline"] == "PPO (BT RM, unit std)"


def test_held_out_rows_pair_with_their_posts_by_id_however_the_cache_holds_them(tmp_path, tiny_model_dir):
    """04's generations cache is append-only: a resumed run, or two runs on one folder, can hold rows out of the
    records' order or twice (issue 55's confirm phase: 1,488 rows for 1,000 posts). sequence_kl paired rows with
    prompts by position, so such a cache gave another policy's KL or crashed; now every bench reads the cache by id,
    and a post without a row is one line naming the file."""
    import paper_baselines
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tasks.demo import demo_dataset

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.save_pretrained(tmp_path / "policy")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.save_pretrained(tmp_path / "policy")
    records = demo_dataset("eval", 5)
    rows = [{"id": r["id"], "response": r["response"], "response_ids": tok.encode(r["response"])[:12]} for r in records]
    common.write_jsonl(tmp_path / "ordered.jsonl", rows)
    common.write_jsonl(tmp_path / "resumed.jsonl", rows[3:] + rows + rows[:2])
    kl = {
        name: paper_baselines.sequence_kl(
            str(tmp_path / "policy"), tiny_model_dir, records, tmp_path / f"{name}.jsonl", 12
        )
        for name in ("ordered", "resumed")
    }
    assert kl["ordered"] != 0.0 and kl["resumed"] == pytest.approx(kl["ordered"], rel=1e-5)
    assert paper_baselines.post_mistakes(tmp_path / "resumed.jsonl", records) == paper_baselines.post_mistakes(
        tmp_path / "ordered.jsonl", records
    )
    common.write_jsonl(tmp_path / "short.jsonl", rows[:4])
    with pytest.raises(SystemExit, match=r"short\.jsonl: no generation for 1 of 5 posts"):
        paper_baselines.sequence_kl(str(tmp_path / "policy"), tiny_model_dir, records, tmp_path / "short.jsonl", 12)


def test_a_ppo_run_killed_before_its_first_checkpoint_starts_again(tmp_path):
    """paper_baselines.ppo always passed --resume; a run killed before its first checkpoint (every 25 iterations)
    left metrics.jsonl and no checkpoint.pt, which 03 refuses to resume: the bench stopped there on every rerun.
    Such a run starts again (--overwrite); one with a checkpoint resumes; a finished one is not run."""
    import paper_baselines

    flags = ["--critic", "program"]
    run_dir, argv = paper_baselines.ppo(tmp_path, "Text2Grad", 1, 4, flags)
    assert argv[-1] == "--resume" and not run_dir.exists()  # nothing there: 03 starts it fresh
    _metrics(run_dir, 2)  # killed at iteration 2, before any checkpoint
    assert paper_baselines.ppo(tmp_path, "Text2Grad", 1, 4, flags)[1][-1] == "--overwrite"
    (run_dir / "checkpoint.pt").write_bytes(b"")
    assert paper_baselines.ppo(tmp_path, "Text2Grad", 1, 4, flags)[1][-1] == "--resume"
    _metrics(run_dir, 4)
    (run_dir / "policy").mkdir()
    assert paper_baselines.ppo(tmp_path, "Text2Grad", 1, 4, flags)[1] is None


def test_each_ppo_run_says_which_device_trained_it(tmp_path):
    """A table may mix runs trained on this CPU with runs trained on a lent GPU (issue 44's were): each PPO row's
    values carry the device 03 recorded in the run's config.json, and the printed table says which runs were not
    on a CPU."""
    import paper_baselines

    for seed, device in ((1, "cpu"), (2, "cuda")):
        run_dir = tmp_path / f"run{seed}"
        _metrics(run_dir, 4)
        common.write_json(run_dir / "config.json", {"device": device})
        assert paper_baselines.curve_stats(run_dir, 4)["device"] == device
    run_dir = tmp_path / "run2"  # 03's segments: where each invocation's iterations ran
    segments = [{"from_step": 1, "device": "cuda"}, {"from_step": 5, "device": "cpu"}]  # resumed when finished
    common.write_json(run_dir / "config.json", {"device": "cpu", "segments": segments})
    assert paper_baselines.run_device(run_dir, 4) == "cuda"
    common.write_json(
        run_dir / "config.json",
        {"device": "cuda", "segments": [{"from_step": 1, "device": "cpu"}, {"from_step": 3, "device": "cuda"}]},
    )
    assert paper_baselines.run_device(run_dir, 4) == "cpu+cuda"
    rows = {
        "Text2Grad": [{"device": "cpu"}, {"device": "cuda:0"}],
        "PRM-PPO": [{"device": "cuda"}, {"device": "cpu"}],
        "SFT": [{}],
    }
    assert paper_baselines.devices_line(rows) == "not on a CPU: Text2Grad seed 2 (cuda:0); PRM-PPO seed 1 (cuda)"
    assert paper_baselines.devices_line({"Text2Grad": [{"device": "cpu"}]}) == ""


def test_a_reward_model_killed_before_its_eval_without_a_checkpoint_is_trained_again(tmp_path):
    """The same for 02: a reward model saved (reward_model.json) but killed before eval.json, with no checkpoint to
    resume from (--rm-steps below 02's save interval), was passed --resume, which 02 refuses. It is trained again; one with a
    checkpoint resumes; a finished one is not run."""
    import paper_baselines

    rm, argv = paper_baselines.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])
    assert argv[-1] == "--resume" and not rm.exists()
    common.write_json(rm / "reward_model.json", {})
    assert paper_baselines.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])[1][-1] == "--overwrite"
    (rm / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    assert paper_baselines.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])[1][-1] == "--resume"
    common.write_json(rm / "eval.json", {})
    assert paper_baselines.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])[1] is None


@pytest.mark.slow
def test_paper_baselines_rm_base_builds_every_reward_model_from_it_end_to_end(tmp_path, tiny_chat_model_dir):
    """`bench/paper_baselines/paper_baselines.py --rm-base DIR` at tiny shapes, end to end: the span, Bradley-Terry and PRM reward
    models all start from DIR with one recipe (the same adapter, lr, steps, answers per step); the reflection row that
    reads the span reward model's critique runs beside the oracle one; the JSON carries every row per seed, the reward
    models' quality and Text2Grad against the best baseline with its interval."""
    from pathlib import Path

    from infra.tiny_model import build_demo_base

    rm_base = Path(tiny_chat_model_dir)  # a chat model that is not the policy's base
    out = tmp_path / "pb"
    build_demo_base(out / "base", pretrain_steps=5, n_texts=200)  # the bench's own base, pretrained briefly
    forkserver.run(  # nested: the bench's own stage runs are forks too
        [
            sys.executable,
            "bench/paper_baselines/paper_baselines.py",
            "--annotators",
            "exact",
            "--rm-base",
            str(rm_base),
            "--seeds",
            "1",
            "--steps",
            "2",
            "--pool",
            "40",
            "--pairs",
            "6",
            "--rm-steps",
            "2",
            "--rm-min-parse-rate",
            "0",
            "--eval-posts",
            "8",
            "--sft-steps",
            "4",
            "--jobs",
            "2",
            "--out",
            str(out),
            "--",
            "--batch-size",
            "8",
            "--max-fail-share",
            "1",
        ],  # 2 steps teach no format: nothing parses
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        nested=True,
    )
    res = json.loads((out / "results.json").read_text())["settings"]["exact"]
    recipe = res["rm_recipe"]
    for name, flags in recipe.items():
        info = json.loads(
            (ROOT / [d for d in (out / "exact").glob(f"{name}-*") if d.is_dir()][0] / "reward_model.json").read_text()
        )
        assert info["base_model"] == str(rm_base.resolve()), name
        assert info["lora"]["r"] == 16 and info["train"]["steps"] == 2, name
        value = lambda f: flags[flags.index(f) + 1]  # noqa: E731
        assert [value(f) for f in ("--model", "--lr", "--lora-r", "--max-steps")] == [
            str(rm_base.resolve()),
            "1e-3",
            "16",
            "2",
        ], name
    answers_per_step = {
        n: int(recipe[n][recipe[n].index("--batch-size") + 1]) * (2 if n == "bt_rm" else 1) for n in recipe
    }
    assert set(answers_per_step.values()) == {8}
    assert set(res["rows"]) == set(__import__("paper_baselines").ROWS)
    assert all(len(v) == 1 for v in res["rows"].values())
    reflect = json.loads((ROOT / res["dirs"]["SFT + reflection, RM critique"] / "results.json").read_text())
    span_rm = [d for d in (out / "exact").glob("span_rm-*") if d.is_dir()][0]
    assert reflect["reward_model"] == str(span_rm) and "sft+reflect" in reflect["policies"]
    quality = res["reward_models_vs_exact"]
    assert {"pairwise_accuracy", "wrong_step_recall", "neg_recall"} <= {
        *quality["bt_rm"],
        *quality["prm"],
        *quality["span_rm"],
    }
    vs = res["versus_best"]
    assert vs["best_baseline"] in __import__("paper_baselines").BASELINES and vs["posts"] == 8
    assert res["versus_best_on_task"]["best_baseline"] in __import__("paper_baselines").on_task_baselines(res["rows"])
    assert vs["interval"][0] <= vs["mean_difference"] <= vs["interval"][1]


def test_a_cached_ppo_run_is_keyed_by_the_content_of_its_models(tmp_path, monkeypatch):
    """run_cache keys a run also by the content of the model and data its command line reads (--model,
    --reward-model, ...): a reward model retrained in the same folder makes a finished run there one of other
    settings (refused), never silently reused. Its output folders are not part of the key (they change as it runs)."""
    out, run_dir, rm = tmp_path / "out", tmp_path / "out" / "span_seed1", tmp_path / "rm"
    rm.mkdir()
    (rm / "model.safetensors").write_bytes(b"weights v1")
    flags = ["--critic", "local", "--reward-model", str(rm)]

    def fake_run(cmd):
        _metrics(run_dir, 3)

    monkeypatch.setattr(span_vs_scalar, "run", fake_run)
    span_vs_scalar.ppo_run(out, run_dir, 1, 3, flags)
    monkeypatch.setattr(span_vs_scalar, "run", _never)
    assert span_vs_scalar.ppo_run(out, run_dir, 1, 3, flags)["mistakes"] == [0.5] * 3  # the same model: reused
    (rm / "model.safetensors").write_bytes(b"weights v2")  # retrained in place
    with pytest.raises(SystemExit, match=rf"made with other settings \(inputs\.{rm}: '\w+' there, '\w+' now\)"):
        span_vs_scalar.ppo_run(out, run_dir, 1, 3, flags)


def _fake_locality(ratio: float) -> dict:
    """infra.locality.locality_summary of one update, every group alike (what bench/locality/locality.py's tables read)."""
    import locality

    return {**{g: {"mean": -0.1, "mean_abs": 0.1, "down": 0.5, "tokens": 3} for g in locality.GROUPS}, "ratio": ratio}


def test_locality_runs_both_critics_from_one_shared_sft_start(tmp_path, monkeypatch, tiny_model_dir):
    """bench/locality/locality.py --lams 0.95 0 (both critics, one --out): the SFT start does not depend on the critic, so the
    local critic reuses the program critic's start instead of being refused ('made with other settings')."""
    import locality
    from conftest import as_reward_model

    out, ran = tmp_path / "out", []
    (out / "base").mkdir(parents=True)
    (out / "base" / "config.json").write_text("{}")  # the demo base, as if built

    def fake_run(cmd):
        ran.append(cmd)
        (out / "sft").mkdir(exist_ok=True)
        (out / "sft" / "config.json").write_text("{}")

    monkeypatch.setattr(span_vs_scalar, "run", fake_run)
    rm = as_reward_model(tiny_model_dir, tmp_path / "rm")
    flags = {c: locality.shared_start(out, c, rm, 61, []) for c in ("program", "local")}
    assert len(ran) == 1 and "--sft-output-dir" in ran[0]  # one SFT start, trained once, for both critics
    assert flags["local"][:4] == ["--critic", "local", "--reward-model", str(Path(rm).resolve())]


def test_locality_writes_each_critics_results_as_it_finishes(tmp_path, monkeypatch):
    """A second critic that stops (here: refused) leaves the first one's measurements in OUT/results.json."""
    import locality

    def fake_start(out, critic, reward_model, steps, ppo_args):
        if critic == "local":
            raise SystemExit("the local critic stopped")
        return ["--critic", critic]

    monkeypatch.setattr(locality, "shared_start", fake_start)
    monkeypatch.setattr(locality, "states", lambda flags, seed, iterations, run_dir: {k: None for k in iterations})
    monkeypatch.setattr(
        locality,
        "one_update",
        lambda flags, seed, k, ckpt, work: {
            m: {
                "locality": _fake_locality(2.0 if m == "span" else 1.0),
                "advantage_locality": {"span": _fake_locality(1.5), "scalar": _fake_locality(1.0)},
            }
            for m in ("span", "scalar")
        },
    )
    with pytest.raises(SystemExit, match="the local critic stopped"):
        locality.main(
            ["--out", str(tmp_path / "out"), "--seeds", "1", "--iterations", "0", "--png", str(tmp_path / "l.png")]
        )
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["critics"]) == ["program"]
    assert results["critics"]["program"]["lam 0.95"]["span_over_scalar_ratio"]["median"] == 2.0


def test_token_identity_counts_the_tokens_two_decoders_share():
    """bench/gpu_recipe/gpu_recipe.py's token_identity against counts by hand: the share of identical tokens over both widths,
    the rows identical throughout, and where each row first differs (a flipped sample changes the rest of its row)."""
    import gpu_recipe
    import torch

    a = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    b = torch.tensor([[1, 2, 3, 0], [4, 9, 6, 0], [7, 8, 9, 5]])  # one token flipped; one row one step longer
    assert gpu_recipe.token_identity(a, b) == {
        "tokens": 12,
        "identical": 8,
        "identical_share": 8 / 12,
        "rows": 3,
        "rows_identical": 0,
        "first_difference": [3, 1, 3],
    }
    assert gpu_recipe.token_identity(a, a)["identical_share"] == 1.0
    assert gpu_recipe.token_identity(a, a)["first_difference"] == [None] * 3


def test_gpu_recipe_tokens_phase_compares_eager_and_static_rollouts_on_a_cpu(tmp_path):
    """The tokens phase on its tiny shapes, the static decode not compiled (--no-compile: no C++ compiler needed):
    eager generate() and static_decode sample the same rollout tokens from the same seed, every one of them."""
    out = tmp_path / "gpu"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/gpu_recipe/gpu_recipe.py",
            "--tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--out",
            str(out),
            "--phases",
            "tokens",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads((out / "tokens.json").read_text())
    assert tokens["compiled"] is False and tokens["dtype"] == "float32" and tokens["rows"] == 8
    assert tokens["tokens"] == 8 * 8 and tokens["identical_share"] == 1.0 and tokens["rows_identical"] == 8


# ---------------------------------------------------------------------------------------------------------------------
# bench/credit/credit.py: when per-token credit helps (issue 55)
# ---------------------------------------------------------------------------------------------------------------------

import credit  # noqa: E402
import credit_arms  # noqa: E402


def test_credit_arms_label_exactly_what_the_exact_critic_flags(tiny_tokenizer):
    """Every arm puts delta only on tokens inside an interval the demo critic flags (no quote widened to be unique:
    on these answers the quoting critic's delta differs); poor_only is min(span, 0); clause_scores is a perfect PRM's
    step_deltas, its clauses the PRM's (split_steps), wrong where a flagged poor interval overlaps them."""
    from baselines.scalar_rm import split_steps
    from critics.scalar import step_deltas
    from tasks.demo import demo_dataset, demo_intervals, demo_labels

    widened = 0
    for k in (1, 2):
        for rec in demo_dataset("sft", 60, pets=k):
            text, offsets = common.decode_with_offsets(
                tiny_tokenizer, tiny_tokenizer(rec["response"], add_special_tokens=False)["input_ids"]
            )
            d = {
                arm: critics.delta(text, offsets, critics.call(getattr(credit_arms, arm), arm, [rec], [text])[0])[0]
                for arm in ("span", "poor_only", "clause_scores")
            }
            flagged = demo_intervals(text, demo_labels(rec["prompt"], text))
            for (s, e), v in zip(offsets, d["span"]):
                s, e = common._core(text, s, e)
                assert not v or any(a <= s and e <= b for a, b in flagged["good"] + flagged["poor"])
            assert d["poor_only"] == [min(v, 0.0) for v in d["span"]]
            bad = lambda s, e: any(a < e and s < b for a, b in flagged["poor"])  # noqa: E731
            assert d["clause_scores"] == step_deltas(
                offsets, [(e, -1.0 if bad(s, e) else 1.0) for s, e in split_steps(text, "clause")]
            )
            quoting = critics.call(plugin.load_critic("program", "demo", "--critic")[0], "p", [rec], [text])[0]
            widened += critics.delta(text, offsets, quoting)[0] != d["span"]
    assert widened  # the bench's reason for its own arms: the quoting critic widens some labels


def test_fair_scalar_and_poor_facts_score_facts_stated_less_mistakes(tiny_tokenizer):
    """Issue 65's arms an empty answer cannot win. Hand-counted: the answer with "luna" for rex, the aside "monday"
    and the repeated "fish" states 5 facts and makes 3 mistakes: fair_scalar scores 5 - 3 = 2 at EOS and nothing
    else; poor_facts is poor_only's delta with the 5 facts added on the last token; the empty answer scores 0."""
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    rec = {"prompt": post}
    for text, facts, mistakes in (
        (" tom has a red dog called luna that likes the park on monday and eats fish fish.", 5, 3),
        (" tom has a red dog called rex that likes the park and eats fish.", 6, 0),
    ):
        offsets = common.decode_with_offsets(
            tiny_tokenizer, tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        )[1]
        d = {
            arm: critics.delta(text, offsets, critics.call(getattr(credit_arms, arm), arm, [rec], [text])[0])[0]
            for arm in ("fair_scalar", "poor_facts", "poor_only")
        }
        assert d["fair_scalar"] == [0.0] * (len(offsets) - 1) + [facts - mistakes]
        assert d["poor_facts"] == d["poor_only"][:-1] + [d["poor_only"][-1] + facts]
    assert credit_arms.fair_scalar([rec], [""]) == [{"critique": "", "spans": [], "score": 0.0}]


def test_per_pet_arms_divide_every_reward_by_k_and_change_nothing_at_k1(tiny_tokenizer):
    """bench/credit/credit.md, amendment 1: an arm's _per_pet twin is its delta divided by the post's K (pets), the same at
    K = 1, for intervals and scores alike."""
    from tasks.demo import demo_dataset

    for k in (1, 2):
        for rec in demo_dataset("sft", 20, pets=k):
            text = rec["response"]
            offsets = common.decode_with_offsets(
                tiny_tokenizer, tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
            )[1]
            for arm in ("span", "poor_facts", "fair_scalar", "clause_scores"):
                d = [
                    critics.delta(text, offsets, critics.call(getattr(credit_arms, name), name, [rec], [text])[0])[0]
                    for name in (arm, arm + "_per_pet")
                ]
                assert d[1] == [x / k for x in d[0]]


def test_sample_scores_count_the_exact_critics_flags_and_the_facts_per_logged_answer(tmp_path):
    """The sweep's mistakes per answer: "luna" for rex, the aside "monday" and the repeated "fish" are 3; the clean
    answer 0; the empty one 0 mistakes and 0 of 5 facts; a row logged before from_step is not read."""
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    bad = " tom has a red dog called luna that likes the park on monday and eats fish fish."  # 5 facts, luna wrong
    clean = " tom has a red dog called rex that likes the park and eats fish."
    common.write_jsonl(
        tmp_path / "samples.jsonl",
        [
            {"step": 100, "prompt": post, "response": bad},
            {"step": 110, "prompt": post, "response": bad},
            {"step": 150, "prompt": post, "response": clean},
            {"step": 150, "prompt": post, "response": ""},
        ],
    )
    assert credit.sample_scores(tmp_path, 110) == {"mistakes": 1.0, "facts": (5 + 6 + 0) / 18}
    assert credit.sample_scores(tmp_path, 150) == {"mistakes": 0.0, "facts": 6 / 12}


def test_credit_ratios_and_paired_differences_against_hand_computed_values():
    rng = __import__("numpy").random.default_rng(0)
    r = credit.step_ratio([20, 30], [40, 60], rng, resamples=200)
    assert r["ratio"] == 0.5 and r["interval"] == [0.5, 0.5]  # every resample pairs seeds: the same ratio
    d = credit.paired_difference([[1, 0, 0, 0]], [[1, 1, 1, 0]], rng, resamples=500)
    assert d["difference"] == -0.5 and d["interval"][0] <= -0.5 <= d["interval"][1]
    grid = {
        ("a", 1e-3, 0.05, 1): {"steps": 30, "final": 0.2},
        ("a", 1e-3, 0.05, 2): {"steps": 50, "final": 0.1},
        ("a", 2e-3, 0.05, 1): {"steps": 40, "final": 0.1},
        ("a", 2e-3, 0.05, 2): {"steps": 40, "final": 0.3},
    }
    chosen = credit.select(grid)["a"]  # the lower median steps (40 vs 40: the lower final rate, 0.15 vs 0.2)
    assert (chosen["lr"], chosen["score"]) == (1e-3, [40, 0.15000000000000002])


@pytest.mark.slow  # 93 s of a worker in the 2026-11-27 profile (docs/tests.md)
def test_credit_bench_runs_every_arm_and_selects_on_training_curves_alone(
    forked_stages, tmp_path, monkeypatch, tiny_model_dir
):
    """A tiny grid of every arm, end to end through 03, then the selection: it reads the grid's metrics alone. No
    held-out post is made or read before the confirmation phase (demo_dataset("eval", ...) raises here). Then, for
    two arms, the confirmation and the K sweep, whose final training rates pair up seed by seed with the scalar's."""
    from tasks.demo import demo_dataset

    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 8))
    flags = [
        "--model",
        tiny_model_dir,
        "--sft-steps",
        "0",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        "--trace-samples",
        "0",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--device",
        "cpu",
    ]
    monkeypatch.setattr(credit, "start", lambda out, pets, args: flags)
    monkeypatch.setattr(credit, "THRESHOLD", -1.0)  # the tiny model's answers hold no demo mistakes to bring down

    def no_eval(split, *a, **k):
        assert split != "eval", "the selection read a held-out post"
        return demo_dataset(split, *a, **k)

    monkeypatch.setattr(credit, "demo_dataset", no_eval)
    out = tmp_path / "credit"
    result = credit.main(
        [
            "--steps",
            "2",
            "--lrs",
            "1e-3",
            "--kl-coefs",
            "0.05",
            "--grid-seeds",
            "1",
            "--stop-after",
            "select",
            "--out",
            str(out),
            "--results",
            "",
        ]
    )
    assert set(result["selection"]) == set(credit.ARMS) and result["best_scalar"] in credit.SCALAR_ARMS
    runs = sorted((out / "grid").glob("*/metrics.jsonl"))
    assert len(runs) == len(credit.ARMS) and all(len(common.read_jsonl(m)) == 2 for m in runs)
    assert not list(out.rglob("eval*.jsonl"))

    # then the confirmation and the K sweep, for two arms (the grid's runs reused; 04's judging: credit_learned's test)
    monkeypatch.setattr(credit, "demo_dataset", demo_dataset)
    monkeypatch.setattr(
        credit,
        "judge",
        lambda out, name, policy, *a: {
            "mistake_rate": 0.5,
            "rougeL": 0.9,
            "heldout_kl": 0.0,
            "per_post": [float(i % 2) for i in range(4)],
        },
    )
    for k in (1, 2):
        common.write_jsonl(out / f"k{k}" / "prompts.jsonl", demo_dataset("train", 8, pets=k))
    result = credit.main(
        [
            "--steps",
            "2",
            "--lrs",
            "1e-3",
            "--kl-coefs",
            "0.05",
            "--grid-seeds",
            "1",
            "--arms",
            "span",
            "poor_scalar",
            "--confirm-seeds",
            "1",
            "--sweep-seeds",
            "1",
            "--ks",
            "2",
            "--eval-posts",
            "4",
            "--out",
            str(out),
            "--results",
            "",
        ]
    )
    assert len(list((out / "grid").glob("*/metrics.jsonl"))) == len(credit.ARMS)  # nothing ran twice
    assert set(result["confirm"]) == {"sft", "span", "poor_scalar"} and (out / "confirm").is_dir()
    arm, ref = result["sweep"][2]["span"], result["sweep"][2]["poor_scalar"]
    assert len(arm["steps"]) == len(arm["final"]) == len(arm["train_kl"]) == len(arm["length"]) == 1
    assert arm["heldout_kl"] == [0.0] and arm["train_kl"][0] != 0.0  # each KL under its own name (issue 65)
    per_post = json.loads((out / "results.json").read_text())["per_post"]
    assert per_post["k2/span/seed101"] == "0101"  # every sweep policy's 0/1 per held-out post
    scores = credit.sample_scores(next((out / "sweep_k2").glob("span_*")), 0)
    assert [arm["mistakes"], arm["facts"]] == [[scores["mistakes"]], [scores["facts"]]]
    assert arm["final_versus_scalar"] == {
        "difference": pytest.approx(arm["final"][0] - ref["final"][0]),
        "interval": [pytest.approx(arm["final"][0] - ref["final"][0])] * 2,
    }
    assert result["sweep"][2]["poor_scalar"]["final_versus_scalar"] == {"difference": 0.0, "interval": [0.0, 0.0]}

    # --from-selection: the sweep alone at a committed selection, nothing of phases 1-3 run or read
    common.write_json(tmp_path / "sel.json", {"selection": result["selection"], "best_scalar": "poor_scalar"})
    monkeypatch.setattr(credit, "phases_1_to_3", None)
    argv = [*"--steps 2 --sweep-seeds 1 --ks 2 --eval-posts 4 --results".split(), "", "--out", str(out)]
    again = credit.main([*argv, "--from-selection", str(tmp_path / "sel.json")])
    assert again["sweep"][2]["span"]["steps"] == arm["steps"] and "confirm" not in again
    curves = json.loads((out / "results.json").read_text())["curves"]  # every iteration's rate, to rerun against
    assert len(curves["k2/span/seed101"]) == 2 and set(again["sweep"][2]) == {"sft", "span", "poor_scalar"}
    one = credit.main([*argv, "--from-selection", str(tmp_path / "sel.json"), "--sweep-arms", "span"])
    assert set(one["sweep"][2]) == {"sft", "span"}


# bench/credit/credit_matched.py: per-token credit at matched difficulty (issue 65)
import credit_matched  # noqa: E402

BUILD = """
import sys
from pathlib import Path
sys.path.insert(0, "bench")
import credit_matched as cm
args = cm.parse_args(["--tiny", "--out", sys.argv[1]])
cm.one_thread()
print(cm.build_world(Path(sys.argv[1]), 2, 1, int(sys.argv[2]), args)["checksum"])
"""


def test_a_start_built_twice_is_the_same_bytes_whatever_the_thread_count(tmp_path):
    """Issue 65, item 2: a world's base model and SFT start, built in two processes, one given 2 threads by its
    environment, are the same bytes (credit.one_thread); the other seed is another start."""

    def build(folder, seed, threads):
        env = {**__import__("os").environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(
            [sys.executable, "-c", BUILD, str(tmp_path / folder), str(seed)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()[-1]

    one, two = build("a", 0, 1), build("b", 0, 2)
    assert one == two and build("c", 1, 1) != one


def test_credit_matched_statistics_against_hand_computed_values():
    """The sign-flip test's exact p (3 positive differences: 2 of the 8 sign patterns are as extreme), Holm's step-down
    adjustment by hand, and compare(): the steps ratio of paired seeds, its p, the seed left out as most extreme, and
    the held-out difference of 0/1 posts."""
    cm = credit_matched
    assert cm.sign_flip_p([1, 1, 1]) == 0.25 and cm.sign_flip_p([1, -1]) == 1.0
    assert cm.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    rng = __import__("numpy").random.default_rng(0)
    arm = {"steps": [10, 20, 30, 100], "imperfect": [[1, 0], [0, 0], [1, 1], [0, 0]]}
    ref = {"steps": [20, 40, 60, 40], "imperfect": [[1, 1], [1, 0], [1, 1], [0, 0]]}
    out = cm.compare(arm, ref, ["A", "A", "B", "B"], rng, resamples=200)
    st, h = out["steps_ratio"], out["heldout_imperfect"]
    assert st["ratio"] == 160 / 160 and st["extreme_seed"] == 3 and st["without_extreme"] == 60 / 120
    assert st["p"] == cm.sign_flip_p([-10, -20, -30, 60])
    assert h["difference"] == -2 / 8 and h["per_seed"] == [-0.5, -0.5, 0.0, 0.0]
    assert h["interval"][0] <= -0.25 <= h["interval"][1]


def test_credit_matched_one_seed_has_no_value_without_its_extreme_seed():
    """With one seed (the tiny study's shapes) nothing is left once the extreme seed is out: NaN, said quietly (numpy's
    'Mean of empty slice' warning was raised before)."""
    import warnings

    arm, ref = {"steps": [10], "imperfect": [[1, 0]]}, {"steps": [20], "imperfect": [[1, 1]]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = credit_matched.compare(arm, ref, ["A"], __import__("numpy").random.default_rng(0), resamples=20)
    assert math.isnan(out["steps_ratio"]["without_extreme"]) and math.isnan(out["heldout_imperfect"]["without_extreme"])
    assert out["steps_ratio"]["ratio"] == 0.5 and out["heldout_imperfect"]["difference"] == -0.5


def test_credit_matched_interval_resamples_the_starts_first():
    """Two starts whose seeds agree within each start and disagree across them: the two-level bootstrap draws A twice
    (a quarter of the time), B twice, or one of each, so its 95% interval is exactly the two starts' values, by hand:
    steps ratio [0.5, 1.5], held-out difference [-1, +1] (every post of a start's seeds alike, so resampling the posts
    changes nothing). A bootstrap of the 10 seeds alone would be narrower: it reaches an end only when all 10 draws
    come from one start (2 / 2^10 of the time)."""
    rng = __import__("numpy").random.default_rng(0)
    starts = ["A"] * 5 + ["B"] * 5
    arm = {"steps": [150] * 5 + [50] * 5, "imperfect": [[1] * 5] * 5 + [[0] * 5] * 5}
    ref = {"steps": [100] * 10, "imperfect": [[0] * 5] * 5 + [[1] * 5] * 5}
    out = credit_matched.compare(arm, ref, starts, rng, resamples=2000)
    assert out["steps_ratio"]["interval"] == pytest.approx([0.5, 1.5])
    assert out["heldout_imperfect"]["interval"] == pytest.approx([-1.0, 1.0])
    arm["train_kl"], ref["train_kl"] = [0.5] * 5 + [0.3] * 5, [0.4] * 10  # an uncorrected measure: the same draws
    kl = credit_matched.compare(arm, ref, starts, rng, resamples=2000)["uncorrected"]["train_kl"]
    assert kl["difference"] == pytest.approx(0.0) and kl["interval"] == pytest.approx([-0.1, 0.1])


@pytest.mark.slow
def test_credit_matched_runs_every_phase_at_tiny_shapes(forked_stages, tmp_path):
    """Two arms through calibration, the grid, the selection and the confirmation on two starts (04 judges every
    policy), then K = 1: the results name each start's checksum, every confirmed policy's per-post outcomes and each
    per-token arm's comparison with fair_scalar, Holm-adjusted."""
    out = tmp_path / "cm"
    result = credit_matched.main(
        ["--tiny", "--arms", "fair_scalar", "span", "--ladder", "1", "--out", str(out), "--results", ""]
    )
    assert set(result["starts"]) == {"k1", "A", "B"} and len(set(result["starts"].values())) == 3
    conf = result["confirm"]
    assert conf["starts"] == ["A", "B"] and set(conf["versus_fair_scalar"]) == {"span"}
    assert "p_holm" in conf["versus_fair_scalar"]["span"]["steps_ratio"]
    per_post = json.loads((out / "results.json").read_text())["per_post"]
    assert len(per_post["confirm/span/seed102"]["imperfect"]) == 8 and "k1/span/seed101" in per_post
    assert set(result["k1_selection"]) == {"fair_scalar", "span", "poor_scalar"}
    md = credit_matched.markdown(result)  # bench/credit/credit.md's tables: the grid, the confirmation, K = 1
    assert md.count("| SFT start A | | |") == 1 and "| SFT start B | | |" in md and "| SFT start k1 | | |" in md
    assert md.count("| span − fair_scalar held out |") == 2 and "| poor_scalar | " in md


def test_credit_matched_means_per_start_by_hand():
    """The per-start table averages each arm's seeds of one start only: A's seeds (0.2, 0.4) -> 0.300, B's (1, 1)."""
    row = {"heldout_imperfect": [0.2, 0.4, 1, 1], "heldout_mistakes": [1, 2, 5, 6], "heldout_facts": [1] * 4}
    table = {"sft": {}, "starts": ["A", "A", "B", "B"], "span": {**row, "heldout_length": [60, 62, 40, 40]}}
    lines = credit_matched.by_start_markdown(table)
    assert lines[0].startswith("| held-out mean per start | imperfect (A) | imperfect (B) | mistakes (A)")
    assert lines[-1] == "| span | 0.300 | 1.000 | 1.50 | 5.50 | 1.000 | 1.000 | 61 | 40 |"


def test_credit_md_tables_are_the_committed_results():
    """Every line of bench/credit/credit.md's result tables is what `credit_matched.py --report` prints from the committed
    bench/credit/credit_matched_results.json: no number copied by hand."""
    result = json.loads((ROOT / "bench" / "credit_matched_results.json").read_text())
    page = set((ROOT / "bench" / "credit.md").read_text().splitlines())
    missing = [line for line in credit_matched.markdown(result).splitlines() if line and line not in page]
    assert not missing, missing


# bench/credit/credit_learned.py: the tuned arms with learned critics (issue 58, part 1)
import credit_learned  # noqa: E402


@pytest.mark.slow
def test_credit_learned_runs_each_arm_on_its_reward_model_and_judges_from_the_runs_record(
    forked_stages, tmp_path, monkeypatch, tiny_model_dir, tiny_chat_model_dir
):
    """At tiny shapes: the train phase builds the three reward models from --rm-base, then one 03 run per arm with
    its critic and bench/credit/credit.py's tuned lr and beta (the poor-only arm: --labels poor), and records them in
    OUT/runs.json; the eval phase reads that record alone (the reward models stay where they trained, e.g. a lent
    GPU) and pairs every arm with each scalar row, post by post."""
    from tasks.demo import demo_dataset

    out = tmp_path / "cl"
    common.write_jsonl(out / "k1" / "prompts.jsonl", demo_dataset("train", 8))
    common.write_jsonl(out / "k1" / "sft.jsonl", demo_dataset("sft", 16))
    flags = [
        "--model",
        tiny_model_dir,
        "--sft-steps",
        "0",
        "--prompts",
        str(out / "k1" / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        "--trace-samples",
        "0",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--device",
        "cpu",
        "--max-fail-share",
        "1",
    ]  # 2 steps teach the reward model no format: nothing parses
    monkeypatch.setattr(credit_learned, "start", lambda out, pets, args: flags)
    argv = [
        "--rm-base",
        tiny_chat_model_dir,
        "--rm-steps",
        "2",
        "--rm-min-parse-rate",
        "0",
        "--pool",
        "40",
        "--pairs",
        "4",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--eval-posts",
        "8",
        "--out",
        str(out),
        "--results",
        "",
    ]
    assert credit_learned.main([*argv, "--stop-after", "train"]) is None
    made = json.loads((out / "runs.json").read_text())
    selection = json.loads((ROOT / "bench" / "credit_selection.json").read_text())
    for row, (arm, rm, critic) in credit_learned.ARMS.items():
        config = json.loads((Path(made["runs"][f"{row}/101"]) / "config.json").read_text())
        chosen = selection["selection"][selection["best_scalar"] if arm == "best scalar" else arm]
        assert (config["lr"], config["kl_coef"]) == (chosen["lr"], chosen["kl_coef"]), row
        assert config["critic"] == critic[1] and f"/{rm}-" in config["reward_model"], row
        assert config["labels"] == ("poor" if arm == "poor_span" else "spans"), row
    for rm in (out / "rms").iterdir():
        __import__("shutil").rmtree(rm)
    result = credit_learned.main(argv)
    table = result["table"]
    assert set(table) == {"SFT", *credit_learned.ARMS}
    assert set(table["Text2Grad"]["versus"]) == set(credit_learned.SCALARS)
    assert set(table["PRM-PPO"]["versus"]) == {"PPO (BT RM, unit std)"}
    for row in credit_learned.ARMS:
        v = table[row]["versus"]["PPO (BT RM, unit std)"]["mistakes"] if row != "PPO (BT RM, unit std)" else None
        assert v is None or v["interval"][0] <= v["difference"] <= v["interval"][1]
    per_post = json.loads((out / "results.json").read_text())["per_post"]
    assert len(per_post) == 1 + len(credit_learned.ARMS) and all(len(b) == 8 for b in per_post.values())
