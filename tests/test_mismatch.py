"""infra/mismatch.py, the trainer/inference mismatch correction of served rollouts: against hand-computed values and a
plain Python loop written from TRL's rule (trl/trainer/grpo_trainer.py, vllm_importance_sampling_mode)."""

import math
import random

import pytest
import torch

from infra import mismatch

# two rollouts, T = 3; the second is 2 tokens long (its padding's behaviour log-prob is -inf, as a server leaves it)
LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, 0.0]])  # trainer: log pi_old
BLP = torch.tensor([[-1.0, -2.5, -0.5], [-1.3, -0.1, -math.inf]])  # server: log mu
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
E05, E11, E12, EM01 = math.exp(0.5), math.exp(1.1), math.exp(1.2), math.exp(-0.1)  # 1.649, 3.004, 3.320, 0.905


@pytest.mark.parametrize(
    "mode, weights, keep",
    [
        # row 0: log-ratio 0 + 0.5 + 0 -> rho = e^0.5 <= 3; row 1: 1.2 - 0.1 = 1.1 -> e^1.1 = 3.004 > 3
        ("sequence_mask", [[E05] * 3, [0, 0, 0]], [[1, 1, 1], [0, 0, 0]]),
        ("sequence_truncate", [[E05] * 3, [3, 3, 0]], [[1, 1, 1], [1, 1, 0]]),
        ("token_truncate", [[1, E05, 1], [3, EM01, 0]], [[1, 1, 1], [1, 1, 0]]),  # e^1.2 = 3.32 -> 3
        ("token_mask", [[1, E05, 1], [0, EM01, 0]], [[1, 1, 1], [0, 1, 0]]),
    ],
)
def test_weights_by_hand(mode, weights, keep):
    w, k = mismatch.importance_weights(LP, BLP, MASK, mode, cap=3.0)
    torch.testing.assert_close(w, torch.tensor(weights, dtype=torch.float32))
    torch.testing.assert_close(k, torch.tensor(keep, dtype=torch.float32))
    assert not w.isnan().any()


def test_masked_tokens_leave_the_denominator():
    losses = torch.ones(2, 3)
    w, keep = mismatch.importance_weights(LP, BLP, MASK, "sequence_mask", 3.0)
    # 3 tokens of row 0 at weight e^0.5 over the 3 kept tokens; TRL's form (w * l * mask / mask) would give 3e^0.5 / 5
    assert mismatch.weighted_masked_mean(losses, w, keep).item() == pytest.approx(E05)
    w, keep = mismatch.importance_weights(LP, BLP, MASK, "token_mask", 3.0)
    assert mismatch.weighted_masked_mean(losses, w, keep).item() == pytest.approx((2 + E05 + EM01) / 4)
    nothing = torch.zeros(2, 3)  # every rollout masked: a zero loss, not 0/0
    assert mismatch.weighted_masked_mean(losses, nothing, nothing).item() == 0.0


