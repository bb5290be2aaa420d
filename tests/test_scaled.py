"""A ``transform_fn`` that scales each example's gradient by a function of its norms (the
API reference's clipping, ``optax.clip_by_global_norm``, per-layer bounds, normalisation)
takes ``l2_clip_norm``'s path with the user's factors: each form against
``jax.vmap(jax.grad(loss))`` followed by the same transform and the sum or mean."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import microbatching
from microbatching import AccumulationType, micro_grad

from .strategies import assert_close
from .test_ghost import MICROBATCH, Model, mlp, norms, per_example_grads
from .test_statistics import MODELS, reference

MEAN, SUM = AccumulationType.MEAN, AccumulationType.SUM
C = 2.0
SCALED = "transform_fn scaled by a function of the norms"
NORMS_READ = "metrics_fn read as a function of the norms (its code runs on them)"


def global_norm(g: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))


def clip(g: Any) -> Any:
    """The API reference's clipping, as people write it."""
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, C / global_norm(g)), g)


def unit(g: Any) -> Any:
    """jax-privacy's ``clip_pytree`` with ``rescale_to_unit_norm``: clipped, then divided
    by the bound."""
    n = optax.tree.norm(g)
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, C / n) / C, g)


def normalised(g: Any) -> Any:
    """fastDP's automatic clipping: ``g / (||g|| + 0.01)``."""
    n = global_norm(g)
    return jax.tree.map(lambda x: x / (n + 0.01), g)


def per_layer(g: Any) -> Any:
    """Each leaf to ``C / sqrt(#leaves)``, with ``jnp.linalg.norm``."""
    leaves = jax.tree.leaves(g)
    bound = C / len(leaves) ** 0.5
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, bound / jnp.linalg.norm(x)), g)


def guarded(g: Any) -> Any:
    """``nan_safe``-style: an example whose norm is not finite contributes 0."""
    n = global_norm(g)
    ok = jnp.isfinite(n)
    return jax.tree.map(lambda x: jnp.where(ok, x * jnp.minimum(1.0, C / n), 0.0), g)


def by_relu(g: Any) -> Any:
    """A ``custom_jvp`` (``relu``) in the scalar function: ``min(1, C / n)`` spelled
    ``1 - relu(1 - C / n)``."""
    n = global_norm(g)
    return jax.tree.map(lambda x: x * (1.0 - jax.nn.relu(1.0 - C / n)), g)


FORMS = {
    "min": clip,
    "optax": lambda g: optax.clip_by_global_norm(C).update(g, optax.EmptyState())[0],
    "unit": unit,
    "normalised": normalised,
    "per_layer": per_layer,
    "guarded": guarded,
    "relu": by_relu,
}


def grad_fn(model: Model, transform: Any, **options: Any) -> Any:
    options = {"microbatch_size": MICROBATCH, "accumulator": MEAN, **options}
    return micro_grad(
        model.loss,
        batch_argnums=tuple(range(1, 1 + len(model.batch))),
        keep_batch_dim=model.keep_batch_dim,
        transform_fn=transform,
        **options,
    )


@pytest.fixture(scope="module")
def small() -> Model:
    return mlp()


@pytest.fixture(scope="module")
def small_grads(small: Model) -> Any:
    return per_example_grads(small)


@pytest.mark.parametrize("name", list(FORMS))
def test_every_form_is_read_and_equals_vmap_grad(name, small, small_grads):
    transform = FORMS[name]
    fn = grad_fn(small, transform)
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.reason.startswith(SCALED), report.reason
    assert report.method in ("ghost", "materialize"), report
    got, _ = jax.jit(fn)(small.params, *small.batch)
    assert_close(got, reference(small_grads, transform), terms=2, factor=4)


@pytest.mark.parametrize("family", list(MODELS))
def test_every_model_family(family):
    """Dense, convolution, embedding, tied (shared) embedding, attention and scanned
    leaves; the global bound and the per-layer one."""
    model = MODELS[family]()
    grads = per_example_grads(model)
    for transform in (clip, per_layer):
        fn = grad_fn(model, transform)
        report = microbatching.clipping_report(fn, model.params, *model.batch)
        assert report.reason.startswith(SCALED), (family, report.reason)
        got, _ = jax.jit(fn)(model.params, *model.batch)
        assert_close(got, reference(grads, transform), terms=2, factor=4)


