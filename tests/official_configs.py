"""The official StableCascade training YAMLs (configs/training/*.yaml of Stability-AI/StableCascade), written out
with their own keys and values (paths are the placeholders the originals ship with), so tests can check that users'
files load unchanged and, with local paths and a tiny model, start training."""

_COMMON = """
checkpoint_path: /path/to/checkpoint
output_path: /path/to/output
wandb_project: StableCascade
wandb_entity: wandb_username
lr: 1.0e-4
warmup_updates: 1
# ema_start_iters: 5000
# ema_iters: 100
# ema_beta: 0.9
webdataset_path:
  - s3://path/to/your/first/dataset/on/s3
  - s3://path/to/your/second/dataset/on/s3
effnet_checkpoint_path: models/effnet_encoder.safetensors
"""
_RATIOS = "multi_aspect_ratio: [1/1, 1/2, 1/3, 2/3, 3/4, 1/5, 2/5, 3/5, 4/5, 1/6, 5/6, 9/16]\n"
_CNET = """
model_version: 3.6B
batch_size: 256
image_size: 768
# multi_aspect_ratio: [1/1, 1/2, 1/3, 2/3, 3/4, 1/5, 2/5, 3/5, 4/5, 1/6, 5/6, 9/16]
grad_accum_steps: 1
use_fsdp: True
previewer_checkpoint_path: models/previewer.safetensors
generator_checkpoint_path: models/stage_c_bf16.safetensors
captions_getter: ['txt', identity]
dataset_filters:
  - ['width', 'lambda w: w >= 768']
  - ['height', 'lambda h: h >= 768']
controlnet_blocks: [0, 4, 8, 12, 51, 55, 59, 63]
"""

