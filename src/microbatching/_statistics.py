"""Per-example gradient statistics without per-example gradients: ``micro_grad``'s
``transform_fn`` and ``metrics_fn`` read off their traced programs, and computed from
the sites of the ghost engine (``_ghost``).

``transform_fn`` is traced once on one example's gradient, as shapes. Each of its output
leaves takes a **form**:

- ``constant``: it reads no gradient; its sum is the value times the examples' weights.
- ``linear``: a linear function of the gradient (any leaves: the gradient itself, a
  multiple, a ``vdot`` with a fixed direction, a projection, a cumulative sum). The sum
  of ``L(c_b g_b)`` is ``L`` of the clipped sum, which the book-keeping sum gives
  without forming any per-example gradient.
- ``factorised``: ``C * m(g)`` for one leaf reached by one dense site with one row per
  example (``g_b = a_b (outer) d_b``), where ``C`` is a constant and ``m`` a
  multiplicative function (``m(xy) = m(x) m(y)``: powers, ``abs``, ``sign``, square roots
  of what is provably not negative, and products of them) that vanishes at 0. Then
  ``sum_b w_b m(a_b (outer) c_b d_b) = m(A)^T (w * m(c G))``: one matrix product like the
  gradient's own. Every term of it is the product that the per-example form rounds, so
  its sum over examples has the same condition as the reference's, as long as ``m(a)``
  and ``m(d)``, taken apart, stay in range where ``m(a d)`` does: a microbatch where
  they may not (``_exact_terms``) takes ``direct`` in a branch. A sum of several such
  terms is not taken this way: its signs may cancel, and it takes ``direct``.
- ``direct``: any other elementwise function of one leaf. That leaf's own per-example
  gradient is formed from its sites, a chunk of examples at a time, clipped, transformed
  and summed: memory of one leaf's per-example gradients, never the model's.

Anything else (a function that mixes leaves non-linearly, reads a norm, sorts...) is not
read, and the call takes the per-example path; a transform that scales the gradient by
a function of its norms is read before, by ``_scaled``, and only its rest comes here.
``metrics_fn`` is read the same way: each
output leaf linear in the gradient is ``<g_b, V>``, the sum over sites of the output
cotangents against the site's product with the direction ``V`` (one more product per
site, ``A V`` against ``G`` for a dense one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.extend.core import Literal as JaxprLiteral

from . import _accumulators, _ghost, _layout, _primitives, _sharding, _tuning
from ._primitives import facts
from ._signature import leaf_paths
from ._typing import PyTree

Form = Literal["constant", "linear", "factorised", "direct"]


@dataclasses.dataclass(frozen=True)
class Monomial:
    """``x**n * |x|**r * sign(x)**s`` of one entry ``x``: multiplicative, so that
    ``m(a g) = m(a) m(g)``. ``s`` is 0, 1 or 2 (``sign(x)**2`` is ``x != 0``)."""

    n: int = 1
    r: float = 0.0
    s: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "s", 0 if self.s == 0 else 2 - self.s % 2)

    @property
    def vanishes(self) -> bool:
        """Whether ``m(0) = 0``: a row of zeros contributes nothing."""
        return self.n > 0 or self.r > 0 or self.s > 0

    @property
    def not_negative(self) -> bool:
        """Whether ``m(x) >= 0`` for every ``x``."""
        return self.n % 2 == 0 and self.s != 1

    def times(self, other: Monomial) -> Monomial:
        return Monomial(self.n + other.n, self.r + other.r, self.s + other.s)

    def power(self, y: float) -> Monomial:
        """``m**y``: any ``y >= 0`` where ``m`` is not negative, else an integer ``y``."""
        if float(y).is_integer():
            k = int(y)
            return Monomial(self.n * k, self.r * k, self.s * k)
        return Monomial(0, (self.n + self.r) * y, self.s)

    def absolute(self) -> Monomial:
        degree = self.n + self.r
        return Monomial(0, degree, 0) if degree > 0 else Monomial(0, 0.0, 2 * (self.s > 0))

    def signum(self) -> Monomial:
        if not self.vanishes:
            return Monomial(0, 0.0, 0)
        odd = self.n + self.s
        return Monomial(0, 0.0, odd) if odd else Monomial(0, 0.0, 2)

    def __call__(self, x: jax.Array) -> jax.Array:
        out = jnp.ones_like(x)
        if self.n:
            out = out * jax.lax.integer_pow(x, self.n)
        if self.r:
            magnitude = jnp.abs(x)
            r = self.r
            out = out * (jax.lax.integer_pow(magnitude, int(r)) if r.is_integer() else magnitude**r)
        if self.s == 1:
            out = out * jnp.sign(x)
        elif self.s == 2:
            out = out * (x != 0).astype(x.dtype)
        return out


@dataclasses.dataclass(frozen=True)
class _Value:
    """What the reading knows of one value of the transform's program.

    Attributes:
      deps: The gradient leaves it reads (empty: a constant).
      linear: A linear function of the gradient (no constant term).
      elementwise: Entry by entry a function of the same entry of its one leaf, with
        the leaf's shape.
      monomial: Where it is ``C * m(x)`` of its one leaf, ``m``; else None.
      positive: Where it has a monomial, whether ``C >= 0`` is known.
      coefficient: Where it has a monomial and ``C`` is a product of literal scalars,
        ``C``; else None (``C`` is then read as the value at 1).
      scalar: For a constant that is a Python or literal scalar, its value.
    """

    deps: frozenset[int] = frozenset()
    linear: bool = False
    elementwise: bool = False
    monomial: Monomial | None = None
    positive: bool = False
    coefficient: float | None = None
    scalar: float | None = None

    @property
    def constant(self) -> bool:
        return not self.deps


_OPAQUE = _Value(frozenset({-1}))
"""A value the reading cannot follow (it counts as reading an unknown leaf)."""


def _literal(x: Any) -> float | None:
    """The value of a real scalar known when the program is read; else None (an array,
    or a value traced by an enclosing ``jit``)."""
    if isinstance(x, bool | int | float):
        return float(x)
    if isinstance(x, Tracer) or getattr(x, "shape", None) != ():
        return None
    value = np.asarray(x)
    if not (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)):
        return None
    return float(value)


def _step(e: Any, ins: list[_Value], shapes: dict[int, tuple[int, ...]], out: Any) -> _Value:
    """The value of equation ``e``'s one output, from its operands."""
    known = facts(e)
    name = e.primitive.name  # of a primitive the table knows: its rules below, by name
    live = [v for v in ins if not v.constant]
    if live and (not known.derived or known.user_code):  # read as reading an unknown leaf
        return _OPAQUE
    if not live:  # a constant; a scalar's value is followed through casts
        kept = name in ("convert_element_type", "copy", "copy_p") and ins[0].scalar is not None
        return _Value(scalar=ins[0].scalar if kept else None)
    deps = frozenset().union(*(v.deps for v in live))
    linear = _linear(name, known, e, ins) and all(v.linear for v in live)
    elementwise = False
    monomial, positive, coefficient = None, False, None
    if known.elementwise and len(deps) == 1 and -1 not in deps:
        (leaf,) = deps
        shape = tuple(out.aval.shape)
        same = all(v.elementwise for v in live) and shape == shapes[leaf]
        consts = [v for v, a in zip(ins, e.invars, strict=True) if v.constant]
        shaped = all(
            tuple(getattr(a.aval, "shape", ())) in ((), shape)
            for v, a in zip(ins, e.invars, strict=True)
            if v.constant
        )
        elementwise = same and shaped
        if elementwise:
            monomial, positive, coefficient = _monomial(name, e, ins, live, consts)
    return _Value(deps, linear, elementwise, monomial, positive, coefficient)


