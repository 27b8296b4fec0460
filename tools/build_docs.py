#!/usr/bin/env python
"""Offline HTML documentation: take each notebook with its saved outputs (`tools/run_notebooks.py`) when they are
fresh, else run it the way `nbdev-test` does (cells flagged with the project's `tst_flags` skipped), then render it to a self-contained page in `_site/` with Debian's `pandoc`: outputs and
local pictures embedded as data URIs, LaTeX as MathML, a sidebar by folder (reference notebooks, tutorials,
explanations: the sections of `nbs/_quarto.yml`), links between notebooks rewritten to pages and links to other
repository files to GitHub. The published site (GitHub Pages) is `nbdev-docs` with quarto, which cannot be installed
offline; this build is what CI and the browser check (`tools/check_docs_browser.py`) look at.

    python tools/build_docs.py                                         # every notebook -> _site/
    python tools/build_docs.py nbs/19_gdf.ipynb tutorials/04_inference.ipynb --out /tmp/site
    python tools/build_docs.py --rerun nbs/19_gdf.ipynb                # execute even if the saved outputs are fresh
    python tools/build_docs.py --check _site                           # only check a built site

Needs `pandoc` (`apt-get install -y pandoc`). A notebook's saved outputs are used as they are when their fingerprint
matches its source (what `nbdev-docs` publishes); a stale or never-run notebook is executed for its page (with the
same cleaning of outputs as tools/run_notebooks.py), and the notebook file itself is never modified. Each page
records where its outputs came from in `<meta name="cascade-nb-executed">`: `stored`, `true` (run now) or `false`.
"""
from __future__ import annotations
import argparse, base64, html, json, mimetypes, os, re, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_notebooks                                   # noqa: E402  (tools/ is not a package)
REPO_URL = "https://github.com/cascade-nb/cascade_nb/blob/main"
SECTIONS = (("Reference", "nbs"), ("Tutorials", "tutorials"), ("Explanations", "nbs/explanations"))  # as nbs/_quarto.yml
IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_TEXT_LINES = 40    # longer text outputs (e.g. a whole tensor) are shortened in the middle

# ---------------------------------------------------------------- which notebooks, where their pages go
all_notebooks = run_notebooks.all_notebooks   # every documented notebook: nbs/ (with subfolders) and tutorials/

def page_path(src: Path, root: Path = ROOT) -> Path:
    "Site path of a notebook: nbs/x.ipynb -> x.html, nbs/explanations/x.ipynb -> explanations/x.html, tutorials/x -> tutorials/x.html."
    rel = src.resolve().relative_to(root)
    rel = rel.relative_to("nbs") if rel.parts[0] == "nbs" else rel
    return rel.with_suffix(".html")

def section_of(src: Path, root: Path = ROOT) -> str:
    rel = src.resolve().relative_to(root).parent.as_posix()
    return next((name for name, folder in reversed(SECTIONS) if rel == folder), "Reference")

# ---------------------------------------------------------------- run a notebook
def execute(src: Path, skip_flags: list[str] | None = None, cell_timeout: int = 600):
    "The notebook with fresh outputs, run from its own folder exactly as nbdev-test runs it; raises on a failing cell."
    return run_notebooks.execute(src, skip_flags, cell_timeout, ROOT)

def load_unexecuted(src: Path):
    "The notebook as nbdev processes it (directives kept), without running it."
    from nbdev.process import NBProcessor
    return NBProcessor(src, rm_directives=False, process=True).nb

# ---------------------------------------------------------------- notebook -> pandoc markdown
def _raw_html(s: str) -> str: return f"\n```{{=html}}\n{s}\n```\n"
def _fence(s: str, lang: str = "") -> str:
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", s)), default=0))
    return f"\n{ticks}{lang}\n{s.rstrip()}\n{ticks}\n"

def _text(v) -> str: return "".join(v) if isinstance(v, list) else str(v)

