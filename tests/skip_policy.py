"""In CI (``CI=true``) a skipped test fails the run: a missing tool (chromium, playwright, a metric backend)
must not pass as green. The allow-list is one marker: ``gpu``, a test that needs a CUDA device, skipped on a
machine without one. Loaded by tests/conftest.py; tests/test_skip_policy.py runs it on a tiny test file."""

import os

import pytest

# Markers whose tests may skip in CI, and why. Keep it short: each entry is a test CI never runs.
CI_MAY_SKIP = {"gpu": "needs a CUDA device; CI runs on CPU"}

_unexpected: list[tuple[str, str]] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", f"gpu: {CI_MAY_SKIP['gpu']} (skipped without one, allowed to skip in CI)")


def pytest_collection_modifyitems(config, items):
    gpu_only = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_only:
        return
    import torch  # heavy: imported only when a gpu test was collected

    if not torch.cuda.is_available():
        for item in gpu_only:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def _record(report) -> None:
    allowed = set(CI_MAY_SKIP) & set(getattr(report, "keywords", ()))  # a collection report has no keywords
    if report.skipped and not hasattr(report, "wasxfail") and not allowed:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _unexpected.append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)


def pytest_sessionfinish(session, exitstatus):
    if _in_ci() and _unexpected and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if not (_in_ci() and _unexpected):
        return
    terminalreporter.section("skipped in CI (CI=true): each one fails the run", red=True)
    for nodeid, reason in _unexpected:
        terminalreporter.write_line(f"{nodeid}: {reason}")
    allowed = ", ".join(f"@pytest.mark.{m} ({why})" for m, why in CI_MAY_SKIP.items())
    terminalreporter.write_line(f"only {allowed} may skip in CI: install what the test needs (see .ci/run)")
