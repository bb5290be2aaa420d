"""Equinox with microbatching: gradient accumulation for an ``eqx.Module``, trained with optax.

An Equinox model is a pytree whose leaves are its arrays and whose static parts
(activation functions, sizes) ride along in the tree structure. Two ways to hand it to
``microbatching``:

1. ``eqx.filter_value_and_grad(loss)`` *inside* ``microbatch``: the model is an ordinary
   non-batched argument, the filter differentiates its floating-point arrays, and
   ``microbatch`` averages ``(loss, grads)`` over the microbatches (``MEAN``). The
   gradient is a model-shaped pytree with None where nothing was differentiated.
2. ``eqx.partition`` / ``eqx.combine`` around ``jax.grad(microbatch(loss))``: split the
   model into its trainable arrays and the rest once, write the loss as a function of the
   arrays, and differentiate the microbatched loss with plain JAX.

Both are checked against the whole-batch gradient, then the model is trained a few steps
with each, with Adam from optax (``eqx.filter_jit`` compiles the step), on a synthetic
regression task: fit ``y = sin(3 x_0) + x_1 x_2`` with an MLP.

Run::

    python examples/equinox_model.py           # 300 steps, about 15 s on 2 CPUs
    python examples/equinox_model.py --quick   # a few steps on tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from checks import assert_trees_close

from microbatching import AccumulationType, microbatch

NUM_FEATURES = 8


@jax.jit(static_argnums=1)
def make_data(key: jax.Array, num_examples: int) -> tuple[jax.Array, jax.Array]:
    """Uniform features in [-1, 1] and a smooth nonlinear target with a little noise."""
    k_x, k_noise = jax.random.split(key)
    x = jax.random.uniform(k_x, (num_examples, NUM_FEATURES), minval=-1.0, maxval=1.0)
    y = jnp.sin(3.0 * x[:, 0]) + x[:, 1] * x[:, 2]
    return x, y + 0.05 * jax.random.normal(k_noise, (num_examples,))


def mean_squared_error(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """The mean squared error of an Equinox MLP, which maps one example: vmap it."""
    predictions = jax.vmap(model)(x)[:, 0]
    return jnp.mean((predictions - y) ** 2)


def filtered_loss_and_grad(microbatch_size: int) -> Any:
    """Way 1: ``eqx.filter_value_and_grad`` inside ``microbatch``."""
    return microbatch(
        eqx.filter_value_and_grad(mean_squared_error),
        argnums=(1, 2),
        microbatch_size=microbatch_size,
        accumulator=AccumulationType.MEAN,
    )


def partitioned_loss_and_grad(static: Any, microbatch_size: int) -> Any:
    """Way 2: the loss of the trainable arrays, microbatched, then differentiated."""

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return mean_squared_error(eqx.combine(params, static), x, y)

    mean_loss = microbatch(
        loss, argnums=(1, 2), microbatch_size=microbatch_size, accumulator=AccumulationType.MEAN
    )
    return jax.value_and_grad(mean_loss)


def check_gradients(model: eqx.nn.MLP, x: jax.Array, y: jax.Array, microbatch_size: int) -> None:
    """Both ways against ``eqx.filter_grad`` of the whole batch, in one compiled call."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    way1 = filtered_loss_and_grad(microbatch_size)
    way2 = partitioned_loss_and_grad(static, microbatch_size)

    @eqx.filter_jit
    def gradients(model: eqx.nn.MLP, params: Any, x: jax.Array, y: jax.Array) -> Any:
        return (
            way1(model, x, y)[1],
            way2(params, x, y)[1],
            eqx.filter_grad(mean_squared_error)(model, x, y),
        )

    filtered, partitioned, whole = gradients(model, params, x, y)
    whole_batch = "jax.grad of the whole batch"
    assert_trees_close(filtered, whole, "microbatch(eqx.filter_value_and_grad(loss))", whole_batch)
    assert_trees_close(
        partitioned,
        eqx.filter(whole, eqx.is_inexact_array),
        "jax.grad(microbatch(loss)) with eqx.partition/combine",
        whole_batch,
    )


def train(args: argparse.Namespace) -> None:
    """Checks the gradients, then trains the same initial model both ways."""
    k_data, k_model, k_batches = jax.random.split(jax.random.key(args.seed), 3)
    x, y = make_data(k_data, args.train_size + args.test_size)
    x_train, y_train = x[: args.train_size], y[: args.train_size]
    x_test, y_test = x[args.train_size :], y[args.train_size :]
    initial = eqx.filter_jit(eqx.nn.MLP)(
        NUM_FEATURES, 1, args.hidden, depth=2, activation=jax.nn.gelu, key=k_model
    )

    @jax.jit
    def batch(step: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Examples drawn with replacement, a fresh draw at each step."""
        rows = jax.random.randint(
            jax.random.fold_in(k_batches, step), (args.batch_size,), 0, args.train_size
        )
        return x_train[rows], y_train[rows]

    x0, y0 = batch(0)
    check_gradients(initial, x0, y0, args.microbatch_size)
    optimizer = optax.adam(args.learning_rate)
    test_error = eqx.filter_jit(mean_squared_error)

    # Way 1: the whole model goes in; the gradient is a model with None for static parts.
    loss_and_grad = filtered_loss_and_grad(args.microbatch_size)

    @eqx.filter_jit
    def filtered_step(model: eqx.nn.MLP, state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = loss_and_grad(model, x, y)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    # Way 2: only the arrays go in and out; the static part is closed over.
    params, static = eqx.partition(initial, eqx.is_inexact_array)
    value_and_grad = partitioned_loss_and_grad(static, args.microbatch_size)

    @jax.jit
    def partitioned_step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = value_and_grad(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    print(f"\nbatch {args.batch_size}, microbatch {args.microbatch_size}, Adam")
    print("  step  way 1 loss  way 2 loss")
    model, state1 = initial, optimizer.init(eqx.filter(initial, eqx.is_inexact_array))
    state2 = optimizer.init(params)
    start = time.perf_counter()
    for step in range(args.steps):
        xb, yb = batch(step)
        model, state1, loss1 = filtered_step(model, state1, xb, yb)
        params, state2, loss2 = partitioned_step(params, state2, xb, yb)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  {step:4d}  {float(loss1):10.4f}  {float(loss2):10.4f}")
    print(f"  ({time.perf_counter() - start:.1f} s for both, with compilation)")
    error1 = float(test_error(model, x_test, y_test))
    error2 = float(test_error(eqx.combine(params, static), x_test, y_test))
    print(f"test mean squared error: way 1 {error1:.4f}, way 2 {error2:.4f}")
    if not np.isclose(error1, error2, rtol=1e-3, atol=1e-5):
        raise AssertionError("the two ways trained different models")


def parse_args() -> argparse.Namespace:
    """The command-line flags; ``--quick`` shrinks every size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few steps on tiny sizes")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--train-size", type=int, default=16384)
    parser.add_argument("--test-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--microbatch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.train_size, args.test_size = 3, 512, 128
        args.batch_size, args.microbatch_size, args.hidden = 64, 16, 16
    args.log_every = max(1, args.steps // 10)
    return args


if __name__ == "__main__":
    train(parse_args())
