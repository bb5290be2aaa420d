"""Clipped per-example gradient sums: ghost norms against every other way of computing them.

For four workloads (an MLP, a CNN, a transformer block and a Flax NNX language model with
tied embeddings) and three microbatch sizes, and a tied transformer LM at 64, 256 and 1024
tokens (issue 24's settings: batch 256 at microbatch 64, batch 64 at microbatch 16, batch
16 at microbatch 4), the same
DP-SGD sum
``sum_b g_b * min(1, 1 / ||g_b||)`` is computed by ``micro_grad`` with each
``clip_method``, by ``micro_grad`` with the clipping in ``transform_fn``, by optax 0.2.8's
``micro_grad`` with that ``transform_fn``, by the hand-written ``vmap(grad)`` loop, by
jax-privacy's ``clipped_grad`` (where installed) and by ``jax.vmap(jax.grad(loss))`` over
the whole batch, clipped and summed. Each table gives the compiled temp memory and flops
(XLA's count, a loop body once), the median time
of a call and its ratio to ``micro_grad`` without clipping (``plain``), from interleaved
repetitions in one process (medians of per-repetition ratios, with quartiles), as in
``accumulation.py``. A way whose first call (the warm-up) takes over ``LIMIT_S`` seconds is
not timed. Every clipped sum is checked against ``vmap(grad)``.

A last part times the clipping as people write it in ``transform_fn`` (``FORMS``), and
``metrics_fn=optax.tree.norm`` beside it, against ``l2_clip_norm`` (issue 50).
``--device`` (``make bench-device``) runs the forms and each workload at microbatch 64
only, every repetition timed, into ``device/CLIPPING.md``: a run that fits a few minutes
on an accelerator. Its figures describe the commit and the
device they were taken on (the header says which); ``make bench`` does not rewrite them.

Usage: ``python benchmarks/clipping.py [--quick] [--device] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from accumulation import (  # benchmarks/ is on sys.path when run as a script
    Fn,
    clip,
    loss,
    mlp,
    ms,
    ratio,
    report,
)

import microbatching as mb

RESULTS = Path(__file__).resolve().parent / "CLIPPING.md"
DEVICE_RESULTS = Path(__file__).resolve().parent / "device" / "CLIPPING.md"
"""``make bench-device``'s results: the forms and one microbatch size, on an accelerator."""
LIMIT_S = 3.0  # a way whose first call takes longer is not timed
PLAIN, VMAP = "plain", "`vmap(grad)`"
AUTO = "`l2_clip_norm`"
LOOP = "hand-written loop"

try:  # optional, not in the bench extra: its dependency pydantic breaks `make docs`
    # (mkdocstrings' configuration); `.venv/bin/pip install jax-privacy==2.0.0` to time it
    import jax_privacy  # pyright: ignore[reportMissingImports]

    JAX_PRIVACY: str | None = f"jax-privacy {jax_privacy.__version__} `clipped_grad`"
except ImportError:  # pragma: no cover
    jax_privacy = None
    JAX_PRIVACY = None

try:  # benchmark-only dependency
    import optax
    from optax import microbatching as optax_mb

    OPTAX: str | None = f"optax {optax.__version__}"
except ImportError:  # pragma: no cover
    optax = None
    optax_mb = None
    OPTAX = None


