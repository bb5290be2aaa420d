"""Exact results on a 4-device mesh: a batch split over 4 of the 8 fake CPU devices.

Each test compares the transform on the mesh with an independent reference computed on
one device or in NumPy: the whole batch's gradient through an embedding lookup (whose
backward is a scatter-add), weighted means, a remainder with FSDP parameters, and
integer maxima and minima. The data of the embedding model are small integers, so its
unclipped gradients are exact whatever the order of the sums.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import microbatching
from microbatching import AccumulationType, micro_grad, micro_vmap, microbatch

from .strategies import assert_close, clipped_grad_sum

SHARDS = 4
AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]
BATCH = 32
VOCAB, DIM, TOKENS = 16, 4, 3
FSDP = P("data", None)
LAYOUTS = {"replicated": P(), "fsdp": FSDP}


def _mesh(axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (SHARDS,), ("data",), devices=jax.devices()[:SHARDS], axis_types=(axis_type,)
    )


def _put(mesh: jax.sharding.Mesh, tree: Any, spec: P) -> Any:
    return jax.device_put(tree, NamedSharding(mesh, spec))


def _mesh_options(axis_type: AxisType) -> dict[str, Any]:
    """Inside ``jit`` on an Auto mesh the batch's sharding must be named."""
    return {"batch_mesh_axes": "data"} if axis_type is AxisType.Auto else {}


def _embedding_problem(batch: int = BATCH) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Small-integer parameters, tokens (with repeats across and within examples) and
    targets of ``_embedding_loss``."""
    rng = np.random.default_rng(0)
    params = {
        "emb": rng.integers(-2, 3, size=(VOCAB, DIM)).astype(np.float32),
        "w": rng.integers(-2, 3, size=(DIM, 1)).astype(np.float32),
    }
    tokens = rng.integers(0, VOCAB, size=(batch, TOKENS)).astype(np.int32)
    tokens[:, 1] = tokens[:, 0]  # the same row twice in one example
    targets = rng.integers(-4, 5, size=(batch,)).astype(np.float32)
    return params, tokens, targets


def _lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``; on an Explicit mesh, from a whole table and split like
    ``tokens`` (JAX asks for the gather's output sharding there)."""
    if AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types:
        return table[tokens]
    spec = jax.typeof(tokens).sharding.spec
    return jax.sharding.reshard(table, P()).at[tokens].get(out_sharding=P(*spec, None))


