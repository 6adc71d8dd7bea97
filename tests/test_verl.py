"""integrations/verl_reward.py against the real verl package (0.9.1, in a virtual environment of its own: it pins
transformers below 5.11; tools/verl_env.sh DIR makes it, T2G_VERL_VENV=DIR points the test at it). verl's own
DataProto batch, the reward manager found through verl's own config resolution and its registry, and the
(batch, response length) tensor it assembles: equal to 03's delta_t on the same texts and tokens."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from tasks.demo import demo_dataset

import common
import critics
from infra import models

VENV = Path(os.environ.get("T2G_VERL_VENV", "/nonexistent"))
pytestmark = pytest.mark.skipif(
    not (VENV / "bin" / "python").is_file(),
    reason="verl needs a virtual environment of its own: tools/verl_env.sh DIR, then T2G_VERL_VENV=DIR",
)

IN_VERL = r"""
import asyncio, json, sys
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl import DataProto
from verl.trainer.ppo.reward import resolve_reward_manager_cls
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

tensors = torch.load(sys.argv[1])
config = OmegaConf.create({"reward": {
    "reward_manager": {"source": "importlib", "name": "Text2GradRewardManager", "module": {"path": sys.argv[2]}},
    "text2grad": {"critic": "program", "task": "demo"},
}})
cls = resolve_reward_manager_cls(config)  # what a user's config names
assert get_reward_manager_cls("text2grad") is cls  # and verl's registry holds it
data = DataProto.from_dict(tensors=tensors, non_tensors={"data_source": ["demo"] * len(tensors["responses"])})
manager = cls(config, AutoTokenizer.from_pretrained(sys.argv[3]), None)
outputs = [asyncio.run(manager.run_single(data[i : i + 1])) for i in range(len(data))]
torch.save(cls.assemble_rm_scores(data, [o["reward_score"] for o in outputs]), sys.argv[4])
print(json.dumps([o["reward_extra_info"] for o in outputs]))
"""


@pytest.mark.slow  # verl's imports (ray, hydra) in its own interpreter
def test_the_verl_reward_manager_gives_03s_delta_as_verls_token_level_reward(tmp_path, tiny_model_dir):
    _, tok = models.load_model(tiny_model_dir)
    records = demo_dataset("train", 6)
    prompts = [tok(r["prompt"])["input_ids"] for r in records]
    responses = [tok(r["response"], add_special_tokens=False)["input_ids"] for r in records]
    P, R, pad = max(map(len, prompts)), max(map(len, responses)), tok.pad_token_id
    prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])  # verl: prompts left-padded
    response_ids = torch.tensor([r + [pad] * (R - len(r)) for r in responses])  # responses right-padded
    mask = torch.tensor(
        [[0] * (P - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (R - len(r)) for p, r in zip(prompts, responses)]
    )
    tensors = {"prompts": prompt_ids, "responses": response_ids, "attention_mask": mask}
    tensors["input_ids"] = torch.cat([prompt_ids, response_ids], 1)
    torch.save(tensors, tmp_path / "batch.pt")

    # 03's step 3 on the same tokens: decoded with offsets, the demo critic, critics.span_deltas
    texts, offsets = zip(*(common.decode_with_offsets(tok, r) for r in responses))
    recs = [{"prompt": tok.decode(p, skip_special_tokens=True)} for p in prompts]
    critic = critics.make_critic(
        __import__("policy.cli", fromlist=["cli"]).parse_args(["--model", "x", "--critic", "program"])
    )
    response_mask = (torch.arange(R)[None] < torch.tensor([len(r) for r in responses])[:, None]).float()
    want = critics.span_deltas(list(texts), list(offsets), critic(recs, list(texts)), response_mask)[0]
    assert (want != 0).any(1).all() and (want < 0).any()  # every answer quoted, some mistakes among them

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    script = [str(VENV / "bin" / "python"), "-c", IN_VERL, str(tmp_path / "batch.pt")]
    script += [str(ROOT / "integrations" / "verl_reward.py"), tiny_model_dir, str(tmp_path / "rm.pt")]
    proc = subprocess.run(script, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "rm.pt")
    assert got.shape == (6, R) and got.dtype == torch.float32
    assert torch.equal(got, want.float())
    extra = json.loads(proc.stdout.splitlines()[-1])
    assert [e["t2g/critique_failed"] for e in extra] == [0.0] * 6
