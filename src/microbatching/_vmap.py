"""``micro_vmap``: ``jax.vmap`` over a batch too large to map at once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax

from . import _accumulators, _checks, _fsdp, _signature
from ._accumulators import AccumulationType
from ._loop import loop
from ._signature import BatchAxes
from ._typing import AccumulatorTree, Count, Function, InAxes, P, VmapFn
from ._wrap import Settings, wraps


@_signature.other_transforms_names
def micro_vmap(
    fun: Callable[P, Any],
    in_axes: InAxes = 0,
    out_axes: Any = 0,
    *,
    microbatch_size: int | None = None,
    vmap_fn: VmapFn = jax.vmap,
    accumulator: AccumulatorTree = AccumulationType.CONCAT,
    num_real_microbatches: Count = None,
    accumulation_dtype: Any = None,
    batch_mesh_axes: str | tuple[str, ...] | None = None,
    progress: bool = False,
    allow_remainder: bool = False,
) -> Callable[..., Any]:
    """Maps ``fun`` over a batch axis, one microbatch at a time.

    With the default ``CONCAT`` accumulator the result equals
    ``jax.vmap(fun, in_axes)(*args, **kwargs)``, but only ``microbatch_size`` rows are
    mapped at once. A reducing accumulator (``SUM``, ``MEAN``...) reduces over the batch
    axis instead, so the mapped outputs never exist all at once.

    The returned function also takes a keyword-only ``example_weights``: one weight per
    example, shape ``(batch_size,)``, boolean (a mask) or numeric, never passed to
    ``fun``. SUM then gives ``sum(w_b * y_b)``, MEAN and RUNNING_MEAN
    ``sum(w_b * y_b) / sum(w_b)``, MAX and MIN skip examples of weight 0, and CONCAT
    gives rows of zeros for them. Examples of weight 0 never reach a result: ``fun``
    sees another example in their place and their outputs are selected away, so NaN or
    padding in them is harmless. Without ``example_weights`` nothing of this is compiled.

    Args:
      fun: The per-example function.
      in_axes: As in ``jax.vmap``: an int for every positional parameter, or one entry
        per positional parameter (an int, None for an unmapped argument, or a pytree
        prefix). An entry applies to its parameter whether the call passes it by
        position or by keyword. Keyword arguments that name no positional parameter
        are mapped along axis 0, as in ``jax.vmap``.
      out_axes: Must be 0.
      microbatch_size: Rows mapped at once; None maps the whole batch at once.
      vmap_fn: Called as ``vmap_fn(fun, in_axes, out_axes)`` on each microbatch, e.g.
        ``functools.partial(jax.vmap, spmd_axis_name='data')``.
      accumulator: How to combine the mapped outputs over the batch: an
        ``AccumulationType``, an ``Accumulator`` or a pytree prefix of the output.
      num_real_microbatches: See ``microbatch``.
      accumulation_dtype: See ``microbatch``.
      batch_mesh_axes: The mesh axis name(s) the batch axis is sharded over, on an Auto
        mesh (call inside ``jax.set_mesh``). Reductions then keep one partial result per
        shard through the loop and all-reduce once after it, as they do on Explicit
        meshes, where the sharding is read from the arrays' types and this is not needed.
      progress: See ``microbatch``.
      allow_remainder: Accept a batch that ``microbatch_size`` does not divide. The last
        rows run as one more microbatch inside the same loop, padded to
        ``microbatch_size`` with copies of the last row that are masked out; results
        equal those of the whole batch. Microbatch ``i < n`` holds rows ``i, i + n, ...``
        of the first ``n * microbatch_size`` rows, the last one the remaining rows.
        A custom ``Accumulator`` cannot mask, so it gets the last rows in one more call
        after the loop, as in ``microbatch``.

    Returns:
      A function taking ``fun``'s arguments with an extra batch axis, and optionally
      ``example_weights=``.

    Raises:
      NotImplementedError: If ``out_axes`` is not 0.

    >>> import jax.numpy as jnp
    >>> micro_vmap(lambda x: x**2)(jnp.arange(8))
    Array([ 0,  1,  4,  9, 16, 25, 36, 49], dtype=int32)
    >>> micro_vmap(lambda x: x ** 2, microbatch_size=2)(jnp.arange(6))
    Array([ 0,  1,  4,  9, 16, 25], dtype=int32)
    >>> micro_vmap(lambda x: x ** 2, microbatch_size=2,
    ...            accumulator=AccumulationType.SUM)(jnp.arange(6))
    Array(55, dtype=int32)
    >>> mean = micro_vmap(lambda x: x ** 2, microbatch_size=4, allow_remainder=True,
    ...                   accumulator=AccumulationType.MEAN)
    >>> mean(jnp.arange(7.0)), mean(jnp.arange(7.0), example_weights=jnp.arange(7) < 3)
    (Array(13., dtype=float32), Array(1.6666666, dtype=float32))
    """
    if not (_checks.is_int(out_axes) and out_axes == 0):
        raise NotImplementedError(
            f"micro_vmap supports only out_axes=0, got {out_axes=}; move the axis afterwards "
            "with jnp.moveaxis."
        )
    axes = _signature.vmap_axes(fun, in_axes)
    settings = Settings(
        _checks.ensure_microbatch_size(microbatch_size),
        _accumulators.ensure_tree(accumulator),
        _checks.ensure_count(num_real_microbatches),
        _checks.ensure_accumulation_dtype(accumulation_dtype),
        _checks.ensure_mesh_axes(batch_mesh_axes),
        _checks.ensure_bool("progress", progress),
        "micro_vmap",
        _checks.ensure_bool("allow_remainder", allow_remainder),
    )
    looped = build(fun, axes, _checks.ensure_callable("vmap_fn", vmap_fn), settings)
    return wraps(fun, looped, axes, settings, weights=True)


def build(
    fun: Function,
    axes: BatchAxes,
    vmap_fn: VmapFn,
    settings: Settings,
    around: Callable[[Function], Function] | None = None,
) -> Function:
    """The loop over ``vmap_fn(fun)``, its outputs aggregated within each microbatch;
    ``around`` may wrap that step.

    Unmapped arguments that an Explicit mesh splits over the batch's axes are gathered
    once, before the loop (``_fsdp.whole_over_batch_axes``).
    """

    def whole(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _fsdp.whole_over_batch_axes(lambda w: axes.spec(w) is not None, args, kwargs)

    step = aggregated(fun, axes, vmap_fn, settings)
    return loop_over(step if around is None else around(step), axes, settings, whole)


def aggregated(fun: Function, axes: BatchAxes, vmap_fn: VmapFn, settings: Settings) -> Function:
    """``per_microbatch(weights, *args, **kwargs)``: ``vmap_fn(fun)`` on a microbatch, its
    outputs aggregated by ``settings.accumulator``."""
    mapped = vmapped(fun, axes, vmap_fn)
    accumulator = settings.accumulator
    dtype, mesh_axes = settings.accumulation_dtype, settings.mesh_axes

    def per_microbatch(weights: Any, *args: Any, **kwargs: Any) -> Any:
        with jax.named_scope("micro_vmap_step"):
            out = mapped(*args, **kwargs)
            if weights is None:
                return _accumulators.combine(accumulator, 1, dtype, mesh_axes).aggregate(out)
            return _accumulators.weighted_aggregate(accumulator, out, weights, dtype, mesh_axes)

    return per_microbatch


def loop_over(
    per_microbatch: Function,
    axes: BatchAxes,
    settings: Settings,
    prepare: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None,
) -> Function:
    """The loop over ``per_microbatch(weights, *args, **kwargs)``, called as
    ``called(args, kwargs, weights, bind=None)`` with the call's arguments and its
    ``example_weights`` (or None) apart; ``bind`` is passed to ``per_microbatch`` first
    where it is not None.

    Keyword arguments that name positional parameters become positional first, then
    ``prepare(args, kwargs)`` may lay them out for the loop. Profiler spans:
    ``{span}_size_{m}`` and ``micro_vmap_size_{m}``, as optax.microbatching writes.
    """
    looped = loop(per_microbatch, axes, settings)
    outer = f"{settings.span}_size_{settings.size}"
    inner = f"micro_vmap_size_{settings.size}"

    def called(
        args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any, bind: Any = None
    ) -> Any:
        args, kwargs = axes.to_positions(args, kwargs)
        if prepare is not None:
            args, kwargs = prepare(args, kwargs)
        with (
            jax.named_scope(outer),
            contextlib.nullcontext() if outer == inner else jax.named_scope(inner),
        ):
            return looped(args, kwargs, weights, bind)

    return called


def vmapped(fun: Function, axes: BatchAxes, vmap_fn: VmapFn) -> Function:
    """``vmap_fn(fun)`` with each argument mapped on the axis ``axes`` gives its parameter."""

    def mapped(*args: Any, **kwargs: Any) -> Any:
        return vmap_fn(*_positional(fun, axes, args, kwargs))(*args, *kwargs.values())

    return mapped


def _positional(
    fun: Function, axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Function, Any, int]:
    """``vmap_fn``'s arguments for a call: keyword arguments become positional, so that
    each gets the axis its parameter has (``jax.vmap`` maps keywords along 0 only)."""
    if not kwargs and _checks.is_int(axes.rest):
        return fun, axes.rest, 0
    specs = tuple(axes.spec(where) for where in [*range(len(args)), *kwargs])
    if not kwargs:
        return fun, specs, 0
    names = tuple(kwargs)

    def by_position(*values: Any) -> Any:
        split = len(values) - len(names)
        return fun(*values[:split], **dict(zip(names, values[split:], strict=True)))

    return by_position, specs, 0
