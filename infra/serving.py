"""--base-url, --critic-base-url, --judge-base-url: OpenAI-compatible servers (01 --annotator openai, 03 --critic
openai, 04's judge). The server's own error text (api_error), one retry policy (retry_delay, send_with_retries), one
cheap request before any work (check_server). A served reward model's critiques: critics/learned.py.
"""

from __future__ import annotations

import json
import os

import common


PREFLIGHT = "Reply with OK."  # the one-token request check_server sends


def redact(text: str) -> str:
    """`text` without the API key: errors may echo request headers, and keys never reach logs or files."""
    key = os.environ.get("OPENAI_API_KEY", "")
    return text.replace(key, "[redacted]") if len(key) >= 4 else text


def api_error(e: Exception) -> str:
    """A failed request as one line, with the server's own words: "HTTP 400: Server is pinned to ...". The openai
    SDK's str(e) keeps only OpenAI's {"error": {"message"}} and drops every other layout (FastAPI's {"detail"},
    transformers serve's among them); the text is in e.body, else e.response.text. Timeouts and connection errors
    name themselves; notes added to the exception (send_with_retries: the attempts) follow after "; "."""
    import openai

    if isinstance(e, openai.APIStatusError):
        body = e.body if e.body is not None else e.response.text
        if isinstance(body, dict):
            body = next((body[k] for k in ("message", "detail", "error") if body.get(k)), body)
        text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, default=str)
        line = f"HTTP {e.status_code}: {' '.join(text.split()) or e.response.reason_phrase}"
    elif isinstance(e, openai.APITimeoutError):
        line = "timed out"
    elif isinstance(e, openai.APIConnectionError):
        line = f"cannot connect ({common.first_line(e.__cause__) if e.__cause__ else common.first_line(e)})"
    else:
        line = f"{type(e).__name__}: {common.first_line(e)}"
    return redact("; ".join([line[:500], *getattr(e, "__notes__", [])]))


def backoff_delay(attempt: int, retry_after: float | None, base: float, cap: float, rng) -> float:
    """Wait before retry number attempt+1: the server's Retry-After, at most `cap` (a server asking for an hour must
    not stall a worker an hour; send_with_retries says so in the error), +0-10% so workers do not return in
    lockstep; else exponential backoff with equal jitter, min(cap, base * 2^attempt) * U[0.5, 1]."""
    if retry_after is not None:
        return min(retry_after, cap) * (1 + 0.1 * rng.random())
    d = min(cap, base * 2**attempt)
    return d / 2 + rng.uniform(0, d / 2)


def retry_after_s(headers) -> float | None:
    """Seconds a 429/503 asks us to wait: Retry-After-Ms, Retry-After in seconds, or Retry-After as an HTTP date."""
    import email.utils
    import time

    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return max(0.0, float(headers.get(name)) * scale)
        except (TypeError, ValueError):
            pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(headers.get("retry-after")).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def retry_delay(e: Exception, attempt: int, retries: int, rng, base: float = 1.0, cap: float = 60.0) -> float | None:
    """Seconds to wait before sending a failed request again, or None: give up. Retried up to `retries` times:
    408, 409, 429 and 5xx (after the server's Retry-After, else backoff_delay) and connection errors. Never another
    4xx (the same request fails the same way) and never a timeout: a server keeps generating a request whose client
    has gone (transformers serve does, measured), so a retry would queue the same work twice, exactly when the server
    is slowest. A timed-out request fails; 01 --retry-failed redoes it later."""
    import openai

    if attempt >= retries or isinstance(e, openai.APITimeoutError):
        return None
    if isinstance(e, openai.APIStatusError):
        if e.status_code not in (408, 409, 429) and e.status_code < 500:
            return None
        return backoff_delay(attempt, retry_after_s(getattr(e.response, "headers", None)), base, cap, rng)
    return backoff_delay(attempt, None, base, cap, rng) if isinstance(e, openai.APIConnectionError) else None


async def send_with_retries(send, retries: int, rng=None, base: float = 1.0, cap: float = 60.0):
    """await send() (one OpenAI-compatible request), sent again while retry_delay allows; the last error is raised
    with a note of the attempts it took, and of a Retry-After longer than `cap` that was cut to it (api_error shows
    them)."""
    import asyncio
    import random

    import openai

    attempt, capped = 0, None
    while True:
        try:
            return await send()
        except openai.APIError as e:
            wait = retry_delay(e, attempt, retries, rng or random, base, cap)
            asked = retry_after_s(getattr(getattr(e, "response", None), "headers", None))
            if wait is not None and asked is not None and asked > cap:
                capped = asked
            if wait is None:
                if capped is not None:
                    e.add_note(f"the server's Retry-After ({capped:g} s) was capped at {cap:g} s")
                if attempt:
                    e.add_note(f"gave up after {attempt + 1} attempts")
                elif isinstance(e, openai.APITimeoutError):
                    e.add_note("not retried: the server may still be generating it")
                raise
            await asyncio.sleep(wait)
            attempt += 1


def openai_client(base_url: str | None, timeout: float, flag: str = "--base-url"):
    """An AsyncOpenAI client for `base_url` (None: OpenAI), the key from OPENAI_API_KEY only (a local server needs
    none), its own retries off (send_with_retries is ours). DataError when OpenAI itself is meant and there is no
    key."""
    from openai import AsyncOpenAI

    key = os.environ.get("OPENAI_API_KEY")
    if not key and base_url is None:
        raise common.DataError(
            f"OPENAI_API_KEY is not set (the key is read from the environment only), and no {flag} "
            "names another endpoint"
        )
    return AsyncOpenAI(base_url=base_url, api_key=key or "EMPTY", timeout=timeout, max_retries=0)


def check_server(
    base_url: str | None,
    model: str,
    api: str = "chat",
    timeout: float = 120.0,
    retries: int = 2,
    flag: str = "--base-url",
    params: dict | None = None,
) -> None:
    """One cheap request (PREFLIGHT) to the endpoint and model a stage is about to use, through the API it will use
    and with the parameters its own requests carry (`params`: temperature, max_tokens if it sends one; default
    greedy with a budget), before it spends any compute: an endpoint that refuses a parameter refuses it here. Only
    max_tokens' value differs: 1, to stay cheap. DataError, one line with the server's own words, for a wrong model
    name, a dead port, a 4xx (a missing or bad key: 401), or a timeout. 429 and 5xx are retried as any request
    (retry_delay)."""
    import asyncio

    params = {"temperature": 0.0, "max_tokens": 1} if params is None else dict(params)
    if "max_tokens" in params:
        params["max_tokens"] = 1

    async def ping():
        async with openai_client(base_url, timeout, flag) as client:
            if api == "completions":
                return await send_with_retries(
                    lambda: client.completions.create(model=model, prompt=PREFLIGHT, **params), retries
                )
            return await send_with_retries(
                lambda: client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PREFLIGHT}], **params
                ),
                retries,
            )

    import openai

    try:
        asyncio.run(ping())
    except openai.APIError as e:
        where = f"{flag} {base_url or 'https://api.openai.com/v1'} (model {model!r}, {api} API)"
        hint = (
            " (OPENAI_API_KEY is not set)"
            if getattr(e, "status_code", None) == 401 and not os.environ.get("OPENAI_API_KEY")
            else ""
        )
        raise common.DataError(f"{where}: {api_error(e)}{hint}") from None


class NoChoices(Exception):
    """A 200 reply with an empty `choices` list (a server that filtered its output): no text to use."""

    def __init__(self):
        super().__init__("HTTP 200 with no choices: the server returned no completion")
