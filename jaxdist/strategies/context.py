"""Which strategy is current: the scope stack, the lazy default strategy, and the replica context.

Cross-replica context is the normal Python code between steps; replica context is the body of a function
running under `Strategy.run`. ``get_strategy()`` returns the strategy whose ``scope()`` is open, else a default
single-device strategy created on first use (never at import: `jax.distributed.initialize` must be able to
run before any device is queried). ``get_replica_context()`` returns the `ReplicaContext` of the replica being
traced, ``None`` in cross-replica context (inside a scope), and a single-replica default context outside any
scope, as in tf.distribute.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from jaxdist.strategies.base import Strategy
    from jaxdist.strategies.replica_context import ReplicaContext

__all__ = [
    "enter_replica",
    "enter_scope",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class _State(threading.local):
    def __init__(self) -> None:
        self.scopes: list[Strategy] = []
        self.replicas: list[ReplicaContext] = []


_state = _State()
_default: dict[str, Any] = {}
_default_lock = threading.Lock()


def _default_strategy() -> Strategy:
    with _default_lock:
        if "strategy" not in _default:
            from jaxdist.strategies.one_device import OneDeviceStrategy

            _default["strategy"] = OneDeviceStrategy()
        return _default["strategy"]


def get_strategy() -> Strategy:
    """The current strategy: the innermost open ``scope()`` (or running replica), else the default one.

    The default strategy is a `OneDeviceStrategy` on the first device, created lazily on the first call.

    Returns:
        The current `Strategy`.

    Example:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> with strategy.scope():
        ...     assert jd.get_strategy() is strategy
    """
    if _state.replicas:
        return _state.replicas[-1].strategy
    if _state.scopes:
        return _state.scopes[-1]
    return _default_strategy()


def has_strategy() -> bool:
    """True inside some strategy's ``scope()`` or replica function (tf.distribute.has_strategy).

    Example:
        >>> import jaxdist as jd
        >>> jd.has_strategy()
        False
    """
    return bool(_state.scopes or _state.replicas)


def in_cross_replica_context() -> bool:
    """True inside a strategy's ``scope()`` but not inside a replica function.

    Example:
        >>> import jaxdist as jd
        >>> with jd.OneDeviceStrategy().scope():
        ...     jd.in_cross_replica_context()
        True
    """
    return bool(_state.scopes) and not _state.replicas


def get_replica_context() -> ReplicaContext | None:
    """The replica context of the replica function being run, or None in cross-replica context.

    Inside ``strategy.run(fn)``: the `ReplicaContext` of the replica (its id, all-reduce, all-gather).
    Inside ``strategy.scope()`` but outside ``run``: None (cross-replica context). Outside any scope: a
    single-replica context of the default strategy, so replica code also runs without a strategy.

    Example:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> with strategy.scope():
        ...     print(jd.get_replica_context())
        None
    """
    if _state.replicas:
        return _state.replicas[-1]
    if _state.scopes:
        return None
    from jaxdist.strategies.replica_context import ReplicaContext

    return ReplicaContext(_default_strategy(), traced=False)


@contextlib.contextmanager
def enter_scope(strategy: Strategy) -> Iterator[Strategy]:
    """Push ``strategy`` as the current one (its mesh JAX's ambient mesh); another strategy's scope inside it is
    an error."""
    current = _state.scopes[-1] if _state.scopes else None
    if current is not None and current is not strategy:
        raise RuntimeError(
            f"Mixing different Strategy objects: cannot enter the scope of {strategy!r} inside the scope of "
            f"{current!r}. Leave the outer scope first, or use one strategy for both."
        )
    if _state.replicas:
        raise RuntimeError(
            "strategy.scope() cannot be entered inside a replica function (strategy.run); "
            "open the scope in cross-replica code, around the training loop."
        )
    _state.scopes.append(strategy)
    try:
        # The strategy's mesh is JAX's ambient mesh inside the scope: Flax nnx creates variables annotated with
        # nnx.with_partitioning already sharded, on the ambient mesh.
        with jax.set_mesh(strategy.mesh):
            try:
                yield strategy
            except ValueError as error:
                explained = _missing_mesh_axis(error, strategy)
                if explained is None:
                    raise
                raise explained from error
    finally:
        _state.scopes.pop()


_MISSING_AXIS = re.compile(r"Resource axis: (\S+) of (.+) is not found in mesh")


def _missing_mesh_axis(error: ValueError, strategy: Strategy) -> ValueError | None:
    """JAX's error for a sharding that names an axis the ambient mesh lacks, said in the user's terms: inside
    a scope that is a model's partitioning annotation naming an axis this strategy's mesh does not have."""
    match = _MISSING_AXIS.search(str(error))
    if match is None:
        return None
    axis, spec = match.groups()
    message = (
        f"A partitioning annotation names axis {axis!r} ({spec}), which {type(strategy).__name__}'s mesh (axes "
        f"{tuple(strategy.mesh.axis_names)}) does not have. "
    )
    if getattr(strategy, "logical_axis_rules", ()):
        message += (
            f"If {axis!r} is a logical name, give it a rule: Flax nnx passes a logical name that no rule maps "
            f"through as a mesh axis (linen maps it to None): add ({axis!r}, None) to logical_axis_rules to keep "
            f"that dimension whole, or ({axis!r}, 'replica') to split it. "
        )
    return ValueError(
        message + "nn.with_partitioning / nnx.with_partitioning name MESH axes, and Flax applies them on the "
        "ambient mesh, which inside strategy.scope() is the strategy's. Name logical axes instead "
        "(nn.with_logical_partitioning) and map them with ShardedStrategy(logical_axis_rules=...): such a model "
        "runs on every strategy; or use a strategy whose mesh has that axis (ShardedStrategy(model_parallelism=k) "
        "has 'model')."
    )


@contextlib.contextmanager
def enter_replica(ctx: ReplicaContext) -> Iterator[ReplicaContext]:
    """Mark the code traced inside as replica context (used by `Strategy.run`)."""
    _state.replicas.append(ctx)
    try:
        yield ctx
    finally:
        _state.replicas.pop()
