"""01_annotate.py: data presets, the program and OpenAI-compatible critics (against a real local HTTP server that
injects faults), durability under kill -9, bad input, and the API key's hygiene."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

import common
from annotation import annotator, generation
from annotation import report as annotation_report
from infra import serving
from annotation.inputs import DEMO_FILES, dataset_rows, to_records
from tasks.demo import demo_critic, demo_dataset
import forkserver
from conftest import ROOT, import_script, write_jsonl_gz

annotate = import_script("01_annotate")
SCRIPT = str(ROOT / "01_annotate.py")


def lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def response_of(body: dict) -> str:
    """The response text inside the critic prompt the server received."""
    user = [m for m in body["messages"] if m["role"] == "user"][0]["content"]
    return user.split("### Response\n", 1)[1].split("\n\n###", 1)[0]


def feedback(response: str, bad: str | None = None) -> str:
    words = response.split()
    return json.dumps(
        {"critique": f"It says {words[0]} well.", "good_spans": [words[0]], "poor_spans": [bad] if bad else [words[-1]]}
    )


def write_jsonl(path, rows) -> str:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# The zero-flag demo path, data presets, bad input
# ---------------------------------------------------------------------------------------------------------------------


def test_demo_writes_the_data_files_and_program_critiques(tmp_path):
    out = tmp_path / "annotations.jsonl"
    summary = annotate.main(["--output", str(out), "--no-build-base", "--limit", "60"])
    for name, (split, n) in DEMO_FILES.items():
        assert common.read_jsonl(tmp_path / "data" / f"{name}.jsonl") == demo_dataset(split, n)
    recs = lines(out)
    expected = demo_dataset("annotate", 60)
    assert [r["id"] for r in recs] == [r["id"] for r in expected] and summary["records"] == 60
    for rec, ex in zip(recs, expected):
        fb = demo_critic(ex["prompt"], ex["response"])
        assert rec["status"] == "ok" and rec["critique"] == fb["critique"] and rec["unmatched_spans"] == []
        assert rec["good_spans"] == fb["good_spans"] and rec["poor_spans"] == fb["poor_spans"]
        assert rec["reference"] == ex["reference"]
    assert annotate.main(["--output", str(out), "--no-build-base", "--limit", "60"])["this_run"]["annotated"] == 0
    assert json.loads((tmp_path / "annotations.summary.json").read_text())["records"] == 60


def test_presets_read_slf5k_kodcode_and_ultrafeedback_files(tmp_path):
    write_jsonl(
        tmp_path / "validation.jsonl",
        [
            {
                "id": "t3_a",
                "subreddit": "pets",
                "title": "My dog",
                "post": "He barks.",
                "feedback": "Too vague.",
                "generated_summary_for_feedback": "A dog barks.",
                "ideal_human_summary": "My dog barks at night.",
            }
        ],
    )
    args = annotate.parse_args(
        ["--task", "summarization", "--dataset", str(tmp_path), "--split", "validation", "--annotator", "openai"]
    )
    [rec] = to_records(dataset_rows(args), args)
    assert rec == {
        "id": "t3_a",
        "prompt": "SUBREDDIT: r/pets\nTITLE: My dog\nPOST: He barks.\nTL;DR:",
        "response": "A dog barks.",
        "reference": "My dog barks at night.",
        "human_feedback": "Too vague.",
    }

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "question_id": "q1",
                    "question": "Add.",
                    "solution": "def f(): pass",
                    "test": "def test_f(): pass",
                    "gpt_difficulty": "easy",
                }
            ]
        ),
        tmp_path / "kod.parquet",
    )
    args = annotate.parse_args(["--task", "code", "--dataset", str(tmp_path / "kod.parquet")])
    assert to_records(dataset_rows(args), args) == [
        {"id": "q1", "prompt": "Add.", "response": "def f(): pass", "test": "def test_f(): pass"}
    ]

    uf = tmp_path / "uf.json"
    uf.write_text(
        json.dumps(
            [
                {"instruction": "Hi?", "completions": [{"response": "Hello."}, {"response": "Hey."}]},
                {"instruction": "Bye?", "completions": [{"response": "Bye."}]},
            ]
        )
    )
    args = annotate.parse_args(["--task", "qa", "--dataset", str(uf), "--annotator", "openai", "--limit", "2"])
    assert to_records(dataset_rows(args), args) == [
        {"id": "train-0-0", "prompt": "Hi?", "response": "Hello."},
        {"id": "train-0-1", "prompt": "Hi?", "response": "Hey."},
    ]
    args = annotate.parse_args(
        [
            "--task",
            "qa",
            "--dataset",
            str(uf),
            "--annotator",
            "openai",
            "--prompt-field",
            "instruction",
            "--response-field",
            "instruction",
            "--split",
            "dev",
        ]
    )
    assert [r["response"] for r in to_records(dataset_rows(args), args)] == ["Hi?", "Bye?"]


def test_a_field_the_task_preset_names_and_the_dataset_lacks_names_the_flag_that_picks_it(tmp_path):
    """Issue 67, item 7: --task qa without --prompt-field said "missing field 'instruction'" alone."""
    data = tmp_path / "uf.jsonl"
    common.write_jsonl(data, [{"question": "Hi?", "answer": "Hello."}])
    args = annotate.parse_args(["--task", "qa", "--dataset", str(data), "--annotator", "openai"])
    with pytest.raises(common.DataError, match=r"uf\.jsonl:1: missing field 'instruction' \(set --prompt-field\)$"):
        to_records(dataset_rows(args), args)
    args = annotate.parse_args(["--task", "summarization", "--dataset", str(data), "--annotator", "openai"])
    with pytest.raises(common.DataError, match=r"uf\.jsonl:1: missing field 'title' \(set --prompt-field\)$"):
        to_records(dataset_rows(args), args)
    args = annotate.parse_args(["--task", "demo", "--dataset", str(data), "--prompt-field", "question"])
    with pytest.raises(common.DataError, match=r"uf\.jsonl:1: missing field 'response' \(set --response-field\)$"):
        to_records(dataset_rows(args), args)


def test_bad_input_names_file_line_and_field(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "solution": "s", "test": "t"}, {"question": "q"}])
    args = annotate.parse_args(["--task", "code", "--dataset", bad])
    with pytest.raises(common.DataError, match=r"bad\.jsonl:2: missing field 'solution'"):
        to_records(dataset_rows(args), args)
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "p", "response": "r"}] * 2)
    args = annotate.parse_args(["--task", "demo", "--dataset", dup])
    with pytest.raises(common.DataError, match=r"dup\.jsonl:2: duplicate id 'a'"):
        to_records(dataset_rows(args), args)

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "prompt": "p", "response": "r"}\n\n{"id": "b", "prompt": \n')
    out = tmp_path / "out" / "annotations.jsonl"
    proc = forkserver.run(
        [sys.executable, SCRIPT, "--dataset", str(broken), "--output", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"error: {broken}:3: not valid JSON (Expecting value)"]
    assert not out.exists()


def run_cli(*argv, cwd=ROOT) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, SCRIPT, *map(str, argv)], capture_output=True, text=True, cwd=cwd)


def test_a_latin1_byte_in_the_dataset_is_one_line_and_writes_nothing(tmp_path):
    """A file saved as Latin-1 (café as the byte 0xe9): exit 2 and one line naming the file, line, byte and column,
    never a UnicodeDecodeError traceback; no output, summary or folder."""
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(
        b'{"id": "a", "prompt": "p", "response": "r"}\n{"id": "b", "prompt": "caf\xe9", "response": "r"}\n'
    )
    out = tmp_path / "out" / "annotations.jsonl"
    proc = run_cli("--dataset", data, "--output", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: {data}:2: not UTF-8 (byte 0xe9 at column 27)"]
    assert not out.parent.exists()


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_limit_below_one_exits_2_and_writes_nothing(tmp_path, limit):
    """--limit 0 annotated the whole demo (0 read as no limit) and --limit -1 all records but the last (a slice
    from the end), both exiting 0: now exit 2 naming the flag, no output or folder."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "p", "response": "r"}] * 1)
    out = tmp_path / "out" / "annotations.jsonl"
    proc = run_cli("--dataset", data, "--output", out, "--limit", limit)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(f"error: --limit {limit}: at least 1 record")
    assert not out.parent.exists()


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_an_empty_dataset_exits_2_and_writes_nothing(tmp_path, content):
    """An empty file (or blank lines only) is no dataset: one line, exit 2, no output, summary or folder (it exited
    0, writing an empty output and a summary of 0 records)."""
    data = tmp_path / "empty.jsonl"
    data.write_bytes(content)
    out = tmp_path / "out" / "annotations.jsonl"
    proc = run_cli("--dataset", data, "--output", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: no records in {data}"]
    assert not out.parent.exists()


# ---------------------------------------------------------------------------------------------------------------------
# The OpenAI-compatible critic against a fault-injecting server
# ---------------------------------------------------------------------------------------------------------------------

SCENARIOS = [
    "ok",
    "fenced",
    "reasoning",
    "r429",
    "r500",
    "slow",
    "invalid_once",
    "invalid_twice",
    "unmatched",
    "r400",
    "exhaust",
]


def fault_server(fake_openai, log, release):
    """A reply function keyed by the scenario word that starts each response; `log` records every attempt; the
    "slow" reply waits for `release` (set it once the client gave up)."""

    def reply(body, n):
        response = response_of(body)
        kind = response.split()[0]
        log[kind].append((time.monotonic(), body))
        attempt = len(log[kind])
        if kind == "r429" and attempt == 1:
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": "0.4"}
        if kind == "r500" and attempt <= 2 or kind == "exhaust":
            return 503 if kind == "exhaust" else 500, {"error": {"message": "boom"}}, {}
        if kind == "r400":
            return 400, {"error": {"message": "context length exceeded"}}, {}
        if kind == "slow" and attempt == 1:
            release.wait()  # past the client's --timeout, however loaded the machine
        if kind == "invalid_twice" or kind == "invalid_once" and attempt == 1:
            return "I think the response is fine, nothing to add {oops"
        if kind == "fenced":
            return f"```json\n{feedback(response)}\n```"
        if kind == "reasoning":
            return f"Reasoning: the first word is right and the last is weak.\n\n{feedback(response)}\nHope it helps!"
        if kind == "unmatched":
            return feedback(response, bad="a phrase that is not there")
        return feedback(response)

    return fake_openai(reply)


def openai_args(url, data, out, *extra):
    return [
        "--task",
        "qa",
        "--dataset",
        data,
        "--output",
        str(out),
        "--annotator",
        "openai",
        "--base-url",
        url,
        "--model",
        "fake-critic",
        "--timeout",
        "5.0",  # a reply that should come in time does on a loaded machine; "slow" waits past any limit
        "--backoff-base",
        "0.01",
        "--max-retries",
        "3",
        "--concurrency",
        "4",
        *extra,
    ]


def test_openai_critic_survives_every_injected_fault(tmp_path, fake_openai, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-faults")
    data = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"id": k, "instruction": f"Say {k}.", "completions": [{"response": f"{k} is the answer here"}]}
            for k in SCENARIOS
        ],
    )
    out, log = tmp_path / "annotations.jsonl", defaultdict(list)
    release = threading.Event()
    with fault_server(fake_openai, log, release) as server:
        summary = annotate.main(openai_args(server.base_url, data, out))
        release.set()
    recs = {r["id"].rsplit("-", 1)[0]: r for r in lines(out)}
    assert sorted(recs) == sorted(SCENARIOS)
    for kind in ("ok", "fenced", "reasoning", "r429", "r500", "invalid_once"):
        rec = recs[kind]
        assert rec["status"] == "ok", (kind, rec)
        assert rec["critique"] == f"It says {kind} well." and rec["good_spans"] == [kind]
        assert rec["poor_spans"] == ["here"] and rec["unmatched_spans"] == []
    assert recs["unmatched"]["poor_spans"] == [] and recs["unmatched"]["unmatched_spans"] == [
        "a phrase that is not there"
    ]
    assert recs["invalid_twice"]["status"] == "failed" and "unparseable" in recs["invalid_twice"]["reason"]
    assert recs["invalid_twice"]["critic_output"].startswith("I think")
    assert recs["r400"]["status"] == "failed" and len(log["r400"]) == 1
    assert recs["r400"]["reason"] == "HTTP 400: context length exceeded"  # the server's own words
    assert recs["exhaust"]["status"] == "failed" and len(log["exhaust"]) == 4  # 1 try + --max-retries 3
    assert recs["exhaust"]["reason"] == "HTTP 503: boom; gave up after 4 attempts"
    # a timeout is not retried: the server may still be generating the request its client abandoned
    assert recs["slow"]["status"] == "failed" and len(log["slow"]) == 1
    assert recs["slow"]["reason"] == "timed out; not retried: the server may still be generating it"
    assert len(log["r500"]) == 3 and len(log["r429"]) == 2
    assert log["r429"][1][0] - log["r429"][0][0] >= 0.4  # Retry-After honoured
    repair = log["invalid_once"][1][1]["messages"]  # the repair request carries the bad reply and the instruction
    assert repair[-2]["role"] == "assistant" and repair[-2]["content"].startswith("I think")
    assert "could not use your reply" in repair[-1]["content"]
    first = log["ok"][0][1]
    assert first["model"] == "fake-critic" and "ok is the answer here" in first["messages"][-1]["content"]
    assert "good_spans" in first["messages"][-1]["content"] and first["messages"][0]["role"] == "system"
    assert summary["failed"] == 4 and summary["unmatched_span_rate"] == round(1 / 14, 4)  # 13 quotes found, 1 not
    assert summary["this_run"]["timed_out"] == 1 and summary["estimated_cost_usd"] is None  # a local server
    assert recs["ok"]["usage"] == {"prompt_tokens": 10, "completion_tokens": 20}
    assert recs["invalid_once"]["usage"] == {"prompt_tokens": 20, "completion_tokens": 40}  # reply + repair
    assert (summary["prompt_tokens"], summary["completion_tokens"]) == (100, 200)  # 10 answered requests
    assert len(server.preflights) == 1 and server.preflights[0]["body"]["model"] == "fake-critic"


