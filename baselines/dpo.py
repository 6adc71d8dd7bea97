"""DPO (Rafailov et al. 2023) on preference pairs, from the same SFT start as stage 3: the paper's DPO baseline (§4.3).

    python baselines/dpo.py --model runs/demo/sft --data runs/demo/pairs_annotations.jsonl --output-dir runs/demo/dpo
    python baselines/dpo.py --task qa --model runs/slf5k/sft --data HuggingFaceH4/ultrafeedback_binarized \\
        --split train_prefs --output-dir runs/uf/dpo --device cuda --dtype bf16 --gradient-checkpointing
    python 04_evaluate.py --policy sft=runs/demo/sft --policy dpo=runs/demo/dpo/policy

Why here and not in a stage: DPO has no reward model (stage 2's job) and no rollouts or critic (stage 3's); it turns
the pairs that `02 --objective pairwise` trains a Bradley-Terry reward model on into a policy directly. So it reads
the pairs exactly as 02 does (scalar_rm.py's load_pairs: a dataset's chosen / rejected fields, or annotations, one
pair per prompt, fewer poor spans winning) and writes a policy that 04 evaluates like any other. The policy is 03's:
the same LoRA parametrisation and reference (the adapter switched off) and the same log-probs, from short copies of
infra.trainable's build_policy and 03's forward (build_policy, token_logprobs, reference_logprobs) that
tests/test_baselines.py pins equal to 03's.

The loss, with pi's and the reference's summed log-probs of each response (its EOS included) given the prompt:
    L = -log sigmoid(beta * [(log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))])
and beta * (log pi - log ref) is each response's implicit reward. It is written out in dpo_loss (a few lines, tested
against hand-computed values) rather than imported from TRL, which the project does not depend on for a baseline.
A batch runs as micro-batches (--micro-batch-size pairs per forward and backward, the gradient accumulated; run_pairs)
and the held-out pairs are scored the same way, so that only a micro-batch's logits ever exist (a 128k vocabulary
makes a row's float32 logits 128 MB per 256 tokens). Writes OUTPUT_DIR/config.json first, then policy/ (04 loads it),
metrics.jsonl (per step: loss, implicit rewards, their margin and accuracy) and eval.json (the same on the held-out
pairs: 02's split, by --task's preset).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import common  # noqa: E402
from infra import distributed, models, runs, trainable  # noqa: E402
from baselines import scalar_rm  # noqa: E402
from infra.data import split_records  # noqa: E402

# 02's --val-frac by --task preset (02_train_reward.PRESETS; tests/test_baselines.py pins the two equal): DPO holds out
# the pairs that 02 --objective pairwise holds out
VAL_FRAC = {"code": 0.05, "demo": 0.025, "qa": 0.05, "summarization": 0.05}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    a = p.add_argument
    a("--model", default="runs/demo/sft", help="the SFT policy to start from (and the reference): hub id or local dir")
    a(
        "--data",
        required=True,
        help="preference pairs: a dataset with chosen / rejected fields (JSONL, .json, "
        ".parquet or hub id),\nor annotations of 01_annotate.py (one pair per prompt, fewer poor spans wins)",
    )
    a("--split", default="train", help="--data a hub dataset: its split")
    a("--prompt-field", default="prompt", help="the prompt field of a preference dataset")
    a("--chosen-field", default="chosen", help="the preferred answer's field")
    a("--rejected-field", default="rejected", help="the other answer's field")
    a("--output-dir", default="runs/demo/dpo", help="policy/, metrics.jsonl, eval.json, config.json")
    a("--beta", type=float, default=0.1, help="DPO's beta: the strength of the implicit KL to the reference")
    a(
        "--lr",
        type=float,
        default=1e-4,
        help="learning rate (AdamW; linear warmup, then constant). On the demo, 1e-4 "
        "learns and\n1e-3 (03's LoRA lr) over-optimises: bench/paper_baselines/paper_baselines.py",
    )
    a("--warmup-steps", type=int, default=10, help="linear learning-rate warmup")
    a("--epochs", type=float, default=3.0, help="passes over the training pairs")
    a("--batch-size", type=int, default=32, help="pairs per optimizer step")
    a(
        "--micro-batch-size",
        type=int,
        help="pairs per forward and backward, the batch's gradient accumulated over "
        "them; the held-out\npairs are scored as many at a time (default: as many as 256 MB of float32 logits hold)",
    )
    a("--gradient-checkpointing", action="store_true", help="recompute activations in the backward pass (memory)")
    a(
        "--lora-r",
        type=int,
        default=16,
        help="LoRA rank (as 03's demo preset); 0 = full fine-tuning (the reference is then a frozen copy)",
    )
    a("--lora-alpha", type=int, default=32, help="LoRA alpha")
    a("--lora-targets", default="all-linear", help="comma-separated module names, or all-linear")
    a(
        "--task",
        default="demo",
        choices=sorted(VAL_FRAC),
        help="02's preset whose split DPO takes: --val-frac "
        "by default, and with --split-seed, the pairs\n02 --objective pairwise holds out for that task",
    )
    a(
        "--val-frac",
        type=float,
        help="share of pairs held out for eval.json (default: 02's preset for --task: the same pairs)",
    )
    a("--seed", type=int, default=1, help="seed of the LoRA init and the pair order (the split uses --split-seed)")
    a("--split-seed", type=int, default=0, help="seed of the train / val split (02's --seed: the same held-out pairs)")
    a(
        "--chat-template",
        default="auto",
        choices=["auto", "on", "off"],
        help="wrap prompts in the chat template, as 03 and 04 do",
    )
    a("--max-prompt-tokens", type=int, default=1024, help="a longer prompt keeps its last tokens (as in 03)")
    a(
        "--max-new-tokens",
        type=int,
        default=256,
        help="a longer response is cut to this many tokens (and loses its EOS)",
    )
    a("--max-grad-norm", type=float, default=1.0, help="gradient norm clip")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, ...")
    a("--dtype", default="float32", choices=["float32", "bf16", "fp16"], help="as 03's --dtype")
    args = p.parse_args(argv)
    if args.val_frac is None:  # 02's preset (VAL_FRAC), so DPO never trains on pairs 02 holds out
        args.val_frac = VAL_FRAC[args.task]
    for flag, value, ok in (
        ("--beta", args.beta, args.beta > 0),
        ("--batch-size", args.batch_size, args.batch_size >= 1),
        ("--micro-batch-size", args.micro_batch_size, (args.micro_batch_size or 1) >= 1),
    ):
        if not ok:
            raise common.DataError(f"{flag} {value:g}: must be > 0")
    return args


def build_policy(args, model):
    """(policy, frozen reference or None): infra.trainable's build_policy (03's) for DPO's flags (no --ref-adapter,
    no value head). LoRA (--lora-r > 0): the reference is the same weights with the adapter switched off; full
    fine-tuning: a frozen copy. Activation checkpointing where asked."""
    ref_model = None
    if args.lora_r > 0:
        model = trainable.add_lora(model, args.lora_r, args.lora_alpha, args.lora_targets)
    else:  # full fine-tuning: pi_ref is a frozen copy
        ref_model = trainable.frozen_copy(model, args.dtype)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model, ref_model


def token_logprobs(model, input_ids, attention_mask, n_resp: int):
    """(B, n_resp) log-probs of the last n_resp tokens, at temperature 1: 03's forward without a value head. Only the
    last n_resp + 1 positions' logits are computed; left padding: positions start at each row's first token."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=n_resp + 1,
    )
    logits = out.logits[:, :-1].float()  # (B, T, V): position t predicts t+1
    return torch.gather(logits.log_softmax(-1), 2, input_ids[:, -n_resp:, None]).squeeze(-1)


