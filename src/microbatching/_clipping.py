"""L2 norms of gradients and the clip factors of DP-SGD, without overflow or underflow.

``sum(g**2)`` overflows in float32 once ``|g|`` passes about 1e19 (and in float16 at
256), and underflows to 0 below about 1e-19: a huge gradient would get norm ``inf`` and
clip to 0, a tiny one norm 0. The sums of squares are first taken as they are, in one
read of the gradients. Where every one of a leaf's lies in ``[SAFE_LOW * tiny, max /
SAFE_HIGH]`` of its dtype, no square or partial sum overflowed, and the squares lost to
underflow (each below the dtype's smallest normal ``tiny``) add at most ``2**-66`` of
the sum per entry: the norms are their square roots. Otherwise (a branch inside the
compiled program, taken by all the rows of a leaf at once; always under ``vmap``, where
a branch would run both sides; and for a row whose gradient is 0, which cannot be told
from one that underflowed) each row is scaled by the power of two ``2**-e`` that brings
its largest magnitude into ``[1/2, 1)``, once per row and exactly (no division per
entry), and its norm is ``2**e`` times that of the scaled row: every term of the sum is
then below 64, and the largest at least 1/4, so the sum neither overflows nor vanishes.
The scaling is computed in at least float32. A norm beyond the dtype's largest number
(3.4e38 in float32) is ``inf``, and clips the gradient to 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from . import _sharding
from ._typing import PyTree


def row_norms(grads: PyTree, rows: int) -> jax.Array:
    """The L2 norm of each row of gradients stacked on axis 0, over all leaves: the
    plain sums of squares where all of them are safe, else every row scaled (a branch)."""
    return _norms([jax.tree.leaves(grads)], rows, branch=True)[:, 0]


def mapped_row_norms(grads: PyTree, rows: int) -> jax.Array:
    """``row_norms`` without the branch, every row scaled: for a caller under ``vmap``,
    where a ``lax.cond`` on batched values runs both of its sides."""
    return _norms([jax.tree.leaves(grads)], rows, branch=False)[:, 0]


def _norms(groups: list[list[Any]], rows: int, branch: bool) -> jax.Array:
    """``(rows, groups)``: each row's norm over each group of leaves (axis 0: the rows),
    each group taking the branch of its own sums of squares."""
    if not rows:
        return jnp.zeros((0, len(groups)))
    values = [[_wide(g) for g in group] for group in groups]
    dtype = jnp.result_type(jnp.float32, *(v for group in values for v in group))
    norms = [_norm_of(group, rows, dtype, branch) for group in values]
    return jnp.stack(aligned(norms), axis=1) if norms else jnp.zeros((rows, 0), dtype)


def aligned(columns: list[jax.Array]) -> list[jax.Array]:
    """``columns`` (one entry per row) to stack, each varying with all of them
    (``_sharding.varying_like``): under ``jax.vmap`` over the shards of a batch on an
    Explicit mesh, a column that does not depend on the rows (the norm of a parameter
    the loss never reads) is unmapped, and JAX's batching rule for ``stack`` broadcasts
    it without the mapped ones' sharding, which ``stack`` refuses."""
    if len(columns) < 2:
        return columns
    rows = functools.reduce(jnp.logical_or, [jnp.isnan(c) for c in columns])
    return [_sharding.varying_like(c, rows) for c in columns]


def _norm_of(values: list[jax.Array], rows: int, dtype: Any, branch: bool) -> jax.Array:
    if not branch or not values:
        return _scaled_norms(values, rows, dtype)
    squares = sum(
        (jnp.sum(jnp.square(v), axis=_rest(v)) for v in values), jnp.zeros((rows,), dtype)
    )
    info = jnp.finfo(dtype)
    plain = jnp.all((squares >= SAFE_LOW * info.tiny) & (squares <= info.max / SAFE_HIGH))
    return _sharding.data_cond(
        plain, lambda: sqrt(squares), lambda: _scaled_norms(values, rows, dtype)
    )


SAFE_LOW = 2.0**66
"""How many times the dtype's smallest normal number a sum of squares must be, at least,
to be taken as it is: each square lost to underflow is below that smallest number, so
that each costs at most ``2**-66`` of the sum."""

SAFE_HIGH = 4.0
"""How many times below the dtype's largest number a sum of squares must be, at least,
to be taken as it is: its terms and partial sums are no larger, so none overflowed."""


