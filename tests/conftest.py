"""Test-wide settings: 8 fake CPU devices, strict rank promotion, no hypothesis deadline,
and the compilation cache of `make test`."""

import os

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# An example's first call compiles, so its time says nothing about the code: no deadline.
settings.register_profile("microbatching", deadline=None)
settings.load_profile("microbatching")

# `make test` names a folder for the run (MICROBATCHING_TEST_CACHE, deleted after it): each
# worker keeps its own compilation cache there, so a program that several of its tests
# compile (a reference, a shared model) compiles once. One folder per worker, because JAX
# writes an entry in place, and a worker could read another's half-written one.
if os.environ.get("MICROBATCHING_TEST_CACHE"):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    jax.config.update(
        "jax_compilation_cache_dir", os.path.join(os.environ["MICROBATCHING_TEST_CACHE"], worker)
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# The files of the longest items, run first: the wheel in a fresh environment, the
# examples and the processes of tests/test_multiprocess.py (subprocesses), the doctests of
# the guides (a page is one item). pytest-xdist's worksteal gives each worker a contiguous
# part of the items and balances by stealing what a worker has not started, so a long item
# left for the end keeps one worker busy while the other has nothing left to take.
LONGEST_FIRST = (
    "tests/test_wheel.py",
    "tests/test_examples.py",
    "tests/test_multiprocess.py",
    "docs/",
    "README.md",
)


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return next(
        (i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)),
        len(LONGEST_FIRST),
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The x64 run compiles with the legacy emitters and leaves the ``compiled`` tests
    out (Makefile's test-x64): a test marked both would never see float64. The files of
    ``LONGEST_FIRST`` go first, each in its own order; the rest keep theirs."""
    both = [
        i.nodeid for i in items if i.get_closest_marker("x64") and i.get_closest_marker("compiled")
    ]
    if both:
        raise pytest.UsageError(
            f"{', '.join(both)}: marked both x64 and compiled, so make test-x64 would skip "
            "it. A fact of the lowered program (StableHLO) does not depend on XLA's flags: "
            "drop `compiled`; one of the compiled program needs a run of its own."
        )
    items.sort(key=_rank)  # stable
