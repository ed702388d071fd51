"""The trainer's steps compiled for a strategy: training (one step, or an on-device loop),
evaluation, prediction.

Evaluation and prediction pad a ragged batch to a multiple of the replica count and mask the padding
out (`eval_batches`), so their results cover every example exactly once. Training steps add their
metrics to the running sums (`jaxdist.training.step.RunningSums`), which stay on the devices: the
fit loop reads them at a log point, so logging costs no work and no transfer per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxdist.costs import bytes_per_device
from jaxdist.costs.step import CostOptions, StepCost
from jaxdist.replicate.layouts import put
from jaxdist.strategies import Plan, Strategy
from jaxdist.strategies.layout import untyped
from jaxdist.training.data import eval_batches
from jaxdist.training.step._build import check_losses
from jaxdist.training.step._functions import (
    TrainState,
    layer_metric_names,
    make_eval_step,
    make_loop_step,
    make_predict_step,
    make_summed_train_step,
    zero_sums,
)
from jaxdist.training.step._running import PackedSums, RunningSums

__all__ = ["CompiledSteps"]


class CompiledSteps:
    """One model's train, evaluation and prediction steps, compiled for ``strategy``, with sums.

    Args:
        strategy: the strategy to compile for.
        model: the `LinenModel` / `NnxModel` adapter.
        optimizer: the optax transformation (clipping chained in).
        loss_fn / metrics / grad_accum_steps / compute_dtype: as for `make_train_step`.
        ema_decay: the averaged weights' decay (`make_summed_train_step`; the states must carry
            ``ema``, `jaxdist.training.step._ema.with_ema`), or None.

    Examples:
        >>> import jax, numpy as np, optax, flax.linen as nn, jaxdist as jd
        >>> from jaxdist.training.step._build import state_builder
        >>> from jaxdist.training.step._models import LinenModel
        >>> strategy, model = jd.MirroredStrategy(), LinenModel(nn.Dense(1))
        >>> steps = CompiledSteps(strategy, model, optax.sgd(0.1),
        ...                       lambda out, y: ((out[:, 0] - y) ** 2).mean())
        >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
        >>> build, args = state_builder(model, optax.sgd(0.1), 0, batch[0])
        >>> state = strategy.create_variables(build, *args)
        >>> state, metrics = steps.train(state, batch)
        >>> sums = steps.pop_sums(state).to_host()
        >>> sums.names, int(sums.steps), int(sums.non_finite.count)
        (('loss',), 1, 0)
    """

    def __init__(self, strategy: Strategy, model: Any, optimizer: optax.GradientTransformation,
                 loss_fn: Callable, metrics: Mapping[str, Callable] | None = None,
                 grad_accum_steps: int = 1, compute_dtype: Any = None,
                 ema_decay: float | None = None):
        self.strategy = strategy
        self.metrics = dict(metrics or {})
        self._model, self._loss_fn, self._compute_dtype = model, loss_fn, compute_dtype
        self.grad_accum_steps = grad_accum_steps
        self.train_step = make_summed_train_step(model, optimizer, loss_fn, metrics,
                                                 grad_accum_steps, compute_dtype,
                                                 ema_decay=ema_decay)
        # fit(on_non_finite="skip") trains with this variant, built lazily
        self._skipping_step = lambda: make_summed_train_step(
            model, optimizer, loss_fn, metrics, grad_accum_steps, compute_dtype,
            skip_non_finite=True, ema_decay=ema_decay)
        self.skip_non_finite = False  # which of the two the training calls run (set by fit)
        self.eval_step = strategy.jit(make_eval_step(model, loss_fn, metrics, compute_dtype),
                                      batch_argnums=(1, 2))
        self.predict_step = strategy.jit(make_predict_step(model, compute_dtype),
                                         batch_argnums=(1,))
        # Which of "loss" and the metrics return (sum, weight) pairs (from the first batch if unset)
        self.weighted: frozenset[str] | None = None
        # per skip_non_finite, (fit_step, loop body): built with the first state (the metric names
        # depend on the optimizer state)
        self._fit_steps: dict[bool, tuple[Callable, Callable]] = {}
        self._zero: PackedSums | None = None  # the running sums of no steps, on the host
        self._metrics_out: tuple[str, ...] = ()  # the step's metrics dict's
        # The running sums since pop_sums: the packed vector alone, on the devices (`_zero` knows
        # its structure); None: zeros.
        self._sums: jax.Array | None = None
        # The sums of a new window, placed once and passed to every step that starts one (the fit
        # step does not donate its sums: a few bytes, against ~0.1 ms to place zeros each time).
        self._zeros: jax.Array | None = None
        self._cost: StepCost | None = None

    @property
    def fit_step(self) -> Callable | None:
        """The compiled ``(state, batch, sums) -> (state, metrics, sums)`` training runs now (None
        before the first training batch)."""
        steps = self._fit_steps.get(self.skip_non_finite)
        return None if steps is None else steps[0]

    @property
    def _loop_step(self) -> Callable | None:
        steps = self._fit_steps.get(self.skip_non_finite)
        return None if steps is None else steps[1]

    def _build(self, state: TrainState, pair: Any = None) -> bool:
        """Build the fit step; False when it cannot be yet (no batch: the loss's form unknown)."""
        if self.fit_step is not None:
            return True
        if self._zero is not None:  # the other variant is built: same sums
            self._compile(self._skipping_step() if self.skip_non_finite else self.train_step)
            return True
        if pair is None:
            return False
        # Shapes only, outside any program: on the strategy's mesh, as strategy.jit traces the step.
        with self.strategy.policy.shape_scope():
            if self.weighted is None:
                self.weighted = check_losses(self._model, self._loss_fn, self.metrics,
                                             untyped(state), *pair)
            # the metrics the model's own layers add (MoE): token-weighted where the loss is
            extra = layer_metric_names(self._model,
                                       *untyped((state.params, state.model_state, pair[0])))
        weighted = self.weighted | (frozenset(extra) if "loss" in self.weighted else frozenset())
        zero = zero_sums((*self.metrics, *extra), state.opt_state, weighted)
        self._zero = zero.pack()
        self._metrics_out = (*zero.names, *(("learning_rate",) if zero.learning_rate is not None
                                            else ()))
        self._compile(self._skipping_step() if self.skip_non_finite else self.train_step)
        return True

    def _compile(self, train_step: Callable) -> None:
        like = self._zero

        def fit_step(state, batch, sums):
            state, metrics, addends = train_step(state, batch)
            return state, metrics, like.holding(sums).unpack().then(addends).pack().vector

        fit_step = self.strategy.jit(fit_step, donate_argnums=(0,), batch_argnums=(1,))
        self._fit_steps[self.skip_non_finite] = (fit_step, make_loop_step(train_step, like))

    def _current_sums(self) -> Any:
        """The sums' vector: the running one, or zeros (laid out as the last one was)."""
        if self._sums is not None:
            return self._sums
        zeros = self._zeros
        if zeros is not None and zeros.shape == self._zero.vector.shape:
            if zeros.is_deleted():  # an on-device loop donated them: placed again
                zeros = self._zeros = put(self._zero.vector, zeros.sharding)
            return zeros
        return self._zero.vector

    def train(self, state: TrainState, pair: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One compiled step on ``pair = (x, y)`` (the state is donated); adds to the sums."""
        if self.fit_step is None:
            self._build(state, pair)
        state, metrics, self._sums = self.fit_step(state, pair, self._current_sums())
        return state, metrics

    def train_loop(self, state: TrainState,
                   pairs: Sequence[Any]) -> tuple[TrainState, dict[str, jax.Array]]:
        """``len(pairs)`` steps in one on-device loop (the state is donated); adds to the sums.

        Returns:
            The new state and every step's metrics, stacked: ``{name: array (len(pairs),)}``.
        """
        self._build(state, pairs[0])
        n = len(pairs)
        values = {name: np.zeros(n, np.float32) for name in self._metrics_out}
        ctx = self.strategy.run_steps_on_dataset(self._loop_step, iter(pairs), iterations=n,
                                                 initial_loop_values=(state, values, np.int32(0),
                                                                      self._current_sums()),
                                                 donate=True)
        state, values, _, self._sums = ctx.loop_values
        return state, values

    def plan(self, state: TrainState, pair: Any) -> Plan:
        """The fit step's `jd.Plan` for ``state`` and the batch ``pair = (x, y)`` (arrays or
        abstract arrays): compiled for the strategy's layout, never run (see ``Trainer.plan``)."""
        self._build(state, pair)
        return self.fit_step.plan(state, pair, self._current_sums())

    def pop_sums(self, state: TrainState) -> PackedSums:
        """The running sums since the last call (``Trainer.pop_running_sums``); restarts them."""
        sums = self.peek_sums(state)
        self._sums = None
        vector = sums.vector
        if isinstance(vector, jax.Array) and (self._zeros is None
                                              or self._zeros.shape != vector.shape):
            # placed from the host, not built by a program of its own: one compile less per fit
            self._zeros = put(self._zero.vector, vector.sharding)
        return sums

    def peek_sums(self, state: TrainState) -> PackedSums:
        """The running sums since the last `pop_sums`, which go on."""
        if not self._build(state):  # no training batch seen yet: no steps to sum
            return RunningSums.zeros(()).pack()
        return self._zero.holding(self._current_sums())

    def step_cost(self, state: TrainState, batch_signature: tuple,
                  options: CostOptions) -> StepCost:
        """What the compiled train step costs, read once from its `Plan` (after a training step).

        Args:
            state: the current state (only its shapes, dtypes and layout are read).
            batch_signature: the training batches' `jaxdist.training.data._checks.signature`.
            options: the `CostOptions`.
        """
        if self._cost is not None:
            return self._cost
        strategy = self.strategy
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            state)
        batch = _abstract_batch(batch_signature, strategy.policy.batch_layout)
        sums = jax.ShapeDtypeStruct(self._zero.vector.shape, np.float32)
        sums = jax.ShapeDtypeStruct(sums.shape, sums.dtype,
                                    sharding=strategy.variable_shardings(sums))
        # The arguments the step ran with, abstractly: JAX's caches hand back its program.
        rows = jax.tree.leaves(batch)[0].shape[0]
        devices = tuple(strategy.mesh.devices.flat)
        local = tuple(d for d in devices if d.process_index == jax.process_index())
        try:
            # the accumulation loop counted per micro-batch
            plan, why = self.fit_step.plan(like, batch, sums), ""
        except Exception as error:
            # a backend without program text or memory analysis: FLOPs n/a, not a failed fit
            first = (str(error).splitlines() or [""])[0][:200]
            plan, why = None, f"the step could not be planned: {type(error).__name__}: {first}"
        roles = {k: bytes_per_device(getattr(like, k))
                 for k in ("params", "opt_state", "model_state")}
        self._cost = StepCost.of_plan(plan, options=options, devices=devices, local_devices=local,
                                      rows_per_step=rows, state_bytes=roles, why=why)
        return self._cost

    def evaluate(self, state_for: Callable[[Any], TrainState], data: Any,
                 split: Callable) -> dict[str, float]:
        """Each metric's mean over every example of ``data`` (see ``Trainer.evaluate``).

        ``state_for(batch)`` gives the state (built from the first batch if needed); ``split(batch,
        where)`` returns a batch's ``(x, y)``.
        """
        sums, counts, examples = {}, {}, 0.0
        labels: list[int] = []  # the smallest and largest integer target seen (host side, free)

        def source() -> Any:
            for b, w, _ in eval_batches(data, self.strategy.num_replicas_in_sync, "eval_data",
                                        split):
                ints = [np.asarray(a) for a in jax.tree.leaves(b[1])
                        if np.issubdtype(np.asarray(a).dtype, np.integer)]
                if ints and all(a.size for a in ints):
                    seen = [int(a.min()) for a in ints] + [int(a.max()) for a in ints] + labels
                    labels[:] = [min(seen), max(seen)]
                yield b, w

        first = None
        for batch, weights in self.strategy.experimental_distribute_dataset(source()):
            first = batch if first is None else first
            batch_sums, batch_counts, rows = jax.device_get(self.eval_step(state_for(batch), batch,
                                                                           weights))
            for k, v in batch_sums.items():
                sums[k] = sums.get(k, 0.0) + float(v)
                counts[k] = counts.get(k, 0.0) + float(batch_counts[k])
            examples += float(rows)
        if examples == 0:
            raise ValueError("evaluate got no examples: pass at least one batch.")
        result = {k: v / counts[k] if counts[k] else float("nan") for k, v in sums.items()}
        if labels and not all(np.isfinite(v) for v in result.values()):
            self._check_labels(state_for(first), first, labels, result)
        return result

    def _check_labels(self, state: TrainState, batch: Any, labels: list[int],
                      result: dict[str, float]) -> None:
        """A non-finite evaluation with integer targets: raise when they are outside the classes."""
        outputs = jax.tree.leaves(self.predict_step(state, batch[0]))
        classes = np.shape(outputs[0])[-1] if outputs and np.ndim(outputs[0]) >= 2 else None
        if classes is None or (0 <= labels[0] and labels[1] < classes):
            return
        raise ValueError(
            f"evaluate's results are not finite ({result}): eval_data's integer labels run from "
            f"{labels[0]} to {labels[1]}, but the model's outputs have {classes} classes (their "
            f"last axis), so labels outside [0, {classes}) make the loss NaN. Fix the labels (or "
            "the model's number of outputs).")

    def predict(self, state_for: Callable[[Any], TrainState], data: Any, split: Callable) -> Any:
        """The outputs for every example of ``data``, as numpy arrays (see ``Trainer.predict``)."""
        if isinstance(data, (np.ndarray, jax.Array)):
            data = [data]  # one array: one batch (not an iterable of rows)

        def inputs(batch: Any, where: str) -> Any:
            return split(batch, where, need_targets=False)[0]

        outputs = []
        source = ((x, w) for x, w, _ in eval_batches(data, self.strategy.num_replicas_in_sync,
                                                     "data", inputs))
        for x, weights in self.strategy.experimental_distribute_dataset(source):
            keep, out = np.asarray(weights) > 0, self.predict_step(state_for(x), x)
            outputs.append(jax.tree.map(lambda a, keep=keep: np.asarray(a)[keep], out))
        if not outputs:
            raise ValueError("predict got no batches: pass at least one.")
        return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)


def _abstract_batch(signature: tuple, layout: Any) -> Any:
    """The batch a `jaxdist.training.data._checks.signature` describes, as abstract arrays laid out
    by ``layout`` (`LayoutPolicy.batch_layout`)."""
    treedef, leaves = signature
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(dtype),
                             sharding=layout(len(shape), tuple(shape)))
        for shape, dtype in leaves
    ])
