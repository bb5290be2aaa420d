"""How microbatch results are combined: ``AccumulationType``, ``Accumulator`` and the built-ins.

The built-in reductions accumulate floating results narrower than 32 bits in float32 (or
in ``accumulation_dtype``) and give back ``fun``'s dtype; the wider carry travels as a
``_layout.Open`` reduction until the loop closes it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _layout, _sharding
from ._layout import Open, is_open
from ._typing import PyTree, PyTreeFn, UpdateFn


class AccumulationType(enum.Enum):
    """The built-in ways to combine microbatch results.

    >>> AccumulationType.SUM
    <AccumulationType.SUM: 2>
    """

    MEAN = 1
    """The sum of the microbatch results divided by the number of microbatches (NaN for
    an empty batch). With a remainder each microbatch counts for its rows, and with
    ``example_weights`` the result is ``sum(w * y) / sum(w)``."""
    SUM = 2
    """The sum of the microbatch results."""
    RUNNING_MEAN = 3
    """The mean of the microbatch results that ran (see ``num_real_microbatches``), 0
    when none ran (as in optax); weighted as MEAN is."""
    CONCAT = 4
    """The microbatch results joined along axis 0, in the original row order."""
    MAX = 5
    """The elementwise maximum of the results (for floats -inf, for integers their least
    value, when there are none)."""
    MIN = 6
    """The elementwise minimum of the results (inf, or the integers' greatest value, when
    there are none)."""


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

    def __post_init__(self) -> None:
        for field in ("init", "update", "finalize", "aggregate"):
            value = getattr(self, field)
            if not callable(value):
                raise TypeError(
                    f"Accumulator.{field} must be callable, got {field}={value!r}; see the "
                    "Accumulator docstring for what each function receives."
                )


def accumulation_dtype(dtype: Any, requested: Any) -> Any:
    """The dtype a built-in reduction accumulates ``dtype`` in.

    Floating dtypes narrower than 32 bits widen to float32 unless ``requested`` names
    another floating dtype; integer, boolean and complex results keep their own.
    """
    if not jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(dtype)
    if requested is not None:
        return jnp.dtype(requested)
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else jnp.dtype(dtype)


def _reduction(
    how: str,
    step: Callable[[Any, Any, Any], Any],
    finish: Callable[[Any], Any],
    requested: Any,
    kind: str | None = None,
    mesh_axes: tuple[str, ...] | None = None,
) -> Accumulator:
    """A built-in reduction: ``step`` folds a result into the carry, ``finish`` ends it.

    Both see plain arrays in the accumulation dtype; open reductions are unwrapped and
    wrapped again around them. ``kind`` names a reduction that needs floating results.
    """

    extremum = how in _layout.EXTREMA

    def init(s: Any, path: str = "", several: bool = False) -> Any:
        if is_open(s):
            fill = _layout.identity(how, s.value.dtype) if extremum else 0
            return Open(_sharding.full(s.value, fill), s.dtype, s.merge)
        _check_inexact(kind, s, path, several)
        if extremum:  # exact in any dtype
            return _sharding.full(s, _layout.identity(how, s.dtype))
        wide = accumulation_dtype(s.dtype, requested)
        zeros = _sharding.full(s, 0, wide)
        return zeros if wide == s.dtype else Open(zeros, s.dtype)

    def update(c: Any, x: Any, i: Any) -> Any:
        _check_same_shape(how, c, x)
        if is_open(c):
            new = step(c.value, _layout.value(x).astype(c.value.dtype), i)
            return Open(new, c.dtype, c.merge)
        return step(c, x, i).astype(c.dtype)

    def finalize(c: Any) -> Any:
        if is_open(c):
            return Open(finish(c.value), c.dtype, c.merge)
        return finish(c).astype(c.dtype)

    def aggregate(x: Any) -> Any:
        dtype = _layout.reduced_dtype(x, how)
        wide = dtype if extremum else accumulation_dtype(dtype, requested)
        return _layout.reduce_rows(x, how, wide, dtype, mesh_axes)

    return Accumulator(
        init=lambda tree: _with_paths(init, tree),
        update=lambda carry, tree, i: jax.tree.map(
            lambda c, x: update(c, x, i), carry, tree, is_leaf=is_open
        ),
        finalize=lambda carry: jax.tree.map(finalize, carry, is_leaf=is_open),
        aggregate=lambda tree: jax.tree.map(aggregate, tree),
    )


def _check_same_shape(how: str, carry: Any, x: Any) -> None:
    """A reduction over microbatches needs one result shape; only the remainder, which
    ``microbatch`` runs alone, can bring another."""
    have, got = jnp.shape(_layout.value(carry)), jnp.shape(_layout.value(x))
    if have != got:
        raise ValueError(
            f"fun returned a leaf of shape {got} on the last, partial microbatch but "
            f"{have} on the others, and a {how.upper()} accumulator needs one shape: with "
            "allow_remainder a result with a row per example is not reduced across "
            "microbatches. Reduce over the rows inside fun (e.g. jnp.sum), or accumulate "
            "that output with AccumulationType.CONCAT."
        )


def _with_paths(init: Callable[..., Any], tree: Any) -> Any:
    """``init`` of each leaf of ``tree``, told the leaf's path in it and whether the tree
    has several leaves (for ``_check_inexact``'s message)."""
    several = len(jax.tree.leaves(tree, is_leaf=is_open)) > 1
    return jax.tree_util.tree_map_with_path(
        lambda path, s: init(s, jax.tree_util.keystr(path), several), tree, is_leaf=is_open
    )


def _check_inexact(kind: str | None, x: Any, path: str = "", several: bool = False) -> None:
    """Means of integers or booleans would change the result's type: refuse them."""
    if kind is not None and not jnp.issubdtype(x.dtype, jnp.inexact):
        where = f" at {path}" if path else ""
        message = (
            f"AccumulationType.{kind} needs floating-point results, but fun returned a leaf"
            f"{where} of dtype {x.dtype} and shape {x.shape}; cast it to a float dtype inside "
            "fun, or accumulate it with AccumulationType.SUM."
        )
        if several:
            message += (
                f" fun returns several outputs, and one accumulator applies to all of them: "
                f"give each its own, e.g. accumulator=(AccumulationType.{kind}, "
                "AccumulationType.SUM) for a (loss, aux) pair. If that pair is a loss and "
                "its auxiliary data, its gradient is jax.grad(..., has_aux=True) of the "
                "microbatched function (without has_aux, jax.grad refuses a pair)."
            )
        raise ValueError(message)


def sum_(requested: Any = None, mesh_axes: tuple[str, ...] | None = None) -> Accumulator:
    """Sums the results."""
    return _reduction("sum", lambda c, x, i: c + x, lambda c: c, requested, None, mesh_axes)


@dataclasses.dataclass(frozen=True)
class Weighting:
    """How much each microbatch counts in MEAN and RUNNING_MEAN, when not all count alike.

    Attributes:
      per_microbatch: The weight of each microbatch: its rows, or the sum of its examples'
        ``example_weights``.
      total: The sum of ``per_microbatch``.
      presummed: Whether a result arrives as the weighted sum over its rows (``micro_vmap``
        and ``micro_grad``), or as ``fun``'s value on the microbatch, a mean over its rows
        that counts ``per_microbatch[i]`` times (``microbatch``).
    """

    per_microbatch: jax.Array
    total: jax.Array
    presummed: bool

    def scaled(self, x: jax.Array, i: Any) -> jax.Array:
        """Result ``x`` of microbatch ``i`` as a weighted sum over its rows."""
        return x if self.presummed else x * self.per_microbatch[i].astype(x.dtype)


def mean(
    num_microbatches: int,
    requested: Any = None,
    mesh_axes: tuple[str, ...] | None = None,
    weighting: Weighting | None = None,
) -> Accumulator:
    """Sums, then divides by ``num_microbatches`` (NaN when there are none), or by the
    total weight of a ``weighting``."""
    if weighting is None:
        step = lambda c, x, i: c + x  # noqa: E731
        divisor = lambda dtype: jnp.asarray(num_microbatches, dtype)  # noqa: E731
    else:
        step = lambda c, x, i: c + weighting.scaled(x, i)  # noqa: E731
        divisor = lambda dtype: weighting.total.astype(dtype)  # noqa: E731
    return _reduction("mean", step, lambda c: c / divisor(c.dtype), requested, "MEAN", mesh_axes)


def running_mean(
    num_microbatches: int,
    requested: Any = None,
    mesh_axes: tuple[str, ...] | None = None,
    weighting: Weighting | None = None,
) -> Accumulator:
    """The mean of the results so far: 0 until the first (and for an empty batch).

    The update ``c * (i / (i + 1)) + x / (i + 1)`` never forms ``x - c``, which
    overflows when the two have opposite signs near the dtype's maximum. With a
    ``weighting``, ``i`` and ``1`` become the weight so far and the microbatch's weight;
    microbatches of weight 0 leave the mean as it is.
    """

    def step(c: jax.Array, x: jax.Array, i: Any) -> jax.Array:
        if weighting is None:
            count = jnp.asarray(i + 1, c.dtype)
            return jnp.where(i == 0, x, c * ((count - 1) / count) + x / count)
        before = jnp.cumsum(weighting.per_microbatch)[i] - weighting.per_microbatch[i]
        before = before.astype(c.dtype)
        after = before + weighting.per_microbatch[i].astype(c.dtype)
        safe = jnp.where(after == 0, 1, after)
        moved = c * (before / safe) + weighting.scaled(x, i) / safe
        return jnp.where(after == 0, c, moved)

    def finish(c: jax.Array) -> jax.Array:
        return c

    return _reduction("mean", step, finish, requested, "RUNNING_MEAN", mesh_axes)


def extremum(how: str, mesh_axes: tuple[str, ...] | None = None) -> Accumulator:
    """The elementwise maximum (``how="max"``) or minimum of the results."""
    fold = jnp.maximum if how == "max" else jnp.minimum
    return _reduction(how, lambda c, x, i: fold(c, x), lambda c: c, None, None, mesh_axes)


def concat(num_microbatches: int, remainder: int = 0, microbatch_size: int = 0) -> Accumulator:
    """Interleaves the results back into batch order.

    Result ``i`` (``k`` rows) goes to column ``i`` of a ``(k, n, ...)`` buffer, whose
    row-major merge of the first two axes puts its row ``j`` at ``j * n + i``: the row
    microbatch ``i`` read from the batch. A scalar result is stored at index ``i``. The
    buffer is built from a zero result, so it keeps the result's sharding.

    With a ``remainder``, the last column holds the last microbatch, the last rows of the
    batch, zero-padded: the other columns merge as above and its rows follow them.
    """
    n = num_microbatches
    full = n - (remainder > 0)
    # The rows of the last result: ``remainder`` when results have a row per example,
    # else what the last update brings (``microbatch`` calls fun on the remainder alone).
    tail: dict[str, int] = {}

    def init(s: Any) -> jax.Array:
        if not s.shape:
            return jnp.zeros((n,), s.dtype)
        zeros = jnp.expand_dims(_sharding.full(s, 0), 1)
        return jnp.broadcast_to(zeros, (s.shape[0], n, *s.shape[1:]))

    def update(carry: jax.Array, x: jax.Array, i: Any) -> jax.Array:
        if remainder and x.ndim and isinstance(i, int) and i == full:  # the remainder alone
            if x.shape[0] > carry.shape[0]:
                raise ValueError(
                    f"CONCAT got {x.shape[0]} rows from fun on the last {remainder} rows of "
                    f"the batch, more than the {carry.shape[0]} of a whole microbatch; with "
                    "allow_remainder, fun's CONCAT outputs may not have more rows on fewer "
                    "inputs."
                )
            tail["rows"] = x.shape[0]
            padding = [(0, carry.shape[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
            x = jnp.pad(x, padding)
        axis = 1 if x.ndim else 0
        return jax.lax.dynamic_update_index_in_dim(carry, x.astype(carry.dtype), i, axis)

    def finalize(carry: jax.Array) -> jax.Array:
        if carry.ndim == 1:
            return carry
        if not remainder:
            return carry.reshape(carry.shape[0] * carry.shape[1], *carry.shape[2:])
        head = carry[:, :full].reshape(carry.shape[0] * full, *carry.shape[2:])
        rows = tail.get("rows", remainder * carry.shape[0] // max(microbatch_size, 1))
        return jnp.concatenate([head, carry[:rows, full]])

    return Accumulator(
        init=lambda tree: jax.tree.map(init, tree),
        update=lambda carry, tree, i: jax.tree.map(lambda c, x: update(c, x, i), carry, tree),
        finalize=lambda carry: jax.tree.map(finalize, carry),
        aggregate=lambda tree: tree,
    )


@dataclasses.dataclass(frozen=True)
class Split:
    """How a batch splits into microbatches, for the built-in accumulators.

    Attributes:
      num_microbatches: How many microbatches, the last one partial if ``remainder``.
      remainder: The rows of the partial microbatch (0: none).
      microbatch_size: The rows of the others.
      weighting: The microbatches' weights where they differ (a remainder, or
        ``example_weights``); None when every microbatch counts alike.
    """

    num_microbatches: int
    remainder: int = 0
    microbatch_size: int = 0
    weighting: Weighting | None = None


@dataclasses.dataclass(frozen=True)
class PerShard:
    """How the loop per shard computes a kind (``_fsdp``): each device folds its own rows
    of every microbatch, then one collective per leaf combines the devices.

    Attributes:
      fold: The kind each device folds its rows with: a MEAN is a SUM until the devices
        combine, then divided by the whole batch's rows or weight (as every kind whose
        ``Kind.rows`` is ``"mean"``).
      collective: Combines the devices' folds over the batch's mesh axes (``psum``,
        ``pmax``, ``pmin``); None leaves them split by rows, as the batch is (CONCAT).
    """

    fold: AccumulationType
    collective: Callable[[Any, tuple[str, ...]], Any] | None


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one ``AccumulationType`` means, in one place.

    Attributes:
      rows: How the rows of one microbatch combine: ``"sum"``, ``"mean"``, ``"max"`` or
        ``"min"``; None keeps them (CONCAT).
      linear: Whether the kind commutes with sums over examples, so that a sum of
        per-example results may be formed by other means (``micro_grad``'s summed
        gradient). A microbatch then contributes the sum of its rows, divided by its
        rows where ``rows`` is ``"mean"``.
      build: The accumulator over microbatches, from the split, the accumulation dtype
        and the mesh axes the rows are sharded over.
      per_shard: How the loop per shard computes it; None where that loop does not
        (RUNNING_MEAN, whose carry is a mean so far, not a sum the devices could add),
        and the call runs on the global arrays.
    """

    rows: str | None
    linear: bool
    build: Callable[[Split, Any, Any], Accumulator]
    per_shard: PerShard | None


KINDS: dict[AccumulationType, Kind] = {
    AccumulationType.SUM: Kind(
        "sum",
        True,
        lambda split, dtype, axes: sum_(dtype, axes),
        PerShard(AccumulationType.SUM, jax.lax.psum),
    ),
    AccumulationType.MEAN: Kind(
        "mean",
        True,
        lambda split, dtype, axes: mean(split.num_microbatches, dtype, axes, split.weighting),
        PerShard(AccumulationType.SUM, jax.lax.psum),
    ),
    AccumulationType.RUNNING_MEAN: Kind(
        "mean",
        True,
        lambda split, dtype, axes: running_mean(
            split.num_microbatches, dtype, axes, split.weighting
        ),
        None,
    ),
    AccumulationType.MAX: Kind(
        "max",
        False,
        lambda split, dtype, axes: extremum("max", axes),
        PerShard(AccumulationType.MAX, jax.lax.pmax),
    ),
    AccumulationType.MIN: Kind(
        "min",
        False,
        lambda split, dtype, axes: extremum("min", axes),
        PerShard(AccumulationType.MIN, jax.lax.pmin),
    ),
    AccumulationType.CONCAT: Kind(
        None,
        False,
        lambda split, dtype, axes: concat(
            split.num_microbatches, split.remainder, split.microbatch_size
        ),
        PerShard(AccumulationType.CONCAT, None),
    ),
}


def _foreign(leaf: Any) -> Any:
    """An optax.microbatching accumulator leaf, as ours (optax is never imported)."""
    kind = type(leaf)
    if not kind.__module__.startswith("optax"):
        return None
    if (
        kind.__name__ == "AccumulationType"
        and getattr(leaf, "name", None) in AccumulationType.__members__
    ):
        return AccumulationType[leaf.name]
    if kind.__name__ == "Accumulator":
        return Accumulator(leaf.init, leaf.update, leaf.finalize, leaf.aggregate)
    return None


def _is_spec(x: Any) -> bool:
    return isinstance(x, Accumulator | AccumulationType) or _foreign(x) is not None


def ensure_tree(accumulator: Any) -> Any:
    """Wrap-time check: every leaf is an AccumulationType or an Accumulator (ours or optax's).

    Returns the tree with optax's leaves replaced by ours.
    """

    if not jax.tree.leaves(accumulator, is_leaf=_is_spec):
        raise TypeError(
            f"accumulator must be an AccumulationType, an Accumulator or a pytree of them, "
            f"got {accumulator=}; e.g. accumulator=AccumulationType.SUM."
        )

    def ensure(leaf: Any) -> Any:
        if isinstance(leaf, Accumulator | AccumulationType):
            return leaf
        ours = _foreign(leaf)
        if ours is None:
            raise TypeError(
                f"accumulator leaves must be AccumulationType or Accumulator, got {leaf!r} of "
                f"type {type(leaf).__name__}; e.g. accumulator=AccumulationType.SUM."
            )
        return ours

    return jax.tree.map(ensure, accumulator, is_leaf=_is_spec)


def combine(
    accumulator: Any,
    layout: int | Split,
    requested: Any = None,
    mesh_axes: tuple[str, ...] | None = None,
) -> Accumulator:
    """One Accumulator for a whole output, from a pytree prefix of per-subtree specs.

    ``layout`` is the number of microbatches, or how the batch splits; ``requested`` the
    ``accumulation_dtype`` of the built-in reductions; ``mesh_axes`` the mesh axes the
    rows are sharded over, where the types do not say (Auto meshes).
    """
    layout = layout if isinstance(layout, Split) else Split(layout)
    specs, treedef = jax.tree.flatten(accumulator, is_leaf=_is_spec)
    accs = [
        s if isinstance(s, Accumulator) else KINDS[s].build(layout, requested, mesh_axes)
        for s in specs
    ]

    def each(fn: Callable[..., Any], *trees: PyTree) -> PyTree:
        parts = [_split(treedef, t) for t in trees]
        return treedef.unflatten([fn(a, *p) for a, *p in zip(accs, *parts, strict=True)])

    return Accumulator(
        init=lambda tree: each(lambda a, t: a.init(t), tree),
        update=lambda carry, tree, i: each(lambda a, c, t: a.update(c, t, i), carry, tree),
        finalize=lambda carry: each(lambda a, c: a.finalize(c), carry),
        aggregate=lambda tree: each(lambda a, t: a.aggregate(t), tree),
    )


def _split(treedef: Any, tree: PyTree, of: str = "fun's output") -> list[Any]:
    """``tree`` cut into the subtrees that the accumulator tree's leaves apply to; a
    ``ValueError`` naming both structures and what ``tree`` is (``of``) where it cannot."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"The accumulator structure {treedef} is not a pytree prefix of the structure "
            f"of {of}, {jax.tree.structure(tree)}; give one accumulator, or a tree that "
            "matches the output down to where each accumulator applies."
        ) from err


def check_prefix(accumulator: Any, tree: PyTree, of: str) -> None:
    """Raises ``_split``'s error where the accumulator tree is not a prefix of ``tree``
    (``of`` says what it is, for the message)."""
    _, treedef = jax.tree.flatten(accumulator, is_leaf=_is_spec)
    _split(treedef, tree, of)


def kinds(accumulator: Any) -> list[AccumulationType | Accumulator]:
    """The leaves of an accumulator tree (checked by ``ensure_tree``), in order."""
    return jax.tree.leaves(accumulator, is_leaf=_is_spec)


def is_custom(accumulator: Any) -> bool:
    """Whether any leaf is an ``Accumulator`` rather than a built-in."""
    return any(isinstance(leaf, Accumulator) for leaf in kinds(accumulator))


def weighted_aggregate(
    accumulator: Any,
    tree: PyTree,
    weights: jax.Array,
    requested: Any = None,
    mesh_axes: tuple[str, ...] | None = None,
) -> PyTree:
    """A microbatch's aggregate of per-example results under ``example_weights``.

    SUM, MEAN and RUNNING_MEAN give ``sum(w_b * x_b)`` (the loop divides means by the
    weights); MAX and MIN skip rows of weight 0; CONCAT gives the rows, zero where the
    weight is 0. Rows of weight 0 are selected away, never multiplied, so a NaN in them
    does not reach the result.
    """
    specs, treedef = jax.tree.flatten(accumulator, is_leaf=_is_spec)
    parts = _split(treedef, tree)
    keep = weights if weights.dtype == jnp.bool_ else weights != 0

    def one(kind: Any, x: jax.Array) -> Any:
        mask = jnp.reshape(keep, (-1,) + (1,) * (jnp.ndim(x) - 1))
        how = KINDS[kind].rows
        if how is None:
            return jnp.where(mask, x, jnp.zeros((), x.dtype))
        if how in _layout.EXTREMA:
            rows = jnp.where(mask, x, jnp.asarray(_layout.identity(how, x.dtype), x.dtype))
            return _layout.reduce_rows(rows, how, x.dtype, x.dtype, mesh_axes)
        dtype = _layout.reduced_dtype(x, how)
        if jnp.issubdtype(weights.dtype, jnp.floating) and not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(weights.dtype, jnp.float32)  # integers by floats: floats
        wide = accumulation_dtype(dtype, requested)
        rows = x.astype(wide)
        if weights.dtype != jnp.bool_:
            rows = rows * jnp.reshape(weights, mask.shape).astype(wide)
        rows = jnp.where(mask, rows, jnp.zeros((), wide))
        return _layout.reduce_rows(rows, "sum", wide, dtype, mesh_axes)

    out = []
    for kind, part in zip(specs, parts, strict=True):
        if isinstance(kind, Accumulator):
            raise TypeError(
                "example_weights needs built-in accumulators, but the accumulator tree has a "
                "custom Accumulator, which cannot know the weights; weight the examples "
                "inside fun, or use AccumulationType members for the outputs."
            )
        out.append(jax.tree.map(functools.partial(one, kind), part))
    return treedef.unflatten(out)


def is_linear(accumulator: Any) -> bool:
    """Whether every leaf is a built-in kind that commutes with sums (``Kind.linear``)."""
    return all(isinstance(k, AccumulationType) and KINDS[k].linear for k in kinds(accumulator))


def averages_rows(accumulator: Any) -> bool:
    """Whether every leaf is a built-in kind whose microbatch result is the mean of its
    rows (MEAN, RUNNING_MEAN): ``per_row`` divides all of them by the rows."""
    return all(
        isinstance(k, AccumulationType) and KINDS[k].rows == "mean" for k in kinds(accumulator)
    )


def per_row(accumulator: Any, sums: PyTree, rows: int) -> PyTree:
    """A microbatch's aggregate from the sum of its rows: divided by ``rows`` for means."""
    specs, treedef = jax.tree.flatten(accumulator, is_leaf=_is_spec)
    parts = _split(treedef, sums)
    factor = 1 / rows if rows else float("nan")  # the mean of no rows
    scaled = [
        part
        if KINDS[spec].rows == "sum"
        else jax.tree.map(lambda x: _scale(x, factor), part, is_leaf=is_open)
        for spec, part in zip(specs, parts, strict=True)
    ]
    return treedef.unflatten(scaled)


def _scale(x: Any, factor: float) -> Any:
    if is_open(x):
        return Open(x.value * jnp.asarray(factor, x.value.dtype), x.dtype, x.merge)
    return x * jnp.asarray(factor, x.dtype)
