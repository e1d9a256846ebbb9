"""Which samples of the shards each rank and loader worker trains in an epoch, every sample once and every rank
the same number of batches, and how an interrupted epoch resumes (docs/shards.md)."""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

__all__ = ["EpochOrder", "PositionSet", "WorkerPlan", "batches_per_rank", "read_factor", "split_epoch"]

log = logging.getLogger(__name__)

Range = tuple[int, int]  # [start, stop)


class PositionSet:
    """A set of epoch positions as sorted, disjoint ``[start, stop)`` ranges."""

    def __init__(self, ranges: Iterable[Sequence[int]] = ()) -> None:
        self.ranges: list[Range] = []
        self._merge((int(a), int(b)) for a, b in ranges)

    def _merge(self, ranges: Iterable[Range]) -> None:
        merged: list[Range] = []
        for start, stop in sorted([*self.ranges, *ranges]):  # the ranges held are sorted: a linear merge
            if start < stop and merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            elif start < stop:
                merged.append((start, stop))
        self.ranges = merged

    def add(self, positions: Iterable[int]) -> None:
        """Add positions (in any order)."""
        self._merge((p, p + 1) for p in positions)

    def __len__(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def __contains__(self, p: int) -> bool:
        i = bisect.bisect_right(self.ranges, (p, float("inf"))) - 1
        return i >= 0 and self.ranges[i][0] <= p < self.ranges[i][1]

    def complement(self, total: int) -> list[Range]:
        """The ranges of ``0 .. total-1`` not in the set."""
        gaps, start = [], 0
        for a, b in self.ranges:
            if a > start:
                gaps.append((start, min(a, total)))
            start = max(start, b)
        if start < total:
            gaps.append((start, total))
        return [(a, b) for a, b in gaps if a < b]


def _take(ranges: Sequence[Range], skip: int, count: int) -> list[Range]:
    """``count`` positions of ``ranges`` after the first ``skip``, as ranges."""
    out = []
    for a, b in ranges:
        n = b - a
        if skip >= n:
            skip -= n
            continue
        a, skip = a + skip, 0
        take = min(count, b - a)
        if take > 0:
            out.append((a, a + take))
            count -= take
        if count == 0:
            break
    return out


@dataclass
class EpochOrder:
    """The shards of an epoch in order (drawn from ``seed, epoch`` unless ``shuffle`` is off) and where each
    position lies; ``limit``: only the first ``limit`` positions (``data.samples_per_epoch``)."""

    sizes: Sequence[int]
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    limit: int | None = None
    order: list[int] = field(init=False)
    starts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.order = list(range(len(self.sizes)))
        if self.shuffle:
            random.Random(f"{self.seed}/{self.epoch}").shuffle(self.order)
        self.starts = [0, *accumulate(int(self.sizes[shard]) for shard in self.order)]
        self._start_of = {shard: self.starts[k] for k, shard in enumerate(self.order)}
        self._bases = [0, *accumulate(int(n) for n in self.sizes)]

    @property
    def total(self) -> int:
        """Positions in the epoch."""
        whole = self.starts[-1]
        return whole if self.limit is None else min(whole, int(self.limit))

    def locate(self, position: int) -> tuple[int, int]:
        """``(shard index in the listing, offset in the shard)`` of an epoch position."""
        k = bisect.bisect_right(self.starts, position) - 1
        return self.order[k], position - self.starts[k]

    def start_of(self, shard: int) -> int:
        """The epoch position of a shard's first sample."""
        return self._start_of[shard]

    def sample_id(self, shard: int, offset: int) -> int:
        """A number for the sample, the same in every epoch: its place in the listed shards."""
        return self._bases[shard] + offset

    def shard_runs(self, ranges: Sequence[Range]) -> list[tuple[int, list[Range]]]:
        """``ranges`` of positions grouped by shard, in order: ``[(shard, [offset ranges]), ...]``."""
        runs: list[tuple[int, list[Range]]] = []
        for a, b in ranges:
            while a < b:
                k = bisect.bisect_right(self.starts, a) - 1
                stop = min(b, self.starts[k + 1])
                shard, base = self.order[k], self.starts[k]
                if runs and runs[-1][0] == shard:
                    runs[-1][1].append((a - base, stop - base))
                else:
                    runs.append((shard, [(a - base, stop - base)]))
                a = stop
        return runs


@dataclass
class WorkerPlan:
    """What one loader worker of one rank reads: epoch positions (``ranges``) batched as ``batch_sizes``."""

    ranges: list[Range]
    batch_sizes: list[int]


def batches_per_rank(total: int, world_size: int, batch_size: int) -> int:
    """The batches every rank trains for ``total`` samples: what the rank with most samples needs."""
    return math.ceil(math.ceil(total / world_size) / batch_size)


def split_epoch(
    remaining: Sequence[Range],
    world_size: int,
    workers: int,
    batch_size: int,
    shards: EpochOrder | None = None,
) -> list[list[WorkerPlan]]:
    """``[rank][worker]`` plans of the positions still to train, the same batch count on every rank.

    Where the ranks cannot make equal batch counts (``batch_size=1`` and a total they do not divide), the last
    ``total % world_size`` positions are left out with a warning rather than repeated. ``shards`` (the order):
    give each worker whole shards (streams: each read once) where there are at least ``world_size x workers``.
    """
    workers = max(1, workers)
    if shards is not None:
        whole = _whole_shards(remaining, world_size, workers, batch_size, shards)
        if whole is not None:
            return whole
    total = sum(b - a for a, b in remaining)
    per_rank = [total // world_size + (r < total % world_size) for r in range(world_size)]
    batches = batches_per_rank(total, world_size, batch_size)
    if batches and min(per_rank) < batches:
        log.warning(
            "%d samples cannot give %d ranks %d batches each; the last %d are left out of this epoch",
            total,
            world_size,
            batches,
            total % world_size,
        )
        per_rank = [total // world_size] * world_size
        batches = batches_per_rank(sum(per_rank), world_size, batch_size)
    plans, start = [], 0
    for n in per_rank:
        rank_ranges, offset, rank_plans = _take(remaining, start, n), 0, []
        rank_sizes = _even_sizes(n, batches)
        for sizes in (rank_sizes[w::workers] for w in range(workers)):  # batch j to worker j % workers
            rank_plans.append(WorkerPlan(_take(rank_ranges, offset, sum(sizes)), sizes))
            offset += sum(sizes)
        plans.append(rank_plans)
        start += n
    return plans


def _even_sizes(n: int, batches: int) -> list[int]:
    """``n`` samples as ``batches`` batch sizes within one of each other, the larger first (a resumed epoch
    never needs more batches)."""
    q, t = divmod(n, batches) if batches else (0, 0)
    return [q + 1] * t + [q] * (batches - t)


def _whole_shards(
    remaining: Sequence[Range], world_size: int, workers: int, batch_size: int, order: EpochOrder
) -> list[list[WorkerPlan]] | None:
    """Plans that give each shard's remaining positions to one worker; None where that cannot be done."""
    units = order.shard_runs(remaining)  # [(shard, offset ranges)], in epoch order
    slots = world_size * workers
    if len(units) < slots:
        return None
    counts = [sum(b - a for a, b in offsets) for _, offsets in units]
    heap = [(0, i) for i in range(slots)]  # (samples, slot): the largest unit to the slot with fewest samples
    owned: list[list[int]] = [[] for _ in range(slots)]
    for u in sorted(range(len(units)), key=lambda u: (-counts[u], u)):
        load, slot = heapq.heappop(heap)
        owned[slot].append(u)
        heapq.heappush(heap, (load + counts[u], slot))
    loads = sorted(heap, key=lambda load_slot: (-load_slot[0], load_slot[1]))  # (samples, slot), fullest first
    # the i-th fullest slot: rank i % world_size, worker i // world_size (worker 0, which steps first, the fullest)
    slot_of = {(i % world_size, i // world_size): s for i, (_, s) in enumerate(loads)}
    batches = max(workers * (math.ceil(n / batch_size) - 1) + i // world_size + 1 for i, (n, _) in enumerate(loads))
    plans = []
    for r in range(world_size):
        rank_plans = []
        for w in range(workers):
            mine = sorted(owned[slot_of[r, w]])
            n = sum(counts[u] for u in mine)
            k = len(range(w, batches, workers))
            if n < k:  # a worker that cannot fill its batches: the even split instead
                return None
            base = [order.start_of(units[u][0]) for u in mine]
            ranges = [(b + a, b + z) for u, b in zip(mine, base) for a, z in units[u][1]]
            rank_plans.append(WorkerPlan(ranges, _even_sizes(n, k)))
        plans.append(rank_plans)
    return plans


def read_factor(order: EpochOrder, plans: Sequence[Sequence[WorkerPlan]]) -> float:
    """Samples a plan reads from streams (each worker reads each of its shards from the start to its last
    planned sample) per sample it trains: 1.0 when every shard is read once."""
    read = trained = 0
    for rank in plans:
        for plan in rank:
            for _, offsets in order.shard_runs(plan.ranges):
                read += offsets[-1][1]
                trained += sum(b - a for a, b in offsets)
    return read / trained if trained else 1.0
