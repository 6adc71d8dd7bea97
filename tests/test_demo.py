"""tasks/demo.py, the demo world: its critic's labels and spans, and the reward-hacking monitor's counts. Then the
embedded demo end to end: the four stage scripts run as a user runs them (subprocesses, default paths under runs/demo/
in a fresh folder). It runs at the zero-flag size: shorter runs leave PPO inside its first-updates dip, where neither
mode has improved on the SFT start yet, so the comparison below would test noise."""

import json
import os
import random
import re
import sys

import browser
import pytest
import forkserver
from conftest import ROOT, import_script

import common
from common import locate_spans, parse_feedback
from tasks.demo import demo_critic, demo_dataset, demo_labels, demo_rm_agreement, make_demo_example


# ---------------------------------------------------------------------------------------------------------------------
# The demo critic and the monitor
# ---------------------------------------------------------------------------------------------------------------------


def test_demo_labels_name_each_mistake_kind():
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    response = " tom has a red dog called luna that likes the park on monday and eats fish fish."
    assert [(w, k) for w, _, _, k in demo_labels(post, response) if k] == [
        ("tom", "good"),
        ("red", "good"),
        ("dog", "good"),
        ("luna", "wrong"),
        ("park", "good"),
        ("monday", "irrelevant"),
        ("fish", "good"),
        ("fish", "repeated"),
    ]
    for w, a, b, _ in demo_labels(post, response):
        assert response[a:b].strip() == w  # intervals keep the word's leading space, as the quotes do


def test_demo_rm_agreement_counts_flagged_mistakes_by_kind():
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    response = " tom has a red dog called luna that likes the park on monday and eats fish fish."
    critic = demo_critic(post, response)
    rm = {"critique": "", "good_spans": [" fish"], "poor_spans": [" on monday", " fish"]}  # the aside and the repeat
    offsets = [(m.start(), m.end()) for m in re.finditer(r"\S+", response)]  # one "token" per word
    d_critic = common.span_rewards(response, offsets, critic["good_spans"], critic["poor_spans"])[0]
    d_rm = common.span_rewards(response, offsets, rm["good_spans"], rm["poor_spans"])[0]
    rows = demo_rm_agreement(post, response, critic, d_critic, rm, d_rm)
    assert rows["rm_vs_critic/mistakes_flagged"] == (2, 3)
    assert rows["rm_vs_critic/flagged_wrong"] == (0, 1)  # " luna" where the post says rex: missed
    assert rows["rm_vs_critic/flagged_irrelevant"] == (1, 1)
    assert rows["rm_vs_critic/flagged_repeated"] == (1, 1)  # the second " fish", located after the good first one
    assert rows["rm_vs_critic/poor_invented"] == (0, 2)


def test_demo_critic_on_generated_examples():
    rng, with_mistakes = random.Random(0), 0
    for _ in range(300):
        ex = make_demo_example(rng)
        fb = demo_critic(ex["prompt"], ex["response"])
        assert set(fb) == {"critique", "good_spans", "poor_spans", "ambiguous_spans"} and fb["critique"]
        assert parse_feedback(common.format_rm_target(**fb)) == {
            k: fb[k] for k in ("critique", "good_spans", "poor_spans")
        }
        _, _, unmatched = locate_spans(ex["response"], fb["good_spans"], fb["poor_spans"])
        assert unmatched == []
        with_mistakes += bool(fb["poor_spans"])
        clean = demo_critic(ex["prompt"], " " + ex["reference"])
        assert clean["poor_spans"] == [] and len(clean["good_spans"]) == 5  # owner, color+animal, name, place, food
    assert 0.3 < with_mistakes / 300 < 0.8


