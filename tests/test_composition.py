"""Microbatched functions under jit, grad and vmap; tracing and profiler names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbatching import AccumulationType, micro_grad, micro_vmap, microbatch

from .strategies import assert_close


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


W = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
X = jnp.linspace(-2.0, 2.0, 32).reshape(8, 4)


def test_grad_through_microbatch_equals_grad_of_the_whole_batch():
    batched = microbatch(_loss, argnums=1, microbatch_size=2)
    assert_close(jax.grad(batched)(W, X), jax.grad(_loss)(W, X), terms=4)
    assert_close(jax.jit(jax.grad(batched, argnums=1))(W, X), jax.grad(_loss, argnums=1)(W, X))


def test_forward_mode_through_microbatch():
    batched = microbatch(_loss, argnums=1, microbatch_size=4)
    tangent = jnp.arange(12.0).reshape(4, 3) / 10
    got = jax.jvp(lambda w: batched(w, X), (W,), (tangent,))
    want = jax.jvp(lambda w: _loss(w, X), (W,), (tangent,))
    assert_close(got, want, terms=2)


def test_vmap_of_a_microbatched_function():
    batched = microbatch(_loss, argnums=1, microbatch_size=2)
    ws = jnp.stack([W, 2 * W, -W])
    assert_close(jax.vmap(batched, (0, None))(ws, X), jax.vmap(_loss, (0, None))(ws, X), terms=4)
    concat = microbatch(lambda x: x * 2, 0, 2, AccumulationType.CONCAT)
    xs = jnp.stack([X, X + 1])
    assert_close(jax.vmap(concat)(xs), xs * 2)


def test_vmap_over_the_batch_axis_of_micro_vmap_outputs():
    mapped = micro_vmap(lambda x: jnp.sum(x**2), microbatch_size=2)
    xs = jnp.stack([X, -X])
    assert_close(jax.vmap(mapped)(xs), jnp.sum(xs**2, axis=-1))


def test_traced_num_real_microbatches_does_not_retrace():
    traces = []

    def step(x, count):
        traces.append(1)
        return microbatch(jnp.sum, 0, 2, num_real_microbatches=count)(x)

    step = jax.jit(step)
    x = jnp.arange(8.0)
    results = [float(step(x, jnp.int32(k))) for k in range(5)]
    assert results == [0.0, 4.0, 10.0, 18.0, 28.0]  # microbatch i holds rows i and i + 4
    assert len(traces) == 1


def test_traced_num_real_microbatches_is_clipped_to_the_number_of_microbatches():
    step = jax.jit(lambda x, k: microbatch(jnp.sum, 0, 2, num_real_microbatches=k)(x))
    assert float(step(jnp.arange(8.0), jnp.int32(99))) == 28.0
    assert float(step(jnp.arange(8.0), jnp.int32(-3))) == 0.0


def test_fun_is_traced_once_per_call():
    traces = []

    def fun(x):
        traces.append(x.shape)
        return jnp.sum(x)

    jax.jit(microbatch(fun, 0, 2))(X)
    assert traces == [(2, 4)]


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: microbatch(_loss, 1, 2), "microbatch(_loss)"),
        (lambda: micro_vmap(_loss, (None, 0), microbatch_size=2), "micro_vmap(_loss)"),
        (lambda: micro_grad(_loss, microbatch_size=2), "micro_grad(_loss)"),
    ],
)
def test_each_transform_opens_a_named_scope(make, name):
    text = jax.jit(make()).lower(W, X).as_text(debug_info=True)
    assert name in text


def test_micro_grad_inside_a_jitted_training_step():
    def step(w, x):
        grads, aux = micro_grad(_loss, microbatch_size=4)(w, x)
        return w - 0.1 * grads, jnp.mean(aux.values)

    w, loss = jax.jit(step)(W, X)
    assert_close(w, W - 0.1 * jax.grad(_loss)(W, X), terms=2)
    assert_close(loss, _loss(W, X) / 8, terms=8)


@pytest.mark.parametrize("count", [2, np.int32(2), jnp.int32(2)], ids=["int", "numpy", "jax"])
def test_concrete_num_real_microbatches_keeps_a_static_loop(count):
    batched = microbatch(_loss, 1, 2, num_real_microbatches=count)
    rows = jnp.arange(8) % 4 < 2  # microbatches 0 and 1: rows 0, 1, 4, 5
    want = jax.grad(_loss)(W, X[rows])
    assert_close(jax.jit(jax.grad(batched))(W, X), want, terms=2)
