"""Remote sources through a real client, no shell: s3:// against a local S3 server (moto, 127.0.0.1), from the data CLI,
the dataset (also in DataLoader workers) and the trainer; a missing client names the extra to install."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

EMOJI = ROOT / "data_samples" / "emoji"
moto_server = pytest.importorskip("moto.server", reason="moto[s3] + flask (the dev extra) runs the local S3 server")
pytest.importorskip("s3fs", reason="s3fs (the remote extra) reads s3:// sources")

@pytest.fixture(scope="module")
def s3():
    "A moto S3 server on a free loopback port with bucket 'shards' holding the emoji shards; yields the client env."
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_MAX_ATTEMPTS": "2"}   # bounded retries: a failure is seen quickly
    old = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL"]}
    os.environ.update(env)
    import s3fs; s3fs.S3FileSystem.clear_instance_cache()   # none made for another endpoint earlier in this process
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    env["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    import boto3
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
    client.create_bucket(Bucket="shards")
    for p in sorted(EMOJI.glob("shard-*.tar")): client.upload_file(str(p), "shards", f"emoji/{p.name}")
    yield env
    srv.stop()
    for k, v in old.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v

def brace():
    n = len(list(EMOJI.glob("shard-*.tar"))) - 1
    return f"s3://shards/emoji/shard-{{000000..{n:06d}}}.tar"

def local_keys():
    from cascade_nb.data import build_dataset
    return sorted(k for b in build_dataset(EMOJI, 16, image_size=64, shuffle_buffer=0, drop_last=False) for k in b["keys"])

def test_s3_source_from_the_cli(s3):
    res = run_cli("-m", "cascade_nb.data", "inspect", brace(), "--image-size", "64", "--json", env=s3, timeout=300)
    rep = json.loads(res.stdout)
    assert rep["samples"] == len(local_keys()) and rep["skipped"] == {}

def test_s3_source_in_dataloader_workers(s3):
    from cascade_nb.data import build_dataloader
    dl = build_dataloader(brace(), 16, num_workers=2, image_size=64, drop_last=False)
    assert sorted(k for b in dl for k in b["keys"]) == local_keys()

def test_s3_missing_object_is_counted(s3):
    import warnings
    from cascade_nb.data import build_dataset
    ds = build_dataset(["s3://shards/emoji/shard-000000.tar", "s3://shards/emoji/nope.tar"], 8, image_size=64, drop_last=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = sum(len(b["keys"]) for b in ds)
    assert n > 0 and ds.counter.total == {"unreadable_shard": 1} and any("nope.tar" in str(x.message) for x in w)

def test_training_reads_s3(s3, tmp_path):
    res = run_cli("-m", "cascade_nb.train", str(ROOT / "configs" / "demo.yaml"), f"webdataset_path={brace()}", "num_workers=0",
                  "image_size=32", "batch_size=4", "log_every=1", "updates=2", "save_every=100", "experiment_id=s3", "eval_every=null",
                  f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out", env=s3, timeout=600)
    assert "update 2/2: loss" in res.stdout

def test_missing_client_names_the_extra():
    code = ("import sys; sys.modules['s3fs'] = None\n"   # as if s3fs were not installed
            "from cascade_nb.data.__main__ import main; sys.exit(main(['inspect', 's3://bucket/a.tar']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and 'pip install "cascade_nb[remote]"' in res.stderr and "Traceback" not in res.stderr
