"""`Trainer`: one training loop for Flax linen and nnx models with optax, unchanged on every strategy.

The train step is an ordinary single-device step (`jaxdist.training.step._functions`) compiled with ``strategy.jit(step,
donate_argnums=(0,), batch_argnums=(1,))`` (`jaxdist.training.step._compiled`); the state is born in the strategy's
layout with ``strategy.create_variables``; each batch is checked and placed once, at the stream boundary
(`jaxdist.training.data._feed`), the next ones while the current step runs. So ``fit`` on any strategy computes what
the same training computes on one device, and the loss and metrics are means over the GLOBAL batch.

Resuming is exact: the state's step counter drives the RNG (``fold_in(rng, step)``), the checkpoint stores the
data position, and a resumed ``fit`` with the same ``checkpoint_dir`` re-reads the same epoch and skips the
batches already used, so its parameters are bitwise identical to an uninterrupted run's.

``fit``'s loop lives in `jaxdist.training.loop`; it drives the trainer through its typed interface
(`jaxdist.training.loop._fit.FitTarget`: ``train_on_batch``, ``train_on_batches``, ``pop_running_sums``,
``peek_running_sums``, ``step_cost``, ``evaluate``, ``save``, ``restore``, ``sync_model``).

A diverging run loses nothing (`jaxdist.training.step._non_finite`): each step flags a non-finite loss or gradient
norm on the devices, ``fit`` acts on the flags where it reads its logs and before every checkpoint
(``on_non_finite``: stop, skip, roll back or continue), and `save` refuses a state that is not finite.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist.costs.step import CostOptions, StepCost
from jaxdist.replicate.trees import is_distributed
from jaxdist.strategies import Plan, Strategy
from jaxdist.strategies.layout import shape_scope, untyped
from jaxdist.strategies.plan import abstract_variables
from jaxdist.training.callbacks import Callback, CSVLogger, History, Progress, TensorBoardLogger
from jaxdist.training.checkpoints import Checkpointer, assemble, check_directory, checked_pieces
from jaxdist.training.data import (
    BatchChecker,
    BatchFeed,
    BatchStream,
    DataPosition,
    IteratorSnapshot,
    TrainBatch,
    UnrestorableState,
    check_key,
    global_rows,
    restored_position,
    say_batch_change,
)
from jaxdist.training.loop import FitOptions, NonFiniteError, NonFinitePolicy, agree_on_fit, check_int, failing, run_fit
from jaxdist.training.step import (
    CompiledSteps,
    PackedSums,
    TrainState,
    as_model,
    check_losses,
    describe,
    non_finite_leaves,
    params_target,
    restore_target,
    state_builder,
)

__all__ = ["Trainer"]


class Trainer:
    """Train a Flax (linen or nnx) model with an optax optimizer on any strategy.

    Args:
        strategy: a `jd.Strategy` (``MirroredStrategy()``, ``OneDeviceStrategy()``, ...).
        model: a `flax.linen.Module` instance or a `flax.nnx.Module` instance (detected from its type). An
            nnx module whose ``__call__`` takes ``rngs`` (as in the NNX tutorial, for ``nnx.Dropout``) gets a
            fresh ``nnx.Rngs`` each training step (see `NnxModel`).
        optimizer: an optax ``GradientTransformation``; learning-rate schedules work as in optax (build it
            with `optax.inject_hyperparams` to have the learning rate logged).
        loss_fn: ``loss_fn(outputs, targets)`` returning the MEAN loss over the batch, e.g.
            ``lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()``, or a
            token-weighted pair ``(sum, weight)``: the SUM of per-token losses and how many (real) tokens it
            covers, e.g. ``return (losses * mask).sum(), mask.sum()``. Pairs are summed and divided once over
            the global batch, its micro-batches and each log window (`jaxdist.training.step._weighted`), so padding
            never biases the mean however it is spread.
        metrics: extra ``{name: fn(outputs, targets)}``, each a batch mean or a ``(sum, weight)`` pair, e.g.
            ``{"accuracy": jd.training.accuracy}``.
        input_key: for batches given as dicts: the key of the model's inputs, e.g. ``input_key="image"`` for
            ``{"image": ..., "label": ...}``. A tuple of keys passes their values as a dict. Other keys than
            the input and target keys are dropped on the host (one warning). Batches given as pairs ``(x, y)``
            ignore it.
        target_key: for batches given as dicts: the key of the targets (``target_key="label"`` above), or a
            tuple of keys, as ``input_key``.
        variables: linen only: variables to start from (e.g. pretrained) instead of ``model.init``.
        grad_accum_steps: split each batch into this many micro-batches per optimizer step (one update
            equal to a step on the whole batch, with the activation memory of a micro-batch).
        compute_dtype: e.g. ``jnp.bfloat16``: mixed precision (bf16 compute; float32 parameters, gradients
            and optimizer state).
        clip_grad_norm: clip gradients to this global norm before the optimizer (None: no clipping).
        seed: seeds parameter init (linen) and the per-step key (``fold_in(key, step)``) behind linen rng
            streams and nnx call-time ``rngs``.
        train_kwargs: linen only: keyword arguments for ``model.apply`` in training (e.g. ``{"train": True}``).
        eval_kwargs: linen only: keyword arguments for ``model.apply`` in evaluation and prediction (e.g.
            ``{"train": False}``).
        rng_streams: linen only: rng names given a fresh key each step (default ``("dropout",)``).
        steps_per_run: steps per compiled on-device loop in ``fit`` (``strategy.run_steps_on_dataset``;
            default: ``strategy.steps_per_run`` for a `TPUStrategy`, else 1: one compiled step per batch). A
            loop ends early at a log, evaluation or checkpoint point, so those see the same steps as one step
            at a time (make ``log_every`` a multiple of ``steps_per_run`` to keep the loops full).
        tokens_per_example: tokens in one example (a language model's sequence length): logs then show
            ``tokens_per_sec`` = rows x this / step time (padding included: what the devices process). None:
            a token-weighted loss's summed weight counts the tokens (the real ones); other losses log none.
        peak_flops: peak FLOP/s of ONE device for ``mfu`` and ``hfu`` (e.g. a measured peak), instead of the
            datasheet's dense bf16 figure for A100, H100, H200, B200 and TPU v4 / v5e / v5p / v6e
            (`jaxdist.costs.ACCELERATORS`). Without either (CPU), both are "n/a".
        flops_per_step: the model's FLOPs per optimizer step over the global batch (e.g. 6 x parameters x
            tokens): the basis of ``mfu`` (model FLOPs utilisation). Without it, the compiled step's FLOPs
            without recomputation (`jaxdist.costs.program_cost`). ``hfu`` (hardware FLOPs utilisation) always
            counts what the compiled step executes, rematerialisation and replicated optimizer work included.

    Raises:
        TypeError: for a strategy, model, optimizer or loss_fn of the wrong kind (a module class instead of
            an instance; linen options with an nnx module), or a key option that is not a string.
        ValueError: for out-of-range numbers (``peak_flops=-1``), a metric named "loss", or ``variables``
            with an nnx module.

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> trainer = jd.training.Trainer(
        ...     jd.MirroredStrategy(), nn.Dense(2), optax.sgd(0.1),
        ...     lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean(),
        ...     input_key="image", target_key="label")
        >>> data = [{"image": np.ones((8, 3), np.float32), "label": np.zeros(8, np.int32)}] * 4
        >>> history = trainer.fit(data, steps=4, verbose=0)
        >>> trainer.step, trainer.evaluate(data)["loss"] < history.train[0]["loss"]
        (4, True)
    """

    def __init__(
        self,
        strategy: Strategy,
        model: Any,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable[[Any, Any], jax.Array],
        *,
        metrics: Mapping[str, Callable[[Any, Any], jax.Array]] | None = None,
        input_key: str | Sequence[str] = "x",
        target_key: str | Sequence[str] = "y",
        variables: Any = None,
        grad_accum_steps: int = 1,
        compute_dtype: Any = None,
        clip_grad_norm: float | None = None,
        seed: int = 0,
        train_kwargs: dict | None = None,
        eval_kwargs: dict | None = None,
        rng_streams: Sequence[str] | None = None,
        steps_per_run: int | None = None,
        tokens_per_example: int | None = None,
        peak_flops: float | None = None,
        flops_per_step: float | None = None,
    ):
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy={strategy!r} is not a jaxdist strategy: pass e.g. jd.MirroredStrategy() or "
                "jd.OneDeviceStrategy()."
            )
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                f"optimizer={optimizer!r} is not an optax GradientTransformation: pass e.g. optax.adam(1e-3)."
            )
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn={loss_fn!r} is not callable: pass loss_fn(outputs, targets) -> scalar mean or (sum, weight)."
            )
        self.cost_options = CostOptions(tokens_per_example, peak_flops, flops_per_step)  # checks them
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if name == "loss" or not isinstance(name, str) or not callable(fn):
                raise ValueError(
                    f"metrics[{name!r}]={fn!r}: metrics map names other than 'loss' to fn(outputs, targets) -> "
                    "scalar (the loss is always reported as 'loss')."
                )
        input_key, target_key = check_key(input_key, "input_key"), check_key(target_key, "target_key")
        check_int(grad_accum_steps, "grad_accum_steps", 1, allow_none=False)
        check_int(steps_per_run, "steps_per_run", 1)
        check_int(seed, "seed", 0, allow_none=False)
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be a positive number or None.")
        if compute_dtype is not None and not jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating):
            raise ValueError(f"compute_dtype={compute_dtype!r} must be a floating dtype such as jnp.bfloat16.")
        self.strategy = strategy
        self._model = as_model(model, variables, train_kwargs=train_kwargs, eval_kwargs=eval_kwargs,
                               rng_streams=tuple(rng_streams) if rng_streams is not None else None)
        self.model = model
        self.loss_fn = loss_fn
        self.metrics = metrics
        self.input_key, self.target_key = input_key, target_key
        self.optimizer = optax.chain(optax.clip_by_global_norm(clip_grad_norm), optimizer) if clip_grad_norm \
            else optimizer
        self.grad_accum_steps = grad_accum_steps
        self.compute_dtype = compute_dtype
        self.seed = seed
        self.steps_per_run = steps_per_run or int(getattr(strategy, "steps_per_run", 1) or 1)
        self.stop_training = False
        self._position_unknown = False  # load_state's run: where its data stopped is unknown until set
        self._loaded = False  # the state is load_state's and no fit has trained it yet
        self._unchecked = False  # load_state without a batch: the model checks its parameters at its first batch
        self.data_position = DataPosition()
        self._state: TrainState | None = None
        self._step = 0
        self._batches = BatchChecker(strategy.num_replicas_in_sync, grad_accum_steps, input_key=input_key,
                                     target_key=target_key)
        # The stream boundary: every training batch is checked by self._batches and placed once, here. A
        # compiled step per batch takes placed batches; an on-device loop stacks host batches and places them.
        self._feed = BatchFeed(strategy, self._batches, place=True)
        self._loop_feed = BatchFeed(strategy, self._batches, place=False)
        self._steps = CompiledSteps(strategy, self._model, self.optimizer, loss_fn, metrics, grad_accum_steps,
                                    compute_dtype)

    # --------------------------------------------------------------------------------------------- state
    @property
    def state(self) -> TrainState | None:
        """The `TrainState` in the strategy's layout (None before the first batch is seen)."""
        return self._state

    @property
    def params(self) -> Any:
        """The current parameters (a nested dict of arrays)."""
        return None if self._state is None else self._state.params

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints, set by `load_state`)."""
        return self._step

    @property
    def data_position(self) -> DataPosition:
        """How far training has read ``train_data`` (saved in checkpoints; ``fit`` starts there).

        Set it after `load_state` to say where the loaded run's data stopped, e.g.
        ``trainer.data_position = jd.training.DataPosition(epoch=0, index=20)``: ``fit`` then skips the first
        20 batches of epoch 0 of a list or ``data_fn(epoch)``.
        """
        return self._data_position

    @data_position.setter
    def data_position(self, position: DataPosition) -> None:
        if not isinstance(position, DataPosition):
            raise TypeError(
                f"data_position={position!r} must be a jd.training.DataPosition(epoch=..., index=...)."
            )
        self._data_position = position
        self._position_unknown = False

    def init(self, batch: Any) -> TrainState:
        """Build the state from a sample batch (done on first use; call it to build it earlier).

        Runs ``model.init`` (linen; nnx modules bring their variables) and ``optimizer.init`` under
        ``strategy.create_variables``: born in the strategy's layout, no host copy. Checks that ``loss_fn``
        returns a scalar and each metric too.

        Args:
            batch: a batch ``(x, y)`` / a dict with ``input_key`` and ``target_key`` (only shapes matter), or
                just ``x``.

        Returns:
            The `TrainState`.

        Raises:
            ValueError: for a batch of the wrong structure, or a loss_fn / metric returning a non-scalar.
        """
        if self._state is not None:
            if self._unchecked:
                self._check_loaded(batch)
            return self._state
        build, args = self._checked_builder(batch)
        with self.strategy.scope():
            self._state = self.strategy.create_variables(build, *args)
        return self._state

    def _check_loaded(self, batch: Any) -> None:
        """At the first batch after ``load_state`` without one: the loaded parameters checked against the
        model's (before any update), and the model's other variables (batch statistics) as a new run's."""
        like = restore_target(self.strategy, *self._checked_builder(batch))
        state = self._state
        try:
            checked_pieces(like, state.params, None, None)
        except ValueError as e:
            raise ValueError(
                f"the parameters given to load_state() do not fit this model on its first batch: {e}"
            ) from None
        if jax.tree.leaves(like.model_state) and not jax.tree.leaves(state.model_state):
            build, args = self._checked_builder(batch)
            with self.strategy.scope():
                fresh = self.strategy.create_variables(build, *args)
            state = state._replace(model_state=fresh.model_state)
        self._state, self._unchecked = state, False

    def _checked_builder(self, batch: Any) -> tuple[Callable, tuple]:
        """The state's builder for ``batch``'s shapes, after checking what the losses return on them (which also
        tells the compiled steps which of them are token-weighted)."""
        x, y = self._batches.split(batch, "the first batch", need_targets=False)
        build, args = state_builder(self._model, self.optimizer, self.seed, x)
        if y is not None:
            with shape_scope(self.strategy.mesh):
                self._steps.weighted = check_losses(self._model, self.loss_fn, self.metrics,
                                                    jax.eval_shape(build, *untyped(args)), x, y)
        return build, args

    def sync_model(self) -> None:
        """Write the trained values back into the model the trainer was given (``fit`` does this at its end).

        nnx modules are updated in place, as nnx code expects; linen modules hold no values (a no-op).

        Examples:
            >>> import numpy as np, optax, jaxdist as jd
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> trainer = jd.training.Trainer(jd.OneDeviceStrategy(), model, optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> _ = trainer.train_on_batch((np.ones((4, 2), np.float32), np.ones(4, np.float32)))
            >>> before = float(model.bias[0])
            >>> trainer.sync_model()
            >>> float(model.bias[0]) != before
            True
        """
        if self._state is not None:
            self._model.sync(self._state.params, self._state.model_state)

    # ------------------------------------------------------------------------------------------ steps
    def train_on_batch(self, batch: Any) -> dict[str, jax.Array]:
        """One optimizer step on one global batch (what ``fit`` runs per batch, without its loop).

        Args:
            batch: ``(x, y)`` or a dict with ``input_key`` / ``target_key``: host arrays (split over the
                replicas) or a batch of this strategy's distributed dataset; checked and placed here (a
                batch ``fit``'s stream has already checked and placed is taken as it is).

        Returns:
            The step's metrics (``"loss"``, each metric, ``"learning_rate"`` when logged) as device scalars:
            reading one waits for the step.

        Raises:
            ValueError: for a batch of the wrong structure, one the replicas (times ``grad_accum_steps``) do
                not divide, or one whose shapes differ from the first batch's.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> metrics = trainer.train_on_batch((np.ones((8, 2), np.float32), np.ones(8, np.float32)))
            >>> trainer.step, sorted(metrics)
            (1, ['loss'])
        """
        fed: TrainBatch = batch if self._feed.trusts(batch) else self._feed(batch, "train_on_batch's batch")
        state = self.init(fed.pair)  # the state (built, or checked after load_state, on first use)
        self._state, metrics = self._steps.train(state, fed.pair)
        self._step += 1
        return metrics

    def train_on_batches(self, batches: Sequence[Any]) -> dict[str, jax.Array]:
        """``len(batches)`` optimizer steps in ONE compiled on-device loop (``strategy.run_steps_on_dataset``).

        The same steps ``train_on_batch`` would take one by one, with the host involved once.

        Args:
            batches: global batches of one shape, as for `train_on_batch`.

        Returns:
            Every step's metrics, stacked: ``{name: array of shape (len(batches),)}`` on the devices.

        Raises:
            ValueError: for no batches, or batches of the wrong structure or of different shapes.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.TPUStrategy(steps_per_run=4), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
            >>> metrics = trainer.train_on_batches([batch] * 4)
            >>> trainer.step, metrics["loss"].shape
            (4, (4,))
        """
        feed = self._loop_feed
        pairs = [(b if feed.trusts(b) else feed(b, f"train_on_batches' batch {i}")).pair for i, b in enumerate(batches)]
        if not pairs:
            raise ValueError("train_on_batches got no batches: pass at least one.")
        state = self.init(pairs[0])
        self._state, values = self._steps.train_loop(state, pairs)
        self._step += len(pairs)
        return values

    def pop_running_sums(self) -> PackedSums:
        """The running sums of the steps taken since the last call, on the devices; restarts them.

        Every step (`train_on_batch`, `train_on_batches`) adds its metrics to the running sums on the devices
        (no extra work per step): ``fit`` pops them at each log point and reads them in one transfer.

        Returns:
            The sums still on the devices, packed in one vector (`jd.training.PackedSums`; zeros when no step
            ran since the last call); nothing waits here. Their ``to_host()`` reads them in one transfer and
            returns the `jd.training.RunningSums`: ``averages`` (each metric's ``Average(total, weight)``,
            ``"loss"`` first), ``non_finite`` (the record of the steps whose loss or gradients were not
            finite), ``steps`` and ``learning_rate`` (the last step's, when logged).

        Raises:
            RuntimeError: before the state exists (nothing trained or initialized yet).

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.0),
            ...                               lambda out, y: ((out[:, 0] * 0 + y) ** 2).mean())
            >>> for y in (1.0, 2.0):
            ...     _ = trainer.train_on_batch((np.ones((8, 2), np.float32), np.full(8, y, np.float32)))
            >>> sums = trainer.pop_running_sums().to_host()
            >>> sums.mean("loss"), int(sums.steps), int(sums.non_finite.count)
            (2.5, 2, 0)
            >>> int(trainer.pop_running_sums().to_host().steps)  # restarted
            0
        """
        if self._state is None:
            raise RuntimeError("pop_running_sums() before the state exists: call fit(...) or init(batch) first.")
        return self._steps.pop_sums(self._state)

    def peek_running_sums(self) -> PackedSums:
        """The running sums `pop_running_sums` would return, without restarting them (read them before the next
        step, which updates them in place): ``fit`` reads the non-finite steps' record in them before a
        checkpoint.

        Returns:
            The `PackedSums`, as `pop_running_sums`.

        Raises:
            RuntimeError: before the state exists.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> _ = trainer.train_on_batch((np.ones((8, 2), np.float32), np.full(8, np.nan, np.float32)))
            >>> peeked = trainer.peek_running_sums().to_host()  # not restarted:
            >>> int(peeked.non_finite.count), int(peeked.steps), int(trainer.pop_running_sums().to_host().steps)
            (1, 1, 1)
        """
        if self._state is None:
            raise RuntimeError("peek_running_sums() before the state exists: call fit(...) or init(batch) first.")
        return self._steps.peek_sums(self._state)

    def pop_metric_sums(self) -> tuple[tuple[str, ...], Any]:
        """Deprecated: `pop_running_sums` (read by name: ``.to_host().mean("loss")``) as ``(names, vector)``.

        Returns:
            ``(names, sums)``: ``sums[i]`` belongs to ``names[i]``: each metric's sum (``"loss"`` first; a
            token-weighted one followed by ``"<name>.weight"``), ``"learning_rate"`` the last step's rate (when
            logged), the non-finite steps' record (``"non_finite_steps"``, ...) and ``"steps"``. A device vector
            (zeros when no step ran since the last call).

        Raises:
            RuntimeError: before the state exists.

        Examples:
            >>> import warnings, flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.0),
            ...                               lambda out, y: ((out[:, 0] * 0 + y) ** 2).mean())
            >>> _ = trainer.train_on_batch((np.ones((8, 2), np.float32), np.full(8, 2.0, np.float32)))
            >>> with warnings.catch_warnings():
            ...     warnings.simplefilter("ignore", DeprecationWarning)
            ...     names, sums = trainer.pop_metric_sums()
            >>> dict(zip(names, sums.tolist()))["loss"]
            4.0
        """
        _deprecated("pop_metric_sums", "pop_running_sums")
        if self._state is None:
            raise RuntimeError("pop_metric_sums() before the state exists: call fit(...) or init(batch) first.")
        return _packed(self._steps.pop_sums(self._state))

    def peek_metric_sums(self) -> tuple[tuple[str, ...], Any]:
        """Deprecated: `peek_running_sums` packed as ``(names, vector)`` (see `pop_metric_sums`).

        Raises:
            RuntimeError: before the state exists.
        """
        _deprecated("peek_metric_sums", "peek_running_sums")
        if self._state is None:
            raise RuntimeError("peek_metric_sums() before the state exists: call fit(...) or init(batch) first.")
        return _packed(self._steps.peek_sums(self._state))

    def step_cost(self) -> StepCost:
        """What one training step costs per device: FLOPs, peak FLOP/s, bytes of parameters, optimizer state
        and temporaries (``fit`` logs it once at its start; `jaxdist.training.cost`). Measured once, from the
        compiled step (`jaxdist.costs.program_cost`, the same count as ``Trainer.plan(...).flops``, and XLA's
        memory analysis), never per step: the step that ran is found in JAX's cache; with ``steps_per_run > 1``
        (on-device loops) the single step is compiled once more for it.

        Raises:
            RuntimeError: before the first training step.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean(), peak_flops=1e9)
            >>> _ = trainer.train_on_batch((np.ones((8, 2), np.float32), np.ones(8, np.float32)))
            >>> cost = trainer.step_cost()
            >>> cost.flops > 0, cost.peak_flops, cost.param_bytes  # kernel (2, 1) + bias (1,), float32
            (True, 1000000000.0, 12)
        """
        signature = self._batches.signature
        if self._state is None or signature is None or self._steps.fit_step is None:
            raise RuntimeError("step_cost() before the first training step: call fit(...) or train_on_batch first.")
        return self._steps.step_cost(self._state, signature, self.cost_options)

    def plan(self, batch: Any) -> Plan:
        """The `jd.Plan` of the trainer's own train step on a global ``batch``: memory, FLOPs and collectives
        per device on the strategy's layout (the optimizer state, ``grad_accum_steps``, ``compute_dtype`` and
        all), compiled but never run. Before the state exists it is planned from its shapes (nothing is
        initialized or allocated), so a strategy over a plan mesh (`jd.plan_mesh`) works too.

        Args:
            batch: ``(x, y)`` or a dict with ``input_key`` / ``target_key``, of arrays or
                `jax.ShapeDtypeStruct`s: the global batch (only shapes and dtypes are read).

        Returns:
            A `jd.Plan`.

        Raises:
            ValueError: for a batch of the wrong structure, or one the replicas do not divide.

        Examples:
            >>> import flax.linen as nn, jax, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.ShardedStrategy(min_shard_size=1), nn.Dense(64), optax.adam(1e-3),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> plan = trainer.plan((jax.ShapeDtypeStruct((32, 64), np.float32), np.ones(32, np.float32)))
            >>> plan.state_bytes["params"] == (64 * 64 + 64) * 4 // 8, trainer.state is None
            (True, True)
        """
        x, y = self._batches.split(batch, "plan's batch")
        if self._state is not None:
            state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self._state)
        else:
            # The builder reads one example (as init does): one row of zeros of the batch's shapes stands in.
            row = jax.tree.map(lambda a: np.zeros((1, *np.shape(a)[1:]), jax.dtypes.result_type(a)), (x, y))
            build, args = self._checked_builder(row)
            with self.strategy.scope():
                state = abstract_variables(self.strategy.policy, build, args, {})
        return self._steps.plan(state, (x, y))

    # ------------------------------------------------------------------------------------- checkpoints
    def save(self, checkpoint_dir: str | os.PathLike | Checkpointer, max_to_keep: int | None = 3) -> str:
        """Write a checkpoint of the state, step, data position and RNG, unless the state is not finite.

        A state with a NaN or an infinity in its parameters or model state, or a NaN in its optimizer state, is
        refused: no checkpoint ever holds one, so the rotation (``max_to_keep``) never deletes the newest
        finite checkpoint in favour of a diverged one. Checking costs one pass over the state on the devices
        per save (`jaxdist.training.step.non_finite_leaves`).

        Args:
            checkpoint_dir: a directory, or an open `Checkpointer` (left open; its own ``max_to_keep``).
            max_to_keep: with a directory: how many recent checkpoints to keep there.

        Returns:
            The checkpoint's path.

        Raises:
            RuntimeError: before the state exists (nothing trained or initialized yet).
            NonFiniteError: (a `FloatingPointError`) when the state is not finite, naming the leaves and the
                newest checkpoint there is; nothing is written.
        """
        if self._state is None:
            raise RuntimeError("save() before the state exists: call fit(...) or init(batch) first.")
        bad = non_finite_leaves(self._state)
        if bad:
            self._refuse(checkpoint_dir, bad)
        position = self.data_position  # a grain source's iterator state goes beside it, one file per process
        meta = {"model_kind": self._model.kind, "data_position": {"epoch": position.epoch, "index": position.index},
                "global_batch": global_rows(self._batches.signature)}
        state = position.state
        data_iterator = None if state is None or isinstance(state, UnrestorableState) else IteratorSnapshot(state)
        if isinstance(checkpoint_dir, Checkpointer):
            return checkpoint_dir.save(self._step, self._state, meta, data_iterator)
        ckpt = Checkpointer(checkpoint_dir, max_to_keep)
        try:
            return ckpt.save(self._step, self._state, meta, data_iterator)
        finally:
            ckpt.close()

    def _refuse(self, checkpoint_dir: str | os.PathLike | Checkpointer, bad: list[str]) -> None:
        """Raise the `NonFiniteError` of a save refused because the leaves ``bad`` are not finite."""
        if isinstance(checkpoint_dir, Checkpointer):
            directory, latest = checkpoint_dir.directory, checkpoint_dir.latest_step()
        else:
            directory = os.path.abspath(os.fspath(checkpoint_dir))
            latest = None
            if os.path.isdir(directory) and os.listdir(directory):
                ckpt = Checkpointer(directory, None)
                try:
                    latest = ckpt.latest_step()
                finally:
                    ckpt.close()
        where = "there is no checkpoint there" if latest is None else f"the newest checkpoint there is step {latest}"
        raise NonFiniteError(
            f"not saving step {self._step} to {directory!r}: its state is not finite ({describe(bad)}); {where}. "
            "Resume from a finite checkpoint (fit(..., restore_step=...)) with a lower learning rate or "
            "clip_grad_norm=..., or train with on_non_finite='skip' / 'rollback'.",
            step=self._step, count=0, checkpoint=latest, directory=directory,
        )

    def restore(
        self, checkpoint_dir: str | os.PathLike | Checkpointer, step: int | None = None, batch: Any = None
    ) -> int:
        """Load a checkpoint (default: the latest) onto THIS trainer's strategy, whatever wrote it.

        Args:
            checkpoint_dir: the directory ``fit`` or `save` wrote, or an open `Checkpointer` (left open).
            step: which checkpoint; None for the latest.
            batch: a sample batch, needed only when the state does not exist yet (see `init`).

        Returns:
            The restored step.

        Raises:
            FileNotFoundError: when there is no checkpoint (or none for ``step``, naming the steps there are).
            ValueError: for another model's checkpoint (or one of an nnx model into a linen trainer and vice
                versa), an optimizer state that does not fit, or no ``batch`` when the state does not exist; for
                a checkpoint jaxdist did not write (plain orbax's), showing the two lines of orbax and
                `load_state` that continue it.
            CheckpointCorruptedError: when the checkpoint's files are damaged, naming the newest older
                checkpoint that restores into this trainer (the trainer is left as it was).
        """
        if isinstance(checkpoint_dir, Checkpointer):
            return self._restore(checkpoint_dir, step, batch)
        ckpt = Checkpointer(checkpoint_dir, None)
        try:
            return self._restore(ckpt, step, batch)
        finally:
            ckpt.close()

    def _restore(self, ckpt: Checkpointer, step: int | None, batch: Any, step_argument: str = "step") -> int:
        """Restore checkpoint ``step`` (None: the latest) whole (state, step, data position) or not at all."""
        targets: list[Any] = []  # built once, on the first checkpoint that fits this model

        def read(at: int) -> tuple[Any, int, DataPosition]:
            meta = ckpt.meta(at)
            if meta.get("model_kind") != self._model.kind:
                raise ValueError(
                    f"checkpoint_dir={ckpt.directory!r} holds a checkpoint of a {meta.get('model_kind')} model, but "
                    f"this Trainer's model is a {self._model.kind} module: pass the {meta.get('model_kind')} model "
                    "that wrote it, or use a fresh checkpoint_dir."
                )
            if not targets:
                targets.append(self._restore_target(batch))
            state, meta = ckpt.restore(targets[0], at)
            position = restored_position(meta["data_position"], lambda: ckpt.data_iterator_state(at))
            return state, int(meta["step"]), position

        self._state, self._step, self.data_position = ckpt.read(read, step, step_argument=step_argument)
        self.sync_model()
        return self._step

    def _restore_target(self, batch: Any) -> Any:
        """What a restore reads into: the live state, or (cheaper: nothing is computed or allocated twice)
        abstract arrays carrying the strategy's variable layout."""
        if self._state is not None:
            return self._state
        if batch is None:
            raise ValueError("restore() needs batch=... (a sample batch) to build the state it restores into.")
        return restore_target(self.strategy, *self._checked_builder(batch))

    def load_state(
        self,
        params: Any,
        opt_state: Any = None,
        step: int | None = None,
        model_state: Any = None,
        *,
        batch: Any = None,
    ) -> TrainState:
        """Continue a run trained elsewhere (plain JAX / Flax, saved with plain orbax or any other way): place
        its parameters, optimizer state and step onto this trainer's strategy.

        Each piece is checked leaf by leaf against the state this trainer builds for its model and optimizer,
        then placed in the strategy's layout for it (`jaxdist.training.checkpoints._load`): host arrays are sliced
        on the host and each device gets only its part (a leaf the layout splits is born split, never whole on every
        device); device arrays of any layout are resharded. The state is a copy: the arrays passed stay
        valid. Leaves match by name, whatever holds them: the optax state orbax restores without a target
        (NamedTuples as dicts, tuples as lists), an ``nnx.State``, an ``nnx.Optimizer``'s ``opt_state`` all fit.
        On several processes each process passes the same values (each reads the same checkpoint), or global
        `jax.Array` s.

        ``fit`` continues from here: to ``steps`` in total (``fit(steps=30)`` after ``step=20`` takes 10 steps),
        with the per-step keys, checkpoints and logs of step 21 on. An iterator is read on from where it is; a
        list or a ``data_fn(epoch)`` is read from its first batch unless `data_position` is set (``fit`` says
        so with a warning when it is not).

        Args:
            params: the model's parameters (linen: ``variables["params"]``; nnx: ``nnx.state(model, nnx.Param)``
                or its pure dict).
            opt_state: the state of the optimizer this trainer was given (the same optax transformation, so
                its schedule continues); None: a fresh one (``optimizer.init(params)``: moments and schedule
                start over).
            step: the steps the run took: the trainer's step counter (per-step RNG keys, checkpoint numbers,
                ``fit``'s totals); None: unchanged.
            model_state: the model's other variables (linen: the collections besides ``"params"``, e.g.
                ``{"batch_stats": ...}``; nnx: every variable that is not an ``nnx.Param``); None: the trainer's
                (a new trainer's: what `init` builds).
            batch: a sample batch (optional): for a linen model whose trainer has no state yet, the model's
                shapes come from it; without it the pieces are checked against each other (the optimizer state
                against ``optimizer.init(params)``'s shapes) and against the model at its first batch, before
                any update (its other variables, e.g. batch statistics, then start as a new run's).

        Returns:
            The new `TrainState` (also `state`).

        Raises:
            ValueError: when a piece does not fit the model and optimizer: a leaf missing or extra, a shape or
                dtype that differs (naming each such leaf by its path, e.g. ``opt_state[0].mu['Dense_0']
                ['kernel']``), for a ``step`` that is not an int >= 0; parameters that do not fit the model,
                at its first batch when no ``batch`` was given.
                The trainer is left as it was.

        Warns:
            UserWarning: when the optimizer state's own step count (Adam's, a schedule's ``count``) differs from
                the trainer's step after the load (the schedule would follow one, the RNG and ``fit`` the other).

        Examples:
            >>> import flax.linen as nn, jax, numpy as np, optax, jaxdist as jd
            >>> model, optimizer = nn.Dense(2), optax.adam(optax.linear_schedule(1e-2, 0.0, 100))
            >>> x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
            >>> params = model.init(jax.random.key(0), x)["params"]  # a run of 20 steps elsewhere
            >>> opt_state = optimizer.init(params)
            >>> for _ in range(20):
            ...     grads = jax.grad(lambda p: ((model.apply({"params": p}, x) - y) ** 2).mean())(params)
            ...     updates, opt_state = optimizer.update(grads, opt_state, params)
            ...     params = optax.apply_updates(params, updates)
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), model, optimizer,
            ...                               lambda out, y: ((out - y) ** 2).mean())
            >>> _ = trainer.load_state(params=params, opt_state=opt_state, step=20)  # no batch needed
            >>> _ = trainer.fit(iter([(x, y)] * 5), steps=25, verbose=0)  # the schedule goes on at step 21
            >>> trainer.step, int(trainer.state.opt_state[0].count)
            (25, 25)
        """
        check_int(step, "step", 0)
        for name, piece in (("params", params), ("opt_state", opt_state), ("model_state", model_state)):
            held = [jax.tree_util.keystr(p) for p, v in
                    jax.tree_util.tree_flatten_with_path(piece, is_leaf=is_distributed)[0] if is_distributed(v)]
            if held:
                raise ValueError(
                    f"{name} holds per-replica values ({type(piece).__name__}{held[0]}"
                    f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}): one copy per replica, where the "
                    "trainer keeps one state. Pass one copy (strategy.experimental_local_results(value)[0]) or "
                    "their mean (strategy.reduce('mean', value)); replicas that drifted apart were trained apart."
                )
        unchecked = False  # the model's own check waits for its first batch
        if self._state is not None:
            like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self._state)
        elif batch is None and self._model.kind == "linen" and self._model.initial_variables is None:
            # A linen model's shapes come from its inputs: the pieces are checked against each other now (the
            # optimizer state against optimizer.init(params)'s) and against the model at the first batch.
            like, unchecked = params_target(self.strategy, self.optimizer, params, model_state), True
        else:
            like = restore_target(self.strategy, *self._checked_builder(batch))
        # Everything given is checked before anything is built or placed: an error leaves the trainer as it was.
        pieces = checked_pieces(like, params, opt_state, model_state)
        base = self._state
        if base is None and model_state is None and jax.tree.leaves(like.model_state):
            base = self.init(batch)  # the model's other variables (batch statistics, nnx Rngs), as a new run's
        step = self._step if step is None else step
        state = assemble(like, pieces, base, self.optimizer, self.seed, step)
        self._state, self._step = state, step
        self._unchecked = unchecked
        self.data_position = DataPosition()
        self._position_unknown = True  # fit says where it starts reading a list (set data_position to say it)
        self._loaded = True  # until a fit trains on it (one that restores a later checkpoint over it says so)
        self.sync_model()
        return state

    # --------------------------------------------------------------------------------------------- fit
    def fit(
        self,
        train_data: Any,
        steps: int | None = None,
        *,
        epochs: int | None = None,
        eval_data: Any = None,
        eval_every: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        async_checkpoints: bool = True,
        log_every: int = 10,
        log_dir: str | os.PathLike | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: str | int = "auto",
        on_preemption: str = "exit",
        restore_step: int | None = None,
        step_timeout: float | None = None,
        on_non_finite: str | NonFinitePolicy = "stop",
        profile_steps: tuple[int, int] | None = None,
        profile_processes: int | Sequence[int] | str = (0,),
    ) -> History:
        """Train until the step counter reaches ``steps`` (or ``epochs`` passes over the data end).

        Both counts are totals, not increments: a resumed run (same ``checkpoint_dir``) restores the latest
        checkpoint, continues from its step and data position, and stops at the same place an uninterrupted
        run would.

        Args:
            train_data: global batches ``(x, y)`` or dicts with ``input_key`` and ``target_key``, all of one
                shape: a function ``epoch -> iterable`` (shuffle per epoch with a seed derived from
                ``epoch``), a re-iterable (a list: repeated each epoch) or an iterator (read once). Resuming
                needs the same batches for the same epoch (deterministic data).
            steps: train until ``trainer.step == steps``.
            epochs: stop after this many epochs in total (with ``steps``, whichever comes first).
            eval_data: batches for `evaluate` (any size; padded and masked), evaluated every ``eval_every``
                steps and at the end.
            eval_every: steps between evaluations (None: only at the end).
            checkpoint_dir: restore the latest checkpoint from here and save here (every
                ``checkpoint_every`` steps, at the end, and on preemption). None: no checkpoints. A damaged
                latest checkpoint is a `CheckpointCorruptedError` naming the newest one that restores.
            checkpoint_every: steps between checkpoints (None: only at the end / on preemption).
            keep_checkpoints: how many recent checkpoints to keep.
            async_checkpoints: write checkpoints in the background: training goes on once the state is
                copied to host memory (`Checkpointer`'s ``async_save``); ``on_checkpoint`` comes once one is
                complete, a failed write raises at the next step or at the end of ``fit``, and ``fit``
                returns (or exits on preemption) only when the last one is complete. False: each save
                blocks until written.
            log_every: steps between log points: each log is the mean of every metric over the steps since
                the previous one (with ``steps_per_run > 1`` too; token-weighted for ``(sum, weight)`` losses),
                plus steps/s, the window's seconds by part (``time/steps``, ...: `History`'s ``time``) and,
                where known, ``tokens_per_sec``, ``mfu`` and ``peak_bytes_in_use``; the
                step's cost (`step_cost`) is logged once, after the first step. A log point does not wait for
                the devices: it is emitted once they have the values (a step or two later, with its own
                step number), and always before the next evaluation, checkpoint or the end of ``fit``.
            log_dir: also write ``metrics.csv`` and TensorBoard event files here.
            callbacks: `Callback` instances.
            verbose: ``"auto"`` (a bar on a terminal, lines otherwise), ``"bar"``, ``"lines"``, 2 (``"auto"``
                with the step's whole cost line, `StepCost.describe`, instead of its summary), or 0 (silent).
            on_preemption: on SIGTERM the current step finishes and a checkpoint is saved; then ``"exit"``
                raises ``SystemExit(0)`` (the job exits cleanly) or ``"return"`` returns the history with
                ``history.preempted = True``. With several processes a SIGTERM to any one stops them all
                after the same step (`jaxdist.training.loop._preemption`), and they save together.
            restore_step: resume from this checkpoint of ``checkpoint_dir`` instead of the latest (e.g. the
                one before a damaged checkpoint): the run goes back to that step (state, data position), and
                the checkpoints after it are deleted once it is restored (they belong to the run being
                replaced; a later resume would otherwise jump back to them).
            step_timeout: seconds a training step may take; when none finishes in time (the first, which
                compiles, gets ``max(10 * step_timeout, 600)``), the process writes why and every thread's stack
                to stderr and exits with status 124 (`jaxdist.training.Watchdog`): a stuck or dead peer ends
                the job, so the scheduler restarts it from the last complete checkpoint, instead of hanging.
                Evaluation and checkpoint writes are not watched. None (default): not watched, because only
                you know how long a step may take; set a few times your slowest step.
            on_non_finite: what a step whose loss or gradients are not finite (a loss spike, divergence) does;
                each step computes the flag on the devices and ``fit`` reads it with the logs and before every
                checkpoint (no cost per step). ``"stop"`` (default): raise `NonFiniteError` (a
                `FloatingPointError`) naming the first bad step, the last finite checkpoint and how to resume.
                ``"skip"``: bad steps change no state (optax's ``apply_if_finite``; the step counter and the
                data move on), the logs count them (``non_finite_steps``); 10 in a row stop as ``"stop"``.
                ``"rollback"``: restore the last finite checkpoint (needs ``checkpoint_dir``) and go on with the
                data past the bad batches; at most 3 times, then stop. ``"continue"``: train on, with one
                warning. A `NonFinitePolicy` sets other limits. Whatever the policy, a non-finite state is
                never saved (`save`).
            profile_steps: ``(start, stop)``: trace steps ``start ... stop - 1`` with `jax.profiler` (step ``n``
                is the one numbered ``n`` in the logs: after it ``trainer.step == n``) into
                ``<log_dir>/profile``, for xprof, TensorBoard's profile plugin (``plugins/profile/*/
                *.xplane.pb``) or Perfetto (``perfetto_trace.json.gz``). With ``steps_per_run > 1`` the trace
                covers the on-device loops that run those steps; a resumed run traces what is left of the
                window. Needs ``log_dir``.
            profile_processes: the processes that trace (``profile_steps``): a process index, several, or
                ``"all"``; default process 0.

        Returns:
            The `History` of logged metrics, and where the time went (``history.time``, ``history.goodput``).

        Raises:
            ValueError: for bad arguments, data of the wrong batch structure, batches the replicas do not
                divide, a non-scalar loss, a checkpoint_dir holding another model's checkpoint or one jaxdist
                did not write (the message shows the orbax and `load_state` that continue it), or
                ``restore_step`` without ``checkpoint_dir``.
            FileNotFoundError: for a ``restore_step`` that ``checkpoint_dir`` has no checkpoint of (the
                message names the steps it has).
            CheckpointCorruptedError: when the checkpoint to resume from is damaged: the message names it,
                the directory and the newest older checkpoint that restores (delete the damaged one, or pass
                that step as ``restore_step``).
            SystemExit: after a preemption checkpoint, with ``on_preemption="exit"``.
            NonFiniteError: (a `FloatingPointError`) when a step's loss or gradients were not finite and the
                policy stops (see ``on_non_finite``).
        """
        if steps is None and epochs is None:
            raise ValueError("fit needs steps=N (train until step N) or epochs=N (N passes over train_data).")
        check_int(epochs, "epochs", 0)
        options = FitOptions(steps=steps, eval_data=eval_data, eval_every=eval_every, checkpoint_every=checkpoint_every,
                             log_every=log_every, step_timeout=step_timeout, log_dir=log_dir,
                             profile_steps=profile_steps, profile_processes=profile_processes)  # checks them
        if on_preemption not in ("exit", "return"):
            raise ValueError(f"on_preemption={on_preemption!r} must be 'exit' or 'return'.")
        check_int(restore_step, "restore_step", 0)
        policy = NonFinitePolicy.of(on_non_finite)
        if policy.action == "rollback" and checkpoint_dir is None:
            raise ValueError(
                "on_non_finite='rollback' needs checkpoint_dir=... (it restores the last finite checkpoint): pass "
                "one (with checkpoint_every=...), or use on_non_finite='skip' or 'stop'."
            )
        if restore_step is not None and checkpoint_dir is None:
            raise ValueError(
                f"restore_step={restore_step} needs checkpoint_dir=... (the directory holding that checkpoint)."
            )
        if checkpoint_dir is not None:  # storage trouble before any step, not at the first save
            check_directory(checkpoint_dir, "checkpoint_dir", create=jax.process_index() == 0)
        stream = BatchStream(train_data, None, epochs, self._batches)  # the first batch, checked, for the state
        sample = None
        if self._state is None or self._unchecked:
            sample = stream.peek(self.data_position.epoch)  # checked; a grain iterator is not advanced
        settings = {"steps": steps, "epochs": epochs, "checkpoint_every": checkpoint_every, "eval_every": eval_every,
                    "log_every": log_every, "restore_step": restore_step, "keep_checkpoints": keep_checkpoints,
                    "checkpoint_dir": checkpoint_dir is not None, "on_non_finite": policy.action}
        with failing(self.strategy.mesh, lambda: self._step):  # a process that fails ends the job, with its reason
            agree_on_fit(self.strategy.mesh, settings, checkpoint_dir)  # before anything collective
            history = self._fit(train_data, stream, sample, checkpoint_dir, keep_checkpoints, async_checkpoints,
                                restore_step, epochs, steps, verbose, callbacks, log_dir, options, policy)
        if history.data_ended is not None and verbose and self.strategy.should_save_summary:
            print(f"fit: train_data ended at step {history.data_ended} of {steps}: the run stopped there "
                  "(history.data_ended).", flush=True)
        if history.preempted and on_preemption == "exit":
            raise SystemExit(0)
        return history

    def _fit(self, train_data: Any, stream: BatchStream, sample: Any, checkpoint_dir: Any, keep_checkpoints: int,
             async_checkpoints: bool, restore_step: int | None, epochs: int | None, steps: int | None, verbose: Any,
             callbacks: Any, log_dir: Any, options: FitOptions, policy: NonFinitePolicy) -> History:
        """``fit``'s body once its arguments are checked (and, with several processes, agreed)."""
        ckpt = None if checkpoint_dir is None else Checkpointer(checkpoint_dir, keep_checkpoints,
                                                                 async_save=async_checkpoints)
        try:
            if ckpt is not None:
                ckpt.claim()  # one writer per directory: a second live run is refused here, before any step
                ckpt.check_writer()  # another writer's checkpoints: the orbax that reads them, never written over
            resumed = ckpt is not None and (restore_step is not None or (ckpt.latest_step() or 0) > self._step)
            if restore_step is not None:
                self._roll_back(ckpt, restore_step, sample)
            elif ckpt is not None and (latest := ckpt.latest_step() or 0) > self._step:
                if self._loaded:  # the state load_state gave is about to be replaced: say so
                    warnings.warn(
                        f"fit resumes from checkpoint {latest} of checkpoint_dir={str(checkpoint_dir)!r}, which "
                        f"replaces the state load_state gave (step {self._step}); to train on from that state, pass a "
                        "checkpoint_dir without later checkpoints (or restore_step= to choose one).",
                        UserWarning, stacklevel=2)
                self._restore(ckpt, None, sample, "restore_step")
            if ckpt is not None and resumed:  # the position counts batches: another batch size moves it
                say_batch_change(ckpt.meta(self._step), global_rows(self._batches.signature), self.data_position)
            self._loaded = False
            if self._state is None or self._unchecked:
                self.init(sample)
            if self._position_unknown and not isinstance(train_data, Iterator):
                self._say_start()
            callbacks = list(callbacks)
            writer = self.strategy.should_save_summary  # one writer: the chief (process 0) shows and writes logs
            if verbose and writer:  # 1 / True: "auto"; 2: "auto" with the step's whole cost line
                callbacks.insert(0, Progress(steps, "auto" if verbose in (True, 1, 2) else verbose,
                                             details=verbose == 2, resumed_from=checkpoint_dir if resumed else None))
            if log_dir is not None and writer:
                callbacks += [CSVLogger(os.path.join(log_dir, "metrics.csv")), TensorBoardLogger(log_dir)]
            options = dataclasses.replace(options, checkpointer=ckpt, callbacks=tuple(callbacks),
                                          steps_per_run=self.steps_per_run, mesh=self.strategy.mesh,
                                          on_non_finite=policy)
            feed = self._feed if self.steps_per_run == 1 else self._loop_feed
            self._steps.skip_non_finite = policy.action == "skip"  # a step variant that skips on the devices
            history = run_fit(self, BatchStream(stream.data, self.data_position, epochs, feed), options)
        finally:
            self._steps.skip_non_finite = False
            if ckpt is not None:
                ckpt.close()
        return history

    def _say_start(self) -> None:
        """After `load_state`: say that ``fit`` reads a list (or ``data_fn``) from its first batch, and how to
        say otherwise (once: setting `data_position` says where, and ends the warning)."""
        self._position_unknown = False
        warnings.warn(
            f"fit continues the run load_state loaded at step {self._step} from batch 0 of epoch 0 of train_data "
            "(where that run's data stopped is unknown). If train_data starts with the batches that run trained "
            f"on, set trainer.data_position = jd.training.DataPosition(epoch=0, index={self._step}) before fit to "
            "skip them; if it starts with the batches that come next, set trainer.data_position = "
            "jd.training.DataPosition() to say so. Either silences this; an iterator is read on from where it is.",
            UserWarning,
            stacklevel=3,
        )

    def _roll_back(self, ckpt: Checkpointer, step: int, sample: Any) -> None:
        """``fit(restore_step=step)``: restore that checkpoint, then delete the later ones (another run's: kept,
        they would be resumed from next time, and a save at one of their steps would be skipped as done)."""
        steps = ckpt.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"restore_step={step}: {ckpt.directory!r} has no checkpoint for step {step}; it has steps {steps}: "
                "pass one of them, or leave restore_step out to resume from the latest."
            )
        self._restore(ckpt, step, sample, "restore_step")
        ckpt.abandon_after(step)  # recorded first: an interruption cannot bring them back as the newest

    # --------------------------------------------------------------------------------- evaluate, predict
    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and metrics averaged over EVERY example of ``data`` (evaluation mode).

        Args:
            data: batches ``(x, y)`` / dicts with ``input_key`` and ``target_key``, of any size (a ragged
                last batch is padded to a multiple of the replica count and its padding masked out): a list,
                an iterator, or a function of no arguments returning an iterable.

        Returns:
            ``{"loss": ..., <metric>: ...}`` as floats.

        Raises:
            ValueError: for batches of the wrong structure, or empty data.
        """
        return self._steps.evaluate(self._state_for, data, self._batches.split)

    def predict(self, data: Any) -> Any:
        """The model's outputs (evaluation mode) for every example of ``data``, as numpy arrays.

        Args:
            data: batches of inputs: ``x``, ``(x,)``, ``(x, y)`` or dicts with ``input_key`` (targets are
                ignored), any size (padded and stripped like `evaluate`); a single array is one batch.

        Returns:
            The outputs concatenated along axis 0 (a pytree of arrays if the model returns one).
        """
        return self._steps.predict(self._state_for, data, self._batches.split)

    def _state_for(self, batch: Any) -> TrainState:
        """The state; built from ``batch`` (a placed one) the first time."""
        return self._state if self._state is not None and not self._unchecked else self.init(jax.device_get(batch))


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"Trainer.{old}() is deprecated: use Trainer.{new}(), which returns a jd.training.RunningSums read by name "
        f"(sums = trainer.{new}().to_host(); sums.mean('loss'), sums.steps, sums.non_finite.count) instead of "
        "(names, vector).", DeprecationWarning, stacklevel=3)


def _packed(sums: PackedSums) -> tuple[tuple[str, ...], Any]:
    """What ``pop_metric_sums`` returned: ``(sums.fields, sums.vector)``; before the first training step (no
    metrics known yet) ``(("steps",), zeros(1))``."""
    return (sums.fields, sums.vector) if sums.names else (("steps",), np.zeros(1, np.float32))
