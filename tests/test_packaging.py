"""The package as users get it: a wheel with its configs, installed (not editable) into a fresh venv,
and their own config groups added with Hydra's ``--config-dir``."""

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.parser import Parser
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import vitattn.conf
from omegaconf import OmegaConf

import vitattn
from tests.helpers.runs import TINY, TINY_SHAPES

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(vitattn.conf.__file__).parent
FAST = [*TINY, *TINY_SHAPES, "trainer.fast_dev_run=true", "num_threads=1"]
# pip offline and quiet: no index, no version check against PyPI.
PIP_ENV = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGES = ["vitattn", "hydra_plugins", "conf"]  # the source folders the wheel is built from


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources, never into the checkout.
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*command, "-q", "-w", str(out)], check=True, capture_output=True, env=PIP_ENV)
    (built,) = out.glob("vitattn-*.whl")
    return built


def test_listed_packages_are_every_package_folder():
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("vitattn", "hydra_plugins")
        for p in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    # hydra_plugins is a namespace package (no __init__): listed, so that an editable install lets Hydra's plugin
    # scan find the sweeper in it
    expected = folders | {"vitattn.conf", "hydra_plugins"}
    listed = set(SETUPTOOLS["packages"])
    assert listed == expected, sorted(listed ^ expected)
    assert SETUPTOOLS["package-dir"] == {"vitattn.conf": "conf"} and (ROOT / "conf" / "train.yaml").is_file()


def test_hydras_plugin_scan_finds_the_optuna_sweeper():
    """Hydra finds plugins by listing the ``hydra_plugins`` namespace package: the installed project must be in it."""
    code = "import hydra_plugins, pkgutil; print(sorted(m.name for m in pkgutil.iter_modules(hydra_plugins.__path__)))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, check=True)
    assert "vitattn_optuna_sweeper" in out.stdout, out.stdout


def _wheel_metadata(wheel: Path):
    archive = zipfile.ZipFile(wheel)
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(archive.read(name).decode()), set(archive.namelist())


def test_wheel_metadata_has_licence_version_and_types(wheel):
    metadata, names = _wheel_metadata(wheel)
    assert metadata["Version"] == vitattn.__version__  # one version source: vitattn.__version__
    assert metadata["License-Expression"] == "Apache-2.0" and metadata.get_all("License-File") == ["LICENSE"]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "vitattn/py.typed" in names
    requires = metadata.get_all("Requires-Dist")
    assert "lightning>=2.6" in requires  # vitattn.training.callbacks.EMA subclasses WeightAveraging (Lightning 2.6)
    assert metadata["Requires-Python"] == ">=3.11"


def _imported_distributions() -> dict[str, set[str]]:
    """Distribution name -> the packaged files that import it (top-level and function-level imports alike)."""
    owners, found = packages_distributions(), {}
    for path in (path for package in PACKAGES for path in (ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in PACKAGES:
                    continue
                for dist in owners.get(top, [top]):
                    found.setdefault(_normalize(dist), set()).add(path.relative_to(ROOT).as_posix())
    return found


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(requirements: list[str]) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in requirements}


def test_every_imported_package_is_declared():
    project = PYPROJECT["project"]
    declared = _declared(project["dependencies"])
    declared |= {d for extra in project["optional-dependencies"].values() for d in _declared(extra)}
    missing = {dist: sorted(files) for dist, files in _imported_distributions().items() if dist not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


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
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        env=PIP_ENV,
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
