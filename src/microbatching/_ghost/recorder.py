"""One batched pass that records every site's data inputs and output cotangents."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import jaxpr_as_fun

from .. import _sharding
from .._primitives import facts
from .program import Const, Program, Site, _inexact, _read, free_values


def _floating(program: Program, keys: Sequence[int]) -> list[bool]:
    """Which of a site's outputs carry a cotangent: floating, and reached by the
    derivative (an unused output of a ``scan`` or ``cond`` site gets none, as in JAX,
    where a zero would meet the data in its products: ``inf * 0``)."""
    return [k in program.live and _inexact(program, k) for k in keys]


def _site_outputs(
    program: Program, site: Site, env: dict[int, Any], inputs: Sequence[Any]
) -> list[Any]:
    """The floating outputs of ``site`` at the free values ``env`` and data ``inputs``."""
    e = program.eqns[site.eqn]
    given = dict(zip(site.data, inputs, strict=True))
    outs = e.bind([given[p] if p in given else _read(env, a) for p, a in enumerate(e.ins)])
    return [o for o, f in zip(outs, _floating(program, e.outs), strict=True) if f]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What one batched pass records: per example, the program's outputs, and per site
    its data inputs and the loss's cotangents of its floating outputs."""

    outs: list[Any]
    inputs: list[list[Any]]
    cotangents: list[list[Any]]


def record(program: Program, params: Sequence[Any], example: Sequence[Any]) -> Recorded:
    """The forward pass over a batch of examples (leaves stacked on axis 0), and the
    backward pass from each example's loss to every site's outputs."""
    env = free_values(program, params)
    sites = {s.eqn: k for k, s in enumerate(program.sites)}
    computed: list[list[bool]] = [[] for _ in program.sites]
    """Per site and floating output, whether JAX's backward pass computes its cotangent
    (is not a symbolic zero); set by ``_tap`` as the backward pass is traced."""

    def forward(data: Sequence[Any], taps: list[list[Any]]) -> tuple[Any, Any]:
        values = dict(env)
        values.update(
            zip(range(program.n_params, program.n_params + program.n_data), data, strict=True)
        )
        inputs: list[list[Any]] = [[] for _ in program.sites]
        for i, e in enumerate(program.eqns):
            if all(program.free(a) for a in e.ins):
                continue
            ins = [_read(values, a) for a in e.ins]
            outs = e.bind(ins)
            k = sites.get(i)
            if k is not None and not facts(e).additive:
                inputs[k] = [ins[p] for p in program.sites[k].data]
            if k is not None and program.sites[k].same_as is None:
                tapped = iter(taps[k])
                floating = _floating(program, e.outs)
                outs = [
                    _tap(o, next(tapped), computed[k]) if f else o
                    for o, f in zip(outs, floating, strict=True)
                ]
            values.update(zip(e.outs, outs, strict=True))
        outs = [_read(values, a) for a in program.outs]
        return outs[0], (outs, inputs)

    def one(data: Sequence[Any]) -> tuple[Any, Any, Any]:
        taps = [
            [
                _zeros(program.avals[o])
                for o, f in zip(
                    program.eqns[s.eqn].outs,
                    _floating(program, program.eqns[s.eqn].outs),
                    strict=True,
                )
                if f
            ]
            if s.same_as is None
            else []
            for s in program.sites
        ]
        value, pull, (outs, inputs) = jax.vjp(lambda t: forward(data, t), taps, has_aux=True)
        (cotangents,) = pull(jnp.ones_like(value))
        return outs, inputs, cotangents

    closed, shapes = jax.make_jaxpr(jax.vmap(one), return_shape=True)(list(example))
    flat = jaxpr_as_fun(closed)(*jax.tree.leaves(list(example)))
    outs, inputs, cotangents = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    for k in reversed(range(len(program.sites))):
        shared = program.sites[k].same_as
        if shared is not None:
            cotangents[k] = cotangents[shared]
            computed[k] = computed[shared]
    rows = example[0].shape[0]
    for k, site in enumerate(program.sites):
        e = program.eqns[site.eqn]
        if facts(e).additive:  # their products never read the data
            avals = [program.avals[e.ins[p]] for p in site.data]  # type: ignore[index]
            inputs[k] = [jnp.zeros((rows, *a.shape), a.dtype) for a in avals]
        elif facts(e).bilinear and not any(computed[k]):
            inputs[k] = _unreached_zeroed(inputs[k], cotangents[k])
    return Recorded(outs, inputs, cotangents)


