"""Every command in the README still runs as written: each `python SCRIPT ...` or `torchrun ... SCRIPT ...` in a fenced
block of README.md (and bench/README.md, baselines/README.md) names a script that exists and accepts its flags. The
flags are parsed by the script's own argparse parser and nothing runs: parse_args is patched to stop the script
once it has parsed them."""
import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT

READMES = [p for p in (ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "baselines" / "README.md")
           if p.is_file()]
PREFIXES = {"taskset": 2, "nice": 2, "nohup": 0, "time": 0, "env": 0}  # wrappers before the command: arguments skipped
KEYWORDS = {"do", "then", "else", "{", "!"}  # shell words that may stand before a command

# In a fresh interpreter, in the repo root: run each script as __main__ with its README arguments until its parser has
# parsed them. Prints, per command, "ok" or what went wrong (argparse's own message).
RUNNER = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(BaseException):
    pass

parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_and_stop

out = []
for script, args in json.loads(sys.argv[1]):
    sys.argv, err = [script, *args], io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        out.append("it ran to the end without parsing its arguments")
    except Parsed:
        out.append("ok")
    except SystemExit as e:
        out.append(f"exit {e.code}: {err.getvalue().strip()[-600:]}")
print(json.dumps(out))
"""


def readme_commands(markdown: str) -> list[tuple[str, list[str]]]:
    """(script, arguments) of each python or torchrun command in the fenced code blocks of a markdown text: line
    continuations joined, comments dropped, commands split at && ; & |, environment assignments, wrappers
    (taskset -c N, nice -n N) and shell keywords (do, then) skipped, redirections (> FILE, 2>&1) dropped, a loop
    variable ($s of `for s in 1 2 3`) read as its first value, `python -m MODULE` left out, and an optional part
    written [--flag VALUE] taken as given."""
    found, loop_values = [], {}
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.S | re.M):
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
                segment = [re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: loop_values.get(m[1], m[0]), t)
                           for t in segment]
                redirect = next((i for i, t in enumerate(segment) if re.match(r"\d*[<>]", t)), len(segment))
                segment = segment[:redirect]
                while segment and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]) or segment[0] in PREFIXES
                                   or segment[0] in KEYWORDS):
                    segment = segment[1 + PREFIXES.get(segment[0], 0):]
                if segment and re.fullmatch(r"python3?|torchrun", segment[0]) and "-m" not in segment[1:2]:
                    script = next((i for i, t in enumerate(segment) if t.endswith(".py")), None)
                    if script is not None:
                        args = [t.strip("[]") if t.startswith("[") or t.endswith("]") else t  # "" stays ""
                                for t in segment[script + 1:] if t not in ("[", "]")]
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
        proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([commands[i] for i in to_parse])], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
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
taskset -c 0 python bench/real_critic.py --threads 1 --only 1 &
wait; python bench/real_critic.py --only 3
python 01_annotate.py && python 02_train_reward.py --resume && torchrun --nproc_per_node 8 03_train_policy.py --steps 2
python bench/sandbox_cost.py [--runs 40]
python 04_evaluate.py --judge-base-url https://api.openai.com/v1 --curves "a b=x.jsonl" --x ""
for s in 7 8; do python bench/real_critic.py --only $s > "log_$s.txt" 2>&1 & done
```
```
post: python is not a command here
```
"""
    assert readme_commands(markdown) == [
        ("01_annotate.py", []), ("01_annotate.py", ["--task", "summarization", "--annotator", "openai"]),
        ("bench/real_critic.py", ["--threads", "1", "--only", "1"]), ("bench/real_critic.py", ["--only", "3"]),
        ("01_annotate.py", []), ("02_train_reward.py", ["--resume"]), ("03_train_policy.py", ["--steps", "2"]),
        ("bench/sandbox_cost.py", ["--runs", "40"]),
        ("04_evaluate.py", ["--judge-base-url", "https://api.openai.com/v1", "--curves", "a b=x.jsonl", "--x", ""]),
        ("bench/real_critic.py", ["--only", "7"])]


def test_a_wrong_flag_or_script_is_caught():
    verdicts = check([("03_train_policy.py", ["--reward-mode", "span", "--steps", "3"]),
                      ("03_train_policy.py", ["--reward-mode", "spans"]), ("03_train_policy.py", ["--no-such-flag"]),
                      ("05_missing.py", []), ("tools/smollm2.py", ["runs/smollm2"]),
                      ("tools/smollm2.py", ["--out", "x"])])
    assert verdicts[0] == "ok" and verdicts[4] == "ok"
    assert verdicts[1].startswith("exit 2") and "invalid choice: 'spans'" in verdicts[1]
    assert verdicts[2].startswith("exit 2") and "unrecognized arguments: --no-such-flag" in verdicts[2]
    assert verdicts[3] == "05_missing.py: no such script"
    assert "no flags" in verdicts[5]


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(ROOT)) for p in READMES])
def test_every_readme_command_accepts_its_flags(readme):
    commands = readme_commands(readme.read_text(encoding="utf-8"))
    assert len(commands) >= 3  # the extraction found the README's commands
    wrong = [f"{script} {shlex.join(args)}: {verdict}" for (script, args), verdict in zip(commands, check(commands))
             if verdict != "ok"]
    assert not wrong, "\n".join(wrong)
