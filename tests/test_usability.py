"""Progress inside jit, cached eager calls, hints for framework errors, the package."""

import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import microbatching
from microbatching import (
    AccumulationType,
    UnsplitBatchWarning,
    micro_grad,
    micro_vmap,
    microbatch,
)

from .strategies import SIN_W, SIN_X, assert_close, random_array, sin_loss

X = random_array(0, (40, 3), jnp.float32)
W = random_array(1, (3, 2), jnp.float32)


def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name)]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: microbatch(jnp.sum, 0, 4, progress=p),
        lambda p: micro_vmap(jnp.sin, microbatch_size=4, progress=p),
        lambda p: micro_grad(loss, microbatch_size=4, progress=p),
    ],
)
@pytest.mark.compiled
def test_progress_off_leaves_no_callback_in_the_program(make):
    fun_off, fun_on = make(False), make(True)
    args = (W, X) if fun_off.__name__ == "loss" else (X,)
    assert "callback" not in jax.jit(fun_off).lower(*args).as_text()
    assert "callback" in jax.jit(fun_on).lower(*args).as_text()


def test_progress_in_a_log_prints_a_line_per_ten_percent(capsys):
    grads, _ = jax.jit(micro_grad(loss, microbatch_size=2, progress=True))(W, X)
    jax.block_until_ready(grads)
    lines = _lines(capsys.readouterr().err, "micro_grad(loss)")
    done = [int(re.search(r"\] (\d+)/20 microbatches", line).group(1)) for line in lines]  # pyright: ignore[reportOptionalMemberAccess]
    assert done == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert lines[-1].endswith("[##############################] 20/20 microbatches (100%)")


@pytest.mark.x64
def test_progress_counts_a_traced_num_real_microbatches(capsys):
    def run(x, count):
        return microbatch(jnp.sum, 0, 4, progress=True, num_real_microbatches=count)(x)

    jax.block_until_ready(jax.jit(run)(X, jnp.int32(3)))
    lines = _lines(capsys.readouterr().err, "microbatch(sum)")
    assert lines[-1].endswith("3/3 microbatches (100%)") and len(lines) == 3


def test_progress_under_vmap_over_the_count_reports_only_what_each_lane_runs(capsys):
    def run(count):
        fun = micro_vmap(
            jnp.sum,
            microbatch_size=4,
            accumulator=AccumulationType.SUM,
            num_real_microbatches=count,
            progress=True,
        )
        return fun(X[:12])

    jax.block_until_ready(jax.jit(jax.vmap(run))(jnp.array([1, 3])))
    lines = _lines(capsys.readouterr().err, "micro_vmap(sum)")
    reports = sorted(line.split("] ")[1].split(" ")[0] for line in lines)
    assert reports == ["1/1", "1/3", "2/3", "3/3"]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_progress_on_a_mesh_is_one_bar(capsys, axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    fun = micro_vmap(
        jnp.sin, microbatch_size=8, accumulator=microbatching.AccumulationType.SUM, progress=True
    )
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((64, 2)), NamedSharding(mesh, P("data")))
        jax.block_until_ready(jax.jit(fun)(x))
    lines = _lines(capsys.readouterr().err, "micro_vmap(sin)")
    assert [line.split("] ")[1].split(" ")[0] for line in lines] == [f"{i}/8" for i in range(1, 9)]


@pytest.mark.x64
def test_eager_calls_key_python_numbers_by_type_and_sign():
    add = microbatch(lambda x, s: jnp.sum(x) + s, 0, 4)
    x = jnp.arange(8)
    ints, floats = add(x, 1), add(x, 1.0)
    assert jnp.issubdtype(ints.dtype, jnp.integer) and jnp.issubdtype(floats.dtype, jnp.floating)
    sign = microbatch(lambda x, s: jnp.copysign(1.0, s) * jnp.sum(x), 0, 4)
    assert float(sign(x, 0.0)) == 28.0 and float(sign(x, -0.0)) == -28.0


def test_progress_reaches_the_remainder_last(capsys):
    fun = microbatch(jnp.sum, 0, 4, progress=True, allow_remainder=True)
    jax.block_until_ready(jax.jit(fun)(jnp.ones(10)))
    lines = _lines(capsys.readouterr().err, "microbatch(sum)")
    assert [line.split("] ")[1].split(" ")[0] for line in lines] == ["1/3", "2/3", "3/3"]


