"""How ``micro_grad`` computes a microbatch's summed gradient: the methods, and the plan
that picks one for each call.

``micro_grad``'s options are normalised once, when the user wraps ``fun``
(``GradRequest``). Each call then gets one ``GradPlan``, built before the loop from the
shapes of the call: which ``Method`` computes the summed (clipped) gradient and why, the
rule of each parameter leaf's norm, whether a plain gradient may be seeded by the mean's
``1 / rows`` (where it is exactly the sum of the per-example gradients), and the call's
sharded layout. The loop's body
only runs the planned method's step; ``clipping_report`` prints the same plan.

A method is one object (a subclass of ``Method``) that owns its wrap-time check, its plan
when asked for by name (which raises, with the fix, where it cannot compute the call) and
its step, ``step(sums, seed, weights, args, kwargs) -> (summed gradient, Aux)``. ``plan``
asks the method named by ``clip_method``, or ``_auto`` picks one. A new method is one
subclass and one entry of ``METHODS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import (
    _accumulators,
    _batch_statistics,
    _checks,
    _clipping,
    _fsdp,
    _ghost,
    _layout,
    _per_example,
    _scaled,
    _statistics,
)
from ._inspect import ClippingReport, LeafRule, StatisticRule
from ._per_example import Aux, Examples, Sums
from ._typing import PyTree, PyTreeFn
from ._wrap import Settings

Step = Callable[[Sums, Any, Any, tuple[Any, ...], dict[str, Any]], tuple[PyTree, Aux]]
"""``step(sums, seed, weights, args, kwargs)``: a microbatch's summed gradient and its
``Aux``. ``seed`` is None, or the mean's ``1 / rows`` that seeds the backward pass (only
where the plan found the gradient of the summed loss exact); ``weights`` the
microbatch's ``example_weights``, or None."""


class Method:
    """One way to compute a microbatch's summed gradient, its clipping and its norms: the
    object owns its wrap-time check (``refusal``), its plan when asked for by name
    (``plan``, which says why it declines a call), and its ``step``. ``auto``'s choice
    among them is ``_auto``; a new method is one more subclass and its entry in
    ``METHODS`` (and, where users may ask for it, in ``_typing.ClipMethod``).

    Attributes:
      name: As ``clip_method`` names it and ``clipping_report`` shows it.
      scales_loss: Whether it takes the gradient of the loss weighted by one clip factor
        per example: exact only where ``_per_example.summed_differs`` says so, with one
        bound for the whole gradient, and NaN for an example whose loss is not finite.
      forms_gradients: Whether it forms each example's gradient, which a ``metrics_fn``
        that reads more than their norms needs.
      ghost_norms: Whether its norms are the ghost norms read off the traced program;
        else they are those of the per-example gradients (``kept`` reads the same ones).
      sums_only: Whether it computes the (clipped) sum and nothing else, so that a
        ``transform_fn`` or an accumulator that needs more refuses it.
    """

    name: str = ""
    scales_loss: bool = False
    forms_gradients: bool = False
    ghost_norms: bool = False
    sums_only: bool = True

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        """``Step``: a microbatch's summed gradient and its ``Aux``."""
        raise NotImplementedError

    def plan(self, call: Call) -> GradPlan:
        """The plan of ``call`` where it asks for this method by name (a summed call with
        clipping or norms); raises a ValueError naming the fix where the method cannot
        compute it."""
        raise NotImplementedError

    def check(self, request: GradRequest) -> None:
        """Wrap-time: raises a ValueError naming the fix where this method, asked for by
        name, cannot compute ``request``."""
        why = self.refusal(request)
        if why is not None:
            raise ValueError(why)

    def refusal(self, request: GradRequest) -> str | None:
        """``check``'s message, or None."""
        name, clipping = self.name, request.clipping
        if self.scales_loss and clipping and len(jax.tree.leaves(clipping.bound)) > 1:
            return (
                f"micro_grad was given clip_method={name!r}, which scales each example's "
                "loss by one factor, and a pytree l2_clip_norm, which needs one factor per "
                "subtree; pass clip_method='ghost', 'materialize' or 'auto'."
            )
        if self.scales_loss and clipping and clipping.nan_safe:
            return (
                f"micro_grad was given clip_method={name!r} and nan_safe=True, but "
                f"{name!r} takes the gradient of the losses weighted by the clip factors, "
                "and an example whose loss is not finite makes that gradient NaN even at "
                "factor 0; pass clip_method='auto', 'ghost' or 'materialize', which drop it."
            )
        if not self.forms_gradients and request.gradient_metrics:
            return (
                f"micro_grad was given clip_method={name!r} and "
                f"metrics_fn={_checks.function_name(request.metrics)}, which needs each example's "
                "gradient; the "
                f"{name} method never forms them. Pass metrics_fn=microbatching.l2_norm "
                "for the per-example norms, or clip_method='auto'."
            )
        if self.sums_only and not request.summed:
            # Only a transform_fn in the way: the statistics method may read it.
            readable = "" if request.unsummable else ", 'statistics'"
            return (
                f"micro_grad was given clip_method={name!r}, which computes the sum of "
                "the clipped gradients and nothing else, but more than their sum is needed "
                f"for {_joined(request.unsummed)}; pass clip_method='auto'{readable} or "
                f"'materialize', or {_joined(_fixes(request, True))}."
            )
        unclipped = clipping is None and request.metrics is _per_example.no_metrics
        if self.sums_only and unclipped:
            return (
                f"micro_grad was given clip_method={name!r}, which says how the clipped "
                "sum and the per-example norms are computed, but neither l2_clip_norm nor "
                "metrics_fn=microbatching.l2_norm, so nothing would be clipped: the call "
                "would return the plain, unclipped sum. Pass l2_clip_norm (or "
                "metrics_fn=microbatching.l2_norm), or leave clip_method='auto'."
            )
        return None


