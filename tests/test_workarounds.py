"""Each backend workaround (``_workarounds``) applies where its gate says, its fault is
still there on the installed JAX wherever it applies, and the code it gates does without
it where it does not."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxpr_as_fun

from microbatching import _layout, micro_grad, micro_vmap
from microbatching._xla_cpu import convs as _convs
from microbatching._xla_cpu import dots as _dots
from microbatching._xla_cpu import squeeze as _squeeze
from microbatching._xla_cpu import workarounds as _workarounds

from .strategies import assert_close, equations

pytestmark = pytest.mark.compiled  # facts of the compiled program (`make test` runs these apart)

OFF = _workarounds.Workaround("no-such-backend", (), None, "")


def without(monkeypatch, name):
    monkeypatch.setattr(_workarounds, name, OFF)


def test_a_workaround_applies_on_its_backend_until_the_version_that_fixed_it():
    version = _workarounds.jaxlib_version()
    assert version >= (0, 7) and all(isinstance(part, int) for part in version)
    backend = jax.default_backend()
    assert _workarounds.Workaround(backend, (), None, "").applies()
    assert _workarounds.Workaround(backend, (), (*version[:-1], version[-1] + 1), "").applies()
    assert not _workarounds.Workaround(backend, (), version, "").applies()
    assert not OFF.applies()


def _per_example_sum(rows, barrier):
    """The repro's program (``benchmarks/xla_per_example_sum_repro.py``) at the smallest
    shapes it was seen at here: a 256x256 layer's per-example gradients, summed."""
    k = jax.random.split(jax.random.key(0), 4)
    w1, w2 = jax.random.normal(k[0], (256, 256)), jax.random.normal(k[1], (256, 16))
    x, y = jax.random.normal(k[2], (rows, 256)), jax.random.normal(k[3], (rows, 16))

    def one(a, b):
        return jax.grad(lambda w: jnp.sum((a @ w) @ w2 * b))(w1)

    def total(x, y):
        each = jax.vmap(one)(x, y)
        return jnp.sum(jax.lax.optimization_barrier(each) if barrier else each, 0)

    x64, y64, w64 = (np.asarray(v, np.float64) for v in (x, y, w2))
    return jax.jit(total)(x, y), x64.T @ (y64 @ w64.T)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_the_per_example_sum_is_wrong_without_the_barrier_where_the_gate_applies():
    got, want = _per_example_sum(2, barrier=False)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    if _workarounds.PER_EXAMPLE_SUM.applies():
        assert error > 0.1, (
            f"jaxlib {_workarounds.jaxlib_version()} sums per-example rows right ({error=:.1e}): set "
            "PER_EXAMPLE_SUM.fixed_in to it, so that the barrier is left out"
        )
    else:
        assert_close(got, want, dtype=jnp.float32, factor=10)
    barred, want = _per_example_sum(2, barrier=True)
    assert_close(barred, want, dtype=jnp.float32, factor=10)


def _dense_loss(w, x, y):
    return jnp.sum((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)


def _barriers(jaxpr):
    """The optimization barriers of a program, at any depth."""
    return str(jaxpr).count("optimization_barrier")


def _clip(g):
    norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
    return jax.tree.map(lambda leaf: leaf * jnp.minimum(1.0, 1.0 / norm), g)


@pytest.mark.parametrize(
    "options",
    [
        {"l2_clip_norm": 1.0, "clip_method": "materialize"},
        {"transform_fn": _clip, "clip_method": "materialize"},
    ],
    ids=["materialize", "transform_fn"],
)
def test_per_example_rows_pass_a_barrier_only_where_the_gate_applies(monkeypatch, options):
    w = {"a": jnp.full((4, 3), 0.1), "b": jnp.full((3, 2), 0.2)}
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jax.random.normal(jax.random.key(2), (8, 2))

    def fun():  # a new function each time: no trace is reused from a cache
        grad = micro_grad(_dense_loss, batch_argnums=(1, 2), microbatch_size=4, **options)
        return lambda *args: grad(*args)[0]

    barred = 2 if _workarounds.PER_EXAMPLE_SUM.applies() else 0  # one per leaf
    on = _barriers(jax.make_jaxpr(fun())(w, x, y))
    expected = jax.jit(fun())(w, x, y)
    without(monkeypatch, "PER_EXAMPLE_SUM")
    assert _layout.rows_apart(x) is x
    off = _barriers(jax.make_jaxpr(fun())(w, x, y))
    assert on - off == barred
    # These shapes are not ones XLA:CPU gets wrong: the sums agree either way.
    assert_close(jax.jit(fun())(w, x, y), expected)


def _conv_program():
    x = jnp.ones((2, 3, 4, 4))
    w = jnp.ones((2, 3, 2, 2))
    dims = ("NCHW", "OIHW", "NCHW")

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dims)

    return jax.make_jaxpr(conv)(x, w), (x, w)


