"""The planner: ``plan`` compiles a function at a few microbatch sizes and picks one.

``pick="largest"`` runs nothing: candidates are compiled for the example arguments'
shapes and XLA's own memory analysis of each program is read; the memory of the ones not
compiled is predicted from those that were (``_Search``). ``pick="fastest"`` then runs
the compiled steps that fit on the example arrays and keeps the fastest (``_Timing``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import sys
import time
import typing
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from . import _checks, _sharding
from ._inspect import clipping_report
from ._signature import OPTIONS, leaf_paths
from ._typing import ClipMethod, GatherParams

Build = Callable[..., Callable[..., Any]]
"""``build(microbatch_size)``, or ``build(microbatch_size, gather_params=...)``."""
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_FLOP_UNITS = ("", "K", "M", "G", "T", "P", "E")
_REMAINDER_FIX = "pass allow_remainder=True to the transform that build calls to try other sizes."


class Batching(Protocol):
    """What ``plan`` reads from a function that ``microbatch``, ``micro_vmap`` or
    ``micro_grad`` returned: the options it was wrapped with."""

    @property
    def allow_remainder(self) -> bool: ...

    def batch_size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The size of the batch axis that a call with these arguments splits."""
        ...


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """What one candidate microbatch size costs, from its compiled program.

    Attributes:
      microbatch_size: The candidate; None runs the whole batch without microbatching.
      num_microbatches: ``ceil(batch_size / microbatch_size)`` (1 for None).
      temp_bytes: The compiled program's scratch memory (``temp_size_in_bytes``).
      argument_bytes: Its arguments' memory (``argument_size_in_bytes``), the same for
        every microbatch size: microbatching shrinks only the scratch memory.
      total_bytes: ``temp + arguments + outputs - aliases`` from the compiled program's
        memory analysis: what one call needs on a device (per device when sharded). The
        generated code is not counted.
      flops: An estimate of the floating-point work of one call over the whole batch, or
        None if the backend reports none. XLA's cost analysis counts a loop body once, so
        when the compiled program still loops, its count is multiplied by
        ``num_microbatches``; work outside the loop is multiplied too, a small overestimate.
      fits: Whether ``total_bytes`` is at most the plan's memory budget.
      gather_params: The ``gather_params`` this row was compiled with, when ``build``
        takes that keyword (``micro_grad`` on parameters sharded over the batch's mesh
        axis); else None.
      clip_method: The ``clip_method`` this row was compiled with, when
        ``pick="fastest"`` and ``build`` takes that keyword; else None.
      seconds: With ``pick="fastest"``, the median time of this row's timed calls of its
        compiled step on the example arrays (one call where it was over 1.5x slower than
        the best at its first, or where the rounds ended early); None where it was not
        timed (it does not fit, it was not compiled, going to smaller sizes stopped, or
        ``max_seconds`` were spent).
      compiled: Whether this row was compiled. If not, its memory and flops are
        predicted from the compiled rows of the same ``gather_params`` and
        ``clip_method``, and ``str(plan)`` marks them ``~``: the memory linear in the
        microbatch size between the nearest compiled sizes (through the two nearest
        beyond them); where only one size was compiled, along the slope of another
        series compiled at two or more, else a bound (that size's memory below it, in
        proportion to the size above it); the flops linear in the number of
        microbatches. Estimates: the memory can fall below the real figure where XLA's
        choices change between the compiled sizes.

    >>> import jax.numpy as jnp
    >>> from microbatching import AccumulationType, microbatch, plan
    >>> def loss(w, x):
    ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> build = lambda m: microbatch(loss, 1, m, AccumulationType.MEAN)
    >>> w, x = jnp.ones((8, 8)), jnp.ones((32, 8))
    >>> (row,) = plan(build, w, x, batch_size=32, candidates=[4], memory_budget=2**30).table
    >>> row.microbatch_size, row.num_microbatches, row.fits, row.total_bytes > row.temp_bytes
    (4, 8, True, True)
    """

    microbatch_size: int | None
    num_microbatches: int
    temp_bytes: int
    argument_bytes: int
    total_bytes: int
    flops: float | None
    fits: bool
    gather_params: str | None = None
    clip_method: str | None = None
    seconds: float | None = None
    compiled: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """The microbatch size chosen by ``plan``, and what every candidate costs.

    Attributes:
      microbatch_size: The chosen candidate: with ``pick="largest"``, the largest whose
        total memory fits ``memory_budget`` (None, no microbatching, counts as larger
        than any size); with ``pick="fastest"``, the fastest of those timed.
      memory_budget: The budget in bytes, per device.
      batch_size: The size of the batch axis that the function splits.
      table: One ``PlanRow`` per candidate, smallest microbatch size first, None last.
      allow_remainder: Whether the candidates need not divide ``batch_size``.
      gather_params: The chosen row's ``gather_params``, when ``build`` takes it: with
        ``pick="largest"``, at the chosen size ``"once"`` if it fits (fewer
        collectives), else ``"per_microbatch"``; with ``pick="fastest"``, the faster
        one; None otherwise.
      clip_method: The chosen row's ``clip_method``, when ``pick="fastest"`` and
        ``build`` takes it; None otherwise.
      pick: ``"largest"`` or ``"fastest"``, as ``plan`` was asked.

    ``str(plan)`` renders the table, with the chosen row marked ``*``, and says why a
    prime batch size has no candidates but 1 and itself. ``compile()`` hands back the
    chosen row's compiled program, which ``plan`` kept.

    >>> import jax, jax.numpy as jnp
    >>> from microbatching import AccumulationType, microbatch, plan
    >>> def loss(w, x):
    ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> build = lambda m: jax.grad(microbatch(loss, 1, m, AccumulationType.MEAN))
    >>> w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((12, 16), jnp.float32)
    >>> p = plan(build, w, x, batch_size=12, memory_budget=2**30)
    >>> [row.microbatch_size for row in p.table]
    [1, 2, 3, 4, 6, 12]
    >>> print(str(p).splitlines()[0])
    Plan for batch_size=12 within memory_budget=1.0 GiB per device:
    """

    microbatch_size: int | None
    memory_budget: int
    batch_size: int
    table: tuple[PlanRow, ...]
    allow_remainder: bool = False
    gather_params: str | None = None
    clip_method: str | None = None
    pick: str = "largest"
    _step: _Step | None = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)

    def compile(self) -> jax.stages.Compiled:
        """The chosen row's compiled program, to call instead of compiling it again.

        ``plan`` compiles ``jax.jit(build(microbatch_size))`` for each candidate (with its
        ``gather_params`` when ``build`` takes it) and keeps the chosen one's program, and
        no other. When it took the chosen row's measurement from its cache, as when
        planning again under another budget, it compiled nothing and kept nothing: the
        first ``compile()`` then compiles that row, once, under the mesh ``plan`` ran
        under (and with ``progress=True`` says so).

        The program takes arguments of the example arguments' shapes, dtypes and
        shardings, and raises a TypeError for others (a smaller last batch needs its own
        ``jax.jit(build(microbatch_size))``). It is ``jax.jit``'s with no options: it
        donates no argument, even where ``build`` returns a function jitted with
        ``donate_argnums``; compile a step that donates with its own ``jax.jit``.

        Returns:
          A ``jax.stages.Compiled``: call it as the function ``build`` returns.

        Raises:
          ValueError: For a ``Plan`` made by hand rather than returned by ``plan``.

        >>> import jax, jax.numpy as jnp
        >>> from microbatching import AccumulationType, microbatch, plan
        >>> def loss(w, x):
        ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
        >>> build = lambda m: jax.grad(microbatch(loss, 1, m, AccumulationType.MEAN))
        >>> w, x = jnp.ones((16, 16)), jnp.ones((64, 16))
        >>> p = plan(build, w, x, batch_size=64, candidates=[4, 8], memory_budget=2**30)
        >>> step = p.compile()  # what plan compiled for microbatch_size=8
        >>> bool(jnp.allclose(step(w, x), build(p.microbatch_size)(w, x)))
        True
        """
        if self._step is None:
            raise ValueError(
                "This Plan holds no compiled program: it was made by hand, and only a Plan "
                "that plan(build, *args, ...) returns keeps the chosen row's; call plan."
            )
        return self._step.compiled()

    def __str__(self) -> str:
        header = (
            f"Plan for batch_size={self.batch_size} within memory_budget="
            f"{_bytes(self.memory_budget)} per device:"
        )
        chosen = [
            row.fits
            and row.compiled
            and row.microbatch_size == self.microbatch_size
            and row.gather_params == self.gather_params
            and row.clip_method == self.clip_method
            for row in self.table
        ]
        footer = (
            "  total = temp + arguments + outputs - aliases; flops estimated for the batch."
            if any(chosen)
            else "  nothing fits."
        )
        if any(not row.compiled for row in self.table):
            footer += " ~ predicted from the compiled rows."
        if any(row.seconds is not None for row in self.table):
            footer += " time: the median time of a call, on the example arrays."
        prime = self.batch_size > 2 and _is_prime(self.batch_size) and not self.allow_remainder
        note = [f"  {_prime(self.batch_size)}; {_REMAINDER_FIX}"] if prime else []
        return "\n".join([header, *_render(self.table, chosen), footer, *note])


