"""Shortcuts that must equal the plain computation: eager calls, the summed-gradient
fast path, norms at the ends of the float range, and defaults that could drop a batch."""

import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbatching import (
    AccumulationType,
    Accumulator,
    UnsplitBatchWarning,
    micro_grad,
    micro_vmap,
    microbatch,
)
from microbatching import _per_example as per_example

from .strategies import assert_close, random_array

pytestmark = pytest.mark.x64  # dtypes are what most of these are about

SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
X = random_array(0, (8, 3), jnp.float32)
P = jnp.array([1.0, -0.5, 2.0])


class Compiles:
    """Counts XLA compilations while it is entered."""

    def __enter__(self):
        self.count = 0
        self._on = True
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, event, duration_secs, **kwargs):
        if self._on and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __exit__(self, *exc):
        self._on = False


# --- eager calls behave as un-jitted calls ------------------------------------------


def test_eager_call_reads_the_current_globals():
    state = {"k": 1.0}
    scaled = micro_vmap(lambda v: v * state["k"], microbatch_size=2)
    assert_close(scaled(X), X)
    state["k"] = 2.0
    assert_close(scaled(X), 2 * X)


def test_eager_call_reads_a_global_array_without_compiling_again():
    state = {"w": jnp.ones(3)}
    fun = microbatch(lambda x: jnp.sum(x @ state["w"]), 0, 2)
    assert_close(fun(X), jnp.sum(X))
    state["w"] = jnp.full_like(state["w"], 3.0)  # the same type: not weak, the same dtype
    with Compiles() as compiles:
        got = fun(X)
    assert_close(got, 3 * jnp.sum(X))
    assert compiles.count == 0


def test_side_effects_of_fun_run_at_every_eager_call_and_the_second_compiles_nothing():
    calls = []

    def fun(x, scale):
        calls.append(scale)
        return jnp.sum(x) * scale

    wrapped = microbatch(fun, 0, 4)
    assert_close(wrapped(X, 2.0), jnp.sum(X) * 2)
    doubled = X * 2
    with Compiles() as compiles:
        got = wrapped(doubled, 2.0)
    assert_close(got, jnp.sum(X) * 4)
    assert compiles.count == 0
    assert calls == [2.0, 2.0]
    assert_close(wrapped(X, 3.0), jnp.sum(X) * 3)  # a new number: a new program


def test_eager_call_keeps_a_non_batch_argument_concrete():
    def fun(x, flag):
        if flag:
            return x * 2
        return x

    wrapped = microbatch(fun, 0, 2, CONCAT)
    assert_close(wrapped(X, jnp.array(True)), X * 2)
    assert_close(wrapped(X, jnp.array(False)), X)
    sized = microbatch(lambda x, n: jnp.sum(x) + jnp.zeros(n), 0, 2)
    assert sized(X, np.int64(3)).shape == (3,)


def test_eager_call_inside_grad_closing_over_the_traced_parameter():
    def outer(p):
        return jnp.sum(micro_vmap(lambda v: jnp.sin(v * p), microbatch_size=2)(X))

    want = jax.grad(lambda p: jnp.sum(jnp.sin(X * p)))(1.5)
    assert_close(jax.grad(outer)(1.5), want, dtype=jnp.float32)
    assert_close(
        jax.grad(outer)(1.5), want, dtype=jnp.float32
    )  # nothing of the first trace is reused


def test_shape_dtype_struct_arguments_give_shapes():
    fun = microbatch(lambda x, y: (x * 2, jnp.sum(y)), 0, 2, (CONCAT, SUM))
    y = jnp.ones(2)
    out = fun(jax.ShapeDtypeStruct((8, 3), jnp.float32), y)
    assert out == (
        jax.ShapeDtypeStruct((8, 3), jnp.float32),
        jax.ShapeDtypeStruct((), y.dtype),
    )


# --- the summed-gradient fast path ---------------------------------------------------


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def clipped_loss(p, v):
    return jnp.sum(clip_gradient(v @ p))


def _per_example(loss, p, x):
    return jax.vmap(jax.grad(loss), (None, 0))(p, x)


def _clip_rows(grads, bound):
    norms = np.linalg.norm(np.asarray(grads, np.float64), axis=1, keepdims=True)
    return np.asarray(grads, np.float64) * np.minimum(1.0, bound / norms)


