"""README "Your own data": its four commands, run as written on a file of another world than the demo's
(tests/data/own_data.jsonl: capital cities), offline. The Qwen models are a tiny chat model, the served critic is the
fake OpenAI-compatible server of conftest.py (it knows each capital and quotes the response's city), and the sizes
are cut to a few steps; every other flag is the README's."""

import json
import os
import re
import subprocess
import sys

from conftest import ROOT
from test_readme import readme_commands

import common

DATA = ROOT / "tests" / "data" / "own_data.jsonl"
CAPITALS = {r["prompt"]: r["capital"] for r in common.read_jsonl(DATA)}
SMALL = {  # fewer steps and tokens; flags given again win over the README's
    "01_annotate.py": ["--concurrency", "2"],
    "02_train_reward.py": [
        "--max-steps",
        "3",
        "--batch-size",
        "4",
        "--grad-accum",
        "1",
        "--max-len",
        "256",
        "--max-new-tokens",
        "32",
        "--val-frac",
        "0.25",
        "--eval-limit",
        "2",
        "--device",
        "cpu",
        "--logging-steps",
        "1",
        "--min-parse-rate",
        "0",
    ],  # 3 steps teach no format
    "03_train_policy.py": [
        "--max-fail-share",
        "1",  # a 3-step reward model: few critiques parse yet
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--num-minibatches",
        "2",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "8",
        "--critic-max-new-tokens",
        "24",
        "--device",
        "cpu",
    ],
    "04_evaluate.py": ["--max-new-tokens", "8", "--rm-max-new-tokens", "24", "--device", "cpu", "--bootstrap", "50"],
}


def recipe() -> list[tuple[str, list[str]]]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme_commands(readme.split("\n## Your own data\n", 1)[1].split("\n## ", 1)[0])


def critic(body, n):
    """A served critic that knows the capitals: the response's city is a good span when right, a poor one when not."""
    user = body["messages"][-1]["content"]
    prompt = user.split("### Task\n", 1)[1].split("\n\n###", 1)[0]
    response = user.split("### Response\n", 1)[1].split("\n\n###", 1)[0]
    city, capital = response.rstrip(".").split()[-1], CAPITALS[prompt]
    right = city == capital
    return (
        f"Reasoning: the capital is {capital}.\n```json\n"
        + json.dumps(
            {
                "critique": f"It names {city}, {'right' if right else f'but the capital is {capital}'}.",
                "good_spans": [city] if right else [],
                "poor_spans": [] if right else [city],
            }
        )
        + "\n```"
    )


def test_the_readme_recipe_runs_on_your_own_data(tmp_path, tiny_chat_model_dir, fake_openai):
    commands = recipe()
    assert [script for script, _ in commands] == [
        "01_annotate.py",
        "02_train_reward.py",
        "03_train_policy.py",
        "04_evaluate.py",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    with fake_openai(critic) as server:
        swap = {
            "my_data.jsonl": str(DATA),
            "my_heldout.jsonl": str(DATA),
            "http://localhost:8000/v1": server.base_url,
            "Qwen/Qwen2.5-1.5B-Instruct": tiny_chat_model_dir,
        }
        for script, args in commands:
            argv = [re.sub("|".join(map(re.escape, swap)), lambda m: swap[m[0]], a) for a in args] + SMALL[script]
            proc = subprocess.run(
                [sys.executable, str(ROOT / script), *argv], capture_output=True, text=True, cwd=tmp_path, env=env
            )
            assert proc.returncode == 0, f"{script}:\n{proc.stderr[-3000:]}"
            assert "FutureWarning" not in proc.stderr, proc.stderr[-3000:]  # issue 46: no noise either
            if script == "03_train_policy.py":
                assert re.search(r"critic \(local\): \d+ of 8 critiques failed in this run", proc.stdout)
    mine = tmp_path / "runs" / "mine"
    annotations = common.read_jsonl(mine / "annotations.jsonl")
    assert len(annotations) == 12 and {r["status"] for r in annotations} == {"ok"}
    wrong = {r["id"]: r["poor_spans"] for r in annotations if r["poor_spans"]}
    assert wrong == {
        "japan": ["Kyoto"],
        "canada": ["Toronto"],
        "norway": ["Bergen"],
        "australia": ["Sydney"],
        "poland": ["Krakow"],
    }
    rm = mine / "reward_model"
    assert json.loads((rm / "reward_model.json").read_text())["train"]["steps"] == 3
    assert json.loads((rm / "eval.json").read_text())["n"] == 2 and (rm / "adapter_config.json").is_file()
    assert len(common.read_jsonl(mine / "text2grad" / "metrics.jsonl")) == 2
    assert (mine / "text2grad" / "policy" / "value_head.pt").is_file()
    results = json.loads((mine / "results.json").read_text())
    assert set(results["policies"]) == {"base", "text2grad"} and results["n_prompts"] == 12
    assert "rm/parse_rate" in results["policies"]["text2grad"]["metrics"] and (mine / "report.html").is_file()
