"""bench/gpu_recipe/gpu_recipe.py: the 8B recipe on one GPU, its path run on a CPU at tiny shapes."""

import json
import subprocess
import sys

import pytest
from bench_helpers import bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)
from conftest import ROOT


bench_path("gpu_recipe")


@pytest.mark.slow  # 48 s of a worker (2026-12-03): the recipe end to end
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
