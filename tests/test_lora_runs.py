"""Two tiny LoRA runs that carry every adapter-side feature at once, shared by the tests of each feature (a run is the
cost; the assertions are cheap): configs/lora_demo.yaml with a trained token, adapters on the CLIP text encoder
(nbs/60c_lora_converters), parameter groups at their own lr and weight decay (nbs/40a_optimizers) and the EMA of the
trained tensors, each run killed inside its commit of update 4 and resumed, with the EMA probe on the killed launch
(tests/train_driver.py --ema-probe: the EMA by hand of every update's weights, and the collectives of each EMA update).

- one process: groups logged and saved per group, the resume bit-identical, the state without the frozen base, the
  released EMA equal to the EMA by hand, the loss on the training images lower, the kohya export read by ComfyUI's rules
  with our ΔW (the text encoder's `lora_te_` keys too), the sample CLI sampling with the EMA merged; then (last, they
  move the run on) a relaunch with other groups refused in one line and one with other group settings resumed;
- two processes under FSDP2 (gloo): the same resume, each process holding its shards of the trained tensors only (state
  and EMA, updated with no collective), the released files gathered.

The features' other tests (refusals, layouts, fused_backward, ControlNet's EMA) stay in test_param_groups.py,
test_te_adapters.py and test_lora_ema.py."""
from pathlib import Path
import pytest
import torch
from safetensors.torch import load_file
from conftest import run_cli
from test_lora_train import DRIVER, info, assert_state_without_the_base
from test_train import resumes_to_the_killed_state, _launch_2proc
from test_param_groups import metrics, optimizer_groups_saved
from test_lora_ema import probed, ema_comms, assert_released_ema_is_the_ema, assert_ema_of_trained_tensors_only
from test_te_adapters import te_args, fixed_batch, loss_on, TE_UP

AD, TOK, TOK_WD, TE = 2e-3, 1e-2, 0.0, 5e-3    # lr of the generator's adapters, the token rows (and their wd), the TE's
GROUPS = (f"param_groups={{adapters: {{lr: {AD}}}, tokens: {{lr: {TOK}, weight_decay: {TOK_WD}}}, "
          f"text_encoder_adapters: {{lr: {TE}}}}}")
UPDATES = 4    # saved at 2 and 4; killed committing 4, resumed from 2

def shared_run(tmp: Path, name: str, launch, *extra):
    "The run killed in its commit of update 4 (the probe on it) and resumed: (run dir, resumed, killed, reference)."
    run, reference, killed = tmp / "ckpt" / name, tmp / f"{name}_reference.safetensors", []
    argv = te_args(tmp, name, f"updates={UPDATES}", GROUPS, *extra)
    resumed = resumes_to_the_killed_state(run, argv, launch=probed(launch, reference, killed))
    return run, resumed, killed[0], reference

