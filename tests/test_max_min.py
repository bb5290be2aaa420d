"""``AccumulationType.MAX`` and ``MIN``: against the whole batch, in every dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from microbatching import AccumulationType, micro_grad, micro_vmap, microbatch

from .strategies import assert_close, random_array
from .strategies import two_layer_loss as _loss
from .strategies import two_layer_params as _params

SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
RUNNING_MEAN, MAX, MIN = AccumulationType.RUNNING_MEAN, AccumulationType.MAX, AccumulationType.MIN
REDUCING = [SUM, MEAN, RUNNING_MEAN, MAX, MIN]
F32 = jnp.float32


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


@pytest.mark.x64
def test_max_of_complex_results():
    with pytest.raises(
        ValueError,
        match=r"AccumulationType\.MAX needs ordered results, but fun returned a leaf of dtype "
        r"complex64; take the real part or the modulus inside fun\.",
    ):
        micro_vmap(lambda x: x * 1j, microbatch_size=2, accumulator=MAX)(jnp.ones(4, F32))


# --- integer and boolean extrema ----------------------------------------------------

X = random_array(0, (16, 3), jnp.float32)
W = random_array(1, (3,), jnp.float32)
EXTREMA = [AccumulationType.MIN, AccumulationType.MAX]
INTEGERS = [jnp.uint8, jnp.uint16, jnp.uint32, jnp.int8, jnp.int32, jnp.bool_]


def loss(w, x):
    return jnp.sum(jnp.sin(x @ w))


def _integers(dtype, rows: int) -> np.ndarray:
    values = np.random.default_rng(0).integers(0, 100, (rows, 2))
    return (values % 2).astype(dtype) if dtype == jnp.bool_ else values.astype(dtype)


@pytest.mark.parametrize("kind", EXTREMA, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", INTEGERS, ids=lambda d: np.dtype(d).name)
def test_integer_and_bool_extrema_equal_the_whole_batch(dtype, kind):
    x = _integers(dtype, 10)
    reduce = np.min if kind is AccumulationType.MIN else np.max
    fun = micro_vmap(lambda v: v, microbatch_size=4, accumulator=kind, allow_remainder=True)
    got = jax.jit(fun)(x)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, reduce(x, axis=0))


@pytest.mark.parametrize("kind", EXTREMA, ids=lambda k: k.name)
def test_unsigned_extrema_of_no_rows_are_the_dtypes_limits(kind):
    weights = np.zeros(8, np.float32)
    fun = micro_vmap(lambda v: v, microbatch_size=4, accumulator=kind)
    got = fun(_integers(jnp.uint32, 8), example_weights=weights)
    info = np.iinfo(np.uint32)
    want = info.max if kind is AccumulationType.MIN else info.min
    np.testing.assert_array_equal(got, np.full(2, want, np.uint32))


@pytest.mark.parametrize("kind", EXTREMA, ids=lambda k: k.name)
def test_unsigned_extrema_of_transformed_gradients_equal_vmap(kind):
    def to_uint(g):
        return jnp.round(jnp.abs(g) * 1000).astype(jnp.uint32)

    got, _ = micro_grad(loss, microbatch_size=4, accumulator=kind, transform_fn=to_uint)(W, X)
    per_example = jax.vmap(lambda x: to_uint(jax.grad(loss)(W, x[None])))(X)
    reduce = jnp.min if kind is AccumulationType.MIN else jnp.max
    np.testing.assert_array_equal(got, reduce(per_example, axis=0))


@pytest.mark.parametrize("kind", EXTREMA, ids=lambda k: k.name)
def test_unsigned_extrema_on_an_auto_mesh_with_batch_mesh_axes(kind):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = _integers(jnp.uint32, 32)
    fun = micro_vmap(lambda v: v, microbatch_size=16, accumulator=kind, batch_mesh_axes="data")
    with jax.set_mesh(mesh):
        got = jax.jit(fun)(jax.device_put(x, NamedSharding(mesh, P("data"))))
    reduce = np.min if kind is AccumulationType.MIN else np.max
    np.testing.assert_array_equal(got, reduce(x, axis=0))


@pytest.mark.parametrize("how", ["MAX", "MIN"])
@pytest.mark.parametrize("microbatch_size", [4, None], ids=["microbatched", "whole"])
def test_an_empty_batch_reduces_to_the_identity_in_every_transform(how, microbatch_size):
    """MAX and MIN over no examples give their identity (``-inf``, ``inf``), as
    ``microbatch`` already did; ``micro_vmap`` and ``micro_grad`` raised NumPy's
    "zero-size array to reduction operation" (breaker round 24)."""
    kind = AccumulationType[how]
    identity = -jnp.inf if how == "MAX" else jnp.inf
    x = jnp.ones((0, 3))
    mapped = micro_vmap(lambda r: 2 * r, microbatch_size=microbatch_size, accumulator=kind)(x)
    assert mapped.shape == (3,) and bool(jnp.all(mapped == identity))
    grads, aux = micro_grad(
        lambda w, r: jnp.sum(r @ w), microbatch_size=microbatch_size, accumulator=kind
    )(jnp.ones(3), x)
    assert grads.shape == (3,) and bool(jnp.all(grads == identity))
    assert aux.values.shape == (0,)
