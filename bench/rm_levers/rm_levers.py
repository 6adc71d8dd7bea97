"""What limits the demo reward model's poor-span recall? One lever at a time (issue: capacity, data, objective, init,
training length), each a full fine-tune of a demo base on demo annotations, scored on 200 held-out posts.

    python bench/rm_levers/rm_levers.py --name base                                  # the reference point
    python bench/rm_levers/rm_levers.py --name deep --layers 4 --pretrain 500        # capacity: depth (also --hidden, --heads)
    python bench/rm_levers/rm_levers.py --name data --n 16000 --mistake 0.9          # data: fresh examples, flawed share
    python bench/rm_levers/rm_levers.py --name kind --n 16000 --kind wrong           # data: every flawed summary has a wrong fact
    python bench/rm_levers/rm_levers.py --name own --policy runs/demo/sft            # data: a share of the policy's own answers
    python bench/rm_levers/rm_levers.py --name walk --fmt verdict                    # objective: a critique format
    python bench/rm_levers/rm_levers.py --name heavy --json-weight 3                 # objective: loss weight on the span JSON
    python bench/rm_levers/rm_levers.py --name order --json-first                    # objective: the span JSON first
    python bench/rm_levers/rm_levers.py --name lora --lora 32 --lr 5e-4              # LoRA instead of full fine-tuning
    python bench/rm_levers/rm_levers.py --name long --steps 4000 --evals 1000,2000,3000,4000   # training length

Each run prints one JSON line per evaluation step and, last, all of them as one JSON list. A run of 2000 steps of
batch 16 takes ~5 min on 2 CPU cores (~1.5 min on a GPU: --device cuda); runs are independent, so a sweep can run them
side by side. The held-out posts have the demo's natural flawed share (55%), whatever the training data's.
Formats (--fmt; the span JSON that follows is always the same):
  default  the demo critic's critique: "It gets X, Y and Z right. It says W where the post says V."
  verdict  a verdict per quoted word in response order: "X right. W wrong, the post says V."
  ref      the post's ideal summary first, then the default critique
  cmp      each quoted word next to the post's word of its kind: "W (post: V) wrong."
  slots    fact by fact, the post's value first, then the response's: "place: park / garden wrong."
"""

import argparse
import fcntl
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra import models, runs  # noqa: E402
from infra import tiny_model  # noqa: E402
from tasks import demo  # noqa: E402
from importlib import import_module  # noqa: E402

rm02 = import_module("02_train_reward")


def labels_of(prompt: str, response: str) -> list[tuple[str, str, str | None]]:
    """(word, label, the post's word of its kind) for each word the demo critic labels, in response order."""
    facts, _ = demo.demo_post_facts(prompt)
    return [
        (w, "right" if kind == "good" else kind, facts.get(demo._CATEGORY.get(w)))
        for w, _, _, kind in demo.demo_labels(prompt, response)
        if kind
    ]


def flagged_by_kind(held_out: list[dict], outputs: list[str]) -> dict:
    """Share of the held-out posts' real mistakes that the reward model's poor spans flag, by kind
    (demo.demo_flagged, as 04's monitor counts them): wrong facts need the post; asides and repeats show alone."""
    got = {k: [0, 0] for k in ("wrong", "irrelevant", "repeated")}
    for rec, out in zip(held_out, outputs):
        try:
            rm = common.parse_feedback(out)
        except ValueError:
            rm = {"good_spans": [], "poor_spans": []}
        rows = demo.demo_flagged(rec["prompt"], rec["response"], rec, rm)
        for k in got:
            got[k] = [x + y for x, y in zip(got[k], rows[f"rm_vs_critic/flagged_{k}"])]
    return {f"flagged_{k}": round(n / d, 3) if d else None for k, (n, d) in got.items()}


