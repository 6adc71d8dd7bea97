"""The helper module of the four Text2Grad stages: what two or more of them share, so that it cannot drift apart.
No torch or transformers at module level: parsing and alignment work without them (functions that need them import
them lazily). Task-specific parts live in tasks/ (the sandbox and the code task, the demo world); what one stage alone
uses lives in that stage.

Contents: the core first (copy it as is), then what the stages share.
  core  1. Records                   DataError, iter_jsonl, read_jsonl, atomic_open, write_json, write_jsonl
        2. Feedback parsing          parse_feedback: critic text -> {"critique", "good_spans", "poor_spans"}
        3. Span <-> token alignment  find_span, locate_spans, decode_with_offsets, span_rewards (delta_t, Sec. 3.3),
                                     span_tokens, unambiguous_quotes, interval_rewards (delta_t from located
                                     intervals with real rewards: a python: critic's, tasks/plugin.py)
        4. Datasets, resumable I/O   read_rows, open_resumable_jsonl, append_jsonl
        5. Reward-model format       rm_user_message, build_rm_prompt, rm_prompt, format_rm_target (z = [c ; A(y)],
                                     Sec. 3.4), rm_settings; OpenAI-compatible servers: api_error, retry_delay,
                                     send_with_retries, check_server (a preflight), rm_critique_served
        6. Models                    load_model, check_transformers, check_model_path, check_reward_model,
                                     generation_config, policy_prompt, generate, rm_critique; static_decode,
                                     generate_static (a static KV cache, the decode step under torch.compile:
                                     generate()'s tokens at the model's speed)
        7. Training pieces           torch_dtype, add_lora, peft_wraps_quietly, save_pretrained, share_files
        8. Reward-model metrics      rm_scores, rm_span_metrics (paper Tables 1 and 6)
The paper's baselines (a Bradley-Terry or process reward model, DPO, SFT + reflection) live in baselines/.
"""
from __future__ import annotations

import ast
import functools
import json
import os
import re
import tempfile
import unicodedata
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path

# ----------------------------------------------------------------------------------------------------------------------
# 1. Records (core): one JSON object per line; an error names the file and line
# ----------------------------------------------------------------------------------------------------------------------


class DataError(ValueError):
    """Bad user input. Its message is one line naming the file, line and field; scripts print it and exit 2."""


def iter_jsonl(path, required: tuple[str, ...] = ()):
    """(line number, record) per non-blank line of a JSONL file (.jsonl.gz too), each `required` field a string.
    Lines end at "\n" only: a lone "\r" is JSON whitespace, and counting it as a line break (text mode's universal
    newlines) would shift every later line number. Raises DataError('file:line: reason')."""
    import gzip
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8", newline="\n") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for field in required:
                if field not in rec:
                    raise DataError(f"{path}:{lineno}: missing field '{field}'")
                if not isinstance(rec[field], str):
                    raise DataError(f"{path}:{lineno}: field '{field}' must be a string")
            yield lineno, rec


def read_jsonl(path, required: tuple[str, ...] = ()) -> list[dict]:
    """All records of a JSONL file (.jsonl.gz too); blank lines are skipped. Raises DataError('file:line: reason')."""
    return [rec for _, rec in iter_jsonl(path, required)]


_UMASK = os.umask(0o022)  # read the process umask once, at import (setting it is not thread-safe)
os.umask(_UMASK)


@contextmanager
def atomic_open(path, mode: str = "w"):
    """Write to a temp file next to `path`, then rename: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give the result the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path, obj) -> None:
    with atomic_open(path) as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path, records) -> None:
    with atomic_open(path) as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)


def content_fingerprint(path, head_bytes: int = 1 << 20) -> str:
    """A short hash of what a file, or the files directly in a folder (a saved model: weights, config, tokenizer;
    not its checkpoints/), hold: each one's name, size and first MiB. Caches key a model by it, not by its path, so
    a model retrained or rebuilt in the same folder is a new key. An adapter's base model is hashed in too. Cheap: a
    retrained model's weights differ in their first MiB (the safetensors header, then the first tensors)."""
    import hashlib

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]:
        with open(f, "rb") as fh:
            h.update(f"{f.name}:{f.stat().st_size}:".encode() + fh.read(head_bytes))
    base = path / "adapter_config.json"
    if base.is_file():
        base = json.loads(base.read_text()).get("base_model_name_or_path") or ""
        h.update(content_fingerprint(base, head_bytes).encode() if Path(base).exists() else base.encode())
    return h.hexdigest()[:12]


# ----------------------------------------------------------------------------------------------------------------------
# 2. Feedback parsing (core): raw critic text -> {"critique", "good_spans", "poor_spans"}
# ----------------------------------------------------------------------------------------------------------------------

_GOOD_KEYS = {"good_spans", "positive_spans"}
_POOR_KEYS = {"poor_spans", "negative_spans", "bad_spans"}
_CRITIQUE_KEYS = ("critique", "textual_feedback", "feedback", "code_feedback")


def _norm_key(key) -> str:
    return re.sub(r"[\s\-]+", "_", str(key).strip().lower())


def _find_feedback(obj) -> tuple[dict | None, object]:
    """(the last dict in text order, `obj` or nested, that holds a span list; its critique), or (None, None). The
    critique is that dict's own critique key, else the nearest enclosing dict's string critique (e.g.
    {"critique": ..., "spans": {"good_spans": ...}}), else None."""
    found, stack = (None, None), [(obj, None)]
    while stack:  # iterative pre-order walk: LLM output can nest deeper than Python's recursion limit
        node, critique = stack.pop()
        if isinstance(node, dict):
            fields = {_norm_key(k): v for k, v in node.items()}
            own = next((fields[k] for k in _CRITIQUE_KEYS if k in fields), None)
            if fields.keys() & (_GOOD_KEYS | _POOR_KEYS):
                found = (node, own if own is not None else critique)
                continue
            critique = own if isinstance(own, str) else critique
            children = list(node.values())
        else:
            children = node if isinstance(node, list) else []
        stack.extend((child, critique) for child in reversed(children))
    return found


def _balanced_end(text: str, start: int) -> int:
    """Index just past the '}' closing the '{' at `start` (string-aware), or -1."""
    depth, quote, escaped = 0, None, False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth == 0:
                return i + 1
    return -1


def _decode_object(text: str, start: int):
    """(object, end) for the JSON-ish object at `start`, or (None, start + 1). Lenient about LLM habits."""
    try:
        return json.JSONDecoder(strict=False).raw_decode(text, start)  # strict=False: raw newlines inside strings
    except (ValueError, RecursionError):
        pass
    end = _balanced_end(text, start)
    chunk = re.sub(r",\s*([}\]])", r"\1", text[start:end]) if end > 0 else ""  # trailing commas
    # literal_eval: 'quotes', True/None; never runs code
    for loads in (functools.partial(json.loads, strict=False), ast.literal_eval) if chunk else ():
        try:
            return loads(chunk), end
        except Exception:  # noqa: BLE001 - any failure just means "not this parser"
            pass
    return None, start + 1


# A template's stand-in is not content: "...", "\u2026", "[...]" (ast.literal_eval reads a bare [...] as [Ellipsis]),
# anything of dots, ellipses, brackets and quotes alone; for a critique also one "<description>" in angle brackets.
_PLACEHOLDER = re.compile(r"[\s\[\]()<>\"'`]*(?:\.\.|\u2026)[\s.\u2026\[\]()<>\"'`]*")
_DESCRIPTION = re.compile(r"<[^<>\n]+>")


def _is_placeholder(value, critique: bool = False) -> bool:
    if value is Ellipsis:
        return True
    return isinstance(value, str) and bool(_PLACEHOLDER.fullmatch(value.strip()) or critique and
                                           _DESCRIPTION.fullmatch(value.strip()))


