"""How microbatch ``i`` is read from a batch, and how reductions of its rows are kept open.

Microbatch ``i`` of a batch of ``B = m * n`` rows (``m = microbatch_size``,
``n = B // m``) holds rows ``i, i + n, i + 2n, ...``. The row-major view of the batch
axis as ``(m, n)`` is free (a bitcast), and microbatch ``i`` is its column ``i``:
reading it gathers ``m`` rows, and nothing else of the batch is copied.

A reduction over the rows of a microbatch (``micro_vmap`` with ``SUM``, ``MEAN``...) may be
left *open*: kept in a wider accumulation dtype, and, when the rows are sharded, as one
partial result per shard, so that the loop adds up partials on each device and the
devices combine them once, after the loop (``close``).
"""

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from . import _sharding, _tuning
from ._checks import ensure_microbatch_size, is_int
from ._typing import PyTree
from ._xla_cpu import workarounds as _workarounds

REDUCE = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}
EXTREMA = ("max", "min")


def identity(how: str, dtype: Any) -> np.ndarray:
    """The identity of ``max`` or ``min`` for ``dtype``: what no rows reduce to.

    A 0-d array of ``dtype``: as a Python int, the greatest ``uint32`` would overflow
    JAX's default ``int32`` when passed on (``initial=``, ``full_like``).
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return np.array(how == "min", dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return np.array(info.min if how == "max" else info.max, dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"AccumulationType.{how.upper()} needs ordered results, but fun returned a leaf of "
            f"dtype {dtype}; take the real part or the modulus inside fun."
        )
    return np.array(-np.inf if how == "max" else np.inf, dtype)


def reduce(x: jax.Array, how: str, axis: int, dtype: Any = None) -> jax.Array:
    """``REDUCE[how]`` along ``axis``, in ``dtype`` for sums and means; max and min of no
    rows give their identity."""
    if how in EXTREMA:
        return REDUCE[how](x, axis=axis, initial=identity(how, x.dtype))
    return REDUCE[how](x, axis=axis, dtype=dtype)


def reduced_dtype(x: Any, how: str) -> Any:
    """The dtype of ``reduce(x, how, 0)``, traced on shapes: also for no rows, where
    ``jnp.max`` itself raises."""
    return jax.eval_shape(lambda v: reduce(v, how, 0), x).dtype


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["value"], meta_fields=["dtype", "merge"]
)
@dataclasses.dataclass(frozen=True)
class Open:
    """A reduction left open until the end of the loop.

    Attributes:
      value: The running result in the accumulation dtype; with one partial per shard
        along axis 0 when ``merge`` is set.
      dtype: The dtype of the closed result.
      merge: How the per-shard partials combine (``"sum"``, ``"mean"``), or None.
    """

    value: Any
    dtype: Any
    merge: str | None = None


def is_open(x: Any) -> bool:
    return isinstance(x, Open)


def value(x: Any) -> Any:
    """The array inside an open reduction, or ``x`` itself."""
    return x.value if isinstance(x, Open) else x


def close(tree: PyTree) -> PyTree:
    """Combines the per-shard partials of every open reduction and casts it to its dtype."""

    def close_one(x: Any) -> Any:
        if not isinstance(x, Open):
            return x
        out = x.value if x.merge is None else reduce(x.value, x.merge, 0)
        return out.astype(x.dtype)

    return jax.tree.map(close_one, tree, is_leaf=is_open)


@dataclasses.dataclass(frozen=True)
class Shards:
    """How the rows of a microbatch are spread over devices.

    Attributes:
      count: The number of shards of the batch axis.
      entry: The mesh axis name, or tuple of names, that the batch axis is sharded over.
      explicit: Whether the sharding is in the arrays' types (an Explicit mesh); if not,
        it is asked of XLA with sharding constraints (``batch_mesh_axes`` on an Auto mesh).
    """

    count: int
    entry: Any
    explicit: bool


def shards(leaf: Any, axis: int, mesh_axes: tuple[str, ...] | None) -> Shards | None:
    """How ``leaf``'s batch axis is sharded: from its type, else from ``mesh_axes``.

    ``mesh_axes`` counts on Auto mesh axes only: on Explicit ones an array's type says
    how it is sharded, and a batch whose type names no mesh (placed outside it) is not.
    """
    sharding = _sharding.explicit_sharding(leaf)
    if sharding is not None:
        entry = _sharding.entries(sharding.spec, leaf.ndim)[axis]
        count = _sharding.num_shards(sharding, entry)
        return Shards(count, entry, True) if count > 1 else None
    if not mesh_axes:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            f"batch_mesh_axes={mesh_axes!r} names mesh axes, but no mesh is set; call the "
            "function inside `with jax.set_mesh(mesh):`."
        )
    missing = [name for name in mesh_axes if name not in mesh.shape]
    if missing:
        raise ValueError(
            f"batch_mesh_axes={mesh_axes!r} names {missing}, which the mesh (axes "
            f"{tuple(mesh.shape)}) does not have; name axes of the mesh."
        )
    if any(name in mesh.explicit_axes for name in mesh_axes):
        return None  # the types say how a batch is sharded: this one is not on the mesh
    count = math.prod(mesh.shape[name] for name in mesh_axes)
    entry = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
    return Shards(count, entry, False) if count > 1 else None


def chunk(x: jax.Array, axis: int, where: Shards) -> jax.Array:
    """Splits ``x``'s batch axis into ``(shards, rows per shard)``, one shard per device."""
    if x.shape[axis] % where.count:
        raise ValueError(
            f"The microbatch has {x.shape[axis]} rows, which the {where.count} shards of mesh "
            f"axis {where.entry!r} do not divide; use a microbatch_size divisible by "
            f"{where.count}."
        )
    shape = (*x.shape[:axis], where.count, x.shape[axis] // where.count, *x.shape[axis + 1 :])
    spec = [*[None] * axis, where.entry]
    sharding = _sharding.explicit_sharding(x) if where.explicit else None
    if sharding is not None:
        full = _sharding.entries(sharding.spec, x.ndim)
        return jnp.reshape(
            x,
            shape,
            out_sharding=_sharding.with_spec(
                sharding, [*full[:axis], where.entry, None, *full[axis + 1 :]]
            ),
        )
    if where.explicit:  # a leaf outside the mesh's types: nothing to state
        return jnp.reshape(x, shape)
    return constrain(jnp.reshape(x, shape), where, spec)


def unchunk(x: jax.Array, where: Shards) -> jax.Array:
    """The inverse of ``chunk`` for a result with the shards on axis 0."""
    shape = (x.shape[0] * x.shape[1], *x.shape[2:])
    sharding = _sharding.explicit_sharding(x) if where.explicit else None
    if sharding is not None:
        full = _sharding.entries(sharding.spec, x.ndim)
        return jnp.reshape(
            x, shape, out_sharding=_sharding.with_spec(sharding, [full[0], *full[2:]])
        )
    if where.explicit:
        return jnp.reshape(x, shape)
    return constrain(jnp.reshape(x, shape), where, [where.entry])


def replicated(tree: Any) -> Any:
    """``tree`` asked to be whole on every device, on an Auto mesh; as it is elsewhere (an
    Explicit sharding is the array's type, and stays the caller's choice)."""
    if jax.sharding.get_abstract_mesh().empty:
        return tree

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array) or _sharding.explicit_sharding(x) is not None:
            return x
        return jax.lax.with_sharding_constraint(x, PartitionSpec())

    return jax.tree.map(one, tree)


