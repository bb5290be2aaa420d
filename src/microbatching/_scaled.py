"""A ``transform_fn`` that scales each example's gradient by a function of its norms.

Clipping as people write it (``g * min(1, C / ||g||)``, ``optax.clip_by_global_norm``,
``g / (||g|| + eps)``, a bound per layer) multiplies every gradient leaf by a number that
depends on the gradient only through squared norms: of the whole gradient, of one leaf,
of a group of leaves. Such a transform is ``T(g) = R(s(q) * g)``: ``q`` the example's
squared norms per leaf, ``s`` the user's own code on them (one factor per leaf), ``R``
the rest of the transform, applied to the scaled gradient. ``micro_grad`` then takes the
norms from the ghost engine (or whatever ``l2_clip_norm`` would use), runs ``s`` on them
per example, and sums the scaled gradients as it sums clipped ones; ``R`` is read by the
statistics method (``(clip(g), clip(g)**2)``) or is the identity.

The reading follows the transform's traced program (``read``), value by value:

- ``grad``: a gradient leaf as given; ``square``: its entries squared (``g * g``,
  ``g**2``, ``square``, ``abs`` first), partly summed; their sum over every axis is that
  leaf's squared norm, the program's only way into ``s``.
- ``uniform``: one number per example, whatever its shape (a scalar, or one broadcast):
  the squared norms, literals and scalars closed over, and what elementwise operations
  (or any operation on scalars alone) compute from them. Each is a node of a DAG keyed
  by what it computes, so that the same factor written twice is one factor.
- ``scaled``: a gradient leaf times a uniform value (``mul``, ``div`` by one, ``neg``,
  ``select_n`` between scaled values of one leaf or a 0, sums of them).

Anything else that reads the gradient belongs to ``R``, which may read each leaf only
through its one scaled value (the last one the program forms; two different factors for
one leaf are not this form). ``s`` runs by binding the user's own primitives to the
norms, one example at a time: any spelling of the scalar function works, and derivatives
through it are JAX's.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import Literal as JaxprLiteral

from . import _clipping, _primitives
from ._signature import leaf_paths
from ._typing import PyTree

Key = tuple[Any, ...]
"""A node of the factor DAG: ``("sq", leaf, dtype)``, ``("lit", dtype, bytes)`` (a
scalar known when the program is read, by its exact bits: ``-0.0`` is not ``0.0``),
``("ref", id)`` (a scalar closed over), ``("op", name, params, inputs, index)``."""


def _lit(value: Any, dtype: Any) -> Key:
    """The key of a known scalar, by its exact bits in ``dtype``."""
    array = np.asarray(value, dtype=jnp.dtype(dtype))
    return ("lit", str(array.dtype), array.tobytes().hex())


def _lit_value(key: Key) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(key[2]), dtype=jnp.dtype(key[1])).reshape(())


def _one(dtype: str) -> Key:
    return _lit(1, dtype)


def _is_one(key: Key) -> bool:
    return key[0] == "lit" and key == _one(key[1])


def _simple(value: Any) -> Any:
    """A parameter as a key: plain values as they are, anything else (a program, a rule
    function) by identity: two ``custom_jvp`` functions with one primal and two rules
    print alike and are two nodes."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return tuple(_simple(v) for v in value)
    if isinstance(value, np.dtype | enum.Enum) or type(value).__module__ == "numpy":
        return repr(value)
    try:
        return ("dtype", str(jnp.dtype(value))) if isinstance(value, type) else ("id", id(value))
    except TypeError:
        return ("id", id(value))


class _Ref:
    """One value of the flattened program (calls inlined), by identity."""

    __slots__ = ("aval",)

    def __init__(self, aval: Any) -> None:
        self.aval = aval


@dataclasses.dataclass(frozen=True)
class _Eqn:
    eqn: Any
    ins: tuple[_Ref, ...]
    outs: tuple[_Ref, ...]


