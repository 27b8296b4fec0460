"""`python -m cascade_nb.export RUN --to comfyui-checkpoint` (nbs/52_export) on tiny run directories: the key layout
and prefixes ComfyUI's checkpoint loader reads, the dtype, the header, the EMA choice, a LoRA run's trained tokens and
text-encoder adapters carried in the CLIP-G, Stage B with its Stage A, and one-line refusals. ComfyUI's own loader
reads these files in bench/comfyui_checkpoint.py (ComfyUI is not installable from the registries)."""
import json
from pathlib import Path
import pytest
import torch
from safetensors.torch import load_file, save_file
from conftest import ROOT, run_cli
from test_lora_train import pretrained_tiny

EMOJI = f"webdataset_path={ROOT / 'data_samples' / 'emoji'}"
TABLE = "text_encoder.clip_g.transformer.text_model.embeddings.token_embedding.weight"

def write_run(folder: Path, config: Path, overrides: list, files: dict) -> Path:
    "A run directory as the trainer leaves it: info.json with the resolved config, and its released files."
    from cascade_nb.config import load_config
    import cascade_nb.modes  # noqa: F401  (the modes' config sections)
    folder.mkdir(parents=True)
    cfg = load_config(config, [EMOJI, f"experiment_id={folder.name}", *overrides])
    (folder / "info.json").write_text(json.dumps({"config": cfg.to_yaml_dict(), "update": 6}))
    for name, sd in files.items(): save_file(sd, folder / name)
    return folder

