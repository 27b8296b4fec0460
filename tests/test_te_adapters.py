"""Adapters on the CLIP text encoder of a LoRA run (nbs/60_lora, text encoder) through the real trainer CLI:
configs/lora_demo.yaml at tiny size with `text_encoder_adapter: lora` beside the generator's adapters and a new token.
The loss on a fixed batch goes down, the `text_encoder_adapters` group trains at its own lr, a kill and resume is
bit-identical, cached text embeddings are refused in one line, the kohya export's `lora_te_` keys give ComfyUI's
reader the same ΔW per layer, and `python -m cascade_nb.sample` samples with the adapters merged."""
import copy
from pathlib import Path
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from conftest import ROOT, run_cli
from test_lora_train import pretrained_tiny, token_captions, info
from test_param_groups import optimizer_groups_saved
from test_train import resumes_to_the_killed_state

X = 5e-3   # the text encoder's adapters' lr (the others train at lora_demo's 1e-3)
TE_UP = "text_model.text_model.encoder.layers.0.self_attn.q_proj.weight.lora_up"

def te_args(tmp: Path, name: str, *extra) -> list:
    base = pretrained_tiny(tmp / "base.safetensors")
    return [ROOT / "configs" / "lora_demo.yaml", f"generator_checkpoint_path={base}",
            f"webdataset_path={token_captions(tmp / 'data')}", "train_tokens=[['[fernando]', '^face</w>']]",
            f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", "tracker=none",
            "wandb_project=null", "num_workers=0", "batch_size=4", "log_every=1", "sample_steps=2", "updates=6",
            "save_every=2", "warmup_updates=2", "lr_schedule=constant", "text_encoder_adapter=lora",
            "text_encoder_rank=2", f"param_groups={{text_encoder_adapters: {{lr: {X}}}}}",
            # the EMA of the trained tensors (the text encoder's adapters among them), released as lora_ema.safetensors
            "ema_start_iters=1", "ema_iters=1", "ema_beta=0.9", *extra]

def fixed_batch(folder: Path) -> dict:
    "The 8 training images (16 px, in [0, 1]) and their captions."
    keys = sorted(p.stem for p in folder.glob("*.png"))
    img = lambda k: torch.from_numpy(np.asarray(Image.open(folder / f"{k}.png").convert("RGB").resize((16, 16))).copy())
    images = torch.stack([img(k).float().permute(2, 0, 1) / 255 for k in keys])
    return {"images": images, "captions": [(folder / f"{k}.txt").read_text() for k in keys]}

def loss_on(cfg, base, batch, lora_file=None) -> float:
    "The LoRA mode's loss on `batch` at fixed noise, on the generator `base`, with fresh adapters or `lora_file`'s."
    from cascade_nb.train import build_generator, build_text_encoder, PixelSpace, diffusion_loss
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.lora import LoraTraining
    cfg = copy.deepcopy(cfg)
    cfg.lora.lora_checkpoint_path = lora_file and str(lora_file)
    cfg.model.generator_checkpoint_path = str(base)   # a run's recorded config leaves it out
    tok, te = build_text_encoder(cfg)
    mode = LoraTraining(cfg, build_generator(cfg), tok, te, None, PixelSpace(), torch.float32)
    mode.net.eval()
    x0, conds = mode.encode(batch, "cpu", training=False)
    with torch.no_grad():
        loss, _, _ = diffusion_loss(mode.net, gdf_from_config(cfg.gdf), x0, conds, rng=torch.Generator().manual_seed(1))
    return float(loss)

