"""Ghost norms on inputs built to cancel: rows that repeat, with cotangents that nearly
balance, so that an example's gradient is small against the terms of its Gram form.

Every example's gradient here is ``sum_t a_t (outer) g_t`` with one unit row ``a`` read
twice and cotangents ``u`` and ``-u + d``, ``||u|| = ratio * ||d||``: its norm is
``||d||`` while the Gram form adds terms of ``||u||^2``. The reference is that gradient
in float64, from the same (rounded) inputs the model sees. Every norm must be within
the DP guide's tolerance of it (``GRAM_TOLERANCE``, plus the rounding that the gradient
itself carries, ``u * sum_t ||a_t|| ||g_t||``), through every path that reads norms.
"""

from collections.abc import Callable
from typing import Any

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import microbatching
from microbatching import _clipping, _ghost, micro_grad
from microbatching._ghost import book_keeping
from microbatching._ghost.rules import dense as dense_rule
from microbatching._ghost.rules import gram, products

from .strategies import equations

RATIOS = (1e1, 1e2, 1e3, 1e4, 1e5, 1e6)
"""One example per ratio ``||u|| / ||d||``."""
WIDTH = 4
CLIP = 0.1
"""Below every gradient norm of the suite, so that every example is clipped."""
A_ROW = np.full(WIDTH, 0.5)
"""A unit row whose products with any float are exact, so that the product form (and
the gradient) is exact and any error left is the Gram form's."""


def scale_of(dtype: Any) -> float:
    """``||d||``: small enough that ``ratio * ||d||`` fits float16's range."""
    return 1e-2 if jnp.dtype(dtype) == jnp.float16 else 1.0


def cotangents(dtype: Any, ratios=RATIOS, seed: int = 0) -> np.ndarray:
    """``(examples, 2, WIDTH)``: ``u`` and ``-u + d`` for each ratio, in ``dtype``."""
    rng = np.random.default_rng(seed)
    rows = []
    for ratio in ratios:
        d = rng.normal(size=WIDTH)
        d *= scale_of(dtype) / np.linalg.norm(d)
        u = rng.normal(size=WIDTH)
        u *= ratio * scale_of(dtype) / np.linalg.norm(u)
        rows.append(np.stack([u, -u + d]))
    return np.asarray(jnp.asarray(np.stack(rows), dtype).astype(jnp.float32), np.float64)


def dense(dtype: Any):
    def loss(p, x, v):
        return jnp.sum((x @ p["w"]) * v)

    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)), dtype)}
    v = cotangents(dtype)
    x = np.broadcast_to(A_ROW, (*v.shape[:2], WIDTH))
    batch = (jnp.asarray(x, dtype), jnp.asarray(v, dtype))

    def reference(x, v):  # one example's gradient of w, from its (2, WIDTH) rows
        return {"w": x.T @ v}

    return loss, params, batch, reference


def embedding(dtype: Any):
    rows = 16

    def loss(p, ids, v):
        return jnp.sum(p["table"][ids] * v)

    rng = np.random.default_rng(2)
    params = {"table": jnp.asarray(rng.normal(size=(rows, WIDTH)), dtype)}
    v = cotangents(dtype)
    ids = np.full(v.shape[:2], 3, np.int32)
    batch = (jnp.asarray(ids), jnp.asarray(v, dtype))

    def reference(ids, v):
        table = np.zeros((rows, WIDTH))
        np.add.at(table, ids, v)
        return {"table": table}

    return loss, params, batch, reference


def conv(dtype: Any):
    """A 1x1 convolution over two positions holding the same patch."""

    def loss(p, x, v):
        out = jax.lax.conv_general_dilated(
            x, p["kernel"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
        )
        return jnp.sum(out * v)

    rng = np.random.default_rng(3)
    params = {"kernel": jnp.asarray(rng.normal(size=(1, WIDTH, WIDTH)), dtype)}
    v = cotangents(dtype)
    x = np.broadcast_to(A_ROW, (*v.shape[:2], WIDTH))
    batch = (jnp.asarray(x, dtype), jnp.asarray(v, dtype))

    def reference(x, v):
        return {"kernel": (x.T @ v)[None]}

    return loss, params, batch, reference


RULES = {"dense": dense, "embedding": embedding, "conv": conv}
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def references(reference: Callable[..., Any], batch: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """Each example's float64 gradient norm, ``sum_t ||a_t|| ||g_t||`` (what a product of
    its rows errs by, times ``u``), and the gradients."""
    x, v = (
        np.asarray(b) if jnp.issubdtype(b.dtype, jnp.integer) else np.asarray(b, np.float64)
        for b in (jnp.asarray(b) for b in batch)
    )
    grads = [reference(x[i], v[i]) for i in range(len(x))]
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in grad.values())) for grad in grads])
    rows = np.linalg.norm(v, axis=-1).sum(axis=1)  # ||a_t|| = 1 (0.5 per entry)
    return norms, rows, grads


def assert_norms_close(got: Any, want: np.ndarray, rows: np.ndarray) -> None:
    u = float(jnp.finfo(jnp.float32).eps) / 2
    slack = _ghost.GRAM_TOLERANCE[32] * want + 4 * u * rows
    error = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(error <= slack), f"norms {np.asarray(got)} against {want} (error {error})"


def grad_fn(loss: Any, dtype: Any, **options: Any) -> Any:
    return micro_grad(
        loss,
        batch_argnums=(1, 2),
        microbatch_size=2,
        accumulation_dtype=dtype,  # so that a narrow model still takes the ghost norms
        metrics_fn=microbatching.l2_norm,
        **options,
    )


# auto takes the ghost norms on every rule here (the test asserts it), so it stands for a
# forced "ghost" as well, which would compile the same program; per-layer bounds force it.
PATHS = {
    "l2_norm": {},
    "auto": {"l2_clip_norm": CLIP},
    "two_pass": {"l2_clip_norm": CLIP, "clip_method": "two_pass"},
    "per-layer": {"l2_clip_norm": {"w": CLIP}, "clip_method": "ghost"},
}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("path", PATHS)
def test_cancelling_rows_keep_their_norms(rule: str, dtype: Any, path: str) -> None:
    loss, params, batch, reference = RULES[rule](dtype)
    options = dict(PATHS[path])
    if path == "per-layer":
        options["l2_clip_norm"] = {next(iter(params)): CLIP}
    fn = grad_fn(loss, dtype, **options)
    report = microbatching.clipping_report(fn, params, *batch)
    assert report.method == ("two_pass" if path == "two_pass" else "ghost"), str(report)
    assert [leaf.form for leaf in report.leaves] == ["gram"], str(report)
    summed, aux = jax.jit(fn)(params, *batch)
    norms, rows, grads = references(reference, batch)
    assert_norms_close(aux.metrics, norms, rows)
    if "l2_clip_norm" in options and dtype == jnp.float32:
        u = float(jnp.finfo(jnp.float32).eps) / 2
        factors = np.minimum(1, CLIP / norms)
        (leaf,) = params
        want = sum(f * g[leaf] for f, g in zip(factors, grads, strict=True))
        # Scaling a cotangent by its clip factor rounds it by u of its size, the
        # gradient's own error: u * ratio * ||d|| per example, times its factor.
        slack = np.sum(factors * 4 * u * rows) + _ghost.GRAM_TOLERANCE[32] * CLIP
        error = float(np.linalg.norm(np.asarray(summed[leaf], np.float64) - want))
        assert error <= slack, f"clipped sum off by {error} (allowed {slack})"
        assert float(np.linalg.norm(np.asarray(summed[leaf]))) <= len(norms) * CLIP + slack


