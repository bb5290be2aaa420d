"""``allow_remainder``: a batch that the microbatch size does not divide, on every
transform and accumulator, against ``fun`` of the whole batch or ``jax.vmap``."""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatching import AccumulationType, Accumulator, micro_grad, micro_vmap, microbatch

from .strategies import ROWS_W as W
from .strategies import assert_close, clipper, draw_weights, random_array, rows, terms, weighted
from .strategies import two_layer_loss as _loss
from .strategies import two_layer_params as _params

SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
RUNNING_MEAN, MAX, MIN = AccumulationType.RUNNING_MEAN, AccumulationType.MAX, AccumulationType.MIN
REDUCING = [SUM, MEAN, RUNNING_MEAN, MAX, MIN]
F32 = jnp.float32


def _microbatch_fun(kind):
    """``fun`` for ``microbatch``: per-example work that ``kind`` combines exactly."""
    reduce = {
        SUM: lambda y: jnp.sum(y, axis=0),
        MEAN: lambda y: jnp.mean(y, axis=0),
        RUNNING_MEAN: lambda y: jnp.mean(y, axis=0),
        MAX: lambda y: jnp.max(y, axis=0),
        MIN: lambda y: jnp.min(y, axis=0),
        CONCAT: lambda y: y,
    }[kind]
    return lambda x, scale: {"y": reduce(rows(x) * scale), "s": reduce(jnp.sum(x, -1) * scale)}


@settings(max_examples=12, deadline=None)
@given(
    size=st.integers(1, 23),
    microbatch_size=st.integers(1, 9),
    kind=st.sampled_from(list(AccumulationType)),
    jit=st.booleans(),
)
def test_microbatch_with_a_remainder_equals_the_whole_batch(size, microbatch_size, kind, jit):
    x = random_array(size, (size, 3), F32)
    fun = _microbatch_fun(kind)
    wrapped = microbatch(fun, 0, microbatch_size, kind, allow_remainder=True)
    got = (jax.jit(wrapped) if jit else wrapped)(x, 2.0)
    assert_close(got, jax.jit(fun)(x, 2.0), terms=terms(size, microbatch_size))


@settings(max_examples=15, deadline=None)
@given(size=st.integers(1, 17), microbatch_size=st.integers(1, 6), kind=st.sampled_from(REDUCING))
def test_microbatch_with_a_remainder_on_a_later_axis(size, microbatch_size, kind):
    x = random_array(size, (3, size), F32)
    fun = lambda w, x: _microbatch_fun(kind)(x.T, 1.0)  # noqa: E731
    # W has 3 entries, as a batch of 3 has rows: meant whole.
    looped = microbatch(
        fun, 1, microbatch_size, kind, in_axes=1, allow_remainder=True, whole_argnums=0
    )
    got = looped(W, x)
    assert_close(got, jax.jit(fun)(W, x), terms=terms(size, microbatch_size))


@settings(max_examples=15, deadline=None)
@given(
    size=st.integers(0, 23),
    microbatch_size=st.integers(1, 9),
    kind=st.sampled_from(list(AccumulationType)),
    axis=st.sampled_from([0, 1]),
    data=st.data(),
)
def test_micro_vmap_with_a_remainder_and_weights_equals_jax_vmap(
    size, microbatch_size, kind, axis, data
):
    x = random_array(size, (size, 3) if axis == 0 else (3, size), F32)
    weights = draw_weights(data, size)
    fun = lambda w, x: {"y": rows(x, w), "s": (jnp.sum(x), x[0])}  # noqa: E731
    mapped = micro_vmap(
        fun, (None, axis), microbatch_size=microbatch_size, accumulator=kind, allow_remainder=True
    )
    call = jax.jit(mapped) if data.draw(st.booleans()) else mapped
    got = call(W, x) if weights is None else call(W, x, example_weights=weights)

    @jax.jit  # one program: a reference run op by op compiles every op for every new shape
    def reference(x, weights):
        per_example = jax.vmap(fun, (None, axis))(W, x)
        return jax.tree.map(lambda ys: weighted(kind, ys, weights), per_example)

    assert_close(got, reference(x, weights), terms=terms(size, microbatch_size))


