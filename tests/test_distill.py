"""The distillation modes (cascade_nb.distill) through the real trainer: each mode trains from a tiny teacher, a run
stopped and resumed releases exactly what an uninterrupted run releases, each runs on 2 DDP processes (gloo), and a
student samples through the sample CLI with its own sampler, steps and CFG."""
import json, os, re, signal
from pathlib import Path
import pytest, torch
from safetensors.torch import load_file
from conftest import ROOT, run_cli, free_port

DRIVER = ROOT / "tests" / "train_driver.py"
DEMO = ROOT / "configs" / "demo.yaml"
TINY = ["webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "batch_size=4", "tracker=none",
        "log_every=1", "eval_every=null", "best_metric=null", "ema_start_iters=null", "sample_steps=2"]
MODES = {"lcm": ["mode=lcm", "solver_steps=8", "cfg_scale=[1, 3]"],
         # PCM, a 2-step teacher solve, half the inputs the student's own, the CFG rescale's std over each noise level
         "lcm_phased": ["mode=lcm", "solver_steps=4", "solver_substeps=2", "phases=2", "cfg_scale=2", "student_rollout=0.5",
                        "cfg_rescale_std=level"],
         "progressive": ["mode=progressive", "teacher_steps=4", "cfg_scale=2"],
         "distill": ["mode=distill", "model_overrides={c_in: 3, c_out: 3, patch_size: 2, blocks: [[1, 1], [1, 1]]}"]}

@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    "A tiny 'trained' Stage C weights file (random, with a non-zero output layer so that predictions differ)."
    from cascade_nb.models.stage_c import StageC, save_stage_c
    path = tmp_path_factory.mktemp("teacher") / "stage_c_tiny.safetensors"
    torch.manual_seed(0)
    model = StageC.from_preset("tiny", c_in=3, c_out=3, patch_size=2)
    with torch.no_grad(): model.clf[1].weight.normal_(std=0.1)
    save_stage_c(model, path)
    return path

def overrides(tmp, name, teacher, mode, *extra):
    "The run's overrides; `mode` is a key of MODES (a mode name, or a variant such as lcm_phased)."
    return [*TINY, *MODES[mode], f"teacher_checkpoint_path={teacher}", f"experiment_id={name}",
            f"checkpoint_path={tmp}/ck", f"output_path={tmp}/out", *extra]

def released(tmp, name) -> dict:
    run = Path(tmp) / "ck" / name
    return {f.name: load_file(str(f)) for f in sorted(run.glob("generator*.safetensors"))}

class StopAt:
    "A training hook that sends this process SIGTERM after update `n`: the trainer saves there and returns (as on pre-emption)."
    n = None
    def __init__(self, cfg): pass
    @classmethod
    def enabled(cls, cfg): return cls.n is not None
    def after_update(self, run):
        if run.state.update == self.n: os.kill(os.getpid(), signal.SIGTERM)

def stopped_and_resumed(run, tmp: Path, at: int = 2) -> dict:
    """`run(folder)` twice into `tmp`/stopped, the first stopped by SIGTERM after update `at` (`StopAt`), the second
    resuming it; the second's result."""
    from cascade_nb.train_state import TRAINING_HOOKS
    TRAINING_HOOKS["test_stop"] = StopAt
    try:
        StopAt.n = at
        assert run(tmp / "stopped")["update"] == at
    finally:
        StopAt.n = None; del TRAINING_HOOKS["test_stop"]
    return run(tmp / "stopped")

