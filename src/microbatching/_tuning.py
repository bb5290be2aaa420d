"""The knobs that trade speed for memory or choose between exact methods, by backend.

Each was measured on one backend; ``knobs()`` gives the installed default backend's. A
backend that nothing was measured on gets the CPU's values (but the ghost norms take a
microbatch whole there), which is never a wrong result, only possibly a slower one
(each knob chooses between exact forms or sizes a chunk). ``plan`` measuring on the
user's device is how a GPU or TPU user tunes beyond them.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Knobs:
    """One backend's tuning. ``measured_on`` says where its values come from."""

    measured_on: str
    norm_chunk_bytes: int = 4 * 2**20
    """Bytes of a Gram rule's intermediates (patches, Gram matrices) formed at once: the
    norms are computed a chunk of examples at a time, so that they cost no more memory than
    the activations the backward pass holds anyway."""
    ghost_chunk_bytes: int | None = 8 * 2**20
    """Bytes of what the ghost norms record per chunk of a microbatch (each site's inputs
    and cotangents, ``_ghost.recorded_bytes``), or None to take every microbatch at once.
    A microbatch whose record is larger is taken a chunk of rows at a time, each chunk's
    sums added to the last: memory then grows with the chunk, not the microbatch, and on
    the CPU the passes run near the caches. Measured on 2 CPU cores with
    ``benchmarks/clipping.py`` (``clip_method="ghost"``, batch 1024, medians of 7
    interleaved calls): on its CNN (154 kB recorded per example) at microbatch 64, chunks
    of 32 rows took 153 ms and 11.8 MiB of temp against 204 ms and 19.2 MiB at once (the
    plain step: 109 ms, 6.5 MiB); at microbatch 256, 155 ms and 12.4 MiB against 265 ms
    and 55.1 MiB. Chunks of 16 rows (4 MiB) took 186 ms at 64. Its MLP (20 kB per
    example) is taken at once up to 427 rows; in chunks of 128 at microbatch 256 it took
    29.1 ms against 24.4 ms at once."""
    ghost_chunk_rows: int = 32
    """The fewest rows a chunk of ``ghost_chunk_bytes`` takes, however large the record:
    each chunk runs every pass of the ghost step, whose many small operations cost time
    per chunk. On the transformer block of ``benchmarks/clipping.py`` (524 kB recorded
    per example, medians of 5), at microbatch 64: chunks of 16 rows took 475 ms, of 32
    rows 446 ms, at once 409 ms; at microbatch 256: 468, 424 and 481 ms."""
    direct_chunk_bytes: int = 32 * 2**20
    """Bytes of per-example gradients of ``direct`` leaves formed at once."""
    materialize_flops_per_entry: int = 12
    """What forming, reading, scaling and summing one entry of a per-example gradient costs,
    in flops of the ghost norms' products. Calibrated on 2 CPU cores with
    ``benchmarks/clipping.py``: on its transformer block (85k parameters, norms of 1.6
    Mflop per example) per-example gradients took 1.16-1.24x a plain step against ghost's
    1.40-1.46x, and on its MLP (670k parameters, norms of 4 kflop) ghost took 1.05x.

    Not counted: the per-example weight-gradient products that materialize forms over an
    example's rows, which replace the plain step's one product over the batch but run as
    many small ones. On the tied transformer LM of ``benchmarks/clipping.py`` at 64 tokens
    the model puts ghost at 4.6x materialize (13.2M against 2.9M per example), where both
    measured 1.6-2.0x a plain step on 2 shared cores, materialize no slower; at 256 tokens
    (product forms) materialize took 1.15-1.25x against ghost's 1.3-1.7x, as the model says."""
    gram_entry_flops: int = 64
    """What writing one entry of a norm's intermediates costs, in flops of its products, when
    ``_product_cost`` chooses between the Gram and the product form: the Gram form writes
    ``2 + blocks`` matrices of ``T x T`` per example (each block of ``GRAM_BLOCK`` entries
    is its own small product, then the error bound's passes), the product form one
    ``K x N``. Calibrated on 2 CPU cores (jax 0.10.2) with ``benchmarks/clipping.py``,
    ``clip_method="ghost"`` against a plain step, medians of 7 interleaved calls: on the tied
    transformer LM at 64 tokens, Gram forms at every dense site took 3.0x, product forms
    2.2x (by flops alone the Gram form is the cheaper or equal at each); on the transformer
    block at 32 tokens, 3.0x against 2.3x (2.8x with the MLP's two sites left to the Gram
    form, as a weight of 24 would); on the CNN at microbatch 64, 3.5x against 2.0x (its
    second convolution, 49 positions of 288 inputs). A weight of 64 gives the product form
    to each of these and keeps the Gram form where rows are few and wide (16 tokens of
    512 inputs and outputs: 1.3 against 21 Mflop). By flops alone, the Gram form was
    chosen wherever ``T^2 (K + N) <= T K N``."""
    statistics_chunk_bytes: int = 32 * 2**20
    """How many bytes of per-example gradients to form at once for their norms or metrics.

    They are formed a chunk of rows at a time (``lax.map``), so memory holds at most this
    much of them, and XLA:CPU runs faster on chunks that stay near its caches. Measured for
    a 256-512-512-10 MLP (1.6 MB of gradient per example) at microbatch 256: 43 ms in chunks
    of 16 rows against 130 ms at once; for a 64-256-10 MLP (76 kB) at microbatch 64, 9.8 ms
    at once against 13.1 ms in chunks of 16.
    """
    explicit_chunk_bytes: int = 16 * 2**20
    """How many bytes of per-example gradients ``explicit`` (``materialize``) forms at once.

    Each chunk's scaled sum is added to the last, so memory holds one chunk of gradients,
    not the microbatch's. Measured on 2 cores (median of 7, `clip_method` left `auto`,
    which takes ``materialize`` on each; whole microbatch against chunks of 16 MiB): the
    tied transformer LM of ``benchmarks/clipping.py`` at microbatch 64 (0.91 MiB of
    gradient per example), 218 against 206 ms and 92.5 against 24.1 MiB of temp; the
    Flax NNX LM at microbatch 256 (0.46 MiB), 271 against 170 ms, 371 against 43 MiB; an
    MLP 784-512-512-10 in bfloat16 at microbatch 256, unclipped (its float32 sums take
    the per-example gradients), 643 against 570 ms, 401 against 24 MiB. Chunks of 8 MiB
    were slower on the LM (241 ms), of 32 MiB no faster (215 ms, 47 MiB).
    """


