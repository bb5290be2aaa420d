"""Per-example gradients for ``micro_grad``, one microbatch at a time: the pieces the
methods of ``_methods`` are made of.

- ``per_example``: each example's gradient, clipped and transformed, then aggregated.
  This is what a ``transform_fn`` or a custom accumulator needs.
- The summed path: when the transform is the identity and the accumulation is a sum or
  a mean, the aggregate of the per-example gradients is the gradient of the summed loss
  (``weighted_gradient``), one backward pass with matrix products instead of one per
  example. That equality holds only where ``summed_is_exact`` proves it for the call's
  traced loss; elsewhere ``explicit`` forms the per-example gradients. ``ghost`` reads
  the norms off the traced program and sums by book-keeping (``_ghost``);
  ``statistics_in_chunks`` forms the per-example gradients a chunk at a time for their
  norms and metrics.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    _accumulators,
    _clipping,
    _ghost,
    _layout,
    _primitives,
    _programs,
    _scaled,
    _sharding,
    _signature,
    _statistics,
    _tuning,
    _vmap,
)
from ._signature import SHAPES_NOTE, WEIGHTS, BatchAxes, first_few
from ._typing import Function, PyTree


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
class Unvarying:
    """Inside ``shard_map``, a differentiated leaf that does not vary over manual mesh
    axes that the batch or its ``example_weights`` vary over (``Examples.unvarying``).

    Attributes:
      argument: The name of the differentiated argument that holds it.
      leaf: The leaf, as the gradient's tree names it (``params['w']``).
      type: Its type, short (``float32[3]``).
      axes: The mesh axes it does not vary over.
      by: What varies over them: ``"the batch"``, ``"example_weights"``, or both.
    """

    argument: str
    leaf: str
    type: str
    axes: tuple[str, ...]
    by: tuple[str, ...]

    @property
    def weighted(self) -> bool:
        """Whether ``example_weights`` vary over these axes: each device's weights would
        then scale (or divide) gradients summed over all of them."""
        return WEIGHTS in self.by

    def error(self, why: str) -> ValueError:
        """The refusal of a call for ``why``, an option that the devices' summed
        gradients cannot serve (``GradRequest.per_example_reason``, ``weights_reason``)."""
        axes = repr(self.axes[0]) if len(self.axes) == 1 else repr(self.axes)
        varies = f"{' and '.join(self.by)} {'varies' if self.by == ('the batch',) else 'vary'}"
        return ValueError(
            f"micro_grad with {why} inside jax.shard_map: {varies} over the mesh axes "
            f"{axes}, but `{self.leaf}` does not (type {self.type}), so JAX's derivative "
            "would sum each example's gradient over those devices before micro_grad sees "
            "it. Pass the parameters as varying, "
            f"`jax.lax.pcast({self.argument}, {axes}, to='varying')`, and combine the "
            f"devices' results after, e.g. `jax.lax.psum(grads, {axes})`."
        )


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

    def _shapes_seen(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The note on an error that ``fun`` raised, or a shape it returned: how it saw
        each example (``keep_batch_dim``) and which arguments were split into examples,
        and the fixes where that was the cause: the usual ones for a loss written for one
        example or for a batch, or for an argument split that is not a batch."""
        seen = [
            f"`{self.axes.label(where)}` of shape {tuple(np.shape(leaves[0]))}"
            for where, value in (*enumerate(args), *kwargs.items())
            if self.axes.position(where) is not None and self.axes.spec(where) is not None
            for leaves in [jax.tree.leaves(value)]
            if leaves
        ]
        which = f" ({self.axes.set_by}: {first_few(seen)})" if seen else ""
        argument = self.axes.set_by.split("=")[0]
        split = (
            f"; if one of these arguments is not a batch of examples, leave it out of {argument}"
            if seen
            else ""
        )
        if self.keep_batch_dim:
            return (
                f"{SHAPES_NOTE} as a batch of one{which}: keep_batch_dim=True, the "
                "default. If fun is written for a single example, without a leading "
                f"batch axis, pass keep_batch_dim=False{split}."
            )
        return (
            f"{SHAPES_NOTE} without a batch axis{which}: keep_batch_dim=False. If fun "
            "is written for a batch, indexing or reducing over a leading batch axis, "
            f"leave keep_batch_dim at its default, True{split}."
        )

    def _loss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        try:
            out = self.fun(*args, **kwargs)
        except (TypeError, ValueError, IndexError) as err:
            # One note per error, whichever trace saw it first: a loss that raises the
            # same exception object each call (a module-level instance) keeps one.
            if not any(n.startswith(SHAPES_NOTE) for n in getattr(err, "__notes__", [])):
                err.add_note(self._shapes_seen(args, kwargs))
            raise
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
            hint = " " + self._shapes_seen(args, kwargs) if self.keep_batch_dim else ""
            raise TypeError(
                "micro_grad needs fun to return a scalar loss per example, but it returned "
                f"shape {value.shape} for each; reduce it to a scalar in fun.{hint}"
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

    def unvarying(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any
    ) -> Unvarying | None:
        """Inside ``shard_map``, the first differentiated leaf that does not vary over a
        manual mesh axis that the batch or its ``example_weights`` vary over (the loop
        makes the batch vary as its weights do, ``_batch.locate``); None elsewhere.

        JAX's derivative sums each example's gradient over such an axis's devices, so the
        gradient of the summed loss is what ``jax.grad`` gives there, but no per-example
        gradient is one example's (``GradRequest.per_example_reason``), and the weights
        of one device do not weight the others' rows (``GradRequest.weights_reason``)."""
        batch: set[str] = set()
        for _, arg in batch_arguments(self.axes, args, kwargs):
            for leaf in jax.tree.leaves(arg):
                batch.update(_sharding.varying_of(leaf))
        weighted = set(_sharding.varying_of(weights))
        if not batch | weighted:
            return None
        for i in self.nums():
            if i >= len(args) or self.axes.spec(i) is not None:
                continue
            name = self.axes.label(i)
            for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
                missing = tuple(sorted((batch | weighted) - set(_sharding.varying_of(leaf))))
                if missing:
                    by = tuple(
                        source
                        for source, axes in (("the batch", batch), (WEIGHTS, weighted))
                        if axes & set(missing)
                    )
                    leaf_name = f"{name}{jax.tree_util.keystr(path)}"
                    return Unvarying(name, leaf_name, jax.typeof(leaf).str_short(), missing, by)
        return None

    def value_and_grad(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], PyTree]:
        """One example's ``((value, aux), gradient)``, with respect to the expanded
        arguments (a batch argument in ``argnums`` gets a gradient of shape ``(1, ...)``)."""
        args, kwargs = self.expand(args, kwargs)
        return jax.value_and_grad(self._loss, self.argnums, has_aux=True)(*args, **kwargs)

    def nums(self) -> tuple[int, ...]:
        return (self.argnums,) if isinstance(self.argnums, int) else self.argnums


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


