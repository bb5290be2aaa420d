"""Parameters sharded over the batch's mesh axes (FSDP, ZeRO-3): where they are gathered,
and where their gradients are reduced.

When ``micro_grad``'s differentiated arguments are split over the same mesh axes as the
batch, every device needs them whole to take its rows' gradients, and each device's
gradient sum covers only its rows. Two choices trade memory per device against
collectives per microbatch (``P`` is the parameters' size, ``N`` the number of shards):

- ``gather_params``: ``"once"`` gathers the parameters before the loop (``P`` per device
  for the whole step, one all-gather per leaf per step); ``"per_microbatch"`` gathers
  them inside each microbatch, so the whole copy lives only while it runs (one
  all-gather per leaf per microbatch).
- ``reduce_gradients``: ``"per_microbatch"`` reduce-scatters each microbatch's gradient
  into a sum sharded like the parameters (a carry of ``P / N`` per device, one
  reduce-scatter per leaf per microbatch); ``"after_loop"`` keeps a full-size partial
  sum on each device and reduces it once (a carry of ``P``, one collective per leaf per
  step).

The loop then runs inside ``jax.shard_map`` over the batch's mesh axes: each device
loops over its own rows of every microbatch, and the collectives above are the only
ones, written out (``all_gather``, ``psum_scatter``) rather than left to XLA's choice.
The layout is read from the arrays: their types on an Explicit mesh, their shardings
when they are concrete. Inside ``jit`` on an Auto mesh JAX does not show them: the
parameters enter the ``shard_map`` whole over the batch's axes (XLA gathers them there
if they are sharded), and their gradients are all-reduced after the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from . import _accumulators, _checks, _layout, _sharding
from ._accumulators import AccumulationType, PerShard
from ._typing import GatherParams, PyTree, ReduceGradients


class UnseenLayoutWarning(UserWarning):
    """Large differentiated arguments whose layout ``micro_grad`` cannot read."""


GATHER: tuple[GatherParams, ...] = typing.get_args(GatherParams)
REDUCE: tuple[ReduceGradients, ...] = typing.get_args(ReduceGradients)


@dataclasses.dataclass(frozen=True)
class Trade:
    """The user's choice of collectives against memory: ``micro_grad``'s
    ``gather_params`` and ``reduce_gradients``, normalised once (``ensure_trade``).

    Attributes:
      gather_per_microbatch: ``gather_params="per_microbatch"``: the parameters are
        gathered inside each microbatch; else once, before the loop.
      reduce_per_microbatch: ``reduce_gradients="per_microbatch"`` (True) or
        ``"after_loop"`` (False); None where not given: per microbatch when a parameter
        is sharded over the batch's axes, else after the loop (``layout`` resolves it).
    """

    gather_per_microbatch: bool = False
    reduce_per_microbatch: bool | None = None


def ensure_trade(gather_params: Any, reduce_gradients: Any) -> Trade:
    """``gather_params`` (one of ``GATHER``) and ``reduce_gradients`` (one of ``REDUCE``,
    or None), checked when ``micro_grad`` wraps the function."""
    gather = _checks.ensure_choice("gather_params", gather_params, GATHER)
    if reduce_gradients is None:
        return Trade(gather == "per_microbatch")
    reduce = _checks.ensure_choice("reduce_gradients", reduce_gradients, REDUCE)
    return Trade(gather == "per_microbatch", reduce == "per_microbatch")


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
      per_shard: Whether the loop can run per shard (else: ``gathered_once``).
    """

    axes: tuple[str, ...]
    count: int
    entry: Any
    homes: tuple[tuple[Any, ...], ...]
    trade: Trade
    per_shard: bool = True

    @property
    def reduce_per_microbatch(self) -> bool:
        return bool(self.trade.reduce_per_microbatch)

    @property
    def gather_per_microbatch(self) -> bool:
        return self.trade.gather_per_microbatch

    def gather(self, args: tuple[Any, ...], nums: tuple[int, ...]) -> tuple[Any, ...]:
        """``args`` with the differentiated ones made whole over ``axes`` (inside the
        shard_map)."""
        leaves, structure = jax.tree.flatten([args[i] for i in nums])
        whole = [
            _all_gather(x, home, self.axes) for x, home in zip(leaves, self.homes, strict=True)
        ]
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


