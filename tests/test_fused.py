"""``microbatch(..., fused_gradient=True)``: gradients taken in the forward loop.

References: ``jax.value_and_grad`` of the function on the whole batch, and JAX's own
Hessian-vector products.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from microbatching import AccumulationType, microbatch

from .strategies import assert_close, microbatch_sizes, random_array
from .test_convs import cnn, cnn_loss, compiled, other_order_convs  # noqa: F401

SUM, MEAN, RUNNING_MEAN = (
    AccumulationType.SUM,
    AccumulationType.MEAN,
    AccumulationType.RUNNING_MEAN,
)


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    return jnp.mean((h @ params["w2"] - y) ** 2)


@pytest.fixture(scope="module")
def data():
    params = {
        "w1": random_array(0, (5, 7), jnp.float32),
        "b1": random_array(1, (7,), jnp.float32),
        "w2": random_array(2, (7, 2), jnp.float32),
    }
    return params, random_array(3, (12, 5), jnp.float32), random_array(4, (12, 2), jnp.float32)


@pytest.mark.parametrize("accumulator", [SUM, MEAN, RUNNING_MEAN])
@pytest.mark.parametrize("jit", [True, False])
def test_value_and_grad_equals_the_whole_batch(data, accumulator, jit):
    params, x, y = data
    fused = microbatch(mlp_loss, (1, 2), 4, accumulator, fused_gradient=True)
    step = jax.value_and_grad(fused)
    got = (jax.jit(step) if jit else step)(params, x, y)
    scale = 3.0 if accumulator is SUM else 1.0  # SUM adds 3 microbatch means
    want = jax.value_and_grad(lambda *a: scale * mlp_loss(*a))(params, x, y)
    assert_close(got, want, terms=3)
    assert_close(fused(params, x, y), want[0], terms=3)  # not differentiated: the plain loop


@settings(max_examples=15, deadline=None)
@given(
    st.integers(1, 12).flatmap(lambda b: st.tuples(st.just(b), microbatch_sizes(b))),
    st.integers(0, 1),
    st.sampled_from([SUM, MEAN]),
    st.integers(0, 2**16),
)
def test_any_batch_axis_and_microbatch_size(rows_and_size, axis, accumulator, seed):
    rows, size = rows_and_size
    w = random_array(seed, (3, 2), jnp.float32)
    x = random_array(seed + 1, (rows, 3) if axis == 0 else (3, rows), jnp.float32)

    def loss(w, x):
        rows_first = x if axis == 0 else x.T
        return jnp.mean(jnp.sin(rows_first @ w))

    fused = microbatch(loss, 1, size, accumulator, in_axes=axis, fused_gradient=True)
    scale = rows // size if accumulator is SUM else 1
    want = jax.value_and_grad(lambda w, x: scale * loss(w, x))(w, x)
    assert_close(jax.jit(jax.value_and_grad(fused))(w, x), want, terms=rows // size)


def test_remainder_weights_microbatches_by_rows(data):
    params, x, y = data
    x, y = x[:10], y[:10]
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, allow_remainder=True, fused_gradient=True)
    want = jax.value_and_grad(mlp_loss)(params, x, y)
    assert_close(jax.jit(jax.value_and_grad(fused))(params, x, y), want, terms=3)


def test_several_scalar_outputs_and_aux(data):
    """Each floating scalar output gets its own gradient; integer outputs none."""
    params, x, y = data

    def two(params, x, y):
        loss = mlp_loss(params, x, y)
        return loss, (jnp.sum(params["w1"]) * jnp.mean(x), jnp.int32(x.shape[0]))

    fused = microbatch(two, (1, 2), 4, (MEAN, (MEAN, SUM)), fused_gradient=True)
    got = jax.jit(jax.value_and_grad(fused, has_aux=True))(params, x, y)
    loss, grads = jax.value_and_grad(two, has_aux=True)(params, x, y)
    want = ((loss[0], (loss[1][0], 12)), grads)
    assert_close(got, want, terms=3)
    mixed = jax.grad(lambda p: (lambda o: 2 * o[0] - 3 * o[1][0])(fused(p, x, y)))
    want_mixed = jax.grad(lambda p: (lambda o: 2 * o[0] - 3 * o[1][0])(two(p, x, y)))
    assert_close(jax.jit(mixed)(params), want_mixed(params), terms=3)


def test_bfloat16_parameters_accumulate_in_float32(data):
    params, x, y = data
    low = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    got = jax.jit(jax.grad(fused))(low, x, y)
    want = jax.grad(mlp_loss)(low, x, y)
    assert jax.tree.map(lambda g: g.dtype, got) == jax.tree.map(lambda g: g.dtype, low)
    assert_close(got, want, dtype=jnp.bfloat16, terms=3)


def test_hessian_vector_products_and_second_derivatives(data):
    """jvp and grad of the gradient differentiate the forward loop: exact, not refused."""
    params, x, y = data
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    tangent = jax.tree.map(jnp.ones_like, params)
    got = jax.jvp(jax.grad(fused), (params, x, y), (tangent, jnp.zeros_like(x), jnp.zeros_like(y)))
    want = jax.jvp(
        jax.grad(mlp_loss), (params, x, y), (tangent, jnp.zeros_like(x), jnp.zeros_like(y))
    )
    assert_close(got, want, terms=3, factor=4)
    second = jax.grad(
        lambda s: jax.grad(fused)(jax.tree.map(lambda p: s * p, params), x, y)["b1"][0]
    )
    want_second = jax.grad(
        lambda s: jax.grad(mlp_loss)(jax.tree.map(lambda p: s * p, params), x, y)["b1"][0]
    )
    assert_close(second(1.5), want_second(1.5), terms=3, factor=4)


def test_hessian_of_a_fused_function(data):
    """Each order of differentiation calls the forward rule with its own inputs; each
    backward rule reads its own (carried in the residuals' structure)."""
    params, x, y = data
    w1 = params["w1"]
    fused = microbatch(
        lambda w, x, y: mlp_loss({**params, "w1": w}, x, y), (1, 2), 4, MEAN, fused_gradient=True
    )
    want = jax.hessian(lambda w: mlp_loss({**params, "w1": w}, x, y))(w1)
    assert_close(jax.jit(jax.hessian(fused))(w1, x, y), want, terms=3, factor=4)


def test_vmap_over_parameters(data):
    params, x, y = data
    stacked = jax.tree.map(lambda p: jnp.stack([p, -p]), params)
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    got = jax.jit(jax.vmap(jax.grad(fused), (0, None, None)))(stacked, x, y)
    want = jax.vmap(jax.grad(mlp_loss), (0, None, None))(stacked, x, y)
    assert_close(got, want, terms=3)


def test_static_and_integer_arguments_pass_through(data):
    params, x, y = data

    def loss(params, x, y, scale, squared):
        err = x @ params["w1"] @ params["w2"] - y
        return scale * jnp.mean(err**2 if squared else jnp.abs(err))

    fused = microbatch(loss, (1, 2), 4, MEAN, fused_gradient=True)
    for squared in (True, False):
        got = jax.grad(fused)(params, x, y, jnp.int32(3), squared)
        assert_close(got, jax.grad(loss)(params, x, y, 3, squared), terms=3)


@pytest.mark.compiled
def test_the_gradient_is_one_loop_with_convolutions_in_eigen_order(cnn):  # noqa: F811
    """The default runs a second, transposed loop; the fused gradient is the loop of
    value_and_grad, its convolutions in Eigen's order."""
    p, x, y = cnn
    default = jax.value_and_grad(microbatch(cnn_loss, (1, 2), 8, MEAN))
    fused = jax.value_and_grad(microbatch(cnn_loss, (1, 2), 8, MEAN, fused_gradient=True))
    default_hlo, fused_hlo = compiled(default, p, x, y), compiled(fused, p, x, y)
    assert len(re.findall(r"\bwhile\(", default_hlo)) == 2
    assert len(re.findall(r"\bwhile\(", fused_hlo)) == 1
    assert other_order_convs(fused_hlo) == []
    assert_close(jax.jit(fused)(p, x, y), jax.value_and_grad(cnn_loss)(p, x, y), terms=4)


def test_forward_mode_of_the_function_names_the_option(data):
    params, x, y = data
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    with pytest.raises(TypeError, match=r"fused_gradient=True computes the gradient .* reverse"):
        jax.jvp(lambda p: fused(p, x, y), (params,), (params,))


def test_forward_mode_under_jit_is_refused_by_jax_s_own_error(data):
    """Under jit JAX raises it when the program runs, after the library's call has
    returned (documented with the option)."""
    params, x, y = data
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\) to a custom_vjp"):
        jax.jit(lambda p: jax.jvp(lambda p: fused(p, x, y), (p,), (p,)))(params)


