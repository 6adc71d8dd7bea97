"""Stages 1, 3 and 4 against a real OpenAI-compatible server running a real model: `transformers serve` with
SmolLM2-135M-Instruct (conftest.smollm2_server), through the official openai client, as a user runs them. What only a
real server shows: its own error texts and model-name rule, how it tokenizes a raw prompt, what a small model really
writes. The fake server of conftest stays for the faults no real server makes on demand (429, 500, timeouts).

Generation budgets are small (SmolLM2 on one thread writes ~15 tokens/s): what is tested is the plumbing, not the
critiques' quality."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import common
from critics import learned
from infra import models
import forkserver
from conftest import ROOT, bos_adding_copy, import_script, start_server, stop_server
from tasks.demo import demo_critic, demo_dataset

annotate, ppo, ev = import_script("01_annotate"), import_script("03_train_policy"), import_script("04_evaluate")


def cli(script, *args, env=None):
    return forkserver.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def one_error_line(proc) -> str:
    """The stage's stderr is one line, `error: ...`, and it exited 2."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def dead_url() -> str:
    from conftest import free_port

    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there


def test_the_smollm2_export_is_readable_by_a_server(smollm2_dir):
    """tools/smollm2.py's folder is an ordinary model folder: every file readable as the umask allows (safetensors
    writes its weights 0600, which a server run as another user cannot read)."""
    modes = {f.name: f.stat().st_mode & 0o777 for f in Path(smollm2_dir).iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~common._UMASK}, modes


# ----------------------------------------------------------------------------------------------------------------------
# Stage 1
# ----------------------------------------------------------------------------------------------------------------------


def test_01_annotates_through_a_real_server_resumes_and_reports_the_true_parse_rate(smollm2_server, tmp_path):
    """Two demo rows critiqued by SmolLM2 (48 tokens per reply): once with --limit 1, then the rest on a rerun. Every
    row comes back once, and the summary counts a row as ok only when it is a real annotation. SmolLM2 answers
    demo-annotate-2's repair request by quoting the repair template {"critique": "...", ...}: that row was written as
    ok, critique "...", no spans."""
    data = tmp_path / "posts.jsonl"
    common.write_jsonl(data, demo_dataset("annotate", 4)[2:])
    out = tmp_path / "a.jsonl"
    argv = [
        "--task",
        "demo",
        "--dataset",
        data,
        "--annotator",
        "openai",
        "--base-url",
        smollm2_server["base_url"],
        "--model",
        smollm2_server["model"],
        "--max-tokens",
        "48",
        "--concurrency",
        "1",
        "--output",
        out,
    ]
    first = annotate.main(list(map(str, argv + ["--limit", "1"])))
    summary = annotate.main(list(map(str, argv)))
    recs = common.read_jsonl(out)
    assert sorted(r["id"] for r in recs) == ["demo-annotate-2", "demo-annotate-3"]
    assert first["this_run"]["annotated"] == 1 and summary["this_run"]["annotated"] == 1  # the rerun did the rest
    ok = [r for r in recs if r["status"] == "ok"]
    assert summary["ok"] == len(ok) and summary["failed"] == len(recs) - len(ok)
    for r in ok:  # a real annotation: a critique of its own, every kept span a quote of the response
        assert len(re.findall(r"[A-Za-z]{2,}", r["critique"])) >= 3 and not r["critique"].startswith("<"), r
        assert all(common.find_span(r["response"], s) for s in r["good_spans"] + r["poor_spans"])
    for r in recs:
        assert r["usage"]["completion_tokens"] <= 2 * 48  # the reply, and at most one repair
        if r["status"] == "failed":
            assert r["critic_output"] and "unparseable" in r["reason"]
            with pytest.raises(ValueError):
                annotate.parse_critic(r["critic_output"])
    assert summary["estimated_cost_usd"] is None  # a local server has no gpt-4o price


