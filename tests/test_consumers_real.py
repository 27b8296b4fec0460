"""Adapter files read by the consumers' own code, the ones that are pip packages (issue 46): LyCORIS' kohya loader
(`lycoris.kohya.create_network_from_weights` + `merge_to`, how kohya's Stable Cascade scripts load LyCORIS types) on
a Stage C with kohya's q/k/v-split attention, and peft (`PeftModel.from_pretrained` + `merge_and_unload`) on
diffusers' StableCascadeUNet. For every type each supports, the merged weights minus the base equal what cascade_nb
trained (its own `merge_lora`), and `python -m cascade_nb.lora check --for lycoris|peft` predicts the consumer: the
same ΔW where it loads, a refusal where its code fails. ComfyUI and kohya's `networks.lora` are not on the package
registries: bench/consumers.py runs them from a checkout."""
import copy, json, logging, warnings
import pytest
import torch
from torch import nn
from safetensors.torch import load_file
from cascade_nb.models.stage_c import StageC
from cascade_nb.adapters import apply_lora, lora_layers
from cascade_nb.lora_file import lora_state_dict, merge_lora, adapter_entries
from cascade_nb.adapter_exports import export_adapter
from cascade_nb.adapter_readers import consumer_params, read_lycoris, read_peft, read_kohya
from cascade_nb.core import safetensors_header

# every Stage C module kind: attention (fused q/k/v), Linear mappers, 1×1 convs (embedding, clf), depthwise convs
EVERY = [".attn", "channelwise", "depthwise", "mapper", "embedding", "clf"]
TYPES = {"lora": ("lora", {}, EVERY), "dora": ("dora", {}, EVERY), "loha": ("loha", {}, EVERY),
         "lokr": ("lokr", {}, EVERY), "lokr_full_matrix": ("lokr", {"full_matrix": True}, EVERY),
         "lokr_decompose_both": ("lokr", {"decompose_both": True, "lokr_factor": 4}, EVERY),
         "oft": ("oft", {"oft_block_size": 4}, [".attn", "channelwise", "mapper", "clf"]),
         "oft_block_32": ("oft", {"oft_block_size": 32}, [".attn"]),             # 2 blocks of 32 rows: n < b
         "oft_rescale": ("oft", {"oft_block_size": 4, "oft_rescale": True}, [".attn", "mapper"]),
         "oft_constraint": ("oft", {"oft_block_size": 4, "oft_constraint": 1e-3}, [".attn", "mapper"])}

def adapted(base: nn.Module, filters, kind: str, opts: dict | None = None) -> tuple[dict, dict]:
    "(LoRA state dict, merge_lora's ΔW) of `kind` adapters on `filters` of `base`, their tensors off their start."
    model = copy.deepcopy(base)
    apply_lora(model, filters, rank=4, alpha=2.0, adapter=kind, options=opts)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for t in layer.tensors().values(): t.add_(torch.randn(t.shape) * 0.05)
    lora = lora_state_dict(model)
    merged = merge_lora(copy.deepcopy(base), lora)
    return lora, {p: merged.get_parameter(p).detach() - base.get_parameter(p).detach() for p in adapter_entries(lora)}

@pytest.fixture(scope="module")
def trained():
    "{case: (base, LoRA state dict, merge_lora's ΔW)}: every type on the tiny Stage C."
    torch.manual_seed(0)
    base = StageC.from_preset("tiny")
    return {case: (base, *adapted(base, filters, kind, opts)) for case, (kind, opts, filters) in TYPES.items()}

def kohya_view(model: nn.Module) -> nn.Module:
    "A copy of the Stage C whose attentions are to_q/to_k/to_v/out_proj Linears: kohya's StageC's module names."
    view = copy.deepcopy(model)
    for name, mha in list(view.named_modules()):
        if not isinstance(mha, nn.MultiheadAttention): continue
        c, split = mha.embed_dim, nn.Module()
        for i, part in enumerate(("to_q", "to_k", "to_v")):
            lin = nn.Linear(c, c)
            lin.weight.data, lin.bias.data = (mha.in_proj_weight.data[i * c:(i + 1) * c].clone(),
                                              mha.in_proj_bias.data[i * c:(i + 1) * c].clone())
            setattr(split, part, lin)
        split.out_proj = nn.Linear(c, c)         # a plain Linear (MultiheadAttention's is a "quantizable" one)
        split.out_proj.load_state_dict(mha.out_proj.state_dict())
        parent, _, leaf = name.rpartition(".")
        setattr(view.get_submodule(parent), leaf, split)
    return view

