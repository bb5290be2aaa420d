"""What a ghost rule is: the object each file of ``rules`` defines, and ``RULES`` keys by
its site's primitive."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax

from ..program import Program, Site


class Cost(NamedTuple):
    """A rule's cost at one site, per example.

    Attributes:
      form: How the norm is evaluated: ``gram`` (checked per example), ``product`` or
        ``rows``.
      flops: Flops of the norm in that form.
      entries: Entries of the intermediates the form writes.
      product_entries: Those of the product form, which a ``gram`` form falls back to
        for the examples whose error bound it cannot meet.
    """

    form: str
    flops: int
    entries: int
    product_entries: int


class Norm(Protocol):
    """``norm(program, site, inputs, cotangents, gram)``: one example's norm of the leaf
    at ``site`` from its data inputs and output cotangents, in the Gram form (``gram``)
    or the product form, and whether it is reliable (the product form always is)."""

    def __call__(
        self,
        program: Program,
        site: Site,
        inputs: Sequence[Any],
        cotangents: Sequence[Any],
        gram: bool,
    ) -> tuple[jax.Array, jax.Array]: ...


Rows = Callable[[Program, Site, Sequence[Any], Sequence[Any]], tuple[jax.Array, jax.Array]]
"""``rows(program, site, inputs, cotangents)``: one example's rows ``(H, T, K)`` and
``(H, T, N)`` whose outer products, summed over ``T``, are the leaf's gradient."""


def _nothing(program: Program, site: Site) -> int:
    return 0


@dataclasses.dataclass(frozen=True)
class GhostRule:
    """How the norm of a leaf that meets the data at one site is read off that site.

    Attributes:
      name: As ``clipping_report`` shows it.
      cost: The rule's ``Cost`` at a site, or None where the site is not of the form the
        rule reads (another operand is the parameter, a grouped convolution...): the
        leaf then takes the ``direct`` rule, which is exact for any site.
      norm: The norm (``Norm``).
      rows: For a rule whose gradient is a sum of outer products of rows (``Rows``):
        the norms of a chunk of examples then come from the rows as they are, where
        their squares are safely in range (``norms._unscaled``).
      materialize_flops: The flops per example that forming the gradients takes at such
        a site beyond writing them (``materialize_cost``): a convolution's kernel
        gradient, which XLA computes one example at a time.
    """

    name: str
    cost: Callable[[Program, Site], Cost | None]
    norm: Norm
    rows: Rows | None = None
    materialize_flops: Callable[[Program, Site], int] = _nothing