@pytest.mark.parametrize("mode", list(MODES))
def test_mode_trains_and_resumes_bit_identically(tmp_path, teacher, mode):
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.train_state import TRAINING_HOOKS
    run = lambda tmp, *kv: train(load_config(DEMO, overrides(tmp, "s", teacher, mode, "updates=3", "save_every=3", *kv)))
    ref = run(tmp_path / "ref")
    assert ref["update"] == 3 and type(ref["mode"]).name == mode.split("_")[0]
    TRAINING_HOOKS["test_stop"] = StopAt
    try:
        StopAt.n = 2
        assert run(tmp_path / "stopped")["update"] == 2   # stopped after update 2, saved there
    finally:
        StopAt.n = None; del TRAINING_HOOKS["test_stop"]
    assert json.loads((tmp_path / "stopped" / "ck" / "s" / "info.json").read_text())["update"] == 2
    assert run(tmp_path / "stopped")["update"] == 3      # resumed from update 2
    a, b = released(tmp_path / "ref", "s"), released(tmp_path / "stopped", "s")
    assert set(a) == ({"generator.safetensors", "generator_ema.safetensors"} if mode.startswith("lcm") else {"generator.safetensors"})
    for f in a:
        diff = [k for k in a[f] if not torch.equal(a[f][k], b[f][k])]
        assert not diff, f"{f}: {len(diff)} tensors differ after resume, e.g. {diff[:3]}"
    teacher_sd = load_file(str(teacher))
    if mode != "distill": assert a["generator.safetensors"].keys() == teacher_sd.keys()
    assert not torch.equal(a["generator.safetensors"]["clf.1.weight"], teacher_sd["clf.1.weight"])   # the student trained

@pytest.mark.parametrize("mode", list(MODES))
def test_two_process_ddp(tmp_path, teacher, mode):
    res = run_cli("-m", "accelerate.commands.launch", "--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml",
                  "--main_process_port", str(free_port()), DRIVER, "--check-ddp-sync", DEMO,
                  *overrides(tmp_path, "ddp", teacher, mode, "updates=1", "save_every=1", "batch_size=8"), env={"OMP_NUM_THREADS": "1"})
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]   # lcm: student and target network
    info = json.loads((tmp_path / "ck" / "ddp" / "info.json").read_text())
    assert info["num_processes"] == 2 and info["update"] == 1

def test_student_samples_with_its_own_sampler(tmp_path, teacher, capsys):
    "The sample CLI on an lcm student: the run's LCM sampler, 4 steps and CFG 1, unless the command line overrides them."
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.sample import load_run, sample_run, main
    train(load_config(DEMO, overrides(tmp_path, "lcm", teacher, "lcm", "updates=1", "save_every=1")))
    run = tmp_path / "ck" / "lcm"
    mode, gdf, cfg = load_run(run)
    assert (cfg.gdf.sample_sampler, cfg.gdf.sample_steps, cfg.gdf.sample_cfg) == ("lcm", 4, 1.0)
    own = sample_run(mode, gdf, cfg, ["red apple"], n=2, seed=3)
    assert torch.equal(own, sample_run(mode, gdf, cfg, ["red apple"], n=2, seed=3, steps=4, sampler="lcm", cfg_scale=1.0))
    assert not torch.equal(own, sample_run(mode, gdf, cfg, ["red apple"], n=2, seed=3, steps=2))
    paths = main(["--checkpoint", run, "--prompt", "red apple", "--n", "2", "--out", tmp_path / "samples"])
    assert len(paths) == 2 and "generator_ema.safetensors" in capsys.readouterr().out   # the target network, as any run's EMA

