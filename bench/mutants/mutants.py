"""Mutation testing of the method and its scale-out (issue 68): does a test fail when a feature is gone?

    nice -n 10 python bench/mutants/mutants.py                  # every target and hand-written mutant, then the score
    python bench/mutants/mutants.py --targets common --list     # the mutants of one target, not run
    nice -n 10 python bench/mutants/mutants.py --targets pure   # one target (its outcomes replace its old ones)
    nice -n 10 python bench/mutants/mutants.py --every 6        # bounded: every 6th automatic mutant of each target
    nice -n 10 python bench/mutants/mutants.py --new            # resume: the mutants without an outcome yet
    nice -n 10 python bench/mutants/mutants.py --survivors      # rerun the survivors (after a test that should kill them)

Automatic mutants: the operators below applied one at a time to each named function of a target (the function's
source, parsed with ast): an arithmetic, comparison or boolean operator swapped, a small constant changed, a unary
operator dropped, a call statement or an augmented assignment deleted. Hand-written mutants (MANUAL): what a tool
cannot write, a feature removed by its meaning (a shard that shards nothing, the KL dropped from r_t, ...), each a
text replacement in one file. Every mutant runs its target's tests in a scratch copy of the working tree (tracked and
untracked files, no run folders), under a time limit: "killed" when they fail, "survived" when they pass, "timeout"
(counted as killed: the tests did not pass). The clean copy must pass each target's tests first.

Survivors are read by hand: each gets a verdict in bench/mutants/mutants_verdicts.json ({mutant id: "equivalent: why" or
"killed by <test> since <commit>"}); the score and the verdicts go in docs/tests.md. Writes bench/mutants/mutants_results.json.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# target: ([functions], pytest arguments). A function is found by its name wherever it is defined (one module-level
# def in the tree's own modules, tests and bench aside), so code moved between files keeps its mutants and their ids.
# The tests are the ones that cover those functions: the fewest that kill its mutants, fast ones first (pytest -x
# stops at the first failure).
POLICY = "tests/test_policy.py::test_"
POLICY_MATH = [
    POLICY + t
    for t in (
        "gae_matches_direct_sum_with_ragged_masks",
        "ppo_loss_hand_computed",
        "ppo_loss_when_the_unclipped_value_term_wins_and_with_importance_weights",
        "ppo_update_is_sgd_on_the_loss_of_every_row_once",
        "advantages_of_a_batch_whose_responses_are_one_token_long",
        "ppo_update_sums_over_ranks",
        "clip_grad_norm_over_sharded_gradients",
        "rewards_span_and_scalar_carry_the_same_delta",
        "kl_estimators",
        "whiten_and_span_weighting_and_kl_controller",
        "masked_means_and_rewards_on_one_or_no_response_token",
        "linear_decay_is_the_papers_formula_over_each_located_span",
        "rloo_matches_a_direct_loop_with_ragged_masks",
        "rloo_baselines_differ_where_they_should",
        "rloo_with_the_reward_on_the_last_token_is_plain_rloo",
        "locality_sums_match_a_plain_loop",
        "mean_reward_baseline_is_not_primes_masked_rloo",
        "the_pure_functions_need_only_torch",
    )
]
POLICY_RUNS = [  # short runs of the real loop (the tiny model: about a second each)
    POLICY + t
    for t in (
        "smoke_program_critic_span_and_scalar",
        "whiten_rewards_in_a_run",
        "kl_estimator_in_a_run",
        "grad_accum_gives_the_same_update",
        "entropy_bonus_raises_the_entropy",
        "target_kl_stops_on_the_current_epochs_kl",
        "rloo_run_samples_each_prompt_k_times_and_leaves_the_value_head",
        "the_missing_eos_penalty_is_traced_under_its_own_name",
    )
]
TARGETS = {
    "common": (
        [
            "_find_feedback",
            "_balanced_end",
            "_decode_object",
            "_is_placeholder",
            "_span_list",
            "_read_feedback",
            "parse_feedback",
            "_normalize",
            "_quote_variants",
            "_is_word",
            "_find_bounded",
            "find_span",
            "locate_spans",
            "decode_with_offsets",
            "_core",
            "span_rewards",
            "interval_rewards",
        ],
        ["tests/test_common.py", "tests/test_parse_snapshot.py"],
    ),
    "pure": (  # 03's pure section (the PPO math and loop a reader copies) and its locality sums
        [
            "masked_mean",
            "masked_whiten",
            "per_token_kl",
            "weight_spans",
            "compute_rewards",
            "compute_gae",
            "compute_rloo",
            "ppo_loss",
            "update_kl_coef",
            "entropy_from_logits",
            "clip_grad_norm",
            "ppo_update",
            "locality_sums",
        ],
        [*POLICY_MATH, "tests/test_copied_loop.py", *POLICY_RUNS],
    ),
    "steps": (  # 03's steps 3-5 around the pure functions: delta from the critic's spans, r_t and A_t
        ["span_deltas", "rewards_and_advantages"],
        [
            *(
                POLICY + t
                for t in (
                    "dense_labels_put_minus_one_inside_poor_spans_and_plus_one_elsewhere",
                    "poor_labels_keep_only_the_negative_rewards_of_every_kind_of_critic",
                    "dense_labels_count_the_critics_unmatched_quotes_and_place_its_poor_ones",
                    "only_quotes_are_made_dense_or_weighted_and_counted",
                    "linear_decay_locates_each_quote_once",
                    "center_delta_takes_the_batch_mean_per_token_out_of_the_rewards",
                )
            ),
            *POLICY_RUNS,
        ],
    ),
    "mismatch": (  # the trainer/inference importance weights of served rollouts (TRL's modes)
        ["importance_weights", "weighted_masked_mean", "mismatch_stats"],
        ["tests/test_mismatch.py"],
    ),
}
FSDP_03 = "tests/test_fsdp.py::test_03_shards_every_layer_and_rollouts_gather_one_layer_at_a_time"
FSDP_02 = "tests/test_fsdp.py::test_02_shards_every_layer_and_trains_one_layer_whole_at_a_time"
TORCHRUN = POLICY + "torchrun_two_ranks_match_single_process_math"
RESUME_03 = POLICY + "resume_matches_an_uninterrupted_run"
RESUME_02 = "tests/test_reward.py::test_fsdp_resume_is_exact"
SERVER = "tests/test_rollout_server.py::test_"  # 03 --rollout-server's side of the loop (issue 69)
REFERENCE = [POLICY + "reference_equals_policy_before_training", POLICY + "kl_estimator_in_a_run"]
REWARDS = [
    POLICY + "rewards_span_and_scalar_carry_the_same_delta",
    POLICY + "whiten_rewards_in_a_run",
    POLICY + "the_missing_eos_penalty_is_traced_under_its_own_name",
    "tests/test_copied_loop.py",
]
# Hand-written semantic mutants: a feature removed by its meaning, as one text replacement (`old` occurs once in
# `file`), and the tests that must fail without it.
MANUAL: list[dict] = [
    # --- the scale-out: --shard fsdp (infra/distributed.py) and torchrun's sums
    {
        "id": "shard_is_a_no_op_03",
        "file": "infra/distributed.py",
        "old": "        fully_shard_model(m, args.dtype)\n",
        "new": "        pass  # mutant: 03's models left whole\n",
        "tests": [FSDP_03],
    },
    {
        "id": "shard_is_a_no_op_02",
        "file": "infra/distributed.py",
        "old": '    fully_shard_model(model, "bf16" if args.bf16 else "float32", summed=False)\n'
        '    base = model.get_base_model() if hasattr(model, "peft_config") else model\n'
        "    base._is_distributed_loading_by_transformers = True",
        "new": "    pass  # mutant: 02's model left whole, to the Trainer's DDP",
        "tests": [FSDP_02],
    },
    {
        "id": "reference_copy_not_sharded",
        "file": "infra/distributed.py",
        "old": "    for m in [model] + [ref_model] * (ref_model is not None):\n",
        "new": "    for m in [model]:  # mutant\n",
        "tests": [FSDP_03],
    },
    {
        "id": "decoder_layers_not_grouped",
        "file": "infra/distributed.py",
        "old": "    for layer in layers:\n        fully_shard(layer, mp_policy=mp)\n",
        "new": "    for layer in []:  # mutant: the root alone\n        fully_shard(layer, mp_policy=mp)\n",
        "tests": [FSDP_03, FSDP_02],
    },
    {
        "id": "layers_rollout_gathers_the_whole_policy",
        "file": "infra/decoding.py",
        "old": 'distributed.gathered(model, args.fsdp_generate == "whole")',
        "new": "distributed.gathered(model, True)",
        "tests": [FSDP_03],
    },
    {
        "id": "fsdp_gradients_averaged",
        "file": "infra/distributed.py",
        "old": 'def fully_shard_model(model, dtype: str = "float32", summed: bool = True):',
        "new": 'def fully_shard_model(model, dtype: str = "float32", summed: bool = False):',
        "tests": [TORCHRUN + "[fsdp]"],
    },
    {
        "id": "ddp_gradients_averaged",
        "file": "03_train_policy.py",
        "old": "                    all_sum(p.grad)\n",
        "new": "                    all_sum(p.grad).div_(all_sum(torch.ones(())))  # mutant: the mean over ranks\n",
        "tests": [TORCHRUN + "[ddp]"],
    },
    # --- the reference policy stays the start
    {
        "id": "reference_is_the_adapter_on",
        "file": "03_train_policy.py",
        "old": "    with model.disable_adapter():\n",
        "new": "    with torch.no_grad():  # mutant: a context that switches nothing off\n",
        "tests": REFERENCE,
    },
    {
        "id": "lora_base_not_frozen",
        "file": "infra/trainable.py",
        "old": "model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_targets)",
        "new": "model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_targets).requires_grad_(True)",
        "tests": REFERENCE,
    },
    {
        "id": "full_reference_is_the_policy",
        "file": "infra/trainable.py",
        "old": "        ref_model = frozen_copy(model, args.dtype)\n",
        "new": "        ref_model = model  # mutant\n",
        "tests": REFERENCE,
    },
    {
        "id": "full_reference_copy_not_frozen",
        "file": "infra/trainable.py",
        "old": ".to(models.torch_dtype(dtype)).eval().requires_grad_(False)\n",
        "new": ".to(models.torch_dtype(dtype))  # mutant: trainable, in train mode\n",
        "tests": REFERENCE,
    },
    # --- the run's lifecycle: a resume restores everything; the policy is saved whole
    {
        "id": "resume_skips_the_optimizer",
        "file": "infra/runs.py",
        "old": "    optimizer.load_state_dict(optim)\n",
        "new": "    pass  # mutant\n",
        "tests": [RESUME_03],
    },
    {
        "id": "resume_skips_the_scheduler",
        "file": "infra/runs.py",
        "old": '    scheduler.load_state_dict(state["scheduler"])\n',
        "new": "    pass  # mutant\n",
        "tests": [RESUME_03],
    },
    {
        "id": "resume_skips_the_rng_state",
        "file": "infra/runs.py",
        "old": '    torch.set_rng_state(rng["torch"])\n',
        "new": "    pass  # mutant\n",
        "tests": [RESUME_03],
    },
    {
        "id": "resume_skips_the_value_head",
        "file": "infra/runs.py",
        "old": '    value_head.load_state_dict(state["value_head"])\n',
        "new": "    pass  # mutant\n",
        "tests": [RESUME_03],
    },
    {
        "id": "value_head_not_saved",
        "file": "infra/runs.py",
        "old": '            {"value_head.pt": value_head.state_dict()},\n',
        "new": "            {},  # mutant\n",
        "tests": [POLICY + "smoke_program_critic_span_and_scalar"],
    },
    {
        "id": "resume_02_skips_the_optimizer",
        "file": "infra/training.py",
        "old": '                    self._fsdp_state["optimizer"],\n',
        "new": "                    get_optimizer_state_dict(self.model, self.optimizer, options=whole),  # mutant\n",
        "tests": [RESUME_02],
    },
    {
        "id": "resume_02_skips_the_scheduler",
        "file": "infra/training.py",
        "old": '                self.lr_scheduler.load_state_dict(self._fsdp_state["scheduler"])\n',
        "new": "                pass  # mutant\n",
        "tests": [RESUME_02],
    },
    {
        "id": "resume_02_skips_the_rng_state",
        "file": "infra/training.py",
        "old": "            self._save_rng_state(str(out))\n",
        "new": "            pass  # mutant\n",
        "tests": [RESUME_02],
    },
    # --- the method: r_t, A_t and delta_t
    {
        "id": "kl_dropped_from_r_t",
        "file": "03_train_policy.py",
        "old": "    rewards = -kl_coef * kl * mask\n",
        "new": "    rewards = torch.zeros_like(kl)  # mutant\n",
        "tests": REWARDS,
    },
    {
        "id": "advantage_whitening_skipped",
        "file": "03_train_policy.py",
        "old": "    return rewards, masked_whiten(advantages, g.mask), returns\n",
        "new": "    return rewards, advantages * g.mask, returns  # mutant\n",
        "tests": REWARDS,
    },
    {
        "id": "missing_eos_penalty_on_the_first_token",
        "file": "03_train_policy.py",
        "old": "        rewards[rows, last] += seq_bonus\n",
        "new": "        rewards[rows, 0] += seq_bonus  # mutant\n",
        "tests": REWARDS,
    },
    {
        "id": "good_span_wins_an_overlap",
        "file": "common.py",
        "old": "        delta.append(min(got, default=0.0) + 0.0)",
        "new": "        delta.append(max(got, default=0.0) + 0.0)  # mutant",
        "tests": ["tests/test_common.py"],
    },
    {
        "id": "importance_weights_ignored",
        "file": "03_train_policy.py",
        "old": "    pg_loss = masked_mean(torch.max(pg_losses, pg_losses_clipped) * weights, mask)",
        "new": "    pg_loss = masked_mean(torch.max(pg_losses, pg_losses_clipped), mask)  # mutant",
        "tests": [SERVER + "the_weighted_surrogate_is_a_plain_loop"],
    },
    {
        "id": "masked_tokens_stay_in_the_denominator",
        "file": "03_train_policy.py",
        "old": "mb_tokens = all_sum(keep[mb].sum()).clamp(min=1)",
        "new": "mb_tokens = all_sum(batch.mask[mb].sum()).clamp(min=1)",
        "tests": [SERVER + "a_masked_rollout_moves_nothing_and_leaves_the_denominator"],
    },
]
SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Pow: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass
class Mutant:
    id: str  # target:function:line:col-end_col:operator (manual:name)
    file: str
    start: tuple[int, int]  # (line, byte column) of the replaced text
    end: tuple[int, int]
    new: str  # the replacement text
    tests: list[str]
    old: str = ""


def replacements(node: ast.AST) -> list[tuple[str, ast.AST | str]]:
    """(operator name, the node's replacement: an ast node or a statement's text) for one node."""
    out = []
    if isinstance(node, ast.BinOp) and type(node.op) in SWAPS:
        out.append(
            (
                f"{type(node.op).__name__}->{SWAPS[type(node.op)].__name__}",
                ast.BinOp(node.left, SWAPS[type(node.op)](), node.right),
            )
        )
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAPS:
        new = SWAPS[type(node.ops[0])]
        out.append((f"{type(node.ops[0]).__name__}->{new.__name__}", ast.Compare(node.left, [new()], node.comparators)))
    elif isinstance(node, ast.BoolOp):
        out.append(
            (
                f"{type(node.op).__name__}->{SWAPS[type(node.op)].__name__}",
                ast.BoolOp(SWAPS[type(node.op)](), node.values),
            )
        )
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((f"drop {type(node.op).__name__}", node.operand))
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        out.append((f"{node.value}->{not node.value}", ast.Constant(not node.value)))
    elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        v = node.value
        out.append((f"{v!r}->{v + 1!r}", ast.Constant(v + 1)))
        if v not in (0, 1):
            out.append((f"{v!r}->0", ast.Constant(type(v)(0))))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        out.append(("drop call", "pass"))
    elif isinstance(node, ast.AugAssign):
        out.append(("drop augmented assignment", "pass"))
    return out


def tree_files() -> list[str]:
    """The working tree's files (tracked and untracked, not ignored), relative to ROOT."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


