"""The demo's shared start and its PPO runs, as the benches build them (span_vs_scalar.py, ablations.py, locality.py,
paper_baselines.py, the credit studies, real_critic.py): the demo base model, prompts and SFT start built once in an
out dir (shared_start), one 03 run from it (ppo_run), scripts run from the repository root (run, run_side_by_side),
and the measure every bench reads off a training curve: steps to a mistake rate, smoothed over WINDOW iterations,
<= THRESHOLD (fixed before any run: 0.15)."""

import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from infra import reward_models  # noqa: E402
from run_cache import check_settings  # noqa: E402
from infra.tiny_model import build_demo_base  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

THRESHOLD, WINDOW = 0.15, 10


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run([sys.executable, "-u", *cmd], cwd=ROOT, check=True)


def run_side_by_side(cmds: dict, jobs: int, logs: Path) -> None:
    """{name: a script's argv} run like run(), at most `jobs` at a time, each one's output in LOGS/NAME.log; exits
    naming the failed ones' logs. Each process gets its share of the cores (OMP_NUM_THREADS) unless the environment
    sets it: N torch processes with a thread per core each would thrash."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    if jobs <= 1:
        for cmd in cmds.values():
            run(cmd)
        return
    import os

    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs)), **os.environ, "PYTHONUNBUFFERED": "1"}
    logs.mkdir(parents=True, exist_ok=True)

    def launch(name, cmd):
        print(f"+ {' '.join(cmd)}  (log: {logs / name}.log)", flush=True)
        with open(logs / f"{name}.log", "w") as f:
            return subprocess.run(
                [sys.executable, "-u", *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env
            ).returncode

    with ThreadPoolExecutor(jobs) as pool:  # threads only wait: each command is its own process
        futures = {pool.submit(launch, name, cmd): name for name, cmd in cmds.items()}
        failed = []
        for done, future in enumerate(as_completed(futures), 1):
            failed += [futures[future]] if future.result() else []
            print(f"{done}/{len(futures)} done: {futures[future]}{' FAILED' if future.result() else ''}", flush=True)
    if failed:
        sys.exit(f"{len(failed)} of {len(cmds)} failed: " + "; ".join(f"{n} (its log: {logs / n}.log)" for n in failed))


def smoothed(xs, w=WINDOW):
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def steps_to_threshold(mistakes: list[float]) -> int | None:
    """The first iteration (from 1) whose mistake rate, smoothed over WINDOW iterations, is <= THRESHOLD; None if
    none is."""
    return next((i + 1 for i, x in enumerate(smoothed(mistakes)) if i + 1 >= WINDOW and x <= THRESHOLD), None)


def shared_start(
    out: Path, critic: str, reward_model: str | None, steps: int, ppo_args: list[str], pets: int = 1
) -> list[str]:
    """The start every run shares, built once in `out`: the demo base model, prompts, the SFT warm start (03 with
    --steps 0 trains and saves it) and, for critic "local" without reward_model, stages 1 and 2 at their zero-flag
    settings on this base. Each is keyed by the commands that made it (run_cache). Returns 03's flags for every run
    (critic, prompts, steps). pets: the demo world's K (tasks/demo.py), 1 as the demo is."""
    if not (out / "base" / "config.json").is_file():
        build_demo_base(out / "base", pets=pets)
    common.write_jsonl(out / "prompts.jsonl", demo_dataset("train", 1000, pets=pets))
    common.write_jsonl(out / "sft.jsonl", demo_dataset("sft", 2000, pets=pets))
    flags = ["--critic", "program", "--kl-coef", "0.05"]  # the exact critic cannot be gamed: a looser KL leash
    if critic == "local":  # stages 1 and 2 at their zero-flag settings, on this base model (or --reward-model)
        rm_dir = Path(reward_model).resolve() if reward_model else out / "reward_model"
        if reward_model:
            reward_models.check_reward_model(str(rm_dir))
        else:
            stages = [
                ["01_annotate.py", "--output", str(out / "annotations.jsonl"), "--demo-dir", str(out)],
                [
                    "02_train_reward.py",
                    "--data",
                    str(out / "annotations.jsonl"),
                    "--model",
                    str(out / "base"),
                    "--output-dir",
                    str(rm_dir),
                ],
            ]
            check_settings(rm_dir, {"commands": stages})
            for cmd in stages if not (rm_dir / "reward_model.json").is_file() else ():
                run(cmd)
        flags = ["--critic", "local", "--reward-model", str(rm_dir)]  # and the demo's own KL setting
    flags += ["--prompts", str(out / "prompts.jsonl"), "--scalar-baseline-dir", ""]
    # the SFT start depends on neither the critic nor --steps: both critics of one --out share it
    sft = [
        "03_train_policy.py",
        "--model",
        str(out / "base"),
        "--sft-data",
        str(out / "sft.jsonl"),
        "--sft-output-dir",
        str(out / "sft"),
        "--critic",
        "program",
        "--prompts",
        str(out / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        *ppo_args,
        "--steps",
        "0",
        "--output-dir",
        str(out / "sft_only"),
    ]
    check_settings(out / "sft", {"argv": sft})
    if not (out / "sft" / "config.json").is_file():
        run([*sft, "--overwrite"])
    return [*flags, "--steps", str(steps), "--save-every", str(steps), *ppo_args]


def ppo_command(out: Path, run_dir: Path, seed: int, flags: list[str]) -> list[str]:
    """03's command line for one PPO run from the shared SFT start."""
    return [
        "03_train_policy.py",
        "--model",
        str(out / "sft"),
        "--sft-steps",
        "0",
        "--seed",
        str(seed),
        "--output-dir",
        str(run_dir),
        *flags,
    ]


def ppo_run(out: Path, run_dir: Path, seed: int, steps: int, flags: list[str]) -> dict:
    """One PPO run from the shared SFT start (skipped when run_dir already holds `steps` iterations of the very same
    command, refused when it holds a run of another: run_cache): its curves as judged by the exact critic on its own
    rollouts (03's exact/* monitor), its KL and response length."""
    cmd, metrics = ppo_command(out, run_dir, seed, flags), run_dir / "metrics.jsonl"
    check_settings(run_dir, {"argv": cmd})
    if not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        run([*cmd, "--overwrite"])  # an unfinished run of this command: started again
    rows = common.read_jsonl(metrics)[:steps]
    return {
        "mistakes": [r["exact/mistake_rate"] for r in rows],
        "reward": [r["exact/span_reward"] for r in rows],
        "kl": [r["objective/kl"] for r in rows],
        "length": [r["response/length"] for r in rows],
    }
