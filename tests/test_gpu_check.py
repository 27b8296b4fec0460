"""bench/gpu_check.py --dry-run: every measurement of the prepared GPU check runs at tiny size on CPU and prints its line,
so the script is known to work before the few minutes of GPU time it is written for."""
from conftest import ROOT, run_cli

def test_gpu_check_dry_run_prints_every_measurement():
    res = run_cli(ROOT / "bench" / "gpu_check.py", "--dry-run", env={"OMP_NUM_THREADS": "1"}, timeout=1200)   # ~1 min of CPU
    lines = [l for l in res.stdout.splitlines() if l.startswith("gpu_check ")]
    for start in ("gpu_check step tiny eager", "gpu_check step tiny compiled", "gpu_check swap tiny 6 blocks swapped", "gpu_check memory tiny official, batch 1",
                  "gpu_check memory tiny checkpointing + 8-bit AdamW + bf16 weights", "gpu_check memory tiny LoRA r4",
                  "gpu_check sampling cascade", "gpu_check train demo through train() on cpu", "gpu_check done in"):
        assert any(l.startswith(start) for l in lines), (start, res.stdout[-3000:])
    assert sum(l.startswith("gpu_check memory") for l in lines) == 6
    step = [l for l in lines if l.startswith("gpu_check step")]
    assert all("images/s" in l and "MFU" in l for l in step)

def test_gpu_check_refuses_to_run_without_a_gpu():
    import torch
    if torch.cuda.is_available(): return
    res = run_cli(ROOT / "bench" / "gpu_check.py", check=False)
    assert res.returncode != 0 and "no CUDA device" in res.stderr
