"""Stage 3: NL-Gradient policy optimisation (Text2Grad paper §3.5, Alg. 4): PPO on per-token span rewards.

train() is Alg. 4's loop, one named step per line of it (the step numbers are ours):
  1. rollout          y ~ pi_theta(.|x) for a batch of prompts, left-padded, sampled at temperature T
  2. critic           the critic writes a critique c and quotes good / poor spans of each y (make_critic)
  3. span_deltas      spans -> character intervals -> per-token delta_t in {-1, 0, +1} (§3.3, common.span_rewards)
  4. compute_rewards  r_t = delta_t - beta * KL_t, KL_t to the reference policy from score_rollouts
  5. compute_gae      advantages A_t by GAE over r_t, then whitened (--advantage rloo: compute_rloo, no value head)
  6. ppo_update       clipped surrogate + clipped value loss - entropy bonus, epochs of minibatches (ppo_loss)
  7. log_iteration    the iteration's metrics on the global batch, samples, checkpoints
The file reads top to bottom: the arguments; the pure tensor functions of steps 4-6 (copy them into your own project
as they are); precision and torchrun; the policy (forward, reference_forward, build_policy); the critic (make_critic)
and the demo's monitor (make_monitor); the steps; the run's setup (prompts, SFT warm start, checkpoints); train().
Only common.py is needed beside it, tasks/ for the program and python: critics (tasks/plugin.py), and baselines/ for
the paper's scalar baselines (--critic scalar-rm, prm: baselines/scalar_rm.py).

    python 03_train_policy.py       # the demo after stages 1-2: SFT, Text2Grad PPO, then the scalar baseline (CPU)
    python 03_train_policy.py --critic program --reward-mode scalar --output-dir runs/demo/prog_scalar
    python 03_train_policy.py --critic scalar-rm --reward-model runs/demo/bt_rm --output-dir runs/demo/ppo_bt  # PPO
    python 03_train_policy.py --critic prm --reward-model runs/demo/prm --output-dir runs/demo/prm_ppo     # PRM-PPO
    python 03_train_policy.py --task summarization --model meta-llama/Llama-3.1-8B-Instruct \
        --prompts data/slf5k_prompts.jsonl --critic openai --critic-base-url http://localhost:8000/v1 \
        --critic-model rm --device cuda --dtype bf16 --gradient-checkpointing --output-dir runs/slf5k/text2grad
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import common
from infra import decoding, models, reward_models, runs, serving
from tasks import plugin

# Defaults per task preset: the demo must fit a 2-core CPU; the others follow the paper's setup (App. A, Table 7).
PRESETS = {
    "demo": dict(model="runs/demo/base", prompts="runs/demo/data/prompts.jsonl", sft_data="runs/demo/data/sft.jsonl",
                 sft_steps=100, sft_lr=1e-3, sft_lora_r=0, sft_output_dir="runs/demo/sft",
                 reward_model="runs/demo/reward_model", output_dir="runs/demo/text2grad",
                 scalar_baseline_dir="runs/demo/scalar", steps=60, batch_size=32, max_new_tokens=32, lr=1e-3,
                 lora_r=16, lora_alpha=32, kl_coef=0.2, ppo_epochs=2, num_minibatches=2,
                 critic_max_new_tokens=reward_models.critique_tokens("demo"), warmup_steps=0, trace_samples=3),
    "default": dict(model=None, prompts=None, sft_data=None, sft_steps=0, sft_lr=2e-5, sft_lora_r=None,
                    sft_output_dir=None, reward_model=None, output_dir="runs/text2grad", scalar_baseline_dir="",
                    steps=1000, batch_size=64, max_new_tokens=256, lr=1e-5, lora_r=16, lora_alpha=32, kl_coef=0.05,
                    ppo_epochs=4, num_minibatches=4, critic_max_new_tokens=reward_models.critique_tokens("qa"),
                    warmup_steps=0, trace_samples=0)}


def parse_args(argv=None):
    cell = lambda v: "none" if v is None else repr(v) if v == "" else str(v)  # noqa: E731
    table = "\n".join(f"  --{k.replace('_', '-'):23s} {cell(PRESETS['default'][k]):31s} {cell(v)}"
                      for k, v in PRESETS["demo"].items())
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog=f"presets (--task picks a column; a flag given explicitly wins):\n"
                                       f"  {'':25s} {'summarization, code, qa':31s} demo\n{table}\n"
                                       "  (--sft-lora-r none: --lora-r; --sft-output-dir none: OUTPUT_DIR/sft, the "
                                       "scalar baseline's too;\n  with --output-dir, --scalar-baseline-dir is '' "
                                       "(none) and --sft-output-dir OUTPUT_DIR/sft unless given:\n  no run writes "
                                       "into a preset's folder it did not name;\n  --critic-max-new-tokens: what "
                                       "stage 2 evaluated --reward-model with, where its reward_model.json says)")
    a = p.add_argument
    # --- task, data, model
    a("--task", default="demo", choices=["demo", "summarization", "code", "qa"], help="preset and program critic")
    a("--model", help="policy base model: hub id or local dir (demo: runs/demo/base)")
    a("--prompts", help="JSONL with a 'prompt' field (--task code --critic program: any layout of tasks/code.py)")
    a("--output-dir", help="run dir: metrics.jsonl, samples.jsonl, checkpoint.pt, policy/")
    a("--steps", type=int, help="number of PPO iterations")
    a("--seed", type=int, default=1, help="seed for sampling, prompt order and init")
    a("--resume", action="store_true", help="continue from <output-dir>/checkpoint.pt (a folder holding a run "
      "without one: refused),\non the SFT start it began from (one made with other settings, or gone: refused)")
    a("--overwrite", action="store_true", help="a fresh run replaces the run in --output-dir, and an SFT start made "
      "with other settings\n(without it: refused, but for the literal zero-flag demo's own runs/demo/text2grad, "
      "runs/demo/scalar\nand runs/demo/sft). Not with --resume: a checkpoint is never continued on a retrained SFT "
      "start")
    a("--scalar-baseline-dir", help="then train the --reward-mode scalar baseline here, same settings and SFT start "
      "('': skip;\ndefault: the demo's runs/demo/scalar when --output-dir is not given, else none)")
    a("--chat-template", default="auto", choices=["auto", "on", "off"], help="wrap prompts in the tokenizer's chat "
                                                                             "template (auto: if it has one)")
    a("--max-prompt-tokens", type=int, default=1024, help="a longer prompt keeps its last tokens (its chat template "
      "is kept whole);\nthe reward model's input is cut to what stage 2 trained it with (its reward_model.json)")
    # --- optional SFT warm start (the paper's SLF5K policy starts from SFT on reference summaries)
    a("--sft-data", help="JSONL with 'prompt' and --sft-field; trains before PPO (reused where --sft-output-dir holds "
      "the SFT\nthese settings made, its sft.json; other settings: refused, --overwrite retrains)")
    a("--sft-field", default="response", help="the SFT target field")
    a("--sft-steps", type=int, help="SFT optimizer steps")
    a("--sft-lr", type=float, help="SFT learning rate")
    a("--sft-batch-size", type=int, default=32, help="SFT batch size")
    a("--sft-lora-r", type=int, help="LoRA rank for SFT, merged afterwards; 0 = full fine-tuning (default: --lora-r)")
    a("--sft-output-dir", help="where the SFT model (merged, full weights) is saved; PPO starts from it")
    # --- policy parametrisation
    a("--lora-r", type=int, help="LoRA rank; 0 = full fine-tuning (then the reference is a frozen copy)")
    a("--lora-alpha", type=int, help="LoRA alpha")
    a("--lora-targets", default="all-linear", help="comma-separated module names, or all-linear")
    a("--ref-adapter", help="a LoRA adapter the policy starts from; it is also the reference policy")
    # --- critic
    a("--critic", default="local", type=plugin.choice("local", "program", "openai", "scalar-rm", "prm"),
      metavar="{local,program,openai,scalar-rm,prm,python:MODULE_OR_FILE:FUNCTION}",
      help="who writes critique + spans: local (--reward-model), openai (a served one), program (the\ntask's own: "
      "python:tasks.demo:critic or python:tasks.code:critic), or python:MODULE_OR_FILE:FUNCTION,\nyour own "
      "function (records, responses) -> one item per response: {critique, good_spans,\npoor_spans} quotes, or "
      "{spans: [{start, end, reward}]} character intervals with a reward in\n[-1, 1] (a token takes it when it lies "
      "inside; overlap: the lowest reward wins; --labels dense\nand --span-weighting linear-decay need quotes), or "
      "{error}; trusted code, run in this process,\nchecked on one record before any training (tasks/plugin.py; "
      "README \"Your own critic\"). Or the\npaper's baselines (§4.3, App. N), a scalar reward model's scores "
      "instead: scalar-rm (02\n--objective pairwise) scores the whole response, put on its last token (classic RLHF "
      "PPO);\nprm (02 --objective prm) scores each step, put on the step's last token (baselines/scalar_rm.py)")
    a("--reward-model", help="stage-2 output dir (adapter + reward_model.json), for --critic local, scalar-rm, prm")
    a("--score-norm", default="mean", choices=["mean", "mean-std"], help="--critic scalar-rm: mean subtracts the "
      "SFT demonstrations' mean score (Huang et al. 2024);\nmean-std also divides by their std (Ziegler et al. "
      "2019's gain): the score's scale\nagainst beta * KL no longer depends on how confident the reward model got")
    a("--critic-base-url", help="OpenAI-compatible endpoint for --critic openai (vLLM, Ollama, OpenAI)")
    a("--critic-model", default="gpt-4o", help="model name at that endpoint")
    a("--critic-api", default="chat", choices=["chat", "completions"], help="chat: one user message (the server "
      "applies the chat template);\ncompletions: the exact text of infra.reward_models.rm_prompt (--reward-model's tokenizer if "
      "given,\nelse the plain template), less a leading BOS the server adds itself. Either API: with\n"
      "--reward-model, the task prompt is cut as stage 2 cut it (reward_model.json)")
    a("--critic-concurrency", type=int, default=32, help="parallel requests for --critic openai (a local server: "
      "what it runs at once)")
    a("--critic-timeout", type=float, default=300.0, help="--critic openai: seconds before a critique request is "
      "abandoned;\nit is not retried (the server may still be generating it) and that rollout gets delta = 0")
    a("--critic-retries", type=int, default=2, help="--critic openai: retries of a critique request on 408/409/429/5xx "
      "and\nconnection errors (backoff with jitter, the server's Retry-After); then delta = 0")
    a("--critic-max-new-tokens", type=int, help="max tokens of a critique (default: what stage 2 evaluated "
      "--reward-model with,\nelse the preset: 96 for the demo, 512)")
    # --- rollouts
    a("--batch-size", type=int, help="rollouts per iteration")
    a("--max-new-tokens", type=int, help="response length limit")
    a("--min-new-tokens", type=int, default=0, help="no EOS before this many tokens (benchmarks; log-probs likewise)")
    a("--temperature", type=float, default=1.0, help="sampling temperature; log-probs use logits / T")
    a("--top-p", type=float, default=1.0, help="nucleus sampling (1.0 = off). Below 1 the run is OFF-POLICY: rollouts"
                                               "\ncome from the truncated distribution, PPO scores the full one")
    a("--missing-eos-penalty", type=float, default=1.0, help="subtracted from the last reward when no EOS is produced")
    a("--compile-generation", action=argparse.BooleanOptionalAction, default=False, help="rollouts and the local "
      "critic's critiques by infra.decoding.static_decode: a static KV cache and the\ndecode step under torch.compile; the "
      "same tokens as generate() in every float32 CPU run measured,\nnot guaranteed (rounding may flip a sampled "
      "token; bench/gpu_recipe.py --phases tokens\nmeasures it on a GPU); compiled once per prompt-width bucket: "
      "seconds on a CPU, a minute\nfor an 8B model; --no-compile-generation: generate() and greedy_generate as they "
      "were")
    a("--compile-update", action=argparse.BooleanOptionalAction, default=False, help="the policy and reference "
      "forwards of steps 4 and 6 (scoring; the update's forward and\nbackward) under torch.compile, and AdamW fused. "
      "NOT bit for bit:\nlog-probs, losses and weights move within float rounding (~1e-6 "
      "relative; a later\nsampled token could flip); compiled per shape, dynamic after the first change (minutes\n"
      "on a CPU: more than the demo saves); --no-compile-update: eager, as it was")
    # --- rewards (§3.5) and advantages
    a("--reward-mode", default="span", choices=["span", "scalar"], help="span: delta_t on every token (Text2Grad); "
                                                                        "scalar: sum of delta on the last token")
    a("--span-weighting", default="uniform", choices=["uniform", "linear-decay"], help="App. I ablation (weight_spans)")
    a("--labels", default="spans", choices=["spans", "dense"], help="spans: delta from the quoted spans, 0 elsewhere "
      "(§3.3);\ndense (App. I.1 ablation): every token outside the critic's poor spans +1, inside -1, its good "
      "spans\nignored. Any critic's output (program, local, openai) is relabelled so (dense_feedback)")
    a("--kl-estimator", default="k1", choices=["k1", "k3", "full"], help="per-token KL: k1 = log p - log q at the "
      "sampled token, k3 = (r-1) - log r,\nfull = sum over the vocabulary (what the paper's code uses)")
    a("--kl-coef", type=float, help="initial beta")
    a("--adaptive-kl-target", type=float, help="adaptive beta's target sequence KL (Ziegler et al.)")
    a("--adaptive-kl-horizon", type=float, default=10000, help="horizon of the adaptive KL controller")
    a("--whiten-rewards", action="store_true", help="whiten rewards (scale only) before GAE")
    a("--gamma", type=float, default=1.0, help="discount")
    a("--lam", type=float, default=0.95, help="GAE lambda")
    a("--advantage", default="gae", choices=["gae", "rloo"], help="gae: GAE with the value head (compute_gae); "
      "rloo: no value head, each token's\nreward-to-go minus the other samples' mean return (compute_rloo)")
    a("--rloo-k", type=int, default=4, help="--advantage rloo: samples per prompt (>= 2, divides --batch-size)")
    a("--rloo-baseline", default="start", choices=["start", "position", "mean-reward"], help="--advantage rloo: "
      "what each token's reward-to-go G_t is compared with, over the\nother samples of its prompt: start = their "
      "mean return G_0 (the same for every token); position =\ntheir mean G_t at the same position; mean-reward = "
      "their mean reward per token, subtracted from\neach r_s before summing. README: \"the two estimators\"")
    # --- PPO update
    a("--lr", type=float, help="learning rate (LoRA weights and value head)")
    a("--anneal-lr", action="store_true", help="linearly anneal the learning rate to 0")
    a("--warmup-steps", type=int, help="linear learning-rate warmup over the first N iterations")
    a("--ppo-epochs", type=int, help="passes over each batch")
    a("--num-minibatches", type=int, help="minibatches per epoch")
    a("--grad-accum", type=int, default=1, help="micro-batches per minibatch (memory)")
    a("--forward-batch-size", type=int, help="rows per no-grad forward (default: what 256 MB of logits allow)")
    a("--clip-range", type=float, default=0.2, help="policy ratio clip epsilon")
    a("--clip-range-value", type=float, default=0.2, help="value clip")
    a("--vf-coef", type=float, default=0.1, help="value loss coefficient")
    a("--ent-coef", type=float, default=0.0, help="entropy bonus coefficient (the paper's beta * H)")
    a("--max-grad-norm", type=float, default=1.0, help="gradient norm clip")
    a("--target-kl", type=float, help="stop an iteration's epochs early when an epoch's mean approx KL exceeds this")
    # --- system
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    a("--dtype", default="float32", choices=["float32", "bf16", "fp16"], help="LoRA: the frozen base is stored in it "
      "(adapter, value head: float32);\nfull fine-tuning: float32 master weights, autocast (fp16: loss scaling)")
    a("--gradient-checkpointing", action="store_true", help="trade compute for memory")
    a("--save-every", type=int, default=20, help="checkpoint every N iterations")
    a("--log-every", type=int, default=10, help="write sample rollouts every N iterations")
    a("--dump-rollouts", help="audit: each iteration's tensors (delta, KL, advantages, ...) to DIR/step<N>_rank<R>.pt")
    a("--trace-samples", type=int, help="where each update went (trace_iteration): N rollouts' delta, KL, V, r and A "
      "under both\nreward modes, old and new log-probs, the batch's update locality: OUTPUT_DIR/trace.jsonl\n"
      "(0: off; costs one no-grad forward of the batch per iteration)")
    args = p.parse_args(argv)
    args.zero_flag = not (sys.argv[1:] if argv is None else argv)  # only this command may replace the demo's runs
    if args.resume and args.overwrite:
        raise common.DataError("--resume and --overwrite: pick one (--resume continues a run on the SFT start it "
                               "began from; --overwrite starts it again, and retrains a changed SFT start)")
    critic_budget, rm_given = args.critic_max_new_tokens, args.reward_model is not None
    if args.output_dir is not None:  # the preset's folders are the preset's: no baseline, the SFT in OUTPUT_DIR/sft
        args.scalar_baseline_dir = "" if args.scalar_baseline_dir is None else args.scalar_baseline_dir
        args.sft_output_dir = args.sft_output_dir or str(Path(args.output_dir) / "sft")
    for key, value in PRESETS["demo" if args.task == "demo" else "default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sft_output_dir = args.sft_output_dir or str(Path(args.output_dir) / "sft")  # the scalar baseline's too
    if not args.model:
        raise common.DataError("--model is required outside the demo")
    if args.critic != "local" and not rm_given:  # the demo's reward model is not the one a server runs
        args.reward_model = None
    # the reward model is used as stage 2 trained it (its reward_model.json): its input cut to the same budget, and,
    # unless given, critiques as long as those stage 2 evaluated (a shorter limit cuts them before their span JSON)
    settings = reward_models.rm_settings(args.reward_model if args.critic != "program" else None)
    args.critic_max_prompt_tokens, args.critic_rm_format = settings["max_prompt_tokens"], settings["rm_format"]
    args.critic_max_new_tokens = critic_budget or settings["max_new_tokens"] or args.critic_max_new_tokens
    for flag, value, ok, rule in (("--temperature", args.temperature, args.temperature > 0, "> 0 (logits / T)"),
                                  ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
                                  ("--ppo-epochs", args.ppo_epochs, args.ppo_epochs >= 1, ">= 1 (0: no update)"),
                                  ("--num-minibatches", args.num_minibatches, args.num_minibatches >= 1, ">= 1"),
                                  ("--grad-accum", args.grad_accum, args.grad_accum >= 1, ">= 1"),
                                  ("--rloo-k", args.rloo_k, args.advantage == "gae" or (
                                      args.rloo_k >= 2 and args.batch_size % args.rloo_k == 0),
                                   ">= 2 and divide --batch-size (samples of one prompt)")):
        if not ok:
            raise common.DataError(f"{flag} {value:g}: must be {rule}")
    shards = int(os.environ.get("WORLD_SIZE", 1)) * args.num_minibatches * args.grad_accum  # torchrun sets it
    if args.batch_size % shards:
        raise common.DataError(f"--batch-size {args.batch_size} must divide by world size x --num-minibatches x "
                               f"--grad-accum = {shards}")
    if args.critic in SCALAR_CRITICS:  # before any training: a generative reward model here (or none) is refused
        objective, use = SCALAR_CRITICS[args.critic]
        reward_models.check_reward_model(args.reward_model, objective=objective, use=use)
        if args.labels == "dense" or args.span_weighting != "uniform":
            raise common.DataError(f"--critic {args.critic}: --labels and --span-weighting relabel spans, it has none")
    if args.labels == "dense" and args.span_weighting != "uniform":  # every token is in one span: nothing to weight
        raise common.DataError("--labels dense: --span-weighting must be uniform (no quotes to weight)")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions. Shapes: B rollouts, T response tokens; mask is 1.0 on response tokens.
# ----------------------------------------------------------------------------------------------------------------------


def masked_mean(x, mask, dim=None):
    return (x * mask).sum() / mask.sum().clamp(min=1) if dim is None else (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the masked entries; shift_mean=False keeps the mean (used for rewards)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return (whitened if shift_mean else whitened + mean) * mask


def per_token_kl(logprobs, ref_logprobs, estimator="k1", logits=None, ref_logits=None):
    """KL_t between policy and reference at each position: Schulman's k1 / k3 estimators from the sampled token's
    log-probs (B, T), or the exact KL over the vocabulary ("full") from both models' logits (B, T, V)."""
    if estimator == "full":
        logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
        return (logp.exp() * (logp - logq)).sum(-1)
    log_ratio = logprobs - ref_logprobs
    return log_ratio if estimator == "k1" else torch.expm1(-log_ratio) + log_ratio


