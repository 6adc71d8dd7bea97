"""--model, --policy: loading a model (a hub id, a local folder, a LoRA adapter folder), its prompts (chat template,
the prompt cut from its start to fit) and batched generation. Every stage loads through load_model; what training
adds to a loaded model (LoRA, the reference adapter, compiled forwards) is infra/trainable.py's.
"""

from __future__ import annotations

import json
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import common

# transformers resolves its names lazily and from_pretrained sets process-wide init state: neither is thread-safe (8
# threads loading at once raised ImportError or "Cannot copy out of meta tensor"), so a process's threads (e.g.
# bench/credit/credit_matched.py's judges) load one at a time
LOADING = threading.Lock()


def load_model(
    name_or_path: str,
    device: str = "cpu",
    dtype: str = "float32",
    adapter: str | None = None,
    scalar_head: bool = False,
):
    """(model, tokenizer) in eval mode. A directory holding adapter_config.json loads its base model plus the adapter.
    scalar_head: a sequence-classification model with one output (a scalar reward model; baselines/scalar_rm.py's
    scalar_rm_scores reads it), whose config's pad id is the tokenizer's; else a causal LM.

    - Dropout is off in every module (disable_dropout; RLHF detail: dropout makes old and new log-probs disagree).
    - The hub's generation_config.json is dropped, all but its stop ids: every generate() here passes its complete
      settings (generation_config), so no repetition_penalty, no_repeat_ngram_size, min_p, ... of the hub changes what
      is sampled. Its EOS ids (a list for Llama-3.1: <|eot_id|>, <|end_of_text|>, ...) join the tokenizer's.
    - A tokenizer without a pad token gets a distinct one, never EOS, so padding can't be confused with a finished
      response.
    A directory or hub id that cannot be loaded (no weights, no such model) is a DataError naming it; so is a
    transformers older than 5.24 (check_transformers), whose models would ignore our decoding loops' KV cache.
    """
    with LOADING:  # not thread-safe: see LOADING
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
            GenerationConfig,
        )

        check_transformers()
        check_model_path(name_or_path)
        path = Path(name_or_path)
        if adapter is None and (path / "adapter_config.json").is_file():
            adapter, name_or_path = (
                str(path),
                json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"],
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                adapter if adapter and Path(adapter, "tokenizer_config.json").is_file() else name_or_path
            )
            auto = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
            model = auto.from_pretrained(
                name_or_path, dtype=torch_dtype(dtype), **({"num_labels": 1} if scalar_head else {})
            )
        except (OSError, ValueError) as e:
            raise common.DataError(f"{name_or_path}: cannot load the model: {common.first_line(e)}") from None
        if tokenizer.pad_token is None:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            model.resize_token_embeddings(len(tokenizer))
        if scalar_head:  # (its pooling is not used: scalar_rm_scores reads the score at a given token, never a pad)
            model.config.pad_token_id = tokenizer.pad_token_id
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        hub_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # a scalar head: none
        stop += [i for i in ([hub_eos] if isinstance(hub_eos, int) else hub_eos or []) if i not in stop]
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id
        )
        if adapter:
            from peft import PeftModel

            with peft_wraps_quietly():
                model = PeftModel.from_pretrained(model, adapter)
        disable_dropout(model)
        return model.to(device).eval(), tokenizer


def check_transformers() -> None:
    """DataError unless transformers >= 5.24 (requirements.txt): from 5.24 a model takes its KV cache as `cache`, which
    greedy_generate and static_decode pass; an older 5.x takes `past_key_values` and silently swallows `cache`, so
    every token after the first would be decoded without its history (found on a GPU image with 5.17)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 24):
        raise common.DataError(
            f"transformers {transformers.__version__} is installed; this code needs >= 5.24 (a "
            "model takes its KV cache as `cache`): pip install 'transformers>=5.24,<6'"
        )


def looks_local(path: str) -> bool:
    """True when `path` names a local directory rather than a hub id ("org/name"): absolute, starting with '.', more
    than two parts, or under a directory that exists here. A missing local path is reported without asking the hub."""
    p = Path(path)
    return (
        p.exists()
        or p.is_absolute()
        or path.startswith(".")
        or len(p.parts) > 2
        or (bool(p.parts) and Path(p.parts[0]).is_dir())
    )


def check_model_path(path: str | None, flag: str = "") -> None:
    """DataError at once where `path` looks local (looks_local) and is not there: a typo'd folder (runs/smolm2) is
    never sent to the hub as a model id, where it costs ten retries and ends in an error that does not say the folder
    is missing. `flag` ("--model ") prefixes the message, as the user typed it."""
    if path and looks_local(path) and not Path(path).exists():
        raise common.DataError(f"{flag}{path}: no such directory")


def disable_dropout(model) -> None:
    """Dropout off for real, after the model is built: p = 0 in every dropout module, and 0.0 in every float attribute
    named like a dropout rate, which attention modules copy from the config when they are built (Llama, Qwen and
    Mistral's `attention_dropout`, OPT's `dropout`): editing the config afterwards reaches neither."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):  # and in the config, so a copy made from it (deepcopy, save and reload) agrees
            setattr(config, key, 0.0)


