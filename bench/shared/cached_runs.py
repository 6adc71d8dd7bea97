"""What the benches that judge policies share (paper_baselines.py, the credit studies, real_critic.py): artefacts cached
in a folder named by a hash of the settings that made them (keyed: a 03 run, ppo; a 04 evaluation, evaluate), read
back from 04's cache of generations (generations, post_mistakes, sequence_kl), and the SmolLM2 reward model's recipe
(RECIPE) that real_critic.py trains with and paper_baselines.py --rm-base gives every reward model."""

import hashlib
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from demo_start import run  # noqa: E402
from infra import models, runs  # noqa: E402

# The SmolLM2 reward model's recipe (bench/real_critic/README.md "Text2Grad with a pretrained critic": the lever table behind it).
RECIPE = [
    "--lora-r",
    "16",
    "--lora-alpha",
    "32",
    "--lora-targets",
    "all-linear",
    "--lr",
    "1e-3",
    "--lr-schedule",
    "linear",
    "--warmup",
    "0.03",
    "--batch-size",
    "8",
    "--eval-steps",
    "100000",
    "--logging-steps",
    "25",
    "--max-new-tokens",
    "128",
    "--max-len",
    "288",
]
# 128 critique tokens: gold critiques of the SFT policy's wrong answers reach 116; inputs reach 130 (<= 288 - 128)

# Bench files a key names, hashed by the path they had before bench/ became one folder per study (issue 78), so an
# artefact cached before the move (a run whose --critic is one of bench/credit/credit_arms.py's arms) keeps its name.
MOVED = {"bench/credit/credit_arms.py": "bench/credit_arms.py"}


def keyed(parent: Path, name: str, settings) -> Path:
    """The folder of an artefact made with `settings`: its name carries their hash. Paths inside the repository are
    hashed relative to it, so an artefact made in another checkout (a lent GPU's) is found under the same name."""
    text = json.dumps(settings, sort_keys=True, default=str).replace(str(ROOT) + "/", "")
    for now, before in MOVED.items():
        text = text.replace(now, before)
    return parent / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def made_of(flags: list[str]) -> dict:
    """The content fingerprint of every file or folder a command line names (models, data): a run is keyed by what
    it starts from, so a reward model retrained in the same folder is a new run, never a stale one reused."""
    return {f: runs.content_fingerprint(f) for f in map(str, flags) if f and Path(f).exists()}  # "": no path


def ppo(folder: Path, name: str, seed: int, steps: int, flags: list[str]) -> tuple[Path, list[str] | None]:
    """One 03 run from the SFT start: (its folder, 03's argv, or None when it is finished). Keyed by its flags and
    the content of what they name; a killed run resumes from its checkpoint, or starts again when it was killed
    before its first one (03 refuses to resume a run without one)."""
    run_dir = keyed(folder, f"{name}_seed{seed}", [*flags, seed, steps, made_of(flags)])
    metrics = run_dir / "metrics.jsonl"
    if (run_dir / "policy").is_dir() and metrics.is_file() and len(common.read_jsonl(metrics)) >= steps:
        return run_dir, None
    again = metrics.is_file() and not (run_dir / "checkpoint.pt").is_file()
    return run_dir, [
        "03_train_policy.py",
        *flags,
        "--seed",
        str(seed),
        "--steps",
        str(steps),
        "--save-every",
        "25",
        "--output-dir",
        str(run_dir),
        "--overwrite" if again else "--resume",
    ]


def generations(path: Path, records: list[dict]) -> list[dict]:
    """04's cached generations, one per record in the records' order, read by id: the cache is append-only, so a
    resumed run or two runs on one folder can hold a row out of order or twice (04 itself keeps the last per id)."""
    by_id = {g["id"]: g for g in common.read_jsonl(path)}
    missing = [r["id"] for r in records if r["id"] not in by_id]
    if missing:
        raise SystemExit(f"{path}: no generation for {len(missing)} of {len(records)} posts (first: {missing[0]})")
    return [by_id[r["id"]] for r in records]


def sequence_kl(policy: str, sft: str, records: list[dict], gens_path: Path, max_new_tokens: int) -> float:
    """KL(pi || pi_SFT) on pi's own samples (04's generations cache at gens_path): the mean over them of
    sum_t log pi(y_t) - log pi_SFT(y_t), the EOS included where one ended the answer (baselines/dpo.py's
    sequence_logprobs: 03's forward; pi_SFT is the LoRA adapter switched off, or the SFT model itself for a full
    fine-tune)."""
    import torch

    sys.path.insert(0, str(ROOT / "baselines"))
    dpo = importlib.import_module("dpo")
    gens = generations(gens_path, records)
    model, tok = models.load_model(policy)
    ref = None if hasattr(model, "peft_config") else models.load_model(sft)[0]
    total = []
    for i in range(0, len(gens), 64):
        queries = [models.policy_prompt(tok, r["prompt"]) for r in records[i : i + 64]]
        answers = [
            g["response_ids"] + ([tok.eos_token_id] if len(g["response_ids"]) < max_new_tokens else [])
            for g in gens[i : i + 64]
        ]
        with torch.no_grad():
            logp, ref_logp = dpo.sequence_logprobs(model, ref, queries, answers, tok.pad_token_id, "cpu", "float32")
        total += (logp - ref_logp).tolist()
    return statistics.fmean(total)


def evaluate(folder: Path, policies: dict, eval_data: Path, extra: list[str] = ()) -> dict:
    """04_evaluate.py on the held-out posts (cached in its folder): {policy: {metric: value}}."""
    out = keyed(folder, "eval", [policies, str(eval_data), *extra])
    if not (out / "results.json").is_file():
        run(
            [
                "04_evaluate.py",
                "--data",
                str(eval_data),
                "--reward-model",
                "none",
                "--output-dir",
                str(out),
                *[f"--policy={n}={p}" for n, p in policies.items()],
                *extra,
            ]
        )
    results = json.loads((out / "results.json").read_text())
    table = {n: {k: m["value"] for k, m in p["metrics"].items()} for n, p in results["policies"].items()}
    return {"table": table, "dir": out}


def post_mistakes(path: Path, records: list[dict]) -> list[float]:
    """1.0 / 0.0 per held-out post, in the eval split's order: does the answer (04's cached generation) have a
    mistake the exact critic flags (demo_mistakes). Two policies' lists pair up post by post."""
    from tasks.demo import demo_mistakes

    return [float(demo_mistakes(r["prompt"], g["response"]) > 0) for r, g in zip(records, generations(path, records))]
