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

Parameters without value equality (a callback's closure, a JAX array closed over by a
nested ``jit``) can only be named by identity: such programs are not cached, and
compile again at every call, as optax's do. The one exception is what only
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
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, identities: list[Any], build: Callable[[], Any]) -> Any:
        """The entry under ``key``, built on a miss. A key that names objects by identity
        (``identities``) is never stored: such a program is built at every call, as an
        un-jitted call would be, and holds nothing alive after it."""
        if identities:
            return build()
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.popitem(last=False)
        value = build()
        self._entries[key] = value
        return value
