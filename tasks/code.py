"""The code task: benchmarks in their own layouts (KodCode, HumanEval, MBPP, EvalPlus), completions post-processed as
the field does, pass@k, and the programmatic critic, which runs the tests in the sandbox (tasks/sandbox.py) and quotes
the lines most likely wrong. 01 annotates with it (--task code), 03 trains on it (--critic program), 04 evaluates with
it (pass@k).
"""

from __future__ import annotations

import ast
import functools
import os
import re

from common import DataError
from tasks.quotes import unambiguous_quotes
from tasks.sandbox import TRACEBACK_FRAME, parse_python, run_tests_sandboxed

# ----------------------------------------------------------------------------------------------------------------------
# Benchmark layouts, completion post-processing and pass@k (01 annotates, 03 trains on, 04 evaluates)
# ----------------------------------------------------------------------------------------------------------------------

# Every layout becomes {"id", "prompt", "test", "reference"}, where `test` is what run_tests_sandboxed runs:
#   KodCode    question, solution, test: test = the pytest file, which imports from `solution` (the contract's layout).
#              03's prompt files may say `prompt` instead of `question`.
#   HumanEval  task_id, prompt, canonical_solution, test, entry_point: the completion continues the prompt, and the
#              test's check(candidate) is called with the entry point, all in one namespace as the official harness
#              does: test = {"prefix": prompt, "script": test + "check(<entry_point>)", "entry_point", "stop"}.
#   MBPP       text or prompt, code, test_list, test_setup_code, test_imports: the completion is the whole program;
#              test = {"prefix": "", "script": imports + setup + the asserts, "stop"}. A bare description (original
#              MBPP's `text`, sanitized MBPP's `prompt`) becomes the usual prompt, as MBPP+ ships it: a docstring
#              holding the description and the first test, which names the function to write.
#   EvalPlus   HumanEval+ / MBPP+ as published on the hub (evalplus/humanevalplus, evalplus/mbppplus): the same
#              layouts, their extra tests inside `test`, which then runs instead of MBPP's test_list. The raw release
#              files' base_input / plus_input / atol / contract fields are not read: their expected outputs come from
#              running the canonical solution, which the hub files' test code already embeds.
# The layout is told by its fields (entry_point: HumanEval; test_list: MBPP; else KodCode); every record must then
# have that layout's fields, or DataError names the file, line and field.

HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")  # the Codex paper's stop sequences
MBPP_STOP = ("\nassert ", '\n"""', "\nprint(", "\nif __name__", "\n```")  # what follows a program in MBPP prompts
_REFERENCE = {"kodcode": "solution", "humaneval": "canonical_solution", "mbpp": "code"}


def code_layout(rec: dict) -> str:
    return "humaneval" if "entry_point" in rec else "mbpp" if "test_list" in rec else "kodcode"


def code_problem(
    rec: dict,
    where: str,
    layout: str | None = None,
    need_reference: bool = False,
    prompt_field: str | None = None,
    test_field: str | None = None,
) -> dict:
    """One benchmark record -> {"id"?, "prompt", "test", "reference"} (see above); DataError('where: ...') if a field
    is missing or has the wrong type. need_reference: the reference solution must be there (01 critiques it)."""
    layout = layout or code_layout(rec)

    def get(name, kind=str, required=True):
        if name not in rec or rec[name] is None:
            if required:
                raise DataError(f"{where}: missing field '{name}' ({layout} layout)")
            return kind()
        if not isinstance(rec[name], kind) or (kind is list and not all(isinstance(x, str) for x in rec[name])):
            raise DataError(f"{where}: field '{name}' must be {'a list of strings' if kind is list else 'a string'}")
        return rec[name]

    ref = get(_REFERENCE[layout], required=need_reference) or None
    if layout == "humaneval":
        prompt, entry = get("prompt"), get("entry_point")
        test = {
            "prefix": prompt,
            "script": f"{get('test')}\n\ncheck({entry})\n",
            "entry_point": entry,
            "stop": list(HUMANEVAL_STOP),
        }
    elif layout == "mbpp":
        tests = get("test_list", list)
        prompt = rec["prompt"] if isinstance(rec.get("prompt"), str) else get("text")
        if "assert" not in prompt:  # a bare description (MBPP's text, sanitized MBPP's prompt) names no function
            prompt = f'"""\n{prompt}\n{tests[0] if tests else ""}\n"""\n'
        plus = get("test", required=False)  # MBPP+: the extra tests, as one script
        script = "\n".join(
            get("test_imports", list, False)
            + [get("test_setup_code", required=False)]
            + ([plus] if plus.strip() else tests)
        )
        test = {"prefix": "", "script": script.strip() + "\n", "stop": list(MBPP_STOP)}
    else:
        name = prompt_field or ("question" if "question" in rec or "prompt" not in rec else "prompt")
        prompt, test = get(name), get(test_field or "test")
    out = {"prompt": prompt, "test": test, "reference": ref}
    rid = rec.get("task_id", rec.get("question_id", rec.get("id")))
    return {"id": str(rid), **out} if rid is not None else out


