"""Unreadable training and validation images: data.bad_images=raise|skip, data.verify, vitattn-check-data.

Every data source that reads files (ImageFolder, COCO, Karpathy) gets the same four bad training files
(corrupt, truncated, empty, not an image) and one empty validation file.
"""

import csv
import os
import pickle
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from torch._utils import ExceptionWrapper

from tests.helpers.datasets import make_coco, make_karpathy
from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, compose_train
from vitattn.cli.check_data import main as check_data
from vitattn.cli.run_split import datamodule_from_run
from vitattn.cli.train import _report
from vitattn.data import load_karpathy
from vitattn.data.bad_images import PartialBatch, SkippedImage, collate_skipping
from vitattn.data.images import BadImageError, read_image
from vitattn.errors import first_line
from vitattn.run_dir import RunDir
from vitattn.training import train
from vitattn.training.callbacks import SkippedImages
from vitattn.training.datamodules import CocoCaptionDataModule, ImageFolderDataModule, KarpathyDataModule

REASONS = {
    "corrupt": r"unreadable image: .+",
    "truncated": r"unreadable image: (image file is truncated.*|Truncated File Read)",
    "empty": r"empty file \(0 bytes\)",
    "not-an-image": r"not an image \(unrecognised file format\)",
}


def spoil(path: Path, kind: str) -> None:
    """Overwrite the image at ``path`` with a broken one of ``kind``."""
    data = path.read_bytes()
    n = len(data)
    path.write_bytes(
        {
            "corrupt": data[: n // 3] + bytes(b ^ 0xFF for b in data[n // 3 : 2 * n // 3]) + data[2 * n // 3 :],
            "truncated": data[: n // 2],
            "empty": b"",
            "not-an-image": b"image_id,caption\n1,a cat on a sofa\n",
        }[kind]
    )


def _image_folder(root: Path) -> tuple[dict, list[Path], list[Path]]:
    make_image_folder(root, per_class=4)
    train, val = sorted((root / "train").rglob("*.png")), sorted((root / "val").rglob("*.png"))
    return {"root": root}, train, val


def _coco(root: Path) -> tuple[dict, list[Path], list[Path]]:
    files = make_coco(root, num_train=8, num_val=4)
    images = sorted(files["image_dir"].iterdir())
    return files, [p for p in images if p.name.startswith("train")], [p for p in images if p.name.startswith("val")]


def _karpathy(root: Path) -> tuple[dict, list[Path], list[Path]]:
    files = make_karpathy(root, style="coco")
    splits = load_karpathy(files["dataset_json"])
    train = [files["image_dir"] / im.file_name for im in splits["train"] + splits["restval"]]
    return files, train, [files["image_dir"] / im.file_name for im in splits["val"]]


MODULES = {"imagefolder": ImageFolderDataModule, "coco": CocoCaptionDataModule, "karpathy": KarpathyDataModule}
MAKERS = {"imagefolder": _image_folder, "coco": _coco, "karpathy": _karpathy}


@pytest.fixture(scope="module", params=list(MODULES))
def source(request, tmp_path_factory):
    """(name, DataModule arguments, {bad file: kind}, number of train images, number of val images)."""
    name = request.param
    files, train, val = MAKERS[name](tmp_path_factory.mktemp(name))
    bad = dict(zip(map(str, train[::2]), REASONS))  # every other training image, one of each kind
    bad[str(val[0])] = "empty"
    for path, kind in bad.items():
        spoil(Path(path), kind)
    return name, files, bad, len(train), len(val)


def _datamodule(source, **kwargs):
    name, files, *_ = source
    settings = {"img_size": 32, "batch_size": 3, "num_workers": 0, "cache": "none", **kwargs}
    if name != "imagefolder":
        settings["min_word_freq"] = 1
    return MODULES[name](**files, **settings)


def _assert_reasons(found: dict[str, str], bad: dict[str, str]) -> None:
    assert sorted(found) == sorted(bad)
    for path, reason in found.items():
        assert re.fullmatch(REASONS[bad[path]], reason), (path, bad[path], reason)


@pytest.mark.parametrize("kind", list(REASONS))
def test_load_image_names_the_file_and_why(kind, tmp_path):
    path = tmp_path / "image.png"
    Image.effect_noise((40, 40), 60).convert("RGB").save(path)
    assert read_image(path).size == (40, 40)
    spoil(path, kind)
    with pytest.raises(BadImageError) as err:
        read_image(path)
    assert re.fullmatch(rf"{re.escape(str(path))}: {REASONS[kind]}", str(err.value))
    assert err.value.path == str(path) and re.fullmatch(REASONS[kind], err.value.reason)


@pytest.mark.parametrize("cache", ["none", "ram"])
def test_skip_leaves_bad_images_out_of_their_batches(source, cache):
    name, _, bad, num_train, num_val = source
    dm = _datamodule(source, bad_images="skip", cache=cache)
    dm.setup("fit")
    assert (dm.cache is not None) == (cache == "ram")
    loader = dm.train_dataloader()
    dataset, collate = pickle.loads(pickle.dumps((loader.dataset, loader.collate_fn)))  # spawned workers
    assert isinstance(collate(list(map(dataset.__getitem__, range(len(dataset))))), PartialBatch)
    seen = {}
    for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
        items = 0
        for batch in loader:
            batch = dm.on_before_batch_transfer(batch, 0)  # what Lightning does before the batch reaches the model
            if batch is None:  # every image of the batch unreadable: Lightning skips it
                continue
            images = batch[0] if name == "imagefolder" else batch["images"]
            items += len(images)
        seen[split] = items
    num_bad_val = 1
    assert seen == {"train": num_train - (len(bad) - num_bad_val), "val": num_val - num_bad_val}
    _assert_reasons(dm.skipped_images, bad)


def test_raise_stops_at_a_bad_image_naming_it_and_why(source):
    _, _, bad, *_ = source
    dm = _datamodule(source)  # bad_images=raise is the default
    dm.setup("fit")
    with pytest.raises(BadImageError) as err:
        for _ in dm.train_dataloader():
            pass
    message = str(err.value)
    path = message.split(": ", 1)[0]
    assert path in bad and "\n" not in message
    assert re.fullmatch(rf"{re.escape(path)}: {REASONS[bad[path]]}; data\.bad_images=skip .+", message)


def test_raise_with_the_images_cached_stops_before_any_batch(source):
    _, _, bad, *_ = source
    with pytest.raises(BadImageError, match=rf"\(and {len(bad) - 1} more unreadable images\); data\.bad_images=skip"):
        _datamodule(source, cache="ram").setup("fit")


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_verify_lists_every_bad_image_before_training(source, mode, caplog):
    _, _, bad, *_ = source
    dm = _datamodule(source, bad_images=mode, verify=True)
    caplog.set_level("INFO", logger="vitattn")
    if mode == "raise":
        with pytest.raises(BadImageError, match=r"^\S+: .+ \(and 4 more unreadable images\)"):
            dm.setup("fit")
    else:
        dm.setup("fit")
    listed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("unreadable image: ")]
    assert sorted(line.split(": ")[1] for line in listed) == sorted(bad)


def test_check_data_prints_the_bad_files_and_exits_1(source, capsys):
    name, files, bad, *_ = source
    args = [f"data={name}", *(f"data.{k}={v}" for k, v in files.items()), "threads=2"]
    assert check_data(args) == 1
    out = capsys.readouterr().out.splitlines()
    _assert_reasons(dict(line.split(": ", 1) for line in out), bad)


def test_check_data_exit_status_0_when_every_image_reads_2_on_a_usage_error(tmp_path, capsys):
    root = make_image_folder(tmp_path / "clean", per_class=2)
    assert check_data(["data=imagefolder", f"data.root={root}"]) == 0
    assert capsys.readouterr().out == ""
    assert check_data([]) == 2  # data=shapes: no files
    assert "has no image files to check" in capsys.readouterr().err
    assert check_data(["data=imagefolder", f"data.root={root}", "threads=0"]) == 2
    assert check_data(["data=imagefolder"]) == 2
    assert "data.root is required" in capsys.readouterr().err


def test_collate_skipping_keeps_the_readable_items_and_a_batch_of_none_when_all_are_bad():
    bad = SkippedImage("a.png", "empty file (0 bytes)")
    assert collate_skipping([1, 2], sum) == 3
    assert collate_skipping([1, bad, 2], sum) == PartialBatch(3, [bad])
    assert collate_skipping([bad, bad], sum) == PartialBatch(None, [bad, bad])


def test_a_worker_error_reads_as_the_workers_one_line():
    try:
        raise BadImageError("/data/cat.png: empty file (0 bytes); data.bad_images=skip trains without such files")
    except BadImageError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 3")
    with pytest.raises(BadImageError) as err:
        wrapped.reraise()  # what the main process receives
    assert str(err.value).startswith("Caught BadImageError in DataLoader worker process 3.")
    assert (
        first_line(err.value) == "/data/cat.png: empty file (0 bytes); data.bad_images=skip trains without such files"
    )
    assert first_line(ValueError("plain\nsecond line")) == "plain"


HEADS = {"imagefolder": "classification", "coco": "caption", "karpathy": "caption"}


def test_evaluating_a_run_trained_with_verify_does_not_read_its_images_first(source, tmp_path):
    name, files, *_ = source
    overrides = [f"head={HEADS[name]}", f"data={name}", *(f"data.{k}={v}" for k, v in files.items())]
    RunDir(tmp_path).save_config(compose_train([*overrides, "data.verify=true"], tmp_path))
    dm = datamodule_from_run(RunDir(tmp_path))  # bad_images=raise: a verification would stop here
    assert dm.verify is False and dm.cache is None and len(dm.val_dataset) > 0


@pytest.mark.slow
def test_training_with_bad_images_skipped_counts_and_lists_them(source, tmp_path, capsys):
    name, files, bad, num_train, _ = source
    num_bad_train = len(bad) - 1
    cfg = compose_train(
        [
            f"head={HEADS[name]}",
            f"data={name}",
            *(f"data.{k}={v}" for k, v in files.items()),
            *TINY,
            "data.batch_size=1",  # each bad image makes a batch with no image at all
            "data.num_workers=1",  # the skipped files cross from the worker process
            "data.bad_images=skip",
            "data.cache=none",
            "trainer.max_epochs=1",
            "trainer.max_steps=-1",
            "trainer.log_every_n_steps=1",
            "test=false",
            "export_bundle=false",
            *(["data.min_word_freq=1", "head.generate.max_new_tokens=4"] if name != "imagefolder" else []),
        ],
        tmp_path,
    )
    result = train(cfg)
    assert result.global_step == num_train - num_bad_train  # a batch with no image takes no step
    _assert_reasons(result.skipped_images, bad)
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["train/skipped_images"]) for r in rows if r.get("train/skipped_images")] == [num_bad_train]
    assert {float(r["val/skipped_images"]) for r in rows if r.get("val/skipped_images")} == {1.0}
    _report(result)
    out = capsys.readouterr().out
    assert f"skipped images ({len(bad)} files could not be read; data.bad_images=skip):" in out
    assert all(f"  {path}: {reason}" in out for path, reason in result.skipped_images.items())


