"""Real size without a GPU: a rehearsal of the official Stable Cascade runs on this CPU machine (issue 30).

    python bench/real_size.py [--work DIR] [--steps write,load,lora,full_1b,fsdp,generate,attribute]
                              [--scale official|tiny] [--only NAMES]

Every other test and benchmark runs tiny models. This one writes random weights with the official shapes, key names
and file names (Stage C 3.6B and 1B, Stage B, Stage A, EfficientNet, Previewer, the CLIP text and image encoders,
the tokenizer) into a local hub-style cache (`models--stabilityai--stable-cascade/snapshots/<commit>/`), points
`HF_HUB_CACHE` at it with `HF_HUB_OFFLINE=1`, and then runs what a user with the official weights runs, through the
same commands (`hf://stabilityai/stable-cascade/...` ids, `python -m cascade_nb.launch`, `.sample`, `.generate`,
`.memory`):

1. `load`: each stage loaded from the cache (wall time, peak resident memory against the file and the model).
2. `lora`: the official `finetune_c_3b_lora.yaml`, 2 updates, save, SIGTERM, resume, 1 more update, the LoRA
   export, a sample through the sample CLI; time per update, checkpoint size and save time, peak memory against
   `python -m cascade_nb.memory` for the same config.
3. `full_1b`: the official `finetune_c_1b.yaml` as a full fine-tune with the levers that make it fit 24 GB.
4. `fsdp`: the same 1B fine-tune on two FSDP2 processes (gloo): 1 update, a sharded save, a resume; under each C
   allocator of ALLOCATORS, then profiled.
5. `generate`: `python -m cascade_nb.generate` at 1024x1024 through Stage C, B and A, one step per stage.
6. `attribute`: the runs of 2 and 3 under `bench/memory_attribution.py`: what torch holds at its peak, by phase and
   op, against the planner's rows; the resident peak under each C allocator (glibc as it comes, glibc with
   `MALLOC_MMAP_THRESHOLD_=1048576`, jemalloc); a resume from the saved state.

Each step runs its command in a child process and measures that child's wall time and peak RSS (the largest
descendant's `ru_maxrss`), prints one line, and records it in bench/results/real_size.json (with the command);
bench/RESULTS.md quotes them. `--scale tiny` runs the same steps on tiny presets in a minute: a check of this script,
not a measurement.
"""
from __future__ import annotations
import argparse, json, os, shutil, signal, subprocess, sys, time
from pathlib import Path
from memory_attribution import torch_held

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REPO_ID = "stabilityai/stable-cascade"
COMMIT = "ca5cade" + "0" * 33          # the snapshot's (made-up) commit: refs/main points at it
RESULTS = ROOT/"bench"/"results"/"real_size.json"
GB = 1e9

# the CLIP encoders of the official repository's text_encoder/ and image_encoder/ (OpenCLIP bigG text tower,
# OpenAI ViT-L/14 vision tower), as transformers configs
BIGG_TEXT = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                 projection_dim=1280, hidden_act="gelu", vocab_size=49408, max_position_embeddings=77,
                 bos_token_id=49406, eos_token_id=49407, pad_token_id=1)
VIT_L14 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, patch_size=14,
               image_size=224, projection_dim=768, hidden_act="quick_gelu")
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, projection_dim=64,
                 hidden_act="gelu", vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
                 eos_token_id=49407, pad_token_id=1)
TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                   image_size=224, projection_dim=64, hidden_act="quick_gelu")

# file (or folder) of the official repository -> (what it is, preset at official scale, at tiny scale, dtype)
WEIGHTS = {
    "stage_c_bf16.safetensors": ("stage_c", "3.6B", "tiny", "bfloat16"),
    "stage_c_lite_bf16.safetensors": ("stage_c", "1B", "tiny", "bfloat16"),
    "stage_b_bf16.safetensors": ("stage_b", "3B", "tiny", "bfloat16"),
    # the small stages are written at their official size at both scales (the tiny runs load them as they are)
    "stage_a.safetensors": ("stage_a", "official", "official", "float32"),
    "effnet_encoder.safetensors": ("effnet", "v2_s", "v2_s", "float32"),
    "previewer.safetensors": ("previewer", {}, {}, "float32"),
    "text_encoder": ("clip_text", BIGG_TEXT, TINY_TEXT, "float32"),
    "image_encoder": ("clip_image", VIT_L14, TINY_VISION, "float32"),
}


def snapshot(cache: Path) -> Path: return cache/f"models--{REPO_ID.replace('/', '--')}"/"snapshots"/COMMIT
def hub_id(name: str) -> str: return f"hf://{REPO_ID}/{name}"


# --- writing the random official-size weights -------------------------------------------------------------------

def build(kind: str, preset):
    "A randomly initialised model of `kind` (see WEIGHTS), built in the current default dtype."
    from cascade_nb.models import StageC, StageB, StageA
    from cascade_nb.models.effnet import EfficientNetEncoder
    from cascade_nb.models.previewer import Previewer
    makers = dict(stage_c=StageC.from_preset, stage_b=StageB.from_preset, stage_a=StageA.from_preset,
                  effnet=EfficientNetEncoder.from_preset, previewer=lambda kw: Previewer(**kw))
    return makers[kind](preset)


