"""Cost of common.decode_with_offsets on SmolLM2-135M-Instruct's tokenizer (a real 49k-token byte-level BPE), on text
mixing ASCII, accents, CJK and emoji. Goals (issue 13): time(2048 tokens) / time(1024) <= 2.5 (linear, not quadratic)
and time(1024) <= 20 x one tokenizer.decode of the same 1024 ids. Also shows the old per-prefix definition's time.

    python bench/speed/decode_offsets.py      # ~10 s once SmolLM2 is converted (tools/smollm2.py); JSON on the last line
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import common  # noqa: E402
import smollm2  # noqa: E402


def seconds(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    from transformers import AutoTokenizer

    cache = Path(os.environ.get("T2G_CACHE") or Path.home() / ".cache" / "text2grad")
    tok = AutoTokenizer.from_pretrained(smollm2.export(cache / "smollm2-135m-instruct"))
    text = " ".join(["The café’s naïve résumé — “quoted” text… 寿司 and 🍰 cost 12.50€; déjà vu 😀🧪."] * 200)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids1, ids2 = ids[:1024], ids[:2048]
    assert len(ids2) == 2048
    t1 = seconds(lambda: common.decode_with_offsets(tok, ids1), 21)
    t2 = seconds(lambda: common.decode_with_offsets(tok, ids2), 21)
    dec = seconds(lambda: tok.decode(ids1, skip_special_tokens=True), 201)
    prefix = seconds(lambda: common._decode_with_offsets_by_prefix(tok, ids1, tok.decode(ids1)), 3)
    print(
        f"decode_with_offsets: 1024 tokens {t1 * 1e3:.2f} ms, 2048 tokens {t2 * 1e3:.2f} ms; one decode of 1024 "
        f"tokens {dec * 1e3:.3f} ms; decoding every prefix (the old way), 1024 tokens {prefix * 1e3:.0f} ms"
    )
    print(
        json.dumps(
            {
                "t1024_s": round(t1, 5),
                "t2048_s": round(t2, 5),
                "decode1024_s": round(dec, 6),
                "ratio_2048_1024": round(t2 / t1, 2),
                "ratio_vs_decode": round(t1 / dec, 1),
                "prefix_t1024_s": round(prefix, 4),
                "speedup_vs_prefix": round(prefix / t1, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
