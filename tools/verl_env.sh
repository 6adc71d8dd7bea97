#!/usr/bin/env bash
# A virtual environment of its own for verl (issue 79): verl 0.9.1 pins transformers below 5.11 and pulls ray, so it
# never goes into the project's venv. tests/test_verl.py runs where T2G_VERL_VENV names it (else it skips, saying so).
#   tools/verl_env.sh /opt/verl-venv && T2G_VERL_VENV=/opt/verl-venv python -m pytest tests/test_verl.py
set -euo pipefail
venv="${1:?usage: tools/verl_env.sh VENV_DIR}"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install torch==2.13.0 ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}  # the CPU wheel, as the Makefile's
"${pip[@]}" install "verl==0.9.1" "transformers>=5.5.3,<5.11" "peft==0.21.*" openai
"$venv/bin/python" -c "import verl, transformers; print('verl', verl.__version__, 'transformers', transformers.__version__)"