@dataclasses.dataclass
class Workload:
    """A loss of ``(params, *batch)``, its arguments and a line that describes it."""

    name: str
    loss: Fn
    params: Any
    batch: tuple[jax.Array, ...]

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.params, *self.batch)

    @property
    def batch_argnums(self) -> tuple[int, ...]:
        return tuple(range(1, 1 + len(self.batch)))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy of each row of ``logits`` (last axis) against integer labels."""
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(key, shape) / np.sqrt(fan_in)


# --- 1. MLP ---------------------------------------------------------------------------


def mlp_workload(examples: int) -> Workload:
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k1, (examples, 784))
    y = jax.random.randint(k2, (examples,), 0, 10)
    return Workload("MLP 784-512-512-10 with biases", loss, mlp([784, 512, 512, 10]), (x, y))


# --- 2. CNN ---------------------------------------------------------------------------


def conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """3x3 convolution of stride 2, NHWC, SAME padding, plus a bias, then ReLU."""
    out = jax.lax.conv_general_dilated(
        x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jax.nn.relu(out + b)


def cnn_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = conv(x, params["conv1"], params["bias1"])
    h = conv(h, params["conv2"], params["bias2"])
    logits = h.reshape(h.shape[0], -1) @ params["dense"] + params["bias3"]
    return jnp.mean(cross_entropy(logits, y))


def cnn_workload(examples: int) -> Workload:
    k = jax.random.split(jax.random.key(3), 5)
    params = {
        "conv1": normal(k[0], (3, 3, 1, 32), 9),
        "bias1": jnp.zeros(32),
        "conv2": normal(k[1], (3, 3, 32, 64), 9 * 32),
        "bias2": jnp.zeros(64),
        "dense": normal(k[2], (7 * 7 * 64, 10), 7 * 7 * 64),
        "bias3": jnp.zeros(10),
    }
    x = jax.random.normal(k[3], (examples, 28, 28, 1))
    y = jax.random.randint(k[4], (examples,), 0, 10)
    name = "CNN 28x28x1, conv 3x3/2 to 32 and to 64 (bias, ReLU), dense to 10"
    return Workload(name, cnn_loss, params, (x, y))


# --- 3. Transformer block -------------------------------------------------------------

VOCAB, WIDTH, HEADS, HIDDEN = 256, 64, 4, 256


def dense(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def layer_norm(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def attention(p: dict[str, Any], x: jax.Array) -> jax.Array:
    """Causal multi-head self-attention of ``x`` (batch, tokens, width)."""
    b, t, d = x.shape
    q, k, v = (dense(p[n], x).reshape(b, t, HEADS, d // HEADS) for n in "qkv")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return dense(p["o"], out.reshape(b, t, d))


def block_loss(params: dict[str, Any], tokens: jax.Array, targets: jax.Array) -> jax.Array:
    h = params["embed"][tokens] + params["positions"]
    h = h + attention(params["attention"], layer_norm(params["ln1"], h))
    up = jax.nn.gelu(dense(params["up"], layer_norm(params["ln2"], h)))
    h = h + dense(params["down"], up)
    logits = dense(params["out"], layer_norm(params["ln3"], h))
    return jnp.mean(cross_entropy(logits, targets))


def initializers(k: Iterator[jax.Array], width: int = WIDTH) -> tuple[Any, Any]:
    """``linear(a, b)`` (scaled normal weights, zero biases) and ``norm()`` (a layer norm
    of ``width``), drawing keys from ``k``."""

    def linear(a: int, b: int) -> dict[str, jax.Array]:
        return {"w": normal(next(k), (a, b), a), "b": jnp.zeros(b)}

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones(width), "bias": jnp.zeros(width)}

    return linear, norm


def transformer_params(
    k: Iterator[jax.Array], tokens: int, width: int, hidden: int, *, tied: bool
) -> dict[str, Any]:
    """One pre-LN block's parameters: embedding, learned positions, attention, MLP, and an
    output projection unless ``tied`` (the embedding table is then read back)."""
    linear, norm = initializers(k, width)
    params = {
        "embed": jax.random.normal(next(k), (VOCAB, width)) * 0.02,
        "positions": jax.random.normal(next(k), (tokens, width)) * 0.02,
        "ln1": norm(),
        "attention": {n: linear(width, width) for n in "qkvo"},
        "ln2": norm(),
        "up": linear(width, hidden),
        "down": linear(hidden, width),
        "ln3": norm(),
    }
    if not tied:
        params["out"] = linear(width, VOCAB)
    return params


def block_workload(examples: int, tokens: int = 32) -> Workload:
    k = iter(jax.random.split(jax.random.key(4), 12))
    params = transformer_params(k, tokens, WIDTH, HIDDEN, tied=False)
    ids = jax.random.randint(next(k), (examples, tokens), 0, VOCAB)
    targets = jax.random.randint(next(k), (examples, tokens), 0, VOCAB)
    name = (
        f"Transformer block: {tokens} tokens over vocab {VOCAB}, width {WIDTH}, learned "
        f"positions, pre-LN, {HEADS}-head causal attention, MLP {HIDDEN}, untied output"
    )
    return Workload(name, block_loss, params, (ids, targets))


# --- 3b. Tied transformer LM (issue 24) ----------------------------------------------

LM_WIDTH, LM_HIDDEN = 128, 512


def tied_lm_loss(params: dict[str, Any], tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """One pre-LN causal block whose output projection is the embedding table (tied),
    per-token cross-entropy averaged over each example's tokens, then over the batch."""
    h = params["embed"][tokens] + params["positions"]
    h = h + attention(params["attention"], layer_norm(params["ln1"], h))
    up = jax.nn.gelu(dense(params["up"], layer_norm(params["ln2"], h)))
    h = h + dense(params["down"], up)
    logits = layer_norm(params["ln3"], h) @ params["embed"].T
    return jnp.mean(jnp.mean(cross_entropy(logits, targets), axis=-1))


