"""Regenerate `data_samples/`: emoji shards for the demo and tests, plus a few real non-square photos.

    apt-get install -y fonts-noto-color-emoji          # NotoColorEmoji.ttf (SIL OFL 1.1)
    pip download --no-deps scikit-image -d /tmp/skimg  # only for the photos; scikit-image is not installed
    python tools/make_data_samples.py [--skimage-wheel /tmp/skimg/scikit_image-*.whl]

Output (deterministic: rerunning gives byte-identical shards):
- data_samples/emoji/shard-000000.tar ...: 64×64 RGB emoji on white, `NNNN.png` + `NNNN.txt` (lowercase Unicode
  name, e.g. "red apple") + `NNNN.json` (width, height, codepoint, group, source, license).
- data_samples/masked/: 12 of the emoji with their white background cut out (`loss_mask`): even keys as RGBA
  `NNNN.png` (the alpha is the mask), odd keys as the RGB `NNNN.png` plus a grey `NNNN.mask.png` member.
- data_samples/emoji_control/: the 32 emoji of the README's demo (configs/demo.yaml's filter) with a control image
  each for a ControlNet that reads them from the data: `NNNN.png` + `NNNN.txt` + `NNNN.control.png`, the emoji's
  silhouette (the `masked/` cut-out rule: white where the emoji is, black where its white background is).
- data_samples/photos/: NNNN.jpg + NNNN.txt + NNNN.json, non-square photos from scikit-image's bundled data
  (public domain / CC0), a loose-folder source for the aspect-bucket path.
"""
from __future__ import annotations
import argparse, glob, io, json, unicodedata, zipfile
from pathlib import Path
from PIL import Image, ImageDraw, ImageFont

from cascade_nb.data.sources import write_shards

FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
ROOT = Path(__file__).resolve().parents[1] / "data_samples"

# Visually distinct groups: a prompt names one emoji, and its colours/shape make it learnable at 64x64.
GROUPS = {
    "face":   [(0x1F600, 0x1F637), (0x1F641, 0x1F644), (0x1F910, 0x1F92F), (0x1F970, 0x1F976)],
    "cat":    [(0x1F638, 0x1F640)],
    "animal": [(0x1F400, 0x1F43C), (0x1F980, 0x1F9AE)],
    "food":   [(0x1F345, 0x1F37F), (0x1F950, 0x1F96F)],
    "plant":  [(0x1F330, 0x1F344)],
}
SIZE, RENDER_SIZE, SHARD_SIZE = 64, 109, 64   # 109 is the one bitmap size NotoColorEmoji ships

