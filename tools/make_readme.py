#!/usr/bin/env python
"""Generate README.md from nbs/index.ipynb without quarto (which can't be installed offline): markdown cells are
copied, visible code cells become ```python blocks, cells marked `#| hide` are left out.
`--check` exits 1 when README.md differs from what the notebook generates (CI gate)."""
import json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = "<!-- generated from nbs/index.ipynb by tools/make_readme.py: edit the notebook, not this file -->\n\n"

def render(nb_path=ROOT / "nbs" / "index.ipynb") -> str:
    cells = json.loads(Path(nb_path).read_text())["cells"]
    parts = []
    for c in cells:
        src = "".join(c["source"])
        lines = src.splitlines()
        directives = [l.strip() for l in lines if l.strip().startswith("#|")]
        if any(d.replace(" ", "") in ("#|hide", "#|exporti", "#|include:false") for d in directives): continue
        body = "\n".join(l for l in lines if not l.strip().startswith("#|")).strip()
        if not body: continue
        parts.append(body if c["cell_type"] == "markdown" else f"```python\n{body}\n```")
    return HEADER + "\n\n".join(parts) + "\n"

if __name__ == "__main__":
    text, readme = render(), ROOT / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            sys.exit("README.md is out of sync with nbs/index.ipynb: run `python tools/make_readme.py`")
        print("README.md is in sync with nbs/index.ipynb")
    else:
        readme.write_text(text)
        print(f"wrote {readme}")
