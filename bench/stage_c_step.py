"""Stage C training step: cascade_nb's StageC vs diffusers' StableCascadeUNet, same weights and inputs, fp32 on CPU.

    .venv/bin/python bench/stage_c_step.py            # both configs
    .venv/bin/python bench/stage_c_step.py --iters 30 --threads 2

Forward + backward of each model alternate in one process; the line per config gives the median time of each,
the median of the per-pair ratios (ours / diffusers, lower is better, target <= 0.85) and the activation memory
each saves for backward (the term that sets peak training memory; unique tensor storages, MB).
"""
import argparse, statistics, time
import torch
from cascade_nb.models.stage_c import StageC
from cascade_nb.interop_c import stage_c_to_diffusers, DiffusersStageC
from cascade_nb.memory import saved_bytes

CONFIGS = {  # name: (StageC.from_preset overrides, batch, latent size)
    'tiny': (dict(), 4, 24),
    'mid': (dict(c_cond=256, c_hidden=(256, 256), nhead=(4, 4), blocks=((2, 4), (4, 2)), c_clip_text=256,
                 c_clip_text_pooled=256, c_clip_img=256), 2, 24),
}

def step(model, inp):
    model.zero_grad(set_to_none=True)
    out = []
    nbytes = saved_bytes(lambda: out.append(model(**inp)))   # every saved storage, parameters included
    out[0].square().mean().backward()
    return nbytes

def bench(name, iters):
    overrides, B, hw = CONFIGS[name]
    torch.manual_seed(0)
    ours = StageC.from_preset('tiny', **overrides)
    for p in ours.parameters(): torch.nn.init.normal_(p, std=0.02)   # non-zero everywhere, same in both
    theirs = DiffusersStageC(stage_c_to_diffusers(ours))
    c = ours.config
    inp = dict(x=torch.randn(B, c['c_in'], hw, hw), r=torch.rand(B), clip_text=torch.randn(B, 77, c['c_clip_text']),
               clip_text_pooled=torch.randn(B, 1, c['c_clip_text_pooled']), clip_img=torch.randn(B, 1, c['c_clip_img']))
    with torch.no_grad(): diff = (ours(**inp) - theirs(**inp)).abs().max().item()
    mem = {}
    for m in (ours, theirs): mem[m] = step(m, inp)   # warm-up
    times = {ours: [], theirs: []}
    for _ in range(iters):
        for m in (ours, theirs):
            t0 = time.perf_counter(); step(m, inp); times[m].append(time.perf_counter() - t0)
    ratio = statistics.median(a / b for a, b in zip(times[ours], times[theirs]))
    n = sum(p.numel() for p in ours.parameters())
    print(f"stage_c_step {name} ({n/1e6:.1f}M params, batch {B} of {c['c_in']}x{hw}x{hw}, {torch.get_num_threads()} threads): "
          f"ours {statistics.median(times[ours])*1e3:.0f} ms, diffusers {statistics.median(times[theirs])*1e3:.0f} ms, "
          f"median ratio {ratio:.2f}x; saved activations {mem[ours]/2**20:.0f} vs {mem[theirs]/2**20:.0f} MB; "
          f"max|diff| {diff:.1e}", flush=True)

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--configs', nargs='+', default=list(CONFIGS))
    ap.add_argument('--iters', type=int, default=15)
    ap.add_argument('--threads', type=int, default=None)
    args = ap.parse_args()
    if args.threads: torch.set_num_threads(args.threads)
    for name in args.configs: bench(name, args.iters)