def test_custom_vjp_with_clipping_equals_per_example_clipping():
    want = _clip_rows(_per_example(clipped_loss, P, X), 0.2).sum(0)
    got, _ = micro_grad(clipped_loss, microbatch_size=4, l2_clip_norm=0.2)(P, X)
    assert_close(got, want.astype(np.float32), terms=8)


def test_custom_vjp_with_weights_equals_weighted_per_example_gradients():
    weights = jnp.array([0.5, 2.0, 0.0, 1.0, 3.0, 1.0, 0.25, 1.0])
    want = (np.asarray(weights)[:, None] * np.asarray(_per_example(clipped_loss, P, X))).sum(0)
    got, _ = micro_grad(clipped_loss, microbatch_size=4)(P, X, example_weights=weights)
    assert_close(got, want.astype(np.float32), terms=8)


def test_custom_vjp_with_a_remainder_equals_per_example_gradients():
    x = random_array(3, (7, 3), jnp.float32)
    want = np.asarray(_per_example(clipped_loss, P, x)).sum(0)
    got, _ = micro_grad(clipped_loss, microbatch_size=4, allow_remainder=True)(P, x)
    assert_close(got, want, terms=7)


@pytest.mark.parametrize("accumulator", [AccumulationType.MEAN, AccumulationType.RUNNING_MEAN])
def test_custom_vjp_not_linear_in_its_cotangent_takes_the_mean_unseeded(accumulator):
    """A mean seeds the backward pass with 1 / rows only where it is linear in its
    cotangent: here the seed 1/4 would be clipped to 0.1, not 0.1 / 4 (4x too large)."""
    want = np.asarray(_per_example(clipped_loss, P, X), np.float64).mean(0)
    got, _ = micro_grad(clipped_loss, microbatch_size=4, accumulator=accumulator)(P, X)
    assert_close(got, want.astype(np.float32), terms=8)


def _exact(loss, dtype=jnp.float32, requested=None):
    example = per_example.Examples(loss, _axes(loss), 0, False, True)
    sums = per_example.Sums(example, None, None, requested)
    args = (P.astype(dtype), X.astype(dtype))
    return per_example.summed_is_exact(sums, args, {})


def _axes(loss):
    from microbatching import _signature

    return _signature.grad_axes(loss, 1)


def test_fast_path_rule_takes_only_what_it_can_prove():
    relu_loss = lambda p, v: jnp.sum(jax.nn.relu(v @ p))  # noqa: E731  custom_jvp: linear
    assert _exact(relu_loss)
    # a user-written backward rule on the parameters' side sees the summed cotangent
    assert not _exact(clipped_loss)
    assert not _exact(relu_loss, dtype=jnp.float16)  # summed in float16
    assert _exact(relu_loss, dtype=jnp.float16, requested=jnp.float16)


def test_the_report_says_why_the_summed_gradient_is_not_taken():
    """``clipping_report`` names the reason the per-example gradients are formed without
    clipping: a dtype narrower than its accumulation (with the spelling that takes one
    gradient per microbatch), or a backward rule that weights cannot be proven linear
    through."""
    from microbatching import clipping_report

    def mixed(p, v):  # float32 parameters, bfloat16 compute
        return jnp.sum(jnp.tanh(v.astype(jnp.bfloat16) @ p.astype(jnp.bfloat16)))

    report = clipping_report(micro_grad(mixed, microbatch_size=4), P, X)
    assert report.method == "materialize"
    assert report.reason == (
        "not one gradient per microbatch: "
        + per_example.NARROWER.format(dtype="bfloat16", wide="float32")
    )
    assert "microbatch(jax.grad(fun), accumulator=MEAN)" in report.reason
    weights = jnp.ones(X.shape[0])
    report = clipping_report(
        micro_grad(clipped_loss, microbatch_size=4), P, X, example_weights=weights
    )
    assert report.method == "materialize"
    assert report.reason.startswith(
        "not one gradient per microbatch: the loss holds custom_vjp_call"
    )
    same = clipping_report(
        micro_grad(mixed, microbatch_size=4, accumulation_dtype=jnp.bfloat16), P, X
    )
    assert same.method == "plain"


