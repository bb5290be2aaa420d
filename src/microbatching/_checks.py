"""Wrap-time normalisers: each checks one argument of a transform and returns it normalised.

They run once, when the user wraps a function, and raise a TypeError or ValueError that
names the argument, shows the value and says how to fix it. ``warn`` is their
counterpart for what is allowed but likely wrong.
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._typing import AxisSpec, Count, Function

_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep for path in (__file__, jax.__file__) if path is not None
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first frame up the stack
    that is neither this package nor JAX (which traces the user's function, maybe
    several calls deep), so that the warning names the call that caused it."""
    frame, level = sys._getframe(1), 2  # stacklevel 2 is warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def function_name(fun: Function) -> str:
    """A readable name for ``fun`` in error messages and profiler spans."""
    inner = getattr(fun, "func", fun)  # functools.partial
    return getattr(inner, "__name__", type(inner).__name__)


def is_int(value: Any) -> bool:
    if isinstance(value, bool | np.bool_):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def ensure_callable(name: str, value: Any) -> Function:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {name}={value!r}; pass a function.")
    return value


def ensure_bool(name: str, value: Any) -> bool:
    """Refuses truthy strings and other stand-ins: ``keep_batch_dim="no"`` is an error."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{name} must be a bool, got {name}={value!r} of type {type(value).__name__}; "
            "pass True or False."
        )
    return bool(value)


def ensure_microbatch_size(microbatch_size: Any) -> int | None:
    """A positive int, or None for no microbatching."""
    if microbatch_size is None:
        return None
    if not is_int(microbatch_size):
        raise TypeError(
            f"microbatch_size must be a positive int or None, got {microbatch_size!r} "
            f"of type {type(microbatch_size).__name__}; pass an int such as 8."
        )
    size = operator.index(microbatch_size)
    if size <= 0:
        raise ValueError(
            f"microbatch_size must be a positive int, got {microbatch_size=}; "
            "pass at least 1, or None to run the whole batch at once."
        )
    return size


def ensure_index_tuple(name: str, value: Any) -> tuple[int, ...]:
    """An int or a sequence of distinct ints (``argnums``, ``batch_argnums``)."""
    values = (value,) if is_int(value) else value
    if not isinstance(values, Sequence) or not all(is_int(v) for v in values):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {name}={value!r}.")
    indices = tuple(operator.index(v) for v in values)
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name} must not repeat an index, got {name}={value!r}.")
    return indices


def ensure_name_tuple(argnames: Any) -> tuple[str, ...]:
    """A str or a sequence of distinct str (``argnames``)."""
    names = (argnames,) if isinstance(argnames, str) else argnames
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"argnames must be a str or a sequence of str, got {argnames=}.")
    if len(set(names)) != len(names):
        raise ValueError(f"argnames must not repeat a name, got {argnames=}.")
    return tuple(names)


def ensure_count(num_real_microbatches: Any) -> Count:
    """None, a non-negative integer, or a traced integer scalar.

    A concrete integer (Python, NumPy or a concrete JAX scalar) becomes a Python int, so
    the loop keeps a static trip count; only a traced value stays an array.
    """
    if num_real_microbatches is None:
        return None
    shape = getattr(num_real_microbatches, "shape", ())
    dtype = getattr(num_real_microbatches, "dtype", None)
    integer = is_int(num_real_microbatches) or (
        dtype is not None and np.issubdtype(dtype, np.integer)
    )
    if shape != () or not integer:
        raise TypeError(
            "num_real_microbatches must be None, an int or an integer scalar array, got "
            f"{num_real_microbatches!r}; pass e.g. 3 or jnp.int32(3)."
        )
    try:
        count = operator.index(num_real_microbatches)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return jax.numpy.asarray(num_real_microbatches)
    if count < 0:
        raise ValueError(
            f"num_real_microbatches must be non-negative, got {num_real_microbatches=}."
        )
    return count


def ensure_axis_spec(spec: Any, where: str) -> AxisSpec:
    """An int, None or a pytree of them: the batch axis of one argument."""
    leaves = jax.tree.leaves(spec, is_leaf=lambda x: x is None)
    if not all(leaf is None or is_int(leaf) for leaf in leaves):
        raise TypeError(
            f"{where} must be an int, None or a pytree of them, got {spec!r}; "
            "give the batch axis of each batch argument."
        )
    return spec


def ensure_axes_sequence(in_axes: Any, per: str) -> tuple[AxisSpec, ...]:
    """A list or tuple of axis specs, one per ``per``."""
    if not isinstance(in_axes, list | tuple):
        raise TypeError(
            f"in_axes must be an int or a sequence with one entry per {per}, got {in_axes=}."
        )
    return tuple(ensure_axis_spec(spec, f"in_axes[{i}]") for i, spec in enumerate(in_axes))


def ensure_accumulation_dtype(dtype: Any) -> np.dtype | None:
    """None (the default policy) or a floating dtype."""
    if dtype is None:
        return None
    try:
        result = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(
            f"accumulation_dtype must be None or a floating dtype, got {dtype!r}; "
            "pass e.g. jnp.float32."
        ) from err
    if not jax.numpy.issubdtype(result, jax.numpy.floating):
        raise ValueError(
            f"accumulation_dtype must be a floating dtype, got accumulation_dtype={dtype!r}; "
            "pass e.g. jnp.float32, or None for float32 accumulation of narrower floats."
        )
    if jax.dtypes.canonicalize_dtype(result) != result:
        raise ValueError(
            f"accumulation_dtype={result.name} needs 64-bit JAX; enable it with "
            "jax.config.update('jax_enable_x64', True), or pass jnp.float32."
        )
    return result


def ensure_mesh_axes(batch_mesh_axes: Any) -> tuple[str, ...] | None:
    """None, a mesh axis name, or a sequence of names."""
    if batch_mesh_axes is None:
        return None
    names = (batch_mesh_axes,) if isinstance(batch_mesh_axes, str) else batch_mesh_axes
    if not isinstance(names, Sequence) or not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"batch_mesh_axes must be a mesh axis name or a sequence of them, got "
            f"{batch_mesh_axes=}; pass e.g. 'data' or ('data', 'fsdp')."
        )
    return tuple(names)


def ensure_clip_bound(l2_clip_norm: Any) -> Any:
    """None, a positive scalar (``ensure_clip_norm``), or a pytree of them: one bound
    per subtree of the gradient (per-layer clipping)."""
    leaves, structure = jax.tree_util.tree_flatten_with_path(l2_clip_norm)
    if structure.num_nodes == 1 or not leaves:
        return ensure_clip_norm(l2_clip_norm)
    checked = []
    for path, leaf in leaves:
        try:
            checked.append(ensure_clip_norm(leaf))
        except (TypeError, ValueError) as error:
            where = jax.tree_util.keystr(path)
            raise type(error)(f"l2_clip_norm{where}: {error}") from None
    return jax.tree.unflatten(jax.tree.structure(l2_clip_norm), checked)


def ensure_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}.")
    return value


def ensure_clip_norm(l2_clip_norm: Any, name: str = "l2_clip_norm") -> float | jax.Array | None:
    """None, or a positive finite real scalar: a number or a 0-d array.

    A concrete value is checked and becomes a Python float, so the clipping math stays in
    the gradient's dtype; a traced one (``micro_grad`` built inside ``jit``) cannot be
    checked and stays an array.
    """
    if l2_clip_norm is None:
        return None
    dtype = getattr(l2_clip_norm, "dtype", None)
    real = (
        dtype is not None
        and np.shape(l2_clip_norm) == ()
        and (jax.numpy.issubdtype(dtype, jax.numpy.floating) or np.issubdtype(dtype, np.integer))
    )
    if not (real or is_int(l2_clip_norm) or isinstance(l2_clip_norm, float)):
        raise TypeError(
            f"{name} must be a positive number or None, got {name}={l2_clip_norm!r} of type "
            f"{type(l2_clip_norm).__name__}; pass a real scalar such as 1.0 or "
            "jnp.float32(1.0), not a bool or an array with axes."
        )
    try:
        value = float(l2_clip_norm)
    except jax.errors.ConcretizationTypeError:
        return jax.numpy.asarray(l2_clip_norm)
    if not 0 < value < float("inf"):
        raise ValueError(
            f"{name} must be positive and finite, got {name}={l2_clip_norm!r}; pass e.g. "
            f"1.0{', or None for no clipping' if name == 'l2_clip_norm' else ''}."
        )
    return value
