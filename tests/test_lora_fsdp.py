"""LoRA, the LyCORIS adapter types and ControlNet nets under FSDP2 (`fully_shard` per block, frozen generator sharded
too) on 2 CPU processes (gloo), in one launch: a training step (LoRA's with a prior-prediction target) matches a
single-process step on both ranks' batches, and the released weights are gathered from the shards.
accelerate's FSDP plugin is GPU-only, so this drives torch FSDP2 directly, as a launch config would on GPUs."""
import textwrap
from conftest import ROOT, run_cli

SCRIPT = textwrap.dedent('''
    import gc, os, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from cascade_nb.models.stage_c import StageC
    from cascade_nb.models.blocks import ResBlock, AttnBlock, TimestepBlock
    from types import SimpleNamespace
    from cascade_nb.adapters import apply_lora, lora_layers
    from cascade_nb.lora_file import lora_state_dict
    from cascade_nb.prior_preservation import prior_retarget
    from cascade_nb.lora_training import LoraNet
    from cascade_nb.controlnet import ControlNet, ControlNetNet

    TYPES = {"dora": {}, "oft": {"oft_block_size": 16, "oft_rescale": True}, "loha": {}, "lokr": {}}

    def build(kind):
        torch.manual_seed(0)
        gen = StageC.from_preset("tiny")
        with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)
        if kind in TYPES:   # the LyCORIS types: every tensor moved off its zero-effect start
            apply_lora(gen, [".attn"], rank=4, adapter=kind, options=TYPES[kind])
            with torch.no_grad():
                for l in lora_layers(gen).values():
                    for t in l.tensors().values(): t.add_(torch.randn_like(t) * 0.02)
            return LoraNet(gen)
        if kind == "lora":
            apply_lora(gen, [".attn"], rank=4, init="peft")   # U = 0, set below
            with torch.no_grad():
                for l in lora_layers(gen).values(): l.lora_up.normal_(std=0.02)
            return LoraNet(gen)
        gen.requires_grad_(False)
        cn = ControlNet(1, 64, [0, 2, 4], "simple")
        with torch.no_grad():
            for p in cn.projections: p[2].weight.normal_(std=0.02)
        return ControlNetNet(gen, cn)

    def batch(rank, B=2):
        g = torch.Generator().manual_seed(10 + rank)
        return (torch.randn(B, 16, 8, 8, generator=g), torch.rand(B, generator=g),
                dict(clip_text=torch.randn(B, 77, 64, generator=g), clip_text_pooled=torch.randn(B, 1, 64, generator=g),
                     clip_img=torch.randn(B, 1, 64, generator=g), cnet_input=torch.rand(B, 1, 16, 16, generator=g)))

    def step(net, inputs, kind):
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
        loss = 0
        for x, r, c in inputs:
            target = torch.zeros_like(x)
            if kind != "controlnet":
                c = {k: v for k, v in c.items() if k != "cnet_input"}
                # prior preservation: sample 0 targets the frozen base's own prediction (a no-grad pass with the
                # adapters off through the sharded net, on every process)
                target = prior_retarget(net, c, torch.tensor([True, False]))(SimpleNamespace(noised=x, noise_cond=r,
                                                                                              target=target))
            loss = loss + (net(x, r, **c) - target).square().mean() / len(inputs)
        loss.backward(); opt.step()

    def released(net, kind):
        if kind != "controlnet": return lora_state_dict(net.generator)
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in net.controlnet.state_dict().items()}

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for kind in ("lora", *TYPES, "controlnet"):
        ref = build(kind)                                   # single process, both ranks' batches
        step(ref, [batch(i) for i in range(world)], kind)
        want = released(ref, kind)
        net = build(kind)
        for m in net.modules():
            if isinstance(m, (ResBlock, AttnBlock, TimestepBlock)): fully_shard(m, mesh=mesh)
        if kind == "controlnet": fully_shard(net.controlnet, mesh=mesh)
        fully_shard(net, mesh=mesh)
        assert any(hasattr(p, "full_tensor") for p in net.parameters())
        step(net, [batch(rank)], kind)
        got = released(net, kind)
        assert got.keys() == want.keys()
        err = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
        assert err < 1e-5, (kind, err)
        print(f"rank {rank}: {kind} FSDP2 step matches single process (max err {err:.1e})", flush=True)
    del net, ref; gc.collect()   # sharded modules that outlive the process group make gloo abort at exit
    dist.destroy_process_group()
''')

def test_adapters_and_controlnet_under_fsdp2(tmp_path):
    script = tmp_path / "fsdp2.py"
    script.write_text(SCRIPT)
    res = run_cli("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
                  env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    for kind in ("lora", "dora", "oft", "loha", "lokr", "controlnet"):
        assert res.stdout.count(f"{kind} FSDP2 step matches single process") == 2, res.stdout[-3000:] + res.stderr[-3000:]

