"""``micro_grad`` across processes: 2 processes x 2 CPU devices on 127.0.0.1, over gloo.

Each process runs ``multiprocess_worker.py``: it owns half of the global batch, and the
two together run one jitted DP-SGD-style step (clip every per-example gradient, sum)
over a 4-device ``'data'`` mesh. The test checks the result against plain per-example
``jax.vmap(jax.grad)`` in this process, and that the compiled step moves no batch data
between devices: its only collective is the all-reduce of the summed gradients. The same
processes then take the gradients of a model whose parameters are sharded over all
devices of both processes (FSDP), which the test checks against per-example gradients
summed in NumPy here, and that they come back sharded like the parameters.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import microbatching

from . import multiprocess_worker as worker
from .strategies import assert_close

NUM_PROCESSES = 2
LOCAL_DEVICES = 2
TIMEOUT_S = 1200.0  # a hang guard, not a speed check: generous for a loaded machine
WORKER = pathlib.Path(worker.__file__)

pytestmark = pytest.mark.skipif(
    "jax_cpu_collectives_implementation" not in jax.config.values,
    reason="this jax has no CPU collectives (gloo), so a CPU computation cannot span processes",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """This environment, on CPU, importing the same ``microbatching`` and with no proxy."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["JAX_PLATFORMS"] = "cpu"
    src = str(pathlib.Path(microbatching.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=1200)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=1200)


def _run_workers(tmp_path: pathlib.Path, axis_type: str) -> list[dict[str, Any]]:
    """Runs all worker processes to completion and returns each one's results."""
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"process{i}.log" for i in range(NUM_PROCESSES)]
    outs = [tmp_path / f"process{i}.json" for i in range(NUM_PROCESSES)]

    def report() -> str:
        parts = [
            f"process {i} rc={p.returncode}:\n{logs[i].read_text()}" for i, p in enumerate(procs)
        ]
        return "\n".join(parts)

    timed_out = False
    try:
        for i in range(NUM_PROCESSES):
            with open(logs[i], "wb") as log:
                cmd = [
                    sys.executable, str(WORKER), "--process-id", str(i),
                    "--num-processes", str(NUM_PROCESSES), "--port", str(port),
                    "--out", str(outs[i]), "--local-devices", str(LOCAL_DEVICES),
                    "--axis-type", axis_type, "--timeout", str(int(TIMEOUT_S) // 2),
                ]  # fmt: skip
                procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env())
                )
        # Wait for all, but stop early once one fails: the others would only hang.
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            _stop(proc)
    assert not timed_out, f"workers still running after {TIMEOUT_S} s, stopped\n{report()}"
    assert all(p.returncode == 0 for p in procs), f"a worker failed\n{report()}"
    return [json.loads(out.read_text()) for out in outs]


