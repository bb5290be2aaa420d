"""A standalone reproduction: XLA:CPU (jax 0.10.2) miscompiles a sum of per-example
gradients of a dense layer, on one device and on a mesh, for some shapes.

No microbatching is involved. ``jnp.sum(jax.vmap(jax.grad(loss_w1))(x, y), 0)`` under
``jit`` differs from the exact sum by about 1.5x the result's own magnitude when each
device holds fewer than 256 rows (32 rows per device on 8 devices, or 32 rows on one);
256 or more rows, or smaller layers, come out right. The smallest form is
``jnp.sum(jnp.einsum("bh,bd->bhd", u, x), 0)``. It mattered to ``micro_grad`` with a
``transform_fn``, whose microbatches are such programs; the library now sums
per-example rows behind an optimization barrier (``_layout.rows_apart``). Run:

    .venv/bin/python benchmarks/xla_per_example_sum_repro.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    for rows, d, h, o in [
        (32, 256, 512, 16),
        (256, 256, 512, 16),
        (2048, 256, 512, 16),
        (256, 8, 8, 4),
    ]:
        w1, w2 = jax.random.normal(keys[0], (d, h)), jax.random.normal(keys[1], (h, o))
        x, y = jax.random.normal(keys[2], (rows, d)), jax.random.normal(keys[3], (rows, o))

        def w1_grad(a, b, w1, w2):
            return jax.grad(lambda w1: jnp.sum((a @ w1) @ w2 * b))(w1)

        def total(x, y, w1, w2):
            return jnp.sum(jax.vmap(w1_grad, (0, 0, None, None))(x, y, w1, w2), 0)

        want = np.sum(np.asarray(jax.vmap(w1_grad, (0, 0, None, None))(x, y, w1, w2)), 0)
        alone = jax.jit(total)(x, y, w1, w2)
        error = float(np.max(np.abs(alone - want)) / np.max(np.abs(want)))
        print(f"rows {rows:5d}, layers {d}x{h}x{o}, one device: relative error {error:.1e}")
        for axis_type in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
            with jax.set_mesh(mesh):
                xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
                ws = jax.device_put((w1, w2), NamedSharding(mesh, P()))
                got = jax.jit(total)(xs, ys, *ws)
            error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            print(f"rows {rows:5d}, layers {d}x{h}x{o}, {axis_type}: relative error {error:.1e}")


if __name__ == "__main__":
    main()
