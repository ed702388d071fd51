"""Optional kernel libraries, imported once here when present: ``tokamax`` (the extra
``jaxdist[tokamax]``).

tokamax (openxla's Pallas kernel library: grouped matmuls and flash attention for GPUs and TPUs) is
never a dependency of jaxdist: it brings pydantic, qwix, jaxtyping and xprof (which tokamax 0.0.17
imports at its top level). Where it is not installed, or its own imports fail, ``tokamax`` is None
and the layers use jax's own kernels.

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