def _span_list(value):
    """The strings of a span list (a lone string: a list of one), without placeholders; None when it held nothing but
    placeholders: a template's list, not filled in, is no span list."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    spans = [s for s in items if isinstance(s, str) and not _is_placeholder(s)]
    return None if not spans and any(_is_placeholder(s) for s in items) else spans


def _read_feedback(feedback: dict, critique) -> tuple[dict | None, bool]:
    """The dict _find_feedback chose, read without placeholders: ({"critique": its critique or None (absent),
    "good_spans", "poor_spans"}, False); or (None, True) when its span lists hold only placeholders (a template's
    lists, not filled in), or when it holds placeholders and nothing else (a template echoed as it is)."""
    fields = {_norm_key(k): v for k, v in feedback.items()}
    good = next((_span_list(fields[k]) for k in fields if k in _GOOD_KEYS), [])
    poor = next((_span_list(fields[k]) for k in fields if k in _POOR_KEYS), [])
    placeholder = _is_placeholder(critique, critique=True)
    critique = None if placeholder else critique
    has_critique = critique is not None and (not isinstance(critique, str) or bool(critique.strip()))
    if good is None and poor is None or placeholder and not good and not poor and not has_critique:
        return None, True
    return {"critique": critique, "good_spans": good or [], "poor_spans": poor or []}, False


def parse_feedback(text: str) -> dict:
    """Critic output -> {"critique": str, "good_spans": [str], "poor_spans": [str]}. The JSON may be fenced, follow
    chain-of-thought, or precede chatter. Of several objects, the last one holding a span list (good_spans or
    poor_spans, at any depth) wins; with only one of the two lists, the other is []. Its critique is the critique key
    next to the lists, else one around them, else the prose before the JSON. ValueError when no object holds a span
    list: an output without spans (cut off before them, critique only) counts as unparsed, never as "no spans".
    Placeholders ("...", "\u2026", [...], a "<description>" critique) count as absent: a span list of nothing else is
    no span list, and an object of nothing else (a template the critic echoed) is never chosen."""
    if not isinstance(text, str):
        raise ValueError(f"critic output must be a string, got {type(text).__name__}")
    chosen, chosen_start, any_obj, echoed, pos = None, 0, False, False, 0
    while (start := text.find("{", pos)) >= 0:
        obj, pos = _decode_object(text, start)
        if isinstance(obj, dict):
            any_obj = True
            feedback, found_critique = _find_feedback(obj)
            if feedback is not None:
                fields, was_echo = _read_feedback(feedback, found_critique)
                echoed = echoed or was_echo
                if fields is not None:
                    chosen, chosen_start = fields, start
    if chosen is None:
        raise ValueError(
            "only template placeholders ('...', [...]) where the spans belong: a format echoed, not filled in" if echoed
            else "no JSON object with good_spans or poor_spans in critic output" if any_obj
            else "no JSON object (with good_spans or poor_spans) found in critic output")
    critique = chosen["critique"]
    if critique is None:  # prose before the JSON, minus an opening code fence
        critique = re.sub(r"```[\w-]*\s*$", "", text[:chosen_start]).strip()
    elif not isinstance(critique, str):
        critique = json.dumps(critique, ensure_ascii=False, default=str)
    return {"critique": critique.strip(), "good_spans": chosen["good_spans"], "poor_spans": chosen["poor_spans"]}


# ----------------------------------------------------------------------------------------------------------------------
# 3. Span <-> token alignment by character intervals (core; paper Sec. 3.3 and App. L)
# ----------------------------------------------------------------------------------------------------------------------

_CHAR_MAP = {"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
             "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"', "\u00ab": '"', "\u00bb": '"',
             "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2015": "-", "\u2212": "-"}
_WRAP_CHARS = "\"'` \t\n"  # quote marks (straightened by _CHAR_MAP) and backticks a critic may put around a quote


@functools.lru_cache(maxsize=64)  # locate_spans looks up every quote, and repeats, in the same response
def _normalize(s: str) -> tuple[str, list[tuple[int, int]]]:
    """Unicode NFC (é whether one code point or e + accent), case-fold, straighten quotes/dashes, collapse whitespace
    runs. Returns (normalized, the source interval [start, end) of the character (with its accents) or whitespace run
    that each normalized character comes from)."""
    out, src, i, n = [], [], 0, len(s)
    while i < n:
        j = i + 1
        if s[i].isspace():
            while j < n and s[j].isspace():
                j += 1
            out.append(" ")
            src.append((i, j))
        else:  # a character and the marks that belong to it: composed or not, it is one unit of the source
            while j < n and s[j] >= "\u0300" and (unicodedata.category(s[j])[0] == "M" or "\u1160" <= s[j] <= "\u11ff"):
                j += 1  # a combining mark, or a Hangul vowel / final jamo
            if j == i + 1 and s[i] < "\u0080":  # ASCII: the common case, nothing to compose or straighten
                out.append(s[i].lower())
                src.append((i, j))
                i = j
                continue
            unit = "".join(_CHAR_MAP.get(ch, ch) for ch in unicodedata.normalize("NFC", s[i:j]))
            for c in unicodedata.normalize("NFC", unit.lower()):  # lower() may yield 2 chars ("İ"): both map to it
                out.append(c)
                src.append((i, j))
        i = j
    return "".join(out), src


def _quote_variants(span: str):
    """The span, then the span with the critic's wrapping removed: quotes, ellipses, trailing punctuation."""
    s = _normalize(span)[0].strip()
    yield s
    peels = (lambda x: x.strip(_WRAP_CHARS), lambda x: re.sub(r"^(?:\.\.\.|\u2026)\s*", "", x),
             lambda x: re.sub(r"\s*(?:\.\.\.|\u2026)$", "", x), lambda x: x.rstrip(".,;:!?").rstrip())
    for _ in range(3):  # peel one layer at a time, e.g.  "...the dog.",  ->  ...the dog.  ->  the dog.  ->  the dog
        for peel in peels:
            s = peel(s)
            yield s


