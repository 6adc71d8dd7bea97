"""--trace-samples, --dump-rollouts, --log-every: what a stage-3 run writes about itself, and what it shows while it
runs: step 7 of Alg. 4 (log_iteration: metrics.jsonl on the global batch, samples.jsonl every --log-every iterations),
the progress bar and its warnings (progress_bar, show_progress); --trace-samples
(trace_iteration: where each update went, token by token, in trace.jsonl, which 04's report draws as "Where the update
went" and bench/locality/ measures) and --dump-rollouts (dump_rollouts: every tensor of an iteration, an audit).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import common
from infra import distributed, mismatch


def add_args(p) -> None:
    g = p.add_argument_group("what a run records (infra/trace.py)")
    g.add_argument("--save-every", type=int, default=20, help="checkpoint every N iterations")
    g.add_argument("--log-every", type=int, default=10, help="write sample rollouts every N iterations")
    g.add_argument(
        "--dump-rollouts", help="audit: each iteration's tensors (delta, KL, advantages, ...) to DIR/step<N>_rank<R>.pt"
    )
    g.add_argument(
        "--trace-samples",
        type=int,
        help="where each update went: N rollouts per iteration to OUTPUT_DIR/trace.jsonl (0: off)",
    )


def progress_bar(first_step: int, args, rank: int):
    """The run's progress bar over its iterations (rank 0 shows it), and above it a warning when --top-p < 1 makes
    the run off-policy."""
    from tqdm.auto import tqdm

    if args.top_p < 1 and rank == 0:
        print(
            f"warning: --top-p {args.top_p} < 1: this run is off-policy (rollouts are sampled from the nucleus, PPO "
            "scores log-probs of the full distribution)",
            file=sys.stderr,
        )
    return tqdm(
        range(first_step, args.steps + 1),
        desc=f"PPO ({args.reward_mode})",
        initial=first_step - 1,
        total=args.steps,
        disable=rank != 0,
    )


def show_progress(bar, step: int, row: dict, feedback: list, args, rank: int) -> None:
    """Rank 0: the iteration's reward, KL, the share of answers the critic flagged (a token of delta < 0: what it
    calls a mistake, not the truth) and the parse-fail rate in the progress bar, and a warning line above it when most
    of its critiques failed (over --max-fail-share): a critic that stops parsing gives delta = 0, which the reward and
    the flagged share alone do not tell from a flawless batch (critics.failing stops such a run)."""
    if rank != 0:
        return
    rate = row["critic/parse_fail_rate"]
    bar.set_postfix(
        reward=f"{row['objective/span_reward']:.2f}",
        kl=f"{row['objective/kl']:.2f}",
        flagged=f"{row['critic/flagged_rate']:.2f}",
        parse_fail=f"{rate:.2f}",
    )
    if rate > args.max_fail_share:
        first = next((fb["critic_error"] for fb in feedback if fb and fb.get("critic_error")), None)
        bar.write(
            f"warning: iteration {step}: {round(rate * args.batch_size)} of {args.batch_size} critiques failed "
            f"(no span JSON, or no answer): their rollouts get delta = 0; first: {first}",
            file=sys.stderr,
        )


def served_mismatch(b, args, server=None) -> dict:
    """--rollout-server: how far the server's mu is from the trainer's pi_old (infra/mismatch.py), and the freshness
    check's largest difference on its probe (mismatch/probe_diff, nats: what "passed" measured); {} in-process."""
    if getattr(b, "behaviour_logprobs", None) is None:
        return {}
    stats = mismatch.mismatch_stats(b.logprobs, b.behaviour_logprobs, b.mask, args.rollout_is_mode, args.rollout_is_cap)
    return {
        **stats,
        **({"mismatch/probe_diff": server.fresh} if server is not None and server.fresh is not None else {}),
    }


def token_means(stats: list[dict], device) -> dict:
    """ppo_update's stats (each its micro-batch's token mean, with its "tokens") as token means over every micro-batch
    of every rank: a 1-token micro-batch weighs what its one token does, whatever --grad-accum and the world size."""
    keys = [k for k in stats[0] if k != "tokens"]
    rows = [[s[k] * s["tokens"] for k in keys] + [s["tokens"]] for s in stats]
    sums = distributed.all_sum(torch.tensor(rows, dtype=torch.float64, device=device).sum(0))  # (len(keys) + 1,)
    return dict(zip(keys, (sums[:-1] / sums[-1].clamp(min=1)).tolist()))


