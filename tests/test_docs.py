"""The offline docs (tools/build_docs.py): a few key pages are rendered (from their saved outputs when fresh, else run)
the way the whole site is, and every page of the site must show its plots embedded, with no broken local links. With
Chromium installed (CI installs it), every page is opened in headless Chromium (tools/check_docs_browser.py):
pictures decoded, links resolved, no error output, maths rendered, and the key pages' screenshots not blank."""
import os, re, shutil
import pytest, yaml
from conftest import ROOT, tool

build_docs, browser = tool("build_docs"), tool("check_docs_browser")
REQUIRED = bool(os.environ.get("CASCADE_NB_REQUIRE_DOCS_TOOLS"))   # set by .ci/run: in CI these tests never skip

def _missing(what: str, install: str):
    msg = f"{what} not installed ({install})"
    if REQUIRED: pytest.fail(msg + ": CI requires it (CASCADE_NB_REQUIRE_DOCS_TOOLS)")
    pytest.skip(msg)
KEY_PAGES = ["nbs/19_gdf.ipynb", "tutorials/04_inference.ipynb", "nbs/index.ipynb"]   # the GDF explorer, a tutorial, the README

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not shutil.which("pandoc"): _missing("pandoc", "apt-get install -y pandoc")
    out = tmp_path_factory.mktemp("site")
    written = build_docs.build([ROOT/p for p in KEY_PAGES], out, log=lambda *_: None)
    return out, written

def test_every_notebook_has_a_page(site):
    out, _ = site
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    expected = {build_docs.page_path(p).as_posix() for p in build_docs.all_notebooks()}
    assert pages == expected
    assert {"index.html", "19_gdf.html", "tutorials/01_walkthrough.html"} <= pages

def test_key_pages_render_with_plots_embedded(site):
    out, written = site
    for page in written:
        text = page.read_text()
        assert re.search(r'name="cascade-nb-executed" content="(true|stored)"', text), page     # outputs, saved or fresh
        assert "<main>" in text and '<nav id="sidebar">' in text, page
        assert text.count('<img class="output" src="data:image/png;base64,') >= (1 if "index" not in page.name else 0), page
    gdf = (out/"19_gdf.html").read_text()
    assert gdf.count('<img class="output" src="data:image/png;base64,') >= 3          # the explorer and the toy run's plots
    assert "<math" in gdf                                                               # LaTeX as MathML
    assert 'src="data:image/png;base64,' in (out/"index.html").read_text()              # the demo grid, embedded

def test_no_broken_links_or_missing_pictures(site):
    out, _ = site
    assert build_docs.check_site(out) == []

def test_sidebar_sections_match_quarto_config():
    cfg = yaml.safe_load((ROOT/"nbs"/"_quarto.yml").read_text())
    sections = [c["section"] for c in cfg["website"]["sidebar"]["contents"] if isinstance(c, dict)]
    assert sections == [name for name, _ in build_docs.SECTIONS]

def test_fresh_saved_outputs_are_used_without_running(tmp_path, monkeypatch):
    "A notebook whose saved outputs are fresh is rendered from them; a stale one is run for its page."
    if not shutil.which("pandoc"): _missing("pandoc", "apt-get install -y pandoc")
    ran, nb = [], ROOT/"nbs/explanations/three_stages.ipynb"
    monkeypatch.setattr(build_docs, "execute", lambda src, *a, **k: ran.append(src) or build_docs.load_unexecuted(src))
    # a site of this one notebook: the other pages (rendered from what their files hold) play no part here, and the
    # `site` fixture above checks the whole site
    monkeypatch.setattr(build_docs, "all_notebooks", lambda root=ROOT: [nb])
    for fresh in (True, False):
        monkeypatch.setattr(build_docs.run_notebooks, "is_fresh", lambda p, root=ROOT: fresh)
        ran.clear()
        [page] = build_docs.build([nb], tmp_path, log=lambda *_: None)
        assert ran == ([] if fresh else [nb.resolve()])
        assert 'cascade-nb-executed" content="true"' in page.read_text() or fresh