def test_forward_mode_that_reaches_no_input_runs(data):
    """Just outside the refusal: a jvp around the call whose tangent the inputs do not carry."""
    params, x, y = data
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    got = jax.jvp(lambda s: s * fused(params, x, y), (2.0,), (1.0,))
    loss = mlp_loss(params, x, y)
    assert_close(got, (2 * loss, loss), terms=3)


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_a_type_error_of_fun_is_its_own_whatever_its_text(data, mode):
    """The refusal is told by forward mode reaching the inputs after the forward rule
    returned, not by an error's text: fun's own TypeError, raised in the loop, passes."""
    params, x, y = data
    calls = []

    def fails_in_the_loop(params, x, y):  # the first trace finds closed-over values
        calls.append(None)
        if len(calls) > 1:
            raise TypeError("fun's own: forward-mode")
        return mlp_loss(params, x, y)

    fused = microbatch(fails_in_the_loop, (1, 2), 4, MEAN, fused_gradient=True)
    run = {
        "grad": lambda: jax.grad(fused)(params, x, y),
        "jvp": lambda: jax.jvp(lambda p: fused(p, x, y), (params,), (params,)),
    }[mode]
    with pytest.raises(TypeError, match=r"^fun's own: forward-mode"):
        run()


@pytest.mark.parametrize("accumulator", [AccumulationType.MAX, AccumulationType.CONCAT])
def test_accumulators_that_do_not_commute_with_gradients_are_refused(accumulator):
    with pytest.raises(ValueError, match=r"fused_gradient=True .* only the gradient .* SUM, MEAN"):
        microbatch(mlp_loss, (1, 2), 4, accumulator, fused_gradient=True)


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_gradient_with_respect_to_a_batch_argument_is_refused(data, mode):
    """Forward mode with a tangent on the batch reaches the same check as reverse mode
    (the custom rule's forward pass cannot tell them apart): its message names both."""
    params, x, y = data
    fused = microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient=True)
    with pytest.raises(
        ValueError,
        match=r"this derivative is with respect to batch argument `x` \(jax\.grad or "
        r"jax\.vjp with respect to it, or a jax\.jvp tangent on it\)\. Differentiate with "
        r"respect to the parameters only, or drop fused_gradient=True \(forward mode of "
        r"the microbatched function needs it dropped in any case\)\.",
    ):
        if mode == "grad":
            jax.grad(fused, argnums=1)(params, x, y)
        else:
            jax.jvp(lambda x: fused(params, x, y), (x,), (jnp.ones_like(x),))


