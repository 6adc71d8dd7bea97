"""--alpaca-eval, --alpaca-eval-reference, --alpaca-eval-glm: AlpacaEval 2.0's raw and length-controlled win rates.

Each --policy's answers are judged against the reference answers of --reference-field (AlpacaEval 2.0: GPT-4 Turbo's
outputs, the "output" field of alpaca_eval_gpt4_baseline.json) by 04's own judge (--judge-base-url, evaluation/judge.py:
the order random per prompt and undone, "Winner: A/B/tie"). Its verdicts and the two answers' lengths become the
alpaca_eval package's annotations (annotations: preference 2 where the policy wins, 1 where the reference does, 1.5
for a tie; an invalid verdict is left out), and the package computes both numbers (length_controlled): the raw win
rate (get_winrate: wins + ties / 2) and the length-controlled one (get_length_controlled_winrate: a logistic GLM of the
preference on tanh of the standardised length difference, the instruction's difficulty and the model, whose predicted
win rate at zero length difference is the LC win rate). Nothing of the formula is re-derived here.

Which GLM (--alpaca-eval-glm): length_controlled_v1 is AlpacaEval 2.0's, the leaderboard's and the paper's; it needs
each instruction's difficulty and the package's regularising annotations (df_gamed.csv, which the package fetches
from the hub dataset tatsu-lab/alpaca_eval and huggingface_hub caches), so the prompts must be AlpacaEval's 805, in
its order (the record's position is its index there). length_controlled_minimal drops the difficulty term: for any
other prompts, whose difficulty nobody measured. The package still looks the difficulty up for it; it gets a table
of zeros (neutral_difficulty) instead of the hub's, which the formula then never reads. auto: v1 when --data is one of
AlpacaEval's files (alpaca_eval*.json), else minimal.

Intervals: the raw win rate's is 04's 95% bootstrap over the prompts; the LC win rate's is a bootstrap over the prompts
too, the package's GLM refitted on each resample (lc_bootstrap), or "n/a" with the reason. Not +-1.96 times the
package's lc_standard_error (what the leaderboard prints): that is the spread of its predictions over the instructions,
not of the estimate, and the minimal GLM predicts the same for every instruction (85.29 [85.29, 85.29], standard error
3.4e-15: issue 68). results.json keeps it as package_stderr. Where a setting
differs from the paper's (another judge, another reference, fewer than AlpacaEval's 805 prompts, the minimal GLM),
not_comparable says so in one line each; the judge's prompt is always 04's pairwise one, not AlpacaEval's annotator's.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import tempfile
from pathlib import Path

from common import DataError
import evaluation
from evaluation import judge

INSTALL = "pip install -r requirements-eval.txt"
PAPER_REFERENCE = "gpt4_1106_preview"  # AlpacaEval 2.0's reference: GPT-4 Turbo's outputs
PAPER_JUDGES = ("gpt-4-1106-preview", "gpt-4-turbo", "gpt-4")  # AlpacaEval 2.0's annotator, and plain GPT-4
N_ALPACA_EVAL = 805


def add_args(p) -> None:
    g = p.add_argument_group("AlpacaEval 2.0 raw and length-controlled win rates (evaluation/alpaca_lc.py)")
    g.add_argument(
        "--alpaca-eval",
        action="store_true",
        help="each policy vs --reference-field's answers, judged by --judge-base-url",
    )
    g.add_argument(
        "--alpaca-eval-reference",
        default=PAPER_REFERENCE,
        metavar="NAME",
        help="who wrote the reference answers (AlpacaEval 2.0: gpt4_1106_preview, GPT-4 Turbo)",
    )
    g.add_argument(
        "--alpaca-eval-glm",
        default="auto",
        choices=["auto", "length_controlled_v1", "length_controlled_minimal"],
        help="the package's GLM (auto: v1 for AlpacaEval's own files, else minimal)",
    )


def require():
    """The package's GLM module, or a one-line DataError naming the install command (alpaca_eval 0.6.6 imports
    pkg_resources, which setuptools 82 removed: requirements-eval.txt pins setuptools below it)."""
    try:
        from alpaca_eval.metrics import glm_winrate
    except ImportError as e:
        raise DataError(f"--alpaca-eval needs the alpaca_eval package ({e}): {INSTALL}") from None
    return glm_winrate


def check(args, names: list[str]) -> None:
    """Before any generation: the package imports, and the run has what the win rates need."""
    if not args.alpaca_eval:
        return
    require()
    if not args.judge_base_url:
        raise DataError("--alpaca-eval needs a judge: --judge-base-url (and --judge-model)")
    if not args.reference_field:
        raise DataError("--alpaca-eval needs the reference's answers: --reference-field (AlpacaEval: output)")
    if args.alpaca_eval_reference in names:
        raise DataError(f"--alpaca-eval-reference {args.alpaca_eval_reference!r} is also a --policy name")


def glm_name(args) -> str:
    if args.alpaca_eval_glm != "auto":
        return args.alpaca_eval_glm
    return "length_controlled_v1" if Path(args.data).name.startswith("alpaca_eval") else "length_controlled_minimal"


def annotations(
    records: list[dict], answers: list[str], verdicts: list[dict], policy: str, reference: str, annotator: str
) -> list[dict]:
    """The package's annotation rows from 04's judge verdicts (evaluation/judge.py's rows: "winner" is a name, "tie", or
    None when invalid): output_1 is the reference's answer, output_2 the policy's, preference 1, 2 or 1.5 (tie); an
    invalid verdict is left out. index is the record's position (AlpacaEval's instruction index)."""
    pref = {reference: 1.0, policy: 2.0, "tie": 1.5}
    by_id = {v["id"]: v for v in verdicts}
    return [
        {
            "index": i,
            "instruction": r["prompt"],
            "output_1": r["reference"],
            "output_2": a,
            "generator_1": reference,
            "generator_2": policy,
            "annotator": annotator,
            "preference": pref[by_id[r["id"]]["winner"]],
        }
        for i, (r, a) in enumerate(zip(records, answers))
        if by_id[r["id"]]["winner"]
    ]


@contextlib.contextmanager
def neutral_difficulty(glm_winrate, n: int):
    """The package's featurisation reads each instruction's difficulty from the hub (df_gamed.csv) even for a GLM
    whose formula has no difficulty term: hand it a table of zeros for n instructions instead."""
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "df_gamed.csv"
        pd.DataFrame({"model": "none", "index": range(n), "instruction_difficulty": 0.0}).to_csv(path, index=False)
        real, glm_winrate.hf_hub_download = glm_winrate.hf_hub_download, lambda *a, **k: str(path)
        try:
            yield
        finally:
            glm_winrate.hf_hub_download = real


def length_controlled(rows: list[dict], glm: str = "length_controlled_v1", n_boot: int = 0, seed: int = 0) -> dict:
    """The package's raw and length-controlled win rates (percent) and their standard errors, for annotations of one
    policy against one reference; and the LC win rate's 95% interval over n_boot resamples (lc_bootstrap)."""
    import pandas as pd

    glm_winrate = require()
    if len(rows) < 10:  # its 5-fold cross-validation needs a few rows per fold
        raise DataError(f"--alpaca-eval: {len(rows)} valid verdicts: the length-controlled GLM needs at least 10")
    df = pd.DataFrame(rows)
    info = glm_winrate.GLM_INFO[glm]

    def fit(d):
        return glm_winrate.get_length_controlled_winrate(
            d, glm_name=glm, save_weights_dir=None, is_warn_extreme_changes=False
        )

    with (
        neutral_difficulty(glm_winrate, int(df["index"].max()) + 1)
        if "instruction_difficulty" not in info["formula"]
        else contextlib.nullcontext()
    ):
        out = fit(df)
        boot = lc_bootstrap(df, fit, n_boot, seed)
    return {
        **{k: float(v) for k, v in out.items() if isinstance(v, numbers.Number) and not isinstance(v, bool)},
        **boot,
    }


