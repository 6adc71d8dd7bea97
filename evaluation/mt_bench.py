"""--mt-bench, --mt-bench-questions, --mt-bench-judge-model: MT-Bench, FastChat's single-answer grading of policies.

Each --policy answers the 80 two-turn questions (answer_turns): turn 1 alone, then turn 2 with turn 1 and the policy's
own answer to it in the conversation, through its chat template, at FastChat's temperature for the question's category
(TEMPERATURE; gen_model_answer.py's, seeded) and up to --mt-bench-max-new-tokens. The judge (--judge-base-url, model
--mt-bench-judge-model, default --judge-model) grades each turn on its own, 1 to 10, with FastChat's published prompts
(judge_turns): "single-v1" for turn 1 and "single-v1-multi-turn" for turn 2 (the whole conversation, judged on its
second answer); math, reasoning and coding questions get the "-math-" prompts with GPT-4's reference answers. The score
is read as FastChat reads it (parse_score: the first "[[x]]", else "[x]"); a verdict without one is invalid and counts
nowhere, as in FastChat's show_result.py, its count reported beside the means. Scores: the mean per turn and over both,
each with its 95% bootstrap interval (summarize).

Where the pieces come from: the questions, GPT-4's reference answers and the judge prompts are FastChat's files
(tasks/mt_bench/, copied unchanged; its README says from where), because the fschat wheel ships none of them and its
judge code cannot run here (fastchat.llm_judge.common imports anthropic, which fschat does not install, and calls
openai.ChatCompletion, which openai>=1 removed). So fschat is not a dependency: its prompts and its score pattern are.
Answers and verdicts are cached in OUTPUT_DIR/eval/ (<name>.mt_bench.jsonl, mt_bench_judge.<name>.jsonl).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import common
from common import DataError
import evaluation
from infra import models, serving

DATA = Path(__file__).resolve().parents[1] / "tasks" / "mt_bench"
NEED_REF_CATS = ("math", "reasoning", "coding", "arena-hard-200")  # fastchat/llm_judge/common.py
TEMPERATURE = {
    "writing": 0.7,
    "roleplay": 0.7,
    "extraction": 0.0,
    "math": 0.0,
    "coding": 0.0,
    "reasoning": 0.0,
    "stem": 0.1,
    "humanities": 0.1,
    "arena-hard-200": 0.0,
}  # its temperature_config; 0.7 otherwise
ONE_SCORE = re.compile(r"\[\[(\d+\.?\d*)\]\]")  # fastchat/llm_judge/common.py: one_score_pattern
ONE_SCORE_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")  # ... and one_score_pattern_backup
PAPER_JUDGES = ("gpt-4", "gpt-4-0613")  # FastChat's default judge, "gpt-4", as MT-Bench's published scores used it


def add_args(p) -> None:
    g = p.add_argument_group("MT-Bench, FastChat's single-answer grading (evaluation/mt_bench.py)")
    g.add_argument("--mt-bench", action="store_true", help="each policy's 1-10 score per turn from --judge-base-url")
    g.add_argument(
        "--mt-bench-questions",
        default=str(DATA / "question.jsonl"),
        help="FastChat's question.jsonl layout (default: its 80 questions, tasks/mt_bench/)",
    )
    g.add_argument(
        "--mt-bench-references",
        default=str(DATA / "reference_gpt-4.jsonl"),
        help="reference answers for math, reasoning, coding (default: FastChat's GPT-4 answers)",
    )
    g.add_argument("--mt-bench-judge-model", default=None, help="judge model (default: --judge-model)")
    g.add_argument("--mt-bench-max-new-tokens", type=int, default=1024, help="answer length per turn, as FastChat's")
    g.add_argument("--mt-bench-limit", type=int, default=None, help="only the first N questions (not comparable)")


# ----------------------------------------------------------------------------------------------------------------------
# FastChat's files: the questions, the reference answers, the judge prompts
# ----------------------------------------------------------------------------------------------------------------------


def read_questions(path, references=None, limit: int | None = None) -> list[dict]:
    """[{"id", "category", "turns": [q1, q2], "reference": [r1, r2] | None}] from FastChat's question.jsonl layout;
    a question of a NEED_REF_CATS category takes its reference from `references` (FastChat's reference_answer
    layout), else from its own "reference" field. Errors name the file, line and field."""
    refs = read_references(references) if references else {}
    out = []
    for lineno, rec in common.iter_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(rec.get("question_id"), (int, str)):
            raise DataError(f"{where}: missing field 'question_id'")
        turns = rec.get("turns")
        if not (isinstance(turns, list) and len(turns) == 2 and all(isinstance(t, str) for t in turns)):
            raise DataError(f"{where}: field 'turns' must be a list of two strings")
        category = rec.get("category")
        if not isinstance(category, str):
            raise DataError(f"{where}: field 'category' must be a string")
        ref = refs.get(rec["question_id"], rec.get("reference")) if category in NEED_REF_CATS else None
        if category in NEED_REF_CATS and not (isinstance(ref, list) and len(ref) == 2):
            raise DataError(
                f"{where}: a {category} question needs a reference answer per turn: none in "
                f"{references or path} for question_id {rec['question_id']}"
            )
        out.append({"id": str(rec["question_id"]), "category": category, "turns": turns, "reference": ref})
    if not out:
        raise DataError(f"{path}: no questions")
    return out[:limit]


def read_references(path) -> dict:
    """{question_id: [r1, r2]} from FastChat's reference_answer/<model>.jsonl layout (choices[0].turns)."""
    out = {}
    for lineno, rec in common.iter_jsonl(path):
        try:
            turns = rec["choices"][0]["turns"]
        except (KeyError, IndexError, TypeError):
            raise DataError(f"{path}:{lineno}: missing field 'choices[0].turns'") from None
        out[rec.get("question_id")] = turns
    return out


