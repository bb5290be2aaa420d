"""Parameters sharded over the batch's mesh axes (FSDP, ZeRO-3): where they are gathered,
and where their gradients are reduced.

When ``micro_grad``'s differentiated arguments are split over the same mesh axes as the
batch, every device needs them whole to take its rows' gradients, and each device's
gradient sum covers only its rows. The parameters are gathered once, before the loop
(one all-gather per leaf per step). ``reduce_gradients`` trades memory per device
against collectives per microbatch (``P`` is the parameters' size, ``N`` the number of
shards): ``"per_microbatch"`` reduce-scatters each microbatch's gradient into a sum
sharded like the parameters (a carry of ``P / N`` per device, one reduce-scatter per
leaf per microbatch); ``"after_loop"`` keeps a full-size partial sum on each device and
reduce-scatters it once (a carry of ``P``, one reduce-scatter per leaf per step).

The loop then runs inside ``jax.shard_map`` over the batch's mesh axes: each device
loops over its own rows of every microbatch, and the collectives above are the only
ones, written out (``all_gather``, ``psum_scatter``) rather than left to XLA's choice.
The layout is read from the arrays: their types on an Explicit mesh, their shardings
when they are concrete. Inside ``jit`` on an Auto mesh the shardings are not visible,
and the loop runs as for replicated parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from . import _layout, _sharding
from ._accumulators import AccumulationType
from ._typing import PyTree

REDUCE = ("per_microbatch", "after_loop")


@dataclasses.dataclass(frozen=True)
class Trade:
    """The user's choice of collectives against memory (``micro_grad``'s option).

    Attributes:
      reduce: ``reduce_gradients``, one of ``REDUCE``, or None: per microbatch.
    """

    reduce: str | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one call's arrays sit on the mesh, when its parameters are sharded.

    Attributes:
      axes: The batch's mesh axes: manual inside the ``shard_map``.
      count: Into how many shards they cut the batch.
      entry: The batch axis's partition entry (an axis name or a tuple of them).
      homes: Per differentiated leaf (in ``jax.tree.leaves`` order of the differentiated
        arguments), its partition spec over ``axes`` only, one entry per dimension.
      trade: The choices, resolved.
    """

    axes: tuple[str, ...]
    count: int
    entry: Any
    homes: tuple[tuple[Any, ...], ...]
    trade: Trade

    @property
    def reduce_per_microbatch(self) -> bool:
        return self.trade.reduce == "per_microbatch"

    def gather(self, args: tuple[Any, ...], nums: tuple[int, ...]) -> tuple[Any, ...]:
        """``args`` with the differentiated ones made whole over ``axes`` (inside the
        shard_map)."""
        leaves, structure = jax.tree.flatten([args[i] for i in nums])
        whole = [_all_gather(x, home) for x, home in zip(leaves, self.homes, strict=True)]
        gathered = dict(zip(nums, jax.tree.unflatten(structure, whole), strict=True))
        return tuple(gathered.get(i, a) for i, a in enumerate(args))

    def reduce(self, grads: PyTree) -> PyTree:
        """Each device's gradient sums, added over ``axes`` and cut like the parameters."""
        leaves, structure = jax.tree.flatten(grads, is_leaf=_layout.is_open)
        reduced = [_reduce(x, home, self.axes) for x, home in zip(leaves, self.homes, strict=True)]
        return jax.tree.unflatten(structure, reduced)

    def grad_specs(self, args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> Any:
        """The partition specs of the gradients, shaped as ``jax.grad(argnums=argnums)``'s."""
        nums = argnums if isinstance(argnums, tuple) else (argnums,)
        homes = iter(self.homes)
        trees = tuple(jax.tree.map(lambda _: PartitionSpec(*next(homes)), args[i]) for i in nums)
        return trees if isinstance(argnums, tuple) else trees[0]


def _names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _all_gather(x: Any, home: tuple[Any, ...]) -> Any:
    for dim, entry in enumerate(home):
        if entry is not None:
            x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
    return x


def _reduce(x: Any, home: tuple[Any, ...], axes: tuple[str, ...]) -> Any:
    value = _layout.value(x)
    rest = [name for name in axes if name not in {n for e in home for n in _names(e)}]
    for dim, entry in enumerate(home):
        if entry is not None:
            value = jax.lax.psum_scatter(value, entry, scatter_dimension=dim, tiled=True)
    if rest:
        value = jax.lax.psum(value, tuple(rest))
    if isinstance(x, _layout.Open):
        return _layout.Open(value, x.dtype, None)
    return value


def spec_of(leaf: Any) -> PartitionSpec | None:
    """``leaf``'s partition spec where it can be read: from an Explicit type, or from a
    concrete array's sharding; None inside ``jit`` on an Auto mesh, or off any mesh."""
    sharding = _sharding.explicit_sharding(leaf)
    if sharding is None and isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer):
        sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    return None


