"""Issue 17, data: every file packed or counted, no old shards mixed in, bad shards skipped by the trainer with the
counts on its console lines, decompression bombs skipped, and no shell commands from a YAML (all through the CLIs)."""
import io, json
from pathlib import Path
from PIL import Image
from conftest import ROOT, run_cli

EMOJI, PHOTOS = ROOT / "data_samples" / "emoji", ROOT / "data_samples" / "photos"
PHOTO = (PHOTOS / "0000.jpg").read_bytes()
TINY = [str(ROOT / "configs" / "demo.yaml"), "num_workers=0", "image_size=32", "batch_size=4", "log_every=1",
        "warmup_updates=1", "updates=4", "save_every=100",
        "dataset_filters=null", "eval_every=null", "best_metric=null"]   # other data: the demo's caption filter and evaluation off

def data_cli(*args, check=True): return run_cli("-m", "cascade_nb.data", *args, check=check, timeout=300)

def train_cli(tmp, *extra, check=True):
    return run_cli("-m", "cascade_nb.train", *TINY, f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *extra,
                   check=check, timeout=600)

def dotted_folder(root: Path) -> Path:
    root.mkdir()
    for name in ["2023.05.01", "IMG_001.edited", "0000"]:
        (root / f"{name}.jpg").write_bytes(PHOTO); (root / f"{name}.txt").write_text(f"photo {name}")
    (root / "notes.md").write_text("not a sample")
    return root

def test_pack_keeps_dotted_names_and_counts_other_files(tmp_path):
    src = dotted_folder(tmp_path / "photos")
    res = data_cli("pack", src, tmp_path / "shards", "--shard-size", "2")
    assert "wrote 2 shard(s)" in res.stdout and "skipped: other_file 1" in res.stdout, res.stdout
    rep = json.loads(data_cli("inspect", tmp_path / "shards", "--image-size", "64", "--json").stdout)
    assert rep["samples"] == 3 and rep["skipped"] == {}
    res = data_cli("inspect", src, "--image-size", "64")   # the loose folder says the same, and names the stray file
    assert "usable samples: 3" in res.stdout and "skipped: other_file 1" in res.stdout

def test_pack_refuses_a_non_empty_folder_unless_overwrite(tmp_path):
    src = dotted_folder(tmp_path / "photos")
    data_cli("pack", src, tmp_path / "shards", "--shard-size", "1")
    assert len(list((tmp_path / "shards").glob("*.tar"))) == 3
    res = data_cli("pack", src, tmp_path / "shards", "--shard-size", "2", check=False)
    assert res.returncode == 2 and "not empty" in res.stderr and "--overwrite" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "shards" / "README").write_text("keep me")
    res = data_cli("pack", src, tmp_path / "shards", "--shard-size", "2", "--overwrite")
    assert "replaced 3 old shard(s)" in res.stdout
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["README", "shard-000000.tar", "shard-000001.tar"]
    assert "usable samples: 3" in data_cli("inspect", tmp_path / "shards", "--image-size", "64").stdout

def test_training_skips_bad_shards_and_prints_the_counts(tmp_path):
    data = tmp_path / "data"; data.mkdir()
    for p in sorted(EMOJI.glob("shard-*.tar"))[:2]: (data / p.name).write_bytes(p.read_bytes())
    (data / "shard-empty.tar").write_bytes(bytes(1024))           # a tar that holds nothing
    (data / "shard-junk.tar").write_bytes(b"not a tar at all" * 100)  # cannot be read
    res = train_cli(tmp_path, "experiment_id=bad_shards", f"webdataset_path={data}", "resampled=true", "updates=12")
    lines = [l for l in res.stdout.splitlines() if l.startswith("update ") and "loss" in l]
    assert len(lines) == 12 and "skipped" in lines[-1] and ("empty_shard" in lines[-1] or "unreadable_shard" in lines[-1]), res.stdout
    rows = [json.loads(l) for l in (tmp_path / "out" / "bad_shards" / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("skipped/") for k in rows[-1])

def test_training_stops_clearly_when_nothing_is_usable(tmp_path):
    data = tmp_path / "data"; data.mkdir()
    (data / "a.tar").write_bytes(bytes(1024)); (data / "b.tar").write_bytes(b"junk")
    res = train_cli(tmp_path, "experiment_id=all_bad", f"webdataset_path={data}", "resampled=true", check=False)
    assert res.returncode != 0 and "nothing is left to train on" in res.stderr

def test_decompression_bomb_is_skipped(tmp_path):
    src = tmp_path / "photos"; src.mkdir()
    (src / "0000.jpg").write_bytes(PHOTO); (src / "0000.txt").write_text("a cat")
    buf = io.BytesIO(); Image.new("1", (12000, 12000)).save(buf, "PNG")
    assert len(buf.getvalue()) < 40_000   # a few KB that would decode to 144 M pixels (432 MB as RGB)
    (src / "0001.png").write_bytes(buf.getvalue()); (src / "0001.txt").write_text("a bomb")
    res = data_cli("inspect", src, "--image-size", "768")
    assert "usable samples: 1" in res.stdout and "skipped: too_large 1" in res.stdout, res.stdout

def test_pipe_sources_refused_unless_allowed(tmp_path):
    marker = tmp_path / "ran"
    res = train_cli(tmp_path, "experiment_id=pipe", f"webdataset_path=pipe:touch {marker}", check=False)
    assert res.returncode == 2 and "allow_pipe_sources" in res.stderr and "Traceback" not in res.stderr
    res = data_cli("inspect", f"pipe:touch {marker}", check=False)
    assert res.returncode == 2 and "--allow-pipe-sources" in res.stderr
    assert not marker.exists()
    tar = sorted(EMOJI.glob("shard-*.tar"))[0]
    res = data_cli("inspect", f"pipe:cat {tar}", "--image-size", "64", "--allow-pipe-sources")
    assert "usable samples: " in res.stdout and "usable samples: 0" not in res.stdout
