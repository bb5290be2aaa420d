"""How microbatch results are combined: ``AccumulationType``, ``Accumulator`` and the built-ins."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _sharding
from ._typing import PyTree, PyTreeFn, UpdateFn


class AccumulationType(enum.Enum):
    """The built-in ways to combine microbatch results.

    >>> AccumulationType.SUM
    <AccumulationType.SUM: 2>
    """

    MEAN = 1
    """The sum of the microbatch results divided by the number of microbatches (NaN for
    an empty batch)."""
    SUM = 2
    """The sum of the microbatch results."""
    RUNNING_MEAN = 3
    """The mean of the microbatch results that ran (see ``num_real_microbatches``); 0
    when none ran (as in optax), NaN for an empty batch."""
    CONCAT = 4
    """The microbatch results joined along axis 0, in the original row order."""


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """A recipe for folding a sequence of microbatch results into one result.

    For results ``x_0, ..., x_{n-1}`` the loop computes::

        carry = init(jax.eval_shape(lambda: x_0))
        for i in range(n):
            carry = update(carry, x_i, i)
        result = finalize(carry)

    ``aggregate`` reduces a stack of per-example results along axis 0 the same way;
    ``micro_vmap`` applies it inside each microbatch before ``update``.

    Attributes:
      init: Maps the shape and dtype of one result to the initial carry.
      update: Maps ``(carry, result, index)`` to the next carry.
      finalize: Maps the last carry to the final result.
      aggregate: Reduces per-example results stacked on axis 0.

    >>> import jax.numpy as jnp
    >>> from microbatching import microbatch
    >>> maximum = Accumulator(
    ...     init=lambda s: jnp.full(s.shape, -jnp.inf, s.dtype),
    ...     update=lambda carry, x, i: jnp.maximum(carry, x),
    ...     finalize=lambda carry: carry,
    ...     aggregate=lambda xs: jnp.max(xs, axis=0),
    ... )
    >>> microbatch(jnp.max, argnums=0, microbatch_size=2, accumulator=maximum)(
    ...     jnp.array([3.0, 9.0, 1.0, 4.0]))
    Array(9., dtype=float32)
    """

    init: PyTreeFn
    update: UpdateFn
    finalize: PyTreeFn
    aggregate: PyTreeFn


def _leafwise(
    init: Callable[[Any], Any],
    update: Callable[[Any, Any, Any], Any],
    finalize: Callable[[Any], Any],
    aggregate: Callable[[Any], Any],
) -> Accumulator:
    """An Accumulator that applies per-array functions to every leaf of a subtree."""
    return Accumulator(
        init=lambda tree: jax.tree.map(init, tree),
        update=lambda carry, tree, i: jax.tree.map(lambda c, x: update(c, x, i), carry, tree),
        finalize=lambda carry: settle(jax.tree.map(finalize, carry)),
        aggregate=lambda tree: jax.tree.map(aggregate, tree),
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=["how"])
@dataclasses.dataclass(frozen=True)
class _PerShard:
    """A reduction left open: one partial result per shard of the batch axis (axis 0).

    Accumulating these instead of the reduced value keeps every device's partial sum on
    that device for the whole loop; ``settle`` combines them with one all-reduce at the end.
    """

    parts: Any
    how: str


def settle(tree: PyTree) -> PyTree:
    """Combines every open per-shard reduction in ``tree``."""

    def close(x: Any) -> Any:
        if not isinstance(x, _PerShard):
            return x
        reduce = jnp.sum if x.how == "sum" else jnp.mean
        return reduce(x.parts, axis=0, dtype=x.parts.dtype)

    return jax.tree.map(close, tree, is_leaf=lambda x: isinstance(x, _PerShard))


def _rows(how: str) -> Callable[[jax.Array], Any]:
    """Reduces axis 0 (the batch) with ``how``; per shard when it is explicitly sharded.

    Floating results keep their dtype; integer and boolean sums promote as ``jnp.sum`` does
    (a sum of booleans counts them).
    """
    reduce = jnp.sum if how == "sum" else jnp.mean

    def rows(x: jax.Array, axis: int) -> jax.Array:
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else None
        return reduce(x, axis=axis, dtype=dtype)

    def aggregate(x: jax.Array) -> Any:
        sharding = _sharding.explicit_sharding(x)
        spec = None if sharding is None else _sharding.spec_of(sharding, x.ndim)
        shards = 1 if sharding is None or not spec else _sharding.num_shards(sharding, spec[0])
        if shards == 1 or sharding is None or spec is None:
            return rows(x, 0)
        parts = jnp.reshape(
            x,
            (shards, x.shape[0] // shards, *x.shape[1:]),
            out_sharding=_sharding.with_spec(sharding, [spec[0], None, *spec[1:]]),
        )
        return _PerShard(rows(parts, 1), how)

    return aggregate


def _inexact(kind: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wraps ``fn`` to refuse integer and boolean leaves, which a mean would change the type of."""

    def checked(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"AccumulationType.{kind} needs floating-point results, but fun returned a leaf "
                f"of dtype {x.dtype} and shape {x.shape}; cast it to a float dtype inside fun, "
                "or accumulate it with AccumulationType.SUM."
            )
        return fn(x)

    return checked


def _zeros(struct: Any) -> jax.Array:
    return _full(struct, 0)