def write_one(name: str, scale: str, cache: Path):
    "Write one file of WEIGHTS into the snapshot, as the official repository has it (no cascade_nb metadata)."
    import torch
    from cascade_nb.core import save_safetensors_atomic
    kind, official, tiny, dtype = WEIGHTS[name]
    preset, dtype = (official if scale == "official" else tiny), getattr(torch, dtype)
    out = snapshot(cache)/name
    torch.manual_seed(0)
    if kind.startswith("clip"):
        from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPVisionConfig,
                                  CLIPVisionModelWithProjection)
        config, cls = ((CLIPTextConfig, CLIPTextModelWithProjection) if kind == "clip_text"
                       else (CLIPVisionConfig, CLIPVisionModelWithProjection))
        cls(config(**preset)).to(dtype).save_pretrained(out, safe_serialization=True)
        return
    torch.set_default_dtype(dtype)
    model = build(kind, preset)
    # the reference's init zeroes the output conv and the timestep blocks, which trained weights never are; left at
    # zero, no gradient would reach an adapter (a LoRA would train nothing): small random values instead
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and not p.any(): p.normal_(std=0.02)
    save_safetensors_atomic({k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()},
                            out)


def lay_out_cache(cache: Path):
    "refs/main -> COMMIT and the tokenizer folder (the real CLIP tokenizer shipped in data_samples/)."
    repo = cache/f"models--{REPO_ID.replace('/', '--')}"
    (repo/"refs").mkdir(parents=True, exist_ok=True)
    (repo/"refs"/"main").write_text(COMMIT)
    shutil.copytree(ROOT/"data_samples"/"clip_tokenizer", snapshot(cache)/"tokenizer", dirs_exist_ok=True)


# --- measuring a child process ------------------------------------------------------------------------------------

WRAPPER = """
import json, os, resource, subprocess, sys, threading, time
def anon(pid):
    try: return int(next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("RssAnon:"))) * 1024
    except (OSError, StopIteration): return 0
def tree(pid):
    kids = [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return [pid] + [d for k in kids for d in tree(k)]
t = time.time()
p = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], "ab"), stderr=subprocess.STDOUT)
peak = {"anon": 0, "anon_sum": 0}
def poll():
    while p.poll() is None:
        sizes = [anon(q) for q in tree(p.pid)]
        peak["anon"], peak["anon_sum"] = max(peak["anon"], *sizes), max(peak["anon_sum"], sum(sizes))
        time.sleep(0.5)
threading.Thread(target=poll, daemon=True).start()
rc = p.wait()
print(json.dumps(dict(rc=rc, wall_s=time.time() - t, peak_anon_gb=peak["anon"] / 1e9,
                      peak_anon_sum_gb=peak["anon_sum"] / 1e9,
                      peak_rss_gb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9)))
"""


def measured(cmd: list[str], env: dict, log: Path, stop_when=None) -> dict:
    """Run `cmd` in a wrapper process; its wall time, exit status, peak RSS (GB, the largest descendant's
    `ru_maxrss`, which counts the pages of memory-mapped files too) and peak anonymous memory (RssAnon sampled every
    0.5 s: the largest process's, and the sum over the processes). With `stop_when` (a function), SIGTERM the
    command once it returns True (a stop signal through the launcher)."""
    p = subprocess.Popen([sys.executable, "-c", WRAPPER, str(log), *cmd], env=env, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    signalled = False
    while p.poll() is None:
        time.sleep(2)
        if stop_when is not None and not signalled and stop_when():
            # the command (the launcher) is the wrapper's child: it forwards the signal to the trainers
            for child in _children(p.pid): os.kill(child, signal.SIGTERM)
            signalled = True
    rec = json.loads(p.stdout.read().strip().splitlines()[-1])
    if stop_when is not None: rec["sigterm"] = signalled
    return rec


def _children(pid: int) -> list[int]:
    "The direct children of `pid` (from /proc)."
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in out]


def record(results: dict, step: str, name: str, rec: dict, line: str):
    "Print the step's one line and keep its figures."
    print(f"real_size {step} {name}: {line}", flush=True)
    results.setdefault(step, {})[name] = {**rec, "line": line}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


# --- the steps ------------------------------------------------------------------------------------------------------

def step_write(ctx):
    "Every file of WEIGHTS, each built and written by a process of its own (the largest, Stage C 3.6B: 7.2 GB)."
    for name in WEIGHTS:
        target = snapshot(ctx.cache)/name
        if target.exists() and not ctx.rewrite: continue
        code = f"import sys; sys.path.insert(0, {str(ROOT/'bench')!r}); import real_size as r; " \
               f"r.write_one({name!r}, {ctx.scale!r}, r.Path({str(ctx.cache)!r}))"
        rec = measured([sys.executable, "-c", code], ctx.env, ctx.log("write"))
        assert rec["rc"] == 0, f"writing {name} failed: see {ctx.log('write')}"
        size = file_bytes(target) / GB
        record(ctx.results, "write", name, {**rec, "file_gb": size},
               f"{size:.2f} GB written in {rec['wall_s']:.0f} s, peak RSS {rec['peak_rss_gb']:.1f} GB")
    lay_out_cache(ctx.cache)


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def weights_of(path: Path) -> int:
    "Number of weights in a safetensors file (or the model.safetensors of a folder), from its header."
    from math import prod
    from cascade_nb.core import safetensors_header
    _, shapes = safetensors_header(path/"model.safetensors" if path.is_dir() else path)
    return sum(prod(s) for s in shapes.values())


