"""03 --rollout-server URL: the policy's rollouts sampled by a vLLM server that the user started (issue 69), the way
TRL's GRPO runs `vllm serve` beside its trainer. Every iteration:

1. push_adapter: the policy's LoRA adapter is saved to a NEW folder (adapters/step-000007) and loaded under one name
   (LORA_NAME, load_inplace) through POST /v1/load_lora_adapter (~20-40 ms on a CPU). A new folder, because vLLM's
   prefix cache is keyed by the adapter's name and path, never its weights: an adapter saved over the last one's
   folder is served from the old weights' cached blocks for every prompt of >= one block (128 tokens on a CPU);
2. check_fresh: a fixed probe prompt longer than a block is sampled again under the new adapter and the served log-probs
   of the 20 likeliest tokens at each of its positions are compared with the trainer's own: a server that still
   answers from an old policy (the trap above, an adapter it ignores as in unsloth PR #8701, another model) stops
   the run in one line instead of training on rollouts of the wrong policy;
3. sample: the rollouts, through the official openai client's completions API with the prompts as token ids, every
   sampling setting sent (nothing left to the server's or the hub's defaults), the sampled token ids
   (return_token_ids) and each one's log-prob under the distribution sampled from (logprobs=0: the sampled token's
   alone; the server runs with --logprobs-mode processed_logprobs, so after temperature): the behaviour log-probs
   mu(y_t | x, y_<t) that infra/mismatch.py corrects for. as_tensors lays them out as 03's rollout() does.

03 calls three functions: add_args / check_args (the flags), open_server (None in-process) and served_rollouts (step 1
on the server: push, check, sample); the importance weights of infra/mismatch.py then enter 03's ppo_update as
Rollouts.weights and Rollouts.keep, and infra/trace.py logs the mismatch every iteration.

The server needs, at start (tests/vllm_server.py starts one so):
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL --enable-lora --max-lora-rank R \\
        --logprobs-mode processed_logprobs [--dtype float32]
with R >= 03's --lora-r (vLLM takes 1, 8, 16, 32, 64, 128, 256, 320 or 512) and MODEL the policy's base model (the
folder 03 starts from). Failures are one line (common.DataError): a dead server, a refused adapter, a stale one.
Full fine-tuning would push the weights themselves (vLLM's weight-update RPCs), which this client does not do.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import common
from infra import mismatch, serving

LORA_NAME = "policy"  # the one name every iteration's adapter is loaded under
PROBE_TOKENS = 160  # the probe prompt's length: a full block of vLLM's prefix cache on a CPU (128 tokens; 16 on GPUs)
PROBE_NEW_TOKENS = 8  # its response, always this long (EOS ignored: stopping is no part of the check)
PROBE_TOP = 20  # the probe compares the log-probs of this many most likely tokens (vLLM's --max-logprobs: 20)


@dataclass
class Rollout:
    ids: list[int]  # the response's token ids, up to and including the first stop id
    logprobs: list[float]  # the behaviour log-prob of each, log mu(y_t | x, y_<t)
    has_eos: bool  # it ended at a stop id (not at max_tokens)


@dataclass
class Server:
    url: str  # the endpoint, ".../v1"
    adapters: Path  # the folder that gets one adapter folder per iteration
    client: object  # an openai.OpenAI client
    probe: list[int]  # the probe prompt's token ids (probe_prompt)
    last_probe: tuple | None = None  # the probe as served at the last check: (ids, top log-probs per position)
    folder: Path | None = None  # the adapter folder loaded last
    tol: float = 1e-3  # check_fresh's tolerance in nats (--rollout-tol)
    pushes: int = 0  # the number of the last adapter folder (a resumed run continues after it: never a reused path)
    fresh: float | None = None  # check_fresh's last largest difference (nats): mismatch/probe_diff, every iteration


def fail(server_or_url, what: str, e: Exception | None = None):
    """The one line of a failure (DataError). A server that stops answering mid-run (a Server: connected before) is
    said so, with where the run stands and the command that continues it once the server is back, as Ctrl-C says."""
    import openai

    url = server_or_url.url if isinstance(server_or_url, Server) else server_or_url
    if isinstance(server_or_url, Server) and isinstance(e, openai.APIConnectionError):
        from infra import runs

        why = f"the server stopped answering ({what}: {serving.api_error(e)})"
        return common.DataError(f"--rollout-server {url}: {why}; restart it; the run stopped {runs.where_it_stands()}")
    return common.DataError(f"--rollout-server {url}: {what}" + (f": {serving.api_error(e)}" if e else ""))


def probe_prompt(queries: list[list[int]], length: int = PROBE_TOKENS) -> list[int]:
    """A fixed prompt of `length` token ids, the training prompts' ids one after another (cycled): long enough that
    vLLM caches its first blocks, so that a stale prefix cache shows in the probe as it would in the rollouts."""
    flat = [t for q in queries for t in q]
    if not flat:
        raise common.DataError("--rollout-server: no prompt tokens to build the probe from")
    return (flat * (length // len(flat) + 1))[:length]


def connect(url: str, adapters_dir, probe: list[int], timeout: float = 600.0) -> Server:
    """A Server for `url` once /v1/models answers (DataError: cannot connect, HTTP ...); nothing is written
    (push_adapter makes `adapters_dir`). `timeout` is per request (a batch of rollouts on a CPU takes minutes)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="EMPTY", timeout=timeout, max_retries=0)
    try:
        client.models.list()
    except openai.APIError as e:
        raise fail(url, "the server does not answer", e) from None
    pushed = [int(f.name.split("-")[1]) for f in Path(adapters_dir).glob("step-*") if f.name.split("-")[1].isdigit()]
    return Server(url, Path(adapters_dir), client, list(probe), pushes=max(pushed, default=0))


