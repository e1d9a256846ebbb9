"""A DDP run on shards preempted, resumed, killed and resumed again continues mid-epoch each time: every sample of
the epoch trained once, over the three runs."""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.processes import stop_twice_then_finish
from vitattn.data.shapes import CLASS_NAMES
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.writer import shapes_samples, write_shards

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _command(tmp_path: Path) -> list[str]:
    """Two CPU ranks x two loader workers, one epoch of 300 samples in 13 shards of 23 (the last 1): 38 steps."""
    return [
        *[sys.executable, "-m", "vitattn.cli.train", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"],
        *["trainer.precision=32-true", "trainer.benchmark=false", "head=classification", "data=webdataset"],
        *[f"data.train_shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'val'}", "data.num_workers=2"],
        *["data.shuffle_buffer=20", f"data.count_cache={tmp_path / 'cache'}", "data.img_size=32", "data.batch_size=4"],
        *["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8", "num_threads=null"],
        *["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv", "test=false"],
        *["export_bundle=false", "trainer.max_epochs=1", "callbacks.step_checkpoint.every_n_train_steps=3"],
        "+callbacks.sample_keys._target_=vitattn.training.callbacks.SampleKeys",
        f"+callbacks.sample_keys.folder={tmp_path / 'keys'}",
        "resume=auto",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]


@pytest.mark.slow
def test_a_ddp_epoch_on_shards_stopped_by_sigterm_then_by_kill_9_resumes_with_every_sample_once(tmp_path):
    write_shards(shapes_samples("train", 300, img_size=32), tmp_path / "train", 23)
    write_shards(shapes_samples("val", 16, img_size=32), tmp_path / "val", 8)
    (tmp_path / "train" / "classes.txt").write_text("".join(f"{n}\n" for n in CLASS_NAMES))
    epoch = [s["__key__"] for url in expand_shards(str(tmp_path / "train")) for s in read_shard(url)]
    keys = tmp_path / "keys"
    runs = stop_twice_then_finish(_command(tmp_path), tmp_path, keys, first=8, every=3, steps=38, batch=4, env=ENV)
    trained = [k for run in runs for k in run]
    repeated = [k for k, n in Counter(trained).items() if n > 1]
    assert not repeated, f"{len(repeated)} samples trained twice: {repeated[:5]}"
    assert sorted(trained) == sorted(epoch)  # none skipped
    print("samples trained, to the SIGTERM's checkpoint, to the kill -9's, after:", [len(run) for run in runs])