def reference_logprobs(model, ref_model, input_ids, attention_mask, n_resp: int):
    """token_logprobs of the reference: the frozen copy `ref_model` (full fine-tuning), else the same weights with
    the LoRA adapter switched off (03's reference_forward)."""
    if ref_model is not None:
        return token_logprobs(ref_model, input_ids, attention_mask, n_resp)
    with model.disable_adapter():
        return token_logprobs(model, input_ids, attention_mask, n_resp)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta: float):
    """DPO's loss on a batch of pairs, each argument the (B,) summed log-probs of a response given its prompt under
    the policy or the reference. Returns (mean loss, implicit rewards of the chosen and the rejected, each (B,)):
    r = beta * (log pi - log ref), loss = -log sigmoid(r_c - r_r)."""
    r_chosen, r_rejected = beta * (pi_chosen - ref_chosen), beta * (pi_rejected - ref_rejected)
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean(), r_chosen, r_rejected


def encode_pairs(tokenizer, pairs: list[dict], chat_template: str, max_prompt_tokens: int, max_new_tokens: int):
    """Each pair as (prompt ids as 03 builds them, chosen ids, rejected ids); a response ends with EOS unless cut."""

    def answer(text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[:max_new_tokens] if len(ids) >= max_new_tokens else ids + [tokenizer.eos_token_id]

    return [
        (
            models.policy_prompt(tokenizer, p["prompt"], chat_template, max_prompt_tokens),
            answer(p["chosen"]),
            answer(p["rejected"]),
        )
        for p in pairs
    ]


def sequence_logprobs(
    model, ref_model, queries: list[list[int]], answers: list[list[int]], pad_id: int, device: str, dtype: str
):
    """(policy, reference) summed log-probs of each answer given its query, each (N,), laid out as 03 lays out
    rollouts (queries left-padded, answers right-padded) and scored as 03 scores them (token_logprobs,
    reference_logprobs)."""
    query, query_mask = models.left_pad(queries, pad_id)
    T = max(len(y) for y in answers)
    response = torch.full((len(answers), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(answers), T)
    for i, y in enumerate(answers):
        response[i, : len(y)], mask[i, : len(y)] = torch.tensor(y), 1.0
    ids, attn = torch.cat([query, response], 1).to(device), torch.cat([query_mask, mask.long()], 1).to(device)
    mask = mask.to(device)
    with distributed.autocast(device, dtype):
        logprobs = token_logprobs(model, ids, attn, T)  # (2B, T)
        with torch.no_grad():
            ref_logprobs = reference_logprobs(model, ref_model, ids, attn, T)
    return (logprobs * mask).sum(1), (ref_logprobs * mask).sum(1)


def pair_rewards(model, ref_model, batch, pad_id, args) -> tuple:
    """dpo_loss of a batch of encoded pairs, all in one forward (sequence_logprobs): (mean loss, r_c, r_r)."""
    queries, answers = [q for q, _, _ in batch] * 2, [c for _, c, _ in batch] + [r for _, _, r in batch]
    pi, ref = sequence_logprobs(model, ref_model, queries, answers, pad_id, args.device, args.dtype)  # chosen, rejected
    B = len(batch)
    return dpo_loss(pi[:B], pi[B:], ref[:B], ref[B:], args.beta)


def stats_of(r_c, r_r) -> dict:
    """The loss and TRL's statistics of a batch's implicit rewards (each (B,))."""
    loss = -torch.nn.functional.logsigmoid(r_c - r_r).mean()
    return {
        "loss": loss.item(),
        "rewards/chosen": r_c.mean().item(),
        "rewards/rejected": r_r.mean().item(),
        "rewards/margin": (r_c - r_r).mean().item(),
        "rewards/accuracy": (r_c > r_r).float().mean().item(),
    }


def pair_stats(model, ref_model, batch, pad_id, args) -> tuple:
    """(loss, its stats) of a batch of encoded pairs in one forward: the reference run_pairs' micro-batches equal."""
    loss, r_c, r_r = pair_rewards(model, ref_model, batch, pad_id, args)
    return loss, stats_of(r_c.detach(), r_r.detach())


def micro_pairs(pairs, vocab: int, budget: int = 2**26) -> int:
    """Pairs per forward that keep its float32 logits (2 rows a pair, each its longest answer + 1 positions of the
    vocabulary; log_softmax a second copy) within `budget` elements (256 MB), at least 1."""
    longest = max((max(len(c), len(r)) for _, c, r in pairs), default=1)
    return max(1, budget // (2 * 2 * (longest + 1) * vocab))


def run_pairs(model, ref_model, pairs, pad_id, args, backward=None) -> dict:
    """stats_of the pairs, scored --micro-batch-size pairs per forward (default: micro_pairs): of a micro-batch only
    its pairs' summed log-probs outlive it. backward(loss): called on each micro-batch's loss weighted by its share
    of the pairs, at once, so its activations go before the next one's forward: the gradients add up to those of one
    forward over all the pairs (pair_stats; tested). Without it, wrap the call in torch.no_grad()."""
    micro = args.micro_batch_size or micro_pairs(pairs, model.config.vocab_size)
    r_c, r_r = [], []
    for i in range(0, len(pairs), micro):
        chunk = pairs[i : i + micro]
        loss, c, r = pair_rewards(model, ref_model, chunk, pad_id, args)
        if backward is not None:
            backward(loss * len(chunk) / len(pairs))
        r_c.append(c.detach())
        r_r.append(r.detach())
    return stats_of(torch.cat(r_c), torch.cat(r_r))


def main(argv=None) -> dict:
    from tqdm.auto import tqdm

    args, t0 = parse_args(argv), time.time()
    out = Path(args.output_dir)
    pairs, source = scalar_rm.load_pairs(
        args.data, args.split, args.prompt_field, args.chosen_field, args.rejected_field
    )
    train_pairs, val_pairs = split_records(pairs, args.val_frac, args.split_seed)
    print(f"{args.data}: {len(pairs)} pairs from {source} -> {len(train_pairs)} train, {len(val_pairs)} val")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model, tokenizer = models.load_model(
        args.model, device=args.device, dtype=args.dtype if args.lora_r > 0 else "float32"
    )
    model, ref_model = build_policy(args, model)  # 03's: LoRA, the reference = adapter off
    encode = lambda ps: encode_pairs(  # noqa: E731
        tokenizer,
        ps,
        args.chat_template,
        args.max_prompt_tokens,  # noqa: E731
        args.max_new_tokens,
    )
    train_set, val_set = encode(train_pairs), encode(val_pairs)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / max(args.warmup_steps, 1)))
    scaler = distributed.grad_scaler(args.device, args.dtype)
    steps = max(1, round(args.epochs * len(train_set) / args.batch_size))
    order, rows = [], []
    common.write_json(out / "config.json", {**vars(args), "pairs": len(pairs), "source": source})  # before any step
    model.train()
    for step in (bar := tqdm(range(1, steps + 1), desc="DPO")):
        if len(order) < args.batch_size:  # shuffled epochs, drawn in order
            order += random.sample(range(len(train_set)), len(train_set))
        batch, order = [train_set[i] for i in order[: args.batch_size]], order[args.batch_size :]
        stats = run_pairs(
            model, ref_model, batch, tokenizer.pad_token_id, args, backward=lambda loss: scaler.scale(loss).backward()
        )
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        rows.append({"step": step, **stats})
        bar.set_postfix(loss=f"{stats['loss']:.3f}", margin=f"{stats['rewards/margin']:.2f}")
    model.eval()
    common.write_jsonl(out / "metrics.jsonl", rows)
    runs.save_pretrained(
        out / "policy",
        model,
        tokenizer,
        **({"selected_adapters": ["default"]} if hasattr(model, "peft_config") else {}),
    )
    metrics = {"n": len(val_set), "steps": steps, "train_s": round(time.time() - t0, 1)}
    if val_set:
        with torch.no_grad():
            metrics.update(run_pairs(model, ref_model, val_set, tokenizer.pad_token_id, args))
    common.write_json(out / "eval.json", metrics)
    print(
        f"policy saved to {out / 'policy'}; held-out pairs: "
        + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float))
    )
    return metrics


if __name__ == "__main__":
    try:
        main()
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
