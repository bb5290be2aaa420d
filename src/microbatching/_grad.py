"""``micro_grad``: per-example gradients, transformed and accumulated one microbatch at a time."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.core import Tracer

from . import (
    _accumulators,
    _batch,
    _checks,
    _clipping,
    _dropped,
    _fsdp,
    _layout,
    _methods,
    _per_example,
    _sharding,
    _signature,
    _unsplit,
    _vmap,
)
from ._accumulators import AccumulationType
from ._inspect import ClippingReport
from ._per_example import Aux, identity, no_metrics
from ._typing import (
    AccumulatorTree,
    ClipMethod,
    Count,
    Function,
    GatherParams,
    P,
    PyTree,
    ReduceGradients,
)
from ._wrap import Settings, wraps


@_signature.other_transforms_names
def micro_grad(
    fun: Callable[P, Any],
    has_aux: bool = False,
    argnums: int | tuple[int, ...] = 0,
    *,
    batch_argnums: int | tuple[int, ...] = _signature.DEFAULT_BATCH_ARGNUMS,
    keep_batch_dim: bool = True,
    microbatch_size: int | None = None,
    accumulator: AccumulatorTree = AccumulationType.SUM,
    transform_fn: Callable[[PyTree], PyTree] = identity,
    metrics_fn: Callable[[PyTree], PyTree] = no_metrics,
    num_real_microbatches: Count = None,
    l2_clip_norm: float | jax.Array | PyTree | None = None,
    rescale_to_unit_norm: bool = False,
    normalize_by: float = 1.0,
    nan_safe: bool = False,
    clip_method: ClipMethod = "auto",
    accumulation_dtype: Any = None,
    batch_mesh_axes: str | tuple[str, ...] | None = None,
    gather_params: GatherParams = "once",
    reduce_gradients: ReduceGradients | None = None,
    param_specs: Any = None,
    progress: bool = False,
    allow_remainder: bool = False,
    whole_argnums: int | tuple[int, ...] = (),
) -> Callable[..., tuple[PyTree, Aux]]:
    """Computes per-example gradients, transforms them and accumulates them over the batch.

    For every example ``b`` the returned function computes
    ``value_b, g_b = jax.value_and_grad(fun, argnums)(..., example_b, ...)``, then
    returns ``(accumulate(transform_fn(g_b)), Aux(values, metrics_fn(g_b), aux))``.
    Gradients are computed ``microbatch_size`` examples at a time, so the per-example
    gradients of the whole batch never exist at once. Clipping each gradient in
    ``transform_fn`` and summing gives the DP-SGD update.

    The returned function also takes a keyword-only ``example_weights`` of shape
    ``(batch_size,)``, as ``micro_vmap`` does: SUM gives ``sum(w_b * t_b)`` of the
    transformed gradients ``t_b``, MEAN divides it by ``sum(w_b)``, MAX and MIN skip
    weight 0, and ``Aux`` holds zeros for examples of weight 0. A boolean mask over a
    batch padded to a fixed size gives DP-SGD with Poisson sampling without recompiling.

    Args:
      fun: A scalar loss, e.g. ``fun(params, batch, ...)``.
      has_aux: Whether ``fun`` returns ``(loss, aux)``.
      argnums: The argument(s) to differentiate.
      batch_argnums: The argument(s) with a batch axis 0. An entry applies to its
        parameter whether the call passes it by position or by keyword (``fn(p, x=x)``
        with ``batch_argnums=1`` splits ``x``; a parameter left out is passed whole to
        every example either way). Keyword arguments that name no positional
        parameter are mapped along axis 0, as in ``jax.vmap``. A positional argument
        that is neither split nor differentiated, but whose array leaves all have the
        batch's size on axis 0, gets an ``UnsplitBatchWarning``: it is passed whole to
        every example, where a forgotten label array would silently broadcast against
        every example's loss. ``whole_argnums`` says that it is meant whole.
      keep_batch_dim: If True, ``fun`` sees each example as a batch of one (axis 0 of
        size 1); if False, without the batch axis. If True, ``fun`` is also traced once,
        abstractly, on a batch of 4099 rows, and a loss that applies a statistic over
        the rows back to them (BatchNorm) gets a ``BatchStatisticsWarning``.
      microbatch_size: Examples per microbatch; None does the whole batch at once.
      accumulator: How to combine the transformed gradients (default SUM).
      transform_fn: Applied to each example's gradient before accumulation. With SUM
        or MEAN, ``micro_grad`` reads it off its traced program: an output leaf linear
        in the gradient (the gradient itself, a multiple, a ``vdot`` with a fixed
        direction) comes from the (clipped) sum; a multiplicative function of one leaf
        (``g**2``, ``jnp.sign``, ``jnp.abs``) at a dense layer without a sequence is one
        product of the layer's activations and output cotangents, as the gradient's
        own; any other elementwise function of one leaf is that leaf's own per-example
        gradients, a chunk of examples at a time. A ``transform_fn`` that scales each
        leaf by a function of the gradient's squared norms (clipping as people write
        it: ``g * min(1, C / ||g||)``, ``optax.clip_by_global_norm``, a bound per
        layer, ``g / (||g|| + eps)``) takes ``l2_clip_norm``'s path, its factors the
        user's own code run on each example's norms, and whatever it computes from the
        scaled gradient (``(c, c**2)``) is read as above. The model's per-example
        gradients are then never formed; anything else forms them. ``clipping_report``
        says which form each output leaf takes, and ``clip_method="materialize"`` forms
        them always.
      metrics_fn: Applied to each example's gradient before ``transform_fn``; returned
        per example in ``Aux.metrics``, so keep it small (a norm, a sign...). A
        ``metrics_fn`` linear in the gradient (a dot product with a reference
        gradient, a fixed projection) is read the same way, from one more product per
        layer; one that reads the gradient only through squared norms
        (``optax.tree.norm``, ``jnp.linalg.norm`` per leaf) runs on each example's
        norms, as a clipping ``transform_fn`` does.
      num_real_microbatches: See ``microbatch``.
      l2_clip_norm: If set, each example's gradient is first scaled by
        ``min(1, l2_clip_norm / ||g_b||)``, its L2 norm taken over the whole gradient
        tree, then given to ``transform_fn``: the clipping of DP-SGD. A pytree that is a
        prefix of the gradient clips each subtree by its own norm and bound (per-layer
        clipping). A traced value (``micro_grad`` built inside ``jit``) changes without
        recompiling. With the default ``transform_fn``, SUM or MEAN, and ``metrics_fn``
        left out or a function of the norms (``l2_norm``), the clipped sum can be
        formed without the per-example gradients; ``clip_method`` says how the norms
        and the sum are computed, and ``clipping_report`` which method a call takes (a
        ``metrics_fn`` that reads more than norms needs each example's gradient).
        ``metrics_fn`` sees the gradients before clipping.
      rescale_to_unit_norm: With ``l2_clip_norm``, divide each clipped gradient by its
        bound, so that every example contributes a norm of at most 1.
      normalize_by: With ``l2_clip_norm``, divide the clipped gradients by this.
      nan_safe: With ``l2_clip_norm``, an example whose gradient norm is not finite
        (NaN or inf) contributes zero instead of making the sum NaN; the norms in
        ``Aux.metrics`` (``metrics_fn=l2_norm``) show which examples those were.
        ``clip_method`` ``"two_pass"`` and ``"chunked"`` cannot, and refuse it.
      clip_method: How the clipped sum and the norms are computed with the default
        ``transform_fn`` and SUM or MEAN. They differ in rounding where an example's
        rows cancel (the ghost methods add a gradient rounded in the model's dtype)
        and in what they certify when a clip factor takes a cotangent below the
        dtype's smallest normal number. Only ``"materialize"`` bounds each example's
        contribution by the bound on every input; the reference page "DP-SGD: guarantees
        and numerics" (``docs/reference/dp-sgd-guarantees.md``) says what
        each of the others leaves. ``"ghost"``,
        ``"two_pass"`` and ``"chunked"`` need ``l2_clip_norm`` or
        ``metrics_fn=microbatching.l2_norm``, and refuse a call with neither:

        - ``"ghost"``: each parameter's per-example norm is read off the traced program
          of one example's loss, from the inputs and output cotangents of the layers
          that use it (dense, convolution, embedding), without forming its gradient;
          the clipped sum is one more product per layer at the scaled cotangents.
        - ``"two_pass"``: ghost norms, then the gradient of the loss weighted by the
          clip factors.
        - ``"chunked"``: per-example gradients a chunk of examples at a time for the norms,
          then that weighted gradient.
        - ``"materialize"``: per-example gradients, scaled and summed.
        - ``"statistics"``: ``transform_fn`` and ``metrics_fn`` read off their traced
          programs, each output leaf summed from the layers' activations and output
          cotangents (see ``transform_fn``), with SUM or MEAN; a ``ValueError`` says
          why where it cannot read them.
        - ``"auto"`` (default): ``"ghost"`` or ``"materialize"``, whichever a cost
          model finds cheaper for the call, or ``"statistics"`` for a
          ``transform_fn`` or ``metrics_fn`` it can read where the same cost model finds
          it cheaper than forming the per-example gradients. Where the gradients
          must be formed (a ``metrics_fn`` that reads them, a loss the ghost norms
          cannot read) it takes ``"materialize"`` when clipping and ``"chunked"``
          otherwise; ``clipping_report`` says which, and why.
      accumulation_dtype: See ``microbatch``.
      batch_mesh_axes: See ``micro_vmap``.
      gather_params: Where differentiated arguments sharded over the batch's mesh axes
        (FSDP) are made whole: ``"once"`` before the loop (their full size on every
        device through the step, one all-gather) or ``"per_microbatch"`` inside each
        microbatch (the full copy lives only while it runs; one all-gather per
        microbatch).
      reduce_gradients: Where the gradients of such arguments are added over the
        devices: ``"per_microbatch"`` reduce-scatters each microbatch's gradient into a
        sum sharded like the parameters (``1/N`` of their size per device, one
        reduce-scatter per microbatch); ``"after_loop"`` keeps a full-size partial sum
        per device and reduces it once. None (default) takes ``"per_microbatch"`` for
        sharded parameters. Both apply where the layout can be read: on an Explicit
        mesh, for concrete arrays, or where ``param_specs`` states it; see the
        multi-device guide.
      param_specs: The ``jax.sharding.PartitionSpec`` of the differentiated arguments
        (one, or a pytree of them that is a prefix of those arguments), for where their
        layout cannot be read: inside ``jax.jit`` on an Auto mesh. With it, FSDP
        parameters are gathered and their gradients reduce-scattered as on an Explicit
        mesh; without it they enter the loop whole on every device (and arguments of
        8 MiB or more get a ``UserWarning`` naming this option). A layout that
        can be read takes precedence.
      progress: See ``microbatch``.
      allow_remainder: See ``micro_vmap``.
      whole_argnums: Positions of arguments that are meant whole (passed to every
        example as they are) although their axis 0 may have the batch's size: no
        ``UnsplitBatchWarning`` for them.

    Returns:
      A function returning ``(accumulated transformed gradients, Aux)``; it takes
      ``fun``'s arguments and optionally ``example_weights=``.

    >>> import jax.numpy as jnp
    >>> def mean_squared_loss(params, features, targets):
    ...     diff = features @ params - targets
    ...     return 0.5 * jnp.mean(diff**2)
    >>> params = jnp.zeros(1)
    >>> features = jnp.ones((4, 1))
    >>> targets = jnp.array([0, 2, 4, 6])
    >>> (grads, squared_grads), aux = micro_grad(
    ...     mean_squared_loss,
    ...     argnums=0,
    ...     batch_argnums=(1, 2),
    ...     accumulator=AccumulationType.MEAN,
    ...     transform_fn=lambda g: (g, g**2),
    ...     metrics_fn=jnp.linalg.norm,
    ... )(params, features, targets)
    >>> grads, squared_grads  # the per-example gradients are 0, -2, -4, -6
    (Array([-3.], dtype=float32), Array([14.], dtype=float32))
    >>> aux.values
    Array([ 0.,  2.,  8., 18.], dtype=float32)
    >>> aux.metrics
    Array([0., 2., 4., 6.], dtype=float32)

    Clipped per-example gradients, two examples at a time (the DP-SGD sum):

    >>> clip = lambda g: g * jnp.minimum(1.0, 1.0 / jnp.linalg.norm(g))
    >>> grads, _ = micro_grad(mean_squared_loss, batch_argnums=(1, 2), microbatch_size=2,
    ...                       transform_fn=clip)(params, features, targets)
    >>> grads
    Array([-3.], dtype=float32)
    """
    axes = _signature.grad_axes(fun, batch_argnums)
    grad_nums = _signature.differentiated(fun, argnums)
    example = _per_example.Examples(
        fun,
        axes,
        grad_nums if isinstance(argnums, Sequence) else grad_nums[0],
        _checks.ensure_bool("has_aux", has_aux),
        _checks.ensure_bool("keep_batch_dim", keep_batch_dim),
    )
    transform = _noted(_checks.ensure_callable("transform_fn", transform_fn))
    metrics = _checks.ensure_callable("metrics_fn", metrics_fn)
    accumulators = _accumulators.ensure_tree(accumulator)
    settings = Settings(
        _checks.ensure_microbatch_size(microbatch_size),
        (accumulators, AccumulationType.CONCAT),
        _checks.ensure_count(num_real_microbatches),
        _checks.ensure_accumulation_dtype(accumulation_dtype),
        _checks.ensure_mesh_axes(batch_mesh_axes),
        _checks.ensure_bool("progress", progress),
        "micro_grad",
        _checks.ensure_bool("allow_remainder", allow_remainder),
    )
    clipping = _clipping_of(l2_clip_norm, rescale_to_unit_norm, normalize_by, nan_safe)
    trade = _fsdp.ensure_trade(gather_params, reduce_gradients)
    specs = _fsdp.ensure_specs(param_specs)
    method = _checks.ensure_choice("clip_method", clip_method, CLIP_METHODS)
    request = _methods.GradRequest(
        example, clipping, transform, metrics, accumulators, method, settings, trade, specs
    )
    request.check()
    calls = _Calls(request, _unsplit_check(fun, axes, grad_nums, batch_argnums, whole_argnums))
    return wraps(fun, calls, axes, settings, weights=True, describe=calls.describe)


TRANSFORM_NOTE = (
    "(microbatching: transform_fn receives one example's gradient as a pytree shaped "
    "like the differentiated arguments, e.g. a dict of parameters, not one array: apply "
    "a per-array function with jax.tree.map, e.g. transform_fn=lambda g: (g, "
    "jax.tree.map(jnp.square, g)).)"
)


def _noted(transform: Callable[[PyTree], PyTree]) -> Callable[[PyTree], PyTree]:
    """``transform`` that, where it raises a ``TypeError`` on a gradient that is not one
    array (``g ** 2`` on a dict), says that it receives the gradient pytree."""
    if transform is identity:
        return transform

    def call(grads: PyTree) -> PyTree:
        try:
            return transform(grads)
        except TypeError as err:
            whole = jax.tree_util.treedef_is_leaf(jax.tree.structure(grads))
            if not whole and TRANSFORM_NOTE not in getattr(err, "__notes__", []):
                err.add_note(TRANSFORM_NOTE)
            raise

    # Messages name the user's function (``_checks.function_name``), not this wrapper.
    call.__name__ = call.__qualname__ = _checks.function_name(transform)
    return call


def _unsplit_check(
    fun: Function, axes: Any, argnums: tuple[int, ...], batch_argnums: Any, whole_argnums: Any
) -> _unsplit.Unsplit:
    """The warning for an argument of the batch's size that no argument names. A
    differentiated argument is looked at only where ``argnums`` also names the batch
    (``argnums=(1, 2)`` with ``batch_argnums`` left at its default: ``argnums`` taken
    for it); parameters whose axis 0 happens to match the batch are otherwise no sign
    of a mix-up."""
    whole = _unsplit.whole_positions(fun, whole_argnums, axes)
    default = batch_argnums is _signature.DEFAULT_BATCH_ARGNUMS
    mixed_up = default and 1 in argnums
    given = argnums[0] if len(argnums) == 1 else argnums
    return _unsplit.Unsplit(
        axes,
        (*whole, *(() if mixed_up else argnums)),
        "1" if default else None,
        {i: f"which argnums={given} differentiates" for i in argnums} if mixed_up else None,
        "argnums names the arguments to differentiate, batch_argnums those split into examples.",
    )


CLIP_METHODS: tuple[str, ...] = typing.get_args(ClipMethod)
"""The values of ``clip_method``: ``"auto"`` and the methods a user may ask for."""


class _Calls:
    """The calls of one ``micro_grad`` function: its loops, built when the user wraps
    ``fun``, and the plan of each call (``_methods.plan``), which they run."""

    def __init__(self, request: _methods.GradRequest, unsplit: Any) -> None:
        self.request, self.unsplit = request, unsplit
        example, settings, kinds = request.example, request.settings, request.accumulators
        # ``local``: the same per-microbatch step for the loop per shard (``_fsdp.run``),
        # where each device folds its own rows and means are sums until the devices combine.
        self.local = dataclasses.replace(settings, mesh_axes=None)
        self.folds = _fsdp.local_kinds(kinds)
        safe = self._drops_in_derivatives
        if request.summed:
            self.looped = _vmap.loop_over(
                safe(_methods.summed(request, kinds, settings), settings), example.axes, settings
            )
            self.per_shard = _fsdp.supports_summed(kinds, settings.count)
            self.local_step = safe(_methods.summed(request, self.folds, self.local), self.local)
            self.statistics: Any = None  # the summed loop runs the statistics method too
        else:
            self.statistics = (
                _vmap.loop_over(
                    safe(_methods.summed(request, kinds, settings), settings),
                    example.axes,
                    settings,
                )
                if request.reads_statistics
                else None
            )
            one = _per_example.per_example(
                example, request.clipping, request.transform, request.metrics
            )
            self.looped = _vmap.build(
                one, example.axes, jax.vmap, settings, lambda step: _unplanned(safe, step, settings)
            )
            self.per_shard = _fsdp.supports(kinds, settings.count)
            folded = dataclasses.replace(
                self.local, accumulator=(self.folds, AccumulationType.CONCAT)
            )
            aggregated = _vmap.aggregated(one, example.axes, jax.vmap, folded)
            self.local_step = safe(
                lambda plan, weights, *a, **k: aggregated(weights, *a, **k), self.local
            )
        self.local_loops: dict[Any, Any] = {}

    def __call__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any
    ) -> tuple[PyTree, Aux]:
        request = self.request
        example, settings = request.example, request.settings
        args, kwargs = example.axes.to_positions(args, kwargs)
        example.check_differentiable(args)
        if (
            request.clipping is not None
            and jax.tree.structure(request.clipping.bound).num_nodes > 1
        ):
            # A pytree l2_clip_norm against the gradient's tree, before the loop: inside,
            # its error would gain the note on fun's microbatches, which is not the fix.
            request.clipping.groups(_per_example.gradient_shapes(example, args))
        if not isinstance(request.accumulators, AccumulationType | _accumulators.Accumulator):
            shapes = jax.eval_shape(request.transform, _per_example.gradient_shapes(example, args))
            _accumulators.check_prefix(
                request.accumulators, shapes, "transform_fn's output (the gradient by default)"
            )
        unvarying = example.unvarying(args, kwargs, weights)
        if unvarying is not None and request.per_example_reason is not None:
            raise unvarying.error(request.per_example_reason)
        self.unsplit.check(args, kwargs)
        if weights is None and self._nan_safe:
            weights = _every_row(_per_example.find_batched(example.axes, args, kwargs))
        plan = self.plan(args, kwargs, weights)
        if unvarying is not None and unvarying.weighted:
            why = request.weights_reason(plan.method)
            if why is not None:
                raise unvarying.error(why)
        layout, nums = plan.layout, example.nums()
        if layout is not None and self.per_shard and _runs_per_shard(layout, settings):
            first = _per_example.first_batched(example.axes, args, kwargs)
            explicit = _sharding.explicit_sharding(first) is not None
            if not (explicit and self._closes_over_traced_values(args, kwargs)):
                return self._per_shard(plan, args, kwargs, weights)
        args = _fsdp.gathered_once(layout, nums, args)
        if request.gathers_for_norms and settings.mesh_axes:
            # The per-example norms read every parameter on every shard: gathered once
            # here, not once per microbatch by XLA inside the loop.
            args = tuple(_layout.replicated(a) if i in nums else a for i, a in enumerate(args))
        if request.summed:
            return self.looped(args, kwargs, weights, plan)
        if plan.summed and self.statistics is not None:  # the statistics method
            return self.statistics(args, kwargs, weights, plan)
        return self.looped(args, kwargs, weights)

    def plan(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any, layout: bool = True
    ) -> _methods.GradPlan:
        """The plan of a call with positional ``args``; ``layout``: read its layout too."""
        request = self.request
        example, settings = request.example, request.settings
        _batch.locate(example.axes, args, kwargs, weights, None, None)  # its errors first
        where = None
        first = _per_example.find_batched(example.axes, args, kwargs)
        if layout and first is not None and not request.batched_grad:
            params = _differentiated(example.argnums, args)
            given = _fsdp.given_specs(request.param_specs, params)
            nums = example.nums()
            leaves = jax.tree.leaves([args[i] for i in nums if i < len(args)])
            where = _fsdp.layout(first, leaves, settings.mesh_axes, request.trade, given)
        sharded = first is not None and _layout.shards(first, 0, settings.mesh_axes) is not None
        nums = example.nums()

        def abstract(owner: int | str) -> bool:  # the batch and the parameters
            return owner in nums or example.axes.spec(owner) is not None

        def planned(a: tuple[Any, ...], k: dict[str, Any]) -> _methods.GradPlan:
            return _methods.plan(request, a, k, where, sharded)

        return _abstractly(planned, args, kwargs, abstract)

    def describe(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any
    ) -> ClippingReport:
        """The call's plan, as ``clipping_report`` shows it."""
        args, kwargs = self.request.example.axes.to_positions(args, kwargs)
        return self.plan(args, kwargs, weights, layout=False).report()

    def _per_shard(
        self,
        plan: _methods.GradPlan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        weights: Any,
    ) -> tuple[PyTree, Aux]:
        """The call on each device's rows, inside a ``shard_map`` (``_fsdp.run``)."""
        request, layout = self.request, plan.layout
        assert layout is not None  # for the type checker: the caller checked it
        example, summed, kinds = request.example, request.summed, request.accumulators
        if summed:
            specs = layout.grad_specs(args, example.argnums)
        else:
            specs = _fsdp.out_specs(kinds, layout.entry)

        def finish(outs: PyTree, total: Any) -> PyTree:
            if summed and not layout.reduce_per_microbatch:
                outs = layout.reduce(outs)
            return _fsdp.combine(kinds, outs, total, layout.axes, reduced=summed)

        loop = self._local_loop(plan, (request.settings.size or 0) // layout.count)
        out, aux = _fsdp.run(
            layout,
            loop,
            example.nums(),
            lambda where: example.axes.spec(where) is not None,
            (args, kwargs, weights),
            specs,
            finish,
        )
        if not summed:  # a transform's sums come back whole: laid out as promised
            params = _differentiated(example.argnums, args)
            out = _fsdp.like_parameters(out, params, layout.grad_specs(args, example.argnums))
        return out, aux

    def _local_loop(self, plan: _methods.GradPlan, size: int) -> Any:
        """``loop(args, kwargs, weights)`` over one device's rows, inside the shard_map of
        ``_fsdp.run``; one per plan and size, so that its compiled loop is kept."""
        key = (plan, size)
        if key not in self.local_loops:
            layout, request = plan.layout, self.request
            assert layout is not None  # for the type checker: only sharded plans get here
            nums, summed = request.example.nums(), request.summed

            def body(plan: Any, weights: Any, *args: Any, **kwargs: Any) -> Any:
                if layout.gather_per_microbatch:
                    args = layout.gather(args, nums)
                outs, aux = self.local_step(plan, weights, *args, **kwargs)
                if summed and layout.reduce_per_microbatch:
                    outs = layout.reduce(outs)
                return outs, aux

            inner = dataclasses.replace(
                self.local,
                size=size,
                accumulator=(self.folds, AccumulationType.CONCAT),
                pin_consts=layout.gather_per_microbatch,
            )
            loop = _vmap.loop_over(body, request.example.axes, inner)
            self.local_loops[key] = lambda a, k, w: loop(a, k, w, plan)
        return self.local_loops[key]

    @property
    def _nan_safe(self) -> bool:
        clipping = self.request.clipping
        return clipping is not None and clipping.nan_safe

    def _drops_in_derivatives(self, step: Any, settings: Settings) -> Any:
        """``step(plan, weights, *args, **kwargs)``; under ``nan_safe``, its derivatives
        leave out the rows it drops (``_dropped``), which needs the weights that
        ``__call__`` then always passes."""
        if not self._nan_safe:
            return step
        kept = _methods.kept(self.request, settings)
        axes = self.request.example.axes
        return _dropped.drops_in_derivatives(step, kept, axes, settings.mesh_axes)

    def _closes_over_traced_values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``fun`` or the clipping options hold values traced by an enclosing
        ``jit``: a ``shard_map`` on an Explicit mesh cannot close over them (JAX 0.10)."""
        clipping, example = self.request.clipping, self.request.example
        bound = () if clipping is None else (clipping.bound, clipping.normalize_by)

        args, kwargs = jax.tree.map(_plain, (args, kwargs))
        losses = _vmap.vmapped(example.loss, example.axes, jax.vmap)
        closed = jax.make_jaxpr(losses)(*args, **kwargs)
        return any(isinstance(x, Tracer) for x in [*jax.tree.leaves(bound), *closed.consts])


def _unplanned(safe: Callable[[Any, Settings], Any], step: Any, settings: Settings) -> Any:
    """``safe`` of a step without a plan, ``step(weights, *args, **kwargs)``."""
    planned = safe(lambda plan, weights, *a, **k: step(weights, *a, **k), settings)
    return lambda weights, *a, **k: planned(None, weights, *a, **k)


def _every_row(first: Any) -> Any:
    """Weights of True for each row of the batch leaf ``first`` (its axis 0), laid out
    and varying as it is; None without a batch."""
    if first is None:
        return None
    sharding = _sharding.explicit_sharding(first)
    if sharding is not None:
        sharding = _sharding.with_spec(sharding, _sharding.entries(sharding.spec, first.ndim)[:1])
    out = jax.numpy.ones(first.shape[:1], bool, out_sharding=sharding)
    varying = _sharding.varying(jax.typeof(first))
    return jax.lax.pcast(out, varying, to="varying") if varying else out


def _plain(x: Any) -> Any:
    """An array's shape and dtype only, without its layout; anything else as it is."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        weak = getattr(getattr(x, "aval", x), "weak_type", False)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)
    return x


def _abstractly(
    fn: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    abstract: Callable[[int | str], bool],
) -> Any:
    """``fn(args, kwargs)`` traced with the arrays of the arguments that ``abstract``
    picks as their shapes and dtypes, without their layouts (``_plain``); every other
    argument as it is, so that a loss may still branch on a concrete one. The plan reads
    shapes and dtypes only: one example of a batch split over an Explicit mesh cannot be
    sliced out before the loop, as it is inside it."""
    owners = [*range(len(args)), *kwargs]
    values = [*args, *kwargs.values()]
    leaves, treedef = jax.tree.flatten(values)
    picked = [abstract(w) for w, v in zip(owners, values, strict=True) for _ in jax.tree.leaves(v)]
    arrays = [
        p and isinstance(x, jax.Array | jax.ShapeDtypeStruct)
        for x, p in zip(leaves, picked, strict=True)
    ]
    found: list[Any] = []

    def traced(given: list[Any]) -> int:
        it = iter(given)
        full = jax.tree.unflatten(
            treedef, [next(it) if a else x for x, a in zip(leaves, arrays, strict=True)]
        )
        found.append(
            fn(tuple(full[: len(args)]), dict(zip(kwargs, full[len(args) :], strict=True)))
        )
        return 0

    jax.eval_shape(traced, [_plain(x) for x, a in zip(leaves, arrays, strict=True) if a])
    return found[0]


def _differentiated(argnums: int | tuple[int, ...], args: tuple[Any, ...]) -> Any:
    """The arguments ``argnums`` picks, shaped as ``jax.grad(argnums=argnums)`` shapes
    its gradient (one argument, or a tuple); () where an int picks none."""
    if isinstance(argnums, tuple):
        return tuple(args[i] for i in argnums if i < len(args))
    return args[argnums] if argnums < len(args) else ()


def _runs_per_shard(layout: _fsdp.Layout, settings: Settings) -> bool:
    """Whether the call's loop can run per shard: the layout allows it, there is no
    remainder, and each shard holds the same rows of every microbatch."""
    size = settings.size
    divides = size is not None and size % layout.count == 0
    return layout.per_shard and divides and not settings.allow_remainder


def _clipping_of(
    l2_clip_norm: Any, rescale_to_unit_norm: Any, normalize_by: Any, nan_safe: Any
) -> _clipping.Clipping | None:
    """The clipping options, checked together."""
    bound = _checks.ensure_clip_bound(l2_clip_norm)
    unit = _checks.ensure_bool("rescale_to_unit_norm", rescale_to_unit_norm)
    divide = _checks.ensure_clip_norm(normalize_by, "normalize_by")
    if divide is None:
        raise TypeError("normalize_by must be a positive number, got None; pass e.g. 1.0.")
    safe = _checks.ensure_bool("nan_safe", nan_safe)
    if bound is None:
        given = [f"rescale_to_unit_norm={unit}"] if unit else []
        if not (isinstance(divide, float) and divide == 1.0):
            given.append(f"normalize_by={normalize_by!r}")
        given += [f"nan_safe={safe}"] if safe else []
        if given:
            raise ValueError(
                f"micro_grad was given {', '.join(given)} without l2_clip_norm; these "
                "change how clipped gradients are summed, so pass l2_clip_norm too."
            )
        return None
    return _clipping.Clipping(bound, unit, divide, safe)