def plan(
    build: Build,
    /,
    *args: Any,
    memory_budget: float | None = None,
    candidates: Sequence[int | None] | None = None,
    batch_size: int | None = None,
    safety_margin: float = 0.9,
    allow_remainder: bool | None = None,
    pick: str = "largest",
    compile_all: bool = False,
    max_seconds: float | None = None,
    repeats: int = 5,
    progress: bool = False,
    **kwargs: Any,
) -> Plan:
    """Picks the largest microbatch size that fits in memory, or the fastest of those.

    A candidate ``m`` is measured by compiling
    ``jax.jit(build(m)).lower(*args, **kwargs).compile()`` and reading its memory
    analysis: the total is ``temp + arguments + outputs - aliases`` bytes, per device
    for sharded arguments. Not every candidate is compiled: the total grows with the
    size, so ``plan`` compiles the largest (done if it fits), the smallest above 1, and
    then the largest size predicted to fit between the largest compiled size that fits
    and the smallest that does not, until the two are neighbours (four programs where
    the total is affine in the size, as it is for the loop over long stretches); the
    other rows are predicted from the compiled ones (``PlanRow.compiled``): estimates,
    which can fall below the real figure, while the pick itself is always compiled and
    checked against its larger neighbour. ``compile_all=True`` compiles every candidate.

    With ``pick="fastest"``, every candidate that fits is compiled and **run** on the
    example arrays (the user's function runs, with its side effects): each is warmed up
    and timed once, largest size first, and those within 1.5x of the best are timed in
    turn for ``repeats - 1`` more rounds; the fastest median wins. Going to smaller
    sizes stops after two sizes in a row whose timed candidates were all over 1.5x
    slower than the best, or when ``max_seconds`` are spent. Where ``build`` also takes
    ``clip_method``, each method is timed at each size (those that cannot compute the
    call are left out, and ``"auto"`` is timed only where it chooses none of them), so
    that the measurement, not a cost model, chooses it; a ``clip_method`` with no
    default is given ``"auto"`` by ``pick="largest"``. Where ``build`` takes
    ``gather_params``, both values are timed.

    Measurements are kept per ``build`` (held weakly), argument shapes, dtypes and
    shardings, batch size, mesh and candidate, so planning again, under any budget or
    with candidates already measured, compiles nothing; times are not kept. The chosen
    candidate's compiled program is kept in the ``Plan`` (``Plan.compile()``), and no
    other candidate's.

    The batch size and ``allow_remainder`` come from the function that ``build(1)``
    returns, when ``microbatch``, ``micro_vmap`` or ``micro_grad`` made it, directly or
    under transforms that set ``__wrapped__`` and keep its arguments (``jax.grad``,
    ``jax.value_and_grad``, ``jax.jit``): it finds its batch arguments in ``args`` and
    ``kwargs`` as a call would, so parameters may sit next to the batch.

    Args:
      build: ``build(microbatch_size)`` returns the function to run, e.g.
        ``lambda m: jax.grad(microbatch(loss, (1, 2), m, AccumulationType.MEAN))``. If
        it also takes a keyword ``gather_params``, as
        ``lambda m, gather_params: micro_grad(..., gather_params=gather_params)``, each
        size is compiled with ``"once"`` and with ``"per_microbatch"``, and the plan
        chooses between them too (``Plan.gather_params``). If it takes ``clip_method``,
        ``pick="fastest"`` times each method (``Plan.clip_method``), and
        ``pick="largest"`` gives it ``"auto"`` where it has no default. ``build(1)`` is
        called first, to read the options of the function it returns.
      *args: Example positional arguments of that function: arrays or
        ``jax.ShapeDtypeStruct``, possibly sharded. Only their shapes, dtypes and
        shardings are used.
      memory_budget: Bytes available per device. None takes the device's limit
        (``memory_stats()["bytes_limit"]`` of the devices the arguments live on, else of
        ``jax.devices()[0]``) times ``safety_margin``; CPUs report none, so pass it there.
      candidates: The microbatch sizes to try, each dividing the batch size, or None for
        no microbatching (counted as larger than any size). By default every divisor of
        the batch size (only 1 and itself for a prime); None is not tried, as the whole
        batch in one microbatch is the same program in all but the loop.
      batch_size: The size of the batch axis that ``build``'s function splits. By
        default that function finds it in the example arguments; a function of other
        making must have the same leading-axis size in every array argument. Pass it
        under a transform that changes the arguments' shapes, such as ``jax.vmap``.
      safety_margin: The fraction of the device's limit to plan for when
        ``memory_budget`` is None, in (0, 1]. It leaves room for fragmentation, other
        buffers and the generated code.
      allow_remainder: Whether the candidates need not divide the batch size (the
        default ones then add the powers of two). By default that of ``build``'s
        function, or False for a function of other making; if given, it must agree
        with ``build``'s function.
      pick: ``"largest"`` (the largest size that fits; nothing runs) or ``"fastest"``
        (the fastest, timed on the device, of the sizes that fit; needs arrays, not
        ``jax.ShapeDtypeStruct``).
      compile_all: Whether to compile every candidate, rather than the few that the
        search needs; the table then predicts nothing.
      max_seconds: With ``pick="fastest"``, the seconds from the start of ``plan``
        (its compiling included) after which no new candidate is timed and no new round
        begins; None for no limit.
      repeats: With ``pick="fastest"``, the timed calls of each candidate after its
        warm-up (the first round times each once, as it is compiled).
      progress: Whether to say on standard error, one line per candidate, which one it
        compiles (``plan [3/6] microbatch_size=8: compiling...``), how long that took,
        its total memory and whether it fits; a candidate measured before says so; with
        ``pick="fastest"``, each candidate's first time and the fastest after each round. Off
        by default, as ``microbatch``'s ``progress``.
      **kwargs: Example keyword arguments of that function, as ``*args``.

    Returns:
      A ``Plan``: the chosen ``microbatch_size``, a table of every candidate, and the
      chosen candidate's compiled program (``Plan.compile()``).

    Raises:
      TypeError, ValueError: For bad arguments, a batch size that cannot be inferred, a
        device that reports no memory limit, or when no candidate fits the budget (the
        message says whether the arguments alone exceed it, and shows the table).

    >>> import jax, jax.numpy as jnp
    >>> from microbatching import AccumulationType, microbatch, plan
    >>> def loss(w, x):
    ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> build = lambda m: jax.grad(microbatch(loss, 1, m, AccumulationType.MEAN))
    >>> w, x = jnp.ones((16, 16)), jnp.ones((64, 16))
    >>> p = plan(build, w, x, batch_size=64, candidates=[4, 8], memory_budget=2**30)
    >>> p.microbatch_size, [(row.microbatch_size, row.compiled) for row in p.table]
    (8, [(4, False), (8, True)])
    >>> tight = p.table[1].total_bytes - 1  # less than microbatch_size=8 needs
    >>> plan(build, w, x, batch_size=64, candidates=[4, 8], memory_budget=tight).microbatch_size
    4
    >>> fast = plan(build, w, x, candidates=[4, 8], memory_budget=2**30, pick="fastest")
    >>> fast.microbatch_size in (4, 8), [row.seconds is not None for row in fast.table]
    (True, [True, True])
    """
    _checks.ensure_callable("build", build)
    if not isinstance(pick, str) or pick not in PICKS:
        raise ValueError(
            f"pick must be 'largest' (the largest size that fits; nothing runs) or "
            f"'fastest' (the fastest of those, timed on the device), got {pick=}."
        )
    how = pick
    every = _checks.ensure_bool("compile_all", compile_all)
    seconds = _max_seconds(max_seconds)
    rounds = _repeats(repeats)
    report = _Progress(_checks.ensure_bool("progress", progress))
    labels, specs, treedef = _specs(args, kwargs)
    if how == "fastest":
        _ensure_arrays(labels, args, kwargs)
    fastest = how == "fastest"
    takes_clip = CLIP.tried(build)[0] is not None
    base_clip = "auto" if (fastest and takes_clip) or CLIP.required(build) else None
    first = (build, 1, GATHER.tried(build)[0], base_clip)
    batching = _cached(build, OPTIONS, lambda: _batching(_built(*first)))
    remainder = _remainder(allow_remainder, batching)
    size = _batch_size(batch_size, batching, (args, kwargs), labels, specs)
    sizes = _candidates(candidates, size, remainder)
    budget = _budget(memory_budget, safety_margin, specs)
    example = jax.tree.unflatten(treedef, specs)
    key = (treedef, tuple(specs), size, jax.sharding.get_abstract_mesh())
    began = _clock()
    with _sharding.mesh_of(specs):
        search = _Search(build, example, key, size, sizes, budget, report, base_clip, fastest)
        top = search.largest(every)
        if top is None:
            raise ValueError(_nothing_fits(Plan(None, budget, size, search.rows({}), remainder)))
        times: dict[_Candidate, float] = {}
        if how == "largest":
            fitting = (
                c for c in search.base(sizes[top]) if search.measured[c].total_bytes <= budget
            )
            chosen = next(fitting)  # at one size, the first gather_params that fits
        else:
            timing = _Timing(search, args, kwargs, seconds, rounds, began)
            chosen, times = timing.fastest(top)
        before = len(search.measured) - search.compiled
        cached = f" ({before} measured before)" if before else ""
        plural = "" if search.compiled == 1 else "s"
        report.write(
            f"plan: {search.compiled} program{plural} compiled{cached} for {len(sizes)} sizes\n"
        )
        table = search.rows(times)
        step = search.step(chosen)
    return Plan(
        chosen.microbatch_size,
        budget,
        size,
        table,
        remainder,
        chosen.gather_params,
        chosen.clip_method,
        how,
        _step=step,
    )


