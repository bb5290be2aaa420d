"""Each example's norm of every parameter leaf, by the leaf's rule, from what the
recorder saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _clipping, _layout, _sharding, _tuning
from .program import Program, Rule
from .recorder import Recorded
from .rules import named
from .rules.base import GhostRule
from .rules.dense import _dense_rows, shared_inputs
from .rules.direct import _direct_norms
from .rules.gram import HIGHEST, gram_matrices
from .rules.products import _balance, _gram_norm, _product_norm


def leaf_norms(program: Program, params: Sequence[Any], seen: Recorded) -> jax.Array:
    """Each example's gradient norm of each parameter leaf, ``(examples, leaves)``."""
    rows = jnp.shape(seen.outs[0])[0]
    columns: list[jax.Array] = [jnp.zeros((rows,), jnp.float32)] * program.n_params
    shared = shared_inputs(program)
    for leaves in shared:
        norms = _shared_site_norms(program, leaves, seen)
        for j, leaf in enumerate(leaves):
            columns[leaf] = norms[:, j]
    alone = {leaf for leaves in shared for leaf in leaves}
    for leaf, rule in enumerate(program.rules):
        if named(rule.name) is not None and leaf not in alone:
            columns[leaf] = _site_norms(program, rule, seen)
    direct = [leaf for leaf, r in enumerate(program.rules) if r.name == "direct"]
    if direct:
        for leaf, norms in zip(direct, _direct_norms(program, params, seen, direct), strict=True):
            columns[leaf] = norms
    wide = jnp.result_type(*columns) if columns else jnp.float32
    if not columns:
        return jnp.zeros((rows, 0))
    return jnp.stack(_clipping.aligned([c.astype(wide) for c in columns]), axis=1)


SHARED_FLOOR = -30
"""The exponent below which no row's largest magnitude may fall, relative to the largest
of the example's input, for the shared Gram matrix to serve every site: then no row's
square underflows, and what an inner product loses to underflow is below ``2**-66`` of
its rows' norms, far within ``u``."""


def _shared_site_norms(program: Program, leaves: Sequence[int], seen: Recorded) -> jax.Array:
    """``(examples, len(leaves))``: the norms of dense leaves whose sites read one input
    (``shared_inputs``), from one Gram matrix of that input per example.

    The input's rows are scaled once, by the power of two that brings the largest
    magnitude into ``[1/2, 1)``, and their Gram matrix taken. Each site's Gram form wants
    its rows scaled by ``_balanced``, row by row: that Gram matrix is the shared one
    times ``2**(a_t + a_s)`` entry by entry, exactly (powers of two, and no entry
    underflows: ``SHARED_FLOOR``), and so is its rounding error, so each site's error
    bound (``_reliable``) holds as if its own rows had been multiplied. Each site's
    unreliable examples are recomputed by the product form, as in ``_site_norms``; a
    chunk of examples that does not meet ``SHARED_FLOOR``, or holds a value that is not
    finite, takes each site's own Gram matrix."""
    rules = [program.rules[leaf] for leaf in leaves]
    ks = [rule.sites[0] for rule in rules]
    sites = [program.sites[k] for k in ks]

    def each(x: Sequence[Any], gs: Sequence[Sequence[Any]]) -> Any:
        xs = _dense_rows(program, sites[0], x, gs[0])[0]
        mx = jnp.max(jnp.abs(xs), axis=-1, initial=0.0)
        top = jnp.max(mx, initial=0.0)
        usable = jnp.isfinite(top) & (top > 0)
        e = _clipping.exponent(jnp.where(usable, top, 1))
        rows = _clipping.exponent(jnp.where(mx > 0, mx, 1)) - e
        fits = usable & jnp.all((mx == 0) | (rows >= SHARED_FLOOR))
        xx = gram_matrices(_clipping.times_power(xs, -e))
        norms, reliable = [], []
        for site, g in zip(sites, gs, strict=True):
            xs, g_rows = _dense_rows(program, site, x, g)
            shift_x, shift_g, kept, scales = _balance(xs, g_rows)
            fits = fits & jnp.all(jnp.isfinite(g_rows))
            a = shift_x[..., 0] + e
            mine = _clipping.times_power(xx, a[..., :, None] + a[..., None, :])
            mine = jnp.where(kept & jnp.swapaxes(kept, -1, -2), mine, 0)
            gg = gram_matrices(jnp.where(kept, _clipping.times_power(g_rows, shift_g), 0))
            norm, ok = _gram_norm(mine, xs.shape[-1], gg, g_rows.shape[-1], scales)
            norms.append(norm)
            reliable.append(ok)
        return jnp.stack(norms), jnp.stack(reliable), fits

    def chunked(chunk: Any) -> jax.Array:
        x, gs = chunk
        norms, reliable, fits = jax.vmap(each)(x, gs)

        def checked() -> jax.Array:
            return jnp.stack(
                [
                    _recomputed(program, rule, (x, g), norms[:, j], reliable[:, j])
                    for j, (rule, g) in enumerate(zip(rules, gs, strict=True))
                ],
                axis=1,
            )

        def alone() -> jax.Array:
            own = [_checked(program, rule, (x, g)) for rule, g in zip(rules, gs, strict=True)]
            return jnp.stack(own, axis=1).astype(norms.dtype)

        return _sharding.data_cond(jnp.all(fits), checked, alone)

    pairs = (seen.inputs[ks[0]], [seen.cotangents[k] for k in ks])
    return _layout.map_chunks(chunked, pairs, _chunk_rows(sum(rule.bytes for rule in rules)))