@pytest.mark.parametrize("case", ["wrong-model", "dead-port"])
def test_01_a_wrong_endpoint_stops_before_the_first_row_in_one_line(smollm2_server, tmp_path, case):
    """01's default --model gpt-4o against a server pinned to another model: the server's own words, once, exit 2,
    no record written (it used to write every row as failed, "HTTP 400: Error code: 400", and exit 0)."""
    common.write_jsonl(tmp_path / "posts.jsonl", demo_dataset("annotate", 3))
    url = smollm2_server["base_url"] if case == "wrong-model" else dead_url()
    proc = cli(
        "01_annotate.py",
        "--task",
        "demo",
        "--dataset",
        tmp_path / "posts.jsonl",
        "--annotator",
        "openai",
        "--base-url",
        url,
        "--max-retries",
        "1",
        "--output",
        tmp_path / "a.jsonl",
    )
    line = one_error_line(proc)
    if case == "wrong-model":
        assert f"Server is pinned to '{smollm2_server['model']}'; requested 'gpt-4o'" in line and "400" in line
    else:
        assert url in line and "connect" in line.lower()
    assert not (tmp_path / "a.jsonl").exists() or not (tmp_path / "a.jsonl").read_text().strip()


# ----------------------------------------------------------------------------------------------------------------------
# Stage 3
# ----------------------------------------------------------------------------------------------------------------------


def ppo_argv(tmp_path, model, *extra):
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    return [
        "--model",
        model,
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--task",
        "qa",
        "--output-dir",
        str(tmp_path / "run"),
        "--scalar-baseline-dir",
        "",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--num-minibatches",
        "1",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--sft-steps",
        "0",
        "--device",
        "cpu",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--log-every",
        "1",
        "--max-fail-share",
        "1",
        *extra,
    ]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_03_two_iterations_with_a_served_critic(smollm2_server, tiny_model_dir, tmp_path, api):
    """SmolLM2 as stage 3's critic over either API. It writes no span JSON in 12 tokens: every critique is unparsed,
    delta = 0, counted, and samples.jsonl keeps what the server wrote (it kept "critique": null and nothing else)."""
    from openai import OpenAI

    ppo.main(
        ppo_argv(
            tmp_path,
            tiny_model_dir,
            "--critic",
            "openai",
            "--critic-base-url",
            smollm2_server["base_url"],
            "--critic-model",
            smollm2_server["model"],
            "--critic-api",
            api,
            "--critic-max-new-tokens",
            "12",
        )
    )
    rows = common.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    samples = common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and len(samples) == 4
    unparsed = [s for s in samples if s["critique"] is None]
    assert sum(r["critic/parse_fail_rate"] for r in rows) * 2 == len(unparsed)
    assert all(r["objective/span_reward"] == 0.0 for r in rows) if len(unparsed) == 4 else True
    client = OpenAI(base_url=smollm2_server["base_url"], api_key="EMPTY")
    for s in unparsed:  # the server's own text, verbatim: ask it again (greedy) and compare
        assert s["critic_error"] and s["critic_output"].strip(), s
        if api == "chat":
            again = (
                client.chat.completions.create(
                    model=smollm2_server["model"],
                    temperature=0.0,
                    max_tokens=12,
                    messages=[{"role": "user", "content": common.rm_user_message(s["prompt"], s["response"])}],
                )
                .choices[0]
                .message.content
            )
        else:
            again = (
                client.completions.create(
                    model=smollm2_server["model"],
                    temperature=0.0,
                    max_tokens=12,
                    prompt=common.build_rm_prompt(None, s["prompt"], s["response"]),
                )
                .choices[0]
                .text
            )
        assert s["critic_output"] == again


