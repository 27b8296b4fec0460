"2 ranks × 2 workers: each sample once per finite epoch; resampled streams differ per reader; spawn-picklable."
import json, os, pickle, subprocess, sys
from pathlib import Path
from cascade_nb.data import build_dataset, build_dataloader

ROOT = Path(__file__).resolve().parents[1]
EMOJI = ROOT / "data_samples" / "emoji"

READER = r"""
import json, sys, warnings
from cascade_nb.data import build_dataloader
resampled = sys.argv[2] == "resampled"
kw = dict(resampled=True, epoch_length=5) if resampled else {}
dl = build_dataloader(sys.argv[1], 8, num_workers=2, image_size=64, seed=3, drop_last=False, **kw)
print(json.dumps([k for b in dl for k in b["keys"]]))
"""

def run_ranks(mode):
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(EMOJI), mode], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]

def test_two_ranks_two_workers_see_every_sample_once():
    ranks = run_ranks("finite")
    n = sum(len(b["keys"]) for b in build_dataset(EMOJI, 64, image_size=64, drop_last=False, shuffle_buffer=0))
    assert all(ranks) and not set(ranks[0]) & set(ranks[1])
    assert len(ranks[0]) + len(ranks[1]) == n == len(set(ranks[0]) | set(ranks[1]))

def test_resampled_streams_differ_per_rank():
    r0, r1 = run_ranks("resampled")
    assert len(r0) == len(r1) == 2 * 5 * 8   # 2 workers × epoch_length 5 batches × 8
    assert r0 != r1

def test_dataset_pickles_and_runs_under_spawn():
    ds = build_dataset(EMOJI, 8, image_size=64, dataset_filters=[["group", "lambda g: g == 'food'"]],
                       captions_getter=["txt", "identity"], multi_aspect_ratio=["1/1", "1/2"])
    clone = pickle.loads(pickle.dumps(ds))
    assert sum(len(b["keys"]) for b in clone) > 0
    dl = build_dataloader(EMOJI, 16, num_workers=2, image_size=64, multiprocessing_context="spawn")
    keys = [k for b in dl for k in b["keys"]]
    assert len(keys) == len(set(keys)) > 250
