# pyright: reportArgumentType=false
# (the wrap-time checks below pass arguments of the wrong types on purpose)
"""Calling conventions, profiler spans, wrap-time checks and interoperability.

The calling conventions follow optax main: a keyword argument that names a positional
parameter of ``fun`` is that parameter, whichever way it is passed.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from microbatching import AccumulationType, Accumulator, l2_norm, micro_grad, micro_vmap, microbatch
from microbatching._batch_statistics import PROBE_ROWS

from .strategies import assert_close, random_array

SUM, MEAN, CONCAT = AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.CONCAT
A = random_array(0, (8, 3), jnp.float32)
B = random_array(1, (8, 3), jnp.float32)
B0 = random_array(2, (3,), jnp.float32)


def add(a, b):
    return a * 2 + b


@pytest.mark.parametrize(
    ("in_axes", "call", "want"),
    [
        ((0, 0), lambda f: f(A, B), A * 2 + B),
        ((0, 0), lambda f: f(A, b=B), A * 2 + B),
        ((0, 0), lambda f: f(a=A, b=B), A * 2 + B),
        ((0, 0), lambda f: f(b=B, a=A), A * 2 + B),
        ((0, None), lambda f: f(a=A, b=B0), A * 2 + B0[None]),
        ((None, 0), lambda f: f(a=B0, b=B), B0[None] * 2 + B),
        ((1, 1), lambda f: f(A.T, b=B.T), A * 2 + B),
        (0, lambda f: f(A, b=B), A * 2 + B),
    ],
)
@pytest.mark.parametrize("size", [None, 2])
def test_micro_vmap_binds_keywords_to_the_signature(in_axes, call, want, size):
    assert_close(call(micro_vmap(add, in_axes, microbatch_size=size)), want)


def test_micro_vmap_keywords_that_name_no_positional_parameter_are_mapped_on_axis_0():
    def scaled(a, *, scale):
        return a * scale

    got = micro_vmap(scaled, microbatch_size=2)(A, scale=B)
    assert_close(got, jax.vmap(scaled)(A, scale=B))


def test_micro_vmap_keyword_with_gap_keeps_its_parameter_axis():
    def three(a, b=None, c=None):
        return a + c

    got = micro_vmap(three, (0, None, 1), microbatch_size=4)(A, c=B.T)
    assert_close(got, A + B)


def loss(params, x):
    return jnp.sum(jnp.tanh(x @ params) ** 2)


W = random_array(3, (3, 2), jnp.float32)


@pytest.mark.parametrize(
    "call",
    [
        lambda f: f(W, A),
        lambda f: f(W, x=A),
        lambda f: f(params=W, x=A),
        lambda f: f(x=A, params=W),
    ],
)
@pytest.mark.parametrize("size", [None, 4])
@pytest.mark.parametrize("transform", [None, lambda g: g * 2])
def test_micro_grad_binds_keywords_to_the_signature(call, size, transform):
    kwargs = {} if transform is None else {"transform_fn": transform}
    grads, aux = call(micro_grad(loss, microbatch_size=size, **kwargs))
    per_example = jax.vmap(jax.grad(loss), (None, 0))(W, A[:, None])
    want = jnp.sum(per_example, 0) * (1 if transform is None else 2)
    assert_close(grads, want, terms=8)
    assert_close(aux.values, jax.vmap(loss, (None, 0))(W, A[:, None]))


def test_micro_grad_keep_batch_dim_expands_only_batch_arguments():
    shapes = []

    def spy(params, x, *, weight):
        shapes.append((x.shape, weight.shape))
        return jnp.sum(x @ params) * jnp.sum(weight)

    micro_grad(spy, microbatch_size=4)(W, A, weight=B)
    probe = ((PROBE_ROWS, 3), (3,))  # the trace that looks for batch statistics
    assert probe in shapes
    assert {s for s in shapes if s != probe} == {((1, 3), (3,))}


def test_microbatch_size_none_returns_the_call_of_fun_unchanged():
    calls = []

    def fun(x, *, flag=None):
        calls.append(flag)
        return x

    got = microbatch(fun, 0, None)(A, flag="anything")
    assert got is A and calls == ["anything"]


def _scopes(fun, *args) -> str:
    return jax.jit(fun).lower(*args).as_text(debug_info=True)


def test_profiler_spans_of_optax_and_ours():
    text = _scopes(microbatch(jnp.sum, 0, 2), A)
    assert "microbatch(sum)" in text and "microbatch_size_2" in text and "4_microbatches" in text
    text = _scopes(micro_vmap(jnp.sin, microbatch_size=4), A)
    for name in ["micro_vmap(sin)", "micro_vmap_size_4", "micro_vmap_step", "2_microbatches"]:
        assert name in text, name
    for transform in [None, lambda g: g]:
        kwargs = {} if transform is None else {"transform_fn": transform}
        text = _scopes(micro_grad(loss, microbatch_size=2, **kwargs), W, A)
        for name in ["micro_grad(loss)", "micro_grad_size_2", "micro_grad_step", "4_microbatches"]:
            assert name in text, name
    assert "micro_vmap_size_None" in _scopes(micro_vmap(jnp.sin), A)


@pytest.mark.x64
@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: micro_grad(loss, microbatch_size=0),
            ValueError,
            "microbatch_size must be a positive int, got microbatch_size=0",
        ),
        (
            lambda: micro_vmap(jnp.sin, microbatch_size=-1),
            ValueError,
            "microbatch_size must be a positive int",
        ),
        (
            lambda: micro_grad(loss, num_real_microbatches="a"),
            TypeError,
            "num_real_microbatches must be None, an int or an integer scalar array, got 'a'",
        ),
        (
            lambda: micro_vmap(jnp.sin, num_real_microbatches=-1),
            ValueError,
            "num_real_microbatches must be non-negative",
        ),
        (
            lambda: micro_grad(loss, argnums=()),
            ValueError,
            "argnums is empty, so there is nothing to differentiate; pass the position",
        ),
        (
            lambda: micro_grad(loss, argnums=2),
            ValueError,
            r"argnums contains 2, out of range for loss\(params, x\)",
        ),
        (
            lambda: micro_grad(loss, transform_fn=None),
            TypeError,
            "transform_fn must be callable, got transform_fn=None",
        ),
        (
            lambda: micro_grad(loss, metrics_fn=None),
            TypeError,
            "metrics_fn must be callable, got metrics_fn=None",
        ),
        (
            lambda: micro_vmap(jnp.sin, vmap_fn=None),
            TypeError,
            "vmap_fn must be callable, got vmap_fn=None",
        ),
        (
            lambda: micro_grad(loss, has_aux="yes"),
            TypeError,
            "has_aux must be a bool, got has_aux='yes' of type str",
        ),
        (
            lambda: micro_grad(loss, keep_batch_dim="no"),
            TypeError,
            "keep_batch_dim must be a bool, got keep_batch_dim='no'",
        ),
        (
            lambda: micro_grad(loss, accumulator="sum"),
            TypeError,
            "accumulator leaves must be AccumulationType or Accumulator, got 'sum'",
        ),
        (
            lambda: micro_vmap(add, (0, 0, 0)),
            ValueError,
            r"in_axes has 3 entries but add\(a, b\) takes 2 positional parameter",
        ),
        (
            lambda: micro_vmap(jnp.sin, accumulation_dtype=jnp.int32),
            ValueError,
            "accumulation_dtype must be a floating dtype",
        ),
        (
            lambda: micro_vmap(jnp.sin, accumulation_dtype="nope"),
            TypeError,
            "accumulation_dtype must be None or a floating dtype, got 'nope'",
        ),
        (
            lambda: micro_grad(loss, l2_clip_norm=0.0),
            ValueError,
            "l2_clip_norm must be positive and finite, got l2_clip_norm=0.0",
        ),
        (
            lambda: micro_grad(loss, l2_clip_norm="1"),
            TypeError,
            "l2_clip_norm must be a positive number or None, got l2_clip_norm='1'",
        ),
        (
            lambda: micro_vmap(jnp.sin, batch_mesh_axes=3),
            TypeError,
            "batch_mesh_axes must be a mesh axis name or a sequence of them, got batch_mesh_axes=3",
        ),
        (
            lambda: Accumulator(None, None, None, None),
            TypeError,
            "Accumulator.init must be callable, got init=None",
        ),
    ],
)
def test_every_transform_checks_its_arguments_when_wrapping(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_mismatched_batch_sizes_name_the_users_parameters():
    def two(params, x, y):
        return jnp.sum(x @ params) + jnp.sum(y)

    message = (
        r"Batch arguments of two must have equal batch sizes, got \[8, 6\]: `x` axis 0 of "
        r"shape \(8, 3\); `y` axis 0 of shape \(6,\). Fix the shapes, or the batch axes "
        r"\(batch_argnums=\(1, 2\)\)."
    )
    with pytest.raises(ValueError, match=message):
        micro_grad(two, batch_argnums=(1, 2), microbatch_size=2)(W, A, jnp.ones(6))
    with pytest.raises(ValueError, match=r"equal batch sizes.*\(in_axes=\(None, 0, 0\)\)"):
        micro_vmap(two, (None, 0, 0), microbatch_size=2)(W, A, jnp.ones(6))


def test_a_bound_below_the_smallest_normal_number_is_refused_when_traced():
    """Found by a breaker: XLA flushes a subnormal bound to 0, and an example whose
    gradient is 0 then made the whole sum NaN."""
    fn = micro_grad(lambda w, x: jnp.sum(x @ w), microbatch_size=2, l2_clip_norm=1e-40)
    message = (
        r"l2_clip_norm holds 1e-40, below float32's smallest normal number 1.175e-38, in "
        r"which the norms are computed: XLA may flush it to 0, and an example whose "
        r"gradient is 0 would then make the sum NaN. Pass a bound of at least 1.175e-38, "
        r"scaling the loss by a power of two if you need a smaller one."
    )
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(fn, W, A)


def test_a_bound_beyond_the_largest_number_is_refused_and_one_just_inside_is_kept():
    """1e39 is a finite Python float that rounds to inf in float32, where the norms are
    computed: it used to clip nothing without a word (round 6 of the hostile tests)."""
    fn = micro_grad(lambda w, x: jnp.sum(x @ w), microbatch_size=2, l2_clip_norm=1e39)
    message = (
        r"l2_clip_norm holds 1e\+39, above float32's largest number 3.403e\+38, in which the "
        r"norms are computed: it would round to inf and clip nothing. Pass a bound of at "
        r"most 3.403e\+38, or leave l2_clip_norm out to sum the gradients unclipped."
    )
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(fn, W, A)
    inside = micro_grad(lambda w, x: jnp.sum(x @ w), microbatch_size=2, l2_clip_norm=3e38)
    grads, _ = inside(W, A)
    assert_close(grads, jax.grad(lambda w: jnp.sum(A @ w))(W))


def test_missing_batch_argument_of_micro_grad_names_it():
    with pytest.raises(
        TypeError,
        match=r"batch_argnums includes 1, but loss was called with 1 positional argument\(s\) and no keyword argument `x`",
    ):
        micro_grad(loss, microbatch_size=2)(W)


def test_missing_differentiated_argument_of_micro_grad_is_a_type_error():
    # The plan of the call leaves it to the call of fun: jax.grad names the argnums.
    def xy(w, x, y):
        return jnp.sum((x @ w - y) ** 2)

    with pytest.raises(TypeError, match=r"differentiating with respect to argnums=0"):
        micro_grad(xy, batch_argnums=(1, 2), l2_clip_norm=1.0)(x=A, y=A[:, 0])


@pytest.mark.parametrize("method", ["auto", "ghost", "two_pass", "chunked", "materialize"])
def test_micro_grad_keeps_an_unbatched_argument_concrete_for_fun(method):
    """A loss may branch in Python on an argument that is neither batched nor
    differentiated, as with micro_vmap: the plan of the call traces only the batch and
    the parameters."""

    def branching(w, x, use_bias, scale):
        out = x @ w["k"]
        if use_bias:
            out = out + w["b"][None]
        return float(scale) * jnp.sum(jnp.tanh(out))

    w = {"k": random_array(3, (3, 2), jnp.float32), "b": random_array(4, (2,), jnp.float32)}
    flag, scale = jnp.array(True), jnp.array(0.5)
    fn = micro_grad(
        branching, batch_argnums=1, microbatch_size=4, l2_clip_norm=1.0, clip_method=method
    )
    got, _ = fn(w, A, flag, scale)

    def clipped(x):
        g = jax.grad(branching)(w, x[None], True, 0.5)
        norm = jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(g)))
        return jax.tree.map(lambda v: v * jnp.minimum(1.0, 1.0 / norm), g)

    want = jax.tree.map(lambda v: jnp.sum(v, 0), jax.vmap(clipped)(A))
    assert_close(got, want, terms=8)


@pytest.mark.x64
def test_custom_init_of_the_wrong_shape_says_so():
    wrong = Accumulator(
        init=lambda s: jnp.zeros((5,), jnp.float32),
        update=lambda c, x, i: c + x,
        finalize=lambda c: c,
        aggregate=lambda x: jnp.sum(x, 0),
    )
    with pytest.raises(
        TypeError,
        match=r"could not fold a microbatch result into its carry: fun returns float32\[3\] and init made the carry float32\[5\]",
    ):
        microbatch(lambda x: jnp.sum(x, 0), 0, 2, wrong)(A)


def test_an_error_of_fun_in_the_loop_keeps_jax_s_message():
    """Only a carry that the accumulator cannot fold is blamed on the accumulator."""

    @jax.custom_vjp
    def identity(x):
        return x

    identity.defvjp(lambda x: (x, None), lambda _, g: (g,))
    looped = microbatch(lambda x: jnp.sum(identity(x), 0), 0, 2)
    with pytest.raises(TypeError, match=r"^can't apply forward-mode autodiff \(jvp\)") as caught:
        jax.jvp(looped, (A,), (A,))
    assert "accumulator" not in str(caught.value)


@pytest.mark.parametrize("axis", [0.0, None, "0"])
def test_reshape_batch_axis_axis_must_be_an_int(axis):
    from microbatching import reshape_batch_axis

    with pytest.raises(TypeError, match=re.escape(f"axis must be an int, got axis={axis!r}")):
        reshape_batch_axis(A, 2, axis=axis)


def test_optax_accumulators_are_accepted():
    optax_mb = pytest.importorskip("optax.microbatching")
    got = microbatch(jnp.sum, 0, 2, accumulator=optax_mb.AccumulationType.MEAN)(A)
    assert_close(got, jnp.sum(A) / 4)
    optax_concat = optax_mb.AccumulationType.CONCAT
    got = micro_vmap(jnp.sin, microbatch_size=2, accumulator=optax_concat)(A)
    assert_close(got, jnp.sin(A))
    summed = optax_mb.Accumulator(
        init=lambda s: jnp.zeros(s.shape, s.dtype),
        update=lambda c, x, i: c + x,
        finalize=lambda c: c,
        aggregate=lambda x: jnp.sum(x, 0),
    )
    grads, _ = micro_grad(loss, microbatch_size=2, accumulator=summed)(W, A)
    assert_close(grads, jax.grad(loss)(W, A), terms=8)


def test_wrappers_do_not_trigger_equinox_warnings():
    eqx = pytest.importorskip("equinox")

    def model_loss(model, x):
        return jnp.sum(jax.vmap(model)(x) ** 2)

    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = eqx.filter_jit(microbatch(eqx.filter_value_and_grad(model_loss), 1, 2, MEAN))
        value, grads = step(model, A)

        class Holder(eqx.Module):
            fn: object

        Holder(micro_grad(loss, microbatch_size=2))
        Holder(micro_vmap(jnp.sin, microbatch_size=2))
    want_value, want_grads = eqx.filter_value_and_grad(model_loss)(model, A)
    assert_close(value, want_value / 4, terms=4)
    assert_close(grads.weight, want_grads.weight / 4, terms=4)


def test_help_shows_readable_defaults():
    import inspect

    text = str(inspect.signature(micro_grad))
    assert "= identity," in text and "= no_metrics," in text
    assert "<function" not in text


# --- inside jax.shard_map, where arrays vary over manual mesh axes ---------------------


def _shard_map(fun, in_specs=None):
    """``fun`` in a shard_map over 4 devices, every argument split over them by default."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    specs = P("data") if in_specs is None else in_specs
    return jax.jit(jax.shard_map(fun, mesh=mesh, in_specs=specs, out_specs=P("data")))


