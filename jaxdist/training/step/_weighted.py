"""Token-weighted losses and metrics: ``fn(outputs, targets) -> (sum, weight)``.

A loss (or metric) given to the `Trainer` returns either

* a scalar: the MEAN over the batch's rows (every row counts the same), or
* a pair ``(sum, weight)``: the SUM of the per-token (or per-example) values and the weight they
  carry, e.g. the count of real tokens: ``return (losses * mask).sum(), mask.sum()``. Padded or
  masked positions then count for nothing, however they are spread over the batch.

A pair is never averaged per piece: the trainer adds the sums and the weights separately and divides
once. So the mean over a step is ``sum of sums / sum of weights`` over the whole global batch,
whatever its split into replicas or into ``grad_accum_steps`` micro-batches holding different
numbers of real tokens (averaging per-micro-batch means would over-weight the tokens of sparse
ones), and the gradient is that of the same mean. A logged value is the same ratio over its log
window.

The weight is a count, not a function of the parameters: it is not differentiated. A step (or a log
window) whose weight is 0 has no mean (NaN) and contributes a zero gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_value", "mean", "split_value"]

def _describe(value: Any) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return f"a {type(value).__name__}"
    return f"shape {tuple(shape)} {np.dtype(dtype).name}"


def check_value(name: str, value: Any, rows: int | None = None) -> bool:
    """Check what ``name`` (``"loss_fn"`` or ``"metrics['acc']"``) returned; True when it is a pair.
    Only shapes and dtypes are read (arrays and `jax.eval_shape` results alike).

    Args:
        name: how the function is named in errors.
        value: what it returned.
        rows: the batch's row count, for the message.

    Returns:
        True for a ``(sum, weight)`` pair, False for a scalar mean.

    Raises:
        ValueError: for anything else, naming the function, what it returned and the fix.

    Examples:
        >>> import jax.numpy as jnp
        >>> check_value("loss_fn", (jnp.float32(3.0), jnp.int32(4)))
        True
        >>> try:
        ...     check_value("loss_fn", (jnp.float32(3.0), jnp.ones(4)))
        ... except ValueError as error:
        ...     print(str(error).split(";")[0])
        loss_fn returned (sum, weight) with weight of shape (4,) float32
    """
    loss = name == "loss_fn"
    of = f" for a batch of {rows} rows" if rows is not None else ""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"{name} returned a tuple of {len(value)} values{of}; it must return "
                             "a scalar (the mean over the batch) or a pair (sum, weight): e.g. "
                             "return (losses * mask).sum(), mask.sum().")
        total, weight = value
        kind = jnp.inexact if loss else jnp.number
        if (getattr(total, "shape", None) != ()
                or not jnp.issubdtype(getattr(total, "dtype", object), kind)):
            raise ValueError(f"{name} returned (sum, weight) with sum of {_describe(total)}{of}; "
                             f"the sum must be a {'float' if loss else 'numeric'} scalar: the SUM "
                             "over tokens (or rows), e.g. (losses * mask).sum(), not the "
                             "per-token values.")
        dtype = getattr(weight, "dtype", None)
        if (getattr(weight, "shape", None) != () or dtype is None or dtype == jnp.bool_
                or not jnp.issubdtype(dtype, jnp.number)
                or jnp.issubdtype(dtype, jnp.complexfloating)):
            raise ValueError(f"{name} returned (sum, weight) with weight of "
                             f"{_describe(weight)}{of}; the weight must be a real number (an int "
                             "or float scalar): how many tokens (or rows) the sum covers, e.g. "
                             "mask.sum() (not the mask itself, nor a boolean).")
        return True
    dtype = getattr(value, "dtype", None)
    if (getattr(value, "shape", None) != () or dtype is None
            or not jnp.issubdtype(dtype, jnp.inexact if loss else jnp.number)):
        raise ValueError(f"{name} returned {_describe(value)}{of}; it must return a "
                         f"{'float' if loss else 'numeric'} scalar, the mean over the batch: "
                         "reduce it, e.g. optax.softmax_cross_entropy_with_integer_labels(logits, "
                         "y).mean() (or a pair (sum, weight) such as ((losses * mask).sum(), "
                         "mask.sum()) to weight by tokens).")
    return False


def split_value(name: str, value: Any) -> tuple[jax.Array, jax.Array | None]:
    """``(total, weight)`` of a traced result: ``(mean, None)`` for a scalar, ``(sum, weight)`` for
    a pair, the weight a float32 scalar that gradients do not flow through.

    Raises:
        ValueError: as `check_value`.

    Examples:
        >>> import jax.numpy as jnp
        >>> split_value("loss_fn", (jnp.float32(3.0), jnp.int32(4)))
        (Array(3., dtype=float32), Array(4., dtype=float32))
    """
    if check_value(name, value):
        total, weight = value
        return total, jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
    return value, None


def mean(total: jax.Array, weight: jax.Array) -> jax.Array:
    """``total / weight`` in float32; NaN where the weight is 0 (no tokens, no mean).

    Examples:
        >>> import jax.numpy as jnp
        >>> mean(jnp.float32(6.0), jnp.float32(4.0)).item(), mean(0.0, jnp.float32(0.0)).item()
        (1.5, nan)
    """
    total = jnp.asarray(total, jnp.float32)
    return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), jnp.nan)
