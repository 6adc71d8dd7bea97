"""03 --critic (with its --critic-*, --score-norm and --max-fail-* flags), 01 --annotator, 04 --monitor: the critic.

The contract. A critic is a function critic(records, texts) -> feedback, one dict per text, in one of these forms:
  {"critique": str, "good_spans": [str], "poor_spans": [str]}    quotes of the text (common.span_rewards, §3.3)
  {"critique": str, ..., "spans": [{"start", "end", "reward"}]}  character intervals, rewards in [-1, 1]
  {"critique": str, ..., "step_rewards": [(end, reward)]}        a scalar critic's rewards at given characters
  {"critique": None, ..., "critic_error": str}                   a failed critique (critique_failed): delta = 0
and delta(text, offsets, feedback) is the one function from feedback to the per-token pseudo-rewards delta_t
(span_deltas: 03's step 3, a batch of them, with App. I's --labels and --span-weighting: weight_spans).
A user's function returns the same forms, or {"critique", "score"} or {"error"} (check_item puts them in these).

make_critic builds the critic that --critic names, each kind in a module beside this one: local and openai, the
stage-2 reward model in this process or behind an OpenAI-compatible server (critics/learned.py), whose raw text
parse() reads; program and python:MODULE_OR_FILE:FUNCTION, a function (critics/plugin.py loads it: the task's own
critic, or yours), called through call(); scalar-rm and prm, the paper's scalar baselines (critics/scalar.py).
Before any training check_critic makes sure that it works; during the run a critic that has stopped working stops
it (failing: --max-fail-share, --max-fail-iterations), and end_of_run says what it cost and how many of its critiques
failed. make_monitor: the demo's exact critic on the same rollouts, logged and never trained on.
"""

from __future__ import annotations

import argparse
import collections
import math
import numbers
import time

import numpy as np
import torch

import common
from critics import learned, plugin, scalar
from infra import reward_models, runs, serving
from infra.data import read_prompts
from tasks.quotes import unambiguous_quotes

NAMES = ("local", "program", "openai", *scalar.CRITICS)  # --critic's names; or python:MODULE_OR_FILE:FUNCTION


def choice(*names: str):
    """An argparse type: one of `names`, or python:MODULE_OR_FILE:FUNCTION."""

    def parse_name(value: str) -> str:
        if value in names or plugin.is_plugin(value) and value.count(":") >= 2:
            return value
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from "
            + "".join(f"{n!r}, " for n in names)
            + ("or " if names else "")
            + "python:MODULE_OR_FILE:FUNCTION)"
        )

    return parse_name


