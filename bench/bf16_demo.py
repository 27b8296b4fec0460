#!/usr/bin/env python
"""bf16 weights with round-to-nearest or stochastic rounding against fp32 weights on the README demo (issue 48):

    OMP_NUM_THREADS=1 .venv/bin/python bench/bf16_demo.py [--seeds 0 1 2] [--arms fp32 ...] [--updates 1200]

Arms, everything else as shipped in configs/demo.yaml (AdamW, lr 4e-3 cosine to 0, EMA 0.98, no autocast on CPU):
`fp32` (as shipped); `fp32_fused` (`fused_backward`: each tensor stepped inside backward, so the SR arm's difference is
not the fused step); `bf16_rne` (`dtype=bfloat16`: torch's fused AdamW on the bf16 weights: its moments are bf16 too,
the update is computed in fp32 inside the kernel and the new weight written back rounded to nearest, no fp32 master
copy; the forward and backward run in bf16); `bf16_sr` (`dtype=bfloat16 fused_backward=true
stochastic_rounding=true`: each tensor's step on an fp32 copy with fp32 moments, rounded back into the bf16 weight at
random); `bf16_rne_fp32_state` (an ablation: `bf16_sr`'s step, fp32 moments included, rounded back to nearest instead:
what separates the rounding from the moments' precision); `fp32_amp` (`mixed_precision=bf16`: fp32 weights, the
forward and backward under bf16 autocast, as the GPU launch configs run them: what separates the weights' rounding
from the bf16 arithmetic).

Per run: the logged loss curve, the EMA's retrieval top-1 every 300 updates (the trainer's evaluation) and the live
weights' at the same updates (`LiveAndUpdates`, a hook of this script), the CPU seconds of this process, and every
`--every` updates the update's relative size ||W_after - W_before|| / ||W_before|| over the trained weights, the
fraction of their elements the update left unchanged, the fraction it moved by less than half a bf16 ulp (what
round-to-nearest into bf16 would drop; in an fp32 run, the updates bf16 would lose), and the drift from the initial
weights ||W - W_0|| / ||W_0||. Results go to
bench/results/bf16_demo.json (an arm and seed already there is not redone); one line per run, and per arm its means
over the seeds with ratios to `fp32`'s."""
import argparse, contextlib, functools, json, re, statistics, subprocess, sys, tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_runs import ROOT, train_demo, demo_scores   # noqa: E402  the demo trained in this process, its scores
import torch   # noqa: E402
import cascade_nb.optimizers   # noqa: E402
from cascade_nb.train_state import register_training_hook   # noqa: E402
from cascade_nb.eval import Evaluator, evaluate_run   # noqa: E402

def nearest_round_(out, x, generator=None):
    "`stochastic_round_`'s signature, rounding to nearest (a bf16 `copy_`): the `bf16_rne_fp32_state` ablation."
    return out.copy_(x)

_BF16_SR = ["dtype=bfloat16", "fused_backward=true", "stochastic_rounding=true"]
# arm -> (config overrides on configs/demo.yaml, the rounding FusedBackward's bf16 step uses)
ARMS = {"fp32": ([], None), "fp32_fused": (["fused_backward=true"], None), "bf16_rne": (["dtype=bfloat16"], None),
        "bf16_sr": (_BF16_SR, None), "bf16_rne_fp32_state": (_BF16_SR, nearest_round_),
        "fp32_amp": (["mixed_precision=bf16"], None)}
RESULTS = ROOT / "bench" / "results" / "bf16_demo.json"

def trained(run) -> list[torch.Tensor]:
    "The trained weights, detached."
    return [p.detach() for p in run.acc.unwrap_model(run.net).parameters() if p.requires_grad]

def sq_norm(ts) -> float: return float(sum(t.float().pow(2).sum() for t in ts))

