"""bench/locality/locality.py: where one update lands."""

import json
from pathlib import Path

import pytest
from bench_helpers import bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)


bench_path("locality")
import demo_start  # noqa: E402


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

    monkeypatch.setattr(demo_start, "run", fake_run)
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
