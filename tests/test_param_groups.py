"""Parameter groups through the real trainer (nbs/40a_optimizers, parameter groups): a full fine-tune with per-block lr
multipliers; `fused_backward` stepping each tensor at its group's lr. A LoRA run's groups (adapters, tokens, the text
encoder's adapters at their own lr and weight decay, logged per group, exact across a kill and resume, a resume with
other groups refused in one line) are tested on the shared run of tests/test_lora_runs.py."""
import json
from pathlib import Path
import torch
from torch import nn
from conftest import run_cli
from test_train import demo_args


def metrics(out_dir) -> dict:
    "update -> the last training row logged for it (a resumed run logs the updates after its state again)."
    rows = [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["update"]: r for r in rows if "loss" in r}

def optimizer_groups_saved(run_dir) -> list[dict]:
    "The param groups of the optimizer in a run's committed state (accelerate's optimizer.bin), without the tensors."
    state = Path(run_dir) / json.loads((Path(run_dir) / "info.json").read_text())["state_dir"]
    return torch.load(state / "optimizer.bin", weights_only=True)["param_groups"]

def test_full_training_with_block_multipliers(tmp_path):
    """Per-block lr multipliers in a full fine-tune: the first matching pattern decides, 0 freezes; a pattern that
    decides no parameter is refused in one line."""
    mult = "lr_multipliers={down_blocks.0: 0.5, up_blocks.1: 0, down_blocks: 2}"
    res = run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "m", "updates=2", "save_every=2", "lr_schedule=constant",
                                                       "warmup_updates=1", "ema_start_iters=null", mult))
    assert "parameter groups: generator" in res.stdout and "(x0.5 on" in res.stdout and "x2 on" in res.stdout
    saved = optimizer_groups_saved(tmp_path / "ckpt" / "m")
    by_m = {g["lr_multiplier"]: g for g in saved}
    assert sorted(by_m) == [0.5, 1.0, 2.0] and all(g["group"] == "generator" for g in saved)
    assert [by_m[k]["lr"] for k in (0.5, 1.0, 2.0)] == [5e-4, 1e-3, 2e-3]
    m = metrics(tmp_path / "out" / "m")
    assert m[2]["lr"] == 1e-3 and "lr/generator" not in m[2]   # one group: the `lr` key alone
    from cascade_nb.config import load_config
    from cascade_nb.modes import build_generator
    names = [n for n, _ in build_generator(load_config(*demo_args(tmp_path, "m")[:1], demo_args(tmp_path, "m")[1:]))
             .named_parameters()]
    n_up1, n_all = sum("up_blocks.1" in n for n in names), len(names)
    assert n_up1 and sum(len(g["params"]) for g in saved) == n_all - n_up1   # up_blocks.1: frozen, in no group
    res = run_cli("-m", "cascade_nb.train", *demo_args(tmp_path, "typo", "updates=2", "lr_multipliers={dwn_blocks: 2}"),
                  check=False)
    assert res.returncode != 0 and "key 'lr_multipliers.dwn_blocks': 'dwn_blocks' decides the lr of no trained " \
        "parameter" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]

def test_fused_backward_steps_each_tensor_at_its_group_lr():
    "One optimizer per tensor (`fused_backward`) gives the plain optimizer's weights, bit for bit, group settings kept."
    from types import SimpleNamespace
    from cascade_nb.optimizers import FusedBackward, OPTIMIZERS, named_groups, optimizer_groups
    t = SimpleNamespace(lr=1e-2, weight_decay=0.01, adam_betas=(0.9, 0.999), adam_eps=1e-8, optimizer_args={},
                        param_groups={"tokens": {"lr": 5e-2, "weight_decay": 0.0}}, lr_multipliers={"body.1": 0.25})
    def build():
        torch.manual_seed(0)
        net = nn.ModuleDict({"body": nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3)), "emb": nn.Embedding(4, 6)})
        groups = optimizer_groups(named_groups(net, lambda n: "tokens" if n.startswith("emb") else "generator"), t)
        return net, groups
    step = lambda ps: OPTIMIZERS.choose("adamw").build(ps, t, t.lr)
    (a, groups_a), (b, groups_b) = build(), build()
    plain, fused = step(groups_a), FusedBackward(groups_b, step)
    assert [g["lr"] for g in fused.param_groups] == [1e-2, 1e-2, 2.5e-3, 2.5e-3, 5e-2]
    before = {k: v.clone() for k, v in b.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, ids = torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)
        for net in (a, b): net["body"](x + net["emb"](ids)).square().mean().backward()
        plain.step(); plain.zero_grad(); fused.grad_norm()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(before["body.1.weight"], b.state_dict()["body.1.weight"])
