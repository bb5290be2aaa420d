"""The check that the examples make of their results against a reference computed
without microbatching (examples/ is on the path when a script there runs)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def assert_trees_close(
    actual: Any, expected: Any, what: str, reference: str = "its reference"
) -> None:
    """Raises if two pytrees of arrays (None leaves skipped) differ beyond float32
    rounding; prints that ``what`` matches ``reference`` otherwise."""
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    worst = max(
        float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
        for a, b in (jax.device_get(pair) for pair in pairs)
    )
    if worst > 1e-4:
        raise AssertionError(f"{what}: relative difference {worst:.2e}")
    print(f"check: {what} matches {reference} (max relative difference {worst:.1e})")
