"""Run the trainer in a subprocess with optional fault injection, for tests/test_train*.py.

    python tests/train_driver.py [--kill-in-commit N] [--nan-from N] [--check-ddp-sync] CONFIG [key=value ...]

--kill-in-commit N   SIGKILL the process inside the checkpoint commit of update N (state written, info.json not yet)
--term-at N          send SIGTERM to the process itself after update N (a scheduler's stop signal)
--kill-in-export     SIGKILL the process when a save after a stop signal starts exporting the released weights
--nan-from N         make every loss from micro-step N on NaN (the non-finite guard must stop the run)
--nan-once N         make the loss of micro-step N NaN once (the update must be skipped, the run continues)
--check-ddp-sync     after training, assert that every process holds identical generator weights
--fsdp-cpu           run accelerate's FSDP2 path on CPU processes (gloo). accelerate only enables FSDP on GPUs, so
                     this flips its state to FSDP after it initialised: the trainer then runs the same prepare
                     (fully_shard per block), sharded save_state/load_state (torch.distributed.checkpoint) and
                     get_state_dict as on GPUs, with the FSDP settings of --fsdp-config (default: the shipped
                     configs/accelerate/fsdp.yaml). Test-only: it relies on accelerate internals.
--fsdp-config PATH   the accelerate launch config whose fsdp_config --fsdp-cpu applies
--report-shards      print the fraction of the generator's parameters each process holds locally
--report-memory      print this process's bytes of weights (by dtype), gradients (largest after any backward, FSDP2's
                     unsharded accumulation buffers included), optimizer state and EMA, as one JSON line
--ema-probe PATH     around every EMA update: count the collectives it makes (torch's CommDebugMode sees c10d and
                     DTensor collectives) and print them as one JSON line per update; outside that window, keep a
                     reference EMA computed from the gathered (full) model weights, written by rank 0 to PATH
"""
import argparse, os, signal, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import cascade_nb.train as T
import cascade_nb.modes as M
from cascade_nb.run_state import RunDir

p = argparse.ArgumentParser()
p.add_argument("--kill-in-commit", type=int)
p.add_argument("--term-at", type=int)
p.add_argument("--kill-in-export", action="store_true")
p.add_argument("--nan-from", type=int)
p.add_argument("--nan-once", type=int)
p.add_argument("--check-ddp-sync", action="store_true")
p.add_argument("--fsdp-cpu", action="store_true")
p.add_argument("--fsdp-config", default=str(Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "fsdp.yaml"))
p.add_argument("--report-shards", action="store_true")
p.add_argument("--report-memory", action="store_true")
p.add_argument("--ema-probe")
args, rest = p.parse_known_args()

if args.kill_in_commit is not None:
    _commit = RunDir.commit
    def commit(self, state_dir, info):
        if info["update"] == args.kill_in_commit: os.kill(os.getpid(), signal.SIGKILL)
        return _commit(self, state_dir, info)
    RunDir.commit = commit

TERM_SENT = False
if args.term_at is not None:   # a hook the loop calls after every update: SIGTERM once update N is done
    from cascade_nb.train_state import TRAINING_HOOKS
    class _Term:
        def __init__(self, cfg): pass
        @classmethod
        def enabled(cls, cfg): return True
        def after_update(self, run):
            global TERM_SENT
            if run.state.update == args.term_at: TERM_SENT = True; os.kill(os.getpid(), signal.SIGTERM)
    TRAINING_HOOKS["_term_at"] = _Term

if args.kill_in_export:
    _export = T.export_weights
    def export_weights(run):
        if TERM_SENT: os.kill(os.getpid(), signal.SIGKILL)   # the first export after the stop signal
        return _export(run)
    T.export_weights = export_weights

if args.nan_from is not None or args.nan_once is not None:
    _loss, calls = M.diffusion_loss, [0]   # what every mode's default `loss` calls
    def diffusion_loss(*a, **kw):
        loss, raw, d = _loss(*a, **kw)
        calls[0] += 1
        if (args.nan_from is not None and calls[0] >= args.nan_from) or calls[0] == args.nan_once:
            loss = loss * float("nan")
        return loss, raw, d
    M.diffusion_loss = diffusion_loss

