"""One EMA flag (issue 49): `--ema / --no-ema` in every command that takes weights from a run (sample, eval, generate
and the pipeline here; `lora export|check` in test_lora_cli.py). By default the EMA where the run keeps one; `--ema`
on a run without one is one line naming the run folder and its files; `--best` with a flag that contradicts the best
file is one line; each command says which file it used and which weights that holds. The runs here are written by
hand (random tiny weights, headers through the trainer's `ema.labelled`, in this process); test_train.py,
test_eval.py and test_lora_cli.py check the header field on files the trainer and the exports write."""
import json, shutil
from pathlib import Path
import pytest, torch
from conftest import ROOT
from official_configs import OFFICIAL_CONFIGS

DEMO = ROOT / "configs" / "demo.yaml"
DATA = f"webdataset_path={ROOT / 'data_samples' / 'emoji'}"

def write_run(run: Path, cfg, live: dict, ema: dict | None = None) -> Path:
    "A finished run folder: info.json, generator.safetensors and (given `ema`) generator_ema.safetensors."
    from cascade_nb.core import save_safetensors_atomic
    from cascade_nb.ema import labelled
    run.mkdir(parents=True)
    info = {"config": cfg.to_yaml_dict(), "update": 2, "state_dir": "state-00000002"}
    (run / "info.json").write_text(json.dumps(info))
    files = labelled({"generator": live, **({"generator_ema": ema} if ema is not None else {})})
    for name, sd in files.items(): save_safetensors_atomic(sd, run / f"{name}.safetensors")
    return run

def averaged(sd: dict) -> dict:
    "Other weights than `sd` (an EMA's stand-in): its floating-point tensors moved."
    return {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in sd.items()}

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "(a demo run that kept an EMA, the same run without it, its live weights, its EMA weights)."
    from cascade_nb.config import load_config
    from cascade_nb.modes import build_generator
    tmp = tmp_path_factory.mktemp("ema_flag")
    cfg = load_config(DEMO, [DATA])
    torch.manual_seed(0)
    live = build_generator(cfg).state_dict()
    ema = averaged(live)
    return write_run(tmp / "with_ema", cfg, live, ema), write_run(tmp / "no_ema", cfg, live), live, ema

def one_line_exit(main, argv, capsys, *needles) -> str:
    "`main(argv)` in this process: exit status 2 and ONE line on stderr holding each of `needles`."
    capsys.readouterr()
    with pytest.raises(SystemExit) as e: main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, (e.value.code, err)
    for n in needles: assert n in err[0], err[0]
    return err[0]

def test_sample_takes_the_weights_the_flag_names(runs, tmp_path, capsys):
    from cascade_nb.sample import main, load_run
    run, _, live, ema = runs
    for i, (flag, name, kind) in enumerate([((), "generator_ema", "the EMA"), (("--ema",), "generator_ema", "the EMA"),
                                            (("--no-ema",), "generator", "the live weights")]):
        capsys.readouterr()
        main(["--checkpoint", str(run), "--prompt", "red apple", "--n", "1", "--steps", "1", "--out",
              str(tmp_path / f"s{i}"), *flag])
        out = capsys.readouterr().out.strip()
        assert out.endswith(f"from {run / f'{name}.safetensors'} ({kind})"), out
    for ema_flag, want in ((None, ema), (True, ema), (False, live)):
        net = load_run(run, ema=ema_flag)[0].net.state_dict()
        assert all(torch.equal(net[k], want[k]) for k in want)

def test_ema_on_a_run_without_one_is_one_line(runs, tmp_path, capsys):
    from cascade_nb import sample, eval as evaluate
    _, no_ema, *_ = runs
    why = f"{no_ema} has no generator_ema.safetensors (it kept no EMA); it has generator.safetensors"
    one_line_exit(sample.main, ["--checkpoint", no_ema, "--prompt", "x", "--ema", "--out", tmp_path / "s"], capsys,
                  why)
    assert not list((tmp_path / "s").iterdir())
    one_line_exit(evaluate.main, ["--checkpoint", no_ema, "--ema"], capsys, why)
    # the default and --no-ema take its live weights
    assert sample.run_weights(no_ema).name == sample.run_weights(no_ema, False).name == "generator.safetensors"

