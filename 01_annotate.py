"""Stage 1: dual-feedback annotation (Text2Grad paper Sec. 3.3, Alg. 2).

For each (prompt, response) a critic reasons step by step, writes a natural-language critique c,
and quotes 0-3 good and 0-3 poor spans of the response exactly. Every quote is located in the
response by character interval (common.locate_spans); a quote that is not there is dropped from the
spans and listed under `unmatched_spans` (App. L). The output is append-only JSONL, one line per
record flushed as it completes: kill the run at any moment, rerun the same command, and every id
ends up there exactly once.

    # the offline demo (no flags, ~20 s on 2 CPU cores): builds runs/demo/base, writes
    # runs/demo/data/*.jsonl and annotates 16000 demo summaries with the demo's rule-based critic
    python 01_annotate.py

    # KodCode with the programmatic critic: each solution's unit tests in the sandbox (no LLM)
    python 01_annotate.py --task code --dataset KodCode/KodCode-Light-RL-10K --limit 2000 \
        --annotator program --output runs/kodcode/annotations.jsonl

    # SLF5K with GPT-4o, spans grounded in the human feedback (the paper's); the key: env only
    OPENAI_API_KEY=... python 01_annotate.py --task summarization --dataset JeremyAlain/SLF5K \
        --split train --annotator openai --model gpt-4o --use-human-feedback \
        --output runs/slf5k/annotations.jsonl

    # UltraFeedback, responses by your policy, critiqued by an OpenAI-compatible server (vLLM)
    python 01_annotate.py --task qa --dataset openbmb/UltraFeedback --limit 1000 \
        --generate-with Qwen/Qwen2.5-1.5B-Instruct --annotator openai \
        --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-72B-Instruct \
        --output runs/uf/annotations.jsonl

Rerunning a command skips the ids already in --output; --retry-failed redoes the records that
failed. A rerun with another critic, task or dataset is refused (OUTPUT.made_by.json says what made
it); --overwrite starts afresh.

It reads top to bottom: the arguments; the critic's prompts (App. B) and its reply; the quotes
located in the response (App. L); the two ways a critic runs (a program or plug-in; a served
model); main(). Dataset layouts: infra/data.py; plug-in critics: critics/; the records,
--generate-with, the served critic's requests and the summary: annotation/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import common
import critics
from annotation import annotator, generation, inputs, report
from critics import plugin
from infra import cli, models, serving

# ----------------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.parser(__doc__, inputs.FIELDS)
    a = p.add_argument
    a(
        "--task",
        choices=["demo", "summarization", "code", "qa"],
        default="demo",
        help="field preset and critic prompt (SLF5K, KodCode, UltraFeedback)",
    )
    a(
        "--dataset",
        default=None,
        help="hub id, .jsonl/.json/.parquet or a folder of <split>.jsonl (default: the demo's)",
    )
    a("--split", default="train", help="dataset split (SLF5K: train, development, ...)")
    a("--limit", type=int, default=None, help="the first N records (UltraFeedback: completions)")
    a("--prompt-field", default=None, help="the prompt's field (default: the task's preset)")
    a("--response-field", default=None, help="the response's field (default: the task's preset)")
    a("--id-field", default=None, help="the id's field (default: the preset's, else the index)")
    a(
        "--annotator",
        type=critics.choice("program", "openai"),
        default="program",
        help="program: the task's own; openai: served; python:...: yours (critics/plugin.py)",
    )
    a("--concurrency", type=int, default=16, help="records in flight (code: at most the CPUs)")
    a(
        "--use-human-feedback",
        action="store_true",
        help="summarization: spans grounded in SLF5K's human feedback (the paper's)",
    )
    a("--code-timeout", type=float, default=10.0, help="code: seconds the unit tests may run")
    a("--output", default="runs/demo/annotations.jsonl", help="annotations JSONL (resumable)")
    a("--retry-failed", action="store_true", help="redo the failed records of --output")
    a("--seed", type=int, default=0, help="seed of backoff jitter, sampling, the demo base model")
    for variant in (annotator, generation, report):
        variant.add_args(p)
    inputs.add_demo_args(p)
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:  # 0 meant "no limit", -1 dropped the last
        p.error(f"--limit {args.limit}: at least 1 record")
    if args.dataset is None and args.task != "demo":
        p.error(f"--task {args.task} needs --dataset")
    if args.annotator == "program" and args.task not in ("demo", "code"):
        p.error(f"there is no program critic for --task {args.task}; use --annotator openai")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Critic prompts, in the spirit of App. B: reason step by step, critique, then quote spans exactly
# ----------------------------------------------------------------------------------------------------------------------

SYSTEM = "You are a meticulous, fair critic of model responses. You reason before you judge, and you quote exactly."
TASKS = {  # task: (what is critiqued, the chain-of-thought questions)
    "summarization": (
        "a summary of a Reddit post",
        [
            "What are the key points of the post?",
            "Which of them does the summary capture accurately?",
            "What important information is missing?",
            "Is anything inaccurate, misleading, redundant or unimportant?",
        ],
    ),
    "qa": (
        "a response to a user's request",
        [
            "What does the user need, explicitly and implicitly?",
            "Is the response accurate, relevant, clear and complete?",
            "Which claims are wrong, vague or off-topic?",
            "Which parts serve the user best?",
        ],
    ),
    "code": (
        "a code solution to a programming problem",
        [
            "What must the code do?",
            "Which algorithm does it use, and is it correct for every input, edge cases included?",
            "If a test failed, which lines cause the failure?",
            "Which lines are wrong or inefficient, and which are right?",
        ],
    ),
    "demo": (
        "a one-sentence summary of a short post",
        [
            "Which facts of the post (owner, town, colour, animal, name, place, food) "
            "does the summary state correctly?",
            "Which words are wrong, irrelevant or repeated?",
            "Which facts are missing?",
        ],
    ),
}
FORMAT = """Then write the critique, and quote spans from the response (never from the task):
- good_spans: 0-3 short phrases that make the response better, each one praised in your critique;
- poor_spans: 0-3 short phrases that make it worse (wrong, irrelevant, redundant, unclear), \
each one faulted in your critique.
Copy every span character for character from the response: no paraphrase, no ellipsis, \
no added quotes. Prefer the shortest phrase that carries the point (a few words, or one line \
of code). Use [] when nothing stands out.

