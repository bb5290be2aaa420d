"""The clipped (or weighted) sum of the per-example gradients by book-keeping at the
sites, and its guard against underflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _clipping, _layout, _sharding
from .._primitives import facts
from .program import Program
from .recorder import Recorded, _site_outputs, at_rows
from .rules.direct import _direct_sites, _free_with, chunk, per_example_grads
from .rules.gram import GRAM_TOLERANCE


def clipped_sum(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    scale: jax.Array,
    groups: Sequence[int],
    clean: bool,
    norms: jax.Array | None = None,
    kept: jax.Array | None = None,
) -> list[Any]:
    """``sum_b scale[b, groups[leaf]] * g_b`` for every leaf: one product per site at
    the scaled cotangents (book-keeping). With ``clean``, rows of scale 0 contribute
    exactly 0 even where their data are not finite (weight-0 rows, ``nan_safe``), or
    where ``kept`` (``(rows,)``) is given, the rows it leaves out (weight-0 rows alone:
    without ``nan_safe`` an infinite gradient times its factor 0 is NaN).

    Given each example's ``norms`` (``(rows, leaves)``), a microbatch where a scaled
    cotangent may have lost to underflow more than ``GRAM_TOLERANCE`` of an example's
    scaled gradient (``underflow_risk``) takes its sum from the per-example gradients
    of the sites instead (``_per_example_sum``), inside the compiled loop."""
    total: list[Any] = [jnp.zeros_like(p) for p in params]
    keep = scale != 0 if clean else jnp.ones(scale.shape, bool)
    if clean and kept is not None:
        keep = jnp.broadcast_to(kept[:, None], scale.shape)
    for group in sorted(set(groups)):
        leaves = [leaf for leaf, g in enumerate(groups) if g == group]
        factor, kept = scale[:, group], keep[:, group]
        reached = _direct_sites(program, leaves) + [
            k
            for leaf in leaves
            if program.rules[leaf].name != "direct"
            for k in program.rules[leaf].sites
        ]
        reached = sorted(set(reached))
        linear = [k for k in reached if program.sites[k].linear]
        other = [k for k in reached if not program.sites[k].linear]
        if linear:
            found = _linear_sum(program, params, seen, leaves, linear, factor, kept, clean, norms)
            for leaf, g in zip(leaves, found, strict=True):
                total[leaf] = total[leaf] + g
        if other:
            size = chunk(program, leaves)
            found = _per_example_sum(program, params, seen, leaves, other, factor, kept, size)
            for leaf, g in zip(leaves, found, strict=True):
                total[leaf] = total[leaf] + g
    return total


def _linear_sum(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    leaves: list[int],
    sites: list[int],
    factor: jax.Array,
    kept: jax.Array,
    clean: bool,
    norms: jax.Array | None,
) -> list[Any]:
    """``clipped_sum`` of one group's ``leaves`` at its linear ``sites``: book-keeping at
    the cotangents times the factors over their power of two (``to_unit``), unless
    ``norms`` are given and ``underflow_risk`` says that may lose too much."""
    unit, power = to_unit(factor)

    def book_keeping() -> tuple[list[Any], jax.Array]:
        return scaled_products(program, params, seen, leaves, sites, unit, kept, clean), power

    def per_example() -> tuple[list[Any], jax.Array]:
        found = _per_example_sum(program, params, seen, leaves, sites, factor, kept, 1)
        return found, jnp.ones_like(power)

    if norms is None:
        found, ups = book_keeping()
        return [times_both(g, ups) for g in found]
    target = jnp.abs(unit) * jnp.max(norms[:, leaves], axis=1)
    # A factor that the division by the largest takes below tiny (a weight far above 1
    # beside a factor far below it: 2**60 beside 5e-21) would enter as 0, or as a few
    # bits, though its own value is a normal number: the per-example sum takes it as it is.
    flushed = (factor != 0) & (jnp.abs(unit) < jnp.finfo(unit.dtype).tiny)
    risky = underflow_risk(program, seen, sites, unit, target) | flushed
    # The power of two is applied after the branch (by 1 after the per-example sum):
    # outside it, XLA fuses the two multiplications of a weight-sized sum into the
    # accumulator's addition; inside, each was a pass of its own over the sum (on the
    # MLP of ``benchmarks/clipping.py`` at microbatch 16, 6.6 of 62 ms a step).
    found, ups = _sharding.data_cond(jnp.any(risky), per_example, book_keeping)
    return [times_both(g, ups) for g in found]


def to_unit(factors: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``factors`` divided by ``2^e``, the power of two just above the largest in
    magnitude (``2^(e-1) <= max < 2^e``), and ``2^e`` as two factors, each normal where
    ``2^e`` itself overflows (factors times weights near the dtype's largest number,
    ``e = 128`` in float32), stacked; ``2^e`` is 1 where the largest is 0 or not finite.
    All exact. Scaling by the first, then by both factors of ``2^e``, runs a backward
    pass at cotangents no smaller than the loss's own for the example of the largest
    factor, so that clip factors far below 1 do not push them below ``tiny``. A largest
    factor below ``tiny`` counts as ``tiny`` (``_clipping.exponent``)."""
    top = jnp.max(jnp.abs(factors))
    usable = (top > 0) & jnp.isfinite(top)
    exponent = jnp.where(usable, _clipping.exponent(jnp.where(usable, top, 1)), 0)
    half = _clipping.halve(exponent)
    ups = [_clipping.power_of_two(k, factors.dtype) for k in (half, exponent - half)]
    return _clipping.times_power(factors, -exponent), jnp.stack(ups)


