"""The prepared GPU check (issue 18): one script, at most 8 minutes on one H200, one comparable line per measurement.

    python bench/gpu_check.py                       # on a CUDA machine; paste the `gpu_check` lines into bench/RESULTS.md
    python bench/gpu_check.py --only step,memory    # a subset: step, memory, lora, sampling, train
    python bench/gpu_check.py --models DIR          # sampling with real checkpoints (default: tiny-twin weights)
    python bench/gpu_check.py --dry-run             # every measurement at tiny size on CPU (tests/test_gpu_check.py)

Measurements:
- step: Stage C 1B train step (bf16 autocast, fp32 AdamW master weights) at the official finetune_c_1b.yaml size:
  1024 images @768 over 64 GPUs = 16 per GPU, 24x24 latents; eager and with `compile_blocks` (regional compile).
  images/s and MFU = 3 x `stage_c_flops` (the model's own forward count) / step time / 790 TFLOP/s.
- memory: CUDA peak (`max_memory_allocated`) of the official 3.6B full fine-tune at batch 1, and of the memory options
  at the largest batch the planner says fits 80 GB, next to the planner's rows for the generator (weights, gradients,
  optimizer state, weight copies, activations; frozen encoders and the CUDA context are not loaded here, on either side).
- lora: the same for LoRA rank 4 '.attn' on the 3.6B at batch 4 @768 (the reference needs about 45 GB).
- sampling: the whole cascade (Stage C 20 steps -> Stage B 10 steps -> Stage A) at 1024x1024, images/s; the weights in
  --models when given, else tiny-twin weights (`write_tiny_checkpoints`: the same code path, not the real cost).
- swap: block swap (nbs/40g_block_swap) on the 3.6B at batch 1 @768 with the 8 GB plan's settings (bf16 weights, fused
  backward with stochastic rounding, Adafactor, checkpointing, activation offload): CUDA peak and step time with 0 and
  N blocks swapped, the loss of the first step equal, next to the planner's rows for the generator.
- train: a short run of `train()` itself on the device (the demo config), so a crash on CUDA shows here.
"""
import argparse, contextlib, gc, math, sys, tempfile, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch
from cascade_nb.models.stage_c import StageC
from cascade_nb.models.blocks import compile_blocks
from cascade_nb.memory import GB, plan_memory, official_config, stage_c_flops

PEAK_FLOPS = 790e12   # H200 bf16 dense, the reference figure
FULL = dict(swap_preset="3.6B", swap_blocks=(0, 36, 96), preset="1B", step_batch=16, side=24, mem_preset="3.6B", budget=80, image=1024, steps=(20, 10), iters=10)
DRY = dict(swap_preset="tiny", swap_blocks=(0, 6), preset="tiny", step_batch=2, side=8, mem_preset="tiny", budget=80, image=128, steps=(2, 2), iters=2)
MEMORY_OPTIONS = {   # label: overrides of the official 3.6B config
    "official (fp32 weights, AdamW)": {},
    "checkpointing": dict(gradient_checkpointing=True),
    "checkpointing + 8-bit AdamW": dict(gradient_checkpointing=True, optimizer="adamw8bit"),
    "checkpointing + 8-bit AdamW + bf16 weights": dict(gradient_checkpointing=True, optimizer="adamw8bit", dtype="bfloat16"),
}

def out(line: str): print(f"gpu_check {line}", flush=True)

def sync(device):
    if device.type == "cuda": torch.cuda.synchronize(device)

def build(preset: str, device, dtype=torch.float32, **overrides) -> StageC:
    "A StageC built straight on `device` (random init there: seconds for the 3.6B on a GPU)."
    torch.manual_seed(0)
    with torch.device(device): return StageC.from_preset(preset, **overrides).to(dtype)

def inputs(model: StageC, batch: int, side: int, device, dtype=torch.float32) -> dict:
    c = model.config
    rnd = lambda *s: torch.randn(*s, device=device, dtype=dtype)
    return dict(x=rnd(batch, c["c_in"], side, side), r=torch.rand(batch, device=device), clip_text=rnd(batch, 77, c["c_clip_text"]),
                clip_text_pooled=rnd(batch, 1, c["c_clip_text_pooled"]), clip_img=rnd(batch, 1, c["c_clip_img"]))

def make_optimizer(params, name: str, device):
    if name == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=1e-5)
    return torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")

def train_steps(model, opt, batch: int, side: int, device, n: int) -> float:
    "Seconds per step over `n` steps of forward (bf16 autocast) + backward + optimizer step."
    x = inputs(model, batch, side, device, next(model.parameters()).dtype)
    sync(device); t0 = time.perf_counter()
    for _ in range(n):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**x).float().square().mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    sync(device)
    return (time.perf_counter() - t0) / n