def _fenced(response: str):
    """(code, offset) of the first fenced Python (or untagged) block of `response`, or None."""
    for m in re.finditer(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", response, re.S):
        if m.group(1).lower() in ("", "python", "py", "python3"):
            return m.group(2), m.start(2)
    return None


def extract_code(response: str, test=None) -> tuple[str, int]:
    """(code, offset in `response`) of a completion, post-processed the way the benchmarks' users expect: a chat
    model's first fenced Python block; else, for a benchmark test with stop sequences (a base model continuing the
    prompt), the text before the first stop sequence; else the whole response."""
    fenced = _fenced(response)
    if fenced:
        return fenced
    stops = test.get("stop", ()) if isinstance(test, dict) else ()
    cut = min([i for i in (response.find(s) for s in stops) if i >= 0], default=len(response))
    return response[:cut], 0


def build_program(test, code: str) -> tuple[str, int]:
    """(program, where `code` starts in it): the benchmark's prefix (HumanEval's prompt) followed by the code."""
    prefix = test.get("prefix", "") if isinstance(test, dict) else ""
    if prefix and not prefix.endswith("\n") and not code.startswith((" ", "\t", "\n")):
        prefix += "\n"  # a complete function after the prompt; a continuation goes straight on, as the harness does
    return prefix + code, len(prefix)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k), from n samples with c correct."""
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def _run_one_test(item: dict, timeout_s: float) -> dict:
    """{"id", "response", "test"} -> {"id", "passed", "status", "timed_out", "raw", "program", "output"}: the raw
    completion, the program that ran (post-processed, after the benchmark's prompt) and its verdict."""
    res = run_completion(item["response"], item["test"], timeout_s=timeout_s)
    return {
        "id": item["id"],
        "passed": bool(res["passed"]),
        "status": res["status"],
        "timed_out": res["timed_out"],
        "raw": item["response"],
        "program": res["program"],
        "output": res["output"][-1000:],
    }


def run_tests(items: list[dict], timeout_s: float, workers: int) -> list[dict]:
    """04's test runs: each {"id", "response", "test"} through run_completion, `workers` at a time. Processes, not
    threads: the parse before each run is CPU work under one lock (sandbox.parse_python: CPython 3.11's ast.parse is
    not thread-safe), so threads would take turns."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(functools.partial(_run_one_test, timeout_s=timeout_s), items))


# ----------------------------------------------------------------------------------------------------------------------
# The programmatic critic (01 --annotator program, 03 --critic program): run the tests, name what failed with its
# input, expected and actual value, and quote the lines that are most likely wrong
# ----------------------------------------------------------------------------------------------------------------------

# Where the bug is: a second, traced run makes every assert its own test case and records the solution lines each one
# executes. Spectrum-based fault localisation ranks a line by Ochiai's suspiciousness, failed(line) /
# sqrt(failed_total * executed(line)): a line run by every failing case and few passing ones is most suspicious.
# Ties (straight-line code runs every line in every case) are broken by what the failure shows: the line that raised,
# then lines that decide (a comparison, a condition) or produce the result (a return).


def run_completion(response: str, test, timeout_s: float = 10.0, trace: bool = False) -> dict:
    """A model's raw completion against a problem's tests, post-processed (extract_code) and joined to the benchmark's
    prefix (build_program): what 04 scores and the critic judges. run_tests_sandboxed's dict plus "program"."""
    program = build_program(test, extract_code(response, test)[0])[0]
    return {**run_tests_sandboxed(program, test, timeout_s=timeout_s, trace=trace), "program": program}


def critic(records: list[dict], responses: list[str], timeout_s: float = 10.0) -> list[dict]:
    """code_critic as a plug-in critic (critics/plugin.py): --critic program, or python:tasks.code:critic; each record
    holds its problem's "test" (code_problem). A problem whose tests cannot run is an error item: no annotation, and
    no delta for that response."""
    out = []
    for rec, response in zip(records, responses):
        if "test" not in rec:
            raise ValueError(
                "a prompt without tests: the code critic runs a code benchmark's tests (--prompts in a "
                "layout of tasks/code.py)"
            )
        fb = code_critic(rec["prompt"], response, rec["test"], timeout_s)
        out.append({"error": f"the tests cannot run: {fb['error']}"} if fb.get("error") else fb)
    return out


def _test_failure(output: str) -> dict:
    """The last failure in a test report: {"test", "error", "frames": [(file name, line, function)] oldest first}."""
    tb, dump = output.rfind("Traceback (most recent call last):"), output.rfind("(most recent call first):")
    frames, error = [], ""
    if dump > tb:  # a faulthandler stack dump lists the innermost call first
        frames = TRACEBACK_FRAME.findall(output[dump:].split("\n\n")[0])[::-1]
    elif tb >= 0:
        block = output[tb:].splitlines()[1:]
        frames = TRACEBACK_FRAME.findall("\n".join(block))
        tail = [ln for ln in block if ln.strip() and not ln.startswith(" ")]  # the exception line is not indented
        if tail:
            i = block.index(tail[0])
            explained = [tail[0]] + [ln for ln in block[i + 1 : i + 3] if ln.startswith(" +")]  # pytest's "+ where"
            error = re.sub(r"\s+", " ", " ".join(explained))[:300]
    m = re.search(r"(?:FAILED|ERROR) test_solution\.py::(\S+)", output)
    test = m.group(1) if m else next((fn for f, _, fn in frames[::-1] if f.endswith("test_solution.py")), "")
    return {
        "test": test.split("[")[0],
        "error": error,
        "frames": [(os.path.basename(f), int(n), fn) for f, n, fn in frames],
    }


def _line_ranges(node) -> list[tuple[int, int]]:
    """The (first, last) line ranges that produce a function's result: its returns, else its last statement."""
    returns, stack = [], list(node.body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Return):
            returns.append((n.lineno, n.end_lineno))
        elif not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(n))
    return sorted(returns) or [(node.body[-1].lineno, node.body[-1].end_lineno)]


