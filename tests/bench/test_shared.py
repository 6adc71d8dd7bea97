"""bench/shared: a finished run is reused only when the settings that made it are the ones asked for
(bench/shared/run_cache.py); a folder made otherwise, or whose settings were never recorded, is refused in one line,
never mixed into a result. The demo's shared start and runs (demo_start), the keyed runs and evaluations
(cached_runs), the data budget (budget), the four-stage chains (chains); and every bench script imports from its own
folder and bench/shared alone."""

import os
import subprocess
import sys

import pytest
from bench_helpers import _metrics, _never, bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)
from conftest import ROOT

import common

bench_path()
import budget  # noqa: E402
import cached_runs  # noqa: E402
import chains  # noqa: E402
import demo_start  # noqa: E402
import run_cache  # noqa: E402


def test_every_bench_module_imports_first():
    """Each bench module imported first (the others not yet loaded), with sys.path[0] its own folder as `python
    bench/<study>/<script>.py` has it, and nothing of another study on the path: an import cycle (paper_baselines ->
    real_critic -> paper_baselines) stops `python bench/credit/credit.py` while the suite, which had imported
    real_critic first, passes; an import of another study's module fails here. credit_arms.py is a plug-in: 03 loads
    it with the repository on its path."""
    code = (
        "import importlib, pathlib, sys\nroot, base = pathlib.Path(sys.argv[1]), sys.path[1:]\n"
        "files = sorted(root.glob('bench/*/*.py'))\nnames = {p.stem for p in files}\n"
        "for p in files:\n    for n in names:\n        sys.modules.pop(n, None)\n"
        "    sys.path[:] = [str(p.parent), *[str(root)] * (p.stem in sys.argv[2:]), *base]\n"
        "    importlib.import_module(p.stem)\nprint(len(files))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), "credit_arms"],
        cwd=ROOT / "bench",
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == len(list((ROOT / "bench").glob("*/*.py"))) >= 30


def test_settings_are_recorded_then_matched(tmp_path):
    """check_settings records a folder's settings next to it; the same settings pass, other ones exit naming the first
    difference; a folder holding output without recorded settings exits too. An empty folder takes any settings."""

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
    monkeypatch.setattr(demo_start, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        demo_start.ppo_run(out, run_dir, 1, 3, ["--critic", "local", "--reward-model", "smol_rm"])

    made = demo_start.ppo_command(out, run_dir, 1, ["--critic", "program"])
    common.write_json(
        run_cache.settings_path(run_dir),  # as if this bench had made it
        {"argv": made, "inputs": run_cache.inputs_content(made)},
    )
    with pytest.raises(SystemExit, match="made with other settings"):
        demo_start.ppo_run(out, run_dir, 1, 3, ["--critic", "local", "--reward-model", "smol_rm"])
    curves = demo_start.ppo_run(out, run_dir, 1, 3, ["--critic", "program"])
    assert curves["mistakes"] == [0.5] * 3


def test_a_cached_demo_chain_is_reused_only_with_its_own_stages(tmp_path, monkeypatch):
    """bench/demo_seeds/chains.py and bench/real_critic/real_critic.py: a chain folder that other stages made is refused."""
    work = tmp_path / "seed1_threads1"
    common.write_json(work / "runs/demo/results.json", {"policies": {}})
    common.write_json(work / "runs/demo/reward_model/eval.json", {})
    monkeypatch.setattr(chains.subprocess, "run", _never)
    with pytest.raises(SystemExit, match="settings were not recorded"):
        chains.run_chain(work, 1, 1)

    common.write_json(run_cache.settings_path(work), chains.chain_settings(1, 1, chains.STAGES))
    assert chains.run_chain(work, 1, 1)["policies"] == {}
    smol = [("03_train_policy.py", ["--critic", "local", "--reward-model", "runs/demo/smol_rm"])]
    with pytest.raises(SystemExit, match="made with other settings"):
        chains.run_chain(work, 1, 1, smol)
    with pytest.raises(SystemExit, match="made with other settings"):
        chains.run_chain(work, 2, 1)


def test_held_out_rows_pair_with_their_posts_by_id_however_the_cache_holds_them(tmp_path, tiny_model_dir):
    """04's generations cache is append-only: a resumed run, or two runs on one folder, can hold rows out of the
    records' order or twice (issue 55's confirm phase: 1,488 rows for 1,000 posts). sequence_kl paired rows with
    prompts by position, so such a cache gave another policy's KL or crashed; now every bench reads the cache by id,
    and a post without a row is one line naming the file."""
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
        name: cached_runs.sequence_kl(str(tmp_path / "policy"), tiny_model_dir, records, tmp_path / f"{name}.jsonl", 12)
        for name in ("ordered", "resumed")
    }
    assert kl["ordered"] != 0.0 and kl["resumed"] == pytest.approx(kl["ordered"], rel=1e-5)
    assert cached_runs.post_mistakes(tmp_path / "resumed.jsonl", records) == cached_runs.post_mistakes(
        tmp_path / "ordered.jsonl", records
    )
    common.write_jsonl(tmp_path / "short.jsonl", rows[:4])
    with pytest.raises(SystemExit, match=r"short\.jsonl: no generation for 1 of 5 posts"):
        cached_runs.sequence_kl(str(tmp_path / "policy"), tiny_model_dir, records, tmp_path / "short.jsonl", 12)


def test_a_ppo_run_killed_before_its_first_checkpoint_starts_again(tmp_path):
    """cached_runs.ppo always passed --resume; a run killed before its first checkpoint (every 25 iterations)
    left metrics.jsonl and no checkpoint.pt, which 03 refuses to resume: the bench stopped there on every rerun.
    Such a run starts again (--overwrite); one with a checkpoint resumes; a finished one is not run."""

    flags = ["--critic", "program"]
    run_dir, argv = cached_runs.ppo(tmp_path, "Text2Grad", 1, 4, flags)
    assert argv[-1] == "--resume" and not run_dir.exists()  # nothing there: 03 starts it fresh
    _metrics(run_dir, 2)  # killed at iteration 2, before any checkpoint
    assert cached_runs.ppo(tmp_path, "Text2Grad", 1, 4, flags)[1][-1] == "--overwrite"
    (run_dir / "checkpoint.pt").write_bytes(b"")
    assert cached_runs.ppo(tmp_path, "Text2Grad", 1, 4, flags)[1][-1] == "--resume"
    _metrics(run_dir, 4)
    (run_dir / "policy").mkdir()
    assert cached_runs.ppo(tmp_path, "Text2Grad", 1, 4, flags)[1] is None


def test_a_reward_model_killed_before_its_eval_without_a_checkpoint_is_trained_again(tmp_path):
    """The same for 02: a reward model saved (reward_model.json) but killed before eval.json, with no checkpoint to
    resume from (--rm-steps below 02's save interval), was passed --resume, which 02 refuses. It is trained again; one with a
    checkpoint resumes; a finished one is not run."""

    rm, argv = budget.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])
    assert argv[-1] == "--resume" and not rm.exists()
    common.write_json(rm / "reward_model.json", {})
    assert budget.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])[1][-1] == "--overwrite"
    (rm / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    assert budget.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])[1][-1] == "--resume"
    common.write_json(rm / "eval.json", {})
    assert budget.reward_model(tmp_path, "span_rm", ["--max-steps", "2"])[1] is None


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

    monkeypatch.setattr(demo_start, "run", fake_run)
    demo_start.ppo_run(out, run_dir, 1, 3, flags)
    monkeypatch.setattr(demo_start, "run", _never)
    assert demo_start.ppo_run(out, run_dir, 1, 3, flags)["mistakes"] == [0.5] * 3  # the same model: reused
    (rm / "model.safetensors").write_bytes(b"weights v2")  # retrained in place
    with pytest.raises(SystemExit, match=rf"made with other settings \(inputs\.{rm}: '\w+' there, '\w+' now\)"):
        demo_start.ppo_run(out, run_dir, 1, 3, flags)


def test_a_run_cached_before_the_move_keeps_its_name(tmp_path):
    """Issue 78 moved bench/credit_arms.py to bench/credit/credit_arms.py: a run whose --critic names one of its arms
    is keyed by the old path, so a run cached before the move (credit_k4's, credit's) is found under its name, as
    keyed named it then (the hash of its settings' JSON, sha256, first 8 hex digits); other settings are untouched."""
    import hashlib
    import json

    flags = ["--critic", "python:bench/credit/credit_arms.py:span_per_pet", "--lr", "1e-3", 101, 150, {}]
    before = json.dumps([flags[0], "python:bench/credit_arms.py:span_per_pet", *flags[2:]], sort_keys=True)
    assert cached_runs.keyed(tmp_path, "span_seed101", flags).name == (
        f"span_seed101-{hashlib.sha256(before.encode()).hexdigest()[:8]}"
    )
    assert cached_runs.keyed(tmp_path, "r", ["--lr", "1e-3"]) != cached_runs.keyed(tmp_path, "r", ["--lr", "2e-3"])
