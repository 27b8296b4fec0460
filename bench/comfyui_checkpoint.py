"""ComfyUI's own checkpoint loader on cascade_nb's single-file export (issue 49).

    python bench/comfyui_checkpoint.py --comfyui PATH [--sizes tiny,lite] [--dtype bfloat16|float32] [--work DIR]
                                       [--commit SHA]

PATH is a ComfyUI checkout the user fetched (https://github.com/comfyanonymous/ComfyUI); ComfyUI is not on the package
registries, so this is a bench, not a test. Its Python dependencies must be importable (e.g. `pip install --target DIR
torchsde scipy kornia spandrel sentencepiece av` and DIR on PYTHONPATH); where torchvision is not installed (no CPU
wheel for this torch), an empty `torchvision` package is put on the path: ComfyUI imports it at module level for the
EfficientNet of its Stage C coder and ControlNet, which the checkpoint loader never builds. Without a GPU ComfyUI runs
with `args.cpu` (its `--cpu`).

For each run it writes the file with the command as a user runs it (`python -m cascade_nb.export RUN --to
comfyui-checkpoint --out FILE`, in process), checks the file against cascade_nb's weights (the run's parts as
`cascade_nb.export.run_models` loads them, cast to the file's dtype), then loads it with
`comfy.sd.load_state_dict_guess_config` (and `comfy.sd.load_checkpoint_guess_config` on the path) and prints one
row per run: the model class ComfyUI detected, and for the diffusion model, the CLIP, the VAE and the CLIP vision
model the keys it loaded / reported missing / found unexpected, the file's keys under no prefix that model class reads
(left over), and the largest |difference| between a tensor ComfyUI holds and the file's (after ComfyUI's own key
processing: `process_unet_state_dict` splits the fused attention projections).

Runs (`--sizes`):
* `tiny`: a Stage C LoRA run trained here for 2 updates on a 2-update demo run (a new token `[emoji]`, the re-trained
  word `apple`, adapters on the text encoder: all merged by the export) and a Stage B run (tiny Stage B, random
  official-size Stage A). ComfyUI builds only the official sizes, so for these tiny files one function is patched:
  `comfy.model_detection.detect_unet_config` returns the tiny Stage C/B configuration (from the file's
  `cascade_nb.model_version`/`model_overrides` header fields) where ComfyUI's detection found Stable Cascade; and
  ComfyUI's own option `te_model_options={"clip_g_model_config": {...}}` gives its CLIP-G the tiny text model's
  sizes. Nothing else is changed.
* `lite`: random weights at the official shapes ComfyUI detects without help: Stage C 1B ("lite", c_cond 1536) with
  the bigG text encoder and the ViT-L/14 image encoder, and Stage B 700M ("lite") with the official-size Stage A
  (15 GB of memory at the peak, 10 minutes on 2 shared cores).

Results: bench/results/comfyui_checkpoint.json; bench/RESULTS.md and nbs/52_export.ipynb quote the table.
"""
from __future__ import annotations
import argparse, gc, inspect, importlib.util, json, logging, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT/"bench"/"results"/"comfyui_checkpoint.json"
# the official encoders, as transformers configs (bench/real_size.py)
BIGG_TEXT = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                 projection_dim=1280, hidden_act="gelu", vocab_size=49408, max_position_embeddings=77,
                 bos_token_id=49406, eos_token_id=49407, pad_token_id=1)
VIT_L14 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, patch_size=14,
               image_size=224, projection_dim=768, hidden_act="quick_gelu")


# --- ComfyUI ------------------------------------------------------------------------------------------------------

def import_comfyui(path: Path, work: Path):
    "Import ComfyUI's loader from checkout `path` (CPU where there is no GPU; a torchvision stub where it is missing)."
    import torch
    # transformers decides once, at its import, whether torchvision is there: before the stub, it is not
    import transformers.image_utils  # noqa: F401
    sys.path.insert(0, str(path))
    if importlib.util.find_spec("torchvision") is None:
        stub = work/"stubs"/"torchvision"
        (stub/"transforms").mkdir(parents=True, exist_ok=True)
        for f in (stub/"__init__.py", stub/"transforms"/"__init__.py"):
            f.write_text('"Stub: the checkpoint loader never builds what ComfyUI imports torchvision for."\n')
        sys.path.append(str(work/"stubs"))
        print("torchvision is not installed: an empty stub package stands in for it")
    import comfy.cli_args
    if not torch.cuda.is_available(): comfy.cli_args.args.cpu = True
    import comfy.sd, comfy.utils, comfy.model_detection   # noqa: F401
    return comfy


