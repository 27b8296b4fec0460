"""Refresh the demo pictures in nbs/images/ (README and training notebook) from a finished demo run.

    accelerate launch cascade_nb/train.py configs/demo.yaml
    python tools/make_demo_images.py outputs/demo

Writes demo_grid.png (the last sample grid), demo_loss.png (the run's loss curve) and demo_progress.png (every
saved grid, top to bottom, each headed "after N updates").
"""
import argparse, shutil, sys
from pathlib import Path
from PIL import Image, ImageDraw

IMAGES = Path(__file__).resolve().parents[1] / "nbs" / "images"

def progress_strip(grids: list[Path], header: int = 18) -> Image.Image:
    "The grids stacked vertically, each under a one-line 'after N updates' header."
    ims = [Image.open(g).convert("RGB") for g in grids]
    out = Image.new("RGB", (max(im.width for im in ims), sum(im.height + header for im in ims)), "white")
    draw, y = ImageDraw.Draw(out), 0
    for g, im in zip(grids, ims):
        draw.text((4, y + 3), f"after {int(g.stem)} updates", fill="black")
        out.paste(im, (0, y + header)); y += header + im.height
    return out

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_output", type=Path, help="the demo's {output_path}/{experiment_id}, e.g. outputs/demo")
    ap.add_argument("--images", type=Path, default=IMAGES, help="where the pictures go (default: nbs/images)")
    args = ap.parse_args(argv)
    grids = sorted(p for p in args.run_output.glob("*.png") if p.stem.isdigit())
    if not grids or not (args.run_output / "loss.png").exists():
        sys.exit(f"{args.run_output}: expected NNNNNN.png sample grids and loss.png from a finished run")
    shutil.copyfile(grids[-1], args.images / "demo_grid.png")
    shutil.copyfile(args.run_output / "loss.png", args.images / "demo_loss.png")
    progress_strip(grids).quantize(256).save(args.images / "demo_progress.png", optimize=True)   # a palette: ⅓ the bytes
    print(f"wrote demo_grid.png ({grids[-1].name}), demo_loss.png, demo_progress.png ({len(grids)} grids) to {args.images}")

if __name__ == "__main__": main()
