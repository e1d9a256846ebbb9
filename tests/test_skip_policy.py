"""tests/helpers/skip_policy.py, run on tiny test files by a pytest of their own (pytester, in this process; under
pytest-xdist, as ``make test`` runs it, in a process of its own): in CI a skip fails the run."""

import os
from pathlib import Path

import pytest

import vitattn.precision

ROOT = Path(__file__).resolve().parents[1]
PASSING = "def test_passes():\n    assert True\n"
SKIPPED = "import pytest\n\ndef test_needs_a_browser():\n    pytest.skip('no chromium on PATH')\n"
GPU_ONLY = "import pytest, torch\n\n@pytest.mark.gpu\ndef test_on_cuda():\n    assert torch.cuda.is_available()\n"
CPU_BF16_ONLY = "import pytest\n\n@pytest.mark.cpu_bf16\ndef test_on_bf16_units():\n    pass\n"
MISSING_MODULE = "import pytest\n\npytest.importorskip('no_such_module_here')\n\ndef test_never_runs():\n    pass\n"
XFAIL = "import pytest\n\n@pytest.mark.xfail(reason='known')\ndef test_known_bug():\n    assert False\n"
STRICT_XFAIL = (
    "import pytest\n\n@pytest.mark.xfail(reason='known', strict=True)\ndef test_known_bug():\n    assert False\n"
)
# "gpu" among an item's keywords but no gpu marker: a parametrize id, a folder's name
GPU_ID = "import pytest\n\n@pytest.mark.parametrize('device', ['gpu'])\ndef test_id(device):\n    pytest.skip('no')\n"
IN_GPU_FOLDER = "import pytest\n\ndef test_in_a_folder_named_gpu():\n    pytest.skip('no chromium')\n"


