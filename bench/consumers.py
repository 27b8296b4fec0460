"""Adapter files read by ComfyUI's and kohya's own code (issue 46): every adapter type, every export form.

    OMP_NUM_THREADS=1 python bench/consumers.py --comfyui PATH --sd-scripts DIR [--cases lora dora ...] [--out FILE]

ComfyUI and kohya's sd-scripts are not on the package registries (the suite's tests/test_consumers_real.py runs
LyCORIS and peft, which are), so this bench runs their loaders from checkouts the user fetches:

* `--comfyui PATH`: a ComfyUI checkout (last run: Comfy-Org/ComfyUI a125cd84b054a57729b5eecab930ca9408719832). Its
  Python dependencies must be importable (`pip install --target DIR torchsde scipy kornia spandrel sentencepiece av`,
  `--deps DIR` puts DIR on sys.path); where torchvision is not installed an empty stub stands in (ComfyUI and
  sd-scripts import it at module level; the LoRA path never uses it). ComfyUI runs with `--cpu` in float32.
  Its model detection knows only the 3.6B/1B Stage C, so one function is patched: `comfy.model_detection.
  detect_unet_config` adds the tiny Stage C's sizes where ComfyUI found a Stage C of a width it does not know; the
  CLIP-G gets the tiny text model's sizes through ComfyUI's own `clip_g_model_config` model option. Then, as its
  LoraLoader node: `comfy.sd.load_diffusion_model_state_dict` (cascade_nb's Stage C state dict; ComfyUI splits the fused
  in_proj into to_q/k/v itself), a `comfy.sd.CLIP` of `Stable_Cascade_C.clip_target()` loaded with the tiny CLIP's
  HF state dict, `comfy.sd.load_lora_for_models(model, clip, file, 1, 1)` (its key maps `model_lora_keys_unet` /
  `_clip`), then `comfy.model_management.load_models_gpu([model, clip.patcher])`, which patches the weights as a
  sampler / CLIPTextEncode does before running them (a bare `patch_model()` on the CLIP's clone leaves its weights
  as they were: loading the CLIP at its construction marked its modules `comfy_patched_weights`, which
  `ModelPatcher.load` skips; `load_models_gpu` sees the new patches and reloads); ΔW = patched − before, to_q/k/v
  concatenated back to our in_proj; `unload_all_models()` puts the backups back before the next file.
  Keys not loaded: ComfyUI's own "lora key not loaded" log lines (captured).
* `--sd-scripts DIR`: kohya-ss/sd-scripts, branch stable-cascade (last run: 235a1ea2c6021e471bb5868446faf9693f0753a1,
  `git archive 235a1ea… library networks | tar -x -C DIR`; a whole-tree archive of the mirror stops at a binary
  it does not hold). Its `library/stable_cascade.py` StageC is built with the
  tiny config and loads cascade_nb's weights `strict=True`, the fused in_proj split into to_q/k/v as its loader does
  (`library.stable_cascade_utils.convert_state_dict_mha_to_normal_attn`, copied inline as `split_in_proj`: that module
  does not import with transformers 5, `CLIPFeatureExtractor`); the text encoder is the tiny HF CLIP itself. Then as
  its `stable_cascade_gen_img.py`: `create_network_from_weights(1.0, file, None, text_model, stage_c,
  for_inference=True)` and `network.merge_to(text_model, stage_c, weights_sd, float32, "cpu")`, with
  `--network_module networks.lora` (sd-scripts') and `lycoris.kohya` (the pip LyCORIS).

Cases (`CASES`): every adapter type on every Stage C module kind of `StageC.from_preset("tiny")` (as the suite's
fixture) and on the tiny CLIP's self_attn/mlp, tensors moved off their start; cascade_nb's ΔW is its own
`merge_lora` on copies of both. Exports: `comfyui` (`export --to kohya --for comfyui` with the base weights),
`lycoris` (`--for lycoris`, with them), `plain` (no base weights; only where it differs from `comfyui`).

Per file and consumer: keys loaded / in the file, weights patched by the consumer / by cascade_nb (non-zero ΔW, the
fused in_proj and each CLIP projection counted once; "+N" extra weights cascade_nb does not change), the max relative
ΔW error against cascade_nb (max over weights of max|ΔW_c − ΔW| / max|ΔW|, ΔW as a merge gives it, (W+ΔW)−W in
float32; a weight the consumer leaves alone counts as 0 there), stage C / CLIP separately; "crash" where the
consumer's code raised; and whether `python -m cascade_nb.lora check --for <consumer>` (`read_comfyui` /
`read_kohya` / `read_lycoris` on the same file, header and base weights) predicted it: the same ΔW (to 1e-4) or a
refusal where the consumer raised, and exit 1 (a warning, a skipped key or a refusal) exactly where the consumer is
not exact (all keys loaded, the same weights patched, error < 1e-4).

Prints one line per row and the markdown table (bench/RESULTS.md); writes nothing else but `--out FILE` (JSON).
"""
from __future__ import annotations
import argparse, copy, importlib, importlib.util, json, logging, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EVERY = [".attn", "channelwise", "depthwise", "mapper", "embedding", "clf"]
TE = ["self_attn", "mlp"]
# case: (adapter, options, Stage C module filters) — the suite's (tests/test_consumers_real.py), plus the CLIP's
CASES = {"lora": ("lora", {}, EVERY), "dora": ("dora", {}, EVERY), "loha": ("loha", {}, EVERY),
         "lokr": ("lokr", {}, EVERY), "lokr_full_matrix": ("lokr", {"full_matrix": True}, EVERY),
         "lokr_decompose_both": ("lokr", {"decompose_both": True, "lokr_factor": 4}, EVERY),
         "oft": ("oft", {"oft_block_size": 4}, [".attn", "channelwise", "mapper", "clf"]),
         "oft_block_32": ("oft", {"oft_block_size": 32}, [".attn"]),
         "oft_rescale": ("oft", {"oft_block_size": 4, "oft_rescale": True}, [".attn", "mapper"]),
         "oft_constraint": ("oft", {"oft_block_size": 4, "oft_constraint": 1e-3}, [".attn", "mapper"])}
