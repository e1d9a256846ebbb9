"""Every file and generated DataModule resumes mid-epoch exactly: the samples of an interrupted epoch, over both
runs, are those of an uninterrupted one, and with data.max_patches their crops too, in one process
(vitattn.training.datamodules.base; DDP: test_data_resume_ddp.py)."""

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, RandomSampler

from tests.helpers.datasets import make_coco
from tests.helpers.images import make_image_folder
from tests.helpers.processes import sample_keys
from tests.helpers.runs import TINY, compose_train
from vitattn.data.tokenizer import load_tokenizer
from vitattn.run_dir import RunDir
from vitattn.training import train
from vitattn.training.datamodules.base import EpochSampler, ResumableLoader, SeededDraws
from vitattn.training.datamodules.shapes import ShapesDataModule
from vitattn.training.systems import ClassificationSystem

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),  # this checkout's vitattn
}


class _Indices(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def test_epoch_sampler_in_one_process_draws_randomsamplers_order():
    torch.manual_seed(3)
    expected = [list(RandomSampler(range(11))) for _ in range(2)]
    torch.manual_seed(3)
    sampler = EpochSampler(11)
    assert [list(sampler) for _ in range(2)] == expected


@pytest.mark.parametrize("ranks", [2, 3])
def test_epoch_sampler_gives_each_rank_distributedsamplers_share(ranks):
    for rank in range(ranks):
        theirs, ours = DistributedSampler(range(10), ranks, rank, seed=7), EpochSampler(10, ranks, rank, seed=7)
        theirs.set_epoch(2), ours.set_epoch(2)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)  # padded to 12 with 3 ranks, as theirs


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_loader_state_mid_epoch_resumes_the_rest_of_the_epoch(workers, ranks):
    def loader(rank: int) -> ResumableLoader:
        sampler = EpochSampler(21, ranks, rank, seed=5)
        sampler.set_epoch(1)
        return ResumableLoader(_Indices(21), sampler=sampler, batch_size=4, num_workers=workers)

    for rank in range(ranks):
        torch.manual_seed(0)
        whole = [b.tolist() for b in loader(rank)]
        first, seen = loader(rank), []
        torch.manual_seed(0)
        for batch in first:
            seen.append(batch.tolist())
            assert first.last_indices == batch.tolist()  # the keys SampleKeys writes name the batch's samples
            if len(seen) == 2:
                break
        state = first.state_dict()
        assert state["batches"] == 2 and len(first) == len(whole)
        torch.manual_seed(1)  # another global seed: the order comes from the state
        second = loader(rank)
        second.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint keeps
        rest = [b.tolist() for b in second]
        assert seen + rest == whole
        assert second.state_dict()["batches"] == len(whole)


def test_a_loader_state_of_other_data_is_refused_in_one_line():
    state = ResumableLoader(_Indices(21), sampler=EpochSampler(21), batch_size=4).state_dict()
    state.update(epoch_seed=1, batches=2)
    other = ResumableLoader(_Indices(20), sampler=EpochSampler(20), batch_size=4)
    with pytest.raises(ValueError, match="^the checkpoint's training loader stopped mid-epoch over 21 samples") as err:
        other.load_state_dict(state)
    assert "\n" not in str(err.value)


