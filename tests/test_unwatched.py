"""Issue 67: a run nobody watched hides nothing. Every count a stage-3 run reports covers the whole run, resumed
segments included (metrics.jsonl), and so do its failure limits; 04's curves mark the iterations the critic did not
judge; --resume checks the prompts' content; a plug-in critic runs under --critic-timeout, Ctrl-C inside it is one
line, and a plug-in error keeps the iterations done in a checkpoint."""

import json
import math
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import common
import critics
from tasks.demo import demo_dataset
from conftest import ROOT, import_script

ppo = import_script("03_train_policy")

# A plug-in that fails (raises) on the iterations k % 3 != 0, k its batch calls (the preflight's batch of two and
# the one-record retries of a batch that raised are not counted: the runs' batches are 4), until T2G_FIXED is set: the trial's case. It quotes the
# first word of each response as poor, so that a judged iteration has a signal.
FLAKY = """
import os
CALLS = [0]

def critic(records, responses):
    if len(responses) > 2:
        CALLS[0] += 1
    if not os.environ.get("T2G_FIXED") and CALLS[0] % 3 and CALLS[0]:
        raise RuntimeError(f"flaky on call {CALLS[0]}")
    items = [{"good_spans": [], "poor_spans": y.split()[:1]} for y in responses]
    if os.environ.get("T2G_SHORT_AT") == str(CALLS[0]) and len(responses) > 2:
        return items[:-1]  # one item short: a plug-in error, not a failed record
    return items

def never(records, responses):
    return [{"error": "no answer"} for _ in responses]

def sometimes(records, responses):
    return [{"good_spans": [], "poor_spans": y.split()[:1]} for y in responses]
"""

# A plug-in that hangs from its second batch call on (the first iteration is judged), after touching HUNG (its path
# in the T2G_HUNG environment variable), so that a test knows when the call is under way.
HANG = """
import os, time
CALLS = [0]

def critic(records, responses):
    if len(responses) > 2:
        CALLS[0] += 1
        if CALLS[0] >= 2:
            open(os.environ["T2G_HUNG"], "w").close()
            while True:
                try:
                    time.sleep(3600)
                except Exception:  # a plug-in that swallows everything: the limit still stops it
                    pass
    return [{"good_spans": [], "poor_spans": y.split()[:1]} for y in responses]
"""


def _argv(tmp_path, plugin: str, out: str, *extra) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.is_file():
        common.write_jsonl(prompts, demo_dataset("train", 16))
    return [
        "--model",
        str(tmp_path / "tiny"),
        "--prompts",
        str(prompts),
        "--critic",
        plugin,
        "--output-dir",
        str(tmp_path / out),
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "6",
        "--sft-steps",
        "0",
        "--device",
        "cpu",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        *extra,
    ]


@pytest.fixture
def run(tmp_path, tiny_model_dir):
    """train(NAME, *flags): stage 3 in this process with the tiny model and a plug-in of FLAKY (its file NAME.py)."""
    (tmp_path / "tiny").symlink_to(tiny_model_dir)

    def train(name, out, *extra, function="critic"):
        path = tmp_path / f"{name}.py"
        if not path.is_file():
            path.write_text(FLAKY)
        return ppo.train(ppo.parse_args(_argv(tmp_path, f"python:{path}:{function}", out, *extra)))

    return train


def _rows(path) -> list[dict]:
    return common.read_jsonl(path / "metrics.jsonl")


# ----------------------------------------------------------------------------------------------------------------------
# Item 1: the counts and the failure limits cover the whole run, resumed segments included
# ----------------------------------------------------------------------------------------------------------------------