class Plain(Method):
    """No clipping and no metrics: one gradient of the (weighted) summed loss. ``auto``
    takes it where that gradient is exact; it cannot be asked for by name."""

    name, scales_loss = "plain", True

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        return _per_example.weighted_gradient(sums, None, None, seed, weights, args, kwargs)


class Ghost(Method):
    """Norms read off the traced program, the clipped sum by book-keeping (``_ghost``)."""

    name, ghost_norms = "ghost", True

    def plan(self, call: Call) -> GradPlan:
        program = call.program()
        if isinstance(program, str):
            raise ValueError(_NO_GHOST.format(method=self.name, reason=program))
        return call.ghost_plan(self, _ASKED, program)

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        out = _per_example.ghost(sums, weights, args, kwargs)
        if isinstance(out, str):  # the plan read the same program before the loop
            raise RuntimeError(f"micro_grad planned the ghost norms, but in the loop {out}.")
        return out


class TwoPass(Ghost):
    """Ghost norms, then the gradient of the loss weighted by the clip factors."""

    name, scales_loss = "two_pass", True

    def plan(self, call: Call) -> GradPlan:
        call.need_exact(self)
        return super().plan(call)

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        norms = _per_example.ghost_norms(sums, args, kwargs)
        if isinstance(norms, str):
            raise RuntimeError(f"micro_grad planned the ghost norms, but in the loop {norms}.")
        factors = None
        if sums.clipping is not None:
            params = [args[i] for i in sums.example.nums()]
            factors = sums.clipping.per_leaf(norms, params)[0]
        measured = sums.of_norms(norms)
        return _per_example.weighted_gradient(sums, measured, factors, seed, weights, args, kwargs)


class Chunked(Method):
    """Per-example gradients a chunk of rows at a time for the norms (and metrics), then
    the gradient of the loss weighted by the clip factors."""

    name, scales_loss, forms_gradients = "chunked", True, True

    def plan(self, call: Call) -> GradPlan:
        call.need_exact(self)
        return call.each(self, "per-example", _ASKED)

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        measured, factors = _per_example.statistics_in_chunks(sums, args, kwargs)
        return _per_example.weighted_gradient(sums, measured, factors, seed, weights, args, kwargs)


class Materialize(Method):
    """Per-example gradients, scaled and summed in the accumulation dtype: exact for any
    call, the path every other method declines to."""

    name, forms_gradients, sums_only = "materialize", True, False

    def plan(self, call: Call) -> GradPlan:
        return call.each(self, "per-example", _ASKED)

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        return _per_example.explicit(sums, weights, args, kwargs)


class Statistics(Method):
    """A ``transform_fn`` read off its traced program: each output leaf's sum from the
    sites of the ghost engine, by the form ``_statistics`` gives it, without the
    per-example gradients of the model."""

    name, ghost_norms = "statistics", True

    def refusal(self, request: GradRequest) -> str | None:
        if _accumulators.is_linear(request.accumulators) and not request.batched_grad:
            return None
        return (
            "micro_grad was given clip_method='statistics', which sums the "
            "transformed gradients from the layers' activations and cotangents, "
            "but each example's gradient is needed for "
            f"{_joined(request.unsummable)}; {_joined(_fixes(request, False))}, or "
            "pass clip_method='auto'."
        )

    def plan(self, call: Call) -> GradPlan:
        found = _statistics_plan(call.request, call.args, call.kwargs, call.layout, call.sharded)
        if isinstance(found, Declined):
            raise ValueError(_NO_STATISTICS.format(reason=found.reason))
        return found

    def step(self, sums: Sums, seed: Any, weights: Any, args: Any, kwargs: Any) -> Any:
        out = _per_example.statistics(sums, weights, args, kwargs)
        if isinstance(out, str):  # the plan read the same program before the loop
            raise RuntimeError(f"micro_grad planned the statistics, but in the loop {out}.")
        return out