@pytest.mark.x64
def test_cancelling_rows_keep_their_norms_in_float64() -> None:
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("float64 models need JAX_ENABLE_X64=1 (make test-x64)")
    for rule, model in RULES.items():
        loss, params, batch, reference = model(jnp.float64)
        fn = grad_fn(loss, jnp.float64, l2_clip_norm=CLIP)
        report = microbatching.clipping_report(fn, params, *batch)
        assert [leaf.form for leaf in report.leaves] == ["gram"], str(report)
        _, aux = fn(params, *batch)
        norms, _, _ = references(reference, batch)
        error = np.abs(np.asarray(aux.metrics) - norms)
        assert np.all(error <= _ghost.GRAM_TOLERANCE[64] * norms + 1e-15), (rule, error)


def test_the_gram_form_stays_where_its_bound_holds_and_falls_back_where_not() -> None:
    """Both outcomes of the check: rows that do not cancel keep the Gram form (and agree
    with the product form), rows that cancel are marked for the product form."""
    rng = np.random.default_rng(4)
    xs = jnp.asarray(rng.normal(size=(1, 2, WIDTH)), jnp.float32)
    gs = jnp.asarray(rng.normal(size=(1, 2, WIDTH)), jnp.float32)
    gram, reliable = products._product_norm(xs, gs, gram=True)
    product, _ = products._product_norm(xs, gs, gram=False)
    assert bool(reliable)
    np.testing.assert_allclose(float(gram), float(product), rtol=1e-6, atol=1e-30)
    v = cotangents(jnp.float32, ratios=(1e3,))[0]
    x = jnp.asarray(np.broadcast_to(A_ROW, (1, 2, WIDTH)), jnp.float32)
    _, reliable = products._product_norm(x, jnp.asarray(v[None], jnp.float32), gram=True)
    assert not bool(reliable)


KINDS = 5


def gram_terms(kind: int, t: int, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of five kinds: random; repeated with cancelling cotangents; all positive
    (rounding errors of one sign); nearly equal with nearly opposite cotangents; one
    dominant entry and many small ones (whose squares a long sum loses)."""
    rng = np.random.default_rng(seed)
    x, g = rng.normal(size=(t, k)), rng.normal(size=(t, n))
    if kind == 4:
        x[:] = 0
        x[0, :], x[:, 0] = 2.4e-4, 1.0
        g[1::2] = -g[0::2] + rng.normal(size=g[1::2].shape)
    if kind == 1:
        x[:] = x[0]
        g[1::2] = -g[0::2] + rng.normal(size=g[1::2].shape) * 10.0 ** -rng.uniform(0, 4)
    elif kind == 2:
        x, g = np.abs(x), np.abs(g)
    elif kind == 3:
        x = 1 + 1e-3 * rng.normal(size=(t, k))
        g[1::2] = -g[0::2] * (1 + 1e-3 * rng.normal(size=g[1::2].shape))
    return x.astype(np.float32), g.astype(np.float32)


@jax.jit
def _gram_and_error(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    xx, gg = gram.gram_matrices(x[None]), gram.gram_matrices(g[None])
    return gram._gram_sum(xx, gg, x.shape[-1], g.shape[-1])


SHAPES = [
    (2, 128, 4),
    (2, 288, 4),
    (2, 512, 4),
    (16, 64, 128),
    (32, 512, 512),
    (64, 128, 128),
    (2, 2048, 4),
]
"""Rows up to 2048 entries, where one dot product of the row's length stagnated most."""


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_gram_error_bound_covers_the_rounding(shape: tuple[int, int, int]) -> None:
    """The bound ``u * E``, times its margin, covers the Gram sum's actual error on rows
    built to round badly, on any CPU: it counts every addition a ``dot`` of a block may
    chain (a row of 2048 with one dominant entry erred by 24 times the old per-product
    estimate on an AVX2 machine; on that machine it reaches 0.4 of the bound)."""
    u = float(jnp.finfo(jnp.float32).eps) / 2
    for kind in range(KINDS):
        for seed in range(3):
            x, g = gram_terms(kind, *shape, seed=seed)
            total, error = _gram_and_error(jnp.asarray(x), jnp.asarray(g))
            exact = float(np.sum((x.astype(np.float64).T @ g.astype(np.float64)) ** 2))
            assert abs(float(total) - exact) <= gram.GRAM_ERROR_MARGIN * u * float(error)


def test_blocks_and_halving_sums_bound_the_additions():
    """``gram_matrices`` hands ``dot`` at most ``GRAM_BLOCK`` entries and adds the blocks
    by ``tree_sum``, whose depth ``inner_error`` counts; a halving sum is the pairwise one,
    to the bit."""
    assert gram.GRAM_BLOCK == 16
    assert [gram.inner_error(k) for k in (1, 16, 17, 32, 33, 128, 2048)] == [
        1, 16, 17, 17, 18, 19, 23,
    ]  # fmt: skip
    assert [gram.outer_error(n) for n in (1, 2, 3, 4, 4096)] == [1, 2, 3, 3, 13]
    x = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    halves = [x[0] + x[3], x[1] + x[4], x[2] + x[5], x[6]]
    pairs = (halves[0] + halves[2]) + (halves[1] + halves[3])
    np.testing.assert_array_equal(np.asarray(gram.tree_sum(jnp.asarray(x))), pairs)
    assert float(gram.tree_sum(jnp.zeros((0,)))) == 0.0
    rows = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, 40)), jnp.float32)
    want = np.einsum("htk,hsk->hts", np.float64(rows), np.float64(rows))
    np.testing.assert_allclose(gram.gram_matrices(rows), want, rtol=1e-6, atol=1e-5)


_PROPERTY_T, _PROPERTY_K = 4, 8
"""Four rows of eight: the Gram form is the cheaper one (``T (k + n) <= k n``)."""


def _property_loss(p, x, v):
    return jnp.sum((x @ p) * v)


_property_fn = jax.jit(
    micro_grad(
        _property_loss,
        batch_argnums=(1, 2),
        microbatch_size=4,
        keep_batch_dim=False,
        metrics_fn=microbatching.l2_norm,
    )
)


