"""01 --generate-with MODEL and its flags: the responses sampled from a policy (Alg. 1 line 6, y ~ pi(.|x)) instead
of taken from the dataset. The policy is loaded before anything is written (load_generator), so one that cannot load
leaves no folder behind; each prompt is wrapped in the tokenizer's chat template when it has one (--chat-template),
and the responses are generated in batches of --gen-batch-size, left-padded (infra.models.generate), greedy at
--temperature 0.
"""

from __future__ import annotations

import argparse

import common
from infra import models


def add_args(p) -> None:
    g = p.add_argument_group("responses from a policy: --generate-with (annotation/generation.py)")
    g.add_argument(
        "--generate-with",
        default=None,
        metavar="MODEL",
        help="generate the responses with this policy (hub id or local dir) instead of taking the dataset's",
    )
    g.add_argument("--max-new-tokens", type=int, default=256, help="--generate-with: response length limit")
    g.add_argument("--temperature", type=float, default=0.0, help="--generate-with: sampling temperature (0 = greedy)")
    g.add_argument("--gen-batch-size", type=int, default=16, help="--generate-with: prompts per generate() call")
    g.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--generate-with: wrap each prompt in the tokenizer's chat template when it has one",
    )
    g.add_argument("--device", default=None, help="--generate-with: cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", default="float32", help="--generate-with: float32, bf16 or fp16")


def load_generator(args):
    """(model, tokenizer) of --generate-with, loaded before anything is written: one that cannot load leaves no
    folder behind."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return models.load_model(args.generate_with, device=device, dtype=args.dtype)
    except common.DataError as e:
        raise common.DataError(f"--generate-with {e}") from None


def generate_responses(records: list[dict], args, generator) -> None:
    """Fill `response` by sampling the policy `generator` (load_generator; Alg. 1 line 6): batched, left-padded."""
    import torch

    model, tok = generator
    prompts = [models.apply_template(tok, r["prompt"], "auto" if args.chat_template else "off") for r in records]
    torch.manual_seed(args.seed)
    ids = models.generate(
        model,
        tok,
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.gen_batch_size,
        desc="generate",
    )
    for rec, seq in zip(records, ids):
        rec["response"] = tok.decode(seq, skip_special_tokens=True)
