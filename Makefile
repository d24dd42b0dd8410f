# make test / make demo create .venv on first use; nothing else needs installing by hand.
# make test-newest does the same in .venv-newest with the newest Python the machine has
# (pyenv's; where `pip install jax` gives the newest jax), the other end of what we support.
PYTHON ?= python3
VENV ?= .venv
NEWEST_PYTHON ?= $(shell .ci/newest_python)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: test test-newest demo lint format bench clean

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
	$(BIN)/python benchmarks/numerics_loops.py

clean:
	rm -rf .venv .venv-newest .pytest_cache runs