@hypothesis.settings(max_examples=25)
@hypothesis.given(
    seed=st.integers(0, 2**16),
    exponents=st.lists(st.floats(0, 6), min_size=8, max_size=8),
    repeated=st.booleans(),
)
def test_no_norm_falls_below_its_reference(seed: int, exponents: list[float], repeated: bool):
    """Cotangent pairs that nearly cancel (``g_{2i+1} = -g_{2i} + d``, ``||g|| / ||d||`` up
    to 1e6), rows that repeat or not: no norm is below the float64 norm of the same
    inputs' gradient by more than the tolerance and the product's own rounding."""
    rng = np.random.default_rng(seed)
    t, k = _PROPERTY_T, _PROPERTY_K
    x = rng.normal(size=(8, t, k))
    if repeated:
        x[:] = x[:, :1]
    g = rng.normal(size=(8, t, k))
    d = rng.normal(size=(8, t // 2, k)) * (10.0 ** -np.asarray(exponents))[:, None, None]
    g[:, 1::2] = -g[:, 0::2] + d
    x32, g32 = x.astype(np.float32), g.astype(np.float32)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(k, k)), jnp.float32)
    _, aux = _property_fn(w, jnp.asarray(x32), jnp.asarray(g32))
    x64, g64 = x32.astype(np.float64), g32.astype(np.float64)
    want = np.linalg.norm(np.einsum("btk,btn->bkn", x64, g64), axis=(1, 2))
    rows = np.sum(np.linalg.norm(x64, axis=-1) * np.linalg.norm(g64, axis=-1), axis=1)
    u = float(jnp.finfo(jnp.float32).eps) / 2
    slack = _ghost.GRAM_TOLERANCE[32] * want + t * u * rows
    assert np.all(np.asarray(aux.metrics, np.float64) >= want - slack)


def _ghost_with_norms(loss: Callable[..., Any], l2_clip_norm: float = 1.0, **options: Any):
    """``micro_grad`` of ``loss(p, x, v)`` over examples of ``x`` and ``v`` (no batch axis),
    clipped by the ghost method, with each example's norm as its metric."""
    return micro_grad(
        loss,
        batch_argnums=(1, 2),
        keep_batch_dim=False,
        metrics_fn=microbatching.l2_norm,
        l2_clip_norm=l2_clip_norm,
        clip_method="ghost",
        **options,
    )


def _dense_norms(x: np.ndarray, v: np.ndarray) -> tuple[Any, Any, Any]:
    """``micro_grad``'s norms of ``sum((x @ w) * v)`` per example (rows ``(B, T, k)``),
    its report's form, and the float64 norms of the same inputs' gradients."""
    w = jnp.zeros((x.shape[-1], v.shape[-1]), jnp.float32)
    fn = _ghost_with_norms(_property_loss)
    (form,) = [leaf.form for leaf in microbatching.clipping_report(fn, w, x, v).leaves]
    _, aux = jax.jit(fn)(w, jnp.asarray(x), jnp.asarray(v))
    want = np.linalg.norm(np.einsum("btk,btn->bkn", x.astype(np.float64), v), axis=(1, 2))
    return np.asarray(aux.metrics, np.float64), form, want


@pytest.mark.parametrize("big", [1e10, 1e20, 1e30])
@pytest.mark.parametrize("tokens", [4, 16], ids=["gram", "product"])
def test_a_row_of_large_input_and_zero_cotangent_sets_no_scale(big: float, tokens: int):
    """One token with a huge input and a zero cotangent, another with the reverse: they
    add nothing to the gradient, and must not scale the other rows' terms into underflow
    (the norms came out 0, so the examples were not clipped)."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, tokens, 8)).astype(np.float32)
    v = rng.normal(size=(2, tokens, 8)).astype(np.float32)
    x[:, 0], v[:, 0] = big, 0.0
    x[:, 1], v[:, 1] = 0.0, big
    got, form, want = _dense_norms(x, v)
    assert form == ("gram" if tokens == 4 else "product")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("sizes", [(2e-38, 1.5e38), (1.5e38, 2e-38)], ids=["tiny_x", "huge_x"])
def test_rows_at_the_ends_of_float32_keep_their_norm(sizes: tuple[float, float]):
    """Inputs near float32's smallest normal (2e-38: a subnormal input is flushed to 0
    before any form sees it) with cotangents near its largest, and the
    reverse: the product is moderate, and so is its norm (neither 0 nor inf)."""
    rng = np.random.default_rng(7)
    x = (rng.uniform(1, 2, size=(2, 2, 4)) * sizes[0]).astype(np.float32)
    v = (rng.uniform(1, 2, size=(2, 2, 4)) * sizes[1]).astype(np.float32)
    got, form, want = _dense_norms(x, v)
    assert form == "gram"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_long_rows_of_one_dominant_entry_keep_their_norm():
    """Rows ``[1, t, t, ...]`` and ``[1, 0, ...]`` of 2048 entries, ``t^2`` about ``u``:
    one dot product over the row lost the small squares (1.3e-4 relative); the Gram
    matrices are taken in blocks (``GRAM_BLOCK``)."""
    rng = np.random.default_rng(8)
    x = np.zeros((3, 2, 2048), np.float32)
    x[:, 0, :], x[:, :, 0] = 2.4e-4, 1.0
    u = rng.normal(size=(3, 4))
    u *= np.array([0.5, 1.0, 1.5])[:, None] / np.linalg.norm(u, axis=1, keepdims=True)
    d = rng.normal(size=(3, 4))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    v = np.stack([u, -u + d], axis=1).astype(np.float32)
    got, form, want = _dense_norms(x, v)
    assert form == "gram"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def _shared_loss(p, x, v):
    """Two dense sites reading the same input (as ``q`` and ``k`` do)."""
    return jnp.sum((x @ p["a"]) * v) + jnp.sum((x @ p["b"]) * (0.5 * v[..., ::-1]))


def _shared_norms(x: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
    """``micro_grad``'s norms of ``_shared_loss`` per example, and the float64 norms."""
    k, n = x.shape[-1], v.shape[-1]
    p = {"a": jnp.zeros((k, n), jnp.float32), "b": jnp.zeros((k, n), jnp.float32)}
    fn = _ghost_with_norms(_shared_loss, l2_clip_norm=CLIP, microbatch_size=2)
    forms = [leaf.form for leaf in microbatching.clipping_report(fn, p, x, v).leaves]
    assert forms == ["gram", "gram"]
    _, aux = jax.jit(fn)(p, jnp.asarray(x), jnp.asarray(v))
    x64, v64 = x.astype(np.float64), v.astype(np.float64)
    a = np.einsum("btk,btn->bkn", x64, v64)
    b = np.einsum("btk,btn->bkn", x64, 0.5 * v64[..., ::-1])
    want = np.sqrt(np.sum(a**2, axis=(1, 2)) + np.sum(b**2, axis=(1, 2)))
    return np.asarray(aux.metrics, np.float64), want


def test_sites_that_read_one_input_share_its_gram_matrix():
    """``q``, ``k`` and ``v`` of one input share its Gram matrix; sites that read
    different values, or take the product form, do not."""

    def groups(loss, tokens, k=4):
        params = [jnp.zeros((k, 4))] * 2
        example = [jnp.zeros((tokens, k)), jnp.zeros((tokens, 4))]
        fun = lambda ps, ex: [loss({"a": ps[0], "b": ps[1]}, *ex)]  # noqa: E731
        program = _ghost.analyse(fun, params, example)
        assert isinstance(program, _ghost.Program), program
        return dense_rule.shared_inputs(program)

    assert groups(_shared_loss, 2) == [[0, 1]]

    def twice(p, x, v):  # a reaches two sites: direct
        return _shared_loss(p, x, v) + jnp.sum(((2 * x) @ p["a"]) * v)

    def apart(p, x, v):
        return jnp.sum((x @ p["a"]) * v) + jnp.sum(((2 * x) @ p["b"]) * v)

    assert groups(twice, 2) == []
    assert groups(apart, 2) == []
    assert groups(_shared_loss, 64, k=4) == []  # T^2 (k + n) > T k n: the product form


