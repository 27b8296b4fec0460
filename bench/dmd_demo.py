#!/usr/bin/env python
"""The DMD student against its teacher (issue 47's evidence), on the README demo.

For each sampling seed: caption retrieval top-1 of one sample per caption (the demo's metric, cascade_nb.eval), the
diversity of 8 samples per caption (mean pairwise RMS pixel distance between samples of the same caption from 8
different initial noises, averaged over the 32 captions) and its ratio to the teacher's, and network evaluations per
image: teacher DDPM@20 CFG 3 (the demo's sampling), the DMD student at 1 and 4 steps of its lcm sampler, CFG 1, and
optionally an lcm student (configs/lcm_demo.yaml) at its own sampler and steps.

    accelerate launch cascade_nb/train.py configs/demo.yaml                                 # the teacher
    accelerate launch cascade_nb/train.py configs/dmd_demo.yaml                             # the DMD student
    accelerate launch cascade_nb/train.py configs/lcm_demo.yaml                             # an LCM student (figure)
    python bench/dmd_demo.py --teacher checkpoints/demo --dmd checkpoints/dmd_demo --seeds 0 1 2   # bench/RESULTS.md
    python bench/dmd_demo.py --teacher checkpoints/demo --dmd checkpoints/dmd_demo --lcm checkpoints/lcm_demo \\
        --seeds 0 --figure nbs/images/dmd_demo_grid.png --curves nbs/images/dmd_demo_curves.png

`--figure PNG` draws the same captions and noise through each sampler; `--curves PNG` scores each run's numbered
backups (backup_every, its EMA) at 1 and 4 steps on the first seed: retrieval and diversity against updates.
"""
import argparse, itertools, re, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cascade_nb.config import load_config
from cascade_nb.eval import reference_set, sample_captions, Retrieval
from cascade_nb.fast_sampling import nfe
from cascade_nb.sample import load_run

def samples(run, captions, seed, kw, net=None):
    return sample_captions(*run, captions, seed=seed, net=net, steps=kw["steps"], sampler=kw["sampler"],
                           cfg_scale=kw["cfg_scale"])

def diversity(run, captions, seed, kw, n=8, net=None) -> float:
    "Mean pairwise RMS distance between `n` samples per caption (initial noises seed + 1000 j), over the captions."
    xs = torch.stack([samples(run, captions, seed + 1000 * j, kw, net) for j in range(n)], 1)   # (N, n, C, H, W)
    d = [(xs[:, i] - xs[:, j]).pow(2).flatten(1).mean(1).sqrt() for i, j in itertools.combinations(range(n), 2)]
    return torch.stack(d, 1).mean().item()

def entries(a) -> dict:
    t, e = load_run(a.teacher), {}
    e["teacher DDPM@20 CFG 3"] = (t, dict(sampler="ddpm", steps=20, cfg_scale=3.0))
    if a.lcm:
        s = load_run(a.lcm); g = s[2].gdf
        e[f"LCM student {g.sample_sampler}@{g.sample_steps}"] = (s, dict(sampler=g.sample_sampler, steps=g.sample_steps,
                                                                         cfg_scale=1.0))
    for run in a.dmd:   # several runs: named by their directories
        d, tag = load_run(run, ema=False if a.live else None), f" [{Path(run).name}]" if len(a.dmd) > 1 else ""
        for k in a.steps: e[f"DMD student lcm@{k}{tag}"] = (d, dict(sampler="lcm", steps=k, cfg_scale=1.0))
    return e

def table(e, captions, ref, seed) -> list[dict]:
    rows, teacher_div = [], None
    for name, (run, kw) in e.items():
        top1 = Retrieval()(samples(run, captions, seed, kw), captions, *ref)["top1"]
        div = diversity(run, captions, seed, kw)
        teacher_div = teacher_div or div
        rows.append(dict(name=name, top1=top1, div=div, ratio=div / teacher_div, nfe=nfe(kw["steps"], kw["cfg_scale"])))
    return rows

