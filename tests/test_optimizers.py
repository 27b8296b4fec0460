"""The optimizers beyond AdamW (adamw8bit, adafactor, came, lion, prodigy, schedulefree_adamw, muon), the LR schedules
and the fused backward pass through the trainer's paths:
each optimizer's state survives a save and load exactly; a run killed in its checkpoint commit resumes and commits
the very state the killed process had written (weights, optimizer state, EMA, data position, random streams), and the
planner's state bytes are the trainer's (Muon: its momentum buffers on the matrices, AdamW's two moments on the
rest); Prodigy's step-size estimate and Muon's orthogonalised steps are the same on two DDP processes; FSDP2 refuses
the optimizers that cannot step its shards, before anything is built; the schedules' options are checked;
schedule-free AdamW's evaluation view gives x and leaves the trained y bit for bit, and its released weights are x."""
import copy, io, json, pytest, torch
from torch import nn
from types import SimpleNamespace
from conftest import run_cli
from test_train import DRIVER, demo_args, info, weights, assert_identical, _launch_2proc, resumes_to_the_killed_state
from cascade_nb.config import ConfigError, load_config
from cascade_nb.optimizers import OPTIMIZERS
import cascade_nb.modes   # noqa: F401 -- configs load as every command loads them

NEW = ("adamw8bit", "adafactor", "came", "lion", "prodigy", "schedulefree_adamw", "muon")
ROOT = __import__("conftest").ROOT
DEMO = str(ROOT / "configs" / "demo.yaml")

def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))

def _steps(net, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        net(torch.randn(2, 3, 8, 8, generator=g)).square().mean().backward()
        opt.step(); opt.zero_grad(set_to_none=True)

@pytest.mark.parametrize("name", NEW)
def test_optimizer_state_round_trips_exactly(name):
    "Two steps, the state saved and loaded into a fresh optimizer on a copy, two more steps: bit-identical weights."
    t = SimpleNamespace(adam_betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=0.01, optimizer_args={})
    spec = OPTIMIZERS.choose(name)
    build = lambda net: spec.build(list(net.parameters()), t, 1.0 if name == "prodigy" else 1e-3, **spec.args(t))
    a = _net(); opt_a = build(a)
    _steps(a, opt_a, 2, 1)
    buf = io.BytesIO(); torch.save(opt_a.state_dict(), buf); buf.seek(0)
    b = copy.deepcopy(a); opt_b = build(b); opt_b.load_state_dict(torch.load(buf, weights_only=True))
    _steps(a, opt_a, 2, 2); _steps(b, opt_b, 2, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), _net().parameters()))   # it did train

@pytest.mark.parametrize("name, extra", [
    ("prodigy", ["lr=1.0", "lr_schedule=cosine", "warmup_shape=cosine"]),
    ("adamw8bit", ["lr_schedule=linear", "min_lr=1e-4"]),
    ("came", ["lr=4e-4", "lr_schedule=polynomial"]),
    ("lion", ["lr=1e-4", "weight_decay=0.1", "lr_schedule=cosine_with_restarts", "lr_cycles=2"]),
    # fused backward with bf16 weights and stochastic rounding: the per-tensor states and the roundings resume too
    ("adafactor", ["optimizer_args={beta1: 0.9}", "lr_schedule=rex", "fused_backward=true", "stochastic_rounding=true",
                   "model_overrides={c_in: 3, c_out: 3, patch_size: 2, dropout: [0.1, 0.1]}",
                   "dtype=bfloat16"]),
    # schedule-free: every EMA update, validation, sample grid and export goes through its evaluation view (x), the
    # state keeps y
    ("schedulefree_adamw", ["lr=3e-3", "lr_schedule=constant", "val_every=2", "val_batches=1",
                            f"val_webdataset_path={ROOT}/data_samples/emoji/shard-000005.tar"]),
    # Muon's momentum buffers and AdamW's moments in one state dict, each part at its groups' LR (lr_multipliers)
    ("muon", ["lr_schedule=cosine", "lr_multipliers={up_blocks: 0.5}"])])
def test_killed_in_its_commit_resumes_to_the_same_state(tmp_path, name, extra):
    """Killed while committing update 4 and resumed from update 2, each optimizer commits the very state (weights,
    optimizer state, EMA, data position, random streams) the killed process had written for update 4."""
    args = demo_args(tmp_path, "res", "updates=4", "save_every=2", f"optimizer={name}", *extra)
    flags = ["--report-memory"] if name in ("adafactor", "muon") else []
    resumed = resumes_to_the_killed_state(tmp_path / "ckpt" / "res", args, resume_flags=flags)
    if name in ("adafactor", "muon"): _assert_planned_state_bytes(resumed.stdout, args, name)
    if name == "muon": _assert_muon_split(tmp_path, "res")
    if name == "schedulefree_adamw": _assert_released_is_x(tmp_path, "res")

