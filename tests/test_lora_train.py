"""LoRA + token training through the real trainer CLI: the official LoRA YAML at tiny size, exact resume after a kill,
2-process DDP, and a frozen base."""
import json
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from conftest import ROOT, free_port, run_cli
from official_configs import OFFICIAL_CONFIGS
from test_train import resumes_to_the_killed_state

DRIVER = ROOT / "tests" / "train_driver.py"
TINY = ["model_version=tiny", "model_overrides={c_in: 3, c_out: 3, patch_size: 2}", "latent_space=pixels",
        "clip_text_model_name=tiny", "clip_image_model_name=null",
        "effnet_checkpoint_path=null", "previewer_checkpoint_path=null", "wandb_project=null", "tracker=none",
        "webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "image_size=32", "batch_size=4",
        "log_every=1", "lr=1e-3", "warmup_updates=2", "multi_aspect_ratio=null", "sample_steps=2", "use_fsdp=false"]
EXP = "stage_c_3b_lora"

def pretrained_tiny(path: Path) -> Path:
    "A tiny 'pretrained' Stage C: the official init zeroes the output conv, which would block every gradient to adapters."
    from cascade_nb.models.stage_c import StageC, save_stage_c
    if not path.exists():
        torch.manual_seed(0)
        model = StageC.from_preset("tiny", c_in=3, c_out=3, patch_size=2)
        with torch.no_grad(): model.clf[1].weight.normal_(std=0.1)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_stage_c(model, path)
    return path

def lora_args(tmp, name, *extra):
    cfg = Path(tmp) / "finetune_c_3b_lora.yaml"
    Path(tmp).mkdir(parents=True, exist_ok=True); cfg.write_text(OFFICIAL_CONFIGS["finetune_c_3b_lora.yaml"])
    return [cfg, *TINY, f"generator_checkpoint_path={pretrained_tiny(Path(tmp) / 'pretrained.safetensors')}",
            f"experiment_id={name}", f"checkpoint_path={tmp}/ckpt", f"output_path={tmp}/out", *extra]

def info(tmp, name):
    p = Path(tmp) / "ckpt" / name / "info.json"
    return json.loads(p.read_text()) if p.exists() else None

def released(tmp, name): return load_file(str(Path(tmp) / "ckpt" / name / "lora.safetensors"))

def assert_identical(a, b):
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"

def test_official_lora_config_trains_at_tiny_size(tmp_path):
    # one prompt at three adapter strengths (sample_prompts' adapter_scale, nbs/44_prompt_samples)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"text": "a [fernando] face", "seed": 0, "adapter_scale": {s}}}\n' for s in (0, 1, 2)))
    run_cli("-m", "cascade_nb.train", *lora_args(tmp_path, EXP, "updates=2", "save_every=2", f"sample_prompts={prompts}"),
            env={"OMP_NUM_THREADS": "1"})
    samples = tmp_path / "out" / EXP / "samples"
    png = lambda u, i: (samples / f"{u:06d}" / f"{i:02d}_a_fernando_face.png").read_bytes()
    assert png(0, 0) == png(0, 1) == png(0, 2)                               # fresh adapters (D = 0): no effect yet
    assert len({png(2, 0), png(2, 1), png(2, 2)}) == 3                        # trained: the scale changes the image
    assert info(tmp_path, EXP)["update"] == 2
    run = tmp_path / "ckpt" / EXP
    assert not (run / "generator.safetensors").exists()                     # only the adapters are released
    sd = released(tmp_path, EXP)
    ups = [k for k in sd if k.endswith(".lora_up")]
    assert len(ups) == 12 and all(sd[k].shape[1] == 4 for k in ups)         # 6 AttnBlocks × (in_proj, out_proj), rank 4
    assert sd["tokens.ids"].tolist() == [49408]
    assert json.loads(bytes(sd["tokens.names"].tolist()).decode()) == ["[fernando]"]
    downs = [k for k in sd if k.endswith(".lora_down")]
    assert all(sd[k].abs().sum() > 0 for k in downs)                         # the adapters moved (lora_init: reference, D = 0)
    assert (tmp_path / "out" / EXP / "000002.png").exists()

RUN = ["updates=6", "save_every=2"]
# prior preservation (issue 28): the instance shards with the new token, the class shards as regularisation samples whose
# target is the frozen base's prediction (nbs/60d_prior_preservation), at prior_loss_weight 0.5
EMOJI = ROOT / "data_samples" / "emoji"
PRIOR = [f"webdataset_path=[{{path: '{EMOJI}/shard-{{000000..000001}}.tar', caption_prefix: '[fernando] '}}, "
         f"{{path: '{EMOJI}/shard-{{000002..000005}}.tar', prior: true}}]", "prior_loss_weight=0.5",
         # and a density over the schedule's time (OneTrainer's SIGMOID) in a range whose lower edge moves
         "timestep_sampling=sigmoid_t", "t_density_weight=2", "logsnr_min=-6", "logsnr_min_end=-2"]