def _linear(name: str, known: _primitives.Facts, e: Any, ins: list[_Value]) -> bool:
    """Whether ``e`` is linear in its operands that read the gradient."""
    consts = [v.constant for v in ins]
    if known.additive:  # adding a literal 0 (``sum`` starts there)
        return all(v.scalar == 0 for v in ins if v.constant)
    if name in ("concatenate", "stack"):
        return not any(consts)
    if known.linear_operand:
        return len(ins) == 1
    if name == "convert_element_type":
        return jnp.issubdtype(e.params["new_dtype"], jnp.inexact)
    if name in ("mul", "dot_general"):
        return sum(consts) == 1
    if name == "div":
        return consts == [False, True]
    if name == "pad":
        return consts == [False, True] and ins[1].scalar == 0
    if name == "dynamic_slice":
        return not consts[0] and all(consts[1:])
    if name == "select_n":
        return consts[0] and not any(consts[1:])
    return False


def _monomial(
    name: str, e: Any, ins: list[_Value], live: list[_Value], consts: list[_Value]
) -> tuple[Monomial | None, bool, float | None]:
    """``(m, C >= 0 known, C where a Python scalar)`` where an elementwise value is
    ``C * m(x)``; ``m`` None where it is not."""
    none = (None, False, None)
    monos = [v.monomial for v in live]
    if any(m is None for m in monos):
        return none
    first, one = monos[0], live[0]
    assert first is not None  # for the type checker: checked above
    c = one.coefficient
    if name in ("copy", "copy_p"):
        return first, one.positive, c
    if name == "convert_element_type":
        same = e.params["new_dtype"] == e.invars[0].aval.dtype
        return (first, one.positive, c) if same else none
    if name == "neg":
        return first, False, None if c is None else -c
    if name == "mul":
        if len(live) == 2:
            second, other = monos[1], live[1]
            assert second is not None
            both = None if c is None or other.coefficient is None else c * other.coefficient
            return first.times(second), one.positive and other.positive, both
        scalar = consts[0].scalar
        known = None if c is None or scalar is None else c * scalar
        return first, one.positive and scalar is not None and scalar >= 0, known
    if name == "div" and not ins[0].constant and ins[1].constant:
        scalar = ins[1].scalar
        if scalar == 0:
            return none
        known = None if c is None or scalar is None else c / scalar
        return first, one.positive and scalar is not None and scalar > 0, known
    if name in ("integer_pow", "square", "pow", "sqrt"):
        y = {"integer_pow": e.params.get("y"), "square": 2, "sqrt": 0.5}.get(
            name, ins[-1].scalar if ins[-1].constant else None
        )
        if y is None or y < 0 or ins[0].constant:
            return none
        known = None if c is None else c**y
        if float(y).is_integer():
            return first.power(y), one.positive or int(y) % 2 == 0, known
        if one.positive and first.not_negative:
            return first.power(y), True, known
        return none
    if name == "abs":
        return first.absolute(), True, None if c is None else abs(c)
    if name == "sign":
        return first.signum(), one.positive, None if c is None else float(np.sign(c))
    return none


