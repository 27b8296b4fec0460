"""The trainer end to end on CPU: a short run from the command line, exact resume after SIGKILL (also during a save),
SIGTERM handling, the non-finite-loss guard, 2-process DDP, the recipe keys (gdf.recipe) under both, and the official
Stage C configs at tiny size."""
import json, os, random, re, signal, subprocess, sys, time
from pathlib import Path
import pytest
from safetensors.torch import load_file
from conftest import free_port, ROOT, run_cli
from official_configs import OFFICIAL_CONFIGS

DRIVER = ROOT / "tests" / "train_driver.py"
TINY = ["webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "image_size=32", "batch_size=4",
        "log_every=1", "lr=1e-3", "warmup_updates=2", "ema_start_iters=2", "ema_iters=1", "ema_beta=0.9",
        "dataset_filters=null", "eval_every=null", "best_metric=null", "sample_steps=2"]   # the demo's caption filter and evaluation off

def demo_args(tmp, name, *extra):
    return [str(ROOT / "configs" / "demo.yaml"), *TINY, f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt",
            f"output_path={tmp}/out", *extra]

def weights(tmp, name, which="generator"):
    return load_file(str(Path(tmp) / "ckpt" / name / f"{which}.safetensors"))

def assert_identical(a, b):
    assert a.keys() == b.keys()
    diff = [k for k in a if not (a[k] == b[k]).all()]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"

def info(tmp, name):
    p = Path(tmp) / "ckpt" / name / "info.json"
    return json.loads(p.read_text()) if p.exists() else None

def test_short_run_from_the_command_line(tmp_path):
    # the installed console script: it exits with main()'s return value, so a finished run must exit 0
    res = run_cli(Path(sys.executable).parent / "cascade-train", *demo_args(tmp_path, "short", "updates=6", "save_every=3"))
    run, out = tmp_path / "ckpt" / "short", tmp_path / "out" / "short"
    assert info(tmp_path, "short")["update"] == 6
    assert {"generator.safetensors", "generator_ema.safetensors", "info.json", "state-00000006"} <= {p.name for p in run.iterdir()}
    # the EMA is stored once: the released file is the training state's ema.safetensors (a hard link), not a second copy
    assert os.path.samefile(run / "generator_ema.safetensors", run / "state-00000006" / "ema.safetensors")
    # each released file says which weights it holds (the EMA's through the state's ema.safetensors it links to)
    from cascade_nb.core import safetensors_header
    assert [safetensors_header(run / f"{n}.safetensors")[0]["cascade_nb.weights"] for n in ("generator", "generator_ema")] \
        == ["live", "ema"]
    assert (out / "000003.png").exists() and (out / "000006.png").exists() and (out / "loss.png").exists()
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["loss"] > 0 for r in rows)
    # stdout is a pipe here, as in a SLURM log: one plain line per log_every, no progress bar redrawn with \r
    assert "\r" not in res.stdout and len(re.findall(r"^update \d/6: loss [0-9.]+ \| lr", res.stdout, re.M)) == 6, res.stdout[-2000:]
    # the export is a plain state dict in the official key layout, loadable by load_stage_c
    from cascade_nb.models.stage_c import load_stage_c
    load_stage_c(run / "generator.safetensors", preset="tiny", c_in=3, c_out=3, patch_size=2)
    # ... and samples come from the run's EMA weights through the sample CLI
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "red apple", "--n", "4", "--steps", "3",
                  "--cfg", "4", "--seed", "0", "--out", tmp_path / "samples")
    assert "generator_ema.safetensors (the EMA)" in res.stdout and len(list((tmp_path / "samples").glob("0_*_red_apple.png"))) == 4

def test_config_error_exits_2(tmp_path):
    res = run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "bad", "learning_rate=1"), check=False)
    assert res.returncode == 2 and "unknown key 'learning_rate'; did you mean 'lr'" in res.stderr

