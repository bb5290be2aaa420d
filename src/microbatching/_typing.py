"""Type aliases shared by the package."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, ParamSpec, Protocol, TypeAlias

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

ClipMethod: TypeAlias = Literal["auto", "ghost", "two_pass", "chunked", "materialize", "statistics"]
"""``micro_grad``'s ``clip_method``."""
GatherParams: TypeAlias = Literal["once", "per_microbatch"]
"""``micro_grad``'s ``gather_params``, in the order ``plan`` prefers them (fewer
collectives first)."""
ReduceGradients: TypeAlias = Literal["per_microbatch", "after_loop"]
"""``micro_grad``'s ``reduce_gradients`` (or None, its default)."""


class _KindLike(Protocol):
    """A member of an accumulation-kind enum: ``AccumulationType``'s, or
    optax.microbatching's."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> int: ...


class _AccumulatorLike(Protocol):
    """An accumulator made of four functions: an ``Accumulator``, or
    optax.microbatching's."""

    @property
    def init(self) -> Callable[..., Any]: ...

    @property
    def update(self) -> Callable[..., Any]: ...

    @property
    def finalize(self) -> Callable[..., Any]: ...

    @property
    def aggregate(self) -> Callable[..., Any]: ...


AccumulatorTree: TypeAlias = (
    _KindLike | _AccumulatorLike | Sequence["AccumulatorTree"] | Mapping[Any, "AccumulatorTree"]
)
"""An accumulation kind, a custom ``Accumulator`` (ours or optax.microbatching's), or a
pytree prefix of the output made of them; a string such as ``"mean"`` is a type error
(use ``AccumulationType.MEAN``). Both are named by their shape (``_KindLike``,
``_AccumulatorLike``), which ours have, so that this module imports none of the package."""
