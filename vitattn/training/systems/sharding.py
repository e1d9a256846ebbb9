"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the systems' models: each ``EncoderLayer`` and
``DecoderLayer`` one shard unit, the rest of the model another; validation runs on weights gathered once
before it (why: docs/scaling.md#big-models-fsdp).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from vitattn.layers import DecoderLayer, EncoderLayer
from vitattn.models import CocaCaptioner, ImageCaptioner, VisionTransformer, captioner_from_config

__all__ = [
    "SHARD_UNITS",
    "FullyShardedStrategy",
    "gather_for_evaluation",
    "is_sharded",
    "shard_layers",
    "shard_again",
    "unsharded_copy",
]

SHARD_UNITS = (EncoderLayer, DecoderLayer)  # each one all-gathered for its own forward and backward


def shard_layers(model: nn.Module, mesh: DeviceMesh, precision: str = "32-true") -> None:
    """Shard ``model`` in place over ``mesh``: each ``SHARD_UNITS`` layer, then the rest; ``bf16-mixed`` gathers
    weights in bf16 and reduces gradients in fp32 (half the traffic)."""
    policy = MixedPrecisionPolicy()
    if precision == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, SHARD_UNITS):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if isinstance(model, CocaCaptioner):
        register_fsdp_forward_method(model, "forward_coca")  # training's pass: gathers the root's weights as forward


def is_sharded(model: nn.Module) -> bool:
    """Whether ``shard_layers`` sharded ``model``."""
    return isinstance(model, FSDPModule)


def _shard_units(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gather_for_evaluation(model: nn.Module) -> None:
    """All-gather every weight of a sharded ``model`` (every process together), kept through the forward passes
    that follow until ``shard_again``; a model that is not sharded is left as it is."""
    units = _shard_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()


def shard_again(model: nn.Module) -> None:
    """Undo ``gather_for_evaluation``: every layer but the root shards again after each forward (FSDP's default)."""
    units = _shard_units(model)
    for unit in units:
        unit.set_reshard_after_forward(unit is not model, recurse=False)
        unit.reshard()


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain copy of a sharded ``model``, whole, on its shards' device, in its mode (every process together)."""
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    device = next(iter(weights.values())).device
    with torch.device(device):
        if isinstance(model, ImageCaptioner):
            copy: nn.Module = captioner_from_config(model.config)
        else:
            copy = VisionTransformer(**model.config)
    copy.load_state_dict(weights, strict=True)
    return copy.train(model.training)


class FullyShardedStrategy(ModelParallelStrategy):
    """``trainer=fsdp``: FSDP2 over all ``num_nodes x devices`` processes, each a data-parallel rank (no tensor
    parallelism); each checkpoint one whole file gathered on rank 0 (why not Lightning's own: docs/scaling.md)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=False, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        super().setup_environment()