def test_custom_vjp_nested_in_a_custom_jvp_rule_is_seen():
    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda primals, tangents: (primals[0], clip_gradient(tangents[0])))
    assert not _exact(lambda p, v: jnp.sum(f(v @ p)))


# --- norms at the ends of the float range --------------------------------------------

PATHS = {
    "fast": {},
    "per-example": {"transform_fn": lambda g: jax.tree.map(lambda x: x * 1, g)},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [1e25, 1e-30])
def test_clipping_huge_and_tiny_gradients(path, scale):
    bound = scale * 1e-3 if scale < 1 else 1.0  # every example clipped
    loss = lambda p, v: scale * jnp.sum(v @ p)  # noqa: E731
    got, _ = micro_grad(loss, microbatch_size=4, l2_clip_norm=bound, **PATHS[path])(P, X)
    rows = np.asarray(X, np.float64)
    want = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).sum(0)
    assert_close(np.asarray(got, np.float64) / bound, want.astype(np.float32), terms=8)


def test_norms_of_huge_and_tiny_gradients_match_float64():
    from microbatching import _clipping

    for scale in [1e30, 1e-30, 0.0]:
        grads = {"a": X * scale, "b": X[:, :2] * scale}
        got = _clipping.row_norms(grads, 8)
        wide = np.concatenate([np.asarray(X, np.float64), np.asarray(X[:, :2], np.float64)], 1)
        want = np.linalg.norm(wide * scale, axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(want, initial=0.0))


ROW_SCALES = {
    "ordinary": [1.0] * 8,  # every sum of squares safe: taken as it is
    "one huge row": [1.0] * 7 + [1e25],  # the branch that scales every row
    "one tiny row": [1e-25] + [1.0] * 7,
    "a zero row": [0.0] + [1.0] * 7,
    # Entries stay normal: XLA:CPU reads subnormal numbers as 0.
    "the ends of float32": [3e38, 1e-35, 2.0**-120, 0.0, 1.0, 1e19, 1e-19, 1e-36],
}


@pytest.mark.parametrize("mapped", [False, True], ids=["branch", "mapped"])
@pytest.mark.parametrize("case", ROW_SCALES)
def test_row_norms_are_exact_on_either_side_of_their_branch(case, mapped):
    """``row_norms`` takes the plain sums of squares where every one of them is safe, and
    scales every row by a power of two otherwise; ``mapped_row_norms`` always scales.
    Either way each row's norm is its float64 norm, up to rounding."""
    from microbatching import _clipping

    scales = np.asarray(ROW_SCALES[case], np.float64)[:, None]
    rows = np.asarray(X, np.float64) * scales
    grads = {"a": jnp.asarray(rows, jnp.float32), "b": jnp.asarray(rows[:, :2], jnp.float32)}
    norms = _clipping.mapped_row_norms if mapped else _clipping.row_norms
    got = np.asarray(jax.jit(lambda g: norms(g, 8))(grads), np.float64)
    wide = np.concatenate(
        [np.asarray(grads["a"], np.float64), np.asarray(grads["b"], np.float64)], axis=1
    )
    want = np.linalg.norm(wide, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0.0)  # relative to each row
    leaves = np.asarray(
        jax.jit(lambda g: _clipping.leaf_norms(g, 8, not mapped))(grads), np.float64
    )
    each = [np.linalg.norm(np.asarray(grads[k], np.float64), axis=1) for k in "ab"]
    np.testing.assert_allclose(leaves, np.stack(each, 1), rtol=1e-6, atol=0.0)


def test_the_plain_sums_of_squares_are_taken_only_where_they_are_safe():
    """The branch reads the sums of squares: safe ones (neither overflowed nor lost to
    underflow) pass it, the others and a zero row (which an underflowed row cannot be
    told from) take the scaled form."""
    from microbatching import _clipping

    info = jnp.finfo(jnp.float32)
    low, high = _clipping.SAFE_LOW * float(info.tiny), float(info.max) / _clipping.SAFE_HIGH
    assert 2.0**-60 <= low <= 2.0**-59 and 2.0**125 <= high <= 2.0**126
    text = str(jax.make_jaxpr(lambda g: _clipping.row_norms(g, 4))(jnp.ones((4, 3))))
    assert "cond" in text
    mapped = str(jax.make_jaxpr(lambda g: _clipping.mapped_row_norms(g, 4))(jnp.ones((4, 3))))
    assert "cond" not in mapped


