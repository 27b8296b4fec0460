"""Hostile adapter files (the audit's Part B, B1-B32 of the LoRA files): each crafted once in a module fixture for the
tiny model, and read by `python -m cascade_nb.lora check|export` (its `main` in this process), by training's
`lora_checkpoint_path` load and by sampling's load (`load_lora_file`). Bad input is one line naming the file, key or
layer; `check` warns (exit 1) about values that load but look wrong; one subprocess shows the exit status as a user
sees it."""
import json, struct, subprocess, sys, pytest, torch, yaml
from conftest import ROOT
from test_lora_cli import in_process, lora_cli

P_IN, P_OUT = "down_blocks.0.2.attention.attn.in_proj_weight", "down_blocks.0.2.attention.attn.out_proj.weight"

def _raw_header(path, header: dict, data: bytes = b""):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)

@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """{name: path} of the bad files (and `good`, a run directory, `model_yaml`, `ckpt` a bare tiny checkpoint)."""
    from safetensors.torch import save_file
    from cascade_nb.models.stage_c import StageC
    from cascade_nb.models.clip import tiny_clip_text_model, load_clip_tokenizer, sample_tokenizer_dir
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict
    from cascade_nb.train_tokens import add_train_tokens, token_state_dict
    tmp = tmp_path_factory.mktemp("hostile")
    raw = yaml.safe_load((ROOT / "configs" / "lora_demo.yaml").read_text())
    torch.manual_seed(0)
    model = StageC.from_preset("tiny", **raw["model_overrides"])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "generator.safetensors"))
    apply_lora(model, raw["module_filters"], rank=raw["rank"], init="peft")
    with torch.no_grad():
        for l in lora_layers(model).values(): l.lora_up.normal_(std=0.05)
    tok, text = load_clip_tokenizer(sample_tokenizer_dir()), tiny_clip_text_model()
    add_train_tokens(tok, text, raw["train_tokens"])
    good = {**lora_state_dict(model), **token_state_dict(tok, text)}
    assert f"{P_IN}.lora_down" in good and f"{P_OUT}.lora_up" in good
    files = {"model_yaml": tmp / "model.yaml", "ckpt": tmp / "generator.safetensors"}
    files["model_yaml"].write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "generator_checkpoint_path"}))

    def variant(name, change=None, metadata=None, run=False, **extra):
        sd = {k: v.clone() for k, v in good.items()}
        if change: change(sd)
        sd.update(extra)
        folder = tmp / name
        if run:   # a run directory: its info.json names the model
            folder.mkdir()
            (folder / "info.json").write_text(json.dumps({"config": raw}))
            path = folder / "lora.safetensors"
        else: path = tmp / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
        files[name] = folder if run else path

    variant("good", run=True)
    huge = {"x": {"dtype": "F32", "shape": [10**12], "data_offsets": [0, 4 * 10**12]}}   # 4 TB in 16 bytes
    _raw_header(tmp / "hdr_huge.safetensors", huge, b"\0" * 16)
    _raw_header(tmp / "hdr_inconsistent.safetensors", {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
                b"\0" * 8)
    _raw_header(tmp / "meta_list.safetensors", {"__metadata__": [1, 2]})
    _raw_header(tmp / "meta_nonstr.safetensors", {"__metadata__": {"a": 1}})
    (tmp / "empty.safetensors").write_bytes(b"")
    torch.save({"x": torch.zeros(2)}, tmp / "pickle.safetensors")
    for n in ("hdr_huge", "hdr_inconsistent", "meta_list", "meta_nonstr", "empty", "pickle"):
        files[n] = tmp / f"{n}.safetensors"
    variant("meta_options_list", metadata={"cascade_nb.adapter_options": "[1, 2]"})
    variant("meta_options_bad", metadata={"cascade_nb.adapter_options": "{not json"})
    for name, dtype in (("dtype_int", torch.int64), ("dtype_bool", torch.bool), ("dtype_f8", torch.float8_e4m3fn)):
        variant(name, lambda sd, d=dtype: sd.update({f"{P_OUT}.lora_up": sd[f"{P_OUT}.lora_up"].to(d)}))
    variant("alpha_vector", lambda sd: sd.update({f"{P_OUT}.alpha": torch.ones(4)}))
    variant("nan_up", lambda sd: sd[f"{P_OUT}.lora_up"].__setitem__(0, float("nan")))
    variant("inf_down", lambda sd: sd[f"{P_OUT}.lora_down"].__setitem__(0, float("inf")))
    variant("alpha_inf", lambda sd: sd.update({f"{P_OUT}.alpha": torch.tensor(float("inf"))}))
    variant("huge_values", lambda sd: sd[f"{P_OUT}.lora_up"].mul_(1e8))
    variant("alpha_neg", lambda sd: sd.update({f"{P_OUT}.alpha": torch.tensor(-1e6)}))
    variant("rank0", lambda sd: sd.update({f"{P_IN}.lora_down": torch.zeros(0, 64),
                                           f"{P_IN}.lora_up": torch.zeros(192, 0)}))
    pair = lambda stem: {f"{stem}.lora_down": torch.zeros(4, 64), f"{stem}.lora_up": torch.zeros(64, 4)}
    variant("keys_dotdot", **pair("../../../tmp/evil"))
    variant("keys_slash", **pair("/etc/passwd.weight"))
    variant("keys_unknown", **pair("no_such.block.weight"), run=True)
    variant("keys_unknown_tensor", **{f"{P_OUT}.lora_mid": torch.zeros(4, 4)})
    files["lokr_mixed_only"] = tmp / "lokr_mixed_only.safetensors"   # lokr_w2 and lokr_w2_a/_b both
    save_file({f"{P_OUT}.{n}": torch.zeros(s) for n, s in (("lokr_w1", (8, 8)), ("lokr_w2", (8, 8)),
                                                           ("lokr_w2_a", (8, 2)), ("lokr_w2_b", (2, 8)))},
              str(files["lokr_mixed_only"]))
    files["kohya_sdxl"] = tmp / "kohya_sdxl.safetensors"            # SDXL's module names
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 64),
               "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.zeros(64, 4)}, str(files["kohya_sdxl"]))
    variant("up_without_down", lambda sd: sd.pop(f"{P_OUT}.lora_down"))
    variant("lora_transposed", lambda sd: sd.update({f"{P_IN}.lora_down": sd[f"{P_IN}.lora_up"].T.contiguous(),
                                                     f"{P_IN}.lora_up": sd[f"{P_IN}.lora_down"].T.contiguous()}))
    variant("lora_transposed_run", lambda sd: sd.update({f"{P_IN}.lora_down": sd[f"{P_IN}.lora_up"].T.contiguous(),
                                                         f"{P_IN}.lora_up": sd[f"{P_IN}.lora_down"].T.contiguous()}),
            run=True)
    variant("lora_wrong_out", lambda sd: sd.update({f"{P_IN}.lora_up": torch.zeros(100, 4)}))
    drop_out = lambda sd: [sd.pop(f"{P_OUT}.{n}") for n in ("lora_down", "lora_up", "alpha")]
    variant("oft_nonsquare", drop_out, **{f"{P_OUT}.oft_blocks": torch.zeros(4, 16, 8)})
    variant("oft_count", drop_out, **{f"{P_OUT}.oft_blocks": torch.zeros(3, 16, 16)})
    variant("lokr_bad", drop_out, **{f"{P_OUT}.lokr_w1": torch.zeros(4, 4), f"{P_OUT}.lokr_w2_a": torch.zeros(16, 2),
                                     f"{P_OUT}.lokr_w2_b": torch.zeros(3, 16)})
    variant("loha_half", drop_out, **{f"{P_OUT}.hada_w1_a": torch.zeros(64, 2),
                                      f"{P_OUT}.hada_w1_b": torch.zeros(2, 64)})
    names = lambda b: torch.tensor(list(b), dtype=torch.uint8)
    variant("tokens_oov", lambda sd: sd.update({"tokens.ids": torch.tensor([49500])}), run=True)
    variant("tokens_dict", lambda sd: sd.update({"tokens.names": names(b'{"a": 1}')}))
    variant("tokens_width", lambda sd: sd.update({"tokens.embeddings": torch.zeros(1, 999)}))
    variant("tokens_binary", lambda sd: sd.update({"tokens.names": names(b"\xff\xfe")}))
    te = "text_model.text_model.encoder.layers.0.self_attn.q_proj.weight"
    variant("te_wide", run=True, **{f"{te}.lora_down": torch.zeros(4, 1280), f"{te}.lora_up": torch.zeros(1280, 4),
                                    f"{te}.alpha": torch.tensor(1.)})
    files["tiny_model"] = (model, text, tok)
    return files