def test_differentiating_a_non_scalar_output_is_refused(data):
    params, x, _ = data
    per_row = microbatch(lambda p, x: x @ p["w1"], 1, 4, SUM, fused_gradient=True)
    with pytest.raises(
        ValueError, match=r"scalar floating outputs only, and this one is float32\[4,7\]"
    ):
        jax.grad(lambda p: jnp.sum(per_row(p, x[:4])))(params)


def test_fused_gradient_must_be_a_bool():
    with pytest.raises(TypeError, match="fused_gradient"):
        microbatch(mlp_loss, (1, 2), 4, MEAN, fused_gradient="yes")  # pyright: ignore[reportArgumentType]


def test_no_microbatching_is_the_plain_function(data):
    params, x, y = data
    plain = microbatch(mlp_loss, (1, 2), None, MEAN, fused_gradient=True)
    assert_close(jax.grad(plain)(params, x, y), jax.grad(mlp_loss)(params, x, y))
    np.testing.assert_array_equal(plain(params, x, y), mlp_loss(params, x, y))


@pytest.mark.parametrize("jit", [True, False])
def test_fun_closing_over_the_differentiated_values(data, jit):
    """The usual spelling: the parameters closed over, only the batch passed."""
    params, x, y = data

    def outer(params, scale):
        fused = microbatch(
            lambda x, y: scale * mlp_loss(params, x, y), (0, 1), 4, MEAN, fused_gradient=True
        )
        return fused(x, y)

    step = jax.value_and_grad(outer, argnums=(0, 1))
    got = (jax.jit(step) if jit else step)(params, 2.0)
    want = jax.value_and_grad(lambda p, s: s * mlp_loss(p, x, y), argnums=(0, 1))(params, 2.0)
    assert_close(got, want, terms=3)


