"Shared pytest setup: repository paths, quiet threads, and helpers to run the package's CLIs and load tools/ scripts."
import importlib.util, os, socket, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two cores: keep test subprocesses from oversubscribing

@pytest.fixture
def root(): return ROOT

def tool(name: str):
    "The script tools/{name}.py imported as a module (tools/ is not a package)."
    if name in sys.modules: return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

def run_cli(*args, cwd=ROOT, env=None, timeout=600, check=True):
    "Run `python args...` in a subprocess with the repo's interpreter; return the CompletedProcess."
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("IN_TEST", None)
    res = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"command failed ({res.returncode}): {' '.join(map(str, args))}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}")
    return res

def free_port() -> int:
    "A port no one listens on now (other test runs may launch multi-process jobs at the same time: no fixed port)."
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0)); return sock.getsockname()[1]

# ---- running under pytest-xdist (`pytest -n auto`, the README's command; pyproject sets --dist loadgroup)
# Each worker is its own process. Tests that share a module-scoped fixture (a training run, a built docs site) are
# sent to one worker, so the fixture is built once, not once per worker that happens to get one of them.
# The workers take the other tests in collection order, so the files whose tests each launch training runs or
# notebooks go first: the run then ends on short tests instead of one worker finishing a long one while the other idles.
# Files whose tests each run notebooks, training subprocesses or a browser (the slowest of the last serial run: a
# notebook 74 s, the lr test 63 s, the browser check 47 s, FSDP resume 41 s, compile 39 s); the rest keep their order.
LONG_FIRST = ("test_notebooks.py", "test_train_state.py", "test_train.py", "test_signals.py", "test_compile.py",
              "test_memory_fsdp.py", "test_gpu_check.py", "test_lora_train.py", "test_controlnet_train.py", "test_eval.py", "test_rundir.py",
              "test_distill.py", "test_resolution.py")

def _module_fixtures(item) -> list[str]:
    "Names of the module-scoped fixtures defined in the item's own test file that the item uses (directly or not)."
    info = getattr(item, "_fixtureinfo", None)
    if info is None: return []   # not a python test function
    return sorted(name for name, defs in info.name2fixturedefs.items()
                  if defs and defs[-1].scope == "module" and Path(defs[-1].baseid or ".").name == item.path.name)

@pytest.hookimpl(tryfirst=True)   # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if shared := _module_fixtures(item): item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}.{'+'.join(shared)}"))
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))   # stable: the order inside a file is kept
