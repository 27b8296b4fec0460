"""What `train(cfg)` really does with two reference-fidelity switches (issue 13, items 5 and 6), seen from inside a
tiny run: the shift Stage B diffuses and updates its adaptive buckets with (`stage_b_shift`), and the dtype of the
frozen encoders under bf16 autocast (`frozen_dtype`). Each runs in its own process (accelerate's state is global)."""
import json
import pytest
from conftest import ROOT, run_cli
from official_configs import OFFICIAL_CONFIGS

PROBE = r"""
import json, sys, torch
from cascade_nb.gdf.core import GDF
from cascade_nb.config import load_config
from cascade_nb.train import train
seen = {"diffuse": set(), "update": set(), "sample": set()}
_diffuse, _update, _sample = GDF.diffuse, GDF.update_buckets, GDF.sample
def diffuse(self, x0, *a, shift=1., loss_shift=1., **kw):
    if torch.is_grad_enabled(): seen["diffuse"].add((shift, loss_shift))  # training steps (previews run under no_grad)
    return _diffuse(self, x0, *a, shift=shift, loss_shift=loss_shift, **kw)
def update(self, logsnr, loss, beta=0.99, shift=1., loss_shift=1.):
    seen["update"].add((shift, loss_shift)); return _update(self, logsnr, loss, beta, shift=shift, loss_shift=loss_shift)
def sample(self, *a, shift=1., **kw):
    seen["sample"].add(shift); return _sample(self, *a, shift=shift, **kw)
GDF.diffuse, GDF.update_buckets, GDF.sample = diffuse, update, sample
out = train(load_config(sys.argv[1], sys.argv[2:]))
mode = out["mode"]
dtypes = {"text_model": next(mode.text_model.parameters()).dtype, "space": next(mode.space.parameters()).dtype}
if hasattr(mode, "effnet"): dtypes["effnet"] = next(mode.effnet.parameters()).dtype
print("PROBE " + json.dumps({"diffuse": sorted(seen["diffuse"]), "update": sorted(seen["update"]), "sample": sorted(seen["sample"]),
                             "dtypes": {k: str(v) for k, v in dtypes.items()}}))
"""

def probe(tmp_path, *overrides):
    name = "finetune_b_3b.yaml"
    (tmp_path / name).write_text(OFFICIAL_CONFIGS[name])
    res = run_cli("-c", PROBE, tmp_path / name, "model_version=tiny", "stage=b", "stage_a_checkpoint_path=tiny",
                  "effnet_checkpoint_path=tiny", "clip_text_model_name=tiny", "clip_image_model_name=null",
                  "generator_checkpoint_path=null", "wandb_project=null", "tracker=none", "use_fsdp=false",
                  "webdataset_path=" + str(ROOT / "data_samples" / "emoji"), "num_workers=0", "image_size=64",
                  "batch_size=2", "updates=1", "save_every=1", "sample_steps=1", "log_every=1",
                  f"checkpoint_path={tmp_path}/ckpt", f"output_path={tmp_path}/out", *overrides)
    line = next(l for l in res.stdout.splitlines() if l.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])

@pytest.mark.parametrize("option, want", [((), [1.0, 1.0]), (("stage_b_shift=config",), [4.0, 4.0])])
def test_stage_b_trains_at_the_reference_shift_unless_asked(tmp_path, option, want):
    "finetune_b_3b.yaml says shift: 4; train_b.py diffuses (and previews) at shift=1, loss_shift=1, and so do we by default."
    got = probe(tmp_path, "mixed_precision=no", *option)
    assert got["diffuse"] == [want] and got["update"] == [want] and got["sample"] == want[:1], got

@pytest.mark.parametrize("option, want", [((), "torch.float32"), (("frozen_dtype=bfloat16",), "torch.bfloat16")])
def test_frozen_encoders_stay_fp32_under_bf16_autocast(tmp_path, option, want):
    "The reference keeps EfficientNet / Stage A / CLIP in fp32 outside autocast; bf16 is a memory option."
    got = probe(tmp_path, "mixed_precision=bf16", *option)
    assert set(got["dtypes"]) == {"text_model", "space", "effnet"} and set(got["dtypes"].values()) == {want}, got

def test_memory_planner_counts_frozen_dtype():
    "fp32 frozen encoders by default (also under bf16 autocast); frozen_dtype=bfloat16 halves them and is a suggestion."
    from cascade_nb.memory import plan_memory, official_config, suggest
    key = "frozen encoders (clip_text, clip_image, effnet, previewer)"
    fp32, bf16 = plan_memory(official_config()).rows[key], plan_memory(official_config(frozen_dtype="bfloat16")).rows[key]
    assert fp32 == 2 * bf16 and fp32 / 1e9 > 4   # ~1.0B frozen parameters
    assert any(s.overrides.get("frozen_dtype") == "bfloat16" for s in suggest(official_config(), 24))
