"""LoRA library checks that notebooks test badly: peft loads our adapter onto the diffusers twin of the same
weights, kohya/ComfyUI key layout, merge/unmerge equality, token init and gradient masking."""
import pytest, torch
from cascade_nb.models.stage_c import StageC
from cascade_nb.adapters import apply_lora, lora_layers
from cascade_nb.lora_file import lora_state_dict, merge_lora, unmerge_lora, load_lora
from cascade_nb.train_tokens import add_train_tokens, TokenDeltas
from cascade_nb.lora_converters import to_kohya, from_kohya, save_peft_adapter, load_peft_adapter

def _models(filters=(".attn",), rank=4, seed=0):
    torch.manual_seed(seed)
    base = StageC.from_preset("tiny")
    with torch.no_grad(): base.clf[1].weight.normal_(std=0.1)        # official init zeroes the output
    adapted = StageC.from_preset("tiny"); adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, list(filters), rank=rank, alpha=2.0, init="peft")   # U = 0, set below
    with torch.no_grad():
        for l in lora_layers(adapted).values(): l.lora_up.normal_(std=0.05)
    return base.eval(), adapted.eval()

def _inputs(B=2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(B, 16, 6, 6, generator=g), torch.rand(B, generator=g),
            dict(clip_text=torch.randn(B, 77, 64, generator=g), clip_text_pooled=torch.randn(B, 1, 64, generator=g),
                 clip_img=torch.randn(B, 1, 64, generator=g)))

def test_merge_unmerge_equals_adapted_output():
    base, adapted = _models((".attn", "depthwise", "embedding.1"))   # fused, Linear, depthwise and 1×1 convs
    x, r, c = _inputs()
    sd = lora_state_dict(adapted)
    with torch.no_grad():
        want, plain = adapted(x, r, **c), base(x, r, **c)
        assert (want - plain).abs().max() > 1e-3
        merge_lora(base, sd)
        assert torch.allclose(base(x, r, **c), want, atol=1e-5)
        unmerge_lora(base, sd)
        assert torch.allclose(base(x, r, **c), plain, atol=1e-5)
        merge_lora(base, sd, scale=0.5)
        half = base(x, r, **c)
        assert not torch.allclose(half, want, atol=1e-4) and not torch.allclose(half, plain, atol=1e-4)

def test_peft_loads_the_adapter_onto_the_diffusers_twin(tmp_path):
    pytest.importorskip("diffusers")
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from cascade_nb.interop_c import stage_c_to_diffusers, DiffusersStageC
    base, adapted = _models((".attn", "kv_mapper"))
    x, r, c = _inputs()
    save_peft_adapter(lora_state_dict(adapted), tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    unet = stage_c_to_diffusers(base)
    cfg = LoraConfig.from_pretrained(str(tmp_path / "adapter"))
    inject_adapter_in_model(cfg, unet)
    sd = {k.removeprefix("base_model.model."): v for k, v in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).items()}
    res = set_peft_model_state_dict(unet, sd)
    assert not res.unexpected_keys
    n_lora = sum(1 for n, _ in unet.named_modules() if n.endswith("lora_A.default"))
    assert n_lora == 6 * 5                                    # per AttnBlock: to_q, to_k, to_v, to_out.0, kv_mapper.1
    with torch.no_grad():
        got, want = DiffusersStageC(unet.eval())(x, r, **c), adapted(x, r, **c)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # and back onto our StageC
    again = StageC.from_preset("tiny"); again.load_state_dict(base.state_dict())
    load_lora(again, load_peft_adapter(tmp_path / "adapter", again))
    with torch.no_grad(): assert torch.allclose(again.eval()(x, r, **c), want, atol=1e-5)

