"""``strategy.scope()``: the strategy is current, its mesh JAX's ambient mesh, its logical rules Flax's.

Entering a second, different strategy's scope inside another's is an error (tf.distribute's "Mixing different
Strategy objects"); re-entering the same strategy's scope is fine. Inside a scope, JAX's terse error for a
partitioning annotation naming an axis the mesh lacks is said in the user's terms.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import jax

from jaxdist.strategies import ambient
from jaxdist.strategies.policy import LayoutPolicy

__all__ = ["enter_scope"]


@contextlib.contextmanager
def enter_scope(strategy: Any, policy: LayoutPolicy) -> Iterator[Any]:
    """Push ``strategy`` as the current one: its mesh is JAX's ambient mesh and its logical axis rules Flax's
    inside; another strategy's scope inside it is an error."""
    current = ambient.current_scope()
    if current is not None and current is not strategy:
        raise RuntimeError(
            f"Mixing different Strategy objects: cannot enter the scope of {strategy!r} inside the scope of "
            f"{current!r}. Leave the outer scope first, or use one strategy for both."
        )
    if ambient.current_replica() is not None:
        raise RuntimeError(
            "strategy.scope() cannot be entered inside a replica function (strategy.run); "
            "open the scope in cross-replica code, around the training loop."
        )
    # The strategy's mesh is JAX's ambient mesh inside the scope: Flax nnx creates variables annotated with
    # nnx.with_partitioning already sharded, on the ambient mesh.
    with ambient.scope(strategy), jax.set_mesh(policy.mesh), policy.flax_rules():
        try:
            yield strategy
        except ValueError as error:
            explained = _missing_mesh_axis(error, strategy, policy)
            if explained is None:
                raise
            raise explained from error


_MISSING_AXIS = re.compile(r"Resource axis: (\S+) of (.+) is not found in mesh")


def _missing_mesh_axis(error: ValueError, strategy: Any, policy: LayoutPolicy) -> ValueError | None:
    """JAX's error for a sharding that names an axis the ambient mesh lacks, said in the user's terms: inside
    a scope that is a model's partitioning annotation naming an axis this strategy's mesh does not have."""
    match = _MISSING_AXIS.search(str(error))
    if match is None:
        return None
    axis, spec = match.groups()
    message = (
        f"A partitioning annotation names axis {axis!r} ({spec}), which {type(strategy).__name__}'s mesh (axes "
        f"{tuple(policy.mesh.axis_names)}) does not have. "
    )
    if policy.rules.logical_axis_rules:
        message += (
            f"If {axis!r} is a logical name, give it a rule: Flax nnx passes a logical name that no rule maps "
            f"through as a mesh axis (linen maps it to None): add ({axis!r}, None) to logical_axis_rules to keep "
            f"that dimension whole, or ({axis!r}, {policy.mesh.axis_names[0]!r}) to split it. "
        )
    return ValueError(
        message + "nn.with_partitioning / nnx.with_partitioning name MESH axes, and Flax applies them on the "
        "ambient mesh, which inside strategy.scope() is the strategy's. Name logical axes instead "
        "(nn.with_logical_partitioning) and map them with ShardedStrategy(logical_axis_rules=...): such a model "
        "runs on every strategy; or use a strategy whose mesh has that axis (ShardedStrategy(mesh=your_mesh, "
        "batch_axes=...) keeps your mesh's axis names; ShardedStrategy(model_parallelism=k) has 'model')."
    )
