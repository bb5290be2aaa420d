"""``micro_vmap``: ``jax.vmap`` over a batch too large to map at once."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from . import _accumulators, _arguments
from ._accumulators import AccumulationType
from ._microbatch import microbatch
from ._typing import Count, InAxes, P, VmapFn


def micro_vmap(
    fun: Callable[P, Any],
    in_axes: InAxes = 0,
    out_axes: Any = 0,
    *,
    microbatch_size: int | None = None,
    vmap_fn: VmapFn = jax.vmap,
    accumulator: Any = AccumulationType.CONCAT,
    num_real_microbatches: Count = None,
) -> Callable[P, Any]:
    """Maps ``fun`` over a batch axis, one microbatch at a time.

    With the default ``CONCAT`` accumulator the result equals
    ``jax.vmap(fun, in_axes)(*args, **kwargs)``, but only ``microbatch_size`` rows are
    mapped at once. A reducing accumulator (``SUM``, ``MEAN``...) reduces over the batch
    axis instead, so the mapped outputs never exist all at once.

    Args:
      fun: The per-example function.
      in_axes: As in ``jax.vmap``: an int for every positional argument, or one entry
        per positional argument (an int, None for an unmapped argument, or a pytree
        prefix). Keyword arguments are mapped along axis 0, as in ``jax.vmap``.
      out_axes: Must be 0.
      microbatch_size: Rows mapped at once; None maps the whole batch at once.
      vmap_fn: Called as ``vmap_fn(fun, in_axes, out_axes)`` on each microbatch, e.g.
        ``functools.partial(jax.vmap, spmd_axis_name='data')``.
      accumulator: How to combine the mapped outputs over the batch: an
        ``AccumulationType``, an ``Accumulator`` or a pytree prefix of the output.
      num_real_microbatches: See ``microbatch``.

    Returns:
      A function taking ``fun``'s arguments with an extra batch axis.

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
    """
    if not (_arguments.is_int(out_axes) and out_axes == 0):
        raise NotImplementedError(
            f"micro_vmap supports only out_axes=0, got {out_axes=}; move the axis afterwards "
            "with jnp.moveaxis."
        )
    size = _arguments.ensure_microbatch_size(microbatch_size)
    axes_spec = _arguments.ensure_vmap_in_axes(in_axes)
    _accumulators.check_tree(accumulator)
    count = _arguments.ensure_count(num_real_microbatches)
    name = _arguments.function_name(fun)

    def per_microbatch(*args: Any, **kwargs: Any) -> Any:
        mapped = vmap_fn(fun, axes_spec, 0)(*args, **kwargs)
        return _accumulators.combine(accumulator, 1).aggregate(mapped)

    @functools.wraps(fun, updated=())
    def mapped(*args: P.args, **kwargs: P.kwargs) -> Any:
        with jax.named_scope(f"micro_vmap({name})"):
            axes = (axes_spec,) * len(args) if isinstance(axes_spec, int) else axes_spec
            if len(axes) != len(args):
                raise ValueError(
                    f"in_axes has {len(axes)} entries but {name} was called with {len(args)} "
                    f"positional argument(s); give one entry per positional argument ({in_axes=})."
                )
            _arguments.check_mapped_keywords(kwargs, "micro_vmap", "by position with in_axes None")
            argnums = tuple(i for i, ax in enumerate(axes) if ax is not None)
            if not argnums and not kwargs:
                raise ValueError(
                    f"micro_vmap of {name} has nothing to map: {in_axes=} maps no positional "
                    "argument and no keyword argument was passed; map at least one argument."
                )
            looped = microbatch(
                per_microbatch,
                argnums=argnums,
                microbatch_size=size,
                accumulator=accumulator,
                argnames=tuple(kwargs),
                in_axes=[axes[i] for i in argnums] + [0] * len(kwargs),
                num_real_microbatches=count,
            )
            # Without microbatching the per-shard partial sums of ``aggregate`` are still open.
            return _accumulators.settle(looped(*args, **kwargs))

    return mapped