def push_adapter(server: Server, model, step: int, keep: int = 2) -> float:
    """Save the peft model's adapter ("default") to a new folder adapters/step-{step:06d} and load it under LORA_NAME
    in place; the seconds the load took. Folders older than the last `keep` are removed (vLLM has read them)."""
    import openai

    if not hasattr(model, "peft_config"):
        raise fail(
            server,
            "the policy has no LoRA adapter to push (full fine-tuning pushes weights, which this client "
            "does not do): use --lora-r > 0",
        )
    folder = server.adapters / f"step-{step:06d}"
    shutil.rmtree(folder, ignore_errors=True)  # a resumed run's half-written folder: a fresh save, never a mix
    server.adapters.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, selected_adapters=["default"])
    start = time.perf_counter()
    try:
        server.client.post(
            "/load_lora_adapter",
            cast_to=str,
            body={"lora_name": LORA_NAME, "lora_path": str(folder.resolve()), "load_inplace": True},
        )
    except openai.APIError as e:
        dead = isinstance(e, openai.APIConnectionError)  # not refused: gone (fail says so, with the --resume line)
        raise fail(
            server, f"loading the adapter {folder}" if dead else f"the adapter {folder} was refused", e
        ) from None
    seconds = time.perf_counter() - start
    server.folder = folder
    old = sorted(p for p in server.adapters.glob("step-*") if p.is_dir() and p != folder)
    for p in old[: max(len(old) - keep + 1, 0)]:
        shutil.rmtree(p, ignore_errors=True)
    return seconds


