"""The PPO loop copied alone: 03_train_policy.py's pure-function section, lifted exactly as a reader would copy it
(between its two section banners) into a file with nothing but `import torch` and `from dataclasses import dataclass`
above it, trains a tiny language model built here to stop saying one token, with the section's own ppo_update: the
update 03's train() runs, not a copy of it, called by the section's one_iteration. iterate() below is the whole of what
a reader writes around it."""

import ast
import builtins
import copy
import dis
import importlib.util

import pytest
import torch

from conftest import ROOT, import_script

BAD, VOCAB, T, B = 3, 6, 8, 64  # the penalised token; a bigram LM over 6 tokens; rollouts of 8 tokens, 64 at a time
PRELUDE = "import torch\nfrom dataclasses import dataclass\n"  # what the section needs above it (README)


def pure_section() -> str:
    """The lines between the banner titled "The algorithm" and the next banner of 03_train_policy.py."""
    lines = (ROOT / "03_train_policy.py").read_text(encoding="utf-8").splitlines(keepends=True)
    rule = lambda i: lines[i].startswith("# ---")  # noqa: E731
    title = next(i for i, line in enumerate(lines) if line.startswith("# The algorithm"))
    end = next(i for i in range(title + 2, len(lines)) if rule(i) and lines[i + 1].startswith("# "))
    assert rule(title - 1) and rule(title + 1)
    return "".join(lines[title + 2 : end])


def foreign_imports(source: str) -> list[str]:
    """What `source` imports, anywhere in it, besides torch."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or ".")
    return [n for n in names if n.split(".")[0] != "torch"]


def unresolved_globals(module) -> set[str]:
    """Global names the module's functions read that neither it nor the builtins define (np, common, ...)."""
    classes = [c for c in vars(module).values() if isinstance(c, type)]
    defs = [*vars(module).values(), *(f for c in classes for f in vars(c).values())]
    missing, codes = (
        set(),
        [f.__code__ for f in defs if getattr(f, "__code__", None) and f.__code__.co_filename == module.__file__],
    )  # its own functions and methods (not dataclass's, nor those it makes)
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if hasattr(c, "co_code")]
        missing |= {
            i.argval
            for i in dis.get_instructions(code)
            if i.opname == "LOAD_GLOBAL" and i.argval not in vars(module) and not hasattr(builtins, i.argval)
        }
    return missing


