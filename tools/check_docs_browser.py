#!/usr/bin/env python
"""Open pages of the offline docs (`tools/build_docs.py`) in headless Chromium (Debian `chromium`) and check what a
reader would see: every embedded picture decoded by the browser (none broken), as many output pictures as the
notebook produced, every local link (as the browser resolves it) pointing to a file of the site, no error output,
LaTeX rendered as MathML with a size (no raw `$...$` left in the text), and for the pages given to `--shots` a
screenshot that is not blank.

    python tools/build_docs.py --out _site
    python tools/check_docs_browser.py _site                                  # every page of the site
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
  const b = document.body.dataset, main = document.querySelector('main') || document.body;
  const imgs = [...document.images].filter(i => i.src.startsWith('data:'));
  b.embedded = imgs.length;
  b.broken = imgs.filter(i => !i.complete || i.naturalWidth === 0).length;
  b.outputs = imgs.filter(i => i.classList.contains('output') && i.naturalWidth > 0).length;
  const maths = [...document.querySelectorAll('math')];
  b.maths = maths.length;
  b.mathsunsized = maths.filter(m => m.getBoundingClientRect().width === 0).length;
  const prose = [...main.querySelectorAll('p, li, td, th, h1, h2, h3, h4')].map(e => e.innerText).join('\\n');
  b.rawtex = (prose.match(/\\$[^$\\n]*\\\\[a-zA-Z]+[^$\\n]*\\$/g) || []).length;
  b.errors = main.querySelectorAll('.error').length + (main.innerText.includes('Traceback (most recent call last)') ? 1 : 0);
  b.links = [...document.querySelectorAll('a[href]')].map(a => a.href).filter(h => h.startsWith('file:'))
                 .map(h => encodeURIComponent(h.split('#')[0])).join(' ');
});</script>"""
COUNTS = ("embedded", "broken", "outputs", "maths", "mathsunsized", "rawtex", "errors")

def find_chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)

def _chromium(args: list[str], chromium: str, timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                              timeout=timeout)

def probe_dom(page: Path, chromium: str) -> dict:
    """What the browser made of `page`: counts of data-URI pictures (embedded, broken, output pictures decoded), of
    MathML formulas (and those without a size), of raw TeX left in the prose and of error outputs; and `links`, the
    local files the page's links point to as the browser resolved them."""
    probe = page.with_name(f".probe_{page.name}")   # the page plus the probe script, in a copy beside it (same links)
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>", 1))
    try: dom = _chromium(["--dump-dom", probe.resolve().as_uri()], chromium).stdout
    finally: probe.unlink(missing_ok=True)
    m = re.search(r"<body[^>]*>", dom)
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', m.group(0))) if m else {}
    if not set(COUNTS) <= set(attrs): raise RuntimeError(f"{page}: chromium returned no DOM probe (got {dom[:200]!r})")
    from urllib.parse import unquote, urlparse
    links = sorted({Path(unquote(urlparse(unquote(h)).path)) for h in attrs.get("links", "").split()})
    return {**{k: int(attrs[k]) for k in COUNTS}, "links": [str(l).replace(f".probe_{page.name}", page.name) for l in links]}

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

def check_page(site: Path, rel: str, shots: Path | None, chromium: str) -> tuple[list[str], dict]:
    "Problems seen in the browser for page `rel` of `site`, and what was measured; a screenshot only if `shots`."
    page = site/rel
    text = page.read_text()
    expected = int(re.search(r'name="cascade-nb-output-images" content="(\d+)"', text).group(1))
    has_tex = bool(re.search(r'<math\b', text))
    dom = probe_dom(page, chromium)
    missing = [l for l in dom.pop("links") if not Path(l).is_file()]
    info = {**dom, "expected_outputs": expected, "missing_links": missing}
    problems = []
    if dom["broken"]: problems.append(f"{rel}: {dom['broken']} embedded picture(s) failed to decode")
    if dom["outputs"] < expected: problems.append(f"{rel}: {dom['outputs']} output pictures rendered, {expected} expected")
    problems += [f"{rel}: broken link to {l}" for l in missing]
    if dom["errors"]: problems.append(f"{rel}: {dom['errors']} error output(s) on the page")
    if dom["rawtex"]: problems.append(f"{rel}: {dom['rawtex']} formula(s) left as raw TeX")
    if has_tex and (dom["maths"] == 0 or dom["mathsunsized"]):
        problems.append(f"{rel}: maths not rendered ({dom['maths']} formulas, {dom['mathsunsized']} without a size)")
    if shots is not None:
        png = screenshot(page, shots/(rel.replace("/", "__").removesuffix(".html") + ".png"), chromium)
        ink, colours = blankness(png)
        info.update(ink=round(ink, 3), colours=colours, screenshot=str(png))
        if ink < 0.02 or colours < 50: problems.append(f"{rel}: the screenshot looks blank (ink {ink:.3f}, {colours} colours)")
    return problems, info

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("site", help="folder built by tools/build_docs.py")
    ap.add_argument("pages", nargs="*", help="pages relative to the site (default: every page)")
    ap.add_argument("--shots", default=None, help="where screenshots go (default: SITE/_shots)")
    ap.add_argument("--shots-of", nargs="*", default=["index.html", "19_gdf.html", "tutorials/01_walkthrough.html"],
                    help="pages that also get a screenshot checked for blankness (default: index, GDF explorer, walkthrough)")
    a = ap.parse_args(argv)
    chromium = find_chromium()
    if chromium is None: sys.exit("check_docs_browser: chromium not found (apt-get install -y chromium)")
    site = Path(a.site)
    shots = Path(a.shots) if a.shots else site/"_shots"
    pages = a.pages or sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if not p.name.startswith("."))
    problems = []
    for rel in pages:
        p, info = check_page(site, rel, shots if rel in a.shots_of else None, chromium)
        print(f"{rel}: {info}")
        problems += p
    for p in problems: print(p, file=sys.stderr)
    return 1 if problems else 0

if __name__ == "__main__": sys.exit(main())
