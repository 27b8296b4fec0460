"""The adapter types side by side on the LoRA demo, at about equal trainable parameter counts.

    OMP_NUM_THREADS=1 .venv/bin/python bench/adapter_types.py [--work DIR] [--base RUN] [--types lora dora ...]

1. The README's demo base (`configs/demo.yaml`, as shipped; skipped with `--base` naming a finished demo run).
2. `configs/lora_demo.yaml` (rank-4 adapters on the attention projections, the `[emoji]` token) once per adapter type,
   each with the settings in `SETTINGS` (chosen so the trainable counts are close to LoRA rank 4's; the table states
   the real counts), the same seed, data and updates.
3. Per run: the loss at the start (the mean of the first logged losses) and at the end (the mean of the last ones,
   from `metrics.jsonl`), caption retrieval top-1 of its samples (`python -m cascade_nb.eval --metrics retrieval`),
   the size of `lora.safetensors`, its trainable tensors, and the CPU time of the training process.

Prints one line per type with its ratios to LoRA's (the reference run, made in the same invocation), writes
bench/results/adapter_types.json and the markdown table nbs/60_adapters.ipynb quotes.
"""
import argparse, json, math, resource, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# config overrides per type: near LoRA rank 4's trainable count on the demo's 12 attention weights (6 fused q/k/v
# projections 192x64, 6 out projections 64x64: 9216 parameters)
SETTINGS = {
    "lora": ["adapter=lora", "rank=4"],
    "dora": ["adapter=dora", "rank=4"],                                    # + one magnitude per output row
    "loha": ["adapter=loha", "rank=2"],                                    # two rank-2 pairs: LoRA rank 4's count
    "lokr": ["adapter=lokr", "rank=4", "lokr_factor=4", "full_matrix=true"],
    "oft": ["adapter=oft", "rank=null", "oft_block_size=8"],                # out x 8 per weight (no rank)
}

def run(*argv) -> float:
    "Run a cascade_nb command; the CPU seconds (user + system) it and its children used."
    print("$", " ".join(map(str, argv)), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, *map(str, argv)], check=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

def losses(metrics: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("loss") is not None]

def trainable(lora_file: Path) -> int:
    "Trained numbers in a released adapter file: every tensor but the alphas and the token ids."
    from safetensors import safe_open
    with safe_open(str(lora_file), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                   if not k.endswith(".alpha") and k != "tokens.ids")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/adapter_types")
    ap.add_argument("--base", default=None, help="a finished configs/demo.yaml run to reuse")
    ap.add_argument("--types", nargs="+", default=list(SETTINGS))
    a = ap.parse_args()
    work = Path(a.work)
    base = Path(a.base) if a.base else work / "ckpt" / "demo"
    if not (base / "generator.safetensors").exists():
        run("-m", "cascade_nb.train", "configs/demo.yaml", f"checkpoint_path={work}/ckpt", f"output_path={work}/out")
    res = {}
    for name in a.types:
        exp = f"lora_demo_{name}"
        run_dir, out_dir, done = work / "ckpt" / exp, work / "out" / exp, work / f"{exp}.json"
        if done.exists():                         # measured by an earlier invocation with the same --work
            res[name] = json.loads(done.read_text()); continue
        t0 = time.time()
        cpu = run("-m", "cascade_nb.train", "configs/lora_demo.yaml", *SETTINGS[name], f"experiment_id={exp}",
                  f"generator_checkpoint_path={base}/generator.safetensors", f"checkpoint_path={work}/ckpt",
                  f"output_path={work}/out")
        wall = time.time() - t0
        ls = losses(out_dir / "metrics.jsonl")
        k = max(1, len(ls) // 5)
        scores = work / f"{exp}_eval.json"
        run("-m", "cascade_nb.eval", "--checkpoint", run_dir, "--metrics", "retrieval", "--json", scores)
        ev = next(iter(json.loads(scores.read_text()).values()))
        lora_file = run_dir / "lora.safetensors"
        res[name] = dict(settings=SETTINGS[name], loss_start=sum(ls[:k]) / k, loss_end=sum(ls[-k:]) / k,
                         retrieval_top1=ev.get("retrieval/top1", ev.get("top1")), file_bytes=lora_file.stat().st_size,
                         trainable=trainable(lora_file), train_cpu_s=cpu, train_wall_s=wall)
        done.write_text(json.dumps(res[name]))
    ref = res.get("lora")
    lines = ["| adapter | settings | trainable | file | loss start → end | retrieval top-1 | train CPU |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        ratio = "" if not ref else (f" (x{r['train_cpu_s'] / ref['train_cpu_s']:.2f} LoRA's CPU, "
                                    f"final loss x{r['loss_end'] / ref['loss_end']:.2f})")
        print(f"adapter_types {name}: trainable {r['trainable']}, file {r['file_bytes'] / 1e3:.1f} kB, loss "
              f"{r['loss_start']:.4f} -> {r['loss_end']:.4f}, retrieval top-1 {r['retrieval_top1']}, "
              f"train CPU {r['train_cpu_s']:.0f} s{ratio}", flush=True)
        lines.append(f"| `{name}` | `{' '.join(r['settings'][1:])}` | {r['trainable']:,} | "
                     f"{r['file_bytes'] / 1e3:.1f} kB | {r['loss_start']:.4f} → {r['loss_end']:.4f} | "
                     f"{r['retrieval_top1']} | {r['train_cpu_s']:.0f} s |")
    table = "\n".join(lines)
    print(table)
    out = {"command": "OMP_NUM_THREADS=1 .venv/bin/python bench/adapter_types.py " + " ".join(sys.argv[1:]),
           "runs": res, "table": table}
    (ROOT / "bench" / "results" / "adapter_types.json").write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__": main()
