"""Shards read once: bytes read in an epoch over the dataset's bytes, on 64 ranks x 8 loader workers.

    python -m benchmarks.shard_reads_bench                         # the table in docs/benchmarks.md (~1 min)
    python -m benchmarks.shard_reads_bench --samples-per-shard 500 --workers-read 8   # a smoke run

The plans are simulated: ``split_epoch`` for 100 and 1,000 shards of ``--samples-per-shard`` samples, on 64
ranks x 8 workers, batches of 256. The reads are real on a sample: one shard file is written with members of
the sizes img2dataset writes (``KEY.jpg`` of about ``--jpeg-kb`` KB, log-normal; ``KEY.txt``; ``KEY.json``),
every simulated shard stands for it, and ``--workers-read`` of the 512 workers (drawn at random) read
their plans from it through ``read_samples`` with the file's reads counted. A factor is the bytes those
workers read over the bytes (headers and padding included) of the samples they train:

- before: each worker reads its shards from the start to its last sample (what a worker read before; a
  ``pipe:`` stream still must), counted from the member offsets;
- local tars, headers: header skipping (``read_samples`` without a member index), real reads;
- local tars, with index: ``read_samples`` with the shard's member index (``.offsets``, written once by the
  listing step), real reads of the shard and of the index file both;
- ``pipe:``: the plan streamed shards get (whole shards to workers from 512 shards on, else the even
  split and its warning), counted from the member offsets as for "before";
- a resumed epoch (half trained, the holes of a shuffle buffer of 1,000 in every worker's run): the local
  reads of the rest of the epoch over the bytes of the samples left, real reads, without and with the index.

Writing the index (once a shard, not every epoch) reads the shard's headers: ``index_pass`` is that over
the shard's bytes.

Writes a Markdown table to stdout and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
import tempfile
from pathlib import Path
from unittest import mock

import vitattn.data.shards.reading as reading
from vitattn.data.shards.epoch_split import EpochOrder, PositionSet, read_factor, split_epoch
from vitattn.data.shards.reading import build_index, index_files, read_samples

RANKS, WORKERS, BATCH = 64, 8, 256


class _Counted(io.FileIO):
    """A shard file that adds the bytes each read returns to ``total``."""

    total = 0

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        _Counted.total += len(data)
        return data


def write_shard(path: Path, samples: int, jpeg_kb: float, seed: int = 0) -> None:
    """A shard of ``samples`` samples: a JPEG-sized ``.jpg`` (random bytes: nothing is decoded), ``.txt``, ``.json``."""
    rng = random.Random(seed)
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            key = f"{i:09d}"
            jpg = int(rng.lognormvariate(0, 0.5) * jpeg_kb * 1000 / 1.13)  # the log-normal's mean is 1.13
            caption = b"a photo of " + b"x" * rng.randint(20, 120)
            meta = json.dumps({"key": key, "caption": "x" * rng.randint(40, 160), "width": 256}).encode()
            for ext, data in (("jpg", rng.randbytes(jpg)), ("txt", caption), ("json", meta)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


class Layout:
    """Where each sample of the shard file starts and ends (``tarfile``), and its bytes."""

    def __init__(self, path: Path) -> None:
        starts, key = [], None
        with tarfile.open(path) as tar:
            members = [m for m in tar if m.isreg()]
        for m in members:
            if m.name.split(".")[0] != key:
                key = m.name.split(".")[0]
                starts.append(m.offset)
        self.starts = [*starts, path.stat().st_size - 1024]  # the two zero blocks at the end
        self.size = path.stat().st_size

    def bytes_of(self, a: int, b: int) -> int:
        """The bytes of samples ``a .. b-1``, headers and padding included."""
        return self.starts[b] - self.starts[a]

    def streamed(self, last: int) -> int:
        """What a stream reads to give sample ``last``: everything up to it and the next header."""
        return self.starts[last + 1] + 512


def _runs(order: EpochOrder, plan) -> list[tuple[int, list[tuple[int, int]]]]:
    return order.shard_runs(plan.ranges)


def _sampled(plans, count: int):
    """``count`` of the plans, drawn at random (the same ranks and workers for every plan of the run)."""
    flat = [plan for rank in plans for plan in rank]
    return [flat[i] for i in sorted(random.Random(1).sample(range(len(flat)), min(count, len(flat))))]


def factors(path: Path, layout: Layout, shards: int, per_shard: int, count: int) -> dict:
    order = EpochOrder([per_shard] * shards, seed=0, epoch=1)
    even = split_epoch([(0, order.total)], RANKS, WORKERS, BATCH)
    piped = split_epoch([(0, order.total)], RANKS, WORKERS, BATCH, order)
    out = {"shards": shards, "samples": order.total}
    for name, plans in (("before", even), ("pipe", piped)):
        read = trained = 0
        for plan in _sampled(plans, count):
            for _, offsets in _runs(order, plan):
                read += layout.streamed(offsets[-1][1] - 1)
                trained += sum(layout.bytes_of(a, b) for a, b in offsets)
        out[name] = read / trained
    out["pipe_whole"] = piped != even
    out["pipe_samples_factor"] = read_factor(order, piped)
    trained = _half_trained(order.total)
    rest = split_epoch(trained.complement(order.total), RANKS, WORKERS, BATCH)
    for indexed in (False, True):
        name = "index" if indexed else "local"
        out[name] = _local(path, layout, order, _sampled(even, count), indexed)
        out[f"resumed_{name}"] = _local(path, layout, order, _sampled(rest, count), indexed)
    return out


def _local(path: Path, layout: Layout, order: EpochOrder, plans, indexed: bool) -> float:
    """Real bytes read by ``plans`` from the shard file (every shard stands for it), and from its index where
    ``indexed``, over the bytes trained."""
    index = index_files(path)[0]
    if indexed and not index.exists():
        build_index(path)
    elif not indexed:
        index.unlink(missing_ok=True)
    trained = 0
    _Counted.total = 0
    with mock.patch.object(reading, "open_shard", lambda url: _Counted(url, "rb")):
        for plan in plans:
            for _, offsets in _runs(order, plan):
                wanted = [o for a, b in offsets for o in range(a, b)]
                for _ in read_samples(str(path), wanted):
                    pass
                trained += sum(layout.bytes_of(a, b) for a, b in offsets)
    return _Counted.total / trained


def _index_pass(path: Path) -> tuple[float, int]:
    """The bytes writing the shard's index reads over the shard's bytes; the index file's size."""
    index = index_files(path)[0]
    index.unlink(missing_ok=True)
    _Counted.total = 0
    build_index(path, opener=lambda name: _Counted(name, "rb"))
    return _Counted.total / path.stat().st_size, index.stat().st_size


