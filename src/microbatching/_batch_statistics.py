"""A loss that mixes the rows of its batch, seen at trace time: ``micro_grad`` warns.

``micro_grad`` computes each example's gradient from the loss of that example alone. With
``keep_batch_dim=True`` the loss is written for a batch, and it may compute a statistic
over the batch and apply it back to the rows: a BatchNorm layer (``x - mean(x, 0)``), a
softmax over the examples of a contrastive loss, a loss normalised by the batch's token
count. Each example then sees a statistic of itself alone, and the result is not that of
the whole batch (with BatchNorm on a dense layer, the output is its bias whatever the
input). Nothing fails, so the user is told.

The loss is traced once more, abstractly, on a batch of ``PROBE_ROWS`` rows: a prime that
no other axis is likely to be a multiple of. A **batch statistic** is the result of a
reduction of a batch value over an axis of a multiple of ``PROBE_ROWS`` entries (a sum,
max, min, product, cumulative op, sort, or a contraction); the loss mixes its rows where a
batch statistic meets a value that still has such an axis. A mean of per-row losses (the
loss itself) reduces the rows and meets nothing after: it is not flagged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from . import _primitives

PROBE_ROWS = 4099
"""The probe's batch size: a prime, so that an axis carries the rows only where its size
is a multiple of it."""

REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "psum",  # a collective over a vmapped axis of positions (Equinox BatchNorm)
    "pmax",
    "pmin",
}
"""Primitives that combine entries along the axes their parameters name."""


class BatchStatisticsWarning(UserWarning):
    """``micro_grad`` with ``keep_batch_dim=True`` was given a loss that computes a
    statistic over the batch axis and applies it back to the rows: a BatchNorm layer, a
    softmax over the examples, each row divided by a batch total.

    ``micro_grad`` computes each example's gradient from that example alone, so the
    statistic is the example's own, and the result is not the whole batch's. It warns when
    it traces the loss; the result is computed all the same.

    >>> import warnings
    >>> import jax.numpy as jnp
    >>> from microbatching import BatchStatisticsWarning, micro_grad
    >>> def centred(w, x):  # each row less the batch's mean: a batch statistic
    ...     return jnp.mean((x - x.mean(0, keepdims=True)) @ w)
    >>> grad_fn = micro_grad(centred, batch_argnums=1, microbatch_size=2)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     grads, _ = grad_fn(jnp.ones(3), jnp.arange(12.0).reshape(4, 3))
    >>> caught[0].category is BatchStatisticsWarning
    True
    >>> grads  # each example alone is its own mean: nothing is left to learn
    Array([0., 0., 0.], dtype=float32)
    """


def _reduced_axes(eqn: Any) -> tuple[int, ...]:
    params = eqn.params
    if "axes" in params:
        return tuple(params["axes"])
    if "axis" in params:
        return (params["axis"],)
    if "dimension" in params:
        return (params["dimension"],)
    return ()


def _rows(size: int) -> bool:
    """Whether an axis of ``size`` entries may carry the probe's rows."""
    return size > 0 and size % PROBE_ROWS == 0


def _rows_axis(aval: Any) -> bool:
    return any(_rows(d) for d in getattr(aval, "shape", ()))


def _bodies(eqn: Any) -> list[tuple[Jaxpr, int]]:
    """Sub-programs of a call whose inputs are the call's last ones (closed calls, jit,
    custom derivatives, remat): read in line."""
    inlined = _primitives.body(eqn)  # a checkpoint under JAX_REMAT3 holds it elsewhere
    if inlined is not None:
        return [(inlined[0], len(eqn.invars) - len(inlined[0].invars))]
    found = []
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(name)
        if isinstance(body, ClosedJaxpr):
            body = body.jaxpr
        if isinstance(body, Jaxpr):
            found.append((body, len(eqn.invars) - len(body.invars)))
    return found


@dataclasses.dataclass
class _Walk:
    data: set[Any]  # variables that depend on the batch
    statistics: set[Any]  # variables that depend on a batch statistic
    found: list[str]

    def run(self, jaxpr: Jaxpr, live: set[Any] | None = None) -> None:
        for eqn in jaxpr.eqns:
            if live is not None and not any(o in live for o in eqn.outvars):
                continue  # feeds only aux, or nothing: the gradient does not see it
            ins = [v for v in eqn.invars if not isinstance(v, Literal)]
            data = any(v in self.data for v in ins)
            stat = any(v in self.statistics for v in ins)
            for body, skip in _bodies(eqn):
                pairs = [
                    (b, v)
                    for b, v in zip(body.invars, eqn.invars[skip:], strict=True)
                    if not isinstance(v, Literal)
                ]
                inner = _Walk(
                    {b for b, v in pairs if v in self.data},
                    {b for b, v in pairs if v in self.statistics},
                    self.found,
                )
                inner.run(body)
                if self.found:
                    return
            rows = [v for v in ins if v in self.data and _rows_axis(v.aval)]
            if stat and (rows or any(_rows_axis(o.aval) for o in eqn.outvars)):
                self.found.append(eqn.primitive.name)
                return
            if data:
                self.data.update(eqn.outvars)
            if stat or (data and self._reduces_rows(eqn, rows)):
                self.statistics.update(eqn.outvars)

    @staticmethod
    def _reduces_rows(eqn: Any, rows: Sequence[Any]) -> bool:
        if not rows:
            return False
        name = eqn.primitive.name
        if name in REDUCTIONS:
            shape = rows[0].aval.shape
            axes = [a for a in _reduced_axes(eqn) if isinstance(a, int) and a < len(shape)]
            return any(_rows(shape[a]) for a in axes)
        if name == "dot_general":
            contract, _ = eqn.params["dimension_numbers"]
            for operand, axes in zip(eqn.invars, contract, strict=True):
                if operand in rows and any(_rows(operand.aval.shape[a]) for a in axes):
                    return True
        return False


def mixes_rows(
    fun: Any, params: Sequence[Any], data: Sequence[Any], expanded: Sequence[bool]
) -> str | None:
    """The primitive where ``fun(params, data)``, given a batch of ``PROBE_ROWS`` rows of
    each leaf of ``data`` (whose rows are on axis 0) that is ``expanded`` and one example
    of the others, applies a statistic over the rows back to them; None where it does
    not, or where the probe cannot trace it."""
    probe = [
        jax.ShapeDtypeStruct(((PROBE_ROWS,) if e else ()) + jax.numpy.shape(x)[1:], x.dtype)
        for x, e in zip(data, expanded, strict=True)
    ]
    specs = [jax.ShapeDtypeStruct(jax.numpy.shape(p), jax.numpy.result_type(p)) for p in params]
    try:
        closed = jax.make_jaxpr(fun)(specs, probe)
    except Exception:  # a loss written for its own batch size: no probe
        return None
    jaxpr = closed.jaxpr
    batch = jaxpr.invars[len(specs) :]
    walk = _Walk({v for v, e in zip(batch, expanded, strict=True) if e}, set(), [])
    walk.run(jaxpr, _feeding(jaxpr, jaxpr.outvars[:1]))
    return walk.found[0] if walk.found else None


def _feeding(jaxpr: Jaxpr, outputs: Sequence[Any]) -> set[Any]:
    """The variables of ``jaxpr`` that ``outputs`` (the loss, not its aux) depend on."""
    live = {v for v in outputs if not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns):
        if any(o in live for o in eqn.outvars):
            live.update(v for v in eqn.invars if not isinstance(v, Literal))
    return live
