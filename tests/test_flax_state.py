"""Flax models with state: batch statistics and per-example dropout keys.

What docs/how-to/stateful-models.md and the Flax sections of docs/how-to/randomness.md
say, each against a reference without the library: the model run microbatch by
microbatch in a Python loop (microbatch ``k`` of ``n`` is rows ``k::n``), a batch of one
per example, or clipped ``jax.vmap(jax.grad)`` gradients.
"""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbatching import (
    AccumulationType,
    BatchStatisticsWarning,
    clipping_report,
    micro_grad,
    microbatch,
)

from .strategies import assert_close

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

MEAN = AccumulationType.MEAN
MOMENTUM = 0.9
ROWS = 16


class Net(nn.Module):
    """Dense, BatchNorm, ReLU, Dense: a scalar output per row."""

    @nn.compact
    def __call__(self, x, train):
        h = nn.Dense(8)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(h)
        return nn.Dense(1)(nn.relu(h))[:, 0]


def data(rows: int = ROWS) -> tuple[jax.Array, jax.Array]:
    """Features away from zero mean and unit variance, and a target of two of them."""
    x = jnp.asarray(1.0 + 2.0 * np.random.default_rng(0).normal(size=(rows, 4)), jnp.float32)
    return x, x[:, 0] * x[:, 1]


MODEL = Net()
X, Y = data()
VARIABLES = MODEL.init(jax.random.key(1), X, train=False)
PARAMS, STATS = VARIABLES["params"], VARIABLES["batch_stats"]


def loss(params: Any, stats: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Any]:
    """The mean squared error in training mode, and the updated batch statistics."""
    pred, updated = MODEL.apply(
        {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
    )
    return jnp.mean((pred - y) ** 2), updated["batch_stats"]


# The references run one jitted program per shape: op by op, Flax's layers compile every
# primitive and run slowly in Python.
value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))


def by_hand(parts: list[tuple[jax.Array, jax.Array]]) -> Any:
    """``((loss, stats), grads)`` of each part, averaged weighted by the part's rows."""
    outs = [value_and_grad(PARAMS, STATS, x, y) for x, y in parts]
    rows = [x.shape[0] for x, _ in parts]
    return jax.tree.map(
        lambda *leaves: sum(r * leaf for r, leaf in zip(rows, leaves, strict=True)) / sum(rows),
        *outs,
    )


def strided(x: jax.Array, y: jax.Array, size: int) -> list[tuple[jax.Array, jax.Array]]:
    """The microbatches of ``size`` rows, as the library groups them: ``k::n``."""
    n = x.shape[0] // size
    return [(x[k::n], y[k::n]) for k in range(n)]


def normalised(x: jax.Array) -> jax.Array:
    """BatchNorm's input."""
    return x @ PARAMS["Dense_0"]["kernel"] + PARAMS["Dense_0"]["bias"][None]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("size", [1, 4, ROWS])
