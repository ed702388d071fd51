"""What a `Trainer` trains: the state in the strategy's layout, its step counter and data position,
built from the first batch, and the compiled steps that advance it (`LiveState`).

The ``Trainer`` is a facade over one `LiveState`: its steps, evaluation, prediction and plans are
the methods here; `jaxdist.training.checkpoints` saves, restores and loads it, and
`jaxdist.training.loop` runs a fit on it. The settings that build it are checked here, at the
Trainer's construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist.costs.step import CostOptions, StepCost
from jaxdist.strategies import Plan, Strategy
from jaxdist.strategies.plan import abstract_variables
from jaxdist.training.data import BatchChecker, BatchFeed, DataPosition, TrainBatch, check_key
from jaxdist.training.step._build import restore_target, state_builder
from jaxdist.training.step._compiled import CompiledSteps
from jaxdist.training.step._ema import averaged, check_ema_decay, with_ema
from jaxdist.training.step._functions import TrainState
from jaxdist.training.step._models import as_model
from jaxdist.training.step._running import PackedSums

__all__ = ["LiveState", "abstract_state", "check_int"]


def check_int(value: Any, name: str, minimum: int, allow_none: bool = True) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is an int >= ``minimum`` (or allowed
    None).

    Examples:
        >>> check_int(None, "eval_every", 1)
        >>> check_int(0, "log_every", 1, allow_none=False)
        Traceback (most recent call last):
        ValueError: log_every=0 must be an int >= 1.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= "
                         f"{minimum}{' or None' if allow_none else ''}.")


def abstract_state(state: Any) -> Any:
    """``state`` as `jax.ShapeDtypeStruct`s with its shardings (what a restore or a plan reads)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)