CONSUMERS = ("comfyui", "kohya", "lycoris")   # ComfyUI; sd-scripts with networks.lora; with lycoris.kohya
TOL = 1e-4
_QKV = ("to_q", "to_k", "to_v")


class Log(logging.Handler):
    "Every log line at WARNING and above while a consumer loads (ComfyUI's 'lora key not loaded', its errors)."
    def __init__(self): super().__init__(logging.WARNING); self.lines = []
    def emit(self, record): self.lines.append(record.getMessage())


_TRANSFORMS_STUB = '''"stub: sd-scripts' stable_cascade.py builds its EfficientNet preprocessing at import"
class _Unused:
    def __init__(self, *args, **kwargs): pass
    def __call__(self, *args, **kwargs): raise NotImplementedError("torchvision stub")
Compose = Normalize = ToTensor = _Unused
'''

def stub_torchvision(work: Path):
    """A stub torchvision where none is installed: ComfyUI and sd-scripts import it at the top (sd-scripts' StageC
    module builds `transforms.Compose([transforms.Normalize(...)])` at import); the LoRA path never calls it."""
    import transformers.image_utils  # noqa: F401  (transformers decides at import whether torchvision is there)
    if importlib.util.find_spec("torchvision") is not None: return False
    stub = work / "stubs" / "torchvision"
    (stub / "transforms").mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text('"stub"\nfrom . import transforms  # noqa\n')
    (stub / "transforms" / "__init__.py").write_text(_TRANSFORMS_STUB)
    sys.path.append(str(work / "stubs"))
    return True


# --- the trained adapters and cascade_nb's ΔW ---------------------------------------------------------------------

def trained(cases) -> dict:
    "{case: (Stage C base, CLIP base, LoRA state dict (Stage C + text encoder), cascade_nb's ΔW {our param: ΔW})}."
    import torch
    from cascade_nb.models.stage_c import StageC
    from cascade_nb.models.clip import tiny_clip_text_model
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict, merge_lora, adapter_entries
    from cascade_nb.lora_converters import text_encoder_state_dict
    torch.manual_seed(0)
    base, text, out = StageC.from_preset("tiny"), tiny_clip_text_model(), {}
    for case in cases:
        kind, opts, filters = CASES[case]
        model, te = copy.deepcopy(base), copy.deepcopy(text)
        apply_lora(model, filters, rank=4, alpha=2.0, adapter=kind, options=opts)
        apply_lora(te, TE, rank=4, alpha=2.0, adapter=kind, options=opts)
        with torch.no_grad():
            for m in (model, te):
                for layer in lora_layers(m).values():
                    for t in layer.tensors().values(): t.add_(torch.randn(t.shape) * 0.05)
        lora, te_lora = lora_state_dict(model), lora_state_dict(te)
        merged, merged_te = merge_lora(copy.deepcopy(base), lora), merge_lora(copy.deepcopy(text), te_lora)
        want = {p: merged.get_parameter(p).detach() - base.get_parameter(p).detach() for p in adapter_entries(lora)}
        want.update({f"text_encoder.{p}": merged_te.get_parameter(p).detach() - text.get_parameter(p).detach()
                     for p in adapter_entries(te_lora)})
        out[case] = base, text, {**lora, **text_encoder_state_dict(te)}, want
    return out


