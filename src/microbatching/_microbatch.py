"""The loop: ``microbatch``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import jaxpr_as_fun

from . import _accumulators, _arguments, _layout, _sharding
from ._accumulators import AccumulationType
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
) -> Callable[P, Any]:
    """Runs ``fun`` on one microbatch at a time and combines the results.

    The returned function takes the same arguments as ``fun``. It splits every batch
    argument into ``batch_size // microbatch_size`` microbatches, calls ``fun`` on each
    inside a single ``jax.lax.fori_loop`` and folds the results with ``accumulator``.
    Microbatch ``i`` holds rows ``i, i + n, i + 2n, ...`` of the batch (``n`` the number
    of microbatches); it is read in place, so the batch is never copied.

    Args:
      fun: The function to run; it must accept a microbatch wherever it accepts the batch.
      argnums: Positions of the arguments that have a batch axis.
      microbatch_size: Rows per microbatch; it must divide the batch size. None runs
        ``fun`` once on the whole batch.
      accumulator: How to combine the per-microbatch results: an ``AccumulationType``,
        an ``Accumulator``, or a pytree of them that is a prefix of ``fun``'s output.
      argnames: Names of keyword arguments that have a batch axis.
      in_axes: The batch axis of each argument in ``argnums + argnames`` (one int for
        all). An entry may also be a pytree prefix of its argument, with None for
        leaves that are not batched. Negative axes count from the end.
      num_real_microbatches: Run only microbatches ``0 .. k-1``. An int is checked
        against the number of microbatches; a traced integer is clipped to it and can
        change without recompiling. CONCAT rows of skipped microbatches are zero;
        MEAN still divides by the total number of microbatches, RUNNING_MEAN by ``k``.

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
    size = _arguments.ensure_microbatch_size(microbatch_size)
    batch_arguments = _arguments.BatchArguments.create(fun, argnums, argnames, in_axes)
    _accumulators.check_tree(accumulator)
    count = _arguments.ensure_count(num_real_microbatches)

    @functools.wraps(fun, updated=())
    def microbatched(*args: P.args, **kwargs: P.kwargs) -> Any:
        with jax.named_scope(f"microbatch({batch_arguments.fun_name})"):
            if size is None:
                return fun(*args, **kwargs)
            batch = batch_arguments.locate(args, kwargs)
            with _sharding.mesh_of(batch.leaves):
                return _loop(fun, batch, size, accumulator, count)

    return microbatched


def _loop(fun: Function, batch: _arguments.Batch, size: int, accumulator: Any, count: Count) -> Any:
    """Traces ``fun`` once on an abstract microbatch, then runs it in a fori_loop."""
    n = _arguments.num_microbatches(batch.size, size)
    acc = _accumulators.combine(accumulator, n)
    batched = [(i, axis) for i, axis in enumerate(batch.axes) if axis is not None]

    def call(microbatch_leaves: list[Any]) -> Any:
        leaves = list(batch.leaves)
        for (i, _), leaf in zip(batched, microbatch_leaves, strict=True):
            leaves[i] = leaf
        args, kwargs = batch.rebuild(leaves)
        return fun(*args, **kwargs)

    views = [(_layout.split(batch.leaves[i], ax, size, batch.labels[i]), ax) for i, ax in batched]
    structs = [_layout.microbatch_struct(batch.leaves[i], ax, size) for i, ax in batched]
    jaxpr, out_shape = jax.make_jaxpr(call, return_shape=True)(structs)
    run, out_tree = jaxpr_as_fun(jaxpr), jax.tree.structure(out_shape)
    carry = acc.init(out_shape)
    if n == 0:
        return acc.finalize(carry)

    def body(index: Any, carry: Any) -> Any:
        microbatch_leaves = [_layout.take(view, ax, index) for view, ax in views]
        return acc.update(carry, out_tree.unflatten(run(*microbatch_leaves)), index)

    return acc.finalize(jax.lax.fori_loop(0, _arguments.real_count(count, n), body, carry))