Answer in this format:
Reasoning: <your step-by-step analysis>
```json
{"critique": "<one paragraph on the main strengths and weaknesses>", \
"good_spans": ["..."], "poor_spans": ["..."]}
```"""
REPAIR = (
    "I could not use your reply ({error}). Reply again with only the JSON object "
    '{{"critique": "...", "good_spans": [...], "poor_spans": [...]}}, '
    "spans copied exactly from the response."
)


def build_messages(task: str, rec: dict, tests: dict | None = None, human_feedback: bool = False) -> list[dict]:
    what, steps = TASKS[task]
    parts = [f"Critique {what}.", f"### Task\n{rec['prompt']}", f"### Response\n{rec['response']}"]
    if tests is not None:  # code: the sandbox's verdict, so the critic need not guess (as in the paper)
        parts.append(
            f"### Unit test results\npassed: {'yes' if tests['passed'] else 'no'}\n"
            + (f"```\n{tests['output'][-2000:]}\n```" if not tests["passed"] else "")
        )
    if human_feedback:
        parts.append(
            f"### Human feedback on this summary\n{rec['human_feedback']}\n"
            "Ground your critique and spans in this feedback: "
            "quote the phrases of the summary that it praises or faults."
        )
    parts.append(
        "### How to critique\nThink step by step:\n"
        + "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1))
        + "\n"
        + FORMAT
    )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_critic(raw: str | None) -> dict:
    """common.parse_feedback, plus: an empty reply, or one without any critique, is unusable."""
    if not raw or not raw.strip():
        raise ValueError("empty reply")
    fb = common.parse_feedback(raw)
    if not fb["critique"]:
        raise ValueError("no critique in or before the JSON")
    return fb


# ----------------------------------------------------------------------------------------------------------------------
# Records: locate the quotes (App. L), write one line per record
# ----------------------------------------------------------------------------------------------------------------------


def split_spans(response: str, good: list[str], poor: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(good, poor, unmatched): the quotes common.locate_spans finds in `response`, and those it
    cannot. Identical quotes claim occurrences in order (good first, then poor), so the ones left
    without an occurrence are the last copies of that quote: those are the unmatched ones."""
    good, poor = [s for s in good if s.strip()], [s for s in poor if s.strip()]
    unmatched = common.locate_spans(response, good, poor)[2]
    missing, kept = Counter(unmatched), {"good": [], "poor": []}
    for label, span in reversed([("good", s) for s in good] + [("poor", s) for s in poor]):
        if missing[span]:
            missing[span] -= 1
        else:
            kept[label].insert(0, span)
    return kept["good"], kept["poor"], unmatched


