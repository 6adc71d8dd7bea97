"""text2grad's critic inside verl (issue 79, docs/scaling.md "Inside verl"): a reward manager for verl's reward loop
(verl 0.9) that gives each response the per-token pseudo-rewards delta_t of 03's step 3 instead of one score at its
last token. Each response is decoded with its tokens' character intervals (common.decode_with_offsets), judged by any
text2grad critic (03's --critic: local, openai, program or python:MODULE:FUNCTION, with its own flags), and its
quotes located by character interval (critics.span_deltas: exactly 03's delta). verl's config names the class:

    reward.reward_manager.source=importlib
    reward.reward_manager.module.path=/path/to/text2grad/integrations/verl_reward.py
    reward.reward_manager.name=Text2GradRewardManager
    +reward.text2grad.critic=python:my_critic.py:critic    # or local, with flags: the reward model's folder
    +reward.text2grad.flags=[--reward-model,runs/demo/reward_model]
    +reward.text2grad.task=demo

run_single returns each response's delta list as its "reward_score" (and the critique's outcome in
reward_extra_info); assemble_rm_scores lays the lists out as verl's (batch, response length) rm_scores, 0 after each
response's last valid token. verl then adds its KL and computes advantages from the dense reward, as 03 does.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # text2grad's modules, from wherever verl imports this

import critics  # noqa: E402
import integrations  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.reward_loop.reward_manager import register  # noqa: E402
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase  # noqa: E402


@register("text2grad")
class Text2GradRewardManager(RewardManagerBase):
    """delta_t of a text2grad critic as verl's token-level reward (module docstring)."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        own = dict(config.reward.get("text2grad") or {}) if config is not None else {}
        self.critic = integrations.from_flags(
            own.get("critic", "program"), own.get("task", "demo"), own.get("flags", ())
        )

    async def run_single(self, data: DataProto) -> dict:
        item = data[-1:][0]  # a multi-sequence sample: its last sequence, as verl's naive manager
        response, mask = item.batch["responses"], item.batch["attention_mask"]  # prompts left-padded, responses right
        valid, n_prompt = int(mask[-response.shape[-1] :].sum()), int(mask[: -response.shape[-1]].sum())
        prompt = self.tokenizer.decode(item.batch["prompts"][-n_prompt:], skip_special_tokens=True)
        record = {**dict(item.non_tensor_batch.get("extra_info") or {}), "prompt": prompt}
        loop = asyncio.get_running_loop()  # the loop verl awaits this in (a critic may block: a thread of its own)
        ids = [response[:valid].tolist()]
        deltas, feedback, n_spans, n_unmatched = await loop.run_in_executor(
            None, critics.token_deltas, self.critic, self.tokenizer, [record], ids
        )
        extra = {"t2g/critique_failed": float(critics.critique_failed(feedback[0])), "t2g/quotes": n_spans}
        return {"reward_score": deltas[0], "reward_extra_info": {**extra, "t2g/unmatched": n_unmatched}}

    @classmethod
    def assemble_rm_scores(cls, data: DataProto, scores: list[list[float]]) -> torch.Tensor:
        """(batch, response length): each response's delta_t on its own tokens, 0 on the padding after them."""
        rm_scores = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        for i, delta in enumerate(scores):
            rm_scores[i, : len(delta)] = rm_scores.new_tensor(delta)
        return rm_scores