X16 = jnp.arange(16.0)
WEIGHT = jnp.float32(1.5)


@pytest.mark.x64
def test_microbatch_inside_shard_map():
    got = _shard_map(lambda x: microbatch(jnp.sum, 0, 2)(x)[None])(X16)
    assert_close(got, X16.reshape(4, 4).sum(1))
    got = _shard_map(lambda x: microbatch(lambda v: jnp.sum(v * WEIGHT), 0, 2)(x)[None])(X16)
    assert_close(got, X16.reshape(4, 4).sum(1) * 1.5)


@pytest.mark.x64
def test_micro_vmap_inside_shard_map():
    got = _shard_map(lambda x: micro_vmap(lambda v: v * WEIGHT, microbatch_size=2)(x))(X16)
    assert_close(got, X16 * 1.5)


@pytest.mark.x64
@pytest.mark.parametrize("clip", [None, 1.0])
def test_micro_grad_inside_shard_map_matches_vmap_of_grad_there(clip):
    """The parameter passed as varying over the batch's axis: each device's per-example
    gradients are its own examples' (a replicated one is refused with clipping, below)."""

    def pe(w, v):
        return jnp.sum(jnp.sin(v * w))

    def varying(w):
        return jax.lax.pcast(w, "data", to="varying")

    def reference(x):
        g = jax.vmap(jax.grad(pe), (None, 0))(varying(WEIGHT), x[:, None])
        if clip is not None:
            g = g * jnp.minimum(1.0, clip / jnp.abs(g))
        return jnp.sum(g)[None]

    def ours(x):
        return micro_grad(pe, microbatch_size=2, l2_clip_norm=clip)(varying(WEIGHT), x)[0][None]

    assert_close(_shard_map(ours)(X16), _shard_map(reference)(X16), terms=4)


