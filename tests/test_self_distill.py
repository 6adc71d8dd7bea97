"""03 --reward-mode self_distill (baselines/self_distill.py): the critique as a self-teacher, SDPO's per-token signal,
against TRL's own loss functions (trl.experimental.sdpo.loss_utils, TRL 1.16: requirements-eval.txt) and against a
direct forward of the teacher's context row by row."""

import os

import pytest
import torch

import common
from baselines import self_distill
from baselines.reflection_data import revision_prompt
from conftest import import_script
from infra import models
from tasks.demo import demo_critic, demo_dataset

ppo = import_script("03_train_policy")


def _trl_loss_utils():
    try:
        from trl.experimental.sdpo import loss_utils
    except ImportError as e:  # under CI (CI set) a missing package is a failure, never a skip (as conftest's)
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"TRL is not installed (requirements-eval.txt): {e}")
    return loss_utils


def test_the_per_token_advantage_is_trls_sampled_token_distillation_loss():
    """On one batch of logits: TRL's sampled-token loss is (log pi_s - log pi_t).detach() * log pi_s per token, so
    -delta is its detached factor; and the clipped surrogate of 03 with A_t = delta_t at ratio 1 (--advantage token,
    the first minibatch of an update) has TRL's gradient, token by token. Its reverse KL over the full vocabulary
    (alpha 1) is the KL the sampled tokens estimate."""
    loss_utils = _trl_loss_utils()
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 11
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(V, (B, T), generator=g)
    gather = lambda logits: logits.log_softmax(-1).gather(2, ids[..., None]).squeeze(-1)  # noqa: E731
    mask = torch.ones(B, T, dtype=torch.float64)
    delta = self_distill.delta(gather(teacher), gather(student).detach(), mask, torch.ones(B, dtype=torch.bool))
    trl = loss_utils.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    torch.testing.assert_close(trl, -delta * gather(student), rtol=0, atol=1e-12)
    (want,) = torch.autograd.grad(trl.sum(), student)
    logprobs = gather(student)
    pg_loss, _, _ = ppo.ppo_loss(logprobs, logprobs.detach(), delta, None, None, None, mask, 0.2, 0.2)
    (got,) = torch.autograd.grad(pg_loss * mask.sum(), student)  # ppo_loss is the token mean
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    full = loss_utils.compute_full_logit_self_distillation_loss(student, teacher, distillation_alpha=1.0)
    p = student.softmax(-1)
    torch.testing.assert_close(full, (p * (student.log_softmax(-1) - teacher.log_softmax(-1))).sum(-1))


def test_a_row_without_a_critique_gets_no_delta():
    lp, teacher = torch.zeros(2, 3), torch.ones(2, 3)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    d = self_distill.delta(teacher, lp, mask, torch.tensor([True, False]))
    assert d.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_self_distill_run_scores_the_teacher_row_by_row(tmp_path, tiny_model_dir):
    """A 1-iteration run at lr 0 (the weights stay those that sampled): each rollout's delta_t is, row by row without
    padding, log pi(y_t | revision_prompt(x, y, demo_critic's critique)) - log pi(y_t | x); --advantage token makes
    A_t = r_t = delta_t - beta * KL_t (and the missing-EOS penalty at the last token), unwhitened, and no value head
    is trained."""
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    flags = [
        *("--model", tiny_model_dir, "--prompts", str(tmp_path / "prompts.jsonl"), "--critic", "program"),
        *("--output-dir", str(tmp_path / "run"), "--scalar-baseline-dir", "", "--steps", "1", "--batch-size", "4"),
        *("--num-minibatches", "2", "--ppo-epochs", "1", "--max-new-tokens", "8", "--sft-steps", "0"),
        *("--device", "cpu", "--lora-r", "4", "--lora-alpha", "8", "--lr", "0", "--max-fail-share", "1"),
        *("--reward-mode", "self_distill", "--advantage", "token", "--dump-rollouts", str(tmp_path / "dump")),
    ]
    args = ppo.parse_args(flags)
    ppo.train(args)
    d = torch.load(tmp_path / "dump" / "step1_rank0.pt", weights_only=False)
    records = common.read_jsonl(tmp_path / "prompts.jsonl")
    recs = [records[i] for i in ppo.prompt_indices(1, len(records), args, 0, 1)]
    model, tok = models.load_model(tiny_model_dir)
    assert d["delta"].abs().sum() > 0

    def logprobs(query: list[int], response: list[int]) -> torch.Tensor:
        ids = torch.tensor([query + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(query) - 1 : -1]
        return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)

    for i, rec in enumerate(recs):
        n = int(d["mask"][i].sum())
        response = d["response"][i, :n].tolist()
        critique = demo_critic(rec["prompt"], d["texts"][i])["critique"]
        teacher = logprobs(models.policy_prompt(tok, revision_prompt(rec["prompt"], d["texts"][i], critique)), response)
        student = logprobs(models.policy_prompt(tok, rec["prompt"]), response)
        torch.testing.assert_close(d["delta"][i, :n], teacher - student, rtol=1e-4, atol=1e-4)
        assert d["delta"][i, n:].abs().sum() == 0
    rewards = (d["delta"] - d["kl_coef"] * d["kl"]) * d["mask"]
    last = d["mask"].sum(1).long() - 1
    rewards[torch.arange(4), last] -= (~d["has_eos"]).float()  # the missing-EOS penalty of 1
    torch.testing.assert_close(d["advantages"], rewards, rtol=1e-5, atol=1e-6)
    head = torch.load(tmp_path / "run" / "policy" / "value_head.pt", weights_only=True)
    assert all(v.abs().sum() == 0 for v in head.values())  # zero-init and never trained


def test_self_distill_needs_a_critic_that_writes_a_critique(tmp_path, tiny_model_dir):
    with pytest.raises(common.DataError, match="self_distill: --critic scalar-rm writes no critique"):
        ppo.parse_args(
            [
                *("--model", tiny_model_dir, "--prompts", "p.jsonl", "--critic", "scalar-rm", "--reward-model"),
                *(str(tmp_path), "--output-dir", str(tmp_path / "r"), "--reward-mode", "self_distill"),
            ]
        )
