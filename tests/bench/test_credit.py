"""bench/credit/: when per-token credit helps (credit.py, credit_arms.py), at matched difficulty (credit_matched.py),
with learned critics (credit_learned.py); credit_k4.py's tests are in test_credit_k4.py."""

import json
import math
import sys
from pathlib import Path

import forkserver
import pytest
from bench_helpers import bench_path, environ_restored  # noqa: F401 (environ_restored: autouse)
from conftest import ROOT

import common
import critics
from critics import plugin

bench_path("credit")


# ---------------------------------------------------------------------------------------------------------------------
# bench/credit/credit.py: when per-token credit helps (issue 55)
# ---------------------------------------------------------------------------------------------------------------------

import credit  # noqa: E402
import credit_arms  # noqa: E402


def test_credit_arms_label_exactly_what_the_exact_critic_flags(tiny_tokenizer):
    """Every arm puts delta only on tokens inside an interval the demo critic flags (no quote widened to be unique:
    on these answers the quoting critic's delta differs); poor_only is min(span, 0); clause_scores is a perfect PRM's
    step_deltas, its clauses the PRM's (split_steps), wrong where a flagged poor interval overlaps them."""
    from baselines.scalar_rm import split_steps
    from critics.scalar import step_deltas
    from tasks.demo import demo_dataset, demo_intervals, demo_labels

    widened = 0
    for k in (1, 2):
        for rec in demo_dataset("sft", 60, pets=k):
            text, offsets = common.decode_with_offsets(
                tiny_tokenizer, tiny_tokenizer(rec["response"], add_special_tokens=False)["input_ids"]
            )
            d = {
                arm: critics.delta(text, offsets, critics.call(getattr(credit_arms, arm), arm, [rec], [text])[0])[0]
                for arm in ("span", "poor_only", "clause_scores")
            }
            flagged = demo_intervals(text, demo_labels(rec["prompt"], text))
            for (s, e), v in zip(offsets, d["span"]):
                s, e = common._core(text, s, e)
                assert not v or any(a <= s and e <= b for a, b in flagged["good"] + flagged["poor"])
            assert d["poor_only"] == [min(v, 0.0) for v in d["span"]]
            bad = lambda s, e: any(a < e and s < b for a, b in flagged["poor"])  # noqa: E731
            assert d["clause_scores"] == step_deltas(
                offsets, [(e, -1.0 if bad(s, e) else 1.0) for s, e in split_steps(text, "clause")]
            )
            quoting = critics.call(plugin.load_critic("program", "demo", "--critic")[0], "p", [rec], [text])[0]
            widened += critics.delta(text, offsets, quoting)[0] != d["span"]
    assert widened  # the bench's reason for its own arms: the quoting critic widens some labels


def test_fair_scalar_and_poor_facts_score_facts_stated_less_mistakes(tiny_tokenizer):
    """Issue 65's arms an empty answer cannot win. Hand-counted: the answer with "luna" for rex, the aside "monday"
    and the repeated "fish" states 5 facts and makes 3 mistakes: fair_scalar scores 5 - 3 = 2 at EOS and nothing
    else; poor_facts is poor_only's delta with the 5 facts added on the last token; the empty answer scores 0."""
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    rec = {"prompt": post}
    for text, facts, mistakes in (
        (" tom has a red dog called luna that likes the park on monday and eats fish fish.", 5, 3),
        (" tom has a red dog called rex that likes the park and eats fish.", 6, 0),
    ):
        offsets = common.decode_with_offsets(
            tiny_tokenizer, tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        )[1]
        d = {
            arm: critics.delta(text, offsets, critics.call(getattr(credit_arms, arm), arm, [rec], [text])[0])[0]
            for arm in ("fair_scalar", "poor_facts", "poor_only")
        }
        assert d["fair_scalar"] == [0.0] * (len(offsets) - 1) + [facts - mistakes]
        assert d["poor_facts"] == d["poor_only"][:-1] + [d["poor_only"][-1] + facts]
    assert credit_arms.fair_scalar([rec], [""]) == [{"critique": "", "spans": [], "score": 0.0}]


