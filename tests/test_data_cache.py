"Cache round trip with a stand-in encoder, fingerprint refusal, and the CLI (pack / inspect / cache) as subprocesses."
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch, yaml
from cascade_nb.data import build_dataset, cache_dataset, cache_fingerprint, config_cache_parts, CacheMismatchError
from cascade_nb.config import load_config

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
            torch.testing.assert_close(b["latents"][0], StandInEncoder().encode(direct[src][None])[0])
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
    cfg.write_text(yaml.safe_dump(dict(model_version="tiny", clip_text_model_name="tiny", image_size=64, webdataset_path=str(EMOJI))))
    cli("cache", EMOJI / "shard-000005.tar", tmp_path / "cache", "--config", cfg, "--batch-size", "4")
    fp = cache_fingerprint(**config_cache_parts(load_config(cfg, training=False)))
    b = next(iter(build_dataset(tmp_path / "cache", 4, cache_fingerprint=fp)))
    assert b["latents"].shape[-2:] == (2, 2) and set(b["text"]) == {"clip_text", "clip_text_pooled"}
    other = load_config(cfg, overrides=["image_size=128"], training=False)
    with pytest.raises(CacheMismatchError):
        build_dataset(tmp_path / "cache", 4, cache_fingerprint=cache_fingerprint(**config_cache_parts(other)))
