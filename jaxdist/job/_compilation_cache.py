"""`configure_compilation_cache`: a restarted job loads its compiled programs instead of compiling
them again.

Every restart (a preemption, a watchdog exit, a new job on the same code) compiles every program
again: minutes for a large model. JAX's persistent compilation cache keeps the compiled executables
on disk, keyed by the program, the devices and the compiler version, so an unchanged program is
loaded instead. This turns it on with thresholds for training jobs: every program is cached,
whatever its compile time (JAX's default skips those under a second, which are most of a small job's
programs and all of a test's).

Many processes can share one directory (a shared file system for the job): JAX reads from every
process and writes only from process 0 (a process that reads an entry process 0 is still writing
gets JAX's warning and compiles the program itself). A cache entry from another JAX / jaxlib
version or other devices is simply not used (it is part of the key).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["configure_compilation_cache"]


def configure_compilation_cache(directory: str | os.PathLike, *,
                                min_compile_seconds: float = 0.0) -> Path:
    """Turn on JAX's persistent compilation cache in ``directory`` for this process (see the module
    doc). Call it once, at the top of the program, on every process, with the same directory; it
    also works after programs have compiled (those are not cached).

    Args:
        directory: where the compiled programs go (created if missing; share it between restarts).
        min_compile_seconds: programs that compiled faster than this are not cached (0: cache all).

    Returns:
        The directory, as an absolute `Path`.

    Raises:
        ValueError: for a negative ``min_compile_seconds``, or a ``directory`` that is a file.

    Examples:
        >>> import tempfile, jax, jaxdist as jd
        >>> before = (jax.config.jax_compilation_cache_dir,
        ...           jax.config.jax_persistent_cache_min_compile_time_secs)
        >>> path = jd.configure_compilation_cache(tempfile.mkdtemp())
        >>> path.is_dir(), jax.config.jax_compilation_cache_dir == str(path)
        (True, True)
        >>> jax.config.update("jax_compilation_cache_dir", before[0])  # as it was
        >>> jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    """
    if (isinstance(min_compile_seconds, bool) or not isinstance(min_compile_seconds, (int, float))
            or min_compile_seconds < 0):
        raise ValueError(f"min_compile_seconds={min_compile_seconds!r} must be a number of seconds "
                         ">= 0.")
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"directory={str(directory)!r} is a file: pass a directory for the "
                         "compiled programs.")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path