_SUMMED = Accumulator(
    init=lambda s: jnp.zeros(s.shape, s.dtype),
    update=lambda carry, x, i: carry + x,
    finalize=lambda carry: carry,
    aggregate=lambda xs: jnp.sum(xs, axis=0),
)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"l2_clip_norm": 1.0}, "l2_clip_norm"),
        ({"transform_fn": jnp.sign}, "a transform_fn"),
        ({"metrics_fn": l2_norm}, "a metrics_fn"),
    ],
)
def test_per_example_gradients_of_a_replicated_parameter_in_shard_map_are_refused(options, why):
    """JAX's derivative of a parameter that does not vary over the batch's mesh axis sums
    each example's gradient over the devices: clipping those sums would bound no example."""

    def ours(x):
        return micro_grad(jnp.dot, microbatch_size=2, **options)(WEIGHT, x)[0][None]

    with pytest.raises(ValueError) as error:
        _shard_map(ours)(X16)
    assert str(error.value) == (
        f"micro_grad with {why} inside jax.shard_map: the batch varies over the mesh axes "
        "'data', but `a` does not (type float32[]), so JAX's derivative would sum each "
        "example's gradient over those devices before micro_grad sees it. Pass the "
        "parameters as varying, `jax.lax.pcast(a, 'data', to='varying')`, and combine "
        "the devices' results after, e.g. `jax.lax.psum(grads, 'data')`."
    )