PLAIN, GHOST, TWO_PASS = Plain(), Ghost(), TwoPass()
CHUNKED, MATERIALIZE, STATISTICS = Chunked(), Materialize(), Statistics()

METHODS: dict[str, Method] = {
    m.name: m for m in (PLAIN, GHOST, TWO_PASS, CHUNKED, MATERIALIZE, STATISTICS)
}
"""Every method, by name; ``clip_method`` names all but ``plain`` (and ``"auto"``)."""

ASKED_BY_NAME: tuple[str, ...] = tuple(name for name in METHODS if name != "plain")
"""The methods ``clip_method`` may name, beside ``"auto"`` (``_typing.ClipMethod``)."""


@dataclasses.dataclass(frozen=True)
class GradRequest:
    """``micro_grad``'s options, normalised once when the user wraps ``fun``.

    Attributes:
      example: One example's loss and gradient.
      clipping: The clipping options, or None.
      transform: ``transform_fn``.
      metrics: ``metrics_fn``.
      accumulators: The accumulator tree.
      method: ``clip_method`` as asked (``"auto"`` or a key of ``METHODS``).
      settings: How the loop runs.
      trade: ``gather_params`` and ``reduce_gradients``.
      param_specs: ``param_specs``, checked.
    """

    example: Examples
    clipping: _clipping.Clipping | None
    transform: PyTreeFn
    metrics: PyTreeFn
    accumulators: Any
    method: str
    settings: Settings
    trade: _fsdp.Trade
    param_specs: Any

    @property
    def batched_grad(self) -> bool:
        """Whether a differentiated argument is also a batch argument."""
        return any(self.example.axes.spec(i) is not None for i in self.example.nums())

    @property
    def per_example_reason(self) -> str | None:
        """What needs each example's own gradient (clipping, a ``transform_fn``, a
        ``metrics_fn``, an accumulator other than SUM, MEAN and RUNNING_MEAN), in words;
        None where only their (weighted) sum is asked."""
        if self.clipping is not None:
            return "l2_clip_norm"
        if self.transform is not _per_example.identity:
            return "a transform_fn"
        if self.metrics is not _per_example.no_metrics:
            return "a metrics_fn"
        for kind in _accumulators.kinds(self.accumulators):
            if not isinstance(kind, _accumulators.AccumulationType):
                return "a custom Accumulator"
            if not _accumulators.KINDS[kind].linear:
                return f"accumulator={kind.name}"
        return None

    def weights_reason(self, method: Method) -> str | None:
        """Where ``example_weights`` differ between devices over which JAX's derivative
        sums each example's gradient (inside ``shard_map``: ``_per_example.Unvarying``),
        what of this call would mix one device's weights with the devices' summed
        gradients, in words; None where the result is ``jax.grad``'s of the weighted loss
        there.

        A method that weights the loss before the derivative (``Method.scales_loss``: the
        plain gradient) gives ``jax.grad``'s sum; the others weight each example's
        gradient after it, and the means divide the summed gradients by one device's
        weights.
        """
        for kind in _accumulators.kinds(self.accumulators):
            built_in = isinstance(kind, _accumulators.AccumulationType)
            if built_in and _accumulators.KINDS[kind].rows == "mean":
                return f"example_weights and accumulator={kind.name}"
        if not method.scales_loss:
            return f"example_weights on each example's gradient (the {method.name} method)"
        return None

    @property
    def summed(self) -> bool:
        """Whether the accumulated result is a (weighted) sum of the clipped gradients:
        the identity transform, linear accumulators, no batched argnums."""
        return not self.unsummed

    @property
    def unsummed(self) -> list[str]:
        """What of the call needs more than the (weighted) sum of the gradients, in
        words for a message: a ``transform_fn`` (any function given: it is not read at
        wrap time), an accumulator other than SUM, MEAN and RUNNING_MEAN, and
        differentiated arguments that are also batch arguments."""
        found = []
        if self.transform is not _per_example.identity:
            found.append(f"transform_fn={_checks.function_name(self.transform)}")
        return found + self.unsummable

    @property
    def unsummable(self) -> list[str]:
        """``unsummed`` but the ``transform_fn``: what the statistics method cannot sum."""
        found = []
        for kind in _accumulators.kinds(self.accumulators):
            if not isinstance(kind, _accumulators.AccumulationType):
                said = "a custom Accumulator"
            elif not _accumulators.KINDS[kind].linear:
                said = f"accumulator={kind.name}"
            else:
                continue
            if said not in found:
                found.append(said)
        batched = [i for i in self.example.nums() if self.example.axes.spec(i) is not None]
        if batched:
            labels = _joined([self.example.axes.label(i) for i in batched])
            plural = "s" if len(batched) > 1 else ""
            found.append(f"the differentiated batch argument{plural} {labels}")
        return found

    @property
    def asked(self) -> Method | None:
        """The method ``clip_method`` names, or None for ``"auto"``."""
        return None if self.method == "auto" else METHODS[self.method]

    @property
    def reads_statistics(self) -> bool:
        """Whether a call may take the statistics method: linear accumulators, no
        batched argnums, and ``clip_method`` left to ``auto``."""
        linear = _accumulators.is_linear(self.accumulators)
        return linear and not self.batched_grad and self.asked in (None, STATISTICS)

    @property
    def gradient_metrics(self) -> bool:
        """Whether ``metrics_fn`` may need each example's gradient: not ``l2_norm``, nor
        a function of the norms already read (``_scaled.NormsMetric``)."""
        known = (_per_example.no_metrics, _per_example.l2_norm)
        return self.metrics not in known and not isinstance(self.metrics, _scaled.NormsMetric)

    def sums(self, settings: Settings | None = None) -> Sums:
        """What the summed path's steps read, for ``settings`` (default: the call's)."""
        metrics = None if self.metrics is _per_example.no_metrics else self.metrics
        requested = (settings or self.settings).accumulation_dtype
        return Sums(self.example, self.clipping, metrics, requested)

    @property
    def gathers_for_norms(self) -> bool:
        """Whether the norms may be read off the program (``auto``, ``ghost``,
        ``two_pass``), which reads every parameter on every shard of the batch."""
        wanted = self.clipping is not None or _per_example.norms_only(self.metrics)
        return self.summed and wanted and (self.asked is None or isinstance(self.asked, Ghost))

    def check(self) -> None:
        """Wrap-time: raises where the method asked for cannot compute the request."""
        if self.asked is not None:
            self.asked.check(self)