def _flatten(closed: Any, given: Sequence[_Ref]) -> tuple[list[_Eqn], list[_Ref], dict[_Ref, Any]]:
    """The program's equations with calls inlined, its outputs, and the values of its
    constants and literals."""
    eqns: list[_Eqn] = []
    known: dict[_Ref, Any] = {}

    def walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[_Ref]) -> list[_Ref]:
        env: dict[Any, _Ref] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = ref = _Ref(v.aval)
            known[ref] = c
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> _Ref:
            if isinstance(v, JaxprLiteral):
                ref = _Ref(v.aval)
                known[ref] = v.val
                return ref
            return env[v]

        for e in jaxpr.eqns:
            ins = [read(v) for v in e.invars]
            body = _primitives.body(e)
            if body is not None:
                env.update(zip(e.outvars, walk(*body, ins), strict=True))
                continue
            outs = [_Ref(v.aval) for v in e.outvars]
            env.update(zip(e.outvars, outs, strict=True))
            eqns.append(_Eqn(e, tuple(ins), tuple(outs)))
        return [read(v) for v in jaxpr.outvars]

    program = _primitives.split(closed)
    if program is None:
        raise TypeError(f"not a traced program: {closed!r}")
    outs = walk(*program, given)
    return eqns, outs, known


# --- what the reading knows of each value -------------------------------------------


@dataclasses.dataclass(frozen=True)
class _V:
    """A value as read: ``kind`` one of ``const`` (no gradient; ``key`` where uniform),
    ``grad``, ``flat`` (a leaf reshaped: read only for its norm), ``abs``, ``square``,
    ``uniform``, ``scaled`` (``leaf`` times the factor ``key``), ``other``."""

    kind: str
    leaf: int = -1
    key: Key | None = None
    drops: bool = False


_CONST = _V("const")
_OTHER = _V("other")
_SAME = {"copy", "copy_p", "optimization_barrier"}
_SHAPE = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev"}
_SQUARES = {"square"}


def _scalar_shape(ref: _Ref) -> bool:
    return tuple(getattr(ref.aval, "shape", (None,))) == ()


def _dtype(ref: _Ref) -> str:
    return str(getattr(ref.aval, "dtype", ""))


def _params_key(params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, _simple(v)) for k, v in params.items()))


