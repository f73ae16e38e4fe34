# megatron-ssd: `make run` (the demo job) and `make test` (the suite). Both create .venv first.
#
# Two pinned environments, one per end of the supported range (docs/compatibility.md):
#   .venv         the newest pair, what a new user gets: Python 3.12, torch 2.14.1, megatron-core 0.19.2
#                 (megatron-core 0.17 and later ship Python 3.12 wheels only);
#   .venv-oldest  the oldest pair: Python 3.11, torch 2.6.0, megatron-core 0.16.1 (torch 2.6 is setup.py's
#                 floor and megatron-core 0.16.1's own; its PyPI build is the CUDA 12.4 one: 2.9 GB of
#                 wheels with its nvidia-* ones, 5.5 GB installed; the tests run it on CPU).
# `make test` runs the whole suite in .venv (Megatron-LM core_v0.19.0's pretrain_gpt.py included)
# and, beside it, the Megatron tests in .venv-oldest (Megatron-LM core_v0.16.1's pretrain_gpt.py included).
# setup.py itself takes ranges; these pins are only for reproducible runs here.
VENV := .venv
OLDEST := .venv-oldest
PY := $(VENV)/bin/python
OLDEST_PY := $(OLDEST)/bin/python
TORCH_VERSION := 2.14.1
CORE_VERSION := 0.19.2
OLDEST_TORCH_VERSION := 2.6.0
OLDEST_CORE_VERSION := 0.16.1
# An interpreter of the given version: $PYTHON312 / $PYTHON311, else python3.X on PATH, else pyenv's.
find_python = $(shell for p in $(1) python$(2) $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(2).*/bin/python$(2) 2>/dev/null | sort -V | tail -n 1); do \
	"$$p" -c 'import sys; sys.exit(0)' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
PYTHON312 ?= $(call find_python,$(PYTHON312_ENV),3.12)
PYTHON311 ?= $(call find_python,$(PYTHON311_ENV),3.11)

.PHONY: run test test-fast test-default test-oldest venv clean

# $(call build_venv,DIR,PYTHON,TORCH,MEGATRON_CORE,PYTHON_VERSION,OVERRIDE_VARIABLE)
# setuptools is upgraded with pip: tests/test_install.py builds the checkout without build isolation,
# which needs setuptools 70.1 or later (bdist_wheel built in); torch 2.6 does not bring it on Python 3.11.
# The editable install maps megatron_ssd only; megatron_ssd_lab.pth puts the checkout on the path too, so
# the lab package (the GPU check, the sizing tables, `rok --throttle`'s cgroup throttle), which the wheel
# does not ship, imports in every process of these environments.
define build_venv
	@test -n "$(2)" || { echo "megatron_ssd: make needs Python $(5) (python$(5) on PATH, or $(6)=/path/to/python$(5))"; exit 2; }
	@test -x $(1)/bin/python || $(2) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip setuptools
	$(1)/bin/python -m pip install -q torch==$(3) megatron-core==$(4)
	$(1)/bin/python -m pip install -q -e '.[dev,megatron-lm]'
	$(1)/bin/python -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/megatron_ssd_lab.pth", "w").write(sys.argv[1] + "\n")' "$(CURDIR)"
	@touch $(1)/.installed
endef

$(VENV)/.installed: setup.py Makefile
	$(call build_venv,$(VENV),$(PYTHON312),$(TORCH_VERSION),$(CORE_VERSION),3.12,PYTHON312)

$(OLDEST)/.installed: setup.py Makefile
	$(call build_venv,$(OLDEST),$(PYTHON311),$(OLDEST_TORCH_VERSION),$(OLDEST_CORE_VERSION),3.11,PYTHON311)

venv: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/megatron-ssd train --config configs/demo.yaml

# The two environments' suites run side by side (each is one pytest process): much of a suite's
# time is spent waiting on child processes (Megatron-LM ranks, SLURM jobs, signals), so the
# oldest pair's tests fit in the default suite's time on 2 cores. -O prints each suite's output
# whole when it ends; the run fails if either fails.
test:
	$(MAKE) --no-print-directory -j2 -O test-default test-oldest

# The tests that start no process and are not slow (NOTE [Test tiers] in tests/conftest.py): a quick
# answer while developing.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not e2e and not slow" $(PYTEST_ARGS)

test-default: $(VENV)/.installed
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

test-oldest: $(OLDEST)/.installed
	$(OLDEST_PY) -m pytest -q tests/megatron tests/test_install.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST) .pytest_cache build *.egg-info

# `make gpu-check`: one command that checks the GPU paths in a short GPU window (scripts/gpu_check.sh,
# docs/getting-started.md "GPU check"): GPU_CHECK_OUT gets gpu-check.json and gpu-check.log, GPU_CHECK_ARGS
# more options (--path DIR, --budget SECONDS, ...). Without a GPU it runs what needs none and skips the rest,
# saying why. `make gpu-wheels` fills .whl, the wheel folder it installs from, where the package index is reachable.
GPU_CHECK_OUT ?= benchmarks/out/gpu-check
.PHONY: gpu-check gpu-wheels

gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-wheels:
	bash scripts/gpu_wheels.sh --core-version $(CORE_VERSION)

# `make slurm-deps`: Debian's SLURM and munge for the SLURM tests (tests/scripts/test_slurm_jobs.py start a
# private two-node SLURM), with apt-get as root or through sudo; nothing when installed. Without them, or
# without root, those tests skip with the reason; .ci/run installs them and sets MEGATRON_SSD_REQUIRE_SLURM=1,
# which turns the skip into a failure (docs/cluster.md, "Tested under SLURM").
.PHONY: slurm-deps

slurm-deps:
	bash scripts/slurm_test_deps.sh