def test_max_of_a_replicated_parameter_in_shard_map_is_refused():
    """Without the refusal every device returned the largest of the examples' gradients
    summed over the devices, which is no example's (round 12)."""

    def ours(x):
        fn = micro_grad(
            jnp.dot, microbatch_size=2, keep_batch_dim=False, accumulator=AccumulationType.MAX
        )
        return fn(WEIGHT, x)[0][None]

    with pytest.raises(
        ValueError, match=r"^micro_grad with accumulator=MAX inside jax\.shard_map: the batch"
    ):
        _shard_map(ours)(X16)


@pytest.mark.parametrize(
    ("accumulator", "why"),
    [
        (AccumulationType.MIN, "accumulator=MIN"),
        (CONCAT, "accumulator=CONCAT"),
        (_SUMMED, "a custom Accumulator"),
    ],
)
def test_accumulators_of_a_replicated_parameter_in_shard_map_are_refused(accumulator, why):
    """An extremum, the rows of CONCAT and a custom accumulator read each example's
    gradient, which JAX's derivative summed over the devices."""

    def ours(x):
        fn = micro_grad(jnp.dot, microbatch_size=2, keep_batch_dim=False, accumulator=accumulator)
        return fn(WEIGHT, x)[0][None]

    message = (
        f"micro_grad with {why} inside jax.shard_map: the batch varies over the mesh axes "
        "'data', but `a` does not (type float32[]), so JAX's derivative would sum each "
        "example's gradient over those devices before micro_grad sees it. Pass the "
        "parameters as varying, `jax.lax.pcast(a, 'data', to='varying')`, and combine the "
        "devices' results after, e.g. `jax.lax.psum(grads, 'data')`."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        _shard_map(ours)(X16)


# Device 1's second microbatch (its rows 1 and 3) has weight 0 only.
W16 = jnp.asarray([1, 3, 0.5, 2, 2, 0, 1, 0, 0.5, 1, 1, 4, 1, 2, 3, 1], jnp.float32)


def _tanh_loss(w, v):
    return jnp.tanh(w / (1 + v**2))


@pytest.mark.parametrize(
    ("accumulator", "weighted"),
    [(SUM, True), (MEAN, False), (AccumulationType.RUNNING_MEAN, False)],
)
def test_summed_gradient_of_a_replicated_parameter_in_shard_map_is_jax_grad_there(
    accumulator, weighted
):
    """What needs no example's own gradient is left to JAX's derivative, which sums each
    microbatch's over the devices: the result is jax.grad's of the (weighted) loss there.
    A device whose microbatch kept no row zeroed that sum, the other devices' rows with
    it (round 12)."""
    mean = accumulator is not SUM

    def reference(x, w):
        def total(p):
            values = jax.vmap(_tanh_loss, (None, 0))(p, x) * w
            return jnp.sum(values) / (x.shape[0] if mean else 1)

        return jax.grad(total)(WEIGHT)[None]

    def ours(x, w):
        fn = micro_grad(
            _tanh_loss, microbatch_size=2, keep_batch_dim=False, accumulator=accumulator
        )
        return fn(WEIGHT, x, example_weights=w if weighted else None)[0][None]

    w = W16 if weighted else jnp.ones_like(W16)
    got = _shard_map(ours)(X16, w)
    assert_close(got, _shard_map(reference)(X16, w), terms=8)
    assert_close(got, jnp.full(4, got[0]), terms=1)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"accumulator": MEAN}, "example_weights and accumulator=MEAN"),
        (
            {"accumulator": AccumulationType.RUNNING_MEAN},
            "example_weights and accumulator=RUNNING_MEAN",
        ),
        (
            {"clip_method": "materialize"},
            "example_weights on each example's gradient (the materialize method)",
        ),
    ],
)
def test_weights_on_a_replicated_parameter_in_shard_map_are_refused(options, why):
    """Each device's weights would divide (the means) or scale (per-example gradients) the
    gradients that JAX's derivative summed over all devices."""

    def ours(x, w):
        fn = micro_grad(_tanh_loss, microbatch_size=2, keep_batch_dim=False, **options)
        return fn(WEIGHT, x, example_weights=w)[0][None]

    message = (
        f"micro_grad with {why} inside jax.shard_map: the batch and example_weights vary over "
        "the mesh axes 'data', but `w` does not (type float32[]), so JAX's derivative would "
        "sum each example's gradient over those devices before micro_grad sees it. Pass the "
        "parameters as varying, `jax.lax.pcast(w, 'data', to='varying')`, and combine the "
        "devices' results after, e.g. `jax.lax.psum(grads, 'data')`."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        _shard_map(ours)(X16, W16)


def _clipped_rows(p, x, clip):
    g = jax.vmap(jax.grad(_tanh_loss), (None, 0))(p, x)
    return g * jnp.minimum(1.0, clip / jnp.abs(g))


@pytest.mark.parametrize("method", ["auto", "ghost", "materialize", "two_pass", "chunked"])
def test_replicated_batch_with_weights_split_in_shard_map(method):
    """The batch the same on every device, its example_weights split: each device sums its
    own weighting of the same rows. The batch varies as its weights do; it failed inside
    JAX (round 12)."""
    x = X16[:4]

    def varying(p):
        return jax.lax.pcast(p, "data", to="varying")

    def reference(x, w):
        return jnp.sum(_clipped_rows(varying(WEIGHT), x, 0.15) * w)[None]

    def ours(x, w):
        fn = micro_grad(
            _tanh_loss,
            microbatch_size=2,
            keep_batch_dim=False,
            l2_clip_norm=0.15,  # clips three of the four rows
            clip_method=method,
        )
        return fn(varying(WEIGHT), x, example_weights=w)[0][None]

    specs = (P(), P("data"))
    assert_close(_shard_map(ours, specs)(x, W16), _shard_map(reference, specs)(x, W16), terms=4)


def test_replicated_batch_with_weights_split_in_shard_map_refuses_a_replicated_parameter():
    def ours(x, w):
        fn = micro_grad(_tanh_loss, microbatch_size=2, keep_batch_dim=False, l2_clip_norm=0.4)
        return fn(WEIGHT, x, example_weights=w)[0][None]

    with pytest.raises(
        ValueError,
        match=r"^micro_grad with l2_clip_norm inside jax\.shard_map: example_weights vary over "
        r"the mesh axes 'data', but `w` does not \(type float32\[\]\)",
    ):
        _shard_map(ours, (P(), P("data")))(X16[:4], W16)


def test_micro_vmap_of_a_replicated_batch_with_weights_split_in_shard_map():
    def ours(x, w):
        return micro_vmap(jnp.sin, microbatch_size=2, accumulator=SUM)(x, example_weights=w)[None]

    got = _shard_map(ours, (P(), P("data")))(X16[:4], W16)
    assert_close(got, W16.reshape(4, 4) @ jnp.sin(X16[:4]), terms=4)


@pytest.mark.x64
def test_traced_num_real_microbatches_inside_shard_map():
    def fun(x):
        count = jnp.int32(1) + 0 * x[0].astype(jnp.int32)
        return microbatch(jnp.sum, 0, 2, num_real_microbatches=count)(x)[None]

    got = _shard_map(fun)(X16)
    assert_close(got, X16.reshape(4, 4)[:, ::2].sum(1))


# --- precision and overflow ----------------------------------------------------------


@pytest.mark.x64
def test_float16_mean_does_not_overflow():
    x = jnp.full((128, 4), 1000.0, jnp.float16)
    for size in [None, 1, 16]:
        got = micro_vmap(lambda v: v, microbatch_size=size, accumulator=MEAN)(x)
        assert got.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(got, np.float32), 1000.0)
    mean_grad = micro_grad(
        lambda w, v: jnp.sum(w * v), microbatch_size=16, accumulator=MEAN, keep_batch_dim=False
    )
    grads, _ = mean_grad(jnp.ones(4, jnp.float16), x)
    np.testing.assert_array_equal(np.asarray(grads, np.float32), 1000.0)


