"""Behaviour pins for the speed work (issue 17): what an optimisation must leave exactly as it was.

- a fixed-seed PPO run (full fine-tuning and LoRA) logs the same losses, KL, rewards and parameters as the code before
  the optimisations did (tests/speed_pins.json, recorded from that code);
- the reward model's greedy critiques are the ones plain `model.generate` gives, token for token.
No timings here: those live in bench/ (vs_trl.py, annotate_throughput.py, the demo's time/* metrics).

To re-record the PPO pins after a deliberate change of behaviour: T2G_RECORD_PINS=1 python -m pytest tests/test_speed_pins.py
"""
import json
import os
from pathlib import Path

import pytest
import torch

import common
from conftest import import_script

ppo = import_script("03_train_policy")
PINS = Path(__file__).with_name("speed_pins.json")


def _ppo_run(tmp_path, model_dir, lora_r):
    common.write_jsonl(tmp_path / "prompts.jsonl", common.demo_dataset("train", 16))
    run = tmp_path / f"run{lora_r}"
    args = ppo.parse_args([
        "--model", model_dir, "--prompts", str(tmp_path / "prompts.jsonl"), "--critic", "program", "--output-dir",
        str(run), "--scalar-baseline-dir", "", "--steps", "2", "--batch-size", "8", "--num-minibatches", "2",
        "--ppo-epochs", "2", "--max-new-tokens", "8", "--sft-steps", "0", "--device", "cpu", "--lora-r", str(lora_r),
        "--lora-alpha", "8", "--lr", "1e-3", "--kl-coef", "0.1", "--seed", "3", "--temperature", "1.0",
        "--dump-rollouts", str(run / "dump")])
    ppo.train(args)
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in common.read_jsonl(run / "metrics.jsonl")]
    checksums = [torch.load(run / "dump" / f"step{s}_rank0.pt", weights_only=False)["param_checksum"] for s in (1, 2)]
    return {"metrics": rows, "param_checksums": checksums}


@pytest.mark.parametrize("lora_r", [0, 4])
def test_ppo_run_matches_the_recorded_one(tmp_path, tiny_model_dir, lora_r):
    got = _ppo_run(tmp_path, tiny_model_dir, lora_r)
    pins = json.loads(PINS.read_text()) if PINS.is_file() else {}
    if os.environ.get("T2G_RECORD_PINS"):
        pins[f"ppo_lora{lora_r}"] = got
        PINS.write_text(json.dumps(pins, indent=1) + "\n")
        pytest.skip("recorded")
    want = pins[f"ppo_lora{lora_r}"]
    assert [set(r) for r in got["metrics"]] == [set(r) for r in want["metrics"]]
    for g, w in zip(got["metrics"], want["metrics"]):
        for key in w:  # a float-rounding difference (another CPU's kernels) is ~1e-7; a behaviour change is not
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (g["step"], key)
    assert got["param_checksums"] == pytest.approx(want["param_checksums"], rel=1e-6)
