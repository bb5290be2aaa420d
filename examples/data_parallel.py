"""Data-parallel DP-SGD with ``micro_grad``: the batch sharded over devices and hosts.

The batch is sharded along a ``'data'`` mesh axis over every device of every process,
the parameters are replicated, and one jitted step computes, clips and sums the
per-example gradients ``microbatch_size`` examples at a time. Microbatch ``i`` holds
rows ``i, i + n, i + 2n, ...`` of the batch (``n`` microbatches), read in place, so when
``microbatch_size`` is a multiple of the number of devices each device reads only rows
it already holds: the compiled step moves no batch data between devices, and its only
collectives are all-reduces (the sum of the clipped gradients and the mean loss), which
span processes too.

Run it on one machine with 8 fake CPU devices::

    python examples/data_parallel.py --devices 8

or as 2 processes with 2 CPU devices each (one command per process, e.g. on two
machines with the first one's address; here both on localhost)::

    python examples/data_parallel.py --num-processes 2 --process-id 0 \\
        --coordinator 127.0.0.1:12345 --devices 2 &
    python examples/data_parallel.py --num-processes 2 --process-id 1 \\
        --coordinator 127.0.0.1:12345 --devices 2

It prints the mesh, where this process's rows of the batch live, the collectives of
the compiled step and the loss of each step. The data are scikit-learn's 8x8 digits;
every process loads them and draws the same global batch each step (same seed), then
keeps only the rows that land on its own devices, as a per-host input pipeline would.
It shows the mechanics only: it does no privacy accounting.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

from microbatching import l2_norm, micro_grad

Params = dict[str, jax.Array]

HIDDEN = 64
NUM_CLASSES = 10
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 2.0
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """The standardised digits features (float32) and labels (int32), on the host."""
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    return x.astype(np.float32), y.astype(np.int32)


def init_params(key: jax.Array, num_features: int) -> Params:
    """He-initialised weights and zero biases of a 64 -> HIDDEN -> 10 MLP."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (num_features, HIDDEN)) * jnp.sqrt(2.0 / num_features),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, NUM_CLASSES)) * jnp.sqrt(2.0 / HIDDEN),
        "b2": jnp.zeros(NUM_CLASSES),
    }


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of a batch (``micro_grad`` passes batches of one)."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    log_probs = jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of a pytree taken together."""
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


def clip(tree: Any) -> Any:
    """Scales a pytree so that its global L2 norm is at most ``CLIP_NORM``."""
    scale = jnp.minimum(1.0, CLIP_NORM / jnp.maximum(global_norm(tree), 1e-12))
    return jax.tree.map(lambda leaf: leaf * scale, tree)


def make_step(batch_size: int, microbatch_size: int) -> Any:
    """A DP-SGD step ``(params, x, y, key) -> (params, mean loss, fraction clipped)``."""
    grads_fn = micro_grad(
        loss_fn,
        batch_argnums=(1, 2),
        microbatch_size=microbatch_size,
        transform_fn=clip,
        metrics_fn=l2_norm,
    )

    def step(
        params: Params, x: jax.Array, y: jax.Array, key: jax.Array
    ) -> tuple[Params, jax.Array, jax.Array]:
        summed, aux = grads_fn(params, x, y)  # the sum over the batch is an all-reduce
        leaves, treedef = jax.tree.flatten(summed)
        keys = jax.random.split(key, len(leaves))
        noise = [
            NOISE_MULTIPLIER * CLIP_NORM * jax.random.normal(k, leaf.shape, leaf.dtype)
            for k, leaf in zip(keys, leaves, strict=True)
        ]
        noisy = jax.tree.map(jnp.add, summed, jax.tree.unflatten(treedef, noise))
        params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g / batch_size, params, noisy)
        return params, jnp.mean(aux.values), jnp.mean(aux.metrics > CLIP_NORM)

    return step


def count_collectives(hlo: str) -> dict[str, int]:
    """How many instructions of each collective kind the HLO text has (async pairs once)."""
    return {
        op: len(re.findall(rf"(?<![%\w.-]){re.escape(op)}(?:-start)?\(", hlo)) for op in COLLECTIVES
    }


