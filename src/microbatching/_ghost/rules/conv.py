"""The ``conv`` rule: a leaf that is the kernel of one convolution."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..program import Eqn, Program, Site
from .base import Cost, GhostRule
from .products import _product_cost, _product_norm


def _conv_dims(program: Program, e: Eqn) -> tuple[int, int, int]:
    """``(T, K, N)`` of a convolution's kernel gradient as a product of patches: ``T``
    output positions, ``K`` entries of a patch, ``N`` output features."""
    kernel = program.avals[e.ins[1]].shape  # type: ignore[index]
    out = program.avals[e.outs[0]].shape
    n = kernel[e.params["dimension_numbers"].rhs_spec[0]]
    return math.prod(out) // max(n, 1), math.prod(kernel) // max(n, 1), n


def _conv_norm(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any], gram: bool
) -> tuple[jax.Array, jax.Array]:
    """One example's norm of a convolution's kernel gradient: the product of the input
    patches (``T x K``) and the output cotangents (``T x N``)."""
    return _product_norm(*_conv_rows(program, site, inputs, cotangents), gram)


def _conv_rows(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any]
) -> tuple[jax.Array, jax.Array]:
    """One example's rows ``(1, T, K)`` and ``(1, T, N)`` of a convolution's kernel
    gradient: its input patches and output cotangents, at least float32."""
    e = program.eqns[site.eqn]
    (x,), (g,) = inputs, cotangents
    numbers = e.params["dimension_numbers"]
    kernel = program.avals[e.ins[1]].shape  # type: ignore[index]
    window = tuple(kernel[d] for d in numbers.rhs_spec[2:])
    out = program.avals[e.outs[0]].shape
    t, k, n = _conv_dims(program, e)
    wide = jnp.promote_types(jnp.promote_types(x.dtype, g.dtype), jnp.float32)
    x = jnp.transpose(x, (numbers.lhs_spec[0], *numbers.lhs_spec[2:], numbers.lhs_spec[1]))
    if any(d != 1 for d in e.params["lhs_dilation"]):
        x = jax.lax.pad(
            x,
            jnp.zeros((), x.dtype),
            [(0, 0, 0)] + [(0, 0, d - 1) for d in e.params["lhs_dilation"]] + [(0, 0, 0)],
        )
    x = jax.lax.pad(
        x,
        jnp.zeros((), x.dtype),
        [(0, 0, 0), *((lo, hi, 0) for lo, hi in e.params["padding"]), (0, 0, 0)],
    )
    sizes = [out[d] for d in numbers.out_spec[2:]]
    strides = e.params["window_strides"]
    dilation = e.params["rhs_dilation"]
    taken = []
    for offset in itertools.product(*(range(w) for w in window)):
        start = [o * r for o, r in zip(offset, dilation, strict=True)]
        limit = [s + (m - 1) * st + 1 for s, m, st in zip(start, sizes, strides, strict=True)]
        taken.append(
            jax.lax.slice(x, [0, *start, 0], [x.shape[0], *limit, x.shape[-1]], [1, *strides, 1])
        )
    patches = jnp.stack(taken, axis=-2)
    order = (numbers.out_spec[0], *numbers.out_spec[2:], numbers.out_spec[1])
    xs = patches.reshape(1, t, k).astype(wide)
    gs = jnp.transpose(g, order).reshape(1, t, n).astype(wide)
    return xs, gs


def _cost(program: Program, site: Site) -> Cost | None:
    """The product's cost where the kernel is the parameter, the input the data, and the
    convolution is not grouped."""
    e = program.eqns[site.eqn]
    ungrouped = e.params.get("feature_group_count") == e.params.get("batch_group_count") == 1
    if site.free != (1,) or site.data != (0,) or not ungrouped:
        return None
    return _product_cost(1, *_conv_dims(program, e))


def _kernel_gradient_flops(program: Program, site: Site) -> int:
    if site.free != (1,):
        return 0
    return math.prod(_conv_dims(program, program.eqns[site.eqn]))


RULE = GhostRule(
    "conv", _cost, _conv_norm, rows=_conv_rows, materialize_flops=_kernel_gradient_flops
)
"""The kernel gradient of a convolution as the product of the input's patches and the
output cotangents."""
