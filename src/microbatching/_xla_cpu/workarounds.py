"""Where one backend's compiler needs help: each workaround, and the backend and JAX
versions it was measured on, in one table.

A workaround applies on its backend from the oldest JAX this package supports until
``fixed_in``, the first jaxlib release measured without the fault (None while there is
none). Beyond the last version measured it stays on, so that a newer JAX costs at most
the workaround's time, never a wrong result; ``tests/test_workarounds.py`` checks, on the
installed JAX, that the fault is still there wherever a workaround applies, so a release
that fixes one fails there, loudly, until ``fixed_in`` says so.

| workaround | backend | measured on | gates | costs |
|---|---|---|---|---|
| ``PER_EXAMPLE_SUM`` | cpu | 0.10.2 | ``_layout.rows_apart`` | rows written out, then summed |
| ``CONV_ORDER`` | cpu | 0.10.2 | ``_convs.canonical`` | transposes around convolutions |
| ``BF16_BITS`` | cpu | 0.10.2 | ``_layout.reads_bits`` | a uint16 copy of the batch |
| ``UNIT_REDUCE`` | cpu | 0.10.2 | ``_squeeze.squeezed`` | two reshapes (bitcasts) per reduction |
| ``DOT_ORDER`` | cpu | 0.10.2 | ``_dots.swapped`` | none: the same product, operands swapped |

Not gated, because they are not about one backend: the barrier of
``_ghost.gram_matrices`` (XLA's algebraic simplifier folds a sum of blocked Gram
products back into one long contraction on every backend), and the barriers of
``_loop`` and ``_remat``, which order work rather than avoid a fault.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jaxlib.version


@dataclasses.dataclass(frozen=True)
class Workaround:
    """A fault of one backend's compiler that the library works around.

    Attributes:
      backend: ``jax.default_backend()`` where it applies.
      measured_on: The jaxlib versions on which the fault was seen, for reading.
      fixed_in: The first jaxlib version measured without it, or None.
      fault: What goes wrong without the workaround, and where it is reproduced.
    """

    backend: str
    measured_on: tuple[str, ...]
    fixed_in: tuple[int, ...] | None
    fault: str

    def applies(self) -> bool:
        """Whether the default backend, at the installed jaxlib, needs the workaround."""
        if jax.default_backend() != self.backend:
            return False
        return self.fixed_in is None or jaxlib_version() < self.fixed_in


@functools.cache
def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's release as integers (never compared as text)."""
    release = jaxlib.version.__version__.split("+")[0].split(".")
    return tuple(int(part) for part in release if part.isdigit())


PER_EXAMPLE_SUM = Workaround(
    "cpu",
    ("0.10.2",),
    None,
    "the sum over rows of a batched outer product (per-example gradients of a dense layer) "
    "is off by about its own size for fewer than 256 rows: "
    "benchmarks/xla_per_example_sum_repro.py",
)
CONV_ORDER = Workaround(
    "cpu",
    ("0.10.2",),
    None,
    "a convolution inside a loop keeps its dimension order and runs as a loop nest, about "
    "10x slower (XLA:CPU reorders only the entry computation's): "
    "benchmarks/xla_conv_grad_in_loop_repro.py",
)
BF16_BITS = Workaround(
    "cpu",
    ("0.10.2",),
    None,
    "a bfloat16 read inside a loop becomes a float32 copy of the whole batch before it "
    "(XLA:CPU converts every bfloat16 operand): tests/test_memory.py",
)
UNIT_REDUCE = Workaround(
    "cpu",
    ("0.10.2",),
    None,
    "a reduction of an array with a dimension of size 1 (a per-example array of a batch of "
    "one, mapped) runs in YNNPACK about 10x slower than without that dimension: "
    "benchmarks/xla_unit_dim_reduce_repro.py",
)
DOT_ORDER = Workaround(
    "cpu",
    ("0.10.2",),
    None,
    "a batched product whose result is transposed (JAX's transpose of ``x @ w`` for "
    "``w``'s per-example gradient) runs with a transposed copy of the cotangent in XLA's "
    "dot emitter, not YNNPACK; a fifth of a clipped transformer step: "
    "tests/test_workarounds.py",
)
