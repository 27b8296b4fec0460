"""What a run's state depends on, across processes and resumes: the lr (and EMA beta, cadence) is a function of the
update count only, whatever the process count and accumulation; every rank resumes its own random stream; a checkpoint
folder never runs pickled code; validation agrees on every rank."""
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from conftest import ROOT, run_cli, free_port
from test_train import DRIVER, demo_args, info, _launch_2proc as launch_2proc, resumes_to_the_killed_state

def metrics(tmp, name):
    return [json.loads(l) for l in (Path(tmp) / "out" / name / "metrics.jsonl").read_text().splitlines()]

def launch_2machines(*args):
    "Two machines of one process each over the loopback address: accelerate's multi-node launch, machine_rank 0 and 1."
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("IN_TEST", None)
    cmd = lambda rank: [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        str(ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"), "--num_machines", "2", "--num_processes", "2",
                        "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                        str(DRIVER), *map(str, args)]
    procs = [subprocess.Popen(cmd(r), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)

def test_lr_and_ema_beta_depend_on_updates_only(tmp_path):
    """1 process, 1 process with grad_accum_steps=2, 2 processes on one machine with grad_accum_steps=2, and 2 machines of
    one process each: the same lr, EMA beta and save cadence at every update. (2 processes without accumulation are the
    2 machines' case: the same world size, only the launch differs; one launch of each kind is enough.)"""
    run = ["updates=6", "save_every=3", "batch_size=8", "warmup_updates=3", "lr_schedule=cosine", "ema_start_iters=2"]
    runs = {"p1": lambda n: run_cli(DRIVER, *demo_args(tmp_path, n, *run)),
            "p1_acc2": lambda n: run_cli(DRIVER, *demo_args(tmp_path, n, *run, "grad_accum_steps=2")),
            "p2_acc2": lambda n: launch_2proc(*demo_args(tmp_path, n, *run, "grad_accum_steps=2")),
            "2machines": lambda n: launch_2machines(*demo_args(tmp_path, n, *run))}
    logged = {}
    for name, go in runs.items():
        go(name)
        rows = [r for r in metrics(tmp_path, name) if "lr" in r]
        logged[name] = [(r["update"], r["lr"], r["ema_beta"], r["samples_seen"]) for r in rows]
        assert info(tmp_path, name)["update"] == 6
    # warm-up 1/3, 2/3, 1, then cosine decay; the EMA copies the weights up to update 2 (ema_start_iters) and averages after it
    expected_lr = [1e-3 * f for f in (1 / 3, 2 / 3, 1.0, 1.0, 0.75, 0.25)]
    assert [l for _, l, _, _ in logged["p1"]] == pytest.approx(expected_lr)
    assert [b for *_, b, _ in logged["p1"]] == [0.0, 0.0, 0.9, 0.9, 0.9, 0.9]
    assert [s for *_, s in logged["p1"]] == [8 * u for u in range(1, 7)]
    for name in runs: assert logged[name] == logged["p1"], name

def test_two_process_resume_keeps_each_rank_stream(tmp_path):
    "After a 2-process resume each rank continues its own random stream: the same state as the uninterrupted run."
    # the state committed after the resume is the killed process's own, rng_0 and rng_1 included: each rank's stream
    # after the resumed updates is where the uninterrupted run's is (before the fix both ranks restored rank 0's)
    run = ["updates=4", "save_every=2", "batch_size=8"]
    resumes_to_the_killed_state(tmp_path / "ckpt" / "res", demo_args(tmp_path, "res", *run), launch=launch_2proc)
    from safetensors.torch import load_file
    state = tmp_path / "ckpt" / "res" / info(tmp_path, "res")["state_dir"]
    r0, r1 = (load_file(str(state / f"rng_{i}.safetensors"))["state"] for i in (0, 1))
    assert not torch.equal(r0, r1)                       # one stream per rank, both in the checkpoint
    # the losses of updates 3 and 4 (the mean over both ranks), logged by the killed process and again after the resume
    losses = [(r["update"], r["loss"]) for r in metrics(tmp_path, "res") if "loss" in r]
    assert [u for u, _ in losses] == [1, 2, 3, 4, 3, 4] and losses[2:4] == losses[4:], losses

PLANT = r'''
import os, pickle, shutil, sys, torch
from pathlib import Path
from cascade_nb.config import load_config
from cascade_nb.train import train
args, run, marker = sys.argv[1:-2], Path(sys.argv[-2]), Path(sys.argv[-1])
class Evil:
    def __reduce__(self): return (os.makedirs, (str(marker),))
state = run / next(p.name for p in run.iterdir() if p.name.startswith("state-"))
names = sorted(p.name for p in state.iterdir()) + ["custom_checkpoint_0.pkl"]
for i, name in enumerate(names):
    copy = run.with_name(f"planted{i}"); shutil.copytree(run, copy)
    target = copy / state.name / name
    if name.endswith((".bin", ".pt")): torch.save(Evil(), target)        # torch's zip format, as accelerate writes
    else: target.write_bytes(pickle.dumps(Evil()))
    try: train(load_config(args[0], [*args[1:], f"experiment_id=planted{i}"]))
    except RuntimeError as e: print(f"{name}: refused: {e}", flush=True)
    else: print(f"{name}: resumed", flush=True)
    assert not marker.exists(), f"unpickling {name} ran code"
'''

def test_planted_pickles_never_run(tmp_path):
    "A malicious pickle in any file a resume reads never runs: the resume refuses, naming the file."
    run_cli(DRIVER, *demo_args(tmp_path, "run", "updates=2", "save_every=2"))
    state = {p.name for p in (tmp_path / "ckpt" / "run" / info(tmp_path, "run")["state_dir"]).iterdir()}
    assert not any(n.startswith("custom_checkpoint") for n in state)   # nothing of ours is pickled
    assert {"train_state.json", "gdf.safetensors", "ema.safetensors", "rng_0.safetensors"} <= state
    marker = tmp_path / "pwned"
    res = run_cli("-c", PLANT, *demo_args(tmp_path, "x", "updates=3"), tmp_path / "ckpt" / "run", marker)
    lines = [l for l in res.stdout.splitlines() if ": refused: " in l or ": resumed" in l]
    assert len(lines) == len(state) + 1, res.stdout[-3000:]
    for l in lines:
        name = l.split(":")[0]
        # the only state is refused: RunDir.resume has no previous one to fall back to and names the refused file
        assert ": refused: cannot resume from " in l and "resume: refusing" in l and f"{name}" in l.split("refused: ", 1)[1], l
    assert not marker.exists()

def test_validation_on_two_processes_with_one_shard(tmp_path):
    "One validation tar, two processes: every process validates on the same batches and they agree on the best weights."
    shards = ROOT / "data_samples" / "emoji"
    launch_2proc(*demo_args(tmp_path, "val2", "updates=2", "save_every=2", "val_every=1", "batch_size=8",
                            f"val_webdataset_path={shards}/shard-000005.tar", "val_batches=1"))
    vals = [r for r in metrics(tmp_path, "val2") if "val_loss" in r]
    assert [r["update"] for r in vals] == [1, 2] and all(r["val_loss"] > 0 for r in vals)
    assert (tmp_path / "ckpt" / "val2" / "generator_best.safetensors").exists()
    assert info(tmp_path, "val2")["best_val_loss"] == min(r["val_loss"] for r in vals)

def test_adamw8bit_with_fsdp_is_refused_before_building_models(tmp_path):
    res = launch_2proc("--fsdp-cpu", *demo_args(tmp_path, "bnb", "optimizer=adamw8bit", "updates=2", "batch_size=8"), check=False)
    assert res.returncode != 0 and "config error: optimizer 'adamw8bit' does not work with FSDP" in res.stderr, res.stderr[-2000:]
    assert "training of" not in res.stdout   # the line printed once the models are built
