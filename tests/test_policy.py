"""03_train_policy.py: the PPO math against independent references, and short runs of the real loop."""

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import common
import critics
from infra import decoding, distributed, models, reward_models, runs, trace
from infra.data import read_prompts
from infra.locality import LOCALITY_GROUPS, locality_sums, locality_summary
from tasks.demo import demo_critic, demo_dataset
import forkserver
from conftest import ROOT, as_reward_model, import_script, model_variant, write_jsonl_gz

ppo = import_script("03_train_policy")


# ---------------------------------------------------------------------------------------------------------------------
# The math
# ---------------------------------------------------------------------------------------------------------------------


def gae_reference(rewards, values, n, gamma, lam):
    """A_t = sum_l (gamma*lam)^l td_{t+l} by the direct double sum, on python floats, for one row of length n."""
    v = lambda t: values[t] if t < n else 0.0  # noqa: E731
    td = [rewards[t] + gamma * v(t + 1) - v(t) for t in range(n)]
    adv = [sum((gamma * lam) ** l * td[t + l] for l in range(n - t)) for t in range(n)]  # noqa: E741
    return adv, [a + values[t] for t, a in enumerate(adv)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0), (1.0, 1.0)])
def test_gae_matches_direct_sum_with_ragged_masks(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = [9, 1, 5, 0, 3, 8]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        want_adv, want_ret = gae_reference(rewards[b].tolist(), values[b].tolist(), n, gamma, lam)
        assert adv[b, :n].tolist() == pytest.approx(want_adv, abs=1e-5)
        assert ret[b, :n].tolist() == pytest.approx(want_ret, abs=1e-5)
        assert adv[b, n:].abs().sum() == 0 and ret[b, n:].abs().sum() == 0


def test_ppo_loss_hand_computed():
    # two valid tokens and one padded one; every number below is worked out by hand
    logprobs = torch.tensor([[0.0, -1.0, 5.0]])
    old = torch.tensor([[-0.5, -1.0, 0.0]])  # ratios: e^0.5 = 1.6487 (clipped to 1.2), 1.0
    adv = torch.tensor([[1.0, -2.0, 9.0]])
    values = torch.tensor([[0.5, 1.0, 7.0]])
    old_values = torch.tensor([[0.0, 1.0, 0.0]])  # value 0.5 clipped to 0.2
    returns = torch.tensor([[1.0, 0.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    pg, vf, stats = ppo.ppo_loss(logprobs, old, adv, values, old_values, returns, mask, 0.2, 0.2)
    # token 0: max(-1*1.6487, -1*1.2) = -1.2 ; token 1: max(2*1, 2*1) = 2  -> mean 0.4
    assert pg.item() == pytest.approx(0.4, abs=1e-6)
    # token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64 ; token 1: max(1, 1) = 1 -> 0.5 * mean = 0.41
    assert vf.item() == pytest.approx(0.41, abs=1e-6)
    assert stats["policy/clipfrac"] == pytest.approx(0.5) and stats["val/clipfrac"] == 0.5  # token 1's are equal
    # approx KL (k3 of the ratio): token 0: e^0.5 - 1 - 0.5 = 0.148721 ; token 1: 0
    assert stats["policy/approx_kl"] == pytest.approx(0.1487212707 / 2, abs=1e-6)


def test_ppo_loss_when_the_unclipped_value_term_wins_and_with_importance_weights():
    """Two more cases by hand (found by bench/mutants/mutants.py): a value moved past its clip away from its return, where
    the unclipped square is the larger, max((1 + 1)^2, (0.2 + 1)^2) = 4, so 0.5 * 4; and importance weights on the
    surrogate, at ratio 1: mean(-A * w) over the mask = (-1 * 0.5 + 2 * 2) / 2."""
    zero, one = torch.zeros(1, 1), torch.ones(1, 1)
    _, vf, stats = ppo.ppo_loss(zero, zero, one, one, zero, -one, one, 0.2, 0.2)
    assert vf.item() == 2.0 and stats["val/clipfrac"] == 0.0
    zeros, adv, w = torch.zeros(1, 3), torch.tensor([[1.0, -2.0, 4.0]]), torch.tensor([[0.5, 2.0, 3.0]])
    pg, vf, _ = ppo.ppo_loss(zeros, zeros, adv, None, None, None, torch.tensor([[1.0, 1.0, 0.0]]), 0.2, 0.2, w)
    assert pg.item() == 1.75 and vf is None


def _bigram(seed=0):
    """A bigram LM with a value head and 4 ragged rollouts of it, from one seeded start: (score, params, batch)."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 6, 7
    ids = torch.randint(V, (B, T + 1), generator=g)
    torch.manual_seed(seed)
    embed, head = torch.nn.Embedding(V, V), torch.nn.Linear(V, 1)
    params = [*embed.parameters(), *head.parameters()]

    def score(rows):
        logits = embed(ids[rows, :-1])
        return logits.log_softmax(-1).gather(2, ids[rows, 1:, None]).squeeze(-1), head(logits).squeeze(-1), logits

    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in (6, 2, 4, 5)])
    with torch.no_grad():
        old, values, _ = score(torch.arange(B))
    batch = ppo.Rollouts(
        mask,
        logprobs=old - 0.1 * torch.randn(B, T, generator=g),
        values=values,
        advantages=torch.randn(B, T, generator=g) * mask,
        returns=torch.randn(B, T, generator=g) * mask,
    )
    return score, params, batch


def _bigram_update(all_sum, seed=0, **hp):
    """ppo_update (SGD, lr 0.1) of _bigram's model on its rollouts: its weights after, and its stats."""
    score, params, batch = _bigram(seed)
    hp = ppo.PpoHParams(**{"ppo_epochs": 2, "num_minibatches": 2, "max_grad_norm": 1e9, **hp})
    stats, epochs = ppo.ppo_update(score, batch, params, torch.optim.SGD(params, lr=0.1), hp, all_sum=all_sum)
    return [p.detach() for p in params], stats, epochs


def test_ppo_update_is_sgd_on_the_loss_of_every_row_once():
    """Against a direct computation (found by bench/mutants/mutants.py: the update was only ever compared with itself): one
    epoch of one minibatch with SGD moves the weights by -lr * the gradient of ppo_loss's surrogate + vf_coef * value
    loss - ent_coef * entropy over all rows (and over one row of one token); with 2 minibatches of 2 micro-batches,
    each epoch scores every row once, one row a call; with a GradScaler, the clip sees the true gradients and its
    scale is updated; --target-kl stops above the epoch's mean KL, not at it."""
    for rows, tokens in ((4, 6), (1, 1)):  # every row; one row of one token (where the token count is 1)
        score, params, batch = _bigram()
        mask = batch.mask[:rows].clone()
        mask[:, tokens:] = 0.0
        fields = ("logprobs", "values", "advantages", "returns")
        batch = ppo.Rollouts(mask, **{k: getattr(batch, k)[:rows] * mask for k in fields})
        start = [p.detach().clone() for p in params]
        logprobs, values, logits = score(torch.arange(rows))
        old = (batch.logprobs, batch.advantages, values, batch.values, batch.returns, mask)
        pg, vf, _ = ppo.ppo_loss(logprobs, *old, 0.2, 0.2)
        entropy = ppo.masked_mean(ppo.entropy_from_logits(logits), mask)
        grads = torch.autograd.grad(pg + 0.1 * vf - 1.0 * entropy, params)
        hp = ppo.PpoHParams(ppo_epochs=1, num_minibatches=1, ent_coef=1.0, max_grad_norm=1e9)
        ppo.ppo_update(score, batch, params, torch.optim.SGD(params, lr=0.1), hp)
        for p, p0, grad in zip(params, start, grads):
            torch.testing.assert_close(p.detach(), p0 - 0.1 * grad)
    score, params, batch = _bigram()
    calls = []
    hp = ppo.PpoHParams(ppo_epochs=2, num_minibatches=2, grad_accum=2)
    ppo.ppo_update(lambda rows: calls.append(rows.tolist()) or score(rows), batch, params, torch.optim.SGD(params), hp)
    epochs = [sorted(sum(calls[:4], [])), sorted(sum(calls[4:], []))]
    assert [len(rows) for rows in calls] == [1] * 8 and epochs == [[0, 1, 2, 3]] * 2
    # a GradScaler (fp16) changes nothing the clip sees: the scaled update is the plain one, clipped alike
    plain = _bigram_update(ppo.no_reduction, max_grad_norm=0.05)[0]
    score, params, batch = _bigram()
    hp = ppo.PpoHParams(ppo_epochs=2, num_minibatches=2, max_grad_norm=0.05)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)  # its scale doubles after each of the 4 clean steps
    ppo.ppo_update(score, batch, params, torch.optim.SGD(params, lr=0.1), hp, scaler=scaler)
    for a, b in zip(plain, params):
        torch.testing.assert_close(a, b.detach())
    assert scaler.get_scale() == 2.0**16 * 2**4
    # --target-kl: the epochs stop once an epoch's mean approx KL is above it, not at it
    stats = _bigram_update(ppo.no_reduction)[1]
    _, _, batch = _bigram()
    perm = torch.randperm(4)  # the first epoch's minibatches, as ppo_update draws them: the epoch's KL is a token mean
    n = [batch.mask[perm[:2]].sum().item(), batch.mask[perm[2:]].sum().item()]
    kl = sum(st["policy/approx_kl"] * k for st, k in zip(stats[:2], n)) / sum(n)
    assert _bigram_update(ppo.no_reduction, target_kl=kl)[2] == 2
    assert _bigram_update(ppo.no_reduction, target_kl=kl * 0.99)[2] == 1


def test_ppo_update_sums_over_ranks():
    """ppo_update's all_sum, with a second rank that holds the same rollouts (all_sum doubles): the minibatch's tokens,
    the gradients and the epoch's KL are summed over both, so the update is the one of one process on those rows
    (SGD: a gradient half or twice as large would move the weights half or twice as far), and so is --target-kl's
    stop; clipped (--max-grad-norm), the same again."""
    for hp in ({}, {"max_grad_norm": 0.05}, {"target_kl": 1e-9, "ppo_epochs": 3}):
        one, stats, epochs = _bigram_update(ppo.no_reduction, **hp)
        two, stats2, epochs2 = _bigram_update(lambda x: x.mul_(2), **hp)
        assert epochs == epochs2 == (1 if "target_kl" in hp else hp.get("ppo_epochs", 2)) and stats == stats2
        for a, b in zip(one, two):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    moved = _bigram_update(ppo.no_reduction)[0]
    clipped = _bigram_update(ppo.no_reduction, max_grad_norm=0.05)[0]
    assert max((a - b).abs().max() for a, b in zip(moved, clipped)) > 1e-3  # the clip bites


def test_clip_grad_norm_over_sharded_gradients():
    """clip_grad_norm with an FSDP-sharded gradient (a DTensor: this rank's shard) beside a whole one (the value head):
    the norm is over every rank's shards (all_sum; here a second rank holding the same shard, so its square counts
    twice) and the whole gradients once, every gradient scaled by max_norm / norm, and none below max_norm; tiny
    gradients as torch's clip_grad_norm_ scales them (its eps); without a sharded gradient it is torch's own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g), torch.randn(5, generator=g)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for max_norm in (1.0, 100.0):
            sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
            sharded.grad = distribute_tensor(a.clone(), mesh, [Shard(0)])
            whole = torch.nn.Parameter(torch.zeros(5))
            whole.grad = b.clone()
            total = distributed.clip_grad_norm([sharded, whole], max_norm, lambda x: x * 2)
            want = (2 * a.pow(2).sum() + b.pow(2).sum()).sqrt()
            coef = min(1.0, max_norm / (want.item() + 1e-6))
            assert total.item() == pytest.approx(want.item(), rel=1e-6) and want > 1.0
            torch.testing.assert_close(sharded.grad.to_local(), a * coef)
            torch.testing.assert_close(whole.grad, b * coef)
        for scale, max_norm in ((1e-7, 1.0), (1e-6, 1e-6)):  # tiny: torch's eps in max_norm / (norm + 1e-6) decides
            sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
            sharded.grad, whole.grad = distribute_tensor(a * scale, mesh, [Shard(0)]), b * scale
            distributed.clip_grad_norm([sharded, whole], max_norm, lambda x: x * 2)
            ref = [torch.nn.Parameter(torch.zeros(8, 3)), torch.nn.Parameter(torch.zeros(5))]  # a twice: two ranks
            ref[0].grad, ref[1].grad = torch.cat([a, a]) * scale, b * scale
            torch.nn.utils.clip_grad_norm_(ref, max_norm)
            torch.testing.assert_close(sharded.grad.to_local(), ref[0].grad[:4], rtol=1e-5, atol=0)  # tiny: no atol
            torch.testing.assert_close(whole.grad, ref[1].grad, rtol=1e-5, atol=0)
    finally:
        dist.destroy_process_group()
    plain = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    plain[0].grad, plain[1].grad = a.clone(), b.clone()
    assert distributed.clip_grad_norm(plain, 1.0, lambda x: x * 2).item() == pytest.approx(
        (a.square().sum() + b.square().sum()).sqrt().item()
    )


def test_rewards_span_and_scalar_carry_the_same_delta():
    delta = torch.tensor([[1.0, 0.0, -1.0, 1.0, 0.0], [0.0, -1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.0, -0.1, 0.3], [0.5, 0.0, 0.1, 9.0, 9.0]])
    span = ppo.compute_rewards(delta, kl, mask, 0.5, "span")
    scalar = ppo.compute_rewards(delta, kl, mask, 0.5, "scalar")
    assert torch.allclose(span.sum(1), scalar.sum(1))
    assert torch.allclose(span, (delta - 0.5 * kl) * mask)
    # scalar: only the KL term per token, the sum of delta at the last valid token (not at the padding)
    assert torch.allclose(scalar[1], torch.tensor([-0.25, 0.0, -0.05 - 1.0, 0.0, 0.0]))
    bonus = ppo.compute_rewards(delta, kl * 0, mask, 0.5, "span", seq_bonus=torch.tensor([0.0, -1.0]))
    assert bonus[1, 2] == -1.0 and bonus[0].tolist() == delta[0].tolist()


def test_kl_estimators():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    assert ppo.per_token_kl(lp, ref, "k1")[0].tolist() == pytest.approx([0.5, 0.0])
    assert ppo.per_token_kl(lp, ref, "k3")[0].tolist() == pytest.approx([torch.e**-0.5 - 1 + 0.5, 0.0])
    logits, ref_logits = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    p, q = logits.softmax(-1), ref_logits.softmax(-1)
    assert torch.allclose(
        ppo.per_token_kl(None, None, "full", logits, ref_logits), (p * (p / q).log()).sum(-1), atol=1e-6
    )
    assert ppo.per_token_kl(None, None, "full", logits, logits).abs().max() < 1e-6
    entropy = torch.distributions.Categorical(logits=logits).entropy()  # H_t, beside the KL: the same logits
    assert torch.allclose(ppo.entropy_from_logits(logits), entropy, atol=1e-6)


def test_whiten_and_span_weighting_and_kl_controller():
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = ppo.masked_whiten(x, mask)
    assert w[0, :3].tolist() == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-3) and w[0, 3] == 0
    assert ppo.masked_whiten(x, mask, shift_mean=False)[0, 1].item() == pytest.approx(2.0)
    assert ppo.update_kl_coef(0.1, 12.0, 6.0, 10000, 100) == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    assert ppo.update_kl_coef(0.1, 3.0, 6.0, 10000, 100) == pytest.approx(0.1 * (1 - 0.2 * 100 / 10000))  # clipped


def test_masked_means_and_rewards_on_one_or_no_response_token():
    """The edges of the pure section's means (found by bench/mutants/mutants.py): a row mean (dim) is each row's own; one
    masked token is its own mean and an empty mask gives 0, not a division by zero; whitening a constant is 0, not
    nan (eps); a one-token response takes r_t's last-token terms on that token, and an empty one on token 0."""
    x, mask = torch.tensor([[2.0, 4.0, 9.0], [6.0, 1.0, 1.0]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert ppo.masked_mean(x, mask, 1).tolist() == [3.0, 6.0]
    assert ppo.masked_mean(x, mask).item() == 4.0 and ppo.masked_mean(x[1:], mask[1:]).item() == 6.0
    assert ppo.masked_mean(x, mask * 0).item() == 0.0 and ppo.masked_mean(x, mask * 0, 1).tolist() == [0.0, 0.0]
    assert ppo.masked_whiten(torch.full((1, 3), 5.0), torch.ones(1, 3)).tolist() == [[0.0, 0.0, 0.0]]
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    r = ppo.compute_rewards(x, torch.zeros_like(x), one, 0.1, "scalar", seq_bonus=torch.tensor([-1.0, -1.0]))
    assert r.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # 2 - 1 on the one token; nothing on the empty row


def test_advantages_of_a_batch_whose_responses_are_one_token_long():
    """T = 1 (every response one token, e.g. --max-new-tokens 1): GAE's advantage is r - V and its return r; RLOO's
    is r minus the others' mean, for each baseline (found by bench/mutants/mutants.py: a loop's carry built from column 1
    instead of 0 passed every longer batch)."""
    rewards, values = torch.tensor([[2.0], [-1.0], [0.5], [3.0]]), torch.tensor([[0.5], [1.0], [0.0], [2.0]])
    mask = torch.tensor([[1.0], [1.0], [0.0], [1.0]])
    adv, ret = ppo.compute_gae(rewards, values, mask, 0.9, 0.95)
    assert adv.tolist() == [[1.5], [-2.0], [0.0], [1.0]] and ret.tolist() == [[2.0], [-1.0], [0.0], [3.0]]
    for baseline in ("start", "position", "mean-reward"):
        adv, ret = ppo.compute_rloo(rewards, mask, 2, 0.9, baseline)
        assert adv.tolist() == [[3.0], [-3.0], [0.0], [3.0]] and ret.tolist() == [[2.0], [-1.0], [0.0], [3.0]]


def test_linear_decay_is_the_papers_formula_over_each_located_span():
    """App. I: the i-th of the n tokens of a span weighs 1 - (i - 1) * 0.9 / (n - 1): [1, .775, .55, .325, .1] for
    n = 5, 1 for n = 1. Spans are the located quotes: two adjacent quotes are two spans, and a token of a quote that
    carries no label of its own (0: it straddles a poor quote inside) does not split the quote in two."""
    delta = torch.tensor(
        [[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]]
    )
    spans = [
        [[1, 2, 3, 4, 5], [6, 7], [9]],  # a 5-token span, then an adjacent poor one of 2, then one of 1
        [[0, 1, 3, 4], [5]],
    ]  # a good span whose third token is 0, a poor one inside it
    assert critics.weight_spans(delta, spans, "uniform").tolist() == delta.tolist()
    assert torch.allclose(
        critics.weight_spans(delta, spans, "linear-decay"),
        torch.tensor(
            [
                [0.0, 1.0, 0.775, 0.55, 0.325, 0.1, -1.0, -0.1, 0.0, 1.0],
                [1.0, 0.7, 0.0, 0.4, 0.1, -1.0, 0.0, 0.0, 0.0, 0.0],
            ]
        ),
    )


def rloo_reference(rewards, lengths, k, gamma, baseline="start"):
    """RLOO advantages by a direct loop on python floats: G_t = sum_{s>=t} gamma^(s-t) r_s over a row's own tokens,
    minus, over the other k-1 rows of its group: the mean of their G_0 (start); the mean of their G_t at the same t, 0
    past a row's end (position). mean-reward: sum_{s>=t} gamma^(s-t) (r_s - the others' mean of their mean reward)."""

    def to_go(row, n):
        return [sum(gamma ** (s - t) * row[s] for s in range(t, n)) for t in range(n)]

    G = [to_go(row, n) for row, n in zip(rewards, lengths)]
    out = []
    for i, (g, n) in enumerate(zip(G, lengths)):
        others = [j for j in range(i // k * k, i // k * k + k) if j != i]
        if baseline == "start":
            out.append([x - sum(G[j][0] for j in others) / (k - 1) for x in g])
        elif baseline == "position":
            out.append([x - sum(G[j][t] if t < lengths[j] else 0.0 for j in others) / (k - 1) for t, x in enumerate(g)])
        else:
            rbar = sum(sum(rewards[j][: lengths[j]]) / lengths[j] for j in others) / (k - 1)
            out.append(to_go([r - rbar for r in rewards[i][:n]], n))
    return out, G


@pytest.mark.parametrize("baseline", ["start", "position", "mean-reward"])
@pytest.mark.parametrize("k,gamma", [(2, 1.0), (3, 1.0), (3, 0.9)])
def test_rloo_matches_a_direct_loop_with_ragged_masks(k, gamma, baseline):
    g = torch.Generator().manual_seed(1)
    lengths = [9, 1, 5, 3, 8, 2][: 6 // k * k]
    B, T = len(lengths), 9
    rewards = torch.randn(B, T, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    adv, ret = ppo.compute_rloo(rewards, mask, k, gamma, baseline)
    want_adv, want_ret = rloo_reference(rewards.tolist(), lengths, k, gamma, baseline)
    for b, n in enumerate(lengths):
        assert adv[b, :n].tolist() == pytest.approx(want_adv[b], abs=1e-5)
        assert ret[b, :n].tolist() == pytest.approx(want_ret[b], abs=1e-5)
        assert adv[b, n:].abs().sum() == 0 and ret[b, n:].abs().sum() == 0


def test_rloo_baselines_differ_where_they_should():
    """One prompt, k = 2, +1 on each token of equal-length answers: the start baseline gives later tokens less (their
    reward-to-go is smaller than the other's whole return: the position term), the position baseline gives every
    token 0, and an unknown baseline is refused."""
    rewards, mask = torch.ones(2, 4), torch.ones(2, 4)
    assert ppo.compute_rloo(rewards, mask, 2, baseline="start")[0][0].tolist() == [0.0, -1.0, -2.0, -3.0]
    assert ppo.compute_rloo(rewards, mask, 2, baseline="position")[0].abs().sum() == 0
    assert ppo.compute_rloo(rewards, mask, 2, baseline="mean-reward")[0].abs().sum() == 0
    with pytest.raises(ValueError, match="unknown RLOO baseline"):
        ppo.compute_rloo(rewards, mask, 2, baseline="first")


def test_rloo_with_the_reward_on_the_last_token_is_plain_rloo():
    """delta only at the last token, no KL: every token of sample i gets R_i - mean of the other samples' R."""
    R = [1.0, -2.0, 0.5, 3.0, 0.0, -1.0]  # two prompts, k = 3
    lengths = [4, 2, 5, 3, 5, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    delta = torch.zeros(6, 5)
    for i, n in enumerate(lengths):
        delta[i, n - 1] = R[i]
    rewards = ppo.compute_rewards(delta, torch.zeros(6, 5), mask, 0.1, "span")
    adv, _ = ppo.compute_rloo(rewards, mask, 3)
    for i, n in enumerate(lengths):
        others = [R[j] for j in range(i // 3 * 3, i // 3 * 3 + 3) if j != i]
        assert adv[i, :n].tolist() == pytest.approx([R[i] - sum(others) / 2] * n)


@pytest.mark.parametrize("baseline", ["start", "position"])
def test_rloo_run_samples_each_prompt_k_times_and_leaves_the_value_head(tmp_path, tiny_model_dir, baseline):
    """--advantage rloo --rloo-k 2: the batch holds 2 samples of each prompt, in a row; the advantages are compute_rloo
    of the run's own rewards, with --rloo-baseline's baseline; the value head gets no gradient, so it is not trained."""
    d, _ = _dump(tmp_path, tiny_model_dir, "rloo", "--advantage", "rloo", "--rloo-k", "2", "--rloo-baseline", baseline)
    samples = [json.loads(x) for x in (tmp_path / "rloo" / "samples.jsonl").read_text().splitlines()]
    prompts = [s["prompt"] for s in samples][:4]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]
    import numpy as np

    mask = d["mask"].double()
    rewards = (d["delta"] - d["kl_coef"] * d["kl"]) * d["mask"]
    for i in range(mask.shape[0]):
        rewards[i, int(mask[i].sum()) - 1] -= 0.0 if d["has_eos"][i] else 1.0
    adv, ret = ppo.compute_rloo(rewards.double(), mask, 2, baseline=baseline)
    assert not torch.allclose(
        adv,
        ppo.compute_rloo(
            rewards.double(),
            mask,
            2,  # the flag chose between different ones
            baseline={"start": "position", "position": "start"}[baseline],
        )[0],
    )
    valid = adv[mask > 0].numpy()
    want = (adv.numpy() - valid.mean()) / np.sqrt(valid.var() + 1e-8) * mask.numpy()
    assert torch.allclose(d["advantages"].double(), torch.from_numpy(want), atol=1e-4)
    assert torch.allclose(d["returns"].double(), ret, atol=1e-5)
    head = torch.load(tmp_path / "rloo" / "policy" / "value_head.pt", weights_only=True)
    assert all(v.abs().sum() == 0 for v in head.values())  # zero-init and never updated


def test_batch_indices_cover_each_pass_once_and_are_reproducible():
    first_pass = sum((runs.batch_indices(s, 4, 10, seed=3) for s in range(5)), [])
    assert sorted(first_pass[:10]) == list(range(10)) and sorted(first_pass[10:20]) == list(range(10))
    assert runs.batch_indices(7, 4, 10, 3) == runs.batch_indices(7, 4, 10, 3) != runs.batch_indices(7, 4, 10, 4)


# ---------------------------------------------------------------------------------------------------------------------
# The model plumbing
# ---------------------------------------------------------------------------------------------------------------------


def _args(tmp_path, tiny_model_dir, *extra):
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    return ppo.parse_args(
        [
            "--model",
            tiny_model_dir,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--critic",
            "program",
            "--output-dir",
            str(tmp_path / "run"),
            "--scalar-baseline-dir",
            "",
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--num-minibatches",
            "2",
            "--ppo-epochs",
            "1",
            "--max-new-tokens",
            "8",
            "--sft-steps",
            "0",
            "--device",
            "cpu",
            "--lora-r",
            "4",
            "--lora-alpha",
            "8",
            "--max-fail-share",
            "1",
            *extra,
        ]
    )  # the loop under test, not the
    # critic: an untrained critic's failed critiques do not stop these runs (test_plugin tests the stop)


@pytest.mark.parametrize("lora_r", [4, 0])
def test_reference_equals_policy_before_training(tmp_path, tiny_model_dir, lora_r):
    args = _args(tmp_path, tiny_model_dir, "--lora-r", str(lora_r))
    model, tok = models.load_model(tiny_model_dir)
    model, ref_model, value_head = ppo.build_policy(args, model)
    assert (ref_model is None) == (lora_r > 0)  # LoRA: no second copy of the weights
    if ref_model is not None:  # full fine-tuning's copy is frozen: no gradient, no dropout
        assert not ref_model.training and not any(p.requires_grad for p in ref_model.parameters())
    ids, mask = models.left_pad(
        [tok("post: tom lives in york")["input_ids"], tok("it eats")["input_ids"]], tok.pad_token_id
    )
    with torch.no_grad():
        lp, values, logits = ppo.forward(model, value_head, ids, mask, 3, 1.0)
        ref_lp, ref_logits = ppo.reference_forward(model, ref_model, ids, mask, 3, 1.0)
    assert torch.equal(lp, ref_lp) and torch.equal(logits, ref_logits)
    assert ppo.per_token_kl(lp, ref_lp, "k1").abs().max() == 0
    assert values.abs().max() == 0  # zero-initialised value head
    for p in model.parameters():  # a step of training moves the policy but not the reference (LoRA: the adapter
        if p.requires_grad:  # alone trains, the base is frozen; full fine-tuning: the reference is a frozen copy)
            p.data.add_(0.1)
    lp2, _, _ = ppo.forward(model, value_head, ids, mask, 3, 1.0)
    ref2, _ = ppo.reference_forward(model, ref_model, ids, mask, 3, 1.0)
    assert torch.equal(ref2, ref_lp) and not torch.allclose(lp2, lp)


def test_forward_logprobs_match_generate_scores(tiny_model_dir):
    model, tok = models.load_model(tiny_model_dir)
    ids, mask = models.left_pad(
        [tok("post: tom lives in york")["input_ids"], tok("it eats")["input_ids"]], tok.pad_token_id
    )
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=5,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    R = out.sequences.shape[1] - ids.shape[1]
    want = torch.stack(out.scores, 1).log_softmax(-1).gather(2, out.sequences[:, -R:, None]).squeeze(-1)
    full_mask = torch.cat([mask, torch.ones(2, R, dtype=torch.long)], 1)
    lp, _, _ = ppo.forward(model, None, out.sequences, full_mask, R, 0.7)
    assert torch.allclose(lp, want, atol=1e-4)  # the log-probs of the behaviour policy, logits divided by T


# ---------------------------------------------------------------------------------------------------------------------
# Short runs of the real loop
# ---------------------------------------------------------------------------------------------------------------------


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_program_critic_span_and_scalar(tmp_path, tiny_model_dir):
    args = _args(tmp_path, tiny_model_dir)
    ppo.train(args)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for key in [
        "objective/kl",
        "objective/entropy",
        "objective/span_reward",
        "policy/approx_kl",
        "policy/clipfrac",
        "losses/policy_loss",
        "losses/value_loss",
        "val/explained_variance",
        "critic/parse_fail_rate",
        "critic/unmatched_span_rate",
        "critic/tokens_labelled_frac",
        "time/step_s",
    ]:
        assert key in rows[0], key
    assert rows[0]["objective/kl"] == 0.0  # the LoRA policy starts exactly at the reference
    assert rows[0]["critic/parse_fail_rate"] == 0.0
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "critique", "good_spans", "poor_spans"} <= set(samples[0])
    policy, tok = models.load_model(str(tmp_path / "run" / "policy"))  # the saved adapter loads on its own
    assert (tmp_path / "run" / "policy" / "value_head.pt").is_file()

    scalar = _args(tmp_path, tiny_model_dir, "--reward-mode", "scalar", "--output-dir", str(tmp_path / "scalar"))
    ppo.train(scalar)
    assert [r["step"] for r in _rows(tmp_path / "scalar")] == [1, 2]


def test_smoke_code_task_on_a_humaneval_file(tmp_path, tiny_model_dir):
    rows = [
        {
            "task_id": f"HumanEval/{i}",
            "prompt": f"def f{i}(x):\n",
            "entry_point": f"f{i}",
            "canonical_solution": "    return x\n",
            "test": "def check(candidate):\n    assert candidate(1) == 1\n",
        }
        for i in range(4)
    ]
    args = _args(
        tmp_path,
        tiny_model_dir,
        "--task",
        "code",
        "--prompts",
        write_jsonl_gz(tmp_path / "he.jsonl.gz", rows),
        "--steps",
        "1",
    )
    ppo.train(args)
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("def f") and s["critique"] for s in samples)


def test_smoke_local_critic_counts_unparseable_output(tmp_path, tiny_model_dir):
    # an untrained model as "reward model": its output is gibberish, which must give delta = 0, never a crash
    args = _args(
        tmp_path,
        tiny_model_dir,
        "--critic",
        "local",
        "--reward-model",
        as_reward_model(tiny_model_dir, tmp_path / "rm"),
        "--critic-max-new-tokens",
        "8",
    )
    ppo.train(args)
    rows = _rows(tmp_path / "run")
    assert rows[0]["critic/parse_fail_rate"] == 1.0 and rows[0]["objective/span_reward"] == 0.0


def test_smoke_openai_critic_sends_the_batch_concurrently(tmp_path, tiny_model_dir, fake_openai):
    active, peak, lock = [0], [0], threading.Lock()

    def reply(body, n):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        response = body["messages"][0]["content"].split("### Response\n", 1)[1]
        word = (response.split() or ["x"])[0]
        return (
            f"Reasoning first.\n```json\n{json.dumps({'critique': 'c', 'good_spans': [], 'poor_spans': [word]})}\n```"
        )

    with fake_openai(reply) as server:
        args = _args(
            tmp_path, tiny_model_dir, "--critic", "openai", "--critic-base-url", server.base_url, "--critic-model", "rm"
        )
        ppo.train(args)
        bodies = [r["body"] for r in server.requests]
    assert len(bodies) == 8 and all(b["model"] == "rm" for b in bodies)
    assert bodies[0]["messages"][0]["content"].startswith(common.RM_INSTRUCTION)
    assert peak[0] >= 4  # one batch of 4 rollouts in flight at once
    rows = _rows(tmp_path / "run")
    assert rows[0]["critic/parse_fail_rate"] == 0.0 and rows[0]["critic/tokens_labelled_frac"] > 0


def test_a_critique_request_that_fails_mid_run_is_delta_zero_counted_and_kept(tmp_path, tiny_model_dir, fake_openai):
    """--critic openai: a critique whose request still fails after --critic-retries (503), or times out after
    --critic-timeout (never retried: the server may still be generating it), gives its rollout delta = 0, is counted
    in critic/parse_fail_rate, and its error is kept in samples.jsonl; the run goes on (it crashed on the first)."""
    attempts, release = {}, threading.Event()

    def reply(body, n):
        response = body["messages"][0]["content"].split("### Response\n", 1)[1]
        attempts[response] = attempts.get(response, 0) + 1
        if len(response) % 3 == 0:
            return 503, {"error": {"message": "overloaded"}}, {}
        if len(response) % 3 == 1:
            release.wait()  # past --critic-timeout however long that is (a fixed sleep raced a loaded machine)
        word = (response.split() or ["x"])[0]
        return json.dumps({"critique": "c", "good_spans": [], "poor_spans": [word]})

    with fake_openai(reply) as server:
        ppo.train(
            _args(
                tmp_path,
                tiny_model_dir,
                "--critic",
                "openai",
                "--critic-base-url",
                server.base_url,
                "--critic-model",
                "rm",
                "--critic-timeout",
                "5",  # a reply that should come comes in time on a loaded machine too (0.5 s did not always)
                "--critic-retries",
                "1",
                "--log-every",
                "1",
                "--task",
                "qa",
            )
        )
        release.set()
    rows, samples = _rows(tmp_path / "run"), common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and len(samples) == 8  # every rollout of both iterations
    kinds = [len(s["response"]) % 3 for s in samples]
    assert 0 in kinds and 1 in kinds  # both faults happened
    for s, kind in zip(samples, kinds):
        if kind == 0:
            assert (
                s["critic_error"] == "HTTP 503: overloaded; gave up after 2 attempts" and attempts[s["response"]] >= 2
            )
        elif kind == 1:
            assert s["critic_error"].startswith("timed out") and s["critique"] is None
        else:
            assert s["critique"] == "c" and "critic_error" not in s
        if kind != 2:
            assert s["critique"] is None and s["critic_output"] is None and s["span_reward"] == 0.0
    for step, row in zip((1, 2), rows):
        assert row["critic/parse_fail_rate"] == sum(k != 2 for s, k in zip(samples, kinds) if s["step"] == step) / 4


def test_openai_critic_completions_api_sends_the_training_prompt(tmp_path, tiny_chat_model_dir, fake_openai):
    """--critic-api completions: a served base model gets exactly the text stage 2 trained on (build_rm_prompt)."""
    from transformers import AutoTokenizer

    with fake_openai(lambda body, n: '{"good_spans": [], "poor_spans": []}') as server:
        ppo.train(
            _args(
                tmp_path,
                tiny_chat_model_dir,
                "--critic",
                "openai",
                "--critic-base-url",
                server.base_url,
                "--critic-model",
                "rm",
                "--critic-api",
                "completions",
                "--reward-model",
                as_reward_model(tiny_chat_model_dir, tmp_path / "rm"),
                "--steps",
                "1",
            )
        )
        requests = list(server.requests)
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    samples = common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(requests) == 4 and all(r["path"] == "/v1/completions" for r in requests)
    sent = {r["body"]["prompt"] for r in requests}
    for s in samples:
        assert common.build_rm_prompt(tok, s["prompt"], s["response"]) in sent
    assert all(p.endswith("assistant: ") for p in sent)  # the chat template's generation prompt, applied by us


def test_local_critic_asks_a_spans_only_reward_model_for_spans_only(
    tmp_path, tiny_model_dir, tiny_spans_only_reward_model, monkeypatch
):
    """--critic local with a 02 --rm-format spans-only reward model: the format comes from its reward_model.json, and
    every critique request is its training input (the spans-only instruction, rm_prompt cut as in 02)."""
    from transformers import AutoTokenizer

    rm_dir, _ = tiny_spans_only_reward_model
    rm_tok, settings = AutoTokenizer.from_pretrained(rm_dir), reward_models.rm_settings(rm_dir)
    inputs, real = [], decoding.greedy_generate

    def record(model, tokenizer, prompts, *a, **k):
        inputs.extend(prompts)
        return real(model, tokenizer, prompts, *a, **k)

    monkeypatch.setattr(decoding, "greedy_generate", record)
    ppo.train(
        _args(
            tmp_path, tiny_model_dir, "--critic", "local", "--reward-model", rm_dir, "--steps", "1", "--log-every", "1"
        )
    )
    samples = common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(inputs) == 4
    for s in samples:
        want = reward_models.rm_prompt(rm_tok, s["prompt"], s["response"], settings["max_prompt_tokens"], "spans-only")[
            0
        ]
        assert want in inputs
    assert all(common.RM_INSTRUCTIONS["spans-only"] in rm_tok.decode(x) for x in inputs)


def test_dense_labels_put_minus_one_inside_poor_spans_and_plus_one_elsewhere():
    """--labels dense (App. I.1): from the same critique, every token outside a poor span is +1 and every token inside
    one is -1 (a token straddling its edge: 0); the critic's good spans do not matter. Spans: only the quotes count."""
    text = "tom saw the cat today"
    offsets = [(0, 3), (3, 7), (7, 11), (11, 18), (18, 21), (21, 21)]  # tom| saw| the| cat to|day|EOS (no text)
    mask = torch.ones(1, 6)
    fb = {"critique": "c", "good_spans": ["tom"], "poor_spans": ["the", "cat"]}
    spans, _, n, _ = ppo.span_deltas([text], [offsets], [fb], mask)
    dense, _, n_dense, _ = ppo.span_deltas([text], [offsets], [fb], mask, labels="dense")
    assert spans.tolist() == [[1.0, 0.0, -1.0, 0.0, 0.0, 0.0]]
    assert dense.tolist() == [[1.0, 1.0, -1.0, 0.0, 1.0, 0.0]]  # " cat to" straddles "cat"'s edge
    assert n == n_dense == 3  # the critic's own quotes
    no_good = ppo.span_deltas([text], [offsets], [{**fb, "good_spans": []}], mask, labels="dense")[0]
    assert torch.equal(no_good, dense)
    unparsed = ppo.span_deltas([text], [offsets], [None], mask, labels="dense")[0]
    assert unparsed.abs().sum() == 0  # no critique, no labels


def test_poor_labels_keep_only_the_negative_rewards_of_every_kind_of_critic():
    """--labels poor (bench/credit/credit.py's poor_span arm over any critic): delta_t = min(delta_t, 0), the same as
    dropping the good quotes, for a quoting critic, a python: critic's located spans and a scalar critic's steps."""
    text = "tom saw the cat today"
    offsets = [(0, 3), (3, 7), (7, 11), (11, 18), (18, 21), (21, 21)]
    mask = torch.ones(3, 6)
    quotes = {"critique": "c", "good_spans": ["tom", "today"], "poor_spans": ["the", "saw the"]}
    located = {
        "critique": "",
        "spans": [{"start": 0, "end": 7, "reward": 1.0}, {"start": 4, "end": 11, "reward": -1.0}],
    }
    steps = {"critique": "", "step_rewards": [(7, 0.5), (11, -0.25), (None, -0.75)]}
    feedback = [quotes, located, steps]
    spans = ppo.span_deltas([text] * 3, [offsets] * 3, feedback, mask)[0]
    poor = ppo.span_deltas([text] * 3, [offsets] * 3, feedback, mask, labels="poor")[0]
    assert poor.tolist() == [[min(x, 0.0) for x in row] for row in spans.tolist()]  # a plain loop as the reference
    assert poor.tolist() == [
        [0.0, -1.0, -1.0, 0.0, 0.0, 0.0],
        [0.0, -1.0, -1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, -0.25, 0.0, 0.0, -0.75],
    ]
    dropped = ppo.span_deltas([text], [offsets], [{**quotes, "good_spans": []}], mask[:1])[0]
    assert torch.equal(dropped, poor[:1])


def test_only_quotes_are_made_dense_or_weighted_and_counted():
    """--labels dense and --span-weighting linear-decay act on quotes (App. I): a python: critic's intervals and a
    scalar critic's score (critics.check_item's forms, their quote lists empty) go on the tokens as they are, and the
    count of spans counts each interval. The whole response, which --labels dense quotes once more as good, is not
    the critic's quote: where the critic quoted it too (the copy then finds no occurrence left), it is not counted
    unmatched; a critic's own quote of it twice is, under either labels."""
    text = "tom saw the cat today"
    offsets = [(0, 3), (3, 7), (7, 11), (11, 15), (15, 21), (21, 21)]
    located = {"critique": "", "good_spans": [], "poor_spans": [], "spans": [{"start": 0, "end": 7, "reward": 1.0}]}
    located["spans"].append({"start": 4, "end": 11, "reward": -1.0})
    score = {"critique": "", "good_spans": [], "poor_spans": [], "step_rewards": [(None, 0.5)]}
    mask = torch.ones(2, 6)
    plain, _, n, unmatched = ppo.span_deltas([text] * 2, [offsets] * 2, [located, score], mask)
    assert (n, unmatched) == (2, 0) and plain.abs().sum() > 0
    for weighting, labels in (("uniform", "dense"), ("linear-decay", "spans")):
        got, _, n, unmatched = ppo.span_deltas([text] * 2, [offsets] * 2, [located, score], mask, weighting, labels)
        assert torch.equal(got, plain) and (n, unmatched) == (2, 0), (weighting, labels)
    whole = {"critique": "c", "good_spans": [text], "poor_spans": ["cat"]}
    assert ppo.span_deltas([text], [offsets], [whole], mask[:1], labels="dense")[2:] == (2, 0)
    twice = {**whole, "good_spans": [text, text]}
    for labels in ("spans", "dense"):
        assert ppo.span_deltas([text], [offsets], [twice], mask[:1], labels=labels)[2:] == (3, 1), labels


def test_dense_run_trains_on_dense_labels_of_the_program_critic(tmp_path, tiny_model_dir):
    """--labels dense --critic program: step 3's delta is +1 on every token of a rollout outside the exact critic's poor
    spans, -1 inside; the monitor still logs the exact critic's own span reward, not the dense one."""
    from tasks.demo import demo_critic
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    d, row = _dump(tmp_path, tiny_model_dir, "dense", "--labels", "dense", "--log-every", "1")
    samples = common.read_jsonl(tmp_path / "dense" / "samples.jsonl")
    assert [s["response"] for s in samples] == d["texts"]  # the batch of 4, in order
    exact_sum, labelled = 0.0, 0
    for i, text in enumerate(d["texts"]):
        n = int(d["mask"][i].sum())
        text_i, offsets = common.decode_with_offsets(tok, d["response"][i, :n].tolist())
        assert text_i == text
        fb = demo_critic(samples[i]["prompt"], text)  # its poor quotes land where its good ones place them
        exact, _ = common.span_rewards(text, offsets, fb["good_spans"], fb["poor_spans"])
        for t, (s, e) in enumerate(offsets):
            want = (
                -1.0
                if exact[t] == -1
                else 1.0
                if text[s:e].strip()
                and not any(
                    a < e and s < b for a, b in common.locate_spans(text, fb["good_spans"], fb["poor_spans"])[1]
                )
                else None
            )
            if want is not None:
                assert d["delta"][i, t].item() == want
                labelled += 1
        exact_sum += sum(common.span_rewards(text, offsets, fb["good_spans"], fb["poor_spans"])[0])
    assert labelled >= 0.9 * d["mask"].sum().item() - 4  # nearly every token but the EOS carries a dense label
    assert row["exact/span_reward"] == pytest.approx(exact_sum / len(d["texts"]), abs=1e-4)


def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir, monkeypatch):
    extra = [
        "--steps",
        "4",
        "--save-every",
        "2",
        "--kl-coef",
        "0.1",
        "--adaptive-kl-target",
        "0.5",
        "--anneal-lr",
        "--log-every",
        "1",
    ]
    straight = _args(tmp_path, tiny_model_dir, *extra, "--output-dir", str(tmp_path / "straight"))
    ppo.train(straight)

    real_make_critic, calls = ppo.make_critic, [0]

    def crashing_make_critic(args):
        critic = real_make_critic(args)

        def wrapped(recs, texts):
            calls[0] += 1
            if calls[0] == 4:
                raise KeyboardInterrupt  # interrupted in the 4th iteration: step 3 is logged but not checkpointed
            return critic(recs, texts)

        return wrapped

    monkeypatch.setattr(ppo, "make_critic", crashing_make_critic)
    run = _args(tmp_path, tiny_model_dir, *extra, "--output-dir", str(tmp_path / "resumed"))
    with pytest.raises(KeyboardInterrupt):
        ppo.train(run)
    monkeypatch.setattr(ppo, "make_critic", real_make_critic)
    ppo.train(_args(tmp_path, tiny_model_dir, *extra, "--output-dir", str(tmp_path / "resumed"), "--resume"))

    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(_rows(tmp_path / "resumed")) == strip(_rows(tmp_path / "straight"))
    samples = [common.read_jsonl(tmp_path / d / "samples.jsonl") for d in ("resumed", "straight")]
    assert samples[0] == samples[1] and [r["step"] for r in samples[0]] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    traces = [common.read_jsonl(tmp_path / d / "trace.jsonl") for d in ("resumed", "straight")]  # the demo preset's
    assert traces[0] == traces[1] and [r["step"] for r in traces[0]] == [1, 2, 3, 4]  # --trace-samples 3
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["trainable"]
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["trainable"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_malformed_prompts_file_gives_one_line_error_and_no_output(tmp_path, tiny_model_dir):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"id": 2, "promt": "typo"}\n')
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            tiny_model_dir,
            "--prompts",
            str(bad),
            "--critic",
            "program",
            "--output-dir",
            str(tmp_path / "run"),
            "--scalar-baseline-dir",
            "",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"error: {bad}:2: missing field 'prompt'"
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------------
# torchrun: 2 processes with the gloo backend
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # 2 gloo ranks under torchrun
@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_torchrun_two_ranks_match_single_process_math(tmp_path, tiny_model_dir, shard):
    """2 gloo ranks against one process replaying their concatenated batches: the same advantages, the same updated
    weights; with --shard fsdp (issue 57) too, the checkpoint holding the gathered weights and optimizer state."""
    import socket

    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 16))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        str(ROOT / "03_train_policy.py"),
        "--model",
        tiny_model_dir,
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--critic",
        "program",
        "--output-dir",
        str(tmp_path / "run"),
        "--scalar-baseline-dir",
        "",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--num-minibatches",
        "1",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--lora-r",
        "4",
        "--dump-rollouts",
        str(tmp_path / "dump"),
        "--sft-data",
        str(tmp_path / "sft.jsonl"),
        "--sft-field",
        "reference",
        "--sft-steps",
        "2",
        "--sft-batch-size",
        "4",
        "--sft-output-dir",
        str(tmp_path / "sft"),
        "--shard",
        shard,
    ]
    # rank 0 trains the SFT warm start alone while rank 1 waits for it (a gloo group with a long timeout)
    proc = forkserver.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone writes the log
    assert (tmp_path / "run" / "policy" / "adapter_config.json").is_file()

    d = [torch.load(tmp_path / "dump" / f"step{s}_rank{r}.pt", weights_only=False) for s in (1, 2) for r in (0, 1)]
    assert d[2]["param_checksum"] == d[3]["param_checksum"]  # both ranks end with identical parameters
    assert d[0]["texts"] != d[1]["texts"]  # but sampled different rollouts
    if shard == "fsdp":  # --fsdp-generate layers (each layer gathered at every decode step) samples the same tokens
        new = {
            "--output-dir": str(tmp_path / "layers"),
            "--dump-rollouts": str(tmp_path / "dump_layers"),
            "--steps": "1",
            "--sft-steps": "0",
            "--model": str(tmp_path / "sft"),
        }  # the same SFT start
        layers = [new.get(cmd[i - 1], x) for i, x in enumerate(cmd)] + ["--fsdp-generate", "layers"]
        proc = forkserver.run(
            layers,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for r in (0, 1):
            e = torch.load(tmp_path / "dump_layers" / f"step1_rank{r}.pt", weights_only=False)
            assert e["texts"] == d[r]["texts"] and torch.equal(e["response"], d[r]["response"])
    for row, dumps in zip(common.read_jsonl(tmp_path / "run" / "trace.jsonl"), (d[:2], d[2:])):  # the demo preset's
        assert sum(row["locality"][g]["tokens"] for g in LOCALITY_GROUPS) == sum(
            x["mask"].sum().item() for x in dumps
        )  # --trace-samples: its locality counts both ranks' tokens
    for r0, r1 in (d[:2], d[2:]):  # single process on the concatenated batch gives the same whitened advantages
        T = max(r0["mask"].shape[1], r1["mask"].shape[1])
        cat = lambda k: torch.cat([torch.nn.functional.pad(x[k], (0, T - x[k].shape[1])) for x in (r0, r1)])  # noqa
        bonus = torch.where(torch.cat([r0["has_eos"], r1["has_eos"]]), 0.0, -1.0)
        rewards = ppo.compute_rewards(cat("delta"), cat("kl"), cat("mask"), r0["kl_coef"], "span", bonus)
        adv, ret = ppo.compute_gae(rewards, cat("values"), cat("mask"), 1.0, 0.95)
        adv = ppo.masked_whiten(adv, cat("mask"))
        assert torch.allclose(cat("advantages"), adv, atol=1e-5)
        assert torch.allclose(cat("returns"), ret, atol=1e-5)
    assert rows[0]["objective/span_reward"] == pytest.approx(
        torch.cat([(x["delta"] * x["mask"]).sum(1) for x in d[:2]]).mean().item(), abs=1e-5
    )
    # the updates: one process, from the same start, on each iteration's concatenated batch of both ranks' rollouts
    # (one minibatch, so the order of the rows does not matter) ends with the parameters the two ranks saved
    args = ppo.parse_args(cmd[cmd.index(str(ROOT / "03_train_policy.py")) + 1 :])
    torch.manual_seed(args.seed)
    model, tok = models.load_model(str(tmp_path / "sft"))
    model, _, value_head = ppo.build_policy(args, model)
    params = [p for p in model.parameters() if p.requires_grad] + list(value_head.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=1e-5)
    for r0, r1 in (d[:2], d[2:]):
        Q, T = (max(x[k].shape[1] for x in (r0, r1)) for k in ("query", "mask"))
        pad = lambda x, width, value, left: torch.nn.functional.pad(  # noqa: E731
            x, (width - x.shape[1], 0) if left else (0, width - x.shape[1]), value=value
        )
        b = ppo.Rollouts(
            input_ids=torch.cat(
                [
                    torch.cat(
                        [pad(x["query"], Q, tok.pad_token_id, True), pad(x["response"], T, tok.pad_token_id, False)], 1
                    )
                    for x in (r0, r1)
                ]
            ),
            attention_mask=torch.cat(
                [
                    torch.cat(
                        [pad((x["query"] != tok.pad_token_id).long(), Q, 0, True), pad(x["mask"].long(), T, 0, False)],
                        1,
                    )
                    for x in (r0, r1)
                ]
            ),
            has_eos=None,
            **{
                k: torch.cat([pad(x[k], T, 0.0, False) for x in (r0, r1)])
                for k in ("mask", "values", "advantages", "returns")
            },
        )
        with torch.no_grad():
            b.logprobs = ppo.forward(model, value_head, b.input_ids, b.attention_mask, T, 1.0)[0]
        ppo.update(model, value_head, b, params, optimizer, distributed.grad_scaler("cpu", "float32"), None, args)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    replayed = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert saved["trainable"].keys() == replayed.keys()
    for n, p in replayed.items():
        torch.testing.assert_close(p.detach(), saved["trainable"][n], rtol=1e-4, atol=1e-6)
    for n, p in value_head.state_dict().items():
        torch.testing.assert_close(p, saved["value_head"][n], rtol=1e-4, atol=1e-6)
    # one process cannot continue what two sampled: refused in one line, the run left as it was
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    refusal = (
        r"checkpoint\.pt: saved by 2 process\(es\), resumed with 1; resume with the same world size "
        r"\(torchrun --nproc_per_node 2\)"
        if shard == "ddp"
        else "--shard fsdp shards over torchrun's processes"
    )
    with pytest.raises(common.DataError, match=refusal):
        ppo.train(ppo.parse_args(cmd[cmd.index(str(ROOT / "03_train_policy.py")) + 1 :] + ["--resume", "--steps", "3"]))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_fsdp_layers_with_a_compiled_decoder_is_one_line(tmp_path, tiny_model_dir):
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 8))
    with pytest.raises(common.DataError, match="--fsdp-generate layers with --compile-generation"):
        ppo.train(
            ppo.parse_args(
                [
                    "--model",
                    tiny_model_dir,
                    "--prompts",
                    str(tmp_path / "prompts.jsonl"),
                    "--critic",
                    "program",
                    "--output-dir",
                    str(tmp_path / "run"),
                    "--sft-steps",
                    "0",
                    "--scalar-baseline-dir",
                    "",
                    "--shard",
                    "fsdp",
                    "--fsdp-generate",
                    "layers",
                    "--compile-generation",
                    "--device",
                    "cpu",
                ]
            )
        )


# ---------------------------------------------------------------------------------------------------------------------
# Real-model correctness on tiny models: the sampled policy is the scored policy
# ---------------------------------------------------------------------------------------------------------------------


def _dump(tmp_path, model_dir, name, *extra):
    """Step 1's rollouts of a 1-step run (--dump-rollouts) and its metrics row."""
    ppo.train(
        _args(
            tmp_path,
            model_dir,
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path / name),
            "--dump-rollouts",
            str(tmp_path / name / "dump"),
            *extra,
        )
    )
    return torch.load(tmp_path / name / "dump" / "step1_rank0.pt", weights_only=False), _rows(tmp_path / name)[0]


HUB_EXTRAS = {
    "repetition_penalty": 1.8,
    "no_repeat_ngram_size": 2,
    "min_p": 0.3,
    "typical_p": 0.5,
    "top_k": 3,
    "temperature": 0.2,
    "suppress_tokens": list(range(100, 400)),
    "bad_words_ids": [[5], [6]],
}


def paper_weights(text, offsets, good, poor):
    """App. I's weights from first principles: each located quote's tokens (those inside it, by their non-whitespace
    characters, or the character a byte token is part of) that carry its label, weighted 1 - (i - 1) * 0.9 / (n - 1)."""
    delta, _ = common.span_rewards(text, offsets, good, poor)
    good_iv, poor_iv, _ = common.locate_spans(text, good, poor)

    def inside(t, a, b):
        s, e = offsets[t]
        piece = text[s:e]
        if s == e:  # a byte token: where its character is
            return a <= s < b
        if piece.strip():  # by its non-whitespace characters
            s, e = s + len(piece) - len(piece.lstrip()), e - len(piece) + len(piece.rstrip())
        return a <= s and e <= b

    weights = [1.0] * len(delta)
    for label, ivs in ((1.0, good_iv), (-1.0, poor_iv)):
        for a, b in ivs:
            mine = [t for t in range(len(delta)) if delta[t] == label and inside(t, a, b)]
            for i, t in enumerate(mine):
                weights[t] = 1.0 if len(mine) == 1 else 1 - i * 0.9 / (len(mine) - 1)
    return [d * w for d, w in zip(delta, weights)]


def test_span_weighting_linear_decay_in_a_run(tmp_path, tiny_model_dir, tiny_tokenizer, fake_openai):
    """--span-weighting linear-decay end to end: the delta that step 4 turns into rewards is the critic's spans weighted
    by App. I's formula, recomputed here from the logged critiques. The critic (a server) quotes the first three words
    as good and the next two, right after them, as poor: adjacent spans of several tokens."""

    def reply(body, n):
        words = body["messages"][0]["content"].split("### Response\n", 1)[1].split(" ")
        return json.dumps({"critique": "c", "good_spans": [" ".join(words[:3])], "poor_spans": [" ".join(words[3:5])]})

    with fake_openai(reply) as server:
        d, row = _dump(
            tmp_path,
            tiny_model_dir,
            "run",
            "--span-weighting",
            "linear-decay",
            "--log-every",
            "1",
            "--critic",
            "openai",
            "--critic-base-url",
            server.base_url,
            "--min-new-tokens",
            "12",
            "--max-new-tokens",
            "12",
        )
    samples = common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(samples) == len(d["texts"]) == 4
    decayed = 0
    for i, s in enumerate(samples):
        n = int(d["mask"][i].sum())
        text, offsets = common.decode_with_offsets(tiny_tokenizer, d["response"][i, :n].tolist())
        assert text == s["response"] == d["texts"][i]
        want = paper_weights(text, offsets, s["good_spans"], s["poor_spans"])
        assert d["delta"][i, :n].tolist() == pytest.approx(want) and d["delta"][i, n:].abs().sum() == 0
        decayed += sum(abs(w) not in (0.0, 1.0) for w in want)
    assert decayed > 0 and row["objective/span_reward"] == pytest.approx((d["delta"] * d["mask"]).sum(1).mean().item())


def _trained(tmp_path, model_dir, name, *extra):
    """The trainable parameters after a run (its final checkpoint)."""
    ppo.train(_args(tmp_path, model_dir, "--output-dir", str(tmp_path / name), *extra))
    return torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["trainable"]


def test_grad_accum_gives_the_same_update(tmp_path, tiny_model_dir):
    """--grad-accum 2 splits each minibatch in two micro-batches; the update is the one of the whole minibatch (the
    loss is its token mean, not a mean of the micro-batches' means). Responses of different lengths (many stop ids)
    make the two differ. Another minibatch split is another update."""
    model = model_variant(tiny_model_dir, tmp_path / "stops", generation={"eos_token_id": list(range(200, 300))})
    flags = ("--steps", "2", "--num-minibatches", "1", "--lr", "1e-2", "--lora-r", "0", "--max-new-tokens", "16")
    one, two = (_trained(tmp_path, model, f"accum{k}", *flags, "--grad-accum", k) for k in ("1", "2"))
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=2e-6)
    split = _trained(tmp_path, model, "split", *flags[:2], "--num-minibatches", "2", *flags[4:])
    assert max((split[k] - one[k]).abs().max().item() for k in one) > 1e-4


def test_entropy_bonus_raises_the_entropy(tmp_path, tiny_model_dir):
    """--ent-coef > 0 is a bonus (loss - ent_coef * H): with no advantage and no value loss, the update makes the policy
    more uncertain on the batch (and a negative coefficient, less); with --ent-coef 0 it moves nothing."""
    tok = models.load_model(tiny_model_dir)[1]
    recs = demo_dataset("eval", 4)
    responses = [tok(r["response"], add_special_tokens=False)["input_ids"][:8] for r in recs]
    T = max(map(len, responses))
    ids, attn = models.left_pad(
        [tok(r["prompt"])["input_ids"] + y + [tok.pad_token_id] * (T - len(y)) for r, y in zip(recs, responses)],
        tok.pad_token_id,
    )
    mask = torch.tensor([[1.0] * len(y) + [0.0] * (T - len(y)) for y in responses])
    attn[:, -T:] = mask.long()
    entropy = {}
    for coef in ("0", "0.5", "-0.5"):
        args = _args(
            tmp_path,
            tiny_model_dir,
            "--ent-coef",
            coef,
            "--vf-coef",
            "0",
            "--num-minibatches",
            "1",
            "--ppo-epochs",
            "3",
        )
        torch.manual_seed(0)
        model, _, value_head = ppo.build_policy(args, models.load_model(tiny_model_dir)[0])
        params = [p for p in model.parameters() if p.requires_grad] + list(value_head.parameters())
        before = [p.detach().clone() for p in params]
        H = lambda: ppo.masked_mean(  # noqa: E731
            ppo.entropy_from_logits(ppo.forward(model, None, ids, attn, T, 1.0)[2]),  # noqa
            mask,
        ).item()
        with torch.no_grad():
            old_lp, h0 = ppo.forward(model, None, ids, attn, T, 1.0)[0], H()
        b = ppo.Rollouts(mask, None, ids, attn, logprobs=old_lp, advantages=0 * mask, values=0 * mask, returns=0 * mask)
        ppo.update(
            model,
            value_head,
            b,
            params,
            torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0),
            distributed.grad_scaler("cpu", "float32"),
            None,
            args,
        )
        with torch.no_grad():
            entropy[coef] = H() - h0
        moved = max((p.detach() - q).abs().max().item() for p, q in zip(params, before))
        assert (moved > 0) == (coef != "0")
    assert entropy["0"] == 0.0 and entropy["0.5"] > 1e-3 and entropy["-0.5"] < -1e-3


def _advantages_from(d, kl_coef, whiten_rewards, mode="span"):
    """Steps 4-5 from a dump, independently: rewards (scalar mode: the sum of delta at the last token), optional reward
    whitening (scale only), GAE by the direct sum, advantage whitening, in float64."""
    import numpy as np

    mask, B = d["mask"].double().numpy(), d["mask"].shape[0]
    delta = d["delta"].double().numpy() * mask
    rewards = (-kl_coef * d["kl"] * d["mask"]).double().numpy() + (delta if mode == "span" else 0.0)
    for i in range(B):
        n = int(mask[i].sum())
        rewards[i, n - 1] -= 0.0 if d["has_eos"][i] else 1.0  # the missing-EOS penalty
        rewards[i, n - 1] += 0.0 if mode == "span" else delta[i].sum()
    if whiten_rewards:
        valid = rewards[mask > 0]
        rewards = ((rewards - valid.mean()) / np.sqrt(valid.var() + 1e-8) + valid.mean()) * mask
    adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
    for i in range(B):
        n = int(mask[i].sum())
        a, r = gae_reference(rewards[i].tolist(), d["values"][i].tolist(), n, 1.0, 0.95)
        adv[i, :n], ret[i, :n] = a, r
    valid = adv[mask > 0]
    return (adv - valid.mean()) / np.sqrt(valid.var() + 1e-8) * mask, ret


@pytest.mark.parametrize("whiten", [False, True])
def test_whiten_rewards_in_a_run(tmp_path, tiny_model_dir, whiten):
    """--whiten-rewards scales the rewards before GAE (their mean kept): the run's advantages and returns are those
    recomputed from its own delta, KL and values, with the whitening or without it, and the two differ."""
    d, _ = _dump(tmp_path, tiny_model_dir, "run", *(["--whiten-rewards"] if whiten else []))
    for flag in (whiten, not whiten):
        adv, ret = _advantages_from(d, d["kl_coef"], flag)
        same = torch.allclose(d["returns"].double(), torch.from_numpy(ret), atol=1e-5) and torch.allclose(
            d["advantages"].double(), torch.from_numpy(adv), atol=1e-4
        )
        assert same == (flag == whiten)


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_kl_estimator_in_a_run(tmp_path, tiny_model_dir, estimator):
    """--kl-estimator k3 / full in a run: step 2's per-token KL (the policy after step 1 against the reference) is
    the estimator's formula, recomputed in float64 from the two models' log-probs, and never negative."""
    flags = ("--kl-estimator", estimator, "--lr", "3e-2", "--kl-coef", "0.1", "--output-dir", str(tmp_path / "run"))
    ppo.train(_args(tmp_path, tiny_model_dir, "--steps", "1", *flags))  # checkpoint.pt holds the policy after step 1
    after_one = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["trainable"]
    ppo.train(
        _args(tmp_path, tiny_model_dir, "--steps", "2", "--resume", "--dump-rollouts", str(tmp_path / "dump"), *flags)
    )
    d = torch.load(tmp_path / "dump" / "step2_rank0.pt", weights_only=False)
    args = _args(tmp_path, tiny_model_dir, *flags)
    model, tok = models.load_model(tiny_model_dir)
    model, _, _ = ppo.build_policy(args, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in after_one:
                p.copy_(after_one[n])
        T = d["mask"].shape[1]
        ids = torch.cat([d["query"], d["response"]], 1)
        attn = torch.cat([(d["query"] != tok.pad_token_id).long(), d["mask"].long()], 1)
        lp, _, logits = ppo.forward(model, None, ids, attn, T, 1.0)
        ref_lp, ref_logits = ppo.reference_forward(model, None, ids, attn, T, 1.0)
    if estimator == "k3":  # Schulman's k3: q/p - 1 - log(q/p), at the sampled token
        log_q_over_p = (ref_lp - lp).double()
        want = log_q_over_p.exp() - 1 - log_q_over_p
    else:  # the exact KL(p || q) over the vocabulary
        logp, logq = logits.double().log_softmax(-1), ref_logits.double().log_softmax(-1)
        want = (logp.exp() * (logp - logq)).sum(-1)
    want = want * d["mask"]
    assert torch.allclose(d["kl"].double(), want, atol=1e-5) and (d["kl"] >= 0).all() and d["kl"].max() > 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# --trace-samples: where each update went (bench/locality/locality.py, 04's "Where the update went")
# ---------------------------------------------------------------------------------------------------------------------


def test_locality_sums_match_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 6, 0, 5, 4]
    B, T = len(lengths), 7
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    delta = torch.randint(-1, 2, (B, T), generator=g).float() * mask
    delta[2] = delta[2].clamp(min=0)  # a clean answer with good spans
    delta[5] = 0.0  # a clean answer without any span
    log_ratio = torch.randn(B, T, generator=g) * mask
    log_ratio[0, :4] = 0.0  # tokens the update left alone: not made less likely ("down")
    want = {k: [] for k in LOCALITY_GROUPS}
    for b, n in enumerate(lengths):
        flawed = any(delta[b, t] < 0 for t in range(n))
        for t in range(n):
            d, x = delta[b, t].item(), log_ratio[b, t].item()
            want["poor" if d < 0 else "good" if d > 0 else "outside_flawed" if flawed else "outside_clean"].append(x)
    got = locality_summary(locality_sums(log_ratio, delta, mask))
    for k, xs in want.items():
        assert got[k]["tokens"] == len(xs) > 0
        assert got[k]["mean"] == pytest.approx(sum(xs) / len(xs), abs=1e-6)
        assert got[k]["mean_abs"] == pytest.approx(sum(map(abs, xs)) / len(xs), abs=1e-6)
        assert got[k]["down"] == pytest.approx(sum(x < 0 for x in xs) / len(xs))
    assert got["ratio"] == pytest.approx(got["poor"]["mean_abs"] / got["outside_flawed"]["mean_abs"])
    clean = locality_summary(locality_sums(log_ratio, delta.clamp(min=0), mask))  # no poor span anywhere
    assert clean["poor"]["tokens"] == clean["outside_flawed"]["tokens"] == 0 and clean["ratio"] is None


def _traced(tmp_path, model_dir, name, *extra):
    """A run's trace.jsonl, its --dump-rollouts by step and its metrics rows; every rollout of the batch traced."""
    ppo.train(
        _args(
            tmp_path,
            model_dir,
            "--output-dir",
            str(tmp_path / name),
            "--dump-rollouts",
            str(tmp_path / name / "dump"),
            "--trace-samples",
            "4",
            "--log-every",
            "1",
            *extra,
        )
    )
    trace = common.read_jsonl(tmp_path / name / "trace.jsonl")
    dumps = {
        r["step"]: torch.load(tmp_path / name / "dump" / f"step{r['step']}_rank0.pt", weights_only=False) for r in trace
    }
    return trace, dumps, _rows(tmp_path / name)


def _policy_logprobs(args, model_dir, trainable, d):
    """log pi(y_t) of a dump's rollouts under the policy with these trainable parameters (none: the start), float64."""
    model, tok = models.load_model(model_dir)
    model, _, _ = ppo.build_policy(args, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in (trainable or {}):
                p.copy_(trainable[n])
        ids = torch.cat([d["query"], d["response"]], 1)
        attn = torch.cat([(d["query"] != tok.pad_token_id).long(), d["mask"].long()], 1)
        return ppo.forward(model, None, ids, attn, d["mask"].shape[1], 1.0)[0].double()


def test_trace_records_the_update_the_run_made(tmp_path, tiny_model_dir, tiny_tokenizer):
    """--trace-samples: each traced token's delta, KL, V and A are the ones the update used (the dump's), its delta
    the span_rewards labels of the critic's spans, its old and new log-probs those of the policy before and after the
    update, and the batch's locality groups and means follow from them. Resumed, the trace is cut back and continues
    as if never interrupted; and the trace changes nothing in the run."""
    flags = ("--lr", "1e-2", "--kl-coef", "0.1", "--save-every", "1")
    trace, dumps, rows = _traced(tmp_path, tiny_model_dir, "run", "--steps", "1", *flags)
    after_one = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["trainable"]
    (tmp_path / "run" / "trace.jsonl").open("a").write('{"step": 2, "stale": true}\n')  # logged, never checkpointed
    trace, dumps, rows = _traced(tmp_path, tiny_model_dir, "run", "--steps", "2", "--resume", *flags)
    assert [r["step"] for r in trace] == [1, 2] and all(r["reward_mode"] == "span" for r in trace)
    args = _args(tmp_path, tiny_model_dir, *flags)
    moved = 0.0
    for row in trace:
        d = dumps[row["step"]]
        old = _policy_logprobs(args, tiny_model_dir, None if row["step"] == 1 else after_one, d)
        new = _policy_logprobs(args, tiny_model_dir, after_one, d) if row["step"] == 1 else None
        assert sorted(s["row"] for s in row["samples"]) == [0, 1, 2, 3]
        flawed = [any(x < 0 for x in s["delta"]) for s in row["samples"]]
        assert flawed == sorted(flawed, reverse=True)  # answers with a poor span first
        groups = {k: [] for k in LOCALITY_GROUPS}
        adv = {m: {k: [] for k in LOCALITY_GROUPS} for m in ("span", "scalar")}
        for s in row["samples"]:
            i, n = s["row"], int(d["mask"][s["row"]].sum())
            text, offsets = common.decode_with_offsets(tiny_tokenizer, d["response"][i, :n].tolist())
            assert "".join(s["tokens"]) == text == d["texts"][i] and len(s["tokens"]) == n
            fb = demo_critic(s["prompt"], text)
            labels = common.span_rewards(text, offsets, fb["good_spans"], fb["poor_spans"])[0]
            assert s["delta"] == labels == d["delta"][i, :n].tolist()  # the labels the update used
            for key, want in (("kl", d["kl"]), ("values", d["values"])):
                assert s[key] == pytest.approx(want[i, :n].tolist(), rel=1e-5, abs=1e-6)
            assert s["advantages"]["span"] == pytest.approx(d["advantages"][i, :n].tolist(), rel=1e-5, abs=1e-5)
            assert s["logprobs_old"] == pytest.approx(old[i, :n].tolist(), abs=1e-4)
            if new is not None:
                assert s["logprobs_new"] == pytest.approx(new[i, :n].tolist(), abs=1e-4)
            for lab, a, b in zip(labels, s["logprobs_old"], s["logprobs_new"]):
                group = (
                    "poor"
                    if lab < 0
                    else "good"
                    if lab > 0
                    else "outside_flawed"
                    if min(labels) < 0
                    else "outside_clean"
                )
                groups[group].append(b - a)
                moved = max(moved, abs(b - a))
            for m in adv:
                for lab, a in zip(labels, s["advantages"][m]):
                    adv[m][
                        "poor"
                        if lab < 0
                        else "good"
                        if lab > 0
                        else "outside_flawed"
                        if min(labels) < 0
                        else "outside_clean"
                    ].append(a)
        for k, xs in groups.items():  # the whole batch is traced: the locality is that of these tokens
            assert row["locality"][k]["tokens"] == len(xs)
            if xs:
                assert row["locality"][k]["mean_abs"] == pytest.approx(sum(map(abs, xs)) / len(xs), abs=1e-4)
            for m, by_group in adv.items():  # and the advantages' locality, in both modes
                xs = by_group[k]
                assert row["advantage_locality"][m][k]["tokens"] == len(xs)
                if xs:
                    assert row["advantage_locality"][m][k]["mean"] == pytest.approx(sum(xs) / len(xs), abs=1e-4)
    assert moved > 1e-3  # the update moved the log-probs (so the lr-0 test below can fail)
    ppo.train(
        _args(
            tmp_path,
            tiny_model_dir,
            "--output-dir",
            str(tmp_path / "plain"),
            "--steps",
            "2",
            "--trace-samples",
            "0",
            *flags,
        )
    )  # the demo preset traces 3 rollouts; 0 is off
    assert not (tmp_path / "plain" / "trace.jsonl").exists()
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(_rows(tmp_path / "plain")) == strip(rows)  # the trace draws nothing random


def test_the_missing_eos_penalty_is_traced_under_its_own_name(tmp_path, tiny_model_dir):
    """--missing-eos-penalty's -1 at the last token of an answer cut off before its EOS landed in trace.jsonl's
    rewards, where it read as the critic's. The trace's rewards are now the critic's and the KL's alone (span:
    delta_t - beta * KL_t; scalar: the delta-sum at the last token), and the penalty is missing_eos_penalty, beside
    them (what the update added at the last token); the advantages are those the update used, penalty included."""
    trace, dumps, _ = _traced(
        tmp_path, tiny_model_dir, "run", "--steps", "1", "--kl-coef", "0.1", "--missing-eos-penalty", "0.75"
    )
    (row,) = trace
    samples, beta = row["samples"], row["kl_coef"]
    assert any(not s["has_eos"] for s in samples)  # 8 new tokens: answers cut off before their EOS
    for s in samples:
        assert s["missing_eos_penalty"] == (0.0 if s["has_eos"] else -0.75)
        want = [d - beta * k for d, k in zip(s["delta"], s["kl"])]
        assert s["rewards"]["span"] == pytest.approx(want, abs=1e-5)
        scalar = [-beta * k for k in s["kl"]]
        scalar[-1] += sum(s["delta"])
        assert s["rewards"]["scalar"] == pytest.approx(scalar, abs=1e-5)
        assert s["advantages"]["span"] == pytest.approx(
            dumps[1]["advantages"][s["row"], : len(s["tokens"])].tolist(), rel=1e-5, abs=1e-5
        )


def test_trace_delta_is_zero_at_learning_rate_zero(tmp_path, tiny_model_dir):
    trace, _, _ = _traced(tmp_path, tiny_model_dir, "run", "--lr", "0", "--steps", "1")
    for s in trace[0]["samples"]:
        assert s["logprobs_new"] == s["logprobs_old"]
    assert all(g["mean_abs"] in (0.0, None) for k, g in trace[0]["locality"].items() if k != "ratio")


def test_trace_from_one_state_differs_between_modes_only_through_the_advantages(tmp_path, tiny_model_dir):
    """bench/locality/locality.py's experiment: two copies of one checkpoint, resumed for one iteration in each reward mode,
    sample the same rollouts and see the same delta, KL, beta, values and old log-probs; each computes both modes'
    rewards and advantages alike, the span rewards summed are the scalar ones, and only the update moves differently."""
    flags = ("--lr", "1e-2", "--kl-coef", "0.1")
    ppo.train(_args(tmp_path, tiny_model_dir, "--output-dir", str(tmp_path / "start"), "--steps", "1", *flags))
    traces, dumps = {}, {}
    for mode in ("span", "scalar"):
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "checkpoint.pt").write_bytes((tmp_path / "start" / "checkpoint.pt").read_bytes())
        trace, dump, _ = _traced(
            tmp_path, tiny_model_dir, mode, "--steps", "2", "--resume", "--reward-mode", mode, *flags
        )
        (traces[mode],), dumps[mode] = trace, dump[2]
    span, scalar = traces["span"], traces["scalar"]
    assert span["kl_coef"] == scalar["kl_coef"] and span["reward_mode"] == "span" and scalar["reward_mode"] == "scalar"
    for a, b in zip(span["samples"], scalar["samples"]):
        for key in ("row", "tokens", "delta", "kl", "values", "logprobs_old", "rewards", "advantages"):
            assert a[key] == b[key], key
        assert max(abs(x) for x in a["kl"]) > 0 and max(abs(x) for x in a["values"]) > 0  # a trained state
        assert sum(a["rewards"]["span"]) == pytest.approx(sum(a["rewards"]["scalar"]), abs=1e-4)  # the same return
        assert a["advantages"]["span"] != a["advantages"]["scalar"]
    assert any(a["logprobs_new"] != b["logprobs_new"] for a, b in zip(span["samples"], scalar["samples"]))
    assert {k: v["tokens"] for k, v in span["locality"].items() if k != "ratio"} == {
        k: v["tokens"] for k, v in scalar["locality"].items() if k != "ratio"
    }
    assert span["advantage_locality"] == scalar["advantage_locality"]
    for mode, d in dumps.items():  # each run's update used its own mode's advantages, as recomputed independently
        adv, _ = _advantages_from(d, span["kl_coef"], False, mode)
        assert torch.allclose(d["advantages"].double(), torch.from_numpy(adv), atol=1e-4)
        for s in span["samples"]:
            n = len(s["tokens"])
            assert s["advantages"][mode] == pytest.approx(adv[s["row"], :n].tolist(), abs=1e-4)


def test_locality_bench_summary_and_its_same_batch_check():
    """bench/locality/locality.py: medians [min, max] over the states, empty groups left out, the goals, and a refusal to
    compare two updates that did not see the same batch."""
    sys.path.insert(0, str(ROOT / "bench" / "locality"))
    import locality

    def state(poor_span, poor_scalar, rest_span, rest_scalar, n=4):
        loc = lambda poor, rest: locality_summary(  # noqa: E731
            torch.tensor(  # noqa: E731
                [
                    [n, poor * n, abs(poor) * n, n * (poor < 0)],
                    [0, 0, 0, 0],
                    [n, rest * n, abs(rest) * n, 0],
                    [0, 0, 0, 0],
                ],
                dtype=torch.float64,
            )
        )
        return {
            "span": loc(poor_span, rest_span),
            "scalar": loc(poor_scalar, rest_scalar),
            "advantages": {"span": loc(-2.0, -0.5), "scalar": loc(-1.0, -1.0)},
        }

    measured = [state(-0.5, -0.1, 0.05, 0.05), state(-0.2, 0.1, 0.01, 0.02), state(-0.4, -0.2, 0.1, 0.1)]
    s = locality.summarize(measured)
    assert s["span"]["poor"]["mean"] == {"median": -0.4, "min": -0.5, "max": -0.2, "n": 3}
    assert s["span"]["good"]["mean"] is None  # no good-span token in any state
    assert s["span"]["ratio"]["median"] == pytest.approx(10.0) and s["scalar"]["ratio"]["median"] == pytest.approx(2.0)
    assert s["span_over_scalar_ratio"]["median"] == pytest.approx(4.0)  # per state: 5, 4, 2
    assert s["goal_ratio_3x"] and not s["goal_ratio_3x_every_state"] and s["goal_poor_mean_negative"]
    assert s["scalar_poor_mean_positive_states"] == 1 and s["span"]["advantage"]["ratio"]["median"] == 4.0
    assert not locality.summarize([state(0.1, -0.1, 0.05, 0.05)])["goal_poor_mean_negative"]
    sample = {"tokens": [" a"], "delta": [-1.0], "kl": [0.0], "values": [0.0], "logprobs_old": [-1.0]}
    row = {"samples": [sample], "kl_coef": 0.2, "advantage_locality": {}, "locality": measured[0]["span"]}
    locality.check_same_batch(row, {**row, "locality": measured[0]["scalar"]})
    with pytest.raises(SystemExit, match="sample tokens differs"):
        locality.check_same_batch(row, {**row, "samples": [{**sample, "tokens": [" b"]}]})


def test_hub_generation_settings_do_not_change_what_is_sampled(tmp_path, tiny_model_dir):
    """generation_config.json's sampling extras reach neither the rollouts nor any other generate() (01, 02, 04 and
    the local critic all go through infra.models.generate)."""
    leaky = model_variant(tiny_model_dir, tmp_path / "leaky", generation=HUB_EXTRAS)
    plain, _ = _dump(tmp_path, tiny_model_dir, "plain", "--max-new-tokens", "12")
    extras, _ = _dump(tmp_path, leaky, "extras", "--max-new-tokens", "12")
    assert torch.equal(plain["response"], extras["response"]) and plain["texts"] == extras["texts"]
    prompts = [r["prompt"] for r in demo_dataset("eval", 4)]
    for temperature in (0.0, 1.0):
        outs = []
        for d in (tiny_model_dir, leaky):
            model, tok = models.load_model(d)
            torch.manual_seed(0)
            outs.append(models.generate(model, tok, prompts, 12, temperature=temperature))
        assert outs[0] == outs[1]


def test_every_eos_id_stops_generation_and_cuts_the_mask(tmp_path, tiny_model_dir, tiny_tokenizer):
    """generation_config.eos_token_id as a list (Llama-3.1 has three): generation stops at any of them and the
    response mask ends at the first one."""
    stops = [tiny_tokenizer.eos_token_id] + list(range(200, 400))
    multi = model_variant(tiny_model_dir, tmp_path / "multi", generation={"eos_token_id": stops})
    d, row = _dump(tmp_path, multi, "run", "--max-new-tokens", "16")
    lengths = d["mask"].sum(1).long().tolist()
    ended_elsewhere = 0
    for ids, n, has_eos in zip(d["response"].tolist(), lengths, d["has_eos"].tolist()):
        first = next((k for k, t in enumerate(ids) if t in stops), None)
        assert has_eos == (first is not None) and n == (first + 1 if has_eos else len(ids))
        ended_elsewhere += has_eos and ids[first] != tiny_tokenizer.eos_token_id
    assert ended_elsewhere > 0 and row["response/eos_rate"] > 0
    model, tok = models.load_model(multi)
    out = models.generate(model, tok, [r["prompt"] for r in demo_dataset("eval", 8)], 16, temperature=1.0)
    assert all(not set(x) & set(stops) for x in out) and min(map(len, out)) < 16


def test_a_tokenizer_without_pad_gets_a_distinct_one(tmp_path, tiny_model_dir):
    """README: the pad token is distinct from EOS where load_model adds it (a tokenizer without one); one a tokenizer
    ships is kept, even pad = EOS (SmolLM2: tests/test_real_model.py), as masks never compare ids with pad."""
    from transformers import AutoTokenizer

    d = model_variant(tiny_model_dir, tmp_path / "nopad")
    tok = AutoTokenizer.from_pretrained(d)
    tok.pad_token = None
    tok.save_pretrained(d)
    assert AutoTokenizer.from_pretrained(d).pad_token is None
    model, tok = models.load_model(d)
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id not in models.stop_ids(model)
    assert (
        model.get_input_embeddings().weight.shape[0] == len(tok)
        and model.generation_config.pad_token_id == tok.pad_token_id
    )
    same = model_variant(tiny_model_dir, tmp_path / "padeos")
    tok = AutoTokenizer.from_pretrained(same)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(same)
    assert models.load_model(same)[1].pad_token_id == tok.eos_token_id  # kept as shipped


def dropout_models(tmp_path, tiny_model_dir):
    """A Llama (attention_dropout copied into every attention module at build time) and a GPT-2 (dropout modules
    everywhere), both with dropout 0.1."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    llama = model_variant(tiny_model_dir, tmp_path / "llama", config={"attention_dropout": 0.1})
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tok),
            n_positions=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    return {"llama": llama, "gpt2": str(tmp_path / "gpt2")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_dropout_is_off_in_the_update(tmp_path, tiny_model_dir, arch, lora_r):
    """The first minibatch of the first epoch is scored by exactly the policy that sampled it: ratio 1 in the
    update's (train) mode, so approx KL and clip fraction are exactly 0."""
    model_dir = dropout_models(tmp_path, tiny_model_dir)[arch]
    _, row = _dump(
        tmp_path, model_dir, "run", "--ppo-epochs", "1", "--num-minibatches", "1", "--lora-r", lora_r, "--lr", "1e-2"
    )
    assert row["policy/approx_kl"] == 0.0 and row["policy/clipfrac"] == 0.0
    model, tok = models.load_model(model_dir)
    ids, mask = models.left_pad(
        [tok("post: tom has a red dog")["input_ids"], tok("it eats")["input_ids"]], tok.pad_token_id
    )
    with torch.no_grad():
        eval_lp = ppo.forward(model, None, ids, mask, 3, 1.0)[0]
    model.train()
    assert torch.equal(ppo.forward(model, None, ids, mask, 3, 1.0)[0].detach(), eval_lp)


def test_full_finetuning_in_bf16_keeps_float32_master_weights(tmp_path, tiny_model_dir):
    """One step at lr 1e-6 moves the weights: in bf16 storage nearly all of them would round back (spacing ~1e-4)."""

    def weights(lr):
        ppo.train(
            _args(
                tmp_path,
                tiny_model_dir,
                "--steps",
                "1",
                "--lora-r",
                "0",
                "--dtype",
                "bf16",
                "--lr",
                lr,
                "--output-dir",
                str(tmp_path / lr),
            )
        )
        return torch.load(tmp_path / lr / "checkpoint.pt", weights_only=False)["trainable"]

    moved, still = weights("1e-6"), weights("0")
    changed = sum((moved[k] != still[k]).sum().item() for k in moved)
    assert changed > 0.5 * sum(v.numel() for v in moved.values())
    assert all(v.dtype == torch.float32 for v in moved.values())


def test_target_kl_stops_on_the_current_epochs_kl(tmp_path, tiny_model_dir):
    """--target-kl compares the last epoch's mean approx KL, not the mean over every epoch so far."""
    run = lambda name, *a: _dump(tmp_path, tiny_model_dir, name, "--num-minibatches", "1", "--lr", "3e-2", *a)[1]  # noqa
    k1 = run("one", "--ppo-epochs", "1")["policy/approx_kl"]
    two = run("two", "--ppo-epochs", "2")
    k2 = 2 * two["policy/approx_kl"] - k1
    assert k2 > k1 >= 0
    target = ((k1 + k2) / 2 + k2) / 2  # above the running mean after epoch 2, below epoch 2's own KL
    stopped = run("stopped", "--ppo-epochs", "3", "--target-kl", str(target))
    assert stopped["policy/epochs"] == 2 and stopped["policy/approx_kl"] == pytest.approx(two["policy/approx_kl"])


def test_min_new_tokens_is_scored_as_it_was_sampled(tiny_model_dir):
    """With --min-new-tokens, generate() forbids EOS at the first positions; forward() scores that same distribution."""
    model, tok = models.load_model(tiny_model_dir)
    ids, mask = models.left_pad(
        [tok("post: tom lives in york")["input_ids"], tok("it eats")["input_ids"]], tok.pad_token_id
    )
    torch.manual_seed(0)
    config = models.generation_config(model, 6, temperature=0.7, min_new_tokens=4)
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config, output_scores=True, return_dict_in_generate=True
    )
    R = out.sequences.shape[1] - ids.shape[1]
    want = torch.stack(out.scores, 1).log_softmax(-1).gather(2, out.sequences[:, -R:, None]).squeeze(-1)
    full_mask = torch.cat([mask, torch.ones(2, R, dtype=torch.long)], 1)
    lp, _, logits = ppo.forward(model, None, out.sequences, full_mask, R, 0.7, (models.stop_ids(model), 4))
    assert torch.allclose(lp, want, atol=1e-4)
    assert torch.isfinite(ppo.entropy_from_logits(logits)).all()