def test_eager_calls_keep_python_control_flow_on_static_arguments():
    def fun(x, mode):
        return jnp.sum(x) if mode == "sum" else jnp.max(x)

    wrapped = micro_vmap(
        fun, (0, None), microbatch_size=4, accumulator=microbatching.AccumulationType.SUM
    )
    assert_close(wrapped(X, "sum"), jnp.sum(X))
    unhashable = microbatch(lambda x, opts: jnp.sum(x) * opts["k"], 0, 4)
    assert_close(unhashable(X, {"k": [2.0][0]}), jnp.sum(X) * 2)


def test_non_array_leaf_in_a_differentiated_argument_gets_a_hint():
    def with_function(params, x):
        return jnp.sum(params["act"](x @ params["w"]))

    with pytest.raises(
        TypeError,
        match=r"micro_grad differentiates `params` \(argnums=0\), but its leaf `params\['act'\]` is <.*> of type \w+, not a float array. Split the non-array parts out.*eqx.partition",
    ):
        micro_grad(with_function, microbatch_size=4)({"act": jax.nn.relu, "w": W}, X)


def test_equinox_model_with_activation_gets_the_partition_hint():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(3, 1, 4, 1, key=jax.random.key(0))

    def model_loss(m, x):
        return jnp.sum(jax.vmap(m)(x))

    with pytest.raises(TypeError, match=r"leaf `model\.activation` .* eqx\.partition"):
        micro_grad(lambda model, x: model_loss(model, x), microbatch_size=4)(model, X)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grads, _ = micro_grad(lambda p, x: model_loss(eqx.combine(p, static), x), microbatch_size=4)(
        params, X
    )
    assert_close(grads, jax.grad(lambda p: model_loss(eqx.combine(p, static), X))(params), terms=10)


def test_nnx_state_mutated_inside_the_loop_gets_a_hint():
    nnx = pytest.importorskip("flax.nnx")
    rngs = nnx.Rngs(0)
    dropout = nnx.Dropout(0.5, rngs=rngs)
    with pytest.raises(Exception, match="different trace level") as info:
        microbatch(lambda x: jnp.sum(dropout(x)), 0, 4)(X)
    notes = getattr(info.value, "__notes__", [])
    assert any("split the module with `graphdef, state = nnx.split(model)`" in n for n in notes)


def test_nnx_batch_stats_merged_without_a_copy_get_a_hint():
    """Merged inside fun and updated under a jax.grad taken in the loop (BatchNorm in
    training mode), the statistics are the caller's variables: the note says to merge a
    copy."""
    nnx = pytest.importorskip("flax.nnx")
    norm = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    graphdef, params, stats = nnx.split(norm, nnx.Param, nnx.BatchStat)

    def loss(params, stats, x):
        model = nnx.merge(graphdef, params, stats)
        return jnp.sum(model(x) ** 2), nnx.state(model, nnx.BatchStat)

    step = microbatch(jax.grad(loss, has_aux=True), 2, 4, AccumulationType.MEAN)
    with pytest.raises(Exception, match="Cannot mutate BatchStat") as info:
        step(params, stats, X)
    notes = getattr(info.value, "__notes__", [])
    assert any("nnx.merge(graphdef, state, copy=True)" in n for n in notes)


_BATCH_OF_ONE = (
    "micro_grad called fun with each example as a batch of one (batch_argnums={argnums}: "
    "`x` of shape (1, 5){more}): keep_batch_dim=True, the default. If fun is written for a "
    "single example, without a leading batch axis, pass keep_batch_dim=False; if one of "
    "these arguments is not a batch of examples, leave it out of batch_argnums."
)
_X_AND_Y = _BATCH_OF_ONE.format(argnums=(1, 2), more=", `y` of shape (1,)")


def _one_example_loss(w, x, y):
    """Written for one example: ``x`` of shape ``(5,)``, ``y`` a scalar."""
    return jnp.sum((jnp.dot(w.T, x) - y) ** 2)


def _one_example_logits(w, x, y):
    return -jax.nn.log_softmax(x @ w)[y]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_loss_written_for_one_example_gets_a_note_naming_keep_batch_dim(clip):
    """JAX's own shape error inside fun keeps its message and gains a note with the fix;
    with ``keep_batch_dim=False`` the same loss gives the per-example gradients' sum."""
    w, x, y = random_array(0, (5, 3), jnp.float32), random_array(1, (8, 5), jnp.float32), X[:8, 0]
    options = {"batch_argnums": (1, 2), "microbatch_size": 4, "l2_clip_norm": clip}
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions") as info:
        micro_grad(_one_example_loss, **options)(w, x, y)
    assert info.value.__notes__.count(_X_AND_Y) == 1
    got, _ = micro_grad(_one_example_loss, keep_batch_dim=False, **options)(w, x, y)
    each = jax.vmap(jax.grad(_one_example_loss), (None, 0, 0))(w, x, y)
    if clip is not None:
        norms = jnp.sqrt(jnp.sum(each**2, axis=(1, 2)))
        each = each * jnp.minimum(1.0, clip / norms)[:, None, None]
    assert_close(got, jnp.sum(each, axis=0), terms=2)


