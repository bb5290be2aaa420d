"""What the transforms need to know about explicit sharding (``AxisType.Explicit`` meshes).

Under an Auto mesh (or none) JAX's sharding propagation places every intermediate
itself, and nothing here applies. Under an Explicit mesh the sharding is part of each
array's type, so the views, microbatches and buffers the transforms build must state it.
"""

import contextlib
import math
from collections.abc import Iterable
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


def varying_of(value: Any) -> tuple[str, ...]:
    """The manual mesh axes that a JAX array (or tracer) varies over; () for anything
    else, which is the same on every device (a NumPy array, a Python number)."""
    return varying(jax.typeof(value)) if isinstance(value, jax.Array) else ()
