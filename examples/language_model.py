"""A byte-level language model in Flax NNX, trained with gradient accumulation.

A small decoder-only transformer (causal self-attention, pre-LayerNorm blocks, input and
output embeddings tied) learns the text that ships with Python itself: the help topics
of ``pydoc_data.topics``, about 460 KB of English and code, no download.

- **Data.** Every paragraph of every topic becomes bytes after a start token (0, which
  the text never uses), cut into windows of ``--seq-len`` inputs and their next-byte
  targets. The last window of a paragraph is padded and a mask marks its real targets.
  Whole topics are held out for validation.
- **Loss.** Each sequence's loss is the mean over its real tokens, and ``micro_grad``
  with ``example_weights`` = its number of real tokens and the ``MEAN`` accumulator
  gives ``sum(n_b * g_b) / sum(n_b)``: the gradient of the mean over every real token
  of the batch, as if the batch were one sequence. The script checks that against
  ``jax.grad`` of the whole batch's token mean.
- **Step.** One jitted step: the accumulated gradient ``--microbatch-size`` sequences
  at a time, then ``optax.adamw``. ``microbatching.plan`` picks the microbatch size:
  the largest whose compiled step fits ``--memory-budget``; its table is printed.
- **Output.** Train loss and validation bits per byte (the mean negative log2
  likelihood of each held-out byte, evaluated with ``microbatch`` 64 sequences at a
  time), then a sampled continuation of a prompt.
- **--dp.** The model trained as above is fine-tuned with DP-SGD on topics it has not
  seen: Poisson sampling (each sequence joins a step's batch with probability ``q``,
  padded to a fixed size and masked), each sequence's gradient clipped to norm ``C``
  (``micro_grad(l2_clip_norm=C)``), Gaussian noise of standard deviation ``sigma * C``
  added to the sum. It prints the ε that ``examples/accounting.py`` (dp-accounting)
  gives for the ``q``, ``sigma`` and steps used, at ``--delta``. The privacy unit is
  one sequence of ``--seq-len`` bytes: a paragraph longer than that spans several, and
  protecting a whole topic would take group privacy.

Run::

    python examples/language_model.py           # about 4.5 min on 2 CPUs
    python examples/language_model.py --dp      # then a DP fine-tune and its ε (+2 min)
    python examples/language_model.py --quick   # a tiny model, a few steps (CI)
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pydoc_data.topics import topics
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from accounting import epsilon, gaussian_like, padded_size, poisson_batch
from checks import assert_trees_close
from flax import nnx

import microbatching
from microbatching import AccumulationType, l2_norm, micro_grad, microbatch

VOCAB = 256  # bytes; 0 is the start token and never occurs in the text
START = 0
EVAL_MICROBATCH = 64

Params = Any
Step = Callable[..., Any]


class Data(NamedTuple):
    """Windows of one split: inputs, next-byte targets and the mask of real targets,
    each of shape ``(num_sequences, seq_len)``."""

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray


def windows(text: str, seq_len: int) -> Data:
    """Every paragraph of ``text`` as a start token and its bytes, cut into windows.

    A paragraph of ``L`` bytes has ``L`` targets (each byte, predicted from the bytes
    before it), in ``ceil(L / seq_len)`` windows; the last one is padded with zeros.
    """
    xs, ys, masks = [], [], []
    for paragraph in text.split("\n\n"):
        if not paragraph.strip():
            continue
        tokens = np.frombuffer(bytes([START]) + paragraph.encode(), np.uint8).astype(np.int32)
        for start in range(0, len(tokens) - 1, seq_len):
            chunk = tokens[start : start + seq_len + 1]
            pad = seq_len + 1 - len(chunk)
            chunk = np.pad(chunk, (0, pad))
            xs.append(chunk[:-1])
            ys.append(chunk[1:])
            masks.append(np.arange(seq_len) < seq_len - pad)
    return Data(np.stack(xs), np.stack(ys), np.stack(masks))


def load_splits(seq_len: int) -> dict[str, Data]:
    """The topics, sorted by name: every 10th is validation, every 5th from the 4th is
    private (the DP fine-tune's data), the rest is training."""
    names = sorted(topics)
    split_of = {
        name: {0: "validation", 3: "private", 8: "private"}.get(i % 10, "train")
        for i, name in enumerate(names)
    }
    return {
        split: windows("\n\n".join(topics[n] for n in names if split_of[n] == split), seq_len)
        for split in ("train", "validation", "private")
    }


class Block(nnx.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP, each
    added to the residual stream."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs) -> None:
        self.num_heads = num_heads
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        batch, length, dim = h.shape
        heads = self.qkv(self.norm1(h)).reshape(batch, length, 3, self.num_heads, -1)
        q, k, v = heads[:, :, 0], heads[:, :, 1], heads[:, :, 2]
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attended.reshape(batch, length, dim))
        return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))


