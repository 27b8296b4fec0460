"""The shape of the code a reader meets (issue 31): export cells short, one definition per cell, no line over 120
characters in the package or in a notebook's code. `tools/code_shape.py` prints the figures; ruff checks the line
limit with its configuration in pyproject.toml."""
import json, shutil, subprocess, sys
from pathlib import Path
from conftest import ROOT, tool

shape = tool("code_shape")

def _notebook(path: Path, *cells: str):
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c.splitlines(True), "metadata": {},
                                           "outputs": [], "execution_count": None} for c in cells],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))

def test_figures_count_what_they_say(tmp_path):
    nb = tmp_path / "toy.ipynb"
    long_def = "#| export\ndef big():\n" + "    x = 1\n" * 90
    _notebook(nb, "#| export\nA = 1\nB, C = 2, 3\ndef f(): pass", "#| export\n#| hide\nclass K: pass", long_def,
              "x = 'a' * 1  # " + "y" * 120, "#| export\ndef train(cfg):\n" + "    pass\n" * 90)
    shape.ONLY = [nb]
    try:
        got = {i: k for _, i, k, _ in shape.export_cells(tmp_path)}
        assert got == {0: 3, 1: 1, 2: 91, 4: 91}                              # directives do not count
        assert shape.defined_names("A = 1\nB, C = 2, 3\ndef f(): pass") == 4
        lines, missed = shape.figures(tmp_path)
        assert any("over 80 lines" in m and "cell 2" in m for m in missed)    # train() may be long, big() may not
        assert not any("cell 4" in m and "80 lines" in m for m in missed)
        assert any("cell 3: a line over 120" in m for m in missed) and lines[0].startswith("export cells: 4,")
    finally: shape.ONLY = None

WHOLE = """
from dataclasses import asdict
from .helpers import helper
def _body(model, x): return x
class Model:
    def forward(self, x):
        "Forwards."
        return _body(self, x)
    def also(self, x): helper(x, model=self)
    def normal(self, x): return _body(None, x) + 1
    def stdlib(self): return asdict(self)
    @classmethod
    def make(cls): return _body(cls, 1)
def _extra(self): return 1
Model.extra = _extra
setattr(Model, "more", _extra)
@patch
def third(self: Model): pass
"""

def test_forwarders_and_patches_are_found():
    import ast
    tree = ast.parse(WHOLE)
    assert shape.forwarders(tree) == ["Model.forward -> _body", "Model.also -> helper"]
    assert [p.split(" ")[0] for p in shape.patches(tree)] == ["Model.extra", "setattr(Model,", "@patch"]

def test_the_project_meets_its_code_shape_targets():
    res = subprocess.run([sys.executable, ROOT / "tools" / "code_shape.py", "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr

def test_ruff_line_limit():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in the dev extras (pip install -e '.[dev]')"
    res = subprocess.run([ruff, "check", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
