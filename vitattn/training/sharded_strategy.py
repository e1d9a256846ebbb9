"""``trainer=fsdp``: Lightning's ``ModelParallelStrategy`` as fully sharded data parallelism over every process."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

__all__ = ["FullyShardedStrategy"]


class FullyShardedStrategy(ModelParallelStrategy):
    """FSDP2 over all ``num_nodes x devices`` processes: each one a data-parallel rank holding a shard of every
    weight (the system's ``configure_model`` shards it), no tensor parallelism.

    ``ModelParallelStrategy`` on its own makes the processes of a node one tensor-parallel group (``auto``):
    they would all read the same batches. Lightning's ``FSDPStrategy`` (FSDP1) needs a GPU; FSDP2 runs on CPUs
    too (gloo). Each checkpoint is one file with the whole weights and optimizer state, gathered on rank 0
    (``save_distributed_checkpoint=False``), that ``resume``, ``weights=best`` and the bundle read as they read a
    DDP run's: the run's own code reads checkpoints as files.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=False, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        super().setup_environment()
