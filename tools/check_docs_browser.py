#!/usr/bin/env python
"""Open pages of the offline docs (`tools/build_docs.py`) in headless Chromium (Debian `chromium`), take a screenshot
of each, and check what a reader would see: every embedded picture decoded by the browser (none broken), as many
output pictures as the notebook produced, and a screenshot that is not blank.

    python tools/build_docs.py nbs/19_gdf.ipynb tutorials/01_walkthrough.ipynb --out _site
    python tools/check_docs_browser.py _site 19_gdf.html tutorials/01_walkthrough.html --shots _site/_shots

Needs `chromium` (`apt-get install -y chromium`); nothing is fetched from the network (remote pictures such as the
Colab badge stay unloaded and are not counted).
"""
from __future__ import annotations
import argparse, re, shutil, subprocess, sys, tempfile
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--virtual-time-budget=5000")
# After the page has loaded, the browser writes what it decoded onto <body>; --dump-dom prints it.
PROBE = """<script>addEventListener('load', () => {
  const imgs = [...document.images].filter(i => i.src.startsWith('data:'));
  document.body.dataset.embedded = imgs.length;
  document.body.dataset.broken = imgs.filter(i => !i.complete || i.naturalWidth === 0).length;
  document.body.dataset.outputs = imgs.filter(i => i.classList.contains('output') && i.naturalWidth > 0).length;
});</script>"""

def find_chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)

def _chromium(args: list[str], chromium: str, timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                              timeout=timeout)

def probe_dom(page: Path, chromium: str) -> dict:
    "{'embedded', 'broken', 'outputs'} counts of data-URI pictures as the browser decoded them."
    with tempfile.TemporaryDirectory() as d:
        probe = Path(d)/"probe.html"      # the page plus the probe script, in a copy: the built page stays as it is
        probe.write_text(page.read_text().replace("</body>", PROBE + "</body>", 1))
        dom = _chromium(["--dump-dom", probe.as_uri()], chromium).stdout
    m = re.search(r"<body[^>]*>", dom)
    attrs = dict(re.findall(r'data-(\w+)="(\d+)"', m.group(0))) if m else {}
    if not {"embedded", "broken", "outputs"} <= set(attrs): raise RuntimeError(f"{page}: chromium returned no DOM probe (got {dom[:200]!r})")
    return {k: int(v) for k, v in attrs.items()}

def screenshot(page: Path, png: Path, chromium: str, size=(1280, 2400)) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    res = _chromium([f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", page.resolve().as_uri()], chromium)
    if not png.is_file(): raise RuntimeError(f"{page}: no screenshot written: {res.stderr[-1000:]}")
    return png

def blankness(png: Path) -> tuple[float, int]:
    "(fraction of pixels that are not near-white, number of distinct colours) of a screenshot."
    import numpy as np
    from PIL import Image
    px = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
    return float((px.min(axis=1) < 235).mean()), len(np.unique(px, axis=0))

def check_page(site: Path, rel: str, shots: Path, chromium: str) -> tuple[list[str], dict]:
    "Problems seen in the browser for page `rel` of `site`, and what was measured."
    page = site/rel
    expected = int(re.search(r'name="cascade-nb-output-images" content="(\d+)"', page.read_text()).group(1))
    dom = probe_dom(page, chromium)
    png = screenshot(page, shots/(rel.replace("/", "__").removesuffix(".html") + ".png"), chromium)
    ink, colours = blankness(png)
    info = {**dom, "expected_outputs": expected, "ink": round(ink, 3), "colours": colours, "screenshot": str(png)}
    problems = []
    if dom["broken"]: problems.append(f"{rel}: {dom['broken']} embedded picture(s) failed to decode")
    if dom["outputs"] < expected: problems.append(f"{rel}: {dom['outputs']} output pictures rendered, {expected} expected")
    if ink < 0.02 or colours < 50: problems.append(f"{rel}: the screenshot looks blank (ink {ink:.3f}, {colours} colours)")
    return problems, info

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("site", help="folder built by tools/build_docs.py")
    ap.add_argument("pages", nargs="*", default=["19_gdf.html", "tutorials/01_walkthrough.html"],
                    help="pages relative to the site (default: the GDF explorer and the walkthrough)")
    ap.add_argument("--shots", default=None, help="where screenshots go (default: SITE/_shots)")
    a = ap.parse_args(argv)
    chromium = find_chromium()
    if chromium is None: sys.exit("check_docs_browser: chromium not found (apt-get install -y chromium)")
    site = Path(a.site)
    shots = Path(a.shots) if a.shots else site/"_shots"
    problems = []
    for rel in a.pages:
        p, info = check_page(site, rel, shots, chromium)
        print(f"{rel}: {info}")
        problems += p
    for p in problems: print(p, file=sys.stderr)
    return 1 if problems else 0

if __name__ == "__main__": sys.exit(main())
