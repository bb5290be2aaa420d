"""The loop: ``microbatch``, and ``loop``, which ``micro_vmap`` and ``micro_grad`` build on."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from . import (
    _accumulators,
    _batch,
    _checks,
    _eager,
    _gradients,
    _layout,
    _programs,
    _progress,
    _sharding,
    _signature,
)
from ._accumulators import AccumulationType
from ._batch import Batch
from ._signature import OPTIONS, RESERVES, WEIGHTS, BatchAxes
from ._typing import AccumulatorTree, Count, Function, InAxes, P


def microbatch(
    fun: Callable[P, Any],
    argnums: int | tuple[int, ...] | list[int],
    microbatch_size: int | None,
    accumulator: AccumulatorTree = AccumulationType.SUM,
    *,
    argnames: str | tuple[str, ...] | list[str] = (),
    in_axes: InAxes = 0,
    num_real_microbatches: Count = None,
    accumulation_dtype: Any = None,
    progress: bool = False,
    allow_remainder: bool = False,
) -> Callable[P, Any]:
    """Runs ``fun`` on one microbatch at a time and combines the results.

    The returned function takes the same arguments as ``fun``. It splits every batch
    argument into ``batch_size // microbatch_size`` microbatches, calls ``fun`` on each
    inside a single ``jax.lax.fori_loop`` and folds the results with ``accumulator``.
    Microbatch ``i`` holds rows ``i, i + n, i + 2n, ...`` of the batch (``n`` the number
    of microbatches); it is read in place, so the batch is never copied. With
    ``allow_remainder=True`` a batch of ``n * microbatch_size + r`` rows is split the
    same way in its first ``n * microbatch_size`` rows, and ``fun`` is called once more,
    after the loop, on the last ``r`` rows.

    Args:
      fun: The function to run; it must accept a microbatch wherever it accepts the batch.
      argnums: Positions of the arguments that have a batch axis. A batch argument may be
        passed by position or by keyword.
      microbatch_size: Rows per microbatch; it must divide the batch size. None runs
        ``fun`` once on the whole batch.
      accumulator: How to combine the per-microbatch results: an ``AccumulationType``,
        an ``Accumulator``, or a pytree of them that is a prefix of ``fun``'s output.
        optax.microbatching's members and accumulators are accepted too.
      argnames: Names of keyword arguments that have a batch axis.
      in_axes: The batch axis of each argument in ``argnums + argnames`` (one int for
        all). An entry may also be a pytree prefix of its argument, with None for
        leaves that are not batched. Negative axes count from the end.
      num_real_microbatches: Run only microbatches ``0 .. k-1``. An int is checked
        against the number of microbatches; a traced integer is clipped to it and can
        change without recompiling. CONCAT rows of skipped microbatches are zero;
        MEAN still divides by the whole batch (all its microbatches, rows or weights),
        RUNNING_MEAN by the part that ran. Microbatch ``i`` holds strided rows, so
        this does not keep "the first ``k * microbatch_size`` rows".
      accumulation_dtype: The dtype in which the built-in reductions (SUM, MEAN,
        RUNNING_MEAN) accumulate floating results. None, the default, accumulates
        floats narrower than 32 bits in float32. The result keeps ``fun``'s dtype.
      progress: Print a progress bar over the microbatches to standard error, from
        inside the compiled loop (one line per 10% when the output is not a terminal).
      allow_remainder: Accept a batch that ``microbatch_size`` does not divide: the last
        ``r`` rows form one more, smaller microbatch (it counts in
        ``num_real_microbatches``). SUM and CONCAT combine it as any other; MEAN and
        RUNNING_MEAN weight each microbatch by its rows, so that a ``fun`` that averages
        over its rows gives the mean over the whole batch.

    Returns:
      A function with ``fun``'s signature that returns the combined result.

    Raises:
      TypeError, ValueError: At wrap time for bad ``microbatch_size``, ``argnums``,
        ``argnames``, ``in_axes`` or ``accumulator``; at the first call for batch
        arguments that do not fit them.

    >>> import jax.numpy as jnp
    >>> fun = lambda x: (x + 1, jnp.sum(3 * x))
    >>> data = jnp.array([1, 2, 3, 4])
    >>> fun(data)
    (Array([2, 3, 4, 5], dtype=int32), Array(30, dtype=int32))
    >>> strategy = (AccumulationType.CONCAT, AccumulationType.SUM)
    >>> microbatched_fun = microbatch(fun, argnums=0, microbatch_size=2, accumulator=strategy)
    >>> microbatched_fun(data)
    (Array([2, 3, 4, 5], dtype=int32), Array(30, dtype=int32))
    """
    axes = _signature.microbatch_axes(fun, argnums, argnames, in_axes)
    settings = Settings(
        _checks.ensure_microbatch_size(microbatch_size),
        _accumulators.ensure_tree(accumulator),
        _checks.ensure_count(num_real_microbatches),
        _checks.ensure_accumulation_dtype(accumulation_dtype),
        progress=_checks.ensure_bool("progress", progress),
        allow_remainder=_checks.ensure_bool("allow_remainder", allow_remainder),
    )
    return wraps(fun, loop(fun, axes, settings), axes, settings)


STATE_HINT = (
    "microbatching: fun mutates state that lives outside the loop (in Flax NNX, e.g. the "
    "Rngs counter of a Dropout layer), which JAX cannot do from inside a traced loop. Pass "
    "the state in as an argument instead: split the module with `graphdef, state = "
    "nnx.split(model)` and `nnx.merge(graphdef, state)` inside fun, and give each example "
    "its own PRNG key as a batch argument, e.g. `jax.random.split(key, batch_size)`."
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a transform loops, normalised when the user wraps ``fun``.

    Attributes:
      size: ``microbatch_size``.
      accumulator: The accumulator tree (optax's leaves replaced by ours).
      count: ``num_real_microbatches``: None, an int or a traced integer.
      accumulation_dtype: The requested accumulation dtype, or None for the default.
      mesh_axes: ``batch_mesh_axes``.
      progress: Whether the loop reports each microbatch to a progress bar.
      span: The transform's name, for profiler spans and the progress bar.
      allow_remainder: Whether a batch that ``size`` does not divide runs a last,
        partial microbatch.
    """

    size: int | None
    accumulator: Any
    count: Count
    accumulation_dtype: Any
    mesh_axes: tuple[str, ...] | None = None
    progress: bool = False
    span: str = "microbatch"
    allow_remainder: bool = False