def layout(
    batch_leaf: Any,
    differentiated: list[Any],
    mesh_axes: tuple[str, ...] | None,
    trade: Trade,
) -> Layout | None:
    """The call's layout if a differentiated leaf is sharded over the batch's mesh axes
    and the loop can run per shard; else None (the loop runs as for replicated ones)."""
    where = _layout.shards(batch_leaf, 0, mesh_axes)
    if where is None:
        return None
    axes = _names(where.entry)
    homes, sharded = [], False
    for leaf in differentiated:
        spec = spec_of(leaf)
        full = [] if spec is None else list(spec) + [None] * (jnp.ndim(leaf) - len(spec))
        home = []
        for entry in full:
            names = _names(entry)
            mine = tuple(n for n in names if n in axes)
            if mine and len(mine) != len(names):
                return None  # a dimension split over batch and other axes: not per shard
            home.append(None if not mine else mine[0] if len(mine) == 1 else mine)
        sharded = sharded or any(e is not None for e in home)
        homes.append(tuple(home))
    if not sharded:
        return None
    reduce = trade.reduce or "per_microbatch"
    return Layout(axes, where.count, where.entry, tuple(homes), Trade(reduce))


def supports(accumulators: Any, count: Any) -> bool:
    """Whether the per-shard loop computes this call: sums and means of all rows (the
    means divided afterwards by the global count or weight), without a bound."""
    kinds = jax.tree.leaves(accumulators, is_leaf=lambda x: isinstance(x, AccumulationType))
    plain = all(k in (AccumulationType.SUM, AccumulationType.MEAN) for k in kinds)
    return plain and count is None


def sums_only(accumulators: Any) -> Any:
    """The accumulator tree with every MEAN made a SUM (divided after the loop)."""
    return jax.tree.map(
        lambda k: AccumulationType.SUM,
        accumulators,
        is_leaf=lambda x: isinstance(x, AccumulationType),
    )


def divide_means(accumulators: Any, grads: PyTree, total: Any) -> PyTree:
    """``grads`` with the leaves under a MEAN divided by ``total``."""
    kinds, treedef = jax.tree.flatten(
        accumulators, is_leaf=lambda x: isinstance(x, AccumulationType)
    )
    parts = treedef.flatten_up_to(grads)
    out = [
        jax.tree.map(lambda g: g / total.astype(g.dtype), part)
        if kind is AccumulationType.MEAN
        else part
        for kind, part in zip(kinds, parts, strict=True)
    ]
    return treedef.unflatten(out)


def gathered_once(
    layout: Layout | None, nums: tuple[int, ...], args: tuple[Any, ...]
) -> tuple[Any, ...]:
    """``args`` with the differentiated ones made whole over the batch's mesh axes before
    the loop: the fallback for calls the per-shard loop does not compute (``reshard`` on
    an Explicit mesh, a sharding constraint on an Auto one)."""
    if layout is None:
        return args

    def whole(x: Any) -> Any:
        spec = spec_of(x)
        if spec is None:
            return x
        kept = []
        for entry in spec:
            rest = tuple(n for n in _names(entry) if n not in layout.axes)
            kept.append(None if not rest else rest[0] if len(rest) == 1 else rest)
        if _sharding.explicit_sharding(x) is not None:
            return jax.sharding.reshard(x, PartitionSpec(*kept))
        return jax.lax.with_sharding_constraint(x, PartitionSpec(*kept))

    return tuple(jax.tree.map(whole, a) if i in nums else a for i, a in enumerate(args))


def run(
    layout: Layout,
    inner: Callable[[tuple[Any, ...], dict[str, Any], Any], Any],
    argnums: int | tuple[int, ...],
    batched: Callable[[int | str], bool],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    weights: Any,
    means: Callable[[PyTree, Any], PyTree],
) -> Any:
    """``inner(args, kwargs, weights)`` on each device's rows, inside a ``shard_map`` over
    the batch's mesh axes, its gradients reduced over them.

    ``inner`` loops over the local rows with microbatches of ``microbatch_size / count``
    rows; with ``reduce_gradients="per_microbatch"`` it reduces each microbatch's
    gradients itself (``Layout.reduce``). ``means(grads, total)`` divides the means by the
    number of rows, or the sum of the weights, of the whole batch.
    """
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    rows = PartitionSpec(layout.entry)
    rows_total = jax.tree.leaves(
        [args[i] for i in range(len(args)) if batched(i)]
        + [v for k, v in kwargs.items() if batched(k)]
    )[0].shape[0]

    def spec(owner: int | str, value: Any) -> Any:
        if owner in nums:
            return None  # filled below
        if batched(owner):
            return jax.tree.map(lambda _: rows, value)
        return jax.tree.map(lambda _: PartitionSpec(), value)

    arg_specs = [spec(i, a) for i, a in enumerate(args)]
    homes = iter(layout.homes)
    for i in nums:
        arg_specs[i] = jax.tree.map(lambda _: PartitionSpec(*next(homes)), args[i])
    kwarg_specs = {k: spec(k, v) for k, v in kwargs.items()}
    weight_specs = None if weights is None else rows

    def local(a: tuple[Any, ...], kw: dict[str, Any], w: Any) -> Any:
        a = layout.gather(a, nums)
        grads, aux = inner(a, kw, w)
        if not layout.reduce_per_microbatch:
            grads = layout.reduce(grads)
        if w is None:
            total = jnp.float32(rows_total)
        else:
            total = jax.lax.psum(jnp.sum(w, dtype=jnp.float32), layout.axes)
        return means(grads, total), aux

    mapped = jax.shard_map(
        local,
        in_specs=(tuple(arg_specs), kwarg_specs, weight_specs),
        out_specs=(layout.grad_specs(args, argnums), rows),
        axis_names=set(layout.axes),
    )
    return mapped(tuple(args), kwargs, weights)