OFFICIAL_CONFIGS = {
    "finetune_c_3b.yaml": "experiment_id: stage_c_3b_finetuning\nmodel_version: 3.6B\nbatch_size: 512\nimage_size: 768\n"
        + _RATIOS + "grad_accum_steps: 1\nupdates: 100000\nbackup_every: 20000\nsave_every: 2000\nuse_fsdp: True\n"
        "adaptive_loss_weight: True\npreviewer_checkpoint_path: models/previewer.safetensors\n"
        "generator_checkpoint_path: models/stage_c_bf16.safetensors\n" + _COMMON,
    "finetune_c_3b_lowres.yaml": "experiment_id: stage_c_3b_finetuning\nmodel_version: 3.6B\nbatch_size: 1024\nimage_size: 384\n"
        + _RATIOS + "grad_accum_steps: 1\nupdates: 100000\nbackup_every: 20000\nsave_every: 2000\nuse_fsdp: True\n"
        "adaptive_loss_weight: True\n# captions_getter: ['json', captions_getter]\n# dataset_filters:\n"
        "#   - ['normalized_score', 'lambda s: s > 9.0']\n#   - ['pgen_normalized_score', 'lambda s: s > 3.0']\n"
        "previewer_checkpoint_path: models/previewer.safetensors\ngenerator_checkpoint_path: models/stage_c_bf16.safetensors\n" + _COMMON,
    "finetune_c_3b_v.yaml": "experiment_id: stage_c_3b_finetuning\nmodel_version: 3.6B\nbatch_size: 512\nimage_size: 768\n"
        + _RATIOS + "grad_accum_steps: 1\nupdates: 100000\nbackup_every: 20000\nsave_every: 2000\nuse_fsdp: True\n"
        "adaptive_loss_weight: True\nedm_objective: True\npreviewer_checkpoint_path: models/previewer.safetensors\n"
        "generator_checkpoint_path: models/stage_c_bf16.safetensors\n" + _COMMON,
    "finetune_c_1b.yaml": "experiment_id: stage_c_1b_finetuning\nmodel_version: 1B\nbatch_size: 1024\nimage_size: 768\n"
        "# " + _RATIOS + "grad_accum_steps: 1\nupdates: 10000\nbackup_every: 20000\nsave_every: 2000\nuse_fsdp: True\n"
        "# adaptive_loss_weight: True\npreviewer_checkpoint_path: models/previewer.safetensors\n"
        "generator_checkpoint_path: models/stage_c_lite_bf16.safetensors\n" + _COMMON,
    "finetune_c_3b_lora.yaml": "experiment_id: stage_c_3b_lora\nmodel_version: 3.6B\nbatch_size: 32\nimage_size: 768\n"
        + _RATIOS + "grad_accum_steps: 4\nupdates: 10000\nbackup_every: 1000\nsave_every: 100\nuse_fsdp: False\n"
        "module_filters: ['.attn']\nrank: 4\ntrain_tokens:\n  # - ['^snail', null]\n  - ['[fernando]', '^dog</w>']\n"
        "previewer_checkpoint_path: models/previewer.safetensors\ngenerator_checkpoint_path: models/stage_c_bf16.safetensors\n" + _COMMON,
    "finetune_b_3b.yaml": "experiment_id: stage_b_3b_finetuning\nmodel_version: 3B\nbatch_size: 256\nimage_size: 1024\n"
        "# " + _RATIOS + "shift: 4\ngrad_accum_steps: 1\nupdates: 100000\nbackup_every: 20000\nsave_every: 1000\nuse_fsdp: True\n"
        "adaptive_loss_weight: True\nstage_a_checkpoint_path: models/stage_a.safetensors\n"
        "generator_checkpoint_path: models/stage_b_bf16.safetensors\n" + _COMMON,
    "finetune_b_700m.yaml": "experiment_id: stage_b_700m_finetuning\nmodel_version: 700M\nbatch_size: 512\nimage_size: 1024\n"
        "# " + _RATIOS + "shift: 4\ngrad_accum_steps: 1\nupdates: 10000\nbackup_every: 20000\nsave_every: 2000\nuse_fsdp: True\n"
        "adaptive_loss_weight: True\nstage_a_checkpoint_path: models/stage_a.safetensors\n"
        "generator_checkpoint_path: models/stage_b_lite_bf16.safetensors\n" + _COMMON,
    "controlnet_c_3b_canny.yaml": "experiment_id: stage_c_3b_controlnet_canny\nupdates: 10000\nbackup_every: 2000\nsave_every: 1000\n"
        + _CNET + "controlnet_filter: CannyFilter\ncontrolnet_filter_params:\n  resize: 224\n# offset_noise: 0.1\n" + _COMMON,
    "controlnet_c_3b_inpainting.yaml": "experiment_id: stage_c_3b_controlnet_inpainting\nupdates: 10000\nbackup_every: 2000\nsave_every: 1000\n"
        + _CNET + "controlnet_filter: InpaintFilter\ncontrolnet_filter_params:\n  thresold: [0.04, 0.4]\n  p_outpaint: 0.4\noffset_noise: 0.1\n" + _COMMON,
    "controlnet_c_3b_sr.yaml": "experiment_id: stage_c_3b_controlnet_sr\nupdates: 30000\nbackup_every: 5000\nsave_every: 1000\n"
        + _CNET + "controlnet_bottleneck_mode: 'large'\ncontrolnet_filter: SREffnetFilter\ncontrolnet_filter_params:\n  scale_factor: 0.5\noffset_noise: 0.1\n" + _COMMON,
    "controlnet_c_3b_identity.yaml": "experiment_id: stage_c_3b_controlnet_identity\nupdates: 200000\nbackup_every: 2000\nsave_every: 1000\n"
        + _CNET.replace("controlnet_blocks: [0, 4, 8, 12, 51, 55, 59, 63]", "controlnet_blocks: [" + ", ".join(map(str, range(64))) + "]")
        + "controlnet_bottleneck_mode: 'simple'\ncontrolnet_filter: IdentityFilter\ncontrolnet_filter_params:\n  max_faces: 4\n  p_drop: 0.05\n  p_full: 0.3\n" + _COMMON,
}

OFFICIAL_KEYS = """experiment_id checkpoint_path output_path model_version wandb_project wandb_entity lr batch_size image_size
multi_aspect_ratio grad_accum_steps updates backup_every save_every warmup_updates use_fsdp adaptive_loss_weight
ema_start_iters ema_iters ema_beta shift offset_noise dtype webdataset_path dataset_filters captions_getter module_filters
rank train_tokens controlnet_blocks controlnet_filter controlnet_filter_params controlnet_bottleneck_mode
effnet_checkpoint_path previewer_checkpoint_path generator_checkpoint_path stage_a_checkpoint_path edm_objective""".split()
