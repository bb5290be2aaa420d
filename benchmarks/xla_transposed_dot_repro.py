"""A standalone reproduction: XLA:CPU (jax 0.10.2) runs JAX's per-example weight gradient
of a dense layer, a batched product followed by a transpose of its result, outside
YNNPACK, where the same gradient written as the product with its operands swapped runs
in it.

No microbatching is involved. For ``y = x @ w`` JAX's transpose gives ``w``'s gradient as
``dot_general(g, x)`` (cotangent first) and then a transpose to ``w``'s shape. Under
``jax.vmap`` over 64 examples of 64 rows each that is a product batched over the
examples, ``(64, 64, 512) x (64, 64, 128) -> (64, 512, 128)``, and a transpose to ``(64,
128, 512)``. XLA:CPU moves the transpose onto a copy of the cotangent and runs the
product in its own dot emitter (``dot(`` in the compiled HLO). The same per-example
gradients as ``dot_general(x, g)``, which is the transposed result itself, compile to a
YNNPACK fusion (``__ynn_fusion``). Each program here also takes the per-example squared
norms, as a clipped step does. Run:

    .venv/bin/python benchmarks/xla_transposed_dot_repro.py

The microbatching library writes each such pair of its loop body as the swapped product
(``src/microbatching/_xla_cpu/dots.py``, gated by ``_xla_cpu.workarounds.DOT_ORDER``).
Inside the loop of a clipped step, beside the rest of a transformer's backward pass, the
difference is larger than in this small program: see ``docs/concepts.md``.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def layer(h, w):
    return jnp.sum(jax.nn.gelu(h @ w))


def jax_order(w, h):
    """JAX's per-example gradients of ``w``: a product, then a transpose."""
    g = jax.vmap(jax.grad(layer), (None, 0))(w, h)
    return g, jnp.sum(g * g, axis=(1, 2))


def swapped(w, h):
    """The same gradients as one product, the input first."""

    def cotangent(h):
        _, back = jax.vjp(jax.nn.gelu, h @ w)
        return back(jnp.ones((h.shape[0], w.shape[1]), h.dtype))[0]

    c = jax.vmap(cotangent)(h)
    g = lax.dot_general(h, c, (((1,), (1,)), ((0,), (0,))))
    return g, jnp.sum(g * g, axis=(1, 2))


def timed(fn, *args, repetitions=21):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def kind(fn, *args):
    """How the compiled program computes the ``(64, 128, 512)`` product."""
    text = str(jax.jit(fn).lower(*args).compile().as_text())
    for line in text.splitlines():
        if re.search(r"= f32\[64,128,512\]\S* fusion\(", line) and "__ynn_fusion" in line:
            return "YNNPACK fusion"
    return "XLA dot emitter"


def main():
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, (128, 512)) / 11
    h = jax.random.normal(k2, (64, 64, 128))
    want, got = jax_order(w, h), swapped(w, h)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    print(f"jax {jax.__version__}, {jax.default_backend()}; medians of 21 calls, in ms")
    print("| order | product runs in | ms |")
    print("|---|---|---:|")
    for name, fn in (("JAX's (product, transpose)", jax_order), ("swapped", swapped)):
        print(f"| {name} | {kind(fn, w, h)} | {timed(jax.jit(fn), w, h):.2f} |")


if __name__ == "__main__":
    main()