def test_stats_by_hand():
    s = mismatch.mismatch_stats(LP, BLP, MASK, "sequence_mask", 3.0)
    d = [0.0, 0.5, 0.0, 1.2, -0.1]  # log pi_old - log mu on the 5 response tokens
    assert s["mismatch/kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 5)  # 0.2547
    assert s["mismatch/kl"] == pytest.approx(0.254735, abs=1e-6)
    assert s["mismatch/kl_k1"] == pytest.approx(-0.32)
    assert s["mismatch/abs_diff_max"] == pytest.approx(1.2)
    assert s["mismatch/masked_share"] == pytest.approx(0.4) and s["mismatch/capped_share"] == pytest.approx(0.4)
    assert s["mismatch/weight_mean"] == pytest.approx(E05)
    t = mismatch.mismatch_stats(LP, BLP, MASK, "token_truncate", 3.0)
    assert t["mismatch/masked_share"] == 0.0 and t["mismatch/capped_share"] == pytest.approx(0.2)  # e^1.2 only
    assert t["mismatch/kl"] == s["mismatch/kl"]  # the mismatch itself does not depend on the mode


def loop_weights(lp, blp, mask, mode, cap):
    """TRL's rule, one row and one token at a time, with the masked ones out of keep."""
    weights, keep = [], []
    for row_lp, row_blp, row_m in zip(lp, blp, mask):
        diffs = [a - b if m else 0.0 for a, b, m in zip(row_lp, row_blp, row_m)]
        seq = math.exp(sum(diffs))
        w_row, k_row = [], []
        for d, m in zip(diffs, row_m):
            rho = seq if mode.startswith("sequence") else math.exp(d)
            if mode.endswith("truncate"):
                w, k = min(rho, cap), m
            else:
                w, k = (rho, m) if rho <= cap else (0.0, 0.0)
            w_row.append(w * m)
            k_row.append(k)
        weights.append(w_row)
        keep.append(k_row)
    return weights, keep


@pytest.mark.parametrize("mode", mismatch.MODES)
def test_weights_and_loss_match_a_loop(mode):
    rng = random.Random(mode)
    B, T = 6, 7
    lengths = [rng.randint(1, T) for _ in range(B)]
    mask = [[1.0 if t < n else 0.0 for t in range(T)] for n in lengths]
    lp = [[rng.uniform(-3, 0) for _ in range(T)] for _ in range(B)]
    blp = [[x + rng.gauss(0, 0.4) if m else -math.inf for x, m in zip(r, mr)] for r, mr in zip(lp, mask)]
    losses = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    want_w, want_k = loop_weights(lp, blp, mask, mode, 1.5)
    w, k = mismatch.importance_weights(torch.tensor(lp), torch.tensor(blp), torch.tensor(mask), mode, 1.5)
    torch.testing.assert_close(w, torch.tensor(want_w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, torch.tensor(want_k))
    num = sum(wt * lo * kt for rw, rl, rk in zip(want_w, losses, want_k) for wt, lo, kt in zip(rw, rl, rk))
    den = sum(map(sum, want_k))
    got = mismatch.weighted_masked_mean(torch.tensor(losses), w, k).item()
    assert got == pytest.approx(num / den if den else 0.0, rel=1e-5, abs=1e-6)
    assert 0 < den < sum(lengths) if mode.endswith("mask") else den == sum(lengths)  # the draw masks some, not all


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="sequence_mask"):
        mismatch.importance_weights(LP, BLP, MASK, "sequence", 3.0)


def test_the_edges_trl_sets():
    """The cap's default is TRL's (3); a rho exactly at the cap stays (TRL masks rho > cap); a single kept token is
    its own mean; no response tokens (or none kept) log zeros, not a division by zero or the mean of nothing."""
    rho = torch.tensor([[3.5]]).log()  # above 3, below 4
    assert mismatch.importance_weights(rho, torch.zeros(1, 1), torch.ones(1, 1))[1].item() == 0.0
    assert mismatch.mismatch_stats(rho, torch.zeros(1, 1), torch.ones(1, 1))["mismatch/masked_share"] == 1.0
    one_ = torch.ones(1, 1)  # rho = 1, under the default cap: kept by both
    assert mismatch.importance_weights(0 * one_, 0 * one_, one_)[1].item() == 1.0
    assert mismatch.mismatch_stats(0 * one_, 0 * one_, one_)["mismatch/masked_share"] == 0.0
    at_cap = torch.tensor([[0.5]])
    cap = float(torch.exp(at_cap))  # the float32 rho itself
    assert mismatch.importance_weights(at_cap, torch.zeros(1, 1), torch.ones(1, 1), "token_mask", cap)[1].item() == 1.0
    one = torch.tensor([[1.0, 0.0]])
    assert mismatch.weighted_masked_mean(torch.tensor([[2.0, 9.0]]), one * 0.5, one).item() == 1.0
    s = mismatch.mismatch_stats(torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2), one)
    assert s["mismatch/kl_k1"] == -0.5 and s["mismatch/abs_diff_max"] == 0.5
    for mask in (torch.zeros(1, 2), one):  # no response token; one, masked (rho = e^5 > 3)
        s = mismatch.mismatch_stats(torch.tensor([[5.0, 0.0]]), torch.zeros(1, 2), mask)
        assert s["mismatch/weight_mean"] == 0.0 and s["mismatch/abs_diff_max"] == (5.0 if mask.any() else 0.0)