def modules() -> list[str]:
    """The tree's own Python modules, the ones a mutant may change: tests and benches aside."""
    return [f for f in tree_files() if f.endswith(".py") and not f.startswith(("tests/", "bench/", "."))]


def find_functions(names: list[str]) -> list[tuple[str, ast.AST]]:
    """(file, its module-level def) of each name, wherever it is defined: exactly one module defines it."""
    found: dict[str, list] = {n: [] for n in names}
    for f in modules():
        source = (ROOT / f).read_bytes()
        if not any(f"def {n}(".encode() in source for n in names):
            continue
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in found:
                found[node.name].append((f, node))
    for n, where in found.items():
        if len(where) != 1:
            sys.exit(
                f"bench/mutants/mutants.py: {len(where)} module-level functions named {n!r} (TARGETS is out of date)"
            )
    return [found[n][0] for n in names]


def automatic(target: str) -> list[Mutant]:
    """Every automatic mutant of a target, in source order. Ids name the function and the line within it (from its
    def), so a move of the function leaves them as they were."""
    names, tests = TARGETS[target]
    out = []
    for path, fn in find_functions(names):
        docstring = ast.get_docstring(fn, clean=False) is not None
        skip = {id(n) for n in ast.walk(fn.body[0])} if docstring else set()
        for node in ast.walk(fn):
            if id(node) in skip:
                continue
            for op, new in replacements(node):
                text = new if isinstance(new, str) else f"({ast.unparse(new)})"
                start, end = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)
                where = f"+{node.lineno - fn.lineno}:{node.col_offset}-{node.end_col_offset}"  # a * b * c: two at a
                out.append(Mutant(f"{target}:{fn.name}:{where}:{op}", path, start, end, text, tests))
    return out


