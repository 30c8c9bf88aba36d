"""The built book in a real browser with no network: math typeset, images loaded, console clean.

A reader on a machine without network (a cluster node) opens `_build/html/index.html`. This
builds the book the way `make book` does, with the notebooks' stored outputs instead of executing
them, into a temporary folder, and opens the index and every page of toc.yml in headless Chromium
(Debian's `chromium` and `chromium-driver`, driven by selenium) whose every host name fails to
resolve and whose proxy is an unusable address: only file:// loads. On each page it asserts

* the math was typeset: MathJax (served from the build by sphinx-mathjax-offline) put an
  `mjx-container` on every `.math` element, none holds a TeX error (`mjx-merror`), and the text
  outside code blocks has no raw `\\(`, `\\[` or `$$` left;
* every `<img>` loaded (`naturalWidth > 0`);
* the browser console has no errors (a script or font the page could not load, a JavaScript
  exception), and every resource the page loaded came from file://.

`make setup` installs the browser with apt-get where it can (root, Debian); elsewhere the module is
skipped with the reason. The build takes about 10 s and the pages about 10 s on two cores.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# how many seconds a page may take to load, and MathJax to typeset it (the longest chapter
# takes about 2 s here; the margin is for a loaded CI machine)
PAGE_TIMEOUT_S = 60
MATHJAX_TIMEOUT_S = 30

# Chromium's and its driver's names on Debian (chromium, chromedriver) and elsewhere
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVERS = ("chromedriver",)


def _which(names: tuple[str, ...]) -> str | None:
    for name in names:
        if path := shutil.which(name):
            return path
    return None


def _missing() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    reasons = []
    try:
        import selenium  # noqa: F401
    except ImportError:
        reasons.append("selenium is not installed (pip install -e '.[test]')")
    if _which(BROWSERS) is None or _which(DRIVERS) is None:
        reasons.append("no Chromium and chromedriver on PATH (Debian: apt-get install chromium "
                       "chromium-driver; `make setup` does it when run as root)")
        log = Path(sys.prefix) / "browser-install.log"  # written by tools/install_browser.sh
        if log.exists() and (lines := log.read_text(errors="replace").strip().splitlines()):
            reasons.append(f"{log}: {lines[-1]}")
    try:
        import jupyter_book  # noqa: F401
    except ImportError:
        reasons.append("jupyter-book is not installed (pip install -e '.[book]')")
    return "; ".join(reasons) or None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=f"browser test: {_missing()}")


def _pages() -> list[str]:
    """index.html and every file of toc.yml, as paths relative to the HTML root."""
    toc = yaml.safe_load((ROOT / "toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for c in toc["chapters"]]
    return ["index.html"] + [f + ".html" for f in files]


@pytest.fixture(scope="module")
def html_root(tmp_path_factory) -> Path:
    """Build the book from the committed notebooks' stored outputs (no execution); return _build/html."""
    out = tmp_path_factory.mktemp("book")
    config = yaml.safe_load((ROOT / "book.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    # local extensions are found relative to the config file: point them at the repository
    local = config.get("sphinx", {}).get("local_extensions") or {}
    for name, path in local.items():
        local[name] = str((ROOT / path).resolve())
    (out / "book.yml").write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(ROOT),
         "--config", str(out / "book.yml"), "--toc", str(ROOT / "toc.yml"), "--path-output", str(out),
         "-W", "-n", "--keep-going"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, f"jupyter-book build failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    print(f"book built in {time.perf_counter() - start:.1f} s")
    html = out / "_build" / "html"
    assert (html / "index.html").exists()
    return html


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium that can load file:// only, with its console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _which(BROWSERS)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        # no network: every host name fails to resolve, and any proxied request goes to a port
        # where nothing listens
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=http://127.0.0.1:9",
        "--proxy-bypass-list=<-loopback>",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(_which(DRIVERS)), options=options)
    driver.set_page_load_timeout(PAGE_TIMEOUT_S)
    driver.set_script_timeout(PAGE_TIMEOUT_S)
    yield driver
    driver.quit()


def _errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# Resolves once MathJax has typeset the page ("typeset"), at once where the page has no math.
WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1];
const limit = Date.now() + arguments[0] * 1000;
if (!document.querySelector('.math')) { done('no math'); return; }
(function poll() {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done('typeset'), (e) => done('MathJax failed: ' + e));
  } else if (Date.now() > limit) {
    done('MathJax never started');
  } else {
    setTimeout(poll, 50);
  }
})();
"""

# What the reader sees, measured in the page.
INSPECT = """
const body = document.body.cloneNode(true);
body.querySelectorAll('pre, code, script, style, textarea, mjx-container').forEach((e) => e.remove());
const text = body.textContent;
return {
  math: document.querySelectorAll('.math').length,
  typeset: document.querySelectorAll('.math mjx-container').length,
  tex_errors: document.querySelectorAll('mjx-merror').length,
  raw_tex: ['\\\\(', '\\\\[', '$$'].filter((s) => text.includes(s)),
  images: document.images.length,
  broken_images: [...document.images].filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.src),
  not_file: performance.getEntriesByType('resource').map((r) => r.name).filter((u) => !u.startsWith('file:')),
};
"""


def test_the_browser_has_no_network(browser):
    """The premise of the page test: a URL on the network does not load."""
    browser.get("about:blank")
    result = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js', {mode: 'no-cors'})"
        "  .then(() => done('loaded'), (e) => done('failed: ' + e));")
    assert result.startswith("failed"), result
    _errors(browser)  # drop the failed fetch's message


@pytest.mark.parametrize("page", _pages())
def test_page_renders_offline(page, html_root, browser):
    _errors(browser)  # start from an empty log
    browser.get((html_root / page).as_uri())
    if page == "index.html":  # a redirect to the root page
        root = yaml.safe_load((ROOT / "toc.yml").read_text())["root"]
        limit = time.monotonic() + PAGE_TIMEOUT_S
        while time.monotonic() < limit and not (
                browser.current_url.endswith(f"/{root}.html")
                and browser.execute_script("return document.readyState") == "complete"):
            time.sleep(0.05)
        assert browser.current_url.endswith(f"/{root}.html"), browser.current_url
    status = browser.execute_async_script(WAIT_FOR_MATHJAX, MATHJAX_TIMEOUT_S)
    seen = browser.execute_script(INSPECT)
    errors = _errors(browser)

    problems = []
    if status not in ("typeset", "no math"):
        problems.append(status)
    if seen["typeset"] != seen["math"]:
        problems.append(f"{seen['typeset']} of {seen['math']} formulas typeset")
    if seen["tex_errors"]:
        problems.append(f"{seen['tex_errors']} formulas with TeX errors")
    if seen["raw_tex"]:
        problems.append(f"raw TeX delimiters {seen['raw_tex']} in the text")
    if seen["broken_images"]:
        problems.append(f"images not loaded: {seen['broken_images']}")
    if seen["not_file"]:
        problems.append(f"loaded from outside the build: {seen['not_file']}")
    if errors:
        problems.append("console errors:\n" + "\n".join(errors))
    assert not problems, f"{page}:\n" + "\n".join(problems)
