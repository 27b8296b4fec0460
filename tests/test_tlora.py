"""T-LoRA (issue 50, nbs/60_adapters): the rank schedule against the paper's formula, ΔW = 0 at the Ortho-LoRA init and
the masked product in a forward at a given logSNR, the noise level reaching the adapters in the training loss and in
every sampler step, the LoRA demo trained with it (a kill and resume ends bit for bit where the killed run was), on 2
DDP processes, sampled live, and exported where a consumer cannot express a noise-dependent rank (`check` says so)."""
import json
import pytest
import torch
from safetensors import safe_open
from conftest import ROOT, free_port, run_cli
from test_lora_train import DRIVER, info
from test_train import resumes_to_the_killed_state
from test_user_adapter import demo_args

TL = ["adapter=tlora", "adapter_args={tlora_min_rank: 2}"]

@pytest.mark.parametrize("rank, min_rank, power", [(4, 1, 1.0), (4, 2, 1.0), (64, 1, 1.0), (64, 4, 2.0), (8, 1, 0.5)])
def test_rank_follows_the_papers_formula(rank, min_rank, power):
    "r(t) = floor(((T - t)/T)^a (r_max - r_min)) + r_min at each integer t of T = 1000, through the cosine schedule."
    from cascade_nb.adapters import tlora_rank
    from cascade_nb.gdf.schedules import CosineSchedule
    T, t = 1000, torch.arange(10, 991)
    paper = torch.floor(((T - t) / T).double() ** power * (rank - min_rank)).long() + min_rank
    got = tlora_rank(CosineSchedule()(t.double() / T), rank, min_rank, power)
    assert torch.equal(got, paper), (got - paper).abs().max()

def test_ortho_init_is_zero_and_a_forward_is_the_masked_product():
    from torch import nn
    from cascade_nb.adapters import apply_lora, lora_layers, tlora_rank
    from cascade_nb.gdf.noise_conditions import noise_level
    from cascade_nb.gdf.schedules import CosineSchedule
    torch.manual_seed(0)
    lin, x = nn.Linear(16, 24), torch.randn(5, 16)
    W = lin.weight.detach().clone()
    apply_lora(lin, targets=["weight"], adapter="tlora", rank=4, alpha=2.0)
    a = lora_layers(lin)["weight"]
    assert torch.equal(lin.weight.detach(), W)                       # the frozen copy cancels the SVD product
    U0, D0 = a.tlora_up0.detach().clone(), a.tlora_down0.detach().clone()
    assert torch.allclose(D0 @ D0.T, torch.diag(torch.diag(D0 @ D0.T)), atol=1e-5)   # orthogonal components
    with torch.no_grad(): a.tlora_up.add_(0.05 * torch.randn(24, 4)); a.tlora_down.add_(0.05 * torch.randn(4, 16))
    U, D = a.tlora_up.detach(), a.tlora_down.detach()
    for u in (0.05, 0.3, 0.6, 0.97):
        lam = CosineSchedule()(torch.full((5,), u))
        k = int(tlora_rank(lam[:1], 4))
        with torch.no_grad(), noise_level(lam): y = lin(x)
        want = x @ (W + (U[:, :k] @ D[:k] - U0[:, :k] @ D0[:k]) * 0.5).T + lin.bias.detach()
        assert torch.allclose(y, want, atol=1e-6), (u, k)
    # no noise level (a merge): all components
    assert torch.allclose(lin.weight.detach(), W + (U @ D - U0 @ D0) * 0.5, atol=1e-6)
    assert [n for n, p in a.named_parameters() if p.requires_grad] == ["tlora_down", "tlora_up"]

def test_the_noise_level_reaches_the_network_in_training_and_every_sampler_step():
    from torch import nn
    from cascade_nb.gdf.noise_conditions import current_noise_level
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.config import load_config
    from cascade_nb.modes import diffusion_loss
    seen = []
    class Probe(nn.Module):
        def forward(self, x, r, **conds):
            seen.append(current_noise_level()); return x * 0 + r.view(-1, 1, 1, 1)
    gdf = gdf_from_config(load_config(ROOT / "configs" / "lora_demo.yaml", ["webdataset_path=data_samples/emoji"]).gdf)
    _, _, d = diffusion_loss(Probe(), gdf, torch.zeros(3, 3, 4, 4), {}, rng=torch.Generator().manual_seed(0))
    assert torch.equal(seen[0], d.logsnr) and current_noise_level() is None
    seen.clear()
    steps = list(gdf.sample(Probe(), {}, (2, 3, 4, 4), unconditional_inputs={}, timesteps=4, cfg=2.0))
    want = gdf.schedule(torch.linspace(1, 0, 5)).float()
    assert len(steps) == len(seen) == 4 and current_noise_level() is None
    for i, lam in enumerate(seen): assert torch.allclose(lam, want[i].expand(4))   # cond and uncond halves

