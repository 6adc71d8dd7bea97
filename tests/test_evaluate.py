"""04_evaluate.py: metrics against the reference libraries, pass@1 in the sandbox, the judge's order randomisation,
the report's highlighted spans, clear data errors, and a full run on tiny models that a rerun serves from the cache."""

import itertools
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import forkserver
from conftest import ROOT, as_reward_model, import_script, write_jsonl_gz

import common
import evaluation
from evaluation import judge, report
from infra import decoding, models, reward_models
from infra.data import load_split
from tasks.demo import demo_dataset

ev = import_script("04_evaluate")

HYPS = ["the cat sat on the mat", "a quick brown dog jumps over the lazy fox", "hello world", ""]
REFS = ["the cat is sitting on the mat", "the quick brown fox jumps over the lazy dog", "hello there world", "empty"]


# ----------------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------------


def test_rouge_and_bleu_agree_with_reference_libraries():
    from rouge_score import rouge_scorer
    import sacrebleu

    rows = evaluation.reference_stats(HYPS, REFS)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for key in ("rouge1", "rouge2", "rougeL"):
        want = [scorer.score(r, h)[key].fmeasure for h, r in zip(HYPS, REFS)]
        got = evaluation.bootstrap(rows[key], n_boot=200)
        assert [f for f, _ in rows[key]] == pytest.approx(want)
        assert got["value"] == pytest.approx(np.mean(want)) and got["n"] == len(HYPS)
    bleu = evaluation.bootstrap(rows["bleu"], evaluation.bleu_stat, n_boot=200)
    assert bleu["value"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)
    assert bleu["ci95"][0] <= bleu["value"] <= bleu["ci95"][1]
    assert 0 < bleu["value"] < 100


def test_bootstrap_interval():
    const = evaluation.bootstrap([(2.0, 1)] * 50, n_boot=100)
    assert const == {"value": 2.0, "ci95": [2.0, 2.0], "n": 50}
    ratio = evaluation.bootstrap([(1, 4), (3, 4), (0, 0)], n_boot=300, seed=1)
    assert ratio["value"] == pytest.approx(0.5)  # a pooled ratio: 4 / 8, the empty sample adds nothing
    assert ratio == evaluation.bootstrap([(1, 4), (3, 4), (0, 0)], n_boot=300, seed=1)  # seeded
    coin = evaluation.bootstrap([(float(i % 2), 1) for i in range(400)], n_boot=500)
    assert coin["ci95"][0] < 0.5 < coin["ci95"][1] and coin["ci95"][1] - coin["ci95"][0] < 0.15
    # undefined, not 0 (e.g. precision with no predictions)
    assert evaluation.bootstrap([(0, 0)], n_boot=10)["value"] is None