def _response_lines(program: str, start: int, offset: int) -> dict[int, tuple[str, int, int]]:
    """Program line -> (stripped text, start, end) in the response, for the lines the response wrote (not the
    prefix)."""
    units, pos = {}, 0
    for i, line in enumerate(program.splitlines(keepends=True), 1):
        a, b = max(pos, start), pos + len(line.rstrip("\r\n"))
        body = program[a:b] if b > a else ""
        if body.strip():
            lead = len(body) - len(body.lstrip())
            units[i] = (body.strip(), offset + a - start + lead, offset + a - start + lead + len(body.strip()))
        pos += len(line)
    return units


def _quote_lines(response: str, units: dict, good: list, poor: list) -> tuple[list[str], list[str], list[dict]]:
    """Exact, unambiguous quotes of `response` for (first, last) program line ranges; poor wins over good, 3 each;
    and the ranges no quote can reach (unambiguous_quotes: a line repeated earlier)."""

    def intervals(ranges):
        out = []
        for a, b in ranges:
            lines = [units[n] for n in range(a, b + 1) if n in units]
            if lines and (lines[0][1], lines[-1][2]) not in out:
                out.append((lines[0][1], lines[-1][2]))
        return out

    poor_iv = intervals(poor)[:3]
    good_iv = [iv for iv in intervals(good) if not any(a < iv[1] and iv[0] < b for a, b in poor_iv)][:3]
    return unambiguous_quotes(response, good_iv, poor_iv)