def test_a_loss_of_shape_one_per_example_names_keep_batch_dim():
    w, x = random_array(0, (5, 3), jnp.float32), random_array(1, (8, 5), jnp.float32)
    y = jnp.zeros((8,), jnp.int32)
    with pytest.raises(TypeError) as info:
        micro_grad(_one_example_logits, batch_argnums=(1, 2), microbatch_size=4)(w, x, y)
    assert str(info.value) == (
        "micro_grad needs fun to return a scalar loss per example, but it returned shape "
        "(1, 3) for each; reduce it to a scalar in fun. " + _X_AND_Y
    )


def test_a_loss_written_for_a_batch_given_keep_batch_dim_false_gets_the_other_note():
    def batch_loss(w, x, y):  # indexes the batch axis that keep_batch_dim=False takes away
        return -jnp.mean(jnp.take_along_axis(x @ w, y[:, None], axis=1))

    w, x = random_array(0, (5, 3), jnp.float32), random_array(1, (8, 5), jnp.float32)
    y = jnp.zeros((8,), jnp.int32)
    grad_fn = micro_grad(batch_loss, batch_argnums=(1, 2), microbatch_size=4, keep_batch_dim=False)
    with pytest.raises(IndexError) as info:
        grad_fn(w, x, y)
    assert (
        info.value.__notes__.count(
            "micro_grad called fun with each example without a batch axis (batch_argnums=(1, 2): "
            "`x` of shape (5,), `y` of shape ()): keep_batch_dim=False. If fun is written for a "
            "batch, indexing or reducing over a leading batch axis, leave keep_batch_dim at its "
            "default, True; if one of these arguments is not a batch of examples, leave it out "
            "of batch_argnums."
        )
        == 1
    )


def test_a_loss_of_any_other_shape_per_example_names_keep_batch_dim():
    w, x = random_array(0, (5, 3), jnp.float32), random_array(1, (8, 5), jnp.float32)
    with pytest.raises(TypeError) as info:
        micro_grad(lambda w, x: (x @ w)[0], microbatch_size=4)(w, x)
    assert str(info.value).endswith(_BATCH_OF_ONE.format(argnums=1, more="")), str(info.value)


def test_an_error_beside_an_argument_of_the_batch_size_passed_whole_names_it():
    """``argnums=1`` where ``y`` is batched too: JAX's shape error gains a note naming
    ``y``, passed whole at the batch's size; an error with nothing so named gains none."""
    w, x, y = jnp.ones(3), jnp.ones((64, 3)), jnp.ones(64)

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    with (
        pytest.raises(TypeError, match="incompatible shapes for broadcasting") as info,
        pytest.warns(UnsplitBatchWarning, match="`y` \\(argument 2\\) has 64 rows on axis 0"),
    ):
        jax.jit(microbatch(loss, argnums=1, microbatch_size=16))(w, x, y)
    assert (
        info.value.__notes__.count(
            "microbatching: fun ran on microbatches of 16 rows of the batch arguments, and got "
            "`y` (shape (64,)) whole, though its axis 0 has the batch's size, 64. If it is part "
            "of the batch, add it to the batch arguments: argnums (microbatch), in_axes "
            "(micro_vmap) or batch_argnums (micro_grad)."
        )
        == 1
    )
    assert not any(n.startswith("microbatching: fun ran on microbatches of 16 rows of the "
                                "batch arguments (") for n in info.value.__notes__)  # fmt: skip
    with pytest.raises(TypeError) as info:
        microbatch(loss, argnums=1, microbatch_size=16)(w, x, jnp.ones(5))
    assert not any("whole" in note for note in getattr(info.value, "__notes__", []))


_SPLIT_NOTE = (
    "microbatching: fun ran on microbatches of 4 rows of the batch arguments ({split}). If one "
    "of them is not a batch, leave it out of the batch arguments: argnums (microbatch), "
    "in_axes (micro_vmap) or batch_argnums (micro_grad)."
)


