"""Weights by hub id (cascade_nb.hub) without a network: downloads through huggingface_hub from a small HTTP server on
127.0.0.1 that speaks the hub's file-resolve protocol, offline resolution from a cache the test lays out, and the
trainer given a hub id for its generator.

The server answers HEAD and GET `/{owner}/{repo}/resolve/{revision}/{path}` the way huggingface_hub 2.x needs for a
plain (non-xet) file: `ETag` (the blob's name in the cache), `X-Repo-Commit` (the snapshot folder), `Content-Length`,
`Range` requests answered 206 with `Content-Range`, and errors as the hub sends them, a status with `X-Error-Code`
(`EntryNotFound`, `RepoNotFound`, `GatedRepo`). It never sends `X-Xet-*` headers, so no xet download is tried.
huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE into `huggingface_hub.constants` at import, but
`cascade_nb.hub.hub_settings` reads the environment at each call and passes them as arguments, so `monkeypatch.setenv`
is enough. Two constants are patched: `constants.HF_HUB_OFFLINE` (False for the online tests, in case the environment
running the suite is offline: huggingface_hub's HTTP layer refuses every request when it is True) and
`constants.DOWNLOAD_CHUNK_SIZE` (10 MB; 64 KiB here, so that a cut-off 2 MB file has whole chunks on disk to resume
from: the bytes of an unfinished chunk are lost with the connection)."""
import hashlib, http.server, json, os, re, threading, urllib.parse
import pytest
import torch
from safetensors.torch import load_file
from conftest import ROOT, run_cli
from cascade_nb.core import save_safetensors_atomic
from cascade_nb.hub import weights_file
from cascade_nb.models.stage_c import StageC, load_stage_c

COMMIT = "0123456789abcdef" * 2 + "01234567"
CHUNK = 64 * 1024
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")


class HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass

    def _record(self):
        self.server.hub["requests"].append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

    def _answer(self, body: bool):
        hub = self.server.hub
        self._record()
        m = RESOLVE.fullmatch(urllib.parse.unquote(self.path))
        repo, path = (m["repo"], m["path"]) if m else (None, None)
        if repo in hub["gated"]: return self._error(403, "GatedRepo")
        if repo not in hub["repos"]: return self._error(401, "RepoNotFound")
        data = hub["repos"][repo].get(path)
        if data is None: return self._error(404, "EntryNotFound")
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start: self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body: return
        fault = hub["faults"][path].pop(0) if hub["faults"].get(path) else None
        if fault is not None:
            # promise the whole file, send `fault` bytes, close: the client sees a cut-off body
            self.wfile.write(data[start:start + fault]); self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data[start:])

    def _error(self, status: int, code: str):
        self.send_response(status)
        self.send_header("X-Error-Code", code); self.send_header("X-Error-Message", code)
        self.send_header("Content-Length", "0"); self.end_headers()

    def do_HEAD(self): self._answer(body=False)

    def do_GET(self):
        m = RESOLVE.fullmatch(urllib.parse.unquote(self.path))
        faults = self.server.hub["faults"].get(m["path"] if m else None)
        if faults and faults[0] == "500":
            # a failing retry: huggingface_hub gives up and keeps the partial file for the next call
            faults.pop(0)
            self._record()
            return self._error(500, "Internal")
        self._answer(body=True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    "A hub on 127.0.0.1 (HF_ENDPOINT), an empty cache (HF_HUB_CACHE); its state: repos, gated, faults, requests."
    from huggingface_hub import constants
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    server.hub = dict(repos={}, gated=set(), faults={}, requests=[])
    thread = threading.Thread(target=server.serve_forever, daemon=True); thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    yield server.hub
    server.shutdown(); server.server_close(); thread.join()


def tiny_stage_c_bytes(tmp_path) -> tuple[bytes, StageC]:
    model = StageC.from_preset("tiny")
    save_safetensors_atomic(model.state_dict(), tmp_path / "src.safetensors")   # official layout: no metadata
    return (tmp_path / "src.safetensors").read_bytes(), model


def gets(hub): return [h for method, _, h in hub["requests"] if method == "GET"]


def test_download_into_empty_cache_then_strict_load(hub, tmp_path):
    data, model = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/rep"] = {"sub/stage_c_tiny.safetensors": data}
    loaded = load_stage_c("hf://own/rep/sub/stage_c_tiny.safetensors", preset="tiny")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    cached = weights_file("hf://own/rep/sub/stage_c_tiny.safetensors")
    assert cached == tmp_path / "cache" / "models--own--rep" / "snapshots" / COMMIT / "sub" / "stage_c_tiny.safetensors"
    assert cached.read_bytes() == data and len(gets(hub)) == 1       # the second resolution reads the cache
    # a file of another model is refused from its header, naming the file
    with pytest.raises(ValueError, match=r"stage_c_tiny.safetensors does not match StageC .* shapes differ"):
        load_stage_c("hf://own/rep/sub/stage_c_tiny.safetensors", preset="tiny", c_hidden=[32, 64])


def test_missing_file_repo_and_gated_repo_are_one_line(hub):
    hub["repos"]["own/rep"] = {"a.safetensors": b""}
    hub["gated"].add("own/gated")
    cases = {"hf://own/rep/stage_b.safetensors@v1": (FileNotFoundError, "own/rep has no file 'stage_b.safetensors' at "
                                                     "revision 'v1'"),
             "hf://own/nope/a.safetensors": (FileNotFoundError, "no repository own/nope at http://127.0.0.1"),
             "hf://own/gated/a.safetensors": (PermissionError, "own/gated is gated: accept its licence at "
                                             "http://127.0.0.1:")}
    for spec, (kind, text) in cases.items():
        with pytest.raises(kind) as e: weights_file(spec)
        assert text in str(e.value) and str(e.value).startswith(spec) and "\n" not in str(e.value), str(e.value)
    assert "and log in (`hf auth login`, or set HF_TOKEN)" in str(pytest.raises(PermissionError, weights_file,
                                                                                "hf://own/gated/a.safetensors").value)


def test_cut_off_download_resumes_with_a_range_request(hub, tmp_path):
    data, _ = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/rep"] = {"w.safetensors": data}
    cut = 10 * CHUNK + 123
    # the first GET is cut off after `cut` bytes: huggingface_hub retries within the call, from the chunks it has
    hub["faults"]["w.safetensors"] = [cut]
    assert weights_file("hf://own/rep/w.safetensors").read_bytes() == data
    first, second = gets(hub)
    resumed = int(re.fullmatch(r"bytes=(\d+)-", second["range"])[1])
    assert "range" not in first and 0 < resumed <= cut and resumed % CHUNK == 0, second


def test_failed_download_leaves_no_partial_file_and_the_next_call_starts_over(hub, tmp_path):
    """huggingface_hub 2.4.0 resumes only within a call: it downloads into a temp file unique to the call and deletes it
    when the call fails (file_download._download_to_tmp_and_move, huggingface_hub PR #4228), so a later call never
    appends to a stale partial file; it starts over. This pins that behaviour, which the notebook's prose states."""
    data, _ = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/rep"] = {"w.safetensors": data}
    # cut off, and the retry fails too: the call gives up with one line
    hub["faults"]["w.safetensors"] = [12 * CHUNK + 45, "500"]
    with pytest.raises(OSError, match=r"^hf://own/rep/w.safetensors: the hub answered HTTP 500: try again later"):
        weights_file("hf://own/rep/w.safetensors")
    assert "range" in gets(hub)[-1]                                     # the failed retry was a resume
    blobs = tmp_path / "cache" / "models--own--rep" / "blobs"
    assert not list(blobs.glob("*")), list(blobs.glob("*"))             # nothing partial, nothing corrupt
    assert weights_file("hf://own/rep/w.safetensors").read_bytes() == data
    assert "range" not in gets(hub)[-1] and len(gets(hub)) == 3


def test_offline_uses_the_cache_and_names_what_is_missing(hub, tmp_path, monkeypatch):
    data, _ = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/rep"] = {"w.safetensors": data}
    weights_file("hf://own/rep/w.safetensors")
    n = len(hub["requests"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert weights_file("hf://own/rep/w.safetensors").read_bytes() == data
    with pytest.raises(FileNotFoundError) as e: weights_file("hf://own/rep/other.safetensors")
    assert str(e.value) == ("hf://own/rep/other.safetensors: other.safetensors of own/rep (revision 'main') is not "
                            "downloaded yet and HF_HUB_OFFLINE is set: run once online, or "
                            "`hf download own/rep other.safetensors`")
    assert len(hub["requests"]) == n                                  # offline: not one request


def test_trainer_takes_a_hub_id_for_its_generator_offline(tmp_path):
    "The demo config at tiny size, its generator from `hf://own/demo/...` in a cache laid out here, HF_HUB_OFFLINE=1."
    cache, overrides = tmp_path / "cache", dict(c_in=3, c_out=3, patch_size=2)
    snap = cache / "models--own--demo" / "snapshots" / COMMIT
    start = StageC.from_preset("tiny", **overrides)
    # far from a fresh init: the trained weights can only be this close to it if training started from the file
    with torch.no_grad():
        for p in start.parameters(): p.fill_(0.05)
    save_safetensors_atomic(start.state_dict(), snap / "stage_c_demo.safetensors")
    (cache / "models--own--demo" / "refs").mkdir(); (cache / "models--own--demo" / "refs" / "main").write_text(COMMIT)
    args = [ROOT / "configs" / "demo.yaml", "experiment_id=hub", f"checkpoint_path={tmp_path}/ckpt",
            f"output_path={tmp_path}/out", "webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0",
            "image_size=16", "batch_size=4", "updates=2", "save_every=2", "lr=1e-3", "warmup_updates=1",
            "dataset_filters=null", "eval_every=null", "best_metric=null", "sample_steps=2", "tracker=none",
            "generator_checkpoint_path=hf://own/demo/stage_c_demo.safetensors"]
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    run_cli("-m", "cascade_nb.train", *args, env=env)
    trained = load_file(str(tmp_path / "ckpt" / "hub" / "generator.safetensors"))
    info = json.loads((tmp_path / "ckpt" / "hub" / "info.json").read_text())
    assert info["config"]["generator_checkpoint_path"] == "hf://own/demo/stage_c_demo.safetensors"
    # two Adam updates at lr 1e-3 move a weight by at most ~2e-3
    drift = max((v.float() - start.state_dict()[k]).abs().max().item() for k, v in trained.items())
    assert 0 < drift < 3e-3, drift
    # a file the cache lacks: one line and exit status 2 before any data is read
    res = run_cli("-m", "cascade_nb.train", *args[:-1], "experiment_id=hub2",
                  "generator_checkpoint_path=hf://own/demo/stage_c_other.safetensors", env=env, check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "hf://own/demo/stage_c_other.safetensors: stage_c_other.safetensors of own/demo (revision 'main') is not " \
           "downloaded yet and HF_HUB_OFFLINE is set" in res.stderr.splitlines()[-1]


def test_generate_and_the_pipeline_take_stage_c_weights_by_hub_id(hub, tmp_path, capsys):
    """`generate --stage-c-weights hf://...`: its check fetches the file before any model is built (a missing one is its
    one line, exit 2), and the pipeline's Stage C loader loads the fetched file."""
    from cascade_nb.generate import main
    from cascade_nb.inference import stage_c_weights_loader
    data, model = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/student"] = {"stage_c_student.safetensors": data}
    (tmp_path / "models").mkdir()
    args = ["a red bus", "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"), "--device", "cpu"]
    assert main([*args, "--stage-c-weights", "hf://own/student/missing.safetensors"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: hf://own/student/missing.safetensors: own/student has no file 'missing.safetensors' at revision "
        f"'main' (its files: {os.environ['HF_ENDPOINT']}/own/student/tree/main)")
    # with the file there, the check passes and the next missing thing is --models' Stage B: the file was fetched first
    assert main([*args, "--stage-c-weights", "hf://own/student/stage_c_student.safetensors"]) == 2
    assert "no stage_b*.safetensors and no diffusers decoder/ in --models" in capsys.readouterr().err
    assert [m for m, _, _ in hub["requests"]][-2:] == ["HEAD", "GET"]
    loaded = stage_c_weights_loader("hf://own/student/stage_c_student.safetensors", "tiny", torch.float32, "cpu")()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_controlnet_and_lora_files_by_hub_id(hub, tmp_path):
    """`controlnet_checkpoint_path` and `lora_checkpoint_path` (through `load_controlnet` and `load_lora_file`) take hub
    ids too: each file is fetched once and loads as the local file does."""
    from cascade_nb.controlnet import ControlNet, load_controlnet
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict, save_lora
    from cascade_nb.lora_converters import load_lora_file
    torch.manual_seed(0)
    cn = ControlNet(c_in=1, c_proj=64, proj_blocks=(0, 4), bottleneck_mode="simple")
    save_safetensors_atomic(cn.state_dict(), tmp_path / "cn.safetensors")
    adapted = StageC.from_preset("tiny")
    apply_lora(adapted, [".attn"], rank=2, alpha=2.0, init="peft")
    with torch.no_grad():
        for layer in lora_layers(adapted).values(): layer.lora_up.normal_(std=0.05)
    save_lora(lora_state_dict(adapted), tmp_path / "lora.safetensors")
    hub["repos"]["own/adapters"] = {"cn.safetensors": (tmp_path / "cn.safetensors").read_bytes(),
                                    "lora.safetensors": (tmp_path / "lora.safetensors").read_bytes()}
    got = load_controlnet("hf://own/adapters/cn.safetensors", (0, 4))
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in cn.state_dict().items())
    base = StageC.from_preset("tiny")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    twin = StageC.from_preset("tiny"); twin.load_state_dict(before)
    load_lora_file("hf://own/adapters/lora.safetensors", base)
    load_lora_file(tmp_path / "lora.safetensors", twin)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in base.state_dict().items())
    assert not all(torch.equal(v, before[k]) for k, v in base.state_dict().items())   # the LoRA was merged
    assert len(gets(hub)) == 2


def test_a_lora_run_on_a_hub_base_finds_its_base(hub, tmp_path):
    """A LoRA run whose `generator_checkpoint_path` is a hub id samples (`lora_base_generator`): the base is fetched,
    not looked for as a local file (bench/real_size.py found `python -m cascade_nb.sample` refusing such a run)."""
    from cascade_nb.config import config_from_dict
    from cascade_nb.lora_training import lora_base_generator
    data, model = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/base"] = {"stage_c_base.safetensors": data}
    run = tmp_path / "run"
    run.mkdir()
    spec = "hf://own/base/stage_c_base.safetensors"
    (run / "info.json").write_text(json.dumps({"config": {"generator_checkpoint_path": spec}}))
    cfg = config_from_dict({"experiment_id": "x", "webdataset_path": "x", "model_version": "tiny",
                            "module_filters": [".attn"]})
    base = lora_base_generator(cfg, run)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in model.state_dict().items())
    (run / "info.json").write_text(json.dumps({"config": {"generator_checkpoint_path": str(tmp_path / "gone.st")}}))
    with pytest.raises(FileNotFoundError, match="gone.st, is not here"): lora_base_generator(cfg, run)


def test_a_distillation_teacher_by_hub_id(hub, tmp_path):
    "`teacher_checkpoint_path: hf://...` (an LCM student's teacher): fetched and loaded as the local file would be."
    from cascade_nb.config import config_from_dict
    from cascade_nb.distill import load_teacher
    data, model = tiny_stage_c_bytes(tmp_path)
    hub["repos"]["own/teacher"] = {"stage_c_teacher.safetensors": data}
    cfg = config_from_dict({"experiment_id": "x", "webdataset_path": "x", "model_version": "tiny", "mode": "lcm",
                            "teacher_checkpoint_path": "hf://own/teacher/stage_c_teacher.safetensors",
                            "teacher_model_version": "tiny"})
    teacher, tcfg = load_teacher(cfg)
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in model.state_dict().items())
    assert tcfg.model.generator_checkpoint_path == "hf://own/teacher/stage_c_teacher.safetensors"


