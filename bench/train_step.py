#!/usr/bin/env python
"""Overhead of cascade_nb's whole training step over the bare model step, side by side in one process.

bare  : generator forward + backward on a fixed noised batch (the irreducible work), then zero_grad
train : what `cascade_nb.train` does per update with data already in memory: GDF diffuse (noise, logSNR, target,
        loss weight) → generator → weighted MSE → accelerate backward → grad clipping → AdamW step → scheduler →
        EMA update (every update) → adaptive loss buckets
The two alternate for --iters rounds; the line printed is the median of per-round ratios (target ≤ 1.10).

    python bench/train_step.py [--preset tiny|mid] [--batch 8] [--iters 20] [--threads 1]
"""
import argparse, copy, statistics, time
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--preset", default="mid", choices=["tiny", "mid"])
p.add_argument("--batch", type=int, default=8)
p.add_argument("--iters", type=int, default=20)
p.add_argument("--threads", type=int, default=1)
args = p.parse_args()
torch.set_num_threads(args.threads)

from accelerate import Accelerator
from cascade_nb.models.stage_c import StageC
from cascade_nb.gdf.presets import stage_c_gdf
from cascade_nb.modes import diffusion_loss
from cascade_nb.ema import ema_update_
from cascade_nb.optimizers import LRSchedule

torch.manual_seed(0)
over = dict(tiny={}, mid=dict(c_hidden=(256, 256), nhead=(4, 4), blocks=((2, 4), (4, 2))))[args.preset]
model = StageC.from_preset("tiny", **over)
ema = copy.deepcopy(model).requires_grad_(False)
B, c = args.batch, model.clip_txt_mapper.in_features
x0 = torch.randn(B, 16, 24, 24)
conds = dict(clip_text=torch.randn(B, 77, c), clip_text_pooled=torch.randn(B, 1, c), clip_img=torch.zeros(B, 1, model.clip_img_mapper.in_features))
gdf = stage_c_gdf(adaptive_loss_weight=True)
acc = Accelerator(cpu=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
sched = torch.optim.lr_scheduler.LambdaLR(opt, LRSchedule(1, 1000))
model, opt, sched = acc.prepare(model, opt, sched)
fixed = gdf.diffuse(x0)
rng = torch.Generator().manual_seed(0)

def bare():
    pred = model(fixed.noised, fixed.noise_cond, **conds)
    F.mse_loss(pred, fixed.target).backward()
    model.zero_grad(set_to_none=True)

def full():
    with acc.accumulate(model):
        loss, raw, d = diffusion_loss(model, gdf, x0, conds, rng=rng)
        gdf.update_buckets(d.logsnr, raw.detach())
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
    sched.step()
    ema_update_(ema, acc.unwrap_model(model), 0.999)

def timed(f):
    t = time.perf_counter(); f(); return time.perf_counter() - t

for f in (bare, full, bare, full): f()   # warm-up
ratios, tb, tf = [], [], []
for _ in range(args.iters):
    b, f_ = timed(bare), timed(full)
    tb.append(b); tf.append(f_); ratios.append(f_ / b)
n = sum(p.numel() for p in model.parameters())
print(f"train_step {args.preset} ({n/1e6:.1f}M params, batch {B}x16x24x24, {args.threads} thread): whole step "
      f"{statistics.median(tf)*1e3:.1f} ms vs bare fwd+bwd {statistics.median(tb)*1e3:.1f} ms: median ratio "
      f"{statistics.median(ratios):.3f} (target <= 1.10)")
