"""The HTML report of a failing run as a browser shows it (headless Chromium, Debian `chromium`).

The run: the CPU kernel of data/dtype_adapters.py that rounds its state to bf16 every token,
on the one golden where that fails the final state worst (kda_decay_zero: o at about 4.9x its
bound, the final state at about 6.8x). Chromium parses report.html (--dump-dom): the verdict
heading reads FAIL and the summary names the failed test; the failure's table starts with the
failing tensor's row (final_state), the plot's title names the kernel, the case and that tensor.
Its screenshot (--screenshot) is no blank page: the verdict's red heading and the plot's markers
(matplotlib's first colour) are among its pixels, so the page and its image rendered.
Skipped where chromium is not installed (.ci/packages lists it).
"""
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xdist")
pytest.importorskip("matplotlib")  # the report's plots

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = f"{Path(__file__).with_name('data') / 'dtype_adapters.py'}:Bf16EveryToken"
TEST_ID = "dtype.bf16_every_token-kda_decay_zero-golden"
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install "
                                                         "chromium, listed in .ci/packages)")


class Dom(HTMLParser):
    """The elements of the page in document order: (tag, attributes, text of the element)."""

    def __init__(self):
        super().__init__()
        self.elements, self.open = [], []

    def handle_starttag(self, tag, attrs):
        element = [tag, dict(attrs), ""]
        self.elements.append(element)
        if tag not in ("img", "meta", "br", "link"):
            self.open.append(element)

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for element in self.open:
            element[2] += data


def chromium(*args, cwd):
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={cwd / 'profile'}", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    d = tmp_path_factory.mktemp("browser")
    run = subprocess.run([sys.executable, "-m", "k3ref.gpu_check", "run", "--no-builtin", "--adapter", ADAPTER,
                          "--goldens", str(ROOT / "goldens"), "--device", "cpu", "--no-warmup", "--checks", "golden",
                          "--cases", "kda_decay_zero", "--out", str(d / "r")],
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "python")), capture_output=True, text=True,
                         timeout=600, cwd=str(d))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    url = (d / "r" / "report.html").as_uri()
    dom = chromium("--dump-dom", url, cwd=d)
    assert dom.returncode == 0 and "<html" in dom.stdout, dom.stderr[-2000:]
    shot = chromium("--window-size=1400,1400", f"--screenshot={d / 'shot.png'}", url, cwd=d)
    assert shot.returncode == 0 and (d / "shot.png").is_file(), shot.stderr[-2000:]
    parsed = Dom()
    parsed.feed(dom.stdout)
    return parsed.elements, d / "shot.png"


def test_the_verdict_heading_and_summary_say_fail(page):
    elements, _ = page
    h1 = [e for e in elements if e[0] == "h1"]
    assert len(h1) == 1 and h1[0][2] == "FAIL" and h1[0][1].get("class") == "fail", h1
    summary = next(e[2] for e in elements if e[0] == "p")
    assert summary.startswith("1 tests: 0 passed, 1 failed, 0 skipped"), summary
    listed = [e[2] for e in elements if e[0] == "li"]
    assert len(listed) == 1 and listed[0].startswith(f"FAIL {TEST_ID}: o: rel RMS ") and "final_state: rel RMS" in listed[0]


def failure_section(elements):
    start = next(i for i, e in enumerate(elements) if e[0] == "h3" and e[1].get("id") == TEST_ID)
    end = next((i for i, e in enumerate(elements) if i > start and e[0] in ("h2", "h3")), len(elements))
    assert elements[start][2] == f"FAIL: {TEST_ID}"
    return elements[start:end]


def table_rows(section):
    """The cells' texts of each row of the section's first table."""
    table = next(i for i, e in enumerate(section) if e[0] == "table")
    rows = []
    for e in section[table + 1:]:
        if e[0] == "table":
            break
        if e[0] == "tr":
            rows.append([])
        elif e[0] in ("th", "td"):
            rows[-1].append(e[2])
    return rows


def test_the_failure_table_starts_with_the_failing_tensor(page):
    header, first, *rest = table_rows(failure_section(page[0]))
    assert header[:4] == ["tensor", "rel_rms", "floor_rel_rms", "floor_ratio"], header
    assert first[0] == "final_state" and len(first) == len(header), first
    assert float(first[3]) > 6, first  # floor_ratio: the final state's, the worst (6.8x)
    assert len(rest) == 1 and rest[0][0] == "o" and 1.5 < float(rest[0][3]) < float(first[3]), rest


def test_the_plot_is_titled_with_the_failing_tensor(page):
    images = [e for e in failure_section(page[0]) if e[0] == "img"]
    assert len(images) == 1, images
    assert images[0][1]["title"] == "dtype.bf16_every_token kda_decay_zero: final_state", images[0][1]
    assert images[0][1]["alt"] == "error of final_state"
    assert (page[1].parent / "r" / images[0][1]["src"]).is_file()


def test_the_screenshot_shows_the_verdict_and_the_plot(page):
    import numpy as np
    from matplotlib import image

    pixels = (image.imread(str(page[1]))[..., :3] * 255).round().astype(np.int64)
    assert pixels.shape[:2] == (1400, 1400), pixels.shape
    white = (pixels == 255).all(axis=-1)
    assert 0.01 < 1 - white.mean() < 0.5, 1 - white.mean()  # text and tables on a white page

    def near(colour, tolerance=40):
        return (np.abs(pixels - np.array(colour)).max(axis=-1) <= tolerance)

    red = near((0xaa, 0, 0))  # h1.fail, the verdict
    rows = np.nonzero(red.any(axis=1))[0]
    assert red.sum() > 100 and rows.min() < 100, (red.sum(), rows[:5])  # at the top of the page
    blue = near((0x1f, 0x77, 0xb4))  # matplotlib's first colour: the plot's markers
    assert blue.sum() > 20, blue.sum()
