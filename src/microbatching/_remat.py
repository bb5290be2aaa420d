"""How gradients flow through the loop.

Reverse-mode differentiation of a loop keeps what every iteration's backward pass needs.
For ``fun`` on a microbatch that is its activations, so ``jax.grad`` of a microbatched
function would hold the activations of the whole batch. Here the step that runs ``fun``
is rematerialised (``jax.checkpoint``): the backward pass recomputes one microbatch's
forward pass at a time, and only the loop index is kept per iteration.

The transposed loop sums the cotangents of ``fun``'s closed-over values (the parameters)
over microbatches, in their dtype. To keep that sum exact for bfloat16 or float16
parameters, the loop closes over copies in the accumulation dtype and casts them back
inside each step, so the sum runs in the wider dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from . import _sharding
from ._accumulators import accumulation_dtype


def step(
    jaxpr: ClosedJaxpr,
    take: Callable[[Any], Sequence[Any]],
    requested: Any,
    runs: Callable[[Any], Any] | None = None,
    pin: bool = False,
) -> Callable[[Any], list[Any]]:
    """``fun`` on microbatch ``index`` (read by ``take(index)``), rematerialised.

    ``requested`` is the ``accumulation_dtype``, applied to floating closed-over values.
    Microbatches for which ``runs(index)`` is False skip ``fun`` and give zeros. The
    skip sits inside the checkpoint: a ``lax.cond`` around it would make the backward pass
    keep the checkpoint's inputs, the whole batch, once per microbatch. With ``pin`` the
    closed-over values pass an optimization barrier with the index, so that what ``fun``
    computes from them alone (a gather of sharded parameters) runs in every microbatch
    rather than once before the loop.
    """
    consts = list(jaxpr.consts)
    widened = [_widen(c, requested) for c in consts]

    def compute(index: Any, widened: list[Any]) -> list[Any]:
        if pin:  # one barrier per value: a barrier's outputs share their inputs' manual axes
            widened = [jax.lax.optimization_barrier((w, index))[0] for w in widened]
        narrow = [w.astype(c.dtype) for w, c in zip(widened, consts, strict=True)]
        return jaxpr_as_fun(ClosedJaxpr(jaxpr.jaxpr, narrow))(*take(index))

    if runs is None:
        run = jax.checkpoint(compute, prevent_cse=False)
        return lambda index: run(index, widened)
    condition = runs

    def bounded(index: Any, widened: list[Any]) -> list[Any]:
        types = jax.eval_shape(compute, index, widened)  # inside shard_map: what varies
        skipped = lambda index, widened: [_zeros(t) for t in types]  # noqa: E731
        return _sharding.cond(condition(index), compute, skipped, index, widened)

    run_bounded = jax.checkpoint(bounded, prevent_cse=False)
    return lambda index: run_bounded(index, widened)


def _widen(value: Any, requested: Any) -> Any:
    """``value`` in the accumulation dtype, if that is a wider float; else unchanged."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return value
    wide = accumulation_dtype(dtype, requested)
    if jax.numpy.finfo(wide).bits <= jax.numpy.finfo(dtype).bits:
        return value
    return jax.numpy.asarray(value, wide)


def _zeros(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``struct``'s type, varying over the same manual mesh axes (``shard_map``)."""
    return _sharding.full(struct, 0)
