"""What the library does about one backend's compiler, XLA:CPU: the table of its faults
and where each applies (``workarounds``), and the rewrites of ``fun``'s traced program that
avoid them (``convs``, ``dots``, ``squeeze``), composed by ``rewrite``.

Each rewrite leaves the program as it is where its workaround does not apply (another
backend, a jaxlib where the fault is fixed), and touches an equation only where the
equation's parameters are exactly those it was written against
(``_primitives.as_checked``): the results are the same either way, only the speed moves.
"""

from __future__ import annotations

from typing import Any

from . import convs, dots, squeeze


def rewrite(program: Any) -> Any:
    """``program`` (a ``ClosedJaxpr``) with every rewrite that applies here."""
    return squeeze.squeezed(dots.swapped(convs.canonical(program)))
