"""Per-example gradients for ``micro_grad``, one microbatch at a time.

Two ways to compute a microbatch's contribution:

- ``per_example``: each example's gradient, clipped and transformed, then aggregated.
  This is what a ``transform_fn`` or a custom accumulator needs.
- ``summed``: when the transform is the identity and the accumulation is a sum or a
  mean, the aggregate of the per-example gradients is the gradient of the summed loss,
  one backward pass with matrix products instead of one per example. That equality
  holds only where ``_summed_is_exact`` proves it for the call's traced loss; elsewhere
  ``summed`` forms the per-example gradients (``explicit``). With clipping (or
  ``metrics_fn=l2_norm``) it takes the method of ``clip_method``: ``ghost`` reads the
  norms off the traced program and sums by book-keeping (``_ghost``); ``two_pass`` and
  ``chunked`` scale each example's loss by its clip factor, held fixed, and take the
  gradient of the weighted sum; ``materialize`` is ``explicit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _accumulators, _clipping, _ghost, _layout, _programs, _vmap
from ._inspect import ClippingReport, LeafRule
from ._signature import BatchAxes
from ._typing import Function, PyTree
from ._wrap import Settings


class Aux(NamedTuple):
    """Per-example outputs of a ``micro_grad`` function, each stacked on axis 0.

    Attributes:
      values: The value of ``fun`` for each example.
      metrics: ``metrics_fn`` of each example's gradient.
      aux: The auxiliary output of ``fun`` for each example (None without ``has_aux``).

    >>> Aux(values=1.0, metrics=None, aux=None).values
    1.0
    """

    values: PyTree
    metrics: PyTree
    aux: PyTree


class _Default:
    """A default function argument that ``help()`` shows by name."""

    def __init__(self, fn: Callable[[PyTree], PyTree], name: str) -> None:
        self._fn, self._name = fn, name

    def __call__(self, tree: PyTree) -> PyTree:
        return self._fn(tree)

    def __repr__(self) -> str:
        return self._name


identity = _Default(lambda tree: tree, "identity")
"""``micro_grad``'s default ``transform_fn``: the gradient unchanged."""
no_metrics = _Default(lambda tree: None, "no_metrics")
"""``micro_grad``'s default ``metrics_fn``: no per-example metrics (None)."""