def test_bertscore_with_a_local_model(tmp_path):
    bert_score = pytest.importorskip("bert_score")  # optional dependency; skipped where it is not installed
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer, wp.pre_tokenizer = normalizers.Lowercase(), pre_tokenizers.Whitespace()
    wp.train_from_iterator(
        HYPS + REFS,
        trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]),
    )
    wp.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    BertTokenizerFast(
        tokenizer_object=wp,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    ).save_pretrained(tmp_path)
    BertModel(
        BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(tmp_path)
    got = evaluation.bertscore_f1(HYPS[:3] + [REFS[0]], REFS[:3] + [REFS[0]], str(tmp_path), None, "cpu")
    _, _, want = bert_score.score(
        HYPS[:3] + [REFS[0]], REFS[:3] + [REFS[0]], model_type=str(tmp_path), num_layers=2, use_fast_tokenizer=True
    )
    assert got == pytest.approx(want.tolist()) and got[3] == pytest.approx(1.0)
    with pytest.raises(common.DataError, match="local model directory"):
        evaluation.bertscore_f1(HYPS, REFS, str(tmp_path / "nope"), None, "cpu")


def test_pass_at_k_per_problem_over_its_samples_without_broken_problems():
    records = [{"id": f"{p}#{j}", "problem": p} for p in ("a", "b", "c") for j in range(10)]
    runs = [
        {"passed": p == "a" or (p == "b" and j < 3), "status": "error" if p == "c" else "x"}
        for p in ("a", "b", "c")
        for j in range(10)
    ]
    rows, broken = evaluation.pass_at_k_rows(runs, records)
    assert broken == ["c"] and set(rows) == {"pass@1", "pass@10"}
    assert rows["pass@1"] == [(1.0, 1), (pytest.approx(0.3), 1)] and rows["pass@10"] == [(1.0, 1), (1.0, 1)]
    assert evaluation.bootstrap(rows["pass@1"], n_boot=50)["value"] == pytest.approx(0.65)  # the mean over problems
    few = evaluation.pass_at_k_rows(runs[:2] + runs[10:12], records[:2] + records[10:12])[0]
    assert set(few) == {"pass@1"}  # n = 2 < 10


def test_feedback_stats_on_policy_tokens(tiny_tokenizer):
    text = " tom from york has a red dog called rex."
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    _, offsets = common.decode_with_offsets(tiny_tokenizer, ids)
    raw = 'It says red.\n```json\n{"good_spans": ["tom from york"], "poor_spans": ["red", "purple"]}\n```'
    gen = {"id": "x", "response": text, "offsets": offsets}
    rows, shown = ev.score_policy([{"id": "x", "prompt": "p"}], [gen], [{"id": "x", "critique_raw": raw}], "qa")
    delta, _ = common.span_rewards(text, offsets, ["tom from york"], ["red"])  # the contract's delta (test_common)
    n_good, n_poor = delta.count(1.0), delta.count(-1.0)
    assert n_good >= 3 and [text[a:b] for (a, b), d in zip(offsets, delta) if d < 0] == [" red"]
    assert rows["rm/delta_sum"] == [(n_good - n_poor, 1)] and rows["rm/good_token_frac"] == [(n_good, len(offsets))]
    assert rows["rm/poor_token_frac"] == [(n_poor, len(offsets))] and rows["rm/unmatched_span_rate"] == [(1, 3)]
    assert rows["rm/parse_rate"] == [(1.0, 1)]
    assert shown[0]["poor"] == [(text.index("red"), text.index("red") + 3)] and shown[0]["unmatched"] == ["purple"]
    rows, _ = ev.score_policy([{"id": "x", "prompt": "p"}], [gen], [{"id": "x", "critique_raw": "no json"}], "qa")
    assert rows["rm/parse_rate"] == [(0.0, 1)] and rows["rm/delta_sum"] == [(0, 1)]


# ----------------------------------------------------------------------------------------------------------------------
# LLM judge against a real HTTP server
# ----------------------------------------------------------------------------------------------------------------------


def _shown(request):
    content = request["messages"][-1]["content"]
    return re.search(r"### Response A\n(.*?)\n\n### Response B\n(.*?)\n\nExplain", content, re.S).groups()


FPS = {"t2g": "fp1", "sft": "fp2"}


def test_judge_randomises_order_records_it_and_undoes_it(fake_openai, tmp_path):
    records = [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(24)]
    outputs = {"t2g": [f"GOOD answer {i}" for i in range(24)], "sft": [f"bad answer {i}" for i in range(24)]}
    seen = []

    def smart(body, n):  # always prefers the GOOD answer, wherever it is shown
        a, b = _shown(body)
        seen.append((a, b))
        return "A is accurate.\nWinner: A" if a.startswith("GOOD") else "B is better.\n**Winner:** B"

    with fake_openai(smart) as server:
        res = judge.judge_pairs(records, outputs, [("t2g", "sft")], server.base_url, "judge-x", 7, 4, tmp_path, FPS)
    pair = res["t2g_vs_sft"]
    assert pair["win"]["value"] == 1.0 and pair["loss"]["value"] == 0.0 and pair["n"] == 24
    order = pair["order"]
    assert set(order.values()) == {"t2g", "sft"}  # both orders were used ...
    for a, _ in seen:  # ... and the recorded order is the one the judge saw
        assert order[f"p{int(a.split()[-1])}"] == ("t2g" if a.startswith("GOOD") else "sft")
    cache = [json.loads(line) for line in (tmp_path / "judge.t2g_vs_sft.jsonl").read_text().splitlines()]
    assert {r["id"]: r["shown_first"] for r in cache} == order

    with fake_openai(lambda body, n: "Winner: A") as server:  # pure position bias: the undo must expose it
        res = judge.judge_pairs(
            records, outputs, [("t2g", "sft")], server.base_url, "judge-y", 7, 4, tmp_path / "y", FPS
        )
    pair, first = res["t2g_vs_sft"], sum(v == "t2g" for v in order.values())
    assert pair["order"] == order  # same seed, same coin per prompt
    assert pair["win"]["value"] == pytest.approx(first / 24) and pair["loss"]["value"] == pytest.approx(1 - first / 24)
    assert pair["a_shown_first"] == first and 0 < first < 24
    res = judge.judge_pairs(
        records, outputs, [("t2g", "sft")], "http://127.0.0.1:9/v1", "judge-y", 7, 4, tmp_path / "y", FPS
    )  # all cached: no request is made (port 9 would refuse)
    assert res["t2g_vs_sft"]["order"] == order


def test_judge_failure_is_one_clear_line_without_the_key(fake_openai, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    records, outputs = [{"id": "p0", "prompt": "q"}], {"t2g": ["x"], "sft": ["y"]}
    denied = lambda body, n: (401, {"error": {"message": "invalid api key", "type": "auth"}}, {})  # noqa: E731
    with fake_openai(denied) as server, pytest.raises(common.DataError, match="judge request failed") as err:
        judge.judge_pairs(records, outputs, [("t2g", "sft")], server.base_url, "judge", 0, 1, tmp_path, FPS)
    assert "sk-secret-123" not in str(err.value) and "\n" not in str(err.value)
    headers = {k.lower(): v for k, v in server.requests[0]["headers"].items()}
    assert headers["authorization"] == "Bearer sk-secret-123"  # the key was used, not shown


def test_parse_verdict():
    assert judge.parse_verdict("Winner: A") == "A" and judge.parse_verdict("blah\n**Winner**: tie") == "tie"
    assert judge.parse_verdict("Winner: A ... on reflection, Winner: B") == "B" and judge.parse_verdict("B") == "B"
    assert judge.parse_verdict("I cannot decide") == "invalid" and judge.parse_verdict("Answer: Bob") == "invalid"


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


class ReportParser(HTMLParser):
    """Text of each response element and the character intervals of its <mark> children, by class."""

    def __init__(self):
        super().__init__()
        self.responses, self.cur, self.mark, self.depth, self.srcs = {}, None, None, 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.srcs += [v for k, v in attrs if k in ("src", "href")]
        if tag == "div" and "response" in (a.get("class") or "").split():
            self.cur = (a["data-policy"], a["data-id"])
            self.responses[self.cur] = {"text": "", "good": [], "poor": []}
            self.depth = 1
        elif self.cur and tag == "div":
            self.depth += 1
        elif self.cur and tag == "mark":
            self.mark = (a["class"], len(self.responses[self.cur]["text"]))

    def handle_endtag(self, tag):
        if self.cur and tag == "mark":
            cls, start = self.mark
            self.responses[self.cur][cls].append((start, len(self.responses[self.cur]["text"])))
            self.mark = None
        elif self.cur and tag == "div":
            self.depth -= 1
            self.cur = None if self.depth == 0 else self.cur

    def handle_data(self, data):
        if self.cur:
            self.responses[self.cur]["text"] += data


def test_report_highlights_spans_at_their_character_positions():
    text = ' <b>tom</b> & "ann" from york has a red red dog; tom likes <script>x</script> the park.'
    good_q, poor_q = ["tom", "york has a red", "the park"], ["red", "<script>x</script>", "a red red"]
    good, poor, unmatched = common.locate_spans(text, good_q, poor_q)
    assert not unmatched
    records = [{"id": "r&1", "prompt": "post: <x> & y\nsummary:", "reference": "ref <i>"}]
    shown = {
        "sft": [
            {
                "id": "r&1",
                "response": text,
                "good": good,
                "poor": poor,
                "unmatched": ["zz"],
                "critique": 'says "red" twice <oops>',
                "source": "reward model",
                "delta_sum": -3.0,
            }
        ]
    }
    results = {
        "task": "demo",
        "data": "x.jsonl",
        "n_prompts": 1,
        "created": "now",
        "reward_model": "rm",
        "generation": {"temperature": 0.0, "max_new_tokens": 32},
        "policies": {"sft": {"n": 1, "metrics": {"rouge1": {"value": 0.5, "ci95": [0.4, 0.6], "n": 1}}}},
    }
    page = report.render_report(results, shown, records, "AAAA", ["r&1"], "demo")
    parser = ReportParser()
    parser.feed(page)
    got = parser.responses[("sft", "r&1")]
    assert got["text"] == text  # escaping round-trips: no tag in the response became markup
    label = [None] * len(text)  # expected: per-character labels (poor over good), merged into runs
    for lab, ivs in (("good", good), ("poor", poor)):
        for a, b in ivs:
            label[a:b] = [lab] * (b - a)
    runs, pos = {"good": [], "poor": []}, 0
    for lab, run in itertools.groupby(label):
        n = len(list(run))
        if lab:
            runs[lab].append((pos, pos + n))
        pos += n
    assert got["good"] == runs["good"] and got["poor"] == runs["poor"]
    assert text[got["poor"][0][0] : got["poor"][0][1]] == "a red red"  # "red" (2nd occurrence) merged into "a red red"
    assert any(text[a:b] == "<script>x</script>" for a, b in got["poor"])
    assert "<script>" not in page and "<oops>" not in page  # escaped everywhere, including the critique
    assert parser.srcs == ["data:image/png;base64,AAAA"]  # self-contained: nothing to fetch
    assert "@import" not in page and "url(" not in page


def test_curves_plot_what_is_present(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        "".join(json.dumps({"step": i, "objective/kl": i / 10, "objective/entropy": 1.0}) + "\n" for i in range(30))
        + '{"step": 30, "objective/k'
    )  # a run still writing: torn last line
    b.write_text("".join(json.dumps({"step": i, "loss": 1 / (i + 1)}) + "\n" for i in range(5)))
    runs = report.read_curves({"a": str(a), "missing": str(tmp_path / "nope.jsonl")})
    assert list(runs) == ["a"] and len(runs["a"]) == 30
    png = report.plot_curves(runs)
    assert __import__("base64").b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.plot_curves(report.read_curves({"b": str(b)})) is not None  # no known key: plots what is there
    assert report.plot_curves({}) is None


def test_curve_titles_name_only_what_is_drawn(monkeypatch):
    """A qa run has no exact critic: its panels were titled "reward: critic (solid), exact critic (dashed)" over one
    solid line. A title names the exact critic's dashed line only where one is drawn."""
    import matplotlib.axes

    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, label, *a, **k: titles.append(label))
    qa = [
        {"step": i, "objective/span_reward": 0.1 * i, "critic/flagged_rate": 0.5, "objective/kl": 0.0} for i in range(5)
    ]
    report.plot_curves({"qa": qa})
    assert titles == ["reward: critic", "answers flagged: critic", "KL to the reference"]
    titles.clear()
    demo = [{**r, "exact/span_reward": 0.2, "exact/mistake_rate": 0.4} for r in qa]
    report.plot_curves({"qa": qa, "demo": demo})
    assert titles == [
        "reward: critic (solid), exact critic (dashed)",
        "answers flagged: critic (solid), exact critic (dashed)",
        "KL to the reference",
    ]


class StripParser(HTMLParser):
    """The "Where the update went" strips: per strip, its token headers and, per row label, its cells' (value, title,
    background)."""

    def __init__(self):
        super().__init__()
        self.strips, self.row, self.inside, self.text = [], None, False, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("class") == "tokens":
            self.strips.append({"tokens": [], "rows": {}})
            self.inside = True
        elif self.inside and tag == "th":
            self.text = ""
        elif self.inside and tag == "td" and "cell" in a.get("class", ""):
            self.strips[-1]["rows"][self.row].append((float(a["data-v"]), a["title"], a["style"]))

    def handle_endtag(self, tag):
        if self.inside and tag == "th" and self.text is not None:
            if self.row is None and self.text != "token":
                self.strips[-1]["tokens"].append(self.text)
            self.text = None
        elif tag == "table":
            self.row, self.inside = None, False

    def handle_data(self, data):
        if self.text is not None:
            self.text += data
            if self.text in ("δt", "At span", "At scalar", "Δt span", "Δt scalar", "πold(yt)"):
                self.row = self.text
                self.strips[-1]["rows"][self.row] = []


def _trace_row(step, mode, tokens, delta, old, new_span, new_scalar, adv_span, adv_scalar, ratio):
    sample = {
        "row": 0,
        "prompt": "post: <b>x</b>\nsummary:",
        "critique": "says <cat>",
        "tokens": tokens,
        "has_eos": True,
        "delta": delta,
        "kl": [0.0] * len(tokens),
        "values": [0.0] * len(tokens),
        "rewards": {"span": delta, "scalar": [0.0] * (len(tokens) - 1) + [sum(delta)]},
        "advantages": {"span": adv_span, "scalar": adv_scalar},
        "logprobs_old": old,
        "logprobs_new": new_span if mode == "span" else new_scalar,
    }
    group = {"tokens": 1, "mean": -0.5, "mean_abs": 0.5, "down": 1.0}
    return {
        "step": step,
        "reward_mode": mode,
        "kl_coef": 0.2,
        "samples": [sample],
        "locality": {"poor": group, "good": group, "outside_flawed": group, "outside_clean": group, "ratio": ratio},
    }


def test_where_the_update_went_draws_each_token_with_its_exact_value(tmp_path):
    tokens, delta = [" tom", " cat", " <b>", ""], [1.0, -1.0, 0.0, 0.0]
    old, new_span, new_scalar = [-0.1, -3.0, -0.5, -0.01], [-0.05, -3.75, -0.5, -0.01], [-0.2, -3.5, -0.6, -0.02]
    adv_span, adv_scalar = [0.5, -1.2, 0.0, 0.3], [-0.7, -0.8, -0.9, -1.0]
    for name, mode in (("t2g", "span"), ("base", "scalar")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1}\n')
        rows = [
            _trace_row(s, mode, tokens, delta, old, new_span, new_scalar, adv_span, adv_scalar, 2.0 + s)
            for s in (1, 2, 3)
        ]
        (tmp_path / name / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    (tmp_path / "none").mkdir()
    specs = {n: str(tmp_path / n / "metrics.jsonl") for n in ("t2g", "base", "none")}
    traces = report.read_traces(specs)
    assert list(traces) == ["t2g", "base"] and [r["step"] for r in traces["t2g"]] == [1, 2, 3]  # torn line skipped
    section = report.render_update_section(traces)
    parser = StripParser()
    parser.feed(section)
    (strip,) = parser.strips
    assert strip["tokens"] == [" tom", " cat", " <b>", "⟨eos⟩"]  # escaped, not markup
    want = {
        "δt": delta,
        "At span": adv_span,
        "At scalar": adv_scalar,
        "Δt span": [b - a for a, b in zip(old, new_span)],
        "Δt scalar": [b - a for a, b in zip(old, new_scalar)],
    }
    assert set(strip["rows"]) == {*want, "πold(yt)"}
    for label, values in want.items():
        cells = strip["rows"][label]
        assert [v for v, _, _ in cells] == pytest.approx(values)
        for v, title, style in cells:
            assert title.endswith(f" = {v:+.6g}")  # the exact number on hover
            colour = "transparent" if v == 0 else "rgba(26,127,55," if v > 0 else "rgba(207,34,46,"
            assert colour in style  # green > 0, red < 0, none at 0
    assert [v for v, _, _ in strip["rows"]["πold(yt)"]] == pytest.approx([round(np.exp(x), 4) for x in old])
    assert "<b>" not in section and "<cat>" not in section and "data:image/png;base64," in section
    # another rollout in the scalar run's first iteration: no scalar update of this one to show
    other = [
        _trace_row(
            1, "scalar", [" ann", " dog", " <b>", ""], delta, old, new_span, new_scalar, adv_span, adv_scalar, 1.0
        )
    ]
    parser = StripParser()
    parser.feed(report.render_update_section({"t2g": traces["t2g"], "base": other}))
    assert set(parser.strips[0]["rows"]) == {"πold(yt)", "δt", "At span", "At scalar", "Δt span"}
    assert report.render_update_section({}) == ""
    results = {
        "task": "demo",
        "data": "x",
        "n_prompts": 0,
        "created": "now",
        "reward_model": None,
        "generation": {"temperature": 1.0, "max_new_tokens": 4},
        "policies": {},
    }
    assert "Where the update went" in report.render_report(results, {}, [], None, [], "demo", traces)
    assert "Where the update went" not in report.render_report(results, {}, [], None, [], "demo")


def test_where_the_update_went_draws_an_iteration_with_flagged_tokens_or_says_there_is_none():
    """Iteration 1 of both runs flagged nothing (delta = 0 on every traced token): the section drew it anyway, strips
    of nothing to see. It now draws the first iteration with a flagged token (delta < 0), both runs' updates paired as
    before, or says that no traced iteration has one."""
    tokens, old, adv = [" tom", " cat", " <b>", ""], [-0.1, -3.0, -0.5, -0.01], [0.5, -1.2, 0.0, 0.3]
    flat, flagged = [0.0] * 4, [1.0, -1.0, 0.0, 0.0]
    traces = {
        name: [
            _trace_row(s, mode, tokens, flagged if s == 3 else flat, old, old, old, adv, adv, 1.0) for s in (1, 2, 3)
        ]
        for name, mode in (("t2g", "span"), ("base", "scalar"))
    }
    section = report.render_update_section(traces)
    assert "Iteration 3:" in section and "Iteration 1:" not in section
    parser = StripParser()
    parser.feed(section)
    (strip,) = parser.strips
    assert [v for v, _, _ in strip["rows"]["δt"]] == flagged and "Δt scalar" in strip["rows"]  # paired as before
    for rows in traces.values():
        rows[2]["samples"][0]["delta"] = flat
    section = report.render_update_section(traces)
    assert "no traced iteration has a token the critic flagged (δ<sub>t</sub> &lt; 0)" in section
    assert "Iteration 1:" in section


# ----------------------------------------------------------------------------------------------------------------------
# Bad input, and a full run on tiny models
# ----------------------------------------------------------------------------------------------------------------------


def test_a_field_the_task_preset_names_and_the_data_lacks_names_the_flag_that_picks_it(tmp_path):
    """Issue 67, item 7: --task qa without --prompt-field said "missing field 'instruction'", and nothing about
    which flag picks another field."""
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "a", "question": "Hi?", "answer": "Hello."}])
    with pytest.raises(common.DataError, match=r"eval\.jsonl:1: missing field 'instruction' \(set --prompt-field\)$"):
        ev.main(["--task", "qa", "--data", str(data), "--policy", "p=runs/none", "--reward-model", "none"])
    with pytest.raises(common.DataError, match=r"eval\.jsonl:1: missing field 'output' \(set --reference-field\)$"):
        ev.main(
            [
                "--task",
                "qa",
                "--data",
                str(data),
                "--prompt-field",
                "question",
                "--reference-field",
                "output",
                "--policy",
                "p=runs/none",
                "--reward-model",
                "none",
            ]
        )


