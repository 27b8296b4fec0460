#!/usr/bin/env python
"""Few-step students against their teacher (issue 15's evidence), on the README demo.

From the same initial noise for each of the demo's 32 captions: teacher DDPM@20, DDIM@20, DDIM@4 (CFG 3, as the demo
samples), each lcm student (a phased one, as configs/lcm_demo.yaml trains by default, at DDIM@phases; a plain LCM one
at 4/2/1 LCM steps) and the progressive student at its steps (CFG 1: guidance is distilled in).
For each: RMS pixel distance to teacher DDIM@20, that distance relative to teacher DDIM@4, caption retrieval top-1
against the demo's training images (cascade_nb.eval), network evaluations and seconds per image. The table is
`cascade_nb.fast_sampling.sampler_table`, the code nbs/63_fast_sampling.ipynb runs at tiny size.

    accelerate launch cascade_nb/train.py configs/demo.yaml                                   # the teacher
    accelerate launch cascade_nb/train.py configs/lcm_demo.yaml                               # the phased student (4 phases)
    python bench/fast_sampling.py --teacher checkpoints/demo --lcm checkpoints/lcm_demo --seeds 0 1 2   # bench/RESULTS.md

Other students to compare (bench/RESULTS.md, "fast_sampling"): the plain LCM student and a progressive one
    accelerate launch cascade_nb/train.py configs/lcm_demo.yaml phases=1 solver_steps=20 solver_substeps=1 student_rollout=0 batch_size=16 lr_schedule=constant updates=400 experiment_id=lcm_plain
    accelerate launch cascade_nb/train.py configs/lcm_demo.yaml mode=progressive experiment_id=pd_demo teacher_steps=8
    python bench/fast_sampling.py --teacher checkpoints/demo --lcm checkpoints/lcm_demo checkpoints/lcm_plain --progressive checkpoints/pd_demo
"""
import argparse, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cascade_nb.config import load_config
from cascade_nb.fast_sampling import sampler_table, format_table, fast_sampling_entries
from cascade_nb.eval import reference_set

p = argparse.ArgumentParser()
p.add_argument("--teacher", default="checkpoints/demo")
p.add_argument("--lcm", nargs="+", default=[], help="lcm student runs (LCM or phased)")
p.add_argument("--progressive", default=None)
p.add_argument("--seeds", type=int, nargs="+", default=[0])
p.add_argument("--threads", type=int, default=1)
a = p.parse_args()
torch.set_num_threads(a.threads)
root = Path(__file__).resolve().parents[1]
ref_images, ref_captions = reference_set(load_config(
    root/"configs"/"demo.yaml", [f"webdataset_path={root}/data_samples/emoji/shard-{{000002..000005}}.tar"]))
captions = list(dict.fromkeys(ref_captions))
entries = fast_sampling_entries(a.teacher, a.lcm, a.progressive)
for seed in a.seeds:
    rows = sampler_table(entries, captions, ref_images, ref_captions, reference="teacher DDIM@20",
                         baseline="teacher DDIM@4", seed=seed)
    print(f"\nseed {seed}, {len(captions)} captions, {a.threads} thread(s)\n" + format_table(rows))