def test_per_pet_arms_divide_every_reward_by_k_and_change_nothing_at_k1(tiny_tokenizer):
    """bench/credit/credit.md, amendment 1: an arm's _per_pet twin is its delta divided by the post's K (pets), the same at
    K = 1, for intervals and scores alike."""
    from tasks.demo import demo_dataset

    for k in (1, 2):
        for rec in demo_dataset("sft", 20, pets=k):
            text = rec["response"]
            offsets = common.decode_with_offsets(
                tiny_tokenizer, tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
            )[1]
            for arm in ("span", "poor_facts", "fair_scalar", "clause_scores"):
                d = [
                    critics.delta(text, offsets, critics.call(getattr(credit_arms, name), name, [rec], [text])[0])[0]
                    for name in (arm, arm + "_per_pet")
                ]
                assert d[1] == [x / k for x in d[0]]


def test_sample_scores_count_the_exact_critics_flags_and_the_facts_per_logged_answer(tmp_path):
    """The sweep's mistakes per answer: "luna" for rex, the aside "monday" and the repeated "fish" are 3; the clean
    answer 0; the empty one 0 mistakes and 0 of 5 facts; a row logged before from_step is not read."""
    post = (
        "post: tom has a red dog called rex. it rained on monday. the dog likes the park. nora lost a cup. "
        "it eats fish.\nsummary:"
    )
    bad = " tom has a red dog called luna that likes the park on monday and eats fish fish."  # 5 facts, luna wrong
    clean = " tom has a red dog called rex that likes the park and eats fish."
    common.write_jsonl(
        tmp_path / "samples.jsonl",
        [
            {"step": 100, "prompt": post, "response": bad},
            {"step": 110, "prompt": post, "response": bad},
            {"step": 150, "prompt": post, "response": clean},
            {"step": 150, "prompt": post, "response": ""},
        ],
    )
    assert credit.sample_scores(tmp_path, 110) == {"mistakes": 1.0, "facts": (5 + 6 + 0) / 18}
    assert credit.sample_scores(tmp_path, 150) == {"mistakes": 0.0, "facts": 6 / 12}


def test_credit_ratios_and_paired_differences_against_hand_computed_values():
    rng = __import__("numpy").random.default_rng(0)
    r = credit.step_ratio([20, 30], [40, 60], rng, resamples=200)
    assert r["ratio"] == 0.5 and r["interval"] == [0.5, 0.5]  # every resample pairs seeds: the same ratio
    d = credit.paired_difference([[1, 0, 0, 0]], [[1, 1, 1, 0]], rng, resamples=500)
    assert d["difference"] == -0.5 and d["interval"][0] <= -0.5 <= d["interval"][1]
    grid = {
        ("a", 1e-3, 0.05, 1): {"steps": 30, "final": 0.2},
        ("a", 1e-3, 0.05, 2): {"steps": 50, "final": 0.1},
        ("a", 2e-3, 0.05, 1): {"steps": 40, "final": 0.1},
        ("a", 2e-3, 0.05, 2): {"steps": 40, "final": 0.3},
    }
    chosen = credit.select(grid)["a"]  # the lower median steps (40 vs 40: the lower final rate, 0.15 vs 0.2)
    assert (chosen["lr"], chosen["score"]) == (1e-3, [40, 0.15000000000000002])


