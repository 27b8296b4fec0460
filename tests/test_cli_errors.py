"""Every command as a user types it: options and key=value overrides in any order, and each bad input (config
values out of range, a config path that is a folder or not text, missing or corrupt weights, `--n 0`, `--out` a
file, an empty models folder) ends in ONE line on stderr and exit status 2, without a traceback or a download."""
import json, shutil
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

DEMO = ROOT / "configs" / "demo.yaml"

def one_line_error(res, *needles):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, (res.returncode, res.stderr[-3000:])
    for n in needles: assert n in lines[0], lines[0]
    return lines[0]

def test_memory_takes_options_and_overrides_in_any_order():
    res = run_cli("-m", "cascade_nb.memory", DEMO, "--budget", "80", "batch_size=8", "--world-size", "2", "image_size=64")
    assert "budget 80 GB per GPU" in res.stdout and "peak per GPU" in res.stdout

@pytest.mark.parametrize("override, message", [
    ("log_every=0", "key 'log_every': 0 is out of range; expected >= 1"),
    ("lr=inf", "key 'lr': inf is out of range; expected > 0"),
    ("adam_betas=[2, 3]", "key 'adam_betas[0]': 2.0 is out of range; expected in [0, 1)"),
])
def test_train_refuses_out_of_range_values_in_one_line(override, message):
    one_line_error(run_cli("-m", "cascade_nb.train", DEMO, override, check=False), "override:", message)

def test_config_path_that_is_a_folder_or_not_text(tmp_path):
    one_line_error(run_cli("-m", "cascade_nb.memory", tmp_path, check=False), "is a directory; expected a YAML file")
    binary = tmp_path / "model.safetensors"; binary.write_bytes(b"\x80\x81\xff\x00" * 10)
    one_line_error(run_cli("-m", "cascade_nb.train", binary, check=False), "not UTF-8 text")

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from cascade_nb.inference import write_tiny_checkpoints
    return write_tiny_checkpoints(tmp_path_factory.mktemp("ckpt") / "models")

GEN = ("--height", "128", "--width", "96", "--steps-c", "2", "--steps-b", "2", "--device", "cpu")

def test_generate_file_errors(models, tmp_path):
    empty = tmp_path / "empty"; empty.mkdir()
    # used to fall through to downloading the CLIP tokenizer/text encoder from the hub
    one_line_error(run_cli("-m", "cascade_nb.generate", "x", "--models", empty, *GEN, check=False, env={"HF_HUB_OFFLINE": "1"}),
                   "no stage_c*.safetensors and no diffusers prior/")
    broken = tmp_path / "broken"; shutil.copytree(models, broken)
    next(broken.glob("stage_b*.safetensors")).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    one_line_error(run_cli("-m", "cascade_nb.generate", "x", "--models", broken, *GEN, check=False), "not a readable safetensors file")
    one_line_error(run_cli("-m", "cascade_nb.generate", "x", "--models", models, "--n", "0", *GEN, check=False), "--n: 0 must be >= 1")
    afile = tmp_path / "afile"; afile.write_text("x")
    one_line_error(run_cli("-m", "cascade_nb.generate", "x", "--models", models, "--out", afile, *GEN, check=False),
                   "--out must be a folder, but it is a file")
    res = run_cli("-m", "cascade_nb.generate", "--models", models, "a red bus", "--seed", "1", *GEN, "a cat", "--out", tmp_path / "o")
    assert "wrote 2 image(s)" in res.stdout   # prompts before and after options

@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    "A run directory whose info.json is real and whose weights are not."
    from cascade_nb.config import load_config
    run = tmp_path_factory.mktemp("run") / "demo"; run.mkdir()
    cfg = load_config(DEMO, [f"webdataset_path={ROOT / 'data_samples' / 'emoji'}"])
    (run / "info.json").write_text(json.dumps({"config": cfg.to_yaml_dict(), "update": 2, "state_dir": "state-00000002"}))
    (run / "generator.safetensors").write_bytes(b"garbage")
    return run

def test_sample_file_errors(fake_run, tmp_path):
    one_line_error(run_cli("-m", "cascade_nb.sample", "--checkpoint", tmp_path / "nope", "--prompt", "x", check=False), "no info.json")
    one_line_error(run_cli("-m", "cascade_nb.sample", "--checkpoint", fake_run, "--prompt", "x", "--out", tmp_path / "s", check=False),
                   "generator.safetensors: not a readable safetensors file")
    one_line_error(run_cli("-m", "cascade_nb.sample", "--checkpoint", fake_run, "--prompt", "x", "--n", "0", check=False), "--n: 0 must be >= 1")
    afile = tmp_path / "afile"; afile.write_text("x")
    one_line_error(run_cli("-m", "cascade_nb.sample", "--checkpoint", fake_run, "--prompt", "x", "--out", afile, check=False),
                   "--out must be a folder")

def test_data_cli_file_errors_and_option_order(tmp_path):
    one_line_error(run_cli("-m", "cascade_nb.data", "inspect", tmp_path / "nope", check=False), "no such file or folder")
    one_line_error(run_cli("-m", "cascade_nb.data", "inspect", "--limit", "0x", tmp_path, check=False), "--limit")
    one_line_error(run_cli("-m", "cascade_nb.data", "cache", tmp_path, tmp_path / "out", "--config", tmp_path / "missing.yaml", check=False),
                   "does not exist")
    res = run_cli("-m", "cascade_nb.data", "inspect", "--limit", "3", ROOT / "data_samples" / "emoji", "--image-size", "32")
    assert "usable samples: 3" in res.stdout

