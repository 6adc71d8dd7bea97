"""--compile-generation, and how the reward model's critiques are decoded: our own decoding loops. greedy_generate (a
row stops once its span JSON is complete) and static_decode (a static KV cache, the one-token step under torch.compile:
the same tokens as generate(), at the compiled model's speed).
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager, nullcontext

from infra import models


def add_args(p) -> None:
    """03's speed flags: --compile-generation (static_decode) and --compile-update (trainable.compile_update)."""
    import argparse

    g = p.add_argument_group("compiled decoding and update (infra/decoding.py, infra/trainable.py: compile_update)")
    g.add_argument(
        "--compile-generation",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rollouts and the local critic's critiques by static_decode (a static KV cache, torch.compile)",
    )
    g.add_argument(
        "--compile-update",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="steps 4 and 6's forwards under torch.compile, AdamW fused (not bit for bit)",
    )


@functools.lru_cache(maxsize=8)
def _ids_with(tokenizer, char: str) -> frozenset:
    """Ids of the vocabulary entries whose text contains `char` (byte-level BPE keeps ASCII as is)."""
    return frozenset(i for piece, i in tokenizer.get_vocab().items() if char in piece)


def _text_stop(tokenizer, stop, closers):
    """finished() for static_decode: the rows whose new token holds a closer ('}') and whose text so far satisfies
    stop(text) (greedy_generate's check, on the same ids)."""
    import torch

    def finished(history, token):  # history: the (B,) ids of every step so far, token: last
        rows = [r for r, t in enumerate(token.tolist()) if t in closers]
        done = torch.zeros(token.shape, dtype=torch.bool, device=token.device)
        if rows:
            so_far = torch.stack(history, 1)[rows].tolist()
            done[rows] = torch.tensor(
                [stop(tokenizer.decode(ids, skip_special_tokens=True)) for ids in so_far], device=token.device
            )
        return done

    return finished


def greedy_generate(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str | None = None,
    stop=None,
    compile: bool = False,
) -> list[list[int]]:
    """Greedy response ids for each prompt, cut before EOS: batched, left-padded, with a KV cache.

    The same tokens as `generate(..., temperature=0)` (model.generate greedy, nothing from the model's
    generation_config), with two savings: a row leaves the batch, and its KV cache, as soon as it ends, so the rows
    still running no longer pay for it; and with `stop(text) -> bool` a row also ends when its decoded text satisfies
    it (checked only after a token holding '}', the one stop condition in use: feedback_complete).
    compile: static_decode instead (a static KV cache, the step under torch.compile), the same tokens; there a row
    that has ended stays in the batch, masked (the compiled step keeps one shape).
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    device, out = next(model.parameters()).device, []
    eos, pad = set(models.stop_ids(model)), tokenizer.pad_token_id
    closers = _ids_with(tokenizer, "}") if stop is not None else frozenset()
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=desc is None, leave=False):
        ids, mask = models.left_pad(
            [p if isinstance(p, list) else models.encode_prompt(tokenizer, p) for p in prompts[i : i + batch_size]], pad
        )
        ids, mask = ids.to(device), mask.to(device)
        if compile:
            new = static_decode(
                model,
                ids,
                mask,
                max_new_tokens,
                lambda logits, t: logits.argmax(-1),
                list(eos),
                pad,
                finished=_text_stop(tokenizer, stop, closers) if stop is not None else None,
            )
            out += [[t for t in row if t != pad and t not in eos] for row in new.tolist()]
            continue
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        rows = list(range(len(ids)))  # chunk rows still running, in batch order
        new = [[] for _ in rows]
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=position,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1]
            next_ids = logits.float().argmax(-1)
            running = []
            for j, (row, token) in enumerate(zip(rows, next_ids.tolist())):
                if token in eos:
                    continue
                new[row].append(token)
                if token in closers and stop(tokenizer.decode(new[row], skip_special_tokens=True)):
                    continue
                running.append(j)
            if not running:
                break
            if len(running) < len(rows):  # finished rows leave the batch and the cache
                keep = torch.tensor(running, device=device)
                cache.batch_select_indices(keep)
                rows, next_ids, mask, position = [rows[j] for j in running], next_ids[keep], mask[keep], position[keep]
            ids = next_ids[:, None]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
            position = position[:, -1:] + 1
        out += [[t for t in row if t != pad] for row in new]
    return out


def prompt_bucket(width: int) -> int:
    """The prompt width a static KV cache is built for: `width` rounded up to 16, 24, 32, 48, 64, 96, ... (powers of
    two and their halfway points: at most a third of the width is padding). The compiled decode step is specialised
    to its shapes, so a run compiles it for a few widths, not for every batch."""
    bucket = 16
    while bucket < width:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


def decode_forward(model, ids, mask, position, cache):
    """Logits (B, V) of the token after the last of `ids` (B, n), whose keys and values join `cache` (a StaticCache);
    mask (B, L) marks the cache slots that hold a token (L = its length), position (B, n) their positions."""
    return model(
        input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True, logits_to_keep=1
    ).logits[:, -1]


def inductor_cache_per_kernel_path() -> None:
    """Inductor's cache key leaves out torch's CPU kernel path (ATEN_CPU_CAPABILITY): C++ kernels compiled under avx2
    and loaded under another path failed to build, and the other way sampled from NaN (issue 80). Each path gets a
    folder of its own in inductor's default one, unless TORCHINDUCTOR_CACHE_DIR names another (inductor sets it to
    the default the first time anything asks, so the default value counts as unset). Called before torch.compile."""
    import os

    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        path = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, path)


@functools.cache
def _compiled_decode_forward(device_type: str):
    """decode_forward under torch.compile (inductor): built once per device type, specialised to each shape it meets
    (dynamic=False), fullgraph (a part that cannot be compiled is an error, not a silent fall back to eager). On CUDA
    in mode reduce-overhead, as transformers' own compiled generate(): the step is replayed as one CUDA graph, so
    its few hundred kernel launches cost one (the static cache's tensors keep their addresses for it)."""
    import torch

    # one compiled entry per model class x batch x cache length: torch's default limit of 8 would make a long
    # run (policy and critic, a few buckets each) quietly fall back to eager for the shapes after the eighth
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    inductor_cache_per_kernel_path()
    return torch.compile(
        decode_forward, fullgraph=True, dynamic=False, mode="reduce-overhead" if device_type == "cuda" else None
    )


_STATIC_CACHES = weakref.WeakKeyDictionary()  # model -> (shape key, its StaticCache): the last one static_decode used


def static_cache(model, batch: int, length: int, device):
    """An empty StaticCache of `length` slots for `batch` rows: the model's last one when its shape and dtype fit (its
    tensors keep their addresses, on which a CUDA graph of the compiled step replays), else a new one that replaces
    it (one per model: an 8B model's cache can take gigabytes)."""
    import torch
    from transformers import StaticCache

    key = (
        batch,
        length,
        str(device),
        next(model.parameters()).dtype,
        torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type),
    )
    kept = _STATIC_CACHES.get(model)
    if kept is not None and kept[0] == key:
        kept[1].reset()
        return kept[1]
    cache = StaticCache(config=model.config, max_cache_len=length)
    _STATIC_CACHES[model] = (key, cache)
    return cache