def critique(fmt: str, prompt: str, response: str, default: str) -> str:
    if fmt == "default":
        return default
    labs = labels_of(prompt, response)
    if fmt == "verdict":
        return (
            " ".join(
                f"{w} {lab}" + (f", the post says {post}" if lab == "wrong" else "") + "." for w, lab, post in labs
            )
            or default
        )
    if fmt == "ref":
        return f"The post says: {demo.DEMO_SUMMARY.format(**demo.demo_post_facts(prompt)[0])} {default}"
    if fmt == "cmp":
        return " ".join(f"{w} (post: {post or 'none'}) {lab}." for w, lab, post in labs) or default
    if fmt == "slots":
        facts, words = demo.demo_post_facts(prompt)[0], re.findall(r"\w+", response)
        parts = []
        for cat, post in ((c, facts[c]) for c in demo.DEMO_FACTS):
            said = next((w for w in words if demo._CATEGORY.get(w) == cat), None)
            parts.append(
                f"{cat.replace('_', ' ')}: {post} / {said or 'none'} "
                f"{'ok' if said == post else 'wrong' if said else 'missing'}."
            )
        return " ".join(
            parts + list(dict.fromkeys(f"{w} {lab}." for w, lab, _ in labs if lab in ("irrelevant", "repeated")))
        )
    raise ValueError(fmt)


def records(split: str, n: int, mistake_rate: float, fmt: str, kind: str | None = None) -> list[dict]:
    """n annotated demo examples; kind: keep the clean ones and the flawed ones with a mistake of that kind (drawn
    from 4n)."""
    out = []
    for ex in demo.demo_dataset(split, 4 * n if kind else n, mistake_rate):
        if (
            kind
            and kind not in (found := {k for *_, k in demo.demo_labels(ex["prompt"], ex["response"])})
            and found - {None, "good"}
        ):
            continue
        out.append(annotated(ex, fmt))
    return out[:n]


def annotated(ex: dict, fmt: str) -> dict:
    """A demo example with the exact critic's spans and its critique in format `fmt`."""
    fb = demo.demo_critic(ex["prompt"], ex["response"])
    return {**ex, **fb, "critique": critique(fmt, ex["prompt"], ex["response"], fb["critique"])}