def lc_bootstrap(df, fit, n_boot: int, seed: int) -> dict:
    """The LC win rate's 95% interval: the prompts drawn with replacement n_boot times, the package's whole procedure
    (standardised lengths, GLM, cross-validated regularisation) refitted on each, and the 2.5/97.5 percentiles of the
    LC win rates; their standard deviation as its standard error. lc_ci95 None, and lc_ci95_na the reason, where there
    is no interval to give: no resamples, verdicts all alike (every resample is the same data), or most resamples
    unfittable."""
    import numpy as np

    na = {"lc_ci95": None, "lc_boot_stderr": None, "lc_resamples": 0}
    if n_boot < 1:
        return {**na, "lc_ci95_na": "no resamples (--bootstrap 0)"}
    if df["preference"].nunique() == 1:
        alike = {1.0: "losses", 1.5: "ties", 2.0: "wins"}[float(df["preference"].iloc[0])]
        return {**na, "lc_ci95_na": f"all {len(df)} verdicts are {alike}: every resample is the same data"}
    values = []
    for idx in np.random.default_rng(seed).integers(0, len(df), size=(n_boot, len(df))):
        try:
            values.append(float(fit(df.iloc[idx].reset_index(drop=True))["length_controlled_winrate"]))
        except ValueError:  # e.g. every length difference alike: nothing to standardise by
            continue
    values = [v for v in values if not math.isnan(v)]
    if len(values) < n_boot / 2:
        return {**na, "lc_ci95_na": f"the GLM could not be refitted on {n_boot - len(values)} of {n_boot} resamples"}
    lo, hi = (float(v) for v in np.percentile(values, [2.5, 97.5]))
    if hi - lo < 1e-9:
        return {**na, "lc_ci95_na": f"every resample refits to the same LC win rate ({lo:.2f})"}
    return {
        "lc_ci95": [lo, hi],
        "lc_ci95_na": None,
        "lc_boot_stderr": float(np.std(values, ddof=1)),
        "lc_resamples": len(values),
    }


