"""From ``argnums`` / ``argnames`` / ``in_axes`` and a call's arguments to batched leaves.

Every check of user input lives here. Wrap-time checks run in ``BatchArguments.create``;
what needs the actual arrays runs in ``BatchArguments.locate`` at the first call.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._typing import AxisSpec, Count, Function, PyTree


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


def check_mapped_keywords(kwargs: dict[str, Any], transform: str, unmapped: str) -> None:
    """Keyword arguments of micro_vmap / micro_grad are mapped, so their leaves must be arrays.

    ``unmapped`` tells how to pass an argument that should not be mapped.
    """
    for name, value in kwargs.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            if not isinstance(leaf, jax.Array | np.ndarray) or not np.ndim(leaf):
                raise TypeError(
                    f"{transform} maps keyword arguments along axis 0, as jax.vmap does, but "
                    f"`{name}{jax.tree_util.keystr(path)}` is {leaf!r}, not an array with a "
                    f"batch axis; pass it {unmapped}, or bind it with functools.partial."
                )


def ensure_microbatch_size(microbatch_size: Any) -> int | None:
    """Checks ``microbatch_size``: a positive int, or None for no microbatching."""
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
    """Normalises an int or a sequence of ints (``argnums``, ``batch_argnums``)."""
    values = (value,) if is_int(value) else value
    if not isinstance(values, Sequence) or not all(is_int(v) for v in values):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {name}={value!r}.")
    indices = tuple(operator.index(v) for v in values)
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name} must not repeat an index, got {name}={value!r}.")
    return indices


def ensure_name_tuple(argnames: Any) -> tuple[str, ...]:
    """Normalises ``argnames``: a str or a sequence of str."""
    names = (argnames,) if isinstance(argnames, str) else argnames
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"argnames must be a str or a sequence of str, got {argnames=}.")
    if len(set(names)) != len(names):
        raise ValueError(f"argnames must not repeat a name, got {argnames=}.")
    return tuple(names)


def ensure_count(num_real_microbatches: Any) -> Count:
    """Checks ``num_real_microbatches``: None, a non-negative integer, or a traced integer scalar.

    A concrete integer (Python, NumPy or a concrete JAX scalar) becomes a Python int, so
    the loop keeps a static trip count; only a traced value makes it dynamic.
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


def num_microbatches(batch_size: int, microbatch_size: int) -> int:
    """The number of microbatches, or a ValueError naming both sizes."""
    if batch_size % microbatch_size:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        nearest = sorted(sorted(divisors, key=lambda d: abs(d - microbatch_size))[:4])
        raise ValueError(
            f"The batch size {batch_size} is not divisible by {microbatch_size=}; "
            f"choose a microbatch_size that divides it, such as one of {nearest}, "
            "or pad the batch and pass num_real_microbatches."
        )
    return batch_size // microbatch_size


def real_count(count: Count, total: int) -> int | jax.Array:
    """How many microbatches to run: ``count`` bounded by ``total``."""
    if count is None:
        return total
    if isinstance(count, int):
        if count > total:
            raise ValueError(
                f"num_real_microbatches={count} exceeds the number of microbatches, {total}; "
                f"pass at most {total}."
            )
        return count
    return jax.numpy.clip(count, 0, total).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class _Signature:
    """What ``inspect.signature`` tells about how ``fun`` takes its arguments."""

    positional: tuple[str, ...]
    positional_only: frozenset[str]
    keyword: frozenset[str]
    var_positional: bool
    var_keyword: bool

    @classmethod
    def of(cls, fun: Function) -> _Signature | None:
        try:
            params = inspect.signature(fun).parameters.values()
        except (TypeError, ValueError):
            return None
        kind = inspect.Parameter
        return cls(
            positional=tuple(
                p.name
                for p in params
                if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
            ),
            positional_only=frozenset(p.name for p in params if p.kind == kind.POSITIONAL_ONLY),
            keyword=frozenset(
                p.name for p in params if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)
            ),
            var_positional=any(p.kind == kind.VAR_POSITIONAL for p in params),
            var_keyword=any(p.kind == kind.VAR_KEYWORD for p in params),
        )

    def describe(self) -> str:
        names = list(self.positional) + sorted(self.keyword - set(self.positional))
        return "(" + ", ".join(names) + ")"


def _check_axis_spec(spec: AxisSpec, where: str) -> None:
    leaves = jax.tree.leaves(spec, is_leaf=lambda x: x is None)
    if not all(leaf is None or is_int(leaf) for leaf in leaves):
        raise TypeError(
            f"{where} must be an int, None or a pytree of them, got {spec!r}; "
            "give the batch axis of each batch argument."
        )


