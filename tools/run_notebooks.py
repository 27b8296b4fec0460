#!/usr/bin/env python
"""Run the notebooks and save their outputs into the .ipynb files, so GitHub, Colab and the docs site (`nbdev-docs`
renders saved outputs, it never executes) show the plots and values a reader expects.

    python tools/run_notebooks.py                         # every notebook in nbs/, nbs/explanations/, tutorials/
    python tools/run_notebooks.py nbs/19_gdf.ipynb        # some of them
    python tools/run_notebooks.py --stale                 # only those whose source changed since their outputs
    python tools/run_notebooks.py --check                 # list stale notebooks, exit 1 if any (runs nothing)

Each notebook runs the way `nbdev-test` runs it (tests/test_notebooks.py): in its own process, from its own folder,
with `IN_TEST=1`, cells flagged with the project's `tst_flags` (gpu, weights, notest) or `#| eval: false` left out;
those cells keep whatever outputs they carried (e.g. from a GPU run). Before the first cell the random generators are
seeded (python, numpy, torch: 0) and torch uses one thread, so a rerun gives the same numbers. The outputs are then
made fit for git:

* text: ANSI colours removed, `\\r`-redrawn progress lines reduced to their last state, long outputs shortened in the
  middle; the repository's absolute path, the home folder, the user name and temporary folders replaced, and
  timings that differ on every run (`12.8 img/s`, `0.45 s`, progress bars' clocks) replaced by `…`;
* stderr: Python warnings raised by the environment (library deprecations and the like) and libraries' tqdm
  progress bars dropped;
* pictures: PNGs at most MAX_IMAGE_WIDTH pixels wide, palette-encoded when that loses nothing, or when the picture
  is still over MAX_PNG_BYTES (noise, photos); a PIL image's JPEG twin dropped;
* widgets: dropped (no widget state is saved; what the widget's function displayed, e.g. its plot, is kept);
* metadata: nbdev's cleaning applied (`nbdev-clean` leaves the file unchanged), plus the fingerprint below.

Staleness: the notebook's metadata records `cascade_nb.source_fingerprint`, a hash of what its code cells run (the
parsed code, see `fingerprint`) and of the package version. `tests/test_notebook_outputs.py` fails when the fingerprint
no longer matches and names the command to refresh. Markdown, comments, line wrapping, docstring wording, cell ids,
metadata and the boundaries between cells that run alike are not in the hash: prose edits, re-formatting, splitting a
cell and `nbdev-clean`/`nbdev-export` round trips don't make outputs stale.

A notebook whose run fails is left as it was; the command reports it and exits 1.
"""
from __future__ import annotations
import argparse, ast, base64, hashlib, io, json, os, re, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
META_KEY = "cascade_nb"                    # notebook metadata key, kept by nbdev-clean (pyproject allowed_metadata_keys)
REFRESH = "python tools/run_notebooks.py"
MAX_TEXT_LINES = 40                        # longer text outputs keep their first 25 and last 10 lines
MAX_LINE_CHARS = 400
MAX_IMAGE_WIDTH = 1000                     # pixels; matplotlib figures are drawn at FIGURE_DPI
FIGURE_DPI = 80
# Run before the first cell; leaves no names behind (a notebook must import what it uses, as under nbdev-test).
SETUP = f"""
import random as _random, numpy as _np, torch as _torch, matplotlib as _mpl
_random.seed(0); _np.random.seed(0); _torch.manual_seed(0); _torch.set_num_threads(1)
_mpl.rcParams['figure.dpi'] = {FIGURE_DPI}
del _random, _np, _torch, _mpl
"""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# `path:123: SomeWarning: message` and the source line Python prints under it
WARNING = re.compile(r"^[^\n]*?:\d+: \w*Warning: [^\n]*\n(?:[ \t]+[^\n]*\n)*", re.M)
WIDGET = "application/vnd.jupyter.widget-view+json"
# tqdm's bars that libraries (transformers, huggingface_hub) draw on stderr: environment noise with a clock
TQDM = re.compile(r"^[^\n]*\|[^|\n]*\| *\d+/\d+ \[[^\]\n]*\][^\n]*(\n|$)", re.M)
# Timings that differ on every run: the trainer's throughput, and durations a cell prints (`0.45 s`, `12.3 ms`).
TIMINGS = [(re.compile(r"\s*\|\s*[\d.]+ img/s"), ""),
           (re.compile(r"""(["']images_per_s["']:\s*)[-+\d.e]+"""), r"\1…"),
           (re.compile(r"(?<![\w.])\d+\.\d+ ?(ms|s)\b"), r"… \1"),
           (re.compile(r"(\d+/\d+) \d+:\d+<\d+:\d+(, [\d.]+ ?\w+/\w+)?"), r"\1")]      # progress bars' times