def test_missing_reference_and_empty_split_are_clear_errors(tmp_path):
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, [{"id": "a", "prompt": "p", "reference": "r"}, {"id": "b", "prompt": "x"}])
    with pytest.raises(common.DataError, match=r"eval\.jsonl:2: missing field 'reference'"):
        load_split(str(data), "prompt", "reference")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(common.DataError, match=r"empty\.jsonl: no records to evaluate \(empty split\)"):
        load_split(str(empty), "prompt", "reference")
    with pytest.raises(common.DataError, match="no records"):
        load_split(str(data), "prompt", None, limit=0)
    with pytest.raises(common.DataError, match="NAME=PATH"):
        ev.parse_named(["justapath"], "--policy")


def test_a_latin1_byte_in_the_data_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir):
    """--data saved as Latin-1 (café as the byte 0xe9): exit 2 and one line naming the file, line, byte and column,
    before any policy loads; no --output-dir."""
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"id": "a", "prompt": "p", "reference": "r"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "04_evaluate.py"),
            "--data",
            str(data),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            "none",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: {data}:2: not UTF-8 (byte 0xe9 at column 27)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_limit_below_one_exits_2_before_any_policy_loads(tmp_path, tiny_model_dir, limit):
    """--limit -1 evaluated all records but the last (a slice from the end) and exited 0; now 0 and below exit 2
    naming the flag, no --output-dir."""
    data = tmp_path / "eval.jsonl"
    data.write_text('{"prompt": "p", "reference": "r"}\n' * 2)
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "04_evaluate.py"),
            "--data",
            str(data),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            "none",
            "--limit",
            limit,
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(f"error: --limit {limit}: at least 1 record")
    assert not (tmp_path / "out").exists()


