"""The benchmark matrix: every path of the library on four model families, each timed
against the whole batch and a hand-written loop.

Families: an MLP, a CNN (the one of ``xla_conv_grad_in_loop_repro.py``), a small
transformer LM on token ids with per-token weights, and an embedding-heavy model. Paths:
the forward value of ``microbatch``, ``jax.grad`` and ``jax.value_and_grad`` through it
(and with ``fused_gradient=True`` where ``microbatch`` takes that keyword),
``micro_grad`` with MEAN, and ``micro_grad`` with ``l2_clip_norm``. Each path is timed,
interleaved in one process, against the same computation on the whole batch and in a
hand-written ``jax.lax.fori_loop`` over contiguous ``dynamic_slice_in_dim`` microbatches
(and, for gradients, against the transform applied inside the loop,
``microbatch(jax.grad(loss))``); ratios are medians of per-repetition ratios with their
quartiles, as in ``accumulation.py``. The compiled temp memory of ours is read at the batch
and at 4 and 16 times it (compiled only). Every result is checked against its reference
before it is timed.

Usage: ``python benchmarks/matrix.py [--quick] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import inspect
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _provenance  # benchmarks/ is on sys.path when run as a script
import jax
import jax.numpy as jnp
import numpy as np
from accumulation import Fn, clip, data, loss, mlp, ms, ratio  # benchmarks/ is on sys.path
from clipping import attention, cross_entropy, dense, initializers, layer_norm, normal
from xla_conv_grad_in_loop_repro import loss as cnn_loss

import microbatching as mb

RESULTS = Path(__file__).resolve().parent / "MATRIX.md"
MEAN = mb.AccumulationType.MEAN
OURS, LOOP, WHOLE, INSIDE = "ours", "loop", "whole", "inside"
LIMIT_S = 5.0  # a program whose first call takes longer is not timed
LIMIT_MIB = 1536.0  # a program whose compiled temp memory is larger is not run
FUSED = "fused_gradient" in inspect.signature(mb.microbatch).parameters
CHECK_ROWS, CHECK_MICROBATCH = 32, 8  # the check where the references cannot run


# --- Families -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """A loss of ``(params, *batch)``, the mean over the batch's rows, and its data."""

    name: str
    description: str
    loss: Fn
    params: Any
    batch_of: Callable[[int], tuple[jax.Array, ...]]  # a batch of that many rows
    rows: int
    microbatch: int

    @property
    def argnums(self) -> tuple[int, ...]:
        return tuple(range(1, 1 + len(self.abstract(1))))

    def abstract(self, rows: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        return jax.eval_shape(lambda: self.batch_of(rows))


def mlp_family(rows: int) -> Family:
    sizes = [784, 256, 256, 10]
    return Family(
        "MLP",
        f"MLP {'-'.join(map(str, sizes))} (ReLU, biases), softmax cross-entropy.",
        loss,
        mlp(sizes),
        lambda n: data(n, sizes[0], sizes[-1]),
        rows,
        256,
    )


def cnn_family(rows: int) -> Family:
    keys = jax.random.split(jax.random.key(0), 5)
    params = {
        "c1": jax.random.normal(keys[0], (3, 3, 1, 32)) / 3,
        "c2": jax.random.normal(keys[1], (3, 3, 32, 64)) / 17,
        "d": jax.random.normal(keys[2], (7 * 7 * 64, 10)) / 56,
    }

    def batch_of(n: int) -> tuple[jax.Array, jax.Array]:
        x = jax.random.normal(keys[3], (n, 28, 28, 1))
        return x, jax.random.randint(keys[4], (n,), 0, 10)

    return Family(
        "CNN",
        "CNN of `xla_conv_grad_in_loop_repro.py`: NHWC 28x28x1 images, 3x3 convolutions of "
        "stride 2 to 32 and to 64 channels (ReLU, no biases), a dense layer to 10 classes, "
        "softmax cross-entropy.",
        cnn_loss,
        params,
        batch_of,
        rows,
        256,
    )


VOCAB, WIDTH, TOKENS, BLOCKS, HIDDEN = 256, 64, 64, 2, 256


def lm_loss(params: dict[str, Any], ids: jax.Array, targets: jax.Array, w: jax.Array) -> jax.Array:
    """``mean_b sum_t w[b, t] * ce[b, t]``: with ``w = mask * rows / real tokens`` of the
    whole batch, the mean cross-entropy over its real tokens, and a mean over rows, so
    that MEAN over microbatches is exact."""
    h = params["embed"][ids] + params["positions"]
    for block in params["blocks"]:
        h = h + attention(block["attention"], layer_norm(block["ln1"], h))
        up = jax.nn.gelu(dense(block["up"], layer_norm(block["ln2"], h)))
        h = h + dense(block["down"], up)
    logits = layer_norm(params["ln"], h) @ params["embed"].T  # tied output projection
    return jnp.mean(jnp.sum(w * cross_entropy(logits, targets), axis=-1))


def lm_family(rows: int) -> Family:
    k = iter(jax.random.split(jax.random.key(4), 4 + 6 * BLOCKS))
    linear, norm = initializers(k, WIDTH)

    params = {
        "embed": jax.random.normal(next(k), (VOCAB, WIDTH)) * 0.02,
        "positions": jax.random.normal(next(k), (TOKENS, WIDTH)) * 0.02,
        "blocks": [
            {
                "ln1": norm(),
                "attention": {n: linear(WIDTH, WIDTH) for n in "qkvo"},
                "ln2": norm(),
                "up": linear(WIDTH, HIDDEN),
                "down": linear(HIDDEN, WIDTH),
            }
            for _ in range(BLOCKS)
        ],
        "ln": norm(),
    }
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)

    def batch_of(n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        ids = jax.random.randint(k1, (n, TOKENS), 0, VOCAB)
        targets = jax.random.randint(k2, (n, TOKENS), 0, VOCAB)
        lengths = jax.random.randint(k3, (n, 1), TOKENS // 4, TOKENS + 1)
        mask = (jnp.arange(TOKENS) < lengths).astype(jnp.float32)
        return ids, targets, mask * n / jnp.sum(mask)

    return Family(
        "LM",
        f"Transformer LM on int32 token ids (B, {TOKENS}): vocab {VOCAB}, width {WIDTH}, "
        f"{BLOCKS} pre-LN blocks (4-head causal attention, MLP {HIDDEN}), learned positions, "
        "tied output projection. Sequences hold 16 to 64 real tokens; per-token weights "
        "`mask * B / (real tokens of the batch)` make the loss, a mean over sequences of "
        "`sum_t w_t * ce_t`, the mean cross-entropy over the batch's real tokens.",
        lm_loss,
        params,
        batch_of,
        rows,
        32,
    )


TABLE, EMBED, BAG, UNITS = 32768, 64, 16, 64


def bag_loss(params: dict[str, jax.Array], ids: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean-pooled embeddings of a bag of ids, a hidden layer, softmax cross-entropy."""
    pooled = jnp.mean(params["table"][ids], axis=-2)
    hidden = jax.nn.relu(pooled @ params["w1"] + params["b1"])
    return jnp.mean(cross_entropy(hidden @ params["w2"] + params["b2"], labels))


def embedding_family(rows: int) -> Family:
    k = jax.random.split(jax.random.key(6), 5)
    params = {
        "table": jax.random.normal(k[0], (TABLE, EMBED)) * 0.1,
        "w1": normal(k[1], (EMBED, UNITS), EMBED),
        "b1": jnp.zeros(UNITS),
        "w2": normal(k[2], (UNITS, 10), UNITS),
        "b2": jnp.zeros(10),
    }

    def batch_of(n: int) -> tuple[jax.Array, jax.Array]:
        return (
            jax.random.randint(k[3], (n, BAG), 0, TABLE),
            jax.random.randint(k[4], (n,), 0, 10),
        )

    return Family(
        "Embedding",
        f"Embedding table {TABLE}x{EMBED} ({TABLE * EMBED * 4 / 2**20:.0f} MiB, "
        f"{TABLE * EMBED / (TABLE * EMBED + EMBED * UNITS + UNITS * 11 + 10):.1%} of the "
        f"parameters), bags of {BAG} int32 ids mean-pooled, dense {EMBED}-{UNITS}-10 (ReLU), "
        "softmax cross-entropy.",
        bag_loss,
        params,
        batch_of,
        rows,
        256,
    )


# --- Paths ----------------------------------------------------------------------------


def clipped_sum(fun: Fn) -> Fn:
    """``jax.vmap(jax.grad(fun))`` over the rows, each gradient clipped to norm 1, summed."""

    def one(params: Any, *example: jax.Array) -> Any:
        return clip(jax.grad(fun)(params, *(e[None] for e in example)))

    def summed(params: Any, *batch: jax.Array) -> Any:
        grads = jax.vmap(one, in_axes=(None, *[0] * len(batch)))(params, *batch)
        return jax.tree.map(lambda g: jnp.sum(g, axis=0), grads)

    return summed


# What one microbatch computes (and the whole batch at once), and whether the results of
# the microbatches are averaged (else summed).
BODIES: dict[str, tuple[Callable[[Fn], Fn], bool]] = {
    "value": (lambda f: f, True),
    "grad": (jax.grad, True),
    "value_and_grad": (jax.value_and_grad, True),
    "clipped": (clipped_sum, False),
}


def hand_loop(body: Fn, size: int, mean: bool) -> Fn:
    """``body`` on contiguous microbatches read by ``dynamic_slice_in_dim`` in a
    ``fori_loop``, its results summed in the carry (and divided by their number)."""

    def run(params: Any, *batch: jax.Array) -> Any:
        count = batch[0].shape[0] // size

        def step(i: Any, total: Any) -> Any:
            rows = [jax.lax.dynamic_slice_in_dim(a, i * size, size) for a in batch]
            return jax.tree.map(jnp.add, total, body(params, *rows))

        shapes = jax.eval_shape(body, params, *(a[:size] for a in batch))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total = jax.lax.fori_loop(0, count, step, zeros)
        return jax.tree.map(lambda t: t / count, total) if mean else total

    return run


def grads_only(grad_fn: Fn) -> Fn:
    """A ``micro_grad`` function that returns only the accumulated gradients."""
    return lambda *args: grad_fn(*args)[0]


Ours = Callable[[Fn, tuple[int, ...], int], Fn]  # (loss, batch argnums, microbatch size)


@dataclasses.dataclass(frozen=True)
class Way:
    """A path of the library, the body its references compute, and whether the body
    applied inside ``microbatch`` is a reference too."""

    name: str
    ours: Ours
    body: str
    inside: bool


def _fused(f: Fn, nums: tuple[int, ...], m: int) -> Fn:
    options: dict[str, Any] = {"fused_gradient": True}  # absent from older versions
    return jax.value_and_grad(mb.microbatch(f, nums, m, MEAN, **options))


PATHS = [
    Way(
        "forward",
        lambda f, n, m: mb.microbatch(f, n, m, MEAN),
        "value",
        False,
    ),
    Way(
        "grad through",
        lambda f, n, m: jax.grad(mb.microbatch(f, n, m, MEAN)),
        "grad",
        True,
    ),
    Way(
        "value_and_grad through",
        lambda f, n, m: jax.value_and_grad(mb.microbatch(f, n, m, MEAN)),
        "value_and_grad",
        True,
    ),
    *([Way("value_and_grad, fused", _fused, "value_and_grad", True)] if FUSED else []),
    Way(
        "micro_grad",
        lambda f, n, m: grads_only(
            mb.micro_grad(f, batch_argnums=n, microbatch_size=m, accumulator=MEAN)
        ),
        "grad",
        True,
    ),
    Way(
        "clipped micro_grad",
        lambda f, n, m: grads_only(
            mb.micro_grad(f, batch_argnums=n, microbatch_size=m, l2_clip_norm=1.0)
        ),
        "clipped",
        False,
    ),
]


def references(family: Family, path: Way) -> dict[str, Fn]:
    """The whole batch, the hand-written loop and (where it applies) the body inside
    ``microbatch``, for ``path``'s body."""
    transform, mean = BODIES[path.body]
    body = transform(family.loss)
    out = {WHOLE: body, LOOP: hand_loop(body, family.microbatch, mean)}
    if path.inside:
        out[INSIDE] = mb.microbatch(body, family.argnums, family.microbatch, MEAN)
    return out


# --- Measurement ----------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """A compiled program, its temp memory, and its first call (None if not run)."""

    compiled: Any
    temp_mib: float
    first_s: float | None = None
    output: Any = None

    @property
    def timed(self) -> bool:
        return self.first_s is not None and self.first_s <= LIMIT_S

    def note(self) -> str:
        """Why it was not timed."""
        if self.first_s is None:
            return f"not run: {self.temp_mib / 1024:.1f} GiB of temp"
        return f"not timed: {self.first_s:.1f} s a call"


def temp_of(compiled: Any) -> float:
    analysis = compiled.memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def prepare(fn: Fn, args: Sequence[Any]) -> Program:
    """Compiles ``fn``; runs it once unless its temp memory is over ``LIMIT_MIB``."""
    compiled = jax.jit(fn).lower(*args).compile()
    program = Program(compiled, temp_of(compiled))
    if program.temp_mib <= LIMIT_MIB:
        start = time.perf_counter()
        program.output = jax.block_until_ready(compiled(*args))
        program.first_s = time.perf_counter() - start
    return program


def assert_close(got: Any, want: Any, what: str) -> None:
    """Float32 agreement, leaf by leaf, ``atol`` scaled by the largest value of ``want``
    (a gradient that is zero in exact arithmetic, as of a key bias, is rounding noise)."""
    scale = max((float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(want)), default=1.0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale, err_msg=what
        )


def check(family: Family, path: Way, programs: dict[str, Program]) -> str:
    """Checks ours against the whole batch (or the loop); where neither could run, on a
    batch of ``CHECK_ROWS`` rows in microbatches of ``CHECK_MICROBATCH``. Returns what
    it checked against."""
    what = f"{family.name}, {path.name}"
    for name in (WHOLE, LOOP):
        if programs[name].first_s is not None:
            assert_close(programs[OURS].output, programs[name].output, f"{what} against {name}")
            return name
    args = (family.params, *family.batch_of(CHECK_ROWS))
    ours = path.ours(family.loss, family.argnums, CHECK_MICROBATCH)
    want = jax.jit(BODIES[path.body][0](family.loss))(*args)
    assert_close(jax.jit(ours)(*args), want, f"{what} against whole, {CHECK_ROWS} rows")
    return f"whole, {CHECK_ROWS} rows"


def interleaved(
    programs: dict[str, Program], args: Sequence[Any], reps: int
) -> dict[str, list[float]]:
    """Seconds per call of each timed program, every repetition in a fresh random order,
    the garbage collector off."""
    timed = {name: p.compiled for name, p in programs.items() if p.timed}
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    order = np.random.default_rng(0)
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            for name in order.permutation(list(timed)):
                start = time.perf_counter()
                jax.block_until_ready(timed[name](*args))
                seconds[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return seconds


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to run: the temp scales, and the repetitions a path gets: as many as fit
    in ``budget_s`` (from the first calls' times), within ``fewest`` and ``most``."""

    scales: tuple[int, ...]
    budget_s: float
    fewest: int
    most: int

    def reps(self, programs: dict[str, Program]) -> int:
        per_rep = sum(p.first_s or 0.0 for p in programs.values() if p.timed)
        return max(self.fewest, min(self.most, int(self.budget_s / max(per_rep, 1e-3))))


def row(
    family: Family, path: Way, cache: dict[tuple[str, str], Program], settings: Settings
) -> str:
    """One (family, path) cell: compile, check, time, and temp at every scale."""
    start = time.perf_counter()
    args = (family.params, *family.batch_of(family.rows))
    ours = path.ours(family.loss, family.argnums, family.microbatch)
    programs = {OURS: prepare(ours, args)}
    for name, fn in references(family, path).items():
        key = (name, path.body)
        if key not in cache:
            cache[key] = prepare(fn, args)
        programs[name] = cache[key]
    checked = check(family, path, programs)
    reps = settings.reps(programs)
    seconds = interleaved(programs, args, reps)
    temps = [programs[OURS].temp_mib] + [
        temp_of(jax.jit(ours).lower(family.params, *family.abstract(family.rows * s)).compile())
        for s in settings.scales[1:]
    ]
    flat = "yes" if max(temps) <= 1.1 * min(temps) else "**no**"

    def median(name: str) -> str:
        return ms(seconds[name]) if name in seconds else programs[name].note()

    def against(name: str) -> str:
        if name not in programs:
            return ""
        if name not in seconds or OURS not in seconds:
            return "-"
        return ratio(seconds[OURS], seconds[name])

    cells = [
        path.name,
        median(OURS),
        median(LOOP),
        median(WHOLE),
        against(LOOP),
        against(WHOLE),
        against(INSIDE),
        " / ".join(f"{t:.1f}" for t in temps),
        flat,
        str(reps),
    ]
    print(
        f"  {family.name}, {path.name}: checked against {checked}; {reps} repetitions, "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return "| " + " | ".join(cells) + " |"


def family_table(family: Family, settings: Settings) -> str:
    """A section: the family, then a row per path."""
    start = time.perf_counter()
    cache: dict[tuple[str, str], Program] = {}
    rows = [row(family, path, cache, settings) for path in PATHS]
    sizes = ", ".join(str(family.rows * s) for s in settings.scales)
    return "\n".join(
        [
            f"## {family.name}",
            "",
            f"{family.description} Batch {family.rows}, microbatch {family.microbatch} "
            f"({family.rows // family.microbatch} microbatches); temp MiB of ours at batch "
            f"{sizes}. {time.perf_counter() - start:.0f} s for this table.",
            "",
            "| path | ours ms | loop ms | whole ms | ours / loop | ours / whole "
            "| ours / inside | temp MiB | flat | reps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
            *rows,
        ]
    )


# --- Report ---------------------------------------------------------------------------


def header(settings: Settings, stamp: _provenance.Stamp) -> str:
    """What ran, where and when, and what the columns are."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    reps = (
        f"{settings.most}"
        if settings.fewest == settings.most
        else f"as many as fit in {settings.budget_s:.0f} s ({settings.fewest} to "
        f"{settings.most}, the **reps** column)"
    )
    fused = (
        ""
        if FUSED
        else " `microbatch` has no `fused_gradient` keyword here: the fused row is left out."
    )
    scales = ", ".join(f"{s}x" for s in settings.scales)
    return "\n".join(
        [
            "# The benchmark matrix",
            "",
            f"{stamp.describe()}; jax {jax.__version__}, numpy {np.__version__}, "
            f"backend {jax.default_backend()}, "
            f"{os.cpu_count()} CPUs, {now}, load average at start {load}.",
            f"Command: `{command}`; interleaved repetitions per path: {reps}, after one "
            "warm-up call (the check) each. Times are wall-clock per call.",
            "",
            "Every path of the library on four model families, each a loss that averages "
            "over the batch's rows. The paths (ours): **forward** "
            "`microbatch(loss, MEAN)`, its value; **grad through** "
            "`jax.grad(microbatch(loss, MEAN))`; **value_and_grad through** "
            "`jax.value_and_grad(microbatch(loss, MEAN))`; **value_and_grad, fused** the same "
            "with `microbatch(..., fused_gradient=True)`; **micro_grad** "
            "`micro_grad(loss, accumulator=MEAN)`; **clipped micro_grad** "
            "`micro_grad(loss, l2_clip_norm=1.0)`, the sum of the per-example gradients "
            "clipped to norm 1. **ours ms**, **loop ms**, "
            "**whole ms**: the median time of a call of ours, of a hand-written "
            "`jax.lax.fori_loop` over contiguous `dynamic_slice_in_dim` microbatches doing "
            "the same (for clipped: `jax.vmap(jax.grad)`, clip, sum in each microbatch), and "
            "of the function on the whole batch (for clipped: `jax.vmap(jax.grad)`, clip, "
            "sum over the whole batch). **ours / loop**, **ours / whole**, **ours / inside**: "
            "medians of per-repetition ratios, with their quartiles; *inside* is the "
            "transform inside the loop, `microbatch(jax.grad(loss), MEAN)` (or "
            "`jax.value_and_grad`). **temp MiB**: the compiled `temp_size_in_bytes` of ours "
            f"at {scales} the batch (the larger compiled, not run); **flat**: max / min <= "
            f"1.1. A program whose temp is over {LIMIT_MIB / 1024:.1f} GiB is not run, one "
            f"whose first call takes over {LIMIT_S:.0f} s is not timed. Every result of ours "
            "is checked against the whole batch (`assert_allclose`, rtol 1e-4, atol 1e-5 x "
            "the largest value of the result) before it is timed; where no reference could "
            f"run, on {CHECK_ROWS} rows in microbatches of {CHECK_MICROBATCH}." + fused,
            "",
        ]
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description="The benchmark matrix.")
    parser.add_argument(
        "--quick", action="store_true", help="batches / 4, 3 reps, two scales, prints only"
    )
    parser.add_argument("--reps", type=int, help="timed repetitions of every path")
    parser.add_argument("--output", type=Path, help=f"markdown file (default {RESULTS})")
    return parser.parse_args(argv)


def settings_of(quick: bool, reps: int | None) -> Settings:
    """Full: scales 1, 4 and 16, 15 s of timing a path (5 to 21 reps); quick: 1 and 4, 3."""
    full = Settings((1, 4), 0.0, 3, 3) if quick else Settings((1, 4, 16), 15.0, 5, 21)
    return full if reps is None else dataclasses.replace(full, fewest=reps, most=reps)


def families(quick: bool) -> list[Family]:
    """The four families, at a quarter of their batches for ``quick``."""
    q = 4 if quick else 1
    return [
        mlp_family(1024 // q),
        cnn_family(1024 // q),
        lm_family(256 // q),
        embedding_family(4096 // q),
    ]


def main(argv: Sequence[str]) -> None:
    """Runs every family's table and prints (and writes) the report."""
    options = parse_args(argv)
    stamp = _provenance.stamp(__file__, argv)
    start = time.perf_counter()
    settings = settings_of(options.quick, options.reps)
    sections = [header(settings, stamp)]
    print(sections[0], flush=True)
    for family in families(options.quick):
        sections += [family_table(family, settings), ""]
        print(sections[-2], "\n", flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    sections.append(f"Total time {time.perf_counter() - start:.0f} s; load average at end {load}.")
    print(sections[-1])
    output = options.output or (None if options.quick else RESULTS)
    if output is not None:
        _provenance.write(output, "\n".join(sections) + "\n", stamp)
        print(f"Wrote {output}.")


if __name__ == "__main__":
    main(sys.argv[1:])
