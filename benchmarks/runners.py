"""Steppers: the ways of running the same training step that the suite compares.

Each stepper owns its state and its input, runs ``steps`` steps per `run` call and blocks on the
result at the end of the call (see `benchmarks.timing`). Device-resident steppers cycle through
batches placed on the devices once, up front; host-fed steppers take numpy batches every step.

A stepper that cannot run here (a missing optional package, an API that errors) raises `Unavailable`
from its constructor; the suite reports the row as skipped with that reason.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxdist as jd
from benchmarks.models import Problem

__all__ = [
    "HandJit",
    "HostMetricJit",
    "KerasFit",
    "KerasLoop",
    "LayoutJit",
    "PlainJit",
    "Pmap",
    "StepsPerRun",
    "StrategyJit",
    "StrategyRun",
    "TrainerFit",
    "Unavailable",
    "import_keras",
]


FIT_MIN_BLOCK_SECONDS = 0.3
"""Blocks of ``fit``-style steppers (one ``fit`` call per block) last at least this long, so that
the fixed cost of a ``fit`` call is diluted over many steps as in real use (about 100 steps of the
small MLP here)."""


class Unavailable(RuntimeError):
    """This stepper cannot run on this machine or with these packages; the message says why."""


def _cycle(items: Any) -> Iterator[Any]:
    return itertools.cycle(tuple(items))


class _Loop:
    """The shared step loop: ``state, loss = step(state, next(batches))``, block at the end of the
    block."""

    step_multiple = 1
    min_block_steps = 1
    min_block_seconds = 0.0

    def __init__(self, step: Any, state: Any, batches: Iterator[Any]):
        self._step = step
        self._state = state
        self._batches = batches

    def run(self, steps: int) -> None:
        """Run ``steps`` steps and wait for the state and the last loss."""
        step, state, batches = self._step, self._state, self._batches
        loss = None
        for _ in range(steps):
            state, loss = step(state, next(batches))
        jax.block_until_ready((state, loss))
        self._state = state

    def close(self) -> None:
        """Drop the state (and, in subclasses, stop input threads)."""
        self._state = None


class StrategyJit(_Loop):
    """``strategy.jit(problem.step, donate_argnums=0)`` with state from
    ``strategy.create_variables``.

    Args:
        strategy: the jaxdist strategy.
        problem: the model to train.
        feed: ``"device"`` cycles batches placed once with ``experimental_distribute_values``;
            ``"dataset"`` feeds host numpy batches through ``experimental_distribute_dataset``.
        prefetch: the dataset's prefetch depth (``feed="dataset"`` only).
    """

    def __init__(self, strategy: jd.Strategy, problem: Problem, feed: str = "device",
                 prefetch: int = 2):
        state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
        self._iterator = None
        if feed == "device":
            batches = _cycle(strategy.experimental_distribute_values(b)
                             for b in problem.host_batches)
        elif feed == "dataset":
            self._iterator = iter(
                strategy.experimental_distribute_dataset(_cycle(problem.host_batches),
                                                         prefetch=prefetch)
            )
            batches = self._iterator
            # the queue filled during the other side's block is a head start
            self.min_block_steps = 5 * prefetch
        else:
            raise ValueError(f"feed={feed!r} must be 'device' or 'dataset'.")
        super().__init__(strategy.jit(problem.step, donate_argnums=0), state, batches)

    def close(self) -> None:
        """Stop the dataset's prefetch thread."""
        if self._iterator is not None:
            self._iterator.close()
        super().close()


class HandJit(_Loop):
    """The hand-written reference: ``jax.jit`` with ``NamedSharding`` in/out shardings and donated
    state.

    Parameters and optimizer state are replicated over ``mesh``; batches are split on axis 0 over
    its first axis and placed once, up front.
    """

    def __init__(self, mesh: jax.sharding.Mesh, problem: Problem):
        replicated = NamedSharding(mesh, PartitionSpec())
        split = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
        init = jax.jit(problem.init, out_shardings=replicated)
        state = init(jax.random.key(0), problem.sample_x())
        step = jax.jit(
            problem.step,
            in_shardings=(replicated, split),
            out_shardings=(replicated, replicated),
            donate_argnums=0,
        )
        batches = _cycle(jax.device_put(b, split) for b in problem.host_batches)
        super().__init__(step, state, batches)


class PlainJit(_Loop):
    """Plain single-device ``jax.jit`` (no shardings): state and batches committed to ``device``."""

    def __init__(self, device: jax.Device, problem: Problem):
        state = jax.device_put(jax.jit(problem.init)(jax.random.key(0), problem.sample_x()), device)
        batches = _cycle(jax.device_put(b, device) for b in problem.host_batches)
        super().__init__(jax.jit(problem.step, donate_argnums=0), state, batches)


