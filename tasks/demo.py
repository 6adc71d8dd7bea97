"""The demo world: summarise a short synthetic post about a pet. It holds the data (demo_dataset), the rule-based
critic that writes critique + spans (demo_critic), the exact monitor of stages 3 and 4 (demo_monitor, demo_scores,
demo_rm_agreement); the tiny base model that plays the pretrained LLM is built from it (infra/tiny_model.py:
build_demo_base). The zero-flag run of every stage uses it.
"""

from __future__ import annotations

import re

from common import locate_spans, span_rewards
from tasks.quotes import unambiguous_quotes

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
_FACT_PATTERNS = [
    r"(?P<owner>\w+) has an? (?P<color>\w+) (?P<animal>\w+) called (?P<pet_name>\w+)\.",
    r"likes the (?P<place>\w+)\.",
    r"eats (?P<food>\w+)\.",
]
_CATEGORY = {w: cat for cat, words in DEMO_FACTS.items() for w in words}


def demo_post_pets(prompt: str) -> tuple[list[dict], set]:
    """([facts by category, one per pet, in the post's order], irrelevant words) read off a demo post of K >= 1 pets
    (demo_dataset's `pets`): each pet's block runs from its "<owner> has a ..." sentence to the next one's. Raises
    ValueError if it is not a demo post."""
    # letter case is no fact: a real model's "Luna" is the post's "luna" (demo_labels compares words lower-cased too)
    post = prompt.split("post:", 1)[-1].split("summary:", 1)[0].lower()
    starts, pets = list(re.finditer(_FACT_PATTERNS[0], post)), []
    if not starts:
        raise ValueError(f"not a demo post (no match for {_FACT_PATTERNS[0]!r}): {prompt[:60]!r}")
    for i, first in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(post)
        block, facts = post[first.start() : end], first.groupdict()
        for pattern in _FACT_PATTERNS[1:]:
            m = re.search(pattern, block)
            if not m:
                raise ValueError(f"not a demo post (no match for {pattern!r}): {prompt[:60]!r}")
            facts.update(m.groupdict())
        pets.append(facts)
    fact_words = {w for facts in pets for w in facts.values()}
    irrelevant = {
        w
        for w in re.findall(r"\w+", post)
        if w not in fact_words and (w in _CATEGORY or any(w in v for v in DEMO_DISTRACTORS.values()))
    }
    return pets, irrelevant


def demo_post_facts(prompt: str) -> tuple[dict, set]:
    """(facts by category, irrelevant words) of a demo post: its first pet's facts (the demo has one pet per post).
    Raises ValueError if it is not one."""
    pets, irrelevant = demo_post_pets(prompt)
    return pets[0], irrelevant


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def demo_labels(prompt: str, response: str) -> list[tuple[str, int, int, str | None]]:
    """The demo critic's verdict on each word of `response`: (word, start, end, kind), kind "good" (a fact of the
    post, first time), "wrong" (another value of a fact's kind), "irrelevant" (from the post's asides), "repeated" (a
    fact again, or the second copy of an immediately repeated 1-3 word phrase) or None (a connective). With K pets,
    the answer's k-th sentence is judged against the k-th pet (sentences past the K-th against the last)."""
    pets, irrelevant = demo_post_pets(prompt)
    # Quotes keep a word's leading space (" red dog"): still exact, and a small model copies the response's own tokens
    # ("Ġred") into the JSON instead of having to map them to the space-less tokens that '["red' would need.
    words = [
        (m.group(), m.start() - (response[m.start() - 1 : m.start()] == " "), m.end())
        for m in re.finditer(r"\w+", response)
    ]
    seq = [w.lower() for w, _, _ in words]  # compared ignoring case; quoted as written
    repeated = [False] * len(seq)  # the second copy of an immediately repeated 1-3 word phrase
    for i in range(len(seq)):
        for n in (3, 2, 1):
            if i >= n and seq[i - n : i] == seq[i : i + n]:
                repeated[i : i + n] = [True] * n
    kinds, seen = [], set()
    for i, w in enumerate(seq):
        pet = min(response[: words[i][1]].count("."), len(pets) - 1)  # the sentence's pet
        cat = _CATEGORY.get(w)
        if w in irrelevant:
            kinds.append("irrelevant")
        elif cat and pets[pet][cat] != w:
            kinds.append("wrong")
        elif repeated[i] or (cat and (pet, cat) in seen):
            kinds.append("repeated")
        elif cat:
            kinds.append("good")
            seen.add((pet, cat))
        else:
            kinds.append(None)
    return [(w, a, b, kind) for (w, a, b), kind in zip(words, kinds)]