def check_step(S, device, dry):
    "Stage C train step, eager and regionally compiled: images/s and MFU."
    for compiled in (False, True):
        model = build(S["preset"], device).train()
        opt = make_optimizer(model.parameters(), "adamw", device)
        t0 = time.perf_counter()
        if compiled: compile_blocks(model, backend="eager") if dry else compile_blocks(model)   # dry: dynamo tracing only
        train_steps(model, opt, S["step_batch"], S["side"], device, 2)
        warm = time.perf_counter() - t0
        dt = train_steps(model, opt, S["step_batch"], S["side"], device, S["iters"])
        flops = 3 * stage_c_flops(model, S["step_batch"], S["side"])
        out(f"step {S['preset']} {'compiled' if compiled else 'eager   '} batch {S['step_batch']} @{S['side'] * 32} bf16 autocast "
            f"on {device.type}: {S['step_batch'] / dt:8.2f} images/s, {dt * 1e3:8.1f} ms/step, {flops / dt / 1e12:7.1f} TFLOP/s, "
            f"MFU {flops / dt / PEAK_FLOPS:6.1%} of 790 TFLOP/s (first 2 steps incl. compile {warm:.1f} s)")
        del model, opt; gc.collect()

def generator_rows(plan) -> int:
    "The plan's bytes for what this script allocates: everything but frozen encoders and the CUDA context."
    return sum(v for k, v in plan.rows.items() if not k.startswith(("frozen", "CUDA", "ControlNet backbone")))

def measure(cfg, S, device) -> float | None:
    "Peak bytes of two training steps of the config's generator (full or LoRA) on `device`; None on CPU."
    from cascade_nb.adapters import apply_lora
    m, t = cfg.model, cfg.train
    model = build(S["mem_preset"], device, torch.bfloat16 if m.dtype == "bfloat16" else torch.float32).train()
    model.gradient_checkpointing = m.gradient_checkpointing
    if t.mode == "lora":
        model.requires_grad_(False)
        apply_lora(model, cfg.lora.module_filters, rank=cfg.lora.rank)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], t.optimizer, device)
    if device.type == "cuda": torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(device)
    side = cfg.data.image_size // 32 if S is FULL else S["side"]
    train_steps(model, opt, cfg.data.batch_size, side, device, 2)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, opt; gc.collect()
    if device.type == "cuda": torch.cuda.empty_cache()
    return peak

def memory_line(label, cfg, S, device):
    plan = plan_memory(cfg)
    try: peak = measure(cfg, S, device)
    except ImportError as e: return out(f"memory {label}: skipped ({e})")
    except torch.OutOfMemoryError: peak = math.inf
    planned = generator_rows(plan)
    got = f"measured {peak / GB:6.2f} GB, ratio planned/measured {planned / peak:.3f}" if peak else "measured n/a (CPU)"
    out(f"memory {S['mem_preset']} {label}, batch {cfg.data.batch_size} @{cfg.data.image_size}: planned {planned / GB:6.2f} GB "
        f"(whole plan {plan.peak_gb:.1f} GB) vs {got}")

def largest_batch(overrides: dict, budget: float, model_version: str) -> int:
    "The largest batch per GPU the planner says fits `budget` GB (1 if none)."
    b = 1
    while b < 256 and plan_memory(official_config(model_version=model_version, batch_size=b * 2, **overrides)).peak_gb <= budget: b *= 2
    return b

def check_memory(S, device, dry):
    mv = S["mem_preset"]
    memory_line("official, batch 1", official_config(model_version=mv, batch_size=1), S, device)
    for label, ov in MEMORY_OPTIONS.items():
        if dry and ov.get("optimizer") == "adamw8bit" and device.type == "cpu": ov = {**ov, "optimizer": "adamw"}   # bitsandbytes runs on CPU, but its import alone costs ~10 CPU-s
        b = largest_batch(ov, S["budget"], "3.6B") if not dry else 2
        memory_line(f"{label} (largest batch planned to fit {S['budget']} GB)", official_config(model_version=mv, batch_size=b, **ov), S, device)

def check_lora(S, device, dry):
    cfg = official_config(model_version=S["mem_preset"], experiment_id="stage_c_3b_lora", batch_size=4, module_filters=[".attn"],
                          rank=4, dtype="bfloat16", gradient_checkpointing=True)
    memory_line("LoRA r4 '.attn' bf16 checkpointed (reference: ~45 GB)", cfg, S, device)

