"""The primitive table: everything the engine knows about a primitive, in one place.

The engine reads the user's traced program and takes a shortcut (a gradient of the
summed loss, ghost norms, a clipped sum by book-keeping, a statistic read off a
``transform_fn``) only where it can prove the shortcut equal to the plain path. Each
proof rests on facts about the primitives on the way: that JAX transposes its
derivative linearly, that it only moves entries, that it is a product of a weight and
the data... Those facts live here, keyed by the ``Primitive`` object as JAX keys its own
rules (``ad.primitive_jvps``), and ``facts(eqn)`` is how every reader asks for them.

**A primitive that is not in the table is opaque**: not linear in its cotangent, no
site rule, nothing inlined. A program holding one takes a form that is exact for any
primitive (the per-example gradients, or a leaf's own gradient), never a shortcut. A
newer JAX that renames or adds a primitive therefore gives exact results, possibly
slower, until its line is added here. A primitive that runs code the user supplies
under differentiation (``custom_jvp``, ``custom_vjp``, a linear solve, a callback) is
in the table as user code: never assumed linear where its rule decides, never
re-derived.

This is the one module that names JAX's internal modules; checked on jax 0.10.2 (with
and without ``JAX_CUSTOM_VJP3``, ``JAX_REMAT3`` and ``JAX_SCAN3``) and on jax 0.12.0.1,
where ``closed_call`` is ``eval_jaxpr`` (its body ``call_jaxpr``) and ``ClosedJaxpr`` is
``Jaxpr``. A name that an installed JAX lacks is left out of the table, which makes
that primitive opaque, never wrong.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive

Body = Callable[[Any], "tuple[Jaxpr, tuple[Any, ...]] | None"]
"""The program a call runs, as ``(jaxpr, consts)``, from its equation; None where it
cannot be read (the call is then opaque)."""


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the engine knows about one primitive. Every field is False by default: the
    facts of a primitive the table does not hold (``OPAQUE``).

    Attributes:
      name: The primitive as messages name it.
      derived: JAX derives its derivative from its own rules, so a backward pass through
        it is linear in its cotangent (given its sub-programs are: ``linear_in_cotangent``).
      user_code: It runs a derivative rule, a transpose or a callback that the user
        supplies: never read as linear where that rule decides, never re-derived.
      rounding: JAX transposes it by applying itself, which rounds: not linear either.
      shape_only: Moves entries without changing them (transpose, reshape...).
      no_gradient: Passes no gradient to its inputs at all (``stop_gradient``).
      zero_derivative: Its outputs carry no derivative back (``sign``, ``floor``...).
      additive: A sum of its inputs (``add``): its product with a cotangent reads none.
      bilinear: Each output entry a sum of products of one entry of each of two inputs.
      selecting: Each output entry one entry of an input, or a sum of such.
      non_expanding: Its transpose moves a cotangent's sum of magnitudes by at most 1.
      elementwise: Each output entry reads only the same entry of each operand.
      linear_operand: Linear in its one array operand (for reading a ``transform_fn``).
      body: For a call whose program is read as part of the caller's: where it is.
      rule: For a ``custom_jvp``: the program of its JVP rule, which JAX differentiates
        in its place (None where it cannot be read: then it counts as not linear).
    """

    name: str = "an unknown primitive"
    derived: bool = False
    user_code: bool = False
    rounding: bool = False
    shape_only: bool = False
    no_gradient: bool = False
    zero_derivative: bool = False
    additive: bool = False
    bilinear: bool = False
    selecting: bool = False
    non_expanding: bool = False
    elementwise: bool = False
    linear_operand: bool = False
    body: Body | None = None
    rule: Body | None = None


OPAQUE = Facts()
"""The facts of a primitive the table does not hold."""


def _params_body(eqn: Any) -> tuple[Jaxpr, tuple[Any, ...]] | None:
    """The body of a call that holds it as ``jaxpr`` or ``call_jaxpr``."""
    return split(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))


def split(body: Any) -> tuple[Jaxpr, tuple[Any, ...]] | None:
    """``(jaxpr, consts)`` of a ``ClosedJaxpr`` or a ``Jaxpr`` without constants: the one
    place that tells them apart (jax 0.11 merges them)."""
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, tuple(body.consts)
    if isinstance(body, Jaxpr) and not body.constvars:
        return body, ()
    return None


