"""03 --critic local and openai (its --critic-* flags): the learned critic, the stage-2 reward model writing its
critique and span JSON (§3.4), greedily, in this process (local_critic: rm_critique, also stage 2's evaluation and
stage 4's critiques) or behind an OpenAI-compatible server (served_critic: rm_critique_served).

--critic openai asks the served model for critique + spans of each (prompt, response): --critic-api chat sends one
user message (the server applies the chat template); completions sends the exact text of the reward model's input
(common.build_rm_prompt, with --reward-model's tokenizer if given, else the plain template), less a leading BOS the
server adds itself. With --reward-model, either API cuts the task prompt as stage 2 cut it (reward_model.json).
A request that times out (--critic-timeout) is not retried, since the server may still be generating it; 408, 409,
429, 5xx and connection errors are retried --critic-retries times (backoff with jitter, the server's Retry-After).
A critique that fails either way gives its rollout delta = 0, counted in critic/parse_fail_rate (critics.parse).
"""

from __future__ import annotations

import common
from infra import decoding, models, reward_models, serving


def rm_critique(
    model,
    tokenizer,
    prompts: list[str],
    responses: list[str],
    max_new_tokens: int = 128,
    batch_size: int = 32,
    desc: str | None = None,
    max_prompt_tokens: int | None = None,
    rm_format: str = "critique+spans",
    compile: bool = False,
) -> list[str]:
    """The local reward model's raw critic output for each (prompt, response): batched greedy generation on rm_prompt
    (the task prompt cut from its start to fit max_prompt_tokens, as in training), in which a row stops as soon as
    its span JSON is complete (greedy_generate). The text is what plain greedy decoding up to a stop id gives whenever
    the model ends its output with that JSON, as it is trained to (format_rm_target, in its rm_format)."""
    inputs = [
        reward_models.rm_prompt(tokenizer, p, r, max_prompt_tokens, rm_format)[0] for p, r in zip(prompts, responses)
    ]
    ids = decoding.greedy_generate(
        model,
        tokenizer,
        inputs,
        max_new_tokens,
        batch_size=batch_size,
        desc=desc,
        stop=common.feedback_complete,
        compile=compile,
    )
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def local_critic(args):
    """03 --critic local: critic(records, texts) -> the stage-2 reward model's raw text per rollout (rm_critique,
    greedy, its input cut and its critique capped as stage 2 trained it; --compile-generation: static_decode)."""
    rm, rm_tok = models.load_model(args.reward_model, device=args.device, dtype=args.dtype)
    return lambda recs, texts: rm_critique(
        rm,
        rm_tok,
        [r["prompt"] for r in recs],
        texts,
        args.critic_max_new_tokens,
        max_prompt_tokens=args.critic_max_prompt_tokens,
        rm_format=args.critic_rm_format,
        compile=args.compile_generation,
    )


def served_critic(args):
    """03 --critic openai: critic(records, texts) -> the served reward model's raw text per rollout, or the exception
    of a request that failed (rm_critique_served). With --reward-model (a stage-2 output, checked before any
    training), its tokenizer cuts the task prompt as training did, for either API."""
    rm_tok = None
    if args.reward_model:
        from transformers import AutoTokenizer

        rm_tok = AutoTokenizer.from_pretrained(args.reward_model)
    return lambda recs, texts: rm_critique_served(
        [r["prompt"] for r in recs],
        texts,
        args.critic_base_url,
        args.critic_model,
        args.critic_max_new_tokens,
        args.critic_concurrency,
        args.critic_api,
        rm_tok,
        args.critic_max_prompt_tokens,
        args.critic_rm_format,
        args.critic_timeout,
        args.critic_retries,
    )


def rm_completions_prompt(
    tokenizer, prompt: str, response: str, max_prompt_tokens: int | None = None, rm_format: str = "critique+spans"
) -> str:
    """The text a served reward model gets on /v1/completions: rm_prompt's, as in training (tokenizer=None: the plain
    template). The server adds its BOS when it tokenizes, so a BOS the chat template wrote is left out: one, not two."""
    if tokenizer is None:
        return common.build_rm_prompt(None, prompt, response, rm_format)
    kept = reward_models.rm_prompt(tokenizer, prompt, response, max_prompt_tokens, rm_format)[1]
    text = common.build_rm_prompt(tokenizer, kept, response, rm_format)
    bos, adds_bos = tokenizer.bos_token, tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return text[len(bos) :] if bos and adds_bos and text.startswith(bos) else text


def rm_critique_served(
    prompts: list[str],
    responses: list[str],
    base_url: str | None,
    model: str,
    max_new_tokens: int,
    concurrency: int = 32,
    api: str = "chat",
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    rm_format: str = "critique+spans",
    timeout: float = 300.0,
    retries: int = 2,
) -> list:
    """rm_critique for a reward model behind an OpenAI-compatible endpoint (vLLM, Ollama, OpenAI): greedy, the whole
    batch in flight at once (up to `concurrency`). api "chat" sends rm_user_message as one user message (the server
    applies the chat template); "completions" sends rm_completions_prompt, the exact training text. Given the reward
    model's tokenizer, both cut the task prompt to max_prompt_tokens as training did (rm_prompt, rm_settings); both ask
    for rm_format's output (its instruction). Each request times out after `timeout` s and is retried as
    serving.retry_delay says. Each entry is the critic's text or, for a request that failed, its exception
    (openai.APIError; a reply without choices: serving.NoChoices): one failed critique never stops the batch."""
    import asyncio

    import openai

    async def ask(client, sem, prompt, response):
        async with sem:
            try:
                if api == "completions":
                    reply = await serving.send_with_retries(
                        lambda: client.completions.create(
                            model=model,
                            temperature=0.0,
                            max_tokens=max_new_tokens,
                            prompt=rm_completions_prompt(tokenizer, prompt, response, max_prompt_tokens, rm_format),
                        ),
                        retries,
                    )
                    return (reply.choices[0].text or "") if reply.choices else serving.NoChoices()
                if tokenizer is not None and max_prompt_tokens:  # the text the server's template makes, cut alike
                    prompt = reward_models.rm_prompt(tokenizer, prompt, response, max_prompt_tokens, rm_format)[1]
                reply = await serving.send_with_retries(
                    lambda: client.chat.completions.create(
                        model=model,
                        temperature=0.0,
                        max_tokens=max_new_tokens,
                        messages=[{"role": "user", "content": common.rm_user_message(prompt, response, rm_format)}],
                    ),
                    retries,
                )
                return (reply.choices[0].message.content or "") if reply.choices else serving.NoChoices()
            except openai.APIError as e:
                return e

    async def ask_all():
        sem = asyncio.Semaphore(concurrency)
        async with serving.openai_client(base_url, timeout, "--critic-base-url") as client:
            return await asyncio.gather(*[ask(client, sem, p, r) for p, r in zip(prompts, responses)])

    return asyncio.run(ask_all())
