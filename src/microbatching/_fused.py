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
from jax.core import Tracer
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.interpreters.ad import JVPTracer

from . import _accumulators, _batch, _sharding
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
    loops: dict[Any, tuple[Function, dict[str, Any]]] = {}  # one per differentiated set

    def gradient_loop(key: Any, body: Any) -> tuple[Function, dict[str, Any]]:
        """The loop of ``body`` for ``key``, and the cell its closed-over values are put
        in at each call: they are the loop's constants, so an eager loop is reused."""
        if key not in loops:
            cell: dict[str, Any] = {}
            both = dataclasses.replace(settings, accumulator=(settings.accumulator,) * 2)
            looped = loop(lambda weights, *a, **k: body(cell, *a, **k), axes, both)
            loops[key] = (lambda *a, **k: looped(a, k, None)), cell
        return loops[key]

    def call(*args: Any, **kwargs: Any) -> Any:
        _batch.check_call(axes, args, kwargs)  # before fun is traced below, with kwargs
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        program = _Program(fun, leaves, tree, arrays)
        hoisted = program.closed_over_tracers(axes, args, kwargs, settings.size)
        count = len(arrays)
        inputs = (*(leaves[i] for i in arrays), *hoisted)
        forward_ran: list[bool] = []  # an entry each time run_fwd returns

        @jax.custom_vjp
        def run(*values: Any) -> Any:
            a, k = program.rebuild(values[:count])
            return forward(*a, **k)

        def run_fwd(*primals: Any) -> tuple[Any, Any]:
            values = [p.value for p in primals]
            differentiated = tuple(j for j, p in enumerate(primals) if p.perturbed and _floating(p))
            _refuse_batched(axes, args, kwargs, [arrays[j] for j in differentiated if j < count])
            key = (differentiated, tree, tuple(arrays), len(hoisted))
            looped, cell = gradient_loop(key, program.value_and_gradients(differentiated))
            cell["index"] = {id(h): n for n, h in enumerate(hoisted)}
            cell["hoisted"] = values[count:]
            a, k = program.rebuild(values[:count])
            value, gradients = looped(*a, **k)
            # Which inputs were differentiated, and the manual axes each varies over, ride
            # in the residuals' structure (dictionary keys, no arrays): each call of this
            # rule (one per order of differentiation) hands its own to its backward rule.
            wrt = {(j, _sharding.varying(jax.typeof(values[j]))): None for j in differentiated}
            forward_ran.append(True)
            return value, (gradients, wrt)

        def run_bwd(residuals: Any, cotangent: Any) -> tuple[Any, ...]:
            gradients, wrt = residuals
            summed = _scaled_sum(gradients, cotangent)
            out: list[Any] = [None] * (count + len(hoisted))
            if summed is None:  # no cotangent reached an output
                return tuple(out)
            for (j, manual), g in zip(sorted(wrt), summed, strict=True):
                out[j] = _as_varying(g, manual)
            return tuple(out)

        run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
        try:
            return run(*inputs)
        except TypeError as err:
            # Under forward mode, after the forward rule: JAX refusing the tangent.
            if not (forward_ran and _forward_mode(inputs)):
                raise
            raise TypeError(
                f"{OPTION} computes the gradient in the forward loop for reverse mode only "
                "(jax.grad, jax.value_and_grad, jax.vjp, and jax.jvp of those); "
                "jax.jvp, jax.jacfwd and jax.linearize of the microbatched function itself "
                f"need the default: drop {OPTION}."
            ) from err

    return call


