"""bench/paper_baselines/paper_baselines.py: the paper's baselines on one bench."""

import json
import sys
from pathlib import Path

import forkserver
import pytest
from bench_helpers import _metrics, bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)
from conftest import ROOT

import common

bench_path("paper_baselines")


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


@pytest.mark.slow
def test_paper_baselines_rm_base_builds_every_reward_model_from_it_end_to_end(tmp_path, tiny_chat_model_dir):
    """`bench/paper_baselines/paper_baselines.py --rm-base DIR` at tiny shapes, end to end: the span, Bradley-Terry and PRM reward
    models all start from DIR with one recipe (the same adapter, lr, steps, answers per step); the reflection row that
    reads the span reward model's critique runs beside the oracle one; the JSON carries every row per seed, the reward
    models' quality and Text2Grad against the best baseline with its interval."""

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