def test_kohya_layout_keys_and_round_trip():
    base, adapted = _models()
    sd = lora_state_dict(adapted)
    ko = to_kohya(sd)
    mods = {k.split(".")[0] for k in ko}
    assert "lora_unet_down_blocks_0_2_attention_attn_to_q" in mods and "lora_unet_up_blocks_1_2_attention_attn_out_proj" in mods
    assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in ko)
    assert len(mods) == 6 * 4 and float(ko["lora_unet_down_blocks_0_2_attention_attn_to_v.alpha"]) == 2.0
    assert ko["lora_unet_down_blocks_0_2_attention_attn_to_q.lora_up.weight"].shape == (64, 4)
    x, r, c = _inputs()
    # independent q/k/v LoRAs (as kohya trains them) fuse back exactly
    g = torch.Generator().manual_seed(3)
    for k in ko:
        if k.endswith("to_k.lora_down.weight"): ko[k] = torch.randn(ko[k].shape, generator=g)
    ref = StageC.from_preset("tiny"); ref.load_state_dict(base.state_dict())
    from cascade_nb.models.blocks import AttnBlock
    with torch.no_grad():                                                 # apply the split LoRA by hand
        for name, blk in ref.named_modules():
            if not isinstance(blk, AttnBlock): continue
            pre = "lora_unet_" + name.replace(".", "_") + "_attention_attn_"
            W = blk.attention.attn.in_proj_weight
            for i, part in enumerate(("to_q", "to_k", "to_v")):
                d, u, a = ko[pre + part + ".lora_down.weight"], ko[pre + part + ".lora_up.weight"], float(ko[pre + part + ".alpha"])
                W[i * 64:(i + 1) * 64] += (u @ d) * a / d.shape[0]
            d, u, a = ko[pre + "out_proj.lora_down.weight"], ko[pre + "out_proj.lora_up.weight"], float(ko[pre + "out_proj.alpha"])
            blk.attention.attn.out_proj.weight += (u @ d) * a / d.shape[0]
    fused = StageC.from_preset("tiny"); fused.load_state_dict(base.state_dict())
    merge_lora(fused, from_kohya(ko, fused))
    with torch.no_grad(): assert torch.allclose(fused(x, r, **c), ref(x, r, **c), atol=1e-5)

def test_token_init_and_gradient_mask():
    from cascade_nb.models.clip import load_clip_tokenizer, sample_tokenizer_dir, tiny_clip_text_model, encode_text
    tok, te = load_clip_tokenizer(sample_tokenizer_dir()), tiny_clip_text_model()
    E0 = te.get_input_embeddings().weight.clone()
    vocab = tok.get_vocab()
    cats = [i for t, i in vocab.items() if t.startswith("cat")]
    chosen = add_train_tokens(tok, te, [["<kitty>", "^cat"], ["^dog</w>", None]])
    new = chosen["<kitty>"][0]
    emb = te.get_input_embeddings()
    assert isinstance(emb, TokenDeltas) and new == len(vocab)
    assert torch.allclose(emb.weight[new], E0[cats].mean(0), atol=1e-6)           # mean of the matching rows
    assert chosen["^dog</w>"] == [vocab["dog</w>"]]
    assert [n for n, p in te.named_parameters() if p.requires_grad] == ["text_model.embeddings.token_embedding.delta"]
    out = encode_text(tok, te, ["a <kitty> and a dog", "nothing here"])
    (out["clip_text"].sum() + out["clip_text_pooled"].sum()).backward()
    assert emb.delta.grad.shape == (2, E0.shape[1]) and (emb.delta.grad.abs().sum(1) > 0).all()
    # pooled embedding is read at end-of-text, not at the (larger) new token id
    ids = tok(["a <kitty>"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    assert ids[0, 2] == new and ids[0, 3] == tok.eos_token_id
    with torch.no_grad():
        h = te(input_ids=ids, output_hidden_states=True)
        pooled_at_eos = te.text_projection(h.last_hidden_state[0, 3])
    assert torch.allclose(h.text_embeds[0], pooled_at_eos, atol=1e-5)