def norms_only(metrics: Any) -> bool:
    """Whether ``metrics`` needs no gradient: the norms (``l2_norm``), or a function of the
    norms read off ``metrics_fn``'s program (``_scaled.NormsMetric``)."""
    return metrics is l2_norm or isinstance(metrics, _scaled.NormsMetric)


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


@dataclasses.dataclass(frozen=True)
class Sums:
    """What the steps of the summed path read: one example's loss, the clipping, the
    metrics and the requested accumulation dtype.

    Attributes:
      example: One example's loss and gradient.
      clipping: The clipping options, or None.
      metrics: ``metrics_fn``, or None for no metrics.
      requested: The requested accumulation dtype, or None for the default.
      reading: For the statistics method, the call's reading of ``transform_fn`` and
        ``metrics_fn`` (``_statistics.read``); else None.
      by_shard: Whether the step computes one shard's rows of a sharded batch.
    """

    example: Examples
    clipping: _clipping.Clipping | None
    metrics: Callable[[PyTree], PyTree] | None
    requested: Any
    reading: _statistics.Reading | None = None
    by_shard: bool = False

    @property
    def branches(self) -> bool:
        """Whether the sums may branch on the data (a ``lax.cond``): the per-example norms
        to the plain sums of squares where they are safe (``_clipping``), the ghost sums
        to check their scaled cotangents for underflow (``_ghost.clipped_sum``). Not on
        one shard's rows, which run vmapped over the shards, where a branch runs both
        sides."""
        return not self.by_shard

    @property
    def norms_only(self) -> bool:
        """Whether the metrics need no gradient (``norms_only``)."""
        return norms_only(self.metrics)

    def of_norms(self, norms: jax.Array) -> Any:
        """The per-example metrics from each example's norms per leaf ``(rows, leaves)``
        where they need no gradient (``norms_only``), else None."""
        if self.metrics is l2_norm:
            return _clipping.row_norms(norms, norms.shape[0])
        if isinstance(self.metrics, _scaled.NormsMetric):
            return self.metrics.of_norms(norms)
        return None

    def losses(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """The ``(values, aux)`` of a microbatch, one row per example."""
        return _vmap.vmapped(self.example.loss, self.example.axes, jax.vmap)(*args, **kwargs)

    def each(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], PyTree]:
        """The ``((values, aux), gradients)`` of a microbatch, one row per example."""
        each = _vmap.vmapped(self.example.value_and_grad, self.example.axes, jax.vmap)
        return each(*args, **kwargs)