def weight_spans(delta, spans, mode="uniform"):
    """App. I ablation. uniform: delta as is. linear-decay: the i-th of the n tokens of each span gets delta times
    1 - (i - 1) * 0.9 / (n - 1) ([1, .775, .55, .325, .1] for n = 5; 1 for n = 1), so a span's start carries most of its
    credit. spans[b]: the token indices of each located span of row b, in order (common.span_tokens); a token in two
    spans of its label takes the larger weight."""
    if mode == "uniform":
        return delta
    weight = torch.ones_like(delta)
    for b, row in enumerate(spans):
        best = {}
        for idx in row:
            for i, t in enumerate(idx):
                best[t] = max(best.get(t, 0.0), 1.0 - i * 0.9 / (len(idx) - 1) if len(idx) > 1 else 1.0)
        for t, w in best.items():
            weight[b, t] = w
    return delta * weight


def compute_rewards(delta, kl, mask, kl_coef, mode="span", seq_bonus=None):
    """Per-token rewards r_t (Sec. 3.5, step 4). span: r_t = delta_t - beta*KL_t. scalar (App. A, Setting B):
    r_t = -beta*KL_t, plus sum_t delta_t at the last response token (the EOS if one was sampled, never a pad).
    seq_bonus (B,), e.g. the missing-EOS penalty, is added at the last token in both modes."""
    rewards = -kl_coef * kl * mask
    last = mask.sum(1).long().clamp(min=1) - 1                                   # (B,)
    rows = torch.arange(mask.shape[0], device=mask.device)
    if mode == "span":
        rewards = rewards + delta * mask
    else:
        rewards[rows, last] += (delta * mask).sum(1)
    if seq_bonus is not None:
        rewards[rows, last] += seq_bonus
    return rewards * mask


