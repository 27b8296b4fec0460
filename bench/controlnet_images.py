#!/usr/bin/env python
"""Does a ControlNet trained on control images from the data follow a user's control image? (issue 49)

    accelerate launch cascade_nb/train.py configs/demo.yaml                     # the base model (the README demo)
    accelerate launch cascade_nb/train.py configs/controlnet_images_demo.yaml   # its ControlNet on the silhouettes
    python bench/controlnet_images.py --run checkpoints/controlnet_images_demo --base checkpoints/demo --seeds 0 1 2

For each of the demo's 32 captions, three control images (silhouettes, white on black, at the run's 16×16):
  own       its emoji's silhouette, as in the data;
  shifted   that silhouette moved 4 pixels right and down (a place the data's centred emoji never had);
  other     another emoji's silhouette (the next caption's): a shape the caption never had.
A sample's shape is its pixels that are not the white background (max over channels of 1 − value > 0.19); the score is
the IoU of that shape with the control's white area: for the ControlNet's samples, and as the reference for the base
model's samples of the same caption and seed (no control). Prints one comparable line and writes
nbs/images/controlnet_images.png (for 8 captions: the `other` controls, the base's samples, the ControlNet's).
"""
import argparse, sys
from pathlib import Path
import torch
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cascade_nb.core import to_pil_grid
from cascade_nb.sample import load_run, sample_run, read_control

p = argparse.ArgumentParser()
p.add_argument("--run", default="checkpoints/controlnet_images_demo")
p.add_argument("--base", default="checkpoints/demo")
p.add_argument("--seeds", type=int, nargs="+", default=[0])
p.add_argument("--threads", type=int, default=1)
p.add_argument("--picture", default=str(ROOT / "nbs" / "images" / "controlnet_images.png"))
a = p.parse_args()
torch.set_num_threads(a.threads)

folder = ROOT / "data_samples" / "emoji_control"
keys = sorted(f.stem for f in folder.glob("*.txt"))
captions = [(folder / f"{k}.txt").read_text().strip() for k in keys]
cnet, base = load_run(a.run), load_run(a.base)
size = cnet[2].data.image_size
own = torch.cat([read_control(folder / f"{k}.control.png", size) for k in keys])          # (32, 3, 16, 16)
shifted = torch.zeros_like(own); shifted[..., 4:, 4:] = own[..., :-4, :-4]
controls = {"own": own, "shifted": shifted, "other": own.roll(-1, 0)}

def shape_of(images: torch.Tensor) -> torch.Tensor: return (1 - images).amax(1) > 0.19   # not the white background
def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a & b).flatten(1).sum(1) / (a | b).flatten(1).sum(1).clamp(min=1)

scores = {k: {"controlnet": [], "base": []} for k in controls}
for seed in a.seeds:
    plain = sample_run(*base, captions, n=1, seed=seed)
    for kind, ctrl in controls.items():
        followed = sample_run(*cnet, captions, n=1, seed=seed, control=ctrl)
        target = ctrl[:, 0] > 0.5
        scores[kind]["controlnet"].append(iou(shape_of(followed), target).mean().item())
        scores[kind]["base"].append(iou(shape_of(plain), target).mean().item())
        if kind == "other" and seed == a.seeds[0]:
            to_pil_grid([ctrl[:8], plain[:8], followed[:8]]).resize((8 * 18 * 6, 3 * 18 * 6), 0).save(a.picture)

mean = lambda v: sum(v) / len(v)
parts = [f"{k} {mean(s['controlnet']):.3f} vs {mean(s['base']):.3f} ({mean(s['controlnet']) / mean(s['base']):.2f}x)"
         for k, s in scores.items()]
print(f"controlnet_images: IoU of the sample's shape with the control's, ControlNet vs base (no control), "
      f"{len(captions)} captions x seeds {' '.join(map(str, a.seeds))}: " + "; ".join(parts))
print(f"picture: {a.picture}")
