"""Eager calls: ``fun`` is traced at every call, the loop is compiled once per program.

A wrapped function called outside any JAX transformation behaves as an un-jitted call:
``fun`` is traced afresh, so it reads the current values of what it closes over, its
Python side effects run, and arguments that are not batched stay concrete (``if flag:``
works on them). What is compiled is the loop around ``fun``'s traced program. It is
cached under a *fingerprint* of that program: its equations, with every parameter and
literal by value, and its constants by type only, since they are passed in as arguments
(``_programs.fingerprint``).
Two calls with the same fingerprint run the same computation on the same kinds of
inputs, so the second call compiles nothing. A changed global read as a Python number
is a literal of the program, so it changes the fingerprint and compiles again; one read
as an array is a constant, passed in, and compiles nothing.

Parameters without value equality (a mesh, a callback's closure, a JAX array closed over
by a nested ``jit``) can only be named by identity. A program is reused only for the
same objects; objects made afresh at every call compile again at every call, as optax's
do, and replace the program they would have reused. The one exception is what only
differentiation reads (the JVP rule of a ``custom_jvp``, the forward and backward of a
``custom_vjp``): the cached program runs on concrete values only, so nothing
differentiates it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.core

MAX_ENTRIES = 64
"""How many compiled loops one wrapped function keeps, the most recently used."""


def is_concrete(tree: Any) -> bool:
    """Whether no leaf of ``tree`` is a tracer: a call made outside every transformation."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


class Cache:
    """The compiled loops of one wrapped function, keyed by fingerprint."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, tuple[Any, list[int], list[Any]]] = OrderedDict()

    def get(self, key: Hashable, identities: list[Any], build: Callable[[], Any]) -> Any:
        """The entry under ``key`` for these ``identities`` (the objects the fingerprint
        names by identity), built on a miss.

        One entry per key: new identities replace the entry, so that objects made afresh
        at every call (a closure, an array closed over by a nested ``jit``) compile again
        but hold nothing stale alive. The entry keeps its objects, so that their
        identities cannot be reused by others while it lives.
        """
        entry = self._entries.get(key)
        if entry is not None and entry[1] == [id(x) for x in identities]:
            self._entries.move_to_end(key)
            return entry[0]
        if entry is None and len(self._entries) >= MAX_ENTRIES:
            self._entries.popitem(last=False)
        value = build()
        self._entries[key] = (value, [id(x) for x in identities], identities)
        return value