MAX_PNG_BYTES = 120_000    # above this (noise, photos) a PNG gets a 256-colour palette, lossy but fine for reading

def all_notebooks(root: Path = ROOT) -> list[Path]:
    "Every documented notebook: nbs/ (with subfolders) and tutorials/, skipping `_`/`.` names (e.g. _proc/)."
    found = sorted((root/"nbs").rglob("*.ipynb")) + sorted((root/"tutorials").rglob("*.ipynb"))
    return [p for p in found if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)]

def rel(p: Path, root: Path = ROOT) -> str:
    p = Path(p).resolve()
    return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)

# ---------------------------------------------------------------- fingerprint
def package_version(root: Path = ROOT) -> str:
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', (root/"cascade_nb"/"__init__.py").read_text(), re.M)
    return m.group(1) if m else "unknown"

def _source(cell) -> str:
    s = cell.get("source", "")
    s = "".join(s) if isinstance(s, list) else s
    return "\n".join(l.rstrip() for l in s.replace("\r\n", "\n").split("\n")).strip("\n")

SKIP_DIRECTIVE = r"^#\|\s*(?:(?:{flags})\b|eval:\s*false)"      # a cell nbdev-test (and this tool) leaves out

def _code_form(src: str) -> list[ast.stmt] | None:
    """The cell's statements as Python sees them (IPython magics turned into calls), None if it does not parse.
    Comments, formatting and the wording of function and class docstrings are not part of the code's meaning; a
    last statement that is an expression (shown as the cell's output) gets a marker, so that where a cell shows a
    value is part of it."""
    from IPython.core.inputtransformer2 import TransformerManager
    try: tree = ast.parse(TransformerManager().transform_cell(src))
    except SyntaxError: return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                first.value.value = " ".join(first.value.value.split())
    shown = [ast.Expr(ast.Name("__shown__"))] if tree.body and isinstance(tree.body[-1], ast.Expr) else []
    return tree.body + shown

def fingerprint(nb: dict, root: Path = ROOT) -> str:
    """Hash of what the code cells run (in order) and of the package version.

    The code is compared as parsed Python (`_code_form`): re-wrapping lines, editing comments, re-wording a
    docstring or splitting one cell into several leaves the fingerprint as it is; any change to what runs, to which
    cells are left out (`#| eval: false`, the test flags) or to where a cell shows a value changes it. A cell that does
    not parse counts by its text."""
    from nbdev.config import get_config
    skipped = re.compile(SKIP_DIRECTIVE.format(flags="|".join(get_config(root).tst_flags.split()) or "$^"), re.M)
    h = hashlib.sha256(f"cascade_nb {package_version(root)}\n".encode())
    run, group = [], None                       # consecutive cells that run (or are skipped) alike form one program
    def flush():
        if run: h.update(f"\0{group}\0".encode() + ast.dump(ast.Module(run, [])).encode())
        run.clear()
    for c in nb.get("cells", []):
        if c.get("cell_type") != "code": continue
        src = _source(c)
        key = "skipped" if skipped.search(src) else "runs"
        form = _code_form(src)
        if key != group or form is None: flush()
        group = key
        if form is None: h.update(b"\0text\0" + src.encode())
        else: run.extend(form)
    flush()
    return h.hexdigest()[:16]

def read_json(path: Path) -> dict: return json.loads(Path(path).read_text(encoding="utf-8"))