def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (step 5), as an explicit reversed loop.
    A_t = sum_l (gamma*lam)^l td_{t+l},  td_t = r_t + gamma*V_{t+1} - V_t,  V = 0 after the last valid token.
    Returns (advantages, returns = advantages + values), both 0 where mask is 0."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        td = rewards[:, t] + gamma * next_value - values[:, t]
        running = td + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def compute_rloo(rewards, mask, k: int, gamma: float = 1.0, baseline: str = "start"):
    """Critic-free advantages (--advantage rloo; step 5 without a value head). Rows come in groups of k >= 2 samples
    of one prompt (rows j*k .. j*k+k-1). RLOO's leave-one-out baseline (Ahmadian et al. 2024) on token-level returns,
    with r_t from compute_rewards (delta_t - beta*KL_t, as for GAE) and the mean over the other samples j of the prompt:
      start        A_t = G_t - mean_j G_0^j                 G_t = sum_{s>=t} gamma^(s-t) r_s (--rloo-baseline)
      position     A_t = G_t - mean_j G_t^j                 (G_t^j = 0 once sample j has ended)
      mean-reward  A_t = sum_{s>=t} gamma^(s-t) (r_s - mean_j rbar^j)   rbar^j: j's mean reward per token
    With the whole reward on the last token, "start" is plain RLOO: every token of a sample gets R - mean(others' R).
    Returns (advantages, returns = G), both 0 where mask is 0."""
    def reward_to_go(r):                                                       # (B, T) -> (B, T), a reversed loop
        out, running = torch.zeros_like(r), torch.zeros_like(r[:, 0])
        for t in reversed(range(r.shape[1])):
            running = r[:, t] * mask[:, t] + gamma * running                   # nothing after a sample's end
            out[:, t] = running
        return out * mask

    def others_mean(x):                                                        # (B, ...) -> each row: its group's
        group = x.reshape(-1, k, *x.shape[1:])                                 # mean over the other k-1 rows
        return ((group.sum(1, keepdim=True) - group) / (k - 1)).reshape(x.shape)

    returns = reward_to_go(rewards)                                            # (B, T)
    if baseline == "start":
        advantages = returns - others_mean(returns[:, 0])[:, None]
    elif baseline == "position":
        advantages = returns - others_mean(returns)
    elif baseline == "mean-reward":
        rbar = (rewards * mask).sum(1) / mask.sum(1).clamp(min=1)              # (B,)
        advantages = reward_to_go(rewards - others_mean(rbar)[:, None])
    else:
        raise ValueError(f"unknown RLOO baseline {baseline!r}")
    return advantages * mask, returns


def ppo_loss(logprobs, old_logprobs, advantages, values, old_values, returns, mask, clip_range, clip_range_value):
    """Clipped surrogate policy loss and clipped value loss (step 6), token-averaged under `mask`. values None (no
    value head: --advantage rloo): no value loss (None) and no value statistic."""
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses_clipped), mask)
    with torch.no_grad():
        stats = {"policy/approx_kl": masked_mean(ratio - 1 - log_ratio, mask).item(),
                 "policy/clipfrac": masked_mean((pg_losses_clipped > pg_losses).float(), mask).item()}
    if values is None:
        return pg_loss, None, stats
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    vf_losses, vf_losses_clipped = (values - returns) ** 2, (values_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses, vf_losses_clipped), mask)
    stats["val/clipfrac"] = masked_mean((vf_losses < vf_losses_clipped).float(), mask).item()
    return pg_loss, vf_loss, stats


def update_kl_coef(kl_coef, observed_kl, target, horizon, n_steps):
    """Adaptive KL controller (Ziegler et al. 2019): nudge beta towards the target sequence KL."""
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


def entropy_from_logits(logits):
    """H of the categorical at each position, (B, T, V) -> (B, T)."""
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


LOCALITY_GROUPS = ("poor", "good", "outside_flawed", "outside_clean")


def locality_sums(log_ratio, delta, mask):
    """Where an update went: Delta_t = log pi_new - log pi_old (log_ratio, (B, T)) summed per token group, the groups
    read off the delta_t the update was computed from (its sign): inside poor spans, inside good spans, and outside
    every span in answers with a poor span ("flawed") or without one ("clean"). Returns (4, 4): per LOCALITY_GROUPS
    entry, (tokens, sum Delta, sum |Delta|, tokens whose Delta < 0); sums, so that ranks and batches add up."""
    flawed = ((delta < 0).float() * mask).amax(1, keepdim=True)              # (B, 1): 1 if the answer has a poor token
    outside = (delta == 0).float() * mask
    groups = torch.stack([(delta < 0).float() * mask, (delta > 0).float() * mask, outside * flawed,
                          outside * (1 - flawed)])                           # (4, B, T)
    return torch.stack([groups.sum((1, 2)), (groups * log_ratio).sum((1, 2)), (groups * log_ratio.abs()).sum((1, 2)),
                        (groups * (log_ratio < 0).float()).sum((1, 2))], 1)


def locality_summary(sums) -> dict:
    """locality_sums' (4, 4) as {group: {tokens, mean, mean_abs, down}} (down: the share of its tokens made less
    likely) plus "ratio", the locality ratio: mean |Delta| inside poor spans / mean |Delta| on the unflagged tokens of
    the same (flawed) answers; None where a group is empty."""
    out = {}
    for name, (n, total, total_abs, down) in zip(LOCALITY_GROUPS, sums.tolist()):
        out[name] = {"tokens": int(n), "mean": total / n if n else None, "mean_abs": total_abs / n if n else None,
                     "down": down / n if n else None}
    poor, rest = out["poor"]["mean_abs"], out["outside_flawed"]["mean_abs"]
    out["ratio"] = poor / rest if poor is not None and rest else None
    return out



# ----------------------------------------------------------------------------------------------------------------------
# Precision and torchrun: autocast, loss scaling, the process group and its collectives (rank 0 writes)
# ----------------------------------------------------------------------------------------------------------------------


def autocast(device: str, dtype: str):
    """bf16/fp16 compute over float32 master weights for full fine-tuning (a bf16 weight does not move by a 1e-6
    step); for LoRA the frozen base is stored in `dtype` and autocast only matches the adapter's float32 to it."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=models.torch_dtype(dtype))


def grad_scaler(device: str, dtype: str):
    """Loss scaling for fp16 (its gradients underflow without it); a no-op otherwise."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "fp16")


def dist_init(device: str) -> tuple[int, int, str]:
    """(rank, world size, this rank's device). Under torchrun (even with one process, so its collectives run) it starts
    the process group: gloo on CPU; on GPU nccl for CUDA tensors and gloo for CPU ones, each rank on GPU LOCAL_RANK."""
    if "WORLD_SIZE" in os.environ and device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size(), device) if dist.is_initialized() else (0, 1, device)


def gather_rows(x):
    """The (B, ...) tensors of every rank stacked along B, (B, T) ones padded with zeros to the longest T."""
    if not dist.is_initialized():
        return x
    if x.dim() == 2:
        width = torch.tensor([x.shape[1]], device=x.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        x = torch.nn.functional.pad(x, (0, int(width) - x.shape[1]))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_sum(x):
    """Sum of a tensor over ranks (in place)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier(timeout_h: float | None = None) -> None:
    """Wait for every rank. timeout_h: a long wait (rank 0 training the SFT warm start alone), on a gloo group of its
    own, since nccl's collectives give up after 10 minutes."""
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=timeout_h)) if timeout_h else None
        dist.barrier(group=group)
        if group is not None:
            dist.destroy_process_group(group)


# ----------------------------------------------------------------------------------------------------------------------
# The policy: log-probs and values in one forward, the reference policy without a second copy of the weights
# ----------------------------------------------------------------------------------------------------------------------


