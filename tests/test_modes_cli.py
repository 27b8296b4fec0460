"""A training mode defined outside the package: a module named in the config's `imports:` registers it with
`@register_training_mode`, and the command line trains it (python -m and the script path accelerate launches)."""
import json, re, sys
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

MODE = '''
from pathlib import Path
from cascade_nb.modes import FullTraining, register_training_mode

@register_training_mode("x0_cli")
class X0Training(FullTraining):
    "Predict x0 directly, scored by a plain MSE."
    def loss(self, net, gdf, x0, conds, rng=None, **kw):
        d = gdf.diffuse(x0, shift=self.cfg.gdf.shift, loss_shift=self.cfg.gdf.shift, generator=rng)
        raw = ((net(d.noised, d.noise_cond, **conds).float() - x0.float()) ** 2).flatten(1).mean(1)
        return raw.mean(), raw, d
    def after_update(self, state):
        with open(Path(self.cfg.checkpoint.checkpoint_path) / "x0_updates.txt", "a") as f: f.write(f"{state.update}\\n")
'''

def write_run(tmp: Path) -> Path:
    (tmp / "my_modes.py").write_text(MODE)
    # the demo's own webdataset_path replaced (a key given twice is refused)
    cfg = "\n".join(l for l in (ROOT / "configs" / "demo.yaml").read_text().splitlines() if not l.startswith("webdataset_path:"))
    cfg += f"\nimports: [my_modes]\nmode: x0_cli\nwebdataset_path: {ROOT / 'data_samples' / 'emoji'}\n"
    (tmp / "x0.yaml").write_text(cfg)
    return tmp / "x0.yaml"

