"""Bring your own critic: 03 --critic, 01 --annotator and 04 --monitor python:MODULE_OR_FILE:FUNCTION.

FUNCTION(records, responses) gets a list of records (dicts with at least "prompt"; 01's also "id" and "response",
the code task's "test") and the responses to judge, and returns one item per response, either
  {"critique": str, "good_spans": [str], "poor_spans": [str]}   quotes of the response, located as 01 locates a
                                                                  critic's (common.span_rewards: delta +1 / -1), or
  {"critique": str, "spans": [{"start": int, "end": int, "reward": float}]}   character intervals [start, end) of
                                                                  the response, each with a reward in [-1, 1]
                                                                  (common.interval_rewards; overlap: the lowest
                                                                  reward wins), or
  {"critique": str, "score": float}                               one number for the whole response, put on its
                                                                  last token (a reward function's, as TRL's
                                                                  PPOTrainer took it: docs/from_trl.md); beside
                                                                  "spans", added to their last token's reward, or
  {"error": str}                                                  this response cannot be judged (delta = 0 for it).
"critique" may be left out. The task's own critics are instances: --critic program is python:tasks.demo:critic or
python:tasks.code:critic. A plug-in is trusted code the user chose: it runs in this process, with this process's
rights (model-written code is what the sandbox is for), and 01 calls it from several threads at once.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import importlib.util
import math
import numbers
import os
import re
import sys
from pathlib import Path

from common import DataError, first_line, interval_rewards, locate_spans, span_rewards

PREFIX = "python:"
PROGRAM = {"demo": "python:tasks.demo:critic", "code": "python:tasks.code:critic"}  # `program`: the task's own


def choice(*names: str):
    """An argparse type: one of `names`, or python:MODULE_OR_FILE:FUNCTION."""
    def parse(value: str) -> str:
        if value in names or (value.startswith(PREFIX) and value.count(":") >= 2):
            return value
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from " + "".join(
            f"{n!r}, " for n in names) + ("or " if names else "") + "python:MODULE_OR_FILE:FUNCTION)")
    return parse


def is_plugin(name: str | None) -> bool:
    return bool(name) and name.startswith(PREFIX)


def load_critic(name: str, task: str, flag: str, **options):
    """(function, label) for --critic / --annotator NAME: `program` is the task's own critic, called with `options`
    (01's --code-timeout); python:MODULE_OR_FILE:FUNCTION is imported here. DataError, one line naming
    MODULE:FUNCTION, for a module that does not import or a function it does not have."""
    if name == "program":
        if task not in PROGRAM:
            raise DataError(f"{flag} program: no programmatic critic for --task {task}")
        fn, label = load_critic(PROGRAM[task], task, flag)
        return functools.partial(fn, **options), label
    target, _, func = name[len(PREFIX):].rpartition(":")
    label = f"{target}:{func}"
    if not target or not func.isidentifier():
        raise DataError(f"{flag} {name}: expected python:MODULE_OR_FILE:FUNCTION")
    try:
        module = _import(target)
    except DataError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever importing it raised, in one line
        raise DataError(f"{flag} {label}: {target} does not import ({type(e).__name__}: {first_line(e)})") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise DataError(f"{flag} {label}: {target} has no function {func!r}" +
                        (f" ({type(fn).__name__})" if fn is not None else ""))
    return fn, label


def _import(target: str):
    """A .py file (a path), or a dotted module name importable from sys.path or the current folder."""
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target)
        if not path.is_file():
            raise DataError(f"{target}: no such file")
        name = "t2g_critic_" + re.sub(r"\W", "_", str(path.resolve()))  # one module per file, however it is named
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and pickle look modules up by name
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name]
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(target)


class ShapeError(ValueError):
    """What a plug-in returned is not one item per response."""


def _items(fn, records: list[dict], responses: list[str]) -> list:
    """fn's return value as a list of one item per response; ShapeError (one line) for any other shape."""
    out = fn(records, responses)
    if not isinstance(out, (list, tuple)):
        raise ShapeError(f"returned a {type(out).__name__}, not a list of one item per response")
    if len(out) != len(responses):
        raise ShapeError(f"returned {len(out)} items for {len(responses)} responses (one per response)")
    return list(out)


def check_item(item, response: str) -> dict:
    """One item, checked and put in the form the stages read: quotes {"critique", "good_spans", "poor_spans"};
    intervals the same with empty quote lists and "spans"; an error item {"critique": None, ..., "critic_error"}
    (03's failed critique: delta = 0). ValueError, one line, for any other shape."""
    if not isinstance(item, dict):
        raise ValueError(f"an item is a {type(item).__name__}, not a dict")
    if item.get("error"):
        return {"critique": None, "good_spans": [], "poor_spans": [], "critic_error": str(item["error"])}
    critique = item.get("critique") or ""
    if not isinstance(critique, str):
        raise ValueError(f"'critique' is a {type(critique).__name__}, not a string")
    out = {"critique": critique, "good_spans": [], "poor_spans": []}
    if "score" in item:  # one reward on the last token, as a scalar reward model's (03: step_rewards)
        s = item["score"]
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s):
            raise ValueError(f"'score' is {s!r}: a finite number is needed")
        out["step_rewards"] = [(None, float(s))]
    if "spans" in item:  # with a "score" too: the intervals' rewards, and the score added on the last token
        if not isinstance(item["spans"], (list, tuple)):
            raise ValueError(f"'spans' is a {type(item['spans']).__name__}, not a list")
        out["spans"] = [_interval(x, len(response)) for x in item["spans"]]
    if len(out) > 3:
        return out
    if "good_spans" not in item and "poor_spans" not in item:
        raise ValueError("an item needs 'good_spans' / 'poor_spans' (quotes), 'spans' (intervals) or 'score', got "
                         f"keys {sorted(map(str, item))}")
    quotes = {k: item.get(k) or [] for k in ("good_spans", "poor_spans")}
    for k, v in quotes.items():
        if not isinstance(v, (list, tuple)) or not all(isinstance(q, str) for q in v):
            raise ValueError(f"'{k}' must be a list of strings (quotes of the response)")
    extra = {"ambiguous_spans": item["ambiguous_spans"]} if item.get("ambiguous_spans") else {}  # (a program critic's)
    return {"critique": critique, **{k: list(v) for k, v in quotes.items()}, **extra}


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