CPU = Knobs("2 CPU cores, jax 0.10.2 (benchmarks/clipping.py, benchmarks/accumulation.py)")
"""The values measured."""

UNMEASURED = dataclasses.replace(
    CPU,
    measured_on="nothing: the CPU's values, but every microbatch taken at once by the ghost norms",
    ghost_chunk_bytes=None,
)
"""Every backend without its own entry. Chunks of a microbatch suit the CPU's caches;
an accelerator runs a whole microbatch at once as it was asked to until a measurement
there says otherwise."""

BY_BACKEND: dict[str, Knobs] = {"cpu": CPU}


def chunk_rows(rows: int, most: int) -> int:
    """Rows per chunk of ``rows``, at most ``most`` (at least 1): the largest divisor of
    ``rows`` where one is at least half of ``most``, else as many equal chunks as
    ``most`` needs and a shorter last one. The one rule of every chunked pass: a last
    chunk of another size is a second copy of the pass in the compiled program (a norm
    chunk of 29 rows of 32 compiled the CNN of ``benchmarks/clipping.py``'s range
    fallback twice)."""
    if rows <= most:
        return rows
    most = max(most, 1)
    divisor = max(d for d in range(1, most + 1) if rows % d == 0)
    if 2 * divisor >= most:
        return divisor
    return -(-rows // -(-rows // most))


def knobs() -> Knobs:
    """The tuning of ``jax.default_backend()``."""
    return BY_BACKEND.get(jax.default_backend(), UNMEASURED)
