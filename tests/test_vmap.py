"""``micro_vmap`` against ``jax.vmap``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatching import AccumulationType, micro_vmap

from .strategies import FLOATS, assert_close, batches, microbatch_sizes, random_array

REDUCE = {
    AccumulationType.SUM: lambda y: jnp.sum(y, axis=0),
    AccumulationType.MEAN: lambda y: jnp.mean(y, axis=0, dtype=y.dtype),
    AccumulationType.RUNNING_MEAN: lambda y: jnp.mean(y, axis=0, dtype=y.dtype),
    AccumulationType.CONCAT: lambda y: y,
    AccumulationType.MAX: lambda y: jnp.max(y, axis=0, initial=_lowest(y.dtype)),
    AccumulationType.MIN: lambda y: jnp.min(y, axis=0, initial=-_lowest(y.dtype) - 1),
}


def _lowest(dtype):
    """What MAX gives for no rows; MIN gives its negation minus one (inf, or int max)."""
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _per_example(x, w):
    return {"out": jnp.tanh(x * w) if jnp.issubdtype(x.dtype, jnp.inexact) else x * 3, "n": x.size}


@pytest.mark.x64
@settings(max_examples=20, deadline=None)
@given(data=st.data(), case=batches())
def test_matches_jax_vmap_for_every_accumulator(data, case):
    x, axis = case
    kinds = (
        list(AccumulationType)
        if x.dtype in FLOATS
        else [
            AccumulationType.SUM,
            AccumulationType.CONCAT,
            AccumulationType.MAX,
            AccumulationType.MIN,
        ]
    )
    kind = data.draw(st.sampled_from(kinds))
    size = data.draw(microbatch_sizes(x.shape[axis]))
    w = jnp.asarray(0.5, x.dtype)
    mapped = micro_vmap(
        lambda x, w: _per_example(x, w)["out"],
        in_axes=(axis, None),
        microbatch_size=size,
        accumulator=kind,
    )
    got = (jax.jit(mapped) if data.draw(st.booleans()) else mapped)(x, w)
    mapped_whole = jax.vmap(lambda x, w: _per_example(x, w)["out"], (axis, None))
    want = jax.jit(lambda x, w: REDUCE[kind](mapped_whole(x, w)))(x, w)
    if kind is AccumulationType.RUNNING_MEAN and x.shape[axis] == 0:
        want = jnp.zeros_like(want)  # no microbatch ran: 0, as in optax main
    assert got.dtype == want.dtype
    assert_close(got, want, terms=x.shape[axis] // size)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 99), rows=st.sampled_from([4, 6, 12]), data=st.data())
def test_pytree_outputs_and_keyword_arguments(seed, rows, data):
    x = random_array(seed, (rows, 3), jnp.float32)
    y = random_array(seed + 1, (rows,), jnp.float32)
    size = data.draw(microbatch_sizes(rows))

    def fun(x, scale, *, y):
        return {"rows": x * scale + y, "norm": jnp.linalg.norm(x)}

    accumulator = {"rows": AccumulationType.CONCAT, "norm": AccumulationType.MEAN}
    mapped = micro_vmap(fun, (0, None), microbatch_size=size, accumulator=accumulator)
    got = mapped(x, 2.0, y=y)
    want = jax.vmap(fun, (0, None))(x, 2.0, y=y)
    assert_close(got["rows"], want["rows"])
    assert_close(got["norm"], jnp.mean(want["norm"]), terms=rows // size)


@pytest.mark.x64
def test_int_in_axes_maps_every_positional_argument():
    x, y = jnp.arange(6.0), jnp.arange(6.0) * 10
    got = micro_vmap(jnp.add, microbatch_size=3)(x, y)
    np.testing.assert_array_equal(got, x + y)


@pytest.mark.x64
def test_vmap_fn_is_used_on_each_microbatch():
    calls = []

    def recording_vmap(fun, in_axes, out_axes):
        calls.append((in_axes, out_axes))
        return jax.vmap(fun, in_axes, out_axes)

    got = micro_vmap(jnp.sin, microbatch_size=2, vmap_fn=recording_vmap)(jnp.arange(4.0))
    assert_close(got, jnp.sin(jnp.arange(4.0)))
    assert calls == [(0, 0)]


@pytest.mark.x64
def test_vmap_fn_with_options_from_partial():
    vmap_fn = functools.partial(jax.vmap, axis_name="batch")
    fun = lambda x: x - jax.lax.pmean(x, "batch")  # noqa: E731 - mean within the microbatch
    got = micro_vmap(fun, microbatch_size=2, vmap_fn=vmap_fn)(jnp.arange(4.0))
    assert_close(got, [-1.0, -1.0, 1.0, 1.0])


@pytest.mark.x64
@pytest.mark.parametrize("kind", list(AccumulationType))
def test_no_microbatching_still_reduces(kind):
    x = jnp.arange(8.0)
    got = micro_vmap(jnp.square, microbatch_size=None, accumulator=kind)(x)
    assert_close(got, REDUCE[kind](x**2))


@pytest.mark.x64
def test_empty_batch():
    x = jnp.zeros((0, 2))
    got = micro_vmap(jnp.sum, microbatch_size=4)(x)
    assert got.shape == (0,)
    total = micro_vmap(jnp.sum, microbatch_size=4, accumulator=AccumulationType.SUM)(x)
    assert total == 0.0


@pytest.mark.x64
def test_sum_of_booleans_counts_them_and_small_ints_promote():
    x = jnp.arange(8.0)
    count = micro_vmap(lambda v: v > 3, microbatch_size=2, accumulator=AccumulationType.SUM)(x)
    assert count.dtype == jnp.sum(x > 3).dtype
    assert count == 4
    small = (jnp.arange(8) * 50).astype(jnp.uint8)
    total = micro_vmap(lambda v: v, microbatch_size=4, accumulator=AccumulationType.SUM)(small)
    assert total == jnp.sum(small) == 888 and total.dtype == jnp.sum(small).dtype


@pytest.mark.x64
def test_numpy_integers_for_in_axes_and_out_axes():
    x = jnp.arange(4.0)
    got = micro_vmap(jnp.sin, np.int64(0), np.int64(0), microbatch_size=2)(x)
    assert_close(got, jnp.sin(x))