def add_args(p) -> None:
    """03's flags of the critic (step 2): --critic and its reward model, App. I's labels (span_deltas), the served
    critic's, the scalar baselines', the failure limits."""
    g = p.add_argument_group("the critic of step 2 (critics/)")
    g.add_argument(
        "--critic",
        default="local",
        type=choice(*NAMES),
        metavar="{local,program,openai,scalar-rm,prm,python:MODULE_OR_FILE:FUNCTION}",
        help="who writes critique + spans (critics/; README: Your own critic)",
    )
    g.add_argument(
        "--reward-model", help="stage-2 output dir (adapter + reward_model.json), for --critic local, scalar-rm, prm"
    )
    g.add_argument(
        "--critic-max-new-tokens", type=int, help="max tokens of a critique (default: reward_model.json's, else preset)"
    )
    g = p.add_argument_group("the paper's ablations (App. I): span_deltas")
    g.add_argument("--span-weighting", default="uniform", choices=["uniform", "linear-decay"], help="weight_spans")
    g.add_argument(
        "--labels",
        default="spans",
        choices=["spans", "dense", "poor"],
        help="dense: +1 outside poor spans (App. I.1); poor: delta_t = min(delta_t, 0)",
    )
    g = p.add_argument_group("a served critic: --critic openai (critics/learned.py)")
    g.add_argument("--critic-base-url", help="OpenAI-compatible endpoint for --critic openai (vLLM, Ollama, OpenAI)")
    g.add_argument("--critic-model", default="gpt-4o", help="model name at that endpoint")
    g.add_argument(
        "--critic-api",
        default="chat",
        choices=["chat", "completions"],
        help="chat: one user message; completions: the reward model's exact input text",
    )
    g.add_argument("--critic-concurrency", type=int, default=32, help="parallel requests for --critic openai")
    g.add_argument(
        "--critic-timeout",
        type=float,
        default=300.0,
        help="seconds before a critique is abandoned: a request of --critic openai (not retried), or a call of a "
        "python: plug-in on a batch (its one-record retries included); either way its critiques fail (delta = 0) and "
        "count toward --max-fail-*",
    )
    g.add_argument("--critic-retries", type=int, default=2, help="retries on 408/409/429/5xx and connection errors")
    g = p.add_argument_group("the paper's scalar baselines: --critic scalar-rm, prm (critics/scalar.py)")
    g.add_argument(
        "--score-norm",
        default="mean",
        choices=["mean", "mean-std"],
        help="--critic scalar-rm: subtract the SFT demonstrations' mean score (mean-std: and divide by their std)",
    )
    g = p.add_argument_group("a critic that stops working (critics/__init__.py: failing)")
    g.add_argument(
        "--max-fail-share",
        type=float,
        default=0.5,
        help="an iteration whose critiques fail above this share counts as failed",
    )
    g.add_argument(
        "--max-fail-iterations",
        type=int,
        default=3,
        help="stop after this many failed iterations in a row, checkpoint saved",
    )


def check_args(args, budget: int | None, rm_given: bool) -> None:
    """03's parse_args, once the preset is applied: the reward model the critic uses, and how (args.critic_*), as
    stage 2 trained it (its reward_model.json): its input cut to the same budget and, unless given, critiques as long
    as those stage 2 evaluated (a shorter limit cuts them before their span JSON). The demo's reward model is not the
    one a server runs: without --reward-model only --critic local uses one. budget, rm_given: --critic-max-new-tokens
    and --reward-model as given. --critic scalar-rm, prm: a reward model of their objective (critics/scalar.py).
    --labels dense: uniform --span-weighting."""
    if args.critic != "local" and not rm_given:
        args.reward_model = None
    settings = reward_models.rm_settings(args.reward_model if args.critic != "program" else None)
    args.critic_max_prompt_tokens, args.critic_rm_format = settings["max_prompt_tokens"], settings["rm_format"]
    args.critic_max_new_tokens = budget or settings["max_new_tokens"] or args.critic_max_new_tokens
    scalar.check_args(args)
    if args.labels == "dense" and args.span_weighting != "uniform":  # every token is in one span: nothing to weight
        raise common.DataError("--labels dense: --span-weighting must be uniform (no quotes to weight)")


# ----------------------------------------------------------------------------------------------------------------------
# The contract: feedback, its forms, and feedback -> delta
# ----------------------------------------------------------------------------------------------------------------------


def failed(error: str, **output) -> dict:
    """A failed critique: delta = 0 for its text, counted in critic/parse_fail_rate, the error (and a learned critic's
    own text, critic_output) kept for samples.jsonl."""
    return {"critique": None, "good_spans": [], "poor_spans": [], "critic_error": error, **output}


def critique_failed(fb) -> bool:
    """True for a critique that gives no delta: its output did not parse or its request failed, or None."""
    return fb is None or fb.get("critique") is None


def parse(raw) -> dict:
    """A learned critic's raw text as feedback (common.parse_feedback), or, for text that does not parse or a request
    that failed (an exception), a failed critique."""
    if isinstance(raw, Exception):
        return failed(serving.api_error(raw), critic_output=None)
    try:
        return common.parse_feedback(raw)
    except ValueError as e:
        return failed(str(e), critic_output=raw[:4000])


