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
    cfg = (ROOT / "configs" / "demo.yaml").read_text()
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