def _all_gather(x: Any, home: tuple[Any, ...], axes: tuple[str, ...]) -> Any:
    """``x`` whole over ``axes``, and typed as varying over them: its gradient is then
    each device's own sum, which ``_reduce`` adds up, and not one that JAX would
    all-reduce by itself (the transpose of an unvarying value's use)."""
    for dim, entry in enumerate(home):
        if entry is not None:
            x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
    missing = tuple(name for name in axes if name not in _sharding.varying(jax.typeof(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


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


UNSEEN_LAYOUT_BYTES = 8 * 2**20
"""Differentiated arguments this large whose layout cannot be read (inside ``jit`` on an
Auto mesh) get a warning naming ``param_specs``: they enter the loop whole on every
device, which for FSDP parameters costs more memory than the whole batch's gradient."""


def ensure_specs(specs: Any) -> Any:
    """``param_specs`` as given, once it is None or a pytree whose leaves are all
    ``PartitionSpec`` (checked when ``micro_grad`` wraps the function)."""
    if specs is not None and not all(_is_spec(s) for s in jax.tree.leaves(specs, is_leaf=_is_spec)):
        raise TypeError(
            f"micro_grad was given param_specs={specs!r}, whose leaves must be "
            "jax.sharding.PartitionSpec; pass PartitionSpec('data', None) and the like, "
            "one for all the differentiated arguments or a pytree of them."
        )
    return specs


def given_specs(specs: Any, differentiated: Any) -> list[PartitionSpec | None] | None:
    """``param_specs`` (a prefix tree of partition specs, or None) for each leaf of the
    differentiated arguments, or None where the user gave none."""
    if specs is None:
        return None
    try:
        spread = jax.tree.broadcast(specs, differentiated, is_leaf=_is_spec)
    except ValueError as error:
        raise ValueError(
            f"micro_grad was given param_specs={specs!r}, which must be a PartitionSpec or "
            "a pytree of them that is a prefix of the differentiated arguments "
            f"{jax.tree.structure(differentiated)} ({error}); pass one spec per leaf or "
            "subtree, or one PartitionSpec for all of them."
        ) from None
    return jax.tree.leaves(spread, is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def layout(
    batch_leaf: Any,
    differentiated: list[Any],
    mesh_axes: tuple[str, ...] | None,
    trade: Trade,
    given: list[PartitionSpec | None] | None = None,
) -> Layout | None:
    """The call's layout when the batch is sharded and a differentiated leaf is sharded
    over the batch's axes, or its layout cannot be read (inside ``jit`` on an Auto mesh).
    None otherwise: the loop runs on the global arrays, as for replicated parameters.

    ``given``: the user's partition spec of each differentiated leaf (``param_specs``),
    for the leaves whose layout cannot be read. ``Layout.per_shard`` says whether the
    loop can run per shard; where it cannot (a dimension split over the batch's axes and
    others together, or, on an Explicit mesh, a leaf split over both), the parameters are
    gathered once (``gathered_once``).
    """
    where = _layout.shards(batch_leaf, 0, mesh_axes)
    if where is None:
        return None
    axes = _names(where.entry)
    homes, sharded, unknown, per_shard = [], False, False, True
    unseen = 0
    for i, leaf in enumerate(differentiated):
        spec = spec_of(leaf)
        if spec is None and given is not None:
            spec = given[i]
        if spec is None:
            unseen += math.prod(jnp.shape(leaf)) * jnp.dtype(jnp.result_type(leaf)).itemsize
        unknown = unknown or spec is None
        full = [] if spec is None else _sharding.entries(spec, jnp.ndim(leaf))
        home, others = [], False
        for entry in full:
            names = _names(entry)
            mine = tuple(n for n in names if n in axes)
            per_shard = per_shard and not (mine and len(mine) != len(names))
            others = others or len(mine) != len(names)
            home.append(_entry(mine))
        home += [None] * (jnp.ndim(leaf) - len(home))
        mine_any = any(e is not None for e in home)
        # psum_scatter of a leaf also split over Explicit axes of its own: not per shard.
        per_shard = per_shard and not (mine_any and others and where.explicit)
        sharded = sharded or mine_any
        homes.append(tuple(home))
    if unknown and not where.explicit and unseen >= UNSEEN_LAYOUT_BYTES:
        _checks.warn(
            f"micro_grad cannot see how its differentiated arguments ({unseen / 2**20:.0f} "
            "MiB) are laid out: inside jax.jit on an Auto mesh JAX does not show it. They "
            "enter the loop whole on every device, and their gradients are all-reduced "
            "after it. If they are sharded over the batch's mesh axes (FSDP), pass "
            "micro_grad(..., param_specs=...) with their PartitionSpecs, so that each "
            "microbatch's gradient is reduce-scattered into a sum sharded like them; if "
            "they are replicated, pass param_specs=jax.sharding.PartitionSpec().",
            UnseenLayoutWarning,
        )
    if not (sharded or (unknown and not where.explicit)):
        return None
    reduce = sharded if trade.reduce_per_microbatch is None else trade.reduce_per_microbatch
    trade = dataclasses.replace(trade, reduce_per_microbatch=reduce)
    return Layout(axes, where.count, where.entry, tuple(homes), trade, per_shard)


def _is_kind(x: Any) -> bool:
    return isinstance(x, AccumulationType)


def _per_shard(kind: Any) -> PerShard | None:
    """How the loop per shard computes ``kind`` (``Kind.per_shard``); None for a kind it
    does not compute, or a custom ``Accumulator``."""
    return _accumulators.KINDS[kind].per_shard if _is_kind(kind) else None


def _computed(kind: Any) -> PerShard:
    """``kind``'s ``PerShard``, for a call that ``supports`` has let through."""
    per_shard = _per_shard(kind)
    if per_shard is None:
        raise ValueError(f"the loop per shard does not compute {kind!r}; ask supports first.")
    return per_shard


def supports(accumulators: Any, count: Any) -> bool:
    """Whether the per-shard loop computes this call: every accumulator a built-in kind
    it computes (``Kind.per_shard``), without a bound on the microbatches that run."""
    leaves = jax.tree.leaves(accumulators, is_leaf=_is_kind)
    return count is None and all(_per_shard(k) is not None for k in leaves)


def supports_summed(accumulators: Any, count: Any) -> bool:
    """Whether the per-shard loop computes this call from each shard's summed gradient:
    as ``supports``, with every kind linear (SUM and MEAN)."""
    return supports(accumulators, count) and _accumulators.is_linear(accumulators)


def local_kinds(accumulators: Any) -> Any:
    """The accumulators each device folds its rows with (``PerShard.fold``): a MEAN is a
    SUM until ``combine`` divides it by the whole batch's rows or weights. Kinds the loop
    per shard does not compute are left as they are."""

    def local(kind: Any) -> Any:
        per_shard = _per_shard(kind)
        return kind if per_shard is None else per_shard.fold

    return jax.tree.map(local, accumulators, is_leaf=_is_kind)


def combine(
    accumulators: Any, outs: PyTree, total: Any, axes: tuple[str, ...], reduced: bool = False
) -> PyTree:
    """The devices' folds of their rows combined by kind, with its ``PerShard.collective``
    over ``axes`` (none leaves them sharded), means then divided by ``total``.
    ``reduced``: the devices' sums are combined already (``Layout.reduce``)."""
    kinds, treedef = jax.tree.flatten(accumulators, is_leaf=_is_kind)
    parts = treedef.flatten_up_to(outs)

    def one(kind: Any, x: Any) -> Any:
        collective = _computed(kind).collective
        x = x if reduced or collective is None else collective(x, axes)
        return x / total.astype(x.dtype) if _accumulators.KINDS[kind].rows == "mean" else x

    out = [
        jax.tree.map(functools.partial(one, kind), part)
        for kind, part in zip(kinds, parts, strict=True)
    ]
    return treedef.unflatten(out)


def out_specs(accumulators: Any, entry: Any) -> Any:
    """The shard_map output specs of the accumulated results, as a prefix tree: a kind
    without a collective stays split by rows, the others are whole on every device."""

    def spec(kind: Any) -> PartitionSpec:
        split = _computed(kind).collective is None
        return PartitionSpec(entry) if split else PartitionSpec()

    return jax.tree.map(spec, accumulators, is_leaf=_is_kind)


def gathered_once(
    layout: Layout | None, nums: tuple[int, ...], args: tuple[Any, ...]
) -> tuple[Any, ...]:
    """``args`` with the differentiated ones made whole over the batch's mesh axes before
    the loop: the fallback for calls the per-shard loop does not compute (``reshard`` on
    an Explicit mesh, a sharding constraint on an Auto one)."""
    if layout is None:
        return args

    whole = functools.partial(_whole_over, axes=layout.axes)
    return tuple(jax.tree.map(whole, a) if i in nums else a for i, a in enumerate(args))


def _entry(names: Any) -> Any:
    """A partition spec entry that names ``names``: None, one axis, or a tuple of them."""
    names = tuple(names)
    return None if not names else names[0] if len(names) == 1 else names


def _whole_over(x: Any, axes: tuple[str, ...]) -> Any:
    """``x`` made whole over the mesh ``axes``, its other axes kept, where its layout can
    be read (``spec_of``): resharded on an Explicit mesh, constrained on an Auto one."""
    spec = spec_of(x)
    if spec is None:
        return x
    have = _sharding.entries(spec, jnp.ndim(x))
    kept = [_entry(n for n in _names(e) if n not in axes) for e in have]
    if kept == have:
        return x
    if _sharding.explicit_sharding(x) is not None:
        return jax.sharding.reshard(x, PartitionSpec(*kept))
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*kept))


def like_parameters(out: PyTree, params: Any, specs: Any) -> PyTree:
    """``out`` with each subtree shaped like the gradient of ``params`` (a
    ``transform_fn``'s output, or each of a tuple of them) laid out as the parameters are,
    ``specs`` (their partition specs, as ``Layout.grad_specs`` gives them): resharded on
    an Explicit mesh, constrained on an Auto one. Other subtrees are left whole."""
    structure = jax.tree.structure(params)
    shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]

    def shaped(node: Any) -> bool:
        if jax.tree.structure(node) != structure:
            return False
        return [jnp.shape(x) for x in jax.tree.leaves(node)] == shapes

    def put(node: Any) -> Any:
        if not shaped(node):
            return node
        leaves = jax.tree.leaves(node)
        laid = [
            _put(x, spec) for x, spec in zip(leaves, structure.flatten_up_to(specs), strict=True)
        ]
        return jax.tree.unflatten(structure, laid)

    return jax.tree.map(put, out, is_leaf=shaped)


def _put(x: Any, spec: PartitionSpec) -> Any:
    if _sharding.explicit_sharding(x) is not None:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _onto(x: Any, spec: PartitionSpec, axes: tuple[str, ...]) -> Any:
    """``x`` resharded so that the batch's mesh ``axes`` split it as ``spec`` says, its
    other axes kept, where its Explicit type says otherwise; else ``x``."""
    sharding = _sharding.explicit_sharding(x)
    if sharding is None:
        return x
    have = _sharding.entries(sharding.spec, jnp.ndim(x))
    want = _sharding.entries(spec, jnp.ndim(x))
    target = []
    for current, wanted in zip(have, want, strict=True):
        target.append(_entry([n for n in _names(current) if n not in axes] + [*_names(wanted)]))
    if target == have:
        return x
    return jax.sharding.reshard(x, PartitionSpec(*target))


def run(
    layout: Layout,
    inner: Callable[[tuple[Any, ...], dict[str, Any], Any], Any],
    nums: tuple[int, ...],
    batched: Callable[[int | str], bool],
    call: tuple[tuple[Any, ...], dict[str, Any], Any],
    specs: Any,
    finish: Callable[[PyTree, Any], PyTree],
) -> Any:
    """``inner(args, kwargs, weights)`` of ``call`` on each device's rows, inside a
    ``shard_map`` over the batch's mesh axes.

    ``inner`` loops over the local rows with microbatches of ``microbatch_size / count``
    rows; with ``reduce_gradients="per_microbatch"`` it reduces each microbatch's
    gradients itself (``Layout.reduce``), and with ``gather_params="per_microbatch"`` it
    gathers the parameters itself. ``finish(results, total)`` combines the devices'
    results, ``total`` being the number of rows, or the sum of the weights, of the whole
    batch; ``specs`` are the combined results' partition specs (a prefix tree).
    """
    args, kwargs, weights = call
    rows = PartitionSpec(layout.entry)
    batch = [a for i, a in enumerate(args) if batched(i)]
    batch += [v for k, v in kwargs.items() if batched(k)]
    size = jax.tree.leaves(batch)[0].shape[0]

    def spec(owner: int | str, value: Any) -> Any:
        whole = rows if batched(owner) else PartitionSpec()
        return jax.tree.map(lambda _: whole, value)

    arg_specs = [spec(i, a) for i, a in enumerate(args)]
    homes = iter(layout.homes)
    for i in nums:
        arg_specs[i] = jax.tree.map(lambda _: PartitionSpec(*next(homes)), args[i])
    kwarg_specs = {k: spec(k, v) for k, v in kwargs.items()}
    weight_specs = None if weights is None else rows
    # On an Explicit mesh an argument laid out otherwise over the batch's axes (a batch
    # leaf or weights left whole, a frozen sharded parameter) is moved there first.
    onto = functools.partial(_onto, axes=layout.axes)
    args = tuple(jax.tree.map(onto, a, s) for a, s in zip(args, arg_specs, strict=True))
    kwargs = {k: jax.tree.map(onto, v, kwarg_specs[k]) for k, v in kwargs.items()}
    weights = None if weights is None else onto(weights, rows)

    def local(a: tuple[Any, ...], kw: dict[str, Any], w: Any) -> Any:
        if not layout.gather_per_microbatch:
            a = layout.gather(a, nums)
        outs, aux = inner(a, kw, w)
        if w is None:
            total = jnp.float32(size)
        else:
            total = jax.lax.psum(jnp.sum(w, dtype=jnp.float32), layout.axes)
        return finish(outs, total), aux

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # explicitly sharded inputs, called outside jax.set_mesh
        first = jax.tree.leaves(batch)[0]
        sharding = _sharding.explicit_sharding(first)
        mesh = sharding.mesh if sharding is not None else mesh
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tuple(arg_specs), kwarg_specs, weight_specs),
        out_specs=(specs, rows),
        axis_names=set(layout.axes),
    )
    return mapped(tuple(args), kwargs, weights)


def whole_over_batch_axes(
    batched: Callable[[int | str], bool], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments, those without a batch axis made whole over the batch's mesh
    axes where their Explicit type splits them there (``micro_vmap`` maps the shards of
    the batch, and JAX cannot map over a mesh axis that splits an unmapped value)."""
    batch = [a for i, a in enumerate(args) if batched(i)]
    batch += [v for k, v in kwargs.items() if batched(k)]
    leaves = jax.tree.leaves(batch)
    sharding = _sharding.explicit_sharding(leaves[0]) if leaves else None
    if sharding is None:
        return args, kwargs
    axes = _names(_sharding.entries(sharding.spec, jnp.ndim(leaves[0]))[0])
    if not axes:
        return args, kwargs

    whole = functools.partial(_whole_over, axes=axes)
    args = tuple(a if batched(i) else jax.tree.map(whole, a) for i, a in enumerate(args))
    kwargs = {k: v if batched(k) else jax.tree.map(whole, v) for k, v in kwargs.items()}
    return args, kwargs