def _is_word(ch: str) -> bool:
    """A character no word boundary can fall next to (a combining accent is part of its letter). Scripts written
    without spaces (CJK, Thai, Lao) have none."""
    return (ch.isalnum() or ch == "_" or ch >= "\u0300" and unicodedata.category(ch)[0] == "M") and not (
        "\u2e80" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" or "\u0e00" <= ch <= "\u0eff")


def _find_bounded(text: str, span: str, start: int) -> int:
    """text.find(span, start), skipping matches that begin or end inside a word ("he" is not in "the"), or before an
    accent that belongs to the letter in front of it ("cafe" is not in NFD "cafe\u0301")."""
    i, n = text.find(span, start), len(span)
    mark = lambda k: k < len(text) and unicodedata.category(text[k])[0] == "M"  # noqa: E731
    while i >= 0 and ((i > 0 and (_is_word(text[i]) and _is_word(text[i - 1]) or mark(i))) or
                      (i + n < len(text) and (_is_word(text[i + n - 1]) and _is_word(text[i + n]) or mark(i + n)))):
        i = text.find(span, i + 1)
    return i


def find_span(text: str, span: str, start: int = 0) -> tuple[int, int] | None:
    """[start, end) of the first occurrence of `span` in `text` at or after `start`, or None. Exact match first; then
    tolerant of whitespace runs, case, curly quotes/dashes, Unicode normalization (NFC vs NFD), and quotes, ellipses
    or trailing punctuation the critic wrapped around the quote; never of anything else, never inside a longer word
    ("2." is not in "12."), and never half a character (an e without its combining accent)."""
    if not span or not span.strip():
        return None
    i = _find_bounded(text, span, start)
    if i >= 0:
        return i, i + len(span)
    norm_text, src = _normalize(text)
    norm_start = next((k for k, (j, _) in enumerate(src) if j >= start), len(src))
    for variant in dict.fromkeys(_quote_variants(span)):  # unique, in order
        if not variant:
            return None
        k = _find_bounded(norm_text, variant, norm_start)
        while k >= 0 and (k > 0 and src[k - 1] == src[k] or k + len(variant) < len(src) and
                          src[k + len(variant)] == src[k + len(variant) - 1]):  # half of a source character: no
            k = _find_bounded(norm_text, variant, k + 1)
        if k >= 0:
            return src[k][0], src[k + len(variant) - 1][1]
    return None


def locate_spans(text: str, good_spans: list[str], poor_spans: list[str]):
    """(good_intervals, poor_intervals, unmatched_quotes). Quotes claim occurrences in order, good first: each takes
    the earliest occurrence an identical earlier quote has not claimed (a word quoted as good, then as poor, labels
    its first occurrence good and its second poor). A poor quote that finds every occurrence claimed takes the
    earliest one a good quote claimed: poor wins. Empty or whitespace-only quotes are ignored."""
    claimed: dict[str, dict[tuple[int, int], str]] = {}  # quote -> {interval: label of the quote that claimed it}
    located, unmatched = {"good": [], "poor": []}, []
    for label, spans in (("good", good_spans), ("poor", poor_spans)):
        for span in spans:
            if not isinstance(span, str) or not span.strip():
                continue
            taken = claimed.setdefault(span.strip(), {})
            pos, iv = 0, None
            while (iv := find_span(text, span, pos)) is not None and iv in taken:
                pos = iv[0] + 1
            if iv is None and label == "poor":
                iv = min((x for x, by in taken.items() if by == "good"), default=None)
            if iv is None:
                unmatched.append(span)
                continue
            taken[iv] = label
            located[label].append(iv)
    return located["good"], located["poor"], unmatched


def decode_with_offsets(tokenizer, token_ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text and each token's character interval in it, from incremental decoding of the ids (never by
    re-tokenizing the text). Token i ends where the decode of ids[:i + 1] stops agreeing with the text (never before
    token i - 1 ends): a special token, or one that does not complete a character, gets an empty interval.
    Linear time: each token's window of at most 2 * _WINDOW ids (more inside a run of byte-fallback tokens) is
    decoded, all in one batch, and the prefix's decode is tracked as "the previous one, its tail replaced by the new
    window's". Should that not end on the text exactly (a tokenizer whose decoding is not local), the prefixes are
    decoded one by one."""
    token_ids = [int(t) for t in token_ids]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    n, w = len(token_ids), _WINDOW
    # A byte-fallback decoder (Llama-2, Mistral, Gemma: <0xE5><0x8C><0x97> is 北) decodes a run of byte tokens as a
    # whole, and the whole run becomes U+FFFD when any of it is not UTF-8: a window must never start inside a run.
    pieces = getattr(tokenizer, "convert_ids_to_tokens", lambda ids: [None] * len(ids))(token_ids)
    in_run = [i > 0 and all(isinstance(p, str) and _BYTE_PIECE.fullmatch(p) for p in pieces[i - 1:i + 1])
              for i in range(n)]
    edge = list(range(n + 1))  # edge[j]: where a window meant to start at token j starts (its byte run's first token)
    for j in range(1, n):
        edge[j] = edge[j - 1] if in_run[j] else j
    # token i's window starts a block before its own block of w tokens, so the window's left edge, where a decode can
    # differ from the decode in context (a stripped leading space, half a character), is the same in both strings
    # compared: the window up to token i, and up to token i - 1 (the previous window, or one extra per block)
    windows = [token_ids[edge[max(0, (i // w - 1) * w)]: i + 1] for i in range(n)]
    windows += [token_ids[edge[max(0, b - w)]: b] for b in range(0, n, w)]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust batch when it decodes the same, ~3x faster
    fast = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    decoded = (backend.decode_batch if fast else tokenizer.batch_decode)(windows, skip_special_tokens=True)
    offsets, pos, agree, length = [], 0, 0, 0  # agree: how much of the prefix's decode is the text; length: its size
    for i in range(n):
        a, b = decoded[i], decoded[i - 1] if i % w else decoded[n + i // w]
        keep = len(b) if a.startswith(b) else len(os.path.commonprefix([a, b]))
        kept, added = length - len(b) + keep, a[keep:]  # the prefix's decode: its first `kept` chars, then `added`
        if kept < 0:
            return _decode_with_offsets_by_prefix(tokenizer, token_ids, text)
        if agree >= kept:
            agree = kept + (len(added) if text.startswith(added, kept) else
                            len(os.path.commonprefix([added, text[kept:kept + len(added)]])))
        length = kept + len(added)
        pos = max(agree, pos)
        offsets.append(pos)
    if length != len(text) or agree != len(text):
        return _decode_with_offsets_by_prefix(tokenizer, token_ids, text)
    return text, list(zip([0] + offsets[:-1], offsets))


_WINDOW = 4  # tokens: a character split into byte tokens spans at most 4 (UTF-8); measured fastest of 4, 8 and 16
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token, as SentencePiece's vocabularies write them


def _decode_with_offsets_by_prefix(tokenizer, token_ids: list[int], text: str):
    """The definition itself, in quadratic time, for tokenizers whose decoding the windows cannot follow."""
    prefixes = tokenizer.batch_decode([token_ids[: i + 1] for i in range(len(token_ids))], skip_special_tokens=True)
    offsets, pos = [], 0
    for prefix in prefixes:
        end = max(len(os.path.commonprefix([prefix, text])), pos)
        offsets.append((pos, end))
        pos = end
    if offsets and pos < len(text):  # whatever the prefixes never agreed on belongs to the last token
        offsets[-1] = (offsets[-1][0], len(text))
    return text, offsets


def _core(text: str, s: int, e: int) -> tuple[int, int]:
    """A token's interval less the whitespace it carries (the space of "Ġdog"); a whitespace-only one's as it is."""
    piece = text[s:e]
    if piece.strip():
        s, e = s + len(piece) - len(piece.lstrip()), e - (len(piece) - len(piece.rstrip()))
    return s, e


def span_rewards(text: str, offsets: list[tuple[int, int]], good_spans: list[str], poor_spans: list[str]):
    """Per-token pseudo-rewards delta_t in {-1, 0, +1} (paper Sec. 3.3), and the quotes that could not be located.
    A token takes a span's label when the non-whitespace part of its interval lies inside the span. Tokens straddling
    a span edge get 0 (App. L); poor overrides good, and a token that overlaps a poor span is never +1.
    A token holding only part of a multi-byte character (an empty interval right before a non-ASCII character, see
    decode_with_offsets) takes the label of the token that completes that character: all 9 tokens of SmolLM2's
    "北京不是上海" are labelled, not just the 6 that complete one. A token that completes one character and starts the
    next ("ĠðŁ" of " 🍰": the space, then half the emoji) is scored by the one it completes."""
    good_iv, poor_iv, unmatched = locate_spans(text, good_spans, poor_spans)
    return _token_labels(text, offsets, good_iv, poor_iv), unmatched


def _token_labels(text: str, offsets: list[tuple[int, int]], good_iv, poor_iv) -> list[float]:
    """span_rewards' delta_t, from the located intervals: good ones reward +1, poor ones -1 (interval_rewards)."""
    return interval_rewards(text, offsets, [(a, b, 1.0) for a, b in good_iv] + [(a, b, -1.0) for a, b in poor_iv])


def interval_rewards(text: str, offsets: list[tuple[int, int]], spans) -> list[float]:
    """delta_t from located character intervals [start, end) of `text` that carry a real reward, (start, end, reward)
    or {"start", "end", "reward"} (a python: critic's, tasks/plugin.py), by span_rewards' rule: a token takes an
    interval's reward when the non-whitespace part of its own interval lies inside it; one straddling its edge does
    not (App. L). Overlap: the lowest reward wins (a poor span overrides a good one), and a token that straddles a
    negative interval's edge is never above 0. An empty interval labels nothing. span_rewards is the case +1 / -1."""
    spans = [(x["start"], x["end"], x["reward"]) if isinstance(x, dict) else tuple(x) for x in spans]
    spans = [(a, b, float(r)) for a, b, r in spans if a < b]
    delta = []
    for s, e in offsets:
        s, e = _core(text, s, e)
        if e <= s:
            delta.append(0.0)
            continue
        got = [r for a, b, r in spans if a <= s and e <= b]  # the intervals it lies inside
        got += [0.0 for a, b, r in spans if r < 0 and a < e and s < b and not (a <= s and e <= b)]  # straddles
        delta.append(min(got, default=0.0) + 0.0)  # + 0.0: no -0.0
    completing = (0.0, None)  # (label, start) of the next token with a non-empty interval
    for i in reversed(range(len(offsets))):
        s, e = offsets[i]
        if s < e:
            completing = (delta[i], s)
        elif completing[1] == s and s < len(text) and ord(text[s]) > 127:  # part of the multi-byte character at s
            delta[i] = completing[0]
    return delta


def span_tokens(text: str, offsets: list[tuple[int, int]], good_spans: list[str], poor_spans: list[str]):
    """span_rewards' (delta, unmatched), and (label, token indices) of each quote that locate_spans locates, good ones
    first: the tokens whose delta_t it sets (inside it, carrying its label; a byte token by where its character is),
    in order; each quote located once. What App. I's within-span weighting counts: two adjacent quotes are two spans,
    and a token of a quote that span_rewards leaves at 0 (it straddles a poor quote inside a good one) belongs to
    neither."""
    good_iv, poor_iv, unmatched = locate_spans(text, good_spans, poor_spans)
    delta = _token_labels(text, offsets, good_iv, poor_iv)
    cores = [(s, s + 1) if s == e else _core(text, s, e) for s, e in offsets]  # a byte token: its character's start
    return delta, unmatched, [(label, [t for t, (s, e) in enumerate(cores) if delta[t] == label and a <= s and e <= b])
                              for label, ivs in ((1.0, good_iv), (-1.0, poor_iv)) for a, b in ivs]


def unambiguous_quotes(text, good_iv, poor_iv, words):
    """Quote strings that locate_spans resolves to exactly the intended intervals, for a critic that knows the
    intervals it means (tasks/: the demo's and the code task's program critics). words: (word, start, end) of `text`.
    A quote that would land on an earlier occurrence is widened by a word, right first, until it is unique (or dropped
    if it cannot be)."""
    ivs = {"good": list(good_iv), "poor": list(poor_iv)}
    starts, ends = [s for _, s, _ in words], [e for _, _, e in words]
    for _ in range(8):
        quotes = {k: [text[a:b] for a, b in v] for k, v in ivs.items()}
        got_good, got_poor, _ = locate_spans(text, quotes["good"], quotes["poor"])
        wrong = [(k, i) for k, got in (("good", got_good), ("poor", got_poor))
                 for i, iv in enumerate(ivs[k]) if i >= len(got) or got[i] != iv]
        if not wrong:
            return quotes["good"], quotes["poor"]
        k, i = wrong[0]
        a, b = ivs[k][i]
        later, earlier = [e for e in ends if e > b], [s for s in starts if s < a]
        if later or earlier:
            ivs[k][i] = (a, later[0]) if later else (earlier[-1], b)
        else:
            del ivs[k][i]
    return [], []


# ======================================================================================================================
# End of the core. What the stages share follows.
# ======================================================================================================================

# ----------------------------------------------------------------------------------------------------------------------
# 4. Datasets and resumable outputs (01, 03, 04): records from files or the hub; append-only JSONL keyed by id
# ----------------------------------------------------------------------------------------------------------------------

DATA_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")  # read_rows reads these locally; else: a hub id


def read_rows(data: str, split: str = "test", required: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """[(where, record)] from a local .jsonl / .jsonl.gz / .json / .parquet file or, through `datasets`, a hub
    dataset id; each `required` field a string. `where` names the file and line (or record) for error messages; a
    failure is a one-line DataError. A .json may hold a list of records, the paper's {id: record}, or JSON Lines."""
    path = Path(data)
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return [(f"{path}:{n}", r) for n, r in iter_jsonl(path, required)]
    if path.name.endswith(DATA_FILE_SUFFIXES):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        rows = _read_json_or_parquet(path)
    else:
        try:
            from datasets import load_dataset
            rows = [(f"{data}[{split}] record {i}", dict(r)) for i, r in enumerate(load_dataset(data, split=split))]
        except Exception as e:  # noqa: BLE001 - offline, no such repo or split, gated: one line, not a traceback
            raise DataError(f"{data}[{split}]: cannot load it ({type(e).__name__}: {first_line(e)})") from None
    for where, row in rows:
        for f in required:
            if f not in row:
                raise DataError(f"{where}: missing field '{f}'")
            if not isinstance(row[f], str):
                raise DataError(f"{where}: field '{f}' must be a string")
    return rows


def _read_json_or_parquet(path: Path) -> list[tuple[str, dict]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return [(f"{path}: record {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines under a .json name
            return [(f"{path}:{n}", r) for n, r in iter_jsonl(path)]
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        data = [{"id": k, **v} for k, v in data.items()]  # {id: record}, as the paper's own files are laid out
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a list of JSON objects or an object of objects keyed by id")
    return [(f"{path}: record {i}", r) for i, r in enumerate(data)]


def open_resumable_jsonl(path) -> set[str]:
    """Prepare an append-only JSONL output for resuming; returns the ids it already holds.

    A torn last line (a crash mid-write) is cut off, so a rerun redoes that record instead of keeping half of it.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return set()
    done, good_bytes = set(), 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("torn line")
                rec = json.loads(raw)
                done.add(str(rec["id"]))
            except (ValueError, KeyError, TypeError):
                break  # everything from the first broken line on is redone
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return done


def append_jsonl(f, record: dict) -> None:
    """Append one record to an open text file and flush it, so a kill loses at most the line being written."""
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()


# ----------------------------------------------------------------------------------------------------------------------
# 5. Reward-model format and prompts, shared by training (02) and inference (03, 04) so the two never drift apart
# ----------------------------------------------------------------------------------------------------------------------

RM_INSTRUCTION = ("Critique the response, then give its good_spans and poor_spans as JSON, each quoted exactly from "
                  "the response.")
# The reward model's output format (02 --rm-format, reward_model.json "rm_format"): "critique+spans" is the paper's
# z = [c ; A(y)]; "spans-only" is its "w/o CoT" ablation (Table 2): the span JSON alone, no critique before it.
RM_FORMATS = ("critique+spans", "spans-only")
# What a stage-2 reward model was trained for (02 --objective, reward_model.json "objective"), and who can use it.
RM_OBJECTIVES = {"generative": "a generative one (02 without --objective: it writes critique + spans)",
                 "pairwise": "a scalar one trained on preference pairs (02 --objective pairwise)",
                 "prm": "a process reward model (02 --objective prm)"}
# How a process reward model cuts a response into steps (02 --step-unit, reward_model.json "step_unit"):
# baselines/scalar_rm.py's split_steps.
STEP_UNITS = ("clause", "block")
RM_INSTRUCTIONS = {"critique+spans": RM_INSTRUCTION,
                   "spans-only": "Give the good_spans and poor_spans of the response as JSON, each quoted exactly "
                                 "from the response."}


def rm_user_message(prompt: str, response: str, rm_format: str = "critique+spans") -> str:
    """The reward model's request as one user message (what an OpenAI-compatible server receives)."""
    return f"{RM_INSTRUCTIONS[rm_format]}\n\n### Prompt\n{prompt}\n\n### Response\n{response}"


def build_rm_prompt(tokenizer, prompt: str, response: str, rm_format: str = "critique+spans") -> str:
    """The reward model's input text: the tokenizer's chat template if it has one, else a plain documented fallback:
    the user message followed by a blank line and "### Critique". tokenizer=None gives the fallback."""
    message = rm_user_message(prompt, response, rm_format)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    return f"{message}\n\n### Critique\n"


def rm_prompt(tokenizer, prompt: str, response: str, max_tokens: int | None = None, rm_format: str = "critique+spans"):
    """The reward model's input, the same in 02 (training), 03 and 04 (critiquing): (ids, task prompt kept, status) of
    build_rm_prompt, the task prompt cut from its start when the whole would not fit in max_tokens (fit_prompt)."""
    return fit_prompt(tokenizer, lambda p: build_rm_prompt(tokenizer, p, response, rm_format), prompt, max_tokens)


def format_rm_target(critique: str, good_spans: list[str], poor_spans: list[str], rm_format: str = "critique+spans"
                     ) -> str:
    """The reward model's output z = [c ; A(y)]: the critique, a newline, then the span JSON (EOS is added later).
    rm_format "spans-only" (the paper's w/o-CoT ablation): the span JSON alone."""
    spans = json.dumps({"good_spans": list(good_spans), "poor_spans": list(poor_spans)}, ensure_ascii=False)
    return spans if rm_format == "spans-only" else f"{critique.strip()}\n{spans}"


RM_PROMPT_FORMAT = "common.build_rm_prompt(tokenizer, prompt, response, rm_format)"
RM_TARGET_FORMAT = "common.format_rm_target(critique, good_spans, poor_spans, rm_format) + EOS"


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
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    out = {"max_prompt_tokens": None, "max_new_tokens": None, "rm_format": "critique+spans",
           "prompt_format": RM_PROMPT_FORMAT, "target_format": RM_TARGET_FORMAT, "objective": "generative",
           "score_bias": 0.0, "norm_score_std": 1.0, "step_unit": None}
    if "max_len" in info.get("train", {}) and "max_new_tokens" not in info:  # written before these keys existed
        out["max_new_tokens"] = 128 if info.get("task") == "demo" else 512
        out["max_prompt_tokens"] = max(info["train"]["max_len"] - out["max_new_tokens"], 1)
    out.update({k: info[k] for k in out if k in info})
    if path is not None and not info and _is_sequence_classifier(Path(reward_model_dir)):
        out["objective"] = "pairwise"
    if out["rm_format"] not in RM_FORMATS:
        raise DataError(f"{path}: rm_format {out['rm_format']!r}: must be one of {', '.join(RM_FORMATS)}")
    if out["objective"] not in RM_OBJECTIVES:
        raise DataError(f"{path}: objective {out['objective']!r}: must be one of {', '.join(RM_OBJECTIVES)}")
    return out


def _is_sequence_classifier(model_dir: Path) -> bool:
    """True for a model directory (or LoRA adapter) with a sequence-classification head, read from its config files."""
    for name, test in (("adapter_config.json", lambda c: c.get("task_type") == "SEQ_CLS"),
                       ("config.json", lambda c: any(a.endswith("ForSequenceClassification")
                                                     for a in c.get("architectures") or []))):
        try:
            if test(json.loads((model_dir / name).read_text())):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def rm_completions_prompt(tokenizer, prompt: str, response: str, max_prompt_tokens: int | None = None,
                          rm_format: str = "critique+spans") -> str:
    """The text a served reward model gets on /v1/completions: rm_prompt's, as in training (tokenizer=None: the plain
    template). The server adds its BOS when it tokenizes, so a BOS the chat template wrote is left out: one, not two."""
    if tokenizer is None:
        return build_rm_prompt(None, prompt, response, rm_format)
    text = build_rm_prompt(tokenizer, rm_prompt(tokenizer, prompt, response, max_prompt_tokens, rm_format)[1], response,
                           rm_format)
    bos, adds_bos = tokenizer.bos_token, tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return text[len(bos):] if bos and adds_bos and text.startswith(bos) else text


# OpenAI-compatible servers (01's critic, 03's served critic, 04's judge): the server's own error text, one retry
# policy, and one cheap request before any work is spent.

PREFLIGHT = "Reply with OK."  # the one-token request check_server sends


def redact(text: str) -> str:
    """`text` without the API key: errors may echo request headers, and keys never reach logs or files."""
    key = os.environ.get("OPENAI_API_KEY", "")
    return text.replace(key, "[redacted]") if len(key) >= 4 else text


def api_error(e: Exception) -> str:
    """A failed request as one line, with the server's own words: "HTTP 400: Server is pinned to ...". The openai
    SDK's str(e) keeps only OpenAI's {"error": {"message"}} and drops every other layout (FastAPI's {"detail"},
    transformers serve's among them); the text is in e.body, else e.response.text. Timeouts and connection errors
    name themselves; notes added to the exception (send_with_retries: the attempts) follow after "; "."""
    import openai
    if isinstance(e, openai.APIStatusError):
        body = e.body if e.body is not None else e.response.text
        if isinstance(body, dict):
            body = next((body[k] for k in ("message", "detail", "error") if body.get(k)), body)
        text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, default=str)
        line = f"HTTP {e.status_code}: {' '.join(text.split()) or e.response.reason_phrase}"
    elif isinstance(e, openai.APITimeoutError):
        line = "timed out"
    elif isinstance(e, openai.APIConnectionError):
        line = f"cannot connect ({first_line(e.__cause__) if e.__cause__ else first_line(e)})"
    else:
        line = f"{type(e).__name__}: {first_line(e)}"
    return redact("; ".join([line[:500], *getattr(e, "__notes__", [])]))


def backoff_delay(attempt: int, retry_after: float | None, base: float, cap: float, rng) -> float:
    """Wait before retry number attempt+1: the server's Retry-After, at most `cap` (a server asking for an hour must
    not stall a worker an hour; send_with_retries says so in the error), +0-10% so workers do not return in
    lockstep; else exponential backoff with equal jitter, min(cap, base * 2^attempt) * U[0.5, 1]."""
    if retry_after is not None:
        return min(retry_after, cap) * (1 + 0.1 * rng.random())
    d = min(cap, base * 2 ** attempt)
    return d / 2 + rng.uniform(0, d / 2)


def retry_after_s(headers) -> float | None:
    """Seconds a 429/503 asks us to wait: Retry-After-Ms, Retry-After in seconds, or Retry-After as an HTTP date."""
    import email.utils
    import time
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return max(0.0, float(headers.get(name)) * scale)
        except (TypeError, ValueError):
            pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(headers.get("retry-after")).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def retry_delay(e: Exception, attempt: int, retries: int, rng, base: float = 1.0, cap: float = 60.0) -> float | None:
    """Seconds to wait before sending a failed request again, or None: give up. Retried up to `retries` times:
    408, 409, 429 and 5xx (after the server's Retry-After, else backoff_delay) and connection errors. Never another
    4xx (the same request fails the same way) and never a timeout: a server keeps generating a request whose client
    has gone (transformers serve does, measured), so a retry would queue the same work twice, exactly when the server
    is slowest. A timed-out request fails; 01 --retry-failed redoes it later."""
    import openai
    if attempt >= retries or isinstance(e, openai.APITimeoutError):
        return None
    if isinstance(e, openai.APIStatusError):
        if e.status_code not in (408, 409, 429) and e.status_code < 500:
            return None
        return backoff_delay(attempt, retry_after_s(getattr(e.response, "headers", None)), base, cap, rng)
    return backoff_delay(attempt, None, base, cap, rng) if isinstance(e, openai.APIConnectionError) else None


async def send_with_retries(send, retries: int, rng=None, base: float = 1.0, cap: float = 60.0):
    """await send() (one OpenAI-compatible request), sent again while retry_delay allows; the last error is raised
    with a note of the attempts it took, and of a Retry-After longer than `cap` that was cut to it (api_error shows
    them)."""
    import asyncio
    import random

    import openai
    attempt, capped = 0, None
    while True:
        try:
            return await send()
        except openai.APIError as e:
            wait = retry_delay(e, attempt, retries, rng or random, base, cap)
            asked = retry_after_s(getattr(getattr(e, "response", None), "headers", None))
            if wait is not None and asked is not None and asked > cap:
                capped = asked
            if wait is None:
                if capped is not None:
                    e.add_note(f"the server's Retry-After ({capped:g} s) was capped at {cap:g} s")
                if attempt:
                    e.add_note(f"gave up after {attempt + 1} attempts")
                elif isinstance(e, openai.APITimeoutError):
                    e.add_note("not retried: the server may still be generating it")
                raise
            await asyncio.sleep(wait)
            attempt += 1


def openai_client(base_url: str | None, timeout: float, flag: str = "--base-url"):
    """An AsyncOpenAI client for `base_url` (None: OpenAI), the key from OPENAI_API_KEY only (a local server needs
    none), its own retries off (send_with_retries is ours). DataError when OpenAI itself is meant and there is no
    key."""
    from openai import AsyncOpenAI
    key = os.environ.get("OPENAI_API_KEY")
    if not key and base_url is None:
        raise DataError(f"OPENAI_API_KEY is not set (the key is read from the environment only), and no {flag} "
                        "names another endpoint")
    return AsyncOpenAI(base_url=base_url, api_key=key or "EMPTY", timeout=timeout, max_retries=0)


def check_server(base_url: str | None, model: str, api: str = "chat", timeout: float = 120.0, retries: int = 2,
                 flag: str = "--base-url", params: dict | None = None) -> None:
    """One cheap request (PREFLIGHT) to the endpoint and model a stage is about to use, through the API it will use
    and with the parameters its own requests carry (`params`: temperature, max_tokens if it sends one; default
    greedy with a budget), before it spends any compute: an endpoint that refuses a parameter refuses it here. Only
    max_tokens' value differs: 1, to stay cheap. DataError, one line with the server's own words, for a wrong model
    name, a dead port, a 4xx (a missing or bad key: 401), or a timeout. 429 and 5xx are retried as any request
    (retry_delay)."""
    import asyncio

    params = {"temperature": 0.0, "max_tokens": 1} if params is None else dict(params)
    if "max_tokens" in params:
        params["max_tokens"] = 1

    async def ping():
        async with openai_client(base_url, timeout, flag) as client:
            if api == "completions":
                return await send_with_retries(lambda: client.completions.create(
                    model=model, prompt=PREFLIGHT, **params), retries)
            return await send_with_retries(lambda: client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PREFLIGHT}], **params), retries)
    import openai
    try:
        asyncio.run(ping())
    except openai.APIError as e:
        where = f"{flag} {base_url or 'https://api.openai.com/v1'} (model {model!r}, {api} API)"
        hint = " (OPENAI_API_KEY is not set)" if getattr(e, "status_code", None) == 401 and not os.environ.get(
            "OPENAI_API_KEY") else ""
        raise DataError(f"{where}: {api_error(e)}{hint}") from None


class NoChoices(Exception):
    """A 200 reply with an empty `choices` list (a server that filtered its output): no text to use."""

    def __init__(self):
        super().__init__("HTTP 200 with no choices: the server returned no completion")


def rm_critique_served(prompts: list[str], responses: list[str], base_url: str | None, model: str,
                       max_new_tokens: int, concurrency: int = 32, api: str = "chat", tokenizer=None,
                       max_prompt_tokens: int | None = None, rm_format: str = "critique+spans", timeout: float = 300.0,
                       retries: int = 2) -> list:
    """rm_critique for a reward model behind an OpenAI-compatible endpoint (vLLM, Ollama, OpenAI): greedy, the whole
    batch in flight at once (up to `concurrency`). api "chat" sends rm_user_message as one user message (the server
    applies the chat template); "completions" sends rm_completions_prompt, the exact training text. Given the reward
    model's tokenizer, both cut the task prompt to max_prompt_tokens as training did (rm_prompt, rm_settings); both ask
    for rm_format's output (its instruction). Each request times out after `timeout` s and is retried as retry_delay
    says. Each entry is the critic's text or, for a request that failed, its exception (openai.APIError; a reply
    without choices: NoChoices): one failed critique never stops the batch."""
    import asyncio

    import openai

    async def ask(client, sem, prompt, response):
        async with sem:
            try:
                if api == "completions":
                    reply = await send_with_retries(lambda: client.completions.create(
                        model=model, temperature=0.0, max_tokens=max_new_tokens,
                        prompt=rm_completions_prompt(tokenizer, prompt, response, max_prompt_tokens, rm_format)),
                        retries)
                    return (reply.choices[0].text or "") if reply.choices else NoChoices()
                if tokenizer is not None and max_prompt_tokens:  # the text the server's template makes, cut alike
                    prompt = rm_prompt(tokenizer, prompt, response, max_prompt_tokens, rm_format)[1]
                reply = await send_with_retries(lambda: client.chat.completions.create(
                    model=model, temperature=0.0, max_tokens=max_new_tokens,
                    messages=[{"role": "user", "content": rm_user_message(prompt, response, rm_format)}]), retries)
                return (reply.choices[0].message.content or "") if reply.choices else NoChoices()
            except openai.APIError as e:
                return e

    async def ask_all():
        sem = asyncio.Semaphore(concurrency)
        async with openai_client(base_url, timeout, "--critic-base-url") as client:
            return await asyncio.gather(*[ask(client, sem, p, r) for p, r in zip(prompts, responses)])
    return asyncio.run(ask_all())


# ----------------------------------------------------------------------------------------------------------------------
# 6. Models: loading (hub id, local dir, LoRA adapter dir), prompts, batched left-padded generation
# ----------------------------------------------------------------------------------------------------------------------

def first_line(e: Exception) -> str:
    """An exception as one line, for a DataError: its message's first line, else its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_model(name_or_path: str, device: str = "cpu", dtype: str = "float32", adapter: str | None = None,
               scalar_head: bool = False):
    """(model, tokenizer) in eval mode. A directory holding adapter_config.json loads its base model plus the adapter.
    scalar_head: a sequence-classification model with one output (a scalar reward model; baselines/scalar_rm.py's
    scalar_rm_scores reads it), whose config's pad id is the tokenizer's; else a causal LM.

    - Dropout is off in every module (disable_dropout; RLHF detail: dropout makes old and new log-probs disagree).
    - The hub's generation_config.json is dropped, all but its stop ids: every generate() here passes its complete
      settings (generation_config), so no repetition_penalty, no_repeat_ngram_size, min_p, ... of the hub changes what
      is sampled. Its EOS ids (a list for Llama-3.1: <|eot_id|>, <|end_of_text|>, ...) join the tokenizer's.
    - A tokenizer without a pad token gets a distinct one, never EOS, so padding can't be confused with a finished
      response.
    A directory or hub id that cannot be loaded (no weights, no such model) is a DataError naming it; so is a
    transformers older than 5.24 (check_transformers), whose models would ignore our decoding loops' KV cache.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

    check_transformers()
    check_model_path(name_or_path)
    path = Path(name_or_path)
    if adapter is None and (path / "adapter_config.json").is_file():
        adapter, name_or_path = str(path), json.loads((path / "adapter_config.json").read_text())[
            "base_model_name_or_path"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(adapter if adapter and Path(adapter, "tokenizer_config.json")
                                                  .is_file() else name_or_path)
        auto = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
        model = auto.from_pretrained(name_or_path, dtype=torch_dtype(dtype), **({"num_labels": 1} if scalar_head
                                                                                 else {}))
    except (OSError, ValueError) as e:
        raise DataError(f"{name_or_path}: cannot load the model: {first_line(e)}") from None
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        model.resize_token_embeddings(len(tokenizer))
    if scalar_head:  # (its pooling is not used: scalar_rm_scores reads the score at a given token, never a pad)
        model.config.pad_token_id = tokenizer.pad_token_id
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    hub_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # a scalar head: none
    stop += [i for i in ([hub_eos] if isinstance(hub_eos, int) else hub_eos or []) if i not in stop]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop,
                                               pad_token_id=tokenizer.pad_token_id)
    if adapter:
        from peft import PeftModel
        with peft_wraps_quietly():
            model = PeftModel.from_pretrained(model, adapter)
    disable_dropout(model)
    return model.to(device).eval(), tokenizer


def check_transformers() -> None:
    """DataError unless transformers >= 5.24 (requirements.txt): from 5.24 a model takes its KV cache as `cache`, which
    greedy_generate and static_decode pass; an older 5.x takes `past_key_values` and silently swallows `cache`, so
    every token after the first would be decoded without its history (found on a GPU image with 5.17)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 24):
        raise DataError(f"transformers {transformers.__version__} is installed; this code needs >= 5.24 (a model "
                        f"takes its KV cache as `cache`): pip install 'transformers>=5.24,<6'")


def looks_local(path: str) -> bool:
    """True when `path` names a local directory rather than a hub id ("org/name"): absolute, starting with '.', more
    than two parts, or under a directory that exists here. A missing local path is reported without asking the hub."""
    p = Path(path)
    return (p.exists() or p.is_absolute() or path.startswith(".") or len(p.parts) > 2
            or (bool(p.parts) and Path(p.parts[0]).is_dir()))


def check_model_path(path: str | None, flag: str = "") -> None:
    """DataError at once where `path` looks local (looks_local) and is not there: a typo'd folder (runs/smolm2) is
    never sent to the hub as a model id, where it costs ten retries and ends in an error that does not say the folder
    is missing. `flag` ("--model ") prefixes the message, as the user typed it."""
    if path and looks_local(path) and not Path(path).exists():
        raise DataError(f"{flag}{path}: no such directory")


def check_reward_model(path: str, flag: str = "--reward-model ", objective: str = "generative",
                       use: str = "a critic that writes critiques (03 --critic local or openai, 04 --reward-model)"
                       ) -> None:
    """Fail fast, before any training: DataError (one line) unless load_model could load the reward model at `path`
    and stage 2 trained it for `objective` (its reward_model.json; RM_OBJECTIVES): a scalar reward model where
    critiques are needed, or the reverse, is refused, naming `use`. Checks, without loading weights: the directory
    exists; an adapter's base model is there when it is a local path (a hub id is left to load_model); the tokenizer
    loads. `flag` prefixes the message, as the user typed it."""
    from transformers import AutoTokenizer
    rm = Path(path or "")
    if not path or not rm.is_dir():
        raise DataError(f"{flag}{path or '(not given)'}: no such directory (run 02_train_reward.py first)")
    have = rm_settings(path)["objective"]
    if not (rm / "reward_model.json").is_file() and have != "pairwise":  # 02 writes it into the folder it renames
        raise DataError(f"{flag}{path}: no reward_model.json (not a stage-2 output; run 02_train_reward.py)")  # last
    if have != objective:  # (a plain sequence classifier, e.g. TRL's RewardTrainer output, is a pairwise one as it is)
        raise DataError(f"{flag}{path}: {RM_OBJECTIVES[have]}; {use} needs {RM_OBJECTIVES[objective]}")
    tokenizer_dir = path
    if (rm / "adapter_config.json").is_file():  # a LoRA adapter: load_model loads the base it names, then the adapter
        base = json.loads((rm / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        if not base or (looks_local(base) and not Path(base).is_dir()):
            raise DataError(f"{flag}{path}: its base model {base!r} (reward_model.json, adapter_config.json) is not "
                            f"there; put it back at that path, or train the reward model again")
        if not (rm / "tokenizer_config.json").is_file():
            tokenizer_dir = base
    try:
        AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # noqa: BLE001 -- whatever the tokenizer files hold, the user needs one line
        raise DataError(f"{flag}{path}: cannot load its tokenizer: {first_line(e)}") from None


def disable_dropout(model) -> None:
    """Dropout off for real, after the model is built: p = 0 in every dropout module, and 0.0 in every float attribute
    named like a dropout rate, which attention modules copy from the config when they are built (Llama, Qwen and
    Mistral's `attention_dropout`, OPT's `dropout`): editing the config afterwards reaches neither."""
    import torch
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):  # and in the config, so a copy made from it (deepcopy, save and reload) agrees
            setattr(config, key, 0.0)


def stop_ids(model) -> list[int]:
    """Every id that ends a response: the EOS ids load_model collected (tokenizer's first)."""
    ids = model.generation_config.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [])


def generation_config(model, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                      min_new_tokens: int = 0):
    """The complete settings of a generate() call, built here rather than inherited: sampling at `temperature` with
    top_k = 0 (transformers' default top-k of 50 would be a hidden truncation) and `top_p`, or greedy when temperature
    is 0; the new-token limits; every stop id; the pad id. Everything else keeps transformers' neutral defaults,
    because load_model leaves nothing else in model.generation_config for generate() to merge in."""
    from transformers import GenerationConfig
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p) if temperature > 0 else \
        dict(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, eos_token_id=stop_ids(model),
                            pad_token_id=model.generation_config.pad_token_id,
                            bos_token_id=model.generation_config.bos_token_id, **sample)


