"""The running sums: what the train steps add up on the devices between two looks of the host.

Every train step adds its metrics to a `RunningSums` inside the compiled program: nothing is read
per step. Between steps the sums stay on the devices packed in one float32 vector (`PackedSums`: a
compiled step takes and returns one array, not one per part, which keeps its host cost per call
that of one argument). The host reads them at a log point in one transfer (`PackedSums.to_host`).
A scalar metric adds its step mean and 1, a token-weighted one (`jaxdist.training.step._weighted`)
its sum and weight, so a window's mean is one division of two sums (as Flax's ``nnx.metrics``
``Average`` keeps a total and a count).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.training.step._non_finite import NonFiniteRecord

__all__ = ["Average", "PackedSums", "RunningSums"]


class Average(NamedTuple):
    """A running mean as its two sums: ``total / weight``.

    Attributes:
        total: the summed values (float32): a scalar metric's step means, or a weighted one's sums.
        weight: what they are divided by (float32): the steps, or the summed weights (e.g. tokens).

    Examples:
        >>> import numpy as np
        >>> Average(np.float32(6.0), np.float32(4.0)).mean(), Average(0.0, 0.0).mean()
        (1.5, nan)
    """

    total: Any
    weight: Any

    def mean(self) -> float:
        """``total / weight`` as a Python float (NaN for weight 0); call it on host sums."""
        total, weight = float(self.total), float(self.weight)
        return total / weight if weight else float("nan")


@dataclasses.dataclass(frozen=True)
class RunningSums:
    """The running sums of a trainer's steps since the last read: a pytree (its leaves are scalars).

    Between steps they stay on the devices packed in one vector (`pack`, `PackedSums`);
    ``Trainer.pop_running_sums().to_host()`` reads them. `mean`, `means`, `loss_weight` read host
    values.

    Attributes:
        averages: ``{name: Average(total, weight)}``: ``"loss"`` first, then each metric.
        non_finite: the `jaxdist.training.step.NonFiniteRecord` of the steps that were not finite.
        steps: how many steps were added (int32).
        learning_rate: the last step's learning rate, or None when the optimizer does not expose it
            (build it with `optax.inject_hyperparams`).
        names: the averages' names, in order (static: part of the pytree's structure).
        token_weighted: the names whose average is token-weighted (``(sum, weight)``; static).

    Examples:
        >>> import jax.numpy as jnp
        >>> sums = RunningSums.zeros(["loss", "accuracy"], token_weighted=["loss"])
        >>> for loss_sum, tokens, accuracy in ((6.0, 3.0, 0.5), (2.0, 1.0, 1.0)):
        ...     step = {"loss": (jnp.float32(loss_sum), jnp.float32(tokens)),
        ...             "accuracy": (accuracy, None)}
        ...     sums = sums.then(RunningSums.of_step(step))
        >>> sums = sums.pack().to_host()  # one vector, one transfer
        >>> sums.means(), int(sums.steps), int(sums.non_finite.count)  # loss: (6 + 2) / (3 + 1)
        ({'loss': 2.0, 'accuracy': 0.75}, 2, 0)
    """

    averages: Mapping[str, Average]
    non_finite: NonFiniteRecord
    steps: Any
    learning_rate: Any = None
    names: tuple[str, ...] = ()
    token_weighted: tuple[str, ...] = ()

    @classmethod
    def zeros(cls, names: Iterable[str], token_weighted: Iterable[str] = (),
              learning_rate: bool = False) -> RunningSums:
        """The sums of no steps, on the host (a compiled step takes them as its first sums).

        Args:
            names: the metrics' names (``"loss"`` first).
            token_weighted: those whose values are ``(sum, weight)`` pairs.
            learning_rate: whether the steps report a learning rate.

        Raises:
            ValueError: for a token-weighted name that is not among ``names``.

        Examples:
            >>> RunningSums.zeros(["loss"]).means()
            {'loss': nan}
        """
        names = tuple(names)
        weighted = tuple(n for n in names if n in set(token_weighted))
        unknown = sorted(set(token_weighted) - set(names))
        if unknown:
            raise ValueError(f"token_weighted={unknown!r} names no metric: pass some of "
                             f"names={names!r}.")
        zero = lambda dtype: np.zeros((), dtype)  # noqa: E731
        return cls({n: Average(zero(np.float32), zero(np.float32)) for n in names},
                   NonFiniteRecord.zeros(), zero(np.int32),
                   zero(np.float32) if learning_rate else None, names, weighted)

    @classmethod
    def of_step(cls, values: Mapping[str, tuple[Any, Any]], flag: Any = None,
                learning_rate: Any = None) -> RunningSums:
        """The sums of one step (inside a compiled step).

        Args:
            values: ``{name: (value, weight)}``: a scalar metric's mean with weight None, or a
                token-weighted metric's sum and its weight.
            flag: the step's `jaxdist.training.step._non_finite.step_flag` (None: finite).
            learning_rate: the step's learning rate, or None.

        Examples:
            >>> import jax.numpy as jnp
            >>> step = RunningSums.of_step({"loss": (jnp.float32(6.0), jnp.float32(3.0)),
            ...                             "acc": (0.5, None)})
            >>> step.mean("loss"), step.mean("acc"), step.token_weighted
            (2.0, 0.5, ('loss',))
        """
        averages = {}
        for name, (value, weight) in values.items():
            averages[name] = Average(jnp.asarray(value, jnp.float32),
                                     jnp.ones((), jnp.float32) if weight is None
                                     else jnp.asarray(weight, jnp.float32))
        return cls(averages, NonFiniteRecord.of_step(flag), jnp.ones((), jnp.int32),
                   None if learning_rate is None else jnp.asarray(learning_rate, jnp.float32),
                   tuple(values), tuple(n for n, (_, w) in values.items() if w is not None))

    def then(self, later: RunningSums) -> RunningSums:
        """These sums followed by ``later``'s (a later step's or window's).

        Raises:
            ValueError: when ``later`` sums other metrics, weights them otherwise, or differs in
                reporting a learning rate.

        Examples:
            >>> import jax.numpy as jnp
            >>> bad = RunningSums.of_step({"loss": (jnp.float32(1.0), None)}, flag=jnp.float32(1.0))
            >>> both = bad.then(RunningSums.of_step({"loss": (jnp.float32(3.0), None)}))
            >>> both.mean("loss"), int(both.steps), int(both.non_finite.count)
            (2.0, 2, 1)
        """
        if (set(later.names) != set(self.names)
                or set(later.token_weighted) != set(self.token_weighted)
                or (later.learning_rate is None) != (self.learning_rate is None)):
            raise ValueError(f"running sums of {self._describe()} cannot add sums of "
                             f"{later._describe()}: a step must report the same metrics, each "
                             "weighted the same way, every time.")
        averages = {n: Average(a.total + later.averages[n].total,
                               a.weight + later.averages[n].weight)
                    for n, a in self.averages.items()}
        return dataclasses.replace(
            self, averages=averages,
            non_finite=self.non_finite.then(later.non_finite, self.steps, later.steps),
            steps=self.steps + later.steps, learning_rate=later.learning_rate)

    def _describe(self) -> str:
        rate = " and a learning rate" if self.learning_rate is not None else ""
        return f"metrics {list(self.names)} (token-weighted: {list(self.token_weighted)}){rate}"

    def pack(self) -> PackedSums:
        """These sums packed in one float32 vector (`PackedSums`), as a compiled step carries them.

        Examples:
            >>> import jax.numpy as jnp
            >>> packed = RunningSums.of_step({"loss": (jnp.float32(6.0), jnp.float32(3.0))}).pack()
            >>> packed.fields, packed.vector.tolist()
            (('loss', 'loss.weight', 'non_finite_steps', 'non_finite_first', 'non_finite_lead', \
'non_finite_run', 'non_finite_longest', 'steps'), [6.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
        """
        values = []
        for name in self.names:
            values.append(self.averages[name].total)
            if name in self.token_weighted:
                values.append(self.averages[name].weight)
        if self.learning_rate is not None:
            values.append(self.learning_rate)
        values += [*self.non_finite, self.steps]
        stack = jnp.stack if any(isinstance(v, jax.Array) for v in values) else np.stack
        return PackedSums(stack([_as(v, np.float32) for v in values]), self.names,
                          self.token_weighted, self.learning_rate is not None)

    def mean(self, name: str) -> float:
        """The mean of ``name`` over the summed steps: its total over its weight (NaN for weight 0).

        Raises:
            KeyError: for a name that is not summed, naming those that are.
        """
        if name not in self.averages:
            raise KeyError(f"no running sums of {name!r}: the sums hold {list(self.names)}.")
        return self.averages[name].mean()

    def means(self) -> dict[str, float]:
        """Every metric's `mean`, ``"loss"`` first (NaN for all when no steps were added)."""
        return {name: self.mean(name) for name in self.names}

    @property
    def loss_weight(self) -> Any:
        """The loss's summed weight (e.g. tokens) when the loss is token-weighted, else None."""
        return self.averages["loss"].weight if "loss" in self.token_weighted else None


jax.tree_util.register_dataclass(
    RunningSums, data_fields=["averages", "non_finite", "steps", "learning_rate"],
    meta_fields=["names", "token_weighted"])


def _as(value: Any, dtype: Any) -> Any:
    return value.astype(dtype) if hasattr(value, "astype") else np.asarray(value, dtype)


@dataclasses.dataclass(frozen=True)
class PackedSums:
    """`RunningSums` packed in one float32 vector, as they stay on the devices between steps and
    travel to the host. ``Trainer.pop_running_sums`` returns them without waiting for the steps;
    `to_host` reads and unpacks. A pytree: the vector is its one leaf, the structure is static.

    Attributes:
        vector: the values (float32), in the order of `fields`: a device array, or a numpy one.
        names: the metrics' names (`RunningSums.names`).
        token_weighted: those that are token-weighted (`RunningSums.token_weighted`).
        learning_rate: whether the sums hold a learning rate.

    Examples:
        >>> import jax.numpy as jnp
        >>> step = RunningSums.of_step({"loss": (jnp.float32(2.0), None)})
        >>> packed = RunningSums.zeros(["loss"]).then(step).pack()
        >>> sums = packed.to_host()  # one transfer
        >>> sums.mean("loss"), int(sums.steps)
        (2.0, 1)
    """

    vector: Any
    names: tuple[str, ...] = ()
    token_weighted: tuple[str, ...] = ()
    learning_rate: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        """What each entry of `vector` holds: each metric's total (a token-weighted one followed by
        ``"<name>.weight"``; a scalar metric's weight is the step count), ``"learning_rate"``, the
        non-finite record (``"non_finite_steps"``, ``"non_finite_first"``, ``"non_finite_lead"``,
        ``"non_finite_run"``, ``"non_finite_longest"``) and ``"steps"``."""
        out = []
        for name in self.names:
            out += [name, f"{name}.weight"] if name in self.token_weighted else [name]
        out += ["learning_rate"] if self.learning_rate else []
        out += ["non_finite_steps" if f == "count" else f"non_finite_{f}"
                for f in NonFiniteRecord._fields]
        return (*out, "steps")

    def holding(self, vector: Any) -> PackedSums:
        """Sums of this structure whose values are ``vector`` (e.g. a compiled step's)."""
        return dataclasses.replace(self, vector=vector)

    def unpack(self) -> RunningSums:
        """The `RunningSums` (device or traced values for a device vector, numpy for a host one)."""
        vector, at = self.vector, iter(range(len(self.fields)))
        steps = _as(vector[len(self.fields) - 1], np.int32)
        averages = {}
        for name in self.names:
            total = vector[next(at)]
            weight = vector[next(at)] if name in self.token_weighted else _as(steps, np.float32)
            averages[name] = Average(total, weight)
        rate = vector[next(at)] if self.learning_rate else None
        record = NonFiniteRecord(*(_as(vector[next(at)], np.int32)
                                   for _ in NonFiniteRecord._fields))
        return RunningSums(averages, record, steps, rate, self.names, self.token_weighted)

    def to_host(self) -> RunningSums:
        """The `RunningSums`, read in ONE transfer (waits for the steps)."""
        return self.holding(np.asarray(jax.device_get(self.vector))).unpack()


jax.tree_util.register_dataclass(PackedSums, data_fields=["vector"],
                                 meta_fields=["names", "token_weighted", "learning_rate"])
