"""`python -m cascade_nb.lora export|check`: a run directory exported to the kohya/ComfyUI, official and embedding
layouts, each checked the consumer's way; one-line errors. Two calls run as a user runs them (subprocesses, ~5 s of
imports each: an export, and a bad option's exit status and one-line error); the others call the command's `main`
in this process (`python -m cascade_nb.lora` is `adapter_files.main`)."""
import json, subprocess, sys, pytest, torch, yaml
from conftest import ROOT

def lora_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "cascade_nb.lora", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)

def in_process(capsys, *args) -> subprocess.CompletedProcess:
    "The command's `main` in this process, read back like `lora_cli`: exit status, stdout, stderr."
    from cascade_nb.lora import main
    capsys.readouterr()
    try: code = main(list(map(str, args)))
    except SystemExit as e: code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    "A finished LoRA run of configs/lora_demo.yaml: info.json with its config, lora.safetensors with a token."
    from cascade_nb.models.stage_c import StageC
    from cascade_nb.models.clip import tiny_clip_text_model, load_clip_tokenizer, sample_tokenizer_dir
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict, save_lora
    from cascade_nb.train_tokens import add_train_tokens, token_state_dict
    tmp = tmp_path_factory.mktemp("lora_run")
    raw = yaml.safe_load((ROOT / "configs" / "lora_demo.yaml").read_text())
    torch.manual_seed(0)
    model = StageC.from_preset("tiny", **raw["model_overrides"])
    apply_lora(model, raw["module_filters"], rank=raw["rank"], init="peft")
    with torch.no_grad():
        for l in lora_layers(model).values(): l.lora_up.normal_(std=0.05)
    tok, text = load_clip_tokenizer(sample_tokenizer_dir()), tiny_clip_text_model()
    add_train_tokens(tok, text, raw["train_tokens"])
    with torch.no_grad(): text.get_input_embeddings().delta.normal_(std=0.1)
    run = tmp / "run"; run.mkdir()
    save_lora({**lora_state_dict(model), **token_state_dict(tok, text)}, run / "lora.safetensors")
    (run / "info.json").write_text(json.dumps({"config": raw}))
    model_yaml = tmp / "model.yaml"                        # the same model, randomly initialised (no checkpoint here)
    model_yaml.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "generator_checkpoint_path"}))
    return run, model_yaml

def test_export_kohya_then_check_it_for_comfyui_and_kohya(run_dir, tmp_path, capsys):
    run, model_yaml = run_dir
    res = lora_cli("export", run, "--to", "kohya", "--out", tmp_path / "k.safetensors")
    assert res.returncode == 0, res.stderr
    assert "export the tokens with --to embedding" in res.stderr
    from cascade_nb.core import safetensors_header
    meta, shapes = safetensors_header(tmp_path / "k.safetensors")
    assert meta["ss_network_dim"] == "4" and meta["ss_sd_model_name"] == "generator.safetensors"
    assert json.loads(meta["cascade_nb.trigger_tokens"]) == ["[emoji]"]
    assert "lora_unet_down_blocks_0_2_attention_attn_to_q.alpha" in shapes
    res = in_process(capsys, "check", tmp_path / "k.safetensors", "--for", "comfyui", "--model", model_yaml)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "comfyui: loads 72 of 72 keys" and "warning" not in res.stdout
    row = next(line for line in lines if line.startswith("lora_unet_down_blocks_0_2_attention_attn_to_q "))
    # family, rank, alpha, scale; |dW| measured on the merged model
    assert row.split()[1:5] == ["lora", "4", "1", "0.25"] and float(row.split()[5]) > 0

def test_export_official_and_check_it_for_official_and_comfyui(run_dir, tmp_path, capsys):
    run, model_yaml = run_dir
    res = in_process(capsys, "export", run, "--to", "official", "--out", tmp_path / "o.safetensors")
    assert res.returncode == 0, res.stderr
    res = in_process(capsys, "check", tmp_path / "o.safetensors", "--for", "official", "--model", model_yaml)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "official: loads 26 of 26 keys" in res.stdout and "token rows changed: [49408]" in res.stdout
    from cascade_nb.lora import main
    assert main(["check", str(tmp_path / "o.safetensors")]) == 1          # ComfyUI maps none of its keys
    assert capsys.readouterr().out.startswith("comfyui: loads 0 of 26 keys; skips 26: embeddings.indices")