@contextmanager
def input_grad_hooks_off(model):
    """Activation checkpointing's forward hook on the embeddings (transformers' enable_input_require_grads: it calls
    output.requires_grad_(True)) removed while the block runs, then put back: decoding needs no gradients, and torch
    2.11's compiler cannot trace that call (the compiled decode step of a checkpointed policy failed on a GPU)."""
    owners = [m for m in model.modules() if vars(m).get("_require_grads_hooks")]
    for m in owners:
        m.disable_input_require_grads()
    try:
        yield
    finally:
        for m in owners:
            m.enable_input_require_grads()


PACKED = "t2g_packed_sdpa"  # the attention static_decode's compiled step runs (packed_sdpa)


def packed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, except for one query token with grouped key/value heads (GQA: Llama-3.1-8B has 8
    key/value heads for 32 query heads): its query heads are packed onto their key/value head (transformers'
    pack_gqa) also under torch.compile. transformers' sdpa packs only in eager mode; compiled, with a mask (a static
    cache always has one) it copies the whole cache once per query head (repeat_kv) in every layer of every step:
    4x the cache's bytes written and read again, at 8B x 64 rows x 768 slots some 25 GB a step."""
    from transformers.integrations.sdpa_attention import pack_gqa, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or query.shape[2] != 1 or kwargs.get("position_bias") is not None or kwargs.get("dropout", 0.0):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(
        pack_gqa(query, groups), key, value, attn_mask=pack_gqa(attention_mask, groups), scale=kwargs.get("scaling")
    )  # (B, H_kv, groups, D)
    return out.reshape(out.shape[0], -1, 1, value.shape[-1]).transpose(1, 2).contiguous(), None  # (B, 1, H, D)


