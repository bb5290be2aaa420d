"""Hypothesis strategies and comparisons shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8]
FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]
_TOLERANCE = {jnp.float32: 1e-5, jnp.float16: 4e-3, jnp.bfloat16: 3e-2}


def random_array(seed: int, shape: tuple[int, ...], dtype) -> jnp.ndarray:
    """Seeded normal floats, or small integers for integer dtypes."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-5, 6, size=shape), dtype)
    return jnp.asarray(rng.normal(size=shape), dtype)


@st.composite
def batches(draw, min_rows: int = 0, dtypes=tuple(DTYPES)):
    """An array with a batch axis somewhere: (array, axis)."""
    rows = draw(st.integers(min_rows, 12))
    features = draw(st.lists(st.integers(1, 3), max_size=2))
    axis = draw(st.integers(0, len(features)))
    shape = (*features[:axis], rows, *features[axis:])
    dtype = draw(st.sampled_from(dtypes))
    return random_array(draw(st.integers(0, 2**16)), shape, dtype), axis


def microbatch_sizes(batch_size: int):
    """1, a middle divisor and the whole batch; any small size for an empty batch."""
    if batch_size == 0:
        return st.integers(1, 4)
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    return st.sampled_from(sorted({1, divisors[len(divisors) // 2], batch_size}))


def assert_close(got, want, dtype, terms: int = 1) -> None:
    """Exact for integers; for floats, within rounding of ``terms`` partial results."""
    got, want = jnp.asarray(got), jnp.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if not jnp.issubdtype(dtype, jnp.inexact):
        np.testing.assert_array_equal(got, want)
        return
    tol = _TOLERANCE[jnp.dtype(dtype).type] * max(1, terms)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(w), initial=0.0)))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def clipper(bound: float):
    """A ``transform_fn`` scaling a gradient pytree to global L2 norm at most ``bound``."""

    def clip(grads):
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        return jax.tree.map(lambda g: g * jnp.minimum(1.0, bound / norm), grads)

    return clip