def policy_records(model, tok, split: str, n: int, fmt: str) -> list[dict]:
    """The policy's own answers to n demo posts, sampled at temperature 1 as in PPO, with the exact critic's spans."""
    torch.manual_seed(0)
    posts = demo.demo_dataset(split, n)
    ids = models.generate(model, tok, [p["prompt"] for p in posts], 32, temperature=1.0, batch_size=64)
    return [
        annotated({**ex, "response": tok.decode(row, skip_special_tokens=True)}, fmt) for ex, row in zip(posts, ids)
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--name", required=True, help="label of this run in the output")
    a("--out", default="bench/out/rm_levers", help="where the demo bases are built (shared by runs of one shape)")
    a("--layers", type=int, default=2, help="capacity: base model depth (the demo's: 2)")
    a("--hidden", type=int, default=128, help="capacity: base model width (the demo's: 128)")
    a("--heads", type=int, default=4, help="capacity: attention heads (the demo's: 4)")
    a("--pretrain", type=int, default=250, help="init: base model pretraining steps (the demo's: 250)")
    a("--scratch", action="store_true", help="init: train the reward model from random weights")
    a(
        "--fmt",
        default="default",
        choices=["default", "verdict", "ref", "cmp", "slots"],
        help="objective: critique format",
    )
    a(
        "--json-first",
        action="store_true",
        help="objective: the span JSON before the critique (generation stops at "
        "the JSON's end,\nso the critique after it is never written)",
    )
    a(
        "--json-weight",
        type=float,
        default=1.0,
        help="objective: loss weight of the span JSON's tokens (the critique's: 1)",
    )
    a("--n", type=int, default=2000, help="data: annotated examples")
    a("--mistake", type=float, default=0.55, help="data: share of flawed summaries in the training data")
    a("--kind", choices=["wrong", "irrelevant", "repeated"], help="data: keep only flawed summaries with this kind")
    a(
        "--policy",
        help="data: a policy dir (e.g. runs/demo/sft) whose own samples (temperature 1), critiqued by the "
        "exact\ncritic, replace --policy-share of the training data; its samples on the held-out posts are scored too",
    )
    a("--policy-share", type=float, default=0.25, help="data: the share of --policy's samples in the training data")
    a("--lora", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tuning)")
    a("--lr", type=float, default=1e-3, help="peak learning rate (linear warmup 50 steps, linear decay)")
    a("--bs", type=int, default=16, help="batch size")
    a("--steps", type=int, default=2000, help="training length: optimizer steps")
    a("--evals", default="500,1000,1500,2000", help="steps at which the held-out posts are critiqued")
    a("--seed", type=int, default=0, help="seed of the data order")
    a(
        "--save",
        help="save the trained reward model here (loadable by infra.models.load_model, e.g. for bench/speed/critic_cost.py)",
    )
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    args = p.parse_args()

    base = ROOT / args.out / f"base_L{args.layers}_H{args.hidden}_h{args.heads}_P{args.pretrain}"
    base.parent.mkdir(parents=True, exist_ok=True)
    lock = open(f"{base}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # runs side by side build each shape's base once
    if not (base / "config.json").is_file():  # the demo base's recipe at this shape (demo.build_demo_base)
        texts, pairs = [], []
        for ex in demo.demo_dataset("pretrain", 3000):
            pairs.append((ex["prompt"], " " + ex["reference"]))
            fb = demo.demo_critic(ex["prompt"], ex["response"])
            texts += [ex["prompt"] + ex["response"], " " + common.format_rm_target(**fb)]
            texts += [critique(f, ex["prompt"], ex["response"], fb["critique"]) for f in ("verdict", "ref", "cmp")]
        texts += [common.rm_user_message("", "") + "\n\n### Critique\n"] * 100
        tiny_model.build_tiny_base(
            base,
            texts,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            intermediate_size=4 * args.hidden,
            pretrain_texts=pairs,
            pretrain_steps=args.pretrain,
            lr=2e-3,
            seed=0,
        )
    fcntl.flock(lock, fcntl.LOCK_UN)
    train = records("annotate", args.n, args.mistake, args.fmt, args.kind)
    held_out = records("rmval", 200, 0.55, args.fmt)
    on_policy = []
    if args.policy:  # the policy's answers: in training (a share) and as a second held-out set
        policy, policy_tok = models.load_model(args.policy)
        k = round(args.policy_share * args.n)
        train = train[: args.n - k] + (policy_records(policy, policy_tok, "annotate", k, args.fmt) if k else [])
        on_policy = policy_records(policy, policy_tok, "rmval", 200, args.fmt)
    model, tok = models.load_model(str(base))
    if args.scratch:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(model.config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        with models.peft_wraps_quietly():
            model = get_peft_model(
                model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear")
            )
    model.to(args.device)
    if args.json_first:  # encode_example and rm_critique read this module attribute at call time
        common.format_rm_target = lambda critique, good, poor, rm_format="critique+spans": (
            json.dumps({"good_spans": list(good), "poor_spans": list(poor)}, ensure_ascii=False) + "\n" + critique
        )
    examples, _ = rm02.encode_all(tok, train, 320)
    for ex in examples if args.json_weight != 1.0 else []:  # loss weights: the span JSON's tokens json_weight, else 1
        n_prompt = ex["labels"].count(-100)
        text, offsets = common.decode_with_offsets(tok, ex["input_ids"][n_prompt:])
        start = text.index('{"good_spans"')
        stop = text.index("}", start) + 1
        ex["weights"] = [0.0] * n_prompt + [args.json_weight if start <= lo < stop else 1.0 for lo, _ in offsets]
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1, (i + 1) / 50) * max(0.0, 1 - i / args.steps))
    rng, evals, t0, results = random.Random(args.seed), {int(x) for x in args.evals.split(",")}, time.time(), []
    for step in range(1, args.steps + 1):
        model.train()
        feats = [examples[rng.randrange(len(examples))] for _ in range(args.bs)]
        batch = {k: v.to(args.device) for k, v in rm02.collate(feats, tok.pad_token_id).items()}
        if args.json_weight == 1.0:
            loss = model(**batch).loss
        else:  # the weighted mean of the next-token losses
            w = torch.zeros(batch["labels"].shape, device=args.device)
            for i, f in enumerate(feats):
                w[i, : len(f["weights"])] = torch.tensor(f["weights"])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="none"
            )
            loss = (nll * w[:, 1:]).sum() / w[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step in evals:
            model.eval()
            row = {"name": args.name, "step": step, "examples": step * args.bs, "s": round(time.time() - t0)}
            for prefix, recs in (("", held_out), ("policy_", on_policy)):
                if recs:
                    m, outputs = rm02.evaluate_rm(model, tok, recs, 160, 64)
                    scores = {
                        **{
                            k: m[k]
                            for k in ("parse_rate", "pos_precision", "pos_recall", "neg_precision", "neg_recall")
                        },
                        **flagged_by_kind(recs, outputs),
                    }
                    row.update({prefix + k: v for k, v in scores.items()})
            results.append(row)
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps(results))
    if args.save:
        runs.save_pretrained(args.save, model, tok)


if __name__ == "__main__":
    main()
