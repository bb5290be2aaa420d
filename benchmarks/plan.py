"""``plan(pick="fastest")`` against the largest size that fits, on the example's language model.

The decoder of ``examples/language_model.py`` (Flax NNX, tied embeddings, token-weighted
mean loss, Adam), at issue 52's size: 8 blocks of width 256, 64 tokens, a batch of 64
sequences. ``build(m)`` is the example's whole training step at microbatch ``m``. The
script

- times every candidate step independently (compiled once, warmed up, then interleaved
  repetitions in one process: medians, and per-repetition ratios to the fastest, with
  quartiles), with the compiled temp memory of each;
- runs ``plan(build, ..., pick="fastest")`` and ``pick="largest"`` (which is also
  jax-privacy's rule: the largest size that fits), and says which size each chose, how
  many programs each compiled, and the chosen step's time over the fastest's, from the
  independent repetitions.

Usage: ``python benchmarks/plan.py [--quick] [--reps N] [--output PATH]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from accumulation import interleaved, ms, ratio, report  # benchmarks/ is on sys.path

import microbatching as mb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import language_model as lm  # examples/, put on the path above

RESULTS = Path(__file__).resolve().parent / "PLAN.md"
SIZES = (4, 8, 16, 32, 64)


def workload(batch: int, layers: int, dim: int, tokens: int) -> tuple[Callable[..., Any], tuple]:
    """The example's training step as ``build(m)``, and its arguments."""
    model = lm.new_model(jax.random.key(0), dim, layers, 4, tokens)
    graphdef, params, rest = lm.nnx.split(model, lm.nnx.Param, ...)
    loss = lm.token_mean_loss(graphdef, rest)
    optimizer = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    x = rng.integers(1, lm.VOCAB, (batch, tokens), dtype=np.int32)
    y = rng.integers(1, lm.VOCAB, (batch, tokens), dtype=np.int32)
    mask = np.arange(tokens)[None] < rng.integers(tokens // 2, tokens + 1, (batch, 1))
    args = (params, optimizer.init(params), jax.numpy.asarray(x), jax.numpy.asarray(y))
    return lambda m: lm.make_train_step(loss, optimizer, m), (*args, jax.numpy.asarray(mask))


def temp_mib(fn: Callable[..., Any], args: Sequence[Any]) -> float:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def compiles(build: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``build``, counting the programs ``plan`` builds (less its first call, ``build(1)``,
    which only tells it the batch)."""
    sizes: list[int] = []

    def counted(m: int) -> Any:
        sizes.append(m)
        return build(m)

    return counted, sizes


def table(batch: int, layers: int, dim: int, tokens: int, reps: int) -> str:
    build, args = workload(batch, layers, dim, tokens)
    sizes = [m for m in SIZES if m <= batch]
    title = (
        f"## Example LM: {layers} blocks, width {dim}, {tokens} tokens, batch {batch}, Adam step"
    )
    picks: dict[str, tuple[int | None, int, float]] = {}
    shown = ""
    for pick in ("fastest", "largest"):
        counted, built = compiles(build)
        start = time.perf_counter()
        found = mb.plan(
            counted, *args, batch_size=batch, candidates=sizes, memory_budget=2**40, pick=pick
        )
        picks[pick] = (found.microbatch_size, len(built) - 1, time.perf_counter() - start)
        if pick == "fastest":
            shown = str(found)
    seconds = interleaved({str(m): build(m) for m in sizes}, args, reps)
    medians = {m: float(np.median(seconds[str(m)])) for m in sizes}
    best = min(medians, key=medians.__getitem__)
    lines = [
        title,
        "",
        "| microbatch | step ms | over the fastest | temp MiB |",
        "|---|---|---|---|",
    ]
    for m in sizes:
        lines.append(
            f"| {m} | {ms(seconds[str(m)])} | {ratio(seconds[str(m)], seconds[str(best)])} | "
            f"{temp_mib(build(m), args):.0f} |"
        )
    lines += ["", "| rule | chose | its step over the fastest | programs compiled | plan took |"]
    lines += ["|---|---|---|---|---|"]
    rules = {
        "fastest": '`plan(pick="fastest")`',
        "largest": '`plan(pick="largest")` (and jax-privacy\'s rule)',
    }
    for pick, (m, compiled, took) in picks.items():
        over = ratio(seconds[str(m)], seconds[str(best)])
        lines.append(f"| {rules[pick]} | {m} | {over} | {compiled} | {took:.0f} s |")
    lines += [
        "",
        f"The fastest size, timed independently after the plans: {best}. The memory budget "
        "is unlimited, so every size fits and `largest` takes the largest. The table that "
        '`plan(pick="fastest")` returned, with its own times:',
        "",
        "```text",
        shown,
        "```",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    def parts(quick: bool, reps: int) -> list[Callable[[], str]]:
        if quick:
            return [lambda: table(16, 2, 64, 32, reps)]
        return [lambda: table(64, 8, 256, 64, reps)]

    report(argv, "plan.py", "plan: the fastest size against the largest", RESULTS, parts)


if __name__ == "__main__":
    main(sys.argv[1:])
