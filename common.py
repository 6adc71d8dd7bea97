"""What the four Text2Grad stages share about the method itself, so that it cannot drift apart between them:
  1. Records                   DataError, iter_jsonl, read_jsonl, atomic_open, write_json(l), open_resumable_jsonl,
                               append_jsonl: JSON lines, errors naming file and line, outputs a rerun resumes
  2. Feedback parsing          parse_feedback: critic text -> {"critique", "good_spans", "poor_spans"}
  3. Span <-> token alignment  find_span, locate_spans, decode_with_offsets, span_rewards (delta_t, paper Sec. 3.3),
                               interval_rewards, span_tokens
  4. The reward model's text   rm_user_message, build_rm_prompt, format_rm_target (z = [c ; A(y)], Sec. 3.4)
No torch or transformers at module level: parsing and alignment work without them. Copy it as it is.
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
    """Bad input: its one-line message names the file, line and field; scripts print it, exit 2."""


def first_line(e: Exception) -> str:
    """An exception as one line for a DataError: its message's first line, else its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def iter_jsonl(path, required: tuple[str, ...] = ()):
    """(line number, record) per non-blank line of a JSONL file (.jsonl.gz too), each `required` field a string.
    Lines end at "\n" only: a lone "\r" is JSON whitespace. Raises DataError('file:line: reason')."""
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
    """A line's bytes as text, a UTF-8 BOM that starts the file dropped (Windows editors write
    one); DataError naming the file, line and byte where they are not UTF-8."""
    try:
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:  # e.object: the bytes after the BOM, which e.start counts in
        column = len(e.object[: e.start].decode("utf-8", "replace")) + 1
        raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{e.object[e.start]:02x} at column {column})") from None


def read_jsonl(path, required: tuple[str, ...] = ()) -> list[dict]:
    """All records of a JSONL file (.jsonl.gz too), blank lines skipped; DataError: the line."""
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
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files: give the usual permissions
        os.replace(tmp, path)
    except BaseException:  # (a Ctrl-C can land just after the rename: the temp file is gone then)
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path, obj) -> None:
    with atomic_open(path) as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path, records) -> None:
    with atomic_open(path) as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)


def open_resumable_jsonl(path) -> set[str]:
    """Prepare an append-only JSONL output for resuming; returns the ids it already holds. A torn last line (a crash
    mid-write) is cut off, so a rerun redoes that record instead of keeping half of it."""
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
    """Append one record to an open text file and flush: a kill loses only the line it writes."""
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
    """(the last dict in text order, `obj` or nested, that holds a span list; its critique), or (None, None): the
    critique is that dict's own critique key, else the nearest enclosing dict's string critique, else None."""
    found, stack = (None, None), [(obj, None)]
    while stack:  # iterative pre-order walk: LLM output nests deeper than recursion can
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
    """(object, end) of the JSON-ish object at `start`, or (None, start + 1); lenient to LLMs."""
    try:
        return json.JSONDecoder(strict=False).raw_decode(text, start)  # raw newlines in strings
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


# A template's stand-in is not content: "...", "\u2026", "[...]" (literal_eval: [Ellipsis]),
# anything of dots, ellipses, brackets and quotes alone; for a critique also one "<description>".
_PLACEHOLDER = re.compile(r"[\s\[\]()<>\"'`]*(?:\.\.|\u2026)[\s.\u2026\[\]()<>\"'`]*")
_DESCRIPTION = re.compile(r"<[^<>\n]+>")


def _is_placeholder(value, critique: bool = False) -> bool:
    if value is Ellipsis:
        return True
    return isinstance(value, str) and bool(
        _PLACEHOLDER.fullmatch(value.strip()) or critique and _DESCRIPTION.fullmatch(value.strip())
    )


