"""Saved notebook outputs (tools/run_notebooks.py): every notebook carries outputs made from its current source, fit
for git (no machine-specific text, no warnings, small pictures), and the tool itself does what it promises on a small
notebook. The checks on the committed notebooks only read JSON: they take well under a second each."""
import base64, json, os, re, shutil, subprocess, sys
from pathlib import Path
import pytest
from conftest import ROOT, tool

run_nbs = tool("run_notebooks")
NOTEBOOKS = run_nbs.all_notebooks(ROOT)
IDS = [str(p.relative_to(ROOT)) for p in NOTEBOOKS]
SKIP_FLAGS = ("gpu", "weights", "notest")
# a cell draws when it uses matplotlib or show_images, or ends by displaying a PIL image it opened
DRAWS = re.compile(r"\bplt\.\w+\(|show_images\(|\.plot\(|\bimshow\(|\A(?:.*\n)*Image\.open\([^\n]*\)\s*\Z")

def _nb(p): return json.loads(Path(p).read_text())
def _src(c): return "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
def _text(o): return "".join(o.get("text", "")) + "".join("".join(v) for k, v in o.get("data", {}).items() if k.startswith("text/")) + "".join(o.get("traceback", []))
def _skipped(c): return bool(re.search(r"^#\|\s*(?:(?:gpu|weights|notest)\b|eval:\s*false)", _src(c), re.M))

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_outputs_are_fresh(nb):
    "A notebook's saved outputs were made from its current code cells and package version."
    assert (why := run_nbs.staleness(nb, ROOT)) is None, why

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_outputs_fit_for_git(nb):
    "No errors, warnings, absolute paths or user names in outputs; pictures are PNGs of reading size; text shortened."
    problems, machine = [], [str(ROOT), str(Path.home()), "/tmp/tmp", "/private/var/"]
    for i, c in enumerate(_nb(nb)["cells"]):
        for o in c.get("outputs", []):
            where = f"{nb.relative_to(ROOT)} cell {i} ({c.get('id')})"
            text = _text(o)
            if o["output_type"] == "error": problems.append(f"{where}: error output {o.get('ename')}")
            if o.get("name") == "stderr" and run_nbs.WARNING.search(text): problems.append(f"{where}: a warning in stderr")
            problems += [f"{where}: machine-specific {m!r}" for m in machine if len(m) > 1 and m in text]
            if re.search(r"\d img/s|\d+:\d\d<\d+:\d\d", text): problems.append(f"{where}: a timing that changes every run")
            if len(text.splitlines()) > run_nbs.MAX_TEXT_LINES + 1: problems.append(f"{where}: {len(text.splitlines())} lines of text")
            for mime, v in o.get("data", {}).items():
                if mime.startswith("image/") and mime != "image/png": problems.append(f"{where}: {mime} (PNG expected)")
                if mime == "image/png" and len(base64.b64decode("".join(v))) > 400_000: problems.append(f"{where}: picture over 400 kB")
    assert problems == [], "\n".join(problems) + f"\nrefresh with `{run_nbs.REFRESH} {nb.relative_to(ROOT)}`"

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_drawing_cells_carry_pictures(nb):
    "Every cell that ran and draws (matplotlib, show_images, PIL) saved a picture a reader on GitHub sees."
    d = _nb(nb)
    if run_nbs.stored_fingerprint(d) is None: pytest.skip("no saved outputs yet: test_outputs_are_fresh fails for it and names the command")
    missing = [f"cell {i} ({c.get('id')})" for i, c in enumerate(d["cells"])
               if c["cell_type"] == "code" and not _skipped(c) and "#| export" not in _src(c)
               and not re.search(r"^#\|\s*(hide|output:\s*false)", _src(c), re.M)
               and DRAWS.search(_src(c)) and not any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]
    assert missing == [], f"{nb.relative_to(ROOT)}: drawing cells without a picture: {missing}"

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_skipped_cells_are_explained(nb):
    "A cell skipped on CPU (gpu, weights, notest, eval: false) shows outputs from a run elsewhere or a note after it."
    cells, bare = _nb(nb)["cells"], []
    for i, c in enumerate(cells):
        if c["cell_type"] != "code" or not _skipped(c) or c.get("outputs"): continue
        nxt = cells[i + 1] if i + 1 < len(cells) else None
        if not (nxt and nxt["cell_type"] == "markdown" and "not run here" in _src(nxt).lower()): bare.append(f"cell {i} ({c.get('id')})")
    assert bare == [], f"{nb.relative_to(ROOT)}: skipped cells with neither outputs nor a 'Not run here' note after them: {bare}"

def test_all_outputs_small():
    total = sum(p.stat().st_size for p in NOTEBOOKS)
    assert total < 20e6, f"notebooks take {total / 1e6:.1f} MB"

