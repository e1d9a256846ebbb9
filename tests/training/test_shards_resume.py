"""A preempted or killed DDP run on shards resumes mid-epoch: every sample of the epoch trained once, over both runs."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers import stop_mid_run
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


def _steps(keys: Path) -> list[tuple[int, list[str]]]:
    """Every rank's ``(step, keys)`` lines (SampleKeys)."""
    return [
        (int(line.split()[0]), line.split()[1:])
        for f in sorted(keys.glob("keys.rank*.txt"))
        for line in f.read_text().splitlines()
    ]


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "kill-9"])
def test_a_stopped_ddp_epoch_on_shards_resumes_with_every_sample_once(stop, tmp_path):
    write_shards(shapes_samples("train", 300, img_size=32), tmp_path / "train", 23)
    write_shards(shapes_samples("val", 16, img_size=32), tmp_path / "val", 8)
    (tmp_path / "train" / "classes.txt").write_text("".join(f"{n}\n" for n in CLASS_NAMES))
    epoch = [s["__key__"] for url in expand_shards(str(tmp_path / "train")) for s in read_shard(url)]
    command, keys, last = _command(tmp_path), tmp_path / "keys", tmp_path / "run" / "checkpoints" / "last.ckpt"

    stop_mid_run(command, tmp_path / "first.log", lambda: len(_steps(keys)) >= 2 * 8, stop, ENV)
    saved = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert 0 < saved < 38
    before = [k for step, ks in _steps(keys) if step <= saved for k in ks]  # what the checkpoint holds
    assert len(before) == 2 * 4 * saved
    for f in keys.glob("*"):
        f.rename(f.with_suffix(".first"))

    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = [k for _, ks in _steps(keys) for k in ks]
    repeated = [k for k, n in Counter(before + after).items() if n > 1]
    assert not repeated, f"{len(repeated)} samples trained twice: {repeated[:5]}"
    assert sorted(before + after) == sorted(epoch)  # none skipped
    print(f"{stop} at step {saved}: {len(before)} samples before, {len(after)} after, {len(epoch)} in the epoch")
