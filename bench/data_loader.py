"""Data loader throughput: the full pipeline (read + shuffle + decode/validate + bucket resize/crop + collate) with
0, 1 and 2 DataLoader workers vs a bare loop that only opens the tars and decodes each image with PIL, same data,
same process. One line per worker count:

    python bench/data_loader.py [--epochs 6]                      # two data sets, 3 lines each
    python bench/data_loader.py --source DIR --image-size S        # your own shards

Data sets: the shipped 64×64 emoji shards at image_size 64 (per-sample overheads dominate: the hardest case), and
400 JPEG crops (512×384, random boxes of data_samples/photos, packed into 4 shards in a temp folder) at
image_size 256 with multi-aspect buckets (decode and resize dominate: closer to real training).

`per-worker ratio` = pipeline images/s / (bare images/s × max(1, workers)); target >= 0.9.
"""
import argparse, io, random, sys, tarfile, tempfile, time
from pathlib import Path
from PIL import Image
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cascade_nb.data import build_dataloader, resolve_shards, write_shards

ROOT = Path(__file__).resolve().parents[1]

def photo_crops(out_dir, n=400, size=(512, 384)):
    "Shards of `n` JPEG crops of the sample photos (deterministic)."
    rng, photos = random.Random(0), [Image.open(p).convert("RGB") for p in sorted((ROOT / "data_samples" / "photos").glob("*.jpg"))]
    def samples():
        for i in range(n):
            im = photos[i % len(photos)]
            w, h = (size if i % 2 else size[::-1])
            scale = max(w / im.width, h / im.height) * rng.uniform(1, 1.5)
            big = im.resize((int(im.width * scale) + 1, int(im.height * scale) + 1))
            l, t = rng.randrange(big.width - w + 1), rng.randrange(big.height - h + 1)
            buf = io.BytesIO(); big.crop((l, t, l + w, t + h)).save(buf, "JPEG", quality=90)
            yield {"__key__": f"{i:06d}", "jpg": buf.getvalue(), "txt": f"photo crop {i}"}
    write_shards(samples(), out_dir, shard_size=n // 4)
    return out_dir

def bare_loop(shards, epochs):
    n = 0
    for _ in range(epochs):
        for s in shards:
            with tarfile.open(s["url"], "r|*") as tar:
                for m in tar:
                    if m.isfile() and m.name.rsplit(".", 1)[-1] in ("png", "jpg", "jpeg", "webp"):
                        Image.open(io.BytesIO(tar.extractfile(m).read())).convert("RGB"); n += 1
    return n

def pipeline(source, workers, epochs, image_size, batch_size, ratios):
    dl = build_dataloader(source, batch_size, num_workers=workers, image_size=image_size, persistent_workers=workers > 0,
                          drop_last=False, shuffle_buffer=256, multi_aspect_ratio=ratios)
    n = 0
    for e in range(epochs):
        dl.dataset.set_epoch(e)
        n += sum(b["images"].shape[0] for b in dl)
    return n

def timed(fn, *a):
    t = time.perf_counter(); n = fn(*a); return n / (time.perf_counter() - t), n

def bench(name, source, image_size, epochs, batch_size, ratios=None):
    shards = resolve_shards(source)
    bare_loop(shards, 1)   # warm the page cache
    bare, n_bare = timed(bare_loop, shards, epochs)
    for w in (0, 1, 2):
        ips, n = timed(pipeline, source, w, epochs, image_size, batch_size, ratios)
        print(f"data_loader {name} workers={w}: pipeline {ips:6.0f} img/s vs bare PIL loop {bare:6.0f} img/s "
              f"({n} vs {n_bare} images): ratio {ips / bare:.2f}, per-worker ratio {ips / (bare * max(1, w)):.2f}", flush=True)

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=None)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args()
    if args.source:
        return bench(Path(args.source).name, args.source, args.image_size, args.epochs, args.batch_size)
    bench("emoji64", ROOT / "data_samples" / "emoji", 64, args.epochs * 3, args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        bench("photo512->256", photo_crops(Path(tmp)), 256, args.epochs, 16, ["1/1", "3/4"])

if __name__ == "__main__": main()