def _jvp_rule(eqn: Any) -> tuple[Jaxpr, tuple[Any, ...]] | None:
    """The program of a ``custom_jvp``'s rule, with every tangent given (as JAX traces
    it under differentiation: the same memoised trace)."""
    rule = eqn.params.get("jvp_jaxpr_fun")
    tangents = len(eqn.invars) - eqn.params.get("num_consts", 0)
    if not hasattr(rule, "call_wrapped"):
        return None
    jaxpr, consts, _ = rule.call_wrapped(*([False] * tangents))
    return (jaxpr, tuple(consts)) if isinstance(jaxpr, Jaxpr) else split(jaxpr)


def _hi_body(eqn: Any) -> tuple[Jaxpr, tuple[Any, ...]] | None:
    """The body of a ``call_hi_primitive`` whose class the table inlines (a checkpoint
    under ``JAX_REMAT3``)."""
    return split(getattr(eqn.params.get("_prim"), "jaxpr", None))


def _primitive(where: str) -> Any:
    """The primitive at ``module:name``, or None where the installed JAX has none."""
    module, _, name = where.partition(":")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return found if isinstance(found, Primitive) else None


_PUBLIC = "jax.extend.core.primitives"
_LAX = "jax._src.lax.lax"

# The facts, by what they are. Each primitive is named once per group; ``TABLE`` merges
# the groups. Names without a module are in jax.extend.core.primitives.
_ADDITIVE = ["add", "sub", "jax._src.ad_util:add_any_p"]
_SHAPE_ONLY = ["transpose", "reshape", "squeeze", "copy"]
_MOVING = ["broadcast_in_dim", "convert_element_type", "slice", "concatenate", "pad", "rev",
           "gather", "dynamic_slice", "neg", *_ADDITIVE, "select_n"]  # fmt: skip
_ELEMENTWISE = [
    "neg", "abs", "sign", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh",
    "asinh", "acosh", "atanh", "floor", "ceil", "round", "is_finite", "not", "erf", "erfc",
    "erf_inv", "lgamma", "digamma", "integer_pow", "square", "convert_element_type", "copy",
    *_ADDITIVE, "mul", "div", "max", "min", "pow", "atan2", "rem", "eq", "ne",
    "lt", "le", "gt", "ge", "and", "or", "xor", "select_n", "clamp", "reduce_precision",
    "nextafter", "one_minus_square", "log2", "polynomial",  # the last three: jax 0.12
]  # fmt: skip
_LINEAR_OPERAND = ["transpose", "reshape", "squeeze", "broadcast_in_dim", "slice", "rev",
                   "reduce_sum", "cumsum", "copy", "neg"]  # fmt: skip
_ZERO_DERIVATIVE = ["sign", "floor", "ceil", "round", "is_finite"]
_BILINEAR = ["dot_general", "conv_general_dilated", "mul"]
_SELECTING = [*_ADDITIVE, "gather", "dynamic_slice", "select_n", "concatenate", "pad"]
_CALLS = ["jit", "closed_call", "call", "remat", "jax._src.lax.eval_jaxpr:eval_jaxpr_p",
          "jax._src.shard_map:eval_jaxpr_p"]  # fmt: skip
