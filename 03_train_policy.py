"""Stage 3: NL-Gradient policy optimisation (Text2Grad paper Sec. 3.5, Alg. 4). PPO on per-token span rewards.

One iteration of Alg. 4's loop (the step numbers below are ours; they label the blocks of train()):
  1. sample a response y ~ pi_theta(.|x) for a batch of prompts (left-padded, temperature T)
  2. the critic writes a critique c and quotes good/poor spans of y                               make_critic
  3. spans -> character intervals -> per-token pseudo-rewards delta_t in {-1, 0, +1} (Sec. 3.3)   common.span_rewards
  4. r_t = delta_t - beta * KL_t, the KL to the reference policy taken per token (Sec. 3.5)       compute_rewards
  5. advantages A_t by GAE over r_t; values V_t from a head on the policy's last hidden state     compute_gae
  6. clipped surrogate + clipped value loss - entropy bonus, for a few epochs of minibatches      ppo_loss
The pure tensor functions for 4-6 sit right below the arguments; copy them into your own project as they are.

    # the demo, after stages 1 and 2: SFT warm start, Text2Grad PPO, then the scalar-reward baseline (~2 min on CPU)
    python 03_train_policy.py
    # CPU, the demo task's programmatic critic (no reward model needed), scalar-reward ablation
    python 03_train_policy.py --critic program --reward-mode scalar --output-dir runs/demo/prog_scalar
    # GPU: an 8B policy with LoRA, the stage-2 reward model served by vLLM (see README "Scaling up")
    python 03_train_policy.py --task summarization --model meta-llama/Llama-3.1-8B-Instruct \
        --prompts data/slf5k_prompts.jsonl --critic openai --critic-base-url http://localhost:8000/v1 \
        --critic-model rm --device cuda --dtype bf16 --gradient-checkpointing --output-dir runs/slf5k/text2grad
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import common

# Defaults per task preset: the demo must fit a 2-core CPU; the others follow the paper's setup (App. A, Table 7).
PRESETS = {
    "demo": dict(model="runs/demo/base", prompts="runs/demo/data/prompts.jsonl", sft_data="runs/demo/data/sft.jsonl",
                 sft_steps=100, sft_lr=1e-3, sft_lora_r=0, sft_output_dir="runs/demo/sft",
                 reward_model="runs/demo/reward_model", output_dir="runs/demo/text2grad",
                 scalar_baseline_dir="runs/demo/scalar", steps=60, batch_size=32, max_new_tokens=32, lr=1e-3,
                 lora_r=16, lora_alpha=32, kl_coef=0.2, ppo_epochs=2, num_minibatches=2, critic_max_new_tokens=96,
                 warmup_steps=0),
    "default": dict(model=None, prompts=None, sft_data=None, sft_steps=0, sft_lr=2e-5, sft_lora_r=None,
                    sft_output_dir=None, reward_model=None, output_dir="runs/text2grad", scalar_baseline_dir="",
                    steps=1000, batch_size=64, max_new_tokens=256, lr=1e-5, lora_r=16, lora_alpha=32, kl_coef=0.05,
                    ppo_epochs=4, num_minibatches=4, critic_max_new_tokens=512, warmup_steps=0),
}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    a = p.add_argument
    # --- task, data, model
    a("--task", default="demo", choices=["demo", "summarization", "code", "qa"], help="preset and program critic")
    a("--model", help="policy base model: hub id or local dir (demo: runs/demo/base)")
    a("--prompts", help="JSONL with a 'prompt' field; --task code --critic program: KodCode-style prompt + test, or a "
                        "HumanEval / MBPP / EvalPlus file (.jsonl or .jsonl.gz)")
    a("--output-dir", help="run dir: metrics.jsonl, samples.jsonl, checkpoint.pt, policy/")
    a("--steps", type=int, help="number of PPO iterations")
    a("--seed", type=int, default=1, help="seed for sampling, prompt order and init")
    a("--resume", action="store_true", help="continue from <output-dir>/checkpoint.pt")
    a("--scalar-baseline-dir", help="after the run, train the --reward-mode scalar baseline here with the same settings"
                                    " (demo default: runs/demo/scalar; '' to skip)")
    a("--chat-template", default="auto", choices=["auto", "on", "off"], help="wrap prompts in the tokenizer's chat "
                                                                             "template (auto: if it has one)")
    a("--max-prompt-tokens", type=int, default=1024,
      help="a longer prompt keeps its last tokens (the chat template around it is kept whole);\n"
           "the reward model's input is cut the same way (common.rm_prompt), as stage 2 cut it in training")
    # --- optional SFT warm start (the paper fine-tunes on SLF5K reference summaries first)
    a("--sft-data", help="JSONL with 'prompt' and --sft-field; trains before PPO (skipped if --sft-output-dir exists)")
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
    a("--critic", default="local", choices=["local", "program", "openai"], help="who writes critique + spans")
    a("--reward-model", help="stage-2 output dir (adapter + reward_model.json), for --critic local")
    a("--critic-base-url", help="OpenAI-compatible endpoint for --critic openai (vLLM, Ollama, OpenAI)")
    a("--critic-model", default="gpt-4o", help="model name at that endpoint")
    a("--critic-api", default="chat", choices=["chat", "completions"],
      help="chat: send the request as one user message (the server applies the model's chat template);\n"
           "completions: send the exact text of common.rm_prompt (built with --reward-model's tokenizer if given,\n"
           "else the plain template), less a leading BOS the server adds itself")
    a("--critic-concurrency", type=int, default=32, help="parallel requests for --critic openai")
    a("--critic-max-new-tokens", type=int, help="max tokens of a critique")
    # --- rollouts
    a("--batch-size", type=int, help="rollouts per iteration")
    a("--max-new-tokens", type=int, help="response length limit")
    a("--min-new-tokens", type=int, default=0, help="forbid EOS before this many tokens (benchmarks); the log-probs\n"
                                                     "are scored with EOS forbidden there too, as it was sampled")
    a("--temperature", type=float, default=1.0, help="sampling temperature; log-probs use logits / T")
    a("--top-p", type=float, default=1.0, help="nucleus sampling (1.0 = off). Below 1 the run is OFF-POLICY: rollouts\n"
                                               "come from the truncated distribution, PPO scores the full one (the\n"
                                               "run log says so)")
    a("--missing-eos-penalty", type=float, default=1.0, help="subtracted from the last reward when no EOS is produced")
    # --- rewards (Sec. 3.5) and advantages
    a("--reward-mode", default="span", choices=["span", "scalar"], help="span: delta_t on every token (Text2Grad); "
                                                                        "scalar: sum of delta on the last token")
    a("--span-weighting", default="uniform", choices=["uniform", "linear-decay"],
      help="App. I ablation: linear-decay scales delta inside each span from 1 at its first token to 1/n at its last")
    a("--kl-estimator", default="k1", choices=["k1", "k3", "full"],
      help="per-token KL: k1 = log p - log q at the sampled token, k3 = (r-1) - log r,\n"
           "full = sum over the vocabulary (what the paper's code uses; needs both logits)")
    a("--kl-coef", type=float, help="initial beta")
    a("--adaptive-kl-target", type=float, default=None, help="target KL per sequence for the adaptive controller "
                                                             "(Ziegler et al.); unset = fixed beta")
    a("--adaptive-kl-horizon", type=float, default=10000, help="horizon of the adaptive KL controller")
    a("--whiten-rewards", action="store_true", help="whiten rewards (scale only) before GAE")
    a("--gamma", type=float, default=1.0, help="discount")
    a("--lam", type=float, default=0.95, help="GAE lambda")
    # --- PPO update
    a("--lr", type=float, help="learning rate (LoRA weights and value head)")
    a("--anneal-lr", action="store_true", help="linearly anneal the learning rate to 0")
    a("--warmup-steps", type=int, help="linear learning-rate warmup over the first N iterations (Adam's "
                                                   "first steps are full-size whatever the gradient's noise)")
    a("--ppo-epochs", type=int, help="passes over each batch")
    a("--num-minibatches", type=int, help="minibatches per epoch")
    a("--grad-accum", type=int, default=1, help="micro-batches per minibatch (memory)")
    a("--forward-batch-size", type=int, help="rows per no-grad forward for the old / reference log-probs and values\n"
                                             "(default: the whole batch while its logits fit in 256 MB)")
    a("--clip-range", type=float, default=0.2, help="policy ratio clip epsilon")
    a("--clip-range-value", type=float, default=0.2, help="value clip")
    a("--vf-coef", type=float, default=0.1, help="value loss coefficient")
    a("--ent-coef", type=float, default=0.0, help="entropy bonus coefficient (the paper's beta * H)")
    a("--max-grad-norm", type=float, default=1.0, help="gradient norm clip")
    a("--target-kl", type=float, default=None, help="stop an iteration's epochs early when an epoch's mean approx KL "
                                                    "exceeds this")
    # --- system
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    a("--dtype", default="float32", choices=["float32", "bf16", "fp16"],
      help="compute dtype. LoRA: the frozen base is stored in it (the adapter and value head stay float32);\n"
           "full fine-tuning: float32 master weights, bf16/fp16 autocast (fp16 with loss scaling)")
    a("--gradient-checkpointing", action="store_true", help="trade compute for memory")
    a("--save-every", type=int, default=20, help="checkpoint every N iterations")
    a("--log-every", type=int, default=10, help="write sample rollouts every N iterations")
    a("--dump-rollouts", help="audit: save every iteration's tensors (delta, KL, rewards, advantages, ...) per rank "
                              "to DIR/step<N>_rank<R>.pt")
    args = p.parse_args(argv)
    for key, value in PRESETS["demo" if args.task == "demo" else "default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
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


def weight_spans(delta, mode="uniform"):
    """App. I ablation. uniform: delta as is. linear-decay: inside each run of equal non-zero labels, the k-th of n
    tokens gets delta * (n - k) / n, so the start of a span carries most of its credit."""
    if mode == "uniform":
        return delta
    out = delta.clone()
    for b in range(delta.shape[0]):
        row, t = delta[b].tolist(), 0
        while t < len(row):
            end = t
            while end + 1 < len(row) and row[t] != 0 and row[end + 1] == row[t]:
                end += 1
            n = end - t + 1
            for k in range(n):
                out[b, t + k] = row[t] * (n - k) / n
            t = end + 1
    return out


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


def ppo_loss(logprobs, old_logprobs, advantages, values, old_values, returns, mask, clip_range, clip_range_value):
    """Clipped surrogate policy loss and clipped value loss (step 6), token-averaged under `mask`."""
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses_clipped), mask)
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    vf_loss = 0.5 * masked_mean(torch.max((values - returns) ** 2, (values_clipped - returns) ** 2), mask)
    with torch.no_grad():
        stats = {"policy/approx_kl": masked_mean(ratio - 1 - log_ratio, mask).item(),
                 "policy/clipfrac": masked_mean((pg_losses_clipped > pg_losses).float(), mask).item(),
                 "val/clipfrac": masked_mean(((values - returns) ** 2 < (values_clipped - returns) ** 2).float(),
                                             mask).item()}
    return pg_loss, vf_loss, stats


def update_kl_coef(kl_coef, observed_kl, target, horizon, n_steps):
    """Adaptive KL controller (Ziegler et al. 2019): nudge beta towards the target sequence KL."""
    error = float(np.clip(observed_kl / target - 1.0, -0.2, 0.2))
    return kl_coef * (1.0 + error * n_steps / horizon)


def entropy_from_logits(logits):
    """H of the categorical at each position, (B, T, V) -> (B, T)."""
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Model plumbing: policy with a value head, reference log-probs without a second copy of the weights
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


def forward_rows(batch, micro, n_resp, vocab, n_logits=1, budget=2 ** 26):
    """Rows per no-grad forward of the rollout phase: the whole batch in one call when its logits (n_logits tensors of
    rows x (n_resp + 1) x vocab floats) fit in `budget` elements (256 MB of fp32), else as many as fit, at least the
    training micro-batch. Fewer calls, the same numbers: a row's log-probs do not depend on its batch-mates (bit for bit
    in the pinned runs; a kernel picked by shape, e.g. for an odd batch or on a GPU, may round differently, ~1e-7)."""
    return max(micro, min(batch, budget // (n_logits * (n_resp + 1) * vocab)))


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


def build_policy(args, model):
    """Wrap the (SFT) model for PPO: LoRA (reference = adapter off) or full fine-tuning (reference = frozen copy)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    ref_model = None
    if args.ref_adapter:
        model = PeftModel.from_pretrained(model, args.ref_adapter, adapter_name="ref")
        model.load_adapter(args.ref_adapter, adapter_name="default", is_trainable=True)
        model.set_adapter("default")
    elif args.lora_r > 0:
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
    else:  # full fine-tuning: the frozen reference needs no float32 master weights
        ref_model = copy.deepcopy(model).to(DTYPES[args.dtype]).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    hidden = model.get_input_embeddings().weight.shape[1]
    value_head = torch.nn.Linear(hidden, 1, device=args.device)
    torch.nn.init.zeros_(value_head.weight)  # zero-init: V = 0 at the start, so early advantages are the returns
    torch.nn.init.zeros_(value_head.bias)
    return model, ref_model, value_head


