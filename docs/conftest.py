"""Settings for the doctests of these pages (pytest collects docs/**/*.md, see pyproject).

Eight fake CPU devices, as tests/conftest.py sets for the suite, so the multi-device guide
runs anywhere (set before JAX creates its CPU backend). The pages show user code, which
broadcasts a bias over a batch as everyone writes it: their doctests run with JAX's default
rank promotion, whatever the suite sets.
"""

from collections.abc import Iterator

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

# The MkDocs hooks are build code that imports griffe, not a module with doctests.
collect_ignore = ["hooks.py"]


@pytest.fixture(autouse=True)
def _default_rank_promotion() -> Iterator[None]:
    with jax.numpy_rank_promotion("allow"):
        yield
