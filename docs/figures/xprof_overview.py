"""Take docs/assets/xprof-overview.png: XProf's overview page of a ``fit(profile_steps=(5, 10))`` profile.

    python docs/figures/xprof_overview.py             # scripts/docs runs it: keeps the committed screenshot
    python docs/figures/xprof_overview.py --capture   # run the fit, serve it with XProf, retake the screenshot

``--capture`` trains a 3-layer MLP with ``MirroredStrategy`` on 8 simulated CPU devices for 12 steps, tracing
steps 5 to 9 into a temporary ``<log_dir>/profile``; starts XProf's own server on that folder (``python -m
xprof.server --logdir ... --port ...``), opens the run's overview page in headless Chromium driven by Playwright,
waits for the page's data, and saves what XProf drew. Nothing here is drawn by this script: the numbers on the
picture are XProf's, read from the trace's step markers.

Run by hand, not by the docs build or the tests: it needs three things the project does not depend on, and
says which is missing and exits 0 when one is:

- Chromium (Debian: ``apt-get install chromium``; or ``CHROMIUM=/path/to/chrome``),
- XProf (``pip install xprof``), in this interpreter or in the one beside an ``xprof`` on ``PATH``
  (or ``XPROF_PYTHON=/path/to/python``),
- Playwright's Python package (``pip install playwright``; it drives the Chromium above, it never downloads
  a browser), in either of those interpreters (or ``PLAYWRIGHT_PYTHON=/path/to/python``).

XProf draws the page's step-time graph with Google Charts, which the page loads from www.gstatic.com. On a
machine that reaches it the screenshot is the whole page, graph included; on one that does not (a sandbox
with no network), the graph's panel stays empty and the screenshot keeps the left part of the page: the
performance summary, the average step time and its parts.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "assets" / "xprof-overview.png"
WINDOW = (5, 10)
STEPS = 12
VIEWPORT = (1400, 1620)  # tall enough for the whole overview page (XProf scrolls it inside a panel)
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# --- what it needs ------------------------------------------------------------------------------------------


def _imports(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _pythons() -> list[str]:
    """The interpreters that may hold XProf or Playwright: this one, then the one beside ``xprof`` on PATH."""
    found = [sys.executable]
    xprof = shutil.which("xprof")
    if xprof:
        for name in ("python", "python3"):
            beside = pathlib.Path(xprof).parent / name
            if beside.exists():
                found.append(str(beside))
                break
    return found


def _find(env: str, module: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env] if _imports(os.environ[env], module) else None
    return next((py for py in _pythons() if _imports(py, module)), None)


def requirements() -> tuple[dict[str, str], list[str]]:
    """The Chromium, XProf and Playwright to use, and a line for each one missing."""
    found, missing = {}, []
    chromium = os.environ.get("CHROMIUM") or next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if chromium:
        found["chromium"] = chromium
    else:
        missing.append("Chromium (apt-get install chromium, or CHROMIUM=/path/to/chrome)")
    xprof = _find("XPROF_PYTHON", "xprof.server")
    if xprof:
        found["xprof"] = xprof
    else:
        missing.append("XProf (pip install xprof, or XPROF_PYTHON=/path/to/python)")
    playwright = _find("PLAYWRIGHT_PYTHON", "playwright.sync_api")
    if playwright:
        found["playwright"] = playwright
    else:
        missing.append("Playwright (pip install playwright, or PLAYWRIGHT_PYTHON=/path/to/python)")
    return found, missing


# --- the profile --------------------------------------------------------------------------------------------


def fit_and_trace(log_dir: pathlib.Path) -> pathlib.Path:
    """Runs the traced fit; returns the run's folder (``<log_dir>/profile/plugins/profile/<run>``)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT))
    import flax.linen as nn
    import numpy as np
    import optax

    import jaxdist as jd

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(256)(x))
            x = nn.relu(nn.Dense(256)(x))
            return nn.Dense(1)(x)

    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(256, 64)).astype(np.float32), rng.normal(size=256).astype(np.float32))
            for _ in range(STEPS)]
    trainer = jd.training.Trainer(jd.MirroredStrategy(), MLP(), optax.adam(1e-3),
                                  lambda out, y: ((out[:, 0] - y) ** 2).mean())
    trainer.fit(data, steps=STEPS, log_dir=str(log_dir), profile_steps=WINDOW, verbose=0)
    (run,) = (log_dir / "profile" / "plugins" / "profile").iterdir()
    return run


