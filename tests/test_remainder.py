"""Any batch (issue 8): ``allow_remainder``, ``example_weights`` and MAX and MIN.

Every result is compared with an independent reference: ``fun`` on the whole batch, or
``jax.vmap`` / per-example ``jax.grad`` with the weights applied afterwards.
"""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatching import AccumulationType, Accumulator, micro_grad, micro_vmap, microbatch

from .strategies import assert_close, clipper, random_array

SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
RUNNING_MEAN, MAX, MIN = AccumulationType.RUNNING_MEAN, AccumulationType.MAX, AccumulationType.MIN
REDUCING = [SUM, MEAN, RUNNING_MEAN, MAX, MIN]
F32 = jnp.float32
W = random_array(0, (3, 4), F32) / 2


def rows(x, w=W):
    """A per-example function of a row of 3 features, as a microbatch of rows."""
    return jnp.tanh(x @ w)


def weighted(kind, ys, weights=None):
    """The reference: per-example results ``ys`` (rows on axis 0) reduced by ``kind`` with
    ``weights`` applied afterwards (None: all 1)."""
    n = ys.shape[0]
    weights = jnp.ones(n, bool) if weights is None else weights
    keep = jnp.reshape(weights != 0, (n,) + (1,) * (ys.ndim - 1))
    if kind is CONCAT:
        return jnp.where(keep, ys, 0)
    if kind in (MAX, MIN):
        low = -jnp.inf if jnp.issubdtype(ys.dtype, jnp.floating) else jnp.iinfo(ys.dtype).min
        if kind is MAX:
            return jnp.max(jnp.where(keep, ys, low), axis=0, initial=low)
        high = jnp.inf if low == -jnp.inf else jnp.iinfo(ys.dtype).max
        return jnp.min(jnp.where(keep, ys, high), axis=0, initial=high)
    w = jnp.reshape(weights.astype(F32), keep.shape)
    total = jnp.sum(jnp.where(keep, ys.astype(F32) * w, 0), axis=0)
    if kind is SUM:
        return total
    count = jnp.sum(weights.astype(F32))
    if kind is RUNNING_MEAN:  # no weight seen: the running mean's 0
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
    return jnp.asarray(np.where(keep, rng.uniform(0.1, 2.0, size), 0.0), F32)


def terms(size, microbatch_size):
    return max(1, -(-size // microbatch_size))


# --- allow_remainder: every transform, every accumulator, against the whole batch --------


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


@settings(max_examples=40, deadline=None)
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


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 17), microbatch_size=st.integers(1, 6), kind=st.sampled_from(REDUCING))
def test_microbatch_with_a_remainder_on_a_later_axis(size, microbatch_size, kind):
    x = random_array(size, (3, size), F32)
    fun = lambda w, x: _microbatch_fun(kind)(x.T, 1.0)  # noqa: E731
    got = microbatch(fun, 1, microbatch_size, kind, in_axes=1, allow_remainder=True)(W, x)
    assert_close(got, jax.jit(fun)(W, x), terms=terms(size, microbatch_size))


@settings(max_examples=60, deadline=None)
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


def _loss(params, x, y):
    """A per-example loss (``keep_batch_dim``: a batch of one)."""
    pred = jnp.tanh(x @ params["w"]) @ params["v"]
    return jnp.mean((pred - y) ** 2)


def _params():
    return {"w": random_array(3, (3, 4), F32) / 2, "v": random_array(4, (4,), F32)}


@settings(max_examples=40, deadline=None)
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


@pytest.mark.x64
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


# --- example_weights ---------------------------------------------------------------------


