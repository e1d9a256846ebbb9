"""In CI (``CI=true``) a skipped test fails the run: a missing tool (chromium, playwright, a metric backend)
must not pass as green. The allow-list is two markers: ``gpu``, a test that needs a CUDA device, skipped on a
machine without one, and ``cpu_bf16``, a test of what ``precision=auto`` gives on a CPU with bf16 matrix units,
skipped on a CPU without them; they are read from the test's markers (``get_closest_marker``), not from its
keywords (a parametrize id ``[gpu]`` or a folder named ``gpu`` is no marker). An expected failure counts as a
skip unless it is strict (``@pytest.mark.xfail(strict=True)``, or ``xfail_strict`` in the ini file):
``pytest.xfail()`` inside a test, a non-strict or ``run=False`` xfail mark fail the run in CI. Loaded by
tests/conftest.py; tests/test_skip_policy.py runs it on tiny test files."""

import os

import pytest

# Markers whose tests may skip in CI, and why. Keep it short: each entry is a test CI never runs.
CI_MAY_SKIP = {
    "gpu": "needs a CUDA device; CI runs on CPU",
    "cpu_bf16": "needs a CPU with bf16 matrix instructions (amx_bf16 or avx512_bf16), where precision=auto is bf16",
}

_unexpected: list[tuple[str, str]] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def pytest_configure(config):
    for marker, why in CI_MAY_SKIP.items():
        config.addinivalue_line("markers", f"{marker}: {why} (skipped without one, allowed to skip in CI)")


def pytest_collection_modifyitems(config, items):
    gpu_only = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_only:
        import torch  # heavy: imported only when a gpu test was collected

        if not torch.cuda.is_available():
            for item in gpu_only:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
    bf16_only = [item for item in items if item.get_closest_marker("cpu_bf16")]
    if bf16_only:
        from vitattn.precision import cpu_bf16_units  # the CPU itself, whatever VITATTN_NATIVE_BF16 says

        if not cpu_bf16_units():
            reason = "needs a CPU with bf16 matrix instructions (amx_bf16 or avx512_bf16); this one has neither"
            for item in bf16_only:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each report carries what the policy needs (under pytest-xdist, reports are judged in another process)."""
    report = yield
    xfail = item.get_closest_marker("xfail")
    strict = xfail is not None and xfail.kwargs.get("strict", item.config.getini("xfail_strict"))
    report.ci_may_skip = any(item.get_closest_marker(marker) for marker in CI_MAY_SKIP)
    report.ci_strict_xfail = bool(strict) and xfail.kwargs.get("run", True)
    return report


def _record(report) -> None:
    wasxfail = getattr(report, "wasxfail", None)
    if wasxfail is not None:  # xfailed, or xpassed without strict
        if not getattr(report, "ci_strict_xfail", False):
            _unexpected.append((report.nodeid, f"xfail without strict=True: {wasxfail or 'no reason given'}"))
    elif report.skipped and not getattr(report, "ci_may_skip", False):  # a collection report: never allowed
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
    terminalreporter.section("skipped or not-strict xfail in CI (CI=true): each one fails the run", red=True)
    for nodeid, reason in _unexpected:
        terminalreporter.write_line(f"{nodeid}: {reason}")
    allowed = ", ".join(f"@pytest.mark.{m} ({why})" for m, why in CI_MAY_SKIP.items())
    terminalreporter.write_line(
        f"only {allowed} may skip in CI: install what the test needs (see .ci/run); an expected failure is "
        "@pytest.mark.xfail(strict=True)"
    )
