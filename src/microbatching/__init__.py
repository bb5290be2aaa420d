"""Microbatching for JAX: run a function, a vmap or per-example gradients over a batch
one microbatch at a time, inside one compiled program, where the whole batch's
activations, gradients or per-example results would not fit in device memory at once."""

from ._accumulators import AccumulationType as AccumulationType
from ._accumulators import Accumulator as Accumulator
from ._batch_statistics import BatchStatisticsWarning as BatchStatisticsWarning
from ._grad import Aux as Aux
from ._grad import micro_grad as micro_grad
from ._inspect import ClippingReport as ClippingReport
from ._inspect import LeafRule as LeafRule
from ._inspect import clipping_report as clipping_report
from ._layout import reshape_batch_axis as reshape_batch_axis
from ._microbatch import microbatch as microbatch
from ._per_example import l2_norm as l2_norm
from ._plan import Plan as Plan
from ._plan import PlanRow as PlanRow
from ._plan import plan as plan
from ._unsplit import UnsplitBatchWarning as UnsplitBatchWarning
from ._vmap import micro_vmap as micro_vmap

__version__ = "0.4.0"

__all__ = [
    "AccumulationType",
    "Accumulator",
    "Aux",
    "BatchStatisticsWarning",
    "ClippingReport",
    "LeafRule",
    "Plan",
    "PlanRow",
    "UnsplitBatchWarning",
    "clipping_report",
    "l2_norm",
    "micro_grad",
    "micro_vmap",
    "microbatch",
    "plan",
    "reshape_batch_axis",
]