@pytest.mark.x64
@pytest.mark.parametrize("kind", list(AccumulationType))
def test_weight_zero_rows_never_leak_a_nan(kind):
    size, microbatch_size = 11, 4  # a remainder of 3: the padding copies row 10
    x = jnp.abs(random_array(0, (size, 3), F32)) + 0.5
    weights = jnp.asarray([1, 0, 2, 1, 0, 1, 1, 0.5, 1, 1, 0], F32)  # row 10 has weight 0
    poisoned = jnp.where((weights == 0)[:, None], jnp.nan, x)
    fun = lambda w, x: jnp.log(x) @ w  # noqa: E731 - NaN on the poisoned rows
    mapped = micro_vmap(
        fun, (None, 0), microbatch_size=microbatch_size, accumulator=kind, allow_remainder=True
    )
    got = jax.jit(mapped)(W, poisoned, example_weights=weights)
    want = weighted(kind, jax.vmap(fun, (None, 0))(W, x), weights)
    assert np.all(np.isfinite(np.asarray(got)))
    assert_close(got, want, terms=3)
    # and through jax.grad of the mapped function, where 0 * NaN would show up
    if kind is not CONCAT:
        grad = jax.grad(lambda w: jnp.sum(mapped(w, poisoned, example_weights=weights)))(W)
        want_grad = jax.grad(
            lambda w: jnp.sum(weighted(kind, jax.vmap(fun, (None, 0))(w, x), weights))
        )(W)
        assert_close(grad, want_grad, terms=3)


@pytest.mark.x64
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"l2_clip_norm": 0.5},
        {"transform_fn": lambda g: g},
        {"accumulator": MEAN},
        {"accumulator": MAX},
    ],
    ids=["fast", "clipped", "per-example", "mean", "max"],
)
def test_weight_zero_examples_give_finite_gradients(options):
    params = _params()
    size = 11
    x, y = random_array(0, (size, 3), F32), random_array(1, (size,), F32)
    mask = jnp.asarray([1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0], bool)
    poisoned = jnp.where(mask[:, None], x, jnp.nan)
    grad_fn = micro_grad(
        _loss, batch_argnums=(1, 2), microbatch_size=4, allow_remainder=True, **options
    )
    grads, aux = jax.jit(grad_fn)(params, poisoned, y, example_weights=mask)
    clean, _ = micro_grad(_loss, batch_argnums=(1, 2), **options)(params, x[mask], y[mask])
    for leaf in jax.tree.leaves((grads, aux)):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert_close(grads, clean, terms=3)
    np.testing.assert_array_equal(np.asarray(aux.values)[~np.asarray(mask)], 0)


@pytest.mark.x64
def test_all_weights_zero_gives_zero_sums_and_identity_extrema():
    x = jnp.full((6, 3), jnp.nan, F32)
    weights = jnp.zeros(6, F32)
    for kind, want in [
        (SUM, 0.0),
        (RUNNING_MEAN, 0.0),
        (MAX, -np.inf),
        (MIN, np.inf),
        (CONCAT, 0.0),
    ]:
        got = micro_vmap(rows, microbatch_size=4, accumulator=kind, allow_remainder=True)(
            x, example_weights=weights
        )
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want, got.shape))
    grads, _ = micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=4, allow_remainder=True)(
        _params(), x, x[:, 0], example_weights=weights
    )
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_array_equal(np.asarray(leaf), 0)


@pytest.mark.x64
def test_all_weights_zero_gives_zero_gradients_through_micro_vmap():
    # fun is NaN on the zero rows; with no example kept, fun must not run at all.
    fun = lambda p, x: jnp.sum(p * x) / jnp.linalg.norm(x)  # noqa: E731
    zeros, mask = jnp.zeros((8, 3), F32), jnp.zeros(8, bool)
    for options in [{"microbatch_size": 4}, {"microbatch_size": 3, "allow_remainder": True}, {}]:
        mapped = micro_vmap(fun, (None, 0), accumulator=SUM, **options)
        grad = jax.grad(lambda p: mapped(p, zeros, example_weights=mask))(jnp.ones(3, F32))  # noqa: B023
        np.testing.assert_array_equal(np.asarray(grad), 0)


