"""CI gates on the literate source: notebooks are clean (`nbdev-clean` changes nothing), the package is exactly
what the notebooks export (`nbdev-export` changes nothing), and README.md is what nbs/index.ipynb generates."""
import filecmp, os, shutil, subprocess, sys
from pathlib import Path
from conftest import ROOT, run_cli

def _tree(base: Path, pattern: str):
    return {p.relative_to(base): p for p in base.rglob(pattern) if "__pycache__" not in p.parts and "_proc" not in p.parts}

def test_clean_and_exported(tmp_path):
    for d in ("nbs", "cascade_nb"): shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "IN_TEST"}   # nbdev-export is a no-op under IN_TEST
    bindir = Path(sys.executable).parent
    for cmd in ("nbdev-clean", "nbdev-export"):
        subprocess.run([str(bindir / cmd)], cwd=tmp_path, env=env, check=True, capture_output=True)
    for sub, pattern in (("nbs", "*.ipynb"), ("cascade_nb", "*.py")):
        before, after = _tree(ROOT / sub, pattern), _tree(tmp_path / sub, pattern)
        assert sorted(before) == sorted(after), f"{sub}: files differ after nbdev-clean/export: {set(before) ^ set(after)}"
        changed = [str(k) for k in before if not filecmp.cmp(before[k], after[k], shallow=False)]
        hint = "run `nbdev-clean && nbdev-export` and commit" if sub == "cascade_nb" else "run `nbdev-clean` and commit"
        assert not changed, f"{sub}: out of sync ({hint}): {changed}"

def test_readme_in_sync():
    res = run_cli(ROOT / "tools" / "make_readme.py", "--check", check=False)
    assert res.returncode == 0, res.stdout + res.stderr