def test_the_report_counts_the_leaves_and_factors(small):
    report = microbatching.clipping_report(grad_fn(small, per_layer), small.params, *small.batch)
    assert report.reason.startswith(
        f"{SCALED} (4 of 4 leaves, 4 factors): its code runs on each example's norms, and "
        "the sum is l2_clip_norm's with those factors; "
    ), report.reason
    report = microbatching.clipping_report(grad_fn(small, clip), small.params, *small.batch)
    assert report.reason.startswith(f"{SCALED} (4 of 4 leaves, 1 factor): "), report.reason


def test_the_ghost_path_is_taken_where_auto_takes_it_for_l2_clip_norm(small):
    """The same choice as ``l2_clip_norm`` with the same model: one decision."""
    batch = small.batch
    bound = micro_grad(small.loss, batch_argnums=(1, 2), microbatch_size=MICROBATCH,
                       l2_clip_norm=C)  # fmt: skip
    want = microbatching.clipping_report(bound, small.params, *batch).method
    got = microbatching.clipping_report(grad_fn(small, clip), small.params, *batch).method
    assert got == want


def test_weights_remainders_and_sum(small, small_grads):
    rows = small.batch[0].shape[0]
    weights = jnp.asarray(np.arange(rows) % 3, jnp.float32)
    fn = grad_fn(small, clip, accumulator=SUM, microbatch_size=3, allow_remainder=True)
    got, _ = jax.jit(fn)(small.params, *small.batch, example_weights=weights)
    want = reference(small_grads, clip, weights=weights, mean=False)
    assert_close(got, want, terms=3, factor=4)


def test_an_example_whose_gradient_is_not_finite_is_dropped_by_the_guard(small):
    x, y = small.batch
    x = x.at[3].set(jnp.inf)
    grads = per_example_grads(dataclass_with_batch(small, (x, y)))
    fn = grad_fn(small, guarded, accumulator=SUM)
    report = microbatching.clipping_report(fn, small.params, x, y)
    assert report.reason.startswith(SCALED), report.reason
    got, _ = jax.jit(fn)(small.params, x, y)
    want = reference(grads, guarded, mean=False)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(got))
    assert_close(got, want, terms=2, factor=4)


def dataclass_with_batch(model: Model, batch: tuple[Any, ...]) -> Model:
    return Model(model.loss, model.params, batch, model.keep_batch_dim, model.rules)


def test_derivatives_through_the_result_are_jax_s(small, small_grads):
    """Reverse, forward and mixed: the factors are the user's code on the norms."""
    fn = grad_fn(small, clip, accumulator=SUM)

    def ours(params):
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(fn(params, *small.batch)[0]))

    def theirs(params):
        grads = per_example_grads(small, params)
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(reference(grads, clip, mean=False)))

    assert_close(jax.grad(ours)(small.params), jax.grad(theirs)(small.params), terms=8, factor=8)
    tangent = jax.tree.map(jnp.ones_like, small.params)
    _, got = jax.jvp(ours, (small.params,), (tangent,))
    _, want = jax.jvp(theirs, (small.params,), (tangent,))
    assert_close(got, want, terms=8, factor=8)


def test_clipped_statistics_of_the_api_reference(small, small_grads):
    """``(clip(g), clip(g)**2)``: the scaling, then the statistics method reads the rest."""

    def moments(g: Any) -> Any:
        c = clip(g)
        return c, jax.tree.map(jnp.square, c)

    fn = grad_fn(small, moments)
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.method == "statistics", report
    assert report.reason.startswith(SCALED), report.reason
    got, _ = jax.jit(fn)(small.params, *small.batch)
    assert_close(got, reference(small_grads, moments), terms=2, factor=4)


def test_beside_l2_clip_norm_and_metrics(small, small_grads):
    """``l2_clip_norm`` first, then the transform's own scaling of the clipped gradient;
    the norms, by ``l2_norm`` and by a metric read as a function of the norms."""
    fn = grad_fn(small, normalised, accumulator=SUM, l2_clip_norm=1.5,
                 metrics_fn=optax.tree.norm)  # fmt: skip
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.reason.startswith(f"{NORMS_READ}; {SCALED}"), report.reason
    got, aux = jax.jit(fn)(small.params, *small.batch)
    want = reference(small_grads, normalised, clip=1.5, mean=False)
    assert_close(got, want, terms=2, factor=4)
    assert_close(aux.metrics, norms(small_grads), terms=2)
    fn = grad_fn(small, clip, metrics_fn=microbatching.l2_norm)
    got, aux = jax.jit(fn)(small.params, *small.batch)
    assert_close(got, reference(small_grads, clip), terms=2, factor=4)
    assert_close(aux.metrics, norms(small_grads), terms=2)