"""Calls whose body is read as part of the program: it computes what the call does."""
_DERIVED = [
    *_ELEMENTWISE, *_LINEAR_OPERAND, *_BILINEAR, *_SELECTING, "stop_gradient", "iota",
    "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort",
    "top_k", "approx_top_k", "dynamic_update_slice", "scatter", "scatter_add", "scatter_mul",
    "scatter_min", "scatter_max", "reduce_window_sum", "reduce_window_max",
    "reduce_window_min", "reduce_window", "select_and_scatter_add", "select_and_gather_add",
    "select_and_scatter", "reduce", "real", "imag", "conj", "complex", "fft",
    "bitcast_convert_type", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "clz", "bessel_i0e", "bessel_i1e", "igamma", "igammac",
    "igamma_grad_a", "polygamma", "zeta", "regularized_incomplete_beta", "random_bits",
    "random_seed", "random_split", "random_fold_in", "random_gamma", "threefry2x32",
    "rng_bit_generator", "rng_uniform", "cholesky", "triangular_solve", "lu", "qr", "eigh",
    "svd", "tridiagonal", "tridiagonal_solve", "householder_product", "sharding_constraint",
    "device_put", "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute",
    "axis_index", "name", "cond", "while", "scan", *_CALLS, "jax._src.core:pvary_p",
    "jax._src.pjit:reshard_p", "jax._src.lax.parallel:reduce_scatter_p",
    "jax._src.lax.parallel:psum_invariant_p", "jax._src.lax.parallel:all_gather_invariant_p",
    "jax._src.lax.lax:optimization_barrier_p", "jax._src.shard_map:shard_map_p",
    "jax._src.random:random_clone_p", "jax._src.random.prng:random_wrap_p",
    "jax._src.random.prng:random_unwrap_p", "jax._src.random.prng:iota_2x32_shape_p",
    "jax._src.lax.lax:split_p", "jax._src.lax.lax:tile_p", "jax._src.lax.lax:stack_p",
    "jax._src.lax.lax:unstack_p",
    "jax._src.debugging:debug_callback_p",
    "jax._src.debugging:debug_print_p", "jax._src.ad_util:zeros_like_p",
    "jax._src.lax.control_flow:platform_index_p",
    # ``custom_jvp``: JAX transposes the rule's tangent map, which is linear; its site
    # and its rule are user code (``_USER_CODE``).
    "custom_jvp_call",
]  # fmt: skip
_USER_CODE = [
    "custom_jvp_call", "custom_vjp_call", "custom_lin", "linear_solve",
    "jax._src.custom_derivatives:linear_call_p", "jax._src.callback:pure_callback_p",
    "jax._src.callback:io_callback_p", "jax._src.ad_checkpoint:call_hi_primitive_p",
    "jax._src.hijax:call_hi_primitive_linearized_p",
]  # fmt: skip
_ROUNDING = ["reduce_precision"]


def _where(name: str) -> str:
    if ":" in name:
        return name
    return f"{_PUBLIC}:{name}_p"


def _build() -> dict[Any, Facts]:
    groups = {
        "derived": _DERIVED, "user_code": _USER_CODE, "rounding": _ROUNDING,
        "shape_only": _SHAPE_ONLY, "no_gradient": ["stop_gradient"],
        "zero_derivative": [*_ZERO_DERIVATIVE, "stop_gradient"], "additive": _ADDITIVE,
        "bilinear": _BILINEAR, "selecting": _SELECTING,
        "non_expanding": [*_SHAPE_ONLY, *_MOVING], "elementwise": _ELEMENTWISE,
        "linear_operand": _LINEAR_OPERAND,
    }  # fmt: skip
    found: dict[Any, dict[str, Any]] = {}
    for fact, names in groups.items():
        for name in names:
            primitive = _primitive(_where(name))
            if primitive is not None:
                entry = found.setdefault(primitive, {"name": primitive.name})
                entry[fact] = True
    for name in _CALLS:
        primitive = _primitive(_where(name))
        if primitive is not None:
            found[primitive]["body"] = _params_body
    found[_primitive(_where("custom_jvp_call"))]["rule"] = _jvp_rule
    rounding = found.get(_primitive(_where("reduce_precision")), {})
    rounding["derived"] = False  # a rounding transpose is JAX's, but not linear
    return {p: Facts(**entry) for p, entry in found.items()}


TABLE: dict[Any, Facts] = _build()
"""Every primitive the engine knows, by the ``Primitive`` object."""

_HI_CALLS: dict[str, Facts] = {
    "RematTraced": Facts("checkpoint", derived=True, body=_hi_body),
    "CustomVJPTraced": Facts("custom_vjp_call", user_code=True),
}
"""The classes of ``call_hi_primitive`` (JAX's next form of higher-order primitives)
that the engine knows, by class name: a checkpoint computes its body. Every other class
(a ``custom_vjp`` under ``JAX_CUSTOM_VJP3``, a ``scan`` under ``JAX_SCAN3``, which reads
and writes references) is user code or opaque."""

_HI_CALL = _primitive("jax._src.ad_checkpoint:call_hi_primitive_p")


