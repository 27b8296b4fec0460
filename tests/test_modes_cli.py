"""A training mode defined outside the package: a module named in the config's `imports:` registers it with
`@training_mode`, and the command line trains it (python -m and the script path accelerate launches)."""
import json, sys
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

MODE = '''
from pathlib import Path
from cascade_nb.modes import FullTraining, training_mode

@training_mode("x0_cli")
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
from cascade_nb.modes import FullTraining, StageBTraining, training_mode

@training_mode("b_user")
class MyStageB(StageBTraining):
    "A user's Stage B mode: its own loss (the standard one, counted)."
    def loss(self, net, gdf, x0, conds, rng=None, **kw):
        with open(Path(self.cfg.checkpoint.checkpoint_path) / "user_loss_calls.txt", "a") as f: f.write(f"{type(self).__name__}\\n")
        return super().loss(net, gdf, x0, conds, rng=rng, **kw)

@training_mode("c_user")
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
