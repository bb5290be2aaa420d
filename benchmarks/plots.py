"""Plots time and compiled temp memory against batch size and against microbatch size.

Three workloads, each written four ways: ``microbatching``, ``optax.microbatching`` 0.2.8
with the same API, ``jax.lax.map(f, xs, batch_size=m)`` and the un-microbatched function
(the reference line):

* ``sum``: ``microbatch`` with ``SUM`` of ``sum(tanh(x @ W))``, ``x`` f32[batch, 256].
* ``grad``: gradient accumulation, the gradient of the mean softmax cross-entropy of a
  64-256-10 MLP: ``microbatch(jax.grad(loss), MEAN)``; ``lax.map`` maps the per-example
  loss, and ``jax.grad`` differentiates the mean of the mapped losses.
* ``clipped``: the DP-SGD gradient, each example's gradient clipped to norm 1 and summed:
  ``micro_grad(loss, l2_clip_norm=1.0)`` against optax's ``micro_grad(loss,
  transform_fn=clip)``; ``lax.map`` stacks every clipped gradient, then sums.

Measured as in ``compare.py`` (whose helpers this script imports), one sweep at a time:
every implementation at every point of the sweep is compiled and checked against the
whole-batch result, then each is called once per repetition, all in a fresh random order,
so drift in machine load spreads over the whole curve instead of bending it at one point.
Times are medians over repetitions with the interquartile range as error bars (the
whole-batch reference of a microbatch sweep: a line and a band). Temp memory is XLA's
``compiled.memory_analysis().temp_size_in_bytes``: deterministic, drawn on a log-2 axis
with a row for 0 below it. A full run takes about 3 minutes on 2 CPU cores, most of it
compiling.

Writes ``benchmarks/plots/{workload}.png``: four panels (time and temp memory, against
batch size and against microbatch size), 8 inches wide, lettered so that they read at the
width of the docs' content column (about 700 pixels), and the legend below them. Each PNG
carries the run's provenance stamp in a text chunk (``benchmarks/_provenance.py``), and
its title the library's version and commit.

Usage: ``python benchmarks/plots.py [--quick] [--reps N] [--out DIR] [--only WORKLOAD]``.
``--quick`` (two points per axis, 3 repetitions, under a minute) writes to a fresh temporary
directory unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _provenance  # benchmarks/ is on sys.path when run as a script
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from compare import (  # benchmarks/ is on sys.path when run as a script
    CLASSES,
    INPUTS,
    LAX_MAP,
    OPTAX,
    OURS,
    UNITS,
    WHOLE,
    Candidate,
    _mlp_args,
    check_agreement,
    compile_candidate,
    time_call,
)
from matplotlib.axes import Axes
from matplotlib.ticker import NullFormatter, NullLocator
from optax import microbatching as optax_mb  # benchmark-only dependency

import microbatching as mb

PLOTS = Path(__file__).resolve().parent / "plots"
Fn = Callable[..., Any]
Build = Callable[[int, int], tuple[dict[str, Fn], tuple[Any, ...]]]
# Sizes in points for an 8-inch figure shown about 700 pixels wide: 11 points are 13 pixels.
FONTS: dict[Any, Any] = {
    "font.size": 11,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 11,
}
STYLE: dict[str, dict[str, Any]] = {
    OURS: {"color": "tab:blue", "marker": "o", "linestyle": "-", "zorder": 4},
    OPTAX: {"color": "tab:orange", "marker": "s", "linestyle": "-", "zorder": 3},
    LAX_MAP: {"color": "tab:green", "marker": "^", "linestyle": "-", "zorder": 2},
    WHOLE: {"color": "0.35", "marker": "", "linestyle": "--", "zorder": 1},
}


# --- Workloads --------------------------------------------------------------------------

FEATURES, HIDDEN = 256, 256
Params = dict[str, jax.Array]


def _layer_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(x @ w))


def build_sum(batch: int, micro: int) -> tuple[dict[str, Fn], tuple[Any, ...]]:
    """``microbatch`` with SUM of ``sum(tanh(x @ W))``."""
    x = jax.random.normal(jax.random.key(0), (batch, FEATURES), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (FEATURES, HIDDEN), jnp.float32) / 16

    def lax_map(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(jax.lax.map(lambda row: _layer_sum(row, w), x, batch_size=micro))

    fns: dict[str, Fn] = {
        OURS: mb.microbatch(_layer_sum, argnums=0, microbatch_size=micro),
        OPTAX: optax_mb.microbatch(_layer_sum, argnums=0, microbatch_size=micro),
        LAX_MAP: lax_map,
        WHOLE: _layer_sum,
    }
    return fns, (x, w)


def _loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of the MLP over the batch."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _example_loss(params: Params, xy: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = xy
    return _loss(params, x[None], y[None])


def build_grad(batch: int, micro: int) -> tuple[dict[str, Fn], tuple[Any, ...]]:
    """The gradient of the mean loss, accumulated over microbatches."""

    def lax_map(params: Params, x: jax.Array, y: jax.Array) -> Params:
        def mean_loss(p: Params) -> jax.Array:
            return jnp.mean(jax.lax.map(lambda xy: _example_loss(p, xy), (x, y), batch_size=micro))

        return jax.grad(mean_loss)(params)

    fns: dict[str, Fn] = {
        OURS: mb.microbatch(jax.grad(_loss), (1, 2), micro, mb.AccumulationType.MEAN),
        OPTAX: optax_mb.microbatch(jax.grad(_loss), (1, 2), micro, optax_mb.AccumulationType.MEAN),
        LAX_MAP: lax_map,
        WHOLE: jax.grad(_loss),
    }
    return fns, _mlp_args(batch)


def _clip(grads: Any) -> Any:
    """Scales a gradient to global norm at most 1."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    return jax.tree.map(lambda g: g / jnp.maximum(norm, 1.0), grads)