def test_missing_default_policies_are_skipped_with_a_warning(tmp_path, capsys):
    got = ev.resolve_policies([], {"sft": str(tmp_path), "scalar": str(tmp_path / "missing")})
    assert got == {"sft": str(tmp_path)} and "skipping policy 'scalar'" in capsys.readouterr().err
    with pytest.raises(common.DataError, match="no policy to evaluate"):
        ev.resolve_policies([], {"scalar": str(tmp_path / "missing")})
    args = ev.parse_args(["--device", "cpu"])  # an explicit local path that is missing: one line, no hub lookup
    with pytest.raises(common.DataError, match=r"--policy x=.*/missing: no such directory"):
        ev.load(str(tmp_path / "missing"), args, "--policy x=")


def test_cache_resumes_after_a_kill_and_drops_stale_rows(tmp_path):
    path, items, calls = tmp_path / "c.jsonl", [{"id": str(i)} for i in range(5)], []

    def compute(chunk):
        calls.extend(it["id"] for it in chunk)
        return [{"id": it["id"], "v": 2 * int(it["id"])} for it in chunk]

    evaluation.cached(path, "fp1", items[:3], compute, 2, "t")
    with open(path, "a") as f:
        f.write('{"id": "3", "v"')  # killed mid-write
    rows = evaluation.cached(path, "fp1", items, compute, 2, "t")
    assert calls == ["0", "1", "2", "3", "4"] and [r["v"] for r in rows] == [0, 2, 4, 6, 8]
    assert len(common.read_jsonl(path)) == 5  # the torn line is gone, nothing duplicated
    evaluation.cached(path, "fp2", items, compute, 2, "t")  # another policy or setting: everything is recomputed
    assert calls[5:] == ["0", "1", "2", "3", "4"] and len(common.read_jsonl(path)) == 5


def test_full_run_writes_results_and_report_and_reruns_from_cache(tiny_model_dir, adapter_dir, tmp_path, monkeypatch):
    data = tmp_path / "eval.jsonl"
    common.write_jsonl(data, demo_dataset("eval", 6))
    curves = tmp_path / "metrics.jsonl"
    curves.write_text(
        "".join(
            json.dumps({"step": i, "objective/span_reward": i * 0.1, "objective/kl": 0.01 * i}) + "\n"
            for i in range(20)
        )
    )
    rm_dir = as_reward_model(tiny_model_dir, tmp_path / "rm")
    argv = [
        "--data",
        str(data),
        "--policy",
        f"base={tiny_model_dir}",
        "--policy",
        f"lora={adapter_dir}",
        "--reward-model",
        rm_dir,
        "--rm-max-new-tokens",
        "12",
        "--max-new-tokens",
        "8",
        "--curves",
        f"t2g={curves}",
        "--output-dir",
        str(tmp_path / "out"),
        "--bootstrap",
        "100",
        "--device",
        "cpu",
        "--monitor-reward-model",
        f"same={rm_dir}",
        "--monitor-reward-model",
        f"other={as_reward_model(adapter_dir, tmp_path / 'other')}",
    ]
    results = ev.main(argv)
    saved = json.loads((tmp_path / "out/results.json").read_text())
    assert saved["policies"].keys() == {"base", "lora"} and saved["n_prompts"] == 6
    for pol in saved["policies"].values():
        assert pol["n"] == 6
        for key in (
            "rouge1",
            "rouge2",
            "rougeL",
            "bleu",
            "demo/delta_sum",
            "demo/mistake_rate",
            "demo/facts_right",
            "rm/delta_mean",
            "rm/poor_token_frac",
            "rm/parse_rate",
            "gen/tokens",
        ):
            assert pol["metrics"][key]["n"] == 6 and len(pol["metrics"][key]["ci95"]) == 2
        # a monitor reward model gets the monitor's rows under its name: the same model, the same numbers
        main = {k: v for k, v in pol["metrics"].items() if k.startswith("rm_vs_critic/")}
        assert main and {k.replace("rm_vs_critic/", "rm_vs_critic[same]/"): v for k, v in main.items()} == {
            k: v for k, v in pol["metrics"].items() if k.startswith("rm_vs_critic[same]/")
        }
        assert {k.split("/")[1] for k in pol["metrics"] if k.startswith("rm_vs_critic[other]/")} == {
            k.split("/")[1] for k in main
        }
    assert (tmp_path / "out/eval/base.critiques.other.jsonl").is_file()
    gens = {n: common.read_jsonl(tmp_path / f"out/eval/{n}.generations.jsonl") for n in ("base", "lora")}
    assert [g["id"] for g in gens["base"]] == [f"demo-eval-{i}" for i in range(6)]
    assert [g["response"] for g in gens["base"]] != [g["response"] for g in gens["lora"]]  # the adapter was applied
    for g in gens["base"]:  # offsets are the policy's own tokens, and the text is their decoding
        assert len(g["offsets"]) == len(g["response_ids"]) <= 8 and g["offsets"][-1][1] == len(g["response"])
    page = (tmp_path / "out/report.html").read_text()
    parser = ReportParser()
    parser.feed(page)
    assert {p for p, _ in parser.responses} == {"base", "lora"} and len(parser.responses) == 12
    assert "data:image/png;base64," in page
    assert "reward model &#x27;other&#x27; vs the exact critic" in page

    def boom(*a, **k):
        raise AssertionError("a rerun must not generate")

    monkeypatch.setattr(models, "generate", boom)
    monkeypatch.setattr(models, "load_model", boom)
    again = ev.main(argv)  # everything served from the eval/ caches
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "created")}  # noqa: E731
    assert strip(again) == strip(results)
    Path(adapter_dir, "adapter_model.safetensors").touch()  # the policy changed: its cache must be dropped
    with pytest.raises(AssertionError, match="must not generate"):
        ev.main(argv)