def constrain(x: jax.Array, where: Shards, spec: list[Any] | None = None) -> jax.Array:
    """Asks XLA to shard ``x`` by ``spec`` (default: axis 0 over the shards), on Auto meshes."""
    if where.explicit:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(spec or [where.entry])))


def rows_apart(x: jax.Array) -> jax.Array:
    """``x``, per-example results, behind an optimization barrier before they are reduced,
    where ``_workarounds.PER_EXAMPLE_SUM`` applies (XLA:CPU); elsewhere ``x`` itself.

    XLA:CPU (jax 0.10.2) miscompiles the sum over rows of a batched outer product, e.g.
    ``jnp.sum(jnp.einsum("bh,bd->bhd", u, x), 0)``, which is what summing per-example
    gradients of a dense layer is: for fewer than 256 rows the result is off by about its
    own size (``benchmarks/xla_per_example_sum_repro.py``). The barrier keeps the reduction
    from being fused into the product, where the rewrite goes wrong, at the cost of
    writing the rows out before they are summed.
    """
    if x.ndim <= 1 or not _workarounds.PER_EXAMPLE_SUM.applies():
        return x
    return jax.lax.optimization_barrier(x)


def weighted_rows(weights: jax.Array, x: jax.Array) -> jax.Array:
    """``sum_b weights[b] * x[b]`` over axis 0 of ``x``: one contraction, at HIGHEST
    precision (a default-precision float32 dot may round its operands to TF32 or bf16
    on GPUs and TPUs), in the dtype the two share.

    A contraction, not ``jnp.sum(weights * x, 0)``: XLA:CPU (jax 0.10.2) hands such a
    fused multiply and reduction over the leading axis to YNNPACK, which takes about 3 ns
    per entry, ten times a matrix-vector product's (per-example statistics of the tied
    transformer LM of ``benchmarks/clipping.py``: 1.87x a plain step, 1.20x as a
    contraction). ``x`` is read once, the rows are never scaled in memory."""
    return jnp.tensordot(weights, x, axes=1, precision=jax.lax.Precision.HIGHEST)


