"""Regional compilation (`compile: true` → `compile_blocks`) through the trainer on CPU: a compiled run trains, saves,
is killed inside a save and resumes to the same losses and weights as an eager run within float tolerance, and the
log carries compile and step times. (Inductor compiles on CPU too: the first update pays the compile time.)"""
import json, signal
import pytest, torch
from conftest import run_cli
from test_train import DRIVER, demo_args, info, weights

def metric_rows(tmp, name):
    rows = [json.loads(l) for l in (tmp / "out" / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]

def test_compiled_run_trains_saves_and_resumes_like_eager(tmp_path):
    run = ["updates=4", "save_every=2", "batch_size=4", "lr=1e-3"]
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}   # no compile worker pool on a small CI machine
    run_cli(DRIVER, *demo_args(tmp_path, "eager", *run))
    res = run_cli(DRIVER, "--kill-in-commit", "4", *demo_args(tmp_path, "comp", *run, "compile=true"), env=env, check=False)
    assert res.returncode == -signal.SIGKILL and info(tmp_path, "comp")["update"] == 2, res.stdout[-3000:] + res.stderr[-3000:]
    run_cli(DRIVER, *demo_args(tmp_path, "comp", *run, "compile=true"), env=env)  # resumes at update 2 from the sharded state
    assert info(tmp_path, "comp")["update"] == 4
    eager = {r["update"]: r["loss"] for r in metric_rows(tmp_path, "eager")}
    rows = metric_rows(tmp_path, "comp")
    resumed = {r["update"]: r["loss"] for r in rows}                             # later rows (the resumed process) win
    assert sorted(resumed) == sorted(eager) == [1, 2, 3, 4]
    for u in eager: assert resumed[u] == pytest.approx(eager[u], rel=1e-3, abs=1e-5), (u, resumed[u], eager[u])
    a, b = weights(tmp_path, "comp"), weights(tmp_path, "eager")
    assert a.keys() == b.keys()                                                    # no _orig_mod. or other prefixes
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-3
    assert all(r["compile_time_s"] > 0 and r["step_time_s"] > 0 for r in rows)   # both appear in the log
    assert "compile_time_s" not in metric_rows(tmp_path, "eager")[0]

@pytest.mark.parametrize("setup", ["ddp_lora", "fsdp"])
def test_compiled_blocks_compose_with_ddp_lora_and_fsdp(tmp_path, setup):
    """Regional compile after wrapping, on 2 processes: DDP with LoRA adapters, and FSDP2 with the EMA; each trains to
    the eager run's losses and weights within float tolerance."""
    from test_train import _launch_2proc
    extra = {"ddp_lora": ["mode=lora", "module_filters=[.attn]", "rank=2"], "fsdp": []}[setup]
    flags = ["--fsdp-cpu"] if setup == "fsdp" else []
    run = ["updates=2", "save_every=2", "batch_size=8", "lr=1e-3", *extra]
    _launch_2proc(*flags, *demo_args(tmp_path, "eager", *run))
    _launch_2proc(*flags, *demo_args(tmp_path, "comp", *run, "compile=true"))
    eager = {r["update"]: r["loss"] for r in metric_rows(tmp_path, "eager")}
    comp = {r["update"]: r["loss"] for r in metric_rows(tmp_path, "comp")}
    assert sorted(comp) == sorted(eager) == [1, 2]
    for u in eager: assert comp[u] == pytest.approx(eager[u], rel=1e-3, abs=1e-5), (u, comp[u], eager[u])
    which = "lora" if setup == "ddp_lora" else "generator"
    a, b = weights(tmp_path, "comp", which), weights(tmp_path, "eager", which)
    assert a.keys() == b.keys() and max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-3
    assert all(r["compile_time_s"] > 0 for r in metric_rows(tmp_path, "comp"))