def demo_intervals(response: str, labelled) -> dict:
    """{"good": [(start, end)], "poor": [...]}: the character intervals the demo critic flags, runs of adjacent
    same-polarity words of demo_labels' verdicts ("red dog"), a run never crossing a sentence's end. Bridging over an
    unlabelled word ("called") would pay a policy for deleting connectives so that more words fall inside a run: PPO
    found exactly that."""
    labels = [None if kind is None else "good" if kind == "good" else "poor" for *_, kind in labelled]
    spans = {"good": [], "poor": []}
    for i, lab in enumerate(labels):
        if lab is None:
            continue
        run = spans[lab]
        if (
            run
            and run[-1][1] == i - 1
            and labels[i - 1] == lab
            and "." not in response[labelled[i - 1][2] : labelled[i][1]]
        ):
            run[-1][1] = i
        else:
            run.append([i, i])
    return {k: [(labelled[a][1], labelled[b][2]) for a, b in v] for k, v in spans.items()}


def demo_mistakes(prompt: str, response: str) -> int:
    """The mistakes the exact critic flags in a response: its poor intervals, quoted or not (a repeated word right
    after a good run, " white parrot parrot", has no quote of its own: it is one of demo_critic's ambiguous_spans)."""
    return len(demo_intervals(response, demo_labels(prompt, response))["poor"])


def demo_facts(prompt: str, response: str) -> tuple[int, int]:
    """(facts stated, facts in the post): the words demo_labels finds "good", each a distinct fact of its sentence's
    pet stated for the first time (6 per pet). The credit bench's fair scalar and its primary endpoint read it: an
    empty answer makes no mistake, and states none of the facts."""
    stated = sum(kind == "good" for *_, kind in demo_labels(prompt, response))
    return stated, len(DEMO_FACTS) * len(demo_post_pets(prompt)[0])


def demo_critic(prompt: str, response: str) -> dict:
    """The demo task's programmatic critic: {"critique", "good_spans", "poor_spans", "ambiguous_spans"}, quotes
    exact in `response`; a flagged interval no quote can reach (unambiguous_quotes) is listed, not quoted."""
    pets, _ = demo_post_pets(prompt)
    labelled = demo_labels(prompt, response)
    pet = lambda start: min(response[:start].count("."), len(pets) - 1)  # noqa: E731  (as demo_labels judges)
    words = [(w, a, b) for w, a, b, _ in labelled]
    labels = [None if kind is None else "good" if kind == "good" else "poor" for *_, kind in labelled]
    seen = {(pet(a), _CATEGORY[w.lower()]) for w, a, _, kind in labelled if kind == "good"}
    notes = []
    for w, a, _, kind in labelled:
        note = {
            "irrelevant": f"It adds {w}, which is irrelevant.",
            "repeated": f"It repeats {w}.",
            "wrong": f"It says {w} where the post says {pets[pet(a)].get(_CATEGORY.get(w.lower()))}.",
        }.get(kind)
        if note and note not in notes:
            notes.append(note)
    intervals = demo_intervals(response, labelled)
    good, poor, ambiguous = unambiguous_quotes(response, intervals["good"], intervals["poor"])
    right = [w for (w, _, _), lab in zip(words, labels) if lab == "good"]
    missing = [
        cat.replace("_", " ") + (f" of pet {k + 1}" if len(pets) > 1 else "")
        for k in range(len(pets))
        for cat in DEMO_FACTS
        if (k, cat) not in seen
    ]
    parts = ([f"It gets {_join(right)} right."] if right else ["It states none of the post's facts."]) + notes
    if missing and right:
        parts.append(f"It leaves out the {_join(missing)}.")
    return {"critique": " ".join(parts), "good_spans": good, "poor_spans": poor, "ambiguous_spans": ambiguous}


