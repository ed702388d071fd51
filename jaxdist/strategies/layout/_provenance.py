"""Where a layout came from: jaxdist's own placements told from the user's by the sharding object.

On a mesh with ``Explicit`` axes a variable that jaxdist split by its own rule (FSDP) enters a step
typed whole (`jaxdist.strategies.compile._trace._resolve.typed_whole_at_entry`), so unannotated
single-device code type-checks; a variable the user placed keeps its layout as its type inside the
step, as under `jax.jit` (a `jax.shard_map` in the step infers its ``in_specs`` from it), even where
the two specs are equal. The difference is structural, never a comparison of specs:

* jaxdist lays variables out with canonical sharding objects (`own`: one object per layout), and an
  array placed with one carries that very object (`jax.device_put` keeps it; a `jax.jit` program
  given it as an out sharding returns it);
* a compiled step's outputs whose layout came from an own one (an argument jaxdist placed, the
  variable layout) are marked after the program's first call (`mark`;
  `jaxdist.strategies.compile._trace._provenance`): an executable returns the same sharding object
  at each output position on every call, so later outputs are recognised without work per call;
* everything else (the user's `jax.device_put`, an eager op's result, a restored array) is the
  user's, and so is the layout an nnx Variable's annotation declares (`declared`: Flax places such a
  Variable itself, and the step's output for it must read the same, or the program's cache key
  would change after the first step and the step compile twice).

Why an identity: JAX compares shardings by mesh, spec and memory kind, so jaxdist's FSDP layout and
the user's equal one are one value to it (and one program refuses arguments on two meshes). So the
step's cache key carries the provenance of the user's split layouts, read only on Explicit meshes
whose variables jaxdist splits, and a restored checkpoint marks what it restores (`mark`). A layout
misread as the user's costs nothing but its type (the step runs as under `jax.jit`).

Examples:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    >>> mine = own(NamedSharding(mesh, P("fsdp")))
    >>> is_own(jax.device_put(np.zeros(4), mine).sharding)
    True
    >>> is_own(jax.device_put(np.zeros(4), NamedSharding(mesh, P("fsdp"))).sharding)
    False
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from jax.sharding import NamedSharding

__all__ = ["declared", "is_own", "mark", "own"]

_CANONICAL: dict[NamedSharding, NamedSharding] = {}  # a layout -> jaxdist's one object for it
_DECLARED: dict[NamedSharding, NamedSharding] = {}  # a layout -> one object for it, not jaxdist's
_OWN: dict[int, NamedSharding] = {}  # id -> object: held, so an id is never reused by another
_LOCK = threading.Lock()


def own(sharding: Any) -> Any:
    """jaxdist's canonical object for ``sharding`` (a layout jaxdist decided): equal to it, and
    recognised by `is_own` wherever an array carries it. Anything not a `NamedSharding` is returned
    as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    canonical = _CANONICAL.get(sharding)
    if canonical is None:
        with _LOCK:
            canonical = _CANONICAL.setdefault(sharding, sharding)
            _OWN[id(canonical)] = canonical
    return canonical


def declared(sharding: Any) -> Any:
    """An object equal to ``sharding`` that is the user's (never `is_own`): the layout of a value
    whose annotation declared it. Anything not a `NamedSharding` is returned as it is.

    Examples:
        >>> import jax, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
        >>> layout = own(NamedSharding(mesh, P("model")))
        >>> declared(layout) == layout, is_own(declared(layout))
        (True, False)
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    found = _DECLARED.get(sharding)
    if found is None:
        with _LOCK:
            found = _DECLARED.setdefault(sharding, NamedSharding(sharding.mesh, sharding.spec,
                                                                 memory_kind=sharding.memory_kind))
    return found


def is_own(sharding: Any) -> bool:
    """Whether ``sharding`` (an array's, by identity) is a layout jaxdist placed (`own`, `mark`)."""
    return id(sharding) in _OWN


def mark(values: Iterable[Any], flags: Iterable[bool]) -> None:
    """Record the shardings of ``values`` (a program's outputs) that ``flags`` say are jaxdist's."""
    for value, flag in zip(values, flags, strict=True):
        sharding = getattr(value, "sharding", None)
        if flag and isinstance(sharding, NamedSharding) and id(sharding) not in _OWN:
            with _LOCK:
                _OWN[id(sharding)] = sharding
