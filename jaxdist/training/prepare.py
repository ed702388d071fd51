"""`prepare`: keep your own training loop, run it on a strategy (Accelerate's ``prepare``, for JAX).

One call wraps what your loop already has: the step is compiled with ``strategy.jit`` (state
donated, so it is updated in place; the batch argument declared with ``batch_argnums``), the state
is placed in the strategy's layout, and each dataset becomes a distributed dataset of global batches
split over the replicas. The loop itself does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jaxdist.strategies import DistributedDataset, Strategy, StrategyFunction

__all__ = ["prepare"]


def prepare(strategy: Strategy, train_step: Callable[..., Any], state: Any,
            *datasets: Iterable[Any], donate: bool = True,
            batch_argnums: int | Sequence[int] = (1,)) -> tuple[Any, ...]:
    """Wrap an own-loop ``train_step``, its state and its data for ``strategy``.

    Args:
        strategy: the strategy to run on.
        train_step: an ordinary single-device ``train_step(state, batch, ...) -> (state, ...)``.
        state: the state pytree (e.g. ``(params, opt_state)``) as numpy or jax arrays; placed in the
            strategy's variable layout (to build a large state directly on the devices instead, use
            ``strategy.create_variables(init_fn, ...)`` and pass its result).
        *datasets: iterables of GLOBAL batches (any number, e.g. train and eval).
        donate: let the step reuse the state's buffers (``donate_argnums=(0,)``); set False if you
            keep references to old states.
        batch_argnums: which of the step's positional arguments are batches, passed to
            ``strategy.jit`` (default ``(1,)``: ``train_step(state, batch)``): host arrays there are
            split over the replicas too, so a batch you pass without the distributed datasets is
            still data parallel. Other unplaced arguments take the strategy's variable layout.
            ``()`` declares that there is none.

    Returns:
        ``(step, state, *distributed_datasets)``.

    Raises:
        TypeError: when ``strategy`` is not a jaxdist strategy, ``train_step`` is not callable, a
            dataset is not iterable, or ``batch_argnums`` is not an int or a tuple of ints (from
            ``strategy.jit``).

    Examples:
        >>> import jax, numpy as np, jaxdist as jd
        >>> def train_step(w, batch):
        ...     x, y = batch
        ...     loss, g = jax.value_and_grad(lambda w: ((x @ w - y) ** 2).mean())(w)
        ...     return w - 0.1 * g, loss
        >>> data = [(np.ones((8, 2), np.float32), np.ones(8, np.float32))] * 20
        >>> step, w, data = jd.training.prepare(jd.MirroredStrategy(), train_step,
        ...                                     np.zeros(2, np.float32), data)
        >>> for batch in data:
        ...     w, loss = step(w, batch)
        >>> round(float(loss), 4)
        0.0
    """
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy={strategy!r} is not a jaxdist strategy: pass e.g. "
                        "jd.MirroredStrategy().")
    if not callable(train_step):
        raise TypeError(f"train_step={train_step!r} is not callable: pass train_step(state, batch) "
                        "-> (state, ...).")
    step: StrategyFunction = strategy.jit(train_step, donate_argnums=(0,) if donate else None,
                                          batch_argnums=batch_argnums)
    placed = strategy.mirror(state)
    distributed: list[DistributedDataset] = [strategy.experimental_distribute_dataset(d)
                                             for d in datasets]
    return (step, placed, *distributed)