def figure(e, captions, path, seed=0, n=8):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(n * 0.9, len(e) * 1.1))
    for i, (name, (run, kw)) in enumerate(e.items()):
        ax = fig.add_subplot(len(e), 1, i + 1)
        x = samples(run, captions[:n], seed, kw).clamp(0, 1)                          # (n, 3, H, W) -> one row
        ax.imshow(torch.cat(list(x), 2).permute(1, 2, 0))
        ax.set_axis_off(); ax.set_title(f"{name} ({nfe(kw['steps'], kw['cfg_scale'])} NFE)", fontsize=8)
    fig.suptitle(", ".join(captions[:n]), fontsize=7); fig.tight_layout(); fig.savefig(path, dpi=100)

def curves(a, e, captions, ref, path, seed=0):
    "Retrieval and diversity ratio of the run's backups generator[_ema]_N.safetensors at 1 and 4 steps."
    from matplotlib.figure import Figure
    from safetensors.torch import load_file
    trun, tkw = e["teacher DDPM@20 CFG 3"]
    teacher_div = diversity(trun, captions, seed, tkw)
    fig = Figure(figsize=(8, 3)); ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for dmd in a.dmd:   # each run loaded once, each of its backups read once, scored at every step count
        run = load_run(dmd); net = run[0].net
        pat = re.compile(r"generator_ema_(\d+)(k?)\.safetensors" if list(Path(dmd).glob("generator_ema_*")) else
                         r"generator_(\d+)(k?)\.safetensors")   # _900, _1k, _1100 (train.backup_suffix)
        files = sorted((int(m.group(1)) * (1000 if m.group(2) else 1), f)
                       for f in Path(dmd).glob("generator*_*.safetensors") if (m := pat.fullmatch(f.name)))
        pts = {k: [] for k in a.steps}
        for u, f in files:
            net.load_state_dict(load_file(str(f)))
            for k, kw in ((k, dict(sampler="lcm", steps=k, cfg_scale=1.0)) for k in a.steps):
                pts[k].append((u, Retrieval()(samples(run, captions, seed, kw, net), captions, *ref)["top1"],
                               diversity(run, captions, seed, kw, net=net) / teacher_div))
                print(f"{Path(dmd).name} update {u} @{k}: top1 {pts[k][-1][1]:.3f}, "
                      f"diversity {pts[k][-1][2]:.2f}x teacher")
        for k, ps in pts.items():
            ax1.plot([p[0] for p in ps], [p[1] for p in ps], "o-", label=f"{Path(dmd).name} @{k}")
            ax2.plot([p[0] for p in ps], [p[2] for p in ps], "o-", label=f"{Path(dmd).name} @{k}")
    top = Retrieval()(samples(trun, captions, seed, tkw), captions, *ref)["top1"]
    ax1.axhline(top, color="k", ls="--", label="teacher DDPM@20 CFG 3"); ax2.axhline(1, color="k", ls="--")
    ax2.axhline(0.8, color="r", ls=":", label="0.8x teacher")
    ax1.set(xlabel="update", ylabel="retrieval top-1"); ax2.set(xlabel="update", ylabel="diversity / teacher's")
    ax1.legend(fontsize=7); ax2.legend(fontsize=7); fig.tight_layout(); fig.savefig(path, dpi=100)

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", default="checkpoints/demo")
    p.add_argument("--dmd", nargs="+", default=["checkpoints/dmd_demo"], help="DMD runs, each at --steps")
    p.add_argument("--lcm", default=None, help="an lcm student run (configs/lcm_demo.yaml), sampled as it says")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--live", action="store_true", help="the DMD run's live weights, not its EMA")
    p.add_argument("--figure", default=None)
    p.add_argument("--curves", default=None)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    root = Path(__file__).resolve().parents[1]
    ref = reference_set(load_config(root/"configs"/"demo.yaml",
                                    [f"webdataset_path={root}/data_samples/emoji/shard-{{000002..000005}}.tar"]))
    captions = list(dict.fromkeys(ref[1]))
    e = entries(a)
    for seed in a.seeds:
        print(f"\nseed {seed}, {len(captions)} captions, diversity of 8 samples per caption\n"
              "| sampler | retrieval top-1 | diversity | vs teacher | NFE |\n|---|---|---|---|---|")
        for r in table(e, captions, ref, seed):
            print(f"| {r['name']} | {r['top1']:.3f} | {r['div']:.4f} | {r['ratio']:.2f} | {r['nfe']} |")
    if a.figure: figure(e, captions, a.figure)
    if a.curves: curves(a, e, captions, ref, a.curves)
