"""L2 norms of gradients and the clip factors of DP-SGD, without overflow or underflow.

``sum(g**2)`` overflows in float32 once ``|g|`` passes about 1e19 (and in float16 at
256), and underflows to 0 below about 1e-19: a huge gradient would get norm ``inf`` and
clip to 0, a tiny one norm 0. Each norm here is taken of the gradient divided by its
largest magnitude, then multiplied back: ``m * sqrt(sum((g / m)**2))`` with
``m = max |g|``. Every term of the sum is then at most 1, and the largest is exactly 1,
so the sum neither overflows nor vanishes. The scaling is computed in at least float32.
A norm beyond the dtype's largest number (3.4e38 in float32) is ``inf``, and clips the
gradient to 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._typing import PyTree


def row_norms(grads: PyTree, rows: int) -> jax.Array:
    """The L2 norm of each row of gradients stacked on axis 0, over all leaves."""
    if not rows:
        return jnp.zeros((0,))
    flat = [_magnitudes(g).reshape(rows, -1) for g in jax.tree.leaves(grads)]
    if not flat:
        return jnp.zeros((rows,))
    largest = jnp.max(jnp.stack([jnp.max(f, axis=1, initial=0.0) for f in flat]), axis=0)
    safe = jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)
    # Divided twice by the square root: XLA may divide by multiplying with the reciprocal,
    # and 1 / m is subnormal (flushed to 0) for m above 2**126; 1 / sqrt(m) never is.
    root = jnp.sqrt(safe)[:, None]
    squares = sum(jnp.sum(jnp.square(f / root / root), axis=1) for f in flat)
    return jnp.where(jnp.isfinite(largest), safe * jnp.sqrt(squares), largest)


def norm(grads: PyTree) -> jax.Array:
    """The L2 norm of one gradient, over all its leaves."""
    return row_norms(jax.tree.map(lambda g: jnp.reshape(g, (1, -1)), grads), 1)[0]


def factor(norms: jax.Array, bound: Any) -> jax.Array:
    """``min(1, bound / norm)``: the scale that clips a gradient to norm ``bound``."""
    return jnp.minimum(1.0, bound / norms)


def _magnitudes(g: Any) -> jax.Array:
    """``|g|`` in at least float32."""
    g = jnp.asarray(g)
    magnitude = jnp.abs(g) if jnp.iscomplexobj(g) else g
    wide = jnp.promote_types(magnitude.dtype, jnp.float32)
    return jnp.abs(magnitude.astype(wide))
