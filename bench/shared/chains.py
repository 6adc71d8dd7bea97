"""The four-stage chain in a folder of its own, as demo_seeds.py and real_critic.py run it: each stage with --seed S and
OMP_NUM_THREADS=T (run_chain, keyed by run_cache), and the table of a metric's median [min, max] over chains."""

import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_cache import check_settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STAGES = [(script, []) for script in ("01_annotate.py", "02_train_reward.py", "03_train_policy.py", "04_evaluate.py")]
POLICIES = ["sft", "scalar", "text2grad"]


def chain_settings(seed: int, threads: int, stages) -> dict:
    """What makes a chain: its stages' command lines, the seed and the thread count (its key in run_cache)."""
    return {"stages": [[script, *extra] for script, extra in stages], "seed": seed, "threads": threads}


def stage_env(threads: int) -> dict:
    """A stage's environment: this one, OMP_NUM_THREADS=T, and the repo put in front of PYTHONPATH (kept: packages
    installed with pip install --target DIR and PYTHONPATH=DIR, as on a GPU machine, must reach every stage)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}


def run_chain(work: Path, seed: int, threads: int, stages=STAGES, rm_dir: str = "runs/demo/reward_model") -> dict:
    """Run `stages` [(script, extra flags)] in `work`, each with --seed S and OMP_NUM_THREADS=T, unless results.json
    is there already; a stage that timing.json records as finished (an interrupted run) is not run again. A `work`
    that other stages, another seed or thread count made is refused (run_cache). Returns results.json plus the seconds
    per stage and the reward model's eval.json (rm_dir, relative to `work`)."""
    check_settings(work, chain_settings(seed, threads, stages))
    results = work / "runs" / "demo" / "results.json"
    timing = work / "timing.json"
    if not results.is_file():
        work.mkdir(parents=True, exist_ok=True)
        env = stage_env(threads)
        times = json.loads(timing.read_text()) if timing.is_file() else {}  # stages done by an interrupted run
        for i, (script, extra) in enumerate(stages):
            key = f"{i + 1}. {script}"
            if key in times:
                continue
            t0 = time.time()
            print(f"+ [{work.name}] python {script} --seed {seed} {' '.join(extra)}", flush=True)
            with open(work / f"{i + 1}_{script}.log", "w") as log:
                subprocess.run(
                    [sys.executable, "-u", str(ROOT / script), "--seed", str(seed), *extra],
                    cwd=work,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=True,
                )
            times[key] = round(time.time() - t0, 1)
            timing.write_text(json.dumps(times))
    out = json.loads(results.read_text())
    out["timing"] = json.loads(timing.read_text()) if timing.is_file() else {}
    out["rm_eval"] = json.loads((work / rm_dir / "eval.json").read_text())
    return out


def value(r: dict, pol: str, key: str):
    return r["policies"][pol]["metrics"][key]["value"]


def summary_table(runs: list[dict], keys: dict[str, str], policies=POLICIES) -> dict:
    """Print "median [min, max]" over runs of each metric (rows) for each policy (columns); return them as a dict."""
    print(f"\n{'metric (median [min, max] over runs)':<48}" + "".join(f"{p:>24}" for p in policies))
    summary = {}
    for key, label in keys.items():
        cells = []
        for pol in policies:
            vals = [v for r in runs if (v := value(r, pol, key)) is not None]  # None: nothing to count (0 / 0)
            summary[f"{pol}/{key}"] = (
                {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
                if vals
                else None
            )
            cells.append(f"{statistics.median(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}]" if vals else "n/a")
        print(f"{label:<48}" + "".join(f"{c:>24}" for c in cells))
    return summary


def packages() -> dict:
    return {p: version(p) for p in ("torch", "transformers", "peft", "tokenizers", "numpy")}