def test_demo_critic_finds_each_mistake_kind():
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    good = " tom has a red dog called rex that likes the park and eats fish."
    assert demo_critic(post, good)["poor_spans"] == []
    for response, poor_word in [
        (good.replace("rex", "luna"), "luna"),
        (good.replace("park", "park on monday"), "monday"),
        (good.replace("red dog", "red red dog"), "red"),
        (good.replace("tom", "nora"), "nora"),
        (good.replace("fish", "fish fish"), "fish"),
    ]:
        fb = demo_critic(post, response)
        _, poor_iv, _ = locate_spans(response, fb["good_spans"], fb["poor_spans"])
        assert any(poor_word in response[a:b] for a, b in poor_iv), (response, fb)
    wrong = demo_critic(post, good.replace("rex", "luna"))
    assert "luna where the post says rex" in wrong["critique"]
    with pytest.raises(ValueError):
        demo_critic("not a demo post", "x")


def test_a_mistake_no_quote_can_reach_still_counts_as_one(tmp_path):
    """ " white parrot parrot": the second " parrot" is flagged (repeated), but a quote of it would land on the first,
    inside the good run " white parrot", so the critic lists it under ambiguous_spans (issue 56, item 5). The ground
    truth counted quoted spans only: 04's demo/mistake_rate, 03's exact monitor and the benches' 0/1 per post read this
    answer as mistake-free (27 of the eval split's first 1,000 noisy answers)."""
    import sys
    from tasks.demo import demo_mistakes, demo_monitor, demo_scores

    sys.path.insert(0, str(ROOT / "bench" / "shared"))
    from cached_runs import post_mistakes

    post = (
        "post: ruby has a white parrot called bruno. it rained on monday. the parrot likes the river. nora lost a "
        "cup. it eats bread.\nsummary:"
    )
    response = " ruby has a white parrot parrot called bruno that likes the river and eats bread."
    fb = demo_critic(post, response)
    assert fb["poor_spans"] == [] and [a["label"] for a in fb["ambiguous_spans"]] == ["poor"]
    assert demo_mistakes(post, response) == 1 and demo_mistakes(post, response.replace("parrot parrot", "parrot")) == 0
    offsets = [(m.start(), m.end()) for m in re.finditer(r"\S+", response)]
    assert demo_scores(post, response, fb, [0.0] * len(offsets))["demo/mistake_rate"] == (1.0, 1)
    assert demo_monitor([{"prompt": post}], [response], [offsets])["exact/mistake_rate"].item() == 1.0
    common.write_jsonl(tmp_path / "generations.jsonl", [{"id": "p", "response": response}])  # 04's cache
    assert post_mistakes(tmp_path / "generations.jsonl", [{"id": "p", "prompt": post}]) == [1.0]


def test_the_exact_monitor_counts_facts_and_the_answers_that_miss_one_or_make_a_mistake():
    """03's exact monitor (issue 65's primary endpoint): per answer the mistakes, the share of the post's facts stated
    (demo_facts: the critic's "good" words) and whether it is imperfect (a fact missed or a mistake made). Hand-counted:
    the clean answer states 6 of 6; "luna" for rex, the aside "monday" and the repeated "fish" are 3 mistakes with 5
    facts; a fact left out is imperfect with no mistake; the empty answer states 0 and makes none, and is imperfect."""
    from tasks.demo import demo_facts, demo_monitor

    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    answers = [
        " tom has a red dog called rex that likes the park and eats fish.",
        " tom has a red dog called luna that likes the park on monday and eats fish fish.",
        " tom has a red dog called rex that likes the park.",
        "",
    ]
    assert [demo_facts(post, a) for a in answers] == [(6, 6), (5, 6), (5, 6), (0, 6)]
    offsets = [[(m.start(), m.end()) for m in re.finditer(r"\S+", a)] for a in answers]
    row = {k: v.item() for k, v in demo_monitor([{"prompt": post}] * 4, answers, offsets).items()}
    assert row["exact/mistakes"] == 3 and row["exact/mistake_rate"] == 1
    assert row["exact/facts_stated"] == pytest.approx(1 + 5 / 6 + 5 / 6 + 0)
    assert row["exact/imperfect_rate"] == 3
    two = demo_dataset("train", 1, pets=2)[0]["prompt"]  # K pets: 6 facts each
    assert demo_facts(two, "")[1] == 12


