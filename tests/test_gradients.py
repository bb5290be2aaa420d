"""Gradient accumulation at the cost of one microbatch.

Differentiating through ``microbatch`` and ``micro_vmap`` (every JAX transformation, one
microbatch of memory), the ``micro_grad`` fast path and ``l2_clip_norm``, accumulation
precision, and one all-reduce per step on Auto meshes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from microbatching import (
    AccumulationType,
    Accumulator,
    _tuning,
    clipping_report,
    l2_norm,
    micro_grad,
    micro_vmap,
    microbatch,
)
from microbatching._batch_statistics import PROBE_ROWS
from microbatching._tuning import chunk_rows

from .strategies import assert_close, clipper, equations, microbatch_sizes, random_array
from .test_sharding import all_reduces_in_loops, collectives


def _tune(patch: pytest.MonkeyPatch, **changes: int) -> None:
    """The backend's tuning with ``changes``, for the test (``_tuning.knobs``)."""
    tuned = dataclasses.replace(_tuning.knobs(), **changes)
    patch.setattr(_tuning, "knobs", lambda: tuned)


SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
RUNNING_MEAN = AccumulationType.RUNNING_MEAN
MAX, MIN = AccumulationType.MAX, AccumulationType.MIN
REDUCING = [SUM, MEAN, RUNNING_MEAN]
W = random_array(0, (4, 5), jnp.float32) / 2
X = random_array(1, (12, 4), jnp.float32)


def rows(w, x):
    return jnp.tanh(x @ w)


def reduced(kind):
    """``fun`` for ``microbatch``: the per-microbatch result ``kind`` combines into the
    full-batch result (means of rows for the means, sums for SUM, rows for CONCAT)."""
    if kind is CONCAT:
        return rows
    if kind is SUM:
        return lambda w, x: jnp.sum(rows(w, x), axis=0)
    if kind in (MAX, MIN):
        extremum = jnp.max if kind is MAX else jnp.min
        return lambda w, x: extremum(rows(w, x), axis=0)
    return lambda w, x: jnp.mean(rows(w, x), axis=0)


def whole(kind):
    """The un-microbatched reference for ``reduced(kind)`` over the whole batch."""
    return reduced(kind)


def scalar(out):
    weights = jnp.arange(1.0, 1.0 + out.size, dtype=out.dtype).reshape(out.shape)
    return jnp.sum(jnp.sin(out) * weights)


ARGNUMS = [0, 1, (0, 1)]


def _grads(fun):
    """``jax.grad`` of ``scalar(fun(w, x))`` for each of ``ARGNUMS``, in one jitted program."""
    return jax.jit(
        lambda w, x: [jax.grad(lambda w, x: scalar(fun(w, x)), a)(w, x) for a in ARGNUMS]
    )


@functools.cache
def _whole_grads(kind):
    return _grads(whole(kind))(W, X)


@given(data=st.data())
@settings(max_examples=10, deadline=None)
def test_grad_through_microbatch_equals_the_whole_batch(data):
    kind = data.draw(st.sampled_from(list(AccumulationType)))
    size = data.draw(microbatch_sizes(X.shape[0]))
    fun = microbatch(reduced(kind), 1, size, kind)
    n = X.shape[0] // size
    for got, want in zip(_grads(fun)(W, X), _whole_grads(kind), strict=True):
        assert_close(got, want, terms=n)


@pytest.mark.parametrize("kind", list(AccumulationType))
@pytest.mark.parametrize("size", [1, 3, 12])
def test_vjp_and_value_and_grad_through_micro_vmap(kind, size):
    fun = micro_vmap(rows, (None, 0), microbatch_size=size, accumulator=kind)
    reference = {
        SUM: jnp.sum,
        MEAN: jnp.mean,
        RUNNING_MEAN: jnp.mean,
        CONCAT: lambda r, axis: r,
        MAX: jnp.max,
        MIN: jnp.min,
    }
    want_fn = lambda w, x: reference[kind](jax.vmap(rows, (None, 0))(w, x), axis=0)  # noqa: E731
    out, vjp = jax.vjp(fun, W, X)
    want_out, want_vjp = jax.vjp(want_fn, W, X)
    assert_close(out, want_out, terms=12)
    cotangent = random_array(5, out.shape, jnp.float32)
    assert_close(vjp(cotangent), want_vjp(cotangent), terms=12)
    value, grads = jax.value_and_grad(lambda w, x: scalar(fun(w, x)), (0, 1))(W, X)
    want_value, want_grads = jax.value_and_grad(lambda w, x: scalar(want_fn(w, x)), (0, 1))(W, X)
    assert_close(value, want_value, terms=12)
    assert_close(grads, want_grads, terms=12)


def test_forward_mode_hessian_vector_products_vmap_and_jit_still_work():
    fun = microbatch(reduced(SUM), 1, 4, SUM)
    loss = lambda w: scalar(fun(w, X))  # noqa: E731
    want_loss = lambda w: scalar(reduced(SUM)(w, X))  # noqa: E731
    tangent = random_array(7, W.shape, jnp.float32)
    assert_close(jax.jvp(loss, (W,), (tangent,)), jax.jvp(want_loss, (W,), (tangent,)), terms=3)
    hvp = lambda f: jax.jvp(jax.grad(f), (W,), (tangent,))[1]  # noqa: E731
    assert_close(jax.jit(lambda: hvp(loss))(), hvp(want_loss), terms=3, factor=4)
    ws = jnp.stack([W, 2 * W])
    assert_close(jax.vmap(jax.grad(loss))(ws), jax.vmap(jax.grad(want_loss))(ws), terms=3)


