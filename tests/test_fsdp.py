"""--shard fsdp on the stages' own path (issue 68): a real run of 03 and of 02 under torchrun (2 gloo ranks on CPU), in
which a probe reads what each rank holds. It wraps the stage's own call into infra/distributed.py (03's shard, 02's
shard_for_trainer) and runs the stage's main() as the command line would, then records, per rank: for every decoder
layer of every sharded model (03: the policy, and full fine-tuning's frozen reference copy), whether the layer is an
FSDP group of its own, and the elements of it that this rank holds (DTensor.to_local) against the whole layer, right
after sharding and again at the end of the run; and, inside each layer's forward, how many decoder layers are whole
at that moment (03: during the rollouts; 02: during training). A shard that shards nothing, a sharding that groups
no layer, or a rollout that gathers the whole policy under --fsdp-generate layers fails here."""

import json
import os
import sys
import forkserver

import common
from tasks.demo import demo_critic, demo_dataset
from conftest import ROOT, torchrun

WORLD = 2

PROBE = r"""
import importlib, json, os, sys
sys.path.insert(0, sys.argv[1])
from torch.distributed.fsdp import FSDPModule
from infra import distributed

stage, out, argv = sys.argv[2], sys.argv[3], sys.argv[4:]
seen = {"sharded": [], "at_end": [], "whole_in_forward": []}
watch = [False]  # 03: record inside the rollouts; 02: inside training

def held(model):  # per decoder layer: its own FSDP group, and this rank's elements of it against the whole
    local = lambda p: p.to_local() if distributed.is_sharded(p) else p
    return [
        {"layer": i, "class": type(layer).__name__, "group": isinstance(layer, FSDPModule),
         "local": sum(local(p).numel() for p in layer.parameters()), "full": sum(p.numel() for p in layer.parameters())}
        for i, layer in enumerate(distributed.decoder_layers(model))
    ]

def count_whole_layers(model):  # a hook inside each layer's forward: how many layers are whole (no DTensor) now
    layers = distributed.decoder_layers(model)
    whole = lambda layer: not any(distributed.is_sharded(p) for p in layer.parameters())
    def hook(*_):  # (returns None: the inputs stay as they are)
        if watch[0]:
            seen["whole_in_forward"].append(sum(map(whole, layers)))
    for layer in layers:
        next(iter(layer.children())).register_forward_pre_hook(hook)

def sharded(models):
    seen["sharded"] = [held(m) for m in models]
    world = int(os.environ["WORLD_SIZE"])
    wrong = [x for layers in seen["sharded"] for x in layers if not x["group"] or x["local"] * world != x["full"]]
    if wrong or not seen["sharded"][0]:  # stop here, every rank alike: a run sharded otherwise may hang later on
        what = ", ".join(f"layer {x['layer']} ({x['class']}: {x['local']} of {x['full']} here)" for x in wrong)
        sys.exit(f"probe: decoder layers not sharded one by one over {world} ranks: {what or 'no layer list found'}")
    count_whole_layers(models[0])
    return models

if stage == "03":
    ppo = importlib.import_module("03_train_policy")
    real_shard, real_rollout, real_save = distributed.shard, ppo.rollout, ppo.runs.save_policy
    def shard(model, ref_model, args):
        model, ref_model = real_shard(model, ref_model, args)
        sharded([m for m in (model, ref_model) if m is not None])
        seen["ref_model"] = ref_model
        return model, ref_model
    def rollout(*a, **k):
        watch[0] = True
        try:
            return real_rollout(*a, **k)
        finally:
            watch[0] = False
    def save_policy(folder, model, *a, **k):
        seen["at_end"] = [held(m) for m in (model, seen.pop("ref_model")) if m is not None]
        return real_save(folder, model, *a, **k)
    distributed.shard, ppo.rollout, ppo.runs.save_policy = shard, rollout, save_policy
    ppo.main(argv)
else:
    rm = importlib.import_module("02_train_reward")
    real_shard, real_full = distributed.shard_for_trainer, distributed.full_state_dict
    def shard_for_trainer(model, args):
        model = real_shard(model, args)
        sharded([model])
        watch[0] = True  # from here on the Trainer trains (its evaluation is off: --eval-limit 0)
        return model
    def full_state_dict(model):
        watch[0] = False
        seen["at_end"] = [held(model)]
        return real_full(model)
    distributed.shard_for_trainer, distributed.full_state_dict = shard_for_trainer, full_state_dict
    rm.main(rm.parse_args(argv))
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
"""