def evaluate(
    records: list[dict], outputs: dict[str, list[str]], policies: list[str], args, cache_dir: Path, fps: dict[str, str]
) -> dict:
    """results.json's "alpaca_eval": each policy's raw and LC win rates against the reference, with intervals, and
    the settings printed beside them. The verdicts are 04's judge's, cached as judge.<policy>_vs_<reference>.jsonl."""
    ref, glm = args.alpaca_eval_reference, glm_name(args)
    refs = [r["reference"] for r in records]
    ref_fp = evaluation.fingerprint(args.data, args.reference_field, args.limit, ref)
    out = {
        "reference": ref,
        "judge": args.judge_model,
        "glm": glm,
        "n_prompts": len(records),
        "data": args.data,
        "policies": {},
    }
    for name in policies:
        pairs = judge.judge_pairs(
            records,
            {name: outputs[name], ref: refs},
            [(name, ref)],
            args.judge_base_url,
            args.judge_model,
            args.seed,
            args.judge_concurrency,
            cache_dir,
            {name: fps[name], ref: ref_fp},
            args.judge_max_tokens,
            args.judge_timeout,
            args.judge_retries,
        )[f"{name}_vs_{ref}"]
        verdicts = judge.cached_verdicts(cache_dir, name, ref, records)
        rows = annotations(records, outputs[name], verdicts, name, ref, args.judge_model)
        lc = length_controlled(rows, glm, args.bootstrap, args.seed)
        raw = evaluation.bootstrap([((r["preference"] - 1), 1) for r in rows], n_boot=args.bootstrap, seed=args.seed)
        out["policies"][name] = {
            "win_rate": {
                "value": lc["win_rate"],
                "ci95": [100 * x for x in raw["ci95"]],
                "n": len(rows),
                "stderr": lc["standard_error"],
            },
            "lc_win_rate": {
                "value": lc["length_controlled_winrate"],
                "n": len(rows),
                "ci95": lc["lc_ci95"],
                "ci95_na": lc["lc_ci95_na"],
                "stderr": lc["lc_boot_stderr"],
                "resamples": lc["lc_resamples"],
                "package_stderr": lc["lc_standard_error"],
            },
            "invalid": pairs["invalid"],
            "wins": lc.get("n_wins"),
            "draws": lc.get("n_draws"),
            "mean_length": sum(len(a) for a in outputs[name]) / len(records),
            "reference_mean_length": sum(len(r) for r in refs) / len(records),
        }
    return out


def not_comparable(res: dict) -> list[str]:
    """Why an AlpacaEval number is not the paper's setting (GPT-4 Turbo's reference, a GPT-4 judge, AlpacaEval's 805
    instructions, the v1 GLM): one line each. The judge's prompt always differs (04's pairwise one)."""
    lines = []
    if res["reference"] != PAPER_REFERENCE:
        lines.append(f"reference {res['reference']}, not GPT-4 Turbo's outputs ({PAPER_REFERENCE})")
    if not any(res["judge"] == j or res["judge"].startswith(j + "-") for j in PAPER_JUDGES):
        lines.append(f"judge {res['judge']}, not GPT-4 (AlpacaEval 2.0: gpt-4-1106-preview)")
    if res["n_prompts"] != N_ALPACA_EVAL:
        lines.append(f"{res['n_prompts']} prompts, not AlpacaEval's {N_ALPACA_EVAL}")
    if res["glm"] != "length_controlled_v1":
        lines.append(f"GLM {res['glm']}, not AlpacaEval 2.0's length_controlled_v1")
    return lines
