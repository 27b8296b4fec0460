"""Run every notebook (library notebooks in nbs/ and the tutorials) the way `nbdev-test` does, one pytest test each,
so CI prints pytest's summary. Cells flagged with the project's `tst_flags` (gpu, weights, notest) are skipped."""
from pathlib import Path
import pytest
from nbdev.config import get_config
from nbdev import test as nbdev_test   # (not `from ... import test_nb`: pytest would collect it)
from conftest import ROOT

def _notebooks():
    found = sorted((ROOT / "nbs").rglob("*.ipynb")) + sorted((ROOT / "tutorials").rglob("*.ipynb"))
    return [p for p in found if not any(part.startswith(("_", ".")) for part in p.relative_to(ROOT).parts)]

NOTEBOOKS = _notebooks()

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_notebook(nb, monkeypatch):
    monkeypatch.chdir(nb.parent)   # nbdev-test runs notebooks from their folder
    skip = get_config(ROOT).tst_flags.split()
    ok, _ = nbdev_test.test_nb(nb, skip_flags=skip, basepath=ROOT, showerr=True)
    assert ok, f"{nb.name} failed (traceback above)"

def test_found_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert "00_core.ipynb" in names and "01_config.ipynb" in names and "index.ipynb" in names