def comfyui_commit(path: Path, given: str | None) -> str:
    if given: return given
    try: return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError): return "unknown (pass --commit)"


def let_comfyui_build_tiny_sizes(comfy):
    """The one patch, for the tiny files only: `detect_unet_config` returns the tiny Stage C/B configuration (the
    file's `cascade_nb.model_version` and `model_overrides`) where ComfyUI found Stable Cascade of a size it does not
    build; official-size files are detected by ComfyUI's code alone."""
    import torch
    from cascade_nb.models.stage_b import StageB
    from cascade_nb.models.stage_c import StageC
    from comfy.ldm.cascade.stage_b import StageB as ComfyB
    from comfy.ldm.cascade.stage_c import StageC as ComfyC
    detect = comfy.model_detection.detect_unet_config

    def tiny_detect(state_dict, key_prefix, metadata=None):
        config = detect(state_dict, key_prefix, metadata=metadata)
        meta = metadata or {}
        stage = (config or {}).get("stable_cascade_stage")
        if stage is None or meta.get("cascade_nb.model_version") != "tiny": return config
        ours, theirs = (StageC, ComfyC) if stage == "c" else (StageB, ComfyB)
        overrides = json.loads(meta["cascade_nb.model_overrides"])
        with torch.device("meta"): full = ours.from_preset("tiny", **overrides).config
        takes = inspect.signature(theirs.__init__).parameters
        tiny = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
                for k, v in full.items() if k in takes and k != "self_attn"}
        return {**config, **tiny}
    comfy.model_detection.detect_unet_config = tiny_detect


class Warnings(logging.Handler):
    "ComfyUI's warnings while it loads (`unet missing`, `clip missing`, ...)."
    def __init__(self): super().__init__(logging.WARNING); self.lines = []
    def emit(self, record): self.lines.append(record.getMessage()[:300])


# --- the runs -----------------------------------------------------------------------------------------------------

def random_file(meta_sd: dict, path: Path, dtype, seed: int = 0, metadata=None):
    "Random tensors (N(0, 0.02²); integer buffers zero) with the names and shapes of `meta_sd`, as safetensors."
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    out = {k: (torch.randn(v.shape, generator=g).mul_(0.02).to(dtype) if v.is_floating_point()
               else torch.zeros(v.shape, dtype=v.dtype)) for k, v in meta_sd.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata=metadata)


def random_clip(kind: str, config: dict, folder: Path, dtype):
    "A transformers CLIP text or vision model folder (config.json, model.safetensors) with random weights."
    import torch
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPVisionConfig,
                              CLIPVisionModelWithProjection)
    cfg_cls, cls = ((CLIPTextConfig, CLIPTextModelWithProjection) if kind == "text"
                    else (CLIPVisionConfig, CLIPVisionModelWithProjection))
    cfg = cfg_cls(**config)
    cfg.save_pretrained(folder)
    with torch.device("meta"): sd = cls(cfg).state_dict()
    random_file(sd, folder/"model.safetensors", dtype, metadata={"format": "pt"})


def fake_run(folder: Path, overrides: list[str], generator_file_writer) -> Path:
    "A run directory: info.json with the demo config and `overrides`, and a released generator.safetensors."
    from cascade_nb.config import load_config
    folder.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ROOT/"configs"/"demo.yaml", [f"webdataset_path={ROOT/'data_samples'/'emoji'}",
                                                   f"experiment_id={folder.name}", *overrides])
    (folder/"info.json").write_text(json.dumps({"config": cfg.to_yaml_dict(), "update": 2}))
    generator_file_writer(cfg, folder/"generator.safetensors")
    return folder


