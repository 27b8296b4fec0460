"""Prior preservation on the emoji demo: does a new-token LoRA drift less on the base's own prompts with it?

    OMP_NUM_THREADS=1 .venv/bin/python bench/prior_drift.py [--work DIR] [--base RUN]

1. The README's demo base (`configs/demo.yaml`, as shipped; skipped with `--base` naming a finished demo run).
2. Two LoRA + new-token runs from `configs/lora_demo.yaml`, identical but for the regularisation entry: the instance
   set is the 64 smiley emoji of shard 0 (faces the base never saw), captioned `[emoji] <name>`; "with prior" adds the
   base's own shards 2-5 as `prior: true` (their target is the frozen base's prediction, nbs/60_lora), weight 0.3 so
   that about half of each batch is regularisation, `prior_loss_weight` 1.
3. Same-seed samples of the base and of each tuned run on the 32 captions the base was trained on (its `dataset_filters`;
   five of them end in "face", the word the instance captions share) and on 8 instance prompts.
   Drift = RMS pixel difference in [0, 1] between the base's and the tuned run's image, averaged over the prompts.

Writes bench/results/prior_drift.json and nbs/images/prior_drift.png (base | without | with prior, on 8 class prompts).
"""
import argparse, json, re, subprocess, sys
from pathlib import Path
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
EMOJI = ROOT / "data_samples" / "emoji"
INSTANCE = f"{{path: '{EMOJI}/shard-000000.tar', caption_prefix: '[emoji] '}}"
PRIOR = f"{{path: '{EMOJI}/shard-{{000002..000005}}.tar', prior: true, weight: 0.3}}"
INSTANCE_PROMPTS = ["[emoji] grinning face", "[emoji] winking face", "[emoji] crying face", "[emoji] sleepy face",
                    "[emoji] angry face", "[emoji] nerd face", "[emoji] relieved face", "[emoji] flushed face"]
SHOWN = ["frog face", "pig face", "panda face", "tiger face", "red apple", "banana", "sunflower", "octopus"]

def run(*argv):
    print("$", " ".join(map(str, argv)), flush=True)
    subprocess.run([sys.executable, *map(str, argv)], check=True, cwd=ROOT)

def class_prompts() -> list[str]:
    "The 32 captions the demo base trains on (configs/demo.yaml's dataset_filters)."
    text = (ROOT / "configs" / "demo.yaml").read_text()
    return re.findall(r'"([^"]+)"', re.search(r"c in \(([^)]*)\)", text).group(1))

def samples(run_dir, prompts, out, no_ema=False) -> list[np.ndarray]:
    "One same-seed sample per prompt (`python -m cascade_nb.sample`), as float arrays in [0, 1], in prompt order."
    out = Path(out)
    args = ["-m", "cascade_nb.sample", "--checkpoint", run_dir, "--seed", 0, "--n", 1, "--out", out, "--overwrite"]
    for p in prompts: args += ["--prompt", p]
    run(*args, *(["--no-ema"] if no_ema else []))
    # the CLI names them {seed}_{index}_{slug}.png
    by_index = {int(f.name.split("_")[1]): f for f in out.glob("0_*_*.png")}
    files = [by_index[i] for i in range(len(prompts))]
    return [np.asarray(Image.open(f).convert("RGB"), dtype=np.float64) / 255 for f in files]

def drift(a, b) -> list[float]: return [float(np.sqrt(((x - y) ** 2).mean())) for x, y in zip(a, b)]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/prior_drift")
    ap.add_argument("--base", default=None, help="a finished configs/demo.yaml run to reuse")
    a = ap.parse_args()
    work = Path(a.work)
    base = Path(a.base) if a.base else work / "ckpt" / "demo"
    if not (base / "generator.safetensors").exists():
        run("-m", "cascade_nb.train", "configs/demo.yaml", f"checkpoint_path={work}/ckpt", f"output_path={work}/out")
    runs = {"without prior": f"webdataset_path=[{INSTANCE}]", "with prior": f"webdataset_path=[{INSTANCE}, {PRIOR}]"}
    for name, data in runs.items():
        exp = name.replace(" ", "_")
        if not (work / "ckpt" / exp / "lora.safetensors").exists():
            run("-m", "cascade_nb.train", "configs/lora_demo.yaml", data, f"experiment_id={exp}",
                f"generator_checkpoint_path={base}/generator.safetensors", f"checkpoint_path={work}/ckpt",
                f"output_path={work}/out")
    cls, res = class_prompts(), {}
    prompts = cls + INSTANCE_PROMPTS
    ref = samples(base, prompts, work / "samples" / "base", no_ema=True)
    imgs = {"base": ref}
    for name in runs:
        imgs[name] = samples(work / "ckpt" / name.replace(" ", "_"), prompts, work / "samples" / name.replace(" ", "_"))
        d = drift(ref, imgs[name])
        faces = [x for p, x in zip(cls, d) if p.endswith("face")]
        res[name] = {"class_drift": float(np.mean(d[:len(cls)])), "face_class_drift": float(np.mean(faces)),
                     "instance_change": float(np.mean(d[len(cls):])), "per_class_prompt": dict(zip(cls, d))}
        print(f"{name}: class drift {res[name]['class_drift']:.4f} (the 5 'face' prompts "
              f"{res[name]['face_class_drift']:.4f}), instance prompts changed {res[name]['instance_change']:.4f}")
    res["command"] = "OMP_NUM_THREADS=1 .venv/bin/python bench/prior_drift.py"
    (ROOT / "bench" / "results" / "prior_drift.json").write_text(json.dumps(res, indent=1) + "\n")
    rows = [np.concatenate([imgs[k][cls.index(p)] for p in SHOWN], 1) for k in ("base", *runs)]
    grid = (np.concatenate(rows, 0) * 255).round().astype(np.uint8)
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(
        ROOT / "nbs" / "images" / "prior_drift.png")

if __name__ == "__main__": main()
