"""Issue 28, mixtures: `webdataset_path` entries with weight/repeats, loss_weight and caption_prefix. Two sources at 1:1
within a binomial bound; `repeats: 4` is `weight: 4`; a resumed stream meets the same mixed batches; two ranks split one
mixture's epoch exactly; a loss weight of 0 gives no gradient; the modes that cannot weight samples refuse it.
(A killed-and-resumed training run and 2-process DDP with a mixture: test_train.py's recipe and DDP runs.)"""
import io, json, os, subprocess, sys
from collections import Counter
import pytest
import torch
from PIL import Image
from conftest import ROOT, run_cli
from cascade_nb.config import config_from_dict, ConfigError
from cascade_nb.data.pipeline import build_dataloader, build_dataset
from cascade_nb.data.sources import write_shards
import cascade_nb.modes  # noqa: F401  the modes' config sections (teacher_checkpoint_path, ...), whatever runs first

def make_source(root, name, shards, per_shard, meta=None):
    "A source of `shards` tar shards of `per_shard` 32² PNG samples keyed `{name}-{i}`."
    png = io.BytesIO(); Image.new("RGB", (32, 32), (200, 40, 40)).save(png, "PNG")
    n = shards * per_shard
    samples = ({"__key__": f"{name}-{i}", "png": png.getvalue(), "txt": f"{name} {i}",
                **({"json": json.dumps(meta(i))} if meta else {})} for i in range(n))
    write_shards(samples, root / name, shard_size=per_shard)
    return str(root / name)

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return make_source(root, "a", 12, 1), make_source(root, "b", 12, 1), make_source(root, "c", 3, 4)

def stream_keys(source, batches, **kw):
    from cascade_nb.run_data import batch_stream
    loader = build_dataloader(source, 4, image_size=32, seed=1, num_workers=0, **kw)
    return [b["keys"] for _, b in zip(range(batches), batch_stream(loader))]

def test_one_to_one_within_a_binomial_bound(sources):
    "Resampled, weights 1:1 over equal sources: the share of `a` in 400 samples is within 4 sigma of Binomial(400, 1/2)."
    a, b, _ = sources
    keys = [k for ks in stream_keys([{"path": a, "weight": 1}, {"path": b, "weight": 1}], 100, resampled=True,
                                    shuffle_buffer=8) for k in ks]
    n_a = sum(k.startswith("a-") for k in keys)
    assert abs(n_a - 200) <= 4 * (400 * 0.25) ** 0.5, n_a
    # 3:1 moves the share to 3/4, within the same kind of bound
    keys = [k for ks in stream_keys([{"path": a, "weight": 3}, b], 100, resampled=True, shuffle_buffer=8) for k in ks]
    assert abs(sum(k.startswith("a-") for k in keys) - 300) <= 4 * (400 * 3 / 16) ** 0.5

@pytest.mark.parametrize("resampled", [True, False])
def test_repeats_4_is_weight_4(sources, resampled):
    a, _, c = sources
    assert (stream_keys([{"path": a, "repeats": 4}, c], 20, resampled=resampled)
            == stream_keys([{"path": a, "weight": 4}, c], 20, resampled=resampled))
    if not resampled:   # a finite epoch holds each sample of `a` 4 times, of `c` once
        epoch = Counter(k for b in build_dataset([{"path": a, "repeats": 4}, c], 4, image_size=32, drop_last=False)
                        for k in b["keys"])
        assert {k: v for k, v in epoch.items() if k.startswith("a-")} == {f"a-{i}": 4 for i in range(12)}
        assert {k: v for k, v in epoch.items() if k.startswith("c-")} == {f"c-{i}": 1 for i in range(12)}

