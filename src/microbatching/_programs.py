"""Reading traced programs: what a program's computation depends on, and what it calls."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from . import _primitives

UNUSED_WHEN_NOT_DIFFERENTIATED = {
    "custom_jvp_call": {"jvp_jaxpr_fun", "jvp_jaxpr_thunk"},
    "custom_vjp_call": {"fwd_jaxpr_thunk", "bwd", "out_trees"},
}
"""Parameters that only a derivative of the program reads. ``fingerprint`` leaves them
out: the eager cache runs its programs on concrete values, which nothing differentiates."""

_PLAIN = (bool, int, str, bytes, type(None), np.dtype, enum.Enum)


def fingerprint(program: ClosedJaxpr, keep: list[Any]) -> Hashable:
    """What the computation of ``program`` depends on, except its constants' values.

    Equations with every parameter and literal by value where its type has value
    equality. Other objects are appended to ``keep`` and named by their place in it: the
    fingerprint holds for these very objects only, which the caller compares by identity.
    Constants by type only.
    """
    consts = tuple(_aval(c) for c in program.consts)
    return consts, _jaxpr(program.jaxpr, keep)


def _aval(value: Any) -> Hashable:
    return type(value).__name__, jax.typeof(value)


def _jaxpr(jaxpr: Jaxpr, keep: list[Any]) -> Hashable:
    ids: dict[Any, int] = {}

    def var(v: Any) -> Hashable:
        if isinstance(v, Literal):
            return "literal", _value(v.val, keep), v.aval
        return ids.setdefault(v, len(ids)), v.aval

    head = tuple(var(v) for v in [*jaxpr.constvars, *jaxpr.invars])
    eqns = tuple(
        (
            e.primitive.name,
            _params(e.primitive.name, e.params, keep),
            repr(e.ctx),  # the configuration it runs under (PRNG, compute type, ...)
            tuple(var(v) for v in e.invars),
            tuple(var(v) for v in e.outvars),
        )
        for e in jaxpr.eqns
    )
    return head, eqns, tuple(var(v) for v in jaxpr.outvars), str(jaxpr.effects)


def _params(primitive: str, params: dict[str, Any], keep: list[Any]) -> Hashable:
    skip = UNUSED_WHEN_NOT_DIFFERENTIATED.get(primitive, set())
    return tuple(
        (name, _param(value, keep)) for name, value in sorted(params.items()) if name not in skip
    )


def _param(value: Any, keep: list[Any]) -> Hashable:
    if isinstance(value, ClosedJaxpr):
        return "closed", _jaxpr(value.jaxpr, keep), tuple(_value(c, keep) for c in value.consts)
    if isinstance(value, Jaxpr):
        return "jaxpr", _jaxpr(value, keep)
    if isinstance(value, tuple | list):
        return type(value).__name__, tuple(_param(v, keep) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((k, _param(v, keep)) for k, v in sorted(value.items()))
    return _value(value, keep)


def _value(value: Any, keep: list[Any]) -> Hashable:
    """A parameter or literal by value where its type has value equality, else by identity.

    NumPy arrays are keyed by their bytes, however large: they can change in place. JAX
    arrays cannot, so they are keyed by identity.
    """
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, float | complex):
        return type(value), repr(value)  # -0.0 and NaN as themselves
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        digest = hashlib.blake2b(array.tobytes(), digest_size=16).digest()
        return "array", array.dtype, array.shape, digest
    if type(value).__eq__ is not object.__eq__ and not isinstance(value, jax.Array):
        try:
            hash(value)
        except TypeError:
            pass
        else:
            return type(value), value
    keep.append(value)
    return "identity", len(keep) - 1


def float_dtypes(program: ClosedJaxpr) -> set[Any]:
    """The floating dtypes of the values of ``program``, its inputs included, at any depth."""
    found = {v.aval.dtype for v in program.jaxpr.invars}
    for e in _primitives.equations(program.jaxpr):
        found |= {getattr(v.aval, "dtype", None) for v in e.outvars}
    return {d for d in found if d is not None and jnp.issubdtype(d, jnp.floating)}


Replacement = Callable[[JaxprEqn], "list[JaxprEqn] | None"]
"""The equations to put in an equation's place, or None to keep it (and look inside it)."""


def rewritten(program: ClosedJaxpr, replace: Replacement) -> ClosedJaxpr:
    """``program`` with each equation, at any depth, that ``replace`` gives equations for
    replaced by them; ``program`` itself where it gives none. A replacement must take the
    equation's inputs to its outputs, of the same types: a sub-program then keeps its
    inputs and outputs, and any primitive takes it back."""
    jaxpr = _rewritten(program.jaxpr, replace)
    return program if jaxpr is None else ClosedJaxpr(jaxpr, program.consts)


def _rewritten(jaxpr: Jaxpr, replace: Replacement) -> Jaxpr | None:
    eqns: list[JaxprEqn] = []
    changed = False
    for eqn in jaxpr.eqns:
        if (new := replace(eqn)) is not None:
            eqns.extend(new)
            changed = True
        elif (params := _rewritten_params(eqn.params, replace)) is not None:
            eqns.append(eqn.replace(params=params))
            changed = True
        else:
            eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else None


def _rewritten_params(params: dict[str, Any], replace: Replacement) -> dict[str, Any] | None:
    changed = False

    def one(v: Any) -> Any:
        nonlocal changed
        inner = v.jaxpr if isinstance(v, ClosedJaxpr) else v
        if not isinstance(inner, Jaxpr) or (new := _rewritten(inner, replace)) is None:
            return v
        changed = True
        return ClosedJaxpr(new, v.consts) if isinstance(v, ClosedJaxpr) else new

    out = {k: _same_tuple(v, [one(x) for x in v]) if isinstance(v, tuple) else one(v)
           for k, v in params.items()}  # fmt: skip
    return out if changed else None


def _same_tuple(original: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    """``items`` as a tuple of ``original``'s type: a named tuple stays one
    (``custom_linear_solve`` reads its programs by name, ``jaxprs.solve``)."""
    return type(original)(*items) if hasattr(original, "_fields") else tuple(items)
