"""Runs the code blocks of several documentation pages in one process, each page as a fresh script.

``python tests/doc_pages.py RESULTS.json PAGE...``: each page's blocks run in order, as one
``__main__`` module of their own, in a directory of their own, with the environment, ``sys.argv``,
``sys.path``, the warning filters and JAX's configuration as they were before the first page. One
import of jaxdist (~4 s) serves every page, instead of one per page. A page that leaves something
behind that would change the next page's result (a strategy in scope, a JAX setting changed) fails,
so no page passes because of another. RESULTS.json maps each page to ``null`` (ran) or the end of
its traceback; a page that is missing from it was never reached.

Every page shares the process's JAX backend, so the pages run here are the ones that run on 8
simulated CPU devices without a cluster (tests/test_docs.py chooses them).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback
import types
import warnings

import jax

import jaxdist as jd


def blocks(page: pathlib.Path) -> list[str]:
    """The ``python`` code blocks of a Markdown page, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def run_page(page: pathlib.Path, workdir: pathlib.Path) -> str | None:
    """Runs ``page``'s blocks as a fresh ``__main__`` in ``workdir``; returns None or what went
    wrong."""
    code = compile("\n\n".join(blocks(page)), str(page), "exec")
    main = types.ModuleType("__main__")
    main.__file__ = str(workdir / "page.py")
    saved = dict(os.environ), list(sys.argv), list(sys.path), os.getcwd(), sys.modules["__main__"]
    config = dict(jax.config.values)
    sys.argv[:] = [main.__file__]
    sys.modules["__main__"] = main  # dataclasses (Flax modules) look their module up by name
    os.chdir(workdir)
    problem = None
    try:
        with warnings.catch_warnings():
            exec(code, main.__dict__)
        jax.effects_barrier()
    except BaseException:  # a page's SystemExit or KeyboardInterrupt is its failure too
        problem = traceback.format_exc()[-3000:]
    finally:
        environ, sys.argv[:], sys.path[:], cwd, sys.modules["__main__"] = saved
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
    changed = {k: (config.get(k), v) for k, v in jax.config.values.items() if config.get(k) != v}
    # back as they were for the next page (what can be set back)
    for name, (before, _) in changed.items():
        jax.config.update(name, before)
    if problem is None and changed:
        problem = f"the page changes JAX settings {changed} (before, after): run it in a process of its own"
    if problem is None and jd.has_strategy():
        problem = f"the page leaves {jd.get_strategy()!r} in scope: leave its `with strategy.scope():` block"
    return problem


def main(results: str, *pages: str) -> None:
    jax.config.update("jax_num_cpu_devices", 8)  # what every page sets first
    out: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="jaxdist-doc-pages-") as tmp:
        for i, page in enumerate(pages):
            workdir = pathlib.Path(tmp) / str(i)
            workdir.mkdir()
            start = time.perf_counter()
            out[page] = run_page(pathlib.Path(page), workdir)
            print(f"{page}: {'ok' if out[page] is None else 'FAILED'} in "
                  f"{time.perf_counter() - start:.1f}s",
                  flush=True)
            # what ran so far, should a page crash the process
            pathlib.Path(results).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