def apply_template(tokenizer, prompt: str, chat_template: str = "auto") -> str:
    """The prompt as the policy sees it: wrapped in the tokenizer's chat template as one user turn ("on"; "auto": if
    it has one), or as is ("off"). "on" with a tokenizer that has no template is a DataError."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has:
        raise DataError(f"--chat-template on: the tokenizer of {tokenizer.name_or_path} has no chat template")
    if chat_template == "off" or not has:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def fit_prompt(tokenizer, build, prompt: str, max_tokens: int | None):
    """(ids, task prompt kept, status) of the text build(prompt), with the task prompt cut from its start until the
    ids fit in max_tokens: what build() puts around it (a chat template, an instruction, the response a reward model
    critiques) is never cut. status is "ok", "truncated", or "too_long" when even an empty task prompt does not fit."""
    ids, kept = encode_prompt(tokenizer, build(prompt)), prompt
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, kept, "ok"
    task, cut = tokenizer(prompt, add_special_tokens=False)["input_ids"], 0
    while len(ids) > max_tokens and cut < len(task):  # a re-tokenized tail can differ by a token or two: re-check
        cut = min(cut + len(ids) - max_tokens, len(task))
        kept = tokenizer.decode(task[cut:]).lstrip("\ufffd")
        ids = encode_prompt(tokenizer, build(kept))
    return ids, kept, "truncated" if len(ids) <= max_tokens else "too_long"


def policy_prompt(tokenizer, prompt: str, chat_template: str = "auto", max_tokens: int | None = None) -> list[int]:
    """The policy's input ids, the same in 03 (rollouts, SFT) and 04: the prompt in the chat template (apply_template),
    cut from its start to fit max_tokens (fit_prompt)."""
    return fit_prompt(tokenizer, lambda p: apply_template(tokenizer, p, chat_template), prompt, max_tokens)[0]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt; no second BOS when a chat template already put one in the text."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def left_pad(seqs: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) as (B, T) tensors, padded on the left so every row ends where generation starts."""
    import torch
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def generate(model, tokenizer, prompts: list, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, batch_size: int = 32, desc: str | None = None) -> list[list[int]]:
    """Response token ids for each prompt (a text, or its token ids), cut before the first stop id. Greedy when
    temperature == 0. The settings are generation_config's, complete: nothing comes from the hub."""
    import torch
    from tqdm.auto import tqdm

    device, out, stop = next(model.parameters()).device, [], set(stop_ids(model))
    config = generation_config(model, max_new_tokens, temperature, top_p)
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=desc is None, leave=False):
        ids, mask = left_pad([p if isinstance(p, list) else encode_prompt(tokenizer, p)
                              for p in prompts[i:i + batch_size]], tokenizer.pad_token_id)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for row in seqs[:, ids.shape[1]:].tolist():
            cut = next((k for k, t in enumerate(row) if t in stop), len(row))
            out.append(row[:cut])
    return out