def _half_trained(total: int) -> PositionSet:
    """What 64 ranks x 8 workers leave after half an epoch with a shuffle buffer of 1,000: runs with holes."""
    rng, per, ranges = random.Random(0), total // (RANKS * WORKERS), []
    for w in range(RANKS * WORKERS):
        start, half = w * per, per // 2
        hole = min(1000, half)
        ranges.append((start, start + half - hole))
        ranges += [(p, p + 1) for p in rng.sample(range(start + half - hole, start + half), hole * 2 // 3)]
    return PositionSet(ranges)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--samples-per-shard", type=int, default=5000)
    parser.add_argument("--jpeg-kb", type=float, default=25.0, help="mean .jpg size (img2dataset's 256 px: ~25 KB)")
    parser.add_argument("--workers-read", type=int, default=32, help="workers whose reads are real")
    parser.add_argument("--out", default="bench_results/shard_reads.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "00000.tar"
        write_shard(path, args.samples_per_shard, args.jpeg_kb)
        layout = Layout(path)
        rows = [factors(path, layout, n, args.samples_per_shard, args.workers_read) for n in args.shards]
        index_pass, index_bytes = _index_pass(path)
    mb = layout.size / 1e6
    print(f"shard: {args.samples_per_shard} samples, {mb:.0f} MB; 64 ranks x 8 workers; {args.workers_read} read")
    print(f"writing the index (once a shard): {index_pass:.4f} of the shard read; the index {index_bytes:,} bytes")
    print(
        "| shards | samples | before | local, headers | local, with index | pipe: | pipe: plan "
        "| resumed, headers | resumed, with index |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        plan = "whole shards" if r["pipe_whole"] else f"even split, warned ({r['pipe_samples_factor']:.2f}x)"
        print(
            f"| {r['shards']:,} | {r['samples']:,} | {r['before']:.3f} | {r['local']:.3f} | {r['index']:.3f} "
            f"| {r['pipe']:.3f} | {plan} | {r['resumed_local']:.3f} | {r['resumed_index']:.3f} |"
        )
    for r in rows:
        r["index_pass"] = index_pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
