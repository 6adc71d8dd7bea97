"""03 --critic openai (and its --critic-* flags): stage 3's critics beside the learned one: the check before any
training (check_critic: a served critic answers, a plug-in imports and returns the right shape), a reward model behind
an OpenAI-compatible server (served_critic: 03 --critic openai and its --critic-* flags) and the demo's exact monitor
(make_monitor). 03's make_critic dispatches here; the function critics (--critic program, python:...) are
tasks/plugin.py's, the scalar baselines (--critic scalar-rm, prm) baselines/scalar_rm.py's.

--critic openai asks the served model for critique + spans of each (prompt, response): --critic-api chat sends one
user message (the server applies the chat template); completions sends the exact text of the reward model's input
(common.build_rm_prompt, with --reward-model's tokenizer if given, else the plain template), less a leading BOS the
server adds itself. With --reward-model, either API cuts the task prompt as stage 2 cut it (reward_model.json).
A request that times out (--critic-timeout) is not retried, since the server may still be generating it; 408, 409,
429, 5xx and connection errors are retried --critic-retries times (backoff with jitter, the server's Retry-After).
A critique that fails either way gives its rollout delta = 0, counted in critic/parse_fail_rate.
"""
from __future__ import annotations

import common
from infra import reward_models, serving
from tasks import plugin
from tasks.data import read_prompts


def add_args(p) -> None:
    g = p.add_argument_group("a served critic: --critic openai (infra/critics.py)")
    g.add_argument("--critic-base-url", help="OpenAI-compatible endpoint for --critic openai (vLLM, Ollama, OpenAI)")
    g.add_argument("--critic-model", default="gpt-4o", help="model name at that endpoint")
    g.add_argument("--critic-api", default="chat", choices=["chat", "completions"], help="chat: one user message; "
                   "completions: the reward model's exact input text")
    g.add_argument("--critic-concurrency", type=int, default=32, help="parallel requests for --critic openai")
    g.add_argument("--critic-timeout", type=float, default=300.0, help="seconds before a critique request is abandoned "
                   "(not retried: delta = 0)")
    g.add_argument("--critic-retries", type=int, default=2, help="retries on 408/409/429/5xx and connection errors")


def check_critic(args) -> None:
    """--critic openai: one cheap request to the served critic before any training, so that a wrong model name, a
    dead port, a 4xx or a missing key stops the run here in one line (infra.serving.check_server). --critic program or
    python:...: the function is imported and called on the first prompt (tasks/plugin.py: preflight), so that a
    module that does not import, a missing function or a wrong return stops it here in one line too. First of all,
    a reward model that cannot be used (--critic local, or openai with --reward-model: check_reward_model)."""
    if args.critic == "local" or (args.critic == "openai" and args.reward_model):
        reward_models.check_reward_model(args.reward_model)
    if args.critic == "program" or plugin.is_plugin(args.critic):
        fn, label = plugin.load_critic(args.critic, args.task, "--critic")
        rec = read_prompts(args.prompts, args.task, args.critic)[0]
        item = plugin.preflight(fn, label, rec, plugin.probe_response(rec), "--critic")
        if ("spans" in item or "step_rewards" in item) and (args.labels != "spans" or args.span_weighting != "uniform"):
            raise common.DataError(f"--critic {label} returns " + ("located intervals with their own rewards" if "spans"
                                   in item else "a score") + ": --labels dense and --span-weighting relabel quotes")
    if args.critic == "openai":
        serving.check_server(args.critic_base_url, args.critic_model, args.critic_api, args.critic_timeout,
                            args.critic_retries, "--critic-base-url",
                            {"temperature": 0.0, "max_tokens": args.critic_max_new_tokens})  # as the critic sends


def parsed(raw):
    """parse_feedback's dict for the critic's output `raw`; for one that does not parse, or a request that failed (an
    exception), a failed critique (03's critique_failed): delta = 0 for this rollout, counted in critic/parse_fail_rate,
    with the error and the critic's text kept for samples.jsonl."""
    failed = lambda error, output: {"critique": None, "good_spans": [], "poor_spans": [],  # noqa: E731
                                    "critic_error": error, "critic_output": output}
    if isinstance(raw, Exception):
        return failed(serving.api_error(raw), None)
    try:
        return common.parse_feedback(raw)
    except ValueError as e:
        return failed(str(e), raw[:4000])


def served_critic(args):
    """critic(records, texts) -> the served reward model's raw text per rollout, or the exception of a request that
    failed (serving.rm_critique_served). With --reward-model (a stage-2 output, checked before any training), its
    tokenizer cuts the task prompt as training did, for either API."""
    rm_tok = None
    if args.reward_model:
        from transformers import AutoTokenizer
        rm_tok = AutoTokenizer.from_pretrained(args.reward_model)
    return lambda recs, texts: serving.rm_critique_served(
        [r["prompt"] for r in recs], texts, args.critic_base_url, args.critic_model, args.critic_max_new_tokens,
        args.critic_concurrency, args.critic_api, rm_tok, args.critic_max_prompt_tokens, args.critic_rm_format,
        args.critic_timeout, args.critic_retries)


def make_monitor(args):
    """monitor(records, texts, offsets, deltas) -> {metric: this rank's sum over its rollouts}, logged next to the
    critic's metrics and never trained on; or None. The demo has one: its exact critic on the same rollouts
    (tasks.demo.demo_monitor), the reward-hacking monitor that 04's curves draw dashed. deltas, step 3's (delta,
    unmatched) per rollout, are reused when the critic is that very one (--critic program, --labels spans)."""
    if args.task != "demo":
        return None
    from tasks.demo import demo_monitor
    reuse = args.critic == "program" and args.labels == "spans"  # dense labels are not the exact critic's delta
    return lambda recs, texts, offsets, deltas: demo_monitor(recs, texts, offsets, deltas if reuse else None)