def weighted_gradient(
    sums: Sums,
    measured: Any,
    factors: jax.Array | None,
    seed: Any,
    given: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[PyTree, Aux]:
    """The gradient of the microbatch's loss summed with each example's clip ``factors``
    and weight ``given`` (either may be None), times ``seed`` if given; ``measured`` are
    the per-example metrics for ``Aux``.

    The factors depend on the parameters, but as values closed over by ``total`` the
    gradient holds them fixed; outer derivatives still see them.

    The factors, times the weights, are first divided by the power of two of the
    largest (``to_unit``), and the gradient multiplied by it after, both exact: the
    backward pass then runs at cotangents no smaller than the loss's own for that
    example, so that clip factors far below 1 do not push its cotangents below the
    dtype's smallest normal number, and no larger, so that weights far above 1 do not
    lift a cotangent that the norms' pass flushed to 0 back into the sum (an example
    weighted 7853 times its bound would).
    """
    example = sums.example
    power = None
    # The weights multiply the rows' losses: folded into the factors, which are then
    # normalised with them, where there are factors; a boolean mask only selects.
    scaled_by = None if given is None or given.dtype == jnp.bool_ else given
    if factors is not None and scaled_by is not None:
        wide = jnp.promote_types(factors.dtype, scaled_by.dtype)
        both = factors.astype(wide) * scaled_by.astype(wide)
        factors = jnp.where(scaled_by != 0, both, jnp.zeros((), wide))
        scaled_by = None
    if factors is not None:
        factors, power = _ghost.to_unit(factors)

    def total(*args: Any, **kwargs: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        values, aux = sums.losses(*args, **kwargs)
        weighted = values if factors is None else values * factors.astype(values.dtype)
        if seed is not None:
            weighted = weighted * jnp.asarray(seed, values.dtype)
        if given is not None:  # selected, so that a NaN of a weight-0 row cannot leak
            if scaled_by is not None:
                weighted = weighted * scaled_by.astype(values.dtype)
            weighted = jnp.where(given != 0, weighted, jnp.zeros((), values.dtype))
        return jnp.sum(weighted), (values, aux)

    (_, (values, aux)), grads = jax.value_and_grad(total, example.argnums, has_aux=True)(
        *args, **kwargs
    )
    if power is not None:
        grads = jax.tree.map(lambda g: _ghost.times_both(g, power), grads)
    return _kept(grads, Aux(values, measured, aux), given)


def _kept(grads: PyTree, out: Aux, given: Any) -> tuple[PyTree, Aux]:
    """``Aux`` zero on the rows of weight 0, and the sums zero where every row is."""
    if given is None:
        return grads, out
    keep = given != 0
    out = jax.tree.map(lambda x: _masked(x, keep), out)
    grads = jax.tree.map(lambda g: jnp.where(_any_kept(keep, g), g, jnp.zeros_like(g)), grads)
    return grads, out


def _any_kept(keep: jax.Array, g: jax.Array) -> jax.Array:
    """Whether a row that ``g`` sums is kept. Inside ``shard_map``, where ``keep`` varies
    over mesh axes that ``g`` does not (JAX's derivative of a parameter that does not vary
    summed ``g`` over their devices), whether a device keeps one: a device that keeps none
    still holds the others' rows."""
    kept = jnp.any(keep)
    summed = sorted(set(_sharding.varying_of(keep)) - set(_sharding.varying_of(g)))
    return jax.lax.psum(kept.astype(jnp.int32), summed) > 0 if summed else kept


def statistics_in_chunks(
    sums: Sums, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, jax.Array | None]:
    """The per-example metrics and clip factors (None without clipping) of a
    microbatch, from its per-example gradients, a chunk of rows at a time."""

    def statistics(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        grads = sums.each(*args, **kwargs)[1]
        measured = None if sums.metrics is None else jax.vmap(sums.metrics)(grads)
        if sums.clipping is None:
            return measured, None
        rows = first_batched(sums.example.axes, args, kwargs).shape[0]
        scale = sums.clipping.per_leaf(_clipping.leaf_norms(grads, rows, sums.branches), grads)
        return measured, scale[0] if scale else jnp.ones((rows,))

    return _in_chunks(statistics, sums.example, args, kwargs)


def explicit(
    sums: Sums, given: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Aux]:
    """A microbatch's sums from the per-example gradients, each scaled by its clip
    factor and weight, and added up in the accumulation dtype.

    Each example's clip factor reads its own gradient only, so the gradients are formed
    a chunk of rows at a time (``_tuning.Knobs.explicit_chunk_bytes``) and each chunk's sum is added
    to the last: the same terms, summed in the same dtype, with memory for one chunk of
    gradients instead of the microbatch's. One shard's rows of a batch split over a mesh
    (``Sums.by_shard``, run vmapped over the shards) are taken at once."""
    rows, size = _chunk_rows(sums.example, args, kwargs, _tuning.knobs().explicit_chunk_bytes)
    if size in (0, rows) or sums.by_shard:
        return _explicit(sums, given, args, kwargs)
    split = functools.partial(_split_rows, size=size)
    chunks = (_batched_split(sums.example, args, kwargs, split), split(given))

    def one(chunk: Any) -> tuple[list[Any], Aux]:
        (a, k), g = _rebuilt(chunk[0], args, kwargs), chunk[1]
        summed, out = _explicit(sums, g, a, k)
        return [s.value for s in jax.tree.leaves(summed, is_leaf=_layout.is_open)], out

    shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], chunks))[0]
    zeros = [_sharding.full(t, 0) for t in shapes]

    def body(carry: list[Any], chunk: Any) -> tuple[list[Any], Aux]:
        summed, out = one(chunk)
        return [c + s for c, s in zip(carry, summed, strict=True)], out

    totals, out = jax.lax.scan(body, zeros, chunks)
    structure = jax.tree.structure(gradient_shapes(sums.example, args))
    dtypes = [jnp.result_type(p) for i in sums.example.nums() for p in jax.tree.leaves(args[i])]
    opened = [_layout.Open(t, d) for t, d in zip(totals, dtypes, strict=True)]
    whole = jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)
    return jax.tree.unflatten(structure, opened), whole


