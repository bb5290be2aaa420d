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
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun, primitives

from . import _clipping, _layout, _primitives, _programs, _sharding, _tuning
from ._primitives import facts

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
    program.rules.extend(_rule(program, leaf) for leaf in range(len(params)))
    return program


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


def _rule(program: Program, leaf: int) -> Rule:
    """The cheapest exact rule for ``leaf``."""
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
    cost = _gram_cost(program, site)
    if cost is None:
        return direct
    name, form, flops, entries, product = cost
    return Rule(name, reached, names, flops, 4 * entries, form, 4 * product)


def _rows_of(program: Program, site: Site) -> int:
    """Roughly how many rows a site's product sums over, per example (``T``)."""
    out = program.avals[program.eqns[site.eqn].outs[0]].shape
    return max(1, math.prod(out) // max(out[-1], 1)) if out else 1


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
    entries, and the products of a convolution's kernel gradient, which XLA computes one
    example at a time (a grouped convolution) instead of as one product over the batch."""
    size = sum(math.prod(program.avals[leaf].shape) for leaf in range(program.n_params))
    convolutions = sum(
        math.prod(_conv_dims(program, program.eqns[site.eqn]))
        for site in program.sites
        if program.eqns[site.eqn].primitive is _PRIMS.conv_general_dilated_p and site.free == (1,)
    )
    return _tuning.knobs().materialize_flops_per_entry * size + convolutions


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


def _gram_cost(program: Program, site: Site) -> tuple[str, str, int, int, int] | None:
    """``(rule, form, flops, entries, product entries)`` per example where ``site`` has a
    Gram rule, else None: ``entries`` counts the intermediates of its norm in ``form``,
    ``product entries`` those of the product form (a Gram form's fallback)."""
    e = program.eqns[site.eqn]
    if e.primitive is _PRIMS.dot_general_p and site.data == (1 - site.free[0],):
        h, t, k, n = _dense_dims(program, e, site.free[0])
        return "dense", *_product_cost(h, t, k, n)
    ungrouped = e.params.get("feature_group_count") == e.params.get("batch_group_count") == 1
    convolution = e.primitive is _PRIMS.conv_general_dilated_p
    if convolution and site.free == (1,) and site.data == (0,) and ungrouped:
        t, k, n = _conv_dims(program, e)
        return "conv", *_product_cost(1, t, k, n)
    if e.primitive is _PRIMS.gather_p and site.free == (0,) and _is_row_gather(program, e):
        rows, width = program.avals[_key(program, site, 0)].shape
        t = math.prod(program.avals[e.outs[0]].shape) // max(width, 1)
        scatter = rows * width + t * width
        if t * t <= rows:
            return "embedding", "gram", t * t * width, t * t + t * width, scatter
        return "embedding", "product", t * width + rows * width, scatter, scatter
    return None


def _product_cost(h: int, t: int, k: int, n: int) -> tuple[str, int, int, int]:
    """``(form, flops, entries, product entries)`` of the cheaper of the two forms of
    ``_product_norm``: flops, and ``_tuning.Knobs.gram_entry_flops`` for each entry of the
    intermediates it writes (the rows themselves are read by both)."""
    rows = h * t * (k + n)
    product = rows + h * k * n
    if t == 1:
        return "rows", h * (k + n), rows, product
    blocks = sum(-(-d // GRAM_BLOCK) for d in (k, n) if d > GRAM_BLOCK)  # gram_matrices
    gram_flops, written = h * t * t * (k + n), (2 + blocks) * h * t * t
    weight = _tuning.knobs().gram_entry_flops
    if gram_flops + weight * written <= h * t * k * n + weight * h * k * n:
        return "gram", gram_flops, rows + written, product
    return "product", h * t * k * n, product, product


def _dense_dims(program: Program, e: Eqn, free: int) -> tuple[int, int, int, int]:
    """``(H, T, K, N)`` of a ``dot_general`` whose operand ``free`` is the parameter:
    ``H`` shared batch entries, ``T`` rows of the example, ``K`` contracted, ``N`` out."""
    (contract, batch), (x, w) = (
        _dense_axes(e),
        (
            program.avals[e.ins[1 - free]].shape,  # type: ignore[index]
            program.avals[e.ins[free]].shape,  # type: ignore[index]
        ),
    )
    h = math.prod(x[d] for d in batch[1 - free])
    k = math.prod(x[d] for d in contract[1 - free])
    return h, math.prod(x) // max(h * k, 1), k, math.prod(w) // max(h * k, 1)


def _conv_dims(program: Program, e: Eqn) -> tuple[int, int, int]:
    """``(T, K, N)`` of a convolution's kernel gradient as a product of patches: ``T``
    output positions, ``K`` entries of a patch, ``N`` output features."""
    kernel = program.avals[e.ins[1]].shape  # type: ignore[index]
    out = program.avals[e.outs[0]].shape
    n = kernel[e.params["dimension_numbers"].rhs_spec[0]]
    return math.prod(out) // max(n, 1), math.prod(kernel) // max(n, 1), n


def _dense_axes(e: Eqn) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """``((lhs, rhs) contracting, (lhs, rhs) batch)`` dimensions of a ``dot_general``."""
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def _is_row_gather(program: Program, e: Eqn) -> bool:
    """Whether ``e`` takes whole rows of a matrix: ``table[ids]``."""
    table, ids = (program.avals[a].shape if not isinstance(a, Const) else None for a in e.ins)
    numbers = e.params["dimension_numbers"]
    return (
        table is not None
        and ids is not None
        and len(table) == 2
        and len(ids) >= 1
        and ids[-1] == 1
        and tuple(numbers.offset_dims) == (len(ids) - 1,)
        and tuple(numbers.collapsed_slice_dims) == (0,)
        and tuple(numbers.start_index_map) == (0,)
        and not numbers.operand_batching_dims
        and tuple(e.params["slice_sizes"]) == (1, table[1])
    )


def _read(env: dict[int, Any], a: Atom) -> Any:
    return a.value if isinstance(a, Const) else env[a]


def free_values(program: Program, params: Sequence[Any]) -> dict[int, Any]:
    """The values that do not depend on the example, from the parameter leaves."""
    env: dict[int, Any] = dict(enumerate(params))
    for e in program.eqns:
        if all(program.free(a) for a in e.ins):
            env.update(zip(e.outs, e.bind([_read(env, a) for a in e.ins]), strict=True))
    return env


def _floating(program: Program, keys: Sequence[int]) -> list[bool]:
    """Which of a site's outputs carry a cotangent: floating, and reached by the
    derivative (an unused output of a ``scan`` or ``cond`` site gets none, as in JAX,
    where a zero would meet the data in its products: ``inf * 0``)."""
    return [k in program.live and _inexact(program, k) for k in keys]


def _site_outputs(
    program: Program, site: Site, env: dict[int, Any], inputs: Sequence[Any]
) -> list[Any]:
    """The floating outputs of ``site`` at the free values ``env`` and data ``inputs``."""
    e = program.eqns[site.eqn]
    given = dict(zip(site.data, inputs, strict=True))
    outs = e.bind([given[p] if p in given else _read(env, a) for p, a in enumerate(e.ins)])
    return [o for o, f in zip(outs, _floating(program, e.outs), strict=True) if f]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What one batched pass records: per example, the program's outputs, and per site
    its data inputs and the loss's cotangents of its floating outputs."""

    outs: list[Any]
    inputs: list[list[Any]]
    cotangents: list[list[Any]]


def record(program: Program, params: Sequence[Any], example: Sequence[Any]) -> Recorded:
    """The forward pass over a batch of examples (leaves stacked on axis 0), and the
    backward pass from each example's loss to every site's outputs."""
    env = free_values(program, params)
    sites = {s.eqn: k for k, s in enumerate(program.sites)}
    computed: list[list[bool]] = [[] for _ in program.sites]
    """Per site and floating output, whether JAX's backward pass computes its cotangent
    (is not a symbolic zero); set by ``_tap`` as the backward pass is traced."""

    def forward(data: Sequence[Any], taps: list[list[Any]]) -> tuple[Any, Any]:
        values = dict(env)
        values.update(
            zip(range(program.n_params, program.n_params + program.n_data), data, strict=True)
        )
        inputs: list[list[Any]] = [[] for _ in program.sites]
        for i, e in enumerate(program.eqns):
            if all(program.free(a) for a in e.ins):
                continue
            ins = [_read(values, a) for a in e.ins]
            outs = e.bind(ins)
            k = sites.get(i)
            if k is not None and not facts(e).additive:
                inputs[k] = [ins[p] for p in program.sites[k].data]
            if k is not None and program.sites[k].same_as is None:
                tapped = iter(taps[k])
                floating = _floating(program, e.outs)
                outs = [
                    _tap(o, next(tapped), computed[k]) if f else o
                    for o, f in zip(outs, floating, strict=True)
                ]
            values.update(zip(e.outs, outs, strict=True))
        outs = [_read(values, a) for a in program.outs]
        return outs[0], (outs, inputs)

    def one(data: Sequence[Any]) -> tuple[Any, Any, Any]:
        taps = [
            [
                _zeros(program.avals[o])
                for o, f in zip(
                    program.eqns[s.eqn].outs,
                    _floating(program, program.eqns[s.eqn].outs),
                    strict=True,
                )
                if f
            ]
            if s.same_as is None
            else []
            for s in program.sites
        ]
        value, pull, (outs, inputs) = jax.vjp(lambda t: forward(data, t), taps, has_aux=True)
        (cotangents,) = pull(jnp.ones_like(value))
        return outs, inputs, cotangents

    closed, shapes = jax.make_jaxpr(jax.vmap(one), return_shape=True)(list(example))
    flat = jaxpr_as_fun(closed)(*jax.tree.leaves(list(example)))
    outs, inputs, cotangents = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    for k in reversed(range(len(program.sites))):
        shared = program.sites[k].same_as
        if shared is not None:
            cotangents[k] = cotangents[shared]
            computed[k] = computed[shared]
    rows = example[0].shape[0]
    for k, site in enumerate(program.sites):
        e = program.eqns[site.eqn]
        if facts(e).additive:  # their products never read the data
            avals = [program.avals[e.ins[p]] for p in site.data]  # type: ignore[index]
            inputs[k] = [jnp.zeros((rows, *a.shape), a.dtype) for a in avals]
        elif facts(e).bilinear and not any(computed[k]):
            inputs[k] = _unreached_zeroed(inputs[k], cotangents[k])
    return Recorded(outs, inputs, cotangents)


def recorded_bytes(program: Program) -> int:
    """Bytes per example of what ``record`` keeps until the clipped sum: each site's
    inputs that depend on the example, and its outputs' cotangents."""
    total = 0
    for site in program.sites:
        e = program.eqns[site.eqn]
        keys = [a for p, a in enumerate(e.ins) if p in site.data and not isinstance(a, Const)]
        keys += [k for k, f in zip(e.outs, _floating(program, e.outs), strict=True) if f]
        for k in keys:
            aval = program.avals[k]
            total += int(np.prod(aval.shape, dtype=np.int64)) * jnp.dtype(aval.dtype).itemsize
    return total


def _tap(out: Any, tap: Any, computed: list[bool]) -> Any:
    """``out + tap``, appending to ``computed`` whether the backward pass gives the sum
    a cotangent that it computes (the user's ``custom_vjp`` returning ``zeros_like``
    computes one: it meets the data in JAX's product) or a symbolic zero (an output that
    reaches the loss only through an unused output, a rule that returns None: JAX never
    forms that product). A static fact of the trace, the same for every example."""

    @jax.custom_vjp
    def add(out: Any, tap: Any) -> Any:
        return out + tap

    def forward(out: Any, tap: Any) -> tuple[Any, None]:
        return out.value + tap.value, None

    def backward(_: None, cotangent: Any) -> tuple[Any, Any]:
        computed.append(not isinstance(cotangent, SymbolicZero))
        return cotangent, cotangent

    add.defvjp(forward, backward, symbolic_zeros=True)
    return add(out, tap)


def _unreached_zeroed(inputs: list[Any], cotangents: list[Any]) -> list[Any]:
    """A bilinear site's floating data inputs, with each entry that is not finite
    read as 0 for an example whose cotangents there are all zero; for a site whose
    cotangents JAX's backward pass does not compute from the example (``record``).
    Where it does, a cotangent that comes out 0 (``tanh`` saturated by an infinite
    input) meets the data in JAX's product, and ``inf * 0`` makes that example's
    gradient NaN, as it is here.

    Its product is then 0, as it is where JAX's backward pass gives the site a symbolic
    zero (an output that reaches the loss only through an unused output of a ``sort``,
    ``scan``, ``cond`` or ``custom_jvp`` call, or through a rule whose tangent is zero,
    which ``_differentiated`` cannot tell apart), where ``inf * 0`` would make the norm
    and the sum NaN. Only there: a product linear in the data is 0 at data 0, where
    another site's (``p / x``, a ``log`` in a ``scan`` body) may not be finite. And only
    entries that are not finite: a finite entry is kept, so that an outer derivative
    still sees the product's dependence on the data where the cotangent is 0 but its
    derivative is not."""
    if not cotangents:
        return inputs
    reached = functools.reduce(
        jnp.logical_or,
        [jnp.any(g != 0, axis=tuple(range(1, g.ndim))) for g in cotangents],
    )
    return [
        jnp.where(at_rows(reached, x) | jnp.isfinite(x), x, jnp.zeros((), x.dtype))
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else x
        for x in inputs
    ]


def _zeros(aval: Any) -> jax.Array:
    """Zeros of ``aval``'s type: varying over the same manual mesh axes (``shard_map``),
    for the cotangent of a tap that did not vary would be summed over those axes; and on
    its Explicit mesh, for the cotangent is resharded to the tap's type, which for a
    scalar made by ``jnp.zeros`` alone is no mesh at all (see ``_sharding.full``)."""
    return _sharding.full(aval, 0)


def leaf_norms(program: Program, params: Sequence[Any], seen: Recorded) -> jax.Array:
    """Each example's gradient norm of each parameter leaf, ``(examples, leaves)``."""
    rows = jnp.shape(seen.outs[0])[0]
    columns: list[jax.Array] = [jnp.zeros((rows,), jnp.float32)] * program.n_params
    shared = shared_inputs(program)
    for leaves in shared:
        norms = _shared_site_norms(program, leaves, seen)
        for j, leaf in enumerate(leaves):
            columns[leaf] = norms[:, j]
    alone = {leaf for leaves in shared for leaf in leaves}
    for leaf, rule in enumerate(program.rules):
        if rule.name in GRAM_NORMS and leaf not in alone:
            columns[leaf] = _site_norms(program, rule, seen)
    direct = [leaf for leaf, r in enumerate(program.rules) if r.name == "direct"]
    if direct:
        for leaf, norms in zip(direct, _direct_norms(program, params, seen, direct), strict=True):
            columns[leaf] = norms
    wide = jnp.result_type(*columns) if columns else jnp.float32
    if not columns:
        return jnp.zeros((rows, 0))
    return jnp.stack(_clipping.aligned([c.astype(wide) for c in columns]), axis=1)


def shared_inputs(program: Program) -> list[list[int]]:
    """The leaves whose Gram forms can share the Gram matrix of their data input: dense
    sites that read the same value, as rows of the same layout (``q``, ``k`` and ``v``
    of one input), in groups of two or more."""
    groups: dict[Any, list[int]] = {}
    for leaf, rule in enumerate(program.rules):
        if rule.name == "dense" and rule.form == "gram":
            site = program.sites[rule.sites[0]]
            e = program.eqns[site.eqn]
            (contract, batch), data = _dense_axes(e), 1 - site.free[0]
            groups.setdefault((e.ins[data], contract[data], batch[data]), []).append(leaf)
    return [leaves for leaves in groups.values() if len(leaves) > 1]


SHARED_FLOOR = -30
"""The exponent below which no row's largest magnitude may fall, relative to the largest
of the example's input, for the shared Gram matrix to serve every site: then no row's
square underflows, and what an inner product loses to underflow is below ``2**-66`` of
its rows' norms, far within ``u``."""


def _shared_site_norms(program: Program, leaves: Sequence[int], seen: Recorded) -> jax.Array:
    """``(examples, len(leaves))``: the norms of dense leaves whose sites read one input
    (``shared_inputs``), from one Gram matrix of that input per example.

    The input's rows are scaled once, by the power of two that brings the largest
    magnitude into ``[1/2, 1)``, and their Gram matrix taken. Each site's Gram form wants
    its rows scaled by ``_balanced``, row by row: that Gram matrix is the shared one
    times ``2**(a_t + a_s)`` entry by entry, exactly (powers of two, and no entry
    underflows: ``SHARED_FLOOR``), and so is its rounding error, so each site's error
    bound (``_reliable``) holds as if its own rows had been multiplied. Each site's
    unreliable examples are recomputed by the product form, as in ``_site_norms``; a
    chunk of examples that does not meet ``SHARED_FLOOR``, or holds a value that is not
    finite, takes each site's own Gram matrix."""
    rules = [program.rules[leaf] for leaf in leaves]
    ks = [rule.sites[0] for rule in rules]
    sites = [program.sites[k] for k in ks]

    def each(x: Sequence[Any], gs: Sequence[Sequence[Any]]) -> Any:
        xs = _dense_rows(program, sites[0], x, gs[0])[0]
        mx = jnp.max(jnp.abs(xs), axis=-1, initial=0.0)
        top = jnp.max(mx, initial=0.0)
        usable = jnp.isfinite(top) & (top > 0)
        e = _clipping.exponent(jnp.where(usable, top, 1))
        rows = _clipping.exponent(jnp.where(mx > 0, mx, 1)) - e
        fits = usable & jnp.all((mx == 0) | (rows >= SHARED_FLOOR))
        xx = gram_matrices(_clipping.times_power(xs, -e))
        norms, reliable = [], []
        for site, g in zip(sites, gs, strict=True):
            xs, g_rows = _dense_rows(program, site, x, g)
            shift_x, shift_g, kept, scales = _balance(xs, g_rows)
            fits = fits & jnp.all(jnp.isfinite(g_rows))
            a = shift_x[..., 0] + e
            mine = _clipping.times_power(xx, a[..., :, None] + a[..., None, :])
            mine = jnp.where(kept & jnp.swapaxes(kept, -1, -2), mine, 0)
            gg = gram_matrices(jnp.where(kept, _clipping.times_power(g_rows, shift_g), 0))
            norm, ok = _gram_norm(mine, xs.shape[-1], gg, g_rows.shape[-1], scales)
            norms.append(norm)
            reliable.append(ok)
        return jnp.stack(norms), jnp.stack(reliable), fits

    def chunked(chunk: Any) -> jax.Array:
        x, gs = chunk
        norms, reliable, fits = jax.vmap(each)(x, gs)

        def checked() -> jax.Array:
            return jnp.stack(
                [
                    _recomputed(program, rule, (x, g), norms[:, j], reliable[:, j])
                    for j, (rule, g) in enumerate(zip(rules, gs, strict=True))
                ],
                axis=1,
            )

        def alone() -> jax.Array:
            own = [_checked(program, rule, (x, g)) for rule, g in zip(rules, gs, strict=True)]
            return jnp.stack(own, axis=1).astype(norms.dtype)

        return _sharding.data_cond(jnp.all(fits), checked, alone)

    pairs = (seen.inputs[ks[0]], [seen.cotangents[k] for k in ks])
    return _by_chunks(chunked, pairs, _chunk_rows(sum(rule.bytes for rule in rules)))


def _recomputed(
    program: Program, rule: Rule, chunk: Any, norms: jax.Array, reliable: jax.Array
) -> jax.Array:
    """``norms`` of a chunk of examples, those not ``reliable`` recomputed by the product
    form (a branch: only where some example needs it)."""
    site, norm = program.sites[rule.sites[0]], GRAM_NORMS[rule.name]

    def product(pair: Any) -> jax.Array:
        return norm(program, site, *pair, gram=False)[0]

    def recomputed() -> jax.Array:
        exact = jax.lax.map(product, chunk, batch_size=_chunk_rows(rule.product_bytes))
        return jnp.where(reliable, norms, exact.astype(norms.dtype))

    return _sharding.data_cond(jnp.all(reliable), lambda: norms, recomputed)


def _checked(program: Program, rule: Rule, chunk: Any) -> jax.Array:
    """A ``gram`` rule's norms of a chunk of examples, checked (``_recomputed``)."""
    site, norm = program.sites[rule.sites[0]], GRAM_NORMS[rule.name]
    norms, reliable = jax.vmap(lambda x, g: norm(program, site, x, g, gram=True))(*chunk)
    return _recomputed(program, rule, chunk, norms, reliable)


def _site_norms(program: Program, rule: Rule, seen: Recorded) -> jax.Array:
    """Each example's norm of a leaf with a Gram rule, ``rule.form`` at a time. A ``gram``
    form's chunk of examples is recomputed by the product form, inside the compiled loop,
    where any of its examples fails the Gram form's error bound (``_reliable``)."""
    k = rule.sites[0]
    site, norm = program.sites[k], GRAM_NORMS[rule.name]

    def product(pair: Any) -> jax.Array:
        return norm(program, site, *pair, gram=False)[0]

    pairs = (seen.inputs[k], seen.cotangents[k])
    if rule.form != "gram" and rule.name in ROWS:
        return _by_chunks(
            lambda chunk: _unscaled(program, rule, chunk), pairs, _chunk_rows(rule.bytes)
        )
    if rule.form != "gram":
        return jax.lax.map(product, pairs, batch_size=_chunk_rows(rule.bytes))
    return _by_chunks(lambda chunk: _checked(program, rule, chunk), pairs, _chunk_rows(rule.bytes))


def _unscaled(program: Program, rule: Rule, chunk: Any) -> jax.Array:
    """A ``product`` or ``rows`` rule's norms of a chunk of examples, from its rows as
    they are, where every example's sum of squares lies in ``[SAFE_LOW * tiny, max /
    SAFE_HIGH]`` (or, per shared entry, the rows on one side are all 0 and those on the
    other finite: that part of the gradient is exactly 0, even where the other side's
    squares overflowed); otherwise, for the whole chunk, from rows scaled by powers of
    two (``_balanced``), in a branch.

    In that range no square or partial sum overflowed, and what underflow took is far
    below ``u``: each square lost is below ``tiny``, at most ``n 2**-66`` of the sum over
    ``n`` squares; each product ``x g`` lost to an entry of ``x^T g`` is below ``tiny``,
    at most ``T sqrt(K N) tiny`` of the product's norm, which is at least ``2**33
    sqrt(tiny)``. A product that overflowed is ``inf`` or NaN, outside the range. The
    scaled form costs a largest-magnitude pass over every row and a multiplication per
    entry (on the MLP of ``benchmarks/clipping.py``, a fifth of a ghost step's thunks)."""
    site, norm = program.sites[rule.sites[0]], GRAM_NORMS[rule.name]
    xs, gs = jax.vmap(lambda x, g: ROWS[rule.name](program, site, x, g))(*chunk)
    info = jnp.finfo(xs.dtype)
    low, high = _clipping.SAFE_LOW * info.tiny, info.max / _clipping.SAFE_HIGH

    def fits(squares: jax.Array) -> jax.Array:
        return (squares >= low) & (squares <= high)

    def zero(rows: jax.Array) -> jax.Array:
        return jnp.all(rows == 0, axis=tuple(range(2, rows.ndim)))

    _, h, t, _ = xs.shape
    if t == 1:  # per shared entry h, ||x_h|| ||g_h||
        sx, sg = (jnp.sum(jnp.square(v), axis=(2, 3)) for v in (xs, gs))
        fine = fits(sx) & fits(sg)
        each = _clipping.sqrt(sx) * _clipping.sqrt(sg)

        def combined(each: jax.Array) -> jax.Array:
            return each[:, 0] if h == 1 else _clipping.mapped_row_norms(each, each.shape[0])

        norms = combined(each)

        def without(nothing: jax.Array) -> jax.Array:  # sqrt(inf) * 0 is NaN: set to 0
            return combined(jnp.where(nothing, 0, each))
    else:
        product = jnp.einsum("bhtk,bhtn->bhkn", xs, gs, precision=HIGHEST)
        squares = jnp.sum(jnp.square(product), axis=(1, 2, 3))
        fine = fits(squares)[:, None]
        norms = _clipping.sqrt(squares)

        def without(nothing: jax.Array) -> jax.Array:  # the products of 0 are 0 already
            return norms

    def scaled() -> jax.Array:
        found = jax.vmap(lambda x, g: norm(program, site, x, g, gram=False)[0])(*chunk)
        return found.astype(norms.dtype)

    def with_zeros() -> jax.Array:
        # A gradient that is exactly 0 (a row of weight 0: its cotangents are 0) is
        # taken as it is: every product is 0, so every square, and nothing was lost.
        finite = [jnp.all(jnp.isfinite(v), axis=tuple(range(2, v.ndim))) for v in (xs, gs)]
        nothing = (zero(xs) & finite[1]) | (zero(gs) & finite[0])
        found = without(nothing)
        return _sharding.data_cond(jnp.all(fine | nothing), lambda: found, scaled)

    return _sharding.data_cond(jnp.all(fine), lambda: norms, with_zeros)


def _chunk_rows(per_example: int) -> int:
    """How many examples' norm intermediates of ``per_example`` bytes fit in a chunk."""
    return max(1, _tuning.knobs().norm_chunk_bytes // max(per_example, 1))


def _by_chunks(f: Callable[[Any], jax.Array], xs: Any, size: int) -> jax.Array:
    """``f`` of every chunk of ``size`` rows of ``xs`` (a last, shorter chunk for the
    rest), concatenated: ``jax.lax.map(..., batch_size=size)`` where ``f`` sees the
    chunk whole, so that a choice it makes for the chunk stays a branch."""
    rows = jax.tree.leaves(xs)[0].shape[0]
    if rows <= size:
        return f(xs)
    whole = rows // size * size
    stacked = jax.tree.map(lambda x: x[:whole].reshape(rows // size, size, *x.shape[1:]), xs)
    mapped = jax.lax.map(f, stacked)
    parts = [mapped.reshape(whole, *mapped.shape[2:])]
    if rows > whole:
        parts.append(f(jax.tree.map(lambda x: x[whole:], xs)))
    return jnp.concatenate(parts)


GRAM_TOLERANCE = {32: 1e-5, 64: 1e-12}
"""The relative error, by the bits of the dtype the norms are computed in (at least
float32), that a Gram form's norm must be within of its exact value: a norm whose error
bound exceeds it is recomputed by the product form."""

GRAM_ERROR_MARGIN = 1.125
"""The factor on the Gram form's error bound ``u * E`` (see ``_reliable``, ``_gram_sum``)
for what the bound leaves out: ``E`` is computed from the rounded Gram matrices, not the
exact ones, and in floating point itself (by halving: ``log2`` of its terms times
``u``); the products of two errors (``u^2``) are dropped; and ``gamma_n = n u / (1 - n
u)``, not ``n u``. Each of these is below ``1e-5`` relative for the lengths a Gram
matrix takes, so an eighth is ample. The bound itself is
a worst case, for any order of XLA's additions (``inner_error``, ``outer_error``):
``tests/test_norm_numerics.py`` pins it on rows built to round badly."""


def _reliable(gram: jax.Array, error: jax.Array) -> jax.Array:
    """Whether a Gram sum ``gram`` (a squared norm), whose rounding error is bounded by
    ``u * error`` (``_gram_sum``), gives its norm within ``GRAM_TOLERANCE``. The square's
    relative error is twice the norm's. A sum that is not finite came from rows that are
    not, and is kept as it is: the product form would not be finite either."""
    u = jnp.finfo(gram.dtype).eps / 2
    tolerance = GRAM_TOLERANCE[jnp.finfo(gram.dtype).bits]
    bound = GRAM_ERROR_MARGIN * u * error
    return (bound <= 2 * tolerance * gram) | (error == 0) | ~jnp.isfinite(gram + error)


GRAM_BLOCK = 16
"""The longest inner product a Gram matrix hands to one ``dot``. The order in which a
``dot`` adds its products is the backend's, and a sum of ``n`` products in an unknown
order errs by up to ``n u`` times the sum of their magnitudes (``gamma_n``): which bites
where a row's one large entry meets many small ones, each below half an ulp of the
running sum. XLA:CPU on an AVX2 machine adds a row of 128 entries one after another
(122 ``u ||a||^2`` measured on such a row, against 3.1 on an AVX-512 one). Rows are cut
into blocks of this length, and the blocks' Gram matrices added by halving
(``tree_sum``), whose order is the program's: each inner product then errs by at most
``inner_error(k) u ||a_t|| ||a_s||`` on any backend. 16 keeps that factor at 19 for
rows of 128 (the Gram form is then kept on random rows of 64 tokens, where the bound
is about 220 times the squared norm, below the ``2 tol / (margin u)`` = 298 it must
meet), at about 1.6 times the time of blocks of 128 on the CPU."""


def tree_sum(x: jax.Array) -> jax.Array:
    """The sum over the leading axis by halving: each result is a sum of at most
    ``ceil(log2(len(x)))`` rounded additions, whatever the backend (elementwise adds of
    slices, which XLA does not reassociate). 0 for an empty axis."""
    if x.shape[0] == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        head = x[:half] + x[half : 2 * half]
        x = jnp.concatenate([head, x[2 * half :]]) if x.shape[0] % 2 else head
    return x[0]


def _depth(n: int) -> int:
    """How many rounded additions ``tree_sum`` of ``n`` entries chains at most."""
    return max(n - 1, 0).bit_length()


def inner_error(length: int) -> int:
    """How many times ``u ||a|| ||b||`` an inner product of ``length`` entries, as
    ``gram_matrices`` takes it, can err by: ``gamma`` of a block's products (at most
    ``GRAM_BLOCK``, in any order), and the halving sum of the blocks."""
    blocks = -(-length // GRAM_BLOCK)
    return min(length, GRAM_BLOCK) + _depth(blocks)


def outer_error(terms: int) -> int:
    """How many times the sum of their magnitudes the sum of ``terms`` Gram terms
    ``xx * gg`` can err by (``_gram_sum``): the rounding of each product, and the
    halving sum."""
    return 1 + _depth(terms)


def gram_matrices(rows: jax.Array) -> jax.Array:
    """``(H, T, T)`` Gram matrices of rows ``(H, T, k)``, in blocks of ``GRAM_BLOCK``
    entries added by halving (see there): each inner product then errs by at most
    ``inner_error(k) u`` times the product of its rows' norms, in any backend's order."""
    h, t, k = rows.shape
    if k <= GRAM_BLOCK:
        return jnp.einsum("htk,hsk->hts", rows, rows, precision=HIGHEST)
    blocks = -(-k // GRAM_BLOCK)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, blocks * GRAM_BLOCK - k)))
    rows = rows.reshape(h, t, blocks, GRAM_BLOCK)
    parts = jnp.einsum("htjb,hsjb->jhts", rows, rows, precision=HIGHEST)
    # The barrier keeps XLA from folding the sum of the blocks back into the product
    # (a reduction over a dot's batch dimension becomes a contraction).
    return tree_sum(jax.lax.optimization_barrier(parts))


def _gram_sum(
    xx: jax.Array, gg: jax.Array, k: int = 0, n: int = 0, exact: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``sum(xx * gg)`` over Gram matrices (``gram_matrices``) of rows ``a_t`` of ``k``
    and ``g_t`` of ``n`` entries, leading axes ``(..., T, T)``, and ``E``, a bound on its
    rounding error over ``u`` (times ``GRAM_ERROR_MARGIN``, see there).

    Each inner product ``a_t.a_s`` errs by at most ``inner_error(k) u ||a_t|| ||a_s||``
    (Cauchy-Schwarz bounds the magnitudes of its products by the norms), so a term by
    that times ``|g_t.g_s|``, plus the same for ``gg``, and the sum of the terms by
    ``outer_error`` times their magnitudes more. Where rows repeat and cotangents cancel,
    ``E`` is as large as ``(sum_t ||a_t|| ||g_t||)^2`` while the sum (the squared norm)
    is small: the squared condition number of the form. ``exact``: ``xx`` has no rounding
    error (the equal-ids matrix of an embedding)."""
    total = tree_sum((xx * gg).reshape(-1))
    g = jnp.sqrt(jnp.diagonal(gg, axis1=-2, axis2=-1))
    error = inner_error(n) * jnp.abs(xx) * (g[..., :, None] * g[..., None, :])
    error = error + outer_error(math.prod(xx.shape)) * jnp.abs(xx * gg)
    if not exact:
        a = jnp.sqrt(jnp.diagonal(xx, axis1=-2, axis2=-1))
        error = error + inner_error(k) * a[..., :, None] * a[..., None, :] * jnp.abs(gg)
    # By halving too: a sum of N positive terms in an unknown order may be off by N u
    # relative, beyond the margin for N above a million; by halving, log2(N) u.
    return total, tree_sum(error.reshape(-1))


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
    return jax.lax.map(norms, xs, batch_size=chunk(program, leaves))


def clipped_sum(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    scale: jax.Array,
    groups: Sequence[int],
    clean: bool,
    norms: jax.Array | None = None,
    kept: jax.Array | None = None,
) -> list[Any]:
    """``sum_b scale[b, groups[leaf]] * g_b`` for every leaf: one product per site at
    the scaled cotangents (book-keeping). With ``clean``, rows of scale 0 contribute
    exactly 0 even where their data are not finite (weight-0 rows, ``nan_safe``), or
    where ``kept`` (``(rows,)``) is given, the rows it leaves out (weight-0 rows alone:
    without ``nan_safe`` an infinite gradient times its factor 0 is NaN).

    Given each example's ``norms`` (``(rows, leaves)``), a microbatch where a scaled
    cotangent may have lost to underflow more than ``GRAM_TOLERANCE`` of an example's
    scaled gradient (``underflow_risk``) takes its sum from the per-example gradients
    of the sites instead (``_per_example_sum``), inside the compiled loop."""
    total: list[Any] = [jnp.zeros_like(p) for p in params]
    keep = scale != 0 if clean else jnp.ones(scale.shape, bool)
    if clean and kept is not None:
        keep = jnp.broadcast_to(kept[:, None], scale.shape)
    for group in sorted(set(groups)):
        leaves = [leaf for leaf, g in enumerate(groups) if g == group]
        factor, kept = scale[:, group], keep[:, group]
        reached = _direct_sites(program, leaves) + [
            k
            for leaf in leaves
            if program.rules[leaf].name != "direct"
            for k in program.rules[leaf].sites
        ]
        reached = sorted(set(reached))
        linear = [k for k in reached if program.sites[k].linear]
        other = [k for k in reached if not program.sites[k].linear]
        if linear:
            found = _linear_sum(program, params, seen, leaves, linear, factor, kept, clean, norms)
            for leaf, g in zip(leaves, found, strict=True):
                total[leaf] = total[leaf] + g
        if other:
            size = chunk(program, leaves)
            found = _per_example_sum(program, params, seen, leaves, other, factor, kept, size)
            for leaf, g in zip(leaves, found, strict=True):
                total[leaf] = total[leaf] + g
    return total


def _linear_sum(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    leaves: list[int],
    sites: list[int],
    factor: jax.Array,
    kept: jax.Array,
    clean: bool,
    norms: jax.Array | None,
) -> list[Any]:
    """``clipped_sum`` of one group's ``leaves`` at its linear ``sites``: book-keeping at
    the cotangents times the factors over their power of two (``to_unit``), unless
    ``norms`` are given and ``underflow_risk`` says that may lose too much."""
    unit, power = to_unit(factor)

    def book_keeping() -> tuple[list[Any], jax.Array]:
        return scaled_products(program, params, seen, leaves, sites, unit, kept, clean), power

    def per_example() -> tuple[list[Any], jax.Array]:
        found = _per_example_sum(program, params, seen, leaves, sites, factor, kept, 1)
        return found, jnp.ones_like(power)

    if norms is None:
        found, ups = book_keeping()
        return [times_both(g, ups) for g in found]
    target = jnp.abs(unit) * jnp.max(norms[:, leaves], axis=1)
    # A factor that the division by the largest takes below tiny (a weight far above 1
    # beside a factor far below it: 2**60 beside 5e-21) would enter as 0, or as a few
    # bits, though its own value is a normal number: the per-example sum takes it as it is.
    flushed = (factor != 0) & (jnp.abs(unit) < jnp.finfo(unit.dtype).tiny)
    risky = underflow_risk(program, seen, sites, unit, target) | flushed
    # The power of two is applied after the branch (by 1 after the per-example sum):
    # outside it, XLA fuses the two multiplications of a weight-sized sum into the
    # accumulator's addition; inside, each was a pass of its own over the sum (on the
    # MLP of ``benchmarks/clipping.py`` at microbatch 16, 6.6 of 62 ms a step).
    found, ups = _sharding.data_cond(jnp.any(risky), per_example, book_keeping)
    return [times_both(g, ups) for g in found]


def to_unit(factors: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``factors`` divided by ``2^e``, the power of two just above the largest in
    magnitude (``2^(e-1) <= max < 2^e``), and ``2^e`` as two factors, each normal where
    ``2^e`` itself overflows (factors times weights near the dtype's largest number,
    ``e = 128`` in float32), stacked; ``2^e`` is 1 where the largest is 0 or not finite.
    All exact. Scaling by the first, then by both factors of ``2^e``, runs a backward
    pass at cotangents no smaller than the loss's own for the example of the largest
    factor, so that clip factors far below 1 do not push them below ``tiny``. A largest
    factor below ``tiny`` counts as ``tiny`` (``_clipping.exponent``)."""
    top = jnp.max(jnp.abs(factors))
    usable = (top > 0) & jnp.isfinite(top)
    exponent = jnp.where(usable, _clipping.exponent(jnp.where(usable, top, 1)), 0)
    half = _clipping.halve(exponent)
    ups = [_clipping.power_of_two(k, factors.dtype) for k in (half, exponent - half)]
    return _clipping.times_power(factors, -exponent), jnp.stack(ups)


def times_both(g: jax.Array, ups: jax.Array) -> jax.Array:
    """``g`` times the two factors of ``to_unit``'s power of two, one after the other."""
    return g * ups[0].astype(g.dtype) * ups[1].astype(g.dtype)


def underflow_risk(
    program: Program,
    seen: Recorded,
    sites: Sequence[int],
    factor: jax.Array,
    target: jax.Array,
) -> jax.Array:
    """Whether each example's sum at ``sites``, taken at its cotangents times its
    ``factor`` in the model's dtype, may differ from ``factor`` times its gradient by
    more than ``GRAM_TOLERANCE`` of ``target`` (a lower bound of that scaled
    gradient's norm), ``(rows,)``. Scaling both by a power of two leaves the answer.
    Where ``scales_data`` (the site's data rows times the factors, not its
    cotangents), data and cotangents swap their roles below.

    Rounding in the normal range costs ``u`` relative per entry, as in the gradient
    itself. An entry ``c g`` below the dtype's smallest normal number ``tiny`` is
    rounded to a multiple of the smallest subnormal, or flushed to 0: off by at most
    ``tiny``. At a bilinear site (a dot, a convolution, a product) an entry's
    error moves the parameters' gradient by at most ``tiny`` times the sum of the
    magnitudes of the example's data at the site; at a selecting one (a lookup, an
    added bias) by at most ``tiny``. The bound is ``tiny`` times that sum (or 1),
    times the count of such entries, summed over the sites. At a site that is not
    ``bounded`` (another primitive, or a gain between the leaf and the site) any lost
    entry is a risk. A factor of 0 leaves the example out and loses nothing.

    The bound is kept in float32 or the factor's wider dtype: float64's ``tiny`` is 0 in
    float32. A site that loses nothing adds 0 even where its data sum overflowed (no
    ``0 * inf``), and one that loses something beside data too large to sum is at risk.

    Most microbatches lose nothing: one pass per scaled side finds each example's
    smallest magnitude other than 0, and only where that times the factor falls below
    ``tiny`` (then and only then does an entry underflow: rounding a product is monotone
    in each factor) does a ``lax.cond`` count the entries and sum the data. Before, every
    microbatch paid both (the tied LM of ``benchmarks/clipping.py`` under forced ghost:
    about 36 ms of a 490 ms step in the count's passes alone)."""
    rows = factor.shape[0]
    wide = jnp.promote_types(factor.dtype, jnp.float32)
    c = jnp.abs(factor).astype(wide)
    sides = [_scaled_side(program, seen, k) for k in sites]
    hit = jnp.zeros((rows,), bool)
    for scaled, _ in sides:
        for g in scaled:
            flat = jnp.abs(jnp.reshape(g, (rows, -1))).astype(wide)
            # ``flat > 0`` leaves out NaN too, which the count never takes as lost.
            smallest = jnp.min(jnp.where(flat > 0, flat, jnp.inf), axis=1, initial=jnp.inf)
            hit = hit | (smallest * c < jnp.finfo(jnp.result_type(g)).tiny)
    hit = hit & (factor != 0)

    # Both branches vary over every manual mesh axis (inside ``shard_map``) that what
    # the count reads varies over; where the branch is not taken, ``hit`` is all False.
    read = [factor, target, *(v for side in sides for part in side for v in part)]
    axes = sorted({a for v in read for a in _sharding.varying_of(v)})

    def counted() -> jax.Array:
        risk = _counted_risk(program, sites, sides, factor, target)
        return _sharding.varying_over(risk, axes)

    return _sharding.data_cond(jnp.any(hit), counted, lambda: _sharding.varying_over(hit, axes))


def _scaled_side(program: Program, seen: Recorded, k: int) -> tuple[list[Any], list[Any]]:
    """Site ``k``'s side that ``scaled_products`` scales by the factors, and the other."""
    scaled, other = seen.cotangents[k], seen.inputs[k]
    if scales_data(program, seen, k):
        scaled, other = other, scaled
    return list(scaled), list(other)


def _counted_risk(
    program: Program,
    sites: Sequence[int],
    sides: Sequence[tuple[list[Any], list[Any]]],
    factor: jax.Array,
    target: jax.Array,
) -> jax.Array:
    """``underflow_risk``'s bound, counted: the entries each scaled side loses, times
    the other side's magnitudes."""
    rows = factor.shape[0]
    wide = jnp.promote_types(factor.dtype, jnp.float32)
    bound = jnp.zeros((rows,), wide)
    c = jnp.abs(factor).astype(wide)
    for k, (scaled, other) in zip(sites, sides, strict=True):
        site = program.sites[k]
        if not site.bounded:
            data = jnp.full((rows,), jnp.inf, wide)
        elif facts(program.eqns[site.eqn]).bilinear:
            data = jnp.zeros((rows,), wide)
            for a in other:
                data = data + jnp.sum(jnp.abs(jnp.reshape(a, (rows, -1))).astype(wide), axis=1)
        else:
            data = jnp.ones((rows,), wide)
        lost = jnp.zeros((rows,), wide)
        for g in scaled:
            tiny = jnp.finfo(jnp.result_type(g)).tiny
            flat = jnp.abs(jnp.reshape(g, (rows, -1))).astype(wide)
            under = (flat != 0) & (flat * c[:, None] < tiny)
            lost = lost + tiny * jnp.sum(under, axis=1).astype(wide)
        bound = bound + jnp.where(lost > 0, lost * data, 0)
    tolerance = GRAM_TOLERANCE[max(32, jnp.finfo(wide).bits)]
    at_stake = (factor != 0) & (bound > 0)
    return at_stake & ~(bound <= tolerance * target.astype(bound.dtype))


def _per_example_sum(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    leaves: Sequence[int],
    sites: Sequence[int],
    factor: jax.Array,
    kept: jax.Array,
    size: int,
) -> list[Any]:
    """``sum_b factor[b] * g_b`` of ``leaves`` at ``sites`` from each example's
    gradient, formed at most ``size`` examples at a time (the largest divisor of the
    rows up to it) and scaled in float32 or wider: no cotangent is multiplied by a
    factor. Rows not ``kept`` contribute exactly 0. The fallback of ``clipped_sum``
    takes one example at a time: it runs only on inputs built to underflow, and its
    memory is then one example's gradient beside the sum."""
    grads = per_example_grads(program, params, leaves, sites)
    rows = factor.shape[0]
    size = max(d for d in range(1, min(size, rows) + 1) if rows % d == 0)

    def chunks(x: Any) -> Any:
        return jnp.reshape(x, (rows // size, size, *jnp.shape(x)[1:]))

    xs = (
        [[chunks(v) for v in _cleaned(program, k, seen.inputs[k], kept)] for k in sites],
        [[chunks(v) for v in _zero_rows(seen.cotangents[k], kept)] for k in sites],
        chunks(jnp.where(kept, factor, 0)),
        chunks(kept),
    )

    def summed(x: Any) -> list[Any]:
        inputs, cotangents, w, k = x
        out = []
        for g in jax.vmap(grads)(inputs, cotangents):
            wide = jnp.promote_types(g.dtype, jnp.float32)
            g = jnp.where(at_rows(k, g), g, jnp.zeros((), g.dtype)).astype(wide)
            out.append(_layout.weighted_rows(w.astype(wide), g))
        return out

    def step(carry: list[Any], x: Any) -> tuple[list[Any], None]:
        return [c + s for c, s in zip(carry, summed(x), strict=True)], None

    # The first chunk outside the scan: its sum, not zeros, types the carry (under
    # shard_map, a value that varies over the manual axes).
    total, _ = jax.lax.scan(step, summed(jax.tree.map(lambda x: x[0], xs)),
                            jax.tree.map(lambda x: x[1:], xs))  # fmt: skip
    return [t.astype(jnp.result_type(params[leaf])) for t, leaf in zip(total, leaves, strict=True)]


def at_rows(keep: jax.Array, x: jax.Array) -> jax.Array:
    """``keep`` of shape ``(rows,)`` broadcast against ``x`` along its axis 0."""
    return jnp.reshape(keep, keep.shape + (1,) * (jnp.ndim(x) - 1))


def _zero_rows(values: Sequence[Any], keep: jax.Array) -> list[Any]:
    return [jnp.where(at_rows(keep, v), v, jnp.zeros((), v.dtype)) for v in values]


def _cleaned(program: Program, k: int, values: Sequence[Any], keep: jax.Array) -> list[Any]:
    """Site ``k``'s data ``values`` with each row not in ``keep`` replaced by a stand-in,
    whose cotangent is then 0: 0 at a bilinear site, where the product is 0 at data
    0. Elsewhere data 0 may be where the site is singular (``tanh(p / x)``, ``log(x)`` in
    a scan body) and ``0 * inf`` would make the sum NaN:
    the stand-in is the first kept row, or where the chunk keeps none the row's own data
    where it is finite, else 0 (``scaled_products`` then drops the chunk's sum)."""
    if facts(program.eqns[program.sites[k].eqn]).bilinear:
        return _zero_rows(values, keep)
    first = jnp.argmax(keep)

    def cleaned(v: Any) -> Any:
        v = _sharding.varying_like(v, keep)
        own = v
        if jnp.issubdtype(v.dtype, jnp.inexact):
            own = jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))
        return jnp.where(at_rows(keep, v), v, jnp.where(keep[first], v[first][None], own))

    return [cleaned(v) for v in values]


def scales_data(program: Program, seen: Recorded, k: int) -> bool:
    """Whether ``scaled_products`` scales site ``k``'s data rows by the factors rather
    than its output cotangents: at a bilinear site with one floating data input,
    where the data has no more entries than the cotangents. The sum is the same (the
    site's output is linear in its data); the multiplication is over fewer entries,
    and on XLA:CPU a scaled cotangent that the weight gradient's product reads
    transposed became a slow fused transposing copy (on the tied transformer LM of
    ``benchmarks/clipping.py`` at 64 tokens, ghost took 2.2x a plain step with every
    cotangent scaled, 1.9x so)."""
    e = program.eqns[program.sites[k].eqn]
    (data, cotangents) = seen.inputs[k], seen.cotangents[k]
    if not facts(e).bilinear or len(data) != 1:
        return False
    if not jnp.issubdtype(jnp.result_type(data[0]), jnp.inexact):
        return False
    return jnp.size(data[0]) <= sum(jnp.size(g) for g in cotangents)


def scaled_products(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    leaves: Sequence[int],
    sites: Sequence[int],
    factor: jax.Array,
    keep: jax.Array,
    clean: bool,
) -> list[Any]:
    if not sites:
        return [jnp.zeros_like(params[leaf]) for leaf in leaves]

    on_data = {k for k in sites if scales_data(program, seen, k)}

    def data_of(k: int) -> list[Any]:
        values = _cleaned(program, k, seen.inputs[k], keep) if clean else seen.inputs[k]
        if k in on_data:
            values = [v * at_rows(factor, v).astype(v.dtype) for v in values]
        return values

    def outs_of(values: Sequence[Any]) -> list[Any]:
        env = _free_with(program, params, leaves, values)
        return [
            jax.vmap(lambda a, s=program.sites[k]: _site_outputs(program, s, env, a))(data_of(k))
            for k in sites
        ]

    outs, pull = jax.vjp(outs_of, [params[leaf] for leaf in leaves])

    def scaled(g: jax.Array, out: jax.Array, k: int) -> jax.Array:
        if k not in on_data:
            g = g * at_rows(factor, g).astype(g.dtype)
        g = jnp.where(at_rows(keep, g), g, jnp.zeros((), g.dtype)) if clean else g
        # On an Explicit mesh the recorded cotangent may be laid out otherwise than the
        # site's output (a tensor-parallel layer): the VJP wants the output's type.
        sharding = _sharding.explicit_sharding(out)
        return g if sharding is None else jax.sharding.reshard(g, sharding)

    cotangents = [
        [scaled(g, o, k) for g, o in zip(seen.cotangents[k], out, strict=True)]
        for k, out in zip(sites, outs, strict=True)
    ]
    found = pull(cotangents)[0]
    if not clean:
        return found
    # A chunk that keeps no row adds 0, even where every stand-in is singular.
    anything = jnp.any(keep)
    return [jnp.where(anything, g, jnp.zeros((), g.dtype)) for g in found]


def linear_values(
    program: Program, params: Sequence[Any], seen: Recorded, direction: Sequence[Any]
) -> jax.Array:
    """Each example's ``<g_b, V>`` for a ``direction`` ``V`` (one array per parameter
    leaf), ``(rows,)``: at every site, the output cotangents against the site's product
    with ``V`` pushed through the parameters-only program (one JVP, never a gradient).
    Exact where every site is linear in its cotangent, whose VJP is then the JVP's
    transpose."""
    leaves = [leaf for leaf, r in enumerate(program.rules) if r.name != "unused"]
    sites = _direct_sites(program, leaves)
    rows = jnp.shape(seen.outs[0])[0]
    if not sites:
        return jnp.zeros((rows,), jnp.result_type(*params) if params else jnp.float32)

    def outs_of(values: Sequence[Any]) -> list[Any]:
        env = _free_with(program, params, leaves, values)
        return [
            jax.vmap(lambda a, s=program.sites[k]: _site_outputs(program, s, env, a))(
                seen.inputs[k]
            )
            for k in sites
        ]

    primals = [params[leaf] for leaf in leaves]
    tangents = [jnp.asarray(direction[leaf], jnp.result_type(params[leaf])) for leaf in leaves]
    _, pushed = jax.jvp(outs_of, (primals,), (tangents,))
    total: Any = 0
    for k, outs in zip(sites, pushed, strict=True):
        for t, g in zip(outs, seen.cotangents[k], strict=True):
            total = total + jnp.sum(t * g, axis=tuple(range(1, t.ndim)))
    return total


def _balanced(xs: jax.Array, gs: jax.Array) -> tuple[jax.Array, jax.Array, tuple[Any, ...]]:
    """Rows ``xs[h, t]`` and ``gs[h, t]`` (at least float32) scaled by powers of two, one
    pair per row, and the factors that undo it, for ``_from_gram``.

    Each row pair is first rescaled by ``2**-k`` and ``2**k`` so that their largest
    magnitudes meet halfway: every product ``x_t (outer) g_t``, so every Gram term and the
    norm, is unchanged (exactly: powers of two), but one row's large input with a small
    cotangent no longer sets the scale of the others (whose squared terms would then
    underflow to 0). Then all rows of each side are scaled so that the largest magnitude
    is in ``[1/2, 1)`` (``_scaled``'s reason); both in one multiplication per entry. A row
    with a zero factor and a finite other contributes nothing, and is zeroed. Where an
    entry is not finite, the rows are left as they are and the first factor returned is
    that magnitude (``inf`` or NaN)."""
    shift_x, shift_g, kept, scales = _balance(xs, gs)
    xs = jnp.where(kept, _clipping.times_power(xs, shift_x), 0)
    gs = jnp.where(kept, _clipping.times_power(gs, shift_g), 0)
    return xs, gs, scales


def _balance(xs: jax.Array, gs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """``_balanced``'s powers of two: the exponents of each row's scale on each side
    ``(H, T, 1)``, the rows kept, and the factors that undo the scaling."""
    mx = jnp.max(jnp.abs(xs), axis=-1, initial=0.0)
    mg = jnp.max(jnp.abs(gs), axis=-1, initial=0.0)
    finite = jnp.isfinite(mx) & jnp.isfinite(mg)
    both = finite & (mx > 0) & (mg > 0)
    ex = _clipping.exponent(jnp.where(both, mx, 1))
    eg = _clipping.exponent(jnp.where(both, mg, 1))
    k = jnp.where(both, _clipping.halve(ex - eg), 0)
    lowest = jnp.iinfo(ex.dtype).min
    top_x = jnp.max(jnp.where(both, ex - k, lowest), initial=lowest)
    top_g = jnp.max(jnp.where(both, eg + k, lowest), initial=lowest)
    any_row = jnp.any(both)
    top_x, top_g = jnp.where(any_row, top_x, 0), jnp.where(any_row, top_g, 0)
    usable = jnp.all(finite)
    kept = (both | ~usable)[..., None]
    shift_x = jnp.where(usable, -k - top_x, 0)[..., None]
    shift_g = jnp.where(usable, k - top_g, 0)[..., None]
    bad = jnp.max(jnp.where(finite, 0, mx + mg), initial=0.0)  # inf, or NaN
    # top_x = ceil((ex + eg) / 2) and top_g = floor((ex + eg) / 2) lie in the exponents'
    # range, so each half lies in [minexp / 2, maxexp / 2]: one exact power each.
    half_x, half_g = _clipping.halve(top_x), _clipping.halve(top_g)
    scales = (
        jnp.where(usable, _clipping.power_of_two(half_x, xs.dtype), bad),
        _clipping.power_of_two(half_g, xs.dtype),
        _clipping.power_of_two(top_x - half_x, xs.dtype),
        _clipping.power_of_two(top_g - half_g, xs.dtype),
    )
    return shift_x, shift_g, kept, scales


def _scaled(x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``x`` times a power of two that brings its largest magnitude ``m`` into
    ``[1/2, 1)``, in at least float32, and the two powers of two whose product undoes it.

    Multiplying by a power of two is exact, so the product form of a norm errs only by
    the rounding of its own products, as the gradient does: a scale by ``m`` itself would
    round every entry, an error as large as the largest row where rows cancel. Where
    ``m`` is 0 or not finite ``x`` is left as it is, and the scale returned is ``m`` (0,
    ``inf`` or NaN) and 1.
    """
    wide = jnp.promote_types(jnp.result_type(x), jnp.float32)
    x = x.astype(wide)
    m = jnp.max(jnp.abs(x), initial=0.0)
    usable = (m > 0) & jnp.isfinite(m)
    exponent = _clipping.exponent(jnp.where(usable, m, 1).astype(wide))
    half = _clipping.halve(exponent)
    up = _clipping.power_of_two(half, wide), _clipping.power_of_two(exponent - half, wide)
    scaled = _clipping.times_power(x, -exponent)
    return scaled, (jnp.where(usable, up[0], jnp.where(m > 0, m, 0)), jnp.where(usable, up[1], 1))


def _from_gram(gram: jax.Array, *scales: jax.Array) -> jax.Array:
    """The norm from a squared norm of rows scaled down by ``_balanced`` or ``_scaled``,
    and the factors that undo it; ``inf`` or NaN where a factor (the largest magnitude
    itself) is. ``gram`` is never negative: a Gram sum that could be is recomputed
    (``_reliable``)."""
    return _from_norm(_clipping.sqrt(gram), *scales)


def _from_norm(norm: jax.Array, *scales: jax.Array) -> jax.Array:
    """``_from_gram`` of a norm already taken."""
    bad = jnp.zeros((), norm.dtype)
    for scale in scales:
        norm = norm * scale
        bad = bad + jnp.where(jnp.isfinite(scale), 0, scale)
    return norm + bad


def _product_of_rows(product: jax.Array, *scales: jax.Array) -> jax.Array:
    """The norm of a per-example gradient formed from scaled rows (``x^T g``, or the
    scattered rows of an embedding), scaled by its own largest entry before it is
    squared. The rows' scale is set by their largest entries, and where large rows
    cancel (a row twice with opposite cotangents) what is left can be far below it:
    squared at the rows' scale, it underflowed to a norm of 0, and the example was not
    clipped at all."""
    return _from_norm(_clipping.norm(product), *scales)


HIGHEST = jax.lax.Precision.HIGHEST


def _dense_norm(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any], gram: bool
) -> tuple[jax.Array, jax.Array]:
    """One example's norm of ``x^T g`` at a ``dot_general`` site, and whether it is
    reliable (``_product_norm``)."""
    return _product_norm(*_dense_rows(program, site, inputs, cotangents), gram)


def _dense_rows(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any]
) -> tuple[jax.Array, jax.Array]:
    """One example's rows ``(H, T, K)`` and ``(H, T, N)`` of a ``dot_general`` site's
    weight gradient ``sum_t x_t (outer) g_t`` (per shared entry ``h``), at least float32."""
    e = program.eqns[site.eqn]
    free = site.free[0]
    (x,), (g,) = inputs, cotangents
    (contract, batch) = _dense_axes(e)
    xc, xb = contract[1 - free], batch[1 - free]
    xf = tuple(d for d in range(x.ndim) if d not in xc and d not in xb)
    nb = len(xb)
    wf = len(program.avals[e.ins[free]].shape) - len(contract[free]) - len(batch[free])  # type: ignore[index]
    if free == 1:
        gx, gw = tuple(range(nb, nb + len(xf))), tuple(range(nb + len(xf), nb + len(xf) + wf))
    else:
        gw, gx = tuple(range(nb, nb + wf)), tuple(range(nb + wf, nb + wf + len(xf)))
    h, t, k, n = _dense_dims(program, e, free)
    wide = jnp.promote_types(jnp.promote_types(x.dtype, g.dtype), jnp.float32)
    xs = jnp.transpose(x, xb + xf + xc).reshape(h, t, k).astype(wide)
    gs = jnp.transpose(g, tuple(range(nb)) + gx + gw).reshape(h, t, n).astype(wide)
    return xs, gs


def _product_norm(xs: jax.Array, gs: jax.Array, gram: bool) -> tuple[jax.Array, jax.Array]:
    """The norm of ``sum_t xs[h, t] (outer) gs[h, t]`` over all ``h``, from the Gram
    matrices of the rows (``gram``) or from the product itself, and whether it is
    reliable: the product form always is (a sum of squares errs as the gradient does),
    the Gram form where its error bound meets ``GRAM_TOLERANCE`` (``_reliable``)."""
    _, t, _ = xs.shape
    if t == 1:  # per shared entry h, ||x_h|| ||g_h||
        return _rows_norm(xs[:, 0], gs[:, 0]), jnp.ones((), bool)
    xs, gs, scales = _balanced(xs, gs)  # interleaved: no product of two is subnormal
    if not gram:
        product = jnp.einsum("htk,htn->hkn", xs, gs, precision=HIGHEST)
        return _product_of_rows(product, *scales), jnp.ones((), bool)
    return _gram_norm(gram_matrices(xs), xs.shape[-1], gram_matrices(gs), gs.shape[-1], scales)


def _rows_norm(x: jax.Array, g: jax.Array) -> jax.Array:
    """``sqrt(sum_h ||x_h||^2 ||g_h||^2)`` of rows ``(h, k)`` and ``(h, n)``, each row's
    norm kept as a mantissa times a power of two (``_clipping.norm_parts``) until the
    end: one row's norm may overflow, or its product with the other's underflow, where
    the gradient ``x_h g_h^T`` is finite (an input row near float32's largest number
    beside a cotangent of 0, or of 1e-20 beside one of 3e38: NaN and inf before). Rows
    with 0, inf or NaN give what the products of their entries give: NaN where an inf
    meets a 0 (``0 * inf``) or a NaN is there, else inf where an inf is, else the norm."""
    mx, kx = _clipping.norm_parts(x)
    mg, kg = _clipping.norm_parts(g)
    # An entry of inf times an entry of 0 is NaN in the gradient, as is any NaN.
    holes_x, holes_g = jnp.any(x == 0, axis=1), jnp.any(g == 0, axis=1)
    bad = jnp.isnan(mx) | jnp.isnan(mg)
    bad = bad | (jnp.isinf(mx) & holes_g) | (jnp.isinf(mg) & holes_x)
    infinite = (jnp.isinf(mx) | jnp.isinf(mg)) & ~bad
    zero = (mx == 0) | (mg == 0)
    m = jnp.where(zero | bad | infinite, 0, mx * mg)  # at most sqrt(k n): no overflow
    k = kx + kg
    top = jnp.max(jnp.where(m > 0, k, jnp.iinfo(k.dtype).min))
    top = jnp.where(jnp.any(m > 0), top, 0)
    scaled = _clipping.times_power(m, k - top)
    total = _clipping.times_power(_clipping.sqrt(jnp.sum(jnp.square(scaled))), top)
    return jnp.where(jnp.any(bad), jnp.nan, jnp.where(jnp.any(infinite), jnp.inf, total))


def _gram_norm(
    xx: jax.Array, k: int, gg: jax.Array, n: int, scales: tuple[Any, ...]
) -> tuple[jax.Array, jax.Array]:
    """The Gram form's norm from the Gram matrices of rows of ``k`` and ``n`` entries
    scaled by ``_balanced``, and whether it is reliable (``_reliable``)."""
    total, error = _gram_sum(xx, gg, k, n)
    reliable = _reliable(total, error)
    # Where it is not reliable the caller takes the product form's norm instead; 1 keeps
    # the discarded value, and its derivative, finite.
    return _from_gram(jnp.where(reliable, total, 1), *scales), reliable


def _conv_norm(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any], gram: bool
) -> tuple[jax.Array, jax.Array]:
    """One example's norm of a convolution's kernel gradient: the product of the input
    patches (``T x K``) and the output cotangents (``T x N``)."""
    return _product_norm(*_conv_rows(program, site, inputs, cotangents), gram)


def _conv_rows(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any]
) -> tuple[jax.Array, jax.Array]:
    """One example's rows ``(1, T, K)`` and ``(1, T, N)`` of a convolution's kernel
    gradient: its input patches and output cotangents, at least float32."""
    e = program.eqns[site.eqn]
    (x,), (g,) = inputs, cotangents
    numbers = e.params["dimension_numbers"]
    kernel = program.avals[e.ins[1]].shape  # type: ignore[index]
    window = tuple(kernel[d] for d in numbers.rhs_spec[2:])
    out = program.avals[e.outs[0]].shape
    t, k, n = _conv_dims(program, e)
    wide = jnp.promote_types(jnp.promote_types(x.dtype, g.dtype), jnp.float32)
    x = jnp.transpose(x, (numbers.lhs_spec[0], *numbers.lhs_spec[2:], numbers.lhs_spec[1]))
    if any(d != 1 for d in e.params["lhs_dilation"]):
        x = jax.lax.pad(
            x,
            jnp.zeros((), x.dtype),
            [(0, 0, 0)] + [(0, 0, d - 1) for d in e.params["lhs_dilation"]] + [(0, 0, 0)],
        )
    x = jax.lax.pad(
        x,
        jnp.zeros((), x.dtype),
        [(0, 0, 0), *((lo, hi, 0) for lo, hi in e.params["padding"]), (0, 0, 0)],
    )
    sizes = [out[d] for d in numbers.out_spec[2:]]
    strides = e.params["window_strides"]
    dilation = e.params["rhs_dilation"]
    taken = []
    for offset in itertools.product(*(range(w) for w in window)):
        start = [o * r for o, r in zip(offset, dilation, strict=True)]
        limit = [s + (m - 1) * st + 1 for s, m, st in zip(start, sizes, strides, strict=True)]
        taken.append(
            jax.lax.slice(x, [0, *start, 0], [x.shape[0], *limit, x.shape[-1]], [1, *strides, 1])
        )
    patches = jnp.stack(taken, axis=-2)
    order = (numbers.out_spec[0], *numbers.out_spec[2:], numbers.out_spec[1])
    xs = patches.reshape(1, t, k).astype(wide)
    gs = jnp.transpose(g, order).reshape(1, t, n).astype(wide)
    return xs, gs


def _embedding_norm(
    program: Program, site: Site, inputs: Sequence[Any], cotangents: Sequence[Any], gram: bool
) -> tuple[jax.Array, jax.Array]:
    """One example's norm of the scattered rows at a row gather ``table[ids]``: from the
    Gram matrix of the cotangents of equal ids (``gram``, checked by ``_reliable``), or
    from the scattered rows themselves."""
    e = program.eqns[site.eqn]
    (ids,), (g,) = inputs, cotangents
    rows, width = program.avals[e.ins[0]].shape  # type: ignore[index]
    ids = ids.reshape(-1)
    g = g.reshape(ids.shape[0], width)
    if e.params["mode"] != jax.lax.GatherScatterMode.CLIP:  # the scatter drops them
        g = jnp.where(((ids >= 0) & (ids < rows))[:, None], g, jnp.zeros((), g.dtype))
    ids = jnp.clip(ids, 0, rows - 1)
    gs, mg = _scaled(g)
    if not gram:
        scattered = jnp.zeros((rows, width), gs.dtype).at[ids].add(gs)
        return _product_of_rows(scattered, *mg), jnp.ones((), bool)
    same = (ids[:, None] == ids[None, :]).astype(gs.dtype)  # the ids' Gram matrix, exact
    gg = gram_matrices(gs[None])[0]
    total, error = _gram_sum(same, gg, n=width, exact=True)
    reliable = _reliable(total, error)
    return _from_gram(jnp.where(reliable, total, 1), *mg), reliable


GRAM_NORMS = {"dense": _dense_norm, "conv": _conv_norm, "embedding": _embedding_norm}
"""The rules that read a leaf's norm off its one site's inputs and output cotangents."""

ROWS = {"dense": _dense_rows, "conv": _conv_rows}
"""The rules whose gradient is a product of two sides' rows, and how each reads them."""
