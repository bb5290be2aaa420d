"""Per-example randomness (dropout) that does not depend on the microbatch size.

A function that draws random numbers from one key draws them for the rows it sees. Once
microbatched it sees ``microbatch_size`` rows at a time, and every microbatch would draw
the same masks again: the result would change with ``microbatch_size``. The fix is to
give every example its own key, ``jax.random.split(key, batch_size)``, and pass the keys
as one more batch argument. Each example then gets the same mask wherever it lands.

This script builds a small MLP with dropout and

1. asserts that with per-example keys the loss and the gradient are the same for
   microbatch sizes 8, 32 and None (no microbatching), through ``microbatch``,
   ``micro_vmap`` and ``micro_grad(l2_clip_norm=...)``;
2. shows that one shared key breaks this;
3. trains a few steps with fresh keys every step, ``fold_in(key, step)``, and microbatch
   size 32.

Run::

    python examples/dropout_keys.py           # the checks and 200 training steps
    python examples/dropout_keys.py --quick   # the checks and 3 steps (CI)
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microbatching import AccumulationType, micro_grad, micro_vmap, microbatch

Params = dict[str, jax.Array]
NUM_FEATURES = 16
DROPOUT_RATE = 0.5
MICROBATCH_SIZES = (8, 32, None)


def init_params(key: jax.Array, hidden: int) -> Params:
    """A 16 -> hidden -> 1 MLP."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (NUM_FEATURES, hidden)) / jnp.sqrt(NUM_FEATURES),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(hidden),
    }


def dropout(key: jax.Array, h: jax.Array) -> jax.Array:
    """Inverted dropout of one example's activations ``h`` with the example's ``key``."""
    keep = jax.random.bernoulli(key, 1.0 - DROPOUT_RATE, h.shape)
    return jnp.where(keep, h / (1.0 - DROPOUT_RATE), 0.0)


def loss(params: Params, x: jax.Array, y: jax.Array, keys: jax.Array) -> jax.Array:
    """Mean squared error of a batch, each row dropped out with its own key."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    hidden = jax.vmap(dropout)(keys, hidden)
    return jnp.mean(((hidden @ params["w2"])[:, 0] - y) ** 2)


def loss_one_key(params: Params, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    """The same loss with one key for the whole call: the pitfall."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    hidden = dropout(key, hidden)
    return jnp.mean(((hidden @ params["w2"])[:, 0] - y) ** 2)


def example_loss(params: Params, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    """The loss of one example (no batch axis), for ``micro_vmap``."""
    return loss(params, x[None], y[None], key[None])


def results(params: Params, x: jax.Array, y: jax.Array, keys: jax.Array, size: int | None) -> Any:
    """Loss and gradient three ways, at one microbatch size, in one compiled call."""
    mean = AccumulationType.MEAN
    loss_and_grad = microbatch(
        jax.value_and_grad(loss), argnums=(1, 2, 3), microbatch_size=size, accumulator=mean
    )
    mapped = micro_vmap(
        example_loss, in_axes=(None, 0, 0, 0), microbatch_size=size, accumulator=mean
    )
    clipped = micro_grad(loss, batch_argnums=(1, 2, 3), microbatch_size=size, l2_clip_norm=1.0)

    @jax.jit
    def all_three(params: Params, x: jax.Array, y: jax.Array, keys: jax.Array) -> Any:
        value, grads = loss_and_grad(params, x, y, keys)
        clipped_sum, aux = clipped(params, x, y, keys)
        return {
            "microbatch loss": value,
            "microbatch grad": grads,
            "micro_vmap loss": mapped(params, x, y, keys),
            "micro_grad clipped sum": clipped_sum,
            "micro_grad per-example losses": aux.values,
        }

    return jax.device_get(all_three(params, x, y, keys))


def check_independence(params: Params, x: jax.Array, y: jax.Array, key: jax.Array) -> None:
    """Asserts that per-example keys give the same results at every microbatch size."""
    keys = jax.random.split(key, x.shape[0])
    by_size = {size: results(params, x, y, keys, size) for size in MICROBATCH_SIZES}
    reference = by_size[None]
    for size, got in by_size.items():
        for name, value in got.items():
            for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(reference[name]), strict=True):
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=f"{name}, {size=}")
    print(
        f"per-example keys: loss {float(reference['microbatch loss']):.6f} for microbatch sizes "
        f"{', '.join(map(str, MICROBATCH_SIZES))}; gradients, micro_vmap and micro_grad agree too"
    )


def show_pitfall(params: Params, x: jax.Array, y: jax.Array, key: jax.Array) -> None:
    """One key for the whole call: the loss changes with the microbatch size."""
    values = {}
    for size in MICROBATCH_SIZES:
        mean_loss = microbatch(
            loss_one_key, argnums=(1, 2), microbatch_size=size, accumulator=AccumulationType.MEAN
        )
        values[size] = float(jax.jit(mean_loss)(params, x, y, key))
    shown = ", ".join(f"{value:.6f} (size {size})" for size, value in values.items())
    print(f"one shared key:   loss {shown}")
    if len(set(values.values())) == 1:
        raise AssertionError("a shared key was expected to depend on the microbatch size")


def train(args: argparse.Namespace) -> None:
    """The checks, then a few steps of SGD with dropout and fresh keys per step."""
    k_data, k_params, k_check, k_train = jax.random.split(jax.random.key(args.seed), 4)
    x = jax.random.normal(k_data, (args.batch_size, NUM_FEATURES))
    y = jnp.sin(x[:, 0]) + 0.5 * x[:, 1]
    params = init_params(k_params, args.hidden)
    check_independence(params, x, y, k_check)
    show_pitfall(params, x, y, k_check)

    loss_and_grad = microbatch(
        jax.value_and_grad(loss),
        argnums=(1, 2, 3),
        microbatch_size=32,
        accumulator=AccumulationType.MEAN,
    )

    @jax.jit
    def step(params: Params, index: jax.Array) -> tuple[Params, jax.Array]:
        keys = jax.random.split(jax.random.fold_in(k_train, index), x.shape[0])
        value, grads = loss_and_grad(params, x, y, keys)
        return jax.tree.map(lambda p, g: p - args.learning_rate * g, params, grads), value

    print(f"\nSGD with dropout, batch {args.batch_size}, microbatch 32")
    for index in range(args.steps):
        params, value = step(params, jnp.asarray(index))
        if index % args.log_every == 0 or index == args.steps - 1:
            print(f"  step {index:4d}  loss {float(value):.4f}")


def parse_args() -> argparse.Namespace:
    """The command-line flags; ``--quick`` shrinks every size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few steps on tiny sizes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1024, help="a multiple of 32")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.hidden = 3, 64, 16
    if args.batch_size % 32:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of 32")
    args.log_every = max(1, args.steps // 10)
    return args


if __name__ == "__main__":
    train(parse_args())