@contextmanager
def packed_attention(model):
    """The model's layers attend through packed_sdpa inside the block (a model on sdpa; any other left as it is)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    AttentionInterface.register(PACKED, packed_sdpa)
    AttentionMaskInterface.register(PACKED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = PACKED
    try:
        yield
    finally:
        config._attn_implementation = before


def static_decode(
    model, ids, mask, max_new_tokens: int, pick, stop_ids: list[int], pad_id: int, compile: bool = True, finished=None
):
    """generate()'s decoding loop without generate(): a static KV cache, and the one-token step compiled.

    The prompts ids, mask (B, P) (left-padded) are padded further on the left to prompt_bucket(P) and go through one
    eager forward (the prefill); then every new token through decode_forward, compiled when `compile`. A static cache
    (StaticCache: one preallocated tensor per layer, written in place) keeps every step's shapes the same, so the
    compiled step is reused for the whole run; what it removes is eager transformers' per-call overhead (most of a
    small model's step on a CPU, and of a large one's on a GPU, where one step reads the weights in milliseconds).
    pick(logits (B, V) float32, t) -> ids (B,) chooses token t of every row (sampler, or argmax). A row ends at its
    first id in stop_ids, or where finished(the (B,) ids of steps 0..t, those of step t) -> (B,) bool says so; it gets
    pad_id from then on, and the loop ends when every row has ended or after max_new_tokens. Returns the new ids
    (B, steps): generate()'s sequences after the prompt, for the same pick.
    """
    import torch
    import torch.nn.functional as F

    extra = prompt_bucket(ids.shape[1]) - ids.shape[1]
    ids, mask = F.pad(ids, (extra, 0), value=pad_id), F.pad(mask, (extra, 0))  # (B, P'), P' a bucket
    slots = F.pad(mask, (0, max_new_tokens))  # (B, P' + N): 1 where a cache slot holds a token
    position = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions start at the first token
    cache = static_cache(model, len(ids), slots.shape[1], ids.device)
    stop = torch.tensor(stop_ids, device=ids.device)
    step = _compiled_decode_forward(ids.device.type) if compile else decode_forward
    done, new = torch.zeros(len(ids), dtype=torch.bool, device=ids.device), []
    with torch.no_grad(), input_grad_hooks_off(model), packed_attention(model) if compile else nullcontext():
        logits = decode_forward(model, ids, slots, position, cache)  # prefill: eager (its shape changes)
        position = position[:, -1:]
        for t in range(max_new_tokens):
            token = pick(logits.float(), t).masked_fill(done, pad_id)  # (B,)
            new.append(token)
            done |= torch.isin(token, stop) | (finished(new, token) if finished is not None else False)
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            slots[:, ids.shape[1] + t] = 1
            position = position + 1
            logits = step(model, token[:, None], slots, position, cache)
    return torch.stack(new, 1)


def sampler(config):
    """pick() for static_decode that chooses as generate() does for the GenerationConfig `config` (one of
    generation_config's): the stop ids barred for the first min_new_tokens tokens, then greedy, or logits / T, the
    top-p cut (transformers' own TopPLogitsWarper) and one torch.multinomial draw per step over the whole batch,
    finished rows included, so the random stream is consumed exactly as generate() consumes it."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    known = {
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_p",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "transformers_version",
    }
    unsupported = {k: v for k, v in config.to_diff_dict().items() if k not in known | {"top_k"}}
    if config.do_sample and config.top_k:  # GenerationConfig's default top_k is 50: generate() would cut to it
        unsupported["top_k"] = config.top_k
    if unsupported:  # a logits processor that generate() would apply and pick() does not
        raise ValueError(f"static decoding implements generation_config's settings only, not {unsupported}")
    stop = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]

    def pick(logits, t):  # (B, V) -> (B,)
        if t < (config.min_new_tokens or 0):  # MinNewTokensLengthLogitsProcessor
            logits = logits.index_fill(1, torch.tensor(stop, device=logits.device), -float("inf"))
        if not config.do_sample:
            return logits.argmax(-1)
        if config.temperature != 1.0:
            logits = TemperatureLogitsWarper(config.temperature)(None, logits)
        if config.top_p < 1.0:
            logits = TopPLogitsWarper(config.top_p)(None, logits)
        return torch.multinomial(logits.softmax(-1), num_samples=1).squeeze(1)

    return pick


def generate_static(model, ids, mask, config, compile: bool = True):
    """model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, P:] (the new ids, (B, steps)),
    token for token and drawing the same random numbers, by static_decode: a static KV cache and, when `compile`, the
    decode step under torch.compile. config: one of generation_config's (sampling at T with top_k = 0 and top_p, or
    greedy; min/max new tokens; stop ids; pad id)."""
    stop = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return static_decode(model, ids, mask, config.max_new_tokens, sampler(config), stop, config.pad_token_id, compile)


def generate(model, query, query_mask, gen_config, args):
    """03's step 1 in process: the responses (B, T) to a left-padded batch of queries, sampled with gen_config under
    03's precision, by transformers' generate or, with --compile-generation, generate_static (the same tokens from
    the same random numbers); --fsdp-generate whole gathers the sharded policy for it."""
    import torch

    from infra import distributed

    with (
        torch.no_grad(),
        distributed.autocast(args.device, args.dtype),
        distributed.gathered(model, args.fsdp_generate == "whole"),
    ):
        if args.compile_generation:
            return generate_static(model, query, query_mask, gen_config)
        response = model.generate(input_ids=query, attention_mask=query_mask, generation_config=gen_config)
        return response[:, query.shape[1] :]