def stored_fingerprint(nb: dict) -> str | None:
    return (nb.get("metadata", {}).get(META_KEY) or {}).get("source_fingerprint")

def is_fresh(path: Path, root: Path = ROOT) -> bool:
    "True when the notebook's saved outputs were made from its current code cells and package version."
    nb = read_json(path)
    return stored_fingerprint(nb) == fingerprint(nb, root)

def staleness(path: Path, root: Path = ROOT) -> str | None:
    "None when fresh, else why the saved outputs can't be trusted, with the command that refreshes them."
    nb = read_json(path)
    saved = stored_fingerprint(nb)
    if saved == fingerprint(nb, root): return None
    why = ("has never been run by tools/run_notebooks.py (no saved outputs)" if saved is None else
           "changed since its outputs were saved (code cells or package version)")
    return f"{rel(path, root)} {why}: refresh with `{REFRESH} {rel(path, root)}`"

# ---------------------------------------------------------------- making outputs fit for git
def _text(v) -> str: return "".join(v) if isinstance(v, list) else str(v)

def _lines(s: str) -> list[str]: return s.splitlines(keepends=True)

def scrubbers(root: Path = ROOT) -> list[tuple[re.Pattern, str]]:
    "Machine-specific strings and what they become."
    subs = []
    for path, name in ((root.resolve(), "<repo>"), (Path.home(), "~")):
        if len(str(path)) > 1: subs.append((re.compile(re.escape(str(path)) + r"(?=/|\b|$)"), name))
    tmp = re.escape(tempfile.gettempdir().rstrip("/"))
    subs.append((re.compile(tmp + r"/(?:tmp|pytest-of-[^/\s]+/pytest-\d+/)[A-Za-z0-9_]+"), "/tmp/…"))
    subs += TIMINGS
    user = os.environ.get("USER") or os.environ.get("LOGNAME")
    if user and len(user) > 3 and user not in ("root", "runner", "user"): subs.append((re.compile(rf"\b{re.escape(user)}\b"), "user"))
    return subs

def shorten(text: str, max_lines: int = MAX_TEXT_LINES) -> str:
    lines = [l if len(l) <= MAX_LINE_CHARS else l[:MAX_LINE_CHARS] + " …\n" for l in _lines(text)]
    if len(lines) > max_lines:
        head, tail = lines[:25], lines[-10:]
        lines = head + [f"… ({len(lines) - 35} lines not shown)\n"] + tail
    return "".join(lines)

def clean_text(text: str, subs) -> str:
    text = ANSI.sub("", text)
    text = "\n".join(re.sub(r".*\r(?=.)", "", l) for l in text.split("\n"))    # what a terminal shows last
    for pat, new in subs: text = pat.sub(new, text)
    return text

def shrink_png(b64: str, max_width: int = MAX_IMAGE_WIDTH) -> str:
    "A PNG at most `max_width` wide, palette-encoded when it has at most 256 colours; the smallest lossless form."
    from PIL import Image
    raw = base64.b64decode(b64)
    im = Image.open(io.BytesIO(raw))
    im.load()
    if im.width > max_width:
        im = im.convert("RGBA" if "A" in im.getbands() else "RGB")
        im = im.resize((max_width, round(im.height * max_width / im.width)), Image.LANCZOS)
    candidates = []
    for img in (im, _palette(im)):
        if img is None: continue
        buf = io.BytesIO(); img.save(buf, "PNG", optimize=True); candidates.append(buf.getvalue())
    if im.width == Image.open(io.BytesIO(raw)).width: candidates.append(raw)
    best = min(candidates, key=len)
    if len(best) > MAX_PNG_BYTES:
        rgb = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        buf = io.BytesIO(); rgb.save(buf, "PNG", optimize=True); best = min(best, buf.getvalue(), key=len)
    return base64.b64encode(best).decode()

