"""T-LoRA against plain LoRA on the new-token LoRA demo, scored by the report card (issue 50).

    OMP_NUM_THREADS=1 .venv/bin/python bench/tlora_demo.py --base RUN [--work DIR] [--seeds 0 1 2] [--arms ...]

`--base`: a finished `configs/demo.yaml` run (the README's demo base). Per training seed, runs of
`configs/lora_demo.yaml` on the instance set of bench/prior_drift.py (the 64 smiley emoji of shard 0, captioned
`[emoji] <name>`, no prior entry), identical but for the adapter: `lora` (as shipped), `tlora` (`adapter=tlora`, its
defaults: `tlora_min_rank` 1, `tlora_alpha` 1, Ortho-LoRA init), and two ablations: `tlora_merged` (the `tlora` runs
sampled with their adapters folded at full rank, as a merge or an export gives them) and `tlora_no_ortho`
(`tlora_ortho: false`). Each released LoRA is scored as bench/report_prior.py scores one (subject fidelity on the
instance captions, drift from the base on its 32 prompts, diversity; pixel features, `eval_seeds` 2). Results go to
bench/results/tlora_demo.json (an arm and seed already there is not redone); one line per run and per arm.
"""
import argparse, dataclasses, json, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from prior_drift import INSTANCE, class_prompts, run   # noqa: E402  the instance set, the base's prompts, subprocesses
from report_prior import METRICS   # noqa: E402  the report card's metrics

# arm -> (the run it scores, that run's extra training keys, fold the adapters before sampling)
ARMS = {"lora": ("lora", [], False), "tlora": ("tlora", ["adapter=tlora"], False),
        "tlora_merged": ("tlora", ["adapter=tlora"], True),
        "tlora_no_ortho": ("tlora_no_ortho", ["adapter=tlora", "adapter_args={tlora_ortho: false}"], False)}
RESULTS = ROOT / "bench" / "results" / "tlora_demo.json"

def train(work: Path, base: Path, name: str, keys: list, seed: int) -> Path:
    "One LoRA run (once; a finished run is reused)."
    out = work / "ckpt" / f"{name}_s{seed}"
    if not (out / "lora.safetensors").exists():
        run("-m", "cascade_nb.train", "configs/lora_demo.yaml", f"webdataset_path=[{INSTANCE}]", *keys,
            f"experiment_id={out.name}", f"seed={seed}", f"generator_checkpoint_path={base}/generator.safetensors",
            f"checkpoint_path={work}/ckpt", f"output_path={work}/out")
    return out

def score(run_dir: Path, fold: bool) -> dict:
    "bench/report_prior.py's scoring of a released LoRA; `fold`: its adapters folded at full rank first."
    from cascade_nb.sample import load_run
    from cascade_nb.eval import Evaluator, evaluate_run
    from cascade_nb.export import fold_parametrizations
    mode, gdf, cfg = load_run(run_dir)
    if fold: fold_parametrizations(mode.net)
    ck = dataclasses.replace(cfg.checkpoint, eval_features="pixels", eval_drift_prompts=class_prompts(), eval_seeds=2)
    results, _ = evaluate_run(Evaluator(dataclasses.replace(cfg, checkpoint=ck), metrics=METRICS, best_metric=""),
                              mode, gdf)
    return {k: float(v) for k, v in results.items() if k in METRICS}

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/cascade_nb_tlora"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    a = p.parse_args()
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    out["command"] = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python bench/tlora_demo.py", *sys.argv[1:]])
    for seed in a.seeds:
        for arm in a.arms:
            if f"s{seed}" in out.get(arm, {}): continue
            name, keys, fold = ARMS[arm]
            s = score(train(a.work, a.base, name, keys, seed), fold)
            out.setdefault(arm, {})[f"s{seed}"] = s
            print(f"tlora_demo {arm} seed {seed}: " + ", ".join(f"{m} {s[m]:.4f}" for m in METRICS), flush=True)
            RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for arm in a.arms:
        runs = list(out[arm].values())
        out[arm + "_mean"] = {m: statistics.mean(s[m] for s in runs) for m in METRICS}
        print(f"tlora_demo {arm}: " + ", ".join(f"{m} {v:.4f}" for m, v in out[arm + "_mean"].items())
              + f" ({len(runs)} seeds)")
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__":
    main()