def params_of(base, text) -> dict:
    "Our parameter path → base tensor (Stage C, and the CLIP under `text_encoder.`): what ΔW is measured on."
    from cascade_nb.adapter_readers import consumer_params
    return consumer_params(base, text)


def fuse(sd: dict, prefix: str = "") -> dict:
    "A to_q/to_k/to_v state dict (ComfyUI's, kohya's) in our names: each attention's three as one in_proj, `prefix`."
    import torch
    out, parts = {}, {}
    for k, v in sd.items():
        mod, _, leaf = k.rpartition(".")
        head, _, part = mod.rpartition(".")
        if part in _QKV and head.endswith("attention.attn"):
            parts.setdefault(f"{head}.in_proj_{leaf}", {})[part] = v
        else: out[prefix + k] = v
    out.update({prefix + k: torch.cat([p[q] for q in _QKV]) for k, p in parts.items()})
    return out


def split_in_proj(sd: dict) -> dict:
    """sd-scripts' `convert_state_dict_mha_to_normal_attn` (library/stable_cascade_utils.py, 235a1ea), inline: that
    module does not import with transformers 5. Each `attention.attn.in_proj_weight/bias` as to_q/to_k/to_v."""
    import torch
    out = {}
    for key, value in sd.items():
        if "attention.attn." in key and "in_proj_" in key:
            leaf = "bias" if key.endswith("in_proj_bias") else "weight"
            for part, v in zip(_QKV, torch.chunk(value, 3, dim=0)):
                out[key.replace(f"in_proj_{leaf}", f"{part}.{leaf}")] = v
        else: out[key] = value
    return out


def deltas(before: dict, after: dict) -> dict:
    "ΔW of every tensor a consumer changed, float32."
    import torch
    return {k: after[k].float() - before[k].float() for k in before if not torch.equal(after[k], before[k])}


# --- ComfyUI ------------------------------------------------------------------------------------------------------

def import_comfyui(path: Path):
    "ComfyUI from checkout `path`, --cpu where there is no GPU; its Stage C detection given the tiny sizes."
    import torch
    from cascade_nb.models.stage_c import StageC
    sys.path.insert(0, str(path))
    import comfy.cli_args
    if not torch.cuda.is_available(): comfy.cli_args.args.cpu = True
    import comfy.sd, comfy.model_detection, comfy.supported_models, comfy.model_management  # noqa: F401
    with torch.device("meta"): tiny = StageC.from_preset("tiny").config
    tiny = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
            for k, v in tiny.items() if k != "self_attn"}
    detect = comfy.model_detection.detect_unet_config

    def detect_tiny(state_dict, key_prefix, metadata=None):
        config = detect(state_dict, key_prefix, metadata=metadata)
        if (config or {}).get("stable_cascade_stage") == "c" and "c_cond" not in config:   # a width it does not know
            return {**config, **tiny}
        return config
    comfy.model_detection.detect_unet_config = detect_tiny
    return comfy


