"""L2 norms of gradients and the clip factors of DP-SGD, without overflow or underflow.

``sum(g**2)`` overflows in float32 once ``|g|`` passes about 1e19 (and in float16 at
256), and underflows to 0 below about 1e-19: a huge gradient would get norm ``inf`` and
clip to 0, a tiny one norm 0. Each norm here is taken of the gradient divided by its
largest magnitude, then multiplied back: ``m * sqrt(sum((g / m)**2))`` with
``m = max |g|``. Every term of the sum is then at most 1, and the largest is exactly 1,
so the sum neither overflows nor vanishes. The scaling is computed in at least float32.
A norm beyond the dtype's largest number (3.4e38 in float32) is ``inf``, and clips the
gradient to 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ._typing import PyTree


def row_norms(grads: PyTree, rows: int) -> jax.Array:
    """The L2 norm of each row of gradients stacked on axis 0, over all leaves."""
    if not rows:
        return jnp.zeros((0,))
    # The magnitudes feed the largest entry; the squares read the values again, so that
    # XLA fuses both reductions into reads of the gradient and keeps no copy of it.
    values = [_wide(g) for g in jax.tree.leaves(grads)]
    if not values:
        return jnp.zeros((rows,))
    largest = jnp.max(
        jnp.stack([jnp.max(jnp.abs(v), axis=_rest(v), initial=0.0) for v in values]), axis=0
    )
    safe = jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)
    # Divided twice by the square root: XLA may divide by multiplying with the reciprocal,
    # and 1 / m is subnormal (flushed to 0) for m above 2**126; 1 / sqrt(m) never is. The
    # barrier keeps XLA from rewriting the scaled squares back into overflowing ones,
    # which it does where the gradient is a known constant.
    root = jax.lax.optimization_barrier(jnp.sqrt(safe))
    squares = sum(
        jnp.sum(jnp.square(v / _at_rows(root, v) / _at_rows(root, v)), axis=_rest(v))
        for v in values
    )
    return jnp.where(jnp.isfinite(largest), safe * jnp.sqrt(squares), largest)


def _rest(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _at_rows(values: jax.Array, x: jax.Array) -> jax.Array:
    """``values`` of shape ``(rows,)`` broadcast against ``x`` along its axis 0."""
    return jnp.reshape(values, values.shape + (1,) * (x.ndim - 1))


def norm(grads: PyTree) -> jax.Array:
    """The L2 norm of one gradient, over all its leaves."""
    return row_norms(jax.tree.map(lambda g: jnp.asarray(g)[None], grads), 1)[0]


def factor(norms: jax.Array, bound: Any) -> jax.Array:
    """``min(1, bound / norm)``: the scale that clips a gradient to norm ``bound``."""
    return jnp.minimum(1.0, bound / norms)


def _wide(g: Any) -> jax.Array:
    """``g`` in at least float32; a complex ``g`` as its moduli."""
    g = jnp.asarray(g)
    if jnp.iscomplexobj(g):
        g = jnp.abs(g)
    return g.astype(jnp.promote_types(g.dtype, jnp.float32))


def leaf_norms(grads: PyTree, rows: int) -> jax.Array:
    """``(rows, leaves)``: the norm of each leaf of each row of stacked gradients."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return jnp.zeros((rows, 0), jnp.float32)
    return jnp.stack([row_norms(g, rows) for g in leaves], axis=1)


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
        columns = []
        for group, bound in enumerate(bounds):
            if not isinstance(bound, float):  # traced: a bound that is not positive and
                # finite makes the sum NaN, where it would silently flip or drop it
                bound = jnp.where((bound > 0) & jnp.isfinite(bound), bound, jnp.nan)
            members = [leaf for leaf, g in enumerate(groups) if g == group]
            scale = factor(row_norms(norms[:, members], rows), bound)
            columns.append(scale / bound if self.unit else scale)
        scale = jnp.stack(columns, axis=1) if columns else jnp.ones((rows, 0))
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
        norms = leaf_norms([jnp.asarray(g)[None] for g in leaves], 1)
        scales = self.per_leaf(norms, grads)
        clipped = [
            jnp.where(s[0] != 0, g * s[0].astype(g.dtype), jnp.zeros((), g.dtype))
            for g, s in zip(leaves, scales, strict=True)
        ]
        return jax.tree.unflatten(structure, clipped)