def test_one_leaf_scaled_by_another_leaf_s_norm(small, small_grads):
    """Still the form: each leaf's factor reads any squared norms."""

    def cross(g: Any) -> Any:
        n = jnp.linalg.norm(g["dense2"]["kernel"])
        return jax.tree.map(lambda x: x / (1.0 + n), g)

    fn = grad_fn(small, cross)
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.reason.startswith(SCALED), report.reason
    got, _ = jax.jit(fn)(small.params, *small.batch)
    assert_close(got, reference(small_grads, cross), terms=2, factor=4)


def _l1(g: Any) -> Any:
    n = sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(g))
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, C / n), g)


def _by_max(g: Any) -> Any:
    return jax.tree.map(lambda x: x / (jnp.max(jnp.abs(x)) + 1.0), g)


def _partial_norms(g: Any) -> Any:
    return jax.tree.map(lambda x: x / (1.0 + jnp.sum(x * x, axis=0, keepdims=True)), g)


def _entry(g: Any) -> Any:
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, C / (jnp.abs(jnp.ravel(x)[0]) + 1)), g)


def _both(g: Any) -> Any:
    return g, clip(g)


def _renormalised(g: Any) -> Any:
    c = clip(g)
    return jax.tree.map(lambda x: x / (global_norm(c) + 1.0), c)


def _cubed(g: Any) -> Any:
    n = sum(jnp.sum(x**3) for x in jax.tree.leaves(g))
    return jax.tree.map(lambda x: x / (1.0 + jnp.abs(n)), g)


def _elementwise_factor(g: Any) -> Any:
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, C / (jnp.abs(x) + global_norm(g))), g)


NEAR_MISSES = {
    "l1 norm": _l1,
    "max": _by_max,
    "partial norms": _partial_norms,
    "an entry": _entry,
    "as given and clipped": _both,
    "renormalised": _renormalised,
    "cubes": _cubed,
    "elementwise factor": _elementwise_factor,
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_transforms_that_nearly_fit_take_an_exact_path(name, small, small_grads):
    """Transforms that read the gradient other than through squared norms, or read a
    leaf both as given and scaled: not read as scaled (or, renormalised, scaled and
    then read by the rest), and exact whatever path they take."""
    transform = NEAR_MISSES[name]
    fn = grad_fn(small, transform)
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    if name != "renormalised":
        assert not report.reason.startswith(SCALED), report.reason
    got, _ = jax.jit(fn)(small.params, *small.batch)
    assert_close(got, reference(small_grads, transform), terms=2, factor=8)


def test_the_report_says_why_a_clipping_lookalike_forms_the_gradients(small):
    report = microbatching.clipping_report(grad_fn(small, _both), small.params, *small.batch)
    assert report.method == "materialize"
    assert report.reason.endswith(
        "and it is not the gradient scaled by a function of its norms: gradient leaf 0 is "
        "read both as given and scaled"
    ), report.reason


def test_a_clip_method_asked_by_name_keeps_its_meaning(small):
    """``clip_method='materialize'`` with a clipping transform: per-example gradients."""
    fn = grad_fn(small, clip, clip_method="materialize")
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.method == "materialize" and not report.reason.startswith(SCALED)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_on_a_mesh(axis_type, small):
    """The batch split over 4 devices: the same sum as ``vmap(grad)``, by the
    per-example path, which reduces across devices once per microbatch."""
    x, y = (jnp.concatenate([a] * 4) for a in small.batch)
    model = dataclass_with_batch(small, (x, y))
    grads = per_example_grads(model)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(axis_type,))
    options = {"batch_mesh_axes": "data"} if axis_type is AxisType.Auto else {}
    fn = grad_fn(model, clip, accumulator=SUM, microbatch_size=8, **options)
    with jax.set_mesh(mesh):
        xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        got, _ = jax.jit(fn)(model.params, xs, ys)
        report = microbatching.clipping_report(fn, model.params, xs, ys)
    assert report.method == "materialize"
    assert report.reason.endswith(
        "the batch is split over a mesh, where the per-example path is kept for now"
    ), report.reason
    assert_close(got, reference(grads, clip, mean=False), terms=8, factor=4)


