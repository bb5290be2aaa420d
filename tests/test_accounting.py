"""``examples/accounting.py``: ε against the exact ε of Gaussian mechanisms, and padded
Poisson batches against the binomial law.

The references are independent of ``dp_accounting``: the analytic Gaussian mechanism
(Balle & Wang 2018) from the normal CDF (``math.erf``) and a bisection, and for one
subsampled step the hockey-stick divergence of its dominating pair of distributions,
integrated on a grid. The accountant (PLD, pessimistic) must be at or above each exact
ε, and within its discretisation of it (they agree to about 1e-8 here).
"""

from __future__ import annotations

import doctest
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

DELTA = 1e-5


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _solve(delta_of: Callable[[float], float], delta: float) -> float:
    """The ε at which the decreasing ``delta_of(ε)`` equals ``delta``, by bisection."""
    low, high = 0.0, 100.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if delta_of(middle) > delta else (low, middle)
    return high


def _gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact ε of the Gaussian mechanism of sensitivity 1 and noise ``sigma``
    (Balle & Wang 2018, Theorem 8)."""

    def delta_of(eps: float) -> float:
        a, b = 1 / (2 * sigma), eps * sigma
        return _phi(a - b) - math.exp(eps) * _phi(-a - b)

    return _solve(delta_of, delta)


def _subsampled_epsilon(sigma: float, q: float, delta: float) -> float:
    """Exact ε of one Poisson-subsampled Gaussian step, add or remove one: the larger
    hockey-stick divergence between N(0, σ²) and (1 - q) N(0, σ²) + q N(1, σ²), either way."""
    x = np.linspace(-30 * sigma, 1 + 30 * sigma, 400_001)
    dx = x[1] - x[0]
    base = np.exp(-(x**2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))
    shifted = np.exp(-((x - 1) ** 2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))
    mixture = (1 - q) * base + q * shifted

    def delta_of(eps: float) -> float:
        remove = np.sum(np.maximum(mixture - math.exp(eps) * base, 0)) * dx
        add = np.sum(np.maximum(base - math.exp(eps) * mixture, 0)) * dx
        return float(max(remove, add))

    return _solve(delta_of, delta)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 3.0])
def test_one_gaussian_step_is_exact(sigma: float) -> None:
    got = accounting.epsilon(noise_multiplier=sigma, sampling_rate=1.0, steps=1, delta=DELTA)
    want = _gaussian_epsilon(sigma, DELTA)
    assert got >= want - 1e-9
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_composed_gaussian_steps_are_one_gaussian() -> None:
    # k full-batch steps of noise sigma are one Gaussian step of noise sigma / sqrt(k).
    got = accounting.epsilon(noise_multiplier=4.0, sampling_rate=1.0, steps=16, delta=DELTA)
    want = _gaussian_epsilon(1.0, DELTA)
    assert got >= want - 1e-9
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.1), (2.0, 0.25)])
def test_one_subsampled_step_is_exact(sigma: float, q: float) -> None:
    got = accounting.epsilon(noise_multiplier=sigma, sampling_rate=q, steps=1, delta=DELTA)
    want = _subsampled_epsilon(sigma, q, DELTA)
    assert got >= want - 1e-7
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_epsilon_grows_with_steps_and_rate_and_falls_with_noise() -> None:
    def eps(sigma: float = 1.5, q: float = 0.05, steps: int = 50) -> float:
        return accounting.epsilon(noise_multiplier=sigma, sampling_rate=q, steps=steps, delta=DELTA)

    base = eps()
    assert base < eps(steps=100)
    assert base < eps(q=0.1)
    assert base > eps(sigma=3.0)
    assert accounting.epsilon(noise_multiplier=1.0, sampling_rate=0.1, steps=0, delta=DELTA) == 0


def _exact_overflow(n: int, q: Fraction, size: int) -> float:
    return float(sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(size + 1, n + 1)))


@pytest.mark.parametrize(("n", "q", "size"), [(50, 0.3, 20), (200, 0.05, 10), (200, 0.05, 30)])
def test_overflow_probability_is_the_binomial_tail(n: int, q: float, size: int) -> None:
    got = accounting.overflow_probability(n, q, size)
    np.testing.assert_allclose(got, _exact_overflow(n, Fraction(q), size), rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize(("n", "q"), [(1438, 0.25), (100, 0.02), (10, 1.0)])
def test_padded_size_is_the_smallest_within_the_bound(n: int, q: float) -> None:
    size = accounting.padded_size(n, q, max_overflow=1e-9)
    assert accounting.overflow_probability(n + 1, q, size) <= 1e-9
    assert accounting.overflow_probability(n + 1, q, size - 1) > 1e-9


def test_mask_samples_each_row_at_the_rate() -> None:
    n, q, draws = 500, 0.1, 400
    rng = np.random.default_rng(0)
    size = accounting.padded_size(n, q)
    counts = np.zeros(n)
    for _ in range(draws):
        index, mask = accounting.poisson_batch(rng, n, q, size)
        counts[index[mask]] += 1
    # The total is Binomial(n * draws, q): within 5 standard deviations (fails with
    # probability below 1e-6, and the seed fixes the draw).
    sd = math.sqrt(n * draws * q * (1 - q))
    assert abs(counts.sum() - n * draws * q) < 5 * sd
    # Every row is drawn (Binomial(draws, q) = 0 has probability 5e-19 per row).
    assert counts.min() > 0


def test_padding_semantics() -> None:
    rng = np.random.default_rng(1)
    index, mask = accounting.poisson_batch(rng, 300, 0.2, 100)
    assert index.shape == mask.shape == (100,)
    assert mask.dtype == bool
    sampled = int(mask.sum())
    np.testing.assert_array_equal(mask, np.arange(100) < sampled)  # sampled rows first
    assert np.all(np.diff(index[:sampled]) > 0)  # distinct, in increasing order
    assert index[:sampled].max() < 300
    np.testing.assert_array_equal(index[sampled:], 0)
    again, _ = accounting.poisson_batch(np.random.default_rng(1), 300, 0.2, 100)
    np.testing.assert_array_equal(again, index)


def test_full_rate_takes_every_row() -> None:
    index, mask = accounting.poisson_batch(np.random.default_rng(0), 7, 1.0, 9)
    np.testing.assert_array_equal(index, [0, 1, 2, 3, 4, 5, 6, 0, 0])
    np.testing.assert_array_equal(mask, [True] * 7 + [False] * 2)


def test_overflow_raises() -> None:
    with pytest.raises(ValueError, match=r"sampled 10 rows, more than padded_size=4"):
        accounting.poisson_batch(np.random.default_rng(0), 10, 1.0, 4)


def test_docstring_examples() -> None:
    failed, attempted = doctest.testmod(accounting, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert attempted > 0 and failed == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"noise_multiplier": 0.0},
            r"noise_multiplier must be positive and finite, got noise_multiplier=0.0",
        ),
        (
            {"noise_multiplier": math.inf},
            r"noise_multiplier must be positive and finite, got noise_multiplier=inf",
        ),
        ({"sampling_rate": 0.0}, r"sampling_rate must be in \(0, 1\], got sampling_rate=0.0"),
        ({"sampling_rate": 1.5}, r"sampling_rate must be in \(0, 1\], got sampling_rate=1.5"),
        ({"steps": -1}, r"steps must be an integer >= 0, got steps=-1"),
        ({"steps": 2.0}, r"steps must be an integer >= 0, got steps=2.0"),
        ({"delta": 0.0}, r"delta must be in \(0, 1\), got delta=0.0"),
        ({"delta": 1.0}, r"delta must be in \(0, 1\), got delta=1.0"),
    ],
)
def test_epsilon_rejects(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {
        "noise_multiplier": 1.0,
        "sampling_rate": 0.1,
        "steps": 10,
        "delta": DELTA,
    }
    with pytest.raises(ValueError, match=match):
        accounting.epsilon(**(arguments | kwargs))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0.1, 5), r"num_examples must be an integer >= 1, got num_examples=0"),
        ((10.0, 0.1, 5), r"num_examples must be an integer >= 1, got num_examples=10.0"),
        ((10, -0.1, 5), r"sampling_rate must be in \(0, 1\], got sampling_rate=-0.1"),
        ((10, 0.1, 0), r"padded_size must be an integer >= 1, got padded_size=0"),
        ((10, 0.1, 5.0), r"padded_size must be an integer >= 1, got padded_size=5.0"),
    ],
)
def test_poisson_batch_rejects(args: tuple[Any, Any, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        accounting.poisson_batch(np.random.default_rng(0), *args)


def test_padded_size_rejects() -> None:
    with pytest.raises(ValueError, match=r"max_overflow must be in \(0, 1\), got max_overflow=0"):
        accounting.padded_size(100, 0.1, max_overflow=0)


def test_gaussian_like_draws_independent_noise_of_the_tree_shape():
    """Per leaf: the tree's shapes and dtypes, mean 0 and standard deviation ``std``
    (100,000 draws: within 5 standard errors), and leaves drawn independently."""
    tree = {"a": jnp.zeros((100_000,), jnp.float32), "b": [jnp.zeros((100_000,), jnp.float32)]}
    noise = accounting.gaussian_like(jax.random.key(0), tree, 0.5)
    assert jax.tree.structure(noise) == jax.tree.structure(tree)
    a, b = np.asarray(noise["a"], np.float64), np.asarray(noise["b"][0], np.float64)
    assert noise["a"].dtype == jnp.float32
    np.testing.assert_allclose([a.mean(), b.mean()], 0.0, rtol=0, atol=5 * 0.5 / 100_000**0.5)
    np.testing.assert_allclose([a.std(), b.std()], 0.5, rtol=5 / (2 * 100_000) ** 0.5, atol=0)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / 100_000**0.5