def call(fn, label: str, records: list[dict], responses: list[str]) -> list[dict]:
    """fn on a batch, one checked item per response (check_item). A record fn raises on never ends the run: when the
    batch call raises, each record is called alone, and those that still fail get an error item, "<label> raised
    TypeError: ..." (one line). A wrong-shaped item is an error item too. A return of the wrong length or type is no
    failed record but a broken plug-in: DataError naming the call and the lengths (one item for a batch of 8 would
    otherwise pass the one-record preflight and train on delta = 0)."""
    CALLS[label] += 1
    try:
        items = fn(records, responses)
    except Exception as e:  # noqa: BLE001 - a user's function: anything it raises is this batch's failure
        if len(records) > 1:
            return [item for r, t in zip(records, responses) for item in call(fn, label, [r], [t])]
        return [check_item({"error": f"{label} raised {type(e).__name__}: {first_line(e)}"}, responses[0])]
    got = f"{len(items)} items for {len(responses)} responses" if isinstance(items, (list, tuple)) else \
        f"a {type(items).__name__}, not a list,"
    if not isinstance(items, (list, tuple)) or len(items) != len(responses):
        raise DataError(f"{label}: returned {got} on its call {CALLS[label]} (one item per response): a plug-in "
                        "error, not a failed record")
    out = []
    for item, response in zip(items, responses):
        try:
            out.append(check_item(item, response))
        except ValueError as e:
            out.append(check_item({"error": f"{label} returned a bad item: {e}"}, response))
    return out


