"""One data budget for every method that learns from annotated answers (paper_baselines.py, the credit study's
credit_learned.py): the SFT policy's two answers to held-apart posts, judged by the exact critic (pool_annotations),
the annotated answers of the first N posts that make a preference pair (budget), and 02's three reward models on them
with one recipe (rm_flags, reward_model). Every artefact is cached by its settings (cached_runs.keyed)."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cached_runs import RECIPE, keyed  # noqa: E402

import common  # noqa: E402  (on the path from cached_runs)
from demo_start import run  # noqa: E402
from tasks.demo import demo_dataset  # noqa: E402

# the SmolLM2 reward-model recipe without its batch size, which rm_flags sets per objective
RECIPE_SHARED = [x for i, x in enumerate(RECIPE) if "--batch-size" not in RECIPE[max(i - 1, 0) : i + 1]]


def slug(row: str) -> str:
    return re.sub(r"\W+", "_", row).strip("_")  # "PPO (BT RM)" -> "PPO_BT_RM": a folder, a 04 policy name


def pool_annotations(out: Path, sft: Path, n_posts: int) -> Path:
    """The SFT policy's two answers to each of n_posts posts (the demo's "pairs" split, apart from the PPO prompts
    and the eval posts), judged by the exact critic: 01_annotate.py --generate-with, resumable."""
    pool = keyed(out / "pool", "pool", {"sft": str(sft), "posts": n_posts, "v": 1})
    pool.mkdir(parents=True, exist_ok=True)
    posts = [{**r, "id": f"{r['id']}/{k}"} for r in demo_dataset("pairs", n_posts) for k in "ab"]
    common.write_jsonl(pool / "pool.jsonl", [{k: r[k] for k in ("id", "prompt", "reference")} for r in posts])
    exact = pool / "exact.jsonl"
    if len(common.open_resumable_jsonl(exact)) < len(posts):
        run(
            [
                "01_annotate.py",
                "--task",
                "demo",
                "--dataset",
                str(pool / "pool.jsonl"),
                "--generate-with",
                str(sft),
                "--temperature",
                "1.0",
                "--max-new-tokens",
                "32",
                "--gen-batch-size",
                "64",
                "--annotator",
                "program",
                "--output",
                str(exact),
                "--seed",
                "0",
            ]
        )
    return exact


def budget(annotations: Path, n_pairs: int, folder: Path) -> Path:
    """The annotated answers of the first n_pairs posts that make a preference pair: the data of every method."""
    from baselines.scalar_rm import preference_pairs  # (it imports torch: only where needed, as the bench does)

    records = common.read_jsonl(annotations)
    pairs = preference_pairs(records)
    if len(pairs) < n_pairs:
        sys.exit(f"{annotations}: only {len(pairs)} posts give a pair; raise --pool or lower --pairs")
    keep = {i for p in pairs[:n_pairs] for i in (p["chosen_id"], p["rejected_id"])}
    path = keyed(folder, "budget", {"annotations": str(annotations), "pairs": n_pairs}).with_suffix(".jsonl")
    if not path.is_file():
        common.write_jsonl(path, [r for r in records if r["id"] in keep])
    return path


def reward_model(folder: Path, name: str, flags: list[str]) -> tuple[Path, list[str] | None]:
    """02_train_reward.py with these flags: (its folder, 02's argv, or None when it is finished). Resumable from its
    checkpoints; one saved but killed before its eval.json with none to resume from is trained again (02 refuses to
    resume it)."""
    rm = keyed(folder, name, flags)
    if (rm / "reward_model.json").is_file() and (rm / "eval.json").is_file():
        return rm, None
    again = (rm / "reward_model.json").is_file() and not any((rm / "checkpoints").glob("checkpoint-*"))
    return rm, ["02_train_reward.py", *flags, "--output-dir", str(rm), "--overwrite" if again else "--resume"]


def rm_flags(args, data: Path, sft_data: Path, base: Path) -> dict[str, list[str]]:
    """02's flags of the three reward models, one recipe: the same base, data, steps and answers per step. Without
    --rm-base: 02's demo preset on the bench's toy base (600 steps of 32, full fine-tuning). With it (a pretrained
    chat model, SmolLM2-135M-Instruct): bench/real_critic/real_critic.py's SmolLM2 recipe for all three (LoRA r 16 on every
    linear layer, lr 1e-3, linear decay, 600 steps, float32), each step 8 annotated answers: 8 for the span RM and the
    PRM, 4 pairs of 2 for the Bradley-Terry RM, so every model sees the budget the same number of times."""
    steps = ["--max-steps", str(args.rm_steps)] if args.rm_steps else []
    floor = [] if args.rm_min_parse_rate is None else ["--min-parse-rate", str(args.rm_min_parse_rate)]
    shared = ["--model", str(base), "--data", str(data), *steps, *floor]
    if args.rm_base:
        shared = [
            "--model",
            str(Path(args.rm_base).resolve()),
            "--data",
            str(data),
            *RECIPE_SHARED,
            "--max-steps",
            str(args.rm_steps or 600),
            "--save-steps",
            "100",
            "--no-bf16",
            *floor,
        ]  # float32 on any device
    batch = (
        {"span_rm": ["--batch-size", "8"], "bt_rm": ["--batch-size", "4"], "prm": ["--batch-size", "8"]}
        if args.rm_base
        else {"span_rm": [], "bt_rm": [], "prm": []}
    )
    return {
        "span_rm": [*shared, *batch["span_rm"]],
        "bt_rm": [*shared, "--objective", "pairwise", "--norm-data", str(sft_data), *batch["bt_rm"]],
        "prm": [*shared, "--objective", "prm", *batch["prm"]],
    }