def test_text_encoder_adapters_train_resume_export_and_sample(tmp_path):
    from cascade_nb.adapter_files import export_adapter, read_comfyui, consumer_params, cascade_nb_deltas, delta_error
    from cascade_nb.lora import split_text_encoder, lora_entries, lora_delta, base_state_dict
    from cascade_nb.modes import released_file
    from cascade_nb.run_state import _saved_model_layout
    from cascade_nb.sample import run_config, load_run
    from cascade_nb.train import build_text_encoder
    run = tmp_path / "ckpt" / "te"
    # killed committing update 4, resumed from update 2: it commits the killed process's own state of update 4
    resumed = resumes_to_the_killed_state(run, te_args(tmp_path, "te"))
    assert info(tmp_path, "te")["update"] == 6 and "text_encoder_adapters" in resumed.stdout
    groups = {g["group"]: (g["lr"], len(g["params"])) for g in optimizer_groups_saved(run)}
    assert groups == {"adapters": (1e-3, 24), "tokens": (1e-3, 1), "text_encoder_adapters": (X, 24)}, groups
    state = run / info(tmp_path, "te")["state_dir"]
    saved = _saved_model_layout(state)[1]
    assert sum(k.startswith("text_model.text_model.encoder.") and ".lora_" in k for k in saved) == 24
    # released: the generator's keys as before, the text encoder's under text_model. (rank 2, both layers' 6 weights)
    lora_file = released_file(run, "lora", False)
    lora, ema = load_file(str(lora_file)), load_file(str(run / "lora_ema.safetensors"))
    assert ema.keys() == lora.keys() and not torch.equal(ema[TE_UP], lora[TE_UP])
    gen_part, te_part = split_text_encoder({k: v for k, v in lora.items() if not k.startswith("tokens.")})
    assert len(lora_entries(gen_part)) == 12 and len(lora_entries(te_part)) == 12
    assert {d.shape[0] for d, _, _ in lora_entries(te_part).values()} == {2}
    # the loss on the training images at fixed noise: lower with the trained adapters and token than with fresh ones
    cfg, batch = run_config(run), fixed_batch(tmp_path / "data")
    base = tmp_path / "base.safetensors"
    fresh, trained = loss_on(cfg, base, batch), loss_on(cfg, base, batch, lora_file)
    print(f"loss on the fixed batch at fixed noise: fresh {fresh:.4f}, trained {trained:.4f}")
    assert trained < fresh, (fresh, trained)
    # the kohya/ComfyUI export: ComfyUI's reader adds the same ΔW to each Stage C and CLIP weight as we merge
    from cascade_nb.models.stage_c import StageC
    out, _ = export_adapter(lora, "kohya", tmp_path / "te_kohya.safetensors")
    ko = load_file(str(out[0]))
    assert sum(k.startswith("lora_te_text_model_encoder_layers_") and k.endswith(".lora_up.weight") for k in ko) == 12
    _, text_model = build_text_encoder(cfg)
    gen = StageC.from_preset("tiny", c_in=3, c_out=3, patch_size=2)
    rd = read_comfyui(ko, consumer_params(gen, text_model))
    te_deltas = cascade_nb_deltas(te_part, base_state_dict(text_model))
    expected = {**cascade_nb_deltas(gen_part, base_state_dict(gen)),
                **{f"text_encoder.{k}": v for k, v in te_deltas.items()}}
    assert not rd.skipped and delta_error(rd, expected) < 1e-6, (rd.skipped[:4], delta_error(rd, expected))
    # the kohya file read back as a source (export/check CLI) keeps its text-encoder adapters; peft has no place for them
    from cascade_nb.adapter_files import read_source, source_lora
    back = source_lora(read_source(out[0]), gen)
    assert {k for k in back if k.startswith("text_model.")} == {k for k in lora if k.startswith("text_model.")}
    with pytest.raises(ValueError, match="text-encoder weights"):
        export_adapter(lora, "peft", tmp_path / "te_peft")
    # sampling: the CLI runs, and the text encoder it uses has the adapters merged
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "a [fernando] face", "--n", "1",
                  "--steps", "2", "--out", tmp_path / "samples")
    assert "wrote 1 images" in res.stdout and res.stdout.strip().endswith("lora_ema.safetensors"), res.stdout
    mode, _, _ = load_run(run, ema=False)
    p = "text_model.encoder.layers.1.mlp.fc1.weight"
    want = text_model.get_parameter(p) + lora_delta(*lora_entries(te_part)[p], text_model.get_parameter(p).shape)
    assert torch.allclose(mode.text_model.get_parameter(p), want, atol=1e-6)
    assert not torch.allclose(want, text_model.get_parameter(p))

def test_text_encoder_adapters_refuse_cached_text_embeddings():
    from cascade_nb.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "lora_demo.yaml", ["text_encoder_adapter=lora", "latent_space=cached",
                                                          "caption_dropout=0", "generator_checkpoint_path=null"])
    msg = str(e.value)
    assert "text_encoder_adapter" in msg and "latent_space: cached" in msg and "\n" not in msg, msg

@pytest.mark.parametrize("adapter", ["lora", "loha"])
def test_kohya_text_encoder_keys_read_by_comfyui_with_the_same_delta(adapter):
    """Every Linear of the tiny CLIP (text_projection too) through to_kohya: ComfyUI's reader adds our ΔW, and
    from_kohya inverts it."""
    from cascade_nb.adapter_files import read_comfyui, consumer_params, delta_error
    from cascade_nb.lora import (apply_lora, lora_layers, text_encoder_state_dict, to_kohya, from_kohya, merge_lora,
                                 base_state_dict)
    from cascade_nb.models.clip import tiny_clip_text_model
    from cascade_nb.models.stage_c import StageC
    te = tiny_clip_text_model()
    targets = apply_lora(te, ["self_attn", "mlp", "text_projection"], rank=2, adapter=adapter, freeze=False)
    assert "text_projection.weight" in targets and len(targets) == 13
    torch.manual_seed(0)
    for layer in lora_layers(te).values():
        for t in layer.tensors().values(): torch.nn.init.normal_(t, std=0.1)
    lora = text_encoder_state_dict(te)
    ko = to_kohya(lora)
    assert "lora_prior_te_text_projection.alpha" in ko
    base, gen = tiny_clip_text_model(), StageC.from_preset("tiny")
    rd = read_comfyui(ko, consumer_params(gen, base))
    merged = base_state_dict(merge_lora(tiny_clip_text_model(), {k[len("text_model."):]: v for k, v in lora.items()}))
    plain = base_state_dict(base)
    expected = {f"text_encoder.{p}": merged[p] - plain[p] for p in targets}
    assert not rd.skipped and delta_error(rd, expected) < 1e-6, (rd.skipped[:4], rd.warnings[:4])
    back = from_kohya(ko, gen)
    assert back.keys() == lora.keys() and all(torch.equal(back[k].float(), lora[k].float()) for k in lora)

def test_text_encoder_adapters_under_fsdp2(tmp_path):
    """Two CPU processes under FSDP2 (the text encoder inside the sharded `net`): a run killed in its commit resumes to
    the same state, and the released file holds the gathered text-encoder adapters."""
    from test_train import _launch_2proc
    from cascade_nb.lora import split_text_encoder, lora_entries
    fsdp = lambda *a, check=True: _launch_2proc("--fsdp-cpu", *a, check=check)
    run = tmp_path / "ckpt" / "f"
    resumes_to_the_killed_state(run, te_args(tmp_path, "f", "updates=4", "batch_size=8"), launch=fsdp)
    te_part = split_text_encoder(load_file(str(run / "lora.safetensors")))[1]
    assert len(lora_entries(te_part)) == 12 and all(d.abs().sum() > 0 for d, _, _ in lora_entries(te_part).values())
