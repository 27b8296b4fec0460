"The generate CLI as a real subprocess on tiny random checkpoints: images written and printed, seeded determinism, clear errors."
from pathlib import Path
import pytest
from conftest import run_cli

ARGS = ("--height", "128", "--width", "96", "--steps-c", "2", "--steps-b", "2", "--device", "cpu")

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from cascade_nb.inference import write_tiny_checkpoints
    return write_tiny_checkpoints(tmp_path_factory.mktemp("ckpt") / "models")

def test_generate_writes_and_prints_images(models, tmp_path):
    from PIL import Image
    res = run_cli("-m", "cascade_nb.generate", "a red bus", "a cat", "--models", models, "--out", tmp_path / "out",
                  "--seed", "5", *ARGS)
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("wrote 2 image(s)") and "seed 5" in lines[-1]
    paths = [Path(l) for l in lines[:-1]]
    assert len(paths) == 4 and all(p.is_file() for p in paths)             # 2 images + 2 Stage C previews
    assert paths[0].name == "5_00_a-red-bus.png" and paths[1].name == "5_00_a-red-bus_preview.png"
    assert Image.open(paths[0]).size == (96, 128)
    again = run_cli("-m", "cascade_nb.generate", "a red bus", "a cat", "--models", models, "--out", tmp_path / "again",
                    "--seed", "5", "--no-previews", *ARGS)
    again_paths = [Path(l) for l in again.stdout.strip().splitlines()[:-1]]
    assert len(again_paths) == 2                                             # no previews
    assert again_paths[1].read_bytes() == paths[2].read_bytes()              # same seed and prompts, same image

def test_generate_errors_are_clear(models, tmp_path):
    res = run_cli("-m", "cascade_nb.generate", "x", "--models", tmp_path / "missing", *ARGS, check=False)
    assert res.returncode == 2 and "not a directory" in res.stderr
    res = run_cli("-m", "cascade_nb.generate", "x", "--models", models, "--dtype", "float16", *ARGS, check=False)
    assert res.returncode == 2 and "overflow" in res.stderr