class ComfyUI:
    "ComfyUI's Stage C and CLIP-G of the tiny model, and its LoraLoader's code on a file."
    def __init__(self, comfy, base, text):
        import torch
        self.comfy = comfy
        self.model = comfy.sd.load_diffusion_model_state_dict(
            {k: v.detach().clone() for k, v in base.state_dict().items()}, model_options={"dtype": torch.float32})
        c = text.config
        opts = {"dtype": torch.float32, "clip_g_model_config": dict(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads, projection_dim=c.projection_dim)}
        target = comfy.supported_models.Stable_Cascade_C({"stable_cascade_stage": "c"}).clip_target()
        self.clip = comfy.sd.CLIP(target, model_options=opts)
        missing, unexpected = self.clip.load_sd({k: v.detach().clone() for k, v in text.state_dict().items()})
        # ComfyUI's CLIP keeps no position_ids buffer and adds its own logit_scale: nothing else may differ
        assert not [k for k in missing if "logit_scale" not in k], missing
        assert not [k for k in unexpected if "position_ids" not in k], unexpected

    def state(self) -> dict:
        unet = fuse(self.model.model.diffusion_model.state_dict())
        te = {k.removeprefix("clip_g.transformer."): v for k, v in self.clip.cond_stage_model.state_dict().items()
              if k.startswith("clip_g.transformer.")}
        return {**{k: v.clone() for k, v in unet.items()}, **{f"text_encoder.{k}": v.clone() for k, v in te.items()}}

    def read(self, path: Path) -> dict:
        comfy, log = self.comfy, Log()
        lora = comfy.utils.load_torch_file(str(path), safe_load=True)
        before = self.state()
        root = logging.getLogger()
        root.addHandler(log)
        try:
            model, clip = comfy.sd.load_lora_for_models(self.model, self.clip, lora, 1.0, 1.0)
            # what a sampler / CLIPTextEncode does before running them: load the patchers, which patches the weights
            comfy.model_management.load_models_gpu([model, clip.patcher], force_full_load=True)
            after = self.state()
        finally:
            root.removeHandler(log)
            comfy.model_management.unload_all_models()    # unpatches: the weights go back to their backups
        assert all(v.equal(before[k]) for k, v in self.state().items())   # unpatched: the next file starts clean
        not_loaded = [x for x in log.lines if x.startswith("lora key not loaded")]
        other = [x for x in log.lines if x not in not_loaded]
        return dict(deltas=deltas(before, after), keys=len(lora), loaded=len(lora) - len(not_loaded),
                    log=other[:5])


# --- kohya sd-scripts ---------------------------------------------------------------------------------------------

class Kohya:
    "sd-scripts' StageC (tiny) with cascade_nb's weights and the tiny CLIP, fresh per file; a network module's merge."
    def __init__(self, path: Path, base, text):
        sys.path.insert(0, str(path))
        import library.stable_cascade as sc
        self.sc, self.base, self.text = sc, base, text
        # sd-scripts' loggers print every module at INFO
        logging.getLogger("networks.lora").setLevel(logging.WARNING)
        logging.getLogger("LyCORIS").setLevel(logging.ERROR)

    def fresh(self):
        cfg = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
               for k, v in self.base.config.items() if k != "self_attn"}
        stage_c = self.sc.StageC(**cfg, self_attn=all(self.base.config["self_attn"]))
        stage_c.load_state_dict(split_in_proj({k: v.detach().clone() for k, v in self.base.state_dict().items()}),
                                strict=True)
        return stage_c.eval(), copy.deepcopy(self.text)

    @staticmethod
    def state(stage_c, text) -> dict:
        return {**{k: v.clone() for k, v in fuse(stage_c.state_dict()).items()},
                **{f"text_encoder.{k}": v.clone() for k, v in text.state_dict().items()}}

    def read(self, path: Path, module: str) -> dict:
        import torch
        from safetensors.torch import load_file
        net_module = importlib.import_module(module)
        stage_c, text = self.fresh()
        before, sd = self.state(stage_c, text), load_file(str(path))
        log = Log(); logging.getLogger().addHandler(log)
        try:
            network, weights_sd = net_module.create_network_from_weights(1.0, str(path), None, text, stage_c,
                                                                         weights_sd=sd, for_inference=True)
            assert network.is_mergeable()
            network.merge_to(text, stage_c, weights_sd, torch.float32, "cpu")
        finally: logging.getLogger().removeHandler(log)
        names = [m.lora_name for m in network.text_encoder_loras + network.unet_loras]
        if module == "networks.lora":   # LoRAInfModule.merge_to reads these three, nothing else
            used = {f"{n}.{s}" for n in names for s in ("lora_down.weight", "lora_up.weight", "alpha")}
        else: used = {k for k in sd for n in names if k.startswith(n + ".")}
        return dict(deltas=deltas(before, self.state(stage_c, text)), keys=len(sd),
                    loaded=len(used & set(sd)), log=log.lines[:5])