def one_line_error(res, *parts):
    "Exit status 2 and one line on stderr holding each of `parts`."
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, (res.returncode, res.stderr)
    for p in parts: assert str(p) in lines[0], (p, lines[0])
    return lines[0]

def test_check_a_run_reads_its_own_model_and_a_bare_checkpoint(crafted, capsys):
    "B1: a tiny run's `check` without --model uses the run's model; B2: a bare checkpoint takes the run's config."
    good, cfg = crafted["good"], crafted["model_yaml"]
    res = in_process(capsys, "check", good)
    assert res.returncode == 0 and "skips" not in res.stdout.splitlines()[0], res.stdout + res.stderr
    res = in_process(capsys, "check", good, "--model", crafted["ckpt"])
    assert res.returncode == 0 and "warning" not in res.stdout, res.stdout + res.stderr
    # a lone file with a checkpoint that names no model size: one line saying what to pass
    one_line_error(in_process(capsys, "check", good / "lora.safetensors", "--model", crafted["ckpt"]),
                   "pass --config TRAINING.yaml")
    res = in_process(capsys, "check", good / "lora.safetensors", "--model", crafted["ckpt"], "--config", cfg)
    assert res.returncode == 0, res.stdout + res.stderr

@pytest.mark.parametrize("name", ["hdr_huge", "hdr_inconsistent", "meta_list", "meta_nonstr", "empty", "pickle"])
def test_malformed_files_are_one_line_everywhere(crafted, capsys, tmp_path, name):
    "B3/B4/B5 and B22: check, export, sampling's and training's loads name the file; nothing is unpickled."
    from cascade_nb.lora_converters import load_lora_file
    from cascade_nb.lora_training import load_lora_checkpoint
    from cascade_nb.config import ConfigError
    path = crafted[name]
    one_line_error(in_process(capsys, "check", path), path, "not a readable safetensors file")
    one_line_error(in_process(capsys, "export", path, "--to", "kohya", "--out", tmp_path / "k.safetensors"), path)
    model, text, _ = crafted["tiny_model"]
    with pytest.raises(ValueError, match="not a readable safetensors file"): load_lora_file(path, model)
    with pytest.raises(ConfigError, match=f"key 'lora_checkpoint_path': {path}: not a readable"):
        load_lora_checkpoint(path, model, text)