def _walk(
    closed: ClosedJaxpr, given: list[_Value], shapes: dict[int, tuple[int, ...]]
) -> list[_Value]:
    def walk(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[_Value]) -> list[_Value]:
        env: dict[Any, _Value] = {
            v: _Value(scalar=_literal(c)) for v, c in zip(jaxpr.constvars, consts, strict=True)
        }
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> _Value:
            return _Value(scalar=_literal(v.val)) if isinstance(v, JaxprLiteral) else env[v]

        for e in jaxpr.eqns:
            ins = [read(v) for v in e.invars]
            body = _primitives.body(e)
            if body is not None:
                env.update(zip(e.outvars, walk(*body, ins), strict=True))
                continue
            if len(e.outvars) != 1:
                outs = [_Value() if all(v.constant for v in ins) else _OPAQUE] * len(e.outvars)
                env.update(zip(e.outvars, outs, strict=True))
                continue
            env[e.outvars[0]] = _step(e, ins, shapes, e.outvars[0])
        return [read(v) for v in jaxpr.outvars]

    return walk(closed.jaxpr, closed.consts, given)


@dataclasses.dataclass(frozen=True)
class Statistic:
    """One output leaf of ``transform_fn`` (or ``metrics_fn``), as read.

    Attributes:
      path: The output leaf, e.g. ``[1]['kernel']``.
      form: ``constant``, ``linear``, ``factorised`` or ``direct`` (see the module).
      leaf: For ``factorised`` and ``direct``, the gradient leaf it reads; for
        ``linear``, the one leaf it reads, where it reads one.
      monomial: For ``factorised``, ``m`` of ``C * m(g)``.
      why: Why it takes its form, in words.
      coefficient: For ``factorised``, ``C`` where it is a Python scalar; None where it
        is read off ``transform_fn`` at 1 (``m(1) = 1``).
    """

    path: str
    form: Form
    leaf: int | None = None
    monomial: Monomial | None = None
    why: str = ""
    coefficient: float | None = None


@dataclasses.dataclass(frozen=True)
class Reading:
    """What ``micro_grad``'s statistics method computes for one call.

    Attributes:
      transform: ``transform_fn``.
      outputs: One ``Statistic`` per output leaf of ``transform_fn``.
      metrics: ``metrics_fn``, or None.
      metric_outputs: One ``linear`` ``Statistic`` per output leaf of a ``metrics_fn``
        read as linear; empty for none, or for the norms (``norms``).
      norms: Whether ``metrics_fn`` is ``l2_norm``.
      structure: The tree structure of ``transform_fn``'s output, as read.
    """

    transform: Callable[[PyTree], PyTree]
    outputs: tuple[Statistic, ...]
    metrics: Callable[[PyTree], PyTree] | None
    metric_outputs: tuple[Statistic, ...]
    norms: bool
    structure: Any


def _read_values(fn: Callable[[PyTree], PyTree], grads: PyTree) -> tuple[list[_Value], Any, Any]:
    """Each output leaf of ``fn`` at one example's gradient ``grads`` (shapes), as read,
    with the output's structure and shapes."""
    leaves = jax.tree.leaves(grads)
    shapes = {i: tuple(g.shape) for i, g in enumerate(leaves)}
    # A new function object each time: ``make_jaxpr`` caches a trace by its function,
    # and a transform that reads state must be read as it is now.
    closed, shape = jax.make_jaxpr(lambda g: fn(g), return_shape=True)(grads)
    given = [_Value(frozenset({i}), True, True, Monomial(), True, 1.0) for i in range(len(leaves))]
    return _walk(closed, given, shapes), jax.tree.structure(shape), shape


