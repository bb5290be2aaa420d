"""Flax NNX with microbatching: DP-SGD with ``micro_grad`` and gradient accumulation.

An ``nnx.Module`` holds its parameters as attributes, while the transforms of
``microbatching`` differentiate pytrees of arrays. ``nnx.split`` bridges the two: it
turns the model into a static ``graphdef`` and ``nnx.State`` pytrees (here its
``nnx.Param``s and everything else), and ``nnx.merge`` rebuilds a model from them inside
the loss. The loss then takes the parameter state as an ordinary argument, which
``micro_grad`` and ``jax.grad`` can differentiate, and ``nnx.Optimizer`` applies the
resulting ``nnx.State`` of gradients to the model.

Two trainings of the same MLP on a synthetic classification task (labels from a random
"teacher" network):

1. DP-SGD: ``micro_grad(loss, l2_clip_norm=C)`` sums per-example gradients clipped to
   norm ``C``, ``microbatch_size`` examples at a time; Gaussian noise is added and the
   update divided by the batch size. Checked once against per-example gradients from
   ``jax.vmap(jax.grad)``. It shows the mechanics only: no privacy accounting.
2. Gradient accumulation with Adam: ``microbatch(jax.value_and_grad(loss), MEAN)``, the
   mean loss and gradient over a batch one microbatch at a time; checked once against
   ``jax.grad(microbatch(loss, MEAN))`` and the whole-batch ``jax.grad(loss)``.

Run::

    python examples/flax_nnx.py           # 200 steps of each, about 20 s on 2 CPUs
    python examples/flax_nnx.py --quick   # a few steps on tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from checks import assert_trees_close
from flax import nnx

from microbatching import AccumulationType, l2_norm, micro_grad, microbatch

NUM_FEATURES = 32
NUM_CLASSES = 10


class MLP(nnx.Module):
    """A two-layer perceptron with a ReLU."""

    def __init__(self, num_in: int, hidden: int, num_out: int, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(num_in, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, num_out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


@nnx.jit(static_argnums=(1, 2, 3))
def new_model(key: jax.Array, num_in: int, hidden: int, num_out: int) -> MLP:
    """A freshly initialised MLP, built in one compiled call rather than op by op."""
    return MLP(num_in, hidden, num_out, rngs=nnx.Rngs(key))


@jax.jit(static_argnums=1)
def make_data(key: jax.Array, num_examples: int) -> tuple[jax.Array, jax.Array]:
    """Gaussian features and the labels that a random linear "teacher" gives them."""
    k_teacher, k_x = jax.random.split(key)
    x = jax.random.normal(k_x, (num_examples, NUM_FEATURES))
    teacher = jax.random.normal(k_teacher, (NUM_FEATURES, NUM_CLASSES))
    return x, jnp.argmax(x @ teacher, axis=-1)


def loss_of(graphdef: Any, rest: Any) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """The mean cross-entropy as a function of the parameter state and a batch."""

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    return loss


def split(model: MLP) -> tuple[Any, Any, Any]:
    """``(graphdef, parameters, the rest of the state)``: the rest would hold batch
    statistics or RNG counters, which are not differentiated; this MLP has none."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of a pytree taken together."""
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