def _explicit(
    sums: Sums, given: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Aux]:
    """``explicit`` of rows taken at once."""
    (values, aux), grads = sums.each(*args, **kwargs)
    rows = values.shape[0]
    measured = None if sums.metrics is None else jax.vmap(sums.metrics)(grads)
    leaves, structure = jax.tree.flatten(grads)
    scales = [jnp.ones((rows,), jnp.float32)] * len(leaves)
    if sums.clipping is not None:
        scales = sums.clipping.per_leaf(_clipping.leaf_norms(grads, rows, sums.branches), grads)
    keep = None if given is None else given != 0
    dropping = sums.clipping is not None and sums.clipping.nan_safe
    if given is not None and given.dtype != jnp.bool_:
        scales = [s * given.astype(jnp.promote_types(given.dtype, s.dtype)) for s in scales]

    def add(g: jax.Array, scale: jax.Array) -> _layout.Open:
        wide = _accumulators.accumulation_dtype(g.dtype, sums.requested)
        shape = (rows,) + (1,) * (g.ndim - 1)
        g = _layout.rows_apart(g)  # see there: XLA:CPU sums such rows wrongly
        terms = g.astype(wide)
        # Selected, so that a NaN of a row that ``nan_safe`` drops (factor 0) or of a
        # weight-0 row cannot leak. Otherwise an infinite gradient times its factor 0 is
        # NaN, as on the other methods.
        drop = scale == 0 if dropping else None
        if keep is not None:
            drop = ~keep if drop is None else drop | ~keep
        if drop is not None:
            terms = jnp.where(jnp.reshape(drop, shape), jnp.zeros((), wide), terms)
        return _layout.Open(_layout.weighted_rows(scale.astype(wide), terms), g.dtype)

    out = Aux(values, measured, aux)
    if keep is not None:
        out = jax.tree.map(lambda x: _masked(x, keep), out)
    summed = [add(g, s) for g, s in zip(leaves, scales, strict=True)]
    return jax.tree.unflatten(structure, summed), out


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


