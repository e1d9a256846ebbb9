"""Reliability: user errors stop a run before any work, a killed run resumes, non-finite losses."""

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.helpers import TINY, TINY_SHAPES, compose_train, console_script, make_coco, make_image_folder
from vitattn.cli.errors import user_errors
from vitattn.data.vocab import Vocabulary
from vitattn.errors import ConfigError
from vitattn.training import AtomicCheckpointIO, setup_data, train
from vitattn.training.compose import check_targets
from vitattn.training.config import check_config
from vitattn.training.systems import ClassificationSystem
from vitattn.training.systems.base import NonFiniteLossError

SHAPES = [*TINY, *TINY_SHAPES]
CLS = ["head=classification", *SHAPES]
QUIET = ["test=false", "export_bundle=false", "trainer.max_epochs=-1", "trainer.check_val_every_n_epoch=1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TRAIN_CLI = [sys.executable, "-m", "vitattn.cli.train"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    empty = make_image_folder(root / "empty", classes=("cat",), per_class=1)
    for image in (empty / "train" / "cat").iterdir():  # train/cat/ stays, without images
        image.unlink()
    coco = make_coco(root / "coco", num_train=2, num_val=2)
    return {
        "folder": make_image_folder(root / "folder", per_class=1),
        "empty": empty,
        "coco": " ".join(f"data.{k}={v}" for k, v in coco.items()),
        "ann_dir": root / "coco" / "images",  # a folder where a file belongs
        "missing": root / "missing.json",
    }


# (overrides, what the error must say); {name} is filled from the `data` fixture; shapes data unless data= is given.
CONFIG_ERRORS = {
    "encoder-heads": ("model.num_heads=3", r"^model\.num_heads=3 must divide model\.embed_dim=32"),
    "decoder-heads": (
        "head=caption head.decoder.num_heads=3",
        r"^head\.decoder\.num_heads=3 must divide head\.decoder\.embed_dim=32",
    ),
    "patch": ("data.img_size=36", r"^data\.img_size=36 must be divisible by model\.patch_size=8"),
    "task": ("head.task=segment", r"^head\.task='segment' is unknown; choose head=caption or head=classification"),
    "pool": ("model.global_pool=max", r"^model\.global_pool='max' is unknown"),
    "activation": ("model.activation=swish", r"^model\.activation='swish' is unknown"),
    "decoder-activation": (
        "head=caption head.decoder.activation=swish",
        r"^head\.decoder\.activation='swish' is unknown",
    ),
    "nonfinite": ("head.nonfinite=ignore", r"^head\.nonfinite='ignore' is unknown; choose raise or skip"),
    "bad-images": (
        "data=imagefolder head=classification data.root={folder} data.bad_images=ignore",
        r"^data\.bad_images='ignore' is unknown; choose raise or skip",
    ),
    "augment-crop": (
        "data=imagefolder head=classification data.root={folder} data.augment.crop=zoom",
        r"^data\.augment\.crop='zoom' is unknown; use one of \['resized', 'pad'\]",
    ),
    "warmup": (
        "optim.warmup_steps=soon",
        r"^optim\.warmup_steps='soon' must be a whole number of steps, or auto",
    ),
    "augment-scale": (
        "data=imagefolder head=classification data.root={folder} data.augment.scale=[0.9,0.2]",
        r"^data\.augment\.scale=\[0\.9, 0\.2\] must satisfy 0 < min <= max <= 1",
    ),
    "sincos-width": (
        "model.embed_dim=34 model.num_heads=2",
        r"^model\.pos_embed_init=sincos needs embed_dim divisible by 4, not 34",
    ),
    "caption-on-imagefolder": (
        "data=imagefolder head=caption data.root={folder}",
        r"no captions for head=caption; use head=classification",
    ),
    "classification-on-coco": (
        "data=coco head=classification {coco}",
        r"no class labels for head=classification; use head=caption",
    ),
    "root-missing": ("data=imagefolder head=classification", r"^data\.root is required: add data\.root=PATH"),
    "root-not-found": (
        "data=imagefolder head=classification data.root=/no/such/dir",
        r"^data\.root=/no/such/dir does not exist",
    ),
    "annotations-not-found": (
        "data=coco {coco} data.train_annotations={missing}",
        r"^data\.train_annotations=.*missing\.json does not exist",
    ),
    "annotations-not-a-file": (
        "data=coco {coco} data.val_annotations={ann_dir}",
        r"^data\.val_annotations=.* is not a file",
    ),
    "empty-shapes": ("data.num_train=0", r"^data\.num_train=0 leaves that split empty; use 1 or more"),
    "resume-without-checkpoint": ("resume={folder}", r"^resume=.* has no checkpoints/last\.ckpt"),
    "untrusted-target": ("data._target_=os.system", r"^data\._target_=os\.system is not allowed"),
    "unknown-target": (
        "data._target_=vitattn.data.NoSuchData",
        r"^data\._target_=vitattn\.data\.NoSuchData cannot be imported",
    ),
}


def _overrides(spec: str, data: dict) -> list[str]:
    given = spec.format(**data).split()
    base = SHAPES if not any(o.startswith("data=") for o in given) else TINY
    return [*base, *given]


@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_check_config_names_key_and_fix(name, data, tmp_path):
    spec, message = CONFIG_ERRORS[name]
    cfg = compose_train(_overrides(spec, data), tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        check_config(cfg)
    assert "\n" not in str(err.value)


def test_check_targets_refuses_a_saved_config_pointing_outside(tmp_path):
    cfg = compose_train(CLS, tmp_path)
    cfg.data._target_ = "os.system"
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"^data\._target_=os\.system is not allowed"):
        check_targets(OmegaConf.load(tmp_path / "config.yaml"))
    cfg.data._target_ = "vitattn.training.datamodules.ShapesDataModule"
    cfg.callbacks.step_checkpoint._target_ = "builtins.exec"  # nested nodes too
    with pytest.raises(ConfigError, match=r"^callbacks\.step_checkpoint\._target_=builtins\.exec"):
        check_targets(cfg)


def test_empty_image_folder_fails_before_any_step(data, tmp_path):
    cfg = compose_train(
        [*TINY, "data=imagefolder", "head=classification", f"data.root={data['empty']}", "data.num_workers=0"], tmp_path
    )
    with pytest.raises(ConfigError, match=r"^data\.root=.*empty: .*train.*expected ROOT/train/<class>/<image>") as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.yaml").exists()


def _fake_checkpoint(path: Path, **hparams) -> Path:
    """A checkpoint file carrying only the hyperparameters (what the pre-training checks read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 3, "hyper_parameters": hparams}, path)
    return path


@pytest.mark.parametrize("how", ["resume", "ckpt_path"])
def test_vocabulary_differing_from_the_checkpoint_fails_before_any_step(how, tmp_path):
    run = tmp_path / "run"
    trained = Vocabulary(["a", "red", "circle"])
    ckpt = _fake_checkpoint(run / "checkpoints" / "last.ckpt", vocab=trained.itos[4:], model_config={})
    trained.save(run / "vocab.json")
    other = Vocabulary(["a", "blue", "circle"])
    other.save(tmp_path / "other.json")
    load = f"resume={run}" if how == "resume" else f"ckpt_path={ckpt}"
    cfg = compose_train(["head=caption", *SHAPES, f"data.vocab_path={tmp_path / 'other.json'}", load], tmp_path / "out")
    pattern = (
        r"^data\.vocab_path: .*other\.json \(3 words\) differs .*'blue' vs 'red'.*"
        rf"data\.vocab_path={re.escape(str(run / 'vocab.json'))}$"
    )
    with pytest.raises(ConfigError, match=pattern):
        train(cfg)
    assert not (tmp_path / "out").exists()  # nothing written, no step run
    # the same vocabulary passes, and a checkpoint of the other head is refused
    matching = compose_train(["head=caption", *SHAPES, f"data.vocab_path={run / 'vocab.json'}", load], tmp_path / "out")
    setup_data(matching, instantiate(matching.data), str(ckpt))
    cls_cfg = compose_train([*CLS, load], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"was trained with head=caption, not head=classification; use head=caption"):
        setup_data(cls_cfg, instantiate(cls_cfg.data), str(ckpt))


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


def test_user_errors_show_traceback_only_with_debug(capsys):
    with pytest.raises(SystemExit, match="^2$") as exit_, user_errors(debug=False):
        raise NonFiniteLossError("non-finite training loss nan at step 7 (epoch 0)\nsecond line")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: non-finite training loss nan at step 7") and err.count("\n") == 1
    with pytest.raises(ConfigError, match="model.num_heads=3 must divide model.embed_dim=32"), user_errors(debug=True):
        raise ConfigError("model.num_heads=3 must divide model.embed_dim=32")


# --- a killed run resumes -------------------------------------------------------------------------
# Lightning's `_atomic_save` (lightning/fabric/utilities/cloud_io.py) writes inside an fsspec
# transaction; for the local filesystem fsspec's `LocalFileOpener` then opens `tempfile.mkstemp()` --
# a file in the system temp folder, not beside the checkpoint -- and commits with `shutil.move`. That
# is a rename only when the temp folder shares the run directory's filesystem; otherwise shutil copies
# the bytes straight onto the checkpoint's path, and a kill during the copy leaves it truncated (and
# the temp file leaks). So `train()` installs `AtomicCheckpointIO`: `PATH.tmp` beside it, fsync, then
# `os.replace`, which is atomic on one filesystem.


def _train_steps(metrics_csv: Path) -> list[int]:
    if not metrics_csv.is_file():
        return []
    with open(metrics_csv, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/loss") and (row.get("step") or "").isdigit()]
    return sorted({int(row["step"]) for row in rows})


def _assert_checkpoints_whole(run_dir: Path) -> None:
    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts
    for path in ckpts:
        assert "global_step" in torch.load(path, map_location="cpu", weights_only=True), path


def test_atomic_checkpoint_io_replaces_whole_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1}, path)

    def killed(obj, f):  # the process dies halfway through writing the new checkpoint
        f.write(b"partial")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt, match="killed while writing"):
        io.save_checkpoint({"global_step": 2}, path)
    assert torch.load(path, weights_only=True) == {"global_step": 1}


@pytest.mark.slow
def test_killed_training_resumes_with_at_most_one_interval_repeated(tmp_path):
    runs = tmp_path / "runs"
    args = [
        *CLS,
        "callbacks.step_checkpoint.every_n_train_steps=5",
        "trainer.max_steps=40",
        "trainer.max_epochs=-1",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "+logger.csv.flush_logs_every_n_steps=1",  # rows on disk at each step
        "test=false",
        "export_bundle=false",
        f"paths.runs_dir={runs}",
    ]
    train_cli = [str(console_script("vitattn-train"))]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen([*train_cli, *args], stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path)
        deadline = time.monotonic() + 180
        last = None
        while proc.poll() is None and time.monotonic() < deadline:
            found = list(runs.glob("classification/*/checkpoints/last.ckpt"))
            # kill once a step checkpoint exists and training is past the first validation (which
            # rewrites metrics.csv with new columns) and past the step-10 checkpoint
            if found and max(_train_steps(found[0].parents[2] / "csv" / "metrics.csv"), default=0) >= 11:
                last = found[0]
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert last is not None and proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    run_dir = last.parents[2]
    _assert_checkpoints_whole(run_dir)  # none partial after the kill
    done_before_kill = max(_train_steps(run_dir / "csv" / "metrics.csv")) + 1
    resumed_from = torch.load(last, weights_only=True)["global_step"]
    assert done_before_kill > resumed_from  # rows past the checkpoint, which the resumed run logs again

    proc = subprocess.run(
        [*train_cli, f"resume={run_dir}"], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 40
    _assert_checkpoints_whole(run_dir)
    # the file continued: the steps before the checkpoint kept, those the killed process logged after it
    # replaced by the resumed run's, each step once
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        assert [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")] == list(range(40))
    repeated = done_before_kill - resumed_from
    print(f"killed after {done_before_kill} steps, resumed at step {resumed_from}: {repeated} steps repeated")
    assert 0 < repeated <= 5
    assert len(list(runs.glob("classification/*"))) == 1  # the run directory was reused


# --- non-finite loss ------------------------------------------------------------------------------


def _poison(monkeypatch, steps) -> None:
    """NaN images (so a NaN loss) in the training steps whose global_step is in ``steps``."""
    original = ClassificationSystem.training_step

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if self.global_step in steps:
            images = images * float("nan")
        return original(self, (images, labels), batch_idx)

    monkeypatch.setattr(ClassificationSystem, "training_step", training_step)


STEP_CKPT = ["callbacks.step_checkpoint.every_n_train_steps=5", "logger=csv", "trainer.log_every_n_steps=1"]


def test_nan_loss_stops_naming_the_step_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    train(compose_train([*CLS, *QUIET, *STEP_CKPT, "trainer.max_steps=5"], tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    assert torch.load(last, weights_only=True)["global_step"] == 5
    _poison(monkeypatch, steps=range(9, 10**6))  # step 9 would complete the step-10 checkpoint
    with pytest.raises(NonFiniteLossError, match=r"^non-finite training loss nan at step 9 \(epoch 1\)"):
        train(compose_train([*CLS, *QUIET, *STEP_CKPT, "trainer.max_steps=20", f"resume={tmp_path}"], tmp_path))
    assert last.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step000005.ckpt"]


def test_inf_loss_is_non_finite_too():
    system = ClassificationSystem(
        {"embed_dim": 32, "depth": 1, "num_heads": 2, "patch_size": 8, "img_size": 32, "num_classes": 2},
        class_names=["a", "b"],
    )
    loss = torch.tensor(float("inf"))
    assert system.guard(loss) is loss  # noted on the loss's device: no host sync in the step
    with pytest.raises(NonFiniteLossError, match=r"^non-finite training loss inf at step 0 \(epoch 0\); "):
        system.check_finite()
    system.check_finite()  # the note is read once


def test_nan_loss_between_logging_steps_stops_before_the_next_checkpoint(tmp_path, monkeypatch):
    # Logging every 50 steps: step 8 (the first of epoch 1) is not looked at when it runs; the step-10
    # checkpoint looks first, and is not written.
    _poison(monkeypatch, steps={8})
    run = [*CLS, *QUIET, *STEP_CKPT, "trainer.log_every_n_steps=50", "trainer.max_steps=20"]
    with pytest.raises(NonFiniteLossError, match=r"^non-finite training loss nan at step 8 \(epoch 1\); "):
        train(compose_train(run, tmp_path))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step000005.ckpt"]
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5


def test_nan_loss_from_the_cli_is_one_line_and_keeps_the_good_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    # a learning rate that overflows the weights: the loss turns NaN after the first update or two
    proc = _cli(
        [
            *CLS,
            *QUIET,
            "optim.lr=1e38",
            "optim.warmup_steps=0",
            "trainer.max_steps=10",
            "callbacks.step_checkpoint.every_n_train_steps=1",
            f"paths.runs_dir={runs}",
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    step = int(re.match(r"error: non-finite training loss nan at step (\d+) ", last).group(1))
    ckpt = torch.load(next(runs.glob("classification/*/checkpoints/last.ckpt")), weights_only=True)
    assert ckpt["global_step"] == step  # the last step whose loss was finite
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_nan_loss_skipped_and_counted_with_nonfinite_skip(tmp_path, monkeypatch):
    _poison(monkeypatch, steps={3, 4})
    with pytest.warns(UserWarning) as warned:
        result = train(
            compose_train([*CLS, *QUIET, *STEP_CKPT, "trainer.max_steps=8", "head.nonfinite=skip"], tmp_path)
        )
    messages = [str(w.message) for w in warned]
    assert [m for m in messages if m.startswith("non-finite training loss")] == [
        "non-finite training loss nan at step 3 (epoch 0); batch skipped (1 so far)",
        "non-finite training loss nan at step 4 (epoch 0); batch skipped (2 so far)",
    ]
    assert result.global_step == 8
    assert result.system.skipped_batches == 2
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        counts = [float(r["train/skipped_batches"]) for r in csv.DictReader(f) if r.get("train/skipped_batches")]
    assert counts[0] == 1.0 and max(counts) == 2.0  # Lightning repeats the last value on later rows
    assert all(torch.isfinite(p).all() for p in result.system.parameters())


# Two CPU processes that Lightning starts itself (gloo).
DDP_CPU = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def _run_group(command: list[str], cwd: Path, timeout: int, **env: str) -> subprocess.CompletedProcess:
    """``command`` in its own process group; past ``timeout`` every process of the group is killed (a rank
    left waiting in a collective would otherwise outlive the test) and the test fails."""
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    env.pop("PYTHONWARNINGS")  # the warnings are under test
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"still running after {timeout} s (a rank waiting for the others?): {stderr[-2000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_ddp_nonfinite_skip_skips_the_step_on_every_rank_and_counts_it_once(tmp_path):
    run_dir, reports = tmp_path / "run", tmp_path / "ranks"
    reports.mkdir()
    script = ROOT / "tests" / "helpers" / "ddp_nonfinite_train.py"  # rank 1's loss at step 3 is NaN, rank 0's is not
    overrides = [*DDP_CPU, *CLS, *QUIET, "trainer.max_steps=6", "head.nonfinite=skip", "trainer.log_every_n_steps=1"]
    overrides += ["+logger.csv.flush_logs_every_n_steps=1", f"hydra.run.dir={run_dir}"]
    proc = _run_group(
        [sys.executable, str(script), *overrides], tmp_path, 240, VITATTN_NAN_STEP="3", VITATTN_RANK_REPORT=str(reports)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (torch.load(reports / f"{rank}.pt", weights_only=True) for rank in (0, 1))
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [5]  # 6 steps; the same one skipped on both
    for key, value in rank0["weights"].items():  # the ranks still hold the same weights
        assert torch.equal(value, rank1["weights"][key]), key
    warned = [line for line in proc.stderr.splitlines() if "non-finite training loss" in line]
    assert len(warned) == 1, warned  # rank 0 warns for both
    assert warned[0].endswith(
        "non-finite training loss nan at step 3 (epoch 0) on rank 1; step skipped on every rank (1 so far)"
    )
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        counts = [
            (int(r["step"]), float(r["train/skipped_batches"])) for r in csv.DictReader(f) if r["train/skipped_batches"]
        ]
    assert counts[0] == (3, 1.0) and max(count for _, count in counts) == 1.0


@pytest.mark.slow
def test_ddp_batch_of_unreadable_images_on_one_rank_trains_on_with_the_others(tmp_path):
    """Rank 1's batch at step 2 holds no readable image (None): the ranks still step together, no hang."""
    reports = tmp_path / "ranks"
    reports.mkdir()
    script = ROOT / "tests" / "helpers" / "ddp_nonfinite_train.py"
    overrides = [*DDP_CPU, *CLS, *QUIET, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'run'}"]
    command = [sys.executable, str(script), *overrides]
    proc = _run_group(command, tmp_path, 240, VITATTN_EMPTY_STEP="2", VITATTN_RANK_REPORT=str(reports))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (torch.load(reports / f"{rank}.pt", weights_only=True) for rank in (0, 1))
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [4]  # every step updated, on both ranks
    for key, value in rank0["weights"].items():  # the same update on both: the all-reduce ran at step 2
        assert torch.equal(value, rank1["weights"][key]), key


def test_class_list_differing_from_the_checkpoint_fails_before_any_step(tmp_path):
    root = make_image_folder(tmp_path / "folder", classes=("bird", "cat"), per_class=2)
    ckpt = tmp_path / "trained.ckpt"
    torch.save({"hyper_parameters": {"class_names": ["cat", "dog"]}}, ckpt)
    cfg = compose_train(
        ["head=classification", "data=imagefolder", f"data.root={root}", f"ckpt_path={ckpt}"], tmp_path / "run"
    )
    dm = instantiate(cfg.data)
    with pytest.raises(ConfigError, match=r"classes \['bird', 'cat'\] differ from the checkpoint's \['cat', 'dog'\]"):
        setup_data(cfg, dm, str(ckpt))