def test_convolutions_are_reordered_only_where_the_gate_applies(monkeypatch):
    program, args = _conv_program()
    reordered = _convs.canonical(program)
    assert (reordered is not program) == _workarounds.CONV_ORDER.applies()
    assert_close(jaxpr_as_fun(reordered)(*args), jaxpr_as_fun(program)(*args))
    without(monkeypatch, "CONV_ORDER")
    assert _convs.canonical(program) is program


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_a_convolution_gradient_in_a_loop_keeps_its_order_where_the_gate_applies():
    """The fault itself, read off the compiled program of a hand-written loop: XLA:CPU
    leaves a convolution of another order than Eigen's inside the while body."""

    def loss(w, x):
        out = jax.lax.conv_general_dilated(
            x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(out**2)

    def looped(w, x):
        def body(i, total):
            rows = jax.lax.dynamic_slice_in_dim(x, i * 4, 4)
            return total + jax.grad(loss)(w, rows)

        return jax.lax.fori_loop(0, 2, body, jnp.zeros_like(w))

    w = jax.ShapeDtypeStruct((3, 3, 2, 4), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 8, 8, 2), jnp.float32)
    text = str(jax.jit(looped).lower(w, x).compile().as_text())
    labels = set(re.findall(r"convolution\(.*dim_labels=([\w>-]+)", text))
    other = {label for label in labels if label != "b01f_01io->b01f"}
    assert bool(other) == _workarounds.CONV_ORDER.applies(), labels


def _reductions(jaxpr):
    """The operand shapes of every reduction of ``jaxpr``, its inner jaxprs included."""
    names = ("reduce_sum", "reduce_max", "reduce_min")
    return [tuple(e.invars[0].aval.shape) for e, _ in equations(jaxpr) if e.primitive.name in names]


def test_reductions_lose_their_unit_dimensions_only_where_the_gate_applies(monkeypatch):
    """Sums, maxima and minima of arrays with dimensions of size 1, at the top and inside
    a jitted function and a scan, over unit and other axes: the same values either way."""

    def fun(x, y):
        inner = jax.jit(lambda x: jnp.max(x, axis=(1, 3)))(x)
        scanned = jax.lax.scan(lambda c, r: (c + jnp.min(r, axis=2), None), y[0, :, :, 0], y)[0]
        return jnp.sum(x * 2, axis=2), jnp.sum(x, axis=1), inner, scanned, jnp.sum(y)

    args = (
        jnp.arange(2 * 1 * 3 * 4, dtype=jnp.float32).reshape(2, 1, 3, 4),
        jnp.arange(5 * 1 * 3 * 2, dtype=jnp.float32).reshape(5, 1, 3, 2) % 7,
    )
    program = jax.make_jaxpr(fun)(*args)
    assert any(1 in shape for shape in _reductions(program.jaxpr))
    rewritten = _squeeze.squeezed(program)
    assert (rewritten is not program) == _workarounds.UNIT_REDUCE.applies()
    if _workarounds.UNIT_REDUCE.applies():
        assert not [s for s in _reductions(rewritten.jaxpr) if 1 in s], _reductions(rewritten.jaxpr)
    got, want = jaxpr_as_fun(rewritten)(*args), jaxpr_as_fun(program)(*args)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # small integers: exact in any order
    plain = jax.make_jaxpr(lambda x: jnp.sum(x, axis=0))(jnp.ones((3, 4)))
    assert _squeeze.squeezed(plain) is plain  # nothing to rewrite: the same program
    without(monkeypatch, "UNIT_REDUCE")
    assert _squeeze.squeezed(program) is program


