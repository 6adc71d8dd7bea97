"""The paper's scalar reward-model baselines (§4.3, App. N): PPO with a Bradley-Terry reward model, and PRM-PPO with
a process reward model. Not a script: stage 2 trains them (02_train_reward.py --objective pairwise | prm) and stage 3
uses them as its critic (03_train_policy.py --critic scalar-rm | prm: critics/scalar.py, which reads their scores
here).

    python 02_train_reward.py --objective pairwise --data pairs.jsonl --output-dir runs/demo/bt_rm   # PPO's RM
    python 02_train_reward.py --objective pairwise --data HuggingFaceH4/ultrafeedback_binarized --split train_prefs
    python 02_train_reward.py --objective prm --data runs/demo/annotations.jsonl --output-dir runs/demo/prm  # PRM-PPO's
    python 03_train_policy.py --critic scalar-rm --reward-model runs/demo/bt_rm --output-dir runs/demo/ppo_bt  # PPO
    python 03_train_policy.py --critic prm --reward-model runs/demo/prm --output-dir runs/demo/prm_ppo     # PRM-PPO

Both are the same LM as the generative reward model with a scalar head (sequence classification), trained by stage
2's Trainer set-up (infra/training.py: make_trainer: checkpoints, --resume, DDP) and saved as stage 2 saves
(infra/reward_models.py: save_reward_model).
pairwise: -log sigmoid(r_c - r_r) on chosen / rejected pairs, a dataset's own fields or, from annotations, the answer
with fewer poor spans chosen over the other answer to the same prompt; the held-out pairwise accuracy goes to
eval.json, and reward_model.json gets score_bias, the mean score of --norm-data's demonstrations (Huang et al. 2024).
prm: binary cross-entropy of each step's score (clauses; code: blocks) against "no poor span falls in it". Stage 3
refuses each where the other kind is needed (reward_model.json's objective, infra.reward_models.check_reward_model).

02's flags for them (add_train_args): pairwise reads --data's --prompt-field, --chosen-field and --rejected-field
(a hub dataset's --split); a dataset without the chosen field is read as annotations of 01_annotate.py, of whose
responses to one prompt the one with fewer poor spans is chosen (preference_pairs). --norm-data (--norm-field) are the
demonstrations whose mean score becomes 0, by default the training pairs' answers. prm cuts responses into steps by
--step-unit (split_steps: clauses, or blocks for --task code).

The file reads top to bottom: the losses; the pairs (DPO's too: baselines/dpo.py); the steps and their labels; the
model's input and scores, the same in training and in use (critics/scalar.py: 03's --critic scalar-rm | prm);
training (main_scalar, 02's --objective pairwise | prm).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import time
from pathlib import Path

import torch

import common
from infra import models, reward_models, trainable, training
from infra.data import load_annotations, read_rows, split_records


# ----------------------------------------------------------------------------------------------------------------------
# The losses (pure tensor functions)
# ----------------------------------------------------------------------------------------------------------------------


def bradley_terry_loss(r_chosen, r_rejected):
    """-log sigmoid(r_c - r_r), the mean over pairs (Bradley-Terry, as in Ouyang et al. 2022, eq. 1). (B,), (B,)"""
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean()


def prm_loss(scores, labels, mask):
    """Binary cross-entropy of each step's score, a logit of "this step is right", against its label (1 right, 0
    wrong), the mean over the steps under mask (Lightman et al. 2023). (B, S) each -> ()"""
    bce = torch.nn.functional.binary_cross_entropy_with_logits(scores, labels, reduction="none")
    return (bce * mask).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------------------------------
# Preference pairs (the Bradley-Terry reward model, and DPO: baselines/dpo.py): a dataset's chosen / rejected
# fields, or annotations of 01_annotate.py (App. N)
# ----------------------------------------------------------------------------------------------------------------------


def preference_pairs(records: list[dict]) -> list[dict]:
    """Preference pairs from annotations (App. N): of the responses to one prompt, the best is chosen over the worst,
    one pair per prompt, in the order the prompts first appear. Better means: tests passed over failed, where every
    response of the prompt says ("passed", the code task), then fewer poor spans. A prompt whose responses all tie
    gives no pair; records with status "failed" take no part. Each pair: {"id", "prompt", "chosen", "rejected",
    "chosen_id", "rejected_id"}."""
    groups: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("status", "ok") != "failed":
            groups.setdefault(rec["prompt"], []).append(rec)
    pairs = []
    for prompt, recs in groups.items():
        tests = all(isinstance(r.get("passed"), bool) for r in recs)
        rank = lambda r: (tests and not r["passed"], len(r["poor_spans"]))  # noqa: E731 - lower is better
        best, worst = min(recs, key=rank), max(recs, key=rank)
        if rank(best) < rank(worst):
            pairs.append(
                {
                    "id": f"{best.get('id')}>{worst.get('id')}",
                    "prompt": prompt,
                    "chosen": best["response"],
                    "rejected": worst["response"],
                    "chosen_id": best.get("id"),
                    "rejected_id": worst.get("id"),
                }
            )
    return pairs


def _answer_text(value, where: str, field: str) -> str:
    """A chosen / rejected value as text: a string, or a chat (a list of {"role", "content"} messages, as UltraFeedback
    binarized stores them) whose last message is the answer."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content")
    if not isinstance(value, str):
        raise common.DataError(f"{where}: field '{field}' must be a string or a chat whose last message is the answer")
    return value