class _Draws(Dataset):
    """Item ``index``: a draw of Python's, NumPy's and torch's generators each."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        return random.random(), float(np.random.random()), float(torch.rand(()))


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_seeded_draws_are_the_samples_own_in_any_order_and_worker_and_leave_the_process_generators_alone():
    draws = SeededDraws(_Draws())
    _seed(1)
    first = [draws[(i, 7)] for i in range(8)]
    after = _Draws()[0]
    _seed(1)
    assert after == _Draws()[0]  # the process's generators put back after each item
    assert [draws[(i, 7)] for i in reversed(range(8))] == first[::-1]  # each item its own, in any order
    assert len({x for item in first for x in item}) == 24 and draws[(0, 8)] != first[0]  # by index and epoch seed
    loader = ResumableLoader(draws, sampler=EpochSampler(8, draws=True), batch_size=4, num_workers=2)
    loader.sampler.resume(7, 0)
    batches, indices = [], []
    for batch in loader:  # two workers, each item drawn in one of them
        batches.append(torch.stack(batch, 1))  # (4, 3)
        indices += loader.last_indices
    expected = torch.tensor([first[i] for i in indices], dtype=torch.float64)
    torch.testing.assert_close(torch.cat(batches), expected, rtol=0, atol=0)


def _overrides(name: str, size: int, root: Path, teacher: Path | None = None) -> tuple[list[str], list[str]]:
    """Overrides for a tiny one-epoch ``name`` run of ``size`` training samples (4 a batch) and their keys;
    ``coco-bootstrap``: 16 human-captioned images and a pool of 8 that ``teacher`` captions."""
    if name == "shapes":
        data = ["head=classification", "data=shapes", f"data.num_train={size}", "data.num_val=8", "data.num_test=8"]
        keys = [str(i) for i in range(size)]
    elif name == "imagefolder":
        make_image_folder(root / "tree", per_class=size // 2, size=32)
        keys = [f"{c}/{p.name}" for c in ("cat", "dog") for p in (root / "tree" / "train" / c).iterdir()]
        data = ["head=classification", "data=imagefolder", f"data.root={root / 'tree'}"]
    else:
        files = make_coco(root / "coco", num_train=size, num_val=4, size=32)
        coco = json.loads(files["train_annotations"].read_text())
        keys = [image["file_name"] for image in coco["images"]]
        head = "head=coca" if name == "coco-coca" else "head=caption"
        data = [head, "trainer.precision=32-true", "data=coco", *[f"data.{k}={v}" for k, v in files.items()]]
        if name == "coco-bootstrap":
            human, pool = coco["images"][:16], [str(files["image_dir"] / k) for k in keys[16:]]
            ids = {image["id"] for image in human}
            annotations = [a for a in coco["annotations"] if a["image_id"] in ids]
            # a human caption of the teacher's words: the student's vocabulary (the human captions') spells its pool's
            words = " ".join(load_tokenizer(RunDir(teacher).vocab).words)
            annotations.append({"id": 10_000, "image_id": human[0]["id"], "caption": words})
            files["train_annotations"].write_text(json.dumps({"images": human, "annotations": annotations}))
            (root / "pool.txt").write_text("".join(f"{p}\n" for p in pool))
            data += [f"bootstrap.teacher={teacher}", f"bootstrap.images={root / 'pool.txt'}", "bootstrap.keep.top_k=5"]
            data.append("data.min_word_freq=1")
            keys = [*keys[:16], *(f"pool:{p}" for p in pool)]
    run = ["data.batch_size=4", "trainer.max_epochs=1", "test=false", "export_bundle=false"]
    return [*TINY, *data, *run, "+callbacks.sample_keys._target_=vitattn.training.callbacks.SampleKeys"], keys


# Every data path without loader workers (the fast run keeps the coco ones); with two, the human + pool mix. The
# other paths' workers resume in test_data_resume_ddp.py (coco and imagefolder, one a rank), test_preemption.py's DDP
# chain (shapes, one a rank) and on the loader itself (test_a_loader_state_mid_epoch_resumes_the_rest_of_the_epoch,
# two workers).
@pytest.mark.parametrize(
    ("name", "workers"),
    [
        ("coco", 0),
        ("coco-coca", 0),
        ("coco-bootstrap", 0),
        pytest.param("imagefolder", 0, marks=pytest.mark.slow),
        pytest.param("shapes", 0, marks=pytest.mark.slow),
        pytest.param("coco-bootstrap", 2, marks=pytest.mark.slow),
    ],
)
def test_a_preempted_epoch_in_one_process_trains_what_an_uninterrupted_one_does(name, workers, tmp_path, request):
    teacher = request.getfixturevalue("shapes_caption_run") if name == "coco-bootstrap" else None
    overrides, expected = _overrides(name, 24, tmp_path / "data", teacher)
    overrides.append(f"data.num_workers={workers}")
    train(compose_train([*overrides, f"+callbacks.sample_keys.folder={tmp_path / 'whole'}"], tmp_path / "whole_run"))
    whole = [k for _, _, ks in sample_keys(tmp_path / "whole") for k in ks]
    assert sorted(whole) == sorted(expected)  # the keys name each training sample once

    run, resumed = tmp_path / "run", [*overrides, f"+callbacks.sample_keys.folder={tmp_path / 'keys'}", "resume=auto"]
    command = [
        sys.executable,
        str(ROOT / "tests" / "helpers" / "preempted_train.py"),
        "SIGUSR1",
        "train",
        "2",
        str(run),
    ]
    proc = subprocess.run([*command, *resumed], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 3" in json.loads(proc.stdout.strip().splitlines()[-1])["preempted"]
    train(compose_train(resumed, run))
    steps = sample_keys(tmp_path / "keys")
    assert [s for _, s, _ in steps] == list(range(1, 7))  # steps 1..3, then 4..6 in the resumed run
    assert [k for _, _, ks in steps for k in ks] == whole  # the same samples, in the same order


def _stopped_and_resumed(overrides: list[str], step: int, tmp_path: Path) -> list[str]:
    """The sample keys of a run of ``overrides`` stopped after ``step`` with a step checkpoint there, then resumed
    from it in a new run (``ckpt_path``): both runs' keys, in order."""
    keys = f"+callbacks.sample_keys.folder={tmp_path / 'keys'}"
    overrides = [*overrides, f"callbacks.step_checkpoint.every_n_train_steps={step}"]
    train(compose_train([*overrides, keys, f"trainer.max_steps={step}"], tmp_path / "stopped"))
    checkpoint = tmp_path / "stopped" / "checkpoints" / f"step{step:06d}.ckpt"
    train(compose_train([*overrides, keys, f"ckpt_path={checkpoint}"], tmp_path / "resumed"))
    return [k for _, _, ks in sample_keys(tmp_path / "keys") for k in ks]