@pytest.mark.parametrize("resampled", [True, False])
def test_resumed_mid_mix_meets_the_same_batches(sources, resampled):
    "Fast-forwarded past 13 batches (over an epoch's end when finite), with 2 workers: the next keys are the same."
    from cascade_nb.run_data import batch_stream
    a, b, c = sources
    mix = [{"path": a, "weight": 1.5, "caption_prefix": "a, "}, {"path": b, "weight": 0}, {"path": c, "repeats": 2}]
    load = lambda: build_dataloader(mix, 4, image_size=32, seed=2, num_workers=2, resampled=resampled)
    plain = [bt for _, bt in zip(range(17), batch_stream(load()))][13:]
    resumed = batch_stream(load(), skip=13)
    for ref in plain:
        got = next(resumed)
        assert got["keys"] == ref["keys"] and got["captions"] == ref["captions"]
        assert torch.equal(got["images"], ref["images"])
    assert all(c.startswith("a, ") == k.startswith("a-") for bt in plain for k, c in zip(bt["keys"], bt["captions"]))
    assert not any(k.startswith("b-") for bt in plain for k in bt["keys"])   # weight 0: off

READER = r"""
import json, sys
from cascade_nb.data import build_dataloader
mix = json.loads(sys.argv[1])
dl = build_dataloader(mix, 4, num_workers=2, image_size=32, seed=3, drop_last=False, resampled=False)
print(json.dumps([k for b in dl for k in b["keys"]]))
"""