def test_failures_are_counted_over_the_whole_run_resumes_included(tmp_path, run, monkeypatch, capsys):
    """The trial: a plug-in that fails on iterations k % 3 != 0, run for 9 iterations (exit 2: 24 of 36 critiques
    failed), then fixed and resumed to 11. The resumed segment judged all its 8 critiques; the run did not: 24 of its
    44 failed, over --max-fail-share, and the resumed run said "0 of 8 critiques failed in this run", exit 0."""
    monkeypatch.delenv("T2G_FIXED", raising=False)
    with pytest.raises(common.DataError, match=r"^stage 3 finished, but 24 of 36 critiques failed \(67%, over"):
        run("flaky", "run", "--steps", "9", "--save-every", "3")
    assert [r["critic/parse_fail_rate"] for r in _rows(tmp_path / "run")] == [1.0, 1.0, 0.0] * 3
    capsys.readouterr()
    monkeypatch.setenv("T2G_FIXED", "1")
    with pytest.raises(common.DataError) as e:
        run("flaky", "run", "--steps", "11", "--save-every", "3", "--resume")
    line = str(e.value)
    assert line.startswith("stage 3 finished, but 24 of 44 critiques failed (55%, over --max-fail-share 0.5)"), line
    assert "0 of 8 in iterations 10-11, since the resume" in line and "\n" not in line
    out = capsys.readouterr().out
    assert "24 of 44 critiques failed in this run (55%; 0 of 8 in iterations 10-11, since the resume)" in out
    assert "0 of 8 critiques failed in this run" not in out
    assert [r["critic/parse_fail_rate"] for r in _rows(tmp_path / "run")][9:] == [0.0, 0.0]
    assert (tmp_path / "run" / "policy" / "adapter_config.json").is_file()  # saved, and said how it was trained


def test_the_failure_limits_count_iterations_in_a_row_across_a_resume(tmp_path, run):
    """--max-fail-iterations 3: two failed iterations before a resume and one after are three in a row (the resumed
    segment alone ran two more iterations on delta = 0 before it stopped)."""
    with pytest.raises(common.DataError, match=r"^stage 3 finished, but 8 of 8 critiques failed"):
        run("broken", "run", "--steps", "2", function="never")
    with pytest.raises(common.DataError, match=r"^stage 3 stopped at iteration 3: most critiques failed .* 3 iter"):
        run("broken", "run", "--steps", "6", "--resume", function="never")
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 3
    assert len(_rows(tmp_path / "run")) == 3


def test_curves_mark_the_iterations_the_critic_did_not_judge(tmp_path, monkeypatch):
    """04's curves drew the critic's mistake rate as 0.0 on the iterations where no critique parsed. They draw no value
    there (the raw line and its moving average) and mark them; results.json's "training" counts the whole run's
    critiques (metrics.jsonl, with config.json's batch size), and the report says so under the curves."""
    import matplotlib.axes

    from evaluation import report

    drawn = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda self, *a, **k: drawn.append((a, k)) or real_plot(self, *a, **k)
    )
    fail = {2: 1.0, 3: 1.0, 5: 0.25}
    rows = [
        {
            "step": i,
            "objective/span_reward": -0.5,
            "critic/flagged_rate": 0.5 * (fail.get(i, 0.0) < 1),
            "critic/parse_fail_rate": fail.get(i, 0.0),
            "objective/kl": 0.1,
        }
        for i in range(1, 7)
    ]
    assert report.plot_curves({"t2g": rows}) is not None
    lines = [(list(a[0]), list(a[1])) for a, k in drawn if len(a) >= 2 and k.get("label") != "critic did not judge"]
    critic_lines = [(x, y) for x, y in lines if any(v == 0.5 for v in y)]  # the mistake rate's raw line
    assert critic_lines and all(math.isnan(y[x.index(s)]) for x, y in critic_lines for s in (2, 3) if s in x)
    assert all(v != 0.0 for x, y in lines for v in y if not math.isnan(v) and y[0] == 0.5)
    marks = [list(a[0]) for a, k in drawn if k.get("label") == "critic did not judge"]
    assert marks and all(m == [2, 3] for m in marks)
    kl = [y for x, y in lines if set(y) == {0.1}]
    assert kl and all(len(y) == 6 for y in kl)  # the KL and entropy are the policy's: drawn everywhere

    path = tmp_path / "t2g" / "metrics.jsonl"
    common.write_jsonl(path, rows)
    common.write_json(tmp_path / "t2g" / "config.json", {"batch_size": 4})
    training = report.training_counts(report.read_curves({"t2g": str(path)}), {"t2g": str(path)})
    want = {"iterations": 6, "critiques": 24, "failed": 9, "unjudged": [2, 3], "temperature": None}  # (no T in config)
    assert training == {"t2g": want}
    results = {
        "task": "demo",
        "data": "x.jsonl",
        "n_prompts": 1,
        "created": "now",
        "reward_model": "rm",
        "generation": {"temperature": 0.0, "max_new_tokens": 32},
        "policies": {},
        "training": training,
    }
    page = report.render_report(results, {}, [], "AAAA", [], "demo")
    assert "t2g: 9 of 24 critiques failed over its 6 iterations" in page
    assert "did not judge iterations 2, 3" in page


