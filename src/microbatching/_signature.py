"""Binding a call to ``fun``'s signature: which parameter each argument is.

``inspect.signature`` is read once, when the user wraps ``fun``. At each call a keyword
argument that names a positional parameter is treated as that parameter, so
``f(x, y=y)`` and ``f(x, y)`` are the same call to every transform.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax

from . import _checks
from ._typing import AxisSpec, Function

F = TypeVar("F", bound=Callable[..., Any])

WEIGHTS = "example_weights"
"""The keyword of the per-example weights that ``micro_vmap`` and ``micro_grad`` take."""


def split_weights(kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """A call's keyword arguments without ``example_weights``, and the weights (or None).

    The one place the weights leave the keywords: from here on they travel as an
    argument of their own (``_wrap.wraps``, ``Options.batch_size``, ``clipping_report``).
    """
    if WEIGHTS not in kwargs:
        return kwargs, None
    rest = dict(kwargs)
    return rest, rest.pop(WEIGHTS)


RESERVES = "__microbatching_example_weights__"
"""The attribute set on our wrappers that take ``example_weights`` themselves."""

OPTIONS = "__microbatching__"
"""The attribute of our wrappers that holds their ``Options`` (read by ``plan``)."""

TOO_MANY = object()
"""``BatchAxes.rest`` when a call may not pass more positional arguments than there are specs."""


@dataclasses.dataclass(frozen=True)
class Signature:
    """What ``inspect.signature`` tells about how ``fun`` takes its arguments."""

    positional: tuple[str, ...]
    positional_only: frozenset[str]
    keyword: frozenset[str]
    var_positional: bool
    var_keyword: bool

    @classmethod
    def of(cls, fun: Function) -> Signature | None:
        """The signature of ``fun``, or None when Python cannot tell it."""
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

    def takes(self, name: str) -> bool:
        """Whether a keyword argument ``name`` binds to a parameter (or ``**kwargs``)."""
        return name in self.keyword or self.var_keyword

    def describe(self) -> str:
        """``(x, y, *, z)``-like text for error messages."""
        names = list(self.positional) + sorted(self.keyword - set(self.positional))
        return "(" + ", ".join(names) + ")"

    def position(self, name: str) -> int | None:
        """The position of the parameter a keyword argument ``name`` binds to, if any."""
        if name in self.positional and name not in self.positional_only:
            return self.positional.index(name)
        return None

    def label(self, where: int | str) -> str:
        """The name of the parameter at ``where`` (a position or a keyword)."""
        if isinstance(where, int) and where < len(self.positional):
            return self.positional[where]
        return where if isinstance(where, str) else f"args[{where}]"


SHAPES_NOTE = "micro_grad called fun with each example"
"""How ``micro_grad``'s note on an error inside ``fun`` begins (``_per_example``): an
error that has one is given no other note of how ``fun`` saw the batch."""


BATCH_NAMES = {
    "microbatch": (
        "microbatch names its batch arguments by argnums= (positions) or argnames= "
        "(names), and their axes by in_axes="
    ),
    "micro_vmap": (
        "micro_vmap takes its batch axes as in_axes=, as jax.vmap does: an axis for each "
        "batch argument, None for one that is not a batch (in_axes=(None, 0) for "
        "fun(params, x))"
    ),
    "micro_grad": (
        "micro_grad names its batch arguments by batch_argnums= (positions); its argnums= "
        "are the parameters differentiated, as jax.grad's"
    ),
}
"""How each transform names its batch arguments: the fix for a keyword that another
transform takes (``batch_argnums=`` passed to ``microbatch``)."""

_OTHERS = ("argnums", "argnames", "in_axes", "batch_argnums")


def other_transforms_names(fun: F) -> F:
    """``fun`` (a transform), raising a ``TypeError`` that names its own way where a
    call passes a keyword for the batch arguments that only another transform takes;
    Python's own error names the keyword alone."""
    own = set(inspect.signature(fun).parameters)
    foreign = [name for name in _OTHERS if name not in own]

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        for name in foreign:
            if name in kwargs:
                raise TypeError(
                    f"{fun.__name__} takes no argument {name}= (given {kwargs[name]!r}): "
                    f"{BATCH_NAMES[fun.__name__]}."
                )
        return fun(*args, **kwargs)

    return typing.cast(F, call)


def first_few(items: Sequence[str], most: int = 4) -> str:
    """``items`` joined by commas, the first ``most`` of them, then ``...`` for the rest:
    the arguments that an error's note lists."""
    return ", ".join(items[:most]) + (", ..." if len(items) > most else "")


