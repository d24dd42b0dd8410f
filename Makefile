# make test / make demo create .venv on first use, make docs .venv-docs; nothing else needs
# installing by hand.
# make test-newest does the same in .venv-newest with the newest Python the machine has
# (pyenv's; where `pip install jax` gives the newest jax), the other end of what we support.
PYTHON ?= python3
VENV ?= .venv
NEWEST_PYTHON ?= $(shell .ci/newest_python)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
PYTEST_WORKERS ?= 2
comma := ,
# Extra pytest arguments (e.g. make test PYTEST_ARGS="-k explain").
PYTEST_ARGS ?=
# jmp_rewrite needs Python >= 3.11: an interpreter older than that is refused with its version.
PY_OK := import sys; sys.exit(sys.version_info < (3, 11))

# A $(VENV) whose interpreter is gone or older than 3.11 (made by an old python3 before) is
# stale whatever its stamps say: its stamps are rebuilt, and the recipe below remakes it.
ifneq ($(wildcard $(VENV)),)
ifneq ($(shell $(BIN)/python -c '$(PY_OK)' 2>/dev/null && echo ok),ok)
.PHONY: $(STAMP) $(DEMO_STAMP) $(DOCS_STAMP)
endif
endif

# $(call venv,EXTRAS): (re)make $(VENV) with a good interpreter, then install '.[EXTRAS]'.
define venv
	@$(PYTHON) -c '$(PY_OK)' || { echo "$(PYTHON) is $$($(PYTHON) -V 2>&1); jmp_rewrite \
	needs >= 3.11: run make PYTHON=python3.11 (or newer)"; exit 1; }
	@$(BIN)/python -c '$(PY_OK)' 2>/dev/null || { rm -rf $(VENV) && \
	echo "Creating $(VENV) with $(PYTHON)" && $(PYTHON) -m venv $(VENV); }
	@echo "Installing jmp_rewrite[$(1)] into $(VENV) (first use only; a minute or two)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(1)]'
endef

# make gpu-memory: the GPU memory of the GPU benchmark's train steps, compiled for an H200 on
# this CPU-only machine (benchmarks/gpu_memory.py); its own environment, .venv-gpu, holds jax
# with the CUDA plugin (~5.6 GB of wheels: never part of make test). ARGS go to the script,
# e.g. make gpu-memory ARGS="--models gpt --dtypes bf16".
GPU_VENV ?= .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
GPU_JAX ?= 0.11.2
GPU_PYTHON ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3))),python3)

$(STAMP): pyproject.toml
	$(call venv,test$(comma)demo)
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	$(call venv,demo)
	touch $(DEMO_STAMP)

$(DOCS_STAMP): pyproject.toml
	$(call venv,docs)
	touch $(DOCS_STAMP)

.PHONY: test test-newest demo docs package package-check lint format bench figures gpu-memory \
  tpu-memory tpu-smoke mutants goldens clean

LINTED := jmp_rewrite tests benchmarks tools docs/conf.py docs/_ext

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

test: $(STAMP) lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS) tests
	if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --nbmake notebooks; fi

# The other end of the range runs the library's tests only. Lint, the notebooks and the tests
# marked `once` (README blocks, each in a fresh interpreter; the GPU benchmark's smoke run)
# use only the public API, whose version-specific parts (_jax_compat.py, higher_order.py) the
# library's tests check at both ends: they run once, in `make test`. CI (.ci/run) runs both.
test-newest:
	$(MAKE) .venv-newest/.installed VENV=.venv-newest PYTHON="$(NEWEST_PYTHON)"
	.venv-newest/bin/python -m pytest -n $(PYTEST_WORKERS) -m "not once" $(PYTEST_ARGS) tests

demo: $(DEMO_STAMP)
	$(BIN)/python -m jmp_rewrite demo $(ARGS)

