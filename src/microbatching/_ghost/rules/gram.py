"""Gram matrices summed in a known order, and the bound of their rounding error that
decides whether a Gram form's norm is reliable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

GRAM_TOLERANCE = {32: 1e-5, 64: 1e-12}
"""The relative error, by the bits of the dtype the norms are computed in (at least
float32), that a Gram form's norm must be within of its exact value: a norm whose error
bound exceeds it is recomputed by the product form."""


GRAM_ERROR_MARGIN = 1.125
"""The factor on the Gram form's error bound ``u * E`` (see ``_reliable``, ``_gram_sum``)
for what the bound leaves out: ``E`` is computed from the rounded Gram matrices, not the
exact ones, and in floating point itself (by halving: ``log2`` of its terms times
``u``); the products of two errors (``u^2``) are dropped; and ``gamma_n = n u / (1 - n
u)``, not ``n u``. Each of these is below ``1e-5`` relative for the lengths a Gram
matrix takes, so an eighth is ample. The bound itself is
a worst case, for any order of XLA's additions (``inner_error``, ``outer_error``):
``tests/test_norm_numerics.py`` pins it on rows built to round badly."""


def _reliable(gram: jax.Array, error: jax.Array) -> jax.Array:
    """Whether a Gram sum ``gram`` (a squared norm), whose rounding error is bounded by
    ``u * error`` (``_gram_sum``), gives its norm within ``GRAM_TOLERANCE``. The square's
    relative error is twice the norm's. A sum that is not finite came from rows that are
    not, and is kept as it is: the product form would not be finite either."""
    u = jnp.finfo(gram.dtype).eps / 2
    tolerance = GRAM_TOLERANCE[jnp.finfo(gram.dtype).bits]
    bound = GRAM_ERROR_MARGIN * u * error
    return (bound <= 2 * tolerance * gram) | (error == 0) | ~jnp.isfinite(gram + error)


GRAM_BLOCK = 16
"""The longest inner product a Gram matrix hands to one ``dot``. The order in which a
``dot`` adds its products is the backend's, and a sum of ``n`` products in an unknown
order errs by up to ``n u`` times the sum of their magnitudes (``gamma_n``): which bites
where a row's one large entry meets many small ones, each below half an ulp of the
running sum. XLA:CPU on an AVX2 machine adds a row of 128 entries one after another
(122 ``u ||a||^2`` measured on such a row, against 3.1 on an AVX-512 one). Rows are cut
into blocks of this length, and the blocks' Gram matrices added by halving
(``tree_sum``), whose order is the program's: each inner product then errs by at most
``inner_error(k) u ||a_t|| ||a_s||`` on any backend. 16 keeps that factor at 19 for
rows of 128 (the Gram form is then kept on random rows of 64 tokens, where the bound
is about 220 times the squared norm, below the ``2 tol / (margin u)`` = 298 it must
meet), at about 1.6 times the time of blocks of 128 on the CPU."""


def tree_sum(x: jax.Array) -> jax.Array:
    """The sum over the leading axis by halving: each result is a sum of at most
    ``ceil(log2(len(x)))`` rounded additions, whatever the backend (elementwise adds of
    slices, which XLA does not reassociate). 0 for an empty axis."""
    if x.shape[0] == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        head = x[:half] + x[half : 2 * half]
        x = jnp.concatenate([head, x[2 * half :]]) if x.shape[0] % 2 else head
    return x[0]


def _depth(n: int) -> int:
    """How many rounded additions ``tree_sum`` of ``n`` entries chains at most."""
    return max(n - 1, 0).bit_length()


def inner_error(length: int) -> int:
    """How many times ``u ||a|| ||b||`` an inner product of ``length`` entries, as
    ``gram_matrices`` takes it, can err by: ``gamma`` of a block's products (at most
    ``GRAM_BLOCK``, in any order), and the halving sum of the blocks."""
    blocks = -(-length // GRAM_BLOCK)
    return min(length, GRAM_BLOCK) + _depth(blocks)


def outer_error(terms: int) -> int:
    """How many times the sum of their magnitudes the sum of ``terms`` Gram terms
    ``xx * gg`` can err by (``_gram_sum``): the rounding of each product, and the
    halving sum."""
    return 1 + _depth(terms)


def gram_matrices(rows: jax.Array) -> jax.Array:
    """``(H, T, T)`` Gram matrices of rows ``(H, T, k)``, in blocks of ``GRAM_BLOCK``
    entries added by halving (see there): each inner product then errs by at most
    ``inner_error(k) u`` times the product of its rows' norms, in any backend's order."""
    h, t, k = rows.shape
    if k <= GRAM_BLOCK:
        return jnp.einsum("htk,hsk->hts", rows, rows, precision=HIGHEST)
    blocks = -(-k // GRAM_BLOCK)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, blocks * GRAM_BLOCK - k)))
    rows = rows.reshape(h, t, blocks, GRAM_BLOCK)
    parts = jnp.einsum("htjb,hsjb->jhts", rows, rows, precision=HIGHEST)
    # The barrier keeps XLA from folding the sum of the blocks back into the product
    # (a reduction over a dot's batch dimension becomes a contraction).
    return tree_sum(jax.lax.optimization_barrier(parts))


def _gram_sum(
    xx: jax.Array, gg: jax.Array, k: int = 0, n: int = 0, exact: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``sum(xx * gg)`` over Gram matrices (``gram_matrices``) of rows ``a_t`` of ``k``
    and ``g_t`` of ``n`` entries, leading axes ``(..., T, T)``, and ``E``, a bound on its
    rounding error over ``u`` (times ``GRAM_ERROR_MARGIN``, see there).

    Each inner product ``a_t.a_s`` errs by at most ``inner_error(k) u ||a_t|| ||a_s||``
    (Cauchy-Schwarz bounds the magnitudes of its products by the norms), so a term by
    that times ``|g_t.g_s|``, plus the same for ``gg``, and the sum of the terms by
    ``outer_error`` times their magnitudes more. Where rows repeat and cotangents cancel,
    ``E`` is as large as ``(sum_t ||a_t|| ||g_t||)^2`` while the sum (the squared norm)
    is small: the squared condition number of the form. ``exact``: ``xx`` has no rounding
    error (the equal-ids matrix of an embedding)."""
    total = tree_sum((xx * gg).reshape(-1))
    g = jnp.sqrt(jnp.diagonal(gg, axis1=-2, axis2=-1))
    error = inner_error(n) * jnp.abs(xx) * (g[..., :, None] * g[..., None, :])
    error = error + outer_error(math.prod(xx.shape)) * jnp.abs(xx * gg)
    if not exact:
        a = jnp.sqrt(jnp.diagonal(xx, axis1=-2, axis2=-1))
        error = error + inner_error(k) * a[..., :, None] * a[..., None, :] * jnp.abs(gg)
    # By halving too: a sum of N positive terms in an unknown order may be off by N u
    # relative, beyond the margin for N above a million; by halving, log2(N) u.
    return total, tree_sum(error.reshape(-1))


HIGHEST = jax.lax.Precision.HIGHEST