_SCALARS = {
    "min": lambda n, c: jnp.minimum(1.0, c / n),
    "where": lambda n, c: jnp.where(n > c, c / n, 1.0),
    "rsqrt": lambda n, c: jnp.minimum(1.0, c * jax.lax.rsqrt(n * n)),
    "eps": lambda n, c: c / (n + 1e-3),
    "clip": lambda n, c: jnp.clip(c / n, 0.0, 1.0),
    "smooth": lambda n, c: jnp.tanh(c / n),
}


@settings(max_examples=12, deadline=None)
@given(
    scalar=st.sampled_from(list(_SCALARS)),
    bound=st.floats(0.05, 20.0),
    per_leaf=st.booleans(),
    weighted=st.booleans(),
    microbatch_size=st.sampled_from([2, 3, 8]),
)
def test_any_scalar_function_of_the_norms(scalar, bound, per_leaf, weighted, microbatch_size):
    """Drawn spellings of the factor (``where``, ``rsqrt``, ``clip``, ``tanh``...), one
    for the whole gradient or one per leaf, with weights and remainders; the same
    factors as a ``metrics_fn`` beside it, computed from the norms too."""
    model = _SMALL
    f = _SCALARS[scalar]

    def factors(g: Any) -> Any:
        if per_leaf:
            return jax.tree.map(lambda x: f(jnp.sqrt(jnp.sum(x**2)), bound), g)
        return f(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g))), bound)

    def transform(g: Any) -> Any:
        if per_leaf:
            return jax.tree.map(lambda x, c: x * c, g, factors(g))
        return jax.tree.map(lambda x: x * factors(g), g)

    rows = model.batch[0].shape[0]
    weights = jnp.asarray((np.arange(rows) * 7) % 4, jnp.float32) if weighted else None
    fn = grad_fn(model, transform, accumulator=SUM, microbatch_size=microbatch_size,
                 allow_remainder=True, metrics_fn=factors)  # fmt: skip
    report = microbatching.clipping_report(fn, model.params, *model.batch)
    assert report.reason.startswith(f"{NORMS_READ}; {SCALED}"), report.reason
    got, aux = fn(model.params, *model.batch, example_weights=weights)
    want = reference(_SMALL_GRADS, transform, weights=weights, mean=False)
    assert_close(got, want, terms=4, factor=8)
    measured = jax.vmap(factors)(_SMALL_GRADS)
    if weights is not None:  # a row of weight 0 has metrics 0, as on every path
        measured = jax.tree.map(lambda m: jnp.where(weights != 0, m, 0.0), measured)
    assert_close(aux.metrics, measured, terms=2, factor=4)


_SMALL = mlp()
_SMALL_GRADS = per_example_grads(_SMALL)


# --- found by an attempt to break the reading ------------------------------------------


def _sum_of_two_squares(g: Any) -> Any:
    q = sum(jnp.sum(x * x + x * x) for x in jax.tree.leaves(g))  # 2 ||g||^2
    return jax.tree.map(lambda x: x / (1.0 + q), g)


def _trace_of_square(g: Any) -> Any:
    q = jnp.einsum("ij,ji->", g["dense2"]["kernel"][:3], g["dense2"]["kernel"][:3])
    return jax.tree.map(lambda x: x / (1.0 + jnp.abs(q)), g)


def _signed_zeros(g: Any) -> Any:
    q = sum(jnp.sum(x**2) for x in jax.tree.leaves(g))
    a, b = jnp.arctan2(0.0 * q, -1.0), jnp.arctan2(-0.0 * q, -1.0)  # pi and -pi
    return {"dense1": jax.tree.map(lambda x: x * a, g["dense1"]),
            "dense2": jax.tree.map(lambda x: x * b, g["dense2"])}  # fmt: skip


