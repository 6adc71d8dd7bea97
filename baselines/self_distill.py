"""03 --reward-mode self_distill: the same critiques turned into a self-teacher, the field's 2026 rival (SDPO: Hübotter
et al., arXiv 2601.20802; TRL's trl.experimental.sdpo).

The policy, given the post x, its own answer y and the critique c of that answer, is the teacher: the context is the
SFT + reflection baseline's revision_prompt(x, y, c) (baselines/reflection_data.py, what 04 --reflect revises from).
On the tokens the student sampled, the two distributions give each token

    delta_t = log pi_old(y_t | revision_prompt(x, y, c), y_<t) - log pi_old(y_t | x, y_<t)

both from step 4's no-grad forwards of the sampling policy (SDPO's "live" teacher, stop-gradient). With 03 --advantage
token (A_t = r_t = delta_t - beta * KL_t: no reward-to-go, no value head, not whitened) the clipped surrogate's
gradient at ratio 1 is TRL's sampled-token reverse-KL loss's (loss_utils.compute_sampled_token_self_distillation_loss;
tests/test_self_distill.py checks both on one batch). A row whose critique failed, or is empty, gets delta = 0, as
SDPO leaves a sample without feedback out of its distillation loss.

Departures from SDPO: the teacher is the live policy (SDPO and TRL default to an EMA of it); the per-token KL to the
reference stays in r_t (so every arm of bench/credit/credit_k4.py has the same beta); PPO's clip, not TRL's capped
IS ratio, bounds the later minibatches. A model can only teach itself from a critique it can read in context: the
demo's toy policy learns that from revision SFT examples (reflection_data.revision_examples), and
bench/credit/credit_k4.py gates the arm on it (the teacher's answers, 04 --reflect, must make fewer mistakes than the
student's).
"""

from __future__ import annotations

import torch

from baselines.reflection_data import revision_prompt
from infra import models


def teacher_inputs(tokenizer, records, texts, feedback, response, response_mask, args):
    """The teacher's rows: policy_prompt(revision_prompt(x, y, c)) left-padded, then the student's own response
    tokens (B, T) unchanged, so that 03's forward scores the same T tokens. Returns (input_ids, attention_mask,
    has_critique (B,) bool)."""
    critiques = [(fb or {}).get("critique") or "" for fb in feedback]
    queries = [
        models.policy_prompt(tokenizer, revision_prompt(r["prompt"], y, c), args.chat_template, args.max_prompt_tokens)
        for r, y, c in zip(records, texts, critiques)
    ]
    query, query_mask = models.left_pad(queries, tokenizer.pad_token_id)
    query, query_mask = query.to(response.device), query_mask.to(response.device)
    has_critique = torch.tensor([bool(c.strip()) for c in critiques], device=response.device)
    return torch.cat([query, response], 1), torch.cat([query_mask, response_mask.long()], 1), has_critique


def delta(teacher_logprobs, logprobs, mask, has_critique):
    """delta_t = log pi(y_t | x, y, c) - log pi(y_t | x) on the response tokens, 0 for a row without a critique.
    All (B, T) but has_critique (B,)."""
    return (teacher_logprobs - logprobs) * mask * has_critique[:, None]
