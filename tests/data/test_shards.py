"""WebDataset shards: listing, reading, counting, the epoch plan, and data=webdataset for both heads."""

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, compose_train
from vitattn.data.bad_images import PartialBatch
from vitattn.data.images import BadImageError
from vitattn.data.shards import ShardError, expand_shards, read_shard, shard_sizes
from vitattn.data.shards.epoch_split import EpochOrder, PositionSet, batches_per_rank, split_epoch
from vitattn.data.shards.writer import ShardSample, shapes_samples, write_shards
from vitattn.data.tokenizer import Vocabulary
from vitattn.training import train
from vitattn.training.datamodules import WebDatasetDataModule

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    """Shapes as shards: 50 train samples in shards of 12 (the last holds 2), 12 val samples in shards of 6."""
    root = tmp_path_factory.mktemp("shards")
    write_shards(shapes_samples("train", 50, img_size=32), root / "train", 12, class_names=_classes())
    write_shards(shapes_samples("val", 12, img_size=32), root / "val", 6, class_names=_classes())
    return {"train": root / "train", "val": root / "val", "cache": root / "cache"}


def _classes() -> list[str]:
    from vitattn.data.shapes import CLASS_NAMES

    return CLASS_NAMES


def _keys(url: str) -> list[str]:
    return [sample["__key__"] for sample in read_shard(url)]


def _datamodule(shards, **kwargs) -> WebDatasetDataModule:
    settings = dict(img_size=32, batch_size=4, num_workers=0, shuffle_buffer=8, count_cache=shards["cache"])
    return WebDatasetDataModule(str(shards["train"]), str(shards["val"]), **{**settings, **kwargs})


def test_expand_shards_reads_braces_lists_listing_files_and_folders(shards, tmp_path):
    train = shards["train"]
    braces = expand_shards(f"{train}/{{00000..00004}}.tar")
    assert braces == [f"{train}/{i:05d}.tar" for i in range(5)]
    assert expand_shards(str(train)) == braces  # a folder: its tars, sorted
    assert expand_shards([braces[0], f"{train}/{{00001..00004}}.tar"]) == braces
    listing = train / "shards.txt"
    listing.write_text("".join(f"{Path(u).name}\n" for u in braces))  # relative to the listing's folder
    assert expand_shards(str(listing)) == braces
    with pytest.raises(ValueError, match=r"^data.train_shards: shard .*00005.tar does not exist \(and 4 more\)"):
        expand_shards(f"{train}/{{00000..00009}}.tar", "data.train_shards")


def test_a_pipe_command_reads_the_same_samples_as_the_path(shards):
    path = f"{shards['train']}/00001.tar"
    assert _keys(f"pipe:cat {path}") == _keys(path) and len(_keys(path)) == 12


def test_shard_sizes_come_from_the_parquet_when_there_is_no_stats_file(tmp_path):
    write_shards(shapes_samples("train", 7, img_size=32), tmp_path, 4, parquet=True)
    for stats in tmp_path.glob("*_stats.json"):
        stats.unlink()
    (tmp_path / "00001.tar").write_bytes(b"")  # not read: the parquet's success rows are the count
    assert shard_sizes(expand_shards(str(tmp_path)), tmp_path / "cache") == [4, 3]


def test_shard_sizes_come_from_stats_or_one_cached_counting_pass(shards, tmp_path):
    urls = expand_shards(str(shards["train"]))
    stated = shard_sizes(urls)
    assert stated == [12, 12, 12, 12, 2]
    copies = tmp_path / "copies"
    copies.mkdir()
    for url in urls:  # the tars without their _stats.json: counted
        (copies / Path(url).name).write_bytes(Path(url).read_bytes())
    counted = shard_sizes(expand_shards(str(copies)), tmp_path / "cache")
    assert counted == stated
    assert sorted(p.name for p in copies.glob("*.offsets")) == [Path(u).name + ".offsets" for u in urls]
    piped = [f"pipe:cat {copies / Path(url).name}" for url in urls]  # a stream: counted, the count cached
    assert shard_sizes(piped, tmp_path / "cache") == stated
    cached = json.loads((tmp_path / "cache" / "shard_sizes.json").read_text())
    assert sorted(cached.values()) == sorted(stated)


