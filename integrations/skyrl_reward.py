"""text2grad's critic inside SkyRL (issue 79, docs/scaling.md "Inside SkyRL"): SkyRL (skyrl 0.3) takes token-level
rewards as they are when a generator's output holds one list of floats per response token (GeneratorOutput.rewards:
List[List[float]]; the trainer's postprocess_generator_output keeps them, its preprocessing right-aligns them), so
text2grad's delta_t goes in there, computed exactly as for verl (critics.token_deltas). No SkyRL import: plain lists
in, plain lists out. The critic is the one 03's flags build (integrations.from_flags). In a generator of your own
(skyrl.train.generators.skyrl_gym_generator):

    CRITIC = integrations.from_flags("local", "demo", ["--reward-model", "runs/demo/reward_model"])  # or any critic

    class Text2GradGenerator(SkyRLGymGenerator):
        async def generate(self, input_batch, disable_tqdm=False):
            output = await super().generate(input_batch, disable_tqdm)
            return with_text2grad_rewards(output, CRITIC, self.tokenizer, input_batch.get("env_extras"))
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # text2grad's modules, from wherever SkyRL imports this

import critics  # noqa: E402


def text2grad_rewards(critic, tokenizer, prompt_token_ids, response_ids, records=None) -> list[list[float]]:
    """Each response's delta_t, one float per token of response_ids (SkyRL's per-token rewards). The prompts are
    decoded as verl's manager decodes them; records (SkyRL's env_extras, say) go to the critic beside them."""
    prompts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompt_token_ids]
    records = [{**(r or {}), "prompt": p} for r, p in zip(records or [None] * len(prompts), prompts)]
    return critics.token_deltas(critic, tokenizer, records, [list(r) for r in response_ids])[0]


def with_text2grad_rewards(output: dict, critic, tokenizer, records=None) -> dict:
    """A GeneratorOutput whose rewards are text2grad's delta_t, 0 where the loss mask is 0 (an environment's tokens in
    a multi-turn response, which the policy did not write)."""
    deltas = text2grad_rewards(critic, tokenizer, output["prompt_token_ids"], output["response_ids"], records)
    rewards = [[d * m for d, m in zip(delta, mask)] for delta, mask in zip(deltas, output["loss_masks"])]
    return {**output, "rewards": rewards}