@pytest.mark.x64
def test_nested_transforms_and_signature_binding_with_weights():
    import inspect

    inner = micro_vmap(lambda p, r: jnp.sum(jnp.sin(r * p)), (None, 0), accumulator=SUM)
    outer = micro_grad(inner, batch_argnums=1, microbatch_size=2, allow_remainder=True)
    x, w = jnp.arange(5.0, dtype=F32)[:, None, None], jnp.asarray([1, 0, 1, 1, 0.5], F32)
    got, _ = outer(jnp.float32(1.0), x, example_weights=w)
    assert_close(got, jnp.sum(w * jnp.cos(x[:, 0, 0]) * x[:, 0, 0]))
    assert "example_weights" in inspect.signature(outer).parameters
    donated = jax.jit(outer, donate_argnames="example_weights")
    assert_close(donated(jnp.float32(1.0), x, example_weights=jnp.array(w))[0], got)


def test_weights_sharded_with_a_microbatch_the_shards_do_not_divide():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("b",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((20, 3), F32), NamedSharding(mesh, P("b")))
        w = jax.device_put(jnp.ones(20, F32), NamedSharding(mesh, P("b")))
        with pytest.raises(
            ValueError, match=r"microbatch_size=5 is not a multiple of the 4 shards"
        ):
            micro_vmap(rows, microbatch_size=5, accumulator=SUM)(x, example_weights=w)


@pytest.mark.x64
def test_integer_outputs_with_masks_and_weights():
    x = jnp.arange(10, dtype=jnp.int32) - 4
    mask = jnp.asarray([1, 1, 0, 1, 0, 1, 1, 1, 0, 1], bool)
    square = lambda v: v * v  # noqa: E731
    for kind in (SUM, MAX, MIN, CONCAT):
        got = micro_vmap(square, microbatch_size=3, accumulator=kind, allow_remainder=True)(
            x, example_weights=mask
        )
        # a boolean mask keeps integers exact (sums promote as jnp.sum does)
        assert got.dtype == (jnp.sum(x, axis=0).dtype if kind is SUM else x.dtype)
        np.testing.assert_array_equal(got, weighted(kind, x * x, mask))
    mean = micro_vmap(square, microbatch_size=3, accumulator=MEAN, allow_remainder=True)(
        x, example_weights=mask
    )
    assert_close(mean, float(np.mean(np.asarray(x * x)[np.asarray(mask)])))
    # Float weights on integer outputs give a float sum, as jnp.sum(w * x) does.
    half = jnp.full(10, 0.5, F32)
    total = micro_vmap(square, microbatch_size=3, accumulator=SUM)(x[:9], example_weights=half[:9])
    assert total.dtype == F32
    assert_close(total, 0.5 * float(jnp.sum(x[:9] * x[:9])))


@pytest.mark.x64
def test_integer_weights_keep_integer_sums_exact():
    x = jnp.full(3, 2**24 + 1, jnp.int32)  # not a float32
    identity = lambda v: v  # noqa: E731
    total = micro_vmap(identity, microbatch_size=2, accumulator=SUM, allow_remainder=True)
    got = total(x, example_weights=jnp.asarray([1, 2, 0], jnp.int32))
    assert jnp.issubdtype(got.dtype, jnp.integer) and int(got) == 3 * (2**24 + 1)
    # narrow float weights on integers give float32 sums, not bfloat16 ones
    ones = total(jnp.ones(1001, jnp.int32), example_weights=jnp.ones(1001, jnp.bfloat16))
    assert ones.dtype == F32 and float(ones) == 1001.0


@pytest.mark.x64
def test_the_gradient_with_respect_to_the_weights():
    # d/dw_b of SUM is y_b where w_b != 0; a weight of exactly 0 is a mask, and its
    # example is never evaluated, so its derivative is 0. Multiply inside fun to
    # differentiate at 0 (learning to reweight).
    x = random_array(0, (10, 3), F32)
    weights = jnp.asarray([0.5, 0, 1, 2, 0, 1, 1, 0.5, 1, 3], F32)
    total = micro_vmap(rows, microbatch_size=4, accumulator=SUM, allow_remainder=True)
    got = jax.grad(lambda w: jnp.sum(total(x, example_weights=w)))(weights)
    want = jnp.where(weights != 0, jnp.sum(rows(x), axis=1), 0)
    assert_close(got, want)
    inside = micro_vmap(
        lambda x, w: w * rows(x), microbatch_size=4, accumulator=SUM, allow_remainder=True
    )
    got = jax.grad(lambda w: jnp.sum(inside(x, w)))(weights)
    assert_close(got, jnp.sum(rows(x), axis=1))


