"""What the four Text2Grad stages share about the method itself, so that it cannot drift apart between them:
  1. Records                   DataError, iter_jsonl, read_jsonl, atomic_open, write_json(l), open_resumable_jsonl,
                               append_jsonl: one JSON object per line, an error naming the file and line; append-only
                               outputs keyed by id that a rerun resumes
  2. Feedback parsing          parse_feedback: critic text -> {"critique", "good_spans", "poor_spans"}
  3. Span <-> token alignment  find_span, locate_spans, decode_with_offsets, span_rewards (delta_t, paper Sec. 3.3),
                               interval_rewards, span_tokens
  4. The reward model's text   rm_user_message, build_rm_prompt, format_rm_target (z = [c ; A(y)], Sec. 3.4): what 02
                               trains on and 03 / 04 parse
No torch or transformers at module level: parsing and alignment work without them. Copy it as it is. The machinery a
run needs (loading models, decoding, servers, run folders) is in infra/, the tasks in tasks/, the baselines in
baselines/.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import tempfile
import unicodedata
from contextlib import contextmanager
from pathlib import Path

# ----------------------------------------------------------------------------------------------------------------------
# 1. Records (core): one JSON object per line; an error names the file and line
# ----------------------------------------------------------------------------------------------------------------------


class DataError(ValueError):
    """Bad user input. Its message is one line naming the file, line and field; scripts print it and exit 2."""


def first_line(e: Exception) -> str:
    """An exception as one line, for a DataError: its message's first line, else its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def iter_jsonl(path, required: tuple[str, ...] = ()):
    """(line number, record) per non-blank line of a JSONL file (.jsonl.gz too), each `required` field a string.
    Lines end at "\n" only: a lone "\r" is JSON whitespace, and counting it as a line break (text mode's universal
    newlines) would shift every later line number. Raises DataError('file:line: reason')."""
    import gzip

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:  # lines end at b"\n" only
        for lineno, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, lineno)
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


def decode_utf8(raw: bytes, path, lineno: int) -> str:
    """A line's bytes as text, a UTF-8 BOM that starts the file dropped (Windows editors write one); DataError naming
    the file, line and byte where they are not UTF-8."""
    try:
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:  # e.object: the bytes after the BOM, which e.start counts in
        column = len(e.object[: e.start].decode("utf-8", "replace")) + 1
        raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{e.object[e.start]:02x} at column {column})") from None


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
    return isinstance(value, str) and bool(
        _PLACEHOLDER.fullmatch(value.strip()) or critique and _DESCRIPTION.fullmatch(value.strip())
    )


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
            "only template placeholders ('...', [...]) where the spans belong: a format echoed, not filled in"
            if echoed
            else "no JSON object with good_spans or poor_spans in critic output"
            if any_obj
            else "no JSON object (with good_spans or poor_spans) found in critic output"
        )
    critique = chosen["critique"]
    if critique is None:  # prose before the JSON, minus an opening code fence
        critique = re.sub(r"```[\w-]*\s*$", "", text[:chosen_start]).strip()
    elif not isinstance(critique, str):
        critique = json.dumps(critique, ensure_ascii=False, default=str)
    return {"critique": critique.strip(), "good_spans": chosen["good_spans"], "poor_spans": chosen["poor_spans"]}


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


# ----------------------------------------------------------------------------------------------------------------------
# 3. Span <-> token alignment by character intervals (core; paper Sec. 3.3 and App. L)
# ----------------------------------------------------------------------------------------------------------------------

_CHAR_MAP = {
    "\u2018": "'",
    "\u2019": "'",
    "\u201a": "'",
    "\u201b": "'",
    "\u2032": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u201e": '"',
    "\u201f": '"',
    "\u2033": '"',
    "\u00ab": '"',
    "\u00bb": '"',
    "\u2010": "-",
    "\u2011": "-",
    "\u2012": "-",
    "\u2013": "-",
    "\u2014": "-",
    "\u2015": "-",
    "\u2212": "-",
}
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
    peels = (
        lambda x: x.strip(_WRAP_CHARS),
        lambda x: re.sub(r"^(?:\.\.\.|\u2026)\s*", "", x),
        lambda x: re.sub(r"\s*(?:\.\.\.|\u2026)$", "", x),
        lambda x: x.rstrip(".,;:!?").rstrip(),
    )
    for _ in range(3):  # peel one layer at a time, e.g.  "...the dog.",  ->  ...the dog.  ->  the dog.  ->  the dog
        for peel in peels:
            s = peel(s)
            yield s


def _is_word(ch: str) -> bool:
    """A character no word boundary can fall next to (a combining accent is part of its letter). Scripts written
    without spaces (CJK, Thai, Lao) have none."""
    return (ch.isalnum() or ch == "_" or ch >= "\u0300" and unicodedata.category(ch)[0] == "M") and not (
        "\u2e80" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" or "\u0e00" <= ch <= "\u0eff"
    )


