"""ControlNet training through the real trainer CLI: the official ControlNet YAMLs at tiny size, exact resume after a
kill, 2-process DDP with the EMA of the trained tensors, and a frozen generator."""
import warnings
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file
from conftest import ROOT, free_port, run_cli
from official_configs import OFFICIAL_CONFIGS
from test_train import resumes_to_the_killed_state
from test_lora_train import pretrained_tiny, info

DRIVER = ROOT / "tests" / "train_driver.py"
TINY = ["model_version=tiny", "model_overrides={c_in: 3, c_out: 3, patch_size: 2}", "latent_space=pixels",
        "clip_text_model_name=tiny", "clip_image_model_name=null", "effnet_checkpoint_path=null",
        "previewer_checkpoint_path=null", "wandb_project=null", "tracker=none", "dataset_filters=null",
        "webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "image_size=32", "batch_size=4",
        "log_every=1", "lr=1e-3", "warmup_updates=2", "sample_steps=2", "use_fsdp=false"]
SIMPLE = ["controlnet_bottleneck_mode=simple"]   # small and fast for resume / DDP

def cnet_args(tmp, name, config="controlnet_c_3b_canny.yaml", *extra):
    Path(tmp).mkdir(parents=True, exist_ok=True)
    cfg = Path(tmp) / config
    cfg.write_text(OFFICIAL_CONFIGS[config])
    return [cfg, *TINY, f"generator_checkpoint_path={pretrained_tiny(Path(tmp) / 'pretrained.safetensors')}",
            f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *extra]

def released(tmp, name): return load_file(str(Path(tmp) / "ckpt" / name / "controlnet.safetensors"))

@pytest.mark.parametrize("config", ["controlnet_c_3b_canny.yaml", "controlnet_c_3b_inpainting.yaml"])
def test_official_controlnet_config_trains_at_tiny_size(config, tmp_path):
    "The official keys as they are (effnet bottleneck, blocks [0, 4, 8, 12, 51, 55, 59, 63], offset noise) at tiny size."
    run_cli("-m", "cascade_nb.train", *cnet_args(tmp_path, "c", config, "updates=2", "save_every=2"), env={"OMP_NUM_THREADS": "1"})
    i = info(tmp_path, "c")
    assert i["update"] == 2
    run = tmp_path / "ckpt" / "c"
    assert not (run / "generator.safetensors").exists()
    sd = released(tmp_path, "c")
    from cascade_nb.controlnet import load_controlnet, controlnet_config
    want_c_in = {"controlnet_c_3b_canny.yaml": 1, "controlnet_c_3b_inpainting.yaml": 4}[config]
    assert controlnet_config(sd) == dict(c_in=want_c_in, c_proj=64, bottleneck_mode="effnet", n_proj=8)
    load_controlnet(sd, [0, 4, 8, 12, 51, 55, 59, 63])                          # official layout, strict
    # the zero-initialised projections of the injected blocks (ResBlocks 0 and 4 of six) learned
    assert sd["projections.0.2.weight"].abs().sum() > 0 and sd["projections.1.2.weight"].abs().sum() > 0
    if "inpainting" in config: assert i["config"]["offset_noise"] == 0.1
    assert (tmp_path / "out" / "c" / "000002.png").exists()

RUN = ["updates=6", "save_every=2", *SIMPLE]

def test_controlnet_resume_after_kill_is_bit_identical(tmp_path):
    "Inpainting draws random masks: killed committing update 4 and resumed, it commits the killed process's own state."
    resumes_to_the_killed_state(tmp_path / "ckpt" / "r", cnet_args(tmp_path, "r", "controlnet_c_3b_inpainting.yaml", *RUN))
    assert info(tmp_path, "r")["update"] == 6

