"""Test configuration shared by tests/ and the doctests in jaxdist/: 8 simulated CPU devices."""

import jax

# Must run before any JAX backend starts (importing jaxdist starts none).
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Scripts run as separate processes by the multi-process tests, not modules to import here.
collect_ignore_glob = ["tests/multiprocess/*"]
