"""Test configuration shared by tests/ and the doctests in jaxdist/: 8 simulated CPU devices.

XLA's persistent compilation cache is on: the many tests that build the same program (one model
under several strategies, one step in several checks) compile it once.
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
- Across runs (``JAXDIST_TEST_XLA_KEPT``: ``~/.cache/jaxdist/tests-xla`` unless set; ``""``: none),
  the programs the pytest processes compiled in the last passing runs: each pytest process starts
  with hard links to them in its own directory (JAX writes only the programs it does not find, so a
  kept file is never written), and a run that passed adds the programs it compiled (never a failed
  run's: a process that died may have left one half written). A second run compiles what changed,
  not everything: measured, the pytest processes' own CPU fell from 822 s to 285 s (the whole
  suite's from 1,481 to 952 CPU-s; 12:46 to 8:18 on 2 cores). What the launched processes wrote to
  the shared directory is kept too (in ``launched/`` there, linked into the next run's shared
  directory), each file only when it is a whole zlib stream, as JAX writes them: the tests kill some
  of those processes, one may die mid-write. Measured on the multi-process and benchmark files
  (41 tests): their launched processes' CPU fell from 603 s to 417 s on a second run. Over
  `KEPT_BYTES`, the least recently read programs go first.

Expensive fixtures (references, multi-process runs, a built site) are session-scoped even where one
module uses them: ./scripts/test keeps a file's tests on one pytest-xdist worker (``--dist
loadfile``), which may interleave files, and a module-scoped fixture would be computed again each
time its module comes back.
"""

import atexit
import contextlib
import gc
import os
import shutil
import tempfile
import zlib

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

KEPT = os.environ.get("JAXDIST_TEST_XLA_KEPT", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxdist", "tests-xla"))
KEPT_BYTES = 1 << 30
"""The most the kept programs take; a run that passes them drops the least recently read down to
half (a full run adds about 60 MB of programs when everything changed)."""

# The first process of the run owns (and removes) the directory: beside the kept programs when
# there are, so that hard links reach them.
_OWNER = "JAXDIST_TEST_XLA_CACHE" not in os.environ
if _OWNER:
    try:
        os.makedirs(KEPT or ".", exist_ok=True)
    except OSError:  # a read-only home: nothing kept
        KEPT = os.environ["JAXDIST_TEST_XLA_KEPT"] = ""
    os.environ["JAXDIST_TEST_XLA_CACHE"] = tempfile.mkdtemp(
        prefix="jaxdist-tests-xla-", dir=os.path.dirname(KEPT) if KEPT else None)
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_XLA_CACHE"], ignore_errors=True)


def _link(source: str, target: str) -> None:
    """``target`` names the program file ``source`` (a copy where no hard link can be made); one
    that is there already stays."""
    try:
        os.link(source, target)
    except FileExistsError:
        return
    except OSError:  # no hard links here: a copy, complete before it takes the name
        with contextlib.suppress(OSError):
            shutil.copyfile(source, target + ".part")
            os.replace(target + ".part", target)


def _programs(directory: str) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return [e.path for e in os.scandir(directory) if e.name.endswith("-cache") and e.is_file()]
    return []


def _whole(path: str) -> bool:
    """Whether the program file ``path`` is a complete zlib stream (JAX compresses each program
    with zlib where neither ``zstandard`` nor ``compression.zstd`` is there; a file in another
    format is not kept)."""
    stream = zlib.decompressobj()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                stream.decompress(chunk)
    except (OSError, zlib.error):
        return False
    return stream.eof


LAUNCHED = os.path.join(KEPT, "launched") if KEPT else ""
"""Where the kept programs of the processes the tests launch go."""
if _OWNER:  # the shared directory starts with them
    for _path in _programs(LAUNCHED):
        _link(_path, os.path.join(os.environ["JAXDIST_TEST_XLA_CACHE"], os.path.basename(_path)))

# JAX reads these variables at import: the processes the tests launch (scripts run three times over
# by the preemption tests, the docs' code blocks) share that directory.
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.environ["JAXDIST_TEST_XLA_CACHE"],
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30),
)
# This process: a directory of its own (inside that one), every program, no size limit (no lock),
# starting with the programs kept from the last passing runs.
_OWN = tempfile.mkdtemp(dir=os.environ["JAXDIST_TEST_XLA_CACHE"])
for _path in _programs(KEPT) if KEPT else []:
    _link(_path, os.path.join(_OWN, os.path.basename(_path)))
jax.config.update("jax_compilation_cache_dir", _OWN)
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


def pytest_sessionfinish(session, exitstatus):
    """A run that passed keeps what its processes compiled (the run's owner, once they have all
    ended), then drops the least recently read programs when they take over `KEPT_BYTES`."""
    if not (_OWNER and KEPT and exitstatus == 0):
        return
    run = os.environ["JAXDIST_TEST_XLA_CACHE"]
    for own in (e.path for e in os.scandir(run) if e.is_dir()):
        for path in _programs(own):
            _link(path, os.path.join(KEPT, os.path.basename(path)))
    os.makedirs(LAUNCHED, exist_ok=True)
    for path in _programs(run):
        target = os.path.join(LAUNCHED, os.path.basename(path))
        if not os.path.exists(target) and _whole(path):
            _link(path, target)
    kept = [(os.stat(path), path) for path in _programs(KEPT) + _programs(LAUNCHED)]
    total = sum(st.st_size for st, _ in kept)
    if total > KEPT_BYTES:
        for st, path in sorted(kept, key=lambda item: item[0].st_atime):
            if total <= KEPT_BYTES // 2:
                break
            with contextlib.suppress(OSError):
                os.remove(path)
            total -= st.st_size