def reduce_rows(
    x: jax.Array, how: str, wide: Any, dtype: Any, mesh_axes: tuple[str, ...] | None = None
) -> Any:
    """Reduces axis 0 (the rows) of ``x`` with ``how`` (a key of ``REDUCE``) in dtype ``wide``.

    The result has ``dtype``. When the rows are sharded (explicitly, or over
    ``mesh_axes``) the result stays open, one partial per shard; when ``wide`` differs
    from ``dtype`` it stays open in ``wide``.
    """
    x = rows_apart(x)
    where = shards(x, 0, mesh_axes) if x.ndim else None
    if where is None:
        if how in ("sum", "mean") and x.ndim > 1 and jnp.issubdtype(wide, jnp.inexact):
            # a contraction with ones (exact), not a reduction: ``weighted_rows``' reason
            rows = x.shape[0]
            out = weighted_rows(jnp.ones((rows,), wide), x.astype(wide))
            out = out / jnp.asarray(rows, wide) if how == "mean" else out
        else:
            out = reduce(x, how, 0, wide)
        return out if jnp.dtype(wide) == jnp.dtype(dtype) else Open(out, dtype)
    parts = reduce(chunk(x, 0, where), how, 1, wide)
    return Open(constrain(parts, where), dtype, how)


def split(leaf: Any, axis: int, microbatch_size: int, label: str = "") -> jax.Array:
    """Views ``leaf``'s batch axis as ``(microbatch_size, num_microbatches)``.

    Under an Explicit mesh the batch axis's sharding moves to the ``microbatch_size``
    axis, which needs ``microbatch_size`` to be a multiple of the number of shards.
    """
    shape = leaf.shape
    new_shape = (*shape[:axis], microbatch_size, shape[axis] // microbatch_size, *shape[axis + 1 :])
    sharding = check_shards(leaf, axis, microbatch_size, label)
    if sharding is None:
        return jnp.reshape(leaf, new_shape)
    spec = _sharding.entries(sharding.spec, len(shape))
    out = _sharding.with_spec(sharding, [*spec[:axis], spec[axis], None, *spec[axis + 1 :]])
    return jnp.reshape(leaf, new_shape, out_sharding=out)


def check_shards(leaf: Any, axis: int, microbatch_size: int, label: str) -> Any:
    """``leaf``'s explicit sharding, if any, checked: its batch axis's shards must divide
    ``microbatch_size``, so that each device holds whole rows of every microbatch."""
    sharding = _sharding.explicit_sharding(leaf)
    if sharding is None:
        return None
    spec = _sharding.entries(sharding.spec, leaf.ndim)
    shards = _sharding.num_shards(sharding, spec[axis])
    if microbatch_size % shards:
        raise ValueError(
            f"{microbatch_size=} is not a multiple of the {shards} shards of the batch axis of "
            f"`{label}` (sharded over mesh axis {spec[axis]!r}), so each microbatch would need "
            f"rows from other devices; use a microbatch_size divisible by {shards}."
        )
    return sharding


def reads_view(leaf: Any, axis: int, mesh_axes: tuple[str, ...] | None) -> bool:
    """Whether microbatches of ``leaf`` are read from its ``split`` view, or gathered by
    row (``take_rows`` of rows ``i, i + n, ...``: the same rows).

    Indexing the view of a batch of rank 3 or more (images ``(B, H, W, C)``, sequences
    ``(B, T, D)``) makes XLA:CPU copy the whole batch into another layout before the
    loop: a CNN's gradient at microbatch 256 took 25.3, 34.5 and 71.3 MiB of temp at
    batch 1k, 4k and 16k, against a flat 22.4 with the row gather, as a contiguous
    ``dynamic_slice`` loop takes. Rows of rank 1 or 2 read from the view in place. A
    sharded batch axis keeps the view, whose microbatches stay on their devices.
    """
    if reads_bits(leaf):
        return False
    if jnp.ndim(leaf) <= 2:
        return True
    return shards(leaf, axis, mesh_axes) is not None


def reads_bits(leaf: Any) -> bool:
    """Whether rows of ``leaf`` are gathered as their bits (``_rows_by_bits``): a
    bfloat16 batch on the CPU, unless it is laid out over an Explicit mesh.

    XLA:CPU runs no bfloat16 operation, slices and gathers included: it converts their
    operand to float32 first, and a read from the batch inside the loop becomes a float32
    copy of the whole batch before it (a sequence model at microbatch 64: 0.9 MiB of temp
    at 1k rows, 12.1 at 16k), as it does for a hand-written ``dynamic_slice`` loop. Its
    bits (uint16) are read without conversion. Making them costs one copy of the batch at
    its own size (6.0 MiB at 16k rows), half the float32 one: XLA copies for a
    ``bitcast_convert`` too, and no way to read it in place was found. The gate is
    ``_workarounds.BF16_BITS``.
    """
    if getattr(leaf, "dtype", None) != jnp.bfloat16 or not _workarounds.BF16_BITS.applies():
        return False
    return _sharding.explicit_sharding(leaf) is None


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _rows_by_bits(leaf: jax.Array, indices: jax.Array, axis: int) -> jax.Array:
    """``jnp.take(leaf, indices, axis)`` of a bfloat16 ``leaf``, gathered as uint16.

    The bitcasts have no derivative; the rule gives the gather's: a gradient with
    respect to the batch flows to the rows read.
    """
    bits = jax.lax.bitcast_convert_type(leaf, jnp.uint16)
    rows = jnp.take(bits, indices, axis=axis, mode="clip", indices_are_sorted=True)
    return jax.lax.bitcast_convert_type(rows, leaf.dtype)


@_rows_by_bits.defjvp
def _rows_by_bits_jvp(axis: int, primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    leaf, indices = primals
    rows = jnp.take(tangents[0], indices, axis=axis, mode="clip", indices_are_sorted=True)
    return _rows_by_bits(leaf, indices, axis), rows


def take(view: jax.Array, axis: int, index: Any) -> jax.Array:
    """Microbatch ``index`` of a view made by ``split``, batch axis back at ``axis``."""
    return jax.lax.dynamic_index_in_dim(view, index, axis + 1, keepdims=False)


def rows(index: Any, full: int, remainder: int, size: int) -> tuple[jax.Array, jax.Array]:
    """The rows of microbatch ``index`` of a batch of ``full * size + remainder`` rows.

    Microbatch ``i < full`` holds rows ``i, i + full, i + 2 * full, ...`` of the first
    ``full * size`` rows; microbatch ``full`` holds the last ``remainder`` rows, then
    copies of the last row up to ``size``. Returns the row indices and which are real.
    """
    j = jnp.arange(size)
    last = full * size + jnp.minimum(j, remainder - 1)
    head = index < full
    return jnp.where(head, index + full * j, last), head | (j < remainder)


def take_rows(leaf: Any, axis: int, indices: jax.Array) -> jax.Array:
    """The rows ``indices`` of ``leaf``'s batch axis, gathered in place.

    Under an Explicit mesh the rows come out sharded as the batch axis is; they are on
    other devices than the batch's rows, so the gather moves them there.
    """
    if reads_bits(leaf):
        return _rows_by_bits(leaf, indices, axis)
    sharding = _sharding.explicit_sharding(leaf)
    if sharding is None:
        return jnp.take(leaf, indices, axis=axis, mode="clip", indices_are_sorted=True)
    spec = _sharding.entries(sharding.spec, leaf.ndim)
    entry = (
        spec[axis] if indices.shape[0] % _sharding.num_shards(sharding, spec[axis]) == 0 else None
    )
    out = _sharding.with_spec(sharding, [*spec[:axis], entry, *spec[axis + 1 :]])
    where = (slice(None),) * axis + (indices,)
    return leaf.at[where].get(mode="clip", indices_are_sorted=True, out_sharding=out)


def kept_row(
    leaf: jax.Array, axis: int, weights: jax.Array, mesh_axes: tuple[str, ...] | None
) -> jax.Array:
    """A row of ``leaf`` whose weight is not 0 (row 0 if none), batch axis kept, length 1.

    On a sharded batch each shard finds its own first such row, and one shard's row is
    chosen with a reduction over the shards: one row crosses devices, nothing is gathered.
    """
    kept = weights != 0
    where = shards(leaf, axis, mesh_axes)
    if where is None or leaf.shape[axis] % where.count:  # not sharded, or not evenly
        count = kept.shape[0]
        first = jnp.min(jnp.where(kept, jnp.arange(count), count))
        row = jax.lax.dynamic_index_in_dim(leaf, jnp.where(first == count, 0, first), axis)
        return _from_a_device_that_has_one(row, first < count)
    parts, kept = chunk(leaf, axis, where), chunk(kept, 0, where)
    shape = [1] * parts.ndim
    shape[axis] = where.count
    first = jnp.reshape(jnp.argmax(kept, axis=1), shape)  # within each shard: no gather
    rows = jnp.take_along_axis(parts, first, axis=axis + 1)
    shard = jnp.min(jnp.where(jnp.any(kept, axis=1), jnp.arange(where.count), where.count))
    pick = jnp.reshape(jnp.arange(where.count) == jnp.where(shard == where.count, 0, shard), shape)
    chosen = jnp.where(pick, rows, jnp.zeros((), rows.dtype))
    if rows.dtype == jnp.bool_:
        return jnp.any(chosen, axis=axis)
    return jnp.sum(chosen, axis=axis, dtype=rows.dtype)


def _from_a_device_that_has_one(row: jax.Array, has: jax.Array) -> jax.Array:
    """``row``, or inside ``shard_map``, on a device whose rows all have weight 0, the row
    of the first device that has one (one row crosses devices): its own row 0 would
    reach ``fun`` and, through an outer derivative, the result (a NaN of padding)."""
    varying = _sharding.varying(jax.typeof(has))
    if not varying:
        return row
    index = jax.lax.axis_index(varying)
    owner = jax.lax.pmin(jnp.where(has, index, jnp.iinfo(index.dtype).max), varying)
    mine = index == owner
    if row.dtype == jnp.bool_:
        shared = jax.lax.psum((mine & row).astype(jnp.int32), varying) > 0
    else:
        shared = jax.lax.psum(jnp.where(mine, row, jnp.zeros((), row.dtype)), varying)
    return jnp.where(has, row, shared)


def microbatch_struct(leaf: Any, axis: int, microbatch_size: int) -> Any:
    """The abstract value of one microbatch of ``leaf``.

    It keeps everything of the batch's type but the batch axis's length: its dtype, its
    sharding, and inside ``shard_map`` the mesh axes it varies over.
    """
    shape = (*leaf.shape[:axis], microbatch_size, *leaf.shape[axis + 1 :])
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=leaf.sharding)
    return jax.typeof(leaf).update(shape=shape)


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
    if not is_int(axis):
        raise TypeError(
            f"axis must be an int, got {axis=} of type {type(axis).__name__}; pass the "
            "position of the batch axis, e.g. axis=0."
        )
    axis = operator.index(axis)

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


def map_chunks(f: Callable[[Any], Any], xs: Any, most: int) -> Any:
    """``f`` of every chunk of rows of ``xs`` (``_tuning.chunk_rows`` of at most ``most``),
    the results' rows concatenated: ``jax.lax.map(..., batch_size=...)`` where ``f`` sees
    each chunk whole (a choice it makes for the chunk stays a branch), and where a divisor
    near ``most`` is taken so that no last chunk of another size compiles ``f`` again."""
    rows = jax.tree.leaves(xs)[0].shape[0]
    size = _tuning.chunk_rows(rows, most)
    if rows <= size:
        return f(xs)
    whole = rows // size * size
    stacked = jax.tree.map(lambda x: x[:whole].reshape(rows // size, size, *x.shape[1:]), xs)
    mapped = jax.tree.map(lambda x: x.reshape(whole, *x.shape[2:]), jax.lax.map(f, stacked))
    if rows == whole:
        return mapped
    rest = f(jax.tree.map(lambda x: x[whole:], xs))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), mapped, rest)