def _palette(im):
    "The image as a palette image if that loses nothing (plots usually have few colours), else None."
    from PIL import Image
    if im.mode == "P": return None
    rgba = im.convert("RGBA")
    if rgba.getextrema()[3][0] < 255: return None                      # real transparency: keep as is
    rgb = rgba.convert("RGB")
    colours = rgb.getcolors(256)
    if colours is None: return None
    flat = [v for _, c in colours for v in c]
    pal = Image.new("P", (1, 1)); pal.putpalette(flat + [0] * (768 - len(flat)))
    out = rgb.quantize(palette=pal, dither=Image.Dither.NONE)
    return out if out.convert("RGB").tobytes() == rgb.tobytes() else None

def clean_outputs(outputs: list, subs, log=lambda *_: None) -> list:
    "Outputs of one cell made fit for git (see the module docstring)."
    kept = []
    for o in outputs:
        o = json.loads(json.dumps(o))                                   # plain dicts, our own copy
        kind = o.get("output_type")
        if kind == "stream":
            text = clean_text(_text(o.get("text", "")), subs)
            if o.get("name") == "stderr":
                for w in WARNING.findall(text): log(f"  dropped a warning: {w.splitlines()[0][:160]}")
                text = TQDM.sub("", WARNING.sub("", text))
            if not text.strip(): continue
            o["text"] = _lines(shorten(text))
        elif kind in ("display_data", "execute_result"):
            data = o.get("data", {})
            if WIDGET in data: continue                         # a widget: no state is saved, its text repr is noise
            if "image/png" in data: data.pop("image/jpeg", None)              # PIL images offer both: one is enough
            for mime in list(data):
                if mime == "image/png": data[mime] = shrink_png(_text(data[mime]).replace("\n", "")) + "\n"
                elif mime.startswith("text/"):
                    v = clean_text(_text(data[mime]), subs)
                    data[mime] = _lines(shorten(v) if mime == "text/plain" else v)
                elif mime.startswith("image/"): continue
                elif isinstance(data[mime], (list, str)): data[mime] = _lines(clean_text(_text(data[mime]), subs))
            if not data: continue
            o["metadata"] = {k: v for k, v in o.get("metadata", {}).items() if k in data and k.startswith("image/")}
        elif kind == "error":
            o["traceback"] = [clean_text(t, subs) for t in o.get("traceback", [])]
        kept.append(o)
    return kept

# ---------------------------------------------------------------- running one notebook
def execute(src: Path, skip_flags: list[str] | None = None, cell_timeout: int = 600, root: Path = ROOT, log=lambda *_: None):
    """The notebook as nbdev processes it (directives parsed), run from its own folder as nbdev-test runs it, with
    cleaned outputs on the cells that ran; raises RuntimeError naming the failing cell."""
    from execnb.shell import CaptureShell
    from fastcore.xtras import working_directory
    from nbdev.config import get_config
    from nbdev.process import NBProcessor
    from nbdev.test import _skip_cell
    src = Path(src).resolve()
    skip_flags = get_config(root).tst_flags.split() if skip_flags is None else skip_flags
    nb = NBProcessor(src, rm_directives=False, process=True).nb
    skip = _skip_cell(nb, skip_flags)
    for c in nb.cells:
        if not skip(c): c.outputs = []                                 # cells that run get fresh outputs only
    prev = os.environ.get("IN_TEST")
    os.environ["IN_TEST"] = "1"                                        # what notebooks see under nbdev-test
    shell = CaptureShell(src, mpl_format="png")
    try:
        shell.run(SETUP)
        with working_directory(src.parent):
            shell.run_all(nb, exc_stop=True, preproc=skip, cell_timeout=cell_timeout)
    except Exception as e:
        raise RuntimeError(f"{rel(src, root)}: a cell failed:\n{shell.prettytb(fname=src) or e}") from None
    finally:
        shell.close()
        if prev is None: os.environ.pop("IN_TEST", None)
        else: os.environ["IN_TEST"] = prev
    subs = scrubbers(root)
    for c in nb.cells:
        if c.cell_type == "code" and not skip(c): c.outputs = clean_outputs(c.get("outputs", []), subs, log)
    return nb

def nbdev_clean(nb: dict, root: Path = ROOT) -> dict:
    "nbdev's own cleaning with the project's settings (what `nbdev-clean` does to a file)."
    from nbdev.clean import clean_nb
    from nbdev.config import get_config
    cfg = get_config(root)
    clean_nb(nb, cfg.clear_all, cfg.get("allowed_metadata_keys") or [], cfg.get("allowed_cell_metadata_keys") or [],
             cfg.clean_ids, cfg.get("allowed_out_metadata_keys") or [])
    return nb

