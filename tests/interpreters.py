"""The Pythons that the tests of process exit, signals and orbax's threads run their scripts under.

This interpreter, and the oldest Python the project accepts (3.12), in the environment
``./scripts/setup`` builds for it (``.venv312``, jaxdist's base dependencies) when it finds one:
CPython 3.12.0-3.12.2 refuse new threads once the interpreter shuts down, where later releases allow
them, so how a process ends is tested on both. Where there is no such environment (or this
interpreter is 3.12 already) its cases are skipped with the reason.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
OLDEST = ROOT / ".venv312" / "bin" / "python"


@functools.cache
def _version(python: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:3])"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tuple(map(int, out.stdout.split())) if out.returncode == 0 else None


def pythons() -> list:
    """``pytest.param``s of the interpreters to run a script under: this one (id ``this``) and the
    oldest accepted (id ``py312``; skipped with the reason where it is missing or this one is
    3.12)."""
    here = pytest.param(sys.executable, id="this")
    if sys.version_info[:2] == (3, 12):
        why = "this interpreter is Python 3.12 already"
    elif not OLDEST.exists():
        why = f"no Python 3.12 environment at {OLDEST}: ./scripts/setup builds it when it finds a Python 3.12"
    elif _version(str(OLDEST)) is None or _version(str(OLDEST))[:2] != (3, 12):
        why = f"{OLDEST} does not run as Python 3.12: run ./scripts/setup again"
    else:
        return [here, pytest.param(str(OLDEST), id="py312")]
    return [here, pytest.param(str(OLDEST), id="py312", marks=pytest.mark.skip(reason=why))]