def _fused(view: nn.Module, path: str) -> torch.Tensor:
    if not path.endswith(".in_proj_weight"): return view.get_parameter(path).detach().clone()
    mod = path[:-len(".in_proj_weight")]
    return torch.cat([view.get_submodule(f"{mod}.{p}").weight.detach() for p in ("to_q", "to_k", "to_v")])

def lycoris_merge(base: nn.Module, file) -> dict:
    "ΔW per parameter of ours that LyCORIS' kohya loader merges from `file` (an exception where its code fails)."
    from lycoris.kohya import create_network_from_weights
    logging.getLogger("LyCORIS").setLevel(logging.ERROR)
    view = kohya_view(base)
    paths = [p for p, W in base.named_parameters() if W.ndim > 1]
    before = {p: _fused(view, p) for p in paths}
    network, sd = create_network_from_weights(1.0, str(file), None, None, view, for_inference=True)
    network.merge_to(None, view, sd, "cpu", torch.float32)
    return {p: _fused(view, p) - before[p] for p in paths if not torch.equal(_fused(view, p), before[p])}

def rel_error(got: dict, want: dict, base: nn.Module | None = None) -> float:
    """max over weights of max|ΔW_got − ΔW_want| / max|ΔW_want| (a weight one side leaves alone counts as zero there);
    with `base`, `want` as a merge measures it: (W + ΔW) − W in float32, the rounding every merge has."""
    if base is not None: want = {p: (base.get_parameter(p).detach() + w) - base.get_parameter(p).detach()
                                 for p, w in want.items()}
    return max(float((got.get(p, torch.zeros_like(w)) - w).abs().max() / w.abs().max().clamp_min(1e-12))
               for p, w in want.items() if float(w.abs().max()) > 0)

@pytest.mark.parametrize("case", list(TYPES))
def test_lycoris_merges_what_cascade_nb_trained(case, trained, tmp_path):
    """`export --to kohya --for lycoris` with the base weights: LyCORIS' own loader merges our ΔW for every type (LoHa
    and LoKr at scale 1, so its doubled merge scale does not matter; LoKr factors it cannot rebuild, and OFT with fewer
    blocks than rows, as `.diff`; OFT's bound as alpha/rows). `check --for lycoris` predicts it, without a warning."""
    base, lora, want = trained[case]
    path = tmp_path / "lycoris.safetensors"
    _, warns = export_adapter(lora, "kohya", path, base, reader="lycoris")
    assert not warns, warns
    got = lycoris_merge(base, path)
    assert rel_error(got, want, base) < 1e-4, rel_error(got, want, base)
    rd = read_lycoris(load_file(str(path)), consumer_params(base), safetensors_header(path)[0])
    assert not rd.refused and not rd.skipped and not rd.warnings, (rd.warnings[:3], rd.skipped[:3])
    assert rel_error(got, rd.deltas, base) < 1e-4

@pytest.mark.parametrize("case", ["lokr", "oft_block_32", "oft_constraint", "dora", "loha"])
def test_check_for_lycoris_predicts_lycoris_on_the_comfyui_file(case, trained, tmp_path):
    """The file for ComfyUI (the default `--for comfyui`) where LyCORIS reads it otherwise: `check --for lycoris` says
    the load fails exactly where LyCORIS' code raises, and warns where LyCORIS merges something else."""
    base, lora, want = trained[case]
    path = tmp_path / "comfyui.safetensors"
    export_adapter(lora, "kohya", path, base)
    rd = read_lycoris(load_file(str(path)), consumer_params(base), safetensors_header(path)[0])
    try: got = lycoris_merge(base, path)
    except (RuntimeError, TypeError) as e:
        assert rd.refused and "the whole load fails" in rd.warnings[0], (e, rd.warnings)
        return
    assert not rd.refused and rel_error(got, rd.deltas, base) < 1e-4
    assert (rel_error(got, want, base) > 1e-2) == bool(rd.warnings), (rel_error(got, want, base), rd.warnings)

def _peft_merge(base: nn.Module, folder) -> dict:
    "ΔW per parameter of ours that peft merges from the adapter `folder` into diffusers' twin of `base`."
    from peft import PeftModel
    from cascade_nb.interop_c import stage_c_to_diffusers, stage_c_from_diffusers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(stage_c_to_diffusers(base), str(folder)).merge_and_unload()
    back = dict(stage_c_from_diffusers(merged).named_parameters())
    return {p: back[p].detach().float() - W.detach() for p, W in base.named_parameters()
            if not torch.equal(back[p].detach().float(), W.detach())}

