"""Shared helpers for the four Text2Grad stages. Every stage imports this file and nothing else from the project.
No torch or transformers at module level: parsing and alignment work without them (functions that need them import
them lazily).

Contents: the core first (copy it as is), then the task-specific material, one section each.
  core  1. Records                   DataError, iter_jsonl, read_jsonl, atomic_open, write_json, write_jsonl
        2. Feedback parsing          parse_feedback: critic text -> {"critique", "good_spans", "poor_spans"}
        3. Span <-> token alignment  find_span, locate_spans, decode_with_offsets, span_rewards (delta_t, Sec. 3.3),
                                     span_tokens
        4. Datasets, resumable I/O   read_rows, open_resumable_jsonl, append_jsonl, fingerprint, cached
        5. Reward-model format       rm_user_message, build_rm_prompt, rm_prompt, format_rm_target (z = [c ; A(y)],
                                     Sec. 3.4), rm_critique_served
        6. Models                    load_model, generation_config, policy_prompt, generate, rm_critique
        7. Training plumbing         autocast, add_lora, save_pretrained, 03's SFT warm start, torchrun, checkpoints
        8. Evaluation                rm_scores, rm_span_metrics, bootstrap, reference_stats, plot_curves
        9. Sandbox and code task     run_sandboxed, run_tests_sandboxed, read_code_problems, pass_at_k, code_critic
       10. The demo world            demo_critic, demo_delta, demo_dataset, build_demo_base, build_tiny_base
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import unicodedata
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


def parse_feedback(text: str) -> dict:
    """Critic output -> {"critique": str, "good_spans": [str], "poor_spans": [str]}. The JSON may be fenced, follow
    chain-of-thought, or precede chatter. Of several objects, the last one holding a span list (good_spans or
    poor_spans, at any depth) wins; with only one of the two lists, the other is []. Its critique is the critique key
    next to the lists, else one around them, else the prose before the JSON. ValueError when no object holds a span
    list: an output without spans (cut off before them, critique only) counts as unparsed, never as "no spans"."""
    if not isinstance(text, str):
        raise ValueError(f"critic output must be a string, got {type(text).__name__}")
    chosen, critique, chosen_start, any_obj, pos = None, None, 0, False, 0
    while (start := text.find("{", pos)) >= 0:
        obj, pos = _decode_object(text, start)
        if isinstance(obj, dict):
            any_obj = True
            feedback, found_critique = _find_feedback(obj)
            if feedback is not None:
                chosen, critique, chosen_start = feedback, found_critique, start
    if chosen is None:
        raise ValueError("no JSON object with good_spans or poor_spans in critic output" if any_obj else
                         "no JSON object (with good_spans or poor_spans) found in critic output")
    fields = {_norm_key(k): v for k, v in chosen.items()}
    as_list = lambda v: [v] if isinstance(v, str) else [s for s in v if isinstance(s, str)] if isinstance(  # noqa: E731
        v, (list, tuple)) else []
    good = next((fields[k] for k in fields if k in _GOOD_KEYS), [])
    poor = next((fields[k] for k in fields if k in _POOR_KEYS), [])
    if critique is None:  # prose before the JSON, minus an opening code fence
        critique = re.sub(r"```[\w-]*\s*$", "", text[:chosen_start]).strip()
    elif not isinstance(critique, str):
        critique = json.dumps(critique, ensure_ascii=False)
    return {"critique": critique.strip(), "good_spans": as_list(good), "poor_spans": as_list(poor)}


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
    delta = []
    for s, e in offsets:
        s, e = _core(text, s, e)
        if e <= s:
            delta.append(0.0)
            continue
        inside = lambda ivs: any(a <= s and e <= b for a, b in ivs)  # noqa: E731
        touches_poor = any(a < e and s < b for a, b in poor_iv)
        delta.append(-1.0 if inside(poor_iv) else 0.0 if touches_poor else 1.0 if inside(good_iv) else 0.0)
    completing = (0.0, None)  # (label, start) of the next token with a non-empty interval
    for i in reversed(range(len(offsets))):
        s, e = offsets[i]
        if s < e:
            completing = (delta[i], s)
        elif completing[1] == s and s < len(text) and ord(text[s]) > 127:  # part of the multi-byte character at s
            delta[i] = completing[0]
    return delta, unmatched


def span_tokens(text: str, offsets: list[tuple[int, int]], good_spans: list[str], poor_spans: list[str]):
    """(label, token indices) of each quote that locate_spans locates, good ones first: the tokens whose delta_t it
    sets in span_rewards (inside it, carrying its label; a byte token by where its character is), in order. What App.
    I's within-span weighting counts: two adjacent quotes are two spans, and a token of a quote that span_rewards
    leaves at 0 (it straddles a poor quote inside a good one) belongs to neither."""
    delta, _ = span_rewards(text, offsets, good_spans, poor_spans)
    good_iv, poor_iv, _ = locate_spans(text, good_spans, poor_spans)
    cores = [(s, s + 1) if s == e else _core(text, s, e) for s, e in offsets]  # a byte token: its character's start
    return [(label, [t for t, (s, e) in enumerate(cores) if delta[t] == label and a <= s and e <= b])
            for label, ivs in ((1.0, good_iv), (-1.0, poor_iv)) for a, b in ivs]


# ======================================================================================================================
# End of the core. Task-specific material follows.
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


def fingerprint(*parts) -> str:
    """A short hash of settings and of the files behind local model dirs (name, size, mtime; an adapter's base too),
    so a cache (04's) is dropped when a policy is retrained."""
    h = hashlib.sha256()
    for part in parts:
        path = Path(part) if isinstance(part, str) else None
        if path is not None and path.exists():
            files = sorted(path.iterdir()) if path.is_dir() else [path]
            h.update("".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files if f.is_file())
                     .encode())
            if (path / "adapter_config.json").is_file():
                h.update(fingerprint(json.loads((path / "adapter_config.json").read_text())
                                     .get("base_model_name_or_path", "")).encode())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:12]


def cached(path: Path, fp: str, items: list[dict], compute, chunk: int, desc: str, fresh: bool = False) -> list[dict]:
    """compute(items) -> rows with an "id", run only for items whose id the append-only JSONL cache at `path` lacks.
    Rows are appended per chunk (a killed run resumes); a cache written under another fingerprint is dropped."""
    from tqdm.auto import tqdm

    done = open_resumable_jsonl(path)
    if done:
        with open(path, encoding="utf-8") as f:
            stale = fresh or json.loads(f.readline()).get("fingerprint") != fp
        if stale:
            path.unlink()
            done = set()
    todo = [it for it in items if it["id"] not in done]
    with tqdm(total=len(todo), desc=desc, disable=not todo) as bar:
        for i in range(0, len(todo), chunk):
            rows = compute(todo[i:i + chunk])  # first, so bad input (a model that cannot load) leaves no file behind
            with open(path, "a", encoding="utf-8") as f:
                for row in rows:
                    append_jsonl(f, {**row, "fingerprint": fp})
            bar.update(len(todo[i:i + chunk]))
    rows = {r["id"]: r for r in read_jsonl(path)}
    return [rows[it["id"]] for it in items]


# ----------------------------------------------------------------------------------------------------------------------
# 5. Reward-model format and prompts, shared by training (02) and inference (03, 04) so the two never drift apart
# ----------------------------------------------------------------------------------------------------------------------

RM_INSTRUCTION = ("Critique the response, then give its good_spans and poor_spans as JSON, each quoted exactly from "
                  "the response.")


def rm_user_message(prompt: str, response: str) -> str:
    """The reward model's request as one user message (what an OpenAI-compatible server receives)."""
    return f"{RM_INSTRUCTION}\n\n### Prompt\n{prompt}\n\n### Response\n{response}"


def build_rm_prompt(tokenizer, prompt: str, response: str) -> str:
    """The reward model's input text: the tokenizer's chat template if it has one, else a plain documented fallback:
    the user message followed by a blank line and "### Critique". tokenizer=None gives the fallback."""
    message = rm_user_message(prompt, response)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    return f"{message}\n\n### Critique\n"


def rm_prompt(tokenizer, prompt: str, response: str, max_tokens: int | None = None):
    """The reward model's input, the same in 02 (training), 03 and 04 (critiquing): (ids, task prompt kept, status) of
    build_rm_prompt, the task prompt cut from its start when the whole would not fit in max_tokens (fit_prompt)."""
    return fit_prompt(tokenizer, lambda p: build_rm_prompt(tokenizer, p, response), prompt, max_tokens)


def format_rm_target(critique: str, good_spans: list[str], poor_spans: list[str]) -> str:
    """The reward model's output z = [c ; A(y)]: the critique, a newline, then the span JSON (EOS is added later)."""
    spans = json.dumps({"good_spans": list(good_spans), "poor_spans": list(poor_spans)}, ensure_ascii=False)
    return f"{critique.strip()}\n{spans}"


RM_PROMPT_FORMAT = "common.build_rm_prompt(tokenizer, prompt, response)"
RM_TARGET_FORMAT = "common.format_rm_target(critique, good_spans, poor_spans) + EOS"


def rm_settings(reward_model_dir) -> dict:
    """How stage 2 trained and evaluated the reward model in `reward_model_dir`: what 03 and 04 must repeat to use it.
      max_prompt_tokens  the most tokens of its input, rm_prompt (the task prompt is cut from its start to fit), the
                         same in training (02) and in use (03, 04, a served model too); None: no cut. Stage 2 sets it
                         to --max-len minus --max-new-tokens, so that an input and its critique fit in --max-len.
      max_new_tokens     the critique budget stage 2 evaluated it with: 03's and 04's default; None: the caller's.
      prompt_format, target_format   its input and output (build_rm_prompt; format_rm_target, then EOS).
    Read from DIR/reward_model.json (02 writes it). An older file lacks both budgets; its stage 2 evaluated with
    max_new_tokens 128 (demo) or 512 and the input cut to max_len minus that: those are returned. No file (a plain
    model directory; None for a served model): no cut, and max_new_tokens None."""
    path = Path(reward_model_dir) / "reward_model.json" if reward_model_dir else None
    try:
        info = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    out = {"max_prompt_tokens": None, "max_new_tokens": None, "prompt_format": RM_PROMPT_FORMAT,
           "target_format": RM_TARGET_FORMAT}
    if "max_len" in info.get("train", {}) and "max_new_tokens" not in info:  # written before these keys existed
        out["max_new_tokens"] = 128 if info.get("task") == "demo" else 512
        out["max_prompt_tokens"] = max(info["train"]["max_len"] - out["max_new_tokens"], 1)
    out.update({k: info[k] for k in out if k in info})
    return out


def rm_completions_prompt(tokenizer, prompt: str, response: str, max_prompt_tokens: int | None = None) -> str:
    """The text a served reward model gets on /v1/completions: rm_prompt's, as in training (tokenizer=None: the plain
    template). The server adds its BOS when it tokenizes, so a BOS the chat template wrote is left out: one, not two."""
    if tokenizer is None:
        return build_rm_prompt(None, prompt, response)
    text = build_rm_prompt(tokenizer, rm_prompt(tokenizer, prompt, response, max_prompt_tokens)[1], response)
    bos, adds_bos = tokenizer.bos_token, tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return text[len(bos):] if bos and adds_bos and text.startswith(bos) else text


def rm_critique_served(prompts: list[str], responses: list[str], base_url: str | None, model: str,
                       max_new_tokens: int, concurrency: int = 32, api: str = "chat", tokenizer=None,
                       max_prompt_tokens: int | None = None) -> list[str]:
    """rm_critique for a reward model behind an OpenAI-compatible endpoint (vLLM, Ollama, OpenAI): greedy, the whole
    batch in flight at once (up to `concurrency`). api "chat" sends rm_user_message as one user message (the server
    applies the chat template); "completions" sends rm_completions_prompt, the exact training text. Given the reward
    model's tokenizer, both cut the task prompt to max_prompt_tokens as training did (rm_prompt, rm_settings)."""
    import asyncio

    from openai import AsyncOpenAI

    async def ask(client, sem, prompt, response):
        async with sem:
            if api == "completions":
                reply = await client.completions.create(model=model, temperature=0.0, max_tokens=max_new_tokens,
                                                        prompt=rm_completions_prompt(tokenizer, prompt, response,
                                                                                     max_prompt_tokens))
                return reply.choices[0].text or ""
            if tokenizer is not None and max_prompt_tokens:  # the text the server's template makes, cut alike
                prompt = rm_prompt(tokenizer, prompt, response, max_prompt_tokens)[1]
            reply = await client.chat.completions.create(model=model, temperature=0.0, max_tokens=max_new_tokens,
                                                         messages=[{"role": "user",
                                                                    "content": rm_user_message(prompt, response)}])
            return reply.choices[0].message.content or ""

    async def ask_all():
        sem = asyncio.Semaphore(concurrency)
        async with AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY")) as client:
            return await asyncio.gather(*[ask(client, sem, p, r) for p, r in zip(prompts, responses)])
    return asyncio.run(ask_all())