def split_call(example: Examples, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Split:
    nums = example.nums()
    params, structure = jax.tree.flatten([args[i] for i in nums])
    places = [w for w, _ in batch_arguments(example.axes, args, kwargs) if w not in nums]
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
    if isinstance(program, str):
        return program
    if program is None:
        return "the loss does not depend on the batch"
    for dtype in program.dtypes:
        wide = _accumulators.accumulation_dtype(dtype, requested)
        if jnp.finfo(wide).bits > jnp.finfo(dtype).bits:
            return f"it computes in {dtype}, narrower than its accumulation dtype {wide}"
    return program


def leaf_paths(example: Examples, args: tuple[Any, ...]) -> list[str]:
    """The path of each differentiated leaf, as the gradient's tree names it."""
    split = split_call(example, args, {})
    grads = split.gradient(example, split.params)
    return _signature.leaf_paths(grads)


def gradient_shapes(example: Examples, args: tuple[Any, ...]) -> PyTree:
    """One example's gradient as ``jax.ShapeDtypeStruct`` leaves, shaped as ``jax.grad``
    gives it."""
    split = split_call(example, args, {})
    shapes = [jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) for p in split.params]
    return split.gradient(example, shapes)


def read_program(sums: Sums, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _ghost.Program | str:
    """The traced program of one example's loss, or why the ghost norms cannot read it."""
    return _analyse(split_call(sums.example, args, kwargs), sums.requested)


def ghost_norms(sums: Sums, args: tuple[Any, ...], kwargs: dict[str, Any]) -> jax.Array | str:
    """``(rows, leaves)`` per-example norms of each parameter leaf, by the ghost norms."""
    split = split_call(sums.example, args, kwargs)
    program = _analyse(split, sums.requested)
    if isinstance(program, str):
        return program
    seen = _ghost.record(program, split.params, split.data)
    return _ghost.leaf_norms(program, split.params, seen)


def ghost(
    sums: Sums, given: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Aux] | str:
    """The clipped (weighted) sum by book-keeping, with per-example values, aux and
    norms; or why the ghost norms cannot read this loss. A microbatch whose record is
    larger than ``_tuning.Knobs.ghost_chunk_bytes`` is taken a chunk of rows at a time
    (``_row_chunks``)."""
    example = sums.example
    split = split_call(example, args, kwargs)
    program = _analyse(split, sums.requested)
    if isinstance(program, str):
        return program

    def rows(data: list[Any], weights: Any) -> tuple[list[Any], Aux]:
        return _ghost_rows(sums, program, split, data, weights)

    size = _ghost_chunk(sums, program, split)
    totals, out = _row_chunks(rows, split.data, given, size, sums.requested)
    return split.gradient(example, totals), out


def _ghost_chunk(sums: Sums, program: _ghost.Program, split: _Split) -> int:
    """How many rows of the microbatch the ghost norms take at once: those whose record
    fits ``_tuning.Knobs.ghost_chunk_bytes``, at least ``ghost_chunk_rows`` (every row on
    one shard of a mesh, run vmapped over the shards, or where the backend's knob is None)."""
    rows, knobs = split.data[0].shape[0], _tuning.knobs()
    if sums.by_shard or knobs.ghost_chunk_bytes is None:
        return rows
    most = knobs.ghost_chunk_bytes // max(_ghost.recorded_bytes(program), 1)
    return _tuning.chunk_rows(rows, max(most, knobs.ghost_chunk_rows))


def _row_chunks(
    fn: Callable[[list[Any], Any], tuple[list[Any], Aux]],
    data: list[Any],
    given: Any,
    size: int,
    requested: Any,
) -> tuple[list[Any], Aux]:
    """``fn(data, given) -> (sums, per-row Aux)`` of a microbatch, ``size`` rows at a time:
    the sums added in the accumulation dtype (left open, ``_layout.Open``), the rows
    concatenated. At once where ``size`` takes every row."""
    rows = data[0].shape[0]
    if size >= rows:
        return fn(data, given)
    whole = rows // size * size
    head = jax.tree.map(lambda x: _split_rows(x[:whole], size), (data, given))

    def wide(s: Any) -> Any:  # a sum (or an open one) in its accumulation dtype
        return _layout.value(s).astype(_accumulators.accumulation_dtype(s.dtype, requested))

    def body(carry: list[Any], chunk: Any) -> tuple[list[Any], Aux]:
        summed, out = fn(*chunk)
        return [c + wide(s) for c, s in zip(carry, summed, strict=True)], out

    first = jax.tree.map(lambda x: x[0], head)
    shapes = jax.eval_shape(lambda c: fn(*c)[0], first)
    zeros = [
        _sharding.full(_layout.value(t), 0, _accumulators.accumulation_dtype(t.dtype, requested))
        for t in shapes
    ]
    totals, out = jax.lax.scan(body, zeros, head)
    out = jax.tree.map(lambda x: x.reshape(whole, *x.shape[2:]), out)
    if rows > whole:
        summed, tail = fn(*jax.tree.map(lambda x: x[whole:], (data, given)))
        totals = [t + wide(s) for t, s in zip(totals, summed, strict=True)]
        out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)
    return [_layout.Open(t, s.dtype) for t, s in zip(totals, shapes, strict=True)], out