@dataclasses.dataclass(frozen=True)
class Options:
    """What a wrapped function was built with: its batch arguments and its settings.

    Set on every wrapper as ``__microbatching__``, so that ``plan`` can find the batch in
    example arguments.
    """

    axes: BatchAxes
    settings: Settings

    @property
    def allow_remainder(self) -> bool:
        return self.settings.allow_remainder

    def batch_size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The size of the batch axis that a call with these arguments would split."""
        args, kwargs = self.axes.to_positions(args, kwargs)
        return _batch.locate(self.axes, args, kwargs, None, None).size


def wraps(
    fun: Callable[P, Any],
    wrapper: Function,
    axes: BatchAxes,
    settings: Settings,
    weights: bool = False,
) -> Callable[P, Any]:
    """``wrapper`` with ``fun``'s name, docstring and signature, but no ``__wrapped__``.

    Equinox takes a ``__wrapped__`` attribute as the sign of a JAX transform and warns
    when one becomes a module field; our wrappers are plain functions. With
    ``weights`` the signature also has a keyword-only ``example_weights=None``, so that
    ``inspect.signature(...).bind`` (``eqx.filter_jit``, ``donate_argnames``) accepts it.
    """
    out = functools.wraps(fun, updated=())(_shapes_of_structs(wrapper))
    del out.__wrapped__
    setattr(out, OPTIONS, Options(axes, settings))
    with contextlib.suppress(TypeError, ValueError):  # builtins may have none
        signature = inspect.signature(fun)
        if weights:
            signature = _with_weights(signature)
            setattr(out, RESERVES, True)
        out.__signature__ = signature  # pyright: ignore[reportAttributeAccessIssue]
    return out


def _shapes_of_structs(wrapper: Function) -> Function:
    """``wrapper`` that, called on ``jax.ShapeDtypeStruct`` arguments, returns the shapes
    and dtypes of its result (``jax.eval_shape``), the other arguments held as they are."""

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            return wrapper(*args, **kwargs)
        abstract = [_is_array(leaf) for leaf in leaves]

        def concrete(arrays: list[Any]) -> Any:
            it = iter(arrays)
            full = [next(it) if a else leaf for leaf, a in zip(leaves, abstract, strict=True)]
            args, kwargs = jax.tree.unflatten(treedef, full)
            return wrapper(*args, **kwargs)

        return jax.eval_shape(concrete, [x for x, a in zip(leaves, abstract, strict=True) if a])

    return call


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct | jax.Array | np.ndarray)


def _with_weights(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with a keyword-only ``example_weights=None`` (before ``**kwargs``)."""
    params = list(signature.parameters.values())
    if WEIGHTS in signature.parameters:  # our own wrapper, nested
        return signature
    at = len(params) - (bool(params) and params[-1].kind == inspect.Parameter.VAR_KEYWORD)
    extra = inspect.Parameter(WEIGHTS, inspect.Parameter.KEYWORD_ONLY, default=None)
    return signature.replace(parameters=[*params[:at], extra, *params[at:]])


