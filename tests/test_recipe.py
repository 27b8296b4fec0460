"""The recipe keys (nbs/16b_gdf.recipe) across modules: refused in one line by the modes whose loss is not
`diffusion_loss`, and wired into the GDF and the loss the trainer builds. Training with them (exact resume, 2-process
DDP) is in tests/test_train.py."""
import pytest, torch
from conftest import ROOT
from cascade_nb.config import load_config, ConfigError
import cascade_nb.modes as M
from cascade_nb.gdf.presets import gdf_from_config
from cascade_nb.gdf.recipe import DensitySchedule, ModeDensity, ParabolaTDensity, schedule_at_update

DEMO = [f"webdataset_path={ROOT / 'data_samples' / 'emoji'}"]

# dmd steps its student on some updates only: an optimizer that moves it at a zero gradient is refused first
MODE_KEYS = {"dmd": ["adam_betas=[0, 0.999]", "weight_decay=0"]}

@pytest.mark.parametrize("mode", ["lcm", "progressive", "distill", "dmd"])
@pytest.mark.parametrize("key", ["logsnr_max=2", "loss_type=l1", "input_perturbation=0.1", "pyramid_noise_discount=0.3",
                                 "logsnr_max_end=2", "t_density_weight=2"])
def test_distillation_modes_refuse_recipe_keys_in_one_line(mode, key):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "demo.yaml", [*DEMO, f"mode={mode}", "teacher_checkpoint_path=t.safetensors",
                                                     *MODE_KEYS.get(mode, []), key])
    msg = str(e.value)
    assert "\n" not in msg and f"'{key.split('=')[0]}'" in msg and f"mode '{mode}' does not use" in msg, msg

def test_the_trainer_gets_the_recipe():
    cfg = load_config(ROOT / "configs" / "demo.yaml", [*DEMO, "logsnr_min=-3", "timestep_sampling=mode",
                                                       "input_perturbation=0.1", "loss_type=l1"])
    gdf = gdf_from_config(cfg.gdf, cfg.recipe)
    assert isinstance(gdf.schedule, DensitySchedule) and isinstance(gdf.schedule.density, ModeDensity)
    assert gdf.input_perturbation == 0.1 and gdf.schedule(64, generator=torch.Generator()).min() >= -3
    # no recipe key set: the demo's logit-normal draws exactly as before the keys existed
    plain = load_config(ROOT / "configs" / "demo.yaml", DEMO)
    a, b = gdf_from_config(plain.gdf, plain.recipe), gdf_from_config(plain.gdf)
    assert type(a.schedule) is type(b.schedule) and not isinstance(a.schedule, DensitySchedule)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(a.schedule(16, generator=g1), b.schedule(16, generator=g2))

def test_the_trainer_gets_a_moving_range_and_the_densities_over_t():
    "A moving range reaches the GDF with the run's `updates` as its length; the loop's update number moves the draws."
    cfg = load_config(ROOT / "configs" / "demo.yaml", [*DEMO, "logsnr_min=-6", "logsnr_max=-5", "logsnr_min_end=3",
                                                       "logsnr_max_end=4", "updates=10", "timestep_sampling=inverted_parabola",
                                                       "t_density_weight=3", "t_density_bias=-0.2"])
    gdf = gdf_from_config(cfg.gdf, cfg.recipe)
    s = gdf.schedule
    assert isinstance(s.density, ParabolaTDensity) and (s.density.w, s.density.c) == (3, 0.3)
    assert (s.range, s.range_end, s.range_updates) == ((-6, -5), (3, 4), 10)
    for update, (lo, hi) in [(0, (-6, -5)), (5, (-1.5, -0.5)), (10, (3, 4)), (20, (3, 4))]:
        schedule_at_update(gdf, update)
        x = gdf.diffuse(torch.zeros(64, 3, 4, 4), generator=torch.Generator().manual_seed(0)).logsnr
        assert lo - 1e-5 <= x.min() and x.max() <= hi + 1e-5, (update, x.min(), x.max())
