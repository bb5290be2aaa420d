"""Convolutions in the loop body run in the order XLA:CPU runs fast, with unchanged results.

XLA:CPU reorders a convolution's dimensions for Eigen only outside loops; ``_convs`` does
it on ``fun``'s program. The reference is always the function without microbatching,
whose convolutions XLA reorders itself.
"""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxpr_as_fun

from microbatching import AccumulationType, micro_grad, micro_vmap, microbatch

from .strategies import assert_close

SUM, MEAN = AccumulationType.SUM, AccumulationType.MEAN
_EIGEN = re.compile(r"^b(\d*)f_(\d*)io->b(\d*)f$")


def other_order_convs(hlo: str) -> list[str]:
    """The ``dim_labels`` of the compiled convolutions that Eigen cannot run."""
    labels = re.findall(r"convolution\([^\n]*dim_labels=([\w>-]+)", hlo)
    assert labels, "no convolution in the program"
    return [label for label in labels if not _eigen_order(label)]


def _eigen_order(label: str) -> bool:
    found = _EIGEN.match(label)
    if found is None:
        return False
    spatial = "".join(str(i) for i in range(len(found.group(1))))
    return found.group(1) == found.group(2) == found.group(3) == spatial


def compiled(fun, *args) -> str:
    return str(jax.jit(fun).lower(*args).compile().as_text())


def compiled_and_run(fun, *args) -> tuple[str, Any]:
    """The HLO of ``jax.jit(fun)`` compiled for ``args``, and its result on them: one
    compilation for both."""
    executable = jax.jit(fun).lower(*args).compile()
    return str(executable.as_text()), executable(*args)


def cnn_loss(p, x, y):
    """Two strided 3x3 convolutions and a dense layer on NHWC images; mean cross-entropy."""
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, p["c1"], (2, 2), "SAME", dimension_numbers=dims)
    h = jax.lax.conv_general_dilated(
        jax.nn.relu(h), p["c2"], (2, 2), "SAME", dimension_numbers=dims
    )
    logits = jax.nn.relu(h).reshape(h.shape[0], -1) @ p["d"]
    picked = jnp.take_along_axis(logits, y[:, None], 1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


@pytest.fixture(scope="module")
def cnn():
    rng = np.random.default_rng(0)
    p = {
        "c1": jnp.asarray(rng.normal(size=(3, 3, 1, 4)) / 3, jnp.float32),
        "c2": jnp.asarray(rng.normal(size=(3, 3, 4, 8)) / 6, jnp.float32),
        "d": jnp.asarray(rng.normal(size=(4 * 4 * 8, 3)) / 11, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(32, 14, 14, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, size=32), jnp.int32)
    return p, x, y


@pytest.fixture(scope="module")
def cnn_value_and_grad(cnn):
    """The reference: ``jax.value_and_grad(cnn_loss)`` of the whole batch."""
    return jax.jit(jax.value_and_grad(cnn_loss))(*cnn)


@pytest.mark.compiled
def test_the_gradient_in_the_loop_runs_every_convolution_in_eigen_order(cnn, cnn_value_and_grad):
    """The weight gradient of a convolution reads its input with batch and feature
    swapped; in the loop that ran as a loop nest, 10x slower than outside it."""
    p, x, y = cnn
    looped = microbatch(jax.grad(cnn_loss), (1, 2), 8, MEAN)
    hlo, got = compiled_and_run(looped, p, x, y)
    assert other_order_convs(hlo) == []
    assert_close(got, cnn_value_and_grad[1], terms=4)


@pytest.mark.compiled
def test_micro_grad_and_clipping_run_every_convolution_in_eigen_order(cnn):
    p, x, y = cnn
    per_example = jax.jit(jax.vmap(jax.grad(cnn_loss), (None, 0, 0)))(p, x[:, None], y[:, None])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(32, -1) ** 2, 1) for g in jax.tree.leaves(per_example)))
    scale = jnp.minimum(1.0, 0.5 / norms)
    clipped_sum = jax.tree.map(
        lambda g: np.einsum("b...,b->...", np.float64(g), np.float64(scale)), per_example
    )
    for clip in (None, 0.5):
        grad = micro_grad(cnn_loss, batch_argnums=(1, 2), microbatch_size=8, l2_clip_norm=clip)
        hlo, got = compiled_and_run(lambda *a: grad(*a)[0], p, x, y)  # noqa: B023
        assert other_order_convs(hlo) == []
        want = clipped_sum if clip else jax.tree.map(lambda g: g.sum(0), per_example)
        assert_close(got, want, terms=32)