def loop(fun: Function, axes: BatchAxes, settings: Settings) -> Function:
    """The microbatched ``fun``: locates the batch in each call and runs the loop.

    ``fun`` is called with the call's arguments, each batch argument cut to one microbatch.
    The outer profiler span is ``{span}({fun_name})``; the spans of optax.microbatching
    are there too: ``microbatch_size_{m}`` around the loop and ``{n}_microbatches`` in its
    body.

    For ``micro_vmap`` and ``micro_grad`` (``axes.weights``) ``fun`` also takes the
    microbatch's ``example_weights``: the call's, or with a remainder and built-in
    accumulators, 1 on real rows and 0 on the padding of the last microbatch.

    Each call traces ``fun`` once on an abstract microbatch (and once more on the
    remainder, when it runs apart). Called outside every transformation, the loop around
    those programs is compiled once per fingerprint (``_eager``) and reused.
    """
    size, name = settings.size, f"{settings.span}({axes.fun_name})"
    padded = axes.weights and not _accumulators.is_custom(settings.accumulator)
    cache = _eager.Cache()

    def looped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(name):
            if size is None and axes.transform == "microbatch":
                return fun(*args, **kwargs)
            if axes.weights and WEIGHTS in kwargs and kwargs[WEIGHTS] is None:
                kwargs = {k: v for k, v in kwargs.items() if k != WEIGHTS}
            given = axes.weights and WEIGHTS in kwargs
            if given:
                kwargs = {**kwargs, WEIGHTS: _weights(kwargs[WEIGHTS], axes)}
            count = None if size is None else settings.count
            batch = _batch.locate(axes, args, kwargs, size, count, settings.allow_remainder)
            if size is None and not given:
                return _layout.close(fun(*args, **kwargs))
            m = size
            if m is None:  # example_weights without microbatching: one microbatch of all
                m = max(batch.size, 1)
                batch = _batch.locate(axes, args, kwargs, m, None)
            if batch.remainder:
                _warn_if_sharded(batch, m, settings.mesh_axes, axes)
            if batch.remainder and padded and not given:
                kwargs = {**kwargs, WEIGHTS: jax.numpy.ones(batch.size, bool)}
                batch = _batch.locate(axes, args, kwargs, m, count, True)
            for i in batch.batched:  # before the weights are cut into microbatches
                _layout.check_shards(batch.leaves[i], batch.axes[i] or 0, m, batch.labels[i])
            loop = Loop(batch, m, padded, given, settings.mesh_axes)
            with _sharding.mesh_of(batch.leaves), jax.named_scope(f"microbatch_size_{m}"):
                programs = _trace(fun, loop)
                run = Run(loop.static(), settings, name if settings.progress else None)
                consts, inputs = programs.consts(), loop.inputs()
                if not _eager.is_concrete((consts, inputs)):
                    return run(programs.structure(), consts, inputs)
                keep: list[Any] = []
                key = (run.loop, programs.fingerprint(keep))
                structure = programs.structure()
                compiled = cache.get(key, keep, lambda: jax.jit(functools.partial(run, structure)))
                return compiled(consts, inputs)

    return looped