def test_phased_student_samples_by_ddim_at_its_phase_edges(tmp_path, teacher):
    """A phased (PCM) lcm run samples deterministically: DDIM at its `phases` edges, CFG 1; the same noise gives the same
    images, and they are what its generator gives with those settings."""
    from cascade_nb.config import load_config, ConfigError
    from cascade_nb.train import train
    from cascade_nb.sample import load_run, sample_run
    with pytest.raises(ConfigError, match="'solver_steps': 6 is not a multiple of phases=4"):
        load_config(DEMO, overrides(tmp_path, "bad", teacher, "lcm_phased", "solver_steps=6", "phases=4"))
    train(load_config(DEMO, overrides(tmp_path, "pcm", teacher, "lcm_phased", "updates=1", "save_every=1")))
    mode, gdf, cfg = load_run(tmp_path / "ck" / "pcm")
    assert (cfg.gdf.sample_sampler, cfg.gdf.sample_steps, cfg.gdf.sample_cfg) == ("ddim", 2, 1.0)
    own = sample_run(mode, gdf, cfg, ["red apple"], n=2, seed=3)
    assert torch.equal(own, sample_run(mode, gdf, cfg, ["red apple"], n=2, seed=3, steps=2, sampler="ddim", cfg_scale=1.0))
    assert not torch.equal(own, sample_run(mode, gdf, cfg, ["red apple"], n=2, seed=3, steps=2, sampler="lcm"))

def test_lcm_student_architecture_must_match_the_teacher(tmp_path, teacher):
    from cascade_nb.config import load_config, ConfigError
    from cascade_nb.train import train
    cfg = load_config(DEMO, overrides(tmp_path, "bad", teacher, "lcm", "updates=1",
                                      "model_overrides={c_in: 3, c_out: 3, patch_size: 2, blocks: [[1, 1], [1, 1]]}"))
    with pytest.raises(ConfigError, match="starts the student from the teacher"): train(cfg)

def test_lcm_lora_and_lora_runs_sample_through_the_cli(tmp_path, teacher, capsys):
    """An LCM-LoRA run releases only lora.safetensors: the sample CLI (and so the pipeline and generate, which load runs the
    same way) merges it into its base, the teacher. A plain LoRA run's base is its generator_checkpoint_path."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.sample import run_generator, main
    from cascade_nb.models.stage_c import load_stage_c
    from cascade_nb.lora_file import merge_lora
    lora_keys = ["module_filters=[attention]", "rank=2"]
    train(load_config(DEMO, overrides(tmp_path, "lcm_lora", teacher, "lcm", "updates=1", "save_every=1", *lora_keys)))
    run = tmp_path / "ck" / "lcm_lora"
    assert not list(run.glob("generator*.safetensors")) and (run / "lora.safetensors").exists()
    cfg, generator, weights = run_generator(run)
    assert weights.name == "lora.safetensors"
    expected = merge_lora(load_stage_c(teacher).float(), load_file(str(run / "lora.safetensors")))
    for k, v in expected.state_dict().items(): assert torch.equal(generator.state_dict()[k], v), k
    assert main(["--checkpoint", run, "--prompt", "red apple", "--n", "1", "--out", tmp_path / "s1"])
    assert "lora.safetensors" in capsys.readouterr().out
    plain = [*TINY, "mode=lora", *lora_keys, f"generator_checkpoint_path={teacher}", "model_overrides={c_in: 3, c_out: 3, patch_size: 2}",
             "experiment_id=lora", f"checkpoint_path={tmp_path}/ck", f"output_path={tmp_path}/out", "updates=1", "save_every=1"]
    train(load_config(DEMO, plain))
    cfg, generator, weights = run_generator(tmp_path / "ck" / "lora")
    assert weights.name == "lora.safetensors"
    base = load_stage_c(teacher).float()
    assert any(not torch.equal(generator.state_dict()[k], v) for k, v in base.state_dict().items())   # the adapters are in

def test_lcm_lora_resumes_bit_identically_from_its_adapters(tmp_path, teacher):
    """LCM-LoRA's training state holds its adapters, not the frozen base (the teacher, loaded again on resume), and
    the memory planner counts an optimizer for the adapters alone; a resumed run equals an uninterrupted one."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.memory import plan_memory
    keys = ["module_filters=[attention]", "rank=2", "updates=3", "save_every=3"]
    run = lambda tmp: train(load_config(DEMO, overrides(tmp, "s", teacher, "lcm", *keys)))
    run(tmp_path / "ref")
    assert stopped_and_resumed(run, tmp_path)["update"] == 3
    a, b = (tmp_path / k / "ck" / "s" for k in ("ref", "stopped"))
    x, y = load_file(str(a / "lora.safetensors")), load_file(str(b / "lora.safetensors"))
    assert x and not [k for k in x if not torch.equal(x[k], y[k])]
    state = a / json.loads((a / "info.json").read_text())["state_dir"] / "model.safetensors"
    saved = load_file(str(state))
    assert saved and all("lora" in k for k in saved), [k for k in saved if "lora" not in k][:3]   # no frozen base
    plan = plan_memory(load_config(DEMO, overrides(tmp_path, "p", teacher, "lcm", *keys)))
    n_adapters = sum(v.numel() for k, v in x.items() if not k.endswith(".alpha"))
    assert plan.rows["optimizer state (adamw)"] <= 2 * 4 * n_adapters * 1.01   # AdamW's two moments, float32

