# make test / make demo create .venv on first use; nothing else needs installing by hand.
# make test-newest does the same in .venv-newest with the newest Python the machine has
# (pyenv's; where `pip install jax` gives the newest jax), the other end of what we support.
PYTHON ?= python3
VENV ?= .venv
NEWEST_PYTHON ?= $(shell .ci/newest_python)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

# make gpu-memory: the GPU memory of the GPU benchmark's train steps, compiled for an H200 on
# this CPU-only machine (benchmarks/gpu_memory.py); its own environment, .venv-gpu, holds jax
# with the CUDA plugin (~5.6 GB of wheels: never part of make test). ARGS go to the script,
# e.g. make gpu-memory ARGS="--models gpt --dtypes bf16".
GPU_VENV ?= .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
GPU_JAX ?= 0.11.2
GPU_PYTHON ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3))),python3)

.PHONY: test test-newest demo lint format bench gpu-memory clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,demo]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check jmp_rewrite tests benchmarks
	$(BIN)/ruff format --check jmp_rewrite tests benchmarks

test: $(STAMP) lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) tests
	if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --nbmake notebooks; fi

test-newest:
	$(MAKE) test VENV=.venv-newest PYTHON="$(NEWEST_PYTHON)"

demo: $(STAMP)
	$(BIN)/python -m jmp_rewrite demo $(ARGS)

format: $(STAMP)
	$(BIN)/ruff format jmp_rewrite tests benchmarks
	$(BIN)/ruff check --fix jmp_rewrite tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/rewrite_overhead.py
	$(BIN)/python benchmarks/loss_scale_overhead.py
	$(BIN)/python benchmarks/numerics_vs_handwritten.py

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(GPU_PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q "jax[cuda12]==$(GPU_JAX)" flax -e .
	touch $(GPU_STAMP)

gpu-memory: $(GPU_STAMP)
	$(GPU_VENV)/bin/python benchmarks/gpu_memory.py --out runs/gpu_memory.json $(ARGS)

clean:
	rm -rf .venv .venv-newest .venv-gpu .pytest_cache runs
