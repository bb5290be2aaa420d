"""Calls that used to fail: a batch not placed on an Explicit mesh, clip norms given as
arrays, progress inside ``shard_map``. Each is compared with an independent reference
(the whole batch, ``jax.vmap``, float64 NumPy)."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from microbatching import AccumulationType, micro_grad, micro_vmap

from .strategies import assert_close, random_array

X = random_array(0, (16, 3), jnp.float32)
W = random_array(1, (3,), jnp.float32)


def loss(w, x):
    return jnp.sum(jnp.sin(x @ w))


def clipped_sum(w, x, bound):
    """The sum of per-example gradients clipped to norm ``bound``, in float64 NumPy."""
    grads = np.asarray(jax.vmap(jax.grad(loss), (None, 0))(w, x), np.float64)
    norms = np.linalg.norm(grads.reshape(len(grads), -1), axis=1)
    factors = np.minimum(1.0, bound / norms)
    return np.sum(grads * factors[:, None], axis=0)


EXPLICIT_UNPLACED = {
    "fast path": {},
    "clipped": {"l2_clip_norm": 1.0},
    "transformed": {"transform_fn": lambda g: 2 * g},
    "remainder": {"allow_remainder": True, "microbatch_size": 12},
}


@pytest.mark.parametrize("options", EXPLICIT_UNPLACED.values(), ids=EXPLICIT_UNPLACED.keys())
def test_micro_grad_on_an_explicit_mesh_takes_a_batch_not_on_the_mesh(options):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    options = {"microbatch_size": 4, **options}
    fun = micro_grad(loss, batch_mesh_axes="data", **options)
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about shards the batch does not have
        got, aux = fun(W, X)
    if "l2_clip_norm" in options:
        want = clipped_sum(W, X, options["l2_clip_norm"])
    else:
        want = jnp.sum(jax.vmap(jax.grad(loss), (None, 0))(W, X), axis=0)
        want = 2 * want if "transform_fn" in options else want
    assert_close(got, want, terms=4)
    assert_close(aux.values, jax.vmap(loss, (None, 0))(W, X))


def test_micro_vmap_on_an_explicit_mesh_takes_a_batch_not_on_the_mesh_with_a_remainder():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    fun = micro_vmap(
        lambda v: jnp.sin(v @ W),
        microbatch_size=12,
        accumulator=AccumulationType.SUM,
        batch_mesh_axes="data",
        allow_remainder=True,
    )
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fun(X)
    assert_close(got, np.sum(np.sin(np.asarray(X, np.float64) @ np.asarray(W, np.float64))))


CLIP_NORMS = {
    "jnp.float32": jnp.float32(0.5),
    "jnp.bfloat16": jnp.bfloat16(0.5),
    "np.float32": np.float32(0.5),
    "np.float64": np.float64(0.5),
    "0-d np array": np.array(0.5),
    "0-d jnp array": jnp.array(0.5),
    "jnp.int32": jnp.int32(1),
}


@pytest.mark.parametrize("clip", CLIP_NORMS.values(), ids=CLIP_NORMS.keys())
def test_clip_norm_takes_numpy_and_jax_scalars(clip):
    got, _ = micro_grad(loss, microbatch_size=4, l2_clip_norm=clip)(W, X)
    assert got.dtype == jnp.float32
    assert_close(got, clipped_sum(W, X, float(clip)), terms=4)


@pytest.mark.parametrize("transform_fn", [None, lambda g: g], ids=["fast path", "transformed"])
def test_clip_norm_traced_inside_jit(transform_fn):
    options = {} if transform_fn is None else {"transform_fn": transform_fn}

    @jax.jit
    def step(w, x, clip):
        return micro_grad(loss, microbatch_size=4, l2_clip_norm=clip, **options)(w, x)[0]

    for clip in (0.5, 2.0):
        got = step(W, X, jnp.float32(clip))
        assert got.dtype == jnp.float32
        assert_close(got, clipped_sum(W, X, clip), terms=4)


@pytest.mark.parametrize(
    "clip",
    [True, np.bool_(True), jnp.array(True), jnp.ones(1), np.complex64(1.0), "1"],
    ids=["bool", "np.bool_", "jnp bool", "array with an axis", "complex", "str"],
)
def test_clip_norm_refuses_bools_arrays_with_axes_and_non_reals(clip):
    with pytest.raises(
        TypeError,
        match=r"l2_clip_norm must be a positive number or None, got l2_clip_norm=.* of type "
        r"\w+; pass a real scalar such as 1.0 or jnp.float32\(1.0\), not a bool or an array "
        r"with axes.",
    ):
        micro_grad(loss, l2_clip_norm=clip)


@pytest.mark.parametrize(
    "clip",
    [jnp.float32(0.0), np.float32(-1.0), jnp.float32(jnp.inf), np.array(np.nan)],
    ids=["zero", "negative", "inf", "nan"],
)
def test_concrete_array_clip_norms_must_be_positive_and_finite(clip):
    with pytest.raises(
        ValueError,
        match=r"l2_clip_norm must be positive and finite, got l2_clip_norm=.*; pass e.g. 1.0, "
        r"or None for no clipping.",
    ):
        micro_grad(loss, l2_clip_norm=clip)


BAR = re.compile(r"micro_(vmap\(<lambda>\)|grad\(loss\)) \[[#.]{30}\] (\d)/4 microbatches \(\d+%\)")


@pytest.mark.parametrize("transform", ["micro_vmap", "micro_grad"])
def test_progress_inside_shard_map_is_one_bar_per_process(capfd, transform):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    if transform == "micro_vmap":
        fun = micro_vmap(
            lambda v: jnp.sin(v @ W),
            microbatch_size=2,
            accumulator=AccumulationType.SUM,
            progress=True,
        )
        per_shard = lambda x: jax.lax.psum(fun(x), "data")  # noqa: E731
    else:
        fun = micro_grad(loss, microbatch_size=2, progress=True)
        per_shard = lambda x: jax.lax.psum(fun(W, x)[0], "data")  # noqa: E731
    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P()))
    x = jnp.concatenate([X] * 4)  # 8 rows per shard: 4 microbatches of 2
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        for _ in range(2):  # a later call starts a fresh bar
            jax.block_until_ready(sharded(x))
    jax.effects_barrier()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("micro_")]
    matches = [BAR.fullmatch(line) for line in lines]
    assert all(matches), lines  # no line is a mix of two
    assert [m.group(2) for m in matches if m] == ["1", "2", "3", "4"] * 2
