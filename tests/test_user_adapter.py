"""A user's adapter type with one option of its own (tests/user_adapter.py, a module under `imports:`): `adapter_args`
sets the option and is checked when the config loads; the LoRA demo (configs/lora_demo.yaml, with its new token, on a
tiny stand-in for the demo model) trains with it, a kill and resume ends bit for bit where the uninterrupted run was,
`export --to cascade_nb` writes it with its option in the header, the lone file loads with its option back on the type,
and `lora check` reads it like a built-in type (issue 45)."""
import json, os
import pytest
from safetensors import safe_open
from conftest import ROOT, run_cli
from test_lora_train import info, pretrained_tiny
from test_train import resumes_to_the_killed_state

TESTS = ROOT / "tests"
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")) if p)}
USER = ["imports=[user_adapter]", "adapter=pair", "adapter_args={init_std: 0.05}"]

@pytest.mark.parametrize("args, error", [
    (["adapter_args={bogus: 1}"], "key 'adapter_args': 'bogus' is not an option of adapter 'pair' (its options: init_std)"),
    (["adapter_args={init_st: 0.1}"], "did you mean 'init_std'?"),
    (["adapter_args={init_std: 5}"], "'init_std': 5 is out of range; expected in (0, 1]"),
    (["adapter=lora", "adapter_args={init_std: 0.1}"], "not an option of adapter 'lora' (its options: none)")])
def test_unknown_or_bad_option_refused_at_load(args, error):
    from cascade_nb.config import load_config, ConfigError
    base = ["webdataset_path=data_samples/emoji", "imports=[user_adapter]", "adapter=pair"]
    with pytest.raises(ConfigError) as e: load_config(ROOT / "configs" / "lora_demo.yaml", base + args)
    assert error in str(e.value) and "\n" not in str(e.value), str(e.value)

def test_option_reaches_the_type():
    from cascade_nb.config import load_config
    from cascade_nb.lora_training import adapter_keys
    cfg = load_config(ROOT / "configs" / "lora_demo.yaml", ["webdataset_path=data_samples/emoji", *USER])
    cls, keys = adapter_keys(cfg.lora)
    assert (cls.kind, keys) == ("pair", {"rank": 4, "lora_alpha": 1.0, "init_std": 0.05})

def demo_args(tmp, name, *extra):
    "configs/lora_demo.yaml as shipped (its filters, rank, new token, lr), a few small updates on a tiny base."
    base = pretrained_tiny(tmp / "pretrained.safetensors")
    return [ROOT / "configs" / "lora_demo.yaml", f"generator_checkpoint_path={base}", f"experiment_id={name}",
            f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", "num_workers=0", "batch_size=4", "log_every=1", "warmup_updates=1", "sample_steps=2", *extra]

def test_user_type_trains_resumes_exports_and_is_checked(tmp_path):
    from cascade_nb.lora_file import adapter_file_options, adapter_options, load_adapter_file, load_lora
    from cascade_nb.models.stage_c import load_stage_c
    run = tmp_path / "ckpt" / "u"
    resumes_to_the_killed_state(run, demo_args(tmp_path, "u", "updates=6", "save_every=2", *USER))
    assert info(tmp_path, "u")["update"] == 6
    with safe_open(str(run / "lora.safetensors"), "pt") as f: keys, meta = set(f.keys()), f.metadata()
    assert meta["cascade_nb.adapter_type"] == "pair"
    assert json.loads(meta["cascade_nb.adapter_options"]) == {"init_std": 0.05}
    assert any(k.endswith(".pair_a") for k in keys) and not any(".lora_" in k for k in keys)
    out = tmp_path / "pair.safetensors"
    run_cli("-m", "cascade_nb.lora", "export", run, "--to", "cascade_nb", "--out", out, "--import", "user_adapter",
            env=ENV)
    with safe_open(str(out), "pt") as f: exported = f.metadata()
    assert exported["cascade_nb.adapter_type"] == "pair"
    assert json.loads(exported["cascade_nb.adapter_options"]) == {"init_std": 0.05}
    import user_adapter  # noqa: F401  (registers 'pair' here, as `imports:` does in a run)
    model = load_stage_c(tmp_path / "pretrained.safetensors")
    load_lora(model, {k: v for k, v in load_adapter_file(out).items() if not k.startswith("tokens.")},
              options=adapter_file_options(out))
    assert adapter_options(model) == {"init_std": 0.05}   # the lone file's option, back on the type
    res = run_cli("-m", "cascade_nb.lora", "check", out, "--model", tmp_path / "pretrained.safetensors",
                  "--import", "user_adapter", env=ENV, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " pair " in res.stdout, res.stdout[-3000:]