def test_a_shared_gram_matrix_keeps_cancelling_norms():
    """The cancellation suite's rows through two sites that share their input's Gram
    matrix: every norm within the tolerance, the unreliable ones recomputed per site."""
    v = cotangents(jnp.float32)
    x = np.broadcast_to(A_ROW, (*v.shape[:2], WIDTH)).astype(np.float32)
    got, want = _shared_norms(x, v.astype(np.float32))
    rows = 1.5 * np.linalg.norm(v, axis=-1).sum(axis=1)
    assert_norms_close(got, want, rows)


@pytest.mark.parametrize("small", [2.0**-20, 1e-25], ids=["shared", "each its own"])
def test_a_row_far_below_the_largest_input_keeps_its_norm(small: float):
    """One token's input ``small`` times the others', with a cotangent as many times
    larger: its share of the gradient is ordinary. At ``2**-20`` the shared Gram matrix
    holds it; at ``1e-25`` its square would underflow there (``SHARED_FLOOR``), and
    each site takes its own Gram matrix of balanced rows."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(4, 4, 8)).astype(np.float32)
    v = rng.normal(size=(4, 4, 8)).astype(np.float32)
    x[:, 0] *= small
    v[:, 0] /= small
    got, want = _shared_norms(x, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


@pytest.mark.x64
@pytest.mark.parametrize("method", ["auto", "ghost", "two_pass", "materialize", "chunked"])
@pytest.mark.parametrize(("x", "s", "bound"), [(1e100, 1e-160, 1e-70), (1e-100, 1e-100, 1e-210)])
def test_float64_norms_beyond_float32_s_exponents(method, x, s, bound):
    """Found by a breaker: the power-of-two scales were clamped to float32's exponents, so
    float64 norms near 1e-59 or 1e-199 came out 1e-105 or 0, and the examples were not
    clipped (a clipped sum 1.7e11 times its bound). The scales now span the dtype's own
    exponents."""
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("float64 models need JAX_ENABLE_X64=1 (make test-x64)")

    def loss(w, x, s):
        return jnp.sum(x @ w) * s

    w, xs, ss = jnp.ones((4, 3)), jnp.full((2, 5, 4), x), jnp.full((2,), s)
    # Each example's gradient has every entry 5 x s: its norm is 5 x s sqrt(12).
    want = 5 * x * s * np.sqrt(12.0)
    grad_fn = micro_grad(
        loss,
        batch_argnums=(1, 2),
        keep_batch_dim=False,
        l2_clip_norm=bound,
        metrics_fn=microbatching.l2_norm,
        clip_method=method,
    )
    got, aux = grad_fn(w, xs, ss)
    np.testing.assert_allclose(np.asarray(aux.metrics), [want, want], rtol=1e-12, atol=0)
    # Both examples are clipped to the bound, and point the same way: the sum's norm is 2C.
    total = float(np.sqrt(np.sum((np.asarray(got) / bound) ** 2))) * bound
    np.testing.assert_allclose(total, 2 * bound, rtol=1e-12, atol=0)


def _cancelling_then_small(big: float, small: float, dtype: Any = np.float32):
    """Rows ``(2, 3, 16)``: one input row twice with cotangents ``+big`` and ``-big`` (they
    cancel exactly), and a third row ``small`` in another column with cotangent
    ``small``: the gradient is ``small**2`` per entry, far below the rows' scale."""
    x, v = np.zeros((2, 3, 16), dtype), np.zeros((2, 3, 16), dtype)
    x[:, 0, 0] = x[:, 1, 0] = big
    v[:, 0], v[:, 1] = big, -big
    x[:, 2, 1] = v[:, 2] = small
    return x, v


def _conv_loss(p, x, v):
    y = jax.lax.conv_general_dilated(
        x[None], p, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
    )[0]
    return jnp.sum(y * v)


def _embedding_loss(p, ids, v):
    return jnp.sum(p[ids] * v)


def _norms_and_clipped_sum(loss: Callable[..., Any], p, x, v, want, rtol: float) -> None:
    """``micro_grad``'s ghost norms of two examples equal ``want`` to ``rtol``, and the sum
    clipped to 1 has norm at most 2 (to ``rtol``)."""
    fn = _ghost_with_norms(loss)
    summed, aux = jax.jit(fn)(p, jnp.asarray(x), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(aux.metrics, np.float64), want, rtol=rtol, atol=0)
    total = np.linalg.norm(np.asarray(summed, np.float64))
    assert total <= 2 * (1 + rtol), total


@pytest.mark.parametrize("rule", ["dense", "conv", "embedding"])
def test_a_gradient_far_below_its_cancelling_rows_keeps_its_norm(rule: str):
    """Found by a breaker: the Gram form rightly rejects these examples (large rows that
    cancel), and the product form that recomputes them squared a gradient of ``2**40``
    at the rows' scale of ``2**120``: the squares underflowed, the norms came out 0, and
    the clipped sum was ``8.8e12`` against a bound of 2. The product is now scaled by its
    own largest entry before it is squared."""
    big, small = 2.0**60, 2.0**20
    x, v = _cancelling_then_small(big, small)
    loss: Callable[..., Any]
    if rule == "embedding":  # ids [3, 3, 5]: the same row twice, cotangents cancelling
        loss, p = _embedding_loss, jnp.zeros((8, 16), jnp.float32)
        x = np.tile(np.array([3, 3, 5], np.int32), (2, 1))
        v[:, 0], v[:, 1], v[:, 2] = 2.0**70, -(2.0**70), 32.0  # 32 * 2**-70, squared: 0
        want = np.full(2, 32.0 * 4.0)  # sqrt(16) entries of 32
    else:
        loss = _property_loss if rule == "dense" else _conv_loss
        p = jnp.zeros((16, 16) if rule == "dense" else (1, 16, 16), jnp.float32)
        want = np.full(2, small**2 * 4.0)
    _norms_and_clipped_sum(loss, p, x, v, want, rtol=1e-5)


@pytest.mark.x64
def test_a_float64_gradient_far_below_its_cancelling_rows_keeps_its_norm():
    """The same in float64, at scales float32 cannot hold (``2**400`` against ``2**1000``)."""
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("float64 models need JAX_ENABLE_X64=1 (make test-x64)")
    x, v = _cancelling_then_small(2.0**500, 2.0**200, np.float64)
    p = jnp.zeros((16, 16), jnp.float64)
    _norms_and_clipped_sum(_property_loss, p, x, v, np.full(2, 2.0**400 * 4), rtol=1e-12)


# --- the clip factor times a cotangent below the smallest normal number -----------------


def _lost_to_underflow(big: float, small: float, dtype: Any = np.float32):
    """One example of two rows of a dense or 1x1-conv site ``sum((x @ w)[:, 0] * s)``:
    ``(v, 1)`` with cotangent 1 and ``(-big, 0)`` with cotangent ``small``, where
    ``v = big * small`` cancels the second row's first entry. Its gradient is about
    ``(0, 1)``; times a factor ``c`` with ``c * small`` below ``tiny``, a sum that scales
    the cotangents loses the second row and adds ``c * (v, 1)``: ``v`` times too large."""
    v = float(np.asarray(big, dtype) * np.asarray(small, dtype))
    x = np.asarray([[[v, 1.0], [-big, 0.0]]], dtype)
    s = np.asarray([[1.0, small]], dtype)
    return x, s