def local_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of the global batch that this process's devices hold (a contiguous range)."""
    ranges = {
        index[0].indices(batch_size)[:2]
        for index in sharding.addressable_devices_indices_map((batch_size,)).values()
        if index is not None
    }
    start, stop = min(r[0] for r in ranges), max(r[1] for r in ranges)
    if sum(b - a for a, b in ranges) != stop - start:
        raise SystemExit(f"this process's rows are not one contiguous range: {sorted(ranges)}")
    return slice(start, stop)


def parse_args() -> argparse.Namespace:
    """The command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=8, help="CPU devices of this process")
    parser.add_argument("--num-processes", type=int, default=1, help="processes in the job")
    parser.add_argument("--process-id", type=int, default=0, help="this process, 0 .. N-1")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    parser.add_argument("--axis-type", choices=("auto", "explicit"), default="explicit")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--batch-size", type=int, default=1024, help="global examples per step")
    parser.add_argument("--microbatch-size", type=int, default=64, help="examples per microbatch")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and sampling")
    return parser.parse_args()


def main() -> None:
    """Sets up the devices and the mesh, compiles the step and runs a few steps."""
    args = parse_args()
    # Both settings must come before JAX creates its CPU backend (its first device query).
    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.num_processes > 1:
        if args.coordinator is None:
            raise SystemExit("--coordinator HOST:PORT is needed with --num-processes > 1")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=120,
        )
    try:
        train(args)
    finally:
        if args.num_processes > 1:
            jax.distributed.shutdown()


def train(args: argparse.Namespace) -> None:
    """Builds the mesh and the sharded batches, and runs ``args.steps`` DP-SGD steps."""
    me = f"[process {jax.process_index()}/{jax.process_count()}]"
    num_devices = jax.device_count()
    if args.microbatch_size % num_devices or args.batch_size % args.microbatch_size:
        raise SystemExit(
            f"--microbatch-size {args.microbatch_size} must be a multiple of the {num_devices} "
            f"devices and divide --batch-size {args.batch_size}"
        )
    axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[args.axis_type]
    mesh = jax.make_mesh((num_devices,), ("data",), axis_types=(axis_type,))
    batch_sharding = NamedSharding(mesh, P("data"))  # rows split over all devices
    replicated = NamedSharding(mesh, P())  # a full copy on every device
    rows = local_rows(batch_sharding, args.batch_size)
    if jax.process_index() == 0:
        print(f"mesh: {dict(mesh.shape)} over {num_devices} devices, axis type {args.axis_type}")
    print(
        f"{me} local devices {[d.id for d in jax.local_devices()]}, rows {rows.start}:{rows.stop}"
    )

    x_all, y_all = load_data()
    rng = np.random.default_rng(args.seed)

    def next_batch() -> tuple[jax.Array, jax.Array]:
        """Every process draws the same global batch and keeps only its own rows."""
        chosen = rng.integers(0, len(x_all), args.batch_size)[rows]
        x = jax.make_array_from_process_local_data(batch_sharding, x_all[chosen])
        y = jax.make_array_from_process_local_data(batch_sharding, y_all[chosen])
        return x, y

    init_key, noise_key = jax.random.split(jax.random.key(args.seed))
    with jax.set_mesh(mesh):
        # Same seed everywhere, so every process builds the same parameters.
        params = jax.device_put(init_params(init_key, x_all.shape[1]), replicated)
        x, y = next_batch()
        for shard in x.addressable_shards:
            where = shard.index[0]
            print(f"{me} x[{where.start}:{where.stop}] on {shard.device}: {shard.data.shape}")
        step = jax.jit(make_step(args.batch_size, args.microbatch_size), donate_argnums=0)
        compiled = step.lower(params, x, y, noise_key).compile()
        if jax.process_index() == 0:
            counts = count_collectives(compiled.as_text() or "")
            print(f"collectives of the compiled step: {counts}")
        for index in range(args.steps):
            if index:
                x, y = next_batch()
            key = jax.random.fold_in(noise_key, index)
            params, loss, clipped = compiled(params, x, y, key)
            if jax.process_index() == 0:
                # loss and clipped are replicated: every process holds them whole.
                print(
                    f"step {index}: loss {float(loss.addressable_data(0)):.4f}, "
                    f"clipped {float(clipped.addressable_data(0)):.0%}"
                )


if __name__ == "__main__":
    main()
