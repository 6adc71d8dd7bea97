"""--lm-eval-tasks, --lm-eval-fewshot, --lm-eval-include-path: EleutherAI's lm-evaluation-harness on each --policy.

For the paper's Table 4 the task is arc_challenge: each question's answer choices scored by the policy's
log-likelihood after "Question: ...\nAnswer:", accuracy as acc (the likeliest choice is the gold one) and acc_norm (the
likeliest per character of the choice: what the Open LLM Leaderboard reported). The default is 25-shot, the Open LLM
Leaderboard's setting and the one papers on UltraFeedback-trained policies quote beside AlpacaEval 2.0 and MT-Bench;
--lm-eval-fewshot 0 gives the zero-shot number (lower; not the same column).

The harness is called through its Python API (lm_eval.simple_evaluate), not as a command whose JSON 04 would read:
04 already knows each policy's folder, tells a LoRA adapter from a full model (an adapter runs as pretrained=BASE,
peft=ADAPTER, the base named by its adapter_config.json, model_args), checks every folder before any work, and caches
per fingerprint, so one 04 command gives the harness's numbers for every policy, beside the other metrics, with the
same kind of interval. Kept per task and policy: acc and acc_norm with the harness's stderr, a 95% bootstrap interval
over the questions (04's, from the harness's per-question results), the number of questions and shots, and the
harness's and the task's versions. Results are cached in OUTPUT_DIR/eval/<name>.lm_eval.jsonl.

--lm-eval-include-path DIR adds your own task YAMLs (the harness's TaskManager include_path), e.g. a local copy of ARC
read from data_files instead of the hub (docs/table4.md; the tests' ARC-format fixture is one).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import common
from common import DataError
import evaluation

INSTALL = "pip install -r requirements-eval.txt"
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def add_args(p) -> None:
    g = p.add_argument_group("lm-evaluation-harness tasks, e.g. ARC-Challenge (evaluation/lm_eval_tasks.py)")
    g.add_argument(
        "--lm-eval-tasks",
        default=None,
        metavar="TASK,...",
        help="harness tasks to run on each policy, e.g. arc_challenge",
    )
    g.add_argument("--lm-eval-fewshot", type=int, default=25, help="in-context examples (25: the Open LLM Leaderboard)")
    g.add_argument("--lm-eval-limit", type=int, default=None, help="only the first N questions per task (a smoke test)")
    g.add_argument("--lm-eval-batch-size", default="8", help="the harness's batch size (a number, or 'auto')")
    g.add_argument("--lm-eval-include-path", default=None, help="a folder of your own task YAMLs (local data_files)")


def require():
    """The harness, or a one-line DataError naming the install command."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise DataError(f"--lm-eval-tasks needs EleutherAI's lm-evaluation-harness ({e}): {INSTALL}") from None
    return lm_eval, TaskManager


def task_list(args) -> list[str]:
    return [t.strip() for t in (args.lm_eval_tasks or "").split(",") if t.strip()]


def check(args) -> None:
    """Before any generation: the harness imports, --lm-eval-include-path exists, and every task is one it knows."""
    if not task_list(args):
        return
    _, TaskManager = require()
    if args.lm_eval_include_path and not Path(args.lm_eval_include_path).is_dir():
        raise DataError(f"--lm-eval-include-path {args.lm_eval_include_path}: no such directory")
    manager = task_manager(args, TaskManager)
    unknown = [t for t in task_list(args) if t not in manager.all_tasks]
    if unknown:
        raise DataError(
            f"--lm-eval-tasks: {', '.join(unknown)}: not a task the harness knows"
            + (f" (nor one in {args.lm_eval_include_path})" if args.lm_eval_include_path else "")
        )
    for task in task_list(args):
        check_local_data(manager, task, args.lm_eval_fewshot)


