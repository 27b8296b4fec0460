"""Run every notebook (library notebooks in nbs/ and the tutorials) the way `nbdev-test` does, one pytest test each,
so CI prints pytest's summary. Cells flagged with the project's `tst_flags` (gpu, weights, notest) are skipped.
Each notebook runs in its own process, like nbdev-test's workers: a notebook's tensors and models are freed when it
ends, so the suite's memory stays that of the largest notebook, not the sum."""
import os, subprocess, sys
import pytest
from nbdev.config import get_config
from conftest import ROOT, tool

NOTEBOOKS = tool("build_docs").all_notebooks(ROOT)   # the same list the docs site is built from
RUN = """import sys
from nbdev.test import test_nb
ok, _ = test_nb(sys.argv[1], skip_flags=sys.argv[2].split(), basepath=sys.argv[3], showerr=True)
sys.exit(0 if ok else 1)
"""

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_notebook(nb):
    skip = get_config(ROOT).tst_flags
    env = {k: v for k, v in os.environ.items() if k != "IN_TEST"}
    res = subprocess.run([sys.executable, "-c", RUN, str(nb), skip, str(ROOT)], cwd=nb.parent, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{nb.name} failed:\n{res.stderr[-6000:]}\n{res.stdout[-2000:]}"

def test_found_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert "00_core.ipynb" in names and "01_config.ipynb" in names and "index.ipynb" in names