# the report card (cascade_nb.report) at tiny size: its stopping rule picks the kept update from the logged history
REPORT = ["eval_every=2", "eval_captions=2", "eval_metrics=[subject_fidelity, drift, diversity, prompt_fidelity]",
          "eval_clip_model=tiny", "eval_drift_prompts=[an emoji]", "eval_heldout_prompts=[a red car]", "eval_seeds=2",
          "best_metric=stopping_rule"]

def test_lora_resume_after_kill_is_bit_identical(tmp_path):
    """Killed committing update 4, resumed from update 2: it commits the killed process's own state of update 4 (with
    prior-prediction samples in the mixture, and the report card's kept update, rebuilt from the metrics logged up to
    update 2)."""
    resumes_to_the_killed_state(tmp_path / "ckpt" / "r", lora_args(tmp_path, "r", *RUN, *PRIOR, *REPORT))
    assert info(tmp_path, "r")["update"] == 6
    assert json.loads((tmp_path / "ckpt" / "r" / "best.json").read_text())["metric"] == "stopping_rule"
    assert_state_without_the_base(tmp_path / "ckpt" / "r", tmp_path / "pretrained.safetensors")
    # the base of a state without it must be the file it was trained on: a same-shaped other base is refused
    base = tmp_path / "pretrained.safetensors"
    with safe_open(str(base), "pt") as f: meta = f.metadata()
    save_file({k: v + 1 for k, v in load_file(str(base)).items()}, str(tmp_path / "other.safetensors"), metadata=meta)
    res = run_cli(DRIVER, *lora_args(tmp_path, "r", "updates=8", "save_every=2",
                                     f"generator_checkpoint_path={tmp_path / 'other.safetensors'}"), check=False)
    assert res.returncode != 0 and "they came from generator_checkpoint_path" in res.stderr, res.stderr[-2000:]
    assert info(tmp_path, "r")["update"] == 6

def assert_state_without_the_base(run_dir, base, adapted=12):
    """The committed state's model file holds the adapters and the token tensors only (a resume rebuilds the frozen
    generator from `generator_checkpoint_path`), and base.json fingerprints that file."""
    from cascade_nb.run_state import _saved_model_layout
    state = run_dir / json.loads((run_dir / "info.json").read_text())["state_dir"]
    _, saved = _saved_model_layout(state)
    tokens = "text_model.text_model.embeddings.token_embedding."
    assert saved and all(".lora_" in k or k.startswith(tokens) for k in saved), sorted(saved)
    assert sum(".lora_up" in k for k in saved) == adapted                   # all of them: the resume checks each one
    fp = json.loads((state / "base.json").read_text())["generator_checkpoint_path"]
    assert fp["path"] == str(base) and fp["bytes"] == base.stat().st_size

def test_dora_two_process_ddp(tmp_path):
    """The official LoRA config on 2 DDP processes with a token, prior samples and the report card, as DoRA (the type
    whose update depends on W and carries a magnitude vector; the default LoRA under DDP is the shipped lora_demo.yaml's
    run in tests/test_shipped_configs.py): the weights stay identical on both processes."""
    res = run_cli("-m", "accelerate.commands.launch", "--config_file", ROOT / "configs" / "accelerate" / "cpu_2proc.yaml",
                  "--main_process_port", str(free_port()), DRIVER, "--check-ddp-sync",
                  *lora_args(tmp_path, "ddp", "updates=2", "save_every=2", "batch_size=8", "adapter=dora", *PRIOR,
                             *REPORT),
                  env={"OMP_NUM_THREADS": "1"})
    assert res.stdout.count("weights identical on 2 processes") == 2, res.stdout[-2000:]
    i = info(tmp_path, "ddp")
    assert i["num_processes"] == 2 and i["update"] == 2 and i["config"]["adapter"] == "dora"
    sd = released(tmp_path, "ddp")
    assert "tokens.embeddings" in sd and sum(k.endswith(".dora_scale") for k in sd) == 12
    # the report card on 2 processes: one decision (broadcast), the rule's first update kept
    assert json.loads((tmp_path / "ckpt" / "ddp" / "best.json").read_text())["update"] == 2

