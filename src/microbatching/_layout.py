"""How microbatch ``i`` is read from a batch, without copying the batch.

Microbatch ``i`` of a batch of ``B = m * n`` rows (``m = microbatch_size``,
``n = B // m``) holds rows ``i, i + n, i + 2n, ...``. The row-major view of the batch
axis as ``(m, n)`` is free (a bitcast), and microbatch ``i`` is its column ``i``:
reading it gathers ``m`` rows, and nothing else of the batch is copied.
"""

from typing import Any

import jax
import jax.numpy as jnp

from . import _sharding
from ._arguments import ensure_microbatch_size
from ._typing import PyTree


def split(leaf: Any, axis: int, microbatch_size: int, label: str = "") -> jax.Array:
    """Views ``leaf``'s batch axis as ``(microbatch_size, num_microbatches)``.

    Under an Explicit mesh the batch axis's sharding moves to the ``microbatch_size``
    axis, which needs ``microbatch_size`` to be a multiple of the number of shards.
    """
    shape = leaf.shape
    new_shape = (*shape[:axis], microbatch_size, shape[axis] // microbatch_size, *shape[axis + 1 :])
    sharding = _sharding.explicit_sharding(leaf)
    if sharding is None:
        return jnp.reshape(leaf, new_shape)
    spec = _sharding.spec_of(sharding, len(shape))
    shards = _sharding.num_shards(sharding, spec[axis])
    if microbatch_size % shards:
        raise ValueError(
            f"{microbatch_size=} is not a multiple of the {shards} shards of the batch axis of "
            f"`{label}` (sharded over mesh axis {spec[axis]!r}), so each microbatch would need "
            f"rows from other devices; use a microbatch_size divisible by {shards}."
        )
    out = _sharding.with_spec(sharding, [*spec[:axis], spec[axis], None, *spec[axis + 1 :]])
    return jnp.reshape(leaf, new_shape, out_sharding=out)


def take(view: jax.Array, axis: int, index: Any) -> jax.Array:
    """Microbatch ``index`` of a view made by ``split``, batch axis back at ``axis``."""
    return jax.lax.dynamic_index_in_dim(view, index, axis + 1, keepdims=False)


def microbatch_struct(leaf: Any, axis: int, microbatch_size: int) -> jax.ShapeDtypeStruct:
    """The shape, dtype and (explicit) sharding of one microbatch of ``leaf``."""
    shape = (*leaf.shape[:axis], microbatch_size, *leaf.shape[axis + 1 :])
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=_sharding.explicit_sharding(leaf))


def reshape_batch_axis(tree: PyTree, microbatch_size: int, axis: int = 0) -> PyTree:
    """Splits the batch axis of every leaf into ``(num_microbatches, microbatch_size)``.

    Entry ``[i, j]`` of the new axes is row ``i + j * num_microbatches`` of the batch
    (column-major order), so ``result[..., i, :, ...]`` along the new leading axis is
    exactly the rows that microbatch ``i`` sees. The transforms of this package never
    need this reshape (they read microbatches in place); it is here for code that wants
    the microbatches as an explicit axis.

    Args:
      tree: A pytree of arrays, each with a batch axis at ``axis``.
      microbatch_size: The number of rows per microbatch; it must divide the batch.
      axis: The batch axis of every leaf.

    Returns:
      The same pytree, each leaf of shape ``(..., num_microbatches, microbatch_size, ...)``.

    Raises:
      ValueError: If ``microbatch_size`` does not divide a leaf's batch axis.

    >>> import jax.numpy as jnp
    >>> reshape_batch_axis(jnp.arange(6), microbatch_size=2)
    Array([[0, 3],
           [1, 4],
           [2, 5]], dtype=int32)
    """
    size = ensure_microbatch_size(microbatch_size)
    if size is None:
        raise TypeError("reshape_batch_axis needs an int microbatch_size, got None.")

    def reshape(leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if not -leaf.ndim <= axis < leaf.ndim:
            raise ValueError(
                f"{axis=} is out of range for a leaf of shape {leaf.shape}; every leaf needs the "
                "batch axis, so use an axis in [-ndim, ndim) of each leaf."
            )
        ax = axis % leaf.ndim
        if leaf.shape[ax] % size:
            raise ValueError(
                f"The batch axis {axis} of a leaf of shape {leaf.shape} is not divisible by "
                f"{microbatch_size=}; choose a microbatch_size that divides {leaf.shape[ax]}."
            )
        return jnp.moveaxis(split(leaf, ax, size, "tree"), ax + 1, ax)

    return jax.tree.map(reshape, tree)