@pytest.mark.slow  # 93 s of a worker in the 2026-11-27 profile (docs/tests.md)
def test_credit_bench_runs_every_arm_and_selects_on_training_curves_alone(
    forked_stages, tmp_path, monkeypatch, tiny_model_dir
):
    """A tiny grid of every arm, end to end through 03, then the selection: it reads the grid's metrics alone. No
    held-out post is made or read before the confirmation phase (demo_dataset("eval", ...) raises here). Then, for
    two arms, the confirmation and the K sweep, whose final training rates pair up seed by seed with the scalar's."""
    from tasks.demo import demo_dataset

    common.write_jsonl(tmp_path / "prompts.jsonl", demo_dataset("train", 8))
    flags = [
        "--model",
        tiny_model_dir,
        "--sft-steps",
        "0",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        "--trace-samples",
        "0",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--device",
        "cpu",
    ]
    monkeypatch.setattr(credit, "start", lambda out, pets, args: flags)
    monkeypatch.setattr(credit, "THRESHOLD", -1.0)  # the tiny model's answers hold no demo mistakes to bring down

    def no_eval(split, *a, **k):
        assert split != "eval", "the selection read a held-out post"
        return demo_dataset(split, *a, **k)

    monkeypatch.setattr(credit, "demo_dataset", no_eval)
    out = tmp_path / "credit"
    result = credit.main(
        [
            "--steps",
            "2",
            "--lrs",
            "1e-3",
            "--kl-coefs",
            "0.05",
            "--grid-seeds",
            "1",
            "--stop-after",
            "select",
            "--out",
            str(out),
            "--results",
            "",
        ]
    )
    assert set(result["selection"]) == set(credit.ARMS) and result["best_scalar"] in credit.SCALAR_ARMS
    runs = sorted((out / "grid").glob("*/metrics.jsonl"))
    assert len(runs) == len(credit.ARMS) and all(len(common.read_jsonl(m)) == 2 for m in runs)
    assert not list(out.rglob("eval*.jsonl"))

    # then the confirmation and the K sweep, for two arms (the grid's runs reused; 04's judging: credit_learned's test)
    monkeypatch.setattr(credit, "demo_dataset", demo_dataset)
    monkeypatch.setattr(
        credit,
        "judge",
        lambda out, name, policy, *a: {
            "mistake_rate": 0.5,
            "rougeL": 0.9,
            "heldout_kl": 0.0,
            "per_post": [float(i % 2) for i in range(4)],
        },
    )
    for k in (1, 2):
        common.write_jsonl(out / f"k{k}" / "prompts.jsonl", demo_dataset("train", 8, pets=k))
    result = credit.main(
        [
            "--steps",
            "2",
            "--lrs",
            "1e-3",
            "--kl-coefs",
            "0.05",
            "--grid-seeds",
            "1",
            "--arms",
            "span",
            "poor_scalar",
            "--confirm-seeds",
            "1",
            "--sweep-seeds",
            "1",
            "--ks",
            "2",
            "--eval-posts",
            "4",
            "--out",
            str(out),
            "--results",
            "",
        ]
    )
    assert len(list((out / "grid").glob("*/metrics.jsonl"))) == len(credit.ARMS)  # nothing ran twice
    assert set(result["confirm"]) == {"sft", "span", "poor_scalar"} and (out / "confirm").is_dir()
    arm, ref = result["sweep"][2]["span"], result["sweep"][2]["poor_scalar"]
    assert len(arm["steps"]) == len(arm["final"]) == len(arm["train_kl"]) == len(arm["length"]) == 1
    assert arm["heldout_kl"] == [0.0] and arm["train_kl"][0] != 0.0  # each KL under its own name (issue 65)
    per_post = json.loads((out / "results.json").read_text())["per_post"]
    assert per_post["k2/span/seed101"] == "0101"  # every sweep policy's 0/1 per held-out post
    scores = credit.sample_scores(next((out / "sweep_k2").glob("span_*")), 0)
    assert [arm["mistakes"], arm["facts"]] == [[scores["mistakes"]], [scores["facts"]]]
    assert arm["final_versus_scalar"] == {
        "difference": pytest.approx(arm["final"][0] - ref["final"][0]),
        "interval": [pytest.approx(arm["final"][0] - ref["final"][0])] * 2,
    }
    assert result["sweep"][2]["poor_scalar"]["final_versus_scalar"] == {"difference": 0.0, "interval": [0.0, 0.0]}

    # --from-selection: the sweep alone at a committed selection, nothing of phases 1-3 run or read
    common.write_json(tmp_path / "sel.json", {"selection": result["selection"], "best_scalar": "poor_scalar"})
    monkeypatch.setattr(credit, "phases_1_to_3", None)
    argv = [*"--steps 2 --sweep-seeds 1 --ks 2 --eval-posts 4 --results".split(), "", "--out", str(out)]
    again = credit.main([*argv, "--from-selection", str(tmp_path / "sel.json")])
    assert again["sweep"][2]["span"]["steps"] == arm["steps"] and "confirm" not in again
    curves = json.loads((out / "results.json").read_text())["curves"]  # every iteration's rate, to rerun against
    assert len(curves["k2/span/seed101"]) == 2 and set(again["sweep"][2]) == {"sft", "span", "poor_scalar"}
    one = credit.main([*argv, "--from-selection", str(tmp_path / "sel.json"), "--sweep-arms", "span"])
    assert set(one["sweep"][2]) == {"sft", "span"}


