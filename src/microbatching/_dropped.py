"""Rows that ``nan_safe`` drops, kept out of derivatives taken through ``micro_grad``.

``nan_safe`` drops an example whose gradient is not finite once its norm is known,
inside the microbatch's step. Its contribution is then 0, but the step still ran on its
data: a derivative of the result (``jax.grad`` of a function of the clipped sum) would
pass a cotangent of 0 back through that row's computation, and ``0 * nan`` is NaN.

``drops_in_derivatives`` wraps a step so that its value is computed as before, in one
pass, and only its derivative takes a second look: it finds the rows the step drops
(``kept``), replaces their data by a kept row's and gives them weight 0, the way rows of
``example_weights`` 0 are kept out of everything, and differentiates the step there. A
derivative through ``nan_safe`` therefore costs the norms once more and the step's
forward-mode derivative on the cleaned rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _layout, _sharding
from ._signature import BatchAxes

Step = Callable[..., Any]
"""``step(plan, weights, *args, **kwargs)``: a microbatch's result; ``weights`` an array
of one weight per row (``nan_safe`` always gives the loop one, ``_grad``)."""

Kept = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], jax.Array]
"""``kept(plan, weights, args, kwargs)``: which rows of the microbatch the step keeps
(a finite gradient and a weight other than 0), as the step itself decides it."""


def drops_in_derivatives(
    step: Step, kept: Kept, axes: BatchAxes, mesh_axes: tuple[str, ...] | None
) -> Step:
    """``step`` with the same value, whose derivatives leave out the rows it drops."""

    def safe(plan: Any, weights: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((weights, args, kwargs))
        traced = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]

        def rebuilt(values: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
            full = list(leaves)
            for i, value in zip(traced, values, strict=True):
                full[i] = value
            return jax.tree.unflatten(tree, full)

        def flat(w: Any, a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
            full = jax.tree.leaves((w, a, k))
            return tuple(full[i] for i in traced)

        def plain(*values: Any) -> Any:
            w, a, k = rebuilt(values)
            return step(plan, w, *a, **k)

        # What the step closes over (a value the loss holds, a traced bound) becomes an
        # argument: a custom_jvp would give it no derivative.
        dynamic = tuple(leaves[i] for i in traced)
        converted, consts = jax.closure_convert(plain, *dynamic)
        finds, found_with = jax.closure_convert(
            lambda *values: kept(plan, *rebuilt(values)), *dynamic
        )
        # The derivative's own trace of the step, whose branches ``jax.grad`` can
        # transpose under ``jax.vmap`` (``_sharding.transposable_branches``); a function
        # of its own, as closure_convert caches its traces by function.
        with _sharding.transposable_branches():
            pushing, pushed_with = jax.closure_convert(lambda *v: plain(*v), *dynamic)
        count, used = len(dynamic), len(dynamic) + len(consts)
        pushes = used + len(found_with)

        @jax.custom_jvp
        def run(*values: Any) -> Any:
            return converted(*values[:used])  # the rest: what ``kept`` and the jvp hold

        @run.defjvp
        def derivative(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
            out = run(*primals)
            w, a, k = rebuilt(primals[:count])
            keep = finds(*primals[:count], *primals[used:pushes])
            cleaned = flat(_zeroed(w, keep), *_standing_in(a, k, keep, axes, mesh_axes))

            def moved() -> list[Any]:
                held = (*cleaned, *primals[pushes:])
                pushed = jax.jvp(pushing, held, (*tangents[:count], *tangents[pushes:]))[1]
                return [t for t in jax.tree.leaves(pushed) if _moves(t)]

            outs, structure = jax.tree.flatten(out)
            still = lambda: [jnp.zeros_like(o) for o in outs if _moves(o)]  # noqa: E731
            floats = iter(_sharding.cond(_any_kept(keep), moved, still))
            return out, structure.unflatten(
                [next(floats) if _moves(o) else _no_tangent(o) for o in outs]
            )

        return run(*dynamic, *consts, *found_with, *pushed_with)

    return safe


def _zeroed(weights: jax.Array, keep: jax.Array) -> jax.Array:
    return jnp.where(keep, weights, jnp.zeros((), weights.dtype))


def _standing_in(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    keep: jax.Array,
    axes: BatchAxes,
    mesh_axes: tuple[str, ...] | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The batch arguments with each dropped row replaced by the first kept row."""

    def replaced(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array | np.ndarray) or not jnp.ndim(leaf):
            return leaf
        ref = _layout.kept_row(jnp.asarray(leaf), 0, keep, mesh_axes)
        shape = (-1,) + (1,) * (jnp.ndim(leaf) - 1)
        return jnp.where(jnp.reshape(keep, shape), leaf, ref)

    def each(where: int | str, arg: Any) -> Any:
        return arg if axes.spec(where) is None else jax.tree.map(replaced, arg)

    return (
        tuple(each(i, a) for i, a in enumerate(args)),
        {n: each(n, v) for n, v in kwargs.items()},
    )


def _any_kept(keep: jax.Array) -> jax.Array:
    """Whether a row is kept; inside ``shard_map``, on any device (the step may hold
    collectives that a device skipping it would leave the others waiting on)."""
    some = jnp.any(keep)
    varying = _sharding.varying(jax.typeof(some))
    if varying:
        some = jax.lax.psum(some.astype(jnp.int32), varying) > 0
    return some


def _moves(x: Any) -> bool:
    """Whether an output (or its tangent) has a tangent that can be other than 0."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype != jax.dtypes.float0 and jnp.issubdtype(dtype, jnp.inexact)


def _no_tangent(x: Any) -> np.ndarray:
    return np.zeros(jnp.shape(x), jax.dtypes.float0)
