"""Test-wide settings: 8 fake CPU devices, strict rank promotion, no hypothesis deadline."""

import jax
from hypothesis import settings

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# An example's first call compiles, so its time says nothing about the code: no deadline.
settings.register_profile("microbatching", deadline=None)
settings.load_profile("microbatching")