def _scaled_norms(values: list[jax.Array], rows: int, dtype: Any) -> jax.Array:
    """Each row's norm over ``values`` (at least float32), each row scaled by a power of
    two that brings its largest magnitude into ``[1/2, 1)``: one multiplication per
    entry, exact (a power of two), and the scale applied once per row."""
    if not values:
        return jnp.zeros((rows,), dtype)
    largest = jnp.max(
        jnp.stack([jnp.max(jnp.abs(v), axis=_rest(v), initial=0.0) for v in values]), axis=0
    ).astype(dtype)
    usable = (largest > 0) & jnp.isfinite(largest)
    e = exponent(jnp.where(usable, largest, 1))
    # One power, normal both ways: 2**-e is subnormal (flushed to 0 on the CPU) for e
    # above 126 in float32 (1022 in float64). Clipped, the largest scaled magnitude is
    # in [1/2, 8), or above 2**-24 where it is subnormal: its square neither overflows
    # nor vanishes. The barrier keeps XLA
    # from folding the scale out of the squares, where they would overflow again.
    bound = jnp.finfo(dtype).maxexp - 3  # 125 in float32, 1021 in float64
    k = jax.lax.optimization_barrier(jnp.clip(e, -bound, bound))
    down = power_of_two(-k, dtype)
    squares = sum(jnp.sum(jnp.square(v * _at_rows(down, v)), axis=_rest(v)) for v in values)
    norms = sqrt(squares) * power_of_two(k, dtype)
    # A NaN reaches ``squares`` whatever the order of the terms; XLA:CPU's ``max`` may
    # return a row's other entries past it in some fusions (a row of NaN read as norm 0).
    return jnp.where(usable, norms, jnp.where(jnp.isnan(squares), squares, largest))


def exponent(m: jax.Array) -> jax.Array:
    """The integer ``e`` with ``2**(e - 1) <= m < 2**e``, for ``m`` positive and finite
    (``m`` subnormal counts as ``2**-126``, float32's smallest normal)."""
    info = jnp.finfo(m.dtype)
    ints = jnp.int32 if info.bits == 32 else jnp.int64
    field = jax.lax.bitcast_convert_type(m, ints) >> info.nmant
    return jnp.maximum(field, 1) - (info.maxexp - 1) + 1


def power_of_two(k: jax.Array, dtype: Any) -> jax.Array:
    """``2**k`` in ``dtype``, built from its bits in three operations: exact for integers
    ``k`` from ``minexp`` to ``maxexp - 1`` (-126 to 127 in float32), where it is a
    normal number; ``inf`` at ``maxexp`` and 0 at ``minexp - 1``, as a product would
    overflow or flush. ``k`` must have the width of ``dtype`` (``exponent``'s) and lie in
    that range: beyond it the bits wrap. Where ``k`` can lie further out, ``times_power``."""
    info = jnp.finfo(dtype)
    k = jnp.asarray(k)
    field = jax.lax.shift_left(k + (info.maxexp - 1), jnp.asarray(info.nmant, k.dtype))
    return jax.lax.bitcast_convert_type(field, dtype)