def _kept_reference(kind, count):
    """The loss of ``test_grad_with_a_traced_num_real_microbatches`` with only the rows of
    microbatches ``0 .. count-1`` kept (microbatch i holds rows i, i + 4, i + 8)."""
    kept = (jnp.arange(12) % 4 < count)[:, None]

    def loss(w):
        if kind in (MAX, MIN):
            extremum = jnp.max if kind is MAX else jnp.min
            fill = -jnp.inf if kind is MAX else jnp.inf
            return scalar(extremum(jnp.where(kept, rows(w, X), fill), 0))
        out = jnp.where(kept, rows(w, X), 0.0)
        if kind is CONCAT:
            return scalar(out)
        total = jnp.sum(out, 0)
        if kind is SUM:
            return scalar(total)
        return scalar(total / 3 / (4 if kind is MEAN else max(count, 1)))

    return loss


@pytest.mark.x64
@pytest.mark.parametrize("kind", list(AccumulationType))
def test_grad_with_a_traced_num_real_microbatches(kind):
    def loss(w, count):
        fun = microbatch(reduced(kind), 1, 3, kind, num_real_microbatches=count)
        return scalar(fun(w, X))

    grad = jax.jit(jax.grad(loss))
    for count in [2, 4] if kind in (MAX, MIN) else [0, 2, 4]:  # no rows: MAX gives -inf
        want = jax.grad(_kept_reference(kind, count))(W)
        assert_close(grad(W, jnp.int32(count)), want, terms=4)


def _mlp_loss(params, x, y):
    h = jax.nn.relu(x @ params[0])
    return jnp.mean((h @ params[1] - y) ** 2)


def _temp(fun, *args) -> int:
    analysis = jax.jit(fun).lower(*args).compile().memory_analysis()
    assert analysis is not None
    return analysis.temp_size_in_bytes


@pytest.mark.compiled
def test_grad_through_microbatch_costs_one_microbatch_of_memory():
    params = [random_array(0, (64, 128), jnp.float32), random_array(1, (128, 16), jnp.float32)]
    temps = {}
    for batch in [1024, 16384]:
        x, y = jnp.ones((batch, 64)), jnp.ones((batch, 16))
        through = jax.grad(microbatch(_mlp_loss, (1, 2), 128, MEAN))
        inside = microbatch(jax.grad(_mlp_loss), (1, 2), 128, MEAN)
        temps[batch] = (_temp(through, params, x, y), _temp(inside, params, x, y))
        vmap_grad = jax.grad(
            lambda p, x: jnp.sum(
                micro_vmap(lambda r: jnp.tanh(r @ p[0]), microbatch_size=128, accumulator=SUM)(x)
            )
        )
        temps[batch] += (_temp(vmap_grad, params, x),)
    assert temps[16384][0] <= 1.2 * temps[1024][0]
    assert temps[16384][0] <= 1.5 * temps[16384][1]
    assert temps[16384][2] <= 1.2 * temps[1024][2]


# --- micro_grad: the fast path and l2_clip_norm -----------------------------------------


def _per_example(loss, params, *batch):
    return jax.vmap(jax.grad(loss), (None, *[0] * len(batch)))(params, *[b[:, None] for b in batch])


def _norm(grads):
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(grads)))


@functools.cache
def _references(model):
    """``MODELS[model]``'s per-example gradients, values and gradient norms, one jitted
    program per model for all the tests that compare against them."""
    loss, params, x, y = MODELS[model]

    @jax.jit
    def references(params, x, y):
        grads = _per_example(loss, params, x, y)
        values = jax.vmap(loss, (None, 0, 0))(params, x[:, None], y[:, None])
        return grads, values, jax.vmap(_norm)(grads)

    return references(params, x, y)


def _call(fn, size):
    """``fn`` itself, or jitted where ``size`` is None: without microbatching an eager call
    runs ``fun`` op by op, compiling each of its primitives, on the same path as under jit."""
    return jax.jit(fn) if size is None else fn


