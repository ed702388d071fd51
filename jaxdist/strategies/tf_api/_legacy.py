"""The 2018 DistributionStrategy names (``tf.contrib.distribute``), so that ported code runs.

TF 2018 called replicas *towers*; later releases renamed most of the API. Every jaxdist strategy
answers to the old names through the `StrategyV1Names` mixin, each an alias of the modern name (the
README's table lists them): ``call_for_each_tower`` is ``run``, ``num_towers`` is
``num_replicas_in_sync``, ``unwrap`` is ``experimental_local_results``, ``distribute_dataset`` feeds
one dataset element to each replica as 2018 did. ``tf.get_tower_context()`` is `get_tower_context`,
whose `TowerContext` keeps the 2018 signature of ``merge_call(fn, *args)``.

Names that only meant something to TF graphs and sessions are kept with the behaviour a porting user
expects, documented per name (``configure``, ``update_config_proto``, ``group``, ``fetch``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.trees import is_distributed
from jaxdist.replicate.values import PerReplica, SyncOnRead, local_components
from jaxdist.strategies.input import DistributedDataset
from jaxdist.strategies.layout import resolve_device
from jaxdist.strategies.replica_context import ReplicaContext

__all__ = ["StrategyV1Names", "TowerContext"]


# What `StrategyV1Names.unwrap` handed out, so that `value_container` finds a component's
# container. Weak both ways: an entry dies with its container's array or with its component; a
# container is rebuilt from its array, so nothing here keeps a container alive.
_by_container: dict[int, tuple[weakref.ref, tuple]] = {}  # id(array) -> (ref, components)
# id(component) -> (ref, ref to the container's array, rebuild)
_container_of: dict[int, tuple[weakref.ref, weakref.ref, Callable]] = {}


def _rebuild(container: Any) -> Callable[[jax.Array], Any]:
    """How to make ``container`` again from its array (PerReplica / SyncOnRead are not held)."""
    if isinstance(container, SyncOnRead):
        aggregation, owner = container.aggregation, container.owner
        return lambda stacked: SyncOnRead(stacked, aggregation, owner)
    if isinstance(container, PerReplica):
        owner = container.owner
        return lambda stacked: PerReplica(stacked, owner)
    return lambda array: array


def _remember(key: jax.Array, container: Any, components: tuple) -> tuple:
    """Components of ``container`` (keyed by its array ``key``), the same objects on every call."""
    known = _by_container.get(id(key))
    if known is not None and known[0]() is key:
        return known[1]
    _by_container[id(key)] = (weakref.ref(key), components)
    weakref.finalize(key, _by_container.pop, id(key), None)
    rebuild = _rebuild(container)
    for c in components:
        if isinstance(c, jax.Array):
            _container_of[id(c)] = (weakref.ref(c), weakref.ref(key), rebuild)
            weakref.finalize(c, _container_of.pop, id(c), None)
    return components


class StrategyV1Names:
    """The 2018 ``DistributionStrategy`` names on every strategy (a mixin; see the module doc)."""

    # ------------------------------------------------------------------------------ tower = replica
    @property
    def num_towers(self) -> int:
        """2018 name of `num_replicas_in_sync`.

        Examples:
            >>> import jaxdist as jd
            >>> jd.MirroredStrategy().num_towers
            8
        """
        return self.num_replicas_in_sync

    @property
    def is_single_tower(self) -> bool:
        """True when there is one replica (2018: ``call_for_each_tower(fn)`` calls ``fn`` once).

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().is_single_tower
            True
        """
        return self.num_replicas_in_sync == 1

    @property
    def num_towers_per_host(self) -> int:
        """2018 name of `num_replicas_per_host`.

        Examples:
            >>> import jaxdist as jd
            >>> jd.MirroredStrategy().num_towers_per_host
            8
        """
        return self.num_replicas_per_host

    @property
    def between_graph(self) -> bool:
        """Whether each process runs its own copy of the program (TF's between-graph replication).

        JAX is multi-controller: with several processes every one traces and dispatches the same
        SPMD program for its own devices, which is between-graph; one process drives all devices
        (in-graph) when the strategy spans one host.

        Examples:
            >>> import jaxdist as jd
            >>> jd.MirroredStrategy().between_graph
            False
        """
        return self.num_hosts > 1

    @property
    def worker_device_index(self) -> PerReplica:
        """Each replica's index, as a `PerReplica` to pass to ``call_for_each_tower`` / ``run``.

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> out = s.call_for_each_tower(lambda i: i * 10, s.worker_device_index)
            >>> [int(v) for v in s.unwrap(out)][:3]
            [0, 10, 20]
        """
        n = self.num_replicas_in_sync
        return PerReplica(jax.device_put(np.arange(n, dtype=np.int32), self.batch_sharding), self)

    def call_for_each_tower(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """2018 name of ``run(fn, args=args, kwargs=kwargs)`` (``run_concurrently`` is dropped).

        Inside ``fn``, `get_tower_context` (or ``jd.get_replica_context()``) gives the replica's
        context.

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> float(s.call_for_each_tower(lambda x: x + 1.0, 2.0))
            3.0
        """
        kwargs.pop("run_concurrently", None)
        return self.run(fn, args=args, kwargs=kwargs)

    def distribute_dataset(self, dataset_fn: Callable[[], Iterable[Any]]) -> DistributedDataset:
        """The 2018 input API: each element of ``dataset_fn()`` is ONE replica's batch.

        ``num_replicas_per_host`` consecutive elements make one step's batch on this process (their
        rows concatenated in replica order), as the 2018 strategies fed one element to each tower.
        Modern code passes global batches to ``experimental_distribute_dataset`` instead.

        Args:
            dataset_fn: returns an iterable of per-replica batches (pytrees of arrays); called once
                per pass.

        Returns:
            A `DistributedDataset` of global batches split over the replicas.

        Raises:
            TypeError: when ``dataset_fn`` is not callable.
            ValueError: (while iterating) when the elements run out part-way through a step.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> ds = s.distribute_dataset(lambda: [np.ones((2, 3))] * 16)
            >>> [b.shape for b in ds]
            [(16, 3), (16, 3)]
        """
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn={dataset_fn!r} is not callable: pass a function returning "
                            "the dataset (an iterable of per-replica batches).")
        per_step = self.num_replicas_per_host
        return self.distribute_datasets_from_function(lambda ctx: _PerTowerGroups(dataset_fn,
                                                                                  per_step))

    def make_input_fn_iterator(self, input_fn: Callable[[Any], Iterable[Any]],
                               replication_mode: Any = "per_worker") -> Iterator[Any]:
        """An iterator over ``distribute_datasets_from_function(input_fn)``: ``input_fn(ctx)`` gives
        this process's share of each batch (``ctx`` is a `jd.InputContext`).

        Raises:
            ValueError: for a ``replication_mode`` other than PER_WORKER (the only one TF had).

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> next(s.make_input_fn_iterator(lambda ctx: [np.zeros((4, 1))])).shape
            (4, 1)
        """
        mode = getattr(replication_mode, "name", replication_mode)
        if not isinstance(mode, str) or mode.lower() != "per_worker":
            raise ValueError(f"replication_mode={replication_mode!r}: only PER_WORKER exists "
                             "(input_fn runs once per process and yields that process's share of "
                             "each batch).")
        return iter(self.distribute_datasets_from_function(input_fn))

    def map(self, map_over: Iterable[Any], fn: Callable[..., Any], *args: Any,
            **kwargs: Any) -> list[Any]:
        """``[fn(m, *args, **kwargs) for m in map_over]``, the elements spread over the replicas.

        The elements (pytrees of arrays of one structure and shape) are stacked, split over the
        replicas and mapped with `jax.vmap` in one compiled program (2018 placed element i on device
        ``i % N``). A count the replicas do not divide is padded with copies of the first element,
        whose results are dropped. ``args`` / ``kwargs`` are the same for every element.

        Returns:
            The results in the order of ``map_over``.

        Raises:
            TypeError: when ``fn`` is not callable.
            ValueError: when ``map_over`` is empty.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> [float(y) for y in s.map([np.float32(i) for i in range(3)], lambda m, k: m * k,
            ...                          10.0)]
            [0.0, 10.0, 20.0]
        """
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable: pass fn(element, *args).")
        elements = list(map_over)
        if not elements:
            raise ValueError("map_over is empty: pass at least one element to map fn over.")
        n = self.num_replicas_in_sync
        padded = elements + [elements[0]] * (-len(elements) % n)
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *padded)
        stacked = self.experimental_distribute_values(stacked)

        # one program per fn (jax.jit retraces for new shapes), holding fn weakly
        def build(weak_fn):
            return jax.jit(lambda rows, a, kw: jax.vmap(lambda m: weak_fn(m, *a, **kw))(rows))

        out = self.programs.get(fn, ("compat.map",), build)(stacked, args, kwargs)
        return [jax.tree.map(lambda o, i=i: o[i], out) for i in range(len(elements))]

    # ----------------------------------------------------------------------- values and containers
    def unwrap(self, value: Any) -> list[Any]:
        """2018 name of `experimental_local_results`, as a list; a value that is not distributed
        gives ``[value]``. Inside ``merge_call`` it lists every replica's value.

        Components keep a link to their container: ``value_container(c)`` returns it.

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
            >>> len(s.unwrap(ids)), s.unwrap(3)
            (8, [3])
        """
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
        if not any(is_distributed(x) or isinstance(x, jax.Array) for x in leaves):
            return [value]
        per_leaf = [self._components(x) for x in leaves]
        count = max(len(c) for c in per_leaf)
        per_leaf = [c if len(c) == count else c * count for c in per_leaf]
        return [jax.tree.unflatten(treedef, [c[i] for c in per_leaf]) for i in range(count)]

    def _components(self, leaf: Any) -> tuple:
        if is_distributed(leaf):
            stacked = leaf.stacked
            # inside merge_call: every replica's value is here
            if isinstance(stacked, jax.core.Tracer):
                return tuple(stacked[i] for i in range(stacked.shape[0]))
            return _remember(stacked, leaf, local_components(stacked))
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return _remember(leaf, leaf, tuple(self.experimental_local_results(leaf)))
        return (leaf,)

    def value_container(self, value: Any) -> Any:
        """The distributed value ``value`` (a component from `unwrap`) belongs to, else ``value``.

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
            >>> first = s.unwrap(ids)[0]
            >>> container = s.value_container(first)
            >>> (container.stacked is ids.stacked, any(c is first for c in s.unwrap(container)),
            ...  s.value_container(5))
            (True, True, 5)
        """
        known = _container_of.get(id(value))
        if known is not None and known[0]() is value:
            key = known[1]()
            if key is not None:
                return known[2](key)
        return value

    # ----------------------------------------------------------------- TF graph and session names
    def configure(self, session_config: Any = None, cluster_spec: Any = None,
                  task_type: Any = None, task_id: Any = None) -> None:
        """A no-op for ``session_config`` (there is no session); cluster arguments are an error.

        Raises:
            ValueError: for ``cluster_spec`` / ``task_type`` / ``task_id``: jaxdist joins the
                cluster when the strategy is created
                (``jd.MultiWorkerMirroredStrategy(coordinator_address=..., num_processes=...,
                process_id=...)`` or the ``JAXDIST_*`` environment).

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().configure(session_config=object()) is None
            True
        """
        del session_config  # a tf.ConfigProto tunes a TF session; JAX has none
        given = {k: v for k, v in (("cluster_spec", cluster_spec), ("task_type", task_type),
                                   ("task_id", task_id)) if v is not None}
        if given:
            raise ValueError(
                f"configure({', '.join(f'{k}={v!r}' for k, v in given.items())}): jaxdist joins "
                "the cluster when the strategy is created, not later: "
                "jd.MultiWorkerMirroredStrategy(coordinator_address='host:port', num_processes=N, "
                "process_id=i), or the JAXDIST_COORDINATOR_ADDRESS / JAXDIST_NUM_PROCESSES / "
                "JAXDIST_PROCESS_ID environment."
            )

    def update_config_proto(self, config_proto: Any) -> Any:
        """``config_proto`` unchanged: TF added strategy settings to a session config; JAX has none.

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().update_config_proto("cfg")
            'cfg'
        """
        return config_proto

    def group(self, value: Any, name: str | None = None) -> None:
        """Wait until every value in ``value`` is computed (TF: one op for all; ``name`` is unused).

        JAX dispatches asynchronously; this is `jax.block_until_ready`.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> jd.OneDeviceStrategy().group([jnp.ones(2)]) is None
            True
        """
        del name
        jax.block_until_ready([x for x in jax.tree.leaves(value) if isinstance(x, jax.Array)])

    def fetch(self, val: Any, destination: Any = "/device:CPU:0",
              fn: Callable[[Any], Any] = lambda x: x) -> Any:
        """``fn`` of a copy of ``val`` on ``destination`` (default: the host CPU), as 2018's.

        Args:
            val: a pytree of arrays (mirrored values: one copy is taken).
            destination: a device or device name (``"/device:CPU:0"``, ``"gpu:1"``).
            fn: applied to the copy.

        Raises:
            ValueError: for a `PerReplica` / `SyncOnRead` (reduce or read it first).

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> float(s.fetch(s.mirror(jnp.ones(2)), fn=jnp.sum))
            2.0
        """
        if any(is_distributed(x) for x in jax.tree.leaves(val, is_leaf=is_distributed)):
            raise ValueError("strategy.fetch got a PerReplica / SyncOnRead: it copies one value; "
                             "combine the replicas' values first with strategy.reduce(op, value) "
                             "or strategy.read_var(value).")
        device = resolve_device(destination, "destination")
        return fn(jax.device_put(val, device))


class _PerTowerGroups:
    """Iterate ``dataset_fn()`` in groups of ``k`` per-replica elements, one step's batch each."""

    def __init__(self, dataset_fn: Callable[[], Iterable[Any]], k: int):
        self._dataset_fn = dataset_fn
        self._k = k

    def __iter__(self) -> Iterator[Any]:
        group: list[Any] = []
        for element in self._dataset_fn():
            group.append(element)
            if len(group) == self._k:
                yield jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *group)
                group = []
        if group:
            raise ValueError(f"the dataset of distribute_dataset ended after {len(group)} of the "
                             f"{self._k} per-replica batches of a step: each step takes one "
                             "element per replica; make the number of elements a multiple of "
                             f"{self._k} (drop the remainder, or repeat the dataset).")


