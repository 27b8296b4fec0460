"""LoRA fidelity to the reference (issue 13, items 3 and 4): `lora_init` (the reference's D = 0, U ~ N(0, 1) by
default, peft's as an option) and files in the reference's own `weights.N.*` / `embeddings.*` layout, written here by a
minimal re-statement of the reference's LoRA semantics, loaded through `lora_checkpoint_path` and `load_lora_file`, and
exported back by `to_reference`."""
import pytest, torch
from torch import nn
from torch.nn.utils import parametrize
from safetensors.torch import save_file, load_file
from cascade_nb.config import config_from_dict, ConfigError
from cascade_nb.models.stage_c import StageC
from cascade_nb.modes import build_text_encoder, PixelSpace
from cascade_nb.adapters import lora_layers
from cascade_nb.lora_file import lora_state_dict
from cascade_nb.train_tokens import token_state_dict, TokenDeltas
from cascade_nb.lora_converters import to_reference, load_lora_file, is_reference_lora
from cascade_nb.lora_training import LoraTraining

FILTERS = [".attn", "depthwise"]          # fused in_proj, out_proj (Linear) and 3x3 depthwise convs
TOKENS = [["[fernando]", "^dog</w>"]]

def _cfg(**kw):
    return config_from_dict(dict(experiment_id="ref", webdataset_path="data_samples/emoji", model_version="tiny",
                                 model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2}, latent_space="pixels",
                                 clip_text_model_name="tiny", clip_image_model_name=None, image_size=16, batch_size=2,
                                 **{"module_filters": FILTERS, "rank": 4, "train_tokens": TOKENS, **kw}))

def _base():
    torch.manual_seed(0)
    g = StageC.from_preset("tiny", c_in=3, c_out=3, patch_size=2)
    with torch.no_grad(): g.clf[1].weight.normal_(std=0.1)           # the official init zeroes the output conv
    return g.eval()

def _copy(g):
    c = StageC.from_preset("tiny", c_in=3, c_out=3, patch_size=2); c.load_state_dict(g.state_dict()); return c.eval()

def _mode(cfg, base):
    tok, te = build_text_encoder(cfg)
    return LoraTraining(cfg, _copy(base), tok, te, None, PixelSpace(), torch.float32)

def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g),
            dict(clip_text=torch.randn(2, 77, 64, generator=g), clip_text_pooled=torch.randn(2, 1, 64, generator=g),
                 clip_img=torch.randn(2, 1, 64, generator=g)))

class RefLoRA(nn.Module):
    "The reference's LoRA semantics (modules/lora.py): W + up @ down / rank, broadcast over a conv's taps."
    def __init__(self, W, rank):
        super().__init__()
        self.lora_down = nn.Parameter(torch.zeros(rank, W.size(1)))
        self.lora_up = nn.Parameter(torch.randn(W.size(0), rank))
        self.rank = rank
    def forward(self, W):
        return W + (self.lora_up @ self.lora_down).view(*W.shape[:2], *[1] * (W.ndim - 2)) / self.rank

def reference_adapted(model, filters, rank, seed=2):
    "Adapt `model` as the reference's apply_lora does; return {weights.N.*} in the order its `modules()` meets them."
    for name, m in list(model.named_modules()):
        if not any(f in name for f in filters): continue
        pname = "weight" if isinstance(getattr(m, "weight", None), nn.Parameter) else "in_proj_weight" if hasattr(m, "in_proj_weight") else None
        if pname: parametrize.register_parametrization(m, pname, RefLoRA(getattr(m, pname), rank))
    layers = nn.ModuleList([m for m in model.modules() if isinstance(m, RefLoRA)])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for l in layers: l.lora_down.copy_(torch.randn(l.lora_down.shape, generator=g) * 0.05)   # as if trained
    return {f"weights.{k}": v.detach().clone() for k, v in layers.state_dict().items()}

def test_lora_init_default_is_the_reference_and_peft_is_an_option():
    base = _base()
    for init, zero, random in [("reference", "lora_down", "lora_up"), ("peft", "lora_up", "lora_down")]:
        cfg = _cfg() if init == "reference" else _cfg(lora_init="peft")
        assert cfg.lora.lora_init == init
        layers = lora_layers(_mode(cfg, base).net.generator).values()
        assert all(getattr(l, zero).abs().sum() == 0 for l in layers)
        stds = torch.stack([getattr(l, random).std() for l in layers])
        if init == "reference": assert torch.allclose(stds, torch.ones_like(stds), atol=0.35), stds   # N(0, 1)
        else:                                                                                         # Kaiming: 1/sqrt(3 n_in)
            want = torch.tensor([(3 * l.lora_down[0].numel()) ** -0.5 for l in layers])
            assert torch.allclose(stds, want, rtol=0.4), (stds, want)
    # a registered choice (`register_lora_init`): the key, the value and the choices, at load
    with pytest.raises(ConfigError, match="key 'lora_init': 'gaussian' is not a registered lora init.*reference, peft"):
        _cfg(lora_init="gaussian")