def test_options_are_checked_at_load():
    from cascade_nb.config import load_config, ConfigError
    base = ["webdataset_path=data_samples/emoji", "adapter=tlora"]
    demo = ROOT / "configs" / "lora_demo.yaml"
    with pytest.raises(ConfigError) as e: load_config(demo, [*base, "adapter_args={tlora_min_rank: 0}"])
    assert "'tlora_min_rank': 0 is out of range" in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e: load_config(demo, [*base, "adapter_args={tlora_ortogonal: true}"])
    assert "did you mean 'tlora_ortho'?" in str(e.value), str(e.value)

def test_demo_trains_resumes_samples_live_and_exports_at_full_rank(tmp_path):
    from cascade_nb.adapters import lora_layers
    from cascade_nb.sample import load_run
    run = tmp_path / "ckpt" / "t"
    resumes_to_the_killed_state(run, demo_args(tmp_path, "t", "updates=4", "save_every=2", *TL))
    assert info(tmp_path, "t")["update"] == 4
    with safe_open(str(run / "lora.safetensors"), "pt") as f:
        meta, sd = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["cascade_nb.adapter_type"] == "tlora"
    options = {"tlora_min_rank": 2, "tlora_alpha": 1.0, "tlora_ortho": True}
    assert json.loads(meta["cascade_nb.adapter_options"]) == options
    p = "down_blocks.0.2.attention.attn.out_proj.weight"
    assert not torch.equal(sd[f"{p}.tlora_up"], sd[f"{p}.tlora_up0"])           # trained away from its frozen copy
    mode, _, _ = load_run(run)
    assert len(lora_layers(mode.net)) == 12                                     # sampled with the adapters attached
    from cascade_nb.lora import run_check, run_export
    out, model = tmp_path / "k.safetensors", tmp_path / "pretrained.safetensors"
    _, warns, _ = run_export(run, "kohya", out)
    assert any("12 tlora layers" in w and "written at full rank" in w for w in warns), warns
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["cascade_nb.noise_level_dropped"] == "full rank"
        assert f.get_tensor("lora_unet_down_blocks_0_2_attention_attn_out_proj.lora_down.weight").shape[0] == 8  # 2r
    rd, _ = run_check(out, "comfyui", model_arg=model)
    assert any("holds their full-rank form" in w for w in rd.warnings), rd.warnings
    # the command line, on the run's own file
    res = run_cli("-m", "cascade_nb.lora", "check", run / "lora.safetensors", "--for", "kohya", "--model", model,
                  check=False)
    assert "tlora adapters follow the noise level, which kohya cannot express" in res.stdout, res.stdout[-3000:]

def test_two_process_ddp(tmp_path):
    "The LoRA demo with T-LoRA on 2 gloo DDP processes: each process masks by its own batch; weights stay in sync."
    two = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"
    res = run_cli("-m", "accelerate.commands.launch", "--config_file", two,
                  "--main_process_port", str(free_port()), DRIVER, "--check-ddp-sync",
                  *demo_args(tmp_path, "ddp", "updates=2", "save_every=2", "batch_size=8", *TL),
                  env={"OMP_NUM_THREADS": "1"})
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    i = info(tmp_path, "ddp")
    assert i["num_processes"] == 2 and i["update"] == 2 and i["config"]["adapter"] == "tlora"

def test_gradient_checkpointing_recomputes_at_the_forwards_noise_level():
    "Stage C's checkpointed blocks rerun in backward, outside the loss's context: they must see its logSNR again."
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.gdf.noise_conditions import noise_level
    from cascade_nb.models.stage_c import StageC
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = StageC.from_preset("tiny")
        with torch.no_grad(): m.clf[1].weight.normal_(std=0.1)
        apply_lora(m, [".attn"], rank=4, adapter="tlora")
        for l in lora_layers(m).values(): torch.nn.init.normal_(l.tlora_up, std=0.1)
        m.gradient_checkpointing = ckpt
        x, r = torch.randn(2, 16, 6, 6), torch.full((2,), 0.8)
        conds = dict(clip_text=torch.randn(2, 77, 64), clip_text_pooled=torch.randn(2, 1, 64),
                     clip_img=torch.randn(2, 1, 64))
        with noise_level(torch.full((2,), -3.0)): loss = m(x, r, **conds).square().mean()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6), (grads[0] - grads[1]).abs().max()

def test_memory_planner_counts_the_frozen_copy_as_weights():
    "On the 3.6B: T-LoRA trains as many numbers as LoRA (same gradients, Adam state) plus its frozen copy, as weights."
    from cascade_nb.config import load_config
    from cascade_nb.memory import plan_memory
    rows = {}
    for a in ("lora", "tlora"):
        cfg = load_config(ROOT / "configs" / "lora_demo.yaml", ["webdataset_path=data_samples/emoji", f"adapter={a}",
                          "model_version=3.6B", "model_overrides={}", "latent_space=effnet"])
        rows[a] = plan_memory(cfg).rows
    assert rows["tlora"]["gradients"] == rows["lora"]["gradients"]
    assert rows["tlora"]["optimizer state (adamw)"] == rows["lora"]["optimizer state (adamw)"]
    assert rows["tlora"]["frozen adapter copies"] == rows["lora"]["gradients"] - 1280 * 4   # minus the token row
    assert "frozen adapter copies" not in rows["lora"]