def test_two_ranks_split_one_mixture_exactly(sources):
    "2 ranks × 2 workers, weights 2.5 and 1: together they read exactly the samples one process reads in that epoch."
    a, _, c = sources
    mix = [{"path": a, "weight": 2.5}, c]
    procs = [subprocess.Popen([sys.executable, "-c", READER, json.dumps(mix)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    ranks = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    one = [k for bt in build_dataset(mix, 4, image_size=32, seed=3, drop_last=False) for k in bt["keys"]]
    assert all(ranks) and Counter(ranks[0]) + Counter(ranks[1]) == Counter(one)
    per_key = Counter(one)
    assert all(2 <= per_key[f"a-{i}"] <= 3 for i in range(12)) and all(per_key[f"c-{i}"] == 1 for i in range(12))
    assert 24 < sum(per_key[f"a-{i}"] for i in range(12)) < 36   # 2 whole visits and a random part of a third

def test_loss_weights_reach_the_loss_and_zero_gives_no_gradient(tmp_path):
    "Entry loss_weight × metadata loss_weight per sample, through the mode's extras into the loss: 0 gives no gradient."
    from cascade_nb.modes import FullTraining, diffusion_loss
    from cascade_nb.gdf.presets import gdf_from_config
    src = make_source(tmp_path, "w", 1, 4, meta=lambda i: {"loss_weight": [1, 0, 2, 0.5][i]})
    batch = next(iter(build_dataset([{"path": src, "loss_weight": 0.5}], 4, image_size=32, shuffle_buffer=0)))
    assert dict(zip(batch["keys"], batch["loss_weights"])) == {"w-0": 0.5, "w-1": 0.0, "w-2": 1.0, "w-3": 0.25}
    class Net(torch.nn.Module):
        def __init__(self): super().__init__(); self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        def forward(self, x, r): return self.conv(x)
    net, mode = Net(), FullTraining.__new__(FullTraining)   # `extras` needs none of the mode's models
    gdf = gdf_from_config(config_from_dict(dict(experiment_id="x", webdataset_path="d"), training=False).gdf)
    x0 = batch["images"].float() / 127.5 - 1
    grads = lambda b: torch.autograd.grad(diffusion_loss(net, gdf, x0, {}, t=torch.full((4,), 0.5),
                                                         rng=torch.Generator().manual_seed(0), **mode.extras(b, x0))[0],
                                          list(net.parameters()))
    assert all(not g.any() for g in grads({**batch, "loss_weights": [0.0] * 4}))
    assert any(g.any() for g in grads(batch)) and mode.extras({**batch, "loss_weights": [1.0] * 4}, x0) == {}

def test_distillation_refuses_loss_weights_and_cached_refuses_caption_prefix():
    base = dict(experiment_id="x", teacher_checkpoint_path="t.safetensors")
    with pytest.raises(ConfigError, match=r"webdataset_path\[0\]\.loss_weight': mode 'lcm' does not weight"):
        config_from_dict({**base, "mode": "lcm", "webdataset_path": [{"path": "d", "loss_weight": 0.5}]},
                         training=False)
    with pytest.raises(ConfigError, match=r"webdataset_path\[1\]\.caption_prefix' changes captions"):
        config_from_dict(dict(experiment_id="x", latent_space="cached",
                              webdataset_path=["d", {"path": "e", "caption_prefix": "sks, "}]), training=False)
    with pytest.raises(ConfigError, match=r"webdataset_path\[0\]\.weigth' is unknown; did you mean 'weight'"):
        config_from_dict(dict(experiment_id="x", webdataset_path=[{"path": "d", "weigth": 2}]), training=False)

def test_an_entry_caption_replaces_its_samples_captions(sources):
    """`caption:` on an entry (a class prompt for prior: true samples read from the instance images): every sample of
    that entry is captioned with it, the other entry's samples keep their own; blank or with cached latents: refused."""
    a, b, _ = sources
    loader = build_dataloader([a, {"path": b, "caption": "a photo of a thing", "prior": True}], 4, image_size=32, seed=1,
                              num_workers=0)
    seen = [(k, c, p) for batch in loader for k, c, p in zip(batch["keys"], batch["captions"], batch["priors"])]
    assert len(seen) == 24
    assert all(c == ("a photo of a thing" if k.startswith("b-") else f"a {k[2:]}") for k, c, _ in seen), seen[:4]
    assert all(p == k.startswith("b-") for k, _, p in seen)
    with pytest.raises(ConfigError, match=r"webdataset_path\[0\]\.caption': ' ' is blank"):
        config_from_dict(dict(experiment_id="x", webdataset_path=[{"path": "d", "caption": " "}]), training=False)
    with pytest.raises(ConfigError, match=r"webdataset_path\[0\]\.caption' changes captions"):
        config_from_dict(dict(experiment_id="x", latent_space="cached", webdataset_path=[{"path": "d", "caption": "x"}]),
                         training=False)

def test_inspect_config_prints_the_effective_mix(tmp_path, sources):
    a, _, c = sources
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(f"experiment_id: m\nimage_size: 32\nwebdataset_path: [{{path: {a}, weight: 3}}, {c}]\n")
    out = run_cli("-m", "cascade_nb.data", "inspect", cfg).stdout
    assert f"[0] {a}: 12 samples x weight 3 = 36 (75.0%)" in out and f"[1] {c}: 12 samples x weight 1 = 12 (25.0%)" in out

@pytest.mark.parametrize("entry, says", [
    ("{path: P, weight: 1.0e+9}, {path: P, weight: 0.5}", "'webdataset_path[0].weight': 1000000000.0 is out of range; "
                                                          "expected in [0, 1000]"),
    ("{path: P, repeats: 5000}", "'webdataset_path[0].repeats': 5000 is out of range; expected in [1, 1000]"),
    ("{path: P, loss_weight: 1.0e+308}",
     "'webdataset_path[0].loss_weight': 1e+308 is out of range; expected in [0, 1000]"),
    ("{path: P, prior: true}", "every entry with weight > 0 is prior: true"),
])
def test_absurd_weights_and_a_prior_only_mixture_are_one_line(sources, entry, says):
    "B47 (a weight of 1e9 listed 80 GB of visits), B46 (loss inf at every update), B48 (loss 0: nothing to learn)."
    from cascade_nb.config import load_config
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "lora_demo.yaml",
                    ["resampled=false", f"webdataset_path=[{entry.replace('P', sources[0])}]"])
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
