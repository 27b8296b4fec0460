"""The memory planner against FSDP2 as it really runs (accelerate 1.15, torch.distributed.fsdp.fully_shard) on 2 CPU
processes (gloo) through the trainer: bytes and dtypes after `prepare` and during the steps vs `plan_memory`'s rows.
Also: the trainer under the shipped configs/accelerate/fsdp.yaml settings (the driver reads them), and the launch
environment of multi_node.yaml (HSDP)."""
import json, re
import pytest
from conftest import ROOT
from test_train import _launch_2proc, demo_args, info

def reports(stdout):
    return sorted((json.loads(m) for m in re.findall(r"memory-report (\{.*?\})", stdout)), key=lambda r: r["rank"])

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fsdp_bytes_after_prepare_match_the_plan(tmp_path, dtype):
    from cascade_nb.config import load_config
    from cascade_nb.memory import plan_memory
    run = ["updates=2", "save_every=2", "batch_size=8", "grad_accum_steps=2", "mixed_precision=bf16", f"dtype={dtype}"]
    args = demo_args(tmp_path, "mem", *run)
    res = _launch_2proc("--fsdp-cpu", "--report-memory", *args)
    got = reports(res.stdout)
    assert len(got) == 2, res.stdout[-3000:] + res.stderr[-3000:]
    plan = plan_memory(load_config(args[0], args[1:]), world_size=2, fsdp=True).rows
    # accelerate upcasts trainable parameters to fp32 under bf16 mixed precision, whatever `dtype` says
    assert all(r["trainable_dtypes"] == ["torch.float32"] for r in got), got
    total = lambda k: sum(r[k] for r in got)
    assert total("weights") == pytest.approx(2 * plan["generator weights"], rel=0.01)
    assert total("optimizer") == pytest.approx(2 * plan["optimizer state (adamw)"], rel=0.01)
    # grad_accum_steps=2: between micro-steps every process holds the full gradient (bf16), not its shard
    assert all(r["gradients"] == pytest.approx(plan["gradients"], rel=0.01) for r in got), (got, plan["gradients"])
    # the EMA: each process holds its shards only (in the weights' dtype before the upcast), as the plan counts it
    assert total("ema") == pytest.approx(2 * plan["EMA"], rel=0.01)
    assert all(r["ema"] == pytest.approx(plan["EMA"], rel=0.05) for r in got), (got, plan["EMA"])
    assert info(tmp_path, "mem")["update"] == 2

def test_controlnet_under_the_shipped_fsdp_config(tmp_path):
    "ControlNet (EfficientNet BatchNorm buffers) with configs/accelerate/fsdp.yaml's FSDP settings trains and saves."
    res = _launch_2proc("--fsdp-cpu", *demo_args(tmp_path, "cn", "updates=2", "save_every=2", "batch_size=8", "mode=controlnet",
                                                   "controlnet_filter=CannyFilter", "controlnet_blocks=[0, 1]",
                                                   "ema_start_iters=null"))
    assert info(tmp_path, "cn")["update"] == 2, res.stdout[-2000:]
    assert (tmp_path / "ckpt" / "cn" / "controlnet.safetensors").exists()

def launch_env(name, *extra):
    from accelerate.commands.launch import launch_command_parser, _validate_launch_command
    from accelerate.utils.launch import prepare_multi_gpu_env
    a = launch_command_parser().parse_args(["--config_file", str(ROOT / "configs" / "accelerate" / name),
                                            "--main_process_ip", "127.0.0.1", *extra, "x.py"])
    return prepare_multi_gpu_env(_validate_launch_command(a)[0])

def test_shipped_fsdp_configs_do_not_use_ram_efficient_loading():
    for name in ("fsdp.yaml", "multi_node.yaml"):
        assert launch_env(name)["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false", name

def test_multi_node_config_is_hsdp(monkeypatch):
    "multi_node.yaml: shard within a machine (8 GPUs), replicate across machines; the SLURM script sets both sizes."
    from accelerate.parallelism_config import ParallelismConfig
    env = launch_env("multi_node.yaml")
    for k, v in env.items():
        if k.startswith("PARALLELISM_CONFIG_"): monkeypatch.setenv(k, v)
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.total_size) == (2, 8, 16)
    assert pc.dp_replicate_enabled and pc.dp_shard_enabled and pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    slurm = launch_env("multi_node.yaml", "--num_machines", "4", "--num_processes", "32",
                       "--parallelism_config_dp_replicate_size", "4", "--parallelism_config_dp_shard_size", "8")
    assert (slurm["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], slurm["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("4", "8")
    sbatch = (ROOT / "configs" / "slurm" / "train_multinode.sbatch").read_text()
    assert 'HSDP="--parallelism_config_dp_replicate_size $SLURM_NNODES --parallelism_config_dp_shard_size $GPUS_PER_NODE"' in sbatch
    assert "LAUNCH_CONFIG:-configs/accelerate/multi_node.yaml" in sbatch
