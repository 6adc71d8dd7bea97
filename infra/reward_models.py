"""--reward-model, --merge, --min-parse-rate: a stage-2 reward model in use: how it was trained (rm_settings:
reward_model.json), the checks before a run (check_reward_model), its input (rm_prompt; its critiques:
critics/learned.py) and how well they recover spans (rm_span_metrics, paper Tables 1 and 6). 03 --reward-model, 04
--reward-model. And as stage 2 leaves it: its --output-dir checked before training (check_output_dir: 02 --resume,
--overwrite), saved whole or not at all (save_reward_model), merged into a plain model folder for an OpenAI-compatible
server (merge_reward_model: 02 --merge, tools/merge_reward_model.py), and refused as a critic when its held-out
critiques mostly do not parse (parse_rate_check: 02 --min-parse-rate, MIN_PARSE_RATE by default): a critique that does
not parse gives delta = 0, so such a model would read as a flawless critic in stage 3's rewards and stage 4's metrics.
Stage 2 then ends with exit 1 and one line, the model kept on disk; 04 marks a policy's critic metrics n/a below the
same floor (evaluation/__init__.py: critic_failed).
"""

from __future__ import annotations

import json
from pathlib import Path

import common
from infra import models, runs


def critique_tokens(task: str) -> int:
    """The critique budget where neither a flag nor reward_model.json gives one (03's critic, 04): stage 2's preset
    --max-new-tokens for the task, 96 for the demo (02 DEMO) and 512 otherwise (02 PAPER)."""
    return 96 if task == "demo" else 512


def rm_settings(reward_model_dir) -> dict:
    """How stage 2 trained and evaluated the reward model in `reward_model_dir`: what 03 and 04 must repeat to use it.
      max_prompt_tokens  the most tokens of its input, rm_prompt (the task prompt is cut from its start to fit), the
                         same in training (02) and in use (03, 04, a served model too); None: no cut. Stage 2 sets it
                         to --max-len minus --max-new-tokens, so that an input and its critique fit in --max-len.
      max_new_tokens     the critique budget stage 2 evaluated it with: 03's and 04's default; None: the caller's.
      rm_format          its output: "critique+spans" (z = [c ; A(y)]) or "spans-only" (w/o CoT); and its input's
                         instruction (RM_INSTRUCTIONS). Older files: "critique+spans".
      prompt_format, target_format   its input and output (build_rm_prompt; format_rm_target, then EOS).
      objective          what it was trained for (02 --objective, RM_OBJECTIVES); older files: "generative". Without
                         a file, a sequence classifier (its config.json's architecture, or a SEQ_CLS adapter: e.g.
                         TRL's RewardTrainer output) is "pairwise", score_bias 0; any other model "generative".
      score_bias         pairwise: its mean score on the normalisation responses, subtracted from every score (Huang
                         et al. 2024), and norm_score_std their std; step_unit: prm: how its responses are cut into
                         steps (baselines/scalar_rm.py: split_steps).
    Read from DIR/reward_model.json (02 writes it). An older file lacks both budgets; its stage 2 evaluated with
    max_new_tokens 128 (demo) or 512 and the input cut to max_len minus that: those are returned. No file (a plain
    model directory; None for a served model): no cut, and max_new_tokens None."""
    path = Path(reward_model_dir) / "reward_model.json" if reward_model_dir else None
    try:
        info = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except json.JSONDecodeError as e:
        raise common.DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    out = {
        "max_prompt_tokens": None,
        "max_new_tokens": None,
        "rm_format": "critique+spans",
        "prompt_format": common.RM_PROMPT_FORMAT,
        "target_format": common.RM_TARGET_FORMAT,
        "objective": "generative",
        "score_bias": 0.0,
        "norm_score_std": 1.0,
        "step_unit": None,
    }
    if "max_len" in info.get("train", {}) and "max_new_tokens" not in info:  # written before these keys existed
        out["max_new_tokens"] = 128 if info.get("task") == "demo" else 512
        out["max_prompt_tokens"] = max(info["train"]["max_len"] - out["max_new_tokens"], 1)
    out.update({k: info[k] for k in out if k in info})
    if path is not None and not info and _is_sequence_classifier(Path(reward_model_dir)):
        out["objective"] = "pairwise"
    if out["rm_format"] not in common.RM_FORMATS:
        raise common.DataError(f"{path}: rm_format {out['rm_format']!r}: must be one of {', '.join(common.RM_FORMATS)}")
    if out["objective"] not in common.RM_OBJECTIVES:
        raise common.DataError(
            f"{path}: objective {out['objective']!r}: must be one of {', '.join(common.RM_OBJECTIVES)}"
        )
    return out


