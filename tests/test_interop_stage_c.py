"Stage C interop with diffusers' StableCascadeUNet: equal outputs, exact round trips, agreement with diffusers' own converter."
import pytest, torch
pytest.importorskip("diffusers")
from diffusers import StableCascadeUNet
from cascade_nb.models.stage_c import StageC, save_stage_c, load_stage_c
from cascade_nb.interop_c import (official_to_diffusers, diffusers_to_official, stage_c_config_to_diffusers,
                                stage_c_from_diffusers, stage_c_to_diffusers, DiffusersStageC)

def _tiny_unet(seed=0):
    torch.manual_seed(seed)
    cfg = stage_c_config_to_diffusers(StageC.from_preset("tiny", c_clip_text=32, c_clip_img=24, nhead=(4, 4)).config)
    unet = StableCascadeUNet(**cfg).eval()
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if n.endswith(("gamma", "beta")): p.normal_(0, 0.1)
    return unet

def _inputs(B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(B, 16, 24, 24, generator=g), r=torch.rand(B, generator=g),
                clip_text=torch.randn(B, 77, 32, generator=g), clip_text_pooled=torch.randn(B, 1, 64, generator=g),
                clip_img=torch.randn(B, 1, 24, generator=g))

@torch.no_grad()
def test_from_diffusers_same_output():
    unet, inp = _tiny_unet(), _inputs()
    ours = stage_c_from_diffusers(unet)
    ref = unet(inp["x"], inp["r"], clip_text_pooled=inp["clip_text_pooled"], clip_text=inp["clip_text"],
               clip_img=inp["clip_img"]).sample
    assert ref.abs().mean() > 0.1
    assert (ours(**inp) - ref).abs().max() <= 1e-5

@torch.no_grad()
def test_to_diffusers_same_output_and_exact_round_trip():
    torch.manual_seed(2)
    ours = StageC.from_preset("tiny", c_clip_text=32, c_clip_img=24).eval()
    for p in ours.parameters(): p.normal_(0, 0.05)
    unet = stage_c_to_diffusers(ours)
    inp = _inputs(3)
    assert (DiffusersStageC(unet)(**inp) - ours(**inp)).abs().max() <= 1e-5
    back = stage_c_from_diffusers(unet)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)

def test_key_converter_matches_diffusers_single_file_converter():
    from diffusers.loaders.single_file_utils import convert_stable_cascade_unet_single_file_to_diffusers
    sd = StageC.from_preset("tiny").state_dict()
    ref = convert_stable_cascade_unet_single_file_to_diffusers(sd)
    ours = official_to_diffusers(sd)
    assert set(ours) == set(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    back = diffusers_to_official(ours)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)

def test_official_file_loads_into_both(tmp_path):
    torch.manual_seed(3)
    model = StageC.from_preset("tiny")
    save_stage_c(model, tmp_path / "stage_c.safetensors")
    loaded = load_stage_c(tmp_path)
    unet = stage_c_to_diffusers(loaded)
    from safetensors.torch import load_file
    unet.load_state_dict(official_to_diffusers(load_file(tmp_path / "stage_c.safetensors")), strict=True)

def test_text_without_image_is_not_dropped():
    "diffusers drops clip_text without clip_img; our wrapper and StageC pass a zero image embedding instead."
    unet, inp = _tiny_unet(), _inputs()
    inp.pop("clip_img")
    with torch.no_grad():
        a = DiffusersStageC(unet)(**inp)
        b = DiffusersStageC(unet)(**{**inp, "clip_text": inp["clip_text"] + 1})
    assert (a - b).abs().max() > 1e-4
