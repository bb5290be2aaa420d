"""``micro_grad`` against per-example ``jax.grad``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatching import AccumulationType, Aux, micro_grad, micro_vmap

from .strategies import assert_close, clipper, microbatch_sizes, random_array


def _loss(params, x, y):
    """Softmax cross-entropy of a one-layer model on a batch (of one, when per example)."""
    logits = jnp.tanh(x @ params["w"] + params["b"][None]) @ params["v"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def _problem(seed, rows):
    params = {
        "w": random_array(seed, (4, 5), jnp.float32),
        "b": random_array(seed + 1, (5,), jnp.float32),
        "v": random_array(seed + 2, (5, 3), jnp.float32),
    }
    x = random_array(seed + 3, (rows, 4), jnp.float32)
    y = jax.nn.one_hot(jnp.arange(rows) % 3, 3, dtype=jnp.float32)
    return params, x, y


_clip = clipper(0.5)


@jax.jit
def _reference(params, x, y):
    """Per-example values and gradients with jax.vmap(jax.value_and_grad)."""
    return jax.vmap(jax.value_and_grad(lambda p, x, y: _loss(p, x[None], y[None])), (None, 0, 0))(
        params, x, y
    )


_clipped = jax.jit(jax.vmap(_clip))
_norms = jax.jit(jax.vmap(jnp.linalg.norm))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 999), rows=st.sampled_from([1, 4, 6, 8]), data=st.data())
def test_clipped_sum_matches_per_example_grad(seed, rows, data):
    params, x, y = _problem(seed, rows)
    size = data.draw(microbatch_sizes(rows))
    kind = data.draw(st.sampled_from(list(AccumulationType)))
    grad_fn = micro_grad(
        _loss,
        batch_argnums=(1, 2),
        microbatch_size=size,
        accumulator=kind,
        transform_fn=_clip,
        metrics_fn=lambda g: jnp.linalg.norm(g["v"]),
    )
    grads, aux = jax.jit(grad_fn)(params, x, y)
    values, per_example = _reference(params, x, y)
    clipped = _clipped(per_example)
    reduce = {
        AccumulationType.SUM: lambda g: jnp.sum(g, 0),
        AccumulationType.CONCAT: lambda g: g,
        AccumulationType.MAX: lambda g: jnp.max(g, 0),
        AccumulationType.MIN: lambda g: jnp.min(g, 0),
    }.get(kind, lambda g: jnp.mean(g, 0))
    assert_close(grads, jax.tree.map(reduce, clipped), terms=rows)
    assert_close(aux.values, values)
    assert_close(aux.metrics, _norms(per_example["v"]))
    assert aux.aux is None


@pytest.mark.x64
def test_has_aux_and_several_argnums():
    def loss(w, b, x):
        pred = x @ w + b[None]
        return jnp.sum(pred**2), {"pred": pred}

    w, b, x = jnp.ones((3, 2)), jnp.zeros(2), jnp.arange(12.0).reshape(4, 3)
    (gw, gb), aux = micro_grad(
        loss, has_aux=True, argnums=(0, 1), batch_argnums=2, microbatch_size=2
    )(w, b, x)
    want_w, want_b = jax.grad(lambda w, b: loss(w, b, x)[0], (0, 1))(w, b)
    assert_close((gw, gb), (want_w, want_b), terms=2)
    assert isinstance(aux, Aux)
    assert aux.aux["pred"].shape == (4, 1, 2)  # per example, each a batch of one


@pytest.mark.x64
def test_keep_batch_dim_false_passes_single_examples():
    shapes = []

    def loss(w, x):
        shapes.append(x.shape)
        return jnp.sum(w * x)

    grads, _ = micro_grad(loss, keep_batch_dim=False, microbatch_size=2)(
        jnp.ones(3), jnp.ones((4, 3))
    )
    assert_close(grads, [4.0, 4.0, 4.0])
    assert set(shapes) == {(3,)}


def test_microbatch_size_none_is_the_whole_batch():
    params, x, y = _problem(0, 6)
    whole, _ = micro_grad(_loss, batch_argnums=(1, 2))(params, x, y)
    looped, _ = micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=2)(params, x, y)
    assert_close(looped, whole, terms=3)


@pytest.mark.parametrize("count", [0, 2])
def test_num_real_microbatches_skips_the_rest(count):
    params, x, y = _problem(1, 8)
    grads, aux = micro_grad(
        _loss, batch_argnums=(1, 2), microbatch_size=2, num_real_microbatches=count
    )(params, x, y)
    values, per_example = _reference(params, x, y)
    ran = np.arange(8) % 4 < count  # microbatch i holds rows i and i + 4
    want = jax.tree.map(lambda g: jnp.sum(g[ran], 0), per_example)
    assert_close(grads, want, terms=count)
    assert_close(aux.values, jnp.where(ran, values, 0.0))


def test_negative_batch_argnums_count_from_the_end():
    params, x, y = _problem(2, 4)
    grads, aux = micro_grad(_loss, batch_argnums=(1, -1), microbatch_size=2)(params, x, y)
    values, per_example = _reference(params, x, y)
    assert_close(aux.values, values)
    assert_close(grads, jax.tree.map(lambda w: jnp.sum(w, 0), per_example), terms=2)


def test_summed_per_example_dense_gradients_are_exact_at_small_microbatches():
    """XLA:CPU (jax 0.10.2) sums the rows of a batched outer product wrongly below 256
    rows (``benchmarks/xla_per_example_sum_repro.py``): ``transform_fn`` and ``micro_vmap``
    sums of per-example dense-layer gradients came out off by their own size. The rows
    are now reduced behind a barrier. The reference sums NumPy copies of the gradients."""
    keys = jax.random.split(jax.random.key(3), 4)
    params = {
        "w1": jax.random.normal(keys[0], (256, 512)) / 16,
        "w2": jax.random.normal(keys[1], (512, 16)) / 22,
    }
    x, y = jax.random.normal(keys[2], (64, 256)), jax.random.normal(keys[3], (64, 16))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    per_example = jax.vmap(jax.grad(lambda p, a, b: loss(p, a[None], b[None])), (None, 0, 0))
    want = {k: np.sum(np.asarray(g, np.float64), 0) for k, g in per_example(params, x, y).items()}
    grad_fn = micro_grad(loss, batch_argnums=(1, 2), microbatch_size=16, transform_fn=lambda g: g)
    mapped = micro_vmap(
        lambda a, b: jax.grad(loss)(params, a[None], b[None]),
        microbatch_size=16,
        accumulator=AccumulationType.SUM,
    )
    for got in (jax.jit(grad_fn)(params, x, y)[0], jax.jit(mapped)(x, y)):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


_PLANNED_ONCE = {
    "plain": {},
    "plain, weighted": {"weighted": True},
    "plain, remainder": {"allow_remainder": True},
    "clipped (ghost)": {"l2_clip_norm": 0.5},
    "clipped, weighted": {"l2_clip_norm": 0.5, "weighted": True},
    "clipped, remainder": {"l2_clip_norm": 0.5, "allow_remainder": True},
    "statistics": {"transform_fn": lambda g: (g, jax.tree.map(jnp.square, g))},
}


@pytest.mark.parametrize("name", _PLANNED_ONCE)
@pytest.mark.parametrize("keep_batch_dim", [False, True])
def test_the_loss_is_traced_once_to_plan_and_once_in_the_loop(name, keep_batch_dim):
    """The plain, clipped and statistics steps trace the loss twice a call: once to plan
    (what the engine reads, carried in the plan) and once in the loop; with
    ``keep_batch_dim=True`` once more, on a probe batch, for the batch-statistics
    warning. Each result is ``vmap(grad)``'s, so a plan that skipped a trace it needs
    would show."""
    options = dict(_PLANNED_ONCE[name])
    weighted = options.pop("weighted", False)
    traces = []

    def loss(params, x, y):
        traces.append(None)
        return _loss(params, x if keep_batch_dim else x[None], y if keep_batch_dim else y[None])

    rows = 13 if options.get("allow_remainder") else 12
    params, x, y = _problem(0, rows)
    weights = jnp.linspace(0.5, 1.5, rows) if weighted else jnp.ones(rows)
    fn = micro_grad(loss, batch_argnums=(1, 2), keep_batch_dim=keep_batch_dim,
                    microbatch_size=4, **options)  # fmt: skip
    call = {"example_weights": weights} if weighted else {}
    got = jax.jit(fn)(params, x, y, **call)[0]
    assert len(traces) <= (3 if keep_batch_dim else 2), len(traces)
    _, grads = _reference(params, x, y)
    if "l2_clip_norm" in options:
        grads = jax.vmap(_clip)(grads)
    transform = options.get("transform_fn", lambda g: g)
    want = jax.tree.map(lambda g: jnp.einsum("b,b...->...", weights, g), jax.vmap(transform)(grads))
    assert_close(got, want, terms=rows)
