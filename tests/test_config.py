"Config loading: every official key and file, overrides, and the error messages users see."
from fractions import Fraction
import pytest
from cascade_nb.config import ConfigError, key_sections, load_config, save_config
from conftest import ROOT, run_cli
from official_configs import OFFICIAL_CONFIGS, OFFICIAL_KEYS

def test_every_official_key_is_known():
    "Known to every process that loads configs: the LoRA and ControlNet keys too (`BUILTIN_PARTS`)."
    load_config(None, training=False)   # loading imports the modules of the built-in parts
    missing = [k for k in OFFICIAL_KEYS if k not in key_sections()]
    assert not missing, missing

@pytest.mark.parametrize("name", sorted(OFFICIAL_CONFIGS))
def test_official_file_loads_and_round_trips(name, tmp_path):
    path = tmp_path / name
    path.write_text(OFFICIAL_CONFIGS[name])
    cfg = load_config(path)
    assert cfg.checkpoint.experiment_id.startswith("stage_")
    assert cfg.data.webdataset_path[0].startswith("s3://")
    expected_mode = "lora" if "lora" in name else "controlnet" if name.startswith("controlnet") else "full"
    assert cfg.train.mode == expected_mode
    assert cfg.model.stage == ("b" if "_b_" in name else "c")
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml").flat() == cfg.flat()

def test_every_official_key_in_one_file(tmp_path):
    "All official keys at once, with values of the official forms."
    text = "\n".join([
        "experiment_id: e", "checkpoint_path: c", "output_path: o", "model_version: 3.6B", "wandb_project: p",
        "wandb_entity: u", "lr: 1.0e-4", "batch_size: 8", "image_size: 768", "multi_aspect_ratio: [1/1, 9/16]",
        "grad_accum_steps: 2", "updates: 10", "backup_every: 5", "save_every: 5", "warmup_updates: 1", "use_fsdp: True",
        "adaptive_loss_weight: True", "ema_start_iters: 5", "ema_iters: 1", "ema_beta: 0.9", "shift: 4", "offset_noise: 0.1",
        "dtype: bfloat16", "webdataset_path: file:data.tar", "dataset_filters: [['width', 'lambda w: w >= 768']]",
        "captions_getter: ['txt', identity]", "module_filters: ['.attn']", "rank: 4", "train_tokens: [['[x]', '^dog</w>']]",
        "controlnet_blocks: [0, 4]", "controlnet_filter: CannyFilter", "controlnet_filter_params: {resize: 224}",
        "controlnet_bottleneck_mode: effnet", "effnet_checkpoint_path: e.safetensors", "previewer_checkpoint_path: p.safetensors",
        "generator_checkpoint_path: g.safetensors", "stage_a_checkpoint_path: a.safetensors", "edm_objective: True"])
    keys_in_text = {line.split(":")[0] for line in text.splitlines()}
    assert keys_in_text == set(OFFICIAL_KEYS)
    (tmp_path / "all.yaml").write_text(text)
    cfg = load_config(tmp_path / "all.yaml", ["train.mode=lora"])
    assert cfg.data.multi_aspect_ratio == [Fraction(1), Fraction(9, 16)]
    assert cfg.data.dataset_filters[0]({"width": 800}) and not cfg.data.dataset_filters[0]({"width": 700})
    assert cfg.gdf.shift == 4.0 and cfg.model.dtype == "bfloat16" and cfg.gdf.loss_weight == "adaptive"

