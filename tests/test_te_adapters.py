"""Adapters on the CLIP text encoder of a LoRA run (nbs/60c_lora_converters) through the real trainer CLI:
configs/lora_demo.yaml at tiny size with `text_encoder_adapter: lora` beside the generator's adapters and a new token.
Cached text embeddings are refused in one line, and every Linear of the CLIP goes through the kohya export to ComfyUI's
reader with our ΔW. The trainer run (loss down, its own group lr, kill and resume bit-identical, one process and FSDP2,
the export's `lora_te_` keys, `python -m cascade_nb.sample` with the adapters merged) is the shared run of
tests/test_lora_runs.py, built with `te_args` here."""
import copy
from pathlib import Path
import numpy as np
import pytest
import torch
from PIL import Image
from conftest import ROOT
from test_lora_train import pretrained_tiny, token_captions

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
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace, diffusion_loss
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.lora_training import LoraTraining
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

def test_text_encoder_adapters_refuse_cached_text_embeddings():
    import cascade_nb.modes  # noqa: F401  (the modes' own config sections, as the trainer CLI has them)
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
    from cascade_nb.adapter_readers import read_comfyui, consumer_params, delta_error
    from cascade_nb.adapters import apply_lora, lora_layers, base_state_dict
    from cascade_nb.lora_file import merge_lora
    from cascade_nb.lora_converters import text_encoder_state_dict, to_kohya, from_kohya
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
    # the same layers and ΔW (a LoHa's file carries scale 1: alpha/rank folded into hada_w1_a, `LoHa.kohya_form`)
    assert back.keys() == lora.keys() and delta_error(read_comfyui(to_kohya(back), consumer_params(gen, base)),
                                                      expected) < 1e-6
    assert adapter != "lora" or all(torch.equal(back[k].float(), lora[k].float()) for k in lora)