@dataclasses.dataclass(frozen=True)
class GradPlan:
    """How one call computes its result, decided once before the loop.

    Attributes:
      method: The resolved method (``materialize`` for the per-example path).
      reason: Why, in words.
      leaves: How each parameter leaf's per-example norm is computed.
      summed: Whether the summed path runs (else ``per_example``: a ``transform_fn`` or
        a custom accumulator).
      layout: The call's sharded layout (``_fsdp.layout``), or None.
      reading: For ``statistics``, the reading of ``transform_fn`` and ``metrics_fn``.
      predicted: The cost model's per-example flops of each method compared, by name
        (``ClippingReport.predicted``).
      clipping: The clipping the step takes in place of the call's ``l2_clip_norm``: a
        ``transform_fn`` read as a scaling by a function of the norms (``_scaled``).
      metrics: The ``metrics_fn`` the step takes in place of the call's: one read as a
        function of the norms (``_scaled.NormsMetric``), or None.
    """

    method: Method
    reason: str
    leaves: tuple[LeafRule, ...]
    summed: bool = True
    layout: _fsdp.Layout | None = None
    reading: _statistics.Reading | None = None
    predicted: tuple[tuple[str, int], ...] = ()
    clipping: _clipping.Clipping | None = None
    metrics: _scaled.NormsMetric | None = None

    def report(self) -> ClippingReport:
        """The plan as ``clipping_report`` shows it."""
        statistics: tuple[StatisticRule, ...] = ()
        if self.reading is not None:
            paths = [leaf.path for leaf in self.leaves]
            statistics = tuple(
                StatisticRule(
                    f"transform_fn{s.path}",
                    s.form,
                    "" if s.leaf is None else paths[s.leaf],
                    s.why,
                )
                for s in self.reading.outputs
            ) + tuple(
                StatisticRule(f"metrics_fn{s.path}", s.form, "", s.why)
                for s in self.reading.metric_outputs
            )
        return ClippingReport(
            self.method.name, self.reason, self.leaves, statistics, dict(self.predicted)
        )

    def seeds(self, accumulators: Any, weighted: bool) -> bool:
        """Whether a step with ``accumulators`` seeds the backward pass with the mean's
        ``1 / rows``: a plain gradient that is exact, averaged by rows, without weights."""
        # ``plain`` is planned only where the summed loss's gradient is exact, scaled
        # by one factor per example or not (``_per_example.summed_differs``).
        plain = self.method is PLAIN and not weighted
        return plain and _accumulators.averages_rows(accumulators)