def _models():
    """Losses with dense, convolution, embedding and layer-norm layers, and their data."""
    rng = np.random.default_rng(0)

    def dense(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"][None]) @ p["v"] - y) ** 2)

    def conv(p, x, y):
        out = jax.lax.conv_general_dilated(
            x, p["k"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )
        return jnp.mean((jnp.mean(jax.nn.relu(out), axis=1) @ p["v"] - y) ** 2)

    def embedding(p, tokens, y):
        h = jnp.mean(p["table"][tokens], axis=1)
        mean, var = jnp.mean(h, -1, keepdims=True), jnp.var(h, -1, keepdims=True)
        normed = (h - mean) / jnp.sqrt(var + 1e-5) * p["scale"][None] + p["shift"][None]
        return jnp.mean((normed @ p["v"] - y) ** 2)

    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    y = f(16, 3)
    return {
        "dense": (dense, {"w": f(5, 8), "b": f(8), "v": f(8, 3)}, f(16, 5), y),
        "conv": (conv, {"k": f(3, 2, 4), "v": f(4, 3)}, f(16, 7, 2), y),
        "embedding+layernorm": (
            embedding,
            {"table": f(11, 6), "scale": f(6), "shift": f(6), "v": f(6, 3)},
            jnp.asarray(rng.integers(0, 11, (16, 4)), jnp.int32),
            y,
        ),
    }


MODELS = _models()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("size", [None, 1, 4, 16])
@pytest.mark.parametrize("kind", REDUCING)
def test_fast_path_equals_the_sum_of_per_example_gradients(model, size, kind):
    loss, params, x, y = MODELS[model]
    fn = micro_grad(loss, batch_argnums=(1, 2), microbatch_size=size, accumulator=kind)
    grads, aux = _call(fn, size)(params, x, y)
    per_example, values, _ = _references(model)
    reduce = jnp.sum if kind is SUM else jnp.mean
    assert_close(grads, jax.tree.map(lambda g: reduce(g, 0), per_example), terms=16)
    assert_close(aux.values, values)
    assert aux.metrics is None


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("size", "kind"), [(None, MEAN), (2, SUM), (2, MEAN), (16, SUM)])
def test_l2_clip_norm_equals_clipping_in_transform_fn(model, size, kind):
    """``l2_clip_norm`` sums (or averages) each example's ``jax.vmap(jax.grad)`` gradient
    scaled to norm at most the bound, as optax's way, a clipping ``transform_fn``, does
    (compared where there are several microbatches), with the gradients' norms as
    metrics; a ``transform_fn`` beside it applies to the clipped gradients (SUM: the
    path is the same for MEAN). Batch 16: no microbatching, 8 microbatches, one."""
    loss, params, x, y = MODELS[model]
    per_example, values, norms = _references(model)
    bound = float(np.median(norms))
    scale = jnp.minimum(1.0, bound / norms)
    reduce = jnp.sum if kind is SUM else jnp.mean
    want = jax.tree.map(
        lambda g: reduce(g * scale.reshape(-1, *[1] * (g.ndim - 1)), 0), per_example
    )
    common = {"batch_argnums": (1, 2), "microbatch_size": size, "accumulator": kind}
    fast_fn = micro_grad(loss, l2_clip_norm=bound, metrics_fn=_norm, **common)
    fast, fast_aux = _call(fast_fn, size)(params, x, y)
    assert_close(fast, want, terms=16)
    assert_close(fast_aux.values, values)
    assert_close(fast_aux.metrics, norms)
    if size == 2:
        slow_fn = micro_grad(loss, transform_fn=clipper(bound), metrics_fn=_norm, **common)
        slow, slow_aux = _call(slow_fn, size)(params, x, y)
        assert_close(fast, slow, terms=16)
        assert_close(fast_aux, slow_aux)
    if kind is SUM:
        doubled_fn = micro_grad(
            loss, l2_clip_norm=bound, transform_fn=lambda g: jax.tree.map(lambda v: 2 * v, g),
            **common,
        )  # fmt: skip
        doubled, _ = _call(doubled_fn, size)(params, x, y)
        assert_close(doubled, jax.tree.map(lambda v: 2 * v, want), terms=16)


@pytest.mark.x64
def test_l2_clip_norm_with_zero_gradients_and_keep_batch_dim_false():
    loss = lambda w, x: jnp.sum(w * x)  # noqa: E731
    x = jnp.concatenate([jnp.zeros((4, 3)), 10 * jnp.ones((4, 3))])
    grads, _ = micro_grad(loss, keep_batch_dim=False, microbatch_size=4, l2_clip_norm=1.0)(
        jnp.ones(3), x
    )
    assert_close(grads, 4 * 10 * jnp.ones(3) / jnp.sqrt(300.0))


@pytest.mark.compiled
def test_fast_path_forms_no_per_example_gradients(monkeypatch):
    params = [random_array(0, (64, 256), jnp.float32), random_array(1, (256, 16), jnp.float32)]
    x, y = jnp.ones((1024, 64)), jnp.ones((1024, 16))
    summed = lambda p, x, y: _mlp_loss(p, x, y) * x.shape[0]  # noqa: E731
    gradient_bytes = 4 * (64 * 256 + 256 * 16)
    _tune(monkeypatch, statistics_chunk_bytes=16 * gradient_bytes)
    common = {"batch_argnums": (1, 2), "microbatch_size": 256}
    base = _temp(microbatch(jax.grad(summed), (1, 2), 256, SUM), params, x, y)
    fast = _temp(micro_grad(_mlp_loss, **common), params, x, y)
    clipped = _temp(micro_grad(_mlp_loss, l2_clip_norm=1.0, **common), params, x, y)
    per_example = {"transform_fn": clipper(1.0), "clip_method": "materialize", **common}
    one_by_one = _temp(micro_grad(_mlp_loss, **per_example), params, x, y)
    # The same clipping as transform_fn: read as l2_clip_norm's path, its memory.
    scaled = _temp(micro_grad(_mlp_loss, transform_fn=clipper(1.0), **common), params, x, y)
    assert fast <= 1.5 * base
    assert one_by_one >= 256 * gradient_bytes  # a microbatch of per-example gradients
    assert clipped <= 2 * 16 * gradient_bytes + 2 * base  # norms 16 rows at a time
    assert scaled <= 2 * 16 * gradient_bytes + 2 * base


def _chunk_loss(params, x, y):
    h = jnp.tanh(x @ params["w"] + params["b"])
    value = jnp.sum((h @ params["v"] - y) ** 2)
    return value, {"value": value, "first": h[0]}


_CHUNK_PARAMS = {
    "w": random_array(10, (5, 6), jnp.float32),
    "b": random_array(11, (6,), jnp.float32),
    "v": random_array(12, (6, 2), jnp.float32),
}
_CHUNK_GRADIENT_BYTES = 4 * (5 * 6 + 6 + 6 * 2)


@pytest.mark.x64
@pytest.mark.parametrize("rows_at_once", [1, 3, 12])  # 3: the largest divisor of 12 below 4
@pytest.mark.parametrize(
    "options",
    [
        {"l2_clip_norm": 0.5},
        {"l2_clip_norm": {"w": 0.3, "b": 0.2, "v": 0.4}, "weighted": True},
        {"l2_clip_norm": 0.5, "nan_safe": True, "weighted": True, "nan_row": True},
        {"metrics_fn": "norms", "accumulator": MEAN},
        {"bfloat16": True},
    ],
    ids=["clipped", "per-leaf-weighted", "nan-safe", "metrics-mean", "bf16-unclipped"],
)
def test_materialize_in_chunks_matches_the_per_example_reference(
    monkeypatch, rows_at_once, options
):
    """``explicit`` forms the per-example gradients ``explicit_chunk_bytes`` at a time and
    adds the chunks' sums: checked against ``vmap(grad)``, clipped and summed here, at one
    row, three rows and the whole microbatch at once, with weights, per-leaf bounds, a
    NaN row dropped by ``nan_safe``, metrics, aux, a remainder and a bfloat16 model."""
    _tune(monkeypatch, explicit_chunk_bytes=rows_at_once * _CHUNK_GRADIENT_BYTES)
    options = dict(options)
    narrow = options.pop("bfloat16", False)
    weighted, nan_row = options.pop("weighted", False), options.pop("nan_row", False)
    norms = options.pop("metrics_fn", None) == "norms"
    dtype = jnp.bfloat16 if narrow else jnp.float32
    params = jax.tree.map(lambda p: p.astype(dtype), _CHUNK_PARAMS)
    x = random_array(13, (28, 5), jnp.float32).astype(dtype)  # 2 microbatches and 4 rows
    y = random_array(14, (28, 2), jnp.float32).astype(dtype)
    if nan_row:
        x = x.at[5, 0].set(jnp.nan)
    weights = jnp.asarray(np.random.default_rng(0).uniform(0, 2, 28)).at[3].set(0.0)
    fn = micro_grad(
        _chunk_loss,
        batch_argnums=(1, 2),
        microbatch_size=12,
        allow_remainder=True,
        has_aux=True,
        keep_batch_dim=False,
        clip_method="materialize",
        **({"metrics_fn": l2_norm} if norms else {}),
        **options,
    )
    call = functools.partial(fn, example_weights=weights) if weighted else fn
    grads, aux = jax.jit(call)(params, x, y)
    jax.tree.map(lambda g, p: assert_equal_dtype(g, p), grads, params)

    per_example = _chunk_per_example(params, x, y)
    scale = np.asarray(weights if weighted else np.ones(28))
    keep = scale != 0
    if nan_row:
        keep[5] = False
    want = _clipped_sum(per_example, options.get("l2_clip_norm"), scale, keep)
    if options.get("accumulator") is MEAN:
        want = jax.tree.map(lambda g: g / 28, want)
    assert_close(
        jax.tree.map(lambda g: np.asarray(g, np.float64), grads), want, dtype=dtype, terms=28
    )
    values = np.asarray(aux.values, np.float64)
    assert values.shape == (28,) and np.all(np.isfinite(values[keep]))
    assert aux.aux["first"].shape == (28,)
    if norms:
        assert_close(np.asarray(aux.metrics, np.float64), _norms(per_example), dtype=dtype)


@settings(max_examples=24, deadline=None)
@given(
    rows=st.integers(1, 13),
    size=st.integers(1, 8),
    at_once=st.integers(1, 5),
    bound=st.sampled_from([None, 0.05, 1.0, 1e3]),
    weighted=st.booleans(),
    method=st.sampled_from(["materialize", "ghost"]),
)
def test_chunks_match_the_reference_for_any_sizes(rows, size, at_once, bound, weighted, method):
    """Any batch, microbatch and chunk bound (a remainder, chunks that do not divide the
    microbatch, a chunk of the whole microbatch), clipped or not, weighted or not, for the
    per-example gradients' chunks (``materialize``) and the ghost norms' (a bound of 1e9
    stands for none: ``ghost`` needs one): the sum is ``vmap(grad)``'s, clipped and
    weighted in float64."""
    size = min(size, rows)
    with pytest.MonkeyPatch.context() as patch:
        clip = bound
        if method == "ghost":
            _tune(patch, ghost_chunk_bytes=1, ghost_chunk_rows=at_once)
            clip = 1e9 if bound is None else bound
        else:
            _tune(patch, explicit_chunk_bytes=at_once * _CHUNK_GRADIENT_BYTES)
        fn = micro_grad(
            lambda p, x, y: _chunk_loss(p, x, y)[0],
            batch_argnums=(1, 2),
            microbatch_size=size,
            allow_remainder=True,
            keep_batch_dim=False,
            clip_method=method,
            l2_clip_norm=clip,
        )
        x = random_array(20 + rows, (rows, 5), jnp.float32)
        y = random_array(40 + rows, (rows, 2), jnp.float32)
        weights = jnp.asarray(np.random.default_rng(rows).uniform(0, 2, rows), jnp.float32)
        call = functools.partial(fn, example_weights=weights) if weighted else fn
        grads, aux = call(_CHUNK_PARAMS, x, y)
    scale = np.asarray(weights, np.float64) if weighted else np.ones(rows)
    want = _clipped_sum(_chunk_per_example(_CHUNK_PARAMS, x, y), bound, scale, np.ones(rows, bool))
    got = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
    assert_close(got, want, dtype=jnp.float32, terms=rows)
    assert aux.values.shape == (rows,)


@pytest.mark.parametrize("at_once", [1, 5, 13], ids=["rows-of-1", "5-and-a-tail-of-3", "whole"])
@pytest.mark.parametrize(
    "options",
    [
        {"l2_clip_norm": 0.5},
        {"l2_clip_norm": {"w": 0.3, "b": 0.2, "v": 0.4}, "weighted": True},
        {"l2_clip_norm": 0.5, "nan_safe": True, "weighted": True, "nan_row": True},
        {"metrics_fn": "norms", "accumulator": MEAN},
        {"l2_clip_norm": 0.5, "transform": True, "weighted": True},
    ],
    ids=["clipped", "per-leaf-weighted", "nan-safe", "metrics-mean", "statistics"],
)
def test_ghost_in_chunks_matches_the_per_example_reference(monkeypatch, at_once, options):
    """The ghost norms (and the statistics read off a ``transform_fn``) take a microbatch
    whose record exceeds ``ghost_chunk_bytes`` a chunk of rows at a time: checked against
    ``vmap(grad)``, clipped and summed here, for chunks of one row, chunks that leave a
    shorter last one (13 = 5 + 5 + 3), and the whole microbatch; with weights, per-leaf
    bounds, a NaN row dropped by ``nan_safe``, metrics, aux and a remainder."""
    _tune(monkeypatch, ghost_chunk_bytes=1, ghost_chunk_rows=at_once)
    options = dict(options)
    weighted, nan_row = options.pop("weighted", False), options.pop("nan_row", False)
    norms = options.pop("metrics_fn", None) == "norms"
    transform = options.pop("transform", False)
    x = random_array(13, (28, 5), jnp.float32)  # microbatches of 13, 13 and 2 rows
    y = random_array(14, (28, 2), jnp.float32)
    if nan_row:
        x = x.at[5, 0].set(jnp.nan)
    weights = jnp.asarray(np.random.default_rng(0).uniform(0, 2, 28)).at[3].set(0.0)
    method = {"transform_fn": lambda g: (g, jax.tree.map(jnp.square, g))} if transform else {}
    fn = micro_grad(
        _chunk_loss,
        batch_argnums=(1, 2),
        microbatch_size=13,
        allow_remainder=True,
        has_aux=True,
        keep_batch_dim=False,
        clip_method="auto" if transform else "ghost",
        **({"metrics_fn": l2_norm} if norms else {}),
        **method,
        **options,
    )
    call = functools.partial(fn, example_weights=weights) if weighted else fn
    expected = "statistics" if transform else "ghost"
    given = {"example_weights": weights} if weighted else {}
    assert clipping_report(fn, _CHUNK_PARAMS, x, y, **given).method == expected
    got, aux = jax.jit(call)(_CHUNK_PARAMS, x, y)

    per_example = _chunk_per_example(_CHUNK_PARAMS, x, y)
    scale = np.asarray(weights if weighted else np.ones(28))
    keep = scale != 0
    if nan_row:
        keep[5] = False
    want = _clipped_sum(per_example, options.get("l2_clip_norm"), scale, keep)
    if transform:
        clipped = _clipped_rows(per_example, options["l2_clip_norm"])
        squares = {
            k: np.where(keep.reshape(-1, *[1] * (c.ndim - 1)), c, 0) ** 2
            for k, c in clipped.items()
        }
        want = (want, {k: np.tensordot(np.where(keep, scale, 0), c, 1) for k, c in squares.items()})
    if options.get("accumulator") is MEAN:
        want = jax.tree.map(lambda g: g / 28, want)
    got = jax.tree.map(lambda g: np.asarray(g, np.float64), got)
    assert_close(got, want, dtype=jnp.float32, terms=28)
    values = np.asarray(aux.values, np.float64)
    assert values.shape == (28,) and np.all(np.isfinite(values[keep]))
    assert aux.aux["first"].shape == (28,)
    if norms:
        assert_close(np.asarray(aux.metrics, np.float64), _norms(per_example), dtype=jnp.float32)


def _clipped_rows(per_example, bound):
    """Each example's gradient clipped to global norm ``bound``; NaN rows left as they are."""
    factor = np.minimum(1, bound / _norms(per_example))
    return {k: g * factor.reshape(-1, *[1] * (g.ndim - 1)) for k, g in per_example.items()}


@pytest.mark.parametrize(
    ("rows", "most", "size"),
    [(64, 54, 32), (64, 26, 16), (13, 5, 5), (61, 26, 21), (10, 20, 10), (7, 0, 1), (1, 1, 1)],
)
def test_ghost_chunks_divide_the_microbatch_where_a_divisor_is_near_the_bound(rows, most, size):
    """``_tuning.chunk_rows``: the largest divisor of the rows at most ``most`` where one is at
    least half of it (no shorter last chunk, no copy), else equal chunks and a last one."""
    assert chunk_rows(rows, most) == size


def _chunk_per_example(params, x, y):
    """Each example's gradient of ``_chunk_loss`` by ``vmap(grad)``, in float64."""
    each = jax.vmap(jax.grad(lambda p, x, y: _chunk_loss(p, x, y)[0]), (None, 0, 0))
    return {k: np.asarray(g, np.float64) for k, g in each(params, x, y).items()}


def _norms(per_example):
    """Each example's global L2 norm over the leaves of ``per_example``."""
    rows = next(iter(per_example.values())).shape[0]
    return np.sqrt(sum(np.sum(g.reshape(rows, -1) ** 2, 1) for g in per_example.values()))


def _clipped_sum(per_example, bound, scale, keep):
    """``sum_b keep_b scale_b min(1, C / ||g_b||) g_b`` per leaf: ``bound`` None (no
    clipping), one number (the global norm) or a dict of per-leaf bounds."""
    if isinstance(bound, dict):
        factors = {k: np.minimum(1, bound[k] / _norms({k: g})) for k, g in per_example.items()}
    else:
        rows = len(scale)
        factor = np.ones(rows) if bound is None else np.minimum(1, bound / _norms(per_example))
        factors = dict.fromkeys(per_example, factor)
    return {
        k: np.tensordot(
            np.where(keep, scale * factors[k], 0),
            np.where(keep.reshape(-1, *[1] * (g.ndim - 1)), g, 0),
            1,
        )
        for k, g in per_example.items()
    }


def assert_equal_dtype(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)


@pytest.mark.compiled
def test_materialize_holds_one_chunk_of_per_example_gradients(monkeypatch):
    params = [random_array(0, (64, 256), jnp.float32), random_array(1, (256, 16), jnp.float32)]
    x, y = jnp.ones((1024, 64)), jnp.ones((1024, 16))
    gradient_bytes = 4 * (64 * 256 + 256 * 16)
    common = {"batch_argnums": (1, 2), "microbatch_size": 256, "clip_method": "materialize"}
    temps = []
    for rows in [16, 256]:  # a fresh function each: traces are cached per function
        _tune(monkeypatch, explicit_chunk_bytes=rows * gradient_bytes)
        temps.append(_temp(micro_grad(_mlp_loss, l2_clip_norm=1.0, **common), params, x, y))
    chunked, whole = temps
    assert whole >= 256 * gradient_bytes  # a microbatch of per-example gradients at once
    assert chunked <= 3 * 16 * gradient_bytes  # 16 rows at a time


def _conv_loss(params, x, y):
    """A small CNN: a 3x3 convolution of stride 2 to 32 channels, ReLU, a dense layer."""
    h = jax.lax.conv_general_dilated(
        x, params["k"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jax.nn.relu(h + params["b"][None, None, None])
    return jnp.mean((h.reshape(h.shape[0], -1) @ params["w"] - y) ** 2)


_CONV_PARAMS = {
    "k": random_array(30, (3, 3, 4, 32), jnp.float32),
    "b": random_array(31, (32,), jnp.float32),
    "w": random_array(32, (8 * 8 * 32, 4), jnp.float32),
}


@pytest.mark.compiled
def test_ghost_holds_one_chunk_of_the_microbatch_record():
    """The ghost norms' memory grows with the chunk, not the microbatch: with the CPU's
    knobs (chunks of 32 rows here), a microbatch of 256 costs little more than one of 64
    (its rows' inputs and per-example values), where taking it whole (a backend without
    measurements) costs about seven times as much (measured: 3.1 against 21.3 MiB); and
    the chunked step holds at most twice the plain step's memory at 64 (issue 50's goal,
    on a CNN)."""
    x = random_array(33, (512, 16, 16, 4), jnp.float32)
    y = random_array(34, (512, 4), jnp.float32)
    common = {"batch_argnums": (1, 2), "l2_clip_norm": 1.0, "clip_method": "ghost"}

    def temp(size, **knobs):
        with pytest.MonkeyPatch.context() as patch:
            _tune(patch, **knobs)
            fn = micro_grad(_conv_loss, microbatch_size=size, **common)
            return _temp(fn, _CONV_PARAMS, x, y)

    chunked = {size: temp(size, ghost_chunk_bytes=1, ghost_chunk_rows=32) for size in (64, 256)}
    whole = temp(256, ghost_chunk_bytes=None)
    assert chunked[256] <= 1.5 * chunked[64]
    assert whole >= 4 * chunked[256]
    plain = micro_grad(_conv_loss, batch_argnums=(1, 2), microbatch_size=64)
    assert chunked[64] <= 2 * _temp(plain, _CONV_PARAMS, x, y)


def test_backends_without_measurements_take_the_microbatch_whole(monkeypatch):
    """Chunks of the ghost norms' record are the CPU's tuning: another backend takes
    every microbatch at once, as before (``_tuning.UNMEASURED``), until measured."""
    assert _tuning.CPU.ghost_chunk_bytes is not None
    monkeypatch.setattr(_tuning.jax, "default_backend", lambda: "tpu")
    assert _tuning.knobs() is _tuning.UNMEASURED
    assert _tuning.knobs().ghost_chunk_bytes is None
    x = random_array(33, (128, 16, 16, 4), jnp.float32)
    y = random_array(34, (128, 4), jnp.float32)
    fn = micro_grad(
        _conv_loss, batch_argnums=(1, 2), microbatch_size=128, l2_clip_norm=1.0, clip_method="ghost"
    )
    scans = [e for e, _ in equations(jax.make_jaxpr(fn)(_CONV_PARAMS, x, y).jaxpr)]
    whole = sum(e.primitive.name == "scan" for e in scans)
    monkeypatch.setattr(_tuning.jax, "default_backend", lambda: "cpu")
    _tune(monkeypatch, ghost_chunk_bytes=1, ghost_chunk_rows=32)
    fn = micro_grad(
        _conv_loss, batch_argnums=(1, 2), microbatch_size=128, l2_clip_norm=1.0, clip_method="ghost"
    )
    scans = [e for e, _ in equations(jax.make_jaxpr(fn)(_CONV_PARAMS, x, y).jaxpr)]
    chunks = [e for e in scans if e.primitive.name == "scan" and e.params["length"] == 4]
    assert sum(e.primitive.name == "scan" for e in scans) == whole + 1
    assert len(chunks) == 1


# --- accumulation precision ------------------------------------------------------------


@pytest.mark.x64
def test_bf16_mean_accumulates_in_float32_and_keeps_its_dtype():
    values = jnp.asarray(1.5 + np.random.default_rng(0).uniform(-0.01, 0.01, 4096), jnp.bfloat16)
    truth = float(np.mean(np.asarray(values, np.float64)))
    mean = microbatch(jnp.mean, 0, 1, MEAN)(values)
    assert mean.dtype == jnp.bfloat16
    assert abs(float(mean) - truth) <= 1e-2 * truth
    narrow = microbatch(jnp.mean, 0, 1, MEAN, accumulation_dtype=jnp.bfloat16)(values)
    assert abs(float(narrow) - truth) > 0.5  # the bf16 carry stops growing at 256


def _summing(which, dtype):
    """A transform summing 512 bf16 ones with ``accumulation_dtype=dtype``."""
    if which == "microbatch":
        return microbatch(lambda v: jnp.sum(v, 0), 0, 1, SUM, accumulation_dtype=dtype)
    if which == "micro_vmap":
        return micro_vmap(lambda v: v, microbatch_size=1, accumulator=SUM, accumulation_dtype=dtype)
    grad = micro_grad(
        lambda w, r: jnp.sum(w * r),
        microbatch_size=1,
        keep_batch_dim=False,
        accumulation_dtype=dtype,
    )
    return lambda v: grad(jnp.ones(2, jnp.bfloat16), v)[0]


@pytest.mark.x64
@pytest.mark.parametrize("which", ["microbatch", "micro_vmap", "micro_grad"])
def test_accumulation_dtype_sets_the_carry_and_not_the_result(which):
    x = jnp.full((512, 2), 1.0, jnp.bfloat16)
    wide, narrow = _summing(which, None)(x), _summing(which, jnp.bfloat16)(x)
    assert wide.dtype == narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(wide, np.float32), 512.0)
    np.testing.assert_array_equal(np.asarray(narrow, np.float32), 256.0)


@pytest.mark.x64
def test_grad_through_microbatch_sums_low_precision_parameters_in_float32():
    w = jnp.ones((), jnp.bfloat16)
    xs = jnp.ones((1024,), jnp.bfloat16)
    fun = lambda w, x: jnp.sum(w * x)  # noqa: E731
    assert float(jax.grad(microbatch(fun, 1, 1))(w, xs)) == 1024.0
    assert float(jax.grad(microbatch(fun, 1, 1, accumulation_dtype=jnp.bfloat16))(w, xs)) == 256.0


@pytest.mark.x64
def test_custom_accumulators_keep_full_control_of_the_dtype():
    summed = Accumulator(
        init=lambda s: jnp.zeros(s.shape, s.dtype),
        update=lambda c, x, i: c + x,
        finalize=lambda c: c,
        aggregate=lambda x: jnp.sum(x, 0),
    )
    x = jnp.ones((512,), jnp.bfloat16)
    got = microbatch(jnp.sum, 0, 1, summed)(x)
    assert got.dtype == jnp.bfloat16 and float(got) == 256.0


# --- one all-reduce per step on Auto meshes ---------------------------------------------


def _mesh(axis_type):
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def _grad_variants(mesh_axes):
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
    common = {"microbatch_size": 16, "batch_mesh_axes": mesh_axes}
    return {
        "fast": micro_grad(loss, **common),
        "clipped": micro_grad(loss, l2_clip_norm=0.1, **common),
        "transform": micro_grad(loss, transform_fn=clipper(0.1), **common),
        "mean": micro_grad(loss, accumulator=MEAN, **common),
    }


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("variant", list(_grad_variants(None)))
def test_batch_mesh_axes_keeps_partial_sums_per_shard(axis_type, variant):
    fun = _grad_variants(("data",))[variant]
    w = random_array(0, (16, 16), jnp.float32) / 4
    x = random_array(1, (256, 16), jnp.float32)
    want = jax.jit(_grad_variants(None)[variant])(w, x)
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        got = jax.jit(fun)(w, xs)
        counts = collectives(fun, w, xs)
        in_loops = all_reduces_in_loops(fun, w, xs)
    assert_close(got, want, terms=16)
    assert in_loops == 0
    assert counts == {
        "all-gather": 0,
        "all-to-all": 0,
        "collective-permute": 0,
        "reduce-scatter": 0,
        "all-reduce": 1,
    }


@pytest.mark.parametrize("kind", REDUCING)
def test_micro_vmap_batch_mesh_axes_on_an_auto_mesh(kind):
    fun = micro_vmap(
        lambda r: jnp.tanh(r * 2.0), microbatch_size=16, accumulator=kind, batch_mesh_axes="data"
    )
    x = random_array(1, (256, 16), jnp.float32)
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        got = jax.jit(fun)(xs)
        in_loops = all_reduces_in_loops(fun, xs)
    assert_close(got, (jnp.sum if kind is SUM else jnp.mean)(jnp.tanh(x * 2.0), 0), terms=16)
    assert in_loops == 0


def test_batch_mesh_axes_errors():
    fun = micro_vmap(jnp.sin, microbatch_size=16, accumulator=SUM, batch_mesh_axes="data")
    with pytest.raises(
        ValueError, match=r"batch_mesh_axes=\('data',\) names mesh axes, but no mesh is set"
    ):
        fun(jnp.ones((32, 2)))
    with (
        jax.set_mesh(_mesh(AxisType.Auto)),
        pytest.raises(
            ValueError,
            match=r"names \['model'\], which the mesh \(axes \('data',\)\) does not have",
        ),
    ):
        micro_vmap(jnp.sin, microbatch_size=16, accumulator=SUM, batch_mesh_axes="model")(
            jnp.ones((32, 2))
        )
    with (
        jax.set_mesh(_mesh(AxisType.Auto)),
        pytest.raises(
            ValueError,
            match="The microbatch has 4 rows, which the 8 shards of mesh axis 'data' do not divide",
        ),
    ):
        micro_vmap(jnp.sin, microbatch_size=4, accumulator=SUM, batch_mesh_axes="data")(
            jnp.ones((32, 2))
        )


# --- found by review: each test is the repro of a bug that was fixed --------------------


@pytest.mark.x64
def test_differentiating_a_batch_argument_gives_the_per_example_sum():
    loss = lambda p, x: jnp.sum(jnp.sin(x @ p))  # noqa: E731
    p, x = jnp.ones(3), random_array(0, (8, 3), jnp.float32)
    want = jnp.sum(jax.vmap(jax.grad(loss, (0, 1)), (None, 0))(p, x[:, None])[1], 0)
    for size in [2, 4, 8]:
        grads, _ = micro_grad(loss, argnums=(0, 1), microbatch_size=size)(p, x)
        assert grads[1].shape == (1, 3)
        assert_close(grads[1], want, terms=8)


@pytest.mark.compiled
def test_grad_with_a_traced_count_keeps_one_microbatch_of_memory():
    w = jnp.ones((256, 256)) / 256

    def loss(w, x, k):
        return microbatch(lambda w, x: jnp.sum(jnp.tanh(x @ w)), 1, 128, num_real_microbatches=k)(
            w, x
        )

    temps = [_temp(jax.grad(loss), w, jnp.ones((rows, 256)), jnp.int32(3)) for rows in (1024, 4096)]
    assert temps[1] <= 1.2 * temps[0]


@pytest.mark.x64
def test_derivatives_of_clipped_gradients_match_clipping_in_transform_fn():
    loss = lambda p, x: jnp.sum(jnp.sin(x @ p))  # noqa: E731
    p, x = jnp.ones(3), random_array(0, (8, 3), jnp.float32)
    fast = lambda p: micro_grad(loss, microbatch_size=2, l2_clip_norm=0.5)(p, x)[0]  # noqa: E731
    slow = lambda p: micro_grad(loss, microbatch_size=2, transform_fn=clipper(0.5))(p, x)[0]  # noqa: E731
    tangent = jnp.ones(3)

    @jax.jit  # one program for both, rather than one for each primitive of the derivatives
    def derivatives(p):
        return [(jax.jvp(f, (p,), (tangent,)), jax.jacrev(f)(p)) for f in (fast, slow)]

    (fast_jvp, fast_jac), (slow_jvp, slow_jac) = derivatives(p)
    assert_close(fast_jvp, slow_jvp, terms=8)
    assert_close(fast_jac, slow_jac, terms=8)


def test_a_per_example_loss_that_is_not_a_scalar_is_an_error():
    with pytest.raises(
        TypeError,
        match=r"micro_grad needs fun to return a scalar loss per example, but it returned shape \(1,\)",
    ):
        micro_grad(lambda p, x: p * x[0], microbatch_size=2)(jnp.ones(1), jnp.ones((4, 1)))


@pytest.mark.x64
def test_clipping_complex_parameters_uses_their_modulus():
    loss = lambda p, x: jnp.real(jnp.sum(p * x)) + jnp.imag(jnp.sum(p * x)) ** 2  # noqa: E731
    p = jnp.asarray([1 + 1j, 2 - 1j], jnp.complex64)
    real, imag = random_array(0, (6, 2), jnp.float32), random_array(1, (6, 2), jnp.float32)
    x = jnp.asarray(real + 1j * imag)
    common = {"microbatch_size": 3, "keep_batch_dim": False}
    fast, _ = micro_grad(loss, l2_clip_norm=0.7, **common)(p, x)
    per_example = jax.vmap(jax.grad(loss), (None, 0))(p, x)
    norms = jnp.sqrt(jnp.sum(jnp.abs(per_example) ** 2, axis=1))
    want = jnp.sum(per_example * jnp.minimum(1.0, 0.7 / norms)[:, None], 0)
    assert_close(fast, want, terms=6)


@pytest.mark.x64
def test_clipping_with_a_python_scalar_in_the_parameters():
    loss = lambda p, x: jnp.sum(x * p["w"]) * p["s"]  # noqa: E731
    p, x = {"w": jnp.ones(1), "s": 2.0}, jnp.ones((4, 1))
    common = {"microbatch_size": 2, "keep_batch_dim": False}
    grads, _ = micro_grad(loss, l2_clip_norm=100.0, metrics_fn=lambda g: g["s"], **common)(p, x)
    assert_close(grads["w"], jnp.full(1, 8.0))


@pytest.mark.x64
def test_keep_batch_dim_expands_a_batch_argument_passed_by_keyword():
    shapes = []

    def loss(p, x, rng=None, w=None):
        shapes.append(jnp.shape(jnp.asarray(w)))
        return jnp.sum(p[None] * x * w)

    grad = micro_grad(loss, batch_argnums=(1, 3), microbatch_size=2)
    p, x, w = jnp.ones(2), jnp.ones((4, 2)), jnp.ones((4, 2))
    assert_close(grad(p, x, None, w)[0], grad(p, x, w=w)[0])
    assert set(shapes) == {(1, 2), (PROBE_ROWS, 2)}  # the probe looks for batch statistics
    assert shapes[-1] == (1, 2)


@pytest.mark.x64
@pytest.mark.parametrize("kind", [SUM, MEAN])
def test_empty_batch_without_microbatching(kind):
    loss = lambda p, x: jnp.sum(p * x)  # noqa: E731
    common = {"accumulator": kind, "l2_clip_norm": 1.0, "keep_batch_dim": False}
    grads, aux = micro_grad(loss, microbatch_size=None, **common)(jnp.ones(2), jnp.ones((0, 2)))
    assert aux.values.shape == (0,)
    assert bool(jnp.all(grads == 0)) if kind is SUM else bool(jnp.all(jnp.isnan(grads)))


@pytest.mark.parametrize("allow_remainder", [False, True])
def test_gradients_reach_a_bfloat16_batch_read_as_bits(allow_remainder):
    """A bfloat16 batch is gathered as uint16 on the CPU (``_layout.reads_bits``); the
    bitcasts have no derivative, so the gather's own rule carries the gradient to it."""
    rows = 9 if allow_remainder else 8
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 5, size=rows), jnp.int32)

    def loss(w, x):
        return jnp.sum(jnp.tanh(x.astype(jnp.float32) @ w))

    looped = microbatch(loss, 1, 2, allow_remainder=allow_remainder)
    x = table[ids].astype(jnp.bfloat16)
    assert_close(jax.grad(looped, argnums=1)(w, x), jax.grad(loss, argnums=1)(w, x))
    tangents = (jnp.ones_like(w), jnp.ones_like(x))
    assert_close(jax.jvp(looped, (w, x), tangents), jax.jvp(loss, (w, x), tangents), terms=5)

    def upstream(fn):  # embeddings looked up and cast to bfloat16 outside the loop
        return jax.grad(lambda t: fn(w, t[ids].astype(jnp.bfloat16)))(table)

    assert_close(jax.jit(lambda t: upstream(looped))(table), upstream(loss), dtype=jnp.bfloat16)
