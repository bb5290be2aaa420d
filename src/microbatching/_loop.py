"""The loop: runs ``fun`` on each microbatch of one call and folds the results.

``loop`` is what all three transforms build on. At each call it locates the batch
(``_batch``), traces ``fun`` once on an abstract microbatch (``Programs``), and runs the
programs in a ``fori_loop`` (``Run``); outside every transformation the compiled loop
is reused by the programs' fingerprint (``_eager``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
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
    _layout,
    _programs,
    _progress,
    _remat,
    _sharding,
    _xla_cpu,
)
from ._batch import Batch
from ._signature import SHAPES_NOTE, BatchAxes, first_few
from ._typing import Function
from ._wrap import Settings

STATE_HINT = (
    "microbatching: fun mutates state that lives outside the loop (in Flax NNX, e.g. the "
    "Rngs counter of a Dropout layer), which JAX cannot do from inside a traced loop. Pass "
    "the state in as an argument instead: split the module with `graphdef, state = "
    "nnx.split(model)` and `nnx.merge(graphdef, state)` inside fun, and give each example "
    "its own PRNG key as a batch argument, e.g. `jax.random.split(key, batch_size)`. If fun "
    "merges already and updates the state under `jax.grad` (BatchNorm's statistics in "
    "training mode), merge a copy, `nnx.merge(graphdef, state, copy=True)`, and return the "
    "updated statistics, e.g. `nnx.state(model, nnx.BatchStat)` with `has_aux=True`."
)


def loop(body: Function, axes: BatchAxes, settings: Settings) -> Function:
    """The microbatched ``body``: ``looped(args, kwargs, weights, bind=None)`` plans each
    call and runs the loop; a ``bind`` other than None is passed to ``body`` first (the
    call's ``micro_grad`` plan).

    ``body(weights, *args, **kwargs)`` is called with the call's arguments, each batch
    argument cut to one microbatch, and the microbatch's ``example_weights``: the call's,
    1 on real rows and 0 on the padding of a last microbatch (``micro_vmap`` and
    ``micro_grad`` with built-in accumulators), or None. The outer profiler span is
    ``{span}({fun_name})``; the spans of optax.microbatching are there too:
    ``microbatch_size_{m}`` around the loop and ``{n}_microbatches`` in its body.

    Each call traces ``body`` once on an abstract microbatch (and once more on the
    remainder, when it runs apart). Called outside every transformation, the loop around
    those programs is compiled once per fingerprint (``_eager``) and reused.
    """
    size, name = settings.size, f"{settings.span}({axes.fun_name})"
    custom = _accumulators.is_custom(settings.accumulator)
    padded = axes.weights and not custom
    # A custom Accumulator's functions are traced with the loop, not with ``body``: the
    # fingerprint cannot see what they read, so its loop is not reused between calls.
    cache = _eager.Cache()

    def looped(
        args: tuple[Any, ...], kwargs: dict[str, Any], weights: Any, bind: Any = None
    ) -> Any:
        step = body if bind is None else functools.partial(body, bind)
        with jax.named_scope(name):
            count = None if size is None else settings.count
            batch = _batch.locate(
                axes, args, kwargs, weights, size, count, settings.allow_remainder, padded
            )
            if batch.microbatch_size is None:  # no microbatching, no weights
                return _layout.close(step(None, *args, **kwargs))
            m = batch.microbatch_size
            if batch.remainder:
                _warn_if_sharded(batch, m, settings.mesh_axes, axes)
            for i in batch.batched:  # before the weights are cut into microbatches
                _layout.check_shards(batch.leaves[i], batch.axes[i] or 0, m, batch.labels[i])
            loop = Loop(batch, m, padded, batch.substitute, settings.mesh_axes)
            with _sharding.mesh_of(batch.leaves), jax.named_scope(f"microbatch_size_{m}"):
                programs = _trace(step, loop)
                run = Run(loop.static(), settings, name if settings.progress else None)
                consts, inputs = programs.consts(), loop.inputs()
                if custom or not _eager.is_concrete((consts, inputs)):
                    return run(programs.structure(), consts, inputs)
                identities: list[Any] = []
                key = (run.loop, programs.fingerprint(identities))
                structure = programs.structure()
                compiled = cache.get(
                    key, identities, lambda: jax.jit(functools.partial(run, structure))
                )
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
            _checks.warn(
                f"allow_remainder on a batch sharded over {where.count} devices: with a "
                f"remainder of {batch.remainder} rows the microbatches no longer line up with "
                "the shards, so each microbatch's rows are gathered across devices. To keep "
                "every row on its device, pad the batch to a multiple of microbatch_size (a "
                f"multiple of {where.count}){padding}."
            )
            return


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
        leaves = [batch.leaves[i] for i in batched]
        if not batch.remainder:
            views = [
                _layout.split(leaf, ax, size, batch.labels[i])
                if _layout.reads_view(leaf, ax, self.mesh_axes)
                else None
                for i, leaf, ax in zip(batched, leaves, axes, strict=True)
            ]

            def read(index: Any) -> list[Any]:
                rows = index + batch.full * jax.numpy.arange(size)
                return [
                    _layout.take_rows(leaf, ax, rows) if v is None else _layout.take(v, ax, index)
                    for v, leaf, ax in zip(views, leaves, axes, strict=True)
                ]

        else:
            for i, ax in zip(batched, axes, strict=True):
                _layout.check_shards(batch.leaves[i], ax, size, batch.labels[i])

            def read(index: Any) -> list[Any]:
                rows, valid = _layout.rows(index, batch.full, batch.remainder, size)
                out = [
                    _layout.take_rows(leaf, ax, rows) for leaf, ax in zip(leaves, axes, strict=True)
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


def _trace(body: Function, loop: Loop) -> Programs:
    """Traces ``body`` on an abstract microbatch (and on the remainder, if it runs apart)."""
    batch = loop.batch

    def call(microbatch_leaves: list[Any]) -> Any:
        leaves = list(batch.leaves)
        for i, leaf in zip(batch.batched, microbatch_leaves, strict=True):
            leaves[i] = leaf
        args, kwargs = batch.rebuild(leaves)
        return body(batch.weights_of(leaves), *args, **kwargs)

    def traced(structs: list[Any]) -> tuple[ClosedJaxpr, Any]:
        try:
            program, shapes = jax.make_jaxpr(call, return_shape=True)(structs)
        except Exception as err:
            if _mutates_outer_state(err):
                err.add_note(STATE_HINT)
            elif isinstance(err, TypeError | ValueError | IndexError):
                whole = _whole_batch_sized(batch)
                notes = getattr(err, "__notes__", [])
                if whole:
                    err.add_note(_WHOLE.format(size=batch.size, rows=loop.size, whole=whole))
                elif not any(n.startswith((SHAPES_NOTE, _SPLIT_START)) for n in notes):
                    err.add_note(_split(batch, loop.size))
            raise
        return _xla_cpu.rewrite(program), shapes

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


_WHOLE = (
    "microbatching: fun ran on microbatches of {rows} rows of the batch arguments, and got "
    "{whole} whole, though its axis 0 has the batch's size, {size}. If it is part of the "
    "batch, add it to the batch arguments: argnums (microbatch), in_axes (micro_vmap) or "
    "batch_argnums (micro_grad)."
)


_SPLIT_START = "microbatching: fun ran on microbatches of"
_SPLIT = (
    _SPLIT_START + " {rows} rows of the batch arguments ({split}). If one of them is not "
    "a batch, leave it out of the batch arguments: argnums (microbatch), in_axes "
    "(micro_vmap) or batch_argnums (micro_grad)."
)


def _split(batch: Batch, rows: int) -> str:
    """The note on an error inside ``fun`` with no argument left whole at the batch's
    size: the arguments split into microbatches, as ``fun`` saw them (up to four)."""
    seen = [
        f"`{batch.labels[i]}` as shape "
        f"{_layout.microbatch_struct(batch.leaves[i], batch.axes[i] or 0, rows).shape}"
        for i in batch.batched
        if i != batch.weights
    ]
    return _SPLIT.format(rows=rows, split=first_few(seen))


def _whole_batch_sized(batch: Batch) -> str:
    """The arguments passed to ``fun`` whole whose axis 0 has the batch's size, named for
    a note: the usual cause of a shape error inside ``fun`` is one of them left out of
    the batch arguments."""
    batched = set(batch.batched)
    found = [
        f"`{label}` (shape {tuple(np.shape(leaf))})"
        for i, (leaf, label) in enumerate(zip(batch.leaves, batch.labels, strict=False))
        if i not in batched
        and i != batch.weights
        and np.ndim(leaf)
        and np.shape(leaf)[0] == batch.size
    ]
    return ", ".join(found)


def _mutates_outer_state(err: Exception) -> bool:
    """Whether ``err`` is Flax's refusal to mutate state from inside a traced loop.

    Flax is never imported here: if it raised the error, its module is loaded already.
    """
    errors = sys.modules.get("flax.errors")
    context = getattr(errors, "TraceContextError", None)
    return isinstance(context, type) and isinstance(err, context)


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
        live = None
        if loop.substitute and batch.weights is not None:
            # No example of non-zero weight: no microbatch runs, so that what the rows
            # hold reaches no gradient either (every row would be a stand-in).
            live = jax.numpy.any(batch.leaves[batch.weights] != 0)
            varying = _sharding.varying(jax.typeof(live))
            if varying:  # inside shard_map: every device runs, or none (the body may hold
                # collectives that a device skipping it would leave the others waiting on)
                live = jax.lax.psum(live.astype(jax.numpy.int32), varying) > 0
        first = ClosedJaxpr(main, consts[0])
        apart = None if rest is None else ClosedJaxpr(rest, consts[1])
        requested = self.settings.accumulation_dtype
        pin = self.settings.pin_consts
        return _layout.close(_run(first, shapes, apart, loop, acc, requested, self.name, live, pin))


def _run(
    jaxpr: ClosedJaxpr,
    out_shape: Any,
    apart: ClosedJaxpr | None,
    loop: Loop,
    acc: Any,
    requested: Any,
    progress: str | None,
    live: Any = None,
    pin: bool = False,
) -> Any:
    """Runs ``fun``'s program ``jaxpr`` on each microbatch in a fori_loop.

    The trip count is static, so reverse-mode differentiation works: a traced
    ``num_real_microbatches`` skips the microbatches past it, and a traced ``live``
    that is False skips all of them, inside the rematerialised step (``_remat.step``).
    ``apart`` is ``fun``'s program on the remainder, run after the loop. ``progress``
    names the bar that each microbatch reports to, if any. ``pin``: see
    ``Settings.pin_consts``.
    """
    batch = loop.batch
    carry = acc.init(out_shape)
    if not batch.num_microbatches:
        return acc.finalize(carry)
    take = loop.reader()
    out_tree = jax.tree.structure(out_shape)
    bound = batch.bound
    runs = _runs(bound, live)
    run = _remat.step(jaxpr, take, requested, runs, pin)

    def fold(index: Any, carry: Any, out: Any) -> Any:
        carry = acc.update(carry, out, index)
        if progress is not None:
            # The barrier makes the index available only once the carry is computed, so
            # the report comes after the microbatch's work. Only the index is taken from
            # it: inside shard_map it would make an unvarying carry varying.
            index = jax.lax.optimization_barrier((index, carry))[0]
            _progress.tick(progress, index, bound, runs=True if runs is None else runs(index))
        return carry

    def body(index: Any, carry: Any) -> Any:
        with jax.named_scope(f"{batch.num_microbatches}_microbatches"):
            out = out_tree.unflatten(run(index))
            if runs is None:
                return fold(index, carry, out)
            return _sharding.cond(runs(index), fold, lambda i, c, o: c, index, carry, out)

    trips = min(bound, loop.trips) if isinstance(bound, int) else loop.trips
    try:
        carry = jax.lax.fori_loop(0, trips, body, carry)
    except TypeError as err:
        if _folds(acc, carry, out_shape):
            raise  # not the accumulator's: an error of fun's program, JAX's own message
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


def _folds(acc: Any, carry: Any, out_shape: Any) -> bool:
    """Whether ``acc.update`` folds a result of ``out_shape`` into ``carry``, keeping its
    types (the loop's condition on its carry)."""

    def types(tree: Any) -> Any:
        return jax.tree.map(lambda x: (x.shape, x.dtype), tree)

    try:
        folded = jax.eval_shape(lambda c, o: acc.update(c, o, 0), carry, out_shape)
    except (TypeError, ValueError):
        return False
    same = jax.tree.structure(folded) == jax.tree.structure(carry)
    return same and types(folded) == types(carry)


def _runs(bound: Any, live: Any) -> Callable[[Any], Any] | None:
    """Whether microbatch ``index`` runs, where that is traced: below a traced bound, and
    ``live``; None when every microbatch of the (static) trip count runs."""
    if isinstance(bound, int) and live is None:
        return None

    def runs(index: Any) -> Any:
        below = True if isinstance(bound, int) else index < bound
        return jax.numpy.logical_and(below, True if live is None else live)

    return runs


def _remainder(
    apart: ClosedJaxpr, out_tree: Any, loop: Loop, acc: Any, carry: Any, progress: str | None
) -> Any:
    """Folds ``fun`` of the last, partial microbatch into the carry, as microbatch ``full``."""
    bound, full = loop.batch.bound, loop.batch.full

    def fold(carry: Any) -> Any:
        with jax.named_scope("remainder"):
            outs = jaxpr_as_fun(apart)(*loop.remainder())
            carry = acc.update(carry, out_tree.unflatten(outs), full)
            if progress is not None:
                leaves = jax.tree.leaves(carry)
                after = jax.numpy.sum(jax.numpy.ravel(leaves[0])[:1]) if leaves else None
                _progress.tick(progress, full, bound, after, bound > full)
            return carry

    if isinstance(bound, int):
        return fold(carry) if bound > full else carry
    return _sharding.cond(bound > full, fold, lambda c: c, carry)
