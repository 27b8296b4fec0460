"""The report card on the prior-preservation runs of bench/prior_drift.py: subject fidelity on the instance captions,
drift from the base on the base's own 32 prompts and diversity, for the new-token LoRA with and without prior
preservation, each training seed.

    OMP_NUM_THREADS=1 .venv/bin/python bench/report_prior.py [--work DIR]   # DIR: prior_drift.py's --work

Each run's released LoRA is scored the way `python -m cascade_nb.eval --checkpoint RUN` scores it, with the report
card's keys set here (pixel features; `eval_drift_prompts`: the base's 32 captions; `eval_seeds` 2). Prints one line
per arm (mean over the seeds) and writes bench/results/report_prior.json.
"""
import argparse, dataclasses, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from prior_drift import class_prompts   # noqa: E402  the same 32 base prompts as the drift bench

METRICS = ["subject_fidelity", "drift", "diversity"]

def score(run_dir: Path) -> dict:
    from cascade_nb.sample import load_run
    from cascade_nb.eval import Evaluator, evaluate_run
    mode, gdf, cfg = load_run(run_dir)
    ck = dataclasses.replace(cfg.checkpoint, eval_features="pixels", eval_drift_prompts=class_prompts(), eval_seeds=2)
    cfg = dataclasses.replace(cfg, checkpoint=ck)
    results, _ = evaluate_run(Evaluator(cfg, metrics=METRICS, best_metric=""), mode, gdf)
    return {k: float(v) for k, v in results.items() if k in METRICS}

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/cascade_nb_prior_drift"))
    a = p.parse_args()
    out = {}
    for arm in ("without_prior", "with_prior"):
        runs = sorted((a.work / "ckpt").glob(f"{arm}_s*"))
        if not runs: raise SystemExit(f"{a.work / 'ckpt'}: no {arm}_s* runs; run bench/prior_drift.py --work first")
        out[arm] = {r.name: score(r) for r in runs}
        mean = {m: sum(s[m] for s in out[arm].values()) / len(runs) for m in METRICS}
        out[arm + "_mean"] = mean
        print(f"report_prior {arm}: " + ", ".join(f"{m} {v:.4f}" for m, v in mean.items()) + f" ({len(runs)} seeds)")
    out["command"] = "OMP_NUM_THREADS=1 .venv/bin/python bench/report_prior.py --work " + str(a.work)
    (ROOT / "bench" / "results" / "report_prior.json").write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__":
    main()