def times_both(g: jax.Array, ups: jax.Array) -> jax.Array:
    """``g`` times the two factors of ``to_unit``'s power of two, one after the other."""
    return g * ups[0].astype(g.dtype) * ups[1].astype(g.dtype)


def underflow_risk(
    program: Program,
    seen: Recorded,
    sites: Sequence[int],
    factor: jax.Array,
    target: jax.Array,
) -> jax.Array:
    """Whether each example's sum at ``sites``, taken at its cotangents times its
    ``factor`` in the model's dtype, may differ from ``factor`` times its gradient by
    more than ``GRAM_TOLERANCE`` of ``target`` (a lower bound of that scaled
    gradient's norm), ``(rows,)``. Scaling both by a power of two leaves the answer.
    Where ``scales_data`` (the site's data rows times the factors, not its
    cotangents), data and cotangents swap their roles below.

    Rounding in the normal range costs ``u`` relative per entry, as in the gradient
    itself. An entry ``c g`` below the dtype's smallest normal number ``tiny`` is
    rounded to a multiple of the smallest subnormal, or flushed to 0: off by at most
    ``tiny``. At a bilinear site (a dot, a convolution, a product) an entry's
    error moves the parameters' gradient by at most ``tiny`` times the sum of the
    magnitudes of the example's data at the site; at a selecting one (a lookup, an
    added bias) by at most ``tiny``. The bound is ``tiny`` times that sum (or 1),
    times the count of such entries, summed over the sites. At a site that is not
    ``bounded`` (another primitive, or a gain between the leaf and the site) any lost
    entry is a risk. A factor of 0 leaves the example out and loses nothing.

    The bound is kept in float32 or the factor's wider dtype: float64's ``tiny`` is 0 in
    float32. A site that loses nothing adds 0 even where its data sum overflowed (no
    ``0 * inf``), and one that loses something beside data too large to sum is at risk.

    Most microbatches lose nothing: one pass per scaled side finds each example's
    smallest magnitude other than 0, and only where that times the factor falls below
    ``tiny`` (then and only then does an entry underflow: rounding a product is monotone
    in each factor) does a ``lax.cond`` count the entries and sum the data. Before, every
    microbatch paid both (the tied LM of ``benchmarks/clipping.py`` under forced ghost:
    about 36 ms of a 490 ms step in the count's passes alone)."""
    rows = factor.shape[0]
    wide = jnp.promote_types(factor.dtype, jnp.float32)
    c = jnp.abs(factor).astype(wide)
    sides = [_scaled_side(program, seen, k) for k in sites]
    hit = jnp.zeros((rows,), bool)
    for scaled, _ in sides:
        for g in scaled:
            flat = jnp.abs(jnp.reshape(g, (rows, -1))).astype(wide)
            # ``flat > 0`` leaves out NaN too, which the count never takes as lost.
            smallest = jnp.min(jnp.where(flat > 0, flat, jnp.inf), axis=1, initial=jnp.inf)
            hit = hit | (smallest * c < jnp.finfo(jnp.result_type(g)).tiny)
    hit = hit & (factor != 0)

    # Both branches vary over every manual mesh axis (inside ``shard_map``) that what
    # the count reads varies over; where the branch is not taken, ``hit`` is all False.
    read = [factor, target, *(v for side in sides for part in side for v in part)]
    axes = sorted({a for v in read for a in _sharding.varying_of(v)})

    def counted() -> jax.Array:
        risk = _counted_risk(program, sites, sides, factor, target)
        return _sharding.varying_over(risk, axes)

    return _sharding.data_cond(jnp.any(hit), counted, lambda: _sharding.varying_over(hit, axes))