def _warn_if_sharded(batch: Batch, size: int, mesh_axes: Any, axes: BatchAxes) -> None:
    """A remainder on a sharded batch works, but moves each microbatch between devices.

    (A microbatch size that the shards do not divide is an error, raised later.)
    """
    for i in batch.batched:
        where = _layout.shards(batch.leaves[i], batch.axes[i] or 0, mesh_axes)
        if where is not None and size % where.count == 0:
            padding = (
                " and pass example_weights that are 0 on the padding rows" if axes.weights else ""
            )
            warnings.warn(
                f"allow_remainder on a batch sharded over {where.count} devices: with a "
                f"remainder of {batch.remainder} rows the microbatches no longer line up with "
                "the shards, so each microbatch's rows are gathered across devices. To keep "
                "every row on its device, pad the batch to a multiple of microbatch_size (a "
                f"multiple of {where.count}){padding}.",
                stacklevel=2,
            )
            return


def _weights(weights: Any, axes: BatchAxes) -> jax.Array:
    """``example_weights`` checked: one bool, integer or float per example."""
    shape, dtype = getattr(weights, "shape", None), getattr(weights, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{WEIGHTS} must be an array of one weight per example, got {weights!r} of type "
            f"{type(weights).__name__}; pass e.g. jnp.ones(batch_size) or a boolean mask."
        )
    if len(shape) != 1:
        raise ValueError(
            f"{WEIGHTS} must have shape (batch_size,), one weight per example, got shape "
            f"{tuple(shape)}; pass a vector, e.g. {WEIGHTS}=mask.reshape(-1)."
        )
    kind = np.dtype(dtype)
    if kind == np.bool_ or any(jax.numpy.issubdtype(kind, t) for t in (np.integer, np.floating)):
        return jax.numpy.asarray(weights)
    raise TypeError(
        f"{WEIGHTS} of {axes.transform} must be bool, integer or floating, got dtype {kind}; "
        "pass real weights, or a boolean mask."
    )


def _weighting(batch: Batch, size: int) -> _accumulators.Weighting | None:
    """The weight of each microbatch: the sum of its ``example_weights``, or its rows."""
    full, rem = batch.full, batch.remainder
    if batch.weights is not None:
        w = batch.leaves[batch.weights]
        w = w.astype(jax.numpy.promote_types(w.dtype, jax.numpy.float32))
        parts = [jax.numpy.sum(jax.numpy.reshape(w[: full * size], (size, full)), axis=0)]
        if rem:
            parts.append(jax.numpy.sum(w[full * size :])[None])
        per = jax.numpy.concatenate(parts)
        return _accumulators.Weighting(per, jax.numpy.sum(w), presummed=True)
    if rem:
        per = np.array([size] * full + [rem], np.float32)
        return _accumulators.Weighting(
            jax.numpy.asarray(per), jax.numpy.float32(batch.size), presummed=False
        )
    return None