def _start(tmp, name, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}; env.pop("IN_TEST", None)
    return subprocess.Popen([sys.executable, str(DRIVER), *demo_args(tmp, name, *extra)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

def _wait_for_update(tmp, name, update, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        i = info(tmp, name)
        if i and i["update"] >= update: return
        if proc.poll() is not None: raise AssertionError(f"training ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("timed out waiting for a checkpoint")

RUN = ["updates=10", "save_every=3"]

@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    run_cli(DRIVER, *demo_args(tmp, "ref", *RUN))
    return tmp

def test_sigkill_then_resume_is_bit_identical(tmp_path, reference_run):
    proc = _start(tmp_path, "killed", *RUN)
    _wait_for_update(tmp_path, "killed", 3, proc)
    time.sleep(random.uniform(0, 1.5))   # somewhere in updates 4-6
    proc.send_signal(signal.SIGKILL); proc.wait()
    run_cli(DRIVER, *demo_args(tmp_path, "killed", *RUN))
    assert info(tmp_path, "killed")["update"] == 10
    assert_identical(weights(tmp_path, "killed"), weights(reference_run, "ref"))
    assert_identical(weights(tmp_path, "killed", "generator_ema"), weights(reference_run, "ref", "generator_ema"))

def test_kill_during_save_keeps_previous_checkpoint(tmp_path, reference_run):
    res = run_cli(DRIVER, "--kill-in-commit", "6", *demo_args(tmp_path, "torn", *RUN), check=False)
    assert res.returncode == -signal.SIGKILL
    i = info(tmp_path, "torn")
    assert i["update"] == 3 and (tmp_path / "ckpt" / "torn" / i["state_dir"]).is_dir()
    run_cli(DRIVER, *demo_args(tmp_path, "torn", *RUN))        # resumes from update 3, overwrites the torn state-6
    assert_identical(weights(tmp_path, "torn"), weights(reference_run, "ref"))

def test_sigterm_saves_and_exits_cleanly(tmp_path):
    proc = _start(tmp_path, "term", "updates=200", "save_every=100")
    t0 = time.time()
    while not (tmp_path / "out" / "term" / "metrics.jsonl").exists():
        assert time.time() - t0 < 300 and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "received SIGTERM" in out
    i = info(tmp_path, "term")
    assert 1 <= i["update"] < 200

def test_sigterm_during_update_0_prompt_samples(tmp_path):
    "64 prompts of 1000 steps would hold update 0 for many minutes: SIGTERM skips them, saves and exits 0 at once."
    entries = [f"- {{text: apple {i}, steps: 1000, size: 64}}\n" for i in range(64)]
    (tmp_path / "prompts.yaml").write_text("".join(entries))
    proc = _start(tmp_path, "busy", "updates=200", "save_every=100", f"sample_prompts={tmp_path}/prompts.yaml")
    head = ""
    while "parameter groups:" not in head:   # printed once the models are built, just before update 0's samples
        assert proc.poll() is None, head
        head += proc.stdout.readline()
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and time.time() - t0 < 60, out[-3000:]
    assert "update 0: prompt samples stopped by SIGTERM" in out and "saved update 1" in out, out[-3000:]
    assert info(tmp_path, "busy")["update"] == 1

def test_nonfinite_losses(tmp_path):
    res = run_cli(DRIVER, "--nan-from", "3", *demo_args(tmp_path, "nan", "updates=20", "max_nan_steps=4"), check=False)
    assert res.returncode != 0 and "4 non-finite losses in a row" in res.stderr
    res = run_cli(DRIVER, "--nan-once", "2", *demo_args(tmp_path, "nan1", "updates=4", "save_every=4"))
    assert "update skipped" in res.stdout
    assert info(tmp_path, "nan1")["nonfinite_total"] == 1

def test_a_diverging_run_never_replaces_good_weights(tmp_path):
    "lr 1e10 after 4 good updates: no save commits the diverged state; the error names the checkpoint that is kept."
    run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "div", "updates=4", "save_every=4"))
    good = weights(tmp_path, "div")
    res = run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "div", "updates=14", "save_every=2", "lr=1e10",
                                                      "max_nan_steps=6"), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "non-finite losses in a row" in res.stderr and "checkpoint of update 4" in res.stderr, res.stderr[-2000:]
    assert info(tmp_path, "div")["update"] == 4 and "not saved" in res.stdout
    assert_identical(weights(tmp_path, "div"), good)

def _launch_2proc(*args, check=True):
    return run_cli("-m", "accelerate.commands.launch", "--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml",
                   "--main_process_port", str(free_port()), DRIVER, *args, env={"OMP_NUM_THREADS": "1"}, check=check)

def _committable_state(state_dir) -> dict:
    """{file: digest} of a state directory, less accelerate's `random_states_N.pkl` (its copy of the process-global
    RNGs, which the trainer seeds again at every update: `run_state.seed_global_draws`) and
    torch.distributed.checkpoint's `.metadata` indexes (they carry an id of their own per save; the `.distcp` shards they index are compared)."""
    from cascade_nb.run_state import file_checksums
    skip = lambda name: name.startswith("random_states_") or name == ".metadata"
    return {k: v for k, v in file_checksums(state_dir).items() if not skip(Path(k).name)}

def resumes_to_the_killed_state(run_dir, argv, launch=None, at=4, resume_flags=()):
    """SIGKILL a run inside its checkpoint commit of update `at`, resume it, and assert that the state it commits for
    `at` is, file for file, the one the killed process had written just before: up to that commit the killed process
    was an uninterrupted run, so it is its own reference and no third run is needed. Returns the resumed run."""
    launch = launch or (lambda *a, check=True: run_cli(DRIVER, *a, check=check))
    killed = launch("--kill-in-commit", str(at), *argv, check=False)
    committed = lambda: json.loads((run_dir / "info.json").read_text())["update"]
    assert killed.returncode != 0 and committed() < at, killed.stdout[-3000:] + killed.stderr[-3000:]
    state = run_dir / f"state-{at:08d}"
    written = _committable_state(state)
    assert "train_state.json" in written, written
    stamp = (state / "train_state.json").stat().st_mtime_ns
    resumed = launch(*resume_flags, *argv)
    assert committed() >= at and (state / "train_state.json").stat().st_mtime_ns != stamp   # written anew
    now = _committable_state(state)
    differ = sorted(k for k in written.keys() | now.keys() if now.get(k) != written.get(k))
    assert not differ, f"the resumed run committed another state for update {at}: {differ}"
    return resumed

# the recipe keys of gdf.recipe together: a (moving) range and a density, a robust loss, input perturbation, pyramid noise
RECIPE = ["logsnr_min=-5", "logsnr_max=6", "timestep_sampling=mode", "mode_scale=0.8", "loss_type=scheduled_huber",
          "input_perturbation=0.1", "pyramid_noise_discount=0.5", "pyramid_noise_levels=4",
          # the range moves over the first 3 updates (a function of the update number: exact on resume)
          "logsnr_min_end=-2", "logsnr_max_end=3", "logsnr_range_updates=3"]
# the caption transforms (issue 28), drawn per (sample, epoch) in the data pipeline: the same under resume and DDP
CAPTION_KEYS = ["caption_prefix=emoji", "shuffle_tags=true", "keep_tokens=1", "tag_dropout=0.1"]

# flips, crop jitter and loss masks (issue 28), drawn per (sample, epoch) and pooled to the latent grid
MASK_KEYS = ["hflip=true", "crop_jitter=0.2", "loss_mask=auto", "unmasked_weight=0.2", "normalize_masked_area=true"]

# a mixture (issue 28): a fractional weight, a per-sample loss weight and a caption prefix; a loose folder repeated,
# one that refuses flips, and the masked emoji (alpha and mask members)
SAMPLES = ROOT / "data_samples"
MIX = (f"webdataset_path=[{{path: '{SAMPLES}/emoji/shard-{{000002..000005}}.tar', weight: 1.5, loss_weight: 0.5, "
       f"caption_prefix: 'emoji, '}}, {{path: '{SAMPLES}/photos', repeats: 2, hflip: false}}, "
       f"{{path: '{SAMPLES}/masked'}}]")

PROMPTS = """- {text: red apple, seed: 3, cfg: 2, steps: 3}
- {text: banana, size: 16, negative_prompt: yellow}
"""

def test_recipe_knobs_kill_then_resume_is_exact(tmp_path):
    """With every recipe key set and a mixture of sources, a run killed inside a save resumes to the state it had
    written, file for file; its prompt samples (sample_prompts, update 0 and every sample_every) are the same files too
    (nbs/44_prompt_samples)."""
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    samples, before = tmp_path / "out" / "recipe" / "samples", {}
    def launch(*argv, check=True):
        res = run_cli(DRIVER, *argv, check=check)
        # the killed launch sampled update 4 before the kill inside its save: the uninterrupted run's files
        before.update(before or {p.name: p.read_bytes() for p in (samples / "000004").iterdir()})
        return res
    resumes_to_the_killed_state(tmp_path / "ckpt" / "recipe", demo_args(tmp_path, "recipe", "updates=4", "save_every=2",
                                f"sample_prompts={tmp_path}/prompts.yaml", "sample_every=2", *RECIPE, *CAPTION_KEYS,
                                *MASK_KEYS, MIX), launch=launch)
    assert sorted(p.name for p in samples.iterdir()) == ["000000", "000002", "000004"]
    assert sorted(before) == ["00_red_apple.png", "00_red_apple_ema.png", "00_red_apple_pair.png", "01_banana.png",
                              "01_banana_ema.png", "01_banana_pair.png", "index.json", "index.md"]
    after = {p.name: p.read_bytes() for p in (samples / "000004").iterdir()}
    assert after == before, sorted(k for k in after if after[k] != before.get(k))
    index = json.loads(after["index.json"])
    assert [(e["seed"], e["cfg"], e["steps"], e["negative_prompt"]) for e in index["prompts"]] == \
        [(3, 2.0, 3, ""), (1, 3.0, 2, "yellow")]   # the demo's sample_cfg, TINY's sample_steps
    assert before["00_red_apple.png"] != (samples / "000000" / "00_red_apple.png").read_bytes()   # it trained

def test_cascade_decoded_prompt_samples_kill_then_resume_is_exact(tmp_path):
    """sample_decode: cascade on a tiny Stage C in EfficientNet space (random tiny Stage B, Stage A and Previewer files):
    a run killed inside its save of update 4 resumes to the same state, and its update-4 prompt samples, decoded through
    Stage B and Stage A at the prompt's size, are the same files (nbs/44_prompt_samples)."""
    from cascade_nb.inference import write_tiny_checkpoints
    models = write_tiny_checkpoints(tmp_path / "models")
    (tmp_path / "prompts.yaml").write_text("- {text: red apple, seed: 3, steps: 3}\n- {text: banana, negative_prompt: yellow}\n")
    samples, before = tmp_path / "out" / "casc" / "samples", {}
    def launch(*argv, check=True):
        res = run_cli(DRIVER, *argv, check=check)
        before.update(before or {p.name: p.read_bytes() for p in (samples / "000004").iterdir()})
        return res
    resumes_to_the_killed_state(tmp_path / "ckpt" / "casc", demo_args(
        tmp_path, "casc", "updates=4", "save_every=2", "image_size=64", "model_overrides={}", "latent_space=effnet",
        "effnet_checkpoint_path=tiny", f"previewer_checkpoint_path={models}/previewer.safetensors",
        f"generator_checkpoint_path={models}/stage_c.safetensors", f"sample_prompts={tmp_path}/prompts.yaml",
        "sample_every=2", "sample_decode=cascade", f"sample_stage_b_checkpoint_path={models}/stage_b.safetensors",
        f"stage_a_checkpoint_path={models}/stage_a.safetensors", "sample_stage_b_steps=4"), launch=launch)
    after = {p.name: p.read_bytes() for p in (samples / "000004").iterdir()}
    assert after == before, sorted(k for k in after if after[k] != before.get(k))
    assert json.loads(after["index.json"])["decoder"] == "cascade"
    from PIL import Image
    assert Image.open(samples / "000004" / "01_banana_pair.png").size == (64 * 2 + 2, 64)   # weights | EMA at 64 px

def test_two_process_ddp(tmp_path):
    """2-process DDP with the recipe, caption, flip/jitter and mask keys set (their draws and noise per process) and a
    mixture of sources: the processes' weights stay equal."""
    res = _launch_2proc("--check-ddp-sync", *demo_args(tmp_path, "ddp", "updates=4", "save_every=2", "batch_size=8",
                                                       *RECIPE, *CAPTION_KEYS, *MASK_KEYS, MIX))
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    i = info(tmp_path, "ddp")
    assert i["num_processes"] == 2 and i["update"] == 4

STAGE_C_FULL = [n for n in OFFICIAL_CONFIGS if n.startswith("finetune_c")  and "lora" not in n]

@pytest.mark.parametrize("name", STAGE_C_FULL)
def test_official_config_trains_at_tiny_size(name, tmp_path):
    (tmp_path / name).write_text(OFFICIAL_CONFIGS[name])
    run_cli("-m", "cascade_nb.train", tmp_path / name, "model_version=tiny", "model_overrides={c_in: 3, c_out: 3, patch_size: 2}",
            "latent_space=pixels", "clip_text_model_name=tiny", "clip_image_model_name=null", "generator_checkpoint_path=null",
            "effnet_checkpoint_path=null", "previewer_checkpoint_path=null", "wandb_project=null", "tracker=none",
            *TINY, "updates=2", "save_every=2", "multi_aspect_ratio=null", "use_fsdp=false",
            f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out")
    cfg_id = {"finetune_c_1b.yaml": "stage_c_1b_finetuning"}.get(name, "stage_c_3b_finetuning")
    assert info(tmp_path, cfg_id)["update"] == 2

STAGE_B = [n for n in OFFICIAL_CONFIGS if n.startswith("finetune_b")]

@pytest.mark.parametrize("name", STAGE_B)
def test_official_stage_b_config_trains_at_tiny_size(name, tmp_path):
    "finetune_b_*.yaml: Stage B (trained at shift 1 like the reference, see stage_b_shift), adaptive loss, Stage A latents, pyramid noise."
    (tmp_path / name).write_text(OFFICIAL_CONFIGS[name])
    run_cli("-m", "cascade_nb.train", tmp_path / name, "model_version=tiny", "stage=b", "stage_a_checkpoint_path=tiny",
            "effnet_checkpoint_path=tiny", "clip_text_model_name=tiny", "clip_image_model_name=null", "generator_checkpoint_path=null",
            "wandb_project=null", "tracker=none", *TINY, "image_size=64", "updates=2", "save_every=2", "use_fsdp=false",
            f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out")
    exp = "stage_b_3b_finetuning" if "3b" in name else "stage_b_700m_finetuning"
    i = info(tmp_path, exp)
    assert i["update"] == 2 and i["config"]["shift"] == 4.0 and i["adaptive_loss"]["loss_weight"]["bucket_losses"]
    assert (tmp_path / "out" / exp / "000002.png").exists()

def test_two_process_fsdp_sharded_checkpoint_resume(tmp_path):
    "FSDP2 over 2 CPU processes: each holds about half the weights; a sharded checkpoint resumes to the same state."
    fsdp = lambda *a, check=True: _launch_2proc("--fsdp-cpu", *a, check=check)
    res = resumes_to_the_killed_state(tmp_path / "ckpt" / "fsdp", demo_args(tmp_path, "fsdp", "updates=4", "save_every=2",
                                      "batch_size=8"), launch=fsdp, resume_flags=["--report-shards"])
    shares = [float(x) for x in re.findall(r"holds ([0-9.]+) of", res.stdout)]   # two processes may share an output line
    assert len(shares) == 2 and all(0.4 < s < 0.65 for s in shares), shares
    state = tmp_path / "ckpt" / "fsdp" / info(tmp_path, "fsdp")["state_dir"]
    assert (state / "pytorch_model_fsdp_0").is_dir() and (state / "optimizer_0").is_dir()   # torch.distributed.checkpoint shards
    from cascade_nb.models.stage_c import load_stage_c   # the gathered export is a plain official-layout state dict
    load_stage_c(tmp_path / "ckpt" / "fsdp" / "generator.safetensors", preset="tiny", c_in=3, c_out=3, patch_size=2)

def test_validation_loss_and_best_checkpoint(tmp_path):
    "val_every + val_webdataset_path: a deterministic validation loss is logged and the best weights are kept."
    shards = ROOT / "data_samples" / "emoji"
    run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "val", "updates=4", "save_every=4", "val_every=2",
            f"val_webdataset_path={shards}/shard-000005.tar", "val_batches=1"))
    rows = [json.loads(l) for l in (tmp_path / "out" / "val" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val_loss" in r]
    assert [r["update"] for r in vals] == [2, 4] and all(r["val_loss"] > 0 for r in vals)
    assert (tmp_path / "ckpt" / "val" / "generator_best.safetensors").exists()
    assert info(tmp_path, "val")["best_val_loss"] == min(r["val_loss"] for r in vals)

def test_sigkill_during_export_after_a_signal_resumes_exactly(tmp_path, reference_run):
    """Pre-emption: SIGTERM, the save of the training state is committed first, and SIGKILL arrives while the gathered
    weights are being exported. The run resumes from the signal's update, exactly (issue 18 item 11)."""
    res = run_cli(DRIVER, "--term-at", "4", "--kill-in-export", *demo_args(tmp_path, "preempt", *RUN), check=False)
    assert res.returncode == -signal.SIGKILL, res.stdout[-2000:] + res.stderr[-2000:]
    i = info(tmp_path, "preempt")
    assert i["update"] == 4, i   # the signal-time state is committed before the export began
    state = tmp_path / "ckpt" / "preempt" / i["state_dir"]
    assert (state / "train_state.json").exists() and not (tmp_path / "ckpt" / "preempt" / "generator_4.safetensors").exists()
    run_cli(DRIVER, *demo_args(tmp_path, "preempt", *RUN))
    assert info(tmp_path, "preempt")["update"] == 10
    assert_identical(weights(tmp_path, "preempt"), weights(reference_run, "ref"))
    assert_identical(weights(tmp_path, "preempt", "generator_ema"), weights(reference_run, "ref", "generator_ema"))
