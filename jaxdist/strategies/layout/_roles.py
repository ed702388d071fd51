"""Roles: is a value a batch, a variable, a per-replica value or a constant? Decided here only.

A role is declared or carried by the value, never guessed:

* declared: ``batch_argnums`` of ``strategy.jit`` / ``strategy.run`` / ``outside_compilation`` lists
  the batch arguments; every other array argument is a variable;
* carried by the type: `PerReplica` / `SyncOnRead` hold one component per replica; Python numbers,
  strings, callables and configs are compile-time constants;
* carried by the layout (`LayoutPolicy.layout_role`): an array on the strategy's mesh with axis 0
  split over the replicas is a batch (from a distributed dataset); one in another layout there is a
  variable. Where variables can be split over the replicas too (FSDP) the layout cannot tell: there
  an array is a batch when the strategy's input functions placed it (`placed_as_batch`: they record
  what they hand out, weakly), and any other array split like a batch must be declared (a batch
  and an FSDP variable split over the same axes have equal shardings);
* inside a compiled step: the step's own arguments keep the role they entered with (the step records
  them in its computation frame when it is traced: `jaxdist.strategies.compile._trace._roles`); a
  value COMPUTED in the step (``x / 255``) has no role, and a per-replica verb given one of rank >=
  1 (``strategy.run``, ``outside_compilation``) asks for the declaration.
"""

from __future__ import annotations

import enum
import threading
import warnings
import weakref
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.trees import is_array
from jaxdist.replicate.values import PerReplica, SyncOnRead
from jaxdist.strategies import ambient
from jaxdist.strategies.layout._axis_types import explicit_axes

__all__ = ["Role", "UndeclaredBatchWarning", "classify", "mark_placed_batch", "placed_as_batch",
           "role_in_trace", "traced_role", "typed_role"]


class UndeclaredBatchWarning(UserWarning):
    """An array whose role jaxdist cannot know reached a strategy computation with no declaration of
    which arguments are batches (declare them with ``batch_argnums``)."""


class Role(enum.Enum):
    """The role of one argument leaf of a strategy computation."""

    VARIABLE = "variable"  # a whole copy per replica (mirrored) / the variable layout (global)
    BATCH = "batch"  # axis 0 split over the replicas
    PER_REPLICA = "per_replica"  # a PerReplica: one component per replica
    SYNC_ON_READ = "sync_on_read"  # a SyncOnRead: one component per replica, aggregated on read
    STATIC = "static"  # not an array: a compile-time constant


_placed: dict[int, weakref.ref] = {}  # id -> weak ref: arrays the input functions placed as batches
_placed_lock = threading.Lock()


def mark_placed_batch(x: Any) -> None:
    """Record that the input functions placed ``x`` as a distributed batch (a role it keeps)."""
    if not isinstance(x, jax.Array):
        return
    key = id(x)
    with _placed_lock:
        _placed[key] = weakref.ref(x, lambda _, key=key: _placed.pop(key, None))


def placed_as_batch(x: Any) -> bool:
    """Whether the input functions placed ``x`` itself (not a value derived from it) as a batch."""
    ref = _placed.get(id(x))
    return ref is not None and ref() is x


def role_in_trace(x: Any, policy: Any) -> Role | None:
    """The role tracer ``x`` entered a computation of ``policy`` with (a step's batch or variable
    argument); None for values derived inside it. A value being differentiated (``jax.grad`` inside
    the step wraps its argument in a JVP tracer) keeps the role of the argument it wraps."""
    candidates = [x]
    while isinstance(getattr(candidates[-1], "primal", None), jax.core.Tracer):
        candidates.append(candidates[-1].primal)
    for frame in reversed(ambient.state.computations):
        if frame.policy is policy:
            for c in candidates:
                if any(t is c for t in frame.batches):
                    return Role.BATCH
                if any(t is c for t in frame.variables):
                    return Role.VARIABLE
    return None


def typed_role(x: Any, policy: Any) -> Role | None:
    """The role a traced value's TYPE gives it on a mesh whose batch axes are ``Explicit`` (sharding
    in types): rows split over every batch axis, a batch (also a slice of one inside ``lax.scan``,
    or under ``jax.checkpoint``); split over none of them, a variable; None where the type cannot
    tell (Auto axes, or a value split over the batch axes some other way)."""
    explicit = set(explicit_axes(policy.mesh))
    batch_axes = tuple(policy.batch_axes)
    if not explicit or not set(batch_axes) <= explicit or np.ndim(x) < 1:
        return None
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None:
        return None
    entries = [e if isinstance(e, tuple) else (e,) for e in spec]
    used = {n for e in entries for n in e if n is not None}
    if not used & set(batch_axes):
        return Role.VARIABLE
    if entries and tuple(n for n in entries[0] if n is not None) == batch_axes:
        return Role.BATCH
    return None