def test_code_task_on_a_benchmark_file_with_samples(tiny_model_dir, tmp_path):
    problems = [
        {
            "task_id": f"T/{i}",
            "prompt": f'def f{i}(x):\n    """Return x."""\n',
            "entry_point": f"f{i}",
            "canonical_solution": "    return x\n",
            "test": "def check(candidate):\n    assert candidate(1) == 1\n",
        }
        for i in range(2)
    ]
    problems.append(dict(problems[0], task_id="T/2", test="import no_such_module_t2g\n" + problems[0]["test"]))
    data = write_jsonl_gz(tmp_path / "he.jsonl.gz", problems)
    argv = [
        "--task",
        "code",
        "--data",
        str(data),
        "--policy",
        f"base={tiny_model_dir}",
        "--reward-model",
        "none",
        "--num-samples",
        "3",
        "--temperature",
        "1.0",
        "--max-new-tokens",
        "4",
        "--bootstrap",
        "50",
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--test-workers",
        "2",
    ]
    results = ev.main(argv)
    assert results["n_prompts"] == 3 and results["generation"]["num_samples"] == 3
    metrics = results["policies"]["base"]["metrics"]
    assert metrics["pass@1"]["n"] == 2 and "pass@10" not in metrics  # per problem; n = 3 < 10
    assert results["code_errors"] == {"base": ["T/2"]}  # its tests cannot run: an error, not a failed solution
    runs = common.read_jsonl(tmp_path / "out/eval/base.tests.jsonl")
    assert [r["id"] for r in runs] == [f"T/{i}#{j}" for i in range(3) for j in range(3)]
    assert {r["status"] for r in runs if r["id"].startswith("T/2")} == {"error"}
    for r in runs:  # the raw completion next to the program that ran: the prompt, then the cut completion
        assert r["program"].startswith(problems[int(r["id"][2])]["prompt"]) and isinstance(r["raw"], str)
    with pytest.raises(SystemExit):
        ev.parse_args(["--task", "code", "--num-samples", "2"])  # greedy samples would all be the same


def test_reward_model_gets_its_training_input_and_budget_with_every_default(
    tiny_model_dir, tiny_reward_model, tmp_path, monkeypatch
):
    """--max-prompt-tokens cuts the policy's prompt (its last tokens kept, as in stage 3); the reward model gets exactly
    the input stage 2 trained on, the task prompt cut to reward_model.json's max_prompt_tokens (infra.reward_models.rm_settings),
    and may write as many critique tokens as stage 2 evaluated it with (--rm-max-new-tokens' default)."""
    from transformers import AutoTokenizer

    rm = import_script("02_train_reward")
    rm_dir, rm_args = tiny_reward_model
    tok, rm_tok, settings = (
        AutoTokenizer.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(rm_dir),
        reward_models.rm_settings(rm_dir),
    )
    ex = demo_dataset("eval", 1)[0]
    long = {**ex, "prompt": ex["prompt"].replace("post: ", "post: " + "it rained on monday. " * 80)}
    common.write_jsonl(tmp_path / "eval.jsonl", [long])
    inputs = []

    def spy(real):  # the real generate (policy) or greedy_generate (reward model), recording what it was given
        def record(model, tokenizer, prompts, max_new_tokens, *a, **k):
            inputs.append((prompts, max_new_tokens))
            return real(model, tokenizer, prompts, max_new_tokens, *a, **k)

        return record

    monkeypatch.setattr(models, "generate", spy(models.generate))
    monkeypatch.setattr(decoding, "greedy_generate", spy(decoding.greedy_generate))
    ev.main(
        [
            "--data",
            str(tmp_path / "eval.jsonl"),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            rm_dir,
            "--max-new-tokens",
            "6",
            "--max-prompt-tokens",
            "250",
            "--output-dir",
            str(tmp_path / "out"),
            "--bootstrap",
            "10",
            "--device",
            "cpu",
        ]
    )
    ((policy_in,), _), ((rm_in,), rm_budget) = inputs
    assert len(policy_in) <= 250 and tok.decode(policy_in).endswith(long["prompt"].split("monday.")[-1])
    response = common.read_jsonl(tmp_path / "out/eval/base.generations.jsonl")[0]["response"]
    target = len(rm_tok(common.format_rm_target("c", [], []), add_special_tokens=False)["input_ids"]) + 1
    trained, status = rm.encode_example(
        rm_tok,
        {"prompt": long["prompt"], "response": response, "critique": "c", "good_spans": [], "poor_spans": []},
        rm_args.max_len,
        settings["max_prompt_tokens"],
    )
    assert status == "truncated" and rm_in == trained["input_ids"][:-target]
    assert len(rm_in) <= settings["max_prompt_tokens"] == rm_args.max_len - rm_args.max_new_tokens
    assert rm_budget == settings["max_new_tokens"] == rm_args.max_new_tokens


def test_rm_max_new_tokens_defaults_to_the_reward_model_then_the_preset(tiny_reward_model):
    """A critique budget of 96 tokens cut the real tasks' critiques before their span JSON: the default is what stage
    2 evaluated the reward model with, else the task's preset (512 but for the demo)."""
    rm_dir, rm_args = tiny_reward_model

    def budget(*argv):  # the critique budget 04 gives the reward model of --reward-model
        args = ev.parse_args(list(argv))
        return ev.rm_budgets(args.reward_model, args)[0]

    assert budget("--task", "summarization", "--reward-model", rm_dir) == rm_args.max_new_tokens
    assert budget("--task", "summarization", "--reward-model", "none") == 512
    assert budget("--task", "demo", "--reward-model", "none") == 96
    assert budget("--task", "qa", "--reward-model", rm_dir, "--rm-max-new-tokens", "7") == 7


def test_the_fallback_critique_budget_is_defined_once(monkeypatch):
    """Without a budget from reward_model.json, 04 gives a critique the budget 03's critic has by its preset: one
    number per task, infra.reward_models.critique_tokens, not a second copy of it."""
    ppo = import_script("03_train_policy")
    for task, preset in (("demo", "demo"), ("qa", "default"), ("summarization", "default")):
        args = ev.parse_args(["--task", task, "--reward-model", "none"])
        assert ev.rm_budgets(None, args)[0] == ppo.PRESETS[preset]["critic_max_new_tokens"]
    monkeypatch.setattr(reward_models, "critique_tokens", lambda task: 7)
    assert ev.rm_budgets(None, ev.parse_args(["--reward-model", "none"]))[0] == 7


@pytest.mark.parametrize("flag", ["--chat-template on", "--reward-model DIR", "--monitor-reward-model"])
def test_bad_model_input_exits_2_with_one_line_and_writes_nothing(tiny_model_dir, tmp_path, flag):
    """--chat-template on without a template, or a model directory without weights: one line, exit 2, no file. A
    monitor reward model that is not there: the same, before anything is generated."""
    from conftest import model_variant

    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 2))
    nowts = model_variant(tiny_model_dir, tmp_path / "noweights", weights=False)
    common.write_json(tmp_path / "noweights" / "reward_model.json", {"base_model": tiny_model_dir})
    if flag == "--monitor-reward-model":
        proc = forkserver.run(
            [
                sys.executable,
                str(ROOT / "04_evaluate.py"),
                "--data",
                str(tmp_path / "eval.jsonl"),
                "--policy",
                f"base={tiny_model_dir}",
                "--reward-model",
                as_reward_model(tiny_model_dir, tmp_path / "rm"),
                "--monitor-reward-model",
                f"toy={tmp_path / 'gone'}",
                "--output-dir",
                str(tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: --monitor-reward-model toy={tmp_path / 'gone'}: no such directory (run 02_train_reward.py first)"
        )
        assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
        return
    extra = ["--chat-template", "on", "--reward-model", "none"] if "chat" in flag else ["--reward-model", nowts]
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "04_evaluate.py"),
            "--data",
            str(tmp_path / "eval.jsonl"),
            "--policy",
            f"base={tiny_model_dir}",
            "--max-new-tokens",
            "4",
            "--output-dir",
            str(tmp_path / "out"),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --chat-template on: the tokenizer of {tiny_model_dir} has no chat template"
        if "chat" in flag
        else f"error: --reward-model {nowts}: cannot load the model: "
        + proc.stderr.strip().split(": cannot load the model: ")[-1]
    )
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert written == ([] if "chat" in flag else [tmp_path / "out/eval/base.generations.jsonl"])  # complete, cached


