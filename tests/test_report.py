"""The report card through the real trainer and CLI: a tiny LoRA run logs subject fidelity, drift, diversity and prompt
fidelity at each evaluation and keeps the stopping rule's update; `python -m cascade_nb.eval --report` writes its page;
bad report keys are refused in one line before training."""
import json
from pathlib import Path
import pytest
from conftest import run_cli
from test_lora_train import DRIVER, REPORT, lora_args

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    run_cli(DRIVER, *lora_args(tmp, "card", "updates=4", "save_every=4", *REPORT))
    return tmp

def eval_rows(tmp, name):
    from cascade_nb.eval import read_evaluations
    return read_evaluations(Path(tmp) / "out" / name / "metrics.jsonl")

def test_training_logs_the_card_and_keeps_the_rules_update(run):
    from cascade_nb.report import stopping_update
    rows = eval_rows(run, "card")
    assert [r["update"] for r in rows] == [2, 4]
    want = {"eval/subject_fidelity", "eval/drift", "eval/diversity", "eval/prompt_fidelity"}
    assert want <= set(rows[0]), rows[0]
    assert all(r["eval/drift"] > 0 for r in rows)    # trained adapters move the samples away from the base's
    best = json.loads((run / "ckpt" / "card" / "best.json").read_text())
    assert best["metric"] == "stopping_rule" and best["weights"] == "lora_best.safetensors"
    assert (best["update"], best["value"]) == stopping_update(rows)
    assert (run / "ckpt" / "card" / "lora_best.safetensors").exists()

def test_cli_report_writes_the_page(run):
    ck = run / "ckpt" / "card"
    # from the folder it trained in: the outputs folder its info.json names is inside the current folder
    res = run_cli("-m", "cascade_nb.eval", "--checkpoint", ck, "--report", "--json", run / "now.json", cwd=run)
    page = run / "out" / "card" / "report.md"
    assert f"report: {page}" in res.stdout
    text = page.read_text()
    assert "## The update to keep" in text and "lora_best.safetensors" in text
    assert "![](report_curves.png)" in text and "![](eval_000004.png)" in text
    assert (run / "out" / "card" / "report_curves.png").stat().st_size > 1000
    # released weights scored now: merged adapters against the recorded base checkpoint, so drift is still above 0
    now = json.loads((run / "now.json").read_text())[str(ck)]
    assert now["drift"] > 0 and "| drift |" in text

@pytest.mark.parametrize("extra, message", [
    (["eval_drift_prompts=null"], "key 'eval_drift_prompts' is not set"),
    (["eval_features=dinoo"], "key 'eval_features': 'dinoo' is not a registered feature space; did you mean 'dino'?"),
    (["eval_metrics=[subject_fidelity]"], "rule 'stopping_rule' needs ['subject_fidelity', 'drift']"),
    (["eval_seeds=1"], "key 'eval_seeds': 1 is out of range"),
])
def test_bad_report_keys_are_refused_before_training(tmp_path, extra, message):
    res = run_cli(DRIVER, *lora_args(tmp_path, "bad", "updates=2", *REPORT, *extra), check=False)
    assert res.returncode != 0 and message in res.stderr, res.stderr[-1500:]
    assert not (tmp_path / "out" / "bad" / "metrics.jsonl").exists()
