#!/usr/bin/env python
"""The shape of the code a reader meets: how long the notebooks' export cells are, how many names a cell defines,
and how long the lines of the package and of the notebooks' code cells are. Prints one line per figure;
`--check` exits 1 when a figure misses its target (tests/test_code_shape.py runs it).

    python tools/code_shape.py            # the figures
    python tools/code_shape.py --check    # ... and exit 1 when one misses its target
    python tools/code_shape.py --cells 20 # also list the export cells of more than 20 lines
    python tools/code_shape.py nbs/60_lora.ipynb --cells 12   # the figures of some notebooks only (no package files)

Targets (issue 31, against fastcore's 6 / 17 and miniai's 8 / 22 median / p90 lines per export cell):
an export cell has at most MEDIAN_CELL lines at the median and at most MAX_CELL, except the cell holding `train()`
(one flat loop a reader reads in one piece); no line of the package or of a notebook's code is over MAX_LINE
characters (the same limit `ruff` checks, configured in pyproject.toml). Lines count without nbdev's `#|` directives.
"""
from __future__ import annotations
import argparse, ast, json, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEDIAN_CELL, MAX_CELL, MAX_LINE = 12, 80, 120
LONG_CELL_ALLOWED = ("def train(",)          # cells that may be longer than MAX_CELL (their first definition)

ONLY: list[Path] | None = None              # set by the command line: these notebooks only, no package files

def notebooks(root: Path = ROOT) -> list[Path]:
    if ONLY is not None: return ONLY
    found = sorted((root / "nbs").rglob("*.ipynb")) + sorted((root / "tutorials").rglob("*.ipynb"))
    return [p for p in found if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)]

def code_cells(path: Path):
    "(cell index, source) of each code cell."
    for i, c in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        if c["cell_type"] == "code":
            yield i, "".join(c["source"]) if isinstance(c["source"], list) else c["source"]

def rel(p: Path, root: Path) -> str:
    return p.resolve().relative_to(root.resolve()).as_posix() if p.resolve().is_relative_to(root.resolve()) else str(p)

def is_export(src: str) -> bool:
    return any(l.strip().replace(" ", "") in ("#|export", "#|exports") for l in src.splitlines() if l.startswith("#|"))

def body_lines(src: str) -> list[str]:
    return [l for l in src.rstrip("\n").splitlines() if not l.startswith("#|")]

def defined_names(src: str) -> int:
    "Top-level functions, classes and assigned names a cell defines."
    try: tree = ast.parse("\n".join(body_lines(src)))
    except SyntaxError: return 0
    n = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): n += 1
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            n += sum(isinstance(t, ast.Name) for tgt in targets for t in ast.walk(tgt))
    return n

def export_cells(root: Path = ROOT) -> list[tuple[str, int, int, str]]:
    "(notebook, cell index, lines, source) of every export cell."
    return [(rel(p, root), i, len(body_lines(s)), s)
            for p in notebooks(root) for i, s in code_cells(p) if is_export(s)]

def allowed_long(src: str) -> bool:
    return any(l.startswith(LONG_CELL_ALLOWED) for l in body_lines(src))

def long_lines(root: Path = ROOT) -> tuple[list[str], int, int]:
    "Where lines are over MAX_LINE characters (package files and notebook code cells), lines over 100, all lines."
    where, over100, total = [], 0, 0
    files = [p for p in sorted((root / "cascade_nb").rglob("*.py")) if p.name != "_modidx.py"]   # _modidx: nbdev's index
    if ONLY is not None: files = []
    for p in files:
        for n, l in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            total += 1; over100 += len(l) > 100
            if len(l) > MAX_LINE: where.append(f"{p.relative_to(root)}:{n}")
    for p in notebooks(root):
        for i, s in code_cells(p):
            where += [f"{rel(p, root)} cell {i}" for l in s.splitlines() if len(l) > MAX_LINE]
    return where, over100, total

def figures(root: Path = ROOT) -> tuple[list[str], list[str]]:
    "The printed figures and the targets missed."
    cells = export_cells(root)
    n = sorted(k for _, _, k, _ in cells) or [0]
    too_long = [f"{nb} cell {i} ({k} lines)" for nb, i, k, s in cells if k > MAX_CELL and not allowed_long(s)]
    many = sum(defined_names(s) >= 4 for *_, s in cells)
    where, over100, total = long_lines(root)
    median, p90 = statistics.median(n), n[int(0.9 * (len(n) - 1))]
    lines = [f"export cells: {len(cells)}, lines median {median:g} (target <= {MEDIAN_CELL}), p90 {p90}, max {n[-1]}",
             f"export cells over {MAX_CELL} lines, train() aside: {len(too_long)} (target 0)",
             f"export cells defining four or more names: {many}",
             f"lines over {MAX_LINE} characters (package and notebook code): {len(where)} (target 0)",
             f"package lines over 100 characters: {over100} of {total} ({100 * over100 / max(total, 1):.1f}%)"]
    missed = ([f"median export cell {median:g} lines > {MEDIAN_CELL}"] if median > MEDIAN_CELL else []) + \
             [f"{c}: over {MAX_CELL} lines" for c in too_long] + [f"{w}: a line over {MAX_LINE} characters" for w in where]
    return lines, missed

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when a figure misses its target")
    p.add_argument("--cells", type=int, metavar="N", help="list the export cells of more than N lines")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("notebooks", nargs="*", type=Path, help="only these notebooks (default: all, and the package)")
    a = p.parse_args(argv)
    global ONLY
    ONLY = [n.resolve() for n in a.notebooks] or None
    lines, missed = figures(a.root)
    print("\n".join(lines))
    if a.cells is not None:
        for nb, i, k, s in sorted(export_cells(a.root), key=lambda c: -c[2]):
            if k > a.cells: print(f"  {k:4d} {nb} cell {i}: {body_lines(s)[0][:60]}")
    if a.check and missed:
        print(f"{len(missed)} misses:\n  " + "\n  ".join(missed[:40]) + ("\n  ..." if len(missed) > 40 else ""))
        return 1
    return 0

if __name__ == "__main__": sys.exit(main())