def _axes_sequence(in_axes: Any, per: str) -> tuple[AxisSpec, ...]:
    """Checks a sequence of axis specs, one per ``per``."""
    if not isinstance(in_axes, list | tuple):
        raise TypeError(
            f"in_axes must be an int or a sequence with one entry per {per}, got {in_axes=}."
        )
    for i, spec in enumerate(in_axes):
        _check_axis_spec(spec, f"in_axes[{i}]")
    return tuple(in_axes)


def ensure_vmap_in_axes(in_axes: Any) -> int | tuple[AxisSpec, ...]:
    """Checks ``micro_vmap``'s ``in_axes``: an int, or a sequence with one entry per argument."""
    if is_int(in_axes):
        return operator.index(in_axes)
    return _axes_sequence(in_axes, "positional argument")


def _in_axes_tuple(in_axes: Any, count: int, names: str) -> tuple[AxisSpec, ...]:
    if is_int(in_axes) or in_axes is None:
        _check_axis_spec(in_axes, "in_axes")
        return (in_axes,) * count
    axes = _axes_sequence(in_axes, "batch argument")
    if len(axes) != count:
        raise ValueError(
            f"in_axes has {len(axes)} entries but {names} name {count} batch argument(s); "
            f"give one axis per batch argument, in the order argnums then argnames ({in_axes=})."
        )
    return axes


def _axes_per_leaf(spec: AxisSpec, arg: PyTree, label: str) -> list[int | None]:
    """Broadcasts one argument's axis spec (a pytree prefix) to its leaves."""
    out: list[int | None] = []
    try:
        jax.tree.map(
            lambda ax, sub: out.extend([ax] * len(jax.tree.leaves(sub))),
            spec,
            arg,
            is_leaf=lambda x: x is None,
        )
    except ValueError as err:
        raise ValueError(
            f"The in_axes entry {spec!r} for argument `{label}` is not a pytree prefix of it "
            f"(structure {jax.tree.structure(arg)}); give an int or a prefix of its structure."
        ) from err
    return out


