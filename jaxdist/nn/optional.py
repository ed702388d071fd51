"""Optional kernel libraries, imported once here when present: ``tokamax`` (the extra
``jaxdist[tokamax]``: openxla's Pallas kernels for GPUs and TPUs, never a dependency of jaxdist for
the packages it brings). Where it is not installed, or its own imports fail, ``tokamax`` is None and
the layers use jax's own kernels.

Examples:
    >>> tokamax is None or hasattr(tokamax, "ragged_dot")
    True
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["tokamax"]

tokamax: ModuleType | None
try:
    import tokamax
except ImportError:  # not installed, or a dependency of its own missing (xprof)
    tokamax = None