@pytest.mark.parametrize(
    "total, world, workers, batch",
    [(50, 1, 1, 4), (50, 2, 2, 4), (50, 3, 2, 8), (7, 2, 3, 2), (101, 4, 1, 5), (64, 2, 2, 8)],
)
def test_split_epoch_gives_every_position_once_and_every_rank_the_same_batches(total, world, workers, batch):
    plans = split_epoch([(0, total)], world, workers, batch)
    positions = [p for rank in plans for plan in rank for a, b in plan.ranges for p in range(a, b)]
    assert sorted(positions) == list(range(total))
    counts = {sum(len(plan.batch_sizes) for plan in rank) for rank in plans}
    assert len(counts) == 1 and counts.pop() == batches_per_rank(total, world, batch)
    for rank in plans:
        for plan in rank:
            assert sum(plan.batch_sizes) == sum(b - a for a, b in plan.ranges)
            assert all(1 <= size <= batch for size in plan.batch_sizes)


@pytest.mark.parametrize("world, workers", [(1, 1), (2, 2), (3, 2)])
def test_a_resumed_epoch_trains_the_rest_once_in_no_more_batches_than_left(world, workers):
    total, batch, done_batches = 83, 4, 5
    plans = split_epoch([(0, total)], world, workers, batch)
    batches = len([s for plan in plans[0] for s in plan.batch_sizes])
    trained = PositionSet()
    for rank in plans:  # the first batches of each rank, in the order the loader takes them from its workers
        stream = [list(_batches(plan)) for plan in rank]
        order = [b for j in range(batches) for b in ([stream[j % workers].pop(0)] if stream[j % workers] else [])]
        for positions in order[:done_batches]:
            trained.add(positions)
    rest = split_epoch(trained.complement(total), world, workers, batch)
    again = [p for rank in rest for plan in rank for a, b in plan.ranges for p in range(a, b)]
    assert sorted(again + [p for a, b in trained.ranges for p in range(a, b)]) == list(range(total))
    assert all(sum(len(plan.batch_sizes) for plan in rank) <= batches - done_batches for rank in rest)
    for world2, workers2 in ((1, 3), (4, 1)):  # resumed on another number of ranks or workers: still once
        other = split_epoch(trained.complement(total), world2, workers2, batch)
        again = [p for rank in other for plan in rank for a, b in plan.ranges for p in range(a, b)]
        assert sorted(again + [p for a, b in trained.ranges for p in range(a, b)]) == list(range(total))


def _batches(plan):
    positions = [p for a, b in plan.ranges for p in range(a, b)]
    for size in plan.batch_sizes:
        yield positions[:size]
        positions = positions[size:]


def test_when_ranks_cannot_have_equal_batches_fewer_than_the_ranks_are_left_out_not_repeated(caplog):
    plans = split_epoch([(0, 7)], 2, 1, 1)  # batch_size 1: 4 + 3 samples cannot make equal batch counts
    positions = [p for rank in plans for plan in rank for a, b in plan.ranges for p in range(a, b)]
    assert sorted(positions) == list(range(6)) and [len(rank[0].batch_sizes) for rank in plans] == [3, 3]
    assert "the last 1 are left out of this epoch" in caplog.text


def test_the_shard_order_changes_with_the_epoch_and_is_the_same_for_the_same_epoch():
    sizes = [10] * 20
    assert EpochOrder(sizes, seed=1, epoch=0).order == EpochOrder(sizes, seed=1, epoch=0).order
    assert EpochOrder(sizes, seed=1, epoch=0).order != EpochOrder(sizes, seed=1, epoch=1).order
    assert EpochOrder(sizes, shuffle=False).order == list(range(20))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("task", ["caption", "classification"])