class _Reader:
    """One pass over the flattened program: each value's ``_V``, the factor DAG, and
    why the transform is not of the form where it is not."""

    def __init__(self, known: dict[_Ref, Any]) -> None:
        self.known = known
        self.nodes: dict[Key, tuple[Any, dict[str, Any], tuple[Key, ...], int]] = {}
        self.values: dict[Key, Any] = {}
        self.uses_norms = False

    def const(self, ref: _Ref) -> _V:
        """A constant: uniform where it is a scalar (literal or closed over)."""
        value = self.known[ref]
        if tuple(getattr(value, "shape", np.shape(value))) != ():
            return _CONST
        dtype = getattr(ref.aval, "dtype", None)
        plain = dtype is not None and (
            jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
        )
        if isinstance(value, Tracer) or not plain:  # traced, or a typed key
            key: Key = ("ref", id(value))
            self.values[key] = value
            return _V("const", key=key)
        return _V("const", key=_lit(value, dtype))

    def op(self, e: Any, ins: list[Key], index: int = 0) -> Key:
        key = ("op", e.primitive.name, _params_key(e.params), tuple(ins), index)
        self.nodes.setdefault(key, (e.primitive, dict(e.params), tuple(ins), index))
        return key

    def literal(self, key: Key | None) -> float | None:
        """The value of a constant uniform key made of literals alone, else None."""
        if key is None:
            return None
        if key[0] == "lit":
            found = _lit_value(key)
        elif key[0] != "op" or not _constant(key):
            return None
        else:
            # Inside an enclosing trace (``plan`` reads abstractly), literals stay concrete.
            with jax.ensure_compile_time_eval():
                found = evaluate(self, key, {})
        if isinstance(found, Tracer) or jnp.iscomplexobj(found):
            return None
        return float(np.asarray(found))

    def step(self, q: _Eqn, ins: list[_V]) -> list[_V]:
        e, name, facts = q.eqn, q.eqn.primitive.name, _primitives.facts(q.eqn)
        n_out = len(q.outs)
        keys = _keys(ins)
        scalars = all(_scalar_shape(r) for r in (*q.ins, *q.outs))
        # A uniform value's operation: elementwise, or on scalars alone.
        computes = keys is not None and (scalars or (facts.elementwise and n_out == 1))
        moves = keys is not None and name in _SHAPE | _SAME and n_out == 1
        kind = "const" if all(v.kind == "const" for v in ins) else "uniform"
        if all(v.kind in ("const", "uniform") for v in ins):
            if keys is not None and moves:
                return [_V(kind, key=keys[0])]
            if keys is not None and computes:
                return [_V(kind, key=self.op(e, keys, i)) for i in range(n_out)]
            return [_CONST if kind == "const" else _OTHER] * n_out
        if n_out != 1:
            return [_OTHER] * n_out
        out = q.outs[0]
        kinds = [v.kind for v in ins]
        # The squared norms.
        if name in _SAME and kinds[0] in ("grad", "flat", "abs", "square", "scaled"):
            return [ins[0]]
        if name == "reshape" and kinds == ["grad"]:
            return [_V("flat", ins[0].leaf)]
        if name == "abs" and kinds[0] in ("grad", "flat"):
            return [_V("abs", ins[0].leaf)]
        # A complex entry times itself is not its squared modulus: ``abs`` first.
        real = not jnp.issubdtype(q.ins[0].aval.dtype, jnp.complexfloating)
        entries = ("grad", "flat", "abs") if real else ("abs",)
        squared = (
            (name in _SQUARES and kinds[0] in entries)
            or (name == "integer_pow" and e.params.get("y") == 2 and kinds[0] in entries)
            or (name == "mul" and q.ins[0] is q.ins[1] and kinds[0] in entries)
        )
        if squared:
            return [_V("square", ins[0].leaf)]
        if name == "dot_general" and q.ins[0] is q.ins[1] and real and kinds[0] in entries:
            (contract, other), (batch, _) = e.params["dimension_numbers"]
            # Entry by entry with itself (``vdot``), not ``trace(G @ G)``.
            every = sorted(contract) == list(range(len(q.ins[0].aval.shape)))
            if not batch and every and tuple(contract) == tuple(other):
                self.uses_norms = True
                return [_V("uniform", key=("sq", ins[0].leaf, _dtype(out)))]
            return [_OTHER]
        if name in ("add", "add_any") and "square" in kinds:
            # Squares plus a literal 0 only (optax's ``abs_sq``: the imaginary part's 0);
            # two squares added is not one leaf's entries squared (``g*g + g*g``).
            other = ins[1 - kinds.index("square")]
            if other.kind == "const" and self.literal(other.key) == 0:
                return [ins[kinds.index("square")]]
            return [_OTHER]
        if name == "reduce_sum" and kinds == ["square"]:
            if len(e.params["axes"]) == len(q.ins[0].aval.shape):
                self.uses_norms = True
                return [_V("uniform", key=("sq", ins[0].leaf, _dtype(out)))]
            return [ins[0]]
        # Scaled leaves.
        return [self._scaled(q, name, ins, kinds, out)]

    def _scaled(self, q: _Eqn, name: str, ins: list[_V], kinds: list[str], out: _Ref) -> _V:
        def factor(v: _V) -> Key:
            """The factor of a scaled (or given) leaf."""
            return v.key if v.kind == "scaled" and v.key is not None else _one(_dtype(out))

        leaf_shaped = [
            v.kind in ("grad", "scaled") and tuple(r.aval.shape) == tuple(out.aval.shape)
            for v, r in zip(ins, q.ins, strict=True)
        ]
        same_dtype = all(
            _dtype(r) == _dtype(out) for r, ok in zip(q.ins, leaf_shaped, strict=True) if ok
        )
        if not same_dtype:
            return _OTHER
        if name == "mul" and sorted(kinds) in (
            ["grad", "uniform"],
            ["const", "grad"],
            ["scaled", "uniform"],
            ["const", "scaled"],
        ):
            g = 0 if kinds[0] in ("grad", "scaled") else 1
            u = ins[1 - g]
            if u.key is None or not leaf_shaped[g]:
                return _OTHER
            f = factor(ins[g])
            return _V("scaled", ins[g].leaf, self._mul(f, u.key), ins[g].drops)
        if name == "div" and kinds[0] in ("grad", "scaled") and kinds[1] in ("uniform", "const"):
            if ins[1].key is None or not leaf_shaped[0]:
                return _OTHER
            f = factor(ins[0])
            key = self.op(q.eqn, [f, ins[1].key])
            return _V("scaled", ins[0].leaf, key, ins[0].drops)
        if name == "neg" and kinds[0] in ("grad", "scaled") and leaf_shaped[0]:
            return _V("scaled", ins[0].leaf, self.op(q.eqn, [factor(ins[0])]), ins[0].drops)
        if name in ("add", "sub", "add_any") and all(k in ("grad", "scaled") for k in kinds):
            if ins[0].leaf == ins[1].leaf and all(leaf_shaped):
                keys = [factor(v) for v in ins]
                drops = any(v.drops for v in ins)
                return _V("scaled", ins[0].leaf, self.op(q.eqn, keys), drops)
            return _OTHER
        if name == "select_n" and ins[0].key is not None and kinds[0] in ("uniform", "const"):
            cases = ins[1:]
            leaves = {v.leaf for v in cases if v.kind in ("grad", "scaled")}
            if len(leaves) != 1:
                return _OTHER
            keys: list[Key] = []
            drops = False
            for v, r in zip(cases, q.ins[1:], strict=True):
                if v.kind in ("grad", "scaled") and tuple(r.aval.shape) == tuple(out.aval.shape):
                    keys.append(factor(v))
                    drops = drops or v.drops
                elif v.kind == "const" and self.literal(v.key) == 0:
                    keys.append(_lit(0, _dtype(out)))
                    drops = True
                else:
                    return _OTHER
            pred = ins[0].key
            return _V("scaled", leaves.pop(), self.op(q.eqn, [pred, *keys]), drops)
        if name == "convert_element_type" and kinds[0] in ("grad", "scaled"):
            return ins[0] if _dtype(q.ins[0]) == _dtype(out) else _OTHER
        return _OTHER

    def _mul(self, f: Key, u: Key) -> Key:
        if _is_one(f):
            return u
        key = ("op", "mul", (), (f, u), 0)
        self.nodes.setdefault(key, (jax.lax.mul_p, {}, (f, u), 0))
        return key