def _named(path: str) -> str:
    """An output leaf's path for a message, after a space; nothing for an output that is
    one array (whose path is empty)."""
    return f" {path}" if path else ""


def read(
    transform: Callable[[PyTree], PyTree],
    metrics: Callable[[PyTree], PyTree] | None,
    norms: bool,
    grads: PyTree,
    rules: Sequence[Any],
    sites: Sequence[Any],
    clipped: bool = False,
) -> Reading | str:
    """The reading of ``transform`` and ``metrics`` at one example's gradient ``grads``
    (``ShapeDtypeStruct`` leaves), with the ghost engine's ``rules`` of its leaves and
    its ``sites``; or why one of them cannot be read (``clipped``: ``l2_clip_norm`` is
    given, for the hint)."""
    values, _, shape = _read_values(transform, grads)
    paths = leaf_paths(shape)
    outs = jax.tree.leaves(shape)
    outputs = []
    for path, value, out in zip(paths, values, outs, strict=True):
        if not jnp.issubdtype(out.dtype, jnp.floating):
            return f"transform_fn's output{_named(path)} is {out.dtype}, not a float"
        statistic = _form(path, value, rules, sites, clipped)
        if statistic is None:
            return (
                f"transform_fn's output{_named(path)} needs each example's whole gradient: "
                f"{_unread(value, clipped)}"
            )
        outputs.append(statistic)
    outputs = _beside_direct(outputs)
    metric_outputs: list[Statistic] = []
    if metrics is not None and not norms:
        found, _, mshape = _read_values(metrics, grads)
        mpaths = leaf_paths(mshape)
        for path, value in zip(mpaths, found, strict=True):
            if not value.linear or -1 in value.deps:
                return (
                    f"metrics_fn's output{_named(path)} is not linear in the gradient "
                    "(metrics_fn=microbatching.l2_norm gives the norms without the gradients)"
                )
        reached = {k for r in rules for k in r.sites}
        if not all(sites[k].linear for k in reached):
            return "a linear metrics_fn needs every site linear in its cotangent"
        metric_outputs = [Statistic(p, "linear", why="linear in the gradient") for p in mpaths]
    structure = jax.tree.structure(shape)
    return Reading(transform, tuple(outputs), metrics, tuple(metric_outputs), norms, structure)


def _beside_direct(outputs: list[Statistic]) -> list[Statistic]:
    """``outputs`` with each linear output of one leaf that other outputs read directly
    taken the direct way too: its sum ``sum_b w_b f(c_b g_b)`` then comes from the
    per-example gradients that the leaf forms anyway, where the clipped sum would take
    one more product per site (``(g, g**2)`` at a sequence: the gradient beside its
    square)."""
    direct = {s.leaf for s in outputs if s.form == "direct"}
    return [
        dataclasses.replace(s, form="direct", why=_BESIDE)
        if s.form == "linear" and s.leaf is not None and s.leaf in direct
        else s
        for s in outputs
    ]


_BESIDE = "linear in the gradient: from its leaf's per-example gradients, read for another output"


def _unread(value: _Value, clipped: bool) -> str:
    if -1 in value.deps:
        return "it goes through an operation that is neither elementwise nor linear"
    if len(value.deps) > 1:
        hint = (
            "l2_clip_norm clips each example's gradient before transform_fn sees it: "
            "a clip in transform_fn clips it again"
            if clipped
            else "to clip each example's gradient, pass l2_clip_norm=, which takes the "
            "norms without the gradients"
        )
        return f"it mixes gradient leaves, and is not linear ({hint})"
    return "it is neither elementwise nor linear in its gradient leaf"


def _form(
    path: str, value: _Value, rules: Sequence[Any], sites: Sequence[Any], clipped: bool
) -> Statistic | None:
    if value.constant:
        return Statistic(path, "constant", why="reads no gradient")
    if -1 in value.deps:
        return None
    if value.linear:
        (leaf,) = value.deps if len(value.deps) == 1 else (None,)
        summed = "the clipped sum" if clipped else "the sum"
        return Statistic(path, "linear", leaf, why=f"linear in the gradient: from {summed}")
    if not value.elementwise:
        return None
    (leaf,) = value.deps
    rule, monomial = rules[leaf], value.monomial
    if monomial is None:
        return Statistic(path, "direct", leaf, why="elementwise, not a multiple of a product")
    if not monomial.vanishes:
        return Statistic(path, "direct", leaf, why="elementwise, not 0 at 0")
    one_row = rule.name == "dense" and rule.form == "rows"
    if not one_row:
        where = (
            f"its leaf takes the {rule.name} rule"
            if rule.name != "dense"
            else ("its dense site has more than one row per example")
        )
        return Statistic(path, "direct", leaf, why=f"multiplicative, but {where}")
    if not sites[rule.sites[0]].linear:
        return Statistic(path, "direct", leaf, why="its site is not linear in its cotangent")
    return Statistic(
        path, "factorised", leaf, monomial, "multiplicative, one row per example", value.coefficient
    )


