"""The EMA of a LoRA run (adapters and token rows, not the frozen generator) through the trainer: after N updates it
equals an EMA computed by hand from the weights of every update (tests/train_driver.py --ema-probe), it is released as
`lora_ema.safetensors` in the layout of `lora.safetensors` and is what `load_run` (the sample and eval CLIs) picks,
sampling with it during training leaves the live adapters as they were bit for bit, and a run killed in its commit
resumes to the same state, file for file (one process, and two processes under FSDP2 on gloo). The trainer runs are the
shared runs of tests/test_lora_runs.py, checked with the helpers here; ControlNet's EMA is checked on the 2-process
run of tests/test_controlnet_train.py."""
import json, re
from pathlib import Path
import torch
from safetensors.torch import load_file

EMA_KEYS = ["updates=4", "save_every=2", "ema_start_iters=1", "ema_iters=1", "ema_beta=0.9"]   # a copy, then 3 steps

TOKENS = "text_model.text_model.embeddings.token_embedding."

def probed(launch, reference: Path, results: list):
    """`launch` with the EMA probe on the launch that is killed: it records the EMA by hand of updates 1-4 and each
    EMA update's collectives; its result goes into `results`."""
    def run(*a, check=True):
        res = launch(*(["--ema-probe", str(reference)] if "--kill-in-commit" in a else []), *a, check=check)
        if "--kill-in-commit" in a: results.append(res)
        return res
    return run

def ema_comms(stdout: str) -> list[tuple]:
    "(rank, EMA update, collectives) of each EMA update the probe saw."
    seen = map(json.loads, re.findall(r"ema-comms (\{.*?\})", stdout))
    return sorted((d["rank"], d["call"], d["comms"]) for d in seen)

def by_hand(reference: dict, tokens: dict) -> dict:
    """The probe's EMA of the named parameters, in `lora.safetensors`' layout: the adapters under their weight's path,
    the token rows as the frozen embedding's rows plus the averaged delta."""
    out = {}
    for k, v in reference.items():
        # the generator's under their path in it, the text encoder's (when it has adapters) under text_model.
        if m := re.fullmatch(r"(?:generator\.)?(.+)\.parametrizations\.([^.]+)\.0\.(lora_down|lora_up)", k):
            out[f"{m[1]}.{m[2]}.{m[3]}"] = v
    ids = tokens["tokens.ids"]
    out["tokens.embeddings"] = reference[TOKENS + "base.weight"][ids].float() + reference[TOKENS + "delta"].float()
    return out

def assert_released_ema_is_the_ema(run_dir: Path, reference: Path, adapted: int):
    ema, live = load_file(str(run_dir / "lora_ema.safetensors")), load_file(str(run_dir / "lora.safetensors"))
    assert ema.keys() == live.keys()                                            # the same layout, tokens included
    want = by_hand(load_file(str(reference)), ema)
    assert sum(k.endswith(".lora_up") for k in want) == adapted and want.keys() < ema.keys()
    differ = [k for k in want if not torch.equal(ema[k], want[k])]
    assert not differ, f"{len(differ)} tensors differ from the EMA by hand, e.g. {differ[:3]}"
    assert not torch.equal(ema["tokens.embeddings"], live["tokens.embeddings"])  # an average, not the last weights
    assert not all(torch.equal(ema[k], live[k]) for k in want if ".lora_" in k)
    assert all(torch.equal(ema[k], live[k]) for k in ("tokens.ids", "tokens.names"))

def state_ema_keys(run_dir: Path) -> list[str]:
    state = run_dir / json.loads((run_dir / "info.json").read_text())["state_dir"]
    if (state / "ema.safetensors").exists(): return sorted(load_file(str(state / "ema.safetensors")))
    from torch.distributed.checkpoint import FileSystemReader
    return sorted(FileSystemReader(str(state / "ema")).read_metadata().state_dict_metadata)

def assert_ema_of_trained_tensors_only(run_dir: Path, adapted: int):
    keys = state_ema_keys(run_dir)
    assert all(".lora_" in k or k == TOKENS + "delta" for k in keys), keys[:5]
    assert sum(".lora_" in k for k in keys) == 2 * adapted and TOKENS + "delta" in keys   # adapters (down, up), rows

def test_sampling_with_the_lora_ema_restores_the_live_adapters():
    """The sample grid's EMA row: the EMA's adapters and token rows lent to the live net, which gets its own back bit
    for bit; the row is the one a net holding the EMA's tensors samples."""
    import copy
    from types import SimpleNamespace
    from cascade_nb.config import config_from_dict
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace
    from cascade_nb.run_data import sample_rows
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.lora_training import LoraTraining
    from cascade_nb.run_state import EMA
    cfg = config_from_dict(dict(experiment_id="x", webdataset_path="data_samples/emoji", model_version="tiny",
                                model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2}, latent_space="pixels",
                                clip_text_model_name="tiny", clip_image_model_name=None, image_size=16, batch_size=2,
                                module_filters=[".attn"], rank=2, train_tokens=[["[fernando]", "^dog</w>"]],
                                sample_steps=2, ema_start_iters=0, ema_beta=0.5))
    torch.manual_seed(0)
    gen = build_generator(cfg); tok, te = build_text_encoder(cfg)
    with torch.no_grad(): gen.clf[1].weight.normal_(std=0.1)   # as if pretrained (official init: zero output)
    mode = LoraTraining(cfg, gen, tok, te, None, PixelSpace())
    net, gdf = mode.net, gdf_from_config(cfg.gdf)
    ema = EMA(net, "cpu", trained_only=True)
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    assert list(ema.state_dict()) == list(trained)                              # adapters and the token delta only
    with torch.no_grad():
        for p in trained.values(): p.add_(torch.randn_like(p) * 0.1)            # "training steps"
    ema.update_(net, 0.5)
    live = {k: v.clone() for k, v in net.state_dict().items()}
    x0, conds = mode.encode({"images": torch.rand(2, 3, 16, 16), "captions": ["a [fernando]", "a cat"]}, "cpu",
                            training=False)
    mode.set_training(net, False)
    latents = SimpleNamespace(decode=lambda x: x)   # the rows undecoded: pixel space would clamp them to [0, 1]
    rows = sample_rows(net, ema, gdf, latents, x0, conds, mode.uncond(conds), cfg, n=2)
    assert all(torch.equal(v, live[k]) for k, v in net.state_dict().items())   # the live weights, bit for bit
    averaged = copy.deepcopy(net)
    with torch.no_grad():
        for n, p in averaged.named_parameters():
            if n in ema.shards: p.copy_(ema.shards[n])
    want = sample_rows(averaged, None, gdf, latents, x0, conds, mode.uncond(conds), cfg, n=2)["sampled"]
    assert torch.equal(rows["sampled (EMA)"], want) and not torch.equal(rows["sampled (EMA)"], rows["sampled"])