class StrategyRun(_Loop):
    """tf.distribute's pattern: ``strategy.run`` computes local gradients and all-reduces them
    explicitly.

    The replica function returns ``ctx.all_reduce(MEAN, grads)`` and the mean loss; the optimizer
    update runs on the mirrored result in the global view. The whole step is one ``strategy.jit``
    program.
    """

    def __init__(self, strategy: jd.Strategy, problem: Problem):
        def replica_fn(params, x, y):
            ctx = jd.get_replica_context()
            loss, grads = jax.value_and_grad(problem.loss)(params, x, y)
            return ctx.all_reduce(jd.ReduceOp.MEAN, (grads, loss))

        def step(state, batch):
            grads, loss = strategy.run(replica_fn, args=(state[0], *batch))
            return problem.apply_gradients(state, grads), loss

        state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
        batches = _cycle(strategy.experimental_distribute_values(b) for b in problem.host_batches)
        super().__init__(strategy.jit(step, donate_argnums=0), state, batches)


class Pmap(_Loop):
    """The legacy ``jax.pmap`` style: stacked per-device state, ``lax.pmean`` of gradients, reshaped
    batches.

    Raises:
        Unavailable: when ``jax.pmap`` is missing or errors (it is deprecated upstream).
    """

    _AXIS = "devices"

    def __init__(self, devices: tuple[jax.Device, ...], problem: Problem):
        n = len(devices)
        if not hasattr(jax, "pmap"):
            raise Unavailable(f"jax {jax.__version__} has no jax.pmap")
        axis = self._AXIS

        def pstep(state, x, y):
            loss, grads = jax.value_and_grad(problem.loss)(state[0], x, y)
            grads, loss = jax.lax.pmean((grads, loss), axis)
            return problem.apply_gradients(state, grads), loss

        def stack(tree):
            return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *np.shape(a))), tree)

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                place = jax.pmap(lambda t: t, axis_name=axis, devices=devices)
                compiled = jax.pmap(pstep, axis_name=axis, devices=devices, donate_argnums=0)
                initial = stack(jax.jit(problem.init)(jax.random.key(0), problem.sample_x()))
                state = place(initial)
                batches = [
                    place(jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), b))
                    for b in problem.host_batches
                ]
                # compile now: errors surface here
                jax.block_until_ready(compiled(place(initial), *batches[0]))
        except Exception as error:  # deprecated API: report why instead of failing the suite
            raise Unavailable(f"jax.pmap failed: {type(error).__name__}: {error}") from error
        super().__init__(lambda s, b: compiled(s, *b), state, _cycle(batches))


def import_keras() -> Any:
    """``keras`` on the JAX backend.

    Raises:
        Unavailable: when keras is not installed or its backend is not JAX.
    """
    if os.environ.get("KERAS_BACKEND", "jax") != "jax":
        raise Unavailable(f"KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}; these rows need 'jax'")
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras
    except ImportError as error:
        raise Unavailable("keras is not installed (pip install -e '.[bench]')") from error
    if keras.backend.backend() != "jax":
        raise Unavailable(f"keras backend is {keras.backend.backend()!r}, not 'jax'")
    return keras


class KerasLoop:
    """The shared ``fit`` loop of the Keras steppers: each `run` is one ``model.fit`` call of
    ``steps`` steps (blocks last at least `FIT_MIN_BLOCK_SECONDS`) under ``distribution``, over a
    generator cycling host ``batches``, so the per-call cost of ``fit`` (callbacks, data adapter)
    counts.

    Subclasses build and compile ``model`` (with ``steps_per_execution``) under ``distribution``'s
    scope.
    """

    min_block_steps = 1
    min_block_seconds = FIT_MIN_BLOCK_SECONDS

    def __init__(self, distribution: Any, model: Any, batches: Any, steps_per_execution: int):
        self.step_multiple = steps_per_execution
        self._distribution = distribution
        self._model = model
        self._batches = batches

    def _data(self) -> Iterator[Any]:
        yield from _cycle(self._batches)

    def run(self, steps: int) -> None:
        """One ``fit`` call of ``steps`` steps (``fit`` returns once they are done)."""
        with self._distribution.scope():
            self._model.fit(self._data(), steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
        jax.block_until_ready([v.value for v in self._model.trainable_variables])

    def close(self) -> None:
        """Drop the model."""
        self._model = None


class KerasFit(KerasLoop):
    """Keras 3 (JAX backend) ``model.fit`` of the problem's MLP under
    ``keras.distribution.DataParallel`` on host numpy batches (see `KerasLoop`).

    Raises:
        Unavailable: when keras is not installed or its backend is not JAX.
    """

    def __init__(self, devices: tuple[jax.Device, ...], problem: Problem, steps_per_execution: int):
        keras = import_keras()
        distribution = keras.distribution.DataParallel(devices=list(devices))
        with distribution.scope():
            layers = [keras.Input((problem.host_batches[0][0].shape[1],))]
            layers += [keras.layers.Dense(w, activation="relu") for w in problem.spec.hidden]
            layers += [keras.layers.Dense(10)]
            model = keras.Sequential(layers)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution,
                jit_compile=True,
            )
        super().__init__(distribution, model, problem.host_batches, steps_per_execution)


