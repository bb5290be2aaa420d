"""Unknown is exact: the primitive table, and the programs it does not know.

Every case is checked against JAX's own per-example gradients (``vmap(grad)``, clipped
and summed), in values and in derivatives through the result: reverse (``jax.grad``),
forward (``jax.jvp``) and forward-over-reverse. A method that cannot read a program
exactly refuses it by name, with why; ``auto`` takes an exact one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Primitive
from jax.extend.core import primitives as prims
from jax.interpreters import ad, batching, mlir

import microbatching
from microbatching import _primitives
from microbatching._xla_cpu import convs as _convs
from microbatching._xla_cpu import dots as _dots
from microbatching._xla_cpu import squeeze as _squeeze

from .strategies import assert_close

C = 0.1
BATCH, MICRO = 8, 4


# --- user derivative rules ------------------------------------------------------------


@jax.custom_vjp
def _squared_cotangent(x):
    return x


_squared_cotangent.defvjp(lambda x: (x, None), lambda _, c: (c * jnp.abs(c),))


def _fused_forward(w, x):
    y = jnp.tanh(x @ w)
    return y, (w, x, y)


def _fused_backward(limit, residuals, c):
    w, x, y = residuals
    c = c * (1 - y**2)
    if limit is not None:
        c = jnp.clip(c, -limit, limit)
    return jnp.outer(x, c), c @ w.T


@jax.custom_vjp
def _fused(w, x):  # a layer written as one custom_vjp of the weight and the data
    return jnp.tanh(x @ w)


_fused.defvjp(_fused_forward, lambda r, c: _fused_backward(None, r, c))


@jax.custom_vjp
def _fused_clipped(w, x):  # its backward rule clips the cotangent
    return jnp.tanh(x @ w)


_fused_clipped.defvjp(_fused_forward, lambda r, c: _fused_backward(0.05, r, c))


@jax.custom_jvp
def _straight_through(x, w):  # a quantised product whose derivative is the plain one's
    return (jnp.round(4 * x) / 4) @ (jnp.round(4 * w) / 4)


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return _straight_through(x, w), dx @ w + x @ dw


# --- a primitive the engine has never seen ----------------------------------------------

_scaled_p = Primitive("microbatching_test_scaled")
"""``x * w`` elementwise, with its own JVP, transpose and batching rules."""
_scaled_p.def_impl(lambda x, w: x * w)
_scaled_p.def_abstract_eval(lambda x, w: x)
ad.defbilinear(_scaled_p, lambda ct, _, w: _scaled_p.bind(ct, w),
               lambda ct, x, _: _scaled_p.bind(x, ct))  # fmt: skip


def _scaled_batched(args, dims):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    x, w = (
        jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
        for a, d in zip(args, dims, strict=True)
    )
    return _scaled_p.bind(x, w), 0


batching.primitive_batchers[_scaled_p] = _scaled_batched
mlir.register_lowering(_scaled_p, mlir.lower_fun(lambda x, w: x * w, multiple_results=False))


def _remat_of_custom_vjp(w, x):
    return jax.checkpoint(lambda w, x: jnp.sum(_squared_cotangent(jnp.tanh(x @ w))))(w, x)


def _custom_vjp_on_weight(w, x):
    return jnp.sum(jnp.tanh(x @ _squared_cotangent(w)))


def _fused_layer(w, x):
    return jnp.sum(jnp.sin(_fused(w, x)))


def _fused_clipped_layer(w, x):
    return jnp.sum(jnp.sin(_fused_clipped(w, x * 0.1)))


def _straight_through_layer(w, x):
    return jnp.sum(jnp.sin(_straight_through(x, w)))


def _unknown_at_site(w, x):  # the weight's first row times the data, elementwise
    return jnp.sum(jnp.tanh(_scaled_p.bind(jnp.broadcast_to(x[:3], (3,)), w[0])))


CASES = {
    "checkpoint of a custom_vjp with c|c|": _remat_of_custom_vjp,
    "custom_vjp on the weight": _custom_vjp_on_weight,
    "fused custom_vjp layer": _fused_layer,
    "fused layer clipping its cotangent": _fused_clipped_layer,
    "straight-through custom_jvp": _straight_through_layer,
    "unknown primitive at a site": _unknown_at_site,
}

REFUSED = {  # what the explicit ghost method says of each
    "checkpoint of a custom_vjp with c|c|": "the loss holds custom_vjp_call",
    "custom_vjp on the weight": "the loss holds custom_vjp_call",
    "fused custom_vjp layer": "the loss holds custom_vjp_call",
    "fused layer clipping its cotangent": "the loss holds custom_vjp_call",
    "straight-through custom_jvp": "a parameter meets the data inside custom_jvp_call",
    "unknown primitive at a site": "the loss holds microbatching_test_scaled",
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(BATCH, 4)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=BATCH), jnp.float32)
    return w, x, weights


def _reference(loss, w, x, weights):
    g = jax.vmap(jax.grad(loss), (None, 0))(w, x)
    norms = jnp.sqrt(jnp.sum(g**2, axis=(1, 2)))
    factors = jnp.minimum(1, C / norms) * weights
    return jnp.einsum("b,bij->ij", factors, g)


def _ours(loss, method, weighted):
    fn = microbatching.micro_grad(
        loss, batch_argnums=1, keep_batch_dim=False, microbatch_size=MICRO,
        l2_clip_norm=C, clip_method=method,
    )  # fmt: skip

    def run(w, x, weights):
        kwargs = {"example_weights": weights} if weighted else {}
        return fn(w, x, **kwargs)[0]

    return run


def _through(f, x, weights):
    """A scalar of the clipped sum, for derivatives through it."""
    return lambda w: jnp.sum(jnp.sin(f(w, x, weights)))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name", CASES)
def test_user_rules_and_unknown_primitives_are_exact_on_auto(name, weighted, data):
    w, x, given = data
    loss = CASES[name]
    weights = given if weighted else jnp.ones_like(given)
    want = _reference(loss, w, x, weights)
    ours = _ours(loss, "auto", weighted)
    assert_close(ours(w, x, given), want, terms=BATCH)
    reference = lambda v, x, b: _reference(loss, v, x, b)  # noqa: E731
    grad = jax.grad(_through(ours, x, given))(w)
    assert_close(grad, jax.grad(_through(reference, x, weights))(w), terms=BATCH)
    if name == "checkpoint of a custom_vjp with c|c|" and getattr(jax.config, "jax_remat3", False):
        return  # JAX's own forward mode refuses the reference there
    tangent = jnp.ones_like(w)
    _, got = jax.jvp(lambda v: ours(v, x, given), (w,), (tangent,))
    _, expected = jax.jvp(lambda v: _reference(loss, v, x, weights), (w,), (tangent,))
    assert_close(got, expected, terms=BATCH)


@pytest.mark.parametrize("name", CASES)
def test_methods_that_cannot_read_a_program_refuse_it_by_name(name, data):
    w, x, weights = data
    with pytest.raises(
        ValueError,
        match=f"clip_method='ghost', but the ghost norms cannot read this loss: ({REFUSED[name]})",
    ):
        _ours(CASES[name], "ghost", False)(w, x, weights)


def test_a_forward_over_reverse_derivative_through_a_user_rule_equals_jax(data):
    w, x, weights = data
    ours = _ours(_fused_layer, "auto", True)
    direction = jnp.full_like(w, 0.5)

    def hvp(f):
        return jax.jvp(jax.grad(_through(f, x, weights)), (w,), (direction,))[1]

    assert_close(hvp(ours), hvp(lambda v, x, b: _reference(_fused_layer, v, x, b)), terms=BATCH)


def test_an_unknown_primitive_in_a_transform_takes_the_per_example_path(data):
    w, x, weights = data
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    transform = lambda g: _scaled_p.bind(g, g)  # noqa: E731
    fn = microbatching.micro_grad(
        loss, batch_argnums=1, keep_batch_dim=False, microbatch_size=MICRO,
        transform_fn=transform,
    )  # fmt: skip
    report = microbatching.clipping_report(fn, w, x, example_weights=weights)
    assert report.method == "materialize"
    g = jax.vmap(jax.grad(loss), (None, 0))(w, x)
    assert_close(fn(w, x, example_weights=weights)[0],
                 jnp.einsum("b,bij->ij", weights, g * g), terms=BATCH)  # fmt: skip


def test_the_table_knows_jax_primitives_and_nothing_else():
    jaxpr = jax.make_jaxpr(lambda w, x: jnp.sum(jax.lax.stop_gradient(x) @ w))(
        jnp.ones((3, 2)), jnp.ones((4, 3))
    ).jaxpr
    known = {e.primitive.name: _primitives.facts(e) for e in jaxpr.eqns}
    assert known["dot_general"].bilinear and known["dot_general"].derived
    assert known["stop_gradient"].no_gradient if "stop_gradient" in known else True
    assert known["reduce_sum"].derived and not known["reduce_sum"].user_code
    unknown = jax.make_jaxpr(lambda a: _scaled_p.bind(a, a))(jnp.ones(3)).jaxpr.eqns[0]
    assert _primitives.facts(unknown) == _primitives.Facts(name="microbatching_test_scaled")
    assert _primitives.not_linear(jax.make_jaxpr(lambda a: _scaled_p.bind(a, a))(jnp.ones(3)).jaxpr)
    vjp = jax.make_jaxpr(_custom_vjp_on_weight)(jnp.ones((4, 3)), jnp.ones(4)).jaxpr
    found = _primitives.user_code(vjp)
    assert found is not None and found.user_code
    relu = jax.make_jaxpr(lambda a: jnp.sum(jax.nn.relu(a)))(jnp.ones(3)).jaxpr
    assert _primitives.not_linear(relu) is None  # a custom_jvp: JAX transposes its rule


def test_a_checkpoint_and_eval_jaxpr_are_read_as_their_bodies(data):
    w, x, _ = data
    from jax._src.lax.eval_jaxpr import eval_jaxpr_p

    body = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(w, x[0])
    # jax 0.11 makes closed_call eval_jaxpr, whose body is then its `call_jaxpr`
    key = "call_jaxpr" if prims.closed_call_p is eval_jaxpr_p else "jaxpr"

    def called(w, x):
        return jnp.sum(eval_jaxpr_p.bind(w, x, **{key: body})[0])

    def checkpointed(w, x):
        return jax.checkpoint(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(w, x)

    for loss in (called, checkpointed):
        fn = microbatching.micro_grad(loss, batch_argnums=1, keep_batch_dim=False, l2_clip_norm=C)
        report = microbatching.clipping_report(fn, w, x)
        assert report.method == "ghost", report.reason
        assert [leaf.rule for leaf in report.leaves] == ["dense"]
        assert_close(fn(w, x)[0], _reference(loss, w, x, jnp.ones(BATCH)), terms=BATCH)


def test_a_weighted_custom_vjp_is_read_without_its_forward_mode(data):
    """The plain gradient's check reads the loss before its JVP: a JVP of a custom_vjp
    that no reverse pass encloses is JAX's error under JAX_CUSTOM_VJP3."""
    w, x, weights = data
    loss = _custom_vjp_on_weight
    fn = microbatching.micro_grad(loss, batch_argnums=1, keep_batch_dim=False)
    report = microbatching.clipping_report(fn, w, x, example_weights=weights)
    assert report.method == "materialize"
    assert "the loss holds custom_vjp_call" in report.reason
    g = jax.vmap(jax.grad(loss), (None, 0))(w, x)
    assert_close(fn(w, x, example_weights=weights)[0], jnp.einsum("b,bij->ij", weights, g),
                 terms=BATCH)  # fmt: skip


