"""The built site (``docs/``, README section "The site") opened in a real headless Chromium.

Every notebook page loads without a console error (Chromium's SEVERE log level: script errors and
failed loads), shows a figure for each ``plt.show()`` of its source as an image with a natural size, and
has every math element typeset by MathJax; the other pages load the same way. Two screenshots (a
notebook with a plot, an API page) go to ``docs/_build/screenshots/``, or to the folder named by
``ATTNREF_SITE_SCREENSHOTS`` (``notebooks/results`` refreshes the committed ones).

Skipped when the site is not built or Chromium, its driver or Selenium is missing, so a plain
``python -m pytest -q`` on a machine without them passes. ``ATTNREF_REQUIRE_SITE=1`` (``.ci/run``
sets it) turns each of those skips into a failure.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "docs" / "_build" / "html"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.py"))
OPS = sorted(p.stem for p in (ROOT / "golden").glob("*.py") if not p.stem.startswith("_"))
TABLE_PAGES = ["index", "papers", "tolerances", "benchmarks", "serving"]
REQUIRED = os.environ.get("ATTNREF_REQUIRE_SITE") == "1"
BUILD = "sphinx-build -W --keep-going -b html docs docs/_build/html"
# The screenshots: a notebook whose first figure sits high on the page, and its op's API page.
SHOT_NOTEBOOK, SHOT_API = "lse_merge", "lse_merge"


def _unavailable(why: str) -> None:
    if REQUIRED:
        pytest.fail(f"ATTNREF_REQUIRE_SITE=1 but {why}")
    pytest.skip(why)


def _browser_paths() -> tuple[str, str]:
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        _unavailable("no chromium or chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    return browser, driver


@pytest.fixture(scope="module")
def site_url() -> Iterator[str]:
    """The built site served over HTTP on the loopback address, as a reader's browser gets it."""
    if not (SITE / "index.html").is_file():
        _unavailable(f"no built site at {SITE.relative_to(ROOT)} (build it: {BUILD})")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser(site_url: str) -> Iterator[object]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (install the 'docs' extra)")
    binary, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--hide-scrollbars", "--force-device-scale-factor=1"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver, site_url: str, page: str) -> dict:
    """Load ``page`` (a path in the site, without ``.html``), wait for its images and for MathJax,
    and return what the checks need: console errors, images, math elements."""
    assert (SITE / f"{page}.html").is_file(), f"the site has no {page}.html"
    driver.get_log("browser")  # drop what an earlier page logged
    driver.get(f"{site_url}/{page}.html")
    state = driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const images = Array.from(document.images);
        const loaded = images.map(img => img.complete ? Promise.resolve() : new Promise(resolve => {
            img.addEventListener("load", resolve); img.addEventListener("error", resolve);
        }));
        const typeset = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
        Promise.all([...loaded, typeset]).then(() => {
            const math = Array.from(document.querySelectorAll(".math"));
            done({
                mathjax: Boolean(window.MathJax && MathJax.version),
                math: math.length,
                typeset: math.filter(el => el.querySelector("mjx-container")).length,
                containers: document.querySelectorAll("mjx-container").length,
                images: images.map(img => ({
                    src: img.getAttribute("src"), width: img.naturalWidth, height: img.naturalHeight,
                    output: Boolean(img.closest(".cell_output")),
                })),
                title: document.title,
            });
        });
        """
    )
    state["errors"] = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    return state


def _check_loaded(page: str, state: dict) -> None:
    assert not state["errors"], f"{page}: console errors: {json.dumps(state['errors'], indent=1)}"
    broken = [img["src"] for img in state["images"] if img["width"] == 0 or img["height"] == 0]
    assert not broken, f"{page}: images without a natural size (not loaded): {broken}"
    assert state["typeset"] == state["math"], (
        f"{page}: {state['math'] - state['typeset']} of {state['math']} math elements were not typeset by MathJax"
    )
    if state["math"]:
        assert state["mathjax"], f"{page}: math on the page but MathJax did not load"


def _figures_shown(stem: str) -> int:
    """``plt.show()`` calls in the notebook's source: each one puts a figure in the outputs."""
    source = (ROOT / "notebooks" / f"{stem}.py").read_text()
    return sum(line.strip().startswith("plt.show()") for line in source.splitlines())


def _screenshot_dir() -> Path:
    folder = Path(os.environ.get("ATTNREF_SITE_SCREENSHOTS") or ROOT / "docs" / "_build" / "screenshots")
    folder = folder if folder.is_absolute() else ROOT / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_notebook_page(stem: str, browser, site_url: str) -> None:
    page = f"notebooks/{stem}"
    state = _open(browser, site_url, page)
    _check_loaded(page, state)
    figures = [img for img in state["images"] if img["output"]]
    shown = _figures_shown(stem)
    assert len(figures) >= max(shown, 1), (
        f"{page}: the notebook shows {shown} figures, the page has {len(figures)} images in its cell outputs"
        " (figures are outputs only with the inline backend)"
    )
    if stem == SHOT_NOTEBOOK:
        browser.execute_script(  # the first figure at the bottom of the window, the code that drew it above
            "const box = document.querySelector('.cell_output img').getBoundingClientRect();"
            "window.scrollTo({top: window.scrollY + box.bottom - window.innerHeight + 24, behavior: 'instant'});"
        )
        browser.save_screenshot(str(_screenshot_dir() / f"site_notebook_{stem}.png"))


@pytest.mark.parametrize("op", OPS)
def test_api_page(op: str, browser, site_url: str) -> None:
    """One page per op documents the public functions of both modules, from their docstrings."""
    page = f"api/{op}"
    state = _open(browser, site_url, page)
    _check_loaded(page, state)
    documented = browser.execute_script(
        "return Array.from(document.querySelectorAll('dl.py.function > dt, dl.py.class > dt')).map(dt => dt.id);"
    )
    for module in ("triton_impl", "golden"):
        assert any(name.startswith(f"{module}.{op}.") for name in documented), (
            f"{page}: no function of {module}.{op} documented; found {documented}"
        )
    if op == SHOT_API:
        browser.execute_script("window.scrollTo({top: 0, behavior: 'instant'});")
        browser.save_screenshot(str(_screenshot_dir() / f"site_api_{op}.png"))


@pytest.mark.parametrize("page", TABLE_PAGES)
def test_table_page(page: str, browser, site_url: str) -> None:
    state = _open(browser, site_url, page)
    _check_loaded(page, state)
    if page == "index":
        assert state["containers"] > 0, "index: its formulas were not typeset (the math check would see nothing)"
    else:
        tables = browser.execute_script("return document.querySelectorAll('article table').length;")
        assert tables > 0, f"{page}: no table"
    if page == "benchmarks":
        plots = [img for img in state["images"] if img["src"].endswith("roofline_h200.png")]
        assert plots, "benchmarks: the roofline plot is missing"