def rm_critique(model, tokenizer, prompts: list[str], responses: list[str], max_new_tokens: int = 128,
                batch_size: int = 32, desc: str | None = None, max_prompt_tokens: int | None = None,
                rm_format: str = "critique+spans", compile: bool = False) -> list[str]:
    """The local reward model's raw critic output for each (prompt, response): batched greedy generation on rm_prompt
    (the task prompt cut from its start to fit max_prompt_tokens, as in training), in which a row stops as soon as
    its span JSON is complete (greedy_generate). The text is what plain greedy decoding up to a stop id gives whenever
    the model ends its output with that JSON, as it is trained to (format_rm_target, in its rm_format)."""
    inputs = [rm_prompt(tokenizer, p, r, max_prompt_tokens, rm_format)[0] for p, r in zip(prompts, responses)]
    ids = greedy_generate(model, tokenizer, inputs, max_new_tokens, batch_size=batch_size, desc=desc,
                          stop=feedback_complete, compile=compile)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def feedback_complete(text: str) -> bool:
    """True when `text` ends (but for whitespace) with a JSON object holding both span lists: the last part of the
    reward model's output z = [c ; A(y)] (format_rm_target), after which only its EOS can follow."""
    end = len(text.rstrip())
    if not text[:end].endswith("}"):
        return False
    start = text.rfind("{", 0, end)
    while start >= 0:  # the '{' that the final '}' closes (string-aware), then: is it the span JSON?
        if _balanced_end(text, start) == end:
            obj, _ = _decode_object(text, start)
            keys = {_norm_key(k) for k in obj} if isinstance(obj, dict) else set()
            return bool(keys & _GOOD_KEYS and keys & _POOR_KEYS)
        start = text.rfind("{", 0, start)
    return False