# name -> (module, loader): the function that loads it, called with the hub id in a fresh process
LOADS = {"stage_c_bf16.safetensors": ("cascade_nb.models", "load_stage_c"),
         "stage_c_lite_bf16.safetensors": ("cascade_nb.models", "load_stage_c"),
         "stage_b_bf16.safetensors": ("cascade_nb.models", "load_stage_b"),
         "stage_a.safetensors": ("cascade_nb.models", "load_stage_a"),
         "effnet_encoder.safetensors": ("cascade_nb.models.effnet", "load_effnet_encoder"),
         "previewer.safetensors": ("cascade_nb.models.previewer", "load_previewer"),
         "text_encoder": ("cascade_nb.models.clip", "load_clip_text_model"),
         "image_encoder": ("cascade_nb.models.clip", "load_clip_image_model")}
BYTES = {"bfloat16": 2, "float32": 4}


def tiny_kwargs(name: str, scale: str) -> str:
    "At tiny scale the loaders are told the preset (only the official sizes are inferred from the shapes)."
    kind, official, tiny, _ = WEIGHTS[name]
    if scale == "official" or kind.startswith("clip") or tiny == official: return ""
    return ", " + ", ".join(f"{k}={v!r}" for k, v in tiny.items()) if isinstance(tiny, dict) else f", preset={tiny!r}"


def step_load(ctx):
    """Each stage loaded by its hub id in a fresh process, in bf16 and in fp32, then every weight read once: peak RSS
    minus that of a process that imports the same modules and loads nothing, against the model's bytes in that dtype
    (1.0 = no second copy)."""
    base = measured([sys.executable, "-c", "import cascade_nb.models, cascade_nb.models.clip, transformers"],
                    ctx.env, ctx.log("load"))
    record(ctx.results, "load", "baseline", base, f"imports alone: peak RSS {base['peak_rss_gb']:.2f} GB")
    for name, (module, loader) in LOADS.items():
        path = snapshot(ctx.cache)/name
        for dtype in ("bfloat16", "float32"):
            # every weight read once after the load, as a first forward would: a memory map counts only when used
            code = (f"from {module} import {loader} as load; "
                    f"m = load({hub_id(name)!r}, dtype={dtype!r}{tiny_kwargs(name, ctx.scale)}); "
                    "[t.sum() for t in m.state_dict().values()]")
            rec = measured([sys.executable, "-c", code], ctx.env, ctx.log("load"))
            assert rec["rc"] == 0, f"loading {name} failed: see {ctx.log('load')}"
            model_gb = weights_of(path) * BYTES[dtype] / GB
            held = rec["peak_rss_gb"] - base["peak_rss_gb"]
            anon = rec["peak_anon_gb"] - base["peak_anon_gb"]
            rec.update(file_gb=file_bytes(path) / GB, model_gb=model_gb, held_gb=held, held_anon_gb=anon)
            record(ctx.results, "load", f"{name} as {dtype}", rec,
                   f"{rec['wall_s']:.1f} s; above the imports, peak RSS {held:.2f} GB ({held / model_gb:.2f}x), "
                   f"anonymous {anon:.2f} GB ({anon / model_gb:.2f}x) for a {model_gb:.2f} GB model from a "
                   f"{rec['file_gb']:.2f} GB file")



# --- training runs: launch, SIGTERM after the first update, resume, finish -----------------------------------------

H = f"hf://{REPO_ID}"
PATHS = {"generator_checkpoint_path": None, "effnet_checkpoint_path": f"{H}/effnet_encoder.safetensors",
         "previewer_checkpoint_path": f"{H}/previewer.safetensors", "clip_text_model_name": f"{H}/text_encoder",
         "clip_image_model_name": f"{H}/image_encoder", "tokenizer_path": f"{H}/tokenizer"}
ONE_PROCESS = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def make_images(folder: Path, side: int, n: int = 8, prefix: str = ""):
    "`n` training images of at least `side` px (the shipped photos scaled up), each with its .txt caption."
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    photos = sorted((ROOT/"data_samples"/"photos").glob("*.jpg"))
    for i in range(n):
        src = photos[i % len(photos)]
        img = Image.open(src).convert("RGB")
        scale = side / min(img.size)
        img.resize((round(img.width * scale), round(img.height * scale)), Image.BICUBIC).save(folder/f"{i:04d}.jpg")
        (folder/f"{i:04d}.txt").write_text(prefix + src.with_suffix(".txt").read_text().strip())


def official_config(ctx, name: str) -> Path:
    "The official training YAML `name` (tests/official_configs.py holds their text), written unchanged."
    sys.path.insert(0, str(ROOT/"tests"))
    from official_configs import OFFICIAL_CONFIGS
    path = ctx.work/"configs"/name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OFFICIAL_CONFIGS[name])
    return path


