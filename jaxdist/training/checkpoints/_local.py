"""The local tier: frequent checkpoints on each process's own disk, each shard on two processes.

A job saves to ``checkpoint_dir`` (the persistent tier: shared, slow at scale, so rare) and, with a
`LocalCheckpointer`, every few steps to each process's own directory (a host's SSD or RAM disk):

* Each process writes what it holds (the distinct shards of every leaf that live on its devices) and
  a copy of the NEXT process's shards (process ``p`` holds ``p + 1``'s, the last holds process 0's),
  moved by one collective (a `jax.device_put` onto the same mesh with each process's devices
  replaced by the previous process's), so every shard is on two hosts.
* Asynchronous: ``save`` returns once both are copied to host memory; a background thread writes
  ``own.npz``, ``peer.npz`` (numpy's format, see below) and ``meta.json`` into ``.<step>.partial``
  and renames it to ``<step>`` (the rename is the commit: a save killed midway, or failed on a full
  disk, leaves no step). A failed local save is a warning naming the step and the error, never the
  end of the run: the persistent tier is still there.
* Restart after a lost host: the processes exchange their lists of complete local steps
  (`jaxdist.job.exchange`) and each takes the same decision (`decide`): the newest step, at least as
  new as the persistent tier's, whose shards of EVERY process some surviving process holds, all
  written by the same run with this state's fingerprint and layout. Anything else falls back to the
  persistent tier, with the reason said by name; steps are never mixed.

Why not orbax's emergency checkpointing: it keeps local checkpoints per data-parallel replica and
needs at least two on a replica axis, so a state sharded across all processes (FSDP across hosts)
gets the persistent directory only; its P2P manager needs a replica axis too, and its replicator
the GKE multi-tier daemon. Orbax's handlers also refuse a per-process checkpoint, so the local
tier's files are numpy's ``.npz``; the persistent tier stays orbax's.

Examples:
    One process: the local tier is a fast checkpoint on this host (no peer to copy to):

    >>> import tempfile, jax.numpy as jnp, jaxdist as jd
    >>> state = jd.OneDeviceStrategy().mirror({"w": jnp.arange(4.0)})
    >>> local = LocalCheckpointer(tempfile.mkdtemp() + "/local-{process}")
    >>> local.save(2, state, {"note": "hi"})
    >>> local.wait_until_finished()
    >>> local.all_steps()
    [2]
    >>> restored = local.restore(state, persistent_step=None)
    >>> restored.step, restored.state["w"].tolist(), restored.meta["note"]
    (2, [0.0, 1.0, 2.0, 3.0], 'hi')
    >>> local.close()
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist.job import AGREE_SECONDS, exchange
from jaxdist.training.checkpoints._metadata import fingerprint, node_types
from jaxdist.training.checkpoints._storage import check_directory

__all__ = ["LocalCheckpointer", "LocalRestore", "decide"]

LOG = logging.getLogger("jaxdist.training.checkpoint")
FORMAT = "jaxdist-local/1"
_PARTIAL = ".partial"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _key(index: tuple, shape: Sequence[int]) -> str:
    """A shard's place in its array, as text (``"0:4,0:8"``; ``""`` for a scalar)."""
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _extent(index: tuple, shape: Sequence[int]) -> list[int]:
    """The shape of the shard at ``index``."""
    return [stop - start
            for start, stop, _ in (s.indices(n) for s, n in zip(index, shape, strict=True))]


def _sharding(leaf: Any, path: str) -> NamedSharding:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise TypeError("the local tier keeps arrays laid out on a mesh (a NamedSharding), but "
                        f"leaf {path} has "
                        f"{type(sharding).__name__ if sharding is not None else 'no layout'}: "
                        "place the state with a strategy (strategy.create_variables / "
                        "strategy.mirror), or use the persistent tier only.")
    return sharding