# ----------------------------------------------------------------------------------------------------------------------
# Item 2: --resume checks the prompts' content
# ----------------------------------------------------------------------------------------------------------------------


def test_resume_refuses_prompts_whose_content_changed(tmp_path, run):
    """The same --prompts path, cut to half its records, was accepted silently: the resumed run drew other prompts.
    It is one line naming the file, before anything is written; the same records rewritten are the same prompts."""
    prompts = tmp_path / "prompts.jsonl"
    run("plain", "run", "--steps", "1", "--save-every", "1", function="sometimes")
    before = (tmp_path / "run" / "config.json").read_text()
    records = common.read_jsonl(prompts)
    common.write_jsonl(prompts, records[:8])
    with pytest.raises(common.DataError) as e:
        run("plain", "run", "--steps", "2", "--resume", function="sometimes")
    assert str(e.value).startswith(f"--resume: --prompts {prompts}: 8 prompts now, 16 when this run began"), e.value
    assert "\n" not in str(e.value)
    assert (tmp_path / "run" / "config.json").read_text() == before and len(_rows(tmp_path / "run")) == 1
    prompts.write_text("".join(json.dumps(r, indent=None, separators=(", ", ": ")) + "\n" for r in records))
    run("plain", "run", "--steps", "2", "--resume", function="sometimes")  # the same records: the same prompts
    assert len(_rows(tmp_path / "run")) == 2


# ----------------------------------------------------------------------------------------------------------------------
# Item 3: a plug-in runs under --critic-timeout; Ctrl-C inside it is one line
# ----------------------------------------------------------------------------------------------------------------------


def test_a_plugin_call_past_its_time_limit_is_a_failed_critique():
    """A plug-in call that does not return within its limit gives a failed critique per response (not a wait
    forever), even one that swallows every Exception, and even when its batch raised first and its one-record retries
    hang (the limit is the call's, retries included); the SIGALRM handler and timer are restored; the preflight
    call is limited too; off the main thread (01 calls from several) no limit is set."""

    def hang(records, texts):
        while True:
            try:
                time.sleep(3600)
            except Exception:  # noqa: BLE001
                pass

    def raise_then_hang(records, texts):
        if len(records) > 1:
            raise RuntimeError("no batches")
        hang(records, texts)

    mine = lambda *_: None  # noqa: E731
    old = signal.signal(signal.SIGALRM, mine)
    try:
        for fn in (hang, raise_then_hang):
            out = critics.call(fn, "m:f", [{}] * 3, ["a", "b", "c"], timeout=0.3)
            assert len(out) == 3 and all(critics.critique_failed(fb) for fb in out)
            assert all("m:f did not return within --critic-timeout 0.3 s" in fb["critic_error"] for fb in out)
            assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with pytest.raises(common.DataError, match=r"^--critic m:f did not return on the first record within "):
            critics.preflight(hang, "m:f", {}, "a", "--critic", timeout=0.3)
        assert signal.getsignal(signal.SIGALRM) is mine
        quick = lambda recs, texts: [{"good_spans": [], "poor_spans": []} for _ in texts]  # noqa: E731
        assert critics.call(quick, "m:f", [{}], ["a"], timeout=5)[0]["critique"] == ""
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is mine
        got = []
        worker = threading.Thread(target=lambda: got.append(critics.call(quick, "m:f", [{}], ["a"], timeout=5)))
        worker.start()
        worker.join()
        assert got and got[0][0]["critique"] == ""
    finally:
        signal.signal(signal.SIGALRM, old)