@settings(max_examples=10, deadline=None)
@given(
    size=st.integers(1, 17),
    microbatch_size=st.integers(1, 6),
    kind=st.sampled_from(REDUCING),
    clip=st.sampled_from([None, 0.3]),
    transform=st.booleans(),
    data=st.data(),
)
def test_micro_grad_with_a_remainder_and_weights_equals_per_example_grad(
    size, microbatch_size, kind, clip, transform, data
):
    params = _params()
    x, y = random_array(size, (size, 3), F32), random_array(size + 1, (size,), F32)
    weights = draw_weights(data, size)
    double = lambda g: jax.tree.map(lambda a: 2 * a, g)  # noqa: E731 - the per-example path
    kwargs: dict[str, Any] = {"transform_fn": double} if transform else {}
    grad_fn = micro_grad(
        _loss,
        batch_argnums=(1, 2),
        microbatch_size=microbatch_size,
        accumulator=kind,
        l2_clip_norm=clip,
        allow_remainder=True,
        metrics_fn=lambda g: jnp.sum(g["v"]),
        **kwargs,
    )
    call = jax.jit(grad_fn)
    grads, aux = (
        call(params, x, y) if weights is None else call(params, x, y, example_weights=weights)
    )

    @jax.jit  # one program: a reference run op by op compiles every op for every new shape
    def reference(params, x, y, weights):
        values, per_example = jax.vmap(
            jax.value_and_grad(lambda p, x, y: _loss(p, x[None], y[None])), (None, 0, 0)
        )(params, x, y)
        metrics = jnp.sum(per_example["v"], axis=1)
        if clip is not None:
            per_example = jax.vmap(clipper(clip))(per_example)
        if transform:
            per_example = double(per_example)
        want = jax.tree.map(lambda g: weighted(kind, g, weights), per_example)
        return want, weighted(CONCAT, values, weights), weighted(CONCAT, metrics, weights)

    want, values, metrics = reference(params, x, y, weights)
    assert_close(grads, want, terms=terms(size, microbatch_size), factor=4)
    assert_close(aux.values, values)
    assert_close(aux.metrics, metrics)


@pytest.mark.x64
def test_the_last_microbatch_holds_the_last_rows():
    # 10 rows, microbatch 4: microbatches 0 and 1 hold rows 0, 2, 4, 6 and 1, 3, 5, 7 (the
    # first 8 rows, strided); the last holds rows 8 and 9.
    sums = microbatch(jnp.sum, 0, 4, CONCAT, allow_remainder=True)(jnp.arange(10))
    np.testing.assert_array_equal(sums, [0 + 2 + 4 + 6, 1 + 3 + 5 + 7, 8 + 9])
    got = micro_vmap(lambda x: x, microbatch_size=4, allow_remainder=True)(jnp.arange(10))
    np.testing.assert_array_equal(got, np.arange(10))  # CONCAT restores the batch order
    got = microbatch(lambda x: x, 0, 4, CONCAT, allow_remainder=True)(jnp.arange(10))
    np.testing.assert_array_equal(got, np.arange(10))


@pytest.mark.x64
def test_microbatch_concat_of_results_that_are_not_rows():
    # fun's CONCAT output need not have a row per input row: the remainder's result is
    # appended whole.
    x = jnp.arange(10)
    got = microbatch(lambda x: jnp.sum(x, keepdims=True), 0, 4, CONCAT, allow_remainder=True)(x)
    np.testing.assert_array_equal(got, [12, 16, 17])
    got = microbatch(lambda x: x[:2], 0, 4, CONCAT, allow_remainder=True)(x)
    np.testing.assert_array_equal(got, [0, 1, 2, 3, 8, 9])  # interleaved as CONCAT does
    with pytest.raises(
        ValueError,
        match=r"CONCAT got 9 rows from fun on the last 1 rows of the batch, more than the 6 of a "
        r"whole microbatch; with allow_remainder, fun's CONCAT outputs may not have more rows "
        r"on fewer inputs\.",
    ):
        microbatch(lambda x: jnp.zeros(10 - x.shape[0]), 0, 4, CONCAT, allow_remainder=True)(
            jnp.arange(9.0)
        )


