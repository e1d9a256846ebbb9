"""Shards read once: a worker reads the headers of the samples it does not train, never their bytes, and streamed
shards go whole to workers where there are enough of them."""

import io
import os
import tarfile
from pathlib import Path

import pytest

import vitattn.data.shards.reading as reading
from vitattn.data.shards import expand_shards, read_shard, shard_sizes
from vitattn.data.shards.epoch_split import EpochOrder, PositionSet, read_factor, split_epoch
from vitattn.data.shards.reading import INDEX_SUFFIX, ShardError, build_index, index_files, open_index, read_samples
from vitattn.data.shards.stream import ShardSamples, ShardStream
from vitattn.data.shards.writer import shapes_samples, write_shards


class _CountedFile(io.FileIO):
    """A shard file that notes each read as ``(position, bytes)`` in ``reads`` (an index file's: ``index_reads``)."""

    reads: list[tuple[int, int]] = []
    index_reads: list[tuple[int, int]] = []

    def read(self, size: int = -1) -> bytes:
        at, data = self.tell(), super().read(size)
        self._log().append((at, len(data)))
        return data

    def readinto(self, buffer) -> int:
        at, n = self.tell(), super().readinto(buffer)
        self._log().append((at, n or 0))
        return n

    def _log(self) -> list[tuple[int, int]]:
        return self.index_reads if str(self.name).endswith(INDEX_SUFFIX) else self.reads


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """The reads of every local shard opened in the test."""
    log: list[tuple[int, int]] = []
    monkeypatch.setattr(_CountedFile, "reads", log)
    monkeypatch.setattr(_CountedFile, "index_reads", [])
    monkeypatch.setattr(reading, "open_shard", lambda url: _CountedFile(url, "rb"))
    return log


def _members(path: str) -> list[tuple[int, int, int, int]]:
    """``(sample, header start, data start, size)`` of each file of a tar (``tarfile``: an oracle), samples
    counted where the key (the name up to its first dot) changes."""
    out, key, sample = [], None, -1
    with tarfile.open(path) as tar:
        for m in tar:
            if m.isreg():
                name = m.name.split(".", 1)[0]
                sample += name != key
                key = name
                out.append((sample, m.offset, m.offset_data, m.size))
    return out


