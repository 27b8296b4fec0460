"""Issue 28: the seeded caption transforms (tag shuffle/dropout, trigger word, one of a JSON list) give each sample the
same caption in one epoch whoever reads it: 2 ranks x 2 workers as 1 process, and a resumed stream as an uninterrupted
one (finite and resampled); the config keys reach the loader."""
import json, os, subprocess, sys
import pytest
from PIL import Image

READER = r"""
import json, sys
from cascade_nb.data import build_dataloader
from cascade_nb.filters import CaptionRecipe
recipe = CaptionRecipe(**json.loads(sys.argv[2]))
dl = build_dataloader(sys.argv[1], 2, num_workers=2, image_size=32, seed=5, drop_last=False, folder_chunk=2,
                      caption_recipe=recipe)
dl.dataset.set_epoch(1)
print(json.dumps({k: c for b in dl for k, c in zip(b["keys"], b["captions"])}))
"""
RECIPE = dict(caption_prefix="ohwx", shuffle_tags=True, keep_tokens=1, tag_dropout=0.3, protected_tags=["t3"])

@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    "8 small images whose captions are 8 tags each; sample 0007's is a JSON list of two tag captions."
    root = tmp_path_factory.mktemp("tagged")
    for n in range(8):
        Image.new("RGB", (32, 32), (30 * n, 0, 0)).save(root / f"{n:04d}.png")
        text = ", ".join(f"t{i}" for i in range(8))
        (root / f"{n:04d}.txt").write_text(json.dumps([text, "u0, u1, u2"]) if n == 7 else text)
    return root

def captions(batches): return {k: c for b in batches for k, c in zip(b["keys"], b["captions"])}

def test_two_ranks_two_workers_see_the_captions_of_one_process(tagged):
    from cascade_nb.data import build_dataset
    from cascade_nb.filters import CaptionRecipe
    env = {**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(tagged), json.dumps(RECIPE)], stdout=subprocess.PIPE,
                              text=True, env={**env, "RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    r0, r1 = (json.loads(o.strip().splitlines()[-1]) for o in outs)
    ds = build_dataset(tagged, 2, image_size=32, seed=5, drop_last=False, folder_chunk=2,
                       caption_recipe=CaptionRecipe(**{**RECIPE, "protected_tags": ("t3",)}))
    ds.set_epoch(1)
    one = captions(ds)
    assert r0 and r1 and not set(r0) & set(r1) and {**r0, **r1} == one
    ds.set_epoch(2)
    assert captions(ds) != one   # the next epoch draws again
    assert all(c.startswith("ohwx, t0") or c.startswith("ohwx, u0") for c in one.values())
    assert all("t3" in c for k, c in one.items() if k != "0007")

@pytest.mark.parametrize("resampled", [False, True])
def test_a_resumed_stream_sees_the_same_captions(tagged, resampled):
    from cascade_nb.data.pipeline import build_dataloader
    from cascade_nb.filters import CaptionRecipe
    from cascade_nb.run_data import batch_stream
    def stream(skip):
        dl = build_dataloader(tagged, 2, num_workers=0, image_size=32, seed=3, resampled=resampled,
                              caption_recipe=CaptionRecipe(shuffle_tags=True, tag_dropout=0.2))
        return batch_stream(dl, skip=skip)
    plain = stream(0)
    reference = [next(plain) for _ in range(14)][9:]   # past the first of the 4-batch finite epochs
    resumed = stream(9)
    got = [next(resumed) for _ in range(5)]
    assert [b["keys"] for b in got] == [b["keys"] for b in reference]
    assert [b["captions"] for b in got] == [b["captions"] for b in reference]
    # a resampled stream never ends its epoch: the same sample drawn again gets another variant
    drawn = {}
    for b in [next(plain) for _ in range(30)]:
        for k, c in zip(b["keys"], b["captions"]): drawn.setdefault(k, set()).add(c)
    assert max(map(len, drawn.values())) > 1

def test_the_config_keys_reach_the_loader(tagged):
    from cascade_nb.config import config_from_dict
    from cascade_nb.data.pipeline import dataloader_from_config
    from cascade_nb.run_data import whole_source
    cfg = config_from_dict(dict(webdataset_path=str(tagged), image_size=32, num_workers=0, shuffle_buffer=0,
                                resampled=False),
                           ["caption_prefix=sks", "keep_tokens=2", "shuffle_tags=true", "tag_dropout=0.5"],
                           training=False)
    got = captions(dataloader_from_config(cfg.data, 2, seed=1, pin_memory=False))
    assert len(got) == 8 and all(c.startswith("sks, t0, t1") or c.startswith("sks, u0, u1") for c in got.values())
    assert any(len(c.split(", ")) < 9 for c in got.values())
    # validation, sample grids and evaluation read the captions whole: the trigger word, no shuffle, no dropout
    whole = captions(whole_source(cfg, str(tagged), 2))
    assert whole["0000"] == "sks, " + ", ".join(f"t{i}" for i in range(8))

def test_tag_dropout_1_with_no_tag_kept_is_refused_like_caption_dropout_1(tagged):
    "B51: every caption became '' and the run trained on; now `check` and the launch say it, naming the key."
    from cascade_nb.config import config_from_dict
    from cascade_nb.check import check_config
    def found(*overrides):
        cfg = config_from_dict(dict(webdataset_path=str(tagged), image_size=32, num_workers=0), list(overrides),
                               training=False)
        return [str(f) for f in check_config(cfg, scan=False, names=["tag_dropout"])[0]]
    said = found("tag_dropout=1")
    assert len(said) == 1 and said[0].startswith("error: tag_dropout: 1 with keep_tokens 0"), said
    assert found("tag_dropout=1", "keep_tokens=1") == [] and found("tag_dropout=0.5") == []