def times_power(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k``, exactly (unless the result overflows or is subnormal): applied in three
    parts, so that no power is subnormal (flushed to 0 on the CPU) or infinite.

    Written in ``lax`` integer operations (a truncating division, a shift), about 15 per
    call: ``jnp``'s floor division takes about 60, and this runs per entry of a Gram
    matrix and many times in every clipped program."""
    info = jnp.finfo(x.dtype)
    k = jnp.asarray(k)

    def power(j: jax.Array) -> jax.Array:
        field = jax.lax.shift_left(j + (info.maxexp - 1), jnp.asarray(info.nmant, j.dtype))
        return jax.lax.bitcast_convert_type(field, x.dtype)

    # Three powers of at most 2**(maxexp - 2) each (2**126 in float32, 2**1022 in
    # float64): beyond, the result under- or overflows anyway. With |k| <= 3 m, the
    # truncated third is at most m, the rest at most 2 m, and its two halves (floor and
    # ceiling) at most m each.
    most = 3 * (info.maxexp - 2)
    k = jax.lax.clamp(jnp.asarray(-most, k.dtype), k, jnp.asarray(most, k.dtype))
    third = jax.lax.div(k, jnp.asarray(3, k.dtype))
    rest = k - third
    half = halve(rest)
    return x * power(third) * power(half) * power(rest - half)


def halve(k: jax.Array) -> jax.Array:
    """``floor(k / 2)`` of an integer array: one arithmetic shift (``k // 2`` takes about
    ten operations for signed integers)."""
    k = jnp.asarray(k)
    return jax.lax.shift_right_arithmetic(k, jnp.asarray(1, k.dtype))


def _rest(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _at_rows(values: jax.Array, x: jax.Array) -> jax.Array:
    """``values`` of shape ``(rows,)`` broadcast against ``x`` along its axis 0."""
    return jnp.reshape(values, values.shape + (1,) * (x.ndim - 1))


def norm(grads: PyTree) -> jax.Array:
    """The L2 norm of one gradient, over all its leaves (no branch: it is mapped over
    examples)."""
    return mapped_row_norms(jax.tree.map(lambda g: jnp.asarray(g)[None], grads), 1)[0]


def factor(norms: jax.Array, bound: Any) -> jax.Array:
    """``min(1, bound / norm)``: the scale that clips a gradient to norm ``bound``; 1
    at norm 0, with derivative 0 there (not ``0 * inf``: an outer derivative would be
    NaN for an example whose gradient is 0)."""
    zero = norms == 0
    return jnp.where(zero, 1.0, jnp.minimum(1.0, bound / jnp.where(zero, 1.0, norms)))


def norm_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's norm of ``x`` ``(rows, n)`` (at least float32) as ``(m, k)``, the norm
    being ``m * 2**k``: ``m`` from the row scaled by the power of two of its largest
    magnitude (in ``[1/2, sqrt(n))`` for a row of normal numbers, whatever its scale),
    ``k`` that power's exponent (int32 or int64, within the dtype's normal range). A row
    of zeros gives ``m = 0``, a row with inf or NaN ``m`` inf or NaN (NaN where it holds
    a NaN), ``k = 0`` for those."""
    x = _wide(x)
    largest = jnp.max(jnp.abs(x), axis=1, initial=0.0)
    usable = (largest > 0) & jnp.isfinite(largest)
    # As in ``_scaled_norms``: one power, normal both ways, the largest scaled magnitude
    # in [1/2, 8); the barrier keeps XLA from folding the scale out of the squares.
    bound = jnp.finfo(x.dtype).maxexp - 3
    e = jnp.clip(exponent(jnp.where(usable, largest, 1)), -bound, bound)
    k = jax.lax.optimization_barrier(jnp.where(usable, e, 0))
    scaled = x * _at_rows(power_of_two(-k, x.dtype), x)
    squares = jnp.sum(jnp.square(scaled), axis=1)
    m = jnp.where(usable, sqrt(squares), jnp.where(jnp.isnan(squares), squares, largest))
    return m, k


def sqrt(squares: Any) -> jax.Array:
    """``jnp.sqrt`` with derivative 0 at 0, where the norm of a gradient of 0 would pass
    ``0 * inf`` (NaN) back to an outer derivative."""
    squares = jnp.asarray(squares)
    zero = squares == 0
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, squares))).astype(squares.dtype)


def _wide(g: Any) -> jax.Array:
    """``g`` in at least float32; a complex ``g`` as its moduli."""
    g = jnp.asarray(g)
    if jnp.iscomplexobj(g):
        g = jnp.abs(g)
    return g.astype(jnp.promote_types(g.dtype, jnp.float32))


