"""Gradient accumulation and clipped per-example gradients: every way of writing them.

Measures the goals of the accumulation work (temp memory of ``jax.grad`` through
``microbatch``, the time of each way of writing accumulation, the ``micro_grad`` fast path,
``l2_clip_norm`` against a clipping ``transform_fn``, bf16 precision, and the collectives
of ``micro_grad`` on an Auto mesh). Timings are interleaved in one process, as in
``compare.py``; ratios are medians of per-repetition ratios with their quartiles.

Usage: ``python benchmarks/accumulation.py [--quick] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _provenance  # benchmarks/ is on sys.path when run as a script
import jax
import jax.numpy as jnp
import numpy as np

import microbatching as mb

Fn = Callable[..., Any]
Params = list[tuple[jax.Array, jax.Array]]
MEAN, SUM = mb.AccumulationType.MEAN, mb.AccumulationType.SUM
RESULTS = Path(__file__).resolve().parent / "ACCUMULATION.md"


def mlp(sizes: Sequence[int], seed: int = 0) -> Params:
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def data(examples: int, features: int, classes: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (examples, features))
    y = jax.random.randint(jax.random.key(2), (examples,), 0, classes)
    return x, y


def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of an MLP with ReLU hidden layers."""
    h = x
    for w, b in params[:-1]:
        h = jax.nn.relu(h @ w + b)
    w, b = params[-1]
    logits = h @ w + b
    picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def summed_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    return loss(params, x, y) * x.shape[0]


def clip(grads: Any, bound: float = 1.0) -> Any:
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return jax.tree.map(lambda g: g * jnp.minimum(1.0, bound / norm), grads)


def temp_mib(fn: Fn, *args: Any) -> float:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def interleaved(fns: dict[str, Fn], args: Sequence[Any], reps: int) -> dict[str, list[float]]:
    """Seconds per call of each function, every repetition in a fresh random order."""
    compiled = {name: jax.jit(fn).lower(*args).compile() for name, fn in fns.items()}
    for c in compiled.values():
        jax.block_until_ready(c(*args))
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    order = np.random.default_rng(0)
    for _ in range(reps):
        for name in order.permutation(list(fns)):
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            seconds[name].append(time.perf_counter() - start)
    return seconds


