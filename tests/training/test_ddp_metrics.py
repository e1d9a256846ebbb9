import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ddp_validate import validate
from vitattn.run_dir import RunDir

SCRIPT = Path(__file__).parents[1] / "helpers" / "ddp_validate.py"
NUM_VAL = 15  # odd: the DistributedSampler pads rank 1 with a repeat of image 0
CAPTION_METRICS = ("bleu1", "bleu2", "bleu3", "bleu4", "rouge_l", "cider_d", "exact_match", "distinct", "num_images")


@pytest.fixture
def checkpoint(small_caption_run):
    """The shared small captioner's last checkpoint (tests/conftest.py) and the data it validates on here: its own
    vocabulary and shapes, ``NUM_VAL`` images."""
    saved = RunDir(small_caption_run).load_config().data
    data = dict(
        task="caption",
        img_size=32,
        num_train=0,
        num_val=NUM_VAL,
        num_test=16,
        seed=saved.seed,
        batch_size=8,
        num_workers=0,
        max_caption_len=saved.max_caption_len,
        vocab_path=str(small_caption_run / "vocab.json"),
    )
    return small_caption_run / "checkpoints" / "last.ckpt", data


def _run_ddp(ckpt: Path, data: dict, out: Path, timeout: int = 300) -> None:
    """The helper script with 2 ranks; the whole process group is killed if it hangs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(SCRIPT), str(ckpt), str(out), "2", json.dumps(data)]
    proc = subprocess.Popen(
        cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"DDP validation did not finish within {timeout} s (a rank waiting on a collective?)")
    assert proc.returncode == 0, output[-3000:]


@pytest.mark.slow
def test_ddp_validation_caption_metrics_equal_single_process(checkpoint, tmp_path):
    ckpt, data = checkpoint
    single = validate(ckpt, data, devices=1, out_dir=tmp_path)["metrics"]
    assert single["val/num_images"] == NUM_VAL
    _run_ddp(ckpt, data, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    seen = [i for r in ranks for i in r["image_ids"]]
    assert len(seen) == NUM_VAL + 1 and set(seen) == set(range(NUM_VAL))  # the sampler's padding repeat is really there
    for rank in ranks:
        for key in CAPTION_METRICS:
            assert rank["metrics"][f"val/{key}"] == pytest.approx(single[f"val/{key}"], rel=0, abs=1e-9), (
                rank["rank"],
                key,
            )
