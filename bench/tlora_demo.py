"""T-LoRA against plain LoRA on the new-token LoRA demo, scored by the report card (issue 50).

    OMP_NUM_THREADS=1 .venv/bin/python bench/tlora_demo.py --base RUN [--work DIR] [--seeds 0 1 2]

`--base`: a finished `configs/demo.yaml` run (the README's demo base). Per training seed two runs of
`configs/lora_demo.yaml` on the instance set of bench/prior_drift.py (the 64 smiley emoji of shard 0, captioned
`[emoji] <name>`, no prior entry), identical but for `adapter=tlora` (its defaults: `tlora_min_rank` 1, `tlora_alpha`
1, Ortho-LoRA init); each released LoRA is scored as bench/report_prior.py scores one (subject fidelity on the instance
captions, drift from the base on its 32 prompts, diversity; pixel features, `eval_seeds` 2). The T-LoRA run samples with
its rank following each step's logSNR. Writes bench/results/tlora_demo.json and prints one line per run and per arm.
"""
import argparse, json, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from prior_drift import INSTANCE, run   # noqa: E402  the instance set and the subprocess helper
from report_prior import METRICS, score   # noqa: E402  the report card's scoring of a released LoRA

ARMS = {"lora": [], "tlora": ["adapter=tlora"]}

def train(work: Path, base: Path, arm: str, seed: int) -> Path:
    "One LoRA run (once; a finished run is reused)."
    out = work / "ckpt" / f"{arm}_s{seed}"
    if not (out / "lora.safetensors").exists():
        run("-m", "cascade_nb.train", "configs/lora_demo.yaml", f"webdataset_path=[{INSTANCE}]", *ARMS[arm],
            f"experiment_id={out.name}", f"seed={seed}", f"generator_checkpoint_path={base}/generator.safetensors",
            f"checkpoint_path={work}/ckpt", f"output_path={work}/out")
    return out

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/cascade_nb_tlora"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = p.parse_args()
    out = {"command": " ".join(["OMP_NUM_THREADS=1 .venv/bin/python bench/tlora_demo.py", *sys.argv[1:]])}
    for seed in a.seeds:
        for arm in ARMS:
            r = train(a.work, a.base, arm, seed)
            out.setdefault(arm, {})[f"s{seed}"] = s = score(r)
            print(f"tlora_demo {arm} seed {seed}: " + ", ".join(f"{m} {s[m]:.4f}" for m in METRICS), flush=True)
            (ROOT / "bench" / "results" / "tlora_demo.json").write_text(json.dumps(out, indent=1) + "\n")
    for arm in ARMS:
        runs = list(out[arm].values())
        out[arm + "_mean"] = {m: statistics.mean(s[m] for s in runs) for m in METRICS}
        print(f"tlora_demo {arm}: " + ", ".join(f"{m} {v:.4f}" for m, v in out[arm + "_mean"].items())
              + f" ({len(runs)} seeds)")
    (ROOT / "bench" / "results" / "tlora_demo.json").write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__":
    main()
