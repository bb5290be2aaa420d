# Two commands do everything on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-x64 demo bench lint format clean docs

$(STAMP): pyproject.toml
	@echo "Creating $(VENV) and installing the package with its extras (first run: a few minutes)..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,demo,bench,docs,examples]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/pyright

test: lint docs
	$(BIN)/pytest
	$(MAKE) --no-print-directory test-x64

test-x64: $(STAMP)
	JAX_ENABLE_X64=1 $(BIN)/pytest -q tests

# The site, from docs/ and the docstrings, into site/; warnings are errors (mkdocs.yml).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: $(STAMP)
	$(BIN)/python examples/dp_sgd_digits.py

bench: $(STAMP)
	$(BIN)/python benchmarks/compare.py
	$(BIN)/python benchmarks/accumulation.py
	$(BIN)/python benchmarks/remainder.py
	$(BIN)/python benchmarks/plots.py

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV)
