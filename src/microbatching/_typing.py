"""Type aliases shared by the package."""

from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeAlias

import jax
import numpy as np

P = ParamSpec("P")
"""The parameters of the wrapped function, kept by the wrappers."""

PyTree: TypeAlias = Any
"""Any pytree of arrays (a leaf, a tuple, a dict, a dataclass registered with JAX...)."""

Function: TypeAlias = Callable[..., Any]
PyTreeFn: TypeAlias = Callable[[PyTree], PyTree]
UpdateFn: TypeAlias = Callable[[PyTree, PyTree, Any], PyTree]
VmapFn: TypeAlias = Callable[[Function, Any, Any], Function]

AxisSpec: TypeAlias = int | PyTree | None
"""The batch axis of one argument: an int, None (not batched) or a pytree prefix of them."""

InAxes: TypeAlias = int | np.integer | Sequence[AxisSpec]
Count: TypeAlias = int | np.integer | jax.Array | None
"""A static or traced number of microbatches."""