class Call:
    """One summed call being planned: the request, its arguments, and what the plan reads
    of the loss, each read at most once (``exact`` traces the summed loss's program,
    ``program`` reads the ghost engine's)."""

    def __init__(
        self,
        request: GradRequest,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        layout: _fsdp.Layout | None,
        sharded: bool,
    ) -> None:
        self.request, self.args, self.kwargs = request, args, kwargs
        self.layout, self.sharded = layout, sharded
        self.sums = request.sums()
        self._differs: _per_example.Differs | None = None
        self._program: _ghost.Program | str | None = None

    def why_not_exact(self) -> str | None:
        """Why one gradient of the summed loss is not the sum of the per-example
        gradients here, in words; None where it is."""
        if self._differs is None:
            self._differs = _per_example.summed_differs(self.sums, self.args, self.kwargs)
        return self._differs.why()

    def exact(self) -> bool:
        return self.why_not_exact() is None

    def need_exact(self, method: Method) -> None:
        """Raises where ``method``, which differentiates the factor-weighted loss, would
        not be exact."""
        if not self.exact():
            why = self.why_not_exact()
            raise ValueError(_NOT_LINEAR.format(method=method.name, reason=why))

    def program(self) -> _ghost.Program | str:
        """The loss's program as the ghost engine reads it, or why it does not."""
        if self._program is None:
            self._program = _per_example.read_program(self.sums, self.args, self.kwargs)
        return self._program

    def each(
        self,
        method: Method,
        rule: str,
        why: str,
        predicted: tuple[tuple[str, int], ...] = (),
    ) -> GradPlan:
        """The plan of ``method``, every leaf's norm by ``rule``."""
        paths = _per_example.leaf_paths(self.request.example, self.args)
        params = jax.tree.leaves([self.args[i] for i in self.request.example.nums()])
        leaves = tuple(
            LeafRule(path, tuple(jnp.shape(p)), rule, (), 0)
            for path, p in zip(paths, params, strict=True)
        )
        summed = self.request.summed
        return GradPlan(method, why, leaves, summed, self.layout, predicted=predicted)

    def ghost_plan(self, method: Method, why: str, program: _ghost.Program) -> GradPlan:
        """The plan of ``method`` (``ghost`` or ``two_pass``) with each leaf's rule from
        ``program``, and the costs ``auto`` compares."""
        ghost, per_example = _ghost.ghost_cost(program), _ghost.materialize_cost(program)
        costs = (
            f"{ghost:,} flops of norms per example against {per_example:,} for per-example "
            "gradients"
        )
        predicted = (("ghost", ghost), ("materialize", per_example))
        leaves = _rules_of(self, program)
        return GradPlan(method, f"{why}: {costs}", leaves, layout=self.layout, predicted=predicted)


def _rules_of(call: Call, program: _ghost.Program) -> tuple[LeafRule, ...]:
    paths = _per_example.leaf_paths(call.request.example, call.args)
    return tuple(
        LeafRule(path, tuple(program.avals[leaf].shape), r.name, r.primitives, r.flops, r.form)
        for leaf, (path, r) in enumerate(zip(paths, program.rules, strict=True))
    )


_ASKED = "asked for"
_CHEAPER = "forming the per-example gradients costs less"
_NO_GHOST = (
    "micro_grad was given clip_method={method!r}, but the ghost norms cannot read this "
    "loss: {reason}. Pass clip_method='auto' to let micro_grad pick an exact method."
)
_NOT_LINEAR = (
    "micro_grad was given clip_method={method!r}, which takes the gradient of the loss "
    "weighted by the clip factors, but that gradient is not exactly the weighted sum of "
    "the per-example gradients here: {reason}. Pass clip_method='auto' to let micro_grad "
    "pick an exact method, or 'materialize'."
)


def plan(
    request: GradRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: _fsdp.Layout | None = None,
    sharded: bool = False,
) -> GradPlan:
    """The plan of one call with positional ``args`` and ``kwargs`` (no weights), whose
    batch is split over a mesh where ``sharded``; raises where the method asked for
    cannot compute it. Whether the examples are weighted does not change it: one
    gradient of the summed loss is exact for weights where it is exact at all
    (``_per_example.summed_differs``).

    In this order: an empty batch or a missing argument (materialize, which says what is
    missing); a ``metrics_fn`` read as a function of the norms (``auto``); a call that
    needs more than the sum (``_per_example_plan``); the method asked for by name
    (``Method.plan``); else ``auto``'s choice (``_auto``).
    """
    call = Call(request, args, kwargs, layout, sharded)
    if any(i >= len(args) for i in request.example.nums()):  # the loop says what is missing
        return GradPlan(MATERIALIZE, "a differentiated argument is missing", (), request.summed)
    if request.example.keep_batch_dim:
        _warn_if_rows_mix(request.example, args, kwargs)
    first = _per_example.find_batched(request.example.axes, args, kwargs)
    if first is None or not first.shape[0]:
        return call.each(MATERIALIZE, "per-example", "the batch is empty")
    unread = None
    if request.gradient_metrics and request.asked is None:
        measured = _norms_metric(request, args, layout, sharded)
        if isinstance(measured, _scaled.NormsMetric):
            inner = dataclasses.replace(request, metrics=measured)
            found = plan(inner, args, kwargs, layout, sharded)
            if found.method.forms_gradients:
                return found
            read = "metrics_fn read as a function of the norms (its code runs on them)"
            return dataclasses.replace(found, metrics=measured, reason=f"{read}; {found.reason}")
        unread = measured
    if not request.summed:
        return _per_example_plan(request, args, kwargs, layout, sharded, call.each)
    if request.asked is not None:
        return request.asked.plan(call)
    return _auto(call, unread)


