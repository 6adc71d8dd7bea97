"""--regenerate, --bootstrap, --bertscore-model, --test-timeout: how 04 measures, and what it keeps between runs.

The cache under OUTPUT_DIR/eval/ (cached): append-only JSONL keyed by id, one file per policy and step (generations,
critiques, test runs, verdicts), each row stamped with a fingerprint of the settings and of the model files behind it
(fingerprint), so a rerun computes only what is missing or stale and a killed run resumes. Each metric is kept as
per-sample sufficient statistics: its value is the statistic of their sum (a pooled ratio, corpus BLEU) and its 95%
interval the percentiles of that statistic over resamples of the samples (bootstrap, ratio_stat, bleu_stat). They
are ROUGE and BLEU against the references (reference_stats), BERTScore from a local model (bertscore_f1), and the
code task's pass@k from the benchmark's tests run in the sandbox (code_test_rows, pass_at_k_rows).
A policy whose reward-model critiques mostly did not parse (critic_failed: rm/parse_rate below
infra.reward_models.MIN_PARSE_RATE, stage 2's floor) has its critic's metrics marked: a critique that does not parse
quotes nothing, delta = 0 on every token, which scores as a flawless answer (a poor-token share of 0.000, the best).
results.json keeps the numbers with a critic_failed entry per policy; the table and report.html show them n/a
(evaluation/report.py). So with each --monitor-reward-model NAME (monitor_failed[NAME]: its rm[NAME]/parse_rate).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import common
from common import DataError


def add_args(p) -> None:
    g = p.add_argument_group("task metrics: the code task's tests, BERTScore (evaluation/__init__.py)")
    g.add_argument("--test-timeout", type=float, default=10.0, help="seconds per completion's tests (code task)")
    g.add_argument("--test-workers", type=int, default=2, help="test runs in parallel")
    g.add_argument("--bertscore-model", default=None, help="local model dir for BERTScore (pip install bert-score)")
    g.add_argument("--bertscore-layers", type=int, default=None, help="BERTScore layer (default: the last)")


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
            h.update(
                "".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files if f.is_file()).encode()
            )
            if (path / "adapter_config.json").is_file():
                h.update(
                    fingerprint(
                        json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path", "")
                    ).encode()
                )
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
            rows = compute(todo[i : i + chunk])  # first, so bad input (a model that cannot load) leaves no file behind
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for row in rows:
                    common.append_jsonl(f, {**row, "fingerprint": fp})
            bar.update(len(todo[i : i + chunk]))
    rows = {r["id"]: r for r in common.read_jsonl(path)}
    return [rows[it["id"]] for it in items]


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

    return np.array(
        [
            BLEU.compute_bleu(s[:4].tolist(), s[4:8].tolist(), int(s[8]), int(s[9]), smooth_method="exp").score
            for s in sums
        ]
    )


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


def critic_failed(metrics: dict, monitor: str | None = None) -> dict | None:
    """A policy's results.json entry "critic_failed": {"failed": critiques that did not parse, "n", "parse_rate",
    "floor", "metrics": the metrics they void} when its rm/parse_rate is below infra.reward_models.MIN_PARSE_RATE;
    None when it is not (or there is no reward model). Voided: every rm/ metric but rm/parse_rate itself (the count
    the verdict rests on), and every rm_vs_critic/ one (the monitor's view of the same critiques). monitor NAME: the
    same for --monitor-reward-model NAME's own critiques (rm[NAME]/parse_rate; its rm_vs_critic[NAME]/ rows)."""
    from infra.reward_models import MIN_PARSE_RATE

    rm, vs = ("rm/", "rm_vs_critic/") if monitor is None else (f"rm[{monitor}]/", f"rm_vs_critic[{monitor}]/")
    parse = metrics.get(rm + "parse_rate")
    if not parse or parse["value"] is None or parse["value"] >= MIN_PARSE_RATE:
        return None
    voided = sorted(k for k in metrics if k.startswith((rm, vs)) and k != rm + "parse_rate")
    return {
        "failed": round((1 - parse["value"]) * parse["n"]),
        "n": parse["n"],
        "parse_rate": parse["value"],
        "floor": MIN_PARSE_RATE,
        "metrics": voided,
    }


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
    _, _, f1 = bert_score.score(
        hyps, refs, model_type=model_dir, num_layers=layers, device=device, use_fast_tokenizer=True
    )
    return f1.tolist()


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
    return {
        f"pass@{k}": [(pass_at_k(len(rs), sum(r["passed"] for r in rs), k), 1) for rs in ok] for k in ks if k <= n
    }, broken


def code_test_rows(name, records, hyps, gen_fp, args, cache_dir) -> tuple[dict[str, list], list[str]]:
    """The code task: policy `name`'s completions against the benchmark's tests in the sandbox (tasks.code.run_tests,
    --test-workers at a time, cached in <name>.tests.jsonl), as pass_at_k_rows; a warning names the problems whose
    tests cannot run."""
    from tasks.code import run_tests

    items = [{"id": r["id"], "response": h, "test": r["test"]} for r, h in zip(records, hyps)]
    runs = cached(
        cache_dir / f"{name}.tests.jsonl",
        fingerprint(gen_fp, args.test_timeout, "tests-v2"),
        items,
        lambda chunk: run_tests(chunk, args.test_timeout, args.test_workers),
        16,
        f"tests {name}",
        args.regenerate,
    )
    scores, broken = pass_at_k_rows(runs, records)
    if broken:
        print(
            f"warning: {name}: the tests of {len(broken)} problems cannot run, left out of pass@k: "
            f"{', '.join(broken[:5])}{' ...' if len(broken) > 5 else ''}",
            file=sys.stderr,
        )
    return scores, broken