def random_generator(cfg_overrides: list, seed: int) -> dict:
    from cascade_nb.config import load_config
    from cascade_nb.modes import build_generator
    torch.manual_seed(seed)
    return build_generator(load_config(ROOT / "configs" / "demo.yaml", [EMOJI, *cfg_overrides])).state_dict()

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full Stage C run (with an EMA and a CLIP image encoder), a LoRA run with tokens and text-encoder adapters,
    a Stage B run."""
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_converters import text_encoder_state_dict
    from cascade_nb.lora_file import lora_state_dict
    from cascade_nb.models.clip import load_clip_tokenizer, sample_tokenizer_dir, tiny_clip_text_model
    from cascade_nb.models.stage_c import load_stage_c
    from cascade_nb.train_tokens import add_train_tokens, token_state_dict
    tmp = tmp_path_factory.mktemp("export")
    image = ["clip_image_model_name=tiny", "image_embed_prob=0.1"]
    full = write_run(tmp / "full", ROOT / "configs" / "demo.yaml", image,
                     {"generator.safetensors": random_generator([], 0),
                      "generator_ema.safetensors": random_generator([], 1)})
    # the LoRA run: adapters on the tiny pretrained Stage C, a new token, a re-trained word, adapters on the CLIP
    base = pretrained_tiny(tmp / "base.safetensors")
    model = load_stage_c(base, preset="tiny", c_in=3, c_out=3, patch_size=2)
    tok, text = load_clip_tokenizer(sample_tokenizer_dir()), tiny_clip_text_model()
    add_train_tokens(tok, text, [["[emoji]", "^face</w>"], ["^apple</w>$", None]])
    apply_lora(model, [".attn"], rank=4, init="peft")
    apply_lora(text, ["self_attn", "mlp"], rank=2, init="peft")
    torch.manual_seed(0)
    with torch.no_grad():
        for l in [*lora_layers(model).values(), *lora_layers(text).values()]: l.lora_up.normal_(std=0.05)
        text.get_input_embeddings().delta.normal_(std=0.1)
    lora = {**lora_state_dict(model), **text_encoder_state_dict(text), **token_state_dict(tok, text)}
    lora_run = write_run(tmp / "lora", ROOT / "configs" / "lora_demo.yaml",
                         [f"generator_checkpoint_path={base}", "text_encoder_adapter=lora",
                          "train_tokens=[['[emoji]', '^face</w>'], ['^apple</w>$', null]]"], {"lora.safetensors": lora})
    b_args = ["stage=b", "model_version=tiny", "model_overrides={}", "stage_a_checkpoint_path=tiny",
              "effnet_checkpoint_path=tiny", "latent_space=effnet"]
    stage_b = write_run(tmp / "stage_b", ROOT / "configs" / "demo.yaml", b_args,
                        {"generator.safetensors": random_generator(b_args, 2)})
    return {"full": full, "lora": lora_run, "stage_b": stage_b, "base": base, "lora_sd": lora}

def export(capsys, *args) -> tuple[int, str, str]:
    from cascade_nb.export import main
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err

def test_stage_c_layout_dtype_header_and_the_ema_choice(runs, tmp_path, capsys):
    from cascade_nb.core import safetensors_header
    from cascade_nb.models.clip import tiny_clip_text_model, tiny_clip_vision_model
    path = tmp_path / "c.safetensors"
    code, out, err = export(capsys, runs["full"], "--to", "comfyui-checkpoint", "--out", path)
    assert code == 0 and "generator_ema.safetensors" in out.splitlines()[0] and "will not build this size" in err
    meta, shapes = safetensors_header(path)
    ema = load_file(str(runs["full"] / "generator_ema.safetensors"))
    text, vision = tiny_clip_text_model(), tiny_clip_vision_model(proj=64)
    prefixes = {"model.diffusion_model.": ema, "text_encoder.clip_g.transformer.": text.state_dict(),
                "clip_l_vision.": vision.state_dict()}
    # every key under a prefix ComfyUI's Stable_Cascade_C reads, each part whole, official names (fused projections)
    assert set(shapes) == {p + k for p, sd in prefixes.items() for k in sd}
    assert "model.diffusion_model.down_blocks.0.2.attention.attn.in_proj_weight" in shapes
    assert "text_encoder.clip_g.transformer.text_projection.weight" in shapes
    assert shapes[TABLE] == (49408, 64)
    assert meta["modelspec.architecture"] == "stable-cascade-v1-prior"
    assert meta["cascade_nb.layout"] == "comfyui-checkpoint"
    assert (meta["cascade_nb.run"], meta["cascade_nb.update"], meta["cascade_nb.weights_file"], meta["cascade_nb.weights"],
            meta["cascade_nb.dtype"]) == ("full", "6", "generator_ema.safetensors", "ema", "bfloat16")
    assert "config" not in meta   # ComfyUI reads a `config` key as a model configuration
    sd = load_file(str(path))
    assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.bfloat16}
    assert all(torch.equal(sd["model.diffusion_model." + k], v.bfloat16()) for k, v in ema.items())
    projection = sd["text_encoder.clip_g.transformer.text_projection.weight"]
    assert torch.equal(projection, text.text_projection.weight.bfloat16())
    # --no-ema in float32: the last update's weights, bit for bit
    code, out, _ = export(capsys, runs["full"], "--to", "comfyui-checkpoint", "--out", path, "--no-ema",
                          "--dtype", "float32", "--overwrite")
    sd, plain = load_file(str(path)), load_file(str(runs["full"] / "generator.safetensors"))
    assert all(torch.equal(sd["model.diffusion_model." + k], v) for k, v in plain.items())
    meta = safetensors_header(path)[0]
    assert (meta["cascade_nb.weights_file"], meta["cascade_nb.weights"], meta["cascade_nb.dtype"]) == (
        "generator.safetensors", "live", "float32")

def test_lora_run_carries_its_tokens_and_text_encoder_adapters(runs, tmp_path, capsys):
    "The re-trained word's row is the trained one, the CLIP holds the merged adapters, the base the merged LoRA."
    from cascade_nb.core import safetensors_header
    from cascade_nb.models.clip import load_clip_tokenizer, sample_tokenizer_dir, tiny_clip_text_model
    path = tmp_path / "lora.safetensors"
    code, _, err = export(capsys, runs["lora"], "--to", "comfyui-checkpoint", "--out", path, "--dtype", "float32")
    assert code == 0 and "new tokens [emoji] are not in the file" in err and "--to embedding" in err
    sd, meta = load_file(str(path)), safetensors_header(path)[0]
    assert json.loads(meta["cascade_nb.trained_tokens"]) == ["apple</w>"]
    assert json.loads(meta["cascade_nb.tokens_left_out"]) == ["[emoji]"]
    assert meta["cascade_nb.generator_checkpoint_path"] == "base.safetensors"
    assert (meta["cascade_nb.weights_file"], meta["cascade_nb.weights"]) == ("lora.safetensors", "live")
    lora, frozen = runs["lora_sd"], tiny_clip_text_model().state_dict()
    names = json.loads(bytes(lora["tokens.names"].tolist()).decode())
    apple = load_clip_tokenizer(sample_tokenizer_dir()).convert_tokens_to_ids("apple</w>")
    assert sd[TABLE].shape == (49408, 64)   # the new token's row is cut: ComfyUI's CLIP-G has 49408 rows
    assert torch.equal(sd[TABLE][apple], lora["tokens.embeddings"][names.index("apple</w>")])
    assert not torch.equal(sd[TABLE][apple], frozen["text_model.embeddings.token_embedding.weight"][apple])
    te = "text_encoder.clip_g.transformer."
    changed = {k for k, v in frozen.items() if not torch.equal(sd[te + k], v)}
    assert "text_model.encoder.layers.0.self_attn.q_proj.weight" in changed
    assert "text_model.final_layer_norm.weight" not in changed
    # the generator: the base with its LoRA merged on the attention layers, the rest as the base
    base = load_file(str(runs["base"]))
    moved = {k for k, v in base.items() if not torch.equal(sd["model.diffusion_model." + k], v)}
    assert moved and all(".attn." in k for k in moved), sorted(moved)[:5]

def test_stage_b_holds_its_stage_a(runs, tmp_path, capsys):
    from cascade_nb.core import safetensors_header
    from cascade_nb.modes import load_frozen
    path = tmp_path / "b.safetensors"
    code, out, err = export(capsys, runs["stage_b"], "--to", "comfyui-checkpoint", "--out", path)
    assert code == 0 and "Stage B" in out and "down_blocks.1.0.channelwise.0.weight" in err
    sd, meta = load_file(str(path)), safetensors_header(path)[0]
    stage_a = load_frozen("stage_a", "tiny").state_dict()
    generator = load_file(str(runs["stage_b"] / "generator.safetensors"))
    assert set(sd) == {*("model.diffusion_model." + k for k in generator), *("vae." + k for k in stage_a)}
    assert "vae.vquantizer.codebook.weight" in sd   # what ComfyUI's VAE recognises Stage A by
    assert all(torch.equal(sd["vae." + k], v.bfloat16() if v.is_floating_point() else v) for k, v in stage_a.items())
    assert meta["modelspec.architecture"] == "stable-cascade-v1-decoder"
    assert json.loads(meta["cascade_nb.parts"]) == {"generator": "model.diffusion_model.", "stage_a": "vae."}

def test_refusals_are_one_line(runs, tmp_path, capsys):
    from cascade_nb.export import main
    from test_cli_errors import in_process_error
    out = tmp_path / "mine.safetensors"; out.write_bytes(b"a user's file")
    args = [runs["full"], "--to", "comfyui-checkpoint", "--out"]
    in_process_error(main, [*args, out], capsys, "--out already exists; pass --overwrite to replace it")
    assert out.read_bytes() == b"a user's file"
    in_process_error(main, [*args, runs["full"] / "x.safetensors"], capsys, "lies in the run directory")
    in_process_error(main, [*args, tmp_path / "x.safetensors", "--dtype", "float16"], capsys, "overflow fp16")
    in_process_error(main, [runs["full"], "--to", "comfyui-checkpiont", "--out", tmp_path / "x"], capsys,
                     "--to: 'comfyui-checkpiont' is not a registered checkpoint layout",
                     "did you mean 'comfyui-checkpoint'?")
    in_process_error(main, [tmp_path / "nowhere", "--to", "comfyui-checkpoint", "--out", tmp_path / "x"], capsys,
                     "not a run directory nor a training config")
    # a config exports the generator it names; an adapter config needs its run, where the adapters are
    in_process_error(main, [ROOT / "configs" / "lora_demo.yaml", "--to", "comfyui-checkpoint", "--out", tmp_path / "x"],
                     capsys, "a 'lora' config without its run: pass the run directory")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.safetensors").exists()

def test_the_command_from_a_config(runs, tmp_path):
    "A training config naming a generator: the module's own command line, in a fresh process."
    cfg = tmp_path / "c.yaml"
    cfg.write_text((ROOT / "configs" / "demo.yaml").read_text()
                   + f"\ngenerator_checkpoint_path: {runs['full'] / 'generator.safetensors'}\n")
    res = run_cli("-m", "cascade_nb.export", cfg, "--to", "comfyui-checkpoint", "--out", tmp_path / "c.safetensors",
                  "--dtype", "float32", cwd=ROOT)
    assert "from a config/generator.safetensors" in res.stdout, res.stdout
    sd, plain = load_file(str(tmp_path / "c.safetensors")), load_file(str(runs["full"] / "generator.safetensors"))
    assert all(torch.equal(sd["model.diffusion_model." + k], v) for k, v in plain.items())