def test_data_inspect_config_takes_overrides_not_sources():
    # `inspect CONFIG key=value`: the override applies (image_size 32 -> a 32x32 bucket for the 64x64 emoji)
    res = run_cli("-m", "cascade_nb.data", "inspect", DEMO, "image_size=32", "--limit", "2")
    assert "usable samples: 2" in res.stdout and "-> 32x32" in res.stdout, res.stdout
    one_line_error(run_cli("-m", "cascade_nb.data", "inspect", DEMO, "image_sizee=32", check=False),
                   "unknown key 'image_sizee'; did you mean 'image_size'?")
    one_line_error(run_cli("-m", "cascade_nb.data", "inspect", DEMO, ROOT / "data_samples" / "emoji", check=False),
                   "is not a key=value override", "inspect SOURCE --config CONFIG")

def test_sample_never_overwrites_and_refuses_a_huge_seed(fake_run, tmp_path):
    out = tmp_path / "s"; out.mkdir()
    mine = out / "0_1_x.png"; mine.write_bytes(b"a user's file")
    # refused before the run is loaded (this run's weights are garbage: loading them would be another error)
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", fake_run, "--prompt", "x", "--n", "2", "--out", out,
                  check=False)
    one_line_error(res, "0_1_x.png: --out already holds this file; pass --overwrite to replace")
    assert mine.read_bytes() == b"a user's file"
    one_line_error(run_cli("-m", "cascade_nb.sample", "--checkpoint", fake_run, "--prompt", "x", "--seed",
                           "99999999999999999999", check=False), "--seed: 99999999999999999999 must be <= 4294967295")
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", fake_run, "--prompt", "x", "--seed", "-1", check=False)
    one_line_error(res, "--seed: -1 must be >= 0")

@pytest.fixture(scope="module")
def random_run(tmp_path_factory):
    "A run directory with real (randomly initialised) tiny weights: enough to sample from."
    from safetensors.torch import save_file
    from cascade_nb.config import load_config
    from cascade_nb.modes import build_generator
    run = tmp_path_factory.mktemp("run") / "demo"; run.mkdir()
    cfg = load_config(DEMO, [f"webdataset_path={ROOT / 'data_samples' / 'emoji'}"])
    info = {"config": cfg.to_yaml_dict(), "update": 2, "state_dir": "state-00000002"}
    (run / "info.json").write_text(json.dumps(info))
    save_file(build_generator(cfg).state_dict(), run / "generator.safetensors")
    return run

def test_sample_in_batches_and_overwrite_on_request(random_run, tmp_path):
    out = tmp_path / "s"
    args = ("-m", "cascade_nb.sample", "--checkpoint", random_run, "--prompt", "red apple", "--prompt", "cactus",
            "--n", "20", "--batch", "8", "--steps", "1", "--out", out)
    res = run_cli(*args, env={"OMP_NUM_THREADS": "1"})
    assert "wrote 40 images" in res.stdout
    from PIL import Image
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 41 and "0_39_cactus.png" in names and "0_grid.png" in names, names
    # the grid: a row per prompt, at most 16 images each (16 px images, 2 px padding)
    assert Image.open(out / "0_grid.png").size == (16 * 18 + 2, 2 * 18 + 2)
    first = (out / "0_0_red_apple.png").read_bytes()
    one_line_error(run_cli(*args, check=False),
                   "0_0_red_apple.png: --out already holds this file (and 40 more of the 41")
    res = run_cli(*args, "--overwrite", env={"OMP_NUM_THREADS": "1"})
    assert (out / "0_0_red_apple.png").read_bytes() == first   # same seed, same images

def in_process_error(main, argv, capsys, *needles):
    "`main(argv)` in this process: exit status 2 and ONE line on stderr holding each of `needles`."
    with pytest.raises(SystemExit) as e: main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "Traceback" not in "\n".join(err), (e.value.code, err)
    assert any(all(n in line for n in needles) for line in err), err   # argparse's usage line may come first
    return err

@pytest.mark.parametrize("module, args, says", [
    ("sample", ["--prompt", "x", "--cfg", "nan"], "argument --cfg: 'nan' is not a finite number"),
    ("sample", ["--prompt", "x", "--cfg=-inf"], "argument --cfg: '-inf' is not a finite number"),
    ("eval", ["--seed", "1e20"], "argument --seed: '1e20' is not an integer"),
    ("eval", ["--seed", str(2**32)], "argument --seed: 4294967296 must be <= 4294967295"),
    ("eval", ["--cfg", "inf"], "argument --cfg: 'inf' is not a finite number")])
def test_sample_and_eval_share_the_option_types(fake_run, capsys, module, args, says):
    # refused when parsed, before the run (whose weights here are garbage) is read
    import importlib
    in_process_error(importlib.import_module(f"cascade_nb.{module}").main, ["--checkpoint", fake_run, *args], capsys, says)

def test_sample_refuses_nan_weights_and_writes_nothing(random_run, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from cascade_nb.sample import main
    run = tmp_path / "nan_run"; run.mkdir()
    shutil.copy(random_run / "info.json", run / "info.json")
    sd = load_file(random_run / "generator.safetensors")
    save_file({k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in sd.items()},
              run / "generator.safetensors")
    out = tmp_path / "s"
    in_process_error(main, ["--checkpoint", run, "--prompt", "x", "--steps", "1", "--out", out], capsys,
                     "generator.safetensors: ", "tensors hold NaN or inf", "--no-ema")
    assert not any(out.iterdir())