class Decoder(nnx.Module):
    """A decoder-only transformer over bytes whose output layer is the input embedding
    (tied embeddings): ``logits = final_norm(h) @ embedding.T``."""

    def __init__(
        self, dim: int, num_layers: int, num_heads: int, seq_len: int, *, rngs: nnx.Rngs
    ) -> None:
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(VOCAB, dim, embedding_init=init, rngs=rngs)
        self.position = nnx.Param(init(rngs.params(), (seq_len, dim)))
        self.blocks = nnx.List([Block(dim, num_heads, rngs=rngs) for _ in range(num_layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens) + self.position[None, : tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.norm(h))


@nnx.jit(static_argnums=(1, 2, 3, 4))
def new_model(key: jax.Array, dim: int, num_layers: int, num_heads: int, seq_len: int) -> Decoder:
    """A freshly initialised decoder, built in one compiled call."""
    return Decoder(dim, num_layers, num_heads, seq_len, rngs=nnx.Rngs(key))


def token_mean_loss(graphdef: Any, rest: Any) -> Callable[..., jax.Array]:
    """The mean cross-entropy over the real tokens of a batch of sequences, as a function
    of the parameters. ``micro_grad`` calls it on one sequence at a time."""

    def loss(params: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params, rest)(x)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

    return loss


def make_train_step(
    loss: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    microbatch_size: int | None,
) -> Step:
    """``(params, opt_state, x, y, mask) -> (params, opt_state, token-mean loss)``, the
    gradient accumulated ``microbatch_size`` sequences at a time."""
    grad_fn = micro_grad(
        loss,
        batch_argnums=(1, 2, 3),
        microbatch_size=microbatch_size,
        accumulator=AccumulationType.MEAN,
    )

    def step(params: Params, opt_state: Any, x: jax.Array, y: jax.Array, mask: jax.Array) -> Any:
        tokens = jnp.sum(mask, axis=1)  # each sequence weighs its number of real tokens
        grads, aux = grad_fn(params, x, y, mask, example_weights=tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        mean_loss = jnp.sum(aux.values * tokens) / jnp.sum(tokens)
        return optax.apply_updates(params, updates), opt_state, mean_loss

    return step


def make_dp_step(
    loss: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    microbatch_size: int,
    args: argparse.Namespace,
) -> Step:
    """``(params, opt_state, x, y, mask, sampled, key) -> (params, opt_state, token-mean
    loss, fraction clipped)``: DP-SGD on a Poisson batch padded to a fixed size, whose
    rows ``sampled`` marks."""
    clipped_sum = micro_grad(
        loss,
        batch_argnums=(1, 2, 3),
        microbatch_size=microbatch_size,
        l2_clip_norm=args.clip_norm,
        metrics_fn=l2_norm,  # each sequence's gradient norm, before clipping
    )

    def step(
        params: Params,
        opt_state: Any,
        x: jax.Array,
        y: jax.Array,
        mask: jax.Array,
        sampled: jax.Array,
        key: jax.Array,
    ) -> Any:
        summed, aux = clipped_sum(params, x, y, mask, example_weights=sampled)
        noisy = jax.tree.map(
            jnp.add, summed, gaussian_like(key, summed, args.noise_multiplier * args.clip_norm)
        )
        # Divided by the expected batch size, not the sampled one, which is private.
        grads = jax.tree.map(lambda g: g / args.expected_batch_size, noisy)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        tokens = jnp.sum(mask, axis=1) * sampled
        mean_loss = jnp.sum(aux.values * tokens) / jnp.maximum(jnp.sum(tokens), 1)
        clipped = jnp.sum(sampled & (aux.metrics > args.clip_norm)) / jnp.maximum(
            jnp.sum(sampled), 1
        )
        return optax.apply_updates(params, updates), opt_state, mean_loss, clipped

    return step


def make_bits_per_byte(loss: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A jitted ``(params, x, y, mask) -> bits per byte``: the mean negative
    log2-likelihood of every real target byte, summed ``EVAL_MICROBATCH`` sequences at a
    time (with ``allow_remainder``, any number of sequences)."""

    def nll_and_count(params: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> Any:
        count = jnp.sum(mask)
        return loss(params, x, y, mask) * count, count

    summed = microbatch(
        nll_and_count, argnums=(1, 2, 3), microbatch_size=EVAL_MICROBATCH, allow_remainder=True
    )

    @jax.jit
    def bits_per_byte(params: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
        total, count = summed(params, x, y, mask)
        return total / count / math.log(2)

    return bits_per_byte


def sample(model: Decoder, prompt: str, length: int, key: jax.Array) -> str:
    """``prompt`` continued by ``length`` bytes drawn from the model at temperature 0.7,
    in one compiled loop; the context is the last ``seq_len`` bytes."""
    seq_len = model.position.shape[0]
    start = list(bytes([START]) + prompt.encode())
    end = len(start) + length
    tokens = jnp.zeros(max(end, seq_len), jnp.int32).at[: len(start)].set(jnp.array(start))

    @nnx.jit
    def generate(model: Decoder, tokens: jax.Array) -> jax.Array:
        def draw(i: jax.Array, tokens: jax.Array) -> jax.Array:
            first = jnp.maximum(i - seq_len, 0)
            context = jax.lax.dynamic_slice_in_dim(tokens, first, seq_len)
            logits = model(context[None])[0, i - 1 - first]
            token = jax.random.categorical(jax.random.fold_in(key, i), logits / 0.7)
            return tokens.at[i].set(token)

        return jax.lax.fori_loop(len(start), end, draw, tokens)

    out = np.asarray(generate(model, tokens))[1:end]
    return bytes(out.astype(np.uint8)).decode("utf-8", errors="replace")


def check_token_weighting(
    loss: Callable[..., jax.Array], params: Params, batch: Data, microbatch_size: int
) -> None:
    """The accumulated gradient with token-count weights against ``jax.grad`` of the
    token mean of the whole batch at once, computed without ``microbatching``."""
    grad_fn = micro_grad(
        loss,
        batch_argnums=(1, 2, 3),
        microbatch_size=microbatch_size,
        accumulator=AccumulationType.MEAN,
    )

    @jax.jit
    def both(params: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> Any:
        weighted, _ = grad_fn(params, x, y, mask, example_weights=jnp.sum(mask, axis=1))
        return weighted, jax.grad(loss)(params, x, y, mask)

    lengths = batch.mask.sum(axis=1)
    print(
        f"check batch: {len(lengths)} sequences holding {lengths.min()} to {lengths.max()} "
        f"real tokens ({lengths.sum()} in all)"
    )
    weighted, whole = both(params, *batch)
    assert_trees_close(weighted, whole, "micro_grad(MEAN, example_weights=tokens)")


def choose_microbatch_size(
    build: Callable[[int | None], Step], example: tuple[Any, ...], args: argparse.Namespace
) -> int:
    """``--microbatch-size``, or the largest power of two that ``microbatching.plan``
    fits in ``--memory-budget``; prints the plan's table."""
    if args.microbatch_size is not None:
        return args.microbatch_size
    candidates = [m for m in (4, 8, 16, 32, 64, 128) if m <= args.batch_size]
    chosen = microbatching.plan(
        build,
        *example,
        batch_size=args.batch_size,
        memory_budget=int(args.memory_budget * 2**20),
        candidates=[m for m in candidates if args.batch_size % m == 0],
        compile_all=True,  # the whole memory table, not only the sizes the search needs
    )
    print(chosen)
    assert chosen.microbatch_size is not None
    return chosen.microbatch_size


def train(
    loss: Callable[..., jax.Array],
    evaluate: Callable[..., jax.Array],
    params: Params,
    splits: dict[str, Data],
    args: argparse.Namespace,
) -> Params:
    """Trains with gradient accumulation and AdamW; prints loss and validation bits per
    byte as they fall. Returns the parameters."""
    data, rng = splits["train"], np.random.default_rng(args.seed)

    def batch() -> Data:
        rows = rng.choice(len(data.x), args.batch_size, replace=False)
        return Data(data.x[rows], data.y[rows], data.mask[rows])

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, max(1, args.steps // 10), args.steps, args.learning_rate / 10
    )
    optimizer = optax.adamw(schedule, b2=0.98, weight_decay=0.01)
    opt_state = optimizer.init(params)
    example = (params, opt_state, *batch())
    size = choose_microbatch_size(lambda m: make_train_step(loss, optimizer, m), example, args)
    check_token_weighting(loss, params, batch(), size)

    step = jax.jit(make_train_step(loss, optimizer, size), donate_argnums=(0, 1))
    print(
        f"\ntraining: {args.steps} steps of {args.batch_size} sequences of {args.seq_len} bytes "
        f"({args.batch_size // size} microbatches of {size}), AdamW, peak lr {args.learning_rate}"
    )
    validation = splits["validation"]
    print(f"  step {0:5d}  validation {float(evaluate(params, *validation)):.3f} bits/byte")
    start, losses = time.perf_counter(), []
    for index in range(1, args.steps + 1):
        params, opt_state, value = step(params, opt_state, *batch())
        losses.append(float(value))
        if index % args.log_every == 0 or index == args.steps:
            train_bpb = np.mean(losses[-args.log_every :]) / math.log(2)
            val_bpb = float(evaluate(params, *validation))
            print(
                f"  step {index:5d}  train {train_bpb:.3f}  validation {val_bpb:.3f} bits/byte"
                f"  ({time.perf_counter() - start:.0f} s)"
            )
    return params


def dp_fine_tune(
    loss: Callable[..., jax.Array],
    evaluate: Callable[..., jax.Array],
    params: Params,
    splits: dict[str, Data],
    args: argparse.Namespace,
) -> Params:
    """DP-SGD on the private split with Poisson sampling; prints the epsilon spent."""
    data, rng = splits["private"], np.random.default_rng(args.seed + 1)
    num_examples = len(data.x)
    rate = args.expected_batch_size / num_examples
    # A batch that a Poisson draw overflows with probability at most 1e-12, rounded up
    # to whole microbatches.
    size = args.dp_microbatch_size
    padded = size * math.ceil(padded_size(num_examples, rate) / size)
    optimizer = optax.adamw(args.dp_learning_rate, b2=0.98, weight_decay=0.01)
    opt_state = optimizer.init(params)
    step = jax.jit(make_dp_step(loss, optimizer, args.dp_microbatch_size, args))
    print(
        f"\nDP fine-tune on {num_examples} private sequences: {args.dp_steps} steps, Poisson "
        f"sampling rate q={rate:.4f} (expected batch {args.expected_batch_size}, padded to "
        f"{padded}), clip C={args.clip_norm}, noise multiplier sigma={args.noise_multiplier}"
    )
    key = jax.random.key(args.seed + 2)
    start = time.perf_counter()
    for index in range(1, args.dp_steps + 1):
        rows, sampled = poisson_batch(rng, num_examples, rate, padded)
        params, opt_state, value, clipped = step(
            params,
            opt_state,
            data.x[rows],
            data.y[rows],
            data.mask[rows],
            sampled,
            jax.random.fold_in(key, index),
        )
        if index % args.dp_log_every == 0 or index == args.dp_steps:
            print(
                f"  step {index:5d}  train {float(value) / math.log(2):.3f} bits/byte  "
                f"clipped {float(clipped):.0%}  ({time.perf_counter() - start:.0f} s)"
            )
    spent = epsilon(
        noise_multiplier=args.noise_multiplier,
        sampling_rate=rate,
        steps=args.dp_steps,
        delta=args.delta,
    )
    validation_bpb = float(evaluate(params, *splits["validation"]))
    print(f"  validation {validation_bpb:.3f} bits/byte")
    print(
        f"privacy: ({spent:.2f}, {args.delta:g})-DP for each {args.seq_len}-byte sequence of the "
        f"private split (examples/accounting.py, q={rate:.4f}, sigma="
        f"{args.noise_multiplier}, {args.dp_steps} steps)"
    )
    return params


def parse_args() -> argparse.Namespace:
    """The command-line flags; ``--quick`` shrinks every size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps (CI)")
    parser.add_argument("--dp", action="store_true", help="then fine-tune with DP-SGD")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=6e-3)
    parser.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="sequences per microbatch (default: the largest power of two that "
        "microbatching.plan fits in --memory-budget)",
    )
    parser.add_argument(
        "--memory-budget", type=float, default=160.0, help="MiB of compiled memory per step"
    )
    parser.add_argument("--dp-steps", type=int, default=40)
    parser.add_argument("--expected-batch-size", type=int, default=64)
    parser.add_argument("--dp-microbatch-size", type=int, default=16)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.25)
    parser.add_argument("--dp-learning-rate", type=float, default=3e-4)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.seq_len = 4, 16, 32
        args.dim, args.layers, args.heads = 32, 1, 2
        args.dp_steps, args.expected_batch_size, args.dp_microbatch_size = 3, 8, 8
        args.memory_budget = min(args.memory_budget, 2.5)
    args.log_every = max(1, args.steps // 10)
    args.dp_log_every = max(1, args.dp_steps // 5)
    return args


def main() -> None:
    """Trains, samples, and with ``--dp`` fine-tunes privately."""
    args = parse_args()
    splits = load_splits(args.seq_len)
    if args.quick:  # a validation set of 2 microbatches and a remainder of 3
        splits["validation"] = Data(*(a[: 2 * EVAL_MICROBATCH + 3] for a in splits["validation"]))
    for name, data in splits.items():
        real = int(data.mask.sum())
        print(
            f"{name}: {len(data.x)} sequences, {real} real tokens "
            f"({real / data.mask.size:.0%} of the padded windows)"
        )
    init_key, sample_key = jax.random.split(jax.random.key(args.seed))
    model = new_model(init_key, args.dim, args.layers, args.heads, args.seq_len)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    print(
        f"model: {args.layers} pre-LayerNorm blocks of width {args.dim}, {args.heads} heads, "
        f"tied byte embeddings; {num_params:,} parameters"
    )
    loss = token_mean_loss(graphdef, rest)
    start = time.perf_counter()
    evaluate = make_bits_per_byte(loss)
    params = train(loss, evaluate, params, splits, args)
    print(f"trained in {time.perf_counter() - start:.0f} s")
    prompt = "The "
    text = sample(nnx.merge(graphdef, params, rest), prompt, 64 if args.quick else 300, sample_key)
    print(f"\nsample: {text!r}")
    if args.dp:
        dp_fine_tune(loss, evaluate, params, splits, args)


if __name__ == "__main__":
    main()
