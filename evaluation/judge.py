"""--judge-base-url: the LLM judge's pairwise win/tie/loss (paper §4, App. E), from any OpenAI-compatible endpoint.

Each pair A:B (--judge-pairs; default: each policy against each policy listed before it, judge_pair_list) is judged on
every prompt (the first --judge-limit): the judge reads the prompt and both answers (JUDGE_PROMPT), reasons, and ends
with "Winner: A", "B" or "tie" (parse_verdict), all within --judge-max-tokens. A seeded coin per prompt and pair
decides which answer is shown first; the order is recorded with each verdict and undone before scoring, so the
judge's position bias cancels out. Rates are over the valid verdicts, with 95% bootstrap intervals; a reply without a
"Winner:" line is invalid and counts nowhere (its count is reported beside the rates).

Requests go --judge-concurrency at a time (a local server: what it runs at once), each retried as
infra.serving.retry_delay says (--judge-retries; never after --judge-timeout: the server may still be generating it);
one that still fails stops the judge in one line, the verdicts so far cached in OUTPUT_DIR/eval/judge.A_vs_B.jsonl.
Before any generation, check_judge sends the endpoint one cheap request, so a wrong model name, a dead port or a
missing key stops the run at once (infra.serving).
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path

import common
from common import DataError
import evaluation
from infra import serving


def add_args(p) -> None:
    g = p.add_argument_group("LLM judge (evaluation/judge.py)")
    g.add_argument("--judge-base-url", default=None, help="OpenAI-compatible endpoint of the judge (enables judging)")
    g.add_argument("--judge-model", default="gpt-4o", help="judge model name")
    g.add_argument(
        "--judge-pairs",
        default=None,
        metavar="A:B,...",
        help="A's win/tie/loss against B (default: each policy vs each one listed before it; none: no pair)",
    )
    g.add_argument("--judge-limit", type=int, default=None, help="judge only the first N prompts")
    g.add_argument("--judge-concurrency", type=int, default=8, help="judge requests in flight")
    g.add_argument("--judge-max-tokens", type=int, default=1024, help="longest verdict, in tokens")
    g.add_argument("--judge-timeout", type=float, default=120.0, help="seconds before a request is abandoned")
    g.add_argument("--judge-retries", type=int, default=6, help="retries on 408/409/429/5xx and connection errors")


def judge_pair_list(spec: str | None, names: list[str]) -> list[tuple[str, str]]:
    """--judge-pairs A:B,... as (A, B) pairs, each two of `names`; default: each later policy vs each earlier one;
    "none": no pair (the judge serves only --alpaca-eval or --mt-bench)."""
    if spec == "none":
        return []
    pairs = (
        [tuple(p.split(":", 1)) for p in spec.split(",")]
        if spec
        else [(names[j], names[i]) for j in range(len(names)) for i in range(j)]
    )  # later policy vs earlier one
    for pair in pairs:
        if len(pair) != 2 or not set(pair) <= set(names) or pair[0] == pair[1]:
            raise DataError(f"--judge-pairs: {':'.join(pair)!r} is not A:B with two of {names}")
    return pairs


def check_judge(args) -> None:
    """Before any generation: one cheap request to --judge-base-url, sent as judge_pairs sends its own."""
    serving.check_server(
        args.judge_base_url,
        args.judge_model,
        "chat",
        args.judge_timeout,
        min(args.judge_retries, 2),
        "--judge-base-url",
        {"temperature": 0.0, "max_tokens": args.judge_max_tokens},
    )


JUDGE_PROMPT = """Which response to the prompt is better: faithful, accurate, complete and concise, with nothing \
invented or irrelevant? The order they are shown in means nothing.

### Prompt\n{prompt}\n\n### Response A\n{a}\n\n### Response B\n{b}

Explain briefly, then end with a line that is exactly "Winner: A", "Winner: B" or "Winner: tie"."""


def parse_verdict(text: str) -> str:
    """'A', 'B', 'tie', or 'invalid' from the judge's reply (its last 'Winner: ...')."""
    found = re.findall(r"winner\W*(A|B|tie)\b", text or "", re.I) or re.findall(r"^\W*(A|B|tie)\W*$", text or "", re.I)
    return ({"a": "A", "b": "B", "tie": "tie"}[found[-1].lower()]) if found else "invalid"


