"""Config files and values as a careless or hostile user writes them, through the commands: a key given twice (the
last silently won), a YAML alias bomb (3.7 KB took 7.5 GB and 175 s), a file too big to be a config, and run names
that escape `checkpoint_path` or cannot be a folder. Each ends in one line on stderr and exit status 2, and nothing
is written."""
import pytest
from conftest import ROOT, run_cli
from test_cli_errors import one_line_error

DEMO = ROOT / "configs" / "demo.yaml"

def test_key_given_twice_names_key_and_both_lines(tmp_path):
    text = DEMO.read_text()
    cfg = tmp_path / "twice.yaml"
    cfg.write_text(text + "\n# a week later\nlr: 1.0e-3\n")
    first = 1 + next(i for i, line in enumerate(text.splitlines()) if line.startswith("lr:"))
    last = len(text.splitlines()) + 3
    one_line_error(run_cli("-m", "cascade_nb.memory", cfg, check=False),
                   f"twice.yaml: key 'lr' is given twice in one mapping, on line {first} and line {last}")

def test_key_given_twice_inside_model_overrides(tmp_path):
    cfg = tmp_path / "nested.yaml"
    block = "model_overrides:\n  c_in: 3\n  c_out: 3\n  patch_size: 2\n  patch_size: 4"
    cfg.write_text(DEMO.read_text().replace("model_overrides: {c_in: 3, c_out: 3, patch_size: 2}", block))
    one_line_error(run_cli("-m", "cascade_nb.memory", cfg, check=False), "key 'patch_size' is given twice")
    one_line_error(run_cli("-m", "cascade_nb.memory", DEMO, "model_overrides={c_in: 3, c_in: 4}", check=False),
                   "override 'model_overrides={c_in: 3, c_in: 4}': key 'c_in' is given twice")

def test_alias_bomb_is_refused_before_anything_is_built(tmp_path):
    # 9 levels of 8 references each: 8**9 = 134 million values in under 500 bytes
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 8)}]" for i in range(1, 9)]
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(DEMO.read_text().replace("model_overrides: {c_in: 3, c_out: 3, patch_size: 2}",
                                            "model_overrides:\n" + "".join(f"  {line}\n" for line in levels)))
    res = run_cli("-m", "cascade_nb.memory", cfg, check=False, timeout=120)
    one_line_error(res, "bomb.yaml: line", "more than 100000 values")

def test_file_too_big_to_be_a_config(tmp_path):
    cfg = tmp_path / "huge.yaml"
    cfg.write_text(DEMO.read_text() + "# padding\n" * 200_000)
    one_line_error(run_cli("-m", "cascade_nb.memory", cfg, check=False), "huge.yaml: more than 1048576 bytes")

@pytest.mark.parametrize("name, message", [
    ("../escaped", "'../escaped' contains '/'"),
    ("/tmp/escaped_abs_cascade_nb", "contains '/'"),
    ("", "'' is empty"),
    ("..", "not a run's own"),
    ("a" * 300, "has 300 characters"),
])
def test_experiment_id_is_one_folder_name(name, message, tmp_path):
    res = run_cli("-m", "cascade_nb.train", DEMO, f"experiment_id={name}", "checkpoint_path=ck", "output_path=out",
                  "updates=1", "num_workers=0", "tracker=none", "eval_every=null", cwd=tmp_path, check=False)
    one_line_error(res, "override: key 'experiment_id': ", message, "expected 1 to 128 letters, digits")
    # nothing written: not next to checkpoint_path, not inside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())

@pytest.mark.parametrize("overrides, says", [("{c_in: 3, c_out: 3, patch_size: 0}", "patch_size=0 is out of range"),
                                             ("{c_in: 3, c_out: 3, kernel_size: 4}", "kernel_size=4 is even")])
def test_model_overrides_out_of_range_refused_before_the_run_folder(overrides, says, tmp_path, capsys, monkeypatch):
    # in this process: train's start-up refuses it before the accelerator or any folder exists
    from cascade_nb.train import main
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([str(DEMO), f"model_overrides={overrides}", "experiment_id=c5d", "checkpoint_path=ck", "output_path=out",
              "updates=1", "num_workers=0", "tracker=none", "eval_every=null"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "key 'model_overrides'" in err[0] and says in err[0], err
    assert "expected" in err[0] and sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
