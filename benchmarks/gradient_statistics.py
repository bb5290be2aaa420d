"""Per-example gradient statistics: ``transform_fn`` read off its traced program against
forming every per-example gradient.

On the MLP 784-512-512-10 (ReLU, biases; batch 1024, microbatch 64) and on the tied
transformer LM of ``clipping.py`` (64 tokens, batch 256, microbatch 64; 256 tokens,
batch 64, microbatch 16; a third of the repetitions), each way computes
the mean over the batch of a function of each example's gradient, ``(g, g**2)`` (the
first two moments: the API reference's own example) and ``jnp.sign`` (per-example
signSGD), and the per-example dot product ``<g_b, V>`` with a fixed direction as
``metrics_fn``: by ``micro_grad`` (the ``statistics`` method that ``clip_method='auto'``
picks, and the forced per-example path ``clip_method='materialize'``), by optax 0.2.8's
``micro_grad`` with the same ``transform_fn`` where optax is installed, and by
``jax.vmap(jax.grad(loss))`` over the whole batch followed by the function and the mean.
The baseline is ``micro_grad(loss, MEAN)`` (no statistics: one gradient of the summed
loss per microbatch). Times come from interleaved repetitions in one process (medians of
per-repetition ratios, with quartiles), as in ``clipping.py``, in two groups: ``micro_grad``
auto against the plain step alone, then the ways that form per-example gradients against
the plain step (each ratio to its own group's plain steps); a way whose first call
takes over ``LIMIT_S`` seconds is not timed. Every result is checked against
``vmap(grad)``.

Usage: ``python benchmarks/gradient_statistics.py [--quick] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from accumulation import Fn, ms, ratio, report  # benchmarks/ is on sys.path
from clipping import (
    NO_COSTS,
    OPTAX,
    Warm,
    Workload,
    cost_model,
    interleaved,
    mlp_workload,
    optax_mb,
    relative_error,
    tied_lm_workload,
    warm_up,
)

import microbatching as mb

RESULTS = Path(__file__).resolve().parent / "STATISTICS.md"
LIMIT_S = 3.0  # a way whose first call takes longer is not timed
MEAN = mb.AccumulationType.MEAN
PLAIN, VMAP = "plain `micro_grad(MEAN)`", "`vmap(grad)`"
AUTO = "`micro_grad` auto"


def moments(g: Any) -> Any:
    """The API reference's example: the gradient and its square."""
    return g, jax.tree.map(lambda x: x**2, g)


def sign(g: Any) -> Any:
    """Per-example signSGD."""
    return jax.tree.map(jnp.sign, g)