def facts(eqn: Any) -> Facts:
    """What the table knows of ``eqn``'s primitive; ``OPAQUE`` where it knows nothing."""
    if eqn.primitive is _HI_CALL and _HI_CALL is not None:
        prim = inner = eqn.params.get("_prim")
        while type(inner).__name__ == "VmapOf":  # a mapped one: its body is not batched
            inner = getattr(inner, "params", {}).get("prim")
        known = _HI_CALLS.get(type(inner).__name__)
        if known is not None and (inner is prim or known.body is None):
            return known
        return dataclasses.replace(OPAQUE, name=f"{type(prim).__name__} (call_hi_primitive)",
                                   user_code=True)  # fmt: skip
    return TABLE.get(eqn.primitive, dataclasses.replace(OPAQUE, name=eqn.primitive.name))


def body(eqn: Any) -> tuple[Jaxpr, tuple[Any, ...]] | None:
    """The program of a call that the table inlines, as ``(jaxpr, consts)``; else None."""
    known = facts(eqn)
    return None if known.body is None else known.body(eqn)


def sub_programs(eqn: Any) -> Iterator[Jaxpr]:
    """Every program ``eqn`` holds: the branches and bodies in its parameters (a
    ``cond``'s, a ``scan``'s), and the body of a call the table inlines."""
    inlined = body(eqn)
    if inlined is not None:
        yield inlined[0]
        return
    for value in eqn.params.values():
        yield from _jaxprs(value)


def _jaxprs(value: Any) -> Iterator[Jaxpr]:
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _jaxprs(v)


def equations(jaxpr: Jaxpr, rules: bool = True) -> Iterator[Any]:
    """Every equation of ``jaxpr``, each followed by those of the programs it holds and,
    where ``rules``, of a ``custom_jvp``'s rule (what a derivative runs in its place).
    Inside a rule, the ``custom_jvp`` functions it calls are read by their bodies alone:
    JAX transposes what a rule computes, and a ``custom_jvp`` by its body (a rule that
    calls its own function, as ``relu``'s does, would otherwise be read without end)."""
    for e in jaxpr.eqns:
        yield e
        for inner in sub_programs(e):
            yield from equations(inner, rules)
        rule = facts(e).rule if rules else None
        if rule is not None and (program := rule(e)) is not None:
            yield from equations(program[0], rules=False)


def not_linear(jaxpr: Jaxpr) -> Facts | None:
    """The facts of the first primitive, at any depth, through which a backward pass
    may not be linear in its cotangent: one the table does not hold, one that runs the
    user's derivative code (``custom_vjp``) or one that rounds. A ``custom_jvp`` counts
    as linear where its rule does: JAX transposes the tangent map the rule gives, and
    the rule's own program is read (``equations``); one whose rule cannot be read does
    not. None where all are linear."""
    for e in equations(jaxpr):
        known = facts(e)
        if not known.derived or known.rounding:
            return known
        if known.rule is not None and known.rule(e) is None:
            return dataclasses.replace(known, name=f"{known.name} (its rule unread)")
    return None


def user_code(jaxpr: Jaxpr) -> Facts | None:
    """The facts of the first primitive, at any depth, that the table does not hold or
    that runs derivative code the user supplies (a ``custom_jvp`` or ``custom_vjp``);
    None where there is none."""
    for e in equations(jaxpr):
        known = facts(e)
        if known.user_code or not known.derived:
            return known
    return None


_CHECKED_PARAMS: dict[str, frozenset[str]] = {
    "conv_general_dilated": frozenset({
        "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
        "feature_group_count", "batch_group_count", "precision", "preferred_element_type",
        "out_sharding",
    }),
    "dot_general": frozenset({
        "dimension_numbers", "precision", "preferred_element_type", "out_sharding",
    }),
    "transpose": frozenset({"permutation"}),
    "reduce_sum": frozenset({"axes", "out_sharding"}),
    "reduce_max": frozenset({"axes"}),
    "reduce_min": frozenset({"axes"}),
}  # fmt: skip
"""The parameters of each primitive that a backend rewrite (``_xla_cpu``'s ``convs``,
``dots``, ``squeeze``) reads or writes, as jax 0.10.2 names them."""

_CHECKED = {p: names for name, names in _CHECKED_PARAMS.items() if (p := _primitive(_where(name)))}


def as_checked(eqn: Any) -> bool:
    """Whether ``eqn``'s parameters are those the backend rewrites were written against:
    a rewrite leaves any other equation as it is (a newer JAX that renames or adds a
    parameter then runs the program unrewritten: slower on one backend, never wrong)."""
    names = _CHECKED.get(eqn.primitive)
    return names is not None and set(eqn.params) == names
