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


def test_memory_attribution_sees_every_phase_and_accounts_for_its_peak(tmp_path):
    """bench/memory_attribution.py (the rehearsal's `attribute` step) on the demo started from a weights file, 2
    updates: every phase of the loop is labelled (a renamed loop function would leave the hour-long real-size run
    blind), the bytes it finds live at torch's allocation peak add up to that peak (the generator's storages over the
    memory-mapped file are reported too but torch does not count them: counting them put the sum the file's size
    above the peak),
    and the peak holds at least the generator's gradients and AdamW moments."""
    from safetensors.torch import save_file
    from cascade_nb.config import load_config
    from cascade_nb.models.stage_c import StageC
    out, config, weights = tmp_path / "attribution.json", ROOT / "configs" / "demo.yaml", tmp_path / "gen.safetensors"
    overrides = ["updates=2", f"checkpoint_path={tmp_path}/runs", f"output_path={tmp_path}/outputs", "num_workers=0",
                 f"generator_checkpoint_path={weights}"]
    m = load_config(config, overrides).model
    generator = StageC.from_preset(m.model_version, **m.model_overrides)
    save_file({k: v.contiguous() for k, v in generator.state_dict().items()}, weights)
    subprocess.run([sys.executable, "bench/memory_attribution.py", "--out", str(out), str(config), *overrides],
                   cwd=ROOT, check=True, capture_output=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                                     "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    a = json.loads(out.read_text())
    assert {"build", "encode", "forward", "backward", "grad_norm", "optimizer_step", "save"} <= {
        r["phase"] for r in a["phases"]}
    assert len(a["update_s"]) == 2
    live = sum(a["live_at_peak_by_phase"].values())
    assert abs(live - a["peak_allocated"]) < 1e-3 * a["peak_allocated"], (live, a["peak_allocated"])
    assert a["peak_allocated"] >= 3 * 4 * sum(p.numel() for p in generator.parameters())
