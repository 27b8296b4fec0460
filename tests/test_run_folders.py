"""A run folder handed over is data, never code (issue "Nothing runs and nothing is lost", cases B62-B69 of the hostile
audit): `sample`, `eval` and `lora export` import no module a run's info.json names unless the user's command line
does (`--import`); `eval --report` writes only into the run's outputs when they lie inside the run folder or the
current folder (or into `--report-dir`), never through a planted symbolic link, and puts every string read from the
run's files on the page as literal text. One tiny run (2 updates, with an evaluation) is shared by every case; each
case tampers with its own copy."""
import json, os, re, shutil
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

DRIVER = ROOT / "tests" / "train_driver.py"
HELPER = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared_run")
    run_cli(DRIVER, ROOT / "configs" / "demo.yaml", f"webdataset_path={ROOT / 'data_samples' / 'emoji'}",
            "num_workers=0", "image_size=32", "batch_size=4", "updates=2", "save_every=2", "eval_every=2",
            "eval_captions=4", "sample_steps=2", "experiment_id=good", "checkpoint_path=ck", "output_path=out",
            "tracker=none", cwd=tmp)
    return tmp

def handed_over(trained, tmp_path, **config):
    """A copy of the run as someone downloads it: Downloads/shared_run holds the checkpoint folder and, under out/, its
    outputs (info.json's output_path says so); `config` changes keys of the recorded config."""
    run = tmp_path / "home" / "Downloads" / "shared_run"
    shutil.copytree(trained / "ck" / "good", run)
    shutil.copytree(trained / "out" / "good", run / "out" / "good")
    info = json.loads((run / "info.json").read_text())
    info["config"].update({"output_path": "shared_run/out", **config})
    (run / "info.json").write_text(json.dumps(info))
    return run

def eval_cli(capsys, monkeypatch, cwd, *args):
    "`python -m cascade_nb.eval ARGS` run from `cwd`, in this process (a subprocess would only re-pay the imports)."
    from subprocess import CompletedProcess
    from cascade_nb.eval import main
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try: main([str(a) for a in args]); code = 0
    except SystemExit as e: code = e.code
    out = capsys.readouterr()
    return CompletedProcess(args, code, out.out, out.err)

def test_a_run_folder_runs_no_code_it_ships(trained, tmp_path):
    """B69: info.json names a module shipped in the folder; sample and eval refuse, and it never runs (lora export:
    tests/test_lora_cli.py)."""
    run = handed_over(trained, tmp_path, imports=["cnb_helpers"])
    marker = tmp_path / "pwned"
    (run / "cnb_helpers.py").write_text(HELPER.format(marker=str(marker)))
    for cmd in (["-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "an apple", "--n", "1", "--steps", "1",
                 "--out", tmp_path / "samples"],
                ["-m", "cascade_nb.eval", "--checkpoint", run, "--captions", "2", "--steps", "1"]):
        res = run_cli(*cmd, cwd=run.parent, check=False)
        assert res.returncode == 2, res.stderr[-2000:]
        assert "names module 'cnb_helpers'" in res.stderr and "--import cnb_helpers" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and not marker.exists()
    # the user's own word imports it: the run samples (the module did what it does)
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "an apple", "--n", "1", "--steps", "1",
                  "--out", tmp_path / "samples", "--import", "cnb_helpers", cwd=run.parent,
                  env={"PYTHONPATH": str(run)})
    assert "wrote 1 images" in res.stdout and marker.read_text() == "ran"