@pytest.mark.x64
@pytest.mark.parametrize(
    ("values", "dtype", "want"),
    [
        ([40000.0, -40000.0] * 2, jnp.float16, 0.0),
        ([3e38, -3e38] * 2, jnp.float32, 0.0),
        ([np.inf, 1.0, 2.0, 3.0], jnp.float32, np.inf),
    ],
)
@pytest.mark.parametrize("accumulation_dtype", [None, "same"])
def test_running_mean_does_not_overflow(values, dtype, want, accumulation_dtype):
    carry = dtype if accumulation_dtype == "same" else None
    x = jnp.asarray(values, dtype)
    got = microbatch(lambda v: v[0], 0, 1, AccumulationType.RUNNING_MEAN, accumulation_dtype=carry)(
        x
    )
    mean = microbatch(lambda v: v[0], 0, 1, MEAN, accumulation_dtype=carry)(x)
    assert got.dtype == dtype
    if np.isinf(want):
        assert float(got) == want and float(mean) == want
    else:
        assert abs(float(got)) <= 1e-3 * float(np.max(np.abs(values)))


def test_micro_vmap_keyword_past_the_in_axes_is_mapped_by_the_vmap_rule():
    def scaled(x, s=2.0):
        return x * s

    got = micro_vmap(scaled, (0,), microbatch_size=4)(A, s=B)
    assert_close(got, jax.vmap(scaled)(A, s=B))