@dataclasses.dataclass(frozen=True)
class _Program:
    """``fun`` as a function of the call's array leaves (the rest of the call fixed).

    ``fun`` may close over values that an outer transformation traces, such as the
    parameters of ``jax.grad(lambda p: microbatch(lambda x: loss(p, x), ...)(x))``. The
    forward rule of a ``custom_vjp`` may not use those: they are found in ``fun``'s
    program (``closed_over_tracers``), passed to the ``custom_vjp`` as inputs, and put
    back in place of the program's constants when the loop runs it.
    """

    fun: Function
    leaves: list[Any]
    tree: Any
    arrays: list[int]

    def rebuild(self, values: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        filled = list(self.leaves)
        for i, value in zip(self.arrays, values, strict=True):
            filled[i] = value
        return jax.tree.unflatten(self.tree, filled)

    def flat(self, *values: Any) -> Any:
        a, k = self.rebuild(values)
        return self.fun(*a, **k)

    def closed_over_tracers(
        self, axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any], size: Any
    ) -> list[Any]:
        """The traced values that ``fun``'s program on one microbatch closes over."""
        batched = _batch.leaf_axes(axes, args, kwargs)
        structs = [_microbatch_struct(self.leaves[i], batched[i][1], size) for i in self.arrays]
        found: dict[int, Any] = {}
        for const in jax.make_jaxpr(self.flat)(*structs).consts:
            if isinstance(const, Tracer):
                found.setdefault(id(const), const)
        return list(found.values())

    def value_and_gradients(self, differentiated: tuple[int, ...]) -> Any:
        """The loop body: ``fun``'s result, and for each floating scalar output its
        gradients with respect to the inputs at ``differentiated`` (the call's array
        leaves, then the closed-over tracers, whose values the ``cell`` holds), None
        for other outputs. The body reads the rest of the call (Python values) from the
        microbatch's call, not from the first one's."""
        count = len(self.arrays)

        def body(cell: dict[str, Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            leaves = jax.tree.leaves((args, kwargs))
            current = dataclasses.replace(self, leaves=leaves)
            index, hoisted = cell["index"], list(cell["hoisted"])
            values = [leaves[i] for i in self.arrays] + hoisted

            def run(values: list[Any]) -> Any:
                arrays, replaced = values[:count], values[count:]
                program, shape = jax.make_jaxpr(current.flat, return_shape=True)(*arrays)
                consts = [replaced[index[id(c)]] if id(c) in index else c for c in program.consts]
                outs = jaxpr_as_fun(ClosedJaxpr(program.jaxpr, consts))(*arrays)
                return jax.tree.unflatten(jax.tree.structure(shape), outs)

            def of(chosen: list[Any]) -> tuple[list[Any], Any]:
                filled = list(values)
                for j, value in zip(differentiated, chosen, strict=True):
                    filled[j] = value
                out = run(filled)
                return [leaf for leaf in jax.tree.leaves(out) if _scalar_floating(leaf)], out

            # Varying like the batch inside shard_map: each device's gradient stays its
            # own partial sum (the backward rule adds them up once), where JAX would
            # all-reduce every microbatch's gradient of a replicated value.
            axes = sorted({a for v in values for a in _sharding.varying(jax.typeof(v))})
            chosen = [_sharding.varying_over(values[j], axes) for j in differentiated]
            scalars, vjp, out = jax.vjp(of, chosen, has_aux=True)
            it = iter(_per_output_vjps(scalars, vjp))
            grads = jax.tree.map(lambda leaf: next(it) if _scalar_floating(leaf) else None, out)
            return out, grads

        return body


def _forward_mode(inputs: tuple[Any, ...]) -> bool:
    """Whether an input carries a tangent of forward-mode differentiation (``jax.jvp``,
    ``jax.jacfwd``; reverse mode carries tracers of its own). JAX then runs the forward
    rule and refuses to push the tangent through a ``custom_vjp``: outside ``jit`` at
    once, in the call, with a ``TypeError``; under ``jit`` when the program runs."""
    return any(isinstance(x, JVPTracer) for x in inputs)


def _per_output_vjps(scalars: list[Any], vjp: Any) -> list[Any]:
    """The gradients of each scalar output: one backward pass each (batched)."""
    if not scalars:
        return []
    if len(scalars) == 1:
        return [vjp([jnp.ones_like(scalars[0])])[0]]
    eye = [jnp.eye(len(scalars), dtype=s.dtype)[:, k] for k, s in enumerate(scalars)]
    stacked = jax.vmap(lambda row: vjp(list(row))[0])(eye)
    return [jax.tree.map(lambda g, k=k: g[k], stacked) for k in range(len(scalars))]


def _microbatch_struct(leaf: Any, axis: int | None, size: int) -> Any:
    """The type of one microbatch of ``leaf`` (the leaf itself where it is not batched)."""
    if axis is None:
        return leaf
    shape = list(jnp.shape(leaf))
    axis = axis % len(shape)
    shape[axis] = min(size, shape[axis])
    return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(leaf))


def _as_varying(gradient: Any, manual: tuple[str, ...]) -> Any:
    """``gradient`` summed over the manual mesh axes it varies over and its input does
    not (inside ``shard_map``), as ``jax.grad`` sums the gradient of a replicated input."""
    extra = tuple(a for a in _sharding.varying(jax.typeof(gradient)) if a not in manual)
    return jax.lax.psum(gradient, extra) if extra else gradient


def _scaled_sum(gradients: Any, cotangent: Any) -> list[Any] | None:
    """Sum over outputs of the output's cotangent times its accumulated gradients."""
    total: list[Any] | None = None
    cotangents, outputs = jax.tree.flatten(cotangent, is_leaf=lambda c: isinstance(c, SymbolicZero))
    for grads, ct in zip(outputs.flatten_up_to(gradients), cotangents, strict=True):
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
    axes: BatchAxes, args: tuple[Any, ...], kwargs: dict[str, Any], differentiated: list[int]
) -> None:
    """Gradients with respect to a batch argument are per row: not a sum, not fused."""
    batched = _batch.leaf_axes(axes, args, kwargs)
    for i in differentiated:
        label, axis = batched[i]
        if axis is not None:
            raise ValueError(
                f"{OPTION} accumulates gradients with respect to arguments without a batch "
                f"axis; this derivative is with respect to batch argument `{label}` "
                "(jax.grad or jax.vjp with respect to it, or a jax.jvp tangent on it). "
                f"Differentiate with respect to the parameters only, or drop {OPTION} "
                "(forward mode of the microbatched function needs it dropped in any case)."
            )


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _floating(primal: Any) -> bool:
    return _floating_dtype(jnp.result_type(primal.value))


def _floating_dtype(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _scalar_floating(leaf: Any) -> bool:
    return _floating_dtype(jnp.result_type(leaf)) and jnp.ndim(leaf) == 0
