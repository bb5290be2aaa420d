"""Gradient accumulation two ways on the same data: ``microbatch`` and ``optax.MultiSteps``.

Both train the same MLP with Adam on the same batches of ``batch_size`` rows, and apply
one update per batch:

* ``optax.MultiSteps(adam, every_k_schedule=k)`` is called ``k`` times per update, once
  per minibatch of ``batch_size / k`` rows; it averages the gradients in its state and
  updates the parameters on the ``k``-th call.
* ``microbatch(jax.value_and_grad(loss), microbatch_size=batch_size / k, MEAN)`` is
  called once per update with the whole batch, and averages over its ``k`` microbatches
  inside one compiled loop.

The losses of every update are printed side by side and asserted to match, as are the
final parameters. Then both are timed per update (after compilation) and their memory
compared: XLA's compiled temp memory of each step (``memory_analysis()``) and the size
of each optimizer state, which for ``MultiSteps`` holds a gradient-sized accumulator
between calls.

Run::

    python examples/optax_accumulation.py           # 50 updates of 4096 rows
    python examples/optax_accumulation.py --quick   # 3 updates of 256 rows (CI)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from microbatching import AccumulationType, microbatch

Params = dict[str, jax.Array]
NUM_FEATURES = 64
NUM_CLASSES = 10


def init_params(key: jax.Array, hidden: int) -> Params:
    """He-initialised weights and zero biases of a 64 -> hidden -> 10 MLP."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (NUM_FEATURES, hidden)) * jnp.sqrt(2.0 / NUM_FEATURES),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, NUM_CLASSES)) * jnp.sqrt(2.0 / hidden),
        "b2": jnp.zeros(NUM_CLASSES),
    }


def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of a batch."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit(static_argnums=(1, 2))
def make_batches(key: jax.Array, num_batches: int, batch_size: int) -> tuple[Any, Any]:
    """``num_batches`` batches of Gaussian features labelled by a random linear teacher."""
    k_teacher, k_x = jax.random.split(key)
    x = jax.random.normal(k_x, (num_batches, batch_size, NUM_FEATURES))
    teacher = jax.random.normal(k_teacher, (NUM_FEATURES, NUM_CLASSES))
    return x, jnp.argmax(x @ teacher, axis=-1)


def multisteps_step(optimizer: optax.MultiSteps) -> Callable[..., Any]:
    """One call per minibatch; ``optimizer`` is the ``MultiSteps`` wrapper."""

    @jax.jit
    def step(params: Params, state: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def microbatch_step(optimizer: optax.GradientTransformation, size: int) -> Callable[..., Any]:
    """One call per batch, the gradient averaged over microbatches of ``size`` rows."""
    loss_and_grad = microbatch(
        jax.value_and_grad(loss),
        argnums=(1, 2),
        microbatch_size=size,
        accumulator=AccumulationType.MEAN,
    )

    @jax.jit
    def step(params: Params, state: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = loss_and_grad(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def run_multisteps(
    step: Any, params: Params, state: Any, x: jax.Array, y: jax.Array, k: int
) -> tuple[Params, Any, Any]:
    """One update: ``k`` calls, each on a contiguous minibatch; returns the mean loss."""
    rows = x.shape[0] // k
    values = []
    for j in range(k):
        part = slice(j * rows, (j + 1) * rows)
        params, state, value = step(params, state, x[part], y[part])
        values.append(value)
    return params, state, sum(values) / k


def nbytes(tree: Any) -> int:
    """The bytes of all arrays of a pytree."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def temp_mib(step: Any, *args: Any) -> float:
    """XLA's compiled scratch memory of ``step`` for these arguments, in MiB."""
    analysis = step.lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def seconds_per_update(update: Callable[[], Any], repeats: int) -> float:
    """Median wall-clock time of ``update()`` after one warm-up call."""
    jax.block_until_ready(update())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(update())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(args: argparse.Namespace) -> None:
    """Trains both ways, compares them, then times and measures them."""
    k = args.batch_size // args.microbatch_size
    k_data, k_params = jax.random.split(jax.random.key(args.seed))
    xs, ys = make_batches(k_data, args.updates, args.batch_size)
    initial = init_params(k_params, args.hidden)

    multi = optax.MultiSteps(optax.adam(args.learning_rate), every_k_schedule=k)
    adam = optax.adam(args.learning_rate)
    step_multi = multisteps_step(multi)
    step_micro = microbatch_step(adam, args.microbatch_size)

    print(
        f"{args.updates} updates of {args.batch_size} rows: MultiSteps with {k} minibatches "
        f"of {args.microbatch_size}, microbatch with {k} microbatches of {args.microbatch_size}"
    )
    print("update  MultiSteps loss  microbatch loss")
    p_multi, s_multi = initial, multi.init(initial)
    p_micro, s_micro = initial, adam.init(initial)
    for index in range(args.updates):
        p_multi, s_multi, v_multi = run_multisteps(
            step_multi, p_multi, s_multi, xs[index], ys[index], k
        )
        p_micro, s_micro, v_micro = step_micro(p_micro, s_micro, xs[index], ys[index])
        if index % args.log_every == 0 or index == args.updates - 1:
            print(f"{index:6d}  {float(v_multi):15.6f}  {float(v_micro):15.6f}")
        np.testing.assert_allclose(v_multi, v_micro, rtol=1e-4, err_msg=f"loss of update {index}")
    for name in initial:
        np.testing.assert_allclose(p_multi[name], p_micro[name], rtol=1e-3, atol=1e-5, err_msg=name)
    print("check: the losses of every update and the final parameters match")

    x, y = xs[0], ys[0]
    minibatch = slice(0, args.microbatch_size)
    multi_time = seconds_per_update(
        lambda: run_multisteps(step_multi, p_multi, s_multi, x, y, k), args.repeats
    )
    micro_time = seconds_per_update(lambda: step_micro(p_micro, s_micro, x, y), args.repeats)
    multi_temp = temp_mib(step_multi, p_multi, s_multi, x[minibatch], y[minibatch])
    micro_temp = temp_mib(step_micro, p_micro, s_micro, x, y)
    print(f"\n{'':12s}{'ms / update':>12s}{'step temp MiB':>15s}{'optimizer state MiB':>21s}")
    for name, seconds, temp, state in (
        ("MultiSteps", multi_time, multi_temp, s_multi),
        ("microbatch", micro_time, micro_temp, s_micro),
    ):
        print(f"{name:12s}{seconds * 1e3:12.2f}{temp:15.3f}{nbytes(state) / 2**20:21.3f}")
    print(
        "MultiSteps keeps a gradient-sized accumulator in its state between calls; microbatch "
        "holds its carry only during the step (counted in its temp memory)."
    )


def parse_args() -> argparse.Namespace:
    """The command-line flags; ``--quick`` shrinks every size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few updates on tiny sizes")
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--microbatch-size", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=20, help="timed updates of each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.updates, args.batch_size, args.microbatch_size = 3, 256, 64
        args.hidden, args.repeats = 32, 3
    if args.batch_size % args.microbatch_size:
        parser.error("--microbatch-size must divide --batch-size")
    args.log_every = max(1, args.updates // 10)
    return args


if __name__ == "__main__":
    main(parse_args())
