"""``micro_grad``: per-example gradients, transformed and accumulated one microbatch at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.core import Tracer

from . import (
    _accumulators,
    _checks,
    _clipping,
    _fsdp,
    _layout,
    _per_example,
    _sharding,
    _signature,
    _vmap,
)
from ._accumulators import AccumulationType
from ._inspect import ClippingReport
from ._per_example import Aux, identity, no_metrics
from ._typing import AccumulatorTree, ClipMethod, Count, GatherParams, P, PyTree, ReduceGradients
from ._wrap import Settings, wraps


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
      batch_argnums: The argument(s) with a batch axis 0. Keyword arguments of the call
        are mapped along axis 0 as well, as in ``jax.vmap``. Left at its default, a
        warning names any other positional argument whose leading axis has the batch's
        size (passed whole to every example); pass ``batch_argnums`` to silence it.
      keep_batch_dim: If True, ``fun`` sees each example as a batch of one (axis 0 of
        size 1); if False, without the batch axis.
      microbatch_size: Examples per microbatch; None does the whole batch at once.
      accumulator: How to combine the transformed gradients (default SUM).
      transform_fn: Applied to each example's gradient before accumulation.
      metrics_fn: Applied to each example's gradient before ``transform_fn``; returned
        per example in ``Aux.metrics``, so keep it small (a norm, a sign...).
      num_real_microbatches: See ``microbatch``.
      l2_clip_norm: If set, each example's gradient is first scaled by
        ``min(1, l2_clip_norm / ||g_b||)``, its L2 norm taken over the whole gradient
        tree, then given to ``transform_fn``: the clipping of DP-SGD. A pytree that is a
        prefix of the gradient clips each subtree by its own norm and bound (per-layer
        clipping). A traced value (``micro_grad`` built inside ``jit``) changes without
        recompiling. With the default ``transform_fn`` and SUM or MEAN the clipped
        per-example gradients are never formed; ``clip_method`` says how the norms and
        the sum are computed. ``metrics_fn`` sees the gradients before clipping.
      rescale_to_unit_norm: With ``l2_clip_norm``, divide each clipped gradient by its
        bound, so that every example contributes a norm of at most 1.
      normalize_by: With ``l2_clip_norm``, divide the clipped gradients by this.
      nan_safe: With ``l2_clip_norm``, an example whose gradient norm is not finite
        (NaN or inf) contributes zero instead of making the sum NaN; the norms in
        ``Aux.metrics`` (``metrics_fn=l2_norm``) show which examples those were.
      clip_method: How the clipped sum and the norms are computed with the default
        ``transform_fn`` and SUM or MEAN; every method is exact:

        - ``"ghost"``: each parameter's per-example norm is read off the traced program
          of one example's loss, from the inputs and output cotangents of the layers
          that use it (dense, convolution, embedding), without forming its gradient;
          the clipped sum is one more product per layer at the scaled cotangents.
        - ``"two_pass"``: ghost norms, then the gradient of the loss weighted by the
          clip factors.
        - ``"chunked"``: per-example gradients a chunk of rows at a time for the norms,
          then that weighted gradient.
        - ``"materialize"``: per-example gradients, scaled and summed.
        - ``"auto"`` (default): ``"ghost"`` or ``"materialize"``, whichever a cost
          model finds cheaper for the call; ``clipping_report`` says which, and why.
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
    transform = _checks.ensure_callable("transform_fn", transform_fn)
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
    trade = _fsdp.Trade(
        _checks.ensure_choice("gather_params", gather_params, _fsdp.GATHER),
        None
        if reduce_gradients is None
        else _checks.ensure_choice("reduce_gradients", reduce_gradients, _fsdp.REDUCE),
    )
    param_specs = _fsdp.ensure_specs(param_specs)
    method = _checks.ensure_choice("clip_method", clip_method, _per_example.METHODS)
    if method in ("two_pass", "chunked") and clipping and len(jax.tree.leaves(clipping.bound)) > 1:
        raise ValueError(
            f"micro_grad was given clip_method={method!r}, which scales each example's "
            "loss by one factor, and a pytree l2_clip_norm, which needs one factor per "
            "subtree; pass clip_method='ghost', 'materialize' or 'auto'."
        )
    if method in ("two_pass", "chunked") and clipping and clipping.nan_safe:
        raise ValueError(
            f"micro_grad was given clip_method={method!r} and nan_safe=True, but "
            f"{method!r} takes the gradient of the losses weighted by the clip factors, "
            "and an example whose loss is not finite makes that gradient NaN even at "
            "factor 0; pass clip_method='auto', 'ghost' or 'materialize', which drop it."
        )
    if method == "ghost" and metrics not in (no_metrics, _per_example.l2_norm):
        raise ValueError(
            f"micro_grad was given clip_method='ghost' and metrics_fn={metrics!r}, which "
            "needs each example's gradient; the ghost method never forms them. Pass "
            "metrics_fn=microbatching.l2_norm for the per-example norms, or "
            "clip_method='auto'."
        )
    batched_grad = any(axes.spec(i) is not None for i in example.nums())
    is_summed = transform is identity and _accumulators.is_linear(accumulators)
    is_summed = is_summed and not batched_grad
    wanted = clipping is not None or metrics is _per_example.l2_norm
    if method in ("ghost", "two_pass", "chunked") and not is_summed:
        raise ValueError(
            f"micro_grad was given clip_method={method!r}, which sums the clipped "
            "gradients without forming them, but transform_fn, the accumulator or a "
            "batched argnums needs each example's gradient; pass clip_method='auto' or "
            "'materialize', or drop transform_fn and use SUM or MEAN."
        )

    def describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ClippingReport:
        kwargs = {k: v for k, v in kwargs.items() if k != "example_weights"}
        args, kwargs = axes.to_positions(args, kwargs)
        dtype = settings.accumulation_dtype
        gradient_metrics = metrics not in (no_metrics, _per_example.l2_norm)
        return _per_example.describe(
            example, wanted, is_summed, method, dtype, args, kwargs, gradient_metrics
        )

    measure = None if metrics is no_metrics else metrics
    # ``local_step``: the same per-microbatch step for the loop per shard (``_fsdp.run``),
    # where each device folds its own rows and means are sums until the devices combine.
    local = dataclasses.replace(settings, mesh_axes=None)
    folds = _fsdp.local_kinds(accumulators)
    if is_summed:
        summed = _per_example.summed(example, accumulators, clipping, measure, settings, method)
        looped = _vmap.loop_over(summed, axes, settings)
        per_shard = _fsdp.supports(accumulators, settings.count, _fsdp.KINDS[:2])
        local_step = _per_example.summed(example, folds, clipping, measure, local, method)
    else:
        per_example = _per_example.per_example(example, clipping, transform, metrics)
        looped = _vmap.build(per_example, axes, jax.vmap, settings)
        per_shard = _fsdp.supports(accumulators, settings.count, _fsdp.KINDS)
        with_folds = dataclasses.replace(local, accumulator=(folds, AccumulationType.CONCAT))
        local_step = _vmap.aggregated(per_example, axes, jax.vmap, with_folds)
    local_loops: dict[Any, Any] = {}

    def local_loop(layout: _fsdp.Layout, size: int) -> Any:
        """The loop over one device's rows, inside the shard_map of ``_fsdp.run``."""
        key = (layout, size)
        if key not in local_loops:

            def body(weights: Any, *args: Any, **kwargs: Any) -> Any:
                if layout.gather_per_microbatch:
                    args = layout.gather(args, example.nums())
                outs, aux = local_step(weights, *args, **kwargs)
                if is_summed and layout.reduce_per_microbatch:
                    outs = layout.reduce(outs)
                return outs, aux

            inner = dataclasses.replace(
                local,
                size=size,
                accumulator=(folds, AccumulationType.CONCAT),
                pin_consts=layout.gather_per_microbatch,
            )
            loop = _vmap.loop_over(body, axes, inner)

            def call(args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any) -> Any:
                extra = {} if weights is None else {"example_weights": weights}
                return loop(*args, **kwargs, **extra)

            local_loops[key] = call
        return local_loops[key]

    def run_per_shard(
        layout: _fsdp.Layout, size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[PyTree, Aux]:
        kwargs = dict(kwargs)
        weights = kwargs.pop("example_weights", None)
        nums = example.nums()
        if is_summed:
            specs = layout.grad_specs(args, example.argnums)
        else:
            specs = _fsdp.out_specs(accumulators, layout.entry)

        def finish(outs: PyTree, total: Any) -> PyTree:
            if is_summed and not layout.reduce_per_microbatch:
                outs = layout.reduce(outs)
            return _fsdp.combine(accumulators, outs, total, layout.axes, reduced=is_summed)

        out, aux = _fsdp.run(
            layout,
            local_loop(layout, size // layout.count),
            nums,
            lambda where: axes.spec(where) is not None,
            (args, kwargs, weights),
            specs,
            finish,
        )
        if not is_summed:  # a transform's sums come back whole: laid out as promised
            params = _differentiated(example.argnums, args)
            out = _fsdp.like_parameters(out, params, layout.grad_specs(args, example.argnums))
        return out, aux

    unsplit = _signature.UnsplitBatchWarning(axes, grad_nums, batch_argnums)

    gather = is_summed and wanted and method in ("auto", "ghost", "two_pass")

    def checked(*args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        positional, named = axes.to_positions(args, kwargs)
        example.check_differentiable(positional)
        unsplit.check(positional)
        nums = example.nums()
        first = _per_example.find_batched(axes, positional, named)
        differentiated = jax.tree.leaves([positional[i] for i in nums if i < len(positional)])
        layout = None
        if first is not None and not batched_grad:  # else the loop says what is missing
            given = _fsdp.given_specs(param_specs, _differentiated(example.argnums, positional))
            layout = _fsdp.layout(first, differentiated, settings.mesh_axes, trade, given)
        if layout is not None and per_shard and _runs_per_shard(layout, settings):
            explicit = _sharding.explicit_sharding(first) is not None
            if not (explicit and _closes_over_traced_values(positional, named)):
                return run_per_shard(layout, settings.size or 0, positional, named)
        positional = _fsdp.gathered_once(layout, nums, positional)
        if gather and settings.mesh_axes:
            # The per-example norms read every parameter on every shard: gathered once
            # here, not once per microbatch by XLA inside the loop.
            positional = tuple(
                _layout.replicated(a) if i in nums else a for i, a in enumerate(positional)
            )
        return looped(*positional, **named)

    def _closes_over_traced_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``fun`` or the clipping options hold values traced by an enclosing
        ``jit``: a ``shard_map`` on an Explicit mesh cannot close over them (JAX 0.10)."""
        bound = () if clipping is None else (clipping.bound, clipping.normalize_by)
        kwargs = {k: v for k, v in kwargs.items() if k != "example_weights"}

        def plain(x: Any) -> Any:  # its shape and dtype only: no layout to check
            if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype)
            return x

        args, kwargs = jax.tree.map(plain, (args, kwargs))
        closed = jax.make_jaxpr(_vmap.vmapped(example.loss, axes, jax.vmap))(*args, **kwargs)
        return any(isinstance(x, Tracer) for x in [*jax.tree.leaves(bound), *closed.consts])

    return wraps(fun, checked, axes, settings, weights=True, describe=describe)


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
