#!/usr/bin/env python
"""Every optimizer and LR schedule on the README demo (configs/demo.yaml: the tiny text-conditioned Stage C on 32
emoji, 1200 updates of 16 images, scored by caption retrieval every 300 updates). One run per arm, one after the
other in this process, everything else as shipped (seed, data order, EMA, evaluation):

    python bench/optimizers_demo.py [--arms adamw,adafactor,...] [--updates 1200] [--json bench/optimizers_demo.json]

An arm is an optimizer with the LR its authors recommend relative to AdamW's (Prodigy: lr 1, it estimates the step
size; Lion: a tenth of AdamW's, with ten times its weight decay, as the Lion paper advises; CAME: a tenth too, since
at AdamW's LR it hardly learns (`came_at_adamw_lr`, measured); schedule-free AdamW: no decay schedule, it averages
instead; Muon: AdamW's own, its update being scaled to AdamW's size), or AdamW with another `lr_schedule`. Per arm it prints one line: the loss over
the last 100 updates, the retrieval top-1 of the EMA weights at the last evaluation and the best one, the run's CPU
seconds (this process, one thread, data decoded in-process) with the ratio to the shipped AdamW run, and the
optimizer state the memory planner counts for the demo's trained parameters (fp32), with its ratio to AdamW's."""
import argparse, json, math, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_runs import train_demo, demo_scores   # noqa: E402  the demo trained in this process, its logged scores

ARMS = {   # name -> config overrides on top of configs/demo.yaml (lr 4e-3, cosine, 50 warm-up updates)
    "adamw": [],
    "adamw8bit": ["optimizer=adamw8bit"],
    "adafactor": ["optimizer=adafactor"],
    "came": ["optimizer=came", "lr=4e-4"],
    "came_at_adamw_lr": ["optimizer=came"],
    "lion": ["optimizer=lion", "lr=4e-4", "weight_decay=0.1"],
    "prodigy": ["optimizer=prodigy", "lr=1.0"],
    "schedulefree_adamw": ["optimizer=schedulefree_adamw", "lr_schedule=constant"],
    # Muon's update is scaled to AdamW's RMS (Moonlight), so AdamW's LR; measured over 3 seeds through the trainer instead
    # (bench/results/muon_demo.json), not in this file's one-seed table
    "muon": ["optimizer=muon"],
    "constant": ["lr_schedule=constant"],
    "linear": ["lr_schedule=linear"],
    "cosine_with_restarts": ["lr_schedule=cosine_with_restarts", "lr_cycles=3"],
    "polynomial": ["lr_schedule=polynomial", "lr_power=2"],
    "rex": ["lr_schedule=rex"],
    "cosine_min_lr": ["min_lr=4e-4"],
}

p = argparse.ArgumentParser()
p.add_argument("--arms", default=",".join(ARMS))
p.add_argument("--updates", type=int, default=1200)
p.add_argument("--json", help="write (or update) the results here, one entry per arm")
args = p.parse_args()
from cascade_nb.optimizers import OPTIMIZERS   # noqa: E402

def run(name: str, tmp: str) -> dict:
    "Train one arm of the demo; its scores, CPU time and planned optimizer state."
    n = args.updates
    out, records, cpu = train_demo(name, ARMS[name], tmp, n)
    cfg, s = out["mode"].cfg, demo_scores(records, n)
    shapes = [p.shape for p in out["net"].parameters() if p.requires_grad]
    spec = OPTIMIZERS.choose(cfg.train.optimizer)
    state = spec.state_bytes_of(shapes, 4, cfg.train.optimizer_args)
    return dict(arm=name, overrides=ARMS[name], loss_last_100=s["loss_last_100"], top1_final=s["top1_final"],
                top1_best=s["top1_best"], top1_curve=s["top1_curve"], cpu_s=cpu, state_bytes=state,
                params=sum(math.prod(s) for s in shapes), updates=n)

results = {}
if args.json and Path(args.json).exists(): results = json.loads(Path(args.json).read_text())
for name in args.arms.split(","):
    with tempfile.TemporaryDirectory() as tmp: r = results[name] = run(name, tmp)
    ref = results.get("adamw")
    ratio = (f"; vs adamw: CPU x{r['cpu_s'] / ref['cpu_s']:.2f}, state x{r['state_bytes'] / ref['state_bytes']:.2f}"
             if ref and name != "adamw" else "")
    print(f"optimizers_demo {name} ({' '.join(r['overrides']) or 'as shipped'}, {r['updates']} updates): loss "
          f"{r['loss_last_100']:.4f} (last 100 updates), retrieval top-1 {r['top1_final']:.1%} (best "
          f"{r['top1_best']:.1%}), {r['cpu_s']:.0f} CPU-s, optimizer state {r['state_bytes'] / 2**20:.2f} MiB"
          + ratio, flush=True)
    if args.json: Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
