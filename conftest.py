"""Test configuration shared by tests/ and the doctests in jaxdist/: 8 simulated CPU devices.

XLA's persistent compilation cache is on, in directories that live as long as the run (nothing is
kept across runs): the many tests that build the same program (one model under several strategies,
one step in several checks) compile it once.
- Each pytest process (each pytest-xdist worker of ``./scripts/test``) keeps every program it
  compiles, however short its compile, in a directory of its own: only that process reads and writes
  it, so it needs no lock. Most of the suite's programs compile in well under 0.2 s, and the same
  ones come back test after test (a new ``jax.jit`` of the same step is a new function to JAX's
  memory caches, not to this one). Measured on six single-process test files in one process: 9% less
  CPU than keeping only the programs that take over 0.2 s.
- The processes the tests launch (multi-process jobs, scripts, the docs' code blocks) share one
  directory (``JAXDIST_TEST_XLA_CACHE``, inherited) with JAX's file lock, which a size limit turns
  on. That lock scans the whole directory at each write, so there only programs that take over 0.2 s
  are kept.

Expensive fixtures (references, multi-process runs, a built site) are session-scoped even where one
module uses them: ./scripts/test keeps a file's tests on one pytest-xdist worker (``--dist
loadfile``), which may interleave files, and a module-scoped fixture would be computed again each
time its module comes back.
"""

import atexit
import gc
import os
import shutil
import tempfile

import jax

# Must run before any JAX backend starts (importing jaxdist starts none).
jax.config.update("jax_num_cpu_devices", 8)
# Tests check what programs compute, not how fast they run: LLVM's optimisation passes are most of
# XLA:CPU's compile time (about half of a pipelined LM's first step) and change no result (no
# fast-math either way). Added to XLA_FLAGS, never replacing what a user set; the processes the
# tests launch inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
jax.config.update("jax_platforms", "cpu")

# The first process of the run owns (and removes) the directory.
if "JAXDIST_TEST_XLA_CACHE" not in os.environ:
    os.environ["JAXDIST_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_XLA_CACHE"], ignore_errors=True)
# JAX reads these variables at import: the processes the tests launch (scripts run three times over
# by the preemption tests, the docs' code blocks) share that directory.
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.environ["JAXDIST_TEST_XLA_CACHE"],
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30),
)
# This process: a directory of its own (inside that one), every program, no size limit (no lock).
jax.config.update("jax_compilation_cache_dir",
                  tempfile.mkdtemp(dir=os.environ["JAXDIST_TEST_XLA_CACHE"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", -1)

# Scripts run as separate processes by the multi-process tests, not modules to import here.
collect_ignore_glob = ["tests/multiprocess/*"]

# Python's cyclic garbage collector: a pytest process holds hundreds of thousands of objects (JAX's
# traces and caches, every test module), which each full collection walks again. Measured on six
# single-process test files in one process: 6.6 s of 220 s of CPU in collections with Python's
# defaults, 3.2 s with what collection created frozen and the youngest generation collected every
# 20,000 allocations instead of 700.
gc.set_threshold(20_000, *gc.get_threshold()[1:])


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()  # what collection created lives to the end: never walked again