def prompt_ids(tokenizer, prompt, args):
    """The policy's prompt ids: the chat template per --chat-template, the prompt cut from its start to fit
    --max-prompt-tokens."""
    return common.fit_prompt(tokenizer, lambda p: common.apply_template(tokenizer, p, args.chat_template), prompt,
                             args.max_prompt_tokens)[0]


def autocast(args):
    """bf16/fp16 compute over float32 master weights for full fine-tuning (a bf16 weight does not move by a 1e-6
    step); for LoRA the frozen base is stored in --dtype and autocast only matches the adapter's float32 to it."""
    import contextlib
    if args.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(args.device).type, dtype=DTYPES[args.dtype])


def grad_scaler(args):
    """Loss scaling for fp16 (its gradients underflow without it); a no-op otherwise."""
    return torch.amp.GradScaler(torch.device(args.device).type, enabled=args.dtype == "fp16")


def sft_warm_start(args, model, tokenizer):
    """Supervised fine-tuning on (prompt, --sft-field) before PPO; loss on the response and its EOS only."""
    from tqdm.auto import tqdm

    records = common.read_jsonl(args.sft_data, required=("prompt", args.sft_field))
    if not records:
        raise common.DataError(f"{args.sft_data}: no records")
    examples = []
    for r in records:
        y = tokenizer(r[args.sft_field], add_special_tokens=False)["input_ids"][:args.max_new_tokens]
        examples.append((prompt_ids(tokenizer, r["prompt"], args), y + [tokenizer.eos_token_id]))
    model.train()
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.sft_lr)
    scaler = grad_scaler(args)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.sft_steps), desc="SFT warm start")
    for _ in bar:
        batch = [examples[i] for i in torch.randint(len(examples), (args.sft_batch_size,), generator=gen).tolist()]
        ids, attn = common.left_pad([p + y for p, y in batch], tokenizer.pad_token_id)
        labels = ids.masked_fill(attn == 0, -100)
        for i, (p, y) in enumerate(batch):
            labels[i, : ids.shape[1] - len(y)] = -100                          # no loss on the prompt
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        with autocast(args):
            loss = model(input_ids=ids.to(args.device), attention_mask=attn.to(args.device),
                         position_ids=pos.to(args.device), labels=labels.to(args.device)).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