def test_a_400_that_every_row_gets_stops_the_run(tmp_path, fake_openai, monkeypatch):
    """A 400 the one-token preflight cannot see (here --max-tokens above what the model allows) that the first rows
    all get, and no row succeeds: the run stops in one line with the server's words, exit 2, instead of writing every
    row as failed. A 400 of one row (a prompt too long) stays that row's failure (the fault test above)."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    data = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"id": f"q{i}", "instruction": "Q?", "completions": [{"response": f"answer {i}"}]} for i in range(20)],
    )
    too_long = {"error": {"message": "max_tokens 100000 exceeds the model's context (2048)"}}
    with fake_openai(lambda body, n: (400, too_long, {})) as server:
        argv = openai_args(server.base_url, data, tmp_path / "a.jsonl", "--concurrency", "1", "--max-tokens", "100000")
        proc = forkserver.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: --base-url {server.base_url}: the first {annotator.FATAL_REPEATS} records all got "
        "HTTP 400: max_tokens 100000 exceeds the model's context (2048)"
    )
    assert len(server.preflights) == 1 and len(lines(tmp_path / "a.jsonl")) == annotator.FATAL_REPEATS


def test_a_critique_without_span_lists_is_repaired_or_failed(tmp_path, fake_openai, monkeypatch):
    """A critic reply with a critique but no good_spans / poor_spans is no annotation: it gets the repair request,
    and a record whose critic never gives span lists is "failed" (never "ok" with no spans, which stage 2 would learn
    as "nothing to quote")."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    data = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"id": k, "instruction": f"Say {k}.", "completions": [{"response": f"{k} is the answer"}]}
            for k in ("once", "always")
        ],
    )
    log = defaultdict(list)

    def reply(body, n):
        kind = response_of(body).split()[0]
        log[kind].append(body)
        if kind == "always" or len(log[kind]) == 1:
            return json.dumps({"critique": f"It says {kind} well."})
        return feedback(response_of(body))

    with fake_openai(reply) as server:
        annotate.main(openai_args(server.base_url, data, tmp_path / "a.jsonl"))
    recs = {r["id"].rsplit("-", 1)[0]: r for r in lines(tmp_path / "a.jsonl")}
    assert recs["once"]["status"] == "ok" and recs["once"]["good_spans"] == ["once"] and len(log["once"]) == 2
    assert "good_spans" in log["once"][1]["messages"][-1]["content"]  # the repair request names what was missing
    assert recs["always"]["status"] == "failed" and "good_spans or poor_spans" in recs["always"]["reason"]
    assert len(log["always"]) == 2