def metrics_of(ctx, run_id: str) -> list[dict]:
    p = ctx.work/"outputs"/run_id/"metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def planned_gb(ctx, config: Path, overrides: list[str], *flags: str) -> float:
    "`python -m cascade_nb.memory`'s peak for the same config and overrides, less its CUDA context (none on CPU)."
    out = subprocess.run([sys.executable, "-m", "cascade_nb.memory", str(config), *overrides, *flags], env=ctx.env,
                         capture_output=True, text=True, cwd=ROOT).stdout
    (ctx.work/"logs"/f"plan_{config.stem}{'_'.join(flags)}.txt").write_text(out)
    total = float(out.split("≈")[-1].split()[0])
    context = next(float(line.split()[-1]) for line in out.splitlines() if line.startswith("CUDA context"))
    return total - context


def train_stop_resume(ctx, step: str, config: Path, overrides: list[str], launch: list[str], script: list[str]):
    """Launch the run through `python -m cascade_nb.launch`, SIGTERM it once update 1 is logged (it saves at the
    update it is in and exits 0), relaunch the same command (it resumes) and let it finish; record both."""
    run_id = next(o.split("=", 1)[1] for o in overrides if o.startswith("experiment_id="))
    cmd = [sys.executable, "-m", "cascade_nb.launch", *launch, *script, str(config), *overrides]
    first = measured(cmd, ctx.env, ctx.log(step),
                     stop_when=lambda: any(m.get("update", 0) >= 1 and "loss" in m for m in metrics_of(ctx, run_id)))
    stopped_at = json.loads((ctx.work/"runs"/run_id/"info.json").read_text())["update"]
    second = measured(cmd, ctx.env, ctx.log(step))
    assert first["rc"] == 0 and second["rc"] == 0, f"{step} failed: see {ctx.log(step)}"
    return run_id, first, second, stopped_at



def run_overrides(ctx, generator: str, run_id: str) -> list[str]:
    "Only paths and the run's name: the cache's hub ids, this work folder, the generated images."
    paths = {**PATHS, "generator_checkpoint_path": f"{H}/{generator}"}
    out = [f"{k}={v}" for k, v in paths.items()] + [
        f"experiment_id={run_id}", f"checkpoint_path={ctx.work}/runs", f"output_path={ctx.work}/outputs",
        f"webdataset_path={ctx.work}/images"]
    # at tiny scale the official preset, image size and text widths are swapped for the tiny ones; the official
    # presets' dropout (0.1) is kept, as it decides what a resume must restore (run_state.seed_global_draws)
    return out + ([] if ctx.scale == "official" else ["model_version=tiny", "image_size=256",
                                                      "model_overrides={dropout: [0.1, 0.1]}"])


def summarise_run(ctx, step: str, config: Path, overrides: list[str], run_id, first, second, stopped_at,
                  plan_flags=()):
    "Time per update, peak RSS vs the planner, checkpoint size and save time, from the logs and the run folder."
    ms = [m for m in metrics_of(ctx, run_id) if "loss" in m]
    run = ctx.work/"runs"/run_id
    saves = [float(line.rsplit(" in ", 1)[1].split()[0]) for line in ctx.log(step).read_text().splitlines()
             if ": saved in " in line and line.rstrip().endswith(" s")]
    state = max(run.glob("state-*"))
    rec = dict(first=first, second=second, stopped_at=stopped_at, updates=[m["update"] for m in ms],
               losses=[m["loss"] for m in ms], step_time_s=[m["step_time_s"] for m in ms],
               trainer_peak_rss_gb=max(m["peak_memory_gb"] for m in ms), save_s=saves,
               state_gb=file_bytes(state) / GB,
               released_gb={p.name: p.stat().st_size / GB for p in run.glob("*.safetensors")},
               planned_gb=planned_gb(ctx, config, overrides, *plan_flags), command=" ".join(
                   ["python -m cascade_nb.launch", "...", str(config.name), *overrides]))
    peak = max(first["peak_rss_gb"], second["peak_rss_gb"])
    rec["peak_rss_gb"] = peak
    record(ctx.results, step, "run", rec,
           f"stopped by SIGTERM at update {stopped_at}, resumed to {rec['updates'][-1]}; "
           f"{min(rec['step_time_s']):.0f}-{max(rec['step_time_s']):.0f} s per update, peak RSS {peak:.1f} GB vs "
           f"planner {rec['planned_gb']:.1f} GB ({rec['planned_gb'] and peak / rec['planned_gb'] - 1:+.0%}); "
           f"training state {rec['state_gb']:.2f} GB, saves {', '.join(f'{s:.0f} s' for s in saves)}")
    return rec


