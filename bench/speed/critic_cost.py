"""What the learned critic costs next to the rollout it judges: 03's time/critic_s / time/generate_s, measured alone.

    python 01_annotate.py && python 02_train_reward.py        # the demo's reward model (once)
    python bench/speed/critic_cost.py                               # ~1 min on 2 CPU cores

For each of --batches batches of 32 demo prompts, interleaved: the rollout exactly as 03 samples it (the SFT policy with
a fresh LoRA adapter, temperature 1, up to 32 new tokens), then the reward model's critiques of those rollouts twice:
with critics.learned.rm_critique (a finished row leaves the batch, a row ends where its span JSON closes) and with plain
model.generate, greedy, up to EOS (the code before issue 17). The two must give the same text for every rollout
(checked; the demo's results depend on nothing else). A reward model that writes its span JSON first
(bench/rm_levers/rm_levers.py --json-first --save DIR) stops there, while plain generate goes on to write the critique after it.
Prints one JSON object last: medians in seconds, ratio = critic_s / rollout_s (goal <= 1.0), ratio_plain_generate the
same with plain model.generate.
"""

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from critics import learned  # noqa: E402
from infra import models  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=12, help="batches of rollouts (the first is a warm-up)")
    p.add_argument("--policy", default="runs/demo/sft", help="rollout policy (03 builds it: the demo's SFT start)")
    p.add_argument("--reward-model", default="runs/demo/reward_model", help="the stage-2 reward model")
    p.add_argument("--prompts", default="runs/demo/data/prompts.jsonl")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    ppo = importlib.import_module("03_train_policy")
    run_args = ppo.parse_args(["--output-dir", "bench/out/critic_cost"])  # the demo preset: batch 32, LoRA r=16
    model, tok = models.load_model(args.policy)
    model, _, _ = ppo.build_policy(run_args, model)
    rm, rm_tok = models.load_model(args.reward_model)
    records = common.read_jsonl(args.prompts)
    bs, n_new, n_critic = run_args.batch_size, run_args.max_new_tokens, run_args.critic_max_new_tokens
    torch.manual_seed(0)
    rows, same = [], 0
    for b in range(args.batches):
        batch = records[b * bs % len(records) :][:bs]
        query, query_mask = models.left_pad([models.encode_prompt(tok, r["prompt"]) for r in batch], tok.pad_token_id)
        t0 = time.perf_counter()
        with torch.no_grad():
            seqs = model.generate(
                input_ids=query,
                attention_mask=query_mask,
                max_new_tokens=n_new,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        t1 = time.perf_counter()
        texts = []
        for row in seqs[:, query.shape[1] :].tolist():
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            texts.append(common.decode_with_offsets(tok, row[:cut])[0])
        prompts = [r["prompt"] for r in batch]
        t2 = time.perf_counter()
        new = learned.rm_critique(rm, rm_tok, prompts, texts, n_critic)
        t3 = time.perf_counter()
        plain = rm_tok.batch_decode(
            models.generate(
                rm,
                rm_tok,
                [common.build_rm_prompt(rm_tok, p, t) for p, t in zip(prompts, texts)],
                n_critic,
                batch_size=bs,
            ),
            skip_special_tokens=True,
        )
        t4 = time.perf_counter()
        same += sum(a == b for a, b in zip(new, plain))
        if b:
            rows.append(
                {
                    "rollout_s": t1 - t0,
                    "critic_s": t3 - t2,
                    "plain_s": t4 - t3,
                    "rollout_steps": seqs.shape[1] - query.shape[1],
                    "critic_tokens_max": max(len(rm_tok(x)["input_ids"]) for x in new),
                }
            )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"rollout {med['rollout_s']:.3f} s, critic {med['critic_s']:.3f} s (plain generate {med['plain_s']:.3f} s) "
        f"per batch of {bs}; identical critiques: {same} of {args.batches * bs}"
    )
    print(
        json.dumps(
            {
                "rollout_s": round(med["rollout_s"], 4),
                "critic_s": round(med["critic_s"], 4),
                "ratio": round(med["critic_s"] / med["rollout_s"], 3),
                "critic_plain_generate_s": round(med["plain_s"], 4),
                "ratio_plain_generate": round(med["plain_s"] / med["rollout_s"], 3),
                "identical": same,
                "critiques": args.batches * bs,
                "batches": len(rows),
                "batch_size": bs,
                "rollout_steps": med["rollout_steps"],
                "critic_tokens_max": med["critic_tokens_max"],
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