def launch_env(config_file):
    "The environment `accelerate launch --config_file CONFIG` gives its workers (FSDP_* settings and the like)."
    from accelerate.commands.launch import launch_command_parser, _validate_launch_command
    from accelerate.utils.launch import prepare_multi_gpu_env
    a = launch_command_parser().parse_args(["--config_file", str(config_file), "--main_process_ip", "127.0.0.1", "x.py"])
    return prepare_multi_gpu_env(_validate_launch_command(a)[0])

if args.fsdp_cpu:
    import accelerate.accelerator as A
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    # the FSDP settings of the shipped launch config, as accelerate launch passes them on a GPU machine
    os.environ.update({k: v for k, v in launch_env(args.fsdp_config).items() if k.startswith("FSDP_")})
    _init = A.Accelerator.__init__
    def __init__(self, *a, **kw):
        kw["fsdp_plugin"] = FullyShardedDataParallelPlugin()   # reads the FSDP_* variables
        _init(self, *a, **kw)
        if self.state.distributed_type == DistributedType.MULTI_CPU:   # what accelerate does on GPUs
            from accelerate.state import PartialState
            PartialState().distributed_type = DistributedType.FSDP     # AcceleratorState re-syncs from it
            self.state.distributed_type = DistributedType.FSDP
            if self.state.mixed_precision != "no": kw["fsdp_plugin"].set_mixed_precision(self.state.mixed_precision)
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

if args.report_memory:
    import json
    from accelerate import Accelerator
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts if t is not None)
    def grad_bytes(model):
        "Gradients held now: the parameters' (sharded) .grad plus FSDP2's unsharded gradients of no_sync micro-steps."
        n = nbytes(p.grad for p in model.parameters())
        for m in model.modules():
            state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
            group = state._fsdp_param_group if state is not None else None
            for fp in (group.fsdp_params if group is not None else ()):
                n += nbytes([fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None, fp.unsharded_accumulated_grad])
        return n
    seen = {"gradients": 0}
    _prepare = Accelerator.prepare
    def prepare(self, *objs, **kw):   # weights right after wrapping (later, FSDP may hold a module unsharded)
        out = _prepare(self, *objs, **kw)
        model = self._models[0]
        seen["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
        seen["weights"] = nbytes(model.parameters())
        return out
    Accelerator.prepare = prepare
    _backward = Accelerator.backward
    def backward(self, loss, **kw):
        _backward(self, loss, **kw)
        seen["gradients"] = max(seen["gradients"], grad_bytes(self._models[0]))
    Accelerator.backward = backward
    runs, _Run = [], T.Run   # the trainer's Run record holds the EMA (nothing is registered with accelerate)
    T.Run = lambda *a, **kw: runs.append(r := _Run(*a, **kw)) or r
    _free1 = Accelerator.free_memory
    def free_memory(self, *objects):
        fused = runs[-1].fused if runs else None   # fused_backward: one optimizer per tensor, not prepared
        opts = fused.opts if fused is not None else [self._optimizers[0].optimizer]
        ema = runs[-1].ema if runs else None   # what this process holds of the EMA: its state dict's tensors
        report = dict(rank=self.process_index, **seen, optimizer=nbytes(v for opt in opts for st in opt.state.values()
                                                                   for k, v in st.items() if torch.is_tensor(v) and v.ndim > 0),
                      ema=nbytes(ema.state_dict().values()) if ema is not None else 0)
        print("memory-report " + json.dumps(report), flush=True)
        return _free1(self, *objects)
    Accelerator.free_memory = free_memory

if args.ema_probe:
    import json
    import cascade_nb.ema as E
    from torch.distributed.tensor.debug import CommDebugMode
    from safetensors.torch import save_file
    reference, probe_update = {}, [0]
    def probed(update_):
        "`update_(..., model, beta)` counted for collectives; then the reference EMA of the gathered weights, uncounted."
        def update(*a):
            model, beta = a[-2], a[-1]
            with CommDebugMode() as comms: update_(*a)
            probe_update[0] += 1
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            print("ema-comms " + json.dumps({"rank": rank, "call": probe_update[0], "comms": comms.get_total_counts()}), flush=True)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
                    reference[name] = full.clone() if beta == 0 else torch.lerp(reference[name], full, 1 - beta)
            if rank == 0: save_file({k: v.contiguous() for k, v in reference.items()}, args.ema_probe)
        return update
    if hasattr(E, "EMA"): E.EMA.update_ = probed(E.EMA.update_)      # the trainer's EMA object
    else: T.ema_update_ = probed(T.ema_update_)                      # before it: the function train() called

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