def delta(text: str, offsets, fb: dict) -> tuple[list[float], list[str]]:
    """delta_t on the tokens of `text` (offsets: each token's character interval in it) from one critique, and the
    quotes not found in the text: 0 everywhere for a failed critique; a scalar critic's step rewards on the tokens
    that hold their characters (critics/scalar.py); intervals with their rewards (common.interval_rewards, the lowest
    wins where they overlap); quotes, +1 good and -1 poor (common.span_rewards, §3.3)."""
    if critique_failed(fb):
        return [0.0] * len(offsets), []
    if "spans" in fb or "step_rewards" in fb:  # intervals, a score, or both: the score added on the last token
        d = scalar.step_deltas(offsets, fb.get("step_rewards", []))
        if "spans" in fb:
            d = [a + b for a, b in zip(common.interval_rewards(text, offsets, fb["spans"]), d)]
        return d, []
    return common.span_rewards(text, offsets, fb["good_spans"], fb["poor_spans"])


def span_deltas(texts, offsets, feedback, mask, weighting="uniform", labels="spans"):
    """03's step 3 (§3.3): a batch's feedback -> per-token pseudo-rewards delta_t (delta() of each row),
    with --span-weighting and --labels (App. I). Returns delta (B, T) (0 where the critique failed), each
    row's (delta, unmatched), the number of non-empty quotes (or intervals) and of the critic's quotes
    not found."""
    out = torch.zeros_like(mask)
    rows = [None] * len(feedback)
    spans = [[] for _ in feedback]
    n_spans = 0
    n_unmatched = 0
    for i, fb in enumerate(feedback):
        if critique_failed(fb):
            continue
        has_quotes = "spans" not in fb and "step_rewards" not in fb  # a learned critic's, or a function's quotes
        quoted = fb.get("good_spans", []) + fb.get("poor_spans", [])
        n_spans += sum(1 for s in quoted if s.strip()) + len(fb.get("spans", []))
        if has_quotes and labels == "dense":  # App. I.1: the whole response quoted as good too: +1 outside poor spans
            fb = {**fb, "good_spans": fb["good_spans"] + ([texts[i]] if texts[i].strip() else [])}
        if has_quotes and weighting != "uniform":  # the same delta, and the tokens of each located quote
            d, unmatched, located = common.span_tokens(texts[i], offsets[i], fb["good_spans"], fb["poor_spans"])
            spans[i] = [idx for _, idx in located]
        elif has_quotes:  # the paper's delta_t: +1 on good quotes, -1 on poor ones (§3.3)
            d, unmatched = common.span_rewards(texts[i], offsets[i], fb["good_spans"], fb["poor_spans"])
        else:  # intervals with rewards, or a scalar critic's step rewards
            d, unmatched = delta(texts[i], offsets[i], fb)
        rows[i] = (d, unmatched)
        out[i, : len(d)] = torch.tensor(d)
        n_unmatched += len(unmatched) - (labels == "dense" and texts[i] in unmatched)  # the critic's quotes only
    out = weight_spans(out, spans, weighting)
    if labels == "poor":  # no +1 (bench/credit/credit.py)
        out = out.clamp(max=0)
    return out, rows, n_spans, n_unmatched


def weight_spans(delta, spans, mode="uniform"):
    """App. I's within-span weighting. linear-decay: the i-th of a span's n tokens gets delta times
    1 - (i - 1) * 0.9 / (n - 1) ([1, .775, .55, .325, .1] for n = 5; 1 for n = 1), so a span's start
    carries most of its credit. spans[b]: the token indices of each located span of row b, in order
    (common.span_tokens); a token in two spans of its label takes the larger weight."""
    if mode == "uniform":
        return delta
    weight = torch.ones_like(delta)
    for b, row in enumerate(spans):
        best = {}
        for idx in row:
            for i, t in enumerate(idx):
                best[t] = max(best.get(t, 0.0), 1.0 - i * 0.9 / (len(idx) - 1) if len(idx) > 1 else 1.0)
        for t, w in best.items():
            weight[b, t] = w
    return delta * weight


