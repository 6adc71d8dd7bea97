"""--report-to (issue 79, infra/tracking.py): the real TensorBoard, W&B (offline) and Trackio (local) packages, each
read back with its own reader. Stage 3 logs every metrics.jsonl row under its keys at its iteration, and a --resume
continues the same run; stage 2 hands the list to its Trainer."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import browser
import forkserver
import pytest
from conftest import ROOT
from tasks.demo import demo_critic, demo_dataset

import common
from infra import tracking


def test_report_to_takes_transformers_values_and_names_a_bad_one():
    assert tracking.parse("none") == [] and tracking.parse("") == []
    assert tracking.parse("tensorboard, wandb,trackio") == ["tensorboard", "wandb", "trackio"]
    for bad in ("tensorbord", "none,wandb", "mlflow"):
        with pytest.raises(common.DataError, match=f"^--report-to {bad}: takes none, or a comma list of"):
            tracking.parse(bad)


def stage3(tmp_path, model, *flags):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio")}
    argv = [sys.executable, str(ROOT / "03_train_policy.py"), "--model", model, "--critic", "program"]
    argv += ["--prompts", str(tmp_path / "prompts.jsonl"), "--output-dir", str(tmp_path / "run")]
    argv += ["--scalar-baseline-dir", "", "--batch-size", "4", "--num-minibatches", "2", "--ppo-epochs", "1"]
    argv += ["--max-new-tokens", "6", "--sft-steps", "0", "--device", "cpu", "--lora-r", "4", "--lora-alpha", "8"]
    argv += ["--save-every", "1", "--report-to", "tensorboard,wandb,trackio", *flags]
    proc = forkserver.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_model_dir):
    """A stage-3 run of 2 iterations, then --resume to 3, reported to all three trackers: its folder."""
    tmp_path = tmp_path_factory.mktemp("tracked")
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    stage3(tmp_path, tiny_model_dir, "--steps", "2")
    stage3(tmp_path, tiny_model_dir, "--steps", "3", "--resume")  # (--report-to may change on a resume: a watch)
    return tmp_path


@pytest.mark.slow  # two stage-3 runs and three trackers' imports (~1 minute of a worker)
def test_stage3_logs_every_row_to_each_tracker_and_a_resume_continues_the_same_run(tracked):
    """2 iterations, then --resume to 3: each tracker holds iterations 1-3 once, each value the metrics.jsonl row's,
    in one run (TensorBoard's scalars, Trackio's local database, W&B's offline run files under the same run id)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp_path = tracked
    rows = common.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    keys = ("objective/kl", "objective/span_reward", "policy/approx_kl", "critic/flagged_rate")
    want = {k: [(r["step"], r[k]) for r in rows] for k in keys}
    assert [r["step"] for r in rows] == [1, 2, 3]

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert events.Tags()["tensors"] == ["config/text_summary"]  # the flags, as text
    for k in keys:
        assert [(e.step, pytest.approx(e.value, rel=1e-6, abs=1e-7)) for e in events.Scalars(k)] == want[k], k

    state = json.loads((tmp_path / "run" / "tracking.json").read_text())
    read = (  # Trackio's own reader, in a process of its own: TRACKIO_DIR is read when trackio is imported
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; p, n = sys.argv[1:]; "
        "print(json.dumps([S.get_runs(p), S.get_logs(p, n)], default=str))"
    )
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    proc = forkserver.run([sys.executable, "-c", read, tracking.PROJECT, state["name"]], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs, logs = json.loads(proc.stdout.splitlines()[-1])
    assert runs == [state["name"]]  # one run, resumed, not a second
    for k in keys:
        assert [(x["step"], pytest.approx(x[k], rel=1e-9)) for x in logs] == want[k], k

    offline = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(d.name.endswith(state["wandb_id"]) for d in offline)  # the same run, twice


@pytest.mark.slow  # the stage-3 run above, then 04 on 8 posts
def test_stage4_logs_its_results_to_the_stage3_run_its_policy_came_from(tracked, tmp_path, tiny_model_dir):
    """04 --report-to: the policy of the tracked stage-3 run gets its metrics as eval/METRIC at the run's last
    iteration (3), and the table, in the same run (Trackio: still one run; W&B: a third folder of the same id); the
    SFT start, of no stage-3 run, is in the table only; the training curves stay whole."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shutil.copytree(tracked, tmp_path / "t")  # (the module's run stays as the tests above read it)
    run = tmp_path / "t" / "run"
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 8))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "t/trackio")}
    argv = [sys.executable, str(ROOT / "04_evaluate.py"), "--data", str(tmp_path / "eval.jsonl"), "--device", "cpu"]
    argv += ["--policy", f"sft={tiny_model_dir}", "--policy", f"text2grad={run / 'policy'}", "--reward-model", "none"]
    argv += ["--output-dir", str(tmp_path / "eval"), "--report-to", "tensorboard,wandb,trackio"]
    proc = forkserver.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    want = results["policies"]["text2grad"]["metrics"]["demo/mistake_rate"]["value"]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/demo/mistake_rate")] == [(3, want)]
    assert [e.step for e in events.Scalars("critic/flagged_rate")] == [1, 2, 3]  # the curves: not purged
    assert "eval/results/text_summary" in events.Tags()["tensors"]
    (text,) = events.Tensors("eval/results/text_summary")  # a markdown table: a row per metric
    lines = text.tensor_proto.string_val[0].decode().splitlines()
    assert lines[:2] == ["| metric | sft (n=8) | text2grad (n=8) |", "| --- | --- | --- |"]
    assert any(line.startswith("| demo/mistake_rate | ") for line in lines)
    assert not any(t.startswith("eval/") for t in events.Tags()["scalars"] if "sft" in t)  # sft: the table only

    state = json.loads((run / "tracking.json").read_text())
    read = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; p, n = sys.argv[1:]; "
        "print(json.dumps([S.get_runs(p), S.get_logs(p, n)], default=str))"
    )
    proc = forkserver.run([sys.executable, "-c", read, tracking.PROJECT, state["name"]], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs, logs = json.loads(proc.stdout.splitlines()[-1])
    assert runs == [state["name"]]
    assert [(x["step"], x["eval/demo/mistake_rate"]) for x in logs if "eval/demo/mistake_rate" in x] == [(3, want)]
    assert any("eval/results" in x for x in logs)
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 3 and all(d.name.endswith(state["wandb_id"]) for d in offline)
    (table,) = (offline[-1] / "files" / "media" / "table" / "eval").glob("results_3_*.table.json")  # W&B's own file
    assert json.loads(table.read_text())["columns"] == ["metric", "sft (n=8)", "text2grad (n=8)"]
    assert b"eval/demo/mistake_rate" in next(offline[-1].glob("*.wandb")).read_bytes()  # its history (binary)

    # no policy of a stage-3 run: a run of 04's own in its --output-dir, each policy's metrics under its name
    argv = [*argv[:6], "--policy", f"sft={tiny_model_dir}", "--reward-model", "none"]
    argv += ["--output-dir", str(tmp_path / "o")]
    proc = forkserver.run([*argv, "--report-to", "tensorbord"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --report-to tensorbord:")
    proc = forkserver.run([*argv, "--report-to", "tensorboard"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "o" / "tensorboard"))
    events.Reload()
    sft = json.loads((tmp_path / "o" / "results.json").read_text())["policies"]["sft"]["metrics"]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/sft/bleu")] == [(0, sft["bleu"]["value"])]


@pytest.mark.slow  # the stage-3 run above, TensorBoard's server and Chromium
@pytest.mark.skipif(browser.CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")
def test_tensorboard_shows_a_stage3_curve_in_a_browser(tracked):
    """TensorBoard's own server on 127.0.0.1 over the run above, its time-series page in headless Chromium: the card
    of critic/flagged_rate is drawn (its title and its chart; screenshot: tensorboard.png beside the run)."""
    from conftest import free_port

    port = free_port()
    tb = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tracked / "run" / "tensorboard")]
    server = subprocess.Popen([*tb, "--host", "127.0.0.1", "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        while server.poll() is None:  # up when it answers (however long that takes), or it exited
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/")
                break
            except OSError:
                time.sleep(0.5)
        assert server.poll() is None, server.stderr.read()[-2000:]
        drawn = (  # its scalar card, title and line chart, once the page has drawn them (polled: at most 2 minutes)
            "new Promise(ok => { let n = 0; const t = setInterval(() => { const seen = [...document.querySelectorAll("
            "'scalar-card')].some(c => c.textContent.includes('critic/flagged_rate') && c.querySelector('line-chart'));"
            " if (seen || ++n > 1200) { clearInterval(t); ok(seen); } }, 100); })"
        )
        shot = tracked / "tensorboard.png"
        values, errors, _ = browser.inspect_page(
            f"http://127.0.0.1:{port}/?smoothing=0#timeseries", {"drawn": drawn}, str(shot)
        )
        assert values["drawn"] is True, errors
        assert shot.stat().st_size > 10_000
    finally:
        server.terminate()
        server.wait()


@pytest.mark.slow  # a short stage-2 run
def test_stage2_hands_report_to_to_its_trainer(tmp_path, tiny_model_dir):
    """02 --report-to tensorboard: the Trainer's own callback writes the training loss (transformers' convention:
    OUTPUT_DIR/checkpoints/tensorboard, kept and cleared with the Trainer's checkpoints); an unknown tracker is one
    line before anything loads."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = tmp_path / "ann.jsonl"
    common.write_jsonl(
        data,
        [{**ex, **demo_critic(ex["prompt"], ex["response"]), "status": "ok"} for ex in demo_dataset("annotate", 20)],
    )
    argv = [sys.executable, str(ROOT / "02_train_reward.py"), "--model", tiny_model_dir, "--data", str(data)]
    argv += ["--output-dir", str(tmp_path / "rm"), "--max-steps", "4", "--batch-size", "2", "--eval-limit", "0"]
    argv += ["--logging-steps", "1", "--device", "cpu", "--lora-r", "4", "--lora-alpha", "8"]
    proc = forkserver.run([*argv, "--report-to", "tensorbord"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --report-to tensorbord:")
    proc = forkserver.run([*argv, "--report-to", "tensorboard"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "rm" / "checkpoints" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
