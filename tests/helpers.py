"""Small on-disk datasets and config composition shared by the tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from PIL import Image

import vitattn.conf

CONF_DIR = Path(vitattn.conf.__file__).parent

# A small model and data for fast runs: 32 px images, 8 px patches, width 32, 2 layers.
TINY = [
    "model.embed_dim=32",
    "model.depth=2",
    "model.num_heads=2",
    "model.patch_size=8",
    "data.img_size=32",
    "data.batch_size=8",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=csv",
]
TINY_SHAPES = ["data.num_train=64", "data.num_val=16", "data.num_test=16"]


def console_script(name: str) -> Path:
    """The venv's ``name`` console script. A missing one fails the test: the install is broken, nothing to skip."""
    path = Path(sys.executable).with_name(name)
    assert path.is_file(), f"console script {name} is missing from {path.parent}: run pip install -e . --no-deps"
    return path


def compose_train(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, writing into ``output_dir``."""
    extra = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    with initialize_config_module("vitattn.conf", version_base="1.3"):
        return compose("train", overrides=[*overrides, *extra])


def _image(rng: np.random.Generator, size: int) -> Image.Image:
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    pixels = np.clip(colour + rng.integers(-20, 20, (size, size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def make_image_folder(root: Path, classes=("cat", "dog"), per_class: int = 6, size: int = 40) -> Path:
    """``root/{train,val}/<class>/<n>.png`` with random images."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                _image(rng, size).save(root / split / name / f"{i}.png")
    return root


def make_coco(root: Path, num_train: int = 12, num_val: int = 6, size: int = 40) -> dict[str, Path]:
    """Images and COCO caption JSONs (two captions per image) under ``root``."""
    rng = np.random.default_rng(1)
    words = ["a", "red", "blue", "dog", "cat", "on", "the", "grass", "sofa", "sleeping"]
    image_dir = root / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    paths = {"image_dir": image_dir}
    next_id = 1
    for split, n in (("train", num_train), ("val", num_val)):
        images, annotations = [], []
        for _ in range(n):
            name = f"{split}_{next_id:03d}.jpg"
            _image(rng, size).save(image_dir / name)
            images.append({"id": next_id, "file_name": name})
            for _ in range(2):
                caption = " ".join(rng.choice(words, 5)).capitalize() + "."
                annotations.append({"id": len(annotations) + 1, "image_id": next_id, "caption": caption})
            next_id += 1
        path = root / f"captions_{split}.json"
        path.write_text(json.dumps({"images": images, "annotations": annotations}))
        paths[f"{split}_annotations"] = path
    return paths