def write_notebook(path: Path, nb: dict):
    "Write as `nbdev-clean` writes (fastcore's format), so a later `nbdev-clean` changes nothing."
    from fastcore.nbio import write_nb
    write_nb(nb, path)

def save_outputs(src: Path, ran, root: Path = ROOT) -> dict:
    "Copy the outputs of the executed notebook `ran` into the file `src` (matched by cell id), record the fingerprint."
    raw = read_json(src)
    by_id = {c.get("id"): c for c in ran.cells if c.get("id")}
    code = [c for c in raw["cells"] if c["cell_type"] == "code"]
    ran_code = [c for c in ran.cells if c.cell_type == "code"]
    for i, c in enumerate(code):
        r = by_id.get(c.get("id")) or (ran_code[i] if len(ran_code) == len(code) else None)
        if r is None: raise RuntimeError(f"{rel(src, root)}: cell {c.get('id')} not found in the executed notebook")
        c["outputs"] = [json.loads(json.dumps(o)) for o in r.get("outputs", [])]
        c["execution_count"] = None
    raw.setdefault("metadata", {})[META_KEY] = {"source_fingerprint": fingerprint(raw, root)}
    nbdev_clean(raw, root)
    write_notebook(src, raw)
    return raw

def run_one(src: Path, root: Path = ROOT) -> float:
    "Execute `src` and save its outputs; returns seconds taken."
    t0 = time.time()
    ran = execute(src, root=root, log=lambda m: print(f"{rel(src, root)}: {m.strip()}", file=sys.stderr))
    save_outputs(src, ran, root)
    return time.time() - t0

# ---------------------------------------------------------------- many notebooks, each in its own process
def _run_in_subprocess(src: Path, root: Path) -> tuple[Path, int, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("IN_TEST", None)
    t0 = time.time()
    res = subprocess.run([sys.executable, __file__, "--one", str(src), "--root", str(root)], env=env,
                         capture_output=True, text=True)
    return src, res.returncode, time.time() - t0, (res.stdout + res.stderr).strip()

def run_many(notebooks: list[Path], jobs: int = 2, root: Path = ROOT, log=print) -> list[Path]:
    "Run each notebook in its own process, `jobs` at a time; returns those that failed."
    failed = []
    with ThreadPoolExecutor(max(1, jobs)) as ex:
        for src, rc, dt, out in ex.map(lambda p: _run_in_subprocess(p, root), notebooks):
            log(f"{'ok    ' if rc == 0 else 'FAILED'} {rel(src, root)}  ({dt:.1f} s)")
            if out and (rc or "dropped" in out): log("  " + out[-6000:].replace("\n", "\n  "))
            if rc: failed.append(src)
    return failed

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="notebooks to run (default: all in nbs/ and tutorials/)")
    ap.add_argument("--stale", action="store_true", help="run only notebooks whose outputs are stale or missing")
    ap.add_argument("--check", action="store_true", help="only list stale notebooks; exit 1 if there are any")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="notebooks run at a time (default 2)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    root = Path(a.root).resolve()
    if a.one:
        try: run_one(Path(a.one), root)
        except RuntimeError as e: print(e, file=sys.stderr); return 1
        return 0
    nbs = [Path(p).resolve() for p in a.notebooks] or all_notebooks(root)
    if a.check or a.stale:
        stale = [(p, why) for p in nbs if (why := staleness(p, root))]
        if a.check:
            for _, why in stale: print(why)
            return 1 if stale else 0
        nbs = [p for p, _ in stale]
    t0 = time.time()
    failed = run_many(nbs, a.jobs, root)
    print(f"ran {len(nbs)} notebook(s) in {time.time() - t0:.0f} s; {len(failed)} failed"
          + (": " + " ".join(rel(p, root) for p in failed) if failed else ""))
    return 1 if failed else 0

if __name__ == "__main__": sys.exit(main())