def _assert_planned_state_bytes(stdout, args, name):
    """The planner's 'optimizer state' row against the bytes the trainer's (factored) optimizer holds; fused backward
    with stochastic rounding keeps fp32 states (the steps run on fp32 copies of the bf16 weights)."""
    import re
    from cascade_nb.memory import plan_memory
    got = [json.loads(m) for m in re.findall(r"memory-report (\{.*?\})", stdout)]
    plan = plan_memory(load_config(args[0], args[1:])).rows
    assert len(got) == 1, got
    assert got[0]["optimizer"] == pytest.approx(plan[f"optimizer state ({name})"], rel=0.01), (got, plan)
    assert got[0]["gradients"] <= plan["gradients"], (got, plan)   # at most one tensor's gradient alive

def _assert_muon_split(tmp, name):
    """The committed state holds a Muon part whose state is one momentum buffer per 2-D weight and an AdamW part with
    two moments per bias, gain and convolution; together they cover every trained parameter once."""
    d = tmp / "ckpt" / name
    opt = torch.load(d / json.loads((d / "info.json").read_text())["state_dir"] / "optimizer.bin", weights_only=True)
    assert sorted(opt) == ["adamw", "muon"], sorted(opt)
    muon, adamw = opt["muon"]["state"].values(), opt["adamw"]["state"].values()
    assert muon and all(list(s) == ["momentum_buffer"] and s["momentum_buffer"].ndim == 2 for s in muon)
    assert adamw and all(s["exp_avg"].ndim in (1, 4) and "exp_avg_sq" in s for s in adamw)
    # both parts at the run's one LR, each with the lr_multipliers' two groups
    base = {round(g["lr"] / g["lr_multiplier"], 12) for v in opt.values() for g in v["param_groups"]}
    mults = {k: sorted(g["lr_multiplier"] for g in v["param_groups"]) for k, v in opt.items()}
    assert len(base) == 1 and mults == {"muon": [0.5, 1.0], "adamw": [0.5, 1.0]}, (base, mults)
    n = sum(len(g["params"]) for v in opt.values() for g in v["param_groups"])
    assert n == len(muon) + len(adamw) == len(weights(tmp, name)), (n, len(muon), len(adamw))

def _assert_released_is_x(tmp, name):
    """The released generator is x = y + (1 - 1/beta1)(z - y), exactly as `optimizer.eval()` forms it, from the
    committed state's y (its model file) and z (its optimizer): not the y the state resumes from."""
    from safetensors.torch import load_file
    from cascade_nb.modes import build_generator
    d = tmp / "ckpt" / name
    state = d / json.loads((d / "info.json").read_text())["state_dir"]
    y, opt = load_file(str(state / "model.safetensors")), torch.load(state / "optimizer.bin", weights_only=True)
    args = demo_args(tmp, name)
    # the optimizer's state is indexed in the order of the trained parameters
    names = [n for n, _ in build_generator(load_config(args[0], args[1:])).named_parameters()]
    assert len(names) == len(opt["state"]) and opt["param_groups"][0]["train_mode"]   # saved in train mode
    released, beta1 = weights(tmp, name), opt["param_groups"][0]["betas"][0]
    for i, n in enumerate(names):
        assert torch.equal(released[n], y[n].lerp(opt["state"][i]["z"], 1 - 1 / beta1)), n
    assert not any(torch.equal(released[n], y[n]) for n in names)
    # the best validated weights are x too: those of the last update when it validated best
    rows = map(json.loads, (tmp / "out" / name / "metrics.jsonl").read_text().splitlines())
    vals = [r for r in rows if "val_loss" in r]
    if min(vals, key=lambda r: r["val_loss"])["update"] == vals[-1]["update"]:
        assert_identical(weights(tmp, name, "generator_best"), released)

