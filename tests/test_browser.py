"""The drift explorer and the reviewers' HTML in a real browser (headless Chromium).

The explorer: JupyterLab serves copies of the notebooks made as ``make lab`` makes them (``make lab-copies``;
``--allow-root`` as root), opens the explorer, runs all cells on its defaults (the committed ``cpu`` ledgers:
"runs as is"), waits for the ipywidgets controls and at once, while the first row may still be drawing, picks
another row, which is rebuilt (the server's cache of rebuilt rows is a temp folder): its figure must appear in the explorer, not blank (pixels read back), with its
suffixes and the equality line; then it flips the K/V switch, moves the layer slider and the position window and waits for a new figure after each
change. The two redraws that once left a blank figure, an arm-pair switch to ``live_replica vs live`` (and back) and a
K/V switch, are repeated 24 times each: every figure must change and be drawn (over 1% of its pixels not white), and
JupyterLab's Log Console must stay empty. Then it saves the notebook: the copy holds the outputs, the tracked ``notebooks/`` stay byte for byte.
The HTML: ``make paper``'s renderings of the committed executed notebooks and its index, read at 1,400 px:
no page wider than the window, all 80 Experiment 4 localization rows there, counts as integers, no raw dict,
no absolute path, and an index that opens with the headline and links its files and notebook 08.
Screenshots go to ``$KVREPLAY_SCREENSHOTS`` (default: the test's temp folder).

Needs Debian's ``chromium`` and ``chromium-driver``: skipped with a message when they are missing,
except under CI (``CI=true``), where a missing browser is a failure (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kvreplay.paths import ROOT

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _need_browser():
    if CHROMIUM and DRIVER:
        return
    msg = ("headless Chromium not found (needs Debian's `chromium` and `chromium-driver`: "
           "apt-get install -y chromium chromium-driver)")
    if IN_CI:
        pytest.fail(msg + "; CI must run the browser test")
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on the repository (token auth, app exposed for scripted commands); yields its URL."""
    _need_browser()
    tmp = tmp_path_factory.mktemp("lab")
    # the server serves copies of the notebooks, as `make lab` does (its root is the copies' folder, so nothing it
    # saves can reach the tracked notebooks/)
    subprocess.run(["make", "--no-print-directory", "-s", "lab-copies", f"LAB_DIR={tmp / 'root'}"], cwd=ROOT, check=True)
    settings = tmp / "settings" / "@jupyterlab" / "docmanager-extension"
    settings.mkdir(parents=True)
    (settings / "plugin.jupyterlab-settings").write_text('{"autosave": false}')
    port, token = _free_port(), "kvreplay-browser-test"
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "ws"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), KVREPLAY_EXPLORER_CACHE=str(tmp / "explorer-cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "lib"), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp / 'root'}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.news_url=", "--ServerApp.open_browser=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {(tmp / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.2)
    else:
        proc.terminate()
        raise RuntimeError("jupyter lab did not start in 120 s")
    yield url, token, tmp / "root"
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser(lab):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1500,1300"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    yield driver
    driver.quit()


SHOTS_ENV = "KVREPLAY_SCREENSHOTS"
"""Environment variable: a folder for the screenshots; unset, each run writes into its own temporary folder."""


@pytest.fixture(scope="module")
def shots() -> Path:
    """Where this run's screenshots go: ``$KVREPLAY_SCREENSHOTS``, else a new temp folder of this run alone (never a
    fixed path another checkout on the machine shares, nor pytest's temp folders, which other runs prune)."""
    folder = Path(os.environ[SHOTS_ENV]) if os.environ.get(SHOTS_ENV) else Path(tempfile.mkdtemp(prefix="kvreplay-browser-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


SHOTS: list[Path] = []
"""The current test's screenshot folder (set by the test), where :func:`_wait` saves one on a timeout."""


def _wait(driver, what, timeout, message):
    """Wait for ``what`` (asked every 0.1 s: the test waits about 55 times, mostly for a redraw of about a second);
    on a timeout save a screenshot and name any error the notebook shows."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(what, message=message)
    except TimeoutException:
        shot = (SHOTS[-1] if SHOTS else Path(tempfile.mkdtemp(prefix="kvreplay-browser-"))) / "failure.png"
        driver.save_screenshot(str(shot))
        errors = [e.text[-1500:] for e in driver.find_elements("css selector", "[data-mime-type='application/vnd.jupyter.stderr']")]
        raise AssertionError(f"{message} (screenshot {shot}); notebook errors: {errors[-3:]}") from None


# Both read the page in one script call: the explorer replaces its status line and figure while it redraws,
# so an element found in one WebDriver call may be gone (stale) by the next.
def _status(driver) -> str:
    return driver.execute_script(
        "const e = document.querySelector('.kvreplay-status'); return e ? e.textContent : '';")


def _figure_src(driver) -> str:
    return driver.execute_script(
        "const i = document.querySelector('.kvreplay-explorer img.kvreplay-figure');"
        " return i && i.offsetWidth && i.getAttribute('src') ? i.getAttribute('src').slice(-200) : '';")


def _figure_ink(driver) -> float:
    """The share of the explorer figure's pixels that are not white (-1 while no image is loaded): 0 is a blank figure."""
    return driver.execute_script("""
        const img = document.querySelector('.kvreplay-explorer img.kvreplay-figure');
        if (!img || !img.offsetWidth || !img.complete || !img.naturalWidth) return -1;
        const c = document.createElement('canvas');
        c.width = img.naturalWidth; c.height = img.naturalHeight;
        const g = c.getContext('2d'); g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, c.width, c.height).data;
        let ink = 0, n = 0;
        for (let i = 0; i < d.length; i += 40) { n++; if (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235) ink++; }
        return ink / n;""")


def _log_entries(driver) -> int:
    """Messages in JupyterLab's Log Console for the open notebook (output no cell owns: a figure a callback sent
    elsewhere), from its status-bar item, which renders nothing while there are none."""
    title = driver.execute_script(
        "const e = document.querySelector('.jp-LogConsoleStatusItem [title]'); return e ? e.getAttribute('title') : '';")
    import re

    found = re.search(r"(\d+) log entries", title or "")
    return int(found.group(1)) if found else 0


REDRAWS = 24
"""Times the test repeats each of the two redraws that once left a blank figure: an arm-pair switch to
``live_replica vs live`` (and back) and a K/V switch (48 redraws in all)."""


def test_explorer_widgets_render_and_redraw(lab, browser, shots, progress):
    import hashlib

    url, token, served = lab
    tracked = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (ROOT / "notebooks").glob("*.ipynb")}
    SHOTS.append(shots)
    d = browser
    d.get(f"{url}/lab/tree/08_drift_explorer.ipynb?token={token}")
    _wait(d, lambda d: d.execute_script("return !!(window.jupyterapp && document.querySelector('.jp-Notebook'))"), 120,
          "JupyterLab did not open the notebook")
    _wait(d, lambda d: d.execute_script(
        "const w = window.jupyterapp.shell.currentWidget; return !!(w && w.sessionContext && w.sessionContext.session"
        " && w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle')"), 180, "the kernel did not start")
    d.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    t0 = time.time()
    progress("browser: running all cells of the explorer")
    _wait(d, lambda d: d.find_elements("css selector", ".kvreplay-explorer .widget-dropdown select"), 600,
          "the explorer's widgets did not render")
    # at once, while the cell that drew the widgets may still be drawing the first row: pick another row (one whose
    # suffixes part), which is rebuilt; its figure must show in the explorer, not blank and not elsewhere
    rows = "document.querySelectorAll('.kvreplay-explorer .widget-dropdown select')[1]"
    _wait(d, lambda d: d.execute_script(f"const s = {rows}; return !!(s && s.options.length > 1);"), 120,
          "the row picker lists no rows")
    target = d.execute_script(f"""
        const sel = {rows};
        const others = [...sel.options].map((o, i) => [o, i]).filter(([o, i]) => i !== sel.selectedIndex);
        const [o, k] = others.find(([o, i]) => o.text.replace(/\u00a0/g, ' ').includes('diverges at token')) || others[0];
        sel.selectedIndex = k; sel.dispatchEvent(new Event('change', {{bubbles: true}}));
        return o.text.trim().split(/\\s/)[0];""")
    progress(f"browser: row changed to {target} right after Run All (a rebuild)")
    _wait(d, lambda d: "drawn in" in _status(d) and target in _status(d) and _figure_ink(d) > 0.01, 900,
          f"no figure of {target} after changing the row right after Run All")
    first = time.time() - t0
    progress(f"browser: figure of the changed row {first:.0f} s after Run All")
    text = d.execute_script("return document.querySelector('.kvreplay-explorer').textContent").replace("\xa0", " ")
    assert ("suffixes part at step" in text or "suffixes identical" in text) and "boundary logits" in text, text[-800:]
    assert "rebuilt on" in text and "in this session" in text, "the changed row does not say it was rebuilt here"
    explorer = d.find_element("css selector", ".kvreplay-explorer")
    d.execute_script("arguments[0].scrollIntoView()", explorer)
    d.save_screenshot(str(shots / "explorer_first_draw.png"))
    labels = " ".join(e.text for e in d.find_elements("css selector", ".kvreplay-explorer .widget-label"))
    for name in ("arm pair", "row", "layer", "KV head", "K / V", "positions"):
        assert name in labels, f"control {name!r} missing: {labels}"
    options = [o.text for o in d.find_elements("css selector", ".kvreplay-explorer .widget-dropdown select option")]
    assert any("diverges at token" in o or "same suffix" in o for o in options), options[:5]

    def change(action, label, timeout=120):
        before_src = _figure_src(d)
        t = time.time()
        action()
        # the status line may read the same after two redraws ("drawn in 1.05 s" twice): the figure must change
        _wait(d, lambda d: _figure_src(d) != before_src and "drawn in" in _status(d) and _figure_ink(d) > 0.01, timeout,
              f"no new figure after {label}")
        return time.time() - t

    value_button = next(b for b in d.find_elements("css selector", ".kvreplay-explorer .widget-toggle-buttons button")
                        if b.text.strip() == "value")
    kv_s = change(value_button.click, "the K/V switch")
    d.save_screenshot(str(shots / "explorer_values.png"))
    handle = d.find_elements("css selector", ".kvreplay-explorer .widget-slider .noUi-handle")[0]
    from selenium.webdriver.common.keys import Keys

    slider_s = change(lambda: (handle.click(), handle.send_keys(Keys.ARROW_RIGHT)), "moving the layer slider")
    d.save_screenshot(str(shots / "explorer_layer_slider.png"))
    window = d.find_elements("css selector", ".kvreplay-explorer .widget-slider .noUi-handle")[-1]  # the range's upper end
    window_s = change(lambda: (window.click(), window.send_keys(Keys.HOME)), "narrowing the position window")
    d.save_screenshot(str(shots / "explorer_window.png"))
    # the two redraws that once left a blank figure (or sent it to the Log Console), each repeated: every figure must
    # be new and drawn (more than 1% of its pixels not white), and nothing may reach the Log Console
    pairs = "document.querySelectorAll('.kvreplay-explorer .widget-dropdown select')[0]"

    def pick_pair(text):
        return lambda: d.execute_script(f"""
            const sel = {pairs};
            const k = [...sel.options].findIndex(o => o.text.replace(/\u00a0/g, ' ') === {text!r});
            if (k < 0) throw new Error('no arm pair ' + {text!r});
            sel.selectedIndex = k; sel.dispatchEvent(new Event('change', {{bubbles: true}}));""")

    progress(f"browser: {REDRAWS} arm-pair switches (live_replica vs live and back), {REDRAWS} K/V switches")
    # the first switch rebuilds the row for its replica pair (the model is loaded; minutes on busy cores)
    pair_s = []
    for i in range(REDRAWS):
        pair = "exp1 bfloat16: live_replica vs live" if i % 2 == 0 else "exp1 bfloat16: prefill vs live"
        pair_s.append(change(pick_pair(pair), f"arm-pair switch {i + 1} (to {pair})", 900 if i == 0 else 120))
        if i % 8 == 7:
            progress(f"browser: {i + 1} arm-pair switches, each a new non-blank figure")
    for i in range(REDRAWS):  # each time to the kind not shown (the selected toggle button is marked mod-active)
        button = next(b for b in d.find_elements("css selector", ".kvreplay-explorer .widget-toggle-buttons button")
                      if "mod-active" not in (b.get_attribute("class") or ""))
        change(button.click, f"K/V switch {i + 1} (to {button.text.strip()}s)")
        if i % 8 == 7:
            progress(f"browser: {i + 1} K/V switches, each a new non-blank figure")
    assert _log_entries(d) == 0, "a figure or message went to JupyterLab's Log Console"
    d.save_screenshot(str(shots / "explorer_after_redraws.png"))
    status = _status(d)
    (shots / "timings.txt").write_text(
        f"first draw {first:.1f} s; K/V switch {kv_s:.2f} s; layer slider {slider_s:.2f} s; window {window_s:.2f} s "
        f"(browser round trip); arm-pair switches: first {pair_s[0]:.1f} s (a rebuild), median "
        f"{sorted(pair_s)[len(pair_s) // 2]:.2f} s; kernel status: {status}\n")
    print(f"first draw {first:.1f} s; K/V switch {kv_s:.2f} s; slider {slider_s:.2f} s; window {window_s:.2f} s; {status}")
    # a save writes the outputs into the served copy, never into the tracked notebooks
    d.execute_script("window.jupyterapp.commands.execute('docmanager:save')")
    _wait(d, lambda d: '"image/png"' in (served / "08_drift_explorer.ipynb").read_text(), 60, "the save did not reach the copy")
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert after == tracked, "a tracked notebook changed"


# ----------------------------------------------------------------------------- what a reviewer reads


@pytest.fixture(scope="module")
def reviewer_pages(tmp_path_factory):
    """make paper's HTML of the committed cpu copies (04, 06, 07, 08) and its index, written to a temp build folder."""
    from kvreplay.paper import CHAIN, artifact_index, render_html, write_index
    from kvreplay.paths import EXECUTED, FIGURES

    _need_browser()
    out = tmp_path_factory.mktemp("build") / "cpu"
    out.mkdir()
    for name in CHAIN:
        if name[:2] in ("04", "06", "07", "08"):
            (out / f"{Path(name).stem}.html").write_text(render_html(EXECUTED / "cpu" / name), encoding="utf-8")
    write_index(artifact_index(EXECUTED / "cpu", CHAIN), "cpu", tmp_path_factory.mktemp("md"), out, figures=FIGURES / "cpu")
    return out


def _page(driver, path: Path) -> dict:
    """Load a page at 1,400 px and read what the checks need in one script call."""
    driver.set_window_size(1400, 1000)
    driver.get(path.as_uri())
    return driver.execute_script("""
        const tables = [...document.querySelectorAll('table')].map(t => ({
            rows: t.querySelectorAll('tbody tr').length,
            head: [...t.querySelectorAll('thead tr:last-child th, thead tr:first-child th')].map(th => th.innerText.trim()),
            body: [...t.querySelectorAll('tbody tr')].map(r => [...r.children].map(c => c.innerText.trim()))}));
        return {width: document.documentElement.scrollWidth, window: window.innerWidth, tables: tables,
                text: document.body.innerText, html: document.documentElement.outerHTML,
                links: [...document.querySelectorAll('a')].map(a => a.getAttribute('href'))};""")


def test_reviewer_pages_fit_the_window_and_show_whole_tables(reviewer_pages, browser):
    import re

    from kvreplay.paths import ROOT as root

    for name in ("04_experiment4_cache_transplant", "06_tables", "07_figures", "08_drift_explorer"):
        page = _page(browser, reviewer_pages / f"{name}.html")
        assert page["width"] <= page["window"], f"{name}: the page is {page['width']} px wide at {page['window']} px"
        assert str(root) not in page["html"], f"{name}: an absolute path of this checkout"
        assert not re.search(r"\{'[^']+': ", page["text"]), f"{name}: a raw dict is printed"
        cut = [c for t in page["tables"] for r in t["body"] for c in r if c.endswith("...")]
        assert not cut, f"{name}: table cells cut by pandas: {cut[:3]}"
        if name.startswith("04"):
            localization = [t for t in page["tables"] if t["rows"] == 80]
            assert localization, f"04: no table with all 80 localization rows: {[t['rows'] for t in page['tables']]}"
        if name.startswith("07"):
            (near_tie,) = [t for t in page["tables"] if "shared steps" in t["head"]]
            column = near_tie["head"].index("shared steps")
            counts = [r[column] for r in near_tie["body"]]
            assert counts and all(re.fullmatch(r"\d+", c) for c in counts), f"07: step counts {counts}"


def test_the_index_opens_with_the_headline_and_links_its_files(reviewer_pages, browser):
    page = _page(browser, reviewer_pages / "index.html")
    first = page["text"].split("artifact")[0]
    assert "BF16 suffix differs: 5/16 (31.2%" in first and "paper: 166/200" in first
    assert "08_drift_explorer.html" in page["links"]
    files = [h for h in page["links"] if h and h.endswith((".csv", ".png", ".pdf", ".md", ".tex"))]
    assert files and all(not h.startswith("/") for h in files)
    assert all((reviewer_pages / h).resolve().is_file() for h in files), "a file link leads nowhere"


def test_reviewer_pages_draw_figures_at_full_width_and_wrap_whole_words(reviewer_pages, browser):
    """At 1,400 px every figure spans its output area, no table cell of a page or of the index may break inside a
    word (CSS `overflow-wrap: anywhere` or `word-break: break-all` did: "figur / e"), and every link says what it
    opens: a link to an HTML page reads `.html`, never `.ipynb`."""
    for name in ("04_experiment4_cache_transplant", "07_figures", "index"):
        browser.set_window_size(1400, 1000)
        browser.get((reviewer_pages / f"{name}.html").as_uri())
        got = browser.execute_script("""
            const imgs = [...document.querySelectorAll('.jp-OutputArea-output img')].map(i => ({
                shown: i.getBoundingClientRect().width,
                area: i.closest('.jp-OutputArea-output').getBoundingClientRect().width}));
            const cells = [...document.querySelectorAll('td, th')].map(c => getComputedStyle(c))
                .map(s => s.overflowWrap + ' ' + s.wordBreak);
            const links = [...document.querySelectorAll('a')].map(a => [a.getAttribute('href') || '', a.innerText]);
            return {imgs: imgs, cells: cells, links: links, window: window.innerWidth};""")
        if name == "07_figures":
            assert got["imgs"], "07: no figure"
        for img in got["imgs"]:
            assert img["shown"] >= 0.95 * img["area"] and img["shown"] > 0.6 * got["window"], (
                f"{name}: a figure {img['shown']:.0f} px wide in an output area of {img['area']:.0f} px")
        breaking = sorted({c for c in got["cells"] if "anywhere" in c or "break-all" in c})
        assert not breaking, f"{name}: table cells break inside words ({breaking})"
        for href, text in got["links"]:
            if href.split("#")[0].endswith(".html"):
                assert ".ipynb" not in text and ".html" in text, f"{name}: link to {href} reads {text!r}"