def test_top_p_below_one_is_called_off_policy(tmp_path, tiny_model_dir, capsys):
    with pytest.raises(SystemExit):
        ppo.parse_args(["--help"])
    assert "Below 1 the run is OFF-POLICY" in capsys.readouterr().out
    ppo.train(_args(tmp_path, tiny_model_dir, "--steps", "1", "--top-p", "0.9"))
    assert "--top-p 0.9 < 1: this run is off-policy" in capsys.readouterr().err


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_served_critic_gets_its_training_input_with_every_default(
    tmp_path, tiny_chat_model_dir, tiny_reward_model, fake_openai, api
):
    """With stage 2's and stage 3's defaults, a served reward model gets exactly the input ids it was trained on (02's
    encode_example): the task prompt cut from its start to reward_model.json's max_prompt_tokens (02's --max-len minus
    --max-new-tokens), not to stage 3's own --max-prompt-tokens (1024). completions: the text itself, less the BOS the
    server adds (one BOS, not two); chat: the user message with the cut task prompt, the server applying the template.
    Each critique may be as long as the critiques stage 2 evaluated (reward_model.json's max_new_tokens)."""
    from transformers import AutoTokenizer

    rm = import_script("02_train_reward")
    rm_dir, rm_args = tiny_reward_model
    tok, settings = AutoTokenizer.from_pretrained(rm_dir), reward_models.rm_settings(rm_dir)
    assert settings["max_prompt_tokens"] == rm_args.max_len - rm_args.max_new_tokens < 1024
    long = [{"prompt": "post: " + " ".join(["ben has a grey horse called coco."] * 30) + "\nsummary:"}] * 4
    common.write_jsonl(tmp_path / "long.jsonl", long)
    with fake_openai(lambda body, n: '{"good_spans": [], "poor_spans": []}') as server:
        ppo.train(
            _args(
                tmp_path,
                tiny_chat_model_dir,
                "--critic",
                "openai",
                "--critic-base-url",
                server.base_url,
                "--critic-model",
                "rm",
                "--critic-api",
                api,
                "--reward-model",
                rm_dir,
                "--steps",
                "1",
                "--prompts",
                str(tmp_path / "long.jsonl"),
                "--task",
                "qa",
            )
        )  # qa: no demo monitor
        bodies = [r["body"] for r in server.requests]
    samples = common.read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(bodies) == 4 and len(samples) == 4
    assert {b["max_tokens"] for b in bodies} == {settings["max_new_tokens"]}
    for s in samples:
        if api == "completions":
            sent = next(b["prompt"] for b in bodies if b["prompt"].endswith(s["response"] + "\n<s>assistant: "))
            server_ids = tok(sent)["input_ids"]  # the server tokenizes what it gets and adds its BOS
        else:
            sent = next(
                b["messages"][0]["content"]
                for b in bodies
                if b["messages"][0]["content"].endswith("### Response\n" + s["response"])
            )
            server_ids = models.encode_prompt(
                tok,
                tok.apply_chat_template(
                    [{"role": "user", "content": sent}], tokenize=False, add_generation_prompt=True
                ),
            )
        assert server_ids[:2] != [tok.bos_token_id] * 2
        rec = {**s, "critique": "c", "good_spans": [], "poor_spans": []}
        target = len(tok(common.format_rm_target("c", [], []), add_special_tokens=False)["input_ids"]) + 1
        trained, status = rm.encode_example(tok, rec, rm_args.max_len, settings["max_prompt_tokens"])
        assert status == "truncated" and server_ids == trained["input_ids"][:-target]