# ----------------------------------------------------------------------------------------------------------------------
# 6. Models: loading (hub id, local dir, LoRA adapter dir), prompts, batched left-padded generation
# ----------------------------------------------------------------------------------------------------------------------


def first_line(e: Exception) -> str:
    """An exception as one line, for a DataError: its message's first line, else its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_model(name_or_path: str, device: str = "cpu", dtype: str = "float32", adapter: str | None = None):
    """(model, tokenizer) in eval mode. A directory holding adapter_config.json loads its base model plus the adapter.

    - Dropout is off in every module (disable_dropout; RLHF detail: dropout makes old and new log-probs disagree).
    - The hub's generation_config.json is dropped, all but its stop ids: every generate() here passes its complete
      settings (generation_config), so no repetition_penalty, no_repeat_ngram_size, min_p, ... of the hub changes what
      is sampled. Its EOS ids (a list for Llama-3.1: <|eot_id|>, <|end_of_text|>, ...) join the tokenizer's.
    - A tokenizer without a pad token gets a distinct one, never EOS, so padding can't be confused with a finished
      response.
    A directory or hub id that cannot be loaded (no weights, no such model) is a DataError naming it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(name_or_path)
    if adapter is None and (path / "adapter_config.json").is_file():
        adapter, name_or_path = str(path), json.loads((path / "adapter_config.json").read_text())[
            "base_model_name_or_path"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(adapter if adapter and Path(adapter, "tokenizer_config.json")
                                                  .is_file() else name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype(dtype))
    except (OSError, ValueError) as e:
        raise DataError(f"{name_or_path}: cannot load the model: {first_line(e)}") from None
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        model.resize_token_embeddings(len(tokenizer))
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    hub_eos = model.generation_config.eos_token_id
    stop += [i for i in ([hub_eos] if isinstance(hub_eos, int) else hub_eos or []) if i not in stop]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop,
                                               pad_token_id=tokenizer.pad_token_id)
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    disable_dropout(model)
    return model.to(device).eval(), tokenizer


def looks_local(path: str) -> bool:
    """True when `path` names a local directory rather than a hub id ("org/name"): absolute, starting with '.', more
    than two parts, or under a directory that exists here. A missing local path is reported without asking the hub."""
    p = Path(path)
    return (p.exists() or p.is_absolute() or path.startswith(".") or len(p.parts) > 2
            or (bool(p.parts) and Path(p.parts[0]).is_dir()))


def check_reward_model(path: str, flag: str = "--reward-model ") -> None:
    """Fail fast, before any training: DataError (one line) unless load_model could load the reward model at `path`.
    Checks, without loading weights: the directory exists; an adapter's base model is there when it is a local path
    (a hub id is left to load_model); the tokenizer loads. `flag` prefixes the message, as the user typed it."""
    from transformers import AutoTokenizer
    rm = Path(path or "")
    if not path or not rm.is_dir():
        raise DataError(f"{flag}{path or '(not given)'}: no such directory (run 02_train_reward.py first)")
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
                batch_size: int = 32, desc: str | None = None, max_prompt_tokens: int | None = None) -> list[str]:
    """The local reward model's raw critic output for each (prompt, response): batched greedy generation on rm_prompt
    (the task prompt cut from its start to fit max_prompt_tokens, as in training), in which a row stops as soon as
    its span JSON is complete (greedy_generate). The text is what plain greedy decoding up to a stop id gives whenever
    the model ends its output with that JSON, as it is trained to (format_rm_target)."""
    inputs = [rm_prompt(tokenizer, p, r, max_prompt_tokens)[0] for p, r in zip(prompts, responses)]
    ids = greedy_generate(model, tokenizer, inputs, max_new_tokens, batch_size=batch_size, desc=desc,
                          stop=feedback_complete)
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


def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32,
                    desc: str | None = None, stop=None) -> list[list[int]]:
    """Greedy response ids for each prompt, cut before EOS: batched, left-padded, with a KV cache.

    The same tokens as `generate(..., temperature=0)` (model.generate greedy, nothing from the model's
    generation_config), with two savings: a row leaves the batch, and its KV cache, as soon as it ends, so the rows
    still running no longer pay for it; and with `stop(text) -> bool` a row also ends when its decoded text satisfies
    it (checked only after a token holding '}', the one stop condition in use: feedback_complete).
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
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        rows = list(range(len(ids)))  # chunk rows still running, in batch order
        new = [[] for _ in rows]
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache,
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


# ----------------------------------------------------------------------------------------------------------------------
# 7. Training plumbing (02, 03): dtypes, LoRA, atomic saves, SFT, torchrun collectives, checkpoints
# ----------------------------------------------------------------------------------------------------------------------


def torch_dtype(name: str):
    """torch.float32 / bfloat16 / float16 from "float32", "bf16" (or "bfloat16"), "fp16" (or "float16")."""
    import torch
    return {"float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16}[name]


def autocast(device: str, dtype: str):
    """bf16/fp16 compute over float32 master weights for full fine-tuning (a bf16 weight does not move by a 1e-6
    step); for LoRA the frozen base is stored in `dtype` and autocast only matches the adapter's float32 to it."""
    import contextlib

    import torch
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch_dtype(dtype))


def grad_scaler(device: str, dtype: str):
    """Loss scaling for fp16 (its gradients underflow without it); a no-op otherwise."""
    import torch
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "fp16")


def add_lora(model, r: int, alpha: int, targets: str = "all-linear", dropout: float = 0.0, modules_to_save: str = ""):
    """The model with a trainable LoRA adapter (peft): `targets` is "all-linear" or comma-separated module names,
    `modules_to_save` comma-separated modules trained in full and saved with the adapter."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
        target_modules=targets if targets == "all-linear" else targets.split(","),
        modules_to_save=[m for m in modules_to_save.split(",") if m] or None))


def save_pretrained(out_dir, model, tokenizer, files: dict | None = None, **kwargs) -> Path:
    """model.save_pretrained(**kwargs), the tokenizer and `files` ({name: state dict}, torch.save) into a temp dir that
    is then renamed to out_dir (replacing it): a reader never sees half a model."""
    import shutil

    import torch
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    model.save_pretrained(tmp, **kwargs)
    tokenizer.save_pretrained(tmp)
    for name, state in (files or {}).items():
        torch.save(state, tmp / name)
    os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700 dirs; give the result the usual permissions
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def sft_warm_start(args, rank: int) -> str:
    """03's supervised fine-tuning on (prompt, --sft-field) before PPO, the loss on the response and its EOS only:
    --sft-steps AdamW steps on batches drawn with replacement, left-padded as in generation. Trained once, on rank 0
    (the others wait), and saved as full weights that later runs reuse. Returns its directory."""
    import torch
    from tqdm.auto import tqdm

    sft_dir = Path(args.sft_output_dir or Path(args.output_dir) / "sft")
    lora_r = args.lora_r if args.sft_lora_r is None else args.sft_lora_r
    if rank == 0 and not (sft_dir / "config.json").is_file():
        model, tokenizer = load_model(args.model, device=args.device,
                                      dtype=args.dtype if lora_r > 0 else "float32")  # full FT: fp32 master weights
        if lora_r > 0:  # LoRA for the warm start, merged into the weights afterwards
            model = add_lora(model, lora_r, 2 * lora_r, args.lora_targets)
        records = read_jsonl(args.sft_data, required=("prompt", args.sft_field))
        if not records:
            raise DataError(f"{args.sft_data}: no records")
        examples = [(policy_prompt(tokenizer, r["prompt"], args.chat_template, args.max_prompt_tokens),
                     tokenizer(r[args.sft_field], add_special_tokens=False)["input_ids"][:args.max_new_tokens]
                     + [tokenizer.eos_token_id]) for r in records]
        model.train()
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.sft_lr)
        scaler, gen = grad_scaler(args.device, args.dtype), torch.Generator().manual_seed(args.seed)
        for _ in (bar := tqdm(range(args.sft_steps), desc="SFT warm start")):
            batch = [examples[i] for i in torch.randint(len(examples), (args.sft_batch_size,), generator=gen).tolist()]
            ids, attn = left_pad([p + y for p, y in batch], tokenizer.pad_token_id)
            labels = ids.masked_fill(attn == 0, -100)
            for i, (p, y) in enumerate(batch):
                labels[i, : ids.shape[1] - len(y)] = -100                          # no loss on the prompt
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            with autocast(args.device, args.dtype):
                loss = model(input_ids=ids.to(args.device), attention_mask=attn.to(args.device),
                             position_ids=pos.to(args.device), labels=labels.to(args.device)).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()
        save_pretrained(sft_dir, model.merge_and_unload() if lora_r > 0 else model, tokenizer)
    barrier(timeout_h=24)  # the other ranks wait for rank 0's SFT, however long it takes
    return str(sft_dir)


def dist_init(args) -> tuple[int, int]:
    """(rank, world size). Under torchrun (even with one process, so its collectives run) it starts the process group:
    gloo on CPU; on GPU nccl for CUDA tensors and gloo for CPU ones, and args.device becomes this rank's GPU."""
    import torch
    import torch.distributed as dist
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if args.device.startswith("cuda") else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gather_rows(x):
    """The (B, ...) tensors of every rank stacked along B, (B, T) ones padded with zeros to the longest T."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        return x
    if x.dim() == 2:
        width = torch.tensor([x.shape[1]], device=x.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        x = torch.nn.functional.pad(x, (0, int(width) - x.shape[1]))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_sum(x):
    """Sum of a tensor over ranks (in place)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier(timeout_h: float | None = None) -> None:
    """Wait for every rank. timeout_h: a long wait (rank 0 training the SFT warm start alone), on a gloo group of its
    own, since nccl's collectives give up after 10 minutes."""
    import datetime

    import torch.distributed as dist
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=timeout_h)) if timeout_h else None
        dist.barrier(group=group)
        if group is not None:
            dist.destroy_process_group(group)


