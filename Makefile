# megatron-ssd: `make run` (the demo job) and `make test` (the suite). Both create .venv first.
#
# Two pinned environments, one per end of the supported range (docs/compatibility.md):
#   .venv         the newest pair, what a new user gets: Python 3.12, torch 2.14.1, megatron-core 0.19.2
#                 (megatron-core 0.17 and later ship Python 3.12 wheels only);
#   .venv-oldest  the oldest pair: Python 3.11, torch 2.13.0, megatron-core 0.16.1.
# `make test` runs the whole suite in .venv (Megatron-LM core_v0.19.0's pretrain_gpt.py included),
# then the Megatron tests in .venv-oldest (Megatron-LM core_v0.16.1's pretrain_gpt.py included).
# setup.py itself takes ranges; these pins are only for reproducible runs here.
VENV := .venv
OLDEST := .venv-oldest
PY := $(VENV)/bin/python
OLDEST_PY := $(OLDEST)/bin/python
TORCH_VERSION := 2.14.1
CORE_VERSION := 0.19.2
OLDEST_TORCH_VERSION := 2.13.0
OLDEST_CORE_VERSION := 0.16.1
# An interpreter of the given version: $PYTHON312 / $PYTHON311, else python3.X on PATH, else pyenv's.
find_python = $(shell for p in $(1) python$(2) $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(2).*/bin/python$(2) 2>/dev/null | sort -V | tail -n 1); do \
	"$$p" -c 'import sys; sys.exit(0)' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
PYTHON312 ?= $(call find_python,$(PYTHON312_ENV),3.12)
PYTHON311 ?= $(call find_python,$(PYTHON311_ENV),3.11)

.PHONY: run test test-default test-oldest venv clean

$(VENV)/.installed: setup.py Makefile
	@test -n "$(PYTHON312)" || { echo "megatron_ssd: make needs Python 3.12 (python3.12 on PATH, or PYTHON312=/path/to/python3.12)"; exit 2; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION) megatron-core==$(CORE_VERSION)
	$(PY) -m pip install -q -e '.[dev,megatron-lm]'
	@touch $@

$(OLDEST)/.installed: setup.py Makefile
	@test -n "$(PYTHON311)" || { echo "megatron_ssd: make test needs Python 3.11 (python3.11 on PATH, or PYTHON311=/path/to/python3.11)"; exit 2; }
	@test -x $(OLDEST_PY) || $(PYTHON311) -m venv $(OLDEST)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q torch==$(OLDEST_TORCH_VERSION) megatron-core==$(OLDEST_CORE_VERSION)
	$(OLDEST_PY) -m pip install -q -e '.[dev,megatron-lm]'
	@touch $@

venv: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/megatron-ssd train --config configs/gpt-tiny.yaml

test: test-default test-oldest

test-default: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-oldest: $(OLDEST)/.installed
	$(OLDEST_PY) -m pytest -q tests/megatron tests/test_install.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST) .pytest_cache build *.egg-info