# bench/credit/credit_matched.py: per-token credit at matched difficulty (issue 65)
import credit_matched  # noqa: E402

BUILD = """
import sys
from pathlib import Path
sys.path[:0] = ["bench/credit", "bench/shared"]
import credit_matched as cm
args = cm.parse_args(["--tiny", "--out", sys.argv[1]])
cm.one_thread()
print(cm.build_world(Path(sys.argv[1]), 2, 1, int(sys.argv[2]), args)["checksum"])
"""


@pytest.mark.slow  # 84 s of a worker (2026-12-03): a start built at two thread counts
def test_a_start_built_twice_is_the_same_bytes_whatever_the_thread_count(tmp_path):
    """Issue 65, item 2: a world's base model and SFT start, built in two processes, one given 2 threads by its
    environment, are the same bytes (credit.one_thread); the other seed is another start."""

    def build(folder, seed, threads):
        env = {**__import__("os").environ, "OMP_NUM_THREADS": str(threads)}
        proc = forkserver.run(  # (2 threads: a server of that environment, as a fresh interpreter would read it)
            [sys.executable, "-c", BUILD, str(tmp_path / folder), str(seed)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()[-1]

    one, two = build("a", 0, 1), build("b", 0, 2)
    assert one == two and build("c", 1, 1) != one


def test_credit_matched_statistics_against_hand_computed_values():
    """The sign-flip test's exact p (3 positive differences: 2 of the 8 sign patterns are as extreme), Holm's step-down
    adjustment by hand, and compare(): the steps ratio of paired seeds, its p, the seed left out as most extreme, and
    the held-out difference of 0/1 posts."""
    cm = credit_matched
    assert cm.sign_flip_p([1, 1, 1]) == 0.25 and cm.sign_flip_p([1, -1]) == 1.0
    assert cm.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    rng = __import__("numpy").random.default_rng(0)
    arm = {"steps": [10, 20, 30, 100], "imperfect": [[1, 0], [0, 0], [1, 1], [0, 0]]}
    ref = {"steps": [20, 40, 60, 40], "imperfect": [[1, 1], [1, 0], [1, 1], [0, 0]]}
    out = cm.compare(arm, ref, ["A", "A", "B", "B"], rng, resamples=200)
    st, h = out["steps_ratio"], out["heldout_imperfect"]
    assert st["ratio"] == 160 / 160 and st["extreme_seed"] == 3 and st["without_extreme"] == 60 / 120
    assert st["p"] == cm.sign_flip_p([-10, -20, -30, 60])
    assert h["difference"] == -2 / 8 and h["per_seed"] == [-0.5, -0.5, 0.0, 0.0]
    assert h["interval"][0] <= -0.25 <= h["interval"][1]


def test_credit_matched_one_seed_has_no_value_without_its_extreme_seed():
    """With one seed (the tiny study's shapes) nothing is left once the extreme seed is out: NaN, said quietly (numpy's
    'Mean of empty slice' warning was raised before)."""
    import warnings

    arm, ref = {"steps": [10], "imperfect": [[1, 0]]}, {"steps": [20], "imperfect": [[1, 1]]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = credit_matched.compare(arm, ref, ["A"], __import__("numpy").random.default_rng(0), resamples=20)
    assert math.isnan(out["steps_ratio"]["without_extreme"]) and math.isnan(out["heldout_imperfect"]["without_extreme"])
    assert out["steps_ratio"]["ratio"] == 0.5 and out["heldout_imperfect"]["difference"] == -0.5


def test_credit_matched_interval_resamples_the_starts_first():
    """Two starts whose seeds agree within each start and disagree across them: the two-level bootstrap draws A twice
    (a quarter of the time), B twice, or one of each, so its 95% interval is exactly the two starts' values, by hand:
    steps ratio [0.5, 1.5], held-out difference [-1, +1] (every post of a start's seeds alike, so resampling the posts
    changes nothing). A bootstrap of the 10 seeds alone would be narrower: it reaches an end only when all 10 draws
    come from one start (2 / 2^10 of the time)."""
    rng = __import__("numpy").random.default_rng(0)
    starts = ["A"] * 5 + ["B"] * 5
    arm = {"steps": [150] * 5 + [50] * 5, "imperfect": [[1] * 5] * 5 + [[0] * 5] * 5}
    ref = {"steps": [100] * 10, "imperfect": [[0] * 5] * 5 + [[1] * 5] * 5}
    out = credit_matched.compare(arm, ref, starts, rng, resamples=2000)
    assert out["steps_ratio"]["interval"] == pytest.approx([0.5, 1.5])
    assert out["heldout_imperfect"]["interval"] == pytest.approx([-1.0, 1.0])
    arm["train_kl"], ref["train_kl"] = [0.5] * 5 + [0.3] * 5, [0.4] * 10  # an uncorrected measure: the same draws
    kl = credit_matched.compare(arm, ref, starts, rng, resamples=2000)["uncorrected"]["train_kl"]
    assert kl["difference"] == pytest.approx(0.0) and kl["interval"] == pytest.approx([-0.1, 0.1])


@pytest.mark.slow
def test_credit_matched_runs_every_phase_at_tiny_shapes(forked_stages, tmp_path):
    """Two arms through calibration, the grid, the selection and the confirmation on two starts (04 judges every
    policy), then K = 1: the results name each start's checksum, every confirmed policy's per-post outcomes and each
    per-token arm's comparison with fair_scalar, Holm-adjusted."""
    out = tmp_path / "cm"
    result = credit_matched.main(
        ["--tiny", "--arms", "fair_scalar", "span", "--ladder", "1", "--out", str(out), "--results", ""]
    )
    assert set(result["starts"]) == {"k1", "A", "B"} and len(set(result["starts"].values())) == 3
    conf = result["confirm"]
    assert conf["starts"] == ["A", "B"] and set(conf["versus_fair_scalar"]) == {"span"}
    assert "p_holm" in conf["versus_fair_scalar"]["span"]["steps_ratio"]
    per_post = json.loads((out / "results.json").read_text())["per_post"]
    assert len(per_post["confirm/span/seed102"]["imperfect"]) == 8 and "k1/span/seed101" in per_post
    assert set(result["k1_selection"]) == {"fair_scalar", "span", "poor_scalar"}
    md = credit_matched.markdown(result)  # bench/credit/credit.md's tables: the grid, the confirmation, K = 1
    assert md.count("| SFT start A | | |") == 1 and "| SFT start B | | |" in md and "| SFT start k1 | | |" in md
    assert md.count("| span − fair_scalar held out |") == 2 and "| poor_scalar | " in md


def test_credit_matched_means_per_start_by_hand():
    """The per-start table averages each arm's seeds of one start only: A's seeds (0.2, 0.4) -> 0.300, B's (1, 1)."""
    row = {"heldout_imperfect": [0.2, 0.4, 1, 1], "heldout_mistakes": [1, 2, 5, 6], "heldout_facts": [1] * 4}
    table = {"sft": {}, "starts": ["A", "A", "B", "B"], "span": {**row, "heldout_length": [60, 62, 40, 40]}}
    lines = credit_matched.by_start_markdown(table)
    assert lines[0].startswith("| held-out mean per start | imperfect (A) | imperfect (B) | mistakes (A)")
    assert lines[-1] == "| span | 0.300 | 1.000 | 1.50 | 5.50 | 1.000 | 1.000 | 61 | 40 |"


def test_credit_md_tables_are_the_committed_results():
    """Every line of bench/credit/credit.md's result tables is what `credit_matched.py --report` prints from the committed
    bench/credit/credit_matched_results.json: no number copied by hand."""
    result = json.loads((ROOT / "bench" / "credit" / "credit_matched_results.json").read_text())
    page = set((ROOT / "bench" / "credit" / "credit.md").read_text().splitlines())
    missing = [line for line in credit_matched.markdown(result).splitlines() if line and line not in page]
    assert not missing, missing


# bench/credit/credit_learned.py: the tuned arms with learned critics (issue 58, part 1)
import credit_learned  # noqa: E402


@pytest.mark.slow
def test_credit_learned_runs_each_arm_on_its_reward_model_and_judges_from_the_runs_record(
    forked_stages, tmp_path, monkeypatch, tiny_model_dir, tiny_chat_model_dir
):
    """At tiny shapes: the train phase builds the three reward models from --rm-base, then one 03 run per arm with
    its critic and bench/credit/credit.py's tuned lr and beta (the poor-only arm: --labels poor), and records them in
    OUT/runs.json; the eval phase reads that record alone (the reward models stay where they trained, e.g. a lent
    GPU) and pairs every arm with each scalar row, post by post."""
    from tasks.demo import demo_dataset

    out = tmp_path / "cl"
    common.write_jsonl(out / "k1" / "prompts.jsonl", demo_dataset("train", 8))
    common.write_jsonl(out / "k1" / "sft.jsonl", demo_dataset("sft", 16))
    flags = [
        "--model",
        tiny_model_dir,
        "--sft-steps",
        "0",
        "--prompts",
        str(out / "k1" / "prompts.jsonl"),
        "--scalar-baseline-dir",
        "",
        "--trace-samples",
        "0",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--device",
        "cpu",
        "--max-fail-share",
        "1",
    ]  # 2 steps teach the reward model no format: nothing parses
    monkeypatch.setattr(credit_learned, "start", lambda out, pets, args: flags)
    argv = [
        "--rm-base",
        tiny_chat_model_dir,
        "--rm-steps",
        "2",
        "--rm-min-parse-rate",
        "0",
        "--pool",
        "40",
        "--pairs",
        "4",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--eval-posts",
        "8",
        "--out",
        str(out),
        "--results",
        "",
    ]
    assert credit_learned.main([*argv, "--stop-after", "train"]) is None
    made = json.loads((out / "runs.json").read_text())
    selection = json.loads((ROOT / "bench" / "credit" / "credit_selection.json").read_text())
    for row, (arm, rm, critic) in credit_learned.ARMS.items():
        config = json.loads((Path(made["runs"][f"{row}/101"]) / "config.json").read_text())
        chosen = selection["selection"][selection["best_scalar"] if arm == "best scalar" else arm]
        assert (config["lr"], config["kl_coef"]) == (chosen["lr"], chosen["kl_coef"]), row
        assert config["critic"] == critic[1] and f"/{rm}-" in config["reward_model"], row
        assert config["labels"] == ("poor" if arm == "poor_span" else "spans"), row
    for rm in (out / "rms").iterdir():
        __import__("shutil").rmtree(rm)
    result = credit_learned.main(argv)
    table = result["table"]
    assert set(table) == {"SFT", *credit_learned.ARMS}
    assert set(table["Text2Grad"]["versus"]) == set(credit_learned.SCALARS)
    assert set(table["PRM-PPO"]["versus"]) == {"PPO (BT RM, unit std)"}
    for row in credit_learned.ARMS:
        v = table[row]["versus"]["PPO (BT RM, unit std)"]["mistakes"] if row != "PPO (BT RM, unit std)" else None
        assert v is None or v["interval"][0] <= v["difference"] <= v["interval"][1]
    per_post = json.loads((out / "results.json").read_text())["per_post"]
    assert len(per_post) == 1 + len(credit_learned.ARMS) and all(len(b) == 8 for b in per_post.values())
