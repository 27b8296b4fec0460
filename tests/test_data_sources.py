"Every source form reads the same samples; the bucket table matches the reference."
import subprocess, warnings
from fractions import Fraction
from pathlib import Path
import pytest
from cascade_nb.data import build_dataset, bucket_sizes, pack_folder, resolve_shards

ROOT = Path(__file__).resolve().parents[1]
EMOJI = ROOT / "data_samples" / "emoji"
PHOTOS = ROOT / "data_samples" / "photos"

def keys(source, **kw):
    kw = {"image_size": 64, "shuffle_buffer": 0, "drop_last": False, **kw}
    return sorted(k for b in build_dataset(source, 16, **kw) for k in b["keys"])

@pytest.fixture(scope="module")
def all_emoji_keys(): return keys(EMOJI)

def test_emoji_sample_data(all_emoji_keys):
    assert len(all_emoji_keys) == len(set(all_emoji_keys)) >= 300
    assert len(list(EMOJI.glob("shard-*.tar"))) >= 4
    assert sum(p.stat().st_size for p in EMOJI.glob("*.tar")) < 5e6

@pytest.mark.parametrize("form", ["folder_of_tars", "brace", "brace_file", "list", "list_file", "yml", "pipe"])
def test_every_tar_source_form(form, all_emoji_keys, tmp_path):
    tars = sorted(str(p) for p in EMOJI.glob("shard-*.tar"))
    n = len(tars) - 1
    brace = f"{EMOJI}/shard-{{000000..{n:06d}}}.tar"
    (tmp_path / "list.yml").write_text("\n".join(f"- {t}" for t in tars))
    source = {"folder_of_tars": EMOJI, "brace": brace, "brace_file": "file:" + brace, "list": tars,
              "list_file": [f"file:{t}" for t in tars], "yml": tmp_path / "list.yml",
              "pipe": [f"pipe:cat {t}" for t in tars]}[form]
    assert keys(source, allow_pipe=form == "pipe") == all_emoji_keys

def test_loose_folder_and_seed_tarball(tmp_path):
    ds = tmp_path / "dataset"; ds.mkdir()
    for p in PHOTOS.iterdir(): (ds / p.name).write_bytes(p.read_bytes())
    subprocess.run(["tar", "--sort=name", "-cf", "dataset.tar", "dataset/"], cwd=tmp_path, check=True)
    loose, tarball = keys(PHOTOS, multi_aspect_ratio=["1/1", "2/3"]), keys(tmp_path / "dataset.tar", multi_aspect_ratio=["1/1", "2/3"])
    assert len(loose) == 6 and tarball == [f"dataset/{k}" for k in loose]

def test_folder_splits_into_pseudo_shards():
    shards = resolve_shards(PHOTOS, folder_chunk=4)
    assert [len(s["keys"]) for s in shards] == [4, 2]

def test_remote_urls_untouched_and_missing_local_fails(tmp_path):
    assert resolve_shards("s3://bucket/d/shard-{0..2}.tar") == [{"url": f"s3://bucket/d/shard-{i}.tar"} for i in range(3)]
    assert resolve_shards("https://host/x.tar") == [{"url": "https://host/x.tar"}]
    with pytest.raises(FileNotFoundError, match="nope"): resolve_shards(tmp_path / "nope.tar")
    with pytest.raises(FileNotFoundError, match="neither"): resolve_shards(tmp_path)

def test_pack_is_deterministic(tmp_path):
    a, b = pack_folder(PHOTOS, tmp_path / "a", 4), pack_folder(PHOTOS, tmp_path / "b", 4)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]

def test_bucket_table_matches_reference():
    table = bucket_sizes(768, [Fraction(s) for s in ["1", "1/2", "1/3", "2/3", "3/4", "1/5", "2/5", "3/5", "4/5", "5/6", "1/6", "9/16"]])
    for hw in [(768, 768), (1056, 512), (1312, 416), (928, 608), (864, 640), (1696, 320), (1184, 480), (960, 576),
               (832, 672), (1856, 288), (1024, 576)]:
        assert hw in table and hw[::-1] in table
    assert len(table) == 21 and all(h % 32 == 0 and w % 32 == 0 for h, w in table)
    ratios = [Fraction(1, 2)]
    bucket_sizes(768, ratios); assert ratios == [Fraction(1, 2)]   # no mutable-default / argument mutation
    assert bucket_sizes(512) == ((512, 512),)

def test_batches_never_mix_buckets():
    for b in build_dataset(PHOTOS, 2, image_size=128, multi_aspect_ratio=["1/1", "2/3", "9/16"], drop_last=False):
        assert b["images"].shape[-2:] == b["bucket"] and len(b["captions"]) == b["images"].shape[0]

def test_http_shards_via_fsspec(all_emoji_keys):
    "http(s) URLs are read through fsspec's HTTP client (no shell, no curl); served here by a local HTTP server."
    import functools, http.server, socketserver, threading
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a): pass
    srv = socketserver.TCPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(EMOJI)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        n = len(list(EMOJI.glob("shard-*.tar"))) - 1
        url = f"http://127.0.0.1:{srv.server_address[1]}/shard-{{000000..{n:06d}}}.tar"
        assert keys(url) == all_emoji_keys
        missing = build_dataset(f"http://127.0.0.1:{srv.server_address[1]}/nope.tar", 4, image_size=64)
        with warnings.catch_warnings(record=True) as w, pytest.raises(RuntimeError, match="nothing is left to train on"):
            warnings.simplefilter("always")
            list(missing)
        assert missing.counter.total == {"unreadable_shard": 1} and any("nope.tar" in str(x.message) for x in w)
    finally: srv.shutdown(); srv.server_close()

@pytest.mark.parametrize("text, says", [
    ("a: 1\n", "lists sources (a YAML list of paths or URLs), not dict"),
    ("- a.tar\n- {b: 1}\n", "not list"),
    ("- !!python/object/apply:os.system [echo pwned]\n", "could not determine a constructor"),   # never runs code
    ("- &a [x, x, x, x, x, x, x, x, x, x]\n- &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "- &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n- &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "- [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", "more than 100000 values"),   # a billion-laughs listing
])
def test_a_yml_listing_is_read_as_the_config_is(tmp_path, text, says):
    "A `.yml` source goes through the config's loader: a list of sources, safe tags only, no alias bomb."
    from cascade_nb.config import ConfigError
    from cascade_nb.data.sources import DataError
    (tmp_path / "list.yml").write_text(text)
    with pytest.raises((ConfigError, DataError)) as e: resolve_shards(str(tmp_path / "list.yml"))
    assert says in str(e.value), str(e.value)
