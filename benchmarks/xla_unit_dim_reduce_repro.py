"""A standalone reproduction: XLA:CPU (jax 0.10.2) runs a reduction of an array with a
dimension of size 1 about ten times slower than the same reduction without it.

No microbatching is involved. A per-example function that sees each example as a batch of
one works on arrays like ``(1, T, C)``; under ``jax.vmap`` over 64 examples they are
``(64, 1, T, C)``. Summing ``x * g`` over the tokens, as the per-example gradient of a
LayerNorm's scale does, XLA:CPU hands the fused multiply and reduction to YNNPACK
(``__ynn_fusion`` in the compiled HLO); with the dimension of size 1 it runs far slower.
The same sum on the array reshaped without that dimension (a bitcast, no copy) does not.
Measured here on 2 CPU cores (medians of 21 calls, in ms):

| shape | reduced axis | with the size-1 axis | reshaped without it |
|---|---|---:|---:|
| (64, 1, 64, 128) | 2 | 4.6 | 0.36 |
| (64, 1, 64, 512) | 2 | 44.3 | 0.81 |
| (64, 1, 64, 128) | 3 | 2.9 | 0.54 |

The microbatching library reshapes such reductions in the programs it puts in its loop
(``src/microbatching/_xla_cpu/squeeze.py``, gated by
``_xla_cpu.workarounds.UNIT_REDUCE``). Run:

    .venv/bin/python benchmarks/xla_unit_dim_reduce_repro.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, *args, repetitions=21):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main():
    print(f"jax {jax.__version__}, {jax.default_backend()}; medians of 21 calls, in ms")
    print("| shape | reduced axis | with the size-1 axis | reshaped without it |")
    print("|---|---|---:|---:|")
    key = jax.random.key(0)
    for shape, axis in [((64, 1, 64, 128), 2), ((64, 1, 64, 512), 2), ((64, 1, 64, 128), 3)]:
        x = jax.random.normal(key, shape)
        g = x + 1.0
        squeezed = tuple(d for d in shape if d != 1)
        left = [i for i, d in enumerate(shape) if d != 1].index(axis)
        out = jax.eval_shape(lambda x, g, a=axis: jnp.sum(x * g, axis=a), x, g).shape

        def with_unit(x, g, a=axis):
            return jnp.sum(x * g, axis=a)

        def without(x, g, a=left, s=squeezed, o=out):
            return jnp.sum(jnp.reshape(x * g, s), axis=a).reshape(o)

        np.testing.assert_allclose(with_unit(x, g), without(x, g), rtol=1e-5, atol=1e-3)
        slow, fast = timed(jax.jit(with_unit), x, g), timed(jax.jit(without), x, g)
        print(f"| {shape} | {axis} | {slow:.3f} | {fast:.3f} |")


if __name__ == "__main__":
    main()
