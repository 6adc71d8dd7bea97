"""--alpaca-eval, --lm-eval-tasks, --mt-bench: the paper's Table 4 (§4.5) columns for 04's policies, and their report.

The paper puts its UltraFeedback policies side by side with three numbers, each from its standard owner: AlpacaEval
2.0's length-controlled win rate (the alpaca_eval package's GLM over 04's judge's verdicts against the reference
answers: evaluation/alpaca_lc.py), ARC-Challenge accuracy (EleutherAI's lm-evaluation-harness through its Python API:
evaluation/lm_eval_tasks.py) and the MT-Bench score (FastChat's single-answer grading, its prompts and 80 two-turn
questions: evaluation/mt_bench.py). This module gives 04 their flags (add_args), checks them before any generation
(check), computes what was asked for after 04's own metrics (evaluate: results.json's "table4"), and shows it: a table
per policy with each number's 95% interval and the settings it was computed under, and one line for each way a setting
differs from the paper's, so a number that is not comparable with Table 4 says so (render_html, console_lines).
docs/table4.md has the commands and what each needs.
"""

from __future__ import annotations

import html

from common import DataError
from evaluation import alpaca_lc, lm_eval_tasks, mt_bench
from infra import serving


def add_args(p) -> None:
    for module in (alpaca_lc, lm_eval_tasks, mt_bench):
        module.add_args(p)


def check(args, names: list[str]) -> None:
    """Before any generation: each asked-for metric's package imports, its flags fit, its files read, and the MT-Bench
    judge (when it is another model than --judge-model, which 04 already checked) answers."""
    for flag, value, least in (
        ("--mt-bench-limit", args.mt_bench_limit, 1),
        ("--lm-eval-limit", args.lm_eval_limit, 1),
        ("--lm-eval-fewshot", args.lm_eval_fewshot, 0),
    ):
        if value is not None and value < least:  # --mt-bench-limit 0 generated every answer, then had no file to read
            raise DataError(f"{flag} {value}: at least {least}")
    alpaca_lc.check(args, names)
    lm_eval_tasks.check(args)
    if args.mt_bench:
        if not args.judge_base_url:
            raise DataError("--mt-bench needs a judge: --judge-base-url (and --judge-model or --mt-bench-judge-model)")
        mt_bench.read_questions(args.mt_bench_questions, args.mt_bench_references, args.mt_bench_limit)
        mt_bench.read_prompts()
        if args.mt_bench_judge_model and args.mt_bench_judge_model != args.judge_model:
            serving.check_server(
                args.judge_base_url,
                args.mt_bench_judge_model,
                "chat",
                args.judge_timeout,
                min(args.judge_retries, 2),
                "--judge-base-url",
                {"temperature": 0.0, "max_tokens": 2048},
            )


def evaluate(
    args, records, policies: dict[str, str], gens: dict[str, list[dict]], fps: dict[str, str], cache_dir, load
) -> dict:
    """{"table4": {...}} with the metrics asked for (none: {}). load(path, args, flag) -> (model, tokenizer): 04's."""
    out = {}
    if args.alpaca_eval:
        outputs = {name: [g["response"] for g in gens[name]] for name in policies}
        out["alpaca_eval"] = alpaca_lc.evaluate(records, outputs, list(policies), args, cache_dir, fps)
    if lm_eval_tasks.task_list(args):
        out["lm_eval"] = lm_eval_tasks.evaluate(
            {n: p for n, p in policies.items() if not n.endswith("+reflect")}, args, cache_dir
        )
    if args.mt_bench:
        out["mt_bench"] = mt_bench.evaluate(
            {n: p for n, p in policies.items() if not n.endswith("+reflect")},
            args,
            cache_dir,
            lambda name, path: load(path, args, f"--policy {name}="),
        )
    return {"table4": out} if out else {}


# ----------------------------------------------------------------------------------------------------------------------
# What the report and the console show: per policy, each number with its interval; the settings; comparability
# ----------------------------------------------------------------------------------------------------------------------


def columns(t4: dict) -> list[tuple[str, str, callable]]:
    """(header, settings, policy -> metric dict or None) of each column computed, in Table 4's order."""
    cols = []
    if "alpaca_eval" in t4:
        a = t4["alpaca_eval"]
        settings = (
            f"judge {a['judge']} vs reference {a['reference']}, {a['n_prompts']} prompts, GLM {a['glm']}, "
            f"alpaca_eval's get_length_controlled_winrate"
        )
        for key, head in (
            ("lc_win_rate", "AlpacaEval 2.0 LC win rate (%)"),
            ("win_rate", "AlpacaEval 2.0 win rate (%)"),
        ):
            cols.append((head, settings, lambda n, a=a, key=key: (a["policies"].get(n) or {}).get(key)))
    if "lm_eval" in t4:
        e = t4["lm_eval"]
        for task in e["tasks"]:
            for metric in ("acc_norm", "acc"):
                settings = f"lm-evaluation-harness {e['harness']}, {task}, {e['num_fewshot']}-shot" + (
                    f", first {e['limit']}" if e["limit"] else ""
                )
                cols.append(
                    (
                        f"{'ARC-C' if task == 'arc_challenge' else task} {metric}",
                        settings,
                        lambda n, e=e, task=task, metric=metric: ((e["policies"].get(n) or {}).get(task) or {}).get(
                            metric
                        ),
                    )
                )
    if "mt_bench" in t4:
        m = t4["mt_bench"]
        settings = f"judge {m['judge']}, {m['n_questions']} questions, FastChat's single-answer prompts"
        for key, head in (("mean", "MT-Bench score"), ("turn1", "MT-Bench turn 1"), ("turn2", "MT-Bench turn 2")):
            cols.append((head, settings, lambda n, m=m, key=key: (m["policies"].get(n) or {}).get(key)))
    return cols