def generator_writer(cfg, path):
    "The run's generator with random weights at its config's size, in the run's dtype."
    import torch
    from cascade_nb.core import resolve_dtype
    from cascade_nb.models.stage_b import StageB
    from cascade_nb.models.stage_c import StageC
    cls = StageC if cfg.model.stage == "c" else StageB
    with torch.device("meta"): sd = cls.from_preset(cfg.model.model_version, **cfg.model.model_overrides).state_dict()
    random_file(sd, path, resolve_dtype(cfg.model.dtype))


def official_stage_a(path: Path) -> Path:
    import torch
    from cascade_nb.models.stage_a import StageA
    if not path.exists():
        with torch.device("meta"): sd = StageA.from_preset("official").state_dict()
        random_file(sd, path, torch.float32, seed=1)
    return path


def tiny_runs(work: Path) -> list[tuple[str, Path]]:
    "A 2-update demo run, a LoRA run on it (new token, re-trained word, text-encoder adapters), a tiny Stage B run."
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    common = [f"checkpoint_path={work}/ck", f"output_path={work}/out", "updates=2", "save_every=2", "num_workers=0",
              "batch_size=4", "tracker=none"]
    demo = Path(train(load_config(ROOT/"configs"/"demo.yaml", [
        *common, f"webdataset_path={ROOT/'data_samples'/'emoji'}", "ema_start_iters=1"]))["run_dir"])
    lora = Path(train(load_config(ROOT/"configs"/"lora_demo.yaml", [
        *common, f"webdataset_path=[{{path: {ROOT/'data_samples'/'emoji'}, caption_prefix: '[emoji] apple '}}]",
        "lr=1e-2", f"generator_checkpoint_path={demo}/generator_ema.safetensors", "text_encoder_adapter=lora",
        "train_tokens=[['[emoji]', '^face</w>'], ['^apple</w>$', null]]"]))["run_dir"])
    stage_b = fake_run(work/"ck"/"tiny_b", ["stage=b", "model_version=tiny", "model_overrides={}",
                                           f"stage_a_checkpoint_path={official_stage_a(work/'stage_a.safetensors')}",
                                           "effnet_checkpoint_path=tiny", "latent_space=effnet"], generator_writer)
    return [("tiny Stage C (LoRA run)", lora), ("tiny Stage B", stage_b)]


def lite_runs(work: Path) -> list[tuple[str, Path]]:
    "Random weights at the official shapes: Stage C 1B with bigG and ViT-L/14, Stage B 700M with Stage A."
    import torch
    from cascade_nb.models.clip import sample_tokenizer_dir
    text, image = work/"clip_text_bigG", work/"clip_image_vitl14"
    if not (text/"model.safetensors").exists(): random_clip("text", BIGG_TEXT, text, torch.bfloat16)
    if not (image/"model.safetensors").exists(): random_clip("image", VIT_L14, image, torch.bfloat16)
    stage_c = fake_run(work/"ck"/"lite_c", ["model_version=1B", "model_overrides={}", "dtype=bfloat16",
                                           f"clip_text_model_name={text}", f"tokenizer_path={sample_tokenizer_dir()}",
                                           f"clip_image_model_name={image}", "image_embed_prob=0.1",
                                           "latent_space=effnet", "effnet_checkpoint_path=tiny"], generator_writer)
    stage_b = fake_run(work/"ck"/"lite_b", ["stage=b", "model_version=700M", "model_overrides={}", "dtype=bfloat16",
                                           f"stage_a_checkpoint_path={official_stage_a(work/'stage_a.safetensors')}",
                                           "effnet_checkpoint_path=tiny", "latent_space=effnet"], generator_writer)
    return [("Stage C 1B lite + bigG + ViT-L", stage_c), ("Stage B 700M lite + Stage A", stage_b)]


# --- the checks ---------------------------------------------------------------------------------------------------

def export(run: Path, out: Path, dtype: str) -> tuple[float, str]:
    "The command as a user runs it; (seconds, its stderr warnings)."
    import contextlib, io
    from cascade_nb.export import main
    err, t0 = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err):
        main([str(run), "--to", "comfyui-checkpoint", "--out", str(out), "--dtype", dtype, "--overwrite"])
    # its warnings (transformers' progress bars share stderr)
    return time.perf_counter() - t0, " ".join(x for x in err.getvalue().splitlines() if x.startswith("warning:"))


