#!/usr/bin/env bash
# A virtual environment of its own for SkyRL (issue 79): skyrl 0.3.0 pins transformers at most 5.8, so it never goes
# into the project's venv. tests/test_skyrl.py's SkyRL half runs where T2G_SKYRL_VENV names it (else it skips).
#   tools/skyrl_env.sh /opt/skyrl-venv && T2G_SKYRL_VENV=/opt/skyrl-venv python -m pytest tests/test_skyrl.py
set -euo pipefail
venv="${1:?usage: tools/skyrl_env.sh VENV_DIR}"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install torch==2.13.0 ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}  # the CPU wheel, as the Makefile's
"${pip[@]}" install "skyrl==0.3.0" jaxtyping loguru
"$venv/bin/python" -c "import skyrl, transformers; print('skyrl ok, transformers', transformers.__version__)"
