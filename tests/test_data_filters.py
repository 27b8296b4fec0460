"""Issue 32 item 7: samples that `dataset_filters` exclude are the config's choice, not bad data. The trainer's log line
does not call them skipped, a shard the filters empty is said once per run (not every epoch), and the loader says
once how many samples the filters keep and exclude."""
from conftest import ROOT, run_cli

FRUIT = """dataset_filters=[[caption, 'lambda c: c in ("red apple", "banana", "grapes")']]"""   # all three in shard 3

def test_filtered_samples_are_not_skips_and_are_said_once(tmp_path):
    res = run_cli("-m", "cascade_nb.train", ROOT / "configs" / "demo.yaml", FRUIT, "resampled=false", "num_workers=1",
                  "shuffle_buffer=0", "batch_size=2", "updates=5", "log_every=1", "save_every=5", "eval_every=null",
                  "ema_start_iters=null", "sample_steps=2", "tracker=none", f"checkpoint_path={tmp_path}/ck",
                  f"output_path={tmp_path}/out", "experiment_id=f", env={"OMP_NUM_THREADS": "1"})
    log = res.stdout.splitlines()
    updates = [l for l in log if l.startswith("update ") and "loss" in l]
    assert len(updates) == 5 and not any("skipped" in l or "filtered" in l for l in updates), updates   # 5 epochs of 1 batch
    said = [l for l in log if l.startswith("data: dataset_filters keep")]
    assert said == ["data: dataset_filters keep 3 of the 200 samples of data_samples/emoji/shard-{000002..000005}.tar, "
                    "exclude 197; excluded samples are not counted as skipped"], said
    emptied = [l for l in res.stderr.splitlines() if "UserWarning: data: dataset_filters exclude all" in l]
    assert len(emptied) == 3 and all("said once" in l for l in emptied), emptied   # shards 2, 4 and 5, once each
    assert "yielded no usable sample" not in res.stderr, res.stderr[-2000:]
