"""Per-example weight gradients as the product XLA:CPU hands to YNNPACK.

JAX transposes ``x @ w`` for ``w``'s gradient as a product of the cotangent and the
input, ``dot_general(g, x)``, and then a transpose of that product's result. Mapped over
a microbatch (``vmap(grad)``, as ``materialize`` forms the per-example gradients) the
product is batched over the examples, ``(B, T, p) x (B, T, d) -> (B, p, d)``, and the
transpose takes it to ``(B, d, p)``. XLA:CPU (jaxlib 0.10.2) moves that transpose onto
the cotangent, a copy of it, and runs the product with both operands transposed in its
own dot emitter rather than in YNNPACK (``tests/test_workarounds.py`` reads it off the
compiled program). On the transformers of ``benchmarks/clipping.py`` those products took
a fifth of a clipped step: the block at microbatch 64 ran at 1.19x the unclipped step
with them and 0.99x without; the tied LM at 64 tokens 1.18x and 1.09x (5 and 7
interleaved repetitions, medians of paired ratios).

``swapped`` writes each such pair, at any depth, as the one product with its operands
swapped, ``dot_general(x, g) -> (B, d, p)``: the transposed result itself, from the same
multiply-adds. It takes the pair only where each operand has one dimension that the
product keeps (the swap then is the transpose) and the product names no output
sharding. The product it replaces stays in the program for its other readers, if any;
where the transpose was its only reader XLA drops it.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, JaxprEqn, new_jaxpr_eqn

from .. import _primitives, _programs
from . import workarounds as _workarounds

_DOT = jax.lax.dot_general_p
_TRANSPOSE = jax.lax.transpose_p
_SWAP = (0, 2, 1)


def swapped(program: ClosedJaxpr) -> ClosedJaxpr:
    """``program`` with each batched product whose result is transposed written as the
    product with its operands swapped, where ``_workarounds.DOT_ORDER`` applies."""
    if not _workarounds.DOT_ORDER.applies():
        return program
    products = {e.outvars[0]: e for e in _primitives.equations(program.jaxpr) if _swappable(e)}
    if not products:
        return program

    def replace(eqn: JaxprEqn) -> list[JaxprEqn] | None:
        if eqn.primitive is not _TRANSPOSE or not _primitives.as_checked(eqn):
            return None
        if tuple(eqn.params["permutation"]) != _SWAP:
            return None
        product = products.get(eqn.invars[0])
        if product is None:
            return None
        x, y = product.invars
        (lhs, rhs), (lhs_batch, rhs_batch) = product.params["dimension_numbers"]
        params = {**product.params, "dimension_numbers": ((rhs, lhs), (rhs_batch, lhs_batch))}
        precision = product.params.get("precision")
        if isinstance(precision, tuple):  # one per operand: swapped with them
            params["precision"] = precision[::-1]
        context = product.effects, product.source_info, product.ctx
        return [new_jaxpr_eqn([y, x], list(eqn.outvars), _DOT, params, *context)]

    return _programs.rewritten(program, replace)


def _swappable(eqn: Any) -> bool:
    """A product batched over its operands' first dimension alone, each operand with one
    dimension left after the batch and the contracted ones, no output sharding."""
    if eqn.primitive is not _DOT or not _primitives.as_checked(eqn):
        return False
    if eqn.params.get("out_sharding") is not None:
        return False
    (lhs, rhs), batch = eqn.params["dimension_numbers"]
    if tuple(map(tuple, batch)) != ((0,), (0,)):
        return False
    x, y = (getattr(v.aval, "shape", None) for v in eqn.invars)
    return x is not None and y is not None and len(x) == len(lhs) + 2 and len(y) == len(rhs) + 2