def log_iteration(step, out_dir, it: dict, args, rank) -> dict:
    """Step 7: one line of metrics.jsonl, computed on the global batch it["g"] (every rank's rollouts), and every
    --log-every iterations four sample rollouts with their critique (rank 0 writes). `it`, the iteration: its records
    "recs", this rank's batch "b" and the global one "g", "feedback", "counts" [unparsed critiques, quotes, quotes not
    found], "watched" (the monitor's sums, {} without one; logged as means over the batch), ppo_update's "stats" and
    "epochs", the "kl_coef" and "lr" it used, the value head's "explained_variance", and its "clock" (time.time() at
    its start and after sampling, critiquing, scoring and updating). b and g are 03's Rollouts. Returns the row."""
    b, g, stats, clock, watched = it["b"], it["g"], it["stats"], it["clock"], it["watched"]
    counts = distributed.all_sum(torch.tensor(it["counts"], dtype=torch.float, device=args.device))  # as it["counts"]
    if watched:
        watched = dict(
            zip(
                watched,
                (distributed.all_sum(torch.stack(list(watched.values())).to(args.device)) / args.batch_size).tolist(),
            )
        )
    ppo_stats = token_means(stats, args.device)
    mask = g.mask
    row = {
        "step": step,
        "objective/kl": g.kl.sum(1).mean().item(),
        "objective/kl_coef": it["kl_coef"],
        "objective/entropy": ppo_stats["losses/entropy"],
        "objective/span_reward": (g.delta * mask).sum(1).mean().item(),
        "objective/rlhf_reward": g.rewards.sum(1).mean().item(),
        **ppo_stats,
        **({"val/explained_variance": it["explained_variance"]} if args.advantage == "gae" else {}),  # rloo: no V
        "critic/parse_fail_rate": counts[0].item() / args.batch_size,
        "critic/unmatched_span_rate": counts[2].item() / max(counts[1].item(), 1),
        "critic/tokens_labelled_frac": ((g.delta != 0).float() * mask).sum().item() / mask.sum().item(),
        "critic/flagged_rate": ((g.delta < 0).float() * mask).amax(1).mean().item(),
        **watched,
        **served_mismatch(b, args, it.get("server")),
        "response/length": mask.sum(1).mean().item(),
        "response/eos_rate": g.has_eos.float().mean().item(),
        "policy/epochs": it["epochs"],
        "lr": it["lr"],
        "time/generate_s": clock["sampled"] - clock["start"],
        "time/critic_s": clock["critiqued"] - clock["sampled"],
        "time/forward_s": clock["scored"] - clock["critiqued"],
        "time/update_s": clock["updated"] - clock["scored"],
        "time/step_s": time.time() - clock["start"],
    }
    if rank == 0:
        with open(out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            common.append_jsonl(f, row)
    if rank == 0 and (step % args.log_every == 0 or step == args.steps):
        with open(out_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            for rec, text, fb, delta, m in list(zip(it["recs"], b.texts, it["feedback"], b.delta, b.mask))[:4]:
                fb = fb or {"critique": None, "good_spans": [], "poor_spans": []}
                common.append_jsonl(
                    f,
                    {
                        "step": step,
                        "prompt": rec["prompt"],
                        "response": text,
                        **fb,
                        "span_reward": (delta * m).sum().item(),
                    },
                )
    return row


def dump_rollouts(step: int, rank: int, b, kl_coef: float, params, out_dir) -> None:
    """--dump-rollouts (an audit): every tensor of an iteration (b, 03's Rollouts) and a checksum of the parameters
    after its update, to out_dir/step<N>_rank<R>.pt."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    T = b.mask.shape[1]
    torch.save(
        {
            "texts": b.texts,
            "delta": b.delta,
            "kl_coef": kl_coef,
            "query": b.input_ids[:, :-T],
            "response": b.input_ids[:, -T:],
            **{k: getattr(b, k) for k in ("kl", "mask", "values", "has_eos", "advantages", "returns")},
            "param_checksum": sum(distributed.full(p).double().sum().item() for p in params),
        },
        Path(out_dir) / f"step{step}_rank{rank}.pt",
    )


def trace_iteration(step, out_dir, b, recs, feedback, kl_coef, went: dict, args, rank) -> None:
    """--trace-samples N: where this iteration's update went, one line of out_dir/trace.jsonl (rank 0 writes; resume
    cuts it back like metrics.jsonl). `went`, 03's where_it_went: Delta_t = log pi_new - log pi_old of every response
    token ("log_ratio"), its locality over the global batch ("locality"), that of the advantages under both reward
    modes ("advantage_locality"), and this rank's r and A under both ("rewards", "advantages"). The line holds those
    localities and N of this rank's rollouts (b, 03's Rollouts), those with a poor span first: each token's text,
    delta, KL, V, the old and new log-probs, and r and A under both modes. r is the critic's and the KL's part alone:
    --missing-eos-penalty, which the update adds at the last token of a rollout cut off before its EOS, is the
    sample's own "missing_eos_penalty" (-penalty or 0), never inside r, where it read as the critic's; A is the
    update's, penalty included. 04's report draws it ("Where the update went"); bench/locality/ measures with it."""
    if rank != 0:
        return
    log_ratio, rewards, advantages = went["log_ratio"], went["rewards"], went["advantages"]
    flawed = ((b.delta < 0).float() * b.mask).amax(1).tolist()
    rows = sorted(range(len(b.mask)), key=lambda i: -flawed[i])[: args.trace_samples]  # stable: flawed first, in order
    num = lambda x, i, n: [float(f"{v:.6g}") + 0.0 for v in x[i, :n].tolist()]  # noqa: E731  (6 digits; no -0.0)
    samples = []
    for i in rows:
        n, text = int(b.mask[i].sum()), b.texts[i]
        samples.append(
            {
                "row": i,
                "prompt": recs[i]["prompt"][-2000:],
                "critique": (feedback[i] or {}).get("critique"),
                "tokens": [text[a:z] for a, z in b.offsets[i]],
                "has_eos": bool(b.has_eos[i]),
                "missing_eos_penalty": 0.0 if b.has_eos[i] else -args.missing_eos_penalty + 0.0,
                "delta": num(b.delta, i, n),
                "kl": num(b.kl, i, n),
                "values": num(b.values, i, n),
                "rewards": {m: num(r, i, n) for m, r in rewards.items()},
                "advantages": {m: num(a, i, n) for m, a in advantages.items()},
                "logprobs_old": num(b.logprobs, i, n),
                "logprobs_new": num(b.logprobs + log_ratio, i, n),
            }
        )
    with open(Path(out_dir) / "trace.jsonl", "a", encoding="utf-8") as f:
        common.append_jsonl(
            f,
            {
                "step": step,
                "reward_mode": args.reward_mode,
                "kl_coef": kl_coef,
                "locality": went["locality"],
                "advantage_locality": went["advantage_locality"],
                "samples": samples,
            },
        )