# ----------------------------------------------------------------------------------------------------------------------
# Critics: each returns, per (prompt, response), a dict from parse_feedback or None when the output was unparseable
# ----------------------------------------------------------------------------------------------------------------------


def make_critic(args):
    if args.critic == "program":
        if args.task == "demo":
            return lambda recs, texts: [common.demo_critic(r["prompt"], t) for r, t in zip(recs, texts)]
        if args.task == "code":
            return lambda recs, texts: [common.code_critic(r["prompt"], t, r["test"]) for r, t in zip(recs, texts)]
        raise common.DataError(f"--critic program: no programmatic critic for --task {args.task}")
    if args.critic == "local":
        if not args.reward_model or not Path(args.reward_model).exists():
            raise common.DataError(f"--reward-model {args.reward_model}: not found (run 02_train_reward.py first, or "
                                   "use --critic program / openai)")
        rm, rm_tok = common.load_model(args.reward_model, device=args.device, dtype=args.dtype)

        def local(recs, texts):
            raw = common.rm_critique(rm, rm_tok, [r["prompt"] for r in recs], texts, args.critic_max_new_tokens,
                                     max_prompt_tokens=args.max_prompt_tokens)
            return [_parse(x) for x in raw]
        return local
    from openai import AsyncOpenAI
    rm_tok = None  # completions API: the served reward model must see exactly its training prompt
    if args.critic_api == "completions" and args.reward_model:
        from transformers import AutoTokenizer
        rm_tok = AutoTokenizer.from_pretrained(args.reward_model)

    async def ask(client, sem, prompt, text):
        async with sem:
            if args.critic_api == "completions":
                reply = await client.completions.create(
                    model=args.critic_model, temperature=0.0, max_tokens=args.critic_max_new_tokens,
                    prompt=completions_prompt(rm_tok, prompt, text, args.max_prompt_tokens))
                return reply.choices[0].text or ""
            reply = await client.chat.completions.create(
                model=args.critic_model, temperature=0.0, max_tokens=args.critic_max_new_tokens,
                messages=[{"role": "user", "content": common.rm_user_message(prompt, text)}])
            return reply.choices[0].message.content or ""

    async def ask_all(recs, texts):  # the whole batch in flight at once, up to --critic-concurrency
        sem = asyncio.Semaphore(args.critic_concurrency)
        async with AsyncOpenAI(base_url=args.critic_base_url,
                               api_key=os.environ.get("OPENAI_API_KEY", "EMPTY")) as client:
            return await asyncio.gather(*[ask(client, sem, r["prompt"], t) for r, t in zip(recs, texts)])

    return lambda recs, texts: [_parse(x) for x in asyncio.run(ask_all(recs, texts))]


