#!/usr/bin/env python
"""Progressive resolution on the README demo: does a `resolution_schedule` reach a given validation loss in less CPU
time than training at the final side throughout? Both runs in one process, one after the other, same config otherwise:

final : configs/demo.yaml at image_size=32 (the 32 emoji at 32², batch 16, lr 4e-3 cosine, EMA), all updates at 32²
sched : the same with resolution_schedule=[[0, 16], [SWITCH, 32]]

Both validate every --val-every updates on the 32 training emoji at 32² (centre-cropped, 8 fixed noise levels, fixed
noise: the same images and noise for both runs; the demo has no held-out set, so this measures fit, not
generalisation). CPU time is this process's (time.process_time, one thread, data decoded in-process with
num_workers=0), counted from the first update, validation excluded. The target is the validation loss `final` reaches
at its last update; the line printed compares the CPU seconds each run needs to first reach it:

    python bench/resolution_schedule.py [--updates 200] [--switch 100] [--val-every 20] [--seed 0] [--order sched,final]
                                        [--sched-updates N]   # the scheduled run longer (its own cosine), e.g. equal CPU
"""
import argparse, json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

p = argparse.ArgumentParser()
p.add_argument("--updates", type=int, default=200)
p.add_argument("--switch", type=int, default=100)
p.add_argument("--sched-updates", type=int, help="updates of the scheduled run (its own cosine); default --updates")
p.add_argument("--val-every", type=int, default=20)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--order", default="sched,final")
p.add_argument("--json", help="also write the validation curves here")
args = p.parse_args()
torch.set_num_threads(1)

import cascade_nb.train as T
from cascade_nb.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
ARMS = {"final": [], "sched": [f"resolution_schedule=[[0, 16], [{args.switch}, 32]]"]}

def run(name, extra, tmp):
    "Train one arm; [(update, training CPU-s so far, validation loss)] at each validation."
    updates = (args.sched_updates or args.updates) if name == "sched" else args.updates
    shards = load_config(DEMO, ["webdataset_path=x"]).data   # the demo's source, filters kept
    cfg = load_config(DEMO, [f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", "image_size=32",
                             f"updates={updates}", f"save_every={updates}", "backup_every=1000000", f"seed={args.seed}",
                             "num_workers=0", "tracker=none", f"log_every={args.val_every}", "eval_every=null", "best_metric=null",
                             f"val_every={args.val_every}", "val_batches=2", *extra])
    cfg.data.val_webdataset_path = cfg.data.webdataset_path   # the 32 training emoji, at 32², in order
    clock, points = {"start": None, "val": 0.0}, []
    training_data, validate = T.training_data, T.validate
    def timed_data(*a, **kw):
        out = training_data(*a, **kw); clock["start"] = time.process_time(); return out
    def timed_validate(run, val_batches):
        t0 = time.process_time()
        vl = validate(run, val_batches)
        points.append((run.state.update, t0 - clock["start"] - clock["val"], vl))
        clock["val"] += time.process_time() - t0
        return vl
    T.training_data, T.validate = timed_data, timed_validate
    try: T.train(cfg)
    finally: T.training_data, T.validate = training_data, validate
    return points

def first_below(points, target):
    return next(((u, c) for u, c, v in points if v <= target), None)

with tempfile.TemporaryDirectory() as tmp:
    curves = {name: run(name, ARMS[name], tmp) for name in args.order.split(",")}
target = curves["final"][-1][2]
reach = {n: first_below(c, target) for n, c in curves.items()}
for n, c in curves.items():
    print(f"{n:5s} " + "  ".join(f"{u}:{v:.4f}@{cpu:.0f}s" for u, cpu, v in c))
f_u, f_cpu = reach["final"]
head = (f"resolution_schedule demo (32 emoji, batch 16, {args.updates} updates, seed {args.seed}): 32² throughout reaches "
        f"val {target:.4f} at update {f_u} in {f_cpu:.0f} CPU-s; 16²→32² (switch at {args.switch}"
        + (f", {args.sched_updates} updates" if args.sched_updates else "") + ") ")
if reach["sched"] is None:
    best = min(curves["sched"], key=lambda x: x[2])
    print(head + f"does not reach it (best {best[2]:.4f} at update {best[0]}, {best[1]:.0f} CPU-s; its last: "
          f"{curves['sched'][-1][2]:.4f} in {curves['sched'][-1][1]:.0f} CPU-s)")
else:
    s_u, s_cpu = reach["sched"]
    print(head + f"reaches it at update {s_u} in {s_cpu:.0f} CPU-s: ratio sched/final = {s_cpu / f_cpu:.2f} (< 1: the schedule is faster)")
if args.json: Path(args.json).write_text(json.dumps({"args": vars(args), "curves": curves}, indent=1))
