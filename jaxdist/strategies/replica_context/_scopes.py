"""``strategy.scope()``: the strategy is current, its mesh JAX's ambient mesh, its logical rules
Flax's.

Inside a scope, Flax applies ``nn.with_partitioning`` / ``nnx.with_partitioning`` annotations on the
strategy's mesh as the model's code runs, so an annotation naming an axis that mesh lacks fails in
JAX, in code jaxdist never sees (an nnx module's constructor). That ``ValueError`` looks like any
other, and JAX's message may be reworded, so jaxdist looks at what failed instead: when a frame of
the error's traceback holds a `PartitionSpec` naming an axis the mesh lacks, the error keeps its
type and message and gains a note (PEP 678) naming that spec, the names an annotation may use here
and the fix; any other ``ValueError`` passes untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from jaxdist.replicate.layouts import spec_axes
from jaxdist.strategies import ambient
from jaxdist.strategies.layout import LayoutPolicy

__all__ = ["enter_scope"]


@contextlib.contextmanager
def enter_scope(strategy: Any, policy: LayoutPolicy) -> Iterator[Any]:
    """Push ``strategy`` as the current one (re-entering its own scope is fine).

    Raises:
        RuntimeError: for another strategy's scope open around this one, or inside a replica
            function.
    """
    current = ambient.current_scope()
    if current is not None and current is not strategy:
        raise RuntimeError("Mixing different Strategy objects: cannot enter the scope of "
                           f"{strategy!r} inside the scope of {current!r}. Leave the outer scope "
                           "first, or use one strategy for both.")
    if ambient.current_replica() is not None:
        raise RuntimeError("strategy.scope() cannot be entered inside a replica function "
                           "(strategy.run); open the scope in cross-replica code, around the "
                           "training loop.")
    # Flax nnx creates variables annotated with nnx.with_partitioning already sharded, on the
    # ambient mesh; a plan mesh (jd.plan_mesh) has no devices: it is the ambient abstract mesh only.
    mesh = (jax.sharding.use_abstract_mesh(policy.mesh)
            if isinstance(policy.mesh, jax.sharding.AbstractMesh) else jax.set_mesh(policy.mesh))
    with ambient.scope(strategy), mesh, policy.flax_rules():
        try:
            yield strategy
        except ValueError as error:
            spec = _missing_axis_spec(error, tuple(policy.mesh.axis_names))
            note = None if spec is None else _scope_note(type(strategy).__name__, policy, spec)
            # a re-entered scope notes once
            if note is not None and note not in getattr(error, "__notes__", ()):
                error.add_note(note)
            raise


def _missing_axis_spec(error: BaseException,
                       axes: tuple[str, ...]) -> jax.sharding.PartitionSpec | None:
    """A `PartitionSpec` naming an axis not in ``axes`` held by a frame of ``error``'s traceback."""
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, jax.sharding.PartitionSpec):
                names = {n for n in spec_axes(value) if isinstance(n, str)}
                if names - set(axes):
                    return value
        tb = tb.tb_next
    return None


def _scope_note(owner: str, policy: LayoutPolicy, spec: jax.sharding.PartitionSpec) -> str:
    """The note of a ``ValueError`` raised inside ``owner``'s scope whose failed layout ``spec``
    names an axis the mesh lacks: the names an annotation may use there, and the fix.

    Examples:
        >>> import jax
        >>> policy = LayoutPolicy(jax.devices()[:2])
        >>> note = _scope_note("MirroredStrategy", policy, jax.sharding.PartitionSpec("model"))
        >>> print(note.splitlines()[0])  # doctest: +NORMALIZE_WHITESPACE
        jaxdist: raised inside MirroredStrategy.scope(), where the ambient mesh is this strategy's,
        axes ('replica',).
    """
    axes = tuple(policy.mesh.axis_names)
    rules = policy.rules.logical_axis_rules
    lines = [
        f"jaxdist: raised inside {owner}.scope(), where the ambient mesh is this strategy's, axes "
        f"{axes}.",
        f"The layout {spec} names an axis not in {axes}: a partitioning annotation "
        "(nn.with_partitioning / nnx.with_partitioning) names an axis this mesh does not have.",
    ]
    if rules:
        aliases = tuple(dict.fromkeys(name for name, _ in rules))
        lines.append(
            f"Its logical_axis_rules map {aliases}; Flax nnx passes a logical name no rule maps "
            "through as a mesh axis (linen maps it to None): give that name a rule, e.g. add "
            f"(name, None) to keep the dimension whole, or (name, {axes[0]!r}) to split it."
        )
    lines.append(
        "Fix: name logical axes (nn.with_logical_partitioning) and map them with "
        "ShardedStrategy(logical_axis_rules=...): such a model runs on every strategy; or use a "
        "strategy whose mesh has that axis (ShardedStrategy(mesh=your_mesh, batch_axes=...) keeps "
        "your mesh's axis names; ShardedStrategy(model_parallelism=k) has 'model')."
    )
    return "\n".join(lines)
