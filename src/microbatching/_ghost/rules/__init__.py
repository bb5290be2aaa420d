"""The ghost rules, and the choice of one rule per parameter leaf.

A rule reads a leaf's per-example norm off one site's inputs and output cotangents.
``RULES`` holds one line per rule, keyed by the primitive of its site.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from ... import _tuning
from ..program import _PRIMS, Const, Program, Rule, Site, _chain_end, _key, _rows_of
from . import conv, dense, embedding
from .base import Cost, GhostRule
from .dense import _dense_dims, shared_inputs


def choose(program: Program, leaf: int) -> Rule:
    """The cheapest exact rule for ``leaf``: a rule of ``RULES`` where the leaf reaches one
    site through shape-only steps and that rule reads the site, else ``direct``."""
    reached = tuple(
        k
        for k, s in enumerate(program.sites)
        if any(leaf in program.leaves[_key(program, s, p)] for p in s.free)
    )
    size = math.prod(program.avals[leaf].shape)
    if not reached or size == 0:
        return Rule("unused", (), (), 0)
    names = tuple(program.eqns[program.sites[k].eqn].primitive.name for k in reached)
    rows = sum(_rows_of(program, program.sites[k]) for k in reached)
    direct = Rule("direct", reached, names, size * rows, 4 * size)
    if len(reached) > 1 or jnp.issubdtype(program.avals[leaf].dtype, jnp.complexfloating):
        return direct
    site = program.sites[min(reached)]
    if len(site.free) != 1 or _chain_end(program, leaf) != _key(program, site, site.free[0]):
        return direct
    e = program.eqns[site.eqn]
    values = [a for a in (*e.ins, *e.outs) if not isinstance(a, Const)]
    if any(jnp.issubdtype(program.avals[a].dtype, jnp.complexfloating) for a in values):
        return direct  # the Gram forms are for real rows; a real weight's gradient of
        # complex rows is the real part of their product
    found = site_rule(program, site)
    if found is None:
        return direct
    rule, cost = found
    return Rule(
        rule.name,
        reached,
        names,
        cost.flops,
        4 * cost.entries,
        cost.form,
        4 * cost.product_entries,
    )


def product_flops(program: Program, leaf: int) -> int:
    """Per-example flops of ``leaf``'s own gradient from its sites' products."""
    size = math.prod(program.avals[leaf].shape)
    return size * sum(_rows_of(program, program.sites[k]) for k in program.rules[leaf].sites)


def ghost_cost(program: Program) -> int:
    """Per-example flops that the ghost norms add to a gradient: each leaf's rule, less
    the Gram matrices of inputs that sites share (``shared_inputs``), taken once."""
    saved = 0
    for leaves in shared_inputs(program):
        site = program.sites[program.rules[leaves[0]].sites[0]]
        h, t, k, _ = _dense_dims(program, program.eqns[site.eqn], site.free[0])
        saved += (len(leaves) - 1) * h * t * t * k
    return sum(rule.flops for rule in program.rules) - saved


def materialize_cost(program: Program) -> int:
    """Per-example cost, in the same flops, of forming every per-example gradient: its
    entries, and what a rule's site adds beyond them (``GhostRule.materialize_flops``:
    the products of a convolution's kernel gradient, which XLA computes one example at a
    time, a grouped convolution, instead of as one product over the batch)."""
    size = sum(math.prod(program.avals[leaf].shape) for leaf in range(program.n_params))
    extra = 0
    for site in program.sites:
        rule = RULES.get(program.eqns[site.eqn].primitive)
        if rule is not None:
            extra += rule.materialize_flops(program, site)
    return _tuning.knobs().materialize_flops_per_entry * size + extra


def site_rule(program: Program, site: Site) -> tuple[GhostRule, Cost] | None:
    """The rule of ``RULES`` that reads a leaf's norm off ``site``, and its cost; None
    where none does (the leaf then takes the ``direct`` rule)."""
    rule = RULES.get(program.eqns[site.eqn].primitive)
    cost = None if rule is None else rule.cost(program, site)
    return None if rule is None or cost is None else (rule, cost)


RULES: dict[Any, GhostRule] = {
    _PRIMS.dot_general_p: dense.RULE,
    _PRIMS.conv_general_dilated_p: conv.RULE,
    _PRIMS.gather_p: embedding.RULE,
}
"""The rules that read a leaf's norm off its one site, keyed by the site's primitive
(the ``Primitive`` object): a new rule is a file of this package and a line here."""


def named(name: str) -> GhostRule | None:
    """The rule of ``RULES`` called ``name``, as a leaf's ``Rule`` holds it; None for
    ``direct`` and ``unused``."""
    return next((rule for rule in RULES.values() if rule.name == name), None)
