"""integrations/skyrl_reward.py: the per-token rewards SkyRL takes (GeneratorOutput.rewards, one float per response
token) are 03's delta_t on the same texts and tokens, 0 where the loss mask is 0. Where T2G_SKYRL_VENV names a
virtual environment with skyrl 0.3 (tools/skyrl_env.sh DIR makes one: it pins transformers at most 5.8), SkyRL's own preprocessing lays those lists out as its training batch's
rewards, and the test checks that tensor too."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tasks.demo import demo_dataset

import common
import critics
from infra import models
import integrations
from integrations.skyrl_reward import with_text2grad_rewards

VENV = Path(os.environ.get("T2G_SKYRL_VENV", "/nonexistent"))

IN_SKYRL = r"""
import json, sys
import torch
from transformers import AutoTokenizer
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

d = json.load(open(sys.argv[1]))
out = convert_prompts_responses_to_batch_tensors(
    AutoTokenizer.from_pretrained(sys.argv[2]), d["prompt_token_ids"], d["response_ids"], d["rewards"], d["loss_masks"]
)
torch.save({"action_mask": out[2], "rewards": out[3]}, sys.argv[3])
"""


def generator_output(tok):
    """A SkyRL GeneratorOutput of the demo's responses (each ending in EOS, as SkyRL's are), 03's delta on the same
    tokens, and its loss masks: 0 on row 0's first rewarded token, as on an environment's tokens."""
    records = demo_dataset("train", 6)
    prompts = [tok(r["prompt"])["input_ids"] for r in records]
    responses = [tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in records]
    texts, offsets = zip(*(common.decode_with_offsets(tok, r) for r in responses))
    recs = [{"prompt": tok.decode(p, skip_special_tokens=True)} for p in prompts]
    lengths = torch.tensor([len(r) for r in responses])
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).float()
    want = critics.span_deltas(list(texts), list(offsets), integrations.from_flags("program")(recs, list(texts)), mask)[
        0
    ]
    assert (want != 0).any(1).all() and (want < 0).any()  # every answer quoted, some mistakes among them
    loss_masks = [[1] * len(r) for r in responses]
    loss_masks[0][int(want[0].nonzero()[0])] = 0
    output = {"prompt_token_ids": prompts, "response_ids": responses, "loss_masks": loss_masks, "stop_reasons": None}
    return output, want * torch.tensor([m + [0] * (mask.shape[1] - len(m)) for m in loss_masks])


def test_skyrls_per_token_rewards_are_03s_delta(tiny_model_dir):
    _, tok = models.load_model(tiny_model_dir)
    output, want = generator_output(tok)
    got = with_text2grad_rewards(output, integrations.from_flags("program"), tok)
    assert {k: v for k, v in got.items() if k != "rewards"} == output  # the rest of the output as it was
    assert [len(r) for r in got["rewards"]] == [len(r) for r in output["response_ids"]]  # SkyRL's contract
    for i, rewards in enumerate(got["rewards"]):
        assert torch.equal(torch.tensor(rewards), want[i, : len(rewards)])


@pytest.mark.skipif(
    not (VENV / "bin" / "python").is_file(), reason="no SkyRL venv: tools/skyrl_env.sh DIR, then T2G_SKYRL_VENV=DIR"
)
def test_skyrls_own_preprocessing_lays_out_the_rewards_as_its_training_batchs(tmp_path, tiny_model_dir):
    _, tok = models.load_model(tiny_model_dir)
    output, want = generator_output(tok)
    got = with_text2grad_rewards(output, integrations.from_flags("program"), tok)
    (tmp_path / "output.json").write_text(json.dumps(got))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    script = [str(VENV / "bin" / "python"), "-c", IN_SKYRL, str(tmp_path / "output.json"), tiny_model_dir]
    proc = subprocess.run([*script, str(tmp_path / "batch.pt")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    batch = torch.load(tmp_path / "batch.pt")
    lengths = [len(r) for r in output["response_ids"]]
    assert batch["rewards"].shape == (6, max(lengths)) and batch["action_mask"].sum(1).tolist() == lengths
    for i, n in enumerate(lengths):  # SkyRL right-aligns each response's tensors: its tokens are the last n
        assert torch.equal(batch["rewards"][i, -n:], want[i, :n]) and not batch["rewards"][i, :-n].any()
