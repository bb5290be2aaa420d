"""The ``dense`` rule: a leaf that reaches exactly one ``dot_general``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..program import Eqn, Program, Site
from .base import Cost, GhostRule
from .products import _product_cost, _product_norm


def _dense_dims(program: Program, e: Eqn, free: int) -> tuple[int, int, int, int]:
    """``(H, T, K, N)`` of a ``dot_general`` whose operand ``free`` is the parameter:
    ``H`` shared batch entries, ``T`` rows of the example, ``K`` contracted, ``N`` out."""
    (contract, batch), (x, w) = (
        _dense_axes(e),
        (
            program.avals[e.ins[1 - free]].shape,  # type: ignore[index]
            program.avals[e.ins[free]].shape,  # type: ignore[index]
        ),
    )
    h = math.prod(x[d] for d in batch[1 - free])
    k = math.prod(x[d] for d in contract[1 - free])
    return h, math.prod(x) // max(h * k, 1), k, math.prod(w) // max(h * k, 1)


def _dense_axes(e: Eqn) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """``((lhs, rhs) contracting, (lhs, rhs) batch)`` dimensions of a ``dot_general``."""
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def shared_inputs(program: Program) -> list[list[int]]:
    """The leaves whose Gram forms can share the Gram matrix of their data input: dense
    sites that read the same value, as rows of the same layout (``q``, ``k`` and ``v``
    of one input), in groups of two or more."""
    groups: dict[Any, list[int]] = {}
    for leaf, rule in enumerate(program.rules):
        if rule.name == "dense" and rule.form == "gram":
            site = program.sites[rule.sites[0]]
            e = program.eqns[site.eqn]
            (contract, batch), data = _dense_axes(e), 1 - site.free[0]
            groups.setdefault((e.ins[data], contract[data], batch[data]), []).append(leaf)
    return [leaves for leaves in groups.values() if len(leaves) > 1]


def _dense_norm(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any], gram: bool
) -> tuple[jax.Array, jax.Array]:
    """One example's norm of ``x^T g`` at a ``dot_general`` site, and whether it is
    reliable (``_product_norm``)."""
    return _product_norm(*_dense_rows(program, site, inputs, cotangents), gram)


def _dense_rows(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any]
) -> tuple[jax.Array, jax.Array]:
    """One example's rows ``(H, T, K)`` and ``(H, T, N)`` of a ``dot_general`` site's
    weight gradient ``sum_t x_t (outer) g_t`` (per shared entry ``h``), at least float32."""
    e = program.eqns[site.eqn]
    free = site.free[0]
    (x,), (g,) = inputs, cotangents
    (contract, batch) = _dense_axes(e)
    xc, xb = contract[1 - free], batch[1 - free]
    xf = tuple(d for d in range(x.ndim) if d not in xc and d not in xb)
    nb = len(xb)
    wf = len(program.avals[e.ins[free]].shape) - len(contract[free]) - len(batch[free])  # type: ignore[index]
    if free == 1:
        gx, gw = tuple(range(nb, nb + len(xf))), tuple(range(nb + len(xf), nb + len(xf) + wf))
    else:
        gw, gx = tuple(range(nb, nb + wf)), tuple(range(nb + wf, nb + wf + len(xf)))
    h, t, k, n = _dense_dims(program, e, free)
    wide = jnp.promote_types(jnp.promote_types(x.dtype, g.dtype), jnp.float32)
    xs = jnp.transpose(x, xb + xf + xc).reshape(h, t, k).astype(wide)
    gs = jnp.transpose(g, tuple(range(nb)) + gx + gw).reshape(h, t, n).astype(wide)
    return xs, gs


def _cost(program: Program, site: Site) -> Cost | None:
    """The product's cost where the parameter is one operand and the data the other."""
    if site.data != (1 - site.free[0],):
        return None
    return _product_cost(*_dense_dims(program, program.eqns[site.eqn], site.free[0]))


RULE = GhostRule("dense", _cost, _dense_norm, rows=_dense_rows)
"""``||A^T G||`` at a ``dot_general`` of the data ``A`` and the parameter, ``G`` its
output cotangents (rows ``T`` over the example's free dimensions, ``H`` over shared
batch dimensions)."""