def test_echoing_the_format_or_the_repair_template_is_no_annotation():
    """A small model copies the prompt's templates (SmolLM2-135M did, tests/data): neither is a critique, so neither
    becomes an "ok" record that stage 2 would learn as "nothing wrong"."""
    for echo in (
        annotate.FORMAT,
        annotate.REPAIR.format(error="no JSON object"),
        "Sure! " + annotate.FORMAT.split("```json\n")[1].split("\n```")[0],
    ):
        with pytest.raises(ValueError, match="placeholders"):
            annotate.parse_critic(echo)


def test_backoff_and_retry_after():
    rng = random.Random(0)
    for attempt in range(8):
        d = min(60.0, 1.0 * 2**attempt)
        assert all(d / 2 <= serving.backoff_delay(attempt, None, 1.0, 60.0, rng) <= d for _ in range(50))
    assert 2.0 <= serving.backoff_delay(0, 5.0, 1.0, 2.0, rng) <= 2.2  # the server's Retry-After, cut to the cap
    assert 1.5 <= serving.backoff_delay(0, 1.5, 1.0, 2.0, rng) <= 1.65  # a shorter one as it is
    assert serving.retry_after_s({"retry-after": "2"}) == 2.0
    assert serving.retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert (
        8
        < serving.retry_after_s(
            {"retry-after": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 10))}
        )
        <= 10
    )
    assert serving.retry_after_s({}) is None and serving.retry_after_s({"retry-after": "soon"}) is None


