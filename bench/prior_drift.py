"""Prior preservation on the emoji demo: does a new-token LoRA drift less on the base's own prompts with it?

    OMP_NUM_THREADS=1 .venv/bin/python bench/prior_drift.py [--work DIR] [--base RUN] [--seeds 0 1 2]

1. The README's demo base (`configs/demo.yaml`, as shipped; skipped with `--base` naming a finished demo run).
2. Two LoRA + new-token runs from `configs/lora_demo.yaml`, identical but for the regularisation entry: the instance
   set is the 64 smiley emoji of shard 0 (faces the base never saw), captioned `[emoji] <name>`; "with prior" adds the
   base's own shards 2-5 as `prior: true` (their target is the frozen base's prediction, nbs/60d_prior_preservation), weight 0.3 so
   that about half of each batch is regularisation, `prior_loss_weight` 1.
3. Same-seed samples of the base and of each tuned run on the 32 captions the base was trained on (its
   `dataset_filters`; five of them end in "face", the word the instance captions share) and on 8 instance prompts.
   Drift = RMS pixel difference in [0, 1] between the base's and the tuned run's image, averaged over the prompts.
   Each pair of LoRA runs is repeated for every training `--seeds` (the sampling seed stays 0).

Writes bench/results/prior_drift.json and nbs/images/prior_drift.png (rows: base, without, with prior (training seed
0); columns: 6 of the base's prompts, then 2 instance prompts).
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
SHOWN = ["frog face", "pig face", "panda face", "tiger face", "red apple", "banana", "[emoji] grinning face",
         "[emoji] crying face"]

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

def lora_runs(work: Path, base: Path, seed: int) -> dict:
    "Train (once) the two LoRA runs of training seed `seed`: {name: run dir}."
    data = {"without prior": f"webdataset_path=[{INSTANCE}]", "with prior": f"webdataset_path=[{INSTANCE}, {PRIOR}]"}
    runs = {}
    for name, mix in data.items():
        runs[name] = work / "ckpt" / f"{name.replace(' ', '_')}_s{seed}"
        if not (runs[name] / "lora.safetensors").exists():
            run("-m", "cascade_nb.train", "configs/lora_demo.yaml", mix, f"experiment_id={runs[name].name}",
                f"seed={seed}", f"generator_checkpoint_path={base}/generator.safetensors",
                f"checkpoint_path={work}/ckpt", f"output_path={work}/out")
    return runs

def scores(cls, d) -> dict:
    "The drift numbers of one tuned run: its base prompts (all, the 'face' ones) and its instance prompts."
    faces = [x for p, x in zip(cls, d) if p.endswith("face")]
    return {"class_drift": float(np.mean(d[:len(cls)])), "face_class_drift": float(np.mean(faces)),
            "instance_change": float(np.mean(d[len(cls):]))}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/prior_drift")
    ap.add_argument("--base", default=None, help="a finished configs/demo.yaml run to reuse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = ap.parse_args()
    work = Path(a.work)
    base = Path(a.base) if a.base else work / "ckpt" / "demo"
    if not (base / "generator.safetensors").exists():
        run("-m", "cascade_nb.train", "configs/demo.yaml", f"checkpoint_path={work}/ckpt", f"output_path={work}/out")
    cls = class_prompts()
    prompts = cls + INSTANCE_PROMPTS
    ref = samples(base, prompts, work / "samples" / "base", no_ema=True)
    res, shown = {"per_seed": {}}, {"base": ref}
    for seed in a.seeds:
        for name, run_dir in lora_runs(work, base, seed).items():
            imgs = samples(run_dir, prompts, work / "samples" / run_dir.name)
            res["per_seed"].setdefault(name, []).append(scores(cls, drift(ref, imgs)))
            if seed == a.seeds[0]: shown[name] = imgs
            print(f"seed {seed}, {name}: {res['per_seed'][name][-1]}", flush=True)
    for name, rows in res["per_seed"].items():
        res[name] = {k: [float(np.mean([r[k] for r in rows])), float(np.std([r[k] for r in rows]))] for k in rows[0]}
        print(f"{name}, {len(rows)} seeds (mean, std): " + ", ".join(f"{k} {m:.4f} ± {s:.4f}"
                                                                      for k, (m, s) in res[name].items()))
    res["command"] = "OMP_NUM_THREADS=1 .venv/bin/python bench/prior_drift.py " + " ".join(sys.argv[1:])
    (ROOT / "bench" / "results" / "prior_drift.json").write_text(json.dumps(res, indent=1) + "\n")
    rows = [np.concatenate([imgs[prompts.index(p)] for p in SHOWN], 1) for imgs in shown.values()]
    grid = (np.concatenate(rows, 0) * 255).round().astype(np.uint8)
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(
        ROOT / "nbs" / "images" / "prior_drift.png")

if __name__ == "__main__": main()
