"""The module paths ``jaxdist.training`` had before its concept folders, kept importable with a DeprecationWarning.

``import jaxdist.training.checkpoint`` (and the other flat paths of `MOVED`) imports the module the code moved to
and gives that module itself, so every object is the one the new path gives; the warning names the new path.
One import finder on ``sys.meta_path`` (`MovedFinder`, installed by ``jaxdist.training``) serves them all; it
answers only for the names in `MOVED`, after Python's own finders found nothing. ``jaxdist.training.data``,
``.loop`` and ``.callbacks`` are the folders now and need no alias. The checkpoint logger keeps its name,
``jaxdist.training.checkpoint`` (a logger's name is not a module path).

Examples:
    >>> import warnings, jaxdist as jd
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from jaxdist.training.checkpoint import Checkpointer
    >>> Checkpointer is jd.training.Checkpointer, caught[0].category.__name__
    (True, 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "MovedFinder", "install"]

_T = "jaxdist.training."

MOVED: dict[str, tuple[str, ...]] = {
    _T + old: tuple(_T + n for n in new) for old, new in {
        "feed": ("data._feed",),
        "input_state": ("data._input_state",),
        "step_functions": ("step._functions",),
        "compiled": ("step._compiled",),
        "running": ("step._running",),
        "weighted": ("step._weighted",),
        "build": ("step._build",),
        "models": ("step._models",),
        "non_finite": ("step._non_finite", "loop._non_finite"),  # split: the devices' part and the host's
        "checkpoint": ("checkpoints._checkpointer",),
        "checkpoint_damage": ("checkpoints._damage",),
        "checkpoint_claim": ("checkpoints._claim",),
        "checkpoint_storage": ("checkpoints._storage",),
        "foreign": ("checkpoints._foreign",),
        "load": ("checkpoints._load",),
        "compilation_cache": ("checkpoints._compilation_cache",),
        "preemption": ("loop._preemption",),
        "watchdog": ("loop._watchdog",),
        "job": ("loop._job",),
    }.items()
}
"""Each old module path -> the module(s) its code lives in now (two for a module that was split)."""

_SKIPPED = (importlib.machinery.__file__.rsplit("/", 1)[0] if importlib.machinery.__file__ else "<frozen",
            "<frozen importlib", __file__)


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and loads each as the module it moved to (a split one: a module holding
    the objects of both parts), with a DeprecationWarning naming the new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved: import {' and '.join(n.rsplit('._', 1)[0] for n in new)} (its public names) or "
            f"{' / '.join(new)}; the old path is deprecated and will be removed.",
            DeprecationWarning, stacklevel=2, skip_file_prefixes=_SKIPPED)
        modules = [importlib.import_module(n) for n in new]
        if len(modules) == 1:
            return modules[0]  # the module itself: the same objects, whatever is read from it
        joined = types.ModuleType(spec.name, f"Deprecated: the objects of {' and '.join(new)}.")
        for module in modules:
            joined.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        return joined

    def exec_module(self, module: types.ModuleType) -> None:
        return None  # already executed under its new name


def install() -> None:
    """Put one `MovedFinder` at the end of ``sys.meta_path`` (again: nothing to do)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
