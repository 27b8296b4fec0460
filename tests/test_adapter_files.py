"""The consumer readers of `cascade_nb.adapter_files` against each family's maths written out here, with the scale
conventions of ComfyUI's code (`comfy/weight_adapter/*.py`, `comfy/lora.py`), kohya's `networks/lora.py` and peft's
`tuners/lora`, where they differ included. The LoKr/LoHa/DoRA/OFT exports of cascade_nb are read by the same code."""
import math, pytest, torch
from cascade_nb.models.stage_c import StageC
from cascade_nb.lora_converters import reference_lora_targets
from cascade_nb.adapter_readers import (consumer_params, read_comfyui, read_kohya, read_peft, reference_targets,
                                        clip_g_params)

KEY = "lora_unet_down_blocks_0_2_kv_mapper_1"          # a (64, 64) Linear of the tiny Stage C
PATH = "down_blocks.0.2.kv_mapper.1.weight"
CONV = "lora_unet_embedding_1"                         # a (64, 16, 1, 1) convolution
QKV = "lora_unet_down_blocks_0_2_attention_attn_to_k"  # rows 64..128 of a fused (192, 64) in_proj_weight

@pytest.fixture(scope="module")
def params():
    torch.manual_seed(0)
    return consumer_params(StageC.from_preset("tiny")) | clip_g_params(width=64, layers=2, mlp=256)

def rnd(*shape, seed=[0]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))

def test_lora_scale_alpha_over_rank_and_missing_alpha(params):
    up, down = rnd(64, 4), rnd(4, 64)
    lora = {f"{KEY}.lora_up.weight": up, f"{KEY}.lora_down.weight": down}
    rd = read_comfyui({**lora, f"{KEY}.alpha": torch.tensor(2.)}, params)
    assert torch.allclose(rd.deltas[PATH], 0.5 * up @ down, atol=1e-6) and not rd.skipped
    rd = read_comfyui({f"{KEY}.lora_up.weight": up, f"{KEY}.lora_down.weight": down}, params)
    assert torch.allclose(rd.deltas[PATH], up @ down, atol=1e-6) and "no .alpha" in rd.warnings[0]
    # alpha 0: ComfyUI scales by 0, kohya reads it as alpha = rank (scale 1)
    sd = {f"{KEY}.lora_up.weight": up, f"{KEY}.lora_down.weight": down, f"{KEY}.alpha": torch.tensor(0.)}
    assert read_comfyui(sd, params).deltas[PATH].abs().max() == 0
    assert torch.allclose(read_kohya(sd, params).deltas[PATH], up @ down, atol=1e-6)

def test_fused_attention_rows_and_diffusers_spellings(params):
    up, down = rnd(64, 2), rnd(2, 64)
    rd = read_comfyui({"down_blocks.0.2.attention.attn.to_k.lora_B.weight": up,
                       "down_blocks.0.2.attention.attn.to_k.lora_A.weight": down}, params)   # bare name, peft spelling
    d = rd.deltas["down_blocks.0.2.attention.attn.in_proj_weight"]
    assert d.shape == (192, 64) and d[:64].abs().max() == 0 and d[128:].abs().max() == 0
    assert torch.allclose(d[64:128], up @ down, atol=1e-6)

def test_locon_mid_is_the_tucker_product(params):
    W = params["embedding.1.weight"]                        # (64, 16, 1, 1): a 1x1 kernel, mid (r, r, 1, 1)
    up, mid, down = rnd(64, 3, 1, 1), rnd(3, 3, 1, 1), rnd(3, 16, 1, 1)
    rd = read_comfyui({f"{CONV}.lora_up.weight": up, f"{CONV}.lora_mid.weight": mid, f"{CONV}.lora_down.weight": down,
                       f"{CONV}.alpha": torch.tensor(1.5)}, params)
    want = torch.einsum("op,pqkl,qi->oikl", up[:, :, 0, 0], mid, down[:, :, 0, 0]) * 1.5 / 3
    got = rd.deltas["embedding.1.weight"]
    assert got.shape == W.shape and torch.allclose(got, want, atol=1e-5)

