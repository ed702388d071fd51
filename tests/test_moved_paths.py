"""The flat module paths of ``jaxdist.training`` before its concept folders still import, with a DeprecationWarning
naming the new path, and give the same objects (`jaxdist.training._moved`)."""

import importlib
import logging
import subprocess
import sys
import warnings

import pytest

import jaxdist as jd
from jaxdist.training import _moved


def _fresh_import(name):
    """Import ``name`` as a first import would (the alias is cached in ``sys.modules`` after one)."""
    sys.modules.pop(name, None)
    try:
        return importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_imports_the_moved_module_with_a_warning(old):
    new = _moved.MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} moved: .*{new[0]}") as caught:
        module = _fresh_import(old)
    assert caught[0].filename == __file__  # the warning points at the import, not into importlib
    if len(new) == 1:
        assert module is importlib.import_module(new[0])
    for part in map(importlib.import_module, new):  # every object of the new module(s), the same
        for name in getattr(part, "__all__", ()):
            assert getattr(module, name) is getattr(part, name), (old, name)


def test_the_old_paths_give_the_public_objects():
    with pytest.warns(DeprecationWarning):
        checkpoint = _fresh_import("jaxdist.training.checkpoint")
    with pytest.warns(DeprecationWarning):
        non_finite = _fresh_import("jaxdist.training.non_finite")  # split in two: both halves
    assert checkpoint.Checkpointer is jd.training.Checkpointer
    assert non_finite.NonFiniteError is jd.training.NonFiniteError
    assert non_finite.NonFinitePolicy is jd.training.NonFinitePolicy
    assert non_finite.non_finite_leaves is jd.training.step.non_finite_leaves


def test_the_folders_and_unknown_paths_are_not_aliased():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DeprecationWarning for the folders
        for name in ("jaxdist.training.data", "jaxdist.training.loop", "jaxdist.training.callbacks"):
            assert importlib.import_module(name).__path__
    with pytest.raises(ModuleNotFoundError, match=r"jaxdist\.training\.no_such_module"):
        importlib.import_module("jaxdist.training.no_such_module")


def test_the_checkpoint_logger_keeps_its_name():
    from jaxdist.training.checkpoints import _checkpointer

    assert _checkpointer.LOG is logging.getLogger("jaxdist.training.checkpoint")


def test_an_old_path_imports_in_a_new_interpreter():
    """``import jaxdist.training.checkpoint`` as the first import of a program (the finder is installed by the
    parent package on the way)."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import jaxdist.training.watchdog\nexcept DeprecationWarning as w:\n    print(w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "jaxdist.training.watchdog moved" in out.stdout and "jaxdist.training.loop._watchdog" in out.stdout