@functools.lru_cache(maxsize=8)
def _ids_with(tokenizer, char: str) -> frozenset:
    """Ids of the vocabulary entries whose text contains `char` (byte-level BPE keeps ASCII as is)."""
    return frozenset(i for piece, i in tokenizer.get_vocab().items() if char in piece)


def _text_stop(tokenizer, stop, closers):
    """finished() for static_decode: the rows whose new token holds a closer ('}') and whose text so far satisfies
    stop(text) (greedy_generate's check, on the same ids)."""
    import torch

    def finished(history, token):                          # history: the (B,) ids of every step so far, token: last
        rows = [r for r, t in enumerate(token.tolist()) if t in closers]
        done = torch.zeros(token.shape, dtype=torch.bool, device=token.device)
        if rows:
            so_far = torch.stack(history, 1)[rows].tolist()
            done[rows] = torch.tensor([stop(tokenizer.decode(ids, skip_special_tokens=True)) for ids in so_far],
                                      device=token.device)
        return done
    return finished


def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32,
                    desc: str | None = None, stop=None, compile: bool = False) -> list[list[int]]:
    """Greedy response ids for each prompt, cut before EOS: batched, left-padded, with a KV cache.

    The same tokens as `generate(..., temperature=0)` (model.generate greedy, nothing from the model's
    generation_config), with two savings: a row leaves the batch, and its KV cache, as soon as it ends, so the rows
    still running no longer pay for it; and with `stop(text) -> bool` a row also ends when its decoded text satisfies
    it (checked only after a token holding '}', the one stop condition in use: feedback_complete).
    compile: static_decode instead (a static KV cache, the step under torch.compile), the same tokens; there a row
    that has ended stays in the batch, masked (the compiled step keeps one shape).
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    device, out = next(model.parameters()).device, []
    eos, pad = set(stop_ids(model)), tokenizer.pad_token_id
    closers = _ids_with(tokenizer, "}") if stop is not None else frozenset()
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=desc is None, leave=False):
        ids, mask = left_pad([p if isinstance(p, list) else encode_prompt(tokenizer, p)
                              for p in prompts[i:i + batch_size]], pad)
        ids, mask = ids.to(device), mask.to(device)
        if compile:
            new = static_decode(model, ids, mask, max_new_tokens, lambda logits, t: logits.argmax(-1), list(eos), pad,
                                finished=_text_stop(tokenizer, stop, closers) if stop is not None else None)
            out += [[t for t in row if t != pad and t not in eos] for row in new.tolist()]
            continue
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        rows = list(range(len(ids)))  # chunk rows still running, in batch order
        new = [[] for _ in rows]
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache,
                               use_cache=True, logits_to_keep=1).logits[:, -1]
            next_ids = logits.float().argmax(-1)
            running = []
            for j, (row, token) in enumerate(zip(rows, next_ids.tolist())):
                if token in eos:
                    continue
                new[row].append(token)
                if token in closers and stop(tokenizer.decode(new[row], skip_special_tokens=True)):
                    continue
                running.append(j)
            if not running:
                break
            if len(running) < len(rows):  # finished rows leave the batch and the cache
                keep = torch.tensor(running, device=device)
                cache.batch_select_indices(keep)
                rows, next_ids, mask, position = [rows[j] for j in running], next_ids[keep], mask[keep], position[keep]
            ids = next_ids[:, None]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
            position = position[:, -1:] + 1
        out += [[t for t in row if t != pad] for row in new]
    return out


def prompt_bucket(width: int) -> int:
    """The prompt width a static KV cache is built for: `width` rounded up to 16, 24, 32, 48, 64, 96, ... (powers of
    two and their halfway points: at most a third of the width is padding). The compiled decode step is specialised
    to its shapes, so a run compiles it for a few widths, not for every batch."""
    bucket = 16
    while bucket < width:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


def decode_forward(model, ids, mask, position, cache):
    """Logits (B, V) of the token after the last of `ids` (B, n), whose keys and values join `cache` (a StaticCache);
    mask (B, L) marks the cache slots that hold a token (L = its length), position (B, n) their positions."""
    return model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                 logits_to_keep=1).logits[:, -1]


@functools.cache
def _compiled_decode_forward(device_type: str):
    """decode_forward under torch.compile (inductor): built once per device type, specialised to each shape it meets
    (dynamic=False), fullgraph (a part that cannot be compiled is an error, not a silent fall back to eager). On CUDA
    in mode reduce-overhead, as transformers' own compiled generate(): the step is replayed as one CUDA graph, so
    its few hundred kernel launches cost one (the static cache's tensors keep their addresses for it)."""
    import torch
    # one compiled entry per model class x batch x cache length: torch's default limit of 8 would make a long
    # run (policy and critic, a few buckets each) quietly fall back to eager for the shapes after the eighth
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(decode_forward, fullgraph=True, dynamic=False,
                         mode="reduce-overhead" if device_type == "cuda" else None)


_STATIC_CACHES = weakref.WeakKeyDictionary()  # model -> (shape key, its StaticCache): the last one static_decode used


def static_cache(model, batch: int, length: int, device):
    """An empty StaticCache of `length` slots for `batch` rows: the model's last one when its shape and dtype fit (its
    tensors keep their addresses, on which a CUDA graph of the compiled step replays), else a new one that replaces
    it (one per model: an 8B model's cache can take gigabytes)."""
    import torch
    from transformers import StaticCache
    key = (batch, length, str(device), next(model.parameters()).dtype,
           torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type))
    kept = _STATIC_CACHES.get(model)
    if kept is not None and kept[0] == key:
        kept[1].reset()
        return kept[1]
    cache = StaticCache(config=model.config, max_cache_len=length)
    _STATIC_CACHES[model] = (key, cache)
    return cache


