"""The traced program of one example's loss, inlined: its equations, what each value
depends on, and the sites where a parameter meets the example.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, primitives

from .. import _primitives, _programs
from .._primitives import facts

_PRIMS = primitives
"""The primitives whose identity a rule reads (a ``dot_general`` site, an ``add``)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
    """A constant of the program (a literal, or a constant of an inlined call)."""

    value: Any


Atom = int | Const


@dataclasses.dataclass(frozen=True, eq=False)
class Eqn:
    """One equation of the inlined program, its values named by integers."""

    primitive: Any
    params: dict[str, Any]
    ctx: Any
    ins: tuple[Atom, ...]
    outs: tuple[int, ...]

    def bind(self, values: Sequence[Any]) -> list[Any]:
        params = self.primitive.get_bind_params(self.params)
        with self.ctx.manager:
            out = self.primitive.bind(*values, **params)
        return list(out) if self.primitive.multiple_results else [out]


@dataclasses.dataclass(frozen=True)
class Site:
    """Where free values meet the example: an equation and the roles of its inputs."""

    eqn: int
    free: tuple[int, ...]  # input positions holding gradient-carrying free values
    data: tuple[int, ...]  # input positions that depend on the example
    linear: bool
    same_as: int | None = None  # a later site whose output cotangent is this site's
    bounded: bool = True  # underflow_risk's bound holds: bilinear or selecting, no gain


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one parameter leaf's per-example norm is computed.

    Attributes:
      name: ``dense``, ``embedding``, ``direct``, or ``unused`` (no gradient).
      sites: The sites its gradient comes from.
      primitives: Their primitives, for reading.
      flops: The per-example flops of its norm.
      bytes: The per-example bytes of its norm's intermediates.
      form: How a ``dense``, ``conv`` or ``embedding`` rule evaluates the norm:
        ``gram`` (checked per example, ``_reliable``), ``product`` or ``rows`` (one row
        per example); empty for the other rules.
      product_bytes: The per-example bytes of the product form, which a ``gram`` form
        falls back to for the examples whose error bound it cannot meet.
    """

    name: str
    sites: tuple[int, ...]
    primitives: tuple[str, ...]
    flops: int
    bytes: int = 0  # per example, of the intermediates of its norm
    form: str = ""  # of a Gram rule: "gram", "product" or "rows"
    product_bytes: int = 0  # per example, of the product form (a Gram form's fallback)


@dataclasses.dataclass
class Program:
    """One example's loss, inlined, with every value's dependencies and the sites."""

    n_params: int
    n_data: int
    eqns: list[Eqn]
    outs: list[Atom]
    avals: dict[int, Any]
    leaves: dict[int, frozenset[int]]  # value -> parameter leaves its gradient reaches
    data: dict[int, bool]  # value -> depends on the example
    sites: list[Site]
    rules: list[Rule]

    dtypes: set[Any]  # the floating dtypes of its values
    live: set[int] = dataclasses.field(default_factory=set)  # values a derivative reaches

    def free(self, a: Atom) -> bool:
        """Whether ``a`` does not depend on the example."""
        return isinstance(a, Const) or not self.data[a]


def unreadable(program: Program) -> str | None:
    """Why the ghost engine does not read ``program``, in words; None where it does.

    It reads only what the primitive table knows. A primitive the table does not hold,
    one that runs the user's derivative code other than a ``custom_jvp`` (a
    ``custom_vjp``, a linear solve, a callback), or one that rounds its cotangent
    (``reduce_precision``), anywhere in the program: the engine would have to run that
    code where JAX does not (a forward-mode derivative through the result pushes
    tangents through a ``custom_vjp``'s forward pass, which JAX refuses), or its
    derivatives through the result would round other sums than JAX's. A ``custom_jvp``
    where a parameter meets the data: its site's product is the user's rule, which the
    engine does not re-derive. The per-example gradients are exact for all of them."""
    for e in program.eqns:
        for known in (facts(e), *_inner_facts(e)):
            if not known.derived or known.rounding:
                return (
                    f"the loss holds {known.name}, which the primitive table does not "
                    "know as derived by JAX and linear in its cotangent (a custom_vjp, a "
                    "linear solve, a callback, lax.reduce_precision, or a primitive it has "
                    "not seen)"
                )
    for site in program.sites:
        e = program.eqns[site.eqn]
        for known in (facts(e), *_inner_facts(e)):
            if known.user_code:
                return (
                    f"a parameter meets the data inside {known.name}, whose derivative "
                    "rule is the user's code"
                )
    return None


def _inner_facts(e: Eqn) -> Iterator[_primitives.Facts]:
    for inner in _primitives.sub_programs(e):
        for found in _primitives.equations(inner):
            yield facts(found)


def _inline(closed: ClosedJaxpr, n_params: int, n_data: int) -> Program:
    """The program flat: inlined calls, values named by integers, labelled as they come."""
    program = Program(n_params, n_data, [], [], {}, {}, {}, [], [], _programs.float_dtypes(closed))
    counter = iter(range(1 << 62))

    def new(aval: Any, leaves: frozenset[int], data: bool) -> int:
        key = next(counter)
        program.avals[key] = aval
        gradient = jnp.issubdtype(getattr(aval, "dtype", np.int32), jnp.inexact)
        program.leaves[key] = leaves if gradient else frozenset()
        program.data[key] = data
        return key

    def walk(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Atom]) -> list[Atom]:
        env: dict[Any, Atom] = {v: Const(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Atom:
            return Const(v.val) if isinstance(v, Literal) else env[v]

        for e in jaxpr.eqns:
            ins = tuple(read(v) for v in e.invars)
            inner = _inlined_body(e)
            if inner is not None:
                env.update(zip(e.outvars, walk(*inner, ins), strict=True))
                continue
            keys = [a for a in ins if not isinstance(a, Const)]
            leaves = frozenset().union(*(program.leaves[a] for a in keys))
            if facts(e).no_gradient:
                leaves = frozenset()
            data = any(program.data[a] for a in keys)
            outs = tuple(new(v.aval, leaves, data) for v in e.outvars)
            env.update(zip(e.outvars, outs, strict=True))
            program.eqns.append(Eqn(e.primitive, dict(e.params), e.ctx, ins, outs))
        return [read(v) for v in jaxpr.outvars]

    inputs: list[Atom] = [
        new(v.aval, frozenset({i}) if i < n_params else frozenset(), i >= n_params)
        for i, v in enumerate(closed.jaxpr.invars)
    ]
    program.outs.extend(walk(closed.jaxpr, closed.consts, inputs))
    return program


def _inlined_body(e: Any) -> tuple[Jaxpr, Sequence[Any]] | None:
    return _primitives.body(e)


def _find_sites(program: Program) -> None:
    live = program.live = _differentiated(program)
    for index, e in enumerate(program.eqns):
        keys = [(p, a) for p, a in enumerate(e.ins) if not isinstance(a, Const)]
        free = tuple(p for p, a in keys if not program.data[a] and program.leaves[a])
        data = tuple(p for p, a in keys if program.data[a])
        if free and data and any(out in live for out in e.outs):
            linear = _linear_site(e)
            program.sites.append(Site(index, free, data, linear))
    _share_cotangents(program)
    _nonlinear_parameters(program)
    _unbounded_sites(program)


def _linear_site(e: Eqn) -> bool:
    """Whether a site's product with its cotangent is linear in the cotangent and is
    JAX's own: a primitive the table knows as derived, not user code (a ``custom_jvp``
    whose rule the engine cannot see), and so is everything its sub-programs apply."""
    known = facts(e)
    if not known.derived or known.user_code or known.rounding:
        return False
    return all(_primitives.user_code(inner) is None for inner in _primitives.sub_programs(e))


def _differentiated(program: Program) -> set[int]:
    """The values the differentiated output's cotangent reaches: an equation passes it
    on from a floating output unless it is a zero-derivative primitive. A value it does not reach
    (an aux output's head, a branch under ``stop_gradient``) gets a symbolic zero from
    JAX, not a site: a zero cotangent times an input that is not finite would be NaN."""
    live = {a for a in program.outs[:1] if not isinstance(a, Const)}
    for e in reversed(program.eqns):
        if facts(e).zero_derivative:
            continue
        if any(o in live and _inexact(program, o) for o in e.outs):
            live.update(a for a in e.ins if not isinstance(a, Const))
    return live


def _inexact(program: Program, value: int) -> bool:
    return jnp.issubdtype(getattr(program.avals[value], "dtype", np.int32), jnp.inexact)


def _unbounded_sites(program: Program) -> None:
    """Marks as not ``bounded`` every site that is neither bilinear nor
    selecting, or whose free inputs come through a parameters-only step that is not
    non-expanding (``w * 2**64``, ``w / ||w||``): there ``underflow_risk`` cannot
    bound what a cotangent lost to underflow moves the gradient by. Nor is a sum of two
    values that reach one leaf (``w + w``: its transpose gives the leaf the cotangent
    twice; forty of them would hide a gain of ``2**40``)."""
    amplified: set[int] = set()
    for e in program.eqns:
        if not all(program.free(a) for a in e.ins):
            continue
        keys = [a for a in e.ins if not isinstance(a, Const)]
        known = facts(e)
        doubled = known.additive and any(
            program.leaves[a] & program.leaves[b] for a, b in itertools.combinations(keys, 2)
        )
        if not known.non_expanding or doubled or any(a in amplified for a in keys):
            amplified.update(e.outs)
    for k, site in enumerate(program.sites):
        e = program.eqns[site.eqn]
        if not (facts(e).bilinear or facts(e).selecting) or any(
            e.ins[p] in amplified for p in site.free
        ):
            program.sites[k] = dataclasses.replace(site, bounded=False)


def _nonlinear_parameters(program: Program) -> None:
    """Marks as not linear every site whose parameter inputs come through an equation
    of the parameters-only program that is not linear in its cotangent (a ``custom_vjp``
    on a weight, ``reduce_precision``): the clipped sum must pull each example's
    cotangent through it, not their sum."""
    tainted: set[int] = set()
    for e in program.eqns:
        if not all(program.free(a) for a in e.ins):
            continue
        keys = [a for a in e.ins if not isinstance(a, Const)]
        if not _linear_site(e) or any(a in tainted for a in keys):
            tainted.update(e.outs)
    for k, site in enumerate(program.sites):
        e = program.eqns[site.eqn]
        if site.linear and any(e.ins[p] in tainted for p in site.free):
            program.sites[k] = dataclasses.replace(site, linear=False)


def _share_cotangents(program: Program) -> None:
    """Marks a site whose only output is used once, as the data operand of an added bias
    (``x @ w + b``), as having that site's output cotangent: one tap serves both."""
    uses: dict[int, list[tuple[int, int]]] = {}
    for i, e in enumerate(program.eqns):
        for p, a in enumerate(e.ins):
            if not isinstance(a, Const):
                uses.setdefault(a, []).append((i, p))
    for a in program.outs:
        if not isinstance(a, Const):
            uses.setdefault(a, []).append((-1, 0))
    at = {s.eqn: k for k, s in enumerate(program.sites)}
    for k, site in enumerate(program.sites):
        (out, *more) = program.eqns[site.eqn].outs
        there = uses.get(out, [])
        if more or len(there) != 1 or there[0][0] not in at:
            continue
        j, position = there[0]
        later = program.eqns[j]
        added = facts(later).additive and later.primitive is not _PRIMS.sub_p
        if added and position in program.sites[at[j]].data:
            same = program.avals[later.outs[0]]
            if same.shape == program.avals[out].shape and same.dtype == program.avals[out].dtype:
                program.sites[k] = dataclasses.replace(site, same_as=at[j])


def _rows_of(program: Program, site: Site) -> int:
    """Roughly how many rows a site's product sums over, per example (``T``)."""
    out = program.avals[program.eqns[site.eqn].outs[0]].shape
    return max(1, math.prod(out) // max(out[-1], 1)) if out else 1


def _key(program: Program, site: Site, position: int) -> int:
    a = program.eqns[site.eqn].ins[position]
    assert not isinstance(a, Const)
    return a


def _chain_end(program: Program, leaf: int) -> int | None:
    """The value that ``leaf`` reaches through single-use, shape-only steps."""
    uses: dict[int, list[tuple[int, int]]] = {}
    for i, e in enumerate(program.eqns):
        for p, a in enumerate(e.ins):
            if not isinstance(a, Const):
                uses.setdefault(a, []).append((i, p))
    key = leaf
    while True:
        here = uses.get(key, [])
        if len(here) != 1:
            return None
        e = program.eqns[here[0][0]]
        if program.data[e.outs[0]]:
            return key
        same = e.primitive is _PRIMS.convert_element_type_p and (
            program.avals[e.outs[0]].dtype == program.avals[key].dtype
        )
        if not facts(e).shape_only and not same:
            return None
        key = e.outs[0]


def _read(env: dict[int, Any], a: Atom) -> Any:
    return a.value if isinstance(a, Const) else env[a]


def free_values(program: Program, params: Sequence[Any]) -> dict[int, Any]:
    """The values that do not depend on the example, from the parameter leaves."""
    env: dict[int, Any] = dict(enumerate(params))
    for e in program.eqns:
        if all(program.free(a) for a in e.ins):
            env.update(zip(e.outs, e.bind([_read(env, a) for a in e.ins]), strict=True))
    return env
