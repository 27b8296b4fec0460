"""Training memory of a LoRA step with the base frozen (cascade_nb) vs the reference behaviour (base not frozen).

    .venv/bin/python bench/lora_memory.py            # mid size (12.5M params), rank 4, ['.attn']
    .venv/bin/python bench/lora_memory.py --size tiny

The reference's train_c_lora.py never calls `requires_grad_(False)` on the generator: autograd computes a gradient for
every base weight, keeps it (only the LoRA optimizer zeroes its own), and saves every layer input for those weight
gradients. Both variants run side by side in one process on the same model and batch; the memory counted is
weights + gradients + AdamW state + activations saved for backward (unique storages), which is what sets a GPU's
peak; on CUDA `torch.cuda.max_memory_allocated` is reported too. One line: both totals and the ratio.
"""
import argparse
import torch
from cascade_nb.models.stage_c import StageC
from cascade_nb.adapters import apply_lora, lora_layers

SIZES = {  # name: (StageC.from_preset('tiny') overrides, batch, latent side)
    'tiny': (dict(), 4, 24),
    'mid': (dict(c_cond=256, c_hidden=(256, 256), nhead=(4, 4), blocks=((2, 4), (4, 2)), c_clip_text=256,
                 c_clip_text_pooled=256, c_clip_img=256), 2, 24),
}

def nbytes(ts) -> int: return sum(t.numel() * t.element_size() for t in ts if t is not None)

def lora_step(overrides, B, hw, freeze_base: bool, device):
    "Memory (MB) of one LoRA training step: (weights, grads, optimizer state, saved activations, cuda peak or None)."
    torch.manual_seed(0)
    model = StageC.from_preset('tiny', **overrides).to(device)
    apply_lora(model, ['.attn'], rank=4)
    if not freeze_base: model.requires_grad_(True)                     # the reference: nothing frozen
    lora_params = [p for l in lora_layers(model).values() for p in l.parameters()]
    opt = torch.optim.AdamW(lora_params, lr=1e-4)                      # the reference optimises only the LoRA
    c = model.config
    g = torch.Generator().manual_seed(1)
    inp = dict(x=torch.randn(B, c['c_in'], hw, hw, generator=g), r=torch.rand(B, generator=g),
               clip_text=torch.randn(B, 77, c['c_clip_text'], generator=g),
               clip_text_pooled=torch.randn(B, 1, c['c_clip_text_pooled'], generator=g),
               clip_img=torch.randn(B, 1, c['c_clip_img'], generator=g))
    inp = {k: v.to(device) for k, v in inp.items()}
    if device.type == 'cuda': torch.cuda.reset_peak_memory_stats(device)
    seen = {}
    def pack(t):
        s = t.untyped_storage(); seen[s.data_ptr()] = s.nbytes(); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inp)
    out.square().mean().backward()
    opt.step()                                                          # base gradients stay allocated, as in the reference
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == 'cuda' else None
    MB = 2**20
    weights = nbytes(model.parameters()) / MB
    grads = nbytes(p.grad for p in model.parameters()) / MB
    state = nbytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)) / MB
    return weights, grads, state, sum(seen.values()) / MB, peak

def main():
    p = argparse.ArgumentParser()
    p.add_argument('--size', default='mid', choices=list(SIZES))
    args = p.parse_args()
    overrides, B, hw = SIZES[args.size]
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    frozen = lora_step(overrides, B, hw, True, device)
    ref = lora_step(overrides, B, hw, False, device)
    tot = lambda m: sum(m[:4])
    n = sum(p.numel() for p in StageC.from_preset('tiny', **overrides).parameters())
    cuda = f"; cuda peak {frozen[4]:.0f} vs {ref[4]:.0f} MB (ratio {ref[4] / frozen[4]:.2f}x)" if frozen[4] is not None else ""
    print(f"lora_memory {args.size} ({n / 1e6:.1f}M params, batch {B} of 16x{hw}x{hw}, rank 4, ['.attn'], {device.type}): "
          f"frozen base {tot(frozen):.0f} MB (grads {frozen[1]:.1f}, saved activations {frozen[3]:.0f}) vs "
          f"reference unfrozen {tot(ref):.0f} MB (grads {ref[1]:.1f}, saved activations {ref[3]:.0f}): "
          f"reference / frozen = {tot(ref) / tot(frozen):.2f}x{cuda}")

if __name__ == '__main__': main()
