"""The wrapper every transform returns: its options, normalised once when the user wraps
``fun``, and the signature, name and docstring of ``fun``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import numpy as np

from . import _batch
from ._signature import OPTIONS, RESERVES, WEIGHTS, BatchAxes, split_weights
from ._typing import Count, Function, P


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a transform loops, normalised when the user wraps ``fun``.

    Attributes:
      size: ``microbatch_size``.
      accumulator: The accumulator tree (optax's leaves replaced by ours).
      count: ``num_real_microbatches``: None, an int or a traced integer.
      accumulation_dtype: The requested accumulation dtype, or None for the default.
      mesh_axes: ``batch_mesh_axes``.
      progress: Whether the loop reports each microbatch to a progress bar.
      span: The transform's name, for profiler spans and the progress bar.
      allow_remainder: Whether a batch that ``size`` does not divide runs a last,
        partial microbatch.
      pin_consts: Whether what ``fun`` computes from its closed-over values alone is
        computed in every microbatch (``micro_grad``'s ``gather_params="per_microbatch"``)
        instead of once before the loop, where XLA would hoist it.
    """

    size: int | None
    accumulator: Any
    count: Count
    accumulation_dtype: Any
    mesh_axes: tuple[str, ...] | None = None
    progress: bool = False
    span: str = "microbatch"
    allow_remainder: bool = False
    pin_consts: bool = False


@dataclasses.dataclass(frozen=True)
class Options:
    """What a wrapped function was built with: its batch arguments and its settings.

    Set on every wrapper as ``__microbatching__``, so that ``plan`` can find the batch in
    example arguments.
    """

    axes: BatchAxes
    settings: Settings
    describe: Callable[[tuple[Any, ...], dict[str, Any], Any], Any] | None = None

    @property
    def allow_remainder(self) -> bool:
        return self.settings.allow_remainder

    def batch_size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The size of the batch axis that a call with these arguments would split."""
        kwargs, weights = split_weights(kwargs) if self.axes.weights else (kwargs, None)
        args, kwargs = self.axes.to_positions(args, kwargs)
        return _batch.locate(self.axes, args, kwargs, weights, None, None).size


def wraps(
    fun: Callable[P, Any],
    wrapper: Function,
    axes: BatchAxes,
    settings: Settings,
    weights: bool = False,
    describe: Callable[[tuple[Any, ...], dict[str, Any], Any], Any] | None = None,
) -> Callable[P, Any]:
    """``wrapper`` with ``fun``'s name, docstring and signature, but no ``__wrapped__``.

    With ``weights`` the call's ``example_weights`` are split off here, once:
    ``wrapper(args, kwargs, weights)``; else ``wrapper(*args, **kwargs)``.

    Equinox takes a ``__wrapped__`` attribute as the sign of a JAX transform and warns
    when one becomes a module field; our wrappers are plain functions. With
    ``weights`` the signature also has a keyword-only ``example_weights=None``, so that
    ``inspect.signature(...).bind`` (``eqx.filter_jit``, ``donate_argnames``) accepts it.
    ``describe(args, kwargs, weights)`` says how ``micro_grad`` would compute a call
    (``clipping_report``).
    """
    call = _weights_apart(wrapper) if weights else wrapper
    out = functools.wraps(fun, updated=())(_shapes_of_structs(call))
    del out.__wrapped__
    setattr(out, OPTIONS, Options(axes, settings, describe))
    with contextlib.suppress(TypeError, ValueError):  # builtins may have none
        signature = inspect.signature(fun)
        if weights:
            signature = _with_weights(signature)
            setattr(out, RESERVES, True)
        out.__signature__ = signature  # pyright: ignore[reportAttributeAccessIssue]
    return out


def _weights_apart(wrapper: Function) -> Function:
    """``wrapper(args, kwargs, weights)`` called as ``fun`` is, ``example_weights=`` apart."""

    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs, weights = split_weights(kwargs)
        return wrapper(args, kwargs, weights)

    return call


def _shapes_of_structs(wrapper: Function) -> Function:
    """``wrapper`` that, called on ``jax.ShapeDtypeStruct`` arguments, returns the shapes
    and dtypes of its result (``jax.eval_shape``), the other arguments held as they are."""

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            return wrapper(*args, **kwargs)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise TypeError(
                "A function of microbatching was called on jax.ShapeDtypeStruct arguments "
                "inside a JAX transformation (jax.grad, jax.vmap, ...), which needs arrays. "
                "Call it on ShapeDtypeStructs directly for the result's shapes, or wrap the "
                "whole computation in jax.eval_shape."
            )
        abstract = [_is_array(leaf) for leaf in leaves]

        def concrete(arrays: list[Any]) -> Any:
            it = iter(arrays)
            full = [next(it) if a else leaf for leaf, a in zip(leaves, abstract, strict=True)]
            args, kwargs = jax.tree.unflatten(treedef, full)
            return wrapper(*args, **kwargs)

        return jax.eval_shape(concrete, [x for x, a in zip(leaves, abstract, strict=True) if a])

    return call


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct | jax.Array | np.ndarray)


def _with_weights(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with a keyword-only ``example_weights=None`` (before ``**kwargs``)."""
    params = list(signature.parameters.values())
    if WEIGHTS in signature.parameters:  # our own wrapper, nested
        return signature
    at = len(params) - (bool(params) and params[-1].kind == inspect.Parameter.VAR_KEYWORD)
    extra = inspect.Parameter(WEIGHTS, inspect.Parameter.KEYWORD_ONLY, default=None)
    return signature.replace(parameters=[*params[:at], extra, *params[at:]])
