"""The scripts in examples/ run to completion in their ``--quick`` mode.

Each runs in a fresh Python process, as a user would run it, on CPU, with a timeout. The
scripts assert their own results (microbatched gradients against unbatched references,
results independent of the microbatch size, MultiSteps against microbatch), so a zero
exit status and their ``check`` lines are the test. ``examples/data_parallel.py``, whose
set-up the multi-device guide shows, runs as 2 processes of 2 CPU devices.

All of them are marked ``examples`` (deselect with ``-m "not examples"``). They take
about 2 minutes together on 2 idle CPU cores, and are skipped under
``JAX_ENABLE_X64=1``: the scripts are written for float32, and one run is enough.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 1800  # a hang guard, not a speed check: generous for a loaded machine

pytestmark = [
    pytest.mark.examples,
    pytest.mark.skipif(
        os.environ.get("JAX_ENABLE_X64", "").lower() in ("1", "true"),
        reason="the examples are written for float32; the default run covers them",
    ),
]


def _env() -> dict[str, str]:
    """This environment on CPU, without x64 and without proxies (the coordinator of
    ``jax.distributed`` is on 127.0.0.1)."""
    env = {
        k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64" and "proxy" not in k.lower()
    }
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(script: str, *flags: str) -> str:
    """Runs ``examples/<script>`` to completion; returns its standard output."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *flags],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("flax_nnx.py", ["check: micro_grad(l2_clip_norm)", "check: jax.grad(microbatch(loss))"]),
        ("equinox_model.py", ["check: microbatch(eqx.filter_value_and_grad(loss))"]),
        ("dropout_keys.py", ["per-example keys: loss", "one shared key:"]),
        ("optax_accumulation.py", ["check: the losses of every update and the final parameters"]),
    ],
)
def test_quick(script: str, expected: list[str]) -> None:
    out = _run(script, "--quick")
    for line in expected:
        assert line in out, f"{script} printed no {line!r}:\n{out}"


def test_demo_reports_epsilon() -> None:
    out = _run("dp_sgd_digits.py", "--steps", "10", "--microbatch-size", "128")
    for line in ["padded to 512 = 4 microbatches of 128", "test accuracy:", "privacy: epsilon ="]:
        assert line in out, f"dp_sgd_digits.py printed no {line!r}:\n{out}"


def test_language_model_quick_dp() -> None:
    """The quick language model: the token-weighted gradient against ``jax.grad`` of the
    whole batch's token mean, training, evaluation with a remainder, a sample, then the
    DP fine-tune with Poisson batches and its epsilon (from dp-accounting)."""
    pytest.importorskip("dp_accounting")
    out = _run("language_model.py", "--quick", "--dp")
    expected = [
        "check: micro_grad(MEAN, example_weights=tokens) matches its reference",
        "Plan for batch_size=16",
        "step     4  train",
        "sample: ",
        "DP fine-tune on",
        "privacy: (",
    ]
    for line in expected:
        assert line in out, f"language_model.py printed no {line!r}:\n{out}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(
    "jax_cpu_collectives_implementation" not in jax.config.values,
    reason="this jax has no CPU collectives (gloo), so a CPU computation cannot span processes",
)
def test_data_parallel_two_processes() -> None:
    pytest.importorskip("sklearn")
    coordinator = f"127.0.0.1:{_free_port()}"
    flags = ["--num-processes", "2", "--coordinator", coordinator, "--devices", "2"]
    flags += ["--steps", "2", "--batch-size", "256", "--microbatch-size", "32"]
    script = str(EXAMPLES / "data_parallel.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, *flags, "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )
        for i in range(2)
    ]
    try:
        outs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, f"process {i} failed:\n{out}"
    assert "'all-gather': 0" in outs[0] and "step 1: loss" in outs[0], outs[0]
