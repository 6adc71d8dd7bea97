"""bench/real_critic/real_critic.py: Text2Grad with a pretrained critic; its chains keep their stages and the caller's
PYTHONPATH, and its continued scalar runs are keyed."""

import os

import pytest
from bench_helpers import _metrics, _never, bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)
from conftest import ROOT


bench_path("real_critic")
import chains  # noqa: E402
import real_critic  # noqa: E402


def test_a_continued_scalar_run_is_keyed_too(tmp_path, monkeypatch):
    """bench/real_critic/real_critic.py --scalar-steps N: a scalar_toN folder that another command made is refused."""
    work = tmp_path / "seed1"
    _metrics(work / "runs/demo/scalar_to5", 5)
    monkeypatch.setattr(real_critic.subprocess, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        real_critic.extend_scalar(
            work, 1, "runs/demo/smol_rm", real_critic.parse_args(["--scalar-steps", "5", "--threads", "1"])
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

    seen = []
    monkeypatch.setattr(chains.subprocess, "run", lambda cmd, env, **k: seen.append(env["PYTHONPATH"]))
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    work = tmp_path / "seed1"
    with pytest.raises(FileNotFoundError):  # the stub runs nothing, so there is no results.json to read
        chains.run_chain(work, 1, 1, [("01_annotate.py", [])])
    (tmp_path / "seed2/runs/demo/scalar").mkdir(parents=True)  # what the continuation copies
    real_critic.extend_scalar(tmp_path / "seed2", 1, "rm", real_critic.parse_args(["--scalar-steps", "5"]))
    assert seen == [f"{ROOT}{os.pathsep}/opt/site"] * 2