@pytest.mark.parametrize("entry", [["-m", "cascade_nb.train"], [str(ROOT / "cascade_nb" / "train.py")]], ids=["module", "script"])
def test_user_mode_trains_from_the_cli(tmp_path, entry):
    cfg = write_run(tmp_path)
    run_cli(*entry, cfg, "num_workers=0", "batch_size=4", "updates=3", "save_every=3", "log_every=1", "ema_start_iters=null",
            f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out", "experiment_id=x0", cwd=tmp_path.parent)
    assert (tmp_path / "ckpt" / "x0_updates.txt").read_text().split() == ["1", "2", "3"]   # the user's hook ran
    info = json.loads((tmp_path / "ckpt" / "x0" / "info.json").read_text())
    assert info["update"] == 3 and info["config"]["mode"] == "x0_cli" and info["config"]["imports"] == ["my_modes"]

def test_unknown_mode_and_missing_module_are_config_errors(tmp_path):
    cfg = write_run(tmp_path)
    res = run_cli("-m", "cascade_nb.train", cfg, "mode=x0_clj", "experiment_id=e", check=False, cwd=tmp_path.parent)
    assert res.returncode == 2 and "did you mean 'x0_cli'" in res.stderr, res.stderr[-2000:]
    res = run_cli("-m", "cascade_nb.train", cfg, "imports=[not_my_modes]", "experiment_id=e", check=False, cwd=tmp_path.parent)
    assert res.returncode == 2 and "no module named 'not_my_modes'" in res.stderr, res.stderr[-2000:]

STAGE_B_MODE = '''
from pathlib import Path
from cascade_nb.modes import FullTraining, StageBTraining, register_training_mode

@register_training_mode("b_user")
class MyStageB(StageBTraining):
    "A user's Stage B mode: its own loss (the standard one, counted)."
    def loss(self, net, gdf, x0, conds, rng=None, **kw):
        with open(Path(self.cfg.checkpoint.checkpoint_path) / "user_loss_calls.txt", "a") as f: f.write(f"{type(self).__name__}\\n")
        return super().loss(net, gdf, x0, conds, rng=rng, **kw)

@register_training_mode("c_user")
class MyStageC(FullTraining):
    "A user's mode with Stage C's inputs."
'''

def stage_b_args(tmp: Path, *extra):
    from official_configs import OFFICIAL_CONFIGS
    (tmp / "my_b_modes.py").write_text(STAGE_B_MODE)
    cfg = tmp / "finetune_b_700m.yaml"
    cfg.write_text(OFFICIAL_CONFIGS["finetune_b_700m.yaml"] + "\nimports: [my_b_modes]\n")
    return [cfg, "model_version=tiny", "stage=b", "stage_a_checkpoint_path=tiny", "effnet_checkpoint_path=tiny",
            "clip_text_model_name=tiny", "clip_image_model_name=null", "generator_checkpoint_path=null", "wandb_project=null",
            "tracker=none", f"webdataset_path={ROOT / 'data_samples' / 'emoji'}", "num_workers=0", "image_size=64",
            "batch_size=2", "multi_aspect_ratio=null", "sample_steps=2", "use_fsdp=false", "updates=2", "save_every=2",
            "experiment_id=b", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *extra]

def test_user_stage_b_mode_keeps_its_loss(tmp_path):
    "A subclass of StageBTraining loaded through `imports:` trains a Stage B config with its own class and loss."
    run_cli("-m", "cascade_nb.train", *stage_b_args(tmp_path, "mode=b_user"), cwd=tmp_path.parent, env={"OMP_NUM_THREADS": "1"})
    calls = (tmp_path / "ckpt" / "user_loss_calls.txt").read_text().split()
    assert calls and set(calls) == {"MyStageB"}, calls                     # the user's loss ran, in the user's class
    info = json.loads((tmp_path / "ckpt" / "b" / "info.json").read_text())
    assert info["update"] == 2 and info["config"]["mode"] == "b_user"

def test_stage_c_mode_on_a_stage_b_config_is_refused_at_start(tmp_path):
    "A mode that cannot train the config's stage is a config error (exit 2) before any model is built."
    res = run_cli("-m", "cascade_nb.train", *stage_b_args(tmp_path, "mode=c_user"), cwd=tmp_path.parent, check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "mode 'c_user' (my_b_modes.MyStageC) trains Stage C only" in res.stderr and "StageBTraining" in res.stderr, res.stderr[-2000:]

PARTS = '''
from pathlib import Path
import torch
from cascade_nb.gdf import BaseLossWeight, DDIMSampler, register_loss_weight, register_sampler
from cascade_nb.modes import FullTraining, register_training_mode
from cascade_nb.optimizers import OptimizerSpec, register_optimizer, register_lr_schedule

def mark(what):
    with open(Path(__file__).with_name("calls.txt"), "a") as f: f.write(what + "\\n")

@register_loss_weight("flat_mid")
class FlatMid(BaseLossWeight):
    "1 for logSNR in [-2, 2], 0.1 elsewhere."
    def weight(self, logsnr):
        mark("loss_weight")
        return 0.1 + 0.9 * (logsnr.abs() <= 2).to(logsnr.dtype)

@register_sampler("ddim_half")
class HalfNoiseDDIM(DDIMSampler):
    "DDIM with eta = 0.5."
    def __init__(self): super().__init__(eta=0.5)
    def sigma(self, *args, **params):
        mark("sampler")
        return super().sigma(*args, **params)

@register_optimizer("plain_sgd")
class PlainSGD(OptimizerSpec):
    "SGD without momentum: no state."
    @staticmethod
    def build(params, t, lr):
        mark("optimizer")
        return torch.optim.SGD(params, lr=lr)
    @staticmethod
    def state_bytes(param_bytes): return 0

@register_lr_schedule("halving")
def halving(progress):
    "Half the LR after the warm-up."
    mark("lr_schedule")
    return 0.5

@register_training_mode("counted")
class CountedTraining(FullTraining):
    "Full fine-tuning on the left half of each image (a loss mask passed from `extras` to `loss`), counting its updates."
    def extras(self, batch, x0):
        mask = torch.zeros_like(x0[:, :1]); mask[..., : x0.shape[-1] // 2] = 1
        return {"weight": mask}
    def loss(self, net, gdf, x0, conds, rng=None, **kw):
        mark("masked" if kw["weight"].shape == (len(x0), 1, *x0.shape[2:]) else "unmasked")
        return super().loss(net, gdf, x0, conds, rng=rng, **kw)
    def after_update(self, state): mark("mode")
'''

def test_user_registered_parts_train_sample_and_plan(tmp_path):
    """A module outside the package registers a loss weight, a sampler, an optimizer, an LR schedule and a mode (with a
    loss mask from `extras`):
    `accelerate launch` trains with them, `python -m cascade_nb.sample --sampler --import` samples with the sampler (a
    run folder imports no module on its own: the user names it), the memory
    planner plans the mode; no package edit."""
    (tmp_path / "my_parts.py").write_text(PARTS)
    cfg = tmp_path / "parts.yaml"
    cfg.write_text("\n".join(l for l in (ROOT / "configs" / "demo.yaml").read_text().splitlines()
                             if not l.startswith(("webdataset_path:", "loss_weight:", "lr_schedule:")))
                   + f"\nimports: [my_parts]\nmode: counted\nloss_weight: flat_mid\noptimizer: plain_sgd\nlr_schedule: halving\n"
                   f"webdataset_path: {ROOT / 'data_samples' / 'emoji'}\n")
    calls = tmp_path / "calls.txt"
    run_cli("-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", ROOT / "cascade_nb" / "train.py", cfg, "num_workers=0", "batch_size=4", "updates=2", "warmup_updates=1",
            "save_every=2", "eval_every=null", "ema_start_iters=null", "sample_steps=2", "tracker=none",
            f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out", "experiment_id=parts", cwd=tmp_path)
    trained = calls.read_text().split()
    assert trained.count("mode") == 2 and "loss_weight" in trained and "sampler" not in trained, trained
    assert trained.count("masked") == 2 and "unmasked" not in trained, trained   # one micro-batch per update
    assert trained.count("optimizer") == 1 and "lr_schedule" in trained, trained
    calls.unlink()
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", tmp_path / "ckpt" / "parts", "--prompt", "red apple", "--n", "1",
                  "--steps", "3", "--sampler", "ddim_half", "--out", tmp_path / "samples", "--import", "my_parts",
                  cwd=tmp_path)
    assert "wrote 1 images" in res.stdout and calls.read_text().split().count("sampler") == 3, calls.read_text()  # once per step
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", tmp_path / "ckpt" / "parts", "--prompt", "x", "--sampler", "ddim_hlaf",
                  "--out", tmp_path / "typo", "--import", "my_parts", check=False, cwd=tmp_path)
    assert res.returncode == 2 and "--sampler: 'ddim_hlaf' is not a registered sampler; did you mean 'ddim_half'" in res.stderr, res.stderr
    res = run_cli("-m", "cascade_nb.memory", cfg, "experiment_id=parts", cwd=tmp_path)
    assert res.stdout.startswith("counted tiny (543.76K generator, 543.76K trainable)") and "peak per GPU" in res.stdout, res.stdout
    assert re.search(r"optimizer state \(plain_sgd\)\s+0\.00\n", res.stdout), res.stdout
