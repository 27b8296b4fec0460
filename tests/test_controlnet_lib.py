"""ControlNet library: zero-init no-op on Stage C, the official key layout of every bottleneck, strict loading,
filter output shapes and determinism, Canny edges identical to OpenCV's (the reference's filter), and the hint of an
up level's first ResBlock added in the reference's order."""
import io, tarfile
from pathlib import Path
import numpy as np
import pytest, torch
import torch.nn.functional as F
from PIL import Image
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
    # one column: columns 9 and 10 are equally strong, OpenCV keeps the left one
    assert e[0, 0, 5:15].sum(0).nonzero().flatten().tolist() == [9]
    # uint8 truncation: 0.1·255 = 25.5 -> 25, a gradient of 4·25 = 100, not above the low threshold 100
    assert canny_edges(img * 0.1).sum() == 0


# --- Canny: the reference's CannyFilter is `cv2.Canny(x.mul(255)...astype(np.uint8), 100, 200)` per image

ROOT = Path(__file__).resolve().parents[1]

def _cv2():
    return pytest.importorskip("cv2", reason="comparing with cv2.Canny needs opencv-python-headless (the dev extra)")

def _reference_canny(cv2, x, low=100, high=200):
    "The reference's call, image by image: (B, C, H, W) in [0, 1] -> (B, 1, H, W) edges in {0, 1}."
    edges = [cv2.Canny(x[i].mul(255).permute(1, 2, 0).cpu().numpy().astype(np.uint8), low, high) for i in range(len(x))]
    return torch.stack([torch.tensor(e).div(255).unsqueeze(0) for e in edges], dim=0)

def _sample_images():
    "The real photos (non-square) and a few emoji (flat colour, many exact ties) shipped in data_samples/."
    to01 = lambda im: torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).float()[None] / 255
    photos = [to01(Image.open(p)) for p in sorted((ROOT / "data_samples" / "photos").glob("*.jpg"))]
    with tarfile.open(ROOT / "data_samples" / "emoji" / "shard-000000.tar") as tf:
        pngs = [m for m in tf.getmembers() if m.name.endswith(".png")][:4]
        emoji = [to01(Image.open(io.BytesIO(tf.extractfile(m).read()))) for m in pngs]
    assert len(photos) == 6 and len(emoji) == 4
    return photos + emoji

@pytest.mark.parametrize("size", [224, 64, (97, 130), 31])
def test_canny_edges_equal_cv2_canny_on_the_sample_images(size):
    cv2 = _cv2()
    size = size if isinstance(size, tuple) else (size, size)
    for img in _sample_images():
        x = F.interpolate(img, size=size, mode="bilinear")
        want = _reference_canny(cv2, x)
        assert want.sum() > 0
        assert torch.equal(canny_edges(x), want), (size, int((canny_edges(x) != want).sum()), int(want.sum()))

@pytest.mark.parametrize("channels", [1, 3])
def test_canny_edges_equal_cv2_canny_on_random_images(channels):
    # noise (ties between neighbours and channels everywhere) and smoothed noise, other and swapped thresholds
    cv2 = _cv2()
    g = torch.Generator().manual_seed(0)
    for size in (224, 17, (40, 23)):
        size = size if isinstance(size, tuple) else (size, size)
        noise = torch.rand(3, channels, *size, generator=g)
        for x in (noise, F.avg_pool2d(noise, 5, 1, 2), (noise * 4).round() / 4):
            for low, high in ((100, 200), (30.7, 80.2), (200, 100)):
                want = _reference_canny(cv2, x, low, high)
                assert torch.equal(canny_edges(x, low, high), want), (size, low, high)

def test_canny_filter_equals_the_reference_filter():
    # reference CannyFilter: bilinear to 224², cv2.Canny(·, 100, 200), /255, bilinear back to the image size
    cv2 = _cv2()
    for img in _sample_images()[:6]:
        x = F.interpolate(img, size=(224, 224), mode="bilinear")
        want = F.interpolate(_reference_canny(cv2, x), size=img.shape[-2:], mode="bilinear")
        got, _ = make_filter("CannyFilter", {"resize": 224})(img)
        assert torch.equal(got, want)

# --- the hint at an up level's first ResBlock (reference StageC._up_decode: resize x to the skip, then add the hint)

def test_up_level_hint_is_added_after_the_resize_to_the_skip():
    torch.manual_seed(0)
    # switch_level: bilinear ×½ / ×2 between levels, so a 9×9 latent gives 4×4, 8×8 ≠ the 9×9 skip
    gen = StageC.from_preset("tiny", switch_level=(True,)).eval()
    first_up = gen.up_blocks[1][0]
    # the hint index of the shallow up level's first ResBlock: every ResBlock call before it
    idx = sum(sum(getattr(b, "takes_control", False) for b in level) for level in (*gen.down_blocks, gen.up_blocks[0]))
    assert idx == 5 and getattr(first_up, "level_input", None) == "skip"
    hints = [None] * idx + [torch.randn(2, 64, 3, 3)]
    seen = {}
    gen.up_upscalers[0].register_forward_hook(lambda m, args, out: seen.__setitem__("x", out))
    gen.down_downscalers[1].register_forward_pre_hook(lambda m, args: seen.__setitem__("skip", args[0]))
    first_up.register_forward_pre_hook(lambda m, args: seen.__setitem__("block_input", args[0]))
    with torch.no_grad(): gen(torch.randn(2, 16, 9, 9), torch.rand(2), cnet=hints, **_conds())
    x, skip = seen["x"], seen["skip"]
    assert x.shape[-2:] == (8, 8) and skip.shape[-2:] == (9, 9)
    # the reference's order, restated: x resized to the skip first, then the hint resized to x and added
    x = F.interpolate(x.float(), skip.shape[-2:], mode="bilinear", align_corners=True)
    want = x + F.interpolate(hints[idx], size=x.shape[-2:], mode="bilinear", align_corners=True)
    torch.testing.assert_close(seen["block_input"], want, rtol=0, atol=0)