def _full(struct: Any, value: float, shape: tuple[int, ...] | None = None, spec=None) -> jax.Array:
    """An array like ``struct`` (keeping an explicit sharding, or ``spec`` on it) filled."""
    sharding = _sharding.explicit_sharding(struct)
    if sharding is not None and spec is not None:
        sharding = _sharding.with_spec(sharding, spec)
    shape = struct.shape if shape is None else shape
    return jnp.full(shape, value, struct.dtype, out_sharding=sharding)


def sum_() -> Accumulator:
    """Sums the results, in their own dtype."""
    return _leafwise(_zeros, lambda c, x, i: c + x, lambda c: c, _rows("sum"))


def mean(num_microbatches: int) -> Accumulator:
    """Sums, then divides by ``num_microbatches`` (NaN when there are none)."""
    return _leafwise(
        _inexact("MEAN", _zeros),
        lambda c, x, i: c + x,
        lambda c: (c / jnp.asarray(num_microbatches, c.dtype)).astype(c.dtype),
        _inexact("MEAN", _rows("mean")),
    )


def running_mean(num_microbatches: int) -> Accumulator:
    """Keeps the mean of the results seen so far: 0 until the first, NaN for an empty batch."""

    def update(c: jax.Array, x: jax.Array, i: Any) -> jax.Array:
        return jnp.where(i == 0, x, c + (x - c) / jnp.asarray(i + 1, c.dtype)).astype(c.dtype)

    def finalize(c: jax.Array) -> jax.Array:
        return c if num_microbatches else jnp.full_like(c, jnp.nan)

    return _leafwise(
        _inexact("RUNNING_MEAN", _zeros), update, finalize, _inexact("RUNNING_MEAN", _rows("mean"))
    )


def concat(num_microbatches: int) -> Accumulator:
    """Interleaves the results back into batch order.

    Result ``i`` (``k`` rows) goes to column ``i`` of a ``(k, n, ...)`` buffer, whose
    row-major merge of the first two axes puts its row ``j`` at ``j * n + i``: the row
    microbatch ``i`` read from the batch. A scalar result is stored at index ``i``.
    """
    n = num_microbatches

    def init(s: Any) -> jax.Array:
        if not s.shape:
            return _full(s, 0, (n,), [None])
        sharding = _sharding.explicit_sharding(s)
        spec = None if sharding is None else _sharding.spec_of(sharding, len(s.shape))
        spec = None if spec is None else [spec[0], None, *spec[1:]]
        return _full(s, 0, (s.shape[0], n, *s.shape[1:]), spec)

    def update(carry: jax.Array, x: jax.Array, i: Any) -> jax.Array:
        axis = 1 if x.ndim else 0
        return jax.lax.dynamic_update_index_in_dim(carry, x.astype(carry.dtype), i, axis)

    def finalize(carry: jax.Array) -> jax.Array:
        return carry if carry.ndim == 1 else _merge(carry)

    return _leafwise(init, update, finalize, lambda x: x)


def _merge(carry: jax.Array) -> jax.Array:
    return carry.reshape(carry.shape[0] * carry.shape[1], *carry.shape[2:])


def _builtin(kind: AccumulationType, num_microbatches: int) -> Accumulator:
    if kind is AccumulationType.SUM:
        return sum_()
    if kind is AccumulationType.MEAN:
        return mean(num_microbatches)
    if kind is AccumulationType.RUNNING_MEAN:
        return running_mean(num_microbatches)
    return concat(num_microbatches)


def _is_spec(x: Any) -> bool:
    return isinstance(x, Accumulator | AccumulationType)


def check_tree(accumulator: Any) -> None:
    """Wrap-time check: every leaf of ``accumulator`` is an Accumulator or AccumulationType."""
    for leaf in jax.tree.leaves(accumulator, is_leaf=_is_spec):
        if not _is_spec(leaf):
            raise TypeError(
                f"accumulator leaves must be AccumulationType or Accumulator, got {leaf!r} of "
                f"type {type(leaf).__name__}; e.g. accumulator=AccumulationType.SUM."
            )


def combine(accumulator: Any, num_microbatches: int) -> Accumulator:
    """One Accumulator for a whole output, from a pytree prefix of per-subtree specs."""
    specs, treedef = jax.tree.flatten(accumulator, is_leaf=_is_spec)
    accs = [s if isinstance(s, Accumulator) else _builtin(s, num_microbatches) for s in specs]

    def split(tree: PyTree) -> list[Any]:
        try:
            return treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"The accumulator structure {treedef} is not a pytree prefix of fun's output "
                f"structure {jax.tree.structure(tree)}; give one accumulator, or a tree that "
                "matches the output down to where each accumulator applies."
            ) from err

    def each(fn: Callable[..., Any], *trees: PyTree) -> PyTree:
        parts = [split(t) for t in trees]
        return treedef.unflatten([fn(a, *p) for a, *p in zip(accs, *parts, strict=True)])

    return Accumulator(
        init=lambda tree: each(lambda a, t: a.init(t), tree),
        update=lambda carry, tree, i: each(lambda a, c, t: a.update(c, t, i), carry, tree),
        finalize=lambda carry: each(lambda a, c: a.finalize(c), carry),
        aggregate=lambda tree: each(lambda a, t: a.aggregate(t), tree),
    )