def read_prompts(path=DATA / "judge_prompts.jsonl") -> dict[str, dict]:
    """FastChat's judge prompts by name (single-v1, single-math-v1, and their -multi-turn versions)."""
    return {rec["name"]: rec for rec in common.read_jsonl(path, ("name", "system_prompt", "prompt_template"))}


def judge_prompt(prompts: dict, question: dict, answers: list[str], turn: int) -> tuple[str, str, str]:
    """(prompt name, system message, user message) that FastChat's run_judge_single sends for `turn` (1 or 2)."""
    name = ("single-math-v1" if question["reference"] else "single-v1") + ("-multi-turn" if turn == 2 else "")
    q, ref = question["turns"], question["reference"] or []
    fields = (
        dict(question=q[0], answer=answers[0])
        if turn == 1
        else dict(question_1=q[0], question_2=q[1], answer_1=answers[0], answer_2=answers[1])
    )
    if ref:
        fields.update(ref_answer_1=ref[0], **({"ref_answer_2": ref[1]} if turn == 2 else {}))
    return name, prompts[name]["system_prompt"], prompts[name]["prompt_template"].format(**fields)


def parse_score(text: str) -> float | None:
    """The judge's rating as FastChat's run_judge_single reads it: the first [[x]], else the first [x]; None (its -1,
    an invalid verdict) when there is neither."""
    match = ONE_SCORE.search(text or "") or ONE_SCORE_BACKUP.search(text or "")
    return float(match.group(1)) if match else None


# ----------------------------------------------------------------------------------------------------------------------
# Two-turn answers, and the judge's grades
# ----------------------------------------------------------------------------------------------------------------------