PICKS = ("largest", "fastest")


def _max_seconds(max_seconds: Any) -> float | None:
    if max_seconds is None:
        return None
    fix = "pass e.g. max_seconds=120, or None for no limit."
    value = _number("max_seconds", max_seconds, fix)
    if not 0 < value < float("inf"):
        raise ValueError(f"max_seconds must be positive and finite, got {max_seconds=}; {fix}")
    return value


def _positive_int(name: str, value: Any, allowed: str, fix: str) -> int:
    """``value`` as an int, or a ``TypeError`` (not an int) or ``ValueError`` (below 1)
    naming ``name``, what it may be (``allowed``) and the ``fix``."""
    if not _checks.is_int(value):
        raise TypeError(f"{name} must be {allowed}, got {name}={value!r}; {fix}")
    if operator.index(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}; {fix}")
    return operator.index(value)


def _repeats(repeats: Any) -> int:
    return _positive_int(
        "repeats", repeats, "a positive int", "pass e.g. repeats=5 rounds of timed calls."
    )


def _ensure_arrays(labels: list[str], args: Any, kwargs: Any) -> None:
    """``pick="fastest"`` runs the function: its example arguments must be values."""
    leaves = [leaf for arg in [*args, *kwargs.values()] for leaf in jax.tree.leaves(arg)]
    for label, leaf in zip(labels, leaves, strict=True):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"plan(pick='fastest') times each candidate by running it, so it needs "
                f"arrays, but {label} is a jax.ShapeDtypeStruct {leaf}; pass the arrays "
                "of a real batch, or pick='largest', which only compiles."
            )


_CACHE: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()


def _memo(build: Build) -> dict[Hashable, Any]:
    """What ``plan`` measured of ``build``, kept while ``build`` lives (a new, empty dict
    for a ``build`` that cannot be weakly referenced: plan without a cache)."""
    try:
        return _CACHE.setdefault(build, {})
    except TypeError:
        return {}


def _cached(build: Build, key: Hashable, measure: Callable[[], Any]) -> Any:
    """``measure()``, remembered per ``build`` while ``build`` lives."""
    memo = _memo(build)
    if key not in memo:
        memo[key] = measure()
    return memo[key]