def _ghost_rows(
    sums: Sums, program: _ghost.Program, split: _Split, data: list[Any], given: Any
) -> tuple[list[Any], Aux]:
    """``ghost`` of rows taken at once: the sums of each parameter leaf, and the Aux."""
    example, clipping = sums.example, sums.clipping
    seen = _ghost.record(program, split.params, data)
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
    drops = clipping is not None and clipping.nan_safe
    clean = given is not None or drops
    checked = norms if sums.branches else None
    kept = None if drops or given is None else given != 0
    total = _ghost.clipped_sum(program, split.params, seen, scale, groups, clean, checked, kept)
    aux = jax.tree.unflatten(split.aux[0], seen.outs[1:])
    measured = sums.of_norms(norms)
    return _kept(total, Aux(seen.outs[0], measured, aux), given)


def statistics(
    sums: Sums, given: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyTree, Aux] | str:
    """The (weighted) sums of ``transform_fn`` of the clipped gradients, and the
    per-example values, aux and metrics, by the forms of ``sums.reading``
    (``_statistics``), without forming the per-example gradients of the model; or why
    the ghost engine cannot read this loss. Taken a chunk of rows at a time as ``ghost``
    is."""
    reading = sums.reading
    if reading is None:
        raise ValueError("micro_grad's statistics method needs the call's reading.")
    split = split_call(sums.example, args, kwargs)
    program = _analyse(split, sums.requested)
    if isinstance(program, str):
        return program

    def rows(data: list[Any], weights: Any) -> tuple[list[Any], Aux]:
        return _statistics_rows(sums, reading, program, split, data, weights)

    size = _ghost_chunk(sums, program, split)
    outs, out = _row_chunks(rows, split.data, given, size, sums.requested)
    return jax.tree.unflatten(reading.structure, outs), out


def _statistics_rows(
    sums: Sums,
    reading: _statistics.Reading,
    program: _ghost.Program,
    split: _Split,
    data: list[Any],
    given: Any,
) -> tuple[list[Any], Aux]:
    """``statistics`` of rows taken at once: the output leaves' sums, and the Aux."""
    example, clipping, params = sums.example, sums.clipping, split.params
    seen = _ghost.record(program, params, data)
    rows = jnp.shape(seen.outs[0])[0]
    wide = jnp.promote_types(jnp.result_type(*params), jnp.float32)
    norms = None
    if clipping is not None or reading.norms:
        norms = _ghost.leaf_norms(program, params, seen)
    if clipping is not None and norms is not None:
        groups, bounds = clipping.groups(split.gradient(example, params))
        scale = clipping.factors(norms, groups, bounds)
    else:
        groups, scale = [0] * len(params), jnp.ones((rows, 1), wide)
    if given is None:
        weights, keep = jnp.ones((rows,), scale.dtype), jnp.ones((rows,), bool)
    else:
        weights, keep = given.astype(jnp.promote_types(given.dtype, scale.dtype)), given != 0
    drops = clipping is not None and clipping.nan_safe
    clean = given is not None or drops
    checked = norms if sums.branches else None
    clipped = clipping is not None
    each = _statistics.Rows(scale, groups, weights, keep, clean, checked, drops, clipped)

    def tree(leaves: list[Any]) -> PyTree:
        return split.gradient(example, leaves)

    outs = _statistics.sums(reading, program, params, tree, seen, each, sums.requested)
    if reading.metric_outputs:
        measured = _statistics.metric_values(reading, program, params, tree, seen)
    elif reading.norms and norms is not None:
        measured = sums.of_norms(norms)
    else:
        measured = None
    aux = jax.tree.unflatten(split.aux[0], seen.outs[1:])
    return _kept(list(outs), Aux(seen.outs[0], measured, aux), given)