def step_lora(ctx):
    """The official finetune_c_3b_lora.yaml (3.6B Stage C, LoRA rank 4 on '.attn', a new token), 3 updates."""
    config = official_config(ctx, "finetune_c_3b_lora.yaml")
    make_images(ctx.work/"images", 768 if ctx.scale == "official" else 256, prefix="[fernando] ")
    overrides = run_overrides(ctx, "stage_c_bf16.safetensors", "lora_3b") + [
        "updates=3", "log_every=1",
        # for this CPU (bench/RESULTS.md says why): one image per update instead of 32 in 4 micro-steps, bf16
        # weights (fp32 plans 29 GB > 24 GB), 2 sampler steps for the in-training sample grid instead of 20
        "batch_size=1", "grad_accum_steps=1", "dtype=bfloat16", "sample_steps=2"]
    run_id, first, second, stopped = train_stop_resume(ctx, "lora", config, overrides, ONE_PROCESS,
                                                       [str(ROOT/"cascade_nb"/"train.py")])
    summarise_run(ctx, "lora", config, overrides + ["mixed_precision=no"], run_id, first, second, stopped)
    run = ctx.work/"runs"/run_id
    export = ("import time, torch; from safetensors.torch import load_file; from cascade_nb.lora_converters import to_kohya, save_peft_adapter; "
              "from cascade_nb.core import save_safetensors_atomic; "
              f"run = {str(run)!r}; t = time.time(); lora = load_file(run + '/lora.safetensors'); "
              "save_safetensors_atomic(to_kohya(lora), run + '/lora_kohya.safetensors'); "
              "save_peft_adapter(lora, run + '/lora_peft'); "
              "print('exported in', time.time() - t)")
    rec = measured([sys.executable, "-c", export], ctx.env, ctx.log("lora"))
    assert rec["rc"] == 0, f"LoRA export failed: see {ctx.log('lora')}"
    record(ctx.results, "lora", "export", rec, f"kohya + peft exports of lora.safetensors in {rec['wall_s']:.1f} s, "
           f"peak RSS {rec['peak_rss_gb']:.2f} GB")
    sample = [sys.executable, "-m", "cascade_nb.sample", "--checkpoint", str(run), "--prompt", "a photo of [fernando]",
              "--n", "1", "--steps", "2", "--out", str(ctx.work/"samples"/run_id), "--overwrite"]
    rec = measured(sample, ctx.env, ctx.log("lora"))
    assert rec["rc"] == 0, f"sampling failed: see {ctx.log('lora')}"
    record(ctx.results, "lora", "sample", rec, f"sample CLI, 1 image, 2 steps: {rec['wall_s']:.0f} s, "
           f"peak RSS {rec['peak_rss_gb']:.1f} GB")



# the levers `python -m cascade_nb.memory ... --budget 14` proposes for the full 1B fine-tune (fp32 AdamW plans
# 23.9 GB): gradient checkpointing, 8-bit AdamW, bf16 frozen encoders
LEVERS_1B = ["gradient_checkpointing=true", "optimizer=adamw8bit", "frozen_dtype=bfloat16"]


def step_full_1b(ctx):
    """The official finetune_c_1b.yaml (1B Stage C, full fine-tune), 3 updates, with the planner's levers."""
    config = official_config(ctx, "finetune_c_1b.yaml")
    make_images(ctx.work/"images", 768 if ctx.scale == "official" else 256)
    overrides = run_overrides(ctx, "stage_c_lite_bf16.safetensors", "full_1b") + [
        "updates=3", "log_every=1", "batch_size=1", "grad_accum_steps=1", "sample_steps=2", *LEVERS_1B]
    run_id, first, second, stopped = train_stop_resume(ctx, "full_1b", config, overrides, ONE_PROCESS,
                                                       [str(ROOT/"cascade_nb"/"train.py")])
    summarise_run(ctx, "full_1b", config, overrides + ["mixed_precision=no"], run_id, first, second, stopped)


def step_fsdp(ctx):
    """The 1B full fine-tune on two FSDP2 processes (gloo, CPU): 1 update and a sharded save, then a relaunch that
    resumes from the shards and makes 1 more; per-process peak RSS against the planner's FSDP plan. Once per C
    allocator of ALLOCATORS."""
    config = official_config(ctx, "finetune_c_1b.yaml")
    make_images(ctx.work/"images", 768 if ctx.scale == "official" else 256)
    for i, (allocator, env) in enumerate(ALLOCATORS.items()):
        label, run_id = ("run" if i == 0 else f"run, {allocator}"), f"fsdp_1b_{i}"
        if not ctx.selected(allocator): continue
        shutil.rmtree(ctx.work/"runs"/run_id, ignore_errors=True)
        shutil.rmtree(ctx.work/"outputs"/run_id, ignore_errors=True)
        fsdp_run(ctx, config, run_id, label, env)
    # the same two launches with glibc's defaults, each process under bench/memory_attribution.py (the profiler)
    if not ctx.selected("profiled"): return
    shutil.rmtree(ctx.work/"runs"/"fsdp_1b_profiled", ignore_errors=True)
    shutil.rmtree(ctx.work/"outputs"/"fsdp_1b_profiled", ignore_errors=True)
    fsdp_run(ctx, config, "fsdp_1b_profiled", "profiled", {}, profiled=True)


