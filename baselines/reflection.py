"""--reflect, --reflect-critic, --reviser: SFT + reflection, the paper's §4.3 baseline, as 04 evaluates it.

Each policy's answer is revised once, by --reviser (default: the policy itself, as the paper prompts it), from
revision_prompt(prompt, answer, critique) (baselines/reflection_data.py), sampled as the answers were; the revisions
are a policy row of their own, NAME+reflect, scored, judged and shown like any other. The critique the reviser reads
(--reflect-critic) is --reward-model's (a generative one: its critique text, else its poor spans), the task's
programmatic critic's (demo: the exact critic; code: the tests), or none (an empty critique: what revision does
without feedback). The demo's toy policy cannot follow a critique it was never trained on: its reviser needs
revision SFT first (baselines/reflection_data.py, then 03 --sft-data).
"""

from __future__ import annotations

import hashlib
import json

from common import DataError
from infra import reward_models


def add_args(p) -> None:
    g = p.add_argument_group("SFT + reflection, the paper's §4.3 baseline (baselines/reflection.py)")
    g.add_argument(
        "--reflect",
        action="store_true",
        help="revise each policy's answer once from a critique of it: adds the row NAME+reflect",
    )
    g.add_argument(
        "--reflect-critic",
        default="reward-model",
        choices=["reward-model", "program", "none"],
        help="--reflect: whose critique the reviser reads",
    )
    g.add_argument("--reviser", help="--reflect: the model that revises (default: each policy itself)")


def check_args(args, p) -> None:
    """04's parse_args: --reflect-critic program needs a task with a programmatic critic."""
    if args.reflect and args.reflect_critic == "program" and args.task not in ("demo", "code"):
        p.error(f"--reflect-critic program: no programmatic critic for --task {args.task}")


def check_critic(args) -> None:
    """Before any generation, once the reward model is resolved: --reflect-critic reward-model needs one."""
    if args.reflect and args.reflect_critic == "reward-model" and not args.reward_model:
        raise DataError(
            "--reflect-critic reward-model: no --reward-model to critique the answers (a generative one); "
            "or pass --reflect-critic program or none"
        )


def reflect_outputs(name, path, gens, gen_fp, crits, records, args, cache_dir, generate) -> tuple[list[dict], str]:
    """SFT + reflection (§4.3): each answer of policy `name` revised once by --reviser (default: the policy itself),
    from revision_prompt(prompt, answer, critique) (baselines/reflection_data.py), sampled as the answers were
    by `generate` (04's generate_outputs, cached like them). The critique: the reward model's (crits, already
    computed: its critique text, and its poor spans when it wrote no text), the task's programmatic critic's, or none.
    The cache is keyed by the revision prompts themselves: whatever changes a critique (--rm-max-new-tokens,
    --test-timeout, the critic) makes the revisions again. Returns the revisions in generate_outputs' rows, and their
    fingerprint."""
    from baselines.reflection_data import revision_prompt

    reviser = args.reviser or path

    def critique(rec, gen, crit) -> str:
        if args.reflect_critic == "none":
            return ""
        if args.reflect_critic == "program":
            if args.task == "demo":
                from tasks.demo import demo_critic

                return demo_critic(rec["prompt"], gen["response"])["critique"]
            from tasks.code import code_critic

            return code_critic(rec["prompt"], gen["response"], rec["test"], args.test_timeout)["critique"]
        fb = reward_models.rm_scores(gen["response"], gen["offsets"], crit["critique_raw"])[0]
        return fb["critique"] or "poor: " + ", ".join(s.strip() for s in fb["poor_spans"])

    revise = [
        {**rec, "prompt": revision_prompt(rec["prompt"], gen["response"], critique(rec, gen, crit))}
        for rec, gen, crit in zip(records, gens, crits or [None] * len(records))
    ]
    prompts = hashlib.sha256(json.dumps([r["prompt"] for r in revise]).encode()).hexdigest()
    return generate(f"{name}+reflect", reviser, revise, args, cache_dir, extra=(gen_fp, "reflect-v2", prompts))