def _span_list(value):
    """A span list's strings (a lone string: one), placeholders dropped; None if only those."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    spans = [s for s in items if isinstance(s, str) and not _is_placeholder(s)]
    return None if not spans and any(_is_placeholder(s) for s in items) else spans


def _read_feedback(feedback: dict, critique) -> tuple[dict | None, bool]:
    """The dict _find_feedback chose, without placeholders: ({"critique" or None, "good_spans", "poor_spans"},
    False); (None, True) when its span lists hold only placeholders, or it holds nothing else (an echoed template)."""
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
    chain-of-thought, or precede chatter. The last object holding a span list (at any depth) wins; a missing list is
    []. Its critique: the critique key beside the lists, else one around them, else the prose before the JSON.
    ValueError when no object holds a span list (cut off before them: unparsed, never "no spans"). Placeholders
    ("...", "\u2026", [...], a "<description>" critique) count as absent; an echoed template is never chosen."""
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
    """True when `text` ends (but for whitespace) with an object holding both span lists: z = [c ; A(y)] is done."""
    end = len(text.rstrip())
    if not text[:end].endswith("}"):
        return False
    start = text.rfind("{", 0, end)
    while start >= 0:  # a '{' the final '}' closes (string-aware; one inside a string can seem to): the span JSON?
        if _balanced_end(text, start) == end:
            obj, _ = _decode_object(text, start)
            keys = {_norm_key(k) for k in obj} if isinstance(obj, dict) else set()
            if keys & _GOOD_KEYS and keys & _POOR_KEYS:
                return True
        start = text.rfind("{", 0, start)
    return False


# ----------------------------------------------------------------------------------------------------------------------
# 3. Span <-> token alignment by character intervals (core; paper Sec. 3.3 and App. L)
# ----------------------------------------------------------------------------------------------------------------------

_CHAR_MAP = {  # curly quotes and dashes, straightened
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
}
_WRAP_CHARS = "\"'` \t\n"  # quote marks (straightened) and backticks a critic puts around a quote


@functools.lru_cache(maxsize=64)  # locate_spans looks up every quote, repeats too, in one response
def _normalize(s: str) -> tuple[str, list[tuple[int, int]]]:
    """NFC, case-fold, quotes/dashes straightened, whitespace runs collapsed. Returns (normalized, the source interval
    [start, end) of the character (with its accents) or whitespace run each normalized character comes from)."""
    out, src, i, n = [], [], 0, len(s)
    while i < n:
        j = i + 1
        if s[i].isspace():
            while j < n and s[j].isspace():
                j += 1
            out.append(" ")
            src.append((i, j))
        else:  # a character and its marks: composed or not, one unit of the source
            while j < n and s[j] >= "\u0300" and (unicodedata.category(s[j])[0] == "M" or "\u1160" <= s[j] <= "\u11ff"):
                j += 1  # a combining mark, or a Hangul vowel / final jamo
            if j == i + 1 and s[i] < "\u0080":  # ASCII: nothing to compose or straighten
                out.append(s[i].lower())
                src.append((i, j))
                i = j
                continue
            unit = "".join(_CHAR_MAP.get(ch, ch) for ch in unicodedata.normalize("NFC", s[i:j]))
            for c in unicodedata.normalize("NFC", unit.lower()):  # "İ" lowers to 2: both map to it
                out.append(c)
                src.append((i, j))
        i = j
    return "".join(out), src


def _quote_variants(span: str):
    """The span, then without the critic's wrapping: quotes, ellipses, trailing punctuation."""
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
    """A character no word boundary is next to (accents: their letter's; CJK, Thai, Lao: none)."""
    return (ch.isalnum() or ch == "_" or ch >= "\u0300" and unicodedata.category(ch)[0] == "M") and not (
        "\u2e80" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" or "\u0e00" <= ch <= "\u0eff"
    )