class TowerContext:
    """The 2018 ``TowerContext``: a `ReplicaContext` with the old names (``tower_id``, ...).

    Examples:
        >>> import jaxdist as jd
        >>> s = jd.MirroredStrategy()
        >>> def fn(three):
        ...     ctx = jd.compat.get_tower_context()
        ...     v = three + ctx.tower_id
        ...     return ctx.merge_call(lambda dist, pv: sum(dist.unwrap(pv)), v) + v
        >>> [int(x) for x in s.unwrap(s.call_for_each_tower(fn, 3))][:2]
        [55, 56]
    """

    def __init__(self, replica_context: ReplicaContext):
        self._ctx = replica_context

    @property
    def replica_context(self) -> ReplicaContext:
        """The modern context this wraps."""
        return self._ctx

    @property
    def tower_id(self) -> jax.Array | int:
        """2018 name of ``replica_id_in_sync_group``."""
        return self._ctx.replica_id_in_sync_group

    @property
    def num_towers(self) -> int:
        """2018 name of ``num_replicas_in_sync``."""
        return self._ctx.num_replicas_in_sync

    @property
    def distribution_strategy(self) -> Any:
        """2018 name of ``strategy`` (the `jaxdist.strategies.Strategy` of this replica context)."""
        return self._ctx.strategy

    def merge_call(self, merge_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``ReplicaContext.merge_call(merge_fn, args=args, kwargs=kwargs)``, 2018's signature."""
        return self._ctx.merge_call(merge_fn, args=args, kwargs=kwargs)

    def __repr__(self) -> str:
        return f"TowerContext({self._ctx!r})"
