"""`Trainer`: one training loop for Flax linen and nnx models with optax, unchanged on every
strategy.

The train step is an ordinary single-device step compiled with ``strategy.jit`` on a state born in
the strategy's layout (`jaxdist.training.step`), so ``fit`` on any strategy computes what the same
training computes on one device: the loss and metrics are means over the GLOBAL batch. Resuming is
exact: the step counter drives the RNG (``fold_in(rng, step)``) and the checkpoint stores the data
position, so a resumed run's parameters are bitwise identical to an uninterrupted run's.

The Trainer is a facade over a `jaxdist.training.step.LiveState` (state, step counter, data
position): `jaxdist.training.checkpoints` saves, restores and loads it, `jaxdist.training.loop` runs
``fit`` on it and hands the trainer to the callbacks only.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import optax

from jaxdist.costs.step import CostOptions, StepCost
from jaxdist.strategies import Plan, Strategy
from jaxdist.training.callbacks import Callback, History
from jaxdist.training.checkpoints import Checkpointer, load_live, restore_live, save_live
from jaxdist.training.data import DataPosition
from jaxdist.training.loop import FitOptions
from jaxdist.training.loop import fit as fit_live
from jaxdist.training.step import LiveState, NonFinitePolicy, PackedSums, TrainState, check_int

__all__ = ["Trainer"]


class Trainer:
    """Train a Flax (linen or nnx) model with an optax optimizer on any strategy.

    Args:
        strategy: a `jd.Strategy` (``MirroredStrategy()``, ``OneDeviceStrategy()``, ...).
        model: a `flax.linen.Module` instance or a `flax.nnx.Module` instance (detected from its
            type). An nnx module whose ``__call__`` takes ``rngs`` (as in the NNX tutorial, for
            ``nnx.Dropout``) gets a fresh ``nnx.Rngs`` each training step (see `NnxModel`).
        optimizer: an optax ``GradientTransformation``; learning-rate schedules work as in optax
            (build it with `optax.inject_hyperparams` to have the learning rate logged).
        loss_fn: ``loss_fn(outputs, targets)`` returning the MEAN loss over the batch, e.g.
            ``lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()``,
            or a token-weighted pair ``(sum, weight)``: the SUM of per-token losses and how many
            (real) tokens it covers, e.g. ``return (losses * mask).sum(), mask.sum()``, divided once
            over the global batch, its micro-batches and each log window (so padding never biases
            the mean).
        metrics: extra ``{name: fn(outputs, targets)}``, each a batch mean or a ``(sum, weight)``
            pair, e.g. ``{"accuracy": jd.training.accuracy}``.
        input_key: for batches given as dicts: the key of the model's inputs, e.g.
            ``input_key="image"`` for ``{"image": ..., "label": ...}``. A tuple of keys passes their
            values as a dict. Other keys than the input and target keys are dropped on the host (one
            warning). Batches given as pairs ``(x, y)`` ignore it.
        target_key: for batches given as dicts: the key of the targets (``target_key="label"``
            above), or a tuple of keys, as ``input_key``.
        variables: linen only: variables to start from (e.g. pretrained) instead of ``model.init``.
        grad_accum_steps: split each batch into this many micro-batches per optimizer step (one
            update equal to a step on the whole batch, with the activation memory of a micro-batch).
        compute_dtype: e.g. ``jnp.bfloat16``: mixed precision (bf16 compute; float32 parameters,
            gradients and optimizer state).
        clip_grad_norm: clip gradients to this global norm before the optimizer (None: no clipping).
        seed: seeds parameter init (linen) and the per-step key (``fold_in(key, step)``) behind
            linen rng streams and nnx call-time ``rngs``.
        train_kwargs: linen only: keyword arguments for ``model.apply`` in training (e.g.
            ``{"train": True}``).
        eval_kwargs: linen only: keyword arguments for ``model.apply`` in evaluation and prediction
            (e.g. ``{"train": False}``).
        rng_streams: linen only: rng names given a fresh key each step (default ``("dropout",)``).
        steps_per_run: steps per compiled on-device loop in ``fit`` (default:
            ``strategy.steps_per_run`` for a `TPUStrategy`, else 1). A loop ends early at a log,
            evaluation or checkpoint point, so those see the same steps as one step at a time (make
            ``log_every`` a multiple of it to keep the loops full).
        tokens_per_example: tokens in one example (a language model's sequence length): logs then
            show ``tokens_per_sec`` = rows x this / step time (padding included: what the devices
            process). None: a token-weighted loss's summed weight counts the tokens (the real ones);
            other losses log none.
        peak_flops: peak FLOP/s of ONE device for ``mfu`` and ``hfu`` (e.g. a measured peak),
            instead of the datasheet's dense bf16 figure for A100, H100, H200, B200 and TPU v4 / v5e
            / v5p / v6e (`jaxdist.costs.ACCELERATORS`). Without either (CPU), both are "n/a".
        flops_per_step: the model's FLOPs per optimizer step over the global batch (e.g. 6 x
            parameters x tokens), the basis of ``mfu`` (model FLOPs utilisation); without it, the
            compiled step's FLOPs without recomputation. ``hfu`` (hardware FLOPs utilisation)
            always counts what the compiled step executes.
        ema_decay: keep averaged weights (`ema_params`): ``ema = ema_decay * ema + (1 - ema_decay)
            * params`` after each optimizer step (a skipped non-finite step leaves it), from the
            first parameters, on the devices in their layout and dtype; saved in checkpoints, used
            by ``evaluate(..., ema=True)`` and ``predict(..., ema=True)``. A checkpoint without them
            (and `load_state`) starts them from its parameters. None (default): none.

    Raises:
        TypeError: for a strategy, model, optimizer or loss_fn of the wrong kind (a module class
            instead of an instance; linen options with an nnx module), or a key option that is not a
            string.
        ValueError: for out-of-range numbers (``peak_flops=-1``, ``ema_decay=1.0``), a metric named
            "loss", or ``variables`` with an nnx module.

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
        ema_decay: float | None = None,
    ):
        self.strategy, self.model, self.loss_fn = strategy, model, loss_fn
        self._live = LiveState(strategy, model, optimizer, loss_fn, metrics=metrics,
                               input_key=input_key, target_key=target_key, variables=variables,
                               grad_accum_steps=grad_accum_steps, compute_dtype=compute_dtype,
                               clip_grad_norm=clip_grad_norm, seed=seed, train_kwargs=train_kwargs,
                               eval_kwargs=eval_kwargs, rng_streams=rng_streams,
                               ema_decay=ema_decay)
        self.cost_options = CostOptions(tokens_per_example, peak_flops, flops_per_step)  # checks
        check_int(steps_per_run, "steps_per_run", 1)
        self.metrics, self.optimizer, self.seed = self._live.metrics, self._live.optimizer, seed
        self.input_key, self.target_key = self._live.input_key, self._live.target_key
        self.grad_accum_steps, self.compute_dtype = grad_accum_steps, compute_dtype
        self.ema_decay = self._live.ema_decay
        self.steps_per_run = steps_per_run or int(getattr(strategy, "steps_per_run", 1) or 1)

    @property
    def stop_training(self) -> bool:
        """Set it (from a callback) to end the running ``fit`` after the current step (cleared when
        ``fit`` starts); set on any process, every process stops after the same step."""
        return self._live.stop_training

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self._live.stop_training = bool(value)

    # ---------------------------------------------------------------------------------------- state
    @property
    def state(self) -> TrainState | None:
        """The `TrainState` in the strategy's layout (None before the first batch is seen)."""
        return self._live.state

    @property
    def params(self) -> Any:
        """The current parameters (a nested dict of arrays)."""
        return None if self._live.state is None else self._live.state.params

    @property
    def ema_params(self) -> Any:
        """The averaged weights (``Trainer(ema_decay=...)``): a tree like `params`, with their
        shardings; None before the first batch is seen or without ``ema_decay``.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean(),
            ...                               ema_decay=0.9)
            >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
            >>> start = np.asarray(trainer.init(batch).params["bias"])
            >>> _ = trainer.train_on_batch(batch)
            >>> bool(np.allclose(trainer.ema_params["bias"],
            ...                  0.9 * start + 0.1 * np.asarray(trainer.params["bias"])))
            True
        """
        return None if self._live.state is None else self._live.state.ema

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints, set by `load_state`)."""
        return self._live.step

    @property
    def data_position(self) -> DataPosition:
        """How far training has read ``train_data`` (saved in checkpoints; ``fit`` starts there).

        Set it after `load_state` to say where the loaded run's data stopped, e.g.
        ``trainer.data_position = jd.training.DataPosition(epoch=0, index=20)``: ``fit`` then skips
        the first 20 batches of epoch 0 of a list or ``data_fn(epoch)``.
        """
        return self._live.position

    @data_position.setter
    def data_position(self, position: DataPosition) -> None:
        self._live.position = position

    def init(self, batch: Any) -> TrainState:
        """Build the state from a sample batch (done on first use; call it to build it earlier):
        born in the strategy's layout (``strategy.create_variables``), no host copy; checks that
        ``loss_fn`` and each metric return a scalar.

        Args:
            batch: a batch ``(x, y)`` / a dict with ``input_key`` and ``target_key`` (only shapes
                matter), or just ``x``.

        Returns:
            The `TrainState`.

        Raises:
            ValueError: for a batch of the wrong structure, or a loss_fn / metric returning a
                non-scalar.
        """
        return self._live.init(batch)

    def sync_model(self) -> None:
        """Write the trained values back into the model the trainer was given (``fit`` does this at
        its end): nnx modules are updated in place; for linen modules (no values) a no-op.

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
        self._live.sync()

    # ---------------------------------------------------------------------------------------- steps
    def train_on_batch(self, batch: Any) -> dict[str, jax.Array]:
        """One optimizer step on one global batch (what ``fit`` runs per batch, without its loop).

        Args:
            batch: ``(x, y)`` or a dict with ``input_key`` / ``target_key``: host arrays (split over
                the replicas) or a batch of this strategy's distributed dataset; checked and placed
                here (a batch ``fit``'s stream has already checked and placed is taken as it is).

        Returns:
            The step's metrics (``"loss"``, each metric, ``"learning_rate"`` when logged) as device
            scalars: reading one waits for the step.

        Raises:
            ValueError: for a batch of the wrong structure, one the replicas (times
                ``grad_accum_steps``) do not divide, or one whose shapes differ from the first
                batch's.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> metrics = trainer.train_on_batch((np.ones((8, 2), np.float32),
            ...                                   np.ones(8, np.float32)))
            >>> trainer.step, sorted(metrics)
            (1, ['loss'])
        """
        return self._live.train(batch, "train_on_batch's batch")

    def train_on_batches(self, batches: Sequence[Any]) -> dict[str, jax.Array]:
        """``len(batches)`` optimizer steps in ONE compiled on-device loop
        (``strategy.run_steps_on_dataset``): the steps ``train_on_batch`` would take one by one.

        Args:
            batches: global batches of one shape, as for `train_on_batch`.

        Returns:
            Every step's metrics, stacked: ``{name: array of shape (len(batches),)}`` on the
            devices.

        Raises:
            ValueError: for no batches, or batches of the wrong structure or of different shapes.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.TPUStrategy(steps_per_run=4), nn.Dense(1),
            ...                               optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
            >>> metrics = trainer.train_on_batches([batch] * 4)
            >>> trainer.step, metrics["loss"].shape
            (4, (4,))
        """
        return self._live.train_loop(batches)

    def pop_running_sums(self) -> PackedSums:
        """The running sums of the steps taken since the last call, on the devices; restarts them.

        Every step (`train_on_batch`, `train_on_batches`) adds its metrics to them on the devices;
        ``fit`` pops them at each log point.

        Returns:
            The sums packed in one device vector (`jd.training.PackedSums`; zeros when no step ran
            since the last call); nothing waits here. Its ``to_host()`` reads them in one transfer
            as a `jd.training.RunningSums`: ``averages`` (each metric's ``Average(total, weight)``,
            ``"loss"`` first), ``non_finite`` (the record of the non-finite steps), ``steps`` and
            ``learning_rate`` (the last step's, when logged).

        Raises:
            RuntimeError: before the state exists (nothing trained or initialized yet).

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.0),
            ...                               lambda out, y: ((out[:, 0] * 0 + y) ** 2).mean())
            >>> for y in (1.0, 2.0):
            ...     _ = trainer.train_on_batch((np.ones((8, 2), np.float32),
            ...                                 np.full(8, y, np.float32)))
            >>> sums = trainer.pop_running_sums().to_host()
            >>> sums.mean("loss"), int(sums.steps), int(sums.non_finite.count)
            (2.5, 2, 0)
            >>> int(trainer.pop_running_sums().to_host().steps)  # restarted
            0
        """
        return self._live.sums("pop_running_sums")

    def peek_running_sums(self) -> PackedSums:
        """The running sums `pop_running_sums` would return, without restarting them: ``fit``
        reads the non-finite steps' record in them before a checkpoint. They stay readable after
        later ``train_on_batch`` steps; an on-device loop (``train_on_batches``) takes them over:
        read them before it.

        Returns:
            The `PackedSums`, as `pop_running_sums`.

        Raises:
            RuntimeError: before the state exists.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> _ = trainer.train_on_batch((np.ones((8, 2), np.float32),
            ...                             np.full(8, np.nan, np.float32)))
            >>> peeked = trainer.peek_running_sums().to_host()  # not restarted:
            >>> (int(peeked.non_finite.count), int(peeked.steps),
            ...  int(trainer.pop_running_sums().to_host().steps))
            (1, 1, 1)
        """
        return self._live.sums("peek_running_sums", pop=False)

    def step_cost(self) -> StepCost:
        """What one training step costs per device: FLOPs, peak FLOP/s, bytes of parameters,
        optimizer state and temporaries (``fit`` logs it once at its start; `jaxdist.costs.step`).
        Measured once from the compiled step found in JAX's cache (the FLOPs as in
        ``Trainer.plan(...).flops``); with ``steps_per_run > 1`` the single step is compiled for it.

        Raises:
            RuntimeError: before the first training step.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean(),
            ...                               peak_flops=1e9)
            >>> _ = trainer.train_on_batch((np.ones((8, 2), np.float32), np.ones(8, np.float32)))
            >>> cost = trainer.step_cost()
            >>> # kernel (2, 1) + bias (1,), float32
            >>> cost.flops > 0, cost.peak_flops, cost.param_bytes
            (True, 1000000000.0, 12)
        """
        return self._live.step_cost(self.cost_options)

    def plan(self, batch: Any) -> Plan:
        """The `jd.Plan` of the trainer's own train step on a global ``batch``: memory, FLOPs and
        collectives per device on the strategy's layout (the optimizer state, ``grad_accum_steps``,
        ``compute_dtype`` and all), compiled but never run. Before the state exists it is planned
        from its shapes (nothing is initialized or allocated), so a strategy over a plan mesh
        (`jd.plan_mesh`) works too.

        Args:
            batch: ``(x, y)`` or a dict with ``input_key`` / ``target_key``, of arrays or
                `jax.ShapeDtypeStruct`s: the global batch (only shapes and dtypes are read).

        Returns:
            A `jd.Plan`.

        Raises:
            ValueError: for a batch of the wrong structure, or one the replicas do not divide.

        Examples:
            >>> import flax.linen as nn, jax, numpy as np, optax, jaxdist as jd
            >>> trainer = jd.training.Trainer(jd.ShardedStrategy(min_shard_size=1), nn.Dense(64),
            ...                               optax.adam(1e-3),
            ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
            >>> plan = trainer.plan((jax.ShapeDtypeStruct((32, 64), np.float32),
            ...                      np.ones(32, np.float32)))
            >>> plan.state_bytes["params"] == (64 * 64 + 64) * 4 // 8, trainer.state is None
            (True, True)
        """
        return self._live.plan(batch)

    # ---------------------------------------------------------------------------------- checkpoints
    def save(self, checkpoint_dir: str | os.PathLike | Checkpointer,
             max_to_keep: int | None = 3) -> str:
        """Write a checkpoint of the state, step, data position and RNG, unless the state is not
        finite.

        A state with a NaN or an infinity in its parameters or model state, or a NaN in its
        optimizer state, is refused, so the rotation never deletes the newest finite checkpoint in
        favour of a diverged one (one pass over the state on the devices per save).

        Args:
            checkpoint_dir: a directory, or an open `Checkpointer` (left open; its own
                ``max_to_keep``).
            max_to_keep: with a directory: how many recent checkpoints to keep there.

        Returns:
            The checkpoint's path.

        Raises:
            RuntimeError: before the state exists (nothing trained or initialized yet).
            NonFiniteError: (a `FloatingPointError`) when the state is not finite, naming the leaves
                and the newest checkpoint there is; nothing is written.
        """
        return save_live(self._live, checkpoint_dir, max_to_keep)

    def restore(self, checkpoint_dir: str | os.PathLike | Checkpointer, step: int | None = None,
                batch: Any = None) -> int:
        """Load a checkpoint (default: the latest) onto THIS trainer's strategy, whatever wrote it.

        With ``ema_decay``, the averaged weights come from the checkpoint; from one without them
        they start again from its parameters, with a warning.

        Args:
            checkpoint_dir: the directory ``fit`` or `save` wrote, or an open `Checkpointer` (left
                open).
            step: which checkpoint; None for the latest.
            batch: a sample batch, needed only when the state does not exist yet (see `init`).

        Returns:
            The restored step.

        Raises:
            FileNotFoundError: when there is no checkpoint (or none for ``step``, naming the steps
                there are).
            ValueError: for another model's checkpoint (or one of an nnx model into a linen trainer
                and vice versa), an optimizer state that does not fit, or no ``batch`` when the
                state does not exist; for a checkpoint jaxdist did not write (plain orbax's),
                showing the two lines of orbax and `load_state` that continue it.
            CheckpointCorruptedError: when the checkpoint's files are damaged, naming the newest
                older checkpoint that restores into this trainer (the trainer is left as it was).
        """
        return restore_live(self._live, checkpoint_dir, step, batch)

    def load_state(self, params: Any, opt_state: Any = None, step: int | None = None,
                   model_state: Any = None, *, batch: Any = None) -> TrainState:
        """Continue a run trained elsewhere (plain JAX / Flax, saved with plain orbax or any other
        way): place its parameters, optimizer state and step onto this trainer's strategy.

        Each piece is checked leaf by leaf against the state this trainer builds, then placed in the
        strategy's layout (`jaxdist.training.checkpoints._load`): each device gets only its part of
        a host array, device arrays of any layout are resharded, and the arrays passed stay valid.
        Leaves match by name, whatever holds them: the optax state orbax restores without a target
        (NamedTuples as dicts, tuples as lists), an ``nnx.State``, an ``nnx.Optimizer``'s
        ``opt_state`` all fit. On several processes each passes the same values, or global
        `jax.Array` s. With ``ema_decay`` the averaged weights start again from the parameters.

        ``fit`` continues from here: to ``steps`` in total (``fit(steps=30)`` after ``step=20``
        takes 10 steps), with the per-step keys, checkpoints and logs of step 21 on. An iterator is
        read on from where it is; a list or a ``data_fn(epoch)`` is read from its first batch unless
        `data_position` is set (``fit`` says so with a warning when it is not).

        Args:
            params: the model's parameters (linen: ``variables["params"]``; nnx: ``nnx.state(model,
                nnx.Param)`` or its pure dict).
            opt_state: the state of the optimizer this trainer was given (the same optax
                transformation, so its schedule continues); None: a fresh one
                (``optimizer.init(params)``: moments and schedule start over).
            step: the steps the run took: the trainer's step counter (per-step RNG keys, checkpoint
                numbers, ``fit``'s totals); None: unchanged.
            model_state: the model's other variables (linen: the collections besides ``"params"``,
                e.g. ``{"batch_stats": ...}``; nnx: every variable that is not an ``nnx.Param``);
                None: the trainer's (a new trainer's: what `init` builds).
            batch: a sample batch (optional): for a linen model whose trainer has no state yet, the
                model's shapes come from it; without it the pieces are checked against each other
                (the optimizer state against ``optimizer.init(params)``'s shapes) and against the
                model at its first batch, before any update (its other variables, e.g. batch
                statistics, then start as a new run's).

        Returns:
            The new `TrainState` (also `state`).

        Raises:
            ValueError: when a piece does not fit the model and optimizer: a leaf missing or extra,
                a shape or dtype that differs (naming each such leaf by its path, e.g.
                ``opt_state[0].mu['Dense_0'] ['kernel']``), for a ``step`` that is not an int >= 0;
                parameters that do not fit the model, at its first batch when no ``batch`` was
                given. The trainer is left as it was.

        Warns:
            UserWarning: when the optimizer state's own step count (Adam's, a schedule's ``count``)
                differs from the trainer's step after the load (the schedule would follow one, the
                RNG and ``fit`` the other).

        Examples:
            >>> import flax.linen as nn, jax, numpy as np, optax, jaxdist as jd
            >>> model, optimizer = nn.Dense(2), optax.adam(optax.linear_schedule(1e-2, 0.0, 100))
            >>> x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
            >>> params = model.init(jax.random.key(0), x)["params"]  # a run of 20 steps elsewhere
            >>> opt_state = optimizer.init(params)
            >>> for _ in range(20):
            ...     grads = jax.grad(lambda p: ((model.apply({"params": p},
            ...                                              x) - y) ** 2).mean())(params)
            ...     updates, opt_state = optimizer.update(grads, opt_state, params)
            ...     params = optax.apply_updates(params, updates)
            >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), model, optimizer,
            ...                               lambda out, y: ((out - y) ** 2).mean())
            >>> _ = trainer.load_state(params=params, opt_state=opt_state, step=20)  # no batch
            >>> _ = trainer.fit(iter([(x, y)] * 5), steps=25, verbose=0)  # schedule: on at 21
            >>> trainer.step, int(trainer.state.opt_state[0].count)
            (25, 25)
        """
        return load_live(self._live, params, opt_state, step, model_state, batch)

    # ------------------------------------------------------------------------------------------ fit
    def fit(
        self,
        train_data: Any,
        steps: int | None = None,
        *,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        eval_data: Any = None,
        eval_every: int | str | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | str | datetime.timedelta | None = None,
        keep_checkpoints: int = 3,
        local_checkpoint_dir: str | os.PathLike | None = None,
        local_checkpoint_every: int | None = None,
        async_checkpoints: bool = True,
        log_every: int = 10,
        log_dir: str | os.PathLike | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: str | int = "auto",
        on_preemption: str = "exit",
        restore_step: int | None = None,
        step_timeout: float | None = None,
        on_non_finite: str | NonFinitePolicy = "stop",
        straggler_ratio: float | None = 1.25,
        profile_steps: tuple[int, int] | None = None,
        profile_processes: int | Sequence[int] | str = (0,),
    ) -> History:
        """Train until the step counter reaches ``steps`` (or ``epochs`` epochs end).

        Both counts are totals: a resumed run (same ``checkpoint_dir``) restores the latest
        checkpoint, continues from its step and data position, and stops where an uninterrupted run
        would, with bitwise the same state. Epochs are Keras': ``epochs=3, steps_per_epoch=70``
        trains 210 steps in 3 epochs of 70 (the data read on across passes, as Keras reads a
        repeated dataset); ``epochs=3`` alone is 3 passes over ``train_data``. A fit that counts
        epochs shows them in its progress lines and `History` (``history.epochs``,
        ``history.history``) and calls ``on_epoch_begin`` / ``on_epoch_end``. The keyword
        arguments are one `jaxdist.training.loop.FitOptions`.

        Args:
            train_data: global batches ``(x, y)`` or dicts with ``input_key`` / ``target_key``, of
                one shape: a function ``epoch -> iterable``, a re-iterable (a list: repeated each
                epoch) or an iterator (read once). Resuming needs the same batches per epoch.
            steps: train until ``trainer.step == steps``.
            epochs: stop after this many epochs in total (with ``steps``, whichever comes first).
            steps_per_epoch: an epoch is this many steps; None: one pass over ``train_data``.
            eval_data: batches for `evaluate` (any size), evaluated every ``eval_every`` steps and
                at the end.
            eval_every: steps between evaluations, or ``"epoch"``: at every epoch's end (Keras'
                ``validation_data``: ``on_epoch_end`` gets ``val_<name>``). None: at the end only.
            checkpoint_dir: restore the latest checkpoint from here (a resume), and save here as
                ``checkpoint_every`` says, at the end and on preemption. None: no checkpoints.
            checkpoint_every: when to save besides the end and a preemption: every N steps (an int),
                ``"epoch"``, or a `datetime.timedelta` (at the first log point that long after the
                last checkpoint). None (default): at every epoch's end when the fit counts epochs
                (as Keras' ``BackupAndRestore``), and every 10 minutes
                (`jaxdist.training.loop._cadence` says why). The first progress line says which.
            keep_checkpoints: how many recent checkpoints to keep.
            local_checkpoint_dir: the local tier: each process's own directory (``{process}``
                becomes its index, e.g. ``"/mnt/ssd/ckpt-{process}"``), saved every
                ``local_checkpoint_every`` steps with the process's shards and a copy of the next
                process's; a restart restores the newest step the survivors' copies assemble, else
                ``checkpoint_dir`` (needed), and logs which (`jaxdist.training.LocalCheckpointer`).
            local_checkpoint_every: steps between local checkpoints (with ``local_checkpoint_dir``).
            async_checkpoints: write checkpoints in the background (training goes on once the state
                is in host memory); ``fit`` returns once the last is complete. False: saves block.
            log_every: steps between log points: the mean of every metric over the window,
                steps/s, the window's seconds by part (``time/<part>``) and, where known,
                ``tokens_per_sec``, ``mfu`` and ``peak_bytes_in_use``. A log is emitted once the
                devices have its values, never waited for.
            log_dir: also write ``metrics.csv`` and TensorBoard event files here.
            callbacks: `Callback` instances (their hooks may stop the run, save or skip:
                `FitControl`).
            verbose: ``"auto"`` (a bar on a terminal, lines otherwise), ``"bar"``, ``"lines"``, 2
                (``"auto"`` with the step's whole cost line), or 0 (silent).
            on_preemption: on SIGTERM (to any process) the current step finishes and a checkpoint is
                saved; then ``"exit"`` raises ``SystemExit(0)``, ``"return"`` returns with
                ``history.preempted = True``.
            restore_step: resume from this checkpoint instead of the latest (the later ones are
                deleted once it is restored); steps taken again count as ``history.time["lost"]``.
            step_timeout: seconds a step may take before the process prints every thread's stack and
                exits with status 124 (`jaxdist.training.Watchdog`; the first step gets ``max(10 *
                step_timeout, 600)``). None (default): not watched.
            on_non_finite: what a step with a non-finite loss or gradients does, read with the logs
                and before every checkpoint: ``"stop"`` (raise `NonFiniteError`), ``"skip"`` (the
                step changes nothing), ``"rollback"`` (to the last finite checkpoint),
                ``"continue"``, or a `NonFinitePolicy`. A non-finite state is never saved.
            straggler_ratio: with several processes, a process whose input wait per step is this
                many times the median's is named in a `StragglerWarning` (``history.processes``
                keeps every window's figures). None: nobody is named.
            profile_steps: ``(start, stop)``: trace steps ``start ... stop - 1`` with `jax.profiler`
                into ``<log_dir>/profile`` (needs ``log_dir``).
            profile_processes: the processes that trace: an index, several, or ``"all"`` (default
                process 0).

        Returns:
            The `History` of logged metrics, and where the time went (``history.time``,
            ``history.goodput``).

        Raises:
            ValueError: for bad arguments or data, or a ``checkpoint_dir`` holding another model's
                checkpoint or one jaxdist did not write (the message shows how to continue it).
            FileNotFoundError: for a ``restore_step`` that ``checkpoint_dir`` has no checkpoint of.
            CheckpointCorruptedError: when the checkpoint to resume from is damaged (the message
                names the newest one that restores).
            SystemExit: after a preemption checkpoint, with ``on_preemption="exit"``.
            NonFiniteError: when a step was not finite and the policy stops.
            JobDisagreementError: with several processes, on every process, when they called ``fit``
                differently or passed different global batches (compared at the first step and at
                log points; with per-process input each passes its own part).
        """
        arguments = {k: v for k, v in locals().items() if k not in ("self", "train_data")}
        options = FitOptions(**arguments, steps_per_run=self.steps_per_run)
        settings = {"steps_per_run": self.steps_per_run, "grad_accum_steps": self.grad_accum_steps,
                    "compute_dtype": self.compute_dtype, "ema_decay": self.ema_decay,
                    "seed": self.seed}
        return fit_live(self._live, train_data, options, owner=self, cost=self.cost_options,
                        settings=settings)

    # ---------------------------------------------------------------------------- evaluate, predict
    def evaluate(self, data: Any, *, ema: bool = False) -> dict[str, float]:
        """Loss and metrics averaged over EVERY example of ``data`` (evaluation mode).

        Args:
            data: batches ``(x, y)`` / dicts with ``input_key`` and ``target_key``, of any size (a
                ragged last batch is padded to a multiple of the replica count and its padding
                masked out): a list, an iterator, or a function of no arguments returning an
                iterable.
            ema: evaluate the averaged weights (`ema_params`) instead of the parameters.

        Returns:
            ``{"loss": ..., <metric>: ...}`` as floats.

        Raises:
            ValueError: for batches of the wrong structure, or empty data; ``ema=True`` without
                ``ema_decay``.
        """
        return self._live.evaluate(data, ema)

    def predict(self, data: Any, *, ema: bool = False) -> Any:
        """The model's outputs (evaluation mode) for every example of ``data``, as numpy arrays.

        Args:
            data: batches of inputs: ``x``, ``(x,)``, ``(x, y)`` or dicts with ``input_key``
                (targets are ignored), any size (padded and stripped like `evaluate`); a single
                array is one batch.
            ema: predict with the averaged weights (`ema_params`) instead of the parameters.

        Returns:
            The outputs concatenated along axis 0 (a pytree of arrays if the model returns one).

        Raises:
            ValueError: ``ema=True`` without ``ema_decay``.
        """
        return self._live.predict(data, ema)