def test_prior_samples_reach_the_loss_and_other_modes_refuse_them(tmp_path):
    """A `prior: true` entry's samples arrive marked (`priors`), the mode's extras carry the mask and prior_loss_weight,
    the loss targets the base's prediction there; a mode without a frozen base, and a stray prior_loss_weight, refuse."""
    import pytest
    from cascade_nb.config import config_from_dict, ConfigError
    from cascade_nb.data.pipeline import build_dataset
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.lora_training import LoraTraining
    src = [{"path": f"{EMOJI}/shard-000000.tar", "caption_prefix": "[fernando] "},
           {"path": f"{EMOJI}/shard-000002.tar", "prior": True, "weight": 3}]
    batches = [b for _, b in zip(range(8), build_dataset(src, 16, image_size=16, shuffle_buffer=64))]
    assert all(b["priors"] == [s == 1 for s in b["sources"]] for b in batches)
    batch = next(b for b in batches if 0 < sum(b["priors"]) < 16)   # a batch with both kinds
    base = dict(experiment_id="p", model_version="tiny", model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2},
                latent_space="pixels", clip_text_model_name="tiny", clip_image_model_name=None, image_size=16,
                webdataset_path=src, generator_checkpoint_path=str(pretrained_tiny(tmp_path / "pre.safetensors")))
    cfg = config_from_dict({**base, "module_filters": [".attn"], "train_tokens": [["[fernando]", "^dog</w>"]],
                            "prior_loss_weight": 0.25})
    gen = build_generator(cfg); tok, te = build_text_encoder(cfg)
    mode = LoraTraining(cfg, gen, tok, te, None, PixelSpace(), torch.float32)
    x0, conds = mode.encode(batch, "cpu", rng=torch.Generator().manual_seed(0))
    ex = mode.extras(batch, x0)
    assert ex["prior"].tolist() == batch["priors"]
    assert ex["weight"].flatten().tolist() == [0.25 if p else 1.0 for p in batch["priors"]]
    _, raw, _ = mode.loss(mode.net, gdf_from_config(cfg.gdf, cfg.recipe), x0, conds, rng=torch.Generator().manual_seed(1), **ex)
    assert (raw[ex["prior"]] == 0).all() and (raw[~ex["prior"]] > 0).all()   # fresh adapters: exactly the base's output
    with pytest.raises(ConfigError, match=r"webdataset_path\[1\]\.prior': mode 'full' has no frozen base"):
        config_from_dict(base, training=False)
    with pytest.raises(ConfigError, match=r"key 'prior_loss_weight': 0.5 weights .* no webdataset_path entry has"):
        config_from_dict({**base, "webdataset_path": src[:1], "module_filters": [".attn"], "prior_loss_weight": 0.5},
                         training=False)