def _complete(
    server: Server,
    prompts: list[list[int]],
    temperature: float,
    max_tokens: int,
    stop_ids: list[int],
    min_tokens: int = 0,
    n: int = 1,
    seed: int | None = None,
    top: int = 0,
    top_p: float = 1.0,
    ignore_eos: bool = False,
    model: str = LORA_NAME,
) -> list:
    """The choices of one completions request, in order, each with its token ids and, per token, the sampled one's
    log-prob and the `top` most likely ones' (keyed "token_id:ID")."""
    import openai

    try:
        reply = server.client.completions.create(
            model=model,
            prompt=prompts,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=top,
            seed=seed,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            extra_body={
                "top_k": -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "min_tokens": min_tokens,
                "stop_token_ids": list(stop_ids),
                "ignore_eos": ignore_eos,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
        )
    except openai.APIError as e:
        raise fail(server, f"sampling {len(prompts)} x {n} rollouts failed", e) from None
    choices = sorted(reply.choices, key=lambda c: c.index)
    for c in choices:
        lps = c.logprobs and c.logprobs.token_logprobs
        if getattr(c, "token_ids", None) is None or lps is None or len(c.token_ids) != len(lps) or None in lps:
            raise fail(
                server,
                "a rollout came back without its token ids and their log-probs (not a vLLM server "
                "that takes return_token_ids?)",
            )
    if len(choices) != len(prompts) * n:
        raise fail(server, f"{len(choices)} rollouts came back for {len(prompts)} x {n}")
    return choices


def sample(
    server: Server,
    prompts: list[list[int]],
    temperature: float,
    max_tokens: int,
    stop_ids: list[int],
    min_tokens: int = 0,
    n: int = 1,
    seed: int | None = None,
    top_p: float = 1.0,
    model: str = LORA_NAME,
) -> list[Rollout]:
    """n rollouts of each prompt (token ids), in order (prompt 0's n, then prompt 1's, ...), from one request:
    temperature sampling (top_k off, no penalties; greedy at temperature 0; top_p as 03's --top-p, whose behaviour
    log-probs are then the nucleus's, which 03's scoring of the full distribution does not match), stopping at any
    of stop_ids (03's: every EOS) after at least min_tokens. Each response is cut after its first stop id, which it
    keeps (as 03 does). With a seed, identical prompts of one request get identical samples: leave it None."""
    out, stop = [], set(stop_ids)
    for c in _complete(
        server, prompts, temperature, max_tokens, stop_ids, min_tokens, n, seed, top_p=top_p, model=model
    ):
        ids = list(c.token_ids)
        cut = next((k + 1 for k, t in enumerate(ids) if t in stop), None)
        out.append(Rollout(ids[:cut], [float(x) for x in c.logprobs.token_logprobs[:cut]], cut is not None))
    return out


def as_tensors(rollouts: list[Rollout], pad_id: int, device="cpu") -> dict:
    """03's rollout() layout: response (B, T) right-padded with pad_id, mask (B, T) 1.0 on each response (its stop
    id included), has_eos (B,), and behaviour_logprobs (B, T), 0.0 on padding."""
    import torch

    width = max(max(len(r.ids) for r in rollouts), 1)
    response = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    mask, blp = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
    for i, r in enumerate(rollouts):
        response[i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
        mask[i, : len(r.ids)] = 1.0
        blp[i, : len(r.ids)] = torch.tensor(r.logprobs)
    has_eos = torch.tensor([r.has_eos for r in rollouts])
    return {
        "response": response.to(device),
        "mask": mask.to(device),
        "has_eos": has_eos.to(device),
        "behaviour_logprobs": blp.to(device),
    }


def check_fresh(server: Server, score, temperature: float, tol: float = 1e-3) -> float:
    """Sample the probe under the adapter loaded last, with the PROBE_TOP most likely tokens' log-probs at each of its
    positions, and compare them with the trainer's: score(prompt_ids, response_ids) -> (T, V) log-probs of each
    response position (03's forward: log_softmax(logits / temperature)). The top tokens, not only the sampled one:
    a confident token's log-prob is ~0 under any nearby policy, the unlikely ones' move with the weights (a stale
    prefix cache moved them by 0.2-1.8 nats here, the sampled token's by 1e-4-9e-3). Returns the largest difference;
    DataError when it exceeds `tol` nats, saying when the served numbers are the previous check's own (the server
    did not move with the adapter). A float32 server agrees to ~5e-5 here; a bfloat16 one needs a larger tol."""
    choice = _complete(
        server, [server.probe], temperature, PROBE_NEW_TOKENS, [], seed=0, top=PROBE_TOP, ignore_eos=True
    )[0]
    served = [{int(k.split(":")[1]): v for k, v in top.items()} for top in choice.logprobs.top_logprobs]
    trainer = score(server.probe, list(choice.token_ids))
    diff = max((abs(float(trainer[t][i]) - v) for t, top in enumerate(served) for i, v in top.items()), default=0.0)
    last, server.last_probe = server.last_probe, (list(choice.token_ids), served)
    server.fresh = diff
    if diff > tol:
        raise fail(
            server,
            f"the served policy is stale: after loading {server.folder}, a probe's log-probs differ "
            f"from the trainer's by up to {diff:.3g} nats (tolerance {tol:g})"
            + ("; they are the previous adapter's, unchanged" if last == server.last_probe else "")
            + ": the server is not sampling from this policy (an adapter folder reused under prefix caching, "
            "an adapter it ignores, another base model, or a lower precision: then raise the tolerance)",
        )
    return diff


# ----------------------------------------------------------------------------------------------------------------------
# 03's side: the flags, the server, and step 1 on it
# ----------------------------------------------------------------------------------------------------------------------


def add_args(p):
    g = p.add_argument_group("rollouts on a vLLM server (infra/vllm_rollouts.py, docs/scaling.md)")
    g.add_argument("--rollout-server", help="sample the rollouts on this vLLM server (URL .../v1; LoRA only)")
    g.add_argument(
        "--rollout-is-mode", default="sequence_mask", choices=mismatch.MODES, help="the mismatch's correction"
    )
    g.add_argument("--rollout-is-cap", type=float, default=3.0, help="its cap on rho = pi_old / mu")
    g.add_argument("--rollout-tol", type=float, default=1e-3, help="the stale-adapter check's tolerance (nats)")
    g.add_argument("--rollout-timeout", type=float, default=600.0, help="seconds per request to the server")


def check_args(args, world: int):
    """One line (DataError) for what a rollout server cannot do, before anything is loaded."""
    if not args.rollout_server:
        return
    for flag, ok, rule in (
        ("--lora-r", args.lora_r > 0, "> 0: the server gets the policy's LoRA adapter (full FT would push weights)"),
        ("--rollout-is-cap", args.rollout_is_cap > 0, "> 0"),
        ("--rollout-tol", args.rollout_tol > 0, "> 0"),
        ("--rollout-timeout", args.rollout_timeout > 0, "> 0"),
        ("--rollout-server", world == 1, "one process (torchrun's ranks would push one adapter each)"),
    ):
        if not ok:
            raise common.DataError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: must be {rule}")


def open_server(args, queries: list[list[int]], out_dir) -> Server | None:
    """None without --rollout-server; else the server, once it answers (adapters go to OUT_DIR/adapters)."""
    if not args.rollout_server:
        return None
    server = connect(args.rollout_server, Path(out_dir) / "adapters", probe_prompt(queries), args.rollout_timeout)
    server.tol = args.rollout_tol
    return server


def trainer_logprobs(model, temperature: float):
    """check_fresh's score: (prompt ids, response ids) -> (T, V) log_softmax(logits / T) of the policy now."""
    import torch

    def score(prompt: list[int], response: list[int]):
        ids = torch.tensor([prompt + response], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits / temperature, -1)

    return score


def served_rollouts(server: Server, model, queries: list[list[int]], gen_config, stop, pad_id: int):
    """Step 1 on the server: the policy's adapter pushed to a new folder, the server checked to sample from it, then
    one rollout per query, sampled with 03's settings (gen_config; stop: every EOS). Returns (response (B, T),
    padded with pad_id after each one's first stop id, and mu's log-probs (B, T), 0.0 on padding), on stop's device."""
    server.pushes += 1
    push_adapter(server, model, server.pushes)
    model.eval()
    check_fresh(server, trainer_logprobs(model, gen_config.temperature), gen_config.temperature, server.tol)
    rollouts = sample(
        server,
        queries,
        gen_config.temperature,
        gen_config.max_new_tokens,
        [int(t) for t in stop],
        gen_config.min_new_tokens or 0,
        top_p=gen_config.top_p if gen_config.top_p is not None else 1.0,
    )
    t = as_tensors(rollouts, pad_id, stop.device)
    return t["response"], t["behaviour_logprobs"]
