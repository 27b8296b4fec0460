"""Mode dmd (cascade_nb.dmd) through the real trainer: a run stopped and resumed equals an uninterrupted one, released
files and training state file for file; it runs on 2 DDP processes (gloo) with identical weights; what it cannot train
is refused in one line; the run says how its student samples."""
import json, os
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file
from conftest import ROOT, run_cli, free_port
from test_distill import DEMO, DRIVER, TINY, stopped_and_resumed, teacher   # noqa: F401 (the tiny teacher fixture)

TWO_PROCESSES = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"
DMD = ["mode=dmd", "generator_steps=2", "fake_updates=2", "cfg_scale=2", "ema_start_iters=0", "ema_beta=0.9",
       "regression_weight=0.5", "regression_steps=2", "regression_samples=2", "gan_weight=0.003", "adam_betas=[0, 0.999]",
       "weight_decay=0"]

def overrides(tmp, name, teacher, *extra):
    return [*TINY, *DMD, f"teacher_checkpoint_path={teacher}", f"experiment_id={name}", f"checkpoint_path={tmp}/ck",
            f"output_path={tmp}/out", *extra]

def state_files(run: Path) -> dict:
    "The committed training state's files: safetensors as tensors, the rest as bytes."
    d = run / json.loads((run / "info.json").read_text())["state_dir"]
    return {f.name: load_file(str(f)) if f.suffix == ".safetensors" else f.read_bytes() for f in sorted(d.iterdir())}

def test_dmd_resumes_bit_identically_and_samples_as_it_says(tmp_path, teacher):
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.sample import run_config
    run = lambda tmp: train(load_config(DEMO, overrides(tmp, "s", teacher, "updates=3", "save_every=3")))
    ref = run(tmp_path / "ref")
    assert ref["update"] == 3 and type(ref["mode"]).name == "dmd"
    assert stopped_and_resumed(run, tmp_path)["update"] == 3
    a, b = (tmp_path / k / "ck" / "s" for k in ("ref", "stopped"))
    files = sorted(f.name for f in a.glob("generator*.safetensors"))
    assert files == ["generator.safetensors", "generator_ema.safetensors"]
    teacher_sd = load_file(str(teacher))
    for f in files:
        x, y = load_file(str(a / f)), load_file(str(b / f))
        assert x.keys() == teacher_sd.keys()   # the student alone: the fake score network is not released
        assert not [k for k in x if not torch.equal(x[k], y[k])], f
    sa, sb = state_files(a), state_files(b)
    assert set(sa) == set(sb) and any(k.startswith("loss_terms.dmd.") for k in sa["model.safetensors"])
    for name in sa:
        if isinstance(sa[name], dict):
            assert not [k for k in sa[name] if not torch.equal(sa[name][k], sb[name][k])], name
        # accelerate's snapshot of the global generators, which training does not draw from (its stream: rng_0)
        elif name != "train_state.json" and not name.startswith("random_states"): assert sa[name] == sb[name], name
    assert int(sa["model.safetensors"]["loss_terms.dmd.updates"]) == 3
    assert any(k.startswith("loss_terms.dmd.head.") for k in sa["model.safetensors"])   # the GAN classifier trains
    g = run_config(a).gdf   # the sample CLI and eval read these: lcm sampler, the student's steps, no CFG
    assert (g.sample_sampler, g.sample_steps, g.sample_cfg) == ("lcm", 2, 1.0)

LORA = ["module_filters=['.attn']", "rank=4"]