@pytest.fixture
def chromium():
    return browser.find_chromium() or _missing("chromium", "apt-get install -y chromium: browser check skipped")

def test_every_page_in_headless_chromium(site, tmp_path, chromium):
    "Every page of the site as a browser shows it; the key pages also get a screenshot that must not be blank."
    out, _ = site
    problems = []
    for page in sorted(out.rglob("*.html")):
        rel = page.relative_to(out).as_posix()
        shots = tmp_path if rel in ("19_gdf.html", "tutorials/04_inference.html", "index.html") else None
        p, info = browser.check_page(out, rel, shots, chromium)
        problems += p
        if rel == "19_gdf.html": assert info["embedded"] >= 3 and info["maths"] >= 1 and info["rawtex"] == 0, info
    assert problems == [], "\n".join(problems)

def test_browser_check_sees_problems(tmp_path, chromium):
    "The browser check reports a picture that does not decode, a missing output picture, a broken link, an error output and raw TeX."
    (tmp_path/"ok.html").write_text("<html><body>ok</body></html>")
    (tmp_path/"bad.html").write_text(
        '<html><head><meta name="cascade-nb-output-images" content="2"></head><body><main>'
        '<img class="output" src="data:image/png;base64,AAAAAAAAAAAAAAAAAAAAAAAA">'
        '<a href="ok.html">fine</a> <a href="missing.html">gone</a>'
        '<p>Energy $E = \\frac{1}{2} m v^2$ left as TeX</p><math><mi>x</mi></math>'
        '<pre class="output error">Traceback (most recent call last):\nValueError</pre></main></body></html>')
    problems, info = browser.check_page(tmp_path, "bad.html", None, chromium)
    text = "\n".join(problems)
    assert "1 embedded picture(s) failed to decode" in text and "0 output pictures rendered, 2 expected" in text
    assert "broken link to" in text and "missing.html" in text and "ok.html" not in text
    assert "error output" in text and "raw TeX" in text, problems

def test_demo_images_tool(tmp_path):
    "tools/make_demo_images.py turns a run's grids and loss curve into the three README/notebook pictures."
    from PIL import Image
    run = tmp_path / "run"; run.mkdir()
    for n in (200, 400): Image.new("RGB", (40, 30), (n // 4, 0, 0)).save(run / f"{n:06d}.png")
    Image.new("RGB", (60, 40)).save(run / "loss.png")
    make_demo_images = tool("make_demo_images")
    make_demo_images.main([str(run), "--images", str(tmp_path)])
    assert Image.open(tmp_path / "demo_grid.png").getpixel((0, 0))[:3] == (100, 0, 0)   # the last grid
    assert Image.open(tmp_path / "demo_progress.png").size == (40, 2 * (30 + 18))
    assert (tmp_path / "demo_loss.png").exists()
    assert not (tmp_path / "demo_eval.png").exists()                                     # the run did not evaluate
    import json, torch
    from cascade_nb.run_state import save_sample_grid                                      # the trainer's eval grid format
    save_sample_grid({"sample": torch.tensor([1., 0, 0]).view(1, 3, 1, 1).expand(3, 3, 16, 16),
                      "data": torch.tensor([0., 0, 1]).view(1, 3, 1, 1).expand(3, 3, 16, 16)}, run / "eval_000400.png")
    (run / "eval_000400.txt").write_text("red apple\nbanana\ncactus\n")
    (run / "metrics.jsonl").write_text(json.dumps({"update": 400, "eval/retrieval/top1": 0.5}) + "\n")
    make_demo_images.main([str(run), "--images", str(tmp_path)])
    ev = Image.open(tmp_path / "demo_eval.png").convert("RGB")
    x, y = 2 * (16 * 4 + 24) + 12, 26                                                     # third caption's cell
    assert ev.getpixel((x + 5, y + 5)) == (255, 0, 0) and ev.getpixel((x + 5, y + 64 + 2 + 5)) == (0, 0, 255)
    with pytest.raises(SystemExit, match="expected NNNNNN.png"): make_demo_images.main([str(tmp_path / "nothing"), "--images", str(tmp_path)])
