"""Cost of `GDF.diffuse` relative to a training step of a tiny StageC on the same batch.

Run: `.venv/bin/python bench/gdf_diffuse.py [--batch 64] [--reps 7]`. Prints one line: the median time of
`stage_c_gdf(adaptive_loss_weight=True).diffuse(x0)` on a (B, 16, 24, 24) batch, the median time of a tiny StageC forward + backward on the
noised batch, and their ratio (target: < 2%). Both are timed interleaved in one process, after a warm-up.
"""
import argparse, statistics, time
import torch
from cascade_nb.gdf import stage_c_gdf
from cascade_nb.models.stage_c import StageC

def timed(fn) -> float:
    t0 = time.perf_counter(); fn(); return time.perf_counter() - t0

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    B = args.batch
    gdf = stage_c_gdf(adaptive_loss_weight=True)
    model = StageC.from_preset("tiny")
    c = model.clip_txt_mapper.in_features
    x0 = torch.randn(B, 16, 24, 24)
    conds = dict(clip_text=torch.randn(B, 77, c), clip_text_pooled=torch.randn(B, 1, c),
                 clip_img=torch.randn(B, 1, model.clip_img_mapper.in_features))

    def diffuse(): gdf.diffuse(x0)
    def train_step():
        d = gdf.diffuse(x0)
        loss = ((model(d.noised, d.noise_cond, **conds) - d.target) ** 2).mean((1, 2, 3))
        (loss * d.loss_weight).mean().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2): diffuse(); train_step()  # warm-up
    t_diffuse, t_step = [], []
    for _ in range(args.reps):
        t_diffuse += [timed(diffuse) for _ in range(5)]
        t_step.append(timed(train_step))
    d, s = statistics.median(t_diffuse), statistics.median(t_step)
    print(f"gdf_diffuse: diffuse {d*1e3:.2f} ms vs tiny StageC fwd+bwd {s*1e3:.0f} ms on ({B},16,24,24), "
          f"{torch.get_num_threads()} threads: ratio {100*d/s:.2f}% (target < 2%)")

if __name__ == "__main__": main()
