"""How long the clipped step takes to compile, against the loop a user would write.

Each way is traced, lowered and compiled in a fresh Python process (no compilation cache,
nothing traced before), at batch 512 and microbatch 64, on the MLP, the CNN and the
transformer block of ``benchmarks/clipping.py``: the hand-written ``vmap(grad)`` + clip
``fori_loop``, ``micro_grad`` with ``l2_clip_norm`` (``clip_method='auto'``) and with
``clip_method='ghost'`` and ``'materialize'``. The processes run interleaved, one way
after another, and each time is the median of the repetitions with the per-repetition
ratio to the loop (quartiles). Also reported: the lines of the traced program (jaxpr)
and the kernels (fusions) of the compiled one, which do not depend on the load.

Run: ``.venv/bin/python benchmarks/compile_time.py`` (``make bench``), which writes
``benchmarks/COMPILE.md``; ``--quick`` prints 3 repetitions of the MLP only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from accumulation import ratio, report  # benchmarks/ is on sys.path when run as a script

RESULTS = Path(__file__).resolve().parent / "COMPILE.md"
BATCH, SIZE = 512, 64
MODELS = ("mlp", "cnn", "block")
LOOP = "hand-written loop"
WAYS = (LOOP, "`l2_clip_norm`", "ghost", "materialize")


def _child(model: str, way: str) -> None:
    """In the fresh process: trace, lower and compile one way; print its figures."""
    import clipping
    import jax

    make = {
        "mlp": clipping.mlp_workload,
        "cnn": clipping.cnn_workload,
        "block": clipping.block_workload,
    }
    w = make[model](BATCH)
    if way == LOOP:
        fn = clipping.hand_written(w, SIZE)
    else:
        import microbatching as mb

        method: Any = "auto" if way == "`l2_clip_norm`" else way
        fn = clipping.grads_only(
            mb.micro_grad(
                w.loss,
                l2_clip_norm=1.0,
                batch_argnums=w.batch_argnums,
                microbatch_size=SIZE,
                clip_method=method,
            )
        )
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*w.args)
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text() or ""
    lines = len(str(traced.jaxpr).splitlines())
    print(json.dumps({"s": seconds, "jaxpr": lines, "fusions": text.count(" fusion(")}))


def _measure(model: str, way: str) -> dict[str, float]:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR="", JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run(
        [sys.executable, __file__, "--child", model, way],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(models: Sequence[str], reps: int) -> str:
    """The compile times of every way on ``models``, interleaved over ``reps`` rounds."""
    found: dict[tuple[str, str], list[dict[str, float]]] = {
        (m, w): [] for m in models for w in WAYS
    }
    for _ in range(reps):
        for key in found:
            found[key].append(_measure(*key))
    rows = [
        f"Trace, lower and compile, batch {BATCH}, microbatch {SIZE}, a fresh process each "
        f"({reps} rounds, interleaved); time / loop is the median of per-round ratios "
        "[quartiles].",
        "",
        "| model | way | seconds | time / loop | jaxpr lines | kernels (fusions) |",
        "|---|---|---|---|---|---|",
    ]
    for m in models:
        base = [r["s"] for r in found[(m, LOOP)]]
        for w in WAYS:
            runs = found[(m, w)]
            times = [r["s"] for r in runs]
            rows.append(
                f"| {m} | {w} | {statistics.median(times):.2f} | {ratio(times, base)} "
                f"| {runs[0]['jaxpr']:.0f} | {runs[0]['fusions']:.0f} |"
            )
    return "\n".join(rows)


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2])
        return

    def parts(quick: bool, reps: int) -> list[Callable[[], str]]:
        return [lambda: table(MODELS[:1] if quick else MODELS, _rounds(reps))]

    report(argv, "compile_time.py", "Compile time", RESULTS, parts, _rounds)


def _rounds(reps: int) -> int:
    """A quarter of the repetitions, at least 3: each round starts 12 processes."""
    return max(3, reps // 4)


if __name__ == "__main__":
    main(sys.argv[1:])