def test_a_spans_only_reward_model_is_asked_for_spans_only(
    tiny_model_dir, tiny_spans_only_reward_model, tmp_path, monkeypatch
):
    """02 --rm-format spans-only (w/o CoT): 04 reads the format from reward_model.json and gives the reward model the
    input it trained on, its spans-only instruction included, not the critique+spans one."""
    from transformers import AutoTokenizer

    rm = import_script("02_train_reward")
    rm_dir, rm_args = tiny_spans_only_reward_model
    rm_tok, settings = AutoTokenizer.from_pretrained(rm_dir), reward_models.rm_settings(rm_dir)
    assert settings["rm_format"] == "spans-only"
    ex = demo_dataset("eval", 1)[0]
    common.write_jsonl(tmp_path / "eval.jsonl", [ex])
    inputs, real = [], decoding.greedy_generate

    def record(model, tokenizer, prompts, *a, **k):
        inputs.extend(prompts)
        return real(model, tokenizer, prompts, *a, **k)

    monkeypatch.setattr(decoding, "greedy_generate", record)
    ev.main(
        [
            "--data",
            str(tmp_path / "eval.jsonl"),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            rm_dir,
            "--max-new-tokens",
            "6",
            "--output-dir",
            str(tmp_path / "out"),
            "--bootstrap",
            "10",
            "--device",
            "cpu",
        ]
    )
    response = common.read_jsonl(tmp_path / "out/eval/base.generations.jsonl")[0]["response"]
    rec = {"prompt": ex["prompt"], "response": response, "critique": "c", "good_spans": [], "poor_spans": []}
    trained, _ = rm.encode_example(rm_tok, rec, rm_args.max_len, settings["max_prompt_tokens"], "spans-only")
    target = len(rm_tok(common.format_rm_target("c", [], [], "spans-only"), add_special_tokens=False)["input_ids"]) + 1
    assert inputs == [trained["input_ids"][:-target]]
    assert common.RM_INSTRUCTIONS["spans-only"] in rm_tok.decode(inputs[0])
    assert common.RM_INSTRUCTION not in rm_tok.decode(inputs[0])


def test_a_judge_reply_without_choices_is_an_invalid_verdict(tmp_path, fake_openai):
    """A 200 reply with empty `choices` is an invalid verdict, counted as such; it never raises (IndexError)."""
    records = [{"id": str(i), "prompt": f"p{i}"} for i in range(3)]
    with fake_openai(
        lambda body, n: (200, {"id": "x", "object": "chat.completion", "created": 0, "model": "j", "choices": []}, {})
    ) as server:
        out = judge.judge_pairs(
            records,
            {"a": ["x"] * 3, "b": ["y"] * 3},
            [("b", "a")],
            server.base_url,
            "j",
            0,
            2,
            tmp_path,
            {"a": "fa", "b": "fb"},
        )
    assert out["b_vs_a"]["invalid"] == 3 and out["b_vs_a"]["n"] == 0
    assert all(r["verdict"] == "invalid" for r in common.read_jsonl(tmp_path / "judge.b_vs_a.jsonl"))


# ----------------------------------------------------------------------------------------------------------------------
# A new user's first day (issue 46): invalid verdicts, ties, the exact critic beside the reward model, quiet starts
# ----------------------------------------------------------------------------------------------------------------------


def _judge_results(tmp_path, fake_openai):
    records = [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(4)]
    outputs = {"t2g": [f"answer {i}" for i in range(4)], "sft": [f"other {i}" for i in range(4)]}
    with fake_openai(lambda body, n: "Winner: A" if "prompt 0" in str(body) else "I cannot tell.") as server:
        pairs = judge.judge_pairs(records, outputs, [("t2g", "sft")], server.base_url, "judge", 0, 1, tmp_path, FPS)
    return {
        "task": "qa",
        "data": "x.jsonl",
        "n_prompts": 4,
        "created": "now",
        "reward_model": None,
        "generation": {"temperature": 0.0, "max_new_tokens": 8},
        "policies": {n: {"n": 4, "metrics": {}} for n in outputs},
        "judge": {"model": "judge", "seed": 0, "pairs": pairs},
    }


def test_invalid_verdicts_are_printed_and_reported_with_the_win_rates_intervals(tmp_path, fake_openai, capsys):
    """3 of 4 verdicts invalid printed "win/tie/loss 0.000/0.000/1.000 (n=1)": the console and the report now give the
    invalid count, the report the intervals of the win rates too."""
    results = _judge_results(tmp_path, fake_openai)
    assert results["judge"]["pairs"]["t2g_vs_sft"]["invalid"] == 3
    report.print_table(results)
    out, err = capsys.readouterr()
    assert "(n=1 valid; 3 of 4 verdicts invalid)" in out
    assert "warning: judge t2g_vs_sft: 3 of 4 verdicts invalid (no 'Winner: A', 'B' or 'tie' line; " in err
    page = report.render_report(results, {}, [], None, [], "qa")
    judge = page.split("LLM judge", 1)[1].split("</table>", 1)[0]
    assert "<th>invalid</th>" in judge and "<td>3</td>" in judge and judge.count("<span class='ci'>[") == 3


def test_best_is_bold_only_where_its_interval_stands_apart():
    m = lambda v, lo, hi: {"value": v, "ci95": [lo, hi], "n": 200}  # noqa: E731
    results = {
        "task": "demo",
        "data": "x.jsonl",
        "n_prompts": 200,
        "created": "now",
        "reward_model": None,
        "generation": {"temperature": 1.0, "max_new_tokens": 32},
        "policies": {
            "sft": {
                "n": 200,
                "metrics": {"demo/mistake_rate": m(0.45, 0.38, 0.52), "demo/facts_right": m(0.80, 0.75, 0.85)},
            },
            "scalar": {
                "n": 200,
                "metrics": {"demo/mistake_rate": m(0.30, 0.24, 0.36), "demo/facts_right": m(0.82, 0.78, 0.86)},
            },
            "text2grad": {
                "n": 200,
                "metrics": {"demo/mistake_rate": m(0.20, 0.15, 0.26), "demo/facts_right": m(0.84, 0.80, 0.88)},
            },
        },
    }
    page = report.render_report(results, {}, [], None, [], "demo")
    rows = {
        label: re.findall(r"<td class='([^']*)'>", row)
        for label, row in re.findall(r"<tr><td title='([^']*)'>.*?</td>(.*?)</tr>", page)
    }
    # mistakes: text2grad 0.20 [0.15, 0.26] overlaps scalar 0.30 [0.24, 0.36]: a tie, no bold
    assert rows["demo/mistake_rate"] == ["", "tie", "tie"]
    assert rows["demo/facts_right"] == ["tie", "tie", "tie"]
    results["policies"]["scalar"]["metrics"]["demo/mistake_rate"] = m(0.35, 0.28, 0.42)  # apart from the best
    page = report.render_report(results, {}, [], None, [], "demo")
    assert "<td class='best'>0.200" in page and "class='tie'>0.200" not in page


