"""Critic-free advantages for 03 --advantage rloo: the leave-one-out baseline over k samples of a prompt. A
rival to the value head, beside the stage (its pure section keeps what Text2Grad itself runs)."""

import torch


def compute_rloo(rewards, mask, k: int, gamma: float = 1.0, baseline: str = "start"):
    """Critic-free advantages (--advantage rloo): rows come in groups of k >= 2 samples of a prompt.
    RLOO's leave-one-out baseline (Ahmadian et al. 2024) on token-level returns of the r_t of
    compute_rewards, mean_j over the prompt's other samples j, G_t = sum_{s>=t} gamma^(s-t) r_s:
      start        A_t = G_t - mean_j G_0^j
      position     A_t = G_t - mean_j G_t^j   (G_t^j = 0 once sample j has ended)
      mean-reward  A_t = sum_{s>=t} gamma^(s-t) (r_s - mean_j rbar^j), rbar^j: j's mean r_t
    With the whole reward on the last token and gamma = 1, "start" is plain RLOO. Returns (advantages, G)."""

    def reward_to_go(r):  # (B, T) -> (B, T), a reversed loop
        out, running = torch.zeros_like(r), torch.zeros_like(r[:, 0])
        for t in reversed(range(r.shape[1])):
            running = r[:, t] * mask[:, t] + gamma * running  # nothing after a sample's end
            out[:, t] = running
        return out * mask

    def others_mean(x):  # (B, ...) -> each row: its group's
        group = x.reshape(-1, k, *x.shape[1:])  # mean over the other k-1 rows
        return ((group.sum(1, keepdim=True) - group) / (k - 1)).reshape(x.shape)

    returns = reward_to_go(rewards)  # (B, T)
    if baseline == "start":
        advantages = returns - others_mean(returns[:, 0])[:, None]
    elif baseline == "position":
        advantages = returns - others_mean(returns)
    elif baseline == "mean-reward":
        rbar = (rewards * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
        advantages = reward_to_go(rewards - others_mean(rbar)[:, None])
    else:
        raise ValueError(f"unknown RLOO baseline {baseline!r}")
    return advantages * mask, returns
