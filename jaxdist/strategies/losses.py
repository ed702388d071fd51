"""Loss scaling for custom training loops: ``jd.compute_average_loss`` and
``jd.scale_regularization_loss``, tf.nn's two helpers with the same semantics in both views a step
can have (per replica inside ``strategy.run``, global elsewhere). The replica count is read from
the replica context, never passed by hand.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.strategies.context import get_replica_context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _replicas_in_sync() -> int:
    """Replicas whose losses are summed after this call: >1 only inside ``strategy.run``."""
    ctx = get_replica_context()  # None: cross-replica code, the global view
    return 1 if ctx is None else ctx.num_replicas_in_sync


def _batch_size(global_batch_size: Any) -> int:
    """``global_batch_size`` as a positive Python int, else a ValueError naming it."""
    try:
        if isinstance(global_batch_size, (bool, np.bool_)):
            raise TypeError
        size = operator.index(global_batch_size)
    except TypeError:  # also a traced int (TracerIntegerConversionError)
        hint = ""
        # tf's positional order is (loss, sample_weight, global_batch_size)
        if np.ndim(global_batch_size) > 0:
            hint = " It looks like sample weights: pass them by name, sample_weight=..."
        raise ValueError(
            f"global_batch_size={global_batch_size!r} (type {type(global_batch_size).__name__}) "
            "must be a positive Python int (the number of examples in the global batch), or None "
            f"for the default.{hint}"
        ) from None
    if size <= 0:
        raise ValueError(f"global_batch_size={size} must be positive: the number of examples in "
                         "the global batch, or None for the default (this replica's batch times "
                         "num_replicas_in_sync).")
    return size


def _weights(sample_weight: Any, shape: tuple[int, ...]) -> jax.Array:
    """``sample_weight`` reshaped as tf.nn does (one trailing axis squeezed or added), checked to
    broadcast to the loss's ``shape`` without changing it."""
    weight = jnp.asarray(sample_weight)
    if weight.ndim == len(shape) + 1 and weight.shape[-1] == 1:
        weight = weight[..., 0]  # (batch, 1) weights for (batch,) losses
    elif weight.ndim == len(shape) - 1:
        weight = weight[..., None]  # per-example weights (batch,) for (batch, time) losses
    try:
        ok = np.broadcast_shapes(weight.shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"sample_weight has shape {tuple(jnp.shape(sample_weight))}, which does "
                         f"not broadcast to per_example_loss's shape {shape}: pass one weight per "
                         f"example (shape {shape[:1]}), a scalar, or an array of the loss's shape.")
    return weight


def compute_average_loss(per_example_loss: Any, global_batch_size: int | None = None,
                         sample_weight: Any = None) -> jax.Array:
    """``sum(per_example_loss * sample_weight) / global_batch_size`` (tf.nn.compute_average_loss).

    Inside ``strategy.run`` the default global batch is this replica's batch
    (``per_example_loss.shape[0]``) times ``num_replicas_in_sync``, so
    ``ctx.all_reduce(jd.ReduceOp.SUM, ...)`` of the replicas' results (and of their gradients) is
    the mean over the global batch, as one device computes it. In the global view (inside
    ``strategy.jit``, in cross-replica code, or with no strategy) the step already sees the global
    batch and the default is ``per_example_loss.shape[0]``: the plain mean.

    Args:
        per_example_loss: the unreduced loss, shape ``(batch, ...)``; every element is summed, then
            divided by the batch size (a ``(batch, time)`` loss gives the mean over examples of the
            summed time steps).
        global_batch_size: the number of examples in the global batch (a positive int); None: the
            default above. Pass it when the last batch is smaller, or when padding rows carry zero
            weight. A batch a distributed dataset padded (``remainder="pad"``) needs neither: inside
            ``strategy.run`` its padding rows are left out and the default is the real rows of the
            global batch.
        sample_weight: a weight per example (shape ``(batch,)`` or ``(batch, 1)``), a scalar, or an
            array broadcastable to the loss's shape. Note tf.nn's positional order is
            ``(per_example_loss, sample_weight, global_batch_size)``: pass both by name.

    Returns:
        The scalar loss, in ``per_example_loss``'s dtype.

    Raises:
        ValueError: for a scalar ``per_example_loss`` (already reduced), a ``sample_weight`` that
            does not broadcast to it, or a ``global_batch_size`` that is not a positive int.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> float(jd.compute_average_loss(jnp.array([1.0, 2.0, 3.0, 6.0])))
        3.0
        >>> loss, weight = jnp.array([1.0, 2.0]), jnp.array([1.0, 3.0])
        >>> float(jd.compute_average_loss(loss, global_batch_size=4, sample_weight=weight))
        1.75
    """
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ValueError(
            "per_example_loss has shape () (a scalar, already reduced): compute_average_loss "
            "averages per-example losses; pass the unreduced loss of shape (batch, ...), e.g. "
            "optax.softmax_cross_entropy_with_integer_labels(logits, labels) without .mean()."
        )
    if sample_weight is not None:
        weighted = loss * _weights(sample_weight, loss.shape)
        # tf multiplies in float32 and casts back: a bf16 loss stays bf16.
        loss = weighted.astype(loss.dtype) if jnp.issubdtype(loss.dtype, jnp.inexact) else weighted
    ctx = get_replica_context()
    padded = getattr(ctx, "batch_weights", None)  # a padded batch: its padding rows left out
    if padded is not None and padded.shape[0] == loss.shape[0]:
        loss = loss * padded.reshape((-1,) + (1,) * (loss.ndim - 1)).astype(loss.dtype)
        if global_batch_size is None:
            return jnp.sum(loss) / ctx.all_reduce("sum", jnp.sum(padded)).astype(loss.dtype)
    size = (loss.shape[0] * _replicas_in_sync() if global_batch_size is None
            else _batch_size(global_batch_size))
    return jnp.sum(loss) / size


def scale_regularization_loss(regularization_loss: Any) -> jax.Array:
    """The summed regularization loss divided by ``num_replicas_in_sync`` (tf.nn's).

    Inside ``strategy.run`` every replica adds the same regularization term to its loss, and the
    replicas' losses are summed (``ctx.all_reduce(SUM, ...)``): dividing by the replica count makes
    the sum count it once. In the global view (``strategy.jit``, cross-replica code, no strategy) it
    is returned summed but unscaled.

    Args:
        regularization_loss: an array, or a pytree (list, dict) of arrays (e.g. one L2 term per
            layer); every element of every leaf is summed.

    Returns:
        The scalar, summed and scaled.

    Raises:
        ValueError: when ``regularization_loss`` holds no array.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> float(jd.scale_regularization_loss([jnp.float32(0.5), jnp.array([1.0, 2.0])]))
        3.5
    """
    leaves = jax.tree.leaves(regularization_loss)
    if not leaves:
        raise ValueError(f"regularization_loss={regularization_loss!r} holds no array: pass the "
                         "regularization term(s), e.g. 1e-4 * sum(jnp.sum(w ** 2) for w in "
                         "jax.tree.leaves(params)).")
    total = sum(jnp.sum(jnp.asarray(leaf)) for leaf in leaves)
    return total / _replicas_in_sync()