def _with_extra_param(eqn):
    return eqn.replace(params={**eqn.params, "from_a_newer_jax": 1})


def test_backend_rewrites_leave_equations_they_were_not_written_for():
    x, w = jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
    conv = jax.make_jaxpr(
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
    )(jnp.ones((2, 3, 5, 5)), jnp.ones((4, 3, 3, 3)))
    dot = jax.make_jaxpr(
        lambda a, b: jnp.swapaxes(jax.lax.dot_general(a, b, (((1,), (1,)), ((0,), (0,)))), 1, 2)
    )(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5)))
    reduce = jax.make_jaxpr(lambda a: jnp.sum(a, axis=2))(jnp.ones((4, 1, 3)))
    del x, w
    for program, rewrite in (
        (conv, _convs.canonical),
        (dot, _dots.swapped),
        (reduce, _squeeze.squeezed),
    ):
        assert all(_primitives.as_checked(e) for e in program.jaxpr.eqns if e.primitive in
                   (prims.conv_general_dilated_p, prims.dot_general_p, prims.reduce_sum_p))  # fmt: skip
        altered = program.jaxpr.replace(eqns=[_with_extra_param(e) for e in program.jaxpr.eqns])
        unknown = ClosedJaxpr(altered, program.consts)
        assert rewrite(unknown) is unknown
        assert not any(_primitives.as_checked(e) for e in altered.eqns)


