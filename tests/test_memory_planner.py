"""The memory planner: CLI, the official 3.6B run above 70 GB (the report's 75 GB peak), the report's staircase,
suggestions that fit, and the activation model within 20% of what autograd really keeps on CPU."""
import pytest
from conftest import ROOT, run_cli
from cascade_nb.memory import (plan_memory, official_config, suggest, calibration_rows, RECOMMENDED, GB,
                               activation_bytes, measure_saved_bytes, Precision)

def test_official_config_is_above_70_gb():
    plan = plan_memory(official_config())
    assert 70 < plan.peak_gb < 80, plan.table()

def test_report_staircase_after_load_and_optimizer():
    rows = plan_memory(official_config(mixed_precision="no")).rows   # the reference: fp32 encoders, fp32 weights
    loaded = rows["generator weights"] + rows["frozen encoders (clip_text, clip_image, effnet, previewer)"]
    assert abs(loaded / GB - 18.5) < 0.2 and abs((loaded + rows["optimizer state (adamw)"]) / GB - 47.2) < 0.2

@pytest.mark.parametrize("name", list(RECOMMENDED))
def test_recommended_settings_meet_targets(name):
    budget, overrides = RECOMMENDED[name]
    assert plan_memory(official_config(**overrides)).peak_gb <= budget

def test_suggestions_fit_and_each_step_helps():
    steps = suggest(official_config(), 24)
    assert steps[-1].plan.peak_gb <= 24
    assert all(a.plan.peak > b.plan.peak for a, b in zip(steps, steps[1:]))

def test_bf16_weights_are_suggested_with_stochastic_rounding_where_it_runs():
    "bench/RESULTS.md, bf16_demo: rounded to nearest, bf16 weights trained worse than fp32; stochastically, as well."
    for steps in (suggest(official_config(), 24), suggest(official_config(batch_size=8), 12)):
        bf16 = [s for s in steps if s.overrides.get("dtype") == "bfloat16" and not s.fsdp]   # FSDP upcasts to fp32
        assert bf16 and all(s.overrides.get("stochastic_rounding") for s in bf16), [s.label for s in steps]
        assert "stochastic rounding: every update kept" in " ".join(bf16[0].plan.notes)
    # two processes: no fused backward, so round-to-nearest is the bf16 step, and the plan says what it loses
    two = [s for s in suggest(official_config(batch_size=8), 12, world_size=2) if s.overrides.get("dtype")]
    assert two[0].label == "bf16 weights, rounded to nearest (dtype=bfloat16)" and not two[0].fsdp
    assert any(n.startswith("bf16 trained weights rounded to nearest") for n in two[0].plan.notes)

def test_fsdp_shards_weights_grads_and_optimizer():
    one, eight = plan_memory(official_config(batch_size=8), 8, False), plan_memory(official_config(batch_size=8), 8, True)
    for k in ("generator weights", "gradients", "optimizer state (adamw)"):
        assert eight.rows[k] * 8 == pytest.approx(one.rows[k], rel=1e-6)

def test_lora_has_no_generator_gradients():
    plan = plan_memory(official_config(module_filters=[".attn"], rank=4))
    assert plan.rows["gradients"] < 0.001 * plan.rows["generator weights (frozen)"]

@pytest.fixture(scope="module")
def rows(): return calibration_rows()

def test_activation_model_within_20_percent(rows):
    assert len(rows) >= 9
    bad = [r for r in rows if not 0.8 <= r["ratio"] <= 1.2]
    assert not bad, bad

def test_activations_scale_with_batch():
    from cascade_nb.memory import calibration_models
    m = calibration_models()["tiny"]
    est = [activation_bytes(m, b, 8, Precision(4, device="cpu")).kept for b in (1, 3)]
    meas = [measure_saved_bytes(m, b, 8) for b in (1, 3)]
    assert est[1] == 3 * est[0] and 0.8 < (est[1] - est[0]) / (meas[1] - meas[0]) < 1.2

def test_cli_prints_table_and_suggestions():
    res = run_cli("-m", "cascade_nb.memory", ROOT / "configs" / "demo.yaml", "batch_size=4", "--budget", "0.0001")
    assert "nothing in the list fits" in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("peak per GPU ≈ ")
    res = run_cli("-m", "cascade_nb.memory", ROOT / "configs" / "demo.yaml", "model_version=3.6B", "model_overrides={}",
                  "latent_space=cached", "image_size=768", "batch_size=1", "--budget", "24")
    assert "fits 24 GB:" in res.stdout, res.stdout
    assert "with the changes above" in res.stdout.strip().splitlines()[-1]

def test_cli_config_error_exits_2():
    res = run_cli("-m", "cascade_nb.memory", ROOT / "configs" / "demo.yaml", "learning_rate=1", check=False)
    assert res.returncode == 2 and "unknown key 'learning_rate'" in res.stderr

def test_effnet_backbone_constant():
    "The ControlNet backbone's activations per input pixel (EfficientNetV2-S, BatchNorm in eval mode as ControlNet runs it)."
    from cascade_nb.memory import backbone_saved_per_pixel, EFFNET_SAVED_PER_PIXEL
    from cascade_nb.models.effnet import EfficientNetEncoder
    per_pixel = backbone_saved_per_pixel(EfficientNetEncoder.from_preset("v2_s").backbone.eval(), 128)
    assert abs(per_pixel / EFFNET_SAVED_PER_PIXEL - 1) < 0.05

def test_controlnet_count_matches_the_module():
    import torch
    from cascade_nb.controlnet import ControlNet
    cfg = official_config(controlnet_filter="CannyFilter", controlnet_blocks=[0, 4, 8, 12, 51, 55, 59, 63])
    with torch.device("meta"): n = sum(p.numel() for p in ControlNet(1, 2048, (0, 4, 8, 12, 51, 55, 59, 63)).parameters())
    assert plan_memory(cfg).rows["controlnet weights"] == n * 4     # the trainer keeps the ControlNet in fp32

@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
@pytest.mark.parametrize("world_size,fsdp", [(1, False), (2, True), (8, True)])
def test_suggestions_never_combine_adamw8bit_with_fsdp(optimizer, world_size, fsdp):
    for budget in (80, 40, 24, 12, 6):
        for s in suggest(official_config(batch_size=8, optimizer=optimizer), budget, world_size, fsdp):
            assert not (s.fsdp and (s.overrides.get("optimizer") or optimizer) == "adamw8bit"), (budget, s.label, s.overrides)
            assert "adamw8bit" not in s.plan.summary or not s.fsdp

def test_adamw8bit_with_fsdp_is_refused():
    from cascade_nb.config import ConfigError
    with pytest.raises(ConfigError, match="cannot run under FSDP"):
        plan_memory(official_config(optimizer="adamw8bit"), 8, fsdp=True)
    res = run_cli("-m", "cascade_nb.memory", ROOT / "configs" / "demo.yaml", "optimizer=adamw8bit", "--world-size", "2",
                  "--fsdp", check=False)
    assert res.returncode == 2 and "cannot run under FSDP" in res.stderr
