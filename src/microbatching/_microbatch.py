"""``microbatch``: ``fun`` on one microbatch at a time, its results combined."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _accumulators, _checks, _fused, _signature, _unsplit
from ._accumulators import AccumulationType
from ._loop import loop
from ._typing import AccumulatorTree, Count, InAxes, P
from ._wrap import Settings, wraps


@_signature.other_transforms_names
def microbatch(
    fun: Callable[P, Any],
    argnums: int | tuple[int, ...] | list[int],
    microbatch_size: int | None,
    accumulator: AccumulatorTree = AccumulationType.SUM,
    *,
    argnames: str | tuple[str, ...] | list[str] = (),
    in_axes: InAxes = 0,
    num_real_microbatches: Count = None,
    accumulation_dtype: Any = None,
    progress: bool = False,
    allow_remainder: bool = False,
    fused_gradient: bool = False,
    whole_argnums: int | tuple[int, ...] = (),
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
      fused_gradient: Compute the gradient of the result in the same loop as the result,
        for ``jax.grad`` and ``jax.value_and_grad`` of the returned function: each
        microbatch's gradient is taken right after its value and accumulated alongside,
        instead of a second loop that runs every microbatch's forward pass again. It
        costs what ``microbatch(jax.value_and_grad(fun))`` costs, against 1.2-1.5x for
        the default. Reverse mode only: ``jax.jvp`` of the returned function is refused
        (under ``jit`` by JAX's error for a ``custom_vjp``), of its gradient it works.
        The accumulator must be SUM, MEAN or RUNNING_MEAN; only floating scalar outputs
        may be differentiated, and only with respect to arguments without a batch axis
        (``fun`` may close over the parameters). Calls that are not differentiated run
        the plain loop.
      whole_argnums: Positions of arguments meant whole (passed to every microbatch as
        they are). Any other positional argument outside ``argnums`` and ``argnames``
        whose axis 0 has the batch's size gets an ``UnsplitBatchWarning``, once: a
        forgotten batch argument would be passed whole without any error.

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
    fused = _checks.ensure_bool("fused_gradient", fused_gradient)
    if fused:
        _fused.check(settings)
    if settings.size is None:
        return wraps(fun, fun, axes, settings)
    looped = loop(lambda weights, *args, **kwargs: fun(*args, **kwargs), axes, settings)
    named = f"argnums={argnums!r}" + (f", argnames={argnames!r}" if argnames else "")
    unsplit = _unsplit.Unsplit(
        axes, _unsplit.whole_positions(fun, whole_argnums, axes), named=named
    )

    def forward(*args: Any, **kwargs: Any) -> Any:
        unsplit.check(args, kwargs)
        return looped(args, kwargs, None)

    if fused:
        forward = _fused.fused(fun, axes, settings, forward)
    return wraps(fun, forward, axes, settings)
