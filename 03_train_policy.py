"""Stage 3: NL-Gradient policy optimisation (Text2Grad §3.5, Alg. 4): PPO on span rewards.

train() is Alg. 4's loop, one named step per line of it (the step numbers are ours):
  1. rollout          y ~ pi_theta(.|x) for a batch of prompts, left-padded, at temperature T
  2. critic           a critique c and good / poor spans quoted from each y (critics.make_critic)
  3. span_deltas      spans -> intervals -> delta_t in {-1, 0, +1}: common.span_rewards (§3.3)
  4. compute_rewards  r_t = delta_t - beta * KL_t, KL_t to the reference policy (score_rollouts)
  5. compute_gae      advantages A_t by GAE over r_t, whitened (--advantage rloo: compute_rloo)
  6. ppo_update       clipped surrogate + clipped value loss - entropy bonus, epochs of minibatches
  7. log_iteration    the global batch's metrics (infra/trace.py), samples, checkpoints
It reads top to bottom: the pure tensor functions of steps 4-6, their batch, ppo_update and
one_iteration, steps 4-6 in train()'s order (copy them as they are, torch alone:
docs/copy_the_loop.md); the policy; the steps; train(). Flags and --task presets: policy/cli.py.

    python 03_train_policy.py       # the demo after stages 1-2: SFT, Text2Grad, scalar PPO
    python 03_train_policy.py --critic program --reward-mode scalar --output-dir runs/demo/prog
    python 03_train_policy.py --critic prm --reward-model runs/demo/prm --output-dir runs/demo/prm_ppo
    python 03_train_policy.py --task summarization --model meta-llama/Llama-3.1-8B-Instruct \
        --prompts data/slf5k_prompts.jsonl --critic openai --critic-model rm \
        --critic-base-url http://localhost:8000/v1 --device cuda --dtype bf16 \
        --gradient-checkpointing --output-dir runs/slf5k/text2grad
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import common
import critics
from baselines import self_distill
from critics import critique_failed, make_critic, span_deltas
from infra import decoding, distributed, mismatch, models, runs, sft, trace, tracking, trainable
from infra import vllm_rollouts as vr
from infra.data import read_prompts
from infra.locality import locality_sums, locality_summary
from infra.trainable import build_policy, make_optimizer
from policy import cli as policy_cli
from policy.rloo import compute_rloo
from policy.cli import DEMO_RUNS, PRESETS

# ----------------------------------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions. Shapes: B rollouts, T response tokens; mask: 1.0 on them.
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """One iteration's batch, filled in by rollout (1), delta (3), score_rollouts (4) and step 5;
    ppo_update (6) reads it. torchrun's global batch (every rank's rows) is one too."""

    mask: torch.Tensor  # (B, T) 1.0 on response tokens, up to and including the first EOS
    has_eos: torch.Tensor | None = None  # (B,) bool: the response ended with a stop id
    input_ids: torch.Tensor | None = None  # (B, P + T) prompt and response, left-padded
    attention_mask: torch.Tensor | None = None  # (B, P + T)
    texts: list[str] | None = None  # the responses decoded
    offsets: list[list[tuple[int, int]]] | None = None  # each token's character interval
    delta: torch.Tensor | None = None  # (B, T) delta_t, the critic's pseudo-rewards (step 3)
    logprobs: torch.Tensor | None = None  # (B, T) log pi_old(y_t), the sampling policy's (step 4)
    values: torch.Tensor | None = None  # (B, T) V_old(s_t); 0 without a value head
    kl: torch.Tensor | None = None  # (B, T) KL_t to the reference policy
    rewards: torch.Tensor | None = None  # (B, T) r_t (step 5)
    advantages: torch.Tensor | None = None  # (B, T) A_t, whitened
    returns: torch.Tensor | None = None  # (B, T) the value head's targets
    behaviour_logprobs: torch.Tensor | None = None  # (B, T) log mu(y_t): a served sampler's
    weights: torch.Tensor | None = None  # (B, T) rho = pi_old / mu (None: 1)
    keep: torch.Tensor | None = None  # (B, T) the tokens kept in the loss (None: mask)


def masked_mean(x, mask, dim=None):
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the masked entries; shift_mean=False keeps the mean (rewards).
    std: the population one (TRL's whiten: the unbiased one, sqrt(N / (N - 1)) apart)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return (whitened if shift_mean else whitened + mean) * mask


def per_token_kl(logprobs, ref_logprobs, estimator="k1", logits=None, ref_logits=None):
    """KL_t to the reference: Schulman's k1 / k3 from the sampled tokens' log-probs (B, T), or the
    exact KL over the vocabulary ("full") from both models' logits (B, T, V)."""
    if estimator == "full":
        logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
        return (logp.exp() * (logp - logq)).sum(-1)
    log_ratio = logprobs - ref_logprobs
    return log_ratio if estimator == "k1" else torch.expm1(-log_ratio) + log_ratio