def test_float16_mean_of_large_gradients_does_not_overflow():
    f16 = jnp.float16
    grads, _ = micro_grad(lambda w, x: jnp.sum(x @ w), accumulator=MEAN)(
        jnp.ones(2, f16), jnp.full((128, 2), 1000.0, f16)
    )
    assert grads.dtype == f16
    np.testing.assert_array_equal(np.asarray(grads, np.float32), 1000.0)


# --- defaults that would drop a batch, and has_aux ------------------------------------


def _loss_xy(p, x, y):
    return jnp.sum((x @ p - y) ** 2)


def test_default_batch_argnums_warns_once_about_another_batch_argument():
    y = random_array(1, (8,), jnp.float32)
    wrapped = micro_grad(_loss_xy, microbatch_size=4)
    with pytest.warns(
        UnsplitBatchWarning,
        match=r"batch_argnums was left at its default, 1, so only `x` is split into examples, "
        r"but `y` \(argument 2\) also has 8 rows on axis 0 and is passed whole to every "
        r"example\. If it holds one entry per example, pass batch_argnums=\(1, 2\); if it is "
        r"meant whole, pass batch_argnums=1 or whole_argnums=2 to say so\.$",
    ):
        wrapped(P, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(P, X, y)  # once
        micro_grad(_loss_xy, batch_argnums=1, microbatch_size=4, whole_argnums=2)(P, X, y)
        got, _ = micro_grad(_loss_xy, batch_argnums=(1, 2), microbatch_size=4)(P, X, y)
    want = jax.vmap(jax.grad(_loss_xy), (None, 0, 0))(P, X, y).sum(0)
    assert_close(got, want, terms=8)


def _loss_broadcast(p, x, y):
    """The issue's silent mistake: ``y`` left whole broadcasts against every example."""
    return jnp.sum((jnp.sum(x @ p) - y) ** 2)


@pytest.mark.parametrize("whole", [2, -1, (2,)])
def test_an_explicit_batch_argnums_warns_about_an_argument_it_leaves_whole(whole):
    """Any ``batch_argnums``: a label array left out gives a wrong gradient without an
    error, so the warning names it; ``whole_argnums`` says it is meant whole, and the
    result is then the reference's with ``y`` whole."""
    y = random_array(1, (8,), jnp.float32)
    with pytest.warns(
        UnsplitBatchWarning,
        match=r"^micro_grad\(_loss_broadcast\): `y` \(argument 2\) has 8 rows on axis 0, as "
        r"the batch has, but it is not a batch argument \(batch_argnums=1\), so it is passed "
        r"whole to every example\. If it holds one entry per example, pass "
        r"batch_argnums=\(1, 2\); if it is meant whole, pass whole_argnums=2 to say so\.$",
    ):
        micro_grad(_loss_broadcast, batch_argnums=1, microbatch_size=4)(P, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _ = micro_grad(
            _loss_broadcast, batch_argnums=1, microbatch_size=4, whole_argnums=whole
        )(P, X, y)
        # Passed by keyword, it is the same parameter.
        micro_grad(_loss_broadcast, batch_argnums=1, microbatch_size=4, whole_argnums=whole)(
            P, X, y=y
        )
    want = jax.vmap(jax.grad(_loss_broadcast), (None, 0, None))(P, X, y).sum(0)
    assert_close(got, want, terms=8)


def test_a_keyword_argument_left_whole_is_named_too():
    y = random_array(1, (8,), jnp.float32)
    with pytest.warns(UnsplitBatchWarning, match=r"`y` \(argument 2\) has 8 rows"):
        micro_grad(_loss_broadcast, batch_argnums=1, microbatch_size=4)(P, X, y=y)


def test_microbatch_warns_about_an_argument_its_argnums_leave_whole():
    """``microbatch`` alike, with the batch axis that ``in_axes`` gives (1 here)."""
    fun = lambda x, t: jnp.sum(x) * jnp.sum(t)  # noqa: E731
    xt, t = X.T, random_array(3, (8,), jnp.float32)
    with pytest.warns(
        UnsplitBatchWarning,
        match=r"^microbatch\(<lambda>\): `t` \(argument 1\) has 8 rows on axis 0, as the "
        r"batch has, but it is not a batch argument \(argnums=0\), so it "
        r"is passed whole to every example\. If it holds one entry per example, pass "
        r"argnums=\(0, 1\); if it is meant whole, pass whole_argnums=1 to say so\.$",
    ):
        got = microbatch(fun, 0, 4, in_axes=1)(xt, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = microbatch(fun, 0, 4, in_axes=1, whole_argnums=1)(xt, t)
        microbatch(fun, 0, 4, in_axes=1)(xt, t[:5])  # not the batch's size
    want = fun(xt, t)
    assert_close(got, want, terms=8)
    assert_close(again, want, terms=8)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: micro_grad(_loss_xy, batch_argnums=(1, 2), whole_argnums=2),
            ValueError,
            r"^whole_argnums names argument 2 \(`y`\), which batch_argnums=\(1, 2\) also "
            r"names as a batch argument to split into examples; name it in one of them\.$",
        ),
        (
            lambda: microbatch(_loss_xy, 1, 4, whole_argnums=1),
            ValueError,
            r"^whole_argnums names argument 1 \(`x`\), which argnums, argnames and in_axes "
            r"also names as a batch argument",
        ),
        (
            lambda: micro_grad(_loss_xy, whole_argnums=5),
            ValueError,
            r"^whole_argnums contains 5, out of range for _loss_xy\(p, x, y\) with 3 "
            r"positional parameter\(s\); use an index in \[-3, 3\)\.$",
        ),
        (
            lambda: micro_grad(_loss_xy, whole_argnums="y"),  # pyright: ignore[reportArgumentType]
            TypeError,
            r"^whole_argnums must be an int or a sequence of ints, got whole_argnums='y'\.$",
        ),
    ],
)
def test_bad_whole_argnums(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_argnums_taken_for_batch_argnums_warns_and_says_which_is_which():
    """A new user's mix-up: ``argnums=(1, 2)`` meant as the batch. ``y`` is then
    differentiated and passed whole; the warning says so and tells the two apart. A
    parameter whose axis 0 matches the batch (``argnums`` left at 0) is no sign of it."""
    y = random_array(1, (8,), jnp.float32)
    with pytest.warns(
        UnsplitBatchWarning,
        match=r"but `y` \(argument 2, which argnums=\(1, 2\) differentiates\) also has 8 "
        r"rows on axis 0 and is passed whole to every example\. If it holds one entry per "
        r"example, pass batch_argnums=\(1, 2\); if it is meant whole, pass batch_argnums=1 "
        r"or whole_argnums=2 to say so\. argnums names the arguments to differentiate, "
        r"batch_argnums those split into examples\.$",
    ):
        micro_grad(_loss_xy, argnums=(1, 2), microbatch_size=4)(P, X, y)
    tall = random_array(2, (8, 3), jnp.float32)  # 8 rows, as the batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        micro_grad(lambda p, x: jnp.sum(x @ p.T), microbatch_size=4)(tall, X)
        micro_grad(lambda p, x: jnp.sum(x @ p.T), batch_argnums=1, microbatch_size=4)(tall, X)


def test_a_warning_names_the_line_of_the_call_that_caused_it():
    """Found by a new user: warnings pointed into the library. Eager, or under ``jax.jit``
    (where JAX traces the step a few frames down), the warning is the caller's."""
    y = random_array(1, (8,), jnp.float32)
    for wrap in (lambda f: f, jax.jit):
        step = wrap(micro_grad(_loss_xy, microbatch_size=4))
        with pytest.warns(UserWarning, match="batch_argnums was left") as record:
            step(P, X, y)
        assert [w.filename for w in record] == [__file__]


def test_has_aux_false_with_a_pair_names_has_aux():
    with pytest.raises(
        TypeError,
        match=r"micro_grad needs fun to return a scalar loss, but it returned a tuple of 2; "
        r"if fun returns \(loss, aux\), pass has_aux=True\.",
    ):
        micro_grad(lambda p, v: (jnp.sum(v @ p), 1.0), microbatch_size=4)(P, X)


def test_has_aux_true_with_a_scalar_names_has_aux():
    with pytest.raises(
        TypeError,
        match=r"micro_grad was given has_aux=True, so fun must return a pair \(loss, aux\), "
        r"but it returned an array of shape \(\); return \(loss, aux\), or pass has_aux=False\.",
    ):
        micro_grad(lambda p, v: jnp.sum(v @ p), has_aux=True, microbatch_size=4)(P, X)


# --- found by trying to break the rules above ------------------------------------------

IDENTITY = {"transform_fn": lambda g: jax.tree.map(lambda x: x * 1, g)}  # forces per-example


@pytest.mark.parametrize("size", [None, 64])
def test_narrow_computation_of_wide_parameters_sums_in_float32(size):
    loss = lambda w, x: jnp.sum(w.astype(jnp.float16) * x.astype(jnp.float16)).astype(  # noqa: E731
        jnp.float32
    )
    x = jnp.full((128, 2), 1000.0, jnp.float32)  # each example's gradient is [1000, 1000]
    got, _ = micro_grad(loss, keep_batch_dim=False, microbatch_size=size)(jnp.ones(2), x)
    np.testing.assert_array_equal(np.asarray(got), 128000.0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_clip_factors_are_not_rounded_to_a_narrow_loss(dtype):
    loss = lambda w, x: jnp.sum(w.astype(dtype) * x.astype(dtype))  # noqa: E731
    x = jnp.asarray([[2.3261563, 1.5266447, 1.0413019, 2.5167572]], jnp.float32)
    got, _ = micro_grad(loss, keep_batch_dim=False, l2_clip_norm=1.0)(jnp.ones(4), x)
    want = np.asarray(x[0].astype(dtype), np.float64)
    want = want / np.linalg.norm(want)
    assert_close(got, want.astype(np.float32))


def test_iterative_linear_solve_with_clipping_equals_per_example_clipping():
    rng = np.random.default_rng(0)
    m = rng.normal(size=(6, 6))
    a = jnp.asarray(m @ m.T + 0.5 * np.eye(6), jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 6)) * 3, jnp.float32)
    w = jnp.asarray(rng.normal(size=6), jnp.float32)

    def loss(w, x):
        solved = jax.scipy.sparse.linalg.cg(lambda v: a @ v, x * w, tol=0.0, atol=0.5)[0]
        return jnp.sum(solved * x)

    want = _clip_rows(jax.vmap(jax.grad(loss), (None, 0))(w, x), 0.3).sum(0)
    got, _ = micro_grad(loss, keep_batch_dim=False, microbatch_size=4, l2_clip_norm=0.3)(w, x)
    assert_close(got, want.astype(np.float32), terms=8, factor=10)  # an iterative solve


