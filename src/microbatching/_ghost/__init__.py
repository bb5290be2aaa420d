"""Per-example gradient norms without per-example gradients (ghost norms), and the clipped
sum by book-keeping, read off the traced program of one example's loss.

The loss of one example is traced once. Every value of the program is labelled by what it
depends on: the differentiated parameters, the example, both, or neither. A **site** is an
equation where a value that depends only on the parameters (a *free* value) meets a value
that depends on the example: ``x @ w``, a convolution with a parameter kernel, an
embedding gather, a bias added to an activation. The gradient of a parameter leaf for
one example is the sum, over the sites its free values reach, of each site's own
vector-Jacobian product with respect to its free inputs, taken at the site's data inputs
``a_b`` and output cotangent ``g_b``, then pulled back through the parameters-only part
of the program. So:

- One batched forward pass records every site's data inputs, and one backward pass with
  respect to zero taps added to every site's outputs gives every ``g_b``. Neither forms a
  weight gradient.
- Each leaf's per-example norm comes by a **rule**:
  - ``dense``: the leaf reaches exactly one ``dot_general`` through shape-only steps
    (transpose, reshape, a same-dtype convert). Its gradient is ``A^T G`` (rows ``t``
    over the example's free dimensions), and ``||A^T G||^2`` is either the Gram form
    ``sum_ts (a_t.a_s)(g_t.g_s)`` or the product itself, whichever costs less:
    flops, and what it writes (``_tuning.Knobs.gram_entry_flops``).
  - ``embedding``: the leaf is the table of one gather of rows: ``sum_ts [i_t = i_s]
    (g_t.g_s)``, or the scattered rows when the table is smaller than ``T^2``.
  - ``direct``: any other leaf (biases, norm scales, convolution kernels, tied or shared
    weights, weights inside ``scan`` or ``cond``): its own per-example gradient, from
    its sites' products, a chunk of examples at a time. Exact for any primitive; it
    costs that leaf's size per example.
- The clipped (or weighted) sum is one more product per site at the scaled cotangents
  ``c_b g_b``, summed over examples, and one pull-back through the parameters-only
  program. Each site's product is linear in its own cotangent, so this is exact even
  when the model holds a custom VJP that is not; a site that is itself such a call has
  its contribution summed from its per-example products instead.

The rooms of the engine, in the order a call goes through them:

- ``program``: the loss's traced program, inlined, its values' dependencies and its
  sites; ``unreadable`` says why the engine will not read a program.
- ``rules``: one file per rule (``dense``, ``conv``, ``embedding``, ``direct``), the
  shared product and Gram kernels, and ``RULES``, the table that maps a site's
  primitive to its rule; ``choose`` picks each leaf's rule and its form by cost.
- ``recorder``: the pass that records every site's inputs and output cotangents.
- ``norms``: each example's norm of every leaf, by its rule.
- ``book_keeping``: the clipped sum by book-keeping, and its underflow guard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .book_keeping import (
    clipped_sum,
    linear_values,
    scaled_products,
    scales_data,
    times_both,
    to_unit,
    underflow_risk,
)
from .norms import leaf_norms
from .program import Program, _find_sites, _inline, unreadable
from .recorder import Recorded, at_rows, record, recorded_bytes
from .rules import choose, ghost_cost, materialize_cost, product_flops
from .rules.direct import chunk, per_example_grads
from .rules.gram import GRAM_TOLERANCE, gram_matrices

__all__ = [
    "GRAM_TOLERANCE",
    "Program",
    "Recorded",
    "analyse",
    "at_rows",
    "chunk",
    "clipped_sum",
    "ghost_cost",
    "gram_matrices",
    "leaf_norms",
    "linear_values",
    "materialize_cost",
    "per_example_grads",
    "product_flops",
    "record",
    "recorded_bytes",
    "scaled_products",
    "scales_data",
    "times_both",
    "to_unit",
    "underflow_risk",
    "unreadable",
]


def analyse(fun: Callable[..., Any], params: list[Any], example: list[Any]) -> Program | str | None:
    """Traces ``fun(params, example) -> [value, *aux leaves]`` on one example.

    ``params`` are the parameter leaves and ``example`` one example's data leaves (arrays
    or ``ShapeDtypeStruct``), both flat lists. None where the loss does not depend on
    the example (the ghost norms have nothing to read); why not, in words, where the
    program holds what the engine cannot read exactly (``unreadable``).
    """
    closed = jax.make_jaxpr(fun)(params, example)
    program = _inline(closed, len(params), len(example))
    value = program.outs[0]
    if program.free(value):
        return None
    _find_sites(program)
    why = unreadable(program)
    if why is not None:
        return why
    program.rules.extend(choose(program, leaf) for leaf in range(len(params)))
    return program
