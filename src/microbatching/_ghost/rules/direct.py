"""The ``direct`` rule, for any other leaf: its own per-example gradient from its sites'
products, a chunk of examples at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ... import _clipping, _layout, _tuning
from ..program import Program, free_values
from ..recorder import Recorded, _site_outputs


def _direct_sites(program: Program, leaves: Sequence[int]) -> list[int]:
    return sorted({k for leaf in leaves for k in program.rules[leaf].sites})


def _free_with(
    program: Program, params: Sequence[Any], leaves: Sequence[int], values: Sequence[Any]
) -> dict[int, Any]:
    """``free_values`` with ``values`` in place of the parameter ``leaves``."""
    full = list(params)
    for leaf, v in zip(leaves, values, strict=True):
        full[leaf] = v
    return free_values(program, full)


def per_example_grads(
    program: Program, params: Sequence[Any], leaves: Sequence[int], sites: Sequence[int]
) -> Callable[[Any, Any], list[Any]]:
    """One example's gradients of ``leaves`` from the products at ``sites``."""

    def grads(inputs: Sequence[Any], cotangents: Sequence[Any]) -> list[Any]:
        def outs_of(values: Sequence[Any]) -> list[Any]:
            env = _free_with(program, params, leaves, values)
            return [
                _site_outputs(program, program.sites[k], env, a)
                for k, a in zip(sites, inputs, strict=True)
            ]

        _, pull = jax.vjp(outs_of, [params[leaf] for leaf in leaves])
        return pull(list(cotangents))[0]

    return grads


def chunk(program: Program, leaves: Sequence[int]) -> int:
    """How many examples' gradients of ``leaves`` fit in ``_tuning.Knobs.direct_chunk_bytes``."""
    size = sum(
        math.prod(program.avals[leaf].shape) * program.avals[leaf].dtype.itemsize for leaf in leaves
    )
    return max(1, _tuning.knobs().direct_chunk_bytes // max(size, 1))


def _direct_norms(
    program: Program, params: Sequence[Any], seen: Recorded, leaves: Sequence[int]
) -> list[jax.Array]:
    sites = _direct_sites(program, leaves)
    grads = per_example_grads(program, params, leaves, sites)

    def norms(pair: Any) -> list[jax.Array]:
        return [_clipping.norm(g) for g in grads(*pair)]

    xs = ([seen.inputs[k] for k in sites], [seen.cotangents[k] for k in sites])
    return _layout.map_chunks(jax.vmap(norms), xs, chunk(program, leaves))
