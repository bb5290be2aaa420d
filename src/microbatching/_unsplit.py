"""An argument of the batch's size that no batch argument names: the warning that says so.

``micro_grad(loss, batch_argnums=1)`` on ``loss(params, x, y)`` passes ``y`` whole to
every example: each example's loss then broadcasts against all the labels, and the
gradient is wrong without any error. The check runs at each call, before the loop: a
positional argument that is neither split, nor differentiated, nor declared whole
(``whole_argnums``), and whose array leaves all have the batch's size on axis 0, gets
an ``UnsplitBatchWarning`` naming it, once per wrapped function. All of them: a pytree
of frozen parameters with one table that happens to have as many rows as the batch (a
vocabulary of 64 tokens, a batch of 64) is no sign of a forgotten batch argument, a
label array or a dict of per-example fields is. ``micro_vmap`` takes no
part: its ``in_axes`` names every positional argument, and ``None`` there already says
"whole".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from . import _batch, _checks
from ._signature import BatchAxes, Signature, checked_positions
from ._typing import Function


class UnsplitBatchWarning(UserWarning):
    """A call passed an argument whole to every example although its axis 0 has the
    batch's size: ``microbatch``'s ``argnums`` or ``micro_grad``'s ``batch_argnums`` does
    not name it. If it holds one entry per example, name it there; if it is meant whole
    (a lookup table that happens to have as many rows as the batch), pass its position in
    ``whole_argnums`` to say so. The call runs either way.

    >>> import warnings
    >>> import jax.numpy as jnp
    >>> import microbatching
    >>> def loss(w, x, y):
    ...     return jnp.sum((x @ w - y) ** 2)
    >>> w, x, y = jnp.ones(2), jnp.ones((4, 2)), jnp.zeros(4)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = microbatching.micro_grad(loss, batch_argnums=1, microbatch_size=2)(w, x, y)
    >>> caught[0].category.__name__
    'UnsplitBatchWarning'
    >>> grads, _ = microbatching.micro_grad(loss, batch_argnums=(1, 2), microbatch_size=2)(w, x, y)
    >>> grads
    Array([16., 16.], dtype=float32)
    """


def whole_positions(fun: Function, whole_argnums: Any, axes: BatchAxes) -> tuple[int, ...]:
    """``whole_argnums`` checked against ``fun``'s signature and the batch arguments."""
    nums = _checks.ensure_index_tuple("whole_argnums", whole_argnums)
    sig = axes.signature if axes.signature is not None else Signature.of(fun)
    nums = checked_positions(nums, sig, axes.fun_name, "whole_argnums")
    for i in nums:
        if i in axes.positions:
            raise ValueError(
                f"whole_argnums names argument {i} (`{axes.label(i)}`), which {axes.set_by} "
                "also names as a batch argument to split into examples; name it in one of "
                "them."
            )
    return nums


class Unsplit:
    """The check of one wrapped function: ``exempt`` positions are never looked at (the
    differentiated ones, ``whole_argnums``); ``default`` is the text of batch arguments
    left at their default, for the message (None if the user chose them); ``roles`` what
    else an argument is (``micro_grad``'s ``argnums`` taken for ``batch_argnums``), with a
    ``note`` for the message when one is named."""

    def __init__(
        self,
        axes: BatchAxes,
        exempt: Iterable[int],
        default: str | None = None,
        roles: dict[int, str] | None = None,
        note: str = "",
        named: str | None = None,
    ) -> None:
        self._axes, self._exempt, self._default = axes, frozenset(exempt), default
        self._roles, self._note = roles or {}, note
        self._named = named or axes.set_by
        self._pending = True

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Warns if the call passes such an argument (each wrapped function warns once)."""
        if not self._pending:
            return
        axes = self._axes
        size = self._size(args, kwargs)
        if size is None:
            return
        for where, arg in [*enumerate(args), *kwargs.items()]:
            at = axes.position(where)
            if at is None or at in axes.positions or at in self._exempt:
                continue
            arrays = [x for x in jax.tree.leaves(arg) if np.ndim(x)]
            if arrays and all(np.shape(x)[0] == size for x in arrays):
                self._pending = False
                _checks.warn(self._message(at, size), UnsplitBatchWarning)
                return

    def _size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The batch's size, if the batch arguments agree on one (else the loop's own
        checks will say what is wrong)."""
        axes = self._axes
        sizes = set()
        for where, arg in [*enumerate(args), *kwargs.items()]:
            at = axes.position(where)
            if at is not None and at in axes.positions:
                spec = axes.positions[at]
            elif isinstance(where, str) and where in axes.names:
                spec = axes.names[where]
            else:
                continue
            try:
                per_leaf = _batch.axes_per_leaf(spec, arg, axes.label(where))
            except ValueError:
                return None
            for axis, leaf in zip(per_leaf, jax.tree.leaves(arg), strict=True):
                ndim = np.ndim(leaf)
                if axis is not None and -ndim <= axis < ndim:
                    sizes.add(np.shape(leaf)[axis])
        return sizes.pop() if len(sizes) == 1 else None

    def _message(self, at: int, size: int) -> str:
        axes = self._axes
        label, name, what = axes.label(at), axes.fun_name, axes.required_by
        role = self._roles.get(at)
        named = sorted(axes.positions)
        split = f"pass {what}={tuple(sorted({*named, at}))}" if named else f"add {at} to {what}"
        if self._default is not None:
            head = (
                f"{axes.transform}({name}): {what} was left at its default, "
                f"{self._default}, so only `{axes.label(named[0])}` is split into examples, "
                f"but `{label}` (argument {at}{', ' + role if role else ''}) also has {size} "
                "rows on axis 0 and"
            )
            whole = f"pass {what}={self._default} or whole_argnums={at} to say so"
        else:
            head = (
                f"{axes.transform}({name}): `{label}` (argument {at}"
                f"{', ' + role if role else ''}) has {size} rows on axis 0, as the batch "
                f"has, but it is not a batch argument ({self._named}), so it"
            )
            whole = f"pass whole_argnums={at} to say so"
        return (
            f"{head} is passed whole to every example. If it holds one entry per "
            f"example, {split}; if it is meant whole, {whole}." + (f" {self._note}" if role else "")
        )