def _suspicious_lines(cases: list[dict], tree, quotable, limit: int = 2) -> list[int]:
    """Up to `limit` quotable lines that are most suspicious by Ochiai over the test cases' line coverage, raising a
    failing case's exception counting as extra evidence; ties go to deciding or result-producing lines, then the first.
    Only the top group is returned: a line ranked below it would more likely be a correct line blamed."""
    import math

    failing = [c for c in cases if not c["ok"]]
    ef, ep = {}, {}
    for c in cases:
        for line in c["covered"]:
            (ep if c["ok"] else ef)[line] = (ep if c["ok"] else ef).get(line, 0) + 1
    raised = {c["where"][-1] for c in failing if c.get("where")}
    rank = {
        n: (round(ef[n] / math.sqrt(len(failing) * (ef[n] + ep.get(n, 0))), 9), n in raised)
        for n in ef
        if n in quotable
    }
    deciding = {
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, (ast.If, ast.While, ast.Return, ast.Compare, ast.IfExp, ast.Assert))
    }
    top = max(rank.values(), default=None)
    return sorted((n for n in rank if rank[n] == top), key=lambda n: (n not in deciding, n))[:limit]


def _case_story(case: dict, show) -> str:
    """What went wrong in one failing test case: the input, what came back and what was expected (or what raised)."""
    call = f"`{case['call']}`" if case.get("call") else "the code"
    if case.get("error"):
        return f"{call} raises {case['error']}" + (f" at {show(case['where'][-1])}" if case.get("where") else "")
    if "expected" in case:
        story = f"it gives assert {case['actual']} {case['op']} {case['expected']}"
        if case.get("call") and case["op"] == "==" and case.get("returned") == case["actual"]:
            return story + f": {call} returns {case['returned']}, expected {case['expected']}"
        return story + (f" ({call} returns {case['returned']})" if case.get("returned") else "")
    return f"{call} returns {case['returned']}" if case.get("returned") else "the assert does not hold"