def load_copy(tmp_path, section: str):
    path = tmp_path / "ppo_copy.py"
    path.write_text(PRELUDE + section, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("ppo_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TinyLM(torch.nn.Module):
    """A bigram language model with a value head: next-token logits and V from the current token."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)
        self.value = torch.nn.Linear(16, 1)

    def forward(self, ids):  # (B, T + 1) -> logits (B, T, V) of tokens 1..T, values (B, T) of the states before them
        h = torch.tanh(self.embed(ids[:, :-1]))
        return self.out(h), self.value(h).squeeze(-1)

    def next_token_probs(self):  # (V, V): row c, the distribution after token c
        with torch.no_grad():
            return self.out(torch.tanh(self.embed.weight)).softmax(-1)


def sample(model, gen):
    ids = torch.zeros(B, T + 1, dtype=torch.long)
    with torch.no_grad():
        for t in range(T):
            probs = model(ids[:, : t + 2])[0][:, t].softmax(-1)
            ids[:, t + 1] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return ids


def score(model, ids):
    """(log pi(y_t), V(s_t), logits) of the sampled tokens, the shapes 03's forward returns."""
    logits, values = model(ids)
    return logits.log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(-1), values, logits


def iterate(ppo, model, reference, optimizer, gen, kl_coef=0.2):
    """Alg. 4 on the tiny LM: steps 1-3 written here, 4-6 the copied section's one_iteration, 03's order."""
    ids = sample(model, gen)  # 1. rollouts y ~ pi_theta
    mask, has_eos = torch.ones(B, T), torch.ones(B, dtype=torch.bool)
    delta = -(ids[:, 1:] == BAD).float()  # 2-3. the critic's delta_t: -1 on the bad token
    with torch.no_grad():
        logprobs, values, _ = score(model, ids)
        ref_logprobs, _, _ = score(reference, ids)
    batch = ppo.Rollouts(mask, has_eos, delta=delta, logprobs=logprobs, values=values)
    hp = ppo.PpoHParams(ppo_epochs=2, num_minibatches=2)
    params = list(model.parameters())
    return ppo.one_iteration(
        batch, ref_logprobs, lambda rows: score(model, ids[rows]), params, optimizer, hp, kl_coef, 1.0, 0.95
    )


def test_the_section_imports_nothing_but_torch():
    section = pure_section()
    for name in ("compute_gae", "ppo_loss", "masked_whiten", "ppo_update", "one_iteration"):
        assert f"def {name}(" in section
    assert foreign_imports(section) == []
    assert foreign_imports("import numpy as np\n" + section) == ["numpy"]  # what the check would catch


def test_the_check_catches_a_name_from_outside(tmp_path):
    section = pure_section().replace(
        "def masked_mean(x, mask, dim=None):\n", "def masked_mean(x, mask, dim=None):\n    np.zeros(1)\n", 1
    )
    assert unresolved_globals(load_copy(tmp_path, section)) == {"np"}


def test_the_copied_update_is_the_one_03_runs(tmp_path):
    """The section's ppo_update is the function 03's update() calls, byte code for byte code, and train() calls it."""
    ppo, copied = import_script("03_train_policy"), load_copy(tmp_path, pure_section())
    assert copied.ppo_update.__code__.co_code == ppo.ppo_update.__code__.co_code
    assert "ppo_update" in ppo.update.__code__.co_names and "update" in ppo.train.__code__.co_names


def test_the_copied_loop_trains_a_tiny_lm_away_from_one_token(tmp_path):
    ppo = load_copy(tmp_path, pure_section())
    assert unresolved_globals(ppo) == set()  # every name it reads is its own, torch's or a builtin
    torch.manual_seed(0)
    model, gen = TinyLM(), torch.Generator().manual_seed(0)
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.next_token_probs()
    for _ in range(20):
        stats, epochs = iterate(ppo, model, reference, optimizer, gen)
        assert epochs == 2 and len(stats) == 4  # 2 epochs of 2 minibatches
        assert set(stats[0]) >= {"policy/approx_kl", "policy/clipfrac", "losses/policy_loss", "losses/value_loss"}
    after = model.next_token_probs()
    others = [v for v in range(VOCAB) if v != BAD]
    assert after[:, BAD].mean() < 0.2 * before[:, BAD].mean()  # the penalised token's probability falls (~0.14)
    assert (after[:, others].sum(-1) > before[:, others].sum(-1)).all()  # after every token: it goes to the others
    share = lambda p: p[:, others] / p[:, others].sum(-1, keepdim=True)  # noqa: E731  the others, renormalised
    moved = 0.5 * (share(after) - share(before)).abs().sum(-1)  # total variation, per context token
    assert moved.max() < 0.15 and 0.5 * (share(after).mean(0) - share(before).mean(0)).abs().sum() < 0.08  # kept


@pytest.mark.parametrize("line", ["import numpy as np", "from common import masked_mean as _m"])
def test_a_section_that_imports_more_than_torch_fails_the_check(line):
    assert foreign_imports(line + "\n" + pure_section())  # the test above would fail on it


def test_train_takes_the_steps_of_the_sections_one_iteration(monkeypatch):
    """03's train() gets r_t, A_t and the returns by global_advantages; the section's one_iteration, from the same
    rollouts (ragged, some cut off before their EOS), gives ppo_update the same ones, bit for bit, with 03's defaults
    (--reward-mode span --advantage gae): a reader's copy runs 03's order, the missing-EOS penalty included."""
    ppo = import_script("03_train_policy")
    args = ppo.parse_args(["--missing-eos-penalty", "1.0"])
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()  # (B, T) ragged
    has_eos = torch.rand(B, generator=g) < 0.5
    delta = torch.randint(-1, 2, (B, T), generator=g).float() * mask
    logprobs, ref_logprobs, values = (torch.randn(B, T, generator=g) * mask for _ in range(3))
    seen = []
    monkeypatch.setattr(ppo, "ppo_update", lambda score, batch, *a, **k: seen.append(batch))
    ours = ppo.Rollouts(mask, has_eos, delta=delta, logprobs=logprobs, values=values)
    ppo.one_iteration(ours, ref_logprobs, None, [], None, None, args.kl_coef, args.gamma, args.lam, 1.0)
    b = ppo.Rollouts(mask, has_eos, delta=delta, values=values, kl=ppo.per_token_kl(logprobs, ref_logprobs) * mask)
    g03 = ppo.global_advantages(b, args.kl_coef, args, rank=0)
    assert seen == [ours] and (~has_eos).any() and args.reward_mode == "span" and args.advantage == "gae"
    for theirs, mine in ((g03.rewards, ours.rewards), (b.advantages, ours.advantages), (b.returns, ours.returns)):
        assert torch.equal(theirs, mine)


def copy_the_loop() -> tuple[str, str]:
    """docs/copy_the_loop.md's two blocks: the bash that copies the section, the script written around it."""
    page = (ROOT / "docs" / "copy_the_loop.md").read_text(encoding="utf-8")
    return page.split("```bash\n")[1].split("```")[0], page.split("```python\n")[1].split("```")[0]


def run_copy_the_loop(tmp_path, model_dir, iterations=2):
    """The page's blocks as written: the bash from the repository's root (HOME: tmp_path), the script in the folder it
    made, with nothing of this repository on its path. Returns the folder and the script's output."""
    import os
    import subprocess
    import sys

    import forkserver

    copy, script = copy_the_loop()
    env = dict(os.environ)
    assert str(ROOT) not in env.get("PYTHONPATH", "")  # the script's own folder is all its path holds of ours
    subprocess.run(["bash", "-c", copy], cwd=ROOT, env={**env, "HOME": str(tmp_path)}, check=True)
    project = tmp_path / "my_project"
    (project / "train.py").write_text(script, encoding="utf-8")
    proc = forkserver.run(
        [sys.executable, str(project / "train.py"), str(model_dir), str(iterations)],
        cwd=project, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return project, proc.stdout


def test_copy_the_loop_runs_as_written(tmp_path, tiny_model_dir):
    """docs/copy_the_loop.md: its bash copies exactly the section these tests load, and its script, at most ~120 lines,
    trains a Hugging Face causal LM with it (the tiny Llama here; SmolLM2 in test_real_model.py)."""
    project, out = run_copy_the_loop(tmp_path, tiny_model_dir)
    assert (project / "ppo_core.py").read_text(encoding="utf-8") == PRELUDE + pure_section()
    assert len(copy_the_loop()[1].splitlines()) <= 120
    assert [line.split(":")[0] for line in out.splitlines()] == ["iteration 1", "iteration 2"]