# --- the comparison -----------------------------------------------------------------------------------------------

def merged(params: dict, d: dict) -> dict:
    "ΔW as a merge gives it: (W + ΔW) − W in float32."
    return {p: (params[p].detach().float() + w.reshape(params[p].shape)) - params[p].detach().float()
            for p, w in d.items()}


def rel_error(got: dict, want: dict, side=None) -> float | None:
    """max over weights of max|got − want| / max|want| (a weight one side leaves alone: zero there); `side`: 'te' for
    the CLIP's weights only, 'c' for the Stage C's. None where `want` has no non-zero weight on that side."""
    import torch
    keys = [p for p, w in want.items() if float(w.abs().max()) > 0
            and (side is None or (side == "te") == p.startswith("text_encoder."))]
    if not keys: return None
    return max(float((got.get(p, torch.zeros_like(want[p])) - want[p]).abs().max() / want[p].abs().max())
               for p in keys)


def nonzero(d: dict) -> set:
    return {p for p, w in d.items() if float(w.abs().max()) > 0 and not p.endswith("bias")}


def check(path: Path, consumer: str, params: dict):
    "What `python -m cascade_nb.lora check FILE --for CONSUMER --model …` says: its Reading, and its exit status."
    from safetensors.torch import load_file
    from cascade_nb.core import safetensors_header
    from cascade_nb.adapter_readers import read_comfyui, read_kohya, read_lycoris
    reader = {"comfyui": read_comfyui, "kohya": read_kohya, "lycoris": read_lycoris}[consumer]
    rd = reader(load_file(str(path)), params, safetensors_header(path)[0])
    return rd, int(bool(rd.warnings or rd.refused or rd.skipped))


def measure(case, export, consumer, path, reader_fn, params, want) -> dict:
    "One row: the consumer on the file against cascade_nb's ΔW, and against `check`'s prediction."
    row = dict(case=case, export=export, consumer=consumer)
    rd, exit_status = check(path, consumer, params)
    row.update(check_exit=exit_status, check_refused=rd.refused, check_warning=rd.warnings[0][:200] if rd.warnings
               else None, check_loaded=len(rd.loaded))
    try: got = reader_fn(path)
    except Exception as e:   # the consumer's own code failed on the file
        row.update(crash=f"{type(e).__name__}: {' '.join(str(e).split())[:160]}", exact=False)
        row["check_agrees"] = rd.refused
        return row
    d = merged(params, {p: w for p, w in got.pop("deltas").items() if p in params})
    ours = merged(params, want)
    patched, trained_ = nonzero(d), nonzero(ours)
    row.update(got, crash=None, patched=len(patched & trained_), patched_extra=len(patched - trained_),
               trained=len(trained_), err_c=rel_error(d, ours, "c"), err_te=rel_error(d, ours, "te"))
    errs = [e for e in (row["err_c"], row["err_te"]) if e is not None]
    row["exact"] = (row["loaded"] == row["keys"] and patched == trained_ and max(errs) < TOL)
    said = merged(params, {p: w for p, w in rd.deltas.items() if p in params})
    e = rel_error(d, said)
    same = not rd.refused and nonzero(d) == nonzero(said) and (e is None or e < TOL)
    row.update(check_same_dw=same, check_vs_consumer=e)
    row["check_agrees"] = bool(same and exit_status == (0 if row["exact"] else 1))
    return row


def fmt(e) -> str:
    return "–" if e is None else "0" if e == 0 else f"{e:.1e}"


def line(r: dict) -> str:
    head = f"consumers {r['case']} {r['export']} {r['consumer']}: "
    agrees = f"check agrees {'yes' if r['check_agrees'] else 'no'} (exit {r['check_exit']})"
    if r["crash"]: return head + f"CRASH {r['crash']}; {agrees}"
    return head + (f"loaded {r['loaded']}/{r['keys']}, patched {r['patched']}/{r['trained']}"
                   + (f"+{r['patched_extra']}" if r["patched_extra"] else "")
                   + f", rel err {fmt(r['err_c'])} (C) {fmt(r['err_te'])} (CLIP), {agrees}")


