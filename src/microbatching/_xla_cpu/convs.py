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

Derivatives are the harder half. ``jax.grad`` of the loop (``jax.grad(microbatch(loss))``)
is JAX's transpose of the loop body, and JAX's transpose of a convolution in Eigen's
order is a weight gradient in another order again, which the library never sees. So
each convolution of the body (ungrouped, 1 to 3 spatial dimensions) is also given a
``custom_jvp`` (``_eigen``): its value is the same convolution, and its tangent is the
same linear map written with the input as (feature, spatial..., batch), the kernel as
(in, spatial..., out) and the output as (spatial..., batch, feature) for the weight
term, and the kernel as (spatial..., out, in) for the input term. JAX transposes those
into convolutions in Eigen's order. Forward mode, ``vmap`` and higher derivatives go
through the rule as through any other function.

Not reached: the weight gradient of a grouped convolution (``batch_group_count`` > 1).
XLA expands its groups after this rewrite, into a convolution of another order that only
the top level gets reordered, so in a loop it still runs as a loop nest.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import (
    ClosedJaxpr,
    JaxprEqn,
    Var,
    new_jaxpr_eqn,
)

from .. import _primitives, _programs
from . import workarounds as _workarounds

_CONV = jax.lax.conv_general_dilated_p
_TRANSPOSE = jax.lax.transpose_p


def canonical(program: ClosedJaxpr) -> ClosedJaxpr:
    """``program`` with its convolutions, at any depth, in Eigen's order and with
    derivatives in Eigen's order, where ``_workarounds.CONV_ORDER`` applies (XLA:CPU)."""
    if not _workarounds.CONV_ORDER.applies():
        return program
    return _programs.rewritten(program, _replacement)


def _replacement(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    if _takes_rule(eqn) and (spliced := _with_rule(eqn)) is not None:
        return spliced
    if _needs_rewrite(eqn):
        return _reordered(eqn) or [eqn]
    return None


def _needs_rewrite(eqn: JaxprEqn) -> bool:
    if eqn.primitive is not _CONV or not _primitives.as_checked(eqn):
        return False
    if eqn.params.get("out_sharding") is not None:
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


def _takes_rule(eqn: JaxprEqn) -> bool:
    """An ungrouped convolution that Eigen runs (1 to 3 spatial dimensions)."""
    if eqn.primitive is not _CONV or not _primitives.as_checked(eqn):
        return False
    if eqn.params.get("out_sharding") is not None:
        return False
    groups = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    return groups == (1, 1) and 1 <= len(eqn.params["dimension_numbers"][0]) - 2 <= 3


def _with_rule(eqn: JaxprEqn) -> list[JaxprEqn] | None:
    """The equations of ``_ordered_with_rule`` on the convolution's operands, in place of
    it; None where they would not give the same types (sharded or varying operands)."""
    params = tuple(sorted(eqn.params.items()))
    structs = [_struct(v.aval) for v in eqn.invars]
    inner = jax.make_jaxpr(lambda x, w: _ordered_with_rule(x, w, params))(*structs)
    types = [v.aval for v in inner.jaxpr.invars], [v.aval for v in inner.jaxpr.outvars]
    if inner.consts or types != ([v.aval for v in eqn.invars], [eqn.outvars[0].aval]):
        return None
    if not all(isinstance(v, Var) for v in inner.jaxpr.outvars):
        return None
    rename = dict(zip(inner.jaxpr.invars, eqn.invars, strict=True))
    rename[inner.jaxpr.outvars[0]] = eqn.outvars[0]

    def renamed(atoms: Any) -> list[Any]:
        return [rename.get(a, a) if isinstance(a, Var) else a for a in atoms]

    return [
        e.replace(
            invars=renamed(e.invars),
            outvars=renamed(e.outvars),
            source_info=eqn.source_info,
            ctx=eqn.ctx,
        )
        for e in inner.jaxpr.eqns
    ]


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _ordered_with_rule(x: jax.Array, w: jax.Array, params: tuple[Any, ...]) -> jax.Array:
    """The convolution of ``params``, run in Eigen's order through ``_eigen``."""
    given = dict(params)
    lhs, rhs, out = given["dimension_numbers"]
    eigen = {**given, "dimension_numbers": _numbers(*_eigen_order(len(lhs)))}
    y = _eigen(
        _moved(x, (lhs[0], *lhs[2:], lhs[1])),
        _moved(w, (*rhs[2:], rhs[1], rhs[0])),
        tuple(sorted(eigen.items())),
    )
    order = (out[0], *out[2:], out[1])
    return _moved(y, tuple(sorted(range(len(order)), key=order.__getitem__)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _eigen(x: jax.Array, w: jax.Array, params: tuple[Any, ...]) -> jax.Array:
    """A convolution in Eigen's order (NHWC input, HWIO kernel), whose tangent JAX
    transposes into convolutions in Eigen's order."""
    return _CONV.bind(x, w, **dict(params))


@functools.partial(_eigen.defjvp, symbolic_zeros=True)
def _eigen_jvp(params: tuple[Any, ...], primals: Any, tangents: Any) -> tuple[Any, Any]:
    x, w = primals
    dx, dw = tangents
    given = dict(params)
    rank = x.ndim
    n = rank - 2  # spatial dimensions
    canonical_lhs, _, canonical_out = _eigen_order(rank)
    kernel_spatial = tuple(range(n))
    terms = []
    if not isinstance(dx, SymbolicZero):  # kernel as (spatial..., out, in)
        numbers = _numbers(canonical_lhs, (n, n + 1, *kernel_spatial), canonical_out)
        swapped = _moved(w, (*kernel_spatial, n + 1, n))
        terms.append(_CONV.bind(dx, swapped, **{**given, "dimension_numbers": numbers}))
    if not isinstance(dw, SymbolicZero):  # input (C, spatial, N), kernel (I, spatial, O)
        spatial = tuple(range(1, n + 1))
        numbers = _numbers((n + 1, 0, *spatial), (n + 1, 0, *spatial), (n, n + 1, *kernel_spatial))
        features_first = _moved(x, (n + 1, *spatial, 0))
        inputs_first = _moved(dw, (n, *kernel_spatial, n + 1))
        y = _CONV.bind(features_first, inputs_first, **{**given, "dimension_numbers": numbers})
        terms.append(_moved(y, (n, *kernel_spatial, n + 1)))
    primal = _eigen(x, w, params)
    tangent = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    return primal, tangent


def _numbers(lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...]) -> Any:
    return jax.lax.ConvDimensionNumbers(lhs_spec=lhs, rhs_spec=rhs, out_spec=out)


def _moved(x: jax.Array, permutation: tuple[int, ...]) -> jax.Array:
    if permutation == tuple(range(len(permutation))):
        return x
    return jax.lax.transpose(x, permutation)