def test_a_per_example_gradient_in_the_loop_reduces_no_unit_dimension_where_the_gate_applies():
    """A loss written for a batch (``keep_batch_dim``), its per-example gradients formed
    (``clip_method='materialize'``): where the gate applies no reduction of the loop body
    reads an array with a dimension of size 1, and the clipped sum matches the one
    computed without the rewrite."""

    def loss(p, x):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        h = (x - mean) * p["scale"][None, None]
        return jnp.sum(jnp.tanh(h @ p["w"]))

    params = {"scale": jnp.linspace(0.5, 1.5, 6), "w": jnp.linspace(-1.0, 1.0, 24).reshape(6, 4)}
    x = jnp.sin(jnp.arange(8 * 5 * 6, dtype=jnp.float32)).reshape(8, 5, 6)
    fn = micro_grad(loss, batch_argnums=1, microbatch_size=4, l2_clip_norm=0.5,
                    clip_method="materialize")  # fmt: skip
    jaxpr = jax.make_jaxpr(fn)(params, x).jaxpr
    unit = [s for s in _reductions(jaxpr) if 1 in s and len(s) > 1]
    assert bool(unit) != _workarounds.UNIT_REDUCE.applies(), unit
    per_example = jax.vmap(jax.grad(loss), (None, 0))(params, x[:, None])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(8, -1) ** 2, 1) for g in jax.tree.leaves(per_example)))
    factors = jnp.minimum(1.0, 0.5 / norms)
    expected = jax.tree.map(lambda g: jnp.tensordot(factors, g, 1), per_example)
    assert_close(fn(params, x)[0], expected)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_a_reduction_with_a_unit_dimension_goes_to_ynnpack_where_the_gate_applies():
    """The fault itself, read off the compiled program: XLA:CPU hands the fused multiply
    and sum of a ``(64, 1, 64, 128)`` array, dimension of size 1 kept, to YNNPACK (where
    it runs about ten times slower than the same sum reshaped without it:
    ``benchmarks/xla_unit_dim_reduce_repro.py``)."""
    x = jax.ShapeDtypeStruct((64, 1, 64, 128), jnp.float32)
    text = str(jax.jit(lambda x, g: jnp.sum(x * g, axis=2)).lower(x, x).compile().as_text())
    kept = re.search(r"reduce\(.*dimensions=\{2\}", text) is not None
    ynn = "__ynn_fusion" in text
    assert (kept and ynn) == _workarounds.UNIT_REDUCE.applies(), text[:2000]


def test_bfloat16_batches_are_read_as_bits_only_where_the_gate_applies(monkeypatch):
    batch = jnp.ones((4, 3, 2), jnp.bfloat16)
    assert _layout.reads_bits(batch) == _workarounds.BF16_BITS.applies()
    assert not _layout.reads_bits(batch.astype(jnp.float32))
    without(monkeypatch, "BF16_BITS")
    assert not _layout.reads_bits(batch)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_a_bfloat16_read_in_a_loop_copies_the_batch_to_float32_where_the_gate_applies():
    """The fault itself: a hand-written ``dynamic_slice`` loop over a bfloat16 batch
    takes a float32 copy of the whole batch as temp memory."""

    def looped(x):
        def body(i, total):
            return total + jnp.sum(jax.lax.dynamic_slice_in_dim(x, i * 64, 64).astype(jnp.float32))

        return jax.lax.fori_loop(0, x.shape[0] // 64, body, jnp.zeros(()))

    def temp(rows):
        x = jax.ShapeDtypeStruct((rows, 16, 12), jnp.bfloat16)
        analysis = jax.jit(looped).lower(x).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    grown = temp(16384) - temp(1024)
    float32_copy = (16384 - 1024) * 16 * 12 * 4
    assert (grown >= 0.9 * float32_copy) == _workarounds.BF16_BITS.applies(), grown


def _batch_of_one_loss(w, x):
    """One example seen as a batch of one, ``x`` of shape ``(1, T, d)``: a dense layer,
    so that ``w``'s gradient is JAX's transposed product of the cotangent and ``x``."""
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _transposed_products(jaxpr):
    """The batched products of ``jaxpr`` (any depth) whose result a transpose reads."""
    found = {e.outvars[0]: e for e, _ in equations(jaxpr) if e.primitive.name == "dot_general"}
    return [
        found[e.invars[0]]
        for e, _ in equations(jaxpr)
        if e.primitive.name == "transpose" and e.invars[0] in found
        and found[e.invars[0]].params["dimension_numbers"][1] == ((0,), (0,))
    ]  # fmt: skip


def test_transposed_batched_products_are_swapped_only_where_the_gate_applies(monkeypatch):
    """Per-example gradients of a dense layer, at the top, inside a jitted function and
    inside a scan, beside a product with two kept dimensions on one side (not a swap):
    the same values either way (small integers, exact in any order)."""
    per_example = jax.vmap(jax.grad(_batch_of_one_loss), (None, 0))

    def fun(w, x, v):
        inner = jax.jit(per_example)(w, x)
        scanned = jax.lax.scan(lambda c, xs: (c + per_example(w, xs).sum(0), None), w, x[None])
        two_kept = jax.lax.dot_general(
            v[:, :, 0], v[:, :, :, None] * v[:, :, None], (((1,), (1,)), ((0,), (0,)))
        )
        return per_example(w, x), inner, scanned[0], jnp.swapaxes(two_kept, 1, 2)

    w = (jnp.arange(12, dtype=jnp.float32).reshape(3, 4) % 5 - 2) / 8
    x = (jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 1, 5, 3) % 7 - 3) / 4
    v = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
    program = jax.make_jaxpr(fun)(w, x, v)
    assert len(_transposed_products(program.jaxpr)) == 4
    rewritten = _dots.swapped(program)
    assert (rewritten is not program) == _workarounds.DOT_ORDER.applies()
    left = _transposed_products(rewritten.jaxpr)
    kept = [e for e in left if e.invars[0].aval.shape == (2, 3)]
    assert len(kept) == 1  # two kept dimensions on one side: a swap is not the transpose
    assert len(left) == (1 if _workarounds.DOT_ORDER.applies() else 4), left
    got, want = jaxpr_as_fun(rewritten)(w, x, v), jaxpr_as_fun(program)(w, x, v)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert_close(a, b)
    plain = jax.make_jaxpr(lambda w, x: jnp.sum(x @ w))(w, x)
    assert _dots.swapped(plain) is plain  # nothing to rewrite: the same program
    without(monkeypatch, "DOT_ORDER")
    assert _dots.swapped(program) is program