def compute_rewards(delta, kl, mask, kl_coef, mode="span", seq_bonus=None):
    """r_t (§3.5, step 4). span: r_t = delta_t - beta*KL_t. scalar (App. A, Setting B):
    r_t = -beta*KL_t, plus sum_t delta_t at the last response token. seq_bonus (B,): at the last
    token in both modes."""
    rewards = -kl_coef * kl * mask
    last = mask.sum(1).long().clamp(min=1) - 1  # (B,) the EOS if one was sampled, never a pad
    rows = torch.arange(mask.shape[0], device=mask.device)
    if mode == "span":
        rewards = rewards + delta * mask
    else:
        rewards[rows, last] += (delta * mask).sum(1)
    if seq_bonus is not None:
        rewards[rows, last] += seq_bonus
    return rewards * mask


def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """GAE (step 5), a reversed loop: A_t = sum_l (gamma*lam)^l td_{t+l},
    td_t = r_t + gamma*V_{t+1} - V_t, V = 0 after the last valid token.
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


def ppo_loss(
    logprobs, old_logprobs, advantages, values, old_values, returns, mask, clip_range, clip_range_value, weights=1.0
):
    """Clipped surrogate policy loss and clipped value loss (step 6), token means under `mask`.
    values None (no value head: --advantage rloo): no value loss (None) and no value statistic.
    weights (B, T): each token's surrogate times its importance weight (server rollouts); 1.0: none."""
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses_clipped) * weights, mask)  # x * 1.0 is x, bit for bit
    with torch.no_grad():
        stats = {
            "policy/approx_kl": masked_mean(ratio - 1 - log_ratio, mask).item(),
            "policy/clipfrac": masked_mean((pg_losses_clipped > pg_losses).float(), mask).item(),
        }
    if values is None:
        return pg_loss, None, stats
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    vf_losses = (values - returns) ** 2
    vf_losses_clipped = (values_clipped - returns) ** 2
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


def explained_variance(values, returns, mask) -> float:
    """1 - Var[returns - V] / Var[returns] over the masked tokens (CleanRL's): 1 when V predicts
    the returns up to a constant, 0 when it predicts nothing of them."""

    def var(x):
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

    var_returns = var(returns)
    return float(1 - var(returns - values) / var_returns) if var_returns > 0 else 0.0


@dataclass
class PpoHParams:
    """Step 6's settings (03's flags of the same names)."""

    ppo_epochs: int = 4  # passes over the batch
    num_minibatches: int = 4  # minibatches per pass
    grad_accum: int = 1  # micro-batches per minibatch (memory)
    clip_range: float = 0.2  # policy ratio clip epsilon
    clip_range_value: float = 0.2  # value clip
    vf_coef: float = 0.1
    ent_coef: float = 0.0  # the entropy bonus
    max_grad_norm: float = 1.0
    target_kl: float | None = None  # stop the epochs once an epoch's mean approx KL exceeds it


def no_reduction(x):
    return x