@pytest.mark.x64
def test_integer_weights_are_counts():
    x = random_array(0, (8, 3), F32)
    counts = jnp.asarray([3, 0, 1, 7, 2, 2, 0, 1], jnp.int32)  # e.g. tokens per example
    got = micro_vmap(rows, microbatch_size=4, accumulator=MEAN)(x, example_weights=counts)
    assert_close(got, weighted(MEAN, rows(x), counts.astype(F32)), terms=2)


@pytest.mark.x64
def test_weights_without_microbatching():
    x = random_array(0, (7, 3), F32)
    weights = jnp.asarray([1, 0, 2, 1, 0, 1, 1], F32)
    for kind in AccumulationType:
        got = micro_vmap(rows, accumulator=kind)(x, example_weights=weights)
        assert_close(got, weighted(kind, rows(x), weights))
    grads, _ = micro_grad(_loss, batch_argnums=(1, 2), accumulator=MEAN)(
        _params(), x, x[:, 0], example_weights=weights
    )
    per = jax.vmap(jax.grad(lambda p, x, y: _loss(p, x[None], y[None])), (None, 0, 0))(
        _params(), x, x[:, 0]
    )
    assert_close(grads, jax.tree.map(lambda g: weighted(MEAN, g, weights), per))


@pytest.mark.x64
@pytest.mark.parametrize("count", [0, 1, 2, 3, 5])
def test_a_traced_count_with_a_remainder_and_a_mask(count):
    size, microbatch_size = 11, 4  # microbatches: rows {0,2,4,6}, {1,3,5,7}, {8,9,10}
    x = random_array(0, (size, 3), F32)
    mask = jnp.asarray(np.arange(size) % 4 != 1)
    which = np.arange(size)
    microbatch_of = np.where(which < 8, which % 2, 2)
    ran = jnp.asarray(microbatch_of < count)

    def traced(n):
        return micro_vmap(
            lambda x: (rows(x), rows(x), rows(x)),
            microbatch_size=microbatch_size,
            accumulator=(SUM, RUNNING_MEAN, CONCAT),
            num_real_microbatches=n,
            allow_remainder=True,
        )(x, example_weights=mask)

    got = jax.jit(traced)(jnp.int32(count))
    kept = mask & ran
    ys = rows(x)
    assert_close(got[0], weighted(SUM, ys, kept), terms=3)
    assert_close(got[1], weighted(RUNNING_MEAN, ys, kept), terms=3)
    assert_close(got[2], weighted(CONCAT, ys, kept))

    def summed(n):
        return microbatch(
            lambda x: jnp.sum(rows(x), 0),
            0,
            microbatch_size,
            SUM,
            allow_remainder=True,
            num_real_microbatches=n,
        )(x)

    assert_close(jax.jit(summed)(jnp.int32(count)), weighted(SUM, ys, ran), terms=3)


def test_weights_compose_with_grad_and_vmap():
    x = random_array(0, (10, 3), F32)
    batch_of_weights = jnp.asarray(np.random.default_rng(0).uniform(size=(3, 10)), F32)
    mapped = micro_vmap(rows, (0, None), microbatch_size=4, accumulator=MEAN, allow_remainder=True)
    got = jax.vmap(lambda w: mapped(x, W, example_weights=w))(batch_of_weights)
    want = jax.vmap(lambda w: weighted(MEAN, rows(x, W), w))(batch_of_weights)
    assert_close(got, want, terms=3)
    # gradients with respect to the weights themselves and to the parameters
    loss = lambda w, p: jnp.sum(jnp.sin(mapped(x, p, example_weights=w)))  # noqa: E731
    want_loss = lambda w, p: jnp.sum(jnp.sin(weighted(MEAN, rows(x, p), w)))  # noqa: E731
    w0 = batch_of_weights[0]
    assert_close(jax.grad(loss, (0, 1))(w0, W), jax.grad(want_loss, (0, 1))(w0, W), terms=3)


