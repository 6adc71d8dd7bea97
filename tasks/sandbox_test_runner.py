"""The sandbox's test runner (tasks/sandbox.py): runs a solution's tests and reports the verdict on a private
channel.

Not imported: run_tests_sandboxed reads this file and runs its text inside the sandbox with
`python -c TEXT SETTINGS_FD`, so the sandboxed process needs no read access to the checkout. Its styles and its
verdict channel are described above run_tests_sandboxed.
"""

import faulthandler
import os
import signal

faulthandler.register(signal.SIGUSR1, file=os.fdopen(os.dup(2), "w"))
import ast
import importlib.util
import json
import sys
import time
import traceback
import types


def main(write=os.write, dumps=json.dumps, clock=time.perf_counter, settrace=sys.settrace):
    start = clock()
    with os.fdopen(int(sys.argv[1]), "rb") as f:  # the private settings: read, then closed
        cfg = json.loads(f.read())
    nonce, out_fd, style, trace, test_src = cfg["nonce"], cfg["result_fd"], cfg["style"], cfg["trace"], cfg["test"]
    sol_path, test_path = os.path.abspath("solution.py"), os.path.abspath("test_solution.py")
    counts = {"passed": 0, "failed": 0, "errors": 0}

    def emit(kind, payload):  # payload -> JSON: only localisation hints and messages go this way, never the verdict
        write(out_fd, ('{"nonce": "' + nonce + '", "' + kind + '": ' + dumps(payload, default=repr) + "}\n").encode())

    def finish():  # the verdict: three ints formatted by hand (nothing the code could patch), then exit
        p, f, e = counts["passed"], counts["failed"], counts["errors"]
        write(
            out_fd,
            ('{"nonce": "' + nonce + f'", "summary": {{"passed": {p}, "failed": {f}, "errors": {e}}}}}\n').encode(),
        )
        print(
            ", ".join([f"{n} {w}" for n, w in ((f, "failed"), (p, "passed"), (e, "error")) if n] or ["no tests ran"])
            + f" in {clock() - start:.2f}s",
            flush=True,
        )
        os._exit(1 if f else 2 if e else 0 if p else 5)

    # 1. the tests themselves must compile and find their imports, or the problem (not the solution) is broken
    try:
        tree = ast.parse(test_src, test_path)
    except SyntaxError as e:
        emit("problem_error", f"the tests do not compile: {e.msg} (line {e.lineno})")
        os._exit(3)
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        for name in names:
            top = name.split(".")[0]
            if top not in ("solution", "test_solution") and importlib.util.find_spec(top) is None:
                emit("problem_error", f"the tests import {top!r}, which is not installed")
                os._exit(3)

    # 2. trace mode: line coverage of the solution and the tests' calls into it, per test case
    state = {"lines": set(), "call": None, "returned": None, "cases": 0}
    entry = cfg.get("entry_point")

    def show(v, n=120):
        try:
            t = repr(v)
        except Exception:
            t = "<unprintable>"
        return t if len(t) <= n else t[:n] + "..."

    def on_call(frame, event, arg):
        if frame.f_code.co_filename != sol_path:
            return None
        back, first = frame.f_back, None
        if (
            state["call"] is None
            and back is not None
            and back.f_code.co_filename == test_path
            and (entry is None or frame.f_code.co_name == entry)
        ):
            code = frame.f_code
            n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
            args = ", ".join(show(frame.f_locals.get(a), 80) for a in code.co_varnames[:n])
            state["call"], first = f"{code.co_name}({args})", frame

        def on_line(frame, event, arg):
            if event == "line":
                state["lines"].add(frame.f_lineno)
            elif event == "return" and frame is first:
                state["returned"] = show(arg, 200)
            return on_line

        return on_line

    def solution_lines(tb):  # the solution's lines on a traceback, innermost last
        return [f.lineno for f in traceback.extract_tb(tb) if f.filename == sol_path]

    def case(line, ok, exc=None, parts=None, test=None):  # one test case ends: report it with its coverage
        if ok:
            counts["passed"] += 1
        else:
            counts["failed"] += 1
        rec = {
            "test": test or state["test"],
            "line": line,
            "ok": bool(ok),
            "covered": sorted(state["lines"]),
            "call": state["call"],
            "returned": state["returned"],
        }
        if exc is not None:
            rec.update(error=f"{type(exc).__name__}: {exc}"[:300], where=solution_lines(exc.__traceback__))
        elif not ok and parts is not None:
            rec.update(actual=show(parts[0], 200), op=parts[1], expected=show(parts[2], 200)) if len(
                parts
            ) == 3 else rec.update(value=show(parts[0], 200))
        emit("case", rec)
        state.update(lines=set(), call=None, returned=None, cases=state["cases"] + 1)
        if state["cases"] >= cfg["max_cases"]:
            raise Stop

    class Stop(BaseException):
        pass

    # 3. asserts: explained like pytest's rewriting (assert 3 == 4); in trace mode, each one a test case that does
    #    not stop the test (asserts inside a try block keep their meaning)
    ops = {
        ast.Eq: "==",
        ast.NotEq: "!=",
        ast.Lt: "<",
        ast.LtE: "<=",
        ast.Gt: ">",
        ast.GtE: ">=",
        ast.Is: "is",
        ast.IsNot: "is not",
        ast.In: "in",
        ast.NotIn: "not in",
    }

    def explain(*parts):
        return "assert " + (
            show(parts[0], 200) if len(parts) == 1 else f"{show(parts[0], 200)} {parts[1]} {show(parts[2], 200)}"
        )

    class Rewrite(ast.NodeTransformer):
        def visit_Try(self, node):
            return node  # an assert inside try/except may be expected to fail: leave the whole block alone

        visit_TryStar = visit_Try

        def visit_Assert(self, node):
            if node.msg is not None and not trace:
                return node
            var, t = (lambda n, ctx=ast.Load: ast.Name(f"_t2g_{n}", ctx())), node.test
            call = lambda f, *args: ast.Call(ast.Name(f, ast.Load()), list(args), [])  # noqa: E731
            if isinstance(t, ast.Compare) and len(t.ops) == 1:
                parts = [var("l"), ast.Constant(ops[type(t.ops[0])]), var("r")]
                body = [ast.Assign([var("l", ast.Store)], t.left), ast.Assign([var("r", ast.Store)], t.comparators[0])]
                cond = ast.Compare(var("l"), t.ops, [var("r")])
            else:
                parts, body, cond = [var("v")], [ast.Assign([var("v", ast.Store)], t)], var("v")
            if not trace:
                body.append(ast.Assert(cond, call("_t2g_explain", *parts)))
            else:  # try: <evaluate>; ok = not not cond / except Exception as e: case(e) / else: case(ok)
                ok = ast.UnaryOp(ast.Not(), ast.UnaryOp(ast.Not(), cond))
                body.append(ast.Assign([var("ok", ast.Store)], ok))
                line = ast.Constant(node.lineno)
                failed = ast.Expr(call("_t2g_case", line, ast.Constant(False), var("e")))
                passed = ast.Expr(call("_t2g_case", line, var("ok"), ast.Constant(None), ast.Tuple(parts, ast.Load())))
                body = [
                    ast.Try(
                        body, [ast.ExceptHandler(ast.Name("Exception", ast.Load()), "_t2g_e", [failed])], [passed], []
                    )
                ]
            return [ast.copy_location(s, node) for s in body]

    def report(tag, name, exc):
        print(f"{tag} test_solution.py::{name}")
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # hide the runner's own frames
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb, file=sys.stdout)

    def fail_test(name, exc):  # a test (or the collection) raised outside any assert
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == test_path]
        if trace and not isinstance(exc, Stop):
            state["test"] = name
            case(frames[-1].lineno if frames else 0, False, exc)
        else:
            counts["failed"] += 1
        report("FAILED" if name != "collection" else "ERROR", name, exc)

    def run(name, fn):  # one test function: True if the run goes on
        state.update(test=name, lines=set(), call=None, returned=None)
        try:
            fn()
        except Stop:
            return False
        except BaseException as e:  # SystemExit and KeyboardInterrupt raised by the code count as failures too
            try:
                fail_test(name, e)
            except Stop:
                return False
            return trace
        if not trace:
            counts["passed"] += 1
        return True

    helpers = {"_t2g_explain": explain, "_t2g_case": case}
    code = compile(ast.fix_missing_locations(Rewrite().visit(tree)), test_path, "exec")
    if trace:
        settrace(on_call)

    if style == "pytest-real":
        import pytest

        class Plugin:
            def pytest_runtest_logreport(self, report):  # in trace mode, the cases count instead
                if not trace and report.when == "call" and report.passed:
                    counts["passed"] += 1
                elif not trace and report.failed:
                    counts["failed"] += 1

            def pytest_collectreport(self, report):
                if report.failed:
                    counts["failed"] += 1

            if trace:

                @pytest.hookimpl(hookwrapper=True)
                def pytest_runtest_call(self, item):
                    state.update(test=item.name, lines=set(), call=None, returned=None)
                    outcome = yield
                    exc = outcome.excinfo[1] if outcome.excinfo else None
                    frames = (
                        [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == test_path] if exc else []
                    )
                    case(frames[-1].lineno if frames else 0, exc is None, exc)

        args = ["-q", "--tb=native", "-p", "no:cacheprovider"] + ([] if trace else ["-x"]) + ["test_solution.py"]
        try:
            pytest.main(args, plugins=[Plugin()])
        except Stop:
            pass
        settrace(None)
        finish()

    if style == "script":  # the solution is module "solution"; the tests then run in its namespace
        mod = types.ModuleType("solution")
        mod.__file__ = sol_path
        sys.modules["solution"] = mod
        state["test"] = "check"
        try:
            exec(compile(open(sol_path, encoding="utf-8").read(), sol_path, "exec"), mod.__dict__)
        except BaseException as e:
            fail_test("collection", e)
            settrace(None)
            finish()
        mod.__dict__.update(helpers)
        run("check", lambda: exec(code, mod.__dict__))
        settrace(None)
        finish()

    mod = types.ModuleType("test_solution")  # style "pytest": collect test_* functions and Test* classes
    mod.__file__, sys.modules["test_solution"] = test_path, mod
    mod.__dict__.update(helpers)
    try:
        exec(code, mod.__dict__)
    except BaseException as e:
        fail_test("collection", e)
        settrace(None)
        finish()
    tests = []
    for name, obj in list(vars(mod).items()):
        if name.startswith("test") and isinstance(obj, types.FunctionType):
            tests.append((name, obj))
        elif name.startswith("Test") and isinstance(obj, type):
            tests += [
                (f"{name}::{m}", lambda c=obj, m=m: getattr(c(), m)())
                for m, f in vars(obj).items()
                if m.startswith("test") and callable(f)
            ]
    for name, fn in tests:
        if not run(name, fn):
            break
    settrace(None)
    finish()


main()
