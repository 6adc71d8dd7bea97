"""Peak memory of one PPO update with LoRA vs a plain forward/backward of the same model: no second copy of the weights.

    python bench/speed/memory.py            # ~1 min on 2 CPU cores; a 170M-parameter Llama from a config (no download)

Each measurement runs in a fresh process and reports its peak resident memory (ru_maxrss) above the memory held right
after the model is built, so the numbers compare the work, not the interpreter:
  plain     the model's own forward + backward on (B, T) tokens, every weight trainable (the yardstick)
  lora      03_train_policy's update: build_policy (LoRA r=16 + value head), the reference log-probs from the same
            weights with the adapter disabled (reference_forward), then forward + backward of the policy
  full_ft   the same with --lora-r 0, where the reference must be a frozen copy: what a second copy costs
Also printed: the distinct parameter storages the policy (and its reference) hold. lora holds the model's weights
once plus the adapter; full_ft holds them twice. plain runs the same passes (a no-grad pass, then forward + backward)
with every weight trainable. Prints one JSON line last.
"""

import argparse
import importlib
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(mode: str, batch: int, seq: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ids = torch.randint(1, cfg.vocab_size, (batch, seq))
    mask = torch.ones_like(ids)
    n_resp = seq // 2
    base = rss_mb()
    held = model
    if mode == "plain":  # the same passes as the PPO update: a no-grad pass (the reference), then forward + backward
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).logits[:, -n_resp:].float().log_softmax(-1)
        out = model(input_ids=ids, attention_mask=mask)
        ((out.logits[:, -n_resp:].float().log_softmax(-1) - ref) ** 2).mean().backward()
    else:
        ppo = importlib.import_module("03_train_policy")
        args = ppo.parse_args(
            ["--task", "summarization", "--model", "x", "--lora-r", "16" if mode == "lora" else "0", "--device", "cpu"]
        )
        model, ref_model, value_head = ppo.build_policy(args, model)
        held = [model, ref_model]
        with torch.no_grad():
            ref_lp, _ = ppo.reference_forward(model, ref_model, ids, mask, n_resp, 1.0)
        lp, values, _ = ppo.forward(model, value_head, ids, mask, n_resp, 1.0)
        ((lp - ref_lp) ** 2).mean().add(values.mean()).backward()
    # distinct parameter storages held by the policy (and the reference copy, if any): a second copy shows up here
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for m in ([held] if not isinstance(held, list) else held)
        if m is not None
        for p in m.parameters()
    }
    return {
        "mode": mode,
        "weights_mb": round(weights_mb, 1),
        "held_mb": round(sum(storages.values()) / 2**20, 1),
        "peak_over_model_mb": round(rss_mb() - base, 1),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (half of them the response)")
    p.add_argument("--mode", help=argparse.SUPPRESS)  # internal: one measurement in this process
    args = p.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.batch, args.seq)))
        return
    rows = {}
    for mode in ("plain", "lora", "full_ft"):
        out = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--batch", str(args.batch), "--seq", str(args.seq)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
        print(
            f"{mode:8s} parameters held {rows[mode]['held_mb']:7.1f} MB, peak {rows[mode]['peak_over_model_mb']:7.1f}"
            f" MB above the built model (its weights: {rows[mode]['weights_mb']:.0f} MB)"
        )
    print(
        json.dumps(
            {
                "weights_mb": rows["plain"]["weights_mb"],
                "batch": args.batch,
                "seq": args.seq,
                **{f"{m}_held_mb": r["held_mb"] for m, r in rows.items()},
                **{f"{m}_peak_mb": r["peak_over_model_mb"] for m, r in rows.items()},
                "lora_over_plain": round(rows["lora"]["peak_over_model_mb"] / rows["plain"]["peak_over_model_mb"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
