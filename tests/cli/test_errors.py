"""User errors through the real command line: one line on stderr, exit status 2, nothing trained; the
traceback only with ``debug=true``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import TINY, TINY_SHAPES
from tests.training.test_config import _overrides, error_data
from vitattn.cli.errors import user_errors
from vitattn.errors import ConfigError, NonFiniteLossError

QUIET = ["test=false", "export_bundle=false", "trainer.max_epochs=-1", "trainer.check_val_every_n_epoch=1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TRAIN_CLI = [sys.executable, "-m", "vitattn.cli.train"]
SHAPES = [*TINY, *TINY_SHAPES]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return error_data(tmp_path_factory.mktemp("data"))


def _cli(args: list[str], cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN_CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


CLI_ERRORS = {  # checked through the real command line; the rest above through check_config/train
    "encoder-heads": ("model.num_heads=3", "model.num_heads=3"),
    "caption-on-imagefolder": ("data=imagefolder head=caption data.root={folder}", "head=caption"),
    "empty-image-folder": ("data=imagefolder head=classification data.root={empty} data.num_workers=0", "data.root="),
}


# each a training process of its own: test-fast runs one, the slow tests all
@pytest.mark.parametrize(
    "name", [n if n == "empty-image-folder" else pytest.param(n, marks=pytest.mark.slow) for n in CLI_ERRORS]
)
def test_cli_user_error_is_one_line_exit_2(name, data, tmp_path):
    spec, key = CLI_ERRORS[name]
    runs = tmp_path / "runs"
    proc = _cli([*_overrides(spec, data), *QUIET, f"paths.runs_dir={runs}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and key in last, last
    assert "Traceback" not in proc.stderr
    assert not list(runs.rglob("*.ckpt"))


@pytest.mark.parametrize("trainer", ["ddp", "fsdp", "gpu"])
def test_a_gpu_trainer_without_a_gpu_names_the_cpu_overrides_in_one_line(trainer, tmp_path):
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, on any machine
    proc = subprocess.run(
        [*TRAIN_CLI, f"trainer={trainer}", *SHAPES, *QUIET, f"paths.runs_dir={tmp_path / 'runs'}"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    devices = 1 if trainer == "gpu" else 2
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(
        "error: trainer.accelerator=gpu but this machine has no GPU; to train on its CPUs add "
        f"trainer.accelerator=cpu trainer.devices={devices} trainer.precision=32-true"
    ), lines[0]


def test_user_errors_show_traceback_only_with_debug(capsys):
    with pytest.raises(SystemExit, match="^2$") as exit_, user_errors(debug=False):
        raise NonFiniteLossError("non-finite training loss nan at step 7 (epoch 0)\nsecond line")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: non-finite training loss nan at step 7") and err.count("\n") == 1
    with pytest.raises(ConfigError, match="model.num_heads=3 must divide model.embed_dim=32"), user_errors(debug=True):
        raise ConfigError("model.num_heads=3 must divide model.embed_dim=32")