def recorded_bytes(program: Program) -> int:
    """Bytes per example of what ``record`` keeps until the clipped sum: each site's
    inputs that depend on the example, and its outputs' cotangents."""
    total = 0
    for site in program.sites:
        e = program.eqns[site.eqn]
        keys = [a for p, a in enumerate(e.ins) if p in site.data and not isinstance(a, Const)]
        keys += [k for k, f in zip(e.outs, _floating(program, e.outs), strict=True) if f]
        for k in keys:
            aval = program.avals[k]
            total += int(np.prod(aval.shape, dtype=np.int64)) * jnp.dtype(aval.dtype).itemsize
    return total


def _tap(out: Any, tap: Any, computed: list[bool]) -> Any:
    """``out + tap``, appending to ``computed`` whether the backward pass gives the sum
    a cotangent that it computes (the user's ``custom_vjp`` returning ``zeros_like``
    computes one: it meets the data in JAX's product) or a symbolic zero (an output that
    reaches the loss only through an unused output, a rule that returns None: JAX never
    forms that product). A static fact of the trace, the same for every example."""

    @jax.custom_vjp
    def add(out: Any, tap: Any) -> Any:
        return out + tap

    def forward(out: Any, tap: Any) -> tuple[Any, None]:
        return out.value + tap.value, None

    def backward(_: None, cotangent: Any) -> tuple[Any, Any]:
        computed.append(not isinstance(cotangent, SymbolicZero))
        return cotangent, cotangent

    add.defvjp(forward, backward, symbolic_zeros=True)
    return add(out, tap)


def _unreached_zeroed(inputs: list[Any], cotangents: list[Any]) -> list[Any]:
    """A bilinear site's floating data inputs, with each entry that is not finite
    read as 0 for an example whose cotangents there are all zero; for a site whose
    cotangents JAX's backward pass does not compute from the example (``record``).
    Where it does, a cotangent that comes out 0 (``tanh`` saturated by an infinite
    input) meets the data in JAX's product, and ``inf * 0`` makes that example's
    gradient NaN, as it is here.

    Its product is then 0, as it is where JAX's backward pass gives the site a symbolic
    zero (an output that reaches the loss only through an unused output of a ``sort``,
    ``scan``, ``cond`` or ``custom_jvp`` call, or through a rule whose tangent is zero,
    which ``_differentiated`` cannot tell apart), where ``inf * 0`` would make the norm
    and the sum NaN. Only there: a product linear in the data is 0 at data 0, where
    another site's (``p / x``, a ``log`` in a ``scan`` body) may not be finite. And only
    entries that are not finite: a finite entry is kept, so that an outer derivative
    still sees the product's dependence on the data where the cotangent is 0 but its
    derivative is not."""
    if not cotangents:
        return inputs
    reached = functools.reduce(
        jnp.logical_or,
        [jnp.any(g != 0, axis=tuple(range(1, g.ndim))) for g in cotangents],
    )
    return [
        jnp.where(at_rows(reached, x) | jnp.isfinite(x), x, jnp.zeros((), x.dtype))
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else x
        for x in inputs
    ]


def _zeros(aval: Any) -> jax.Array:
    """Zeros of ``aval``'s type: varying over the same manual mesh axes (``shard_map``),
    for the cotangent of a tap that did not vary would be summed over those axes; and on
    its Explicit mesh, for the cotangent is resharded to the tap's type, which for a
    scalar made by ``jnp.zeros`` alone is no mesh at all (see ``_sharding.full``)."""
    return _sharding.full(aval, 0)


def at_rows(keep: jax.Array, x: jax.Array) -> jax.Array:
    """``keep`` of shape ``(rows,)`` broadcast against ``x`` along its axis 0."""
    return jnp.reshape(keep, keep.shape + (1,) * (jnp.ndim(x) - 1))