@pytest.mark.parametrize("case", ["chat-template-on", "no-weights"])
def test_bad_model_input_one_line_exit_2_nothing_written(tmp_path, tiny_model_dir, case):
    extra = ["--chat-template", "on"] if case == "chat-template-on" else []
    model = tiny_model_dir if extra else model_variant(tiny_model_dir, tmp_path / "noweights", weights=False)
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            model,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--critic",
            "program",
            "--output-dir",
            str(tmp_path / "run"),
            "--scalar-baseline-dir",
            "",
            "--steps",
            "1",
            "--sft-steps",
            "0",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last == f"error: --chat-template on: the tokenizer of {model} has no chat template"
        if extra
        else last.startswith(f"error: {model}: cannot load the model: ")
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["tokenizer", "base"])
def test_broken_reward_model_one_line_exit_2_before_any_training(tmp_path, tiny_model_dir, case):
    """--critic local with a reward model that cannot load: a tokenizer that does not load, or an adapter whose base
    model (named in reward_model.json / adapter_config.json) is gone. One line, exit 2, before the SFT warm start."""
    if case == "tokenizer":
        rm_dir = as_reward_model(tiny_model_dir, tmp_path / "rm")
        (tmp_path / "rm" / "tokenizer.json").write_text("{not json")
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = model_variant(tiny_model_dir, tmp_path / "base")
        rm_dir = str(tmp_path / "rm")
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"])
        ).save_pretrained(rm_dir)
        common.write_json(tmp_path / "rm" / "reward_model.json", {"base_model": base})
        for f in (tmp_path / "base").iterdir():
            f.unlink()
        (tmp_path / "base").rmdir()
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 4))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            tiny_model_dir,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--critic",
            "local",
            "--reward-model",
            rm_dir,
            "--sft-data",
            str(tmp_path / "sft.jsonl"),
            "--sft-steps",
            "1",
            "--sft-output-dir",
            str(tmp_path / "sft"),
            "--output-dir",
            str(tmp_path / "run"),
            "--scalar-baseline-dir",
            "",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: --reward-model {rm_dir}: "
        + ("cannot load its tokenizer: " if case == "tokenizer" else f"its base model {base!r}")
    ), last
    assert not (tmp_path / "sft").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--temperature", "0"),
        ("--temperature", "-1"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--ppo-epochs", "0"),
        ("--num-minibatches", "0"),
        ("--grad-accum", "0"),
    ],
)
def test_sampling_settings_out_of_range_one_line_exit_2(tmp_path, flag, value):
    """T <= 0 would divide the logits by zero (or flip them); top-p outside (0, 1] samples nothing or is no nucleus;
    no PPO epoch would never update, no minibatch or micro-batch divides by zero: refused before anything is loaded
    or written."""
    proc = forkserver.run(
        [sys.executable, str(ROOT / "03_train_policy.py"), flag, value, "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {flag} {value}: must be ")
    assert not (tmp_path / "run").exists()


def test_dense_labels_refuse_within_span_weighting(tmp_path):
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--labels",
            "dense",
            "--span-weighting",
            "linear-decay",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --labels dense: ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["1", "3"])
