"""Test configuration shared by tests/ and the doctests in jaxdist/: 8 simulated CPU devices.

XLA's persistent compilation cache is on, in a directory that lives as long as the run and is shared by every
process of it (the pytest-xdist workers of ``./scripts/test`` and the processes the multi-process tests launch
inherit it through ``JAXDIST_TEST_XLA_CACHE``): the many tests that build the same program (one model under
several strategies, one step in several checks, in either worker) compile it once. Every program is still
compiled in the run; nothing is kept across runs.

Expensive fixtures (references, multi-process runs, a built site) are session-scoped even where one module
uses them: ./scripts/test keeps a file's tests on one pytest-xdist worker (``--dist loadfile``), which may
interleave files, and a module-scoped fixture would be computed again each time its module comes back.
"""

import atexit
import os
import shutil
import tempfile

import jax

# Must run before any JAX backend starts (importing jaxdist starts none).
jax.config.update("jax_num_cpu_devices", 8)
# Tests check what programs compute, not how fast they run: LLVM's optimisation passes are most of XLA:CPU's
# compile time (about half of a pipelined LM's first step) and change no result (no fast-math either way).
# Added to XLA_FLAGS, never replacing what a user set; the processes the tests launch inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
jax.config.update("jax_platforms", "cpu")

if "JAXDIST_TEST_XLA_CACHE" not in os.environ:  # the first process of the run owns (and removes) the directory
    os.environ["JAXDIST_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_XLA_CACHE"], ignore_errors=True)
# JAX reads these variables at import: the processes the tests launch (scripts run three times over by the
# preemption tests, the docs' code blocks) share the cache too. A size limit turns on JAX's file lock.
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.environ["JAXDIST_TEST_XLA_CACHE"],
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30),
)
jax.config.update("jax_compilation_cache_dir", os.environ["JAXDIST_TEST_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", 8 << 30)

# Scripts run as separate processes by the multi-process tests, not modules to import here.
collect_ignore_glob = ["tests/multiprocess/*"]
