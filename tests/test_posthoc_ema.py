"""Post-hoc EMA (issue 50, EDM2): the reconstruction against closed forms and a brute-force EMA, a run killed inside a
save resuming to the same averages and snapshot series, snapshots of whole tensors on 2 processes (DDP and FSDP2's
shards gathered), and bad input as one line."""
import json, shutil
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file
from conftest import run_cli
from test_train import DRIVER, _launch_2proc, demo_args, weights, resumes_to_the_killed_state
from cascade_nb.config import config_from_dict, ConfigError
from cascade_nb.ema import (gamma_of, power_beta, posthoc_coefficients, reconstruct, read_snapshots, snapshot_path,
                            SIGMA_REL_MAX, main as ema_main)

POSTHOC = ["posthoc_ema=true", "posthoc_every=2"]

def brute_force(theta: torch.Tensor, gamma: float, every: int):
    "The power-function EMA of scalar sequence `theta`, stepped one update at a time: (final, snapshots every `every`)."
    ema, snaps = torch.zeros((), dtype=torch.float64), []
    for t, th in enumerate(theta, 1):
        beta = power_beta(t, gamma)
        ema = beta * ema + (1 - beta) * th
        if t % every == 0: snaps.append(ema)
    return ema, torch.stack(snaps)

def test_solver_reproduces_tracked_profiles_and_a_third_width():
    "A tracked width at the last snapshot is that snapshot alone; 0.08 from 0.05 and 0.10 matches an EMA run at 0.08."
    g05, g10, g08 = gamma_of(0.05), gamma_of(0.10), gamma_of(0.08)
    ts = torch.arange(25, 501, 25, dtype=torch.float64)
    t_in, g_in = ts.repeat(2), torch.tensor([g05] * 20 + [g10] * 20, dtype=torch.float64)
    for j, g in ((19, g05), (39, g10)):
        one_hot = torch.eye(40, dtype=torch.float64)[j]
        assert torch.allclose(posthoc_coefficients(t_in, g_in, 500, g), one_hot, atol=1e-9)
    x = posthoc_coefficients(t_in, g_in, 500, g08)
    theta = torch.randn(500, generator=torch.Generator().manual_seed(1), dtype=torch.float64).cumsum(0) / 10
    theta += torch.linspace(0, 3, 500, dtype=torch.float64)
    snaps = torch.cat([brute_force(theta, g, 25)[1] for g in (g05, g10)])
    truth = brute_force(theta, g08, 1)[0]
    assert abs((x * snaps).sum() - truth) < 0.01 * theta.std()
    # a linear drift theta(t) = t: every width averages to t (gamma+1)/(gamma+2) in the continuous limit
    lin = torch.arange(1, 501, dtype=torch.float64)
    snaps = torch.cat([brute_force(lin, g, 25)[1] for g in (g05, g10)])
    assert abs((x * snaps).sum() - 500 * (g08 + 1) / (g08 + 2)) < 1.0

def test_widths_out_of_range_and_single_width_are_config_errors():
    for bad, why in (([0.05, 0.3], "posthoc_sigma_rels[1]': 0.3 is out of range"),
                     ([0.0, 0.1], "posthoc_sigma_rels[0]': 0.0 is out of range"),
                     ([0.05], "two or more different widths")):
        with pytest.raises(ConfigError, match=f".*{why.replace('[', '.').replace(']', '.')}"):
            config_from_dict({"posthoc_ema": True, "posthoc_sigma_rels": bad}, training=False)
    assert config_from_dict({}, training=False).posthoc.posthoc_ema is False   # off by default

