"""Static-cache decoding (infra.decoding.static_decode, issue 37): generate()'s tokens, from the same random numbers, with a
static KV cache and the decode step under torch.compile; 03's --compile-generation rollouts scored as they were
sampled. The critic's greedy path and a whole PPO run against the recorded one are pinned in test_speed_pins.py."""

import pytest
import torch

from infra import decoding, models, runs
from tasks.demo import demo_dataset
from conftest import import_script

ppo = import_script("03_train_policy")


def test_prompt_bucket_pads_by_at_most_a_third():
    assert [decoding.prompt_bucket(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 65, 97, 129, 1000)] == [
        16,
        16,
        24,
        24,
        32,
        48,
        48,
        64,
        96,
        128,
        192,
        1024,
    ]
    assert all(n <= decoding.prompt_bucket(n) < max(16, n * 1.5) + 1 for n in range(1, 3000))


def _generate(model, ids, mask, config, seed, how):
    """(new ids, the next random number): model.generate's or generate_static's, from the same seed."""
    torch.manual_seed(seed)
    with torch.no_grad():
        if how == "generate":
            new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
        else:
            new = decoding.generate_static(model, ids, mask, config, compile=how == "compiled")
    return new, torch.rand(1).item()


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9, min_new_tokens=5),
    dict(temperature=1.6),
    dict(temperature=0.0),
]


def test_generate_static_gives_generates_tokens_and_random_stream(tiny_model_dir):
    """Ragged prompts (left padding, then padding to the bucket: 22 tokens -> 24), sampling at T = 1 and T != 1,
    top-p with min_new_tokens, greedy: eager and compiled static decoding give model.generate's tokens, and draw the
    same random numbers (the next draw after it agrees), so every later draw of a run (the next rollout, the
    minibatch order) is unchanged too."""
    model, tok = models.load_model(tiny_model_dir)
    prompts = [r["prompt"] for r in demo_dataset("eval", 12)] + ["post: it", "post: tom"]
    ids, mask = models.left_pad([models.encode_prompt(tok, p)[-22:] for p in prompts], tok.pad_token_id)
    assert decoding.prompt_bucket(ids.shape[1]) > ids.shape[1] and (mask == 0).any()
    stop = models.stop_ids(model) + list(range(100, 160))  # this untrained model seldom says EOS: more stop ids
    lengths = set()
    for seed, settings in enumerate(SETTINGS):
        config = models.generation_config(model, 20, **settings)
        config.eos_token_id = stop
        want, want_next = _generate(model, ids, mask, config, seed, "generate")
        for how in ("eager", "compiled"):
            got, got_next = _generate(model, ids, mask, config, seed, how)
            assert torch.equal(got, want), (settings, how)
            assert got_next == want_next, (settings, how)
        lengths |= {next((t for t, x in enumerate(row) if x in stop), None) for row in want.tolist()}
    assert len(lengths) > 5  # rows end at different steps (and some never): ended rows padded as generate pads them


@pytest.mark.slow
def test_generate_static_gives_generates_tokens_on_smollm2(smollm2_dir):
    """The real model (30 layers, grouped-query attention, ChatML, eos = pad): eager and compiled static decoding
    give model.generate's sampled and greedy tokens for chat-templated prompts of different lengths."""
    model, tok = models.load_model(smollm2_dir)
    prompts = [
        "Summarize: tom lives in york and likes tea.",
        "Say hi.",
        "What is 2 + 2? Answer in one word.",
        "Name three colours.",
    ]
    ids, mask = models.left_pad([models.policy_prompt(tok, p) for p in prompts], tok.pad_token_id)
    for seed, settings in enumerate([dict(temperature=1.0), dict(temperature=0.0)]):
        config = models.generation_config(model, 12, **settings)
        want, want_next = _generate(model, ids, mask, config, seed, "generate")
        for how in ("eager", "compiled"):
            got, got_next = _generate(model, ids, mask, config, seed, how)
            assert torch.equal(got, want) and got_next == want_next, (settings, how)


def test_sampler_refuses_what_it_does_not_implement(tiny_model_dir):
    model, _ = models.load_model(tiny_model_dir)
    config = models.generation_config(model, 8, temperature=1.0)
    config.top_k = 50  # generate() would cut to the top 50: static decoding would sample another distribution
    with pytest.raises(ValueError, match="top_k"):
        decoding.sampler(config)
    config.top_k, config.repetition_penalty = 0, 1.3
    with pytest.raises(ValueError, match="repetition_penalty"):
        decoding.sampler(config)