def test_an_epoch_gives_every_sample_once_for_both_heads(shards, task, workers):
    dm = _datamodule(shards, task=task, num_workers=workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = list(loader)
    keys = [k for b in batches for k in b.keys]
    expected = [k for url in expand_shards(str(shards["train"])) for k in _keys(url)]
    assert sorted(keys) == sorted(expected) and len(batches) == len(loader) == 13
    first = batches[0].batch
    if task == "caption":
        assert first["images"].shape == (4, 3, 32, 32) and set(first["caption_image"].tolist()) == {0, 1, 2, 3}
        assert len(first["tokens"]) == sum(map(len, first["references"]))  # captions_per_image=all
        assert len(dm.vocab) > 10
    else:
        images, labels = first
        assert images.shape == (4, 3, 32, 32) and labels.dtype == torch.long and dm.num_classes == 15


def test_classification_labels_are_the_cls_members(shards):
    dm = _datamodule(shards, task="classification", shuffle_buffer=0, augment=False)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    url = expand_shards(str(shards["val"]))[0]
    expected = [int(s["cls"]) for s in read_shard(url)][:4]
    assert batch.batch[1].tolist() == expected


def _write(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _jpeg() -> bytes:
    return next(shapes_samples("train", 1, img_size=32)).image


def test_caption_key_reads_the_caption_from_the_json(tmp_path):
    _write(
        tmp_path / "00000.tar",
        {"a.jpg": _jpeg(), "a.json": json.dumps({"alt": "a zebra"}).encode(), "a.txt": b"a horse"},
    )
    for key, word in ((None, "horse"), ("alt", "zebra")):
        dm = WebDatasetDataModule(
            str(tmp_path), str(tmp_path), img_size=32, batch_size=1, num_workers=0, caption_key=key, min_word_freq=1
        )
        dm.setup("fit")
        assert word in dm.vocab.words
        assert next(iter(dm.train_dataloader())).batch["references"] == [[f"a {word}"]]


def _bad_shards(folder: Path) -> None:
    """A good sample, a corrupt image, a sample without caption; then a truncated shard."""
    folder.mkdir()
    image = _jpeg()
    _write(folder / "00000.tar", {"a.jpg": image, "a.txt": b"a circle", "b.jpg": b"not a jpeg", "b.txt": b"a square"})
    _write(folder / "00001.tar", {"c.jpg": image, "c.txt": b"a circle", "d.jpg": image})


def test_bad_samples_raise_naming_shard_and_key(tmp_path):
    _bad_shards(tmp_path / "bad")
    dm = WebDatasetDataModule(str(tmp_path / "bad"), str(tmp_path / "bad"), img_size=32, batch_size=4, num_workers=0)
    dm.setup("fit")
    with pytest.raises(BadImageError, match=r"bad/0000[01].tar: [bd]: (no .txt caption|not an image).*bad_images=skip"):
        list(dm.train_dataloader())


def test_bad_samples_are_skipped_and_counted(tmp_path):
    _bad_shards(tmp_path / "bad")
    dm = WebDatasetDataModule(
        str(tmp_path / "bad"), str(tmp_path / "bad"), img_size=32, batch_size=4, num_workers=0, bad_images="skip"
    )
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    assert isinstance(batch.batch, PartialBatch) and sorted(batch.keys) == ["a", "b", "c", "d"]
    reasons = sorted(item.reason for item in batch.batch.skipped)
    assert reasons == ["no .txt caption", "not an image (unrecognised file format)"]
    assert batch.batch.batch["images"].shape[0] == 2


def test_a_truncated_shard_raises_or_its_missing_samples_are_skipped(tmp_path):
    folder = tmp_path / "cut"
    write_shards((ShardSample(_jpeg(), "jpg", [f"a shape {i}"]) for i in range(6)), folder, 6)
    data = (folder / "00000.tar").read_bytes()
    (folder / "00000.tar").write_bytes(data[: len(data) // 2])  # the stats still say 6
    dm = WebDatasetDataModule(str(folder), str(folder), img_size=32, batch_size=6, num_workers=0, vocab_path=None)
    with pytest.raises((ShardError, ValueError), match=r"00000.tar"):
        dm.setup("fit")  # the vocabulary pass reads the shard first
        list(dm.train_dataloader())
    dm = WebDatasetDataModule(
        str(folder), str(folder), img_size=32, batch_size=6, num_workers=0, bad_images="skip", min_word_freq=1
    )
    dm.vocab = Vocabulary(["a", "shape"])  # a trained model's vocabulary: no pass over the captions
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    skipped = batch.batch.skipped
    cut = r"00000.tar (is unreadable|holds \d samples, fewer than the 6 counted)"  # where the cut falls decides
    assert 0 < len(skipped) < 6 and all(re.search(cut, s.reason) for s in skipped)
    assert len(batch.positions) == 6  # every position of the epoch accounted for


def test_a_shard_that_is_not_a_tar_raises_or_its_samples_are_skipped(tmp_path):
    folder = tmp_path / "broken"
    write_shards((ShardSample(_jpeg(), "jpg", [f"a shape {i}"]) for i in range(4)), folder, 2)
    (folder / "00001.tar").write_bytes(b"this is not a tar file" * 100)  # its stats still say 2
    settings = dict(img_size=32, batch_size=4, num_workers=0, shuffle_buffer=0)
    dm = WebDatasetDataModule(str(folder), str(folder), **settings)
    dm.vocab = Vocabulary(["a", "shape"])
    dm.setup("fit")
    with pytest.raises(ShardError, match=r"^shard .*00001.tar is unreadable: .*; data.bad_images=skip"):
        list(dm.train_dataloader())
    dm = WebDatasetDataModule(str(folder), str(folder), bad_images="skip", **settings)
    dm.vocab = Vocabulary(["a", "shape"])
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    assert len(batch.batch.skipped) == 2 and batch.batch.batch["images"].shape[0] == 2


def test_the_vocabulary_is_built_from_every_train_reference_with_min_word_freq_auto(shards):
    dm = _datamodule(shards, min_word_freq="auto")
    dm.setup("fit")
    samples = [s for url in expand_shards(str(shards["train"])) for s in read_shard(url)]
    references = [c for s in samples for c in json.loads(s["json"])["captions"]]  # training draws from them all
    assert dm.vocab == Vocabulary.build(references, min_freq="auto")
    first = Vocabulary.build([s["txt"].decode() for s in samples], min_freq="auto")
    assert "right" in dm.vocab.tokens(dm.vocab.encode("right")) and len(dm.vocab) > len(first)


def test_train_on_shards_and_the_schedule_horizon_follows_the_epoch(shards, tmp_path):
    overrides = [
        *TINY,
        "head=classification",
        "data=webdataset",
        f"data.train_shards={shards['train']}",
        f"data.val_shards={shards['val']}",
        "data.num_workers=0",
        f"data.count_cache={shards['cache']}",
        "data.batch_size=8",
        "trainer.max_epochs=2",
        "test=false",
        "export_bundle=false",
    ]
    result = train(compose_train(overrides, tmp_path))
    assert result.global_step == 2 * 7  # 50 samples in batches of at most 8
    schedule = result.system.lr_schedulers().lr_lambdas[0]
    assert schedule.total_steps == 14


@pytest.mark.slow  # a training process of its own; the slow tests also run it under DDP
def test_a_preempted_epoch_resumes_with_every_sample_once_in_one_process(shards, tmp_path):
    overrides = [
        *TINY,
        "head=classification",
        "data=webdataset",
        f"data.train_shards={shards['train']}",
        f"data.val_shards={shards['val']}",
        "data.num_workers=2",
        f"data.count_cache={shards['cache']}",
        "data.batch_size=4",
        "trainer.max_epochs=1",
        "test=false",
        "export_bundle=false",
        "resume=auto",
        "+callbacks.sample_keys._target_=vitattn.training.callbacks.SampleKeys",
        f"+callbacks.sample_keys.folder={tmp_path / 'keys'}",
    ]
    # SIGUSR1 during step 3, to a subprocess (tests/helpers/preempted_train.py), never to pytest
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        str(ROOT / "tests" / "helpers" / "preempted_train.py"),
        "SIGUSR1",
        "train",
        "3",
        str(tmp_path),
    ]
    proc = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4" in json.loads(proc.stdout.strip().splitlines()[-1])["preempted"]
    train(compose_train(overrides, tmp_path))
    lines = (tmp_path / "keys" / "keys.rank0.txt").read_text().splitlines()
    keys = [k for line in lines for k in line.split()[1:]]
    expected = [k for url in expand_shards(str(shards["train"])) for k in _keys(url)]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(expected)


def test_a_checkpoint_of_other_shards_starts_the_epoch_over(shards, caplog):
    dm = _datamodule(shards, task="classification")
    dm.setup("fit")
    dm.epoch, dm.trained = 0, PositionSet([(0, 10)])
    state = dm.state_dict()
    same = _datamodule(shards, task="classification")
    same.setup("fit")
    same.load_state_dict(state)
    assert same._resume["trained"] == [[0, 10]]
    fewer = WebDatasetDataModule(
        f"{shards['train']}/{{00000..00003}}.tar", str(shards["val"]), task="classification", num_workers=0
    )
    fewer.setup("fit")
    fewer.load_state_dict(state)
    assert fewer._resume is None and "the train shards (or data.samples_per_epoch) changed" in caplog.text


def test_vitattn_shards_writes_an_image_folder_as_shards(tmp_path, capsys):
    from vitattn.cli.write_shards import main

    make_image_folder(tmp_path / "tree", per_class=5)
    args = ["source=folder", f"folder={tmp_path / 'tree' / 'train'}", f"out={tmp_path / 'out'}", "samples_per_shard=4"]
    assert main(args) == 0, capsys.readouterr().err
    urls = expand_shards(str(tmp_path / "out"))
    assert len(urls) == 3 and shard_sizes(urls) == [4, 4, 2]
    samples = [s for url in urls for s in read_shard(url)]
    labels = Counter(int(s["cls"]) for s in samples)
    assert labels == {0: 5, 1: 5} and (tmp_path / "out" / "classes.txt").read_text() == "cat\ndog\n"
    source = json.loads(samples[0]["json"])["source"]
    assert samples[0]["png"] == Path(source).read_bytes()  # the file as it is, not re-encoded


@pytest.mark.parametrize("kind", ["words", "bpe"])
def test_a_restart_reads_no_training_shard_to_build_its_tokenizer(kind, shards, tmp_path, monkeypatch):
    import vitattn.training.datamodules.webdataset as webdataset

    overrides = [
        *TINY,
        "head=caption",
        f"tokenizer={kind}",
        "data=webdataset",
        f"data.train_shards={shards['train']}",
        f"data.val_shards={shards['val']}",
        "data.num_workers=0",
        f"data.count_cache={shards['cache']}",
        "data.batch_size=8",
        "test=false",
        "export_bundle=false",
        "resume=auto",
        "trainer.max_epochs=-1",
    ]
    reads = []
    read_captions = webdataset.shard_captions
    monkeypatch.setattr(webdataset, "shard_captions", lambda *a, **k: reads.append(a) or read_captions(*a, **k))
    first = train(compose_train([*overrides, "trainer.max_steps=2"], tmp_path))
    assert len(reads) == 1 and first.global_step == 2  # the first start read the training captions once
    restarted = train(compose_train([*overrides, "trainer.max_steps=4"], tmp_path))
    assert len(reads) == 1 and restarted.global_step == 4  # the restart read the run's tokenizer instead
    assert restarted.system.vocab == first.system.vocab