@contextmanager
def input_grad_hooks_off(model):
    """Activation checkpointing's forward hook on the embeddings (transformers' enable_input_require_grads: it calls
    output.requires_grad_(True)) removed while the block runs, then put back: decoding needs no gradients, and torch
    2.11's compiler cannot trace that call (the compiled decode step of a checkpointed policy failed on a GPU)."""
    owners = [m for m in model.modules() if vars(m).get("_require_grads_hooks")]
    for m in owners:
        m.disable_input_require_grads()
    try:
        yield
    finally:
        for m in owners:
            m.enable_input_require_grads()


def static_decode(model, ids, mask, max_new_tokens: int, pick, stop_ids: list[int], pad_id: int, compile: bool = True,
                  finished=None):
    """generate()'s decoding loop without generate(): a static KV cache, and the one-token step compiled.

    The prompts ids, mask (B, P) (left-padded) are padded further on the left to prompt_bucket(P) and go through one
    eager forward (the prefill); then every new token through decode_forward, compiled when `compile`. A static cache
    (StaticCache: one preallocated tensor per layer, written in place) keeps every step's shapes the same, so the
    compiled step is reused for the whole run; what it removes is eager transformers' per-call overhead (most of a
    small model's step on a CPU, and of a large one's on a GPU, where one step reads the weights in milliseconds).
    pick(logits (B, V) float32, t) -> ids (B,) chooses token t of every row (sampler, or argmax). A row ends at its
    first id in stop_ids, or where finished(the (B,) ids of steps 0..t, those of step t) -> (B,) bool says so; it gets
    pad_id from then on, and the loop ends when every row has ended or after max_new_tokens. Returns the new ids
    (B, steps): generate()'s sequences after the prompt, for the same pick.
    """
    import torch
    import torch.nn.functional as F

    extra = prompt_bucket(ids.shape[1]) - ids.shape[1]
    ids, mask = F.pad(ids, (extra, 0), value=pad_id), F.pad(mask, (extra, 0))               # (B, P'), P' a bucket
    slots = F.pad(mask, (0, max_new_tokens))                     # (B, P' + N): 1 where a cache slot holds a token
    position = (mask.cumsum(-1) - 1).clamp(min=0)                # left padding: positions start at the first token
    cache = static_cache(model, len(ids), slots.shape[1], ids.device)
    stop = torch.tensor(stop_ids, device=ids.device)
    step = _compiled_decode_forward(ids.device.type) if compile else decode_forward
    done, new = torch.zeros(len(ids), dtype=torch.bool, device=ids.device), []
    with torch.no_grad(), input_grad_hooks_off(model):
        logits = decode_forward(model, ids, slots, position, cache)      # prefill: eager (its shape changes)
        position = position[:, -1:]
        for t in range(max_new_tokens):
            token = pick(logits.float(), t).masked_fill(done, pad_id)                                        # (B,)
            new.append(token)
            done |= torch.isin(token, stop) | (finished(new, token) if finished is not None else False)
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            slots[:, ids.shape[1] + t] = 1
            position = position + 1
            logits = step(model, token[:, None], slots, position, cache)
    return torch.stack(new, 1)


