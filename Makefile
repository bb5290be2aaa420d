# Two commands do everything on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest workers (pytest-xdist); 2 fits the 2 cores the suite is timed on.
WORKERS ?= 2
PYTEST := $(BIN)/pytest -n $(WORKERS) --dist worksteal --durations=15 --durations-min=2
# The main suite's CPU programs are compiled with LLVM at -O0: the suite is compile-bound,
# and this takes about 40% less CPU. XLA's own passes (fusion, layout, buffers: what
# decides results, temp bytes and collectives) run as ever; the XLA:CPU miscompile of
# benchmarks/xla_per_example_sum_repro.py reproduces at -O0. Plain `.venv/bin/pytest`
# keeps the default level (docs/internals.md, "The suite's speed").
#
# Every run of the suite also keeps each process to one thread for the arithmetic:
# XLA:CPU's Eigen thread pool (--xla_cpu_multi_thread_eigen=false) and the BLAS under
# numpy. The suite's programs are small and four processes share the 2 cores, so those
# pools only wait on each other: on quiet cores `make test` took 8 min 28 s with them
# off against 9 min 0 s with them on (user CPU 922 s against 980 s), all green either way.
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
QUICK_FLAGS := $(XLA_FLAGS) --xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false
QUICK_CODEGEN := $(ONE_THREAD) XLA_FLAGS="$(QUICK_FLAGS)"
# The tests that do not check a fact of the compiled program (marker `compiled`: temp bytes,
# the HLO) are also compiled with XLA:CPU's legacy emitters, which take about half the
# compile time. Results agree up to float rounding, but some compiled facts move (bf16
# converts, loops of convolutions, temp bytes and so plan's choice), so the `compiled`
# tests run apart at the default emitters (docs/internals.md, "The suite's speed"). The
# legacy emitters split each program's LLVM module in 32 parts, compiled on parallel
# threads; on the 2 cores that the runs side by side keep busy, that buys nothing and
# costs CPU (13 to 15% of a test's on the models of tests/test_statistics.py; nothing on
# small programs), so they take one part. The split decides only which module a kernel is
# compiled in: the HLO, the buffers and each kernel's code are the same. (At the default
# emitters of the `compiled` tests it made no difference.)
FAST_CODEGEN := $(ONE_THREAD) XLA_FLAGS="$(QUICK_FLAGS) --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"

# The files that hold a test marked `compiled` or `x64`: the runs of those tests collect
# only these (collecting every file takes about 9 s of CPU, 4.7 s for these). A mark
# is written `pytest.mark.compiled` or `pytest.mark.x64` in the test's own file; the main
# run, which collects every file, refuses a test marked both (tests/conftest.py).
COMPILED_TESTS = $(shell grep -l 'mark\.compiled' tests/test_*.py)
X64_TESTS = $(shell grep -l 'mark\.x64' tests/test_*.py)

# The engine's tests (ghost norms, statistics, weights, derivatives through the result,
# the primitive table), run again under the flags JAX marks as its next defaults:
# JAX_CUSTOM_VJP3 and JAX_REMAT3 turn a custom_vjp and a checkpoint into primitives of a
# new kind (docs/internals.md, "The primitive table"). Not JAX_SCAN3: on jax 0.10.2,
# jax.grad of any lax.scan fails in JAX itself under it.
ENGINE_TESTS = tests/test_primitive_table.py tests/test_engine_rooms.py tests/test_ghost.py tests/test_statistics.py \
	tests/test_weights.py tests/test_gradients.py tests/test_exact.py tests/test_norm_numerics.py
FUTURE_FLAGS := JAX_CUSTOM_VJP3=1 JAX_REMAT3=1

.PHONY: test test-x64 demo bench bench-device lint format clean docs serve dist

$(STAMP): pyproject.toml
	@echo "Creating $(VENV) and installing the package with its extras (first run: a few minutes)..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[test,demo,bench,docs,examples]'
	touch $(STAMP)

lint: $(STAMP)
	@echo "== ruff: format and lint"
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	@echo "== pyright: types of src, tests, benchmarks and examples (about 20 s)"
	$(BIN)/pyright