@pytest.mark.x64  # the lowered StableHLO, which no XLA flag changes: not `compiled`
def test_a_divisible_batch_compiles_to_the_same_program():
    x = random_array(0, (12, 3), F32)
    for make in (
        lambda r: microbatch(rows, 0, 4, SUM, allow_remainder=r),
        lambda r: micro_vmap(rows, microbatch_size=4, accumulator=MEAN, allow_remainder=r),
        lambda r: micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=4, allow_remainder=r),
    ):
        args = (x,) if make(False).__name__ == "rows" else (_params(), x, x[:, 0])
        texts = [jax.jit(make(r)).lower(*args).as_text() for r in (False, True)]
        assert texts[0] == texts[1]


def _while_loops(fun, *args, **kwargs) -> int:
    text = jax.jit(fun).lower(*args, **kwargs).compile().as_text()
    assert text is not None
    return len(re.findall(r"\swhile\(", text))


@pytest.mark.compiled
@pytest.mark.parametrize("weights", [False, True])
def test_a_remainder_runs_in_the_one_loop(weights):
    x, y = random_array(0, (1797, 3), F32), random_array(1, (1797,), F32)
    extra = {"example_weights": jnp.ones(1797)} if weights else {}
    mapped = micro_vmap(rows, microbatch_size=64, accumulator=MEAN, allow_remainder=True)
    grads = micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=64, allow_remainder=True)
    assert _while_loops(mapped, x, **extra) == 1
    assert _while_loops(grads, _params(), x, y, **extra) == 1
    # microbatch calls fun once more after its loop; still one loop.
    assert _while_loops(microbatch(rows, 0, 64, CONCAT, allow_remainder=True), x) == 1


def _temp_bytes(fun, *args, **kwargs) -> int:
    analysis = jax.jit(fun).lower(*args, **kwargs).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this backend gives no memory analysis")
    return analysis.temp_size_in_bytes


@pytest.mark.compiled
def test_the_padded_loop_holds_one_microbatch():
    features, microbatch_size = 64, 128
    w = jnp.ones((features, features), F32) / features
    fun = lambda x: jnp.tanh(jnp.tanh(x @ w) @ w)  # noqa: E731
    mapped = micro_vmap(fun, microbatch_size=microbatch_size, accumulator=SUM, allow_remainder=True)

    def temp(size, weights=False):
        x = jax.ShapeDtypeStruct((size, features), F32)
        extra = {"example_weights": jax.ShapeDtypeStruct((size,), F32)} if weights else {}
        return _temp_bytes(mapped, x, **extra)

    even, small, large = temp(32 * 128), temp(32 * 128 + 5), temp(256 * 128 + 5)
    assert small == large  # independent of the batch
    # One microbatch's activations are 128 * 64 * 4 = 32 KiB, and the divisible loop holds
    # about one (33 KiB). The padded loop gathers its rows and selects the real ones, which
    # XLA:CPU keeps as two more microbatch-sized buffers (83 KiB): still one microbatch's
    # working set, and far from a copy of the batch (1 MiB at 32 * 128 rows).
    microbatch_bytes = 128 * features * 4
    assert small <= even + 2 * microbatch_bytes
    # With example_weights the loop also holds the weights in float32, 4 bytes per example
    # (the weights are an input of that size), and nothing per feature of the batch.
    weighted_small, weighted_large = temp(32 * 128 + 5, True), temp(256 * 128 + 5, True)
    assert weighted_small <= even + 2 * microbatch_bytes + 8 * (32 * 128 + 5)
    assert weighted_large - weighted_small <= 8 * (256 - 32) * 128


