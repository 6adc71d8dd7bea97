"""Seconds per PPO iteration: 03_train_policy.py against TRL 0.11.4's PPOTrainer, same workload, interleaved.

    python bench/speed/vs_trl.py                     # first run builds bench/out/trl-venv from PyPI (~1 min), then ~3 min
    python bench/speed/vs_trl.py --iterations 40 --threads 1

TRL 0.11.4 is the last TRL with the classic PPOTrainer.step (later releases dropped it); it runs in its own virtual
environment, bench/out/trl-venv (git-ignored), with its pinned stack: torch 2.13.0 (CPU wheel, installed first),
transformers 4.46.3, accelerate 1.0.1, datasets 3.0.2 (+ rich, which trl imports but does not declare). The project's
own environment and requirements are never touched.

The workload, the same on both sides: the demo base model (tasks.demo.build_demo_base: a 2-layer Llama, hidden 128, 4
heads, FFN 512, vocabulary 640, tied embeddings, 0.6M parameters), full fine-tuning with a frozen reference copy,
fp32, batch 16, 16-token prompts, 32 new tokens forced (min = max = 32, temperature 1, no top-k), the demo's exact
program critic, 1 PPO epoch of 4 minibatches, gradient clipping at 1.0, `--threads` torch threads.
  - ours: one iteration of 03_train_policy.train (rollout, critic, old log-probs / values / reference log-probs,
    rewards, GAE, PPO update, logging) = its `time/step_s`; span rewards (Text2Grad).
  - TRL: `PPOTrainer.generate` + the same critic, its Σδ as the scalar score (TRL has no per-token reward) +
    `PPOTrainer.step`. Its generate is timed twice per iteration: as TRL's examples call it (its default batch_size=4,
    so 4 sequential generate calls: trl_default_generate_s, ratio_vs_trl_default_generate) and handed the whole batch
    in one call (trl_s, ratio: the stricter comparison); the rollouts of the second feed the step.
The two alternate iteration by iteration: TRL runs in a worker process that does one iteration each time 03 has
finished one (03 is paused in between, at its checkpoint hook), so both see the same machine load. The first
`--warmup` iterations of each side are dropped; the figures are medians, with each side's phases (generate_s,
critic_s, forward_s = old/reference log-probs and values, update_s = the PPO epochs). Prints one JSON object last.
"""

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "bench" / "out" / "trl-venv"
TRL_STACK = ["trl==0.11.4", "transformers==4.46.3", "accelerate==1.0.1", "datasets==3.0.2", "rich"]
BATCH, PROMPT_TOKENS, NEW_TOKENS, MINIBATCHES, LR, KL_COEF = 16, 16, 32, 4, 1e-5, 0.1