def _keys(values: Sequence[_V]) -> list[Key] | None:
    """The keys of ``values`` where every one is uniform, else None."""
    keys = [v.key for v in values]
    return None if any(k is None for k in keys) else keys  # type: ignore[return-value]


def _constant(key: Key) -> bool:
    """Whether ``key`` reads no squared norm (made of literals and scalars closed over)."""
    if key[0] == "sq":
        return False
    if key[0] == "op":
        return all(_constant(k) for k in key[3])
    return True


def bind(primitive: Any, params: dict[str, Any], args: Sequence[Any]) -> Any:
    """``primitive`` applied to ``args`` as ``jax.core.eval_jaxpr`` applies an equation
    (``get_bind_params`` gives ``(subfuns, params)`` before jax 0.10, ``params`` since)."""
    found = primitive.get_bind_params(params)
    subfuns, kept = found if isinstance(found, tuple) else ((), found)
    return primitive.bind(*subfuns, *args, **kept)


def evaluate(reader: _Reader, key: Key, inputs: dict[Key, Any]) -> Any:
    """The value of ``key`` where each squared norm is ``inputs[("sq", leaf, dtype)]``
    (as one example's scalar), by binding the program's own primitives to scalars."""
    memo: dict[Key, Any] = {}

    def value(k: Key) -> Any:
        if k in memo:
            return memo[k]
        if k[0] == "lit":
            out = jnp.asarray(_lit_value(k))
        elif k[0] == "ref":
            out = reader.values[k]
        elif k[0] == "sq":
            out = inputs[k]
        else:
            primitive, params, ins, index = reader.nodes[k]
            args = [value(i) for i in ins]
            if primitive is jax.lax.mul_p and not params:  # a product of two factors
                out = args[0] * args[1]
            else:
                found = bind(primitive, params, args)
                out = found[index] if primitive.multiple_results else found
        memo[k] = out
        return out

    return value(key)


