"""Norms of a sum of outer products ``sum_t x_t (outer) g_t``, shared by the rules whose
gradient is such a product (dense, conv): the product form, the Gram form, and the rows
form, with the powers of two that keep them within range.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ... import _clipping, _tuning
from .base import Cost
from .gram import GRAM_BLOCK, HIGHEST, _gram_sum, _reliable, gram_matrices


def _product_cost(h: int, t: int, k: int, n: int) -> Cost:
    """The ``Cost`` of the cheaper of the two forms of
    ``_product_norm``: flops, and ``_tuning.Knobs.gram_entry_flops`` for each entry of the
    intermediates it writes (the rows themselves are read by both)."""
    rows = h * t * (k + n)
    product = rows + h * k * n
    if t == 1:
        return Cost("rows", h * (k + n), rows, product)
    blocks = sum(-(-d // GRAM_BLOCK) for d in (k, n) if d > GRAM_BLOCK)  # gram_matrices
    gram_flops, written = h * t * t * (k + n), (2 + blocks) * h * t * t
    weight = _tuning.knobs().gram_entry_flops
    if gram_flops + weight * written <= h * t * k * n + weight * h * k * n:
        return Cost("gram", gram_flops, rows + written, product)
    return Cost("product", h * t * k * n, product, product)


def _balanced(xs: jax.Array, gs: jax.Array) -> tuple[jax.Array, jax.Array, tuple[Any, ...]]:
    """Rows ``xs[h, t]`` and ``gs[h, t]`` (at least float32) scaled by powers of two, one
    pair per row, and the factors that undo it, for ``_from_gram``.

    Each row pair is first rescaled by ``2**-k`` and ``2**k`` so that their largest
    magnitudes meet halfway: every product ``x_t (outer) g_t``, so every Gram term and the
    norm, is unchanged (exactly: powers of two), but one row's large input with a small
    cotangent no longer sets the scale of the others (whose squared terms would then
    underflow to 0). Then all rows of each side are scaled so that the largest magnitude
    is in ``[1/2, 1)`` (``_scaled``'s reason); both in one multiplication per entry. A row
    with a zero factor and a finite other contributes nothing, and is zeroed. Where an
    entry is not finite, the rows are left as they are and the first factor returned is
    that magnitude (``inf`` or NaN)."""
    shift_x, shift_g, kept, scales = _balance(xs, gs)
    xs = jnp.where(kept, _clipping.times_power(xs, shift_x), 0)
    gs = jnp.where(kept, _clipping.times_power(gs, shift_g), 0)
    return xs, gs, scales


def _balance(xs: jax.Array, gs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """``_balanced``'s powers of two: the exponents of each row's scale on each side
    ``(H, T, 1)``, the rows kept, and the factors that undo the scaling."""
    mx = jnp.max(jnp.abs(xs), axis=-1, initial=0.0)
    mg = jnp.max(jnp.abs(gs), axis=-1, initial=0.0)
    finite = jnp.isfinite(mx) & jnp.isfinite(mg)
    both = finite & (mx > 0) & (mg > 0)
    ex = _clipping.exponent(jnp.where(both, mx, 1))
    eg = _clipping.exponent(jnp.where(both, mg, 1))
    k = jnp.where(both, _clipping.halve(ex - eg), 0)
    lowest = jnp.iinfo(ex.dtype).min
    top_x = jnp.max(jnp.where(both, ex - k, lowest), initial=lowest)
    top_g = jnp.max(jnp.where(both, eg + k, lowest), initial=lowest)
    any_row = jnp.any(both)
    top_x, top_g = jnp.where(any_row, top_x, 0), jnp.where(any_row, top_g, 0)
    usable = jnp.all(finite)
    kept = (both | ~usable)[..., None]
    shift_x = jnp.where(usable, -k - top_x, 0)[..., None]
    shift_g = jnp.where(usable, k - top_g, 0)[..., None]
    bad = jnp.max(jnp.where(finite, 0, mx + mg), initial=0.0)  # inf, or NaN
    # top_x = ceil((ex + eg) / 2) and top_g = floor((ex + eg) / 2) lie in the exponents'
    # range, so each half lies in [minexp / 2, maxexp / 2]: one exact power each.
    half_x, half_g = _clipping.halve(top_x), _clipping.halve(top_g)
    scales = (
        jnp.where(usable, _clipping.power_of_two(half_x, xs.dtype), bad),
        _clipping.power_of_two(half_g, xs.dtype),
        _clipping.power_of_two(top_x - half_x, xs.dtype),
        _clipping.power_of_two(top_g - half_g, xs.dtype),
    )
    return shift_x, shift_g, kept, scales


def _scaled(x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``x`` times a power of two that brings its largest magnitude ``m`` into
    ``[1/2, 1)``, in at least float32, and the two powers of two whose product undoes it.

    Multiplying by a power of two is exact, so the product form of a norm errs only by
    the rounding of its own products, as the gradient does: a scale by ``m`` itself would
    round every entry, an error as large as the largest row where rows cancel. Where
    ``m`` is 0 or not finite ``x`` is left as it is, and the scale returned is ``m`` (0,
    ``inf`` or NaN) and 1.
    """
    wide = jnp.promote_types(jnp.result_type(x), jnp.float32)
    x = x.astype(wide)
    m = jnp.max(jnp.abs(x), initial=0.0)
    usable = (m > 0) & jnp.isfinite(m)
    exponent = _clipping.exponent(jnp.where(usable, m, 1).astype(wide))
    half = _clipping.halve(exponent)
    up = _clipping.power_of_two(half, wide), _clipping.power_of_two(exponent - half, wide)
    scaled = _clipping.times_power(x, -exponent)
    return scaled, (jnp.where(usable, up[0], jnp.where(m > 0, m, 0)), jnp.where(usable, up[1], 1))


def _from_gram(gram: jax.Array, *scales: jax.Array) -> jax.Array:
    """The norm from a squared norm of rows scaled down by ``_balanced`` or ``_scaled``,
    and the factors that undo it; ``inf`` or NaN where a factor (the largest magnitude
    itself) is. ``gram`` is never negative: a Gram sum that could be is recomputed
    (``_reliable``)."""
    return _from_norm(_clipping.sqrt(gram), *scales)


def _from_norm(norm: jax.Array, *scales: jax.Array) -> jax.Array:
    """``_from_gram`` of a norm already taken."""
    bad = jnp.zeros((), norm.dtype)
    for scale in scales:
        norm = norm * scale
        bad = bad + jnp.where(jnp.isfinite(scale), 0, scale)
    return norm + bad


def _product_of_rows(product: jax.Array, *scales: jax.Array) -> jax.Array:
    """The norm of a per-example gradient formed from scaled rows (``x^T g``, or the
    scattered rows of an embedding), scaled by its own largest entry before it is
    squared. The rows' scale is set by their largest entries, and where large rows
    cancel (a row twice with opposite cotangents) what is left can be far below it:
    squared at the rows' scale, it underflowed to a norm of 0, and the example was not
    clipped at all."""
    return _from_norm(_clipping.norm(product), *scales)


def _product_norm(xs: jax.Array, gs: jax.Array, gram: bool) -> tuple[jax.Array, jax.Array]:
    """The norm of ``sum_t xs[h, t] (outer) gs[h, t]`` over all ``h``, from the Gram
    matrices of the rows (``gram``) or from the product itself, and whether it is
    reliable: the product form always is (a sum of squares errs as the gradient does),
    the Gram form where its error bound meets ``GRAM_TOLERANCE`` (``_reliable``)."""
    _, t, _ = xs.shape
    if t == 1:  # per shared entry h, ||x_h|| ||g_h||
        return _rows_norm(xs[:, 0], gs[:, 0]), jnp.ones((), bool)
    if not gram:
        return _clipping.norm(_product(xs, gs)), jnp.ones((), bool)
    xs, gs, scales = _balanced(xs, gs)  # interleaved: no product of two is subnormal
    return _gram_norm(gram_matrices(xs), xs.shape[-1], gram_matrices(gs), gs.shape[-1], scales)


def _product(xs: jax.Array, gs: jax.Array) -> jax.Array:
    """``sum_t xs[..., t] (outer) gs[..., t]`` from the rows as they are, in at least
    float32: the products the model's own backward pass forms, so each example's gradient
    at the site as ``jax.grad`` gives it (an entry that underflows or overflows there does
    so here too)."""
    wide = jnp.promote_types(jnp.result_type(xs, gs), jnp.float32)
    return jnp.einsum("...tk,...tn->...kn", xs.astype(wide), gs.astype(wide), precision=HIGHEST)


def _rows_norm(x: jax.Array, g: jax.Array) -> jax.Array:
    """``sqrt(sum_h ||x_h||^2 ||g_h||^2)`` of rows ``(h, k)`` and ``(h, n)``, each row's
    norm kept as a mantissa times a power of two (``_clipping.norm_parts``) until the
    end: one row's norm may overflow, or its product with the other's underflow, where
    the gradient ``x_h g_h^T`` is finite (an input row near float32's largest number
    beside a cotangent of 0, or of 1e-20 beside one of 3e38: NaN and inf before). Rows
    with 0, inf or NaN give what the products of their entries give: NaN where an inf
    meets a 0 (``0 * inf``) or a NaN is there, else inf where an inf is, else the norm."""
    mx, kx = _clipping.norm_parts(x)
    mg, kg = _clipping.norm_parts(g)
    # An entry of inf times an entry of 0 is NaN in the gradient, as is any NaN.
    holes_x, holes_g = jnp.any(x == 0, axis=1), jnp.any(g == 0, axis=1)
    bad = jnp.isnan(mx) | jnp.isnan(mg)
    bad = bad | (jnp.isinf(mx) & holes_g) | (jnp.isinf(mg) & holes_x)
    infinite = (jnp.isinf(mx) | jnp.isinf(mg)) & ~bad
    zero = (mx == 0) | (mg == 0)
    m = jnp.where(zero | bad | infinite, 0, mx * mg)  # at most sqrt(k n): no overflow
    k = kx + kg
    top = jnp.max(jnp.where(m > 0, k, jnp.iinfo(k.dtype).min))
    top = jnp.where(jnp.any(m > 0), top, 0)
    scaled = _clipping.times_power(m, k - top)
    total = _clipping.times_power(_clipping.sqrt(jnp.sum(jnp.square(scaled))), top)
    return jnp.where(jnp.any(bad), jnp.nan, jnp.where(jnp.any(infinite), jnp.inf, total))


def _gram_norm(
    xx: jax.Array, k: int, gg: jax.Array, n: int, scales: tuple[Any, ...]
) -> tuple[jax.Array, jax.Array]:
    """The Gram form's norm from the Gram matrices of rows of ``k`` and ``n`` entries
    scaled by ``_balanced``, and whether it is reliable (``_reliable``)."""
    total, error = _gram_sum(xx, gg, k, n)
    reliable = _reliable(total, error)
    # Where it is not reliable the caller takes the product form's norm instead; 1 keeps
    # the discarded value, and its derivative, finite.
    return _from_gram(jnp.where(reliable, total, 1), *scales), reliable