def test_norms_above_two_to_the_126_are_not_flushed_to_zero():
    from microbatching import _clipping

    assert_close(_clipping.norm(jnp.array([9e37, 1.0], jnp.float32)), np.float32(9e37))


def test_eager_call_sees_a_numpy_array_changed_in_place_inside_a_nested_jit():
    table = np.asarray(np.random.default_rng(1).normal(size=(3, 20000)), np.float32)
    fun = lambda x: jnp.sum(jax.jit(lambda y: y @ table)(x))  # noqa: E731
    wrapped = microbatch(fun, 0, 4)
    assert_close(wrapped(X), fun(X), factor=100)
    table += 1.0
    assert_close(wrapped(X), fun(X), factor=100)


def test_eager_call_follows_the_prng_configuration():
    key = jax.random.key(0)
    fun = lambda x: jnp.sum(x * jax.random.normal(key, (4, 3)))  # noqa: E731
    wrapped = microbatch(fun, 0, 4)
    x = jnp.ones((8, 3))
    try:
        for partitionable in (True, False):
            jax.config.update("jax_threefry_partitionable", partitionable)
            assert_close(wrapped(x), fun(x[0::2]) + fun(x[1::2]))
    finally:
        jax.config.update("jax_threefry_partitionable", True)


def test_eager_call_with_a_typed_key_inside_a_nested_jit():
    key = jax.random.key(0)
    fun = lambda x: jnp.sum(jax.jit(lambda y: y * jax.random.normal(key, (1, 3)))(x))  # noqa: E731
    assert_close(microbatch(fun, 0, 4)(X), fun(X))