@pytest.mark.compiled
def test_gradients_through_weighted_loops_hold_one_microbatch():
    features = 64
    w = jnp.ones((features, features), F32) / features
    fun = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))  # noqa: E731
    mapped = micro_vmap(fun, (None, 0), microbatch_size=128, accumulator=SUM, allow_remainder=True)
    grad = jax.grad(lambda w, x, m: mapped(w, x, example_weights=m))

    def temp(size):
        x = jax.ShapeDtypeStruct((size, features), F32)
        return _temp_bytes(grad, w, x, jax.ShapeDtypeStruct((size,), F32))

    # About 264 KB at either size; a copy of the batch would be 1 and 8 MiB. The
    # weights may add a few bytes per example, never a row of 256.
    small, large = temp(4096 + 5), temp(8 * 4096 + 5)
    assert large - small <= 8 * 7 * 4096
    assert large < 2**20


def test_custom_accumulators_see_the_remainder_alone():
    # A custom accumulator cannot skip padding rows, so micro_vmap calls it once more on
    # the last rows, as microbatch does.
    seen = []

    def update(carry, x, i):
        seen.append(x.shape)
        return jnp.maximum(carry, x)

    top = Accumulator(
        init=lambda s: jnp.full(s.shape, -jnp.inf, s.dtype),
        update=update,
        finalize=lambda c: c,
        aggregate=lambda xs: jnp.max(xs, axis=0),
    )
    x = random_array(0, (10, 3), F32)
    got = micro_vmap(rows, microbatch_size=4, accumulator=top, allow_remainder=True)(x)
    assert_close(got, jnp.max(rows(x), 0))
    assert seen == [(4,), (4,)]  # traced once in the loop, once for the remainder
    pair = microbatch(lambda x: jnp.max(rows(x), 0), 0, 4, top, allow_remainder=True)(x)
    assert_close(pair, jnp.max(rows(x), 0))


def test_a_batch_smaller_than_the_microbatch():
    with pytest.raises(
        ValueError,
        match=r"The batch size 4 \(`x` axis 0 of shape \(4, 3\)\) is smaller than microbatch_size=10\. "
        r"Pass allow_remainder=True "
        r"to run it as one microbatch of 4 rows \(which micro_vmap and micro_grad pad to 10 "
        r"with masked copies of the last row\); or pass microbatch_size=4, or None for no "
        r"microbatching\.",
    ):
        micro_vmap(rows, microbatch_size=10)(jnp.ones((4, 3)))
    got = micro_vmap(rows, microbatch_size=10, accumulator=MEAN, allow_remainder=True)(
        jnp.ones((4, 3))
    )
    assert_close(got, jnp.mean(rows(jnp.ones((4, 3))), 0))


def test_allow_remainder_must_be_a_bool():
    with pytest.raises(
        TypeError,
        match=r"allow_remainder must be a bool, got allow_remainder='yes' of type str; pass True "
        r"or False\.",
    ):
        micro_vmap(rows, allow_remainder="yes")  # pyright: ignore[reportArgumentType]


def test_the_demo_scores_all_1797_digits_like_the_whole_batch():
    """The demo's evaluation, 64 rows at a time with ``allow_remainder``, on all digits."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "dp_sgd_digits.py"
    spec = importlib.util.spec_from_file_location("dp_sgd_digits", path)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    data = demo.load_data()
    x = jnp.concatenate([data.x_train, data.x_test])
    y = jnp.concatenate([data.y_train, data.y_test])
    assert x.shape[0] == 1797
    params = demo.init_params(jax.random.key(0), x.shape[1])
    with jax.numpy_rank_promotion("allow"):  # the demo's bias adds broadcast
        # a few plain gradient steps, so that the accuracy is neither 0 nor 1
        for _ in range(5):
            grads = jax.grad(demo.loss_fn)(params, x, y)
            params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        whole = demo.accuracy(params, x, y)
        micro = demo.microbatched_accuracy(params, x, y, 64)
    assert 0.2 < whole < 1.0
    assert micro == pytest.approx(whole, rel=1e-6, abs=1e-6)