def test_split_spans_moves_only_the_missing_copies():
    good, poor, unmatched = annotate.split_spans("the dog and the cat", ["the", "dog", "fox"], ["the", "the", " "])
    # the second poor "the" finds both occurrences claimed: it takes the good one's (poor wins), so it is not missing
    assert (good, poor, unmatched) == (["the", "dog"], ["the", "the"], ["fox"])
    assert annotate.split_spans("the dog", ["dog"], ["dog", "dog", "cat"]) == (["dog"], ["dog"], ["dog", "cat"])
    assert common.locate_spans("the dog and the cat", good, poor)[2] == []


def test_code_prompt_carries_the_unit_test_results(tmp_path, fake_openai, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # a local server needs no key
    data = write_jsonl(
        tmp_path / "kod.jsonl",
        [
            {
                "question_id": "bad",
                "question": "Add.",
                "solution": "def add(a, b):\n    return a - b\n",
                "test": "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
            }
        ],
    )
    seen = []

    def reply(body, n):
        seen.append(body["messages"][-1]["content"])
        return json.dumps({"critique": "It subtracts.", "good_spans": [], "poor_spans": ["return a - b"]})

    with fake_openai(reply) as server:
        annotate.main(
            [
                "--task",
                "code",
                "--dataset",
                data,
                "--output",
                str(tmp_path / "a.jsonl"),
                "--annotator",
                "openai",
                "--base-url",
                server.base_url,
            ]
        )
    assert "### Unit test results\npassed: no" in seen[0] and "assert -1 == 3" in seen[0]
    [rec] = lines(tmp_path / "a.jsonl")
    assert rec["status"] == "ok" and rec["poor_spans"] == ["return a - b"] and rec["test"].startswith("from")


def test_human_feedback_is_shown_only_when_asked(tmp_path, fake_openai, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-hf")
    data = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {
                "id": "p1",
                "title": "Cat",
                "post": "My cat sleeps all day.",
                "feedback": "It misses the cat's age.",
                "generated_summary_for_feedback": "A cat sleeps.",
                "ideal_human_summary": "My old cat sleeps.",
            }
        ],
    )
    seen = []

    def reply(body, n):
        seen.append(body["messages"][-1]["content"])
        return feedback(response_of(body))

    with fake_openai(reply) as server:
        for i, flag in enumerate([[], ["--use-human-feedback"]]):
            annotate.main(
                [
                    "--task",
                    "summarization",
                    "--dataset",
                    data,
                    "--output",
                    str(tmp_path / f"{i}.jsonl"),
                    "--annotator",
                    "openai",
                    "--base-url",
                    server.base_url,
                    *flag,
                ]
            )
    assert "It misses the cat's age." not in seen[0] and "### Human feedback on this summary" not in seen[0]
    assert "### Human feedback on this summary\nIt misses the cat's age." in seen[1]
    assert "TITLE: Cat" in seen[0]