def test_batch_norm_in_microbatch_matches_a_loop_over_its_microbatches(size, jit):
    step = microbatch(
        jax.value_and_grad(loss, has_aux=True),
        argnums=(2, 3),
        microbatch_size=size,
        accumulator=MEAN,
    )
    got = (jax.jit(step) if jit else step)(PARAMS, STATS, X, Y)
    assert_close(got, by_hand(strided(X, Y, size)), terms=ROWS // size)
    # The running mean is the whole batch's update; the running variance is updated by
    # the mean of the microbatch variances.
    (_, new), _ = got
    h, old = normalised(X), STATS["BatchNorm_0"]
    groups = jnp.stack([rows for rows, _ in strided(h, Y, size)])
    expected_mean = MOMENTUM * old["mean"] + (1 - MOMENTUM) * h.mean(0)
    expected_var = MOMENTUM * old["var"] + (1 - MOMENTUM) * groups.var(axis=1).mean(axis=0)
    assert_close(new["BatchNorm_0"], {"mean": expected_mean, "var": expected_var}, terms=ROWS)


@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_in_grad_of_microbatch_matches_the_loop(jit):
    mean_loss = microbatch(loss, argnums=(2, 3), microbatch_size=4, accumulator=(MEAN, MEAN))
    grad_fn = jax.grad(mean_loss, has_aux=True)
    grads, stats = (jax.jit(grad_fn) if jit else grad_fn)(PARAMS, STATS, X, Y)
    (_, expected_stats), expected_grads = by_hand(strided(X, Y, 4))
    assert_close((grads, stats), (expected_grads, expected_stats), terms=4)


def test_batch_norm_with_a_remainder_normalises_the_last_rows_apart():
    x, y = data(18)  # 4 microbatches of 4 rows k::4 of the first 16, then rows 16 and 17
    step = microbatch(
        jax.value_and_grad(loss, has_aux=True),
        argnums=(2, 3),
        microbatch_size=4,
        accumulator=MEAN,
        allow_remainder=True,
    )
    got = jax.jit(step)(PARAMS, STATS, x, y)
    assert_close(got, by_hand([*strided(x[:16], y[:16], 4), (x[16:], y[16:])]), terms=5)
    (_, new), _ = got
    whole_mean = MOMENTUM * STATS["BatchNorm_0"]["mean"] + (1 - MOMENTUM) * normalised(x).mean(0)
    assert_close(new["BatchNorm_0"]["mean"], whole_mean, terms=18)


@pytest.mark.parametrize("l2_clip_norm", [None, 1.0])
def test_micro_grad_normalises_each_example_alone(l2_clip_norm):
    """Each example is a batch of one: BatchNorm's output is its bias, every leaf up to
    it gets a gradient of exactly 0, and each running variance decays by the momentum.
    micro_grad says so at trace time, naming the fix."""
    grad_fn = micro_grad(
        loss, has_aux=True, batch_argnums=(2, 3), microbatch_size=4, l2_clip_norm=l2_clip_norm
    )
    with pytest.warns(BatchStatisticsWarning, match=re.escape(MIXES_ROWS.format("sub"))):
        grads, aux = jax.jit(grad_fn)(PARAMS, STATS, X, Y)
    zero = jax.tree.map(lambda g: bool(jnp.all(g == 0)), grads)
    assert zero == {
        "BatchNorm_0": {"bias": True, "scale": True},
        "Dense_0": {"bias": True, "kernel": True},
        "Dense_1": {"bias": False, "kernel": True},
    }
    old = STATS["BatchNorm_0"]
    assert_close(aux.aux["BatchNorm_0"]["var"], jnp.broadcast_to(MOMENTUM * old["var"], (ROWS, 8)))
    one = jax.jit(loss)
    per_example = [one(PARAMS, STATS, X[b : b + 1], Y[b : b + 1])[0] for b in range(ROWS)]
    assert_close(aux.values, jnp.stack(per_example))


def test_micro_grad_of_an_image_batch_norm_is_the_sum_of_batch_of_one_gradients():
    """On images the statistics are one example's pixels: an instance normalisation,
    with gradients that are not zero."""

    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(x))
            return nn.Dense(1)(nn.relu(h).mean((1, 2)))[:, 0]

    model = ConvNet()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6, 6, 1)), jnp.float32)
    y = jnp.arange(8.0)
    variables = model.init(jax.random.key(2), x, train=False)

    def image_loss(params, stats, x, y):
        pred, updated = model.apply(
            {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
        )
        return jnp.mean((pred - y) ** 2), updated["batch_stats"]

    args = (variables["params"], variables["batch_stats"])
    grad_fn = micro_grad(image_loss, True, batch_argnums=(2, 3), microbatch_size=4)
    with pytest.warns(BatchStatisticsWarning, match="statistic over the batch axis"):
        grads, _ = jax.jit(grad_fn)(*args, x, y)
    one = jax.jit(jax.grad(image_loss, has_aux=True))
    each = [one(*args, x[b : b + 1], y[b : b + 1])[0] for b in range(8)]
    assert_close(grads, jax.tree.map(lambda *g: sum(g), *each), terms=8)
    assert float(jnp.max(jnp.abs(grads["Conv_0"]["kernel"]))) > 1e-3


MIXES_ROWS = (
    "micro_grad gives the loss each example alone, as a batch of one row, and this loss "
    "computes a statistic over the batch axis and applies it back to the rows (first seen "
    "at the primitive `{}`): a BatchNorm layer, a softmax over the examples, a rescaling "
    "of each row by a batch total. The statistic is then each example's own and the result "
    "differs from the whole batch's (a BatchNorm over dense features outputs its bias "
    "whatever the input). For per-example gradients and DP-SGD normalise each example on "
    "its own (GroupNorm, LayerNorm) or compute the statistic outside the loss (for DP, from "
    "public data only); for gradient accumulation with statistics per microbatch, take "
    "jax.grad of microbatch(loss) instead (docs/how-to/stateful-models.md)."
)


def _squares(p, x, y):
    return (jnp.tanh(x @ p) - y) ** 2


ROWS_MIXED = {
    "centred over the batch": lambda p, x, y: jnp.mean(
        _squares(p, x - x.mean(0, keepdims=True), y)
    ),
    "softmax over the examples": lambda p, x, y: -jnp.mean(jax.nn.log_softmax((x @ p)[:, 0])),
    "rows rescaled by a batch total": lambda p, x, y: jnp.sum(_squares(p, x, y) / jnp.sum(y**2)),
    "centred through a jit": lambda p, x, y: jnp.mean(
        _squares(p, jax.jit(lambda v: v - jnp.max(v, 0, keepdims=True))(x), y)
    ),
}
ROWS_APART = {
    "mean of the rows' losses": lambda p, x, y: jnp.mean(_squares(p, x, y)),
    "sum over the batch divided by a batch total": lambda p, x, y: (
        jnp.sum(_squares(p, x, y)) / jnp.sum(jnp.abs(y))
    ),
    "each row normalised over its features": lambda p, x, y: jnp.mean(
        _squares(p, x / jnp.linalg.norm(x, axis=-1, keepdims=True), y)
    ),
    "a matmul over the features": lambda p, x, y: jnp.mean((x @ p @ p.T - x) ** 2),
}
MIX_ARGS = (
    jnp.linspace(-1.0, 1.0, 12).reshape(4, 3),
    jnp.asarray(np.random.default_rng(5).normal(size=(8, 4)), jnp.float32),
    jnp.arange(24.0).reshape(8, 3) / 24,
)


@pytest.mark.parametrize("name", ROWS_MIXED)
def test_a_loss_that_applies_a_batch_statistic_to_its_rows_warns(name):
    """Each of these makes an example's loss depend on the other rows of its batch: with
    keep_batch_dim=True, micro_grad warns at trace time, and still computes each example
    alone, as without the warning: the gradients of a loop over batches of one."""
    fun = ROWS_MIXED[name]
    grad_fn = micro_grad(fun, batch_argnums=(1, 2), microbatch_size=4)
    with pytest.warns(BatchStatisticsWarning, match=r"this loss computes a statistic over"):
        got, _ = grad_fn(*MIX_ARGS)
    p, x, y = MIX_ARGS
    one = jax.jit(jax.grad(fun))
    want = sum(one(p, x[b : b + 1], y[b : b + 1]) for b in range(8))
    assert_close(got, want, terms=8)


@pytest.mark.parametrize("name", ROWS_APART)
def test_a_loss_whose_rows_stay_apart_does_not_warn(name):
    """Reductions over the rows that only make the loss, and reductions over the
    features: no warning (the suite turns warnings into errors)."""
    grad_fn = micro_grad(ROWS_APART[name], batch_argnums=(1, 2), microbatch_size=4)
    got, _ = grad_fn(*MIX_ARGS)
    assert jnp.all(jnp.isfinite(got))


def test_a_mean_over_a_named_vmap_axis_warns():
    """Found by a breaker: Equinox's BatchNorm takes its mean with a collective over the
    axis that ``jax.vmap(..., axis_name=...)`` maps (a ``psum``), which the walk did not
    count; here the same pattern in plain JAX."""

    def loss(p, x, y):
        def one(row):
            return row - jax.lax.pmean(row, "batch")

        return jnp.mean(_squares(p, jax.vmap(one, axis_name="batch")(x), y))

    grad_fn = micro_grad(loss, batch_argnums=(1, 2), microbatch_size=4)
    with pytest.warns(BatchStatisticsWarning, match="statistic over the batch axis") as record:
        got, _ = jax.jit(grad_fn)(*MIX_ARGS)
    assert [w.filename for w in record] == [__file__]  # the caller's line, not the library's
    p, x, y = MIX_ARGS
    one = jax.jit(jax.grad(loss))
    assert_close(got, sum(one(p, x[b : b + 1], y[b : b + 1]) for b in range(8)), terms=8)


def test_batch_statistics_that_reach_only_aux_do_not_warn():
    """Found by a breaker: the spread of the rows' losses in aux, and a centred batch that
    nothing reads, warned. The gradient sees neither: only what the loss reads counts."""

    def logged(p, x, y):
        losses = jnp.sum(_squares(p, x, y), -1)
        unused = x - x.mean(0, keepdims=True)
        return jnp.mean(losses), {"std": jnp.std(losses), "unused": unused.shape}

    got, aux = micro_grad(logged, has_aux=True, batch_argnums=(1, 2), microbatch_size=4)(*MIX_ARGS)
    p, x, y = MIX_ARGS
    one = jax.jit(jax.grad(lambda *a: logged(*a)[0]))
    want = sum(one(p, x[b : b + 1], y[b : b + 1]) for b in range(8))
    assert_close(got, want, terms=8)
    assert_close(aux.aux["std"], jnp.zeros(8))  # the spread of one row's loss


def test_without_keep_batch_dim_the_loss_is_not_probed():
    """With keep_batch_dim=False the loss sees one example without a batch axis: there
    are no rows to mix, and a reduction over axis 0 is one over the features."""
    fun = lambda p, x, y: jnp.mean(_squares(p, x - x.mean(0), y))  # noqa: E731
    grad_fn = micro_grad(fun, batch_argnums=(1, 2), microbatch_size=4, keep_batch_dim=False)
    got, _ = grad_fn(*MIX_ARGS)
    p, x, y = MIX_ARGS
    one = jax.jit(jax.grad(fun))
    assert_close(got, sum(one(p, x[b], y[b]) for b in range(8)), terms=8)


@pytest.mark.parametrize("clip_method", ["auto", "materialize"])
@pytest.mark.parametrize("norm", ["GroupNorm", "LayerNorm"])
def test_per_example_norms_clip_like_clipped_vmap_grad(norm, clip_method):
    layer = {"GroupNorm": lambda: nn.GroupNorm(num_groups=2), "LayerNorm": nn.LayerNorm}[norm]

    class NormNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(layer()(nn.Dense(8)(x))))[:, 0]

    model = NormNet()
    params = model.init(jax.random.key(1), X)["params"]

    def norm_loss(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    grad_fn = micro_grad(
        norm_loss,
        batch_argnums=(1, 2),
        microbatch_size=4,
        l2_clip_norm=1.0,
        clip_method=clip_method,
    )
    summed, _ = jax.jit(grad_fn)(params, X, Y)
    each = jax.jit(jax.vmap(jax.grad(norm_loss), (None, 0, 0)))(params, X[:, None], Y[:, None])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(ROWS, -1) ** 2, 1) for g in jax.tree.leaves(each)))
    assert float(jnp.min(norms)) < 1.0 < float(jnp.max(norms))  # some are clipped, some not
    scale = jnp.minimum(1.0, 1.0 / norms)
    assert_close(summed, jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), each), terms=ROWS)
    expected = "ghost" if clip_method == "auto" else "materialize"
    assert clipping_report(grad_fn, params, X, Y).method == expected