def test_schedule_free_view_gives_x_and_leaves_y_bit_identical():
    "Inside the view: the values `optimizer.eval()` gives; after it: y bit for bit, in train mode, whatever ran inside."
    t = SimpleNamespace(adam_betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=0.01, optimizer_args={})
    spec = OPTIMIZERS.choose("schedulefree_adamw")
    net = _net(); opt = spec.build(list(net.parameters()), t, 1e-2, **spec.args(t))
    _steps(net, opt, 5, 1)
    y = [p.detach().clone() for p in net.parameters()]
    twin_net, twin_opt = copy.deepcopy((net, opt)); twin_opt.eval()
    with spec.evaluated(opt, net):
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), twin_net.parameters()))
        with torch.no_grad():
            for p in net.parameters(): p.add_(1.0)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), y))
    assert not any(torch.equal(p, q) for p, q in zip(twin_net.parameters(), y))   # x is not y
    assert opt.param_groups[0]["train_mode"]
    _steps(net, opt, 1, 2)   # it still steps (a schedule-free optimizer refuses to in eval mode)

@pytest.mark.parametrize("extra", [["optimizer=prodigy", "lr=1.0"],
                                   ["optimizer=schedulefree_adamw", "lr_schedule=constant"],
                                   ["optimizer=adafactor", "optimizer_args={beta1: 0.9}"],
                                   ["optimizer=came", "lr=4e-4"],
                                   ["optimizer=adamw8bit"],
                                   ["optimizer=muon"]],
                         ids=["prodigy", "schedulefree_adamw", "adafactor", "came", "adamw8bit", "muon"])
def test_two_ddp_processes_agree(tmp_path, extra):
    """Every process computes the same step from the same all-reduced gradients (Prodigy: the same step size estimate;
    schedule-free: the same y and z; Adafactor and CAME: the same factored moments; 8-bit AdamW: the same
    quantised moments from bitsandbytes' CPU kernels; Muon: the same orthogonalised momentum of each whole matrix):
    identical trained weights on both. (Lion runs on two processes
    under FSDP2 below.)"""
    res = _launch_2proc("--check-ddp-sync", *demo_args(tmp_path, "ddp", "updates=2", "save_every=2", "batch_size=8",
                                                       *extra))
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]

def test_fsdp_refuses_the_optimizers_that_cannot_step_shards():
    from cascade_nb.memory import plan_memory
    from accelerate.utils import DistributedType
    from cascade_nb.train import check_optimizer
    for name in ("adafactor", "came", "prodigy", "muon"):
        cfg = load_config(DEMO, ["webdataset_path=x", f"optimizer={name}"])
        with pytest.raises(ConfigError, match=f"optimizer '{name}'|{OPTIMIZERS[name].__name__}"):
            plan_memory(cfg, world_size=2, fsdp=True)
    # Muon's reason, in one line, from the trainer's launch check (before anything is built)
    with pytest.raises(ConfigError, match="optimizer 'muon' does not work with FSDP: Muon orthogonalises each weight "
                                          "matrix whole"):
        check_optimizer("muon", DistributedType.FSDP)
    for name in ("lion", "schedulefree_adamw"):
        cfg = load_config(DEMO, ["webdataset_path=x", f"optimizer={name}", "lr_schedule=constant"])
        plan_memory(cfg, world_size=2, fsdp=True)

@pytest.mark.parametrize("override, message", [
    ("optimizer_args={d_coef: 2}", "'d_coef' is not an option of optimizer 'adamw'"),
    ("lr_cycles=0", "key 'lr_cycles': 0 is out of range; expected >= 1"),
    ("lr_power=-1", "key 'lr_power': -1.0 is out of range; expected > 0"),
    ("min_lr=1", "key 'min_lr': 1 is not below lr"),
    ("warmup_shape=cosin", "did you mean 'cosine'"),
    ("lr_scheduler_num_cycles=2", "did you mean 'lr_cycles'")])
def test_schedule_and_optimizer_options_are_checked(override, message):
    with pytest.raises(ConfigError) as e: load_config(DEMO, ["webdataset_path=x", override])
    assert message in str(e.value), str(e.value)

def test_optimizer_options_load_with_their_defaults():
    cfg = load_config(DEMO, ["webdataset_path=x", "optimizer=prodigy", "optimizer_args={d_coef: '0.5'}"])
    assert cfg.train.optimizer_args == {"d_coef": 0.5, "d0": 1e-6, "use_bias_correction": False,
                                        "safeguard_warmup": False}

def test_fused_backward_trains_the_same_weights_as_the_plain_step(tmp_path):
    "fp32, no clipping at work, no accumulation: stepping each weight inside backward changes nothing in the result."
    run = ["updates=3", "save_every=3", "grad_clip=1e9", "ema_start_iters=null"]
    run_cli(DRIVER, *demo_args(tmp_path, "plain", *run))
    run_cli(DRIVER, *demo_args(tmp_path, "fused", *run, "fused_backward=true"))
    assert_identical(weights(tmp_path, "fused"), weights(tmp_path, "plain"))

