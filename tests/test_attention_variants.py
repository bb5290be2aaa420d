"""Clipping on attention variants that the ghost engine was not written against.

Each model is a one-block transformer language model with tied embeddings, written here
and nowhere else in the library or its benchmarks: multi-head, multi-query and
grouped-query attention, rotary positions, cross-attention into an encoder input given
per example, and LoRA adapters on the query and value projections over frozen weights.
At 4 tokens the dense sites take the Gram form, at 16 the product form (the width is 16:
``T^2 (d + p)`` against ``T d p``; the rank-2 adapters take the product form at both),
which the clipping report pins. Every norm and clipped
sum is held to per-example ``jax.grad`` under ``jax.vmap``, clipped and summed in
float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import microbatching
from microbatching import micro_grad
from microbatching._typing import ClipMethod

from .strategies import assert_close

VOCAB, WIDTH, HEADS, RANK = 11, 16, 4, 2
HEAD = WIDTH // HEADS
BATCH, MICROBATCH = 8, 4
ENCODER_TOKENS = 5


def _normal(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def _lead(a: jax.Array, ndim: int) -> jax.Array:
    """``a`` with leading axes of size 1 up to ``ndim`` (the suite raises on implicit rank
    promotion)."""
    return jnp.reshape(a, (1,) * (ndim - a.ndim) + a.shape)


def _layer_norm(h: jax.Array, scale: jax.Array) -> jax.Array:
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5) * _lead(scale, h.ndim)


def _heads(x: jax.Array, heads: int) -> jax.Array:
    """``(..., T, heads * HEAD)`` to ``(..., heads, T, HEAD)``."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], heads, HEAD), -2, -3)


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary positions on ``(..., T, HEAD)``: each pair of channels turned by an angle
    that grows with the position."""
    t = x.shape[-2]
    freq = 1.0 / (100.0 ** (jnp.arange(HEAD // 2) / (HEAD // 2)))
    angle = jnp.arange(t)[:, None] * freq[None, :]
    cos, sin = _lead(jnp.cos(angle), x.ndim), _lead(jnp.sin(angle), x.ndim)
    a, b = x[..., : HEAD // 2], x[..., HEAD // 2 :]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """Scaled dot-product attention of ``q`` ``(..., H, T, HEAD)`` over ``k``, ``v``
    ``(..., G, S, HEAD)`` with ``H / G`` query heads to each key head."""
    groups = k.shape[-3]
    q = q.reshape(*q.shape[:-3], groups, HEADS // groups, *q.shape[-2:])
    scores = jnp.einsum("...gqtd,...gsd->...gqts", q, k) / math.sqrt(HEAD)
    if causal:
        t, s = scores.shape[-2:]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, s), bool)), scores.shape)
        scores = jnp.where(mask, scores, -1e9)
    out = jnp.einsum("...gqts,...gsd->...gqtd", jax.nn.softmax(scores, axis=-1), v)
    out = out.reshape(*out.shape[:-4], HEADS, *out.shape[-2:])
    return jnp.swapaxes(out, -2, -3).reshape(*out.shape[:-3], out.shape[-2], WIDTH)


def _logits_loss(p: Any, h: jax.Array, targets: jax.Array) -> jax.Array:
    """Tied output embedding, per-token cross-entropy averaged per example."""
    logits = _layer_norm(h, p["final_scale"]) @ p["embed"].T
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
    return -jnp.mean(picked)


def _block(p: Any, tokens: jax.Array, kv_heads: int, rotary: bool, memory: Any) -> jax.Array:
    h = p["embed"][tokens]
    if not rotary:
        h = h + _lead(p["position"][: tokens.shape[-1]], h.ndim)
    x = _layer_norm(h, p["scale"])
    q = _heads(x @ p["q"], HEADS)
    source = x if memory is None else memory @ p["memory"]
    k, v = _heads(source @ p["k"], kv_heads), _heads(source @ p["v"], kv_heads)
    if rotary:
        q, k = _rotary(q), _rotary(k)
    h = h + _attend(q, k, v, causal=memory is None) @ p["o"]
    x = _layer_norm(h, p["mlp_scale"])
    return h + jax.nn.gelu(x @ p["up"]) @ p["down"]


def _params(rng: np.random.Generator, tokens: int, kv_heads: int, memory: bool) -> Any:
    p = {
        "embed": _normal(rng, VOCAB, WIDTH),
        "position": _normal(rng, tokens, WIDTH),
        "scale": 1 + _normal(rng, WIDTH, scale=0.1),
        "q": _normal(rng, WIDTH, WIDTH),
        "k": _normal(rng, WIDTH, kv_heads * HEAD),
        "v": _normal(rng, WIDTH, kv_heads * HEAD),
        "o": _normal(rng, WIDTH, WIDTH),
        "mlp_scale": 1 + _normal(rng, WIDTH, scale=0.1),
        "up": _normal(rng, WIDTH, 2 * WIDTH),
        "down": _normal(rng, 2 * WIDTH, WIDTH),
        "final_scale": 1 + _normal(rng, WIDTH, scale=0.1),
    }
    if memory:
        p["memory"] = _normal(rng, 3, WIDTH)
    return p


def _self_attention(kv_heads: int, rotary: bool = False) -> Callable[..., Any]:
    def build(rng: np.random.Generator, tokens: int) -> tuple[Any, Callable[..., Any], tuple]:
        def loss(p, ids, targets):
            return _logits_loss(p, _block(p, ids, kv_heads, rotary, None), targets)

        params = _params(rng, tokens, kv_heads, memory=False)
        if rotary:
            del params["position"]
        return params, loss, _token_batch(rng, tokens)

    return build


def _cross_attention(rng: np.random.Generator, tokens: int) -> tuple[Any, Callable, tuple]:
    """The decoder's tokens attend (not causally) to an encoder input of 5 rows of 3
    features, one per example: a second batched argument."""

    def loss(p, ids, targets, memory):
        return _logits_loss(p, _block(p, ids, HEADS, False, memory), targets)

    params = _params(rng, tokens, HEADS, memory=True)
    memory = _normal(rng, BATCH, 1, ENCODER_TOKENS, 3, scale=1.0)
    return params, loss, (*_token_batch(rng, tokens), memory)


def _lora(rng: np.random.Generator, tokens: int) -> tuple[Any, Callable, tuple]:
    """Rank-2 adapters on the query and value projections, added as ``x W + (x A) B``
    over frozen weights (closed over, not differentiated)."""
    frozen = _params(rng, tokens, HEADS, memory=False)
    adapters = {
        "q_a": _normal(rng, WIDTH, RANK),
        "q_b": _normal(rng, RANK, WIDTH),
        "v_a": _normal(rng, WIDTH, RANK),
        "v_b": _normal(rng, RANK, WIDTH),
    }

    def lora_loss(a, ids, targets):
        def q_of(x):
            return x @ frozen["q"] + (x @ a["q_a"]) @ a["q_b"]

        def v_of(x):
            return x @ frozen["v"] + (x @ a["v_a"]) @ a["v_b"]

        h = frozen["embed"][ids]
        h = h + _lead(frozen["position"][: ids.shape[-1]], h.ndim)
        x = _layer_norm(h, frozen["scale"])
        q, k, v = _heads(q_of(x), HEADS), _heads(x @ frozen["k"], HEADS), _heads(v_of(x), HEADS)
        h = h + _attend(q, k, v, causal=True) @ frozen["o"]
        x = _layer_norm(h, frozen["mlp_scale"])
        h = h + jax.nn.gelu(x @ frozen["up"]) @ frozen["down"]
        return _logits_loss(frozen, h, targets)

    return adapters, lora_loss, _token_batch(rng, tokens)


def _token_batch(rng: np.random.Generator, tokens: int) -> tuple[jax.Array, jax.Array]:
    ids = jnp.asarray(rng.integers(0, VOCAB, size=(BATCH, 1, tokens)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, VOCAB, size=(BATCH, 1, tokens)), jnp.int32)
    return ids, targets


VARIANTS: dict[str, Callable[[np.random.Generator, int], tuple[Any, Callable, tuple]]] = {
    "multi-head": _self_attention(HEADS),
    "multi-query": _self_attention(1),
    "grouped-query": _self_attention(2),
    "rotary": _self_attention(HEADS, rotary=True),
    "cross-attention": _cross_attention,
    "LoRA on q and v": _lora,
}


def _reference(loss: Callable, params: Any, batch: tuple) -> tuple[list[np.ndarray], np.ndarray]:
    """Each example's gradient (``vmap`` of ``grad`` over examples seen as batches of
    one), as float64 leaves ``(rows, ...)``, and their norms."""
    grads = jax.jit(jax.vmap(jax.grad(loss), (None, *[0] * len(batch))))(params, *batch)
    leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    squares = sum(np.sum(g.reshape(BATCH, -1) ** 2, axis=1) for g in leaves)
    return leaves, np.sqrt(squares)


def _clipped(leaves: list[np.ndarray], norms: np.ndarray, clip: float) -> list[np.ndarray]:
    factors = np.minimum(1.0, clip / norms)
    return [np.tensordot(factors, g, 1) for g in leaves]


@pytest.mark.parametrize(
    ("tokens", "method", "form"),
    [(4, "ghost", "gram"), (16, "ghost", "product"), (16, "auto", None)],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_clipped_sum_and_norm_of_an_attention_variant_is_exact(
    variant: str, tokens: int, method: ClipMethod, form: str | None
):
    params, loss, batch = VARIANTS[variant](np.random.default_rng(7), tokens)
    leaves, norms = _reference(loss, params, batch)
    clip = float(np.median(norms))  # about half the examples clipped
    fn = micro_grad(
        loss,
        batch_argnums=tuple(range(1, 1 + len(batch))),
        microbatch_size=MICROBATCH,
        l2_clip_norm=clip,
        metrics_fn=microbatching.l2_norm,
        clip_method=method,
    )
    report = microbatching.clipping_report(fn, params, *batch)
    if form is not None and variant.startswith("LoRA"):
        form = "product"  # rank 2: T d p = 128 against T^2 (d + p) = 288 even at 4 tokens
    if form is not None:
        forms = {leaf.form for leaf in report.leaves if leaf.rule == "dense"}
        assert form in forms, str(report)
    got, aux = jax.jit(fn)(params, *batch)
    assert_close(aux.metrics, norms, dtype=jnp.float32, factor=4)
    want = jax.tree.unflatten(jax.tree.structure(params), _clipped(leaves, norms, clip))
    assert_close(got, want, dtype=jnp.float32, terms=BATCH // MICROBATCH, factor=4)