def layout(state: Any) -> str:
    """A digest of where every shard of ``state`` lives (by process and device position) and the
    process count: a local step restores only onto the layout that wrote it.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> s = jd.OneDeviceStrategy().mirror({"w": jnp.zeros(2)})
        >>> layout(s) == layout(s)
        True
    """
    out: list = [jax.process_count()]
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        sharding = _sharding(leaf, jax.tree_util.keystr(path))
        places = sorted((d.process_index, _position(d), _key(index, leaf.shape))
                        for d, index in sharding.devices_indices_map(tuple(leaf.shape)).items())
        out.append([jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype), places])
    return _digest(out)


def _position(device: jax.Device) -> int:
    """The device's place among its process's devices (by id), alike on every host of a job."""
    mine = sorted((d for d in jax.devices() if d.process_index == device.process_index),
                  key=lambda d: d.id)
    return mine.index(device)


def _rolled(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` with each process's devices replaced by the previous process's: a
    `jax.device_put` onto it moves process ``q``'s shards to ``q - 1`` (process 0's to the last)."""
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    for devices in by_process.values():
        devices.sort(key=lambda d: d.id)
    count = len(by_process)

    def previous(d: jax.Device) -> jax.Device:
        return by_process[(d.process_index - 1) % count][_position(d)]

    mesh = sharding.mesh
    devices = np.vectorize(previous, otypes=[object])(mesh.devices)
    return NamedSharding(Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types), sharding.spec)


def _pieces(leaves: Sequence[jax.Array]) -> dict[str, np.ndarray]:
    """This process's distinct shards of ``leaves``, on the host: ``{"<leaf>|<place>": array}``."""
    out: dict[str, np.ndarray] = {}
    for i, leaf in enumerate(leaves):
        for shard in leaf.addressable_shards:
            name = f"{i}|{_key(shard.index, leaf.shape)}"
            if name not in out:
                out[name] = np.array(shard.data)  # a copy: the step may donate the buffer
    return out


def _build(i: int, leaf: Any, pieces: Mapping[str, np.ndarray], target: NamedSharding) -> jax.Array:
    """Leaf ``i`` (shaped like ``leaf``) laid out as ``target`` from the ``pieces`` this process
    holds; zeros where it holds none (the collective that follows moves the copy that counts)."""
    shape, arrays = tuple(leaf.shape), []
    for device, index in target.addressable_devices_indices_map(shape).items():
        name = f"{i}|{_key(index, shape)}"
        data = pieces[name] if name in pieces else np.zeros(_extent(index, shape), leaf.dtype)
        arrays.append(jax.device_put(data, device))
    return jax.make_array_from_single_device_arrays(shape, target, arrays)


def _same_places(shape: Sequence[int], sharding: NamedSharding) -> bool:
    """Whether each device holds the same part under ``sharding`` and its `_rolled` twin (replicated
    across processes: a device_put between the two moves nothing)."""
    shape = tuple(shape)
    return sharding.devices_indices_map(shape) == _rolled(sharding).devices_indices_map(shape)


def _from_holder(i: int, leaf: Any, pieces: Mapping[str, np.ndarray], target: NamedSharding,
                 sources: Sequence[int]) -> jax.Array:
    """Leaf ``i`` (the same on every process) laid out as ``target``, from the first process that
    holds a copy: every process stacks its bytes as unsigned integers (zeros but on the holder) on a
    process axis, and a compiled sum over it gives the holder's bytes everywhere, exactly."""
    count, me, shape = len(sources), jax.process_index(), tuple(leaf.shape)
    holders = sorted({h for h in sources})
    whole = np.zeros(shape, leaf.dtype)
    if me == holders[0]:
        for index in target.addressable_devices_indices_map(shape).values():
            name = f"{i}|{_key(index, shape)}"
            if name in pieces:
                whole[index] = pieces[name]
    bits = np.dtype(f"uint{8 * whole.dtype.itemsize}")
    whole = whole.view(bits)
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    devices = devices.reshape(count, -1)
    stacked_sharding = NamedSharding(Mesh(devices, ("process", "device")),
                                     jax.sharding.PartitionSpec("process"))
    local = [jax.device_put(whole[None], d) for d in devices[me]]
    stacked = jax.make_array_from_single_device_arrays((count, *shape), stacked_sharding, local)
    summed = jax.jit(lambda s: s.sum(0, dtype=bits), out_shardings=target)(stacked)
    return jax.jit(lambda s: jax.lax.bitcast_convert_type(s, leaf.dtype),
                   out_shardings=target)(summed)


@dataclasses.dataclass(frozen=True)
class LocalRestore:
    """What `LocalCheckpointer.restore` decided and read.

    Attributes:
        step: the step restored, or None: the local tier had nothing to restore (see ``reason``).
        state: the restored state (None with ``step`` None).
        meta: the step's metadata (the ``meta`` given to ``save``).
        sources: for each process, the process whose copy its shards came from.
        reason: why the persistent tier is used instead (None when the local tier restored).
        persistent_step: the persistent tier's newest step given to the decision.
    """

    step: int | None
    state: Any = None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sources: tuple[int, ...] = ()
    reason: str | None = None
    persistent_step: int | None = None

    def message(self) -> str:
        """The log line: ``restored step 14 from the local tier: process 1's shards from process 0's
        copy; the persistent tier holds 10`` (or why the persistent tier restores instead).

        Examples:
            >>> print(LocalRestore(14, sources=(0, 0), persistent_step=10).message())
            ... # doctest: +NORMALIZE_WHITESPACE
            restored step 14 from the local tier: process 1's shards from process 0's copy;
            the persistent tier holds 10
        """
        holds = "nothing" if self.persistent_step is None else str(self.persistent_step)
        if self.step is None:
            return (f"the local tier restores nothing: {self.reason}; the persistent tier holds "
                    f"{holds}")
        moved = [f"process {q}'s shards from process {h}'s copy" for q, h in enumerate(self.sources)
                 if q != h]
        how = "; ".join(moved) if moved else "every process's shards from its own copy"
        return (f"restored step {self.step} from the local tier: {how}; "
                f"the persistent tier holds {holds}")


def decide(records: Sequence[Sequence[Mapping[str, Any]]], *, identity: str, layout: str,
           persistent_step: int | None) -> tuple[int | None, tuple[int, ...], str | None]:
    """The step the local tier restores, from every process's list of complete local steps (the same
    inputs on every process give the same answer).

    Args:
        records: for each process (in order), its complete local steps: ``{"step", "process",
            "peer", "processes", "identity", "layout", "run"}`` (``peer``: the process whose shards
            it also holds).
        identity: this run's digest (the state's fingerprint and the persistent directory).
        layout: this run's `layout`.
        persistent_step: the persistent tier's newest step (None: none): an older local step is not
            used.

    Returns:
        ``(step, sources, reason)``: the step (None: use the persistent tier), for each process the
        process whose copy holds its shards, and the reason when the step is None.

    Examples:
        Process 1's directory was lost; process 0 holds its own shards and process 1's:

        >>> rec = dict(processes=2, identity="i", layout="l", run="r")
        >>> decide([[dict(rec, step=14, process=0, peer=1)], []], identity="i", layout="l",
        ...        persistent_step=10)
        (14, (0, 0), None)
        >>> decide([[], [dict(rec, step=14, process=1, peer=0)]], identity="i", layout="l",
        ...        persistent_step=10)[0]
        14
        >>> decide([[], []], identity="i", layout="l", persistent_step=10)[2]
        'no process has a complete local step'
    """
    count = len(records)
    usable: dict[int, list[Mapping[str, Any]]] = {}
    refused: list[str] = []
    for process, mine in enumerate(records):
        for r in mine:
            step = int(r["step"])
            if r.get("processes") != count:
                refused.append(f"process {process}'s local step {step} was written by "
                               f"{r.get('processes')} processes, this job has {count}")
            elif r.get("identity") != identity:
                refused.append(f"process {process}'s local step {step} belongs to another run (its "
                               "fingerprint of the state and checkpoint_dir differs)")
            elif r.get("layout") != layout:
                refused.append(f"process {process}'s local step {step} was written with another "
                               "layout")
            else:
                usable.setdefault(step, []).append(r)
    floor = -1 if persistent_step is None else persistent_step
    missing: list[str] = []
    for step in sorted(usable, reverse=True):
        if step < floor:
            break
        by_run: dict[str, list[Mapping[str, Any]]] = {}
        for r in usable[step]:
            by_run.setdefault(r["run"], []).append(r)
        for run in sorted(by_run, key=lambda k: -len(by_run[k])):
            holders: dict[int, list[int]] = {}
            for r in by_run[run]:
                holders.setdefault(int(r["process"]), []).append(int(r["process"]))
                if r.get("peer") is not None:
                    holders.setdefault(int(r["peer"]), []).append(int(r["process"]))
            lacking = [q for q in range(count) if q not in holders]
            if not lacking:
                sources = tuple(q if q in holders[q] else holders[q][0] for q in range(count))
                return step, sources, None
            missing.append(f"step {step} lacks the shards of "
                           f"process{'es' if len(lacking) > 1 else ''} "
                           f"{', '.join(map(str, lacking))} (their own copy and their neighbour's "
                           "are both gone)")
    if missing:
        return None, (), missing[0]
    if refused:
        return None, (), refused[0]
    if usable:
        return None, (), f"its newest step ({max(usable)}) is older than the persistent tier's"
    return None, (), "no process has a complete local step"


class LocalCheckpointer:
    """Checkpoints on each process's own directory, every shard also on a neighbour's (local tier).

    Every process of the job creates one and calls `save` and `restore` at the same steps (both are
    collective). The persistent tier (a `Checkpointer` on a shared directory) stays what the run
    falls back to.

    Args:
        directory: this process's directory; ``{process}`` in it becomes the process index (e.g.
            ``"/mnt/ssd/ckpt-{process}"``). Created when missing.
        max_to_keep: how many local steps to keep.
        persistent: the persistent tier's directory (a path or None): part of the run's identity, so
            a local step written for another ``checkpoint_dir`` is never restored.

    Raises:
        ValueError: for a ``directory`` that cannot hold checkpoints, or ``max_to_keep < 1``.

    Examples:
        An own loop with both tiers, persistent every 3 steps and local every 2, then its restart
        (one process here, with no neighbour; in a job every process runs the same lines):

        >>> import tempfile, jax.numpy as jnp, jaxdist as jd
        >>> strategy, root = jd.OneDeviceStrategy(), tempfile.mkdtemp()
        >>> train_step = strategy.jit(lambda s: {"w": s["w"] + 1.0})
        >>> state = strategy.mirror({"w": jnp.zeros(3)})
        >>> ckpt = jd.training.Checkpointer(root + "/persistent")
        >>> local = LocalCheckpointer(root + "/local-{process}", persistent=ckpt.directory)
        >>> for step in range(1, 6):
        ...     state = train_step(state)
        ...     if step % 3 == 0:
        ...         _ = ckpt.save(step, state)
        ...     if step % 2 == 0:
        ...         local.save(step, state)
        >>> local.close()
        >>> ckpt.all_steps(), local.all_steps()
        ([3], [2, 4])

        The restart (a new process on the same directories): the local tier first, else the
        persistent one.

        >>> local = LocalCheckpointer(root + "/local-{process}", persistent=ckpt.directory)
        >>> like = strategy.mirror({"w": jnp.zeros(3)})
        >>> restored = local.restore(like, persistent_step=ckpt.latest_step())
        >>> if restored.step is not None:
        ...     state, step = restored.state, restored.step
        ... else:
        ...     (state, _), step = ckpt.restore(like), ckpt.latest_step()
        >>> # its log line: restored.message()
        >>> restored.step, restored.sources, restored.persistent_step
        (4, (0,), 3)
        >>> step, state["w"].tolist()
        (4, [4.0, 4.0, 4.0])
        >>> local.close(); ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 2, *,
                 persistent: str | os.PathLike | None = None):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an int >= 1.")
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"local_checkpoint_dir={directory!r} is not a path: pass a directory "
                             "path, with {process} in it for one directory per process.")
        path = os.fspath(directory).replace("{process}", str(jax.process_index()))
        self.directory = check_directory(path, "local_checkpoint_dir", create=True)
        self.max_to_keep = max_to_keep
        self.persistent = None if persistent is None else os.path.abspath(os.fspath(persistent))
        # this process's; the job uses process 0's (agreed at `restore`)
        self._run = uuid.uuid4().hex
        self._thread: threading.Thread | None = None
        self.failures: list[tuple[int, str]] = []
        for name in os.listdir(self.directory):  # what a killed or failed save left: never a step
            if name.endswith(_PARTIAL):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # --------------------------------------------------------------------------------------- saving
    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None) -> None:
        """Write ``state`` as local step ``step``: this process's shards and its neighbour's
        (collective: every process calls it at the same step). Returns once both are on the host;
        the files are written in the background (a previous save still in flight is waited for
        first). A failed write is a warning, and the step is not kept.

        Raises:
            TypeError: for a leaf not laid out on a mesh, or ``meta`` that is not JSON-serializable.
        """
        step = int(step)
        leaves, _ = jax.tree.flatten(state)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        shardings = [_sharding(leaf, path) for leaf, path in zip(leaves, paths, strict=True)]
        info = {**dict(meta or {}), "format": FORMAT, "step": step, "process": jax.process_index(),
                "processes": jax.process_count(), "identity": self.identity(state),
                "layout": layout(state), "run": self._run}
        try:
            json.dumps(info)
        except (TypeError, ValueError) as error:
            raise TypeError(f"meta={dict(meta or {})!r} is not JSON-serializable ({error}): pass "
                            "JSON values.") from None
        peer = None
        if jax.process_count() > 1:  # process p receives process p + 1's shards
            peer = jax.device_put(leaves, [_rolled(s) for s in shardings])
            info["peer"] = (jax.process_index() + 1) % jax.process_count()
        self.wait_until_finished()
        pieces = (_pieces(leaves), None if peer is None else _pieces(peer))
        self._thread = threading.Thread(target=self._write, args=(step, *pieces, info),
                                        name=f"jaxdist-local-save-{step}", daemon=False)
        self._thread.start()

    def identity(self, state: Any) -> str:
        """The run's digest: the state's fingerprint (with node types) and ``persistent``."""
        return _digest([fingerprint(state), node_types(state), self.persistent])

    def _write(self, step: int, own: dict, peer: dict | None, info: dict) -> None:
        partial = os.path.join(self.directory, f".{step}{_PARTIAL}")
        final = os.path.join(self.directory, str(step))
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            np.savez(os.path.join(partial, "own.npz"), **own)
            if peer is not None:
                np.savez(os.path.join(partial, "peer.npz"), **peer)
            with open(os.path.join(partial, "meta.json"), "w") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(partial, final)  # the commit
        except Exception as error:
            # a full or failed local disk: the persistent tier is still there
            shutil.rmtree(partial, ignore_errors=True)
            self.failures.append((step, repr(error)))
            LOG.warning("local checkpoint step %d could not be written to %r (%r): the local tier "
                        "keeps steps %s; training goes on (a restart falls back to an older local "
                        "step or the persistent tier)",
                        step, self.directory, error, self.all_steps(wait=False))
            return
        for old in self.all_steps(wait=False)[:-self.max_to_keep]:
            shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)

    def wait_until_finished(self) -> None:
        """Wait for the save in flight, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Wait for the save in flight."""
        self.wait_until_finished()

    def all_steps(self, wait: bool = True) -> list[int]:
        """This process's complete local steps, oldest first."""
        if wait:
            self.wait_until_finished()
        return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

    def records(self) -> list[dict]:
        """This process's complete local steps with what `decide` needs (a step whose metadata
        cannot be read is left out, said in the debug log)."""
        out = []
        for step in self.all_steps():
            try:
                with open(os.path.join(self.directory, str(step), "meta.json")) as f:
                    info = json.load(f)
            except (OSError, ValueError) as error:
                LOG.debug("local step %d in %r is unreadable: %r", step, self.directory, error)
                continue
            if info.get("format") != FORMAT:
                continue
            out.append({k: info.get(k) for k in ("step", "process", "peer", "processes", "identity",
                                                 "layout", "run")})
        return out

    # ------------------------------------------------------------------------------------ restoring
    def restore(self, like: Any, persistent_step: int | None) -> LocalRestore:
        """Agree with the job's other processes on the newest step the local copies assemble
        (`decide`), and read it into ``like``'s layout (collective: every process calls it).

        Args:
            like: the state in its layout (live arrays, or `jax.ShapeDtypeStruct`s with
                NamedShardings).
            persistent_step: the persistent tier's newest step (None: none); an older local step is
                not used.

        Returns:
            A `LocalRestore`; its ``step`` is None when the persistent tier must restore (``reason``
            says why). Later saves carry the run token of process 0, agreed here.
        """
        mine = {"records": self.records(), "run": self._run}
        everyone = [json.loads(v) for v in exchange("local checkpoint steps", json.dumps(mine),
                                                    AGREE_SECONDS)]
        # one run token for the job: steps of one run only are assembled
        self._run = everyone[0]["run"]
        step, sources, reason = decide([e["records"] for e in everyone],
                                       identity=self.identity(like),
                                       layout=layout(like), persistent_step=persistent_step)
        if step is None:
            return LocalRestore(None, reason=reason, persistent_step=persistent_step)
        state, meta = self._read(like, step, sources)
        return LocalRestore(step, state, meta, sources, None, persistent_step)

    def _read(self, like: Any, step: int, sources: tuple[int, ...]) -> tuple[Any, dict]:
        me, count = jax.process_index(), jax.process_count()
        here = os.path.join(self.directory, str(step))
        leaves, tree = jax.tree.flatten(like)
        shardings = [_sharding(leaf, str(i)) for i, leaf in enumerate(leaves)]
        meta: dict = {}
        own: Mapping[str, np.ndarray] = {}
        if sources[me] == me:
            own = np.load(os.path.join(here, "own.npz"))
        held: Mapping[str, np.ndarray] = {}
        if count > 1 and sources[(me + 1) % count] == me:
            held = np.load(os.path.join(here, "peer.npz"))
        if os.path.exists(os.path.join(here, "meta.json")):
            with open(os.path.join(here, "meta.json")) as f:
                meta = json.load(f)
        # the meta of the process whose copy this one restores from (alike but for its ids)
        meta = json.loads(exchange("local checkpoint meta", json.dumps(meta),
                                   AGREE_SECONDS)[sources[me]])
        needs_peer = any(q != h for q, h in enumerate(sources))
        out = []
        for i, (leaf, sharding) in enumerate(zip(leaves, shardings, strict=True)):
            mine = _build(i, leaf, own, sharding)
            if needs_peer and _same_places(leaf.shape, sharding):
                # replicated across processes: a device_put between the two layouts moves nothing,
                # so the copy goes from a process that holds one (collective)
                mine = _from_holder(i, leaf, own or held, sharding, sources)
            elif needs_peer:  # the neighbours' copies, moved back to their owners (collective)
                back = jax.device_put(_build(i, leaf, held, _rolled(sharding)), sharding)
                if sources[me] != me:
                    mine = back
            out.append(mine)
        return jax.tree.unflatten(tree, out), meta