def fsdp_run(ctx, config: Path, run_id: str, label: str, env: dict, profiled: bool = False):
    """One `step_fsdp` run (two launches) in `env`, recorded as `label`; `profiled`: each process under
    `bench/memory_attribution.py`, and what torch holds per process recorded too."""
    # 8-bit AdamW cannot step FSDP2's DTensor shards (the planner refuses it): AdamW, sharded; bf16 weights, because
    # both processes share this machine's 24 GB (with fp32 weights, 11.4 GB planned each, rank 0 was killed for memory
    # at 11.8 GB), and no DataLoader workers (with two per process, the resume was killed for memory at 9.3 GB in rank
    # 1); 384 px keeps the two single-core processes at a few minutes per update
    base = run_overrides(ctx, "stage_c_lite_bf16.safetensors", run_id) + [
        "log_every=1", "batch_size=2", "grad_accum_steps=1", "sample_steps=2", "gradient_checkpointing=true",
        "frozen_dtype=bfloat16", "dtype=bfloat16", "num_workers=0"] + (
            ["image_size=384"] if ctx.scale == "official" else [])
    launch = ["--config_file", str(ROOT/"configs"/"accelerate"/"cpu_2proc.yaml"), "--main_process_port", "29533"]
    script = [str(ROOT/"tests"/"train_driver.py"), "--fsdp-cpu"]
    recs, ranks = [], []
    for updates in (1, 2):
        out = ctx.work/"attribution"/f"{run_id}_{updates}.json"
        wrap = [str(ROOT/"bench"/"memory_attribution.py"), "--out", str(out), "--driver"] if profiled else []
        cmd = [sys.executable, "-m", "cascade_nb.launch", *launch, *wrap, *script, str(config), *base,
               f"updates={updates}"]
        recs.append(measured(cmd, {**ctx.env, **env}, ctx.log("fsdp")))
        assert recs[-1]["rc"] == 0, f"fsdp failed: see {ctx.log('fsdp')}"
        if profiled: ranks.append([json.loads(out.with_name(f"{out.stem}_rank{r}.json").read_text()) for r in (0, 1)])
    ms = [m for m in metrics_of(ctx, run_id) if "loss" in m]
    state = max((ctx.work/"runs"/run_id).glob("state-*"))
    planned = planned_gb(ctx, config, base + ["updates=2", "mixed_precision=no"], "--world-size", "2", "--fsdp")
    saves = [line for line in ctx.log("fsdp").read_text().splitlines() if ": saved in " in line]
    rank0 = [m["peak_memory_gb"] for m in ms]
    rec = dict(runs=recs, updates=[m["update"] for m in ms], step_time_s=[m["step_time_s"] for m in ms],
               trainer_peak_rss_gb=max(rank0), rank0_peak_rss_gb=rank0, planned_gb=planned,
               state_gb=file_bytes(state) / GB, shards=sorted(p.name for p in state.rglob("*.distcp")),
               saves=saves[-2:], env=env)
    anon = " / ".join(f"{r['peak_anon_gb']:.1f}" for r in recs)
    if profiled:   # per launch and rank: what torch holds at its peak (+ the encoders' other threads), mapped, resident
        held = [[torch_held(a)[0] / GB for a in launch_ranks] for launch_ranks in ranks]
        mapped = [[torch_held(a)[2] / GB for a in launch_ranks] for launch_ranks in ranks]
        resident = [[a["rss_peak"] / GB for a in launch_ranks] for launch_ranks in ranks]
        rec.update(torch_peak_gb=held, mapped_gb=mapped, rank_peak_rss_gb=resident,
                   **{k: [[a[k] for a in launch_ranks] for launch_ranks in ranks]
                      for k in ("peak_phase", "live_at_peak_by_phase", "live_at_peak_by_op", "unseen", "phases")})
        per = lambda xs: " / ".join(f"{x:.2f}" for x in xs)
        record(ctx.results, "fsdp", label, rec,
               "torch holds + mapped weights, ranks 0 / 1: new launch " + per(h + m for h, m in zip(held[0], mapped[0]))
               + " GB, resumed " + per(h + m for h, m in zip(held[1], mapped[1])) + f" GB vs planner {planned:.2f} GB "
               f"per process; resident peaks {per(resident[0])} / {per(resident[1])} GB (profiled)")
    else:
        record(ctx.results, "fsdp", label, rec,
               f"updates {rec['updates']} (the second after a resume from the shards), {min(rec['step_time_s']):.0f}-"
               f"{max(rec['step_time_s']):.0f} s per update, rank-0 peak RSS "
               f"{' / '.join(f'{x:.1f}' for x in rank0)} GB (new / resumed launch) vs planner {planned:.1f} GB per "
               f"process ({' / '.join(f'{x / planned - 1:+.0%}' for x in rank0)}); largest process's anonymous peak "
               f"{anon} GB; sharded state {rec['state_gb']:.2f} GB in {len(rec['shards'])} shard files")
    shutil.rmtree(ctx.work/"runs"/run_id)   # 14 GB of states: the next run needs the disk


# the C allocators compared: glibc's defaults; glibc with its mmap threshold fixed at 1 MiB (every block of 1 MiB or
# more is its own mapping, returned to the system when torch frees it; the default threshold grows to 32 MiB and the
# freed blocks below it stay in the process); jemalloc, preloaded, where Debian's libjemalloc2 is installed
JEMALLOC = next((p for p in Path("/usr/lib").glob("*-linux-gnu/libjemalloc.so.2")), None)
ALLOCATORS = {"glibc": {}, "glibc, MALLOC_MMAP_THRESHOLD_=1048576": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
              **({"jemalloc (LD_PRELOAD)": {"LD_PRELOAD": str(JEMALLOC)}} if JEMALLOC else {})}


# the levers `python -m cascade_nb.memory finetune_c_3b.yaml batch_size=1 --budget 24` proposes for the official 3.6B
# full fine-tune (fp32 AdamW plans 73.5 GB), and with --budget 12 (the same with Adafactor); nbs/70_memory checks that
# the planner still proposes them
_BF16_SR = ["gradient_checkpointing=true", "frozen_dtype=bfloat16", "dtype=bfloat16", "fused_backward=true",
            "stochastic_rounding=true"]
