"""Issue 28: horizontal flips and crop jitter (per-sample seeded, a source's own `hflip`), and loss masks (alpha or a
`NNNN.mask.png` member) carried through the crop with the same box, pooled to the latent grid, cached with the latents;
the keys range-checked, refused in one line where they do not apply. Exact resume and 2-process DDP with them are in
tests/test_train.py."""
import tarfile
import numpy as np
import pytest, torch
from PIL import Image
from conftest import ROOT
from cascade_nb.config import load_config, ConfigError
from cascade_nb.data import build_dataset, cache_dataset, cache_fingerprint, config_cache_parts
from cascade_nb.data.pipeline import dataloader_from_config
from cascade_nb.modes import sample_weights

DEMO = ROOT / "configs" / "demo.yaml"
MASKED = ROOT / "data_samples" / "masked"

def demo(*overrides):
    return load_config(DEMO, [f"webdataset_path={MASKED}", *overrides])

def one_line_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e: demo(*overrides)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)

ENTRY = f"webdataset_path=[{{path: '{MASKED}', %s}}]"

@pytest.mark.parametrize("overrides, says", [
    (["crop_jitter=0.7"], "'crop_jitter': 0.7 is out of range"),
    (["unmasked_weight=1.5"], "'unmasked_weight': 1.5 is out of range"),
    (["loss_mask=alfa"], "loss_mask"),
    (["hflipp=true"], "did you mean 'hflip'"),
    ([ENTRY % "hflp: true"], "did you mean 'hflip'"),
    (["unmasked_weight=0.2"], "loss_mask is off"),
    (["normalize_masked_area=true"], "loss_mask is off"),
    (["latent_space=cached", "hflip=true"], "latent_space: cached"),
    (["latent_space=cached", "crop_jitter=0.1"], "latent_space: cached"),
    (["latent_space=cached", ENTRY % "hflip: true"], "webdataset_path[0].hflip"),
])
def test_keys_are_checked_in_one_line(overrides, says):
    msg = one_line_error(*overrides)
    assert says in msg, msg

@pytest.mark.parametrize("mode", ["lcm", "progressive", "distill", "dmd"])
def test_distillation_modes_refuse_a_loss_mask(mode):
    dmd = ["adam_betas=[0, 0.999]", "weight_decay=0"] if mode == "dmd" else []   # else refused for its optimizer first
    msg = one_line_error(f"mode={mode}", "teacher_checkpoint_path=t.safetensors", *dmd, "loss_mask=auto")
    assert "'loss_mask'" in msg and "does not weight its loss per pixel" in msg, msg

def batches(**kw):
    return list(build_dataset(MASKED, 12, image_size=48, shuffle_buffer=0, resampled=False, **kw))

def test_mask_follows_the_box_the_jitter_and_the_mirror():
    "Where the mask says background the pixels are the emoji's white, whatever the crop, jitter and flip drew."
    for seed in range(3):
        b, = batches(loss_mask="auto", hflip=True, crop_jitter=0.4, crop="random", seed=seed)
        im, m = b["images"].float(), b["masks"]
        assert m.shape == (12, 1, 48, 48) and m.dtype == torch.uint8
        assert im[(m < 10).expand_as(im)].mean() > 240 and im[(m > 245).expand_as(im)].mean() < 235
    # member / alpha pick their own samples (even keys: alpha, odd keys: a member); off: no masks at all
    alpha, member = batches(loss_mask="alpha")[0]["masks"], batches(loss_mask="member")[0]["masks"]
    assert (alpha[1::2] == 255).all() and (alpha[0::2] < 255).any()
    assert (member[0::2] == 255).all() and (member[1::2] < 255).any()
    assert "masks" not in batches()[0]

