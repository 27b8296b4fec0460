"""Refresh the demo pictures in nbs/images/ (README and training notebook) from a finished demo run.

    accelerate launch cascade_nb/train.py configs/demo.yaml
    python tools/make_demo_images.py outputs/demo

Writes demo_grid.png (the last sample grid), demo_loss.png (the run's loss curve), demo_progress.png (every
saved grid, top to bottom, each headed "after N updates") and, when the run evaluated (eval_every), demo_eval.png: the
last evaluation's samples, each above the training image of its caption and with the caption written under the pair,
enlarged so a reader can tell the emoji apart, headed by the update and the logged caption-retrieval top-1.
"""
import argparse, json, shutil, sys, textwrap
from pathlib import Path
from PIL import Image, ImageDraw, ImageFont

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

def eval_cells(grid: Image.Image, pad: int = 2) -> list[tuple[Image.Image, Image.Image]]:
    "(sample, training image) per column of an eval grid (cascade_nb.eval: rows 'sample' and 'data', labels on the left)."
    h = (grid.height - pad) // 2 - pad                    # to_pil_grid: two rows of h + pad, plus pad
    x0 = 8 + 7 * len("sample")                           # save_sample_grid's label column for the row names
    n = (grid.width - x0 - pad) // (h + pad)
    cell = lambda i, j: grid.crop((x0 + pad + j * (h + pad), pad + i * (h + pad), x0 + pad + j * (h + pad) + h, pad + i * (h + pad) + h))
    return [(cell(0, j), cell(1, j)) for j in range(n)]

def eval_picture(grid_path: Path, metrics_path: Path, ncols: int = 8, scale: int = 4) -> Image.Image:
    "The eval grid at `grid_path` (+ its .txt captions) as a captioned picture: sample over training image, caption below."
    grid = Image.open(grid_path).convert("RGB")
    caps = grid_path.with_suffix(".txt").read_text().splitlines()
    cells = eval_cells(grid)[:len(caps)]
    update = int(grid_path.stem.split("_")[-1])
    rows = [json.loads(l) for l in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    top1 = next((r["eval/retrieval/top1"] for r in rows if r.get("update") == update and "eval/retrieval/top1" in r), None)
    font = ImageFont.load_default(size=13)
    s = cells[0][0].width * scale; cw, lines, header = s + 24, 2, 26
    nrows = -(-len(cells) // ncols)
    out = Image.new("RGB", (ncols * cw, header + nrows * (2 * s + 6 + lines * 15 + 10)), "white")
    draw = ImageDraw.Draw(out)
    title = f"after {update} updates: sample (top) for each caption, its training image (below)"
    if top1 is not None: title += f"; caption-retrieval top-1 {top1:.0%}"
    draw.text((6, 5), title, fill="black", font=font)
    for k, ((sample, data), cap) in enumerate(zip(cells, caps)):
        x, y = (k % ncols) * cw + 12, header + (k // ncols) * (2 * s + 6 + lines * 15 + 10)
        out.paste(sample.resize((s, s), Image.NEAREST), (x, y)); out.paste(data.resize((s, s), Image.NEAREST), (x, y + s + 2))
        for i, line in enumerate(textwrap.wrap(cap, 11)[:lines]):
            draw.text((x + s / 2, y + 2 * s + 6 + i * 15), line, fill="black", font=font, anchor="ma")
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
    evals = sorted(args.run_output.glob("eval_[0-9]*.png"))
    if evals:
        eval_picture(evals[-1], args.run_output / "metrics.jsonl").save(args.images / "demo_eval.png", optimize=True)
        print(f"wrote demo_eval.png ({evals[-1].name}) to {args.images}")

if __name__ == "__main__": main()