def test_reference_file_loads_via_lora_checkpoint_path_and_exports_back(tmp_path):
    base, (x, r, c) = _base(), _inputs()
    ref_model = _copy(base)
    sd = reference_adapted(ref_model, FILTERS, rank=4)
    assert len([k for k in sd if k.endswith("lora_down")]) == 6 * 2 + 6    # 6 AttnBlocks x 2, 6 ResBlock depthwise convs
    deltas = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)) * 0.1
    sd.update({"embeddings.embeddings": deltas, "embeddings.indices": torch.tensor([49408])})   # ReToken of [fernando]
    save_file(sd, tmp_path / "lora.safetensors")
    with torch.no_grad(): want = ref_model(x, r, **c)
    assert (want - base(x, r, **c)).abs().max() > 1e-3

    mode = _mode(_cfg(lora_checkpoint_path=str(tmp_path / "lora.safetensors")), base)
    emb = mode.text_model.get_input_embeddings()
    assert isinstance(emb, TokenDeltas) and emb.ids.tolist() == [49408]
    assert torch.equal(emb.delta.detach(), deltas)
    with torch.no_grad(): torch.testing.assert_close(mode.net.generator(x, r, **c), want, atol=1e-5, rtol=0)

    # round trip: our export -> the reference layout -> load -> same outputs and token rows
    ours = {**lora_state_dict(mode.net.generator), **token_state_dict(mode.tokenizer, mode.text_model)}
    back = to_reference(ours, mode.net.generator, mode.text_model)
    assert is_reference_lora(back) and set(back) == set(sd)
    for k in sd: torch.testing.assert_close(back[k], sd[k], atol=1e-6, rtol=0)
    save_file(back, tmp_path / "exported.safetensors")
    again = _mode(_cfg(lora_checkpoint_path=str(tmp_path / "exported.safetensors")), base)
    with torch.no_grad(): torch.testing.assert_close(again.net.generator(x, r, **c), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(again.text_model.get_input_embeddings().rows(), emb.rows(), atol=1e-6, rtol=0)

    # for generation: merged into a plain model, tokens rebuilt from train_tokens
    plain = _copy(base)
    tok, te = build_text_encoder(_cfg())
    got = load_lora_file(tmp_path / "lora.safetensors", plain, tok, te, module_filters=FILTERS, train_tokens=TOKENS)
    with torch.no_grad(): torch.testing.assert_close(plain(x, r, **c), want, atol=1e-5, rtol=0)
    assert tok.convert_tokens_to_ids("[fernando]") == 49408 and not isinstance(te.get_input_embeddings(), TokenDeltas)
    torch.testing.assert_close(te.get_input_embeddings().weight[49408], emb.rows()[0], atol=1e-6, rtol=0)
    assert got["tokens.ids"].tolist() == [49408]

def test_reference_file_errors_name_the_fix(tmp_path):
    base = _base()
    sd = reference_adapted(_copy(base), [".attn"], rank=4)
    sd.update({"embeddings.embeddings": torch.zeros(0, 1280), "embeddings.indices": torch.zeros(0, dtype=torch.long)})
    save_file(sd, tmp_path / "lora.safetensors")
    assert load_file(str(tmp_path / "lora.safetensors"))["embeddings.embeddings"].shape == (0, 1280)   # empty ReToken
    with pytest.raises(ValueError, match="has 12 LoRA layers.*select 18 .* same filters"):        # trained with ['.attn'], loaded with more
        _mode(_cfg(lora_checkpoint_path=str(tmp_path / "lora.safetensors")), base)
    with pytest.raises(ValueError, match="same filters"):
        load_lora_file(tmp_path / "lora.safetensors", _copy(base))            # module_filters not given
    adapted = _mode(_cfg(module_filters=["down_blocks.0.0.depthwise"], train_tokens=None), base).net.generator
    with torch.no_grad():
        for l in lora_layers(adapted).values(): l.lora_up.normal_(); l.lora_down.normal_()
    with pytest.raises(ValueError, match="spatially varying"):
        to_reference(lora_state_dict(adapted), adapted)
