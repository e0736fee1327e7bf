"""matrix.html in a real browser: headless Chromium renders it, its screenshot is a real image, the
hover text of a cell is in the DOM the browser built, and the adapter column and the header row
stay in place when the page is scrolled (issue 35, item 2).

Marked ``browser``; it needs Chromium on PATH (``chromium``, ``chromium-browser`` or
``google-chrome``) and fails, never skips, without it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest

from mhaspec.conformance import matrix

pytestmark = pytest.mark.browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WINDOW = (1400, 900)


def _chromium() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(f"no Chromium on PATH (looked for {', '.join(BROWSERS)}): the browser tests need it; "
                "install it with `apt-get install chromium` (Debian/Ubuntu) and run them again", pytrace=False)


def _browse(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [_chromium(), "--headless", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
               *(["--no-sandbox"] if os.geteuid() == 0 else []),  # Chromium's sandbox refuses root
               f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


class _Elements(HTMLParser):
    """Every element's (tag, attributes) in a page, entities decoded."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))


def _elements(page: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Elements()
    parser.feed(page)
    return parser.found


def _colours(png: bytes) -> set[tuple[int, ...]]:
    """The distinct pixel colours of an 8-bit RGB or RGBA PNG (what Chromium writes), decoded here
    so that the test needs nothing beyond the standard library."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n"), "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(png):
        (length,), kind = struct.unpack(">I", png[pos:pos + 4]), png[pos + 4:pos + 8]
        body = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None, "no IHDR"
    width, height, depth, colour_type, _, _, interlace = header
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, f"PNG layout not decoded here: {header}"
    bpp = 3 if colour_type == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(idat)
    assert len(raw) == height * (stride + 1), "truncated PNG"
    previous = bytearray(stride)
    colours: set[tuple[int, ...]] = set()
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 1:  # Sub
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif kind == 2:  # Up
            line = bytearray((a + b) & 0xFF for a, b in zip(line, previous))
        elif kind == 3:  # Average
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + previous[i]) >> 1)) & 0xFF
        elif kind == 4:  # Paeth
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = previous[i], previous[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        else:
            assert kind == 0, f"PNG filter {kind}"
        colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp))
        previous = line
    return {tuple(c) for c in colours}


def _report(adapter: str, cases: int, tensorflow_onednn: bool) -> dict:
    """A report over ``cases`` cases × 4 dtypes: passes, one known deviation, and a failing case
    whose scores are inf and whose weights are NaN."""
    results = []
    for c in range(cases):
        for d, dtype in enumerate(("float64", "float32", "float16", "bfloat16")):
            if c == 0 and dtype == "float16":
                results.append({"case": f"case_{c:02d}", "dtype": dtype, "verdict": "fail",
                                "first_failing_stage": "scores", "worst_ratio": "inf",
                                "message": "1 NaN in the scores", "stages": [
                                    {"stage": "q_proj", "verdict": "pass", "worst_ratio": 0.3},
                                    {"stage": "scores", "verdict": "fail", "worst_ratio": "inf"},
                                    {"stage": "attn_weights", "verdict": "fail", "worst_ratio": "nan"}]})
            elif c == 1 and dtype == "bfloat16":
                results.append({"case": f"case_{c:02d}", "dtype": dtype, "verdict": "known deviation",
                                "worst_ratio": 0.5, "stages": [
                                    {"stage": "attn_weights", "verdict": "known deviation", "worst_ratio": 4.0,
                                     "reason": "uniform rows, upstream #1"}]})
            else:
                ratio = 10.0 ** (-3 + (c + d) % 4)
                results.append({"case": f"case_{c:02d}", "dtype": dtype, "verdict": "pass" if ratio <= 1 else "fail",
                                "first_failing_stage": None if ratio <= 1 else "output", "worst_ratio": ratio,
                                "stages": [{"stage": "output", "verdict": "pass" if ratio <= 1 else "fail",
                                            "worst_ratio": ratio}]})
    return {"adapter": {"name": adapter, "framework": "numpy"},
            "environment": {"machine": "x86_64", "cpu": {"model": "AMD EPYC", "flags": ["avx", "avx2", "fma"]},
                            "onednn": {"tensorflow": tensorflow_onednn}},
            "results": results}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """matrix.html of 28 cases × 4 dtypes (112 columns) and 24 rows: 12 adapters, each run with
    oneDNN off and on (as in .tox/reports and .tox/reports-onednn)."""
    root = tmp_path_factory.mktemp("browser")
    for folder, onednn in (("reports", False), ("reports-onednn", True)):
        (root / folder).mkdir()
        for a in range(12):
            (root / folder / f"wide-{a:02d}.json").write_text(json.dumps(_report(f"wide-{a:02d}", 28, onednn)))
    m = matrix.build([root / "reports-onednn", root / "reports"])
    (root / "out").mkdir()
    (root / "out" / "matrix.html").write_text(matrix.to_html(m), encoding="utf-8")  # what write() writes
    return root, m


def test_the_page_renders_a_real_image_and_the_hover_text_is_in_the_dom(page, tmp_path):
    root, m = page
    html_file = root / "out" / "matrix.html"
    shot = tmp_path / "shot.png"
    _browse(tmp_path, f"--screenshot={shot}", html_file.as_uri())
    png = shot.read_bytes()
    colours = _colours(png)
    assert len(png) > 10_000 and len(colours) > 1, f"a blank screenshot ({len(png)} bytes, colours {colours})"
    assert len(colours) >= 8, f"hardly a matrix: {len(colours)} colours"  # the verdicts, the text, the legend

    dom = _browse(tmp_path, "--dump-dom", html_file.as_uri()).stdout
    titles = {attrs.get("title") for tag, attrs in _elements(dom) if tag == "td"}
    expected = ("wide-03 · oneDNN on · case_00 / float16: fail\nworst ratio (error/tolerance): NaN\n"
                "first failing stage: scores\nreason: 1 NaN in the scores")
    assert expected == matrix.hover_text(m, "wide-03 · oneDNN on", "case_00", "float16")
    assert expected in titles
    assert "wide-03 · oneDNN off · case_01 / bfloat16: known deviation\nworst ratio (error/tolerance): 0.5\n" \
           "attn_weights: known deviation: uniform rows, upstream #1" in titles
    heads = [attrs for tag, attrs in _elements(dom) if tag == "th" and attrs.get("class") == "ad"]
    assert len(heads) == 2 * 24  # the matrix and the heat map: every report a row, none merged
    assert not any(t.endswith(": not run") for t in titles if t)  # every row ran every case × dtype


def test_the_adapter_column_and_the_header_row_stay_in_place_when_scrolled(page, tmp_path):
    """A copy of the page (the page itself has no script) scrolls right and down, then writes where
    the browser laid out the first row's adapter cell, the first header row and the first matrix cell."""
    root, _ = page
    text = (root / "out" / "matrix.html").read_text(encoding="utf-8")
    probe = """<script>
window.scrollTo(1500, 900);
const box = (q) => document.querySelector(q).getBoundingClientRect();
document.body.setAttribute("data-probe", JSON.stringify({
  x: window.scrollX, y: window.scrollY, ad: box("th.ad").left, head: box("table tr").top, cell: box("td").left}));
</script></body>"""
    copy = tmp_path / "scrolled.html"
    copy.write_text(text.replace("</body>", probe), encoding="utf-8")
    dom = _browse(tmp_path, "--dump-dom", copy.as_uri()).stdout
    found = [attrs["data-probe"] for tag, attrs in _elements(dom) if tag == "body" and "data-probe" in attrs]
    assert found, f"the probe did not run:\n{dom[:2000]}"
    at = json.loads(found[0])
    assert at["x"] > 500 and at["y"] > 300, f"the page did not scroll: {at}"
    assert at["cell"] < 0, f"the first matrix cell should have scrolled out of view: {at}"
    assert abs(at["ad"]) < 1, f"the adapter column scrolled away (left {at['ad']}): {at}"
    assert abs(at["head"]) < 1, f"the header row scrolled away (top {at['head']}): {at}"
