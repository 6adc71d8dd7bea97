"""The README's one-GPU 8B recipe, measured: a Llama-3.1-8B-shaped model (its config; random weights built on the GPU
in bf16, since memory and speed do not depend on the values) through stage 2 (02's main) and stage 3 (03's main), as
the README's commands run them. Nothing is downloaded: the tokenizer is a word-level one with Llama-3's 128,256 ids.

    python bench/gpu_recipe/gpu_recipe.py --out /tmp/gpu                        # one 80 GB GPU, ~5 min (bench/gpu_recipe/README.md)
    python bench/gpu_recipe/gpu_recipe.py --out /tmp/gpu --phases bandwidth,decode,stage3 --compile-generation
    python bench/gpu_recipe/gpu_recipe.py --tiny --device cpu --out /tmp/gpu    # the same path with a 2-layer model (the test)
    python bench/gpu_recipe/gpu_recipe.py --out /tmp/gpu --phases tokens         # --compile-generation's tokens, eager vs compiled

Each phase runs in its own process (a clean peak-memory count; one failing does not stop the rest) and writes
OUT/<phase>.json as soon as it ends:
  bandwidth  device-to-device copy bandwidth (bytes read + written per second): the HBM bound's denominator
  stage2     02_train_reward.py at the README's recipe (LoRA r16 alpha 32 on q/v, batch 4 x grad-accum 8, max-len 2048,
             activation checkpointing, bf16) for --rm-steps optimizer steps: peak memory, seconds per step. Its reward
             model is stage 3's critic.
  stage3     03_train_policy.py at the README's recipe (LoRA r16 on all linear maps, activation checkpointing, 64
             rollouts x (512-token prompts + 256 new tokens, forced by --min-new-tokens), --num-minibatches 8
             --grad-accum 2, 4 PPO epochs) for --steps iterations, the reward model a second copy of the base with its
             adapter, critiques capped at --critic-max-new-tokens: per phase (rollout, critic, scoring, update) the
             seconds, tokens per second and peak memory (each phase's own, measured by wrapping 03's step functions).
             With --compile-generation: stage3_compiled.json; with --shard fsdp: stage3_fsdp.json, run under
             torchrun with one process (FSDP2's overhead on one GPU, before sharding pays back).
  decode     one decode step of the policy as 03 builds it, batch 64: eager generate() (LoRA on, and off) and
             static_decode compiled, against the HBM bound: the bytes of its weights (and of its KV cache) / bandwidth.
             The compiled step twice: with transformers' sdpa (static_unpacked: under compile it copies the KV cache
             once per query head) and with packed_sdpa (static: 03's); for each the GPU's busy time per step (the
             step's kernels, against the wall clock's step), whether it replayed as a CUDA graph, and its 12 costliest
             GPU kernels (torch.profiler).
  tokens     one rollout batch of the policy as 03 builds it (bf16 on CUDA, 64 x 256 sampled tokens at T = 1), from
             the same seed and in the same dtype, by eager generate() and by static_decode compiled (03's
             --compile-generation): the share of identical tokens, the rows identical throughout, and where each row
             first differs (token_identity). The compiled kernels round the logits differently, so a token matches
             only while no sampling boundary flips: a measurement, not a guarantee.
Random weights rarely sample EOS, so every response runs to 256 tokens and every critique to its cap (the worst case),
and no critique parses (delta = 0): the numbers are the recipe's cost, not its learning.
"""

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (no torch at import: the orchestrating process stays light)
from infra import decoding, models, runs, trainable  # noqa: E402

LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# the README's recipe, and the tiny run's shapes (the same code path in seconds on a CPU)
SHAPES = {
    "8b": dict(
        batch=64,
        prompt=512,
        new=256,
        critic=128,
        minibatches=8,
        accum=2,
        rm_len=2048,
        rm_new=512,
        rm_batch=4,
        rm_accum=8,
    ),
    "tiny": dict(
        batch=8, prompt=24, new=8, critic=6, minibatches=2, accum=2, rm_len=96, rm_new=24, rm_batch=2, rm_accum=2
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/out/gpu", help="folder for the phases' JSON and the runs")
    p.add_argument("--device", default="cuda", help="cuda, cuda:1, cpu (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small shapes: the same path on a CPU")
    p.add_argument(
        "--phases",
        default="bandwidth,stage2,stage3,decode",
        help="comma-separated, in order (stage3 without stage2 before it: an untrained adapter as the reward model)",
    )
    p.add_argument("--steps", type=int, default=2, help="PPO iterations of stage 3 (the last one is reported)")
    p.add_argument("--rm-steps", type=int, default=3, help="optimizer steps of stage 2")
    p.add_argument("--critic-max-new-tokens", type=int, help="critique cap (default: 128; tiny 6)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time static_decode compiled (the first call compiles: a minute for 8B)",
    )
    p.add_argument(
        "--compile-generation",
        action="store_true",
        help="stage3 with 03's --compile-generation "
        "(rollouts and critiques by static_decode), written to stage3_compiled.json",
    )
    p.add_argument(
        "--variants",
        default="eager,eager-no-lora,static_unpacked,static",
        help="the decode phase's decoders, comma-separated",
    )
    p.add_argument(
        "--shard",
        default="ddp",
        choices=["ddp", "fsdp"],
        help="stage3 with 03's --shard (fsdp: under torchrun, one process), written to stage3_fsdp.json",
    )
    p.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    return p.parse_args(argv)


# ---- an 8B-shaped model without weight files: a config, a tokenizer, and from_pretrained building random weights ----


def write_base(folder: Path, tiny: bool) -> Path:
    """FOLDER/base: config.json and a word-level tokenizer (specials, punctuation, then w0 w1 ...) with as many ids as
    the model's vocabulary. No weights: random_weights() makes from_pretrained build them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    base = folder / "base"
    base.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY if tiny else LLAMA_31_8B)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + list("{}[]():,.'\"!?-_#*/")
    words += [f"w{i}" for i in range(cfg["vocab_size"] - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(base)
    LlamaConfig(**cfg, pad_token_id=0, bos_token_id=1, eos_token_id=2).save_pretrained(base)
    return base


def random_weights(base: Path, device: str) -> None:
    """AutoModelForCausalLM.from_pretrained(base) builds the model from its config with random weights, directly on
    `device` in the dtype asked for (no weight files; 8B in seconds on a GPU); any other path loads as usual."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def from_pretrained(name, *a, dtype=None, **k):
        if Path(str(name)).resolve() != base.resolve():
            return load(name, *a, dtype=dtype, **k)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=dtype)

    AutoModelForCausalLM.from_pretrained = from_pretrained


def words(rng, n: int) -> str:
    return " ".join(f"w{rng.randrange(100, 500)}" for _ in range(n))  # each one token (ids the tiny vocab has too)


# ---- device helpers: a wall clock that waits for the GPU, and peak memory ----


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def peak(device: str):
    import torch

    return gib(torch.cuda.max_memory_allocated(device)) if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def held(device: str):
    import torch

    return gib(torch.cuda.memory_allocated(device)) if device.startswith("cuda") else None


# ---- the phases ----


def phase_bandwidth(args, out: Path) -> dict:
    """Device-to-device copy of a 4 GiB buffer (64 MiB on a CPU), ten times after two warm-ups."""
    import torch

    n = 2**26 if args.tiny else 2**32
    x = torch.empty(n, dtype=torch.uint8, device=args.device)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    sync(args.device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(args.device)
    s = (time.perf_counter() - t) / 10
    return {"bytes": n, "copy_s": s, "read_plus_write_bytes_per_s": 2 * n / s}


def phase_stage2(args, out: Path) -> dict:
    """02's main() on --rm-steps x 32 annotations of full length (prompt cut to max-len - max-new-tokens)."""
    import random

    sh = SHAPES["tiny" if args.tiny else "8b"]
    rm = importlib.import_module("02_train_reward")
    from infra import training  # its make_trainer, which 02's main() looks up there at call time

    base = out / "base"
    random_weights(base, args.device)
    rng, data = random.Random(0), out / "annotations.jsonl"
    with open(data, "w") as f:
        for _ in range(args.rm_steps * sh["rm_batch"] * sh["rm_accum"]):
            response = words(rng, sh["rm_new"] // 2)
            f.write(
                json.dumps(
                    {
                        "prompt": words(rng, sh["rm_len"]),
                        "response": response,
                        "critique": words(rng, sh["rm_new"] // 2),
                        "good_spans": [response[:20]],
                        "poor_spans": [response[-20:]],
                    }
                )
                + "\n"
            )
    argv = [
        "--task",
        "summarization",
        "--model",
        str(base),
        "--data",
        str(data),
        "--output-dir",
        str(out / "rm"),
        "--gradient-checkpointing",
        "--max-steps",
        str(args.rm_steps),
        "--val-frac",
        "0",
        "--logging-steps",
        "1",
        "--save-steps",
        "100000",
        "--device",
        "cpu" if args.device == "cpu" else "cuda",
        "--overwrite",
    ]
    if args.tiny:
        argv += [
            "--max-len",
            str(sh["rm_len"]),
            "--max-new-tokens",
            str(sh["rm_new"]),
            "--batch-size",
            str(sh["rm_batch"]),
            "--grad-accum",
            str(sh["rm_accum"]),
        ]
    steps = []
    make_trainer = training.make_trainer

    def timed_trainer(*a, **k):  # each optimizer step's end, after the GPU is done
        from transformers import TrainerCallback

        trainer, resume = make_trainer(*a, **k)

        class Clock(TrainerCallback):
            def on_step_begin(self, *_, **__):
                if not steps:
                    reset_peak(args.device)  # the model is on the device by now: count training, not loading
                sync(args.device)
                steps.append([time.perf_counter()])

            def on_step_end(self, *_, **__):
                sync(args.device)
                steps[-1].append(time.perf_counter())

        trainer.add_callback(Clock())
        return trainer, resume

    training.make_trainer = timed_trainer
    t0 = time.perf_counter()
    rm.main(rm.parse_args(argv))
    info = json.loads((out / "rm" / "reward_model.json").read_text())
    per_step = [b - a for a, b in steps]
    recs = [json.loads(x) for x in open(data)][:8]
    tokens = [
        len(r["input_ids"]) for r in rm.encode_all(_tokenizer(base), recs, sh["rm_len"], sh["rm_len"] - sh["rm_new"])[0]
    ]
    return {
        "steps": len(per_step),
        "s_per_step": per_step,
        "s_per_step_after_first": _mean(per_step[1:]),
        "examples_per_step": sh["rm_batch"] * sh["rm_accum"],
        "mean_tokens_per_example": _mean(tokens),
        "peak_gib_training": peak(args.device),
        "train_loss": info["train"]["train_loss"],
        "wall_s": time.perf_counter() - t0,
    }


def _tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def phase_stage3(args, out: Path) -> dict:
    """03's main() at the recipe, its step functions wrapped to time each phase and take its own peak memory."""
    import random

    ppo = importlib.import_module("03_train_policy")
    sh, cuda = SHAPES["tiny" if args.tiny else "8b"], args.device.startswith("cuda")
    base, rm_dir, run_dir = out / "base", out / "rm", out / phase_name(args)
    random_weights(base, args.device)
    if not (rm_dir / "reward_model.json").is_file():  # no stage2 in this run: an untrained adapter of its shape
        make_reward_model(base, rm_dir, args.device, sh)
    rng, prompts = random.Random(1), out / "prompts.jsonl"
    with open(prompts, "w") as f:  # longer than --max-prompt-tokens: each is cut to exactly that many tokens
        f.writelines(json.dumps({"prompt": words(rng, sh["prompt"] + 16)}) + "\n" for _ in range(2 * sh["batch"]))
    critic_tokens = args.critic_max_new_tokens or sh["critic"]
    argv = [
        "--task",
        "summarization",
        "--model",
        str(base),
        "--prompts",
        str(prompts),
        "--reward-model",
        str(rm_dir),
        "--device",
        args.device,
        "--dtype",
        "bf16" if cuda else "float32",
        "--gradient-checkpointing",
        "--batch-size",
        str(sh["batch"]),
        "--num-minibatches",
        str(sh["minibatches"]),
        "--grad-accum",
        str(sh["accum"]),
        "--max-new-tokens",
        str(sh["new"]),
        "--min-new-tokens",
        str(sh["new"]),
        "--max-prompt-tokens",
        str(sh["prompt"]),
        "--critic-max-new-tokens",
        str(critic_tokens),
        "--steps",
        str(args.steps),
        "--chat-template",
        "off",
        "--output-dir",
        str(run_dir),
        "--overwrite",
        *(["--compile-generation"] if args.compile_generation else []),
        "--shard",
        args.shard,
        "--max-fail-share",
        "1",
    ]  # random weights: no critique parses (the cost is measured, not the learning)
    phases, kept = {}, {}

    def timed(name, fn):
        def run(*a, **k):
            sync(args.device)
            reset_peak(args.device)
            t = time.perf_counter()
            result = fn(*a, **k)
            sync(args.device)
            phases.setdefault(name, []).append({"s": time.perf_counter() - t, "peak_gib": peak(args.device)})
            return result

        return run

    for name in ("rollout", "score_rollouts", "ppo_update"):
        setattr(ppo, name, timed(name, getattr(ppo, name)))
    make_critic, build_policy = ppo.make_critic, ppo.build_policy

    def make_critic_(a):
        before = held(args.device)
        critic = make_critic(a)
        kept["critic_weights_gib"] = round(held(args.device) - before, 2) if cuda else None
        return timed("critic", critic)

    def build_policy_(a, model):
        kept["policy_base_gib"] = held(args.device)
        policy = build_policy(a, model)
        kept["policy_gib"] = held(args.device)
        return policy

    ppo.make_critic, ppo.build_policy = make_critic_, build_policy_
    t0 = time.perf_counter()
    ppo.main(argv)
    wall = time.perf_counter() - t0
    last = {k: v[-1] for k, v in phases.items()}
    tokens = sh["batch"] * (sh["prompt"] + sh["new"])  # one forward over the batch
    epochs = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["policy/epochs"]
    work = {
        "rollout": sh["batch"] * sh["new"],
        "critic": sh["batch"] * critic_tokens,  # tokens per phase
        "score_rollouts": 2 * tokens,
        "ppo_update": epochs * tokens,
    }
    return {
        "iterations": args.steps,
        "shape": sh,
        "critic_max_new_tokens": critic_tokens,
        "held_gib": kept,
        "last_iteration": {k: {**last[k], "tokens_per_s": n / last[k]["s"]} for k, n in work.items()},
        "all_iterations": phases,
        "peak_gib": max((v["peak_gib"] or 0) for p in phases.values() for v in p) or None,
        "iteration_s": sum(v["s"] for v in last.values()),
        "wall_s": wall,
        "compile_generation": args.compile_generation,
    }


def phase_name(args) -> str:
    return "stage3" + ("_compiled" if args.compile_generation else "") + ("_fsdp" if args.shard == "fsdp" else "")


def make_reward_model(base: Path, rm_dir: Path, device: str, sh: dict) -> None:
    """What stage 2 writes (its LoRA r16 q/v adapter, untrained; reward_model.json), for a run without stage2."""
    model, tok = models.load_model(str(base), device=device, dtype="bf16" if device.startswith("cuda") else "float32")
    model = trainable.add_lora(model, 16, 32, "q_proj,v_proj")
    runs.save_pretrained(
        rm_dir,
        model,
        tok,
        {
            "reward_model.json": {
                "base_model": str(base),
                "objective": "generative",
                "rm_format": "critique+spans",
                "max_prompt_tokens": sh["rm_len"] - sh["rm_new"],
                "max_new_tokens": sh["rm_new"],
            }
        },
        save_embedding_layers=False,
    )
    del model


def recipe_policy(args, out: Path):
    """(03's module, its args, the policy as 03 builds it at the recipe: LoRA r16 on all linear maps, activation
    checkpointing; the shapes) on random weights in OUT/base."""
    ppo = importlib.import_module("03_train_policy")
    sh, base = SHAPES["tiny" if args.tiny else "8b"], out / "base"
    random_weights(base, args.device)
    a = ppo.parse_args(
        [
            "--task",
            "summarization",
            "--model",
            str(base),
            "--critic",
            "program",
            "--device",
            args.device,
            "--dtype",
            "bf16" if args.device.startswith("cuda") else "float32",
            "--gradient-checkpointing",
        ]
    )
    model, _ = models.load_model(str(base), device=a.device, dtype=a.dtype)
    return ppo, a, ppo.build_policy(a, model), sh


def phase_decode(args, out: Path) -> dict:
    """The policy as 03 builds it at the recipe, then decode_step."""
    _, a, policy, sh = recipe_policy(args, out)
    return decode_step(args, out, {"policy": policy, "args": a}, sh)


def token_identity(a, b) -> dict:
    """How far two decoders' tokens (B, T) and (B, T') agree: over max(T, T') positions per row (the shorter padded
    with -1, so a row that ended early differs there), the identical tokens and their share, the rows identical
    throughout, and each row's first differing position (None: identical). A flipped sample changes the rest of its
    row, so the first difference says more than the share."""
    import torch

    width = max(a.shape[1], b.shape[1])
    a, b = (torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1) for x in (a, b))
    same = (a == b).cpu()
    first = [None if bool(row.all()) else int((~row).int().argmax()) for row in same]
    return {
        "tokens": same.numel(),
        "identical": int(same.sum()),
        "identical_share": int(same.sum()) / same.numel(),
        "rows": len(same),
        "rows_identical": first.count(None),
        "first_difference": first,
    }


def phase_tokens(args, out: Path) -> dict:
    """One rollout batch of the policy as 03 builds it (phase_decode's), sampled as 03's rollout() samples it (its
    generation_config, under its autocast) from the same seed: eager generate(), then static_decode (compiled unless
    --no-compile); token_identity of the two."""
    import torch

    from infra import distributed

    ppo, a, (policy, *_), sh = recipe_policy(args, out)
    policy = policy.eval()
    ids = torch.randint(
        100, 500, (sh["batch"], sh["prompt"]), device=args.device, generator=torch.Generator(args.device).manual_seed(0)
    )
    mask = torch.ones_like(ids)
    config = models.generation_config(policy, sh["new"], a.temperature, a.top_p, sh["new"])  # stage 3's recipe

    def sample(static: bool):
        torch.manual_seed(1)  # the same random numbers for both (every device's generator)
        with torch.no_grad(), distributed.autocast(a.device, a.dtype):
            if static:
                return decoding.generate_static(policy, ids, mask, config, compile=args.compile)
            return policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]

    eager = sample(False)
    t = time.perf_counter()
    static = sample(True)
    return {
        **token_identity(eager, static),
        "compiled": args.compile,
        "dtype": a.dtype,
        "static_s_with_compile": time.perf_counter() - t,
    }


def decode_step(args, out: Path, kept: dict, sh: dict) -> dict:
    """One decode step of the policy at the rollout's shape (B x prompt), (t(1 + N) - t(1)) / N over N new
    tokens, for generate() (LoRA on; and off: the base's own step) and static_decode (compiled once, then timed),
    against the HBM bound: the bytes of the weights (+ the mean KV cache over those steps) / the copy bandwidth."""
    import torch

    from infra import distributed

    model, a = kept["policy"][0], kept["args"]
    cfg, n = model.config, 16 if args.tiny else 64
    ids = torch.randint(100, 500, (sh["batch"], sh["prompt"]), device=args.device)
    mask = torch.ones_like(ids)

    def run(new: int, how: str) -> float:
        config = models.generation_config(model, new, a.temperature, 1.0, new)  # forced: no EOS before `new`
        sync(args.device)
        t = time.perf_counter()
        with torch.no_grad(), distributed.autocast(a.device, a.dtype):
            if how.startswith("static"):
                decoding.generate_static(model, ids, mask, config, compile=args.compile)
            elif how == "eager-no-lora":
                with model.disable_adapter():
                    model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            else:
                model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        sync(args.device)
        return time.perf_counter() - t

    bw = (
        json.loads((out / "bandwidth.json").read_text())["read_plus_write_bytes_per_s"]
        if (out / "bandwidth.json").is_file()
        else phase_bandwidth(args, out)["read_plus_write_bytes_per_s"]
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * sh["batch"] * (sh["prompt"] + n / 2)
    result = {
        "batch": sh["batch"],
        "prompt": sh["prompt"],
        "new_tokens_timed": n,
        "weight_bytes": weights,
        "kv_bytes_mean": kv,
        "bound_ms_weights": 1e3 * weights / bw,
        "bound_ms_weights_kv": 1e3 * (weights + kv) / bw,
    }
    reasons = cudagraph_skip_reasons()
    real_packed = decoding.packed_attention
    for how in args.variants.split(","):
        # static_unpacked: the compiled step with transformers' own sdpa (packed_attention off), as before issue 58
        decoding.packed_attention = real_packed if how != "static_unpacked" else lambda m: contextlib.nullcontext()
        first = run(1 + n, how)  # static: compiles here
        long = run(1 + n, how)
        step = (long - run(1, how)) / n
        result[how] = {
            "step_ms": 1e3 * step,
            "first_call_s": first,
            "over_bound": 1e3 * step / result["bound_ms_weights"],
            "over_bound_with_kv": 1e3 * step / result["bound_ms_weights_kv"],
        }
        write(out, "decode", result, args.device)  # at once: what follows is diagnosis, and may fail
        if how.startswith("static") and args.compile:
            kernels, busy_ms = top_kernels(lambda: run(1 + n, how), args.device)  # the shapes timed: no recompile
            busy_ms -= top_kernels(lambda: run(1, how), args.device)[1]  # the prefill's share taken off, as the wall's
            result[how].update(top_kernels=kernels, busy_ms_per_step=busy_ms / n)
            from torch._dynamo.utils import (
                counters,
            )  # did the compiled step replay as a CUDA graph (torch says why not)

            result[how]["cudagraph_skips_so_far"] = int(counters["inductor"]["cudagraph_skips"])
            result[how]["graphs_compiled_so_far"] = int(counters["stats"]["unique_graphs"])
            write(out, "decode", result, args.device)
    decoding.packed_attention = real_packed
    result["static_busy_ms_per_step"] = result.get("static", {}).get("busy_ms_per_step")
    result["cudagraph_skip_reasons"] = reasons[:5]
    write(out, "decode", result, args.device)
    return result


def top_kernels(fn, device: str, k: int = 12) -> tuple[list[dict], float]:
    """The k kernels (and CPU ops, on a CPU) that took the most time while fn() ran, by torch.profiler (name, calls
    and milliseconds in all), and the milliseconds of them all: on a GPU the time it was busy, which set against the
    wall clock says how much of a step is the step itself and how much the host's loop around it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        fn()
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted(prof.key_averages(), key=time_of, reverse=True)[:k]
    # a kernel's time is also its launching op's self time: on a GPU count the kernels alone (the first H200 run, which
    # summed both, reported 60.7 ms busy per 19.7 ms step)
    busy = sum(time_of(e) for e in prof.key_averages() if not cuda or e.device_type != DeviceType.CPU) / 1e3
    return [{"name": e.key[:120], "calls": e.count, "ms": round(time_of(e) / 1e3, 3)} for e in events], busy


def cudagraph_skip_reasons() -> list[str]:
    """A list that fills with the compiler's "skipping cudagraphs due to ..." messages (torch's cudagraphs logs on)."""
    import logging

    import torch

    reasons = []

    class Keep(logging.Handler):
        def emit(self, record):
            if "cudagraph" in record.getMessage():
                reasons.append(record.getMessage()[:500])

    torch._logging.set_logs(cudagraphs=True)
    logging.getLogger("torch._inductor").addHandler(Keep(level=logging.WARNING))
    return reasons


# ---- running the phases ----


def environment(device: str) -> dict:
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
    }


def write(out: Path, name: str, result: dict, device: str) -> None:
    common.write_json(out / f"{name}.json", {**result, "env": environment(device)})


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    if args.phase:
        result = {
            "bandwidth": phase_bandwidth,
            "stage2": phase_stage2,
            "stage3": phase_stage3,
            "decode": phase_decode,
            "tokens": phase_tokens,
        }[args.phase](args, out)
        write(out, phase_name(args) if args.phase == "stage3" else args.phase, result, args.device)
        return
    out.mkdir(parents=True, exist_ok=True)
    write_base(out, args.tiny)
    flags = [
        "--out",
        str(out),
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--rm-steps",
        str(args.rm_steps),
        *(["--tiny"] if args.tiny else []),
        *(["--no-compile"] if not args.compile else []),
        *(["--compile-generation"] if args.compile_generation else []),
        "--shard",
        args.shard,
        "--variants",
        args.variants,
        *(["--critic-max-new-tokens", str(args.critic_max_new_tokens)] if args.critic_max_new_tokens else []),
    ]
    failed = []
    for phase in args.phases.split(","):
        t = time.perf_counter()
        launch = (
            ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29511"]
            if phase == "stage3" and args.shard == "fsdp"
            else []
        )  # 03 --shard fsdp runs under torchrun
        code = subprocess.run([sys.executable, *launch, __file__, *flags, "--phase", phase], cwd=ROOT).returncode
        print(f"== {phase}: exit {code} in {time.perf_counter() - t:.0f} s", flush=True)
        if code:
            failed.append(phase)
    for name in ("bandwidth", "stage2", "stage3", "stage3_compiled", "stage3_fsdp", "decode", "tokens"):
        if (out / f"{name}.json").is_file():
            print(name, (out / f"{name}.json").read_text(), flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
