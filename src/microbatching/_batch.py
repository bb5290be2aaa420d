"""Where the batch is in one call: the batched leaves, their axes, sizes and the loop bound.

``locate`` runs at each call (once per trace under ``jit``) with the ``BatchAxes`` fixed
when the user wrapped ``fun``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _sharding
from ._signature import TOO_MANY, WEIGHTS, BatchAxes, leaf_paths
from ._typing import AxisSpec, Count


@dataclasses.dataclass(frozen=True)
class Batch:
    """A call's arguments, flattened, with the batch axis of each leaf (None: not batched).

    Attributes:
      num_microbatches: ``size // microbatch_size``, plus one for a remainder.
      remainder: The rows of the last, partial microbatch (0 when the size divides).
      bound: How many microbatches run: ``num_microbatches``, or ``num_real_microbatches``
        (an int, or a traced int32 clipped to ``[0, num_microbatches]``).
      weights: The index of the leaf that holds ``example_weights``, if the call has one.
    """

    treedef: Any
    leaves: tuple[Any, ...]
    axes: tuple[int | None, ...]
    labels: tuple[str, ...]
    size: int
    num_microbatches: int
    bound: int | jax.Array
    remainder: int = 0
    weights: int | None = None
    microbatch_size: int | None = None
    substitute: bool = False

    def rebuild(self, leaves: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments from ``leaves`` (the weights, last, are not among them)."""
        args, kwargs = jax.tree.unflatten(self.treedef, leaves[: self.treedef.num_leaves])
        return tuple(args), kwargs

    def weights_of(self, leaves: Sequence[Any]) -> Any:
        """The ``example_weights`` among ``leaves``, or None."""
        return None if self.weights is None else leaves[self.weights]

    @property
    def full(self) -> int:
        """The number of microbatches of ``microbatch_size`` rows."""
        return self.num_microbatches - (self.remainder > 0)

    @property
    def batched(self) -> list[int]:
        """Indices of the batched leaves."""
        return [i for i, axis in enumerate(self.axes) if axis is not None]