def _clipped_example_grad(params: Params, xy: tuple[jax.Array, jax.Array]) -> Params:
    return _clip(jax.grad(_example_loss)(params, xy))


def _sum_rows(tree: Params) -> Params:
    return jax.tree.map(lambda g: jnp.sum(g, axis=0), tree)


def _grads_only(grad_fn: Fn) -> Fn:
    """Drops the ``Aux`` of a ``micro_grad`` function."""

    def grads(params: Params, x: jax.Array, y: jax.Array) -> Params:
        return grad_fn(params, x, y)[0]

    return grads


def build_clipped(batch: int, micro: int) -> tuple[dict[str, Fn], tuple[Any, ...]]:
    """Per-example gradients clipped to norm 1, summed (the DP-SGD gradient)."""
    options: dict[str, Any] = {"batch_argnums": (1, 2), "microbatch_size": micro}

    def lax_map(params: Params, x: jax.Array, y: jax.Array) -> Params:
        one = lambda xy: _clipped_example_grad(params, xy)  # noqa: E731
        return _sum_rows(jax.lax.map(one, (x, y), batch_size=micro))

    def whole(params: Params, x: jax.Array, y: jax.Array) -> Params:
        per_example = jax.vmap(_clipped_example_grad, in_axes=(None, 0))(params, (x, y))
        return _sum_rows(per_example)

    fns: dict[str, Fn] = {
        OURS: _grads_only(mb.micro_grad(_loss, l2_clip_norm=1.0, **options)),
        OPTAX: _grads_only(optax_mb.micro_grad(_loss, transform_fn=_clip, **options)),
        LAX_MAP: lax_map,
        WHOLE: whole,
    }
    return fns, _mlp_args(batch)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload and the two sweeps it is measured on."""

    key: str  # in the file names
    title: str
    labels: dict[str, str]  # legend label per implementation
    build: Build
    micro: int  # the fixed microbatch size of the batch sweep
    batches: tuple[int, ...]
    batch: int  # the fixed batch size of the microbatch sweep
    micros: tuple[int, ...]


def workloads(quick: bool) -> list[Workload]:
    """The three workloads, with full or quick sweeps.

    Each batch sweep passes through the fixed batch size of the microbatch sweep, so the
    point where they cross is measured once and appears in both.
    """
    mlp = f"MLP {INPUTS}-{UNITS}-{CLASSES}"
    return [
        Workload(
            key="sum",
            title=f"microbatch, SUM of sum(tanh(x @ W)), x f32[batch, {FEATURES}]",
            labels={
                OURS: "microbatching.microbatch",
                OPTAX: "optax.microbatching.microbatch",
                LAX_MAP: "jax.lax.map(batch_size=m), then sum",
                WHOLE: "whole batch, no microbatching",
            },
            build=build_sum,
            micro=256,
            batches=(1024, 4096) if quick else (1024, 2048, 4096, 8192, 16384, 32768),
            batch=4096 if quick else 16384,
            micros=(64, 256) if quick else (16, 64, 256, 1024, 4096, 16384),
        ),
        Workload(
            key="grad",
            title=f"gradient accumulation: grad of mean cross-entropy, {mlp}",
            labels={
                OURS: "microbatching.microbatch(jax.grad(loss), MEAN)",
                OPTAX: "optax.microbatching.microbatch(jax.grad(loss), MEAN)",
                LAX_MAP: "jax.grad(mean of jax.lax.map(loss, batch_size=m))",
                WHOLE: "jax.grad(loss), whole batch",
            },
            build=build_grad,
            micro=256,
            batches=(512, 2048) if quick else (512, 1024, 2048, 4096, 8192, 16384),
            batch=2048 if quick else 4096,
            micros=(16, 256) if quick else (4, 16, 64, 256, 1024, 4096),
        ),
        Workload(
            key="clipped",
            title=f"per-example gradients clipped to norm 1, summed (DP-SGD), {mlp}",
            labels={
                OURS: "microbatching.micro_grad(loss, l2_clip_norm=1.0)",
                OPTAX: "optax.microbatching.micro_grad(loss, transform_fn=clip)",
                LAX_MAP: "jax.lax.map(clipped grad, batch_size=m), then sum",
                WHOLE: "jax.vmap(clipped grad), whole batch, then sum",
            },
            build=build_clipped,
            micro=64,
            batches=(256, 1024) if quick else (256, 512, 1024, 2048, 4096),
            batch=1024,
            micros=(16, 64) if quick else (4, 16, 64, 256, 1024),
        ),
    ]


# --- Measurement ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """One implementation at one (batch, microbatch): times in seconds, temp in MiB."""

    batch: int
    micro: int
    seconds: list[float]
    temp_mib: float

    def quartiles(self) -> tuple[float, float, float]:
        """The first quartile, median and third quartile of the times, in ms."""
        ms = [s * 1e3 for s in self.seconds]
        if len(ms) < 2:
            return ms[0], ms[0], ms[0]
        q1, q2, q3 = statistics.quantiles(ms, n=4, method="inclusive")
        return q1, q2, q3


Sweep = dict[str, list[Point]]  # implementation -> points along the swept axis
Key = tuple[str, int, int]  # implementation, batch, microbatch (0 for the whole batch)


class Measurer:
    """Compiles and checks each (implementation, batch, microbatch) of a workload once, and
    times a sweep's points all together.

    Every repetition of a sweep calls each implementation at each of the sweep's points
    once, in a fresh random order (seeded), as ``compare.interleaved`` does for one point:
    a change in machine load is spread over all points and implementations rather than
    bending the curve at the point that happened to be measured then. The whole-batch
    reference does not depend on the microbatch size, so a microbatch sweep times it once.
    """

    def __init__(self, workload: Workload, reps: int, warmup: int) -> None:
        self.workload, self.reps, self.warmup = workload, reps, warmup
        self.compiled: dict[Key, tuple[Candidate, tuple[Any, ...]]] = {}

    def compile(self, batch: int, micro: int) -> list[Key]:
        """Compiles and checks every implementation at one point; returns their keys."""
        fns, args = self.workload.build(batch, micro)
        keys: list[Key] = [(name, batch, 0 if name == WHOLE else micro) for name in fns]
        if all(key in self.compiled for key in keys):
            return keys
        start = time.perf_counter()
        candidates = []
        for key, fn in zip(keys, fns.values(), strict=True):
            if key not in self.compiled:
                self.compiled[key] = compile_candidate(key[0], fn, args), args
            candidates.append(self.compiled[key][0])
        check_agreement(candidates, args)
        print(
            f"  {self.workload.key}: compiled and checked batch {batch} microbatch {micro} "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        return keys

    def interleave(self, keys: Sequence[Key]) -> dict[Key, list[float]]:
        """Seconds per call of each key, every repetition in a fresh random order."""
        seconds: dict[Key, list[float]] = {key: [] for key in keys}
        shuffler = random.Random(0)
        gc.collect()
        gc.disable()
        try:
            for rep in range(self.warmup + self.reps):
                for key in shuffler.sample(list(keys), len(keys)):
                    candidate, args = self.compiled[key]
                    elapsed = time_call(candidate.compiled, args)
                    if rep >= self.warmup:
                        seconds[key].append(elapsed)
        finally:
            gc.enable()
        return seconds

    def sweep(self, axis: str) -> Sweep:
        """All implementations along ``axis`` (``"batch"`` or ``"microbatch"``)."""
        w = self.workload
        if axis == "batch":
            pairs = [(b, w.micro) for b in w.batches]
        else:
            pairs = [(w.batch, m) for m in w.micros]
        keys_at = {(batch, micro): self.compile(batch, micro) for batch, micro in pairs}
        start = time.perf_counter()
        seconds = self.interleave(list({k: None for ks in keys_at.values() for k in ks}))
        print(f"  {w.key}: timed the {axis} sweep ({time.perf_counter() - start:.1f} s)")
        result: Sweep = {}
        for (batch, micro), keys in keys_at.items():
            cells = []
            for key in keys:
                point = Point(batch, micro, seconds[key], self.compiled[key][0].temp_mib)
                result.setdefault(key[0], []).append(point)
                cells.append(f"{key[0]} {point.quartiles()[1]:.1f} ms {point.temp_mib:.2f} MiB")
            print(f"    batch {batch} microbatch {micro}: {'  '.join(cells)}", flush=True)
        return result


# --- Plots ------------------------------------------------------------------------------


def _size_label(value: float, _: Any = None) -> str:
    value = round(value)
    return f"{value // 1024}Ki" if value >= 1024 and value % 1024 == 0 else str(value)


def _bytes_label(mib: float) -> str:
    if mib >= 1:
        return f"{mib:g} MiB"
    return f"{mib * 1024:g} KiB"


def _temp_axis(ax: Axes, temps: Sequence[float]) -> float:
    """Log-2 ticks in KiB/MiB; returns the height at which a temp size of 0 is drawn."""
    nonzero = [t for t in temps if t > 0] or [1.0]
    low = math.floor(math.log2(min(nonzero)))
    high = math.ceil(math.log2(max(nonzero)))
    step = max(1, math.ceil((high - low + 1) / 8))  # at most about 8 ticks
    ticks = [2.0**k for k in range(low, high + 1, step)]
    labels = [_bytes_label(t) for t in ticks]
    zero = 2.0 ** (low - step)
    if any(t <= 0 for t in temps):  # a 0 row below the log scale, set off by a dotted line
        ticks, labels = [zero, *ticks], ["0", *labels]
        ax.axhline(2.0 ** (low - step / 2), color="0.5", linewidth=0.8, linestyle=":")
    ax.set_yscale("log", base=2)
    ax.set_yticks(ticks, labels)
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(min(ticks) / 1.5, max(max(nonzero), ticks[-1]) * 1.5)
    return zero


def machine() -> str:
    """The device kind, core count and jax version, for titles."""
    return f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores, jax {jax.__version__}"


def panel(ax: Axes, workload: Workload, axis: str, quantity: str, data: Sweep) -> list[Any]:
    """Draws ``quantity`` (``"time"`` or ``"temp"``) against ``axis``; returns legend handles."""
    along_batch = axis == "batch"
    xs = workload.batches if along_batch else workload.micros
    zero = 0.0  # where a temp size of 0 is drawn on the log axis
    handles: list[Any] = []
    if quantity == "temp":
        zero = _temp_axis(ax, [p.temp_mib for points in data.values() for p in points])
    for name, points in data.items():
        style = STYLE[name]
        reference = name == WHOLE and not along_batch  # one call, whatever the microbatch
        if quantity == "time":
            if reference:  # the same call at every point, timed once
                q1, q2, q3 = points[0].quartiles()
                handles.append(ax.axhline(q2, color=style["color"], linestyle="--", zorder=1))
                ax.axhspan(q1, q3, color=style["color"], alpha=0.12, linewidth=0)
                continue
            q = [p.quartiles() for p in points]
            medians = [m for _, m, _ in q]
            errors = [[m - lo for lo, m, _ in q], [hi - m for _, m, hi in q]]
            handles.append(ax.errorbar(xs, medians, yerr=errors, capsize=3, **style))
        else:
            temps = [p.temp_mib if p.temp_mib > 0 else zero for p in points]
            if reference:
                handles.append(ax.axhline(temps[0], color=style["color"], linestyle="--"))
                continue
            handles.extend(ax.plot(xs, temps, **style))
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [_size_label(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    if along_batch:
        ax.set_xlabel(f"batch size (microbatch {workload.micro})")
    else:
        ax.set_xlabel(f"microbatch size (batch {_size_label(workload.batch)})")
    if quantity == "time":
        ax.set_yscale("log")
        _time_ticks(ax)
        ax.set_ylabel("ms per call")
    else:
        ax.set_ylabel("compiled temp memory")
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    return handles


def _time_ticks(ax: Axes) -> None:
    """Labelled ticks at 1-2-5 multiples (more if the range is narrow) of a log ms axis."""
    low, high = ax.get_ylim()
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 8)):
        exponents = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
        ticks = [m * 10.0**e for e in exponents for m in mantissas]
        ticks = [t for t in ticks if low <= t <= high]
        if len(ticks) >= 4:
            break
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)


def save_figure(
    workload: Workload, data: dict[str, Sweep], out: Path, reps: int, stamp: _provenance.Stamp
) -> Path:
    """Writes the four panels of ``workload`` to ``out/{workload.key}.png``."""
    with plt.rc_context(FONTS):
        fig, axes = plt.subplots(2, 2, figsize=(8.0, 8.4), layout="constrained")
        handles = []
        for row, quantity in enumerate(("time", "temp")):
            for col, axis in enumerate(("batch", "microbatch")):
                drawn = panel(axes[row][col], workload, axis, quantity, data[axis])
                handles = handles or drawn  # the batch-size time panel's, with error bars
        labels = [workload.labels[name] for name in data["batch"]]
        fig.legend(handles, labels, loc="outside lower center", ncols=1)
        fig.suptitle(
            f"{workload.title}\n{machine()}, {stamp.describe()}\n"
            f"times: median and quartiles of {reps} interleaved repetitions"
        )
        path = out / f"{workload.key}.png"
        fig.savefig(path, dpi=150, metadata={_provenance.PNG_KEY: str(stamp)})
        plt.close(fig)
    return path


# --- Command line -----------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def main(argv: Sequence[str]) -> None:
    """Measures every workload along both axes and writes the plots."""
    parser = argparse.ArgumentParser(description="Plots time and temp memory of microbatching.")
    parser.add_argument("--quick", action="store_true", help="2 points per axis, 3 reps")
    parser.add_argument("--reps", type=_positive, help="timed repetitions (default 11, quick 3)")
    parser.add_argument("--out", type=Path, help=f"output folder (default {PLOTS})")
    parser.add_argument("--only", choices=["sum", "grad", "clipped"], help="one workload")
    options = parser.parse_args(argv)
    reps = options.reps or (3 if options.quick else 11)
    warmup = 0 if options.quick else 1  # on top of the call that checks the outputs
    out = options.out or (
        Path(tempfile.mkdtemp(prefix="microbatching-plots-")) if options.quick else PLOTS
    )
    out.mkdir(parents=True, exist_ok=True)
    stamp = _provenance.stamp(__file__, argv)
    start = time.perf_counter()
    print(f"{machine()}; {reps} reps; writing to {out}", flush=True)
    for workload in workloads(options.quick):
        if options.only not in (None, workload.key):
            continue
        measurer = Measurer(workload, reps, warmup)
        data = {axis: measurer.sweep(axis) for axis in ("batch", "microbatch")}
        print(f"  wrote {save_figure(workload, data, out, reps, stamp)}", flush=True)
    print(f"Total time: {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main(sys.argv[1:])