def test_compiled_rollout_is_scored_with_the_distribution_it_was_sampled_from(tiny_model_dir, monkeypatch):
    """The behaviour policy of --compile-generation is the one PPO scores: at every response position, the
    distribution the compiled step sampled from (its logits, after the min-new-tokens ban and / T) is forward()'s
    logits / T (within float rounding: another kernel, another summation order), and the rollout's tokens are those
    of generate()."""
    model, tok = models.load_model(tiny_model_dir)
    prompts = [r["prompt"] for r in demo_dataset("train", 6)]
    queries = [models.encode_prompt(tok, p) for p in prompts]
    T, min_new = 0.7, 3
    config = models.generation_config(model, 10, T, 1.0, min_new)
    stop = torch.tensor(models.stop_ids(model))
    sampled, real_sampler = [], decoding.sampler

    def recording_sampler(cfg):
        pick = real_sampler(cfg)

        def record(logits, t):
            sampled.append(logits.clone())
            return pick(logits, t)

        return record

    monkeypatch.setattr(decoding, "sampler", recording_sampler)
    b = {}
    for flag in ("--no-compile-generation", "--compile-generation"):
        args = ppo.parse_args(
            ["--model", tiny_model_dir, "--critic", "program", "--device", "cpu", "--temperature", str(T), flag]
        )
        torch.manual_seed(0)
        b[flag] = ppo.rollout(model, tok, queries, config, stop, args)[0]
    eager, compiled = b["--no-compile-generation"], b["--compile-generation"]
    assert torch.equal(compiled.input_ids, eager.input_ids) and compiled.texts == eager.texts
    n = compiled.mask.shape[1]
    assert len(sampled) == n
    with torch.no_grad():
        _, _, logits = ppo.forward(
            model, None, compiled.input_ids, compiled.attention_mask, n, T, (stop.tolist(), min_new)
        )  # (B, n, V) / T
    behaviour = torch.stack(sampled, 1)  # (B, n, V)
    behaviour[:, :min_new, stop] = -float("inf")
    live = compiled.mask.bool()
    want, got = logits.log_softmax(-1)[live], (behaviour / T).log_softmax(-1)[live]
    finite = torch.isfinite(got)
    assert torch.equal(finite, want > torch.finfo(want.dtype).min / 2)  # the banned ids, and only those
    assert torch.allclose(got[finite], want[finite], atol=1e-5)


def test_compiled_rollout_of_a_checkpointed_lora_policy(tiny_model_dir, monkeypatch):
    """The one-GPU 8B recipe's flags together: --gradient-checkpointing and --compile-generation. Checkpointing puts a
    forward hook on the embeddings (output.requires_grad_(True)) that torch 2.11's compiler cannot trace: it stopped
    the first GPU run's compiled decode (bench/gpu_recipe/README.md). The compiled step must run with that hook off, give
    generate()'s tokens, and leave the hook on afterwards, once (build_policy registered it a second time, which
    nothing could remove), so the update's gradients are those of a policy that never decoded."""
    model, tok = models.load_model(tiny_model_dir)
    argv = ["--model", tiny_model_dir, "--critic", "program", "--device", "cpu", "--gradient-checkpointing"]
    policy, _, head = ppo.build_policy(ppo.parse_args(argv), model)
    embed_hooks = policy.get_input_embeddings()._forward_hooks
    compiled, hooks_seen = decoding._compiled_decode_forward("cpu"), []

    def step(*a, **k):  # what the compiled step would trace: the embeddings' hooks at that moment
        hooks_seen.append(len(embed_hooks))
        return compiled(*a, **k)

    monkeypatch.setattr(decoding, "_compiled_decode_forward", lambda device_type: step)
    queries = [models.encode_prompt(tok, r["prompt"]) for r in demo_dataset("train", 4)]
    config = models.generation_config(policy, 8, 1.0, 1.0, 3)
    stop = torch.tensor(models.stop_ids(policy))
    b = {}
    for flag in ("--no-compile-generation", "--compile-generation"):
        torch.manual_seed(0)
        b[flag] = ppo.rollout(policy, tok, queries, config, stop, ppo.parse_args([*argv, flag]))[0]
    assert torch.equal(b["--compile-generation"].input_ids, b["--no-compile-generation"].input_ids)
    assert hooks_seen and set(hooks_seen) == {0}
    assert len(embed_hooks) == 1
    ids, attn = b["--compile-generation"].input_ids, b["--compile-generation"].attention_mask

    def grads():
        policy.zero_grad()
        policy.train()
        logprobs, values, _ = ppo.forward(policy, head, ids, attn, 8, 1.0)
        (logprobs.sum() + values.sum()).backward()
        policy.eval()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}

    before = grads()
    assert all(g.abs().sum() > 0 for n, g in before.items() if "lora_B" in n)  # (A's get none while B = 0, at init)
    torch.manual_seed(1)
    ppo.rollout(policy, tok, queries, config, stop, ppo.parse_args([*argv, "--compile-generation"]))
    assert len(embed_hooks) == 1
    after = grads()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_packed_attention_is_sdpa_with_the_cache_read_once(monkeypatch, tmp_path, tiny_model_dir):
    """Issue 58 part 2: for one query token of a grouped-query model, packed_sdpa attends on the key/value heads as
    they are (transformers' pack_gqa) and equals sdpa on the cache repeated per query head (repeat_kv, what
    transformers' sdpa does under torch.compile), masked rows included; more query tokens are transformers' sdpa.
    The compiled decode step of a grouped-query model goes through it (traced with one query token) and still gives
    generate()'s tokens."""
    from transformers.integrations.sdpa_attention import repeat_kv

    class Attention:
        num_key_value_groups = 4

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    mask = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    mask[0, ..., :4], mask[2, ..., -3:] = False, False
    out, _ = decoding.packed_sdpa(Attention(), q, k, v, mask, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_key_value_heads = 2  # 4 query heads share 2 key/value heads
    torch.manual_seed(0)
    runs.save_pretrained(
        tmp_path / "gqa", AutoModelForCausalLM.from_config(config), AutoTokenizer.from_pretrained(tiny_model_dir)
    )
    model, tok = models.load_model(str(tmp_path / "gqa"))
    ids, mask = models.left_pad(
        [models.encode_prompt(tok, r["prompt"])[-20:] for r in demo_dataset("eval", 6)], tok.pad_token_id
    )
    seen, real = [], decoding.packed_sdpa
    monkeypatch.setattr(
        decoding,
        "packed_sdpa",
        lambda module, query, *a, **k: seen.append(query.shape[2]) or real(module, query, *a, **k),
    )
    config = models.generation_config(model, 10)
    want, _ = _generate(model, ids, mask, config, 0, "generate")
    got, _ = _generate(model, ids, mask, config, 0, "compiled")
    assert torch.equal(got, want) and 1 in seen