def output_markdown(out) -> tuple[str, int]:
    "(markdown, number of embedded images) for one cell output."
    kind = out.get("output_type")
    if kind == "stream":
        text = ANSI.sub("", _text(out.get("text", "")))
        text = re.sub(r"[^\n]*\r", "", text)                      # progress bars: keep what a terminal would show last
        return (_fence(text, "{.output .stream}") if text.strip() else ""), 0
    if kind == "error":
        return _fence(ANSI.sub("", "\n".join(out.get("traceback", []))), "{.output .error}"), 0
    data = out.get("data", {})
    for mime in IMAGE_MIMES:
        if mime in data:
            payload = _text(data[mime])
            if mime == "image/svg+xml": payload = base64.b64encode(payload.encode()).decode()
            payload = payload.replace("\n", "")
            return _raw_html(f'<img class="output" src="data:{mime};base64,{payload}" alt="cell output">'), 1
    if "text/html" in data: return _raw_html(f'<div class="output html">{_text(data["text/html"])}</div>'), 0
    if "text/markdown" in data: return "\n" + _text(data["text/markdown"]) + "\n", 0
    if "text/plain" in data:
        lines = ANSI.sub("", _text(data["text/plain"])).splitlines()
        if len(lines) > MAX_TEXT_LINES: lines = lines[:MAX_TEXT_LINES // 2] + ["…"] + lines[-MAX_TEXT_LINES // 4:]
        return _fence("\n".join(lines), "{.output}"), 0
    return "", 0

def _directive(cell, name) -> list[str] | None:
    d = getattr(cell, "directives_", None) or {}
    return d.get(name)

def _is_false(v) -> bool: return v is not None and (v == [] or str(v[0]).lower() == "false")

def strip_directives(src: str) -> str:
    return "\n".join(l for l in src.splitlines() if not l.lstrip().startswith("#|")).strip("\n")

def title_and_summary(nb) -> tuple[str, str]:
    "The notebook's H1 title and its `> summary` line (nbdev's convention)."
    for c in nb.cells:
        if c.cell_type != "markdown": continue
        m = re.search(r"^#\s+(.+)$", c.source, re.M)
        if m:
            s = re.search(r"^>\s*(.+)$", c.source, re.M)
            return m.group(1).strip(), (s.group(1).strip() if s else "")
    return "", ""

def notebook_markdown(nb) -> tuple[str, int]:
    "(pandoc markdown of the page body, number of output images), following nbdev's cell directives."
    parts, images, title_done = [], 0, False
    for c in nb.cells:
        if _directive(c, "hide") is not None or _is_false(_directive(c, "include")): continue
        if c.cell_type == "markdown":
            src = c.source
            if not title_done and re.search(r"^#\s+.+$", src, re.M):    # title and summary go in the page header
                src = re.sub(r"^#\s+.+$", "", src, count=1, flags=re.M)
                src = re.sub(r"^>\s*.+$", "", src, count=1, flags=re.M)
                title_done = True
            parts.append("\n" + src.strip() + "\n")
            continue
        if c.cell_type != "code": continue
        code = strip_directives(c.source)
        exported = any(_directive(c, k) is not None for k in ("export", "exporti"))
        if code and not _is_false(_directive(c, "echo")):
            if exported: parts.append(_raw_html('<details class="source"><summary>source</summary>') + _fence(code, "python") + _raw_html("</details>"))
            else: parts.append(_fence(code, "python"))
        if _is_false(_directive(c, "output")): continue
        for out in c.get("outputs", []):
            md, n = output_markdown(out)
            parts.append(md); images += n
    return "\n".join(parts), images

# ---------------------------------------------------------------- page chrome
CSS = """<style>
body{margin:0;font:16px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1f24;max-width:none;padding:0}
#sidebar{position:fixed;top:0;left:0;bottom:0;width:250px;overflow-y:auto;background:#f6f8fa;border-right:1px solid #d0d7de;padding:12px 14px;font-size:14px;box-sizing:border-box}
#sidebar h2{font-size:13px;text-transform:uppercase;letter-spacing:.05em;color:#57606a;margin:16px 0 4px}
#sidebar a{display:block;color:#0969da;text-decoration:none;padding:2px 0}#sidebar a.current{font-weight:700;color:#1b1f24}
main{margin-left:270px;padding:12px 32px 60px;max-width:1000px}
header#title-block-header h1{margin-bottom:4px}.subtitle{color:#57606a;font-size:18px;margin-top:0}
pre{background:#f6f8fa;padding:10px;overflow-x:auto;border-radius:6px;font-size:13px}
pre.output,div.output pre,.output pre{background:#fff;border-left:3px solid #d0d7de}
img{max-width:100%}img.output{display:block;margin:8px 0}
details.source>summary{cursor:pointer;color:#57606a;font-size:13px}
table{border-collapse:collapse;display:block;overflow-x:auto;font-size:14px}td,th{border:1px solid #d0d7de;padding:4px 8px}
</style>"""

def sidebar_html(pages: dict[Path, tuple[str, str]], current: Path) -> str:
    "Sidebar with one section per folder; `pages` maps site path -> (section, title); links relative to `current`."
    out = ['<nav id="sidebar">', f'<a href="{_rel(Path("index.html"), current)}"><b>cascade_nb</b></a>']
    for name, _ in SECTIONS:
        items = sorted((p, t) for p, (s, t) in pages.items() if s == name and p.name != "index.html")
        if not items: continue
        out.append(f"<h2>{name}</h2>")
        for p, t in items:
            cls = ' class="current"' if p == current else ""
            out.append(f'<a{cls} href="{_rel(p, current)}">{html.escape(t or p.stem)}</a>')
    return "\n".join(out + ["</nav>"])

def _rel(target: Path, current: Path) -> str: return Path(os.path.relpath(target, current.parent)).as_posix()

# ---------------------------------------------------------------- links and pictures
def _data_uri(path: Path) -> str:
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"

def fix_links(page: str, src: Path, current: Path, root: Path = ROOT) -> str:
    "Embed local pictures; notebook links -> pages; links to other repository files -> GitHub."
    def target(url):
        "The file `url` points to: relative to the notebook, else to the repository root (index.ipynb is also the README)."
        path, _, frag = url.partition("#")
        p = (src.parent/html.unescape(path)).resolve()
        return (p if p.exists() else (root/html.unescape(path)).resolve()), frag
    def img(m):
        url = m.group(2)
        if re.match(r"^(data:|https?:|//)", url): return m.group(0)
        p, _ = target(url)
        return f'{m.group(1)}{_data_uri(p) if p.is_file() else url}{m.group(3)}'
    def href(m):
        url = m.group(2)
        if re.match(r"^(#|[a-z][a-z0-9+.-]*:|//)", url): return m.group(0)
        p, frag = target(url)
        frag = f"#{frag}" if frag else ""
        try: rel = p.relative_to(root)
        except ValueError: return m.group(0)
        if p.suffix == ".ipynb" and p.is_file(): return f'{m.group(1)}{_rel(page_path(p, root), current)}{frag}{m.group(3)}'
        if p.exists(): return f'{m.group(1)}{REPO_URL}/{rel.as_posix()}{frag}{m.group(3)}'
        return m.group(0)                                          # left for the link check to report
    page = re.sub(r'(<img\b[^>]*?\bsrc=")([^"]+)(")', img, page)
    return re.sub(r'(<a\b[^>]*?\bhref=")([^"]+)(")', href, page)

# ---------------------------------------------------------------- one page, the whole site
def pandoc_html(markdown: str, title: str, summary: str, before_body: str, pandoc: str = "pandoc") -> str:
    if not shutil.which(pandoc): raise SystemExit("build_docs: pandoc not found (apt-get install -y pandoc)")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))/f"build_docs_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp/"head.html").write_text(CSS); (tmp/"before.html").write_text(before_body + "\n<main>")
    (tmp/"after.html").write_text("</main>")
    meta = ["--metadata", f"pagetitle={title or 'cascade_nb'} – cascade_nb"]
    header = {"title": title or "cascade_nb", **({"subtitle": summary} if summary else {})}   # markdown, unlike --metadata
    markdown = "---\n" + "".join(f"{k}: {json.dumps(v)}\n" for k, v in header.items()) + "---\n" + markdown
    res = subprocess.run([pandoc, "-f", "markdown-implicit_figures", "-t", "html5", "-s", "--mathml", *meta,
                          "-H", str(tmp/"head.html"), "-B", str(tmp/"before.html"), "-A", str(tmp/"after.html")],
                         input=markdown, capture_output=True, text=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if res.returncode: raise RuntimeError(f"pandoc failed ({res.returncode}): {res.stderr[-2000:]}")
    return res.stdout

def render_page(src: Path, nb, pages: dict, out_dir: Path, root: Path = ROOT, executed: bool | str = True) -> Path:
    "Write the page of notebook `src` (with outputs in `nb`) to `out_dir`; returns its path."
    current = page_path(src, root)
    body, n_images = notebook_markdown(nb)
    title, summary = title_and_summary(nb)
    page = pandoc_html(body, title, summary, sidebar_html(pages, current))
    page = page.replace("<head>", f'<head>\n<meta name="cascade-nb-source" content="{src.resolve().relative_to(root).as_posix()}">'
                                  f'\n<meta name="cascade-nb-output-images" content="{n_images}">'
                                  f'\n<meta name="cascade-nb-executed" content="{str(executed).lower()}">', 1)
    page = fix_links(page, src, current, root)
    dest = out_dir/current
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(page)
    return dest

def build(notebooks: list[Path], out_dir: Path, run: bool = True, root: Path = ROOT, log=print, rerun: bool = False) -> list[Path]:
    """Render `notebooks` into `out_dir` with their saved outputs when fresh, else after running them (`run`; `rerun`
    runs even fresh ones); returns their pages. Every other notebook gets a page from what its file holds (its saved
    outputs, fresh or not), so the sidebar and the links between pages always resolve."""
    sources = {p.resolve(): load_unexecuted(p) for p in all_notebooks(root)}
    pages = {page_path(p, root): (section_of(p, root), title_and_summary(nb)[0]) for p, nb in sources.items()}
    chosen = [Path(p).resolve() for p in notebooks]
    written = []
    for src in chosen:
        t0 = time.time()
        stored = sources.get(src) or load_unexecuted(src)
        if run and (rerun or not run_notebooks.is_fresh(src, root)): nb, how = execute(src), True
        else: nb, how = stored, ("stored" if run_notebooks.stored_fingerprint(stored) else False)
        written.append(render_page(src, nb, pages, out_dir, root, executed=how))
        log(f"{written[-1].relative_to(out_dir)}  ({'ran' if how is True else 'saved outputs' if how else 'no outputs'}, {time.time() - t0:.1f} s)")
    for src, nb in sources.items():
        if src not in chosen: render_page(src, nb, pages, out_dir, root, executed="stored" if run_notebooks.stored_fingerprint(nb) else False)
    return written

# ---------------------------------------------------------------- checks
def check_page(page: Path, site: Path) -> list[str]:
    "Problems of one built page: output images not embedded, local pictures or links that point nowhere."
    text, problems = page.read_text(), []
    srcs = re.findall(r'<img\b[^>]*?\bsrc="([^"]+)"', text)
    m = re.search(r'name="cascade-nb-output-images" content="(\d+)"', text)
    expected = int(m.group(1)) if m else 0
    if len(re.findall(r'<img class="output" src="data:image/', text)) < expected:
        problems.append(f"{page}: {expected} output images expected, fewer embedded")
    for s in srcs:
        if not re.match(r"^(data:image/[a-z+]+;base64,[A-Za-z0-9+/=]{16,}|https?://)", s):
            problems.append(f"{page}: picture not embedded: {s[:80]}")
    for h in re.findall(r'<a\b[^>]*?\bhref="([^"]+)"', text):
        if re.match(r"^(#|[a-z][a-z0-9+.-]*:|//)", h): continue
        if not (page.parent/html.unescape(h.partition("#")[0])).resolve().is_file():
            problems.append(f"{page}: broken link {h}")
    if "Traceback (most recent call last)" in text: problems.append(f"{page}: contains an error traceback")
    return problems

def check_site(site: Path, pages: list[Path] | None = None) -> list[str]:
    pages = sorted(Path(site).rglob("*.html")) if pages is None else pages
    return [p for page in pages for p in check_page(page, Path(site))]

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="notebooks to build (default: every notebook in nbs/ and tutorials/)")
    ap.add_argument("--out", default=str(ROOT/"_site"), help="output folder (default: _site/)")
    ap.add_argument("--no-run", action="store_true", help="don't execute: render what the notebooks store")
    ap.add_argument("--rerun", action="store_true", help="execute the notebooks even when their saved outputs are fresh")
    ap.add_argument("--check", metavar="SITE", help="only check an already built site")
    a = ap.parse_args(argv)
    if a.check:
        problems = check_site(Path(a.check))
    else:
        out = Path(a.out)
        nbs = [Path(p) for p in a.notebooks] or all_notebooks()
        written = build(nbs, out, run=not a.no_run, rerun=a.rerun)
        problems = check_site(out, written)
        print(f"built {len(written)} page(s) in {out}")
    for p in problems: print(p, file=sys.stderr)
    return 1 if problems else 0

if __name__ == "__main__": sys.exit(main())
