"""Memory planner check: estimated vs measured activation bytes of a StageC forward+backward, 3 small configs, CPU.

    .venv/bin/python bench/memory_check.py [--batch 2] [--side 16]

Measured = the distinct non-parameter storages autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`);
estimated = `cascade_nb.memory.activation_bytes` (+ autocast weight copies, + merged LoRA weights), for six cases:
fp32, CPU bf16 autocast, bf16 weights, fp32 checkpointed, frozen generator with a ControlNet hint, LoRA r4 '.attn'.
One line per config: fp32 bytes and every case's ratio estimated / measured (target 0.8 - 1.2). Attention dropout is
off (CPU attention with dropout materialises the attention matrix; CUDA's kernels do not), see nbs/70_memory.ipynb.
"""
import argparse
import torch
from cascade_nb.memory import calibration_models, calibration_rows

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--side", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    all_rows = calibration_rows(args.batch, args.side)
    for name, model in calibration_models().items():
        rows = [r for r in all_rows if r["model"] == name]
        fp32 = rows[0]
        n = sum(q.numel() for q in model.parameters())
        ratios = ", ".join(f"{r['case']} {r['ratio']:.3f}" for r in rows)
        worst = max(abs(r["ratio"] - 1) for r in rows)
        print(f"memory_check {name} ({n / 1e6:.2f}M params, batch {args.batch}x{model.config['c_in']}x{args.side}x{args.side}, cpu): "
              f"fp32 estimated {fp32['estimated'] / 2**20:.2f} MiB vs measured {fp32['measured'] / 2**20:.2f} MiB; "
              f"ratio estimated/measured: {ratios}; worst {worst:.1%} off (target <= 20%)")

if __name__ == "__main__": main()