def test_an_equation_the_table_does_not_hold_is_opaque():
    eqn = jax.make_jaxpr(lambda a: _scaled_p.bind(a, a))(jnp.ones(3)).jaxpr.eqns[0]
    assert _primitives.facts(eqn).derived is False
    assert _primitives.body(eqn) is None
    assert list(_primitives.sub_programs(eqn)) == []


@jax.custom_vjp
def _clipped_cotangent(w):
    return w


_clipped_cotangent.defvjp(lambda w: (w, None), lambda _, g: (jnp.clip(g, -0.3, 0.3),))

_PARAMETER_SIDE = {
    "custom_vjp on the weight": lambda w, x: jnp.sum(jnp.tanh(x @ _clipped_cotangent(w)) ** 2),
    "reduce_precision on the weight": lambda w, x: jnp.sum(
        jnp.tanh(x @ jax.lax.reduce_precision(w, exponent_bits=5, mantissa_bits=4)) ** 2
    ),
}


@pytest.mark.parametrize("microbatch_size", [None, 3])
@pytest.mark.parametrize("name", _PARAMETER_SIDE)
def test_an_unclipped_sum_through_a_rule_on_the_parameters_is_the_per_example_sum(
    name, microbatch_size
):
    """One backward pass of the summed loss passes the batch's summed cotangent through a
    rule on the parameters' side, once; each example's gradient passes its own. Neither
    rule is linear in its cotangent (a clip, a rounding), so the plain gradient is not
    the sum of the per-example gradients, weighted or not: the per-example path."""
    loss = _PARAMETER_SIDE[name]
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    fn = microbatching.micro_grad(loss, batch_argnums=1, keep_batch_dim=False,
                                  microbatch_size=microbatch_size)  # fmt: skip
    report = microbatching.clipping_report(fn, w, x)
    assert report.method != "plain", report.reason
    want = jnp.sum(jax.vmap(jax.grad(loss), (None, 0))(w, x), axis=0)
    assert_close(fn(w, x)[0], want, terms=6)
    with pytest.raises(
        ValueError,
        match=r"clip_method='two_pass'.*not exactly the weighted sum.*the loss holds (custom_vjp_call|reduce_precision)",
    ):
        microbatching.micro_grad(loss, batch_argnums=1, keep_batch_dim=False,
                                 l2_clip_norm=C, clip_method="two_pass")(w, x)  # fmt: skip


def test_a_clipped_sum_with_a_rounded_weight_takes_the_per_example_gradients(data):
    """``reduce_precision`` on a weight rounds each example's cotangent in its backward
    pass: the ghost engine, whose sums are not JAX's, stays out, and the values are
    ``vmap(grad)``'s. (A derivative through the result rounds the weight's cotangent
    once per microbatch, where ``vmap(grad)`` over the whole batch rounds it once: the
    microbatches are a different program there, as they would be written by hand.)"""
    w, x, weights = data
    loss = _PARAMETER_SIDE["reduce_precision on the weight"]
    fn = microbatching.micro_grad(loss, batch_argnums=1, keep_batch_dim=False,
                                  microbatch_size=MICRO, l2_clip_norm=C)  # fmt: skip
    report = microbatching.clipping_report(fn, w, x, example_weights=weights)
    assert report.method == "materialize"
    assert "the loss holds reduce_precision" in report.reason
    assert_close(fn(w, x, example_weights=weights)[0], _reference(loss, w, x, weights),
                 terms=BATCH)  # fmt: skip