# --- the reading -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A transform read as ``R(s(q) * g)``.

    Attributes:
      factors: The factor of each gradient leaf (1 for a leaf used as given).
      groups: The group of each leaf: leaves with the same factor share one.
      keys: Each group's factor.
      drops: Whether a factor selects 0 (``where(..., g * c, 0)``): an example whose
        factor is 0 then contributes exactly 0, as the transform gives it.
      plain: Whether ``R`` is the identity (the output is the scaled gradient, leaf by
        leaf): the sum is ``l2_clip_norm``'s, with these factors.
      rest: ``R``, a function of the scaled gradient's pytree.
      described: The factors in words, for ``clipping_report``.
    """

    reader: _Reader
    factors: tuple[Key, ...]
    groups: tuple[int, ...]
    keys: tuple[Key, ...]
    drops: bool
    plain: bool
    rest: Callable[[PyTree], PyTree]
    described: str

    def evaluate(self, squares: jax.Array) -> jax.Array:
        """``(rows, groups)``: each example's factor per group, from its squared norms per
        leaf ``(rows, leaves)``."""

        def one(row: jax.Array) -> list[jax.Array]:
            inputs = _inputs(self.reader, self.keys, row)
            out = []
            for k in self.keys:
                value = evaluate(self.reader, k, inputs)
                out.append(jnp.asarray(value).astype(squares.dtype))
            return out

        columns = jax.vmap(one)(squares)
        return jnp.stack([jnp.broadcast_to(c, (squares.shape[0],)) for c in columns], axis=1)


def _fresh(fn: Callable[[PyTree], PyTree]) -> Callable[[PyTree], PyTree]:
    """``fn`` as a new function object: ``jax.make_jaxpr`` caches a trace by the function
    it is given, and a transform that reads state (``self.bound``, a dict it closes over)
    must be read as it is at this call."""
    return lambda g: fn(g)


@dataclasses.dataclass
class _Walked:
    """A function of one example's gradient, traced and read value by value."""

    reader: _Reader
    eqns: list[_Eqn]
    outs: list[_Ref]
    shape: Any
    value: dict[_Ref, _V]
    uses: dict[_Ref, list[_V]]
    why: str | None
    """Why an operation that reads the gradient is none of the forms, where one is not."""

    def of(self, ref: _Ref) -> _V:
        if ref not in self.value:
            self.value[ref] = self.reader.const(ref)
        return self.value[ref]


def _walk(fn: Callable[[PyTree], PyTree], grads: PyTree) -> _Walked:
    """``fn`` traced at one example's gradient ``grads`` (shapes), each value read."""
    closed, shape = jax.make_jaxpr(_fresh(fn), return_shape=True)(grads)
    given = [_Ref(v.aval) for v in closed.jaxpr.invars]
    eqns, outs, known = _flatten(closed, given)
    value: dict[_Ref, _V] = {ref: _V("grad", i) for i, ref in enumerate(given)}
    walked = _Walked(_Reader(known), eqns, outs, shape, value, {}, None)
    for q in eqns:
        ins = [walked.of(r) for r in q.ins]
        found = walked.reader.step(q, ins)
        for r, v in zip(q.outs, found, strict=True):
            value[r] = v
        for r in q.ins:
            walked.uses.setdefault(r, []).extend(found)
        if walked.why is None and any(v.kind == "other" for v in found):
            reads = [v for v in ins if v.kind in ("grad", "flat", "abs", "square")]
            if reads:
                walked.why = (
                    f"it reads gradient leaf {reads[0].leaf} through `{q.eqn.primitive.name}`"
                )
    return walked