def finish(
    rec: dict, fb: dict | None = None, reason: str | None = None, raw: str | None = None, usage: Counter | None = None
) -> dict:
    out = dict(rec)
    if fb is not None:
        good, poor, unmatched = split_spans(rec["response"], fb["good_spans"], fb["poor_spans"])
        out.update(critique=fb["critique"], good_spans=good, poor_spans=poor, unmatched_spans=unmatched, status="ok")
    else:
        out.update(critique="", good_spans=[], poor_spans=[], unmatched_spans=[], status="failed", reason=reason)
        if raw:
            out["critic_output"] = raw[:4000]
    if usage:
        out["usage"] = dict(usage)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The critics: a program or python: plug-in on threads, or a served model (annotation/annotator.py)
# ----------------------------------------------------------------------------------------------------------------------


def annotate_program(todo: list[dict], critic, args, sink) -> None:
    """The task's program critic or a python: plug-in, critic = (function, label), on chunks of
    records from min(--concurrency, CPUs) threads (the code critic waits on its sandboxes), written
    in input order. A record it raises on, or cannot judge, fails with a one-line reason."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(args.concurrency, os.cpu_count() or 1))
    size = max(1, min(64, -(-len(todo) // (8 * workers))))  # few calls, every thread kept busy
    chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(critics.call, *critic, chunk, [r["response"] for r in chunk]) for chunk in chunks]
        for chunk, fut in zip(chunks, futures):
            for rec, fb in zip(chunk, fut.result()):
                if fb.get("critic_error"):
                    sink(finish(rec, reason=fb["critic_error"]))
                    continue
                # ambiguous: an interval flagged that no quote reaches
                good, poor, ambiguous = critics.quotes(rec["response"], fb)
                out = finish(rec, {**fb, "good_spans": good, "poor_spans": poor})
                sink({**out, **{k: v for k, v in (("spans", fb.get("spans")), ("ambiguous_spans", ambiguous)) if v}})


async def critique_served(rec: dict, ask, args) -> dict:
    """One record through the served critic (--annotator openai; annotation/annotator.py sends
    the requests): for code, the unit tests run first and the critic sees their verdict (as in the
    paper's KodCode prompt); then its reply, parsed, with at most one repair request (REPAIR)."""
    tests = None
    if args.task == "code" and rec.get("test"):  # the sandbox's verdict (tasks/code.py)
        from tasks.code import run_completion

        tests = await asyncio.to_thread(run_completion, rec["response"], rec["test"], args.code_timeout)
        if tests["status"] == "error":  # a broken problem: nothing to critique
            return finish(rec, reason=f"the tests cannot run: {tests['problem_error']}")
    messages, usage, raw = build_messages(args.task, rec, tests, args.use_human_feedback), Counter(), None
    try:
        for _ in range(2):  # the reply, then at most one repair request
            raw = await ask(messages, usage)
            try:
                return finish(rec, parse_critic(raw), usage=usage)
            except ValueError as e:
                error = str(e)
                messages = messages + [
                    {"role": "assistant", "content": raw or ""},
                    {"role": "user", "content": REPAIR.format(error=error)},
                ]
        return finish(rec, reason=f"unparseable critic output after one repair: {error}", raw=raw, usage=usage)
    except annotator.RecordError as e:
        return finish(rec, reason=str(e), raw=raw, usage=usage)


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args, start = parse_args(argv), time.perf_counter()  # elapsed_s: the whole run
    output = Path(args.output)
    models.check_model_path(args.generate_with, "--generate-with ")  # a typo'd folder: at once

    # 1. Load and validate everything before anything is written: no half-written file, no folder.
    rows = inputs.dataset_rows(args)
    records = inputs.to_records(rows, args)
    critic = (
        None  # a program or python: critic, imported and called on the first record (twice, one batch) before any work
    )
    if args.annotator != "openai":
        critic = plugin.load_critic(
            args.annotator,
            args.task,
            "--annotator",
            **({"timeout_s": args.code_timeout} if args.task == "code" else {}),
        )
        if records:
            critics.preflight(*critic, records[0], records[0]["response"], "--annotator")

    # 2. Resume the same settings only (--overwrite: afresh), repair a torn last line, skip ids
    #    already done (or drop failed ones to redo them).
    made_by = report.made_by(args, rows)
    report.check_made_by(output, made_by, args.overwrite)
    done = common.open_resumable_jsonl(output) if output.exists() and not args.overwrite else set()
    if args.retry_failed and done:
        kept = [r for r in common.read_jsonl(output) if r.get("status") == "ok"]
        common.write_jsonl(output, kept)  # atomic rewrite; the failed ids are then redone below
        done = {str(r["id"]) for r in kept}
    todo = [r for r in records if r["id"] not in done]
    print(
        f"{len(records)} records, {len(records) - len(todo)} already in {output}, {len(todo)} to annotate "
        f"with the {args.annotator} critic" + (f" ({args.model})" if args.annotator == "openai" else "")
    )
    if todo and args.annotator == "openai":  # one cheap request: a wrong endpoint fails here
        serving.check_server(
            args.base_url, args.model, "chat", args.timeout, min(args.max_retries, 2), params=annotator.sampling(args)
        )
    generator = generation.load_generator(args) if todo and args.generate_with else None
    if args.task == "demo" and args.dataset is None:  # the later stages' inputs, once it can start
        inputs.prepare_demo(args)
    if generator:
        generation.generate_responses(todo, args, generator)

    # 3. Annotate; every record is appended and flushed as soon as it is done.
    from tqdm.auto import tqdm

    report.start_output(output, made_by, args.overwrite)  # what made it, before its first record
    this_run, annotate_start = Counter(), time.perf_counter()
    with open(output, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc="annotate", disable=not todo) as bar:

        def sink(rec: dict) -> None:
            common.append_jsonl(f, rec)
            this_run[rec["status"]] += 1
            this_run["timed_out"] += rec.get("reason", "").startswith("timed out")
            bar.update()

        if args.annotator == "openai":
            asyncio.run(annotator.annotate_openai(todo, args, sink, lambda rec, ask: critique_served(rec, ask, args)))
        else:
            annotate_program(todo, critic, args, sink)
    annotate_s = time.perf_counter() - annotate_start

    # 4. Summary: records, failed, spans per record, unmatched-span rate (App. L), tokens, cost.
    summary = report.summarize(output, args, this_run, time.perf_counter() - start, annotate_s)
    common.write_json(output.with_suffix(".summary.json"), summary)
    report.print_summary(output, summary, this_run, args)
    print(json.dumps(summary))
    report.report_failures(output, summary, [r["id"] for r in records])
    return summary


if __name__ == "__main__":
    try:
        summary = main()
        # nothing annotated: exit 1 (report_failures said why)
        sys.exit(1 if summary["records"] and not summary["ok"] else 0)
    except (common.DataError, annotator.FatalAPIError) as e:  # bad input, or an endpoint that refuses
        print(f"error: {serving.redact(str(e))}", file=sys.stderr)
        sys.exit(2)
