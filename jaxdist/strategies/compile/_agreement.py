"""Program agreement: in a job of several processes, every process must run the same programs.

Processes that compile different programs (another code version on one host, a configuration that
drifted, an optimizer built with another learning rate) still meet in the same collectives, so
nothing fails: the all-reduced gradients agree, each process applies its own update, and the
"mirrored" values diverge without a word. Or the programs' collectives do not match and every
process waits forever. So before the first step of each program a strategy compiles, the processes
compare a fingerprint of it (a hash of its lowered StableHLO) through the coordination service's
key-value store, with a timeout: a mismatch is an error on every process, raised before the program
runs, naming the processes that differ and what to check; a process that never arrives is an error
after ``timeout`` seconds, not a wait.

It costs one lowering and one key-value exchange per program and process (a few milliseconds),
nothing per step, and nothing at all in a single process.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from typing import Any

import jax
from jax._src import (
    distributed as _distributed,  # JAX's coordination client (private; orbax reads it too)
)

__all__ = ["ProgramMismatchError", "agree", "fingerprint"]

TIMEOUT_SECONDS = 600.0
"""How long a process waits for its peers to reach the same program (they may still be compiling an
earlier one, or loading data)."""

_counter = itertools.count()
_lock = threading.Lock()


class ProgramMismatchError(RuntimeError):
    """The processes of a job compiled different programs for one step (or one never reached it).

    Raised on every process, before the program runs, naming the processes and what to check.

    Examples:
        >>> import jaxdist as jd
        >>> issubclass(jd.strategies.ProgramMismatchError, RuntimeError)
        True
    """


def fingerprint(lowered: Any) -> str:
    """The hex sha256 of a lowered program's StableHLO text (``jax.jit(f).lower(...)``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> a = fingerprint(jax.jit(lambda x: x * 2.0).lower(jnp.ones(3)))
        >>> a == fingerprint(jax.jit(lambda x: x * 2.0).lower(jnp.ones(3))), a == fingerprint(
        ...     jax.jit(lambda x: x * 3.0).lower(jnp.ones(3)))
        (True, False)
    """
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def agree(name: str, digest: str, timeout: float | None = None) -> None:
    """Compare ``digest`` (this process's fingerprint of program ``name``) with every other's.

    Every process calls it for its programs in the order it compiles them; the n-th call of each
    process is compared with the n-th call of the others. A no-op in a single process.

    Raises:
        ProgramMismatchError: on every process when the fingerprints differ (naming the processes
            and what to check), or when a peer does not arrive within ``timeout`` seconds (default
            `TIMEOUT_SECONDS`).

    Examples:
        >>> agree("train_step", "0" * 64)   # one process: nothing to compare
    """
    count = jax.process_count()
    if count == 1:
        return
    client = _distributed.global_state.client
    if client is None:  # several processes without the coordination service: nothing to talk to
        return
    with _lock:
        n = next(_counter)
    me = jax.process_index()
    client.key_value_set(f"jaxdist/program/{n}/{me}", f"{digest} {name}")
    wait = int(1000 * (TIMEOUT_SECONDS if timeout is None else timeout))
    seen: dict[int, tuple[str, str]] = {}
    for pid in range(count):
        try:
            value = client.blocking_key_value_get(f"jaxdist/program/{n}/{pid}", wait)
        except Exception as error:
            raise ProgramMismatchError(
                f"process {pid} did not reach program {n} ({name!r}) within {wait / 1000:.0f} s: "
                "it is stuck, dead, or running another program (code version, configuration); its "
                f"stack or log says which ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}).") from None
        other_digest, _, other_name = value.partition(" ")
        seen[pid] = (other_digest, other_name)
    reference = seen[0]
    differ = sorted(pid for pid, entry in seen.items() if entry != reference)
    if differ:
        names = ", ".join(f"process {pid}: {seen[pid][1]!r} {seen[pid][0][:12]}"
                          for pid in [0, *differ])
        raise ProgramMismatchError(f"the processes compiled different programs for step {n} of "
                                   f"this job ({name!r} here): process(es) {differ} differ from "
                                   f"process 0 ({names}). Every process must run the same code "
                                   "version, the same configuration (optimizer, learning rate, "
                                   "model sizes) and the same input shapes; nothing has run.")