def test_rloo_k_must_group_the_batch(tmp_path, value):
    """--advantage rloo needs >= 2 samples per prompt (a leave-one-out mean of nothing) that tile the batch of 8."""
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--advantage",
            "rloo",
            "--rloo-k",
            value,
            "--batch-size",
            "8",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --rloo-k {value}: must be >= 2 and divide")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Where a run writes, and what it logs: the numbers an iteration used, nothing another command made overwritten
# ---------------------------------------------------------------------------------------------------------------------


def _main_argv(tmp_path, tiny_model_dir, *extra):
    """03's command line for a 1-step run of the tiny model on 16 demo prompts (no --scalar-baseline-dir)."""
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    return [
        "--model",
        tiny_model_dir,
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--critic",
        "program",
        "--steps",
        "1",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        *extra,
    ]


def test_an_explicit_output_dir_trains_no_baseline_in_the_demo_folder(tmp_path, tiny_model_dir, monkeypatch):
    """The demo preset's scalar baseline (runs/demo/scalar) belongs to the zero-flag demo: with --output-dir, 03 trains
    that one run, and a baseline only where --scalar-baseline-dir asks for one (README's second stage-3 command)."""
    assert ppo.parse_args([]).scalar_baseline_dir == "runs/demo/scalar"
    assert ppo.parse_args(["--output-dir", "runs/demo/prog_scalar"]).scalar_baseline_dir == ""
    assert ppo.parse_args(["--output-dir", "x", "--scalar-baseline-dir", "y"]).scalar_baseline_dir == "y"
    monkeypatch.chdir(tmp_path)
    ppo.main(
        _main_argv(
            tmp_path,
            tiny_model_dir,
            "--sft-steps",
            "0",
            "--reward-mode",
            "scalar",
            "--output-dir",
            str(tmp_path / "prog_scalar"),
        )
    )
    assert (tmp_path / "prog_scalar" / "policy").is_dir() and not (tmp_path / "runs").exists()