def splice(source: bytes, m: Mutant) -> bytes:
    """source with the text between m.start and m.end (ast's lines from 1, byte columns) replaced by m.new."""
    lines = source.splitlines(keepends=True)
    offset = lambda line, col: sum(len(x) for x in lines[: line - 1]) + col  # noqa: E731
    a, b = offset(*m.start), offset(*m.end)
    m.old = source[a:b].decode()
    return source[:a] + m.new.encode() + source[b:]


def manual() -> list[Mutant]:
    """The hand-written mutants. A mutant's text is looked for in its file, then (code moved) in every module: it must
    occur exactly once in one."""
    out, sources = [], None
    for spec in MANUAL:
        path, source = spec["file"], (ROOT / spec["file"]).read_text() if (ROOT / spec["file"]).is_file() else ""
        if source.count(spec["old"]) != 1:
            sources = sources or {f: (ROOT / f).read_text() for f in modules()}
            where = [f for f, text in sources.items() if text.count(spec["old"]) == 1]
            if len(where) != 1 or sum(text.count(spec["old"]) for text in sources.values()) != 1:
                sys.exit(
                    f"bench/mutants/mutants.py: manual mutant {spec['id']}: its text is not in exactly one place (MANUAL "
                    "is out of date)"
                )
            path, source = where[0], sources[where[0]]
        line = source[: source.index(spec["old"])].count("\n") + 1
        out.append(Mutant(f"manual:{spec['id']}", path, (line, 0), (line, 0), spec["new"], spec["tests"], spec["old"]))
    return out