def critic(records: list[dict], responses: list[str]) -> list[dict]:
    """demo_critic as a plug-in critic (critics/plugin.py): --critic program, or python:tasks.demo:critic. A prompt that
    is not a demo post is an error item: that response gets no delta, the others are judged."""
    out = []
    for rec, response in zip(records, responses):
        try:
            out.append(demo_critic(rec["prompt"], response))
        except ValueError as e:
            out.append({"error": str(e)})
    return out


def demo_delta(prompt: str, response: str, offsets) -> tuple[dict, list[float]]:
    """The demo's ground truth on a response: the demo critic's feedback and its per-token delta (span_rewards). 03
    logs it next to the learned critic's (a reward-hacking monitor); 04 scores policies with it."""
    fb = demo_critic(prompt, response)
    return fb, span_rewards(response, offsets, fb["good_spans"], fb["poor_spans"])[0]


def demo_monitor(records: list[dict], texts: list[str], offsets: list, deltas=None) -> dict:
    """03's reward-hacking monitor: the demo's exact critic on the same rollouts (logged, never trained on), summed
    over them: {"exact/span_reward": its summed delta, "exact/mistake_rate": the responses with a mistake}, float32
    tensors; and per response the mistakes flagged ("exact/mistakes"), the share of the post's facts stated
    ("exact/facts_stated", demo_facts) and "exact/imperfect_rate", the responses that miss a fact or make a mistake
    (an empty answer cannot win it: the credit bench's primary endpoint). deltas: span_rewards' (delta, unmatched)
    per rollout when the critic of step 2 was this very one (--critic program), reused."""
    import torch

    exact = torch.zeros(5)
    for i, (rec, text, offs) in enumerate(zip(records, texts, offsets)):
        d = deltas[i][0] if deltas is not None else demo_delta(rec["prompt"], text, offs)[1]
        mistakes, (stated, facts) = demo_mistakes(rec["prompt"], text), demo_facts(rec["prompt"], text)
        exact += torch.tensor(
            [sum(d), float(mistakes > 0), mistakes, stated / facts, float(mistakes > 0 or stated < facts)]
        )
    return dict(
        zip(
            ("exact/span_reward", "exact/mistake_rate", "exact/mistakes", "exact/facts_stated", "exact/imperfect_rate"),
            exact,
        )
    )


def demo_scores(prompt: str, response: str, feedback: dict, delta: list[float], reference: str = "") -> dict:
    """04's per-sample (numerator, denominator) rows of the demo's ground truth (demo_delta's feedback and delta):
    delta-sum, a mistake (any flagged, demo_mistakes), the share of the post's facts stated, exact match with the
    reference."""
    facts = [v for pet in demo_post_pets(prompt)[0] for v in pet.values()]
    words = set(re.findall(r"\w+", response.lower()))
    return {
        "demo/delta_sum": (sum(delta), 1),
        "demo/mistake_rate": (float(demo_mistakes(prompt, response) > 0), 1),
        "demo/facts_right": (sum(v in words for v in facts), len(facts)),
        "demo/exact_match": (float(response.strip() == reference.strip()), 1),
    }


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
    rows = {
        "rm_vs_critic/mistakes_flagged": (sum(flagged), len(true_poor)),
        "rm_vs_critic/mistakes_missed": (len(true_poor) - sum(flagged), len(true_poor)),
    }
    labelled = demo_labels(prompt, response)
    for kind in ("wrong", "irrelevant", "repeated"):
        words = [(a, b) for _, a, b, k in labelled if k == kind]
        of_kind = [f for iv, f in zip(true_poor, flagged) if hits(iv, words)]
        rows[f"rm_vs_critic/flagged_{kind}"] = (sum(of_kind), len(of_kind))
    rows["rm_vs_critic/poor_invented"] = (sum(not hits(iv, true_poor) for iv in rm_poor), len(rm_poor))
    return rows