def leaf_norms(grads: PyTree, rows: int, branch: bool) -> jax.Array:
    """``(rows, leaves)``: the norm of each leaf of each row of stacked gradients; without
    ``branch`` every row scaled, as ``mapped_row_norms``."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return jnp.zeros((rows, 0), jnp.float32)
    return _norms([[g] for g in leaves], rows, branch)


_SUBNORMAL = (
    "l2_clip_norm holds {bound!r}, below {dtype}'s smallest normal number {tiny:.4g}, in "
    "which the norms are computed: XLA may flush it to 0, and an example whose gradient "
    "is 0 would then make the sum NaN. Pass a bound of at least {tiny:.4g}, scaling the "
    "loss by a power of two if you need a smaller one."
)


_BEYOND_RANGE = (
    "l2_clip_norm holds {bound!r}, above {dtype}'s largest number {top:.4g}, in which the "
    "norms are computed: it would round to inf and clip nothing. Pass a bound of at most "
    "{top:.4g}, or leave l2_clip_norm out to sum the gradients unclipped."
)


@dataclasses.dataclass(frozen=True)
class Clipping:
    """DP clipping as the user asked for it: the bound (one, or one per subtree of the
    gradient), and what to do with the clipped gradient.

    Attributes:
      bound: A positive number or traced scalar, or a pytree of them that is a prefix of
        the gradient: each subtree is clipped to its own bound (per-layer clipping).
      unit: Divide each clipped gradient by its bound (``rescale_to_unit_norm``).
      normalize_by: Divide the clipped gradients by this.
      nan_safe: An example whose gradient is not finite contributes zero.
    """

    bound: Any
    unit: bool = False
    normalize_by: Any = 1.0
    nan_safe: bool = False

    def groups(self, grads: PyTree) -> tuple[list[int], list[Any]]:
        """The group of each leaf of ``grads``, and each group's bound."""
        bounds, structure = jax.tree.flatten(self.bound)
        n = len(jax.tree.leaves(grads))
        if structure.num_nodes == 1:
            return [0] * n, bounds
        try:
            index = jax.tree.broadcast(jax.tree.unflatten(structure, range(len(bounds))), grads)
        except ValueError as error:
            raise ValueError(
                f"l2_clip_norm is a pytree, so it must be a prefix of the gradient's tree, "
                f"but {structure} is not a prefix of {jax.tree.structure(grads)} ({error}); "
                "pass one bound per subtree of the differentiated arguments, or one number."
            ) from None
        return list(jax.tree.leaves(index)), bounds

    def factors(self, norms: jax.Array, groups: list[int], bounds: list[Any]) -> jax.Array:
        """``(rows, groups)``: each example's scale for each group, from the norms of its
        leaves ``(rows, leaves)``."""
        rows = norms.shape[0]
        tiny, top = float(jnp.finfo(norms.dtype).tiny), float(jnp.finfo(norms.dtype).max)
        columns = []
        for group, bound in enumerate(bounds):
            if isinstance(bound, float) and bound < tiny:
                raise ValueError(_SUBNORMAL.format(bound=bound, dtype=norms.dtype, tiny=tiny))
            if isinstance(bound, float) and bound > top:
                raise ValueError(_BEYOND_RANGE.format(bound=bound, dtype=norms.dtype, top=top))
            if not isinstance(bound, float):  # traced: a bound that is not positive,
                # normal and finite makes the sum NaN, where it would silently flip or
                # drop it
                bound = jnp.where((bound >= tiny) & jnp.isfinite(bound), bound, jnp.nan)
            members = [leaf for leaf, g in enumerate(groups) if g == group]
            scale = factor(row_norms(norms[:, members], rows), bound)
            columns.append(scale / bound if self.unit else scale)
        scale = jnp.stack(aligned(columns), axis=1) if columns else jnp.ones((rows, 0))
        if self.nan_safe:
            finite = jnp.all(jnp.isfinite(norms), axis=1, keepdims=True)
            scale = jnp.where(finite, scale, jnp.zeros((), scale.dtype))
        plain = isinstance(self.normalize_by, float) and self.normalize_by == 1
        return scale if plain else scale / self.normalize_by

    def per_leaf(self, norms: jax.Array, grads: PyTree) -> list[jax.Array]:
        """``(rows,)`` scale of each leaf of ``grads``, from the norms of its leaves."""
        groups, bounds = self.groups(grads)
        scale = self.factors(norms, groups, bounds)
        return [scale[:, g] for g in groups]

    def clip(self, grads: PyTree) -> PyTree:
        """One example's gradient, clipped."""
        leaves, structure = jax.tree.flatten(grads)
        norms = _norms([[jnp.asarray(g)[None]] for g in leaves], 1, branch=False)
        norms = norms if leaves else jnp.zeros((1, 0), jnp.float32)
        scales = self.per_leaf(norms, grads)
        clipped = [g * s[0].astype(g.dtype) for g, s in zip(leaves, scales, strict=True)]
        if self.nan_safe:  # factor 0: dropped, its NaN selected away (else NaN)
            clipped = [
                jnp.where(s[0] != 0, c, jnp.zeros((), c.dtype))
                for c, s in zip(clipped, scales, strict=True)
            ]
        return jax.tree.unflatten(structure, clipped)