def read(transform: Callable[[PyTree], PyTree], grads: PyTree) -> Scaled | str | None:
    """The reading of ``transform`` at one example's gradient ``grads`` (shapes) as a
    function of the scaled gradient; None where it scales nothing (no factor reads a
    norm: the statistics method reads it as it is), or why it is not of that form."""
    leaves, structure = jax.tree.flatten(grads)
    walked = _walk(transform, grads)
    reader, known = walked.reader, walked.reader.known
    eqns, outs, shape = walked.eqns, walked.outs, walked.shape
    value, uses, why = walked.value, walked.uses, walked.why
    if not reader.uses_norms:
        return None
    # The scaled value of each leaf that the rest reads first: the cut.
    outset = {id(r) for r in outs}
    order = {id(r): n for n, q in enumerate(eqns) for r in q.outs}
    candidates: dict[int, list[_Ref]] = {}
    for ref, v in value.items():
        if v.kind not in ("grad", "scaled"):
            continue
        later = uses.get(ref, [])
        if id(ref) in outset or any(
            u.kind not in ("scaled", "square", "flat", "abs", "uniform") for u in later
        ):
            candidates.setdefault(v.leaf, []).append(ref)
    cut = {leaf: min(refs, key=lambda r: order.get(id(r), -1)) for leaf, refs in candidates.items()}
    factors: list[Key] = [_one(str(g.dtype)) for g in leaves]
    for leaf, ref in cut.items():
        if value[ref].kind == "scaled":
            factors[leaf] = value[ref].key  # type: ignore[assignment]
    drops = any(value[ref].drops for ref in cut.values())

    def twice() -> str | None:
        """Why a leaf's reads do not come from one scaled value, where that is why."""
        for leaf, refs in sorted(candidates.items()):
            if len({value[r].kind for r in refs}) > 1:
                return f"gradient leaf {leaf} is read both as given and scaled"
            if len({value[r].key for r in refs}) > 1:
                return f"gradient leaf {leaf} is read scaled by different factors"
        return None

    if all(_is_one(f) for f in factors):
        return twice() or why or "no gradient leaf is scaled by a function of its norms"
    # The rest: what the outputs compute from the cut and constants alone.
    # Constants computed by the program (``zeros_like``, a mask from ``arange``) are
    # computed again there.
    available = set(cut.values()) | set(known)
    rest_eqns = []
    for q in eqns:
        if all(r in available for r in q.ins):
            rest_eqns.append(q)
            available.update(q.outs)
    for path, ref in zip(leaf_paths(shape), outs, strict=True):
        if ref not in available:
            reason = twice() or why or "it reads the gradient other than through its norms"
            where = f" {path}" if path else ""
            return f"its output{where} needs more than the scaled gradient: {reason}"
    keys: list[Key] = []
    groups = []
    for f in factors:
        if f not in keys:
            keys.append(f)
        groups.append(keys.index(f))
    out_structure = jax.tree.structure(shape)
    plain = (
        out_structure == structure
        and len(outs) == len(leaves)
        and all(cut.get(i) is r for i, r in enumerate(outs))
    )
    cuts = dict(cut)

    def rest(scaled: PyTree) -> PyTree:
        env: dict[_Ref, Any] = {}
        for leaf, h in enumerate(jax.tree.leaves(scaled)):
            if leaf in cuts:
                env[cuts[leaf]] = h

        def get(r: _Ref) -> Any:
            return env[r] if r in env else known[r]

        for q in rest_eqns:
            if any(r in env for r in q.outs):
                continue
            e = q.eqn
            found = bind(e.primitive, e.params, [get(r) for r in q.ins])
            found = found if e.primitive.multiple_results else [found]
            env.update(zip(q.outs, found, strict=True))
        return jax.tree.unflatten(jax.tree.structure(shape), [get(r) for r in outs])

    scaled_leaves = sum(not _is_one(f) for f in factors)
    distinct = len({f for f in factors if not _is_one(f)})
    described = (
        f"scaled by a function of the norms ({scaled_leaves} of {len(leaves)} leaves, "
        f"{distinct} factor{'s' if distinct > 1 else ''}): its code runs on each "
        "example's norms, and the sum is l2_clip_norm's with those factors"
    )
    return Scaled(reader, tuple(factors), tuple(groups), tuple(keys), drops, plain, rest, described)


def _inputs(reader: _Reader, keys: Sequence[Key], row: jax.Array) -> dict[Key, Any]:
    """The squared norms that ``keys`` read, from one example's ``row`` of squared norms
    per leaf, each in the dtype the program computed it in."""
    found: dict[Key, Any] = {}
    seen: set[Key] = set()
    stack = list(keys)
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        if k[0] == "sq":
            found[k] = row[k[1]].astype(k[2])
        elif k[0] == "op":
            stack.extend(k[3])
    return found


@dataclasses.dataclass(frozen=True)
class NormsMetric:
    """A ``metrics_fn`` whose every output is a function of the example's squared norms
    (``optax.tree.norm``, ``jnp.linalg.norm`` of a leaf, whether a norm exceeds a
    bound), read off its program as a transform's factors are: the step computes it from
    the norms it takes for the clipping, by binding the user's own primitives to them.
    Called on a gradient, it is the user's function (for the paths that form them)."""

    fn: Callable[[PyTree], PyTree]
    reader: _Reader
    keys: tuple[Key, ...]
    avals: tuple[Any, ...]
    structure: Any

    def __call__(self, grads: PyTree) -> PyTree:
        return self.fn(grads)

    def of_norms(self, norms: jax.Array) -> PyTree:
        """Each example's metrics, stacked on axis 0, from its norms per leaf
        ``(rows, leaves)``."""

        def one(row: jax.Array) -> list[jax.Array]:
            inputs = _inputs(self.reader, self.keys, row)
            return [
                jnp.broadcast_to(
                    jnp.asarray(evaluate(self.reader, k, inputs)).astype(a.dtype), a.shape
                )
                for k, a in zip(self.keys, self.avals, strict=True)
            ]

        return jax.tree.unflatten(self.structure, jax.vmap(one)(jnp.square(norms)))