# make docs: the documentation site (docs/, Sphinx + myst-nb) into docs/_build/html, in its own
# environment, .venv-docs. Warnings are errors (-W, reported all at once with --keep-going) and
# every cross-reference is checked (-n); nothing is fetched from the network. The notebooks run
# while the site is built (cached in docs/_build/.jupyter_cache); the painting diagram, the
# explain report and the benchmark plots are generated then too (docs/_ext).
DOCS_VENV ?= .venv-docs
docs:
	$(MAKE) $(DOCS_VENV)/.installed-docs VENV=$(DOCS_VENV)
	JAX_PLATFORMS=cpu $(DOCS_VENV)/bin/python -m sphinx -W --keep-going -n -q -b html \
	  docs docs/_build/html
	@echo "The site: docs/_build/html/index.html"

# make package: the wheel and the sdist into dist/ (python -m build, in a throw-away
# environment). make package-check (CI) also installs the wheel into a virtual environment made
# from nothing and runs the README's Example against it from outside the checkout (.ci/package).
package:
	PYTHON=$(PYTHON) .ci/package

package-check:
	PYTHON=$(PYTHON) .ci/package --check

format: $(STAMP)
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

bench: $(STAMP)
	$(BIN)/python benchmarks/rewrite_overhead.py
	$(BIN)/python benchmarks/loss_scale_overhead.py
	$(BIN)/python benchmarks/numerics_vs_handwritten.py
	$(BIN)/python benchmarks/numerics_loops.py

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(GPU_PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q "jax[cuda12]==$(GPU_JAX)" flax -e .
	touch $(GPU_STAMP)

gpu-memory: $(GPU_STAMP)
	$(GPU_VENV)/bin/python benchmarks/gpu_memory.py --out runs/gpu_memory.json $(ARGS)

# make tpu-memory: the same train steps compiled for one chip of a TPU v5e, v5p and v6e on this
# CPU-only machine (benchmarks/gpu_memory.py --target v5e ...; libtpu compiles, no TPU is
# used): peak HBM, bytes accessed and XLA:TPU's cost-model estimate of the step's time. Its own
# environment, .venv-tpu, holds jax with libtpu (never part of make test). The generations
# compile one after another (libtpu allows one process at a time). TPU_TARGETS picks them and
# ARGS go to the script, e.g. make tpu-memory TPU_TARGETS=v5p ARGS="--models gpt --smoke".
# The steps are rewritten with dtype=jnp.bfloat16 given (dtype=None, decided where the program
# is lowered, would give bfloat16 too).
TPU_VENV ?= .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed
TPU_JAX ?= 0.12.0.1
TPU_TARGETS ?= v5e v5p v6e

$(TPU_STAMP): pyproject.toml
	test -x $(TPU_VENV)/bin/python || $(GPU_PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q "jax[tpu]==$(TPU_JAX)" flax pytest pytest-env \
	  hypothesis -e .
	touch $(TPU_STAMP)

tpu-memory: $(TPU_STAMP)
	for t in $(TPU_TARGETS); do \
	  $(TPU_VENV)/bin/python benchmarks/gpu_memory.py --target $$t \
	    --out runs/tpu_memory-$$t.json $(ARGS) || exit 1; done

# make tpu-smoke: the TPU tests of tests/test_gpu_memory_smoke.py (toy sizes, a v5p target),
# which make test skips where libtpu is not installed.
tpu-smoke: $(TPU_STAMP)
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(TPU_VENV)/bin/python -m pytest -q \
	  tests/test_gpu_memory_smoke.py -k tpu

# make goldens: rewrite the painting goldens (tests/goldens/, checked by tests/test_goldens.py)
# from the code, on both JAX ends (the floor's base files first), and print the diff to review
# and commit with the change that caused it. ARGS="-k models" for one family.
goldens: $(STAMP)
	$(MAKE) .venv-newest/.installed VENV=.venv-newest PYTHON="$(NEWEST_PYTHON)"
	$(BIN)/python tools/goldens.py --bless $(ARGS)
	.venv-newest/bin/python tools/goldens.py --bless $(ARGS)

# By hand, never in CI: each mutant of tools/mutant_list.py against its tests (see README).
mutants: $(STAMP)
	$(BIN)/python tools/mutants.py $(ARGS)

clean:
	rm -rf .venv .venv-newest .venv-gpu .venv-tpu .venv-docs .pytest_cache runs docs/_build \
	  docs/_generated dist build jmp_rewrite.egg-info