@pytest.mark.parametrize("case", ["wrong-model", "dead-port", "completions-wrong-model"])
def test_03_a_wrong_endpoint_stops_before_any_training_in_one_line(smollm2_server, tiny_model_dir, tmp_path, case):
    """One cheap request before the SFT warm start and the policy: the server's own words in one line, exit 2,
    nothing written (it was a traceback, after the warm start). The command line once; in-process (DataError, which
    main turns into that line) for the rest."""
    url = dead_url() if case == "dead-port" else smollm2_server["base_url"]
    argv = ppo_argv(
        tmp_path,
        tiny_model_dir,
        "--critic",
        "openai",
        "--critic-base-url",
        url,
        "--critic-model",
        "gpt-4o",
        "--sft-data",
        str(tmp_path / "prompts.jsonl"),
        "--sft-field",
        "prompt",
        "--sft-steps",
        "5",
        *(["--critic-api", "completions"] if case.startswith("completions") else []),
    )
    if case == "wrong-model":
        line = one_error_line(cli("03_train_policy.py", *argv))
    else:
        with pytest.raises(common.DataError) as err:
            ppo.main(argv)
        line = f"error: {err.value}"
    if case == "dead-port":
        assert url in line and "connect" in line.lower()
    else:
        assert f"Server is pinned to '{smollm2_server['model']}'; requested 'gpt-4o'" in line and "400" in line
    assert "--critic-base-url" in line and "\n" not in line and not (tmp_path / "run").exists()


def test_03_without_a_key_or_an_endpoint_stops_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(common.DataError, match="OPENAI_API_KEY is not set"):
        ppo.main(ppo_argv(tmp_path, tiny_model_dir, "--critic", "openai"))
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------------
# Stage 4
# ----------------------------------------------------------------------------------------------------------------------


def eval_argv(tmp_path, tiny_model_dir, tiny_chat_model_dir, server, model, *extra):
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 2))
    return [
        "--data",
        str(tmp_path / "eval.jsonl"),
        "--policy",
        f"a={tiny_model_dir}",
        "--policy",
        f"b={tiny_chat_model_dir}",
        "--reward-model",
        "none",
        "--max-new-tokens",
        "8",
        "--bootstrap",
        "10",
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "out"),
        "--judge-base-url",
        server["base_url"],
        "--judge-model",
        model,
        *extra,
    ]


def test_04_judges_through_a_real_server(smollm2_server, tiny_model_dir, tiny_chat_model_dir, tmp_path):
    """SmolLM2 as the pairwise judge, 16 tokens a verdict: every pair is judged once, valid or not."""
    results = ev.main(
        eval_argv(
            tmp_path,
            tiny_model_dir,
            tiny_chat_model_dir,
            smollm2_server,
            smollm2_server["model"],
            "--judge-max-tokens",
            "16",
        )
    )
    pair = results["judge"]["pairs"]["b_vs_a"]
    assert pair["n"] + pair["invalid"] == 2
    rows = common.read_jsonl(tmp_path / "out" / "eval" / "judge.b_vs_a.jsonl")
    assert len(rows) == 2 and all(r["reply"].strip() for r in rows)


def test_04_a_wrong_judge_stops_before_any_generation_in_one_line(
    smollm2_server, tiny_model_dir, tiny_chat_model_dir, tmp_path
):
    with pytest.raises(common.DataError) as err:
        ev.main(eval_argv(tmp_path, tiny_model_dir, tiny_chat_model_dir, smollm2_server, "gpt-4o"))
    line = str(err.value)
    assert "--judge-base-url" in line and "Server is pinned to" in line and "\n" not in line
    assert not list((tmp_path / "out").glob("eval/*.generations.jsonl"))