@pytest.fixture(scope="module")
def one(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    return (tmp, *shared_run(tmp, "one", lambda *a, check=True: run_cli(DRIVER, *a, check=check)))

@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    launch = lambda *a, check=True: _launch_2proc("--fsdp-cpu", *a, check=check)
    return (tmp, *shared_run(tmp, "f", launch, "batch_size=8", "ema_on_cpu=true"))

def test_groups_train_at_their_own_lr_logged_and_saved(one):
    tmp, run, resumed, _, _ = one
    assert info(tmp, "one")["update"] == UPDATES
    out = resumed.stdout
    assert "parameter groups: adapters" in out and f"tokens 64 parameters at lr {TOK:g}" in out, out[-2000:]
    # after the warm-up (2 updates, linear) the constant schedule: each group at its own lr
    m = metrics(tmp / "out" / "one")
    for group, lr in (("adapters", AD), ("tokens", TOK), ("text_encoder_adapters", TE)):
        assert [m[u][f"lr/{group}"] for u in (1, 2, UPDATES)] == [lr / 2, lr, lr], group
    assert m[UPDATES]["lr"] == m[UPDATES]["lr/adapters"]                      # `lr` stays the first group's
    assert [(g["group"], g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer_groups_saved(run)] == [
        ("adapters", AD, 0.01, 24), ("tokens", TOK, TOK_WD, 1), ("text_encoder_adapters", TE, 0.01, 24)]
    assert info(tmp, "one")["optimizer_groups"] == [["adapters", 1.0, 24], ["tokens", 1.0, 1],
                                                    ["text_encoder_adapters", 1.0, 24]]

def test_state_holds_the_trained_tensors_only(one):
    "The state: adapters (the generator's and the text encoder's 12 weights each) and token rows, never the frozen base."
    tmp, run, *_ = one
    assert_state_without_the_base(run, tmp / "base.safetensors", adapted=24)
    assert_ema_of_trained_tensors_only(run, adapted=24)

def test_ema_is_the_ema_by_hand_and_sampled_with(one):
    """The killed launch made an EMA update after each update; the released EMA (the text encoder's adapters among its
    tensors) is the EMA by hand; `load_run` samples with it (its adapters and token row), or with `lora.safetensors`
    when asked (--no-ema)."""
    from cascade_nb.sample import load_run
    tmp, run, _, killed, reference = one
    assert [u for _, u, _ in ema_comms(killed.stdout)] == [1, 2, 3, 4]
    assert_released_ema_is_the_ema(run, reference, adapted=24)
    ema, live = load_file(str(run / "lora_ema.safetensors")), load_file(str(run / "lora.safetensors"))
    assert not torch.equal(ema[TE_UP], live[TE_UP])
    for use_ema, name in ((True, "lora_ema.safetensors"), (False, "lora.safetensors")):
        mode, _, _ = load_run(run, ema=use_ema)
        assert mode.weights_file.name == name
        row = mode.text_model.get_input_embeddings().weight[mode.tokenizer.convert_tokens_to_ids("[fernando]")]
        assert torch.equal(row, load_file(str(run / name))["tokens.embeddings"][0].to(row))

def test_trained_adapters_lower_the_loss_export_and_sample(one):
    """The loss on the training images at fixed noise is lower with the trained adapters and token than with fresh ones;
    the kohya/ComfyUI export gives ComfyUI's reader the ΔW we merge into each Stage C and CLIP weight, and reads back as
    a source with its text-encoder adapters (peft has no place for them); the sample CLI samples with the EMA, whose
    text encoder has the adapters merged."""
    from cascade_nb.adapter_readers import read_comfyui, consumer_params, cascade_nb_deltas, delta_error
    from cascade_nb.adapter_exports import export_adapter, read_source, source_lora
    from cascade_nb.adapters import base_state_dict
    from cascade_nb.lora_file import lora_entries, lora_delta
    from cascade_nb.lora_converters import split_text_encoder
    from cascade_nb.models.stage_c import StageC
    from cascade_nb.sample import run_config, load_run
    from cascade_nb.modes import build_text_encoder
    tmp, run, *_ = one
    lora = load_file(str(run / "lora.safetensors"))
    gen_part, te_part = split_text_encoder({k: v for k, v in lora.items() if not k.startswith("tokens.")})
    assert len(lora_entries(gen_part)) == 12 and len(lora_entries(te_part)) == 12
    assert {d.shape[0] for d, _, _ in lora_entries(te_part).values()} == {2}   # text_encoder_rank
    cfg, base = run_config(run), tmp / "base.safetensors"
    batch = fixed_batch(tmp / "data")
    fresh, trained = loss_on(cfg, base, batch), loss_on(cfg, base, batch, run / "lora.safetensors")
    print(f"loss on the fixed batch at fixed noise: fresh {fresh:.4f}, trained {trained:.4f}")
    assert trained < fresh, (fresh, trained)
    out, _ = export_adapter(lora, "kohya", tmp / "kohya.safetensors")
    ko = load_file(str(out[0]))
    assert sum(k.startswith("lora_te_text_model_encoder_layers_") and k.endswith(".lora_up.weight") for k in ko) == 12
    _, text_model = build_text_encoder(cfg)
    gen = StageC.from_preset("tiny", c_in=3, c_out=3, patch_size=2)
    rd = read_comfyui(ko, consumer_params(gen, text_model))
    expected = {**cascade_nb_deltas(gen_part, base_state_dict(gen)),
                **{f"text_encoder.{k}": v for k, v in cascade_nb_deltas(te_part, base_state_dict(text_model)).items()}}
    assert not rd.skipped and delta_error(rd, expected) < 1e-6, (rd.skipped[:4], delta_error(rd, expected))
    back = source_lora(read_source(out[0]), gen)
    assert {k for k in back if k.startswith("text_model.")} == {k for k in lora if k.startswith("text_model.")}
    with pytest.raises(ValueError, match="text-encoder weights"):
        export_adapter(lora, "peft", tmp / "peft")
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "a [fernando] face", "--n", "1",
                  "--steps", "2", "--out", tmp / "samples")
    assert "wrote 1 images" in res.stdout and res.stdout.strip().endswith(f"from {run / 'lora_ema.safetensors'} (the EMA)"), \
        res.stdout[-1000:]
    mode, _, _ = load_run(run, ema=False)
    p = "text_model.encoder.layers.1.mlp.fc1.weight"
    want = text_model.get_parameter(p) + lora_delta(*lora_entries(te_part)[p], text_model.get_parameter(p).shape)
    assert torch.allclose(mode.text_model.get_parameter(p), want, atol=1e-6)
    assert not torch.allclose(want, text_model.get_parameter(p))

# the two tests below move the run on: they come last
def test_a_relaunch_with_other_groups_is_refused_in_one_line(one):
    tmp, *_ = one
    res = run_cli(DRIVER, *te_args(tmp, "one", "updates=6", GROUPS, "lr_multipliers={down_blocks: 0.5}"), check=False)
    err = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0 and "its optimizer holds the groups adapters x1 (24 tensors), tokens x1 (1 tensors), " \
        "text_encoder_adapters x1 (24 tensors), and this run builds adapters x0.5" in err, res.stderr[-2000:]
    assert info(tmp, "one")["update"] == UPDATES

def test_the_same_groups_at_other_settings_resume(one):
    "The same groups at other settings: it resumes, and each group trains at its new lr and weight decay from there."
    tmp, run, *_ = one
    now = (f"param_groups={{adapters: {{lr: {AD}}}, tokens: {{lr: 2e-2, weight_decay: 0.05}}, "
           f"text_encoder_adapters: {{lr: {TE}}}}}")
    res = run_cli(DRIVER, *te_args(tmp, "one", "updates=6", now))
    assert "resumed with other settings than the checkpoint's: param_groups" in res.stdout
    assert metrics(tmp / "out" / "one")[6]["lr/tokens"] == 2e-2
    assert [(g["lr"], g["weight_decay"]) for g in optimizer_groups_saved(run)] == [(AD, 0.01), (2e-2, 0.05), (TE, 0.01)]

def test_fsdp2_shards_the_trained_tensors_and_releases_them_gathered(fsdp2):
    """Under FSDP2 each process keeps its shards of the trained tensors only (state and EMA, on the CPU, updated with no
    collective); the killed run resumed to the same state file for file (the fixture); the released files hold the
    gathered tensors, and the EMA is the EMA by hand of the gathered weights."""
    from cascade_nb.lora_file import lora_entries
    from cascade_nb.lora_converters import split_text_encoder
    tmp, run, _, killed, reference = fsdp2
    assert ema_comms(killed.stdout) == [(r, u, 0) for r in (0, 1) for u in (1, 2, 3, 4)]   # no collective
    state = run / info(tmp, "f")["state_dir"]
    assert (state / "pytorch_model_fsdp_0").is_dir() and not (state / "ema.safetensors").exists()
    assert sorted(p.name for p in (state / "ema").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert_state_without_the_base(run, tmp / "base.safetensors", adapted=24)
    assert_ema_of_trained_tensors_only(run, adapted=24)
    assert_released_ema_is_the_ema(run, reference, adapted=24)
    te_part = split_text_encoder(load_file(str(run / "lora.safetensors")))[1]
    assert len(lora_entries(te_part)) == 12 and all(d.abs().sum() > 0 for d, _, _ in lora_entries(te_part).values())