def _first_column_loss(p, x, s):
    return jnp.sum((x @ p)[..., 0] * s)


def _first_channel_conv_loss(p, x, s):
    y = jax.lax.conv_general_dilated(x, p, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    return jnp.sum(y[..., 0] * s)


@pytest.mark.parametrize("method", ["auto", "ghost", "two_pass", "chunked"])
@pytest.mark.parametrize("rule", ["dense", "conv"])
def test_a_clip_factor_that_pushes_a_cotangent_below_tiny_adds_the_clipped_gradient(
    rule: str, method: Any
):
    """Found by a breaker: the ghost sum multiplied the cotangents by the clip factor in
    float32; ``1e-3 * 1e-35`` is below ``tiny``, was flushed, and the example added
    3000 times ``C`` where at most ``C`` is allowed (two_pass and chunked the same,
    through the backward pass). Now ghost bounds what a scaled cotangent can lose and
    sums such a microbatch from the per-example gradients, and two_pass and chunked run
    the backward pass at the factors over their largest power of two."""
    x, s = _lost_to_underflow(3e38, 1e-35)
    clip = 1e-3
    w = jnp.full((2, 1) if rule == "dense" else (1, 2, 1), 1e-3, jnp.float32)
    loss = _first_column_loss if rule == "dense" else _first_channel_conv_loss
    fn = micro_grad(loss, batch_argnums=(1, 2), l2_clip_norm=clip, clip_method=method)
    got = np.asarray(jax.jit(fn)(w, jnp.asarray(x), jnp.asarray(s))[0], np.float64).ravel()
    each = np.asarray(jax.grad(loss)(w, x, s), np.float64).ravel()  # float32, as the model
    want = each * clip / np.linalg.norm(each)
    # The gradient's own rounding: u times the terms that cancel (3000 * C * 2**-24).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=3000 * clip * 2.0**-23)
    assert np.linalg.norm(got) <= clip * (1 + 1e-5)


def _assert_each_example_clipped(loss, w, x, s, clip: float, method: Any) -> None:
    """``micro_grad``'s clipped sum of the examples of ``x`` and ``s`` (batch arguments 1
    and 2) by ``method`` against each example's float32 gradient, clipped and summed in
    float64; the tolerance is the gradients' own rounding of the terms that cancel."""
    fn = micro_grad(loss, batch_argnums=(1, 2), l2_clip_norm=clip, clip_method=method)
    got = np.asarray(jax.jit(fn)(w, jnp.asarray(x), jnp.asarray(s))[0], np.float64).ravel()
    want = 0.0
    for b in range(len(x)):
        each = np.asarray(jax.grad(loss)(w, x[b : b + 1], s[b : b + 1]), np.float64).ravel()
        want = want + each * min(1.0, clip / np.linalg.norm(each))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=3000 * clip * 2.0**-23)


def _cancelling_cotangents_loss(p, x, s):
    return jnp.sum((x @ p) * s)


def _cancelling_cotangents_conv_loss(p, x, s):
    y = jax.lax.conv_general_dilated(x, p, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    return jnp.sum(y * s)


@pytest.mark.parametrize("method", ["auto", "ghost"])
@pytest.mark.parametrize("rule", ["dense", "conv"])
def test_a_clip_factor_that_pushes_a_data_row_below_tiny_takes_the_per_example_sum(
    rule: str, method: Any
):
    """The example above with data and cotangents swapped, beside one of factor 1: where
    a site's data has fewer entries than its cotangents the ghost sum scales the data
    rows (``_ghost.scales_data``), and the data row ``1e-35`` that meets the cotangent
    ``(-3e38, 0)`` is what the factor ``1e-3`` flushes. The bound counts the data's lost
    entries against the cotangents' magnitudes, fails, and the microbatch's sum comes
    from each example's gradient (counted the other way round, it held, and the example
    entered at 3000 ``C``)."""
    big, small = 3e38, 1e-35
    v = float(np.float32(big) * np.float32(small))
    x = np.asarray([[[1.0], [small]], [[1.0], [0.0]]], np.float32)  # one entry a row
    s = np.asarray([[[v, 1.0], [-big, 0.0]], [[1e-4, 0.0], [0.0, 0.0]]], np.float32)
    clip = 1e-3
    w = jnp.full((1, 2) if rule == "dense" else (1, 1, 2), 1e-3, jnp.float32)
    loss = _cancelling_cotangents_loss if rule == "dense" else _cancelling_cotangents_conv_loss
    program = _ghost.analyse(lambda ps, ex: [loss(ps[0], *ex)], [w], [x[:1], s[:1]])
    assert isinstance(program, _ghost.Program), program
    seen = _ghost.record(program, [w], [jnp.asarray(x)[:, None], jnp.asarray(s)[:, None]])
    linear = [k for k, site in enumerate(program.sites) if site.linear]
    assert [_ghost.scales_data(program, seen, k) for k in linear] == [True]
    _assert_each_example_clipped(loss, w, x, s, clip, method)


def test_the_underflow_bound_keeps_book_keeping_where_it_holds_and_not_where_it_fails():
    """The bound (``_ghost.underflow_risk``) on one row of data ``x`` and a cotangent of
    ``1e-35`` that a factor of ``1e-3`` flushes: at data ``1e3`` the loss, at most ``tiny
    * 1e3``, is far below ``1e-5`` of the target, and book-keeping is kept; at ``3e38``
    it is not, and the microbatch takes the per-example sum."""

    program, params, sites = _underflow_sites(2)

    def risk(data: float) -> bool:
        x = jnp.asarray([[[data, 1.0]]], jnp.float32)
        seen = _ghost.record(program, params, [x, jnp.asarray([[1e-35]], jnp.float32)])
        factor, target = jnp.asarray([1e-3]), jnp.asarray([1e-3])
        return bool(_ghost.underflow_risk(program, seen, sites, factor, target)[0])

    assert not risk(1e3)
    assert risk(3e38)


def _underflow_sites(entries: int) -> tuple[Any, Any, list[int]]:
    """``_first_column_loss``'s program on examples of one row of ``entries`` (weights
    of ``1e-3``), and its linear sites: to be recorded at chosen data and cotangents."""
    fun = lambda ps, ex: [_first_column_loss(ps[0], *ex)]  # noqa: E731
    params = [jnp.full((entries, 1), 1e-3, jnp.float32)]
    example = [jnp.ones((1, entries), jnp.float32), jnp.ones((1,), jnp.float32)]
    program = _ghost.analyse(fun, params, example)
    assert isinstance(program, _ghost.Program), program
    return program, params, [k for k, site in enumerate(program.sites) if site.linear]


_MAGNITUDES = st.sampled_from(
    [0.0, 1e-45, 1e-40, 1.2e-38, 1e-36, 1e-30, 1e-3, 1.0, 1e30, 3e38, np.inf, np.nan]
)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    data=st.lists(_MAGNITUDES, min_size=12, max_size=12),
    cotangents=st.lists(_MAGNITUDES, min_size=4, max_size=4),
    factors=st.lists(st.sampled_from([0.0, 1e-30, 1e-5, 0.5, 1.0]), min_size=4, max_size=4),
)
def test_the_underflow_bound_is_counted_exactly_where_an_entry_may_underflow(
    data: list[float], cotangents: list[float], factors: list[float]
):
    """``underflow_risk`` counts lost entries only inside a branch taken where some
    example's smallest magnitude other than 0 times its factor is below ``tiny``: it
    answers as the count itself (``_counted_risk``) on magnitudes across float32's range,
    0, subnormals, inf and NaN included, on data and cotangents."""
    program, params, sites = _underflow_sites(3)
    x = jnp.asarray(np.reshape(data, (4, 1, 3)), jnp.float32)
    s = jnp.asarray(np.reshape(cotangents, (4, 1)), jnp.float32)
    seen = _ghost.record(program, params, [x, s])
    factor = jnp.asarray(factors, jnp.float32)
    target = jnp.asarray([1e-3, 1.0, 1e-30, 0.0], jnp.float32)
    got = _ghost.underflow_risk(program, seen, sites, factor, target)
    sides = [book_keeping._scaled_side(program, seen, k) for k in sites]
    counted = book_keeping._counted_risk(program, sites, sides, factor, target)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(counted))


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    x=st.lists(_MAGNITUDES, min_size=6, max_size=6),
    g=st.lists(_MAGNITUDES, min_size=4, max_size=4),
    signs=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_the_rows_norm_keeps_each_row_norm_apart_from_its_power_of_two(x, g, signs):
    """``products._rows_norm`` of two shared entries' rows against the float64 norm of the
    outer products ``x_h g_h^T`` (inf where that is beyond float32, NaN where a product
    of the entries is, ``0 * inf``): a row's own norm may overflow, or the product of
    two norms underflow, where the gradient is a float32 number."""
    sign = np.where(signs, -1.0, 1.0)
    xs = np.reshape(np.asarray(x) * sign[:6], (2, 3)).astype(np.float32)
    gs = np.reshape(np.asarray(g) * sign[6:], (2, 2)).astype(np.float32)
    tiny = float(np.finfo(np.float32).tiny)

    def flushed(a: np.ndarray) -> np.ndarray:  # XLA:CPU reads subnormal inputs as 0
        return np.where(np.abs(a) < tiny, 0.0, a).astype(np.float64)

    with np.errstate(invalid="ignore", over="ignore"):
        outer = np.einsum("hk,hn->hkn", flushed(xs), flushed(gs))
        want = np.sqrt(np.sum(outer**2))
    got = float(products._rows_norm(jnp.asarray(xs), jnp.asarray(gs)))
    if np.isnan(want):
        assert np.isnan(got), (got, want)
    elif want > np.finfo(np.float32).max:
        assert got == np.inf, (got, want)
    else:  # a product below tiny is flushed too, as in the gradient
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2 * tiny)


