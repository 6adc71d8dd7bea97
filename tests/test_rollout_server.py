"""03 --rollout-server's side of the loop, no server needed (issue 69): the importance weights of infra/mismatch.py
enter ppo_update as Rollouts.weights and Rollouts.keep. With every weight 1 and every token kept the update is the
in-process one bit for bit; a masked rollout moves nothing and leaves the denominator; the weighted surrogate is a
plain loop's. The flags' refusals and a dead server are one line, exit 2, before any iteration. The server itself:
tests/test_vllm_rollouts.py."""

import copy

import pytest
import torch
from conftest import free_port, import_script
from test_copied_loop import B, T, TinyLM, sample, score
from tasks.demo import demo_dataset

import common

ppo = import_script("03_train_policy")


def batch_and_model(seed=0):
    """A batch of TinyLM's own rollouts with advantages and returns, as step 5 leaves it, and the model."""
    torch.manual_seed(seed)
    model, gen = TinyLM(), torch.Generator().manual_seed(seed)
    ids = sample(model, gen)
    with torch.no_grad():
        logprobs, values, _ = score(model, ids)
    mask = torch.ones(B, T)
    advantages = ppo.masked_whiten(torch.randn(B, T, generator=gen), mask)
    batch = ppo.Rollouts(mask, logprobs=logprobs, values=values, advantages=advantages, returns=torch.randn(B, T))
    return batch, model, ids


def run_update(model, ids, batch, num_minibatches=2, optimizer=torch.optim.SGD):
    opt = optimizer(model.parameters(), lr=0.1)
    hp = ppo.PpoHParams(ppo_epochs=2, num_minibatches=num_minibatches)
    torch.manual_seed(123)  # ppo_update's minibatch order
    return ppo.ppo_update(lambda rows: score(model, ids[rows]), batch, list(model.parameters()), opt, hp)


def test_unit_weights_and_every_token_kept_is_the_update_bit_for_bit():
    batch, model, ids = batch_and_model()
    other = copy.deepcopy(model)
    plain = run_update(model, ids, batch, optimizer=torch.optim.Adam)
    weighted = copy.copy(batch)
    weighted.weights, weighted.keep = batch.mask.clone(), batch.mask.clone()
    assert run_update(other, ids, weighted, optimizer=torch.optim.Adam) == plain
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))


def test_a_masked_rollout_moves_nothing_and_leaves_the_denominator():
    """Half the rollouts masked out (keep 0, weight 0): the update equals one on the other half alone."""
    batch, model, ids = batch_and_model(1)
    other = copy.deepcopy(model)
    kept = torch.arange(B) % 2 == 1
    masked = copy.copy(batch)
    masked.keep = batch.mask * kept[:, None]
    masked.weights = masked.keep.clone()
    run_update(model, ids, masked, num_minibatches=1)
    half = ppo.Rollouts(
        batch.mask[kept],
        logprobs=batch.logprobs[kept],
        values=batch.values[kept],
        advantages=batch.advantages[kept],
        returns=batch.returns[kept],
    )
    run_update(other, ids[kept], half, num_minibatches=1)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_the_weighted_surrogate_is_a_plain_loop():
    gen = torch.Generator().manual_seed(3)
    lp, old, adv = (torch.randn(3, 5, generator=gen) * 0.3 for _ in range(3))
    weights = torch.rand(3, 5, generator=gen) * 2
    keep = (torch.rand(3, 5, generator=gen) > 0.3).float()
    pg_loss, _, _ = ppo.ppo_loss(lp, old, adv, None, None, None, keep, 0.2, 0.2, weights)
    total = count = 0.0
    for i in range(3):
        for t in range(5):
            if keep[i, t]:
                ratio = float(torch.exp(lp[i, t] - old[i, t]))
                a = float(adv[i, t])
                total += float(weights[i, t]) * max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
                count += 1
    assert pg_loss.item() == pytest.approx(total / count, rel=1e-5)