def quotes(text: str, fb: dict) -> tuple[list[str], list[str], list[dict]]:
    """(good, poor, ambiguous) quotes of feedback: its own, or for intervals the quotes that locate to exactly them
    (unambiguous_quotes; reward > 0 good, < 0 poor), so that 01's records always hold quotes."""
    if "spans" not in fb:
        return fb["good_spans"], fb["poor_spans"], fb.get("ambiguous_spans", [])
    ivs = {
        sign: [(x["start"], x["end"]) for x in fb["spans"] if x["start"] < x["end"] and sign * x["reward"] > 0]
        for sign in (1, -1)
    }
    return unambiguous_quotes(text, ivs[1], ivs[-1])


def check_item(item, text: str) -> dict:
    """What a user's function returned for one text, checked and put in the contract's forms: quotes; intervals (the
    quote lists empty); a score, one reward on the last token ("step_rewards"), alone or beside intervals; an error
    item, a failed critique.
    ValueError, one line, for any other shape."""
    if not isinstance(item, dict):
        raise ValueError(f"an item is a {type(item).__name__}, not a dict")
    if item.get("error"):
        return failed(str(item["error"]))
    critique = item.get("critique") or ""
    if not isinstance(critique, str):
        raise ValueError(f"'critique' is a {type(critique).__name__}, not a string")
    out = {"critique": critique, "good_spans": [], "poor_spans": []}
    if "score" in item:  # one reward on the last token, as a scalar reward model's
        s = item["score"]
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s):
            raise ValueError(f"'score' is {s!r}: a finite number is needed")
        out["step_rewards"] = [(None, float(s))]
    if "spans" in item:  # with a "score" too: the intervals' rewards, and the score added on the last token
        if not isinstance(item["spans"], (list, tuple)):
            raise ValueError(f"'spans' is a {type(item['spans']).__name__}, not a list")
        out["spans"] = [_interval(x, len(text)) for x in item["spans"]]
    if len(out) > 3:
        return out
    if "good_spans" not in item and "poor_spans" not in item:
        raise ValueError(
            "an item needs 'good_spans' / 'poor_spans' (quotes), 'spans' (intervals) or 'score', got "
            f"keys {sorted(map(str, item))}"
        )
    quoted = {k: item.get(k) or [] for k in ("good_spans", "poor_spans")}
    for k, v in quoted.items():
        if not isinstance(v, (list, tuple)) or not all(isinstance(q, str) for q in v):
            raise ValueError(f"'{k}' must be a list of strings (quotes of the response)")
    extra = {"ambiguous_spans": item["ambiguous_spans"]} if item.get("ambiguous_spans") else {}  # (a program critic's)
    return {"critique": critique, **{k: list(v) for k, v in quoted.items()}, **extra}


def _interval(x, n: int) -> dict:
    """{"start", "end", "reward"} checked: integer offsets with 0 <= start <= end <= n, a reward in [-1, 1]."""
    if not isinstance(x, dict) or not {"start", "end", "reward"} <= set(x):
        raise ValueError(f"a span must be {{'start', 'end', 'reward'}}, got {str(x)[:80]}")
    a, b, r = x["start"], x["end"], x["reward"]
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (a, b)) or not 0 <= a <= b <= n:
        raise ValueError(f"span [{a}, {b}) is not a character interval of the response (0 <= start <= end <= {n})")
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not (math.isfinite(r) and -1 <= r <= 1):
        raise ValueError(f"span [{a}, {b}) has reward {r!r}: a number in [-1, 1] is needed")
    return {"start": int(a), "end": int(b), "reward": float(r)}


# ----------------------------------------------------------------------------------------------------------------------
# A function as the critic (--critic program, python:...; 01 --annotator, 04 --monitor): called, its items checked
# ----------------------------------------------------------------------------------------------------------------------

CALLS = collections.Counter()  # calls of each function (its label) in this process, for call()'s errors