@dataclasses.dataclass(frozen=True)
class Batch:
    """A call's arguments, flattened, with the batch axis of each leaf (None: not batched)."""

    treedef: Any
    leaves: tuple[Any, ...]
    axes: tuple[int | None, ...]
    labels: tuple[str, ...]
    size: int

    def rebuild(self, leaves: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return tuple(args), kwargs


@dataclasses.dataclass(frozen=True)
class BatchArguments:
    """Which arguments of ``fun`` carry a batch axis, and on which axis."""

    fun_name: str
    argnums: tuple[int, ...]
    argnames: tuple[str, ...]
    in_axes: tuple[AxisSpec, ...]
    signature: _Signature | None

    @classmethod
    def create(
        cls, fun: Function, argnums: Any, argnames: Any, in_axes: Any, what: str = "argnums"
    ) -> BatchArguments:
        """Checks the wrap-time arguments against ``fun``'s signature.

        ``what`` is the name the user gave ``argnums`` (``batch_argnums`` in micro_grad).
        """
        if not callable(fun):
            raise TypeError(f"fun must be callable, got {fun!r}.")
        name = function_name(fun)
        signature = _Signature.of(fun)
        nums = ensure_index_tuple(what, argnums)
        names = ensure_name_tuple(argnames)
        if not nums and not names:
            both = "argnums and argnames are both" if what == "argnums" else f"{what} is"
            raise ValueError(f"{both} empty; name at least one argument with a batch axis.")
        nums = _normalise_argnums(nums, signature, name, what)
        _check_argnames(names, signature, name)
        if signature is not None:
            for i in nums:
                if i < len(signature.positional) and signature.positional[i] in names:
                    raise ValueError(
                        f"Argument `{signature.positional[i]}` of {name} is named twice, by "
                        f"argnums ({i}) and by argnames; name it once."
                    )
        axes = _in_axes_tuple(in_axes, len(nums) + len(names), f"{argnums=} and {argnames=}")
        return cls(name, nums, names, axes, signature)

    def _label(self, where: int | str) -> str:
        sig = self.signature
        if isinstance(where, str):
            return where
        if sig is not None and where < len(sig.positional):
            return sig.positional[where]
        return f"args[{where}]"

    def _where(self, argnum_or_name: int | str, args: tuple[Any, ...], kwargs: dict[str, Any]):
        """Where a batch argument sits in this call: a position or a keyword."""
        sig = self.signature
        if isinstance(argnum_or_name, int):
            i = argnum_or_name
            if i < len(args):
                return i
            name = sig.positional[i] if sig and i < len(sig.positional) else None
            if name is not None and name in kwargs and name not in sig.positional_only:  # type: ignore[union-attr]
                return name
            by_name = f" and no keyword argument `{name}`" if name else ""
            raise TypeError(
                f"argnums includes {i}, but {self.fun_name} was called with {len(args)} "
                f"positional argument(s){by_name}; pass the batch argument."
            )
        if argnum_or_name in kwargs:
            return argnum_or_name
        if sig and argnum_or_name in sig.positional:
            i = sig.positional.index(argnum_or_name)
            if i < len(args):
                return i
        raise TypeError(
            f"argnames includes {argnum_or_name!r}, but {self.fun_name} was called without it "
            f"(keyword arguments given: {sorted(kwargs)}); pass the batch argument."
        )

    def locate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Batch:
        """Flattens a call and finds each batched leaf, checking shapes and batch sizes."""
        specs: dict[int | str, AxisSpec] = {}
        for key, spec in zip(self.argnums + self.argnames, self.in_axes, strict=True):
            specs[self._where(key, args, kwargs)] = spec
        axes: list[int | None] = []
        labels: list[str] = []
        leaves: list[Any] = []
        for where, arg in [*enumerate(args), *sorted(kwargs.items())]:
            label = self._label(where)
            arg_leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
            leaves += [leaf for _, leaf in arg_leaves]
            labels += [label + jax.tree_util.keystr(path) for path, _ in arg_leaves]
            axes += _axes_per_leaf(specs.get(where), arg, label)
        axes = [
            _normalise_axis(ax, leaf, lab)
            for ax, leaf, lab in zip(axes, leaves, labels, strict=True)
        ]
        size = _batch_size(axes, leaves, labels)
        treedef = jax.tree.structure((args, kwargs))
        return Batch(treedef, tuple(leaves), tuple(axes), tuple(labels), size)


def _normalise_argnums(
    nums: tuple[int, ...], sig: _Signature | None, name: str, what: str
) -> tuple[int, ...]:
    fixed = sig is not None and not sig.var_positional
    count = len(sig.positional) if sig is not None else 0
    out = []
    for i in nums:
        if i < 0 and not fixed:
            raise ValueError(
                f"{what} contains {i}, but negative indices need a function with a fixed number "
                f"of positional parameters, and {name} takes *args; use a non-negative index."
            )
        j = i + count if i < 0 else i
        if sig is not None and fixed and not 0 <= j < count:
            fix = (
                f"use an index in [{-count}, {count})"
                if count
                else "name keyword parameters with argnames instead"
            )
            raise ValueError(
                f"{what} contains {i}, out of range for {name}{sig.describe()} "
                f"with {count} positional parameter(s); {fix}."
            )
        out.append(j)
    return tuple(out)


def _check_argnames(names: tuple[str, ...], sig: _Signature | None, fun_name: str) -> None:
    if sig is None or sig.var_keyword:
        return
    for n in names:
        if n not in sig.keyword:
            raise ValueError(
                f"argnames contains {n!r}, which is not a keyword parameter of "
                f"{fun_name}{sig.describe()}; use one of {sorted(sig.keyword)}."
            )


def _normalise_axis(axis: int | None, leaf: Any, label: str) -> int | None:
    if axis is None:
        return None
    if not isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        raise TypeError(
            f"Batch argument `{label}` is a {type(leaf).__name__}, not an array, so it has no "
            "batch axis; convert it with jnp.asarray, or leave it out of the batch arguments."
        )
    ndim = len(leaf.shape)
    if ndim == 0:
        raise ValueError(
            f"Batch argument `{label}` is a scalar (shape ()), so it has no batch axis; give it "
            "a batch axis, or leave it out of the batch arguments."
        )
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"in_axes gives axis {axis} for batch argument `{label}` of shape {leaf.shape} "
            f"(rank {ndim}); use an axis in [{-ndim}, {ndim})."
        )
    return operator.index(axis) % ndim


def _batch_size(axes: list[int | None], leaves: list[Any], labels: list[str]) -> int:
    found = [
        (lab, ax, leaf.shape)
        for ax, leaf, lab in zip(axes, leaves, labels, strict=True)
        if ax is not None
    ]
    if not found:
        raise ValueError(
            "No batch argument has an array leaf, so there is no batch axis to split; "
            "check argnums, argnames and in_axes."
        )
    sizes = {shape[ax] for _, ax, shape in found}
    if len(sizes) > 1:
        listing = "; ".join(f"`{lab}` axis {ax} of shape {shape}" for lab, ax, shape in found)
        raise ValueError(
            f"Batch arguments must have equal batch sizes, got {sorted(sizes)}: {listing}. "
            "Fix the shapes or in_axes."
        )
    return sizes.pop()