def test_dp_sgd_with_poisson_sampling_compiles_once():
    """A fixed padded size, a mask, l2_clip_norm: one compilation for every real size."""
    padded, params = 32, _params()
    rng = np.random.default_rng(0)
    data_x, data_y = random_array(0, (100, 3), F32), random_array(1, (100,), F32)
    traces = []

    @jax.jit
    def clipped_sum(params, x, y, mask):
        traces.append(1)
        grad_fn = micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=8, l2_clip_norm=1.0)
        return grad_fn(params, x, y, example_weights=mask)[0]

    reference = jax.jit(micro_grad(_loss, batch_argnums=(1, 2), l2_clip_norm=1.0))
    for _ in range(4):
        chosen = np.flatnonzero(rng.random(100) < 0.2)[:padded]  # Poisson sampling
        index = np.zeros(padded, np.int32)
        index[: len(chosen)] = chosen
        mask = jnp.asarray(np.arange(padded) < len(chosen))
        got = clipped_sum(params, data_x[index], data_y[index], mask)
        want, _ = reference(params, data_x[chosen], data_y[chosen])
        assert_close(got, want, terms=4)
    assert len(traces) == 1


@pytest.mark.x64
def test_evaluation_of_1797_rows_at_microbatch_64():
    """The issue's case: padding plus num_real_microbatches scored the wrong rows."""
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.normal(size=(1797, 8)), F32)
    weights = jnp.asarray(rng.normal(size=(8, 10)), F32)
    labels = jnp.argmax(features @ weights, axis=1)
    labels = labels.at[::7].set((labels[::7] + 1) % 10)  # about 86% right

    def correct(x, label):
        return (jnp.argmax(x @ weights) == label).astype(F32)

    full = jnp.mean(jax.vmap(correct)(features, labels))
    accuracy = micro_vmap(correct, microbatch_size=64, accumulator=MEAN, allow_remainder=True)
    assert_close(jax.jit(accuracy)(features, labels), full, terms=29)
    hits = micro_vmap(correct, microbatch_size=64, accumulator=SUM, allow_remainder=True)
    assert float(hits(features, labels)) == float(jnp.sum(jax.vmap(correct)(features, labels)))


@pytest.mark.x64
def test_sharded_weights_move_no_batch_data():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from .test_sharding import MOVES_DATA, all_reduces_in_loops, collectives

    x = random_array(0, (64, 3), F32)
    mask = jnp.asarray(np.arange(64) % 5 != 0)
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
        auto = axis_type is AxisType.Auto
        for kind in (SUM, MEAN, MAX, CONCAT):
            fun = micro_vmap(
                rows, microbatch_size=16, accumulator=kind, batch_mesh_axes="data" if auto else None
            )
            want = weighted(kind, rows(x), mask)
            with jax.set_mesh(mesh):
                xs = jax.device_put(x, NamedSharding(mesh, P("data")))
                ms = jax.device_put(mask, NamedSharding(mesh, P("data")))
                call = lambda x, m, fun=fun: fun(x, example_weights=m)  # noqa: E731
                assert_close(jax.jit(call)(xs, ms), want, terms=4)
                counts = collectives(call, xs, ms)
                assert {k: counts[k] for k in MOVES_DATA} == dict.fromkeys(MOVES_DATA, 0)
                assert all_reduces_in_loops(call, xs, ms) == 0


