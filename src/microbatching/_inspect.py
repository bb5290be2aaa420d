"""``clipping_report``: how ``micro_grad`` computes a call's clipped sum and norms, and
by which rule each parameter leaf's per-example norm comes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from ._signature import OPTIONS, split_weights


@dataclasses.dataclass(frozen=True)
class LeafRule:
    """How one parameter leaf's per-example gradient norm is computed.

    Attributes:
      path: The leaf in the differentiated arguments, e.g. ``[0]['dense']['kernel']``.
      shape: Its shape.
      rule: ``dense``, ``conv`` or ``embedding`` (from the activations and output
        cotangents of its one site, never forming its gradient), ``direct`` (its own
        per-example gradient, a chunk of examples at a time), ``unused`` (no gradient),
        or ``per-example`` (the whole per-example gradient is formed: not the ghost
        method).
      sites: The primitives where the leaf meets the data.
      flops: Per-example flops (or entries, for ``direct``) of its norm.
      form: For ``dense``, ``conv`` and ``embedding``: ``gram`` (from the Gram matrices
        of the rows, with an error bound checked per example; an example that fails it
        is recomputed by the product form, in the compiled loop), ``product`` (the
        product of the rows, the leaf's gradient one example at a time) or ``rows`` (one
        row per example: the product of two norms). Empty for the other rules.

    >>> LeafRule("['w']", (3, 2), "dense", ("dot_general",), 12).rule
    'dense'
    """

    path: str
    shape: tuple[int, ...]
    rule: str
    sites: tuple[str, ...]
    flops: int
    form: str = ""


@dataclasses.dataclass(frozen=True)
class StatisticRule:
    """How one output leaf of ``transform_fn`` (or ``metrics_fn``) is computed by the
    statistics method.

    Attributes:
      path: The output leaf, e.g. ``transform_fn[1]['kernel']``.
      form: ``linear`` (from the clipped sum: the leaf is linear in the gradient),
        ``factorised`` (one product of the site's rows, as the gradient's own, for a
        multiplicative function at a dense site with one row per example), ``direct``
        (the parameter leaf's own per-example gradient, a chunk of examples at a time)
        or ``constant`` (it reads no gradient).
      leaf: The parameter leaf it reads, for ``factorised`` and ``direct``; else empty.
      why: Why it takes this form, in words.

    >>> StatisticRule("transform_fn[1]['w']", "factorised", "['w']", "").form
    'factorised'
    """

    path: str
    form: str
    leaf: str
    why: str


@dataclasses.dataclass(frozen=True)
class ClippingReport:
    """What ``micro_grad`` does for one call: its method, and each leaf's rule.

    Attributes:
      method: ``ghost`` (norms from the traced program, clipped sum by book-keeping),
        ``two_pass`` (ghost norms, then the gradient of the loss weighted by the clip
        factors), ``chunked`` (per-example gradients a chunk at a time for the norms,
        then that weighted gradient), ``materialize`` (per-example gradients, scaled and
        summed), ``plain`` (no clipping and no norms: one gradient of the summed loss)
        or ``statistics`` (a ``transform_fn`` read off its traced program, each output
        leaf summed from the layers' activations and output cotangents, as
        ``statistics`` says).
      reason: Why, in words.
      leaves: One ``LeafRule`` per parameter leaf.
      statistics: For ``statistics``, one ``StatisticRule`` per output leaf of
        ``transform_fn`` (then of a linear ``metrics_fn``); else empty.
      predicted: The cost model's per-example cost, in flops, of each method it
        compared for this call (``ghost`` or ``statistics`` against ``materialize``),
        by name: what ``clip_method='auto'`` chooses by, and what a benchmark can hold
        against the measured times (``benchmarks/clipping.py`` does). Empty where no
        costs were compared.

    >>> report = ClippingReport("plain", "nothing to clip", ())
    >>> report.coverage()
    {}
    """

    method: str
    reason: str
    leaves: tuple[LeafRule, ...]
    statistics: tuple[StatisticRule, ...] = ()
    predicted: dict[str, int] = dataclasses.field(default_factory=dict)

    def coverage(self) -> dict[str, float]:
        """The fraction of the parameters' entries (their count, not their bytes) that
        each rule covers, as the second line of ``str(report)`` shows it."""
        total = sum(math.prod(leaf.shape) for leaf in self.leaves)
        out: dict[str, float] = {}
        for leaf in self.leaves:
            out[leaf.rule] = out.get(leaf.rule, 0.0) + math.prod(leaf.shape) / max(total, 1)
        return out

    def __str__(self) -> str:
        head = f"method: {self.method} ({self.reason})"
        share = ", ".join(f"{rule} {100 * f:.1f}%" for rule, f in self.coverage().items())
        rows = [
            f"  {_shown(leaf.path):<40} {leaf.shape!s:<16} {leaf.rule:<10} "
            f"{leaf.form:<8} "
            f"{'+'.join(leaf.sites)}"
            for leaf in self.leaves
        ]
        forms = [
            f"  {s.path:<40} {s.form:<10} {_shown(s.leaf) if s.form in READS_A_LEAF else '':<24} "
            f"{s.why}"
            for s in self.statistics
        ]
        return "\n".join([head, f"coverage of parameters: {share}", *rows, *forms])


READS_A_LEAF = ("factorised", "direct")
"""The forms of a ``StatisticRule`` that read one parameter leaf (its ``leaf``)."""


def _shown(path: str) -> str:
    """A parameter leaf's path in the report's table: ``(one array)`` for a gradient that
    is one array, whose path is empty."""
    return path or "(one array)"


def clipping_report(grad_fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> ClippingReport:
    """Says how a ``micro_grad`` function computes a call, without running it.

    The call is traced on the arguments' shapes (arrays or ``jax.ShapeDtypeStruct``):
    which method computes the clipped sum and the norms, and by which rule each
    parameter leaf's per-example norm comes.

    Args:
      grad_fn: A function returned by ``micro_grad``.
      *args: Its positional arguments, as for a call.
      **kwargs: Its keyword arguments, as for a call.

    Returns:
      A ``ClippingReport``; ``print`` it for a table.

    Raises:
      TypeError: If ``grad_fn`` was not made by ``micro_grad``.

    >>> import jax.numpy as jnp
    >>> import microbatching
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w["kernel"] + w["bias"]))
    >>> grad_fn = microbatching.micro_grad(loss, keep_batch_dim=False, l2_clip_norm=1.0)
    >>> params = {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}
    >>> report = microbatching.clipping_report(grad_fn, params, jnp.ones((8, 3)))
    >>> report.method
    'ghost'
    >>> [(leaf.path, leaf.rule) for leaf in report.leaves]
    [("['bias']", 'direct'), ("['kernel']", 'dense')]
    """
    options = getattr(grad_fn, OPTIONS, None)
    describe = getattr(options, "describe", None)
    if describe is None:
        raise TypeError(
            f"clipping_report needs a function returned by micro_grad, got {grad_fn!r}; "
            "pass the function micro_grad(loss, ...) returned (or jax.jit of it), not a "
            "function that calls it."
        )
    jax.eval_shape(grad_fn, *args, **kwargs)  # the call's own errors, first
    found: list[ClippingReport] = []
    kwargs, weights = split_weights(kwargs)

    def trace(args: Any, kwargs: Any, weights: Any) -> int:
        found.append(describe(args, kwargs, weights))
        return 0

    jax.eval_shape(trace, args, kwargs, weights)
    return found[0]
