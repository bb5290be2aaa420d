"""A standalone reproduction: XLA:CPU (jax 0.10.2) runs a convolution's gradient about
10x slower inside a while loop than the same code outside one (issue 16, item 2).

No microbatching is involved. A small CNN (two strided 3x3 convolutions, 32 and 64
channels, and a dense layer) on 1024 NHWC 28x28x1 images, its gradient summed over 4
microbatches of 256 rows. Measured here on 2 CPU cores (medians of 5, in ms):

| program | time |
|---|---|
| `jax.grad` of the whole batch | 190 |
| `fori_loop` over contiguous `dynamic_slice`s | 1110 |
| the same `fori_loop` with `unroll=2` | 1196 |
| `jax.lax.map` over the 4 microbatches | 1176 |
| the same `fori_loop` with `unroll=True` (no loop left) | 112 |
| a Python loop over the 4 microbatches in one `jit` | 109 |
| one microbatch's `jit`-ed gradient, called 4 times | 99 |
| the forward pass: whole batch / in a `fori_loop` | 45 / 28 |

So the cost is not the microbatching nor the loop as such (the forward pass is faster in
the loop): it is XLA's convolution gradient inside a while body.

The cause: XLA:CPU runs a convolution through Eigen only when its dimensions are in the
order (batch, spatial..., feature) for input and output and (spatial..., in, out) for the
kernel, and its ``ConvCanonicalization`` pass, which puts other convolutions in that
order with transposes, walks the entry computation only (``xla/service/cpu/
conv_canonicalization.cc``). The weight gradient of a convolution reads its input with
batch and feature swapped (``dim_labels=f01b_i01o->01bf`` in the compiled HLO): at the
top level it is reordered, inside a while body it runs as a plain loop nest. The
microbatching library applies the same reordering to the programs it puts in its loop
(``src/microbatching/_xla_cpu/convs.py``): ``microbatch(jax.grad(loss))`` of this model then
takes about 100 ms. Run:

    .venv/bin/python benchmarks/xla_conv_grad_in_loop_repro.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

B, M = 1024, 256


def conv(x, w, stride):
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def loss(p, x, y):
    h = jax.nn.relu(conv(x, p["c1"], 2))
    h = jax.nn.relu(conv(h, p["c2"], 2))
    logits = h.reshape(h.shape[0], -1) @ p["d"]
    picked = jnp.take_along_axis(logits, y[:, None], 1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def looped(unroll):
    def run(p, x, y):
        def body(i, total):
            xs = jax.lax.dynamic_slice_in_dim(x, i * M, M)
            ys = jax.lax.dynamic_slice_in_dim(y, i * M, M)
            return jax.tree.map(jnp.add, total, jax.grad(loss)(p, xs, ys))

        zeros = jax.tree.map(jnp.zeros_like, p)
        return jax.lax.fori_loop(0, B // M, body, zeros, unroll=unroll)

    return run


def python_loop(p, x, y):
    total = jax.tree.map(jnp.zeros_like, p)
    for i in range(B // M):
        rows = slice(i * M, (i + 1) * M)
        total = jax.tree.map(jnp.add, total, jax.grad(loss)(p, x[rows], y[rows]))
    return total


def mapped(p, x, y):
    chunks = (x.reshape(B // M, M, *x.shape[1:]), y.reshape(B // M, M))
    grads = jax.lax.map(lambda xy: jax.grad(loss)(p, *xy), chunks)
    return jax.tree.map(lambda g: g.sum(0), grads)


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 5)
    p = {
        "c1": jax.random.normal(keys[0], (3, 3, 1, 32)) / 3,
        "c2": jax.random.normal(keys[1], (3, 3, 32, 64)) / 17,
        "d": jax.random.normal(keys[2], (7 * 7 * 64, 10)) / 56,
    }
    x = jax.random.normal(keys[3], (B, 28, 28, 1))
    y = jax.random.randint(keys[4], (B,), 0, 10)
    programs = {
        "whole batch": jax.jit(jax.grad(loss)),
        "fori_loop": jax.jit(looped(1)),
        "fori_loop, unroll=2": jax.jit(looped(2)),
        "lax.map": jax.jit(mapped),
        "fori_loop, unroll=True": jax.jit(looped(True)),
        "Python loop in one jit": jax.jit(python_loop),
    }
    for run in programs.values():
        jax.block_until_ready(run(p, x, y))
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(5):  # interleaved
        for name, run in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(run(p, x, y))
            times[name].append(time.perf_counter() - start)
    for name, spent in times.items():
        print(f"{name:24s} {1000 * float(np.median(spent)):7.1f} ms")


if __name__ == "__main__":
    main()
