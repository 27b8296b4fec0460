"""A ControlNet that reads control images made beforehand from the data (`controlnet_filter: dataset`, issue 49):
configs/controlnet_images_demo.yaml as shipped (data_samples/emoji_control: each emoji with its silhouette as
`NNNN.control.png`) on a tiny stand-in for the demo model. The control images reach the ControlNet (the released
ControlNet reads 3 channels and learned), a kill inside a checkpoint commit resumes bit-identically (crop jitter and
flips draw per sample, the control image with its image), `python -m cascade_nb.sample --control IMAGE` follows a
user's control image, and `data pack` / `inspect` carry and count the control members. The config on 2 processes (DDP,
FSDP2), stopped by a signal and resumed, then sampled and scored, is the shipped-config matrix's
(tests/test_shipped_configs.py)."""
import shutil, tarfile
from pathlib import Path
from safetensors.torch import load_file
from conftest import ROOT, run_cli
from test_lora_train import pretrained_tiny, info
from test_train import resumes_to_the_killed_state

DEMO = ROOT / "configs" / "controlnet_images_demo.yaml"

def demo_args(tmp: Path, name: str, *extra) -> list:
    "configs/controlnet_images_demo.yaml as shipped, a few small updates on a tiny base, writing under `tmp`."
    base = pretrained_tiny(tmp / "pretrained.safetensors")
    return [DEMO, f"generator_checkpoint_path={base}", f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt",
            f"output_path={tmp}/out", "num_workers=0", "batch_size=4", "log_every=1", "warmup_updates=1",
            "sample_steps=2", "tracker=none", *extra]

def test_dataset_controls_train_and_resume_bit_identically(tmp_path):
    run = tmp_path / "ckpt" / "c"
    resumes_to_the_killed_state(run, demo_args(tmp_path, "c", "updates=6", "save_every=2"))
    assert info(tmp_path, "c")["update"] == 6
    sd = load_file(str(run / "controlnet.safetensors"))
    from cascade_nb.controlnet import controlnet_config
    assert controlnet_config(sd)["c_in"] == 3                                   # the RGB control images
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.startswith("projections.") and k.endswith(".2.weight"))
    # sampled with a user's control image: another control image, another sample (same prompt and seed)
    from cascade_nb.sample import main
    controls = ROOT / "data_samples" / "emoji_control"
    out = {}
    for key in ("0000", "0005"):
        paths = main(["--checkpoint", str(run), "--prompt", "octopus", "--n", "1", "--steps", "2", "--out",
                      str(tmp_path / key), "--control", str(controls / f"{key}.control.png")])
        out[key] = paths[0].read_bytes()
    assert out["0000"] != out["0005"]
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "x", "--control", tmp_path / "none.png",
                  check=False)
    assert res.returncode == 2 and "none.png" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr

def test_control_on_a_run_that_follows_none_is_refused(tmp_path):
    from cascade_nb.sample import read_control
    class Full: follows_control, name = False, "full"
    import pytest
    with pytest.raises(ValueError, match="a 'full' run follows no control image"):
        read_control(ROOT / "data_samples" / "emoji_control" / "0000.control.png", 16, Full())
    (tmp_path / "x.png").write_text("not an image")
    with pytest.raises(ValueError, match="x.png: not an image"): read_control(tmp_path / "x.png", 16)
    c = read_control(ROOT / "data_samples" / "emoji_control" / "0000.control.png", 16)
    assert c.shape == (1, 3, 16, 16) and 0 <= c.min() < c.max() <= 1

def test_pack_and_inspect_carry_the_control_members(tmp_path):
    "A loose folder's `NNNN.control.png` is packed into the shard beside `NNNN.png` and counted by inspect."
    folder = tmp_path / "loose"
    shutil.copytree(ROOT / "data_samples" / "emoji_control", folder)
    (folder / "0003.control.png").unlink()
    run_cli("-m", "cascade_nb.data", "pack", folder, tmp_path / "shards")
    with tarfile.open(next((tmp_path / "shards").glob("*.tar"))) as tar: names = tar.getnames()
    assert "0000.control.png" in names and "0003.control.png" not in names and "0003.png" in names
    out = run_cli("-m", "cascade_nb.data", "inspect", tmp_path / "shards", "--image-size", "16").stdout
    assert "members beside the images: control.png 31" in out, out
    # a ControlNet run reading them skips the sample without one, with the reason
    from cascade_nb.data.pipeline import build_dataset
    ds = build_dataset(tmp_path / "shards", 8, image_size=16, resampled=False, shuffle_buffer=0,
                       control_member="control.png", drop_last=False)
    assert sum(len(b["keys"]) for b in ds) == 31 and ds.counter.total["missing_control"] == 1

def test_generate_follows_a_control_image(tmp_path):
    """`generate --stage-c-weights CONTROLNET_RUN --control IMAGE` on the tiny official-layout models: the run's filter
    (here the control image itself) steers Stage C in both CFG branches; without a ControlNet run, one line."""
    import numpy as np
    from PIL import Image
    from cascade_nb.inference import write_tiny_checkpoints
    models = write_tiny_checkpoints(tmp_path / "models")
    run_cli("-m", "cascade_nb.train", DEMO, "model_version=tiny", "model_overrides={}", "latent_space=effnet",
            "effnet_checkpoint_path=tiny", "previewer_checkpoint_path=tiny", "image_size=64",
            "multi_aspect_ratio=null", f"generator_checkpoint_path={models / 'stage_c.safetensors'}",
            "experiment_id=cn", f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out", "num_workers=0",
            "batch_size=4", "updates=2", "save_every=2", "sample_steps=2", "tracker=none", "lr=0.05",
            "warmup_updates=1", env={"OMP_NUM_THREADS": "1"})
    silhouette = ROOT / "data_samples" / "emoji_control" / "0000.control.png"
    inverted = tmp_path / "inverted.png"
    Image.fromarray(255 - np.asarray(Image.open(silhouette))).save(inverted)
    args = ["--models", models, "--seed", "1", "--height", "128", "--width", "128", "--steps-c", "2", "--steps-b", "2",
            "--device", "cpu", "--no-previews"]
    images = []
    for name, control in (("a", silhouette), ("b", inverted)):
        res = run_cli("-m", "cascade_nb.generate", "an octopus", "--stage-c-weights", tmp_path / "ckpt" / "cn",
                      "--control", control, "--out", tmp_path / name, *args)
        images.append(Path(res.stdout.strip().splitlines()[0]).read_bytes())
    assert images[0] != images[1]
    res = run_cli("-m", "cascade_nb.generate", "x", "--control", silhouette, "--out", tmp_path / "c", *args, check=False)
    assert res.returncode == 2 and "pass the run as --stage-c-weights" in res.stderr, res.stderr
