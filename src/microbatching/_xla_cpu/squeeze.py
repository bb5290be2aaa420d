"""Reductions in the loop body without dimensions of size 1, where XLA:CPU runs them fast.

A per-example function that sees each example as a batch of one (``keep_batch_dim``, the
default) works on arrays like ``(1, T, C)``; mapped over a microbatch they are ``(B, 1,
T, C)``. XLA:CPU (jax 0.10.2) hands a reduction of such an array to YNNPACK, which runs
it about ten times slower than the same reduction of the array without its dimension of
size 1: summing ``(64, 1, 64, 128)`` over the tokens took 3.3 ms, ``(64, 64, 128)`` 0.36
ms (``benchmarks/xla_unit_dim_reduce_repro.py``). On the tied transformer LM of
``benchmarks/clipping.py`` these reductions (a LayerNorm's per-example scale gradient, its
mean and variance) took a quarter of a clipped step's time.

``squeezed`` rewrites each such reduction of ``fun``'s traced program, at any depth: a
reshape that drops the operand's dimensions of size 1 (a bitcast in XLA, no copy), the
reduction over the dimensions left, and a reshape back to the result's type. The
reduction adds the same elements; only the order XLA adds them in may differ, as between
any two compilations. Derivatives, ``vmap`` and sharding rules go through reshapes and
reductions as through any other primitives.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Var, new_jaxpr_eqn

from .. import _primitives, _programs
from . import workarounds as _workarounds

_REDUCTIONS = (jax.lax.reduce_sum_p, jax.lax.reduce_max_p, jax.lax.reduce_min_p)
_RESHAPE = jax.lax.reshape_p


def squeezed(program: ClosedJaxpr) -> ClosedJaxpr:
    """``program`` with its reductions of arrays with dimensions of size 1, at any depth,
    taken without those dimensions, where ``_workarounds.UNIT_REDUCE`` applies."""
    if not _workarounds.UNIT_REDUCE.applies():
        return program
    return _programs.rewritten(program, _replacement)


def _replacement(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    return _without_units(eqn) if _needs_rewrite(eqn) else None


def _needs_rewrite(eqn: JaxprEqn) -> bool:
    """A reduction of a plain array (no sharding, not varying over manual axes) with a
    dimension of size 1 beside at least one other."""
    if eqn.primitive not in _REDUCTIONS or not _primitives.as_checked(eqn):
        return False
    if eqn.params.get("out_sharding") is not None:
        return False
    aval = eqn.invars[0].aval
    shape = getattr(aval, "shape", ())
    if len(shape) < 2 or 1 not in shape or all(d == 1 for d in shape):
        return False
    spec = getattr(getattr(aval, "sharding", None), "spec", ())
    return not getattr(aval, "vma", None) and all(s is None for s in spec)


def _without_units(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    """Reshape to the non-unit dimensions, reduce over those of ``axes``, reshape to the
    result's type; None where the types do not come out the same."""
    (x,), (out,) = eqn.invars, eqn.outvars
    shape, axes = getattr(x.aval, "shape", ()), tuple(eqn.params["axes"])
    result = getattr(out.aval, "shape", ())
    kept = [d for d, size in enumerate(shape) if size != 1]
    first, flat = _reshape(x, tuple(shape[d] for d in kept), eqn)
    params = {**eqn.params, "axes": tuple(i for i, d in enumerate(kept) if d in axes)}
    reduced, _ = eqn.primitive.abstract_eval(flat.aval, **params)
    reduced_var = Var(reduced)
    middle = new_jaxpr_eqn([flat], [reduced_var], eqn.primitive, params, *_context(eqn))
    last, back = _reshape(reduced_var, result, eqn, out)
    return [first, middle, last] if back is out else None


def _reshape(
    x: Any, shape: tuple[int, ...], eqn: JaxprEqn, out: Var | None = None
) -> tuple[JaxprEqn, Var]:
    """An equation that reshapes ``x`` to ``shape``, with ``eqn``'s effects and source,
    and the variable it writes: ``out`` where that has the reshaped type, else a new
    one."""
    params = {"new_sizes": shape, "dimensions": None, "sharding": None}
    aval, _ = _RESHAPE.abstract_eval(x.aval, **params)
    target = out if out is not None and out.aval == aval else Var(aval)
    return new_jaxpr_eqn([x], [target], _RESHAPE, params, *_context(eqn)), target


def _context(eqn: JaxprEqn) -> tuple[Any, Any, Any]:
    """``eqn``'s effects, source and context, for the equations that replace it."""
    return eqn.effects, eqn.source_info, eqn.ctx