def forward(model, value_head, input_ids, attention_mask, n_resp, temperature, forbid=None):
    """Log-probs of the last n_resp tokens, the values of the states before them, and the logits / T.
    Only the last n_resp + 1 positions' logits are computed (logits_to_keep): the prompt's are never needed.
    forbid = (ids, n): generate() could not sample these ids at the first n response positions (--min-new-tokens),
    so they get the lowest logit there too: the log-probs are those of the distribution that was sampled."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions start at the first token
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                output_hidden_states=value_head is not None, logits_to_keep=n_resp + 1)
    logits = out.logits[:, :-1].float() / temperature                          # (B, T, V): position t predicts t+1
    if forbid and forbid[1] > 0:  # finite, not -inf: 0 * logit stays 0 in the entropy and the full KL
        logits[:, :forbid[1], forbid[0]] = torch.finfo(logits.dtype).min
    logprobs = torch.gather(logits.log_softmax(-1), 2, input_ids[:, -n_resp:, None]).squeeze(-1)      # (B, T)
    values = None
    if value_head is not None:
        hidden = out.hidden_states[-1][:, -n_resp - 1:-1]                      # (B, T, H), post final norm
        values = value_head(hidden.to(value_head.weight.dtype)).squeeze(-1).float()  # (B, T)
    return logprobs, values, logits


def reference_forward(model, ref_model, input_ids, attention_mask, n_resp, temperature, forbid=None):
    """(log-probs, logits) of pi_ref: the same weights with the LoRA adapter switched off (or the --ref-adapter
    switched on); only full fine-tuning needs the frozen copy `ref_model`."""
    if ref_model is not None:
        return forward(ref_model, None, input_ids, attention_mask, n_resp, temperature, forbid)[::2]
    if "ref" in getattr(model, "peft_config", {}):
        model.set_adapter("ref")
        try:
            return forward(model, None, input_ids, attention_mask, n_resp, temperature, forbid)[::2]
        finally:
            model.set_adapter("default")
    with model.disable_adapter():
        return forward(model, None, input_ids, attention_mask, n_resp, temperature, forbid)[::2]


def compile_update(model, ref_model, args):
    """--compile-update: (model, ref_model) as forward() should call them in steps 4 and 6, under torch.compile
    (inductor; the same modules and weights, so the rollout, the save and everything else still see the eager ones).
    torch decides per shape: static first, dynamic in the dims that change (the response width, the rows)."""
    if not args.compile_update:
        return model, ref_model
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # train/eval, adapter on/off
    from torch._inductor import config as inductor_config
    inductor_config.fallback_random = True  # a dropout draws from torch's generator, as eager: same random stream
    return torch.compile(model), ref_model if ref_model is None else torch.compile(ref_model)


def build_policy(args, model):
    """Wrap the (SFT) model for PPO: LoRA (reference = adapter off) or full fine-tuning (reference = frozen copy)."""
    ref_model = None
    if args.ref_adapter:
        from peft import PeftModel
        with models.peft_wraps_quietly():
            model = PeftModel.from_pretrained(model, args.ref_adapter, adapter_name="ref")
        model.load_adapter(args.ref_adapter, adapter_name="default", is_trainable=True)
        model.set_adapter("default")
    elif args.lora_r > 0:
        model = models.add_lora(model, args.lora_r, args.lora_alpha, args.lora_targets)
    else:  # full fine-tuning: the frozen reference needs no float32 master weights
        ref_model = copy.deepcopy(model).to(models.torch_dtype(args.dtype)).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        # (it also makes the embeddings' output require grad, by a hook: calling that again would add a second one)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    value_head = torch.nn.Linear(model.get_input_embeddings().weight.shape[1], 1, device=args.device)
    torch.nn.init.zeros_(value_head.weight)  # zero-init: V = 0 at the start, so early advantages are the returns
    torch.nn.init.zeros_(value_head.bias)
    return model, ref_model, value_head


# ----------------------------------------------------------------------------------------------------------------------
# The critic of step 2, and a monitor of its rollouts that nothing is trained on
# ----------------------------------------------------------------------------------------------------------------------


def _parse(raw):
    """parse_feedback's dict for the critic's output `raw`; for one that does not parse, or a request that failed (an
    exception), a failed critique (critique_failed): delta = 0 for this rollout, counted in critic/parse_fail_rate,
    with the error and the critic's text kept for samples.jsonl."""
    failed = lambda error, output: {"critique": None, "good_spans": [], "poor_spans": [],  # noqa: E731
                                    "critic_error": error, "critic_output": output}
    if isinstance(raw, Exception):
        return failed(serving.api_error(raw), None)
    try:
        return common.parse_feedback(raw)
    except ValueError as e:
        return failed(str(e), raw[:4000])


def show_progress(bar, step: int, row: dict, feedback: list, args) -> None:
    """Rank 0: the iteration's reward, KL, mistake and parse-fail rates in the progress bar, and a warning line above
    it when most of its critiques failed: a critic that stops parsing gives delta = 0, which the reward and mistake
    rate alone do not tell from a flawless batch."""
    rate = row["critic/parse_fail_rate"]
    bar.set_postfix(reward=f"{row['objective/span_reward']:.2f}", kl=f"{row['objective/kl']:.2f}",
                    mistakes=f"{row['critic/mistake_rate']:.2f}", parse_fail=f"{rate:.2f}")
    if rate > 0.5:
        first = next(((fb or {}).get("critic_error") for fb in feedback if critique_failed(fb)), None)
        bar.write(f"warning: iteration {step}: {round(rate * args.batch_size)} of {args.batch_size} critiques failed "
                  f"(no span JSON, or no answer): their rollouts get delta = 0; first: {first}", file=sys.stderr)


def print_critic_summary(costs: list[tuple], args) -> None:
    """The run's end, rank 0: what the critic cost next to the rollout it judges, and how many of its critiques
    failed. costs: (time/generate_s, time/critic_s, critic/parse_fail_rate) per iteration."""
    gen_s, critic_s = (float(np.median(c)) for c in list(zip(*costs))[:2])
    print(f"per iteration (median): rollout {gen_s:.3f} s, critic ({args.critic}) {critic_s:.3f} s = "
          f"{critic_s / max(gen_s, 1e-9):.2f}x the rollout (time/critic_s / time/generate_s)")
    failed, n = round(sum(c[2] for c in costs) * args.batch_size), len(costs) * args.batch_size
    print(f"critic ({args.critic}): {failed} of {n} critiques failed in this run ({failed / n:.0%}), their rollouts "
          "got delta = 0 (critic/parse_fail_rate; samples.jsonl keeps critic_error)")


def critique_failed(fb) -> bool:
    """True for a critique that gives no delta: its output did not parse or its request failed (_parse), or None."""
    return fb is None or fb.get("critique") is None


def check_critic(args) -> None:
    """--critic openai: one cheap request to the served critic before any training, so that a wrong model name, a
    dead port, a 4xx or a missing key stops the run here in one line (infra.serving.check_server). --critic program or
    python:...: the function is imported and called on the first prompt (tasks/plugin.py: preflight), so that a
    module that does not import, a missing function or a wrong return stops it here in one line too."""
    if args.critic == "program" or plugin.is_plugin(args.critic):
        fn, label = plugin.load_critic(args.critic, args.task, "--critic")
        rec = read_prompts(args.prompts, args.task, args.critic)[0]
        item = plugin.preflight(fn, label, rec, plugin.probe_response(rec), "--critic")
        if "spans" in item and (args.labels != "spans" or args.span_weighting != "uniform"):
            raise common.DataError(f"--critic {label} returns located intervals with their own rewards: --labels "
                                   "dense and --span-weighting relabel quotes")
    if args.critic == "openai":
        serving.check_server(args.critic_base_url, args.critic_model, args.critic_api, args.critic_timeout,
                            args.critic_retries, "--critic-base-url",
                            {"temperature": 0.0, "max_tokens": args.critic_max_new_tokens})  # as the critic sends


def make_critic(args):
    """critic(records, texts) -> per (prompt, response), parse_feedback's dict, or a failed critique (_parse) when its
    output did not parse or its request failed.
    --critic local: the stage 2 reward model; openai: one behind an OpenAI-compatible server; program: the task's
    programmatic critic (tasks/); python:MODULE_OR_FILE:FUNCTION: the user's (its intervals kept as "spans");
    scalar-rm, prm: a scalar reward model (baselines/scalar_rm.py: scalar_critic)."""
    if args.critic in SCALAR_CRITICS:
        from baselines.scalar_rm import scalar_critic
        return scalar_critic(args)
    if args.critic == "program" or plugin.is_plugin(args.critic):  # the task's own or the user's (tasks/plugin.py)
        fn, label = plugin.load_critic(args.critic, args.task, "--critic")
        return lambda recs, texts: plugin.call(fn, label, recs, texts)  # a raise: that rollout's critic_error
    if args.critic == "local":
        rm, rm_tok = models.load_model(args.reward_model, device=args.device, dtype=args.dtype)
        return lambda recs, texts: [_parse(x) for x in reward_models.rm_critique(
            rm, rm_tok, [r["prompt"] for r in recs], texts, args.critic_max_new_tokens,
            max_prompt_tokens=args.critic_max_prompt_tokens, rm_format=args.critic_rm_format,
            compile=args.compile_generation)]
    rm_tok = None  # with --reward-model, the served reward model gets its training input, cut alike (either API)
    if args.reward_model:  # a stage-2 output (train() checked it: infra.reward_models.check_reward_model)
        from transformers import AutoTokenizer
        rm_tok = AutoTokenizer.from_pretrained(args.reward_model)
    return lambda recs, texts: [_parse(x) for x in serving.rm_critique_served(
        [r["prompt"] for r in recs], texts, args.critic_base_url, args.critic_model, args.critic_max_new_tokens,
        args.critic_concurrency, args.critic_api, rm_tok, args.critic_max_prompt_tokens, args.critic_rm_format,
        args.critic_timeout, args.critic_retries)]


# The paper's scalar baselines as critics (baselines/scalar_rm.py): what each needs of --reward-model (its objective,
# checked by parse_args before any training) and its name in the refusal
SCALAR_CRITICS = {"scalar-rm": ("pairwise", "--critic scalar-rm"), "prm": ("prm", "--critic prm")}