def caveats(t4: dict) -> list[str]:
    """One line per way a number's setting differs from the paper's Table 4."""
    lines = []
    for key, label, module in (
        ("alpaca_eval", "AlpacaEval 2.0", alpaca_lc),
        ("lm_eval", "ARC-Challenge", lm_eval_tasks),
        ("mt_bench", "MT-Bench", mt_bench),
    ):
        lines += [
            f"{label}: not comparable with the paper's Table 4: {why}"
            for why in (module.not_comparable(t4[key]) if key in t4 else [])
        ]
    if "alpaca_eval" in t4:
        lines.append(
            "AlpacaEval 2.0: the preference is 04's pairwise judge prompt (win/tie/loss), not AlpacaEval's "
            "weighted_alpaca_eval_gpt4_turbo annotator (a logprob-weighted preference): close, not identical"
        )
    return lines


def invalid_lines(t4: dict) -> list[str]:
    """The judges' invalid verdicts, which count nowhere, and why an interval is n/a."""
    lines = [
        f"AlpacaEval {name}: LC win rate's interval n/a: {p['lc_win_rate']['ci95_na']}"
        for name, p in (t4.get("alpaca_eval") or {}).get("policies", {}).items()
        if p["lc_win_rate"].get("ci95_na")
    ]
    for name, p in (t4.get("mt_bench") or {}).get("policies", {}).items():
        if sum(p["invalid"].values()):
            lines.append(
                f"MT-Bench {name}: invalid verdicts (no [[rating]]): turn 1: {p['invalid']['turn1']}, "
                f"turn 2: {p['invalid']['turn2']}"
            )
    for name, p in (t4.get("alpaca_eval") or {}).get("policies", {}).items():
        if p["invalid"]:
            lines.append(f"AlpacaEval {name}: {p['invalid']} invalid verdicts left out")
    return lines


def fmt(m) -> tuple[str, str]:
    """(value, interval) of a metric dict, as text."""
    if not m or m.get("value") is None:
        return "–", ""
    f = lambda v: "–" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}"  # noqa: E731
    if m.get("ci95_na"):  # no interval to give: the reason is among the notes
        return f(m["value"]), "[n/a]"
    lo, hi = m.get("ci95") or [None, None]
    return f(m["value"]), f"[{f(lo)}, {f(hi)}]"


def console_lines(results: dict) -> list[str]:
    """The Table 4 block under 04's console table: one row per column, policies across; caveats after."""
    t4 = results.get("table4")
    if not t4:
        return []
    names = list(results["policies"])
    rows = [["Table 4 (paper §4.5)", *names]] + [
        [head, *(" ".join(fmt(get(n))).strip() for n in names)] for head, _, get in columns(t4)
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    seen = []
    for head, settings, _ in columns(t4):
        if settings not in seen:
            seen.append(settings)
            out.append(f"  {head.split(' ')[0]}: {settings}")
    return out + [f"note: {line}" for line in caveats(t4) + invalid_lines(t4)]


def render_html(results: dict) -> str:
    """The report's Table 4 section: the numbers with their intervals, the settings beside each, the caveats."""
    t4, esc = results.get("table4"), html.escape
    if not t4:
        return ""
    names = list(results["policies"])
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    rows = []
    for header, settings, get in columns(t4):
        cells = "".join("<td>{}<span class='ci'>{}</span></td>".format(*map(esc, fmt(get(n)))) for n in names)
        rows.append(f"<tr><td>{esc(header)}<span class='ci'>{esc(settings)}</span></td>{cells}</tr>")
    notes = "".join(f"<li>{esc(line)}</li>" for line in caveats(t4) + invalid_lines(t4))
    return (
        f"<h2 id='table4'>Table 4: AlpacaEval 2.0, ARC-Challenge, MT-Bench</h2><table class='table4'><tr><th>"
        f"metric</th>{head}</tr>{''.join(rows)}</table>"
        + (f"<ul class='caveats'>{notes}</ul>" if notes else "")
        + "<p class='note'>Each value has its 95% interval below it: a bootstrap over the prompts or questions "
        "(for the LC win rate, alpaca_eval's GLM refitted on each resample). docs/table4.md says how each "
        "number is computed and what the paper's setting is.</p>"
    )