def test_kill_in_save_then_resume_is_bit_identical_and_the_series_continues(tmp_path):
    """Killed inside its save of update 4 (snapshots of updates 2 and 4 written, the state of update 2 committed), the
    resumed run removes the snapshot the cut-short run wrote after update 2, commits the same averages for update 4 and
    writes the same snapshots, file for file; a tracked width rebuilt from them is its average."""
    run = tmp_path / "ckpt" / "ph"
    argv = demo_args(tmp_path, "ph", "updates=6", "save_every=2", *POSTHOC)
    killed_snaps = {}
    def launch(*a, check=True):
        res = run_cli(DRIVER, *a, check=check)
        if "--kill-in-commit" in a:
            killed_snaps.update({f.name: f.read_bytes() for f in (run / "posthoc").glob("*.safetensors")})
        return res
    resumes_to_the_killed_state(run, argv, launch=launch, at=4)
    assert sorted(killed_snaps) == [f"0000000{u}-{s}.safetensors" for u in (2, 4) for s in ("0.0500", "0.1000")]
    now = {f.name: f.read_bytes() for f in (run / "posthoc").glob("*.safetensors")}
    assert sorted(now) == sorted([*killed_snaps, "00000006-0.0500.safetensors", "00000006-0.1000.safetensors"])
    assert all(now[k] == v for k, v in killed_snaps.items())   # the same bytes: tensors and header
    state = run / json.loads((run / "info.json").read_text())["state_dir"]
    for s in (0.05, 0.10):
        average, snap = load_file(str(state / f"posthoc-{s:.4f}.safetensors")), load_file(str(snapshot_path(run, 6, s)))
        assert all(torch.equal(average[k], snap[k]) for k in snap)
        rebuilt = reconstruct(run, s)
        assert max((rebuilt[k] - snap[k]).abs().max().item() for k in snap) < 1e-6
    out = tmp_path / "r08.safetensors"
    ema_main([str(run), "--sigma-rel", "0.08", "--out", str(out)])
    assert set(load_file(str(out))) == set(weights(tmp_path, "ph", "generator_ema"))

# FSDP2 only: its sharded averages are the case that must gather (DDP keeps whole replicas; the suite's time budget)
@pytest.mark.parametrize("layout", ["fsdp"])
def test_two_processes_snapshot_whole_tensors(tmp_path, layout):
    """2 processes (gloo): the snapshots hold whole tensors (FSDP2: each process's shards gathered), the first a copy of
    the weights of update 1 (the released backup), the second beta*first + (1-beta)*weights of update 2."""
    flags = ["--fsdp-cpu"] if layout == "fsdp" else ["--check-ddp-sync"]
    _launch_2proc(*flags, *demo_args(tmp_path, "p2", "updates=2", "save_every=1", "backup_every=1", "batch_size=8",
                                     "posthoc_ema=true", "posthoc_every=1"))
    run = tmp_path / "ckpt" / "p2"
    assert [(u, s) for _, s, u in read_snapshots(run)] == [(1, 0.05), (1, 0.10), (2, 0.05), (2, 0.10)]
    w1, w2 = weights(tmp_path, "p2", "generator_1"), weights(tmp_path, "p2", "generator_2")
    for s in (0.05, 0.10):
        first, second = load_file(str(snapshot_path(run, 1, s))), load_file(str(snapshot_path(run, 2, s)))
        assert first.keys() == w1.keys() and all(torch.equal(first[k], w1[k]) for k in w1)
        beta = power_beta(2, gamma_of(s))
        assert all(torch.allclose(second[k], beta * w1[k] + (1 - beta) * w2[k], atol=1e-6)
                   for k in w2 if w2[k].is_floating_point())

def test_command_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "info.json").write_text("{}")
    for argv, why in (([str(tmp_path / "run"), "--sigma-rel", "0.5"], f"0.5 is out of range; expected a width in (0, "
                                                                       f"{SIGMA_REL_MAX:.4f})"),
                      ([str(tmp_path / "run"), "--sigma-rel", "0.08"], "no post-hoc EMA snapshots")):
        with pytest.raises(SystemExit) as e: ema_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and len(err.strip().splitlines()) == 1, err