def _find_bounded(text: str, span: str, start: int) -> int:
    """text.find(span, start), skipping a match starting or ending mid-word or before an accent."""
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
    tolerant of whitespace runs, case, curly quotes/dashes, NFC vs NFD, and quotes, ellipses or trailing punctuation
    around the quote; never of anything else, never inside a longer word, never half a character."""
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
    the earliest one an identical earlier quote has not claimed; a poor quote that finds every occurrence claimed
    takes the earliest a good quote claimed (poor wins). Empty or whitespace-only quotes are ignored."""
    claimed: dict[str, dict[tuple[int, int], str]] = {}  # quote -> {interval: its claimer's label}
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
    token i - 1 ends): a special token, or one that does not complete a character, gets an empty interval. Linear
    time: windows of at most 2 * _WINDOW ids (more in a byte-fallback run), decoded in one batch, track the prefix's
    decode; a tokenizer whose decoding is not local falls back to decoding each prefix."""
    token_ids = [int(t) for t in token_ids]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    n, w = len(token_ids), _WINDOW
    # A byte-fallback decoder (Llama-2, Mistral, Gemma: <0xE5><0x8C><0x97> is 北) decodes a byte run
    # whole, all U+FFFD when any of it is not UTF-8: a window must never start inside a run.
    pieces = getattr(tokenizer, "convert_ids_to_tokens", lambda ids: [None] * len(ids))(token_ids)
    in_run = [
        i > 0 and all(isinstance(p, str) and _BYTE_PIECE.fullmatch(p) for p in pieces[i - 1 : i + 1]) for i in range(n)
    ]
    edge = list(range(n + 1))  # edge[j]: where token j's window starts (its byte run's start)
    for j in range(1, n):
        edge[j] = edge[j - 1] if in_run[j] else j
    # token i's window starts a block before its own block of w tokens, so its left edge (where a
    # decode can differ in context: a stripped leading space, half a character) is the same in the
    # two strings compared: the windows up to token i and to i - 1 (the last one, or one per block)
    windows = [token_ids[edge[max(0, (i // w - 1) * w)] : i + 1] for i in range(n)]
    windows += [token_ids[edge[max(0, b - w)] : b] for b in range(0, n, w)]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # Rust's batch decode, ~3x faster
    fast = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    decoded = (backend.decode_batch if fast else tokenizer.batch_decode)(windows, skip_special_tokens=True)
    offsets, pos, agree, length = [], 0, 0, 0  # agree: how much of the prefix's decode is the text; length: its size
    for i in range(n):
        a, b = decoded[i], decoded[i - 1] if i % w else decoded[n + i // w]
        keep = len(b) if a.startswith(b) else len(os.path.commonprefix([a, b]))
        kept, added = length - len(b) + keep, a[keep:]  # prefix decode: `kept` chars, then `added`
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


_WINDOW = 4  # tokens: a character is at most 4 byte tokens (UTF-8); measured fastest of 4, 8, 16
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token (SentencePiece's)


def _decode_with_offsets_by_prefix(tokenizer, token_ids: list[int], text: str):
    """The definition itself, in quadratic time: for tokenizers whose decoding windows miss."""
    prefixes = tokenizer.batch_decode([token_ids[: i + 1] for i in range(len(token_ids))], skip_special_tokens=True)
    offsets, pos = [], 0
    for prefix in prefixes:
        end = max(len(os.path.commonprefix([prefix, text])), pos)
        offsets.append((pos, end))
        pos = end
    if offsets and pos < len(text):  # what the prefixes never agreed on: the last token's
        offsets[-1] = (offsets[-1][0], len(text))
    return text, offsets


def _core(text: str, s: int, e: int) -> tuple[int, int]:
    """A token's interval less its whitespace (the space of "Ġdog"); a blank one as it is."""
    piece = text[s:e]
    if piece.strip():
        s, e = s + len(piece) - len(piece.lstrip()), e - (len(piece) - len(piece.rstrip()))
    return s, e


def span_rewards(text: str, offsets: list[tuple[int, int]], good_spans: list[str], poor_spans: list[str]):
    """Per-token pseudo-rewards delta_t in {-1, 0, +1} (paper Sec. 3.3), and the quotes that could not be located.
    A token takes a span's label when the non-whitespace part of its interval lies inside the span. Tokens straddling
    a span edge get 0 (App. L); poor overrides good, and a token that overlaps a poor span is never +1. A token
    holding part of a multi-byte character (an empty interval) takes the label of the token that completes it (all
    9 tokens of SmolLM2's "北京不是上海"); one that completes a character and starts the next is scored by the first."""
    good_iv, poor_iv, unmatched = locate_spans(text, good_spans, poor_spans)
    labelled = [(a, b, 1.0) for a, b in good_iv] + [(a, b, -1.0) for a, b in poor_iv]  # good +1, poor -1
    return interval_rewards(text, offsets, labelled), unmatched


