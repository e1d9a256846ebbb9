"""The plan's trainer fields for each accelerator and each spelling of ``trainer.devices``, composed by Hydra as
``vitattn-train`` composes them (quoted ids and ``${oc.env:...}`` arrive as strings), on a machine with and
without CUDA; the expected values are written by hand. The processes that ``distributed`` counts are the ones the
``freeze_encoder_epochs`` refusal and the pool's captioning child see."""

import copy
import dataclasses
import functools

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ReadonlyConfigError

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from tests.training.test_rank_zero import _Clock
from vitattn.data.tokenizer import SubwordTokenizer, Vocabulary, train_bpe
from vitattn.errors import ConfigError
from vitattn.run_dir import RunDir
from vitattn.training.build import _pool_run
from vitattn.training.plan import (
    Plan,
    TrainerPlan,
    _trainer_plan,
    global_rank,
    processes_per_node,
    resolve,
    run_tokenizer,
)

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


def _plan(
    accelerator: str, devices: str, tmp_path, freeze_encoder_epochs: int = 0, resume: str | None = None, **trainer
) -> Plan:
    cfg = _config(accelerator, devices, tmp_path, **trainer)
    cfg.finetune.freeze_encoder_epochs = freeze_encoder_epochs
    cfg.resume = resume
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


def test_the_trainer_keys_a_config_leaves_out_take_lightnings_defaults(machine):
    machine(0)
    trainer = _trainer_plan(OmegaConf.create({}))
    assert trainer == TrainerPlan(
        accelerator="auto",
        devices=1,
        num_nodes=1,
        strategy="auto",
        on_gpu=False,
        no_gpu="",
        sharded=False,
        processes=1,
        rank=0,
        fast_dev_run=False,
        progress_bar=True,  # Lightning's enable_progress_bar=None: shown
    )
    assert not trainer.distributed


@pytest.mark.parametrize(("local_world_size", "processes"), [("1", 1), ("3", 3), ("0", 1)])
def test_torchruns_local_world_size_is_the_process_count_whatever_devices_says(
    local_world_size, processes, machine, monkeypatch
):
    machine(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert processes_per_node(2, on_gpu=True) == processes == processes_per_node("auto", on_gpu=True)


def test_devices_auto_counts_gpus_only_for_a_gpu_trainer_and_never_fewer_than_one_process(machine):
    machine(4)
    assert processes_per_node("auto") == 1  # the default: a CPU trainer
    assert processes_per_node("auto", on_gpu=True) == 4
    machine(0)
    assert processes_per_node("auto", on_gpu=True) == processes_per_node(0) == processes_per_node([]) == 1
    assert processes_per_node(None) == 1  # trainer.devices=null


def test_the_plan_and_its_parts_cannot_change_after_resolve(machine, tmp_path):
    machine(0)
    plan = _plan("cpu", "1", tmp_path)
    for part, field in [(plan, "task"), (plan.trainer, "processes"), (plan.precision, "trainer")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.resume.first_step = 1
    with pytest.raises(ReadonlyConfigError):
        plan.cfg.data.batch_size = 1


def test_the_systems_keys_name_the_config_key_each_value_comes_from(machine, tmp_path):
    machine(0)
    keys = _plan("cpu", "1", tmp_path).system_keys
    assert keys["scst"] == "finetune.scst"  # scst: ${finetune.scst}
    assert keys["label_smoothing"] == "head.label_smoothing"
    assert keys["_target_"] == "head.system._target_"  # written in head.system itself


def test_the_tokenizer_kind_is_the_caption_heads_and_none_for_classes(machine, tmp_path):
    machine(0)
    assert _plan("cpu", "1", tmp_path).tokenizer_kind == "words"
    cfg = compose_train([*TINY, *TINY_SHAPES, "trainer=cpu", "head=classification"], tmp_path)
    assert resolve(cfg).tokenizer_kind is None


def _checkpoint(path, step: int, **extra) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "hyper_parameters": {"lr": 0.5}, **extra}, path)


def test_resume_auto_starts_afresh_in_an_empty_folder_and_continues_the_folders_checkpoint(machine, tmp_path):
    machine(0)
    fresh = _plan("cpu", "1", tmp_path, resume="auto").resume
    assert (fresh.ckpt_path, fresh.first_step, fresh.log_from) == (None, 0, 0)  # the folder's logs continue
    _checkpoint(tmp_path / "checkpoints" / "last.ckpt", 7)
    found = _plan("cpu", "1", tmp_path, resume="auto").resume
    assert (found.ckpt_path, found.key, found.first_step, found.log_from) == (
        str(tmp_path / "checkpoints" / "last.ckpt"),
        "resume",
        7,
        7,
    )
    assert found.hparams == {"lr": 0.5}
    assert _plan("cpu", "1", tmp_path).resume.log_from is None  # no resume: a new run's logs


