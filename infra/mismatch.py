"""The trainer/inference mismatch of rollouts sampled by a server (infra/vllm_rollouts.py): vLLM samples y from its own
numbers, mu(y|x) (the behaviour log-probs it returns), while PPO's ratio is taken against the trainer's own re-scoring
pi_old(y|x). Kernels, batching and precision make the two differ, so the policy gradient is corrected by the importance
weight rho = pi_old / mu, as TRL's GRPO does (vllm_importance_sampling_correction; verl's rollout IS):

    loss = sum_t keep_t * rho_t * l_t / sum_t keep_t          l_t: 03's clipped surrogate per token

Modes (TRL's names and rule, trl/trainer/grpo_trainer.py; cap = TRL's vllm_importance_sampling_clip_max, default 3):
- sequence_mask (TRL's default): rho = exp(sum_t log pi_old - log mu) per sequence; a sequence with rho > cap gets
  weight 0 and, unlike TRL, leaves the loss's denominator (keep = 0), so a masked rollout does not dilute the rest;
- sequence_truncate: rho per sequence, clamped to cap;
- token_truncate: rho per token, clamped to cap (the option for long responses, whose summed log-ratio compounds);
- token_mask: rho per token; a token with rho > cap gets weight 0 and leaves the denominator.
Pure torch on (B, T) tensors; mask is 1.0 on response tokens (03's). No lower bound (TRL's clip_min is None by default).
"""

from __future__ import annotations

import torch

MODES = ("sequence_mask", "sequence_truncate", "token_truncate", "token_mask")


def importance_weights(logprobs, behaviour_logprobs, mask, mode: str = "sequence_mask", cap: float = 3.0):
    """(weights, keep), both (B, T): rho = pi_old / mu under `mode` (MODES) and `cap`, and the tokens that stay in
    the loss. weights are 0 wherever keep is 0; keep is mask with the masked sequences or tokens zeroed."""
    if mode not in MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}: one of {', '.join(MODES)}")
    # where() rather than a product: a padding position's -inf behaviour log-prob would make inf * 0 = nan
    log_ratio = torch.where(mask > 0, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))  # (B, T)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(1, keepdim=True)  # (B, 1)
    rho = torch.exp(log_ratio)  # inf past exp's range: masked, or truncated to cap
    if mode.endswith("truncate"):
        return rho.clamp(max=cap).expand_as(mask) * mask, mask
    keep = mask * (rho <= cap)
    return torch.where(keep > 0, rho.expand_as(mask), torch.zeros_like(mask)), keep


def weighted_masked_mean(losses, weights, keep):
    """The corrected token mean: sum(keep * weights * losses) / sum(keep); masked tokens leave the denominator."""
    return (losses * weights * keep).sum() / keep.sum().clamp(min=1.0)


def mismatch_stats(logprobs, behaviour_logprobs, mask, mode: str = "sequence_mask", cap: float = 3.0) -> dict:
    """The numbers to log every iteration, over the response tokens (mask), with d = log pi_old - log mu:
    - mismatch/kl: KL(mu || pi_old) by the k3 estimator, the mean of exp(d) - 1 - d (>= 0; y was sampled from mu);
    - mismatch/kl_k1: the mean of -d, the plain estimator (can be negative);
    - mismatch/abs_diff_max: the largest |d| of one token;
    - mismatch/masked_share: the share of response tokens that left the loss (importance_weights' keep = 0);
    - mismatch/capped_share: the share of response tokens whose rho (per token or their sequence's) exceeded cap,
      masked or truncated;
    - mismatch/weight_mean: the mean weight over the tokens that stayed."""
    weights, keep = importance_weights(logprobs, behaviour_logprobs, mask, mode, cap)
    under = importance_weights(logprobs, behaviour_logprobs, mask, mode.split("_")[0] + "_mask", cap)[1]
    on, kept = mask > 0, keep > 0
    d = (logprobs - behaviour_logprobs)[on]
    n = max(int(on.sum()), 1)
    return {
        "mismatch/kl": float((torch.expm1(d) - d).sum() / n),
        "mismatch/kl_k1": float(-d.sum() / n),
        "mismatch/abs_diff_max": float(d.abs().max()) if d.numel() else 0.0,
        "mismatch/masked_share": 1.0 - float(kept.sum()) / n,
        "mismatch/capped_share": 1.0 - float(under.sum()) / n,
        "mismatch/weight_mean": float(weights[kept].mean()) if kept.any() else 0.0,
    }