def tied_lm_workload(examples: int, tokens: int = 64) -> Workload:
    k = iter(jax.random.split(jax.random.key(7), 12))
    params = transformer_params(k, tokens, LM_WIDTH, LM_HIDDEN, tied=True)
    ids = jax.random.randint(next(k), (examples, tokens), 0, VOCAB)
    targets = jax.random.randint(next(k), (examples, tokens), 0, VOCAB)
    name = (
        f"Tied transformer LM: {tokens} tokens over vocab {VOCAB}, width {LM_WIDTH}, "
        f"{HEADS} heads, MLP {LM_HIDDEN}, pre-LN, causal, TIED output projection, per-token "
        "cross-entropy averaged per example"
    )
    return Workload(name, tied_lm_loss, params, (ids, targets))


# --- 4. Flax NNX language model, tied embeddings, token mask --------------------------


def nnx_workload(examples: int, tokens: int = 64, blocks: int = 2) -> Workload | None:
    """None where flax is not importable."""
    try:
        from flax import nnx
    except ImportError:
        return None

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                HEADS, WIDTH, decode=False, keep_rngs=False, rngs=rngs
            )
            self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
            self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

        def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
            h = h + self.attention(self.ln1(h), mask=mask)
            return h + self.down(nnx.gelu(self.up(self.ln2(h))))

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.positions = nnx.Param(jax.random.normal(rngs.params(), (tokens, WIDTH)) * 0.02)
            self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
            self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)

        def __call__(self, ids: jax.Array) -> jax.Array:
            h = self.embed(ids) + self.positions[...]
            mask = nnx.make_causal_mask(ids)
            for block in self.blocks:
                h = block(h, mask)
            return self.ln(h) @ self.embed.embedding[...].T  # tied output projection

    graphdef, state = nnx.split(LM(nnx.Rngs(5)))

    def lm_loss(state: Any, ids: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
        ce = cross_entropy(nnx.merge(graphdef, state)(ids), targets)
        per_example = jnp.sum(weights * ce, axis=-1) / jnp.sum(weights, axis=-1)
        return jnp.mean(per_example)

    k1, k2, k3 = jax.random.split(jax.random.key(6), 3)
    ids = jax.random.randint(k1, (examples, tokens), 0, VOCAB)
    targets = jax.random.randint(k2, (examples, tokens), 0, VOCAB)
    lengths = jax.random.randint(k3, (examples, 1), tokens // 4, tokens + 1)
    weights = (jnp.arange(tokens) < lengths).astype(jnp.float32)
    name = (
        f"Flax NNX LM: {blocks} pre-LN blocks (nnx.MultiHeadAttention, {HEADS} heads, causal; "
        f"MLP {HIDDEN}), width {WIDTH}, vocab {VOCAB}, {tokens} tokens, TIED embeddings, "
        "loss sum(mask * ce) / sum(mask) per example"
    )
    return Workload(name, lm_loss, state, (ids, targets, weights))


# --- Ways -----------------------------------------------------------------------------


def grads_only(grad_fn: Fn) -> Fn:
    """A ``micro_grad`` function that returns only the summed gradients."""

    def grads(*args: Any) -> Any:
        return grad_fn(*args)[0]

    return grads


def vmap_grad(w: Workload) -> Fn:
    """``jax.vmap(jax.grad(loss))`` over the whole batch, each gradient clipped, summed."""

    def one(params: Any, *example: jax.Array) -> Any:
        return clip(jax.grad(w.loss)(params, *(e[None] for e in example)))

    def summed(params: Any, *batch: jax.Array) -> Any:
        grads = jax.vmap(one, in_axes=(None, *[0] * len(batch)))(params, *batch)
        return jax.tree.map(lambda g: jnp.sum(g, axis=0), grads)

    return summed


def hand_written(w: Workload, size: int) -> Fn:
    """The loop a user would write: ``vmap(grad)`` over contiguous slices of ``size``
    rows in a ``fori_loop``, each gradient clipped, summed into the carry."""

    def one(params: Any, *example: jax.Array) -> Any:
        return clip(jax.grad(w.loss)(params, *(e[None] for e in example)))

    def summed(params: Any, *batch: jax.Array) -> Any:
        def body(i: Any, total: Any) -> Any:
            rows = [jax.lax.dynamic_slice_in_dim(b, i * size, size) for b in batch]
            grads = jax.vmap(one, in_axes=(None, *[0] * len(rows)))(params, *rows)
            return jax.tree.map(lambda t, g: t + jnp.sum(g, axis=0), total, grads)

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.fori_loop(0, batch[0].shape[0] // size, body, zeros)

    return summed


def ways(w: Workload, size: int) -> dict[str, Fn]:
    """Every way of the clipped sum at microbatch ``size``, and ``plain`` first."""
    options: dict[str, Any] = {"batch_argnums": w.batch_argnums, "microbatch_size": size}
    out = {
        PLAIN: grads_only(mb.micro_grad(w.loss, **options)),
        AUTO: grads_only(mb.micro_grad(w.loss, l2_clip_norm=1.0, **options)),
    }
    for method in ("ghost", "two_pass", "chunked", "materialize"):
        out[method] = grads_only(
            mb.micro_grad(w.loss, l2_clip_norm=1.0, clip_method=method, **options)
        )
    out["`transform_fn=clip`"] = grads_only(mb.micro_grad(w.loss, transform_fn=clip, **options))
    out[LOOP] = hand_written(w, size)
    if jax_privacy is not None and JAX_PRIVACY is not None:
        out[JAX_PRIVACY] = jax_privacy.clipped_grad(
            w.loss, l2_clip_norm=1.0, batch_argnums=w.batch_argnums, microbatch_size=size
        )
    if optax_mb is not None and OPTAX is not None:
        out[OPTAX] = grads_only(optax_mb.micro_grad(w.loss, transform_fn=clip, **options))
    return out


# --- Measurement ----------------------------------------------------------------------


@dataclasses.dataclass
class Warm:
    """A compiled way, its temp memory, the time of its first call and that call's output."""

    compiled: Any
    temp_mib: float
    first_s: float
    output: Any
    gflops: float = float("nan")  # XLA's count; a loop body counts once


def warm_up(fn: Fn, args: Sequence[Any]) -> Warm:
    """Compiles ``jax.jit(fn)`` and times its first call (the warm-up)."""
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    temp = float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    gflops = float("nan") if not cost else cost.get("flops", float("nan")) / 1e9
    start = time.perf_counter()
    output = jax.block_until_ready(compiled(*args))
    return Warm(compiled, temp, time.perf_counter() - start, output, gflops)


def interleaved(compiled: dict[str, Any], args: Sequence[Any], reps: int) -> dict[str, list[float]]:
    """``accumulation.interleaved`` on compiled, warmed-up functions (compiled once)."""
    seconds: dict[str, list[float]] = {name: [] for name in compiled}
    order = np.random.default_rng(0)
    for _ in range(reps):
        for name in order.permutation(list(compiled)):
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            seconds[name].append(time.perf_counter() - start)
    return seconds


def relative_error(got: Any, want: Any) -> float:
    """``||got - want|| / ||want||`` over all leaves, in float64."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    diff = total = 0.0
    for a, b in pairs:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff += float(np.sum((a64 - b64) ** 2))
        total += float(np.sum(b64**2))
    return math.sqrt(diff / total)


def workload_table(w: Workload, sizes: Sequence[int], reps: int) -> str:
    """One workload: every way at every microbatch size, ``vmap(grad)`` with the last."""
    start = time.perf_counter()
    examples = w.batch[0].shape[0]
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(w.params))
    ghost = mb.micro_grad(
        w.loss, batch_argnums=w.batch_argnums, microbatch_size=sizes[0], l2_clip_norm=1.0
    )
    clipping = mb.clipping_report(ghost, *w.args)
    print(f"{w.name}, batch {examples}: clipping_report\n{clipping}\n", flush=True)
    coverage = ", ".join(f"{rule} {100 * f:.1f}%" for rule, f in clipping.coverage().items())
    reference = warm_up(vmap_grad(w), w.args)
    rows: list[str] = []
    errors: list[tuple[float, str]] = []
    measured: list[str] = []
    for size in sizes:
        warm: dict[str, Warm] = {}
        for name, fn in ways(w, size).items():
            warm[name] = warm_up(fn, w.args)
            if name != PLAIN:
                errors.append(
                    (relative_error(warm[name].output, reference.output), f"{name}, {size}")
                )
        if size == sizes[-1]:
            warm[VMAP] = reference
        timed = {  # plain, the baseline, is always timed
            name: x.compiled for name, x in warm.items() if x.first_s <= LIMIT_S or name == PLAIN
        }
        slow = [name for name in warm if name not in timed]
        for name in slow:
            print(
                f"{w.name}, microbatch {size}, {name}: skipped: over {LIMIT_S:.0f} s per call "
                f"({warm[name].first_s:.1f} s)",
                flush=True,
            )
        seconds = interleaved(timed, w.args, reps)
        for name, x in warm.items():
            label = "whole batch" if name == VMAP else str(size)
            if name in timed:
                cells = f"{ms(seconds[name])} | {ratio(seconds[name], seconds[PLAIN])}"
            else:
                cells = f"skipped: over {LIMIT_S:.0f} s per call ({x.first_s:.1f} s) | "
            rows.append(f"| {label} | {name} | {x.temp_mib:.1f} | {x.gflops:.2f} | {cells} |")
        measured.append(against_measured(clipping.predicted, seconds, size))
    worst, where = max(errors)
    optax_note = "" if OPTAX else " optax is not importable: its row is left out."
    return "\n".join(
        [
            f"**{w.name}**; batch {examples}, float32, {count} parameters, {reps} repetitions. "
            f"`clipping_report` of `l2_clip_norm=1.0`: method `{clipping.method}` "
            f"({clipping.reason}), coverage of parameters: {coverage}.{optax_note}",
            "",
            "| microbatch | way | temp MiB | GFLOP (XLA) | median ms | time / plain [quartiles] |",
            "|---:|---|---:|---:|---:|---:|",
            *rows,
            "",
            f"Largest relative difference of a clipped sum from `vmap(grad)`: {worst:.1e} "
            f"({where}). {time.perf_counter() - start:.0f} s for this table.",
            "",
            predicted_line(clipping.predicted, clipping.method, measured),
        ]
    )


# --- The API reference's clipping, as transform_fn -------------------------------------


def _global(grads: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))


def _optax_clip(grads: Any) -> Any:
    assert optax is not None  # the forms table runs only where optax is importable
    return optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]


def _unit(grads: Any) -> Any:
    return jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / _global(grads)) / 1.0, grads)


def _normalised(grads: Any) -> Any:
    norm = _global(grads)
    return jax.tree.map(lambda g: g / (norm + 0.01), grads)


def _per_layer(grads: Any) -> Any:
    bound = 1.0 / len(jax.tree.leaves(grads)) ** 0.5
    return jax.tree.map(lambda g: g * jnp.minimum(1.0, bound / jnp.linalg.norm(g)), grads)


FORMS: dict[str, Callable[[Any], Any]] = {
    "`g * min(1, C / ||g||)`": clip,
    "`optax.clip_by_global_norm(C)`": _optax_clip,
    "rescaled to unit norm": _unit,
    "normalised, `g / (||g|| + 0.01)`": _normalised,
    "per-layer, each leaf to `C / sqrt(#leaves)`": _per_layer,
}
"""The clipping forms people write as ``transform_fn`` (issue 50), bound ``C = 1``."""

NORM_METRIC = "none: `l2_clip_norm` and `metrics_fn=optax.tree.norm`"
"""A row of the forms table: the norms as optax computes them, beside ``l2_clip_norm``."""


def forms_table(w: Workload, size: int, reps: int) -> str:
    """Each form of ``FORMS`` as ``micro_grad``'s ``transform_fn`` against
    ``l2_clip_norm=1.0`` on the same workload: the method each takes, temp memory, median
    time and its ratio to ``l2_clip_norm``'s, every sum checked against ``vmap(grad)``
    followed by the same transform."""
    start = time.perf_counter()
    examples = w.batch[0].shape[0]
    options: dict[str, Any] = {"batch_argnums": w.batch_argnums, "microbatch_size": size}
    fns = {AUTO: mb.micro_grad(w.loss, l2_clip_norm=1.0, **options)}
    for name, form in FORMS.items():
        fns[name] = mb.micro_grad(w.loss, transform_fn=form, **options)
    if optax is not None:  # a metric of the norms beside l2_clip_norm: computed from them
        fns[NORM_METRIC] = mb.micro_grad(
            w.loss, l2_clip_norm=1.0, metrics_fn=optax.tree.norm, **options
        )
    per_example = jax.jit(
        jax.vmap(
            lambda p, *e: jax.grad(w.loss)(p, *(x[None] for x in e)),
            in_axes=(None, *[0] * len(w.batch)),
        )
    )(*w.args)
    warm: dict[str, Warm] = {}
    methods: dict[str, str] = {}
    errors: list[tuple[float, str]] = []
    for name, fn in fns.items():
        methods[name] = mb.clipping_report(fn, *w.args).method
        warm[name] = warm_up(grads_only(fn), w.args)
        form = FORMS.get(name, clip)
        want = jax.tree.map(lambda g: jnp.sum(g, axis=0), jax.vmap(form)(per_example))
        errors.append((relative_error(warm[name].output, want), name))
    seconds = interleaved({name: x.compiled for name, x in warm.items()}, w.args, reps)
    rows = [
        f"| {name} | `{methods[name]}` | {x.temp_mib:.1f} | {ms(seconds[name])} | "
        f"{ratio(seconds[name], seconds[AUTO])} |"
        for name, x in warm.items()
    ]
    worst, where = max(errors)
    return "\n".join(
        [
            f"**{w.name}**; batch {examples}, microbatch {size}, the clipping as "
            f"`transform_fn` against `l2_clip_norm=1.0`; {reps} repetitions.",
            "",
            "| transform_fn | method | temp MiB | median ms | time / `l2_clip_norm` [quartiles] |",
            "|---|---|---:|---:|---:|",
            *rows,
            "",
            f"Largest relative difference from `vmap(grad)` and the same transform: "
            f"{worst:.1e} ({where}). {time.perf_counter() - start:.0f} s for this table.",
        ]
    )


def against_measured(predicted: dict[str, int], seconds: dict[str, list[float]], size: int) -> str:
    """At one microbatch size: the median time of each method the cost model compared
    (forced by ``clip_method``), and which was faster."""
    timed = {name: float(np.median(seconds[name])) for name in predicted if name in seconds}
    if len(timed) < 2:
        return f"microbatch {size}: not every compared method was timed"
    fastest = min(timed, key=lambda name: timed[name])
    cells = ", ".join(f"`{name}` {1e3 * t:.1f} ms" for name, t in timed.items())
    return f"microbatch {size}: {cells} (faster: `{fastest}`)"


NO_COSTS = "`auto` compared no costs here (`clipping_report` has no `predicted`)."


def cost_model(predicted: dict[str, int]) -> tuple[str, str]:
    """``clipping_report``'s ``predicted`` costs as text, and the method it finds cheapest."""
    costs = ", ".join(f"`{name}` {flops:,}" for name, flops in predicted.items())
    cheapest = min(predicted, key=lambda name: predicted[name])
    return f"`auto`'s cost model, per example: {costs} flops", cheapest


def predicted_line(predicted: dict[str, int], method: str, measured: list[str]) -> str:
    """The cost model's prediction (``clipping_report``'s ``predicted``) against the
    measured medians of the methods it compared."""
    if not predicted:
        return NO_COSTS
    costs, cheapest = cost_model(predicted)
    return (
        f"{costs}; it predicts `{cheapest}` (and picks `{method}`). Measured: "
        + "; ".join(measured)
        + "."
    )


def preamble(quick: bool) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs, load average {load} at the start. Every way computes "
        "`sum_b g_b * min(1, 1 / ||g_b||)` for the per-example gradients `g_b` of the "
        "loss, except `plain` (`micro_grad` without clipping: one gradient of the summed "
        "loss, the baseline of the ratios). `l2_clip_norm` is `l2_clip_norm=1.0` with "
        "the default `clip_method='auto'` (the method it picks is named above each "
        "table); `ghost`, `two_pass`, `chunked` and `materialize` force that "
        "`clip_method`; `transform_fn=clip` and optax clip in `transform_fn`; "
        "`vmap(grad)` is `jax.vmap(jax.grad(loss))` over the whole batch, clipped and "
        "summed (it does not depend on the microbatch; it is timed with the last one); the "
        "hand-written loop is `vmap(grad)`, clipped and summed, over contiguous slices in a "
        "`fori_loop`; jax-privacy's `clipped_grad` runs where it is installed (a bench extra). "
        "GFLOP is XLA's cost analysis of the compiled program, which counts a loop body "
        "once: a structural measure, where the times are indicative on shared cores. "
        f"A way whose first call takes over {LIMIT_S:.0f} s is not timed."
        + (" Quick run: batch 256." if quick else "")
    )


def forms_parts(quick: bool, count: int) -> list[Callable[[], str]]:
    """The forms tables (issue 50's setting: batch 512, microbatch 64)."""
    if optax is None:
        return [lambda: "The `transform_fn` forms: skipped (optax is not importable)."]
    examples = 128 if quick else 512
    head = (
        "## The clipping as `transform_fn`\n\nThe API reference's own spelling of clipping "
        "and four others, each as `transform_fn` (bound 1), against `l2_clip_norm=1.0`."
    )
    out: list[Callable[[], str]] = [lambda: head]
    for make in (mlp_workload, cnn_workload):
        out.append(lambda make=make: forms_table(make(examples), 64, count))
    out.append(lambda: forms_table(tied_lm_workload(examples, 64), 64, count))
    return out


def main(argv: Sequence[str]) -> None:
    device = "--device" in argv
    argv = [a for a in argv if a != "--device"]

    def parts(quick: bool, reps: int) -> list[Callable[[], str]]:
        examples = 256 if quick else 1024
        sizes = [16, 64] if quick else [16, 64, 256]
        count = _timed(reps)
        if device:  # make bench-device: the forms, and each workload at microbatch 64
            out = [lambda: preamble(quick), *forms_parts(quick, reps)]
            for make in (mlp_workload, cnn_workload, block_workload):
                out.append(lambda make=make: workload_table(make(examples), [64], reps))
            return out
        out: list[Callable[[], str]] = [lambda: preamble(quick)]
        for make in (mlp_workload, cnn_workload, block_workload):
            out.append(lambda make=make: workload_table(make(examples), sizes, count))

        def lm() -> str:
            w = nnx_workload(examples)
            if w is None:
                print("flax is not importable: the Flax NNX workload is skipped.")
                return "Flax NNX LM: skipped (flax is not importable)."
            return workload_table(w, sizes, count)

        out.append(lm)
        lm_shapes = ((64, 256, 64), (256, 64, 16), (1024, 16, 4))  # issue 24's settings
        for tokens, batch, size in lm_shapes[:1] if quick else lm_shapes:
            out.append(
                lambda t=tokens, b=batch, m=size: workload_table(tied_lm_workload(b, t), [m], count)
            )
        return out + forms_parts(quick, reps)  # all of them: the forms differ by a few %

    if device:
        title = "Clipped per-example gradients on the device"
        report(argv, "clipping.py", title, DEVICE_RESULTS, parts, flags=["--device"])
    else:
        report(argv, "clipping.py", "Clipped per-example gradients", RESULTS, parts, _timed)


def _timed(reps: int) -> int:
    """A quarter of the repetitions, at least 3: the per-example ways take a second or more
    a call."""
    return max(3, reps // 4)


if __name__ == "__main__":
    main(sys.argv[1:])