def test_the_scalar_baseline_starts_from_the_same_sft(tmp_path, tiny_model_dir):
    """One SFT warm start, in OUTPUT_DIR/sft, that the scalar baseline reuses: both modes start from the same weights."""
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 8))
    ppo.main(
        _main_argv(
            tmp_path,
            tiny_model_dir,
            "--sft-data",
            str(tmp_path / "sft.jsonl"),
            "--sft-field",
            "reference",
            "--sft-steps",
            "1",
            "--sft-batch-size",
            "4",
            "--output-dir",
            str(tmp_path / "run"),
            "--scalar-baseline-dir",
            str(tmp_path / "scalar"),
        )
    )
    assert (tmp_path / "run" / "sft" / "config.json").is_file() and not (tmp_path / "scalar" / "sft").exists()
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("run", "scalar")]
    assert configs[0]["sft_output_dir"] == configs[1]["sft_output_dir"] == str(tmp_path / "run" / "sft")
    assert [c["reward_mode"] for c in configs] == ["span", "scalar"]


def test_a_ref_adapter_is_the_start_and_the_frozen_reference(tmp_path, tiny_model_dir):
    """--ref-adapter A: the policy starts as A and pi_ref is A, so the first iteration's KL is 0 (up to float rounding);
    training moves the policy's own copy of A (saved as the policy) and never pi_ref's (not among the trained
    parameters, although every reference forward switches adapters)."""
    from safetensors.torch import load_file

    ppo.main(
        _main_argv(tmp_path, tiny_model_dir, "--sft-steps", "0", "--lr", "1e-2", "--output-dir", str(tmp_path / "a"))
    )
    start = load_file(tmp_path / "a" / "policy" / "adapter_model.safetensors")
    ppo.main(
        _main_argv(
            tmp_path,
            tiny_model_dir,
            "--sft-steps",
            "0",
            "--steps",
            "2",
            "--ref-adapter",
            str(tmp_path / "a" / "policy"),
            "--output-dir",
            str(tmp_path / "b"),
        )
    )
    kl = [r["objective/kl"] for r in common.read_jsonl(tmp_path / "b" / "metrics.jsonl")]
    assert abs(kl[0]) < 1e-5 and kl[1] != 0, kl
    trainable = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["trainable"]
    assert trainable and all(".default." in n for n in trainable)  # pi_ref's adapter is never trained
    trained = load_file(tmp_path / "b" / "policy" / "adapter_model.safetensors")  # the policy's own adapter
    assert trained.keys() == start.keys() and any(not torch.equal(trained[k], start[k]) for k in start)