def render_emoji(ch: str, font) -> Image.Image | None:
    "The emoji on a white 64×64 RGB square, or None if the font has no glyph for it."
    canvas = Image.new("RGBA", (160, 160), (255, 255, 255, 0))
    ImageDraw.Draw(canvas).text((12, 12), ch, font=font, embedded_color=True)
    box = canvas.getbbox()
    if box is None: return None
    glyph = canvas.crop(box)
    if glyph.width < 40 or glyph.height < 20: return None   # .notdef / tofu or a tiny mark
    side = max(glyph.size)
    square = Image.new("RGBA", (side, side), (255, 255, 255, 0))
    square.paste(glyph, ((side - glyph.width) // 2, (side - glyph.height) // 2))
    white = Image.new("RGBA", square.size, (255, 255, 255, 255))
    rgb = Image.alpha_composite(white, square).convert("RGB")
    pad = int(side * 0.08)   # a white margin like an icon
    framed = Image.new("RGB", (side + 2 * pad, side + 2 * pad), (255, 255, 255))
    framed.paste(rgb, (pad, pad))
    return framed.resize((SIZE, SIZE), Image.Resampling.LANCZOS)

def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO(); img.save(buf, format="PNG", optimize=True); return buf.getvalue()

def emoji_samples():
    font = ImageFont.truetype(FONT, RENDER_SIZE)
    n = 0
    for group, ranges in GROUPS.items():
        for lo, hi in ranges:
            for cp in range(lo, hi + 1):
                ch = chr(cp)
                name = unicodedata.name(ch, "").lower()
                img = render_emoji(ch, font) if name else None
                if img is None: continue
                meta = dict(width=SIZE, height=SIZE, codepoint=f"U+{cp:04X}", group=group, caption=name,
                            source="Noto Color Emoji 2.042 (Debian fonts-noto-color-emoji)", license="OFL-1.1")
                yield {"__key__": f"{n:04d}", "png": png_bytes(img), "txt": name, "json": json.dumps(meta)}
                n += 1

# name in skimage/data, caption, licence (from scikit-image's data docstrings), optional crop box (l, t, r, b)
PHOTOS = [
    ("chelsea.png", "a tabby cat lying on a rug", "CC0, photographer Stefan van der Walt", None),
    ("coffee.png", "a cup of coffee on a saucer on a wooden table", "CC0, photographer Rachel Michetti", None),
    ("rocket.jpg", "a rocket on the launch pad", "public domain, SpaceX", None),
    ("rocket.jpg", "a white rocket launching into a blue sky, tall crop", "public domain, SpaceX", (230, 0, 470, 427)),
    ("hubble_deep_field.jpg", "galaxies in the hubble extreme deep field", "public domain, NASA", None),
    ("astronaut.png", "portrait of astronaut eileen collins, tall crop", "public domain, NASA", (128, 0, 416, 512)),
]

def photo_samples(wheel: str):
    with zipfile.ZipFile(wheel) as z:
        for i, (name, caption, lic, box) in enumerate(PHOTOS):
            img = Image.open(io.BytesIO(z.read(f"skimage/data/{name}"))).convert("RGB")
            if box: img = img.crop(box)
            buf = io.BytesIO(); img.save(buf, format="JPEG", quality=90)
            meta = dict(width=img.width, height=img.height, source=f"scikit-image data/{name}", license=lic, caption=caption)
            yield {"__key__": f"{i:04d}", "jpg": buf.getvalue(), "txt": caption, "json": json.dumps(meta)}

MASKED = 12
"Emoji of the first shard made into masked samples."

def masked_samples(emoji_dir: Path):
    "The first `MASKED` emoji, their white background cut out: even keys in the alpha channel, odd keys as a mask member."
    import tarfile
    import numpy as np
    with tarfile.open(emoji_dir / "shard-000000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for i in range(MASKED):
        rgb = Image.open(io.BytesIO(members[f"{i:04d}.png"])).convert("RGB")
        mask = silhouette(rgb)   # the background: near-white pixels connected to the margin
        s = {"__key__": f"{i:04d}", "txt": members[f"{i:04d}.txt"]}
        if i % 2 == 0: rgba = rgb.copy(); rgba.putalpha(mask); s["png"] = png_bytes(rgba)
        else: s["png"], s["mask.png"] = png_bytes(rgb), png_bytes(mask)
        yield s

def silhouette(rgb: Image.Image) -> Image.Image:
    "White where the emoji is, black on the near-white background connected to its margin (white inside it stays)."
    import numpy as np
    mask = Image.fromarray(((255 - np.asarray(rgb)).max(-1) <= 8).astype(np.uint8) * 255).copy()   # writable
    ImageDraw.floodfill(mask, (0, 0), 128)
    return Image.fromarray((np.asarray(mask) != 128).astype(np.uint8) * 255, "L")

def control_samples(emoji_dir: Path):
    "The demo's 32 emoji (configs/demo.yaml's dataset filter) with their silhouettes as control images."
    import tarfile
    from cascade_nb.config import load_config
    keep = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml").data.dataset_filters
    n = 0
    for shard in sorted(emoji_dir.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for key in sorted({name.split(".")[0] for name in members}):
            meta = json.loads(members[f"{key}.json"])
            if not all(f(meta) for f in keep): continue
            rgb = Image.open(io.BytesIO(members[f"{key}.png"])).convert("RGB")
            yield {"__key__": f"{n:04d}", "png": members[f"{key}.png"], "txt": members[f"{key}.txt"],
                   "control.png": png_bytes(silhouette(rgb))}
            n += 1

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skimage-wheel", default=None, help="scikit-image wheel (default: /tmp/skimg/scikit_image-*.whl)")
    ap.add_argument("--out", default=str(ROOT))
    args = ap.parse_args()
    out = Path(args.out)
    for old in (out / "emoji").glob("shard-*.tar"): old.unlink()
    shards = write_shards(emoji_samples(), out / "emoji", shard_size=SHARD_SIZE)
    print(f"emoji: {len(shards)} shards, {sum(p.stat().st_size for p in shards) / 1e6:.2f} MB")
    masked = out / "masked"; masked.mkdir(parents=True, exist_ok=True)
    for s in masked_samples(out / "emoji"):
        for ext in ("png", "mask.png", "txt"):
            if ext in s: (masked / f"{s['__key__']}.{ext}").write_bytes(s[ext])
    print(f"masked: {MASKED} samples in {masked}")
    control = out / "emoji_control"; control.mkdir(parents=True, exist_ok=True)
    for n, s in enumerate(control_samples(out / "emoji"), 1):
        for ext in ("png", "txt", "control.png"): (control / f"{s['__key__']}.{ext}").write_bytes(s[ext])
    print(f"emoji_control: {n} samples in {control}")
    wheel = args.skimage_wheel or next(iter(sorted(glob.glob("/tmp/skimg/scikit_image-*.whl"))), None)
    if wheel is None: print("photos: skipped (no scikit-image wheel; see the docstring)"); return
    photos = out / "photos"; photos.mkdir(parents=True, exist_ok=True)
    for s in photo_samples(wheel):
        for ext in ("jpg", "txt", "json"):
            data = s[ext]
            (photos / f"{s['__key__']}.{ext}").write_bytes(data if isinstance(data, bytes) else data.encode())
    print(f"photos: {len(PHOTOS)} images in {photos}")

if __name__ == "__main__": main()