def read_metric(metrics: Callable[[PyTree], PyTree], grads: PyTree) -> NormsMetric | str:
    """``metrics`` read at one example's gradient ``grads`` (shapes) as a function of
    its squared norms alone, or why it is not one."""
    walked = _walk(metrics, grads)
    keys = []
    for path, ref in zip(leaf_paths(walked.shape), walked.outs, strict=True):
        v = walked.of(ref)
        if v.kind not in ("uniform", "const") or v.key is None:
            if v.kind in ("grad", "scaled"):
                reason = "it returns the gradient's entries"
            else:
                reason = walked.why or "it reads the gradient other than through its norms"
            where = f" {path}" if path else ""
            return f"its output{where} is not a function of the gradient's norms: {reason}"
        keys.append(v.key)
    avals = tuple(r.aval for r in walked.outs)
    structure = jax.tree.structure(walked.shape)
    return NormsMetric(metrics, walked.reader, tuple(keys), avals, structure)


# --- the clipping it gives ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scaling(_clipping.Clipping):
    """``l2_clip_norm``'s clipping with the factors of a ``Scaled`` transform: each
    example's factor per group of leaves, from its norms per leaf. After ``prior`` (the
    call's own ``l2_clip_norm``, if any), which the transform sees applied."""

    scaled: Scaled | None = None
    prior: _clipping.Clipping | None = None
    prior_groups: tuple[int, ...] = ()
    prior_bounds: tuple[Any, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, scaled: Scaled, prior: _clipping.Clipping | None, grads: PyTree) -> Scaling:
        if prior is None:
            pgroups, pbounds = [0] * len(scaled.groups), []
        else:
            pgroups, pbounds = prior.groups(grads)
        pairs = []
        for p, s in zip(pgroups, scaled.groups, strict=True):
            if (p, s) not in pairs:
                pairs.append((p, s))
        nan_safe = scaled.drops or (prior is not None and prior.nan_safe)
        return cls(
            bound=1.0 if prior is None else prior.bound,
            nan_safe=nan_safe,
            scaled=scaled,
            prior=prior,
            prior_groups=tuple(pgroups),
            prior_bounds=tuple(pbounds),
            pairs=tuple(pairs),
        )

    def groups(self, grads: PyTree) -> tuple[list[int], list[Any]]:
        assert self.scaled is not None
        return [
            self.pairs.index((p, s))
            for p, s in zip(self.prior_groups, self.scaled.groups, strict=True)
        ], list(self.pairs)

    def factors(self, norms: jax.Array, groups: list[int], bounds: list[Any]) -> jax.Array:
        assert self.scaled is not None
        rows = norms.shape[0]
        if self.prior is not None:
            before = self.prior.factors(norms, list(self.prior_groups), list(self.prior_bounds))
            per_leaf = (
                jnp.stack([before[:, g] for g in self.prior_groups], axis=1)
                if self.prior_groups
                else jnp.ones((rows, 0), norms.dtype)
            )
            seen = norms * per_leaf.astype(norms.dtype)
        else:
            before, seen = None, norms
        mine = self.scaled.evaluate(jnp.square(seen))
        columns = []
        for p, s in self.pairs:
            column = mine[:, s]
            if before is not None:
                column = column * before[:, p].astype(column.dtype)
            columns.append(column)
        scale = jnp.stack(columns, axis=1) if columns else jnp.ones((rows, 0), norms.dtype)
        if self.nan_safe and self.prior is not None and self.prior.nan_safe:
            finite = jnp.all(jnp.isfinite(norms), axis=1, keepdims=True)
            scale = jnp.where(finite, scale, jnp.zeros((), scale.dtype))
        return scale