def venv_python() -> Path:
    """The TRL environment's python, created on first use: torch first (the CPU wheel), then TRL's stack."""
    python = VENV / "bin" / "python"
    marker = VENV / "stack.json"
    if marker.is_file() and json.loads(marker.read_text()) == TRL_STACK and python.is_file():
        return python
    print(f"building {VENV} (TRL 0.11.4 and its stack, from the package index)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)  # first: an unpinned torch pulls GBs of CUDA wheels
    subprocess.run(pip + TRL_STACK, check=True)
    marker.write_text(json.dumps(TRL_STACK))
    return python


# ----------------------------------------------------------------------------------------------------------------------
# The TRL side: a worker in the TRL environment; one iteration per "step" line on stdin, one JSON line back
# ----------------------------------------------------------------------------------------------------------------------


def trl_worker(base: str, prompts_file: str, threads: int, seed: int) -> None:
    import numpy as np
    import torch
    from transformers import PreTrainedTokenizerFast
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    sys.path.insert(0, str(ROOT))
    import common  # stdlib only at import: runs in this environment too
    from tasks.demo import demo_critic

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    # transformers 4.46 does not know the tokenizer class name that 5.x writes; the tokenizer file itself is the same
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(base) / "tokenizer.json"), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(base)
    config = PPOConfig(
        batch_size=BATCH,
        mini_batch_size=BATCH // MINIBATCHES,
        gradient_accumulation_steps=1,
        ppo_epochs=1,
        learning_rate=LR,
        init_kl_coef=KL_COEF,
        adap_kl_ctrl=False,
        max_grad_norm=1.0,
        seed=seed,
        log_with=None,
    )
    trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tok)  # ref_model=None: TRL makes a frozen copy
    records = [json.loads(line) for line in Path(prompts_file).read_text().splitlines()]
    gen = dict(
        min_new_tokens=NEW_TOKENS,
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    rng = np.random.default_rng(seed)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        batch = [records[i] for i in rng.choice(len(records), BATCH, replace=False)]
        queries = [torch.tensor(r["ids"]) for r in batch]
        t = time.perf_counter()
        trainer.generate(queries, return_prompt=False, **gen)  # TRL's default: batches of 4, as its examples run
        t0 = time.perf_counter()
        responses = trainer.generate(queries, batch_size=BATCH, return_prompt=False, **gen)  # the whole batch at once
        t1 = time.perf_counter()
        scores = []
        for r, resp in zip(batch, responses):
            text, offsets = common.decode_with_offsets(tok, resp.tolist())
            fb = demo_critic(r["prompt"], text)
            scores.append(torch.tensor(sum(common.span_rewards(text, offsets, fb["good_spans"], fb["poor_spans"])[0])))
        t2 = time.perf_counter()
        stats = trainer.step(queries, responses, scores)
        t3 = time.perf_counter()
        print(
            json.dumps(
                {
                    "step_s": t3 - t0,
                    "generate_s": t1 - t0,
                    "default_generate_s": t0 - t,
                    "default_step_s": t3 - t2 + t2 - t1 + t0 - t,
                    "critic_s": t2 - t1,
                    "ppo_s": t3 - t2,
                    "forward_s": stats["time/ppo/forward_pass"],
                    "update_s": stats["time/ppo/optimize_step"],
                    "new_tokens": sum(len(r) for r in responses) / BATCH,
                }
            ),
            flush=True,
        )


# ----------------------------------------------------------------------------------------------------------------------
# The workload of our side, shared with bench/speed/rollout_speed.py
# ----------------------------------------------------------------------------------------------------------------------


def write_prompts(base: str, out: Path) -> Path:
    """The same 256 demo prompts for both sides: out/prompts.jsonl for 03 (which keeps their last 16 tokens,
    --max-prompt-tokens), out/trl_prompts.jsonl with those 16 token ids for the TRL worker. Returns the first."""
    from transformers import AutoTokenizer

    import common
    from infra import models
    from tasks.demo import demo_dataset

    records = demo_dataset("train", 256)
    common.write_jsonl(Path(out) / "prompts.jsonl", records)
    tok = AutoTokenizer.from_pretrained(base)
    common.write_jsonl(
        Path(out) / "trl_prompts.jsonl",
        [{"prompt": r["prompt"], "ids": models.encode_prompt(tok, r["prompt"])[-PROMPT_TOKENS:]} for r in records],
    )
    return Path(out) / "prompts.jsonl"


def ours_argv(base: str, prompts, iterations: int, seed: int, output_dir) -> list[str]:
    """03_train_policy.py's flags for the workload (module docstring); --save-every 1 calls the hook each iteration."""
    return [
        "--model",
        base,
        "--prompts",
        str(prompts),
        "--critic",
        "program",
        "--steps",
        str(iterations),
        "--sft-steps",
        "0",
        "--scalar-baseline-dir",
        "",
        "--batch-size",
        str(BATCH),
        "--max-prompt-tokens",
        str(PROMPT_TOKENS),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--min-new-tokens",
        str(NEW_TOKENS),
        "--ppo-epochs",
        "1",
        "--num-minibatches",
        str(MINIBATCHES),
        "--lora-r",
        "0",
        "--lr",
        str(LR),
        "--kl-coef",
        str(KL_COEF),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--seed",
        str(seed),
        "--save-every",
        "1",
        "--log-every",
        "1000000",
        "--output-dir",
        str(output_dir),
        "--overwrite",
    ]  # throwaway timing runs


# ----------------------------------------------------------------------------------------------------------------------
# The driver: 03's train() in this process, the TRL worker stepped from 03's per-iteration checkpoint hook
# ----------------------------------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=20, help="PPO iterations per side")
    p.add_argument("--warmup", type=int, default=2, help="first iterations of each side that are not counted")
    p.add_argument("--threads", type=int, default=2, help="torch threads on each side")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="bench/out/vs_trl", help="work dir")
    p.add_argument("--base", default="bench/out/span_vs_scalar/base", help="the demo base model (built if missing)")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(args.base, str(Path(args.out) / "trl_prompts.jsonl"), args.threads, args.seed)
        return

    python = venv_python()
    sys.path.insert(0, str(ROOT))
    import torch

    import common
    from infra import runs
    from infra.tiny_model import build_demo_base

    ppo = importlib.import_module("03_train_policy")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if not (Path(args.base) / "config.json").is_file():
        build_demo_base(args.base)
    write_prompts(args.base, out)

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    log = open(out / "trl_worker.log", "w")
    worker = subprocess.Popen(
        [
            str(python),
            __file__,
            "--trl-worker",
            "--base",
            args.base,
            "--out",
            str(out),
            "--threads",
            str(args.threads),
            "--seed",
            str(args.seed),
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    trl_rows = []

    def trl_step():
        worker.stdin.write("step\n")
        worker.stdin.flush()
        reply = worker.stdout.readline()
        if not reply:
            sys.exit(f"the TRL worker died; see {out / 'trl_worker.log'}")
        trl_rows.append(json.loads(reply))

    try:
        if not json.loads(worker.stdout.readline() or "{}").get("ready"):
            sys.exit(f"the TRL worker did not start; see {out / 'trl_worker.log'}")
        real_save = runs.save_checkpoint
        # 03 calls save_checkpoint at the end of every iteration (--save-every 1), after its time/step_s is taken:
        # the TRL iteration runs there, while 03 waits, so the two alternate without timing each other
        runs.save_checkpoint = lambda *a, **k: trl_step()
        run_args = ppo.parse_args(ours_argv(args.base, out / "prompts.jsonl", args.iterations, args.seed, out / "ours"))
        ppo.train(run_args)
        runs.save_checkpoint = real_save
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
        log.close()
    ours = common.read_jsonl(out / "ours" / "metrics.jsonl")[args.warmup :]
    trl = trl_rows[args.warmup :]
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    ours_s, trl_s, trl_default_s = med(ours, "time/step_s"), med(trl, "step_s"), med(trl, "default_step_s")
    parts = ("generate_s", "critic_s", "forward_s", "update_s")
    parts_ours = {k: round(med(ours, f"time/{k}"), 4) for k in parts if f"time/{k}" in ours[0]}
    parts_trl = {k: round(med(trl, k), 4) for k in parts + ("default_generate_s",)}
    print(f"ours {ours_s:.3f} s/iteration {parts_ours}")
    print(
        f"TRL  {trl_s:.3f} s/iteration (whole batch generated at once), {trl_default_s:.3f} s with PPOTrainer."
        f"generate's default batch of 4 {parts_trl}"
    )
    print(
        json.dumps(
            {
                "ours_s": round(ours_s, 4),
                "trl_s": round(trl_s, 4),
                "ratio": round(ours_s / trl_s, 3),
                "trl_default_generate_s": round(trl_default_s, 4),
                "ratio_vs_trl_default_generate": round(ours_s / trl_default_s, 3),
                "ours_parts": parts_ours,
                "trl_parts": parts_trl,
                "iterations": len(ours),
                "batch_size": BATCH,
                "prompt_tokens": PROMPT_TOKENS,
                "new_tokens": NEW_TOKENS,
                "minibatches": MINIBATCHES,
                "threads": args.threads,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "trl": "0.11.4",
            }
        )
    )


if __name__ == "__main__":
    main()