def test_kohya_file_of_another_model_in_training(crafted):
    "B22: an SDXL kohya file as lora_checkpoint_path: one line naming the key and the module, not 'no type'."
    from cascade_nb.lora_training import load_lora_checkpoint
    from cascade_nb.config import ConfigError
    model, text, _ = crafted["tiny_model"]
    with pytest.raises(ConfigError, match="key 'lora_checkpoint_path': from_kohya: lora_unet_input_blocks_4_1_proj_in "
                                          "names no module of StageC"):
        load_lora_checkpoint(crafted["kohya_sdxl"], model, text)

def test_header_fields_name_the_key(crafted, capsys, tmp_path):
    "B7: `cascade_nb.adapter_options` a list or not JSON: one line naming the file and the key."
    for name in ("meta_options_list", "meta_options_bad"):
        res = in_process(capsys, "export", crafted[name], "--to", "kohya", "--out", tmp_path / f"{name}.safetensors")
        one_line_error(res, crafted[name], "'cascade_nb.adapter_options'")
        one_line_error(in_process(capsys, "check", crafted[name]), "'cascade_nb.adapter_options'")

# (file, what the line names): refused by check, export, sampling's and training's loads alike
REFUSED = [("dtype_int", f"{P_OUT}.lora_up: dtype int64; expected a float tensor"),
           ("dtype_bool", f"{P_OUT}.lora_up: dtype bool"), ("dtype_f8", f"{P_OUT}.lora_up: dtype float8_e4m3fn"),
           ("alpha_vector", f"{P_OUT}.alpha: a float32 tensor of shape (4,); expected one number"),
           ("rank0", f"{P_IN}: the lora has rank 0"),
           ("keys_dotdot", "'../../../tmp/evil' names no parameter"),
           ("keys_slash", "'/etc/passwd.weight' names no parameter"),
           ("keys_unknown_tensor", f"{P_OUT}: a lora entry holds lora_down, lora_up; unknown tensor lora_mid"),
           ("lokr_mixed_only", f"{P_OUT}: the lokr has both lokr_w2 and lokr_w2_a"),
           ("up_without_down", f"{P_OUT}: tensor names ['lora_up'] are no registered adapter type's"),
           ("lora_wrong_out", f"{P_IN}: the file's lora (lora_down (4, 64), lora_up (100, 4)) updates a 100 x 64"),
           ("oft_nonsquare", f"{P_OUT}: the oft oft_blocks (4, 16, 8): expected oft_blocks (blocks, b, b)"),
           ("lokr_bad", f"{P_OUT}: the lokr lokr_w1 (4, 4), lokr_w2_a (16, 2), lokr_w2_b (3, 16) do not fit"),
           ("loha_half", f"{P_OUT}: a loha entry holds hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b; hada_w2_a, "
                         "hada_w2_b missing"),
           # against the model's weight (check, export with the run's model, the loads)
           ("lora_transposed", f"{P_IN}: the file's lora (lora_down (4, 192), lora_up (64, 4)) updates a 64 x 192"),
           ("oft_count", f"{P_OUT}: the file's oft (oft_blocks (3, 16, 16)) updates a 48 x any matrix, the "
                         "weight is (64, 64)"),
           ("nan_up", f"{P_OUT}: lora_up hold NaN or inf values"), ("inf_down", f"{P_OUT}: lora_down hold NaN"),
           ("alpha_inf", f"{P_OUT}: alpha hold NaN or inf")]