def save_checkpoint(path, step: int, model, value_head, optimizer, scheduler, kl_coef: float, args, rank: int = 0):
    """Stage 3's checkpoint: the trainable parameters, value head, optimizer, scheduler, beta, the arguments and every
    rank's RNG states, all a run needs to continue bit-exactly. Called on every rank (their RNG states are gathered);
    rank 0 writes it, atomically. The parameters are the same on every rank."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    rngs = [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}]
    if dist.is_initialized():
        rngs, rng = [None] * dist.get_world_size(), rngs[0]
        dist.all_gather_object(rngs, rng)
    if rank == 0:
        state = {"step": step, "kl_coef": kl_coef, "args": vars(args), "rng": rngs,
                 "trainable": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
                 "value_head": value_head.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict()}
        with atomic_open(path, "wb") as f:
            torch.save(state, f)


def load_checkpoint(path, model, value_head, optimizer, scheduler, rank: int = 0, world: int = 1) -> tuple[int, float]:
    """Restore what save_checkpoint saved, this rank's RNG states included: (step, beta). Another world size cannot
    continue exactly (each rank's sampler state is saved): DataError."""
    import random

    import numpy as np
    import torch
    state = torch.load(path, map_location="cpu", weights_only=False)
    if len(state["rng"]) != world:
        raise DataError(f"{path}: saved by {len(state['rng'])} process(es), resumed with {world}; resume with the same "
                        f"world size (torchrun --nproc_per_node {len(state['rng'])})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state["trainable"].items():
            params[name].copy_(tensor)
    value_head.load_state_dict(state["value_head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"][rank]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"], state["kl_coef"]


def read_prompts(args, world: int) -> list[dict]:
    """03's prompt records, checked with its settings before anything is written. --task code --critic program: any
    benchmark layout (read_code_problems), whose tests the critic runs."""
    records = read_code_problems(args.prompts) if args.task == "code" and args.critic == "program" else \
        read_jsonl(args.prompts, required=("prompt",))
    if not records:
        raise DataError(f"{args.prompts}: no prompts")
    if not args.model:
        raise DataError("--model is required outside the demo")
    if args.batch_size % (world * args.num_minibatches * args.grad_accum):
        raise DataError(f"--batch-size {args.batch_size} must divide by world size x --num-minibatches x "
                        f"--grad-accum = {world * args.num_minibatches * args.grad_accum}")
    return records


def start_or_resume(args, ckpt, model, value_head, optimizer, scheduler, rank: int, world: int) -> tuple[int, float]:
    """03's run dir: (first step, beta). --resume restores the checkpoint (load_checkpoint) and cuts metrics.jsonl and
    samples.jsonl back to its step; a fresh run starts without them. Rank 0 writes config.json."""
    out_dir, last, kl_coef = Path(ckpt).parent, 0, args.kl_coef
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    if args.resume and Path(ckpt).is_file():
        last, kl_coef = load_checkpoint(ckpt, model, value_head, optimizer, scheduler, rank, world)
    for path in (out_dir / "metrics.jsonl", out_dir / "samples.jsonl") if rank == 0 else ():
        if last:  # drop the rows logged after the checkpoint
            write_jsonl(path, [r for r in read_jsonl(path) if r["step"] <= last] if path.is_file() else [])
        else:
            path.unlink(missing_ok=True)
    if rank == 0 and last:
        print(f"resumed from {ckpt} at step {last}")
    if rank == 0:
        write_json(out_dir / "config.json", {**vars(args), "world_size": world})
    return last + 1, kl_coef


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """03's prompt indices of an iteration: consecutive slices of a fresh permutation per pass over the data, derived
    from (seed, step) alone so a resumed run draws exactly the same prompts."""
    import torch
    out, pos = [], step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset: offset + batch_size - len(out)]
        out += take
        pos += len(take)
    return out


def forward_rows(batch: int, micro: int, n_resp: int, vocab: int, n_logits: int = 1, budget: int = 2 ** 26) -> int:
    """Rows per no-grad forward of 03's step 4: the whole batch in one call when its logits (n_logits tensors of rows x
    (n_resp + 1) x vocab floats) fit in `budget` elements (256 MB of fp32), else as many as fit, at least the training
    micro-batch. A row's log-probs do not depend on its batch-mates (a kernel picked by shape may round by ~1e-7)."""
    return max(micro, min(batch, budget // (n_logits * (n_resp + 1) * vocab)))


def dump_rollouts(step: int, rank: int, b: dict, kl_coef: float, params, out_dir) -> None:
    """03's --dump-rollouts (an audit): every tensor of an iteration and a checksum of the parameters after its update,
    to out_dir/step<N>_rank<R>.pt."""
    import torch
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"texts": b["texts"], "delta": b["delta"], "kl_coef": kl_coef, **{k: b[k] for k in (
        "query", "response", "kl", "mask", "values", "has_eos", "advantages", "returns")},
        "param_checksum": sum(p.detach().double().sum().item() for p in params)},
        Path(out_dir) / f"step{step}_rank{rank}.pt")


# ----------------------------------------------------------------------------------------------------------------------
# 8. Evaluation (02, 04): a reward model's span recovery and critiques; per-sample statistics with bootstrap intervals;
#    ROUGE / BLEU / BERTScore; stage 3's training curves
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
      critique_words = mean words of the parsed critiques.
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
    return metrics


def ratio_stat(sums):  # (B, 2) summed (numerator, denominator) -> (B,)
    import numpy as np
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sums[:, 1] > 0, sums[:, 0] / np.where(sums[:, 1] > 0, sums[:, 1], 1), np.nan)


def bleu_stat(sums):  # (B, 10) summed [4 matches, 4 totals, hyp length, ref length] -> corpus BLEU
    import numpy as np
    from sacrebleu.metrics import BLEU
    return np.array([BLEU.compute_bleu(s[:4].tolist(), s[4:8].tolist(), int(s[8]), int(s[9]), smooth_method="exp")
                     .score for s in sums])


def bootstrap(rows, stat=ratio_stat, n_boot: int = 1000, seed: int = 0) -> dict:
    """Statistic of the summed per-sample rows, with the 2.5/97.5 percentiles of n_boot resamples of the samples."""
    import numpy as np
    x = np.asarray(rows, dtype=float).reshape(len(rows), -1)  # (N, K) per-sample sufficient statistics
    value = float(stat(x.sum(0, keepdims=True))[0])
    weights = np.random.default_rng(seed).multinomial(len(x), np.full(len(x), 1 / len(x)), size=n_boot)  # (B, N)
    boots = stat(weights @ x)
    boots = boots[~np.isnan(boots)]
    ci = [float(v) for v in np.percentile(boots, [2.5, 97.5])] if len(boots) else [None, None]
    return {"value": None if np.isnan(value) else value, "ci95": ci, "n": len(x)}


def reference_stats(hyps: list[str], refs: list[str]) -> dict[str, list]:
    """Per-sample ROUGE F1s (rouge-score, stemmed, as in the summarization literature) and BLEU sufficient statistics
    (sacrebleu, 13a tokenizer): corpus BLEU = BLEU of the summed statistics."""
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU
    scorer, bleu = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True), BLEU()
    scores = [scorer.score(r, h) for h, r in zip(hyps, refs)]
    out = {key: [(s[key].fmeasure, 1) for s in scores] for key in ("rouge1", "rouge2", "rougeL")}
    stats = [bleu.corpus_score([h], [[r]]) for h, r in zip(hyps, refs)]
    out["bleu"] = [[*s.counts, *s.totals, s.sys_len, s.ref_len] for s in stats]
    return out


def bertscore_f1(hyps, refs, model_dir, layers, device) -> list[float]:
    if not Path(model_dir).is_dir():
        raise DataError(f"--bertscore-model {model_dir}: not a local model directory")
    try:
        import bert_score
    except ImportError:
        raise DataError("--bertscore-model needs the bert-score package: pip install bert-score") from None
    from transformers import AutoConfig
    layers = layers or AutoConfig.from_pretrained(model_dir).num_hidden_layers
    _, _, f1 = bert_score.score(hyps, refs, model_type=model_dir, num_layers=layers, device=device,
                                use_fast_tokenizer=True)
    return f1.tolist()


# Stage 3's training curves (metrics.jsonl) for 04's report: the learned critic's and, dashed, the exact critic's
CURVE_KEYS = {"objective/span_reward": "reward: critic (solid), exact critic (dashed)",
              "critic/mistake_rate": "mistake rate: critic (solid), exact critic (dashed)",
              "objective/kl": "KL to the reference", "objective/entropy": "entropy"}
EXACT_CURVES = {"objective/span_reward": "exact/span_reward", "critic/mistake_rate": "exact/mistake_rate"}  # demo
COLORS = ["#1a7f37", "#8250df", "#0969da", "#bc4c00", "#cf222e", "#57606a"]


def read_curves(specs: dict[str, str]) -> dict[str, list[dict]]:
    """Rows of each stage 3 metrics.jsonl; a torn last line (a run still going) is skipped, not fatal."""
    import sys
    runs = {}
    for name, path in specs.items():
        if not Path(path).is_file():
            print(f"warning: no training curves for {name!r}: {path} not found", file=sys.stderr)
            continue
        rows = []
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a run still writing
        runs[name] = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), (int, float))]
    return runs


def plot_curves(runs: dict[str, list[dict]]) -> str | None:
    """04's report: base64 PNG with one panel per curve present (reward, mistakes, KL, entropy), or None."""
    present = {k for rows in runs.values() for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    keys = [k for k in CURVE_KEYS if k in present] or sorted(present - {"step"})[:4]
    if not keys:
        return None
    import base64
    import io
    import itertools

    import matplotlib
    import numpy as np
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols, rows = min(2, len(keys)), (len(keys) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.1 * rows), dpi=110, squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.remove()
    for ax, key in zip(axes.flat, keys):
        for color, (name, rows) in zip(itertools.cycle(COLORS), runs.items()):
            # the learned critic's curve, and dashed the exact critic's on the same rollouts (the demo's
            # reward-hacking monitor: a rising critic reward over a flat exact one means the critic is being gamed)
            for k, style, label in ((key, "-", name), (EXACT_CURVES.get(key), "--", None)):
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
                if not pts:
                    continue
                x, y = map(np.asarray, zip(*pts))
                w = max(1, len(y) // 15)  # moving average over ~7% of the run; raw values drawn faintly behind
                smooth = np.convolve(y, np.ones(w) / w, mode="valid")
                if style == "-":
                    ax.plot(x, y, color=color, alpha=0.2, lw=1)
                ax.plot(x[w - 1:], smooth, style, color=color, lw=2 if style == "-" else 1.5, label=label)
        ax.set_title(CURVE_KEYS.get(key, key), fontsize=11)
        ax.set_xlabel("PPO iteration", fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.25)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].legend(fontsize=9, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------------------------------------------------
# 9. Sandbox for model-written code (01 program critic, 03 program critic, 04 pass@k)
# ----------------------------------------------------------------------------------------------------------------------

# A tiny launcher (trusted code, no preexec_fn: safe from threads) sets the sandbox up and forks; the child applies the
# per-process layers and execs the command, the launcher stays behind as its supervisor. Layers:
#   always       a fresh temp dir as cwd/HOME/TMPDIR; an allowlisted environment (no keys, tokens or proxies); rlimits
#                on address space, CPU time, file size and core dumps; output kept head and tail; at the time limit and
#                when the command ends, every process it started is killed (see the last three layers).
#   landlock     (Linux >= 5.13, detected at run time) writes only inside the temp dir; reads only the Python
#                installation, system libraries, /dev, /proc and /sys; no TCP bind/connect (ABI >= 4); no signals or
#                abstract sockets outside the sandbox (ABI >= 6); other processes' /proc/PID/environ out of reach.
#   no-capabilities   as root, every capability is dropped (uid 0 stays so an interpreter under /root stays readable).
#   pid-namespace     the command is PID 1 of its own namespace: when it ends or is killed, the kernel kills every
#                process left in it, setsid() and double forks included. Fallback "subreaper": the supervisor adopts
#                orphans and kills all its descendants.
#   seccomp-no-sockets   socket() of every family, and io_uring, fail with EACCES: no TCP, UDP, ICMP or unix socket
#                reaches the host, not even one at a path (/var/run/docker.sock), which no network namespace hides.
#                socketpair() stays (asyncio, multiprocessing.Pipe). For x86-64 and arm64.
#   no-network   also a network namespace with no interface up, where namespaces are allowed.
#   pids-cgroup  a cgroup with pids.max (v2 or v1, where writable): a fork bomb stops at SANDBOX_MAX_PROCESSES.
#                Fallback "nproc-rlimit" (not for root, whom the kernel exempts from RLIMIT_NPROC).
# A layer the machine lacks is skipped with a RuntimeWarning (once) and result["sandbox"] lists the layers applied. A
# layer that was detected but fails to apply runs nothing: RuntimeError.

SANDBOX_MAX_PROCESSES = 64  # pids.max / RLIMIT_NPROC of one run: tests may start a few processes, not a fork bomb


_SAFE_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "SYSTEMROOT")  # an allowlist: nothing secret-looking can leak
_SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # third-party pytest plugins cost ~2 s of startup
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_LL_READ, _LL_FILE_RW, _LL_ALL = 1 | 4 | 8, 2 | 4 | 1 << 14, (1 << 16) - 1  # exec+read file+read dir; rw+truncate
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, struct, sys
status_fd, cfg, cmd = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
os.set_inheritable(status_fd, False)  # a successful exec closes it: the parent then reads nothing
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype, L, U = ctypes.c_long, ctypes.c_long, ctypes.c_ulong

def ok(ret, what):
    if ret < 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
    return ret

def fail(e):
    os.write(status_fd, f"{type(e).__name__}: {e}".encode())
    os._exit(126)

def descendants(root):  # pids whose parent chain leads to `root`, from /proc
    parent = {}
    for d in os.listdir("/proc"):
        try:
            parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            pass
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in found]
        found.update(kids)
        todo += kids
    return found

def kill_all(child):  # the child, everything that descends from the supervisor, and the cgroup's members
    for _ in range(100):  # repeat: a process may fork while we scan
        victims = {child} | descendants(os.getpid())
        if cfg["cgroup"]:
            try:
                victims |= {int(p) for p in open(os.path.join(cfg["cgroup"], "cgroup.procs")).read().split()}
            except OSError:
                pass
        victims.discard(os.getpid())
        alive = False
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                alive = True
            except OSError:
                pass
        while True:  # reap what we can (we are their parent or subreaper)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not alive:
            return

try:  # --- supervisor: cgroup, namespaces, then fork
    if cfg["cgroup"]:
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    uid, gid = os.geteuid(), os.getegid()
    if cfg["clone"]:
        ok(libc.unshare(ctypes.c_int(cfg["clone"])), "unshare")
        if cfg["clone"] & 0x10000000:  # a user namespace: map our own ids, so files look the same
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    if not cfg["clone"] & 0x20000000:
        ok(libc.prctl(ctypes.c_int(36), U(1), U(0), U(0), U(0)), "PR_SET_CHILD_SUBREAPER")
    supervisor = os.getpid()
    child = os.fork()
except BaseException as e:
    fail(e)

if child:  # --- the supervisor: forwards SIGUSR1 (stack dump), kills everything on SIGTERM and when the child ends
    for fd in cfg["pass_fds"]:
        os.close(fd)
    os.close(status_fd)
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(child, signal.SIGUSR1))
    signal.signal(signal.SIGTERM, lambda *_: (kill_all(child), os._exit(137)))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(126)
        if pid == child:
            break
    kill_all(child)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))

