"""Block swap and activation offload (nbs/40g_block_swap): on CPU the swapped step equals the unswapped one bit for bit
(the "device" copies are real copies, so a lost write-back or gradient shows), the schedule of moves, the refusals,
the trainer through `prepare_swapped`, and the planner's 8 GB plan for the official 3.6B full fine-tune."""
import copy
import pytest
import torch
from conftest import ROOT, run_cli
from cascade_nb.block_swap import BlockSwapper, ActivationOffload, prepare_swapped, swapped_blocks, stage_blocks
from cascade_nb.config import ConfigError, config_from_dict
from cascade_nb.models.stage_c import StageC
from cascade_nb.optimizers import FusedBackward

def inputs(model, seed, batch=2, side=8):
    g, c = torch.Generator().manual_seed(seed), model.config
    rnd = lambda *s: torch.randn(*s, generator=g)
    return dict(x=rnd(batch, c["c_in"], side, side), r=torch.rand(batch, generator=g), clip_text=rnd(batch, 77, c["c_clip_text"]),
                clip_text_pooled=rnd(batch, 1, c["c_clip_text_pooled"]), clip_img=rnd(batch, 1, c["c_clip_img"]))

def steps(model, fused: bool, n_steps=2, accum=1, swap=0):
    """`n_steps` optimizer updates of `accum` micro-steps each, `swap` blocks swapped (their fused optimizers' state
    travelling with them): the losses, the last gradients (non-fused) and the swapper."""
    build = lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    opt = FusedBackward(model.parameters(), build) if fused else build(model.parameters())
    swapper = BlockSwapper(model, swap, "cpu", [o.state for o in getattr(opt, "opts", ())]) if swap else None
    losses, grads = [], []
    for s in range(n_steps):
        for k in range(accum):
            loss = model(**inputs(model, 10 * s + k)).square().mean()
            loss.backward(); losses.append(loss.detach())
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step(); opt.zero_grad(set_to_none=True)
    return losses, grads, swapper

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return StageC.from_preset("tiny")

@pytest.mark.parametrize("n", [1, 5, 18])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_swapped_step_equals_unswapped(tiny, n, checkpointing, fused):
    ref, m = copy.deepcopy(tiny), copy.deepcopy(tiny)
    ref.gradient_checkpointing = m.gradient_checkpointing = checkpointing
    accum = 1 if fused else 2   # the fused backward cannot accumulate; without it a swapped block's gradient comes back in
    want, got = steps(ref, fused, accum=accum), steps(m, fused, accum=accum, swap=n)
    swap = got[2]
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))
    assert {p.device.type for p in m.parameters()} == {"cpu"} and not any(b.resident for b in swap.blocks.values())

def test_fused_optimizer_state_travels_with_its_block(tiny):
    "With the swapper told the fused optimizers' states, the state of a swapped block is on the host between steps."
    m, ref = copy.deepcopy(tiny), copy.deepcopy(tiny)
    build = lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    opt, _ = FusedBackward(m.parameters(), build), FusedBackward(ref.parameters(), build)
    swap = BlockSwapper(m, 4, "cpu", [o.state for o in opt.opts])
    moved = []
    for b in swap.blocks.values():   # spy on the state moves
        orig = b._move_state
        b._move_state = lambda d, orig=orig: (moved.append(torch.device(d).type), orig(d))
    for s in range(2):
        m(**inputs(m, s)).square().mean().backward(); ref(**inputs(ref, s)).square().mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))
    assert len(moved) == 2 * 2 * 4   # in for its backward and out after it, per block, per step
    assert all(st for o in opt.opts for st in o.state.values())

def test_schedule_forward_then_backward_in_reverse(tiny):
    m = copy.deepcopy(tiny)
    swap = BlockSwapper(m, 3, "cpu")
    a, b, c = swap.index
    m(**inputs(m, 0)).square().mean().backward()
    assert swap.schedule == [("forward", a), ("fetch", b), ("drop", a), ("forward", b), ("fetch", c), ("drop", b),
                             ("forward", c), ("drop", c), ("fetch", c), ("backward", c), ("fetch", b), ("release", c),
                             ("backward", b), ("fetch", a), ("release", b), ("backward", a), ("release", a)]
    swap.schedule.clear()
    with torch.no_grad(): m(**inputs(m, 0))   # sampling: in and out, nothing for backward
    assert [e for e, _ in swap.schedule] == ["forward", "fetch", "drop", "forward", "fetch", "drop", "forward", "drop"]

