"""The loop: ``microbatch``, and ``loop``, which ``micro_vmap`` and ``micro_grad`` build on."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import (
    _accumulators,
    _batch,
    _checks,
    _eager,
    _gradients,
    _layout,
    _progress,
    _sharding,
    _signature,
)
from ._accumulators import AccumulationType
from ._batch import Batch
from ._signature import RESERVES, WEIGHTS, BatchAxes
from ._typing import Count, Function, InAxes, P


def microbatch(
    fun: Callable[P, Any],
    argnums: int | tuple[int, ...] | list[int],
    microbatch_size: int | None,
    accumulator: Any = AccumulationType.SUM,
    *,
    argnames: str | tuple[str, ...] | list[str] = (),
    in_axes: InAxes = 0,
    num_real_microbatches: Count = None,
    accumulation_dtype: Any = None,
    progress: bool = False,
    allow_remainder: bool = False,
) -> Callable[P, Any]:
    """Runs ``fun`` on one microbatch at a time and combines the results.

    The returned function takes the same arguments as ``fun``. It splits every batch
    argument into ``batch_size // microbatch_size`` microbatches, calls ``fun`` on each
    inside a single ``jax.lax.fori_loop`` and folds the results with ``accumulator``.
    Microbatch ``i`` holds rows ``i, i + n, i + 2n, ...`` of the batch (``n`` the number
    of microbatches); it is read in place, so the batch is never copied. With
    ``allow_remainder=True`` a batch of ``n * microbatch_size + r`` rows is split the
    same way in its first ``n * microbatch_size`` rows, and ``fun`` is called once more,
    after the loop, on the last ``r`` rows.

    Args:
      fun: The function to run; it must accept a microbatch wherever it accepts the batch.
      argnums: Positions of the arguments that have a batch axis. A batch argument may be
        passed by position or by keyword.
      microbatch_size: Rows per microbatch; it must divide the batch size. None runs
        ``fun`` once on the whole batch.
      accumulator: How to combine the per-microbatch results: an ``AccumulationType``,
        an ``Accumulator``, or a pytree of them that is a prefix of ``fun``'s output.
        optax.microbatching's members and accumulators are accepted too.
      argnames: Names of keyword arguments that have a batch axis.
      in_axes: The batch axis of each argument in ``argnums + argnames`` (one int for
        all). An entry may also be a pytree prefix of its argument, with None for
        leaves that are not batched. Negative axes count from the end.
      num_real_microbatches: Run only microbatches ``0 .. k-1``. An int is checked
        against the number of microbatches; a traced integer is clipped to it and can
        change without recompiling. CONCAT rows of skipped microbatches are zero;
        MEAN still divides by the whole batch (all its microbatches, rows or weights),
        RUNNING_MEAN by the part that ran. Microbatch ``i`` holds strided rows, so
        this does not keep "the first ``k * microbatch_size`` rows".
      accumulation_dtype: The dtype in which the built-in reductions (SUM, MEAN,
        RUNNING_MEAN) accumulate floating results. None, the default, accumulates
        floats narrower than 32 bits in float32. The result keeps ``fun``'s dtype.
      progress: Print a progress bar over the microbatches to standard error, from
        inside the compiled loop (one line per 10% when the output is not a terminal).
      allow_remainder: Accept a batch that ``microbatch_size`` does not divide: the last
        ``r`` rows form one more, smaller microbatch (it counts in
        ``num_real_microbatches``). SUM and CONCAT combine it as any other; MEAN and
        RUNNING_MEAN weight each microbatch by its rows, so that a ``fun`` that averages
        over its rows gives the mean over the whole batch.

    Returns:
      A function with ``fun``'s signature that returns the combined result.

    Raises:
      TypeError, ValueError: At wrap time for bad ``microbatch_size``, ``argnums``,
        ``argnames``, ``in_axes`` or ``accumulator``; at the first call for batch
        arguments that do not fit them.

    >>> import jax.numpy as jnp
    >>> fun = lambda x: (x + 1, jnp.sum(3 * x))
    >>> data = jnp.array([1, 2, 3, 4])
    >>> fun(data)
    (Array([2, 3, 4, 5], dtype=int32), Array(30, dtype=int32))
    >>> strategy = (AccumulationType.CONCAT, AccumulationType.SUM)
    >>> microbatched_fun = microbatch(fun, argnums=0, microbatch_size=2, accumulator=strategy)
    >>> microbatched_fun(data)
    (Array([2, 3, 4, 5], dtype=int32), Array(30, dtype=int32))
    """
    axes = _signature.microbatch_axes(fun, argnums, argnames, in_axes)
    settings = Settings(
        _checks.ensure_microbatch_size(microbatch_size),
        _accumulators.ensure_tree(accumulator),
        _checks.ensure_count(num_real_microbatches),
        _checks.ensure_accumulation_dtype(accumulation_dtype),
        progress=_checks.ensure_bool("progress", progress),
        allow_remainder=_checks.ensure_bool("allow_remainder", allow_remainder),
    )
    return wraps(fun, loop(fun, axes, settings), settings)


STATE_HINT = (
    "microbatching: fun mutates state that lives outside the loop (in Flax NNX, e.g. the "
    "Rngs counter of a Dropout layer), which JAX cannot do from inside a traced loop. Pass "
    "the state in as an argument instead: split the module with `graphdef, state = "
    "nnx.split(model)` and `nnx.merge(graphdef, state)` inside fun, and give each example "
    "its own PRNG key as a batch argument, e.g. `jax.random.split(key, batch_size)`."
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a transform loops, normalised when the user wraps ``fun``.

    Attributes:
      size: ``microbatch_size``.
      accumulator: The accumulator tree (optax's leaves replaced by ours).
      count: ``num_real_microbatches``: None, an int or a traced integer.
      accumulation_dtype: The requested accumulation dtype, or None for the default.
      mesh_axes: ``batch_mesh_axes``.
      progress: Whether the loop reports each microbatch to a progress bar.
      span: The transform's name, for profiler spans and the progress bar.
      allow_remainder: Whether a batch that ``size`` does not divide runs a last,
        partial microbatch.
    """

    size: int | None
    accumulator: Any
    count: Count
    accumulation_dtype: Any
    mesh_axes: tuple[str, ...] | None = None
    progress: bool = False
    span: str = "microbatch"
    allow_remainder: bool = False


