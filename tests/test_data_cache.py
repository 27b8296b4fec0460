"Cache round trip with a stand-in encoder, fingerprint refusal, and the CLI (pack / inspect / cache) as subprocesses."
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch, yaml
from cascade_nb.data import build_dataset, cache_dataset, cache_fingerprint, config_cache_parts, CacheMismatchError
from cascade_nb.config import load_config
from cascade_nb.core import images_to_device

ROOT = Path(__file__).resolve().parents[1]
EMOJI, PHOTOS = ROOT / "data_samples" / "emoji", ROOT / "data_samples" / "photos"

class StandInEncoder(torch.nn.Module):
    "A real nn.Module with the encoder interface: 4× average pool, then a 1×1 conv to 4 channels."
    def __init__(self):
        super().__init__(); torch.manual_seed(0); self.proj = torch.nn.Conv2d(3, 4, 1)
    def encode(self, x): return self.proj(torch.nn.functional.avg_pool2d(x, 4))

def text_stub(captions): return torch.tensor([[len(c), c.count(" ")] for c in captions], dtype=torch.float32)

def test_cache_round_trip_and_mismatch(tmp_path):
    fp = cache_fingerprint(image="stand-in", image_size=96)
    info = cache_dataset(PHOTOS, tmp_path / "c", StandInEncoder(), text_stub, fingerprint=fp, image_size=96,
                         multi_aspect_ratio=["1/1", "2/3"], batch_size=2, shard_size=4)
    assert info["samples"] == 6 and json.loads((tmp_path / "c" / "cache_info.json").read_text())["fingerprint"] == fp
    batches = list(build_dataset(tmp_path / "c", 1, cache_fingerprint=fp, shuffle_buffer=0))
    direct = {k: im for b in build_dataset(PHOTOS, 1, image_size=96, multi_aspect_ratio=["1/1", "2/3"], crop="center",
                                             shuffle_buffer=0) for k, im in zip(b["keys"], b["images"])}
    with torch.no_grad():
        for b in batches:
            src = b["meta"][0]["source_key"]
            torch.testing.assert_close(b["latents"][0], StandInEncoder().encode(images_to_device(direct[src][None], "cpu"))[0])
            assert b["text"]["text_embeds"][0, 0] == len(b["captions"][0])
    with pytest.raises(CacheMismatchError, match="fingerprint"):
        build_dataset(tmp_path / "c", 1, cache_fingerprint=cache_fingerprint(image="other", image_size=96))

def cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "cascade_nb.data", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    if check: assert r.returncode == 0, r.stderr
    return r

def test_cli_pack_inspect(tmp_path):
    ds = tmp_path / "dataset"; ds.mkdir()
    for p in PHOTOS.iterdir(): (ds / p.name).write_bytes(p.read_bytes())
    subprocess.run(["tar", "--sort=name", "-cf", "dataset.tar", "dataset/"], cwd=tmp_path, check=True)
    cli("pack", tmp_path / "dataset.tar", tmp_path / "shards", "--shard-size", "4")
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["shard-000000.tar", "shard-000001.tar"]
    r = cli("inspect", tmp_path / "shards", "--image-size", "768", "--multi-aspect-ratio", "1/1", "2/3", "9/16")
    assert "usable samples: 6" in r.stdout and "300x451: 1 -> 608x928" in r.stdout
    rep = json.loads(cli("inspect", tmp_path / "shards", "--image-size", "64", "--json").stdout)
    assert rep["samples"] == 6 and rep["bucket_of_size"] == {s: "64x64" for s in rep["sizes"]}
    (tmp_path / "junk").mkdir(); (tmp_path / "junk" / "0.png").write_bytes(b"x"); (tmp_path / "junk" / "0.txt").write_text("y")
    r = cli("inspect", tmp_path / "junk", check=False)
    assert r.returncode == 1 and "no usable sample" in r.stderr