def leaf_paths(tree: Any) -> list[str]:
    """Each leaf's path in ``tree`` as ``jax.tree_util.keystr`` writes it (``['w']``,
    ``[0]``), in ``jax.tree.leaves`` order; ``""`` for a tree that is one array."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@dataclasses.dataclass(frozen=True)
class BatchAxes:
    """Which arguments of ``fun`` carry a batch axis, and on which axis.

    Attributes:
      transform: ``"microbatch"``, ``"micro_vmap"`` or ``"micro_grad"``, for messages.
      fun_name: The user's function, for messages.
      signature: Its signature, or None where Python cannot tell it.
      positions: The axis spec of each batched positional parameter.
      names: The axis spec of each batched keyword-only (or extra) parameter.
      rest: The spec of positional parameters not in ``positions`` (``TOO_MANY``: an error).
      other_keywords: The spec of keyword arguments that name no parameter of ``positions``
        or ``names`` (``micro_vmap`` and ``micro_grad`` map them along 0, like ``jax.vmap``).
      required: Batch arguments every call must pass.
      required_by: The wrap-time argument that requires them (``argnums``...).
      set_by: The wrap-time arguments that chose these axes, for messages.
      weights: Whether calls may pass ``example_weights`` (a keyword ``fun`` never sees).
    """

    transform: str
    fun_name: str
    signature: Signature | None
    positions: Mapping[int, AxisSpec]
    names: Mapping[str, AxisSpec]
    rest: Any
    other_keywords: AxisSpec
    required: tuple[int | str, ...]
    required_by: str
    set_by: str
    weights: bool = False

    def spec(self, where: int | str) -> AxisSpec:
        """The axis spec of the argument passed at position or keyword ``where``."""
        if isinstance(where, str) and where in self.names:
            return self.names[where]
        at = self.position(where)
        if at is None:
            return self.other_keywords
        return self.positions.get(at, self.rest)

    def position(self, where: int | str) -> int | None:
        """The parameter position of the argument at ``where``, if it binds to one.

        A keyword past the entries of a sequence ``in_axes`` binds to none: it is mapped
        by the ``jax.vmap`` rule, as it would be with ``jax.vmap``.
        """
        at = position(self.signature, where)
        if isinstance(where, str) and self.rest is TOO_MANY and at not in self.positions:
            return None
        return at

    def to_positions(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``to_positions``, up to the last parameter that ``in_axes`` gives an entry."""
        limit = len(self.positions) if self.rest is TOO_MANY else None
        return to_positions(self.signature, args, kwargs, limit)

    def label(self, where: int | str) -> str:
        return label(self.signature, where)


def position(signature: Signature | None, where: int | str) -> int | None:
    """The parameter position of an argument given by position or keyword, if it has one."""
    if isinstance(where, int):
        return where
    return None if signature is None else signature.position(where)


def label(signature: Signature | None, where: int | str) -> str:
    """The user's name for an argument: its parameter name where the signature has one."""
    if signature is not None:
        return signature.label(where)
    return where if isinstance(where, str) else f"args[{where}]"