def make_monitor(args):
    """monitor(records, texts, offsets, deltas) -> {metric: this rank's sum over its rollouts}, logged next to the
    critic's metrics and never trained on; or None. The demo has one: its exact critic on the same rollouts
    (tasks.demo.demo_monitor), the reward-hacking monitor that 04's curves draw dashed. deltas, step 3's (delta,
    unmatched) per rollout, are reused when the critic is that very one (--critic program, --labels spans)."""
    if args.task != "demo":
        return None
    from tasks.demo import demo_monitor
    reuse = args.critic == "program" and args.labels == "spans"  # dense labels are not the exact critic's delta
    return lambda recs, texts, offsets, deltas: demo_monitor(recs, texts, offsets, deltas if reuse else None)


# ----------------------------------------------------------------------------------------------------------------------
# The steps of one iteration (Alg. 4), in the order train() calls them
# ----------------------------------------------------------------------------------------------------------------------


def rollout(model, tokenizer, queries, gen_config, stop, args) -> dict:
    """Step 1 (Alg. 4, §3.5): y ~ pi_theta(.|x) for a left-padded batch, sampled with the behaviour policy's exact
    settings. mask (B, T) is 1.0 on the response up to and including its first stop id (Llama-3.1 has three EOS ids).
    Then each response is decoded with the character interval of every token (common.decode_with_offsets, §3.3)."""
    query, query_mask = (x.to(args.device) for x in models.left_pad(queries, tokenizer.pad_token_id))
    model.eval()
    with torch.no_grad(), autocast(args.device, args.dtype):
        if args.compile_generation:  # the same tokens from the same random numbers, at the compiled model's speed
            response = decoding.generate_static(model, query, query_mask, gen_config)                          # (B, T)
        else:
            response = model.generate(input_ids=query, attention_mask=query_mask,
                                      generation_config=gen_config)[:, query.shape[1]:]                      # (B, T)
    is_eos = torch.isin(response, stop)
    has_eos = is_eos.any(1)                                                                    # (B,)
    first_eos = torch.where(has_eos, is_eos.int().argmax(1), torch.full_like(has_eos, response.shape[1],
                                                                              dtype=torch.long))
    mask = (torch.arange(response.shape[1], device=response.device)[None] <= first_eos[:, None]).float()  # (B, T)
    response = response.masked_fill(mask == 0, tokenizer.pad_token_id)
    b = {"query": query, "response": response, "mask": mask, "has_eos": has_eos, "t_sampled": time.time(),
         "input_ids": torch.cat([query, response], 1), "attention_mask": torch.cat([query_mask, mask.long()], 1)}
    texts, offsets = zip(*[common.decode_with_offsets(tokenizer, row[:n]) for row, n in
                           zip(response.tolist(), mask.sum(1).long().tolist())])
    return {**b, "texts": list(texts), "offsets": list(offsets)}


def dense_feedback(text: str, fb: dict) -> dict:
    """--labels dense (App. I.1): the critic's feedback relabelled so that every token of `text` gets a label: the
    whole response is quoted as good too, so span_rewards gives -1 inside a poor span and +1 everywhere else (0 only
    on a token straddling a poor span's edge, or one of whitespace alone). The critic's good quotes change no label;
    they still place its poor ones (a word quoted good, then poor: the poor one is its second occurrence) and count
    in critic/unmatched_span_rate as they do with --labels spans."""
    return {**fb, "good_spans": fb["good_spans"] + ([text] if text.strip() else [])}


def span_deltas(texts, offsets, feedback, mask, weighting="uniform", labels="spans"):
    """Step 3 (§3.3): the quoted spans -> per-token pseudo-rewards delta_t in {-1, 0, +1} (common.span_rewards),
    weighted within each span by --span-weighting (App. I); --labels dense labels every token (dense_feedback).
    A scalar critic's feedback (--critic scalar-rm, prm) carries step_rewards instead: baselines/scalar_rm.py's
    step_deltas puts them on tokens; a python: critic's may carry located "spans" with real rewards in [-1, 1]
    (common.interval_rewards: the same rule, the lowest reward wins where they overlap).
    Returns delta (B, T) (0 where the feedback was unparseable), span_rewards' (delta, unmatched) per row, the number
    of non-empty quotes and of quotes not found (the critic's own quotes)."""
    delta, rows, n_spans, n_unmatched = torch.zeros_like(mask), [None] * len(feedback), 0, 0
    spans = [[] for _ in feedback]
    for i, fb in enumerate(feedback):
        if critique_failed(fb):
            continue
        if "step_rewards" in fb:  # a scalar critic (baselines/scalar_rm.py): its rewards on given tokens, no spans
            from baselines.scalar_rm import step_deltas
            d = step_deltas(offsets[i], fb["step_rewards"])
            delta[i, :len(d)], rows[i] = torch.tensor(d), (d, [])
            continue
        if "spans" in fb:  # a python: critic's located intervals and their rewards (common.interval_rewards)
            d = common.interval_rewards(texts[i], offsets[i], fb["spans"])
            delta[i, :len(d)], rows[i], n_spans = torch.tensor(d), (d, []), n_spans + len(fb["spans"])
            continue
        n_spans += sum(1 for s in fb["good_spans"] + fb["poor_spans"] if s.strip())
        fb = dense_feedback(texts[i], fb) if labels == "dense" else fb
        if weighting == "uniform":
            d, unmatched = rows[i] = common.span_rewards(texts[i], offsets[i], fb["good_spans"], fb["poor_spans"])
        else:  # the same delta, and the tokens of each located quote (App. I's spans)
            d, unmatched, located = common.span_tokens(texts[i], offsets[i], fb["good_spans"], fb["poor_spans"])
            rows[i], spans[i] = (d, unmatched), [idx for _, idx in located]
        delta[i, :len(d)] = torch.tensor(d)
        n_unmatched += len(unmatched) - (labels == "dense" and texts[i] in unmatched)  # the critic's quotes only
    return weight_spans(delta, spans, weighting), rows, n_spans, n_unmatched