try:  # --- the child: per-process layers, then exec
    ok(libc.prctl(ctypes.c_int(1), U(signal.SIGKILL), U(0), U(0), U(0)), "PR_SET_PDEATHSIG")  # dies with its supervisor
    if os.getppid() != supervisor and not cfg["clone"] & 0x20000000:
        os._exit(137)
    ok(libc.prctl(ctypes.c_int(38), U(1), U(0), U(0), U(0)), "PR_SET_NO_NEW_PRIVS")  # no exec regains privileges
    abi = cfg["landlock_abi"]
    if abi:  # landlock_create_ruleset = 444, landlock_add_rule = 445, landlock_restrict_self = 446 (all arches)
        fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every fs right this ABI knows
        size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct grew: fs rights, then net rights, then scopes
        attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]
        ruleset = ok(libc.syscall(L(444), attr, L(len(attr)), L(0)), "landlock_create_ruleset")
        for path, access in cfg["rules"]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            if not os.path.isdir(path):
                access &= 1 | 2 | 4 | 1 << 14 | 1 << 15  # the rights a single file can carry
            ok(libc.syscall(L(445), L(ruleset), L(1), struct.pack("=Qi", access & fs, fd), L(0)), f"add_rule {path}")
            os.close(fd)
        ok(libc.syscall(L(446), L(ruleset), L(0)), "landlock_restrict_self")
    if cfg["seccomp"]:  # [arch, socket nr]: socket() and io_uring_setup -> EACCES; so are x32 and foreign-ABI calls
        arch, nr_socket = cfg["seccomp"]
        deny, allow = 0x00050000 | 13, 0x7FFF0000
        prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, deny), (0x20, 0, 0, 0), (0x35, 3, 0, 0x40000000),
                (0x15, 2, 0, 425), (0x15, 1, 0, nr_socket), (0x06, 0, 0, allow), (0x06, 0, 0, deny)]
        filt = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))
        fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(filt))
        ok(libc.prctl(ctypes.c_int(22), U(2), ctypes.c_char_p(fprog), U(0), U(0)), "seccomp")
    if cfg["drop_caps"]:  # no privilege left: permitted = effective = {} (and no_new_privs keeps it so)
        for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
            libc.prctl(ctypes.c_int(24), U(cap), U(0), U(0), U(0))  # PR_CAPBSET_DROP; needs CAP_SETPCAP: best effort
        ok(libc.capset(struct.pack("Ii", 0x20080522, 0), bytes(24)), "capset")
    for name, (soft, hard) in cfg["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError):
            if sys.platform.startswith("linux"):
                raise
    os.execvp(cmd[0], cmd)
except BaseException as e:
    fail(e)
"""
_LANDLOCK_ABI = None
_NAMESPACES = None
_PIDS_CGROUP = None
_PROBING = threading.Lock()  # the probes below run once per process, also when the first runs start from threads


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (not Linux, kernel < 5.13, or Landlock disabled)."""
    global _LANDLOCK_ABI
    with _PROBING:  # set once, complete: a thread that saw a half-done probe would run without Landlock
        if _LANDLOCK_ABI is None:
            abi = 0
            if os.uname().sysname == "Linux":
                import ctypes
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall.restype = ctypes.c_long
                abi = max(0, libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))
            _LANDLOCK_ABI = abi
    return _LANDLOCK_ABI


def sandbox_namespaces() -> int:
    """Clone flags for a PID + network namespace (plus a user namespace when not root) if this machine allows them,
    else 0. Probed once, in a throwaway process."""
    global _NAMESPACES
    with _PROBING:
        if _NAMESPACES is None:
            flags = _CLONE_NEWPID | _CLONE_NEWNET | (0 if os.geteuid() == 0 else _CLONE_NEWUSER)
            probe = (f"import ctypes, os, sys\nif ctypes.CDLL(None).unshare({flags}) != 0: sys.exit(1)\n"
                     f"if {flags} & {_CLONE_NEWUSER}:\n    open('/proc/self/setgroups', 'w').write('deny')\n"
                     f"    open('/proc/self/uid_map', 'w').write(f'{{os.geteuid()}} {{os.geteuid()}} 1')\n"
                     "sys.exit(0 if os.fork() == 0 else os.waitstatus_to_exitcode(os.wait()[1]))\n")
            _NAMESPACES = flags if os.uname().sysname == "Linux" and _probe_ok(probe) else 0
    return _NAMESPACES


def _probe_ok(code: str) -> bool:
    """Does `code` exit 0 in a fresh interpreter?"""
    import subprocess
    import sys
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _pids_cgroup_parent() -> str | None:
    """A cgroup directory (v2, or v1's pids controller) under which this process may create a child cgroup, set its
    pids.max and move a process into it; or None. Probed once, with a throwaway cgroup and process."""
    global _PIDS_CGROUP
    with _PROBING:
        if _PIDS_CGROUP is None:
            _PIDS_CGROUP = next((p for p in _cgroup_candidates() if _cgroup_works(p)), "")
    return _PIDS_CGROUP or None


def _cgroup_candidates() -> list[str]:
    try:
        mounts = [line.split(" - ")[1].split() + line.split()[4:5] for line in open("/proc/self/mountinfo")]
        own = [line.rstrip("\n").split(":", 2) for line in open("/proc/self/cgroup")]
    except (OSError, IndexError):
        return []
    return [os.path.join(mount, path.lstrip("/")) for fstype, _, options, mount in mounts for _, controllers, path in own
            if (fstype == "cgroup2" and controllers == "") or
            (fstype == "cgroup" and "pids" in controllers.split(",") and "pids" in options.split(","))]


def _cgroup_works(parent: str) -> bool:
    probe = os.path.join(parent, f"t2g-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        Path(probe, "pids.max").write_text("8")
        return _probe_ok(f"open({os.path.join(probe, 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))")
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def _seccomp_target() -> list | None:
    """[audit arch, socket syscall number] for the seccomp network filter, where this architecture is known."""
    return {"x86_64": [0xC000003E, 41], "aarch64": [0xC00000B7, 198]}.get(os.uname().machine)


def _landlock_rules(work: str) -> list:
    """[path, rights]: read the interpreter and system libraries, read+write /dev/null, everything inside `work`."""
    import site
    import sys
    reads = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/dev", "/proc", "/sys",
             "/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/os-release",
             sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *getattr(site, "getsitepackages", list)(),
             site.getusersitepackages()]
    return [[p, _LL_READ] for p in dict.fromkeys(reads) if os.path.exists(p)] + [["/dev/null", _LL_FILE_RW],
                                                                                  [work, _LL_ALL]]


def _own_processes() -> int:
    """How many processes this uid runs (RLIMIT_NPROC counts them all, not just the sandbox's)."""
    uid, n = os.geteuid(), 0
    for d in os.listdir("/proc"):
        try:
            n += d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid
        except OSError:
            pass
    return n


def _sandbox_plan(work: str, timeout_s: float, memory_mb: int) -> tuple[dict, list[str], list[str]]:
    """(launcher config, layers applied, layers missing) for one run on this machine."""
    linux, root = os.uname().sysname == "Linux", os.geteuid() == 0
    abi, clone = landlock_abi(), sandbox_namespaces() if linux else 0
    cgroup_parent = _pids_cgroup_parent() if linux else None
    seccomp = _seccomp_target() if linux else None
    cpu = int(timeout_s) + 2
    rlimits = {"RLIMIT_AS": [memory_mb << 20] * 2, "RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_FSIZE": [64 << 20] * 2,
               "RLIMIT_CORE": [0, 0]}
    nproc = linux and not cgroup_parent and not root
    if nproc:
        rlimits["RLIMIT_NPROC"] = [_own_processes() + SANDBOX_MAX_PROCESSES] * 2
    config = {"landlock_abi": abi, "rules": _landlock_rules(work) if abi else [], "clone": clone, "cgroup": None,
              "seccomp": seccomp, "drop_caps": linux and (root or bool(clone & _CLONE_NEWUSER)), "rlimits": rlimits,
              "pass_fds": []}
    layers = {f"landlock-v{abi}": abi, "no-capabilities": config["drop_caps"], "pid-namespace": clone,
              "subreaper": linux and not clone, "no-network": clone, "seccomp-no-sockets": seccomp,
              "pids-cgroup": cgroup_parent, "nproc-rlimit": nproc}
    missing = [name for name, ok in (("landlock", abi), ("pid-namespace", clone), ("no-sockets", seccomp),
                                     ("process-limit", cgroup_parent or nproc)) if not ok]
    return config, [name for name, ok in layers.items() if ok], missing


_WARNED = set()