@dataclasses.dataclass(frozen=True)
class Loop:
    """What the loop reads: the batch, the microbatch size, and how a remainder runs.

    Attributes:
      padded: A remainder runs in the loop as one more microbatch of ``size`` rows, its
        padding rows copies of the last row, masked by the weights (``micro_vmap``,
        ``micro_grad``); else ``fun`` is called once more, after the loop, on the
        remainder alone (``microbatch``, custom accumulators).
      substitute: Rows of weight 0 are replaced by a row of non-zero weight before
        ``fun`` sees them, so that whatever they hold cannot reach a result.
      mesh_axes: ``batch_mesh_axes``.
    """

    batch: Batch
    size: int
    padded: bool
    substitute: bool
    mesh_axes: tuple[str, ...] | None = None

    def runs_remainder_apart(self) -> bool:
        """Whether ``fun`` runs on the remainder alone, after the loop."""
        batch = self.batch
        reached = not isinstance(batch.bound, int) or batch.bound > batch.full
        return bool(batch.remainder) and not self.padded and reached

    def static(self) -> Loop:
        """This loop without arrays: hashable, and the same for calls that loop alike."""
        batch = self.batch
        bound = batch.bound if isinstance(batch.bound, int) else None
        leaves = (None,) * len(batch.leaves)
        return dataclasses.replace(
            self, batch=dataclasses.replace(batch, leaves=leaves, bound=bound)
        )

    def inputs(self) -> tuple[list[Any], Any]:
        """The arrays that ``static`` leaves out: the batched leaves, and a traced bound."""
        batch = self.batch
        bound = None if isinstance(batch.bound, int) else batch.bound
        return [batch.leaves[i] for i in batch.batched], bound

    def filled(self, leaves: list[Any], bound: Any) -> Loop:
        """The static loop with its ``inputs`` put back."""
        batch = self.batch
        all_leaves = list(batch.leaves)
        for i, leaf in zip(batch.batched, leaves, strict=True):
            all_leaves[i] = leaf
        bound = batch.bound if bound is None else bound
        return dataclasses.replace(
            self, batch=dataclasses.replace(batch, leaves=tuple(all_leaves), bound=bound)
        )

    @property
    def trips(self) -> int:
        batch = self.batch
        return batch.num_microbatches if self.padded else batch.full

    def reader(self) -> Callable[[Any], list[Any]]:
        """``read(i)``: the batched leaves of microbatch ``i``, as ``fun`` gets them."""
        batch, size = self.batch, self.size
        batched = batch.batched
        axes = [batch.axes[i] or 0 for i in batched]
        if not batch.remainder:
            views = [
                _layout.split(batch.leaves[i], ax, size, batch.labels[i])
                for i, ax in zip(batched, axes, strict=True)
            ]

            def read(index: Any) -> list[Any]:
                return [_layout.take(v, ax, index) for v, ax in zip(views, axes, strict=True)]

        else:
            for i, ax in zip(batched, axes, strict=True):
                _layout.check_shards(batch.leaves[i], ax, size, batch.labels[i])

            def read(index: Any) -> list[Any]:
                rows, valid = _layout.rows(index, batch.full, batch.remainder, size)
                out = [
                    _layout.take_rows(batch.leaves[i], ax, rows)
                    for i, ax in zip(batched, axes, strict=True)
                ]
                if batch.weights is not None:
                    k = batched.index(batch.weights)
                    out[k] = jax.numpy.where(valid, out[k], jax.numpy.zeros((), out[k].dtype))
                return out

        if not self.substitute or batch.weights is None:
            return read
        weights = batch.leaves[batch.weights]
        k = batched.index(batch.weights)
        refs = [
            None
            if i == batch.weights
            else _layout.kept_row(batch.leaves[i], ax, weights, self.mesh_axes)
            for i, ax in zip(batched, axes, strict=True)
        ]

        def substituted(index: Any) -> list[Any]:
            leaves = read(index)
            keep = leaves[k] != 0
            for j, (ref, ax) in enumerate(zip(refs, axes, strict=True)):
                if ref is not None:
                    shape = [1] * leaves[j].ndim
                    shape[ax] = -1
                    leaves[j] = jax.numpy.where(keep.reshape(shape), leaves[j], ref)
            return leaves

        return substituted

    def remainder(self) -> list[Any]:
        """The batched leaves of the last rows, for ``fun`` called on them alone."""
        batch = self.batch
        rows = jax.numpy.arange(batch.full * self.size, batch.size)
        return [_layout.take_rows(batch.leaves[i], batch.axes[i] or 0, rows) for i in batch.batched]