def test_programs_naming_objects_by_identity_are_not_kept():
    weights = {"w": jnp.ones(3)}
    fun = lambda x: jnp.sum(jax.jit(lambda y: y @ weights["w"])(x))  # noqa: E731
    wrapped = microbatch(fun, 0, 4)
    assert_close(wrapped(X), fun(X))
    first = weakref.ref(weights["w"])
    for scale in (2.0, 3.0):
        weights["w"] = jnp.full_like(weights["w"], scale)
        assert_close(wrapped(X), fun(X))
    gc.collect()
    assert first() is None  # no compiled program holds the first array


def test_second_eager_call_of_a_model_with_nested_jits_compiles_nothing():
    def loss(w, x, y):
        logits = x @ w
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]  # a nested jit
        return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)

    grads = micro_grad(loss, batch_argnums=(1, 2), microbatch_size=4, l2_clip_norm=1.0)
    w, y = random_array(2, (3, 5), jnp.float32), jnp.arange(8) % 5
    first = grads(w, X, y)
    with Compiles() as compiles:
        second = grads(w, X, y)
    assert compiles.count == 0
    assert_close(second, first)


def test_shape_dtype_structs_inside_a_transformation_are_refused():
    fun = microbatch(lambda p, x: jnp.sum(x @ p), 1, 4)
    with pytest.raises(
        TypeError,
        match=r"called on jax\.ShapeDtypeStruct arguments inside a JAX transformation "
        r"\(jax\.grad, jax\.vmap, \.\.\.\), which needs arrays",
    ):
        jax.grad(fun)(P, jax.ShapeDtypeStruct((8, 3), jnp.float32))


