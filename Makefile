# Two commands do everything on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-x64 demo bench lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,demo,bench]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/pyright

test: lint
	$(BIN)/pytest
	$(MAKE) --no-print-directory test-x64

test-x64: $(STAMP)
	JAX_ENABLE_X64=1 $(BIN)/pytest -q tests

demo: $(STAMP)
	$(BIN)/python examples/dp_sgd_digits.py

bench: $(STAMP)
	$(BIN)/python benchmarks/compare.py
	$(BIN)/python benchmarks/accumulation.py

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV)