def test_the_report_leads_with_its_verdict_and_says_how_each_part_was_decoded():
    """Issue 78: the first section is one verdict line per pair of policies on the headline metric (the demo's
    mistake rate), each with its value and interval; a rate over fewer than 20 cases is never bold; the metric table
    and the training curves each say how they were decoded (greedy held out, T = 1 in training)."""
    m = lambda v, lo, hi, n=200: {"value": v, "ci95": [lo, hi], "n": n}  # noqa: E731
    metrics = {
        "sft": {"demo/mistake_rate": m(0.45, 0.38, 0.52), "rm_vs_critic/mistakes_flagged": m(1.0, 1.0, 1.0, 4)},
        "scalar": {"demo/mistake_rate": m(0.30, 0.24, 0.36), "rm_vs_critic/mistakes_flagged": m(0.5, 0.0, 1.0, 4)},
        "text2grad": {"demo/mistake_rate": m(0.31, 0.25, 0.37), "rm_vs_critic/mistakes_flagged": m(0.5, 0.0, 1.0, 4)},
    }
    results = {
        "task": "demo", "data": "x.jsonl", "n_prompts": 200, "created": "now", "reward_model": None,
        "generation": {"temperature": 0.0, "max_new_tokens": 32},
        "policies": {name: {"n": 200, "metrics": ms} for name, ms in metrics.items()},
        "training": {"text2grad": {"failed": 0, "unjudged": [], "critiques": 0, "iterations": 3, "temperature": 1.0}},
    }  # fmt: skip
    page = report.render_report(results, {}, [], "png", [], "demo")
    verdict = page.split("<h2>Verdict", 1)[1].split("<h2>", 1)[0]
    assert page.index("<h2>Verdict") < page.index("<h2>Metrics</h2>") and "mistake rate" in verdict
    lines = re.findall(r"<li>(.*?)</li>", verdict)
    assert len(lines) == 3  # every pair
    assert "<b>scalar</b> is better: scalar 0.300 [0.240, 0.360] vs sft 0.450 [0.380, 0.520]" in lines
    assert "text2grad 0.310 [0.250, 0.370] vs scalar 0.300 [0.240, 0.360]: the intervals overlap" in lines[2]
    assert "greedy decoding" in verdict and "Held out, greedy decoding" in page
    assert "sampled at T = 1 (training, not held out)" in page.split("<h2>Training curves</h2>", 1)[1]
    flagged = re.findall(r"<tr><td title='rm_vs_critic/mistakes_flagged'>.*?</td>(.*?)</tr>", page)[0]
    assert "class='best'" not in flagged and "class='tie'" not in flagged  # 1.000 [1.000, 1.000] over 4: not bold
    for name in metrics:  # over 200 cases the same lead is marked
        metrics[name]["rm_vs_critic/mistakes_flagged"]["n"] = 200
    flagged = re.findall(r"<tr><td title='rm_vs_critic/mistakes_flagged'>.*?</td>(.*?)</tr>", report.render_report(
        results, {}, [], None, [], "demo"))[0]  # fmt: skip
    assert "class='tie'" in flagged


def _critic_results(bad_parse: float) -> dict:
    """Two policies' metrics: "good"'s critiques all parse, "bad"'s only a share `bad_parse` of its 8."""

    def metrics(parse):
        flawless = parse < 1  # a critique that does not parse quotes nothing: delta = 0, as if the answer were flawless
        m = lambda v: {"value": v, "ci95": [v, v], "n": 8}  # noqa: E731
        return {
            "rouge1": m(0.5),
            "rm/parse_rate": m(parse),
            "rm/delta_sum": m(0.0 if flawless else -1.5),
            "rm/poor_token_frac": m(0.0 if flawless else 0.3),
            "rm_vs_critic/poor_recall": m(0.0 if flawless else 0.6),
        }

    pols = {"good": {"n": 8, "metrics": metrics(1.0)}, "bad": {"n": 8, "metrics": metrics(bad_parse)}}
    for pol in pols.values():
        pol["critic_failed"] = evaluation.critic_failed(pol["metrics"])
    return {
        "task": "demo",
        "data": "x.jsonl",
        "n_prompts": 8,
        "created": "now",
        "reward_model": "rm",
        "generation": {"temperature": 1.0, "max_new_tokens": 32},
        "policies": pols,
    }


def test_a_critic_whose_critiques_mostly_failed_reads_n_a_not_a_perfect_score(capsys):
    """The reward model's critiques of "bad"'s answers parsed on 1 of 8: delta = 0 everywhere, which read as a flawless
    0.000 share of poor tokens (bold, the best). Below infra.reward_models.MIN_PARSE_RATE its rm/ and rm_vs_critic/
    rows read "n/a (7 of 8 critiques failed)" in the table and the report, never the best; a banner says so at the
    top of report.html, a warning on stderr; results.json keeps the numbers and marks them (critic_failed)."""
    results = _critic_results(1 / 8)
    assert results["policies"]["good"]["critic_failed"] is None
    assert results["policies"]["bad"]["critic_failed"] == {
        "failed": 7,
        "n": 8,
        "parse_rate": 0.125,
        "floor": reward_models.MIN_PARSE_RATE,
        "metrics": ["rm/delta_sum", "rm/poor_token_frac", "rm_vs_critic/poor_recall"],
    }
    report.print_table(results)
    out, err = capsys.readouterr()
    row = {line.split()[0]: line for line in out.splitlines()}
    for key in ("rm/delta_sum", "rm/poor_token_frac", "rm_vs_critic/poor_recall"):
        assert row[key].endswith("n/a (7 of 8 critiques failed)") and "0.000" not in row[key].split("]", 1)[1]
    assert "0.125" in row["rm/parse_rate"] and row["rouge1"].count("0.500") == 6  # the rest as they are
    assert err.strip().splitlines() == [
        "warning: bad: 7 of 8 of the reward model's critiques of its answers did not parse (rm/parse_rate 0.125, "
        "below 0.5): its rm/ and rm_vs_critic/ metrics read n/a (results.json keeps them, under critic_failed)"
    ]
    page = report.render_report(results, {}, [], None, [], "demo")
    banner = page.split("<div class='banner'>", 1)[1].split("</div>", 1)[0]
    assert page.index("<div class='banner'>") < page.index("<h2>Metrics</h2>")
    assert "bad" in banner and "7 of 8" in banner and "good" not in banner
    cells = {
        label: re.findall(r"<td class='([^']*)'>([^<]*)", row)
        for label, row in re.findall(r"<tr><td title='([^']*)'>.*?</td>(.*?)</tr>", page)
    }
    assert cells["rm/poor_token_frac"] == [("", "0.300"), ("na", "n/a")]  # "bad"'s 0.000 is no longer the best
    assert "7 of 8 critiques failed" in page.split("rm/poor_token_frac", 1)[1].split("</tr>", 1)[0]
    assert cells["rm/parse_rate"] == [("", "1.000"), ("", "0.125")]  # over 8 prompts: never marked (MIN_MARKED)
    ok = _critic_results(0.5)  # at the floor: not failed, no banner
    assert ok["policies"]["bad"]["critic_failed"] is None
    assert "class='banner'" not in report.render_report(ok, {}, [], None, [], "demo")


def test_stage4_marks_a_reward_model_that_never_parses(tiny_model_dir, tmp_path):
    """An untrained reward model with 4 critique tokens: none of its critiques parse. 04 prints its metrics n/a, warns,
    and the report carries the banner; results.json keeps the numbers, marked. The same model as a
    --monitor-reward-model: its rm_vs_critic[NAME]/ rows read n/a too (they read 0 mistakes flagged, 3 of 3 missed, as
    if it had judged)."""
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 3))
    rm = as_reward_model(tiny_model_dir, tmp_path / "rm")
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "04_evaluate.py"),
            "--data",
            str(tmp_path / "eval.jsonl"),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            rm,
            "--monitor-reward-model",
            f"toy={rm}",
            "--rm-max-new-tokens",
            "4",
            "--max-new-tokens",
            "4",
            "--bootstrap",
            "20",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("rm/poor_token_frac"))
    assert row.endswith("n/a (3 of 3 critiques failed)")
    assert "warning: base: 3 of 3 of the reward model's critiques of its answers did not parse" in proc.stderr
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["policies"]["base"]
    assert saved["critic_failed"]["failed"] == 3 and saved["metrics"]["rm/poor_token_frac"]["value"] == 0.0
    assert "<div class='banner'>" in (tmp_path / "out" / "report.html").read_text()
    toy = saved["monitor_failed"]["toy"]
    assert toy["failed"] == 3 and toy["metrics"] and all(k.startswith("rm_vs_critic[toy]/") for k in toy["metrics"])
    assert not set(toy["metrics"]) & set(saved["critic_failed"]["metrics"])  # each critic voids its own rows
    for key in toy["metrics"]:
        assert next(line for line in proc.stdout.splitlines() if line.startswith(key + " ")).endswith(
            "n/a (3 of 3 critiques failed)"
        )
    assert "warning: base: 3 of 3 of --monitor-reward-model toy's critiques did not parse" in proc.stderr


