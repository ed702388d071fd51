"""Which axis types a program runs with: the user's Explicit axes where the step type-checks, Auto
where not.

On a mesh with ``Explicit`` axes (``jax.make_mesh``'s default) a value's layout over them is part of
its type, and JAX refuses code that does not say where a result goes (an embedding lookup of a whole
table with indices split over the batch axes asks for ``out_sharding=``). Code written for such a
mesh (gemma, JAX's training cookbook) type-checks and runs with its axes as they are. Code written
for one device (most Flax models) does not: it runs as JAX runs unannotated code, with those axes
``Auto`` for the program, so XLA propagates layouts from the in/out layouts jaxdist resolved. The
numbers are the same either way.

The decision is made once per program, when it is traced (`decided`): the step is traced with the
mesh's Explicit axes; if that trace fails, it is dropped whole (nothing of it runs) and the program
is traced again with those axes Auto (`auto_region`: the program's arguments and results keep their
Explicit types; inside, the step sees the same mesh with Auto axes). JAX refusing the step by those
types (`is_type_refusal`) is the usual cause, not the only one (Equinox's ``State.set`` and
diffrax raise ValueErrors of their own over types), so ANY error of the Explicit trace is retried
Auto: where the Auto trace succeeds, the program runs Auto; where it fails too, the Explicit trace's
error is raised (where the Auto trace failed otherwise, its error chained as the cause and
``axis_types=`` named). Told apart by re-tracing and by the errors' types and places, never by an
error's message. JAX caches the program that traced, so a steady-state call never repeats the
decision; ``strategy.jit(..., axis_types=jax.sharding.AxisType.Auto)`` (or ``Explicit``) forces one.

Inside a program, code that lays values out asks the trace, not the strategy's mesh: `explicit_axes`
(the mesh's axes Explicit in the current trace) and `trace_mesh` / `in_trace` (the mesh, or a layout
on it, as the current trace types it).

Examples:
    >>> import jax, jax.numpy as jnp, jaxdist as jd
    >>> mesh = jax.make_mesh((8,), ("data",))                  # Explicit, jax.make_mesh's default
    >>> strategy = jd.ShardedStrategy(mesh=mesh, min_shard_size=1)
    >>> table = strategy.mirror(jnp.ones((16, 4)))
    >>> lookup = strategy.jit(lambda table, ids: table[ids].sum(), batch_argnums=1)
    >>> # refused under Explicit types: runs Auto
    >>> float(lookup(table, jnp.arange(8)))
    32.0
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxdist.strategies import ambient

__all__ = ["ExplicitRefused", "auto_region", "decided", "explicit_axes", "in_trace", "initializer",
           "is_type_refusal", "runs_auto", "leave_auto", "program_axis_types", "ran_auto",
           "refusals", "retyped", "say", "shape_scope", "trace_mesh", "untyped"]

log = logging.getLogger("jaxdist")

_CONSTRAINT_CODE = inspect.unwrap(jax.lax.with_sharding_constraint).__code__
_MARK = "jaxdist_axis_types_auto"  # the named scope of an Auto program's entry (see `retyped`)


class ExplicitRefused(Exception):
    """Raised out of a failed trace with Explicit axes; `decided` traces the program again Auto.

    ``typed``: whether JAX refused it by the axes' types (`is_type_refusal`); otherwise the step's
    code (or a library's under it) raised an error of its own, which only the Auto trace tells apart
    from a bug.
    """

    def __init__(self, error: Exception, typed: bool = True):
        super().__init__(str(error))
        self.error, self.typed = error, typed


def is_type_refusal(error: BaseException) -> bool:
    """Whether ``error`` is JAX refusing code under Explicit axes' types: its sharding type error
    (JAX does not export the class: told by its name), or the assertion
    ``jax.lax.with_sharding_constraint`` makes when every axis is Explicit (a layout constraint that
    disagrees with the value's type: told by that function's frame in the traceback). Never by the
    message."""
    if type(error).__name__ == "ShardingTypeError":
        return True
    if not isinstance(error, AssertionError):
        return False
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _CONSTRAINT_CODE:
            return True
        tb = tb.tb_next
    return False


def _explicit(mesh: Any) -> tuple[str, ...]:
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                 if t == AxisType.Explicit)


@functools.cache
def _auto_twin(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """``mesh`` with its Explicit axes Auto (same devices, names and order)."""
    types = {a: AxisType.Auto for a in _explicit(mesh)}
    if isinstance(mesh, AbstractMesh):
        return mesh.update_axis_types(types)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=tuple(
        AxisType.Auto if a in types else t for a, t in zip(mesh.axis_names, mesh.axis_types,
                                                           strict=True)))


def _in_auto_twin(mesh: Any) -> bool:
    current = jax.sharding.get_abstract_mesh()
    if current.empty or not _explicit(mesh):
        return False
    return current == _auto_twin(mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh)


def explicit_axes(mesh: Any) -> tuple[str, ...]:
    """The axes of ``mesh`` that are Explicit where this is called: none inside a program that runs
    them Auto (`auto_region`), the mesh's own Explicit axes elsewhere."""
    return () if _in_auto_twin(mesh) else _explicit(mesh)


def trace_mesh(mesh: Any) -> Any:
    """``mesh`` as the current trace types it: its Auto twin inside `auto_region`, else ``mesh``
    itself (what ``jax.shard_map(mesh=...)`` and layouts inside the program must name)."""
    return _auto_twin(mesh) if _in_auto_twin(mesh) else mesh


def in_trace(sharding: Any) -> Any:
    """A `NamedSharding` on the mesh as the current trace types it (`trace_mesh`); others as is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    mesh = trace_mesh(sharding.mesh)
    if mesh is sharding.mesh:
        return sharding
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def program_axis_types() -> AxisType | None:
    """The axis types the program being traced runs with: ``Auto`` (its Explicit axes run Auto),
    ``Explicit``, or None outside `decided` (Explicit, refusals raised as they are)."""
    return ambient.state.axis_types[0]


@contextlib.contextmanager
def _mode(mode: AxisType | None, forced: bool, why: str) -> Iterator[None]:
    previous, ambient.state.axis_types = ambient.state.axis_types, (mode, forced, why)
    try:
        yield
    finally:
        ambient.state.axis_types = previous


def refused(error: BaseException) -> bool:
    """Whether ``error``, raised tracing a step with Explicit axes, makes `decided` trace it again
    Auto: any error, where `decided` chooses the axis types (not forced by ``axis_types=``, not
    outside `decided`)."""
    return not isinstance(error, ExplicitRefused) and not ambient.state.axis_types[1]


def say(mesh: Any, name: str, auto: bool) -> None:
    """Log, once per program (where it has been traced), the axis types it runs with and why."""
    if not _explicit(mesh):
        return
    why = ambient.state.axis_types[2] or "the mesh's own"
    log.info("%s: runs with the mesh's axes %s %s (%s); strategy.jit(..., axis_types=...) chooses.",
             name, _explicit(mesh), "Auto" if auto else "Explicit", why)


def decided(mesh: Any, axis_types: AxisType | None, call: Callable[[], Any], name: str) -> Any:
    """``call()`` (which may trace a program of ``name`` on ``mesh``) with the program's axis types
    decided: ``axis_types`` when given; else the mesh's Explicit axes, and when the trace raises
    `ExplicitRefused`, the same call again with them Auto (the trace that succeeds logs which).

    Raises:
        When both traces fail, with a note: where the Explicit trace's error is no type refusal,
            that error (caused by the Auto trace's where that is another error or raised at another
            place; the note names ``axis_types=``); where JAX refused the Explicit trace by types,
            the Auto trace's own error if it is no type refusal (what the user must fix), else the
            Explicit trace's sharding type error (the Auto refusal its cause).
    """
    if not _explicit(mesh) or _in_auto_twin(mesh):
        return call()
    if axis_types is not None:
        with _mode(axis_types, forced=True, why=f"axis_types=AxisType.{axis_types.name}"):
            return call()
    here = ambient.state  # (inline, not _mode: every call of the full path comes here)
    previous, here.axis_types = here.axis_types, (AxisType.Explicit, False,
                                                  "its code type-checks with them")
    try:
        return call()
    except ExplicitRefused as explicit:
        error, typed = explicit.error, explicit.typed
    finally:
        here.axis_types = previous
    why = ("its code does not type-check with them Explicit" if typed else
           f"its code raised {type(error).__name__} with them Explicit and traces with them Auto")
    try:
        with _mode(AxisType.Auto, forced=True,
                   why=f"{why}; XLA propagates the layouts jaxdist resolved"):
            return call()
    except Exception as auto_error:
        if typed:
            _raise_typed(error, auto_error, mesh, name)
        if type(auto_error) is not type(error) or _raised_at(auto_error) != _raised_at(error):
            # Another error at another place: the first may be a library's type check under
            # Explicit axes, the second the step's own bug past it. Both are shown, the first last.
            first = (str(auto_error).splitlines() or [""])[0][:300]
            error.add_note(
                f"jaxdist: {name} raised the error above with the mesh's axes {_explicit(mesh)} "
                f"Explicit, and another with them Auto ({type(auto_error).__name__}: {first}; its "
                "traceback is shown first). If the error above is a library checking its values' "
                "types (layouts are part of them on Explicit axes), the other one is the step's to "
                "fix: strategy.jit(..., axis_types=jax.sharding.AxisType.Auto) raises it alone.")
            raise error from auto_error
        # The same error at the same place: the step's own, raised outside this handler (so its
        # traceback does not carry the Auto trace's).
        error.add_note(f"jaxdist: {name} was traced again with the mesh's axes {_explicit(mesh)} "
                       f"Auto and failed there the same way: the axis types are not its cause.")
    raise error


def _raised_at(error: BaseException) -> tuple[Any, int] | None:
    """Where ``error`` was raised: its innermost frame's code and line (None without traceback)."""
    tb = error.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code, tb.tb_lineno


def _raise_typed(error: Exception, auto_error: Exception, mesh: Any, name: str) -> None:
    """Raise what `decided` raises where JAX refused the Explicit trace by types (``error``) and the
    Auto trace failed too (``auto_error``, being handled)."""
    if not is_type_refusal(auto_error):
        # The step's own error (a configuration check of its layers, a shape error): raised as
        # itself, not buried under the Explicit attempt's type refusal, which is noted.
        first = (str(error).splitlines() or [""])[0][:300]
        auto_error.add_note(f"jaxdist: {name} was traced first with the mesh's axes "
                            f"{_explicit(mesh)} Explicit, where JAX refused it by their types "
                            f"({type(error).__name__}: {first}); the error above comes from "
                            "tracing it with them Auto. If it comes from code that needs Explicit "
                            "axes (out_sharding=, jax.sharding.reshard naming them), annotate the "
                            "refused operation too, or drop those annotations.")
        raise auto_error
    first = (str(auto_error).splitlines() or [""])[0][:300]
    error.add_note(f"jaxdist: {name} was traced with the mesh's axes {_explicit(mesh)} Auto too, "
                   f"and failed there as well ({type(auto_error).__name__}: {first}). If some of "
                   "its code needs Explicit axes (out_sharding=, jax.sharding.reshard naming them) "
                   "while the operation above needs an annotation under them, annotate that "
                   "operation too; or drop the annotations that need Explicit axes.")
    raise error from auto_error


@contextlib.contextmanager
def refusals(mesh: Any, name: str) -> Iterator[None]:
    """Where a step's own code is traced with Explicit axes: its error becomes `ExplicitRefused`
    when `decided` may trace the program again Auto (JAX's type refusal, `is_type_refusal`, or any
    other: only the Auto trace tells a library's own type check from a bug); otherwise JAX's refusal
    gets a note saying what jaxdist knows and what to do."""
    try:
        yield
    except Exception as error:
        if not explicit_axes(mesh):
            raise
        typed = is_type_refusal(error)
        if refused(error):
            raise ExplicitRefused(error, typed) from error
        if not typed:
            raise
        forced = program_axis_types() is AxisType.Explicit
        error.add_note(
            f"jaxdist: {name} runs with the mesh's axes {explicit_axes(mesh)} Explicit"
            + (" (axis_types=AxisType.Explicit)" if forced else "")
            + ": a value's layout over them is part of its type, so code that does not annotate "
              "layouts is refused, as under plain jax.jit on that mesh. Annotate the operation "
              "(out_sharding=, jax.sharding.reshard), or let the program run with them Auto: "
              "strategy.jit(..., axis_types=None) decides per program, "
              "axis_types=jax.sharding.AxisType.Auto forces it.")
        raise


@contextlib.contextmanager
def auto_region(mesh: Any) -> Iterator[None]:
    """The inside of a program whose Explicit axes run Auto: ``mesh``'s Auto twin is the abstract
    mesh. Its arguments enter through `retyped`; its results leave by `jax.sharding.reshard` to
    their layouts outside the region (or `leave_auto`)."""
    with jax.sharding.use_abstract_mesh(_auto_twin(mesh.abstract_mesh if isinstance(mesh, Mesh)
                                                   else mesh)):
        yield


def shape_scope(mesh: Any) -> contextlib.AbstractContextManager[Any]:
    """Where only shapes are evaluated (``jax.eval_shape`` of a user's model or loss outside any
    program, e.g. inside ``strategy.scope()``): ``mesh`` is JAX's abstract mesh, as in a
    ``strategy.jit`` trace (so a model's ``jax.lax.with_sharding_constraint(x, PartitionSpec(...))``
    names its axes), with its Explicit axes Auto (a shape never depends on axis types, and
    unannotated code is refused by them). Arrays entering it pass through `untyped`. The mesh must
    be of the context mesh's size, if one is set (`LayoutPolicy.shape_scope` sets it)."""
    if _explicit(mesh):
        return auto_region(mesh)
    return jax.sharding.use_abstract_mesh(mesh if isinstance(mesh, AbstractMesh)
                                          else mesh.abstract_mesh)


def untyped(tree: Any) -> Any:
    """``tree``'s arrays as `jax.ShapeDtypeStruct`s without a layout (for `shape_scope`)."""
    def strip(x: Any) -> Any:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(strip, tree)


def retyped(tree: Any) -> Any:
    """``tree``'s traced arrays typed on the current `auto_region`'s mesh: their layouts unchanged,
    their types no longer name the Explicit axes (called inside the region). The retyping is marked
    in the program (a named scope), which is how `ran_auto` reads the decision back from a trace."""
    def retype(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        return jax.sharding.reshard(x, PartitionSpec(*[None] * x.ndim))

    with jax.named_scope(_MARK):
        return jax.tree.map(retype, tree)


def ran_auto(jaxpr: Any) -> bool:
    """Whether the traced program ``jaxpr`` (a `jax.stages.Traced`'s) runs its Explicit axes Auto:
    its arguments were retyped at entry (`retyped`'s mark, at the program's top level)."""
    return any(_MARK in str(eqn.source_info.name_stack) for eqn in jaxpr.eqns)


def leave_auto(mesh: Any, tree: Any) -> Any:
    """Results of an `auto_region` that no layout retyped: typed Explicit again, whole (called
    outside it)."""
    twin = _auto_twin(mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh)

    def retype(x: Any) -> Any:
        if isinstance(x, jax.Array) and jax.typeof(x).sharding.mesh == twin:
            return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
        return x

    return jax.tree.map(retype, tree)


def initializer(mesh: Any, name: str, call: Callable[[Any], Any], dyn: Any) -> tuple[Any, bool]:
    """``call(dyn)`` (a variable initializer over its array leaves), traced with the axis types its
    program runs with (inside `decided`): on Explicit axes it does not type-check with (Flax's
    logical constraints on activations, say), Auto, as a step. Its output, and whether it ran Auto
    (then the caller's outputs leave the region: `leave_auto` or a reshard to their layouts)."""
    auto = runs_auto(mesh)
    with auto_region(mesh) if auto else contextlib.nullcontext():
        if auto:
            dyn = retyped(dyn)
        with refusals(mesh, name):
            return call(dyn), auto


def runs_auto(mesh: Any) -> bool:
    """Whether the program being traced on ``mesh`` runs its Explicit axes Auto (`decided` chose
    so, or ``axis_types=Auto`` was given)."""
    return program_axis_types() is AxisType.Auto and bool(explicit_axes(mesh))