def _embedding_loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Half the mean squared error of a linear read-out of summed token embeddings."""
    pooled = jnp.sum(_lookup(params["emb"], tokens), axis=1)
    return 0.5 * jnp.mean(((pooled @ params["w"])[:, 0] - targets) ** 2)


def _per_example_grads(params: Any, tokens: Any, targets: Any) -> dict[str, np.ndarray]:
    """Per-example gradients of ``_embedding_loss`` on one device, as float64 NumPy."""
    grads = jax.vmap(
        jax.grad(lambda p, t, y: _embedding_loss(p, t[None], y[None])), in_axes=(None, 0, 0)
    )(params, tokens, targets)
    return {k: np.asarray(g, np.float64) for k, g in grads.items()}


def _clipped_sum(grads: dict[str, np.ndarray], bound: float, weights: Any = None) -> Any:
    n = len(next(iter(grads.values())))
    norms = np.sqrt(sum(np.sum(g.reshape(n, -1) ** 2, 1) for g in grads.values()))
    scale = np.minimum(1.0, bound / np.maximum(norms, 1e-30)) * (
        1.0 if weights is None else weights
    )
    return {k: np.tensordot(scale, g, 1) for k, g in grads.items()}


GHOST_ON_EXPLICIT = pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="ghost clipping on an Explicit mesh outside the per-shard loop (replicated "
    "parameters, or a remainder) fails on an embedding lookup written with "
    ".at[].get(out_sharding=...), as JAX requires there: _ghost.record raises 'context "
    "mesh ... Explicit should match the aval mesh ... Auto'",
)
EMBEDDING_CASES = [
    pytest.param(
        path,
        layout,
        axis_type,
        marks=[GHOST_ON_EXPLICIT]
        if (path, layout, axis_type) == ("micro_grad_clipped", "replicated", AxisType.Explicit)
        else [],
        id=f"{path}-{layout}-{axis_type}",
    )
    for path in ("grad_of_microbatch", "micro_grad", "micro_grad_clipped")
    for layout in LAYOUTS
    for axis_type in AXIS_TYPES
]


@pytest.mark.parametrize(("path", "layout", "axis_type"), EMBEDDING_CASES)
def test_embedding_gradients_over_microbatches_equal_the_whole_batch(path, layout, axis_type):
    """The scatter-add of an embedding's backward, summed over microbatches and shards,
    gives the whole batch's gradient: through ``jax.grad`` of a MEAN ``microbatch``, and
    through ``micro_grad``'s MEAN (and its clipped sum)."""
    params, tokens, targets = _embedding_problem()
    if path == "micro_grad_clipped":
        bound = 4.0
        grads = _per_example_grads(params, tokens, targets)
        want = _clipped_sum(grads, bound)
        norms = np.sqrt(sum(np.sum(g.reshape(BATCH, -1) ** 2, 1) for g in grads.values()))
        assert 0 < np.sum(norms > bound) < BATCH, "clipping should bind for some examples"
        grad_fn = micro_grad(
            _embedding_loss,
            batch_argnums=(1, 2),
            microbatch_size=8,
            l2_clip_norm=bound,
            **_mesh_options(axis_type),
        )
        fun = lambda p, t, y: grad_fn(p, t, y)[0]  # noqa: E731
    else:
        want = jax.grad(_embedding_loss)(params, tokens, targets)  # one device, one batch
        if path == "micro_grad":
            grad_fn = micro_grad(
                _embedding_loss,
                batch_argnums=(1, 2),
                microbatch_size=8,
                accumulator=AccumulationType.MEAN,
                **_mesh_options(axis_type),
            )
            fun = lambda p, t, y: grad_fn(p, t, y)[0]  # noqa: E731
        else:
            mean = microbatch(_embedding_loss, (1, 2), 8, AccumulationType.MEAN)
            fun = jax.grad(mean)
    assert np.any(np.asarray(want["emb"]) != 0) and np.any(np.asarray(want["w"]) != 0)
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        p = _put(mesh, params, LAYOUTS[layout])
        t, y = _put(mesh, (tokens, targets), P("data"))
        got = jax.jit(fun)(p, t, y)
    assert_close(got, want, dtype=np.float32, terms=BATCH)
    if axis_type is AxisType.Explicit:
        for g in got.values():
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, LAYOUTS[layout]), 2)