def test_cli_cache_then_train_refuses_other_config(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(dict(model_version="tiny", clip_text_model_name="tiny", clip_image_model_name=None,
                                       image_size=64, webdataset_path=str(EMOJI))))
    cli("cache", EMOJI / "shard-000005.tar", tmp_path / "cache", "--config", cfg, "--batch-size", "4")
    fp = cache_fingerprint(**config_cache_parts(load_config(cfg, training=False)))
    b = next(iter(build_dataset(tmp_path / "cache", 4, cache_fingerprint=fp)))
    assert b["latents"].shape[-2:] == (2, 2) and set(b["text"]) == {"clip_text", "clip_text_pooled"}
    other = load_config(cfg, overrides=["image_size=128"], training=False)
    with pytest.raises(CacheMismatchError):
        build_dataset(tmp_path / "cache", 4, cache_fingerprint=cache_fingerprint(**config_cache_parts(other)))

CACHED = dict(experiment_id="cached", model_version="tiny", clip_text_model_name="tiny", clip_image_model_name="tiny",
              effnet_checkpoint_path="tiny", previewer_checkpoint_path="tiny", latent_space="cached", image_embed_prob=0.5,
              image_size=64, batch_size=4, num_workers=0, updates=3, log_every=1, save_every=100, resampled=True,
              shuffle_buffer=1)   # in order: the corrupt first sample is read in the first batch

def corrupt_one(shard: Path):
    "Cut the first sample's safetensors member to 5 bytes (its header length can no longer be read: struct.error)."
    import io, tarfile
    with tarfile.open(shard) as tar: members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    first = next(m.name for m, _ in members if m.name.endswith(".safetensors"))
    with tarfile.open(shard, "w") as tar:
        for m, data in members:
            if m.name == first: data = data[:5]
            m.size = len(data); tar.addfile(m, io.BytesIO(data))

def test_cached_latents_keep_clip_image_embeddings_and_skip_corrupt_samples(tmp_path):
    "Issue 13 item 7 and issue 17: the cache holds clip_img, the trainer feeds it at image_embed_prob; a corrupt sample is skipped."
    cfg_path = tmp_path / "cached.yaml"
    cfg_path.write_text(yaml.safe_dump({**CACHED, "webdataset_path": str(tmp_path / "cache"), "checkpoint_path": str(tmp_path / "ckpt"),
                                        "output_path": str(tmp_path / "out")}))
    cli("cache", EMOJI / "shard-000000.tar", tmp_path / "cache", "--config", cfg_path, "--batch-size", "8")
    cfg = load_config(cfg_path)
    fp = cache_fingerprint(**config_cache_parts(cfg))
    assert config_cache_parts(cfg)["image_model"] == "tiny"   # the fingerprint covers the image embedder
    batch = next(iter(build_dataset(tmp_path / "cache", 8, cache_fingerprint=fp, shuffle_buffer=0)))
    assert batch["text"]["clip_img"].shape == (8, 1, 64)
    from cascade_nb.modes import build_generator, build_text_encoder, build_latent_space, build_training_mode
    tok, text_model = build_text_encoder(cfg)
    mode = build_training_mode(cfg, build_generator(cfg), tok, text_model, None, build_latent_space(cfg))
    _, conds = mode.encode(batch, torch.device("cpu"), training=True, rng=torch.Generator().manual_seed(0))
    kept = conds["clip_img"].abs().sum((1, 2)) > 0
    assert 0 < int(kept.sum()) < 8   # image_embed_prob 0.5 of the batch, the rest zeros (as with images)
    torch.testing.assert_close(conds["clip_img"][kept], batch["text"]["clip_img"][kept])
    assert not mode.encode(batch, torch.device("cpu"), training=False)[1]["clip_img"].any()
    shard = next((tmp_path / "cache").glob("*.tar")); corrupt_one(shard)
    res = subprocess.run([sys.executable, "-m", "cascade_nb.train", str(cfg_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "update 3/3: loss" in res.stdout and "skipped 1: bad_cache 1" in res.stdout, res.stdout