def _record_batches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, list[int]]]:
    """Each classification training step's ``(global step, digest of its batch, valid patches per image)``: the
    digest of the ``Patches``' patches, coordinates and validity and of the labels, as the step is given them."""
    seen: list[tuple[int, str, list[int]]] = []
    step = ClassificationSystem.training_step

    def recording(self, batch, batch_idx):
        (patches, coord, valid), labels = batch
        digest = hashlib.sha256()
        for tensor in (patches, coord, valid, labels):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        seen.append((self.global_step, digest.hexdigest(), valid.sum(1).tolist()))
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ClassificationSystem, "training_step", recording)
    return seen


def test_a_resumed_epoch_of_patches_is_augmented_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """``data.max_patches`` with augmentation, stopped mid-epoch and resumed from its step checkpoint: the resumed
    steps get the uninterrupted run's samples and crops, pixel for pixel (``SeededDraws``), though the crop draws
    from Python's ``random``, which no checkpoint holds."""
    overrides, expected = _overrides("imagefolder", 24, tmp_path / "data")
    # crops of aspects 1:2 to 2:1 of the square images: grids other than 4x4 (16 patches) once the augmentation runs
    overrides += ["data.max_patches=16", "data.augment.enabled=true", "data.augment.ratio=[0.5,2.0]"]
    overrides.append("data.num_workers=0")
    seen = _record_batches(monkeypatch)
    train(compose_train([*overrides, f"+callbacks.sample_keys.folder={tmp_path / 'whole'}"], tmp_path / "whole_run"))
    whole, whole_keys = list(seen), [k for _, _, ks in sample_keys(tmp_path / "whole") for k in ks]
    assert sorted(whole_keys) == sorted(expected) and len(whole) == 6
    assert len({n for _, _, counts in whole for n in counts}) > 1  # the augmentation ran

    seen.clear()
    assert _stopped_and_resumed(overrides, 3, tmp_path) == whole_keys
    assert seen[:3] == whole[:3]
    assert seen[3:] == whole[3:]  # steps 3 to 5, the resumed run's: the same pixels, crops and grids


def test_in_a_process_group_the_loader_workers_start_from_a_fork_server(tmp_path):
    """A fork of a process whose gloo threads hold the interpreter's locks can hang the child (CPython 3.11), so
    in a process group the workers start from a fork server; out of one, by fork; both hand out every sample."""

    def batches(dm):
        dm.setup("fit")
        loader = dm.train_dataloader()
        method = loader.multiprocessing_context and loader.multiprocessing_context.get_start_method()
        return method, sorted(int(i) for _, labels in loader for i in labels)

    settings = dict(task="classification", img_size=16, num_train=12, num_val=2, num_test=2, batch_size=4)
    alone, labels = batches(ShapesDataModule(**settings, num_workers=1))
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grouped, grouped_labels = batches(ShapesDataModule(**settings, num_workers=1))
    finally:
        torch.distributed.destroy_process_group()
    assert (alone, grouped) == (None, "forkserver")
    assert grouped_labels == labels and len(labels) == 12