def make_demo_example(rng, mistake_rate: float = 0.55, pets: int = 1) -> dict:
    """One demo example: a post (prompt), its ideal summary (reference), and a noisy summary (response) with 0-2
    local mistakes (a wrong fact, an irrelevant detail, a repetition) at random positions. pets > 1: the credit
    bench's K knob (make_pets_example); 1 is the demo as it always was."""
    if pets > 1:
        return make_pets_example(rng, mistake_rate, pets)
    facts = {cat: rng.choice(words) for cat, words in DEMO_FACTS.items()}
    other = rng.choice([n for n in DEMO_FACTS["owner"] if n != facts["owner"]])
    dis = {cat: rng.choice(words) for cat, words in DEMO_DISTRACTORS.items()}
    sentences = [
        "{owner} has a {color} {animal} called {pet_name}.",
        "the {animal} likes the {place}.",
        "it eats {food}.",
    ]
    asides = {
        "it rained on {day}.": "on {day}",
        "the {thing} was {adj}.": "and a {adj} {thing}",
        "{other} lost a {thing}.": "with {other}",
    }  # an irrelevant sentence -> the phrase a summary may borrow
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


def make_pets_example(rng, mistake_rate: float, k: int) -> dict:
    """A demo example about k pets (bench/credit/credit.py's K sweep): k owners and pet names, each pet's three
    sentences in turn with 1-2 asides anywhere; the ideal summary one demo sentence per pet, about 16 k tokens. As in
    the demo, a share `mistake_rate` of the noisy summaries holds 1-2 mistakes, now anywhere in the k sentences: the
    same mistakes in a k times longer answer, so a scalar reward points at one of k times more tokens."""
    pets = [{cat: rng.choice(words) for cat, words in DEMO_FACTS.items()} for _ in range(k)]
    for pet, owner, name in zip(pets, rng.sample(DEMO_FACTS["owner"], k), rng.sample(DEMO_FACTS["pet_name"], k)):
        pet.update(owner=owner, pet_name=name)  # a pet per owner and name: each sentence says whose it is
    other = rng.choice([n for n in DEMO_FACTS["owner"] if n not in {p["owner"] for p in pets}])
    dis = {cat: rng.choice(words) for cat, words in DEMO_DISTRACTORS.items()}
    asides = {
        "it rained on {day}.": "on {day}",
        "the {thing} was {adj}.": "and a {adj} {thing}",
        "{other} lost a {thing}.": "with {other}",
    }
    sentences = [
        s.format(**p)
        for p in pets
        for s in (
            "{owner} has a {color} {animal} called {pet_name}.",
            "the {animal} likes the {place}.",
            "it eats {food}.",
        )
    ]
    extra = rng.sample(list(asides), rng.randint(1, 2))
    for s in extra:
        sentences.insert(rng.randint(0, len(sentences)), s.format(**dis, other=other))
    summary = [DEMO_SUMMARY.format(**p)[:-1].split() for p in pets]  # the words of each sentence, without its "."
    for _ in range(rng.choice([1, 1, 2]) if rng.random() < mistake_rate else 0):
        words = rng.choice(summary)
        kind, slots = rng.choice(["wrong", "irrelevant", "repeat"]), [i for i, w in enumerate(words) if w in _CATEGORY]
        if kind == "wrong" and slots:
            i = rng.choice(slots)
            words[i] = rng.choice([w for w in DEMO_FACTS[_CATEGORY[words[i]]] if w != words[i]])
        elif kind == "irrelevant":
            words.insert(rng.choice([1, 5, 7, 11, len(words)]), asides[rng.choice(extra)].format(**dis, other=other))
        elif slots:
            i = rng.choice(slots)
            words.insert(i + 1, words[i])
    return {
        "prompt": "post: " + " ".join(sentences) + "\nsummary:",
        "reference": " ".join(DEMO_SUMMARY.format(**p) for p in pets),
        "response": " " + " ".join(" ".join(words) + "." for words in summary),
    }


def demo_dataset(split: str, n: int, mistake_rate: float = 0.55, pets: int = 1) -> list[dict]:
    """`n` deterministic demo records of a named split ("pretrain", "annotate", "sft", "train", "eval"); a share
    `mistake_rate` of their responses has 1-2 mistakes. pets: K pets per post (make_pets_example; the demo: 1)."""
    import random

    rng = random.Random(f"text2grad-demo-{split}" + (f"-pets{pets}" if pets > 1 else ""))
    return [{"id": f"demo-{split}-{i}", **make_demo_example(rng, mistake_rate, pets)} for i in range(n)]
