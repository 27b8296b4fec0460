#!/usr/bin/env python
"""Feature alignment (REPA, nbs/36_loss_terms) on the README demo: caption retrieval top-1 at each evaluation (300, 600,
900, 1200 updates) with and without the term, per training seed, from the runs' metrics.jsonl and the CPU time each run's
log ends with (`/usr/bin/time -f "%U user %e wall"`). Writes the table as JSON and prints one line per arm:

    python bench/repa_demo.py --runs OUT/repa_s0 OUT/repa_s1 OUT/repa_s2 --baseline OUT/base_s1 OUT/base_s2 \
        [--baseline-json bench/results/muon_demo.json:adamw_s0] [--json bench/results/repa_demo.json]

The runs, one at a time with OMP_NUM_THREADS=1 (bench/RESULTS.md, section "Feature alignment", has the exact commands):
    python -m cascade_nb.train configs/demo.yaml align_encoder=tiny align_hidden=256 seed=S experiment_id=repa_sS
    python -m cascade_nb.train configs/demo.yaml seed=S experiment_id=base_sS
An OUT/<run> folder is the run's output folder (metrics.jsonl) with its log beside it as OUT/../<run>.log."""
import argparse, json, re
from pathlib import Path

METRIC = "eval/retrieval/top1"

def run_row(out: Path) -> dict:
    "Top-1 curve, loss over the last 100 updates, CPU seconds of one run."
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [[r["update"], r[METRIC]] for r in rows if METRIC in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    log = out.parent.parent / f"{out.name}.log"
    cpu = re.findall(r"([0-9.]+) user ([0-9.]+) wall", log.read_text()) if log.exists() else []
    return {"top1_curve": curve, "loss_last_100": sum(losses[-10:]) / max(len(losses[-10:]), 1),
            "user_cpu_s": float(cpu[-1][0]) if cpu else None}

def seed_of(name: str) -> int: return int(re.search(r"_s(\d+)$", name).group(1))

def arm(rows: dict) -> dict:
    "Mean top-1 at each evaluation over the arm's seeds, and the first update each seed reached 90%."
    curves = [dict(map(tuple, r["top1_curve"])) for r in rows.values()]
    updates = sorted(set.intersection(*(set(c) for c in curves)))
    first = [next((u for u in updates if c[u] >= 0.9), None) for c in curves]
    return {"mean_top1": {u: sum(c[u] for c in curves) / len(curves) for u in updates}, "first_at_90": first}

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", required=True, help="output folders of the runs with feature alignment")
    p.add_argument("--baseline", nargs="*", default=[], help="output folders of the runs without it")
    p.add_argument("--baseline-json", default=None, help="FILE:RUN: a baseline run from another bench's JSON")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    repa = {Path(r).name: run_row(Path(r)) for r in a.runs}
    base = {Path(r).name: run_row(Path(r)) for r in a.baseline}
    if a.baseline_json:
        f, name = a.baseline_json.rsplit(":", 1)
        base[name] = {**json.loads(Path(f).read_text())["runs"][name], "from": f}
    res = {"runs": {"repa": repa, "baseline": base}, "arms": {"repa": arm(repa), "baseline": arm(base)}}
    for name, s in res["arms"].items():
        print(f"{name}: mean top-1 " + " / ".join(f"{v:.3f}@{u}" for u, v in s["mean_top1"].items())
              + f"; first update at >= 90% per seed {s['first_at_90']}")
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return res

if __name__ == "__main__": main()