def _recomputed(
    program: Program, rule: Rule, chunk: Any, norms: jax.Array, reliable: jax.Array
) -> jax.Array:
    """``norms`` of a chunk of examples, those not ``reliable`` recomputed by the product
    form (a branch: only where some example needs it)."""
    site, norm = program.sites[rule.sites[0]], _rule_of(rule).norm

    def product(pair: Any) -> jax.Array:
        return norm(program, site, *pair, gram=False)[0]

    def recomputed() -> jax.Array:
        exact = _layout.map_chunks(jax.vmap(product), chunk, _chunk_rows(rule.product_bytes))
        return jnp.where(reliable, norms, exact.astype(norms.dtype))

    return _sharding.data_cond(jnp.all(reliable), lambda: norms, recomputed)


def _checked(program: Program, rule: Rule, chunk: Any) -> jax.Array:
    """A ``gram`` rule's norms of a chunk of examples, checked (``_recomputed``)."""
    site, norm = program.sites[rule.sites[0]], _rule_of(rule).norm
    norms, reliable = jax.vmap(lambda x, g: norm(program, site, x, g, gram=True))(*chunk)
    return _recomputed(program, rule, chunk, norms, reliable)


def _site_norms(program: Program, rule: Rule, seen: Recorded) -> jax.Array:
    """Each example's norm of a leaf with a Gram rule, ``rule.form`` at a time. A ``gram``
    form's chunk of examples is recomputed by the product form, inside the compiled loop,
    where any of its examples fails the Gram form's error bound (``_reliable``)."""
    k = rule.sites[0]
    site, norm = program.sites[k], _rule_of(rule).norm

    def product(pair: Any) -> jax.Array:
        return norm(program, site, *pair, gram=False)[0]

    pairs = (seen.inputs[k], seen.cotangents[k])
    if rule.form != "gram" and _rule_of(rule).rows is not None:
        return _layout.map_chunks(
            lambda chunk: _unscaled(program, rule, chunk), pairs, _chunk_rows(rule.bytes)
        )
    if rule.form != "gram":
        return _layout.map_chunks(jax.vmap(product), pairs, _chunk_rows(rule.bytes))
    size = _chunk_rows(rule.bytes)
    return _layout.map_chunks(lambda chunk: _checked(program, rule, chunk), pairs, size)