def materialize_cost(program: _ghost.Program) -> int:
    """Per-example flops of the per-example path, in the units of ``cost``: every leaf's
    per-example product, and forming, reading and summing its entries
    (``_ghost.materialize_cost``)."""
    products = sum(_ghost.product_flops(program, leaf) for leaf in range(program.n_params))
    return products + _ghost.materialize_cost(program)


def cost(reading: Reading, program: _ghost.Program) -> int:
    """Per-example flops of the reading's forms beyond the forward and backward passes:
    the book-keeping sum (the products of a gradient, for linear outputs), one product
    per factorised output, and each leaf read directly: its own per-example gradient,
    formed, read and summed."""
    products = [_ghost.product_flops(program, leaf) for leaf in range(program.n_params)]
    total = sum(products) if any(s.form == "linear" for s in reading.outputs) else 0
    total += sum(
        products[s.leaf] for s in reading.outputs if s.form == "factorised" and s.leaf is not None
    )
    direct = {s.leaf for s in reading.outputs if s.form == "direct" and s.leaf is not None}
    entries = sum(math.prod(program.avals[leaf].shape) for leaf in direct)
    return (
        total
        + sum(products[leaf] for leaf in direct)
        + _tuning.knobs().materialize_flops_per_entry * entries
    )


# --- the computation, in the loop ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rows:
    """A microbatch's examples as the sums read them.

    Attributes:
      scale: Each example's clip factor per group ``(rows, groups)``: ones without
        clipping.
      groups: The group of each parameter leaf.
      weights: Each example's weight ``(rows,)``: ones without ``example_weights``.
      keep: The rows of weight other than 0.
      clean: Whether rows of weight or factor 0 must contribute exactly 0 even where
        their data are not finite.
      norms: Each example's gradient norm per leaf ``(rows, leaves)`` where computed:
        the sums then check their cotangents for underflow (``_ghost.clipped_sum``).
      drops: Whether a row of clip factor 0 is left out (``nan_safe``); otherwise its
        gradient times 0 enters, NaN where the gradient is infinite, as on every
        method.
      clipped: Whether ``scale`` holds clip factors; else it is ones.
    """

    scale: jax.Array
    groups: Sequence[int]
    weights: jax.Array
    keep: jax.Array
    clean: bool
    norms: jax.Array | None = None
    drops: bool = False
    clipped: bool = False

    def nonzero(self, clip: jax.Array) -> jax.Array:
        """The rows whose terms enter by ``clip``: of factor other than 0 where ``drops``,
        else all."""
        return clip != 0 if self.drops else jnp.ones(clip.shape, bool)

    def clip(self, leaf: int) -> jax.Array:
        return self.scale[:, self.groups[leaf]]