def forward_rows(batch: int, micro: int, n_resp: int, vocab: int, n_logits: int = 1, budget: int = 2 ** 26) -> int:
    """Rows per no-grad forward of step 4: the whole batch in one call when its logits (n_logits tensors of rows x
    (n_resp + 1) x vocab floats) fit in `budget` elements (256 MB of fp32), else as many as fit, at least the training
    micro-batch. A row's log-probs do not depend on its batch-mates (a kernel picked by shape may round by ~1e-7)."""
    return max(micro, min(batch, budget // (n_logits * (n_resp + 1) * vocab)))


def scoring_rows(b, micro: int, model, args) -> int:
    """Rows per no-grad forward of the batch b (steps 4 and the trace): --forward-batch-size, else forward_rows for
    its shape (two logits tensors with --kl-estimator full)."""
    (B, T) = b["mask"].shape
    return args.forward_batch_size or forward_rows(B, micro, T, model.config.vocab_size,
                                                   2 if args.kl_estimator == "full" else 1)


def score_rollouts(model, ref_model, value_head, b, forbid, micro, args):
    """Step 4, no grad: the behaviour policy's log-probs and values (0 without a value head: --advantage rloo), and
    KL_t to the reference, each (B, T), in as few forward calls as memory allows ((B, T, V) logits can be large)."""
    (B, T), logprobs, values, kl = b["mask"].shape, [], [], []
    rows = scoring_rows(b, micro, model, args)
    with torch.no_grad(), autocast(args.device, args.dtype):
        for s in range(0, B, rows):
            ids, attn = b["input_ids"][s:s + rows], b["attention_mask"][s:s + rows]
            lp, v, logits = forward(model, value_head, ids, attn, T, args.temperature, forbid)
            ref_lp, ref_logits = reference_forward(model, ref_model, ids, attn, T, args.temperature, forbid)
            logprobs.append(lp)
            values.append(torch.zeros_like(lp) if v is None else v)
            kl.append(per_token_kl(lp, ref_lp, args.kl_estimator, logits, ref_logits))
    return torch.cat(logprobs), torch.cat(values), torch.cat(kl) * b["mask"]


def rewards_and_advantages(g, kl_coef: float, reward_mode: str, args):
    """Steps 4-5 on the global batch g (its delta, kl, mask, values, has_eos): the rewards r_t = delta_t - beta*KL_t
    of reward_mode (compute_rewards, the missing-EOS penalty at the last token; --whiten-rewards), then A_t by GAE
    (or --advantage rloo), whitened. Returns (rewards, advantages, returns), each (B, T)."""
    seq_bonus = torch.where(g["has_eos"], 0.0, -args.missing_eos_penalty)                      # (B,)
    rewards = compute_rewards(g["delta"], g["kl"], g["mask"], kl_coef, reward_mode, seq_bonus)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, g["mask"], shift_mean=False)
    advantages, returns = compute_gae(rewards, g["values"], g["mask"], args.gamma, args.lam) \
        if args.advantage == "gae" else compute_rloo(rewards, g["mask"], args.rloo_k, args.gamma, args.rloo_baseline)
    return rewards, masked_whiten(advantages, g["mask"]), returns


def ppo_update(model, value_head, params, optimizer, scaler, b, forbid, args, world):
    """Step 6 (§3.5): --ppo-epochs passes over the batch in --num-minibatches minibatches of --grad-accum
    micro-batches; loss = clipped surrogate + vf_coef * clipped value loss (none without a value head: --advantage
    rloo) - ent_coef * entropy, its token mean over the minibatch on every rank. Returns each micro-batch's stats and
    the epochs run (--target-kl may stop early)."""
    (B, T), stats = b["mask"].shape, []
    mb_size = B // args.num_minibatches
    micro = mb_size // args.grad_accum
    model.train()
    for epoch in range(args.ppo_epochs):
        perm, epoch_start = torch.randperm(B, device=args.device), len(stats)
        for mb_start in range(0, B, mb_size):
            mb = perm[mb_start: mb_start + mb_size]
            mb_tokens = all_sum(b["mask"][mb].sum()).clamp(min=1)    # tokens of the minibatch over all ranks
            for s in range(0, mb_size, micro):
                m = mb[s: s + micro]
                with autocast(args.device, args.dtype):
                    logprobs, values, logits = forward(model, value_head, b["input_ids"][m], b["attention_mask"][m],
                                                       T, args.temperature, forbid)
                pg_loss, vf_loss, st = ppo_loss(logprobs, b["logprobs"][m], b["advantages"][m], values,
                                                b["values"][m], b["returns"][m], b["mask"][m], args.clip_range,
                                                args.clip_range_value)
                with torch.set_grad_enabled(args.ent_coef != 0):  # without the bonus it is only logged
                    entropy = masked_mean(entropy_from_logits(logits), b["mask"][m])
                loss = pg_loss + (args.vf_coef * vf_loss if vf_loss is not None else 0.0) - args.ent_coef * entropy
                scaler.scale(loss * b["mask"][m].sum() / mb_tokens).backward()  # exact token mean over the minibatch
                stats.append({**st, "losses/policy_loss": pg_loss.item(), "losses/entropy": entropy.item(),
                              **({"losses/value_loss": vf_loss.item()} if vf_loss is not None else {})})
            for p in params:  # torchrun: sum the ranks' gradients (identity for one process)
                if p.grad is not None:
                    all_sum(p.grad)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        epoch_kl = np.mean([st["policy/approx_kl"] for st in stats[epoch_start:]])
        epoch_kl = all_sum(torch.tensor(epoch_kl, device=args.device)) / world
        if args.target_kl is not None and epoch_kl > args.target_kl:
            break  # early stop on this epoch's approx KL: the policy moved far enough from the behaviour policy
    model.eval()
    return stats, epoch + 1


def dump_rollouts(step: int, rank: int, b: dict, kl_coef: float, params, out_dir) -> None:
    """--dump-rollouts (an audit): every tensor of an iteration and a checksum of the parameters after its update, to
    out_dir/step<N>_rank<R>.pt."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"texts": b["texts"], "delta": b["delta"], "kl_coef": kl_coef, **{k: b[k] for k in (
        "query", "response", "kl", "mask", "values", "has_eos", "advantages", "returns")},
        "param_checksum": sum(p.detach().double().sum().item() for p in params)},
        Path(out_dir) / f"step{step}_rank{rank}.pt")


def policy_logprobs(model, b, forbid, micro, args):
    """log pi(y_t | x, y_<t) of the batch's response tokens under the model as it is now, (B, T), no grad: in the
    same chunks as score_rollouts (the same shapes, so a token whose probability did not move gets Delta = 0)."""
    (B, T), out = b["mask"].shape, []
    rows = scoring_rows(b, micro, model, args)
    with torch.no_grad(), autocast(args.device, args.dtype):
        for s in range(0, B, rows):
            out.append(forward(model, None, b["input_ids"][s:s + rows], b["attention_mask"][s:s + rows], T,
                               args.temperature, forbid)[0])
    return torch.cat(out)


def trace_iteration(step, out_dir, model, b, g, recs, feedback, kl_coef, forbid, micro, args, rank) -> None:
    """--trace-samples N: where this iteration's update went, one line of out_dir/trace.jsonl (rank 0 writes; resume
    cuts it back like metrics.jsonl). After step 6, one more no-grad forward gives Delta_t = log pi_new - log pi_old
    of every response token. The line holds the locality of Delta over the global batch (locality_summary), that of
    the advantages under both reward modes (the other mode's from the same delta, KL, V and beta), and N of this
    rank's rollouts, those with a poor span first: each token's text, delta, KL, V, the old and new log-probs, and r
    and A under both modes. It draws nothing random: a run is the same with or without it. 04's report draws it
    ("Where the update went"); bench/locality.py measures with it."""
    B, T = b["mask"].shape
    log_ratio = (policy_logprobs(model, b, forbid, micro, args) - b["logprobs"]) * b["mask"]      # (B, T): Delta_t
    locality = locality_summary(all_sum(locality_sums(log_ratio, b["delta"], b["mask"])))
    other = "scalar" if args.reward_mode == "span" else "span"
    r_other, a_other, _ = rewards_and_advantages(g, kl_coef, other, args)
    rewards, advantages = {args.reward_mode: g["rewards"], other: r_other}, {args.reward_mode: g["advantages"],
                                                                             other: a_other}     # global batch
    advantage_locality = {m: locality_summary(locality_sums(a, g["delta"], g["mask"])) for m, a in advantages.items()}
    mine = slice(rank * B, (rank + 1) * B)                                                        # this rank's rows
    rewards, advantages = ({m: x[mine, :T] for m, x in d.items()} for d in (rewards, advantages))
    if rank != 0:
        return
    flawed = ((b["delta"] < 0).float() * b["mask"]).amax(1).tolist()
    rows = sorted(range(B), key=lambda i: -flawed[i])[:args.trace_samples]      # stable: flawed first, in batch order
    num = lambda x, i, n: [float(f"{v:.6g}") + 0.0 for v in x[i, :n].tolist()]  # noqa: E731  (6 digits; no -0.0)
    samples = []
    for i in rows:
        n, text = int(b["mask"][i].sum()), b["texts"][i]
        samples.append({
            "row": i, "prompt": recs[i]["prompt"][-2000:], "critique": (feedback[i] or {}).get("critique"),
            "tokens": [text[a:z] for a, z in b["offsets"][i]], "has_eos": bool(b["has_eos"][i]),
            "delta": num(b["delta"], i, n), "kl": num(b["kl"], i, n), "values": num(b["values"], i, n),
            "rewards": {m: num(r, i, n) for m, r in rewards.items()},
            "advantages": {m: num(a, i, n) for m, a in advantages.items()},
            "logprobs_old": num(b["logprobs"], i, n), "logprobs_new": num(b["logprobs"] + log_ratio, i, n)})
    with open(Path(out_dir) / "trace.jsonl", "a", encoding="utf-8") as f:
        common.append_jsonl(f, {"step": step, "reward_mode": args.reward_mode, "kl_coef": kl_coef,
                                "locality": locality, "advantage_locality": advantage_locality, "samples": samples})


def log_iteration(step, out_dir, it: dict, args, rank, world) -> dict:
    """Step 7: one line of metrics.jsonl, computed on the global batch it["g"] (every rank's rollouts), and every
    --log-every iterations four sample rollouts with their critique (rank 0 writes). `it`, the iteration: its records
    "recs", this rank's batch "b" and the global one "g", "feedback", "counts" [unparsed critiques, quotes, quotes not
    found], "watched" (the monitor's sums, {} without one; logged as means over the batch), ppo_update's "stats" and
    "epochs", the "kl_coef" and "lr" it used, and its "clock" (time.time() at its start and after sampling,
    critiquing, scoring and updating). Returns the metrics row."""
    b, g, stats, clock, watched = it["b"], it["g"], it["stats"], it["clock"], it["watched"]
    counts = all_sum(torch.tensor(it["counts"], dtype=torch.float, device=args.device))  # parse fails, quotes, misses
    if watched:
        watched = dict(zip(watched, (all_sum(torch.stack(list(watched.values())).to(args.device)) / args.batch_size)
                           .tolist()))
    ppo_stats = all_sum(torch.tensor([np.mean([s[k] for s in stats]) for k in stats[0]], device=args.device)) / world
    mask, returns = g["mask"], g["returns"]
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    explained = 1 - masked_mean((returns - g["values"]) ** 2, mask) / var_returns if var_returns > 0 else 0.0
    row = {"step": step, "objective/kl": g["kl"].sum(1).mean().item(), "objective/kl_coef": it["kl_coef"],
           "objective/entropy": ppo_stats[list(stats[0]).index("losses/entropy")].item(),
           "objective/span_reward": (g["delta"] * mask).sum(1).mean().item(),
           "objective/rlhf_reward": g["rewards"].sum(1).mean().item(),
           **{k: v.item() for k, v in zip(stats[0], ppo_stats)},
           **({"val/explained_variance": float(explained)} if args.advantage == "gae" else {}),  # rloo: no value head
           "critic/parse_fail_rate": counts[0].item() / args.batch_size,
           "critic/unmatched_span_rate": counts[2].item() / max(counts[1].item(), 1),
           "critic/tokens_labelled_frac": ((g["delta"] != 0).float() * mask).sum().item() / mask.sum().item(),
           "critic/mistake_rate": ((g["delta"] < 0).float() * mask).amax(1).mean().item(),
           **watched,
           "response/length": mask.sum(1).mean().item(), "response/eos_rate": g["has_eos"].float().mean().item(),
           "policy/epochs": it["epochs"], "lr": it["lr"], "time/generate_s": clock["sampled"] - clock["start"],
           "time/critic_s": clock["critiqued"] - clock["sampled"],
           "time/forward_s": clock["scored"] - clock["critiqued"], "time/update_s": clock["updated"] - clock["scored"],
           "time/step_s": time.time() - clock["start"]}
    if rank == 0:
        with open(out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            common.append_jsonl(f, row)
    if rank == 0 and (step % args.log_every == 0 or step == args.steps):
        with open(out_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            for rec, text, fb, delta, m in list(zip(it["recs"], b["texts"], it["feedback"], b["delta"], b["mask"]))[:4]:
                fb = fb or {"critique": None, "good_spans": [], "poor_spans": []}
                common.append_jsonl(f, {"step": step, "prompt": rec["prompt"], "response": text, **fb,
                                        "span_reward": (delta * m).sum().item()})
    return row


# ----------------------------------------------------------------------------------------------------------------------
# Setup: the prompts and their order, the SFT warm start, checkpoints and resume
# ----------------------------------------------------------------------------------------------------------------------


def read_prompts(path: str, task: str, critic: str) -> list[dict]:
    """The prompt records, read before anything is written: a JSONL file with a "prompt" field or, for --task code
    --critic program or python:..., any benchmark layout (tasks.code.read_code_problems), whose tests the critic
    runs."""
    if task == "code" and (critic == "program" or plugin.is_plugin(critic)):
        from tasks.code import read_code_problems
        numbered = list(enumerate(read_code_problems(path), 1))
    else:
        numbered = list(common.iter_jsonl(path, required=("prompt",)))  # (line number, record)
    records = [rec for _, rec in numbered]
    if not records:
        raise common.DataError(f"{path}: no prompts")
    if task == "demo":  # its exact critic and monitor read the facts off each post: own prompts fail here, not mid-run
        from tasks.demo import demo_post_facts
        for lineno, rec in numbered:
            try:
                demo_post_facts(rec["prompt"])
            except ValueError:
                raise common.DataError(f"{path}:{lineno}: prompt: not a demo post (--task demo reads the demo's facts "
                                       "off each post; --task summarization or qa for your own prompts)") from None
    return records


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The prompt indices of an iteration: consecutive slices of a fresh permutation per pass over the data, derived
    from (seed, step) alone so a resumed run draws exactly the same prompts."""
    out, pos = [], step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset: offset + batch_size - len(out)]
        out += take
        pos += len(take)
    return out


def sft_warm_start(args, rank: int, resuming: bool = False) -> str:
    """Supervised fine-tuning of --model on (prompt, --sft-field) of --sft-data before PPO, the loss on the response
    and its EOS only: --sft-steps AdamW steps on batches drawn with replacement, left-padded as in generation; LoRA
    (--sft-lora-r > 0) is merged into the weights afterwards. Trained once, on rank 0 (the others wait), and saved to
    --sft-output-dir as full weights that later runs (the scalar baseline among them) reuse (resuming: only reused,
    never trained, reuse_sft). Returns that folder."""
    from tqdm.auto import tqdm

    sft_dir, device, dtype = Path(args.sft_output_dir), args.device, args.dtype
    lora_r = args.lora_r if args.sft_lora_r is None else args.sft_lora_r
    settings = sft_settings(args, lora_r)
    retrain = args.overwrite or getattr(args, "zero_flag", False) and sft_dir.resolve() == Path(
        PRESETS["demo"]["sft_output_dir"]).resolve()  # the literal zero-flag demo's own SFT start
    if reuse_sft(sft_dir, settings, retrain, print if rank == 0 else (lambda *a: None), resuming):
        return str(sft_dir)
    barrier()  # every rank has decided before rank 0 replaces the folder
    if rank == 0:
        model, tokenizer = models.load_model(args.model, device=device,
                                             dtype=dtype if lora_r > 0 else "float32")  # full FT: fp32 master weights
        if lora_r > 0:  # LoRA for the warm start, merged into the weights afterwards
            model = models.add_lora(model, lora_r, 2 * lora_r, args.lora_targets)
        records = common.read_jsonl(args.sft_data, required=("prompt", args.sft_field))
        if not records:
            raise common.DataError(f"{args.sft_data}: no records")
        examples = [(models.policy_prompt(tokenizer, r["prompt"], args.chat_template, args.max_prompt_tokens),
                     tokenizer(r[args.sft_field], add_special_tokens=False)["input_ids"][:args.max_new_tokens]
                     + [tokenizer.eos_token_id]) for r in records]
        model.train()
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.sft_lr)
        scaler, gen = grad_scaler(device, dtype), torch.Generator().manual_seed(args.seed)
        for _ in (bar := tqdm(range(args.sft_steps), desc="SFT warm start")):
            batch = [examples[i] for i in torch.randint(len(examples), (args.sft_batch_size,), generator=gen).tolist()]
            ids, attn = models.left_pad([p + y for p, y in batch], tokenizer.pad_token_id)
            labels = ids.masked_fill(attn == 0, -100)
            for i, (p, y) in enumerate(batch):
                labels[i, : ids.shape[1] - len(y)] = -100                          # no loss on the prompt
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            with autocast(device, dtype):
                loss = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                             labels=labels.to(device)).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()
        runs.save_pretrained(sft_dir, model.merge_and_unload() if lora_r > 0 else model, tokenizer,
                               files={"sft.json": settings})
    barrier(timeout_h=24)  # the other ranks wait for rank 0's SFT, however long it takes
    return str(sft_dir)