class NnxNet(nnx.Module):
    """``Net`` in Flax NNX."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=MOMENTUM, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))[:, 0]


@pytest.mark.parametrize("jit", [False, True])
def test_nnx_batch_norm_merged_with_a_copy_matches_the_loop(jit):
    graphdef, params, stats = nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    def nnx_loss(params, stats, x, y):
        model = nnx.merge(graphdef, params, stats, copy=True)
        return jnp.mean((model(x) - y) ** 2), nnx.state(model, nnx.BatchStat)

    step = microbatch(
        jax.value_and_grad(nnx_loss, has_aux=True),
        argnums=(2, 3),
        microbatch_size=4,
        accumulator=MEAN,
    )
    got = (jax.jit(step) if jit else step)(params, stats, X, Y)
    one = jax.jit(jax.value_and_grad(nnx_loss, has_aux=True))
    outs = [one(params, stats, x, y) for x, y in strided(X, Y, 4)]
    assert_close(got, jax.tree.map(lambda *leaves: sum(leaves) / 4, *outs), terms=4)


class Dropout(nn.Module):
    """Dense, ReLU, dropout at rate 0.5, Dense."""

    @nn.compact
    def __call__(self, x, train):
        h = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(1)(h)[:, 0]


class NnxDropout(nnx.Module):
    """``Dropout`` in Flax NNX, drawing from the key it is called with."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x, key):
        return self.out(self.dropout(nnx.relu(self.hidden(x)), rngs=key))[:, 0]


