import os
from contextlib import contextmanager

import pytest
import torch

os.environ.setdefault("HYDRA_FULL_ERROR", "1")

_set_num_threads = torch.set_num_threads  # tests may monkeypatch torch.set_num_threads


@contextmanager
def _one_torch_thread():
    """Exact float comparisons must not depend on the machine's core count: one thread, restored after."""
    threads = torch.get_num_threads()
    _set_num_threads(1)
    try:
        yield
    finally:
        _set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _one_thread_for_module_fixtures():
    """Set before any module-scoped fixture runs, so that trained runs shared by a module are pinned too."""
    with _one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Seed 0 and one torch thread for each test (a test that changes the thread count is undone)."""
    with _one_torch_thread():
        torch.manual_seed(0)
        yield