@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_gradient_checkpointing_changes_no_result(tmp_path, tiny_model_dir, lora_r):
    """--gradient-checkpointing (the 8B recipe's memory saver) recomputes activations in the backward pass: every
    logged number of a 2-step run is the run's without it, within float rounding, with LoRA and full fine-tuning; and
    it is switched on by transformers 5's own name (activation_checkpointing_enable: the old one goes in v6)."""
    import warnings

    def run(name, *extra):
        ppo.main(
            _main_argv(
                tmp_path,
                tiny_model_dir,
                "--sft-steps",
                "0",
                "--steps",
                "2",
                "--lora-r",
                lora_r,
                "--output-dir",
                str(tmp_path / name),
                *extra,
            )
        )
        return [
            {k: v for k, v in r.items() if not k.startswith("time/")}
            for r in common.read_jsonl(tmp_path / name / "metrics.jsonl")
        ]

    plain = run("plain")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gradient_checkpointing_enable.*")
        checkpointed = run("checkpointed", "--gradient-checkpointing")
    args = ppo.parse_args(_main_argv(tmp_path, tiny_model_dir, "--lora-r", lora_r, "--gradient-checkpointing"))
    policy = ppo.build_policy(args, models.load_model(tiny_model_dir)[0])[0]
    assert any(getattr(m, "gradient_checkpointing", False) for m in policy.modules())  # it is on
    assert [r.keys() for r in checkpointed] == [r.keys() for r in plain]
    for a, b in zip(checkpointed, plain):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_an_sft_start_is_reused_only_by_the_settings_that_made_it(tmp_path, tiny_model_dir):
    """--sft-output-dir is reused only where the same settings made it (its sft.json): other settings (here
    --sft-steps) are refused in one line before anything is trained, and nothing is touched; --overwrite retrains it.
    A model folder without sft.json (an SFT model made elsewhere) is used as it is."""
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 8))
    sft = tmp_path / "sft"

    def run(out, *extra):
        ppo.main(
            _main_argv(
                tmp_path,
                tiny_model_dir,
                "--sft-data",
                str(tmp_path / "sft.jsonl"),
                "--sft-field",
                "reference",
                "--sft-batch-size",
                "4",
                "--sft-output-dir",
                str(sft),
                "--output-dir",
                str(tmp_path / out),
                *extra,
            )
        )

    run("a", "--sft-steps", "1")
    assert json.loads((sft / "sft.json").read_text())["sft_steps"] == 1
    weights = (sft / "model.safetensors").read_bytes()
    run("b", "--sft-steps", "1")  # the same settings: reused, not retrained
    assert (sft / "model.safetensors").read_bytes() == weights
    with pytest.raises(
        common.DataError,
        match=rf"--sft-output-dir {sft} holds an SFT start made with other settings "
        r"\(--sft-steps: 1 there, 2 here\): --overwrite retrains it",
    ):
        run("c", "--sft-steps", "2")
    assert (sft / "model.safetensors").read_bytes() == weights and not (tmp_path / "c").exists()
    run("c", "--sft-steps", "2", "--overwrite")
    assert json.loads((sft / "sft.json").read_text())["sft_steps"] == 2
    assert (sft / "model.safetensors").read_bytes() != weights
    (sft / "sft.json").unlink()  # made elsewhere: used as it is, whatever the flags say
    weights = (sft / "model.safetensors").read_bytes()
    run("d", "--sft-steps", "3")
    assert (sft / "model.safetensors").read_bytes() == weights and not (sft / "sft.json").exists()


def test_a_fresh_run_never_replaces_a_run_without_overwrite(tmp_path, tiny_model_dir, monkeypatch):
    """A folder holding a run: a fresh start refuses (one line, exit 2, nothing touched); --resume without a checkpoint
    refuses alike; --overwrite replaces it. The zero-flag demo's own folders are replaced by a rerun of the demo."""
    monkeypatch.chdir(tmp_path)
    argv = _main_argv(tmp_path, tiny_model_dir, "--sft-steps", "0", "--output-dir", str(tmp_path / "run"))
    ppo.main(argv)
    before = {f: (tmp_path / "run" / f).read_bytes() for f in ("metrics.jsonl", "samples.jsonl", "checkpoint.pt")}
    proc = forkserver.run(
        [sys.executable, str(ROOT / "03_train_policy.py"), *argv], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'run'} holds a run (metrics.jsonl, samples.jsonl, trace.jsonl, checkpoint.pt, policy): "
        "--resume continues it from its checkpoint, --overwrite replaces it"
    ]
    (tmp_path / "run" / "checkpoint.pt").rename(tmp_path / "saved.pt")
    with pytest.raises(common.DataError, match=r"--resume: no checkpoint\.pt in .*run, which holds a run"):
        ppo.main(argv + ["--resume"])
    (tmp_path / "saved.pt").rename(tmp_path / "run" / "checkpoint.pt")
    assert {f: (tmp_path / "run" / f).read_bytes() for f in before} == before
    ppo.main(argv + ["--steps", "2", "--resume"])  # a checkpoint: continued
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2]
    ppo.main(argv + ["--overwrite"])  # replaced by a fresh 1-step run
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1]
    for d in ("runs/demo/text2grad", "runs/demo/scalar", "runs/demo/other"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "metrics.jsonl").write_text("{}\n")
    kind = lambda d, zero_flag=False, **k: runs.policy_run_kind(  # noqa: E731  (as 03 asks)
        d, k.get("resume", False), False, ppo.DEMO_RUNS if zero_flag else ()
    )
    assert [kind(d, zero_flag=True) for d in ("runs/demo/text2grad", "runs/demo/scalar")] == ["replace", "replace"]
    for d in ("runs/demo/text2grad", "runs/demo/other"):  # any command with a flag does not: the zero-flag demo's
        with pytest.raises(common.DataError, match="holds a run"):  # own folders alone are replaced by its rerun
            kind(d, zero_flag=d.endswith("other"))
    assert kind(str(tmp_path / "empty"), resume=True) == "fresh"


def test_logged_lr_and_beta_are_those_the_iteration_used(tmp_path, tiny_model_dir):
    """Iteration s logs the learning rate its update used (warmup: lr * s / N, before the scheduler steps) and the beta
    its rewards used (the adaptive controller updates it after); --dump-rollouts records the same beta."""
    extra = (
        "--steps",
        "3",
        "--warmup-steps",
        "4",
        "--lr",
        "1e-3",
        "--kl-coef",
        "0.1",
        "--adaptive-kl-target",
        "0.01",
        "--output-dir",
        str(tmp_path / "run"),
        "--dump-rollouts",
        str(tmp_path / "dump"),
    )
    ppo.train(_args(tmp_path, tiny_model_dir, *extra))
    rows = _rows(tmp_path / "run")
    assert [r["lr"] for r in rows] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])
    assert rows[0]["objective/kl_coef"] == 0.1
    for s in (1, 2):
        assert rows[s]["objective/kl_coef"] == pytest.approx(
            ppo.update_kl_coef(rows[s - 1]["objective/kl_coef"], rows[s - 1]["objective/kl"], 0.01, 10000, 4)
        )
    dumped = [torch.load(tmp_path / "dump" / f"step{s}_rank0.pt", weights_only=False)["kl_coef"] for s in (1, 2, 3)]
    assert dumped == pytest.approx([r["objective/kl_coef"] for r in rows])


def test_rloo_runs_no_value_head(tmp_path, tiny_model_dir, monkeypatch):
    """--advantage rloo: no forward pass computes values (no hidden states asked for), and no value metric is logged."""
    heads, real = [], ppo.forward

    def spy(model, value_head, *a, **k):
        heads.append(value_head)
        return real(model, value_head, *a, **k)

    monkeypatch.setattr(ppo, "forward", spy)
    _, row = _dump(tmp_path, tiny_model_dir, "rloo", "--advantage", "rloo", "--rloo-k", "2")
    assert heads and all(h is None for h in heads)
    assert not {"losses/value_loss", "val/explained_variance", "val/clipfrac"} & set(row)
    heads.clear()
    _, row = _dump(tmp_path, tiny_model_dir, "gae")
    assert any(h is not None for h in heads) and {"losses/value_loss", "val/explained_variance"} <= set(row)


def test_the_checkpoint_holds_the_grad_scaler(tmp_path, tiny_model_dir):
    """--dtype fp16's loss scale is part of the state a resumed run continues from."""
    args = _args(tmp_path, tiny_model_dir)
    torch.manual_seed(0)
    model, _, value_head = ppo.build_policy(args, models.load_model(tiny_model_dir)[0])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = ppo.make_optimizer(params, args)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)  # where a run's scale got to (it started at 2^16)
    runs.save_checkpoint(tmp_path / "ckpt.pt", 3, model, value_head, optimizer, scheduler, scaler, 0.1, {})
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert runs.load_checkpoint(tmp_path / "ckpt.pt", model, value_head, optimizer, scheduler, fresh) == (3, 0.1)
    assert fresh.get_scale() == 512.0