def test_a_report_chain_from_a_shared_folder_touches_nothing_outside(trained, tmp_path, capsys, monkeypatch):
    """B65 + B63: a relative link out/good/report.md -> ~/.bashrc and an eval_features holding shell code: the bad
    name is refused in one line; with a valid name the link is replaced by the page, ~/.bashrc is untouched."""
    run = handed_over(trained, tmp_path, eval_features="pixels`; echo PWNED > pwned; echo `")
    home = tmp_path / "home"
    (home / ".bashrc").write_text("# my shell\n")
    out = run / "out" / "good"
    os.symlink("../../../../.bashrc", out / "report.md")
    os.symlink("../../../../victim.png", out / "report_curves.png")
    (home / "victim.png").write_bytes(b"mine")
    res = eval_cli(capsys, monkeypatch, run.parent, "--checkpoint", "shared_run", "--captions", "2", "--steps", "1",
                   "--report")
    # refused before any sampling, in one line
    assert res.returncode == 2 and "key 'eval_features'" in res.stderr and "is not a registered feature space" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""
    assert (home / ".bashrc").read_text() == "# my shell\n" and (home / "victim.png").read_bytes() == b"mine"
    info = json.loads((run / "info.json").read_text())
    info["config"]["eval_features"] = "pixels"
    (run / "info.json").write_text(json.dumps(info))
    # the planted link counts as a report already there: replaced (not followed) only when the user says so
    res = eval_cli(capsys, monkeypatch, run.parent, "--checkpoint", "shared_run", "--captions", "2", "--steps", "1",
                   "--report")
    assert res.returncode == 2 and "a report card is there already; pass --overwrite" in res.stderr, res.stderr
    res = eval_cli(capsys, monkeypatch, run.parent, "--checkpoint", "shared_run", "--captions", "2", "--steps", "1",
                   "--report", "--overwrite")
    assert f"report: {Path('shared_run/out/good/report.md')}" in res.stdout
    assert (home / ".bashrc").read_text() == "# my shell\n" and (home / "victim.png").read_bytes() == b"mine"
    assert not (out / "report.md").is_symlink() and "# Report card: good" in (out / "report.md").read_text()
    assert not (out / "report_curves.png").is_symlink()

def test_a_report_goes_where_the_user_says_not_where_info_json_says(trained, tmp_path, capsys, monkeypatch):
    "B64: an output_path outside the run folder and the current folder is refused; --report-dir chooses."
    outside = tmp_path / "outside"
    shutil.copytree(trained / "out" / "good", outside / "good")
    run = handed_over(trained, tmp_path, output_path=str(outside))
    before = sorted(p.name for p in (outside / "good").iterdir())
    res = eval_cli(capsys, monkeypatch, run.parent, "--checkpoint", run, "--captions", "2", "--steps", "1",
                   "--report")
    assert res.returncode == 2 and "is outside the run folder and the current folder" in res.stderr
    assert "--report-dir" in res.stderr and sorted(p.name for p in (outside / "good").iterdir()) == before
    mine = tmp_path / "my_reports"
    res = eval_cli(capsys, monkeypatch, run.parent, "--checkpoint", run, "--captions", "2", "--steps", "1",
                   "--report", "--report-dir", mine)
    # the chosen folder has no metrics.jsonl: a page of the numbers scored now
    assert res.returncode == 0, res.stderr[-2000:]
    assert "## The released weights, scored now" in (mine / "report.md").read_text()

def test_text_from_the_run_is_literal_on_the_page(trained, tmp_path):
    """B62 + B66: prompt text with HTML, a newline out of the table, a remote picture; a picture name that is a link;
    an index of another prompts file; a damaged index.json is one line naming the file."""
    from cascade_nb.config import config_from_run
    from cascade_nb.report import write_report
    run = handed_over(trained, tmp_path)
    out = run / "out" / "good"
    evil = "a\n\n<script>alert(1)</script>\n\n# Injected heading\n![](http://203.0.113.7/track.png) [c](javascript:x)"
    for update, prompts in ((2, [evil, "an apple"]), (4, ["a pear"])):
        (out / "samples" / f"{update:06d}").mkdir(parents=True)
        (out / "samples" / f"{update:06d}" / "index.json").write_text(json.dumps({"update": update, "prompts": [
            {"text": p, "files": {"weights": "x.png)![](http://203.0.113.7/y.png" if p == evil else "0.png"}}
            for p in prompts]}))
    cfg = config_from_run(run / "info.json", ["generator_checkpoint_path=null"])
    page = write_report(run, cfg, out_dir=out).read_text()
    table = [l for l in page.splitlines() if l.startswith("| ")][-4:]
    assert "<script" not in page and not re.search(r"(?<!\\)\]\(http", page) and "\n# Injected" not in page
    assert table[0] == "| prompt | update 2 | update 4 |" and len(table) == 4          # header + 3 prompts
    assert table[-1] == "| a pear | - | ![](samples/000004/0.png) |"
    (out / "samples" / "000004" / "index.json").write_text('{"update": 4, "prompts": [{"text": "a"}]}')
    with pytest.raises(ValueError, match=r"000004/index.json: not an index cascade_nb writes"):
        write_report(run, cfg, out_dir=out)