@pytest.mark.parametrize("nb", sorted((ROOT / "tutorials").glob("*.ipynb")), ids=lambda p: p.name)
def test_tutorials_open_on_colab(nb, monkeypatch):
    "Colab shows saved outputs; the first cell installs the package only on Colab and prints nothing; the badge opens this file."
    import subprocess as sp, types
    d = _nb(nb)
    cells = d["cells"]
    assert cells[0]["cell_type"] == "code" and cells[0].get("outputs", []) == [], f"{nb.name}: the Colab install cell has outputs"
    badge = f"https://colab.research.google.com/github/cascade-nb/cascade_nb/blob/main/tutorials/{nb.name}"
    assert badge in "".join(_src(c) for c in cells[:4]), f"{nb.name}: no Colab badge for {badge}"
    assert d["metadata"].get("kernelspec", {}).get("name", "python3") == "python3"
    calls = []
    monkeypatch.setattr(sp, "run", lambda *a, **k: calls.append(a[0]))
    monkeypatch.setattr(os, "chdir", lambda p: calls.append(f"chdir {p}"))
    exec(compile(_src(cells[0]), nb.name, "exec"), {})                                   # here: does nothing
    assert calls == [], calls
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    exec(compile(_src(cells[0]), nb.name, "exec"), {})                                   # on Colab: clone + install
    assert any("pip install" in str(c) for c in calls) and any(str(c).startswith("chdir") for c in calls), calls

# ---------------------------------------------------------------- the tool itself, on a small notebook
def _cell(kind, src, **kw):
    return {"cell_type": kind, "id": f"{abs(hash(src)) % 16**8:08x}", "metadata": {}, "source": src.splitlines(True),
            **({"outputs": [], "execution_count": None} if kind == "code" else {}), **kw}

@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    "A notebook in a repository-like folder, run through the tool twice."
    root = tmp_path_factory.mktemp("repo")
    (root / "cascade_nb").mkdir(); (root / "cascade_nb" / "__init__.py").write_text('__version__ = "9.9.9"\n')
    shutil.copy(ROOT / "pyproject.toml", root)
    (root / "nbs").mkdir()
    nb = {"cells": [
        _cell("markdown", "# Toy\n> a notebook"),
        _cell("code", "import os, warnings, torch, matplotlib.pyplot as plt\nfrom pathlib import Path\nprint(torch.rand(2))"),
        _cell("code", "warnings.warn('something old')\n"
                      "import sys; print('stderr line', file=sys.stderr)\n"
                      "print('Loading weights: 100%|##########| 37/37 [00:00<00:00, 574.13it/s]', file=sys.stderr)\n"
                      "from ipywidgets import interact\n"
                      "interact(lambda n=3: print('widget says', n), n=(1, 5));"),
        _cell("code", "print(Path('.').resolve(), os.environ['IN_TEST'])\nprint('update 5/60: loss 0.2 | lr 1e-3 | 12.8 img/s')"),
        _cell("code", "for i in range(100): print(i)"),
        _cell("code", "plt.figure(figsize=(4, 3)); plt.imshow(torch.rand(64, 64)); plt.plot([0, 63], [0, 63])"),
        _cell("code", "#| gpu\nprint('only on a GPU')", outputs=[{"name": "stdout", "output_type": "stream", "text": ["from a GPU run\n"]}]),
        _cell("code", "#| eval: false\nraise RuntimeError('never runs')"),
    ], "metadata": {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}, "other": 1},
       "nbformat": 4, "nbformat_minor": 5}
    path = root / "nbs" / "toy.ipynb"
    path.write_text(json.dumps(nb))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = [subprocess.run([sys.executable, ROOT / "tools" / "run_notebooks.py", str(path), "--root", str(root)], env=env,
                          capture_output=True, text=True, timeout=300) for _ in range(2)]
    return root, path, res

def test_tool_saves_clean_outputs(toy):
    root, path, (first, second) = toy
    assert first.returncode == 0 and second.returncode == 0, first.stdout + first.stderr
    assert "dropped a warning" in first.stdout
    d = _nb(path)
    assert d["metadata"]["cascade_nb"]["source_fingerprint"] == run_nbs.fingerprint(d, root)
    assert "other" not in d["metadata"]                                                  # nbdev's cleaning applied
    outs = {c["id"]: c.get("outputs", []) for c in d["cells"] if c["cell_type"] == "code"}
    code = [c for c in d["cells"] if c["cell_type"] == "code"]
    assert "tensor([" in _text(outs[code[0]["id"]][0])
    got = [(o.get("name") or o["output_type"], _text(o)) for o in outs[code[1]["id"]]]
    assert sorted(got) == [("stderr", "stderr line\n"), ("stdout", "widget says 3\n")], got   # no warning, tqdm bar, widget repr
    shown = _text(outs[code[2]["id"]][0])
    assert shown == "<repo>/nbs 1\nupdate 5/60: loss 0.2 | lr 1e-3\n", shown                 # ran in its folder, as nbdev-test
    long = _text(outs[code[3]["id"]][0]).splitlines()
    assert long[:2] == ["0", "1"] and long[-1] == "99" and "lines not shown" in long[25] and len(long) == 36
    png = [o for o in outs[code[4]["id"]] if "image/png" in o.get("data", {})]
    assert len(png) == 1 and "image/jpeg" not in png[0]["data"]
    from PIL import Image
    import io
    im = Image.open(io.BytesIO(base64.b64decode("".join(png[0]["data"]["image/png"]))))
    assert 150 <= im.width <= 4 * run_nbs.FIGURE_DPI and im.height <= 3 * run_nbs.FIGURE_DPI   # 4x3 inches at the capped dpi
    assert _text(outs[code[5]["id"]][0]) == "from a GPU run\n"                           # skipped cells keep their outputs
    assert outs[code[6]["id"]] == []