def judge_pairs(
    records,
    outputs: dict[str, list[str]],
    pairs: list[tuple[str, str]],
    base_url: str,
    model: str,
    seed: int,
    concurrency: int,
    cache_dir: Path,
    fps: dict[str, str],
    max_tokens: int = 1024,
    timeout: float = 120.0,
    retries: int = 6,
) -> dict:
    """Win/tie/loss of A against B for each pair. Per prompt, a seeded coin decides which answer is shown first; the
    order is recorded with each verdict and undone before scoring, so position bias cancels out. Requests are retried
    as infra.serving.retry_delay says (never after a timeout); one that still fails stops the judge in one line
    (DataError), the verdicts so far cached."""
    from openai import APIError

    results = {}
    for a, b in pairs:

        async def ask(client, sem, it):
            first, second = (b, a) if it["swapped"] else (a, b)
            content = JUDGE_PROMPT.format(prompt=it["prompt"], a=it["answers"][first], b=it["answers"][second])
            try:
                async with sem:
                    reply = await serving.send_with_retries(
                        lambda: client.chat.completions.create(
                            model=model,
                            temperature=0.0,
                            max_tokens=max_tokens,
                            messages=[{"role": "user", "content": content}],
                        ),
                        retries,
                    )
            except APIError as e:
                raise DataError(f"judge request failed: {serving.api_error(e)}") from None
            raw = (reply.choices[0].message.content or "") if reply.choices else ""  # no choices: invalid
            verdict = parse_verdict(raw)
            winner = {"A": first, "B": second, "tie": "tie"}.get(verdict)  # undo the order
            return {"id": it["id"], "shown_first": first, "verdict": verdict, "winner": winner, "reply": raw[-2000:]}

        items = [
            {
                "id": r["id"],
                "prompt": r["prompt"],
                "answers": {a: outputs[a][i], b: outputs[b][i]},
                "swapped": random.Random(f"{seed}|{a}|{b}|{r['id']}").random() < 0.5,
            }
            for i, r in enumerate(records)
        ]

        def compute(chunk):
            async def ask_all():
                sem = asyncio.Semaphore(max(1, concurrency))
                async with serving.openai_client(base_url, timeout, "--judge-base-url") as client:
                    return await asyncio.gather(*[ask(client, sem, it) for it in chunk])

            return asyncio.run(ask_all())

        fp = evaluation.fingerprint(fps[a], fps[b], model, seed)
        rows = evaluation.cached(
            verdicts_path(cache_dir, a, b), fp, items, compute, 4 * concurrency, f"judge {a} vs {b}"
        )
        valid = [r for r in rows if r["winner"]]
        results[f"{a}_vs_{b}"] = {
            "a": a,
            "b": b,
            "n": len(valid),
            "invalid": len(rows) - len(valid),
            **{
                k: evaluation.bootstrap([(float(r["winner"] == w), 1) for r in valid] or [(0, 0)], seed=seed)
                for k, w in (("win", a), ("tie", "tie"), ("loss", b))
            },
            "a_shown_first": sum(r["shown_first"] == a for r in rows),
            "order": {r["id"]: r["shown_first"] for r in rows},
        }
    return results


def verdicts_path(cache_dir: Path, a: str, b: str) -> Path:
    return cache_dir / f"judge.{a}_vs_{b}.jsonl"


def cached_verdicts(cache_dir: Path, a: str, b: str, records) -> list[dict]:
    """The verdicts judge_pairs cached for the pair A:B, one per record in their order ("winner": A, B, "tie", or None
    where the reply was invalid): what evaluation/alpaca_lc.py turns into AlpacaEval's annotations."""
    rows = {r["id"]: r for r in common.read_jsonl(verdicts_path(cache_dir, a, b))}
    return [rows[r["id"]] for r in records]