def table(rows: list[dict], header: str) -> str:
    out = [header, "", "| case | export | consumer | keys loaded | weights patched | rel. error C / CLIP | "
                       "`check` exit | check agrees |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["consumer"] == "(export)":
            out.append(f"| {r['case']} | {r['export']} | – | the export refuses: {r['crash'][16:120]} | | | – | – |")
            continue
        if r["crash"]: cells = ["**crash**", "–", r["crash"][:90].replace("|", "/")]
        else:
            cells = [f"{r['loaded']}/{r['keys']}", f"{r['patched']}/{r['trained']}"
                     + (f" +{r['patched_extra']}" if r["patched_extra"] else ""),
                     f"{fmt(r['err_c'])} / {fmt(r['err_te'])}"]
        out.append(f"| {r['case']} | {r['export']} | {r['consumer']} | " + " | ".join(cells)
                   + f" | {r['check_exit']} | {'yes' if r['check_agrees'] else '**no**'} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", required=True, type=Path, help="a ComfyUI checkout")
    p.add_argument("--sd-scripts", required=True, type=Path, help="kohya-ss/sd-scripts, stable-cascade branch")
    p.add_argument("--deps", type=Path, help="a folder with ComfyUI's extra dependencies (put on sys.path)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--exports", nargs="+", default=["comfyui", "lycoris", "plain"])
    p.add_argument("--consumers", nargs="+", default=list(CONSUMERS), choices=CONSUMERS)
    p.add_argument("--out", type=Path, help="write the rows and the table as JSON here")
    a = p.parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from cascade_nb.adapter_exports import export_adapter
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    if a.deps: sys.path.insert(0, str(a.deps.resolve()))
    work = Path(tempfile.mkdtemp(prefix="consumers_"))
    stub_torchvision(work)
    comfy = import_comfyui(a.comfyui.resolve()) if "comfyui" in a.consumers else None
    cases, rows = trained(a.cases), []
    base, text = next(iter(cases.values()))[:2]
    comfyui = ComfyUI(comfy, base, text) if comfy else None
    kohya = Kohya(a.sd_scripts.resolve(), base, text) if {"kohya", "lycoris"} & set(a.consumers) else None
    readers = {"comfyui": lambda f: comfyui.read(f), "kohya": lambda f: kohya.read(f, "networks.lora"),
               "lycoris": lambda f: kohya.read(f, "lycoris.kohya")}
    params = params_of(base, text)
    same = []
    for case, (base, text, lora, want) in cases.items():
        files = {}
        for export in a.exports:
            path = work / f"{case}_{export}.safetensors"
            try:
                if export == "plain": export_adapter(lora, "kohya", path)
                else: export_adapter(lora, "kohya", path, base, text_model=text, reader=export)
            except Exception as e:
                print(f"consumers {case} {export}: export refused: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(case=case, export=export, consumer="(export)", crash=f"export refused: {e}"[:160],
                                 check_agrees=True, check_exit=1))
                continue
            sd = load_file(str(path))
            if export == "plain" and "comfyui" in files and sd.keys() == files["comfyui"].keys() and all(
                    torch.equal(v, files["comfyui"][k]) for k, v in sd.items()):
                print(f"consumers {case} plain: the same tensors as the comfyui export", flush=True)
                same.append(case); continue
            files[export] = sd
            for consumer in a.consumers:
                rows.append(measure(case, export, consumer, path, readers[consumer], params, want))
                print(line(rows[-1]), flush=True)
    seconds = time.perf_counter() - t0
    header = (f"{len(rows)} rows in {seconds:.0f} s. Keys loaded / in the file; weights patched (of those cascade_nb's "
              "ΔW changes; +N: others); relative ΔW error vs cascade_nb's merge_lora, Stage C / CLIP; `check --for` "
              "exit status; check agrees: the same ΔW (or a refusal where the consumer crashed) and exit 1 exactly "
              "where the consumer is not exact. Consumers: comfyui = ComfyUI's LoraLoader code; kohya = sd-scripts "
              "with networks.lora; lycoris = sd-scripts with lycoris.kohya. The plain export (no base weights) is "
              f"the same file as the comfyui one for {', '.join(same) or 'none'}; check agrees on "
              f"{sum(bool(r['check_agrees']) for r in rows if r['consumer'] != '(export)')} of "
              f"{sum(r['consumer'] != '(export)' for r in rows)} rows.")
    print(table(rows, header))
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "table": table(rows, header), "seconds": seconds,
                                     "torch": torch.__version__}, indent=1, default=str) + "\n")


if __name__ == "__main__": main()