def test_tool_is_deterministic_and_nbdev_clean_stable(toy, tmp_path):
    root, path, _ = toy
    before = path.read_bytes()
    subprocess.run([sys.executable, ROOT / "tools" / "run_notebooks.py", str(path), "--root", str(root)], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=300)
    assert path.read_bytes() == before                                                   # seeded: the same file again
    subprocess.run([str(Path(sys.executable).parent / "nbdev-clean"), "--fname", str(path)], cwd=root, check=True,
                   capture_output=True, env={k: v for k, v in os.environ.items() if k != "IN_TEST"})
    assert path.read_bytes() == before                                                   # nbdev-clean changes nothing

def test_staleness_names_the_refresh_command(toy, tmp_path):
    root, path, _ = toy
    assert run_nbs.staleness(path, root) is None
    d = _nb(path)
    copy = tmp_path / "toy.ipynb"
    d["cells"][0]["source"] = ["# Toy, retitled"]                                       # prose: outputs still fresh
    d["cells"][1]["id"] = "changedid"; d["cells"][1]["metadata"] = {"x": 1}
    d["cells"][1]["source"] = [l.rstrip("\n") + "   \n" for l in d["cells"][1]["source"]]
    copy.write_text(json.dumps(d))
    assert run_nbs.staleness(copy, root) is None
    d["cells"][1]["source"][-1] = "print(torch.rand(3))"                                 # one changed line of code
    copy.write_text(json.dumps(d))
    why = run_nbs.staleness(copy, root)
    assert why and "changed since its outputs were saved" in why and "python tools/run_notebooks.py" in why
    res = subprocess.run([sys.executable, ROOT / "tools" / "run_notebooks.py", "--check", str(copy), "--root", str(root)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 1 and "refresh with `python tools/run_notebooks.py" in res.stdout
    (root / "cascade_nb" / "__init__.py").write_text('__version__ = "9.9.10"\n')          # a new package version
    try: assert run_nbs.staleness(path, root) is not None
    finally: (root / "cascade_nb" / "__init__.py").write_text('__version__ = "9.9.9"\n')

def test_fingerprint_follows_what_runs_not_how_it_is_written():
    "Re-wrapping, comments, docstring wording and splitting a cell keep the fingerprint; what runs or shows changes it."
    def fp(*cells): return run_nbs.fingerprint({"cells": [_cell("code", c) for c in cells]})
    base = fp('def f(x):\n    "Add one."\n    return x + 1\ny = f(1)\ny')
    assert fp('def f(x):\n    """Add\n    one."""\n    return (x\n            + 1)   # plus one\n',
              "# the value\ny = f(1)\ny") == base                     # wrapped, commented, split in two
    assert fp('def f(x):\n    "Add one."\n    return x + 2\ny = f(1)\ny') != base        # other code
    assert fp('def f(x):\n    "Add one."\n    return x + 1\ny = f(1)', "y") == base      # shown at the same place
    assert fp('def f(x):\n    "Add one."\n    return x + 1\ny = f(1)\ny', "z = 0") != base  # y no longer shown
    assert fp('#| eval: false\ndef f(x):\n    "Add one."\n    return x + 1', "y = f(1)\ny") != base  # a cell left out
    assert fp("%time x = 1") != fp("%time x = 2") and fp("!ls  a") == fp("!ls  a")   # magics count by their text

def test_fingerprint_survives_nbdev_clean_of_the_repository():
    "nbdev-clean (ids, metadata) does not change any committed notebook's fingerprint."
    from nbdev.clean import clean_nb
    for p in NOTEBOOKS[:8]:
        d = _nb(p); before = run_nbs.fingerprint(d)
        for c in d["cells"]: c.pop("id", None); c["metadata"] = {"collapsed": True}
        clean_nb(d)
        assert run_nbs.fingerprint(d) == before, p

def test_tool_leaves_a_failing_notebook_alone(toy):
    "A notebook whose run fails keeps its file as it was; the command names it and exits 1."
    root, _, _ = toy
    bad = root / "nbs" / "bad.ipynb"
    bad.write_text(json.dumps({"cells": [_cell("code", "print('fine')"), _cell("code", "1/0")], "metadata": {},
                               "nbformat": 4, "nbformat_minor": 5}))
    before = bad.read_bytes()
    res = subprocess.run([sys.executable, ROOT / "tools" / "run_notebooks.py", str(bad), "--root", str(root)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert res.returncode == 1 and "FAILED nbs/bad.ipynb" in res.stdout and "ZeroDivisionError" in res.stdout, res.stdout
    assert bad.read_bytes() == before
