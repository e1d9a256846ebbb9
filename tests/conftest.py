import os
import socket
import sys
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("HYDRA_FULL_ERROR", "1")
# precision=auto as on a CPU without bf16 matrix units, here and in the commands the tests start: exact comparisons
# then mean the same on every machine; tests/test_precision.py lifts it where bf16 is what is tested.
os.environ["VITATTN_NATIVE_BF16"] = "0"

pytest_plugins = ["tests.helpers.skip_policy"]

# pytest-timeout: `timeout` in pyproject.toml bounds each test (a hang in an in-process train() fails that
# test instead of hanging CI); a `slow` test without its own timeout mark gets this many seconds instead.
SLOW_TIMEOUT = 1800

# Property-based tests (tests/data/test_fuzz.py): ~100 cases per target in make test-fast; HYPOTHESIS_PROFILE=ci-long
# for 2,000. No deadline: the machine is shared, and a slow case is not a failure (a hang is: pytest-timeout).
_FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=100, **_FUZZ)
settings.register_profile("ci-long", max_examples=2000, **_FUZZ)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

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


@pytest.fixture
def no_network(monkeypatch):
    """Every connection is refused, as with the network down: returns the list of the attempts (empty while
    nothing tried to connect, as HF_HUB_OFFLINE promises)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise ConnectionRefusedError(f"network access refused by the test: {args[1:] or args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache in ``tmp_path`` (``HF_HOME``/hub), for this process and the commands it
    starts; ``tests.helpers.put_in_hub_cache`` fills it as huggingface_hub does."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def hub_offline(monkeypatch):
    """``HF_HUB_OFFLINE=1``, for this process (huggingface_hub reads it once, at import) and the commands it starts."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


def pytest_terminal_summary(terminalreporter):
    """The number of generated cases per fuzzed target, when tests/data/test_fuzz.py ran."""
    fuzz = sys.modules.get("tests.test_fuzz")
    if fuzz is None or not fuzz.CASES:
        return
    terminalreporter.section("fuzzed cases per target (refused / accepted)")
    for target in sorted({target for target, _ in fuzz.CASES}):
        refused, accepted = fuzz.CASES[target, "refused"], fuzz.CASES[target, "accepted"]
        terminalreporter.write_line(f"{target:<42} {refused + accepted:>6}  ({refused} refused, {accepted} accepted)")
