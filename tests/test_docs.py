"""The documentation: the site builds in strict mode, the reference lists every public name
(internals last) and shows every docstring example as code, and the code blocks of the README and of
every docs page run (a page's blocks in order, as a fresh script: the pages on 8 simulated CPU
devices one after another in one process, each in a namespace, directory and environment of its own
(tests/doc_pages.py), the others each in a fresh process)."""

import importlib
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import types

import pytest
from doc_pages import blocks

pytestmark = pytest.mark.slow  # a site build and the pages' code


ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUNNABLE = [p for p in PAGES if "```python" in p.read_text()]
# The packages whose __all__ the reference must cover; its pages group the names by use
# (docs/api/*.md).
PACKAGES = ["jaxdist", "jaxdist.costs", "jaxdist.strategies", "jaxdist.replicate",
            "jaxdist.gradients", "jaxdist.tpu",
            "jaxdist.training", "jaxdist.strategies.compat", "jaxdist.nn"]

# Pages that set up 8 simulated CPU devices share one process (one import of jaxdist, ~4 s, instead
# of one per page); the rest (a cluster, another device count, nothing set up) run in a process of
# their own.
SHARED = [p for p in RUNNABLE if 'jax.config.update("jax_num_cpu_devices", 8)' in p.read_text()]


@pytest.fixture(scope="session")
def shared_pages(tmp_path_factory):
    """What tests/doc_pages.py reports for each page of ``SHARED``: None (ran) or its traceback."""
    tmp = tmp_path_factory.mktemp("doc-pages")
    results = tmp / "results.json"
    runner = [sys.executable, str(ROOT / "tests" / "doc_pages.py"), str(results), *map(str, SHARED)]
    out = subprocess.run(runner, cwd=tmp, capture_output=True, text=True, timeout=840)
    ran = json.loads(results.read_text()) if results.exists() else {}
    died = (
        f"the process running the pages died (exit status {out.returncode}):\n{out.stderr[-3000:]}"
    )
    return {page: ran.get(str(page), died) for page in SHARED}


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, (
        f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    )
    return out


@pytest.mark.timeout(300)
def test_the_reference_documents_every_public_name(site):
    ids = set()
    for page in (site / "api").rglob("index.html"):
        ids |= set(re.findall(r'id="([^"]+)"', page.read_text()))
    sources = "".join(page.read_text() for page in (ROOT / "docs" / "api").glob("*.md"))
    missing = []
    for package in PACKAGES:
        for name in importlib.import_module(package).__all__:
            value = getattr(importlib.import_module(package), name)
            # a subpackage: the page that renders its docstring
            if isinstance(value, types.ModuleType):
                documented = f"::: {value.__name__}\n" in sources
            else:
                documented = any(i.endswith(f".{name}") for i in ids)
            if not documented:
                missing.append(f"{package}.{name}")
    assert not missing, (
        f"not in the API reference: {missing}; add '::: <package>.<name>' under the heading of its "
        "group in docs/api/<page>.md (user-facing names first, the rest under the page's last "
        "heading, Internals)"
    )


@pytest.mark.timeout(300)
def test_the_reference_lists_internals_last(site):
    for page in sorted((site / "api").rglob("index.html")):
        headings = re.findall(r'<h2 id="([^"]+)"', page.read_text())
        if "internals" in headings:
            assert headings[-1] == "internals", (
                f"{page.relative_to(site)}: Internals is not the last heading"
            )


@pytest.mark.timeout(300)
def test_the_reference_shows_every_example_as_code(site):
    spec = importlib.util.spec_from_file_location("check_doc_examples",
                                                  ROOT / "scripts" / "check_doc_examples.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    problems, prompts = check.check_site(site)
    assert not problems, "\n".join([check.FIX, *problems])
    assert prompts > 100  # the reference's examples are there at all


@pytest.mark.timeout(300)
def test_every_page_of_the_site_is_built(site):
    built = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        want = "index.html" if rel.name == "index" and rel.parent.as_posix() == "." else (
            f"{rel.parent.as_posix()}/index.html" if rel.name == "index"
            else f"{rel.as_posix()}/index.html"
        )
        assert want in built, (
            f"docs/{page.relative_to(ROOT / 'docs')} is not in the site (add it to mkdocs.yml nav)"
        )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", RUNNABLE, ids=[p.relative_to(ROOT).as_posix() for p in RUNNABLE])
def test_code_blocks_run(page, tmp_path, request):
    if page in SHARED:
        problem = request.getfixturevalue("shared_pages")[page]
        assert problem is None, f"{page.name}'s code blocks failed:\n{problem}"
        return
    code = "\n\n".join(blocks(page))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=540)
    assert result.returncode == 0, f"{page.name}'s code blocks failed:\n{result.stderr[-3000:]}"
