"""A standalone reproduction: XLA (jax 0.10.2, CPU) miscompiles a sum of per-example
gradients over a batch sharded on 8 devices, for some shapes.

No microbatching is involved. ``jnp.sum(jax.vmap(jax.grad(loss_w1))(x, y), 0)`` with
``x`` of 256 rows sharded over ``"data"`` differs from the same program on one device by
about 1.5x the result's own magnitude; 2048 rows, or smaller layers, come out right, and
so does the same sum written as one einsum. It matters to ``micro_grad`` with a
``transform_fn`` on a sharded batch: each microbatch is such a program. Run:

    .venv/bin/python benchmarks/xla_per_example_sum_repro.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    for rows, d, h, o in [(256, 256, 512, 16), (2048, 256, 512, 16), (256, 8, 8, 4)]:
        w1, w2 = jax.random.normal(keys[0], (d, h)), jax.random.normal(keys[1], (h, o))
        x, y = jax.random.normal(keys[2], (rows, d)), jax.random.normal(keys[3], (rows, o))

        def w1_grad(a, b, w1, w2):
            return jax.grad(lambda w1: jnp.sum((a @ w1) @ w2 * b))(w1)

        def total(x, y, w1, w2):
            return jnp.sum(jax.vmap(w1_grad, (0, 0, None, None))(x, y, w1, w2), 0)

        want = jax.jit(total)(x, y, w1, w2)
        for axis_type in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
            with jax.set_mesh(mesh):
                xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
                ws = jax.device_put((w1, w2), NamedSharding(mesh, P()))
                got = jax.jit(total)(xs, ys, *ws)
            error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            print(f"rows {rows:5d}, layers {d}x{h}x{o}, {axis_type}: relative error {error:.1e}")


if __name__ == "__main__":
    main()
