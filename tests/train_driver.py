"""Run the trainer in a subprocess with optional fault injection, for tests/test_train*.py.

    python tests/train_driver.py [--kill-in-commit N] [--nan-from N] [--check-ddp-sync] CONFIG [key=value ...]

--kill-in-commit N   SIGKILL the process inside the checkpoint commit of update N (state written, info.json not yet)
--nan-from N         make every loss from micro-step N on NaN (the non-finite guard must stop the run)
--nan-once N         make the loss of micro-step N NaN once (the update must be skipped, the run continues)
--check-ddp-sync     after training, assert that every process holds identical generator weights
--fsdp-cpu           run accelerate's FSDP2 path on CPU processes (gloo). accelerate only enables FSDP on GPUs, so
                     this flips its state to FSDP after it initialised: the trainer then runs the same prepare
                     (fully_shard per block), sharded save_state/load_state (torch.distributed.checkpoint) and
                     get_state_dict as on GPUs. Test-only: it relies on accelerate internals.
--report-shards      print the fraction of the generator's parameters each process holds locally
"""
import argparse, os, signal, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import cascade_nb.train as T
import cascade_nb.modes as M
from cascade_nb.training import RunDir

p = argparse.ArgumentParser()
p.add_argument("--kill-in-commit", type=int)
p.add_argument("--nan-from", type=int)
p.add_argument("--nan-once", type=int)
p.add_argument("--check-ddp-sync", action="store_true")
p.add_argument("--fsdp-cpu", action="store_true")
p.add_argument("--report-shards", action="store_true")
args, rest = p.parse_known_args()

if args.kill_in_commit is not None:
    _commit = RunDir.commit
    def commit(self, state_dir, info):
        if info["update"] == args.kill_in_commit: os.kill(os.getpid(), signal.SIGKILL)
        return _commit(self, state_dir, info)
    RunDir.commit = commit

if args.nan_from is not None or args.nan_once is not None:
    _loss, calls = M.diffusion_loss, [0]   # what every mode's default `loss` calls
    def diffusion_loss(*a, **kw):
        loss, raw, d = _loss(*a, **kw)
        calls[0] += 1
        if (args.nan_from is not None and calls[0] >= args.nan_from) or calls[0] == args.nan_once:
            loss = loss * float("nan")
        return loss, raw, d
    M.diffusion_loss = diffusion_loss

if args.fsdp_cpu:
    import accelerate.accelerator as A
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    _init = A.Accelerator.__init__
    def __init__(self, *a, **kw):
        kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type="SHARDED_STATE_DICT",
            transformer_cls_names_to_wrap=["ResBlock", "AttnBlock", "TimestepBlock"],
            reshard_after_forward=True, cpu_ram_efficient_loading=False)
        _init(self, *a, **kw)
        if self.state.distributed_type == DistributedType.MULTI_CPU:   # what accelerate does on GPUs
            from accelerate.state import PartialState
            PartialState().distributed_type = DistributedType.FSDP     # AcceleratorState re-syncs from it
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = kw["fsdp_plugin"]
    A.Accelerator.__init__ = __init__

if args.report_shards:
    from accelerate import Accelerator
    _free0 = Accelerator.free_memory   # the trainer's last step before the process group goes
    def free_memory(self, *objects):
        model = self._models[0]
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        print(f"\nrank {self.process_index}: holds {local / total:.3f} of {total} parameters", flush=True)
        return _free0(self, *objects)
    Accelerator.free_memory = free_memory

if args.check_ddp_sync:   # compare weights across processes just before the trainer releases the DDP wrapper
    from accelerate import Accelerator
    import torch.distributed as dist
    _free = Accelerator.free_memory
    def free_memory(self, *objects):
        model = self.unwrap_model(self._models[0])
        flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "DDP processes hold different weights"
        print(f"rank {dist.get_rank()}: weights identical on {dist.get_world_size()} processes", flush=True)
        return _free(self, *objects)
    Accelerator.free_memory = free_memory

T.main(rest)