def sampler(config):
    """pick() for static_decode that chooses as generate() does for the GenerationConfig `config` (one of
    generation_config's): the stop ids barred for the first min_new_tokens tokens, then greedy, or logits / T, the
    top-p cut (transformers' own TopPLogitsWarper) and one torch.multinomial draw per step over the whole batch,
    finished rows included, so the random stream is consumed exactly as generate() consumes it."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    known = {"max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "pad_token_id", "bos_token_id",
             "eos_token_id", "transformers_version"}
    unsupported = {k: v for k, v in config.to_diff_dict().items() if k not in known | {"top_k"}}
    if config.do_sample and config.top_k:  # GenerationConfig's default top_k is 50: generate() would cut to it
        unsupported["top_k"] = config.top_k
    if unsupported:  # a logits processor that generate() would apply and pick() does not
        raise ValueError(f"static decoding implements generation_config's settings only, not {unsupported}")
    stop = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]

    def pick(logits, t):                                                                      # (B, V) -> (B,)
        if t < (config.min_new_tokens or 0):  # MinNewTokensLengthLogitsProcessor
            logits = logits.index_fill(1, torch.tensor(stop, device=logits.device), -float("inf"))
        if not config.do_sample:
            return logits.argmax(-1)
        if config.temperature != 1.0:
            logits = TemperatureLogitsWarper(config.temperature)(None, logits)
        if config.top_p < 1.0:
            logits = TopPLogitsWarper(config.top_p)(None, logits)
        return torch.multinomial(logits.softmax(-1), num_samples=1).squeeze(1)
    return pick


def generate_static(model, ids, mask, config, compile: bool = True):
    """model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, P:] (the new ids, (B, steps)),
    token for token and drawing the same random numbers, by static_decode: a static KV cache and, when `compile`, the
    decode step under torch.compile. config: one of generation_config's (sampling at T with top_k = 0 and top_p, or
    greedy; min/max new tokens; stop ids; pad id)."""
    stop = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return static_decode(model, ids, mask, config.max_new_tokens, sampler(config), stop, config.pad_token_id, compile)


# ----------------------------------------------------------------------------------------------------------------------
# 7. Training pieces (02, 03, the demo's base model): dtypes, LoRA, atomic saves
# ----------------------------------------------------------------------------------------------------------------------

def torch_dtype(name: str):
    """torch.float32 / bfloat16 / float16 from "float32", "bf16" (or "bfloat16"), "fp16" (or "float16")."""
    import torch
    return {"float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16}[name]


def add_lora(model, r: int, alpha: int, targets: str = "all-linear", dropout: float = 0.0, modules_to_save: str = "",
             task_type: str = "CAUSAL_LM"):
    """The model with a trainable LoRA adapter (peft): `targets` is "all-linear" or comma-separated module names,
    `modules_to_save` comma-separated modules trained in full and saved with the adapter. task_type "SEQ_CLS" (a
    scalar reward model): peft trains and saves the score head in full too."""
    from peft import LoraConfig, get_peft_model
    with peft_wraps_quietly():
        return get_peft_model(model, LoraConfig(
            r=r, lora_alpha=alpha, lora_dropout=dropout, task_type=task_type,
            target_modules=targets if targets == "all-linear" else targets.split(","),
            modules_to_save=[m for m in modules_to_save.split(",") if m] or None))


@contextmanager
def peft_wraps_quietly():
    """peft (0.21) asks each model it wraps for `is_gradient_checkpointing`, which transformers 5.24 deprecated for
    `is_activation_checkpointing`: a FutureWarning at every adapter added or loaded, about a line we cannot change.
    That one warning is silenced while peft wraps a model (stages 2-4 enable checkpointing by the new names)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def share_files(folder) -> None:
    """Give a saved model folder and its files the permissions the umask gives any new file (0644 and 0755 under
    umask 022): mkdtemp makes 0700 folders and safetensors writes its weights 0600, which a server run as another user
    (or in a container) cannot read."""
    folder = Path(folder)
    os.chmod(folder, 0o777 & ~_UMASK)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~_UMASK)


SAVE_RECORD = "saved_files.json"  # in a folder save_pretrained wrote: the names it owns there
# What a model folder saved before SAVE_RECORD existed holds (transformers', peft's and our own files): such a folder
# counts as a save's own only where it also holds the save's marker file (foreign_files)
_MODEL_FILE = re.compile(r"(config|generation_config|adapter_config|tokenizer(_config)?|special_tokens_map|"
                         r"added_tokens|chat_template|vocab|reward_model|sft)\.json|.*\.safetensors(\.index\.json)?|"
                         r"tokenizer\.model|merges\.txt|chat_template\.jinja|value_head\.pt|README\.md")


def foreign_files(folder, owns=(), marker: str = "config.json") -> list[str]:
    """The entries of `folder` that a save into it did not write, and so must never replace or delete: all but those
    its previous save recorded (SAVE_RECORD) and `owns` (what the caller writes there itself: eval.json,
    checkpoints/). A folder saved before saves kept a record counts as one when it holds `marker`, the file that
    this kind of save writes (reward_model.json, sft.json): its model files (_MODEL_FILE) are then its own."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names, record = sorted(p.name for p in folder.iterdir()), folder / SAVE_RECORD
    if record.is_file():
        owned = {SAVE_RECORD, *json.loads(record.read_text())["files"]}
    else:
        owned = {n for n in names if _MODEL_FILE.fullmatch(n)} if (folder / marker).is_file() else set()
    return [n for n in names if n not in owned and n not in owns]


def check_save_dir(folder, owns=(), marker: str = "config.json", flag: str = "") -> None:
    """DataError, one line, when a save into `folder` would replace files it did not write (foreign_files): called
    by save_pretrained, and by a stage before it trains anything. `flag` prefixes the message, as the user typed."""
    foreign = foreign_files(folder, owns, marker)
    if foreign:
        listed = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise DataError(f"{flag}{folder}: holds files that a save there did not write ({listed}); a save replaces "
                        "only its own files: name another folder")


def save_pretrained(out_dir, model, tokenizer, files: dict | None = None, keep: tuple[str, ...] = (),
                    owns: tuple[str, ...] = (), **kwargs) -> Path:
    """model.save_pretrained(**kwargs), the tokenizer and `files` ({name: a state dict, torch.save; or for a .json
    name, a dict}) into a temp dir that then replaces out_dir, whose entries named in `keep` it takes over: a reader
    finds the old folder whole or the new one whole (for an instant, none), never half a model. Only a save's own
    files are replaced: out_dir holding anything else (check_save_dir; marker: the first of `files`, else the model's
    config or adapter config) is refused,
    before anything is written. SAVE_RECORD lists what it owns: what it wrote, `keep`, and `owns` (files the caller
    writes there afterwards, e.g. eval.json: the next save drops them with the old model)."""
    import shutil

    import torch
    out_dir = Path(out_dir)
    marker = next(iter(files or {}), "adapter_config.json" if hasattr(model, "peft_config") else "config.json")
    check_save_dir(out_dir, (*keep, *owns), marker)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
        for name, obj in (files or {}).items():
            if name.endswith(".json"):
                write_json(tmp / name, obj)
            else:
                torch.save(obj, tmp / name)
        write_json(tmp / SAVE_RECORD, {"files": sorted({*(p.name for p in tmp.iterdir()), *keep, *owns})})
        share_files(tmp)  # mkdtemp makes 0700 dirs, safetensors 0600 weights: the usual permissions
    except BaseException:
        shutil.rmtree(tmp)
        raise
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)  # two renames: a directory cannot replace a non-empty one in one
    os.replace(tmp, out_dir)
    for name in keep:
        if (old / name).exists():
            os.replace(old / name, out_dir / name)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def start_kind(out_dir, resume: bool, overwrite: bool, held: list[str], checkpoint: str, resumable: bool,
               replaceable: bool = False) -> str:
    """How a training run starts in out_dir (02, 03), decided before anything is trained: "resume" (--resume, and
    `resumable`: its `checkpoint` is there), "fresh" (`held`, the names of a run's files there, is empty) or "replace"
    (a run there, which --overwrite gives up, or `replaceable`: the zero-flag demo rerun in its own folder). Anything
    else is refused (DataError): a run is never lost to a start that did not ask for it."""
    if resume and resumable:
        return "resume"
    if not held:
        return "fresh"
    if overwrite or replaceable:
        return "replace"
    if resume:
        raise DataError(f"--resume: no {checkpoint} in {out_dir}, which holds a run ({', '.join(held)}): "
                        "--overwrite replaces it")
    raise DataError(f"{out_dir} holds a run ({', '.join(held)}): --resume continues it from its checkpoint, "
                    "--overwrite replaces it")


# ----------------------------------------------------------------------------------------------------------------------
# 8. Reward-model metrics (02 evaluates it, 04 scores each critique): span recovery, as stage 3 scores it
# ----------------------------------------------------------------------------------------------------------------------

def rm_scores(response: str, offsets, raw: str) -> tuple[dict, list[float], dict]:
    """A reward model's raw critique of one response, scored on its tokens as stage 3 scores it: (feedback, delta,
    04's per-sample (numerator, denominator) rows). A critique that does not parse keeps its text and quotes nothing."""
    try:
        fb, parsed = parse_feedback(raw), 1.0
    except ValueError:
        fb, parsed = {"critique": raw.strip(), "good_spans": [], "poor_spans": []}, 0.0
    delta, unmatched = span_rewards(response, offsets, fb["good_spans"], fb["poor_spans"])
    n, quotes = len(offsets), sum(1 for s in fb["good_spans"] + fb["poor_spans"] if s.strip())
    return fb, delta, {"rm/delta_sum": (sum(delta), 1), "rm/delta_mean": (sum(delta), n),
                       "rm/poor_token_frac": (delta.count(-1.0), n), "rm/good_token_frac": (delta.count(1.0), n),
                       "rm/parse_rate": (parsed, 1), "rm/unmatched_span_rate": (len(unmatched), quotes)}


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
        gold, _ = span_rewards(text, offsets, item["good_spans"], item["poor_spans"])
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
        gold_iv = dict(zip(("good", "poor"), locate_spans(text, item["good_spans"], item["poor_spans"])))
        pred_iv = dict(zip(("good", "poor"), locate_spans(text, fb["good_spans"], fb["poor_spans"])))
        for k, s in spans.items():
            s["gold"] += len(gold_iv[k])
            s["pred"] += len(pred_iv[k])
            for a, b in pred_iv[k]:
                if (a, b) in gold_iv[k]:
                    s["exact"] += 1
                elif any(a < d and c < b for c, d in gold_iv[k]):
                    s["partial"] += 1
    n = len(items)
    metrics = {"n": n, "parse_rate": parsed / n if n else None, "quotes": quotes,
               "unmatched_span_rate": unmatched / quotes if quotes else None}
    for name, c in (("pos", 1.0), ("neg", -1.0)):
        t = tok[c]
        metrics.update(zip((f"{name}_precision", f"{name}_recall", f"{name}_f1"), _prf(t["tp"], t["pred"], t["gold"])))
        metrics.update({f"{name}_tokens_{k}": v for k, v in t.items()})
    metrics["spans"] = spans
    metrics["critique_words"] = sum(words) / len(words) if words else 0.0
    metrics["output_words"] = sum(len(o.split()) for o in outputs) / n if n else 0.0
    return metrics