def test_fused_backward_resumes_8bit_adamw_from_one_copy_of_its_state():
    """bitsandbytes deep-copies a state it loads: the fused backward's load takes each tensor's saved state out of the
    loaded dict as its optimizer loads it (a 3.6B relaunch otherwise held 7.3 GB twice), and the steps after the load
    are the uninterrupted ones, bit for bit, on bf16 weights with stochastic rounding."""
    from cascade_nb.optimizers import FusedBackward
    t = SimpleNamespace(adam_betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=0.01, optimizer_args={})
    spec = OPTIMIZERS.choose("adamw8bit")
    build = lambda net: FusedBackward(net.parameters(), lambda g: spec.build(g, t, 1e-3, **spec.args(t)),
                                      stochastic_rounding=True, seed=3)
    def steps(net, opt, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            net(torch.randn(4, 128, generator=g).bfloat16()).float().square().mean().backward(); opt.grad_norm()
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8)).bfloat16(); opt_a = build(a)   # 8192: 8-bit
    steps(a, opt_a, 2, 1)
    buf = io.BytesIO(); torch.save(opt_a.state_dict(), buf); buf.seek(0)
    b = copy.deepcopy(a); opt_b = build(b)
    loaded = torch.load(buf, weights_only=True)
    quant = loaded["optimizers"][0]["state"][0]["__bnb_optimizer_quant_state__"]   # bitsandbytes' wrapped state
    assert quant["state1"].dtype == torch.uint8                                 # the 8-bit moments, as resumed
    opt_b.load_state_dict(loaded)
    assert loaded["optimizers"] == [None] * 4                                # taken out as loaded
    steps(a, opt_a, 2, 2); steps(b, opt_b, 2, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

@pytest.mark.parametrize("override, message", [
    (["stochastic_rounding=true", "dtype=bfloat16"], "'stochastic_rounding' needs fused_backward: true"),
    (["stochastic_rounding=true", "fused_backward=true"], "rounds into bf16 weights, but dtype is float32"),
    (["fused_backward=true", "grad_accum_steps=2"], "gradients cannot be accumulated over grad_accum_steps: 2"),
    (["optimizer=schedulefree_adamw", "stochastic_rounding=true", "fused_backward=true", "dtype=bfloat16"],
     "optimizer 'schedulefree_adamw' cannot take stochastic_rounding"),
    # demo.yaml decays the LR by a cosine
    (["optimizer=schedulefree_adamw"], "lr_schedule: cosine would decay it twice; set lr_schedule: constant")])
def test_fused_backward_combinations_that_cannot_work_are_refused(override, message):
    with pytest.raises(ConfigError) as e: load_config(DEMO, ["webdataset_path=x", *override])
    assert message in str(e.value), str(e.value)

def test_fused_backward_is_refused_on_several_processes(tmp_path):
    from accelerate.utils import DistributedType
    from cascade_nb.memory import plan_memory
    from cascade_nb.train import check_optimizer
    with pytest.raises(ConfigError, match="before DDP or FSDP has reduced"):
        check_optimizer("adamw", DistributedType.MULTI_CPU, fused=True)
    with pytest.raises(ConfigError, match="fused_backward trains on one process"):
        plan_memory(load_config(DEMO, ["webdataset_path=x", "fused_backward=true"]), world_size=2)

@pytest.mark.parametrize("name, lr", [("lion", "1e-4"), ("schedulefree_adamw", "3e-3")])
def test_elementwise_optimizers_step_fsdp2_shards(tmp_path, name, lr):
    """Lion's and schedule-free AdamW's updates (and the latter's x/y switch) are elementwise, so they step FSDP2's
    sharded parameters (accelerate's FSDP2 path on 2 CPU processes; the EMA, sample grid and export run too)."""
    _launch_2proc("--fsdp-cpu", *demo_args(tmp_path, name, "updates=3", "save_every=3", "batch_size=8",
                                           f"optimizer={name}", f"lr={lr}", "lr_schedule=constant"))
    assert info(tmp_path, name)["update"] == 3 and info(tmp_path, name)["num_processes"] == 2

@pytest.mark.parametrize("name, package", [("schedulefree_adamw", "schedulefree"), ("adamw8bit", "bitsandbytes")])
def test_a_missing_package_names_the_extra(monkeypatch, name, package):
    import importlib.util
    from accelerate.utils import DistributedType
    from cascade_nb.train import check_optimizer
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a))
    with pytest.raises(ConfigError, match=rf"needs {package} \(pip install 'cascade_nb\[optimizers\]'\)"):
        check_optimizer(name, DistributedType.NO)