def stop_ids(model) -> list[int]:
    """Every id that ends a response: the EOS ids load_model collected (tokenizer's first)."""
    ids = model.generation_config.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [])


def generation_config(
    model, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, min_new_tokens: int = 0
):
    """The complete settings of a generate() call, built here rather than inherited: sampling at `temperature` with
    top_k = 0 (transformers' default top-k of 50 would be a hidden truncation) and `top_p`, or greedy when temperature
    is 0; the new-token limits; every stop id; the pad id. Everything else keeps transformers' neutral defaults,
    because load_model leaves nothing else in model.generation_config for generate() to merge in."""
    from transformers import GenerationConfig

    sample = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p)
        if temperature > 0
        else dict(do_sample=False)
    )
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        eos_token_id=stop_ids(model),
        pad_token_id=model.generation_config.pad_token_id,
        bos_token_id=model.generation_config.bos_token_id,
        **sample,
    )


def apply_template(tokenizer, prompt: str, chat_template: str = "auto") -> str:
    """The prompt as the policy sees it: wrapped in the tokenizer's chat template as one user turn ("on"; "auto": if
    it has one), or as is ("off"). "on" with a tokenizer that has no template is a DataError."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has:
        raise common.DataError(f"--chat-template on: the tokenizer of {tokenizer.name_or_path} has no chat template")
    if chat_template == "off" or not has:
        return prompt
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def fit_prompt(tokenizer, build, prompt: str, max_tokens: int | None):
    """(ids, task prompt kept, status) of the text build(prompt), with the task prompt cut from its start until the
    ids fit in max_tokens: what build() puts around it (a chat template, an instruction, the response a reward model
    critiques) is never cut. status is "ok", "truncated", or "too_long" when even an empty task prompt does not fit."""
    ids, kept = encode_prompt(tokenizer, build(prompt)), prompt
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, kept, "ok"
    task, cut = tokenizer(prompt, add_special_tokens=False)["input_ids"], 0
    while len(ids) > max_tokens and cut < len(task):  # a re-tokenized tail can differ by a token or two: re-check
        cut = min(cut + len(ids) - max_tokens, len(task))
        kept = tokenizer.decode(task[cut:]).lstrip("\ufffd")
        ids = encode_prompt(tokenizer, build(kept))
    return ids, kept, "truncated" if len(ids) <= max_tokens else "too_long"


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt; no second BOS when a chat template already put one in the text."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def policy_prompt(tokenizer, prompt: str, chat_template: str = "auto", max_tokens: int | None = None) -> list[int]:
    """The policy's input ids, the same in 03 (rollouts, SFT) and 04: the prompt in the chat template (apply_template),
    cut from its start to fit max_tokens (fit_prompt)."""
    return fit_prompt(tokenizer, lambda p: apply_template(tokenizer, p, chat_template), prompt, max_tokens)[0]


def left_pad(seqs: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) as (B, T) tensors, padded on the left so every row ends where generation starts."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def generate(
    model,
    tokenizer,
    prompts: list,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 32,
    desc: str | None = None,
) -> list[list[int]]:
    """Response token ids for each prompt (a text, or its token ids), cut before the first stop id. Greedy when
    temperature == 0. The settings are generation_config's, complete: nothing comes from the hub."""
    import torch
    from tqdm.auto import tqdm

    device, out, stop = next(model.parameters()).device, [], set(stop_ids(model))
    config = generation_config(model, max_new_tokens, temperature, top_p)
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=desc is None, leave=False):
        ids, mask = left_pad(
            [p if isinstance(p, list) else encode_prompt(tokenizer, p) for p in prompts[i : i + batch_size]],
            tokenizer.pad_token_id,
        )
        with torch.no_grad():
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for row in seqs[:, ids.shape[1] :].tolist():
            cut = next((k for k, t in enumerate(row) if t in stop), len(row))
            out.append(row[:cut])
    return out


def torch_dtype(name: str):
    """torch.float32 / bfloat16 / float16 from "float32", "bf16" (or "bfloat16"), "fp16" (or "float16")."""
    import torch

    return {
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }[name]


@contextmanager
def peft_wraps_quietly():
    """peft (0.21) asks each model it wraps for `is_gradient_checkpointing`, which transformers 5.24 deprecated for
    `is_activation_checkpointing`: a FutureWarning at every adapter added or loaded, about a line we cannot change.
    That one warning is silenced while peft wraps a model (stages 2-4 enable checkpointing by the new names)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