def _check_settings(strategy: Any, optimizer: Any, loss_fn: Any, metrics: Mapping,
                    grad_accum_steps: Any, seed: Any, clip_grad_norm: Any,
                    compute_dtype: Any) -> None:
    """The Trainer's arguments that build the state, checked before anything is built."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy={strategy!r} is not a jaxdist strategy: pass e.g. "
                        "jd.MirroredStrategy() or jd.OneDeviceStrategy().")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"optimizer={optimizer!r} is not an optax GradientTransformation: pass "
                        "e.g. optax.adam(1e-3).")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable: pass loss_fn(outputs, targets) -> "
                        "scalar mean or (sum, weight).")
    for name, fn in metrics.items():
        if name == "loss" or not isinstance(name, str) or not callable(fn):
            raise ValueError(f"metrics[{name!r}]={fn!r}: metrics map names other than 'loss' to "
                             "fn(outputs, targets) -> scalar (the loss is always reported as "
                             "'loss').")
    check_int(grad_accum_steps, "grad_accum_steps", 1, allow_none=False)
    check_int(seed, "seed", 0, allow_none=False)
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float))
                                           and clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be a positive number or None.")
    if compute_dtype is not None and not jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating):
        raise ValueError(f"compute_dtype={compute_dtype!r} must be a floating dtype such as "
                         "jnp.bfloat16.")


class LiveState:
    """A Trainer's state (`TrainState`, None before its first batch), step counter and data
    position, with what builds and advances them: the model adapter, the optimizer (clipping chained
    in), the batch checks and feeds, the compiled steps (`CompiledSteps`).

    Args: as ``Trainer``'s of the same names (checked here).

    Raises:
        TypeError / ValueError: as ``Trainer``.

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> live = LiveState(jd.OneDeviceStrategy(), nn.Dense(1), optax.sgd(0.1),
        ...                  lambda out, y: ((out[:, 0] - y) ** 2).mean())
        >>> _ = live.train((np.ones((4, 2), np.float32), np.ones(4, np.float32)), "a batch")
        >>> live.step, live.position
        (1, DataPosition(epoch=0, index=0))
    """

    def __init__(self, strategy: Strategy, model: Any, optimizer: optax.GradientTransformation,
                 loss_fn: Callable, *, metrics: Mapping[str, Callable] | None = None,
                 input_key: Any = "x", target_key: Any = "y", variables: Any = None,
                 grad_accum_steps: int = 1, compute_dtype: Any = None,
                 clip_grad_norm: float | None = None, seed: int = 0,
                 train_kwargs: dict | None = None, eval_kwargs: dict | None = None,
                 rng_streams: Sequence[str] | None = None,
                 ema_decay: float | None = None):
        metrics = dict(metrics or {})
        _check_settings(strategy, optimizer, loss_fn, metrics, grad_accum_steps, seed,
                        clip_grad_norm, compute_dtype)
        self.ema_decay = check_ema_decay(ema_decay)
        self.input_key, self.target_key = (check_key(input_key, "input_key"),
                                           check_key(target_key, "target_key"))
        self.strategy, self.loss_fn, self.metrics, self.seed = strategy, loss_fn, metrics, seed
        self.model = as_model(model, variables, train_kwargs=train_kwargs, eval_kwargs=eval_kwargs,
                              rng_streams=tuple(rng_streams) if rng_streams is not None else None)
        self.optimizer = (optax.chain(optax.clip_by_global_norm(clip_grad_norm), optimizer)
                          if clip_grad_norm else optimizer)
        self.batches = BatchChecker(strategy.num_replicas_in_sync, grad_accum_steps,
                                    input_key=self.input_key, target_key=self.target_key)
        # The stream boundary: every training batch is checked and placed once, here (an on-device
        # loop stacks host batches and places them).
        self.feed = BatchFeed(strategy, self.batches, place=True)
        self.loop_feed = BatchFeed(strategy, self.batches, place=False)
        self.steps = CompiledSteps(strategy, self.model, self.optimizer, loss_fn, metrics,
                                   grad_accum_steps, compute_dtype, ema_decay=self.ema_decay)
        self.state: TrainState | None = None
        self.step = 0
        # load_state without a batch: its parameters' check against the model's first batch
        self.unchecked: Callable[[Any], None] | None = None
        self.loaded = False  # the state is load_state's and no fit has trained it yet
        self.position_unknown = False  # load_state's run: where its data stopped, until set
        self.stop_training = False  # a callback's request that the fit stop after this step
        self._position = DataPosition()

    @property
    def position(self) -> DataPosition:
        """How far training has read its data (``Trainer.data_position``); set: known."""
        return self._position

    @position.setter
    def position(self, position: DataPosition) -> None:
        if not isinstance(position, DataPosition):
            raise TypeError(f"data_position={position!r} must be a "
                            "jd.training.DataPosition(epoch=..., index=...).")
        self._position = position
        self.position_unknown = False

    # ------------------------------------------------------------------------------------ the state
    def init(self, batch: Any) -> TrainState:
        """The state, built from ``batch`` on first use (or checked on it: `unchecked`)."""
        if self.state is not None:
            if self.unchecked is not None:
                self.unchecked(batch)
            return self.state
        build, args = self.builder(batch)
        with self.strategy.scope():
            self.state = with_ema(self.strategy.create_variables(build, *args), self.ema_decay)
        return self.state

    def builder(self, batch: Any) -> tuple[Callable, tuple]:
        """The state's builder for ``batch``'s shapes (the losses are checked with the step)."""
        x, _ = self.batches.split(batch, "the first batch", need_targets=False)
        return state_builder(self.model, self.optimizer, self.seed, x)

    def target(self, batch: Any) -> Any:
        """Abstract arrays in the strategy's layout for the state ``batch`` builds."""
        return restore_target(self.strategy, *self.builder(batch))

    def state_for(self, batch: Any) -> TrainState:
        """The state; built from ``batch`` (a placed one) the first time."""
        return (self.state if self.state is not None and self.unchecked is None
                else self.init(jax.device_get(batch)))

    def sync(self) -> None:
        """Write the trained values back into the user's model (nnx in place; linen: nothing)."""
        if self.state is not None:
            self.model.sync(self.state.params, self.state.model_state)

    # ------------------------------------------------------------------------------------ the steps
    def train(self, batch: Any, where: str) -> dict[str, jax.Array]:
        """One compiled step on ``batch`` (checked, placed unless the feed did it); its metrics."""
        fed: TrainBatch = batch if self.feed.trusts(batch) else self.feed(batch, where)
        state = self.state
        if state is None or self.unchecked is not None:  # built, or checked after load_state
            state = self.init(fed.pair)
        self.state, metrics = self.steps.train(state, fed.pair)
        self.step += 1
        return metrics

    def train_loop(self, batches: Sequence[Any]) -> dict[str, jax.Array]:
        """``len(batches)`` steps in one compiled on-device loop; every step's metrics, stacked."""
        feed = self.loop_feed
        pairs = [(b if feed.trusts(b) else feed(b, f"train_on_batches' batch {i}")).pair
                 for i, b in enumerate(batches)]
        if not pairs:
            raise ValueError("train_on_batches got no batches: pass at least one.")
        state = self.init(pairs[0])
        self.state, values = self.steps.train_loop(state, pairs)
        self.step += len(pairs)
        return values

    def sums(self, caller: str, pop: bool = True) -> PackedSums:
        """The running sums (`CompiledSteps.pop_sums`, or ``peek_sums`` without ``pop``)."""
        if self.state is None:
            raise RuntimeError(f"{caller}() before the state exists: call fit(...) or init(batch) "
                               "first.")
        return self.steps.pop_sums(self.state) if pop else self.steps.peek_sums(self.state)

    def step_cost(self, options: CostOptions) -> StepCost:
        """What one training step costs (``Trainer.step_cost``)."""
        signature = self.batches.signature
        if self.state is None or signature is None or self.steps.fit_step is None:
            raise RuntimeError("step_cost() before the first training step: call fit(...) or "
                               "train_on_batch first.")
        return self.steps.step_cost(self.state, signature, options)

    def plan(self, batch: Any) -> Plan:
        """The `Plan` of the train step on ``batch`` (``Trainer.plan``): compiled, never run."""
        x, y = self.batches.split(batch, "plan's batch")
        if self.state is not None:
            state = abstract_state(self.state)
        else:
            # the builder reads one example (as init does): a row of zeros stands in
            row = jax.tree.map(lambda a: np.zeros((1, *np.shape(a)[1:]), jax.dtypes.result_type(a)),
                               (x, y))
            build, args = self.builder(row)
            with self.strategy.scope():
                state = with_ema(abstract_variables(self.strategy.policy, build, args, {}),
                                 self.ema_decay)
        return self.steps.plan(state, (x, y))

    def evaluate(self, data: Any, ema: bool = False) -> dict[str, float]:
        """``Trainer.evaluate``: each metric's mean over every example of ``data`` (``ema``: with
        the averaged weights as the parameters)."""
        state_for = averaged(self.state_for, self.ema_decay,
                             "evaluate(ema=True)") if ema else self.state_for
        return self.steps.evaluate(state_for, data, self.batches.split)

    def predict(self, data: Any, ema: bool = False) -> Any:
        """``Trainer.predict``: the outputs for every example of ``data`` (``ema``: as
        `evaluate`)."""
        state_for = averaged(self.state_for, self.ema_decay,
                             "predict(ema=True)") if ema else self.state_for
        return self.steps.predict(state_for, data, self.batches.split)