@dataclasses.dataclass(frozen=True)
class Programs:
    """``fun`` traced on one microbatch, and on the remainder when it runs apart.

    The jaxprs' constants are what ``fun`` closes over: the call's arguments that are not
    batched among them. They are passed to the loop apart from the jaxprs (``consts``),
    so that a compiled loop can be reused for the same ``structure`` with new constants.
    """

    main: ClosedJaxpr
    shapes: Any
    remainder: ClosedJaxpr | None = None

    def consts(self) -> tuple[list[Any], list[Any]]:
        rest = [] if self.remainder is None else list(self.remainder.consts)
        return list(self.main.consts), rest

    def structure(self) -> tuple[Any, Any, Any]:
        rest = None if self.remainder is None else self.remainder.jaxpr
        return self.main.jaxpr, self.shapes, rest

    def fingerprint(self, keep: list[Any]) -> Any:
        rest = None if self.remainder is None else _programs.fingerprint(self.remainder, keep)
        shapes = jax.tree.structure(self.shapes)
        return _programs.fingerprint(self.main, keep), shapes, rest


def _trace(fun: Function, loop: Loop) -> Programs:
    """Traces ``fun`` on an abstract microbatch (and on the remainder, if it runs apart)."""
    batch = loop.batch

    def call(microbatch_leaves: list[Any]) -> Any:
        leaves = list(batch.leaves)
        for i, leaf in zip(batch.batched, microbatch_leaves, strict=True):
            leaves[i] = leaf
        args, kwargs = batch.rebuild(leaves)
        return fun(*args, **kwargs)

    def traced(structs: list[Any]) -> tuple[ClosedJaxpr, Any]:
        try:
            return jax.make_jaxpr(call, return_shape=True)(structs)
        except Exception as err:
            if "different trace level" in str(err):  # Flax NNX state mutated inside the loop
                err.add_note(STATE_HINT)
            raise

    main, shapes = traced(
        [
            _layout.microbatch_struct(batch.leaves[i], batch.axes[i] or 0, loop.size)
            for i in batch.batched
        ]
    )
    if not loop.runs_remainder_apart():
        return Programs(main, shapes)
    remainder, _ = traced(jax.eval_shape(loop.remainder))
    return Programs(main, shapes, remainder)


@dataclasses.dataclass(frozen=True)
class Run:
    """The loop of one call, as a function of arrays only: ``fun``'s programs' structure
    (bound once), their constants, and the batch's leaves with the traced bound.

    Attributes:
      loop: The call's ``Loop``, with no arrays in it (``Loop.static``).
      settings: The transform's settings.
      name: The name of the progress bar, or None.
    """

    loop: Loop
    settings: Settings
    name: str | None

    def __call__(
        self, structure: tuple[Any, Any, Any], consts: tuple[list[Any], list[Any]], inputs: Any
    ) -> Any:
        loop = self.loop.filled(*inputs)
        main, shapes, rest = structure
        batch, m = loop.batch, loop.size
        split = _accumulators.Split(
            batch.num_microbatches, batch.remainder, m, _weighting(batch, m)
        )
        acc = _accumulators.combine(
            self.settings.accumulator, split, self.settings.accumulation_dtype
        )
        if loop.substitute and batch.weights is not None:
            # No example of non-zero weight: no microbatch runs, so that what the rows
            # hold reaches no gradient either (every row would be a stand-in). The skip
            # is the traced bound's, inside the rematerialised step.
            kept = jax.numpy.any(batch.leaves[batch.weights] != 0)
            bound = jax.numpy.where(kept, batch.bound, 0).astype(np.int32)
            loop = dataclasses.replace(loop, batch=dataclasses.replace(batch, bound=bound))
        first = ClosedJaxpr(main, consts[0])
        apart = None if rest is None else ClosedJaxpr(rest, consts[1])
        out = _run(first, shapes, apart, loop, acc, self.settings.accumulation_dtype, self.name)
        return _layout.close(out)