def _expected(path: str, wanted: set[int]) -> tuple[int, list[tuple[int, int]]]:
    """The bytes a reader of the ``wanted`` samples needs: the first header (is it a plain tar?), every header
    up to the first of the sample after the last wanted one, and the wanted samples' bytes; and where they lie."""
    members, last = _members(path), max(wanted)
    headers = [(h, d - h) for s, h, d, _ in members if s <= last + 1 and (s <= last or h == _first_of(members, s))]
    data = [(d, n) for s, _, d, n in members if s in wanted]
    end = [(members[-1][2] + members[-1][3] + 511) // 512 * 512] if last == members[-1][0] else []
    total = 512 + sum(n for _, n in headers + data) + 512 * len(end)
    return total, [*headers, *data, *((e, 512) for e in end), (0, 512)]


def _first_of(members, sample: int) -> int:
    return next(h for s, h, _, _ in members if s == sample)


def _inside(read: tuple[int, int], places: list[tuple[int, int]]) -> bool:
    return any(a <= read[0] and read[0] + read[1] <= a + n for a, n in places)


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    """One shard of 40 shapes samples (jpg, txt, json and cls members)."""
    folder = tmp_path_factory.mktemp("shard")
    write_shards(shapes_samples("train", 40, img_size=32), folder, 40, class_names=[str(i) for i in range(15)])
    (url,) = expand_shards(str(folder))
    return url


@pytest.mark.parametrize("wanted", [[0, 1, 2], [25, 26, 30, 31], [38, 39]])
def test_read_samples_reads_headers_and_the_wanted_samples_bytes_only(shard, reads, wanted):
    every = list(read_shard(shard))
    reads.clear()
    assert list(read_samples(shard, wanted)) == [(o, every[o]) for o in wanted]
    total, places = _expected(shard, set(wanted))
    assert all(_inside(r, places) for r in reads), [r for r in reads if not _inside(r, places)][:3]
    assert sum(n for _, n in reads) == total  # and no byte twice


def test_a_worker_of_a_local_shard_reads_no_image_of_another_workers_samples(shard, reads):
    order = EpochOrder([40], shuffle=False)
    plans = split_epoch([(0, 40)], 1, 3, 4)  # three workers: 16, 12 and 12 samples
    samples = ShardSamples("classification", lambda image: image.size, num_classes=15)
    stream = ShardStream([shard], [40], samples, lambda items: items, shuffle_buffer=8)
    for plan in plans[0]:
        reads.clear()
        stream.configure(order, [plan], len(plan.batch_sizes), "0")
        positions = [p for batch in stream for p in batch.positions]
        assert sorted(positions) == [p for a, b in plan.ranges for p in range(a, b)]
        total, places = _expected(shard, set(positions))
        assert sum(n for _, n in reads) == total and all(_inside(r, places) for r in reads)


@pytest.mark.parametrize("with_index", [False, True])
def test_a_resumed_worker_reads_nothing_of_the_samples_trained_already(shard, reads, request, with_index):
    url = request.getfixturevalue("indexed") if with_index else shard
    reads.clear()
    trained = PositionSet([(0, 10), (12, 13), (20, 27)])  # what a checkpoint says, holes and all
    order = EpochOrder([40], shuffle=False)
    (plan,) = split_epoch(trained.complement(40), 1, 1, 4)[0]
    samples = ShardSamples("classification", lambda image: image.size, num_classes=15)
    stream = ShardStream([url], [40], samples, lambda items: items, shuffle_buffer=8)
    stream.configure(order, [plan], len(plan.batch_sizes), "0")
    first = next(iter(stream))
    assert not set(first.positions) & {p for a, b in trained.ranges for p in range(a, b)}
    trained_bytes = [(d, n) for s, _, d, n in _members(url) if s in trained]
    assert not [r for r in reads if any(a < r[0] + r[1] and r[0] < a + n for a, n in trained_bytes)]
    if with_index:  # not their headers either
        left = _samples_bytes(url, {p for p in range(40) if p not in trained})
        assert reads and all(_inside(r, left) for r in reads)
        assert min(at for at, _ in reads) == left[0][0]


def test_counting_a_shard_reads_its_headers_only(shard, reads, tmp_path):
    copy = tmp_path / Path(shard).name  # without its _stats.json: counted
    copy.write_bytes(Path(shard).read_bytes())
    assert shard_sizes([str(copy)], tmp_path / "cache") == [40]
    members = _members(shard)
    assert sum(n for _, n in reads) == 512 + sum(d - h for _, h, d, _ in members) + 512  # + the check, the end


@pytest.mark.parametrize("indexed", [False, True])
def test_read_samples_tells_samples_apart_as_group_by_keys_does(tmp_path, indexed):
    long = "long/" + "y" * 120
    names = ["a.jpg", "a.TXT", "dir/b.x.jpg", "dir/b.x.txt", "noext", "c.jpg", "a.jpg", "a.cls", f"{long}.jpg"]
    names += [f"{long}.txt", "d.e.f.jpg", "zz"]
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as tar:  # pax: the long name in an extended header before its member
        for i, name in enumerate(names):
            data = f"{name} {i}".encode() * (i * 50 + 1)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    every = list(read_shard(f"pipe:cat {path}"))  # webdataset's own tarfile and group_by_keys
    assert [s["__key__"] for s in every] == ["a", "dir/b", "c", "a", long, "d"]
    if indexed:
        assert build_index(path) == len(every)
    for offsets in [[o] for o in range(len(every))] + [[1, 2, 4], [0, 5], list(range(len(every)))]:
        got = list(read_samples(str(path), offsets))
        assert [o for o, _ in got] == offsets
        for offset, sample in got:
            assert {k: v for k, v in sample.items() if k != "__url__"} == {
                k: v for k, v in every[offset].items() if k != "__url__"
            }


@pytest.fixture
def indexed(shard, tmp_path) -> str:
    """A copy of the 40-sample shard with its index beside it, written by the listing step."""
    copy = tmp_path / "indexed" / Path(shard).name
    copy.parent.mkdir()
    copy.write_bytes(Path(shard).read_bytes())
    assert shard_sizes([str(copy)], tmp_path / "cache") == [40]
    assert copy.with_name(copy.name + INDEX_SUFFIX).is_file()
    return str(copy)


def _samples_bytes(path: str, wanted: set[int]) -> list[tuple[int, int]]:
    """Where the headers and bytes of the ``wanted`` samples' members lie (padding left out)."""
    return [(h, d - h + n) for s, h, d, n in _members(path) if s in wanted]


@pytest.mark.parametrize("wanted", [[0, 1, 2], [25, 26, 30, 31], [38, 39], [17]])
def test_with_its_index_a_worker_reads_its_samples_bytes_and_nothing_before_them(indexed, reads, wanted):
    every = list(read_shard(indexed))
    reads.clear()
    assert list(read_samples(indexed, wanted)) == [(o, every[o]) for o in wanted]
    places = _samples_bytes(indexed, set(wanted))
    first = places[0][0]
    assert sum(n for at, n in reads if at < first) == 0  # not a header, not the tar's first block
    assert all(_inside(r, places) for r in reads), [r for r in reads if not _inside(r, places)][:3]
    assert sum(n for _, n in reads) == sum(n for _, n in places)
    offsets = 8 * (wanted[-1] - wanted[0] + 2)  # the index's offsets from the first sample to after the last
    assert sum(n for _, n in _CountedFile.index_reads) == 32 + offsets


def _rewrite(path: str, count: int, tmp_path: Path) -> None:
    """``path`` written again with ``count`` other samples."""
    folder = tmp_path / f"rewrite{count}"
    write_shards(shapes_samples("val", count, img_size=32), folder, count, class_names=[str(i) for i in range(15)])
    Path(path).write_bytes(Path(expand_shards(str(folder))[0]).read_bytes())


def test_a_rewritten_shard_is_never_read_by_its_old_index_and_the_listing_indexes_it_again(indexed, tmp_path):
    _rewrite(indexed, 30, tmp_path)
    with open_index(indexed) as index:
        assert index is None
    every = list(read_shard(indexed))
    assert [s["__key__"] for _, s in read_samples(indexed, [5, 29])] == [every[5]["__key__"], every[29]["__key__"]]
    assert shard_sizes([indexed], tmp_path / "cache") == [30]
    with open_index(indexed) as index:
        assert index is not None and index.count == 30


def test_a_shard_touched_with_the_same_size_is_indexed_again(indexed, tmp_path):
    stat = os.stat(indexed)
    os.utime(indexed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with open_index(indexed) as index:
        assert index is None
    assert shard_sizes([indexed], tmp_path / "cache") == [40]
    with open_index(indexed) as index:
        assert index is not None


@pytest.mark.parametrize("damage", ["truncated", "empty", "offsets out of order", "other magic"])
def test_a_damaged_index_is_not_used_and_the_listing_writes_it_again(indexed, tmp_path, reads, damage):
    file = index_files(indexed)[0]
    data = bytearray(file.read_bytes())
    if damage == "truncated":
        data = data[:-5]
    elif damage == "empty":
        data = bytearray()
    elif damage == "offsets out of order":
        data[32 + 8 * 10 : 32 + 8 * 12] = data[32 + 8 * 11 : 32 + 8 * 12] + data[32 + 8 * 10 : 32 + 8 * 11]
    else:
        data[:8] = b"NOTANIDX"
    file.write_bytes(bytes(data))
    every = list(read_shard(indexed))
    reads.clear()
    assert list(read_samples(indexed, [10, 11, 12])) == [(o, every[o]) for o in (10, 11, 12)]
    assert min(at for at, _ in reads) == 0  # the headers from the shard's start: the index was not used
    assert shard_sizes([indexed], tmp_path / "cache") == [40]
    assert file.read_bytes() != bytes(data) or damage == "offsets out of order"


def test_an_index_that_does_not_match_its_shard_is_one_line_naming_the_shard(indexed):
    file = index_files(indexed)[0]
    data = bytearray(file.read_bytes())
    start = [data[32 + 8 * i : 40 + 8 * i] for i in range(41)]
    data[32 + 8 * 3 : 32 + 8 * 5] = start[4] + start[6]  # sample 3 said to run from where 4 starts to 6's start
    file.write_bytes(bytes(data))
    with pytest.raises(ShardError) as err:
        list(read_samples(indexed, [3]))
    assert indexed in str(err.value) and "\n" not in str(err.value)


def test_a_shard_in_a_folder_that_cannot_be_written_has_its_index_in_the_cache(indexed, tmp_path, reads, monkeypatch):
    beside, cached = index_files(indexed, tmp_path / "cache")
    beside.unlink()
    write = reading.atomic_write

    def read_only_folder(path, data):
        if Path(path).parent == beside.parent:
            raise PermissionError(f"[Errno 13] Permission denied: '{path}'")
        return write(path, data)

    monkeypatch.setattr(reading, "atomic_write", read_only_folder)
    assert shard_sizes([indexed], tmp_path / "cache") == [40]
    assert not beside.exists() and cached.is_file()
    reads.clear()
    assert [o for o, _ in read_samples(indexed, [20, 21], index_dir=tmp_path / "cache")] == [20, 21]
    assert min(at for at, _ in reads) == _samples_bytes(indexed, {20})[0][0]


def _stream_order(counts: list[int], seed: int = 0) -> EpochOrder:
    return EpochOrder(counts, seed=seed, epoch=1)


@pytest.mark.parametrize("shards, world, workers, batch", [(12, 2, 3, 8), (30, 4, 2, 16), (7, 1, 7, 3)])
def test_streamed_shards_go_whole_to_workers_every_sample_once(shards, world, workers, batch):
    counts = [40 + 7 * (i % 5) for i in range(shards)]
    order = _stream_order(counts)
    plans = split_epoch([(0, order.total)], world, workers, batch, order)
    positions = [p for rank in plans for plan in rank for a, b in plan.ranges for p in range(a, b)]
    assert sorted(positions) == list(range(order.total))
    owners = {}
    for r, rank in enumerate(plans):
        for w, plan in enumerate(rank):
            for shard, _ in order.shard_runs(plan.ranges):
                assert owners.setdefault(shard, (r, w)) == (r, w)  # one worker a shard
            assert sum(plan.batch_sizes) == sum(b - a for a, b in plan.ranges)
            assert all(1 <= size <= batch for size in plan.batch_sizes)
    batches = {sum(len(plan.batch_sizes) for plan in rank) for rank in plans}
    assert len(batches) == 1  # the ranks step together
    (k,) = batches
    assert all(len(plan.batch_sizes) == len(range(w, k, workers)) for rank in plans for w, plan in enumerate(rank))
    assert read_factor(order, plans) == 1.0


def test_too_few_streamed_shards_keep_the_even_split_whose_reads_the_factor_counts():
    order = _stream_order([100] * 5)
    plans = split_epoch([(0, 500)], 2, 4, 10, order)  # 5 shards, 8 workers
    assert plans == split_epoch([(0, 500)], 2, 4, 10)
    read = 0
    for plan in (plan for rank in plans for plan in rank):  # each shard from its start to the worker's last
        last: dict[int, int] = {}
        for p in (p for a, b in plan.ranges for p in range(a, b)):
            shard, offset = order.locate(p)
            last[shard] = max(last.get(shard, 0), offset + 1)
        read += sum(last.values())
    assert read_factor(order, plans) == pytest.approx(read / 500) and read > 1.5 * 500


@pytest.fixture(scope="module")
def piped(tmp_path_factory) -> list[str]:
    """Five shards (47 samples: four of 10, one of 7), named as ``pipe:cat`` commands."""
    folder = tmp_path_factory.mktemp("piped")
    write_shards(shapes_samples("train", 47, img_size=32), folder, 10, class_names=[str(i) for i in range(15)])
    return [f"pipe:cat {url}" for url in expand_shards(str(folder))]


def _piped_datamodule(piped: list[str], tmp_path: Path, workers: int):
    from vitattn.training.datamodules import WebDatasetDataModule

    settings = dict(task="classification", img_size=32, batch_size=4, shuffle_buffer=4, count_cache=tmp_path)
    settings["class_names"] = [str(i) for i in range(15)]
    dm = WebDatasetDataModule(piped, piped, num_workers=workers, **settings)
    dm.setup("fit")
    return dm


def test_an_epoch_of_pipe_shards_reads_each_shard_once_in_as_many_batches_as_its_length(piped, tmp_path, caplog):
    dm = _piped_datamodule(piped, tmp_path, workers=2)  # 5 shards for 2 workers: whole shards
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) and sorted(p for b in batches for p in b.positions) == list(range(47))
    stream = dm.train_dataset
    assert [read_factor(stream.order, [stream.plans])] == [1.0] and "read" not in caplog.text


def test_too_few_pipe_shards_for_the_workers_warn_once_naming_the_read_factor(piped, tmp_path, caplog):
    dm = _piped_datamodule(piped, tmp_path, workers=8)  # planned, not run: 5 shards for 8 workers
    dm._plan(dm.train_dataset, True)
    dm._plan(dm.train_dataset, True)
    warnings = [r.getMessage() for r in caplog.records if "per sample trained" in r.getMessage()]
    assert len(warnings) == 1 and "5 shards are fewer than the 1 ranks x 8 loader workers" in warnings[0]
    factor = read_factor(dm.train_dataset.order, [dm.train_dataset.plans])
    assert f"read {factor:.2f}x" in warnings[0] and factor > 1.05