@pytest.mark.compiled
def test_gradients_through_the_loop_run_every_convolution_in_eigen_order(cnn, cnn_value_and_grad):
    """``jax.grad`` of the loop is JAX's transpose of it; each convolution's custom_jvp
    (``_convs._eigen``) makes that transpose come out in Eigen's order too."""
    p, x, y = cnn
    through = jax.grad(microbatch(cnn_loss, (1, 2), 8, MEAN))
    hlo, got = compiled_and_run(through, p, x, y)
    assert other_order_convs(hlo) == []
    assert_close(got, cnn_value_and_grad[1], terms=4)
    both = jax.value_and_grad(microbatch(cnn_loss, (1, 2), 8, MEAN))
    assert_close(jax.jit(both)(p, x, y), cnn_value_and_grad, terms=4)


def test_hessian_vector_products_through_the_rule(cnn):
    """Forward over reverse goes through the custom_jvp's rule, itself differentiated."""
    p, x, y = cnn
    looped = microbatch(cnn_loss, (1, 2), 8, MEAN)
    tangent = jax.tree.map(lambda a: jnp.full_like(a, 0.1), p)

    def hvp(f):
        return jax.jvp(lambda q: jax.grad(f)(q, x, y), (p,), (tangent,))[1]

    assert_close(jax.jit(lambda: hvp(looped))(), hvp(cnn_loss), terms=4, factor=8)


_LAYOUTS = {
    1: [("NWC", "WIO", "NWC"), ("NCW", "OIW", "NCW"), ("WNC", "IWO", "CWN")],
    2: [("NCHW", "OIHW", "NCHW"), ("NHWC", "OHWI", "NCHW"), ("HWNC", "IOHW", "CNHW")],
    3: [("NDHWC", "DHWIO", "NDHWC"), ("NCDHW", "OIDHW", "NCDHW")],
}


@st.composite
def convolutions(draw):
    """A convolution in some dimension order, with strides, dilations and groups."""
    spatial = draw(st.sampled_from([1, 2, 3]))
    lhs, rhs, out = draw(st.sampled_from(_LAYOUTS[spatial]))
    groups = draw(st.sampled_from([1, 2]))
    size = 5 if spatial == 3 else 7
    return {
        "spatial": spatial,
        "dimension_numbers": (lhs, rhs, out),
        "window_strides": (draw(st.sampled_from([1, 2])),) * spatial,
        "rhs_dilation": (draw(st.sampled_from([1, 2])),) * spatial,
        "lhs_dilation": (draw(st.sampled_from([1, 2])),) * spatial,
        "padding": ((draw(st.sampled_from([0, 1])), 1),) * spatial,
        "feature_group_count": groups,
        "size": size,
        "seed": draw(st.integers(0, 2**16)),
    }


def _operands(conv, rows: int):
    """Input and kernel laid out as the convolution's dimension numbers say."""
    lhs, rhs, _ = conv["dimension_numbers"]
    groups, spatial = conv["feature_group_count"], conv["spatial"]
    channels = {"N": rows, "C": 2 * groups}
    shape_x = [channels.get(d, conv["size"]) for d in lhs]
    kernel = {"O": 2 * groups, "I": 2}
    shape_w = [kernel.get(d, 2) for d in rhs]
    rng = np.random.default_rng(conv["seed"])
    x = jnp.asarray(rng.normal(size=shape_x), jnp.float32)
    w = jnp.asarray(rng.normal(size=shape_w) / (2 * 2**spatial), jnp.float32)
    return w, x, lhs.index("N")


def _conv_loss(conv):
    params = {
        k: conv[k]
        for k in (
            "dimension_numbers",
            "window_strides",
            "rhs_dilation",
            "lhs_dilation",
            "padding",
            "feature_group_count",
        )
    }

    def loss(w, x):
        out = jax.lax.conv_general_dilated(x, w, **params)
        return jnp.sum(jnp.tanh(out))

    return loss