def interval_rewards(text: str, offsets: list[tuple[int, int]], spans) -> list[float]:
    """delta_t from located character intervals of `text` with a real reward, (start, end, reward) or {"start",
    "end", "reward"} (a python: critic's), by span_rewards' rule (its case +1 / -1): a token inside an interval
    takes its reward, one straddling its edge does not; the lowest reward wins where they overlap, and a token
    straddling a negative interval's edge is never above 0. An empty interval labels nothing."""
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
        elif completing[1] == s and s < len(text) and ord(text[s]) > 127:  # part of the character at s
            delta[i] = completing[0]
    return delta


def span_tokens(text: str, offsets: list[tuple[int, int]], good_spans: list[str], poor_spans: list[str]):
    """span_rewards' (delta, unmatched), and (label, token indices) of each located quote, good
    ones first: the tokens whose delta_t it sets, in order (App. I's within-span weighting: two
    adjacent quotes are two spans; a token that span_rewards leaves at 0 belongs to neither)."""
    good_iv, poor_iv, unmatched = locate_spans(text, good_spans, poor_spans)  # once: span_rewards' delta_t from them
    delta = interval_rewards(text, offsets, [(a, b, 1.0) for a, b in good_iv] + [(a, b, -1.0) for a, b in poor_iv])
    cores = [(s, s + 1) if s == e else _core(text, s, e) for s, e in offsets]  # a byte token: its character's start
    located = [
        (label, [t for t, (s, e) in enumerate(cores) if delta[t] == label and a <= s and e <= b])
        for label, ivs in ((1.0, good_iv), (-1.0, poor_iv))
        for a, b in ivs
    ]
    return delta, unmatched, located


# ----------------------------------------------------------------------------------------------------------------------
# 4. The reward model's text: training (02) and inference (03, 04) share it, so it cannot drift
# ----------------------------------------------------------------------------------------------------------------------

RM_INSTRUCTION = (
    "Critique the response, then give its good_spans and poor_spans as JSON, each quoted exactly from the response."
)
# The reward model's output format (02 --rm-format, reward_model.json "rm_format"): the paper's
# z = [c ; A(y)] ("critique+spans"), or its "w/o CoT" ablation (Table 2), the span JSON alone.
RM_FORMATS = ("critique+spans", "spans-only")
# What a stage-2 reward model was trained for (02 --objective, reward_model.json "objective").
RM_OBJECTIVES = {
    "generative": "a generative one (02 without --objective: it writes critique + spans)",
    "pairwise": "a scalar one trained on preference pairs (02 --objective pairwise)",
    "prm": "a process reward model (02 --objective prm)",
}
# How a PRM cuts a response into steps (02 --step-unit; baselines/scalar_rm.py's split_steps).
STEP_UNITS = ("clause", "block")
RM_INSTRUCTIONS = {
    "critique+spans": RM_INSTRUCTION,
    "spans-only": "Give the good_spans and poor_spans of the response as JSON, each quoted exactly from the response.",
}


def rm_user_message(prompt: str, response: str, rm_format: str = "critique+spans") -> str:
    """The reward model's request as one user message (what an OpenAI-compatible server gets)."""
    return f"{RM_INSTRUCTIONS[rm_format]}\n\n### Prompt\n{prompt}\n\n### Response\n{response}"


def build_rm_prompt(tokenizer, prompt: str, response: str, rm_format: str = "critique+spans") -> str:
    """The reward model's input text: the tokenizer's chat template if it has one, else a plain
    documented fallback: the user message, a blank line and "### Critique" (tokenizer=None)."""
    message = rm_user_message(prompt, response, rm_format)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    return f"{message}\n\n### Critique\n"


def format_rm_target(
    critique: str, good_spans: list[str], poor_spans: list[str], rm_format: str = "critique+spans", ambiguous_spans=()
) -> str:
    """The reward model's output z = [c ; A(y)]: the critique, a newline, the span JSON (EOS is added later);
    "spans-only" (w/o CoT): the span JSON alone. ambiguous_spans are left out: it learns to quote what locates."""
    spans = json.dumps({"good_spans": list(good_spans), "poor_spans": list(poor_spans)}, ensure_ascii=False)
    return spans if rm_format == "spans-only" else f"{critique.strip()}\n{spans}"


RM_PROMPT_FORMAT = "common.build_rm_prompt(tokenizer, prompt, response, rm_format)"
RM_TARGET_FORMAT = "common.format_rm_target(critique, good_spans, poor_spans, rm_format) + EOS"
