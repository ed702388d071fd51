"""Sparse (embedding) gradients: all-gather the touched rows instead of all-reducing the table.

The gradient of an embedding lookup ``table[ids]`` is zero except in the rows ``ids`` touched. A
dense all-reduce sends the whole table; gathering every replica's ``(indices, rows)`` sends
``num_replicas * k * (row_bytes + index_bytes)``, far less when few rows are touched. JAX shapes are
static, so a `SparseRows` has a fixed number ``k`` of rows (one per looked-up id, repeats allowed:
they are summed), exactly what the gradient with respect to the lookup's output gives::

    rows = table[ids]                                  # ids: (batch, seq) int
    row_grads = jax.grad(lambda r: loss_of_rows(r, batch))(rows)
    grad = SparseRows(ids.reshape(-1), row_grads.reshape(-1, dim), num_rows=table.shape[0])

`sparse_all_reduce` picks the all-gather when it moves fewer bytes than the dense all-reduce (the
choice is static: it depends on shapes only) and returns the dense reduced gradient, ready for any
optax optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.gradients.compressors import _check_options, replica_count
from jaxdist.replicate.collectives import all_reduce, to_varying
from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.ops import ReduceOp

__all__ = ["SparseRows", "all_gather_is_cheaper", "is_sparse", "sparse_all_reduce"]

_METHODS = ("auto", "all_gather", "dense")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseRows:
    """A gradient that is zero outside some rows: ``dense[indices[i]] += values[i]`` (TF's
    IndexedSlices).

    Attributes:
        indices: ``(k,)`` integer row ids, repeats allowed (their rows add up).
        values: ``(k, *row_shape)`` the rows' gradients.
        num_rows: the dense table's row count (static).

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> g = jd.gradients.SparseRows(jnp.array([2, 0, 2]), jnp.ones((3, 2)), num_rows=4)
        >>> g.to_dense().tolist()
        [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]]
    """

    indices: jax.Array
    values: jax.Array
    num_rows: int = dataclasses.field(metadata={"static": True})

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The shape of the dense gradient, ``(num_rows, *row_shape)``."""
        return (self.num_rows, *np.shape(self.values)[1:])

    def to_dense(self) -> jax.Array:
        """The dense gradient (rows of repeated indices summed)."""
        values = jnp.asarray(self.values)
        return jnp.zeros(self.dense_shape, values.dtype).at[self.indices].add(values)


def is_sparse(x: Any) -> bool:
    """Whether ``x`` is a `SparseRows` (use as ``is_leaf`` when mapping over gradients).

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> jd.gradients.is_sparse(jd.gradients.SparseRows(jnp.zeros(1, int), jnp.zeros((1, 2)), 3))
        True
    """
    return isinstance(x, SparseRows)


def _check(grad: Any) -> None:
    if not isinstance(grad, SparseRows):
        raise TypeError(f"grad={type(grad).__name__} is not a SparseRows: build one with "
                        "SparseRows(indices, rows, num_rows), or all-reduce dense gradients with "
                        "AllReduceSynchronizer.")
    idx, values = grad.indices, grad.values
    if np.ndim(idx) != 1 or not jnp.issubdtype(jnp.result_type(idx), jnp.integer):
        raise ValueError(
            f"SparseRows.indices has shape {np.shape(idx)} and dtype {jnp.result_type(idx)}: it "
            "must be a 1-D integer array of row ids (flatten the ids: ids.reshape(-1)).")
    if np.ndim(values) < 1 or np.shape(values)[0] != np.shape(idx)[0]:
        raise ValueError(
            f"SparseRows.values has shape {np.shape(values)} for {np.shape(idx)[0]} indices: it "
            "needs one row per index, shape (k, *row_shape) (reshape the row gradients to (-1, "
            "dim)).")
    rows = grad.num_rows
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
        raise ValueError(f"SparseRows.num_rows={grad.num_rows!r} must be a positive int (the "
                         "table's row count).")


def all_gather_is_cheaper(grad: SparseRows, num_replicas: int) -> bool:
    """Whether gathering every replica's rows moves fewer bytes than all-reducing the dense
    gradient: ``num_replicas * k * (row_bytes + index_bytes) < dense_bytes`` (what each replica
    receives and scatters, against the dense table).

    Args:
        grad: this replica's `SparseRows`.
        num_replicas: the replica count.

    Returns:
        True when the all-gather is the cheaper way.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> ids, rows = jnp.zeros(32, jnp.int32), jnp.zeros((32, 64))
        >>> big = jd.gradients.SparseRows(ids, rows, num_rows=10_000)
        >>> small = jd.gradients.SparseRows(ids, rows, num_rows=100)
        >>> jd.gradients.all_gather_is_cheaper(big, 8), jd.gradients.all_gather_is_cheaper(small, 8)
        (True, False)
    """
    _check(grad)
    values = jnp.asarray(grad.values)
    row_bytes = int(np.prod(values.shape[1:], dtype=np.int64)) * values.dtype.itemsize
    index_bytes = jnp.result_type(grad.indices).itemsize
    gathered = num_replicas * values.shape[0] * (row_bytes + index_bytes)
    return gathered < grad.num_rows * row_bytes


def sparse_all_reduce(grad: SparseRows, reduce_op: ReduceOp | str = ReduceOp.MEAN, *,
                      method: str = "auto", axis_name: str = REPLICA_AXIS) -> jax.Array:
    """Reduce a sparse gradient across replicas into the dense reduced gradient.

    Args:
        grad: this replica's `SparseRows`.
        reduce_op: MEAN (default) or SUM.
        method: ``"all_gather"`` (gather every replica's indices and rows, scatter-add locally),
            ``"dense"`` (scatter locally, all-reduce the dense table), or ``"auto"`` (default): the
            all-gather when `all_gather_is_cheaper`.
        axis_name: the mapped axis (``"replica"`` inside ``strategy.run``); unbound: one replica.

    Returns:
        The dense reduced gradient, shape ``grad.dense_shape``, identical on every replica.

    Raises:
        TypeError: when ``grad`` is not a `SparseRows`.
        ValueError: for malformed indices / values, an unknown ``method`` or ``reduce_op``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> ids = strategy.experimental_distribute_values(jnp.arange(8) % 3)   # one id per replica
        >>> def replica_fn(ids):
        ...     grad = jd.gradients.SparseRows(ids, jnp.ones((1, 2)), num_rows=1000)
        ...     return jd.gradients.sparse_all_reduce(grad, "sum")
        >>> strategy.run(replica_fn, args=(ids,))[:4].tolist()
        [[3.0, 3.0], [3.0, 3.0], [2.0, 2.0], [0.0, 0.0]]
    """
    op = _check_options(reduce_op, axis_name)
    _check(grad)
    if method not in _METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(map(repr, _METHODS))}.")
    n = replica_count(axis_name)
    if n is None:
        return grad.to_dense()
    if method == "auto":
        method = "all_gather" if all_gather_is_cheaper(grad, n) else "dense"
    if method == "dense":
        return all_reduce(grad.to_dense(), op, axis_name)

    def gather(x):
        return jax.lax.all_gather(to_varying(jnp.asarray(x), axis_name), axis_name, axis=0,
                                  tiled=True, to="invarying")

    dense = SparseRows(gather(grad.indices), gather(grad.values), grad.num_rows).to_dense()
    return dense / n if op is ReduceOp.MEAN else dense
