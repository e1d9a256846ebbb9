"""The plan's trainer fields for each accelerator and each spelling of ``trainer.devices``, composed by Hydra as
``vitattn-train`` composes them (quoted ids and ``${oc.env:...}`` arrive as strings), on a machine with and
without CUDA; the expected values are written by hand. The processes that ``distributed`` counts are the ones the
``freeze_encoder_epochs`` refusal and the pool's captioning child see."""

import copy
import functools

import pytest
import torch
from omegaconf import DictConfig

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.errors import ConfigError
from vitattn.training.build import _pool_run
from vitattn.training.plan import Plan, _trainer_plan, resolve

NO_GPU = (
    "trainer.accelerator={} but this machine has no GPU; to train on its CPUs add trainer.accelerator=cpu "
    "trainer.devices={} trainer.precision=32-true"
)

# accelerator, trainer.devices as typed on the command line, GPUs on the machine (0: no CUDA), then by hand:
# processes on this machine, distributed, on_gpu, the no-GPU line.
CASES = [
    ("cpu", "1", 0, 1, False, False, ""),
    ("cpu", "2", 0, 2, True, False, ""),
    ("cpu", "'2'", 0, 2, True, False, ""),
    ("cpu", "'0,1'", 0, 2, True, False, ""),
    ("cpu", "[0,1]", 0, 2, True, False, ""),
    ("cpu", "auto", 0, 1, False, False, ""),
    ("cpu", "auto", 4, 1, False, False, ""),  # a CPU trainer on a GPU machine: one process
    ("cpu", "${oc.env:VITATTN_TEST_DEVICES,2}", 0, 2, True, False, ""),
    ("gpu", "1", 0, 1, False, True, NO_GPU.format("gpu", 1)),
    ("cuda", "1", 0, 1, False, True, NO_GPU.format("cuda", 1)),
    ("cuda", "'0,1'", 0, 2, True, True, NO_GPU.format("cuda", 2)),
    ("gpu", "${oc.env:VITATTN_TEST_DEVICES,2}", 0, 2, True, True, NO_GPU.format("gpu", 2)),
    ("gpu", "'0,1'", 2, 2, True, True, ""),
    ("gpu", "-1", 4, 4, True, True, ""),  # every GPU, as Lightning reads -1
    ("auto", "1", 2, 1, False, True, ""),
    ("auto", "auto", 2, 2, True, True, ""),
    ("auto", "auto", 0, 1, False, False, ""),
    ("auto", "'0,1'", 2, 2, True, True, ""),
    ("auto", "'0,1'", 0, 2, True, False, ""),
]


@pytest.fixture
def machine(monkeypatch):
    """Pretend the machine has ``gpus`` CUDA devices (0: no CUDA), outside torchrun."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("VITATTN_TEST_DEVICES", raising=False)

    def set_gpus(gpus: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    return set_gpus


@functools.cache
def _composed(devices: str) -> DictConfig:
    """``trainer.devices={devices}`` composed once per spelling (Hydra's composition: the slow part, 0.4 s)."""
    return compose_train([*TINY, *TINY_SHAPES, "trainer=cpu", f"trainer.devices={devices}"])


def _config(accelerator: str, devices: str, tmp_path, **trainer) -> DictConfig:
    cfg = copy.deepcopy(_composed(devices))
    cfg.paths.output_dir = str(tmp_path)
    cfg.trainer.accelerator = accelerator  # a string however it is typed
    for key, value in trainer.items():
        cfg.trainer[key] = value
    return cfg


def _plan(accelerator: str, devices: str, tmp_path, freeze_encoder_epochs: int = 0, **trainer) -> Plan:
    cfg = _config(accelerator, devices, tmp_path, **trainer)
    cfg.finetune.freeze_encoder_epochs = freeze_encoder_epochs
    return resolve(cfg)


@pytest.mark.parametrize(("accelerator", "devices", "gpus", "processes", "distributed", "on_gpu", "no_gpu"), CASES)
def test_the_trainer_plan_of_each_accelerator_and_devices_spelling(
    accelerator, devices, gpus, processes, distributed, on_gpu, no_gpu, machine, tmp_path
):
    machine(gpus)
    trainer = _trainer_plan(_config(accelerator, devices, tmp_path).trainer)
    got = (trainer.processes, trainer.distributed, trainer.on_gpu, trainer.no_gpu)
    assert got == (processes, distributed, on_gpu, no_gpu)


def test_the_environment_decides_an_interpolated_devices(machine, monkeypatch, tmp_path):
    machine(0)
    monkeypatch.setenv("VITATTN_TEST_DEVICES", "1")
    trainer = _trainer_plan(_config("cpu", "${oc.env:VITATTN_TEST_DEVICES,2}", tmp_path).trainer)
    assert (trainer.processes, trainer.distributed) == (1, False)


@pytest.mark.parametrize(
    ("trainer", "distributed"),
    [({"strategy": "ddp"}, True), ({"num_nodes": 2}, True), ({"strategy": "auto"}, False)]
    + [({"strategy": {"_target_": "vitattn.training.systems.sharding.FullyShardedStrategy"}}, True)],
)
def test_a_strategy_or_nodes_that_start_processes_are_distributed_on_one_device(
    trainer, distributed, machine, tmp_path
):
    machine(0)
    trainer = _trainer_plan(_config("cpu", "1", tmp_path, **trainer).trainer)
    assert (trainer.processes, trainer.distributed) == (1, distributed)


@pytest.mark.parametrize("devices", ["2", "'0,1'", "${oc.env:VITATTN_TEST_DEVICES,2}"])
def test_freezing_the_encoder_is_refused_on_two_processes_however_devices_is_spelled(devices, machine, tmp_path):
    machine(0)
    assert _plan("cpu", "'0'", tmp_path, freeze_encoder_epochs=1).trainer.processes == 1  # one process: taken
    with pytest.raises(ConfigError, match=r"^finetune\.freeze_encoder_epochs=1 does not work with several processes"):
        _plan("cpu", devices, tmp_path, freeze_encoder_epochs=1)


@pytest.mark.parametrize(("accelerator", "devices", "gpus", "child"), [("gpu", "'0,1'", 2, 2), ("cpu", "'0,1'", 0, 1)])
def test_the_pools_captioning_child_gets_every_gpu_of_the_run(accelerator, devices, gpus, child, machine, tmp_path):
    machine(gpus)
    assert _pool_run(_plan(accelerator, devices, tmp_path))["devices"] == child  # on CPUs: one process, every core
