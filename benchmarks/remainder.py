"""Batches that the microbatch size does not divide: ``allow_remainder`` and ``example_weights``.

For each workload the table gives the compiled temp memory, the number of while loops in
the compiled program, the median time of a call and its ratio to a reference, from
interleaved repetitions in one process (medians of per-repetition ratios, with quartiles):

- the divisible batch just below (``n`` full microbatches, no remainder): what the loop
  costs without a remainder;
- the batch with ``allow_remainder=True``: ``n`` microbatches and one partial, padded and
  masked inside the same loop;
- the batch padded to ``(n + 1) * m`` rows with a boolean ``example_weights`` mask: the
  fixed-shape pattern of DP-SGD with Poisson sampling;
- ``jax.lax.map(batch_size=m)``, which runs a remainder as one more call after its loop;
- the whole batch at once.

It also scores the issue's evaluation (1797 rows, microbatch 64) the old way: padded to
4096 rows with ``num_real_microbatches``, which reads the wrong rows.

Usage: ``python benchmarks/remainder.py [--quick] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from accumulation import (  # benchmarks/ is on sys.path when run as a script
    Fn,
    data,
    loss,
    mlp,
    ms,
    ratio,
    report,
)

import microbatching as mb

RESULTS = Path(__file__).resolve().parent / "REMAINDER.md"
MEAN = mb.AccumulationType.MEAN


def temp_kib(fn: Fn, *args: Any) -> float:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 1024


def while_loops(fn: Fn, *args: Any) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text() or ""
    return len(re.findall(r"\swhile\(", text))


def forward(params: Any, x: jax.Array) -> jax.Array:
    """The MLP's logits for one example (a row of features)."""
    h = x
    for w, b in params[:-1]:
        h = jax.nn.relu(h @ w + b)
    w, b = params[-1]
    return h @ w + b