def test_the_exact_critic_shows_beside_the_reward_models_spans():
    """An SFT answer "called otto" (the post says daisy) that the reward model highlights as good: the report shows
    the exact critic's verdict under it, where " otto" is a poor span."""
    prompt = (
        "post: tom has a red dog called daisy. it rained on monday. the dog likes the park. it eats fish.\nsummary:"
    )
    response = " tom has a red dog called otto that likes the park and eats fish."
    offsets = [(m.start(), m.end()) for m in re.finditer(r" ?\S+", response)]
    records = [{"id": "r1", "prompt": prompt, "reference": "tom has a red dog called daisy."}]
    raw = json.dumps({"critique": "All right.", "good_spans": [" otto"], "poor_spans": []})
    _, shown = ev.score_policy(records, [{"response": response, "offsets": offsets}], [{"critique_raw": raw}], "demo")
    page = report.render_report(
        {
            "task": "demo",
            "data": "x",
            "n_prompts": 1,
            "created": "now",
            "reward_model": "rm",
            "generation": {"temperature": 1.0, "max_new_tokens": 32},
            "policies": {"sft": {"n": 1, "metrics": {}}},
        },
        {"sft": shown},
        records,
        None,
        ["r1"],
        "demo",
    )
    parser = ReportParser()
    parser.feed(page)
    rm_view = parser.responses[("sft", "r1")]
    assert [response[a:b] for a, b in rm_view["good"]] == [" otto"]  # the reward model's view ...
    exact = page.split("class='exact'", 1)[1].split("</div>", 1)[0]
    assert '<mark class="poor"> otto</mark>' in exact and "otto where the post says daisy" in exact  # ... and the truth


MONITOR = """
def critic(records, responses):  # quotes the first word as poor; intervals (the whole answer good) for the second
    out = []
    for rec, text in zip(records, responses):
        if rec["id"].endswith("2"):
            out.append({"error": "cannot judge <this> one"})
        elif rec["id"].endswith("1"):
            out.append({"critique": "all <good>", "spans": [{"start": 0, "end": len(text), "reward": 0.5}]})
        else:
            word = text.split()[0] if text.split() else ""
            out.append({"critique": f"<{word}> is wrong", "good_spans": [], "poor_spans": [word] if word else []})
    return out
"""


def monitor_views(page: str) -> dict[str, str]:
    """Each sample answer's --monitor block (class 'monitor'), by the answer's data-id."""
    return {
        rid: block.split("class='monitor'>", 1)[1].split("</div>", 1)[0]
        for rid, block in re.findall(r"data-id='([^']*)'(.*?)</div></div></div>", page, re.S)
        if "class='monitor'>" in block
    }


def test_a_monitors_spans_and_critique_show_under_each_sample_answer(tiny_model_dir, tmp_path):
    """--monitor python:...: its judgement of each sample answer (its spans highlighted, its critique, or why it
    could not judge it), labelled with its name, under the answer, as the reward model's are; before, the report
    showed only its summary rows."""
    (tmp_path / "my_mon.py").write_text(MONITOR)
    records = demo_dataset("eval", 3)
    common.write_jsonl(tmp_path / "eval.jsonl", records)
    results = ev.main(
        [
            "--data",
            str(tmp_path / "eval.jsonl"),
            "--policy",
            f"base={tiny_model_dir}",
            "--reward-model",
            "none",
            "--monitor",
            f"python:{tmp_path / 'my_mon.py'}:critic",
            "--max-new-tokens",
            "6",
            "--bootstrap",
            "20",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    assert results["policies"]["base"]["metrics"]["monitor[my_mon.py:critic]/error_rate"]["value"] == 1 / 3
    gens = {g["id"]: g["response"] for g in common.read_jsonl(tmp_path / "out/eval/base.generations.jsonl")}
    views = monitor_views((tmp_path / "out/report.html").read_text())
    assert sorted(views) == [r["id"] for r in records]  # every sample answer shown has the monitor's view
    for rid, view in views.items():
        assert view.startswith("your critic my_mon.py:critic: ")
        text = gens[rid]
        if rid.endswith("2"):
            assert "could not judge it: cannot judge &lt;this&gt; one" in view
        elif rid.endswith("1"):
            assert f'<mark class="good">{report.html.escape(text)}</mark>' in view and "all &lt;good&gt;" in view
        else:
            word = text.split()[0]
            assert view.count('<mark class="poor">') == 1 and f"&lt;{report.html.escape(word)}&gt; is wrong" in view
            assert f'<mark class="poor">{report.html.escape(word)}</mark>' in view
            rest = text[text.index(word) + len(word) :].strip()
            assert not rest or report.html.escape(rest) not in view  # issue 80, item 7: the answer is not repeated


def test_a_qa_answer_with_code_is_shown_in_monospace():
    """Issue 80, item 7: 04 --task qa showed a code answer in a proportional font (only --task code's were
    monospace). An answer with a fenced block or an indented line is monospace in any task; prose is not."""
    code = "Use a loop:\n```python\nfor x in xs:\n    print(x)\n```"
    prose = "Paris is the capital of France."
    records = [{"id": "a", "prompt": "q1"}, {"id": "b", "prompt": "q2"}]
    shown = [
        {"response": r, "good": [], "poor": [], "critique": "", "source": "", "delta_sum": None, "unmatched": []}
        for r in (code, prose)
    ]
    results = {
        "task": "qa",
        "data": "x",
        "n_prompts": 2,
        "created": "now",
        "reward_model": None,
        "generation": {"temperature": 0.0, "max_new_tokens": 32},
        "policies": {"p": {"n": 2, "metrics": {}}},
    }
    page = report.render_report(results, {"p": shown}, records, None, ["a", "b"], "qa")
    classes = dict(re.findall(r"<div class='([^']*)' data-policy='p' data-id='(\w)'", page))
    assert {v: k for k, v in classes.items()} == {"a": "response mono", "b": "response"}
    assert ".response.mono{" in page or ",.response.mono{" in page
    assert report.looks_like_code("    indented()") and not report.looks_like_code("a\n  two spaces")


def test_policies_alone_look_for_no_demo_curves():
    assert ev.curve_specs(ev.parse_args(["--policy", "mine=some/dir"])) == {}
    assert ev.curve_specs(ev.parse_args([])) == ev.DEMO_CURVES
    assert ev.curve_specs(ev.parse_args(["--policy", "a=b", "--curves", "a=m.jsonl"])) == {"a": "m.jsonl"}


@pytest.mark.parametrize("policy", ["runs/smolm2", "no-such-org/no-such-model"])
def test_a_failed_start_leaves_no_folder_and_checks_every_policy_first(tmp_path, tiny_model_dir, policy):
    """A typo'd local path is one line before any policy generates; a hub id that cannot load leaves no ev/eval/."""
    (tmp_path / "runs").mkdir()
    common.write_jsonl(tmp_path / "eval.jsonl", demo_dataset("eval", 2))
    first = ["--policy", f"ok={tiny_model_dir}"] if policy.startswith("runs/") else []  # a hub id fails as it loads
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "04_evaluate.py"),
            "--data",
            "eval.jsonl",
            *first,
            "--policy",
            f"typo={policy}",
            "--reward-model",
            "none",
            "--output-dir",
            "ev",
            "--max-new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: --policy typo={policy}: "
            + ("no such directory" if policy.startswith("runs/") else "cannot load the model")
        )
    )
    assert not (tmp_path / "ev").exists()  # the local typo: checked before the first policy generated anything