def code_critic(prompt: str, response: str, test, timeout_s: float = 10.0) -> dict:
    """The code task's programmatic critic: {"critique", "good_spans", "poor_spans", "passed", "status"}, quotes exact
    in `response`; "error" too when the tests themselves cannot run (then no spans: nothing to blame the code for).

    Runs `test` (a KodCode pytest file or a benchmark test, see code_problem) against the completion in the sandbox.
    When tests fail, a traced run localises the fault (above): the critique names the failing assert, its input, the
    expected and the actual value (or the exception) and how many test cases fail; poor spans quote the most suspicious
    lines, or the line a hung test is stuck on, or the line that does not compile. When every test passes, good spans
    quote the tested functions' result lines. `prompt` is unused: the tests are the specification.
    """
    code, offset = extract_code(response, test)
    if not code.strip():
        return {
            "critique": "The response contains no code to test.",
            "good_spans": [],
            "poor_spans": [],
            "passed": False,
            "status": "failed",
        }
    program, start = build_program(test, code)
    units = _response_lines(program, start, offset)
    src, test_src = program.splitlines(), test["script"] if isinstance(test, dict) else test
    line0 = program[:start].count("\n") + 1  # of the response's code; lines before it are the benchmark's prompt

    def show(n: int) -> str:
        text = f" `{src[n - 1].strip()}`" if 0 < n <= len(src) else ""
        return f"line {n - line0 + 1}{text}" if n >= line0 else f"the prompt's{text}"

    verdict = lambda critique, good=(), poor=(), status="failed": {  # noqa: E731
        "critique": critique,
        **dict(zip(("good_spans", "poor_spans", "ambiguous_spans"), _quote_lines(response, units, good, poor))),
        "passed": status == "passed",
        "status": status,
    }
    try:
        tree = parse_python(program)  # one thread at a time: 01 runs the critic from a thread pool
    except SyntaxError as e:
        return verdict(f"The code does not compile: {e.msg} at {show(e.lineno or 1)}.", poor=[(e.lineno or 1,) * 2])
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor))]

    def called(text: str) -> list[str]:  # functions of the solution that a line of test code calls
        return [n for n in dict.fromkeys(re.findall(r"(\w+)\s*\(", text)) if n in defs]

    def loop_of(line: int) -> list[tuple[int, int]]:  # the innermost loop around a line: its header
        around = [n for n in loops if n.lineno <= line <= n.end_lineno]
        return [(max(around, key=lambda n: n.lineno).lineno,) * 2] if around else []

    result = run_completion(response, test, timeout_s)
    if result["status"] == "error":
        return {
            **verdict(f"The tests cannot run: {result['problem_error']}."),
            "status": "error",
            "error": result["problem_error"],
        }
    if result["passed"]:
        tested = (
            [test["entry_point"]] if isinstance(test, dict) and test.get("entry_point") in defs else called(test_src)
        ) or list(defs)[:3]
        n = result["counts"]["passed"] if not isinstance(test, dict) else None
        critique = f"All {f'{n} ' if n else ''}unit tests pass" + (
            f": {', '.join(f'`{t}`' for t in tested[:3])} return{'s' * (len(tested) == 1)} the expected results."
            if tested
            else "."
        )
        return verdict(critique, good=[r for t in tested[:3] for r in _line_ranges(defs[t])], status="passed")
    fail = _test_failure(result["output"])
    where = [n for f, n, _ in fail["frames"] if f == "solution.py"]  # solution lines on the stack, innermost last
    name = f"`{fail['test']}`" if fail["test"] and fail["test"] != "collection" else "Importing the code"
    if result["timed_out"]:
        critique = f"The tests did not finish within {timeout_s:g} s" + (
            f": {name} never gets past {show(where[-1])}, an endless or far too slow loop." if where else "."
        )
        return verdict(critique, poor=(loop_of(where[-1]) + [(where[-1],) * 2]) if where else [], status="timeout")
    if "MemoryError" in fail["error"] or "MemoryError" in result["output"][-500:]:
        critique = (
            f"{name} runs out of memory"
            + (f" at {show(where[-1])}" if where else "")
            + ": the code allocates without bound."
        )
        return verdict(critique, poor=(loop_of(where[-1]) + [(where[-1],) * 2]) if where else [])
    cases = run_completion(response, test, timeout_s, trace=True).get("cases", [])
    failing = [c for c in cases if not c["ok"]]
    if failing:  # the traced run: every assert a case, the fault localised over their coverage
        first, tests = failing[0], test_src.splitlines()
        at = f" at `{tests[first['line'] - 1].strip()}`" if 0 < first["line"] <= len(tests) else ""
        count = f" {len(failing)} of {len(cases)} test cases fail." if len(cases) > 1 else ""
        poor = _suspicious_lines(cases, tree, units)
        if not poor and first.get("error", "").startswith("TypeError") and first.get("call") is None:
            entry = [test["entry_point"]] if isinstance(test, dict) and test.get("entry_point") in defs else []
            funcs = entry + called(tests[first["line"] - 1] if 0 < first["line"] <= len(tests) else "")
            poor = [defs[funcs[0]].lineno] if funcs else []  # the call never entered the function: its signature
        blame = f" The most suspicious line is {show(poor[0])}." if poor else ""
        return verdict(
            f"`{first['test']}` fails{at}: {_case_story(first, show)}.{count}{blame}", poor=[(n, n) for n in poor]
        )
    if where:  # no traced case (e.g. the import itself fails): fall back on the report's traceback
        return verdict(
            f"{name} fails: the code raises {fail['error'] or 'an error'} at {show(where[-1])}.",
            poor=[(where[-1],) * 2],
        )
    tail = result["output"].strip().splitlines()[-1:]
    critique = (
        f"{name} fails with {fail['error']}."
        if fail["error"]
        else f"The tests did not run to completion: the process ended (exit code {result['returncode']}) before "
        "the test runner reported" + (f"; its last output: {tail[0][:200]}" if tail else ".")
    )
    return verdict(critique)
