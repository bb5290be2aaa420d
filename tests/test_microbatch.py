"""``microbatch`` against the function run on the whole batch at once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatching import AccumulationType, Accumulator, microbatch

from .strategies import assert_close, batches, microbatch_sizes

MEAN, SUM, RUNNING_MEAN, CONCAT = (
    AccumulationType.MEAN,
    AccumulationType.SUM,
    AccumulationType.RUNNING_MEAN,
    AccumulationType.CONCAT,
)


def _row_sum(x, axis):
    return jnp.sum(x, axis=axis, dtype=x.dtype)


def _row_mean(x, axis):
    return jnp.mean(x, axis=axis, dtype=x.dtype)


def _rowwise(x, axis):
    return jnp.moveaxis(x * 2 + 1, axis, 0)


REDUCTIONS = {SUM: _row_sum, MEAN: _row_mean, RUNNING_MEAN: _row_mean, CONCAT: _rowwise}


@pytest.mark.x64
@settings(max_examples=20, deadline=None)
@given(data=st.data(), case=batches())
def test_every_accumulator_matches_the_whole_batch(data, case):
    x, axis = case
    kinds = [SUM, CONCAT]
    if jnp.issubdtype(x.dtype, jnp.floating):
        kinds += [MEAN, RUNNING_MEAN]
    kind = data.draw(st.sampled_from(kinds))
    size = data.draw(microbatch_sizes(x.shape[axis]))
    jitted = data.draw(st.booleans())
    fun = REDUCTIONS[kind]
    batched = microbatch(lambda x: fun(x, axis), 0, size, kind, in_axes=axis)
    got = (jax.jit(batched) if jitted else batched)(x)
    assert got.dtype == x.dtype
    want = jax.jit(fun, static_argnums=1)(x, axis)
    if kind is RUNNING_MEAN and x.shape[axis] == 0:
        want = jnp.zeros_like(want)  # no microbatch ran: 0, as in optax main
    assert_close(got, want, terms=x.shape[axis] // size)


@settings(max_examples=12, deadline=None)
@given(data=st.data(), case=batches(min_rows=1))
def test_a_pytree_of_accumulators_applies_per_subtree(data, case):
    x, axis = case
    x = x.astype(jnp.float32)
    size = data.draw(microbatch_sizes(x.shape[axis]))

    def fun(x, y):
        return {
            "rows": (_rowwise(x, axis), y["w"] * 2),
            "total": _row_sum(x, axis) + jnp.sum(y["w"]),
            "mean": [_row_mean(x, axis)],
        }

    y = {"w": jnp.arange(x.shape[axis] * 3, dtype=x.dtype).reshape(x.shape[axis], 3)}
    accumulator = {"rows": CONCAT, "total": SUM, "mean": [MEAN]}
    batched = microbatch(fun, (0, 1), size, accumulator, in_axes=(axis, {"w": 0}))
    got = jax.jit(batched)(x, y)
    want = jax.jit(fun)(x, y)
    assert_close(got, want, terms=x.shape[axis] // size)


@pytest.mark.x64
def test_microbatches_take_every_nth_row():
    seen = microbatch(lambda x: x[None], 0, 3, CONCAT)(jnp.arange(12))
    np.testing.assert_array_equal(seen, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]])


@pytest.mark.x64
def test_concat_of_scalars_stacks_microbatch_results_in_order():
    got = microbatch(jnp.sum, 0, 2, CONCAT)(jnp.arange(8))
    np.testing.assert_array_equal(got, [0 + 4, 1 + 5, 2 + 6, 3 + 7])


@pytest.mark.x64
def test_concat_interleaves_outputs_with_several_rows_per_microbatch():
    fun = lambda x: jnp.repeat(x, 2, axis=0)  # noqa: E731 - four output rows per microbatch
    got = microbatch(fun, 0, 2, CONCAT)(jnp.arange(6))
    # Row j of microbatch i's output lands at j * num_microbatches + i, as it was read.
    np.testing.assert_array_equal(got, [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5])


@pytest.mark.x64
def test_unbatched_arguments_pass_through_whole():
    fun = lambda w, x, *, bias: x @ w + bias[None]  # noqa: E731
    w, x = jnp.ones((3, 2)), jnp.arange(24.0).reshape(8, 3)
    got = microbatch(fun, 1, 4, CONCAT)(w, x, bias=jnp.ones(2))
    assert_close(got, fun(w, x, bias=jnp.ones(2)))


@pytest.mark.x64
def test_batch_passed_by_keyword_or_position_either_way():
    def fun(w, x):
        return jnp.sum(x * w)

    w, x = jnp.float32(2), jnp.arange(8.0)
    by_num = microbatch(fun, argnums=1, microbatch_size=2)
    by_name = microbatch(fun, argnums=(), argnames="x", microbatch_size=2)
    want = fun(w, x)
    for batched in (by_num, by_name):
        assert batched(w, x) == want
        assert batched(w, x=x) == want
        assert batched(w=w, x=x) == want


@pytest.mark.x64
def test_keyword_only_and_var_keyword_batch_arguments():
    def kw_only(*, x, scale):
        return jnp.sum(x) * scale

    def wrapper(*args, **kwargs):
        return jnp.sum(args[0]) + jnp.sum(kwargs["y"])

    x = jnp.arange(6.0)
    assert microbatch(kw_only, (), 3, argnames="x")(x=x, scale=2.0) == 30.0
    assert microbatch(wrapper, 0, 3, argnames=("y",))(x, y=x) == 30.0


@pytest.mark.x64
def test_negative_in_axes_count_from_the_end():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    got = microbatch(lambda x: jnp.sum(x, axis=-1), 0, 2, in_axes=-1)(x)
    assert_close(got, jnp.sum(x, axis=-1))


@pytest.mark.x64
def test_in_axes_pytree_prefix_with_unbatched_leaves():
    def fun(tree):
        return jnp.sum(tree["x"]) * tree["scale"]

    tree = {"x": jnp.arange(8.0), "scale": jnp.float32(3)}
    got = microbatch(fun, 0, 2, in_axes=({"x": 0, "scale": None},))(tree)
    assert got == fun(tree)


@pytest.mark.x64
def test_custom_accumulator_sees_shape_dtype_and_index():
    calls = []

    def init(struct):
        calls.append((struct.shape, struct.dtype))
        return jnp.zeros((4,), jnp.int32)

    acc = Accumulator(
        init=init,
        update=lambda carry, x, i: carry.at[i].set(jnp.sum(x, dtype=carry.dtype)),
        finalize=lambda carry: carry * 10,
        aggregate=lambda x: x,
    )
    got = microbatch(lambda x: x, 0, 2, acc)(jnp.arange(8, dtype=jnp.int32))
    np.testing.assert_array_equal(got, [40, 60, 80, 100])
    assert calls == [((2,), jnp.int32)]


@pytest.mark.x64
@pytest.mark.parametrize("kind", list(AccumulationType))
def test_microbatch_size_none_is_the_function_itself(kind):
    fun = lambda x: (x * 2.0, jnp.sum(x))  # noqa: E731
    x = jnp.arange(6.0)
    got = microbatch(fun, 0, None, kind)(x)
    jax.tree.map(np.testing.assert_array_equal, got, fun(x))  # exact: fun runs once, whole


@pytest.mark.x64
def test_empty_batch_gives_shaped_results():
    x = jnp.zeros((0, 3), jnp.float32)
    fun = lambda x: (jnp.sum(x, axis=0), jnp.mean(x, axis=0), x * 2, jnp.mean(x))  # noqa: E731
    total, mean, rows, running = microbatch(fun, 0, 4, (SUM, MEAN, CONCAT, RUNNING_MEAN))(x)
    np.testing.assert_array_equal(total, jnp.zeros(3))
    # Checked on the host: an XLA isnan is folded to False under fast math without NaNs.
    assert mean.shape == (3,) and np.all(np.isnan(np.asarray(mean)))
    assert running.shape == () and float(running) == 0.0  # no microbatch ran, as in optax main
    assert rows.shape == (0, 3) and rows.dtype == jnp.float32


@pytest.mark.x64
@pytest.mark.parametrize("count", [0, 1, 3])
def test_static_num_real_microbatches_runs_the_first_k(count):
    x = jnp.arange(8.0)
    fun = lambda x: (jnp.sum(x), jnp.sum(x), x, jnp.sum(x))  # noqa: E731
    got = microbatch(fun, 0, 2, (SUM, MEAN, CONCAT, RUNNING_MEAN), num_real_microbatches=count)(x)
    per_microbatch = [float(jnp.sum(x[i::4])) for i in range(4)]
    assert got[0] == sum(per_microbatch[:count])
    assert got[1] == sum(per_microbatch[:count]) / 4
    kept = jnp.where(jnp.arange(8) % 4 < count, x, 0)
    np.testing.assert_array_equal(got[2], kept)
    assert_close(got[3], np.mean(per_microbatch[:count]) if count else 0.0, terms=count)


@pytest.mark.x64
@pytest.mark.parametrize("kind", [MEAN, RUNNING_MEAN, SUM])
def test_no_nan_is_made_on_the_way_under_debug_nans(kind):
    x = jnp.arange(8.0)
    with jax.debug_nans(True):
        got = microbatch(jnp.mean, 0, 2, kind)(x)
    assert bool(jnp.isfinite(got))
