"""``l2_clip_norm``: the values it takes (numbers, NumPy and JAX scalars, traced values)
and those it refuses, against per-example clipping in float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbatching import micro_grad

from .strategies import SIN_W as W
from .strategies import SIN_X as X
from .strategies import assert_close
from .strategies import clipped_sin_sum as clipped_sum
from .strategies import sin_loss as loss

pytestmark = pytest.mark.x64  # scalars of every dtype

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