def dataset_pairs(
    rows: list[tuple[str, dict]],
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> list[dict]:
    """Preference pairs from a dataset's own fields ([(where, row)] of read_rows: a JSONL file or a hub dataset):
    [{"id", "prompt", "chosen", "rejected"}]. DataError naming the record and field when one is missing or no text."""
    pairs = []
    for i, (where, row) in enumerate(rows):
        for f in (prompt_field, chosen_field, rejected_field):
            if f not in row:
                raise common.DataError(f"{where}: missing field '{f}'")
        if not isinstance(row[prompt_field], str):
            raise common.DataError(f"{where}: field '{prompt_field}' must be a string")
        pairs.append(
            {
                "id": str(row.get("id", i)),
                "prompt": row[prompt_field],
                "chosen": _answer_text(row[chosen_field], where, chosen_field),
                "rejected": _answer_text(row[rejected_field], where, rejected_field),
            }
        )
    return pairs


def load_pairs(
    path: str,
    split: str = "train",
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> tuple[list[dict], str]:
    """(preference pairs, where they came from). A dataset whose first record has the chosen or rejected field (a JSONL,
    .json or .parquet file, or a hub id such as HuggingFaceH4/ultrafeedback_binarized) gives its own pairs
    (dataset_pairs); annotations of 01_annotate.py give one pair per prompt, fewer poor spans (tests passed)
    winning (preference_pairs, App. N). DataError naming the file, line and field on a bad record."""
    rows = read_rows(path, split)
    if not rows:
        raise common.DataError(f"{path}: no records")
    where, first = rows[0]
    if chosen_field in first or rejected_field in first:
        return dataset_pairs(rows, prompt_field, chosen_field, rejected_field), "the dataset's pairs"
    if "response" not in first or "poor_spans" not in first:
        raise common.DataError(
            f"{where}: missing field '{chosen_field}' (a preference dataset: --chosen-field, "
            f"--rejected-field) or 'response' and 'poor_spans' (annotations of 01_annotate.py)"
        )
    records, _ = load_annotations(path)
    pairs = preference_pairs(records)
    if not pairs:
        raise common.DataError(
            f"{path}: no preference pairs: no prompt has two responses that differ in their poor "
            f"spans ({len(records)} usable records; sample two answers per prompt, then annotate)"
        )
    return pairs, "annotations (fewer poor spans wins)"


# ----------------------------------------------------------------------------------------------------------------------
# Steps (the process reward model, App. N): a response cut into steps (02 --step-unit: common.STEP_UNITS), each
# labelled wrong where a poor span falls in it
# ----------------------------------------------------------------------------------------------------------------------

_CLAUSE_WORDS = r"\b(?:and|but|that|which|who|while|because|so|then)\b"
_BLOCK_CONTINUES = ("elif", "else", "except", "finally", ")", "]", "}")  # lines that carry on the block above them


def split_steps(text: str, unit: str = "clause") -> list[tuple[int, int]]:
    """The steps of a response (App. N) as character intervals [start, end), in order, from each step's first to its
    last non-space character. "clause" (summaries): a step ends at , ; : . ! ? and before a conjunction or relative
    pronoun (and, but, that, which, who, while, because, so, then); "block" (code): a line at column 0 with the
    indented and blank lines after it (a statement, or a def / class / loop with its body; elif, else, except and
    finally stay in their block)."""
    if unit == "clause":
        starts = {m.end() for m in re.finditer(r"[,;:.!?]\s+", text)} | {
            m.start() for m in re.finditer(_CLAUSE_WORDS, text, re.IGNORECASE)
        }
    elif unit == "block":
        starts = {
            m.start()
            for m in re.finditer(r"^\S", text, re.MULTILINE)
            if not re.match(rf"(?:{'|'.join(map(re.escape, _BLOCK_CONTINUES))})", text[m.start() :])
        }
    else:
        raise ValueError(f"unknown step unit {unit!r}: one of {', '.join(common.STEP_UNITS)}")
    bounds, steps = sorted(starts | {0}), []
    for a, b in zip(bounds, bounds[1:] + [len(text)]):
        piece = text[a:b]
        if piece.strip():
            steps.append((a + len(piece) - len(piece.lstrip()), a + len(piece.rstrip())))
    return steps


def step_labels(text: str, steps: list[tuple[int, int]], good_spans: list[str], poor_spans: list[str]) -> list[int]:
    """A process reward model's binary labels (App. N): 1 for a right step, 0 for a wrong one, a step that a poor span
    overlaps (the spans located as stage 3 locates them: common.locate_spans)."""
    poor = common.locate_spans(text, good_spans, poor_spans)[1]
    return [int(not any(a < e and s < b for a, b in poor)) for s, e in steps]


def token_at(offsets: list[tuple[int, int]], end: int) -> int:
    """The index of the token that holds the character before `end`: the last token starting before it (0 if none)."""
    return max((i for i, (s, _) in enumerate(offsets) if s < end), default=0)


# ----------------------------------------------------------------------------------------------------------------------
# The model: a scalar head on the LM. Its input and its scores, the same in training (02) and in use (03)
# ----------------------------------------------------------------------------------------------------------------------


def scalar_rm_input(tokenizer, prompt: str, response: str, max_prompt_tokens: int | None = None):
    """A scalar reward model's input, the same in training (02) and in use (03): the prompt as a policy with this
    tokenizer sees it (infra.models.policy_prompt: its chat template if it has one, cut from the start to
    max_prompt_tokens), the response's tokens, and an EOS, at which the response's score is read (Huang et al. 2024).
    Returns (ids, the index of the response's first token, the response tokens' character intervals)."""
    query = models.policy_prompt(tokenizer, prompt, "auto", max_prompt_tokens)
    answer = tokenizer(response, add_special_tokens=False)["input_ids"]
    return query + answer + [tokenizer.eos_token_id], len(query), common.decode_with_offsets(tokenizer, answer)[1]


def scalar_rm_scores(model, input_ids, attention_mask):
    """(B, T): a scalar reward model's score at every position of left-padded rows, its score head on the last hidden
    state (post final norm). The caller reads the positions it needs: the EOS for a whole response, each step's last
    token for a process reward model. (transformers' own pooling reads the last token that is not the pad id: the token
    before the EOS when pad == EOS, as in SmolLM2.) Under DDP, the forward runs through the wrapper."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        output_hidden_states=True,
        use_cache=False,
    )
    return getattr(model, "module", model).score(out.hidden_states[-1]).squeeze(-1).float()


def score_responses(
    model,
    tokenizer,
    prompts: list[str],
    responses: list[str],
    steps: list | None = None,
    max_prompt_tokens: int | None = None,
    batch_size: int = 32,
) -> list[list[float]]:
    """A scalar reward model's raw scores of each response: [its score at the EOS] (steps None), or for a process
    reward model one score per step (steps[i]: split_steps' intervals of responses[i]), read at the token that holds
    the step's last character. Batched, left-padded, no grad."""
    device, out = next(model.parameters()).device, []
    for i in range(0, len(prompts), batch_size):
        rows, where = [], []
        for j in range(i, min(i + batch_size, len(prompts))):
            ids, first, offsets = scalar_rm_input(tokenizer, prompts[j], responses[j], max_prompt_tokens)
            rows.append(ids)
            where.append([len(ids) - 1] if steps is None else [first + token_at(offsets, e) for _, e in steps[j]])
        ids, mask = models.left_pad(rows, tokenizer.pad_token_id)
        with torch.no_grad():
            scores = scalar_rm_scores(model, ids.to(device), mask.to(device)).cpu()
        for k, (row, positions) in enumerate(zip(rows, where)):
            shift = ids.shape[1] - len(row)  # left padding
            out.append([scores[k, shift + p].item() for p in positions])
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Training (02_train_reward.py --objective pairwise | prm): its flags, examples, batches, the loss, held-out metrics
# ----------------------------------------------------------------------------------------------------------------------


def add_train_args(p) -> None:
    """02's flags for --objective pairwise | prm."""
    g = p.add_argument_group("the paper's scalar baselines: --objective pairwise, prm (baselines/scalar_rm.py)")
    g.add_argument("--split", default="train", help="pairwise, --data a hub dataset: its split")
    g.add_argument("--prompt-field", default="prompt", help="pairwise, a preference dataset: the prompt field")
    g.add_argument(
        "--chosen-field",
        default="chosen",
        help="pairwise: the preferred answer's field (without it: pairs from annotations, preference_pairs)",
    )
    g.add_argument("--rejected-field", default="rejected", help="pairwise: the other answer's field")
    g.add_argument(
        "--norm-data",
        help="pairwise: JSONL of demonstrations whose mean score becomes 0 (default: the training pairs' answers)",
    )
    g.add_argument("--norm-field", default="response", help="pairwise: the demonstration field of --norm-data")
    g.add_argument(
        "--step-unit",
        choices=common.STEP_UNITS,
        help="prm: how responses are cut into steps, split_steps (default: block for --task code, else clause)",
    )


def check_train_args(args) -> None:
    """02's parse_args: --step-unit's default by --task."""
    args.step_unit = args.step_unit or ("block" if args.task == "code" else "clause")


def encode_scalar(
    tokenizer, items: list[dict], objective: str, max_len: int, max_prompt_tokens: int, step_unit: str = "clause"
) -> tuple[list[dict], dict]:
    """Encoded examples and {"ok", "too_long"} counts. pairwise: {"chosen", "rejected"} input ids of one pair; prm:
    {"input_ids", "positions" (the token that holds each step's last character), "labels" (1 right, 0 wrong:
    step_labels)}. Inputs come from scalar_rm_input (the prompt cut to max_prompt_tokens); an example longer than
    max_len is dropped, and a response without steps gives none."""
    examples, counts = [], {"ok": 0, "too_long": 0}
    for it in items:
        if objective == "pairwise":
            ex = {
                k: scalar_rm_input(tokenizer, it["prompt"], it[k], max_prompt_tokens)[0] for k in ("chosen", "rejected")
            }
            length = max(map(len, ex.values()))
        else:
            steps = split_steps(it["response"], step_unit)
            if not steps:
                continue
            ids, first, offsets = scalar_rm_input(tokenizer, it["prompt"], it["response"], max_prompt_tokens)
            ex = {
                "input_ids": ids,
                "positions": [first + token_at(offsets, e) for _, e in steps],
                "labels": step_labels(it["response"], steps, it["good_spans"], it["poor_spans"]),
            }
            length = len(ids)
        status = "too_long" if length > max_len else "ok"
        counts[status] += 1
        if status == "ok":
            examples.append(ex)
    return examples, counts


def collate_scalar(features: list[dict], pad_id: int) -> dict:
    """A left-padded batch for a scalar reward model, so every row ends at its EOS. pairwise: the B chosen rows, then
    the B rejected rows (input_ids, attention_mask (2B, T)), labels (B,) = 1 (the first is preferred); prm:
    input_ids, attention_mask (B, T) and positions, labels, step_mask (B, S), S the most steps of a row."""
    if "chosen" in features[0]:
        ids, mask = models.left_pad([f["chosen"] for f in features] + [f["rejected"] for f in features], pad_id)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.ones(len(features))}
    ids, mask = models.left_pad([f["input_ids"] for f in features], pad_id)
    S = max(len(f["positions"]) for f in features)
    positions, labels, step_mask = (
        torch.zeros(len(features), S, dtype=dt) for dt in (torch.long, torch.float, torch.float)
    )
    for i, f in enumerate(features):
        n, shift = len(f["positions"]), ids.shape[1] - len(f["input_ids"])  # left padding shifts every position
        positions[i, :n], labels[i, :n], step_mask[i, :n] = (
            torch.tensor(f["positions"]) + shift,
            torch.tensor(f["labels"], dtype=torch.float),
            1.0,
        )
    return {"input_ids": ids, "attention_mask": mask, "positions": positions, "labels": labels, "step_mask": step_mask}


def scalar_loss(model, batch: dict):
    """The training loss of a scalar reward model on a collate_scalar batch: Bradley-Terry on the scores at the last
    position (every row's EOS), or the PRM loss on the scores at each step's last token."""
    scores = scalar_rm_scores(model, batch["input_ids"], batch["attention_mask"])  # (rows, T)
    if "positions" not in batch:
        r = scores[:, -1]  # (2B,)
        return bradley_terry_loss(r[: len(r) // 2], r[len(r) // 2 :])
    return prm_loss(scores.gather(1, batch["positions"]), batch["labels"], batch["step_mask"])


def evaluate_scalar(
    model, tokenizer, items: list[dict], objective: str, max_prompt_tokens: int, step_unit: str, batch_size: int = 32
) -> dict:
    """Held-out metrics of a scalar reward model (loaded as 03 loads it), on its raw scores (score_responses).
    pairwise: accuracy (r_c > r_r), the Bradley-Terry loss and the mean margin r_c - r_r. prm: step accuracy
    (sigmoid > 0.5 = right) and precision / recall of the wrong steps, the ones that carry a poor span."""
    if not items:
        return {"n": 0}
    if objective == "pairwise":
        score = lambda key: torch.tensor(  # noqa: E731
            [
                s[0]
                for s in score_responses(  # noqa: E731 - (n,) raw scores
                    model,
                    tokenizer,
                    [it["prompt"] for it in items],
                    [it[key] for it in items],
                    max_prompt_tokens=max_prompt_tokens,
                    batch_size=batch_size,
                )
            ]
        )
        r_c, r_r = score("chosen"), score("rejected")
        return {
            "n": len(items),
            "pairwise_accuracy": (r_c > r_r).float().mean().item(),
            "bt_loss": bradley_terry_loss(r_c, r_r).item(),
            "margin": (r_c - r_r).mean().item(),
        }
    steps = [split_steps(it["response"], step_unit) for it in items]
    scores = score_responses(
        model,
        tokenizer,
        [it["prompt"] for it in items],
        [it["response"] for it in items],
        steps,
        max_prompt_tokens,
        batch_size,
    )
    gold = [
        g for it, st in zip(items, steps) for g in step_labels(it["response"], st, it["good_spans"], it["poor_spans"])
    ]
    pred = [int(s > 0) for row in scores for s in row]  # sigmoid(s) > 0.5: right
    wrong_tp = sum(p == 0 and g == 0 for p, g in zip(pred, gold))
    precision, recall, f1 = reward_models._prf(wrong_tp, pred.count(0), gold.count(0))
    return {
        "n": len(items),
        "n_steps": len(gold),
        "step_accuracy": sum(p == g for p, g in zip(pred, gold)) / max(len(gold), 1),
        "wrong_step_precision": precision,
        "wrong_step_recall": recall,
        "wrong_step_f1": f1,
        "wrong_steps_gold": gold.count(0),
    }


def main_scalar(args: argparse.Namespace) -> dict:
    """--objective pairwise | prm: stage 2 for the paper's scalar baselines. The same LM with a scalar head (sequence
    classification, its weights drawn with std 1/sqrt(d+1) as in Huang et al. 2024), LoRA or full fine-tuning by the
    same preset, trained by the same Trainer (checkpoints, --resume, DDP); then reward_model.json (objective, the
    input's budget; pairwise: score_bias, the mean score of the demonstrations, which 03 subtracts) and eval.json
    (held-out pairwise accuracy, or step accuracy), measured on the model reloaded as 03 loads it."""
    from transformers import set_seed

    t0 = time.time()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    log = print if rank0 else (lambda *a, **k: None)
    out, dtype = Path(args.output_dir), "bf16" if args.bf16 else "float32"
    if args.objective == "pairwise":
        items, source = load_pairs(args.data, args.split, args.prompt_field, args.chosen_field, args.rejected_field)
    else:
        items, source = load_annotations(args.data)[0], f"annotations, steps: {args.step_unit}s"
    train_items, val_items = split_records(items, args.val_frac, args.seed)
    log(
        f"{args.data}: {len(items)} {'pairs' if args.objective == 'pairwise' else 'responses'} from {source} -> "
        f"{len(train_items)} train, {len(val_items)} val"
    )

    norm = (
        (
            [(r["prompt"], r[args.norm_field]) for r in common.read_jsonl(args.norm_data, ("prompt", args.norm_field))]
            if args.norm_data
            else [(it["prompt"], it[k]) for it in train_items for k in ("chosen", "rejected")]
        )
        if args.objective == "pairwise"
        else []
    )  # read before training: a bad file fails first

    set_seed(args.seed)
    model, tokenizer = models.load_model(args.model, dtype=dtype, scalar_head=True)
    model.config.use_cache = False
    torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.config.hidden_size + 1))  # Huang et al. 2024
    if args.lora_r > 0:  # peft's SEQ_CLS trains and saves the score head in full
        model = trainable.add_lora(
            model,
            args.lora_r,
            args.lora_alpha,
            args.lora_targets,
            args.lora_dropout,
            args.modules_to_save,
            task_type="SEQ_CLS",
        )
    max_prompt_tokens = args.max_len - args.max_new_tokens  # as the generative reward model's input is cut
    encode = functools.partial(
        encode_scalar,
        tokenizer,
        objective=args.objective,
        max_len=args.max_len,
        max_prompt_tokens=max_prompt_tokens,
        step_unit=args.step_unit,
    )
    (train_set, counts), (val_set, _) = encode(train_items), encode(val_items)
    if not train_set:
        raise common.DataError(f"{args.data}: no training example fits in --max-len {args.max_len}")
    log(f"{counts['too_long']} train examples longer than --max-len {args.max_len} dropped")

    trainer, resume_from = training.make_trainer(
        args,
        model,
        train_set,
        val_set,
        functools.partial(collate_scalar, pad_id=tokenizer.pad_token_id),
        log,
        rank0,
        loss_fn=scalar_loss,
    )
    result = trainer.train(resume_from_checkpoint=resume_from)
    final_eval = trainer.evaluate() if val_set else {}
    train_s = time.time() - t0
    if not trainer.is_world_process_zero():
        return {}

    # ---- normalisation (Huang et al. 2024): the demonstrations' mean score becomes 0 (pairwise; 03 subtracts it) ----
    model.eval()
    if args.objective == "pairwise":
        prompts, answers = (list(x) for x in zip(*norm))
        norm_scores = torch.tensor(
            [
                s[0]
                for s in score_responses(
                    model,
                    tokenizer,
                    prompts,
                    answers,
                    max_prompt_tokens=max_prompt_tokens,
                    batch_size=args.gen_batch_size,
                )
            ]
        )
    summary = {
        "base_model": args.model,
        "adapter": "peft LoRA" if args.lora_r > 0 else None,
        "task": args.task,
        "data": str(args.data),
        "objective": args.objective,
        "input_format": "baselines.scalar_rm.scalar_rm_input("
        "tokenizer, prompt, response, max_prompt_tokens): score at the EOS"
        + (" and at each step's last token (split_steps)" if args.objective == "prm" else ""),
        "max_prompt_tokens": max_prompt_tokens,
        "max_len": args.max_len,
        **(
            {
                "score_bias": norm_scores.mean().item(),
                "norm_data": args.norm_data or "the training pairs' answers",
                "norm_score_std": norm_scores.std().item(),
            }
            if args.objective == "pairwise"
            else {"step_unit": args.step_unit}
        ),
        "lora": {
            "r": args.lora_r,
            "alpha": args.lora_alpha,
            "dropout": args.lora_dropout,
            "targets": args.lora_targets,
            "modules_to_save": args.modules_to_save,
        },
        "train": {
            "items": len(train_items),
            "examples": len(train_set),
            "val_items": len(val_items),
            "source": source,
            "too_long_dropped": counts["too_long"],
            "lr": args.lr,
            "lr_schedule": args.lr_schedule,
            "sampling": args.sampling,
            "epochs": args.epochs,
            "steps": trainer.state.global_step,
            "resumed_from": resume_from,
            "seed": args.seed,
            "batch_size": args.batch_size * args.grad_accum * trainer.args.world_size,
            "train_loss": result.training_loss,
            "eval_loss": final_eval.get("eval_loss"),
            "train_s": round(train_s, 1),
        },
    }
    reward_models.save_reward_model(model, args, out, summary)
    log(f"saved the {args.objective} reward model to {out} (eval loss {final_eval.get('eval_loss', float('nan')):.4f})")
    del trainer, model

    # ---- held-out metrics of the saved reward model, loaded exactly as stage 3 loads it ----
    rm, rm_tok = models.load_model(str(out), device=args.device, dtype=dtype, scalar_head=True)
    metrics = evaluate_scalar(
        rm, rm_tok, val_items[: args.eval_limit], args.objective, max_prompt_tokens, args.step_unit, args.gen_batch_size
    )
    metrics.update(
        objective=args.objective,
        eval_loss=final_eval.get("eval_loss"),
        train_loss=result.training_loss,
        steps=summary["train"]["steps"],
        train_s=round(train_s, 1),
        wall_s=round(time.time() - t0, 1),
        **{k: summary[k] for k in ("score_bias", "norm_score_std") if k in summary},
    )
    log(
        "held-out: "
        + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in metrics.items()
            if k not in ("objective",)
        )
    )
    common.write_json(out / "eval.json", metrics)
    log(f"wrote {out / 'eval.json'} ({metrics['wall_s']:.0f} s in all)")
    return metrics