def add_noise(tree: Any, key: jax.Array, std: float) -> Any:
    """``tree`` plus independent Gaussian noise of standard deviation ``std`` per entry."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noisy = [
        leaf + std * jax.random.normal(k, leaf.shape, leaf.dtype)
        for leaf, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, noisy)


def make_dp_sgd_step(microbatch_size: int, clip_norm: float, noise_multiplier: float) -> Any:
    """A jitted DP-SGD step ``(model, optimizer, x, y, key) -> (mean loss, clipped %)``."""

    @nnx.jit
    def step(
        model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array, key: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        graphdef, params, rest = split(model)
        clipped_sum = micro_grad(
            loss_of(graphdef, rest),
            batch_argnums=(1, 2),
            microbatch_size=microbatch_size,
            l2_clip_norm=clip_norm,
            metrics_fn=l2_norm,  # each example's gradient norm, before clipping
        )
        summed, aux = clipped_sum(params, x, y)
        noisy = add_noise(summed, key, noise_multiplier * clip_norm)
        optimizer.update(model, jax.tree.map(lambda g: g / x.shape[0], noisy))
        return jnp.mean(aux.values), jnp.mean(aux.metrics > clip_norm)

    return step


def make_accumulation_step(microbatch_size: int) -> Any:
    """A jitted step ``(model, optimizer, x, y) -> mean loss`` that accumulates the mean
    gradient over the batch, ``microbatch_size`` rows at a time."""

    @nnx.jit
    def step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
        graphdef, params, rest = split(model)
        loss_and_grad = microbatch(
            jax.value_and_grad(loss_of(graphdef, rest)),
            argnums=(1, 2),
            microbatch_size=microbatch_size,
            accumulator=AccumulationType.MEAN,
        )
        value, grads = loss_and_grad(params, x, y)
        optimizer.update(model, grads)
        return value

    return step


def check_gradients(model: MLP, x: jax.Array, y: jax.Array, args: argparse.Namespace) -> None:
    """Both microbatched gradients against references computed without microbatching."""
    graphdef, params, rest = split(model)
    loss = loss_of(graphdef, rest)
    m, mean = args.microbatch_size, AccumulationType.MEAN
    clipped_sum = micro_grad(
        loss, batch_argnums=(1, 2), microbatch_size=m, l2_clip_norm=args.clip_norm
    )
    inside = microbatch(jax.grad(loss), argnums=(1, 2), microbatch_size=m, accumulator=mean)
    outside = jax.grad(microbatch(loss, argnums=(1, 2), microbatch_size=m, accumulator=mean))

    @jax.jit
    def gradients(params: Any, x: jax.Array, y: jax.Array) -> dict[str, Any]:
        """Every gradient to compare, in one compiled program."""
        per_example = jax.vmap(lambda xi, yi: jax.grad(loss)(params, xi[None], yi[None]))(x, y)
        scale = jnp.minimum(1.0, args.clip_norm / jax.vmap(global_norm)(per_example))
        return {
            "micro_grad": clipped_sum(params, x, y)[0],
            "clipped vmap(grad)": jax.tree.map(
                lambda g: jnp.tensordot(scale, g, axes=1), per_example
            ),
            "microbatch(grad)": inside(params, x, y),
            "grad(microbatch)": outside(params, x, y),
            "grad": jax.grad(loss)(params, x, y),
        }

    g = gradients(params, x, y)
    assert_trees_close(g["micro_grad"], g["clipped vmap(grad)"], "micro_grad(l2_clip_norm)")
    assert_trees_close(g["microbatch(grad)"], g["grad"], "microbatch(jax.grad(loss))")
    assert_trees_close(g["grad(microbatch)"], g["grad"], "jax.grad(microbatch(loss))")


@nnx.jit
def accuracy(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """The fraction of examples whose largest logit is the label."""
    return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def train(args: argparse.Namespace) -> None:
    """Checks the gradients, then trains with DP-SGD and with gradient accumulation."""
    k_data, k_init, k_noise, k_batches = jax.random.split(jax.random.key(args.seed), 4)
    x, y = make_data(k_data, args.train_size + args.test_size)
    x_train, y_train = x[: args.train_size], y[: args.train_size]
    x_test, y_test = x[args.train_size :], y[args.train_size :]

    @jax.jit
    def batch(step: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Examples drawn with replacement, a fresh draw at each step."""
        rows = jax.random.randint(
            jax.random.fold_in(k_batches, step), (args.batch_size,), 0, args.train_size
        )
        return x_train[rows], y_train[rows]

    x0, y0 = batch(0)
    check_gradients(new_model(k_init, NUM_FEATURES, args.hidden, NUM_CLASSES), x0, y0, args)

    model = new_model(k_init, NUM_FEATURES, args.hidden, NUM_CLASSES)
    optimizer = nnx.Optimizer(model, optax.sgd(args.dp_learning_rate), wrt=nnx.Param)
    dp_step = make_dp_sgd_step(args.microbatch_size, args.clip_norm, args.noise_multiplier)
    print(
        f"\nDP-SGD: batch {args.batch_size}, microbatch {args.microbatch_size}, "
        f"clip norm {args.clip_norm}, noise multiplier {args.noise_multiplier}"
    )
    start = time.perf_counter()
    for step in range(args.steps):
        loss, clipped = dp_step(model, optimizer, *batch(step), jax.random.fold_in(k_noise, step))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  step {step:4d}  loss {float(loss):.4f}  clipped {float(clipped):.0%}")
    print(
        f"  test accuracy {float(accuracy(model, x_test, y_test)):.1%} "
        f"({time.perf_counter() - start:.1f} s with compilation)"
    )

    model = new_model(k_init, NUM_FEATURES, args.hidden, NUM_CLASSES)
    optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=nnx.Param)
    accumulation_step = make_accumulation_step(args.microbatch_size)
    print(
        f"\nGradient accumulation with Adam: batch {args.batch_size}, "
        f"microbatch {args.microbatch_size}"
    )
    start = time.perf_counter()
    for step in range(args.steps):
        loss = accumulation_step(model, optimizer, *batch(step))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  step {step:4d}  loss {float(loss):.4f}")
    print(
        f"  test accuracy {float(accuracy(model, x_test, y_test)):.1%} "
        f"({time.perf_counter() - start:.1f} s with compilation)"
    )


def parse_args() -> argparse.Namespace:
    """The command-line flags; ``--quick`` shrinks every size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few steps on tiny sizes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train-size", type=int, default=16384)
    parser.add_argument("--test-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--microbatch-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--dp-learning-rate", type=float, default=2.0)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.train_size, args.test_size, args.batch_size = 3, 512, 256, 64
        args.microbatch_size, args.hidden = 16, 16
    args.log_every = max(1, args.steps // 10)
    return args


if __name__ == "__main__":
    train(parse_args())