def call(fn, label: str, records: list[dict], texts: list[str], timeout: float | None = None, deadline=None):
    """fn on a batch, one checked item per text (check_item). A record fn raises on never ends the run: when the
    batch call raises, each record is called alone, and those that still fail get an error item, "<label> raised
    TypeError: ..." (one line). A wrong-shaped item is an error item too. A return of the wrong length or type is no
    failed record but a broken plug-in: DataError naming the call and the lengths (one item for a batch of 8 would
    otherwise train on delta = 0; preflight calls a batch of two for it). timeout (03's --critic-timeout): the seconds
    the call may take, its one-record retries included (deadline, on time.monotonic()); past them, each text it has
    not judged gets an error item: a hung plug-in is a failed critique, under the run's failure limits."""
    CALLS[label] += 1
    deadline = deadline or (time.monotonic() + timeout if timeout else None)
    try:
        items = plugin.limited(fn, (records, texts), deadline)
    except plugin.Timeout:
        why = f"{label} did not return within --critic-timeout {timeout:g} s (call {CALLS[label]})"
        return [failed(why) for _ in texts]
    except Exception as e:  # noqa: BLE001 - a user's function: anything it raises is this batch's failure
        if len(records) > 1:
            return [item for r, t in zip(records, texts) for item in call(fn, label, [r], [t], timeout, deadline)]
        return [failed(f"{label} raised {type(e).__name__}: {common.first_line(e)}")]
    got = (
        f"{len(items)} items for {len(texts)} responses"
        if isinstance(items, (list, tuple))
        else f"a {type(items).__name__}, not a list,"
    )
    if not isinstance(items, (list, tuple)) or len(items) != len(texts):
        raise common.DataError(
            f"{label}: returned {got} on its call {CALLS[label]} (one item per response): a "
            "plug-in error, not a failed record"
        )
    out = []
    for item, text in zip(items, texts):
        try:
            out.append(check_item(item, text))
        except ValueError as e:
            out.append(failed(f"{label} returned a bad item: {e}"))
    return out


def preflight(fn, label: str, record: dict, text: str, flag: str, timeout: float | None = None) -> dict:
    """One call on a batch of two (the record twice) before any work, as serving.check_server does for a server:
    DataError, one line naming MODULE:FUNCTION, when fn raises, does not return within timeout seconds (03's
    --critic-timeout), or returns the wrong length or shape. Two, because a function that returns one item whatever
    the batch passes a one-record check and fails only after the SFT warm start. Returns the checked item."""
    try:
        items = plugin.limited(fn, ([record, record], [text, text]), time.monotonic() + timeout if timeout else None)
    except plugin.Timeout:
        raise common.DataError(
            f"{flag} {label} did not return on the first record within --critic-timeout {timeout:g} s"
        ) from None
    except Exception as e:  # noqa: BLE001
        raise common.DataError(
            f"{flag} {label} raised on the first record: {type(e).__name__}: {common.first_line(e)}"
        ) from None
    if not isinstance(items, (list, tuple)):
        raise common.DataError(
            f"{flag} {label}: returned a {type(items).__name__}, not a list of one item per response"
        )
    if len(items) != 2:
        raise common.DataError(
            f"{flag} {label}: returned {len(items)} items for 2 responses (the first record twice; one per response)"
        )
    try:
        return [check_item(item, text) for item in items][0]
    except ValueError as e:
        raise common.DataError(f"{flag} {label}: {e}") from None


def probe_response(record: dict) -> str:
    """The response a preflight call judges, before any is generated: the record's own, else its reference."""
    return next((record[k] for k in ("response", "reference") if isinstance(record.get(k), str)), "")


# ----------------------------------------------------------------------------------------------------------------------
# Stage 3's critic: built, checked before any training, watched while it runs
# ----------------------------------------------------------------------------------------------------------------------


def make_critic(args):
    """critic(records, texts) -> feedback for --critic: local, the stage-2 reward model (§3.4), or openai, one behind
    a server (critics/learned.py), their text parsed; program, python:...: a function (critics/plugin.py), called
    through call() (a raise: that text's critic_error); scalar-rm, prm: the paper's scalar baselines
    (critics/scalar.py)."""
    if args.critic in scalar.CRITICS:
        return scalar.scalar_critic(args)
    if args.critic == "program" or plugin.is_plugin(args.critic):  # the task's own or the user's (time-limited)
        fn, label = plugin.load_critic(args.critic, args.task, "--critic")
        return lambda recs, texts: call(fn, label, recs, texts, plugin_timeout(args))
    write = learned.local_critic(args) if args.critic == "local" else learned.served_critic(args)
    return lambda recs, texts: [parse(x) for x in write(recs, texts)]