def run_main(tmp_path, tiny_model_dir, *extra):
    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 4))
    argv = [
        *("--model", tiny_model_dir, "--prompts", str(tmp_path / "prompts.jsonl"), "--critic", "program"),
        *("--output-dir", str(tmp_path / "run"), "--scalar-baseline-dir", "", "--steps", "1", "--batch-size", "2"),
        *("--num-minibatches", "1", "--max-new-tokens", "4", "--sft-steps", "0", "--device", "cpu", *extra),
    ]
    with pytest.raises(common.DataError) as e:  # __main__ prints it as one line "error: ...", exit 2
        ppo.main(argv)
    return str(e.value)


def test_a_dead_server_is_one_line_before_anything_is_written(tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: the real openai client's connection error
    line = run_main(tmp_path, tiny_model_dir, "--rollout-server", url)
    assert line.startswith(f"--rollout-server {url}: the server does not answer: ") and "\n" not in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--lora-r", "0"], "--lora-r 0: must be > 0: the server gets the policy's LoRA adapter"),
        (["--rollout-is-cap", "0"], "--rollout-is-cap 0.0: must be > 0"),
    ],
)
def test_what_a_server_cannot_do_is_one_line(tmp_path, tiny_model_dir, flags, line):
    got = run_main(tmp_path, tiny_model_dir, "--rollout-server", "http://127.0.0.1:9/v1", *flags)
    assert got.startswith(line), got


def test_a_server_that_dies_mid_run_is_said_so_with_the_line_that_continues_the_run(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Issue 80, item 8: a vLLM server killed mid-run was reported as "the adapter .../step-000007 was refused: cannot
    connect". Now the line says the server stopped answering, where the run stands and the --resume line, as Ctrl-C
    does. The real openai client, against a port nothing listens on (the server gone after it had connected)."""
    import openai
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from infra import runs, vllm_rollouts

    url = f"http://127.0.0.1:{free_port()}/v1"
    client = openai.OpenAI(base_url=url, api_key="EMPTY", timeout=5, max_retries=0)
    server = vllm_rollouts.Server(url, tmp_path / "adapters", client, probe=[1, 2, 3])
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules="all-linear")
    )
    (tmp_path / "run").mkdir()
    common.write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"step": 1}, {"step": 2}])
    args = type("Args", (), {"output_dir": str(tmp_path / "run"), "steps": 5})()
    monkeypatch.setattr(runs, "_RUN", {})  # this test's run only
    runs.on_interrupt(args, ["03_train_policy.py", "--rollout-server", url, "--overwrite"])
    with pytest.raises(common.DataError) as e:
        vllm_rollouts.push_adapter(server, model, 3)
    line = str(e.value)
    assert line.startswith(f"--rollout-server {url}: the server stopped answering (loading the adapter "), line
    assert "was refused" not in line and "\n" not in line
    assert line.endswith(
        "restart it; the run stopped after iteration 2 of 5; last checkpoint: none yet (--save-every); continue with: "
        f"python 03_train_policy.py --rollout-server {url} --overwrite"
    ), line


def test_the_freshness_checks_difference_is_logged_every_iteration():
    """Issue 80, item 8: check_fresh's largest difference was logged nowhere, so "passed" only meant it never raised.
    The row of a served iteration carries it (mismatch/probe_diff, the Server's last check); in process, no row."""
    from types import SimpleNamespace

    from infra import trace, vllm_rollouts

    b = ppo.Rollouts(torch.ones(2, 3), logprobs=torch.zeros(2, 3), behaviour_logprobs=torch.zeros(2, 3))
    args = SimpleNamespace(rollout_is_mode="sequence_mask", rollout_is_cap=3.0)
    server = vllm_rollouts.Server("http://127.0.0.1:9/v1", None, None, [1])
    assert "mismatch/probe_diff" not in trace.served_mismatch(b, args, server)  # no check has run yet
    server.fresh = 4.2e-5
    assert trace.served_mismatch(b, args, server)["mismatch/probe_diff"] == 4.2e-5
    assert trace.served_mismatch(ppo.Rollouts(torch.ones(2, 3)), args, server) == {}  # in process
