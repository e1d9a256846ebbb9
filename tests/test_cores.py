"""Small machines: loader workers and torch threads of every training process share the cores, never more."""

import os

import pytest
import torch
from hydra.utils import instantiate

from tests.helpers.datasets import make_coco
from tests.helpers.images import make_image_folder
from tests.helpers.runs import TINY, compose_train
from vitattn.training.build import plan_cores
from vitattn.training.plan import processes_per_node, resolve


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    folder = make_image_folder(root / "folder", per_class=2, size=20)
    coco = make_coco(root / "coco", num_train=4, num_val=2, size=20)
    return {
        "imagefolder": ["head=classification", "data=imagefolder", f"data.root={folder}"],
        "coco": ["head=caption", "data=coco", *[f"data.{k}={v}" for k, v in coco.items()]],
        "shapes": ["head=caption", "data=shapes", "data.num_train=8", "data.num_val=4", "data.num_test=4"],
    }


@pytest.fixture
def cores(monkeypatch):
    """Pretend the process may run on ``n`` cores; torch's thread count is restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    yield set_cores
    torch.set_num_threads(before)


def _plan(overrides: list[str], tmp_path) -> tuple[int, int]:
    return _plan_composed(compose_train([*overrides, "data.num_workers=auto", "num_threads=auto"], tmp_path))


def _plan_composed(cfg) -> tuple[int, int]:
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    return plan_cores(resolve(cfg), datamodule)


@pytest.mark.parametrize(
    ("source", "cache"),
    [("imagefolder", "ram"), ("imagefolder", "none"), ("coco", "ram"), ("coco", "none"), ("shapes", None)],
)
def test_cpu_workers_and_threads_of_all_processes_fit_the_cores(source, cache, sources, cores, tmp_path):
    extra = [f"data.cache={cache}"] if cache else []  # the shapes are generated in memory
    for devices in (1, 2, 3):
        ddp = ["trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={devices}"] if devices > 1 else []
        overrides = [*sources[source], *TINY, *extra, *ddp, "data.num_workers=auto", "num_threads=auto"]
        cfg = compose_train(overrides, tmp_path)
        for n in (1, 2, 3, 4, 8):
            cores(n)
            workers, threads = _plan_composed(cfg)
            case = f"{n} cores, {devices} processes, {source}, cache={cache}: {workers} workers, {threads} threads"
            assert threads >= 1, case
            assert devices * (workers + threads) <= max(n, devices), case  # at least one thread per process
            assert workers <= (1 if cache == "none" else 0), case  # images in memory: no workers
            if n >= 2 * devices:
                assert devices * (workers + threads) == n // devices * devices, case  # and no core left idle


@pytest.mark.parametrize("source", ["imagefolder", "coco"])
def test_image_files_get_many_workers_on_gpus_only(source, sources, cores, tmp_path):
    cores(16)
    gpu = _plan([*sources[source], *TINY, "data.cache=none", "trainer=gpu"], tmp_path)
    assert gpu == (8, torch.get_num_threads())  # up to 8 workers; torch's own thread count
    assert _plan([*sources[source], *TINY, "data.cache=none", "trainer=ddp", "trainer.devices=4"], tmp_path)[0] == 3
    assert _plan([*sources[source], *TINY, "data.cache=none", "trainer=cpu"], tmp_path) == (1, 15)


def test_a_users_workers_and_threads_are_kept(sources, cores, tmp_path):
    cores(2)
    cfg = compose_train([*sources["imagefolder"], *TINY, "data.num_workers=3", "num_threads=4"], tmp_path)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    assert plan_cores(resolve(cfg), datamodule) == (3, 4)  # more than the cores, as asked


@pytest.mark.parametrize(
    ("devices", "local_world_size", "expected"),
    [(1, None, 1), (4, None, 4), ("3", None, 3), ("0,1", None, 2), ([0, 2], None, 2), ("auto", None, 1), (-1, None, 1)]
    + [("auto", "4", 4), (2, "2", 2)],
)
def test_processes_per_node(devices, local_world_size, expected, monkeypatch):
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert processes_per_node(devices) == expected
