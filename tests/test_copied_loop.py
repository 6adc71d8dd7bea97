"""The PPO loop copied alone: 03_train_policy.py's pure-function section, lifted exactly as a reader would copy it
(between its two section banners) into a file with nothing but `import torch` above it, and the README's lines that
call it, train a tiny language model built here to stop saying one token."""
import ast
import builtins
import copy
import dis
import importlib.util
import re

import pytest
import torch

from conftest import ROOT

BAD, VOCAB, T, B = 3, 6, 8, 64  # the penalised token; a bigram LM over 6 tokens; rollouts of 8 tokens, 64 at a time


def pure_section() -> str:
    """The lines between the banner titled "The algorithm" and the next banner of 03_train_policy.py."""
    lines = (ROOT / "03_train_policy.py").read_text(encoding="utf-8").splitlines(keepends=True)
    rule = lambda i: lines[i].startswith("# ---")  # noqa: E731
    title = next(i for i, line in enumerate(lines) if line.startswith("# The algorithm"))
    end = next(i for i in range(title + 2, len(lines)) if rule(i) and lines[i + 1].startswith("# "))
    assert rule(title - 1) and rule(title + 1)
    return "".join(lines[title + 2:end])


def readme_loop() -> str:
    """The README's fenced block that calls the section's functions in order (paper -> code)."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    return next(b for b in blocks if "def ppo_iteration(" in b)


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
    missing, codes = set(), [f.__code__ for f in vars(module).values() if callable(f) and hasattr(f, "__code__")]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if hasattr(c, "co_code")]
        missing |= {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"
                    and i.argval not in vars(module) and not hasattr(builtins, i.argval)}
    return missing


def load_copy(tmp_path, section: str):
    path = tmp_path / "ppo_copy.py"
    path.write_text("import torch\n" + section, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("ppo_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TinyLM(torch.nn.Module):
    """A bigram language model with a value head: next-token logits and V from the current token."""

    def __init__(self):
        super().__init__()
        self.embed, self.out, self.value = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB), \
            torch.nn.Linear(16, 1)

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
            probs = model(ids[:, :t + 2])[0][:, t].softmax(-1)
            ids[:, t + 1] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return ids


def token_logprobs(model, ids):
    logits, values = model(ids)
    return logits.log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(-1), values


def test_the_section_imports_nothing_but_torch():
    section = pure_section()
    assert "def compute_gae(" in section and "def ppo_loss(" in section and "def masked_whiten(" in section
    assert foreign_imports(section) == []
    assert foreign_imports("import numpy as np\n" + section) == ["numpy"]  # what the check would catch


def test_the_check_catches_a_name_from_outside(tmp_path):
    section = pure_section().replace("def masked_mean(x, mask, dim=None):\n",
                                     "def masked_mean(x, mask, dim=None):\n    np.zeros(1)\n", 1)
    assert unresolved_globals(load_copy(tmp_path, section)) == {"np"}


def test_the_copied_loop_trains_a_tiny_lm_away_from_one_token(tmp_path):
    ppo = load_copy(tmp_path, pure_section())
    assert unresolved_globals(ppo) == set()  # every name it reads is its own, torch's or a builtin
    namespace = dict(vars(ppo))
    exec(readme_loop(), namespace)  # the README's lines, as a reader lifts them
    torch.manual_seed(0)
    model, gen = TinyLM(), torch.Generator().manual_seed(0)
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.next_token_probs()
    for _ in range(20):
        ids = sample(model, gen)
        mask = torch.ones(B, T)
        delta = -(ids[:, 1:] == BAD).float()  # delta_t = -1 on the penalised token, 0 elsewhere
        with torch.no_grad():
            old_logprobs, old_values = token_logprobs(model, ids)
            ref_logprobs, _ = token_logprobs(reference, ids)
        stats = namespace["ppo_iteration"](lambda: token_logprobs(model, ids), optimizer, delta, mask, old_logprobs,
                                           ref_logprobs, old_values)
        assert set(stats) >= {"policy/approx_kl", "policy/clipfrac"}
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
