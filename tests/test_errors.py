"""Every user error: its type, and a message naming the argument, the value and the fix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbatching import (
    AccumulationType,
    micro_grad,
    micro_vmap,
    microbatch,
    reshape_batch_axis,
)


def pair(x, y):
    return jnp.sum(x) + jnp.sum(y)


X = jnp.ones((8, 3))


@pytest.mark.parametrize("size", [0, -2])
def test_microbatch_size_not_positive(size):
    with pytest.raises(
        ValueError, match=f"microbatch_size must be a positive int, got microbatch_size={size}"
    ):
        microbatch(pair, 0, size)


@pytest.mark.parametrize("size", [2.0, "4", True])
def test_microbatch_size_not_an_int(size):
    with pytest.raises(
        TypeError, match=re.escape(f"microbatch_size must be a positive int or None, got {size!r}")
    ):
        microbatch(pair, 0, size)


def test_argnums_out_of_range():
    with pytest.raises(
        ValueError, match=r"argnums contains 2, out of range for pair\(x, y\) with 2 positional"
    ):
        microbatch(pair, 2, 4)


def test_argnums_not_ints():
    with pytest.raises(
        TypeError, match="argnums must be an int or a sequence of ints, got argnums='x'"
    ):
        microbatch(pair, "x", 4)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
    "transform, keyword, value, says",
    [
        (microbatch, "batch_argnums", 1, "microbatch names its batch arguments by argnums="),
        (micro_vmap, "argnums", 1, "micro_vmap takes its batch axes as in_axes=, as jax.vmap"),
        (micro_vmap, "batch_argnums", 1, "(in_axes=(None, 0) for fun(params, x))"),
        (micro_grad, "in_axes", (None, 0), "micro_grad names its batch arguments by batch_argn"),
        (micro_grad, "argnames", "y", "its argnums= are the parameters differentiated"),
    ],
)
def test_another_transforms_keyword_for_the_batch_names_our_own(transform, keyword, value, says):
    """A keyword for the batch arguments that only another transform takes (code moved
    from micro_grad to microbatch) is named, with its value, and our own way."""
    with pytest.raises(TypeError) as info:
        transform(pair, microbatch_size=4, **{keyword: value})
    message = str(info.value)
    assert message.startswith(f"{transform.__name__} takes no argument {keyword}= (given "), message
    assert f"(given {value!r}): " in message and says in message, message


def test_transforms_keep_their_signatures_and_names():
    import inspect

    assert list(inspect.signature(microbatch).parameters)[:3] == [
        "fun",
        "argnums",
        "microbatch_size",
    ]
    assert [t.__name__ for t in (microbatch, micro_vmap, micro_grad)] == [
        "microbatch", "micro_vmap", "micro_grad"
    ]  # fmt: skip


def test_argnums_repeated():
    with pytest.raises(ValueError, match=r"argnums must not repeat an index, got argnums=\(0, 0\)"):
        microbatch(pair, (0, 0), 4)


def test_negative_argnums_with_var_positional():
    with pytest.raises(ValueError, match="argnums contains -1, but negative indices need"):
        microbatch(lambda *args: args, -1, 4)


def test_unknown_argnames():
    with pytest.raises(
        ValueError, match=r"argnames contains 'z', which is not a keyword parameter of pair\(x, y\)"
    ):
        microbatch(pair, (), 4, argnames="z")


def test_argnames_not_strings():
    with pytest.raises(
        TypeError, match=r"argnames must be a str or a sequence of str, got argnames=\(1,\)"
    ):
        microbatch(pair, (), 4, argnames=(1,))  # pyright: ignore[reportArgumentType]


def test_no_batch_argument_named():
    with pytest.raises(ValueError, match="argnums and argnames are both empty"):
        microbatch(pair, (), 4)


def test_argument_named_twice():
    with pytest.raises(
        ValueError, match=r"Argument `x` of pair is named twice, by argnums \(0\) and by argnames"
    ):
        microbatch(pair, 0, 4, argnames="x")


def test_in_axes_length_mismatch():
    with pytest.raises(
        ValueError, match=r"in_axes has 3 entries but argnums=.* name 2 batch argument"
    ):
        microbatch(pair, (0, 1), 4, in_axes=(0, 0, 0))


def test_in_axes_wrong_type():
    with pytest.raises(
        TypeError, match=r"in_axes\[1\] must be an int, None or a pytree of them, got 'a'"
    ):
        microbatch(pair, (0, 1), 4, in_axes=(0, "a"))


def test_in_axes_outside_the_rank():
    with pytest.raises(
        ValueError,
        match=r"in_axes gives axis 2 for batch argument `x` of shape \(8, 3\) \(rank 2\); use an axis in \[-2, 2\)",
    ):
        microbatch(pair, 0, 4, in_axes=2)(X, 1.0)


def test_in_axes_not_a_prefix_of_the_argument():
    with pytest.raises(
        ValueError, match=r"The in_axes entry \(0, 0\) for argument `x` is not a pytree prefix"
    ):
        microbatch(pair, 0, 4, in_axes=((0, 0),))({"a": X}, 1.0)


def test_unequal_batch_sizes_lists_every_argument():
    expected = (
        r"Batch arguments of pair must have equal batch sizes, got \[8, 6\]: `x` axis 0 of shape \(8, 3\); "
        r"`y\['b'\]` axis 1 of shape \(2, 6\)"
    )
    with pytest.raises(ValueError, match=expected):
        microbatch(pair, (0, 1), 2, in_axes=(0, 1))(X, {"b": jnp.ones((2, 6))})


def test_batch_not_divisible():
    expected = (
        r"The batch size 8 \(`x` axis 0 of shape \(8, 3\)\) is not divisible by microbatch_size=3\. "
        r"Pass allow_remainder=True to "
        r"run 2 microbatches of 3 rows and one of the last 2; or use a microbatch_size that "
        r"divides 8, such as one of \[2, 4\]\."
    )
    with pytest.raises(ValueError, match=expected):
        microbatch(pair, 0, 3)(X, 1.0)


def test_a_batch_size_error_names_the_argument_it_read_the_size_from():
    """``argnums=0`` where the parameters are not the batch: the message points at them."""

    def loss(w, x):
        return jnp.sum((x @ w.T) ** 2)

    with pytest.raises(
        ValueError,
        match=r"^The batch size 16 \(`w` axis 0 of shape \(16, 3\)\) is smaller than "
        r"microbatch_size=100\. ",
    ):
        microbatch(loss, argnums=0, microbatch_size=100)(jnp.ones((16, 3)), jnp.ones((64, 3)))


def test_batch_not_divisible_suggests_the_nearest_divisors():
    with pytest.raises(
        ValueError, match=r"microbatch_size=48\. .* such as one of \[8, 16, 32, 64\]"
    ):
        microbatch(jnp.sum, 0, 48)(jnp.ones(4096))


def test_batch_not_divisible_by_a_prime_size_says_so():
    # Issue 8: 10007 is prime; the old advice listed [1, 10007].
    expected = (
        r"The batch size 10007 \(`x` axis 0 of shape \(10007,\)\) is not divisible by "
        r"microbatch_size=64\. Pass allow_remainder=True "
        r"to run 156 microbatches of 64 rows and one of the last 23 \(10007 is prime: only 1 "
        r"and 10007 divide it\)\. To keep one compiled shape for batches "
        r"of varying size, pad them to a fixed size and pass example_weights that are 0 on the "
        r"padding rows\."
    )
    with pytest.raises(ValueError, match=expected):
        micro_vmap(jnp.sin, microbatch_size=64)(jnp.ones(10007))


def test_accumulator_not_a_prefix_of_the_output():
    fun = lambda x: (jnp.sum(x), x)  # noqa: E731
    acc = (AccumulationType.SUM, AccumulationType.CONCAT, AccumulationType.SUM)
    with pytest.raises(
        ValueError,
        match=r"The accumulator structure .* is not a pytree prefix of the structure of "
        r"fun's output, PyTreeDef\(\(\*, \*\)\); give one accumulator",
    ):
        microbatch(fun, 0, 4, acc)(X)


@pytest.mark.parametrize(
    "accumulator, transform, structure",
    [
        ({"a": AccumulationType.SUM}, lambda g: (g, g), r"\(\*, \*\)"),
        ((AccumulationType.SUM,) * 3, lambda g: (g, g), r"\(\*, \*\)"),
        ((AccumulationType.MEAN,) * 2, lambda g: g, r"\*"),
    ],
    ids=["dict for a tuple", "three for two", "a tuple for one array"],
)
def test_micro_grad_accumulator_not_a_prefix_of_the_transform_output(
    accumulator, transform, structure
):
    """Named at the call, against transform_fn's output, not the loop's pair of outputs
    (breaker round 23: JAX's 'Expected dict, got (JitTracer...)' before)."""
    loss = lambda p, x: jnp.sum((x @ p) ** 2)  # noqa: E731
    fn = micro_grad(loss, microbatch_size=4, accumulator=accumulator, transform_fn=transform)
    with pytest.raises(
        ValueError,
        match=r"^The accumulator structure PyTreeDef\(.*\) is not a pytree prefix of the "
        r"structure of transform_fn's output \(the gradient by default\), PyTreeDef\("
        + structure
        + r"\); give one accumulator, or a tree that matches the output",
    ):
        fn(jnp.ones((3, 2)), jnp.ones((8, 3)))


def test_accumulator_leaf_of_the_wrong_type():
    with pytest.raises(
        TypeError,
        match="accumulator leaves must be AccumulationType or Accumulator, got 'sum' of type str",
    ):
        # A type error too: pyright's reportUnnecessaryTypeIgnoreComment (pyproject.toml)
        # fails the lint if this comment is ever not needed.
        microbatch(pair, 0, 4, accumulator="sum")  # pyright: ignore[reportArgumentType]


@pytest.mark.x64
@pytest.mark.parametrize("kind", ["MEAN", "RUNNING_MEAN"])
def test_mean_of_integers(kind):
    fun = lambda x: jnp.sum(x)  # noqa: E731
    summed = jnp.sum(jnp.ones(8, jnp.int32)).dtype  # int32, or int64 under JAX_ENABLE_X64
    message = f"AccumulationType.{kind} needs floating-point results, but fun returned a leaf of dtype {summed}"
    with pytest.raises(ValueError, match=message):
        microbatch(fun, 0, 4, AccumulationType[kind])(jnp.ones(8, jnp.int32))


def test_mean_of_an_integer_aux_names_the_leaf_and_has_aux():
    """A new user's trip: ``jax.grad(microbatch(loss_with_aux))`` with an integer in the
    aux. The message names the leaf, gives each output its own accumulator, and says
    how ``jax.grad`` takes a (loss, aux) pair."""

    def loss(p, x):
        return jnp.sum((x @ p) ** 2), jnp.argmax(x[0])

    step = microbatch(loss, argnums=1, microbatch_size=4, accumulator=AccumulationType.MEAN)
    p, x = jnp.ones(3), jnp.ones((8, 3))
    with pytest.raises(
        ValueError,
        match=r"^AccumulationType\.MEAN needs floating-point results, but fun returned a leaf "
        r"at \[1\] of dtype int(32|64) and shape \(\); cast it to a float dtype inside fun, or "
        r"accumulate it with AccumulationType\.SUM\. fun returns several outputs, and one "
        r"accumulator applies to all of them: give each its own, e\.g\. "
        r"accumulator=\(AccumulationType\.MEAN, AccumulationType\.SUM\) for a \(loss, aux\) "
        r"pair\. If that pair is a loss and its auxiliary data, its gradient is "
        r"jax\.grad\(\.\.\., has_aux=True\) of the microbatched function \(without has_aux, "
        r"jax\.grad refuses a pair\)\.",
    ):
        jax.grad(step)(p, x)
    fixed = microbatch(
        loss,
        argnums=1,
        microbatch_size=4,
        accumulator=(AccumulationType.MEAN, AccumulationType.SUM),
    )
    got, aux = jax.grad(fixed, has_aux=True)(p, x)
    want = jax.grad(lambda p: loss(p, x)[0])(p) / 2  # the mean of two microbatches' sums
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert int(aux) == 0


def test_transform_fn_on_a_dict_of_parameters_says_it_gets_the_pytree():
    def loss(params, x):
        return jnp.sum((x @ params["w"]) ** 2)

    step = micro_grad(loss, microbatch_size=4, transform_fn=lambda g: (g, g**2))
    with pytest.raises(TypeError, match=r"unsupported operand type") as caught:
        step({"w": jnp.ones(3)}, jnp.ones((8, 3)))
    assert caught.value.__notes__[0] == (
        "(microbatching: transform_fn receives one example's gradient as a pytree shaped "
        "like the differentiated arguments, e.g. a dict of parameters, not one array: apply "
        "a per-array function with jax.tree.map, e.g. transform_fn=lambda g: (g, "
        "jax.tree.map(jnp.square, g)).)"
    )


@pytest.mark.x64
@pytest.mark.parametrize("kind", ["MEAN", "RUNNING_MEAN"])
def test_micro_vmap_mean_of_integers_is_a_float_mean_as_in_optax(kind):
    got = micro_vmap(lambda x: x, microbatch_size=4, accumulator=AccumulationType[kind])(
        jnp.arange(8, dtype=jnp.int32)
    )
    assert jnp.issubdtype(got.dtype, jnp.floating)
    assert float(got) == 3.5


@pytest.mark.x64
@pytest.mark.parametrize("leaf", [3, [1.0, 2.0], "abc"])
def test_batch_leaf_not_an_array(leaf):
    with pytest.raises(TypeError, match=r"Batch argument `x.*` is a (int|float|str), not an array"):
        microbatch(pair, 0, 1)(leaf, 1.0)


def test_static_num_real_microbatches_too_large():
    with pytest.raises(
        ValueError,
        match="num_real_microbatches=5 exceeds the number of microbatches, 4; pass at most 4",
    ):
        microbatch(pair, 0, 2, num_real_microbatches=5)(X, 1.0)


def test_num_real_microbatches_negative():
    with pytest.raises(
        ValueError, match="num_real_microbatches must be non-negative, got num_real_microbatches=-1"
    ):
        microbatch(pair, 0, 2, num_real_microbatches=-1)


@pytest.mark.x64
def test_num_real_microbatches_not_an_integer():
    with pytest.raises(
        TypeError, match="num_real_microbatches must be None, an int or an integer scalar array"
    ):
        microbatch(pair, 0, 2, num_real_microbatches=jnp.float32(2))


def test_missing_batch_argument_at_call():
    with pytest.raises(
        TypeError,
        match=r"argnums includes 1, but pair was called with 1 positional argument.* and no keyword argument `y`",
    ):
        microbatch(pair, 1, 2)(X)  # pyright: ignore[reportCallIssue]
    with pytest.raises(
        TypeError,
        match=r"argnames includes 'y', but pair was called without it \(keyword arguments given: \[\]\)",
    ):
        microbatch(pair, (), 2, argnames="y")(X)  # pyright: ignore[reportCallIssue]


def test_not_callable():
    with pytest.raises(TypeError, match="fun must be callable, got fun=3; pass a function"):
        microbatch(3, 0, 2)  # pyright: ignore[reportArgumentType]


def test_micro_vmap_out_axes():
    with pytest.raises(
        NotImplementedError, match="micro_vmap supports only out_axes=0, got out_axes=1"
    ):
        micro_vmap(jnp.sin, out_axes=1)


def test_micro_vmap_in_axes_length_differs_from_the_call():
    with pytest.raises(
        ValueError, match=r"in_axes has 1 entries but add was called with 2 positional argument"
    ):
        micro_vmap(jnp.add, (0,), microbatch_size=2)(X, X)


def test_micro_vmap_nothing_to_map():
    with pytest.raises(ValueError, match="micro_vmap of sin has nothing to map"):
        micro_vmap(jnp.sin, (None,), microbatch_size=2)(X)


def test_micro_vmap_in_axes_wrong_type():
    with pytest.raises(
        TypeError,
        match="in_axes must be an int or a sequence with one entry per positional argument",
    ):
        micro_vmap(jnp.sin, "0")


def test_micro_grad_batch_argnums_out_of_range():
    with pytest.raises(
        ValueError, match=r"batch_argnums contains 3, out of range for pair\(x, y\)"
    ):
        micro_grad(pair, batch_argnums=3)


def test_micro_grad_batch_argnums_empty():
    with pytest.raises(ValueError, match="batch_argnums is empty; name at least one argument"):
        micro_grad(pair, batch_argnums=())


def test_argnums_for_a_function_without_positional_parameters():
    with pytest.raises(
        ValueError,
        match=r"with 0 positional parameter.*name keyword parameters with argnames instead",
    ):
        microbatch(lambda *, x: x, 0, 2)


def test_scalar_batch_leaf():
    with pytest.raises(
        ValueError, match=r"Batch argument `x` is a scalar \(shape \(\)\), so it has no batch axis"
    ):
        microbatch(pair, 0, 1)(jnp.float32(1), 1.0)


@pytest.mark.x64
def test_concrete_num_real_microbatches_too_large_from_numpy():
    with pytest.raises(
        ValueError, match="num_real_microbatches=9 exceeds the number of microbatches, 4"
    ):
        microbatch(pair, 0, 2, num_real_microbatches=np.int64(9))(X, 1.0)


@pytest.mark.parametrize(
    ("transform", "hint"),
    [
        (
            lambda f: micro_vmap(f, microbatch_size=2),
            "pass it by position with in_axes None, or bind it",
        ),
        (
            lambda f: micro_grad(f, microbatch_size=2),
            "pass it by position, outside batch_argnums, or bind it",
        ),
    ],
)
def test_mapped_keyword_argument_that_is_not_an_array(transform, hint):
    def loss(w, x, **options):
        return jnp.sum(w * x)

    with pytest.raises(
        TypeError,
        match=rf"maps keyword arguments that name no positional parameter along axis 0, as jax.vmap does, but `train` is False, not an array with a batch axis; {hint}",
    ):
        transform(loss)(jnp.ones(3), X, train=False)


def test_mapped_keyword_only_argument_that_is_not_an_array():
    def loss(w, x, *, train):
        return jnp.sum(w * x)

    with pytest.raises(
        TypeError,
        match=r"but `train` is False, not an array with a batch axis; bind it with functools\.partial\.",
    ):
        micro_grad(loss, microbatch_size=2)(jnp.ones(3), X, train=False)


def test_reshape_batch_axis_axis_out_of_range():
    with pytest.raises(ValueError, match=r"axis=3 is out of range for a leaf of shape \(8, 3\)"):
        reshape_batch_axis(X, 2, axis=3)


def test_micro_grad_called_without_the_batch():
    with pytest.raises(
        TypeError,
        match=r"batch_argnums includes 1, but pair was called with 1 positional argument\(s\) and no keyword argument `y`",
    ):
        micro_grad(pair)(X)


def test_reshape_batch_axis_not_divisible():
    with pytest.raises(
        ValueError,
        match=r"The batch axis 0 of a leaf of shape \(8, 3\) is not divisible by microbatch_size=3",
    ):
        reshape_batch_axis(X, 3)


def test_errors_are_raised_under_jit_too():
    with pytest.raises(ValueError, match="not divisible"):
        jax.jit(microbatch(pair, 0, 3))(X, 1.0)
    with pytest.raises(ValueError, match="not divisible"):
        jax.eval_shape(microbatch(pair, 0, 3), jax.ShapeDtypeStruct((8, 3), np.float32), 1.0)