CALLS = collections.Counter()  # calls of each plug-in (its label) in this process, for call()'s errors


def preflight(fn, label: str, record: dict, response: str, flag: str) -> dict:
    """One call on one record before any work (as serving.check_server does for a server): DataError, one line naming
    MODULE:FUNCTION, when fn raises or returns the wrong length or shape. Returns the checked item."""
    try:
        items = _items(fn, [record], [response])
    except ShapeError as e:
        raise DataError(f"{flag} {label}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{flag} {label} raised on the first record: {type(e).__name__}: {first_line(e)}") from None
    try:
        return check_item(items[0], response)
    except ValueError as e:
        raise DataError(f"{flag} {label}: {e}") from None


def delta(response: str, offsets, fb: dict) -> list[float]:
    """delta_t of a checked item on a response's tokens, as 03 puts it there (no delta for an error item)."""
    if fb.get("critic_error"):
        return [0.0] * len(offsets)
    d = interval_rewards(response, offsets, fb["spans"]) if "spans" in fb else [0.0] * len(offsets)
    if "step_rewards" in fb and d:  # a score: added on the last token
        d[-1] += fb["step_rewards"][0][1]
    if "spans" in fb or "step_rewards" in fb:
        return d
    return span_rewards(response, offsets, fb["good_spans"], fb["poor_spans"])[0]


def probe_response(record: dict) -> str:
    """The response a preflight call judges, before any is generated: the record's own, else its reference."""
    return next((record[k] for k in ("response", "reference") if isinstance(record.get(k), str)), "")


def quotes(response: str, fb: dict) -> tuple[list[str], list[str], list[dict]]:
    """(good, poor, ambiguous) quotes of a checked item: its own, or for intervals the quotes that locate to exactly
    them (unambiguous_quotes; reward > 0 good, < 0 poor), so that 01's records always hold quotes."""
    if "spans" not in fb:
        return fb["good_spans"], fb["poor_spans"], fb.get("ambiguous_spans", [])
    ivs = {sign: [(x["start"], x["end"]) for x in fb["spans"] if x["start"] < x["end"] and sign * x["reward"] > 0]
           for sign in (1, -1)}
    return unambiguous_quotes(response, ivs[1], ivs[-1])


def unambiguous_quotes(text, good_iv, poor_iv) -> tuple[list[str], list[str], list[dict]]:
    """(good quotes, poor quotes, ambiguous) for a critic that knows the intervals it means (tasks/: the demo's and
    the code task's program critics, and interval plug-ins in stage 1): each interval's own text, kept where
    common.locate_spans puts every quote back on exactly its interval. An interval whose text occurs earlier,
    unclaimed by an identical quote, cannot be quoted: the quote would label that occurrence. It is never widened to
    be unique (that labels words the critic did not flag: " yellow cat" for a repeated " yellow", issue 56): it goes
    to `ambiguous` as {"start", "end", "label", "reason"}, and the other quotes stay."""
    ivs, ambiguous = {"good": list(good_iv), "poor": list(poor_iv)}, []
    while True:
        quotes = {k: [text[a:b] for a, b in v] for k, v in ivs.items()}
        got = dict(zip(("good", "poor"), locate_spans(text, quotes["good"], quotes["poor"])[:2]))
        wrong = next(((k, i) for k in ("good", "poor") for i, iv in enumerate(ivs[k])
                      if i >= len(got[k]) or got[k][i] != iv), None)
        if wrong is None:
            return quotes["good"], quotes["poor"], ambiguous
        k, i = wrong
        (a, b) = ivs[k].pop(i)
        ambiguous.append({"start": a, "end": b, "label": k, "reason": f"{text[a:b]!r} occurs earlier, where a quote "
                          "of it would land"})
