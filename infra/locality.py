"""--trace-samples: where an update went. Delta_t = log pi_new - log pi_old of every response token, summed per token
group, the groups read off the delta_t the update was computed from. 03's where_it_went measures it after step 6;
infra/trace.py writes it to trace.jsonl, 04's report draws it and bench/locality/ measures with it. Torch only.
"""

from __future__ import annotations

import torch

LOCALITY_GROUPS = ("poor", "good", "outside_flawed", "outside_clean")


def locality_sums(log_ratio, delta, mask):
    """Delta_t (log_ratio, (B, T)) summed per token group: inside poor spans (delta < 0), inside good spans, and
    outside every span in answers with a poor span ("flawed") or without one ("clean"). Returns (4, 4): per
    LOCALITY_GROUPS entry, (tokens, sum Delta, sum |Delta|, tokens whose Delta < 0); sums, so ranks and batches add."""
    flawed = ((delta < 0).float() * mask).amax(1, keepdim=True)  # (B, 1): 1 if the answer has a poor token
    outside = (delta == 0).float() * mask
    groups = torch.stack(
        [(delta < 0).float() * mask, (delta > 0).float() * mask, outside * flawed, outside * (1 - flawed)]
    )  # (4, B, T)
    return torch.stack(
        [
            groups.sum((1, 2)),
            (groups * log_ratio).sum((1, 2)),
            (groups * log_ratio.abs()).sum((1, 2)),
            (groups * (log_ratio < 0).float()).sum((1, 2)),
        ],
        1,
    )


def locality_summary(sums) -> dict:
    """locality_sums' (4, 4) as {group: {tokens, mean, mean_abs, down}} (down: the share of its tokens made less
    likely) plus "ratio", the locality ratio: mean |Delta| inside poor spans / mean |Delta| on the unflagged tokens of
    the same (flawed) answers; None where a group is empty."""
    out = {}
    for name, (n, total, total_abs, down) in zip(LOCALITY_GROUPS, sums.tolist()):
        out[name] = {
            "tokens": int(n),
            "mean": total / n if n else None,
            "mean_abs": total_abs / n if n else None,
            "down": down / n if n else None,
        }
    poor, rest = out["poor"]["mean_abs"], out["outside_flawed"]["mean_abs"]
    out["ratio"] = poor / rest if poor is not None and rest else None
    return out
