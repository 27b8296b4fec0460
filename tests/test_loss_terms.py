"""Extra loss terms (issue 50, nbs/36_loss_terms): REPA-style feature alignment trains the demo with its projector
inside the generator's state (a kill and resume ends bit for bit where the killed run was), leaves it out of the
released weights, runs on 2 DDP processes, is refused under FSDP in one line, and is counted by the memory planner."""
import pytest
import torch
from safetensors import safe_open
from conftest import ROOT
from test_train import demo_args, info, resumes_to_the_killed_state, _launch_2proc

ALIGN = ["align_encoder=tiny", "align_hidden=32"]

def test_demo_trains_resumes_and_releases_without_the_projector(tmp_path):
    run = tmp_path / "ckpt" / "a"
    resumes_to_the_killed_state(run, demo_args(tmp_path, "a", "updates=6", "save_every=2", *ALIGN))
    i = info(tmp_path, "a")
    assert i["update"] == 6 and i["config"]["align_encoder"] == "tiny"
    with safe_open(str(run / i["state_dir"] / "model.safetensors"), "pt") as f:
        trained = [k for k in f.keys() if k.startswith("loss_terms.feature_alignment.")]
    assert len(trained) == 6, trained                                     # 3 linear layers: weights and biases
    for name in ("generator", "generator_ema"):
        with safe_open(str(run / f"{name}.safetensors"), "pt") as f:
            assert not [k for k in f.keys() if k.startswith("loss_terms")]
    from cascade_nb.sample import load_run                                # samples as a plain generator
    mode, _, _ = load_run(run)
    assert not hasattr(mode.net, "loss_terms")

def test_the_term_adds_to_the_loss_and_validation_leaves_it_out():
    from cascade_nb.config import load_config
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.modes import build_generator, build_training_mode, PixelSpace
    from cascade_nb.loss_terms import build_loss_terms
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["align_encoder=tiny", "align_hidden=32", "align_weight=2"])
    torch.manual_seed(0)
    mode = build_training_mode(cfg, build_generator(cfg), None, None, None, PixelSpace())
    terms = build_loss_terms(mode)
    assert list(terms) == ["feature_alignment"] and "loss_terms.feature_alignment.0.weight" in mode.net.state_dict()
    gdf, x0 = gdf_from_config(cfg.gdf, cfg.recipe), torch.rand(2, 3, 16, 16) * 2 - 1
    conds = dict(clip_text=torch.randn(2, 77, 64), clip_text_pooled=torch.randn(2, 1, 64))
    batch = {"images": ((x0 + 1) * 127.5).to(torch.uint8)}
    extras = mode.extras(batch, x0)
    plain, raw, _ = mode.loss(mode.net, gdf, x0, conds, rng=torch.Generator().manual_seed(1))
    with_term, raw2, _ = mode.loss(mode.net, gdf, x0, conds, rng=torch.Generator().manual_seed(1), **extras)
    assert torch.equal(raw, raw2) and 1.5 < (with_term - plain).item() < 2.5   # 2 * (1 - cos) near 2 * 1 at init
    with pytest.raises(Exception, match="FSDP has resharded them"): build_loss_terms(mode, fsdp=True)

def test_two_process_ddp(tmp_path):
    "The projector runs after the generator's forward: DDP still reduces its gradients, the processes stay equal."
    res = _launch_2proc("--check-ddp-sync", *demo_args(tmp_path, "ddp", "updates=2", "save_every=2", "batch_size=8",
                                                       *ALIGN))
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    assert info(tmp_path, "ddp")["num_processes"] == 2

def test_refusals_are_one_line():
    from cascade_nb.config import load_config, ConfigError
    lora = ROOT / "configs" / "lora_demo.yaml"
    with pytest.raises(ConfigError) as e: load_config(lora, ["webdataset_path=data_samples/emoji", *ALIGN])
    assert "key 'align_encoder' belongs to section 'alignment'" in str(e.value) and "\n" not in str(e.value)

def test_memory_planner_counts_the_projector_and_the_encoder():
    from cascade_nb.config import load_config
    from cascade_nb.memory import plan_memory
    over = ["model_version=3.6B", "model_overrides={}", "latent_space=effnet", "image_size=768"]
    plain = plan_memory(load_config(ROOT / "configs" / "demo.yaml", over)).rows
    rows = plan_memory(load_config(ROOT / "configs" / "demo.yaml", [*over, "align_encoder=tiny"])).rows
    n = 2048 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 64 + 64                # 2048 wide at the 3.6B's middle
    assert rows["feature alignment projector (weights, gradients)"] == 2 * 4 * n
    assert rows["feature alignment projector (optimizer state)"] == 2 * 4 * n   # AdamW's two moments in fp32
    assert rows["feature alignment encoder (tiny)"] > 0 and set(plain) < set(rows)