def by_shard(
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


def _chunk_rows(
    example: Examples,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    bound: int | None = None,
) -> tuple[int, int]:
    """The microbatch's rows, and how many of them to take at once: the largest divisor
    whose per-example gradients (in the parameters' dtype) fit ``bound`` bytes
    (``_tuning.Knobs.statistics_chunk_bytes`` by default)."""
    rows = first_batched(example.axes, args, kwargs).shape[0]
    per_row = sum(
        np.size(x) * jnp.result_type(x).itemsize
        for i in example.nums()
        if i < len(args)  # a missing one: the call of fun says so
        for x in jax.tree.leaves(args[i])
    )
    chunk = _tuning.knobs().statistics_chunk_bytes if bound is None else bound
    most = max(1, chunk // max(per_row, 1))
    return rows, max([d for d in range(1, min(rows, most) + 1) if rows % d == 0], default=rows)


def _split_rows(value: Any, size: int) -> Any:
    """``value``'s leaves with their rows as ``(chunks, size)``."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // size, size, *x.shape[1:]), value)


def _batched_split(
    example: Examples, args: tuple[Any, ...], kwargs: dict[str, Any], split: Callable[[Any], Any]
) -> tuple[dict[int, Any], dict[str, Any]]:
    """The batched arguments, split into chunks of rows, by position and by name."""
    axes = example.axes
    return (
        {i: split(a) for i, a in enumerate(args) if axes.spec(i) is not None},
        {n: split(v) for n, v in kwargs.items() if axes.spec(n) is not None},
    )


def _rebuilt(
    chunk: tuple[dict[int, Any], dict[str, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with one chunk's rows in place of the batched ones."""
    a = tuple(chunk[0].get(i, v) for i, v in enumerate(args))
    return a, {n: chunk[1].get(n, v) for n, v in kwargs.items()}


def _in_chunks(
    fn: Function,
    example: Examples,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``fn`` of a microbatch, computed a chunk of rows at a time; results per row."""
    rows, size = _chunk_rows(example, args, kwargs)
    if size in (0, rows):
        return fn(*args, **kwargs)
    split = functools.partial(_split_rows, size=size)

    def one(chunk: tuple[dict[int, Any], dict[str, Any]]) -> Any:
        a, k = _rebuilt(chunk, args, kwargs)
        return fn(*a, **k)

    out = jax.lax.map(one, _batched_split(example, args, kwargs, split))
    return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)


def materialized_norms(sums: Sums, args: tuple[Any, ...], kwargs: dict[str, Any]) -> jax.Array:
    """``(rows, leaves)`` norms of each example's gradient leaves, from the gradients
    formed a chunk of rows at a time."""

    def norms(*args: Any, **kwargs: Any) -> jax.Array:
        grads = sums.each(*args, **kwargs)[1]
        rows = first_batched(sums.example.axes, args, kwargs).shape[0]
        return _clipping.leaf_norms(grads, rows, sums.branches)

    return _in_chunks(norms, sums.example, args, kwargs)


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" if shape is None else f"an array of shape {tuple(shape)}"


def _masked(x: jax.Array, keep: jax.Array) -> jax.Array:
    """Per-example ``x`` with the rows where ``keep`` is False set to zero."""
    return jnp.where(jnp.reshape(keep, (-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def batch_arguments(
    axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[int | str, Any]]:
    """The call's batch arguments, each with its position or keyword, in call order."""
    return [(w, a) for w, a in [*enumerate(args), *kwargs.items()] if axes.spec(w) is not None]


def find_batched(axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's first batched leaf, or None."""
    for _, arg in batch_arguments(axes, args, kwargs):
        if jax.tree.leaves(arg):
            return jax.tree.leaves(arg)[0]
    return None


def first_batched(axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    leaf = find_batched(axes, args, kwargs)
    if leaf is None:
        raise ValueError("micro_grad found no batch argument in the call.")
    return leaf


def open_sum(g: Any, requested: Any, merge: str | None, where: Any = None) -> Any:
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


def summed_is_exact(sums: Sums, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the gradient of the (weighted) summed loss equals the (weighted) sum of the
    per-example gradients, as accumulated (``summed_differs`` says why not)."""
    return summed_differs(sums, args, kwargs).why() is None


@dataclasses.dataclass(frozen=True)
class Differs:
    """Why the gradient of the summed loss may differ from the sum of the per-example
    gradients, as accumulated: each reason in words, or None.

    Attributes:
      narrow: A value is narrower than its accumulation dtype.
      not_linear: The backward pass may not be linear in its cotangent.
    """

    narrow: str | None
    not_linear: str | None

    def why(self) -> str | None:
        """The first reason, or None where the summed gradient is exact."""
        return self.narrow or self.not_linear


def summed_differs(sums: Sums, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Differs:
    """Why the gradient of the (weighted) summed loss may differ from the (weighted) sum
    of the per-example gradients, as accumulated, from one trace of this call's loss.

    - The sums run in the accumulation dtype or wider: no floating value on the way,
      parameters, loss, intermediates and what the rules of its ``custom_jvp`` functions
      compute, is narrower than the dtype the accumulation would give it (float16 would
      overflow, a clip factor or weight would be rounded).
    - The backward pass is linear in its cotangent: every primitive, at any depth and in
      every ``custom_jvp`` rule, is one the primitive table knows JAX to derive
      (``_primitives.not_linear``). Scaled or not: a rule on the parameters' side of the
      program (a ``custom_vjp`` or ``reduce_precision`` on a weight) sees the cotangent
      summed over the batch, where each example's gradient passes its own through it; a
      rule on the data's side sees the batch's cotangents at once, where each example's
      gradient passes its own row.

    The loss is traced once, never differentiated here: a JVP of a ``custom_vjp`` that no
    reverse pass encloses is JAX's error under ``JAX_CUSTOM_VJP3``.
    """
    nums = sums.example.nums()
    if not all(
        jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
        for leaf in jax.tree.leaves([args[i] for i in nums])
    ):
        narrow = "a differentiated leaf is not a float array"  # jax.grad says so in the loop
        return Differs(narrow, narrow)

    def values(*diff: Any) -> Any:
        full = list(args)
        for i, d in zip(nums, diff, strict=True):
            full[i] = d
        return sums.losses(*full, **kwargs)[0]

    program = jax.make_jaxpr(values)(*[args[i] for i in nums])
    narrow = None
    for dtype in _programs.float_dtypes(program):
        wide = _accumulators.accumulation_dtype(dtype, sums.requested)
        if jnp.finfo(wide).bits > jnp.finfo(dtype).bits:
            narrow = NARROWER.format(dtype=jnp.dtype(dtype).name, wide=jnp.dtype(wide).name)
            break
    found = _primitives.not_linear(program.jaxpr)
    return Differs(narrow, None if found is None else NOT_LINEAR.format(name=found.name))


NOT_LINEAR = (
    "the loss holds {name}, which one backward pass of the summed loss cannot be proven "
    "linear through (a custom VJP rule, a custom linear solve, lax.reduce_precision, a "
    "callback, or a primitive the engine does not know)"
)
"""Why the gradient of the summed loss may not be the sum of the per-example gradients
(``summed_differs``)."""


NARROWER = (
    "the loss computes in {dtype}, narrower than its accumulation dtype {wide}, so one "
    "backward pass would sum the examples in {dtype}: the per-example gradients are "
    "summed in {wide} instead (for the mean gradient, microbatch(jax.grad(fun), "
    "accumulator=MEAN) takes one gradient per microbatch and sums those in {wide})"
)
"""Why ``auto`` forms the per-example gradients of a narrow model (``summed_differs``)."""