def traced_role(policy: Any, x: Any, where: str, declaration: str) -> Role:
    """The role of a traced value reaching a per-replica verb inside a step: the role the step's
    argument it is entered with; a value of rank >= 1 computed in the step has none, so it is an
    error naming ``declaration`` (how to declare the batch arguments at that call).

    Raises:
        ValueError: for a value of rank >= 1 computed inside the step.
    """
    role = role_in_trace(x, policy)
    if role is None:  # computed in the step: on Explicit batch axes its type may still say
        role = typed_role(x, policy)
    if role is None and np.ndim(x) >= 1:
        verb = declaration.split("(", 1)[0]
        raise ValueError(f"{verb} got {where}, an array of shape {tuple(np.shape(x))} computed "
                         "inside the step, whose role jaxdist cannot know: only the step's own "
                         "batch arguments are split over the replicas, and a value derived from "
                         "one (say x / 255, or logits) might be a batch or a value every replica "
                         f"needs whole. Declare the roles: {declaration} lists the batch arguments "
                         "(every other one reaches each replica whole; batch_argnums=() if none is "
                         "a batch).")
    return role or Role.VARIABLE


def classify(policy: Any, leaf: Any, declared: bool | None, where: str, verb: str,
             warned: list[bool]) -> Role:
    """The role of one argument leaf of a per-replica computation (``strategy.run``).

    Args:
        policy: the strategy's `LayoutPolicy`.
        leaf: the value.
        declared: True / False when ``batch_argnums`` says whether its argument is a batch, None
            when the caller declared nothing.
        where: how errors name the leaf (``"args[1]['x']"``).
        verb: how errors name the call (``"strategy.run"``).
        warned: a one-element list, the caller's "already warned about an ambiguous layout" flag.

    Raises:
        ValueError: for a per-replica value of another strategy, or (undeclared) a value of rank >=
            1 computed inside a step.
    """
    if isinstance(leaf, (PerReplica, SyncOnRead)):
        return Role.SYNC_ON_READ if isinstance(leaf, SyncOnRead) else Role.PER_REPLICA
    if not is_array(leaf):
        return Role.STATIC
    if declared is not None:
        return Role.BATCH if declared else Role.VARIABLE
    if isinstance(leaf, jax.core.Tracer):
        return traced_role(policy, leaf, where, f"{verb}(fn, args=..., batch_argnums=(i, ...))")
    role = policy.layout_role(leaf)
    if role is None and np.ndim(leaf) >= 1 and policy.is_batch_layout(leaf) and not warned[0]:
        warned[0] = True
        warnings.warn(
            f"{verb} got {where}, split over the replicas on axis 0 like a batch but not placed by "
            "this strategy's input functions, on a strategy whose variables can have that layout "
            "too, so it is taken as a variable (every replica sees all of it). Declare the roles: "
            f"{verb}(fn, args=..., batch_argnums=(i, ...)) lists the batch arguments.",
            UndeclaredBatchWarning, stacklevel=5)
    elif role is None and _rows_split_elsewhere(leaf, policy) and not warned[0]:
        warned[0] = True
        warnings.warn(
            f"{verb} got {where}, split on axis 0 over a mesh that is not this strategy's (axes "
            f"{leaf.sharding.mesh.axis_names}, types {leaf.sharding.mesh.axis_types}; the "
            f"strategy's are {policy.mesh.axis_names}, {policy.mesh.axis_types}), so its role "
            "cannot be read from its layout and it is taken as a variable (every replica sees all "
            f"of it). Declare the roles: {verb}(fn, args=..., batch_argnums=(i, ...)) lists the "
            "batch arguments.", UndeclaredBatchWarning, stacklevel=5)
    return Role.BATCH if role == "batch" else Role.VARIABLE


def _rows_split_elsewhere(x: Any, policy: Any) -> bool:
    """An array laid out over another mesh (say the user's, of other axis types) with its rows
    split: it may be a batch, which its layout cannot say for this strategy."""
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return (isinstance(x, jax.Array) and np.ndim(x) >= 1 and spec is not None and len(spec) > 0
            and spec[0] is not None and sharding.mesh != policy.mesh)