def sft_settings(args, lora_r: int) -> dict:
    """What an SFT start is made of (sft.json in --sft-output-dir): its flags, the SFT data's content hash and, for a
    local --model, its content (infra.runs.content_fingerprint: a base rebuilt in the same folder is another start)."""
    keys = ("model", "sft_field", "sft_steps", "sft_lr", "sft_batch_size", "lora_targets", "seed", "max_new_tokens",
            "max_prompt_tokens", "chat_template", "dtype", "max_grad_norm")
    content = runs.content_fingerprint(args.model) if Path(args.model).exists() else None  # a hub id: its name
    return json.loads(json.dumps({**{k: getattr(args, k) for k in keys}, "sft_lora_r": lora_r,  # as sft.json reads
                                  "sft_data_sha256": hashlib.sha256(Path(args.sft_data).read_bytes()).hexdigest(),
                                  "model_content": content}))


def reuse_sft(sft_dir: Path, settings: dict, retrain: bool, log, resuming: bool = False) -> bool:
    """Whether the SFT start in sft_dir is used as it is (every rank decides the same, before anything is trained):
    a model there made by these settings (sft.json), or made elsewhere (no sft.json). One made by other settings is
    refused (DataError), unless `retrain` (--overwrite, or the zero-flag demo's own runs/demo/sft): then trained again.
    A folder without a model is trained into, unless it holds files an SFT save did not write (refused: a save
    replaces only its own files). `resuming` (--resume from a checkpoint): never trained, since the checkpoint's
    weights belong to the start it began from. log: rank 0's print."""
    if not (sft_dir / "config.json").is_file():
        if resuming:
            raise common.DataError(f"--resume: the run's SFT start {sft_dir} is gone: its checkpoint cannot continue "
                                   "on another one (--overwrite starts the run again)")
        runs.check_save_dir(sft_dir, marker="sft.json", flag="--sft-output-dir ")
        return False
    made = json.loads((sft_dir / "sft.json").read_text()) if (sft_dir / "sft.json").is_file() else None
    if made is None or made == settings:
        log(f"SFT start: {sft_dir}, reused" + ("" if made else " (no sft.json: a model made elsewhere, used as it is)"))
        return True
    diff = "; ".join("--sft-data: other content" if k == "sft_data_sha256" else "--model: other content"
                     if k == "model_content" else f"--{k.replace('_', '-')}: {made.get(k)} there, {v} here"
                     for k, v in settings.items() if made.get(k) != v)
    if retrain and not resuming:
        log(f"SFT start: {sft_dir} was made with other settings ({diff}): trained again")
        return False
    raise common.DataError(f"--sft-output-dir {sft_dir} holds an SFT start made with other settings ({diff}): " + (
        "--resume continues a run only on the start it began from" if resuming else
        "--overwrite retrains it, or name another --sft-output-dir"))


def make_optimizer(params, args):
    """AdamW over the trainable parameters, and its learning rate per iteration: a linear warmup over --warmup-steps,
    then constant, or linearly annealed to 0 (--anneal-lr). scheduler.get_last_lr() is the next update's."""
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=1e-5, fused=args.compile_update or None)  # one kernel
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / max(args.warmup_steps, 1))
                                                  * (1.0 - it / args.steps if args.anneal_lr else 1.0))
    return optimizer, scheduler


