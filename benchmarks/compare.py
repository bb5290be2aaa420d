"""Compares ``microbatching`` with ``optax.microbatching``, ``jax.lax.map``, a hand-written
dynamic-slice ``fori_loop`` and the un-microbatched function, on the same workloads: a
reduction (a), a per-example output (b), clipped per-example gradients (c) and gradient
accumulation (d).

All implementations of a workload are timed in one process, interleaved: every repetition
calls each of them once, in a random order (fixed seed) that changes from one repetition to
the next, so drift in machine load affects all of them alike. See ``benchmarks/README.md``.

Usage: ``python benchmarks/compare.py [--quick] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _provenance  # benchmarks/ is on sys.path when run as a script
import jax
import jax.numpy as jnp
import numpy as np
import optax  # benchmark-only dependency
from optax import microbatching as optax_mb

import microbatching as mb

OURS = "microbatching"
OPTAX = "optax.microbatching"
LAX_MAP = "jax.lax.map"
FORI = "fori_loop (dynamic slice)"
WHOLE = "whole batch"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

Fn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One computation, written once per implementation, and its arguments."""

    name: str
    description: str
    fns: dict[str, Fn]
    args: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation of a workload, compiled."""

    name: str
    compiled: jax.stages.Compiled
    temp_mib: float


@dataclasses.dataclass(frozen=True)
class Result:
    """The timings of one workload: seconds per call, per repetition, per implementation."""

    workload: Workload
    candidates: list[Candidate]
    seconds: dict[str, list[float]]


# --- Workloads a and b: a dense layer over a 32 MiB batch ------------------------------

BATCH, FEATURES, HIDDEN, DENSE_MICROBATCH = 32768, 256, 256, 1024  # x is 32 MiB


def _dense_args(batch: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (batch, FEATURES), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (FEATURES, HIDDEN), jnp.float32) / 16
    return x, w


def _layer(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w)


def _layer_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.sum(_layer(x, w))


def _fori_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    """Contiguous microbatches read with dynamic_slice, results summed in the carry."""
    m = DENSE_MICROBATCH

    def body(i: Any, total: jax.Array) -> jax.Array:
        return total + _layer_sum(jax.lax.dynamic_slice_in_dim(x, i * m, m), w)

    return jax.lax.fori_loop(0, x.shape[0] // m, body, jnp.zeros((), x.dtype))


def _fori_concat(x: jax.Array, w: jax.Array) -> jax.Array:
    """Contiguous microbatches, results written into a preallocated output."""
    m = DENSE_MICROBATCH

    def body(i: Any, out: jax.Array) -> jax.Array:
        rows = _layer(jax.lax.dynamic_slice_in_dim(x, i * m, m), w)
        return jax.lax.dynamic_update_slice_in_dim(out, rows, i * m, 0)

    out = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
    return jax.lax.fori_loop(0, x.shape[0] // m, body, out)


def _lax_map_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.sum(jax.lax.map(lambda row: _layer_sum(row, w), x, batch_size=DENSE_MICROBATCH))


def _lax_map_concat(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.map(lambda row: _layer(row, w), x, batch_size=DENSE_MICROBATCH)


def _mib(x: jax.Array) -> str:
    return f"{x.size * x.dtype.itemsize / 2**20:g} MiB"


def reduction_workload(shrink: int) -> Workload:
    """(a) ``microbatch`` with SUM of a reduction, on ``BATCH // shrink`` rows."""
    m, (x, w) = DENSE_MICROBATCH, _dense_args(BATCH // shrink)
    return Workload(
        name="a. microbatch, SUM: sum(tanh(x @ W))",
        description=f"x f32{list(x.shape)} ({_mib(x)}), W f32{list(w.shape)}, microbatch {m} "
        f"({x.shape[0] // m} microbatches); lax.map maps rows, then sums.",
        fns={
            OURS: mb.microbatch(_layer_sum, argnums=0, microbatch_size=m),
            OPTAX: optax_mb.microbatch(_layer_sum, argnums=0, microbatch_size=m),
            LAX_MAP: _lax_map_sum,
            FORI: _fori_sum,
            WHOLE: _layer_sum,
        },
        args=(x, w),
    )


def concat_workload(shrink: int) -> Workload:
    """(b) ``micro_vmap`` with CONCAT: a per-example output as large as the input."""
    m, (x, w) = DENSE_MICROBATCH, _dense_args(BATCH // shrink)
    options: dict[str, Any] = {"in_axes": (0, None), "microbatch_size": m}  # W is unmapped
    return Workload(
        name="b. micro_vmap, CONCAT: tanh(x @ W) per example",
        description=f"x f32{list(x.shape)} ({_mib(x)}), output as large, microbatch {m} "
        f"({x.shape[0] // m} microbatches).",
        fns={
            OURS: mb.micro_vmap(_layer, **options),
            OPTAX: optax_mb.micro_vmap(_layer, **options),
            LAX_MAP: _lax_map_concat,
            FORI: _fori_concat,
            WHOLE: jax.vmap(_layer, in_axes=(0, None)),
        },
        args=(x, w),
    )


# --- Workload c: clipped per-example gradients of a small MLP --------------------------

EXAMPLES, INPUTS, UNITS, CLASSES, GRAD_MICROBATCH = 2048, 64, 256, 10, 128

Params = dict[str, jax.Array]


def _mlp_args(examples: int) -> tuple[Params, jax.Array, jax.Array]:
    k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
    params = {
        "w1": jax.random.normal(k1, (INPUTS, UNITS), jnp.float32) / 8,
        "b1": jnp.zeros((UNITS,), jnp.float32),
        "w2": jax.random.normal(k2, (UNITS, CLASSES), jnp.float32) / 16,
        "b2": jnp.zeros((CLASSES,), jnp.float32),
    }
    x = jax.random.normal(k3, (examples, INPUTS), jnp.float32)
    y = jax.random.randint(k4, (examples,), 0, CLASSES)
    return params, x, y


def _loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Softmax cross-entropy of a 64-256-10 MLP, averaged over the batch."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _clip(grads: Any) -> Any:
    """Scales a gradient to global norm at most 1."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = 1.0 / jnp.maximum(norm, 1.0)
    return jax.tree.map(lambda g: g * scale, grads)


def _example_grad(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
    """The clipped gradient and the loss of one example, seen as a batch of one."""
    value, grads = jax.value_and_grad(_loss)(params, x[None], y[None])
    return _clip(grads), value


_batch_grads = jax.vmap(_example_grad, in_axes=(None, 0, 0))


def _sum_rows(tree: Params) -> Params:
    return jax.tree.map(lambda g: jnp.sum(g, axis=0), tree)


def _whole_grad(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
    grads, values = _batch_grads(params, x, y)
    return _sum_rows(grads), values


def _lax_map_grad(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
    def one(xy: tuple[jax.Array, jax.Array]) -> tuple[Params, jax.Array]:
        return _example_grad(params, *xy)

    grads, values = jax.lax.map(one, (x, y), batch_size=GRAD_MICROBATCH)
    return _sum_rows(grads), values


def _fori_grad(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
    """Contiguous microbatches: vmap(grad) + clip + sum, losses into a preallocated array."""
    m = GRAD_MICROBATCH

    def body(i: Any, carry: tuple[Params, jax.Array]) -> tuple[Params, jax.Array]:
        total, values = carry
        xs, ys = (jax.lax.dynamic_slice_in_dim(a, i * m, m) for a in (x, y))
        grads, losses = _batch_grads(params, xs, ys)
        total = jax.tree.map(jnp.add, total, _sum_rows(grads))
        return total, jax.lax.dynamic_update_slice_in_dim(values, losses, i * m, 0)

    init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(x.shape[:1], jnp.float32))
    return jax.lax.fori_loop(0, x.shape[0] // m, body, init)


def _values_only(grad_fn: Fn) -> Fn:
    """Adapts a ``micro_grad`` function to return ``(grads, per-example losses)``."""

    def adapted(params: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
        grads, aux = grad_fn(params, x, y)
        return grads, aux.values

    return adapted


def grad_workload(shrink: int) -> Workload:
    """(c) ``micro_grad`` with per-example clipping (the DP-SGD gradient)."""
    m, examples = GRAD_MICROBATCH, EXAMPLES // shrink
    options: dict[str, Any] = {"batch_argnums": (1, 2), "microbatch_size": m}
    return Workload(
        name="c. micro_grad, per-example clipping, SUM",
        description=f"MLP {INPUTS}-{UNITS}-{CLASSES}, softmax cross-entropy, batch {examples}, "
        f"microbatch {m} ({examples // m} microbatches); each example's gradient is clipped "
        "to norm 1, then summed. lax.map stacks all clipped gradients, then sums.",
        fns={
            OURS: _values_only(mb.micro_grad(_loss, transform_fn=_clip, **options)),
            OPTAX: _values_only(optax_mb.micro_grad(_loss, transform_fn=_clip, **options)),
            LAX_MAP: _lax_map_grad,
            FORI: _fori_grad,
            WHOLE: _whole_grad,
        },
        args=_mlp_args(examples),
    )


# --- Workload d: gradient accumulation of the same MLP --------------------------------

ACCUMULATION_EXAMPLES, ACCUMULATION_MICROBATCH = 8192, 256


def _lax_map_mean_grad(params: Params, x: jax.Array, y: jax.Array) -> Params:
    """The gradient of the mean of the per-example losses that ``lax.map`` computes."""

    def mean_loss(params: Params) -> jax.Array:
        def one(xy: tuple[jax.Array, jax.Array]) -> jax.Array:
            return _loss(params, xy[0][None], xy[1][None])

        return jnp.mean(jax.lax.map(one, (x, y), batch_size=ACCUMULATION_MICROBATCH))

    return jax.grad(mean_loss)(params)


def _fori_mean_grad(params: Params, x: jax.Array, y: jax.Array) -> Params:
    """Contiguous microbatches: each one's gradient summed in the carry, then averaged."""
    m, count = ACCUMULATION_MICROBATCH, x.shape[0] // ACCUMULATION_MICROBATCH

    def body(i: Any, total: Params) -> Params:
        xs, ys = (jax.lax.dynamic_slice_in_dim(a, i * m, m) for a in (x, y))
        return jax.tree.map(jnp.add, total, jax.grad(_loss)(params, xs, ys))

    total = jax.lax.fori_loop(0, count, body, jax.tree.map(jnp.zeros_like, params))
    return jax.tree.map(lambda g: g / count, total)


def accumulation_workload(shrink: int) -> Workload:
    """(d) ``microbatch(jax.grad(loss), MEAN)``: the mean gradient, a microbatch at a time."""
    m, examples = ACCUMULATION_MICROBATCH, ACCUMULATION_EXAMPLES // shrink
    grad = jax.grad(_loss)
    return Workload(
        name="d. microbatch, MEAN: gradient accumulation",
        description=f"The gradient of the mean softmax cross-entropy of the MLP "
        f"{INPUTS}-{UNITS}-{CLASSES} of c, batch {examples}, microbatch {m} "
        f"({examples // m} microbatches): `microbatch(jax.grad(loss), MEAN)` in both "
        "libraries; lax.map maps the per-example loss and `jax.grad` differentiates the "
        "mean of the mapped losses.",
        fns={
            OURS: mb.microbatch(grad, (1, 2), m, mb.AccumulationType.MEAN),
            OPTAX: optax_mb.microbatch(grad, (1, 2), m, optax_mb.AccumulationType.MEAN),
            LAX_MAP: _lax_map_mean_grad,
            FORI: _fori_mean_grad,
            WHOLE: grad,
        },
        args=_mlp_args(examples),
    )


# --- Measurement ----------------------------------------------------------------------


def compile_candidate(name: str, fn: Fn, args: Sequence[Any]) -> Candidate:
    """Compiles ``fn`` for ``args`` and reads its temporary-buffer size."""
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    temp = float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20
    return Candidate(name, compiled, temp)


def check_agreement(candidates: Sequence[Candidate], args: Sequence[Any]) -> None:
    """Fails unless every implementation returns what the whole-batch one returns."""
    outputs = {c.name: c.compiled(*args) for c in candidates}
    reference = jax.tree.leaves(outputs[WHOLE])
    for name, output in outputs.items():
        for got, want in zip(jax.tree.leaves(output), reference, strict=True):
            want = np.asarray(want)
            scale = float(np.max(np.abs(want))) if want.size else 1.0
            np.testing.assert_allclose(
                np.asarray(got), want, rtol=1e-3, atol=1e-4 * scale, err_msg=name
            )


def time_call(compiled: jax.stages.Compiled, args: Sequence[Any]) -> float:
    """Seconds for one call, until its outputs are ready."""
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def interleaved(
    candidates: Sequence[Candidate], args: Sequence[Any], reps: int, warmup: int
) -> dict[str, list[float]]:
    """Calls every candidate once per repetition, in a fresh random order each time.

    A fixed order would always run each candidate right after the same neighbour, whose
    cache and allocator footprint (a 150 MiB whole-batch call, say) it would inherit.
    """
    seconds: dict[str, list[float]] = {c.name: [] for c in candidates}
    shuffler = random.Random(0)
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + reps):
            for candidate in shuffler.sample(list(candidates), len(candidates)):
                elapsed = time_call(candidate.compiled, args)
                if rep >= warmup:
                    seconds[candidate.name].append(elapsed)
    finally:
        gc.enable()
    return seconds


def run_workload(workload: Workload, reps: int, warmup: int) -> Result:
    """Compiles, checks and times every implementation of ``workload``."""
    candidates = [compile_candidate(n, f, workload.args) for n, f in workload.fns.items()]
    check_agreement(candidates, workload.args)
    return Result(workload, candidates, interleaved(candidates, workload.args, reps, warmup))


# --- Report ---------------------------------------------------------------------------


def paired_ratio(times: Sequence[float], base: Sequence[float]) -> float:
    """The median over repetitions of ``times[r] / base[r]`` (same round, so drift cancels)."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def ratio_cell(times: Sequence[float], base: Sequence[float]) -> str:
    """``paired_ratio`` with the quartiles of the per-repetition ratios."""
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{paired_ratio(times, base):.2f}x [{q1:.2f}, {q3:.2f}]"


def table(result: Result) -> str:
    """A markdown section: one row per implementation."""
    ours = result.seconds[OURS]
    temp = {c.name: c.temp_mib for c in result.candidates}
    lines = [
        f"## {result.workload.name}",
        "",
        result.workload.description,
        "",
        "| implementation | median ms | min ms | time / ours [quartiles] | temp MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, times in result.seconds.items():
        lines.append(
            f"| {name} | {statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f} "
            f"| {ratio_cell(times, ours)} | {temp[name]:.1f} |"
        )
    versus_fori = paired_ratio(ours, result.seconds[FORI])
    verdict = "within" if versus_fori <= 1.10 else "NOT within"
    lines += [
        "",
        f"Paired median time ratios: ours / fori_loop baseline **{versus_fori:.2f}x** "
        f"({verdict} the 1.10x target); ours / optax "
        f"**{paired_ratio(ours, result.seconds[OPTAX]):.2f}x**. "
        f"Temp memory: ours {temp[OURS]:.1f} MiB, optax {temp[OPTAX]:.1f} MiB.",
        "",
    ]
    return "\n".join(lines)


def footer(seconds: float) -> str:
    """How long the run took and how busy the machine was at its end."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"Total time: {seconds:.0f} s; load average at end {load}.\n"


def header(reps: int, warmup: int, stamp: _provenance.Stamp) -> str:
    """What ran, where and when."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    return "\n".join(
        [
            "# microbatching benchmarks",
            "",
            f"{stamp.describe()}; jax {jax.__version__}, optax {optax.__version__}, "
            f"numpy {np.__version__}, "
            f"backend {jax.default_backend()}, {os.cpu_count()} CPUs, {now}, "
            f"load average at start {load}.",
            f"Command: `{command}`; {reps} interleaved repetitions after {warmup + 1} warm-up "
            "call(s) each. Times are wall-clock per call; see README.md for the columns.",
            "",
        ]
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description="Benchmarks microbatching against optax.")
    parser.add_argument("--quick", action="store_true", help="batches / 4, 5 reps, no RESULTS.md")
    parser.add_argument("--reps", type=_positive, help="timed repetitions (default 41, quick 5)")
    parser.add_argument("--output", type=Path, help=f"markdown file (default {RESULTS})")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> None:
    """Runs every workload and prints (and writes) the report."""
    options = parse_args(argv)
    reps = options.reps or (5 if options.quick else 41)
    warmup = 0 if options.quick else 1  # on top of the call that checks the outputs
    shrink = 4 if options.quick else 1
    output = options.output or (None if options.quick else RESULTS)
    stamp = _provenance.stamp(__file__, argv)
    start = time.perf_counter()
    sections = [header(reps, warmup, stamp)]
    print(sections[0], flush=True)
    for make in (reduction_workload, concat_workload, grad_workload, accumulation_workload):
        sections.append(table(run_workload(make(shrink), reps, warmup)))
        print(sections[-1], flush=True)
    sections.append(footer(time.perf_counter() - start))
    print(sections[-1], flush=True)
    if output is not None:
        _provenance.write(output, "\n".join(sections), stamp)
        print(f"Wrote {output}.")


if __name__ == "__main__":
    main(sys.argv[1:])