@pytest.mark.parametrize("case", ["lora", "dora"])
def test_peft_merges_what_cascade_nb_trained(case, trained, tmp_path):
    """`export --to peft` on every Linear and 1×1 conv (DoRA's conv magnitude as peft's (1, out, 1, 1)): peft's own
    `from_pretrained` + `merge_and_unload` gives our ΔW, and `check --for peft` agrees. On a depthwise conv the export
    refuses, and peft itself refuses such a folder as `check --for peft` says."""
    from peft import PeftModel
    from cascade_nb.config import ConfigError
    from cascade_nb.interop_c import stage_c_to_diffusers
    kind, _, filters = TYPES[case]
    base = trained[case][0]
    lora, want = adapted(base, [f for f in filters if f != "depthwise"], kind)
    paths, _ = export_adapter(lora, "peft", tmp_path / "peft")
    got = _peft_merge(base, tmp_path / "peft")
    assert rel_error(got, want, base) < 1e-4, rel_error(got, want, base)
    rd = read_peft(load_file(str(paths[1])), consumer_params(base), None, json.loads(paths[0].read_text()))
    assert not rd.refused and not rd.warnings and rel_error(got, rd.deltas, base) < 1e-4
    # the depthwise convs: our export refuses; a folder that targets them (rank 4, groups 64) peft refuses, as check
    with pytest.raises(ConfigError, match="depthwise"): export_adapter(trained[case][1], "peft", tmp_path / "dw")
    cfg = json.loads(paths[0].read_text())
    cfg["target_modules"] = cfg["target_modules"] + ["down_blocks.0.0.depthwise"]
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(cfg))
    dw = "base_model.model.down_blocks.0.0.depthwise"
    sd = load_file(str(paths[1])) | {f"{dw}.lora_A.weight": torch.zeros(4, 1, 3, 3),
                                     f"{dw}.lora_B.weight": torch.zeros(64, 4, 1, 1)}
    with pytest.raises(ValueError, match="groups"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PeftModel.from_pretrained(stage_c_to_diffusers(base), str(tmp_path / "peft"))
    assert read_peft(sd, consumer_params(base), None, cfg).refused

def test_kohya_networks_lora_skips_depthwise_convs(trained):
    "kohya's `networks.lora` makes no module for a grouped conv: `check --for kohya` counts those keys skipped, warns."
    from cascade_nb.lora_converters import to_kohya
    base, lora, _ = trained["lora"]
    rd = read_kohya(to_kohya(lora, base), consumer_params(base))
    assert rd.skipped and all("depthwise" in k for k in rd.skipped) and len(rd.skipped) == 3 * 6
    assert any("depthwise (grouped) convs" in w for w in rd.warnings)
    assert not any("depthwise" in p for p in rd.deltas)

def test_comfyui_reads_the_dora_form_exactly_on_near_zero_rows(tmp_path):
    """ComfyUI divides DoRA's magnitude by ‖W‖ + ε per row (float32's ε): the form `--for comfyui` writes carries
    that ε, so rows whose base norm is near 0 (zero-initialised mappers after a few updates) read exactly too."""
    from cascade_nb.adapter_readers import read_comfyui
    torch.manual_seed(0)
    base = StageC.from_preset("tiny")
    with torch.no_grad(): base.get_parameter("down_blocks.0.2.kv_mapper.1.weight")[:8].mul_(1e-6)   # ‖W_row‖ ~ 1e-6
    lora, want = adapted(base, ["kv_mapper"], "dora")
    path = tmp_path / "comfyui.safetensors"
    _, warns = export_adapter(lora, "kohya", path, base)
    rd = read_comfyui(load_file(str(path)), consumer_params(base), safetensors_header(path)[0])
    assert not warns and not rd.warnings and rel_error(rd.deltas, want, base) < 1e-5, rel_error(rd.deltas, want, base)

def test_no_false_alarm_for_an_oft_comfyui_reads_exactly(trained, tmp_path):
    "An OFT without rescale needs no base weights for ComfyUI: the export without `--model` does not warn."
    base, lora, want = trained["oft"]
    from cascade_nb.adapter_readers import read_comfyui
    _, warns = export_adapter(lora, "kohya", tmp_path / "oft.safetensors")
    rd = read_comfyui(load_file(str(tmp_path / "oft.safetensors")), consumer_params(base))
    assert not warns and not rd.warnings and rel_error(rd.deltas, want, base) < 1e-4
