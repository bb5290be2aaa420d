"""``micro_grad``: per-example gradients, transformed and accumulated one microbatch at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from . import _accumulators, _arguments
from ._accumulators import AccumulationType
from ._typing import Count, P, PyTree
from ._vmap import micro_vmap


class Aux(NamedTuple):
    """Per-example outputs of a ``micro_grad`` function, each stacked on axis 0.

    Attributes:
      values: The value of ``fun`` for each example.
      metrics: ``metrics_fn`` of each example's gradient.
      aux: The auxiliary output of ``fun`` for each example (None without ``has_aux``).

    >>> Aux(values=1.0, metrics=None, aux=None).values
    1.0
    """

    values: PyTree
    metrics: PyTree
    aux: PyTree


def _identity(tree: PyTree) -> PyTree:
    return tree


def _no_metrics(tree: PyTree) -> None:
    del tree


def micro_grad(
    fun: Callable[P, Any],
    has_aux: bool = False,
    argnums: int | tuple[int, ...] = 0,
    *,
    batch_argnums: int | tuple[int, ...] = 1,
    keep_batch_dim: bool = True,
    microbatch_size: int | None = None,
    accumulator: Any = AccumulationType.SUM,
    transform_fn: Callable[[PyTree], PyTree] = _identity,
    metrics_fn: Callable[[PyTree], PyTree] = _no_metrics,
    num_real_microbatches: Count = None,
) -> Callable[P, tuple[PyTree, Aux]]:
    """Computes per-example gradients, transforms them and accumulates them over the batch.

    For every example ``b`` the returned function computes
    ``value_b, g_b = jax.value_and_grad(fun, argnums)(..., example_b, ...)``, then
    returns ``(accumulate(transform_fn(g_b)), Aux(values, metrics_fn(g_b), aux))``.
    Gradients are computed ``microbatch_size`` examples at a time, so the per-example
    gradients of the whole batch never exist at once. Clipping each gradient in
    ``transform_fn`` and summing gives the DP-SGD update.

    Args:
      fun: A scalar loss, e.g. ``fun(params, batch, ...)``.
      has_aux: Whether ``fun`` returns ``(loss, aux)``.
      argnums: The argument(s) to differentiate.
      batch_argnums: The argument(s) with a batch axis 0. Keyword arguments of the call
        are mapped along axis 0 as well, as in ``jax.vmap``.
      keep_batch_dim: If True, ``fun`` sees each example as a batch of one (axis 0 of
        size 1); if False, without the batch axis.
      microbatch_size: Examples per microbatch; None does the whole batch at once.
      accumulator: How to combine the transformed gradients (default SUM).
      transform_fn: Applied to each example's gradient before accumulation.
      metrics_fn: Applied to each example's gradient before ``transform_fn``; returned
        per example in ``Aux.metrics``, so keep it small (a norm, a sign...).
      num_real_microbatches: See ``microbatch``.

    Returns:
      A function returning ``(accumulated transformed gradients, Aux)``.

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
    batch_nums = _arguments.BatchArguments.create(
        fun, batch_argnums, (), 0, "batch_argnums"
    ).argnums
    grad_nums = _arguments.BatchArguments.create(fun, argnums, (), 0).argnums
    _accumulators.check_tree(accumulator)
    loss_and_aux = fun if has_aux else lambda *a, **k: (fun(*a, **k), None)
    value_and_grad = jax.value_and_grad(
        loss_and_aux, grad_nums if isinstance(argnums, Sequence) else grad_nums[0], has_aux=True
    )

    def per_example(*args: Any, **kwargs: Any) -> tuple[PyTree, Aux]:
        if keep_batch_dim:
            args = tuple(
                jax.tree.map(lambda x: x[None], a) if i in batch_nums else a
                for i, a in enumerate(args)
            )
        (value, aux), grads = value_and_grad(*args, **kwargs)
        return transform_fn(grads), Aux(value, metrics_fn(grads), aux)

    name = _arguments.function_name(fun)

    @functools.wraps(fun, updated=())
    def gradients(*args: P.args, **kwargs: P.kwargs) -> tuple[PyTree, Aux]:
        with jax.named_scope(f"micro_grad({name})"):
            if max(batch_nums) >= len(args):
                raise TypeError(
                    f"{batch_argnums=} but {name} was called with {len(args)} positional "
                    "argument(s); pass the batch arguments by position."
                )
            _arguments.check_mapped_keywords(
                kwargs, "micro_grad", "by position, outside batch_argnums"
            )
            mapped = micro_vmap(
                per_example,
                in_axes=[0 if i in batch_nums else None for i in range(len(args))],
                microbatch_size=microbatch_size,
                accumulator=(accumulator, AccumulationType.CONCAT),
                num_real_microbatches=num_real_microbatches,
            )
            return mapped(*args, **kwargs)

    return gradients