def _scaled_side(program: Program, seen: Recorded, k: int) -> tuple[list[Any], list[Any]]:
    """Site ``k``'s side that ``scaled_products`` scales by the factors, and the other."""
    scaled, other = seen.cotangents[k], seen.inputs[k]
    if scales_data(program, seen, k):
        scaled, other = other, scaled
    return list(scaled), list(other)


def _counted_risk(
    program: Program,
    sites: Sequence[int],
    sides: Sequence[tuple[list[Any], list[Any]]],
    factor: jax.Array,
    target: jax.Array,
) -> jax.Array:
    """``underflow_risk``'s bound, counted: the entries each scaled side loses, times
    the other side's magnitudes."""
    rows = factor.shape[0]
    wide = jnp.promote_types(factor.dtype, jnp.float32)
    bound = jnp.zeros((rows,), wide)
    c = jnp.abs(factor).astype(wide)
    for k, (scaled, other) in zip(sites, sides, strict=True):
        site = program.sites[k]
        if not site.bounded:
            data = jnp.full((rows,), jnp.inf, wide)
        elif facts(program.eqns[site.eqn]).bilinear:
            data = jnp.zeros((rows,), wide)
            for a in other:
                data = data + jnp.sum(jnp.abs(jnp.reshape(a, (rows, -1))).astype(wide), axis=1)
        else:
            data = jnp.ones((rows,), wide)
        lost = jnp.zeros((rows,), wide)
        for g in scaled:
            tiny = jnp.finfo(jnp.result_type(g)).tiny
            flat = jnp.abs(jnp.reshape(g, (rows, -1))).astype(wide)
            under = (flat != 0) & (flat * c[:, None] < tiny)
            lost = lost + tiny * jnp.sum(under, axis=1).astype(wide)
        bound = bound + jnp.where(lost > 0, lost * data, 0)
    tolerance = GRAM_TOLERANCE[max(32, jnp.finfo(wide).bits)]
    at_stake = (factor != 0) & (bound > 0)
    return at_stake & ~(bound <= tolerance * target.astype(bound.dtype))