def scratch_copy() -> Path:
    """The working tree's files (tracked and untracked, not ignored) copied to a temporary folder."""
    dst = Path(tempfile.mkdtemp(prefix="t2g-mutants-"))
    for f in tree_files():
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)
    return dst


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """("passed" | "failed" | "timeout", seconds) of pytest on `tests` in the copy, one process, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly"]
    proc = subprocess.Popen(
        [*cmd, *tests], cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - start
    finally:  # pytest's own children too (torchrun's ranks): its whole process group, by its id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return ("passed" if rc == 0 else "failed"), time.time() - start


def apply(copy: Path, m: Mutant) -> bytes:
    """Write the mutant into the copy; returns the file's clean bytes (to restore)."""
    path = copy / m.file
    clean = path.read_bytes()
    if m.old and m.start == m.end:  # manual: a text replacement
        path.write_bytes(clean.replace(m.old.encode(), m.new.encode(), 1))
    else:
        path.write_bytes(splice(clean, m))
    return clean


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", default=[*TARGETS, "manual"], help="targets to mutate (or 'manual')")
    p.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    p.add_argument("--limit", type=int, help="the first N mutants only (a quick look)")
    p.add_argument(
        "--every", type=int, help="every Nth automatic mutant of each target (a bounded run, spread over it)"
    )
    p.add_argument("--match", nargs="+", help="only the mutants whose id contains one of these")
    p.add_argument("--survivors", action="store_true", help="only the mutants that survived in --results (rerun)")
    p.add_argument("--new", action="store_true", help="only the mutants without an outcome in --results (resume)")
    p.add_argument(
        "--results", default="bench/mutants/mutants_results.json", help="where the outcomes go ('': nowhere)"
    )
    args = p.parse_args(argv)
    mutants = [m for t in args.targets if t != "manual" for m in automatic(t)[:: args.every or 1]]
    mutants += manual() if "manual" in args.targets else []
    path = ROOT / args.results if args.results else None
    mutants = [m for m in mutants if any(x in m.id for x in args.match)] if args.match else mutants
    if args.survivors:
        mutants = [m for m in mutants if load(path).get(m.id, {}).get("status") == "survived"]
    if args.new:
        mutants = [m for m in mutants if m.id not in load(path)]
    bounded = args.limit or args.every or args.match or args.survivors or args.new
    replaced = set() if bounded else set(args.targets)  # a whole target's run replaces its old outcomes
    mutants = mutants[: args.limit] if args.limit else mutants
    if args.list:
        for m in mutants:
            print(m.id, "->", m.new.replace("\n", " ")[:80])
        print(f"{len(mutants)} mutants")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # kill: the scratch copy is removed all the same
    copy, clean_s, results = scratch_copy(), {}, {}
    try:
        for tests in dict.fromkeys(tuple(m.tests) for m in mutants):  # each test set passes on the clean copy first
            status, clean_s[tests] = run_tests(copy, list(tests), 3600)
            if status != "passed":
                sys.exit(f"bench/mutants/mutants.py: the clean tree fails {' '.join(tests)}: fix that first")
        for i, m in enumerate(mutants, 1):
            clean = apply(copy, m)
            try:
                status, seconds = run_tests(copy, m.tests, max(60.0, 3 * clean_s[tuple(m.tests)]))
            finally:
                (copy / m.file).write_bytes(clean)
            status = {"passed": "survived", "failed": "killed"}.get(status, status)  # a timeout: not passed
            results[m.id] = {"status": status, "old": m.old, "new": m.new, "seconds": round(seconds, 1)}
            print(f"[{i}/{len(mutants)}] {status:<8} {m.id}  {m.old!r} -> {m.new!r}"[:200], flush=True)
            if path is not None:  # after each mutant: a long run stopped halfway keeps what it found
                save(path, results, replaced)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    summary = score({**load(path), **results})
    print(json.dumps({t: {k: v for k, v in x.items() if k != "unexplained"} for t, x in summary.items()}))
    return summary


