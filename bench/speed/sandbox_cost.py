"""What the sandbox costs per test run, against the same tests in a plain subprocess.

    python bench/speed/sandbox_cost.py [--runs 20]     # a line per setting, then one JSON line

Both run the same test runner (tasks/sandbox_test_runner.py, the fast in-process runner) on the same passing solution
and KodCode-style test file, from a fresh temp dir, with the same private settings/verdict files:
  plain_s     subprocess.run of the runner: no launcher, no layers
  sandbox_s   tasks.sandbox.run_tests_sandboxed: launcher + supervisor fork, Landlock, capabilities dropped, PID and
              network namespaces, a seccomp socket filter, a pids cgroup (as many as this machine allows; "layers"
              lists them)
  fallback_s  the same with the namespaces off (the subreaper fallback), for machines without them
Times are medians of --runs runs, interleaved so that load drifts hit both alike; ratio = sandbox_s / plain_s.
"""

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tasks import sandbox  # noqa: E402

SOLUTION = "def add(a, b):\n    return a + b\n"
TEST = (
    "from solution import add\n\ndef test_small():\n    assert add(1, 2) == 3\n\ndef test_big():\n"
    "    assert add(20, 22) == 42\n"
)


def plain_run() -> float:
    """The runner as a plain subprocess in a temp dir: what the tests cost without any sandbox layer."""
    with (
        tempfile.TemporaryDirectory() as work,
        tempfile.TemporaryFile() as settings,
        tempfile.TemporaryFile() as verdict,
    ):
        Path(work, "solution.py").write_text(SOLUTION)
        Path(work, "test_solution.py").write_text(TEST)
        settings.write(
            json.dumps(
                {
                    "nonce": secrets.token_hex(16),
                    "result_fd": verdict.fileno(),
                    "style": "pytest",
                    "trace": False,
                    "test": TEST,
                    "max_cases": 500,
                    "entry_point": None,
                }
            ).encode()
        )
        settings.seek(0)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", sandbox._TEST_RUNNER, str(settings.fileno())],
            cwd=work,
            capture_output=True,
            pass_fds=(settings.fileno(), verdict.fileno()),
        )
        took = time.perf_counter() - start
        assert proc.returncode == 0, proc.stderr
    return took


def sandbox_run() -> tuple[float, list[str]]:
    start = time.perf_counter()
    result = sandbox.run_tests_sandboxed(SOLUTION, TEST)
    took = time.perf_counter() - start
    assert result["passed"], result["output"]
    return took, result["sandbox"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    sandbox.sandbox_namespaces(), sandbox.landlock_abi(), sandbox._pids_cgroup_parent()  # probes: once, not timed
    plain, sandboxed, fallback, layers = [], [], [], []
    namespaces = sandbox._NAMESPACES
    for _ in range(args.runs):
        plain.append(plain_run())
        took, layers = sandbox_run()
        sandboxed.append(took)
        if namespaces:
            sandbox._NAMESPACES = 0
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fallback.append(sandbox_run()[0])
            sandbox._NAMESPACES = namespaces
    out = {
        "plain_s": round(statistics.median(plain), 4),
        "sandbox_s": round(statistics.median(sandboxed), 4),
        "fallback_s": round(statistics.median(fallback), 4) if fallback else None,
    }
    out["ratio"] = round(out["sandbox_s"] / out["plain_s"], 2)
    for key in ("plain_s", "sandbox_s", "fallback_s"):
        print(f"{key:11s} {out[key]}")
    print(json.dumps({**out, "runs": args.runs, "layers": layers, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
