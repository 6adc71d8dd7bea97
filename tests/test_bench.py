"""bench/: a finished run is reused only when the settings that made it are the ones asked for (bench/run_cache.py);
a folder made otherwise, or whose settings were never recorded, is refused in one line, never mixed into a result."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT

import common

sys.path.insert(0, str(ROOT / "bench"))
import ablations  # noqa: E402
import demo_seeds  # noqa: E402
import real_critic  # noqa: E402
import span_vs_scalar  # noqa: E402


def _metrics(run_dir, n):
    common.write_jsonl(run_dir / "metrics.jsonl", [{"step": i + 1, "exact/mistake_rate": 0.5, "exact/span_reward": 1.0,
                                                    "objective/kl": 0.0, "response/length": 9.0} for i in range(n)])


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
    with pytest.raises(SystemExit, match=rf"^{folder}: made with other settings \(argv\[1\]: 'b' there, 'c' now\);"
                                         r" delete it or pick another --out$"):
        run_cache.check_settings(folder, {"argv": ["a", "c"], "seed": 1})
    with pytest.raises(SystemExit, match=r"\(seed: 1 there, 2 now\)"):
        run_cache.check_settings(folder, {"argv": ["a", "b"], "seed": 2})
    run_cache.settings_path(folder).unlink()
    with pytest.raises(SystemExit, match=rf"^{folder}: holds output whose settings were not recorded; delete it "
                                         r"or pick another --out$"):
        run_cache.check_settings(folder, {"argv": ["a", "b"], "seed": 1})


def test_a_cached_ppo_run_is_reused_only_with_its_own_flags(tmp_path, monkeypatch):
    """bench/span_vs_scalar.py's runs (and bench/ablations.py's, which are the same function): a finished run made by
    other flags, e.g. another critic, is refused; one made by these flags is read, not run again."""
    out, run_dir = tmp_path / "out", tmp_path / "out" / "span_seed1"
    _metrics(run_dir, 3)  # a finished run whose flags nobody recorded
    monkeypatch.setattr(span_vs_scalar, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        span_vs_scalar.ppo_run(out, run_dir, 1, 3, ["--critic", "local", "--reward-model", "smol_rm"])
    import run_cache
    common.write_json(run_cache.settings_path(run_dir),  # as if this bench had made it
                      {"argv": span_vs_scalar.ppo_command(out, run_dir, 1, ["--critic", "program"])})
    with pytest.raises(SystemExit, match="made with other settings"):
        span_vs_scalar.ppo_run(out, run_dir, 1, 3, ["--critic", "local", "--reward-model", "smol_rm"])
    curves = span_vs_scalar.ppo_run(out, run_dir, 1, 3, ["--critic", "program"])
    assert curves["mistakes"] == [0.5] * 3


def test_a_cached_demo_chain_is_reused_only_with_its_own_stages(tmp_path, monkeypatch):
    """bench/demo_seeds.py and bench/real_critic.py: a chain folder that other stages made is refused."""
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
    """bench/real_critic.py --scalar-steps N: a scalar_toN folder that another command made is refused."""
    work = tmp_path / "seed1"
    _metrics(work / "runs/demo/scalar_to5", 5)
    monkeypatch.setattr(real_critic.subprocess, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        real_critic.extend_scalar(work, 1, "runs/demo/smol_rm",
                                  real_critic.parse_args(["--scalar-steps", "5", "--threads", "1"]))


def test_a_given_spans_only_reward_model_must_be_one(tmp_path, monkeypatch):
    """bench/ablations.py --spans-only-reward-model DIR: DIR must be a stage-2 output trained with --rm-format
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
    """bench/gpu_recipe.py (the 8B recipe's measurement, issue 34) on its tiny shapes: stage 2's reward model is stage
    3's critic, both built from a config without weight files, every phase timed, the responses forced to full
    length, the first iteration's KL 0, and a decode step against its bound."""
    import json
    import subprocess
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "bench/gpu_recipe.py", "--tiny", "--device", "cpu", "--no-compile",
                           "--out", str(out), "--phases", "stage2,stage3,decode"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((out / "base").glob("*.safetensors"))  # random weights, built on the spot
    stage2, stage3, decode = (json.loads((out / f"{n}.json").read_text()) for n in ("stage2", "stage3", "decode"))
    assert stage2["steps"] == 3 and all(s > 0 for s in stage2["s_per_step"])
    assert json.loads((out / "rm" / "reward_model.json").read_text())["train"]["steps"] == 3
    assert set(stage3["last_iteration"]) == {"rollout", "critic", "score_rollouts", "ppo_update"}
    assert all(len(v) == 2 and all(x["s"] > 0 for x in v) for v in stage3["all_iterations"].values())
    rows = [json.loads(x) for x in (out / "stage3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["response/length"] for r in rows] == [8.0, 8.0] and rows[0]["objective/kl"] == 0.0
    assert decode["bound_ms_weights"] > 0 and all(decode[h]["step_ms"] > 0 for h in ("eager", "eager-no-lora",
                                                                                       "static"))


def test_real_critic_chains_keep_their_stages_and_pass_the_policy_flags(tmp_path):
    """bench/real_critic.py: without the new flags a seed's stages are the ones its chains were made with (so their
    folders stay valid); --policy-model and the GPU flags reach 03 (and its --scalar-steps continuation) and 04."""
    smol, rm = tmp_path / "smollm2", str(tmp_path / "rm")
    stages = real_critic.chain_stages(real_critic.parse_args(["--reward-model", rm]), smol, rm)
    assert stages == [("01_annotate.py", []), ("02_train_reward.py", []),
                      ("03_train_policy.py", ["--critic", "local", "--reward-model", rm, "--steps", "60"]),
                      ("04_evaluate.py", ["--reward-model", rm, "--monitor-reward-model",
                                          "toy=runs/demo/reward_model"])]
    args = real_critic.parse_args(["--reward-model", rm, "--policy-model", str(smol), "--no-toy", "--dtype", "bf16",
                                   "--compile-generation", "--gen-batch-size", "200", "--device", "cuda",
                                   "--sft-steps", "50", "--eval-limit", "20"])
    ppo = ["--model", str(smol), "--sft-lr", "0.0001", "--lr", "0.0002", "--sft-steps", "50", "--device", "cuda",
           "--dtype", "bf16", "--compile-generation"]
    assert real_critic.chain_stages(args, smol, rm) == [
        ("01_annotate.py", []),
        ("03_train_policy.py", ["--critic", "local", "--reward-model", rm, "--steps", "60", *ppo]),
        ("04_evaluate.py", ["--reward-model", rm, "--device", "cuda", "--limit", "20", "--dtype", "bf16",
                            "--batch-size", "200", "--rm-batch-size", "200"])]
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
    """bench/ablations.py's shared_start without the training: it records its out dir, leaves the SFT start's marker
    and returns the 03 flags every row shares."""
    def fake_start(o, critic, reward_model, steps, ppo_args):
        built.append(o)
        (o / "sft").mkdir(parents=True, exist_ok=True)
        (o / "sft" / "config.json").write_text("{}")
        return ["--critic", critic, "--reward-model", reward_model, "--steps", str(steps), *ppo_args]
    return fake_start


def test_ablations_run_one_seed_side_by_side_after_the_start(tmp_path, monkeypatch):
    """bench/ablations.py --start-only builds the shared start (and reward models) and runs nothing; --only S runs seed
    S's runs of the chosen rows and writes no table, and refuses before the shared start exists: side-by-side --only
    calls would race to build it."""
    out, built, ran = tmp_path / "out", [], []
    monkeypatch.setattr(ablations, "shared_start", _fake_shared_start(built))
    monkeypatch.setattr(ablations, "spans_only_reward_model", lambda o, given, rm: given)
    monkeypatch.setattr(ablations, "ppo_run", lambda o, run_dir, seed, steps, flags: ran.append((run_dir.name, flags)))
    argv = ["--critic", "local", "--reward-model", "rm", "--spans-only-reward-model", "so", "--steps", "4",
            "--out", str(out)]
    with pytest.raises(SystemExit, match=rf"^{out}: no shared start yet; build it once with --start-only"):
        ablations.main([*argv, "--only", "2"])
    assert built == [] and ran == []
    assert ablations.main([*argv, "--start-only"]) == 0
    assert built == [out] and ran == []
    assert ablations.main([*argv, "--only", "2", "--rows", "span", "spans-only RM"]) == 0
    assert ran == [("span_seed2", ["--critic", "local", "--reward-model", "rm", "--steps", "4"]),
                   ("spans_only_RM_seed2", ["--reward-model", "so", "--critic", "local", "--steps", "4"])]
    assert not (out / "results.json").exists()


def test_ablations_jobs_run_each_row_and_seed_in_its_own_process_then_the_table(tmp_path, monkeypatch):
    """bench/ablations.py --jobs N builds the shared start once, runs every (row, seed) as its own `--rows R --only S`
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
    argv = ["--critic", "local", "--reward-model", "rm", "--spans-only-reward-model", "so", "--steps", "12",
            "--out", str(out), "--seeds", "2", "--rows", "span", "scalar", "--jobs", "3", "--", "--lr", "1e-5"]
    assert ablations.main(argv) == 0
    assert built == [out] * 5  # the start, then each child's (run_cache makes those no-ops for real)
    assert sorted((c[c.index("--rows") + 1], c[c.index("--only") + 1]) for c in launched) == \
        [("scalar", "1"), ("scalar", "2"), ("span", "1"), ("span", "2")]
    flags = ["--critic", "local", "--reward-model", "rm", "--steps", "12", "--lr", "1e-5"]
    children = sorted(ran[:4])
    assert children == [("scalar_seed1", ["--reward-mode", "scalar", *flags]),
                        ("scalar_seed2", ["--reward-mode", "scalar", *flags]),
                        ("span_seed1", flags), ("span_seed2", flags)]
    assert sorted(ran[4:]) == children  # the table reads the finished runs
    assert json.loads((out / "results.json").read_text())["rows"].keys() == {"span", "scalar"}

    (out / "results.json").unlink()
    monkeypatch.setattr(ablations, "launch", lambda cmd, log, env: fake_launch(cmd, log, env, ("scalar", "2")))
    with pytest.raises(SystemExit, match=r"^1 of 4 runs failed: scalar seed 2 \(its log: .*scalar_seed2\.log\)"):
        ablations.main(argv)
    assert not (out / "results.json").exists()
