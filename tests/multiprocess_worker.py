"""One process of the multi-process ``micro_grad`` test (``test_multiprocess.py``).

Run one copy per process, each with its own ``--process-id``::

    python tests/multiprocess_worker.py --process-id 0 --num-processes 2 --port 12345 --out p0.json
    python tests/multiprocess_worker.py --process-id 1 --num-processes 2 --port 12345 --out p1.json

Each process owns ``--local-devices`` CPU devices and the rows of the global batch that
land on them. Together they run one jitted DP-SGD-style ``micro_grad`` step (clip every
per-example gradient to norm ``CLIP_NORM``, sum) over a mesh of all global devices, and
each writes the gathered results and the collectives of the compiled program to its
``--out`` JSON file. The same processes then take the gradients of a second model whose
parameters are sharded ``P("data", None)`` over all devices (FSDP), without and with
``l2_clip_norm``, and write those too.

Importing this module has no side effects (the test imports the problem definition from
it); JAX is configured and initialised only in ``main``.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from microbatching import micro_grad

BATCH_SIZE = 32
MICROBATCH_SIZE = 8
NUM_FEATURES = 6
HIDDEN = 5
NUM_CLASSES = 3
CLIP_NORM = 1.0
FSDP_ROWS = 16  # the sharded dimension of the FSDP parameters: a multiple of the devices
FSDP_SPEC = P("data", None)
FSDP_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "l2_clip_norm": {"l2_clip_norm": CLIP_NORM},
}
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

Params = dict[str, Any]


def make_problem() -> tuple[Params, np.ndarray, np.ndarray]:
    """The deterministic parameters and global batch ``(params, x, y)``, as NumPy arrays.

    >>> params, x, y = make_problem()
    >>> x.shape, y.shape, sorted(params)
    ((32, 6), (32,), ['b', 'v', 'w'])
    """
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(NUM_FEATURES, HIDDEN)).astype(np.float32),
        "b": rng.normal(size=(HIDDEN,)).astype(np.float32),
        "v": rng.normal(size=(HIDDEN, NUM_CLASSES)).astype(np.float32),
    }
    # Row scales from 0.01 to 3 so that some per-example gradients are clipped and some not.
    scale = np.geomspace(0.01, 3.0, BATCH_SIZE, dtype=np.float32)[:, None]
    x = (rng.normal(size=(BATCH_SIZE, NUM_FEATURES)) * scale).astype(np.float32)
    y = (np.arange(BATCH_SIZE) % NUM_CLASSES).astype(np.int32)
    return params, x, y


def make_fsdp_params() -> Params:
    """The deterministic parameters of ``fsdp_loss``, each with ``FSDP_ROWS`` rows.

    >>> {k: v.shape for k, v in make_fsdp_params().items()}
    {'u': (16, 6), 'v': (16, 3)}
    """
    rng = np.random.default_rng(1)
    return {
        "u": (rng.normal(size=(FSDP_ROWS, NUM_FEATURES)) / 2).astype(np.float32),
        "v": (rng.normal(size=(FSDP_ROWS, NUM_CLASSES)) / 2).astype(np.float32),
    }


def fsdp_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of a one-hidden-layer MLP whose weights are split by rows."""
    log_probs = jax.nn.log_softmax(jnp.tanh(x @ params["u"].T) @ params["v"])
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of a one-hidden-layer MLP on a batch."""
    hidden = jnp.tanh(x @ params["w"] + params["b"][None])
    log_probs = jax.nn.log_softmax(hidden @ params["v"])
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of a pytree taken together."""
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


def clip(tree: Any) -> Any:
    """Scales a pytree so that its global L2 norm is at most ``CLIP_NORM``."""
    scale = jnp.minimum(1.0, CLIP_NORM / jnp.maximum(global_norm(tree), 1e-12))
    return jax.tree.map(lambda leaf: leaf * scale, tree)


def _of_predicates(line: str) -> bool:
    """Whether an HLO instruction's result is boolean scalars alone: an all-reduce of
    branch predicates (the devices agreeing on a branch on the data), not of data.

    >>> _of_predicates("%a = (pred[], pred[]) all-reduce(%x, %y), to_apply=%and")
    True
    >>> _of_predicates("%a = (f32[3]{0}, pred[]) all-reduce(%x, %y)")
    False
    """
    result = line.split("=", 1)[1].split("all-reduce", 1)[0] if "=" in line else line
    types = re.findall(r"(\w+)\[([^\]]*)\]", result)
    return bool(types) and all(t == "pred" and not dims for t, dims in types)


def count_collectives(hlo: str) -> dict[str, int]:
    """How many instructions of each collective kind the HLO text has (async pairs once);
    all-reduces of branch predicates alone are not counted (``_of_predicates``).

    >>> count_collectives("%all-reduce.1 = f32[3]{0} all-reduce(f32[3]{0} %p), to_apply=%add")
    {'all-gather': 0, 'all-to-all': 0, 'collective-permute': 0, 'all-reduce': 1, 'reduce-scatter': 0}
    """
    counts = {}
    for op in COLLECTIVES:
        pattern = re.compile(rf"(?<![%\w.-]){re.escape(op)}(?:-start)?\(")
        counts[op] = sum(
            len(pattern.findall(line))
            for line in hlo.splitlines()
            if not (op == "all-reduce" and _of_predicates(line))
        )
    return counts