def sums(
    reading: Reading,
    program: _ghost.Program,
    params: Sequence[Any],
    tree: Callable[[list[Any]], PyTree],
    seen: _ghost.Recorded,
    rows: Rows,
    requested: Any,
) -> list[Any]:
    """The weighted sums over a microbatch of ``reading``'s output leaves, one array (or
    ``_layout.Open``) per leaf in order; ``tree`` makes the gradient's pytree from its
    leaves."""
    fn = reading.transform

    def outputs(leaves: list[Any]) -> list[Any]:
        # As arrays: a leaf may be a Python number (transform_fn=lambda g: 1.0).
        return [jnp.asarray(v) for v in jax.tree.leaves(fn(tree(leaves)))]

    zeros = [jnp.zeros(jnp.shape(p), jnp.result_type(p)) for p in params]
    outs: list[Any] = [None] * len(reading.outputs)
    forms = [s.form for s in reading.outputs]

    def picker(leaf: int, js: list[int]) -> Callable[[Any], list[Any]]:
        """The outputs ``js`` of ``transform_fn`` at a gradient that is ``g`` at ``leaf``
        and 0 elsewhere (``_direct`` reads them one example at a time)."""

        def picked(g: Any) -> list[Any]:
            full = list(zeros)
            full[leaf] = g
            found = outputs(full)
            return [found[j] for j in js]

        return picked

    def or_direct(checked: list[tuple[int, int, jax.Array, jax.Array]]) -> None:
        """Each factorised output ``(j, leaf, value, exact)`` into ``outs``: ``value``
        where every one is ``exact`` for the microbatch, else each from its leaf's own
        per-example gradients (``_direct``), in one branch: only a microbatch that
        needs it pays for it (each branch on the data costs XLA:CPU a wait; one for all
        of them, not one each). One example at a time: XLA holds the memory of both
        sides of a branch, and this one is for data at the ends of the float range."""
        if not checked:
            return
        values = [value for _, _, value, _ in checked]

        def by_examples() -> list[jax.Array]:
            found = []
            for j, leaf, value, _ in checked:
                picked = picker(leaf, [j])
                (one,) = _direct(program, params, seen, leaf, picked, rows, requested, most=1)
                found.append(jnp.asarray(one).astype(value.dtype).reshape(value.shape))
            return found

        exact = functools.reduce(jnp.logical_and, [e for _, _, _, e in checked])
        for (j, *_), value in zip(
            checked, _sharding.data_cond(exact, lambda: values, by_examples), strict=True
        ):
            outs[j] = value

    if "linear" in forms:
        factor = rows.scale * rows.weights[:, None]
        factor = jnp.where(rows.keep[:, None], factor, 0) if rows.clean else factor
        kept = None if rows.drops else rows.keep
        total = _ghost.clipped_sum(
            program, params, seen, factor, rows.groups, rows.clean, rows.norms, kept
        )
        at_total = outputs(list(total))
        outs = [t if f == "linear" else o for t, f, o in zip(at_total, forms, outs, strict=True)]
    count = jnp.sum(jnp.where(rows.keep, rows.weights, 0))
    at_zero = outputs(zeros)
    direct: dict[int, list[int]] = {}
    checked: list[tuple[int, int, jax.Array, jax.Array]] = []
    for j, s in enumerate(reading.outputs):
        unused = s.leaf is not None and program.rules[s.leaf].name == "unused"
        if s.form == "constant" or unused:  # every example's gradient of the leaf is 0
            outs[j] = at_zero[j] * count.astype(at_zero[j].dtype)
        elif s.form == "factorised":
            assert s.leaf is not None  # for the type checker: read so
            product, exact = _factorised(program, params, seen, s, rows)
            if s.coefficient is None:
                ones = [jnp.ones_like(z) if i == s.leaf else z for i, z in enumerate(zeros)]
                value = outputs(ones)[j] * product  # C * m(1), and m(1) = 1
            else:
                value = product if s.coefficient == 1 else product * s.coefficient
            outs[j] = value
            if exact is not None:
                checked.append((j, s.leaf, value, exact))
        elif s.form == "direct":
            assert s.leaf is not None
            direct.setdefault(s.leaf, []).append(j)
    or_direct(checked)
    for leaf, js in direct.items():
        found = _direct(program, params, seen, leaf, picker(leaf, js), rows, requested)
        for j, value in zip(js, found, strict=True):
            outs[j] = value
    return outs


def _factorised(
    program: _ghost.Program,
    params: Sequence[Any],
    seen: _ghost.Recorded,
    statistic: Statistic,
    rows: Rows,
) -> tuple[jax.Array, jax.Array | None]:
    """``sum_b w_b m(a_b) (outer) m(c_b d_b)`` at the leaf's one dense site, in the leaf's
    layout: the site's own product, at ``m`` of its rows; and whether it is exact for
    the microbatch (``_exact_terms`` for ``m`` of degree 1 or more, ``_unflushed`` for
    less under clipping), None where nothing can be lost (degree below 1, unclipped)."""
    leaf, m = statistic.leaf, statistic.monomial
    assert leaf is not None and m is not None  # for the type checker: a factorised form
    k = program.rules[leaf].sites[0]
    clip = rows.clip(leaf)
    nonzero = rows.nonzero(clip)

    def scaled(d: jax.Array) -> jax.Array:
        c = _ghost.at_rows(clip, d).astype(d.dtype)
        return m(jnp.where(_ghost.at_rows(nonzero, d), d * c, jnp.zeros((), d.dtype)))

    inputs, cotangents = list(seen.inputs), list(seen.cotangents)
    inputs[k] = [m(x) for x in seen.inputs[k]]
    cotangents[k] = [scaled(d) for d in seen.cotangents[k]]
    here = _ghost.Recorded(seen.outs, inputs, cotangents)
    # Under ``nan_safe`` rows of factor 0 are left out (m(0) = 0), so that data that are
    # not finite there cannot reach the sum: as the per-example path drops them.
    kept = rows.keep & nonzero
    (product,) = _ghost.scaled_products(
        program, params, here, [leaf], [k], rows.weights, kept, clean=True
    )
    live = kept & (clip != 0) & (rows.weights != 0)
    if m.n + m.r < 1:
        # ``m`` of a value below ``tiny`` can be far above it (``sqrt``; ``sign`` is 1):
        # a clipped cotangent ``c d`` that rounds below ``tiny`` changes the statistic
        # by more than any bound on ``tiny``. Without clipping ``d`` enters as it is.
        return product, _unflushed(seen.cotangents[k], clip, live) if rows.clipped else None
    # The weights multiply the side that ``scaled_products`` scales: checked as used.
    on_data = _ghost.scales_data(program, here, k)
    sides = (
        _Side(seen.inputs[k], None, rows.weights if on_data else None),
        _Side(seen.cotangents[k], clip, None if on_data else rows.weights),
    )
    return product, _exact_terms(m, sides, live)