def test_flips_are_per_sample_and_a_source_can_refuse_them():
    plain, = batches(crop="center")
    flipped, = batches(crop="center", hflip=True, seed=5)
    mirrored = [bool(torch.equal(f, p.flip(-1))) for f, p in zip(flipped["images"], plain["images"])]
    kept = [bool(torch.equal(f, p)) for f, p in zip(flipped["images"], plain["images"])]
    assert all(a or b for a, b in zip(mirrored, kept)) and 0 < sum(mirrored) < 12, mirrored
    # a source's `hflip: false` wins over the run's `hflip: true`
    cfg = load_config(DEMO, [f"webdataset_path=[{{path: '{MASKED}', hflip: false}}]", "hflip=true", "num_workers=0",
                             "crop=center", "resampled=false", "shuffle_buffer=0", "image_size=48",
                             "dataset_filters=null", "pin_memory=false"], training=False)
    off = next(iter(dataloader_from_config(cfg.data, 12, seed=5)))
    assert torch.equal(off["images"], plain["images"])

def test_chunking_does_not_change_the_draws():
    "Another chunking of the folder (another reader layout) draws the same per sample: hashed, not streamed."
    one = {k: im for b in batches(crop="center", hflip=True, crop_jitter=0.3, seed=2)
           for k, im in zip(b["keys"], b["images"])}
    chunked = {k: im for b in build_dataset(MASKED, 1, image_size=48, shuffle_buffer=0, resampled=False, crop="center",
                                            hflip=True, crop_jitter=0.3, seed=2, folder_chunk=5)
               for k, im in zip(b["keys"], b["images"])}
    assert one.keys() == chunked.keys() and all(torch.equal(one[k], chunked[k]) for k in one)

def test_a_bad_mask_member_is_counted_and_replaced(tmp_path):
    for i in range(4):
        Image.fromarray(np.full((32, 48, 3), 200, np.uint8)).save(tmp_path / f"{i:04d}.png")
        (tmp_path / f"{i:04d}.txt").write_text(f"grey {i}")
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(tmp_path / "0001.mask.png")    # another aspect ratio
    (tmp_path / "0002.mask.png").write_bytes(b"not a png")
    b, = list(build_dataset(tmp_path, 4, image_size=32, loss_mask="member", shuffle_buffer=0, resampled=False))
    assert b["skipped"] == {"bad_mask": 2} and b["masks"].shape == (4, 1, 32, 32)

def test_masks_weigh_the_loss_on_the_latent_grid():
    b, = batches(loss_mask="auto", crop="center")
    x0 = torch.zeros(12, 16, 3, 3)
    w = sample_weights(b, x0)["weight"]
    assert w.shape == (12, 1, 3, 3)
    torch.testing.assert_close(w.mean(dim=(1, 2, 3)), (b["masks"].float() / 255).mean(dim=(1, 2, 3)))

class StandInEncoder(torch.nn.Module):
    "The encoder interface: 8× average pool, then a 1×1 conv to 4 channels."
    def __init__(self):
        super().__init__(); torch.manual_seed(0); self.proj = torch.nn.Conv2d(3, 4, 1)
    def encode(self, x): return self.proj(torch.nn.functional.avg_pool2d(x, 8))

def test_the_cache_keeps_the_pooled_mask_and_its_fingerprint_covers_it(tmp_path):
    plain, masked = demo(), demo("loss_mask=auto")
    assert "loss_mask" not in config_cache_parts(plain)   # caches made before the key keep their fingerprint
    fp = cache_fingerprint(**config_cache_parts(masked))
    assert fp != cache_fingerprint(**config_cache_parts(plain))
    cache_dataset(MASKED, tmp_path / "c", StandInEncoder(), fingerprint=fp, image_size=48, batch_size=4,
                  loss_mask="auto")
    cached = {k: m for b in build_dataset(tmp_path / "c", 4, cache_fingerprint=fp, shuffle_buffer=0)
              for k, m in zip(b["keys"], b["masks"])}
    direct = batches(loss_mask="auto", crop="center")[0]
    assert len(cached) == 12 and next(iter(cached.values())).shape == (1, 6, 6)
    pooled = torch.nn.functional.adaptive_avg_pool2d(direct["masks"].float() / 255, (6, 6))
    got = torch.stack([cached[k] for k in sorted(cached)]).float()
    torch.testing.assert_close(got, pooled, atol=1e-3, rtol=0)
    b = next(iter(build_dataset(tmp_path / "c", 4, cache_fingerprint=fp, shuffle_buffer=0)))
    torch.testing.assert_close(sample_weights(b, b["latents"])["weight"], b["masks"].float())