def test_controlnet_two_process_ddp_and_its_ema(tmp_path):
    """2 processes under DDP: the weights stay identical on both, and the EMA of the trained tensors (each process
    averages whole tensors; no frozen generator in it) is released as `controlnet_ema.safetensors` with the keys of
    `controlnet.safetensors` and the EMA by hand of the trained ones (tests/train_driver.py --ema-probe), and is what
    the run samples with."""
    from test_lora_ema import EMA_KEYS, state_ema_keys
    from cascade_nb.sample import run_generator
    run_dir, reference = tmp_path / "ckpt" / "ddp", tmp_path / "reference.safetensors"
    res = run_cli("-m", "accelerate.commands.launch", "--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml",
                  "--main_process_port", str(free_port()), DRIVER, "--check-ddp-sync", "--ema-probe", reference,
                  *cnet_args(tmp_path, "ddp", "controlnet_c_3b_canny.yaml", *EMA_KEYS, "save_every=4", "batch_size=8",
                             *SIMPLE, "controlnet_filter_params={resize: 32}"),
                  env={"OMP_NUM_THREADS": "1"})
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    i = info(tmp_path, "ddp")
    assert i["num_processes"] == 2 and i["update"] == 4
    ema, live = (load_file(str(run_dir / f"controlnet{s}.safetensors")) for s in ("_ema", ""))
    averaged = state_ema_keys(run_dir)
    assert averaged and all(k.startswith("controlnet.") for k in averaged)      # no frozen generator
    want = {k.removeprefix("controlnet."): v for k, v in load_file(str(reference)).items() if k in averaged}
    assert ema.keys() == live.keys() and len(want) == len(averaged)
    assert all(torch.equal(ema[k], want[k]) for k in want)
    assert not all(torch.equal(ema[k], live[k]) for k in want)
    assert run_generator(run_dir)[2].name == "controlnet_ema.safetensors"

def test_controlnet_step_leaves_the_generator_frozen():
    from cascade_nb.config import config_from_dict
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace, diffusion_loss
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.controlnet import ControlNetTraining
    cfg = config_from_dict(dict(experiment_id="x", webdataset_path="data_samples/emoji", model_version="tiny",
                                model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2}, latent_space="pixels",
                                clip_text_model_name="tiny", clip_image_model_name=None, image_size=32, batch_size=2,
                                controlnet_blocks=[0, 2, 5], controlnet_filter="InpaintFilter", controlnet_bottleneck_mode="simple"))
    torch.manual_seed(0)
    gen = build_generator(cfg); tok, te = build_text_encoder(cfg)
    with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)
    mode = ControlNetTraining(cfg, gen, tok, te, None, PixelSpace())
    before = {k: v.clone() for k, v in gen.state_dict().items()}
    opt = torch.optim.AdamW([p for p in mode.net.parameters() if p.requires_grad], lr=1e-2)
    x0, conds = mode.encode({"images": torch.rand(2, 3, 32, 32), "captions": ["a", "b"]}, "cpu", rng=torch.Generator().manual_seed(0))
    assert conds["cnet_input"].shape == (2, 4, 32, 32)
    for step in range(2):
        loss, _, _ = diffusion_loss(mode.net, gdf_from_config(cfg.gdf), x0, conds, rng=torch.Generator().manual_seed(step))
        loss.backward()
        with_grad = [n for n, p in mode.net.named_parameters() if p.grad is not None]
        assert with_grad and all(n.startswith("controlnet.") for n in with_grad)
        opt.step(); opt.zero_grad()
    assert all(torch.equal(before[k], v) for k, v in gen.state_dict().items())
    assert mode.net.controlnet.projections[0][2].weight.abs().sum() > 0

def test_official_identity_config_explains_the_missing_face_models(tmp_path):
    res = run_cli("-m", "cascade_nb.train", *cnet_args(tmp_path, "id", "controlnet_c_3b_identity.yaml", "updates=1"), check=False)
    assert res.returncode != 0 and "IdentityFilter needs face detection" in res.stderr

