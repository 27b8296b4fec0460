"""The offline docs (tools/build_docs.py): a few key pages are run and rendered the way the whole site is, and every page
of the site must show its plots embedded, with no broken local links. With Chromium installed, the same pages are
opened in headless Chromium (tools/check_docs_browser.py): pictures decoded, screenshots not blank."""
import shutil
import pytest, yaml
from conftest import ROOT, tool

build_docs, browser = tool("build_docs"), tool("check_docs_browser")
KEY_PAGES = ["nbs/19_gdf.ipynb", "tutorials/04_inference.ipynb", "nbs/index.ipynb"]   # the GDF explorer, a tutorial, the README

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not shutil.which("pandoc"): pytest.skip("pandoc not installed (apt-get install -y pandoc)")
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
        assert 'content="true"' in text and "<main>" in text and '<nav id="sidebar">' in text, page
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

@pytest.mark.skipif(browser.find_chromium() is None, reason="chromium not installed (apt-get install -y chromium): browser check skipped")
def test_pages_in_headless_chromium(site, tmp_path):
    out, _ = site
    for rel in ("19_gdf.html", "tutorials/04_inference.html", "index.html"):
        problems, info = browser.check_page(out, rel, tmp_path, browser.find_chromium())
        assert problems == [], (problems, info)
        assert info["embedded"] >= 1 and info["broken"] == 0

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
    with pytest.raises(SystemExit, match="expected NNNNNN.png"): make_demo_images.main([str(tmp_path / "nothing"), "--images", str(tmp_path)])