@pytest.mark.x64
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_weighted_mean_of_micro_vmap_on_a_mesh(axis_type):
    """MEAN with example weights, one shard's rows all weighted 0."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, 3)).astype(np.float32)
    weights = rng.integers(0, 4, size=BATCH).astype(np.float32)
    weights[: BATCH // SHARDS] = 0  # the first shard's rows
    fun = micro_vmap(
        lambda row: jnp.tanh(row) * 2,
        microbatch_size=8,
        accumulator=AccumulationType.MEAN,
        **_mesh_options(axis_type),
    )
    y = np.tanh(x.astype(np.float64)) * 2
    want = np.tensordot(weights, y, 1) / np.sum(weights)
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        xs, ws = _put(mesh, (x, weights), P("data"))
        got = jax.jit(fun)(xs, example_weights=ws)
    assert_close(got, want, dtype=np.float32, terms=BATCH)


@pytest.mark.x64
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
@pytest.mark.parametrize("clipped", [False, True], ids=["mean", "clipped_mean"])
def test_weighted_mean_of_micro_grad_with_fsdp_parameters(axis_type, clipped):
    """MEAN with example weights over FSDP parameters: ``sum(w_b g_b) / sum(w_b)``.
    (Every device's part of every microbatch holds a nonzero weight: see
    ``test_fsdp_gradients_with_a_device_whose_weights_are_all_zero``.)"""
    params, tokens, targets = _embedding_problem()
    weights = (np.arange(BATCH) % 3).astype(np.float32)
    grads = _per_example_grads(params, tokens, targets)
    options: dict[str, Any] = {"l2_clip_norm": 4.0} if clipped else {}
    if clipped:
        want = _clipped_sum(grads, 4.0, weights)
    else:
        want = {k: np.tensordot(weights, g, 1) for k, g in grads.items()}
    want = {k: g / np.sum(weights) for k, g in want.items()}
    grad_fn = micro_grad(
        _embedding_loss,
        batch_argnums=(1, 2),
        microbatch_size=8,
        accumulator=AccumulationType.MEAN,
        **options,
        **_mesh_options(axis_type),
    )
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        p = _put(mesh, params, FSDP)
        t, y, w = _put(mesh, (tokens, targets, weights), P("data"))
        got, _ = jax.jit(grad_fn)(p, t, y, example_weights=w)
    assert_close(got, want, dtype=np.float32, terms=BATCH)


# Runs the weighted MEAN of ``micro_grad`` over FSDP parameters on an Explicit 4-device
# mesh in a child process: a collective that not every device reaches waits forever, and
# XLA then aborts the whole process (here after 3 s instead of 40).
ZERO_WEIGHTS_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from microbatching import AccumulationType, micro_grad

jax.config.update("jax_num_cpu_devices", 4)
with open(sys.argv[1]) as f:
    given = json.load(f)
w, x, weights = (np.asarray(given[k], np.float32) for k in ("w", "x", "weights"))
loss = lambda w, x: 0.5 * jnp.mean(jnp.tanh(x @ w) ** 2)
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
grad_fn = micro_grad(
    loss, batch_argnums=1, microbatch_size=8, accumulator=AccumulationType.MEAN,
    **given["options"],
)
with jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P("data", None)))
    xs, es = jax.device_put((x, weights), NamedSharding(mesh, P("data")))
    grads, _ = jax.jit(grad_fn)(ws, xs, example_weights=es)
    print(json.dumps({"grads": np.asarray(grads).tolist(), "spec": str(tuple(grads.sharding.spec))}))
"""


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="default"),
        pytest.param({"gather_params": "per_microbatch"}, id="gather_per_microbatch"),
        pytest.param({"reduce_gradients": "after_loop"}, id="after_loop"),
    ],
)
def test_fsdp_gradients_with_a_device_whose_weights_are_all_zero(tmp_path: pathlib.Path, options):
    """A padded batch (weights 0 on the padding) whose padding fills one device's rows:
    the weighted mean over the others, sharded like the parameters. (A device that
    skipped the microbatch left the others waiting on its collectives until XLA aborted
    the process: hence the child process, with collective timeouts below its hang guard.)"""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(8, 2)).astype(np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    weights = (np.arange(16) < 12).astype(np.float32)  # the last device's rows: weight 0
    per_example = jax.vmap(
        jax.grad(lambda w, row: 0.5 * jnp.mean(jnp.tanh(row[None] @ w) ** 2)), in_axes=(None, 0)
    )(w, x)
    want = np.tensordot(weights, np.asarray(per_example, np.float64), 1) / np.sum(weights)
    given = tmp_path / "given.json"
    given.write_text(
        json.dumps(
            {"w": w.tolist(), "x": x.tolist(), "weights": weights.tolist(), "options": options}
        )
    )
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # The run's own flags (make test's quicker compilation), and collective timeouts that
    # turn a device left waiting into a failure, long enough for a loaded machine.
    env["XLA_FLAGS"] = " ".join(
        filter(
            None,
            [
                env.get("XLA_FLAGS"),
                "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60",
                "--xla_cpu_collective_call_terminate_timeout_seconds=900",
            ],
        )
    )
    src = str(pathlib.Path(microbatching.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", ZERO_WEIGHTS_SCRIPT, str(given)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,  # a hang guard: killed (by its PID) if it runs longer
        check=False,
    )
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stderr[-3000:]}"
    got = json.loads(done.stdout.splitlines()[-1])
    assert_close(np.asarray(got["grads"]), want, dtype=np.float32, terms=16)
    assert got["spec"] == str(tuple(FSDP))


REMAINDER_OPTIONS = {
    "sum": {},
    "mean": {"accumulator": AccumulationType.MEAN},
    "clipped": {"l2_clip_norm": 4.0},
}


@pytest.mark.x64
@pytest.mark.parametrize(
    ("options", "axis_type"),
    [
        pytest.param(
            options,
            axis_type,
            marks=[GHOST_ON_EXPLICIT]
            if (name, axis_type) == ("clipped", AxisType.Explicit)
            else [],
            id=f"{name}-{axis_type}",
        )
        for name, options in REMAINDER_OPTIONS.items()
        for axis_type in AXIS_TYPES
    ],
)
def test_remainder_with_fsdp_parameters(options, axis_type):
    """36 rows in microbatches of 8 (2 per shard) and a last one of 4 (1 per shard): the
    strided microbatches no longer line up with the shards, which the library says."""
    batch = 36
    params, tokens, targets = _embedding_problem(batch)
    grads = _per_example_grads(params, tokens, targets)
    if "l2_clip_norm" in options:
        want = _clipped_sum(grads, options["l2_clip_norm"])
    else:
        want = {k: np.sum(g, 0) for k, g in grads.items()}
    if options.get("accumulator") is AccumulationType.MEAN:
        want = {k: g / batch for k, g in want.items()}
    grad_fn = micro_grad(
        _embedding_loss,
        batch_argnums=(1, 2),
        microbatch_size=8,
        allow_remainder=True,
        **options,
        **_mesh_options(axis_type),
    )
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        p = _put(mesh, params, FSDP)
        t, y = _put(mesh, (tokens, targets), P("data"))
        with pytest.warns(UserWarning, match="with a remainder of 4 rows the microbatches"):
            got, aux = jax.jit(grad_fn)(p, t, y)
    assert_close(got, want, dtype=np.float32, terms=batch)
    assert aux.values.shape == (batch,)


INTEGERS = [jnp.int8, jnp.uint8, jnp.int32]
EXTREMES = [AccumulationType.MAX, AccumulationType.MIN]


def _far_from_identity(kind: AccumulationType, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Integers at the end of ``dtype``'s range away from ``kind``'s identity, so that a
    fold started at 0 or at the wrong end gives a wrong answer."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(2)
    if kind is AccumulationType.MAX:
        return rng.integers(info.min, info.min + 60, size=shape).astype(dtype)
    return rng.integers(info.max - 60, info.max, size=shape).astype(dtype)


def _extreme(kind: AccumulationType, x: np.ndarray, axis: int = 0) -> np.ndarray:
    return np.max(x, axis) if kind is AccumulationType.MAX else np.min(x, axis)


@pytest.mark.x64
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
@pytest.mark.parametrize("kind", EXTREMES, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", INTEGERS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("which", ["micro_vmap", "microbatch"])
def test_integer_max_and_min_on_a_mesh(axis_type, kind, dtype, which):
    x = _far_from_identity(kind, dtype, (BATCH, 3))
    if which == "micro_vmap":
        fun = micro_vmap(
            lambda row: row[::-1], microbatch_size=8, accumulator=kind, **_mesh_options(axis_type)
        )
        want = _extreme(kind, x[:, ::-1])
    else:
        fun = microbatch(lambda rows: _reduce(kind, rows[:, ::-1]), 0, 8, kind)
        want = _extreme(kind, x[:, ::-1])
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        got = jax.jit(fun)(_put(mesh, x, P("data")))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)


def _reduce(kind: AccumulationType, rows: jax.Array) -> jax.Array:
    return jnp.max(rows, 0) if kind is AccumulationType.MAX else jnp.min(rows, 0)


@pytest.mark.x64
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
@pytest.mark.parametrize("kind", EXTREMES, ids=lambda k: k.name)
def test_integer_max_and_min_skip_examples_of_weight_zero_on_a_mesh(axis_type, kind):
    """A whole shard of weight 0, holding the batch's extreme, is skipped."""
    x = _far_from_identity(kind, np.int32, (BATCH, 3))
    x[3] = np.iinfo(np.int32).max if kind is AccumulationType.MAX else np.iinfo(np.int32).min
    mask = np.arange(BATCH) >= BATCH // SHARDS  # the first shard's rows: weight 0
    fun = micro_vmap(
        lambda row: row, microbatch_size=8, accumulator=kind, **_mesh_options(axis_type)
    )
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        xs, ws = _put(mesh, (x, mask), P("data"))
        got = jax.jit(fun)(xs, example_weights=ws)
    np.testing.assert_array_equal(got, _extreme(kind, x[mask]))


@pytest.mark.parametrize("gather", ["once", "per_microbatch"])
@pytest.mark.parametrize("kind", [AccumulationType.SUM, AccumulationType.MAX], ids=str)
def test_fsdp_transformed_gradients_come_back_laid_out_like_the_parameters(kind, gather):
    """A ``transform_fn`` over FSDP parameters (Explicit mesh): its accumulated results
    are sharded as the parameters are, eagerly and under ``jit``; a result of another
    shape stays whole."""
    params, tokens, targets = _embedding_problem()
    grads = _per_example_grads(params, tokens, targets)

    def transform(g):
        return (jax.tree.map(jnp.sign, g), jnp.sum(g["w"]))

    reduce = np.sum if kind is AccumulationType.SUM else np.max
    want = (
        {k: reduce(np.sign(g), axis=0) for k, g in grads.items()},
        reduce(np.sum(grads["w"], axis=(1, 2))),
    )
    grad_fn = micro_grad(
        _embedding_loss,
        batch_argnums=(1, 2),
        microbatch_size=8,
        transform_fn=transform,
        accumulator=kind,
        gather_params=gather,
    )
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        p = _put(mesh, params, FSDP)
        t, y = _put(mesh, (tokens, targets), P("data"))
        for got, _ in (grad_fn(p, t, y), jax.jit(grad_fn)(p, t, y)):
            assert_close(got, want, dtype=np.float32, terms=BATCH)
            for name in params:
                assert tuple(got[0][name].sharding.spec) == ("data", None), name
            assert tuple(got[1].sharding.spec) == ()


def _nan_padding_loss(p: Any, v: Any) -> Any:
    return jnp.sum(jnp.log(v) * p) ** 2


def _nan_padding_options(method: str) -> dict[str, Any]:
    return {
        "microbatch_size": 8,
        "l2_clip_norm": 1.0,
        "clip_method": method,
        "keep_batch_dim": False,
    }


def _nan_padding_data() -> tuple[jax.Array, np.ndarray, np.ndarray]:
    """The parameters, and a batch whose first device's rows are NaN, with their mask."""
    rng = np.random.default_rng(5)
    v = rng.uniform(0.5, 2.0, size=(BATCH, 3)).astype(np.float32)
    v[: BATCH // SHARDS] = np.nan
    mask = np.arange(BATCH) >= BATCH // SHARDS
    return jnp.asarray([0.3, -0.2, 0.5], jnp.float32), v, mask


def _outer(p: Any, fn: Any, v: Any, w: Any) -> Any:
    return jnp.sum(fn(p, v, example_weights=w)[0] ** 2)


@functools.cache
def _nan_padding_reference() -> Any:
    """The clipped sum of the real rows alone, by ``jax.vmap(jax.grad)``, and the gradient
    of its squared sum: one jitted program for every method and axis type."""
    p, v, mask = _nan_padding_data()
    summed = clipped_grad_sum(_nan_padding_loss, _nan_padding_options("auto")["l2_clip_norm"])
    outer = lambda p, v: jnp.sum(summed(p, v) ** 2)  # noqa: E731
    return jax.jit(lambda p, v: (summed(p, v), jax.grad(outer)(p, v)))(p, jnp.asarray(v[mask]))


@pytest.mark.parametrize(
    ("axis_type", "method"),
    [(a, "auto") for a in AXIS_TYPES]
    + [(AxisType.Explicit, "two_pass"), (AxisType.Auto, "materialize")],
    ids=str,
)
def test_a_whole_shard_of_nan_padding_reaches_no_outer_derivative(axis_type, method):
    """The first device's rows are all padding (weight 0) and NaN: the clipped sum, and
    ``jax.grad`` of a function of it with respect to the parameters, equal those of the
    real rows alone (a regression of round 3's hostile tests). ``auto`` takes the ghost
    norms here (as the report checks), on both kinds of mesh; the other methods each on
    one."""
    p, v, mask = _nan_padding_data()
    options = _nan_padding_options(method)
    grad_fn = micro_grad(_nan_padding_loss, **options, **_mesh_options(axis_type))
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        vs, ws = _put(mesh, (v, mask), P("data"))
        if method == "auto":
            report = microbatching.clipping_report(grad_fn, p, vs, example_weights=ws)
            assert report.method == "ghost"
        got = jax.jit(
            lambda p, v, w: (
                grad_fn(p, v, example_weights=w)[0],
                jax.grad(_outer)(p, grad_fn, v, w),
            )
        )(p, vs, ws)
    assert_close(got, _nan_padding_reference(), dtype=np.float32, terms=BATCH)


@pytest.mark.parametrize(
    ("axis_type", "method"),
    [(a, "auto") for a in AXIS_TYPES] + [(AxisType.Explicit, "materialize")],
    ids=str,
)
def test_a_row_that_nan_safe_drops_reaches_no_outer_derivative_on_a_mesh(axis_type, method):
    """FSDP parameters, one NaN row: ``jax.grad`` through the ``nan_safe`` clipped sum
    equals that of the other rows. (Found with it: XLA's constant folding of ``max``
    passed over the NaN, and the overflow-safe norm read the row as norm 0.)"""

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    rng = np.random.default_rng(0)
    w = rng.normal(size=(SHARDS, 3)).astype(np.float32)
    x = rng.normal(size=(8, SHARDS)).astype(np.float32)
    x[1, 0] = np.nan
    options: dict[str, Any] = {"microbatch_size": 4, "l2_clip_norm": 0.5, "clip_method": method}
    grad_fn = micro_grad(loss, keep_batch_dim=False, nan_safe=True, **options)

    def outer(w, fn, x):
        return jnp.sum(fn(w, x)[0] ** 2)

    stand_in = np.where(np.isfinite(x), x, 1.0)
    keep = jnp.asarray(np.all(np.isfinite(x), axis=1), jnp.float32)
    summed = clipped_grad_sum(loss, 0.5)
    want = jax.grad(lambda w: jnp.sum(summed(w, stand_in, keep) ** 2))(w)
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        ws, xs = _put(mesh, w, FSDP), _put(mesh, x, P("data"))
        # the batch a constant of the program: XLA folds its norms
        got = jax.jit(jax.grad(lambda w: outer(w, grad_fn, xs)))(ws)
    assert_close(got, want, dtype=np.float32, terms=8)


def _fsdp_step(axis_type: AxisType, **options: Any) -> tuple[Any, Any, str, int]:
    """``micro_grad`` of the embedding model with FSDP parameters under ``jit`` with
    in and out shardings: its gradients, the reference sum, its HLO and its temp bytes."""
    params, tokens, targets = _embedding_problem()
    want = {k: np.sum(g, axis=0) for k, g in _per_example_grads(params, tokens, targets).items()}
    grad_fn = micro_grad(
        _embedding_loss,
        batch_argnums=(1, 2),
        microbatch_size=8,
        **options,
        **_mesh_options(axis_type),
    )
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        p = _put(mesh, params, FSDP)
        t, y = _put(mesh, (tokens, targets), P("data"))
        fsdp = jax.tree.map(lambda _: NamedSharding(mesh, FSDP), params)
        step = jax.jit(lambda p, t, y: grad_fn(p, t, y)[0], out_shardings=fsdp)
        compiled = step.lower(p, t, y).compile()
        got = step(p, t, y)
    analysis, hlo = compiled.memory_analysis(), compiled.as_text()
    assert analysis is not None and hlo is not None
    return got, want, hlo, analysis.temp_size_in_bytes


@pytest.mark.compiled
def test_param_specs_give_an_auto_mesh_the_explicit_layout():
    """Inside ``jit`` on an Auto mesh the parameters' layout cannot be read: with
    ``param_specs`` the gradients are reduce-scattered per microbatch into a sum sharded
    like them, as on an Explicit mesh (the same program's collectives), and exact."""
    got, want, hlo, temp = _fsdp_step(AxisType.Auto, param_specs=FSDP)
    _, _, unseen, unseen_temp = _fsdp_step(AxisType.Auto)
    _, _, explicit, _ = _fsdp_step(AxisType.Explicit)
    assert_close(got, want, dtype=np.float32, terms=BATCH)
    assert "reduce-scatter" in hlo and "reduce-scatter" in explicit
    assert "reduce-scatter" not in unseen
    assert temp <= unseen_temp


def test_large_parameters_of_an_unseen_layout_get_a_warning_naming_param_specs():
    """8 MiB of parameters inside ``jit`` on an Auto mesh: a warning says that they enter
    the loop whole and names ``param_specs``; stating them silences it."""
    mesh = _mesh(AxisType.Auto)

    def loss(w, x):
        return jnp.sum(x @ w)

    w = jax.ShapeDtypeStruct((1024, 2048), jnp.float32)
    x = jax.ShapeDtypeStruct((BATCH, 1024), jnp.float32)
    options: dict[str, Any] = {"microbatch_size": 8, "batch_mesh_axes": "data"}
    with jax.set_mesh(mesh):
        with pytest.warns(UserWarning, match=r"\(8 MiB\) are laid out.*param_specs=\.\.\."):
            jax.jit(micro_grad(loss, keep_batch_dim=False, **options)).lower(w, x)
        quiet = micro_grad(loss, keep_batch_dim=False, param_specs=P(), **options)
        jax.jit(quiet).lower(w, x)  # filterwarnings = error: no warning


def test_param_specs_that_are_not_partition_specs_are_refused():
    with pytest.raises(TypeError, match=r"param_specs=\('data', None\), whose leaves must be "):
        micro_grad(_embedding_loss, param_specs=("data", None))


def test_param_specs_that_are_not_a_prefix_of_the_arguments_are_refused():
    params, tokens, targets = _embedding_problem()
    grad_fn = micro_grad(
        _embedding_loss,
        batch_argnums=(1, 2),
        microbatch_size=8,
        param_specs={"emb": FSDP, "other": FSDP},
        batch_mesh_axes="data",
    )
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        t, y = _put(mesh, (tokens, targets), P("data"))
        with pytest.raises(ValueError, match=r"must be a PartitionSpec or a pytree of them"):
            jax.jit(grad_fn)(params, t, y)
