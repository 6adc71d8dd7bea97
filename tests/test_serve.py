"""Stages 1, 3 and 4 against a real OpenAI-compatible server running a real model: `transformers serve` with
SmolLM2-135M-Instruct (conftest.smollm2_server), through the official openai client, as a user runs them. What only a
real server shows: its own error texts, its model-name rules, its tokenization of a raw prompt, its timing."""
from pathlib import Path

import common


def test_the_smollm2_export_is_readable_by_a_server(smollm2_dir):
    """tools/smollm2.py's folder is an ordinary model folder: every file readable as the umask allows (safetensors
    writes its weights 0600, which a server run as another user cannot read)."""
    modes = {f.name: f.stat().st_mode & 0o777 for f in Path(smollm2_dir).iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~common._UMASK}, modes
