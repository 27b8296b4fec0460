"""One RNG rule for the whole package (see `core`'s "Random draws: one rule"): generators are CPU generators, and only
core's `seeded_*` helpers pass `generator=` to a random function (they draw where the generator lives and move the
result to the device that needs it). A draw like `torch.rand(n, generator=g)` with a CUDA generator, or
`torch.randn(..., generator=g, device=cuda)` with a CPU one, crashes on the first GPU step; these scans find them on CPU."""
import ast
from pathlib import Path
from conftest import ROOT

PACKAGE = ROOT / "cascade_nb"
HELPERS = {("core.py", "seeded_randn"), ("core.py", "seeded_rand"), ("core.py", "seeded_multinomial")}

def _calls(path: Path):
    "(function name the call is in, call node) for every call in a module."
    tree = ast.parse(path.read_text(), str(path))
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call): yield fn, child
            yield from walk(child, name)
    yield from walk(tree, None)

def _sources(): return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_modidx.py")

def test_random_draws_go_through_the_helpers():
    offenders = []
    for path in _sources():
        rel = path.relative_to(PACKAGE).as_posix()
        for fn, call in _calls(path):
            if any(k.arg == "generator" for k in call.keywords) and (rel, fn) not in HELPERS:
                callee = ast.unparse(call.func)
                if callee.startswith("torch.") or isinstance(call.func, ast.Attribute) and call.func.attr.endswith("_"):
                    offenders.append(f"cascade_nb/{rel}:{call.lineno}: {ast.unparse(call)[:100]}")
    assert not offenders, "random draws with generator= outside core's seeded_* helpers:\n" + "\n".join(offenders)

def test_every_generator_the_package_makes_is_a_cpu_generator():
    offenders = []
    for path in _sources():
        for _, call in _calls(path):
            if ast.unparse(call.func) in ("torch.Generator", "Generator"):
                args = [*call.args, *(k.value for k in call.keywords if k.arg == "device")]
                if any(not (isinstance(a, ast.Constant) and a.value == "cpu") for a in args):
                    offenders.append(f"cascade_nb/{path.relative_to(PACKAGE).as_posix()}:{call.lineno}: {ast.unparse(call)}")
    assert not offenders, "generators made on a device (draws then depend on it, and CPU-side draws crash):\n" + "\n".join(offenders)

def test_the_scan_sees_a_bad_draw(tmp_path, monkeypatch):
    "The scans are not vacuous: a module with a direct draw and a device generator is caught, with file and line."
    global PACKAGE
    (tmp_path / "bad.py").write_text("import torch\ndef f(g, x):\n    g = torch.Generator(x.device)\n"
                                     "    return torch.randn(3, generator=g, device=x.device)\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path)
    for check, line in ((test_random_draws_go_through_the_helpers, "bad.py:4"),
                        (test_every_generator_the_package_makes_is_a_cpu_generator, "bad.py:3")):
        try: check()
        except AssertionError as e: assert line in str(e), str(e)
        else: raise AssertionError(f"{check.__name__} missed the bad draw")
