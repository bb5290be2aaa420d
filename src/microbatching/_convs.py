"""Convolutions in the loop body, in the dimension order XLA:CPU runs fast.

XLA:CPU runs a convolution through Eigen only when its operands are in the order
(batch, spatial..., feature) for the input and output and (spatial..., in, out) for the
kernel. Its compiler rewrites every other convolution into that order, with transposes
around it, but only in the program's top level (``ConvCanonicalization`` walks the entry
computation alone). A convolution inside a while loop keeps its order and runs as a plain
loop nest: the weight gradient of a strided 3x3 convolution, whose input is read with
batch and feature swapped, took 10x the time of the same gradient outside a loop
(``benchmarks/xla_conv_grad_in_loop_repro.py``).

``canonical`` does the same rewrite on ``fun``'s traced program before it becomes the loop
body. Transposes move elements without arithmetic and the convolution computes the same
sums, so the program's results are unchanged; only the order in which XLA adds within one
convolution may differ, as it does for the whole batch, which XLA rewrites alike.

Not reached: the weight gradient of a grouped convolution (``batch_group_count`` > 1).
XLA expands its groups after this rewrite, into a convolution of another order that only
the top level gets reordered, so in a loop it still runs as a loop nest.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var, new_jaxpr_eqn

_CONV = jax.lax.conv_general_dilated_p
_TRANSPOSE = jax.lax.transpose_p


def canonical(program: ClosedJaxpr) -> ClosedJaxpr:
    """``program`` with its convolutions, at any depth, in Eigen's order (on the CPU)."""
    if jax.default_backend() != "cpu" or not _has_other_order(program.jaxpr):
        return program
    return ClosedJaxpr(_rewrite(program.jaxpr), program.consts)


def _has_other_order(jaxpr: Jaxpr) -> bool:
    return any(_needs_rewrite(eqn) for eqn in jaxpr.eqns) or any(
        _has_other_order(sub) for eqn in jaxpr.eqns for sub in _subjaxprs(eqn.params)
    )


def _subjaxprs(params: dict[str, Any]) -> list[Jaxpr]:
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, Jaxpr):
                found.append(v)
    return found


def _rewrite(jaxpr: Jaxpr) -> Jaxpr:
    eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if _needs_rewrite(eqn):
            eqns.extend(_reordered(eqn) or [eqn])
        elif any(_has_other_order(sub) for sub in _subjaxprs(eqn.params)):
            eqns.append(eqn.replace(params=_rewrite_params(eqn.params)))
        else:
            eqns.append(eqn)
    return jaxpr.replace(eqns=eqns)


def _rewrite_params(params: dict[str, Any]) -> dict[str, Any]:
    """Sub-programs keep their inputs and outputs, so any primitive takes them back."""

    def one(v: Any) -> Any:
        if isinstance(v, ClosedJaxpr):
            return ClosedJaxpr(_rewrite(v.jaxpr), v.consts)
        return _rewrite(v) if isinstance(v, Jaxpr) else v

    return {
        k: tuple(one(x) for x in v) if isinstance(v, tuple) else one(v) for k, v in params.items()
    }


def _needs_rewrite(eqn: JaxprEqn) -> bool:
    if eqn.primitive is not _CONV or eqn.params.get("out_sharding") is not None:
        return False
    lhs, rhs, out = eqn.params["dimension_numbers"]
    spatial = len(lhs) - 2
    if not 1 <= spatial <= 3:  # Eigen's convolutions have 1 to 3 spatial dimensions
        return False
    return (lhs, rhs, out) != _eigen_order(len(lhs))


def _eigen_order(rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The dimension numbers (lhs, rhs, out specs) of NHWC input, HWIO kernel, NHWC out."""
    last, spatial = rank - 1, tuple(range(1, rank - 1))
    kernel_spatial = tuple(range(rank - 2))
    return (0, last, *spatial), (last, last - 1, *kernel_spatial), (0, last, *spatial)


def _reordered(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    """The equations of transpose, convolution in Eigen's order, transpose back; None
    where the types do not come out the same (then the equation stays as it is)."""
    lhs_spec, rhs_spec, out_spec = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    order = _eigen_order(len(lhs_spec))
    new_lhs, first = _transposed(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]), eqn)
    new_rhs, second = _transposed(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]), eqn)
    params = {**eqn.params, "dimension_numbers": type(eqn.params["dimension_numbers"])(*order)}
    out_aval, _ = _CONV.abstract_eval(new_lhs.aval, new_rhs.aval, **params)
    out_order = (out_spec[0], *out_spec[2:], out_spec[1])
    back = tuple(sorted(range(len(out_order)), key=out_order.__getitem__))
    back_aval, _ = _TRANSPOSE.abstract_eval(out_aval, permutation=back)
    if back_aval != eqn.outvars[0].aval:
        return None
    conv_out = Var(out_aval)
    conv = new_jaxpr_eqn(
        [new_lhs, new_rhs], [conv_out], _CONV, params, eqn.effects, eqn.source_info, eqn.ctx
    )
    undo = new_jaxpr_eqn(
        [conv_out],
        eqn.outvars,
        _TRANSPOSE,
        {"permutation": back},
        eqn.effects,
        eqn.source_info,
        eqn.ctx,
    )
    return [*first, *second, conv, undo]


def _transposed(atom: Any, permutation: tuple[int, ...], eqn: JaxprEqn) -> tuple[Any, list]:
    """``atom`` with its dimensions in ``permutation``'s order, and the equation doing it."""
    if permutation == tuple(range(len(permutation))):
        return atom, []
    aval, _ = _TRANSPOSE.abstract_eval(atom.aval, permutation=permutation)
    out = Var(aval)
    moved = new_jaxpr_eqn(
        [atom],
        [out],
        _TRANSPOSE,
        {"permutation": permutation},
        eqn.effects,
        eqn.source_info,
        eqn.ctx,
    )
    return out, [moved]