def conversation_ids(tokenizer, messages: list[dict], chat_template: str, max_tokens: int | None) -> list[int]:
    """The policy's input ids for a conversation ending with the user's turn: its chat template (as 04 wraps one
    prompt: models.apply_template's rules for "auto", "on", "off"), else a plain transcript; cut from the start to
    max_tokens, as 04 cuts a long prompt."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has:
        raise DataError(f"--chat-template on: the tokenizer of {tokenizer.name_or_path} has no chat template")
    if has and chat_template != "off":
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages) + "### Assistant:\n"
    ids = models.encode_prompt(tokenizer, text)
    return ids[-max_tokens:] if max_tokens else ids


def answer_turns(name: str, path: str, questions: list[dict], args, cache_dir: Path, load) -> tuple[list[dict], str]:
    """Each question's two answers from policy `name` ({"id", "turns": [a1, a2]}, cached in <name>.mt_bench.jsonl):
    turn 2 is asked after turn 1 and the policy's own answer to it. load(path) -> (model, tokenizer): 04's loader."""
    fp = evaluation.fingerprint(
        path,
        args.mt_bench_max_new_tokens,
        args.chat_template,
        args.seed,
        args.dtype,
        args.max_prompt_tokens,
        "mt-bench-v1",
    )
    loaded = []

    def compute(chunk):
        import torch

        if not loaded:
            loaded.extend(load(path))
        model, tok = loaded
        convs = {q["id"]: [] for q in chunk}
        for turn in (0, 1):
            for temp in sorted({TEMPERATURE.get(q["category"], 0.7) for q in chunk}):  # one generate per temperature
                group = [q for q in chunk if TEMPERATURE.get(q["category"], 0.7) == temp]
                torch.manual_seed(args.seed + turn)
                prompts = [
                    conversation_ids(
                        tok,
                        convs[q["id"]] + [{"role": "user", "content": q["turns"][turn]}],
                        args.chat_template,
                        args.max_prompt_tokens,
                    )
                    for q in group
                ]
                ids = models.generate(model, tok, prompts, args.mt_bench_max_new_tokens, temp, 1.0, args.batch_size)
                for q, x in zip(group, ids):
                    answer = tok.decode(x, skip_special_tokens=True).strip()
                    convs[q["id"]] += [
                        {"role": "user", "content": q["turns"][turn]},
                        {"role": "assistant", "content": answer},
                    ]
        return [{"id": q["id"], "turns": [m["content"] for m in convs[q["id"]][1::2]]} for q in chunk]

    return evaluation.cached(
        cache_dir / f"{name}.mt_bench.jsonl",
        fp,
        questions,
        compute,
        4 * args.batch_size,
        f"mt-bench {name}",
        args.regenerate,
    ), fp


def judge_turns(
    name: str,
    questions: list[dict],
    answers: list[dict],
    answers_fp: str,
    args,
    cache_dir: Path,
    prompts: dict | None = None,
) -> list[dict]:
    """The judge's grade of each turn of each answer ({"id": "<question>/<turn>", "turn", "prompt", "score",
    "reply"}; score None: invalid), FastChat's messages at temperature 0 with up to 2048 tokens, as its
    chat_completion_openai sends them; cached in mt_bench_judge.<name>.jsonl."""
    from openai import APIError

    prompts = prompts or read_prompts()
    model = args.mt_bench_judge_model or args.judge_model
    by_id = {a["id"]: a["turns"] for a in answers}
    items = [{"id": f"{q['id']}/{turn}", "question": q, "turn": turn} for q in questions for turn in (1, 2)]

    async def ask(client, sem, it):
        pname, system, user = judge_prompt(prompts, it["question"], by_id[it["question"]["id"]], it["turn"])
        try:
            async with sem:
                reply = await serving.send_with_retries(
                    lambda: client.chat.completions.create(
                        model=model,
                        temperature=0.0,
                        max_tokens=2048,
                        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                    ),
                    args.judge_retries,
                )
        except APIError as e:
            raise DataError(f"MT-Bench judge request failed: {serving.api_error(e)}") from None
        raw = (reply.choices[0].message.content or "") if reply.choices else ""
        return {"id": it["id"], "turn": it["turn"], "prompt": pname, "score": parse_score(raw), "reply": raw[-2000:]}

    def compute(chunk):
        async def ask_all():
            sem = asyncio.Semaphore(max(1, args.judge_concurrency))
            async with serving.openai_client(args.judge_base_url, args.judge_timeout, "--judge-base-url") as client:
                return await asyncio.gather(*[ask(client, sem, it) for it in chunk])

        return asyncio.run(ask_all())

    fp = evaluation.fingerprint(answers_fp, model, "mt-bench-judge-v1")
    return evaluation.cached(
        cache_dir / f"mt_bench_judge.{name}.jsonl",
        fp,
        items,
        compute,
        4 * args.judge_concurrency,
        f"mt-bench judge {name}",
        args.regenerate,
    )


def summarize(verdicts: list[dict], n_boot: int = 1000, seed: int = 0) -> dict:
    """The mean score of turn 1, of turn 2 and of both (FastChat's show_result.py: the valid verdicts only), each with
    its 95% bootstrap interval, and the invalid verdicts per turn."""
    out = {}
    for key, turns in (("turn1", (1,)), ("turn2", (2,)), ("mean", (1, 2))):
        valid = [(v["score"], 1) for v in verdicts if v["turn"] in turns and v["score"] is not None]
        out[key] = evaluation.bootstrap(valid or [(0.0, 0)], n_boot=n_boot, seed=seed)
        out[key]["n"] = len(valid)
    out["invalid"] = {f"turn{t}": sum(v["turn"] == t and v["score"] is None for v in verdicts) for t in (1, 2)}
    return out


def evaluate(policies: dict[str, str], args, cache_dir: Path, load) -> dict:
    """results.json's "mt_bench": each policy's scores (summarize) and the settings printed beside them.
    load(name, path) -> (model, tokenizer)."""
    questions = read_questions(args.mt_bench_questions, args.mt_bench_references, args.mt_bench_limit)
    out = {
        "judge": args.mt_bench_judge_model or args.judge_model,
        "questions": args.mt_bench_questions,
        "n_questions": len(questions),
        "max_new_tokens": args.mt_bench_max_new_tokens,
        "prompts": "FastChat judge_prompts.jsonl (single-v1, single-math-v1, -multi-turn)",
        "policies": {},
    }
    for name, path in policies.items():
        answers, fp = answer_turns(name, path, questions, args, cache_dir, lambda p, name=name: load(name, p))
        verdicts = judge_turns(name, questions, answers, fp, args, cache_dir)
        out["policies"][name] = summarize(verdicts, args.bootstrap, args.seed)
    return out


def not_comparable(res: dict) -> list[str]:
    """Why an MT-Bench score is not the paper's setting (FastChat's 80 questions, GPT-4 as judge): one line each."""
    lines = []
    if res["judge"] not in PAPER_JUDGES:
        lines.append(f"judge {res['judge']}, not GPT-4 (gpt-4-0613) as in the paper")
    if res["n_questions"] != 80 or Path(res["questions"]).resolve() != (DATA / "question.jsonl").resolve():
        lines.append(f"{res['n_questions']} questions from {res['questions']}, not FastChat's 80")
    return lines