class LayoutJit(_Loop):
    """Hand-written ``jax.jit`` with explicit in/out shardings copied from the state ``strategy``
    creates.

    The layouts are the strategy's (e.g. `ShardedStrategy`'s FSDP split), the program is plain
    ``jax.jit``: the pair (``strategy.jit``, `LayoutJit`) isolates what ``strategy.jit`` itself
    costs for that layout.
    """

    def __init__(self, strategy: jd.Strategy, problem: Problem):
        state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
        layouts = jax.tree.map(lambda a: a.sharding, state)
        split = strategy.batch_sharding
        step = jax.jit(
            problem.step,
            in_shardings=(layouts, split),
            out_shardings=(layouts, strategy.replicated_sharding),
            donate_argnums=0,
        )
        batches = _cycle(jax.device_put(b, split) for b in problem.host_batches)
        super().__init__(step, state, batches)


class HostMetricJit(_Loop):
    """``strategy.jit`` of a step that also computes per-example accuracy, on the devices or on the
    host.

    With ``host=True`` the accuracy runs in a ``jd.tpu.outside_compilation`` region (one host call
    per replica per step, on that replica's rows); with ``host=False`` the same function runs on the
    devices.
    """

    def __init__(self, strategy: jd.Strategy, problem: Problem, host: bool):
        outside = jd.tpu.outside_compilation

        def correct(logits, y):
            return (jnp.argmax(logits, -1) == y).astype(jnp.float32)

        def step(state, batch):
            x, y = batch

            def loss_fn(params):
                logits = problem.model.apply(params, x)
                return problem.loss_of_logits(logits, y), logits

            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state[0])
            logits = jax.lax.stop_gradient(logits)
            hits = outside(correct, logits, y, batch_argnums=(0, 1)) if host else correct(logits, y)
            return problem.apply_gradients(state, grads), (loss, hits.mean())

        state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
        batches = _cycle(strategy.experimental_distribute_values(b) for b in problem.host_batches)
        super().__init__(strategy.jit(step, donate_argnums=0), state, batches)


class StepsPerRun:
    """``strategy.run_steps_on_dataset``: ``iterations`` steps per call in ONE compiled on-device
    loop.

    Host numpy batches are taken from an endless iterator; each call stacks and places
    ``iterations`` of them at once (TPU infeed style). The step records its loss with
    ``ctx.set_last_step_output``.
    """

    min_block_steps = 1
    min_block_seconds = 0.0

    def __init__(self, strategy: jd.Strategy, problem: Problem, iterations: int):
        self.step_multiple = iterations
        self._strategy = strategy
        self._state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
        self._iterator = _cycle(problem.host_batches)

        def step_fn(ctx, state, x, y):
            state, loss = problem.step(state, (x, y))
            ctx.set_last_step_output("loss", loss)
            return state

        self._step_fn = step_fn

    def run(self, steps: int) -> None:
        """``steps / iterations`` loop calls, then wait for the state."""
        state = self._state
        for _ in range(steps // self.step_multiple):
            ctx = self._strategy.run_steps_on_dataset(
                self._step_fn, self._iterator, iterations=self.step_multiple,
                initial_loop_values=state
            )
            state = ctx.loop_values
        jax.block_until_ready(state)
        self._state = state

    def close(self) -> None:
        """Drop the state."""
        self._state = None


class TrainerFit:
    """``jd.training.Trainer.fit`` on the problem's host numpy batches (``feed="host"``) or on the
    same batches placed once up front (``feed="device"``), with its defaults (``verbose=0``).

    Each `run` is one ``fit`` call that trains ``steps`` more steps (at least
    `FIT_MIN_BLOCK_SECONDS`; ``fit(steps=...)`` counts the total), so its per-call cost (data
    stream, prefetch thread, callbacks, log syncs every ``log_every`` steps) counts.

    Raises:
        Unavailable: when ``jaxdist.training.Trainer`` is missing.
    """

    step_multiple = 1
    min_block_steps = 1
    min_block_seconds = FIT_MIN_BLOCK_SECONDS

    def __init__(self, strategy: jd.Strategy, problem: Problem, feed: str = "host"):
        trainer_cls = getattr(getattr(jd, "training", None), "Trainer", None)
        if trainer_cls is None:
            raise Unavailable("jaxdist.training.Trainer has not landed")
        self._trainer = trainer_cls(strategy, problem.model, problem.optimizer,
                                    problem.loss_of_logits)
        if feed == "host":
            self._data = list(problem.host_batches)
        elif feed == "device":  # placed once, up front: the Trainer's batch path moves nothing
            self._data = [strategy.experimental_distribute_values(b) for b in problem.host_batches]
        else:
            raise ValueError(f"feed={feed!r} must be 'host' or 'device'.")

    def run(self, steps: int) -> None:
        """Train ``steps`` more steps and wait for the state."""
        self._trainer.fit(self._data, steps=self._trainer.step + steps, verbose=0)
        jax.block_until_ready(self._trainer.state)

    def close(self) -> None:
        """Drop the trainer."""
        self._trainer = None
