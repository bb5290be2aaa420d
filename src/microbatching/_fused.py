"""``microbatch(..., fused_gradient=True)``: the gradient taken in the forward loop.

By default ``jax.grad`` of a microbatched function is JAX's transpose of the loop: a
second loop that runs each microbatch's forward pass again (``_remat``), about 1.2-1.45x
the cost of the loop of ``jax.value_and_grad(fun)``. With the option the function is a
``jax.custom_vjp``. Its forward pass is that loop: each microbatch's value and gradients
(with respect to the arguments JAX differentiates, which ``symbolic_zeros`` tells it) are
accumulated side by side. The backward pass only scales the accumulated gradients by the
cotangent of each output.

The gradient of a SUM or a MEAN of microbatch results is the same SUM or MEAN of their
gradients, so the accumulators of the value accumulate the gradients too. One backward
pass is taken per floating scalar output (each with its own accumulator); outputs of
other shapes may not be differentiated. ``jax.jvp`` of the function is refused by JAX
(a ``custom_vjp`` has no forward mode); ``jax.jvp`` of its gradient (a Hessian-vector
product) and ``jax.grad`` of its gradient go through the forward loop and are exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import _accumulators, _batch
from ._loop import loop
from ._signature import BatchAxes
from ._typing import Function
from ._wrap import Settings

OPTION = "fused_gradient=True"


def check(settings: Settings) -> None:
    """Wrap-time check: the accumulators commute with gradients (SUM, MEAN, RUNNING_MEAN)."""
    if not _accumulators.is_linear(settings.accumulator):
        raise ValueError(
            f"{OPTION} accumulates each microbatch's gradient with the accumulator of its "
            "value, which is only the gradient of the result for SUM, MEAN and "
            f"RUNNING_MEAN; got accumulator={settings.accumulator!r}. Drop {OPTION} (the "
            "default differentiates through the loop), or use one of those three."
        )


def fused(fun: Function, axes: BatchAxes, settings: Settings, forward: Function) -> Function:
    """``forward`` (the microbatched ``fun``) with its gradient computed in its loop."""
    loops: dict[Any, Function] = {}  # one value-and-gradient loop per differentiated set

    def gradient_loop(differentiated: tuple[int, ...], tree: Any) -> Function:
        key = (differentiated, tree)
        if key not in loops:
            body = _value_and_gradients(fun, differentiated, tree)
            both = dataclasses.replace(settings, accumulator=(settings.accumulator,) * 2)
            looped = loop(lambda weights, *a, **k: body(*a, **k), axes, both)
            loops[key] = lambda *a, **k: looped(a, k, None)
        return loops[key]

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def rebuild(values: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            filled = list(leaves)
            for i, value in zip(arrays, values, strict=True):
                filled[i] = value
            return jax.tree.unflatten(tree, filled)

        @jax.custom_vjp
        def run(*values: Any) -> Any:
            a, k = rebuild(values)
            return forward(*a, **k)

        def run_fwd(*primals: Any) -> tuple[Any, Any]:
            values = tuple(p.value for p in primals)
            differentiated = tuple(
                i for i, p in zip(arrays, primals, strict=True) if p.perturbed and _floating(p)
            )
            _refuse_batched(axes, args, kwargs, differentiated)
            a, k = rebuild(values)
            value, gradients = gradient_loop(differentiated, tree)(*a, **k)
            return value, (gradients, differentiated)

        def run_bwd(residuals: Any, cotangent: Any) -> tuple[Any, ...]:
            gradients, differentiated = residuals
            summed = _scaled_sum(gradients, cotangent)
            if summed is None:  # no cotangent reached an output
                return (None,) * len(arrays)
            by_leaf = dict(zip(differentiated, summed, strict=True))
            return tuple(by_leaf.get(i) for i in arrays)

        run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
        try:
            return run(*(leaves[i] for i in arrays))
        except TypeError as err:
            if "forward-mode" not in str(err):
                raise
            raise TypeError(
                f"{OPTION} computes the gradient in the forward loop for reverse mode only "
                "(jax.grad, jax.value_and_grad, jax.vjp, and jax.jvp of those); "
                "jax.jvp, jax.jacfwd and jax.linearize of the microbatched function itself "
                f"need the default: drop {OPTION}."
            ) from err

    return call


def _value_and_gradients(fun: Function, differentiated: tuple[int, ...], tree: Any) -> Function:
    """``fun``'s result, and for each floating scalar output the gradients of it with
    respect to the call's leaves at ``differentiated`` (None for other outputs)."""

    def body(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        leaves = jax.tree.leaves((args, kwargs))

        def of(chosen: list[Any]) -> tuple[list[Any], Any]:
            filled = list(leaves)
            for i, value in zip(differentiated, chosen, strict=True):
                filled[i] = value
            a, k = jax.tree.unflatten(tree, filled)
            out = fun(*a, **k)
            return [leaf for leaf in jax.tree.leaves(out) if _scalar_floating(leaf)], out

        scalars, vjp, out = jax.vjp(of, [leaves[i] for i in differentiated], has_aux=True)
        if not scalars:
            per_output = []
        elif len(scalars) == 1:
            per_output = [vjp([jnp.ones_like(scalars[0])])[0]]
        else:
            eye = [jnp.eye(len(scalars), dtype=s.dtype)[:, k] for k, s in enumerate(scalars)]
            stacked = jax.vmap(lambda row: vjp(list(row))[0])(eye)
            per_output = [jax.tree.map(lambda g, k=k: g[k], stacked) for k in range(len(scalars))]
        it = iter(per_output)
        return out, jax.tree.map(lambda leaf: next(it) if _scalar_floating(leaf) else None, out)

    return body


def _scaled_sum(gradients: Any, cotangent: Any) -> list[Any] | None:
    """Sum over outputs of the output's cotangent times its accumulated gradients."""
    total: list[Any] | None = None
    for grads, ct in zip(
        jax.tree.leaves(gradients, is_leaf=lambda g: g is None or isinstance(g, list)),
        jax.tree.leaves(cotangent, is_leaf=lambda c: isinstance(c, SymbolicZero)),
        strict=True,
    ):
        if isinstance(ct, SymbolicZero) or not _floating_dtype(ct.dtype):
            continue
        if grads is None:
            raise ValueError(
                f"{OPTION} computes gradients of scalar floating outputs only, and this "
                f"one is {jax.typeof(ct).str_short()}. Reduce it to a scalar inside fun, "
                f"or drop {OPTION}."
            )
        scaled = [(g * ct.astype(g.dtype)).astype(g.dtype) for g in grads]
        total = scaled if total is None else [a + b for a, b in zip(total, scaled, strict=True)]
    return total


def _refuse_batched(
    axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any], differentiated: tuple[int, ...]
) -> None:
    """Gradients with respect to a batch argument are per row: not a sum, not fused."""
    batched = _batch.leaf_axes(axes, args, kwargs)
    for i in differentiated:
        label, axis = batched[i]
        if axis is not None:
            raise ValueError(
                f"{OPTION} accumulates gradients with respect to arguments without a batch "
                f"axis; this gradient is with respect to batch argument `{label}`. "
                f"Differentiate with respect to the parameters only, or drop {OPTION}."
            )


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _floating(primal: Any) -> bool:
    return _floating_dtype(jnp.result_type(primal.value))


def _floating_dtype(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _scalar_floating(leaf: Any) -> bool:
    return _floating_dtype(jnp.result_type(leaf)) and jnp.ndim(leaf) == 0