def test_lora_step_leaves_the_base_frozen():
    "After optimizer steps of the mode's net, no base parameter has a gradient or moved; adapters and token rows did."
    from cascade_nb.config import config_from_dict
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace, diffusion_loss
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.adapters import base_state_dict
    from cascade_nb.lora_training import LoraTraining
    cfg = config_from_dict(dict(experiment_id="x", webdataset_path="data_samples/emoji", model_version="tiny",
                                model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2}, latent_space="pixels",
                                clip_text_model_name="tiny", clip_image_model_name=None, image_size=16, batch_size=2,
                                module_filters=[".attn", "kv_mapper"], rank=2, lora_dropout=0.1,
                                train_tokens=[["[fernando]", "^dog</w>"], ["^cat</w>", ""]]))   # init regex null (official example) is refused by config.py: see report
    torch.manual_seed(0)
    gen = build_generator(cfg); tok, te = build_text_encoder(cfg)
    with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)              # as if pretrained (official init: zero output)
    mode = LoraTraining(cfg, gen, tok, te, None, PixelSpace())
    base_before = {k: v.clone() for k, v in base_state_dict(gen).items()}
    emb_before = te.get_input_embeddings().base.weight.clone()
    opt = torch.optim.AdamW([p for p in mode.net.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    x0, conds = mode.encode({"images": torch.rand(2, 3, 16, 16), "captions": ["a [fernando]", "a cat"]}, "cpu",
                            rng=torch.Generator().manual_seed(0))
    for step in range(2):
        loss, _, _ = diffusion_loss(mode.net, gdf_from_config(cfg.gdf), x0, conds, rng=torch.Generator().manual_seed(step))
        loss.backward()
        with_grad = {n for n, p in mode.net.named_parameters() if p.grad is not None}
        assert with_grad and all(".lora_" in n or n.endswith("token_embedding.delta") for n in with_grad), sorted(with_grad)[:5]
        opt.step(); opt.zero_grad()
    assert all(torch.equal(base_before[k], v) for k, v in base_state_dict(gen).items())
    assert torch.equal(te.get_input_embeddings().base.weight, emb_before)     # base rows untouched (weight decay too)
    rows = te.get_input_embeddings().rows()
    assert not torch.equal(rows, emb_before[te.get_input_embeddings().ids])   # the selected rows trained

def token_captions(folder: Path, n: int = 8) -> Path:
    "A folder of emoji whose captions hold the trained token (the token gets gradients only where a caption has it)."
    import tarfile
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(ROOT / "data_samples" / "emoji" / "shard-000005.tar") as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            if int(key) >= 320 + n or ext == "json": continue
            data = tar.extractfile(m).read()
            (folder / m.name).write_bytes(b"a [fernando] " + data if ext == "txt" else data)
    return folder

def test_lora_with_tokens_samples_from_the_cli(tmp_path):
    "Tutorial 02's last step: `python -m cascade_nb.sample` takes a LoRA run with train_tokens and uses its trained token."
    from cascade_nb.sample import load_run, sample_run
    from cascade_nb.modes import build_text_encoder
    from cascade_nb.train_tokens import add_train_tokens
    run_cli("-m", "cascade_nb.train", *lora_args(tmp_path, "tok", "updates=2", "save_every=2", "lr=1e-2",
                                                 f"webdataset_path={token_captions(tmp_path / 'data')}"), env={"OMP_NUM_THREADS": "1"})
    run = tmp_path / "ckpt" / "tok"
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", run, "--prompt", "a [fernando] face", "--n", "1",
                  "--steps", "2", "--out", tmp_path / "samples")
    assert "wrote 1 images" in res.stdout and (tmp_path / "samples" / "0_0_a_fernando_face.png").is_file(), res.stdout
    mode, gdf, cfg = load_run(run)
    trained = released(tmp_path, "tok")["tokens.embeddings"][0]
    fid = mode.tokenizer.convert_tokens_to_ids("[fernando]")
    assert fid == 49408 and mode.tokenizer("[fernando]").input_ids[1] == fid            # one token, the trained one
    row = mode.text_model.get_input_embeddings().weight[fid]
    assert torch.equal(row, trained.to(row))                                             # the sampler's row: the trained one
    tok, te = build_text_encoder(cfg)
    start = add_train_tokens(tok, te, cfg.lora.train_tokens) and te.get_input_embeddings().rows()[0]
    assert not torch.allclose(start, trained)                                            # which moved from its start
    a = sample_run(mode, gdf, cfg, ["a [fernando] face"], n=1, steps=2)
    with torch.no_grad(): mode.text_model.get_input_embeddings().weight[fid] = start
    b = sample_run(mode, gdf, cfg, ["a [fernando] face"], n=1, steps=2)
    assert not torch.equal(a, b)                                                         # the trained row changes the sample

def test_lora_with_tokens_in_the_pipeline_and_generate(tmp_path):
    "`CascadePipeline.from_dir(stage_c_weights=RUN)` and `python -m cascade_nb.generate --stage-c-weights RUN` add the run's tokens."
    from cascade_nb.inference import write_tiny_checkpoints, CascadePipeline
    models = write_tiny_checkpoints(tmp_path / "models")
    cfg = Path(tmp_path) / "lora.yaml"; cfg.write_text(OFFICIAL_CONFIGS["finetune_c_3b_lora.yaml"])
    run_cli("-m", "cascade_nb.train", cfg, "model_version=tiny", "latent_space=effnet", "effnet_checkpoint_path=tiny",
            "previewer_checkpoint_path=tiny", "clip_text_model_name=tiny", "clip_image_model_name=null", "wandb_project=null",
            "tracker=none", f"webdataset_path={token_captions(tmp_path / 'data')}", "num_workers=0", "image_size=64",
            "batch_size=4", "multi_aspect_ratio=null", "sample_steps=2", "use_fsdp=false", "updates=2", "save_every=2",
            "lr=1e-2", f"generator_checkpoint_path={models / 'stage_c.safetensors'}", "experiment_id=tok",
            f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out", env={"OMP_NUM_THREADS": "1"})
    run = tmp_path / "ckpt" / "tok"
    trained = load_file(str(run / "lora.safetensors"))["tokens.embeddings"][0]
    pipe = CascadePipeline.from_dir(models, stage_c_weights=run, device="cpu", dtype="float32", offload=True)
    for _ in range(2):   # offload: the text encoder is loaded again, and gets the token again
        with pipe.use("text_model") as te: row = te.get_input_embeddings().weight[pipe.tokenizer.convert_tokens_to_ids("[fernando]")]
        assert torch.equal(row, trained)
    res = run_cli("-m", "cascade_nb.generate", "a [fernando] face", "--models", models, "--stage-c-weights", run,
                  "--out", tmp_path / "gen", "--seed", "1", "--height", "128", "--width", "128", "--steps-c", "2",
                  "--steps-b", "2", "--device", "cpu", "--no-previews")
    assert res.stdout.strip().splitlines()[-1].startswith("wrote 1 image(s)"), res.stdout