def completions_prompt(tokenizer, prompt, response, max_prompt_tokens):
    """The text a served reward model gets on /v1/completions: common.rm_prompt's, as in training. The server tokenizes
    it adding its BOS as usual, so a BOS the chat template wrote is left out of the text: one BOS, not two."""
    if tokenizer is None:
        return common.build_rm_prompt(None, prompt, response)
    text = common.build_rm_prompt(tokenizer, common.rm_prompt(tokenizer, prompt, response, max_prompt_tokens)[1],
                                  response)
    bos, adds_bos = tokenizer.bos_token, tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return text[len(bos):] if bos and adds_bos and text.startswith(bos) else text


def _parse(raw):
    try:
        return common.parse_feedback(raw)
    except ValueError:
        return None  # counted in critic/parse_fail_rate; this rollout gets delta = 0


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: one file, written to a temp name then renamed, holding everything needed to continue bit-exactly
# ----------------------------------------------------------------------------------------------------------------------


def save_checkpoint(path, step, model, value_head, optimizer, scheduler, kl_coef, args, rank=0):
    """Called on every rank (their RNG states are gathered); rank 0 writes. Parameters are identical on all ranks."""
    import torch.distributed as dist
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    rngs = [rng]
    if dist.is_initialized():
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng)
    if rank != 0:
        return
    state = {"step": step, "kl_coef": kl_coef, "args": vars(args), "rng": rngs,
             "trainable": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
             "value_head": value_head.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}
    with common.atomic_open(path, "wb") as f:
        torch.save(state, f)


