"""Issue 18 item 10: a resumed run fast-forwards its data stream without decoding the batches it skips, and then sees
exactly the batches an uninterrupted run sees (resampled and finite epochs, in the main process and with workers)."""
import pytest
import torch
from PIL import ImageFile
from conftest import ROOT

EMOJI = ROOT / "data_samples" / "emoji"

def stream(skip, **kw):
    from cascade_nb.data.pipeline import build_dataloader
    from cascade_nb.run_data import batch_stream
    return batch_stream(build_dataloader(EMOJI, 4, seed=3, **{"image_size": 32, **kw}), skip=skip)

def same(a, b):
    assert a["keys"] == b["keys"] and torch.equal(a["images"], b["images"]) and a["crop_top_lefts"] == b["crop_top_lefts"]

@pytest.mark.parametrize("resampled", [True, False])
def test_skip_decodes_almost_nothing_and_resumes_exactly(monkeypatch, resampled):
    "100 batches of 4 skipped (more than an epoch of the 328 emoji when finite): ~0 decodes instead of 400."
    kw = dict(num_workers=0, resampled=resampled, image_size=64, multi_aspect_ratio=["1/1", "1/2"], crop="random")
    plain = stream(0, **kw)
    reference = [next(plain) for _ in range(104)][100:]
    calls = [0]
    load = ImageFile.ImageFile.load
    def counted(self): calls[0] += 1; return load(self)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    resumed = stream(100, **kw)
    first = next(resumed)
    assert calls[0] <= 2 * 4, calls[0]   # only samples of emitted batches (the first one, a pending group) are decoded
    for a, b in zip([first] + [next(resumed) for _ in range(3)], reference): same(a, b)

def test_fast_forward_with_workers_resumes_exactly():
    kw = dict(num_workers=2, resampled=True, crop="smart")
    plain = stream(0, **kw)
    reference = [next(plain) for _ in range(23)][17:]
    resumed = stream(17, **kw)
    for ref in reference: same(next(resumed), ref)

def test_a_body_that_does_not_decode_is_replaced_in_its_batch():
    from cascade_nb.data.buckets import materialize_samples
    from cascade_nb.data.pipeline import LazyImage
    from cascade_nb.data.sources import SkipCounter
    import numpy as np, random
    good = {"image": np.zeros((3, 4, 4), np.uint8), "__key__": "a", "original_size": (4, 4), "crop_top_left": (0, 0)}
    bad = {"image": LazyImage(b"\xff\xd8 not a jpeg").deferred_crop((4, 4), "center", random.Random(0)), "__key__": "b",
           "original_size": (4, 4)}
    counter = SkipCounter()
    out = materialize_samples([bad, good], counter)
    assert [s["__key__"] for s in out] == ["a", "a"] and counter.take() == {"bad_image": 1}