def token_deltas(critic, tokenizer, records: list[dict], responses: list[list[int]]):
    """delta_t of each response on its own token ids, a list per response (the integrations' reward: verl's, SkyRL's).
    From the ids, not the text: the quotes are located on the tokens the policy sampled, by their character intervals
    (common.decode_with_offsets), then span_deltas, 03's step 3. Returns the lists, the feedback, the number of
    quotes and of quotes not found."""
    texts, offsets = map(list, zip(*(common.decode_with_offsets(tokenizer, r) for r in responses)))
    feedback = critic(records, texts)
    lengths = torch.tensor([len(r) for r in responses])
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).float()
    delta, _, n_spans, n_unmatched = span_deltas(texts, offsets, feedback, mask)
    return [d[:n].tolist() for d, n in zip(delta, lengths.tolist())], feedback, n_spans, n_unmatched


def plugin_timeout(args) -> float | None:
    """--critic-timeout for a python: plug-in's calls; none for `program`, the task's own critic, whose runs have
    limits of their own (the code critic's: each test run's)."""
    return args.critic_timeout if plugin.is_plugin(args.critic) else None


def check_critic(args) -> None:
    """Before any training, so that a critic that cannot work stops the run in one line: a reward model that cannot
    be used (--critic local, or openai with --reward-model: check_reward_model); for a function (program,
    python:...), one that does not import, is missing or returns the wrong shape on the first prompt (preflight), or
    returns intervals or a score where --labels or --span-weighting relabel quotes; for a server (openai), one cheap
    request (serving.check_server: a wrong model name, a dead port, a 4xx, a missing key)."""
    if args.critic == "local" or (args.critic == "openai" and args.reward_model):
        reward_models.check_reward_model(args.reward_model)
    if args.critic == "program" or plugin.is_plugin(args.critic):
        fn, label = plugin.load_critic(args.critic, args.task, "--critic")
        rec = read_prompts(args.prompts, args.task)[0]
        item = preflight(fn, label, rec, probe_response(rec), "--critic", plugin_timeout(args))
        if ("spans" in item or "step_rewards" in item) and (args.labels != "spans" or args.span_weighting != "uniform"):
            raise common.DataError(
                f"--critic {label} returns "
                + ("located intervals with their own rewards" if "spans" in item else "a score")
                + ": --labels dense and --span-weighting relabel quotes"
            )
    if args.critic == "openai":
        serving.check_server(
            args.critic_base_url,
            args.critic_model,
            args.critic_api,
            args.critic_timeout,
            args.critic_retries,
            "--critic-base-url",
            {"temperature": 0.0, "max_tokens": args.critic_max_new_tokens},
        )  # as the critic sends


def judge(critic, records: list[dict], texts: list[str], device) -> tuple[list | None, str | None]:
    """Step 2: (feedback, None), or (None, why) when the critic is broken (a DataError: a plug-in that returned the
    wrong number of items) here or on another rank: every rank learns it in the same iteration, so that they stop
    together (03 first saves the iterations done, a collective)."""
    import torch

    from infra import distributed

    try:
        feedback, why = critic(records, texts), None
    except common.DataError as e:
        feedback, why = None, str(e)
    if distributed.all_sum(torch.tensor([float(why is not None)], device=device)).item() and why is None:
        why = "the critic of another rank failed (its line is on that rank's stderr)"
    return feedback, why


def broken(why: str, done: int) -> str:
    """The line a broken critic (judge) stops stage 3 with, `done` iterations saved in checkpoint.pt (0: none, the
    first iteration failed: there is nothing to continue)."""
    if not done:
        return why
    return f"{why}; checkpoint.pt holds iteration {done}: fix the critic, then continue with --resume"