def _auto(call: Call, unread: str | None) -> GradPlan:
    """``auto``'s method for a summed call: nothing per example (the plain gradient,
    where exact); a ``metrics_fn`` that needs the gradients (the statistics method where
    it reads it, else forming them); the ghost norms where they read the loss and cost
    less than forming the gradients; else forming them (``_forming``)."""
    request = call.request
    if request.clipping is None and call.sums.metrics is None:
        if call.exact():
            return call.each(PLAIN, "unused", "no clipping and no norms")
        why = f"not one gradient per microbatch: {call.why_not_exact()}"
        return call.each(MATERIALIZE, "per-example", why)
    if request.gradient_metrics:
        found = _statistics_plan(request, call.args, call.kwargs, call.layout, call.sharded)
        if not isinstance(found, Declined):
            return found
        why = (
            "metrics_fn needs each example's gradient (metrics_fn=microbatching.l2_norm "
            "gives the norms without them)"
        )
        if unread is not None:
            why += f": {unread}"
        return call.each(_forming(call), "per-example", why)
    program = call.program()
    if isinstance(program, str):
        return call.each(_forming(call), "per-example", program)
    if _ghost.materialize_cost(program) < _ghost.ghost_cost(program):
        return call.ghost_plan(MATERIALIZE, _CHEAPER, program)
    return call.ghost_plan(GHOST, "the ghost norms read this loss", program)


def _norms_metric(
    request: GradRequest, args: tuple[Any, ...], layout: _fsdp.Layout | None, sharded: bool
) -> _scaled.NormsMetric | str:
    """``metrics_fn`` read as a function of each example's norms, or why not."""
    if sharded or layout is not None:
        return "the batch is split over a mesh, where the per-example path is kept for now"
    grads = _per_example.gradient_shapes(request.example, args)
    return _scaled.read_metric(request.metrics, grads)


def _forming(call: Call) -> Method:
    """``auto``'s method where the per-example gradients must be formed: ``chunked`` (a
    chunk of examples at a time) where the summed loss's gradient is exact and nothing
    is clipped, else ``materialize``. Clipped, ``chunked`` differentiates the
    factor-weighted loss: one factor for the whole gradient (no per-layer bounds), no
    ``nan_safe``, and cotangents that a small factor can flush below ``tiny``, which
    ``materialize`` (each gradient formed, then clipped) bounds."""
    return CHUNKED if call.request.clipping is None and call.exact() else MATERIALIZE


_NO_STATISTICS = (
    "micro_grad was given clip_method='statistics', but it cannot compute this call "
    "without the per-example gradients: {reason}. Pass clip_method='auto' to let "
    "micro_grad pick an exact method."
)


