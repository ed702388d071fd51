"""The documentation: the site builds in strict mode, the reference lists every public name, and the code
blocks of the README and of every docs page run (a page's blocks in order, in one fresh process)."""

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUNNABLE = [p for p in PAGES if "```python" in p.read_text()]
# Each reference page and the packages whose __all__ it must cover.
REFERENCE = {
    "api/index.html": "jaxdist",
    "api/strategies/index.html": "jaxdist.strategies",
    "api/replicate/index.html": "jaxdist.replicate",
    "api/gradients/index.html": "jaxdist.gradients",
    "api/tpu/index.html": "jaxdist.tpu",
    "api/training/index.html": "jaxdist.training",
    "api/compat/index.html": "jaxdist.strategies.compat",
}


def _blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.mark.timeout(300)
def test_the_reference_documents_every_public_name(site):
    ids = set()
    for page in REFERENCE:
        ids |= set(re.findall(r'id="([^"]+)"', (site / page).read_text()))
    missing = [
        f"{package}.{name}"
        for package in REFERENCE.values()
        for name in importlib.import_module(package).__all__
        if not any(i.endswith(f".{name}") for i in ids)
    ]
    assert not missing, f"not in the API reference: {missing}"


@pytest.mark.timeout(300)
def test_every_page_of_the_site_is_built(site):
    built = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        want = "index.html" if rel.name == "index" and rel.parent.as_posix() == "." else (
            f"{rel.parent.as_posix()}/index.html" if rel.name == "index" else f"{rel.as_posix()}/index.html"
        )
        assert want in built, f"docs/{page.relative_to(ROOT / 'docs')} is not in the site (add it to mkdocs.yml nav)"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", RUNNABLE, ids=[p.relative_to(ROOT).as_posix() for p in RUNNABLE])
def test_code_blocks_run(page, tmp_path):
    code = "\n\n".join(_blocks(page))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, f"{page.name}'s code blocks failed:\n{result.stderr[-3000:]}"
