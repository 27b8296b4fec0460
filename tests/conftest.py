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

# ---- running under pytest-xdist (`pytest -n auto`, the README's command; pyproject sets --dist loadfile)
# Each worker is its own process and takes whole test files, so a module-scoped fixture (a training run, a built docs
# site) is built once. (xdist_group marks with --dist loadgroup would be finer, but with pytest-xdist 3.8 and pytest 9.2
# they did not group here: marked tests still went to both workers and their fixtures were built twice, measured.)
# Workers take files in collection order, so the files whose tests launch training runs or notebooks go first: the run
# then ends on short files instead of one worker finishing a long one while the other idles.
LONG_FIRST = ("test_shipped_configs.py", "test_notebooks.py", "test_nothing_lost.py", "test_train.py", "test_train_state.py", "test_docs.py", "test_signals.py", "test_distill.py",
              "test_compile.py", "test_memory_fsdp.py", "test_ema_fsdp.py", "test_resolution.py", "test_rundir.py", "test_lora_train.py",
              "test_controlnet_train.py", "test_fidelity_train.py", "test_eval.py", "test_gpu_check.py")

def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))   # stable: the order inside a file is kept
