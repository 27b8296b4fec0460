"""What bench/real_size.py found at the official sizes, caught here at a size a test can afford: saving a weights
file or loading it in another dtype must not hold a second copy of the tensors (at 3.6B parameters that copy was
7-14 GB). Each measurement runs in a fresh process and compares its peak resident memory (`ru_maxrss`) after the save or
load with the peak before it: a high-water mark, so library pages that a busy machine evicts and the process reads
back (they count in the resident size too) do not show as growth."""
import json, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20

PEAK = """
import json, resource, sys, torch
from cascade_nb.core import save_safetensors_atomic, load_safetensors_strict
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
path, what = sys.argv[1], sys.argv[2]
# 48 tensors of 4 MB in bf16 (192 MB), the shape of a model's weights
if what == "save":
    tensors = {f"w{i}.weight": torch.randn(1024, 2048).bfloat16() for i in range(48)}
    before = peak(); save_safetensors_atomic(tensors, path)
else:
    model = torch.nn.ModuleDict({f"w{i}": torch.nn.Linear(2048, 1024, bias=False, device="meta") for i in range(48)})
    before = peak(); load_safetensors_strict(model, path, torch.float32)
    [p.sum() for p in model.parameters()]
print(json.dumps(dict(before=before, peak=peak())))
"""


def measure(what: str, path: Path) -> int:
    "Bytes above what the process held before the save or load, at its peak."
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), what], capture_output=True, text=True, cwd=ROOT,
                         check=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["peak"] - r["before"]


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("w") / "w.safetensors"
    measure("save", path)
    return path


def test_saving_holds_no_copy_of_the_tensors(weights_file):
    "192 MB of bf16 tensors saved: at most a few MB above what the process held (safetensors.torch.save: +384 MB)."
    assert weights_file.stat().st_size > 190 * MB
    assert measure("save", weights_file) < 40 * MB


def test_loading_with_a_cast_holds_the_result_and_one_tensor(weights_file):
    """The 192 MB bf16 file loaded as float32 (384 MB) and every weight read: the result plus a few tensors (a cast of
    the memory-mapped dict held the 192 MB source too)."""
    assert measure("load", weights_file) < 384 * MB + 60 * MB