def test_the_underflow_count_and_the_data_sums_run_only_inside_a_branch():
    """The count of lost entries (an integer sum) and the data's magnitudes (a float
    sum) are inside ``lax.cond``'s branch; outside it, one minimum per scaled side."""
    program, params, sites = _underflow_sites(3)
    x, s = jnp.ones((4, 1, 3), jnp.float32), jnp.ones((4, 1), jnp.float32)
    seen = _ghost.record(program, params, [x, s])

    def risk(factor: jax.Array, target: jax.Array) -> jax.Array:
        return _ghost.underflow_risk(program, seen, sites, factor, target)

    jaxpr = jax.make_jaxpr(risk)(jnp.ones((4,)), jnp.ones((4,))).jaxpr
    found = [(e.primitive.name, branch) for e, branch in equations(jaxpr)]
    assert ("reduce_min", False) in found
    assert ("reduce_sum", True) in found
    assert ("reduce_sum", False) not in found


@pytest.mark.x64
def test_a_float64_clip_factor_that_pushes_a_cotangent_below_tiny_adds_the_clipped_gradient():
    """The same in float64: ``1e-3 * 2e-305`` is below float64's ``tiny``."""
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("float64 models need JAX_ENABLE_X64=1 (make test-x64)")
    x, s = _lost_to_underflow(1.5e308, 2e-305, np.float64)
    w = jnp.full((2, 1), 1e-3, jnp.float64)
    for method in ("auto", "two_pass"):
        fn = micro_grad(_first_column_loss, batch_argnums=(1, 2), l2_clip_norm=1e-3,
                        clip_method=method)  # fmt: skip
        got = np.asarray(jax.jit(fn)(w, jnp.asarray(x), jnp.asarray(s))[0]).ravel()
        assert np.linalg.norm(got) <= 1e-3 * (1 + 1e-12), method


def _gained_loss(p, x, v):
    return jnp.sum((x[0] @ (p * 2.0**64)) * v[0])  # a gain of 2**64 before the site


def _added_loss(p, x, v):
    for _ in range(64):  # the same gain, from sums alone: p + p, 64 times
        p = p + p
    return jnp.sum((x[0] @ p) * v[0])


def _divided_loss(p, x, v):
    return jnp.sum((x[0] / p[None]) * v[0])  # the site reads w, not a product with it


def _beside_an_unclipped_example(model: str) -> tuple[Callable[..., Any], Any, Any, Any]:
    """Two examples: the first of norm 0.5 (factor 1), the second of a norm about 1e19
    whose first entry is exactly 0, two rows cancelling at data 1 and ``2**k``. Its
    factor takes the second row's cotangent below ``tiny``, and a sum that loses it
    adds the first row alone."""
    x, v = (
        np.zeros((2, 2, 1 if model in ("gain", "added") else 2), np.float32),
        np.zeros((2, 2, 2), np.float32),
    )
    if model in ("gain", "added"):
        p = jnp.full((1, 2), 2.0**-40, jnp.float32)
        x[0], v[0] = [[1.0], [0.0]], [[0.0, 0.5 * 2.0**-64], [0.0, 0.0]]
        x[1], v[1] = [[1.0], [2.0**64]], [[1.0, 0.27], [-(2.0**-64), 0.0]]
        return (_gained_loss if model == "gain" else _added_loss), p, x, v
    p = jnp.full((2,), 2.0**-40, jnp.float32)
    x[0], v[0] = [[0.0, 1.0], [0.0, 0.0]], [[0.0, -0.5 * 2.0**-80], [0.0, 0.0]]
    x[1], v[1] = [[1.0, 1.0], [2.0**60, 0.0]], [[1.0, 1e20 * 2.0**-80], [-(2.0**-60), 0.0]]
    return _divided_loss, p, x, v