def _is_sequence_classifier(model_dir: Path) -> bool:
    """True for a model directory (or LoRA adapter) with a sequence-classification head, read from its config files."""
    for name, test in (
        ("adapter_config.json", lambda c: c.get("task_type") == "SEQ_CLS"),
        ("config.json", lambda c: any(a.endswith("ForSequenceClassification") for a in c.get("architectures") or [])),
    ):
        try:
            if test(json.loads((model_dir / name).read_text())):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def check_reward_model(
    path: str,
    flag: str = "--reward-model ",
    objective: str = "generative",
    use: str = "a critic that writes critiques (03 --critic local or openai, 04 --reward-model)",
) -> None:
    """Fail fast, before any training: DataError (one line) unless load_model could load the reward model at `path`
    and stage 2 trained it for `objective` (its reward_model.json; RM_OBJECTIVES): a scalar reward model where
    critiques are needed, or the reverse, is refused, naming `use`. Checks, without loading weights: the directory
    exists; an adapter's base model is there when it is a local path (a hub id is left to load_model); the tokenizer
    loads. `flag` prefixes the message, as the user typed it."""
    from transformers import AutoTokenizer

    rm = Path(path or "")
    if not path or not rm.is_dir():
        raise common.DataError(f"{flag}{path or '(not given)'}: no such directory (run 02_train_reward.py first)")
    have = rm_settings(path)["objective"]
    if not (rm / "reward_model.json").is_file() and have != "pairwise":  # 02 writes it into the folder it renames
        raise common.DataError(
            f"{flag}{path}: no reward_model.json (not a stage-2 output; run 02_train_reward.py)"
        )  # 02 writes it last
    if have != objective:  # (a plain sequence classifier, e.g. TRL's RewardTrainer output, is a pairwise one as it is)
        raise common.DataError(
            f"{flag}{path}: {common.RM_OBJECTIVES[have]}; {use} needs {common.RM_OBJECTIVES[objective]}"
        )
    tokenizer_dir = path
    if (rm / "adapter_config.json").is_file():  # a LoRA adapter: load_model loads the base it names, then the adapter
        base = json.loads((rm / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        if not base or (models.looks_local(base) and not Path(base).is_dir()):
            raise common.DataError(
                f"{flag}{path}: its base model {base!r} (reward_model.json, adapter_config.json) "
                "is not there; put it back at that path, or train the reward model again"
            )
        if not (rm / "tokenizer_config.json").is_file():
            tokenizer_dir = base
    try:
        AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # noqa: BLE001 -- whatever the tokenizer files hold, the user needs one line
        raise common.DataError(f"{flag}{path}: cannot load its tokenizer: {common.first_line(e)}") from None


def rm_prompt(tokenizer, prompt: str, response: str, max_tokens: int | None = None, rm_format: str = "critique+spans"):
    """The reward model's input, the same in 02 (training), 03 and 04 (critiquing): (ids, task prompt kept, status) of
    build_rm_prompt, the task prompt cut from its start when the whole would not fit in max_tokens (fit_prompt)."""
    return models.fit_prompt(
        tokenizer, lambda p: common.build_rm_prompt(tokenizer, p, response, rm_format), prompt, max_tokens
    )


def rm_scores(response: str, offsets, raw: str) -> tuple[dict, list[float], dict]:
    """A reward model's raw critique of one response, scored on its tokens as stage 3 scores it: (feedback, delta,
    04's per-sample (numerator, denominator) rows). A critique that does not parse keeps its text and quotes nothing."""
    try:
        fb, parsed = common.parse_feedback(raw), 1.0
    except ValueError:
        fb, parsed = {"critique": raw.strip(), "good_spans": [], "poor_spans": []}, 0.0
    delta, unmatched = common.span_rewards(response, offsets, fb["good_spans"], fb["poor_spans"])
    n, quotes = len(offsets), sum(1 for s in fb["good_spans"] + fb["poor_spans"] if s.strip())
    return (
        fb,
        delta,
        {
            "rm/delta_sum": (sum(delta), 1),
            "rm/delta_mean": (sum(delta), n),
            "rm/poor_token_frac": (delta.count(-1.0), n),
            "rm/good_token_frac": (delta.count(1.0), n),
            "rm/parse_rate": (parsed, 1),
            "rm/unmatched_span_rate": (len(unmatched), quotes),
        },
    )


def _prf(tp: int, n_pred: int, n_gold: int):
    """(precision, recall, F1); None where a denominator is 0 (no predicted / no gold tokens of the class)."""
    p, r = (tp / n_pred if n_pred else None), (tp / n_gold if n_gold else None)
    return p, r, (None if p is None or r is None else 2 * p * r / (p + r) if p + r else 0.0)


def rm_span_metrics(items: list[dict], outputs: list[str]) -> dict:
    """How well reward-model critiques recover the annotated spans. Pure: no model or tokenizer involved.

    items[i] = {"text", "offsets", "good_spans", "poor_spans"}: a response as decode_with_offsets returns it (text and
    its tokens' character intervals) with the annotated quotes; outputs[i] is the reward model's raw text for it.
    Gold and predicted delta both come from span_rewards on the same tokens; an output that does not parse predicts
    delta = 0 everywhere (what the policy would get). Returns a flat dict:
      n, parse_rate; quotes (non-empty predicted quotes of parsed outputs), unmatched_span_rate (share of them not
      found in the response); {pos,neg}_{precision,recall,f1} over tokens for delta = +1 / -1 (None if undefined) and
      {pos,neg}_tokens_{gold,pred,tp}; spans = {good|poor: {gold, pred, exact, partial}}, where a located predicted
      span is exact if it equals a gold interval of its polarity, partial if it only overlaps one;
      critique_words = mean words of the parsed critiques; output_words = mean words of all raw outputs (a model
      whose outputs do not parse still writes words).
    """
    if len(items) != len(outputs):
        raise ValueError(f"{len(items)} items but {len(outputs)} outputs")
    tok = {c: {"gold": 0, "pred": 0, "tp": 0} for c in (1.0, -1.0)}
    spans = {k: {"gold": 0, "pred": 0, "exact": 0, "partial": 0} for k in ("good", "poor")}
    parsed, quotes, unmatched, words = 0, 0, 0, []
    for item, out in zip(items, outputs):
        text, offsets = item["text"], item["offsets"]
        gold, _ = common.span_rewards(text, offsets, item["good_spans"], item["poor_spans"])
        fb, pred, rows = rm_scores(text, offsets, out)
        if rows["rm/parse_rate"][0]:
            parsed += 1
            words.append(len(fb["critique"].split()))
        unmatched, quotes = unmatched + rows["rm/unmatched_span_rate"][0], quotes + rows["rm/unmatched_span_rate"][1]
        for g, p in zip(gold, pred):
            for c in tok:
                tok[c]["gold"] += g == c
                tok[c]["pred"] += p == c
                tok[c]["tp"] += g == c and p == c
        gold_iv = dict(zip(("good", "poor"), common.locate_spans(text, item["good_spans"], item["poor_spans"])))
        pred_iv = dict(zip(("good", "poor"), common.locate_spans(text, fb["good_spans"], fb["poor_spans"])))
        for k, s in spans.items():
            s["gold"] += len(gold_iv[k])
            s["pred"] += len(pred_iv[k])
            for a, b in pred_iv[k]:
                if (a, b) in gold_iv[k]:
                    s["exact"] += 1
                elif any(a < d and c < b for c, d in gold_iv[k]):
                    s["partial"] += 1
    n = len(items)
    metrics = {
        "n": n,
        "parse_rate": parsed / n if n else None,
        "quotes": quotes,
        "unmatched_span_rate": unmatched / quotes if quotes else None,
    }
    for name, c in (("pos", 1.0), ("neg", -1.0)):
        t = tok[c]
        metrics.update(zip((f"{name}_precision", f"{name}_recall", f"{name}_f1"), _prf(t["tp"], t["pred"], t["gold"])))
        metrics.update({f"{name}_tokens_{k}": v for k, v in t.items()})
    metrics["spans"] = spans
    metrics["critique_words"] = sum(words) / len(words) if words else 0.0
    metrics["output_words"] = sum(len(o.split()) for o in outputs) / n if n else 0.0
    return metrics


def print_table(m: dict) -> None:
    """02's span metrics of the reward model (rm_span_metrics, evaluate_rm's) as a table."""
    fmt = lambda x: "  n/a" if x is None else f"{x:5.3f}"  # noqa: E731
    print(
        f"reward model on {m['n']} val examples: JSON parse rate {fmt(m['parse_rate'])}, unmatched-span rate "
        f"{fmt(m['unmatched_span_rate'])} of {m['quotes']} quotes, critique {m['critique_words']:.1f} words where "
        f"it parses, raw outputs {m['output_words']:.1f} words (annotations {m['gold_critique_words']:.1f})"
    )
    print("  class        precision  recall     F1   spans gold/pred/exact/partial")
    for name, key, label in (("+1 (good)", "pos", "good"), ("-1 (poor)", "neg", "poor")):
        s = m["spans"][label]
        print(
            f"  {name:11s}    {fmt(m[key + '_precision'])}   {fmt(m[key + '_recall'])}  {fmt(m[key + '_f1'])}"
            f"   {s['gold']}/{s['pred']}/{s['exact']}/{s['partial']}"
        )


# ----------------------------------------------------------------------------------------------------------------------
# Stage 2's output: --output-dir checked before training, the reward model saved whole, merged for a server (--merge)
# ----------------------------------------------------------------------------------------------------------------------


def add_args(p) -> None:
    g = p.add_argument_group("serving: --merge (infra/reward_models.py: merge_reward_model)")
    g.add_argument(
        "--merge",
        metavar="DIR",
        help="then also write the reward model at DIR as a plain model folder, its LoRA merged, for a server",
    )
    g = p.add_argument_group("the parse-rate floor (infra/reward_models.py: parse_rate_check)")
    g.add_argument(
        "--min-parse-rate",
        type=float,
        default=MIN_PARSE_RATE,
        help="exit 1 when fewer held-out critiques than this share parse (the model is kept)",
    )


# Below half, most of stage 3's rollouts would get delta = 0 from this critic (a critique that does not parse quotes
# nothing): the policy would learn from the KL term alone, and 04 would read its metrics as a flawless answer's.
MIN_PARSE_RATE = 0.5


def parse_rate_check(metrics: dict, args) -> int:
    """02's exit code: 1, with one line on stderr (where the model is, its parse rate, what to do), when the saved
    reward model's held-out critiques parse below --min-parse-rate; else 0. Nothing evaluated (--eval-limit 0, a
    scalar objective, a rank other than 0): 0."""
    import sys

    rate = metrics.get("parse_rate")
    if rate is None or rate >= args.min_parse_rate:
        return 0
    print(
        f"error: the reward model's critiques parsed on {round(rate * metrics['n'])} of {metrics['n']} held-out "
        f"examples (parse rate {rate:.2f}, below --min-parse-rate {args.min_parse_rate:g}): as a critic it would "
        f"give most rollouts delta = 0. It is saved in {args.output_dir} (its outputs in eval_samples.jsonl); train "
        "it longer (--max-steps, --epochs), on more annotations or with a larger --max-new-tokens, then rerun with "
        "--overwrite; --min-parse-rate 0 accepts it as it is",
        file=sys.stderr,
    )
    return 1


OWNS = ("eval.json", "eval_samples.jsonl")  # what stage 2 writes beside the saved reward model


def check_output_dir(args) -> None:
    """Before anything is trained: --output-dir holds nothing stage 2 did not write (infra.runs.check_save_dir), and a
    reward model there is continued or replaced only when asked (infra.runs.start_kind: --resume, --overwrite, or the
    literal zero-flag demo). DataError otherwise."""
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(args.output_dir)
    runs.check_save_dir(out, (*OWNS, "checkpoints"), "reward_model.json", "--output-dir ")
    if args.merge:
        runs.check_save_dir(args.merge, marker="reward_model.json", flag="--merge ")
    ckpt = out / "checkpoints"
    resumable = ckpt.is_dir() and get_last_checkpoint(str(ckpt)) is not None  # (an empty checkpoints/ is no run)
    held = ["reward_model.json"] * (out / "reward_model.json").is_file() + ["checkpoints"] * resumable
    runs.start_kind(out, args.resume, args.overwrite, held, "checkpoints/", resumable, args.zero_flag)


def save_reward_model(model, args, out: Path, summary: dict, state_dict: dict | None = None) -> None:
    """Adapter weights and config (full fine-tuning: the whole model, loadable like any model directory), the base
    tokenizer and reward_model.json (state_dict: a sharded model's, gathered whole: infra.distributed.full_state_dict),
    written to a temp folder that then replaces `out` (infra.runs.save_pretrained; the
    Trainer's checkpoints/ move over, for --resume): killed while saving, `out` still holds the previous reward model
    whole. A folder with reward_model.json is a complete stage-2 output (check_reward_model).

    The tokenizer is saved as the base model ships it: infra.models.load_model adds the same pad token (and resizes the
    embeddings the same way) when it loads the reward model, so the adapter never needs to carry embedding rows.
    """
    from transformers import AutoTokenizer

    runs.save_pretrained(
        out,
        model,
        AutoTokenizer.from_pretrained(args.model),
        {"reward_model.json": summary},
        keep=("checkpoints",),
        owns=OWNS,
        **({"save_embedding_layers": False} if hasattr(model, "peft_config") else {}),
        **({"state_dict": state_dict} if state_dict is not None else {}),
    )


def merge_untied(model):
    """model.merge_and_unload() for a LoRA model, right also when the base ties lm_head to embed_tokens (SmolLM2,
    Llama-3.2, Qwen2.5-0.5B) and the adapter changes either: merged into the one shared matrix, lm_head's delta would
    reach the embeddings and embed_tokens' the logits. lm_head gets its own copy of the matrix first; the two are tied
    again afterwards when no delta touched them."""
    import torch

    base = model.get_base_model()
    tied = getattr(base.config, "tie_word_embeddings", False)
    if tied:
        head = base.get_output_embeddings()
        head = getattr(head, "base_layer", head)  # under LoRA, the layer it wraps
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
    model = model.merge_and_unload()
    if tied and torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight):
        model.config.tie_word_embeddings = True
        model.tie_weights()
    return model


def merge_reward_model(rm_dir, out_dir, dtype: str = "float32") -> Path:
    """The reward model at rm_dir (stage 2's output) as a plain model folder at out_dir that any OpenAI-compatible
    server can serve: its LoRA adapter merged into the base weights (full fine-tuning: the weights as they are), in
    `dtype`, loaded as stage 3 loads it (infra.models.load_model: the same pad token, a generation_config of stop ids
    only, so a server adds no sampling settings of the hub's); its tokenizer; and its reward_model.json with
    "merged_from", so that --reward-model out_dir cuts the input and budgets critiques as stage 2 trained it. Returns
    out_dir. 02 --merge DIR writes it right after training; tools/merge_reward_model.py for a reward model already
    trained. Then `transformers serve DIR` (or `vllm serve DIR`) and 03 --critic openai --critic-api completions
    --reward-model DIR."""
    model, tokenizer = models.load_model(str(rm_dir), dtype=dtype)
    if hasattr(model, "peft_config"):
        model = merge_untied(model)
    info = (
        json.loads((Path(rm_dir) / "reward_model.json").read_text())
        if (Path(rm_dir) / "reward_model.json").is_file()
        else {}
    )
    return runs.save_pretrained(out_dir, model, tokenizer, {"reward_model.json": {**info, "merged_from": str(rm_dir)}})