def test_demo_critic_ignores_letter_case():
    """A real model capitalises ("Emma has a green pony called Luna"): a capitalised fact is still right, a
    capitalised wrong fact still wrong, and the share of facts right counts them alike (issue 46)."""
    from tasks.demo import demo_scores

    post = (
        "post: Tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    lower = " tom has a red dog called luna that likes the park on monday and eats fish."
    upper = " Tom has a Red dog called Luna that likes the Park on Monday and eats Fish."
    assert [k for *_, k in demo_labels(post, upper)] == [k for *_, k in demo_labels(post, lower)]
    fb_low, fb_up = demo_critic(post, lower), demo_critic(post, upper)
    assert len(fb_up["poor_spans"]) == len(fb_low["poor_spans"]) == 2  # Luna and Monday
    assert "Luna where the post says rex" in fb_up["critique"]
    assert fb_up["critique"].lower() == fb_low["critique"].lower()  # "It leaves out the pet name."
    assert (
        demo_scores(post, upper, fb_up, [0.0])["demo/facts_right"]
        == demo_scores(post, lower, fb_low, [0.0])["demo/facts_right"]
        == (5, 6)
    )


# ---------------------------------------------------------------------------------------------------------------------
# The zero-flag chain
# ---------------------------------------------------------------------------------------------------------------------


STAGES = [  # the zero-flag chain at its full size (about 4.5 minutes on 2 cores), shrunk only where nothing is learned
    ("01_annotate.py",),
    ("02_train_reward.py", "--eval-limit", "50"),
    ("03_train_policy.py",),
    ("04_evaluate.py", "--bootstrap", "200", "--report-samples", "4"),
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Run the chain once in a fresh folder; returns (folder, stdout of each stage)."""
    work = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = {}
    for script, *flags in STAGES:
        proc = forkserver.run(
            [sys.executable, str(ROOT / script), *flags], cwd=work, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
        logs[script] = proc.stdout
    return work / "runs" / "demo", logs


@pytest.mark.slow  # the zero-flag chain's fixture: the suite's longest pole
def test_stage1_annotations_are_well_formed(demo):
    run, _ = demo
    recs = common.read_jsonl(run / "annotations.jsonl")
    assert len(recs) == 16000 and len({r["id"] for r in recs}) == 16000
    assert (run / "base" / "config.json").is_file()
    for name in ("sft", "prompts", "eval"):
        assert common.read_jsonl(run / "data" / f"{name}.jsonl", required=("prompt",))
    for r in recs:
        assert r["status"] == "ok" and r["critique"] and r["unmatched_spans"] == []
        for s in r["good_spans"] + r["poor_spans"]:
            assert common.find_span(r["response"], s) is not None  # every kept quote is in the response
    assert sum(bool(r["poor_spans"]) for r in recs) > 0.4 * len(recs)  # the demo data carries mistakes to learn from


@pytest.mark.slow  # the zero-flag chain's fixture: the suite's longest pole
def test_stage2_reward_model_saved_and_evaluated(demo):
    run, _ = demo
    rm = run / "reward_model"
    info = json.loads((rm / "reward_model.json").read_text())
    assert info["base_model"] == str((run / "base").resolve())  # stored absolute: loads from any directory
    assert info["train"]["steps"] == import_script("02_train_reward").DEMO["max_steps"]
    assert (rm / "model.safetensors").is_file()  # the demo's reward model is fully fine-tuned
    ev = json.loads((rm / "eval.json").read_text())
    assert ev["n"] == 50 and 0.0 <= ev["parse_rate"] <= 1.0
    for k in ("pos_precision", "pos_recall", "neg_recall", "unmatched_span_rate", "critique_words", "eval_loss"):
        assert k in ev
    assert ev["parse_rate"] >= 0.9 and ev["pos_f1"] >= 0.8  # the format and the good spans are learned


@pytest.mark.slow  # the zero-flag chain's fixture: the suite's longest pole
def test_stage3_text2grad_and_scalar_runs(demo):
    run, _ = demo
    assert (run / "sft" / "config.json").is_file()
    for name in ("text2grad", "scalar"):
        rows = common.read_jsonl(run / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(
            range(1, import_script("03_train_policy").PRESETS["demo"]["steps"] + 1)
        )
        for key in (
            "losses/policy_loss",
            "losses/value_loss",
            "policy/approx_kl",
            "policy/clipfrac",
            "val/explained_variance",
            "objective/kl",
            "objective/span_reward",
            "critic/parse_fail_rate",
        ):
            assert all(isinstance(r[key], float) for r in rows), key
        assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the first rollouts come from the reference
        assert (run / name / "policy" / "adapter_config.json").is_file()
        assert json.loads((run / name / "config.json").read_text())["reward_mode"] == (
            "span" if name == "text2grad" else "scalar"
        )


@pytest.mark.slow  # the zero-flag chain's fixture: the suite's longest pole
def test_text2grad_makes_fewer_mistakes_than_the_sft_start(demo):
    """Judged by the exact critic on 200 held-out posts answered at temperature 1 (stage 4's demo/mistake_rate).

    The margin, from `python bench/demo_seeds/demo_seeds.py` (3 seeds x {1, 2} threads, README "The embedded demo"): Text2Grad's
    mistake rate was 0.44-0.79 x the SFT start's (transformers 5.24), the closest run 0.380 vs 0.480, a gap of 0.10
    (about 2 standard errors of a difference of two rates at n = 200). So this asserts only the direction,
    Text2Grad < SFT, which every measured run passed by that margin; the stronger claims (<= 0.8 x SFT on every run,
    Text2Grad against the scalar baseline) are the benchmark's, not a test's."""
    run, _ = demo
    metrics = {name: pol["metrics"] for name, pol in json.loads((run / "results.json").read_text())["policies"].items()}
    mistakes = {name: m["demo/mistake_rate"]["value"] for name, m in metrics.items()}
    assert mistakes["text2grad"] < mistakes["sft"], mistakes


@pytest.mark.slow  # the zero-flag chain's fixture: the suite's longest pole
def test_stage4_results_and_report(demo):
    run, logs = demo
    results = json.loads((run / "results.json").read_text())
    assert set(results["policies"]) == {"sft", "scalar", "text2grad"}
    for pol in results["policies"].values():
        m = pol["metrics"]
        assert m["demo/mistake_rate"]["n"] == 200 and 0 <= m["demo/mistake_rate"]["value"] <= 1
        lo, hi = m["rouge1"]["ci95"]
        assert lo <= m["rouge1"]["value"] <= hi
        assert "rm/parse_rate" in m
    page = (run / "report.html").read_text()
    assert re.search(r'<mark class="good">[^<]+</mark>', page)  # spans highlighted in the sample answers
    assert "data:image/png;base64," in page  # the training curves
    assert "report.html" in logs["04_evaluate.py"]


@pytest.mark.slow  # the zero-flag chain's fixture: the suite's longest pole
@pytest.mark.skipif(browser.CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")
def test_report_renders_offline_in_headless_chromium(demo):
    """report.html in a real browser: no console errors, no network fetches (no CDN), the span highlights and the
    training curves render, and "Where the update went" draws its token strips from stage 3's traces: both runs'
    updates of the same rollouts, every signed cell green above 0 and red below it as the browser paints it, with its
    number on hover. A screenshot is left next to the report for a person to look at."""
    run, _ = demo
    signed = "[...document.querySelectorAll('table.tokens td.cell:not(.p)')]"
    values, errors, fetched = browser.inspect_page(
        (run / "report.html").as_uri(),
        {
            "good": "document.querySelectorAll('mark.good').length",
            "poor": "document.querySelectorAll('mark.poor').length",
            "curves": "[...document.querySelectorAll('img.curves')].map(i => i.complete && i.naturalWidth > 0)",
            "monitor": "document.body.innerText.includes('real mistakes the RM flags')",
            "section": "!!document.getElementById('where-update')",
            "strips": "[...document.querySelectorAll('table.tokens')].map(t => [...t.rows].map(r => r.cells[0].innerText))",
            "cells": f"{signed}.length",
            "visible": f"{signed}.filter(c => c.getBoundingClientRect().width > 0).length",
            # the painted colour of each cell against the sign of its value: [value, 'r,g,b,a'] where they disagree
            "wrong_colour": f"""{signed}.map(c => [parseFloat(c.dataset.v),
            getComputedStyle(c).backgroundColor.match(/[\\d.]+/g).map(Number)]).filter(([v, [r, g, b, a]]) =>
            v > 0 ? !(g > r && (a ?? 1) > 0) : v < 0 ? !(r > g && (a ?? 1) > 0) : (a ?? 1) !== 0)""",
            "signs": f"{signed}.map(c => Math.sign(parseFloat(c.dataset.v)))",
            "titles": f"{signed}.every(c => Math.abs(parseFloat(c.title.split(' = ').pop()) - c.dataset.v) < 1e-5)",
        },
        screenshot=str(run / "report.png"),
    )
    assert errors == [] and fetched == []
    assert values["good"] > 0 and values["poor"] > 0
    assert values["curves"] == [True, True]  # the training curves, and the locality ratio over training
    assert values["monitor"]
    assert values["section"] and 1 <= len(values["strips"]) <= 3
    for rows in values["strips"]:  # the demo's two runs sample the same first rollouts: both updates are drawn
        assert [r.replace("\n", "") for r in rows] == [
            "token",
            "πold(yt)",
            "δt",
            "At span",
            "At scalar",
            "Δt span",
            "Δt scalar",
        ]
    assert values["cells"] > 0 and values["visible"] == values["cells"]
    assert values["wrong_colour"] == []
    assert {1, -1} <= set(values["signs"])  # both colours were checked
    assert values["titles"]
    assert (run / "report.png").stat().st_size > 10_000


def test_no_quote_labels_characters_the_critic_did_not_flag():
    """Issue 56, item 5: a flagged interval whose text occurs earlier, unclaimed, cannot be quoted: its quote would
    land there. It used to be widened by neighbouring words until unique (labelling words nobody flagged: " yellow
    cat" for a repeated " yellow"), or after 8 tries every span of the record was dropped. Now it is listed under
    ambiguous_spans with its interval and a reason, and the record's other spans stay: on 300 answers of the demo's
    two-pet world, every token the quotes label lies in an interval the critic flags, and every flag is either quoted
    or listed."""
    from tasks.demo import demo_critic, demo_intervals, demo_labels

    listed = 0
    for rec in demo_dataset("sft", 300, pets=2):
        text = rec["response"]
        fb = demo_critic(rec["prompt"], text)
        flagged = demo_intervals(text, demo_labels(rec["prompt"], text))
        good, poor, _ = locate_spans(text, fb["good_spans"], fb["poor_spans"])
        assert set(good) <= set(flagged["good"]) and set(poor) <= set(flagged["poor"])
        missing = {(a["start"], a["end"]) for a in fb["ambiguous_spans"]}
        assert set(flagged["good"]) | set(flagged["poor"]) == set(good) | set(poor) | missing
        assert all(a["reason"] and a["label"] in ("good", "poor") for a in fb["ambiguous_spans"])
        listed += len(missing)
    assert listed  # the two-pet world repeats words across its sentences: some flags cannot be quoted
