"""baselines/dpo.py's loss against TRL's DPOTrainer on the same batch (a check of the hand-written loss, bench only)

    /work/venv-trl/bin/python bench/dpo_vs_trl/dpo_vs_trl.py     # a venv with torch 2.13.0 (CPU), trl 1.16.0, peft 0.21.0

TRL is not a dependency of the project: this runs in its own virtual environment (torch first, then `pip install
trl==1.16.0 peft==0.21.0`). The batch: 16 preference pairs of the demo (a post's noisy summary against its reference,
the exact critic's fewer-poor-spans rule) on a tiny Llama. The reference is that model; the policy is a copy whose
weights are perturbed (seeded), so that the log-ratios, the rewards and the loss are far from their trivial values at
pi = ref. TRL's DPOTrainer (loss_type sigmoid, beta 0.1) computes its loss on the whole batch through its own data
pipeline (tokenisation, EOS, collation, log-probs); ours is baselines/dpo.py's pair_stats on the same pairs. Prints
both losses, their difference and the implicit reward margins, then one JSON line.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "baselines"))

import torch  # noqa: E402

from baselines.scalar_rm import preference_pairs  # noqa: E402
from infra.tiny_model import build_tiny_base  # noqa: E402
from tasks.demo import demo_critic, demo_dataset  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=16, help="pairs in the batch")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    p.add_argument("--noise", type=float, default=0.1, help="std of the perturbation that makes the policy")
    args = p.parse_args()
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import dpo

    tmp = Path(tempfile.mkdtemp())
    recs = []
    for ex in demo_dataset("annotate", 4 * args.pairs):
        for k, resp in (("a", ex["response"]), ("b", " " + ex["reference"])):
            recs.append(
                {"id": f"{ex['id']}/{k}", "prompt": ex["prompt"], "response": resp, **demo_critic(ex["prompt"], resp)}
            )
    pairs = preference_pairs(recs)[: args.pairs]
    base = build_tiny_base(
        tmp / "ref",
        [r["prompt"] + r["response"] for r in recs],
        vocab_size=600,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
    )
    tok = AutoTokenizer.from_pretrained(base)
    ref = AutoModelForCausalLM.from_pretrained(base).eval()
    policy = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    with torch.no_grad():
        for q in policy.parameters():
            q.add_(args.noise * torch.randn_like(q))

    config = trl.DPOConfig(
        output_dir=str(tmp / "trl"),
        beta=args.beta,
        loss_type=["sigmoid"],
        per_device_train_batch_size=len(pairs),
        report_to="none",
        use_cpu=True,
        max_length=None,
        precompute_ref_log_probs=False,
        dataloader_drop_last=False,
    )
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=ref,
        args=config,
        processing_class=tok,
        train_dataset=Dataset.from_list([{k: x[k] for k in ("prompt", "chosen", "rejected")} for x in pairs]),
    )
    policy.eval()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, batch).item()

    ours_args = argparse.Namespace(beta=args.beta, device="cpu", dtype="float32")
    encoded = dpo.encode_pairs(tok, pairs, "auto", 1024, 10**6)
    with torch.no_grad():
        loss, stats = dpo.pair_stats(policy, ref, encoded, tok.pad_token_id, ours_args)
    result = {
        "trl": trl.__version__,
        "pairs": len(pairs),
        "beta": args.beta,
        "trl_loss": trl_loss,
        "ours_loss": loss.item(),
        "abs_diff": abs(trl_loss - loss.item()),
        "ours_margin": stats["rewards/margin"],
        "ours_accuracy": stats["rewards/accuracy"],
    }
    print(
        f"TRL {trl.__version__} DPOTrainer loss {trl_loss:.6f}; baselines/dpo.py {loss.item():.6f}; "
        f"|difference| {result['abs_diff']:.2e} (the trivial value at pi = ref: log 2 = 0.693147)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
