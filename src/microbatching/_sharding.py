"""What the transforms need to know about explicit sharding (``AxisType.Explicit`` meshes).

Under an Auto mesh (or none) JAX's sharding propagation places every intermediate
itself, and nothing here applies. Under an Explicit mesh the sharding is part of each
array's type, so the views, microbatches and buffers the transforms build must state it,
and a branch on a predicate that ``jax.vmap`` may map goes through ``cond``.
"""

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.core import AbstractValue
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def explicit_sharding(x: Any) -> NamedSharding | None:
    """The sharding of an array, tracer, ShapeDtypeStruct or abstract value if its mesh has
    Explicit axes."""
    sharding = type_of(x).sharding
    if isinstance(sharding, NamedSharding) and sharding.mesh.explicit_axes:
        return sharding
    return None


def type_of(x: Any) -> Any:
    """The type of an array or tracer; a ShapeDtypeStruct or an abstract value is its own."""
    if isinstance(x, jax.ShapeDtypeStruct | AbstractValue):
        return x
    return jax.typeof(x)


def entries(spec: PartitionSpec, ndim: int) -> list[Any]:
    """A partition spec as a list with one entry per axis of an ``ndim``-dimensional
    array (None for the axes it leaves out)."""
    return [*spec, *[None] * (ndim - len(spec))]


def with_spec(sharding: NamedSharding, spec: list[Any]) -> NamedSharding:
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def num_shards(sharding: NamedSharding, entry: Any) -> int:
    """Into how many pieces a spec entry (None, a mesh axis or a tuple of them) cuts an axis."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(sharding.mesh.shape[name] for name in names)


def mesh_of(leaves: Iterable[Any]) -> contextlib.AbstractContextManager[Any]:
    """Enters the mesh of explicitly sharded concrete inputs when no mesh is set.

    Inside ``jax.set_mesh`` (or ``jit`` with one) this does nothing. Called eagerly on
    arrays placed on an Explicit mesh, the loop still needs that mesh as context.
    """
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)  # None for tracers
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        if isinstance(mesh, Mesh) and mesh.explicit_axes:
            return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def full(struct: Any, fill: Any, dtype: Any = None) -> jax.Array:
    """An array of ``struct``'s shape filled with ``fill``, of its type: its Explicit
    sharding, and inside ``shard_map`` the manual mesh axes it varies over.

    (``jax.lax.full_like`` of such a struct fails inside a ``shard_map`` that leaves some
    mesh axes automatic. ``jnp.zeros(())`` alone is typed on no mesh at all: differentiated
    inside ``vmap`` over an Explicit axis, its cotangent's reshard onto that empty mesh
    fails in JAX 0.10.2.)
    """
    aval = type_of(struct)
    dtype = aval.dtype if dtype is None else dtype
    out = jax.numpy.full(aval.shape, fill, dtype, out_sharding=explicit_sharding(struct))
    axes = varying(aval)
    return jax.lax.pcast(out, axes, to="varying") if axes else out


def varying(aval: Any) -> tuple[str, ...]:
    """The manual mesh axes (inside ``shard_map``) over which values of type ``aval`` (an
    abstract value or a ``ShapeDtypeStruct``) vary; () elsewhere."""
    manual = getattr(aval, "manual_axis_type", None)
    return tuple(sorted(getattr(manual, "varying", ())))


def varying_over(value: Any, axes: Any) -> Any:
    """``value`` typed as varying over the manual mesh axes ``axes`` too (inside
    ``shard_map``): ``jax.lax.pcast`` over those it does not vary over yet."""
    missing = tuple(a for a in axes if a not in varying(jax.typeof(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


def varying_of(value: Any) -> tuple[str, ...]:
    """The manual mesh axes that a JAX array (or tracer) varies over; () for anything
    else, which is the same on every device (a NumPy array, a Python number)."""
    return varying(jax.typeof(value)) if isinstance(value, jax.Array) else ()


def cond(
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
) -> Any:
    """``jax.lax.cond(pred, true_fun, false_fun, *operands)``, also where ``jax.vmap``
    maps ``pred`` over values sharded on an Explicit mesh.

    There JAX 0.10.2 turns a cond of a mapped predicate into a ``select`` whose predicate
    it broadcasts without a sharding, and the select refuses every sharded operand or
    result ("select `which` must be scalar or have the same sharding as cases"). Here the
    cond's own predicate is never mapped: it is whether ``pred`` holds for any of the
    mapped values (``_anyone``). Inside, each mapped value takes ``true_fun``'s result
    where its own ``pred`` holds and ``false_fun``'s elsewhere, as JAX's select does, and
    the side that a value does not take sees zeros in place of its floating inputs, so
    that no derivative of that side reaches them: a zero cotangent times the side's own
    derivative, infinite or NaN on data it was never meant to read, would be NaN, and
    the select stops it where a product would not. Its inputs are the ``operands`` and
    what each branch closes over (the batch a loop body slices, the parameters, a jvp
    rule's tangents), hoisted by ``jax.closure_convert``. A select with zeros is linear,
    so it also guards values linear in a derivative's tangents (``_dropped``'s branch),
    which ``stop_gradient`` could not: it has no transpose.
    Unmapped, those selects are on a constant True (``_mine``), which XLA folds away.
    """
    true_run, true_held = jax.closure_convert(true_fun, *operands)
    false_run, false_held = jax.closure_convert(false_fun, *operands)

    def either(pred: Any, operands: Any, true_held: Any, false_held: Any) -> Any:
        taken = true_run(*_guard(pred, True, (*operands, *true_held)))
        other = false_run(*_guard(pred, False, (*operands, *false_held)))
        return _pick(pred, taken, other)

    def skipped(pred: Any, operands: Any, true_held: Any, false_held: Any) -> Any:
        return false_run(*operands, *false_held)

    held = (operands, true_held, false_held)
    return jax.lax.cond(_anyone(pred), either, skipped, pred, *held)


def varying_like(x: Any, rows: Any) -> Any:
    """``x`` (rows on axis 0) plus an exact 0 made from the booleans ``rows``, one per row.

    Under ``jax.vmap`` over the shards of a batch on an Explicit mesh
    (``_per_example.by_shard``), a value that does not depend on the rows (a bias's
    site input) is unmapped, and JAX's batching rules broadcast it without the mapped
    values' sharding: a gather of it at mapped indices cannot resolve its sharding. An
    elementwise sum takes the mapped operand's; XLA folds the 0 away."""
    zero = jax.numpy.logical_and(rows, False)
    zero = jax.numpy.reshape(zero, zero.shape + (1,) * (jax.numpy.ndim(x) - 1))
    if jax.numpy.result_type(x) == jax.numpy.bool_:
        return jax.numpy.logical_or(x, zero)
    return x + zero.astype(jax.numpy.result_type(x))