def test_lcm_target_network_follows_schedule_free_x(tmp_path, teacher):
    """Schedule-free AdamW trains y and releases x; LCM's target network, the student's EMA, averages x as the run's
    EMA does (`target_ema_beta=0`: a copy of x after every update, which y is not)."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    train(load_config(DEMO, overrides(tmp_path, "sf", teacher, "lcm", "updates=2", "save_every=2", "lr=1e-2",
                                      "optimizer=schedulefree_adamw", "lr_schedule=constant", "target_ema_beta=0")))
    r, run = released(tmp_path, "sf"), tmp_path / "ck" / "sf"
    x, target = r["generator.safetensors"], r["generator_ema.safetensors"]
    y = load_file(str(run / json.loads((run / "info.json").read_text())["state_dir"] / "model.safetensors"))
    y = {k.removeprefix("student."): v for k, v in y.items() if k.startswith("student.")}
    assert x.keys() == target.keys() == y.keys()
    assert all(torch.equal(target[k], x[k]) for k in x)
    assert not all(torch.equal(y[k], x[k]) for k in x)

def test_lcm_lora_trains_any_adapter_type(tmp_path, teacher):
    """LCM-LoRA with a LyCORIS type (LoHa): the student's adapters train, and the released file merges into the teacher
    the way the sample CLI loads it."""
    from cascade_nb.config import load_config
    from cascade_nb.train import train
    from cascade_nb.sample import run_generator
    from cascade_nb.models.stage_c import load_stage_c
    from cascade_nb.lora_file import merge_lora
    train(load_config(DEMO, overrides(tmp_path, "lcm_loha", teacher, "lcm", "updates=1", "save_every=1",
                                      "module_filters=[attention]", "adapter=loha", "rank=2")))
    run = tmp_path / "ck" / "lcm_loha"
    lora = load_file(str(run / "lora.safetensors"))
    assert any(k.endswith(".hada_w1_a") for k in lora) and not any(k.endswith(".lora_down") for k in lora)
    cfg, generator, weights = run_generator(run)
    expected = merge_lora(load_stage_c(teacher).float(), lora)
    for k, v in expected.state_dict().items(): assert torch.equal(generator.state_dict()[k], v), k
    base = load_stage_c(teacher).float()
    assert any(not torch.equal(generator.state_dict()[k], v) for k, v in base.state_dict().items())

def test_lcm_refuses_tokens_and_text_encoder_adapters(tmp_path, teacher):
    "LCM distils the generator's sampling: new tokens and text-encoder adapters are refused in one line each."
    from cascade_nb.config import load_config, ConfigError
    from cascade_nb.train import train
    lora = ["module_filters=[attention]", "rank=2", "updates=1"]
    for extra, message in ((["train_tokens=[['[x]', null]]"], "not train_tokens"),
                           (["text_encoder_adapter=lora"], "key 'text_encoder_adapter': mode 'lcm'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            train(load_config(DEMO, overrides(tmp_path, "bad", teacher, "lcm", *lora, *extra)))