def _repeat_mode(blocks):
    "A ControlNet mode on the tiny pixel model whose deeper level runs twice (block_repeat): 6 ResBlocks, 10 calls."
    from cascade_nb.config import config_from_dict
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace
    from cascade_nb.controlnet import ControlNetTraining
    cfg = config_from_dict(dict(experiment_id="x", webdataset_path="data_samples/emoji", model_version="tiny",
                                model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2,
                                                 "block_repeat": [[1, 2], [2, 1]]},
                                latent_space="pixels", clip_text_model_name="tiny", clip_image_model_name=None,
                                image_size=32, batch_size=2, controlnet_blocks=blocks, controlnet_filter="CannyFilter",
                                controlnet_filter_params={"resize": 32}, controlnet_bottleneck_mode="simple"))
    torch.manual_seed(0)
    gen = build_generator(cfg); tok, te = build_text_encoder(cfg)
    # a non-zero output layer (the official init zeroes it), so every hint reaches the loss
    with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mode = ControlNetTraining(cfg, gen, tok, te, None, PixelSpace())
    return cfg, mode, [str(x.message) for x in w if "never injected" in str(x.message)]

def test_block_repeat_counts_every_call_as_an_injection_point():
    from cascade_nb.modes import diffusion_loss
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.models.blocks import ResBlock
    cfg, mode, warned = _repeat_mode(list(range(10)))
    gen = mode.net.generator
    assert sum(isinstance(m, ResBlock) for m in gen.modules()) == 6 and not warned
    projections = mode.net.controlnet.projections
    assert all(p.requires_grad for p in projections.parameters())
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    x0, conds = mode.encode({"images": images, "captions": ["a", "b"]}, "cpu", rng=torch.Generator().manual_seed(0))
    loss, _, _ = diffusion_loss(mode.net, gdf_from_config(cfg.gdf), x0, conds, rng=torch.Generator().manual_seed(1))
    loss.backward()
    # each of the ten projections is injected, so each zero-initialised output conv gets a gradient
    assert all(p[2].weight.grad is not None and p[2].weight.grad.abs().sum() > 0 for p in projections)
    # past the tenth call: warned and frozen, the others still train
    _, mode, warned = _repeat_mode([0, 9, 10])
    assert len(warned) == 1 and "takes 10 hints" in warned[0] and "indices ≥ 10" in warned[0]
    assert [p[2].weight.requires_grad for p in mode.net.controlnet.projections] == [True, True, False]

def test_controlnet_on_a_lora_base(tmp_path):
    """`lora_checkpoint_path` in a ControlNet run: a LoKr (cascade_nb's layout) is merged into the frozen base for
    training and again when the run samples; the state and the release hold only the ControlNet."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.sample import run_generator
    from cascade_nb.models.stage_c import load_stage_c
    from cascade_nb.adapters import apply_lora
    from cascade_nb.lora_file import lora_state_dict, save_lora, merge_lora
    args = cnet_args(tmp_path, "cl", "controlnet_c_3b_canny.yaml", "updates=1", "save_every=1", *SIMPLE)
    base_path = next(a for a in map(str, args) if a.startswith("generator_checkpoint_path=")).split("=", 1)[1]
    adapted = load_stage_c(base_path).float()
    apply_lora(adapted, [".attn"], rank=2, adapter="lokr")
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad: p.normal_(0, 0.05)                     # a LoKr that changes the weights
    lora = {k: v.clone() for k, v in lora_state_dict(adapted).items()}
    save_lora(lora, tmp_path / "lokr.safetensors")
    res = train(load_config(args[0], [*map(str, args[1:]), f"lora_checkpoint_path={tmp_path / 'lokr.safetensors'}"]))
    expected = merge_lora(load_stage_c(base_path).float(), lora).state_dict()
    trained = res["net"].generator.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in expected.items())
    cfg, net, weights = run_generator(tmp_path / "ckpt" / "cl")
    assert weights.name == "controlnet.safetensors"
    sampled = net.generator.state_dict()
    assert all(torch.equal(sampled[k].float(), v) for k, v in expected.items())
    base = load_stage_c(base_path).float().state_dict()
    assert any(not torch.equal(sampled[k].float(), v) for k, v in base.items())   # the LoKr is in