def test_dense_labels_count_the_critics_unmatched_quotes_and_place_its_poor_ones():
    """critic/unmatched_span_rate counts the critic's own quotes in both label modes: 2 of 4 not found is 2 of 4 with
    --labels dense too. A word quoted good then poor (a repetition) stays poor on its second occurrence."""
    text = "tom saw the cat"
    offsets = [(0, 3), (3, 7), (7, 11), (11, 15)]
    fb = {"critique": "c", "good_spans": ["tom", "dog"], "poor_spans": ["cat", "bird"]}
    for labels in ("spans", "dense"):
        _, _, n, unmatched = ppo.span_deltas([text], [offsets], [fb], torch.ones(1, 4), labels=labels)
        assert (n, unmatched) == (4, 2), labels
    text, offsets = "fish and fish", [(0, 4), (4, 8), (8, 13)]
    fb = {"critique": "c", "good_spans": ["fish"], "poor_spans": ["fish"]}
    assert ppo.span_deltas([text], [offsets], [fb], torch.ones(1, 3), labels="dense")[0].tolist() == [[1.0, 1.0, -1.0]]


def test_linear_decay_locates_each_quote_once(monkeypatch):
    calls, real = [0], common.locate_spans

    def counted(*a):
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(common, "locate_spans", counted)
    text, offsets = "ab cd ef gh", [(0, 2), (2, 5), (5, 8), (8, 11)]
    fb = {"critique": "c", "good_spans": ["ab cd"], "poor_spans": ["gh"]}
    delta, _, _, _ = ppo.span_deltas([text] * 2, [offsets] * 2, [fb, fb], torch.ones(2, 4), "linear-decay")
    assert calls[0] == 2 and delta[0].tolist() == pytest.approx([1.0, 0.1, 0.0, -1.0])