def _kill(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Streams:
    """stdout and stderr of a process, read as they come: the first and last `limit` / 2 bytes of each are kept (a
    verdict or a traceback sits at the end), the middle is counted and dropped, so endless output costs no memory."""

    def __init__(self, proc, limit: int):
        import selectors
        self.half, self.fds = limit // 2, [proc.stdout.fileno(), proc.stderr.fileno()]
        self.head, self.tail, self.cut = {fd: b"" for fd in self.fds}, {fd: b"" for fd in self.fds}, dict.fromkeys(
            self.fds, 0)
        self.files = {proc.stdout.fileno(): proc.stdout, proc.stderr.fileno(): proc.stderr}
        self.sel, self.open = selectors.DefaultSelector(), set(self.fds)
        for fd in self.fds:
            self.sel.register(fd, selectors.EVENT_READ)

    def drain(self, deadline: float) -> bool:
        """Read until both streams are closed (True) or `deadline` (time.monotonic) passes (False)."""
        import time
        while self.open and (left := deadline - time.monotonic()) > 0:
            for key, _ in self.sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    self.close(key.fd)
                    continue
                room = self.half - len(self.head[key.fd])
                self.head[key.fd] += chunk[:max(room, 0)]
                tail = self.tail[key.fd] + chunk[max(room, 0):]
                self.cut[key.fd] += max(0, len(tail) - self.half)
                self.tail[key.fd] = tail[-self.half:] if self.half else b""
        return not self.open

    def close(self, *fds) -> None:
        for fd in fds or list(self.open):
            self.sel.unregister(fd)
            self.open.discard(fd)
            self.files[fd].close()

    def text(self, fd: int, strip: list[str]) -> str:
        """What was kept, decoded, with a note where the middle was cut, and `strip` prefixes (temp paths) removed."""
        note = f"\n[... {self.cut[fd]} bytes cut ...]\n" if self.cut[fd] else ""
        text = (self.head[fd] + note.encode() + self.tail[fd]).decode("utf-8", "replace")
        for prefix in strip:
            text = text.replace(prefix, "")
        return text


def run_sandboxed(files: dict[str, str], command: list[str], timeout_s: float = 10.0, memory_mb: int = 1024,
                  max_output_chars: int = 10_000, pass_fds: tuple[int, ...] = ()) -> dict:
    """Run untrusted code: `files` are written to a fresh temp dir and `command` runs there under the layers listed
    above, with a wall-clock limit after which every process it started is killed. `pass_fds` are inherited by the
    command (the test runner's private channel). Returns {"returncode", "stdout", "stderr", "timed_out",
    "duration_s", "sandbox"}: stdout/stderr keep their head and tail, "sandbox" lists the layers applied. Raises
    RuntimeError if the sandbox itself cannot be set up (the code then never runs)."""
    import shutil
    import signal
    import subprocess
    import sys
    import time
    import warnings

    with tempfile.TemporaryDirectory(prefix="t2g-sandbox-", ignore_cleanup_errors=True) as work:
        config, layers, missing = _sandbox_plan(work, timeout_s, memory_mb)
        if missing and tuple(missing) not in _WARNED:
            _WARNED.add(tuple(missing))
            warnings.warn(f"sandbox layers unavailable on this machine: {', '.join(missing)}"
                          + (" (Landlock is unavailable: no filesystem confinement)" if "landlock" in missing else "")
                          + f"; model-written code runs with: {', '.join(layers) or 'rlimits only'}", RuntimeWarning,
                          stacklevel=2)
        for name, text in files.items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"sandbox file names must stay inside its directory: {name!r}")
            path = Path(work, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        env = {k: os.environ[k] for k in _SAFE_ENV if k in os.environ}
        env.update(_SANDBOX_ENV, HOME=work, TMPDIR=work)
        cgroup = None
        if "pids-cgroup" in layers:
            cgroup = os.path.join(_pids_cgroup_parent(), f"t2g-{os.getpid()}-{os.urandom(4).hex()}")
            os.mkdir(cgroup)
            Path(cgroup, "pids.max").write_text(str(SANDBOX_MAX_PROCESSES))
        config.update(cgroup=cgroup, pass_fds=list(pass_fds))
        status_r, status_w = os.pipe()
        start = time.monotonic()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(status_w), json.dumps(config),
                                     *command], cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status_w, *pass_fds))
        finally:
            os.close(status_w)
        streams = _Streams(proc, max_output_chars)
        timed_out = not streams.drain(start + timeout_s)
        if timed_out:  # ask for a stack dump (the supervisor forwards SIGUSR1), then kill everything the code started
            for sig, grace in ((signal.SIGUSR1, 0.5), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                _kill(proc.pid, sig)
                if streams.drain(time.monotonic() + grace):
                    break
        streams.close()  # a process that escaped every layer may still hold the pipes: stop listening
        proc.wait()
        duration = time.monotonic() - start
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # belt and braces: anything left in the session's process group
        except (ProcessLookupError, PermissionError):
            pass
        if cgroup:
            for _ in range(50):
                try:
                    os.rmdir(cgroup)
                    break
                except OSError:  # members still exiting
                    for pid in Path(cgroup, "cgroup.procs").read_text().split():
                        _kill(int(pid), signal.SIGKILL)
                    time.sleep(0.02)
        with os.fdopen(status_r, "rb") as f:
            setup_error = f.read().decode("utf-8", "replace")
        shutil.rmtree(work, ignore_errors=True)
    if setup_error:
        raise RuntimeError(f"sandbox could not start {command[0]!r}: {setup_error}")

    out, err = (streams.text(fd, [work + os.sep, os.path.realpath(work) + os.sep]) for fd in streams.fds)
    return {"returncode": proc.returncode, "stdout": out, "stderr": err, "timed_out": timed_out,
            "duration_s": duration, "sandbox": layers}


# The test runner. Three styles, one verdict channel:
#   "pytest"       plain pytest files (test_* functions and Test* classes without fixtures, marks or hooks) run by a
#                  fast in-process runner with pytest's semantics: ~0.1 s instead of pytest's ~0.6 s startup.
#   "pytest-real"  files that use pytest features run under pytest itself, with a plugin that reports the outcomes.
#   "script"       benchmark tests (HumanEval's check(), MBPP's asserts) run in the solution's own namespace, exactly
#                  as the official harnesses exec `program + tests` in one namespace.
# The verdict never comes from the output or the exit status, which the code controls. The runner reads a per-run
# nonce and the test source from a private file descriptor before any solution code runs (then closes it), and writes
# the counts, tagged with the nonce, to a second descriptor: an unnamed file the code cannot open by path. A code that
# prints "N passed" or ends the process early yields no verdict: failed. The runner's state lives in closures, not in
# module globals. (What no in-process harness can rule out: code written against this runner's internals, walking the
# interpreter's frames to reach them. HumanEval's and EvalPlus's harnesses share that limit.)
# trace=True (the critic's second run, on failing code only) adds what fault localisation needs: every assert is its
# own test case and execution goes on after a failed one; per case, the solution lines it executed, the first call
# from the tests into the solution with its arguments and return value, and the expected and actual values.
# Both runners dump the stack on SIGUSR1 (sent at the time limit) to a copy of stderr, so the critic can name the line
# a hung test is stuck on.
_TEST_RUNNER = r"""
import faulthandler, os, signal
faulthandler.register(signal.SIGUSR1, file=os.fdopen(os.dup(2), "w"))
import ast, importlib.util, json, sys, time, traceback, types


def main(write=os.write, dumps=json.dumps, clock=time.perf_counter, settrace=sys.settrace):
    start = clock()
    with os.fdopen(int(sys.argv[1]), "rb") as f:  # the private settings: read, then closed
        cfg = json.loads(f.read())
    nonce, out_fd, style, trace, test_src = cfg["nonce"], cfg["result_fd"], cfg["style"], cfg["trace"], cfg["test"]
    sol_path, test_path = os.path.abspath("solution.py"), os.path.abspath("test_solution.py")
    counts = {"passed": 0, "failed": 0, "errors": 0}

    def emit(kind, payload):  # payload -> JSON: only localisation hints and messages go this way, never the verdict
        write(out_fd, ('{"nonce": "' + nonce + '", "' + kind + '": ' + dumps(payload, default=repr) + "}\n").encode())

    def finish():  # the verdict: three ints formatted by hand (nothing the code could patch), then exit
        p, f, e = counts["passed"], counts["failed"], counts["errors"]
        write(out_fd, ('{"nonce": "' + nonce + f'", "summary": {{"passed": {p}, "failed": {f}, "errors": {e}}}}}\n')
              .encode())
        print(", ".join([f"{n} {w}" for n, w in ((f, "failed"), (p, "passed"), (e, "error")) if n] or ["no tests ran"])
              + f" in {clock() - start:.2f}s", flush=True)
        os._exit(1 if f else 2 if e else 0 if p else 5)

    # 1. the tests themselves must compile and find their imports, or the problem (not the solution) is broken
    try:
        tree = ast.parse(test_src, test_path)
    except SyntaxError as e:
        emit("problem_error", f"the tests do not compile: {e.msg} (line {e.lineno})")
        os._exit(3)
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for name in names:
            top = name.split(".")[0]
            if top not in ("solution", "test_solution") and importlib.util.find_spec(top) is None:
                emit("problem_error", f"the tests import {top!r}, which is not installed")
                os._exit(3)

    # 2. trace mode: line coverage of the solution and the tests' calls into it, per test case
    state = {"lines": set(), "call": None, "returned": None, "cases": 0}
    entry = cfg.get("entry_point")

    def show(v, n=120):
        try:
            t = repr(v)
        except Exception:
            t = "<unprintable>"
        return t if len(t) <= n else t[:n] + "..."

    def on_call(frame, event, arg):
        if frame.f_code.co_filename != sol_path:
            return None
        back, first = frame.f_back, None
        if state["call"] is None and back is not None and back.f_code.co_filename == test_path and (
                entry is None or frame.f_code.co_name == entry):
            code = frame.f_code
            n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
            args = ", ".join(show(frame.f_locals.get(a), 80) for a in code.co_varnames[:n])
            state["call"], first = f"{code.co_name}({args})", frame

        def on_line(frame, event, arg):
            if event == "line":
                state["lines"].add(frame.f_lineno)
            elif event == "return" and frame is first:
                state["returned"] = show(arg, 200)
            return on_line
        return on_line

    def solution_lines(tb):  # the solution's lines on a traceback, innermost last
        return [f.lineno for f in traceback.extract_tb(tb) if f.filename == sol_path]

    def case(line, ok, exc=None, parts=None, test=None):  # one test case ends: report it with its coverage
        if ok:
            counts["passed"] += 1
        else:
            counts["failed"] += 1
        rec = {"test": test or state["test"], "line": line, "ok": bool(ok), "covered": sorted(state["lines"]),
               "call": state["call"], "returned": state["returned"]}
        if exc is not None:
            rec.update(error=f"{type(exc).__name__}: {exc}"[:300], where=solution_lines(exc.__traceback__))
        elif not ok and parts is not None:
            rec.update(actual=show(parts[0], 200), op=parts[1], expected=show(parts[2], 200)) if len(parts) == 3 \
                else rec.update(value=show(parts[0], 200))
        emit("case", rec)
        state.update(lines=set(), call=None, returned=None, cases=state["cases"] + 1)
        if state["cases"] >= cfg["max_cases"]:
            raise Stop

    class Stop(BaseException):
        pass

    # 3. asserts: explained like pytest's rewriting (assert 3 == 4); in trace mode, each one a test case that does
    #    not stop the test (asserts inside a try block keep their meaning)
    ops = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}

    def explain(*parts):
        return "assert " + (show(parts[0], 200) if len(parts) == 1 else
                            f"{show(parts[0], 200)} {parts[1]} {show(parts[2], 200)}")

    class Rewrite(ast.NodeTransformer):
        def visit_Try(self, node):
            return node  # an assert inside try/except may be expected to fail: leave the whole block alone

        visit_TryStar = visit_Try

        def visit_Assert(self, node):
            if node.msg is not None and not trace:
                return node
            var, t = (lambda n, ctx=ast.Load: ast.Name(f"_t2g_{n}", ctx())), node.test
            call = lambda f, *args: ast.Call(ast.Name(f, ast.Load()), list(args), [])
            if isinstance(t, ast.Compare) and len(t.ops) == 1:
                parts = [var("l"), ast.Constant(ops[type(t.ops[0])]), var("r")]
                body = [ast.Assign([var("l", ast.Store)], t.left), ast.Assign([var("r", ast.Store)], t.comparators[0])]
                cond = ast.Compare(var("l"), t.ops, [var("r")])
            else:
                parts, body, cond = [var("v")], [ast.Assign([var("v", ast.Store)], t)], var("v")
            if not trace:
                body.append(ast.Assert(cond, call("_t2g_explain", *parts)))
            else:  # try: <evaluate>; ok = not not cond / except Exception as e: case(e) / else: case(ok)
                ok = ast.UnaryOp(ast.Not(), ast.UnaryOp(ast.Not(), cond))
                body.append(ast.Assign([var("ok", ast.Store)], ok))
                line = ast.Constant(node.lineno)
                failed = ast.Expr(call("_t2g_case", line, ast.Constant(False), var("e")))
                passed = ast.Expr(call("_t2g_case", line, var("ok"), ast.Constant(None), ast.Tuple(parts, ast.Load())))
                body = [ast.Try(body, [ast.ExceptHandler(ast.Name("Exception", ast.Load()), "_t2g_e", [failed])],
                                [passed], [])]
            return [ast.copy_location(s, node) for s in body]

    def report(tag, name, exc):
        print(f"{tag} test_solution.py::{name}")
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # hide the runner's own frames
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb, file=sys.stdout)

    def fail_test(name, exc):  # a test (or the collection) raised outside any assert
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == test_path]
        if trace and not isinstance(exc, Stop):
            state["test"] = name
            case(frames[-1].lineno if frames else 0, False, exc)
        else:
            counts["failed"] += 1
        report("FAILED" if name != "collection" else "ERROR", name, exc)

    def run(name, fn):  # one test function: True if the run goes on
        state.update(test=name, lines=set(), call=None, returned=None)
        try:
            fn()
        except Stop:
            return False
        except BaseException as e:  # SystemExit and KeyboardInterrupt raised by the code count as failures too
            try:
                fail_test(name, e)
            except Stop:
                return False
            return trace
        if not trace:
            counts["passed"] += 1
        return True

    helpers = {"_t2g_explain": explain, "_t2g_case": case}
    code = compile(ast.fix_missing_locations(Rewrite().visit(tree)), test_path, "exec")
    if trace:
        settrace(on_call)

    if style == "pytest-real":
        import pytest

        class Plugin:
            def pytest_runtest_logreport(self, report):  # in trace mode, the cases count instead
                if not trace and report.when == "call" and report.passed:
                    counts["passed"] += 1
                elif not trace and report.failed:
                    counts["failed"] += 1

            def pytest_collectreport(self, report):
                if report.failed:
                    counts["failed"] += 1

            if trace:
                @pytest.hookimpl(hookwrapper=True)
                def pytest_runtest_call(self, item):
                    state.update(test=item.name, lines=set(), call=None, returned=None)
                    outcome = yield
                    exc = outcome.excinfo[1] if outcome.excinfo else None
                    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == test_path] \
                        if exc else []
                    case(frames[-1].lineno if frames else 0, exc is None, exc)

        args = ["-q", "--tb=native", "-p", "no:cacheprovider"] + ([] if trace else ["-x"]) + ["test_solution.py"]
        try:
            pytest.main(args, plugins=[Plugin()])
        except Stop:
            pass
        settrace(None)
        finish()

    if style == "script":  # the solution is module "solution"; the tests then run in its namespace
        mod = types.ModuleType("solution")
        mod.__file__ = sol_path
        sys.modules["solution"] = mod
        state["test"] = "check"
        try:
            exec(compile(open(sol_path, encoding="utf-8").read(), sol_path, "exec"), mod.__dict__)
        except BaseException as e:
            fail_test("collection", e)
            settrace(None)
            finish()
        mod.__dict__.update(helpers)
        run("check", lambda: exec(code, mod.__dict__))
        settrace(None)
        finish()

    mod = types.ModuleType("test_solution")  # style "pytest": collect test_* functions and Test* classes
    mod.__file__, sys.modules["test_solution"] = test_path, mod
    mod.__dict__.update(helpers)
    try:
        exec(code, mod.__dict__)
    except BaseException as e:
        fail_test("collection", e)
        settrace(None)
        finish()
    tests = []
    for name, obj in list(vars(mod).items()):
        if name.startswith("test") and isinstance(obj, types.FunctionType):
            tests.append((name, obj))
        elif name.startswith("Test") and isinstance(obj, type):
            tests += [(f"{name}::{m}", lambda c=obj, m=m: getattr(c(), m)()) for m, f in vars(obj).items()
                      if m.startswith("test") and callable(f)]
    for name, fn in tests:
        if not run(name, fn):
            break
    settrace(None)
    finish()


main()
"""


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)', re.M)
_PYTEST_HOOKS = {"setup", "teardown", "setup_module", "teardown_module", "setup_function", "teardown_function",
                 "setup_method", "teardown_method", "setup_class", "teardown_class", "__init__"}