def load(path) -> dict:
    """The outcomes in a results file ({} without one)."""
    return json.loads(path.read_text())["mutants"] if path is not None and path.is_file() else {}


def save(path, results: dict, replaced: set) -> None:
    """Merge this run's outcomes into the file (read again each time: runs of other targets may write it too); the
    old outcomes of a target run whole are dropped (ids move with the lines)."""
    merged = {k: r for k, r in load(path).items() if k.split(":")[0] not in replaced} | results
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(json.dumps({"summary": score(merged), "mutants": merged}, indent=1) + "\n")
    os.replace(f.name, path)


def score(results: dict) -> dict:
    """Per target (a mutant id's first field) and over all: mutants, killed (a timeout counts), survived, the
    survivors with a verdict in bench/mutants/mutants_verdicts.json (explained) and without (unexplained), and the score:
    killed / mutants."""
    verdicts_path = ROOT / "bench" / "mutants" / "mutants_verdicts.json"
    verdicts = json.loads(verdicts_path.read_text()) if verdicts_path.is_file() else {}
    out = {}
    for target in [*dict.fromkeys(k.split(":")[0] for k in results), "all"]:
        ids = [k for k in results if target == "all" or k.split(":")[0] == target]
        survived = [k for k in ids if results[k]["status"] == "survived"]
        out[target] = {
            "mutants": len(ids),
            "killed": len(ids) - len(survived),
            "survived": len(survived),
            "explained": sum(k in verdicts for k in survived),
            "score": round((len(ids) - len(survived)) / len(ids), 4) if ids else None,
            "unexplained": [k for k in survived if k not in verdicts],
        }
    return out


if __name__ == "__main__":
    main()