def prompt_indices(step: int, n: int, args, rank: int, world: int) -> list[int]:
    """This rank's share of iteration `step`'s prompts (batch_indices): --batch-size of them, or for --advantage rloo
    --batch-size / --rloo-k of them, each --rloo-k times in a row (the k samples of a prompt, one group)."""
    k = 1 if args.advantage == "gae" else args.rloo_k
    idx = [i for i in batch_indices(step - 1, args.batch_size // k, n, args.seed) for _ in range(k)]
    local = args.batch_size // world
    return idx[rank * local:(rank + 1) * local]


def save_checkpoint(path, step: int, model, value_head, optimizer, scheduler, scaler, kl_coef: float, config: dict,
                    rank: int = 0):
    """The run's checkpoint: the trainable parameters, value head, optimizer, scheduler, loss scaler (fp16), beta,
    its settings (config) and every rank's RNG states, all a run needs to continue bit-exactly. Called on every rank
    (their RNG states are gathered); rank 0 writes it, atomically. The parameters are the same on every rank."""
    rngs = [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}]
    if dist.is_initialized():
        rngs, rng = [None] * dist.get_world_size(), rngs[0]
        dist.all_gather_object(rngs, rng)
    if rank == 0:
        state = {"step": step, "kl_coef": kl_coef, "args": config, "rng": rngs,
                 "trainable": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
                 "value_head": value_head.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}
        with common.atomic_open(path, "wb") as f:
            torch.save(state, f)


def load_checkpoint(path, model, value_head, optimizer, scheduler, scaler, rank: int = 0,
                    world: int = 1) -> tuple[int, float]:
    """Restore what save_checkpoint saved, this rank's RNG states included: (step, beta). Another world size cannot
    continue exactly (each rank's sampler state is saved): DataError."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if len(state["rng"]) != world:
        raise common.DataError(f"{path}: saved by {len(state['rng'])} process(es), resumed with {world}; resume with "
                               f"the same world size (torchrun --nproc_per_node {len(state['rng'])})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state["trainable"].items():
            params[name].copy_(tensor)
    value_head.load_state_dict(state["value_head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):  # {} when loss scaling is off (not fp16)
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"][rank]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"], state["kl_coef"]


RUN_FILES = ("metrics.jsonl", "samples.jsonl", "trace.jsonl", "checkpoint.pt", "policy")  # what a run writes


def start_kind(out_dir, resume: bool, overwrite: bool, zero_flag: bool = False) -> str:
    """How a run starts in out_dir (infra.runs.start_kind): "resume" (--resume, and a checkpoint there), "fresh" (no run
    there) or "replace" (a run there, which --overwrite gives up, or one of the zero-flag demo's own two folders on a
    rerun of the literal zero-flag command, `zero_flag`: a command with any flag never replaces them). Anything else
    is refused (DataError)."""
    out_dir = Path(out_dir)
    demo = [Path(PRESETS["demo"][key]).resolve() for key in ("output_dir", "scalar_baseline_dir")]
    return runs.start_kind(out_dir, resume, overwrite, [name for name in RUN_FILES if (out_dir / name).exists()],
                             "checkpoint.pt", (out_dir / "checkpoint.pt").is_file(),
                             zero_flag and out_dir.resolve() in demo)


def start_or_resume(out_dir, kind: str, kl_coef: float, config: dict, model, value_head, optimizer, scheduler, scaler,
                    rank: int, world: int) -> tuple[int, float]:
    """The run dir: (first step, beta). kind (start_kind) "resume" restores the checkpoint (load_checkpoint) and cuts
    metrics.jsonl, samples.jsonl and trace.jsonl back to its step; a fresh start removes the run it replaces and has
    beta = kl_coef. Rank 0 writes config.json: config, the run's settings, the world size, and one segment per
    invocation (first step, device, world size; a resume carries the earlier ones over)."""
    out_dir, last = Path(out_dir), 0
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    if kind == "resume":
        last, kl_coef = load_checkpoint(out_dir / "checkpoint.pt", model, value_head, optimizer, scheduler, scaler,
                                        rank, world)
    for path in [out_dir / name for name in RUN_FILES] if rank == 0 else ():
        if last and path.suffix == ".jsonl":  # drop the rows logged after the checkpoint
            common.write_jsonl(path, [r for r in common.read_jsonl(path) if r["step"] <= last] if path.is_file()
                               else [])
        elif not last and path.is_dir():
            shutil.rmtree(path)
        elif not last:
            path.unlink(missing_ok=True)
    if rank == 0 and last:
        print(f"resumed from {out_dir / 'checkpoint.pt'} at step {last}")
    elif rank == 0 and kind == "replace":
        print(f"{out_dir}: the run there is replaced (--overwrite, or a rerun of the zero-flag demo)", file=sys.stderr)
    if rank == 0:  # one segment per invocation, so a run resumed elsewhere still says where its iterations ran
        config_file = out_dir / "config.json"
        old = json.loads(config_file.read_text()) if kind == "resume" and config_file.is_file() else {}
        if "device" in old and "segments" not in old:  # a run from before segments: its one invocation
            old["segments"] = [{"from_step": 1, "device": old["device"], "world_size": old.get("world_size", 1)}]
        this = {"from_step": last + 1, "device": config.get("device"), "world_size": world}
        common.write_json(config_file, {**config, "world_size": world, "segments": [*old.get("segments", []), this]})
    return last + 1, kl_coef


# ----------------------------------------------------------------------------------------------------------------------
# Training: setup, then Alg. 4's loop of named steps
# ----------------------------------------------------------------------------------------------------------------------


def train(args):
    """Alg. 4: Text2Grad PPO on the critic's per-token span rewards. Returns the directory of the saved policy."""
    from tqdm.auto import tqdm

    if args.critic == "local" or (args.critic == "openai" and args.reward_model):
        reward_models.check_reward_model(args.reward_model)  # a broken reward model fails here, before any training
    check_critic(args)  # so does a served critic that cannot answer
    for flag, path in (("--model ", args.model), ("--ref-adapter ", args.ref_adapter)):
        models.check_model_path(path, flag)  # and a typo'd folder: one line, at once
    if args.sft_data and args.sft_steps > 0 and not Path(args.sft_data).is_file():  # the demo preset's, without stage 1
        raise common.DataError(f"--sft-data {args.sft_data}: no such file (stage 1 writes the demo's; --sft-steps 0 "
                               "skips the warm start)")
    kind = start_kind(args.output_dir, args.resume, args.overwrite, args.zero_flag)  # never lost unasked for
    rank, world, device = dist_init(args.device)
    args = argparse.Namespace(**{**vars(args), "device": device})  # this rank's device; the caller's args stay as given
    torch.manual_seed(args.seed)  # the same on every rank, so every rank builds the same LoRA init
    random.seed(args.seed)
    np.random.seed(args.seed)
    records = read_prompts(args.prompts, args.task, args.critic)
    start = sft_warm_start(args, rank, kind == "resume") if args.sft_data and args.sft_steps > 0 else args.model
    model, tokenizer = models.load_model(start, device=args.device,
                                         dtype=args.dtype if args.lora_r > 0 or args.ref_adapter else "float32")
    queries = [models.policy_prompt(tokenizer, r["prompt"], args.chat_template, args.max_prompt_tokens)
               for r in records]  # before any output: may raise DataError
    model, ref_model, value_head = build_policy(args, model)
    scorer, ref_scorer = compile_update(model, ref_model, args)  # steps 4 and 6's forwards (--compile-update)
    head = value_head if args.advantage == "gae" else None  # rloo: the value head is never run, nor trained
    torch.manual_seed(args.seed + rank)  # from here on each rank samples differently
    critic, monitor = make_critic(args), make_monitor(args)
    params = [p for p in model.parameters() if p.requires_grad] + (list(head.parameters()) if head is not None else [])
    optimizer, scheduler = make_optimizer(params, args)
    scaler, costs = grad_scaler(args.device, args.dtype), []
    out_dir, ckpt = Path(args.output_dir), Path(args.output_dir) / "checkpoint.pt"
    first_step, kl_coef = start_or_resume(out_dir, kind, args.kl_coef, vars(args), model, value_head, optimizer,
                                          scheduler, scaler, rank, world)
    local_bs = args.batch_size // world                                   # rollouts of this rank
    micro = local_bs // args.num_minibatches // args.grad_accum           # rows of a forward with grad
    # the behaviour policy's complete settings (nothing inherited from the hub), and what forward() must mirror
    gen_config = models.generation_config(model, args.max_new_tokens, args.temperature, args.top_p, args.min_new_tokens)
    stop = torch.tensor(models.stop_ids(model), device=args.device)
    forbid = (stop.tolist(), args.min_new_tokens)
    if args.top_p < 1 and rank == 0:
        print(f"warning: --top-p {args.top_p} < 1: this run is off-policy (rollouts are sampled from the nucleus, PPO "
              "scores log-probs of the full distribution)", file=sys.stderr)
    bar = tqdm(range(first_step, args.steps + 1), desc=f"PPO ({args.reward_mode})", initial=first_step - 1,
               total=args.steps, disable=rank != 0)
    for step in bar:
        clock = {"start": time.time()}
        idx = prompt_indices(step, len(records), args, rank, world)                               # this rank's share
        recs = [records[i] for i in idx]
        # 1. rollout: y ~ pi_theta(.|x) for this rank's share of the batch (Alg. 4, §3.5)
        b = rollout(model, tokenizer, [queries[i] for i in idx], gen_config, stop, args)
        clock["sampled"] = b["t_sampled"]  # time/generate_s: sampling alone; decoding counts as the critic's
        # 2. critique: the critic writes c and quotes good / poor spans of each y (§3.3; the learned critic: §3.4)
        feedback = critic(recs, b["texts"])
        # 3. delta: the spans -> per-token pseudo-rewards delta_t in {-1, 0, +1} (§3.3, App. L)
        b["delta"], deltas, n_spans, n_unmatched = span_deltas(b["texts"], b["offsets"], feedback, b["mask"],
                                                               args.span_weighting, args.labels)
        clock["critiqued"] = time.time()
        watched = monitor(recs, b["texts"], b["offsets"], deltas) if monitor else {}  # logged, never trained on
        # 4. rewards r_t = delta_t - beta * KL_t (§3.5) on the global batch g (torchrun: every rank's rollouts)
        b["logprobs"], b["values"], b["kl"] = score_rollouts(scorer, ref_scorer, head, b, forbid, micro, args)
        g = {k: gather_rows(b[k]) for k in ("delta", "kl", "mask", "values", "has_eos")}
        # 5. advantages A_t by GAE over the r_t of --reward-mode (§3.5), or by RLOO without the value head; whitened
        g["rewards"], g["advantages"], g["returns"] = rewards_and_advantages(g, kl_coef, args.reward_mode, args)
        mine, T = slice(rank * local_bs, (rank + 1) * local_bs), b["mask"].shape[1]                 # this rank's rows
        b["advantages"], b["returns"] = g["advantages"][mine, :T], g["returns"][mine, :T]
        clock["scored"] = time.time()
        # 6. PPO update: clipped surrogate + clipped value loss, epochs of minibatches (§3.5)
        lr = scheduler.get_last_lr()[0]  # the update's; the scheduler then steps to the next iteration's
        stats, epochs = ppo_update(scorer, head, params, optimizer, scaler, b, forbid, args, world)
        scheduler.step()
        clock["updated"] = time.time()
        if args.dump_rollouts:
            dump_rollouts(step, rank, b, kl_coef, params, args.dump_rollouts)
        if args.trace_samples:
            trace_iteration(step, out_dir, scorer, b, g, recs, feedback, kl_coef, forbid, micro, args, rank)
        # 7. log the global batch's metrics with the beta and lr this iteration used, samples; adapt beta; checkpoint
        row = log_iteration(step, out_dir, {
            "recs": recs, "b": b, "g": g, "feedback": feedback, "counts": [sum(map(critique_failed, feedback)),
            n_spans, n_unmatched], "watched": watched, "stats": stats, "epochs": epochs, "kl_coef": kl_coef, "lr": lr,
            "clock": clock}, args, rank, world)
        if args.adaptive_kl_target:
            kl_coef = update_kl_coef(kl_coef, row["objective/kl"], args.adaptive_kl_target, args.adaptive_kl_horizon,
                                     args.batch_size)
        costs.append((row["time/generate_s"], row["time/critic_s"], row["critic/parse_fail_rate"]))
        if rank == 0:
            show_progress(bar, step, row, feedback, args)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(ckpt, step, model, value_head, optimizer, scheduler, scaler, kl_coef, vars(args), rank)
    if rank == 0 and costs:
        print_critic_summary(costs, args)
    if rank == 0:  # the policy: adapter (or full weights), tokenizer and value head, loadable by infra.models.load_model
        runs.save_pretrained(out_dir / "policy", model, tokenizer, {"value_head.pt": value_head.state_dict()},
                               **({"selected_adapters": ["default"]} if hasattr(model, "peft_config") else {}))
    barrier()
    return out_dir / "policy"


def main(argv=None):
    args = parse_args(argv)
    log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None)  # torchrun: rank 0 speaks
    if args.scalar_baseline_dir:  # refused now, not after the first run, if its folder holds a run
        start_kind(args.scalar_baseline_dir, args.resume, args.overwrite, args.zero_flag)
    policy = train(args)
    log(f"policy saved to {policy}  (metrics: {Path(args.output_dir) / 'metrics.jsonl'})")
    if args.scalar_baseline_dir:  # the same run, from the same SFT start, with the information as one scalar (App. A)
        base = copy.copy(args)
        base.reward_mode, base.output_dir, base.scalar_baseline_dir = "scalar", args.scalar_baseline_dir, ""
        policy = train(base)
        log(f"scalar baseline saved to {policy}")


if __name__ == "__main__":
    try:
        main()
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
