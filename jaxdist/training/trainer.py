"""`Trainer`: one training loop for Flax linen and nnx models with optax, unchanged on every strategy.

The train step is an ordinary single-device step (`jaxdist.training.step`) compiled with
``strategy.jit(step, donate_argnums=(0,))``; the state is born in the strategy's layout with
``strategy.create_variables``; batches go through ``strategy.experimental_distribute_dataset`` (which checks
divisibility and prefetches). So ``fit`` on any strategy computes what the same training computes on one
device, and the loss and metrics are means over the GLOBAL batch.

Resuming is exact: the state's step counter drives the RNG (``fold_in(rng, step)``), the checkpoint stores the
data position, and a resumed ``fit`` with the same ``checkpoint_dir`` re-reads the same epoch and skips the
batches already used, so its parameters are bitwise identical to an uninterrupted run's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist.strategies import Strategy
from jaxdist.training.callbacks import Callback, CSVLogger, History, Progress, TensorBoardLogger
from jaxdist.training.checkpoint import Checkpointer
from jaxdist.training.data import BatchStream, DataPosition, eval_batches, signature
from jaxdist.training.fitting import run_loop
from jaxdist.training.models import as_model
from jaxdist.training.step import (
    TrainState,
    make_eval_step,
    make_predict_step,
    make_train_step,
    split_batch,
)

__all__ = ["Trainer"]


def _check_int(value: Any, name: str, minimum: int, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{' or None' if allow_none else ''}.")


def _abstract(tree: Any) -> Any:
    def one(a):
        dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
        return jax.ShapeDtypeStruct(np.shape(a), jax.dtypes.canonicalize_dtype(dtype))

    return jax.tree.map(one, tree)


class Trainer:
    """Train a Flax (linen or nnx) model with an optax optimizer on any strategy.

    Args:
        strategy: a `jd.Strategy` (``MirroredStrategy()``, ``OneDeviceStrategy()``, ...).
        model: a `flax.linen.Module` instance or a `flax.nnx.Module` instance (detected from its type).
        optimizer: an optax ``GradientTransformation``; learning-rate schedules work as in optax (build it
            with `optax.inject_hyperparams` to have the learning rate logged).
        loss_fn: ``loss_fn(outputs, targets) -> scalar``: the MEAN loss over the batch, e.g.
            ``lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()``.
        metrics: extra ``{name: fn(outputs, targets) -> scalar}`` batch means, e.g.
            ``{"accuracy": jd.training.accuracy}``.
        variables: linen only: variables to start from (e.g. pretrained) instead of ``model.init``.
        grad_accum_steps: split each batch into this many micro-batches per optimizer step (one update
            equal to a step on the whole batch, with the activation memory of a micro-batch).
        compute_dtype: e.g. ``jnp.bfloat16``: mixed precision (bf16 compute; float32 parameters, gradients
            and optimizer state).
        clip_grad_norm: clip gradients to this global norm before the optimizer (None: no clipping).
        seed: seeds parameter init (linen) and the per-step RNG (linen rng streams such as dropout).
        train_kwargs / eval_kwargs: linen only: keyword arguments for ``model.apply`` in training / in
            evaluation and prediction (e.g. ``{"train": True}`` / ``{"train": False}``).
        rng_streams: linen only: rng names given a fresh key each step (default ``("dropout",)``).
        steps_per_run: steps per compiled on-device loop when the strategy has ``run_steps_on_dataset``
            (default: ``strategy.steps_per_run``, else 1).

    Raises:
        TypeError: for a strategy, model, optimizer or loss_fn of the wrong kind (a module class instead of
            an instance; linen options with an nnx module).
        ValueError: for out-of-range numbers, a metric named "loss", or ``variables`` with an nnx module.

    Example:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> trainer = jd.training.Trainer(
        ...     jd.MirroredStrategy(), nn.Dense(2), optax.sgd(0.1),
        ...     lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean())
        >>> data = [(np.ones((8, 3), np.float32), np.zeros(8, np.int32))] * 4
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
        variables: Any = None,
        grad_accum_steps: int = 1,
        compute_dtype: Any = None,
        clip_grad_norm: float | None = None,
        seed: int = 0,
        train_kwargs: dict | None = None,
        eval_kwargs: dict | None = None,
        rng_streams: Sequence[str] | None = None,
        steps_per_run: int | None = None,
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
            raise TypeError(f"loss_fn={loss_fn!r} is not callable: pass loss_fn(outputs, targets) -> scalar.")
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if name == "loss" or not isinstance(name, str) or not callable(fn):
                raise ValueError(
                    f"metrics[{name!r}]={fn!r}: metrics map names other than 'loss' to fn(outputs, targets) -> "
                    "scalar (the loss is always reported as 'loss')."
                )
        _check_int(grad_accum_steps, "grad_accum_steps", 1, allow_none=False)
        _check_int(steps_per_run, "steps_per_run", 1)
        _check_int(seed, "seed", 0, allow_none=False)
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
        self.optimizer = optax.chain(optax.clip_by_global_norm(clip_grad_norm), optimizer) if clip_grad_norm \
            else optimizer
        self.grad_accum_steps = grad_accum_steps
        self.compute_dtype = compute_dtype
        self.seed = seed
        self.steps_per_run = steps_per_run or int(getattr(strategy, "steps_per_run", 1) or 1)
        self.stop_training = False
        self.data_position = DataPosition()
        self._state: TrainState | None = None
        self._step = 0
        self._batch_signature: tuple | None = None
        train_step = make_train_step(self._model, self.optimizer, loss_fn, metrics, grad_accum_steps, compute_dtype)
        self._train_step_fn = train_step
        self._train_step = strategy.jit(train_step, donate_argnums=(0,))
        self._eval_step = strategy.jit(make_eval_step(self._model, loss_fn, metrics, compute_dtype))
        self._predict_step = strategy.jit(make_predict_step(self._model, compute_dtype))
        self._loop_step: Callable | None = None

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
        """Optimizer steps taken so far (restored from checkpoints)."""
        return self._step

    def init(self, batch: Any) -> TrainState:
        """Build the state from a sample batch (done on first use; call it to build it earlier).

        Runs ``model.init`` (linen; nnx modules bring their variables) and ``optimizer.init`` under
        ``strategy.create_variables``: born in the strategy's layout, no host copy. Checks that ``loss_fn``
        returns a scalar and each metric too.

        Args:
            batch: a batch ``(x, y)`` / ``{"x": ..., "y": ...}`` (only shapes matter), or just ``x``.

        Returns:
            The `TrainState`.

        Raises:
            ValueError: for a batch of the wrong structure, or a loss_fn / metric returning a non-scalar.
        """
        if self._state is not None:
            return self._state
        build, args, x, y = self._builder(batch)
        if y is not None:
            self._check_losses(jax.eval_shape(build, *args), x, y)  # before anything compiles
        with self.strategy.scope():
            self._state = self.strategy.create_variables(build, *args)
        return self._state

    def _builder(self, batch: Any) -> tuple[Callable, tuple, Any, Any]:
        x, y = split_batch(batch, "the first batch", need_targets=False)
        sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)

        def build(rng, x_sample, given):
            init_rng, step_rng = jax.random.split(rng)
            params, model_state = self._model.init(init_rng, x_sample, given)
            return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params), model_state, step_rng)

        given = getattr(self._model, "initial_variables", None)
        return build, (jax.random.key(self.seed), sample, given), x, y

    def _restore_target(self, batch: Any) -> Any:
        """What a restore reads into: the live state, or (cheaper: nothing is computed or allocated twice)
        abstract arrays carrying the strategy's variable layout."""
        if self._state is not None:
            return self._state
        if batch is None:
            raise ValueError("restore() needs batch=... (a sample batch) to build the state it restores into.")
        build, args, x, y = self._builder(batch)
        shapes = jax.eval_shape(build, *args)
        if y is not None:
            self._check_losses(shapes, x, y)
        layouts = self.strategy.variable_shardings(shapes)  # the layout create_variables would use
        return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            shapes, layouts)

    def _check_losses(self, state: TrainState, x: Any, y: Any) -> None:
        def outputs(s, xb):
            return self._model.apply(s.params, s.model_state, xb, None, train=False)[0]

        out = jax.eval_shape(outputs, state, _abstract(x))
        y_abs = _abstract(y)
        for name, fn in {"loss_fn": self.loss_fn, **{f"metrics[{k!r}]": f for k, f in self.metrics.items()}}.items():
            got = jax.eval_shape(fn, out, y_abs)
            if not isinstance(got, jax.ShapeDtypeStruct) or got.shape != () or not jnp.issubdtype(
                got.dtype, jnp.inexact if name == "loss_fn" else jnp.number
            ):
                desc = got if not isinstance(got, jax.ShapeDtypeStruct) else f"shape {got.shape} {got.dtype}"
                raise ValueError(
                    f"{name} returned {desc} for a batch of {jax.tree.leaves(y_abs)[0].shape[0]} rows; it must "
                    "return a float scalar, the mean over the batch: reduce it, e.g. "
                    "optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()."
                )

    def _check_batch(self, batch: Any, where: str) -> None:
        split_batch(batch, where)
        sig = signature(batch)
        if self._batch_signature is None:
            rows = np.shape(jax.tree.leaves(batch)[0])[0] if jax.tree.leaves(batch) else 0
            need = self.strategy.num_replicas_in_sync * self.grad_accum_steps
            if rows % need:
                raise ValueError(
                    f"{where} has {rows} rows, which {self.strategy.num_replicas_in_sync} replicas x "
                    f"grad_accum_steps={self.grad_accum_steps} do not divide: use a global batch that is a "
                    f"multiple of {need} (e.g. {-(-rows // need) * need}), dropping or padding the remainder."
                )
            self._batch_signature = sig
        elif sig != self._batch_signature:
            raise ValueError(
                f"{where} has structure/shapes {sig[1]} ({sig[0]}), but the first training batch had "
                f"{self._batch_signature[1]} ({self._batch_signature[0]}): every training batch needs the same "
                "structure and shapes (one compiled step); drop the ragged last batch or pad it."
            )

    # ------------------------------------------------------------------------------------- checkpoints
    def save(self, checkpoint_dir: str | os.PathLike, max_to_keep: int | None = 3) -> str:
        """Write a checkpoint of the state, step, data position and RNG into ``checkpoint_dir``.

        Returns:
            The checkpoint's path.

        Raises:
            RuntimeError: before the state exists (nothing trained or initialized yet).
        """
        if self._state is None:
            raise RuntimeError("save() before the state exists: call fit(...) or init(batch) first.")
        ckpt = Checkpointer(checkpoint_dir, max_to_keep)
        try:
            return self._save(ckpt)
        finally:
            ckpt.close()

    def _save(self, ckpt: Checkpointer) -> str:
        meta = {"model_kind": self._model.kind, "data_position": vars(self.data_position).copy()}
        return ckpt.save(self._step, self._state, meta)

    def restore(self, checkpoint_dir: str | os.PathLike, step: int | None = None, batch: Any = None) -> int:
        """Load a checkpoint (default: the latest) onto THIS trainer's strategy, whatever wrote it.

        Args:
            checkpoint_dir: the directory ``fit`` or `save` wrote.
            step: which checkpoint; None for the latest.
            batch: a sample batch, needed only when the state does not exist yet (see `init`).

        Returns:
            The restored step.

        Raises:
            FileNotFoundError: when there is no checkpoint.
            ValueError: for another model's checkpoint (or one of an nnx model into a linen trainer and vice
                versa), or an optimizer state that does not fit.
        """
        ckpt = Checkpointer(checkpoint_dir, None)
        try:
            return self._restore(ckpt, step, batch)
        finally:
            ckpt.close()

    def _restore(self, ckpt: Checkpointer, step: int | None, batch: Any) -> int:
        meta = ckpt.meta(step)
        if meta.get("model_kind") != self._model.kind:
            raise ValueError(
                f"checkpoint_dir={ckpt.directory!r} holds a checkpoint of a {meta.get('model_kind')} model, but this "
                f"Trainer's model is a {self._model.kind} module: pass the {meta.get('model_kind')} model that "
                "wrote it, or use a fresh checkpoint_dir."
            )
        self._state, meta = ckpt.restore(self._restore_target(batch), meta["step"])
        self._step = int(meta["step"])
        self.data_position = DataPosition(**meta["data_position"])
        self._model.sync(self._state.params, self._state.model_state)
        return self._step

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
        log_every: int = 10,
        log_dir: str | os.PathLike | None = None,
        callbacks: Iterable[Callback] = (),
        verbose: str | int = "auto",
        on_preemption: str = "exit",
    ) -> History:
        """Train until the step counter reaches ``steps`` (or ``epochs`` passes over the data end).

        Both counts are totals, not increments: a resumed run (same ``checkpoint_dir``) restores the latest
        checkpoint, continues from its step and data position, and stops at the same place an uninterrupted
        run would.

        Args:
            train_data: global batches ``(x, y)`` or ``{"x": ..., "y": ...}``, all of one shape: a function
                ``epoch -> iterable`` (shuffle per epoch with a seed derived from ``epoch``), a re-iterable
                (a list: repeated each epoch) or an iterator (read once). Resuming needs the same batches for
                the same epoch (deterministic data).
            steps: train until ``trainer.step == steps``.
            epochs: stop after this many epochs in total (with ``steps``, whichever comes first).
            eval_data: batches for `evaluate` (any size; padded and masked), evaluated every ``eval_every``
                steps and at the end.
            eval_every: steps between evaluations (None: only at the end).
            checkpoint_dir: restore the latest checkpoint from here and save here (every
                ``checkpoint_every`` steps, at the end, and on preemption). None: no checkpoints.
            checkpoint_every: steps between checkpoints (None: only at the end / on preemption).
            keep_checkpoints: how many recent checkpoints to keep.
            log_every: steps between log points (metrics averaged over them; one device sync each).
            log_dir: also write ``metrics.csv`` and TensorBoard event files here.
            callbacks: `Callback` instances.
            verbose: ``"auto"`` (a bar on a terminal, lines otherwise), ``"bar"``, ``"lines"``, or 0 (silent).
            on_preemption: on SIGTERM the current step finishes and a checkpoint is saved; then ``"exit"``
                raises ``SystemExit(0)`` (the job exits cleanly) or ``"return"`` returns the history with
                ``history.preempted = True``.

        Returns:
            The `History` of logged metrics.

        Raises:
            ValueError: for bad arguments, data of the wrong batch structure, batches the replicas do not
                divide, a non-scalar loss, or a checkpoint_dir holding another model's checkpoint.
            SystemExit: after a preemption checkpoint, with ``on_preemption="exit"``.
        """
        if steps is None and epochs is None:
            raise ValueError("fit needs steps=N (train until step N) or epochs=N (N passes over train_data).")
        _check_int(steps, "steps", 0)
        _check_int(epochs, "epochs", 0)
        for name, value in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            _check_int(value, name, 1)
        _check_int(log_every, "log_every", 1, allow_none=False)
        if on_preemption not in ("exit", "return"):
            raise ValueError(f"on_preemption={on_preemption!r} must be 'exit' or 'return'.")
        if eval_every is not None and eval_data is None:
            raise ValueError(f"eval_every={eval_every} needs eval_data=... to evaluate on.")
        if eval_data is not None and isinstance(eval_data, Iterable) and iter(eval_data) is eval_data:
            raise ValueError(
                "eval_data is an iterator, which can be read only once: pass a list of batches or a function "
                "returning a fresh iterable."
            )
        stream = BatchStream(train_data, None, epochs, self._check_batch)
        sample = None
        if self._state is None:
            sample = stream.peek(self.data_position.epoch)
            self._check_batch(sample, f"train_data batch 0 of epoch {self.data_position.epoch}")
        ckpt = Checkpointer(checkpoint_dir, keep_checkpoints) if checkpoint_dir is not None else None
        if ckpt is not None and (ckpt.latest_step() or 0) > self._step:
            self._restore(ckpt, None, sample)
        if self._state is None:
            self.init(sample)
        stream = BatchStream(stream.data, self.data_position, epochs, self._check_batch)
        callbacks = list(callbacks)
        if verbose:
            callbacks.insert(0, Progress(steps, "auto" if verbose in (True, 1) else verbose))
        if log_dir is not None:
            callbacks += [CSVLogger(os.path.join(log_dir, "metrics.csv")), TensorBoardLogger(log_dir)]
        history = History()
        try:
            run_loop(self, stream, steps, eval_data, eval_every, ckpt, checkpoint_every, log_every, callbacks,
                     history)
        finally:
            if ckpt is not None:
                ckpt.close()
        if history.preempted and on_preemption == "exit":
            raise SystemExit(0)
        return history

    # --------------------------------------------------------------------------------- evaluate, predict
    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and metrics averaged over EVERY example of ``data`` (evaluation mode).

        Args:
            data: batches ``(x, y)`` / ``{"x": ..., "y": ...}`` of any size (a ragged last batch is padded
                to a multiple of the replica count and its padding masked out): a list, an iterator, or a
                function of no arguments returning an iterable.

        Returns:
            ``{"loss": ..., <metric>: ...}`` as floats.

        Raises:
            ValueError: for batches of the wrong structure, or empty data.
        """
        n = self.strategy.num_replicas_in_sync
        sums, count = {}, 0.0

        def source():
            for i, (batch, weights, _) in enumerate(eval_batches(data, n)):
                split_batch(batch, f"eval_data batch {i}")
                yield batch, weights

        for batch, weights in self.strategy.experimental_distribute_dataset(source()):
            if self._state is None:
                self.init(jax.device_get(batch))
            batch_sums, batch_count = jax.device_get(self._eval_step(self._state, batch, weights))
            for k, v in batch_sums.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += float(batch_count)
        if count == 0:
            raise ValueError("evaluate got no examples: pass at least one batch.")
        return {k: v / count for k, v in sums.items()}

    def predict(self, data: Any) -> Any:
        """The model's outputs (evaluation mode) for every example of ``data``, as numpy arrays.

        Args:
            data: batches of inputs: ``x``, ``(x,)``, ``(x, y)`` or dicts with ``"x"`` (targets are ignored),
                any size (padded and stripped like `evaluate`); a single array is one batch.

        Returns:
            The outputs concatenated along axis 0 (a pytree of arrays if the model returns one).
        """
        n = self.strategy.num_replicas_in_sync
        if isinstance(data, (np.ndarray, jax.Array)):
            data = [data]  # one array: one batch (not an iterable of rows)

        def inputs():
            for i, (batch, weights, _) in enumerate(eval_batches(data, n, "data")):
                yield split_batch(batch, f"data batch {i}", need_targets=False)[0], weights

        outputs = []
        for x, weights in self.strategy.experimental_distribute_dataset(inputs()):
            if self._state is None:
                self.init(jax.device_get(x))
            keep = np.asarray(weights) > 0
            outputs.append(jax.tree.map(lambda a, keep=keep: np.asarray(a)[keep], self._predict_step(self._state, x)))
        if not outputs:
            raise ValueError("predict got no batches: pass at least one.")
        return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)