def _frozen_and_masked(g: Any) -> Any:
    """Constants made inside the transform: a frozen layer, a mask from ``arange``."""
    c = clip(g)
    mask = (jnp.arange(c["dense1"]["kernel"].shape[1]) % 2).astype(jnp.float32)
    return {
        "dense1": {"kernel": c["dense1"]["kernel"] * mask[None], "bias": c["dense1"]["bias"]},
        "dense2": jax.tree.map(jnp.zeros_like, c["dense2"]),
    }


def _complex_literal(g: Any) -> Any:
    q = sum(jnp.sum(x**2) for x in jax.tree.leaves(g))
    return jax.tree.map(lambda x: x * jnp.real(jnp.exp(1j * q)), g)


_KEY = jax.random.key(0)


def _typed_key(g: Any) -> Any:
    q = sum(jnp.sum(x**2) for x in jax.tree.leaves(g))
    return jax.tree.map(lambda x: x * (1 + 0.1 * jax.random.normal(_KEY)) / (1.0 + q), g)


BROKEN = {
    "two squares added": _sum_of_two_squares,
    "trace of a square": _trace_of_square,
    "signed zeros": _signed_zeros,
    "constants made inside": _frozen_and_masked,
    "a complex literal": _complex_literal,
    "a typed key": _typed_key,
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_what_once_broke_the_reading(name, small, small_grads):
    """``g*g + g*g`` read as one square, ``trace(G @ G)`` as a squared norm, ``0.0`` and
    ``-0.0`` as one factor (wrong sums); constants computed inside the transform, a
    complex literal and a typed key (crashes): each now equals ``vmap(grad)``."""
    transform = BROKEN[name]
    got, _ = jax.jit(grad_fn(small, transform))(small.params, *small.batch)
    assert_close(got, reference(small_grads, transform), terms=2, factor=8)


def test_two_custom_jvp_rules_with_one_primal_are_two_factors(small):
    """Their derivatives through the result differ: never one factor node (each call
    of a ``custom_jvp`` is its own node: four here, one per leaf)."""

    def make(c: float) -> Any:
        @jax.custom_jvp
        def f(q: jax.Array) -> jax.Array:
            return 1.0 / (1.0 + q)

        @f.defjvp
        def f_jvp(primals: Any, tangents: Any) -> Any:
            return f(primals[0]), c * tangents[0]

        return f

    f1, f2 = make(1.0), make(-3.0)

    def transform(g: Any) -> Any:
        q = sum(jnp.sum(x**2) for x in jax.tree.leaves(g))
        return {"dense1": jax.tree.map(lambda x: x * f1(q), g["dense1"]),
                "dense2": jax.tree.map(lambda x: x * f2(q), g["dense2"])}  # fmt: skip

    fn = grad_fn(small, transform, accumulator=SUM)
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.reason.startswith(f"{SCALED} (4 of 4 leaves, 4 factors)"), report.reason

    def ours(params: Any) -> Any:
        out = fn(params, *small.batch)[0]
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(out))

    def theirs(params: Any) -> Any:
        out = reference(per_example_grads(small, params), transform, mean=False)
        return sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(out))

    assert_close(jax.grad(ours)(small.params), jax.grad(theirs)(small.params), terms=8, factor=8)


def test_a_transform_that_reads_state_is_read_at_each_call(small, small_grads):
    """``jax.make_jaxpr`` caches a trace by its function: the reading traces a new one."""

    class Clipper:
        def __init__(self, bound: float) -> None:
            self.bound = bound

        def __call__(self, g: Any) -> Any:
            n = global_norm(g)
            return jax.tree.map(lambda x: x * jnp.minimum(1.0, self.bound / n), g)

    clipper = Clipper(2.0)
    fn = grad_fn(small, clipper, accumulator=SUM)
    fn(small.params, *small.batch)
    clipper.bound = 0.05
    got, _ = fn(small.params, *small.batch)
    assert_close(got, reference(small_grads, Clipper(0.05), mean=False), terms=2, factor=4)


@pytest.mark.x64
def test_an_integer_literal_beyond_float64_s_integers_is_exact(small, small_grads):
    if not jax.config.read("jax_enable_x64"):
        pytest.skip("needs int64: runs in make test-x64")
    big = jnp.int64(2**62)

    def transform(g: Any) -> Any:
        q = sum(jnp.sum(x**2) for x in jax.tree.leaves(g))
        one = (big + jnp.int64(1) - big).astype(jnp.float64)
        return jax.tree.map(lambda x: x * one.astype(x.dtype) / (1.0 + q), g)

    got, _ = grad_fn(small, transform)(small.params, *small.batch)
    assert_close(got, reference(small_grads, transform), terms=2, factor=4)


