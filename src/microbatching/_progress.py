"""A progress bar over microbatches, driven from inside the compiled loop.

With ``progress=True`` the loop body calls back to the host once per microbatch
(``jax.debug.callback``), with the microbatch's index and the number that will run. The
host prints a bar to standard error: redrawn in place on a terminal, and one line per
``STEP_PERCENT`` percent when the output is a file or a pipe (a log). Each process prints
its own bar. Inside ``shard_map`` every shard calls back; the host keeps the first report of
each microbatch and drops the other shards' copies of it. With ``progress=False`` the
compiled program holds no callback at all.

No dependency: a bar is a few lines, and tqdm would add a runtime dependency for them.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

import jax

STEP_PERCENT = 10
"""How often a bar written to a file or a pipe prints a line."""
REDRAW_SECONDS = 0.1
"""How often a bar on a terminal is redrawn, at most."""
WIDTH = 30

_lock = threading.Lock()
_last: dict[str, tuple[int, float]] = {}
_shards: dict[tuple[str, int], set[int]] = {}
"""Per bar and microbatch, the shards that have reported it in the current call."""


def tick(name: str, index: Any, total: Any, after: Any = None, runs: Any = True) -> None:
    """Reports, from inside the loop, that microbatch ``index`` of ``total`` has run.

    ``after``, a scalar computed from the microbatch's result, makes the report wait for
    it where ``index`` is a constant (the remainder after the loop), which XLA would
    otherwise report first. ``runs``, where traced, is whether the microbatch runs: under
    ``jax.vmap`` over a count, a lane that skips it still computes its branch (a select
    picks the result), and its report is dropped on the host.
    """
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)  # inside shard_map
    shard = jax.lax.axis_index(manual) if manual else 0
    jax.debug.callback(functools.partial(_report, name), index, total, shard, after, runs)


def _report(
    name: str, index: Any, total: Any, shard: Any = 0, after: Any = None, runs: Any = True
) -> None:
    if not bool(runs):
        return
    done, total = int(index) + 1, int(total)
    stream = sys.stderr
    label = name if jax.process_count() == 1 else f"[process {jax.process_index()}] {name}"
    with _lock:
        if not _first(label, done, int(shard)) or not _due(label, done, total, stream.isatty()):
            return
        line = _line(label, done, total)
        if stream.isatty():
            stream.write("\r" + line + ("\n" if done == total else ""))
        else:
            stream.write(line + "\n")
        stream.flush()


def _first(label: str, done: int, shard: int) -> bool:
    """Whether this is the first report of microbatch ``done`` in this call: a shard that
    reported it already starts a new call; one that did not repeats another shard's."""
    seen = _shards.setdefault((label, done), set())
    if seen and shard not in seen:
        seen.add(shard)
        return False
    _shards[(label, done)] = {shard}
    return True


def _due(label: str, done: int, total: int, terminal: bool) -> bool:
    """Whether to print now: the first and last microbatch always, else rate-limited."""
    now = time.monotonic()
    previous, printed_at = _last.get(label, (0, 0.0))
    if done == 1 or done == total or done < previous:
        _last[label] = (done, now)
        return True
    if terminal:
        due = now - printed_at >= REDRAW_SECONDS
    else:
        due = done * 100 // (total * STEP_PERCENT) > previous * 100 // (total * STEP_PERCENT)
    if due:
        _last[label] = (done, now)
    return due


def _line(label: str, done: int, total: int) -> str:
    filled = WIDTH * done // max(total, 1)
    bar = "#" * filled + "." * (WIDTH - filled)
    return f"{label} [{bar}] {done}/{total} microbatches ({100 * done // max(total, 1)}%)"