class _Foreign:
    """An object a checkpoint could carry that ``torch.load(weights_only=True)`` must not unpickle."""


@pytest.mark.parametrize("content", ["truncated", "foreign"])
def test_a_checkpoint_that_is_truncated_or_holds_foreign_objects_stops_the_run_in_one_line(content, machine, tmp_path):
    machine(0)
    last = tmp_path / "checkpoints" / "last.ckpt"
    _checkpoint(last, 3, **({"extra": _Foreign()} if content == "foreign" else {}))
    if content == "truncated":
        last.write_bytes(last.read_bytes()[:100])
    with pytest.raises(
        ConfigError, match=rf"^resume: checkpoint {last} cannot be read \(.+\); use another checkpoint$"
    ):
        _plan("cpu", "1", tmp_path, resume="auto")


def test_a_restart_reads_the_runs_own_tokenizer_and_a_first_start_builds_its_own(machine, tmp_path):
    machine(0)
    words = Vocabulary(["circle", "red"])
    words.save(tmp_path / "vocab.json")
    assert _plan("cpu", "1", tmp_path).vocab is None  # a file from an earlier run here is not this run's
    _checkpoint(tmp_path / "checkpoints" / "last.ckpt", 2)
    assert _plan("cpu", "1", tmp_path, resume="auto").vocab.words == ["circle", "red"]


@pytest.mark.parametrize("kind", ["words", "bpe"])
def test_run_tokenizer_reads_the_file_of_its_kind_and_only_that(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    run = RunDir(tmp_path)
    other = run.vocab if kind == "bpe" else run.tokenizer
    (Vocabulary(["red"]).save if other == run.vocab else train_bpe(["a red circle"] * 4, 300).save)(other)
    assert run_tokenizer(kind, tmp_path, resuming=True) is None  # only the other kind's file: none of its own
    mine = run.tokenizer if kind == "bpe" else run.vocab
    (train_bpe(["a blue square"] * 4, 300).save if kind == "bpe" else Vocabulary(["blue"]).save)(mine)
    loaded = run_tokenizer(kind, tmp_path, resuming=True)
    assert type(loaded) is (SubwordTokenizer if kind == "bpe" else Vocabulary)
    assert loaded.decode(loaded.encode("blue")) == "blue"
    assert run_tokenizer(kind, tmp_path, resuming=False) is None  # rank 0's first start builds its own
    assert run_tokenizer("file", tmp_path, resuming=True) is None  # tokenizer=file: the DataModule reads it


def test_another_rank_waits_for_rank_zeros_tokenizer_even_on_a_first_start(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    Vocabulary(["blue"]).save(tmp_path / "vocab.json")
    assert run_tokenizer("words", tmp_path, resuming=False).words == ["blue"]
    clock = _Clock(monkeypatch)
    with pytest.raises(TimeoutError):
        run_tokenizer("bpe", tmp_path, resuming=False, wait=3)
    assert clock.now > 3


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"RANK": "3", "NODE_RANK": "1"}, 3),  # torchrun: RANK says it all
        ({"NODE_RANK": "1"}, 2),  # the first process of node 1 before fit: Lightning's launcher set only NODE_RANK
        ({"LOCAL_RANK": "1"}, 1),
        ({"NODE_RANK": "3", "LOCAL_RANK": "1"}, 7),  # node rank x processes per node + local rank
        ({"GROUP_RANK": "1", "LOCAL_RANK": "1"}, 3),
        ({"SLURM_PROCID": "5"}, 5),
        ({"SLURM_PROCID": "5", "LOCAL_RANK": "0"}, 0),  # Lightning's own launcher inside a SLURM step
    ],
)
def test_the_global_rank_is_lightnings_in_each_launchers_environment(env, rank, monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert global_rank(2) == rank


@pytest.mark.parametrize("epochs", [-1, "2", 1.5])
def test_a_number_of_frozen_epochs_that_is_not_a_whole_number_is_refused_in_one_line(epochs, machine, tmp_path):
    machine(0)
    with pytest.raises(ConfigError, match=rf"^finetune\.freeze_encoder_epochs={epochs} must be a whole number"):
        _plan("cpu", "1", tmp_path, freeze_encoder_epochs=epochs)