# --- a metrics_fn that reads only norms ------------------------------------------------


METRICS = {
    "optax.tree.norm": optax.tree.norm,
    "squared": lambda g: optax.tree.norm(g, squared=True),
    "per leaf": lambda g: jax.tree.map(jnp.linalg.norm, g),
    "clipped and squared": lambda g: (global_norm(g) > C, jnp.minimum(global_norm(g), C) ** 2),
    "a constant beside": lambda g: {"n": optax.tree.norm(g), "one": jnp.ones(3)},
}


def metric_fn(model: Model, metric: Any, transform: Any = None, **options: Any) -> Any:
    options = {"microbatch_size": MICROBATCH, "accumulator": SUM, **options}
    if transform is not None:
        options["transform_fn"] = transform
    return micro_grad(
        model.loss,
        batch_argnums=tuple(range(1, 1 + len(model.batch))),
        keep_batch_dim=model.keep_batch_dim,
        metrics_fn=metric,
        **options,
    )


@pytest.mark.parametrize("name", list(METRICS))
@pytest.mark.parametrize("clip", [None, 1.5], ids=["unclipped", "clipped"])
def test_a_metric_of_the_norms_forms_no_gradient(name, clip, small, small_grads):
    """``metrics_fn=optax.tree.norm`` and the like: read off its program, computed from
    the norms the ghost path takes, equal to the metric of each example's gradient."""
    metric = METRICS[name]
    fn = metric_fn(small, metric, l2_clip_norm=clip)
    report = microbatching.clipping_report(fn, small.params, *small.batch)
    assert report.method == "ghost", report
    assert report.reason.startswith(NORMS_READ), report.reason
    got, aux = jax.jit(fn)(small.params, *small.batch)
    want = reference(small_grads, lambda g: g, clip=clip, mean=False)
    assert_close(got, want, terms=2, factor=4)
    # metrics_fn sees each example's gradient before clipping
    assert_close(aux.metrics, jax.vmap(metric)(small_grads), terms=2, factor=2)


def test_a_metric_of_the_norms_beside_a_transform_and_weights(small, small_grads):
    """Beside the clipping ``transform_fn`` and its clipped statistics, with weights and
    a remainder: no gradient formed, the metrics those of the unclipped gradients (a
    weight-0 example's are 0, as on every path)."""
    rows = small.batch[0].shape[0]
    weights = jnp.asarray(np.arange(rows) % 3, jnp.float32)

    def moments(g: Any) -> Any:
        c = clip(g)
        return c, jax.tree.map(jnp.square, c)

    metric = optax.tree.norm
    for transform, method in ((clip, "ghost"), (moments, "statistics")):
        fn = metric_fn(small, metric, transform, microbatch_size=3, allow_remainder=True)
        report = microbatching.clipping_report(fn, small.params, *small.batch)
        assert report.method == method, report
        assert report.reason.startswith(NORMS_READ), report.reason
        got, aux = jax.jit(fn)(small.params, *small.batch, example_weights=weights)
        want = reference(small_grads, transform, weights=weights, mean=False)
        assert_close(got, want, terms=3, factor=4)
        kept = jnp.where(weights != 0, jax.vmap(metric)(small_grads), 0.0)
        assert_close(aux.metrics, kept, terms=2, factor=2)


def test_a_metric_that_reads_more_than_norms_forms_the_gradients_and_says_why(small):
    """A maximum, an L1 norm: the per-example path, exact, and the report says what the
    metric reads. (A metric linear in the gradient, an entry or the gradient itself, is
    the statistics method's: ``tests/test_statistics.py``.)"""
    misses = {
        "max": (lambda g: jnp.max(jnp.abs(g["dense1"]["kernel"])), "through `reduce_max`"),
        "l1": (lambda g: sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(g)), "`reduce_sum`"),
    }
    grads = per_example_grads(small)
    for metric, said in misses.values():
        fn = metric_fn(small, metric, l2_clip_norm=1.5)
        report = microbatching.clipping_report(fn, small.params, *small.batch)
        assert report.method == "materialize", report
        assert said in report.reason, report.reason
        assert report.reason.startswith(
            "metrics_fn needs each example's gradient (metrics_fn=microbatching.l2_norm "
            "gives the norms without them): its output"
        ), report.reason
        _, aux = jax.jit(fn)(small.params, *small.batch)
        assert_close(aux.metrics, jax.vmap(metric)(grads), terms=2)


