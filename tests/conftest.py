import os

import pytest
import torch

os.environ.setdefault("HYDRA_FULL_ERROR", "1")

_set_num_threads = torch.set_num_threads  # tests may monkeypatch torch.set_num_threads


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Seed 0 and one torch thread: exact float comparisons must not depend on the machine's core count."""
    threads = torch.get_num_threads()
    _set_num_threads(1)
    torch.manual_seed(0)
    yield
    _set_num_threads(threads)
