"""Gradient compressors: what the all-reduce of one gradient leaf puts on the wire.

A compressor reduces ONE gradient leaf across the replicas: ``decompress(all_reduce(compress(g)))``.

* `NoneCompressor`: the plain all-reduce.
* `CastCompressor`: cast to bfloat16 / float16 before the all-reduce and back after (Horovod's fp16
  compression), with optional error feedback.
* `PowerSGDCompressor`: rank-r PowerSGD (Vogels et al., 2019): one power iteration per step, Q
  warm-started from the previous step and the compression error fed into the next step's gradient.

Compressors are stateless configuration objects, optax-style: ``init(leaf, index)`` makes a leaf's
state (a NamedTuple, or None when there is none) and ``reduce(grad, state, ...)`` returns
``(reduced, new_state)``. Use them through `jaxdist.gradients.AllReduceSynchronizer`, which maps
them over a gradient pytree.

Collectives run over a named axis (``"replica"`` inside ``strategy.run``). Outside any mapped axis
there is one replica: the collectives return their input, but the compression still happens, so a
single device sees exactly what one replica would.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.replicate.collectives import (
    all_reduce,
    axis_size,
    is_axis_name,
    keep_per_replica,
    to_varying,
)
from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.ops import ReduceOp
from jaxdist.strategies.ambient import replica_axis

__all__ = ["CastCompressor", "CastState", "Compressor", "NoneCompressor", "PowerSGDCompressor",
           "PowerSGDState", "replica_count"]

_COLLECTIVES = ("auto", "all_reduce", "all_to_all")


def replica_count(axis_name: str | None = None) -> int | None:
    """How many replicas share mesh axis ``axis_name`` here: its size inside ``strategy.run``, else
    None. ``axis_name`` None: the replica axis of the ``strategy.run`` being traced (``"replica"``,
    or the name given with ``run(..., axis_name=...)``).

    Examples:
        >>> import jaxdist as jd
        >>> jd.gradients.replica_count() is None
        True
        >>> int(jd.MirroredStrategy().run(lambda: jd.gradients.replica_count()))
        8
    """
    return axis_size(axis_name or replica_axis(REPLICA_AXIS))


def _check_axis_name(axis_name: Any) -> None:
    if not is_axis_name(axis_name):
        raise TypeError(f"axis_name={axis_name!r} must be a mesh axis name or a tuple of them, "
                        f"e.g. {REPLICA_AXIS!r}.")


def _check_options(reduce_op: Any, axis_name: Any) -> ReduceOp:
    _check_axis_name(axis_name)
    return ReduceOp.parse(reduce_op, "reduce_op")


class Compressor:
    """Base class of the compressors: how one gradient leaf is all-reduced. Subclasses implement
    `reduce` (and `init` when they carry state); `NoneCompressor` is the smallest one.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> c = jd.gradients.NoneCompressor()
        >>> c.init(jnp.ones(3), 0) is None
        True
    """

    def init(self, leaf: Any, index: int) -> Any:
        """The initial state for a gradient leaf shaped like ``leaf`` (None: this compressor keeps
        none).

        Args:
            leaf: an array (or anything with ``shape`` and ``dtype``) shaped like the gradient.
            index: the leaf's position in its pytree (seeds per-leaf randomness).

        Returns:
            A NamedTuple of arrays, or None.
        """
        del leaf, index
        return None

    def reduce(self, grad: jax.Array, state: Any, *, reduce_op: ReduceOp | str = ReduceOp.MEAN,
               axis_name: str = REPLICA_AXIS) -> tuple[jax.Array, Any]:
        """All-reduce ``grad`` (this replica's gradient) across the replicas of ``axis_name``.

        Args:
            grad: this replica's gradient leaf.
            state: the leaf's state from `init` or the previous step.
            reduce_op: MEAN (the default) or SUM.
            axis_name: the mapped axis to reduce over.

        Returns:
            ``(reduced, new_state)``: the reduced gradient (identical on every replica) and the
            state to pass to the next step.

        Raises:
            ValueError: for an unknown ``reduce_op``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCompressor(Compressor):
    """No compression: a plain ``psum`` / ``pmean`` of the gradient.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> out, state = jd.gradients.NoneCompressor().reduce(jnp.ones(2), None)   # one replica
        >>> out.tolist(), state
        ([1.0, 1.0], None)
    """

    def reduce(self, grad, state, *, reduce_op=ReduceOp.MEAN, axis_name=REPLICA_AXIS):
        op = _check_options(reduce_op, axis_name)
        return all_reduce(jnp.asarray(grad), op, axis_name), state


class CastState(NamedTuple):
    """Error-feedback state of `CastCompressor`: what the cast dropped last step, fed into the next.

    Attributes:
        error: this replica's rounding error, shaped like the gradient (different on every replica:
            after ``strategy.run`` it is a `jaxdist.PerReplica`).

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> c = jd.gradients.CastCompressor(error_feedback=True)
        >>> _, state = c.reduce(jnp.float32(1.0 + 2**-10), c.init(jnp.float32(0), 0))
        >>> float(state.error) == 2**-10
        True
    """

    error: jax.Array


def _bits_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def _all_reduce_by_all_to_all(payload: jax.Array, reduce_op: ReduceOp, axis_name: str,
                              n: int) -> jax.Array:
    """A low-precision all-reduce that moves only low-precision bytes on every backend.

    XLA:CPU converts every bfloat16/float16 collective to float32 (all-reduce, reduce-scatter,
    all-gather and all-to-all alike), which would undo the compression. Integer
    collectives are left alone, so the payload travels as its bit pattern: a reduce-scatter built
    from an all-to-all (replica i receives chunk i of everyone's payload and sums it in float32,
    rounding once) and an all-gather of the reduced chunks. Each replica sends (n-1)/n of the
    payload twice, exactly what a ring all-reduce sends, at half the width.
    """
    shape, dtype, size = payload.shape, payload.dtype, payload.size
    bits = _bits_dtype(dtype)
    chunk = -(-size // n)
    flat = jnp.pad(payload.reshape(-1), (0, chunk * n - size)).reshape(n, chunk)
    flat = to_varying(jax.lax.bitcast_convert_type(flat, bits), axis_name)
    mine = jax.lax.all_to_all(flat, axis_name, 0, 0, tiled=True)  # row j: replica j's chunk
    part = jax.lax.bitcast_convert_type(mine, dtype).astype(jnp.float32).sum(0)
    if reduce_op is ReduceOp.MEAN:
        part = part / n
    part = jax.lax.bitcast_convert_type(part.astype(dtype), bits)
    whole = jax.lax.all_gather(part, axis_name, axis=0, tiled=True, to="invarying")
    return jax.lax.bitcast_convert_type(whole, dtype)[:size].reshape(shape)


class CastCompressor(Compressor):
    """Cast to a 16-bit float for the all-reduce, back after: half the bytes of a float32
    all-reduce. Only floating leaves wider than ``dtype`` are cast; others (already bfloat16,
    integers) take the plain all-reduce. With ``error_feedback=True`` the rounding error of each
    step is added to the next step's gradient (state: `CastState`, per replica).

    Args:
        dtype: the wire dtype, ``jnp.bfloat16`` (default) or ``jnp.float16`` (or a narrower float).
        error_feedback: carry the rounding error from step to step (off by default, as in Horovod).
        collective: ``"all_reduce"``: a ``psum`` in ``dtype`` (what GPUs and TPUs run natively);
            ``"all_to_all"``: a reduce-scatter made of an all-to-all of the bit patterns plus an
            all-gather, summed in float32 locally (the only way to move 16-bit payloads on XLA:CPU,
            which converts 16-bit float collectives to float32); ``"auto"`` (default):
            ``"all_to_all"`` when JAX's default backend is the CPU, else ``"all_reduce"``.

    Raises:
        ValueError: for a ``dtype`` that is not a float of at most 16 bits (casting to float32 saves
            nothing) or an unknown ``collective``.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> c = jd.gradients.CastCompressor(jnp.bfloat16)
        >>> float(c.reduce(jnp.float32(1.0 + 2**-10), None)[0])   # rounded to bfloat16 on the way
        1.0
    """

    def __init__(self, dtype: Any = jnp.bfloat16, *, error_feedback: bool = False,
                 collective: str = "auto"):
        try:
            wire = np.dtype(dtype)
        except TypeError as e:
            raise ValueError(
                f"dtype={dtype!r} is not a dtype: use jnp.bfloat16 or jnp.float16.") from e
        if not jnp.issubdtype(wire, jnp.floating) or wire.itemsize > 2:
            raise ValueError(
                f"dtype={wire.name} is not a float of at most 16 bits: a cast compressor must "
                "narrow the gradients to save bytes (a cast to float32 compresses nothing); use "
                "jnp.bfloat16 or jnp.float16.")
        if collective not in _COLLECTIVES:
            raise ValueError(f"collective={collective!r} is not one of "
                             f"{', '.join(map(repr, _COLLECTIVES))}.")
        self.dtype, self.error_feedback = wire, bool(error_feedback)
        self.collective = collective

    def compresses(self, leaf: Any) -> bool:
        """Whether a leaf of this dtype is cast (a float wider than ``dtype``).

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> c = jd.gradients.CastCompressor()
            >>> c.compresses(jnp.zeros(2, jnp.float32)), c.compresses(jnp.zeros(2, jnp.bfloat16))
            (True, False)
        """
        dtype = np.dtype(leaf.dtype)
        return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize > self.dtype.itemsize

    def init(self, leaf, index):
        del index
        if not (self.error_feedback and self.compresses(leaf)):
            return None
        return CastState(jnp.zeros_like(leaf))

    def reduce(self, grad, state, *, reduce_op=ReduceOp.MEAN, axis_name=REPLICA_AXIS):
        op = _check_options(reduce_op, axis_name)
        grad = jnp.asarray(grad)
        if not self.compresses(grad):
            return all_reduce(grad, op, axis_name), state
        m = grad if state is None else grad + state.error
        payload = m.astype(self.dtype)  # compress
        new_state = (None if state is None
                     else CastState(keep_per_replica(m - payload.astype(m.dtype), axis_name)))
        n = replica_count(axis_name)
        collective = self.collective
        if collective == "auto":
            collective = "all_to_all" if jax.default_backend() == "cpu" else "all_reduce"
        if n is None:
            reduced = payload
        elif collective == "all_to_all":
            reduced = _all_reduce_by_all_to_all(payload, op, axis_name, n)
        else:
            reduced = all_reduce(payload, op, axis_name)
        return reduced.astype(grad.dtype), new_state  # decompress

    def __repr__(self) -> str:
        return (f"CastCompressor(dtype={self.dtype.name}, error_feedback={self.error_feedback}, "
                f"collective={self.collective!r})")


class PowerSGDState(NamedTuple):
    """State of `PowerSGDCompressor` for one matrix leaf, carried from step to step.

    Attributes:
        q: the ``(cols, rank)`` right factor of the last step, the warm start of the next power
            iteration; identical on every replica (mirrored after ``strategy.run``).
        error: this replica's residual ``M - P Qᵀ``, shaped like the gradient, added to the next
            gradient (error feedback); different on every replica (a `jaxdist.PerReplica` after
            ``strategy.run``).

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> state = jd.gradients.PowerSGDCompressor(rank=2).init(jnp.zeros((16, 8)), 0)
        >>> state.q.shape, state.error.shape
        ((8, 2), (16, 8))
    """

    q: jax.Array
    error: jax.Array


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with warm-started Q and error feedback (Vogels et al., 2019).

    Per matrix leaf and step, with ``G`` this replica's gradient viewed as a matrix::

        M = G + error              # error feedback
        P = mean(M Q)              # all-reduce 1: rows x rank
        P = orthonormalize(P)      # QR
        Q = mean(Mᵀ P)             # all-reduce 2: cols x rank
        result = P Qᵀ              # ≈ mean of the replicas' M, rank ``rank``
        error = M - P Qᵀ           # kept locally;  Q kept as the next step's warm start

    so each replica sends ``(rows + cols) * rank`` numbers instead of ``rows * cols``. A leaf of
    rank > 2 is viewed as ``(prod(shape[:-1]), shape[-1])`` (features last, as Flax lays out Dense
    and Conv kernels). Vectors, scalars, matrices with a dimension of 1, non-float leaves, and
    matrices too small to gain (``(rows + cols) * rank >= rows * cols``) take the plain all-reduce
    and keep no state.

    Args:
        rank: the rank of the approximation (capped at ``min(rows, cols)``).
        seed: seeds the initial Q (drawn once, in `init`; leaf ``i``: ``fold_in(key(seed), i)``).

    Raises:
        ValueError: when ``rank`` is not a positive int.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> c = jd.gradients.PowerSGDCompressor(rank=1)
        >>> g = jnp.outer(jnp.arange(1.0, 5.0), jnp.ones(6))  # rank 1: recovered exactly
        >>> out, state = c.reduce(g, c.init(g, 0))
        >>> bool(jnp.allclose(out, g, atol=1e-5)), state.q.shape
        (True, (6, 1))
    """

    def __init__(self, rank: int = 4, *, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank={rank!r} must be a positive int, e.g. rank=4.")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed={seed!r} must be an int.")
        self.rank, self.seed = int(rank), int(seed)

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """``(rows, cols, rank)`` of the matrix a leaf of this shape is compressed as (None: not).

        Examples:
            >>> import jaxdist as jd
            >>> c = jd.gradients.PowerSGDCompressor(rank=4)
            >>> c.matrix_shape((512, 512)), c.matrix_shape((3, 3, 16, 32)), c.matrix_shape((1, 512))
            ((512, 512, 4), (144, 32, 4), None)
        """
        if len(shape) < 2:
            return None
        rows, cols = math.prod(shape[:-1]), shape[-1]
        rank = min(self.rank, rows, cols)
        if min(rows, cols) == 1 or (rows + cols) * rank >= rows * cols:
            return None
        return rows, cols, rank

    def _plan(self, leaf: Any) -> tuple[int, int, int] | None:
        if not jnp.issubdtype(np.dtype(leaf.dtype), jnp.floating):
            return None
        return self.matrix_shape(tuple(leaf.shape))

    def init(self, leaf, index):
        plan = self._plan(leaf)
        if plan is None:
            return None
        _, cols, rank = plan
        dtype = jnp.promote_types(leaf.dtype, jnp.float32)
        key = jax.random.fold_in(jax.random.key(self.seed), index)
        q = jax.random.normal(key, (cols, rank), dtype)
        return PowerSGDState(q=q, error=jnp.zeros_like(leaf, dtype))  # varying like leaf

    def reduce(self, grad, state, *, reduce_op=ReduceOp.MEAN, axis_name=REPLICA_AXIS):
        op = _check_options(reduce_op, axis_name)
        grad = jnp.asarray(grad)
        plan = self._plan(grad)
        if plan is None:
            return all_reduce(grad, op, axis_name), state
        if not isinstance(state, PowerSGDState):
            raise ValueError(
                f"state={state!r} is not the PowerSGDState of a {grad.shape} gradient: make the "
                "state with init() on a tree shaped like the gradients and pass each step's new "
                "state to the next.")
        rows, cols, _ = plan
        m = grad.reshape(rows, cols).astype(state.error.dtype) + state.error.reshape(rows, cols)
        p = all_reduce(m @ state.q.astype(m.dtype), ReduceOp.MEAN, axis_name)
        p, _ = jnp.linalg.qr(p)
        q = all_reduce(m.T @ p, ReduceOp.MEAN, axis_name)
        approx = p @ q.T
        error = keep_per_replica((m - approx).reshape(grad.shape), axis_name)  # this replica's
        if op is ReduceOp.SUM:
            approx = approx * (replica_count(axis_name) or 1)
        return (approx.reshape(grad.shape).astype(grad.dtype),
                PowerSGDState(q=q.astype(state.q.dtype), error=error))

    def __repr__(self) -> str:
        return f"PowerSGDCompressor(rank={self.rank}, seed={self.seed})"