def test_outputs_with_none_and_lists(data):
    params, x, y = data
    cases = {
        "(loss, None)": lambda *a: (mlp_loss(*a), None),
        "[loss, loss**2]": lambda *a: [mlp_loss(*a), mlp_loss(*a) ** 2],
        "(loss, [mean x])": lambda *a: (mlp_loss(*a), [jnp.mean(a[1]) * jnp.sum(a[0]["w2"])]),
    }
    for fun in cases.values():
        # The reference is the default microbatch: a mean of squares is not the square
        # of the whole batch's mean.
        fused = microbatch(fun, (1, 2), 4, MEAN, fused_gradient=True)
        default = microbatch(fun, (1, 2), 4, MEAN)

        def total(f):
            return lambda p: sum(2.0 * leaf for leaf in jax.tree.leaves(f(p, x, y)))

        got = jax.jit(jax.grad(total(fused)))(params)
        assert_close(got, jax.grad(total(default))(params), terms=3, factor=2)


@pytest.mark.compiled
def test_inside_shard_map_the_gradient_of_a_replicated_parameter_is_summed_once(data):
    """Each device accumulates its own rows' gradient; the backward rule adds them up,
    as jax.grad does for a replicated input, with one all-reduce after the loop."""
    params, x, y = data
    mesh = jax.make_mesh((4,), ("b",), axis_types=(AxisType.Explicit,))

    def per_device(fused):
        def step(params, x, y):
            return jax.grad(microbatch(mlp_loss, (1, 2), 1, SUM, fused_gradient=fused))(
                params, x, y
            )

        return jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P(), P("b"), P("b")), out_specs=P())
        )

    rows, replicated = NamedSharding(mesh, P("b")), NamedSharding(mesh, P())
    args = (jax.device_put(params, replicated), jax.device_put(x, rows), jax.device_put(y, rows))
    want = jax.grad(lambda *a: 12 * mlp_loss(*a))(params, x, y)  # 12 rows, each a mean of 1
    got = per_device(True)(*args)
    assert_close(got, want, terms=12)
    assert_close(got, per_device(False)(*args), terms=12)
    hlo = str(per_device(True).lower(*args).compile().as_text())
    assert "all-reduce" in hlo


def test_example_weights_on_a_fused_microbatch_name_the_transforms_that_take_them():
    """``fused_gradient=True`` traces ``fun`` with the call's keywords before the loop;
    the call is checked first, as without it (breaker round 24)."""
    fused = microbatch(lambda w, x: jnp.mean((x @ w) ** 2), 1, 4, MEAN, fused_gradient=True)
    with pytest.raises(
        TypeError,
        match=r"<lambda>\(w, x\) was called with example_weights=, which microbatch passes "
        r"on to fun, and fun has no such parameter; per-example weights are a keyword of "
        r"the functions that micro_vmap and micro_grad return\.",
    ):
        fused(jnp.ones(3), jnp.ones((8, 3)), example_weights=jnp.ones(8))  # pyright: ignore[reportCallIssue]
