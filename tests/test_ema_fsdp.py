"""The EMA under FSDP2 (issue 18 item 8), on 2 CPU processes (gloo) through the trainer: each process keeps only its
shards of the EMA and updates them without any communication, the released `generator_ema` equals an EMA of the
gathered weights, a killed run resumes to the same EMA, the checkpoint holds the EMA once (sharded, through
torch.distributed.checkpoint), and a run saved on 2 processes resumes on 3 with the same EMA."""
import json, re, shutil
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file
from conftest import ROOT, free_port, run_cli
from test_train import DRIVER, _launch_2proc, demo_args, info, weights, assert_identical

RUN = ["updates=4", "save_every=2", "batch_size=8"]   # EMA (TINY): copies at updates 1-2, beta 0.9 after

def launch(n, *args, check=True):
    return run_cli("-m", "accelerate.commands.launch", "--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml",
                   "--num_processes", str(n), "--main_process_port", str(free_port()), DRIVER, *args,
                   env={"OMP_NUM_THREADS": "1"}, check=check)

def lines(stdout, tag):
    return [json.loads(m) for m in re.findall(tag + r" (\{.*?\})", stdout)]

@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    "One uninterrupted 2-process FSDP run with the EMA probe and the memory report."
    tmp = tmp_path_factory.mktemp("ema_fsdp")
    res = _launch_2proc("--fsdp-cpu", "--report-memory", "--ema-probe", str(tmp / "reference.safetensors"),
                        *demo_args(tmp, "ref", *RUN))
    assert info(tmp, "ref")["update"] == 4, res.stdout[-3000:]
    return tmp, res.stdout

def test_ema_updates_make_no_collective_calls(ref):
    tmp, out = ref
    calls = lines(out, "ema-comms")
    assert sorted((c["rank"], c["call"]) for c in calls) == [(r, u) for r in (0, 1) for u in (1, 2, 3, 4)], calls
    assert all(c["comms"] == 0 for c in calls), calls   # before: one all-gather per parameter tensor per update

def test_each_process_holds_only_its_shards(ref):
    tmp, out = ref
    full = sum(v.numel() * v.element_size() for v in weights(tmp, "ref", "generator_ema").values())
    got = sorted((r["rank"], r["ema"]) for r in lines(out, "memory-report"))
    assert [r for r, _ in got] == [0, 1], out[-3000:]
    assert sum(b for _, b in got) == full                        # the shards add up to one EMA, nothing replicated
    assert all(b == pytest.approx(full / 2, rel=0.05) for _, b in got), (got, full)

def test_released_ema_equals_an_ema_of_the_gathered_weights(ref):
    tmp, _ = ref
    released, reference = weights(tmp, "ref", "generator_ema"), load_file(str(tmp / "reference.safetensors"))
    assert released.keys() == weights(tmp, "ref").keys() == reference.keys()   # the official layout, like generator
    assert_identical({k: v.float() for k, v in released.items()}, reference)
    assert not all(torch.equal(released[k], weights(tmp, "ref")[k]) for k in released)   # an average, not a copy

def test_checkpoint_holds_the_ema_once_sharded(ref):
    tmp, _ = ref
    state = tmp / "ckpt" / "ref" / info(tmp, "ref")["state_dir"]
    assert not (state / "ema.safetensors").exists()               # no full copy in the training state
    shards = sorted(p.name for p in (state / "ema").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    full = sum(v.numel() * v.element_size() for v in weights(tmp, "ref", "generator_ema").values())
    stored = sum((state / "ema" / n).stat().st_size for n in shards if n.endswith(".distcp"))
    assert full <= stored < 1.5 * full + 200_000, (stored, full)   # once (plus torch.save's per-tensor framing)

def test_killed_fsdp_run_resumes_to_the_same_ema(ref, tmp_path):
    tmp, _ = ref
    killed = _launch_2proc("--fsdp-cpu", "--kill-in-commit", "4", *demo_args(tmp_path, "res", *RUN), check=False)
    assert killed.returncode != 0 and info(tmp_path, "res")["update"] == 2
    _launch_2proc("--fsdp-cpu", *demo_args(tmp_path, "res", *RUN))
    assert info(tmp_path, "res")["update"] == 4
    assert_identical(weights(tmp_path, "res"), weights(tmp, "ref"))
    assert_identical(weights(tmp_path, "res", "generator_ema"), weights(tmp, "ref", "generator_ema"))

def test_resume_on_another_process_count_reshards_the_ema(ref, tmp_path):
    """Saved on 2 processes, resumed on 3 (as the model and optimizer shards, through torch.distributed.checkpoint):
    update 5 makes no EMA step (ema_iters=2), so the released EMA is update 4's, gathered from 3 uneven shards."""
    tmp, _ = ref
    for d in ("ckpt", "out"): shutil.copytree(tmp / d / "ref", tmp_path / d / "wide")
    res = launch(3, "--fsdp-cpu", *demo_args(tmp_path, "wide", "updates=5", "save_every=5", "batch_size=12", "ema_iters=2"))
    assert info(tmp_path, "wide")["update"] == 5 and info(tmp_path, "wide")["num_processes"] == 3, res.stdout[-2000:]
    assert "resuming a run saved with 2 process(es) on 3" in res.stderr
    assert_identical(weights(tmp_path, "wide", "generator_ema"), weights(tmp, "ref", "generator_ema"))