def test_dmd_lora_resumes_bit_identically_and_merges_into_the_teacher(tmp_path, teacher):
    "DMD-LoRA: the state holds adapters and fake network (not the frozen base), the released file merges into the teacher."
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.sample import run_generator
    run = lambda tmp: train(load_config(DEMO, overrides(tmp, "l", teacher, *LORA, "updates=3", "save_every=3")))
    ref = run(tmp_path / "ref")
    assert type(ref["mode"]).__name__ == "DMDLoraTraining"
    assert stopped_and_resumed(run, tmp_path)["update"] == 3
    a, b = (tmp_path / k / "ck" / "l" for k in ("ref", "stopped"))
    assert sorted(f.name for f in a.glob("*.safetensors")) == ["lora.safetensors", "lora_ema.safetensors"]
    for f in ("lora.safetensors", "lora_ema.safetensors"):
        x, y = load_file(str(a / f)), load_file(str(b / f))
        assert x and not [k for k in x if "loss_terms" in k] and not [k for k in x if not torch.equal(x[k], y[k])], f
    sa, sb = state_files(a), state_files(b)
    model = sa["model.safetensors"]
    assert any(k.startswith("generator.loss_terms.dmd.net.") for k in model)         # the fake network trains
    assert not [k for k in model if k.startswith("generator.") and ".dmd." not in k and "lora" not in k]   # no base
    for name in sa:
        if isinstance(sa[name], dict):
            assert not [k for k in sa[name] if not torch.equal(sa[name][k], sb[name][k])], name
    # the sample CLI's student: the teacher with the adapters merged, which moved it
    _, merged, weights = run_generator(a)
    assert weights.name == "lora_ema.safetensors"
    t_sd, m_sd = load_file(str(teacher)), merged.state_dict()
    moved = [k for k in t_sd if not torch.equal(t_sd[k], m_sd[k])]
    assert moved and all(".attn" in k for k in moved), moved[:5]

@pytest.mark.parametrize("student", [[], LORA], ids=["full", "lora"])
def test_two_process_ddp(tmp_path, teacher, student):
    res = run_cli("-m", "accelerate.commands.launch", "--config_file", TWO_PROCESSES,
                  "--main_process_port", str(free_port()), DRIVER, "--check-ddp-sync", DEMO,
                  *overrides(tmp_path, "ddp", teacher, "updates=2", "save_every=2", "batch_size=8", *student),
                  env={"OMP_NUM_THREADS": "1"})
    assert res.stdout.count("weights identical on 2 processes") >= 1, res.stdout[-2000:]
    info = json.loads((tmp_path / "ck" / "ddp" / "info.json").read_text())
    assert info["num_processes"] == 2 and info["update"] == 2

@pytest.mark.parametrize("extra, says", [
    (["dmd_t_min=0.5", "dmd_t_max=0.4"], "key 'dmd_t_min': 0.5 is not below dmd_t_max=0.4"),
    (["module_filters=['.attn']", "train_tokens=[['[x]', 'cat']]"], "train_tokens and text_encoder_adapter are not"),
    (["align_encoder=tiny"], "unset align_encoder"),
    # the student's off-turn gradient is zero: a momentum or weight decay would still move it
    (["adam_betas=[0.9, 0.999]"], "optimizer 'adamw' still moves it by its first moment (beta1 0.9)"),
    (["optimizer=lion"], "optimizer 'lion' still moves it by its state"),
    (["gan_classifier_weight=0"], "key 'gan_classifier_weight': 0 with gan_weight=0.003 leaves the classifier at its"),
    (["gan_weight=-1"], "gan_weight"),
])
def test_refusals_are_one_line(tmp_path, teacher, extra, says):
    from cascade_nb.config import load_config, ConfigError
    with pytest.raises(ConfigError, match=".*") as e:
        load_config(DEMO, overrides(tmp_path, "r", teacher, *extra))
    assert says in str(e.value) and "\n" not in str(e.value)

def test_fsdp_is_refused_in_one_line(tmp_path, teacher):
    res = run_cli("-m", "accelerate.commands.launch", "--config_file", TWO_PROCESSES,
                  "--main_process_port", str(free_port()), DRIVER, "--fsdp-cpu", DEMO,
                  *overrides(tmp_path, "fsdp", teacher, "updates=1", "batch_size=8"), env={"OMP_NUM_THREADS": "1"},
                  check=False)
    assert res.returncode != 0 and "FSDP2 cannot" in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]
