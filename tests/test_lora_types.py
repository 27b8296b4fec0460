"""The LyCORIS adapter types (`adapter: lokr | loha | dora | oft`, nbs/60_adapters) through the trainer CLI at tiny size,
on configs/lora_demo.yaml: the validation loss (fixed noise levels, so comparable across updates) goes down, a run
killed inside its checkpoint commit resumes to the very state it had written, and the run samples with its adapters
merged into the base (the sample CLI). The types train in this process (one model and data set-up for all);
the kill and resume, which need processes, run for OFT, the type whose update depends on W and has most tensors.
DoRA on 2 DDP processes is tests/test_lora_train.py's DDP run; every type under FSDP2 is tests/test_lora_fsdp.py's."""
import json
from pathlib import Path
import pytest
import torch
from conftest import ROOT, run_cli
from test_lora_train import DRIVER, pretrained_tiny, released
from test_train import resumes_to_the_killed_state

# each type's own keys; oft has no rank (lora_demo.yaml sets one)
TYPE_KEYS = {"lora": [], "lokr": ["lokr_factor=4"], "loha": [], "dora": [],
             "oft": ["rank=null", "oft_block_size=16", "oft_rescale=true"]}
TINY = ["train_tokens=null", "num_workers=0", "batch_size=4", "log_every=1", "warmup_updates=1", "lr=1e-2",
        "sample_steps=2", "val_webdataset_path=data_samples/emoji", "val_every=2", "val_batches=2"]

def demo_args(tmp: Path, kind: str, *extra):
    "configs/lora_demo.yaml with `adapter: kind` on the tiny 'pretrained' base, writing under `tmp`."
    return [ROOT / "configs" / "lora_demo.yaml", *TINY, f"adapter={kind}", *TYPE_KEYS[kind],
            f"generator_checkpoint_path={pretrained_tiny(tmp / 'pretrained.safetensors')}", f"experiment_id={kind}",
            f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *extra]

def val_losses(tmp: Path, kind: str) -> list[float]:
    rows = [json.loads(line) for line in (tmp / "out" / kind / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in sorted((r for r in rows if "val_loss" in r), key=lambda r: r["update"])]

def check_released(tmp: Path, kind: str, names: set):
    "The released file holds this type's tensors (LyCORIS names), and the adapters moved from their zero start."
    sd = released(tmp, kind)
    assert {k.rsplit(".", 1)[1] for k in sd} == names | {"alpha"}, sorted(sd)[:6]
    losses = val_losses(tmp, kind)
    assert len(losses) >= 3 and losses[-1] < losses[0], losses

def samples_merged(tmp: Path, kind: str, capsys):
    """The run as the sample CLI loads it: the base with the released adapters merged (the same weights, bit for bit, as
    `merge_lora` on the base file), and the CLI's `main` writes a sample."""
    from cascade_nb.sample import run_generator, main
    from cascade_nb.models.stage_c import load_stage_c
    from cascade_nb.lora_file import merge_lora
    run = tmp / "ckpt" / kind
    cfg, generator, weights = run_generator(run)
    assert weights.name == "lora.safetensors"
    from cascade_nb.lora_converters import split_text_encoder
    expected = merge_lora(load_stage_c(tmp / "pretrained.safetensors").float(), split_text_encoder(released(tmp, kind))[0])
    for k, v in expected.state_dict().items(): assert torch.equal(generator.state_dict()[k], v), k
    assert main(["--checkpoint", run, "--prompt", "an emoji", "--n", "1", "--steps", "2", "--out", tmp / "samples"])
    assert "lora.safetensors" in capsys.readouterr().out

NAMES = {"lora": {"lora_down", "lora_up"}, "lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b"}, "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"},
         "dora": {"lora_down", "lora_up", "dora_scale"}, "oft": {"oft_blocks", "rescale"}}

def exports_exactly(tmp: Path, kind: str, capsys):
    """`lora export RUN --to kohya --for READER --model RUN` (the run's own base, its text encoder too) for ComfyUI and
    for LyCORIS, and `check --for READER --model RUN` on each: exit 0, no warning (each reader reads what trained)."""
    from cascade_nb.lora import main
    run = tmp / "ckpt" / kind
    for reader in ("comfyui", "lycoris"):
        out = tmp / f"{kind}_{reader}.safetensors"
        capsys.readouterr()
        assert main(["export", run, "--to", "kohya", "--for", reader, "--model", run, "--out", out]) == 0
        assert "warning" not in capsys.readouterr().err
        code, text = main(["check", out, "--for", reader, "--model", run]), capsys.readouterr().out
        assert code == 0 and "warning" not in text, (reader, text[-1500:])

# text-encoder adapters of the same type beside the generator's, for two of the types
TEXT_ENCODER = {"lora": ["text_encoder_adapter=lora"], "lokr": ["text_encoder_adapter=lokr"],
                "dora": ["text_encoder_adapter=dora"]}

@pytest.mark.parametrize("kind", ["lora", "lokr", "loha", "dora", "oft"])
def test_adapter_type_trains_and_samples(tmp_path, kind, capsys):
    """In this process (one lycoris import for all): train 6 updates, check the file and the loss, sample, export for
    ComfyUI and LyCORIS with the run as the base."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    args = demo_args(tmp_path, kind, "updates=6", "save_every=6", *TEXT_ENCODER.get(kind, []))
    train(load_config(args[0], [str(a) for a in args[1:]]))
    check_released(tmp_path, kind, NAMES[kind])
    samples_merged(tmp_path, kind, capsys)
    exports_exactly(tmp_path, kind, capsys)

def test_oft_resumes_exactly_and_samples(tmp_path, capsys):
    """OFT (its update depends on W; it carries a rescale vector): a run killed committing update 4 and resumed from 2
    commits the killed process's own state of update 4, and the sample command (its `main`, in this process) merges its
    adapters into the base."""
    from cascade_nb.sample import main
    run = tmp_path / "ckpt" / "oft"
    resumes_to_the_killed_state(run, demo_args(tmp_path, "oft", "updates=4", "save_every=2"),
                                launch=lambda *a, check=True: run_cli(DRIVER, *a, check=check,
                                                                      env={"OMP_NUM_THREADS": "1"}))
    assert json.loads((run / "info.json").read_text())["update"] == 4
    assert {k.rsplit(".", 1)[1] for k in released(tmp_path, "oft")} == NAMES["oft"] | {"alpha"}
    assert main(["--checkpoint", str(run), "--prompt", "an emoji", "--n", "1", "--steps", "2",
                 "--out", str(tmp_path / "samples")]) is not None
    out = capsys.readouterr().out
    assert "wrote 1 images" in out and list((tmp_path / "samples").glob("*.png")), out[-2000:]

