"""``vitattn-train`` that records how each rank sharded the model.

    VITATTN_SHARD_LOG=FILE python tests/helpers/fsdp_train.py trainer=fsdp OVERRIDES...

With ``trainer=fsdp`` Lightning starts this file again once per extra rank, so every rank runs the recording
``shard_layers``; each call appends one JSON line to FILE: the rank, the class of each FSDP unit in module
order, and the numbers of weights the rank holds and the model has. Used by tests/training/test_sharding.py.
"""

from __future__ import annotations

import json
import os

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import vitattn.training.systems.base
from vitattn.cli.train import main

_shard_layers = vitattn.training.systems.base.shard_layers  # what configure_model calls


def recording_shard_layers(model: nn.Module, mesh: DeviceMesh, precision: str = "32-true") -> None:
    _shard_layers(model, mesh, precision)
    params = list(model.parameters())
    record = {
        "rank": mesh.get_rank(),
        "units": [type(m).__name__.removeprefix("FSDP") for m in model.modules() if isinstance(m, FSDPModule)],
        "held": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
        "total": sum(p.numel() for p in params),
    }
    with open(os.environ["VITATTN_SHARD_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    vitattn.training.systems.base.shard_layers = recording_shard_layers
    main()
