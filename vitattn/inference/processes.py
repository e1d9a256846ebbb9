"""Captioning on several processes (devices x machines), for image files and for shards alike.

Lightning Fabric starts the processes (it runs the command again for each local one, or joins those that
``torchrun`` or ``srun`` started) and gives each its rank, its device and the collectives; captioning needs no
more. ``Trainer.predict`` would also wrap the model in DDP, which takes a PyTorch module with weights: an ONNX
Runtime model is not one, and captioning has no gradients to share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Processes", "launch_processes"]


@dataclass
class Processes:
    """This process among the captioning ones: its rank, their number, its device, and what they share.

    A single process (``fabric`` None) shares nothing: ``broadcast`` returns its argument, ``barrier`` returns.
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fabric: Any = None

    @property
    def is_zero(self) -> bool:
        """This is rank 0, which holds the output's lock, shows progress and reports."""
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every rank."""
        return value if self.fabric is None else self.fabric.broadcast(value, src=0)

    def barrier(self, name: str) -> None:
        """Wait until every rank is here."""
        if self.fabric is not None:
            self.fabric.barrier(name)

    def generator(self, seed: int | None) -> torch.Generator | None:
        """A sampling generator on this rank's device seeded ``seed + rank`` (every rank samples its own
        images differently, reproducibly); None for no seed."""
        return None if seed is None else torch.Generator(self.device).manual_seed(seed + self.rank)

    def sum(self, counts: list[int]) -> list[int]:
        """Each of ``counts`` summed over the ranks."""
        if self.fabric is None:
            return list(counts)
        total = self.fabric.all_reduce(torch.tensor(counts, device=self.fabric.device), reduce_op="sum")
        return [int(x) for x in total.cpu()]


def launch_processes(
    *, devices: int = 1, num_nodes: int = 1, accelerator: str = "auto", device: str = "cpu", runtime: str = "torch"
) -> Processes:
    """Start (or join) ``devices`` x ``num_nodes`` captioning processes; one needs no launch.

    Args:
        devices, num_nodes, accelerator: as Lightning's (``auto``, ``cpu``, ``gpu``).
        device: the device of a single process.
        runtime: the model's (``vitattn.inference.loader.runtime_of``): an ONNX folder runs on CPU processes only
            (one process: on the CPU whatever ``device`` says).

    Raises:
        ValueError: an ONNX folder on GPUs (one line saying what would work).
    """
    if runtime == "onnx":
        if devices * num_nodes > 1 and accelerator not in ("auto", "cpu"):
            raise ValueError(
                "an ONNX folder runs on ONNX Runtime's CPU provider, not on GPUs; caption it on CPU processes "
                "(accelerator=cpu devices=N) or caption the bundle or run folder on GPUs"
            )
        accelerator, device = "cpu", "cpu"
    if devices * num_nodes == 1:
        return Processes(device=torch.device(device))
    from lightning.fabric import Fabric  # Lightning only where several processes caption

    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy="ddp")
    fabric.launch()
    return Processes(fabric.global_rank, fabric.world_size, fabric.device, fabric)