def _per_example_sum(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    leaves: Sequence[int],
    sites: Sequence[int],
    factor: jax.Array,
    kept: jax.Array,
    size: int,
) -> list[Any]:
    """``sum_b factor[b] * g_b`` of ``leaves`` at ``sites`` from each example's
    gradient, formed at most ``size`` examples at a time (the largest divisor of the
    rows up to it) and scaled in float32 or wider: no cotangent is multiplied by a
    factor. Rows not ``kept`` contribute exactly 0. The fallback of ``clipped_sum``
    takes one example at a time: it runs only on inputs built to underflow, and its
    memory is then one example's gradient beside the sum."""
    grads = per_example_grads(program, params, leaves, sites)
    rows = factor.shape[0]
    size = max(d for d in range(1, min(size, rows) + 1) if rows % d == 0)

    def chunks(x: Any) -> Any:
        return jnp.reshape(x, (rows // size, size, *jnp.shape(x)[1:]))

    xs = (
        [[chunks(v) for v in _cleaned(program, k, seen.inputs[k], kept)] for k in sites],
        [[chunks(v) for v in _zero_rows(seen.cotangents[k], kept)] for k in sites],
        chunks(jnp.where(kept, factor, 0)),
        chunks(kept),
    )

    def summed(x: Any) -> list[Any]:
        inputs, cotangents, w, k = x
        out = []
        for g in jax.vmap(grads)(inputs, cotangents):
            wide = jnp.promote_types(g.dtype, jnp.float32)
            g = jnp.where(at_rows(k, g), g, jnp.zeros((), g.dtype)).astype(wide)
            out.append(_layout.weighted_rows(w.astype(wide), g))
        return out

    def step(carry: list[Any], x: Any) -> tuple[list[Any], None]:
        return [c + s for c, s in zip(carry, summed(x), strict=True)], None

    # Zeros typed as a chunk's sum (under shard_map, varying over the manual axes it
    # varies over) start the carry: a first chunk summed outside the scan, as before,
    # compiled the sum twice (on the CNN of ``benchmarks/clipping.py``, 11 of the ghost
    # step's 223 kernels).
    shapes = jax.eval_shape(summed, jax.tree.map(lambda x: x[0], xs))
    total, _ = jax.lax.scan(step, [_sharding.full(s, 0) for s in shapes], xs)
    return [t.astype(jnp.result_type(params[leaf])) for t, leaf in zip(total, leaves, strict=True)]


def _zero_rows(values: Sequence[Any], keep: jax.Array) -> list[Any]:
    return [jnp.where(at_rows(keep, v), v, jnp.zeros((), v.dtype)) for v in values]


def _cleaned(program: Program, k: int, values: Sequence[Any], keep: jax.Array) -> list[Any]:
    """Site ``k``'s data ``values`` with each row not in ``keep`` replaced by a stand-in,
    whose cotangent is then 0: 0 at a bilinear site, where the product is 0 at data
    0. Elsewhere data 0 may be where the site is singular (``tanh(p / x)``, ``log(x)`` in
    a scan body) and ``0 * inf`` would make the sum NaN:
    the stand-in is the first kept row, or where the chunk keeps none the row's own data
    where it is finite, else 0 (``scaled_products`` then drops the chunk's sum)."""
    if facts(program.eqns[program.sites[k].eqn]).bilinear:
        return _zero_rows(values, keep)
    first = jnp.argmax(keep)

    def cleaned(v: Any) -> Any:
        v = _sharding.varying_like(v, keep)
        own = v
        if jnp.issubdtype(v.dtype, jnp.inexact):
            own = jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))
        return jnp.where(at_rows(keep, v), v, jnp.where(keep[first], v[first][None], own))

    return [cleaned(v) for v in values]


def scales_data(program: Program, seen: Recorded, k: int) -> bool:
    """Whether ``scaled_products`` scales site ``k``'s data rows by the factors rather
    than its output cotangents: at a bilinear site with one floating data input,
    where the data has no more entries than the cotangents. The sum is the same (the
    site's output is linear in its data); the multiplication is over fewer entries,
    and on XLA:CPU a scaled cotangent that the weight gradient's product reads
    transposed became a slow fused transposing copy (on the tied transformer LM of
    ``benchmarks/clipping.py`` at 64 tokens, ghost took 2.2x a plain step with every
    cotangent scaled, 1.9x so)."""
    e = program.eqns[program.sites[k].eqn]
    (data, cotangents) = seen.inputs[k], seen.cotangents[k]
    if not facts(e).bilinear or len(data) != 1:
        return False
    if not jnp.issubdtype(jnp.result_type(data[0]), jnp.inexact):
        return False
    return jnp.size(data[0]) <= sum(jnp.size(g) for g in cotangents)