def test_a_hung_plugin_is_stopped_by_its_limit_and_the_failure_limits(tmp_path, tiny_model_dir):
    """The trial's hung plug-in waited forever. With --critic-timeout 2 each hung call is a failed iteration, and
    --max-fail-iterations 3 of them in a row stop the run: exit 2, one line, the checkpoint saved."""
    (tmp_path / "tiny").symlink_to(tiny_model_dir)
    (tmp_path / "hang.py").write_text(HANG)
    argv = _argv(tmp_path, f"python:{tmp_path / 'hang.py'}:critic", "run", "--steps", "10", "--critic-timeout", "2")
    proc = subprocess.run(
        [sys.executable, "03_train_policy.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "T2G_HUNG": str(tmp_path / "hung")},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage 3 stopped at iteration 4: most critiques failed"), last
    assert "did not return within --critic-timeout 2 s" in last and "--resume" in last
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 4
    assert [r["critic/parse_fail_rate"] for r in _rows(tmp_path / "run")] == [0.0, 1.0, 1.0, 1.0]


def test_ctrl_c_inside_a_plugin_call_prints_one_line_and_nothing_else(tmp_path, tiny_model_dir):
    """Ctrl-C while a plug-in hangs (pressed again and again, as one does at a process that seems stuck): the one
    "interrupted ... continue with ..." line, exit 130, and nothing after it (a second Ctrl-C in the interpreter's
    teardown printed a KeyboardInterrupt traceback, or killed it with no exit code of its own)."""
    (tmp_path / "tiny").symlink_to(tiny_model_dir)
    (tmp_path / "hang.py").write_text(HANG)
    hung = tmp_path / "hung"
    argv = _argv(tmp_path, f"python:{tmp_path / 'hang.py'}:critic", "run", "--steps", "10", "--save-every", "1")
    proc = subprocess.Popen(
        [sys.executable, "03_train_policy.py", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "T2G_HUNG": str(hung)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal delivers it
    )
    while not hung.exists() and proc.poll() is None:  # the plug-in's call has begun, or the run ended without it
        time.sleep(0.1)
    assert hung.exists()
    while proc.poll() is None:  # Ctrl-C, again and again, until it has gone
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    err = proc.communicate()[1]
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    tail = err.rstrip("\n").rsplit("\n", 1)[-1]
    assert tail.startswith("interrupted after iteration 1 of 10; last checkpoint: iteration 1 ("), tail
    assert tail.endswith(" --resume")


# ----------------------------------------------------------------------------------------------------------------------
# Item 4: a plug-in error keeps the iterations done
# ----------------------------------------------------------------------------------------------------------------------


def test_a_plugin_error_saves_the_iterations_done_and_resume_continues_exactly(tmp_path, run, monkeypatch):
    """A plug-in one item short on its 4th call (a plug-in error: exit 2) lost iterations 1-3: no checkpoint, so
    --resume was refused and only --overwrite ran. The checkpoint now holds iteration 3, as it stood when iteration 4
    began (its random state too), the line says so, and --resume gives the run an uninterrupted one gives."""
    monkeypatch.setenv("T2G_FIXED", "1")
    run("straight", "straight", "--steps", "5", "--save-every", "100")
    monkeypatch.setenv("T2G_SHORT_AT", "4")
    with pytest.raises(common.DataError) as e:
        run("short", "run", "--steps", "5", "--save-every", "100")
    line = str(e.value)
    assert line.startswith(f"{tmp_path / 'short.py'}:critic: returned 3 items for 4 responses on its call 4"), line
    assert line.endswith("; checkpoint.pt holds iteration 3: fix the critic, then continue with --resume"), line
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 3
    monkeypatch.delenv("T2G_SHORT_AT")
    run("short", "run", "--steps", "5", "--save-every", "100", "--resume")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(_rows(tmp_path / "run")) == strip(_rows(tmp_path / "straight"))
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["trainable"] for d in ("straight", "run"))
    assert all(torch.equal(a[k], b[k]) for k in a)