def file_vs_cascade_nb(run: Path, path: Path, dtype) -> dict:
    "Per part: tensors and the largest |file - cascade_nb's weight cast to the file's dtype| (the run's own loader)."
    from safetensors import safe_open
    from cascade_nb.export import COMFYUI_CHECKPOINT, run_models
    models = run_models(run)
    prefixes = COMFYUI_CHECKPOINT.parts(models.cfg.model.stage)
    out = {}
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        for part, sd in models.state_dicts().items():
            if sd is None: continue
            diffs = [(f.get_tensor(prefixes[part] + k).float() - v.to(dtype).float()).abs().max().item()
                     if v.is_floating_point() and v.numel() else 0.0 for k, v in sd.items()]
            out[part] = {"tensors": len(sd), "in_file": sum(prefixes[part] + k in keys for k in sd),
                         "max_abs_diff": max(diffs)}
    del models; gc.collect()
    return out


def compare(theirs: dict, ours: dict) -> dict:
    "Loaded / missing / unexpected keys of a model that loaded `ours` (strict=False), and max |theirs - ours|."
    loaded = sorted(set(theirs) & set(ours))
    diff = max([(theirs[k].float() - ours[k].float()).abs().max().item() for k in loaded if ours[k].numel()] or [0.])
    return {"loaded": len(loaded), "missing": sorted(set(theirs) - set(ours)),
            "unexpected": sorted(set(ours) - set(theirs)), "max_abs_diff": diff,
            "dtypes": sorted({str(theirs[k].dtype).removeprefix("torch.") for k in loaded})}


