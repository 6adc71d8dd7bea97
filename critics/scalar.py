"""03 --critic scalar-rm | prm (and --score-norm): the paper's scalar reward-model baselines as the critic (§4.3, App.
N): PPO with a Bradley-Terry reward model, and PRM-PPO with a process reward model. Stage 2 trains them
(02_train_reward.py --objective pairwise | prm: baselines/scalar_rm.py, whose scores they read, the same in training
and in use); here their scores become rewards on the response's tokens.

    python 03_train_policy.py --critic scalar-rm --reward-model runs/demo/bt_rm --output-dir runs/demo/ppo_bt  # PPO
    python 03_train_policy.py --critic prm --reward-model runs/demo/prm --output-dir runs/demo/prm_ppo     # PRM-PPO
"""

from __future__ import annotations

import torch

import common
from baselines.scalar_rm import score_responses, split_steps, token_at
from infra import models, reward_models

# What each critic needs of 03's --reward-model (its objective, checked before any training) and its name in a refusal
CRITICS = {"scalar-rm": ("pairwise", "--critic scalar-rm"), "prm": ("prm", "--critic prm")}


def check_args(args) -> None:
    """03's parse_args: --critic scalar-rm | prm needs a reward model of its objective, and has no spans to relabel."""
    if args.critic not in CRITICS:
        return
    objective, use = CRITICS[args.critic]
    reward_models.check_reward_model(args.reward_model, objective=objective, use=use)
    if args.labels == "dense" or args.span_weighting != "uniform":
        raise common.DataError(f"--critic {args.critic}: --labels and --span-weighting relabel spans, it has none")


def scalar_critic(args):
    """The paper's scalar baselines as a critic: feedback with no spans and "step_rewards", [(character end, reward)]
    that step_deltas puts on the token holding the character before that end (None: the last token).
      scalar-rm  classic RLHF PPO (Ziegler et al. 2019; Huang et al. 2024): a Bradley-Terry reward model's score of
                 the whole response, read at the EOS appended to it (scalar_rm_input), minus score_bias (its mean
                 score on the SFT demonstrations, 02's normalisation; --score-norm mean-std: divided by their std
                 too, norm_score_std): one reward, on the last token (the EOS if the policy sampled one).
                 compute_rewards adds -beta * KL_t and the missing-EOS penalty; the paper's scalar PPO baseline is
                 this with --reward-mode span or scalar alike (one non-zero delta).
      prm        PRM-PPO (App. N): a process reward model's score s of each step (split_steps, as 02 cut its
                 training responses), as 2 * sigmoid(s) - 1 in (-1, 1) (+1: surely right, -1: surely wrong, the
                 range of delta), on the step's last token.
    Its input is cut as stage 2 cut it (reward_model.json's max_prompt_tokens)."""
    rm, rm_tok = models.load_model(args.reward_model, device=args.device, dtype=args.dtype, scalar_head=True)
    info, prm = reward_models.rm_settings(args.reward_model), args.critic == "prm"
    scale = info["norm_score_std"] if args.score_norm == "mean-std" else 1.0

    def critic(recs, texts):
        steps = [split_steps(t, info["step_unit"] or "clause") for t in texts] if prm else None
        scores = score_responses(rm, rm_tok, [r["prompt"] for r in recs], texts, steps, info["max_prompt_tokens"])
        rewards = (
            [
                [(e, 2 * torch.sigmoid(torch.tensor(s)).item() - 1) for (_, e), s in zip(st, row)]
                for st, row in zip(steps, scores)
            ]
            if prm
            else [[(None, (row[0] - info["score_bias"]) / scale)] for row in scores]
        )
        return [{"critique": "", "good_spans": [], "poor_spans": [], "step_rewards": r} for r in rewards]

    return critic


def step_deltas(offsets, step_rewards) -> list[float]:
    """The per-token rewards of a scalar critic (scalar_critic): each (end, r) of step_rewards adds r at the token
    holding the character before `end` (baselines.scalar_rm.token_at), or at the last token when end is None; 0
    elsewhere."""
    d = [0.0] * len(offsets)
    for end, r in step_rewards:
        if d:
            d[len(d) - 1 if end is None else token_at(offsets, end)] += r
    return d