def check_local_data(manager, task: str, shots: int) -> None:
    """A task that reads local files (dataset_path json with data_files: a local copy of ARC, as docs/table4.md sets
    one up) has them well-formed before any generation: JSON lines, no file empty, each ARC record's answerKey among
    its labels, and enough questions in the few-shot split for --lm-eval-fewshot. Else the harness fails on them
    after every policy has generated, in a 70-116 line traceback (issue 68). A hub task (allenai/ai2_arc) is the
    harness's own business."""
    entry = manager.task_index.get(task)
    if entry is None or not entry.yaml_path:  # a tag or a Python task: its data is read its own way
        return
    from lm_eval.tasks._yaml_loader import load_yaml  # the harness's reader, its includes merged (pinned: 0.4.13)

    cfg = load_yaml(entry.yaml_path, resolve_func=False)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if cfg.get("dataset_path") != "json" or not files:
        return
    arc = "answerKey" in str(cfg.get("doc_to_target")) and not cfg.get("process_docs")  # ARC's own layout, as read
    counts = {
        split: sum(count_questions(path, task, arc) for path in ([paths] if isinstance(paths, str) else paths))
        for split, paths in (files if isinstance(files, dict) else {"train": files}).items()
    }
    # the harness's few-shot pool (ConfigurableTask.fewshot_docs); drawn from the split evaluated, it leaves the
    # question itself out, so one more is needed
    test = cfg.get("test_split") or cfg.get("validation_split")
    pool = (
        (cfg.get("fewshot_config") or {}).get("split")
        or cfg.get("fewshot_split")
        or cfg.get("training_split")
        or cfg.get("validation_split")
        or test
    )
    if shots and counts.get(pool, shots + 1) < shots + (pool == test):
        names = files[pool] if isinstance(files, dict) else files
        raise DataError(
            f"{', '.join([names] if isinstance(names, str) else names)}: {counts[pool]} questions in split "
            f"'{pool}' of task {task}, fewer than --lm-eval-fewshot {shots} takes"
        )


def count_questions(path: str, task: str, arc: bool) -> int:
    """The records of one local data file, each ARC record checked as the harness's arc_easy.yaml reads it
    (question; choices.text and choices.label; choices.label.index(answerKey)). DataError 'file:line: field ...'."""
    from infra.data import DATA_FILE_SUFFIXES, read_rows

    if "://" in path:  # a URL: the harness fetches it
        return 1
    rows = (
        read_rows(path)
        if path.endswith(DATA_FILE_SUFFIXES)
        else [(f"{path}:{n}", r) for n, r in common.iter_jsonl(path)]
    )  # the json builder reads any name as JSON lines
    if not rows:
        raise DataError(f"{path}: no questions (a data file of task {task})")
    for where, rec in rows if arc else ():
        choices = rec.get("choices") if isinstance(rec.get("choices"), dict) else {}
        labels, texts = choices.get("label"), choices.get("text")
        if not isinstance(rec.get("question"), str):
            raise DataError(f"{where}: field 'question' must be a string (task {task})")
        if not (
            isinstance(labels, list)
            and isinstance(texts, list)
            and len(labels) == len(texts) > 0
            and all(isinstance(x, str) for x in labels + texts)
        ):
            raise DataError(
                f"{where}: field 'choices' must hold 'text' and 'label', lists of strings of one length (task {task})"
            )
        if rec.get("answerKey") not in labels:
            raise DataError(
                f"{where}: field 'answerKey' is {rec.get('answerKey')!r}, not one of the labels in "
                f"'choices' ({', '.join(labels)}) (task {task})"
            )
    return len(rows)


def task_manager(args, TaskManager):
    """The harness's TaskManager: only --lm-eval-include-path's tasks when it holds them all (indexing the harness's
    ~15,000 built-in tasks takes ~20 s on a CPU core), else those and the built-in ones; made once per run."""
    include = args.lm_eval_include_path
    if include:
        own = _manager(TaskManager, include, False)
        if all(t in own.all_tasks for t in task_list(args)):
            return own
    return _manager(TaskManager, include, True)


@functools.lru_cache(maxsize=4)
def _manager(TaskManager, include: str | None, defaults: bool):
    return TaskManager(include_path=include, include_defaults=defaults)


def model_args(path: str, dtype: str) -> dict:
    """The harness's HF model arguments for a policy: a plain folder or hub id as pretrained=PATH; a LoRA adapter
    folder (adapter_config.json) as its base plus peft=ADAPTER, with the adapter's tokenizer where it saved one."""
    out = {"pretrained": path, "dtype": DTYPES.get(dtype, dtype)}
    config = Path(path) / "adapter_config.json"
    if config.is_file():
        base = json.loads(config.read_text()).get("base_model_name_or_path")
        if not base:
            raise DataError(f"{config}: missing field 'base_model_name_or_path'")
        out.update(pretrained=base, peft=path)
        if (Path(path) / "tokenizer_config.json").is_file():
            out["tokenizer"] = path
    return out


