"""The package as users get it: a wheel with its configs, installed (not editable) into a fresh venv,
and their own config groups added with Hydra's ``--config-dir``."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import vitattn.conf
from tests.helpers import TINY, TINY_SHAPES

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(vitattn.conf.__file__).parent
FAST = [*TINY, *TINY_SHAPES, "trainer.fast_dev_run=true", "num_threads=1"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("vitattn-*.whl")
    return built


def test_wheel_holds_every_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"vitattn/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert len(configs) > 20 and "vitattn/conf/train.yaml" in configs
    assert configs <= names, sorted(configs - names)
    assert "vitattn/serve/index.html" in names  # vitattn-serve's page


def test_wheel_leaves_out_the_benchmarks_and_load_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert "vitattn/__init__.py" in modules and "vitattn/serve/server.py" in modules
    # benchmarks/ (speed, learning, transfer, load tests) sits beside the package and is never shipped
    shipped = [n for n in modules if n.startswith(("benchmarks/", "scripts/", "vitattn/bench/"))]
    shipped += [n for n in modules if Path(n).stem in ("load", "load_serve", "load_caption")]
    assert not shipped, shipped


def _console_script(venv: Path, name: str) -> Path:
    script = venv / "bin" / name
    assert script.is_file(), f"{name} is missing from {venv}/bin: the wheel declares no such console script"
    return script


@pytest.mark.slow
def test_wheel_installed_in_a_fresh_venv_trains_from_an_empty_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The dependencies (torch, Lightning, ...) come from this environment's site-packages as a plain path
    # entry; this environment's editable vitattn is not on it (its finder is a .pth hook that a plain path
    # entry does not run), so the only vitattn is the wheel's.
    fresh_site = next((venv / "lib").glob("python3*/site-packages"))
    (fresh_site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import vitattn; print(vitattn.__file__)"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(fresh_site), where
    result = subprocess.run(
        [str(_console_script(venv, "vitattn-train")), *FAST, "logger=csv", "hydra.run.dir=run"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (empty / "run" / "config.yaml").is_file() and "run directory:" in result.stdout


@pytest.mark.slow
def test_users_own_experiment_config_through_config_dir(tmp_path):
    mine = tmp_path / "myconf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "my_experiment.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /head: classification\n"
        "model:\n  mlp_ratio: 3.0\noptim:\n  lr: 0.0123\n"
    )
    script = _console_script(Path(sys.executable).parent.parent, "vitattn-train")
    result = subprocess.run(
        [
            str(script),
            "--config-dir",
            str(tmp_path / "myconf"),
            "experiment=my_experiment",
            *FAST,
            "logger=csv",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert (saved.model.mlp_ratio, saved.optim.lr, saved.head.task) == (3.0, 0.0123, "classification")