def _plain_tests(test: str) -> bool:
    """True when `test` needs nothing from pytest but collection: no pytest/unittest import, fixtures, marks, hooks."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return False  # let pytest report it
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n.split(".")[0] in ("pytest", "_pytest", "unittest", "hypothesis") for n in names):
            return False

    def plain(fn, n_args: int) -> bool:
        return fn.name not in _PYTEST_HOOKS and not (fn.name.startswith("test") and (
            isinstance(fn, ast.AsyncFunctionDef) or fn.decorator_list or len(fn.args.args) != n_args or
            fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.posonlyargs))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not plain(node, 0):
            return False
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test") and (
                node.bases or node.keywords or node.decorator_list or not all(
                    plain(f, 1) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))):
            return False
    return True


def _reopen(f, flags: int) -> int:
    """A second descriptor on an open file, with other access rights (through /proc on Linux; else a duplicate)."""
    try:
        return os.open(f"/proc/self/fd/{f.fileno()}", flags | os.O_CLOEXEC)
    except OSError:
        return os.dup(f.fileno())


def run_tests_sandboxed(solution: str, test, timeout_s: float = 10.0, memory_mb: int = 1024,
                        trace: bool = False, max_cases: int = 500) -> dict:
    """Run `test` against `solution` in the sandbox. `test` is a pytest-style file that imports from `solution`
    (KodCode), or a benchmark test {"script": code run in the solution's namespace, "entry_point"?} (HumanEval, MBPP).
    Returns run_sandboxed's dict plus "status" ("passed" | "failed" | "timeout" | "error": the tests themselves cannot
    run), "passed", "counts" {"passed", "failed", "errors"} (None without a verdict), "problem_error", "output" (the test
    report) and, with trace=True, "cases" (per test case: ok, covered solution lines, call, values; see above)."""
    import secrets
    import sys
    if isinstance(test, dict):
        style, test_src = "script", test["script"]
    else:
        style, test_src = ("pytest" if _plain_tests(test) else "pytest-real"), test
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryFile() as settings, tempfile.TemporaryFile() as verdict:  # unnamed files: no path to open
        theirs = [_reopen(settings, os.O_RDONLY), _reopen(verdict, os.O_WRONLY | os.O_APPEND)]  # the runner's ends:
        try:  # it can neither rewrite its settings nor read the nonce back from what it reported
            settings.write(json.dumps({"nonce": nonce, "result_fd": theirs[1], "style": style, "trace": trace,
                                       "test": test_src, "max_cases": max_cases,
                                       "entry_point": test.get("entry_point") if isinstance(test, dict) else None}
                                      ).encode())
            settings.flush()
            result = run_sandboxed({"solution.py": solution, "test_solution.py": test_src},
                                   [sys.executable, "-c", _TEST_RUNNER, str(theirs[0])], timeout_s=timeout_s,
                                   memory_mb=memory_mb, pass_fds=tuple(theirs))
        finally:
            for fd in theirs:
                os.close(fd)
        verdict.seek(0)
        events = []
        for line in verdict.read().decode("utf-8", "replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("nonce") == nonce:  # anything else was written by the code
                events.append(event)
    summary = next((e["summary"] for e in events if "summary" in e), None)
    problem = next((e["problem_error"] for e in events if "problem_error" in e), None)
    result["passed"] = bool(summary and summary["passed"] > 0 and not summary["failed"] and not summary["errors"])
    result["status"] = ("error" if problem else "passed" if result["passed"] else
                        "timeout" if result["timed_out"] else "failed")
    result.update(counts=summary, problem_error=problem, output=_own_frames(result["stdout"] + "\n" +
                                                                            result["stderr"]).strip())
    if trace:
        result["cases"] = [e["case"] for e in events if "case" in e]
    return result


def _own_frames(report: str) -> str:
    """A test report without the traceback frames of pytest, pluggy or the runner: only the two files' frames."""
    out, skipping = [], None
    for line in report.splitlines():
        indent = len(line) - len(line.lstrip())
        if skipping is not None and line.strip() and indent > skipping:
            continue  # the source and caret lines under a dropped frame
        m = _FRAME.match(line)
        skipping = indent if m and m.group(1) not in ("solution.py", "test_solution.py") else None
        if skipping is None:
            out.append(line)
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------------
# 9. Code task: benchmark layouts, completion post-processing and pass@k (01 annotates, 03 trains on, 04 evaluates)
# ----------------------------------------------------------------------------------------------------------------------

# Every layout becomes {"id", "prompt", "test", "reference"}, where `test` is what run_tests_sandboxed runs:
#   KodCode    question, solution, test: test = the pytest file, which imports from `solution` (the contract's layout).
#              03's prompt files may say `prompt` instead of `question`.
#   HumanEval  task_id, prompt, canonical_solution, test, entry_point: the completion continues the prompt, and the
#              test's check(candidate) is called with the entry point, all in one namespace as the official harness
#              does: test = {"prefix": prompt, "script": test + "check(<entry_point>)", "entry_point", "stop"}.
#   MBPP       text or prompt, code, test_list, test_setup_code, test_imports: the completion is the whole program;
#              test = {"prefix": "", "script": imports + setup + the asserts, "stop"}. A bare description (original
#              MBPP's `text`, sanitized MBPP's `prompt`) becomes the usual prompt, as MBPP+ ships it: a docstring
#              holding the description and the first test, which names the function to write.
#   EvalPlus   HumanEval+ / MBPP+ as published on the hub (evalplus/humanevalplus, evalplus/mbppplus): the same
#              layouts, their extra tests inside `test`, which then runs instead of MBPP's test_list. The raw release
#              files' base_input / plus_input / atol / contract fields are not read: their expected outputs come from
#              running the canonical solution, which the hub files' test code already embeds.
# The layout is told by its fields (entry_point: HumanEval; test_list: MBPP; else KodCode); every record must then
# have that layout's fields, or DataError names the file, line and field.

HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")  # the Codex paper's stop sequences


MBPP_STOP = ("\nassert ", '\n"""', "\nprint(", "\nif __name__", "\n```")  # what follows a program in MBPP prompts
_REFERENCE = {"kodcode": "solution", "humaneval": "canonical_solution", "mbpp": "code"}


def code_layout(rec: dict) -> str:
    return "humaneval" if "entry_point" in rec else "mbpp" if "test_list" in rec else "kodcode"


def code_problem(rec: dict, where: str, layout: str | None = None, need_reference: bool = False,
                 prompt_field: str | None = None, test_field: str | None = None) -> dict:
    """One benchmark record -> {"id"?, "prompt", "test", "reference"} (see above); DataError('where: ...') if a field
    is missing or has the wrong type. need_reference: the reference solution must be there (01 critiques it)."""
    layout = layout or code_layout(rec)

    def get(name, kind=str, required=True):
        if name not in rec or rec[name] is None:
            if required:
                raise DataError(f"{where}: missing field '{name}' ({layout} layout)")
            return kind()
        if not isinstance(rec[name], kind) or (kind is list and not all(isinstance(x, str) for x in rec[name])):
            raise DataError(f"{where}: field '{name}' must be {'a list of strings' if kind is list else 'a string'}")
        return rec[name]
    ref = get(_REFERENCE[layout], required=need_reference) or None
    if layout == "humaneval":
        prompt, entry = get("prompt"), get("entry_point")
        test = {"prefix": prompt, "script": f"{get('test')}\n\ncheck({entry})\n", "entry_point": entry,
                "stop": list(HUMANEVAL_STOP)}
    elif layout == "mbpp":
        tests = get("test_list", list)
        prompt = rec["prompt"] if isinstance(rec.get("prompt"), str) else get("text")
        if "assert" not in prompt:  # a bare description (MBPP's text, sanitized MBPP's prompt) names no function
            prompt = f'"""\n{prompt}\n{tests[0] if tests else ""}\n"""\n'
        plus = get("test", required=False)  # MBPP+: the extra tests, as one script
        script = "\n".join(get("test_imports", list, False) + [get("test_setup_code", required=False)] +
                           ([plus] if plus.strip() else tests))
        test = {"prefix": "", "script": script.strip() + "\n", "stop": list(MBPP_STOP)}
    else:
        name = prompt_field or ("question" if "question" in rec or "prompt" not in rec else "prompt")
        prompt, test = get(name), get(test_field or "test")
    out = {"prompt": prompt, "test": test, "reference": ref}
    rid = rec.get("task_id", rec.get("question_id", rec.get("id")))
    return {"id": str(rid), **out} if rid is not None else out


def read_code_problems(data: str, split: str = "test", limit: int | None = None, **fields) -> list[dict]:
    """Code problems from a .jsonl / .jsonl.gz / .json / .parquet file or a hub dataset id, in any layout above.
    Records without an id get their index."""
    rows = read_rows(data, split)
    rows = rows[:limit] if limit is not None else rows
    if not rows:
        raise DataError(f"{data}: no records (empty split)")
    layout, seen, problems = code_layout(rows[0][1]), set(), []
    for i, (where, row) in enumerate(rows):
        prob = code_problem(row, where, layout, **fields)
        prob["id"] = prob.get("id", str(i))
        if prob["id"] in seen:
            raise DataError(f"{where}: duplicate id {prob['id']!r}")
        seen.add(prob["id"])
        problems.append(prob)
    return problems


def _fenced(response: str):
    """(code, offset) of the first fenced Python (or untagged) block of `response`, or None."""
    for m in re.finditer(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", response, re.S):
        if m.group(1).lower() in ("", "python", "py", "python3"):
            return m.group(2), m.start(2)
    return None


def extract_code(response: str, test=None) -> tuple[str, int]:
    """(code, offset in `response`) of a completion, post-processed the way the benchmarks' users expect: a chat
    model's first fenced Python block; else, for a benchmark test with stop sequences (a base model continuing the
    prompt), the text before the first stop sequence; else the whole response."""
    fenced = _fenced(response)
    if fenced:
        return fenced
    stops = test.get("stop", ()) if isinstance(test, dict) else ()
    cut = min([i for i in (response.find(s) for s in stops) if i >= 0], default=len(response))
    return response[:cut], 0


def build_program(test, code: str) -> tuple[str, int]:
    """(program, where `code` starts in it): the benchmark's prefix (HumanEval's prompt) followed by the code."""
    prefix = test.get("prefix", "") if isinstance(test, dict) else ""
    if prefix and not prefix.endswith("\n") and not code.startswith((" ", "\t", "\n")):
        prefix += "\n"  # a complete function after the prompt; a continuation goes straight on, as the harness does
    return prefix + code, len(prefix)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k), from n samples with c correct."""
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def _run_one_test(item: dict, timeout_s: float) -> dict:
    """{"id", "response", "test"} -> {"id", "passed", "status", "timed_out", "raw", "program", "output"}: the raw
    completion, the program that ran (post-processed, after the benchmark's prompt) and its verdict."""
    res = run_completion(item["response"], item["test"], timeout_s=timeout_s)
    return {"id": item["id"], "passed": bool(res["passed"]), "status": res["status"], "timed_out": res["timed_out"],
            "raw": item["response"], "program": res["program"], "output": res["output"][-1000:]}


def run_tests(items: list[dict], timeout_s: float, workers: int) -> list[dict]:
    """04's test runs: each {"id", "response", "test"} through run_completion, `workers` at a time. Processes, not
    threads: the sandbox's ast.parse is not thread-safe on CPython 3.11 ("AST constructor recursion depth mismatch")."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(functools.partial(_run_one_test, timeout_s=timeout_s), items))


# ----------------------------------------------------------------------------------------------------------------------
# 9. The code task's programmatic critic (01 --annotator program, 03 --critic program): run the tests, name what
# failed with its input, expected and actual value, and quote the lines that are most likely wrong
# ----------------------------------------------------------------------------------------------------------------------


# Where the bug is: a second, traced run makes every assert its own test case and records the solution lines each one
# executes. Spectrum-based fault localisation ranks a line by Ochiai's suspiciousness, failed(line) /
# sqrt(failed_total * executed(line)): a line run by every failing case and few passing ones is most suspicious.
# Ties (straight-line code runs every line in every case) are broken by what the failure shows: the line that raised,
# then lines that decide (a comparison, a condition) or produce the result (a return).

def run_completion(response: str, test, timeout_s: float = 10.0, trace: bool = False) -> dict:
    """A model's raw completion against a problem's tests, post-processed (extract_code) and joined to the benchmark's
    prefix (build_program): what 04 scores and the critic judges. run_tests_sandboxed's dict plus "program"."""
    program = build_program(test, extract_code(response, test)[0])[0]
    return {**run_tests_sandboxed(program, test, timeout_s=timeout_s, trace=trace), "program": program}


def _test_failure(output: str) -> dict:
    """The last failure in a test report: {"test", "error", "frames": [(file name, line, function)] oldest first}."""
    tb, dump = output.rfind("Traceback (most recent call last):"), output.rfind("(most recent call first):")
    frames, error = [], ""
    if dump > tb:  # a faulthandler stack dump lists the innermost call first
        frames = _FRAME.findall(output[dump:].split("\n\n")[0])[::-1]
    elif tb >= 0:
        block = output[tb:].splitlines()[1:]
        frames = _FRAME.findall("\n".join(block))
        tail = [ln for ln in block if ln.strip() and not ln.startswith(" ")]  # the exception line is not indented
        if tail:
            i = block.index(tail[0])
            explained = [tail[0]] + [ln for ln in block[i + 1:i + 3] if ln.startswith(" +")]  # pytest's "+ where"
            error = re.sub(r"\s+", " ", " ".join(explained))[:300]
    m = re.search(r"(?:FAILED|ERROR) test_solution\.py::(\S+)", output)
    test = m.group(1) if m else next((fn for f, _, fn in frames[::-1] if f.endswith("test_solution.py")), "")
    return {"test": test.split("[")[0], "error": error,
            "frames": [(os.path.basename(f), int(n), fn) for f, n, fn in frames]}


def _line_ranges(node) -> list[tuple[int, int]]:
    """The (first, last) line ranges that produce a function's result: its returns, else its last statement."""
    returns, stack = [], list(node.body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Return):
            returns.append((n.lineno, n.end_lineno))
        elif not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(n))
    return sorted(returns) or [(node.body[-1].lineno, node.body[-1].end_lineno)]