def run_policy(name: str, path: str, args, cache_dir: Path) -> dict:
    """{task: results} of the harness on policy `name` (cached in <name>.lm_eval.jsonl)."""
    lm_eval, TaskManager = require()
    fp = evaluation.fingerprint(
        path, args.dtype, args.lm_eval_fewshot, args.lm_eval_limit, args.seed, lm_eval.__version__, "lm-eval-v1"
    )

    def compute(chunk):
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=model_args(path, args.dtype),
            tasks=[it["id"] for it in chunk],
            num_fewshot=args.lm_eval_fewshot,
            batch_size=args.lm_eval_batch_size,
            device=args.device,
            limit=args.lm_eval_limit,
            task_manager=task_manager(args, TaskManager),
            log_samples=True,
            random_seed=args.seed,
            fewshot_random_seed=args.seed,
        )
        rows = []
        for it in chunk:
            res, samples = out["results"][it["id"]], out["samples"].get(it["id"], [])
            number = lambda k: res.get(k) if isinstance(res.get(k), (int, float)) else None  # noqa: E731 "N/A"
            rows.append(
                {
                    "id": it["id"],
                    "n_shot": out["n-shot"].get(it["id"]),
                    "n": len(samples),
                    "harness": out.get("lm_eval_version") or lm_eval.__version__,
                    "task_version": out["versions"].get(it["id"]),
                    **{m: number(f"{m},none") for m in ("acc", "acc_norm")},
                    **{f"{m}_stderr": number(f"{m}_stderr,none") for m in ("acc", "acc_norm")},
                    "per_question": [[s.get("acc"), s.get("acc_norm")] for s in samples],
                }
            )
        return rows

    rows = evaluation.cached(
        cache_dir / f"{name}.lm_eval.jsonl",
        fp,
        [{"id": t} for t in task_list(args)],
        compute,
        len(task_list(args)),
        f"lm-eval {name}",
        args.regenerate,
    )
    return {r["id"]: summarize(r, args.bootstrap, args.seed) for r in rows}


def summarize(row: dict, n_boot: int = 1000, seed: int = 0) -> dict:
    """A task's numbers for results.json: the harness's acc and acc_norm with its stderr, and 04's 95% bootstrap
    interval over the questions (acc_norm only where the task has it)."""
    out = {k: row[k] for k in ("n", "n_shot", "harness", "task_version")}
    for i, metric in enumerate(("acc", "acc_norm")):
        if row[metric] is None:
            continue
        per = [(float(q[i]), 1) for q in row["per_question"] if q[i] is not None]
        out[metric] = {
            **evaluation.bootstrap(per or [(0.0, 0)], n_boot=n_boot, seed=seed),
            "value": row[metric],
            "stderr": row[f"{metric}_stderr"],
        }
    return out


def evaluate(policies: dict[str, str], args, cache_dir: Path) -> dict:
    """results.json's "lm_eval": the tasks' settings and each policy's numbers."""
    lm_eval, _ = require()
    return {
        "tasks": task_list(args),
        "num_fewshot": args.lm_eval_fewshot,
        "limit": args.lm_eval_limit,
        "harness": lm_eval.__version__,
        "include_path": args.lm_eval_include_path,
        "policies": {name: run_policy(name, path, args, cache_dir) for name, path in policies.items()},
    }


def not_comparable(res: dict) -> list[str]:
    """Why an ARC-Challenge number is not the paper's setting (the full test set, 25-shot): one line each."""
    lines = []
    if "arc_challenge" not in res["tasks"]:
        lines.append(f"tasks {', '.join(res['tasks'])}: not the harness's arc_challenge")
    if res["num_fewshot"] != 25:
        lines.append(f"{res['num_fewshot']}-shot, not 25-shot as the Open LLM Leaderboard ran ARC-Challenge")
    if res["limit"]:
        lines.append(f"only the first {res['limit']} questions (--lm-eval-limit)")
    return lines