def _joined(items: list[str]) -> str:
    """``items`` as a sentence lists them: ``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _fixes(request: GradRequest, transform: bool) -> list[str]:
    """What the user can change for each of ``request.unsummed`` (without the
    ``transform_fn`` unless ``transform``), as the end of "or ...": the fixes that apply."""
    fixes = []
    if transform and request.transform is not _per_example.identity:
        fixes.append(
            "drop transform_fn (any function given counts, even one that returns the gradient)"
        )
    if not _accumulators.is_linear(request.accumulators):
        fixes.append("use SUM or MEAN")
    if request.batched_grad:
        fixes.append("leave the differentiated arguments out of batch_argnums")
    return fixes


def _per_example_why(request: GradRequest) -> str:
    return f"each example's gradient is needed for {_joined(request.unsummed)}"


def _per_example_plan(
    request: GradRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: _fsdp.Layout | None,
    sharded: bool,
    each: Callable[..., GradPlan],
) -> GradPlan:
    """The plan of a call with a ``transform_fn`` or accumulators other than SUM and
    MEAN: the statistics method where it can read ``transform_fn`` and ``metrics_fn``,
    else the per-example gradients (materialize), with why."""
    if not request.reads_statistics:
        why = _ASKED if request.asked is MATERIALIZE else _per_example_why(request)
        return each(MATERIALIZE, "per-example", why)
    scaled = _scaled_plan(request, args, kwargs, layout, sharded)
    if isinstance(scaled, GradPlan):
        return scaled
    found = _statistics_plan(request, args, kwargs, layout, sharded)
    if isinstance(found, Declined):
        if request.asked is STATISTICS:
            raise ValueError(_NO_STATISTICS.format(reason=found.reason))
        why = f"{_per_example_why(request)}: {found.reason}"
        if scaled is not None:
            why += f"; and it is not the gradient scaled by a function of its norms: {scaled}"
        return each(MATERIALIZE, "per-example", why, found.predicted)
    return found


def _scaled_plan(
    request: GradRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: _fsdp.Layout | None,
    sharded: bool,
) -> GradPlan | str | None:
    """Where ``transform_fn`` scales each example's gradient by a function of its norms
    (``_scaled``), the plan of the same call with that scaling as its clipping and the
    rest of the transform as its ``transform_fn``: ``l2_clip_norm``'s, with the user's
    factors. Else why not (None: it reads no norm). ``auto`` only: a method asked for by
    name keeps its meaning."""
    if request.asked is not None:
        return None
    if sharded or layout is not None:
        # Exact either way; on a split batch the per-example path reduces the gradients
        # across devices once per microbatch, the summed path's steps more often.
        return "the batch is split over a mesh, where the per-example path is kept for now"
    grads = _per_example.gradient_shapes(request.example, args)
    scaled = _scaled.read(request.transform, grads)
    if not isinstance(scaled, _scaled.Scaled):
        return scaled
    scaling = _scaled.Scaling.of(scaled, request.clipping, grads)
    rest = _per_example.identity if scaled.plain else scaled.rest
    inner = dataclasses.replace(request, clipping=scaling, transform=rest)
    found = plan(inner, args, kwargs, layout, sharded)
    if not found.summed:
        return found.reason
    # The rest may itself scale what it is given (``c / ||c||`` of a clipped ``c``):
    # its plan then holds that scaling, composed with this one.
    twice = (
        " (l2_clip_norm clips each example's gradient before transform_fn sees it: a "
        "clip in transform_fn clips it again)"
        if request.clipping is not None
        else ""
    )
    return dataclasses.replace(
        found,
        clipping=found.clipping or scaling,
        reason=f"transform_fn {scaled.described}{twice}; {found.reason}",
    )


class Declined(NamedTuple):
    """Why the statistics method does not compute a call, and the costs compared where
    that is the reason (``GradPlan.predicted``)."""

    reason: str
    predicted: tuple[tuple[str, int], ...] = ()


def _statistics_plan(
    request: GradRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: _fsdp.Layout | None,
    sharded: bool,
) -> GradPlan | Declined:
    """The statistics method's plan where it reads ``transform_fn`` and ``metrics_fn``
    (``_statistics.read``) and the ghost engine reads the loss; else why not
    (``Declined``). The batch is not empty."""
    if sharded or layout is not None:
        return Declined(
            "the batch is split over a mesh, and the statistics method does not lay its "
            "sums out per shard yet"
        )
    sums = request.sums()
    program = _per_example.read_program(sums, args, kwargs)
    if isinstance(program, str):
        return Declined(program)
    grads = _per_example.gradient_shapes(request.example, args)
    norms = sums.norms_only
    reading = _statistics.read(
        request.transform,
        sums.metrics,
        norms,
        grads,
        program.rules,
        program.sites,
        clipped=request.clipping is not None,
    )
    if isinstance(reading, str):
        return Declined(reading)
    paths = _per_example.leaf_paths(request.example, args)
    leaves = tuple(
        LeafRule(path, tuple(program.avals[leaf].shape), r.name, r.primitives, r.flops, r.form)
        for leaf, (path, r) in enumerate(zip(paths, program.rules, strict=True))
    )
    counts: dict[str, int] = {}
    for s in reading.outputs + reading.metric_outputs:
        counts[s.form] = counts.get(s.form, 0) + 1
    forms = ", ".join(f"{n} {form}" for form, n in counts.items())
    read = [
        name
        for name, given in (
            ("transform_fn", request.transform is not _per_example.identity),
            ("metrics_fn", bool(reading.metric_outputs)),
        )
        if given
    ]
    what = " and ".join(read) if read else ("the clipped sum" if request.clipping else "the sum")
    why = f"{what} read off the traced program, each output leaf from the sites: {forms}"
    predicted: tuple[tuple[str, int], ...] = ()
    if request.transform is not _per_example.identity:
        mine, theirs = _statistics.cost(reading, program), _statistics.materialize_cost(program)
        costs = f"{mine:,} flops per example against {theirs:,} for per-example gradients"
        predicted = (("statistics", mine), ("materialize", theirs))
        if request.asked is None and theirs < mine:
            return Declined(f"{_CHEAPER}: {costs}", predicted)
        why = f"{_ASKED if request.asked is STATISTICS else why}: {costs}"
    return GradPlan(
        STATISTICS, why, leaves, True, layout=layout, reading=reading, predicted=predicted
    )


_MIXES_ROWS = (
    "micro_grad gives the loss each example alone, as a batch of one row, and this loss "
    "computes a statistic over the batch axis and applies it back to the rows (first seen "
    "at the primitive `{primitive}`): a BatchNorm layer, a softmax over the examples, a rescaling "
    "of each row by a batch total. The statistic is then each example's own and the result "
    "differs from the whole batch's (a BatchNorm over dense features outputs its bias "
    "whatever the input). For per-example gradients and DP-SGD normalise each example on "
    "its own (GroupNorm, LayerNorm) or compute the statistic outside the loss (for DP, from "
    "public data only); for gradient accumulation with statistics per microbatch, take "
    "jax.grad of microbatch(loss) instead (docs/how-to/stateful-models.md)."
)


def _warn_if_rows_mix(example: Examples, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Warns (``BatchStatisticsWarning``) where the loss, as written for a batch, applies a
    statistic over its rows back to them."""
    split = _per_example.split_call(
        dataclasses.replace(example, keep_batch_dim=False), args, kwargs
    )
    if not split.data:
        return
    nums, axes = example.nums(), example.axes
    owners = [w for w in [*range(len(args)), *kwargs] if axes.spec(w) is not None and w not in nums]
    expanded = [  # as Examples.expand gives them a batch axis: the rest get one example
        axes.position(w) is not None
        for w in owners
        for _ in jax.tree.leaves(args[w] if isinstance(w, int) else kwargs[w])
    ]
    primitive = _batch_statistics.mixes_rows(split.fun, split.params, split.data, expanded)
    if primitive is not None:
        _checks.warn(
            _MIXES_ROWS.format(primitive=primitive), _batch_statistics.BatchStatisticsWarning
        )


