"""The package's import graph, read from the source (module-level and function-level imports alike): no cycles, and
no module imports one whose notebook comes later in the reading order (nbs/NN_*.ipynb sorted by name)."""
import ast, re
from pathlib import Path
from conftest import ROOT

PKG = ROOT / "cascade_nb"

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

MODULES = {module_name(p): p for p in PKG.rglob("*.py") if p.name != "_modidx.py"}

def imports_of(name: str) -> set[str]:
    "Every cascade_nb module `name` imports anywhere in its source (functions included)."
    path, out = MODULES[name], set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import): targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else: continue
        for t in targets:
            while t and t not in MODULES: t = t.rpartition(".")[0]   # `import cascade_nb.x.y as z` → the module
            if t and t != name and t != "cascade_nb": out.add(t)
    return out

GRAPH = {m: imports_of(m) for m in MODULES}

def find_cycle(graph):
    state, stack = {}, []
    def visit(m):
        state[m] = "open"; stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open": return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)): return c
        state[m] = "done"; stack.pop()
    for m in sorted(graph):
        if m not in state and (c := visit(m)): return c

def test_graph_sees_function_level_imports():
    assert "cascade_nb.models.stage_c" in GRAPH["cascade_nb.modes"]   # imported inside build_generator only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]

def test_no_import_cycles():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))

def notebook_of(name: str) -> str | None:
    "The notebook a module is exported from (its 'File to edit' header), or None for hand-written modules."
    m = re.search(r"File to edit: (?:\.\./)+nbs/(\S+)\.ipynb", MODULES[name].read_text()[:2000])
    return m.group(1) if m else None

def test_reading_order_is_import_order():
    late = [(m, n) for m, deps in GRAPH.items() for n in deps
            if notebook_of(m) and notebook_of(n) and notebook_of(n) > notebook_of(m)]
    assert not late, "modules importing a later notebook's module: " + ", ".join(
        f"{m} ({notebook_of(m)}) -> {n} ({notebook_of(n)})" for m, n in late)

CONFIG_ALONE = """
import json, sys
from pathlib import Path
def loaded(): return sorted(m for m in sys.modules if m.startswith("cascade_nb"))
import cascade_nb.config as config
at_import, out = loaded(), {}
for path in sorted(Path("configs").glob("*.yaml")):
    try: cfg = config.load_config(path, ["webdataset_path=data_samples/emoji"]); out[path.name] = cfg.train.mode
    except config.ConfigError as e: out[path.name] = "error: " + str(e)
print(json.dumps({"at_import": at_import, "at_load": loaded(), "configs": out}))
"""

def test_config_imports_no_later_module_at_import_and_loads_the_built_in_parts_at_load():
    """`import cascade_nb.config` loads no module of a later notebook (nor torch); `load_config` imports the built-in
    parts through the one list (`BUILTIN_PARTS`), so every shipped config resolves its mode in a process that imported
    only the config, as in any command."""
    import json, subprocess, sys
    from cascade_nb.registry import BUILTIN_PARTS
    res = subprocess.run([sys.executable, "-c", CONFIG_ALONE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    late = lambda names: [m for m in names if m in MODULES and notebook_of(m) and notebook_of(m) > notebook_of("cascade_nb.config")]
    assert not late(got["at_import"]), late(got["at_import"])
    assert set(BUILTIN_PARTS) <= set(got["at_load"]), set(BUILTIN_PARTS) - set(got["at_load"])
    assert got["configs"] == {"controlnet_demo.yaml": "controlnet", "controlnet_images_demo.yaml": "controlnet",
                              "demo.yaml": "full", "dmd_demo.yaml": "dmd", "lcm_demo.yaml": "lcm",
                              "lora_demo.yaml": "lora"}

def test_every_module_that_registers_a_built_in_part_is_in_the_one_list():
    "A module of the package that registers parts (a decorator or `registry(...)` at module level) is in BUILTIN_PARTS."
    from cascade_nb.registry import BUILTIN_PARTS
    registers = re.compile(r"^(?:@\w*(?:register\w*|training_mode|config_section)\b|\w+ = registry\(|"
                           r"register_\w+\(\s*\"|REPORTS\[|SELECTION_RULES\[)", re.M)
    loaded = set(GRAPH_CLOSURE(BUILTIN_PARTS))
    missing = [m for m, p in MODULES.items() if registers.search(p.read_text()) and m not in loaded
               and m not in ("cascade_nb.registry", "cascade_nb.config", "cascade_nb.typed_yaml", "cascade_nb.filters")]
    assert not missing, f"modules registering parts that BUILTIN_PARTS does not load: {missing}"

def GRAPH_CLOSURE(roots):
    "The modules `roots` import, directly or not (themselves included)."
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m in seen or m not in GRAPH: continue
        seen.add(m); todo += GRAPH[m]
    return seen

# the diffusion maths' own helpers: seeded draws and broadcasting (core), the registries (registry: also ConfigError,
# the one error a bad name raises), the typed values a knob's range is written in (typed_yaml: Range, Choice)
GDF_MAY_IMPORT = {"cascade_nb.core", "cascade_nb.registry", "cascade_nb.typed_yaml"}

def test_gdf_imports_nothing_of_the_trainer():
    """`cascade_nb.gdf` is the diffusion maths (issue 45): it imports only itself and the helpers above, never the
    trainer's config, modes or loop. The trainer's side of its knobs (the `recipe` section) is `recipe_config`."""
    gdf = [m for m in GRAPH if m == "cascade_nb.gdf" or m.startswith("cascade_nb.gdf.")]
    assert len(gdf) >= 9, gdf
    out = {m: sorted(n for n in GRAPH[m] if not n.startswith("cascade_nb.gdf") and n not in GDF_MAY_IMPORT)
           for m in gdf}
    assert not any(out.values()), {m: n for m, n in out.items() if n}
    # and what they may import leans on nothing else of the package either
    assert all(GRAPH[m] <= GDF_MAY_IMPORT for m in GDF_MAY_IMPORT), {m: GRAPH[m] for m in GDF_MAY_IMPORT}