def test_best_with_a_flag_that_contradicts_its_file_is_one_line(runs, tmp_path, capsys):
    "The best weights are those the run scored (its EMA here): --best --ema samples them, --best --no-ema is refused."
    from cascade_nb.core import save_safetensors_atomic
    from cascade_nb.ema import labelled
    from cascade_nb.sample import main, run_weights
    run = tmp_path / "best"
    shutil.copytree(runs[0], run)
    best = run / "generator_ema_best.safetensors"
    save_safetensors_atomic(labelled({"generator_ema": runs[3]})["generator_ema"], best)
    (run / "best.json").write_text(json.dumps({"metric": "retrieval/top1", "value": 0.5, "update": 2,
                                               "weights": "generator_ema_best.safetensors"}))
    assert run_weights(run, None, best=True) == run_weights(run, True, best=True) == best
    one_line_exit(main, ["--checkpoint", run, "--prompt", "x", "--best", "--no-ema", "--out", tmp_path / "s"], capsys,
                  f"--best --no-ema: the best weights of {run}, generator_ema_best.safetensors, are the EMA; pass "
                  "--best alone, or --no-ema without --best")
    main(["--checkpoint", str(run), "--prompt", "x", "--n", "1", "--steps", "1", "--best", "--ema",
          "--out", str(tmp_path / "b")])
    assert capsys.readouterr().out.strip().endswith(f"from {best} (the EMA)")

def test_eval_names_the_weights_it_scored(runs, capsys):
    from cascade_nb.eval import main
    run = runs[0]
    capsys.readouterr()
    main(["--checkpoint", str(run), "--no-ema", "--captions", "2", "--steps", "1", "--metrics", "retrieval"])
    assert "weights\tgenerator.safetensors (live)" in capsys.readouterr().out.splitlines()

@pytest.fixture(scope="module")
def stage_c_run(tmp_path_factory):
    "(tiny models folder, a full fine-tune run of its Stage C with an EMA, one without, live weights, EMA weights)."
    from cascade_nb.config import load_config
    from cascade_nb.inference import write_tiny_checkpoints
    from cascade_nb.modes import build_generator
    tmp = tmp_path_factory.mktemp("stage_c_run")
    models = write_tiny_checkpoints(tmp / "models")
    yaml = tmp / "finetune_c_3b.yaml"; yaml.write_text(OFFICIAL_CONFIGS["finetune_c_3b.yaml"])
    cfg = load_config(yaml, ["model_version=tiny", "latent_space=effnet", "effnet_checkpoint_path=tiny",
                             "previewer_checkpoint_path=tiny", "clip_text_model_name=tiny",
                             "clip_image_model_name=null", "wandb_project=null", "tracker=none", DATA, "use_fsdp=false",
                             f"generator_checkpoint_path={models / 'stage_c.safetensors'}"])
    live = build_generator(cfg).state_dict()
    ema = averaged(live)
    return models, write_run(tmp / "with_ema", cfg, live, ema), write_run(tmp / "no_ema", cfg, live), live, ema

def test_the_pipeline_and_generate_take_the_run_s_choice(stage_c_run, tmp_path, capsys):
    from cascade_nb.inference import stage_c_weights_loader
    from cascade_nb.generate import main
    models, run, no_ema, live, ema = stage_c_run
    for flag, want in ((None, ema), (True, ema), (False, live)):
        net = stage_c_weights_loader(run, None, torch.float32, "cpu", flag)().state_dict()
        assert all(torch.equal(net[k], want[k]) for k in want)
    args = ["a cat", "--models", str(models), "--height", "64", "--width", "64", "--steps-c", "1", "--steps-b", "1",
            "--device", "cpu", "--no-previews", "--seed", "0"]
    capsys.readouterr()
    assert main([*args, "--stage-c-weights", str(run), "--no-ema", "--out", str(tmp_path / "g")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith(f"; Stage C from {run / 'generator.safetensors'} (the live weights))"), last
    assert main([*args, "--stage-c-weights", str(no_ema), "--ema", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{no_ema} has no generator_ema.safetensors (it kept no EMA)" in err[0], err
    for extra in ([], ["--stage-c-weights", str(models / "stage_c.safetensors")]):
        assert main([*args, *extra, "--ema", "--out", str(tmp_path / "f")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--ema/--no-ema (ema=True) choose among a training run's weights" in err[0], err