def below_half_ulp(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Which elements changed by less than half the spacing of bf16 numbers at their old value (nothing included):
    the changes that round-to-nearest into bf16 weights would drop. A bf16 ulp at |w| in [2^(k-1), 2^k) is 2^(k-8)."""
    b = before.float()
    half_ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b).exponent - 9)
    return ((after.float() - b).abs() < half_ulp) & (b != 0) | (after == before)

@register_training_hook("bf16_demo")
class LiveAndUpdates:
    """This script's hook: the live weights' retrieval where the trainer scores the EMA's, and every `every_update`
    updates that update's relative size, the fraction of weight elements it left unchanged, the drift from the start
    (over the tensors that got a gradient in that update; the unchanged fraction over their elements whose gradient
    was not zero)."""
    rows, live, every_update = [], [], 50   # rows, live: the last run's, read by `run_arm`
    def __init__(self, cfg):
        self.evaluator, self.every, self.before, self.start = Evaluator(cfg), cfg.checkpoint.eval_every, None, None
        LiveAndUpdates.rows, LiveAndUpdates.live = [], []
    @classmethod
    def enabled(cls, cfg) -> bool: return True
    def before_training(self, run):
        self.start, self.moved = [w.clone() for w in trained(run)], {}
        # which elements get a non-zero gradient in the measured update: the others (9% of the demo's, e.g. the unused
        # image-conditioning mapper of its text-only Stage C) are not moved in any dtype, and are left out of the counts
        for i, p in enumerate(q for q in run.acc.unwrap_model(run.net).parameters() if q.requires_grad):
            p.register_hook(functools.partial(self.record, i))
    def record(self, i: int, g: torch.Tensor):
        "Gradient hook: during a measured update, which elements of trained tensor `i` get a non-zero gradient."
        if self.before is not None: self.moved[i] = g != 0
    def after_update(self, run):
        u, w = run.state.update, trained(run)
        if self.before is not None:
            now, before, start, moved = ([ts[i] for i in sorted(self.moved)]
                                         for ts in (w, self.before, self.start, self.moved))
            n = sum(int(m.sum()) for m in moved)
            same = sum(int(((a == b) & m).sum()) for a, b, m in zip(now, before, moved))
            small = sum(int((below_half_ulp(a, b) & m).sum()) for a, b, m in zip(now, before, moved))
            rel = (sq_norm([a.float() - b.float() for a, b in zip(now, before)]) / sq_norm(before)) ** 0.5
            drift = (sq_norm([a.float() - b.float() for a, b in zip(now, start)]) / sq_norm(start)) ** 0.5
            self.rows.append((u, rel, same / n, drift, small / n))
            self.before = None
        if (u + 1) % self.every_update == 0: self.before, self.moved = [t.clone() for t in w], {}
        if u % self.every == 0:
            net = run.acc.unwrap_model(run.net)
            res, _ = evaluate_run(self.evaluator, run.mode, run.gdf, net=net.eval(), device=run.acc.device)
            run.mode.set_training(net, True)
            self.live.append((u, res["retrieval/top1"]))

def run_arm(arm: str, seed: int, updates: int) -> dict:
    "One run of `arm` at `seed`: its scores, curves, update sizes and CPU seconds."
    overrides, rounding = ARMS[arm]
    patch = mock.patch.object(cascade_nb.optimizers, "stochastic_round_", rounding) if rounding else \
        contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, patch:
        _, records, cpu = train_demo(f"{arm}_s{seed}", [*overrides, f"seed={seed}"], tmp, updates)
    s = demo_scores(records, updates)
    return dict(s, top1_live_curve=LiveAndUpdates.live, cpu_s=cpu, updates_measured=LiveAndUpdates.rows)

def late_updates(r: dict, updates: int) -> dict:
    """The means of a run's measured updates over the last quarter, before the last update (where the cosine schedule's
    LR is ~0 and even fp32 leaves most weights unchanged)."""
    # (a run too short for that window, e.g. a test's: all its measured updates)
    late = [row for row in r["updates_measured"] if updates * 3 // 4 < row[0] < updates] or r["updates_measured"]
    return {k: statistics.mean(row[i] for row in late) for k, i in
            (("rel_change_late", 1), ("unchanged_late", 2), ("below_half_ulp_late", 4))}

def arm_mean(runs: dict) -> dict:
    "The means over an arm's seeds of its one-number results."
    keys = ("top1_final", "loss_last_100", "unchanged_late", "below_half_ulp_late", "rel_change_late", "cpu_s")
    return {k: statistics.mean(r[k] for r in runs.values()) for k in keys} | {
        "top1_live_final": statistics.mean(r["top1_live_curve"][-1][1] for r in runs.values()), "seeds": len(runs)}

def line(arm: str, m: dict, ref: dict | None) -> str:
    "The arm's printed line: its means, and their differences and ratios to fp32's `ref` (its means on the same seeds)."
    vs = (f"; vs fp32: top-1 {100 * (m['top1_final'] - ref['top1_final']):+.1f} points (live "
          f"{100 * (m['top1_live_final'] - ref['top1_live_final']):+.1f}), loss "
          f"x{m['loss_last_100'] / ref['loss_last_100']:.2f}, CPU x{m['cpu_s'] / ref['cpu_s']:.2f}"
          ) if ref and arm != "fp32" else ""
    return (f"bf16_demo {arm} ({' '.join(ARMS[arm][0]) or 'as shipped'}; {m['seeds']} seeds): EMA top-1 "
            f"{m['top1_final']:.1%}, live {m['top1_live_final']:.1%}, loss {m['loss_last_100']:.4f} (last 100), "
            f"unchanged {m['unchanged_late']:.1%} of weights per update (last quarter, before the last; moved by "
            f"under half a bf16 ulp {m['below_half_ulp_late']:.1%}), update size {m['rel_change_late']:.2e}, "
            f"{m['cpu_s']:.0f} CPU-s" + vs)

def dump(out: dict) -> str:
    "The results as JSON, each innermost list (a curve's point, a measured update) on one line."
    flat = lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]"
    return re.sub(r"\[\s*([^\[\]{}]*?)\s*\]", flat, json.dumps(out, indent=1)) + "\n"

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=["fp32", "fp32_fused", "bf16_rne", "bf16_sr"], choices=list(ARMS))
    p.add_argument("--updates", type=int, default=1200)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--every", type=int, default=50, help="measure every this many updates")
    a = p.parse_args()
    LiveAndUpdates.every_update = a.every
    out = json.loads(a.json.read_text()) if a.json.exists() else {}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out.update(command="OMP_NUM_THREADS=1 .venv/bin/python bench/bf16_demo.py " + " ".join(sys.argv[1:]),
               code=f"commit {commit.stdout.strip()}, torch {torch.__version__}, one thread", every=a.every)
    runs = out.setdefault("runs", {})
    for seed in a.seeds:
        for arm in a.arms:
            if f"s{seed}" in runs.get(arm, {}): continue
            r = runs.setdefault(arm, {})[f"s{seed}"] = run_arm(arm, seed, a.updates)
            r.update(late_updates(r, a.updates))
            print(f"bf16_demo {arm} seed {seed}: EMA top-1 {r['top1_final']:.1%} (curve "
                  f"{[v for _, v in r['top1_curve']]}), live {r['top1_live_curve'][-1][1]:.1%}, loss "
                  f"{r['loss_last_100']:.4f}, unchanged {r['unchanged_late']:.1%}, {r['cpu_s']:.0f} CPU-s",
                  flush=True)
            a.json.write_text(dump(out))
    for r in (r for arm_runs in runs.values() for r in arm_runs.values()): r.update(late_updates(r, a.updates))
    out["means"] = {arm: arm_mean(runs[arm]) for arm in ARMS if arm in runs}
    for arm, m in out["means"].items():
        # against fp32 on the same seeds: a seed is the same initial weights and data order in every arm
        paired = {s: r for s, r in runs.get("fp32", {}).items() if s in runs[arm]}
        print(line(arm, m, arm_mean(paired) if paired else None))
    a.json.write_text(dump(out))

if __name__ == "__main__":
    main()
