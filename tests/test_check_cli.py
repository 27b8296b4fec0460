"""`python -m cascade_nb.check` as a user runs it: the LoRA that learnt nothing (rank 256 at lr 1e-6) is flagged with
its effective step size, every shipped config gives no finding, an error finding exits 1, a bad key is one line and
exit 2; and `train` refuses an error finding before it builds anything."""
import pytest
from conftest import ROOT, run_cli
from cascade_nb.check import main

LORA = ROOT / "configs" / "lora_demo.yaml"

def test_rank_256_at_lr_1e6_is_flagged_with_its_step_size():
    res = run_cli("-m", "cascade_nb.check", LORA, "rank=256", "lr=1e-6")
    lines = res.stdout.splitlines()
    step = [l for l in lines if "effective adapter step" in l]
    assert len(step) == 1 and "lr × lora_alpha/rank = 1e-06 × 1/256 = 3.9e-09 per update" in step[0], res.stdout
    assert step[0].startswith("warning: lr:") and "lora_alpha: 256" in step[0]
    assert res.returncode == 0 and "0 errors" in lines[-2], res.stdout

@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_give_no_finding(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main([f"configs/{config}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no findings\n"), out

def test_an_error_finding_exits_1_and_a_bad_key_is_one_line(capsys):
    assert main([LORA, "caption_dropout=1", "--no-data"]) == 1
    assert capsys.readouterr().out.startswith("error: caption_dropout: 1 drops every caption")
    for argv, needle in [([LORA, "learning_rate=1e-4"], "override: unknown key 'learning_rate'; did you mean 'lr'?"),
                         ([LORA, "--budget", "0"], "--budget 0: expected GB > 0")]:
        with pytest.raises(SystemExit) as e: main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0], err

def test_train_refuses_an_error_finding_before_building(tmp_path):
    res = run_cli("-m", "cascade_nb.train", ROOT / "configs" / "demo.yaml", "caption_dropout=1",
                  f"checkpoint_path={tmp_path}", f"output_path={tmp_path}", check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "check: error: caption_dropout" in lines[-1], res.stderr
    assert "training of" not in res.stdout and not any(tmp_path.iterdir()), res.stdout

DEMO = ROOT / "configs" / "demo.yaml"

@pytest.mark.parametrize("config, entry", [
    (DEMO, "{text: apple, seed: -1}"), (DEMO, "{text: apple, cfg: .nan}"), (DEMO, "{text: apple, size: 4096}"),
    (DEMO, "{text: apple, size: 200000}"), (DEMO, "{text: apple, steps: 100000000}"),
    (DEMO, "{text: apple, adapter_scale: 0.5}"), (LORA, "{text: apple, negative_prompt: blurry}")])
def test_check_reads_sample_prompts_as_the_launch_does(tmp_path, capsys, monkeypatch, config, entry):
    "B57: `check` said 'no findings' for prompts files the launch refuses (B56, B58-B60); now the launch's own line."
    from cascade_nb.config import load_config, ConfigError
    from cascade_nb.prompt_samples import check_sample_prompts
    monkeypatch.chdir(ROOT)
    (tmp_path / "p.yaml").write_text(f"- {entry}\n")
    args = [config, f"sample_prompts={tmp_path}/p.yaml"]
    with pytest.raises(ConfigError) as launch: check_sample_prompts(load_config(args[0], args[1:]))
    assert main([*args, "--no-data"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"error: sample_prompts: {launch.value}; train refuses to start with it", first

@pytest.mark.parametrize("overrides, says", [
    (["lr_multipliers={nonexistent_block: 2}"], "error: lr_multipliers: key 'lr_multipliers.nonexistent_block': "
                                                "'nonexistent_block' decides the lr of no trained parameter"),
    (["warmup_updates=100000", "updates=10"], "warning: warmup_updates: 100000 is not below updates 10"),
    (["optimizer=prodigy", "lr=1", "optimizer_args={d_coef: 1.0e+30}"], "warning: optimizer_args.d_coef: 1e+30")])
def test_check_finds_what_the_launch_finds_late_and_warns_of_odd_schedules(capsys, monkeypatch, overrides, says):
    "B53: an lr_multipliers pattern that matches nothing was found only once the model was built; B54: warnings."
    monkeypatch.chdir(ROOT)
    main([DEMO, *overrides, "--no-data"])
    out = capsys.readouterr().out
    assert out.startswith(says), out