def _unflushed(cotangents: Sequence[jax.Array], clip: jax.Array, live: jax.Array) -> jax.Array:
    """Whether no ``live`` example's nonzero cotangent entry ``d`` times its clip factor
    ``c`` rounds below ``tiny``: the factorised form takes ``m(c d)``, where the
    per-example form takes ``m`` of ``c`` times the gradient's entry ``a d``, and for
    ``m`` of degree below 1 (``sign``, ``sqrt|x|``) a product flushed to 0 or rounded
    among the subnormals is an error of about ``m(tiny)``, not ``tiny``. Rounding is
    monotone, so the row's smallest nonzero ``|d|`` decides (one pass per row)."""
    rows = live.shape[0]
    flat = jnp.concatenate([jnp.reshape(d, (rows, -1)) for d in cotangents], axis=1)
    magnitude = jnp.abs(flat)
    smallest = jnp.min(jnp.where(magnitude > 0, magnitude, jnp.inf), axis=1)
    scaled = jnp.abs(clip).astype(flat.dtype) * smallest
    return jnp.all(~live | jnp.isinf(smallest) | (scaled >= jnp.finfo(flat.dtype).tiny))


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side of a factorised product as ``_factorised`` computes it: each entry ``e``
    of ``raw`` (one row per example on axis 0) enters as ``m(e * clip) * weights``, the
    row's factors where given."""

    raw: Sequence[jax.Array]
    clip: jax.Array | None
    weights: jax.Array | None

    def value(self, m: Monomial, e: jax.Array) -> jax.Array:
        """``e`` (rows on axis 0) as it enters the product."""
        if self.clip is not None:
            e = e * _ghost.at_rows(self.clip, e).astype(e.dtype)
        e = m(e)
        if self.weights is not None:
            e = e * _ghost.at_rows(self.weights, e).astype(e.dtype)
        return e

    def largest(self) -> tuple[jax.Array, int]:
        """Each row's largest magnitude (``(rows,)``), and the row's count of entries."""
        rows = jnp.shape(self.raw[0])[0]
        flat = [jnp.reshape(v, (rows, -1)) for v in self.raw]
        most = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v), axis=1) for v in flat])
        return most, sum(v.shape[1] for v in flat)


def _exact_terms(m: Monomial, sides: Sequence[_Side], live: jax.Array) -> jax.Array:
    """Whether the factorised form's two ``sides`` lose at most ``GRAM_TOLERANCE`` of
    the ``live`` examples' statistic, ``sum_b ||m(c_b g_b) w_b||_1``, to their range.

    The per-example form computes ``m`` of each product ``a_i d_j`` once; this one
    computes ``m(a_i)`` and ``m(d_j)`` apart, and either can leave the normal range
    though the product does not (``m = x**2`` at ``a = 1e-25``, ``d = 1e27``: 0 times
    ``inf``). An entry whose value is below ``tiny`` is off by at most ``tiny`` (beside
    the relative rounding of the reference's own products), which moves the example's
    statistic by at most ``tiny`` times the other side's sum of magnitudes. ``|m|``
    grows with ``|x|``, so each side's largest value is ``M = |m(c max|x|) w|``, and
    counting every entry as lost bounds an example's error by ``tiny I J (M_a + M_d +
    tiny)`` for rows of ``I`` and ``J`` entries: one largest-magnitude pass per row and
    side, over the rows as recorded. Summed over the examples, that is held against
    ``sum_b M_a M_d``, no more than the statistic's ``L1`` mass (the scale of the
    reference's own rounding in the sum over examples). A largest value that is not
    finite (one that overflowed, or data that are not) fails; so does a microbatch whose
    every example has ``M_a M_d`` within about ``1e-27`` of ``tiny`` times ``I J
    (M_a + M_d)`` in float32 (a statistic of about ``1e-30``, or entries out of range).
    Two values in range whose product rounds below ``tiny`` in the sum do as the
    per-example form's ``m`` of a product below ``tiny`` does."""
    tiny = jnp.finfo(jnp.result_type(*sides[0].raw, *sides[1].raw)).tiny
    tops, sizes = [], []
    for side in sides:
        most, size = side.largest()
        wide = jnp.promote_types(most.dtype, jnp.float32)
        tops.append(jnp.where(live, jnp.abs(side.value(m, most)).astype(wide), 0))
        sizes.append(size)
    (top_a, top_d), entries = tops, sizes[0] * sizes[1]
    bound = jnp.sum(jnp.where(live, tiny * entries * (top_a + top_d + tiny), 0))
    tolerance = _ghost.GRAM_TOLERANCE[max(32, jnp.finfo(top_a.dtype).bits)]
    finite = jnp.all(jnp.isfinite(top_a) & jnp.isfinite(top_d))
    return finite & (bound <= tolerance * jnp.sum(top_a * top_d))