MODEL_LEVEL = {"lora_transposed", "oft_count", "lora_wrong_out"}      # check: a warning per layer (exit 1), not merged
VALUES = {"nan_up", "inf_down", "alpha_inf"}        # check: a warning per layer (exit 1); the rest refuse them

@pytest.mark.parametrize("name,msg", REFUSED, ids=[n for n, _ in REFUSED])
def test_bad_adapters_refused_in_one_line_everywhere(crafted, capsys, tmp_path, name, msg):
    "B8, B9, B10, B12, B13, B14, B15, B16, B17 (and B22): one check of an adapter state dict, four readers."
    from cascade_nb.lora_converters import load_lora_file
    from cascade_nb.lora_training import load_lora_checkpoint
    from cascade_nb.config import ConfigError
    path, cfg = crafted[name], crafted["model_yaml"]
    res = in_process(capsys, "check", path, "--config", cfg)
    if name in MODEL_LEVEL | VALUES:
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
        assert f"warning: {msg.partition(':')[0]}" in res.stdout, res.stdout
    else: one_line_error(res, msg)
    for to in ("kohya", "cascade_nb"):
        one_line_error(in_process(capsys, "export", path, "--to", to, "--out", tmp_path / f"{to}.safetensors",
                                  "--config", cfg), msg)
    assert not list(tmp_path.iterdir())                      # nothing written, not even a temporary file
    model, text, _ = crafted["tiny_model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base = type(model).from_preset("tiny", c_in=3, c_out=3, patch_size=2)
    with pytest.raises(ValueError) as e: load_lora_file(path, base)
    assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="key 'lora_checkpoint_path'") as e:
        load_lora_checkpoint(path, model, text)
    assert msg in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

def test_check_warns_about_values_that_look_wrong(crafted, capsys):
    "B10/B11: huge values and alpha -1e6 load, but `check` names the layer and exits 1."
    for name, warn in (("huge_values", f"warning: {P_OUT}: its ΔW reaches"),
                       ("alpha_neg", f"warning: {P_OUT}: alpha -1e+06 is negative")):
        res = in_process(capsys, "check", crafted[name], "--config", crafted["model_yaml"])
        assert res.returncode == 1 and warn in res.stdout, res.stdout + res.stderr

def test_unknown_modules_refused_by_export_named_by_check(crafted, capsys, tmp_path):
    "B13: a module the run's model lacks: check warns (exit 1), export refuses (nothing written)."
    run = crafted["keys_unknown"]
    res = in_process(capsys, "check", run)
    assert res.returncode == 1 and "warning: no_such.block.weight: no such parameter in the model" in res.stdout
    one_line_error(in_process(capsys, "export", run, "--to", "kohya", "--out", tmp_path / "k.safetensors"),
                   "no_such.block.weight: no such parameter in the model")
    assert not list(tmp_path.iterdir())

def test_transposed_run_refused_by_export(crafted, capsys, tmp_path):
    "B16: the run's own model shapes refuse a transposed LoRA in export (not the misleading q/k/v split line)."
    one_line_error(in_process(capsys, "export", crafted["lora_transposed_run"], "--to", "kohya", "--out",
                              tmp_path / "k.safetensors"), f"{P_IN}: the file's lora", "transposed tensors")

