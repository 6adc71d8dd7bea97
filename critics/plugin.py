"""Bring your own critic: 03 --critic, 01 --annotator and 04 --monitor python:MODULE_OR_FILE:FUNCTION, and --critic
program, the task's own critic (python:tasks.demo:critic, python:tasks.code:critic): the function imported.

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
"critique" may be left out. critics/__init__.py calls it (call: each item checked, check_item) and checks it once
before any work (preflight). A plug-in is trusted code the user chose: it runs in this process, with this process's
rights (model-written code is what the sandbox is for), and 01 calls it from several threads at once. In 03 each call
runs under --critic-timeout (limited: SIGALRM, so in the main thread only; a plug-in that sets SIGALRM itself takes
the limit's place).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from common import DataError, first_line

PREFIX = "python:"
PROGRAM = {"demo": "python:tasks.demo:critic", "code": "python:tasks.code:critic"}  # `program`: the task's own


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
    target, _, func = name[len(PREFIX) :].rpartition(":")
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
        raise DataError(
            f"{flag} {label}: {target} has no function {func!r}" + (f" ({type(fn).__name__})" if fn is not None else "")
        )
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


class Timeout(BaseException):
    """A plug-in call past its time limit (limited). A BaseException, as KeyboardInterrupt is, so that a plug-in's own
    `except Exception` cannot swallow it."""


def limited(fn, args: tuple, deadline: float | None):
    """fn(*args), stopped by Timeout at `deadline` (time.monotonic()), or at once where it has passed. SIGALRM: the
    previous handler and timer come back however the call ends. No limit without a deadline, or off the main thread
    (01's threads), where no signal can be taken."""
    if (
        deadline is None
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "setitimer")
    ):
        return fn(*args)
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout
    armed = [True]

    def expire(signum, frame):
        if armed[0]:  # an alarm handled after the call returned (as the handler is put back) is no timeout
            raise Timeout

    old = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, left)
        return fn(*args)
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if old is None else old)  # None: a handler set outside Python