def check_sampling(S, device, dry, models=None):
    from cascade_nb.inference import CascadePipeline, write_tiny_checkpoints
    with tempfile.TemporaryDirectory() as tmp:
        d, what = (Path(models), "real weights") if models else (write_tiny_checkpoints(tmp), "tiny-twin weights")
        pipe = CascadePipeline.from_dir(d, device=device, **({} if models else dict(stage_c="tiny", stage_b="tiny")))
        run = lambda: pipe.run(["a photo of a cat"] * 2, height=S["image"], width=S["image"], steps_c=S["steps"][0],
                               steps_b=S["steps"][1], seed=0, previews=False)
        run(); sync(device)                                          # load + warm up
        t0 = time.perf_counter(); res = run(); sync(device); dt = time.perf_counter() - t0
    out(f"sampling cascade {S['image']}x{S['image']} ({what}, {S['steps'][0]}+{S['steps'][1]} steps, batch 2) on {device.type}: "
        f"{2 / dt:.3f} images/s, {dt:.2f} s per batch, images {tuple(res.images.shape)}")

def check_train(S, device, dry):
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs" / "demo.yaml", [f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", "updates=4",
                          "save_every=4", "log_every=2", "num_workers=0", "batch_size=8", "tracker=none", "warmup_updates=1"])
        t0 = time.perf_counter(); res = train(cfg); dt = time.perf_counter() - t0
        net = res["net"]; dev = next(net.parameters()).device; del res, net; gc.collect()
        out(f"train demo through train() on {dev}: {cfg.train.updates} updates + save + sample grid in {dt:.1f} s")

def check_swap(S, device, dry):
    "Peak memory and step time of the 8 GB plan's step with N blocks swapped; the first step's loss as with none."
    from cascade_nb.block_swap import BlockSwapper, ActivationOffload
    from cascade_nb.optimizers import FusedBackward, OPTIMIZERS
    settings = dict(model_version=S["swap_preset"], batch_size=1, dtype="bfloat16", optimizer="adafactor",
                    gradient_checkpointing=True, fused_backward=True, stochastic_rounding=True, activation_offload=True)
    side, first = (24 if S is FULL else S["side"]), None
    for n in S["swap_blocks"]:
        cfg = official_config(**settings, blocks_to_swap=n)
        torch.manual_seed(0)
        with torch.device("cpu" if n else device): model = StageC.from_preset(S["swap_preset"]).to(torch.bfloat16)
        model.gradient_checkpointing = True
        try: build = lambda ps: OPTIMIZERS.choose("adafactor").build(ps, cfg.train, 1e-5)
        except ImportError as e: return out(f"swap: skipped ({e})")
        opt = FusedBackward(list(model.parameters()), build, stochastic_rounding=True)
        swap = BlockSwapper(model, n, device, [o.state for o in opt.opts]).place(model) if n else None
        ActivationOffload(model, pin_memory=device.type == "cuda")
        if device.type == "cuda": torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(device)
        x = inputs(model, 1, side, device, torch.bfloat16)
        times = []
        for k in range(S["iters"] // 2 + 1):
            sync(device); t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16): loss = model(**x).float().square().mean()
            loss.backward(); opt.grad_norm(); sync(device); times.append(time.perf_counter() - t0)
            if k == 0: first = loss.item() if first is None else first; same = loss.item() == first
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        planned = generator_rows(plan_memory(cfg))
        got = f"measured {peak / GB:6.2f} GB, ratio planned/measured {planned / peak:.3f}" if peak else "measured n/a (CPU)"
        out(f"swap {S['swap_preset']} {n} blocks swapped, batch 1 @{side * 32}, 8 GB plan settings: planned {planned / GB:6.2f} GB "
            f"vs {got}; {1e3 * min(times[1:]):8.1f} ms/step; first loss {'equal to' if same else 'DIFFERS from'} 0 blocks' "
            f"({len(swap.schedule) if swap else 0} moves logged)")
        del model, opt, swap; gc.collect()

CHECKS = {"step": check_step, "swap": check_swap, "memory": check_memory, "lora": check_lora, "sampling": check_sampling, "train": check_train}

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: checks the script, not the GPU")
    p.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ", ".join(CHECKS))
    p.add_argument("--models", default=None, help="directory of real checkpoints for the sampling check")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    if device.type == "cpu" and not a.dry_run: sys.exit("gpu_check: no CUDA device; use --dry-run to check the script on CPU")
    S = DRY if a.dry_run else FULL
    from cascade_nb.core import enable_tf32
    enable_tf32()
    t0 = time.perf_counter()
    out(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (dry run)'}, torch {torch.__version__}")
    for name in a.only.split(","):
        t = time.perf_counter()
        if name == "sampling": check_sampling(S, device, a.dry_run, a.models)
        else: CHECKS[name](S, device, a.dry_run)
        print(f"  ({name}: {time.perf_counter() - t:.1f} s)", flush=True)
    out(f"done in {time.perf_counter() - t0:.0f} s")

if __name__ == "__main__": main()
