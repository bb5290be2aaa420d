"""Same calls, same results as ``optax.microbatching`` 0.2.8 (a test-only dependency)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import microbatching

from .strategies import assert_close, microbatch_sizes, random_array

optax_mb = pytest.importorskip("optax.microbatching")


def _fun(w, x, y):
    return {
        "rows": jnp.tanh(x * w) + y[:, None],
        "total": jnp.sum(x * w),
        "mean": jnp.mean(x, axis=0),
        "scalar_rows": jnp.sum(y),
    }


def _accumulators(module, kind):
    t = module.AccumulationType
    return {"rows": t.CONCAT, "total": t.SUM, "mean": getattr(t, kind), "scalar_rows": t.CONCAT}


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 999),
    rows=st.sampled_from([1, 6, 8, 12]),
    kind=st.sampled_from(["MEAN", "RUNNING_MEAN"]),
    data=st.data(),
)
def test_microbatch_matches_optax(seed, rows, kind, data):
    x = random_array(seed, (rows, 3), jnp.float32)
    y = random_array(seed + 1, (rows,), jnp.float32)
    size = data.draw(microbatch_sizes(rows))
    count = data.draw(st.sampled_from([None, *range(1, rows // size + 1)]))
    ours, theirs = (
        m.microbatch(_fun, (1, 2), size, _accumulators(m, kind), num_real_microbatches=count)
        for m in (microbatching, optax_mb)
    )
    # the reference jitted: optax's runs op by op, compiling each of its primitives
    assert_close(
        ours(jnp.float32(0.5), x, y), jax.jit(theirs)(jnp.float32(0.5), x, y), terms=rows // size
    )


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 999), rows=st.sampled_from([4, 8]), data=st.data())
def test_micro_vmap_matches_optax(seed, rows, data):
    x = random_array(seed, (rows, 3), jnp.float32)
    size = data.draw(microbatch_sizes(rows))
    kind = data.draw(st.sampled_from(["SUM", "MEAN", "CONCAT", "RUNNING_MEAN"]))
    results = [
        m.micro_vmap(
            lambda x: jnp.tanh(x) * 2,
            microbatch_size=size,
            accumulator=getattr(m.AccumulationType, kind),
        )(x)
        for m in (microbatching, optax_mb)
    ]
    assert_close(*results, terms=rows // size)


@pytest.mark.parametrize("keep_batch_dim", [True, False])
@pytest.mark.parametrize("kind", ["SUM", "MEAN", "CONCAT"])
def test_micro_grad_matches_optax(keep_batch_dim, kind):
    def loss(w, x, y):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2), jnp.sum(x)

    w = random_array(0, (3, 2), jnp.float32)
    x, y = random_array(1, (8, 3), jnp.float32), random_array(2, (8, 2), jnp.float32)
    results = [
        m.micro_grad(
            loss,
            has_aux=True,
            batch_argnums=(1, 2),
            keep_batch_dim=keep_batch_dim,
            microbatch_size=4,
            accumulator=getattr(m.AccumulationType, kind),
            transform_fn=lambda g: (g, jnp.sign(g)),
            metrics_fn=jnp.linalg.norm,
        )(w, x, y)
        for m in (microbatching, optax_mb)
    ]
    ours, theirs = ((grads, tuple(aux)) for grads, aux in results)
    assert_close(ours, theirs, terms=2)
    assert results[0][1]._fields == results[1][1]._fields


@pytest.mark.x64
def test_reshape_batch_axis_matches_optax():
    x = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
    for axis in (0, 1):
        np.testing.assert_array_equal(
            microbatching.reshape_batch_axis(x, 2, axis=axis),
            optax_mb.reshape_batch_axis(x, 2, axis=axis),
        )