def test_wrapped_functions_keep_the_signature_of_fun():
    import inspect

    assert str(inspect.signature(microbatch(loss, 1, 2))) == "(params, x)"
    # micro_vmap and micro_grad take example_weights themselves (issue 8)
    for wrapped in [micro_vmap(loss, (None, 0)), micro_grad(loss)]:
        assert str(inspect.signature(wrapped)) == "(params, x, *, example_weights=None)"
        inspect.signature(wrapped).bind(W, A, example_weights=jnp.ones(8))
    nested = micro_grad(microbatch(loss, 1, 1), batch_argnums=1, microbatch_size=4)
    assert_close(nested(W, x=A)[0], micro_grad(loss, microbatch_size=4)(W, A)[0], terms=8)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: microbatch(add, 0, 2, accumulator=None),
            TypeError,
            "accumulator must be an AccumulationType, an Accumulator or a pytree of them, got accumulator=None",
        ),
        (
            lambda: microbatch(add, 0, 2, in_axes=None),
            ValueError,
            "in_axes=None gives the batch arguments no batch axis",
        ),
        (
            lambda: microbatch(add, (1, -1), 2),
            ValueError,
            r"argnums=\(1, -1\) names position 1 twice",
        ),
    ],
)
def test_more_wrap_time_checks(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.skipif(jax.config.read("jax_enable_x64"), reason="float64 is allowed under x64")
def test_float64_accumulation_needs_x64():
    with pytest.raises(ValueError, match="accumulation_dtype=float64 needs 64-bit JAX"):
        microbatch(add, 0, 2, accumulation_dtype=jnp.float64)