def file_part(path: Path, prefix: str, strip: bool = True) -> dict:
    "The file's tensors under `prefix` (without it, with `strip`)."
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return {k[len(prefix) if strip else 0:]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def comfyui_reading(comfy, path: Path, te_options: dict) -> dict:
    "What `load_state_dict_guess_config` makes of the file: classes, per model the key counts and max |Δ|."
    sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    keys = list(sd)
    handler = Warnings(); logging.getLogger().addHandler(handler)
    try:
        model, clip, vae, vision = comfy.sd.load_state_dict_guess_config(
            sd, output_clipvision=True, metadata=metadata, te_model_options=te_options)
    finally: logging.getLogger().removeHandler(handler)
    comfy_left = len(sd); del sd; gc.collect()
    config = model.model.model_config
    prefix = comfy.model_detection.unet_prefix_from_state_dict(dict.fromkeys(keys))
    unet = config.process_unet_state_dict(file_part(path, prefix))
    size = {k: v for k, v in config.unet_config.items() if k in ("stable_cascade_stage", "c_cond", "c_hidden")}
    row = {"model_class": type(config).__name__, "unet_config": size,
           "model": compare(model.model.diffusion_model.state_dict(), unet), "warnings": handler.lines,
           "comfyui_left_over_log": comfy_left}
    read = [prefix]
    del unet
    if clip is not None:
        # ComfyUI's own step from the checkpoint's keys to its CLIP's (it takes off the prefix)
        text = config.process_clip_state_dict(file_part(path, config.text_encoder_key_prefix[0], strip=False))
        row["clip"] = {"class": type(clip.cond_stage_model).__name__,
                       **compare(clip.cond_stage_model.state_dict(), text)}
    read += config.text_encoder_key_prefix
    if vae is not None and vae.first_stage_model is not None and config.vae_key_prefix:
        row["vae"] = {"class": type(vae.first_stage_model).__name__,
                      **compare(vae.first_stage_model.state_dict(), file_part(path, config.vae_key_prefix[0]))}
    read += config.vae_key_prefix
    if config.clip_vision_prefix:
        read.append(config.clip_vision_prefix)
        if vision is not None:
            row["clip_vision"] = {"class": type(vision.model).__name__,
                                  **compare(vision.model.state_dict(), file_part(path, config.clip_vision_prefix))}
    row["left_over"] = [k for k in keys if not k.startswith(tuple(read))]
    del model, clip, vae, vision; gc.collect()
    # and the loader a workflow's "Load Checkpoint" node calls, on the path
    model, *_ = comfy.sd.load_checkpoint_guess_config(str(path), output_clipvision=True, te_model_options=te_options)
    row["load_checkpoint_guess_config"] = type(model.model.model_config).__name__
    del model; gc.collect()
    return row


def cell(r: dict | None) -> str:
    "loaded / missing / unexpected, max |ComfyUI's tensor - the file's|."
    if r is None: return "—"
    diff = f"{r['max_abs_diff']:.0e}" if r["max_abs_diff"] else "0"
    return f"{r['loaded']} / {len(r['missing'])} / {len(r['unexpected'])}, {diff}"


def detected(c: dict) -> str:
    "The class ComfyUI detected and the size it built (both loaders, or the second's class where it differs)."
    u = c["unet_config"]
    size = f"c_cond {u['c_cond']}" if u["stable_cascade_stage"] == "c" else f"width {u['c_hidden'][1]}"
    same = c["load_checkpoint_guess_config"] == c["model_class"]
    return f"{c['model_class']}, {size}" + ("" if same else f"; the path loader: {c['load_checkpoint_guess_config']}")


def table(rows: list[dict], commit: str) -> str:
    "The bench's table (markdown)."
    lines = [f"ComfyUI {commit}. Per model: keys ComfyUI loaded / reported missing / found unexpected, and the largest "
             "|ComfyUI's tensor − the file's|; left over: the file's keys under no prefix the detected class reads; "
             "file − cascade_nb: the largest |the file's tensor − cascade_nb's weight in the file's dtype|.", "",
             "| run | file | ComfyUI detects | diffusion model | CLIP | VAE | CLIP vision | left over | "
             "file − cascade_nb |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["comfyui"]
        ours = max(p["max_abs_diff"] for p in r["file_vs_cascade_nb"].values())
        lines.append(f"| {r['run']} | {r['dtype']}, {r['file_gb']:.2f} GB | {detected(c)} | {cell(c['model'])} | "
                     f"{cell(c.get('clip'))} | {cell(c.get('vae'))} | {cell(c.get('clip_vision'))} | "
                     f"{len(c['left_over'])} | {f'{ours:.0e}' if ours else '0'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", required=True, type=Path, help="a ComfyUI checkout")
    p.add_argument("--commit", help="its commit, where PATH is not a git checkout")
    p.add_argument("--sizes", default="tiny,lite", help="tiny, lite or both (default)")
    p.add_argument("--dtype", default="bfloat16", help="the export's dtype (default bfloat16)")
    p.add_argument("--work", type=Path, help="folder for the runs and files (default: a temporary one)")
    a = p.parse_args(argv)
    import torch
    from cascade_nb.core import resolve_dtype
    work = a.work or Path(tempfile.mkdtemp(prefix="comfyui_checkpoint_"))
    work.mkdir(parents=True, exist_ok=True)
    comfy, commit = import_comfyui(a.comfyui.resolve(), work), comfyui_commit(a.comfyui, a.commit)
    sizes = a.sizes.split(",")
    if "tiny" in sizes: let_comfyui_build_tiny_sizes(comfy)
    rows = []
    tiny_clip = {"clip_g_model_config": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=2, projection_dim=64)}
    for size in sizes:
        for label, run in (tiny_runs if size == "tiny" else lite_runs)(work/size):
            out = work/f"{run.name}.safetensors"
            seconds, warned = export(run, out, a.dtype)
            print(f"{label}: exported in {seconds:.1f} s" + (f"; {warned}" if warned else ""), flush=True)
            ours = file_vs_cascade_nb(run, out, resolve_dtype(a.dtype))
            row = {"run": label, "dtype": a.dtype, "file_gb": out.stat().st_size / 1e9, "export_s": seconds,
                   "export_warnings": warned, "file_vs_cascade_nb": ours}
            row["comfyui"] = comfyui_reading(comfy, out, tiny_clip if size == "tiny" else {})
            rows.append(row)
            print(json.dumps(row["comfyui"], default=str)[:2000], flush=True)
            out.unlink(); gc.collect()
    print(table(rows, commit))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"comfyui_commit": commit, "torch": torch.__version__, "rows": rows,
                                   "table": table(rows, commit)}, indent=1, default=str) + "\n")


if __name__ == "__main__": main()