def test_a_metric_of_the_norms_asked_with_a_named_method_is_refused_at_wrap_time(small):
    """Read at call time, so a method named at wrap time keeps its check."""
    with pytest.raises(ValueError, match="which needs each example's gradient; the ghost"):
        metric_fn(small, optax.tree.norm, l2_clip_norm=1.0, clip_method="ghost")


def test_derivatives_through_a_metric_of_the_norms_are_jax_s(small):
    """``jax.grad`` of the summed metrics with respect to the parameters: the metric's
    code runs on norms that are the loss's own functions of them."""

    def ours(params: Any) -> jax.Array:
        fn = metric_fn(small, optax.tree.norm, l2_clip_norm=1.5)
        return jnp.sum(fn(params, *small.batch)[1].metrics)

    def theirs(params: Any) -> jax.Array:
        return jnp.sum(jax.vmap(optax.tree.norm)(per_example_grads(small, params)))

    assert_close(jax.grad(ours)(small.params), jax.grad(theirs)(small.params), terms=4, factor=4)


def test_a_metric_of_the_norms_on_a_mesh_keeps_the_per_example_path(small):
    x, y = (jnp.concatenate([a] * 4) for a in small.batch)
    model = dataclass_with_batch(small, (x, y))
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    fn = metric_fn(model, optax.tree.norm, microbatch_size=8, batch_mesh_axes="data")
    with jax.set_mesh(mesh):
        xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        _, aux = jax.jit(fn)(model.params, xs, ys)
        report = microbatching.clipping_report(fn, model.params, xs, ys)
    assert report.method in ("chunked", "materialize"), report
    assert report.reason.endswith(
        "(metrics_fn=microbatching.l2_norm gives the norms without them): the batch is "
        "split over a mesh, where the per-example path is kept for now"
    ), report.reason
    want = jax.vmap(optax.tree.norm)(per_example_grads(model))
    assert_close(aux.metrics, want, terms=2)


def test_a_complex_gradient_times_itself_is_not_its_squared_norm():
    """``sum(g * g)`` of a complex leaf is a complex number, not ``sum(|g|**2)``: neither
    a metric nor a transform's factor reads it as a norm (both once did: the metric off
    by a factor of 3-5, the transform's sum by 0.86 of its size); ``abs`` first is one."""
    rng = np.random.default_rng(0)
    params = jnp.asarray(rng.normal(size=(5, 3)) + 1j * rng.normal(size=(5, 3)), jnp.complex64)
    x = jnp.asarray(rng.normal(size=(8, 5)) + 1j * rng.normal(size=(8, 5)), jnp.complex64)
    y = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)

    def loss(p: Any, x: Any, y: Any) -> jax.Array:
        return jnp.mean(jnp.abs(x @ p - y) ** 2)

    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    options = {"batch_argnums": (1, 2), "microbatch_size": 4, "accumulator": SUM}
    for metric, read in ((lambda g: jnp.sum(g * g), False), (lambda g: jnp.sum(jnp.abs(g) ** 2), True)):  # fmt: skip
        fn = micro_grad(loss, metrics_fn=metric, l2_clip_norm=1.0, **options)
        report = microbatching.clipping_report(fn, params, x, y)
        assert report.reason.startswith(NORMS_READ) == read, report.reason
        _, aux = jax.jit(fn)(params, x, y)
        assert_close(aux.metrics, jax.vmap(metric)(grads), terms=2)

    def scaled(g: Any) -> Any:
        return g * jnp.minimum(1.0, 1.0 / jnp.sqrt(jnp.sum(g * g)))

    fn = micro_grad(loss, transform_fn=scaled, **options)
    report = microbatching.clipping_report(fn, params, x, y)
    assert not report.reason.startswith(SCALED), report.reason
    got, _ = jax.jit(fn)(params, x, y)
    assert_close(got, jnp.sum(jax.vmap(scaled)(grads), axis=0), terms=2)
