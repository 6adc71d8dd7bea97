"""How well common.find_span locates a critic's near-quotes, and whether it ever aligns one to the wrong text.

    python bench/span_matching/span_matching.py            # prints a table, then one JSON line

Quotes are cut at word boundaries from realistic responses (summaries, code, QA answers with curly quotes, dashes and
newlines), then altered the ways LLM critics alter them: unchanged, whitespace changed, case changed, wrapped in
quotes / ellipses / trailing punctuation, or paraphrased (a word swapped for a synonym, words reordered or dropped).
A paraphrase must stay unmatched. A false alignment is a match whose text says something else than the quote: for a
non-paraphrase, a matched interval whose normalized text differs from the source text; for a paraphrase, any match.
"""

import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import _normalize, find_span  # noqa: E402

RESPONSES = [
    "The author\u2019s landlord refused to return the $1,200 deposit, claiming the carpet was \u201cruined\u201d. "
    "She asks whether she should take him to small-claims court or let it go.",
    "TL;DR: my roommate keeps eating my food \u2014 labelled or not \u2014 and gets defensive when I bring it up.",
    "def median(xs):\n    xs = sorted(xs)\n    n = len(xs)\n    if n % 2:\n        return xs[n // 2]\n"
    "    return (xs[n // 2 - 1] + xs[n // 2]) / 2\n",
    "Photosynthesis converts light energy into chemical energy. Plants absorb CO2 and water, and release oxygen "
    "as a by-product; the glucose they make fuels growth.",
    "I (24F) have been dating my boyfriend (26M) for two years. He wants to move to Berlin for a job offer, "
    "but I'd have to leave my family and my PhD behind.",
    "To reverse a linked list, walk it once while re-pointing each node's `next` to the previous node:\n"
    "prev = None\nwhile head:\n    head.next, prev, head = prev, head, head.next\nreturn prev",
    "The French Revolution began in 1789. It abolished the monarchy, and \u2014 after years of turmoil \u2014 "
    "ended with Napoleon\u2019s rise to power in 1799.",
    "Poster's dog, a three-year-old beagle named Max, barks at night; neighbours complained twice, so OP is "
    "considering a trainer or a bark collar.",
    "SELECT name, COUNT(*) AS n FROM orders WHERE status = 'shipped' GROUP BY name HAVING n > 5 ORDER BY n DESC;",
    "Caf\u00e9 owners in M\u00fcnchen say the new rules are \u201cunworkable\u201d: terraces must close at 10 p.m., "
    "and fines start at \u20ac500.",
    "The summary is accurate but vague. It says the friend \u2018was upset\u2019 without saying why, and it omits "
    "that the wedding was cancelled.",
    "Use binary search: keep lo and hi, compare the middle element with the target, and halve the range each "
    "step. It runs in O(log n) time.",
]
SYNONYMS = {
    "refused": "declined",
    "return": "give back",
    "deposit": "down payment",
    "keeps": "continues",
    "eating": "consuming",
    "converts": "turns",
    "absorb": "take in",
    "release": "emit",
    "wants": "hopes",
    "move": "relocate",
    "walk": "traverse",
    "began": "started",
    "ended": "finished",
    "barks": "howls",
    "complained": "grumbled",
    "new": "recent",
    "close": "shut",
    "accurate": "correct",
    "vague": "unclear",
    "omits": "leaves out",
    "compare": "check",
    "halve": "split",
    "runs": "executes",
    "dog": "hound",
    "family": "relatives",
    "rules": "regulations",
    "fines": "penalties",
    "time": "duration",
    "sorted": "ordered",
    "node": "element",
    "rise": "ascent",
    "plants": "trees",
    "job": "position",
}