@dataclasses.dataclass(frozen=True)
class Examples:
    """One example's loss and gradient, as ``micro_grad`` calls ``fun``."""

    fun: Function
    axes: BatchAxes
    argnums: int | tuple[int, ...]
    has_aux: bool
    keep_batch_dim: bool

    def expand(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """With ``keep_batch_dim``, each batch argument as a batch of one example.

        Only ``batch_argnums`` are expanded, by position or by keyword, as optax does;
        keyword-only and extra keyword arguments are mapped but not expanded.
        """
        if not self.keep_batch_dim:
            return args, kwargs

        def one(where: int | str, value: Any) -> Any:
            position = self.axes.position(where)
            if position is None or self.axes.spec(where) is None:
                return value
            return jax.tree.map(lambda x: x[None], value)

        args = tuple(one(i, a) for i, a in enumerate(args))
        return args, {k: one(k, v) for k, v in kwargs.items()}

    def loss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``(value, aux)`` of one example (aux None without ``has_aux``)."""
        args, kwargs = self.expand(args, kwargs)
        return self._loss(*args, **kwargs)

    def _loss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = self.fun(*args, **kwargs)
        pair = isinstance(out, tuple | list)
        if self.has_aux and not (pair and len(out) == 2):
            got = f"a {type(out).__name__} of {len(out)}" if pair else _describe(out)
            raise TypeError(
                f"micro_grad was given has_aux=True, so fun must return a pair (loss, aux), "
                f"but it returned {got}; return (loss, aux), or pass has_aux=False."
            )
        if not self.has_aux and pair:
            raise TypeError(
                f"micro_grad needs fun to return a scalar loss, but it returned a "
                f"{type(out).__name__} of {len(out)}; if fun returns (loss, aux), pass "
                "has_aux=True."
            )
        value, aux = out if self.has_aux else (out, None)
        if not isinstance(value, jax.Array | np.ndarray | np.generic | int | float):
            first = " (the first of the pair, with has_aux=True)" if self.has_aux else ""
            raise TypeError(
                f"micro_grad needs fun to return a scalar loss{first}, but it is "
                f"{_describe(value)}; return the loss as a scalar array"
                f"{', then aux: (loss, aux)' if self.has_aux else ''}."
            )
        value = jnp.asarray(value)
        if value.ndim != 0:
            raise TypeError(
                "micro_grad needs fun to return a scalar loss per example, but it returned "
                f"shape {value.shape} for each; reduce it to a scalar in fun."
            )
        return value, aux

    def check_differentiable(self, args: tuple[Any, ...]) -> None:
        """Raises a TypeError with a fix for a non-array leaf in a differentiated argument."""
        for i in self.nums():
            if i >= len(args):
                continue
            name = self.axes.label(i)
            for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
                if not isinstance(leaf, jax.Array | np.ndarray | np.generic | float | complex):
                    raise TypeError(
                        f"micro_grad differentiates `{name}` (argnums={self.argnums}), but its "
                        f"leaf `{name}{jax.tree_util.keystr(path)}` is {leaf!r} of type "
                        f"{type(leaf).__name__}, not a float array. Split the non-array parts "
                        "out and pass them separately: with Equinox, `params, static = "
                        "eqx.partition(model, eqx.is_inexact_array)` and `eqx.combine(params, "
                        "static)` inside the loss; with Flax NNX, `graphdef, state = "
                        "nnx.split(model)`; or bind them with functools.partial."
                    )

    def value_and_grad(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], PyTree]:
        """One example's ``((value, aux), gradient)``, with respect to the expanded
        arguments (a batch argument in ``argnums`` gets a gradient of shape ``(1, ...)``)."""
        args, kwargs = self.expand(args, kwargs)
        return jax.value_and_grad(self._loss, self.argnums, has_aux=True)(*args, **kwargs)

    def nums(self) -> tuple[int, ...]:
        return (self.argnums,) if isinstance(self.argnums, int) else self.argnums


METHODS = ("auto", "ghost", "two_pass", "chunked", "materialize")
"""How ``micro_grad`` may compute clipped sums and per-example norms; see its docstring."""


def l2_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of a pytree of arrays, over all its leaves, without overflow.

    As ``metrics_fn`` of ``micro_grad`` it gives each example's gradient norm, and with
    the default ``transform_fn`` and SUM or MEAN these norms come from the traced
    program without forming the per-example gradients.

    >>> import jax.numpy as jnp
    >>> float(l2_norm({"w": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)}))
    5.0
    """
    return _clipping.norm(tree)


def per_example(
    example: Examples,
    clipping: _clipping.Clipping | None,
    transform: Callable[[PyTree], PyTree],
    metrics: Callable[[PyTree], PyTree],
) -> Function:
    """One example's ``(transform(clipped gradient), Aux)``, to be mapped."""

    def one(*args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        with jax.named_scope("micro_grad_step"):
            (value, aux), grads = example.value_and_grad(*args, **kwargs)
            measured = metrics(grads)
            if clipping is not None:
                grads = clipping.clip(grads)
            return transform(grads), Aux(value, measured, aux)

    return one


def summed(
    example: Examples,
    accumulators: Any,
    clipping: _clipping.Clipping | None,
    metrics: Callable[[PyTree], PyTree] | None,
    settings: Settings,
    method: str,
) -> Function:
    """A microbatch's summed (or averaged) gradient and its per-example ``Aux``.

    On a sharded batch each shard sums its own rows, and the partial sums stay open, one
    per shard, until the loop ends.
    """
    requested, mesh_axes = settings.accumulation_dtype, settings.mesh_axes
    losses = _vmap.vmapped(example.loss, example.axes, jax.vmap)
    each = _vmap.vmapped(example.value_and_grad, example.axes, jax.vmap)
    norms_only = metrics is l2_norm
    by_seed = (
        clipping is None
        and metrics is None
        and method == "auto"
        and _accumulators.averages_rows(accumulators)
    )

    def statistics(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        grads = each(*args, **kwargs)[1]
        measured = None if metrics is None else jax.vmap(metrics)(grads)
        if clipping is None:
            return measured, None
        rows = first_batched(example.axes, args, kwargs).shape[0]
        scale = clipping.per_leaf(_clipping.leaf_norms(grads, rows), grads)
        return measured, scale[0] if scale else jnp.ones((rows,))

    def averaged(given: Any, *args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        """``rows``, divided by the rows where the accumulators average them (no weights)."""
        if given is not None:  # weighted sums: the loop divides means by the weights
            return rows(given, *args, **kwargs)
        count = first_batched(example.axes, args, kwargs).shape[0]
        exact = count and by_seed
        if exact and _summed_is_exact(example, losses, requested, True, args, kwargs):
            # The mean's 1/rows seeds the backward pass, rather than scaling its result:
            # XLA then adds an embedding's scattered gradient into the carry in place,
            # where a scaled one took a copy of the table and 2.5x the time.
            return rows_seeded(1 / count, None, *args, **kwargs)
        grads, aux = rows(None, *args, **kwargs)
        return _accumulators.per_row(accumulators, grads, count), aux

    def rows(given: Any, *args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        return rows_seeded(None, given, *args, **kwargs)

    def rows_seeded(
        seed: float | None, given: Any, *args: Any, **kwargs: Any
    ) -> tuple[PyTree, Aux]:
        """A microbatch's summed gradient and ``Aux``; with ``seed``, the gradient of the
        summed loss scaled by it (the mean's 1 / rows, where the backward pass is linear)."""
        scaled = clipping is not None or given is not None
        wanted = (clipping is not None or norms_only) and (metrics is None or norms_only)
        if not first_batched(example.axes, args, kwargs).shape[0]:
            return explicit(given, *args, **kwargs)  # an empty batch: nothing to read
        if wanted and method in ("auto", "ghost"):
            out = ghost(example, clipping, norms_only, requested, given, args, kwargs, method)
            if not isinstance(out, str):
                return out
            if method == "ghost":
                raise ValueError(_NO_GHOST.format(method=method, reason=out))
            if out == _CHEAPER:
                return explicit(given, *args, **kwargs)
        if seed is None and (
            method == "materialize"
            or not _summed_is_exact(example, losses, requested, scaled, args, kwargs)
        ):
            if method in ("two_pass", "chunked"):
                raise ValueError(_NOT_LINEAR.format(method=method))
            return explicit(given, *args, **kwargs)
        measured, factors = None, None
        if method == "two_pass":
            norms = ghost_norms(example, requested, args, kwargs)
            if isinstance(norms, str):
                raise ValueError(_NO_GHOST.format(method=method, reason=norms))
            if clipping is not None:
                factors = clipping.per_leaf(norms, [args[i] for i in example.nums()])[0]
            measured = _clipping.row_norms(norms, norms.shape[0]) if norms_only else None
        elif clipping is not None or metrics is not None:
            # The factors depend on the parameters, but as values closed over by ``total``
            # the gradient below holds them fixed; outer derivatives still see them.
            measured, factors = _in_chunks(statistics, example, args, kwargs)

        def total(*args: Any, **kwargs: Any) -> tuple[jax.Array, tuple[Any, Any]]:
            values, aux = losses(*args, **kwargs)
            weighted = values if factors is None else values * factors.astype(values.dtype)
            if seed is not None:
                weighted = weighted * jnp.asarray(seed, values.dtype)
            if given is not None:  # selected, so that a NaN of a weight-0 row cannot leak
                if given.dtype != jnp.bool_:
                    weighted = weighted * given.astype(values.dtype)
                weighted = jnp.where(given != 0, weighted, jnp.zeros((), values.dtype))
            return jnp.sum(weighted), (values, aux)

        (_, (values, aux)), grads = jax.value_and_grad(total, example.argnums, has_aux=True)(
            *args, **kwargs
        )
        out = Aux(values, measured, aux)
        if given is not None:
            keep = given != 0
            out = jax.tree.map(lambda x: _masked(x, keep), out)
            grads = jax.tree.map(lambda g: jnp.where(jnp.any(keep), g, jnp.zeros_like(g)), grads)
        return grads, out

    def explicit(given: Any, *args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        """The same sums from the per-example gradients, each scaled by its clip factor
        and weight, and added up in the accumulation dtype."""
        (values, aux), grads = each(*args, **kwargs)
        rows = values.shape[0]
        measured = None if metrics is None else jax.vmap(metrics)(grads)
        leaves, structure = jax.tree.flatten(grads)
        scales = [jnp.ones((rows,), jnp.float32)] * len(leaves)
        if clipping is not None:
            scales = clipping.per_leaf(_clipping.leaf_norms(grads, rows), grads)
        keep = None if given is None else given != 0
        if given is not None and given.dtype != jnp.bool_:
            scales = [s * given.astype(jnp.promote_types(given.dtype, s.dtype)) for s in scales]

        def add(g: jax.Array, scale: jax.Array) -> _layout.Open:
            wide = _accumulators.accumulation_dtype(g.dtype, requested)
            shape = (rows,) + (1,) * (g.ndim - 1)
            g = _layout.rows_apart(g)  # see there: XLA:CPU sums such rows wrongly
            terms = g.astype(wide) * jnp.reshape(scale, shape).astype(wide)
            drop = jnp.reshape(scale == 0, shape)
            if keep is not None:  # selected, so that a NaN of a weight-0 row cannot leak
                drop = drop | ~jnp.reshape(keep, shape)
            terms = jnp.where(drop, jnp.zeros((), wide), terms)
            return _layout.Open(jnp.sum(terms, axis=0), g.dtype)

        out = Aux(values, measured, aux)
        if keep is not None:
            out = jax.tree.map(lambda x: _masked(x, keep), out)
        summed = [add(g, s) for g, s in zip(leaves, scales, strict=True)]
        return jax.tree.unflatten(structure, summed), out

    def per_microbatch(weights: Any, *args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        with jax.named_scope("micro_grad_step"):
            first = first_batched(example.axes, args, kwargs)
            where = _layout.shards(first, 0, mesh_axes)
            if where is None:
                grads, aux = averaged(weights, *args, **kwargs)
                grads = jax.tree.map(
                    lambda g: _open(g, requested, None), grads, is_leaf=_layout.is_open
                )
                return grads, aux
            else:
                grads, aux = _by_shard(rows, example.axes, where, weights, args, kwargs)
                grads = jax.tree.map(
                    lambda g: _open(g, requested, "sum", where), grads, is_leaf=_layout.is_open
                )
                aux = jax.tree.map(lambda x: _layout.unchunk(x, where), aux)
            if weights is not None:  # weighted sums: the loop divides means by the weights
                return grads, aux
            return _accumulators.per_row(accumulators, grads, first.shape[0]), aux

    return per_microbatch


@dataclasses.dataclass(frozen=True)
class _Split:
    """A call's arguments as the ghost norms read them: the parameter leaves, the batch
    leaves, and the loss as a function of both (one example)."""

    params: list[Any]
    structure: Any  # of the differentiated arguments, as a list
    data: list[Any]
    fun: Callable[[list[Any], list[Any]], list[Any]]
    aux: list[Any]  # the structure of aux, once traced

    def one_example(self) -> list[Any]:
        """The first example's leaves: what they are (types, sharding, varying manual
        axes) is what the trace of one example sees."""
        return [x[0] for x in self.data]

    def gradient(self, example: Examples, leaves: list[Any]) -> PyTree:
        grads = jax.tree.unflatten(self.structure, leaves)
        return grads[0] if isinstance(example.argnums, int) else tuple(grads)


def _split(example: Examples, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Split:
    nums = example.nums()
    params, structure = jax.tree.flatten([args[i] for i in nums])
    places = [
        w
        for w in [*range(len(args)), *kwargs]
        if example.axes.spec(w) is not None and w not in nums
    ]
    data, batch = jax.tree.flatten([args[w] if isinstance(w, int) else kwargs[w] for w in places])
    aux: list[Any] = []

    def fun(p: list[Any], d: list[Any]) -> list[Any]:
        full, named = list(args), dict(kwargs)
        for i, value in zip(nums, jax.tree.unflatten(structure, p), strict=True):
            full[i] = value
        for w, value in zip(places, jax.tree.unflatten(batch, d), strict=True):
            if isinstance(w, int):
                full[w] = value
            else:
                named[w] = value
        value, extra = example.loss(*full, **named)
        leaves, tree = jax.tree.flatten(extra)
        aux[:] = [tree]
        return [value, *leaves]

    return _Split(params, structure, data, fun, aux)


def _analyse(split: _Split, requested: Any) -> _ghost.Program | str:
    """The traced program of one example's loss, or why the ghost norms cannot read it."""
    if not all(jnp.issubdtype(jnp.result_type(p), jnp.inexact) for p in split.params):
        return "a differentiated leaf is not a float array"
    if not split.data or not split.data[0].shape[0]:
        return "the batch is empty"
    program = _ghost.analyse(split.fun, split.params, split.one_example())
    if program is None:
        return "the loss does not depend on the batch"
    for dtype in program.dtypes:
        wide = _accumulators.accumulation_dtype(dtype, requested)
        if jnp.finfo(wide).bits > jnp.finfo(dtype).bits:
            return f"it computes in {dtype}, narrower than its accumulation dtype {wide}"
    return program


def ghost_norms(
    example: Examples, requested: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> jax.Array | str:
    """``(rows, leaves)`` per-example norms of each parameter leaf, by the ghost norms."""
    split = _split(example, args, kwargs)
    program = _analyse(split, requested)
    if isinstance(program, str):
        return program
    seen = _ghost.record(program, split.params, split.data)
    return _ghost.leaf_norms(program, split.params, seen)


def ghost(
    example: Examples,
    clipping: _clipping.Clipping | None,
    norms_only: bool,
    requested: Any,
    given: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    method: str = "ghost",
) -> tuple[PyTree, Aux] | str:
    """The clipped (weighted) sum by book-keeping, with per-example values, aux and
    norms; or why the ghost norms cannot read this loss (``_CHEAPER`` where, with
    ``method="auto"``, forming the per-example gradients costs less)."""
    split = _split(example, args, kwargs)
    program = _analyse(split, requested)
    if isinstance(program, str):
        return program
    if method == "auto" and _ghost.materialize_cost(program) < _ghost.ghost_cost(program):
        return _CHEAPER
    seen = _ghost.record(program, split.params, split.data)
    norms = _ghost.leaf_norms(program, split.params, seen)
    rows = norms.shape[0]
    if clipping is not None:
        groups, bounds = clipping.groups(split.gradient(example, split.params))
        scale = clipping.factors(norms, groups, bounds)
    else:
        groups, scale = [0] * len(split.params), jnp.ones((rows, 1), jnp.float32)
    if given is not None:
        weights = given if given.dtype != jnp.bool_ else given.astype(scale.dtype)
        wide = jnp.promote_types(weights.dtype, scale.dtype)
        scale = jnp.where(given[:, None] != 0, scale.astype(wide) * weights[:, None], 0)
    clean = given is not None or (clipping is not None and clipping.nan_safe)
    sums = _ghost.clipped_sum(program, split.params, seen, scale, groups, clean)
    grads = split.gradient(example, sums)
    aux = jax.tree.unflatten(split.aux[0], seen.outs[1:])
    measured = _clipping.row_norms(norms, rows) if norms_only else None
    out = Aux(seen.outs[0], measured, aux)
    if given is not None:
        keep = given != 0
        out = jax.tree.map(lambda x: _masked(x, keep), out)
        grads = jax.tree.map(lambda g: jnp.where(jnp.any(keep), g, jnp.zeros_like(g)), grads)
    return grads, out


def describe(
    example: Examples,
    wanted: bool,
    is_summed: bool,
    method: str,
    requested: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    gradient_metrics: bool = False,
) -> ClippingReport:
    """What ``summed`` or ``per_example`` does for a call with these arguments (whole
    batch), as ``clipping_report`` shows it. ``gradient_metrics``: a ``metrics_fn``
    other than ``l2_norm``, which needs each example's gradient."""
    split = _split(example, args, kwargs)
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(split.gradient(example, split.params))[0]
    ]

    def each(rule: str, why: str) -> ClippingReport:
        leaves = tuple(
            LeafRule(path, tuple(jnp.shape(p)), rule, (), 0)
            for path, p in zip(paths, split.params, strict=True)
        )
        return ClippingReport(method if method != "auto" else rule, why, leaves)

    if not is_summed:
        why = "transform_fn, the accumulator or a batched argnums needs each example's gradient"
        return dataclasses.replace(each("per-example", why), method="materialize")
    if not wanted:
        return dataclasses.replace(each("unused", "no clipping and no norms"), method="plain")
    if method in ("chunked", "materialize"):
        return dataclasses.replace(each("per-example", "asked for"), method=method)

    def per_example_gradients(why: str) -> ClippingReport:
        """``rows`` without the ghost norms: chunked where the weighted loss is exact."""
        losses = _vmap.vmapped(example.loss, example.axes, jax.vmap)
        exact = _summed_is_exact(example, losses, requested, True, args, kwargs)
        return dataclasses.replace(
            each("per-example", why), method="chunked" if exact else "materialize"
        )

    if gradient_metrics:
        return per_example_gradients(
            "metrics_fn needs each example's gradient (metrics_fn=microbatching.l2_norm "
            "gives the norms without them)"
        )
    program = _analyse(split, requested)
    if isinstance(program, str):
        if method in ("ghost", "two_pass"):
            raise ValueError(_NO_GHOST.format(method=method, reason=program))
        return per_example_gradients(program)
    leaves = tuple(
        LeafRule(path, tuple(program.avals[leaf].shape), r.name, r.primitives, r.flops, r.form)
        for leaf, (path, r) in enumerate(zip(paths, program.rules, strict=True))
    )
    ghost, per_example = _ghost.ghost_cost(program), _ghost.materialize_cost(program)
    costs = (
        f"{ghost:,} flops of norms per example against {per_example:,} for per-example gradients"
    )
    if method == "auto" and per_example < ghost:
        return ClippingReport("materialize", f"{_CHEAPER}: {costs}", leaves)
    why = "asked for" if method != "auto" else "the ghost norms read this loss"
    return ClippingReport("ghost" if method == "auto" else method, f"{why}: {costs}", leaves)


_CHEAPER = "forming the per-example gradients costs less"

_NO_GHOST = (
    "micro_grad was given clip_method={method!r}, but the ghost norms cannot read this "
    "loss: {reason}. Pass clip_method='auto' to let micro_grad pick an exact method."
)
_NOT_LINEAR = (
    "micro_grad was given clip_method={method!r}, which takes the gradient of the loss "
    "weighted by the clip factors, but that gradient is not exactly the weighted sum of "
    "the per-example gradients here (a value narrower than its accumulation dtype, or a "
    "custom VJP that is not linear in its cotangent). Pass clip_method='auto' or "
    "'ghost'."
)


def _by_shard(
    rows: Function,
    axes: BatchAxes,
    where: _layout.Shards,
    weights: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``rows(weights, *args, **kwargs)`` on each shard's rows, the shards stacked on axis 0."""
    split = functools.partial(_layout.chunk, axis=0, where=where)
    arg_axes = tuple(None if axes.spec(i) is None else 0 for i in range(len(args)))
    kwarg_axes = {k: None if axes.spec(k) is None else 0 for k in kwargs}
    args = tuple(
        a if s is None else jax.tree.map(split, a) for a, s in zip(args, arg_axes, strict=True)
    )
    kwargs = {k: v if kwarg_axes[k] is None else jax.tree.map(split, v) for k, v in kwargs.items()}
    if weights is not None:
        weights = split(weights)
    spmd = None if where.explicit else where.entry
    mapped = jax.vmap(
        lambda w, a, k: rows(w, *a, **k),
        in_axes=(None if weights is None else 0, arg_axes, kwarg_axes),
        spmd_axis_name=spmd,
    )
    return mapped(weights, args, kwargs)


CHUNK_BYTES = 32 * 2**20
"""How many bytes of per-example gradients to form at once for their norms or metrics.

They are formed a chunk of rows at a time (``lax.map``), so memory holds at most this
much of them, and XLA:CPU runs faster on chunks that stay near its caches. Measured for
a 256-512-512-10 MLP (1.6 MB of gradient per example) at microbatch 256: 43 ms in chunks
of 16 rows against 130 ms at once; for a 64-256-10 MLP (76 kB) at microbatch 64, 9.8 ms
at once against 13.1 ms in chunks of 16.
"""


def _in_chunks(
    fn: Function,
    example: Examples,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``fn`` of a microbatch, computed a chunk of rows at a time; results per row."""
    axes = example.axes
    rows = first_batched(axes, args, kwargs).shape[0]
    per_row = sum(
        np.size(x) * jnp.result_type(x).itemsize
        for i in example.nums()
        for x in jax.tree.leaves(args[i])
    )
    most = max(1, CHUNK_BYTES // max(per_row, 1))
    size = max([d for d in range(1, min(rows, most) + 1) if rows % d == 0], default=rows)
    if size in (0, rows):
        return fn(*args, **kwargs)

    def split(value: Any) -> Any:
        return jax.tree.map(lambda x: x.reshape(rows // size, size, *x.shape[1:]), value)

    chunks = (
        {i: split(a) for i, a in enumerate(args) if axes.spec(i) is not None},
        {n: split(v) for n, v in kwargs.items() if axes.spec(n) is not None},
    )

    def one(chunk: tuple[dict[int, Any], dict[str, Any]]) -> Any:
        a = tuple(chunk[0].get(i, v) for i, v in enumerate(args))
        return fn(*a, **{n: chunk[1].get(n, v) for n, v in kwargs.items()})

    out = jax.lax.map(one, chunks)
    return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" if shape is None else f"an array of shape {tuple(shape)}"


def _masked(x: jax.Array, keep: jax.Array) -> jax.Array:
    """Per-example ``x`` with the rows where ``keep`` is False set to zero."""
    return jnp.where(jnp.reshape(keep, (-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def find_batched(axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's first batched leaf, or None."""
    for where, arg in [*enumerate(args), *kwargs.items()]:
        if axes.spec(where) is not None and jax.tree.leaves(arg):
            return jax.tree.leaves(arg)[0]
    return None


def first_batched(axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    leaf = find_batched(axes, args, kwargs)
    if leaf is None:
        raise ValueError("micro_grad found no batch argument in the call.")
    return leaf


def _open(g: Any, requested: Any, merge: str | None, where: Any = None) -> Any:
    """A gradient sum, in the accumulation dtype until the loop ends; ``g`` may already
    be open (``explicit``)."""
    if isinstance(g, _layout.Open):
        value, dtype = g.value, g.dtype
    else:
        value, dtype = g, g.dtype
    if where is not None:
        value = _layout.constrain(value, where)
    wide = _accumulators.accumulation_dtype(dtype, requested)
    if merge is None and wide == dtype == value.dtype:
        return value
    return _layout.Open(value.astype(wide), dtype, merge)


NONLINEAR_IN_COTANGENT = {
    "custom_lin",
    "custom_vjp_call",
    "custom_transpose_call",
    "custom_linear_solve",
}
"""What may make a backward pass non-linear in its cotangent: primitives whose transpose
runs code that the user supplies.

Every other primitive's transpose is linear by construction (JAX transposes only linear
maps), so without these a VJP with cotangent ``c_b`` per example is ``c_b`` times the VJP
with cotangent 1. ``custom_lin`` is how a ``custom_vjp`` appears in a JVP; a
``custom_vjp`` called inside another's JVP rule stays ``custom_vjp_call``; the transpose
of ``custom_linear_solve`` is a solve, which an iterative solver with a tolerance does
not do linearly."""


def _summed_is_exact(
    example: Examples,
    losses: Function,
    requested: Any,
    scaled: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    """Whether the gradient of the (weighted) summed loss equals the (weighted) sum of the
    per-example gradients, as accumulated.

    Two conditions, checked on the JVP of this call's loss, which holds every value that
    the backward pass sums over examples or scales by a cotangent:
    - the sums run in the accumulation dtype or wider: no floating value on the way,
      parameters, loss and intermediates, is narrower than the dtype the accumulation
      would give it (float16 would overflow, a clip factor or weight would be rounded);
    - when the examples are scaled (clip factors, weights, a padding mask), the backward
      pass is linear in its cotangent: no ``NONLINEAR_IN_COTANGENT``. With all
      cotangents 1 each example's backward pass is its own gradient's.
    """
    nums = example.nums()
    if not all(
        jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
        for leaf in jax.tree.leaves([args[i] for i in nums])
    ):
        return False  # the per-example path lets jax.grad say what is wrong

    def tangents(*primals: Any) -> Any:
        def values(*diff: Any) -> Any:
            full = list(args)
            for i, d in zip(nums, diff, strict=True):
                full[i] = d
            return losses(*full, **kwargs)[0]

        return jax.jvp(values, primals, primals)

    program = jax.make_jaxpr(tangents)(*[args[i] for i in nums])
    for dtype in _programs.float_dtypes(program):
        wide = _accumulators.accumulation_dtype(dtype, requested)
        if jnp.finfo(wide).bits > jnp.finfo(dtype).bits:
            return False
    return not scaled or not _programs.calls(program, NONLINEAR_IN_COTANGENT)