def ratio(times: Sequence[float], base: Sequence[float]) -> str:
    """Median of per-repetition ratios, with the quartiles."""
    ratios = sorted(t / b for t, b in zip(times, base, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return f"{q[1]:.2f}x [{q[0]:.2f}, {q[2]:.2f}]"


def ms(times: Sequence[float]) -> str:
    return f"{statistics.median(times) * 1e3:.1f}"


def ways_table(examples: int, size: int, reps: int) -> str:
    """Every way of writing accumulation on one MLP: temp memory and time."""
    params, (x, y) = mlp([784, 512, 512, 10]), data(examples, 784, 10)
    sums = (1, 2)
    ways: dict[str, Fn] = {
        "`microbatch(jax.grad(loss), MEAN)`": mb.microbatch(jax.grad(loss), sums, size, MEAN),
        "`jax.grad(microbatch(loss, MEAN))`": jax.grad(mb.microbatch(loss, sums, size, MEAN)),
        "`jax.value_and_grad(microbatch(loss, MEAN))`": jax.value_and_grad(
            mb.microbatch(loss, sums, size, MEAN)
        ),
        "`micro_grad(loss, MEAN)`": mb.micro_grad(
            loss, batch_argnums=sums, microbatch_size=size, accumulator=MEAN
        ),
        "`micro_grad(loss, l2_clip_norm=1.0)`": mb.micro_grad(
            loss, batch_argnums=sums, microbatch_size=size, l2_clip_norm=1.0
        ),
        "`jax.grad(loss)` (whole batch)": jax.grad(loss),
    }
    args = (params, x, y)
    seconds = interleaved(ways, args, reps)
    base = seconds["`microbatch(jax.grad(loss), MEAN)`"]
    lines = [
        f"MLP 784-512-512-10, batch {examples}, microbatch {size}, {reps} repetitions.",
        "",
        "| way | temp MiB | median ms | time / `microbatch(jax.grad)` |",
        "|---|---:|---:|---:|",
    ]
    for name, fn in ways.items():
        lines.append(
            f"| {name} | {temp_mib(fn, *args):.1f} | {ms(seconds[name])} "
            f"| {ratio(seconds[name], base)} |"
        )
    return "\n".join(lines)


def grad_through_memory(size: int, batches: Sequence[int]) -> str:
    """Temp memory of ``jax.grad(microbatch(loss))`` as the batch grows."""
    params = mlp([784, 512, 512, 10])
    lines = [
        f"Temp MiB, MLP 784-512-512-10, microbatch {size}:",
        "",
        "| batch | `jax.grad(microbatch(loss))` | `microbatch(jax.grad(loss))` "
        "| `jax.grad(loss)` |",
        "|---:|---:|---:|---:|",
    ]
    for examples in batches:
        x, y = data(examples, 784, 10)
        through = temp_mib(jax.grad(mb.microbatch(loss, (1, 2), size, MEAN)), params, x, y)
        inside = temp_mib(mb.microbatch(jax.grad(loss), (1, 2), size, MEAN), params, x, y)
        whole = temp_mib(jax.grad(loss), params, x, y)
        lines.append(f"| {examples} | {through:.1f} | {inside:.1f} | {whole:.1f} |")
    return "\n".join(lines)


def fast_path(examples: int, sizes: Sequence[int], reps: int) -> str:
    """``micro_grad`` with the default transform against ``microbatch(jax.grad(sum))``."""
    params, (x, y) = mlp([784, 512, 512, 10]), data(examples, 784, 10)
    lines = [
        f"`micro_grad(loss)` (SUM, default `transform_fn`) against "
        f"`microbatch(jax.grad(summed loss), SUM)`, MLP 784-512-512-10, batch {examples}:",
        "",
        "| microbatch | micro_grad ms | microbatch(grad) ms | ratio [quartiles] |",
        "|---:|---:|---:|---:|",
    ]
    for size in sizes:
        fns = {
            "ours": mb.micro_grad(loss, batch_argnums=(1, 2), microbatch_size=size),
            "base": mb.microbatch(jax.grad(summed_loss), (1, 2), size, SUM),
        }
        s = interleaved(fns, (params, x, y), reps)
        lines.append(
            f"| {size} | {ms(s['ours'])} | {ms(s['base'])} | {ratio(s['ours'], s['base'])} |"
        )
    return "\n".join(lines)


def clipping(
    examples: int, sizes: Sequence[int], widths: Sequence[Sequence[int]], reps: int
) -> str:
    """``l2_clip_norm`` against ``transform_fn=clip`` (the same clipped sum)."""
    lines = [
        "`micro_grad(l2_clip_norm=1.0)` against `micro_grad(transform_fn=clip)`, "
        f"batch {examples}:",
        "",
        "| MLP | microbatch | l2_clip_norm ms | transform_fn ms | ratio [quartiles] |",
        "|---|---:|---:|---:|---:|",
    ]
    for sizes_ in widths:
        params, (x, y) = mlp(sizes_), data(examples, sizes_[0], sizes_[-1])
        for size in sizes:
            fns = {
                "fast": mb.micro_grad(
                    loss, batch_argnums=(1, 2), microbatch_size=size, l2_clip_norm=1.0
                ),
                "clip": mb.micro_grad(
                    loss, batch_argnums=(1, 2), microbatch_size=size, transform_fn=clip
                ),
            }
            s = interleaved(fns, (params, x, y), reps)
            name = "-".join(map(str, sizes_))
            lines.append(
                f"| {name} | {size} | {ms(s['fast'])} | {ms(s['clip'])} "
                f"| {ratio(s['fast'], s['clip'])} |"
            )
    return "\n".join(lines)


def precision() -> str:
    """bf16 MEAN over 4096 values near 1.5, one row per microbatch."""
    values = 1.5 + np.random.default_rng(0).uniform(-0.01, 0.01, 4096)
    x = jnp.asarray(values, jnp.bfloat16)
    truth = float(np.mean(np.asarray(x, np.float64)))
    mean = lambda v: jnp.mean(v)  # noqa: E731
    rows = []
    for label, dtype in [
        ("default (float32 carry)", None),
        ("`accumulation_dtype=jnp.bfloat16`", jnp.bfloat16),
    ]:
        got = float(mb.microbatch(mean, 0, 1, MEAN, accumulation_dtype=dtype)(x))
        rows.append(f"| {label} | {got:.4f} | {abs(got - truth) / truth:.2e} |")
    return "\n".join(
        [
            f"bf16 MEAN over 4096 values near 1.5, microbatch 1 (true mean {truth:.4f}):",
            "",
            "| carry | result | relative error |",
            "|---|---:|---:|",
            *rows,
        ]
    )


def eager_calls(reps: int) -> str:
    """Wrapped functions called eagerly (after the first call) against the same jitted.

    An eager call traces ``fun`` again (it must see the current globals), then runs the
    cached compiled loop: a fixed cost of one trace, which a small workload feels most.
    """
    x = jax.random.normal(jax.random.key(0), (4096, 64))
    params = mlp((784, 512, 512, 10))
    features, labels = data(1024, 784, 10)
    cases = [
        (
            "`micro_vmap(tanh)`, f32[4096, 64], microbatch 64",
            mb.micro_vmap(lambda v: jnp.tanh(v) * 2, microbatch_size=64),
            (x,),
        ),
        (
            "`micro_grad`, MLP 784-512-512-10, 1024 rows, microbatch 256",
            mb.micro_grad(loss, batch_argnums=(1, 2), microbatch_size=256),
            (params, features, labels),
        ),
    ]
    rows = []
    for workload, fn, args in cases:
        calls = {"eager": fn, "jit": jax.jit(fn)}
        jax.block_until_ready([call(*args) for call in calls.values()])
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        for rep in range(reps):
            for name in sorted(calls, reverse=bool(rep % 2)):
                start = time.perf_counter()
                jax.block_until_ready(calls[name](*args))
                seconds[name].append(time.perf_counter() - start)
        rows.append(
            f"| {workload} | {ms(seconds['eager'])} | {ms(seconds['jit'])} "
            f"| {ratio(seconds['eager'], seconds['jit'])} |"
        )
    return "\n".join(
        [
            "Eager calls after the first (`fun` traced again, the loop not compiled again):",
            "",
            "| workload | eager ms | jitted ms | eager / jitted |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )


def narrow_parameters(examples: int, reps: int) -> str:
    """``micro_grad`` of bfloat16 parameters: per-example sums in float32 (the default) or
    the summed-gradient fast path in bfloat16 (``accumulation_dtype=jnp.bfloat16``), and
    the clipped sum (``materialize``, per-example gradients a chunk at a time); beside
    them ``microbatch(jax.grad(loss))``, whose microbatch gradients are bfloat16 and
    whose carry is float32."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp((784, 512, 512, 10)))
    x, y = data(examples, 784, 10)
    x = x.astype(jnp.bfloat16)
    ways = {
        "default: per-example gradients summed in float32": mb.micro_grad(
            loss, batch_argnums=(1, 2), microbatch_size=256
        ),
        "`accumulation_dtype=jnp.bfloat16`: summed gradient": mb.micro_grad(
            loss, batch_argnums=(1, 2), microbatch_size=256, accumulation_dtype=jnp.bfloat16
        ),
        "`l2_clip_norm=1.0`: per-example gradients clipped and summed in float32": mb.micro_grad(
            loss, batch_argnums=(1, 2), microbatch_size=256, l2_clip_norm=1.0
        ),
        "`microbatch(jax.grad(loss), MEAN)`: one gradient per microbatch, summed in float32": (
            mb.microbatch(jax.grad(loss), argnums=(1, 2), microbatch_size=256, accumulator=MEAN)
        ),
    }
    seconds = interleaved(ways, (params, x, y), reps)
    base = seconds[next(iter(ways))]
    rows = [
        f"| {name} | {temp_mib(fn, params, x, y):.1f} | {ms(seconds[name])} "
        f"| {ratio(seconds[name], base)} |"
        for name, fn in ways.items()
    ]
    return "\n".join(
        [
            f"`micro_grad` of bfloat16 parameters, MLP 784-512-512-10, batch {examples}, "
            "microbatch 256:",
            "",
            "| way | temp MiB | median ms | time / default |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )


AUTO_MESH = """
import jax, re
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import microbatching as mb
w = jnp.ones((64, 64)) / 64
loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
for option in (None, "data"):
    f = mb.micro_grad(loss, microbatch_size=64, batch_mesh_axes=option)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((1024, 64)), NamedSharding(mesh, P("data")))
        text = jax.jit(f).lower(w, x).compile().as_text()
    bodies = set(re.findall(r"body=%?([\\w.\\-]+)", text))
    inside, current = 0, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            current = line.split()[0].lstrip("%")
        elif current in bodies and re.search(r"\\sall-reduce(-start)?\\(", line):
            inside += 1
    total = len(re.findall(r"\\sall-reduce(-start)?\\(", text))
    print(f"| {option!r} | {total} | {inside} |")
"""


def auto_mesh() -> str:
    """All-reduces of ``micro_grad`` on an 8-device Auto mesh (a separate process)."""
    out = subprocess.run(
        [sys.executable, "-c", AUTO_MESH], capture_output=True, text=True, check=True, timeout=600
    ).stdout
    return "\n".join(
        [
            "`micro_grad` on an Auto mesh of 8 CPU devices, batch `P('data')`, 16 microbatches:",
            "",
            "| batch_mesh_axes | all-reduces | in the loop body |",
            "|---|---:|---:|",
            out.strip(),
        ]
    )


Parts = Callable[[bool, int], list[Callable[[], str]]]


def report(
    argv: Sequence[str],
    script: str,
    title: str,
    results: Path,
    parts: Parts,
    timed: Callable[[int], int] = lambda reps: reps,
    flags: Sequence[str] = (),
) -> None:
    """Runs ``parts(quick, reps)`` in order, prints each table and writes them to ``results``;
    ``timed(reps)``: how many repetitions the parts time, as the header states; ``flags``:
    options the script read itself, recorded in the stamp's command."""
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 reps, prints only")
    parser.add_argument("--reps", type=int, help="timed repetitions (default 21, quick 3)")
    parser.add_argument("--output", type=Path, help=f"markdown file (default {results})")
    options = parser.parse_args(argv)
    quick = options.quick
    reps = options.reps or (3 if quick else 21)
    stamp = _provenance.stamp(script, [*argv, *flags])
    start = time.perf_counter()
    sections = [
        f"# {title}: measured",
        "",
        f"`{stamp.command}` on {jax.devices()[0].device_kind}, {stamp.describe()}, "
        f"jax {jax.__version__}, {timed(reps)} interleaved repetitions.",
    ]
    for part in parts(quick, reps):
        sections += ["", part()]
        print(sections[-1], "\n", flush=True)
    sections += ["", f"Total time {time.perf_counter() - start:.0f} s."]
    output = options.output or (None if quick else results)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        _provenance.write(output, "\n".join(sections) + "\n", stamp)
        print(f"Wrote {output}.")


def main(argv: Sequence[str]) -> None:
    def parts(quick: bool, reps: int) -> list[Callable[[], str]]:
        return [
            lambda: grad_through_memory(256, [1024, 4096] if quick else [1024, 16384, 65536]),
            lambda: ways_table(1024 if quick else 4096, 256, reps),
            lambda: fast_path(1024 if quick else 4096, [64, 256, 1024], reps),
            lambda: clipping(
                256 if quick else 1024,
                [16, 64, 256],
                [[256, 512, 512, 10], [64, 256, 10]],
                max(3, reps // 4),  # clipping in transform_fn takes seconds a call
            ),
            precision,
            lambda: narrow_parameters(256 if quick else 1024, max(3, reps // 4)),
            lambda: eager_calls(reps),
            auto_mesh,
        ]

    report(argv, "accumulation.py", "Gradient accumulation", RESULTS, parts)


if __name__ == "__main__":
    main(sys.argv[1:])