def to_positions(
    signature: Signature | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    limit: int | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Moves keyword arguments that continue the positional ones into positions.

    ``f(p, x=x)`` becomes ``f(p, x)`` and ``f(params=p, x=x)`` becomes ``f(p, x)``, so
    that ``jax.grad``'s ``argnums`` finds them. Anything else is left as it was called.
    """
    if signature is None or not kwargs:
        return args, kwargs
    positional, keywords = list(args), dict(kwargs)
    end = len(signature.positional) if limit is None else min(limit, len(signature.positional))
    while len(positional) < end:
        name = signature.positional[len(positional)]
        if name in signature.positional_only or name not in keywords:
            break
        positional.append(keywords.pop(name))
    return tuple(positional), keywords


def microbatch_axes(fun: Function, argnums: Any, argnames: Any, in_axes: Any) -> BatchAxes:
    """``microbatch``'s batch arguments: ``argnums`` and ``argnames``, axes from ``in_axes``."""
    _checks.ensure_callable("fun", fun)
    name, sig = _checks.function_name(fun), Signature.of(fun)
    nums = checked_positions(_checks.ensure_index_tuple("argnums", argnums), sig, name, "argnums")
    names = _checks.ensure_name_tuple(argnames)
    if not nums and not names:
        raise ValueError("argnums and argnames are both empty; name at least one argument.")
    _check_argnames(names, sig, name)
    for i in nums:
        if sig is not None and i < len(sig.positional) and sig.positional[i] in names:
            raise ValueError(
                f"Argument `{sig.positional[i]}` of {name} is named twice, by argnums ({i}) "
                "and by argnames; name it once."
            )
    axes = _in_axes_tuple(in_axes, len(nums) + len(names), f"{argnums=} and {argnames=}")
    positions = dict(zip(nums, axes, strict=False))
    keywords = {}
    for n, axis in zip(names, axes[len(nums) :], strict=True):
        where = None if sig is None else sig.position(n)
        if where is None:
            keywords[n] = axis
        else:
            positions[where] = axis
    return BatchAxes(
        "microbatch",
        name,
        sig,
        positions,
        keywords,
        None,
        None,
        (*nums, *names),
        "argnums",
        "argnums, argnames and in_axes",
    )


def vmap_axes(fun: Function, in_axes: Any) -> BatchAxes:
    """``micro_vmap``'s: ``in_axes`` per positional parameter, the jax.vmap rule for the rest."""
    _checks.ensure_callable("fun", fun)
    name, sig = _checks.function_name(fun), Signature.of(fun)
    if _checks.is_int(in_axes):
        positions, rest = {}, int(in_axes)
    else:
        positions = dict(enumerate(_checks.ensure_axes_sequence(in_axes, "positional argument")))
        rest = TOO_MANY
        if sig is not None and not sig.var_positional and len(positions) > len(sig.positional):
            raise ValueError(
                f"in_axes has {len(positions)} entries but {name}{sig.describe()} takes "
                f"{len(sig.positional)} positional parameter(s); give one entry per "
                f"positional parameter ({in_axes=})."
            )
    _check_reserved(fun, sig, name, "micro_vmap")
    return BatchAxes(
        "micro_vmap",
        name,
        sig,
        positions,
        {},
        rest,
        0,
        (),
        "in_axes",
        f"in_axes={in_axes!r}",
        weights=True,
    )


def grad_axes(fun: Function, batch_argnums: Any) -> BatchAxes:
    """``micro_grad``'s: axis 0 of ``batch_argnums``, the jax.vmap rule for extra keywords."""
    _checks.ensure_callable("fun", fun)
    name, sig = _checks.function_name(fun), Signature.of(fun)
    nums = _checks.ensure_index_tuple("batch_argnums", batch_argnums)
    if not nums:
        raise ValueError("batch_argnums is empty; name at least one argument with a batch axis 0.")
    nums = checked_positions(nums, sig, name, "batch_argnums")
    _check_reserved(fun, sig, name, "micro_grad")
    return BatchAxes(
        "micro_grad",
        name,
        sig,
        dict.fromkeys(nums, 0),
        {},
        None,
        0,
        nums,
        "batch_argnums",
        f"batch_argnums={batch_argnums!r}",
        weights=True,
    )


class _Default(int):
    """An int that is ``micro_grad``'s default ``batch_argnums``, told apart by identity."""

    def __repr__(self) -> str:
        return int.__repr__(self)


DEFAULT_BATCH_ARGNUMS = _Default(1)
"""``micro_grad``'s default ``batch_argnums``: 1, and known to have been left unset."""


def _check_reserved(fun: Function, sig: Signature | None, name: str, transform: str) -> None:
    """``fun`` may not have a parameter named ``example_weights``: the keyword is ours.

    Our own wrappers have one (they take weights themselves): the outer transform takes
    the keyword, and the inner one runs unweighted.
    """
    if getattr(fun, RESERVES, False):
        return
    if sig is not None and (WEIGHTS in sig.keyword or WEIGHTS in sig.positional):
        raise ValueError(
            f"{name}{sig.describe()} has a parameter named {WEIGHTS!r}, but {transform} "
            f"takes {WEIGHTS}= itself (per-example weights, never passed to fun); rename "
            "the parameter of fun."
        )


def differentiated(fun: Function, argnums: Any) -> tuple[int, ...]:
    """``micro_grad``'s ``argnums``: checked against ``fun``'s positional parameters."""
    nums = _checks.ensure_index_tuple("argnums", argnums)
    if not nums:
        raise ValueError(
            "argnums is empty, so there is nothing to differentiate; pass the position of "
            "the parameters, e.g. argnums=0."
        )
    sig = Signature.of(fun)
    return checked_positions(nums, sig, _checks.function_name(fun), "argnums")


def checked_positions(
    nums: tuple[int, ...], sig: Signature | None, name: str, what: str
) -> tuple[int, ...]:
    """Positions ``nums`` given as ``what`` (``argnums``...) checked against ``fun``'s
    signature ``sig``, negative ones made non-negative."""
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
        if j in out:
            raise ValueError(
                f"{what}={nums!r} names position {j} twice (negative indices count from the "
                f"end of {name}{sig.describe() if sig else ''}); name each argument once."
            )
        out.append(j)
    return tuple(out)


def _check_argnames(names: tuple[str, ...], sig: Signature | None, fun_name: str) -> None:
    if sig is None or sig.var_keyword:
        return
    for n in names:
        if n not in sig.keyword:
            raise ValueError(
                f"argnames contains {n!r}, which is not a keyword parameter of "
                f"{fun_name}{sig.describe()}; use one of {sorted(sig.keyword)}."
            )


def _in_axes_tuple(in_axes: Any, count: int, names: str) -> tuple[AxisSpec, ...]:
    if in_axes is None:
        raise ValueError(
            "in_axes=None gives the batch arguments no batch axis; pass the axis of each, "
            "e.g. in_axes=0."
        )
    if _checks.is_int(in_axes):
        return (_checks.ensure_axis_spec(in_axes, "in_axes"),) * count
    axes = _checks.ensure_axes_sequence(in_axes, "batch argument")
    if len(axes) != count:
        raise ValueError(
            f"in_axes has {len(axes)} entries but {names} name {count} batch argument(s); "
            f"give one axis per batch argument, in the order argnums then argnames ({in_axes=})."
        )
    return axes