def test_api_key_never_leaks(tmp_path, fake_openai, monkeypatch, capsys):
    key = "sk-test-" + os.urandom(12).hex()
    monkeypatch.setenv("OPENAI_API_KEY", key)
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "a", "instruction": "Q?", "completions": [{"response": "r400"}]},
            {"id": "b", "instruction": "Q?", "completions": [{"response": "fine"}]},
        ],
    )
    holder = {}

    def echo_auth(body, n):  # a hostile (or buggy) server that echoes the request's Authorization header
        auth = {k.lower(): v for k, v in holder["server"].requests[n - 1]["headers"].items()}["authorization"]
        if response_of(body) == "r400":
            return 400, {"error": {"message": f"bad request from {auth}"}}, {}
        return json.dumps({"critique": f"Nice. {auth}", "good_spans": [], "poor_spans": []})

    with fake_openai(echo_auth) as server:
        holder["server"] = server
        annotate.main(openai_args(server.base_url, data, tmp_path / "a.jsonl"))
        sent = {k.lower(): v for k, v in server.requests[0]["headers"].items()}
        assert sent["authorization"] == f"Bearer {key}"  # the key is used, and it came from the environment
        env = {**os.environ, "OPENAI_API_KEY": key}
        fatal = fake_openai(
            lambda body, n: (401, {"error": {"message": f"invalid key {key}"}}, {}), answer_preflight=False
        )  # a bad key fails the preflight, before any row
        with fatal:
            proc = forkserver.run(
                [sys.executable, SCRIPT, *openai_args(fatal.base_url, data, tmp_path / "b.jsonl")],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
            )
    recs = {r["id"]: r for r in lines(tmp_path / "a.jsonl")}
    assert recs["a-0"]["status"] == "failed" and "[redacted]" in recs["a-0"]["reason"]
    assert proc.returncode == 2 and "HTTP 401: invalid key [redacted]" in proc.stderr
    assert len(fatal.requests) == 1 and not (tmp_path / "b.jsonl").exists()  # the preflight alone
    captured = capsys.readouterr()
    for text in [
        (tmp_path / "a.jsonl").read_text(),
        (tmp_path / "a.summary.json").read_text(),
        proc.stdout,
        proc.stderr,
        captured.out,
        captured.err,
    ]:
        assert key not in text
    assert recs["b-0"]["critique"] == "Nice. Bearer [redacted]"  # even a reply that echoes the key is scrubbed


# ---------------------------------------------------------------------------------------------------------------------
# Durability: kill -9 at a random moment, torn last line, --retry-failed
# ---------------------------------------------------------------------------------------------------------------------