def _specs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], list[jax.ShapeDtypeStruct], Any]:
    """The example arguments' leaves as ShapeDtypeStructs, labelled, and their treedef."""
    labels: list[str] = []
    specs: list[jax.ShapeDtypeStruct] = []
    for label, arg in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        for path, leaf in zip(leaf_paths(arg), jax.tree.leaves(arg), strict=True):
            labels.append(label + path)
            specs.append(_spec(leaf, labels[-1]))
    return labels, specs, jax.tree.structure((args, kwargs))


def _spec(leaf: Any, label: str) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    try:
        aval = jax.typeof(leaf)
    except TypeError as err:
        raise TypeError(
            f"plan's example arguments must be arrays, jax.ShapeDtypeStruct or scalars, got "
            f"{label}={leaf!r}; pass other values to the function through build (a closure "
            "or functools.partial)."
        ) from err
    sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type)


def _batching(fun: Callable[..., Any]) -> Batching | None:
    """The options of the microbatched function that ``fun`` is, or wraps."""
    inner = inspect.unwrap(fun, stop=lambda f: hasattr(f, OPTIONS))
    return getattr(inner, OPTIONS, None)


def _remainder(allow_remainder: Any, batching: Batching | None) -> bool:
    """``allow_remainder`` checked against ``build``'s function, or taken from it."""
    if allow_remainder is None:
        return batching is not None and batching.allow_remainder
    given = _checks.ensure_bool("allow_remainder", allow_remainder)
    if batching is not None and given != batching.allow_remainder:
        raise ValueError(
            f"plan got {allow_remainder=}, but the function that build returns was made "
            f"with allow_remainder={batching.allow_remainder}; leave allow_remainder out of "
            "plan, which takes it from the function."
        )
    return given


def _batch_size(
    batch_size: Any,
    batching: Batching | None,
    example: tuple[tuple[Any, ...], dict[str, Any]],
    labels: list[str],
    specs: list[jax.ShapeDtypeStruct],
) -> int:
    """``batch_size`` checked, or found in the example arguments by ``build``'s function.
    Given where that function finds another size in them, a ``ValueError``: the loop
    would split that one (its own error would name ``microbatch_size`` instead)."""
    if batch_size is not None:
        given = _ensure_batch_size(batch_size)
        try:
            found = None if batching is None else batching.batch_size(*example)
        except (TypeError, ValueError):  # shapes of another making (under jax.vmap)
            found = None
        if found is not None and found != given:
            raise ValueError(
                f"plan was given batch_size={given}, but build's function finds a batch "
                f"of {found} rows in the example arguments, and would split that one; "
                f"pass batch_size={found}, or leave batch_size out to have it found."
            )
        return given
    if batching is None:
        return _leading_size(labels, specs)
    try:
        return batching.batch_size(*example)
    except (TypeError, ValueError) as err:
        err.add_note(
            "(raised by plan while finding the batch in its example arguments; pass "
            "batch_size= to give its size)"
        )
        raise


def _ensure_batch_size(batch_size: Any) -> int:
    return _positive_int(
        "batch_size",
        batch_size,
        "a positive int or None",
        "pass the size of the batch axis, e.g. batch_size=256.",
    )


def _leading_size(labels: list[str], specs: list[jax.ShapeDtypeStruct]) -> int:
    """The leading-axis size that every array argument shares."""
    leading = [(lab, s.shape) for lab, s in zip(labels, specs, strict=True) if s.shape]
    sizes = {shape[0] for _, shape in leading}
    if len(sizes) != 1 or 0 in sizes:
        first: dict[int, tuple[str, tuple[int, ...], int]] = {}
        for lab, shape in leading:  # one argument per size, and how many more share it
            found = first.get(shape[0])
            first[shape[0]] = (lab, shape, 0) if found is None else (*found[:2], found[2] + 1)
        listing = ", ".join(
            f"{lab} of shape {shape}" + (f" and {more} more" if more else "")
            for lab, shape, more in (first[size] for size in sorted(first))
        )
        listing = listing or "none"
        raise ValueError(
            "plan cannot tell the batch size: build returns a function that microbatch, "
            "micro_vmap and micro_grad did not make (nor wrap through __wrapped__), so "
            "the batch size is the leading-axis size shared by the array arguments, and "
            f"they have leading sizes {sorted(sizes)} ({listing}); pass batch_size=, the "
            "size of the axis that build's function splits."
        )
    return sizes.pop()


def _candidates(
    candidates: Any, batch_size: int, remainder: bool = False
) -> tuple[int | None, ...]:
    """The candidate sizes, checked against ``batch_size``, ascending with None last."""
    if candidates is None:
        sizes = {d for d in range(1, batch_size + 1) if batch_size % d == 0}
        if remainder:
            sizes |= {2**k for k in range(batch_size.bit_length()) if 2**k <= batch_size}
        return tuple(sorted(sizes))
    if not isinstance(candidates, Sequence) or isinstance(candidates, str) or not candidates:
        raise TypeError(
            f"candidates must be a non-empty sequence of microbatch sizes (positive "
            f"ints, or None for no microbatching), got {candidates=}; pass e.g. "
            "candidates=[8, 16, 32], or leave it None to try every divisor of the batch size."
        )
    for i, m in enumerate(candidates):
        _check_candidate(i, m, batch_size, remainder)
    sizes = [None if m is None else operator.index(m) for m in candidates]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"candidates must not repeat a size, got {candidates=}.")
    return (*sorted(m for m in sizes if m is not None), *(None for m in sizes if m is None))


def _check_candidate(i: int, m: Any, batch_size: int, remainder: bool) -> None:
    if m is None:
        return
    if not _checks.is_int(m):
        raise TypeError(
            f"candidates[{i}] must be a positive int or None, got {m!r} of type "
            f"{type(m).__name__}; pass microbatch sizes such as 8."
        )
    if operator.index(m) < 1:
        raise ValueError(
            f"candidates[{i}] must be a positive int or None, got {m!r}; pass microbatch "
            "sizes such as 8."
        )
    if batch_size % operator.index(m) and not remainder:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        prime = f" ({_prime(batch_size)})" if _is_prime(batch_size) else ""
        raise ValueError(
            f"candidates[{i}]={m} does not divide {batch_size=}{prime}; a microbatch size "
            f"must, so choose among {divisors}, or {_REMAINDER_FIX}"
        )


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def _prime(batch_size: int) -> str:
    return f"batch_size={batch_size} is prime: only 1 and {batch_size} divide it"


def _budget(memory_budget: Any, safety_margin: Any, specs: list[jax.ShapeDtypeStruct]) -> int:
    """``memory_budget`` checked, or the arguments' devices' limit times ``safety_margin``."""
    margin = _number("safety_margin", safety_margin, "pass e.g. safety_margin=0.9.")
    if not 0 < margin <= 1:
        raise ValueError(
            f"safety_margin must be in (0, 1], got {safety_margin=}; pass e.g. 0.9 to plan "
            "for 90% of the device's memory."
        )
    if memory_budget is None:
        return int(min(_limit(d) for d in _devices(specs)) * margin)
    fix = "pass e.g. memory_budget=8 * 2**30 for 8 GiB."
    budget = _number("memory_budget", memory_budget, fix)
    if not 1 <= budget < float("inf"):
        raise ValueError(
            f"memory_budget must be at least 1 byte and finite, got {memory_budget=}; {fix}"
        )
    return int(budget)