def test_per_example_gradients_in_the_loop_read_no_transposed_product_where_the_gate_applies():
    """``clip_method='materialize'`` forms the per-example gradients of a dense layer in
    the loop: where the gate applies no transpose reads a batched product there, and the
    clipped sum matches the one from ``vmap(grad)``."""
    w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    x = jnp.sin(jnp.arange(8 * 5 * 3, dtype=jnp.float32)).reshape(8, 5, 3)
    fn = micro_grad(_batch_of_one_loss, batch_argnums=1, microbatch_size=4, l2_clip_norm=0.5,
                    clip_method="materialize")  # fmt: skip
    transposed = _transposed_products(jax.make_jaxpr(fn)(w, x).jaxpr)
    assert bool(transposed) != _workarounds.DOT_ORDER.applies(), transposed
    per_example = jax.vmap(jax.grad(_batch_of_one_loss), (None, 0))(w, x[:, None])
    norms = jnp.sqrt(jnp.sum(per_example.reshape(8, -1) ** 2, 1))
    assert_close(fn(w, x)[0], jnp.tensordot(jnp.minimum(1.0, 0.5 / norms), per_example, 1))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_a_transposed_per_example_product_leaves_ynnpack_where_the_gate_applies():
    """The fault itself, read off the compiled programs: the per-example gradients of a
    ``128 x 512`` dense layer over 64 examples of 64 rows, as JAX transposes them (a
    product, then a transpose), compile to XLA's own dot with a transposed copy of the
    cotangent; the product with its operands swapped compiles to a YNNPACK fusion."""
    w = jax.ShapeDtypeStruct((128, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 1, 64, 128), jnp.float32)

    def as_jax(w, x):
        g = jax.vmap(jax.grad(_batch_of_one_loss), (None, 0))(w, x)
        return g, jnp.sum(g * g, axis=(1, 2))

    def swapped(w, x):
        program = jax.make_jaxpr(as_jax)(w, x)
        return jaxpr_as_fun(_swapped_always(program))(w, x)

    def product(f):
        text = str(jax.jit(f).lower(w, x).compile().as_text())
        lines = [line for line in text.splitlines() if re.search(r"= f32\[64,128,512\]", line)]
        return ["ynn" if "__ynn_fusion" in line else "dot" for line in lines if "dot(" in line
                or "__ynn_fusion" in line]  # fmt: skip

    transposed, swapped_order = product(as_jax), product(swapped)
    assert "ynn" in swapped_order, swapped_order
    assert ("ynn" not in transposed) == _workarounds.DOT_ORDER.applies(), transposed