_TRANSPOSABLE = contextvars.ContextVar("transposable_branches", default=False)


@contextlib.contextmanager
def transposable_branches() -> Any:
    """While a step is traced for ``_dropped``'s derivative, the library's branches on the
    data (``data_cond``) go through ``cond``. That derivative is a jvp that ``jax.grad``
    transposes; under ``jax.vmap`` over the data JAX turns a ``lax.cond`` of a mapped
    predicate into a select whose untaken side passes through ``stop_gradient``, which
    has no transpose. Elsewhere they stay plain ``lax.cond``s: one
    branch, nothing added to the program."""
    token = _TRANSPOSABLE.set(True)
    try:
        yield
    finally:
        _TRANSPOSABLE.reset(token)


def data_cond(pred: Any, true_fun: Callable[..., Any], false_fun: Callable[..., Any]) -> Any:
    """``jax.lax.cond(pred, true_fun, false_fun)`` for a branch that only saves work (both
    sides give the same values where ``pred`` holds): ``cond`` inside
    ``transposable_branches``."""
    if _TRANSPOSABLE.get() and not varying(jax.typeof(pred)):
        return cond(pred, true_fun, false_fun)
    # A predicate that varies over ``shard_map``'s axes stays a ``lax.cond``: ``cond``'s
    # guards would make what its branches hold vary where their programs, traced before,
    # do not expect it.
    return jax.lax.cond(pred, true_fun, false_fun)


@jax.custom_batching.custom_vmap
def _anyone(pred: Any) -> Any:
    """Whether ``pred`` holds for any value that ``jax.vmap`` maps it over: never mapped
    itself (under nested maps, reduced over each); unmapped, ``pred``."""
    return pred


@_anyone.def_vmap
def _anyone_mapped(axis_size: int, in_batched: Any, pred: Any) -> tuple[Any, bool]:
    del axis_size, in_batched  # one argument: the rule runs only where it is mapped
    return _anyone(jax.numpy.any(pred, axis=0)), False  # still mapped under an outer vmap


@jax.custom_batching.custom_vmap
def _mine(pred: Any) -> Any:
    """Whether ``pred`` holds for this mapped value: ``pred`` where ``jax.vmap`` maps it;
    unmapped, True (``cond``'s branch runs only where it holds), a constant to XLA."""
    return jax.numpy.logical_or(pred, True)


@_mine.def_vmap
def _mine_mapped(axis_size: int, in_batched: Any, pred: Any) -> tuple[Any, bool]:
    del axis_size, in_batched
    return pred, True


def _recomputed(fun: Callable[..., Any], static_argnums: tuple[int, ...] = ()) -> Any:
    """``fun`` rematerialised: a derivative recomputes ``_mine`` from ``pred`` rather
    than keeping it (a loop's derivative would keep one per iteration, and its selects
    would stay in the program where they select nothing). Not under ``JAX_REMAT3``
    (jax 0.10.2), whose checkpoint JAX cannot transpose once its JVP is taken (as
    ``_dropped``'s derivative does): there ``fun`` runs as it is, the same values."""
    checkpointed = jax.checkpoint(fun, prevent_cse=False, static_argnums=static_argnums)

    @functools.wraps(fun)
    def run(*args: Any) -> Any:
        return (fun if getattr(jax.config, "jax_remat3", False) else checkpointed)(*args)

    return run


def _guard_values(pred: Any, side: bool, values: Any) -> Any:
    """``values`` for each mapped value that takes ``side`` (its ``pred`` is ``side``),
    else zeros (floating leaves: the others carry no derivative)."""
    mine = _mine(pred)
    keep = mine if side else jax.numpy.logical_not(mine)

    def one(x: Any) -> Any:
        if not jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact):
            return x
        return jax.lax.select(keep, x, jax.numpy.zeros_like(x))

    return jax.tree.map(one, values)


def _pick_values(pred: Any, taken: Any, other: Any) -> Any:
    """``taken`` for each mapped value for which ``pred`` holds, else ``other``."""
    mine = _mine(pred)
    return jax.tree.map(lambda a, b: jax.lax.select(mine, a, b), taken, other)


_guard = _recomputed(_guard_values, static_argnums=(1,))
_pick = _recomputed(_pick_values)