def wraps(
    fun: Callable[P, Any], wrapper: Function, settings: Settings, weights: bool = False
) -> Callable[P, Any]:
    """``wrapper`` with ``fun``'s name, docstring and signature, but no ``__wrapped__``.

    Equinox takes a ``__wrapped__`` attribute as the sign of a JAX transform and warns
    when one becomes a module field; our wrappers are plain functions. Eager calls go
    through a cached ``jax.jit`` (``_eager``), unless there is no loop to compile. With
    ``weights`` the signature also has a keyword-only ``example_weights=None``, so that
    ``inspect.signature(...).bind`` (``eqx.filter_jit``, ``donate_argnames``) accepts it.
    """
    if settings.size is not None:
        wrapper = _eager.cached(wrapper)
    out = functools.wraps(fun, updated=())(wrapper)
    del out.__wrapped__
    with contextlib.suppress(TypeError, ValueError):  # builtins may have none
        signature = inspect.signature(fun)
        if weights:
            signature = _with_weights(signature)
            setattr(out, RESERVES, True)
        out.__signature__ = signature  # pyright: ignore[reportAttributeAccessIssue]
    return out


def _with_weights(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with a keyword-only ``example_weights=None`` (before ``**kwargs``)."""
    params = list(signature.parameters.values())
    if WEIGHTS in signature.parameters:  # our own wrapper, nested
        return signature
    at = len(params) - (bool(params) and params[-1].kind == inspect.Parameter.VAR_KEYWORD)
    extra = inspect.Parameter(WEIGHTS, inspect.Parameter.KEYWORD_ONLY, default=None)
    return signature.replace(parameters=[*params[:at], extra, *params[at:]])


def loop(fun: Function, axes: BatchAxes, settings: Settings) -> Function:
    """The microbatched ``fun``: locates the batch in each call and runs the loop.

    ``fun`` is called with the call's arguments, each batch argument cut to one microbatch.
    The outer profiler span is ``{span}({fun_name})``; the spans of optax.microbatching
    are there too: ``microbatch_size_{m}`` around the loop and ``{n}_microbatches`` in its
    body.

    For ``micro_vmap`` and ``micro_grad`` (``axes.weights``) ``fun`` also takes the
    microbatch's ``example_weights``: the call's, or with a remainder and built-in
    accumulators, 1 on real rows and 0 on the padding of the last microbatch.
    """
    size, name = settings.size, f"{settings.span}({axes.fun_name})"
    padded = axes.weights and not _accumulators.is_custom(settings.accumulator)

    def looped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(name):
            if size is None and axes.transform == "microbatch":
                return fun(*args, **kwargs)
            if axes.weights and WEIGHTS in kwargs and kwargs[WEIGHTS] is None:
                kwargs = {k: v for k, v in kwargs.items() if k != WEIGHTS}
            given = axes.weights and WEIGHTS in kwargs
            if given:
                kwargs = {**kwargs, WEIGHTS: _weights(kwargs[WEIGHTS], axes)}
            count = None if size is None else settings.count
            batch = _batch.locate(axes, args, kwargs, size, count, settings.allow_remainder)
            if size is None and not given:
                return _layout.close(fun(*args, **kwargs))
            m = size
            if m is None:  # example_weights without microbatching: one microbatch of all
                m = max(batch.size, 1)
                batch = _batch.locate(axes, args, kwargs, m, None)
            if batch.remainder:
                _warn_if_sharded(batch, m, settings.mesh_axes, axes)
            if batch.remainder and padded and not given:
                kwargs = {**kwargs, WEIGHTS: jax.numpy.ones(batch.size, bool)}
                batch = _batch.locate(axes, args, kwargs, m, count, True)
            for i in batch.batched:  # before the weights are cut into microbatches
                _layout.check_shards(batch.leaves[i], batch.axes[i] or 0, m, batch.labels[i])
            with _sharding.mesh_of(batch.leaves), jax.named_scope(f"microbatch_size_{m}"):
                split = _accumulators.Split(
                    batch.num_microbatches, batch.remainder, m, _weighting(batch, m)
                )
                acc = _accumulators.combine(
                    settings.accumulator, split, settings.accumulation_dtype
                )
                progress = name if settings.progress else None
                if given and batch.weights is not None:
                    # No example of non-zero weight: no microbatch runs, so that what the
                    # rows hold reaches no gradient either (every row would be a stand-in).
                    # The skip is the traced bound's, inside the rematerialised step.
                    kept = jax.numpy.any(batch.leaves[batch.weights] != 0)
                    batch = dataclasses.replace(
                        batch, bound=jax.numpy.where(kept, batch.bound, 0).astype(np.int32)
                    )
                loop = Loop(batch, m, padded, given, settings.mesh_axes)
                return _layout.close(_run(fun, loop, acc, settings.accumulation_dtype, progress))

    return looped


def _warn_if_sharded(batch: Batch, size: int, mesh_axes: Any, axes: BatchAxes) -> None:
    """A remainder on a sharded batch works, but moves each microbatch between devices.

    (A microbatch size that the shards do not divide is an error, raised later.)
    """
    for i in batch.batched:
        where = _layout.shards(batch.leaves[i], batch.axes[i] or 0, mesh_axes)
        if where is not None and size % where.count == 0:
            padding = (
                " and pass example_weights that are 0 on the padding rows" if axes.weights else ""
            )
            warnings.warn(
                f"allow_remainder on a batch sharded over {where.count} devices: with a "
                f"remainder of {batch.remainder} rows the microbatches no longer line up with "
                "the shards, so each microbatch's rows are gathered across devices. To keep "
                "every row on its device, pad the batch to a multiple of microbatch_size (a "
                f"multiple of {where.count}){padding}.",
                stacklevel=2,
            )
            return


def _weights(weights: Any, axes: BatchAxes) -> jax.Array:
    """``example_weights`` checked: one bool, integer or float per example."""
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
    if kind == np.bool_ or any(jax.numpy.issubdtype(kind, t) for t in (np.integer, np.floating)):
        return jax.numpy.asarray(weights)
    raise TypeError(
        f"{WEIGHTS} of {axes.transform} must be bool, integer or floating, got dtype {kind}; "
        "pass real weights, or a boolean mask."
    )


def _weighting(batch: Batch, size: int) -> _accumulators.Weighting | None:
    """The weight of each microbatch: the sum of its ``example_weights``, or its rows."""
    full, rem = batch.full, batch.remainder
    if batch.weights is not None:
        w = batch.leaves[batch.weights]
        w = w.astype(jax.numpy.promote_types(w.dtype, jax.numpy.float32))
        parts = [jax.numpy.sum(jax.numpy.reshape(w[: full * size], (size, full)), axis=0)]
        if rem:
            parts.append(jax.numpy.sum(w[full * size :])[None])
        per = jax.numpy.concatenate(parts)
        return _accumulators.Weighting(per, jax.numpy.sum(w), presummed=True)
    if rem:
        per = np.array([size] * full + [rem], np.float32)
        return _accumulators.Weighting(
            jax.numpy.asarray(per), jax.numpy.float32(batch.size), presummed=False
        )
    return None


@dataclasses.dataclass(frozen=True)
class Loop:
    """What the loop reads: the batch, the microbatch size, and how a remainder runs.

    Attributes:
      padded: A remainder runs in the loop as one more microbatch of ``size`` rows, its
        padding rows copies of the last row, masked by the weights (``micro_vmap``,
        ``micro_grad``); else ``fun`` is called once more, after the loop, on the
        remainder alone (``microbatch``, custom accumulators).
      substitute: Rows of weight 0 are replaced by a row of non-zero weight before
        ``fun`` sees them, so that whatever they hold cannot reach a result.
      mesh_axes: ``batch_mesh_axes``.
    """

    batch: Batch
    size: int
    padded: bool
    substitute: bool
    mesh_axes: tuple[str, ...] | None = None

    @property
    def trips(self) -> int:
        batch = self.batch
        return batch.num_microbatches if self.padded else batch.full

    def reader(self) -> Callable[[Any], list[Any]]:
        """``read(i)``: the batched leaves of microbatch ``i``, as ``fun`` gets them."""
        batch, size = self.batch, self.size
        batched = batch.batched
        axes = [batch.axes[i] or 0 for i in batched]
        if not batch.remainder:
            views = [
                _layout.split(batch.leaves[i], ax, size, batch.labels[i])
                for i, ax in zip(batched, axes, strict=True)
            ]

            def read(index: Any) -> list[Any]:
                return [_layout.take(v, ax, index) for v, ax in zip(views, axes, strict=True)]

        else:
            for i, ax in zip(batched, axes, strict=True):
                _layout.check_shards(batch.leaves[i], ax, size, batch.labels[i])

            def read(index: Any) -> list[Any]:
                rows, valid = _layout.rows(index, batch.full, batch.remainder, size)
                out = [
                    _layout.take_rows(batch.leaves[i], ax, rows)
                    for i, ax in zip(batched, axes, strict=True)
                ]
                if batch.weights is not None:
                    k = batched.index(batch.weights)
                    out[k] = jax.numpy.where(valid, out[k], jax.numpy.zeros((), out[k].dtype))
                return out

        if not self.substitute or batch.weights is None:
            return read
        weights = batch.leaves[batch.weights]
        k = batched.index(batch.weights)
        refs = [
            None
            if i == batch.weights
            else _layout.kept_row(batch.leaves[i], ax, weights, self.mesh_axes)
            for i, ax in zip(batched, axes, strict=True)
        ]

        def substituted(index: Any) -> list[Any]:
            leaves = read(index)
            keep = leaves[k] != 0
            for j, (ref, ax) in enumerate(zip(refs, axes, strict=True)):
                if ref is not None:
                    shape = [1] * leaves[j].ndim
                    shape[ax] = -1
                    leaves[j] = jax.numpy.where(keep.reshape(shape), leaves[j], ref)
            return leaves

        return substituted

    def remainder(self) -> list[Any]:
        """The batched leaves of the last rows, for ``fun`` called on them alone."""
        batch = self.batch
        rows = jax.numpy.arange(batch.full * self.size, batch.size)
        return [_layout.take_rows(batch.leaves[i], batch.axes[i] or 0, rows) for i in batch.batched]


def _run(fun: Function, loop: Loop, acc: Any, requested: Any, progress: str | None) -> Any:
    """Traces ``fun`` once on an abstract microbatch, then runs it in a fori_loop.

    The trip count is static, so reverse-mode differentiation works: a traced
    ``num_real_microbatches`` skips the microbatches past it with a ``lax.cond``.
    ``progress`` names the bar that each microbatch reports to, if any.
    """
    batch, size = loop.batch, loop.size
    batched = batch.batched

    def call(microbatch_leaves: list[Any]) -> Any:
        leaves = list(batch.leaves)
        for i, leaf in zip(batched, microbatch_leaves, strict=True):
            leaves[i] = leaf
        args, kwargs = batch.rebuild(leaves)
        return fun(*args, **kwargs)

    # The reader first: its views check the microbatch size against the shards.
    take = loop.reader() if batch.num_microbatches else None
    structs = [
        _layout.microbatch_struct(batch.leaves[i], batch.axes[i] or 0, size) for i in batched
    ]
    try:
        jaxpr, out_shape = jax.make_jaxpr(call, return_shape=True)(structs)
    except Exception as err:
        if "different trace level" in str(err):  # Flax NNX state mutated inside the loop
            err.add_note(STATE_HINT)
        raise
    out_tree = jax.tree.structure(out_shape)
    carry = acc.init(out_shape)
    if take is None:
        return acc.finalize(carry)

    bound = batch.bound
    traced = not isinstance(bound, int)
    try:  # skip fun inside the checkpoint; under shard_map the zeros may not type-check
        run = _gradients.step(jaxpr, take, requested, bound if traced else None)
        jax.eval_shape(run, 0)
        inner = traced
    except TypeError:
        run, inner = _gradients.step(jaxpr, take, requested), False

    def fold(index: Any, carry: Any, out: Any) -> Any:
        carry = acc.update(carry, out, index)
        if progress is not None:
            # The barrier makes the index available only once the carry is computed, so
            # the report comes after the microbatch's work.
            index, carry = jax.lax.optimization_barrier((index, carry))
            _progress.tick(progress, index, bound)
        return carry

    def body(index: Any, carry: Any) -> Any:
        with jax.named_scope(f"{batch.num_microbatches}_microbatches"):
            if not traced:
                return fold(index, carry, out_tree.unflatten(run(index)))
            if inner:
                out = out_tree.unflatten(run(index))
                return jax.lax.cond(index < bound, fold, lambda i, c, o: c, index, carry, out)
            step = lambda i, c: fold(i, c, out_tree.unflatten(run(i)))  # noqa: E731
            return jax.lax.cond(index < bound, step, lambda i, c: c, index, carry)

    trips = min(bound, loop.trips) if isinstance(bound, int) else loop.trips
    try:
        carry = jax.lax.fori_loop(0, trips, body, carry)
    except TypeError as err:
        shapes = jax.tree.map(lambda x: jax.typeof(x).str_short(), (out_shape, carry))
        raise TypeError(
            "The accumulator could not fold a microbatch result into its carry: "
            f"fun returns {shapes[0]} and init made the carry {shapes[1]}. A custom "
            "Accumulator's init must return the carry that its update takes and returns. "
            f"({err})"
        ) from err
    if batch.remainder and not loop.padded:
        carry = _remainder(call, loop, acc, carry, progress)
    return acc.finalize(carry)


def _remainder(call: Function, loop: Loop, acc: Any, carry: Any, progress: str | None) -> Any:
    """Folds ``fun`` of the last, partial microbatch into the carry, as microbatch ``full``."""
    batch, full = loop.batch, loop.batch.full

    def fold(carry: Any) -> Any:
        with jax.named_scope("remainder"):
            carry = acc.update(carry, call(loop.remainder()), full)
            if progress is not None:
                leaves = jax.tree.leaves(carry)
                after = jax.numpy.sum(jax.numpy.ravel(leaves[0])[:1]) if leaves else None
                _progress.tick(progress, full, batch.bound, after)
            return carry

    bound = batch.bound
    if isinstance(bound, int):
        return fold(carry) if bound > full else carry
    return jax.lax.cond(bound > full, fold, lambda c: c, carry)