# ----------------------------------------------------------------------------------------------------------------------
# A served reward model is the local one
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_reward_model(tmp_path_factory, tiny_chat_model_dir):
    """(folder, base_url): a LoRA reward model (every projection, lm_head and the tied embed_tokens, trainable norms)
    trained by 02 on the tiny chat model whose tokenizer adds its BOS itself, as Llama's do; written by 02 --merge as
    a plain model folder and served by its own `transformers serve`. 120 steps: it then writes one short critique
    and a span JSON that quotes the response, so its output depends on its input (a few steps only loop)."""
    rm = import_script("02_train_reward")
    tmp = tmp_path_factory.mktemp("served_rm")
    base, _ = bos_adding_copy(tiny_chat_model_dir, tmp / "base")
    recs = []
    for ex in demo_dataset("annotate", 200):
        fb = demo_critic(ex["prompt"], ex["response"])
        recs.append(
            {
                **ex,
                "critique": "It is checked.",
                "good_spans": fb["good_spans"][:1],
                "poor_spans": fb["poor_spans"][:1],
                "status": "ok",
            }
        )
    common.write_jsonl(tmp / "ann.jsonl", recs)
    rm.main(
        rm.parse_args(
            [
                "--model",
                base,
                "--data",
                str(tmp / "ann.jsonl"),
                "--output-dir",
                str(tmp / "rm"),
                "--max-steps",
                "120",
                "--batch-size",
                "8",
                "--eval-limit",
                "0",
                "--device",
                "cpu",
                "--lora-r",
                "32",
                "--lora-alpha",
                "64",
                "--lora-targets",
                "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head,embed_tokens",
                "--modules-to-save",
                "norm",
                "--loraplus-ratio",
                "16",
                "--lr",
                "5e-4",
                "--max-new-tokens",
                "40",
                "--merge",
                str(tmp / "merged"),
            ]
        )
    )
    proc, base_url = start_server(str(tmp / "merged"), tmp / "server.log")
    try:
        yield str(tmp / "merged"), base_url
    finally:
        stop_server(proc)


@pytest.mark.slow  # ~60 s on 2 busy cores, most of it training the reward model
def test_a_served_reward_model_critiques_as_the_local_one_token_for_token(served_reward_model):
    """03 --critic openai --critic-api completions --reward-model DIR, at temperature 0, against the merged folder
    served by transformers serve, writes what --critic local --reward-model DIR writes, token for token: the raw
    critiques, the parsed feedback and delta on the rollout's tokens. That is the served path sending exactly what
    stage 2 trained on: the prompt, its cut, one BOS (the server adds it; the text leaves it out)."""
    rm_dir, url = served_reward_model
    recs = demo_dataset("eval", 16)
    prompts = [r["prompt"] for r in recs]
    local_args = ppo.parse_args(["--critic", "local", "--reward-model", rm_dir, "--device", "cpu"])
    served_args = ppo.parse_args(
        [
            "--critic",
            "openai",
            "--critic-api",
            "completions",
            "--critic-base-url",
            url,
            "--critic-model",
            rm_dir,
            "--reward-model",
            rm_dir,
            "--device",
            "cpu",
        ]
    )
    model, tok = models.load_model(rm_dir)
    texts, offsets = zip(
        *[common.decode_with_offsets(tok, tok(r["response"], add_special_tokens=False)["input_ids"]) for r in recs]
    )  # the rollouts, as 03 decodes them
    budget, cut = local_args.critic_max_new_tokens, local_args.critic_max_prompt_tokens
    assert (budget, cut) == (served_args.critic_max_new_tokens, served_args.critic_max_prompt_tokens) == (40, 216)
    local_raw = learned.rm_critique(model, tok, prompts, list(texts), budget, max_prompt_tokens=cut)
    served_raw = learned.rm_critique_served(
        prompts, list(texts), url, rm_dir, budget, api="completions", tokenizer=tok, max_prompt_tokens=cut
    )
    assert served_raw == local_raw
    local, served = (ppo.make_critic(a)(recs, list(texts)) for a in (local_args, served_args))
    assert served == local and not any(map(ppo.critique_failed, local))
    assert len({json.dumps(fb) for fb in local}) > 3  # the critiques differ with the response: a real comparison
    mask = torch.ones(len(texts), max(map(len, offsets)))
    deltas = [ppo.span_deltas(list(texts), list(offsets), fb, mask)[0] for fb in (local, served)]
    assert torch.equal(*deltas) and deltas[0].abs().sum() > 0
