"""The trainer's steps compiled for a strategy: training (one step, or an on-device loop), evaluation, prediction.

Evaluation and prediction pad a ragged batch to a multiple of the replica count and mask the padding out
(`eval_batches`), so their results cover every example exactly once.

Every compiled step declares its batch arguments (``batch_argnums``): host batches are split over the
replicas, the state keeps the strategy's variable layout. Training steps also add their metrics to running
sums, one small float32 vector on the devices (`add_to_sums`): the fit loop reads that vector at a log point
instead of every step's scalars, so logging costs no work and no transfer per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxdist.strategies import Strategy
from jaxdist.training.data import eval_batches
from jaxdist.training.step import (
    TrainState,
    add_to_sums,
    make_eval_step,
    make_loop_step,
    make_predict_step,
    make_train_step,
    metric_names,
)

__all__ = ["CompiledSteps"]


class CompiledSteps:
    """One model's train, evaluation and prediction steps, compiled for ``strategy``, with running sums.

    Args:
        strategy: the strategy to compile for.
        model: the `LinenModel` / `NnxModel` adapter.
        optimizer: the optax transformation (clipping chained in).
        loss_fn / metrics / grad_accum_steps / compute_dtype: as for `make_train_step`.

    Example:
        >>> import jax, numpy as np, optax, flax.linen as nn, jaxdist as jd
        >>> from jaxdist.training.build import state_builder
        >>> from jaxdist.training.models import LinenModel
        >>> strategy, model = jd.MirroredStrategy(), LinenModel(nn.Dense(1))
        >>> steps = CompiledSteps(strategy, model, optax.sgd(0.1), lambda out, y: ((out[:, 0] - y) ** 2).mean())
        >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
        >>> build, args = state_builder(model, optax.sgd(0.1), 0, batch[0])
        >>> state = strategy.create_variables(build, *args)
        >>> state, metrics = steps.train(state, batch)
        >>> names, sums = steps.pop_sums(state)
        >>> names, sums.shape
        (('loss', 'steps'), (2,))
    """

    def __init__(
        self,
        strategy: Strategy,
        model: Any,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable,
        metrics: Mapping[str, Callable] | None = None,
        grad_accum_steps: int = 1,
        compute_dtype: Any = None,
    ):
        self.strategy = strategy
        self.metrics = dict(metrics or {})
        self.train_step = make_train_step(model, optimizer, loss_fn, metrics, grad_accum_steps, compute_dtype)
        self.eval_step = strategy.jit(make_eval_step(model, loss_fn, metrics, compute_dtype), batch_argnums=(1, 2))
        self.predict_step = strategy.jit(make_predict_step(model, compute_dtype), batch_argnums=(1,))
        # Built with the first state (they need the metric names, which depend on the optimizer state).
        self.fit_step: Callable | None = None  # (state, batch, sums) -> (state, metrics, sums)
        self._loop_step: Callable | None = None
        self._names: tuple[str, ...] = ()
        self._sums: Any = None  # running sums since pop_sums (a device vector; None: zeros)

    def _build(self, state: TrainState) -> None:
        if self.fit_step is not None:
            return
        names = (*metric_names(self.metrics, state.opt_state), "steps")
        train_step = self.train_step

        def fit_step(state, batch, sums):
            state, metrics = train_step(state, batch)
            return state, metrics, add_to_sums(sums, metrics, names)

        self.fit_step = self.strategy.jit(fit_step, donate_argnums=(0, 2), batch_argnums=(1,))
        self._loop_step = make_loop_step(train_step, names)
        self._names = names

    def _current_sums(self) -> Any:
        return np.zeros(len(self._names), np.float32) if self._sums is None else self._sums

    def train(self, state: TrainState, pair: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One compiled step on the batch ``pair = (x, y)`` (the state is donated); adds to the sums."""
        self._build(state)
        state, metrics, self._sums = self.fit_step(state, pair, self._current_sums())
        return state, metrics

    def train_loop(self, state: TrainState, pairs: Sequence[Any]) -> tuple[TrainState, dict[str, jax.Array]]:
        """``len(pairs)`` steps in one on-device loop (the state is donated); adds to the sums.

        Returns:
            The new state and every step's metrics, stacked: ``{name: array (len(pairs),)}``.
        """
        self._build(state)
        n = len(pairs)
        values = {name: np.zeros(n, np.float32) for name in self._names if name != "steps"}
        ctx = self.strategy.run_steps_on_dataset(self._loop_step, iter(pairs), iterations=n,
                                                 initial_loop_values=(state, values, np.int32(0),
                                                                      self._current_sums()),
                                                 donate=True)
        state, values, _, self._sums = ctx.loop_values
        return state, values

    def pop_sums(self, state: TrainState) -> tuple[tuple[str, ...], Any]:
        """``(names, sums)`` since the last call (see ``Trainer.pop_metric_sums``); restarts them."""
        self._build(state)
        sums, self._sums = self._current_sums(), None
        return self._names, sums

    def evaluate(self, state_for: Callable[[Any], TrainState], data: Any, split: Callable) -> dict[str, float]:
        """Each metric's mean over every example of ``data`` (see ``Trainer.evaluate``).

        ``state_for(batch)`` gives the state (built from the first batch if needed); ``split(batch, where)``
        returns a batch's ``(x, y)``.
        """
        sums, count = {}, 0.0
        source = ((b, w) for b, w, _ in eval_batches(data, self.strategy.num_replicas_in_sync, "eval_data", split))
        for batch, weights in self.strategy.experimental_distribute_dataset(source):
            batch_sums, batch_count = jax.device_get(self.eval_step(state_for(batch), batch, weights))
            for k, v in batch_sums.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += float(batch_count)
        if count == 0:
            raise ValueError("evaluate got no examples: pass at least one batch.")
        return {k: v / count for k, v in sums.items()}

    def predict(self, state_for: Callable[[Any], TrainState], data: Any, split: Callable) -> Any:
        """The outputs for every example of ``data``, as numpy arrays (see ``Trainer.predict``)."""
        if isinstance(data, (np.ndarray, jax.Array)):
            data = [data]  # one array: one batch (not an iterable of rows)

        def inputs(batch: Any, where: str) -> Any:
            return split(batch, where, need_targets=False)[0]

        outputs = []
        source = ((x, w) for x, w, _ in eval_batches(data, self.strategy.num_replicas_in_sync, "data", inputs))
        for x, weights in self.strategy.experimental_distribute_dataset(source):
            keep, out = np.asarray(weights) > 0, self.predict_step(state_for(x), x)
            outputs.append(jax.tree.map(lambda a, keep=keep: np.asarray(a)[keep], out))
        if not outputs:
            raise ValueError("predict got no batches: pass at least one.")
        return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)