def test_a_loss_that_is_not_an_array_names_the_fix():
    with pytest.raises(
        TypeError,
        match=r"micro_grad needs fun to return a scalar loss \(the first of the pair, with "
        r"has_aux=True\), but it is a dict; return the loss as a scalar array, then aux: "
        r"\(loss, aux\)\.",
    ):
        micro_grad(lambda p, v: ({"a": 1.0}, jnp.sum(v @ p)), has_aux=True, microbatch_size=4)(P, X)


def test_integer_parameters_get_jax_grad_s_message():
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        micro_grad(lambda p, v: jnp.sum(v @ p), microbatch_size=4)(jnp.ones(3, jnp.int32), X)


def test_a_keyword_only_argument_is_not_told_to_go_by_position():
    def loss(p, v, *, scale):
        return jnp.sum(v @ p) * scale

    with pytest.raises(
        TypeError,
        match=r"but `scale` is 2\.0, not an array with a batch axis; bind it with "
        r"functools\.partial\.",
    ):
        micro_grad(loss, microbatch_size=4)(P, X, scale=2.0)


def test_eager_call_reads_what_a_custom_accumulator_closes_over():
    scale = [1.0]
    accumulator = Accumulator(
        init=lambda s: jnp.zeros(s.shape, s.dtype),
        update=lambda c, v, i: c + v * scale[0],
        finalize=lambda c: c,
        aggregate=lambda v: v.sum(0),
    )
    total = microbatch(jnp.sum, 0, 2, accumulator=accumulator)
    x = jnp.arange(8.0)
    assert_close(total(x), jnp.sum(x))
    scale[0] = 10.0
    assert_close(total(x), 10 * jnp.sum(x))


@pytest.mark.parametrize("kind", [SUM, AccumulationType.MAX])
def test_a_reduced_result_of_another_shape_on_the_remainder_is_an_error(kind):
    with pytest.raises(
        ValueError,
        match=r"fun returned a leaf of shape \(1,\) on the last, partial microbatch but "
        r"\(2,\) on the others, and a (SUM|MAX) accumulator needs one shape",
    ):
        microbatch(lambda x: x, 0, 2, kind, allow_remainder=True)(jnp.arange(5.0))


def test_the_mean_gradient_of_an_empty_batch_is_nan_not_an_error():
    """Just outside the seed's condition: no rows, no 1 / rows (the mean of nothing)."""
    empty = jnp.ones((0, 3), jnp.float32)
    for size in (None, 2):
        got, _ = micro_grad(clipped_loss, microbatch_size=size, accumulator=MEAN)(P, empty)
        assert np.all(np.isnan(np.asarray(got)))