@pytest.mark.compiled
@settings(max_examples=12, deadline=None)
@given(convolutions())
def test_any_convolution_in_the_loop_gives_the_whole_batch_s_gradient(conv):
    w, x, axis = _operands(conv, rows=4)
    loss = _conv_loss(conv)
    # The weights' axis 0 may have the batch's 4 rows: meant whole (no UnsplitBatchWarning).
    looped = microbatch(jax.grad(loss), 1, 2, SUM, in_axes=axis, whole_argnums=0)
    if conv["feature_group_count"] == 1:
        # XLA's own passes turn some (a weight gradient with input dilation) into an order
        # Eigen does not take, for the whole batch as well: the loop is held to the same.
        # The weight gradient of a grouped convolution is not held to it: XLA expands its
        # batch groups after the rewrite, into a convolution that only its entry
        # computation reorders (see _convs).
        whole_hlo, want = compiled_and_run(jax.grad(loss), w, x)
        hlo, got = compiled_and_run(looped, w, x)
        assert sorted(other_order_convs(hlo)) == sorted(other_order_convs(whole_hlo))
    else:
        got, want = jax.jit(looped)(w, x), jax.jit(jax.grad(loss))(w, x)
    assert_close(got, want, terms=2)


@pytest.mark.parametrize("layout", [_LAYOUTS[2][0], _LAYOUTS[1][2]])
def test_reordered_convolutions_compose_with_grad_jvp_and_vmap(layout):
    """The reordered program is differentiated and batched as the original one."""
    conv = {
        "spatial": len(layout[0]) - 2,
        "dimension_numbers": layout,
        "window_strides": (2,) * (len(layout[0]) - 2),
        "rhs_dilation": (1,) * (len(layout[0]) - 2),
        "lhs_dilation": (1,) * (len(layout[0]) - 2),
        "padding": ((1, 1),) * (len(layout[0]) - 2),
        "feature_group_count": 1,
        "size": 6,
        "seed": 3,
    }
    w, x, axis = _operands(conv, rows=4)
    loss = _conv_loss(conv)
    looped = microbatch(loss, 1, 2, SUM, in_axes=axis, whole_argnums=0)  # as above
    assert_close(jax.jit(jax.grad(looped))(w, x), jax.grad(loss)(w, x), terms=2)
    tangent = jnp.ones_like(w)
    assert_close(
        jax.jvp(looped, (w, x), (tangent, jnp.zeros_like(x))),
        jax.jvp(loss, (w, x), (tangent, jnp.zeros_like(x))),
        terms=2,
    )
    ws = jnp.stack([w, 2 * w])
    assert_close(
        jax.vmap(jax.grad(looped), (0, None))(ws, x),
        jax.vmap(jax.grad(loss), (0, None))(ws, x),
        terms=2,
    )
    one = lambda w, row: loss(w, jnp.expand_dims(row, axis))  # noqa: E731
    per_row = micro_vmap(one, (None, axis), microbatch_size=2)
    assert_close(jax.jit(per_row)(w, x), jax.vmap(one, (None, axis))(w, x))


@pytest.mark.compiled
def test_convolutions_inside_jit_and_checkpoint_of_fun_are_reordered(cnn, cnn_value_and_grad):
    """The rewrite reaches programs that ``fun`` calls (``jit``, ``checkpoint``)."""
    p, x, y = cnn
    inner = jax.jit(jax.checkpoint(jax.grad(cnn_loss)))
    looped = microbatch(lambda p, x, y: inner(p, x, y), (1, 2), 8, MEAN)
    hlo, got = compiled_and_run(looped, p, x, y)
    assert other_order_convs(hlo) == []
    assert_close(got, cnn_value_and_grad[1], terms=4)


def test_only_convolutions_eigen_runs_are_reordered():
    """Just outside the rewrite's condition: 4 spatial dimensions (Eigen takes 1 to 3)
    stay as they are; a 2-D one in another order is reordered, to the same values."""
    from microbatching._xla_cpu import convs as _convs

    def program(spatial):
        lhs = "NC" + "DHWT"[:spatial]
        dims = (lhs, "OI" + "DHWT"[:spatial], lhs)
        x = jnp.ones((2, 3) + (4,) * spatial)
        w = jnp.ones((2, 3) + (2,) * spatial)
        conv = lambda x, w: jax.lax.conv_general_dilated(  # noqa: E731
            x, w, (1,) * spatial, "VALID", dimension_numbers=dims
        )
        return jax.make_jaxpr(conv)(x, w), (x, w)

    four, _ = program(4)
    assert _convs.canonical(four) is four
    two, args = program(2)
    reordered = _convs.canonical(two)
    assert reordered is not two
    assert [e.primitive.name for e in reordered.eqns].count("transpose") == 3
    assert_close(
        jax.jit(jaxpr_as_fun(reordered))(*args),
        jaxpr_as_fun(two)(*args),
    )