def test_blocks_chosen_largest_first(tiny):
    with torch.device("meta"): big = StageC.from_preset("3.6B")
    blocks = stage_blocks(big)
    sizes = [sum(p.numel() for p in blocks[i].parameters()) for i in swapped_blocks(big, 70)]
    assert min(sizes) > 20e6 and len(swapped_blocks(big, 70)) == 70   # ResBlocks, then AttnBlocks; no TimestepBlock
    with pytest.raises(ConfigError, match="expected 0 to 18"): swapped_blocks(tiny, 19)

def test_activation_offload_is_exact_and_leaves_no_hook(tiny):
    m, ref = copy.deepcopy(tiny), copy.deepcopy(tiny)
    m.gradient_checkpointing = ref.gradient_checkpointing = True
    off = ActivationOffload(m)
    assert torch.equal(m(**inputs(m, 1)).square().mean(), ref(**inputs(ref, 1)).square().mean())
    with pytest.raises(Exception): m(**{**inputs(m, 1), "x": torch.zeros(1)})
    assert off.context is None

@pytest.mark.parametrize("overrides,message", [
    (dict(activation_offload=True), "expected gradient_checkpointing: true"),
    (dict(blocks_to_swap=2, module_filters=[".attn"], rank=4), "trains no generator weights"),
    (dict(blocks_to_swap=2, compile=True), "set compile: false"),
    (dict(blocks_to_swap=2, model_version="700M"), "is Stage B"),
    (dict(blocks_to_swap=-1), "blocks_to_swap"),
])
def test_refusals_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        config_from_dict({"model_version": "tiny", **overrides}, training=False)
    assert "\n" not in str(e.value)

def test_refused_on_several_processes(tiny):
    class Acc: num_processes, distributed_type = 2, type("T", (), {"value": "FSDP"})()
    cfg = config_from_dict(dict(model_version="tiny", blocks_to_swap=2), training=False)
    with pytest.raises(ConfigError, match="FSDP shards the weights block swap moves"):
        prepare_swapped(Acc(), cfg, copy.deepcopy(tiny), None)
    from cascade_nb.memory import plan_memory, official_config
    with pytest.raises(ConfigError, match="block swap trains on one"):
        plan_memory(official_config(blocks_to_swap=40, batch_size=2), 2)

def test_trainer_swapped_run_equals_unswapped(tmp_path):
    "Through `train()` (demo config, EMA, a sample grid): 4 blocks swapped + activation offload, the same weights."
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    def run(name, *ov):
        cfg = load_config(ROOT / "configs" / "demo.yaml", [
            f"webdataset_path={ROOT / 'data_samples' / 'emoji'}", "num_workers=0", "image_size=32", "batch_size=4",
            "updates=2", "save_every=2", "warmup_updates=1", "tracker=none", "sample_steps=2", "lr=1e-3",
            "gradient_checkpointing=true", f"experiment_id={name}", f"checkpoint_path={tmp_path}/ckpt",
            f"output_path={tmp_path}/out", *ov])
        return {k: v.detach().clone() for k, v in train(cfg)["net"].state_dict().items()}
    base, swapped = run("base"), run("swap", "blocks_to_swap=4", "activation_offload=true")
    assert all(torch.equal(base[k], swapped[k]) for k in base)

def test_planner_fits_8_gb_with_block_swap():
    from cascade_nb.memory import suggest, official_config, plan_memory
    steps = suggest(official_config(), 8)
    last = steps[-1]
    assert last.plan.peak_gb <= 8 and last.label.startswith("block swap"), [s.label for s in steps]
    n = last.overrides["blocks_to_swap"]
    assert plan_memory(official_config(**{**last.overrides, "blocks_to_swap": n - 1})).peak_gb > 8   # the fewest
    assert last.plan.host and sum(last.plan.host.values()) > 2e9

def test_cli_official_yaml_budget_8(tmp_path):
    "`python -m cascade_nb.memory finetune_c_3b.yaml batch_size=1 --budget 8`: the official file, one image per GPU."
    from official_configs import OFFICIAL_CONFIGS
    (tmp_path / "finetune_c_3b.yaml").write_text(OFFICIAL_CONFIGS["finetune_c_3b.yaml"])
    res = run_cli("-m", "cascade_nb.memory", tmp_path / "finetune_c_3b.yaml", "batch_size=1", "--budget", "8",
                  env={"OMP_NUM_THREADS": "1"})
    assert "fits 8 GB:" in res.stdout and "blocks_to_swap=" in res.stdout, res.stdout
    assert "with the changes above" in res.stdout.strip().splitlines()[-1]