def _number(name: str, value: Any, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number, got {name}={value!r}; {fix}")
    return float(value)


def _devices(specs: list[jax.ShapeDtypeStruct]) -> list[Any]:
    """This process's devices that the arguments live on, else the default device."""
    devices = {
        d
        for s in specs
        if isinstance(s.sharding, jax.sharding.Sharding)
        for d in s.sharding.device_set
        if d.process_index == jax.process_index()
    }
    return sorted(devices, key=lambda d: d.id) or [jax.devices()[0]]


def _limit(device: Any) -> int:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"memory_budget is None, but device {device.platform}:{device.id} reports no "
            "memory limit (memory_stats() has no bytes_limit, as on CPU); pass "
            "memory_budget= in bytes, e.g. memory_budget=8 * 2**30 for 8 GiB."
        )
    return int(stats["bytes_limit"])


@dataclasses.dataclass(frozen=True)
class _Keyword:
    """A keyword of ``build``'s that ``plan`` compiles every size with each value of,
    when ``build`` takes it.

    Attributes:
      name: The keyword.
      values: Its values, in the order the table lists them.
    """

    name: str
    values: tuple[Any, ...]

    def _parameter(self, build: Build) -> inspect.Parameter | None:
        try:
            return inspect.signature(build).parameters.get(self.name)
        except (TypeError, ValueError):  # builtins may have no signature
            return None

    def tried(self, build: Build) -> tuple[Any, ...]:
        """``values`` if ``build`` takes the keyword, else ``(None,)``: without it."""
        return self.values if self._parameter(build) is not None else (None,)

    def required(self, build: Build) -> bool:
        """Whether ``build`` takes the keyword and gives it no default."""
        parameter = self._parameter(build)
        return parameter is not None and parameter.default is inspect.Parameter.empty


GATHER = _Keyword("gather_params", typing.get_args(GatherParams))
"""``micro_grad``'s ``gather_params``: with ``pick="largest"``, at the chosen size the
plan takes the first value that fits, in ``GatherParams``'s order (``"once"``, fewer
collectives, first); with ``pick="fastest"``, the faster."""

CLIP = _Keyword("clip_method", ("auto", *(m for m in typing.get_args(ClipMethod) if m != "auto")))
"""``micro_grad``'s ``clip_method``, tried with ``pick="fastest"`` only: memory is
searched with ``"auto"``, and every other method is timed where it fits (a method that
cannot compute the call says why when it compiles, and is left out)."""


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """One program that ``plan`` compiles: ``build``'s function at one microbatch size,
    and with one ``gather_params`` and one ``clip_method`` where ``build`` takes them."""

    build: Build
    microbatch_size: int | None
    gather_params: str | None
    clip_method: str | None = None

    def __str__(self) -> str:
        gather = "" if self.gather_params is None else f", gather_params={self.gather_params!r}"
        clip = "" if self.clip_method is None else f", clip_method={self.clip_method!r}"
        return f"microbatch_size={self.microbatch_size}{gather}{clip}"

    def compile(self, args: Any, kwargs: Any) -> jax.stages.Compiled:
        """``jax.jit(build(m)).lower(*args, **kwargs).compile()``."""
        fun = _built(self.build, self.microbatch_size, self.gather_params, self.clip_method)
        try:
            return jax.jit(fun).lower(*args, **kwargs).compile()
        except Exception as err:
            err.add_note(
                f"(raised by plan while compiling build({self.microbatch_size}); pass "
                "candidates= to plan to leave such sizes out)"
            )
            raise


@dataclasses.dataclass(frozen=True)
class _Progress:
    """With ``plan(..., progress=True)``, one line per candidate on standard error, begun
    when its compilation begins: which candidate, how long it took, what it needs."""

    on: bool

    def write(self, text: str) -> None:
        if self.on:
            sys.stderr.write(text)
            sys.stderr.flush()

    def start(self, label: str, doing: str) -> None:
        process = "" if jax.process_count() == 1 else f"[process {jax.process_index()}] "
        self.write(f"{process}plan {label}: {doing}")

    @contextlib.contextmanager
    def compiling(self, label: str) -> Iterator[None]:
        """Says that ``label`` compiles, then how long it took, or that it failed."""
        self.start(label, "compiling... ")
        began = time.perf_counter()
        try:
            yield
        except BaseException:
            self.write("failed\n")
            raise
        self.write(f"{time.perf_counter() - began:.1f} s")

    def row(self, row: PlanRow) -> None:
        fits = "fits" if row.fits else "does not fit"
        self.write(f"; total {_bytes(row.total_bytes)}, {fits}\n")


@dataclasses.dataclass
class _Step:
    """The chosen candidate's compiled program: the one ``plan`` compiled to measure it,
    or, when its measurement came from the cache, compiled on first use."""

    candidate: _Candidate
    example: tuple[Any, Any]
    under_mesh: Callable[[], contextlib.AbstractContextManager[Any]]
    report: _Progress
    program: jax.stages.Compiled | None

    def compiled(self) -> jax.stages.Compiled:
        if self.program is None:
            with self.under_mesh(), self.report.compiling(f"[chosen] {self.candidate}"):
                self.program = self.candidate.compile(*self.example)
            self.report.write("\n")
        return self.program


def _mesh() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """Enters again the mesh that is set now, to compile later as ``plan`` did."""
    mesh, abstract = jax.sharding.get_mesh(), jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return lambda: jax.set_mesh(mesh)
    return lambda: jax.sharding.use_abstract_mesh(abstract)


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What one candidate's compiled program costs: a ``PlanRow`` before the budget."""

    microbatch_size: int | None
    num_microbatches: int
    temp_bytes: int
    argument_bytes: int
    total_bytes: int
    flops: float | None
    gather_params: str | None
    clip_method: str | None = None
    compiled: bool = True

    def row(self, budget: int, seconds: float | None = None) -> PlanRow:
        """The table's row, which says whether the total fits ``budget``."""
        fits = self.total_bytes <= budget
        return PlanRow(**dataclasses.asdict(self), fits=fits, seconds=seconds)