def make_cases(n_per_kind: int = 60, seed: int = 0):
    """(kind, response, quote, source_interval) near-quotes; paraphrases have source_interval None."""
    rng, cases = random.Random(seed), []
    words_of = [[(m.start(), m.end()) for m in re.finditer(r"\S+", r)] for r in RESPONSES]

    def cut(min_words=2, max_words=8, need=None):
        while True:
            k = rng.randrange(len(RESPONSES))
            ws = words_of[k]
            n = rng.randint(min_words, min(max_words, len(ws)))
            i = rng.randrange(len(ws) - n + 1)
            a, b = ws[i][0], ws[i + n - 1][1]
            text = RESPONSES[k][a:b]
            if need is None or need(text):
                return k, a, b, text

    for kind in ["exact", "whitespace", "case", "wrapped", "paraphrase"]:
        for _ in range(n_per_kind):
            while kind == "paraphrase":
                k, a, b, text = cut(need=lambda t: any(re.search(rf"\b{w}\b", t, re.I) for w in SYNONYMS))
                how = rng.choice(["synonym", "reorder", "drop"])
                toks = text.split()
                if how == "synonym":
                    w = next(w for w in SYNONYMS if re.search(rf"\b{w}\b", text, re.I))
                    quote = re.sub(rf"\b{w}\b", SYNONYMS[w], text, count=1, flags=re.I)
                elif how == "reorder" and len(set(toks)) > 1:
                    while (perm := rng.sample(toks, len(toks))) == toks:
                        pass
                    quote = " ".join(perm)
                else:
                    j = rng.randrange(1, len(toks)) if len(toks) > 2 else 1
                    quote = " ".join(toks[:j] + toks[j + 1 :]) if len(toks) > 2 else toks[0] + " indeed"
                if _normalize(quote)[0].strip() in _normalize(RESPONSES[k])[0]:
                    continue  # e.g. dropping a repeated word: still a literal quote, not a paraphrase
                cases.append((kind, RESPONSES[k], quote, None))
                break
            if kind == "paraphrase":
                continue
            k, a, b, text = cut()
            if kind == "whitespace":
                quote = re.sub(r"\s+", lambda m: rng.choice(["  ", " ", "\n", " \t "]), text)
                quote = rng.choice(["", " "]) + quote + rng.choice(["", " ", "\n"])
            elif kind == "case":
                quote = rng.choice([text.upper(), text.lower(), text.title(), text.swapcase()])
            elif kind == "wrapped":
                quote = rng.choice(
                    [
                        '"{}"',
                        "\u201c{}\u201d",
                        "'{}'",
                        "\u2018{}\u2019",
                        "...{}...",
                        "\u2026{}",
                        "{}.",
                        "{},",
                        '"{}."',
                        "`{}`",
                        '"...{}"',
                    ]
                ).format(text)
            else:
                quote = text
            cases.append((kind, RESPONSES[k], quote, (a, b)))
    return cases


def evaluate(cases):
    stats = {}
    for kind, response, quote, source in cases:
        s = stats.setdefault(kind, {"n": 0, "unmatched": 0, "false_alignments": 0})
        s["n"] += 1
        iv = find_span(response, quote)
        if iv is None:
            s["unmatched"] += kind != "paraphrase"
            continue
        if source is None:
            # a paraphrase may only match if it is literally (modulo case/space) present in the response
            s["false_alignments"] += _normalize(quote)[0].strip() not in _normalize(response)[0]
            continue
        found = _normalize(response[iv[0] : iv[1]])[0].strip(" .,;:!?\"'`")
        want = _normalize(response[source[0] : source[1]])[0].strip(" .,;:!?\"'`")
        s["false_alignments"] += found != want
    return stats


def main():
    cases = make_cases()
    stats = evaluate(cases)
    print(f"{'kind':<12}{'n':>5}{'unmatched':>11}{'false':>7}")
    for kind, s in stats.items():
        print(f"{kind:<12}{s['n']:>5}{s['unmatched']:>11}{s['false_alignments']:>7}")
    near = [s for k, s in stats.items() if k != "paraphrase"]
    n_near = sum(s["n"] for s in near)
    result = {
        "cases": len(cases),
        "near_quotes": n_near,
        "unmatched_rate_near": sum(s["unmatched"] for s in near) / n_near,
        "paraphrases": stats["paraphrase"]["n"],
        "paraphrases_matched": sum(1 for c in cases if c[0] == "paraphrase" and find_span(c[1], c[2])),
        "false_alignments": sum(s["false_alignments"] for s in stats.values()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