# Lint, docs, the suite (the `compiled` tests apart), the `compiled` tests, the x64 tests,
# the engine's tests under JAX's next defaults; README gives the times. The five run side
# by side, so that both cores stay busy to the end (each run alone leaves one core idle
# while its last long item finishes, and pays its own start-up): lint and the docs build
# (pyright and mkdocs keep one core busy for most of a minute), the `compiled` tests, the
# x64 tests and the future-flags run (one process each, held beside the main run's
# workers), their output held until the main run ends. Each run compiles into its own
# cache folder: the runs' XLA flags differ, so they share no program.
test: $(STAMP)
	@echo "== lint and docs, the tests of compiled facts, the x64 tests and the engine's tests under JAX's next defaults beside the main pytest run; their output follows the main run's"
	@echo "== pytest: tests, doctests of src/, README.md and docs/ on $(WORKERS) workers ([done/total] ends each line)"
	@cache=$$(mktemp -d) && checks=$$(mktemp) && compiled=$$(mktemp) && x64=$$(mktemp) && future=$$(mktemp) && \
	  trap 'rm -rf "$$cache" "$$checks" "$$compiled" "$$x64" "$$future"' EXIT && \
	  mkdir "$$cache/main" "$$cache/compiled" "$$cache/x64" "$$cache/future" && \
	  { $(MAKE) --no-print-directory lint docs > "$$checks" 2>&1 & checks_pid=$$!; } && \
	  { ( set -x && $(QUICK_CODEGEN) MICROBATCHING_TEST_CACHE=$$cache/compiled \
	      $(BIN)/pytest --durations=15 --durations-min=2 -m compiled $(COMPILED_TESTS) ) > "$$compiled" 2>&1 & compiled_pid=$$!; } && \
	  { ( set -x && JAX_ENABLE_X64=1 $(FAST_CODEGEN) MICROBATCHING_TEST_CACHE=$$cache/x64 \
	      $(BIN)/pytest -v --durations=15 --durations-min=2 -m "x64 and not compiled" $(X64_TESTS) ) > "$$x64" 2>&1 & x64_pid=$$!; } && \
	  { ( set -x && $(FUTURE_FLAGS) $(FAST_CODEGEN) MICROBATCHING_TEST_CACHE=$$cache/future \
	      $(BIN)/pytest -q --durations=5 --durations-min=2 -m "not compiled" $(ENGINE_TESTS) ) > "$$future" 2>&1 & future_pid=$$!; } && \
	  { ( set -x && $(FAST_CODEGEN) MICROBATCHING_TEST_CACHE=$$cache/main $(PYTEST) -m "not compiled" ); main=$$?; \
	    wait $$checks_pid; lint=$$?; wait $$compiled_pid; comp=$$?; wait $$x64_pid; wide=$$?; \
	    wait $$future_pid; next=$$?; \
	    echo "== make lint docs"; cat "$$checks"; \
	    echo "== pytest: the tests of compiled facts (marker compiled), at XLA's default emitters"; cat "$$compiled"; \
	    echo "== pytest: the tests marked x64 again under JAX_ENABLE_X64=1, a line per test"; cat "$$x64"; \
	    echo "== pytest: the engine's tests again under $(FUTURE_FLAGS), JAX's next defaults"; cat "$$future"; \
	    echo "== exit status: main run $$main, lint and docs $$lint, compiled facts $$comp, x64 $$wide, future flags $$next"; } && \
	  [ $$main -eq 0 ] && [ $$lint -eq 0 ] && [ $$comp -eq 0 ] && [ $$wide -eq 0 ] && [ $$next -eq 0 ]

# The dtype-sensitive tests (marker x64) again with 64-bit JAX, compiled as the main run
# is. None is also marked `compiled` (tests/conftest.py refuses one that is).
test-x64: $(STAMP)
	@echo "== pytest: the tests marked x64 again under JAX_ENABLE_X64=1, a line per test (about 1 min on 2 idle cores)"
	JAX_ENABLE_X64=1 $(FAST_CODEGEN) $(PYTEST) -v -m "x64 and not compiled" $(X64_TESTS)

# The site, from docs/ and the docstrings, into site/; warnings are errors (mkdocs.yml).
docs: $(STAMP)
	@echo "== mkdocs: the site into site/, warnings as errors (about 5 s)"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The site on http://$(SERVE_ADDR)/, rebuilt on every save of a page, a docstring, an
# included example or benchmark table. Not strict, so a broken link while writing does not
# stop the server: `make docs` is the check.
SERVE_ADDR ?= 127.0.0.1:8000
serve: $(STAMP)
	@echo "== mkdocs: serving the docs on http://$(SERVE_ADDR)/ (Ctrl-C stops)"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --no-strict --dev-addr $(SERVE_ADDR) --watch src

# The sdist, and the wheel built from it in an isolated environment, into dist/. The wheel
# alone in a fresh environment is tested by tests/test_wheel.py (part of `make test`).
dist: $(STAMP)
	@echo "== build: the sdist and the wheel into dist/ (about 5 s)"
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	@ls -l dist

demo: $(STAMP)
	$(BIN)/python examples/dp_sgd_digits.py

# On a machine with an accelerator (at most 8 minutes): the clipping forms and each
# workload at microbatch 64, into benchmarks/device/CLIPPING.md.
bench-device: $(STAMP)
	$(BIN)/python benchmarks/clipping.py --device

bench: $(STAMP)
	$(BIN)/python benchmarks/matrix.py
	$(BIN)/python benchmarks/compare.py
	$(BIN)/python benchmarks/accumulation.py
	$(BIN)/python benchmarks/clipping.py
	$(BIN)/python benchmarks/compile_time.py
	$(BIN)/python benchmarks/remainder.py
	$(BIN)/python benchmarks/gradient_statistics.py
	$(BIN)/python benchmarks/plan.py
	$(BIN)/python benchmarks/plots.py

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV)