def direction(params: Any) -> Any:
    """A fixed gradient-shaped direction (a reference gradient, say)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(
        tree, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )


def first(fn: Fn) -> Fn:
    """Only the accumulated result of a ``micro_grad`` function."""
    return lambda *args: fn(*args)[0]


def with_metrics(fn: Fn) -> Fn:
    """The summed gradient and the per-example metrics of a ``micro_grad`` function."""

    def both(*args: Any) -> Any:
        grads, aux = fn(*args)
        return grads, aux.metrics

    return both


def vmap_then(w: Workload, transform: Callable[[Any], Any], v: Any = None) -> Fn:
    """``vmap(grad)`` over the whole batch, then ``transform`` and the mean (or, with a
    direction ``v``, each example's dot product with it)."""

    def one(params: Any, *example: jax.Array) -> Any:
        return jax.grad(w.loss)(params, *(e[None] for e in example))

    def whole(params: Any, *batch: jax.Array) -> Any:
        grads = jax.vmap(one, in_axes=(None, *[0] * len(batch)))(params, *batch)
        if v is not None:
            summed = jax.tree.map(lambda t: jnp.sum(t, axis=0), grads)
            return summed, jax.vmap(lambda g: dot(g, v))(grads)
        return jax.tree.map(lambda t: jnp.mean(t, axis=0), jax.vmap(transform)(grads))

    return whole


def dot(g: Any, v: Any) -> jax.Array:
    pairs = zip(jax.tree.leaves(g), jax.tree.leaves(v), strict=True)
    return jnp.sum(jnp.stack([jnp.vdot(a, b) for a, b in pairs]))


def ways(name: str, size: int, w: Workload) -> dict[str, Fn]:
    """Every way of one statistic, the baseline first."""
    options: dict[str, Any] = {"batch_argnums": w.batch_argnums, "microbatch_size": size}
    out: dict[str, Fn] = {PLAIN: first(mb.micro_grad(w.loss, accumulator=MEAN, **options))}
    if name == "metrics":
        v = direction(w.params)
        metric = lambda g: dot(g, v)  # noqa: E731
        for method in ("auto", "materialize"):
            fn = mb.micro_grad(w.loss, metrics_fn=metric, clip_method=method, **options)
            out[f"`micro_grad` {method}"] = with_metrics(fn)
        out[VMAP] = vmap_then(w, lambda g: g, v)
        return out
    transform = moments if name == "moments" else sign
    for method in ("auto", "materialize"):
        fn = mb.micro_grad(
            w.loss, accumulator=MEAN, transform_fn=transform, clip_method=method, **options
        )
        out[f"`micro_grad` {method}"] = first(fn)
    if optax_mb is not None and OPTAX is not None:
        kind = optax_mb.AccumulationType.MEAN
        fn = optax_mb.micro_grad(w.loss, accumulator=kind, transform_fn=transform, **options)
        out[OPTAX] = first(fn)
    out[VMAP] = vmap_then(w, transform)
    return out


LM_SHAPES = ((64, 256, 64), (256, 64, 16))
"""The tied transformer LM's (tokens, batch, microbatch), as in ``clipping.py``."""

TITLES = {
    "moments": "`transform_fn=lambda g: (g, g**2)`, MEAN",
    "sign": "`transform_fn=jnp.sign` (per example, over every leaf), MEAN",
    "metrics": "`metrics_fn=lambda g: <g, V>` for a fixed direction `V`, SUM",
}


def table(name: str, w: Workload, size: int, reps: int) -> str:
    start = time.perf_counter()
    args = w.args
    fns = ways(name, size, w)
    if name == "metrics":
        statistic: dict[str, Any] = {"metrics_fn": lambda g: dot(g, direction(w.params))}
    else:
        statistic = {"transform_fn": moments if name == "moments" else sign}
    reported = mb.micro_grad(
        w.loss,
        batch_argnums=w.batch_argnums,
        microbatch_size=size,
        accumulator=MEAN,
        **statistic,
    )
    report_of = mb.clipping_report(reported, *args)
    print(f"{TITLES[name]}: clipping_report\n{report_of}\n", flush=True)
    warm: dict[str, Warm] = {n: warm_up(fn, args) for n, fn in fns.items()}
    errors = [
        (relative_error(warm[n].output, warm[VMAP].output), n)
        for n in warm
        if n not in (PLAIN, VMAP)
    ]
    timed = {n: x.compiled for n, x in warm.items() if x.first_s <= LIMIT_S or n == PLAIN}
    # Two interleaved groups, each way against its own group's plain steps: a per-example
    # way's call (up to a second) between the repetitions of a 25 ms step disturbs them.
    seconds, base = {}, {}
    for group in ([AUTO], [n for n in timed if n not in (PLAIN, AUTO)]):
        found = interleaved({n: timed[n] for n in [PLAIN, *group] if n in timed}, args, reps)
        seconds.setdefault(PLAIN, found[PLAIN])
        for n in group:
            seconds[n], base[n] = found[n], found[PLAIN]
    base[PLAIN] = seconds[PLAIN]
    rows = []
    for n, x in warm.items():
        if n in timed:
            cells = f"{ms(seconds[n])} | {ratio(seconds[n], base[n])}"
        else:
            cells = f"skipped: over {LIMIT_S:.0f} s per call ({x.first_s:.1f} s) | "
        rows.append(f"| {n} | {x.temp_mib:.1f} | {cells} |")
    worst, where = max(errors)
    return "\n".join(
        [
            f"**{TITLES[name]}**; {w.name}, batch {w.batch[0].shape[0]}, microbatch {size}, "
            f"float32, {reps} repetitions. `clipping_report` of `micro_grad` auto: method "
            f"`{report_of.method}` ({report_of.reason}).",
            "",
            "| way | temp MiB | median ms | time / plain [quartiles] |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"Largest relative difference from `vmap(grad)`: {worst:.1e} ({where}). "
            f"{time.perf_counter() - start:.0f} s for this table.",
            "",
            predicted_line(report_of.method, report_of.predicted, seconds, base),
        ]
    )


def predicted_line(
    method: str,
    predicted: dict[str, int],
    seconds: dict[str, list[float]],
    base: dict[str, list[float]],
) -> str:
    """``auto``'s cost model (``clipping_report``'s ``predicted``) against the measured
    ratios of ``auto``'s choice and of the forced per-example path."""
    if not predicted:
        return NO_COSTS
    costs, cheapest = cost_model(predicted)
    forced = "`micro_grad` materialize"
    if AUTO not in seconds or forced not in seconds:
        return f"{costs}; not every way was timed."
    mine = float(np.median(np.asarray(seconds[AUTO]) / np.asarray(base[AUTO])))
    theirs = float(np.median(np.asarray(seconds[forced]) / np.asarray(base[forced])))
    faster = method if mine <= theirs else "materialize"
    return (
        f"{costs}; it predicts `{cheapest}` and picks `{method}`. Measured, time / plain: "
        f"`{method}` (auto) {mine:.2f}x, "
        f"`materialize` {theirs:.2f}x (faster: `{faster}`)."
    )


def preamble(quick: bool) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    optax_note = "" if OPTAX else " optax is not importable: its rows are left out."
    return (
        f"{os.cpu_count()} CPUs, load average {load} at the start. `micro_grad` auto reads "
        "`transform_fn` (or `metrics_fn`) off its traced program and computes each output "
        "leaf from the layers' activations and output cotangents (the `statistics` "
        "method); `micro_grad` materialize forces the per-example gradients "
        "(`clip_method='materialize'`); `vmap(grad)` forms every per-example gradient of "
        "the whole batch at once. A way whose first call takes over "
        f"{LIMIT_S:.0f} s is not timed.{optax_note}" + (" Quick run: batch 256." if quick else "")
    )


def main(argv: Sequence[str]) -> None:
    def parts(quick: bool, reps: int) -> list[Callable[[], str]]:
        examples = 256 if quick else 1024
        out: list[Callable[[], str]] = [lambda: preamble(quick)]
        for name in TITLES:
            out.append(lambda name=name: table(name, mlp_workload(examples), 64, reps))
        # The transformer's steps are ten times the MLP's: fewer repetitions.
        lm_reps = max(3, reps // 3)
        for tokens, batch, size in LM_SHAPES[:1] if quick else LM_SHAPES:
            for name in TITLES:
                out.append(
                    lambda name=name, t=tokens, b=batch, s=size: table(
                        name, tied_lm_workload(b, t), s, lm_reps
                    )
                )
        return out

    report(argv, "gradient_statistics.py", "Per-example gradient statistics", RESULTS, parts)


if __name__ == "__main__":
    main(sys.argv[1:])