def load_checkpoint(path, model, value_head, optimizer, scheduler, rank=0, world=1):
    state = torch.load(path, map_location="cpu", weights_only=False)
    if len(state["rng"]) != world:  # each rank's sampler state is in it: another world size cannot continue exactly
        raise common.DataError(f"{path}: saved by {len(state['rng'])} process(es), resumed with {world}; resume with "
                               f"the same world size (torchrun --nproc_per_node {len(state['rng'])})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state["trainable"].items():
            params[name].copy_(tensor)
    value_head.load_state_dict(state["value_head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"][rank]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"], state["kl_coef"]


def batch_indices(step, batch_size, n, seed):
    """Prompt indices of an iteration: consecutive slices of a fresh permutation per pass over the data, derived
    from (seed, step) alone so a resumed run draws exactly the same prompts."""
    out, pos = [], step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset: offset + batch_size - len(out)]
        out += take
        pos += len(take)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# torchrun (DDP) support: a single process never touches torch.distributed; these helpers are identities there.
# Each rank samples its share of the prompts; the rollouts are gathered so rewards, GAE, whitening, the KL controller
# and the logged metrics are computed on the global batch exactly as one process would; gradients are summed.
# ----------------------------------------------------------------------------------------------------------------------


def dist_init(args):
    """(rank, world size); starts the process group under torchrun (even for one process, so that
    `torchrun --nproc_per_node 1` runs the collectives): gloo on CPU; on GPU nccl for CUDA tensors and gloo for CPU
    ones (a stray CPU tensor in a collective then still works instead of failing under nccl)."""
    import torch.distributed as dist
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if args.device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gather_rows(x):
    """The (B, ...) tensors of every rank stacked along B, (B, T) ones padded with zeros to the longest T."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return x
    if x.dim() == 2:
        width = torch.tensor([x.shape[1]], device=x.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        x = F.pad(x, (0, int(width) - x.shape[1]))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_sum(x):
    """Sum of a tensor over ranks (in place)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier(timeout_h=None):
    """Wait for every rank. timeout_h: a long wait (rank 0 training the SFT warm start alone), on a gloo group of its
    own, since nccl's collectives give up after 10 minutes."""
    import datetime
    import torch.distributed as dist
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=timeout_h)) if timeout_h else None
        dist.barrier(group=group)
        if group is not None:
            dist.destroy_process_group(group)


# ----------------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------------