def _unscaled(program: Program, rule: Rule, chunk: Any) -> jax.Array:
    """A ``product`` or ``rows`` rule's norms of a chunk of examples, from its rows as
    they are, where every example's sum of squares lies in ``[SAFE_LOW * tiny, max /
    SAFE_HIGH]``; otherwise, for the whole chunk, in a branch: the ``product`` form's
    norm of the product it formed, scaled by its own largest entry
    (``_clipping.mapped_row_norms``), the ``rows`` form's from each row's norm kept apart
    from its power of two (``_rows_norm``).

    In that range no square or partial sum overflowed, and what underflow took is far
    below ``u``: each square lost is below ``tiny``, at most ``n 2**-66`` of the sum over
    ``n`` squares; each product ``x g`` lost to an entry of ``x^T g`` is below ``tiny``,
    at most ``T sqrt(K N) tiny`` of the product's norm, which is at least ``2**33
    sqrt(tiny)``. A product that overflowed is ``inf`` or NaN, outside the range. The
    product the branch norms is each example's gradient at the site as the model's
    backward pass forms it, with what it lost there to underflow or overflow.

    Each branch is one copy of its form in the compiled program: the ``product`` form's
    used to scale the rows by powers of two (``_balanced``) and form the product again,
    which made 67 of the 304 kernels of the CNN of ``benchmarks/clipping.py``'s ghost step."""
    site, rows = program.sites[rule.sites[0]], _rule_of(rule).rows
    if rows is None:  # _site_norms takes this form only for a rule with rows
        raise RuntimeError(f"the {rule.name!r} rule has no rows to norm.")
    xs, gs = jax.vmap(lambda x, g: rows(program, site, x, g))(*chunk)
    info = jnp.finfo(xs.dtype)
    low, high = _clipping.SAFE_LOW * info.tiny, info.max / _clipping.SAFE_HIGH

    def fits(squares: jax.Array) -> jax.Array:
        return (squares >= low) & (squares <= high)

    _, h, t, _ = xs.shape
    if t > 1:
        # The product is each example's gradient at the site: out of range, its norm is
        # taken scaled by its own largest entry, in a branch.
        product = jnp.einsum("bhtk,bhtn->bhkn", xs, gs, precision=HIGHEST)
        squares = jnp.sum(jnp.square(product), axis=(1, 2, 3))
        norms = _clipping.sqrt(squares)

        def rescaled() -> jax.Array:
            return _clipping.mapped_row_norms(product, product.shape[0]).astype(norms.dtype)

        return _sharding.data_cond(jnp.all(fits(squares)), lambda: norms, rescaled)
    # per shared entry h, ||x_h|| ||g_h||
    sx, sg = (jnp.sum(jnp.square(v), axis=(2, 3)) for v in (xs, gs))
    fine = fits(sx) & fits(sg)
    each = _clipping.sqrt(sx) * _clipping.sqrt(sg)

    def combined(each: jax.Array) -> jax.Array:
        return each[:, 0] if h == 1 else _clipping.mapped_row_norms(each, each.shape[0])

    norms = combined(each)

    def scaled() -> jax.Array:
        # The rows read above, not read again: the same values, compiled once. A row of
        # zeros beside one whose squares overflowed gives 0, as its gradient is.
        found = jax.vmap(lambda x, g: _product_norm(x, g, gram=False)[0])(xs, gs)
        return found.astype(norms.dtype)

    return _sharding.data_cond(jnp.all(fine), lambda: norms, scaled)


def _chunk_rows(per_example: int) -> int:
    """How many examples' norm intermediates of ``per_example`` bytes fit in a chunk."""
    return max(1, _tuning.knobs().norm_chunk_bytes // max(per_example, 1))


def _rule_of(rule: Rule) -> GhostRule:
    """The ``GhostRule`` a leaf's ``Rule`` names (one of ``RULES``)."""
    found = named(rule.name)
    if found is None:
        raise RuntimeError(f"micro_grad planned the {rule.name!r} rule, which RULES does not hold.")
    return found