def test_run_settings_are_checked_where_they_are_parsed(monkeypatch):
    """--model outside the demo, and a batch that the world size x minibatches x micro-batches must divide, are flags:
    parse_args refuses them (read_prompts only reads prompts)."""
    with pytest.raises(common.DataError, match="--model is required outside the demo"):
        ppo.parse_args(["--task", "qa", "--prompts", "p.jsonl"])
    with pytest.raises(
        common.DataError,
        match=r"--batch-size 6 must divide by world size x --num-minibatches x "
        r"--grad-accum = 4",
    ):
        ppo.parse_args(["--batch-size", "6", "--num-minibatches", "4"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(common.DataError, match="= 8"):
        ppo.parse_args(["--batch-size", "12", "--num-minibatches", "2"])
    import inspect

    assert list(inspect.signature(read_prompts).parameters) == ["path", "task"]


def test_the_pure_functions_need_only_torch():
    """README: the pure tensor functions near the top of 03 depend on torch alone (no numpy), to copy as they are."""
    for name in (
        "masked_mean",
        "masked_whiten",
        "per_token_kl",
        "compute_rewards",
        "compute_gae",
        "compute_rloo",
        "ppo_loss",
        "update_kl_coef",
        "entropy_from_logits",
    ):
        assert "np" not in getattr(ppo, name).__code__.co_names, name
    assert isinstance(ppo.update_kl_coef(0.1, 12.0, 6.0, 10000, 100), float)


def test_train_is_alg4_in_at_most_100_lines():
    """Issue 16's readability bound: train() stays a page of named steps; log_iteration takes the iteration as a dict."""
    import inspect

    assert len(inspect.getsource(ppo.train).splitlines()) <= 100
    assert len(inspect.signature(trace.log_iteration).parameters) <= 6


def test_mean_reward_baseline_is_not_primes_masked_rloo(capsys):
    """PRIME's masked_rloo (Cui et al. 2025), transcribed as a loop: per token r * k/(k-1) - sum over the group of the
    mean rewards / (k-1), then summed from t on. --rloo-baseline mean-reward subtracts the other samples' mean reward
    alone: the two agree at t = 0 only. The issue's worked example, and nothing attributes mean-reward to PRIME."""
    rewards = torch.tensor([[1.0, 0.0, -1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    ours, _ = ppo.compute_rloo(rewards, mask, 2, baseline="mean-reward")
    for got, want in zip(ours.tolist(), [[-5 / 3, -2.0, -4 / 3, 1 / 3], [1.25, 0.5, -0.25, 0.0]]):
        assert got == pytest.approx(want, abs=1e-6)

    def prime(rows, lengths, k):
        means = [sum(r[:n]) / n for r, n in zip(rows, lengths)]
        out = []
        for i, (r, n) in enumerate(zip(rows, lengths)):
            group = sum(means[i // k * k : i // k * k + k])
            x = [r[t] * k / (k - 1) - group / (k - 1) for t in range(n)]
            out.append([sum(x[t:]) for t in range(n)] + [0.0] * (len(r) - n))
        return out

    theirs = prime(rewards.tolist(), [4, 3], 2)
    for got, want in zip(theirs, [[-5 / 3, -2.75, -11 / 6, 13 / 12], [1.25, 1 / 6, -11 / 12, 0.0]]):
        assert got == pytest.approx(want, abs=1e-6)
    assert ours[:, 0].tolist() == pytest.approx([row[0] for row in theirs])
    with pytest.raises(SystemExit):
        ppo.parse_args(["--help"])
    assert "PRIME" not in capsys.readouterr().out and "PRIME" not in ppo.compute_rloo.__doc__


def test_a_served_reply_without_choices_is_a_failed_critique(tmp_path, fake_openai):
    """A 200 reply whose `choices` is empty (a server that filtered its output) is a failed critique of that rollout,
    delta = 0 with its critic_error, for either API; it never raises out of the critic (an IndexError killed the run)."""

    def reply(body, n):
        return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "rm", "choices": []}, {}

    for api in ("chat", "completions"):
        with fake_openai(reply) as server:
            critic = ppo.make_critic(
                ppo.parse_args(
                    [
                        "--task",
                        "qa",
                        "--model",
                        "m",
                        "--critic",
                        "openai",
                        "--critic-base-url",
                        server.base_url,
                        "--critic-model",
                        "rm",
                        "--critic-api",
                        api,
                    ]
                )
            )
            fbs = critic([{"prompt": "Say a."}] * 2, [" a", " b"])
        assert all(ppo.critique_failed(fb) and "no choices" in fb["critic_error"] for fb in fbs)


# ---------------------------------------------------------------------------------------------------------------------
# A new user's first day (issue 46): critic failures are shown, a typo'd model path is one line at once
# ---------------------------------------------------------------------------------------------------------------------


def test_critic_failures_show_in_the_bar_warn_and_are_summed_at_the_end(tmp_path, tiny_model_dir, fake_openai, capsys):
    """At iteration 2 every critique stops parsing: the bar showed mistakes=0.00, reward=0.00 and nothing else. Now
    the bar shows the parse-fail rate, a warning line names the iteration, and the run ends with its total. The
    critic's share is what it flagged (issue 80, item 7: a user's critic flags; it was shown as mistakes=)."""

    def reply(body, n):  # iteration 1 (requests 1-4) parses; iteration 2 (5-8) is prose without span JSON
        word = body["messages"][0]["content"].split("### Response\n", 1)[1].split()[0]
        return json.dumps({"critique": "c", "good_spans": [], "poor_spans": [word]}) if n <= 4 else "It is fine."

    with fake_openai(reply) as server:
        ppo.train(
            _args(
                tmp_path,
                tiny_model_dir,
                "--critic",
                "openai",
                "--critic-base-url",
                server.base_url,
                "--critic-model",
                "rm",
                "--critic-concurrency",
                "4",
                "--max-fail-share",
                "0.5",
            )
        )
    out, err = capsys.readouterr()  # (the default share: _args lifts it to 1 for the untrained critics elsewhere)
    assert [r["critic/parse_fail_rate"] for r in _rows(tmp_path / "run")] == [0.0, 1.0]
    assert "parse_fail=0.00" in err and "parse_fail=1.00" in err
    assert "flagged=1.00" in err and "mistakes=" not in err  # iteration 1 quotes a poor word in every answer
    assert [r["critic/flagged_rate"] for r in _rows(tmp_path / "run")] == [1.0, 0.0]
    assert (
        "warning: iteration 2: 4 of 4 critiques failed (no span JSON, or no answer): their rollouts get delta = "
        "0; first: "
    ) in err
    assert "warning: iteration 1" not in err
    assert "critic (openai): 4 of 8 critiques failed in this run (50%), their rollouts got delta = 0" in out


def test_a_typo_in_a_local_model_path_is_one_line_at_once(tmp_path):
    (tmp_path / "runs").mkdir()
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            "runs/smolm2",
            "--prompts",
            "prompts.jsonl",
            "--critic",
            "program",
            "--output-dir",
            "runs/t2g",
            "--steps",
            "1",
            "--sft-steps",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --model runs/smolm2: no such directory"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []
    # issue 80, item 7: with a critic that needs a reward model not given (--task qa), --model is checked first
    qa = [sys.executable, str(ROOT / "03_train_policy.py"), "--task", "qa", "--model", "runs/nope"]
    qa += ["--prompts", "prompts.jsonl", "--output-dir", "runs/qa"]
    proc = forkserver.run(qa, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --model runs/nope: no such directory"


def test_a_missing_sft_data_file_is_one_line_not_a_traceback(tmp_path, tiny_model_dir):
    """Own --model and --prompts, no stage 1: the demo preset's --sft-data (runs/demo/data/sft.jsonl) is not there.
    That raised FileNotFoundError from deep in the SFT setup; it is one line naming the file and the flag, exit 2."""
    (tmp_path / "runs").mkdir()
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            str(tiny_model_dir),
            "--prompts",
            "prompts.jsonl",
            "--critic",
            "program",
            "--output-dir",
            "runs/t2g",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --sft-data runs/demo/data/sft.jsonl: no such file")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []


def test_own_prompts_under_the_demo_task_are_refused_at_once_not_mid_run(tmp_path, tiny_model_dir):
    """--task demo (the default) reads the demo's facts off each post for its exact critic and its reward-hacking
    monitor. Own prompts crashed with a ValueError traceback after the first rollouts; now the prompts file is
    checked first: its line, the reason, and the flag that fits (--task summarization), exit 2, nothing written."""
    (tmp_path / "runs").mkdir()
    common.write_jsonl(
        tmp_path / "prompts.jsonl", demo_dataset("train", 2) + [{"prompt": "Summarize: the order is late."}]
    )
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "03_train_policy.py"),
            "--model",
            str(tiny_model_dir),
            "--prompts",
            "prompts.jsonl",
            "--critic",
            "program",
            "--output-dir",
            "runs/t2g",
            "--steps",
            "1",
            "--sft-steps",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: prompts.jsonl:3: prompt: not a demo post")
    assert "--task" in proc.stderr.strip().splitlines()[-1]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []


def test_only_the_zero_flag_command_replaces_the_demos_runs(tmp_path, tiny_model_dir, monkeypatch):
    """A command with flags but no --output-dir inherits the demo preset's folders (README's served-critic command
    did): it must refuse the demo's finished runs there, not replace them. Only the literal zero-flag command may."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs/demo").mkdir(parents=True)
    (tmp_path / "runs/demo/base").symlink_to(tiny_model_dir)  # the demo preset's base model
    assert ppo.parse_args([]).zero_flag and not ppo.parse_args(["--critic", "program"]).zero_flag
    run = tmp_path / "runs/demo/text2grad"
    common.write_jsonl(run / "metrics.jsonl", [{"step": 1}])
    argv = _main_argv(tmp_path, tiny_model_dir, "--sft-steps", "0")
    with pytest.raises(common.DataError, match=r"runs/demo/text2grad holds a run \(metrics\.jsonl\)"):
        ppo.main(argv)
    assert common.read_jsonl(run / "metrics.jsonl") == [{"step": 1}] and not (tmp_path / "runs/demo/scalar").exists()


def test_resume_never_continues_on_another_sft_start(tmp_path, tiny_model_dir):
    """--resume --overwrite is refused (--overwrite would retrain the SFT start, and the checkpoint's adapter would
    be loaded onto the new one); so is --resume of a run whose SFT start is gone or was made with other settings."""
    with pytest.raises(common.DataError, match=r"^--resume and --overwrite: pick one"):
        ppo.parse_args(["--resume", "--overwrite"])
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 8))
    argv = _main_argv(
        tmp_path,
        tiny_model_dir,
        "--sft-data",
        str(tmp_path / "sft.jsonl"),
        "--sft-field",
        "reference",
        "--sft-batch-size",
        "4",
        "--sft-steps",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    )
    ppo.main(argv)
    with pytest.raises(common.DataError, match=r"--resume continues a run only on the start it began from"):
        ppo.main(argv[:-2] + ["--sft-steps", "2", "--steps", "2", "--resume"] + argv[-2:])
    shutil.rmtree(tmp_path / "run" / "sft")
    with pytest.raises(common.DataError, match=r"^--resume: the run's SFT start .*sft is gone"):
        ppo.main(argv + ["--steps", "2", "--resume"])


def test_a_resumed_run_keeps_where_its_earlier_iterations_ran(tmp_path, tiny_model_dir):
    """config.json said only the last invocation's --device: issue 44's Text2Grad seed 3, trained on a GPU, was
    "resumed" on a CPU with nothing left to do and then read as a CPU run. It keeps one segment per invocation
    (first step, device, world size), earlier ones carried over on --resume; a fresh start begins a new list."""
    run = tmp_path / "run"
    argv = _main_argv(tmp_path, tiny_model_dir, "--sft-steps", "0", "--save-every", "1", "--output-dir", str(run))
    ppo.main(argv[:])
    config = json.loads((run / "config.json").read_text())
    assert config["segments"] == [{"from_step": 1, "device": "cpu", "world_size": 1}]
    config["segments"][0]["device"] = "cuda"  # as if its first iteration had run on a GPU
    common.write_json(run / "config.json", config)
    ppo.main(argv + ["--steps", "2", "--resume"])
    ppo.main(argv + ["--steps", "2", "--resume"])  # finished: nothing left to run
    segments = json.loads((run / "config.json").read_text())["segments"]
    assert [(g["from_step"], g["device"]) for g in segments] == [(1, "cuda"), (2, "cpu"), (3, "cpu")]
    del config["segments"]  # a run from before segments: config.json has only its --device
    common.write_json(run / "config.json", {**config, "device": "cuda"})
    ppo.main(argv + ["--steps", "2", "--resume"])
    segments = json.loads((run / "config.json").read_text())["segments"]
    assert [(g["from_step"], g["device"]) for g in segments] == [(1, "cuda"), (3, "cpu")]
    ppo.main(argv + ["--overwrite"])
    assert [g["from_step"] for g in json.loads((run / "config.json").read_text())["segments"]] == [1]


def test_an_sft_start_is_keyed_by_its_base_models_content(tmp_path, tiny_model_dir):
    """sft.json records the base model's content, not only its path: a base rebuilt in the same folder makes the SFT
    start there one of other settings (refused; --overwrite retrains it), never silently reused."""
    base = Path(model_variant(tiny_model_dir, tmp_path / "base"))
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 8))
    argv = _main_argv(
        tmp_path,
        str(base),
        "--sft-data",
        str(tmp_path / "sft.jsonl"),
        "--sft-field",
        "reference",
        "--sft-batch-size",
        "4",
        "--sft-steps",
        "1",
        "--sft-output-dir",
        str(tmp_path / "sft"),
    )
    ppo.main(argv + ["--output-dir", str(tmp_path / "a")])
    model, tok = models.load_model(str(base))
    with torch.no_grad():
        for w in model.parameters():
            w.add_(0.01)
    (base / "model.safetensors").unlink()  # a symlink to the original's weights: rebuilt in place
    model.save_pretrained(base)
    with pytest.raises(
        common.DataError,
        match=r"holds an SFT start made with other settings \(--model: other "
        r"content\)",
    ):
        ppo.main(argv + ["--output-dir", str(tmp_path / "b")])


def test_an_sft_folder_holding_other_files_is_refused_before_training(tmp_path, tiny_model_dir):
    """--sft-output-dir that holds no model but files an SFT save did not write: refused in one line, untouched."""
    common.write_jsonl(tmp_path / "sft.jsonl", demo_dataset("sft", 8))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "notes.txt").write_text("mine")
    with pytest.raises(
        common.DataError,
        match=rf"^--sft-output-dir {tmp_path / 'sft'}: holds files that a save "
        r"there did not write \(notes\.txt\)",
    ):
        ppo.main(
            _main_argv(
                tmp_path,
                tiny_model_dir,
                "--sft-data",
                str(tmp_path / "sft.jsonl"),
                "--sft-field",
                "reference",
                "--sft-steps",
                "1",
                "--sft-output-dir",
                str(tmp_path / "sft"),
                "--output-dir",
                str(tmp_path / "run"),
            )
        )
    assert [p.name for p in (tmp_path / "sft").iterdir()] == ["notes.txt"]


def test_center_delta_takes_the_batch_mean_per_token_out_of_the_rewards():
    """--center-delta (bench/credit/credit.py's span_centred arm): r_t = (delta_t - mean delta over the batch's response
    tokens) - beta * KL_t, against a plain loop; without it, the paper's r_t = delta_t - beta * KL_t."""
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    delta = torch.tensor([[1.0, 1.0, -1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    kl = torch.rand(2, 4) * mask
    g = ppo.Rollouts(mask, torch.tensor([True, True]), delta=delta, kl=kl, values=torch.zeros(2, 4))
    args = argparse.Namespace(
        missing_eos_penalty=1.0, whiten_rewards=False, advantage="gae", gamma=1.0, lam=0.95, center_delta=True
    )
    rewards, _, _ = ppo.rewards_and_advantages(g, 0.1, "span", args)
    cells = [(b, t) for b in range(2) for t in range(4) if mask[b, t]]
    mean = sum(g.delta[b, t].item() for b, t in cells) / len(cells)  # 2 / 5
    for b, t in cells:
        assert rewards[b, t].item() == pytest.approx(g.delta[b, t].item() - mean - 0.1 * g.kl[b, t].item())
    assert rewards[mask == 0].abs().sum() == 0
    args.center_delta = False
    plain, _, _ = ppo.rewards_and_advantages(g, 0.1, "span", args)
    assert torch.allclose(plain, (g.delta - 0.1 * g.kl) * mask)


def test_ctrl_c_prints_where_the_run_stands_and_the_command_that_continues_it(tmp_path, tiny_model_dir):
    """Issue 56, item 8: Ctrl-C in stage 3 is one line (the iterations done, the last checkpoint, the --resume command
    that continues), no KeyboardInterrupt traceback, exit 130; and that command continues the run."""
    import signal

    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    argv = [
        "--model",
        tiny_model_dir,
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--critic",
        "program",
        "--output-dir",
        str(tmp_path / "run"),
        "--steps",
        "400",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--sft-steps",
        "0",
        "--device",
        "cpu",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--save-every",
        "2",
        "--overwrite",
    ]
    proc = subprocess.Popen(
        [sys.executable, "03_train_policy.py", *argv],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,  # SIGINT as a terminal delivers it, even when the
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # suite runs in `cmd &`
    metrics = tmp_path / "run" / "metrics.jsonl"
    while proc.poll() is None and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)  # no deadline: on a loaded machine the third iteration comes later, not never
    proc.send_signal(signal.SIGINT)
    err = proc.communicate()[1]
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    done = len(metrics.read_text().splitlines())
    assert line.startswith(f"interrupted after iteration {done} of 400; last checkpoint: iteration ")
    command = line.split("continue with: ", 1)[1]
    assert command.startswith("python 03_train_policy.py ") and command.endswith(" --resume")
    assert "--overwrite" not in command
    import shlex

    resumed = forkserver.run(
        [sys.executable, *shlex.split(command)[1:], "--steps", str(done + 1)], cwd=ROOT, capture_output=True, text=True
    )  # the printed command, one iteration further
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout


def test_resume_refuses_a_setting_that_shapes_training(tmp_path, tiny_model_dir):
    """Issue 56, item 3: --resume with another critic, learning rate or beta is refused in one line naming the flag
    and both values, before anything is written; --steps and the flags that change no result (logging, saving,
    tracing) may differ; config.json keeps the run's own settings."""
    args = _args(tmp_path, tiny_model_dir, "--save-every", "1")
    ppo.train(args)
    before = (tmp_path / "run" / "config.json").read_text()
    for extra, flag, there, here in (
        (("--lr", "0.5"), "--lr", "0.001", "0.5"),
        (("--kl-coef", "0.3"), "--kl-coef", "0.2", "0.3"),
        (("--critic", "python:tasks.demo:critic"), "--critic", "program", "python:tasks.demo:critic"),
    ):
        with pytest.raises(common.DataError, match=rf"--resume: {flag} was {there} in this run, {here} now"):
            ppo.train(_args(tmp_path, tiny_model_dir, "--resume", "--steps", "3", *extra))
        assert (tmp_path / "run" / "config.json").read_text() == before
        assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2]
    ppo.train(
        _args(
            tmp_path,
            tiny_model_dir,
            "--resume",
            "--steps",
            "3",
            "--log-every",
            "5",
            "--save-every",
            "7",
            "--trace-samples",
            "2",
        )
    )
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2, 3]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == 0.001


def _torchrun(tmp_path, argv, nproc=2):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = forkserver.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(ROOT / "03_train_policy.py"),
            *argv,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow  # 2 gloo ranks under torchrun
@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_fsdp_resume_is_exact_and_the_saved_policy_loads_whole_in_one_process(tmp_path, tiny_model_dir, lora_r):
    """Issue 57, --shard fsdp on 2 gloo ranks: 2 iterations, a resume and 2 more are the 4 of one run, to the bit
    (metrics and the gathered weights); the saved policy loads in one process and holds exactly the weights the
    sharded run trained, all of them (a LoRA adapter: not rank 0's slice, accelerate #4206; full fine-tuning of the
    tiny model with tied embeddings: one matrix, embed_tokens = lm_head)."""
    argv = _main_argv(
        tmp_path,
        tiny_model_dir,
        "--sft-steps",
        "0",
        "--shard",
        "fsdp",
        "--batch-size",
        "8",
        "--save-every",
        "2",
        "--lora-r",
        lora_r,
    )
    _torchrun(tmp_path, [*argv, "--steps", "4", "--output-dir", str(tmp_path / "straight")])
    _torchrun(tmp_path, [*argv, "--steps", "2", "--output-dir", str(tmp_path / "resumed")])
    _torchrun(tmp_path, [*argv, "--steps", "4", "--output-dir", str(tmp_path / "resumed"), "--resume"])
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert drop(_rows(tmp_path / "straight")) == drop(_rows(tmp_path / "resumed"))
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False) for d in ("straight", "resumed"))
    assert a["trainable"].keys() == b["trainable"].keys() and a["step"] == b["step"] == 4
    assert all(torch.equal(a["trainable"][n], b["trainable"][n]) for n in a["trainable"])
    model, _ = models.load_model(str(tmp_path / "straight" / "policy"))
    trained = {n: p for n, p in model.named_parameters() if n in a["trainable"]}
    assert trained.keys() == a["trainable"].keys()  # every trained weight is in the saved policy
    assert all(torch.equal(p.detach(), a["trainable"][n]) for n, p in trained.items())
    if lora_r == "0":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


FSDP_BYTES = r"""
import importlib, json, sys, types, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from infra import distributed, models
dist.init_process_group("gloo")
model, _ = models.load_model(sys.argv[2])
full = sum(p.numel() for p in model.parameters())
if sys.argv[3] == "fsdp":
    distributed.fully_shard_model(model)
params = [p for p in model.parameters()]
head = torch.nn.Linear(model.config.hidden_size, 1)  # 03's value head: whole on every rank, apart from `params`
ppo = importlib.import_module("03_train_policy")  # conftest's import_script, outside pytest
args = types.SimpleNamespace(lr=1e-3, compile_update=False, warmup_steps=1, steps=1, anneal_lr=False)
opt, _ = ppo.make_optimizer(params + list(head.parameters()), args)
for group in opt.param_groups:
    group["foreach"] = True  # AdamW's default on CUDA (a CPU's is its per-tensor loop)
out = model(input_ids=torch.randint(5, 90, (2, 9)), labels=torch.randint(5, 90, (2, 9)), output_hidden_states=True)
(out.loss + head(out.hidden_states[-1]).mean()).backward()
opt.step()
local = lambda t: t.to_local() if distributed.is_sharded(t) else t
held = {"params": sum(local(p).numel() for p in params),
        "adam": sum(local(v).numel() for p in params for k, v in opt.state[p].items() if k != "step"),
        "full": full, "groups": len(opt.param_groups)}
layer_sharded = lambda: any(distributed.is_sharded(p) for p in distributed.decoder_layers(model)[0].parameters())
held["kept_whole"] = []
with torch.no_grad(), distributed.gathered(model):  # a rollout: decode steps are forwards
    for _ in range(2):
        model(input_ids=torch.randint(5, 90, (2, 3)))
        held["kept_whole"].append(not layer_sharded())
held["resharded_after"] = layer_sharded()
__import__("os").write(1, (json.dumps(held) + "\n").encode())  # one write: the ranks' lines never interleave
"""


@pytest.mark.slow  # 2 gloo ranks under torchrun
def test_fsdp_holds_a_share_of_the_parameters_and_adam_states_per_rank(tmp_path, tiny_model_dir):
    """Issue 57: what each of 2 ranks holds, read off the DTensor local shards after one AdamW step: about half of
    the parameters and of the two Adam moments (DDP: all of them on every rank). The step is 03's make_optimizer's
    over the policy and a whole value head, with foreach forced as on CUDA: issue 58 found on an H200 that foreach
    kernels refuse a list mixing FSDP's sharded weights (DTensors) with plain tensors, so they go in separate groups."""
    import socket

    (tmp_path / "probe.py").write_text(FSDP_BYTES)
    held = {}
    for shard in ("ddp", "fsdp"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = forkserver.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(tmp_path / "probe.py"),
                str(ROOT),
                tiny_model_dir,
                shard,
            ],
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        held[shard] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    full = held["ddp"][0]["full"]
    assert all(r["params"] == full and r["adam"] == 2 * full and r["groups"] == 1 for r in held["ddp"])
    assert all(r["groups"] == 2 for r in held["fsdp"])  # the sharded policy, the whole value head
    assert sum(r["params"] for r in held["fsdp"]) == full and sum(r["adam"] for r in held["fsdp"]) == 2 * full
    assert all(0.45 * full <= r["params"] <= 0.55 * full for r in held["fsdp"])
    # a rollout gathers once: the layers stay whole through every decode step's forward, and are sharded again after
    assert all(r["kept_whole"] == [True, True] and r["resharded_after"] for r in held["fsdp"])


def test_a_score_without_logits_updates_as_one_with_them_when_the_entropy_bonus_is_off():
    """score(rows) may leave out the (B, T, V) logits when ent_coef is 0: the same update, bit for bit, with no
    entropy logged (it is logged from the logits when they are there)."""
    with_logits, stats, _ = _bigram_update(ppo.no_reduction)
    score, params, batch = _bigram()
    hp = ppo.PpoHParams(ppo_epochs=2, num_minibatches=2, max_grad_norm=1e9)
    lean = lambda rows: (*score(rows)[:2], None)  # noqa: E731
    stats2, _ = ppo.ppo_update(lean, batch, params, torch.optim.SGD(params, lr=0.1), hp)
    for a, b in zip(with_logits, params):
        assert torch.equal(a, b.detach())
    assert (
        "losses/entropy" in stats[0]
        and [{k: v for k, v in s.items() if k != "losses/entropy"} for s in stats] == stats2
    )


def test_explained_variance_is_cleanrls():
    """Issue 80, item 5: 1 - Var[returns - V] / Var[returns] over the response tokens, as CleanRL's ppo.py logs it
    (numpy on the masked entries here): a value head off by a constant explains everything (the old 1 - MSE / Var
    read 0.20 for one), one that predicts nothing explains 0."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3])
    returns, values = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    y, v = returns[mask.bool()].numpy(), values[mask.bool()].numpy()
    assert ppo.explained_variance(values, returns, mask) == pytest.approx(1 - np.var(y - v) / np.var(y), rel=1e-5)
    assert ppo.explained_variance(returns + 0.5, returns, mask) == pytest.approx(1.0, abs=1e-6)
    assert ppo.explained_variance(torch.zeros_like(returns), returns, mask) == pytest.approx(0.0, abs=1e-6)


def test_dense_labels_give_a_whitespace_token_plus_one_as_docs_say():
    """Issue 80, item 6: docs/stages.md said --labels dense gives 0 to a token of whitespace alone; span_rewards gives
    it +1 (it lies inside the whole response, quoted good), and the page now says so, with this example."""
    text, offsets = "the dog\n\nran fast", [(0, 3), (3, 7), (7, 9), (9, 12), (12, 17)]
    fb = {"critique": "c", "good_spans": [], "poor_spans": ["ran"]}
    delta = ppo.span_deltas([text], [offsets], [fb], torch.ones(1, 5), labels="dense")[0]
    assert delta.tolist() == [[1.0, 1.0, 1.0, -1.0, 1.0]]
    assert "is [1, 1, 1, −1, 1] on its tokens" in (ROOT / "docs" / "stages.md").read_text(encoding="utf-8")


def test_the_value_loss_reaches_the_policys_weights_not_detached(tiny_model_dir):
    """Issue 80, item 4 (a departure from Alg. 4, lines 28-30, as TRL's and microsoft/Text2Grad's code): forward's
    values read the policy's last hidden state without a detach, so a value loss has a gradient on the policy's own
    weights, not on the value head alone; the whitening's std is the population one."""
    model, _ = models.load_model(tiny_model_dir, device="cpu", dtype="float32")
    head = torch.nn.Linear(model.config.hidden_size, 1)
    ids = torch.randint(3, 20, (2, 7))
    _, values, _ = ppo.forward(model, head, ids, torch.ones_like(ids), 3, 1.0)
    values.square().sum().backward()
    layer = model.model.layers[-1].mlp.down_proj.weight
    assert layer.grad is not None and layer.grad.abs().sum() > 0 and head.weight.grad.abs().sum() > 0
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(ppo.masked_whiten(x, torch.ones_like(x)), (x - 2.0) / (2.0 / 3.0) ** 0.5)


def test_the_value_target_is_the_lambda_return():
    """Issue 80, item 4: returns = A + V, the lambda-return (Alg. 4's line 24 takes the Monte-Carlo return): at
    lambda 0.95 it differs from the reward-to-go, at lambda 1 (gamma 1) it is the reward-to-go exactly."""
    g = torch.Generator().manual_seed(0)
    rewards, values, mask = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g), torch.ones(3, 5)
    to_go = rewards.flip(1).cumsum(1).flip(1)  # sum_{s >= t} r_s
    advantages, returns = ppo.compute_gae(rewards, values, mask, 1.0, 0.95)
    assert torch.allclose(returns, advantages + values) and not torch.allclose(returns, to_go, atol=1e-3)
    assert torch.allclose(ppo.compute_gae(rewards, values, mask, 1.0, 1.0)[1], to_go, atol=1e-5)


def test_target_kl_is_the_epochs_token_mean_whatever_the_micro_batches_and_ranks():
    """Issue 80, item 2: --target-kl compared a mean of micro-batch means, so a 1-token micro-batch weighed as much as
    a 6-token one and --grad-accum (or the world size) changed how many epochs ran. Rows of 6/1/1/1 tokens, lr 0 (the
    policy stays put): with the threshold between the token mean and the mean of row means, every split and 1 or 2
    ranks run the same epochs, those of the token mean."""
    B, T = 4, 6
    mask = (torch.arange(T)[None] < torch.tensor([6, 1, 1, 1])[:, None]).float()
    g = torch.Generator().manual_seed(0)
    new = torch.randn(B, T, generator=g) * mask
    old = (new - torch.randn(B, T, generator=g)) * mask
    k3 = ((new - old).exp() - 1 - (new - old)) * mask
    token_mean, row_means = k3.sum() / mask.sum(), (k3.sum(1) / mask.sum(1)).mean()
    assert abs(token_mean - row_means) > 0.1
    target = float(token_mean + row_means) / 2
    w = torch.nn.Parameter(torch.zeros(()))
    batch = ppo.Rollouts(
        mask, logprobs=old, values=torch.zeros(B, T), advantages=mask.clone(), returns=torch.zeros(B, T)
    )
    score = lambda rows: (new[rows] + w, None, None)  # noqa: E731
    runs = []
    for accum, all_sum in (
        (1, ppo.no_reduction),
        (2, ppo.no_reduction),
        (4, ppo.no_reduction),
        (2, lambda x: x.mul_(2)),
    ):
        hp = ppo.PpoHParams(ppo_epochs=3, num_minibatches=1, grad_accum=accum, target_kl=target, vf_coef=0.0)
        runs.append(ppo.ppo_update(score, batch, [w], torch.optim.SGD([w], lr=0.0), hp, all_sum=all_sum)[1])
    assert runs == [1 if token_mean > target else 3] * 4


def test_the_logged_update_stats_are_token_means_whatever_the_micro_batches_and_ranks():
    """Issue 80, item 2: policy/approx_kl (and clipfrac, the losses) were logged as a mean of micro-batch means, so
    --grad-accum and the world size changed them. Rows of 6/1/1/1 tokens, one epoch at lr 0: trace.token_means gives
    the k3 token mean at every split and on 2 ranks (each holding the same stats: twice the sums), where the old
    mean of micro-batch means moves with the split."""
    from infra import distributed, trace

    B, T = 4, 6
    mask = (torch.arange(T)[None] < torch.tensor([6, 1, 1, 1])[:, None]).float()
    g = torch.Generator().manual_seed(0)
    new = torch.randn(B, T, generator=g) * mask
    old = (new - torch.randn(B, T, generator=g)) * mask
    token_mean = float((((new - old).exp() - 1 - (new - old)) * mask).sum() / mask.sum())
    w = torch.nn.Parameter(torch.zeros(()))
    batch = ppo.Rollouts(
        mask, logprobs=old, values=torch.zeros(B, T), advantages=mask.clone(), returns=torch.zeros(B, T)
    )
    score = lambda rows: (new[rows] + w, None, None)  # noqa: E731
    logged, old_way = [], []
    for accum, ranks in ((1, 1), (2, 1), (4, 1), (2, 2)):
        hp = ppo.PpoHParams(ppo_epochs=1, num_minibatches=1, grad_accum=accum, vf_coef=0.0)
        stats, _ = ppo.ppo_update(score, batch, [w], torch.optim.SGD([w], lr=0.0), hp)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(distributed, "all_sum", lambda x: x.mul_(ranks))
            logged.append(trace.token_means(stats, "cpu")["policy/approx_kl"])
        old_way.append(sum(s["policy/approx_kl"] for s in stats) / len(stats))
    assert logged == pytest.approx([token_mean] * 4, abs=1e-6)
    assert max(old_way) - min(old_way) > 0.1  # the instrument: the old mean sees the split


def test_center_delta_is_a_length_reward_as_docs_say():
    """Issue 80, item 3: centring over the batch's tokens adds -n * mean(delta) to a response's return. Two responses
    with the same two +1 tokens, 4 and 7 tokens long: returns (gamma = lambda = 1, V = 0, beta = 0) 2 and 2 without
    --center-delta, +0.545 and -0.545 with it, as docs/stages.md says."""
    mask = torch.tensor([[1.0] * 4 + [0.0] * 3, [1.0] * 7])
    delta = torch.tensor([[1.0, 1.0] + [0.0] * 5, [1.0, 1.0] + [0.0] * 5])
    g = ppo.Rollouts(mask, torch.tensor([True, True]), delta=delta, kl=torch.zeros(2, 7), values=torch.zeros(2, 7))
    args = argparse.Namespace(
        missing_eos_penalty=0.0, whiten_rewards=False, advantage="gae", gamma=1.0, lam=1.0, center_delta=False
    )
    assert ppo.rewards_and_advantages(g, 0.0, "span", args)[2][:, 0].tolist() == [2.0, 2.0]
    args.center_delta = True
    assert ppo.rewards_and_advantages(g, 0.0, "span", args)[2][:, 0].tolist() == pytest.approx([6 / 11, -6 / 11])
    assert "+0.545 and −0.545 with it" in (ROOT / "docs" / "stages.md").read_text(encoding="utf-8")