# --- XProf and the screenshot -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(python: str, logdir: pathlib.Path, log: pathlib.Path) -> tuple[subprocess.Popen, int]:
    """Starts XProf's server on ``logdir``; returns it and its port once it answers."""
    port = _free_port()
    server = subprocess.Popen(
        [python, "-m", "xprof.server", "--logdir", str(logdir), "--port", str(port),
         "--grpc_port", str(_free_port())],
        stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"xprof exited with status {server.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://localhost:{port}/", timeout=5):
                return server, port
        except OSError:
            time.sleep(1)
    server.terminate()
    raise RuntimeError(f"xprof did not answer on port {port} within 120 s:\n{log.read_text()[-2000:]}")


def shoot(url: str, out: str, chromium: str) -> None:
    """Opens ``url`` (an overview page) in headless Chromium and saves what it shows once its data is in."""
    from playwright.sync_api import TimeoutError as Timeout
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": VIEWPORT[0], "height": VIEWPORT[1]})
        page.goto(url)
        page.locator("performance-summary").get_by_text("Average Step Time").wait_for(timeout=120_000)
        page.locator("run-environment-view").get_by_text("Device type").wait_for(timeout=60_000)
        try:  # Google Charts draws the step-time graph as SVG, once it has loaded from gstatic
            page.locator("step-time-graph svg").first.wait_for(timeout=30_000)
            graph = True
        except Timeout:
            graph = False
        page.wait_for_timeout(2000)  # the last layout and fonts
        # down to the last of the step time's parts (the summary's percentages and the run environment below
        # it say nothing about steps), and the graph's bottom where there is one
        bottom = page.locator("performance-summary").get_by_text("Device Compute Time").first.bounding_box()
        bottom = bottom["y"] + bottom["height"] + 28
        if graph:
            box = page.locator("step-time-graph").bounding_box()
            bottom, right = max(bottom, box["y"] + box["height"]), VIEWPORT[0]
        else:
            box = page.locator("performance-summary").bounding_box()
            right = box["x"] + box["width"]
        page.screenshot(path=out, clip={"x": 0, "y": 0, "width": int(right), "height": int(bottom)})
        browser.close()
    print(f"{out}: " + ("the whole page, step-time graph included" if graph else
                        "no step-time graph (Google Charts did not load from www.gstatic.com): kept the "
                        "performance summary"))


def capture() -> None:
    found, missing = requirements()
    if missing:
        print("docs/figures/xprof_overview.py: skipped, missing " + "; ".join(missing))
        return
    with tempfile.TemporaryDirectory(prefix="jaxdist-xprof-") as tmp:
        tmp = pathlib.Path(tmp)
        run = fit_and_trace(tmp / "logs")
        host = next(run.glob("*.xplane.pb")).name.removesuffix(".xplane.pb")
        server, port = serve(found["xprof"], tmp / "logs" / "profile", tmp / "xprof.log")
        try:
            url = (f"http://localhost:{port}/data/plugin/profile/overview_page?run={run.name}"
                   f"&tag=overview_page&host={host}")
            print(f"XProf serves {url}")
            subprocess.run([found["playwright"], __file__, "--shoot", url, str(OUT), found["chromium"]],
                           check=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"{OUT.relative_to(ROOT)}: {OUT.stat().st_size // 1024} KB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--shoot"]:  # in the interpreter that has Playwright
        shoot(*sys.argv[2:5])
    elif sys.argv[1:] == ["--capture"]:
        capture()
    elif OUT.exists():
        pass  # the committed screenshot stays: retaking it needs a browser and XProf (--capture)
    else:
        print(f"docs/figures/xprof_overview.py: {OUT.relative_to(ROOT)} is missing; run it with --capture")