class _Search:
    """Finds the largest candidate size that fits in few compiles, and predicts the
    memory of the sizes it did not compile.

    Total memory grows with the microbatch size (affinely over long stretches: the loop
    holds one microbatch's intermediates), so the search compiles the largest candidate
    (done if it fits), the smallest above 1 (a microbatch of 1 is a program of its own,
    off the line of the others; it is compiled only where that one does not fit), and
    then the largest size predicted to fit between the largest compiled size that fits
    and the smallest compiled size that does not, until the two are neighbours: for a
    total affine in the size, four programs whatever the number of candidates.
    ``compile_all`` compiles them all, for a total that does not grow with the size.
    """

    def __init__(
        self,
        build: Build,
        example: tuple[Any, Any],
        key: tuple[Any, ...],
        batch_size: int,
        sizes: tuple[int | None, ...],
        budget: int,
        report: _Progress,
        base_clip: str | None,
        keep_fitting: bool,
    ) -> None:
        self.build, self.example, self.key = build, example, key
        self.batch_size, self.sizes, self.budget, self.report = batch_size, sizes, budget, report
        self.gathers = GATHER.tried(build)
        self.base_clip = base_clip
        self.keep_fitting = keep_fitting  # pick="fastest" times every fitting program
        self.memo = _memo(build)
        self.under_mesh = _mesh()
        self.measured: dict[_Candidate, _Measured] = {}
        self.programs: dict[_Candidate, jax.stages.Compiled] = {}
        self.declined: dict[_Candidate, str] = {}
        self.compiled = 0  # programs compiled now, not measured before

    def base(self, m: int | None) -> list[_Candidate]:
        """The candidates at size ``m`` that the search compiles: each ``gather_params``."""
        return [_Candidate(self.build, m, g, self.base_clip) for g in self.gathers]

    def _label(self, candidate: _Candidate) -> str:
        i = self.sizes.index(candidate.microbatch_size) * len(self.gathers)
        i += self.gathers.index(candidate.gather_params) + 1
        return f"[{i}/{len(self.sizes) * len(self.gathers)}] {candidate}"

    def measure(self, candidate: _Candidate) -> _Measured | None:
        """The candidate's costs, compiled now or remembered; None for a ``clip_method``
        other than the base one that cannot compute the call (its reason is kept)."""
        if candidate in self.measured:
            return self.measured[candidate]
        if candidate in self.declined:
            return None
        cached = (*self.key, candidate.microbatch_size, candidate.gather_params)
        cached += (candidate.clip_method,)
        try:
            measured, program = _measure(
                candidate,
                self._label(candidate),
                self.memo,
                cached,
                self.example,
                self.batch_size,
                self.report,
            )
        except ValueError as err:
            if candidate.clip_method in (None, self.base_clip):
                raise
            self.declined[candidate] = str(err).split("\n")[0]
            self.report.write(f"  (clip_method={candidate.clip_method!r} declined: {err})\n")
            return None
        self.measured[candidate] = measured
        self.compiled += program is not None
        row = measured.row(self.budget)
        self.report.row(row)
        if program is not None and row.fits and (self.keep_fitting or self._largest(candidate)):
            if not self.keep_fitting:
                self.programs.clear()  # hold no program but the chosen-so-far one
            self.programs[candidate] = program
        return measured

    def _largest(self, candidate: _Candidate) -> bool:
        """Whether ``candidate`` is larger than every fitting one kept (at one size, the
        first ``gather_params`` that fits stays)."""
        at = self.sizes.index
        return all(at(candidate.microbatch_size) > at(c.microbatch_size) for c in self.programs)

    def fits(self, i: int) -> bool:
        """Whether some base candidate at ``sizes[i]`` fits, compiling them as needed."""
        measured = [self.measure(c) for c in self.base(self.sizes[i])]
        return any(m is not None and m.total_bytes <= self.budget for m in measured)

    def largest(self, compile_all: bool) -> int | None:
        """The index in ``sizes`` of the largest size that fits, or None."""
        top = len(self.sizes) - 1
        if compile_all:
            return max((i for i in range(top + 1) if self.fits(i)), default=None)
        if self.fits(top):
            return top
        if top == 0:
            return None
        low = 1 if self.sizes[0] == 1 and top > 1 else 0  # 1 is no loop: off the line
        if not self.fits(low):
            return 0 if low and self.fits(0) else None
        lo, hi = low, top
        while hi - lo > 1:
            inside = [i for i in range(lo + 1, hi) if self._predicted_fit(i)]
            i = max(inside, default=lo + 1)
            lo, hi = (i, hi) if self.fits(i) else (lo, i)
        return lo

    def _predicted_fit(self, i: int) -> bool:
        predicted = [self.predicted(c) for c in self.base(self.sizes[i])]
        return any(p is not None and p.total_bytes <= self.budget for p in predicted)

    def _x(self, m: int | None) -> int:
        return self.batch_size if m is None else m

    def predicted(self, candidate: _Candidate) -> _Measured | None:
        """The candidate's costs, measured, or predicted from the compiled rows of its
        ``gather_params`` and ``clip_method``; None where none was compiled."""
        if candidate in self.measured:
            return self.measured[candidate]
        by_x = {
            self._x(c.microbatch_size): m
            for c, m in self.measured.items()
            if _same_series(c, candidate)
        }
        points = sorted(by_x.items(), key=lambda p: p[0])  # None and the batch size: one x
        if not points:
            return None
        x = self._x(candidate.microbatch_size)
        nearest = min(points, key=lambda p: abs(p[0] - x))[1]
        slope = self._slope(candidate, points[0][0], x) if len(points) == 1 else None
        if slope is not None:  # one size of its own: another series' slope through it
            temp = max(0, round(points[0][1].temp_bytes + slope * (x - points[0][0])))
        else:
            temp = max(0, round(_line([(px, m.temp_bytes) for px, m in points], x, True)))
        # flops: the whole batch's, plus a cost per loop iteration: a line in their count
        known = [(m.num_microbatches, m.flops) for _, m in points if m.flops is not None]
        n = _count(self.batch_size, candidate.microbatch_size)
        flops = _line(sorted(dict(known).items()), n, False) if len(known) == len(points) else None
        return _Measured(
            microbatch_size=candidate.microbatch_size,
            num_microbatches=n,
            temp_bytes=temp,
            argument_bytes=nearest.argument_bytes,
            total_bytes=temp + nearest.total_bytes - nearest.temp_bytes,
            flops=flops,
            gather_params=candidate.gather_params,
            clip_method=candidate.clip_method,
            compiled=False,
        )

    def _slope(self, candidate: _Candidate, at: int, x: int) -> float | None:
        """The temp bytes per example between sizes ``at`` and ``x`` of the series
        (another ``gather_params`` or ``clip_method``) compiled at the most sizes, two or
        more; None where there is none. A series compiled at one size alone is otherwise a
        bound (in proportion to the size above it), far above what does not grow with
        the size (the parameters gathered once)."""
        series: dict[tuple[Any, Any], list[tuple[int, int]]] = {}
        for c, m in self.measured.items():
            if c.build is candidate.build and not _same_series(c, candidate):
                key = (c.gather_params, c.clip_method)
                series.setdefault(key, []).append((self._x(c.microbatch_size), m.temp_bytes))
        best = max(series.values(), key=len, default=[])
        if len({px for px, _ in best}) < 2 or x == at:
            return None
        points = sorted(dict(best).items())
        return (_line(points, x, False) - _line(points, at, False)) / (x - at)

    def program(self, candidate: _Candidate) -> jax.stages.Compiled:
        """The candidate's compiled program: kept, or compiled now (its measurement came
        from the cache)."""
        if candidate not in self.programs:
            with self.under_mesh(), self.report.compiling(f"[time] {candidate}"):
                self.programs[candidate] = candidate.compile(*self.example)
            self.report.write("\n")
        return self.programs[candidate]

    def step(self, candidate: _Candidate) -> _Step:
        """The chosen candidate's program, to keep in the Plan: no other is kept."""
        program = self.programs.get(candidate)
        self.programs.clear()
        return _Step(candidate, self.example, self.under_mesh, self.report, program)

    def rows(self, seconds: dict[_Candidate, float]) -> tuple[PlanRow, ...]:
        """Every base candidate's row, measured or predicted, each followed by the rows
        of the other ``clip_method`` values compiled at its size."""
        rows: list[PlanRow] = []
        for m in self.sizes:
            for base in self.base(m):
                others = sorted(
                    (c for c in self.measured if _same_program_size(c, base) and c != base),
                    key=lambda c: CLIP.values.index(c.clip_method),
                )
                # a predicted base row beside compiled rows of other methods: left out
                shown = [base] if base in self.measured or not others else []
                for c in [*shown, *others]:
                    costs = self.predicted(c)
                    if costs is not None:
                        rows.append(costs.row(self.budget, seconds.get(c)))
        return tuple(rows)