def test_tokens_refused(crafted, capsys, tmp_path):
    "B19, B20: ids beyond the vocabulary, names that are no list of strings or no UTF-8, rows of another width."
    one_line_error(in_process(capsys, "export", crafted["tokens_oov"], "--to", "official", "--out",
                              tmp_path / "o.safetensors"), "key 'tokens.ids': [49500] lie outside")
    for name, msg in (("tokens_dict", "key 'tokens.names': {\"a\": 1}; expected a JSON list of 1 token strings"),
                      ("tokens_binary", "key 'tokens.names': not UTF-8 JSON text"),
                      ("tokens_width", "key 'tokens.embeddings': rows of width 999")):
        res = in_process(capsys, "export", crafted[name], "--to", "embedding", "--out", tmp_path / f"{name}.st",
                         "--config", crafted["model_yaml"])
        one_line_error(res, msg)
    from cascade_nb.lora_training import add_file_tokens
    _, text, tok = crafted["tiny_model"]
    with pytest.raises(ValueError, match="rows of width 999; the text encoder's token embeddings are 64 wide"):
        add_file_tokens(crafted["tokens_width"], tok, text)
    assert not list(tmp_path.iterdir())

def test_text_encoder_adapters_of_another_width_refused(crafted, capsys, tmp_path):
    "B24: CLIP-G-wide text-encoder adapters on the tiny text model: check warns, export refuses."
    run = crafted["te_wide"]
    res = in_process(capsys, "check", run)
    assert res.returncode == 1 and "q_proj.weight" in res.stdout, res.stdout
    one_line_error(in_process(capsys, "export", run, "--to", "cascade_nb", "--out", tmp_path / "c.safetensors"),
                   "text_model.encoder.layers.0.self_attn.q_proj.weight: the file's lora", "(64, 64)")

def test_out_folder_read_only_and_full_disk_name_out(crafted, capsys, tmp_path):
    "B28: --out a folder or in a read-only folder; B32: a disk that fills up: one line naming --out and the path."
    import os, resource, signal
    good = crafted["good"]
    (tmp_path / "folder").mkdir()
    one_line_error(in_process(capsys, "export", good, "--to", "kohya", "--out", tmp_path / "folder", "--overwrite"),
                   f"--out {tmp_path / 'folder'}: cannot write the kohya export there")
    ro = tmp_path / "ro"; ro.mkdir(); os.chmod(ro, 0o555)
    try:
        if not os.access(ro, os.W_OK):   # (root writes anywhere)
            one_line_error(in_process(capsys, "export", good, "--to", "kohya", "--out", ro / "k.safetensors"),
                           f"--out {ro / 'k.safetensors'}: cannot write the kohya export there (Permission denied)")
    finally: os.chmod(ro, 0o755)
    # a full disk, as a file-size limit: the write fails (EFBIG) part way
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try: res = in_process(capsys, "export", good, "--to", "cascade_nb", "--out", tmp_path / "full.safetensors")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)); signal.signal(signal.SIGXFSZ, old)
    one_line_error(res, f"--out {tmp_path / 'full.safetensors'}: cannot write the cascade_nb export there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "ro"]

def test_a_user_sees_one_line(crafted):
    "The command as a user runs it (one subprocess): a pickle named .safetensors, exit 2, one line, nothing run."
    res = lora_cli("check", crafted["pickle"])
    one_line_error(res, crafted["pickle"], "not a readable safetensors file")

def test_kohya_alpha_not_a_number_names_the_key(crafted, capsys, tmp_path):
    "B9 in kohya's layout: ComfyUI's reading (check) and training's load name the `.alpha` key."
    from safetensors.torch import load_file, save_file
    from cascade_nb.lora_training import load_lora_checkpoint
    from cascade_nb.config import ConfigError
    res = in_process(capsys, "export", crafted["good"], "--to", "kohya", "--out", tmp_path / "k.safetensors")
    assert res.returncode == 0, res.stderr
    sd = load_file(str(tmp_path / "k.safetensors"))
    key = next(k for k in sd if k.endswith("attn_out_proj.alpha"))
    save_file({**sd, key: torch.ones(3)}, str(tmp_path / "bad.safetensors"))
    one_line_error(in_process(capsys, "check", tmp_path / "bad.safetensors", "--for", "comfyui"),
                   f"{key}: a float32 tensor of shape (3,); expected one number")
    model, text, _ = crafted["tiny_model"]
    with pytest.raises(ConfigError, match=f"{key}: a float32 tensor of shape"):
        load_lora_checkpoint(tmp_path / "bad.safetensors", model, text)