def test_loha_hadamard_with_alpha_over_w1b_rows(params):
    w1a, w1b, w2a, w2b = rnd(64, 4), rnd(4, 64), rnd(64, 4), rnd(4, 64)
    sd = {f"{KEY}.hada_w1_a": w1a, f"{KEY}.hada_w1_b": w1b, f"{KEY}.hada_w2_a": w2a, f"{KEY}.hada_w2_b": w2b,
          f"{KEY}.alpha": torch.tensor(3.)}
    rd = read_comfyui(sd, params)
    assert torch.allclose(rd.deltas[PATH], (3 / 4) * (w1a @ w1b) * (w2a @ w2b), atol=1e-5)
    assert rd.layers[KEY].kind == "loha" and rd.layers[KEY].scale == 0.75 and not rd.skipped
    assert read_kohya(sd, params).deltas == {} and "lycoris" in read_kohya(sd, params).warnings[0]

def test_lokr_kron_and_its_dim_rule(params):
    w1, w2a, w2b = rnd(8, 8), rnd(8, 2), rnd(2, 8)
    rd = read_comfyui({f"{KEY}.lokr_w1": w1, f"{KEY}.lokr_w2_a": w2a, f"{KEY}.lokr_w2_b": w2b,
                       f"{KEY}.alpha": torch.tensor(1.)}, params)
    assert torch.allclose(rd.deltas[PATH], torch.kron(w1, w2a @ w2b) / 2, atol=1e-5)      # dim = rows of w2_b
    w1a, w1b, w2 = rnd(8, 2), rnd(2, 8), rnd(8, 8)
    rd = read_comfyui({f"{KEY}.lokr_w1_a": w1a, f"{KEY}.lokr_w1_b": w1b, f"{KEY}.lokr_w2": w2,
                       f"{KEY}.alpha": torch.tensor(4.)}, params)
    assert torch.allclose(rd.deltas[PATH], torch.kron(w1a @ w1b, w2) * 2, atol=1e-5)     # dim = rows of w1_b
    rd = read_comfyui({f"{KEY}.lokr_w1": w1, f"{KEY}.lokr_w2": w2, f"{KEY}.alpha": torch.tensor(4.)}, params)
    assert torch.allclose(rd.deltas[PATH], torch.kron(w1, w2), atol=1e-5)                # both full: alpha ignored
    assert not rd.warnings                     # by every reader (LyCORIS too): no reading differs, nothing to say

def cayley(B, alpha):
    Q = B - B.transpose(-1, -2)
    if Q.norm() > alpha: Q = Q * alpha / (Q.norm() + 1e-8)
    eye = torch.eye(B.shape[-1])
    return (eye + Q) @ torch.linalg.inv(eye - Q)

def test_oft_rotates_block_rows_and_ignores_rescale(params):
    W = params[PATH]
    blocks = 0.1 * rnd(8, 8, 8)                              # 8 blocks of 8 rows
    sd = {f"{KEY}.oft_blocks": blocks, f"{KEY}.alpha": torch.tensor(0.5), f"{KEY}.rescale": rnd(64, 1)}
    rd = read_comfyui(sd, params)
    R = cayley(blocks, 0.5)
    want = torch.cat([(R[k] - torch.eye(8)).T @ W[8 * k:8 * k + 8] for k in range(8)])
    assert torch.allclose(rd.deltas[PATH], want, atol=1e-5) and not rd.skipped
    assert [w for w in rd.warnings if "rescale" not in w] == []     # the bound is ComfyUI's and ours: alpha itself
    rd = read_comfyui({f"{KEY}.oft_blocks": blocks}, params)        # no alpha: ComfyUI a125cd8 reads 0, no bound
    R = cayley(blocks, float('inf'))
    want = torch.cat([(R[k] - torch.eye(8)).T @ W[8 * k:8 * k + 8] for k in range(8)])
    assert torch.allclose(rd.deltas[PATH], want, atol=1e-5) and not rd.warnings
    with torch.device("meta"): meta = consumer_params(StageC.from_preset("tiny"))
    assert "--model" in read_comfyui(sd, meta).warnings[0]                                 # needs the base weights

