"""01 --annotator openai and its flags (--base-url, --model, --timeout, --max-retries, --backoff-*, --max-tokens,
--critic-temperature, --price-*): the critic behind any OpenAI-compatible chat endpoint (OpenAI, vLLM, llama.cpp,
transformers serve), the key read from OPENAI_API_KEY only, never written to a log or a file (infra.serving.redact).

annotate_openai runs min(--concurrency, records) workers, each taking the next record in input order and asking
01's critique_served for its output line; that sends the critic's requests through chat. Retries are explicit and
tested, the SDK's own are off: 408, 409, 429, 5xx and connection errors are sent again (infra.serving.retry_delay:
the server's Retry-After, cut to --backoff-max, else a backoff from --backoff-base doubling per retry, with jitter),
up to --max-retries times. A timeout (--timeout) is never retried: the server may still be generating that request
(README "Use a local server"), so a retry would queue the same work twice; its record fails, and 01 --retry-failed
redoes it. A record that cannot be annotated fails alone (RecordError); 401, 403 and 404 stop the run
(FatalAPIError), as does the same 4xx on each of the first FATAL_REPEATS records with none annotated: every record
would get it.

The summary's cost estimate (prices_usd): --price-input and --price-output, USD per 1M prompt and completion tokens;
without them, gpt-4o's list price (GPT4O_PRICES, the paper's critic) at OpenAI's endpoint with --model gpt-4o, and
no estimate for any other model or endpoint, a local server's above all.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from infra import serving

GPT4O_PRICES = (2.50, 10.0)  # USD per 1M prompt and completion tokens: OpenAI's list price of gpt-4o (the paper's)


def add_args(p) -> None:
    g = p.add_argument_group("an OpenAI-compatible critic: --annotator openai (annotation/annotator.py)")
    g.add_argument(
        "--base-url", default=None, help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 (default: OpenAI)"
    )
    g.add_argument("--model", default="gpt-4o", help="critic model name at the endpoint")
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds before a request is abandoned (not retried: the record fails)",
    )
    g.add_argument(
        "--max-retries", type=int, default=6, help="retries per request on 408/409/429/5xx and connection errors"
    )
    g.add_argument(
        "--backoff-base", type=float, default=1.0, help="first backoff in seconds; doubles per retry, with jitter"
    )
    g.add_argument(
        "--backoff-max",
        type=float,
        default=60.0,
        help="longest wait before a retry in seconds (a longer Retry-After too)",
    )
    g.add_argument(
        "--max-tokens", type=int, default=1024, help="completion token limit per request (0: the server's default)"
    )
    g.add_argument("--critic-temperature", type=float, default=0.0, help="critic sampling temperature")
    g.add_argument(
        "--price-input",
        type=float,
        default=None,
        help="USD per 1M prompt tokens, for the cost estimate "
        f"(default: gpt-4o's {GPT4O_PRICES[0]} at OpenAI with --model gpt-4o; else none)",
    )
    g.add_argument(
        "--price-output",
        type=float,
        default=None,
        help="USD per 1M completion tokens, for the cost "
        f"estimate (default: gpt-4o's {GPT4O_PRICES[1]}, as --price-input)",
    )


def prices_usd(args) -> tuple[float, float] | None:
    """(input, output) USD per 1M tokens for the cost estimate: the ones given, else gpt-4o's at OpenAI's endpoint;
    None (no estimate) for any other model or endpoint, a local server's above all."""
    if args.price_input is not None or args.price_output is not None:
        return args.price_input or 0.0, args.price_output or 0.0
    return GPT4O_PRICES if args.base_url is None and args.model == "gpt-4o" else None


class RecordError(Exception):
    """This record cannot be annotated (retries exhausted, a timeout, or a 4xx that retrying cannot fix): failed."""


class FatalAPIError(Exception):
    """Every request would fail the same way (bad key, no such model or endpoint): stop the run."""


FATAL_REPEATS = 5  # the same 4xx for the first this many records, none ok: every record would get it (FatalAPIError)


def sampling(args) -> dict:
    """The parameters every critic request carries (the preflight, infra.serving.check_server, sends the same)."""
    return {"temperature": args.critic_temperature, **({"max_tokens": args.max_tokens} if args.max_tokens else {})}


async def chat(client, messages: list[dict], args, usage: Counter, rng: random.Random) -> str:
    """The critic's reply, sent again on 408/409/429/5xx and connection errors (infra.serving.retry_delay: Retry-After,
    else backoff with jitter), never on a timeout. 401/403/404: FatalAPIError; any other failure: RecordError."""
    import openai
    from openai.types.chat import ChatCompletion

    body = {"model": args.model, "messages": messages, **sampling(args)}
    try:
        # client.post, not client.chat.completions.create: the same request and typed response, minus the SDK's
        # per-request TypedDict transform (~2 ms of CPU here), which would cap throughput at 16 requests in flight
        resp = await serving.send_with_retries(
            lambda: client.post("/chat/completions", body=body, cast_to=ChatCompletion),
            args.max_retries,
            rng,
            args.backoff_base,
            args.backoff_max,
        )
    except openai.APIStatusError as e:
        if e.status_code in (401, 403, 404):
            raise FatalAPIError(f"--base-url {args.base_url or 'OpenAI'}: {serving.api_error(e)}") from None
        raise RecordError(serving.api_error(e)) from None
    except openai.APIError as e:  # connection errors and timeouts
        raise RecordError(serving.api_error(e)) from None
    if resp.usage is not None:
        usage["prompt_tokens"] += resp.usage.prompt_tokens or 0
        usage["completion_tokens"] += resp.usage.completion_tokens or 0
    return serving.redact(resp.choices[0].message.content or "") if resp.choices else ""  # a server may echo the key


async def annotate_openai(todo: list[dict], args, sink, critique) -> None:
    """Each record of `todo` through the served critic, passed to sink as soon as it is done. critique(rec, ask) ->
    the record's output line (01's critique_served), where `await ask(messages, usage)` is the critic's reply (chat,
    on this run's client). FatalAPIError stops the run."""
    client = serving.openai_client(args.base_url, args.timeout)  # no SDK retries: ours (chat) are explicit and tested
    rng, queue = random.Random(args.seed), list(reversed(todo))

    def ask(messages: list[dict], usage: Counter):
        return chat(client, messages, args, usage, rng)

    seen = Counter()  # outcomes so far: "ok", or a 4xx's reason

    async def worker():
        while queue:
            rec = await critique(queue.pop(), ask)
            sink(rec)
            seen[rec["status"] if rec["status"] == "ok" else rec.get("reason", "")] += 1
            reason = rec.get("reason", "")
            if reason.startswith("HTTP 4") and not seen["ok"] and seen[reason] >= FATAL_REPEATS:
                raise FatalAPIError(
                    f"--base-url {args.base_url or 'OpenAI'}: the first {FATAL_REPEATS} records all got {reason}"
                )

    try:
        await asyncio.gather(*[worker() for _ in range(max(1, min(args.concurrency, len(todo))))])
    finally:
        await client.close()
