"""Hypothesis strategies and comparisons shared by the tests."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.extend.core import primitives as prims

from microbatching import AccumulationType, _primitives

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8]
FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]


def mesh(axis_type, shape=(8,), names=("data",)) -> jax.sharding.Mesh:
    """A mesh of the first ``prod(shape)`` of the 8 CPU devices, every axis of
    ``axis_type``."""
    count = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices()[:count]
    )


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


# Relative error allowed per summed term, by the precision the result is computed in. For
# float32 this is ~84 ulp: reference and result go through different but equally valid
# evaluation orders, FMA contraction and transcendental approximations (tanh, exp, log
# softmax and their gradients), which vary between CPUs, XLA versions and fast-math
# flags. For the half types one result rounding dominates (~4 ulp). float64 is for
# ``JAX_ENABLE_X64=1``.
TOLERANCE = {
    np.dtype(jnp.float64): 1e-12,
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.float16): 4e-3,
    np.dtype(jnp.bfloat16): 3e-2,
}
_ULPS_OF_OTHER_FLOATS = 4  # for inexact dtypes missing from TOLERANCE (float8 etc.)


def tolerance(dtype: Any, terms: int = 1, factor: float = 1.0) -> float:
    """The relative tolerance for a result computed in ``dtype`` from ``terms`` partial results.

    >>> tolerance(jnp.float32), tolerance(jnp.bfloat16, terms=4), tolerance(jnp.complex64)
    (1e-05, 0.12, 1e-05)
    """
    real = np.dtype(jnp.finfo(dtype).dtype)  # complex64 -> float32
    base = TOLERANCE.get(real, _ULPS_OF_OTHER_FLOATS * float(jnp.finfo(real).eps))
    return base * max(1, terms) * factor


def _precision(got: np.ndarray, want: np.ndarray) -> np.dtype:
    """The less precise of the two inexact dtypes, which bounds the achievable agreement."""
    inexact = [a.dtype for a in (got, want) if jnp.issubdtype(a.dtype, jnp.inexact)]
    return max(inexact, key=lambda d: float(jnp.finfo(d).eps))


def _assert_leaf_close(
    got: Any, want: Any, dtype: Any, terms: int, factor: float, where: str
) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert want.dtype != object, f"{where}: reference is not an array: {want!r}"
    assert got.shape == want.shape, f"{where}: shapes differ: {got.shape} != {want.shape}"
    exact = not jnp.issubdtype(dtype if dtype is not None else got.dtype, jnp.inexact)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=f"{where} (exact)")
        return
    rtol = tolerance(dtype if dtype is not None else _precision(got, want), terms, factor)
    wide = np.complex128 if np.iscomplexobj(got) or np.iscomplexobj(want) else np.float64
    g, w = got.astype(wide), want.astype(wide)
    finite = np.abs(w[np.isfinite(w)])
    magnitude = max(1.0, float(np.max(finite, initial=0.0)))
    np.testing.assert_allclose(
        g,
        w,
        rtol=rtol,
        atol=rtol * magnitude,
        err_msg=f"{where} (rtol={rtol:g}, atol={rtol:g} * {magnitude:g})",
    )


def assert_close(
    got: Any, want: Any, *, dtype: Any = None, terms: int = 1, factor: float = 1.0
) -> None:
    """Asserts that pytree ``got`` equals ``want`` up to rounding, leaf by leaf.

    The structures must be equal, and every leaf of ``got`` must have the shape of the
    matching leaf of ``want`` (a leaf of ``want`` may be any array-like, such as a list).
    Leaves of ``got`` with an integer or bool dtype must match exactly. Float (and complex)
    leaves are compared with ``rtol = tolerance(dtype, terms, factor)`` and ``atol = rtol *
    max(1, max |want|)``: an error relative to the largest reference value, so that an
    element near zero, left by cancellation between terms of unit scale, is not held to
    a relative bound it cannot meet.

    Args:
      got: the result under test.
      want: the reference.
      dtype: the precision the result is computed in; by default the less precise of the
        two leaves' dtypes (integer or bool: exact).
      terms: how many partial results were summed into each element (for instance the
        number of microbatches), which the tolerance grows with.
      factor: a further multiplier, for computations deeper than a sum of ``terms``.

    >>> assert_close({"a": jnp.float32(1.0) + 1e-6, "n": 3}, {"a": 1.0, "n": 3})
    >>> assert_close(jnp.array([1.0, -0.01497], jnp.float32), [1.0, -0.0149698])
    """
    paths_and_got, structure = jax.tree_util.tree_flatten_with_path(got)
    try:
        want_leaves = structure.flatten_up_to(want)
    except (TypeError, ValueError) as e:
        raise AssertionError(
            f"pytree structures differ: {structure} != {jax.tree.structure(want)}"
        ) from e
    for (path, g), w in zip(paths_and_got, want_leaves, strict=True):
        _assert_leaf_close(g, w, dtype, terms, factor, jax.tree_util.keystr(path) or "value")


def clipper(bound: float):
    """A ``transform_fn`` scaling a gradient pytree to global L2 norm at most ``bound``."""

    def clip(grads):
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        return jax.tree.map(lambda g: g * jnp.minimum(1.0, bound / norm), grads)

    return clip


def clipped_grad_sum(loss, bound: float):
    """``(w, x, weights=None) -> sum_b weights_b clip(grad loss(w, x_b))``, each example's
    gradient clipped to global L2 norm ``bound``: a reference in plain JAX, differentiable
    in ``w`` and ``weights``."""
    clip = jax.vmap(clipper(bound))

    def total(w, x, weights=None):
        clipped = clip(jax.vmap(jax.grad(loss), (None, 0))(w, x))
        weights = jnp.ones(len(x)) if weights is None else weights
        return jax.tree.map(lambda g: jnp.tensordot(weights.astype(g.dtype), g, 1), clipped)

    return total


# --- per-example references for remainders, weights and extrema ------------------------

ROWS_W = random_array(0, (3, 4), jnp.float32) / 2
"""The weights of ``rows``."""


def rows(x, w=ROWS_W):
    """A per-example function of a row of 3 features, as a microbatch of rows."""
    return jnp.tanh(x @ w)


def weighted(kind, ys, weights=None):
    """The reference: per-example results ``ys`` (rows on axis 0) reduced by ``kind`` with
    ``weights`` applied afterwards (None: all 1)."""
    n = ys.shape[0]
    weights = jnp.ones(n, bool) if weights is None else weights
    keep = jnp.reshape(weights != 0, (n,) + (1,) * (ys.ndim - 1))
    if kind is AccumulationType.CONCAT:
        return jnp.where(keep, ys, 0)
    if kind in (AccumulationType.MAX, AccumulationType.MIN):
        low = -jnp.inf if jnp.issubdtype(ys.dtype, jnp.floating) else jnp.iinfo(ys.dtype).min
        if kind is AccumulationType.MAX:
            return jnp.max(jnp.where(keep, ys, low), axis=0, initial=low)
        high = jnp.inf if low == -jnp.inf else jnp.iinfo(ys.dtype).max
        return jnp.min(jnp.where(keep, ys, high), axis=0, initial=high)
    w = jnp.reshape(weights.astype(jnp.float32), keep.shape)
    total = jnp.sum(jnp.where(keep, ys.astype(jnp.float32) * w, 0), axis=0)
    if kind is AccumulationType.SUM:
        return total
    count = jnp.sum(weights.astype(jnp.float32))
    if kind is AccumulationType.RUNNING_MEAN:  # no weight seen: the running mean's 0
        return jnp.where(count == 0, 0, total / jnp.where(count == 0, 1, count))
    return total / count


def draw_weights(data, size, kind="any"):
    """None, a boolean mask or float weights (some 0) for ``size`` examples."""
    kind = data.draw(st.sampled_from(["none", "bool", "float"])) if kind == "any" else kind
    if kind == "none":
        return None
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    keep = rng.random(size) < 0.7
    if kind == "bool":
        return jnp.asarray(keep)
    return jnp.asarray(np.where(keep, rng.uniform(0.1, 2.0, size), 0.0), jnp.float32)


def terms(size, microbatch_size):
    return max(1, -(-size // microbatch_size))


def two_layer_loss(params, x, y):
    """A per-example loss of ``two_layer_params`` (``keep_batch_dim``: a batch of one)."""
    pred = jnp.tanh(x @ params["w"]) @ params["v"]
    return jnp.mean((pred - y) ** 2)


def two_layer_params():
    return {
        "w": random_array(3, (3, 4), jnp.float32) / 2,
        "v": random_array(4, (4,), jnp.float32),
    }


# --- a small sine model, and its clipped per-example gradients in float64 -----------------

SIN_X = random_array(0, (16, 3), jnp.float32)
SIN_W = random_array(1, (3,), jnp.float32)


def sin_loss(w, x):
    return jnp.sum(jnp.sin(x @ w))


def clipped_sin_sum(w, x, bound):
    """The sum of ``sin_loss``'s per-example gradients clipped to norm ``bound``, in
    float64 NumPy."""
    grads = np.asarray(jax.vmap(jax.grad(sin_loss), (None, 0))(w, x), np.float64)
    norms = np.linalg.norm(grads.reshape(len(grads), -1), axis=1)
    factors = np.minimum(1.0, bound / norms)
    return np.sum(grads * factors[:, None], axis=0)


def equations(jaxpr: Any, in_branch: bool = False) -> Any:
    """Every equation of ``jaxpr`` and of the jaxprs inside it (loops, branches, calls),
    each with whether it lies inside a ``cond``'s branch."""
    for eqn in jaxpr.eqns:
        yield eqn, in_branch
        for inner in _primitives.sub_programs(eqn):  # a checkpoint's too, under JAX_REMAT3
            yield from equations(inner, in_branch or eqn.primitive is prims.cond_p)