@pytest.mark.x64
def test_a_remainder_on_an_explicit_mesh():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    x = random_array(0, (1032, 3), F32)  # 16 microbatches of 64 and one of 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    moved = (
        r"allow_remainder on a batch sharded over 8 devices: with a remainder of 8 rows the "
        r"microbatches no longer line up with the shards, so each microbatch's rows are gathered "
        r"across devices\. To keep every row on its device, pad the batch to a multiple of "
        r"microbatch_size \(a multiple of 8\)"
    )
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        for kind in (SUM, MEAN, MAX, CONCAT):
            mapped = micro_vmap(rows, microbatch_size=64, accumulator=kind, allow_remainder=True)
            with pytest.warns(UserWarning, match=moved + r" and pass example_weights that are 0"):
                got = jax.jit(mapped)(xs)
            assert_close(got, weighted(kind, rows(x)), terms=17)
        summed = microbatch(lambda x: jnp.sum(rows(x), 0), 0, 64, SUM, allow_remainder=True)
        with pytest.warns(UserWarning, match=moved + r"\.$"):
            got = jax.jit(summed)(xs)
        assert_close(got, jnp.sum(rows(x), 0), terms=17)
        with pytest.raises(ValueError, match=r"microbatch_size=60 is not a multiple of the 8"):
            micro_vmap(rows, microbatch_size=60, allow_remainder=True)(xs)


# --- MAX and MIN ---------------------------------------------------------------------------


@pytest.mark.x64
def test_max_and_min_in_accumulator_trees_and_integers():
    x = jnp.asarray([[3, -1], [7, 2], [-5, 9], [0, 4], [6, -8], [1, 1]], jnp.int32)
    fun = lambda x: (jnp.max(x, 0), {"lo": jnp.min(x, 0), "n": jnp.sum(x)})  # noqa: E731
    got = microbatch(fun, 0, 2, (MAX, {"lo": MIN, "n": AccumulationType.SUM}))(x)
    np.testing.assert_array_equal(got[0], [7, 9])
    np.testing.assert_array_equal(got[1]["lo"], [-5, -8])
    assert int(got[1]["n"]) == int(jnp.sum(x))
    mapped = micro_vmap(
        lambda r: (r, -r), microbatch_size=4, accumulator=(MAX, MIN), allow_remainder=True
    )
    hi, lo = mapped(x)
    np.testing.assert_array_equal(hi, [7, 9])
    np.testing.assert_array_equal(lo, [-7, -9])
    booleans = micro_vmap(
        lambda r: r > 0, microbatch_size=4, accumulator=MAX, allow_remainder=True
    )(x)
    np.testing.assert_array_equal(booleans, [True, True])


def test_max_of_gradients_per_coordinate():
    params = _params()
    x, y = random_array(0, (9, 3), F32), random_array(1, (9,), F32)
    per = jax.vmap(jax.grad(lambda p, x, y: _loss(p, x[None], y[None])), (None, 0, 0))(params, x, y)
    for kind, reduce in [(MAX, jnp.max), (MIN, jnp.min)]:
        got, _ = micro_grad(
            _loss, batch_argnums=(1, 2), microbatch_size=2, accumulator=kind, allow_remainder=True
        )(params, x, y)
        assert_close(got, jax.tree.map(lambda g, reduce=reduce: reduce(g, 0), per))


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


# --- errors ------------------------------------------------------------------------------


def test_fun_may_not_take_example_weights():
    def fun(x, example_weights):
        return x * example_weights

    expected = (
        r"fun\(x, example_weights\) has a parameter named 'example_weights', but micro_vmap "
        r"takes example_weights= itself \(per-example weights, never passed to fun\); rename "
        r"the parameter of fun\."
    )
    with pytest.raises(ValueError, match=expected):
        micro_vmap(fun)
    with pytest.raises(ValueError, match=expected.replace("micro_vmap", "micro_grad")):
        micro_grad(fun)

    def keyword_only(x, *, example_weights=None):
        return x

    with pytest.raises(ValueError, match=r"keyword_only.* has a parameter named 'example_weights'"):
        micro_vmap(keyword_only)


@pytest.mark.x64
def test_bad_example_weights():
    mapped = micro_vmap(rows, microbatch_size=4)
    x = random_array(0, (8, 3), F32)
    with pytest.raises(
        ValueError,
        match=r"example_weights must have shape \(batch_size,\), one weight per example, got "
        r"shape \(8, 1\); pass a vector, e\.g\. example_weights=mask\.reshape\(-1\)\.",
    ):
        mapped(x, example_weights=jnp.ones((8, 1)))
    with pytest.raises(
        TypeError,
        match=r"example_weights must be an array of one weight per example, got \[1, 1\] of "
        r"type list; pass e\.g\. jnp\.ones\(batch_size\) or a boolean mask\.",
    ):
        mapped(x, example_weights=[1, 1])
    with pytest.raises(
        TypeError,
        match=r"example_weights of micro_vmap must be bool, integer or floating, got dtype "
        r"complex64; pass real weights, or a boolean mask\.",
    ):
        mapped(x, example_weights=jnp.ones(8, jnp.complex64))
    with pytest.raises(
        ValueError,
        match=r"must have equal batch sizes, got \[6, 8\]: `x` axis 0 of shape \(8, 3\); "
        r"`example_weights` axis 0 of shape \(6,\)",
    ):
        micro_vmap(lambda x: x, microbatch_size=4)(x, example_weights=jnp.ones(6))


def test_weights_with_a_custom_accumulator():
    total = Accumulator(
        init=lambda s: jnp.zeros(s.shape, s.dtype),
        update=lambda c, x, i: c + x,
        finalize=lambda c: c,
        aggregate=lambda xs: jnp.sum(xs, 0),
    )
    with pytest.raises(
        TypeError,
        match=r"example_weights needs built-in accumulators, but the accumulator tree has a "
        r"custom Accumulator, which cannot know the weights; weight the examples inside fun, "
        r"or use AccumulationType members for the outputs\.",
    ):
        micro_vmap(rows, microbatch_size=4, accumulator=total)(
            random_array(0, (8, 3), F32), example_weights=jnp.ones(8)
        )


@pytest.mark.x64
def test_max_of_complex_results():
    with pytest.raises(
        ValueError,
        match=r"AccumulationType\.MAX needs ordered results, but fun returned a leaf of dtype "
        r"complex64; take the real part or the modulus inside fun\.",
    ):
        micro_vmap(lambda x: x * 1j, microbatch_size=2, accumulator=MAX)(jnp.ones(4, F32))


def test_microbatch_takes_no_example_weights():
    with pytest.raises(
        TypeError,
        match=r"rows\(x, w\) was called with example_weights=, which microbatch passes on to "
        r"fun, and fun has no such parameter; per-example weights are a keyword of the "
        r"functions that micro_vmap and micro_grad return\.",
    ):
        microbatch(rows, 0, 4)(jnp.ones((8, 3)), example_weights=jnp.ones(8))  # pyright: ignore[reportCallIssue]


@pytest.mark.parametrize(
    "options",
    [{}, {"l2_clip_norm": 1.0}, {"transform_fn": lambda g: g}, {"accumulator": MAX}],
    ids=["fast", "clipped", "per-example", "max"],
)
def test_a_loss_that_is_not_scalar_per_example(options):
    def loss(params, x):
        return jnp.tanh(x @ params)  # one value per output, not a scalar

    with pytest.raises(
        TypeError,
        match=r"micro_grad needs fun to return a scalar loss per example, but it returned shape "
        r"\(1, 4\) for each; reduce it to a scalar in fun\.",
    ):
        micro_grad(loss, microbatch_size=2, **options)(W, jnp.ones((4, 3)))


def test_a_batch_smaller_than_the_microbatch():
    with pytest.raises(
        ValueError,
        match=r"The batch size 4 is smaller than microbatch_size=10\. Pass allow_remainder=True "
        r"to run it as one microbatch, padded to 10 rows where the transform pads; or pass "
        r"microbatch_size=4, or None for no microbatching\.",
    ):
        micro_vmap(rows, microbatch_size=10)(jnp.ones((4, 3)))
    got = micro_vmap(rows, microbatch_size=10, accumulator=MEAN, allow_remainder=True)(
        jnp.ones((4, 3))
    )
    assert_close(got, jnp.mean(rows(jnp.ones((4, 3))), 0))


def test_example_weights_none_means_no_weights():
    x = random_array(0, (6, 3), F32)
    mapped = micro_vmap(rows, microbatch_size=4, accumulator=SUM, allow_remainder=True)
    np.testing.assert_array_equal(mapped(x, example_weights=None), mapped(x))


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
