"""03_train_policy.py's command line: its --task presets (the demo's, and the paper's App. D Table 10 for the others)
and its flags, each variant's from its own module (add_args), checked before anything loads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import common
import critics
from infra import cli, decoding, distributed, reward_models, sft, trace, tracking, trainable
from infra import vllm_rollouts as vr

# Defaults per task preset: the demo fits a 2-core CPU; the others follow the paper (App. D, Table 10).
PRESETS = {
    "demo": dict(
        model="runs/demo/base",
        prompts="runs/demo/data/prompts.jsonl",
        sft_data="runs/demo/data/sft.jsonl",
        sft_steps=100,
        sft_lr=1e-3,
        sft_lora_r=0,
        sft_output_dir="runs/demo/sft",
        reward_model="runs/demo/reward_model",
        output_dir="runs/demo/text2grad",
        scalar_baseline_dir="runs/demo/scalar",
        steps=60,
        batch_size=32,
        max_new_tokens=32,
        lr=1e-3,
        lora_r=16,
        lora_alpha=32,
        kl_coef=0.2,
        ppo_epochs=2,
        num_minibatches=2,
        critic_max_new_tokens=reward_models.critique_tokens("demo"),
        warmup_steps=0,
        trace_samples=3,
    ),
    "default": dict(
        model=None,
        prompts=None,
        sft_data=None,
        sft_steps=0,
        sft_lr=2e-5,
        sft_lora_r=None,
        sft_output_dir=None,
        reward_model=None,
        output_dir="runs/text2grad",
        scalar_baseline_dir="",
        steps=1000,
        batch_size=64,
        max_new_tokens=256,
        lr=1e-5,
        lora_r=16,
        lora_alpha=32,
        kl_coef=0.05,
        ppo_epochs=4,
        num_minibatches=4,
        critic_max_new_tokens=reward_models.critique_tokens("qa"),
        warmup_steps=0,
        trace_samples=0,
    ),
}

# the demo's own runs: only the zero-flag command may replace them
DEMO_RUNS = (PRESETS["demo"]["output_dir"], PRESETS["demo"]["scalar_baseline_dir"])


def parse_args(argv=None, doc: str = ""):
    """03's flags, its --task preset filled in, checked (one line and exit 2 on a bad value). doc: 03's docstring,
    --help's description."""
    p = cli.parser(
        doc,
        {"summarization, code, qa": PRESETS["default"], "demo": PRESETS["demo"]},
        "  none and '' explained, and every flag in full: docs/stages.md (stage 3)",
    )
    a = p.add_argument
    # --- task, data, model
    a("--task", default="demo", choices=["demo", "summarization", "code", "qa"], help="the preset")
    a("--model", help="policy base model: hub id or local dir (demo: runs/demo/base)")
    a("--prompts", help="JSONL with a 'prompt' field (code: any layout of tasks/code.py)")
    a("--output-dir", help="run dir: metrics.jsonl, samples.jsonl, checkpoint.pt, policy/")
    a("--steps", type=int, help="number of PPO iterations")
    a("--seed", type=int, default=1, help="seed for sampling, prompt order and init")
    a("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt")
    a("--overwrite", action="store_true", help="a fresh run replaces the run in --output-dir")
    a("--scalar-baseline-dir", help="then train the --reward-mode scalar baseline here ('': skip)")
    a("--chat-template", default="auto", choices=["auto", "on", "off"], help="chat template")
    a("--max-prompt-tokens", type=int, default=1024, help="a longer prompt keeps its last tokens")
    # --- rollouts (step 1)
    a("--batch-size", type=int, help="rollouts per iteration")
    a("--max-new-tokens", type=int, help="response length limit")
    a("--min-new-tokens", type=int, default=0, help="no EOS before this many tokens")
    a("--temperature", type=float, default=1.0, help="sampling T; log-probs: logits / T")
    a("--top-p", type=float, default=1.0, help="nucleus sampling. Below 1 the run is OFF-POLICY")
    a("--missing-eos-penalty", type=float, default=1.0, help="penalty when no EOS is produced")
    # --- rewards and advantages (steps 3-5, §3.5)
    a(
        "--reward-mode",
        default="span",
        choices=["span", "scalar", "self_distill"],
        help="span: delta_t on every token (Text2Grad); scalar: its sum on the last token; self_distill: SDPO's",
    )
    a("--kl-estimator", default="k1", choices=["k1", "k3", "full"], help="per-token KL estimator")
    a("--kl-coef", type=float, help="initial beta")
    a("--adaptive-kl-target", type=float, help="adaptive beta's target sequence KL")
    a("--adaptive-kl-horizon", type=float, default=10000, help="adaptive beta's horizon")
    a("--whiten-rewards", action="store_true", help="whiten rewards (scale only) before GAE")
    a("--center-delta", action="store_true", help="delta minus its batch mean per token")
    a("--gamma", type=float, default=1.0, help="discount")
    a("--lam", type=float, default=0.95, help="GAE lambda")
    a(
        "--advantage",
        default="gae",
        choices=["gae", "rloo", "token"],
        help="gae; rloo, token (A_t = r_t): no value head",
    )
    a("--rloo-k", type=int, default=4, help="--advantage rloo: samples per prompt")
    a(
        "--rloo-baseline",
        default="start",
        choices=["start", "position", "mean-reward"],
        help="compute_rloo's baseline",
    )
    # --- PPO update (step 6)
    a("--lr", type=float, help="learning rate (LoRA weights and value head)")
    a("--anneal-lr", action="store_true", help="linearly anneal the learning rate to 0")
    a("--warmup-steps", type=int, help="linear learning-rate warmup over the first N iterations")
    a("--ppo-epochs", type=int, help="passes over each batch")
    a("--num-minibatches", type=int, help="minibatches per epoch")
    a("--grad-accum", type=int, default=1, help="micro-batches per minibatch (memory)")
    a("--clip-range", type=float, default=0.2, help="policy ratio clip epsilon")
    a("--clip-range-value", type=float, default=0.2, help="value clip")
    a("--vf-coef", type=float, default=0.1, help="value loss coefficient")
    a("--ent-coef", type=float, default=0.0, help="entropy bonus (the paper's beta * H)")
    a("--max-grad-norm", type=float, default=1.0, help="gradient norm clip")
    a("--target-kl", type=float, help="stop the epochs once an epoch's approx KL exceeds it")
    # --- system
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, ...")
    a("--dtype", default="float32", choices=["float32", "bf16", "fp16"], help="README: Scaling up")
    # --- the variants' own flags (App. I's --labels and --span-weighting: critics/)
    for variant in (sft, trainable, critics, decoding, distributed, trace, tracking, vr):
        variant.add_args(p)
    args = p.parse_args(argv)
    # only this command may replace the demo's runs
    args.zero_flag = not (sys.argv[1:] if argv is None else argv)
    if args.resume and args.overwrite:
        raise common.DataError(
            "--resume and --overwrite: pick one (--resume continues a run on the SFT start it "
            "began from; --overwrite starts it again, and retrains a changed SFT start)"
        )
    critic_budget, rm_given = args.critic_max_new_tokens, args.reward_model is not None
    if args.output_dir is not None:  # no baseline, SFT in OUTPUT_DIR/sft: the preset's folders are its own
        args.scalar_baseline_dir = args.scalar_baseline_dir or ""
        args.sft_output_dir = args.sft_output_dir or str(Path(args.output_dir) / "sft")
    for key, value in PRESETS["demo" if args.task == "demo" else "default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sft_output_dir = args.sft_output_dir or str(Path(args.output_dir) / "sft")  # and the baseline's
    if not args.model:
        raise common.DataError("--model is required outside the demo")
    for flag, value, ok, rule in (
        ("--temperature", args.temperature, args.temperature > 0, "> 0 (logits / T)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
        ("--ppo-epochs", args.ppo_epochs, args.ppo_epochs >= 1, ">= 1 (0: no update)"),
        ("--num-minibatches", args.num_minibatches, args.num_minibatches >= 1, ">= 1"),
        ("--grad-accum", args.grad_accum, args.grad_accum >= 1, ">= 1"),
        (
            "--rloo-k",
            args.rloo_k,
            args.advantage != "rloo" or (args.rloo_k >= 2 and args.batch_size % args.rloo_k == 0),
            ">= 2 and divide --batch-size (samples of one prompt)",
        ),
    ):
        if not ok:
            raise common.DataError(f"{flag} {value:g}: must be {rule}")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets it
    shards = world * args.num_minibatches * args.grad_accum
    if args.batch_size % shards:
        raise common.DataError(
            f"--batch-size {args.batch_size} must divide by world size x --num-minibatches x --grad-accum = {shards}"
        )
    if args.reward_mode == "self_distill" and args.critic in ("scalar-rm", "prm"):
        raise common.DataError(f"--reward-mode self_distill: --critic {args.critic} writes no critique to teach from")
    critics.check_args(args, critic_budget, rm_given)  # its reward model, as stage 2 trained it
    vr.check_args(args, world)  # --rollout-server: LoRA, one process
    tracking.check(args.report_to)  # --report-to: known trackers, their packages installed
    return args