def _response_lines(program: str, start: int, offset: int) -> dict[int, tuple[str, int, int]]:
    """Program line -> (stripped text, start, end) in the response, for the lines the response wrote (not the prefix)."""
    units, pos = {}, 0
    for i, line in enumerate(program.splitlines(keepends=True), 1):
        a, b = max(pos, start), pos + len(line.rstrip("\r\n"))
        body = program[a:b] if b > a else ""
        if body.strip():
            lead = len(body) - len(body.lstrip())
            units[i] = (body.strip(), offset + a - start + lead, offset + a - start + lead + len(body.strip()))
        pos += len(line)
    return units


def _quote_lines(response: str, units: dict, good: list, poor: list) -> tuple[list[str], list[str]]:
    """Exact, unambiguous quotes of `response` for (first, last) program line ranges; poor wins over good, 3 each."""
    def intervals(ranges):
        out = []
        for a, b in ranges:
            lines = [units[n] for n in range(a, b + 1) if n in units]
            if lines and (lines[0][1], lines[-1][2]) not in out:
                out.append((lines[0][1], lines[-1][2]))
        return out
    poor_iv = intervals(poor)[:3]
    good_iv = [iv for iv in intervals(good) if not any(a < iv[1] and iv[0] < b for a, b in poor_iv)][:3]
    return _unambiguous_quotes(response, good_iv, poor_iv, sorted(units.values(), key=lambda u: u[1]))


def _suspicious_lines(cases: list[dict], tree, quotable, limit: int = 2) -> list[int]:
    """Up to `limit` quotable lines that are most suspicious by Ochiai over the test cases' line coverage, raising a
    failing case's exception counting as extra evidence; ties go to deciding or result-producing lines, then the first.
    Only the top group is returned: a line ranked below it would more likely be a correct line blamed."""
    import math
    failing = [c for c in cases if not c["ok"]]
    ef, ep = {}, {}
    for c in cases:
        for line in c["covered"]:
            (ep if c["ok"] else ef)[line] = (ep if c["ok"] else ef).get(line, 0) + 1
    raised = {c["where"][-1] for c in failing if c.get("where")}
    rank = {n: (round(ef[n] / math.sqrt(len(failing) * (ef[n] + ep.get(n, 0))), 9), n in raised)
            for n in ef if n in quotable}
    deciding = {node.lineno for node in ast.walk(tree)
                if isinstance(node, (ast.If, ast.While, ast.Return, ast.Compare, ast.IfExp, ast.Assert))}
    top = max(rank.values(), default=None)
    return sorted((n for n in rank if rank[n] == top), key=lambda n: (n not in deciding, n))[:limit]


def _case_story(case: dict, show) -> str:
    """What went wrong in one failing test case: the input, what came back and what was expected (or what raised)."""
    call = f"`{case['call']}`" if case.get("call") else "the code"
    if case.get("error"):
        return f"{call} raises {case['error']}" + (f" at {show(case['where'][-1])}" if case.get("where") else "")
    if "expected" in case:
        story = f"it gives assert {case['actual']} {case['op']} {case['expected']}"
        if case.get("call") and case["op"] == "==" and case.get("returned") == case["actual"]:
            return story + f": {call} returns {case['returned']}, expected {case['expected']}"
        return story + (f" ({call} returns {case['returned']})" if case.get("returned") else "")
    return f"{call} returns {case['returned']}" if case.get("returned") else "the assert does not hold"


def code_critic(prompt: str, response: str, test, timeout_s: float = 10.0) -> dict:
    """The code task's programmatic critic: {"critique", "good_spans", "poor_spans", "passed", "status"}, quotes exact
    in `response`; "error" too when the tests themselves cannot run (then no spans: nothing to blame the code for).

    Runs `test` (a KodCode pytest file or a benchmark test, see code_problem) against the completion in the sandbox.
    When tests fail, a traced run localises the fault (above): the critique names the failing assert, its input, the
    expected and the actual value (or the exception) and how many test cases fail; poor spans quote the most suspicious
    lines, or the line a hung test is stuck on, or the line that does not compile. When every test passes, good spans
    quote the tested functions' result lines. `prompt` is unused: the tests are the specification.
    """
    code, offset = extract_code(response, test)
    if not code.strip():
        return {"critique": "The response contains no code to test.", "good_spans": [], "poor_spans": [],
                "passed": False, "status": "failed"}
    program, start = build_program(test, code)
    units = _response_lines(program, start, offset)
    src, test_src = program.splitlines(), test["script"] if isinstance(test, dict) else test
    line0 = program[:start].count("\n") + 1  # of the response's code; lines before it are the benchmark's prompt

    def show(n: int) -> str:
        text = f" `{src[n - 1].strip()}`" if 0 < n <= len(src) else ""
        return f"line {n - line0 + 1}{text}" if n >= line0 else f"the prompt's{text}"

    verdict = lambda critique, good=(), poor=(), status="failed": {  # noqa: E731
        "critique": critique, **dict(zip(("good_spans", "poor_spans"), _quote_lines(response, units, good, poor))),
        "passed": status == "passed", "status": status}
    try:
        tree = ast.parse(program)
    except SyntaxError as e:
        return verdict(f"The code does not compile: {e.msg} at {show(e.lineno or 1)}.", poor=[(e.lineno or 1,) * 2])
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor))]

    def called(text: str) -> list[str]:  # functions of the solution that a line of test code calls
        return [n for n in dict.fromkeys(re.findall(r"(\w+)\s*\(", text)) if n in defs]

    def loop_of(line: int) -> list[tuple[int, int]]:  # the innermost loop around a line: its header
        around = [n for n in loops if n.lineno <= line <= n.end_lineno]
        return [(max(around, key=lambda n: n.lineno).lineno,) * 2] if around else []

    result = run_completion(response, test, timeout_s)
    if result["status"] == "error":
        return {**verdict(f"The tests cannot run: {result['problem_error']}."), "status": "error",
                "error": result["problem_error"]}
    if result["passed"]:
        tested = ([test["entry_point"]] if isinstance(test, dict) and test.get("entry_point") in defs else
                  called(test_src)) or list(defs)[:3]
        n = result["counts"]["passed"] if not isinstance(test, dict) else None
        critique = f"All {f'{n} ' if n else ''}unit tests pass" + (
            f": {', '.join(f'`{t}`' for t in tested[:3])} return{'s' * (len(tested) == 1)} the expected results."
            if tested else ".")
        return verdict(critique, good=[r for t in tested[:3] for r in _line_ranges(defs[t])], status="passed")
    fail = _test_failure(result["output"])
    where = [n for f, n, _ in fail["frames"] if f == "solution.py"]  # solution lines on the stack, innermost last
    name = f"`{fail['test']}`" if fail["test"] and fail["test"] != "collection" else "Importing the code"
    if result["timed_out"]:
        critique = f"The tests did not finish within {timeout_s:g} s" + (
            f": {name} never gets past {show(where[-1])}, an endless or far too slow loop." if where else ".")
        return verdict(critique, poor=(loop_of(where[-1]) + [(where[-1],) * 2]) if where else [], status="timeout")
    if "MemoryError" in fail["error"] or "MemoryError" in result["output"][-500:]:
        critique = f"{name} runs out of memory" + (f" at {show(where[-1])}" if where else "") + \
            ": the code allocates without bound."
        return verdict(critique, poor=(loop_of(where[-1]) + [(where[-1],) * 2]) if where else [])
    cases = run_completion(response, test, timeout_s, trace=True).get("cases", [])
    failing = [c for c in cases if not c["ok"]]
    if failing:  # the traced run: every assert a case, the fault localised over their coverage
        first, tests = failing[0], test_src.splitlines()
        at = f" at `{tests[first['line'] - 1].strip()}`" if 0 < first["line"] <= len(tests) else ""
        count = f" {len(failing)} of {len(cases)} test cases fail." if len(cases) > 1 else ""
        poor = _suspicious_lines(cases, tree, units)
        if not poor and first.get("error", "").startswith("TypeError") and first.get("call") is None:
            entry = [test["entry_point"]] if isinstance(test, dict) and test.get("entry_point") in defs else []
            funcs = entry + called(tests[first["line"] - 1] if 0 < first["line"] <= len(tests) else "")
            poor = [defs[funcs[0]].lineno] if funcs else []  # the call never entered the function: its signature
        blame = f" The most suspicious line is {show(poor[0])}." if poor else ""
        return verdict(f"`{first['test']}` fails{at}: {_case_story(first, show)}.{count}{blame}",
                       poor=[(n, n) for n in poor])
    if where:  # no traced case (e.g. the import itself fails): fall back on the report's traceback
        return verdict(f"{name} fails: the code raises {fail['error'] or 'an error'} at {show(where[-1])}.",
                       poor=[(where[-1],) * 2])
    tail = result["output"].strip().splitlines()[-1:]
    critique = (f"{name} fails with {fail['error']}." if fail["error"] else
                f"The tests did not run to completion: the process ended (exit code {result['returncode']}) before "
                "the test runner reported" + (f"; its last output: {tail[0][:200]}" if tail else "."))
    return verdict(critique)


# ----------------------------------------------------------------------------------------------------------------------
# 10. The demo world: summarise a short synthetic post; a rule-based critic writes critique + spans
# ----------------------------------------------------------------------------------------------------------------------

# A post states 6 facts about a pet and 1-2 irrelevant ones; the ideal summary is one sentence:
#   "<owner> has a <color> <animal> called <pet_name> that likes the <place> and eats <food>."
# Each fact follows the same words in the post as in the summary ("called rex", "likes the park"), so a 1M-parameter
# model learns to copy them in a few hundred steps (an induction-head skill); a paraphrasing summary takes far longer.
# The critic praises correct facts, and faults wrong facts, irrelevant details and repetitions, quoting each exactly.

DEMO_FACTS = {
    "owner": "tom anna ben lily sam zoe jack emma noah ava liam ella owen ruby finn nora".split(),
    "color": "red blue green black white brown grey yellow".split(),
    "animal": "dog cat horse rabbit parrot turtle goat hamster duck pony".split(),
    "pet_name": "rex bella milo coco luna otto pip ziggy bruno daisy".split(),
    "place": "park beach garden river forest field lake barn".split(),
    "food": "fish apples carrots seeds bread rice corn berries".split(),
}


DEMO_DISTRACTORS = {
    "day": "monday tuesday wednesday thursday friday saturday sunday".split(),
    "thing": "hat kite lamp drum bell cup".split(),
    "adj": "old new loud broken shiny".split(),
}
DEMO_SUMMARY = "{owner} has a {color} {animal} called {pet_name} that likes the {place} and eats {food}."
_FACT_PATTERNS = [r"(?P<owner>\w+) has an? (?P<color>\w+) (?P<animal>\w+) called (?P<pet_name>\w+)\.",
                  r"likes the (?P<place>\w+)\.", r"eats (?P<food>\w+)\."]
_CATEGORY = {w: cat for cat, words in DEMO_FACTS.items() for w in words}


def demo_post_facts(prompt: str) -> tuple[dict, set]:
    """(facts by category, irrelevant words) read off a demo post. Raises ValueError if it is not one."""
    post = prompt.split("post:", 1)[-1].split("summary:", 1)[0]
    facts = {}
    for pattern in _FACT_PATTERNS:
        m = re.search(pattern, post)
        if not m:
            raise ValueError(f"not a demo post (no match for {pattern!r}): {prompt[:60]!r}")
        facts.update(m.groupdict())
    fact_words = set(facts.values())
    irrelevant = {w for w in re.findall(r"\w+", post) if w not in fact_words and
                  (w in _CATEGORY or any(w in v for v in DEMO_DISTRACTORS.values()))}
    return facts, irrelevant


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def demo_labels(prompt: str, response: str) -> list[tuple[str, int, int, str | None]]:
    """The demo critic's verdict on each word of `response`: (word, start, end, kind), kind "good" (a fact of the
    post, first time), "wrong" (another value of a fact's kind), "irrelevant" (from the post's asides), "repeated" (a
    fact again, or the second copy of an immediately repeated 1-3 word phrase) or None (a connective)."""
    facts, irrelevant = demo_post_facts(prompt)
    # Quotes keep a word's leading space (" red dog"): still exact, and a small model copies the response's own tokens
    # ("Ġred") into the JSON instead of having to map them to the space-less tokens that '["red' would need.
    words = [(m.group(), m.start() - (response[m.start() - 1:m.start()] == " "), m.end())
             for m in re.finditer(r"\w+", response)]
    seq = [w for w, _, _ in words]
    repeated = [False] * len(seq)  # the second copy of an immediately repeated 1-3 word phrase
    for i in range(len(seq)):
        for n in (3, 2, 1):
            if i >= n and seq[i - n:i] == seq[i:i + n]:
                repeated[i:i + n] = [True] * n
    kinds, seen = [], set()
    for i, w in enumerate(seq):
        cat = _CATEGORY.get(w)
        if w in irrelevant:
            kinds.append("irrelevant")
        elif cat and facts[cat] != w:
            kinds.append("wrong")
        elif repeated[i] or (cat and cat in seen):
            kinds.append("repeated")
        elif cat:
            kinds.append("good")
            seen.add(cat)
        else:
            kinds.append(None)
    return [(w, a, b, kind) for (w, a, b), kind in zip(words, kinds)]