@pytest.mark.slow
def test_cli_bad_image_is_one_line_exit_2_and_keeps_the_checkpoint(tmp_path):
    root = make_image_folder(tmp_path / "folder", per_class=4)
    args = [
        "head=classification",
        "data=imagefolder",
        f"data.root={root}",
        *TINY,
        "data.num_workers=1",
        "data.cache=none",
        "test=false",
        "export_bundle=false",
        "trainer.max_epochs=-1",
    ]
    train(compose_train([*args, "trainer.max_steps=2"], tmp_path / "run"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    bad = sorted((root / "train" / "dog").iterdir())[1]
    spoil(bad, "truncated")
    proc = subprocess.run(
        [sys.executable, "-m", "vitattn.cli.train", *args, "trainer.max_steps=8", f"resume={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: {bad}: unreadable image: image file is truncated"), last_line
    assert "Traceback" not in proc.stderr and "worker process" not in proc.stderr
    assert last.read_bytes() == before


@pytest.mark.parametrize("mode,logged", [("raise", []), ("skip", [("train/skipped_images", 2.0)])])
def test_skipped_images_count_is_logged_only_when_images_are_skipped(mode, logged):
    calls = []
    module = SimpleNamespace(log=lambda name, value, **kwargs: calls.append((name, value)))
    datamodule = SimpleNamespace(bad_images=mode, skipped_counts=Counter(train=2))
    SkippedImages().on_train_epoch_end(SimpleNamespace(datamodule=datamodule, sanity_checking=False), module)
    assert calls == logged
