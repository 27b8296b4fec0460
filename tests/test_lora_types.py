"""The LyCORIS adapter types (`adapter: lokr | loha | dora | oft`, nbs/60_lora) through the trainer CLI at tiny size,
on configs/lora_demo.yaml: the validation loss (fixed noise levels, so comparable across updates) goes down, a run
killed inside its checkpoint commit resumes to the very state it had written, and the run samples with its adapters
merged into the base (the sample CLI). The types train in this process (each process pays lycoris' ~6 s import);
the kill and resume, which need processes, run for OFT, the type whose update depends on W and has most tensors."""
import json, textwrap
from pathlib import Path
import pytest
import torch
from conftest import ROOT, run_cli
from test_lora_train import DRIVER, pretrained_tiny, released
from test_train import _launch_2proc, resumes_to_the_killed_state

# each type's own keys; oft has no rank (lora_demo.yaml sets one)
TYPE_KEYS = {"lokr": ["lokr_factor=4"], "loha": [], "dora": [],
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
    from cascade_nb.lora import merge_lora
    run = tmp / "ckpt" / kind
    cfg, generator, weights = run_generator(run)
    assert weights.name == "lora.safetensors"
    expected = merge_lora(load_stage_c(tmp / "pretrained.safetensors").float(), released(tmp, kind))
    for k, v in expected.state_dict().items(): assert torch.equal(generator.state_dict()[k], v), k
    assert main(["--checkpoint", run, "--prompt", "an emoji", "--n", "1", "--steps", "2", "--out", tmp / "samples"])
    assert "lora.safetensors" in capsys.readouterr().out

NAMES = {"lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b"}, "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"},
         "dora": {"lora_down", "lora_up", "dora_scale"}, "oft": {"oft_blocks", "rescale"}}

@pytest.mark.parametrize("kind", ["lokr", "loha", "dora", "oft"])
def test_adapter_type_trains_and_samples(tmp_path, kind, capsys):
    "In this process (one lycoris import for all): train 6 updates, check the file and the loss, sample."
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    args = demo_args(tmp_path, kind, "updates=6", "save_every=6")
    train(load_config(args[0], [str(a) for a in args[1:]]))
    check_released(tmp_path, kind, NAMES[kind])
    samples_merged(tmp_path, kind, capsys)

def test_oft_resumes_exactly_and_samples_from_the_cli(tmp_path):
    """OFT (its update depends on W; it carries a rescale vector): a run killed committing update 4 and resumed from 2
    commits the killed process's own state of update 4, and the sample CLI merges its adapters into the base."""
    run = tmp_path / "ckpt" / "oft"
    resumes_to_the_killed_state(run, demo_args(tmp_path, "oft", "updates=4", "save_every=2"),
                                launch=lambda *a, check=True: run_cli(DRIVER, *a, check=check,
                                                                      env={"OMP_NUM_THREADS": "1"}))
    assert json.loads((run / "info.json").read_text())["update"] == 4
    assert {k.rsplit(".", 1)[1] for k in released(tmp_path, "oft")} == NAMES["oft"] | {"alpha"}
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "an emoji", "--n", "1", "--steps", "2",
                  "--out", tmp_path / "samples")
    assert "wrote 1 images" in res.stdout and list((tmp_path / "samples").glob("*.png")), res.stdout[-2000:]

def test_dora_two_process_ddp(tmp_path):
    "DoRA (its update depends on W) through the trainer on 2 DDP processes: the weights stay identical on both."
    res = _launch_2proc("--check-ddp-sync", *demo_args(tmp_path, "dora", "updates=2", "save_every=2", "batch_size=8"))
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    assert json.loads((tmp_path / "ckpt" / "dora" / "info.json").read_text())["num_processes"] == 2
    assert "dora_scale" in {k.rsplit(".", 1)[1] for k in released(tmp_path, "dora")}

FSDP_SCRIPT = textwrap.dedent('''
import gc, json, os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from cascade_nb.models.stage_c import StageC
from cascade_nb.models.blocks import ResBlock, AttnBlock, TimestepBlock
from cascade_nb.lora import apply_lora, lora_state_dict, lora_layers, LoraNet
OPTS = {"dora": {}, "oft": {"oft_block_size": 16, "oft_rescale": True}, "loha": {}, "lokr": {}}
def build(kind):
    torch.manual_seed(0)
    gen = StageC.from_preset("tiny")
    with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)
    apply_lora(gen, [".attn"], rank=4, adapter=kind, options=OPTS[kind])
    with torch.no_grad():
        for l in lora_layers(gen).values():
            for t in l.tensors().values(): t.add_(torch.randn_like(t) * 0.02)
    return LoraNet(gen)
def batch(rank, B=2):
    g = torch.Generator().manual_seed(10 + rank)
    return (torch.randn(B, 16, 8, 8, generator=g), torch.rand(B, generator=g),
            dict(clip_text=torch.randn(B, 77, 64, generator=g), clip_text_pooled=torch.randn(B, 1, 64, generator=g),
                 clip_img=torch.randn(B, 1, 64, generator=g)))
def step(net, inputs):
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    loss = sum((net(x, r, **c)).square().mean() / len(inputs) for x, r, c in inputs)
    loss.backward(); opt.step()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
errs = {}
for kind in OPTS:
    ref = build(kind); step(ref, [batch(i) for i in range(world)]); want = lora_state_dict(ref.generator)
    net = build(kind)
    for m in net.modules():
        if isinstance(m, (ResBlock, AttnBlock, TimestepBlock)): fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    step(net, [batch(rank)]); got = lora_state_dict(net.generator)
    assert got.keys() == want.keys()
    err = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    errs[kind] = err
# one file per rank (the ranks' stdout lines interleave)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f: json.dump(errs, f)
del net, ref; gc.collect()
dist.destroy_process_group()
''')

def test_types_under_fsdp2(tmp_path):
    """Each type's net under FSDP2 (`fully_shard` per block, the frozen base sharded too) on 2 CPU processes: one SGD
    step gives the adapters a single process gets from both ranks' batches (as tests/test_lora_fsdp.py for LoRA)."""
    script = tmp_path / "fsdp_types.py"
    script.write_text(FSDP_SCRIPT)
    run_cli("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, tmp_path,
            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    for rank in (0, 1):
        errs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(errs) == ["dora", "loha", "lokr", "oft"] and max(errs.values()) < 1e-5, (rank, errs)
