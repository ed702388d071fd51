"""The on-device check of `strategy.run`'s mirrored outputs: each replica's copy fingerprinted,
compared on device.

`jaxdist.strategies.compile._identical` proves which outputs of a replica function are the same on
every replica; the proof is then checked where it is cheap. The first call of each compiled ``run``
program runs a variant that also returns, per output it returns mirrored, whether every replica
holds the same bits: each device hashes its copy to one 32-bit number (`fingerprint`), and ``pmax ==
pmin`` of those numbers over the replica axes is one boolean per output. Only those booleans reach
the host; the arrays never leave the devices. Later calls run the program without the check (nothing
added to a step); ``strategy.run(..., check_mirrored="every")`` or ``JAXDIST_CHECK_MIRRORED=every``
checks every call while debugging.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.replicate.collectives import AxisName, to_varying
from jaxdist.replicate.trees import describe

__all__ = ["CHECK_MIRRORED_ENV", "agreement", "check_mirrored_arg", "fingerprint",
           "raise_on_disagreement"]

CHECK_MIRRORED_ENV = "JAXDIST_CHECK_MIRRORED"
"""Environment variable: ``every`` checks every call of a ``strategy.run`` program, not just the
first."""

_MULTIPLIER = np.uint32(0x9E3779B1)  # odd: an element's change always changes the sum (mod 2**32)


def check_mirrored_arg(check_mirrored: str | None) -> str:
    """``strategy.run``'s ``check_mirrored`` validated: ``"first"`` or ``"every"``; None reads
    ``JAXDIST_CHECK_MIRRORED`` (a debugger's switch, read at each call), else ``"first"``.

    Raises:
        ValueError: for another value (of the argument or of the environment variable), naming both
            choices.

    Examples:
        >>> check_mirrored_arg(None), check_mirrored_arg("every")
        ('first', 'every')
    """
    where = "check_mirrored"
    if check_mirrored is None:
        check_mirrored, where = os.environ.get(CHECK_MIRRORED_ENV,
                                               "").strip().lower() or "first", CHECK_MIRRORED_ENV
    if check_mirrored not in ("first", "every"):
        raise ValueError(f"{where}={check_mirrored!r}: use 'first' (the default: the first call of "
                         "each strategy.run program checks on device that its mirrored outputs are "
                         "the same on every replica) or 'every' (every call does, while "
                         "debugging).")
    return check_mirrored


def fingerprint(x: Any) -> jax.Array:
    """A 32-bit hash of ``x``'s bits (one per device when traced per replica): equal values, equal
    hashes; one element different, a different hash. Typed PRNG keys hash their key data; complex
    numbers both parts.

    Examples:
        >>> import jax.numpy as jnp
        >>> int(fingerprint(jnp.ones(3))) == int(fingerprint(jnp.ones(3)))
        True
        >>> int(fingerprint(jnp.ones(3))) == int(fingerprint(jnp.array([1.0, 1.0, 2.0])))
        False
    """
    x = jnp.asarray(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    bits = bits.reshape(-1)
    weights = (2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1) * _MULTIPLIER
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def agreement(values: Sequence[Any], axis_name: AxisName) -> jax.Array:
    """Per value (in the replica program): True where every replica's copy has one fingerprint."""
    if not values:
        return jnp.zeros((0,), jnp.bool_)
    prints = jnp.stack([fingerprint(v) for v in values])
    prints = to_varying(prints, axis_name)
    return jax.lax.pmax(prints, axis_name) == jax.lax.pmin(prints, axis_name)


def raise_on_disagreement(fn: str, paths: Sequence[str], agreed: jax.Array) -> None:
    """Raise when an output returned mirrored differs between replicas (``agreed``: one flag each).

    Raises:
        RuntimeError: naming the outputs and the fix (``ctx.all_reduce`` before the value is
            returned).
    """
    flags = np.asarray(agreed.addressable_data(0) if isinstance(agreed, jax.Array) else agreed)
    differ = [p for p, ok in zip(paths, flags.tolist(), strict=True) if not ok]
    if differ:
        raise RuntimeError(
            f"strategy.run({fn}): {describe(differ)} was proven the same on every replica and "
            "would come back mirrored, but on device the replicas hold different values (checked "
            "at the first call). Combine the replicas' values before returning them: "
            "jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, value) (or declare a value kept "
            "apart on purpose with ctx.per_replica(value)). Please report this program: the "
            "analysis should not have proven it (a non-deterministic operation, such as a "
            "scatter-add with atomics on a GPU, can also give each replica other bits).")