def _direct(
    program: _ghost.Program,
    params: Sequence[Any],
    seen: _ghost.Recorded,
    leaf: int,
    picked: Callable[[Any], list[Any]],
    rows: Rows,
    requested: Any,
    most: int | None = None,
) -> list[Any]:
    """``sum_b w_b f(c_b g_b)`` of the outputs ``picked`` reads from one leaf's gradient,
    from that leaf's per-example gradients a chunk of examples at a time: at most
    ``most`` examples (by default as many as ``_ghost.chunk`` allows)."""
    sites = list(program.rules[leaf].sites)
    grads = _ghost.per_example_grads(program, params, [leaf], sites)
    one = jax.ShapeDtypeStruct(program.avals[leaf].shape, program.avals[leaf].dtype)
    dtypes = [
        (o.dtype, _accumulators.accumulation_dtype(o.dtype, requested))
        for o in jax.eval_shape(picked, one)
    ]
    shapes = [o.shape for o in jax.eval_shape(picked, one)]
    n = rows.weights.shape[0]
    most = _ghost.chunk(program, [leaf]) if most is None else most
    size = max(d for d in range(1, min(n, most) + 1) if n % d == 0)
    clip = rows.clip(leaf)

    def split(x: Any) -> Any:
        return x.reshape(n // size, size, *x.shape[1:])

    xs = jax.tree.map(
        split,
        (
            [seen.inputs[k] for k in sites],
            [seen.cotangents[k] for k in sites],
            clip,
            rows.weights,
            rows.keep,
        ),
    )

    def body(carry: list[Any], chunk: Any) -> tuple[list[Any], None]:
        inputs, cotangents, c, w, keep = chunk
        (g,) = jax.vmap(grads)(inputs, cotangents)
        g = g * _ghost.at_rows(c, g).astype(g.dtype)
        if rows.drops:
            g = jnp.where(_ghost.at_rows(c != 0, g), g, jnp.zeros((), g.dtype))
        ys = jax.vmap(picked)(g)
        new = []
        for total, y, (_, wide) in zip(carry, ys, dtypes, strict=True):
            terms = jnp.where(_ghost.at_rows(keep, y), y.astype(wide), jnp.zeros((), wide))
            weights = jnp.where(keep, w, 0).astype(wide)
            new.append(total + _layout.weighted_rows(weights, terms))
        return new, None

    start = [jnp.zeros(s, wide) for s, (_, wide) in zip(shapes, dtypes, strict=True)]
    # typed as the sums come out: inside shard_map they vary over the batch's mesh axes
    typed = jax.eval_shape(lambda c, x: body(c, x)[0], start, jax.tree.map(lambda x: x[0], xs))
    totals, _ = jax.lax.scan(body, [_sharding.full(t, 0) for t in typed], xs)
    return [
        t if wide == dtype else _layout.Open(t, dtype)
        for t, (dtype, wide) in zip(totals, dtypes, strict=True)
    ]


def metric_values(
    reading: Reading,
    program: _ghost.Program,
    params: Sequence[Any],
    tree: Callable[[list[Any]], PyTree],
    seen: _ghost.Recorded,
) -> PyTree:
    """Each example's linear ``metrics_fn``, ``<g_b, V>`` for the direction ``V`` of each
    entry of each output leaf, from the sites (``_ghost.linear_values``)."""
    metrics = reading.metrics
    assert metrics is not None  # for the type checker: a linear reading has metrics
    zeros = [jnp.zeros(jnp.shape(p), jnp.result_type(p)) for p in params]

    def flat(leaves: list[Any]) -> list[Any]:
        return jax.tree.leaves(metrics(tree(leaves)))

    at_zero, pull = jax.vjp(flat, zeros)
    structure = jax.tree.structure(metrics(tree(zeros)))
    rows = jnp.shape(seen.outs[0])[0]
    values = []
    for j, out in enumerate(at_zero):
        size = math.prod(out.shape)

        def direction(e: jax.Array, j: int = j) -> list[Any]:
            cotangent = [jnp.zeros_like(o) for o in at_zero]
            cotangent[j] = e.reshape(at_zero[j].shape).astype(at_zero[j].dtype)
            return pull(cotangent)[0]

        basis = jnp.eye(size, dtype=out.dtype)
        each = jax.vmap(lambda e: _ghost.linear_values(program, params, seen, direction(e)))(
            basis
        )  # (size, rows)
        values.append(jnp.transpose(each).reshape(rows, *out.shape).astype(out.dtype))
    return jax.tree.unflatten(structure, values)