def summed(request: GradRequest, accumulators: Any, settings: Settings) -> Callable[..., Any]:
    """``per_microbatch(plan, weights, *args, **kwargs)``: a microbatch's summed (or
    averaged) gradient and its per-example ``Aux``, by the plan's method.

    On a sharded batch each shard sums its own rows, and the partial sums stay open, one
    per shard, until the loop ends.
    """
    sums, axes = request.sums(settings), request.example.axes
    requested, mesh_axes = settings.accumulation_dtype, settings.mesh_axes

    def per_microbatch(plan: GradPlan, weights: Any, *args: Any, **kwargs: Any) -> Any:
        step = plan.method.step
        here = sums if plan.reading is None else dataclasses.replace(sums, reading=plan.reading)
        if plan.clipping is not None:
            here = dataclasses.replace(here, clipping=plan.clipping)
        if plan.metrics is not None:
            here = dataclasses.replace(here, metrics=plan.metrics)
        with jax.named_scope("micro_grad_step"):
            first = _per_example.first_batched(axes, args, kwargs)
            rows = first.shape[0]
            where = _layout.shards(first, 0, mesh_axes)
            if where is None:
                if plan.seeds(accumulators, weights is not None) and rows:
                    # The mean's 1/rows seeds the backward pass, rather than scaling its
                    # result: XLA then adds an embedding's scattered gradient into the
                    # carry in place, where a scaled one took a copy of the table and
                    # 2.5x the time.
                    grads, aux = step(here, 1 / rows, None, args, kwargs)
                    return _open_all(grads, requested, None), aux
                grads, aux = step(here, None, weights, args, kwargs)
                if weights is None:
                    grads = _accumulators.per_row(accumulators, grads, rows)
                return _open_all(grads, requested, None), aux

            on_shard = dataclasses.replace(here, by_shard=True)

            def local(w: Any, *a: Any, **k: Any) -> Any:
                return step(on_shard, None, w, a, k)

            grads, aux = _per_example.by_shard(local, axes, where, weights, args, kwargs)
            grads = _open_all(grads, requested, "sum", where)
            aux = jax.tree.map(lambda x: _layout.unchunk(x, where), aux)
            if weights is not None:  # weighted sums: the loop divides means by the weights
                return grads, aux
            return _accumulators.per_row(accumulators, grads, rows), aux

    return per_microbatch


def _open_all(grads: PyTree, requested: Any, merge: str | None, where: Any = None) -> PyTree:
    return jax.tree.map(
        lambda g: _per_example.open_sum(g, requested, merge, where),
        grads,
        is_leaf=_layout.is_open,
    )


def kept(request: GradRequest, settings: Settings) -> Callable[..., jax.Array]:
    """``kept(plan, weights, args, kwargs)``: which rows of a microbatch the step of
    ``plan`` (None: the per-example path) keeps under ``nan_safe``: a weight other than 0
    and finite norms, read as that step reads them (``_dropped``)."""
    sums, axes, mesh_axes = request.sums(settings), request.example.axes, settings.mesh_axes

    def finite(method: Method, *args: Any, **kwargs: Any) -> jax.Array:
        if method.ghost_norms:
            norms = _per_example.ghost_norms(sums, args, kwargs)
            if isinstance(norms, str):  # the plan read the same program before the loop
                raise RuntimeError(f"micro_grad planned the ghost norms, but in the loop {norms}.")
        else:
            norms = _per_example.materialized_norms(sums, args, kwargs)
        return jnp.all(jnp.isfinite(norms), axis=1)

    def rows(plan: GradPlan | None, weights: Any, args: Any, kwargs: Any) -> jax.Array:
        method = MATERIALIZE if plan is None else plan.method
        first = _per_example.first_batched(axes, args, kwargs)
        where = _layout.shards(first, 0, mesh_axes)
        if where is None:
            keep = finite(method, *args, **kwargs)
        else:
            local = lambda w, *a, **k: finite(method, *a, **k)  # noqa: E731
            keep = _per_example.by_shard(local, axes, where, None, args, kwargs)
            keep = _layout.unchunk(keep, where)
        return keep & (weights != 0)

    return rows
