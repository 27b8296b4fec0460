"""Each memory option through the real trainer CLI at tiny size on CPU: bf16 weights, gradient checkpointing,
EMA on CPU and the recommended LoRA combination (8-bit AdamW: tests/test_optimizers.py)."""
import pytest
import torch
from safetensors.torch import load_file
from conftest import ROOT, run_cli

BASE = ["webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "image_size=32", "batch_size=4",
        "log_every=1", "lr=1e-3", "updates=2", "save_every=2", "warmup_updates=1", "ema_start_iters=1", "ema_iters=1",
        "ema_beta=0.9", "tracker=none", "sample_steps=2"]

def train(tmp, name, *options, check=True):
    return run_cli("-m", "cascade_nb.train", ROOT / "configs" / "demo.yaml", *BASE, f"experiment_id={name}",
                   f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *options, check=check)

def released(tmp, name, which="generator"):
    return load_file(str(tmp / "ckpt" / name / f"{which}.safetensors"))

@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory_baseline")
    train(tmp, "base")
    return tmp

def assert_close(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, worst

def test_gradient_checkpointing_and_ema_on_cpu_give_the_same_weights(tmp_path, baseline):
    "Two options in one run (each run costs ~10 s of start-up): recomputation and the EMA's device change no number."
    res = train(tmp_path, "ckpt", "gradient_checkpointing=true", "ema_on_cpu=true")
    assert "full training" in res.stdout
    assert_close(released(tmp_path, "ckpt"), released(baseline, "base"))
    assert_close(released(tmp_path, "ckpt", "generator_ema"), released(baseline, "base", "generator_ema"))

def test_bf16_weights_with_bf16_autocast(tmp_path, baseline):
    train(tmp_path, "bf16", "dtype=bfloat16", "mixed_precision=bf16")
    sd, ref = released(tmp_path, "bf16"), released(baseline, "base")
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}
    assert {v.dtype for v in released(tmp_path, "bf16", "generator_ema").values()} == {torch.bfloat16}
    assert_close(sd, ref, atol=0.05)   # two updates at lr ≤ 1e-3: bf16 rounding only

def test_bf16_weights_without_autocast(tmp_path):
    train(tmp_path, "bf16_noamp", "dtype=bfloat16", "mixed_precision=no")
    assert {v.dtype for v in released(tmp_path, "bf16_noamp").values()} == {torch.bfloat16}

def test_lora_with_the_recommended_memory_options(tmp_path):
    res = train(tmp_path, "lora", "module_filters=['.attn']", "rank=4", "dtype=bfloat16", "mixed_precision=bf16",
                "gradient_checkpointing=true")
    assert "lora training" in res.stdout and (tmp_path / "ckpt" / "lora" / "lora.safetensors").exists(), res.stdout[-2000:]

def test_the_trainer_builds_a_checkpointing_generator_that_keeps_less():
    from cascade_nb.config import load_config
    from cascade_nb.modes import build_generator
    from cascade_nb.memory import measure_saved_bytes
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["gradient_checkpointing=true"], training=False)
    gen = build_generator(cfg)
    assert gen.gradient_checkpointing
    kept = measure_saved_bytes(gen, 2, 16, checkpointing=True)
    assert kept < 0.3 * measure_saved_bytes(gen, 2, 16, checkpointing=False)
