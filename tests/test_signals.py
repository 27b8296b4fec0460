"""Stop signals end in a checkpoint and exit 0, whoever receives them: the trainer, its whole process group (with
DataLoader workers), the `accelerate launch` process, or every process of a 2-node SLURM step (simulated over
127.0.0.1 with stand-ins for `srun` and `scontrol`). Nothing may be left running afterwards."""
import os, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import free_port, ROOT
from test_train import demo_args, info
from test_shipped_configs import overrides, check_run, UPDATES
from cascade_nb.launch import descendants

LONG = ["updates=400", "save_every=300", "log_every=1"]

def start(cmd, env=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("IN_TEST", None)
    return subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)

def wait_until_training(proc, tmp, name, timeout=300):
    "Until the first metrics line is written (training has begun); the processes of the run at that moment."
    t0, metrics = time.time(), Path(tmp) / "out" / name / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None: raise AssertionError(f"ended early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        assert time.time() - t0 < timeout, "training did not start"
        time.sleep(0.2)
    return descendants(proc.pid)

def alive(pid: int) -> bool:
    try: return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError: return False

def finish(proc, tracked, timeout=300):
    "Output and exit status of `proc`, after checking that every process of the run has ended."
    out, _ = proc.communicate(timeout=timeout)
    t0 = time.time()
    while [p for p in tracked if alive(p)]:
        assert time.time() - t0 < 60, f"left behind: {[p for p in tracked if alive(p)]}\n{out[-3000:]}"
        time.sleep(0.2)
    return out, proc.returncode

def assert_saved(tmp, name, out, processes=1):
    i = info(tmp, name)
    assert i is not None and 1 <= i["update"] < 400 and i["num_processes"] == processes, out[-3000:]
    assert "received SIG" in out and "saved update" in out, out[-3000:]
    assert "DataLoader worker" not in out and "Traceback" not in out, out[-3000:]

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_process_group_with_workers(tmp_path, sig):
    "Ctrl-C / a scheduler signalling the group: the workers used to die first ('DataLoader worker killed by signal')."
    proc = start([sys.executable, "-m", "cascade_nb.train", *demo_args(tmp_path, "group", *LONG, "num_workers=2")])
    tracked = wait_until_training(proc, tmp_path, "group")
    assert len(tracked) >= 2   # the two DataLoader workers
    os.killpg(proc.pid, sig)
    out, rc = finish(proc, tracked)
    assert rc == 0, out[-3000:]
    assert_saved(tmp_path, "group", out)

ACC_1PROC = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]

def test_sigterm_to_bare_accelerate_launcher(tmp_path):
    """`accelerate launch cascade_nb/train.py ...` (1 process) and SIGTERM to the launcher only: accelerate 1.15 has no
    handler, so the launcher dies with the signal, and 1.16's handler exits 128 + 15 (nothing in the trainer can change
    either); the trainer used to keep training as an orphan. Now it is told by the kernel (die_with_parent), saves and
    exits."""
    proc = start([sys.executable, "-m", "accelerate.commands.launch", *ACC_1PROC, "cascade_nb/train.py",
                  *demo_args(tmp_path, "bare", *LONG, "num_workers=1")])
    tracked = wait_until_training(proc, tmp_path, "bare")
    proc.send_signal(signal.SIGTERM)
    out, rc = finish(proc, tracked)   # the pipe stays open until the trainer has exited too
    assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM), out[-3000:]
    assert_saved(tmp_path, "bare", out)

# SIGTERM to `python -m cascade_nb.launch` on 1 and 2 processes (and nothing left running afterwards): every shipped
# config, in tests/test_shipped_configs.py

SRUN = """#!/bin/bash
# stand-in for srun: start the step command once per node, SLURM_NODEID set, and wait for all (srun's options skipped)
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
SCONTROL = """#!/bin/bash
# stand-in for `scontrol show hostnames LIST`: one host per line
echo "$3" | tr ',' '\\n'
"""

def test_slurm_script_saves_on_sigterm_to_every_process(tmp_path):
    """configs/slurm/train_multinode.sbatch as 2 nodes over 127.0.0.1, and SIGTERM to every process of the step, as
    `--signal=TERM@120` does: both ranks save together and the job step exits 0 (it used to crash on the workers)."""
    bin_dir = tmp_path / "bin"; bin_dir.mkdir()
    for name, text in [("srun", SRUN), ("scontrol", SCONTROL)]:
        (bin_dir / name).write_text(text); (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "127.0.0.1",
           "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1", "MASTER_PORT": str(free_port()),
           # CPU processes: multi_node.yaml's HSDP needs GPUs (accelerate refuses a ParallelismConfig on MULTI_CPU)
           "LAUNCH_CONFIG": str(ROOT / "configs" / "accelerate" / "cpu_2proc.yaml")}
    # the demo as shipped (its data filter and evaluation included), shortened as tests/test_shipped_configs.py does
    step_cmd = ["bash", ROOT / "configs" / "slurm" / "train_multinode.sbatch", ROOT / "configs" / "demo.yaml",
                *overrides("demo.yaml", tmp_path, "slurm"), "mixed_precision=no"]
    proc = start(step_cmd, env=env)
    tracked = wait_until_training(proc, tmp_path, "slurm")
    srun = next(p for p in tracked if "srun" in Path(f"/proc/{p}/cmdline").read_text())
    step = descendants(srun)
    for p in step:
        try: os.kill(p, signal.SIGTERM)
        except ProcessLookupError: pass
    out, rc = finish(proc, tracked)
    assert rc == 0, out[-3000:]
    assert_saved(tmp_path, "slurm", out, processes=2)
    # the job resubmitted: it resumes and finishes, and its evaluation is what one process computes from its weights
    proc = start(step_cmd, env=env)
    out, rc = finish(proc, [])
    assert rc == 0 and f"done at update {UPDATES} of {UPDATES}" in out, out[-3000:]
    check_run(tmp_path, "slurm", processes=2)