def _pytest(
    pytester: pytest.Pytester, monkeypatch, files: dict[str, str], ci: bool, ini: str = "", *options: str
) -> pytest.RunResult:
    """A pytest run of ``files`` with the plugin by its own name (as tests.helpers.skip_policy it would import
    tests.helpers, and with it Lightning): in this process (``runpytest_inprocess``, which imports the plugin
    afresh and drops it after), or, under pytest-xdist (``-n``), in a process of its own."""
    for name, text in files.items():
        (pytester.path / name).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / name).write_text(text)
    pytester.makeini(f"[pytest]\naddopts = --strict-markers\n{ini}")
    helpers = str(ROOT / "tests" / "helpers")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([helpers, str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(helpers)
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    args = ["-p", "skip_policy", "-p", "no:cacheprovider", "-q", "-rs", *options]
    if "-n" in options:
        return pytester.runpytest_subprocess(*args, timeout=240)
    return pytester.runpytest_inprocess(*args)


@pytest.mark.parametrize("skipped", [SKIPPED, MISSING_MODULE], ids=["skip-in-test", "importorskip-in-module"])
def test_a_skip_fails_the_run_in_ci_and_is_named(skipped, pytester, monkeypatch):
    proc = _pytest(pytester, monkeypatch, {"test_pass.py": PASSING, "test_skip.py": skipped}, ci=True)
    assert proc.ret == pytest.ExitCode.TESTS_FAILED, proc.stdout.str()
    assert "skipped or not-strict xfail in CI (CI=true): each one fails the run" in proc.stdout.str()
    assert "test_skip.py" in proc.stdout.str().split("each one fails the run")[1]


def test_a_skip_passes_outside_ci(pytester, monkeypatch):
    proc = _pytest(pytester, monkeypatch, {"test_pass.py": PASSING, "test_skip.py": SKIPPED}, ci=False)
    assert proc.ret == pytest.ExitCode.OK, proc.stdout.str()
    assert "1 passed, 1 skipped" in proc.stdout.str() and "fails the run" not in proc.stdout.str()


def test_only_gpu_tests_and_strict_expected_failures_may_skip_in_ci(pytester, monkeypatch):
    files = {"test_pass.py": PASSING, "test_gpu.py": GPU_ONLY, "test_xfail.py": STRICT_XFAIL}
    proc = _pytest(pytester, monkeypatch, files, ci=True)
    assert proc.ret == pytest.ExitCode.OK, proc.stdout.str()
    assert "fails the run" not in proc.stdout.str() and "1 xfailed" in proc.stdout.str()


def test_the_policy_holds_when_pytest_xdist_runs_the_tests_in_other_processes(pytester, monkeypatch):
    """make test runs the suite with ``-n 2``: the reports are judged in the controller, not where they were made."""
    allowed = {"test_pass.py": PASSING, "test_gpu.py": GPU_ONLY, "test_xfail.py": STRICT_XFAIL}
    proc = _pytest(pytester, monkeypatch, allowed, True, "", "-n", "2")
    assert proc.ret == pytest.ExitCode.OK, proc.stdout.str()
    assert "fails the run" not in proc.stdout.str() and "1 xfailed" in proc.stdout.str()
    proc = _pytest(
        pytester, monkeypatch, {**allowed, "test_skip.py": SKIPPED, "test_xfail.py": XFAIL}, True, "", "-n", "2"
    )
    assert proc.ret == pytest.ExitCode.TESTS_FAILED, proc.stdout.str()
    named = proc.stdout.str().split("each one fails the run")[1].split("only @pytest.mark")[0]
    assert "test_skip.py" in named and "test_xfail.py" in named and "test_gpu.py" not in named


@pytest.mark.parametrize("units", [[], ["avx512_bf16"]], ids=["without", "with"])
def test_cpu_bf16_tests_run_on_cpus_with_the_units_and_skip_elsewhere_saying_why_even_in_ci(
    units, pytester, monkeypatch
):
    # the CPU as vitattn.precision sees it, set before the skip policy asks (and undone after the run)
    monkeypatch.setattr(vitattn.precision, "cpu_bf16_units", lambda: units)
    files = {"test_pass.py": PASSING, "test_bf16.py": CPU_BF16_ONLY}
    proc = _pytest(pytester, monkeypatch, files, ci=True)
    assert proc.ret == pytest.ExitCode.OK, proc.stdout.str()
    assert "fails the run" not in proc.stdout.str()
    if units:
        assert "2 passed" in proc.stdout.str()
    else:
        assert "1 passed, 1 skipped" in proc.stdout.str()
        reason = "needs a CPU with bf16 matrix instructions (amx_bf16 or avx512_bf16); this one has neither"
        assert f"test_bf16.py:3: {reason}" in proc.stdout.str()


def test_xfail_strict_in_the_ini_file_counts_as_strict(pytester, monkeypatch):
    proc = _pytest(pytester, monkeypatch, {"test_xfail.py": XFAIL}, ci=True, ini="xfail_strict = true\n")
    assert proc.ret == pytest.ExitCode.OK, proc.stdout.str()
    assert "fails the run" not in proc.stdout.str() and "1 xfailed" in proc.stdout.str()


@pytest.mark.parametrize(
    "files",
    [
        pytest.param({"test_id.py": GPU_ID}, id="gpu-parametrize-id"),
        pytest.param({"gpu/test_folder.py": IN_GPU_FOLDER}, id="gpu-folder"),
        pytest.param({"test_xfail.py": XFAIL}, id="xfail-mark"),
        pytest.param(
            {"test_xfail.py": "import pytest\n\ndef test_known_bug():\n    pytest.xfail('known')\n"},
            id="pytest.xfail()",
        ),
        pytest.param(
            {"test_xfail.py": "import pytest\n\n@pytest.mark.xfail(reason='known')\ndef test_passes():\n    pass\n"},
            id="xpassed",
        ),
        pytest.param(
            {"test_xfail.py": XFAIL.replace("reason='known'", "reason='known', strict=True, run=False")},
            id="xfail-not-run",
        ),
    ],
)
def test_a_gpu_keyword_without_the_marker_or_a_not_strict_xfail_fails_the_run_in_ci(files, pytester, monkeypatch):
    """The allow-list reads the gpu marker, not every keyword of the test (parametrize ids, folder names); an
    expected failure that is not strict can hide a test that no longer runs or a bug fixed unseen."""
    proc = _pytest(pytester, monkeypatch, {"test_pass.py": PASSING, **files}, ci=True)
    assert proc.ret == pytest.ExitCode.TESTS_FAILED, proc.stdout.str()
    (named,) = proc.stdout.str().split("each one fails the run")[1:]
    assert Path(next(iter(files))).name in named, proc.stdout.str()


def test_a_failing_run_keeps_its_status_in_ci(pytester, monkeypatch):
    failing = "def test_fails():\n    assert False\n"
    proc = _pytest(pytester, monkeypatch, {"test_fail.py": failing, "test_skip.py": SKIPPED}, ci=True)
    assert proc.ret == pytest.ExitCode.TESTS_FAILED and "1 failed, 1 skipped" in proc.stdout.str()