def ppo_update(
    score, batch: Rollouts, params, optimizer, hp: PpoHParams, scaler=None, all_sum=no_reduction, clip_grad_norm=None
):
    """Step 6 (§3.5): hp.ppo_epochs passes over the batch, in hp.num_minibatches minibatches of
    hp.grad_accum micro-batches. loss = clipped surrogate + vf_coef * clipped value loss
    - ent_coef * entropy, its token mean over the minibatch on every rank; gradients clipped.
    score(rows) -> (log-probs, values or None, logits / T or None) of those rows now, with grad
    (logits None: no entropy, so ent_coef must be 0). scaler: a torch.amp.GradScaler (fp16), or
    None. all_sum: a sum over torchrun's ranks, in place; clip_grad_norm(params, max_norm): torch's
    (None) or one over sharded gradients. Returns each micro-batch's stats and the epochs run."""
    clip_grad_norm = clip_grad_norm or torch.nn.utils.clip_grad_norm_
    B = batch.mask.shape[0]
    keep = batch.mask if batch.keep is None else batch.keep  # server rollouts: the mismatch masks some out
    stats = []  # each micro-batch's stats, token means, and its number of tokens ("tokens")
    mb_size = B // hp.num_minibatches
    micro = mb_size // hp.grad_accum
    for epoch in range(hp.ppo_epochs):
        perm = torch.randperm(B, device=batch.mask.device)
        epoch_start = len(stats)
        for mb_start in range(0, B, mb_size):
            mb = perm[mb_start : mb_start + mb_size]
            mb_tokens = all_sum(keep[mb].sum()).clamp(min=1)  # on all ranks
            for s in range(0, mb_size, micro):
                m = mb[s : s + micro]
                logprobs, values, logits = score(m)
                pg_loss, vf_loss, st = ppo_loss(
                    logprobs,
                    batch.logprobs[m],
                    batch.advantages[m],
                    values,
                    batch.values[m],
                    batch.returns[m],
                    keep[m],
                    hp.clip_range,
                    hp.clip_range_value,
                    1.0 if batch.weights is None else batch.weights[m],
                )
                loss = pg_loss + (hp.vf_coef * vf_loss if vf_loss is not None else 0.0)
                st["losses/policy_loss"] = pg_loss.item()
                if vf_loss is not None:
                    st["losses/value_loss"] = vf_loss.item()
                if logits is not None:
                    with torch.set_grad_enabled(hp.ent_coef != 0):  # else only logged
                        entropy = masked_mean(entropy_from_logits(logits), keep[m])
                    loss, st["losses/entropy"] = loss - hp.ent_coef * entropy, entropy.item()
                loss = loss * keep[m].sum() / mb_tokens  # the minibatch's exact token mean
                (loss if scaler is None else scaler.scale(loss)).backward()
                st["tokens"] = keep[m].sum().item()
                stats.append(st)
            for p in params:  # torchrun: the ranks' gradients summed
                if p.grad is not None:
                    all_sum(p.grad)
            if scaler is not None:
                scaler.unscale_(optimizer)  # the clip sees the true gradients
            clip_grad_norm(params, hp.max_grad_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        epoch_kl = [(st["policy/approx_kl"] * st["tokens"], st["tokens"]) for st in stats[epoch_start:]]
        kls = all_sum(torch.tensor(epoch_kl, dtype=torch.float64, device=batch.mask.device).sum(0))
        if hp.target_kl is not None and kls[0] / kls[1].clamp(min=1) > hp.target_kl:  # its token mean, as the loss
            break  # early stop: the policy moved far enough from the behaviour policy
    return stats, epoch + 1


def one_iteration(batch: Rollouts, ref_logprobs, score, params, optimizer, hp, kl_coef, gamma, lam, eos_penalty=0.0):
    """Steps 4-6 on rollouts with the critic's delta_t, in the order train() runs them (its
    defaults: --reward-mode span --advantage gae). batch: mask, has_eos, delta, and the sampling
    policy's logprobs and values, no grad; ref_logprobs (B, T): the reference's."""
    mask = batch.mask
    kl = per_token_kl(batch.logprobs, ref_logprobs) * mask  # 4. KL_t (k1)
    seq_bonus = torch.where(batch.has_eos, 0.0, -eos_penalty)  # (B,) no EOS: --missing-eos-penalty
    batch.rewards = compute_rewards(batch.delta, kl, mask, kl_coef, "span", seq_bonus)  # r_t
    advantages, batch.returns = compute_gae(batch.rewards, batch.values, mask, gamma, lam)  # 5.
    batch.advantages = masked_whiten(advantages, mask)  # the returns stay raw: V's targets
    return ppo_update(score, batch, params, optimizer, hp)  # 6. the clipped PPO update


# ----------------------------------------------------------------------------------------------------------------------
# The policy: log-probs and values in one forward, the reference without a second copy
# ----------------------------------------------------------------------------------------------------------------------


def forward(model, value_head, input_ids, attention_mask, n_resp, temperature, forbid=None):
    """Log-probs of the last n_resp tokens, the values of the states before them, and the
    logits / T (of those positions only: logits_to_keep). forbid = (ids, n): ids generate() could
    not sample at the first n positions (--min-new-tokens) get the lowest logit there too: the
    log-probs are those of the distribution that was sampled."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        output_hidden_states=value_head is not None,
        logits_to_keep=n_resp + 1,
    )
    logits = out.logits[:, :-1].float() / temperature  # (B, T, V): position t predicts t+1
    if forbid and forbid[1] > 0:  # finite, not -inf: 0 * logit stays 0 in the entropy and KL
        logits[:, : forbid[1], forbid[0]] = torch.finfo(logits.dtype).min
    logprobs = torch.gather(logits.log_softmax(-1), 2, input_ids[:, -n_resp:, None]).squeeze(-1)  # (B, T)
    values = None
    if value_head is not None:
        hidden = out.hidden_states[-1][:, -n_resp - 1 : -1]  # (B, T, H), post final norm
        values = value_head(hidden.to(value_head.weight.dtype)).squeeze(-1).float()  # (B, T)
    return logprobs, values, logits


def reference_forward(model, ref_model, input_ids, attention_mask, n_resp, temperature, forbid=None):
    """(log-probs, logits) of pi_ref: the same weights with the LoRA adapter switched off (or the
    --ref-adapter switched on); only full fine-tuning needs the frozen copy `ref_model`."""
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


# ----------------------------------------------------------------------------------------------------------------------
# The steps of one iteration (Alg. 4), in the order train() calls them
# ----------------------------------------------------------------------------------------------------------------------


def rollout(model, tokenizer, queries, gen_config, stop, args, server=None) -> tuple[Rollouts, float]:
    """Step 1 (§3.5): y ~ pi_theta(.|x) for a left-padded batch, the behaviour policy's settings
    exactly; mask is 1.0 up to and including the first stop id (Llama-3.1 has three). Each response
    is decoded with every token's character interval (common.decode_with_offsets, §3.3). Returns
    the batch and the time sampling ended (decoding counts as the critic's time)."""
    query, query_mask = (x.to(args.device) for x in models.left_pad(queries, tokenizer.pad_token_id))
    model.eval()
    if server is not None:  # --rollout-server: vLLM samples them, with its log-probs mu (infra/vllm_rollouts.py)
        response, behaviour = vr.served_rollouts(server, model, queries, gen_config, stop, tokenizer.pad_token_id)
    else:  # transformers' generate (--compile-generation: the same tokens, compiled); no other sampler's mu
        response, behaviour = decoding.generate(model, query, query_mask, gen_config, args), None  # (B, T)
    is_eos = torch.isin(response, stop)
    has_eos = is_eos.any(1)  # (B,)
    no_eos = torch.full_like(has_eos, response.shape[1], dtype=torch.long)
    first_eos = torch.where(has_eos, is_eos.int().argmax(1), no_eos)
    positions = torch.arange(response.shape[1], device=response.device)
    mask = (positions[None] <= first_eos[:, None]).float()  # (B, T)
    response = response.masked_fill(mask == 0, tokenizer.pad_token_id)
    sampled = time.time()
    texts, offsets = zip(
        *[
            common.decode_with_offsets(tokenizer, row[:n])
            for row, n in zip(response.tolist(), mask.sum(1).long().tolist())
        ]
    )
    return Rollouts(
        mask,
        has_eos,
        torch.cat([query, response], 1),
        torch.cat([query_mask, mask.long()], 1),
        list(texts),
        list(offsets),
        behaviour_logprobs=behaviour,
    ), sampled


def no_grad_chunks(fn, b: Rollouts, micro: int, model, args) -> list:
    """fn(input_ids, attention_mask) -> tensors (rows, ...) on the batch, in as few no-grad
    forwards as memory allows ((B, T, V) logits can be large), concatenated."""
    rows = trainable.scoring_rows(b.mask, micro, model, args)
    with torch.no_grad(), distributed.autocast(args.device, args.dtype):
        out = [fn(b.input_ids[s : s + rows], b.attention_mask[s : s + rows]) for s in range(0, len(b.mask), rows)]
    return [torch.cat(x) for x in zip(*out)]


def score_rollouts(model, ref_model, value_head, b: Rollouts, forbid, micro, args):
    """Step 4, no grad: the behaviour policy's log-probs and values (0 without a value head),
    and KL_t to the reference, each (B, T)."""
    T = b.mask.shape[1]

    def score(ids, attn):
        lp, v, logits = forward(model, value_head, ids, attn, T, args.temperature, forbid)
        ref_lp, ref_logits = reference_forward(model, ref_model, ids, attn, T, args.temperature, forbid)
        kl = per_token_kl(lp, ref_lp, args.kl_estimator, logits, ref_logits)
        return lp, torch.zeros_like(lp) if v is None else v, kl

    logprobs, values, kl = no_grad_chunks(score, b, micro, model, args)
    return logprobs, values, kl * b.mask


def self_teacher_delta(model, tokenizer, recs, b: Rollouts, feedback, forbid, micro, args):
    """--reward-mode self_distill, no grad: delta_t = log pi(y_t | x, y, c) - log pi(y_t | x), the
    policy given the critique c of its answer y as the teacher (baselines/self_distill.py)."""
    T = b.mask.shape[1]
    ids, attn, has_critique = self_distill.teacher_inputs(
        tokenizer, recs, b.texts, feedback, b.input_ids[:, -T:], b.mask, args
    )
    teacher = Rollouts(b.mask, input_ids=ids, attention_mask=attn)
    score = lambda i, a: forward(model, None, i, a, T, args.temperature, forbid)[:1]  # noqa: E731
    return self_distill.delta(no_grad_chunks(score, teacher, micro, model, args)[0], b.logprobs, b.mask, has_critique)


def rewards_and_advantages(g: Rollouts, kl_coef: float, reward_mode: str, args):
    """Steps 4-5 on the global batch g: r_t = delta_t - beta*KL_t of reward_mode (the missing-EOS
    penalty, --whiten-rewards, --center-delta), then A_t by GAE (or --advantage rloo), whitened
    (--advantage token: A_t = r_t).
    Returns (rewards, advantages, returns), each (B, T)."""
    seq_bonus = torch.where(g.has_eos, 0.0, -args.missing_eos_penalty)  # (B,)
    delta = g.delta
    if args.center_delta:  # no reward mean for the early tokens' returns to accumulate
        delta = g.delta - masked_mean(g.delta, g.mask)
    rewards = compute_rewards(delta, g.kl, g.mask, kl_coef, "scalar" if reward_mode == "scalar" else "span", seq_bonus)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, g.mask, shift_mean=False)
    if args.advantage == "token":  # A_t = r_t, nothing after it (SDPO's per-token signal): no value head, not whitened
        return rewards, rewards, rewards
    if args.advantage == "gae":
        advantages, returns = compute_gae(rewards, g.values, g.mask, args.gamma, args.lam)
    else:
        advantages, returns = compute_rloo(rewards, g.mask, args.rloo_k, args.gamma, args.rloo_baseline)
    return rewards, masked_whiten(advantages, g.mask), returns


def global_advantages(b: Rollouts, kl_coef: float, args, rank: int) -> Rollouts:
    """Steps 4-5 on the global batch g (torchrun: every rank's rows; else b's own): r_t, A_t and
    returns by rewards_and_advantages, this rank's rows of them set on b. Returns g."""
    g = Rollouts(**{k: distributed.gather_rows(getattr(b, k)) for k in ("mask", "has_eos", "delta", "kl", "values")})
    g.rewards, g.advantages, g.returns = rewards_and_advantages(g, kl_coef, args.reward_mode, args)
    mine, T = slice(rank * len(b.mask), (rank + 1) * len(b.mask)), b.mask.shape[1]
    b.advantages, b.returns = g.advantages[mine, :T], g.returns[mine, :T]
    return g


def update(scorer, head, b: Rollouts, params, optimizer, scaler, forbid, args):
    """Step 6: ppo_update on this rank's rows, the policy in train mode (its dropout is off).
    Rollouts sampled by vLLM get the importance weights rho = pi_old / mu, masked or capped."""
    T = b.mask.shape[1]
    if b.behaviour_logprobs is not None:  # the trainer/inference mismatch (infra/mismatch.py, --rollout-is-mode)
        mode = (args.rollout_is_mode, args.rollout_is_cap)
        b.weights, b.keep = mismatch.importance_weights(b.logprobs, b.behaviour_logprobs, b.mask, *mode)

    def score(rows):  # the policy's log-probs, values and logits / T of these rows now, with grad
        with distributed.autocast(args.device, args.dtype):
            return forward(scorer, head, b.input_ids[rows], b.attention_mask[rows], T, args.temperature, forbid)

    hp = PpoHParams(**{k: getattr(args, k) for k in PpoHParams.__dataclass_fields__})
    scorer.train()
    reduce = (distributed.all_sum, distributed.clip_grad_norm)  # torchrun's sums; FSDP's clip
    stats, epochs = ppo_update(score, b, params, optimizer, hp, scaler, *reduce)
    scorer.eval()
    return stats, epochs


def where_it_went(scorer, b: Rollouts, g: Rollouts, kl_coef: float, forbid, micro, args, rank) -> dict:
    """--trace-samples, after step 6: one more no-grad forward gives Delta_t = log pi_new -
    log pi_old of every response token; its locality over the global batch (infra/locality.py),
    that of the advantages under both reward modes, and this rank's r (less the missing-EOS
    penalty) and A under both. It draws nothing random: a run is the same with or without it."""
    T = b.mask.shape[1]
    mine = slice(rank * len(b.mask), (rank + 1) * len(b.mask))
    new = no_grad_chunks(
        lambda ids, attn: forward(scorer, None, ids, attn, T, args.temperature, forbid)[:1], b, micro, scorer, args
    )[0]
    log_ratio = (new - b.logprobs) * b.mask  # (B, T): Delta_t
    other = "scalar" if args.reward_mode == "span" else "span"
    apart = argparse.Namespace(**{**vars(args), "missing_eos_penalty": 0.0})  # logged apart
    rewards = {m: rewards_and_advantages(g, kl_coef, m, apart)[0] for m in (args.reward_mode, other)}
    advantages = {args.reward_mode: g.advantages, other: rewards_and_advantages(g, kl_coef, other, args)[1]}
    return {
        "log_ratio": log_ratio,
        "locality": locality_summary(distributed.all_sum(locality_sums(log_ratio, b.delta, b.mask))),
        "advantage_locality": {m: locality_summary(locality_sums(a, g.delta, g.mask)) for m, a in advantages.items()},
        "rewards": {m: x[mine, :T] for m, x in rewards.items()},
        "advantages": {m: x[mine, :T] for m, x in advantages.items()},
    }


def prompt_indices(step: int, n: int, args, rank: int, world: int) -> list[int]:
    """This rank's share of iteration `step`'s prompts (the same after a resume): --batch-size of
    them, or for --advantage rloo --batch-size / --rloo-k, each --rloo-k times in a row."""
    k = args.rloo_k if args.advantage == "rloo" else 1
    idx = [i for i in runs.batch_indices(step - 1, args.batch_size // k, n, args.seed) for _ in range(k)]
    local = args.batch_size // world
    return idx[rank * local : (rank + 1) * local]


# ----------------------------------------------------------------------------------------------------------------------
# Training: setup, then Alg. 4's loop of named steps
# ----------------------------------------------------------------------------------------------------------------------


def check_run(args) -> str:
    """Every check before anything is written: the critic answers, the model folders exist, the run
    folder is free. Returns the run's kind (runs.policy_run_kind)."""
    for flag, path in (("--model ", args.model), ("--ref-adapter ", args.ref_adapter)):
        models.check_model_path(path, flag)  # and a typo'd folder: one line, at once (before the critic's checks)
    critics.check_critic(args)
    sft.check_data(args)
    return runs.policy_run_kind(args.output_dir, args.resume, args.overwrite, DEMO_RUNS * args.zero_flag)


def train(args):
    """Alg. 4: Text2Grad PPO on the critic's per-token span rewards. Returns the directory of the saved policy."""
    kind = check_run(args)  # every check before anything is written
    rank, world, device = distributed.dist_init(args.device)
    args = argparse.Namespace(**{**vars(args), "device": device})  # this rank's device; the caller's args stay as given
    distributed.seed_everything(args.seed)  # the same on every rank, so every rank builds the same LoRA init
    # --- the prompts, the policy (after the optional SFT warm start), the critic, the optimizer, the run folder
    records = read_prompts(args.prompts, args.task)
    start = args.model
    if args.sft_data and args.sft_steps > 0:
        start = sft.sft_warm_start(args, rank, kind == "resume", PRESETS["demo"]["sft_output_dir"])
    dtype = args.dtype if args.lora_r > 0 or args.ref_adapter else "float32"  # full FT: float32 master weights
    model, tokenizer = models.load_model(start, device=args.device, dtype=dtype)
    queries = [
        models.policy_prompt(tokenizer, r["prompt"], args.chat_template, args.max_prompt_tokens) for r in records
    ]  # before any output: may raise DataError
    server = vr.open_server(args, queries, args.output_dir)  # --rollout-server: it answers, or one line
    model, ref_model, value_head = build_policy(args, model)
    model, ref_model = distributed.shard(model, ref_model, args)  # --shard fsdp: FSDP2 over torchrun's ranks
    scorer, ref_scorer = trainable.compile_update(model, ref_model, args)  # steps 4 and 6's forwards (--compile-update)
    head = value_head if args.advantage == "gae" else None  # rloo, token: the value head is never run, nor trained
    torch.manual_seed(args.seed + rank)  # from here on each rank samples differently
    critic, monitor = make_critic(args), critics.make_monitor(args)
    params = [p for p in model.parameters() if p.requires_grad] + (list(head.parameters()) if head is not None else [])
    optimizer, scheduler = make_optimizer(params, args)
    scaler = distributed.grad_scaler(args.device, args.dtype)
    out_dir, ckpt = Path(args.output_dir), Path(args.output_dir) / "checkpoint.pt"
    config = {**vars(args), "prompts_content": runs.records_fingerprint(records)}  # --resume: the same prompts
    saved = runs.start_or_resume(out_dir, kind, config, model, value_head, optimizer, scheduler, scaler, rank, world)
    first_step, kl_coef = saved["step"] + 1, saved.get("kl_coef", args.kl_coef)  # resumed: the beta it had reached
    rows = saved["rows"]  # metrics.jsonl's: the failure limits and counts are the whole run's, resumes included
    tracked = tracking.open_run(tracking.parse(args.report_to), out_dir, vars(args), saved["step"], rank)  # live
    save = lambda step, rng=None: runs.save_checkpoint(  # noqa: E731
        ckpt, step, model, value_head, optimizer, scheduler, scaler, kl_coef, vars(args), rank, rng
    )
    micro = args.batch_size // world // args.num_minibatches // args.grad_accum  # rows of a forward with grad
    # the behaviour policy's complete settings (nothing inherited from the hub), and what forward() must mirror
    gen_config = models.generation_config(model, args.max_new_tokens, args.temperature, args.top_p, args.min_new_tokens)
    stop = torch.tensor(models.stop_ids(model), device=args.device)
    forbid = (stop.tolist(), args.min_new_tokens)
    bar = trace.progress_bar(first_step, args, rank)  # and a warning above it when --top-p makes it off-policy
    for step in bar:
        clock = {"start": time.time()}
        rng = runs.rng_state()  # the run as it stood, for a save after an error
        idx = prompt_indices(step, len(records), args, rank, world)  # this rank's share
        recs = [records[i] for i in idx]
        # 1. rollout: y ~ pi_theta(.|x) for this rank's share of the batch (Alg. 4, §3.5)
        b, clock["sampled"] = rollout(model, tokenizer, [queries[i] for i in idx], gen_config, stop, args, server)
        # 2. critique: the critic writes c and quotes good / poor spans of each y (§3.3; the learned critic: §3.4)
        feedback, broken = critics.judge(critic, recs, b.texts, args.device)
        if broken:  # a broken plug-in: the iterations done are kept (checkpoint as this iteration began), one line
            if step > 1:
                save(step - 1, rng)
            raise common.DataError(critics.broken(broken, step - 1))
        # 3. delta: the spans -> per-token pseudo-rewards delta_t in {-1, 0, +1} (§3.3, App. L)
        b.delta, deltas, n_spans, n_unmatched = span_deltas(
            b.texts, b.offsets, feedback, b.mask, args.span_weighting, args.labels
        )
        clock["critiqued"] = time.time()
        watched = monitor(recs, b.texts, b.offsets, deltas) if monitor else {}  # logged, never trained on
        # 4. rewards r_t = delta_t - beta * KL_t (§3.5) on the global batch g (torchrun: every rank's rollouts)
        b.logprobs, b.values, b.kl = score_rollouts(scorer, ref_scorer, head, b, forbid, micro, args)
        if args.reward_mode == "self_distill":  # delta_t from the policy given the critique instead (SDPO)
            b.delta = self_teacher_delta(scorer, tokenizer, recs, b, feedback, forbid, micro, args)
        # 5. advantages A_t by GAE over the r_t of --reward-mode (§3.5), or RLOO (no value head); whitened
        g = global_advantages(b, kl_coef, args, rank)  # g: the global batch; b: this rank's rows of it
        clock["scored"] = time.time()
        # 6. PPO update: clipped surrogate + clipped value loss, epochs of minibatches (§3.5)
        lr = scheduler.get_last_lr()[0]  # the update's; the scheduler then steps to the next iteration's
        stats, epochs = update(scorer, head, b, params, optimizer, scaler, forbid, args)
        scheduler.step()
        clock["updated"] = time.time()
        if args.dump_rollouts:
            trace.dump_rollouts(step, rank, b, kl_coef, params, args.dump_rollouts)
        if args.trace_samples:  # where the update went (one more no-grad forward; 04's report draws it)
            went = where_it_went(scorer, b, g, kl_coef, forbid, micro, args, rank)
            trace.trace_iteration(step, out_dir, b, recs, feedback, kl_coef, went, args, rank)
        # 7. log the global batch's metrics with the beta and lr this iteration used, samples; adapt beta; checkpoint
        counts = [sum(map(critique_failed, feedback)), n_spans, n_unmatched]  # failed critiques, quotes, not found
        ev = explained_variance(g.values, g.returns, g.mask)
        it = dict(recs=recs, b=b, g=g, feedback=feedback, counts=counts, watched=watched, stats=stats)
        it.update(epochs=epochs, kl_coef=kl_coef, lr=lr, explained_variance=ev, clock=clock, server=server)
        row = trace.log_iteration(step, out_dir, it, args, rank)
        tracking.log(tracked, row, step)  # --report-to: the same row, live
        if args.adaptive_kl_target:  # beta's input: the global batch's sequence KL
            kl_coef = update_kl_coef(
                kl_coef, g.kl.sum(1).mean().item(), args.adaptive_kl_target, args.adaptive_kl_horizon, args.batch_size
            )
        trace.show_progress(bar, step, row, feedback, args, rank)
        halt = critics.failing(rows, row, feedback, args)  # why the run stops here (its critic has failed), or None
        if step % args.save_every == 0 or step == args.steps or halt:
            save(step)
        if halt:
            raise common.DataError(halt)
    runs.save_policy(out_dir / "policy", model, tokenizer, value_head, rank)  # adapter or weights, loadable alone
    tracking.finish(tracked)
    distributed.barrier()
    critics.end_of_run(rows, first_step, args, rank)  # its cost; most critiques failed over the run: DataError
    return out_dir / "policy"


def parse_args(argv=None):
    """03's flags and its --task presets (policy/cli.py), checked."""
    return policy_cli.parse_args(argv, __doc__)


def main(argv=None):
    args = parse_args(argv)
    log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None)  # torchrun: rank 0 speaks
    if args.scalar_baseline_dir:  # refused now, not after the first run, if its folder holds a run
        runs.policy_run_kind(args.scalar_baseline_dir, args.resume, args.overwrite, DEMO_RUNS * args.zero_flag)
    # then the scalar baseline: the same run, from the same SFT start, with the information as one scalar (App. A)
    baseline = argparse.Namespace(
        **{**vars(args), "reward_mode": "scalar", "output_dir": args.scalar_baseline_dir, "scalar_baseline_dir": ""}
    )
    for run in [args, baseline][: 1 + bool(args.scalar_baseline_dir)]:
        runs.on_interrupt(run, [Path(__file__).name, *(sys.argv[1:] if argv is None else argv)])  # Ctrl-C: one line
        policy = train(run)
        log(
            f"policy saved to {policy}  (metrics: {Path(args.output_dir) / 'metrics.jsonl'})"
            if run is args
            else f"scalar baseline saved to {policy}"
        )


if __name__ == "__main__":
    try:
        main()
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: where the run stands and how to continue it, one line and nothing after it
        runs.exit_interrupted()
