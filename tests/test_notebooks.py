"""Run every notebook (library notebooks in nbs/ and the tutorials) the way `nbdev-test` does, one pytest test each,
so CI prints pytest's summary. Cells flagged with the project's `tst_flags` (gpu, weights, notest) are skipped.

Each notebook runs in its own process, like nbdev-test's workers: a notebook's tensors and models are freed when it
ends, so the suite's memory stays that of the largest notebook, not the sum. The processes are forked from one that
has imported the heavy third-party libraries once (torch, IPython, nbdev, matplotlib...: about 5 s of CPU per
notebook otherwise, 80 notebooks); nothing of `cascade_nb` is imported there, so each notebook imports the package
as a fresh process would."""
import json, os, select, signal, subprocess, sys, tempfile
from pathlib import Path
import pytest
from nbdev.config import get_config
from conftest import ROOT, tool

NOTEBOOKS = tool("build_docs").all_notebooks(ROOT)   # the same list the docs site is built from
TIMEOUT_S = 900

# reads one JSON line per notebook: [notebook, skip flags, base path, stdout file, stderr file]; answers the forked
# child's pid, then its exit status (0: every cell ran)
FORK_SERVER = """import json, os, sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot, numpy, torch, PIL.Image, IPython, execnb.shell, fastcore.test, nbdev.test
for line in sys.stdin:
    nb, skip, base, out, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(os.path.dirname(nb))
            # the server's requests stay its own: the notebook (and what it runs) reads nothing from them
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, out), (2, err)): os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
            ok, _ = nbdev.test.test_nb(nb, skip_flags=skip.split(), basepath=base, showerr=True)
            code = 0 if ok else 1
        finally:
            sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

@pytest.fixture(scope="module")
def fork_server():
    env = {k: v for k, v in os.environ.items() if k != "IN_TEST"}
    proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    yield proc
    proc.stdin.close(); proc.wait(timeout=60)

def _line(proc, timeout: float) -> str | None:
    "The fork server's next line, or None after `timeout` seconds."
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else None

def run_notebook(server, nb: Path) -> tuple[int, str, str]:
    "(exit status, stdout, stderr) of running notebook `nb` in a child of the fork server."
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp)/"out", Path(tmp)/"err"
        out.touch(); err.touch()
        server.stdin.write(json.dumps([str(nb), get_config(ROOT).tst_flags, str(ROOT), str(out), str(err)]) + "\n")
        server.stdin.flush()
        pid = int(_line(server, 60))
        status = _line(server, TIMEOUT_S)
        if status is None:                                     # too slow: stop it, as subprocess.run's timeout did
            os.kill(pid, signal.SIGKILL); _line(server, 60)
            pytest.fail(f"{nb.name} did not finish in {TIMEOUT_S} s")
        return int(status), out.read_text(errors="replace"), err.read_text(errors="replace")

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_notebook(nb, fork_server):
    code, out, err = run_notebook(fork_server, nb)
    assert code == 0, f"{nb.name} failed:\n{err[-6000:]}\n{out[-2000:]}"

def test_a_failing_notebook_fails_its_test(fork_server, tmp_path):
    "A cell that raises makes the notebook's test fail with the error, and the next notebook still runs."
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "a1", "metadata": {}, "outputs": [],
                     "source": ["raise ValueError('planted failure')"]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path/"bad.ipynb").write_text(json.dumps(nb))
    code, out, err = run_notebook(fork_server, tmp_path/"bad.ipynb")
    assert code == 1 and "planted failure" in err + out
    nb["cells"][0]["source"] = ["import os; x = 1 + 1"]
    (tmp_path/"good.ipynb").write_text(json.dumps(nb))
    assert run_notebook(fork_server, tmp_path/"good.ipynb")[0] == 0

def test_found_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert "00_core.ipynb" in names and "01_config.ipynb" in names and "index.ipynb" in names