def _auto_is_named(search: _Search, candidate: _Candidate) -> str | None:
    """The named method with which ``clip_method="auto"`` computes the call
    (``clipping_report``), so that timing it would time that one twice; None where it
    chooses none of them (the plain sum), or where ``build``'s function is not one
    ``micro_grad`` made: then ``"auto"`` is timed too."""
    fun = _built(search.build, candidate.microbatch_size, candidate.gather_params, "auto")
    args, kwargs = search.example
    try:
        with search.under_mesh():
            method = clipping_report(fun, *args, **kwargs).method
    except TypeError:
        return None
    return method if method in CLIP.values[1:] else None


def _same_series(a: _Candidate, b: _Candidate) -> bool:
    """Whether two candidates differ in their microbatch size alone."""
    return a.gather_params == b.gather_params and a.clip_method == b.clip_method


def _same_program_size(a: _Candidate, b: _Candidate) -> bool:
    """Whether two candidates differ in their ``clip_method`` alone."""
    return a.gather_params == b.gather_params and a.microbatch_size == b.microbatch_size


def _count(batch_size: int, microbatch_size: int | None) -> int:
    """How many microbatches the loop runs (one without microbatching)."""
    return 1 if microbatch_size is None else -(-batch_size // microbatch_size)


def _line(points: Sequence[tuple[int, float]], x: int, proportional: bool) -> float:
    """The value at ``x`` of the line through the nearest points around it (through the
    two nearest on one side, beyond them). From one point, the same value; where
    ``proportional`` (a memory that grows with the size), above it in proportion to
    ``x``: from one point either is a bound, not a fit (below it, the memory of a
    smaller size is at most that point's; above, it grows at most in proportion)."""
    same = [v for px, v in points if px == x]
    if same:
        return same[0]
    below = [p for p in points if p[0] < x]
    above = [p for p in points if p[0] > x]
    if below and above:
        (x0, y0), (x1, y1) = below[-1], above[0]
    elif len(below) >= 2:
        (x0, y0), (x1, y1) = below[-2], below[-1]
    elif len(above) >= 2:
        (x0, y0), (x1, y1) = above[0], above[1]
    else:
        px, v = points[0]
        return v * x / px if proportional and x > px else v
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_SLOWER = 1.5
"""``pick="fastest"`` stops timing a candidate over this many times slower than the best
so far, and stops going to smaller sizes after two sizes in a row that all were."""


def _clock() -> float:
    return time.perf_counter()


def _timed_call(candidate: _Candidate, program: Any, args: Any, kwargs: Any) -> float:
    """Seconds of one call of ``program``, until its outputs are ready."""
    del candidate  # a test's fake clock times by candidate
    began = _clock()
    jax.block_until_ready(program(*args, **kwargs))
    return _clock() - began


class _Timing:
    """``pick="fastest"``: each candidate that fits is warmed up and timed once, largest
    size first; those within ``_SLOWER`` of the best are then timed in turn for the
    other ``repeats - 1`` rounds, each round starting at another one; the fastest median
    wins."""

    def __init__(
        self,
        search: _Search,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        max_seconds: float | None,
        repeats: int,
        began: float,
    ) -> None:
        self.search, self.args, self.kwargs = search, args, kwargs
        self.max_seconds, self.repeats, self.began = max_seconds, repeats, began
        self.auto_named: list[str | None] = []  # once: the choice reads no size

    def _late(self) -> bool:
        return self.max_seconds is not None and _clock() - self.began > self.max_seconds

    def _call(self, candidate: _Candidate) -> float:
        program = self.search.program(candidate)
        return _timed_call(candidate, program, self.args, self.kwargs)

    def _variants(self, m: int | None) -> list[_Candidate]:
        """The candidates to time at size ``m``: each ``gather_params``, and each
        ``clip_method`` where ``build`` takes it; ``"auto"`` only where what it chooses
        for the call is none of the named methods (nothing to clip: the plain sum). That
        choice is asked once, at the first size timed: the cost model it compares counts
        flops per example, the same at every size."""
        build, gathers = self.search.build, self.search.gathers
        clips = CLIP.tried(build)
        if clips[0] is not None:
            if not self.auto_named:
                asked = _Candidate(build, m, gathers[0], "auto")
                self.auto_named.append(_auto_is_named(self.search, asked))
                if self.auto_named[0] is not None:
                    self.search.report.write(
                        f"plan: microbatch_size={m}, clip_method='auto' chooses "
                        f"{self.auto_named[0]!r} for this call (at every size): timed as such\n"
                    )
            if self.auto_named[0] is not None:
                clips = clips[1:]
        return [_Candidate(build, m, g, c) for g in gathers for c in clips]

    def fastest(self, top: int) -> tuple[_Candidate, dict[_Candidate, float]]:
        """The fastest candidate of ``sizes[:top + 1]``, and each timed one's seconds."""
        report = self.search.report
        samples: dict[_Candidate, list[float]] = {}
        slow_sizes = 0
        late = False
        for m in reversed(self.search.sizes[: top + 1]):
            timed, close = False, False
            for candidate in self._variants(m):
                if late := bool(samples) and self._late():
                    spent = f"plan: max_seconds={self.max_seconds} spent"
                    report.write(f"{spent}; no more candidates timed\n")
                    break
                measured = self.search.measure(candidate)
                if measured is None or measured.total_bytes > self.search.budget:
                    continue
                self._call(candidate)  # the warm-up: first-call costs are not the step's
                samples[candidate] = [self._call(candidate)]
                report.write(f"plan [time] {candidate}: {_duration(samples[candidate][0])}\n")
                close |= samples[candidate][0] <= _SLOWER * min(t[0] for t in samples.values())
                timed = True
            if late:
                break
            slow_sizes = 0 if close else slow_sizes + timed  # a size where none fit: no count
            if slow_sizes == 2:
                report.write(
                    f"plan: two sizes in a row over {_SLOWER}x slower than the best; "
                    "smaller sizes not timed\n"
                )
                break
        if not samples:
            reasons = "; ".join(f"{c}: {why}" for c, why in self.search.declined.items())
            raise ValueError(
                "plan(pick='fastest') found no candidate that fits the budget and computes "
                f"the call ({reasons}); pass pick='largest'."
            )
        first = min(t[0] for t in samples.values())
        alive = contenders = [c for c, t in samples.items() if t[0] <= _SLOWER * first]
        for r in range(1, self.repeats):
            if self._late():
                report.write(f"plan: max_seconds={self.max_seconds} spent after {r} rounds\n")
                break
            turn = r % len(alive)
            for candidate in alive[turn:] + alive[:turn]:
                samples[candidate].append(self._call(candidate))
            medians = {c: float(np.median(samples[c])) for c in alive}
            fastest = min(medians, key=medians.__getitem__)
            alive = [c for c in alive if medians[c] <= _SLOWER * medians[fastest]]
            report.write(
                f"plan [round {r + 1}/{self.repeats}] fastest so far: {fastest}, "
                f"{_duration(medians[fastest])}\n"
            )
        seconds = {c: float(np.median(t)) for c, t in samples.items()}
        chosen = min(contenders, key=seconds.__getitem__)
        calls = len(samples[chosen])
        report.write(f"plan: the fastest is {chosen}, {_duration(seconds[chosen])} ")
        report.write(f"(the median of {calls} call{'s' if calls > 1 else ''})\n")
        return chosen, seconds


def _built(
    build: Build, m: int | None, gather: str | None = None, clip: str | None = None
) -> Callable[..., Any]:
    keywords = {k.name: v for k, v in ((GATHER, gather), (CLIP, clip)) if v is not None}
    fun = build(m, **keywords)
    if not callable(fun):
        raise TypeError(
            f"build must return the function to run, but build({m}) returned {fun!r}; "
            "return e.g. microbatch(loss, 1, m)."
        )
    return fun


def _measure(
    candidate: _Candidate,
    label: str,
    memo: dict[Hashable, Any],
    key: Hashable,
    example: tuple[Any, Any],
    batch_size: int,
    report: _Progress,
) -> tuple[_Measured, jax.stages.Compiled | None]:
    """The candidate's costs, from ``memo`` or compiled now (then with the program)."""
    if key in memo:
        report.start(label, "measured before")
        return memo[key], None
    with report.compiling(label):
        program = candidate.compile(*example)
        memo[key] = _analysed(program, candidate, batch_size)
    return memo[key], program


def _analysed(compiled: Any, candidate: _Candidate, batch_size: int) -> _Measured:
    """The costs that XLA's memory and cost analyses give of ``compiled``."""
    memory = compiled.memory_analysis()
    if memory is None:
        raise ValueError(
            f"The {jax.default_backend()} backend gives no memory analysis of compiled "
            "programs, so plan cannot measure them; choose microbatch_size by hand."
        )
    total = (
        memory.temp_size_in_bytes
        + memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )
    m = candidate.microbatch_size
    n = _count(batch_size, m)
    return _Measured(
        microbatch_size=m,
        num_microbatches=n,
        temp_bytes=memory.temp_size_in_bytes,
        argument_bytes=memory.argument_size_in_bytes,
        total_bytes=total,
        flops=_flops(compiled, n),
        gather_params=candidate.gather_params,
        clip_method=candidate.clip_method,
    )


def _flops(compiled: Any, num_microbatches: int) -> float | None:
    """The compiler's flops, times the trip count if the program still loops."""
    cost = compiled.cost_analysis()
    flops = cost.get("flops") if isinstance(cost, dict) else None
    if flops is None or flops < 0:
        return None
    loops = " while(" in (compiled.as_text() or "")
    return float(flops) * (num_microbatches if loops else 1)


def _nothing_fits(result: Plan) -> str:
    head = (
        f"No candidate microbatch size fits memory_budget={result.memory_budget} "
        f"({_bytes(result.memory_budget)}): "
    )
    arguments = min(row.argument_bytes for row in result.table)
    fixed = min(row.total_bytes - row.temp_bytes for row in result.table)
    if fixed > result.memory_budget:
        what = (
            f"the arguments alone take {_amount(arguments)}"
            if arguments > result.memory_budget
            else f"the arguments and outputs take {_amount(fixed)}, the "
            f"arguments {_amount(arguments)},"
        )
        return (
            f"{head}{what} per device whatever the microbatch size, as microbatching "
            "shrinks only the scratch memory (temp). Raise memory_budget, or shard the "
            f"arguments over more devices.\n{result}"
        )
    smallest = min((r for r in result.table if r.compiled), key=lambda row: row.total_bytes)
    least = min((row.microbatch_size for row in result.table if row.microbatch_size), default=0)
    smaller = "" if least == 1 else f"try candidates below {least or 'the batch size'}, "
    return (
        f"{head}the smallest total is {_amount(smallest.total_bytes)}, with "
        f"microbatch_size={smallest.microbatch_size}. "
        f"Raise memory_budget, {smaller}or shard the arguments over more devices.\n{result}"
    )


def _render(table: tuple[PlanRow, ...], chosen: list[bool]) -> list[str]:
    """Aligned rows under a header; the chosen one starts with ``*``."""
    head: tuple[str, ...] = ("microbatch_size", "microbatches", "temp", "total", "flops", "fits")
    gathers = any(row.gather_params is not None for row in table)
    clips = any(row.clip_method is not None for row in table)
    timed = any(row.seconds is not None for row in table)

    def cells(row: PlanRow) -> tuple[str, ...]:
        guess = "" if row.compiled else "~"
        out = (
            str(row.microbatch_size),
            str(row.num_microbatches),
            guess + _bytes(row.temp_bytes),
            guess + _bytes(row.total_bytes),
            "?" if row.flops is None else guess + _si(row.flops),
            "yes" if row.fits else "no",
        )
        out += (str(row.gather_params),) if gathers else ()
        out += (str(row.clip_method),) if clips else ()
        return out + ((_duration(row.seconds),) if timed else ())

    head += ("gather_params",) if gathers else ()
    head += ("clip_method",) if clips else ()
    head += ("time",) if timed else ()
    lines = [cells(row) for row in table]
    widths = [max(len(line[i]) for line in [head, *lines]) for i in range(len(head))]
    marks = [" ", *("*" if c else " " for c in chosen)]
    return [
        f"{mark} " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True))
        for mark, line in zip(marks, [head, *lines], strict=True)
    ]


def _duration(seconds: float | None) -> str:
    """``0.01234`` -> ``'12.3 ms'``; None -> ``'-'`` (not timed)."""
    if seconds is None:
        return "-"
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, one decimal."""
    unit = 0
    while abs(n) >= 1024 and unit < len(_BYTE_UNITS) - 1:
        n, unit = n / 1024, unit + 1
    return f"{int(n)} B" if unit == 0 else f"{n:.1f} {_BYTE_UNITS[unit]}"


def _amount(n: int) -> str:
    """``616`` -> ``'616 bytes'``, ``1536`` -> ``'1536 bytes (1.5 KiB)'``: exact, and
    readable where the units help."""
    return f"{n} bytes" if abs(n) < 1024 else f"{n} bytes ({_bytes(n)})"


def _si(x: float) -> str:
    """``4.3e6`` -> ``'4.30 M'``: decimal units, two decimals."""
    unit = 0
    while abs(x) >= 1000 and unit < len(_FLOP_UNITS) - 1:
        x, unit = x / 1000, unit + 1
    return f"{x:.2f} {_FLOP_UNITS[unit]}" if unit else f"{x:.0f}"