def _find_bounded(text: str, span: str, start: int) -> int:
    """text.find(span, start), skipping matches that begin or end inside a word ("he" is not in "the"), or before an
    accent that belongs to the letter in front of it ("cafe" is not in NFD "cafe\u0301")."""
    i, n = text.find(span, start), len(span)
    mark = lambda k: k < len(text) and unicodedata.category(text[k])[0] == "M"  # noqa: E731
    while i >= 0 and (
        (i > 0 and (_is_word(text[i]) and _is_word(text[i - 1]) or mark(i)))
        or (i + n < len(text) and (_is_word(text[i + n - 1]) and _is_word(text[i + n]) or mark(i + n)))
    ):
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
        while k >= 0 and (
            k > 0
            and src[k - 1] == src[k]
            or k + len(variant) < len(src)
            and src[k + len(variant)] == src[k + len(variant) - 1]
        ):  # half of a source character: no
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
    in_run = [
        i > 0 and all(isinstance(p, str) and _BYTE_PIECE.fullmatch(p) for p in pieces[i - 1 : i + 1]) for i in range(n)
    ]
    edge = list(range(n + 1))  # edge[j]: where a window meant to start at token j starts (its byte run's first token)
    for j in range(1, n):
        edge[j] = edge[j - 1] if in_run[j] else j
    # token i's window starts a block before its own block of w tokens, so the window's left edge, where a decode can
    # differ from the decode in context (a stripped leading space, half a character), is the same in both strings
    # compared: the window up to token i, and up to token i - 1 (the previous window, or one extra per block)
    windows = [token_ids[edge[max(0, (i // w - 1) * w)] : i + 1] for i in range(n)]
    windows += [token_ids[edge[max(0, b - w)] : b] for b in range(0, n, w)]
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
            agree = kept + (
                len(added)
                if text.startswith(added, kept)
                else len(os.path.commonprefix([added, text[kept : kept + len(added)]]))
            )
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
    or {"start", "end", "reward"} (a python: critic's, critics/plugin.py), by span_rewards' rule: a token takes an
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
    return (
        delta,
        unmatched,
        [
            (label, [t for t, (s, e) in enumerate(cores) if delta[t] == label and a <= s and e <= b])
            for label, ivs in ((1.0, good_iv), (-1.0, poor_iv))
            for a, b in ivs
        ],
    )


# ----------------------------------------------------------------------------------------------------------------------
# 4. The reward model's text, shared by training (02) and inference (03, 04) so the two never drift apart
# ----------------------------------------------------------------------------------------------------------------------

RM_INSTRUCTION = (
    "Critique the response, then give its good_spans and poor_spans as JSON, each quoted exactly from the response."
)
# The reward model's output format (02 --rm-format, reward_model.json "rm_format"): "critique+spans" is the paper's
# z = [c ; A(y)]; "spans-only" is its "w/o CoT" ablation (Table 2): the span JSON alone, no critique before it.
RM_FORMATS = ("critique+spans", "spans-only")
# What a stage-2 reward model was trained for (02 --objective, reward_model.json "objective"), and who can use it.
RM_OBJECTIVES = {
    "generative": "a generative one (02 without --objective: it writes critique + spans)",
    "pairwise": "a scalar one trained on preference pairs (02 --objective pairwise)",
    "prm": "a process reward model (02 --objective prm)",
}
# How a process reward model cuts a response into steps (02 --step-unit, reward_model.json "step_unit"):
# baselines/scalar_rm.py's split_steps.
STEP_UNITS = ("clause", "block")
RM_INSTRUCTIONS = {
    "critique+spans": RM_INSTRUCTION,
    "spans-only": "Give the good_spans and poor_spans of the response as JSON, each quoted exactly from the response.",
}


def rm_user_message(prompt: str, response: str, rm_format: str = "critique+spans") -> str:
    """The reward model's request as one user message (what an OpenAI-compatible server receives)."""
    return f"{RM_INSTRUCTIONS[rm_format]}\n\n### Prompt\n{prompt}\n\n### Response\n{response}"


def build_rm_prompt(tokenizer, prompt: str, response: str, rm_format: str = "critique+spans") -> str:
    """The reward model's input text: the tokenizer's chat template if it has one, else a plain documented fallback:
    the user message followed by a blank line and "### Critique". tokenizer=None gives the fallback."""
    message = rm_user_message(prompt, response, rm_format)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    return f"{message}\n\n### Critique\n"


def format_rm_target(
    critique: str, good_spans: list[str], poor_spans: list[str], rm_format: str = "critique+spans", ambiguous_spans=()
) -> str:
    """The reward model's output z = [c ; A(y)]: the critique, a newline, then the span JSON (EOS is added later).
    rm_format "spans-only" (the paper's w/o-CoT ablation): the span JSON alone. A program critic's ambiguous_spans
    (format_rm_target(**critic(...))) are no part of it: the reward model learns to quote what can be located."""
    spans = json.dumps({"good_spans": list(good_spans), "poor_spans": list(poor_spans)}, ensure_ascii=False)
    return spans if rm_format == "spans-only" else f"{critique.strip()}\n{spans}"


RM_PROMPT_FORMAT = "common.build_rm_prompt(tokenizer, prompt, response, rm_format)"
RM_TARGET_FORMAT = "common.format_rm_target(critique, good_spans, poor_spans, rm_format) + EOS"
