"""ControlNet library: zero-init no-op on Stage C, the official key layout of every bottleneck, strict loading,
filter output shapes and determinism."""
import pytest, torch
from cascade_nb.models.stage_c import StageC
from cascade_nb.controlnet import ControlNet, load_controlnet, controlnet_config, make_filter, canny_edges

BLOCKS = [0, 4, 8, 12, 51, 55, 59, 63]

def _conds(B=2):
    g = torch.Generator().manual_seed(0)
    return dict(clip_text=torch.randn(B, 77, 64, generator=g), clip_text_pooled=torch.randn(B, 1, 64, generator=g),
                clip_img=torch.randn(B, 1, 64, generator=g))

@pytest.mark.parametrize("mode,c_in", [("effnet", 3), ("effnet", 1), ("simple", 4)])
def test_fresh_controlnet_leaves_stage_c_unchanged(mode, c_in):
    torch.manual_seed(0)
    gen = StageC.from_preset("tiny").eval()
    with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)
    cn = ControlNet(c_in, 64, [0, 1, 2, 3, 4, 5], mode).eval()
    x, r, c = torch.randn(2, 16, 4, 4), torch.rand(2), _conds()
    with torch.no_grad():
        hint = cn(torch.rand(2, c_in, 128, 128))
        assert all(h is not None and h.abs().sum() == 0 for h in hint)
        assert torch.equal(gen(x, r, cnet=hint, **c), gen(x, r, **c))

def test_official_layout_of_each_bottleneck():
    with torch.device("meta"):
        eff = ControlNet(3, 2048, BLOCKS, "effnet").state_dict()
        inp = ControlNet(4, 2048, BLOCKS, "effnet").state_dict()
        large = ControlNet(16, 2048, BLOCKS, "large").state_dict()
        simple = ControlNet(512, 2048, list(range(64)), "simple").state_dict()
    # effnet: torchvision efficientnet_v2_s().features keys under backbone., 8 projections without bias
    assert eff["backbone.0.0.weight"].shape == (24, 3, 3, 3) and eff["backbone.7.0.weight"].shape == (1280, 256, 1, 1)
    assert eff["projections.7.0.weight"].shape == (1280, 1280, 1, 1) and eff["projections.7.2.weight"].shape == (2048, 1280, 1, 1)
    assert inp["backbone.0.0.weight"].shape == (24, 4, 3, 3) and set(inp) == set(eff)
    assert sum(k.startswith("projections.") for k in eff) == 16
    # large: conv 16→16384, conv →1024, 8 CNetResBlocks (LN, conv, LN, conv), conv →1280
    assert large["backbone.0.weight"].shape == (16384, 16, 1, 1) and large["backbone.2.weight"].shape == (1024, 16384, 1, 1)
    assert large["backbone.3.blocks.0.weight"].shape == (1024,) and large["backbone.10.blocks.5.weight"].shape == (1024, 1024, 3, 3)
    assert large["backbone.11.weight"].shape == (1280, 1024, 1, 1)
    assert simple["backbone.0.weight"].shape == (2048, 512, 3, 3) and simple["projections.63.2.weight"].shape == (2048, 512, 1, 1)
    for sd, want in ((eff, ("effnet", 3)), (inp, ("effnet", 4)), (large, ("large", 16)), (simple, ("simple", 512))):
        cfg = controlnet_config(sd)
        assert (cfg["bottleneck_mode"], cfg["c_in"], cfg["c_proj"]) == (*want, 2048)

def test_strict_load_round_trip_and_stem_init():
    torch.manual_seed(0)
    cn = ControlNet(4, 64, [0, 4], "effnet")
    stem = cn.backbone[0][0]
    assert stem.padding == (0, 0) and stem.weight[:, 3].abs().sum() == 0 and stem.weight[:, :3].abs().sum() > 0
    for p in cn.projections: torch.nn.init.normal_(p[2].weight)
    sd = {k: v.clone() for k, v in cn.state_dict().items()}
    back = load_controlnet(sd, [0, 4])
    x = torch.rand(1, 4, 64, 64)
    with torch.no_grad(): assert torch.equal(back(x)[4], cn.eval()(x)[4])
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="extra.weight"): load_controlnet(sd, [0, 4])

def test_backbone_batchnorm_stays_frozen_in_train_mode():
    cn = ControlNet(3, 8, [0], "effnet").train()
    assert not cn.backbone.training and cn.projections.training
    stats = cn.backbone[0][1].running_mean.clone()
    cn(torch.rand(2, 3, 64, 64))
    assert torch.equal(cn.backbone[0][1].running_mean, stats)

def test_filter_output_shapes_and_determinism():
    from cascade_nb.models.effnet import EfficientNetEncoder
    imgs = torch.rand(3, 3, 64, 64)
    eff = EfficientNetEncoder.from_preset("tiny").eval()
    for name, params, ch, hw in [("CannyFilter", {"resize": 96}, 1, (64, 64)), ("InpaintFilter", {"thresold": [0.04, 0.4], "p_outpaint": 0.4}, 4, (64, 64)),
                                 ("SRFilter", {"scale_factor": 0.25}, 3, (64, 64)), ("SREffnetFilter", {"scale_factor": 0.5}, 16, (2, 2))]:
        f = make_filter(name, params, effnet=eff)
        a, pa = f(imgs, generator=torch.Generator().manual_seed(1))
        b, _ = f(imgs, generator=torch.Generator().manual_seed(1))
        assert f.num_channels == ch and a.shape == (3, ch, *hw), (name, a.shape)
        assert pa.shape == (3, 3, 64, 64) and torch.equal(a, b)
    with pytest.raises(ValueError, match="face detection"): make_filter("IdentityFilter", {"max_faces": 4, "p_drop": 0.05, "p_full": 0.3})
    with pytest.raises(ValueError, match="effnet"): make_filter("SREffnetFilter", {"scale_factor": 0.5})

def test_canny_matches_a_hand_made_case():
    img = torch.zeros(1, 1, 20, 20); img[..., :, 10:] = 1.           # a vertical step edge
    e = canny_edges(img)
    assert e[0, 0, 5:15].sum(0).nonzero().flatten().tolist() == [10]  # one column, at the step
    assert canny_edges(img * 0.1).sum() == 0                         # gradient 0.1·255·4 = 102 > 100 but < 200: no strong seed