def _run(
    jaxpr: ClosedJaxpr,
    out_shape: Any,
    apart: ClosedJaxpr | None,
    loop: Loop,
    acc: Any,
    requested: Any,
    progress: str | None,
) -> Any:
    """Runs ``fun``'s program ``jaxpr`` on each microbatch in a fori_loop.

    The trip count is static, so reverse-mode differentiation works: a traced
    ``num_real_microbatches`` skips the microbatches past it inside the
    rematerialised step (``_gradients.step``). ``apart`` is ``fun``'s program on the
    remainder, run after the loop. ``progress`` names the bar that each microbatch
    reports to, if any.
    """
    batch = loop.batch
    carry = acc.init(out_shape)
    if not batch.num_microbatches:
        return acc.finalize(carry)
    take = loop.reader()
    out_tree = jax.tree.structure(out_shape)
    bound = batch.bound
    traced = not isinstance(bound, int)
    run = _gradients.step(jaxpr, take, requested, bound if traced else None)

    def fold(index: Any, carry: Any, out: Any) -> Any:
        carry = acc.update(carry, out, index)
        if progress is not None:
            # The barrier makes the index available only once the carry is computed, so
            # the report comes after the microbatch's work. Only the index is taken from
            # it: inside shard_map it would make an unvarying carry varying.
            index = jax.lax.optimization_barrier((index, carry))[0]
            _progress.tick(progress, index, bound)
        return carry

    def body(index: Any, carry: Any) -> Any:
        with jax.named_scope(f"{batch.num_microbatches}_microbatches"):
            out = out_tree.unflatten(run(index))
            if not traced:
                return fold(index, carry, out)
            return jax.lax.cond(index < bound, fold, lambda i, c, o: c, index, carry, out)

    trips = min(bound, loop.trips) if isinstance(bound, int) else loop.trips
    try:
        carry = jax.lax.fori_loop(0, trips, body, carry)
    except TypeError as err:
        shapes = jax.tree.map(lambda x: jax.typeof(x).str_short(), (out_shape, carry))
        raise TypeError(
            "The accumulator could not fold a microbatch result into its carry: "
            f"fun returns {shapes[0]} and init made the carry {shapes[1]}. A custom "
            "Accumulator's init must return the carry that its update takes and returns. "
            f"({err})"
        ) from err
    if apart is not None:
        carry = _remainder(apart, out_tree, loop, acc, carry, progress)
    return acc.finalize(carry)


def _remainder(
    apart: ClosedJaxpr, out_tree: Any, loop: Loop, acc: Any, carry: Any, progress: str | None
) -> Any:
    """Folds ``fun`` of the last, partial microbatch into the carry, as microbatch ``full``."""
    batch, full = loop.batch, loop.batch.full

    def fold(carry: Any) -> Any:
        with jax.named_scope("remainder"):
            outs = jaxpr_as_fun(apart)(*loop.remainder())
            carry = acc.update(carry, out_tree.unflatten(outs), full)
            if progress is not None:
                leaves = jax.tree.leaves(carry)
                after = jax.numpy.sum(jax.numpy.ravel(leaves[0])[:1]) if leaves else None
                _progress.tick(progress, full, batch.bound, after)
            return carry

    bound = batch.bound
    if isinstance(bound, int):
        return fold(carry) if bound > full else carry
    return jax.lax.cond(bound > full, fold, lambda c: c, carry)