def test_kill_9_then_rerun_yields_every_id_exactly_once(tmp_path, fake_openai, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-kill")
    rows = [
        {"id": f"r{i}", "instruction": "Q?", "completions": [{"response": f"answer number {i}"}]} for i in range(300)
    ]
    data, out = write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "a.jsonl"
    rng = random.Random()

    def reply(body, n):
        time.sleep(rng.uniform(0.002, 0.02))
        return feedback(response_of(body))

    with fake_openai(reply) as server:
        args = openai_args(server.base_url, data, out)
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        while proc.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < 20):
            time.sleep(0.02)  # no deadline: on a loaded machine the first 20 records come later, not never
        time.sleep(rng.uniform(0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        before = out.read_bytes()
        assert 0 < before.count(b"\n") < 300, "the kill should land mid-run"
        with open(out, "ab") as f:  # and a torn last line, as if the kill had hit mid-write
            f.write(b'{"id": "r299-0", "prompt": "Q?", "resp')
        annotate.main(args)
    recs = lines(out)  # every line parses
    assert Counter(r["id"] for r in recs) == Counter(f"r{i}-0" for i in range(300))
    assert all(r["status"] == "ok" for r in recs)
    assert out.read_bytes().startswith(before.rstrip(b"\n").rsplit(b"\n", 1)[0])  # done lines were kept, not redone


def test_retry_failed_redoes_only_the_failed_records(tmp_path, fake_openai, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-retry")
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": k, "instruction": "Q?", "completions": [{"response": k}]} for k in ("good", "flaky")],
    )
    out, broken = tmp_path / "a.jsonl", threading.Event()
    broken.set()

    def reply(body, n):
        response = response_of(body)
        return "no json" if response == "flaky" and broken.is_set() else feedback(response + " x")

    with fake_openai(reply) as server:
        annotate.main(openai_args(server.base_url, data, out))
        assert {r["id"]: r["status"] for r in lines(out)} == {"good-0": "ok", "flaky-0": "failed"}
        broken.clear()
        annotate.main(openai_args(server.base_url, data, out))  # a plain rerun keeps the failure
        assert len(lines(out)) == 2
        annotate.main(openai_args(server.base_url, data, out, "--retry-failed"))
    assert {r["id"]: r["status"] for r in lines(out)} == {"good-0": "ok", "flaky-0": "ok"}


def test_a_rerun_with_another_critic_or_dataset_is_refused_unless_overwrite(tmp_path):
    """--output records what made it (task, critic, model, the dataset's content) in OUTPUT.made_by.json before its
    first record. A rerun with another dataset or critic kept the old annotations in silence ("5 already in ..., 0 to
    annotate") or mixed two runs' records in one file; now it is refused in one line naming what differs, exit 2,
    nothing touched, unless --overwrite starts afresh. The same settings resume as before: the same content at
    another path, or a larger --limit."""
    first, other = demo_dataset("annotate", 5), demo_dataset("annotate", 8)[3:]
    a, b = write_jsonl(tmp_path / "a.jsonl", first), write_jsonl(tmp_path / "b.jsonl", other)
    copy = write_jsonl(tmp_path / "copy.jsonl", first)
    out = tmp_path / "out" / "annotations.jsonl"
    made_by = tmp_path / "out" / "annotations.made_by.json"
    assert annotate.main(["--dataset", a, "--output", str(out), "--limit", "3"])["records"] == 3
    recorded = json.loads(made_by.read_text())
    assert {k: recorded[k] for k in ("task", "annotator", "model", "dataset")} == {
        "task": "demo",
        "annotator": "program",
        "model": None,
        "dataset": a,
    }
    assert recorded["dataset_fingerprint"].startswith("sha256:")
    summary = annotate.main(["--dataset", copy, "--output", str(out)])  # the same content, all 5 now: resumes
    assert summary["this_run"]["annotated"] == 2 and summary["records"] == 5
    assert json.loads((tmp_path / "out" / "annotations.summary.json").read_text())["made_by"]["dataset"] == copy
    before = out.read_bytes()
    with pytest.raises(common.DataError) as err:
        annotate.main(["--dataset", b, "--output", str(out)])
    assert str(err.value).startswith(f"{out} holds 5 records made with other settings: --dataset {copy} (sha256:")
    assert f"not {b} (sha256:" in str(err.value) and "--overwrite starts it afresh" in str(err.value)
    proc = run_cli(
        "--dataset",
        a,
        "--output",
        out,
        "--annotator",
        "openai",
        "--model",
        "critic-2",
        "--base-url",
        "http://127.0.0.1:9/v1",
    )  # refused before any request: nothing listens there
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: {out} holds 5 records made with other settings: --annotator program, not openai; --model (none), "
        "not critic-2. A rerun resumes only the run that made it: --overwrite starts it afresh, or choose another "
        "--output"
    ]
    assert out.read_bytes() == before
    summary = annotate.main(["--dataset", b, "--output", str(out), "--overwrite"])
    assert summary["this_run"]["annotated"] == 5 and [r["id"] for r in lines(out)] == [r["id"] for r in other]
    assert json.loads(made_by.read_text())["dataset"] == b
    assert annotate.main(["--dataset", b, "--output", str(out), "--retry-failed"])["this_run"]["annotated"] == 0


# ---------------------------------------------------------------------------------------------------------------------
# Program critic for code, and responses generated by a policy
# ---------------------------------------------------------------------------------------------------------------------


def test_program_critic_for_code(tmp_path):
    test = "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    data = write_jsonl(
        tmp_path / "kod.jsonl",
        [
            {"question_id": "pass", "question": "Add.", "solution": "def add(a, b):\n    return a + b\n", "test": test},
            {"question_id": "fail", "question": "Add.", "solution": "def add(a, b):\n    return a * b\n", "test": test},
        ],
    )
    annotate.main(["--task", "code", "--dataset", data, "--output", str(tmp_path / "a.jsonl"), "--concurrency", "2"])
    recs = {r["id"]: r for r in lines(tmp_path / "a.jsonl")}
    assert recs["pass"]["critique"].startswith("All 1 unit tests pass") and recs["pass"]["good_spans"] == [
        "return a + b"
    ]
    assert "assert 6 == 5" in recs["fail"]["critique"] and recs["fail"]["poor_spans"] == ["return a * b"]


def test_a_critic_that_raises_on_one_record_fails_that_record_only(tmp_path, monkeypatch):
    # The code critic crashed 01 in 3 of 6 HumanEval runs under load (a SystemError from ast.parse in a thread): one
    # record's exception became the whole run's. Now it is that record's one-line reason, and the run goes on.
    import tasks.code

    real = tasks.code.code_critic

    def flaky(prompt, response, test, timeout_s=10.0):
        if "boom" in response:
            raise SystemError("AST constructor recursion depth mismatch (before=18, after=17)\nsecond line")
        return real(prompt, response, test, timeout_s)

    monkeypatch.setattr(tasks.code, "code_critic", flaky)
    test = "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    data = write_jsonl(
        tmp_path / "kod.jsonl",
        [
            {
                "question_id": f"q{i}",
                "question": "Add.",
                "test": test,
                "solution": f"def add(a, b):\n    return a + b{'  # boom' if i == 1 else ''}\n",
            }
            for i in range(4)
        ],
    )
    annotate.main(["--task", "code", "--dataset", data, "--output", str(tmp_path / "a.jsonl"), "--concurrency", "2"])
    recs = {r["id"]: r for r in lines(tmp_path / "a.jsonl")}
    assert sorted(recs) == ["q0", "q1", "q2", "q3"]  # every record once
    assert recs["q1"]["status"] == "failed" and "\n" not in recs["q1"]["reason"]
    assert "SystemError: AST constructor recursion depth mismatch" in recs["q1"]["reason"]
    assert all(recs[q]["status"] == "ok" and recs[q]["good_spans"] == ["return a + b"] for q in ("q0", "q2", "q3"))