def demo_critic(prompt: str, response: str) -> dict:
    """The demo task's programmatic critic: {"critique", "good_spans", "poor_spans"}, quotes exact in `response`."""
    facts, _ = demo_post_facts(prompt)
    labelled = demo_labels(prompt, response)
    words = [(w, a, b) for w, a, b, _ in labelled]
    labels = [None if kind is None else "good" if kind == "good" else "poor" for *_, kind in labelled]
    seen = {_CATEGORY[w] for w, *_, kind in labelled if kind == "good"}
    notes = []
    for w, _, _, kind in labelled:
        note = {"irrelevant": f"It adds {w}, which is irrelevant.", "repeated": f"It repeats {w}.",
                "wrong": f"It says {w} where the post says {facts.get(_CATEGORY.get(w))}."}.get(kind)
        if note and note not in notes:
            notes.append(note)
    # Spans: runs of adjacent same-polarity words ("red dog"). Bridging over an unlabelled word ("called") would pay
    # a policy for deleting connectives so that more words fall inside a run: PPO found exactly that.
    spans = {"good": [], "poor": []}
    for i, lab in enumerate(labels):
        if lab is None:
            continue
        run = spans[lab]
        if run and run[-1][1] == i - 1 and labels[i - 1] == lab:
            run[-1][1] = i
        else:
            run.append([i, i])
    intervals = {k: [(words[a][1], words[b][2]) for a, b in v] for k, v in spans.items()}
    good, poor = _unambiguous_quotes(response, intervals["good"], intervals["poor"], words)
    right = [w for (w, _, _), lab in zip(words, labels) if lab == "good"]
    missing = [cat.replace("_", " ") for cat in DEMO_FACTS if cat not in seen]
    parts = ([f"It gets {_join(right)} right."] if right else ["It states none of the post's facts."]) + notes
    if missing and right:
        parts.append(f"It leaves out the {_join(missing)}.")
    return {"critique": " ".join(parts), "good_spans": good, "poor_spans": poor}


def demo_delta(prompt: str, response: str, offsets) -> tuple[dict, list[float]]:
    """The demo's ground truth on a response: the demo critic's feedback and its per-token delta (span_rewards). 03
    logs it next to the learned critic's (a reward-hacking monitor); 04 scores policies with it."""
    fb = demo_critic(prompt, response)
    return fb, span_rewards(response, offsets, fb["good_spans"], fb["poor_spans"])[0]


def demo_monitor(records: list[dict], texts: list[str], offsets: list, deltas=None):
    """03's reward-hacking monitor: the demo's exact critic on the same rollouts (logged, never trained on), as a
    tensor [its summed delta, the number of responses with a mistake]. deltas: span_rewards' (delta, unmatched) per
    rollout when the critic of step 2 was this very one (--critic program), reused."""
    import torch
    exact = torch.zeros(2)
    for i, (rec, text, offs) in enumerate(zip(records, texts, offsets)):
        d = deltas[i][0] if deltas is not None else demo_delta(rec["prompt"], text, offs)[1]
        exact += torch.tensor([sum(d), float(min(d, default=0.0) < 0)])
    return exact


def demo_scores(prompt: str, response: str, feedback: dict, delta: list[float], reference: str = "") -> dict:
    """04's per-sample (numerator, denominator) rows of the demo's ground truth (demo_delta's feedback and delta):
    delta-sum, a mistake (any poor span), the share of the post's facts stated, exact match with the reference."""
    facts, _ = demo_post_facts(prompt)
    words = set(re.findall(r"\w+", response))
    return {"demo/delta_sum": (sum(delta), 1), "demo/mistake_rate": (float(bool(feedback["poor_spans"])), 1),
            "demo/facts_right": (sum(v in words for v in facts.values()), len(facts)),
            "demo/exact_match": (float(response.strip() == reference.strip()), 1)}


def demo_rm_agreement(prompt: str, response: str, critic: dict, critic_delta: list, rm: dict, rm_delta: list) -> dict:
    """How a reward model's spans agree with the demo critic's on one response, as 04's per-sample (numerator,
    denominator) rows: token precision / recall of delta = -1 / +1 (paper Table 6), then demo_flagged's span rows."""
    rows = {}
    for label, cls in (("poor", -1.0), ("good", 1.0)):
        tp = sum(a == cls and b == cls for a, b in zip(rm_delta, critic_delta))
        rows[f"rm_vs_critic/{label}_precision"] = (tp, rm_delta.count(cls))
        rows[f"rm_vs_critic/{label}_recall"] = (tp, critic_delta.count(cls))
    return {**rows, **demo_flagged(prompt, response, critic, rm)}


def demo_flagged(prompt: str, response: str, critic: dict, rm: dict) -> dict:
    """(numerator, denominator) rows: the critic's poor spans (the real mistakes) the RM's poor spans flag or miss, in
    all and by kind (demo_labels: a wrong fact needs the post to be read, an irrelevant aside or a repeat shows in the
    response alone); RM poor spans overlapping no real mistake (invented: what a policy could be punished for, or learn
    to exploit). Quotes are located as stage 3 locates them, good first: a repeat's " fish" is the second " fish"."""
    true_poor = locate_spans(response, critic["good_spans"], critic["poor_spans"])[1]
    rm_poor = locate_spans(response, rm["good_spans"], rm["poor_spans"])[1]
    hits = lambda iv, ivs: any(a < iv[1] and iv[0] < b for a, b in ivs)  # noqa: E731
    flagged = [hits(iv, rm_poor) for iv in true_poor]
    rows = {"rm_vs_critic/mistakes_flagged": (sum(flagged), len(true_poor)),
            "rm_vs_critic/mistakes_missed": (len(true_poor) - sum(flagged), len(true_poor))}
    labelled = demo_labels(prompt, response)
    for kind in ("wrong", "irrelevant", "repeated"):
        words = [(a, b) for _, a, b, k in labelled if k == kind]
        of_kind = [f for iv, f in zip(true_poor, flagged) if hits(iv, words)]
        rows[f"rm_vs_critic/flagged_{kind}"] = (sum(of_kind), len(of_kind))
    rows["rm_vs_critic/poor_invented"] = (sum(not hits(iv, true_poor) for iv in rm_poor), len(rm_poor))
    return rows


def _unambiguous_quotes(text, good_iv, poor_iv, words):
    """Quote strings that locate_spans resolves to exactly the intended intervals; a quote that would land on an
    earlier occurrence is widened by a word, right first, until it is unique (or dropped if it cannot be)."""
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


def make_demo_example(rng, mistake_rate: float = 0.55) -> dict:
    """One demo example: a post (prompt), its ideal summary (reference), and a noisy summary (response) with 0-2
    local mistakes (a wrong fact, an irrelevant detail, a repetition) at random positions."""
    facts = {cat: rng.choice(words) for cat, words in DEMO_FACTS.items()}
    other = rng.choice([n for n in DEMO_FACTS["owner"] if n != facts["owner"]])
    dis = {cat: rng.choice(words) for cat, words in DEMO_DISTRACTORS.items()}
    sentences = ["{owner} has a {color} {animal} called {pet_name}.", "the {animal} likes the {place}.", "it eats {food}."]
    asides = {"it rained on {day}.": "on {day}", "the {thing} was {adj}.": "and a {adj} {thing}",
              "{other} lost a {thing}.": "with {other}"}  # an irrelevant sentence -> the phrase a summary may borrow
    extra = rng.sample(list(asides), rng.randint(1, 2))
    for s in extra:
        sentences.insert(rng.randint(0, len(sentences)), s)
    prompt = "post: " + " ".join(s.format(**facts, **dis, other=other) for s in sentences) + "\nsummary:"
    reference = DEMO_SUMMARY.format(**facts)
    words = reference[:-1].split()
    for _ in range(rng.choice([1, 1, 2]) if rng.random() < mistake_rate else 0):
        kind, slots = rng.choice(["wrong", "irrelevant", "repeat"]), [i for i, w in enumerate(words) if w in _CATEGORY]
        if kind == "wrong" and slots:
            i = rng.choice(slots)
            words[i] = rng.choice([w for w in DEMO_FACTS[_CATEGORY[words[i]]] if w != words[i]])
        elif kind == "irrelevant":
            phrase = asides[rng.choice(extra)].format(**dis, other=other)
            words.insert(rng.choice([1, 5, 7, 11, len(words)]), phrase)  # after the owner, the pet, ...
        elif slots:
            i = rng.choice(slots)
            words.insert(i + 1, words[i])
    return {"prompt": prompt, "reference": reference, "response": " " + " ".join(words) + "."}


def demo_dataset(split: str, n: int, mistake_rate: float = 0.55) -> list[dict]:
    """`n` deterministic demo records of a named split ("pretrain", "annotate", "sft", "train", "eval"); a share
    `mistake_rate` of their responses has 1-2 mistakes."""
    import random
    rng = random.Random(f"text2grad-demo-{split}")
    return [{"id": f"demo-{split}-{i}", **make_demo_example(rng, mistake_rate)} for i in range(n)]


def build_demo_base(out_dir, pretrain_steps: int = 250, n_texts: int = 3000, seed: int = 0) -> str:
    """The demo's stand-in for a pretrained LLM: a tokenizer and a 2-layer, 0.6M-parameter Llama trained to continue
    demo posts with their correct summary (loss on the summary only). That gives it the skill a real LLM brings,
    copying facts from its context (an induction-head skill a model this small needs a few hundred focused steps for;
    plain LM loss over whole posts, or a 4-layer model, takes far longer). It never sees critiques or reward-model
    prompts (stage 2 teaches those) nor the noisy SFT targets (stage 3), only their words in the tokenizer corpus."""
    texts, pretrain = [], []
    for ex in demo_dataset("pretrain", n_texts):
        critique = " " + format_rm_target(**demo_critic(ex["prompt"], ex["response"]))
        pretrain.append((ex["prompt"], " " + ex["reference"]))
        texts += [ex["prompt"] + ex["response"], critique]
    texts += [rm_user_message("", "") + "\n\n### Critique\n"] * 100  # so the RM instruction's words are single tokens
    return build_tiny_base(out_dir, texts, num_layers=2, pretrain_texts=pretrain, pretrain_steps=pretrain_steps,
                           lr=2e-3, seed=seed)


# A tiny model built offline: byte-level BPE tokenizer + small Llama (tests and the demo's base model)
def build_tiny_base(out_dir, texts: list[str], vocab_size: int = 1000, hidden_size: int = 128, num_layers: int = 4,
                    num_heads: int = 4, intermediate_size: int = 512, chat_template: str | None = None,
                    pretrain_texts: list | None = None, pretrain_steps: int = 0, batch_size: int = 32,
                    lr: float = 1e-3, seed: int = 0) -> str:
    """Train a byte-level BPE tokenizer on `texts`, build a small Llama from a config, optionally pretrain it so it
    plays the role of a pretrained LLM, and save both to `out_dir` for from_pretrained. `pretrain_texts` (default
    `texts`) holds strings (loss on every token) or (context, continuation) pairs (loss on the continuation and EOS).
    Every word of a small regular corpus becomes one token (~600-700 in all)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        tok.chat_template = chat_template
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=1024, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    if pretrain_steps:
        from tqdm.auto import tqdm
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30))  # short warm-up
        examples = []  # (ids, index of the first token with a loss)
        for t in pretrain_texts or texts:
            context, cont = t if isinstance(t, tuple) else ("", t)
            ids = tok(context, add_special_tokens=False)["input_ids"] if context else []
            examples.append((ids + tok(cont, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], len(ids)))
        gen = torch.Generator().manual_seed(seed)
        for _ in tqdm(range(pretrain_steps), desc="pretrain tiny base", leave=False):
            batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=gen).tolist()]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            labels = ids.clone()
            for row, (seq, first) in enumerate(batch):
                labels[row, :first] = -100
                labels[row, len(seq):] = -100
            loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    model.generation_config.pad_token_id = tok.pad_token_id
    return str(save_pretrained(out_dir, model, tok))
