#!/usr/bin/env python
"""Post-hoc EMA (EDM2) on the README demo: caption retrieval top-1 of the EMA reconstructed at several widths against
the run's plain EMA and its live weights, per training seed. It reads what `python -m cascade_nb.eval --json` wrote for
each run (one call with `--sigma-rel ...`, scoring the plain EMA and each width; one with `--no-ema`, the live weights)
and writes the table as JSON:

    python bench/posthoc_ema.py --seeds 0 1 2 --ema EMA_0.json EMA_1.json EMA_2.json --live LIVE_0.json LIVE_1.json \
        LIVE_2.json [--json bench/results/posthoc_ema.json]

The runs: `python -m cascade_nb.train configs/demo.yaml seed=S posthoc_ema=true posthoc_every=50 experiment_id=...`
with OMP_NUM_THREADS=1 (bench/RESULTS.md, section posthoc_ema, has the exact commands)."""
import argparse, json
from pathlib import Path

METRIC = "retrieval/top1"

def one(path) -> dict:
    "The single run's results in an eval --json file."
    (res,) = json.loads(Path(path).read_text()).values()
    return res

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, required=True)
    p.add_argument("--ema", nargs="+", required=True, help="eval --json of each seed's run with --sigma-rel")
    p.add_argument("--live", nargs="+", required=True, help="eval --json of each seed's run with --no-ema")
    p.add_argument("--json", default=None, help="write the table here")
    a = p.parse_args(argv)
    if not len(a.seeds) == len(a.ema) == len(a.live): p.error("one --ema and one --live file per seed")
    rows = {}
    for seed, e, l in zip(a.seeds, a.ema, a.live):
        ema, live = one(e), one(l)
        rows[str(seed)] = {"live": live[METRIC], "plain_ema": ema[METRIC],
                           "posthoc": {s: r[METRIC] for s, r in ema["posthoc"].items()}}
    widths = list(next(iter(rows.values()))["posthoc"])
    mean = lambda xs: sum(xs) / len(xs)
    out = {"metric": METRIC, "seeds": rows, "mean": {
        "live": mean([r["live"] for r in rows.values()]), "plain_ema": mean([r["plain_ema"] for r in rows.values()]),
        "posthoc": {s: mean([r["posthoc"][s] for r in rows.values()]) for s in widths}}}
    print("\t".join(["seed", "live", "plain EMA", *(f"sigma_rel {s}" for s in widths)]))
    for seed, r in [*rows.items(), ("mean", out["mean"])]:
        cells = [r["live"], r["plain_ema"], *(r["posthoc"][s] for s in widths)]
        print("\t".join([seed, *(f"{v:.4f}" for v in cells)]))
    if a.json: Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return out

if __name__ == "__main__": main()