def test_generate_with_a_policy(tmp_path, tiny_model_dir):
    rows = [{k: v for k, v in r.items() if k != "response"} for r in demo_dataset("eval", 3)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    annotate.main(
        [
            "--dataset",
            data,
            "--output",
            str(tmp_path / "a.jsonl"),
            "--generate-with",
            tiny_model_dir,
            "--max-new-tokens",
            "6",
            "--temperature",
            "1.0",
        ]
    )
    recs = lines(tmp_path / "a.jsonl")
    assert [r["id"] for r in recs] == [r["id"] for r in rows] and all(r["status"] == "ok" for r in recs)
    assert all(isinstance(r["response"], str) and r["response"] for r in recs)


def test_program_critic_on_humaneval_and_mbpp_layouts(tmp_path):
    he = [
        {
            "task_id": "HumanEval/0",
            "prompt": 'def double(x):\n    """Twice x."""\n',
            "entry_point": "double",
            "canonical_solution": "    return 2 * x\n",
            "test": "def check(candidate):\n    assert candidate(3) == 6\n",
        },
        {
            "task_id": "HumanEval/1",
            "prompt": "def one():\n",
            "entry_point": "one",
            "canonical_solution": "    return 2\n",
            "test": "def check(candidate):\n    assert candidate() == 1\n",
        },
        {
            "task_id": "HumanEval/2",
            "prompt": "def two():\n",
            "entry_point": "two",
            "canonical_solution": "    return 2\n",
            "test": "import no_such_module_t2g\ndef check(candidate):\n    assert candidate() == 2\n",
        },
    ]
    annotate.main(
        [
            "--task",
            "code",
            "--dataset",
            write_jsonl_gz(tmp_path / "he.jsonl.gz", he),
            "--output",
            str(tmp_path / "a.jsonl"),
        ]
    )
    recs = {r["id"]: r for r in lines(tmp_path / "a.jsonl")}
    assert recs["HumanEval/0"]["status"] == "ok" and recs["HumanEval/0"]["good_spans"] == ["return 2 * x"]
    assert (
        recs["HumanEval/0"]["response"] == he[0]["canonical_solution"]
        and recs["HumanEval/0"]["prompt"] == he[0]["prompt"]
    )
    assert (
        recs["HumanEval/1"]["poor_spans"] == ["return 2"]
        and "`one()` returns 2, expected 1" in recs["HumanEval/1"]["critique"]
    )
    assert recs["HumanEval/2"]["status"] == "failed" and "no_such_module_t2g" in recs["HumanEval/2"]["reason"]

    mbpp = write_jsonl(
        tmp_path / "mbpp.jsonl",
        [
            {
                "task_id": 2,
                "text": "Add one.",
                "code": "def inc(x):\n    return x + 2\n",
                "test_setup_code": "",
                "test_list": ["assert inc(1) == 2", "assert inc(0) == 1"],
            },
            {"task_id": 3, "text": "Add one."},
        ],
    )
    with pytest.raises(common.DataError, match=r"mbpp\.jsonl:2: missing field 'code'"):
        annotate.main(["--task", "code", "--dataset", mbpp, "--output", str(tmp_path / "b.jsonl")])


def _rate_limited(retry_after: str):
    """A 429 as the openai client raises it, with the server's Retry-After header."""
    import openai
    import openai._exceptions as ex

    httpx = getattr(ex, "httpx2", None) or ex.httpx  # whichever HTTP library this openai is built on
    response = httpx.Response(
        429, headers={"retry-after": retry_after}, request=httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    )
    return openai.RateLimitError("slow down", response=response, body=None)


def test_a_servers_retry_after_is_capped():
    """A server's Retry-After of an hour must not stall a worker an hour: the wait is capped at `cap` (+10% jitter);
    a shorter Retry-After is honoured as it is."""
    rng = random.Random(0)
    assert serving.retry_delay(_rate_limited("3600"), 0, 3, rng, cap=60.0) <= 66.0
    assert 0.4 <= serving.retry_delay(_rate_limited("0.4"), 0, 3, rng, cap=60.0) <= 0.44


def test_a_request_that_fails_after_a_capped_retry_after_says_so(fake_openai):
    """The cap is said in the error a request fails with, next to what the server asked for."""
    import asyncio

    with fake_openai(lambda body, n: (429, {"error": {"message": "slow down"}}, {"Retry-After": "3600"})) as server:

        async def ask():
            async with serving.openai_client(server.base_url, 10.0) as client:
                return await serving.send_with_retries(
                    lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]),
                    1,
                    random.Random(0),
                    cap=0.05,
                )

        import openai

        with pytest.raises(openai.RateLimitError) as err:
            asyncio.run(asyncio.wait_for(ask(), 30))  # uncapped, it would sleep an hour: wait_for fails it instead
    assert len(server.requests) == 2
    assert serving.api_error(err.value) == (
        "HTTP 429: slow down; the server's Retry-After (3600 s) was capped at 0.05 s; gave up after 2 attempts"
    )


