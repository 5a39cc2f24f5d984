"""A generated report in a real browser (headless Chromium): no console errors, every figure
loaded with a size, the answer on the page; a screenshot is kept for a person to look at.

scripts/test.sh installs Chromium (Debian package ``chromium``) when it is missing; without it
this test skips and says why. ``MOEBENCH_SCREENSHOT_DIR=DIR`` copies the screenshot to DIR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from report_helpers import FIXTURES, fixture_store

from moebench.report.build import build_report

# Runs first in <head>: records every console error and every error event, including a resource
# (an image) that fails to load, which only the capturing phase sees.
PROBE_HEAD = """<script>
window.__errors = [];
const consoleError = console.error;
console.error = (...args) => { window.__errors.push(args.join(" ")); consoleError(...args); };
window.addEventListener("error", e => window.__errors.push(
  e.message || ("failed to load " + (e.target && (e.target.src || e.target.tagName)))), true);
</script>"""
# Runs after load: writes what the test asserts into the DOM, where --dump-dom shows it.
PROBE_END = """<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({alt: i.alt.slice(0, 60), complete: i.complete,
    width: i.naturalWidth, height: i.naturalHeight, shown: i.getBoundingClientRect().width}));
  // the points table's speedup header: where it lies in the 1400 px wide window
  const th = [...document.querySelectorAll("#points ~ div.scroll th")].find(h => h.textContent === "speedup");
  const box = th ? th.getBoundingClientRect() : null;
  const speedup = box && {left: box.left, right: box.right, width: window.innerWidth};
  // the whole points table fits the page: its box does not scroll sideways
  const scroll = th && th.closest("div.scroll");
  const table = scroll && {scrolled: scroll.scrollWidth, shown: scroll.clientWidth};
  const out = document.createElement("pre");
  out.id = "browser-check";
  out.textContent = JSON.stringify({errors: window.__errors, images,
    speedup, table,
    headline: !!document.querySelector(".headline ul.answer li"), height: document.body.scrollHeight});
  document.body.appendChild(out);
});
</script>"""


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _run(browser: str, profile: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: test machines and containers often run as root, where Chromium's sandbox refuses
    # to start; the page is our own file. A profile per call keeps parallel runs apart.
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def browser() -> str:
    path = _chromium()
    if path is None:
        pytest.skip("no chromium on PATH (scripts/test.sh installs the Debian package chromium)")
    try:
        probe = subprocess.run([path, "--headless", "--no-sandbox", "--version"], capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{path} cannot run: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"{path} cannot run: {probe.stderr.strip()[:200]}")
    return path


@pytest.mark.slow
def test_report_renders_in_chromium(browser, tmp_path):
    out = tmp_path / "report"
    html_path = build_report([FIXTURES / "smoke", fixture_store("expert-scaling")], out)
    page = html_path.read_text()
    probe = out / "report.probe.html"
    probe.write_text(page.replace("<head>", "<head>" + PROBE_HEAD, 1).replace("</body>", PROBE_END + "</body>", 1))

    dumped = _run(browser, tmp_path / "profile-dom", probe.as_uri(), "--window-size=1400,900", "--dump-dom")
    match = re.search(r'<pre id="browser-check">(.*?)</pre>', dumped.stdout, re.S)
    assert match, f"the probe did not run (exit {dumped.returncode}): {dumped.stderr[-2000:]}"
    check = json.loads(match.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    # The report runs no script of its own: any console line Chromium logs (it logs console.error at
    # INFO level, as ":CONSOLE:<line>]" or ":CONSOLE(<line>)]") comes from a problem.
    console = [line for line in dumped.stderr.splitlines() if re.search(r":CONSOLE[:(]", line)]
    assert check["errors"] == [] and console == []
    assert check["headline"]
    # the answer's column is on screen at 1400 px without scrolling the table sideways
    speedup = check["speedup"]
    assert speedup and speedup["width"] == 1400 and 0 <= speedup["left"] < speedup["right"] <= 1400, speedup
    assert check["table"] and check["table"]["scrolled"] <= check["table"]["shown"], check["table"]
    assert len(check["images"]) == page.count("<img ") > 0
    for image in check["images"]:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0 and image["shown"] > 0, image

    shot = tmp_path / "report.png"
    height = min(int(check["height"]) + 40, 30000)
    taken = _run(browser, tmp_path / "profile-shot", html_path.as_uri(), f"--screenshot={shot}",
                 f"--window-size=1400,{height}")
    assert shot.is_file() and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    if os.environ.get("MOEBENCH_SCREENSHOT_DIR"):
        keep = Path(os.environ["MOEBENCH_SCREENSHOT_DIR"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / "report.png")