def all_reduces_in_loops(hlo: str) -> int:
    r"""How many all-reduces of data sit directly in ``while`` bodies (so run once per
    iteration).

    >>> all_reduces_in_loops(
    ...     "%body (p: f32[]) -> f32[] {\n  %a = f32[] all-reduce(f32[] %p)\n}\n"
    ...     "ENTRY %main (x: f32[]) -> f32[] {\n  %w = f32[] while(f32[] %x), body=%body\n}"
    ... )
    1
    """
    bodies = set(re.findall(r"body=(%[\w.\-]+)", hlo))
    count, inside = 0, False
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$", line)
        if header:
            inside = header.group(1) in bodies
        elif inside and not _of_predicates(line):
            count += bool(re.search(r"(?<![%\w.-])all-reduce(?:-start)?\(", line))
    return count


def local_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of the global batch that this process's devices hold (a contiguous range)."""
    ranges = {
        index[0].indices(batch_size)[:2]
        for index in sharding.addressable_devices_indices_map((batch_size,)).values()
        if index is not None
    }
    start, stop = min(r[0] for r in ranges), max(r[1] for r in ranges)
    assert sum(b - a for a, b in ranges) == stop - start, f"not contiguous: {sorted(ranges)}"
    return slice(start, stop)


def run_fsdp(mesh: jax.sharding.Mesh, x: jax.Array, y: jax.Array) -> dict[str, Any]:
    """``micro_grad`` of ``fsdp_loss`` with its parameters sharded ``FSDP_SPEC`` over all
    devices, per ``FSDP_OPTIONS`` in one jitted step, and on an Auto mesh also called
    eagerly (``"eager"``, default options): the gathered gradients and their layouts."""
    sharding = NamedSharding(mesh, FSDP_SPEC)
    params = {
        k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
        for k, v in make_fsdp_params().items()
    }
    auto = mesh.axis_types == (AxisType.Auto,)
    common: dict[str, Any] = {"batch_argnums": (1, 2), "microbatch_size": MICROBATCH_SIZE}
    if auto:  # an Auto mesh inside jit does not show the batch's sharding
        common["batch_mesh_axes"] = "data"
    grads_fns = {name: micro_grad(fsdp_loss, **common, **o) for name, o in FSDP_OPTIONS.items()}

    def step(params: Params, x: jax.Array, y: jax.Array) -> dict[str, Params]:
        return {name: fn(params, x, y)[0] for name, fn in grads_fns.items()}

    with jax.set_mesh(mesh):
        grads = jax.jit(step)(params, x, y)
        if auto:  # concrete arrays show their layout on an Auto mesh too
            grads["eager"] = grads_fns["default"](params, x, y)[0]
        host = multihost_utils.process_allgather(grads, tiled=True)
    return {
        name: {
            "grads": {k: np.asarray(v).tolist() for k, v in host[name].items()},
            "specs": {k: str(tuple(v.sharding.spec)) for k, v in tree.items()},
            "shard_shapes": {
                k: [list(s.data.shape) for s in v.addressable_shards] for k, v in tree.items()
            },
        }
        for name, tree in grads.items()
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line flags."""
    parser = argparse.ArgumentParser(description="One process of the multi-process test.")
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="coordinator port on 127.0.0.1")
    parser.add_argument("--out", required=True, help="JSON file to write the results to")
    parser.add_argument("--local-devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--axis-type", choices=("auto", "explicit"), default="auto")
    parser.add_argument("--timeout", type=int, default=60, help="initialization timeout (s)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Initialises JAX across processes, runs the step and returns this process's results."""
    # All three must be set before JAX creates its CPU backend.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.timeout,
    )
    axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[args.axis_type]
    num_devices = jax.device_count()
    mesh = jax.make_mesh((num_devices,), ("data",), axis_types=(axis_type,))
    batch_sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    params_np, x_np, y_np = make_problem()
    local = local_rows(batch_sharding, BATCH_SIZE)
    x = jax.make_array_from_process_local_data(batch_sharding, x_np[local])
    y = jax.make_array_from_process_local_data(batch_sharding, y_np[local])
    params = jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(replicated, a), params_np
    )

    # The per-example path, named: `auto` reads this clipping transform and this norm
    # metric as l2_clip_norm's ghost path, which on an Auto mesh without batch_mesh_axes
    # cannot see the batch's sharding while tracing, and XLA then gathers the batch (6
    # all-gathers on 4 devices, as for l2_clip_norm itself there; the multi-device how-to
    # says to pass batch_mesh_axes). This test holds the per-example path to moving none.
    grads_fn = micro_grad(
        loss_fn,
        batch_argnums=(1, 2),
        microbatch_size=MICROBATCH_SIZE,
        transform_fn=clip,
        metrics_fn=global_norm,
        clip_method="materialize",
    )

    def step(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array, jax.Array]:
        grads, aux = grads_fn(params, x, y)
        return grads, aux.values, aux.metrics

    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(params, x, y).compile()
        grads, values, norms = compiled(params, x, y)
        hlo = compiled.as_text() or ""
        host = multihost_utils.process_allgather((grads, values, norms), tiled=True)
    host_grads, host_values, host_norms = host
    return {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": num_devices,
        "local_device_count": jax.local_device_count(),
        "local_rows": [local.start, local.stop],
        "x_shard_shapes": [list(s.data.shape) for s in x.addressable_shards],
        "grads_sharding": str(jax.tree.leaves(grads)[0].sharding),
        "norms_sharding": str(norms.sharding),
        "collectives": count_collectives(hlo),
        "all_reduces_in_loops": all_reduces_in_loops(hlo),
        "grads": {k: np.asarray(v).tolist() for k, v in host_grads.items()},
        "values": np.asarray(host_values).tolist(),
        "norms": np.asarray(host_norms).tolist(),
        "fsdp": run_fsdp(mesh, x, y),
    }


def main(argv: list[str] | None = None) -> None:
    """Runs one process and writes its results to ``--out``."""
    args = parse_args(argv)
    try:
        result = run(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