def test_the_preflight_sends_the_stages_own_parameters(tmp_path, fake_openai):
    """check_server's one request carries what the stage's requests carry: an endpoint that refuses max_tokens (as
    OpenAI's reasoning models do) is not refused by the preflight when the stage sends none (--max-tokens 0), and the
    critic's temperature is the stage's."""

    def reply(body, n):
        if "max_tokens" in body:
            return 400, {"error": {"message": "Unsupported parameter: 'max_tokens'"}}, {}
        return "OK" if serving.PREFLIGHT in body["messages"][-1]["content"] else feedback(response_of(body))

    data = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"id": "a", "instruction": "Say a.", "completions": [{"response": "a is the answer here"}]}],
    )
    with fake_openai(reply, answer_preflight=False) as server:
        annotate.main(
            openai_args(
                server.base_url, data, tmp_path / "out.jsonl", "--max-tokens", "0", "--critic-temperature", "0.7"
            )
        )
    preflight, request = (r["body"] for r in server.requests)
    assert serving.PREFLIGHT in preflight["messages"][0]["content"]
    assert set(preflight) == set(request) and preflight["temperature"] == request["temperature"] == 0.7
    assert lines(tmp_path / "out.jsonl")[0]["status"] == "ok"


# ---------------------------------------------------------------------------------------------------------------------
# A new user's first day (issue 46): no failure stays quiet, a typo'd model path is one line, each default said once
# ---------------------------------------------------------------------------------------------------------------------


def qa_file(path, n: int) -> str:
    return write_jsonl(
        path,
        [
            {"id": f"q{i}", "instruction": f"Say {i}.", "completions": [{"response": f"answer {i} is here"}]}
            for i in range(n)
        ],
    )


def test_a_run_where_every_record_failed_says_why_and_exits_non_zero(tmp_path, fake_openai, monkeypatch):
    """SmolLM2 zero-shot as the critic: 8 of 8 replies do not parse. The run ends with one line saying so, with the
    first failure in the input's order (it named whichever reply came first: flaky under load), and a non-zero exit;
    a rerun with nothing left to do says it again."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    data, out = qa_file(tmp_path / "qa.jsonl", 8), tmp_path / "a.jsonl"

    def reply(body, n):  # q0's reply comes last: "first" is the input's order, not the order replies arrived in
        if "Say 0." in json.dumps(body):
            time.sleep(0.5)
        return "The response is good. It says the answer."

    with fake_openai(reply) as server:
        for _ in range(2):
            proc = forkserver.run(
                [sys.executable, SCRIPT, *openai_args(server.base_url, data, out)],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            assert proc.returncode == 1, proc.stderr[-2000:]
            assert (
                "error: 0 of 8 records annotated: the critic's outputs do not parse; first failure (q0-0): "
                "unparseable critic output after one repair: "
            ) in proc.stderr
    assert len(lines(out)) == 8


def test_a_failure_share_above_the_threshold_is_a_loud_warning(tmp_path, fake_openai, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    data = qa_file(tmp_path / "qa.jsonl", 8)

    def reply(body, n):  # q0 and q1 never parse: 2 of 8 = 25% > FAIL_WARN_SHARE
        response = response_of(body)
        return "no json here" if response.split()[1] in "01" else feedback(response)

    with fake_openai(reply) as server:
        summary = annotate.main(openai_args(server.base_url, data, tmp_path / "a.jsonl"))
    err = capsys.readouterr().err
    assert summary["ok"] == 6 and annotation_report.FAIL_WARN_SHARE < 2 / 8
    assert "warning: 2 of 8 records failed (25%): the critic's outputs do not parse; first failure (q" in err
    with fake_openai(lambda body, n: feedback(response_of(body))) as server:  # no failure: no warning
        annotate.main(openai_args(server.base_url, qa_file(tmp_path / "q2.jsonl", 4), tmp_path / "b.jsonl"))
    assert "warning" not in capsys.readouterr().err


def test_elapsed_counts_the_whole_run_generation_included(tmp_path, monkeypatch):
    def slow_generation(records, args, *rest):  # stands for --generate-with's model load and generation
        time.sleep(0.5)
        for rec in records:
            rec["response"] = " tom has a red dog."

    monkeypatch.setattr(generation, "generate_responses", slow_generation)
    monkeypatch.setattr(generation, "load_generator", lambda args: ("model", "tokenizer"), raising=False)
    summary = annotate.main(
        ["--output", str(tmp_path / "a.jsonl"), "--no-build-base", "--limit", "3", "--generate-with", "tiny/model"]
    )
    assert summary["this_run"]["elapsed_s"] >= 0.5


@pytest.mark.parametrize("model", ["runs/smolm2", "no-such-org/no-such-model"])
def test_a_model_that_cannot_load_fails_before_anything_is_written(tmp_path, model):
    """A typo in a local path (runs/smolm2, next to runs/smollm2) is one line at once, never sent to the hub as an id;
    a hub id that cannot load fails before the demo's data/ or the output's folder is written."""
    (tmp_path / "runs").mkdir()
    proc = forkserver.run(
        [
            sys.executable,
            SCRIPT,
            "--generate-with",
            model,
            "--limit",
            "4",
            "--no-build-base",
            "--output",
            "runs/smol/annotations.jsonl",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(
        f"error: --generate-with {model}: "
        + ("no such directory" if model.startswith("runs/") else "cannot load the model")
    )
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []


def test_help_states_each_default_once():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        annotate.parse_args(["--help"])
    text = " ".join(out.getvalue().split())
    assert "(default: OpenAI)" in text and "(default: OpenAI) (default:" not in text
    assert "(default: None)" not in text and "(default: 1024)" in text