def _reference() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Clipped, summed per-example gradients, losses and gradient norms in one process."""
    params, x, y = worker.make_problem()

    def per_example(params: Any, xi: jax.Array, yi: jax.Array) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(worker.loss_fn)(params, xi[None], yi[None])

    values, grads = jax.vmap(per_example, in_axes=(None, 0, 0))(
        params, jnp.asarray(x), jnp.asarray(y)
    )
    norms = jax.vmap(worker.global_norm)(grads)
    summed = jax.tree.map(lambda g: jnp.sum(g, axis=0), jax.vmap(worker.clip)(grads))
    return jax.tree.map(np.asarray, summed), np.asarray(values), np.asarray(norms)


def _fsdp_reference() -> dict[str, dict[str, np.ndarray]]:
    """Per ``worker.FSDP_OPTIONS``, the summed (and clipped) gradients of ``fsdp_loss``:
    per-example gradients from ``jax.vmap(jax.grad)``, summed in float64 NumPy."""
    params, (_, x, y) = worker.make_fsdp_params(), worker.make_problem()
    per_example = jax.vmap(
        jax.grad(lambda p, xi, yi: worker.fsdp_loss(p, xi[None], yi[None])), in_axes=(None, 0, 0)
    )(params, jnp.asarray(x), jnp.asarray(y))
    grads = {k: np.asarray(g, np.float64) for k, g in per_example.items()}
    norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, 1) for g in grads.values()))
    assert 0 < np.sum(norms > worker.CLIP_NORM) < len(norms), "clipping should bind for some"
    scale = np.minimum(1.0, worker.CLIP_NORM / norms)
    return {
        "default": {k: np.sum(g, 0) for k, g in grads.items()},
        "l2_clip_norm": {k: np.tensordot(scale, g, 1) for k, g in grads.items()},
    }


def _check_fsdp(result: dict[str, Any], axis_type: str) -> None:
    """One process's FSDP gradients: exact, and sharded like the parameters where the
    layout can be read (an Explicit mesh, or concrete arrays); inside ``jit`` on an Auto
    mesh it cannot, and they come back replicated (see ``_fsdp.py``)."""
    wants = _fsdp_reference()
    names = [*worker.FSDP_OPTIONS, *(["eager"] if axis_type == "auto" else [])]
    assert sorted(result["fsdp"]) == sorted(names)
    rows = worker.FSDP_ROWS // (NUM_PROCESSES * LOCAL_DEVICES)
    for name, got in result["fsdp"].items():
        grads = {k: np.asarray(v) for k, v in got["grads"].items()}
        terms = worker.BATCH_SIZE // worker.MICROBATCH_SIZE
        assert_close(
            grads, wants["default" if name == "eager" else name], dtype=np.float32, terms=terms
        )
        spec = worker.FSDP_SPEC if axis_type == "explicit" or name == "eager" else P()
        assert got["specs"] == dict.fromkeys(grads, str(tuple(spec))), name
        local = {k: [rows if spec else g.shape[0], g.shape[1]] for k, g in grads.items()}
        assert got["shard_shapes"] == {k: [s] * LOCAL_DEVICES for k, s in local.items()}, name


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_micro_grad_across_processes(tmp_path: pathlib.Path, axis_type: str) -> None:
    results = _run_workers(tmp_path, axis_type)
    grads, values, norms = _reference()
    assert 0 < np.sum(norms > worker.CLIP_NORM) < len(norms), "clipping should bind for some"
    for process_id, result in enumerate(results):
        assert result["process_id"] == process_id
        assert result["device_count"] == NUM_PROCESSES * LOCAL_DEVICES
        # Each process holds only its own rows: one (batch / devices)-row shard per device.
        rows = worker.BATCH_SIZE // (NUM_PROCESSES * LOCAL_DEVICES)
        assert result["x_shard_shapes"] == [[rows, worker.NUM_FEATURES]] * LOCAL_DEVICES
        half = worker.BATCH_SIZE // NUM_PROCESSES
        assert result["local_rows"] == [process_id * half, (process_id + 1) * half]
        # JSON gives float64 lists; the worker computed in float32.
        got = {
            "grads": {k: np.asarray(v) for k, v in result["grads"].items()},
            "values": np.asarray(result["values"]),
            "norms": np.asarray(result["norms"]),
        }
        want = {"grads": grads, "values": values, "norms": norms}
        assert_close(got, want, dtype=np.float32, terms=worker.BATCH_SIZE // worker.MICROBATCH_SIZE)
        collectives = result["collectives"]
        moved = {
            op: collectives[op]
            for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")
        }
        assert moved == dict.fromkeys(moved, 0), f"batch data moved between devices: {collectives}"
        assert collectives["all-reduce"] == 1, f"expected one all-reduce of the gradients: {result}"
        # Under Explicit axes the per-device partial sums are all-reduced once, after the loop.
        in_loops = 0 if axis_type == "explicit" else 1
        assert result["all_reduces_in_loops"] == in_loops, f"all-reduce placement: {result}"
        _check_fsdp(result, axis_type)
