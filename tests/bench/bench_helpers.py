"""What the bench tests share (tests/bench/): os.environ restored after each test, a run's metrics.jsonl written by
hand, a stub that fails when a cached run would be run again, and the bench folders put on sys.path."""

import os
import sys

import pytest
from conftest import ROOT

import common

BENCH = ROOT / "bench"


def bench_path(*studies: str) -> None:
    """bench/shared and these studies' folders first on sys.path, as `python bench/<study>/<script>.py` has them."""
    sys.path[:0] = [str(BENCH / s) for s in (*studies, "shared") if str(BENCH / s) not in sys.path]


@pytest.fixture(autouse=True)
def environ_restored():
    """os.environ as it was before each test: credit.one_thread pins OMP_NUM_THREADS and MKL_NUM_THREADS for the
    bench's own process, and in a test worker that outlived the test, sending every later stage run of the worker to
    a fresh interpreter (tests/forkserver.py: a variable read at import that differs from the fork server's)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _metrics(run_dir, n):
    common.write_jsonl(
        run_dir / "metrics.jsonl",
        [
            {
                "step": i + 1,
                "exact/mistake_rate": 0.5,
                "exact/span_reward": 1.0,
                "objective/kl": 0.0,
                "response/length": 9.0,
            }
            for i in range(n)
        ],
    )


def _never(*a, **k):
    raise AssertionError("a cached run must not be run again")
