"""`resolution_schedule` end to end on CPU: a run trains at each side of the schedule in turn; a run pre-empted before,
at or after the switch and resumed equals the uninterrupted run bit for bit; 2-process DDP across the switch; the
memory plan is the one of the largest side."""
import json, os, signal
from pathlib import Path
import pytest
import cascade_nb.modes as M
from cascade_nb.config import load_config
from cascade_nb.train import train, TRAINING_HOOKS   # the hook registry the trainer reads
from test_train import demo_args, info, weights, assert_identical, _launch_2proc

SCHEDULE = ["image_size=16", "resolution_schedule=[[0, 8], [4, 16]]", "updates=8", "save_every=8"]

def config(tmp, name, *extra):
    args = demo_args(tmp, name, *SCHEDULE, *extra)
    return load_config(args[0], args[1:])

@pytest.fixture(scope="module")
def stop_at():
    """`stop_at(n)`: the next `train` gets a SIGTERM after update n (a pre-emption), saves that update and returns; it
    goes through a registered training hook, as any hook would. Signal handlers are restored afterwards."""
    when = {}
    class StopAt:
        @classmethod
        def enabled(cls, cfg): return "n" in when
        def __init__(self, cfg): self.n = when.pop("n")
        def after_update(self, run):
            if run.state.update == self.n: os.kill(os.getpid(), signal.SIGTERM)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    TRAINING_HOOKS["test_stop_at"] = StopAt
    yield lambda n: when.update(n=n)
    del TRAINING_HOOKS["test_stop_at"]
    for s, h in handlers.items(): signal.signal(s, h)

@pytest.fixture(scope="module")
def sides_trained():
    "The side of every batch the training loss sees, in order (validation and sampling do not go through it)."
    seen, loss = [], M.diffusion_loss
    def spy(generator, gdf, x0, *a, **kw):
        seen.append(tuple(x0.shape[-2:]))
        return loss(generator, gdf, x0, *a, **kw)
    M.diffusion_loss = spy
    yield seen
    M.diffusion_loss = loss

def metrics(tmp, name):
    return [json.loads(l) for l in (Path(tmp) / "out" / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]

@pytest.fixture(scope="module")
def reference(tmp_path_factory, sides_trained, stop_at):
    tmp = tmp_path_factory.mktemp("res")
    sides_trained.clear()
    train(config(tmp, "ref"))
    return tmp, list(sides_trained)

def test_training_crosses_the_switch(reference):
    tmp, sides = reference
    assert sides == [(8, 8)] * 4 + [(16, 16)] * 4                        # updates 0-3 at 8², 4-7 at 16²
    assert [(r["update"], r["image_size"]) for r in metrics(tmp, "ref")] == [(u, 8 if u <= 4 else 16) for u in range(1, 9)]
    i = info(tmp, "ref")
    assert (i["update"], i["batches_drawn"]) == (8, 8)                   # the data position counts batches, whatever their side

@pytest.mark.parametrize("stop", [2, 4, 6], ids=["before", "at", "after"])
def test_resume_on_either_side_of_the_switch_is_bit_identical(tmp_path, reference, stop_at, sides_trained, stop):
    ref, ref_sides = reference
    stop_at(stop)
    sides_trained.clear()
    assert train(config(tmp_path, "res"))["update"] == stop              # pre-empted: saved at `stop`, returned
    assert info(tmp_path, "res")["update"] == stop
    assert train(config(tmp_path, "res"))["update"] == 8                  # relaunched: resumes at `stop`
    assert sides_trained == ref_sides                                     # same sides at the same updates
    assert_identical(weights(tmp_path, "res"), weights(ref, "ref"))
    assert_identical(weights(tmp_path, "res", "generator_ema"), weights(ref, "ref", "generator_ema"))
    assert [r["loss"] for r in metrics(tmp_path, "res")] == [r["loss"] for r in metrics(ref, "ref")]

def _mode_args(tmp, mode):
    "A tiny run of `mode` whose first two updates are at the smaller side; (CLI args, latent sides expected per update)."
    switch = "resolution_schedule=[[0, 8], [2, 16]]"
    if mode == "controlnet":
        from test_controlnet_train import cnet_args, SIMPLE
        return cnet_args(tmp, mode, "controlnet_c_3b_canny.yaml", *SIMPLE, "image_size=16", switch), [8, 8, 16, 16]
    extra = {"lora": ["module_filters=['.attn']", "rank=2"],
             "stage_b": ["stage=b", "model_overrides={}", "stage_a_checkpoint_path=tiny", "effnet_checkpoint_path=tiny", "batch_size=2",
                         "image_size=128", "resolution_schedule=[[0, 64], [2, 128]]"]}[mode]   # Stage A latents: side / 4
    return demo_args(tmp, mode, "image_size=16", switch, *extra), [8, 8, 16, 16] if mode == "lora" else [16, 16, 32, 32]

@pytest.mark.parametrize("mode", ["lora", "controlnet", "stage_b"])
def test_every_mode_crosses_the_switch(tmp_path, sides_trained, mode):
    args, want = _mode_args(tmp_path, mode)
    cfg = load_config(args[0], [*args[1:], "updates=4", "save_every=4"])
    sides_trained.clear()
    assert train(cfg)["update"] == 4
    assert (cfg.train.mode, [s[-1] for s in sides_trained]) == ({"stage_b": "full"}.get(mode, mode), want)

def test_two_process_ddp_across_the_switch(tmp_path):
    res = _launch_2proc("--check-ddp-sync", *demo_args(tmp_path, "ddp", "image_size=16", "resolution_schedule=[[0, 8], [2, 16]]",
                                                       "updates=4", "save_every=2", "batch_size=8"))
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    assert [(r["update"], r["image_size"]) for r in metrics(tmp_path, "ddp")] == [(1, 8), (2, 8), (3, 16), (4, 16)]
    assert info(tmp_path, "ddp")["update"] == 4

def test_memory_plan_is_the_largest_sides():
    from cascade_nb.memory import plan_memory
    plan = lambda *o: plan_memory(load_config(None, ["model_version=1B", "experiment_id=m", "webdataset_path=x", *o]))
    scheduled = plan("image_size=768", "resolution_schedule=[[0, 256], [1000, 768]]")
    assert scheduled.rows == plan("image_size=768").rows != plan("image_size=256").rows
    assert "@768" in scheduled.summary