def train(args):
    from tqdm.auto import tqdm

    rank, world = dist_init(args)
    torch.manual_seed(args.seed)  # the same on every rank, so every rank builds the same LoRA init
    random.seed(args.seed)
    np.random.seed(args.seed)
    out_dir = Path(args.output_dir)
    records = common.read_code_problems(args.prompts) if args.task == "code" and args.critic == "program" else \
        common.read_jsonl(args.prompts, required=("prompt",))  # code: any benchmark layout, its tests run by the critic
    if not records:
        raise common.DataError(f"{args.prompts}: no prompts")
    if not args.model:
        raise common.DataError("--model is required outside the demo")
    if args.batch_size % (world * args.num_minibatches * args.grad_accum):
        raise common.DataError(f"--batch-size {args.batch_size} must divide by world size x --num-minibatches x "
                               f"--grad-accum = {world * args.num_minibatches * args.grad_accum}")

    # --- optional SFT warm start: trained once (on rank 0), saved as full weights, reused by later runs
    start_model = args.model
    if args.sft_data and args.sft_steps > 0:
        sft_dir = Path(args.sft_output_dir or out_dir / "sft")
        sft_r = args.lora_r if args.sft_lora_r is None else args.sft_lora_r
        if rank == 0 and not (sft_dir / "config.json").is_file():
            model, tokenizer = common.load_model(args.model, device=args.device,
                                                 dtype=args.dtype if sft_r > 0 else "float32")  # full FT: fp32 master
            if sft_r > 0:  # LoRA for the warm start, merged into the weights afterwards
                from peft import LoraConfig, get_peft_model
                targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
                model = get_peft_model(model, LoraConfig(r=sft_r, lora_alpha=2 * sft_r, lora_dropout=0.0,
                                                         target_modules=targets, task_type="CAUSAL_LM"))
            sft_warm_start(args, model, tokenizer)
            model = model.merge_and_unload() if sft_r > 0 else model
            tmp = sft_dir.with_name(sft_dir.name + ".tmp")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, sft_dir)
        barrier(timeout_h=24)  # the other ranks wait for rank 0's SFT, however long it takes
        start_model = str(sft_dir)
    model, tokenizer = common.load_model(start_model, device=args.device,
                                         dtype=args.dtype if args.lora_r > 0 or args.ref_adapter else "float32")
    queries = [prompt_ids(tokenizer, r["prompt"], args) for r in records]  # before any output: may raise DataError
    model, ref_model, value_head = build_policy(args, model)
    torch.manual_seed(args.seed + rank)  # from here on each rank samples differently
    critic = make_critic(args)
    params = [p for p in model.parameters() if p.requires_grad] + list(value_head.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: min(1.0, (it + 1) / max(args.warmup_steps, 1)) * (1.0 - it / args.steps if args.anneal_lr
                                                                               else 1.0))
    kl_coef, first_step = args.kl_coef, 1
    ckpt = out_dir / "checkpoint.pt"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    if args.resume and ckpt.is_file():
        last, kl_coef = load_checkpoint(ckpt, model, value_head, optimizer, scheduler, rank, world)
        first_step = last + 1
        if rank == 0:  # drop rows logged after the checkpoint
            for name in ("metrics.jsonl", "samples.jsonl"):
                kept = [r for r in common.read_jsonl(out_dir / name) if r["step"] <= last] \
                    if (out_dir / name).is_file() else []
                common.write_jsonl(out_dir / name, kept)
            print(f"resumed from {ckpt} at step {last}")
    elif rank == 0:
        for name in ("metrics.jsonl", "samples.jsonl"):
            (out_dir / name).unlink(missing_ok=True)
    if rank == 0:
        common.write_json(out_dir / "config.json", {**vars(args), "world_size": world})
    local_bs = args.batch_size // world                     # rollouts of this rank
    mb_size = local_bs // args.num_minibatches
    micro = mb_size // args.grad_accum
    # the behaviour policy's complete settings (nothing inherited from the hub), and what forward() must mirror
    gen_config = common.generation_config(model, args.max_new_tokens, args.temperature, args.top_p, args.min_new_tokens)
    stop = torch.tensor(common.stop_ids(model), device=args.device)
    forbid = (stop.tolist(), args.min_new_tokens)
    scaler = grad_scaler(args)
    if args.top_p < 1 and rank == 0:
        print(f"warning: --top-p {args.top_p} < 1: this run is off-policy (rollouts are sampled from the nucleus, PPO "
              "scores log-probs of the full distribution)", file=sys.stderr)

    costs = []  # (rollout, critic) seconds per iteration, for the summary line at the end
    bar = tqdm(range(first_step, args.steps + 1), desc=f"PPO ({args.reward_mode})", initial=first_step - 1,
               total=args.steps, disable=rank != 0)
    for step in bar:
        t0 = time.time()
        # ---- 1. rollouts: left-padded batch, sampled with the behaviour policy's exact settings
        idx = batch_indices(step - 1, args.batch_size, len(records), args.seed)[rank * local_bs:(rank + 1) * local_bs]
        batch_recs = [records[i] for i in idx]
        query, query_mask = common.left_pad([queries[i] for i in idx], tokenizer.pad_token_id)
        query, query_mask = query.to(args.device), query_mask.to(args.device)
        model.eval()
        with torch.no_grad(), autocast(args):
            seqs = model.generate(input_ids=query, attention_mask=query_mask, generation_config=gen_config)
        response = seqs[:, query.shape[1]:]                                                   # (B, T)
        is_eos = torch.isin(response, stop)                      # any stop id ends a response (Llama-3.1 has three)
        has_eos = is_eos.any(1)
        first_eos = torch.where(has_eos, is_eos.int().argmax(1), torch.full_like(has_eos, response.shape[1],
                                                                                  dtype=torch.long))
        positions = torch.arange(response.shape[1], device=response.device)
        mask = (positions[None] <= first_eos[:, None]).float()   # response tokens up to and including the EOS
        response = response.masked_fill(mask == 0, tokenizer.pad_token_id)
        T = response.shape[1]
        input_ids = torch.cat([query, response], 1)
        attention_mask = torch.cat([query_mask, mask.long()], 1)
        t_gen = time.time()

        # ---- 2-3. critique each response and turn its spans into delta_t (Sec. 3.3; common.span_rewards)
        texts, offsets = [], []
        for row, n in zip(response.tolist(), mask.sum(1).long().tolist()):
            text, offs = common.decode_with_offsets(tokenizer, row[:n])
            texts.append(text)
            offsets.append(offs)
        feedback = critic(batch_recs, texts)
        delta = torch.zeros_like(mask)
        n_spans = n_unmatched = 0
        deltas = [None] * len(feedback)
        for i, fb in enumerate(feedback):
            if fb is None:
                continue
            d, unmatched = deltas[i] = common.span_rewards(texts[i], offsets[i], fb["good_spans"], fb["poor_spans"])
            delta[i, :len(d)] = torch.tensor(d)
            n_spans += sum(1 for s in fb["good_spans"] + fb["poor_spans"] if s.strip())
            n_unmatched += len(unmatched)
        delta = weight_spans(delta, args.span_weighting)
        t_critic = time.time()
        # the demo's exact critic on the same rollouts: a reward-hacking monitor (logged, never trained on)
        exact = torch.zeros(2)
        if args.task == "demo":
            for rec, text, offs, done in zip(batch_recs, texts, offsets, deltas):
                if args.critic == "program":  # the critic above was this very one: reuse its delta
                    d = done[0]
                else:
                    fb = common.demo_critic(rec["prompt"], text)
                    d = common.span_rewards(text, offs, fb["good_spans"], fb["poor_spans"])[0]
                exact += torch.tensor([sum(d), float(min(d, default=0.0) < 0)])

        # ---- old log-probs, values, and the per-token KL to the reference policy
        with torch.no_grad(), autocast(args):
            old_logprobs, old_values, kl = [], [], []
            rows_per_call = args.forward_batch_size or forward_rows(local_bs, micro, T, model.config.vocab_size,
                                                                    2 if args.kl_estimator == "full" else 1)
            for s in range(0, local_bs, rows_per_call):  # as few calls as memory allows: (B, T, V) logits can be large
                sl = slice(s, s + rows_per_call)
                lp, v, logits = forward(model, value_head, input_ids[sl], attention_mask[sl], T, args.temperature,
                                        forbid)
                ref_lp, ref_logits = reference_forward(model, ref_model, input_ids[sl], attention_mask[sl], T,
                                                       args.temperature, forbid)
                old_logprobs.append(lp)
                old_values.append(v)
                kl.append(per_token_kl(lp, ref_lp, args.kl_estimator, logits, ref_logits))
            old_logprobs, old_values = torch.cat(old_logprobs), torch.cat(old_values)   # (B, T)
            kl = torch.cat(kl) * mask                                                   # (B, T)

            # ---- 4-5. rewards r_t = delta_t - beta*KL_t and advantages by GAE, on the global batch
            g_delta, g_kl, g_mask, g_values = (gather_rows(x) for x in (delta, kl, mask, old_values))
            g_has_eos = gather_rows(has_eos)
            seq_bonus = torch.where(g_has_eos, 0.0, -args.missing_eos_penalty)
            rewards = compute_rewards(g_delta, g_kl, g_mask, kl_coef, args.reward_mode, seq_bonus)
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, g_mask, shift_mean=False)
            g_advantages, g_returns = compute_gae(rewards, g_values, g_mask, args.gamma, args.lam)
            g_advantages = masked_whiten(g_advantages, g_mask)
            rows = slice(rank * local_bs, (rank + 1) * local_bs)                       # this rank's rollouts
            advantages, returns = g_advantages[rows, :T], g_returns[rows, :T]
        t_forward = time.time()

        # ---- 6. PPO epochs over minibatches
        model.train()
        stats = []
        for epoch in range(args.ppo_epochs):
            perm = torch.randperm(local_bs, device=args.device)
            epoch_start = len(stats)
            for mb_start in range(0, local_bs, mb_size):
                mb = perm[mb_start: mb_start + mb_size]
                mb_tokens = all_sum(mask[mb].sum()).clamp(min=1)    # tokens of the minibatch over all ranks
                for s in range(0, mb_size, micro):
                    m = mb[s: s + micro]
                    with autocast(args):
                        logprobs, values, logits = forward(model, value_head, input_ids[m], attention_mask[m], T,
                                                           args.temperature, forbid)
                    pg_loss, vf_loss, st = ppo_loss(logprobs, old_logprobs[m], advantages[m], values, old_values[m],
                                                    returns[m], mask[m], args.clip_range, args.clip_range_value)
                    with torch.set_grad_enabled(args.ent_coef != 0):  # without the bonus it is only logged
                        entropy = masked_mean(entropy_from_logits(logits), mask[m])
                    loss = pg_loss + args.vf_coef * vf_loss - args.ent_coef * entropy
                    scaler.scale(loss * mask[m].sum() / mb_tokens).backward()  # exact token mean over the minibatch
                    stats.append({**st, "losses/policy_loss": pg_loss.item(), "losses/value_loss": vf_loss.item(),
                                  "losses/entropy": entropy.item()})
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
        scheduler.step()
        model.eval()
        t_update = time.time()
        if args.dump_rollouts:
            Path(args.dump_rollouts).mkdir(parents=True, exist_ok=True)
            torch.save({"texts": texts, "query": query, "response": response, "delta": delta, "kl": kl, "mask": mask,
                        "values": old_values, "has_eos": has_eos, "advantages": advantages, "returns": returns,
                        "kl_coef": kl_coef, "param_checksum": sum(p.detach().double().sum().item() for p in params)},
                       Path(args.dump_rollouts) / f"step{step}_rank{rank}.pt")

        # ---- adaptive KL controller, logging (global batch), checkpoints
        seq_kl = g_kl.sum(1).mean().item()
        if args.adaptive_kl_target:
            kl_coef = update_kl_coef(kl_coef, seq_kl, args.adaptive_kl_target, args.adaptive_kl_horizon,
                                     args.batch_size)
        counts = all_sum(torch.tensor([sum(fb is None for fb in feedback), n_spans, n_unmatched], dtype=torch.float,
                                      device=args.device))
        exact = all_sum(exact.to(args.device)) / args.batch_size
        ppo_stats = all_sum(torch.tensor([np.mean([s[k] for s in stats]) for k in stats[0]],
                                         device=args.device)) / world
        var_returns = masked_mean((g_returns - masked_mean(g_returns, g_mask)) ** 2, g_mask)
        row = {"step": step,
               "objective/kl": seq_kl, "objective/kl_coef": kl_coef,
               "objective/entropy": ppo_stats[list(stats[0]).index("losses/entropy")].item(),
               "objective/span_reward": (g_delta * g_mask).sum(1).mean().item(),
               "objective/rlhf_reward": rewards.sum(1).mean().item(),
               **{k: v.item() for k, v in zip(stats[0], ppo_stats)},
               "val/explained_variance": (1 - masked_mean((g_returns - g_values) ** 2, g_mask) / var_returns).item()
               if var_returns > 0 else 0.0,
               "critic/parse_fail_rate": counts[0].item() / args.batch_size,
               "critic/unmatched_span_rate": counts[2].item() / max(counts[1].item(), 1),
               "critic/tokens_labelled_frac": ((g_delta != 0).float() * g_mask).sum().item() / g_mask.sum().item(),
               "critic/mistake_rate": ((g_delta < 0).float() * g_mask).amax(1).mean().item(),
               **({"exact/span_reward": exact[0].item(), "exact/mistake_rate": exact[1].item()} if args.task == "demo"
                  else {}),
               "response/length": g_mask.sum(1).mean().item(), "response/eos_rate": g_has_eos.float().mean().item(),
               "policy/epochs": epoch + 1, "lr": scheduler.get_last_lr()[0],
               "time/generate_s": t_gen - t0, "time/critic_s": t_critic - t_gen, "time/forward_s": t_forward - t_critic,
               "time/update_s": t_update - t_forward, "time/step_s": time.time() - t0}
        costs.append((row["time/generate_s"], row["time/critic_s"]))
        if rank == 0:
            with open(out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                common.append_jsonl(f, row)
            if step % args.log_every == 0 or step == args.steps:
                with open(out_dir / "samples.jsonl", "a", encoding="utf-8") as f:
                    for i in range(min(4, local_bs)):
                        fb = feedback[i] or {"critique": None, "good_spans": [], "poor_spans": []}
                        common.append_jsonl(f, {"step": step, "prompt": batch_recs[i]["prompt"], "response": texts[i],
                                                **fb, "span_reward": (delta[i] * mask[i]).sum().item()})
            bar.set_postfix(reward=f"{row['objective/span_reward']:.2f}", kl=f"{seq_kl:.2f}",
                            mistakes=f"{row['critic/mistake_rate']:.2f}")
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(ckpt, step, model, value_head, optimizer, scheduler, kl_coef, args, rank)

    if rank == 0 and costs:  # what the critic costs next to the rollout it judges (issue 17: goal <= 1.0)
        gen_s, critic_s = (float(np.median(c)) for c in zip(*costs))
        print(f"per iteration (median): rollout {gen_s:.3f} s, critic ({args.critic}) {critic_s:.3f} s = "
              f"{critic_s / max(gen_s, 1e-9):.2f}x the rollout (time/critic_s / time/generate_s)")

    # ---- the trained policy: adapter (or full weights) + tokenizer + value head, loadable by common.load_model
    policy_dir = out_dir / "policy"
    if rank == 0:
        tmp = out_dir / "policy.tmp"
        if hasattr(model, "peft_config"):
            model.save_pretrained(tmp, selected_adapters=["default"])
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(value_head.state_dict(), tmp / "value_head.pt")
        if policy_dir.exists():
            import shutil
            shutil.rmtree(policy_dir)
        os.replace(tmp, policy_dir)
    barrier()
    return policy_dir


def main(argv=None):
    args = parse_args(argv)
    log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None)  # torchrun: rank 0 speaks
    policy = train(args)
    log(f"policy saved to {policy}  (metrics: {Path(args.output_dir) / 'metrics.jsonl'})")
    if args.scalar_baseline_dir:  # the same run with the same information as one scalar at the end (App. A)
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
