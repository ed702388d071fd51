"""`AllReduceSynchronizer`: a replica function's gradient all-reduce, with a pluggable compressor.

A synchronizer is a pure function object used inside the replica function (``strategy.run``),
optax-style::

    sync = jd.gradients.AllReduceSynchronizer(jd.gradients.PowerSGDCompressor(rank=4))
    sync_state = strategy.run(sync.init, args=(params,))  # Q mirrored, error feedback per replica

    def replica_fn(params, sync_state, batch):
        grads = jax.grad(loss)(params, batch)  # local gradients
        grads, sync_state = sync.all_reduce(grads, sync_state)  # the global mean, compressed
        return grads, sync_state

    grads, sync_state = strategy.run(replica_fn, args=(params, sync_state, batch))

State that is identical on every replica (PowerSGD's Q) comes back from ``run`` mirrored; state that
differs (the error-feedback residuals) comes back as `jaxdist.PerReplica`, and passing it back into
``run`` gives each replica its own component again. ``sync.init(params)`` called outside ``run``
works too (the first step then sees the zero residuals as mirrored values, a different signature, so
``run`` compiles once more on step 2).

Leaves that are `SparseRows` (embedding gradients) are reduced by `sparse_all_reduce` (an all-gather
of the touched rows when that moves fewer bytes), uncompressed, and come back dense. They keep no
state: state that ``init(params)`` made for the dense table is dropped on the first step (so ``run``
compiles once more on step 2); ``init`` on a tree with the `SparseRows` in place avoids that.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxdist.gradients.compressors import Compressor, NoneCompressor, _check_axis_name
from jaxdist.gradients.sparse import is_sparse, sparse_all_reduce
from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.ops import ReduceOp
from jaxdist.strategies.ambient import replica_axis

__all__ = ["AllReduceSynchronizer", "SynchronizerState"]


class SynchronizerState(NamedTuple):
    """The state an `AllReduceSynchronizer` carries from step to step.

    Attributes:
        leaves: one compressor state per gradient leaf, in the gradients' tree structure (None where
            the compressor keeps none, e.g. every leaf of `NoneCompressor`, or PowerSGD's vectors).

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> jd.gradients.AllReduceSynchronizer().init({"w": jnp.zeros((2, 2))})
        SynchronizerState(leaves={'w': None})
    """

    leaves: Any


class AllReduceSynchronizer:
    """All-reduce a gradient pytree across replicas inside ``strategy.run``, compressing each leaf.

    Args:
        compressor: a `Compressor`: `NoneCompressor` (default), `CastCompressor` or
            `PowerSGDCompressor`.
        reduce_op: MEAN (default, the global-batch gradient) or SUM.
        axis_name: the mesh axis to reduce over; None (default): the replica axis of the
            ``strategy.run`` being traced (``"replica"``, or the name given with ``run(...,
            axis_name=...)``).

    Raises:
        TypeError: when ``compressor`` is not a `Compressor` or ``axis_name`` is not a string.
        ValueError: for an unknown ``reduce_op``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> sync = jd.gradients.AllReduceSynchronizer(jd.gradients.PowerSGDCompressor(rank=2))
        >>> params = strategy.mirror({"w": jnp.ones((8, 8)), "b": jnp.zeros(8)})
        >>> state = strategy.run(sync.init, args=(params,))
        >>> def replica_fn(params, state, x):
        ...     grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        ...     return sync.all_reduce(grads, state)
        >>> x = strategy.experimental_distribute_values(jnp.ones((16, 8)))
        >>> grads, state = strategy.run(replica_fn, args=(params, state, x))
        >>> (type(state.leaves["w"].q).__name__, type(state.leaves["w"].error).__name__,
        ...  state.leaves["b"])
        ('ArrayImpl', 'PerReplica', None)
    """

    def __init__(self, compressor: Compressor | None = None,
                 reduce_op: ReduceOp | str = ReduceOp.MEAN, *, axis_name: str | None = None):
        compressor = NoneCompressor() if compressor is None else compressor
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"compressor={compressor!r} (type {type(compressor).__name__}) is not a "
                "Compressor: use NoneCompressor(), CastCompressor(jnp.bfloat16) or "
                "PowerSGDCompressor(rank=4).")
        if axis_name is not None:
            _check_axis_name(axis_name)
        self.compressor, self.axis_name = compressor, axis_name
        self.reduce_op = ReduceOp.parse(reduce_op, "reduce_op")

    def init(self, tree: Any) -> SynchronizerState:
        """The initial state for gradients shaped like ``tree`` (the params, or a gradient pytree).
        Call it inside ``strategy.run`` (``strategy.run(sync.init, args=(params,))``) to get the
        steady-state layout at once: the parts identical on every replica mirrored, the per-replica
        parts `PerReplica`.

        Args:
            tree: a pytree of arrays shaped like the gradients (`SparseRows` leaves get no state).

        Returns:
            A `SynchronizerState`.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> sync = jd.gradients.AllReduceSynchronizer(jd.gradients.PowerSGDCompressor(rank=4))
            >>> state = sync.init({"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros(32)})
            >>> state.leaves["kernel"].q.shape, state.leaves["bias"]
            ((32, 4), None)
        """
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sparse)
        states = [None if is_sparse(leaf) else self.compressor.init(jax.numpy.asarray(leaf), i)
                  for i, leaf in enumerate(leaves)]
        return SynchronizerState(jax.tree.unflatten(treedef, states))

    def all_reduce(self, grads: Any, state: SynchronizerState) -> tuple[Any, SynchronizerState]:
        """Reduce this replica's gradients across the replicas (inside ``strategy.run``). Outside
        any replica function there is one replica: compression still applies, no collective runs.

        Args:
            grads: this replica's gradient pytree (dense arrays and `SparseRows`).
            state: the `SynchronizerState` from `init` or the previous step.

        Returns:
            ``(reduced, new_state)``: the reduced gradients, identical on every replica
            (`SparseRows` come back dense), and the state for the next step.

        Raises:
            TypeError: when ``state`` is not a `SynchronizerState`.
            ValueError: when ``state`` was made for a differently structured tree.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> sync = jd.gradients.AllReduceSynchronizer()
            >>> strategy = jd.MirroredStrategy()
            >>> g = strategy.experimental_distribute_values(jnp.arange(8.0))
            >>> out, _ = strategy.run(lambda g: sync.all_reduce(g, sync.init(g)), args=(g,))
            >>> out.tolist()
            [3.5]
        """
        if not isinstance(state, SynchronizerState):
            raise TypeError(
                f"state={type(state).__name__} is not a SynchronizerState: pass the state made by "
                "sync.init(params) (or returned by the previous sync.all_reduce).")
        leaves, treedef = jax.tree.flatten(grads, is_leaf=is_sparse)
        try:
            leaf_states = treedef.flatten_up_to(state.leaves)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "state was made for a tree of structure "
                f"{jax.tree.structure(state.leaves, is_leaf=_is_state)} but the gradients have "
                f"structure {treedef}: make the state with sync.init on a tree shaped like the "
                "gradients (e.g. the params).") from e
        axis = self.axis_name or replica_axis(REPLICA_AXIS)
        reduced, new_states = [], []
        for grad, leaf_state in zip(leaves, leaf_states, strict=True):
            if is_sparse(grad):  # uncompressed and stateless
                out, leaf_state = sparse_all_reduce(grad, self.reduce_op, axis_name=axis), None
            else:
                out, leaf_state = self.compressor.reduce(grad, leaf_state, reduce_op=self.reduce_op,
                                                         axis_name=axis)
            reduced.append(out)
            new_states.append(leaf_state)
        return (jax.tree.unflatten(treedef, reduced),
                SynchronizerState(jax.tree.unflatten(treedef, new_states)))

    def __repr__(self) -> str:
        return (f"AllReduceSynchronizer(compressor={self.compressor!r}, "
                f"reduce_op={self.reduce_op}, axis_name={self.axis_name!r})")


def _is_state(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and hasattr(x, "_fields"))