def scaled_products(
    program: Program,
    params: Sequence[Any],
    seen: Recorded,
    leaves: Sequence[int],
    sites: Sequence[int],
    factor: jax.Array,
    keep: jax.Array,
    clean: bool,
) -> list[Any]:
    if not sites:
        return [jnp.zeros_like(params[leaf]) for leaf in leaves]

    on_data = {k for k in sites if scales_data(program, seen, k)}

    def data_of(k: int) -> list[Any]:
        values = _cleaned(program, k, seen.inputs[k], keep) if clean else seen.inputs[k]
        if k in on_data:
            values = [v * at_rows(factor, v).astype(v.dtype) for v in values]
        return values

    def outs_of(values: Sequence[Any]) -> list[Any]:
        env = _free_with(program, params, leaves, values)
        return [
            jax.vmap(lambda a, s=program.sites[k]: _site_outputs(program, s, env, a))(data_of(k))
            for k in sites
        ]

    outs, pull = jax.vjp(outs_of, [params[leaf] for leaf in leaves])

    def scaled(g: jax.Array, out: jax.Array, k: int) -> jax.Array:
        if k not in on_data:
            g = g * at_rows(factor, g).astype(g.dtype)
        g = jnp.where(at_rows(keep, g), g, jnp.zeros((), g.dtype)) if clean else g
        # On an Explicit mesh the recorded cotangent may be laid out otherwise than the
        # site's output (a tensor-parallel layer): the VJP wants the output's type.
        sharding = _sharding.explicit_sharding(out)
        return g if sharding is None else jax.sharding.reshard(g, sharding)

    cotangents = [
        [scaled(g, o, k) for g, o in zip(seen.cotangents[k], out, strict=True)]
        for k, out in zip(sites, outs, strict=True)
    ]
    found = pull(cotangents)[0]
    if not clean:
        return found
    # A chunk that keeps no row adds 0, even where every stand-in is singular.
    anything = jnp.any(keep)
    return [jnp.where(anything, g, jnp.zeros((), g.dtype)) for g in found]


def linear_values(
    program: Program, params: Sequence[Any], seen: Recorded, direction: Sequence[Any]
) -> jax.Array:
    """Each example's ``<g_b, V>`` for a ``direction`` ``V`` (one array per parameter
    leaf), ``(rows,)``: at every site, the output cotangents against the site's product
    with ``V`` pushed through the parameters-only program (one JVP, never a gradient).
    Exact where every site is linear in its cotangent, whose VJP is then the JVP's
    transpose."""
    leaves = [leaf for leaf, r in enumerate(program.rules) if r.name != "unused"]
    sites = _direct_sites(program, leaves)
    rows = jnp.shape(seen.outs[0])[0]
    if not sites:
        return jnp.zeros((rows,), jnp.result_type(*params) if params else jnp.float32)

    def outs_of(values: Sequence[Any]) -> list[Any]:
        env = _free_with(program, params, leaves, values)
        return [
            jax.vmap(lambda a, s=program.sites[k]: _site_outputs(program, s, env, a))(
                seen.inputs[k]
            )
            for k in sites
        ]

    primals = [params[leaf] for leaf in leaves]
    tangents = [jnp.asarray(direction[leaf], jnp.result_type(params[leaf])) for leaf in leaves]
    _, pushed = jax.jvp(outs_of, (primals,), (tangents,))
    total: Any = 0
    for k, outs in zip(sites, pushed, strict=True):
        for t, g in zip(outs, seen.cotangents[k], strict=True):
            total = total + jnp.sum(t * g, axis=tuple(range(1, t.ndim)))
    return total
