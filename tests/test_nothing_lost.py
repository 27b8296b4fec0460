"""Nothing lost, whatever goes wrong (issue 25), for the run directory and the trainer: damaged or hand-edited
checkpoints fall back to the previous state, links in a run's folders are refused, a disk that fills during a save
costs one line and leaves nothing half written, a cut-off metrics line is harmless, and a resume says what it changed.
Every fault is injected as a user's world would: bytes flipped on disk, a file edited, a small tmpfs, a symlink."""
import json, os, shutil, subprocess
from pathlib import Path
import pytest
import torch
from safetensors.torch import load_file, save_file
from conftest import run_cli
from test_train import demo_args, info, weights, assert_identical

def train(tmp, name, *extra, check=True):
    return run_cli("-m", "cascade_nb.train", *demo_args(tmp, name, *extra), check=check)

@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    "A run saved at updates 2 and 4 (the latest state and the one before it), copied fresh for each test."
    tmp = tmp_path_factory.mktemp("two_saves")
    train(tmp, "r", "updates=4", "save_every=2")
    return tmp

@pytest.fixture
def run(two_saves, tmp_path):
    shutil.copytree(two_saves, tmp_path, dirs_exist_ok=True, symlinks=True)
    return tmp_path

def state(tmp, which="state_dir") -> Path: return Path(tmp) / "ckpt" / "r" / info(tmp, "r")[which]

def test_flipped_bits_fall_back_to_the_previous_state(run):
    "A byte changed in the latest state's weights (same size, still a valid file): the checksum catches it."
    f = state(run) / "model.safetensors"
    data = bytearray(f.read_bytes()); data[-3] ^= 0xFF; f.write_bytes(bytes(data))
    res = train(run, "r", "updates=6", "save_every=2")
    assert "changed since it was committed" in res.stderr and "resuming from the previous one" in res.stderr, res.stderr[-2000:]
    assert "resumed" in res.stdout and "at update 2" in res.stdout, res.stdout[-2000:]
    assert info(run, "r")["update"] == 6

def _without_checksums(tmp):
    "The run as an older cascade_nb wrote it: no checksums in info.json (so only the content checks can catch a fault)."
    p = Path(tmp) / "ckpt" / "r" / "info.json"
    d = json.loads(p.read_text()); d.pop("checksums"); d.pop("previous_checksums"); p.write_text(json.dumps(d))

def test_nan_weights_on_disk_are_refused(run):
    _without_checksums(run)
    f = state(run) / "model.safetensors"
    sd = load_file(str(f)); k = next(iter(sd)); sd[k] = torch.full_like(sd[k], float("nan")); save_file(sd, str(f))
    res = train(run, "r", "updates=6", "save_every=2")
    assert "NaN or inf" in res.stderr and "resuming from the previous one" in res.stderr, res.stderr[-2000:]
    assert "at update 2" in res.stdout

@pytest.mark.parametrize("edit", [{"update": -3}, {"update": "4"}, {"best_val_loss": float("nan")}])
def test_a_hand_edited_training_state_falls_back(run, edit):
    _without_checksums(run)
    p = state(run) / "train_state.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **edit}))
    res = train(run, "r", "updates=6", "save_every=2")
    assert "training state:" in res.stderr and "resuming from the previous one" in res.stderr, res.stderr[-2000:]
    assert "at update 2" in res.stdout and info(run, "r")["update"] == 6

def test_a_link_in_the_output_folder_is_refused(run, tmp_path_factory):
    "metrics.jsonl pointing at a file elsewhere: the run stops at start, the target is untouched."
    target = tmp_path_factory.mktemp("elsewhere") / "precious.txt"; target.write_text("mine\n")
    metrics = run / "out" / "r" / "metrics.jsonl"; metrics.unlink(); metrics.symlink_to(target)
    res = train(run, "r", "updates=6", check=False)
    assert res.returncode == 2 and "is a symbolic link" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert target.read_text() == "mine\n"

def test_a_cut_off_metrics_line_is_harmless(run):
    "A kill in the middle of a write leaves half a line: the run resumes and finishes (it used to exit 1 at the end)."
    with open(run / "out" / "r" / "metrics.jsonl", "a") as f: f.write('{"update": 5, "lo')
    res = train(run, "r", "updates=6", "save_every=2")
    assert res.returncode == 0 and (run / "out" / "r" / "loss.png").exists()

def test_a_resume_says_what_it_changed(run):
    res = train(run, "r", "updates=6", "save_every=2", "lr=5e-4", "seed=3")
    assert "resumed with other settings than the checkpoint's: lr 0.001 -> 0.0005; seed 0 -> 3" in res.stdout, res.stdout[-2000:]

def test_a_finished_run_says_there_is_nothing_to_do(run):
    res = train(run, "r", "updates=3")
    assert "is at update 4, and updates is 3: nothing to train" in res.stdout, res.stdout[-2000:]
    assert info(run, "r")["update"] == 4

@pytest.fixture
def small_disk(tmp_path):
    "A 14 MB tmpfs: room for the run's first checkpoint, not for a second state beside it."
    mnt = tmp_path / "small"; mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])

def test_disk_full_during_a_save_costs_one_line_and_leaves_nothing(tmp_path, small_disk):
    res = run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "full", "updates=8", "save_every=2",
                                                      f"checkpoint_path={small_disk}"), check=False)
    run_dir = small_disk / "full"
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "failed" in res.stderr and ("No space left on device" in res.stderr or "MB free" in res.stderr), res.stderr[-3000:]
    committed = json.loads((run_dir / "info.json").read_text())
    # nothing half written is left to fill the disk: only the committed states remain
    assert {p.name for p in run_dir.glob("state-*")} <= {committed["state_dir"], committed["previous_state_dir"]}
    assert f"update {committed['update']}" in res.stderr

@pytest.mark.parametrize("args, says", [(["--steps", "0"], "argument --steps: 0 must be >= 1"),
                                        (["--cfg", "nan"], "argument --cfg: 'nan' is not a finite number"),
                                        (["--json", "DIR"], "--json")])
def test_eval_cli_bad_arguments_are_one_line(run, args, says):
    args = [str(run) if a == "DIR" else a for a in args]
    res = run_cli("-m", "cascade_nb.eval", "--checkpoint", run / "ckpt" / "r", "--captions", "2", *args, check=False)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]

def test_the_start_up_disk_check_counts_the_optimizers_own_state():
    """The space a run wants free before it starts: weights twice, the EMA, and the optimizer's state as the memory
    planner sizes it. Counting AdamW's two fp32 moments for every optimizer refused the official 3.6B full fine-tune
    with Adafactor on 34 GB free (43 GB asked, for a 7.3 GB training state)."""
    import torch
    from cascade_nb.config import config_from_dict
    from cascade_nb.models.stage_c import StageC
    from cascade_nb.train import _checkpoint_bytes
    with torch.device("meta"): gen = StageC.from_preset("3.6B").to(torch.bfloat16)
    n = sum(p.numel() for p in gen.parameters())
    base = dict(experiment_id="x", webdataset_path="data", dtype="bfloat16", fused_backward=True, batch_size=1)
    at = lambda **kw: _checkpoint_bytes(gen, config_from_dict({**base, **kw}, training=False).train)
    weights = 2 * 2 * n                                                   # bf16, in the state and released
    assert weights < at(optimizer="adafactor", stochastic_rounding=True) < weights * 1.01   # factored moments
    assert weights + 2 * n <= at(optimizer="adamw8bit") < (weights + 2 * n) * 1.01          # two 8-bit moments
    assert at(optimizer="adamw") == weights + 2 * 2 * n                   # two moments in the weights' bf16
