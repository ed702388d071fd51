"""Test configuration shared by tests/ and the doctests in jaxdist/: 8 simulated CPU devices.

XLA's persistent compilation cache is on for this process, in a directory of its own that lives as long as
the session: the many tests that build the same program (one model under several strategies, one step in
several checks) compile it once. Every program is still compiled in the session; nothing is kept across runs.
"""

import atexit
import shutil
import tempfile

import jax

# Must run before any JAX backend starts (importing jaxdist starts none).
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

_XLA_CACHE = tempfile.mkdtemp(prefix="jaxdist-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Scripts run as separate processes by the multi-process tests, not modules to import here.
collect_ignore_glob = ["tests/multiprocess/*"]