LEVERS_3B = {"12gb": ["optimizer=adafactor", *_BF16_SR], "24gb": ["optimizer=adamw8bit", *_BF16_SR]}
MMAP_1MB = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def state_hashes(state: Path) -> dict:
    """A digest of each file of a training state, as the suite's exact-resume tests compare them: less accelerate's
    `random_states_N.pkl`, its copy of the process-global RNGs, which the trainer seeds again at every update
    (`run_state.seed_global_draws`: dropout's masks are a function of seed, rank and update)."""
    from cascade_nb.run_state import file_checksums
    return {k: v for k, v in file_checksums(state).items() if not Path(k).name.startswith("random_states_")}


def step_attribute(ctx):
    """Where the memory of the full 1B, the 3.6B LoRA and the 3.6B full fine-tune (the 24 GB and 12 GB levers) runs
    goes, beside the planner's rows for the same config: each config in one process under
    `bench/memory_attribution.py`. Profiled (torch's allocations by phase and op): a new run to update 2, where it
    saves, then the same command with updates=3, which resumes from that state. Not profiled (the profiler's event
    buffers add to the resident peak): a new run to update 2 under each C allocator of ALLOCATORS, for the resident
    peak and the time per update; and (the 3.6B full runs) one uninterrupted run to update 3, whose state must be the
    resumed one's, file for file. `--only` picks runs and launches by parts of their names."""
    runs = {"full_1b": ("finetune_c_1b.yaml", "stage_c_lite_bf16.safetensors",
                        ["batch_size=1", "grad_accum_steps=1", *LEVERS_1B]),
            "lora": ("finetune_c_3b_lora.yaml", "stage_c_bf16.safetensors",
                     ["batch_size=1", "grad_accum_steps=1", "dtype=bfloat16"]),
            **{f"full_3b_{b}": ("finetune_c_3b.yaml", "stage_c_bf16.safetensors",
                                ["batch_size=1", "grad_accum_steps=1", *levers]) for b, levers in LEVERS_3B.items()}}
    for name, (yaml, generator, levers) in runs.items():
        if not ctx.selected(name): continue
        config = official_config(ctx, yaml)
        make_images(ctx.work/"images", 768 if ctx.scale == "official" else 256,
                    prefix="[fernando] " if name == "lora" else "")
        run_id = f"attribute_{name}"
        overrides = run_overrides(ctx, generator, run_id) + ["log_every=1", "num_workers=0",
                                                             "mixed_precision=no", *levers]
        planned = planned_gb(ctx, config, overrides)
        rows = [line for line in (ctx.work/"logs"/f"plan_{config.stem}.txt").read_text().splitlines()
                if line[:1].isalpha()]
        # the 3.6B full runs' profiled launches with glibc's mmap threshold fixed too: with its defaults the resident
        # peak grows ~1.5x over what torch holds (the 1B's), past this machine's 24 GB for the 24 GB levers
        first = MMAP_1MB if name.startswith("full_3b") else {}
        launches = [("profiled, new", 2, first), ("profiled, resumed", 3, first)] + [
            (f"new, {allocator}", 2, env) for allocator, env in ALLOCATORS.items()] + (
            [("uninterrupted to 3, MALLOC_MMAP_THRESHOLD_=1048576", 3, MMAP_1MB)] if name.startswith("full_3b") else [])
        launches = [launch for launch in launches if ctx.selected(launch[0])] or launches
        for i, (launch, updates, env) in enumerate(launches):
            if launch != "profiled, resumed": shutil.rmtree(ctx.work/"runs"/run_id, ignore_errors=True)
            out = ctx.work/"attribution"/f"{name}_{i}.json"
            args = [str(config), *overrides, f"updates={updates}"]
            flags = [] if launch.startswith("profiled") else ["--no-profile"]
            cmd = [sys.executable, str(ROOT/"bench"/"memory_attribution.py"), "--out", str(out), *flags, *args]
            rec = measured(cmd, {**ctx.env, **env}, ctx.log("attribute"))
            assert rec["rc"] == 0, f"attribution of {name} ({launch}) failed: see {ctx.log('attribute')}"
            a = json.loads(out.read_text())
            state = max((ctx.work/"runs"/run_id).glob("state-*"))
            keep = dict(wall_s=rec["wall_s"], peak_rss_gb=a["rss_peak"] / GB, planned_gb=planned, plan_rows=rows,
                        state=state.name, state_gb=file_bytes(state) / GB, env=env, runtime_gb=a["imported_rss"] / GB,
                        update_s=a["update_s"],
                        save_s=[r["seconds"] for r in a["phases"] if r["phase"] == "save"], phases=a["phases"],
                        command=" ".join([*(f"{k}={v}" for k, v in env.items()), "python bench/memory_attribution.py "
                                          "--out FILE", *flags, yaml, *args[1:]]))
            if name.startswith("full_3b") and updates == 3: keep["state_sha256"] = state_hashes(state)
            line = (f"resident peak {keep['peak_rss_gb']:.2f} GB vs planner {planned:.2f} GB "
                    f"({keep['peak_rss_gb'] / planned - 1:+.0%}), of which runtime {keep['runtime_gb']:.2f} GB; "
                    f"updates of {', '.join(f'{x:.0f}' for x in a['update_s'])} s; {state.name} "
                    f"{keep['state_gb']:.3f} GB saved in "
                    f"{', '.join(f'{x:.0f} s' for x in keep['save_s'])}")
            if launch.startswith("profiled"):
                keep.update({k: a[k] for k in ("peak_allocated", "peak_phase", "peak_op", "live_at_peak_by_phase",
                                               "live_at_peak_by_op", "phase_peak_allocated", "unseen")})
                # the tensors the profiler did not see: the CLIP encoders (loaded in transformers' threads), and
                # weights that stay memory-mapped from their file (bf16 in a bf16 file, fp32 in an fp32 file)
                held, other, mapped = (b / GB for b in torch_held(a))
                keep.update(torch_peak_gb=held, mapped_gb=mapped)
                line = (f"torch holds {held:.2f} GB at its peak ({a['peak_phase']}; {other:.2f} GB of it loaded in "
                        f"other threads) + {mapped:.2f} GB of mapped weight files = {held + mapped:.2f} GB vs planner "
                        f"{planned:.2f} GB ({(held + mapped) / planned - 1:+.0%}); {line}")
            if launch.startswith("uninterrupted"):   # the same state as the resumed launch's, file for file
                resumed = ctx.results.get("attribute", {}).get(f"{name} profiled, resumed", {}).get("state_sha256")
                keep["resume_exact"] = resumed == keep["state_sha256"] if resumed else None
                line += ("; its state-00000003 is the resumed launch's, file for file" if keep["resume_exact"] else
                         "; NOT the resumed launch's state" if resumed is not None else "; no resumed state to compare")
            record(ctx.results, "attribute", f"{name} {launch}", keep, line)
        shutil.rmtree(ctx.work/"runs"/run_id)   # the full 1B's states take 10 GB each