@pytest.mark.parametrize("method", ["auto", "ghost", "statistics"])
@pytest.mark.parametrize("model", ["gain", "added", "divide"])
def test_a_gain_or_a_division_at_the_site_does_not_hide_an_underflow(model: str, method: Any):
    """Found by a breaker: the bound took every site for a product of data and weight
    entries, read straight from the leaf. With the weight times ``2**64`` before the
    site, or divided into the data (``x / w``), a lost cotangent moves the gradient by
    far more than ``tiny`` times the data, the check kept book-keeping, and the second
    example added 3.8 ``C`` (gain) and 12089 ``C`` (division); the statistics method
    the same. Such sites now take the per-example sum wherever an entry is lost. Round
    9: the same gain from ``p + p`` alone ("added"), which was taken for a copy."""
    loss, p, x, v = _beside_an_unclipped_example(model)
    options: dict[str, Any] = {"clip_method": method}
    if method == "statistics":
        options["transform_fn"] = lambda g: (g, jax.tree.map(jnp.square, g))
    fn = jax.jit(micro_grad(loss, batch_argnums=(1, 2), l2_clip_norm=1.0, **options))
    got = fn(p, jnp.asarray(x), jnp.asarray(v))[0]
    alone = fn(p, jnp.asarray(x), jnp.asarray(v), example_weights=jnp.asarray([1.0, 0.0]))[0]
    if method == "statistics":
        got, alone = got[0], alone[0]
    added = np.asarray(got, np.float64) - np.asarray(alone, np.float64)
    each = np.asarray(jax.grad(loss)(p, x[1:], v[1:]), np.float64)
    np.testing.assert_allclose(added, each / np.linalg.norm(each), rtol=1e-5, atol=1e-6)


@pytest.mark.x64
def test_a_float64_gain_before_the_site_does_not_hide_an_underflow():
    """The gain in float64: ``2**560`` before the site; the example added ``1.1e12 C``."""
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("float64 models need JAX_ENABLE_X64=1 (make test-x64)")
    gain = 2.0**560

    def loss(p, x, v):
        return jnp.sum((x[0] @ (p * gain)) * v[0])

    p = jnp.full((1, 2), 1 / gain, jnp.float64)
    x, v = np.zeros((2, 2, 1)), np.zeros((2, 2, 2))
    x[0], v[0] = [[1.0], [0.0]], [[0.0, 0.5 / gain], [0.0, 0.0]]
    x[1], v[1] = [[1.0], [gain]], [[1.0, 2.0**-40], [-1 / gain, 0.0]]
    fn = jax.jit(micro_grad(loss, batch_argnums=(1, 2), l2_clip_norm=1.0, clip_method="ghost"))
    got = np.asarray(fn(p, x, v)[0])
    # The first example adds its gradient (0, 0.5); the second its direction, (0, 1).
    np.testing.assert_allclose(got, [[0.0, 1.5]], rtol=1e-12, atol=1e-12)


@pytest.mark.x64
@pytest.mark.parametrize("method", ["auto", "ghost"])
def test_a_float64_example_beside_an_unclipped_one_takes_the_per_example_sum(method: Any):
    """The float64 form of the next test. Found in review: the bound was kept in
    float32, where ``tiny * 1e200`` (float64's ``tiny``) is 0, so the check never fired:
    the factor ``1e-120`` takes the cotangent ``1e-195`` to a subnormal that keeps a few
    bits, and the example added ``1e5`` times ``C``."""
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("float64 models need JAX_ENABLE_X64=1 (make test-x64)")
    x, s = _lost_to_underflow(1e200, 1e-195, np.float64)
    x = np.concatenate([x, np.asarray([[[1e-121, 0.0], [0.0, 0.0]]])])
    s = np.concatenate([s, np.asarray([[1.0, 0.0]])])
    clip, w = 1e-120, jnp.full((2, 1), 1e-3, jnp.float64)
    fn = micro_grad(_first_column_loss, batch_argnums=(1, 2), l2_clip_norm=clip,
                    clip_method=method)  # fmt: skip
    got = np.asarray(jax.jit(fn)(w, jnp.asarray(x), jnp.asarray(s))[0]).ravel() / clip
    want = 0.0
    for b in range(2):
        each = np.asarray(jax.grad(_first_column_loss)(w, x[b : b + 1], s[b : b + 1])).ravel()
        want = want + each * min(1.0, clip / np.linalg.norm(each)) / clip
    # want is (0.1, 1) in units of C; the gradient's own rounding is u times the
    # terms that cancel (1e5 C * 2**-52).
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e5 * 2.0**-51)


@pytest.mark.parametrize("method", ["auto", "ghost"])
@pytest.mark.parametrize("rule", ["dense", "conv"])
def test_beside_an_unclipped_example_the_underflowing_one_takes_the_per_example_sum(
    rule: str, method: Any
):
    """The same example beside one whose gradient is below ``C`` (factor 1): scaling by
    the microbatch's largest factor leaves the first at ``1e-3``, the bound fails, and
    the microbatch's sum comes from each example's gradient."""
    x, s = _lost_to_underflow(3e38, 1e-35)
    x = np.concatenate([x, np.asarray([[[1e-4, 0.0], [0.0, 0.0]]], np.float32)])
    s = np.concatenate([s, np.asarray([[1.0, 0.0]], np.float32)])
    clip = 1e-3
    w = jnp.full((2, 1) if rule == "dense" else (1, 2, 1), 1e-3, jnp.float32)
    loss = _first_column_loss if rule == "dense" else _first_channel_conv_loss
    _assert_each_example_clipped(loss, w, x, s, clip, method)


@pytest.mark.parametrize("shape", [(1, 4), (8, 1)], ids=["data-scaled", "cotangent-scaled"])
def test_a_large_weight_does_not_flush_another_examples_factor(shape: tuple[int, int]):
    """Found by a breaker (round 18): beside an example of weight ``2**60``, an example
    of gradient norm ``2e20`` (factor ``5e-21``, a normal number) was dropped by ghost
    and auto: dividing the microbatch's factors by the power of two above the largest
    took its factor below ``tiny``, where it was flushed to 0, and a factor of 0 reads as
    an example left out. Such a microbatch now takes the per-example sum."""
    w = jnp.ones(shape, jnp.float32)
    x = jnp.full((2, 1, shape[0]), 1.0, jnp.float32) * jnp.asarray([1e-15, 1e10])[:, None, None]
    y = jnp.ones((2, 1, shape[1]), jnp.float32) * jnp.asarray([1e-15, 1e10])[:, None, None]
    weights = jnp.asarray([2.0**60, 1.0], jnp.float32)
    want = 0.0
    for b in range(2):
        each = np.asarray(jax.grad(_cancelling_cotangents_loss)(w, x[b], y[b]), np.float64)
        want = want + float(weights[b]) * each * min(1.0, 1.0 / np.linalg.norm(each))
    for method in ("auto", "ghost"):
        fn = micro_grad(_cancelling_cotangents_loss, batch_argnums=(1, 2), l2_clip_norm=1.0,
                        clip_method=method)  # fmt: skip
        got = np.asarray(jax.jit(fn)(w, x, y, example_weights=weights)[0], np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=method)


def _largest_entry(g: Any) -> jax.Array:
    """A ``metrics_fn`` that reads the gradients (``l2_norm`` would not)."""
    return jnp.max(jnp.abs(g))