def test_export_embedding_and_errors(run_dir, tmp_path, capsys):
    from safetensors.torch import load_file
    from cascade_nb.lora import main
    run, _ = run_dir
    assert main(["export", str(run), "--to", "embedding", "--out", str(tmp_path / "emoji.safetensors")]) == 0
    assert load_file(str(tmp_path / "emoji.safetensors"))["clip_g"].shape == (1, 64)
    # without the run's text model the width is CLIP-G's 1280: ComfyUI would ignore this 64-wide test vector
    assert main(["check", str(tmp_path / "emoji.safetensors"), "--for", "comfyui"]) == 1
    assert "width 64 != the text encoder's 1280" in capsys.readouterr().out
    res = lora_cli("export", run, "--to", "comfy", "--out", tmp_path / "x")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("config error: --to: 'comfy' is not a registered adapter layout; (registered: "
                                 "cascade_nb, official, kohya, peft, embedding"), res.stderr

def test_check_errors_are_one_line(run_dir, tmp_path, capsys):
    from cascade_nb.lora import main
    for args, msg in [(("check", run_dir[0], "--for", "comfy"), "--for: 'comfy' is not a registered adapter consumer"),
                      (("check", tmp_path / "missing.safetensors"), "missing.safetensors: no such file"),
                      (("check", tmp_path), "neither a run directory (info.json) nor a peft folder")]:
        with pytest.raises(SystemExit) as e: main(list(map(str, args)))
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and msg in err, err

