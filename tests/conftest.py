import os

import pytest
import torch

os.environ.setdefault("HYDRA_FULL_ERROR", "1")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield
