"""``example_weights``: per-example weights and masks, against ``jax.vmap`` or per-example
``jax.grad`` with the weights applied afterwards; rows of weight 0 never reach a result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbatching import AccumulationType, Accumulator, micro_grad, micro_vmap, microbatch

from .strategies import ROWS_W as W
from .strategies import (
    SIN_W,
    SIN_X,
    assert_close,
    clipped_grad_sum,
    mesh,
    random_array,
    rows,
    sin_loss,
    weighted,
)
from .strategies import two_layer_loss as _loss
from .strategies import two_layer_params as _params

SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
RUNNING_MEAN, MAX, MIN = AccumulationType.RUNNING_MEAN, AccumulationType.MAX, AccumulationType.MIN
REDUCING = [SUM, MEAN, RUNNING_MEAN, MAX, MIN]
F32 = jnp.float32


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
        grad = jax.jit(jax.grad(lambda w: jnp.sum(mapped(w, poisoned, example_weights=weights))))(W)
        want_grad = jax.jit(
            jax.grad(lambda w: jnp.sum(weighted(kind, jax.vmap(fun, (None, 0))(w, x), weights)))
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
    clean, _ = jax.jit(micro_grad(_loss, batch_argnums=(1, 2), **options))(params, x[mask], y[mask])
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
        grad = jax.jit(jax.grad(lambda p: mapped(p, zeros, example_weights=mask)))(jnp.ones(3, F32))  # noqa: B023
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
    got = jax.jit(jax.grad(lambda w: jnp.sum(total(x, example_weights=w))))(weights)
    want = jnp.where(weights != 0, jnp.sum(rows(x), axis=1), 0)
    assert_close(got, want)
    inside = micro_vmap(
        lambda x, w: w * rows(x), microbatch_size=4, accumulator=SUM, allow_remainder=True
    )
    got = jax.jit(jax.grad(lambda w: jnp.sum(inside(x, w))))(weights)
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
    per = jax.jit(jax.vmap(jax.grad(lambda p, x, y: _loss(p, x[None], y[None])), (None, 0, 0)))(
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
    got = jax.jit(jax.vmap(lambda w: mapped(x, W, example_weights=w)))(batch_of_weights)
    want = jax.jit(jax.vmap(lambda w: weighted(MEAN, rows(x, W), w)))(batch_of_weights)
    assert_close(got, want, terms=3)
    # gradients with respect to the weights themselves and to the parameters
    loss = lambda w, p: jnp.sum(jnp.sin(mapped(x, p, example_weights=w)))  # noqa: E731
    want_loss = lambda w, p: jnp.sum(jnp.sin(weighted(MEAN, rows(x, p), w)))  # noqa: E731
    w0 = batch_of_weights[0]
    grads = jax.jit(jax.grad(loss, (0, 1)))(w0, W)
    assert_close(grads, jax.jit(jax.grad(want_loss, (0, 1)))(w0, W), terms=3)


MAPPED_WEIGHTS = jnp.asarray(
    np.stack(
        [np.arange(16) % 3 != 0, np.random.default_rng(1).uniform(0.1, 2.0, 16), np.zeros(16)]
    ),
    F32,
)
"""Three rows of weights for a batch of 16 under ``jax.vmap``: a mask, weights, all 0."""


def _explicit_mesh() -> jax.sharding.Mesh:
    return mesh(jax.sharding.AxisType.Explicit, (4,))


def test_weights_mapped_by_vmap_on_an_explicit_mesh():
    """``jax.vmap`` over ``example_weights``, the batch sharded on an Explicit mesh: each
    row of weights gives its own results and derivatives, a row of zeros included (the
    loop's skip of a microbatch was a ``lax.cond`` on a predicate that vmap maps, which
    JAX turned into a select that refused the sharded batch)."""
    from jax.sharding import PartitionSpec as P

    x = random_array(0, (16, 3), F32)
    mapped = micro_vmap(lambda x: (rows(x), rows(x)), microbatch_size=4, accumulator=(SUM, CONCAT))
    total = lambda w, x: jnp.sum(mapped(x, example_weights=w)[0])  # noqa: E731
    with jax.set_mesh(_explicit_mesh()):
        xs, ws = jax.device_put(x, P("data")), jax.device_put(MAPPED_WEIGHTS, P(None, "data"))
        got = jax.jit(jax.vmap(lambda w: mapped(xs, example_weights=w)))(ws)
        slopes = jax.jit(jax.vmap(jax.grad(total), (0, None)))(ws, xs)
    ys = rows(x)
    for i, w in enumerate(MAPPED_WEIGHTS):
        assert_close(got[0][i], weighted(SUM, ys, w), terms=4)
        assert_close(got[1][i], weighted(CONCAT, ys, w))
        # an example of weight 0 is never evaluated: its weight's derivative is 0
        assert_close(slopes[i], jnp.where(w != 0, jnp.sum(ys, axis=1), 0))


@pytest.mark.parametrize("clip_method", [None, "auto", "materialize"])
def test_micro_grad_weights_mapped_by_vmap_on_an_explicit_mesh(clip_method):
    """The same for ``micro_grad``: unclipped, and clipped with the norms read off the
    per-example dot (``auto``) or from the per-example gradients."""
    from jax.sharding import PartitionSpec as P

    options = {} if clip_method is None else {"l2_clip_norm": 1.0, "clip_method": clip_method}
    grad_fn = micro_grad(sin_loss, keep_batch_dim=False, microbatch_size=4, **options)
    with jax.set_mesh(_explicit_mesh()):
        xs, ws = jax.device_put(SIN_X, P("data")), jax.device_put(MAPPED_WEIGHTS, P(None, "data"))
        got = jax.jit(jax.vmap(lambda w: grad_fn(SIN_W, xs, example_weights=w)[0]))(ws)
    grads = np.asarray(jax.vmap(jax.grad(sin_loss), (None, 0))(SIN_W, SIN_X), np.float64)
    factors = np.ones(16)
    if clip_method is not None:
        factors = np.minimum(1.0, 1.0 / np.linalg.norm(grads, axis=1))
    assert_close(got, (np.asarray(MAPPED_WEIGHTS, np.float64) * factors) @ grads, terms=4)


@pytest.mark.parametrize("clip_method", ["auto", "materialize"])
def test_a_derivative_through_nan_safe_with_weights_mapped_by_vmap_on_an_explicit_mesh(
    clip_method,
):
    """``jax.grad`` of a function of the ``nan_safe`` clipped sum, under ``jax.vmap`` over
    ``example_weights``, a batch with a NaN row sharded on an Explicit mesh: each row of
    weights gives the derivative of the finite rows alone (the derivative's skip where
    no row is kept was the same ``lax.cond``)."""
    from jax.sharding import PartitionSpec as P

    x = np.array(SIN_X)
    x[5, 1] = np.nan
    options = {"keep_batch_dim": False, "microbatch_size": 4, "l2_clip_norm": 1.0}
    grad_fn = micro_grad(sin_loss, clip_method=clip_method, nan_safe=True, **options)

    def outer(w, fn, x, weights):
        return jnp.sum(fn(w, x, example_weights=weights)[0] ** 2)

    finite = jnp.asarray(np.all(np.isfinite(x), axis=1))
    stand_in = jnp.asarray(np.where(np.isfinite(x), x, 1.0))
    summed = clipped_grad_sum(sin_loss, 1.0)
    reference = jax.vmap(lambda w: jax.grad(lambda v: jnp.sum(summed(v, stand_in, w) ** 2))(SIN_W))
    want = jax.jit(reference)(jnp.where(finite, MAPPED_WEIGHTS, 0))  # no mesh, no NaN
    with jax.set_mesh(_explicit_mesh()):
        xs, ws = jax.device_put(x, P("data")), jax.device_put(MAPPED_WEIGHTS, P(None, "data"))
        got = jax.jit(jax.vmap(lambda w: jax.grad(outer)(SIN_W, grad_fn, xs, w)))(ws)
    assert_close(got, want, terms=4)


def test_a_traced_count_mapped_by_vmap_on_an_explicit_mesh():
    """``jax.vmap`` over ``num_real_microbatches``, the batch sharded on an Explicit
    mesh: each count runs its own microbatches (the skip of the others, and of a
    remainder run apart, is the same ``lax.cond`` on a mapped predicate)."""
    from jax.sharding import PartitionSpec as P

    x = random_array(0, (20, 3), F32)  # microbatches of 8: rows {0, 2, ..., 14}, {1, ..., 15}
    counts = jnp.asarray([0, 1, 2, 3], jnp.int32)  # and the remainder {16, ..., 19}
    which = np.arange(20)
    microbatch_of = np.where(which < 16, which % 2, 2)

    def summed(count, x):
        looped = micro_vmap(rows, microbatch_size=8, accumulator=SUM, num_real_microbatches=count)
        return looped(x)

    def apart(count, x):
        remainder = microbatch(
            lambda x: jnp.sum(rows(x), 0),
            0,
            8,
            SUM,
            allow_remainder=True,
            num_real_microbatches=count,
        )
        return remainder(x)

    with jax.set_mesh(_explicit_mesh()):
        xs, whole = jax.device_put((x[:16], x), P("data"))
        got = jax.jit(jax.vmap(summed, (0, None)))(counts, xs)
        with pytest.warns(UserWarning, match=r"allow_remainder on a batch sharded over 4"):
            got_apart = jax.jit(jax.vmap(apart, (0, None)))(counts, whole)
    ys = rows(x)
    for count, one, other in zip(counts, got, got_apart, strict=True):
        ran = jnp.asarray(microbatch_of < count)
        assert_close(one, weighted(SUM, ys[:16], ran[:16]), terms=2)
        assert_close(other, weighted(SUM, ys, ran), terms=3)


def test_dp_sgd_with_poisson_sampling_compiles_once():
    """A fixed padded size, a mask, l2_clip_norm: one compilation for every real size.
    The reference: every example's gradient, clipped and summed over the sampled rows in
    NumPy (a reference compiled for each real size would take most of the test)."""
    padded, params = 32, _params()
    rng = np.random.default_rng(0)
    data_x, data_y = random_array(0, (100, 3), F32), random_array(1, (100,), F32)
    traces = []

    @jax.jit
    def clipped_sum(params, x, y, mask):
        traces.append(1)
        grad_fn = micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=8, l2_clip_norm=1.0)
        return grad_fn(params, x, y, example_weights=mask)[0]

    per_example = jax.jit(
        jax.vmap(jax.grad(lambda p, x, y: _loss(p, x[None], y[None])), (None, 0, 0))
    )
    grads = {k: np.asarray(g, np.float64) for k, g in per_example(params, data_x, data_y).items()}
    norms = np.sqrt(sum(np.sum(g.reshape(100, -1) ** 2, axis=1) for g in grads.values()))
    factors = np.minimum(1.0, 1.0 / norms)
    for _ in range(4):
        chosen = np.flatnonzero(rng.random(100) < 0.2)[:padded]  # Poisson sampling
        index = np.zeros(padded, np.int32)
        index[: len(chosen)] = chosen
        mask = jnp.asarray(np.arange(padded) < len(chosen))
        got = clipped_sum(params, data_x[index], data_y[index], mask)
        want = {k: np.tensordot(factors[chosen], g[chosen], axes=1) for k, g in grads.items()}
        assert_close(got, want, dtype=F32, terms=4)
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
        match=r"must have equal batch sizes, got \[8, 6\]: `x` axis 0 of shape \(8, 3\); "
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


def test_example_weights_none_means_no_weights():
    x = random_array(0, (6, 3), F32)
    mapped = micro_vmap(rows, microbatch_size=4, accumulator=SUM, allow_remainder=True)
    np.testing.assert_array_equal(mapped(x, example_weights=None), mapped(x))


def test_a_derivative_under_vmap_over_the_count_reads_nothing_a_count_skips():
    """Round 14 of the hostile tests: ``jax.vmap`` over ``num_real_microbatches`` of
    ``jax.grad`` through ``microbatch``, where a microbatch that one count skips (a loop
    microbatch, the remainder) has an infinite or NaN derivative: each count's gradient
    is that of its own microbatches, as without the vmap. The skip ran both sides and
    guarded only its operands; the batch a loop body slices and the parameters it
    closes over carried ``0 * inf`` into the counts that skip."""
    w = jnp.asarray([1.0, 2.0])
    x = np.full((10, 2), 1.0, np.float32)  # microbatches of 4: rows {0, 2, 4, 6}, {1, 3, 5, 7}
    x[1, 0] = 0.0  # the second microbatch: the derivative of sqrt is inf there
    x[9, 1] = np.nan  # the remainder, rows {8, 9}
    x = jnp.asarray(x)

    def grads(count, w, x):
        looped = microbatch(
            lambda w, x: jnp.sum(jnp.sqrt(x) @ w),
            1,
            4,
            SUM,
            allow_remainder=True,
            num_real_microbatches=count,
        )
        return jax.grad(looped, (0, 1))(w, x)

    counts = jnp.asarray([0, 1, 2, 3], jnp.int32)
    got = jax.jit(jax.vmap(grads, (0, None, None)))(counts, w, x)
    which = np.arange(10)
    microbatch_of = np.where(which < 8, which % 2, 2)
    for i, count in enumerate(counts.tolist()):
        ran = microbatch_of < count
        want = jax.grad(lambda w, x, ran=ran: jnp.sum(jnp.sqrt(x[ran]) @ w), (0, 1))(w, x)
        for one, reference in zip((got[0][i], got[1][i]), want, strict=True):
            finite = np.isfinite(np.asarray(reference))
            np.testing.assert_array_equal(np.isfinite(np.asarray(one)), finite)
            assert_close(jnp.where(finite, one, 0), jnp.where(finite, reference, 0), terms=4)