@settings(max_examples=20)
@given(
    batch=st.integers(1, 3),
    contracted=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    kept=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    order=st.permutations([0, 1, 2]),
    dtype=st.sampled_from([jnp.float32, jnp.int32, jnp.complex64]),
)
def test_a_swapped_product_is_the_transposed_product(batch, contracted, kept, order, dtype):
    """Any batched product with one kept dimension a side, its contracted dimensions in
    any order on the right-hand side, read by a transpose (and a product of the same
    operands not followed by one): the swap gives the same values, in integers exactly."""
    k = len(contracted)
    x = jnp.arange(batch * np.prod(contracted) * kept[0]) % 5 - 2
    x = x.reshape(batch, *contracted, kept[0]).astype(dtype)
    perm = [i for i in order if i < k]  # where x's i-th contracted dimension sits in y
    y_shape = [batch, *[contracted[perm.index(j)] for j in range(k)], kept[1]]
    y = (jnp.arange(int(np.prod(y_shape))) % 3 - 1).reshape(y_shape).astype(dtype)
    numbers = ((tuple(range(1, k + 1)), tuple(1 + p for p in perm)), ((0,), (0,)))

    def fun(x, y):
        product = jax.lax.dot_general(x, y, numbers)
        return jnp.transpose(product, (0, 2, 1)), product

    program = jax.make_jaxpr(fun)(x, y)
    rewritten = _swapped_always(program)
    assert len(_transposed_products(rewritten.jaxpr)) == 0
    for got, want in zip(jaxpr_as_fun(rewritten)(x, y), jaxpr_as_fun(program)(x, y), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)  # small integers: exact in any order


def test_rewritten_programs_keep_a_linear_solves_named_programs():
    """A per-example ``gmres`` on a matrix right-hand side (its derived transposed
    operator is a transposed batched product under ``vmap``) and a ``custom_linear_solve``
    whose operator reduces an array with a dimension of size 1: the loop's rewrites reach
    inside the solve's programs and keep them a named tuple (``jaxprs.solve``), where a
    plain tuple crashed (breaker, session 13); values as ``vmap`` gives them."""
    from jax.scipy.sparse.linalg import gmres

    def loss(w, x):  # one example: x of shape (4, 3)
        a = w @ w.T + 3 * jnp.eye(4) + x @ x.T
        y, _ = gmres(lambda v: a @ v, x)
        return jnp.sum(jnp.tanh(y) ** 2)

    w = jax.random.normal(jax.random.key(0), (4, 4)) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 4, 3))
    each = jax.vmap(jax.grad(loss), (None, 0))(w, x)
    norms = jnp.sqrt(jnp.sum(each.reshape(8, -1) ** 2, 1))
    fn = micro_grad(loss, microbatch_size=4, l2_clip_norm=0.1, clip_method="materialize",
                    keep_batch_dim=False)  # fmt: skip
    assert_close(fn(w, x)[0], jnp.tensordot(jnp.minimum(1.0, 0.1 / norms), each, 1), factor=100)

    def solve(a, b):
        def matvec(v):
            return a @ v + 0.0 * jnp.sum(v[None], axis=1)  # a reduction of (1, 4, 3)

        return jax.lax.custom_linear_solve(matvec, b, lambda _, r: jnp.linalg.solve(a, r))

    a = jax.random.normal(jax.random.key(2), (8, 4, 4)) + 4 * jnp.eye(4)[None]
    b = jax.random.normal(jax.random.key(3), (8, 4, 3))
    assert_close(micro_vmap(solve, microbatch_size=4)(a, b), jax.vmap(solve)(a, b), factor=100)


def test_a_swapped_product_swaps_its_operands_precisions():
    def fun(x, y):
        precision = (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)
        product = jax.lax.dot_general(x, y, (((1,), (1,)), ((0,), (0,))), precision=precision)
        return jnp.swapaxes(product, 1, 2)

    program = jax.make_jaxpr(fun)(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5)))
    (swap,) = [
        e
        for e, _ in equations(_swapped_always(program).jaxpr)
        if e.outvars[0].aval.shape == (2, 5, 4)
    ]
    assert swap.primitive.name == "dot_general"
    assert swap.params["precision"] == (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST)


def _swapped_always(program):
    """``_dots.swapped`` with its gate on, on any backend."""
    on = _workarounds.Workaround(jax.default_backend(), (), None, "")
    saved, _workarounds.DOT_ORDER = _workarounds.DOT_ORDER, on
    try:
        return _dots.swapped(program)
    finally:
        _workarounds.DOT_ORDER = saved
