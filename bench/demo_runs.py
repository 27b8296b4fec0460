"""The README demo (configs/demo.yaml: a tiny text-conditioned Stage C on 32 emoji, 1200 updates of 16 images, caption
retrieval every 300 updates) trained in this process, for the bench scripts that compare arms of it: `train_demo`
runs one arm with its overrides, `demo_scores` reads the run's logged loss and retrieval curves. One thread; the data
decoded in-process (`num_workers=0`), so the run's CPU seconds are all in this process."""
import json, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "configs" / "demo.yaml"

def train_demo(name: str, overrides: list, tmp: str, updates: int = 1200) -> tuple[dict, list[dict], float]:
    "(train's result, the run's metrics.jsonl records, CPU seconds) of the demo with `overrides`, written under `tmp`."
    import torch
    import cascade_nb.train as T
    from cascade_nb.config import load_config
    torch.set_num_threads(1)
    cfg = load_config(DEMO, [f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out",
                             f"updates={updates}", f"save_every={updates}", "backup_every=1000000", "num_workers=0",
                             "tracker=none", f"eval_every={max(1, updates // 4)}", *overrides])
    t0 = time.process_time()
    out = T.train(cfg)
    cpu = time.process_time() - t0
    records = [json.loads(line) for line in (Path(out["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return out, records, cpu

def demo_scores(records: list[dict], updates: int) -> dict:
    "The loss over the last 100 updates, the logged loss curve, and the EMA's retrieval top-1 (last, best, curve)."
    losses = [r["loss"] for r in records if "loss" in r and r["update"] > updates - 100]
    top1 = [(r["update"], r["eval/retrieval/top1"]) for r in records if "eval/retrieval/top1" in r]
    return dict(loss_last_100=sum(losses) / len(losses), loss_curve=[(r["update"], r["loss"]) for r in records
                                                                      if "loss" in r],
                top1_final=top1[-1][1], top1_best=max(v for _, v in top1), top1_curve=top1)