def test_a_resolution_schedule_scales_the_masks_with_the_images():
    from cascade_nb.data.buckets import at_resolution
    cfg = demo("image_size=64", "resolution_schedule=[[0, 32], [2, 64]]", "updates=4", "loss_mask=auto")
    b, = list(build_dataset(MASKED, 12, image_size=64, loss_mask="auto", shuffle_buffer=0, resampled=False,
                            crop="center"))
    small = at_resolution(b, cfg, 0, torch.device("cpu"))
    assert small["images"].shape[-2:] == small["masks"].shape[-2:] == (32, 32)
    im = small["images"].float()
    assert im[(small["masks"] < 10).expand_as(im)].mean() > 240   # still the background's pixels

def test_packed_shards_keep_the_mask_members(tmp_path):
    "`pack` turns the folder's NNNN.mask.png files into NNNN.mask.png tar members that read back as the same masks."
    from cascade_nb.data.sources import pack_folder
    shard, = pack_folder(MASKED, tmp_path / "packed")
    with tarfile.open(shard) as tar: names = tar.getnames()
    assert "0001.mask.png" in names and "0000.mask.png" not in names
    packed, = list(build_dataset(shard, 12, image_size=48, loss_mask="member", shuffle_buffer=0, resampled=False))
    folder, = batches(loss_mask="member")
    assert packed["keys"] == folder["keys"] and torch.equal(packed["masks"], folder["masks"])

def test_check_finds_masks_of_zeros(tmp_path):
    "Every mask all zero trains nothing (loss 0 at every update): `check` says so when it reads the data (B43)."
    from cascade_nb.check import check_config
    for i in range(4):
        Image.new("RGB", (32, 32), (50 * i, 10, 200)).save(tmp_path / f"{i:04d}.png")
        (tmp_path / f"{i:04d}.txt").write_text("a square")
        Image.new("L", (32, 32), 0).save(tmp_path / f"{i:04d}.mask.png")
    cfg = load_config(DEMO, [f"webdataset_path={tmp_path}", "loss_mask=member", "normalize_masked_area=true",
                             "batch_size=4", "dataset_filters=null"])
    found, _ = check_config(cfg, names=["data"])
    assert [(f.level, f.key) for f in found] == [("error", "loss_mask")], found
    assert "every one of the 4 samples read has a mask of zeros" in str(found[0])

def test_a_transparent_mask_counts_only_where_opaque_and_a_huge_one_is_refused_unread():
    """Hostile cases B41/B42: a white mask whose alpha is 0 everywhere trains nothing (grey × alpha, not the colour
    alone); a 12000×12000 mask for a 40×40 image is `bad_mask` from its header, before its pixels are decoded."""
    import io
    import numpy as np
    from PIL import Image
    from cascade_nb.data.pipeline import decode_mask, BadMask
    buf = io.BytesIO(); Image.new("RGBA", (40, 40), (255, 255, 255, 0)).save(buf, "PNG")
    assert int(np.asarray(decode_mask(buf.getvalue(), (40, 40))).max()) == 0
    buf = io.BytesIO(); Image.new("1", (12000, 12000)).save(buf, "PNG")
    with pytest.raises(BadMask, match="more than 64× the pixels of image 40x40"): decode_mask(buf.getvalue(), (40, 40))