def test_a_bare_path_is_local_and_never_asks_the_hub(hub, tmp_path, monkeypatch):
    "B38: `checkpoints/demo/generator.safetensors` missing here is not fetched from a hub repo `checkpoints/demo`."
    hub["repos"]["checkpoints/demo"] = {"generator.safetensors": tiny_stage_c_bytes(tmp_path)[0]}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e: weights_file("checkpoints/demo/generator.safetensors")
    assert str(e.value) == ("[Errno 2] no such file (read as a local path: if you meant a hub file, write "
                            "hf://checkpoints/demo/generator.safetensors): 'checkpoints/demo/generator.safetensors'")
    assert hub["requests"] == []
    assert weights_file("hf://checkpoints/demo/generator.safetensors").is_file()   # named as a hub file, it is one


def test_hub_ids_that_leave_the_repository_are_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    "B33, B34, B36: '..', an absolute path, a cached ref pointing outside the cache; nothing outside is read."
    from cascade_nb.hub import HubBadFile
    from cascade_nb.train import main
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    repo = cache / "models--own--rep"
    save_safetensors_atomic({"w": torch.zeros(1)}, repo / "snapshots" / COMMIT / "a.safetensors")
    save_safetensors_atomic({"secret": torch.ones(1)}, outside / COMMIT / "a.safetensors")
    (repo / "refs").mkdir(); (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "evil").write_text(f"../../../outside/{COMMIT}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache)); monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    specs = {"hf://own/rep/../../../outside/a.safetensors": "its path '../../../outside/a.safetensors' has a '..'",
             f"hf://own/rep/{outside}/a.safetensors": "has a '' segment",
             "hf://own/rep/a.safetensors@evil": "huggingface_hub refuses it (Invalid pointer path"}
    for spec, says in specs.items():
        with pytest.raises(HubBadFile, match=re.escape(says)): weights_file(spec)
    # through the trainer: one line naming the key and the value, exit status 2, no run folder
    args = [ROOT / "configs" / "demo.yaml", "experiment_id=evil", f"checkpoint_path={tmp_path}/ckpt",
            f"output_path={tmp_path}/out", "tracker=none", "eval_every=null", "num_workers=0",
            "generator_checkpoint_path=hf://own/rep/a.safetensors@evil"]
    with pytest.raises(SystemExit) as e: main([str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("config error: key 'generator_checkpoint_path': "
                                                    "hf://own/rep/a.safetensors@evil: huggingface_hub refuses it"), err
    assert not (tmp_path / "ckpt" / "evil").exists()
