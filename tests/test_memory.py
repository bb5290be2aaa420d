"""Compiled temp memory does not grow with the batch: the batch is read in place.

``temp_size_in_bytes`` of a compiled program is deterministic, so these are exact
structural facts, not timings.
"""

import jax
import jax.numpy as jnp
import pytest

from microbatching import AccumulationType, micro_grad, micro_vmap, microbatch

from .strategies import clipper

DTYPE = jnp.float32  # explicit, so that JAX_ENABLE_X64=1 does not double every size
ITEMSIZE = jnp.dtype(DTYPE).itemsize
W = jnp.ones((64, 64), DTYPE) / 64
FEATURES = 64
MICROBATCH = 128


def _temp_bytes(fun, *args) -> int:
    analysis = jax.jit(fun).lower(*args).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this backend gives no memory analysis")
    return analysis.temp_size_in_bytes


def _batch(rows: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, FEATURES), DTYPE)


def _rows(x):
    return jnp.tanh(x @ W)


def _reduced(x):
    return jnp.sum(jnp.tanh(x @ W), axis=0)


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _transforms():
    for kind in AccumulationType:
        fun = _rows if kind is AccumulationType.CONCAT else _reduced
        yield f"microbatch-{kind.name}", (lambda k=kind, f=fun: microbatch(f, 0, MICROBATCH, k))
        yield (
            f"micro_vmap-{kind.name}",
            (lambda k=kind: micro_vmap(_rows, microbatch_size=MICROBATCH, accumulator=k)),
        )


TRANSFORMS = dict(_transforms())


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_temp_memory_is_independent_of_the_batch_size(name):
    small, large = (_temp_bytes(TRANSFORMS[name](), _batch(rows)) for rows in (4096, 32768))
    assert large == small
    batch_bytes = 4096 * FEATURES * ITEMSIZE
    assert small < batch_bytes // 8  # not even a fraction of the smaller batch is copied


def test_micro_grad_temp_memory_is_one_microbatch_of_per_example_grads():
    clip = clipper(1.0)
    grad_fn = micro_grad(
        _loss, microbatch_size=MICROBATCH, metrics_fn=jnp.linalg.norm, transform_fn=clip
    )
    small, large = (_temp_bytes(grad_fn, W, _batch(rows)) for rows in (2048, 16384))
    assert large == small
    per_example_grads = MICROBATCH * W.size * ITEMSIZE
    assert per_example_grads <= small < 2.5 * per_example_grads


def test_micro_grad_fast_path_keeps_no_per_example_grads():
    grad_fn = micro_grad(_loss, microbatch_size=MICROBATCH, metrics_fn=jnp.linalg.norm)
    small, large = (_temp_bytes(grad_fn, W, _batch(rows)) for rows in (2048, 16384))
    assert large == small < MICROBATCH * W.size * ITEMSIZE // 8


def test_without_microbatching_memory_grows_with_the_batch():
    grad_fn = micro_grad(_loss, microbatch_size=None)
    small, large = (_temp_bytes(grad_fn, W, _batch(rows)) for rows in (2048, 16384))
    assert large >= 8 * small > 0


def test_batch_axis_other_than_zero_is_read_in_place_too():
    fun = microbatch(lambda x: jnp.sum(jnp.tanh(x), axis=1), 0, MICROBATCH, in_axes=1)
    small, large = (
        _temp_bytes(fun, jax.ShapeDtypeStruct((FEATURES, rows), DTYPE)) for rows in (4096, 32768)
    )
    assert large == small < 4096 * FEATURES * ITEMSIZE // 8
