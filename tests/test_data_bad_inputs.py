"Each kind of bad input is skipped and counted; a shard or source with nothing usable fails with a clear message."
import io, warnings
from pathlib import Path
import pytest
from PIL import Image
from cascade_nb.data import build_dataset, pack_folder, inspect_source

PHOTO = (Path(__file__).resolve().parents[1] / "data_samples" / "photos" / "0000.jpg").read_bytes()

def png(size):
    buf = io.BytesIO(); Image.new("RGB", size, (200, 10, 10)).save(buf, "PNG"); return buf.getvalue()

def write(folder, key, img=PHOTO, txt=b"a cat", js=None, ext="jpg"):
    if img is not None: (folder / f"{key}.{ext}").write_bytes(img)
    if txt is not None: (folder / f"{key}.txt").write_bytes(txt)
    if js is not None: (folder / f"{key}.json").write_bytes(js)

BAD = {
    "bad_image": dict(img=PHOTO[: len(PHOTO) // 3]),            # truncated JPEG
    "bad_image ": dict(img=b"\x89PNG not really", ext="png"),    # not an image
    "missing_caption": dict(txt=None),
    "empty_caption": dict(txt=b" \n\t "),
    "bad_text": dict(txt=b"\xff\xfe caf\xe9"),
    "bad_json": dict(js=b'{"width": 12'),
    "too_small": dict(img=png((10, 40)), ext="png"),
    "missing_image": dict(img=None),                            # a caption whose image is gone
}

def run(source, **kw):
    ds = build_dataset(source, 1, image_size=64, shuffle_buffer=0, **kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        batches = list(ds)
    return batches, ds.counter.total, [str(x.message) for x in w]

@pytest.mark.parametrize("reason", list(BAD))
def test_each_bad_kind_is_skipped_and_counted(reason, tmp_path):
    write(tmp_path, "0000"); write(tmp_path, "0001", **BAD[reason]); write(tmp_path, "0002")
    batches, counts, _ = run(tmp_path)
    assert sorted(k for b in batches for k in b["keys"]) == ["0000", "0002"]
    assert dict(counts) == {reason.strip(): 1}

def test_skips_reach_the_batches(tmp_path):
    write(tmp_path, "0000", txt=b""); write(tmp_path, "0001", txt=None); write(tmp_path, "0002")
    batches, _, _ = run(tmp_path)
    assert batches[0]["skipped"] == {"empty_caption": 1, "missing_caption": 1}

def test_truncated_tar_keeps_the_head(tmp_path):
    src = tmp_path / "src"; src.mkdir()
    for i in range(6): write(src, f"{i:04d}", img=png((64, 64)), ext="png")
    (shard,) = pack_folder(src, tmp_path / "shards", 100)
    data = shard.read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 3])
    batches, counts, msgs = run(tmp_path / "cut.tar")
    assert 0 < len(batches) < 6 and counts["truncated_tar"] == 1
    assert any("cut.tar" in m and "truncated" in m for m in msgs)

def test_unusable_shard_fails_clearly(tmp_path):
    src = tmp_path / "src"; src.mkdir()
    for i in range(3): write(src, f"{i:04d}", img=b"junk", ext="png")
    pack_folder(src, tmp_path / "shards", 100)
    with pytest.raises(RuntimeError, match=r"all 1 shard\(s\) of the source yielded no usable sample .*bad_image"):
        run(tmp_path / "shards")
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(RuntimeError, match="nothing is left to train on"):
        run(tmp_path / "empty.tar")
    with pytest.raises(RuntimeError, match="no usable sample"):
        run("pipe:exit 3", allow_pipe=True)

def test_all_filtered_source_fails_clearly(tmp_path):
    for i in range(3): write(tmp_path, f"{i:04d}", js=b'{"width": 451, "height": 300}')
    with pytest.raises(RuntimeError, match="dataset_filters"):
        run(tmp_path, dataset_filters=[["width", "lambda w: w >= 1024"]])
    batches, counts, _ = run(tmp_path, dataset_filters=[[["width", "height"], "lambda w, h: w > h"]])
    assert len(batches) == 3 and not counts

def test_inspect_reports_skips(tmp_path):
    write(tmp_path, "0000"); write(tmp_path, "0001", txt=b"\xff")
    rep = inspect_source(tmp_path, image_size=64)
    assert rep["samples"] == 1 and rep["skipped"] == {"bad_text": 1} and rep["sizes"] == {"300x451": 1}
