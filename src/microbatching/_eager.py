"""Eager calls of a wrapped function go through a cached ``jax.jit``.

Called outside ``jit``, the loop would be traced and compiled again at every call. When
no argument is a tracer, the call is dispatched through one ``jax.jit`` per call
structure instead: arrays are its arguments, everything else (Python numbers, strings,
None, functions) is part of the cache key, as a static argument would be, keyed by type
and value (``1``, ``1.0`` and ``True`` differ, and so do ``0.0`` and ``-0.0``). So each
new Python number compiles again: pass a changing number as an array. The cache keeps
the ``MAX_ENTRIES`` most recent programs. Arguments that cannot be hashed fall back to
the plain call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import numpy as np

from . import _sharding
from ._typing import Function

MAX_ENTRIES = 64


def cached(looped: Function) -> Function:
    """``looped``, dispatched through a cached ``jax.jit`` when called eagerly."""
    compiled: dict[Any, Function] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return looped(*args, **kwargs)
        dynamic = [isinstance(leaf, jax.Array | np.ndarray | np.generic) for leaf in leaves]
        static = tuple(leaf for leaf, d in zip(leaves, dynamic, strict=True) if not d)
        key = (treedef, tuple(dynamic), tuple(_key(leaf) for leaf in static))
        try:
            jitted = compiled.pop(key, None)
        except TypeError:  # an unhashable static argument
            return looped(*args, **kwargs)
        if jitted is None:
            jitted = jax.jit(_rebuilt(looped, treedef, dynamic, static))
            if len(compiled) >= MAX_ENTRIES:
                del compiled[next(iter(compiled))]  # the least recently used
        compiled[key] = jitted
        arrays = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
        with _sharding.mesh_of(arrays):
            return jitted(arrays)

    return call


def _key(leaf: Any) -> Any:
    """A static argument as a cache key: its type with its value, floats by ``repr``
    (so that ``-0.0`` and NaN key as themselves)."""
    if isinstance(leaf, float | complex):
        return type(leaf), repr(leaf)
    return type(leaf), leaf


def _rebuilt(
    looped: Function, treedef: Any, dynamic: list[bool], static: tuple[Any, ...]
) -> Function:
    """``looped`` as a function of the array arguments only."""

    def run(arrays: list[Any]) -> Any:
        arrays_it, static_it = iter(arrays), iter(static)
        leaves = [next(arrays_it) if d else next(static_it) for d in dynamic]
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        return looped(*args, **kwargs)

    return run