def locate(
    binding: BatchAxes,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    weights: Any,
    microbatch_size: int | None,
    count: Count,
    allow_remainder: bool = False,
    pad: bool = False,
) -> Batch:
    """The plan of one call: flattens it, finds each batched leaf, checks shapes and sizes.

    ``weights`` (``example_weights``, or None) follow the call's leaves, with axis 0;
    inside ``shard_map`` each batched leaf is made to vary over the mesh axes that the
    weights vary over (``_varying_as``).
    Without ``microbatch_size`` a weighted call runs as one microbatch of the whole batch.
    With ``pad`` a remainder runs in the loop as a whole microbatch whose padding rows are
    masked: a call without weights gets a mask of ones.
    """
    check_call(binding, args, kwargs)
    axes: list[int | None] = []
    labels: list[str] = []
    leaves: list[Any] = []
    for where, arg in [*enumerate(args), *sorted(kwargs.items())]:
        label = binding.label(where)
        leaves += jax.tree.leaves(arg)
        labels += [label + path for path in leaf_paths(arg)]
        axes += axes_per_leaf(binding.spec(where), arg, label)
    if weights is not None:
        weights = _weights(weights, binding)
        leaves = [
            _varying_as(leaf, weights) if ax is not None else leaf
            for leaf, ax in zip(leaves, axes, strict=True)
        ]
        leaves, labels, axes = [*leaves, weights], [*labels, WEIGHTS], [*axes, 0]
    axes = [
        _normalise_axis(ax, leaf, lab) for ax, leaf, lab in zip(axes, leaves, labels, strict=True)
    ]
    size = _batch_size(binding, axes, leaves, labels)
    m = microbatch_size
    if m is None and weights is not None:
        m, count = max(size, 1), None
    remainder = 0
    if m is None:
        n = size
    elif allow_remainder or microbatch_size is None:
        n, remainder = -(-size // m), size % m
    else:
        n = _num_microbatches(binding, size, m, _size_source(axes, leaves, labels))
    index = len(leaves) - 1 if weights is not None else None
    if remainder and pad and weights is None:
        leaves, labels, axes = [*leaves, jnp.ones(size, bool)], [*labels, WEIGHTS], [*axes, 0]
        index = len(leaves) - 1
    return Batch(
        jax.tree.structure((args, kwargs)),
        tuple(leaves),
        tuple(axes),
        tuple(labels),
        size,
        n,
        _bound(count, n),
        remainder,
        index,
        m,
        substitute=weights is not None,
    )


def _weights(weights: Any, binding: BatchAxes) -> jax.Array | jax.ShapeDtypeStruct:
    """``example_weights`` checked: one bool, integer or float per example (an array, or
    a ``jax.ShapeDtypeStruct`` for shapes only)."""
    shape, dtype = getattr(weights, "shape", None), getattr(weights, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{WEIGHTS} must be an array of one weight per example, got {weights!r} of type "
            f"{type(weights).__name__}; pass e.g. jnp.ones(batch_size) or a boolean mask."
        )
    if len(shape) != 1:
        raise ValueError(
            f"{WEIGHTS} must have shape (batch_size,), one weight per example, got shape "
            f"{tuple(shape)}; pass a vector, e.g. {WEIGHTS}=mask.reshape(-1)."
        )
    kind = np.dtype(dtype)
    if kind == np.bool_ or any(jnp.issubdtype(kind, t) for t in (np.integer, np.floating)):
        return weights if isinstance(weights, jax.ShapeDtypeStruct) else jnp.asarray(weights)
    raise TypeError(
        f"{WEIGHTS} of {binding.transform} must be bool, integer or floating, got dtype "
        f"{kind}; pass real weights, or a boolean mask."
    )


def _varying_as(leaf: Any, weights: Any) -> Any:
    """A batched ``leaf`` made to vary over the manual mesh axes (inside ``shard_map``)
    that its ``example_weights`` vary over: each device then weights its own copy of the
    rows, and a row that the weights replace (``Loop.substitute``) keeps the type that
    ``fun`` was traced with."""
    if not isinstance(leaf, jax.Array | np.ndarray):
        return leaf  # not an array: _normalise_axis says so
    have = _sharding.varying_of(leaf)
    missing = tuple(a for a in _sharding.varying_of(weights) if a not in have)
    return jax.lax.pcast(jnp.asarray(leaf), missing, to="varying") if missing else leaf


def check_call(binding: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The call's arguments against ``binding``: in_axes' count, the batch arguments
    present, ``example_weights`` where ``fun`` cannot take it, mapped keywords."""
    if binding.rest is TOO_MANY and len(args) > len(binding.positions):
        raise ValueError(
            f"in_axes has {len(binding.positions)} entries but {binding.fun_name} was called with "
            f"{len(args)} positional argument(s); give one entry per positional argument "
            f"({binding.set_by})."
        )
    given = {*range(len(args)), *kwargs}
    given |= {binding.position(k) for k in kwargs}
    if binding.signature is not None:
        given |= set(binding.signature.positional[: len(args)])
    for where in binding.required:
        if where not in given:
            raise TypeError(_missing(binding, where, args, kwargs))
    sig = binding.signature
    if WEIGHTS in kwargs and not binding.weights and sig is not None and not sig.takes(WEIGHTS):
        raise TypeError(
            f"{binding.fun_name}{sig.describe()} was called with {WEIGHTS}=, which "
            f"{binding.transform} passes on to fun, and fun has no such parameter; "
            "per-example weights are a keyword of the functions that micro_vmap and "
            "micro_grad return."
        )
    for name, value in kwargs.items():
        if name not in binding.names and binding.position(name) is None:
            _check_mapped_keyword(binding, name, value)


def _missing(
    binding: BatchAxes, where: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    if isinstance(where, str):
        return (
            f"argnames includes {where!r}, but {binding.fun_name} was called without it "
            f"(keyword arguments given: {sorted(kwargs)}); pass the batch argument."
        )
    name = binding.label(where)
    by_name = "" if name.startswith("args[") else f" and no keyword argument `{name}`"
    return (
        f"{binding.required_by} includes {where}, but {binding.fun_name} was called with "
        f"{len(args)} positional argument(s){by_name}; pass the batch argument."
    )


def _batch_size(
    binding: BatchAxes, axes: list[int | None], leaves: list[Any], labels: list[str]
) -> int:
    found = [
        (lab, ax, leaf.shape)
        for ax, leaf, lab in zip(axes, leaves, labels, strict=True)
        if ax is not None
    ]
    if not found:
        raise ValueError(
            f"{binding.transform} of {binding.fun_name} has nothing to map: no argument of this "
            f"call has a batch axis under {binding.set_by}; pass a batch argument, or give "
            "one an axis."
        )
    sizes = list(dict.fromkeys(shape[ax] for _, ax, shape in found))  # in the listing's order
    if len(sizes) > 1:
        listing = "; ".join(f"`{lab}` axis {ax} of shape {shape}" for lab, ax, shape in found)
        raise ValueError(
            f"Batch arguments of {binding.fun_name} must have equal batch sizes, got "
            f"{sizes}: {listing}. Fix the shapes, or the batch axes ({binding.set_by})."
        )
    return sizes[0]


def _check_mapped_keyword(axes: BatchAxes, name: str, value: Any) -> None:
    """A keyword argument mapped by the jax.vmap rule must be arrays with a batch axis."""
    if axes.other_keywords is None:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray) or not np.ndim(leaf):
            unmapped = (
                "by position with in_axes None"
                if axes.transform == "micro_vmap"
                else "by position, outside batch_argnums"
            )
            fix = f"pass it {unmapped}, or bind it"
            sig = axes.signature
            if sig is not None and name in sig.keyword and name not in sig.positional:
                fix = "bind it"  # keyword-only: it cannot be passed by position
            raise TypeError(
                f"{axes.transform} maps keyword arguments that name no positional parameter "
                f"along axis 0, as jax.vmap does, but `{name}{jax.tree_util.keystr(path)}` is "
                f"{leaf!r}, not an array with a batch axis; {fix} with functools.partial."
            )


def _size_source(axes: list[int | None], leaves: list[Any], labels: list[str]) -> str:
    """Where the batch size comes from, for messages: the first batched leaf."""
    for ax, leaf, lab in zip(axes, leaves, labels, strict=True):
        if ax is not None:
            return f"`{lab}` axis {ax} of shape {tuple(np.shape(leaf))}"
    return "no batched argument"


def _num_microbatches(
    binding: BatchAxes, batch_size: int, microbatch_size: int, source: str
) -> int:
    """The number of microbatches, or a ValueError naming both sizes, where the batch
    size comes from (``source``) and the fixes."""
    if 0 < batch_size < microbatch_size:
        raise ValueError(
            f"The batch size {batch_size} ({source}) is "
            f"smaller than {microbatch_size=}. Pass "
            f"allow_remainder=True to run it as one microbatch of {batch_size} rows (which "
            f"micro_vmap and micro_grad pad to {microbatch_size} with masked copies of the "
            f"last row); or pass microbatch_size={batch_size}, or None for no microbatching."
        )
    if batch_size % microbatch_size:
        n, r = divmod(batch_size, microbatch_size)
        divisors = [d for d in range(2, batch_size) if batch_size % d == 0]
        nearest = sorted(sorted(divisors, key=lambda d: abs(d - microbatch_size))[:4])
        sizes = (
            f"; or use a microbatch_size that divides {batch_size}, such as one of {nearest}"
            if nearest
            else f" ({batch_size} is prime: only 1 and {batch_size} divide it)"
        )
        padding = (
            " To keep one compiled shape for batches of varying size, pad them to a fixed "
            "size and pass example_weights that are 0 on the padding rows."
            if binding.weights
            else ""
        )
        raise ValueError(
            f"The batch size {batch_size} ({source}) is "
            f"not divisible by {microbatch_size=}. Pass "
            f"allow_remainder=True to run {n} {'microbatch' if n == 1 else 'microbatches'} "
            f"of {microbatch_size} rows and one of the last {r}{sizes}.{padding}"
        )
    return batch_size // microbatch_size


def _bound(count: Count, total: int) -> int | jax.Array:
    """How many microbatches to run: ``count`` bounded by ``total``."""
    if count is None:
        return total
    if isinstance(count, int):
        if count > total:
            raise ValueError(
                f"num_real_microbatches={count} exceeds the number of microbatches, {total}; "
                f"pass at most {total}."
            )
        return count
    return jax.numpy.clip(count, 0, total).astype(np.int32)


def leaf_axes(
    binding: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, int | None]]:
    """The name and batch axis (None: not batched) of each leaf of ``(args, kwargs)``, in
    ``jax.tree.flatten`` order."""
    out: list[tuple[str, int | None]] = []
    for where, arg in [*enumerate(args), *sorted(kwargs.items())]:
        label = binding.label(where)
        axes = axes_per_leaf(binding.spec(where), arg, label)
        out += [(label + path, axis) for path, axis in zip(leaf_paths(arg), axes, strict=True)]
    return out


def axes_per_leaf(spec: AxisSpec, arg: Any, label: str) -> list[int | None]:
    """Broadcasts one argument's axis spec (a pytree prefix) to its leaves."""
    out: list[int | None] = []
    try:
        jax.tree.map(
            lambda ax, sub: out.extend([ax] * len(jax.tree.leaves(sub))),
            spec,
            arg,
            is_leaf=lambda x: x is None,
        )
    except ValueError as err:
        raise ValueError(
            f"The in_axes entry {spec!r} for argument `{label}` is not a pytree prefix of it "
            f"(structure {jax.tree.structure(arg)}); give an int or a prefix of its structure."
        ) from err
    return out


def _normalise_axis(axis: int | None, leaf: Any, label: str) -> int | None:
    if axis is None:
        return None
    if not isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        raise TypeError(
            f"Batch argument `{label}` is a {type(leaf).__name__}, not an array, so it has no "
            "batch axis; convert it with jnp.asarray, or leave it out of the batch arguments."
        )
    ndim = len(leaf.shape)
    if ndim == 0:
        raise ValueError(
            f"Batch argument `{label}` is a scalar (shape ()), so it has no batch axis; give it "
            "a batch axis, or leave it out of the batch arguments."
        )
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"in_axes gives axis {axis} for batch argument `{label}` of shape {leaf.shape} "
            f"(rank {ndim}); use an axis in [{-ndim}, {ndim})."
        )
    return operator.index(axis) % ndim