@pytest.mark.parametrize("override, message", [
    ("learnig_rate=1", "unknown key 'learnig_rate'; did you mean 'lr'"),
    ("batchsize=4", "did you mean 'batch_size'"),
    ("lr=fast", "key 'lr': 'fast' is not valid; expected float"),
    ("rank=four", "key 'rank': 'four' is not valid"),
    ("multi_aspect_ratio=[1/2, x]", "multi_aspect_ratio[1]"),
    ("lr_schedule=step", "key 'lr_schedule': 'step' is not a registered lr schedule"),
    ("lr_schedule=cosin", "did you mean 'cosine'?"),
    ("optimizer=adam", "key 'optimizer': 'adam' is not a registered optimizer; did you mean 'adamw'"),
    ("sample_sampler=ddmp", "key 'sample_sampler': 'ddmp' is not a registered sampler; did you mean 'ddpm'"),
    ("dataset_filters=[[width, 'lambda w: __import__(\"os\").system(\"id\")']]", "Call is not allowed"),
    ("dataset_filters=[[width, 'lambda w: w.real > 1']]", "Attribute is not allowed"),
    ("dataset_filters=[[width, 'lambda w: y > 1']]", "unknown name 'y'"),
    ("caption_dropout=1.5", "key 'caption_dropout': 1.5 is out of range; expected a probability in [0, 1]"),
    ("log_every=0", "key 'log_every': 0 is out of range; expected >= 1"),
    ("sample_steps=0", "key 'sample_steps': 0 is out of range; expected >= 1"),
    ("grad_clip=-1", "key 'grad_clip': -1.0 is out of range; expected > 0"),
    ("lr=inf", "key 'lr': inf is out of range; expected > 0"),
    ("lr=nan", "key 'lr': nan is out of range; expected > 0"),
    ("adam_betas=[2, 3]", "key 'adam_betas[0]': 2.0 is out of range; expected in [0, 1)"),
    ("num_workers=-1", "key 'num_workers': -1 is out of range; expected >= 0"),
    ("weight_decay=-1", "key 'weight_decay': -1.0 is out of range; expected >= 0"),
    ("controlnet_blocks=[0, -2]", "key 'controlnet_blocks[1]': -2 is out of range; expected >= 0"),
    ("dtype=float16", "overflows fp16"),
])
def test_errors_name_key_value_and_expectation(override, message, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(OFFICIAL_CONFIGS["finetune_c_3b.yaml"])
    with pytest.raises(ConfigError, match=None) as e: load_config(path, [override])
    assert message in str(e.value), str(e.value)

def test_unknown_key_in_file_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(OFFICIAL_CONFIGS["finetune_c_3b.yaml"] + "ema_betta: 0.9\n")
    with pytest.raises(ConfigError) as e: load_config(path)
    assert str(path) in str(e.value) and "'ema_beta'" in str(e.value)

def test_missing_required_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="required key 'experiment_id'"): load_config(None, ["webdataset_path=x"])
    with pytest.raises(ConfigError, match="required key 'webdataset_path'"): load_config(None, ["experiment_id=x"])
    with pytest.raises(ConfigError, match="does not exist"): load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"): load_config(tmp_path / "list.yaml")

FRESH = '''
import glob, sys
from cascade_nb.config import load_config, ConfigError
assert "torch" not in sys.modules, "import cascade_nb.config imported torch"
for f in sorted(glob.glob("configs/*.yaml")): load_config(f)
cases = [("configs/demo.yaml", "mode=bogus", "key 'mode'", "full, lora"),
         ("configs/demo.yaml", "loss_weight=bogus", "key 'loss_weight'", "min_snr"),
         ("configs/demo.yaml", "optimizer=bogus", "key 'optimizer'", "adamw8bit"),
         ("configs/demo.yaml", "sample_sampler=bogus", "key 'sample_sampler'", "ddim"),
         ("configs/demo.yaml", "noise_schedule=nonsense", "key 'noise_schedule'", "cosine"),
         ("configs/lora_demo.yaml", "adapter=bogus", "key 'adapter'", "lokr"),
         ("configs/lora_demo.yaml", "lora_init=bogus", "key 'lora_init'", "peft"),
         ("configs/controlnet_demo.yaml", "controlnet_filter=CanyFilter", "key 'controlnet_filter'", "CannyFilter")]
for path, override, key, choice in cases:
    try: load_config(path, [override])
    except ConfigError as e: assert key in str(e) and choice in str(e) and "\\n" not in str(e), str(e)
    else: raise AssertionError(f"{override} was accepted")
print("same verdict")
'''

def test_a_fresh_process_that_imports_only_the_config_gives_the_same_verdict():
    """`from cascade_nb.config import load_config` alone (no torch on import): every shipped config loads, and each
    bad choice is refused in one line naming the key and the registered choices (`BUILTIN_PARTS`)."""
    res = run_cli("-c", FRESH)
    assert "same verdict" in res.stdout, res.stdout + res.stderr

def test_resume_keys_are_the_sections_own():
    "Each section names the keys a resume must keep; the LoRA and ControlNet sections add theirs (adapter_args too)."
    from cascade_nb.config import resume_keys, SECTIONS, load_config
    load_config(ROOT / "configs" / "lora_demo.yaml", ["webdataset_path=data_samples/emoji"])
    keys = resume_keys()
    assert {"model_version", "mode", "optimizer", "rank", "adapter", "adapter_args", "controlnet_blocks"} <= set(keys)
    assert SECTIONS["lora"].resume_keys and "adapter_args" in SECTIONS["lora"].resume_keys
