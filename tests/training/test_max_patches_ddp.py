"""``data.max_patches`` under DDP: two forked gloo ranks, each with its half of a batch of mixed-aspect images padded
to its own longest, give the gradients and the optimizer step of one process on the whole batch padded to the
batch's longest (each rank's loss a mean over as many images or caption tokens, so the ranks' mean is the whole's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vitattn.data.preprocess import pad_patches, patchify
from vitattn.models.vit import Patches
from vitattn.training.systems import CaptionSystem, ClassificationSystem

WORDS = "a red blue green circle square on the".split()
P, T = 8, 6  # patch side (the table 4 x 4: img_size 32); caption length with <bos> and <eos>
GRIDS = [(1, 4), (2, 3), (3, 1), (1, 2)]  # rank 0's two images (4, 6 patches), rank 1's (3, 2): padded to 6 and 3
ENCODER = dict(img_size=32, patch_size=P, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


def _system(head: str) -> nn.Module:
    """A tiny system of the head in float64 (the ranks' sums in another order stay far within 1e-9)."""
    torch.manual_seed(0)
    if head == "classification":
        system = ClassificationSystem({**ENCODER, "num_classes": 3}, ["x", "y", "z"])
    else:
        decoder = dict(vocab_size=len(WORDS) + 4, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0, max_len=8)
        system = CaptionSystem({"encoder": ENCODER, "decoder": {**decoder, "drop_rate": 0.0}}, WORDS)
    return system.double()


def _images(rows: slice) -> Patches:
    """The images of ``rows`` padded to their own longest."""
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(3, r * P, c * P, generator=g, dtype=torch.float64) for r, c in GRIDS]
    return pad_patches([patchify(image, P) for image in images[rows]])


def _batch(head: str, rows: slice) -> object:
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 3, (len(GRIDS),), generator=g)
    words = torch.randint(4, 12, (len(GRIDS), T - 2), generator=g)
    if head == "classification":
        return _images(rows), labels[rows]
    tokens = torch.cat([torch.full((len(GRIDS), 1), 1), words, torch.full((len(GRIDS), 1), 2)], dim=1)[rows]  # (B, T)
    return {"images": _images(rows), "tokens": tokens, "image_ids": torch.arange(len(GRIDS))[rows]}


class _Loss(nn.Module):
    """The system's training loss as a module's forward, as Lightning's DDP wrapper calls it."""

    def __init__(self, system: nn.Module, head: str) -> None:
        super().__init__()
        self.system, self.head = system, head

    def forward(self, batch: object) -> torch.Tensor:
        return self.system._supervised(batch) if self.head == "classification" else self.system._loss(batch)


def _step(head: str, rows: slice, ddp: bool) -> dict[str, dict[str, torch.Tensor]]:
    """One training step's gradients and the parameters after one SGD step."""
    system = _system(head)
    module = DistributedDataParallel(_Loss(system, head)) if ddp else _Loss(system, head)  # held to the backward
    loss = module(_batch(head, rows))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in system.model.named_parameters() if p.grad is not None}
    torch.optim.SGD(system.model.parameters(), lr=0.5).step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in system.model.named_parameters()}}


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        rows = slice(2 * rank, 2 * rank + 2)
        torch.save({head: _step(head, rows, ddp=True) for head in ("classification", "caption")}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both heads' step on two forked gloo processes (no imports of their own)."""
    folder = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank, args=(str(folder / "store"), str(folder / "out")), nprocs=2, start_method="fork")
    return [torch.load(folder / f"out.{rank}", weights_only=True) for rank in (0, 1)]


@pytest.mark.parametrize("head", ["classification", "caption"])
def test_two_ranks_padded_to_their_own_longest_step_as_one_process_on_the_whole_batch(head, two_ranks):
    halves = [_images(slice(0, 2)), _images(slice(2, 4)), _images(slice(0, 4))]
    assert [h.valid.shape[1] for h in halves] == [6, 3, 6]  # rank 1 pads to 3, the whole batch to 6
    expected = _step(head, slice(0, 4), ddp=False)
    for rank in two_ranks:
        for what in ("grads", "params"):
            assert rank[head][what].keys() == expected[what].keys()
            for name, value in expected[what].items():
                torch.testing.assert_close(rank[head][what][name], value, rtol=0, atol=1e-9, msg=f"{what} {name}")