def failing(rows: list, row: dict, feedback: list, args) -> str | None:
    """After each iteration: its metrics row into `rows` (the run's, from its first iteration: metrics.jsonl, resumed
    segments included), and the line to stop the run with when the critic has not worked for --max-fail-iterations
    iterations in a row (each with more than --max-fail-share of its critiques failed; a resume does not break the
    row), else None. A critic that never parses gives every rollout delta = 0, which a reward of 0.00 and a mistake
    rate of 0.00 do not tell from a flawless batch: the run would train on no signal and end with exit 0 (issue 56).
    Every rank decides the same: the rates are the global batch's."""
    rows.append(row)
    recent = [r["critic/parse_fail_rate"] for r in rows[-args.max_fail_iterations :]]
    if len(recent) < args.max_fail_iterations or min(recent) <= args.max_fail_share:
        return None
    first = next((fb["critic_error"] for fb in feedback if fb and fb.get("critic_error")), None)
    return (
        f"stage 3 stopped at iteration {row['step']}: most critiques failed (over --max-fail-share "
        f"{args.max_fail_share:g}) {len(recent)} iterations in a row, their rollouts got delta = 0 (the last "
        f"one's first: {first}); checkpoint.pt holds iteration {row['step']}: fix the critic, then continue with "
        "--resume"
    )


def end_of_run(rows: list[dict], first_step: int, args, rank: int) -> None:
    """The run's end: what the critic cost next to the rollout it judges, and how many of its critiques failed over
    the whole run (rows: metrics.jsonl's, every iteration, resumed segments included; those since `first_step`, this
    invocation's, beside them) (rank 0 prints); DataError, on every rank, when more than --max-fail-share of the
    run's critiques failed: its policy is saved, but trained mostly without the critic's signal."""
    if not rows:
        return
    run, segment = (
        runs.critic_failures(r, args.batch_size) for r in (rows, [r for r in rows if r["step"] >= first_step])
    )
    failures, n = run["failed"], run["critiques"]
    since = (
        f"{segment['failed']} of {segment['critiques']} in iterations {first_step}-{rows[-1]['step']}, since the resume"
        if first_step > 1
        else ""
    )
    if rank == 0:
        gen_s, critic_s = (float(np.median([r[k] for r in rows])) for k in ("time/generate_s", "time/critic_s"))
        print(
            f"per iteration (median): rollout {gen_s:.3f} s, critic ({args.critic}) {critic_s:.3f} s = "
            f"{critic_s / max(gen_s, 1e-9):.2f}x the rollout (time/critic_s / time/generate_s)"
        )
        print(
            f"critic ({args.critic}): {failures} of {n} critiques failed in this run ({failures / n:.0%}"
            + (f"; {since}" if since else "")
            + "), their rollouts got delta = 0 (critic/parse_fail_rate; samples.jsonl keeps critic_error)"
        )
    if failures / n > args.max_fail_share:
        raise common.DataError(
            f"stage 3 finished, but {failures} of {n} critiques failed ({failures / n:.0%}, over "
            f"--max-fail-share {args.max_fail_share:g})"
            + (f" in its {len(rows)} iterations ({since})" if since else "")
            + ": the saved policy was trained on delta = 0 for them (samples.jsonl keeps their critic_error)"
        )


def make_monitor(args):
    """monitor(records, texts, offsets, deltas) -> {metric: this rank's sum over its rollouts}, logged next to the
    critic's metrics and never trained on; or None. The demo has one: its exact critic on the same rollouts
    (tasks.demo.demo_monitor), the reward-hacking monitor that 04's curves draw dashed. deltas, step 3's (delta,
    unmatched) per rollout, are reused when the critic is that very one (--critic program, --labels spans)."""
    if args.task != "demo":
        return None
    from tasks.demo import demo_monitor

    reuse = args.critic == "program" and args.labels == "spans"  # dense labels are not the exact critic's delta
    return lambda recs, texts, offsets, deltas: demo_monitor(recs, texts, offsets, deltas if reuse else None)