def assert_close(got: Any, want: Any, what: str) -> None:
    """Every leaf of ``got`` equals ``want``'s to float32 rounding."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(b)))) or 1.0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=what)


def padded(x: jax.Array, rows: int) -> jax.Array:
    return jnp.concatenate([x, jnp.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


def table(title: str, ways: dict[str, tuple[Fn, tuple[Any, ...]]], reps: int, base: str) -> str:
    """Temp memory, loops and time of each way; each has its own arguments."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    compiled = {name: jax.jit(fn).lower(*args).compile() for name, (fn, args) in ways.items()}
    for name, (_, args) in ways.items():
        jax.block_until_ready(compiled[name](*args))
    order = jax.random.key(0)
    names = list(ways)
    for rep in range(reps):
        perm = jax.random.permutation(jax.random.fold_in(order, rep), len(names))
        for i in perm.tolist():
            name = names[i]
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*ways[name][1]))
            seconds[name].append(time.perf_counter() - start)
    lines = [
        title,
        "",
        f"| way | temp KiB | while loops | median ms | time / {base} |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (fn, args) in ways.items():
        lines.append(
            f"| {name} | {temp_kib(fn, *args):.0f} | {while_loops(fn, *args)} "
            f"| {ms(seconds[name])} | {ratio(seconds[name], seconds[base])} |"
        )
    return "\n".join(lines)


def evaluation(sizes: Sequence[int], rows: int, size: int, reps: int) -> str:
    """Mean accuracy of an MLP over ``rows`` examples, ``size`` at a time."""
    params, (x, _) = mlp(list(sizes)), data(rows, sizes[0], sizes[-1])
    y = jnp.argmax(jax.vmap(forward, (None, 0))(params, x), axis=1)  # all right: 100%
    y = y.at[::3].set((y[::3] + 1) % sizes[-1])  # two in three right

    def correct(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return (jnp.argmax(forward(params, x)) == y).astype(jnp.float32)

    def accuracy(**options: Any) -> Fn:
        return mb.micro_vmap(correct, (None, 0, 0), accumulator=MEAN, **options)

    full, rest = divmod(rows, size)
    even, cap = full * size, (full + 1) * size
    mask = jnp.arange(cap) < rows
    weighted = accuracy(microbatch_size=size)

    def masked(params: Any, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
        return weighted(params, x, y, example_weights=mask)

    def lax_map(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        hits = jax.lax.map(lambda xy: correct(params, *xy), (x, y), batch_size=size)
        return jnp.mean(hits)

    whole = "`jax.vmap` (whole batch)"
    ways: dict[str, tuple[Fn, tuple[Any, ...]]] = {
        f"`micro_vmap`, {even} rows (divisible)": (
            accuracy(microbatch_size=size),
            (params, x[:even], y[:even]),
        ),
        f"`micro_vmap(allow_remainder=True)`, {rows} rows": (
            accuracy(microbatch_size=size, allow_remainder=True),
            (params, x, y),
        ),
        f"`micro_vmap`, padded to {cap}, `example_weights=mask`": (
            masked,
            (params, padded(x, cap), padded(y, cap), mask),
        ),
        f"`jax.lax.map(batch_size={size})`, {rows} rows": (lax_map, (params, x, y)),
        whole: (accuracy(), (params, x, y)),
    }
    got = {name: float(jax.jit(fn)(*args)) for name, (fn, args) in ways.items()}
    same = [value for name, value in got.items() if "divisible" not in name]
    np.testing.assert_allclose(same, got[whole], rtol=1e-6, err_msg="accuracy over all rows")
    right = int(jnp.sum(jax.vmap(correct, (None, 0, 0))(params, x, y)))
    title = (
        f"MLP {'-'.join(map(str, sizes))}, mean accuracy over {rows} rows = {full} x {size} + "
        f"{rest}, {reps} repetitions. Every way over the {rows} rows gives the same "
        f"accuracy, {got[whole]:.2%} ({right} rows right; equal to 1e-6), so they compute "
        f"the same mean. The first way, over {even} rows, leaves out the last {rest}: it "
        "shows what the loop costs without a remainder."
    )
    return table(title, ways, reps, whole)


def old_advice(rows: int, size: int, padded_rows: int) -> str:
    """The issue's case: pad, then skip microbatches with ``num_real_microbatches``."""
    sizes = [64, 128, 10]
    params, (x, _) = mlp(sizes), data(rows, sizes[0], sizes[-1])
    y = jnp.argmax(jax.vmap(forward, (None, 0))(params, x), axis=1)  # 100% right

    def hit(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return (jnp.argmax(forward(params, x)) == y).astype(jnp.float32)

    count = -(-rows // size)
    pad_y = jnp.concatenate([y, jnp.full(padded_rows - rows, -1, y.dtype)])  # never right
    hits = mb.micro_vmap(
        hit,
        (None, 0, 0),
        microbatch_size=size,
        accumulator=mb.AccumulationType.SUM,
        num_real_microbatches=count,
    )(params, padded(x, padded_rows), pad_y)
    right = mb.micro_vmap(
        hit, (None, 0, 0), microbatch_size=size, accumulator=MEAN, allow_remainder=True
    )(params, x, y)
    return (
        f"The old advice for {rows} rows at microbatch {size} (pad to {padded_rows}, "
        f"`num_real_microbatches={count}`) scores {int(hits)} of the {rows} real rows: "
        f"{float(hits) / rows:.1%} where every row is right. `allow_remainder=True` gives "
        f"{float(right):.1%}."
    )


def gradients(rows: int, size: int, reps: int) -> str:
    """``micro_grad`` MEAN (fast path) and ``l2_clip_norm`` over an uneven batch."""
    params, (x, y) = mlp([784, 512, 512, 10]), data(rows, 784, 10)
    full = rows // size
    even, cap = full * size, (full + 1) * size
    mask = jnp.arange(cap) < rows
    args_even = (params, x[:even], y[:even])
    args_pad = (params, padded(x, cap), padded(y, cap), mask)
    ways: dict[str, tuple[Fn, tuple[Any, ...]]] = {}
    for clip in (None, 1.0):
        label = "MEAN" if clip is None else "`l2_clip_norm=1.0`"
        options: dict[str, Any] = {"accumulator": MEAN, "l2_clip_norm": clip}
        grads = mb.micro_grad(loss, batch_argnums=(1, 2), microbatch_size=size, **options)
        rest = mb.micro_grad(
            loss, batch_argnums=(1, 2), microbatch_size=size, allow_remainder=True, **options
        )

        def masked(params: Any, x: jax.Array, y: jax.Array, m: jax.Array, grads: Fn = grads) -> Any:
            return grads(params, x, y, example_weights=m)

        with_rest = jax.jit(rest)(params, x, y)[0]
        assert_close(with_rest, jax.jit(masked)(*args_pad)[0], f"{label}: remainder, mask")
        if clip is None:
            assert_close(with_rest, jax.grad(loss)(params, x, y), "MEAN against jax.grad")
        ways[f"{label}, {even} rows (divisible)"] = (grads, args_even)
        ways[f"{label}, `allow_remainder=True`, {rows} rows"] = (rest, (params, x, y))
        ways[f"{label}, padded to {cap}, `example_weights=mask`"] = (masked, args_pad)
    clipped = mb.micro_grad(loss, batch_argnums=(1, 2), microbatch_size=size, l2_clip_norm=1.0)
    report = mb.clipping_report(clipped, *args_even)
    base = f"MEAN, {even} rows (divisible)"
    title = (
        f"`micro_grad`, MLP 784-512-512-10, {rows} = {full} x {size} + {rows - even} examples, "
        f"{reps} repetitions. `l2_clip_norm=1.0` computes the clipped sum by "
        f"`{report.method}` ({report.reason}). The gradient with a remainder equals the one "
        "with a mask, and MEAN's equals `jax.grad` over the whole batch."
    )
    return table(title, ways, reps, base)


def main(argv: Sequence[str]) -> None:
    def parts(quick: bool, reps: int) -> list[Callable[[], str]]:
        return [
            lambda: old_advice(1797, 64, 4096),
            lambda: evaluation([64, 128, 10], 1797, 64, reps),
            lambda: evaluation([784, 512, 512, 10], 4100 if quick else 16484, 256, reps),
            lambda: gradients(1124 if quick else 4196, 256, max(3, reps // 3)),
        ]

    report(argv, "remainder.py", "Uneven and padded batches", RESULTS, parts)


if __name__ == "__main__":
    main(sys.argv[1:])