def probe_run(tmp_path, stage: str, argv: list[str]) -> list[dict]:
    """The stage's main(argv) on WORLD gloo ranks under torchrun, probed (PROBE): what each rank recorded."""
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "probed"
    out.mkdir()
    proc = forkserver.run(  # torchrun: under forkserver's limit, so a hang fails instead of hanging the suite
        [
            *torchrun(WORLD),
            str(tmp_path / "probe.py"),
            str(ROOT),
            stage,
            str(out),
            *argv,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def assert_each_rank_holds_its_share(ranks: list[dict], n_models: int) -> None:
    """Every decoder layer of every sharded model is an FSDP group of its own, and each rank holds 1/WORLD of its
    elements, right after sharding and at the end of the run."""
    for when in ("sharded", "at_end"):
        for r in ranks:
            assert len(r[when]) == n_models, when
            for layers in r[when]:
                assert len(layers) == 2  # the tiny model's two decoder layers
                for layer in layers:
                    assert layer["group"], (when, layer)
                    assert layer["local"] * WORLD == layer["full"], (when, layer)


def test_03_shards_every_layer_and_rollouts_gather_one_layer_at_a_time(tmp_path, tiny_model_dir):
    """03 --shard fsdp --fsdp-generate layers, full fine-tuning (the policy and its frozen reference copy both
    sharded): each rank holds half of every decoder layer of both, and inside the rollouts' forwards one decoder
    layer at a time is whole."""
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 16))
    argv = [
        *("--model", tiny_model_dir, "--prompts", str(tmp_path / "prompts.jsonl"), "--critic", "program"),
        *("--output-dir", str(tmp_path / "run"), "--scalar-baseline-dir", "", "--steps", "1", "--batch-size", "4"),
        *("--num-minibatches", "1", "--ppo-epochs", "1", "--max-new-tokens", "6", "--device", "cpu"),
        *("--lora-r", "0", "--sft-steps", "0", "--shard", "fsdp", "--fsdp-generate", "layers"),
    ]
    ranks = probe_run(tmp_path, "03", argv)
    assert_each_rank_holds_its_share(ranks, n_models=2)
    for r in ranks:  # 6 decode steps x 2 layers at least, each forward with one layer whole (the root's own
        assert len(r["whole_in_forward"]) >= 12 and set(r["whole_in_forward"]) == {1}  # weights aside)
    assert (tmp_path / "run" / "policy" / "model.safetensors").is_file()


def test_02_shards_every_layer_and_trains_one_layer_whole_at_a_time(tmp_path, tiny_model_dir):
    """02 --shard fsdp (LoRA): each rank holds half of every decoder layer, frozen base and adapter, and inside the
    training forwards one decoder layer at a time is whole: the Trainer neither wrapped it in DDP nor gathered it."""
    data = tmp_path / "ann.jsonl"
    common.write_jsonl(
        data,
        [{**ex, **demo_critic(ex["prompt"], ex["response"]), "status": "ok"} for ex in demo_dataset("annotate", 20)],
    )
    argv = [
        *("--model", tiny_model_dir, "--data", str(data), "--output-dir", str(tmp_path / "rm"), "--seed", "0"),
        *("--max-steps", "2", "--batch-size", "2", "--eval-limit", "0", "--save-steps", "1000", "--eval-steps"),
        *("1000", "--val-frac", "0.1", "--device", "cpu", "--lora-r", "4", "--lora-alpha", "8", "--shard", "fsdp"),
    ]
    ranks = probe_run(tmp_path, "02", argv)
    assert_each_rank_holds_its_share(ranks, n_models=1)
    for r in ranks:  # 2 steps x 2 layers at least, forward and the backward's recomputation alike
        assert len(r["whole_in_forward"]) >= 4 and set(r["whole_in_forward"]) == {1}
    assert (tmp_path / "rm" / "adapter_model.safetensors").is_file()


PARTLY = r"""
import sys
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from infra import distributed

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
fully_shard(distributed.decoder_layers(model)[0])  # the first layer only: a shard() that stops early
print([type(x).__name__ for x in distributed.decoder_layers(model)])
"""


def test_a_list_of_layers_sharded_only_in_part_is_still_found(tmp_path, tiny_model_dir):
    """Issue 80, item 8: with only the first layer sharded, the probe above reported `[]`: fully_shard renames a
    layer's class (FSDPLlamaDecoderLayer), so decoder_layers found no list of one class, and the probe no layer to
    name. It finds both now (the probe then names layer 1 as not an FSDP group). One process, a gloo group of one."""
    from conftest import free_port

    proc = forkserver.run(
        [sys.executable, "-c", PARTLY, tiny_model_dir, str(free_port())],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "['FSDPLlamaDecoderLayer', 'LlamaDecoderLayer']"
