"""The ``embedding`` rule: a leaf that is the table of one gather of whole rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..program import Const, Eqn, Program, Site, _key
from .base import Cost, GhostRule
from .gram import _gram_sum, _reliable, gram_matrices
from .products import _from_gram, _product_of_rows, _scaled


def _is_row_gather(program: Program, e: Eqn) -> bool:
    """Whether ``e`` takes whole rows of a matrix: ``table[ids]``."""
    table, ids = (program.avals[a].shape if not isinstance(a, Const) else None for a in e.ins)
    numbers = e.params["dimension_numbers"]
    return (
        table is not None
        and ids is not None
        and len(table) == 2
        and len(ids) >= 1
        and ids[-1] == 1
        and tuple(numbers.offset_dims) == (len(ids) - 1,)
        and tuple(numbers.collapsed_slice_dims) == (0,)
        and tuple(numbers.start_index_map) == (0,)
        and not numbers.operand_batching_dims
        and tuple(e.params["slice_sizes"]) == (1, table[1])
    )


def _embedding_norm(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any], gram: bool
) -> tuple[jax.Array, jax.Array]:
    """One example's norm of the scattered rows at a row gather ``table[ids]``: from the
    Gram matrix of the cotangents of equal ids (``gram``, checked by ``_reliable``), or
    from the scattered rows themselves."""
    e = program.eqns[site.eqn]
    (ids,), (g,) = inputs, cotangents
    rows, width = program.avals[e.ins[0]].shape  # type: ignore[index]
    ids = ids.reshape(-1)
    g = g.reshape(ids.shape[0], width)
    if e.params["mode"] != jax.lax.GatherScatterMode.CLIP:  # the scatter drops them
        g = jnp.where(((ids >= 0) & (ids < rows))[:, None], g, jnp.zeros((), g.dtype))
    ids = jnp.clip(ids, 0, rows - 1)
    gs, mg = _scaled(g)
    if not gram:
        scattered = jnp.zeros((rows, width), gs.dtype).at[ids].add(gs)
        return _product_of_rows(scattered, *mg), jnp.ones((), bool)
    same = (ids[:, None] == ids[None, :]).astype(gs.dtype)  # the ids' Gram matrix, exact
    gg = gram_matrices(gs[None])[0]
    total, error = _gram_sum(same, gg, n=width, exact=True)
    reliable = _reliable(total, error)
    return _from_gram(jnp.where(reliable, total, 1), *mg), reliable


def _cost(program: Program, site: Site) -> Cost | None:
    """The Gram form where the ids' Gram matrix (``T^2``) is no larger than the table,
    else the scattered rows; None unless the table is the parameter, gathered by rows."""
    e = program.eqns[site.eqn]
    if site.free != (0,) or not _is_row_gather(program, e):
        return None
    rows, width = program.avals[_key(program, site, 0)].shape
    t = math.prod(program.avals[e.outs[0]].shape) // max(width, 1)
    scatter = rows * width + t * width
    if t * t <= rows:
        return Cost("gram", t * t * width, t * t + t * width, scatter)
    return Cost("product", t * width + rows * width, scatter, scatter)


RULE = GhostRule("embedding", _cost, _embedding_norm)
"""The rows of a table gathered by the example's ids: ``sum_ts [i_t = i_s] (g_t.g_s)``."""
