"""tests/helpers/skip_policy.py, run on tiny test files by a pytest of their own: in CI a skip fails the run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    tmp_path: Path, files: dict[str, str], ci: bool, ini: str = "", *options: str
) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = --strict-markers\n{ini}")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    # the plugin by its own name: as tests.helpers.skip_policy it would import tests.helpers, and with it Lightning
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "helpers"), str(ROOT), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    command = [sys.executable, "-m", "pytest", "-p", "skip_policy", "-p", "no:cacheprovider", "-q", "-rs"]
    return subprocess.run(
        [*command, *options, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("skipped", [SKIPPED, MISSING_MODULE], ids=["skip-in-test", "importorskip-in-module"])
def test_a_skip_fails_the_run_in_ci_and_is_named(skipped, tmp_path):
    proc = _pytest(tmp_path, {"test_pass.py": PASSING, "test_skip.py": skipped}, ci=True)
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    assert "skipped or not-strict xfail in CI (CI=true): each one fails the run" in proc.stdout
    assert "test_skip.py" in proc.stdout.split("each one fails the run")[1]


def test_a_skip_passes_outside_ci(tmp_path):
    proc = _pytest(tmp_path, {"test_pass.py": PASSING, "test_skip.py": SKIPPED}, ci=False)
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout and "fails the run" not in proc.stdout


def test_only_gpu_tests_and_strict_expected_failures_may_skip_in_ci(tmp_path):
    files = {"test_pass.py": PASSING, "test_gpu.py": GPU_ONLY, "test_xfail.py": STRICT_XFAIL}
    proc = _pytest(tmp_path, files, ci=True)
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "fails the run" not in proc.stdout and "1 xfailed" in proc.stdout


def test_the_policy_holds_when_pytest_xdist_runs_the_tests_in_other_processes(tmp_path):
    """make test runs the suite with ``-n 2``: the reports are judged in the controller, not where they were made."""
    allowed = {"test_pass.py": PASSING, "test_gpu.py": GPU_ONLY, "test_xfail.py": STRICT_XFAIL}
    proc = _pytest(tmp_path, allowed, True, "", "-n", "2")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "fails the run" not in proc.stdout and "1 xfailed" in proc.stdout
    proc = _pytest(tmp_path, {**allowed, "test_skip.py": SKIPPED, "test_xfail.py": XFAIL}, True, "", "-n", "2")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    named = proc.stdout.split("each one fails the run")[1].split("only @pytest.mark")[0]
    assert "test_skip.py" in named and "test_xfail.py" in named and "test_gpu.py" not in named


@pytest.mark.parametrize("units", [[], ["avx512_bf16"]], ids=["without", "with"])
def test_cpu_bf16_tests_run_on_cpus_with_the_units_and_skip_elsewhere_saying_why_even_in_ci(units, tmp_path):
    # the CPU as vitattn.precision sees it, set before the skip policy asks
    units_of = f"import vitattn.precision\n\nvitattn.precision.cpu_bf16_units = lambda: {units!r}\n"
    files = {"conftest.py": units_of, "test_pass.py": PASSING, "test_bf16.py": CPU_BF16_ONLY}
    proc = _pytest(tmp_path, files, ci=True)
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "fails the run" not in proc.stdout
    if units:
        assert "2 passed" in proc.stdout
    else:
        assert "1 passed, 1 skipped" in proc.stdout
        reason = "needs a CPU with bf16 matrix instructions (amx_bf16 or avx512_bf16); this one has neither"
        assert f"test_bf16.py:3: {reason}" in proc.stdout


def test_xfail_strict_in_the_ini_file_counts_as_strict(tmp_path):
    proc = _pytest(tmp_path, {"test_xfail.py": XFAIL}, ci=True, ini="xfail_strict = true\n")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "fails the run" not in proc.stdout and "1 xfailed" in proc.stdout


# Each case starts a pytest run (about 8 s): two run with the fast tests, the rest with the slow ones.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "files",
    [
        pytest.param({"test_id.py": GPU_ID}, id="gpu-parametrize-id"),
        pytest.param({"gpu/test_folder.py": IN_GPU_FOLDER}, id="gpu-folder", marks=SLOW),
        pytest.param({"test_xfail.py": XFAIL}, id="xfail-mark"),
        pytest.param(
            {"test_xfail.py": "import pytest\n\ndef test_known_bug():\n    pytest.xfail('known')\n"},
            id="pytest.xfail()",
            marks=SLOW,
        ),
        pytest.param(
            {"test_xfail.py": "import pytest\n\n@pytest.mark.xfail(reason='known')\ndef test_passes():\n    pass\n"},
            id="xpassed",
            marks=SLOW,
        ),
        pytest.param(
            {"test_xfail.py": XFAIL.replace("reason='known'", "reason='known', strict=True, run=False")},
            id="xfail-not-run",
            marks=SLOW,
        ),
    ],
)
def test_a_gpu_keyword_without_the_marker_or_a_not_strict_xfail_fails_the_run_in_ci(files, tmp_path):
    """The allow-list reads the gpu marker, not every keyword of the test (parametrize ids, folder names); an
    expected failure that is not strict can hide a test that no longer runs or a bug fixed unseen."""
    proc = _pytest(tmp_path, {"test_pass.py": PASSING, **files}, ci=True)
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    (named,) = proc.stdout.split("each one fails the run")[1:]
    assert Path(next(iter(files))).name in named, proc.stdout


def test_a_failing_run_keeps_its_status_in_ci(tmp_path):
    failing = "def test_fails():\n    assert False\n"
    proc = _pytest(tmp_path, {"test_fail.py": failing, "test_skip.py": SKIPPED}, ci=True)
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED and "1 failed, 1 skipped" in proc.stdout