def test_boft_one_stage_is_a_shuffled_block_rotation(params):
    W, b = params[PATH], 8
    blocks = 0.1 * rnd(1, 8, b, b)
    rd = read_comfyui({f"{KEY}.boft_x": torch.zeros(1), f"{KEY}.oft_blocks": blocks,
                       f"{KEY}.alpha": torch.tensor(1.)}, params)
    R, k = cayley(blocks, 1.0)[0], b // 2
    # stage 0: in every chunk of b rows, row j*2+g is taken from row g*k+j, rotated by its block, put back
    perm = torch.tensor([c * b + g * k + j for c in range(64 // b) for j in range(k) for g in range(2)])
    rotated = torch.einsum("nij,njd->nid", R, W[perm].reshape(-1, b, 64)).reshape(64, 64)
    out = torch.empty_like(W); out[perm] = rotated
    assert torch.allclose(rd.deltas[PATH], out - W, atol=1e-5) and rd.skipped == [f"{KEY}.boft_x"]

def test_dora_scale_axis_rules(params):
    W, up, down = params[PATH], rnd(64, 4), rnd(4, 64)
    s, diff = 2 / 4, up @ down
    lyco = rnd(1, 64).abs()                                  # LyCORIS wd_on_out=False: one per input column
    rd = read_comfyui({f"{KEY}.lora_up.weight": up, f"{KEY}.lora_down.weight": down, f"{KEY}.alpha": torch.tensor(2.),
                       f"{KEY}.dora_scale": lyco}, params)
    calc = W + s * diff
    assert torch.allclose(rd.deltas[PATH], calc * lyco / calc.norm(dim=0, keepdim=True) - W, atol=1e-5)
    per_row = rnd(64, 1).abs()                               # peft / wd_on_out=True: ComfyUI divides by the BASE rows
    rd = read_comfyui({f"{KEY}.lora_up.weight": up, f"{KEY}.lora_down.weight": down, f"{KEY}.alpha": torch.tensor(2.),
                       f"{KEY}.dora_scale": per_row}, params)
    assert torch.allclose(rd.deltas[PATH], calc * per_row / W.norm(dim=1, keepdim=True) - W, atol=1e-5)
    assert any("base weight's row norms" in w for w in rd.warnings)

def test_full_diff_bias_and_shape_mismatch(params):
    d, db = rnd(64, 64), rnd(64)
    rd = read_comfyui({f"{KEY}.diff": d, f"{KEY}.diff_b": db, f"{CONV}.diff": rnd(3, 3)}, params)
    assert torch.allclose(rd.deltas[PATH], d) and torch.allclose(rd.deltas["down_blocks.0.2.kv_mapper.1.bias"], db)
    assert "embedding.1.weight" not in rd.deltas and any("NOT MERGED" in w for w in rd.warnings)
    assert not rd.skipped                                    # ComfyUI marks the mismatched key loaded

def test_text_encoder_keys(params):
    up, down = rnd(256, 2), rnd(2, 64)
    te = "text_model_encoder_layers_1_mlp_fc1"
    sd = {f"lora_prior_te_{te}.lora_up.weight": up, f"lora_prior_te_{te}.lora_down.weight": down,
          f"lora_te_{te}.alpha": torch.tensor(1.), "lora_te_text_model_embeddings_token_embedding.lora_up.weight": up}
    rd = read_comfyui(sd, params)
    assert torch.allclose(rd.deltas["text_encoder.text_model.encoder.layers.1.mlp.fc1.weight"], up @ down, atol=1e-6)
    # an .alpha under another stem of the same layer is marked loaded by ComfyUI but scales nothing (scale 1 above)
    assert rd.skipped == ["lora_te_text_model_embeddings_token_embedding.lora_up.weight"]
    assert read_kohya(sd, params).deltas == {}               # kohya reads lora_te_, not OneTrainer's lora_prior_te_

def test_peft_rslora_alpha_pattern_and_dora(params):
    W, A, B = params[PATH], rnd(4, 64), rnd(64, 4)
    sd = {"base_model.model.down_blocks.0.2.kv_mapper.1.lora_A.weight": A,
          "base_model.model.down_blocks.0.2.kv_mapper.1.lora_B.weight": B}
    cfg = dict(r=4, lora_alpha=8, target_modules=["kv_mapper.1"], use_rslora=True, alpha_pattern={"0.2.kv_mapper.1": 2})
    rd = read_peft(sd, params, None, cfg)
    assert torch.allclose(rd.deltas[PATH], (2 / math.sqrt(4)) * B @ A, atol=1e-6)
    m = rnd(64).abs()
    rd = read_peft({**sd, "base_model.model.down_blocks.0.2.kv_mapper.1.lora_magnitude_vector": m}, params, None,
                   dict(r=4, lora_alpha=8, target_modules=["kv_mapper.1"], use_dora=True))
    calc = W + 2 * B @ A
    assert torch.allclose(rd.deltas[PATH], m[:, None] * calc / calc.norm(dim=1, keepdim=True) - W, atol=1e-5)
    rd = read_peft(sd, params, None, dict(r=4, lora_alpha=8, target_modules=["kv_mapper.1"], use_dora=True))
    m0 = W.norm(dim=1, keepdim=True)                         # no magnitude saved: peft's initial ‖W‖ rows
    assert torch.allclose(rd.deltas[PATH], m0 * calc / calc.norm(dim=1, keepdim=True) - W, atol=1e-5)
    rd = read_peft(sd, params, None, dict(r=4, lora_alpha=8, target_modules=["to_q"]))     # not targeted
    assert rd.deltas == {} and len(rd.skipped) == 2

def test_official_order_from_names_matches_the_reference():
    model = StageC.from_preset("tiny")
    for filters in ([".attn"], [".attn", "kv_mapper", "embedding.1"], ["channelwise"]):
        assert reference_targets(consumer_params(model), filters) == reference_lora_targets(model, filters)

def test_peft_itself_honours_the_rank_pattern_we_write(tmp_path):
    "Real peft on diffusers' twin of the tiny Stage C: the ranks-per-module folder loads and matches our reader."
    pytest.importorskip("diffusers")
    import copy, json
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from cascade_nb.interop_c import stage_c_to_diffusers
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict
    from cascade_nb.adapter_exports import export_adapter
    torch.manual_seed(0)
    base = StageC.from_preset("tiny"); model = copy.deepcopy(base)
    apply_lora(model, [".attn"], rank=4, alpha=3.0, init="peft")
    apply_lora(model, ["kv_mapper"], rank=2, alpha=5.0, init="peft", freeze=False)
    with torch.no_grad():
        for l in lora_layers(model).values(): l.lora_up.normal_(std=0.05)
    export_adapter(lora_state_dict(model), "peft", tmp_path / "a")
    unet = stage_c_to_diffusers(base)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    inject_adapter_in_model(LoraConfig.from_pretrained(str(tmp_path / "a")), unet)
    file = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    sd = {k.removeprefix("base_model.model."): v for k, v in file.items()}
    assert not set_peft_model_state_dict(unet, sd).unexpected_keys
    mod = unet.get_submodule("down_blocks.0.2.kv_mapper.1")
    got = mod.get_delta_weight("default")                    # peft's own ΔW, scale included
    ours = read_peft(file, consumer_params(base), None,
                     json.loads((tmp_path / "a" / "adapter_config.json").read_text()))
    assert mod.r["default"] == 2 and mod.scaling["default"] == 2.5
    assert torch.allclose(got, ours.deltas[PATH], atol=1e-6) and before

def test_embedding_export_one_file_per_token(tmp_path):
    import json
    from safetensors.torch import load_file
    from cascade_nb.core import safetensors_header
    from cascade_nb.adapter_exports import export_adapter
    rows = rnd(2, 1280)
    tokens = {"tokens.ids": torch.tensor([49408, 49409]), "tokens.embeddings": rows,
              "tokens.names": torch.tensor(list(json.dumps(["[cat toy]", "<style>"]).encode()), dtype=torch.uint8)}
    paths, _ = export_adapter(tokens, "embedding", tmp_path / "emb")
    assert [p.name for p in paths] == ["cat_toy.safetensors", "style.safetensors"]
    assert torch.equal(load_file(str(paths[1]))["clip_g"], rows[1:])
    meta = safetensors_header(paths[0])[0]
    assert meta["modelspec.trigger_phrase"] == "[cat toy]" and "ss_network_dim" not in meta
    assert meta["modelspec.architecture"] == "stable-cascade-v1-prior/textual-inversion"

def test_a_onetrainer_style_file_exports_to_peft(tmp_path, params):
    "Another trainer's lora_prior_unet_ keys (OneTrainer) → cascade_nb's layout → peft, the same ΔW throughout."
    from cascade_nb.adapter_readers import cascade_nb_deltas
    from cascade_nb.adapter_exports import AdapterSource, source_lora, export_adapter
    model = StageC.from_preset("tiny")
    up, down = rnd(64, 2), rnd(2, 64)
    ot = {"lora_prior_unet_down_blocks_0_2_kv_mapper_1.lora_up.weight": up,
          "lora_prior_unet_down_blocks_0_2_kv_mapper_1.lora_down.weight": down,
          "lora_prior_unet_down_blocks_0_2_kv_mapper_1.alpha": torch.tensor(1.),
          "lora_prior_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": rnd(256, 2)}
    rd = read_comfyui(ot, params)                       # an up without its down: ComfyUI fails on the whole file
    assert rd.refused and rd.deltas == {} and "ComfyUI stops loading the file here" in rd.warnings[0]
    want = up @ down / 2
    # as a source, its text-encoder entry (an up without its down) is refused; the generator's part converts
    with pytest.raises(ValueError, match=r"\['lora_up'\]"):
        source_lora(AdapterSource(tmp_path / "ot.safetensors", ot, {}), model)
    ot = {k: v for k, v in ot.items() if not k.startswith("lora_prior_te_")}
    lora = source_lora(AdapterSource(tmp_path / "ot.safetensors", ot, {}), model)
    assert torch.allclose(cascade_nb_deltas(lora, params)[PATH], want, atol=1e-6)
    import json
    from safetensors.torch import load_file
    paths, _ = export_adapter(lora, "peft", tmp_path / "peft")
    rd = read_peft(load_file(str(paths[1])), params, None, json.loads(paths[0].read_text()))
    assert torch.allclose(rd.deltas[PATH], want, atol=1e-6)

TYPES = {"lora": ("lora", {}), "dora": ("dora", {}), "loha": ("loha", {}), "lokr": ("lokr", {}),
         "lokr_full_matrix": ("lokr", {"full_matrix": True}), "lokr_factor_4": ("lokr", {"lokr_factor": 4}),
         "oft": ("oft", {"oft_block_size": 8}), "oft_rescale": ("oft", {"oft_block_size": 8, "oft_rescale": True}),
         "oft_constraint": ("oft", {"oft_block_size": 8, "oft_constraint": 0.05})}

@pytest.fixture(scope="module")
def typed_loras():
    "{case: (plain tiny Stage C, its LoRA state dict, merge_lora's ΔW)}: every type on the fused attention and kv_mapper."
    import copy
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict, merge_lora, adapter_entries
    torch.manual_seed(0)
    base, out = StageC.from_preset("tiny"), {}
    for case, (kind, opts) in TYPES.items():
        model = copy.deepcopy(base)
        apply_lora(model, [".attn", "kv_mapper"], rank=4, alpha=2.0, adapter=kind, options=opts)
        with torch.no_grad():
            for l in lora_layers(model).values():
                for t in l.tensors().values(): t.add_(rnd(*t.shape) * 0.1)
        lora = lora_state_dict(model)
        merged = merge_lora(copy.deepcopy(base), lora)
        out[case] = base, lora, {p: merged.get_parameter(p).detach() - base.get_parameter(p).detach()
                                 for p in adapter_entries(lora)}
    return out

@pytest.mark.parametrize("case", list(TYPES))
def test_every_type_exported_for_comfyui_and_peft_reads_as_merge_lora(case, typed_loras, tmp_path):
    "kohya export → ComfyUI's reader, our own layout → cascade_nb's reader, peft where it supports the type."
    import json
    from safetensors.torch import load_file
    from cascade_nb.core import safetensors_header
    from cascade_nb.config import ConfigError
    from cascade_nb.adapter_readers import delta_error, read_cascade_nb
    from cascade_nb.adapter_exports import export_adapter
    base, lora, want = typed_loras[case]
    params = consumer_params(base)
    assert delta_error(read_cascade_nb(lora, params), want) < 1e-6
    assert max(float(d.abs().max()) for d in want.values()) > 1e-3            # a real update
    paths, warns = export_adapter(lora, "kohya", tmp_path / "k.safetensors", base)
    sd, meta = load_file(str(paths[0])), safetensors_header(paths[0])[0]
    rd = read_comfyui(sd, params, meta)
    assert delta_error(rd, want) < 1e-5 and not rd.skipped and not warns, (delta_error(rd, want), warns)
    assert meta["cascade_nb.adapter_type"] == TYPES[case][0]
    # the one note left: ComfyUI's bound on Q is alpha, LyCORIS' module's alpha·out_dim (ours is ComfyUI's)
    assert all("LyCORIS' constraint" in w for w in rd.warnings) and (not rd.warnings or case == "oft_constraint")
    if case == "oft_rescale": assert {l.kind for l in rd.layers.values()} == {"diff"}
    # no exact q/k/v split: the OFT's bound binds on the whole Q, the LoKr's 4-row w1 does not divide into thirds
    if case in ("oft_constraint", "lokr_factor_4"): assert any(k.endswith("attn_to_q.diff") for k in sd)
    if TYPES[case][0] in ("lora", "dora"):
        paths, _ = export_adapter(lora, "peft", tmp_path / "peft")
        cfg = json.loads(paths[0].read_text())
        rd = read_peft(load_file(str(paths[1])), params, None, cfg)
        assert cfg["use_dora"] == (case == "dora") and delta_error(rd, want) < 1e-5 and not rd.skipped
    else:
        with pytest.raises(ConfigError, match="--to peft: writes one type"): export_adapter(lora, "peft", tmp_path / "p")
    if case != "lora":
        with pytest.raises(ValueError, match="to_reference: writes adapter type 'lora' only"):
            export_adapter(lora, "official", tmp_path / "o.safetensors", base, module_filters=[".attn"])

def test_peft_itself_merges_our_dora_as_merge_lora(typed_loras, tmp_path):
    "Real peft (use_dora) on diffusers' twin of the tiny Stage C: its merged weights minus the base are our ΔW."
    pytest.importorskip("diffusers")
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from cascade_nb.interop_c import stage_c_to_diffusers
    from cascade_nb.adapter_exports import export_adapter
    base, lora, want = typed_loras["dora"]
    export_adapter(lora, "peft", tmp_path / "a")
    unet = stage_c_to_diffusers(base)
    inject_adapter_in_model(LoraConfig.from_pretrained(str(tmp_path / "a")), unet)
    file = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    res = set_peft_model_state_dict(unet, {k.removeprefix("base_model.model."): v for k, v in file.items()})
    assert not res.unexpected_keys
    for mod, path, rows in (("down_blocks.0.2.kv_mapper.1", PATH, slice(None)),
                            ("down_blocks.0.2.attention.to_k", "down_blocks.0.2.attention.attn.in_proj_weight",
                             slice(64, 128))):
        layer = unet.get_submodule(mod)
        before = layer.base_layer.weight.detach().clone()
        layer.merge()
        assert torch.allclose(layer.base_layer.weight.detach() - before, want[path][rows], atol=1e-5), mod
