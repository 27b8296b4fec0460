"""Evaluation end to end on CPU: the trainer logs the configured metrics and keeps the best weights by them,
`python -m cascade_nb.eval` recomputes the same numbers from a finished run (and compares runs side by side), and the
numbers and the best-checkpoint choice survive a kill and resume unchanged."""
import json, subprocess, sys
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

DRIVER = ROOT / "tests" / "train_driver.py"
TINY = ["webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "image_size=32", "batch_size=4",
        "log_every=1", "lr=1e-3", "warmup_updates=2", "ema_start_iters=2", "ema_iters=1", "ema_beta=0.9",
        "updates=4", "save_every=2", "eval_every=2", "eval_captions=6", "sample_steps=3", "best_metric=retrieval/median_rank"]

def args(tmp, name, *extra):
    return [str(ROOT / "configs" / "demo.yaml"), *TINY, f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt",
            f"output_path={tmp}/out", "tracker=none", *extra]

def eval_rows(tmp, name):
    rows = [json.loads(l) for l in (Path(tmp) / "out" / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("eval/") for k in r)]

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    res = run_cli(DRIVER, *args(tmp, "ref"))
    return tmp, res

def test_training_logs_metrics_and_keeps_best(run):
    tmp, res = run
    rows = eval_rows(tmp, "ref")
    assert [r["update"] for r in rows] == [2, 4]
    assert {"eval/retrieval/top1", "eval/retrieval/top5", "eval/retrieval/median_rank"} <= set(rows[0])
    assert "update 4: eval retrieval/top1" in res.stdout
    best = json.loads((tmp / "ckpt" / "ref" / "best.json").read_text())
    want = min(rows, key=lambda r: r["eval/retrieval/median_rank"])   # first of the minima: ties keep the earlier
    assert best["metric"] == "retrieval/median_rank" and best["update"] == want["update"]
    assert best["value"] == want["eval/retrieval/median_rank"] and best["weights"] == "generator_ema_best.safetensors"
    assert (tmp / "ckpt" / "ref" / "generator_ema_best.safetensors").exists()
    from cascade_nb.core import safetensors_header   # the best file says it holds the EMA (what the run scored)
    assert safetensors_header(tmp / "ckpt" / "ref" / "generator_ema_best.safetensors")[0]["cascade_nb.weights"] == "ema"
    assert not (tmp / "ckpt" / "ref" / "generator_best.safetensors").exists()
    assert (tmp / "out" / "ref" / "eval_000004.png").exists()

def test_cli_recomputes_the_logged_numbers_side_by_side(run):
    tmp, _ = run
    ck = tmp / "ckpt" / "ref"
    res = run_cli("-m", "cascade_nb.eval", "--checkpoint", ck, "--checkpoint", ck, "--json", tmp / "eval.json")
    out = json.loads((tmp / "eval.json").read_text())
    last = eval_rows(tmp, "ref")[-1]   # the EMA at update 4 is what the run released: same captions, seed, sampler
    assert out[str(ck)] == {k.removeprefix("eval/"): v for k, v in last.items() if k.startswith("eval/")}
    assert "6 captions, seed 0" in res.stdout and f"metric\t{ck}\t{ck}" in res.stdout
    assert any(l.startswith("retrieval/top1\t") for l in res.stdout.splitlines())

def test_cli_errors_exit_2(tmp_path, run):
    tmp, _ = run
    res = run_cli("-m", "cascade_nb.eval", "--checkpoint", tmp_path, check=False)
    assert res.returncode == 2 and "not a cascade_nb run directory" in res.stderr
    res = run_cli("-m", "cascade_nb.eval", "--checkpoint", tmp / "ckpt" / "ref", "--metrics", "fidd", check=False)
    assert res.returncode == 2 and "unknown metric 'fidd'" in res.stderr

def test_eval_is_resume_stable(tmp_path, run):
    "Killed while committing update 4, resumed from update 2: the same numbers and the same best choice."
    ref_tmp, _ = run
    killed = run_cli(DRIVER, "--kill-in-commit", "4", *args(tmp_path, "res"), check=False)
    assert killed.returncode != 0
    assert json.loads((tmp_path / "ckpt" / "res" / "info.json").read_text())["update"] == 2
    run_cli(DRIVER, *args(tmp_path, "res"))
    ref, res = eval_rows(ref_tmp, "ref"), eval_rows(tmp_path, "res")
    assert [r["update"] for r in res] == [2, 4, 4]   # update 4 was evaluated before the kill and again after resume
    assert res[0] == ref[0] and res[1] == res[2] == ref[1]
    assert (json.loads((tmp_path / "ckpt" / "res" / "best.json").read_text())
            == json.loads((ref_tmp / "ckpt" / "ref" / "best.json").read_text()))