def step_generate(ctx):
    "`python -m cascade_nb.generate` at 1024x1024 from the cache's snapshot folder, one step per stage, bf16."
    if ctx.scale == "tiny":   # the CLI's --stage-c/--stage-b take the official presets only
        print("real_size generate: official scale only", flush=True)
        return
    side = 1024
    out = ctx.work/"generated"
    cmd = [sys.executable, "-m", "cascade_nb.generate", "a photo of a dog", "--models", str(snapshot(ctx.cache)),
           "--out", str(out), "--height", str(side), "--width", str(side), "--steps-c", "1", "--steps-b", "1",
           "--seed", "0", "--device", "cpu", "--dtype", "bfloat16", "--stage-c", "3.6B", "--stage-b", "3B"]
    rec = measured(cmd, ctx.env, ctx.log("generate"))
    assert rec["rc"] == 0, f"generate failed: see {ctx.log('generate')}"
    from PIL import Image
    sizes = sorted({Image.open(p).size for p in out.glob("*.png")})
    record(ctx.results, "generate", f"{side}x{side}", {**rec, "png_sizes": sizes, "command": " ".join(cmd[1:])},
           f"Stage C -> B -> A, 1 step each, bf16: {rec['wall_s']:.0f} s, peak RSS {rec['peak_rss_gb']:.1f} GB, "
           f"images {sizes}")


# --- main -----------------------------------------------------------------------------------------------------------

STEPS = {"write": step_write, "load": step_load, "lora": step_lora, "full_1b": step_full_1b,
         "fsdp": step_fsdp, "generate": step_generate, "attribute": step_attribute}


class Context:
    "The work folder, the environment every child runs in (offline, the cache), the results so far."
    def __init__(self, work: Path, scale: str, rewrite: bool = False, only: tuple = ()):
        self.work, self.scale, self.rewrite, self.only = work, scale, rewrite, only
        self.cache = work/"hub"
        self.env = {**os.environ, "HF_HUB_CACHE": str(self.cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.results = json.loads(RESULTS.read_text()) if RESULTS.exists() and scale == "official" else {}

    def selected(self, name: str) -> bool:
        "Whether `--only` (parts of names: full_1b, lora, MALLOC, jemalloc, profiled, ...) selects run `name`."
        return not self.only or any(part in name for part in self.only)

    def log(self, step: str) -> Path:
        (self.work/"logs").mkdir(parents=True, exist_ok=True)
        return self.work/"logs"/f"{step}.log"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/cascade_nb_real_size"), help="cache, runs and logs")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {list(STEPS)}")
    p.add_argument("--scale", choices=("official", "tiny"), default="official")
    p.add_argument("--rewrite", action="store_true", help="write the weights again even where they exist")
    p.add_argument("--only", default="", help="comma-separated parts of names: attribute's runs (full_1b, lora), "
                   "fsdp's allocators (glibc, MALLOC, jemalloc: ALLOCATORS) or profiled; default all")
    args = p.parse_args(argv)
    global RESULTS
    if args.scale == "tiny": RESULTS = args.work/"real_size_tiny.json"
    args.work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.work, args.scale, args.rewrite, tuple(filter(None, args.only.split(','))))
    for step in args.steps.split(","):
        t = time.time()
        STEPS[step](ctx)
        print(f"real_size {step}: done in {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