def dropout_loss(api: str) -> tuple[Any, Any]:
    """``(loss(params, x, y, keys), params)``: each row dropped out with its own key."""
    if api == "linen":
        model = Dropout()
        params = model.init(jax.random.key(1), X, train=False)["params"]

        def row(params, x, key):
            return model.apply({"params": params}, x[None], train=True, rngs={"dropout": key})

    else:
        graphdef, params, rest = nnx.split(NnxDropout(nnx.Rngs(1)), nnx.Param, ...)

        def row(params, x, key):
            return nnx.merge(graphdef, params, rest)(x[None], key)

    def loss(params, x, y, keys):
        pred = jax.vmap(lambda x, key: row(params, x, key)[0])(x, keys)
        return jnp.mean((pred - y) ** 2)

    return loss, params


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_dropout_with_per_example_keys_is_the_same_for_every_microbatch_size(api):
    loss, params = dropout_loss(api)
    keys = jax.random.split(jax.random.key(2), ROWS)
    whole = jax.jit(jax.value_and_grad(loss))(params, X, Y, keys)
    for size in (1, 4):
        mean_loss = microbatch(loss, argnums=(1, 2, 3), microbatch_size=size, accumulator=MEAN)
        assert_close(jax.jit(jax.value_and_grad(mean_loss))(params, X, Y, keys), whole, terms=ROWS)
        grads, _ = jax.jit(
            micro_grad(loss, batch_argnums=(1, 2, 3), microbatch_size=size, accumulator=MEAN)
        )(params, X, Y, keys)
        assert_close(grads, whole[1], terms=ROWS)