def test_auto_with_a_metrics_fn_that_reads_the_gradients_still_bounds_underflow():
    """Found by a breaker: with a ``metrics_fn`` that needs the gradients, ``auto`` took
    ``chunked``, which differentiates the factor-weighted loss, and the example beside an
    unclipped one entered at 3000 ``C``. Clipped, it now forms and clips each gradient."""
    x, s = _lost_to_underflow(3e38, 1e-35)
    x = np.concatenate([x, np.asarray([[[1e-4, 0.0], [0.0, 0.0]]], np.float32)])
    s = np.concatenate([s, np.asarray([[1.0, 0.0]], np.float32)])
    clip, w = 1e-3, jnp.full((2, 1), 1e-3, jnp.float32)
    fn = micro_grad(
        _first_column_loss, batch_argnums=(1, 2), l2_clip_norm=clip, metrics_fn=_largest_entry
    )
    report = microbatching.clipping_report(fn, w, jnp.asarray(x), jnp.asarray(s))
    assert report.method == "materialize", str(report)
    got, aux = jax.jit(fn)(w, jnp.asarray(x), jnp.asarray(s))
    want, largest = 0.0, []
    for b in range(2):
        each = np.asarray(jax.grad(_first_column_loss)(w, x[b : b + 1], s[b : b + 1]), np.float64)
        largest.append(np.max(np.abs(each)))
        want = want + each.ravel() * min(1.0, clip / np.linalg.norm(each))
    np.testing.assert_allclose(
        np.asarray(got, np.float64).ravel(), want, rtol=1e-5, atol=3000 * clip * 2.0**-23
    )
    np.testing.assert_allclose(np.asarray(aux.metrics, np.float64), largest, rtol=1e-6, atol=0)


def test_auto_with_a_metrics_fn_that_reads_the_gradients_keeps_per_layer_bounds_and_nan_safe():
    """Found by a breaker: the same ``chunked`` scaled each example's whole gradient by
    its first subtree's factor (a layer bounded by 0.01 got 3.5, an example 1.54 times the
    sensitivity) and ignored ``nan_safe`` (a NaN sum). The reference clips each layer of
    each ``jax.grad`` and drops the example whose gradient is not finite."""

    def loss(p, x, y):
        hidden = jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"])
        return jnp.mean((jnp.sum(hidden, axis=(-1, -2)) - y) ** 2)

    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 5, 6)).astype(np.float32)
    x[2, 0, 0] = np.nan
    y = rng.normal(size=(4,)).astype(np.float32)
    params = {k: jnp.asarray(rng.normal(size=(6, 6)) * 0.5, jnp.float32) for k in ("a", "b")}
    bounds = {"a": 3.0, "b": 0.01}
    fn = micro_grad(
        loss,
        batch_argnums=(1, 2),
        microbatch_size=2,
        l2_clip_norm=bounds,
        nan_safe=True,
        metrics_fn=lambda g: jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(g))),
    )
    got, _ = jax.jit(fn)(params, x, y)
    want = {k: np.zeros((6, 6)) for k in bounds}
    for b in range(4):
        each = jax.grad(loss)(params, x[b : b + 1], y[b : b + 1])
        if not all(np.all(np.isfinite(np.asarray(g))) for g in each.values()):
            continue
        for k, bound in bounds.items():
            g = np.asarray(each[k], np.float64)
            want[k] += g * min(1.0, bound / np.linalg.norm(g))
    for k in bounds:
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=1e-5, atol=1e-7)


def _rounding_loss(p, x, c):
    """A loss whose backward pass rounds its cotangent (1 bit of mantissa)."""
    rounded = jax.lax.reduce_precision(x @ p, exponent_bits=8, mantissa_bits=1)
    return jnp.sum(rounded * c)


def test_a_backward_pass_that_rounds_is_not_scaled_by_the_weights():
    """Found by a breaker: ``reduce_precision`` rounds its cotangent, so the gradient of
    the weighted loss is not the weighted sum of the gradients (``round(0.63 g)`` is
    ``0.75 g``: an example entered at 1.19 ``C`` under ``two_pass``). The methods that
    scale the loss now refuse it, and ``auto`` weighs each example's own gradient."""
    w = jnp.zeros((4, 4), jnp.float32)
    x, c = jnp.ones((2, 1, 4), jnp.float32), jnp.ones((2, 1, 4), jnp.float32)
    weights = jnp.asarray([0.63, 0.0], jnp.float32)
    with pytest.raises(ValueError, match="clip_method='two_pass', which takes the gradient"):
        micro_grad(_rounding_loss, batch_argnums=(1, 2), l2_clip_norm=2.52, clip_method="two_pass")(
            w, x, c
        )
    got = micro_grad(_rounding_loss, batch_argnums=(1, 2))(w, x, c, example_weights=weights)[0]
    want = 0.63 * np.asarray(jax.grad(_rounding_loss)(w, x[:1], c[:1]), np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=0)
    clipped = micro_grad(_rounding_loss, batch_argnums=(1, 2), l2_clip_norm=2.52)
    total = clipped(w, x, c, example_weights=jnp.asarray([1.0, 0.0]))[0]
    np.testing.assert_allclose(float(jnp.linalg.norm(total)), 2.52, rtol=1e-6, atol=0)


@pytest.mark.x64
def test_times_power_and_halve_are_exact_over_the_exponent_range():
    """``x * 2**k`` against numpy's ``ldexp`` for every ``k`` that keeps the result
    normal, and ``floor(k / 2)`` for negative and positive ``k``; float32 (and float64
    under x64)."""
    ks = np.arange(-300, 301, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(_clipping.halve(jnp.asarray(ks))), ks // 2)
    dtypes = [np.float32] + ([np.float64] if jax.config.read("jax_enable_x64") else [])
    for dtype in dtypes:
        info = np.finfo(dtype)
        top = info.maxexp
        k = np.arange(-3 * top, 3 * top + 1).astype(np.int32 if dtype == np.float32 else np.int64)
        for x in (1.0, 1.5, info.tiny, 0.75 * float(info.max)):
            with np.errstate(over="ignore", under="ignore"):  # those are left out below
                exact = np.ldexp(np.asarray(x, np.float64), k.astype(np.int64))
            normal = (np.abs(exact) >= info.tiny) & (np.abs(exact) <= info.max)
            got = np.asarray(_clipping.times_power(jnp.full(k.shape, x, dtype), jnp.asarray(k)))
            np.testing.assert_array_equal(got[normal], exact[normal].astype(dtype))


@pytest.mark.x64
def test_power_of_two_is_exact_over_the_normal_exponents_and_overflows_or_flushes_one_beyond():
    """``2**k`` from its bits against numpy's ``ldexp``, for every ``k`` from ``minexp``
    to ``maxexp - 1``; ``inf`` one above and 0 one below, as a product would give."""
    dtypes = [np.float32] + ([np.float64] if jax.config.read("jax_enable_x64") else [])
    for dtype in dtypes:
        info = np.finfo(dtype)
        ints = np.int32 if dtype == np.float32 else np.int64
        k = np.arange(info.minexp, info.maxexp).astype(ints)
        got = np.asarray(_clipping.power_of_two(jnp.asarray(k), dtype))
        np.testing.assert_array_equal(got, np.ldexp(np.ones(k.shape, dtype), k.astype(np.int64)))
        ends = np.asarray(
            _clipping.power_of_two(jnp.asarray([info.minexp - 1, info.maxexp], ints), dtype)
        )
        np.testing.assert_array_equal(ends, np.asarray([0, np.inf], dtype))