def test_an_error_with_the_parameters_split_names_the_split_arguments():
    """``jax.grad(microbatch(loss, argnums=0))``, the parameters split where the data
    were meant (``argnums`` read as ``jax.grad``'s): JAX's shape error gains one note
    naming what was split and how ``fun`` saw it; so does ``micro_vmap``'s."""
    w, x, y = jnp.ones(16), jnp.ones((64, 16)), jnp.ones(64)

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    with pytest.raises(TypeError, match="dot_general requires contracting") as info:
        jax.grad(microbatch(loss, argnums=0, microbatch_size=4))(w, x, y)
    assert info.value.__notes__.count(_SPLIT_NOTE.format(split="`w` as shape (4,)")) == 1
    with pytest.raises(ValueError, match="matmul input operand") as info:
        micro_vmap(lambda p, x: x @ p["w"] + p["b"], in_axes=(0, None), microbatch_size=4)(
            {"w": w, "b": jnp.ones(16)}, x
        )
    split = "`p['b']` as shape (4,), `p['w']` as shape (4,)"
    assert info.value.__notes__.count(_SPLIT_NOTE.format(split=split)) == 1, info.value.__notes__


def test_micro_grad_with_the_parameters_split_names_them_and_batch_argnums():
    """``batch_argnums=0`` where the data were meant: the loss's shape error gains one
    note, naming ``w`` as split and ``batch_argnums``, and not the loop's note too."""
    w, x, y = jnp.ones(16), jnp.ones((64, 16)), jnp.ones(64)

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    with pytest.raises(TypeError, match="dot_general requires contracting") as info:
        micro_grad(loss, batch_argnums=0, microbatch_size=4)(w, x, y)
    ours = [n for n in info.value.__notes__ if n.startswith(("micro", "microbatching:"))]
    assert ours == [_BATCH_OF_ONE.format(argnums=0, more="").replace("`x` of shape (1, 5)",
                                                                    "`w` of shape (1,)")]  # fmt: skip


def test_the_notes_list_the_first_four_split_arguments_then_an_ellipsis():
    """Six arguments split by mistake: both notes name the first four, then ``...``."""
    params = {name: jnp.ones(16) for name in "abcdef"}
    x = jnp.ones((64, 16))

    def loss(p, x):
        return jnp.mean(x @ sum(p.values()))

    four = ", ".join(f"`p['{name}']` as shape (4,)" for name in "abcd") + ", ..."
    with pytest.raises(TypeError, match="dot_general requires contracting") as info:
        microbatch(loss, argnums=0, microbatch_size=4)(params, x)
    assert info.value.__notes__.count(_SPLIT_NOTE.format(split=four)) == 1, info.value.__notes__

    def flat(a, b, c, d, e, x):
        return jnp.mean(x @ (a + b + c + d + e))

    with pytest.raises(TypeError, match="dot_general requires contracting") as info:
        micro_grad(flat, batch_argnums=(0, 1, 2, 3, 4, 5), microbatch_size=4)(
            *[jnp.ones(64)] * 5, jnp.ones((64, 64))
        )
    listed = ", ".join(f"`{name}` of shape (1,)" for name in "abcd") + ", ..."
    assert any(f"(batch_argnums=(0, 1, 2, 3, 4, 5): {listed})" in n for n in
               info.value.__notes__), info.value.__notes__  # fmt: skip


def test_version_matches_the_package_metadata():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert microbatching.__version__ == pyproject["project"]["version"]
    assert (
        f"## {microbatching.__version__}"
        in (Path(__file__).parents[1] / "CHANGELOG.md").read_text()
    )


# --- progress inside shard_map ----------------------------------------------------------

BAR = re.compile(
    r"micro_(vmap\(<lambda>\)|grad\(sin_loss\)) \[[#.]{30}\] (\d)/4 microbatches \(\d+%\)"
)


@pytest.mark.parametrize("transform", ["micro_vmap", "micro_grad"])
def test_progress_inside_shard_map_is_one_bar_per_process(capfd, transform):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    if transform == "micro_vmap":
        fun = micro_vmap(
            lambda v: jnp.sin(v @ SIN_W),
            microbatch_size=2,
            accumulator=AccumulationType.SUM,
            progress=True,
        )
        per_shard = lambda x: jax.lax.psum(fun(x), "data")  # noqa: E731
    else:
        fun = micro_grad(sin_loss, microbatch_size=2, progress=True)
        per_shard = lambda x: jax.lax.psum(fun(SIN_W, x)[0], "data")  # noqa: E731
    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P()))
    x = jnp.concatenate([SIN_X] * 4)  # 8 rows per shard: 4 microbatches of 2
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        for _ in range(2):  # a later call starts a fresh bar
            jax.block_until_ready(sharded(x))
    jax.effects_barrier()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("micro_")]
    matches = [BAR.fullmatch(line) for line in lines]
    assert all(matches), lines  # no line is a mix of two
    assert [m.group(2) for m in matches if m] == ["1", "2", "3", "4"] * 2
