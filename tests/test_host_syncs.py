"""Issue 18 item 12: the training step never waits for the device between logging steps (no `.item()`, `bool(tensor)`,
boolean-mask indexing or stop-flag gather per update), batches leave the loader as uint8 and become float on the device,
and the DataLoader's worker count follows the CPUs this process may use.

No CUDA here, so the test watches the operators themselves: a `TorchDispatchMode` sees every aten op the trainer's
process runs, and the ones that make a CUDA host wait for the device (`_local_scalar_dense` behind `.item()`/`bool()`,
`nonzero` behind boolean masks, ...) are counted per update. The data pipeline runs in a DataLoader worker (another
process), so only the step itself is counted."""
import os, sys
from pathlib import Path
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import ROOT

SYNCING = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "is_nonzero", "equal", "unique",
           "_unique", "_unique2", "unique_consecutive", "unique_dim", "item"}

class SyncCounter(TorchDispatchMode):
    "Counts the aten ops that, on a CUDA tensor, block the host until the device has caught up."
    def __init__(self):
        super().__init__(); self.n, self.names = 0, []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        boolean_index = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
        if (name in SYNCING or boolean_index) and not _in_data_loader(): self.n += 1; self.names.append(name)
        return func(*args, **(kwargs or {}))

def _in_data_loader() -> bool:
    "Called from torch's DataLoader (its base seed at each epoch's start): host-side work by construction, never a device sync."
    f = sys._getframe()
    while f is not None:
        if f"torch{os.sep}utils{os.sep}data{os.sep}" in f.f_code.co_filename: return True
        f = f.f_back
    return False

def tiny_cfg(tmp, name, *extra):
    from cascade_nb.config import load_config
    return load_config(ROOT / "configs" / "demo.yaml", [
        "webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "image_size=16", "batch_size=4", "dataset_filters=null",
        "eval_every=null", "best_metric=null", "caption_dropout=0.5", "warmup_updates=2", "ema_start_iters=2", "ema_iters=1",
        f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *extra])

def test_no_host_sync_between_logging_steps(tmp_path):
    from cascade_nb.train import train
    from cascade_nb.train_state import TRAINING_HOOKS
    counter, per_update = SyncCounter(), []
    class Probe:
        def __init__(self, cfg): self.last = 0
        @classmethod
        def enabled(cls, cfg): return True
        def after_update(self, run):
            per_update.append((run.state.update, counter.names[self.last:])); self.last = len(counter.names)
    TRAINING_HOOKS["_sync_probe"] = Probe
    try:
        with counter: res = train(tiny_cfg(tmp_path, "syncs", "updates=8", "log_every=4", "save_every=100", "num_workers=1"))
    finally: TRAINING_HOOKS.pop("_sync_probe")
    assert res["update"] == 8
    # the updates that log (4, 8) may read values back; the others must not wait for the device at all
    quiet = {u: names for u, names in per_update if u % 4}
    assert len(quiet) == 6 and not any(quiet.values()), quiet

def test_batches_leave_the_loader_as_uint8_and_train_as_floats(tmp_path):
    "4× fewer bytes through the workers, the same loss: uint8 becomes float in [0, 1] on the device, as the float batches did."
    from cascade_nb.run_data import training_data
    from cascade_nb.modes import build_generator, build_text_encoder, build_image_encoder, build_latent_space, build_training_mode
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.data.buckets import images_to_float
    cfg = tiny_cfg(tmp_path, "u8", "num_workers=1")
    batch = next(training_data(cfg, 4)[0])
    assert batch["images"].dtype == torch.uint8 and batch["images"].shape == (4, 3, 16, 16)
    cpu = torch.device("cpu")
    tok, text = build_text_encoder(cfg, cpu)
    mode = build_training_mode(cfg, build_generator(cfg), tok, text, build_image_encoder(cfg, cpu, torch.float32),
                               build_latent_space(cfg, cpu, torch.float32), torch.float32)
    gdf = gdf_from_config(cfg.gdf)
    def loss(b):
        x0, conds = mode.encode(b, cpu, training=True, rng=torch.Generator().manual_seed(0))
        return mode.loss(mode.net, gdf, x0, conds, rng=torch.Generator().manual_seed(1))[0]
    as_float = {**batch, "images": images_to_float(list(batch["images"].numpy()))}   # what the workers used to ship
    assert as_float["images"].dtype == torch.float32
    assert torch.equal(loss(batch), loss(as_float))

def test_num_workers_follow_the_cpus_per_process(tmp_path, monkeypatch):
    from cascade_nb.data.pipeline import dataloader_from_config, default_num_workers
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = tiny_cfg(tmp_path, "w", "num_workers=null")
    assert cfg.data.num_workers is None   # the default
    assert dataloader_from_config(cfg.data, 4).num_workers == default_num_workers() == max(1, min(16, cpus - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))   # as many processes as CPUs on this machine: one worker each
    assert dataloader_from_config(cfg.data, 4).num_workers == 1
    assert dataloader_from_config(tiny_cfg(tmp_path, "w3", "num_workers=2").data, 4).num_workers == 2   # the override
    from cascade_nb.config import DataConfig
    assert DataConfig.__dataclass_fields__["num_workers"].default is None