def test_lokr_and_oft_runs_release_headers_and_check_clean(tmp_path, capsys):
    """A tiny LoKr and a rescaled-OFT run (in this process, with EMA and validation): lora.safetensors, lora_ema and
    lora_best carry the adapter type, its options, rank/alpha per layer and the base; `check` reads the run's file and
    its kohya export (with the base weights: LoKr's 4-row w1 and OFT's rescale go out as `.diff`) with exit 0."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.core import safetensors_header
    from cascade_nb.lora import main
    from test_lora_types import demo_args
    ema = ["updates=2", "save_every=2", "ema_start_iters=1", "ema_iters=1", "ema_beta=0.9"]
    for kind, options in (("lokr", {"lokr_factor": 4}), ("oft", {"oft_block_size": 16, "oft_rescale": True})):
        args = demo_args(tmp_path, kind, *ema)
        train(load_config(args[0], [str(a) for a in args[1:]]))
        capsys.readouterr()
        run, base = tmp_path / "ckpt" / kind, tmp_path / "pretrained.safetensors"
        for name in ("lora", "lora_ema", "lora_best"):
            meta = safetensors_header(run / f"{name}.safetensors")[0]
            assert meta["cascade_nb.adapter_type"] == kind and meta["cascade_nb.generator_checkpoint_path"] == str(base)
            assert json.loads(meta["cascade_nb.adapter_options"]).items() >= options.items(), meta
            layers = json.loads(meta["cascade_nb.layers"])
            assert len(layers) == 12 and {lay["kind"] for lay in layers.values()} == {kind}
            assert json.loads(meta["cascade_nb.module_filters"]) == [".attn"]
            # which weights each file holds: the EMA's, else the live ones (the validation loss's best is theirs)
            assert meta["cascade_nb.weights"] == ("ema" if name == "lora_ema" else "live"), (name, meta)
        assert main(["check", run / "lora.safetensors", "--model", base]) == 0
        table = capsys.readouterr().out
        assert table.startswith("cascade_nb: loads") and "warning" not in table and f" {kind} " in table
        if kind == "lokr":                                 # without the base: no .diff, a one-line error
            with pytest.raises(SystemExit, match="2"): main(["export", run, "--to", "kohya", "--out", tmp_path / "x"])
            assert "no exact q/k/v split" in capsys.readouterr().err
        assert main(["export", run, "--to", "kohya", "--out", tmp_path / f"{kind}.safetensors", "--model", base]) == 0
        assert capsys.readouterr().out.strip().endswith(f"from {run / 'lora_ema.safetensors'} (the EMA)")
        exported = safetensors_header(tmp_path / f"{kind}.safetensors")[0]
        assert json.loads(exported["cascade_nb.adapter_options"]) and exported["cascade_nb.weights"] == "ema"
    res = in_process(capsys, "check", tmp_path / "oft.safetensors", "--model", tmp_path / "pretrained.safetensors")
    assert res.returncode == 0 and res.stdout.startswith("comfyui: loads"), res.stdout + res.stderr
    assert " diff " in res.stdout and "warning" not in res.stdout
    res = in_process(capsys, "check", tmp_path / "lokr.safetensors", "--model", tmp_path / "pretrained.safetensors")
    assert res.returncode == 0 and " lokr " in res.stdout and " diff " in res.stdout, res.stdout + res.stderr

def test_export_and_check_take_the_weights_the_flag_names(run_dir, tmp_path, capsys):
    """`--ema / --no-ema` (issue 49): a run's lora_ema.safetensors by default, its lora.safetensors with --no-ema; the
    export's header says which weights it holds and the command prints the file it read; --ema on a run without an
    EMA, or on a lone file, is one line."""
    import shutil
    from safetensors.torch import load_file
    from cascade_nb.core import safetensors_header
    from cascade_nb.lora_file import save_lora
    run = tmp_path / "run"
    shutil.copytree(run_dir[0], run)
    live = load_file(str(run / "lora.safetensors"))
    save_lora({k: v + 0.01 if v.is_floating_point() else v for k, v in live.items()}, run / "lora_ema.safetensors",
              {"cascade_nb.weights": "ema"})
    ema = load_file(str(run / "lora_ema.safetensors"))
    for flag, name, sd, kind in (((), "lora_ema", ema, "ema"), (("--ema",), "lora_ema", ema, "ema"),
                                 (("--no-ema",), "lora", live, "live")):
        out = tmp_path / f"{name}{len(flag)}.safetensors"
        res = in_process(capsys, "export", run, "--to", "cascade_nb", "--out", out, *flag)
        label = {"ema": "the EMA", "live": "the live weights"}[kind]
        assert res.returncode == 0 and res.stdout.strip().endswith(f"from {run / name}.safetensors ({label})"), res
        assert safetensors_header(out)[0]["cascade_nb.weights"] == kind
        got = load_file(str(out))
        assert all(torch.equal(got[k], sd[k]) for k in sd if k.endswith("lora_up"))
    res = in_process(capsys, "check", run, "--no-ema")
    assert res.stdout.splitlines()[0] == f"{run / 'lora.safetensors'} (the live weights)", res.stdout
    for source, says in ((run_dir[0], f"{run_dir[0]} has no lora_ema.safetensors (it kept no EMA); it has "
                                      "lora.safetensors"),
                         (run / "lora.safetensors", "--ema/--no-ema choose among a run directory's weights")):
        for cmd in (["export", source, "--to", "kohya", "--out", tmp_path / "k.safetensors"], ["check", source]):
            res = in_process(capsys, *cmd, "--ema")
            err = res.stderr.strip().splitlines()
            assert res.returncode == 2 and len(err) == 1 and says in err[0], res.stderr
    assert not (tmp_path / "k.safetensors").exists()

def test_export_never_overwrites_without_asking(run_dir, tmp_path, capsys):
    """B26, B27, B31: the run's own released LoRA is never an export target (not even with --overwrite); an existing
    file is replaced only with --overwrite; a peft folder is replaced whole (no config of one export beside the
    weights of another)."""
    import hashlib
    from cascade_nb.lora import main
    run, _ = run_dir
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    released = sha(run / "lora.safetensors")
    for out in (run / "lora.safetensors", run / "peft"):
        res = in_process(capsys, "export", run, "--to", "peft" if out.name == "peft" else "kohya", "--out", out,
                         "--overwrite")
        assert res.returncode == 2 and "lies in the run directory" in res.stderr, res.stderr
    assert sha(run / "lora.safetensors") == released and not (run / "peft").exists()
    mine = tmp_path / "notes.safetensors"
    mine.write_bytes(b"my notes")
    res = in_process(capsys, "export", run, "--to", "kohya", "--out", mine)
    assert res.returncode == 2 and "already exists; pass --overwrite" in res.stderr and mine.read_bytes() == b"my notes"
    assert in_process(capsys, "export", run, "--to", "kohya", "--out", mine, "--overwrite").returncode == 0
    assert mine.read_bytes() != b"my notes"
    (tmp_path / "peft").mkdir(); (tmp_path / "peft" / "stale.bin").write_bytes(b"old")
    assert in_process(capsys, "export", run, "--to", "peft", "--out", tmp_path / "peft").returncode == 2
    assert in_process(capsys, "export", run, "--to", "peft", "--out", tmp_path / "peft", "--overwrite").returncode == 0
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.safetensors", "peft"]     # no temporary left

def test_export_imports_no_module_the_run_names(run_dir, tmp_path, capsys):
    "B69 for `lora export` / `check`: the run's info.json names a module; it is refused unless --import names it."
    import shutil
    run = tmp_path / "run"
    shutil.copytree(run_dir[0], run)
    info = json.loads((run / "info.json").read_text())
    (run / "info.json").write_text(json.dumps({"config": {**info["config"], "imports": ["cnb_helpers_lora"]}}))
    (run / "cnb_helpers_lora.py").write_text("raise SystemExit('never')\n")
    for cmd in (["export", run, "--to", "kohya", "--out", tmp_path / "k.safetensors"], ["check", run]):
        res = in_process(capsys, *cmd)
        assert res.returncode == 2 and "--import cnb_helpers_lora" in res.stderr, res.stderr
    assert "cnb_helpers_lora" not in sys.modules
