"""Every `configs/*.yaml` as shipped, on every launch the README documents, on CPU: one process, 2-process DDP and
2-process FSDP2 (accelerate's FSDP2 path, switched on for CPU processes by tests/train_driver.py --fsdp-cpu).

Each run trains a few updates, is stopped by SIGTERM to `python -m cascade_nb.launch`, relaunched (it resumes) and
finished; then `python -m cascade_nb.sample` and `python -m cascade_nb.eval` read the run directory, and the numbers
`eval` computes in one process from the released weights are the ones the run logged at its last evaluation.

Only what a short run on a CPU has to change is overridden: update counts (updates, and the intervals and warm-ups
that count updates), paths, and worker counts. Evaluation, sampling, validation and the mode's own options stay as
configured, and a config added to `configs/` joins the matrix without an edit here. Configs that start from another
run (`checkpoints/demo/...`: a LoRA's base, a student's teacher) read the matrix's own one-process demo run."""
import json, os, re, signal, subprocess, sys, time
from pathlib import Path
import pytest
import yaml
from conftest import free_port, ROOT
from cascade_nb.launch import descendants

CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
BASE = "demo.yaml"   # the run the others start from (`checkpoints/demo`)
DRIVER = ROOT / "tests" / "train_driver.py"
TWO = ["--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"]
LAUNCHES = {
    "1proc": (["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
              [ROOT / "cascade_nb" / "train.py"]),
    "ddp": (TWO, [ROOT / "cascade_nb" / "train.py"]),
    "fsdp2": (TWO, [DRIVER, "--fsdp-cpu"]),
}
UPDATES = 8
# keys that count updates, scaled down so that each fires in a short run (evaluation and validation once, at the end)
SHORT = [f"updates={UPDATES}", f"save_every={UPDATES}", "log_every=1", "warmup_updates=2", "ema_start_iters=2",
         "backup_every=1000"]
EVERY = {"eval_every": UPDATES, "val_every": UPDATES}

def shipped(name: str) -> dict: return yaml.safe_load((ROOT / "configs" / name).read_text())

def overrides(name: str, tmp: Path, run_id: str) -> list[str]:
    "What a short CPU run of `configs/{name}` overrides: update counts, paths (a base run's in tmp), worker counts."
    cfg = shipped(name)
    out = [*SHORT, f"experiment_id={run_id}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", "num_workers=1"]
    out += [f"{k}={v}" for k, v in EVERY.items() if cfg.get(k)]
    # a path into the shipped `checkpoints/` folder: the matrix's own base run
    out += [f"{k}={tmp}/ckpt/{v.removeprefix('checkpoints/')}" for k, v in cfg.items()
            if isinstance(v, str) and v.startswith("checkpoints/") and k != "checkpoint_path"]
    return out

def launch(launch_name: str, name: str, tmp: Path, run_id: str):
    acc, script = LAUNCHES[launch_name]
    port = [] if launch_name == "1proc" else ["--main_process_port", str(free_port())]
    cmd = [sys.executable, "-m", "cascade_nb.launch", *acc, *port, *script, ROOT / "configs" / name,
           *overrides(name, tmp, run_id)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("IN_TEST", None)
    return subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)

def metrics(tmp: Path, run_id: str) -> list[dict]:
    p = tmp / "out" / run_id / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []

def alive(pid: int) -> bool:
    try: return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError: return False

def info(tmp: Path, run_id: str) -> dict: return json.loads((tmp / "ckpt" / run_id / "info.json").read_text())

def finish(proc, timeout=600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    return out

def train_stop_resume(launch_name: str, name: str, tmp: Path, run_id: str) -> str:
    "Train, SIGTERM the launcher once update 2 is logged, relaunch: the run resumes and finishes. Both logs."
    proc, t0 = launch(launch_name, name, tmp, run_id), time.time()
    while not any(r.get("update", 0) >= 2 and "loss" in r for r in metrics(tmp, run_id)):
        assert proc.poll() is None, f"ended before update 2 ({proc.returncode}):\n{proc.stdout.read()[-4000:]}"
        assert time.time() - t0 < 400, "no update 2 after 400 s"
        time.sleep(0.1)
    tracked = descendants(proc.pid)   # the launcher's processes: trainers and DataLoader workers
    proc.send_signal(signal.SIGTERM)
    first = finish(proc)
    t0 = time.time()
    while left := [p for p in tracked if alive(p)]:
        assert time.time() - t0 < 60, f"left behind after the stop: {left}"
        time.sleep(0.2)
    stopped = info(tmp, run_id)["update"]
    assert 2 <= stopped < UPDATES and f"saved update {stopped}" in first, first[-3000:]
    second = finish(launch(launch_name, name, tmp, run_id))
    assert f"at update {stopped}" in second and info(tmp, run_id)["update"] == UPDATES, second[-3000:]
    assert f"done at update {UPDATES} of {UPDATES}" in second, second[-3000:]
    return first + second

def check_run(tmp: Path, run_id: str, processes: int):
    "The run as a user reads it afterwards: the sample CLI draws from it, and eval reproduces its last logged evaluation."
    run = tmp / "ckpt" / run_id
    assert info(tmp, run_id)["num_processes"] == processes
    from cascade_nb import eval as E, sample as S
    paths = S.main(["--checkpoint", str(run), "--prompt", "red apple", "--n", "2", "--steps", "2", "--out", str(tmp / f"s_{run_id}")])
    assert len(paths) == 2 and all(p.exists() for p in paths)
    if (run / "best.json").exists():
        best = S.main(["--checkpoint", str(run), "--prompt", "tulip", "--n", "1", "--steps", "2", "--best",
                       "--out", str(tmp / f"s_{run_id}_best")])
        assert len(best) == 1
    logged = [r for r in metrics(tmp, run_id) if any(k.startswith("eval/") for k in r)]
    scalars, images = tensorboard_tags(tmp / "out" / run_id / "tensorboard")
    assert {"loss", "lr"} <= scalars and "samples" in images, (scalars, images)
    if not logged:
        # a run without in-training evaluation is scored by the CLI all the same (a few captions: it is only a check)
        assert E.main(["--checkpoint", str(run), "--captions", "4", "--steps", "2"])[str(run)]
        return
    assert {"eval/retrieval/top1"} <= scalars and "eval" in images, (scalars, images)
    last = logged[-1]
    assert last["update"] == UPDATES
    scored = E.main(["--checkpoint", str(run)])[str(run)]
    assert {k: last[f"eval/{k}"] for k in scored} == scored, (last, scored)

def tensorboard_tags(folder: Path) -> tuple[set, set]:
    "(scalar tags, image tags) in a run's TensorBoard event files."
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars, images = set(), set()
    for f in folder.glob("events.out.tfevents.*"):
        ea = EventAccumulator(str(f), size_guidance={"images": 0}); ea.Reload()
        scalars |= set(ea.Tags()["scalars"]); images |= set(ea.Tags()["images"])
    return scalars, images

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    "The one-process demo run the other configs start from, trained as the matrix trains every config."
    tmp = tmp_path_factory.mktemp("matrix")
    train_stop_resume("1proc", BASE, tmp, "demo")
    return tmp

def test_every_config_is_in_the_matrix():
    assert BASE in CONFIGS and len(CONFIGS) >= 4, CONFIGS

# (config, launch) that a config's mode refuses, and the one line it says; each is checked to be refused that way
REFUSED = {("dmd_demo.yaml", "fsdp2"): "mode 'dmd' runs its fake score network outside the root forward"}

@pytest.mark.parametrize("launch_name", list(LAUNCHES))
@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config(base, name, launch_name):
    if (says := REFUSED.get((name, launch_name))) is not None:
        proc = launch(launch_name, name, base, re.sub(r"\W", "_", f"{Path(name).stem}_{launch_name}"))
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0 and says in out, out[-4000:]
        return
    processes = 1 if launch_name == "1proc" else 2
    run_id = re.sub(r"\W", "_", f"{Path(name).stem}_{launch_name}")
    if name == BASE and launch_name == "1proc": run_id = "demo"   # the base run itself
    else: train_stop_resume(launch_name, name, base, run_id)
    check_run(base, run_id, processes)

def test_demo_resumes_bit_identically_on_2_processes(base):
    "The demo as shipped, stopped by SIGTERM and resumed on 2 processes, ends with the weights of a run never stopped."
    if not (base / "ckpt" / "demo_ddp" / "info.json").exists(): train_stop_resume("ddp", BASE, base, "demo_ddp")
    finish(launch("ddp", BASE, base, "demo_ddp_whole"))
    from safetensors.torch import load_file
    for name in ("generator.safetensors", "generator_ema.safetensors"):
        a, b = (load_file(str(base / "ckpt" / r / name)) for r in ("demo_ddp", "demo_ddp_whole"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), name
