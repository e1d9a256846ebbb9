"""Shapes: a generated dataset for captioning and classification, a pure function of ``(seed, split, index)``:
one to three shapes named left to right ("a small red circle left of a large blue square"); positions are
fractions of the side, y down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset
from torchvision.transforms.functional import pil_to_tensor

from vitattn.models import TASKS

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 90, 215),
    "yellow": (240, 200, 20),
    "purple": (140, 60, 190),
}
SHAPES = ("circle", "square", "triangle")
SIZES: dict[str, float] = {"small": 0.20, "large": 0.38}  # side of the shape's box / image side
BACKGROUND = (235, 235, 235)
SPLITS = ("train", "val", "test")
CLASS_NAMES = [f"{colour} {shape}" for colour in COLOURS for shape in SHAPES]

_MAX_OBJECTS = 3
_EDGE = 0.03  # free border between a shape and the image edge
_GAP = 0.05  # free space between two shapes' boxes, so they stay apart after downsampling
_MIN_DX = 0.06  # centre-x gap between neighbours, so the left-to-right order is clear
_MIN_AXIS_GAP = 0.10  # least | |dx| - |dy| | between neighbours, so the relation is clear
_PLACEMENT_TRIES = 50
_CLASS_INDEX = {name: i for i, name in enumerate(CLASS_NAMES)}


@dataclass(frozen=True)
class SceneObject:
    """One shape: what it is and where its box is centred (fractions of the image side)."""

    size: str
    colour: str
    shape: str
    cx: float
    cy: float

    @property
    def side(self) -> float:
        return SIZES[self.size]

    @property
    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape}"


Scene = tuple[SceneObject, ...]  # sorted left to right by cx


def relation(a: SceneObject, b: SceneObject) -> str:
    """Where ``a`` sits relative to ``b``: along the axis on which their centres differ most."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    if abs(dx) >= abs(dy):
        return "left of" if dx > 0 else "right of"
    return "above" if dy > 0 else "below"


def scene_caption(objects: Scene) -> str:
    """The objects chained in the given order, "a small red circle left of a large blue square"; the canonical
    caption of a scene (left to right)."""
    words = [objects[0].phrase]
    for prev, nxt in zip(objects, objects[1:]):
        words += [relation(prev, nxt), nxt.phrase]
    return " ".join(words)


def scene_references(scene: Scene) -> list[str]:
    """All valid captions: the canonical one, then (2+ objects) the chain read right to left."""
    return [scene_caption(scene)] if len(scene) == 1 else [scene_caption(scene), scene_caption(scene[::-1])]


def scene_label(scene: Scene) -> int:
    """Class index of the left-most object, into ``CLASS_NAMES``."""
    return _CLASS_INDEX[f"{scene[0].colour} {scene[0].shape}"]


def _is_valid(objects: list[tuple[float, float, float]]) -> bool:
    """Check ``(cx, cy, side)`` sorted by cx: no overlap, clear order, clear relations."""
    for i, (x1, y1, s1) in enumerate(objects):
        for x2, y2, s2 in objects[i + 1 :]:
            reach = (s1 + s2) / 2 + _GAP
            if abs(x2 - x1) < reach and abs(y2 - y1) < reach:  # boxes (plus gap) overlap
                return False
    for (x1, y1, _), (x2, y2, _) in zip(objects, objects[1:]):
        dx, dy = x2 - x1, abs(y2 - y1)
        if dx < _MIN_DX or abs(dx - dy) < _MIN_AXIS_GAP:
            return False
    return True


def sample_scene(rng: np.random.Generator) -> Scene:
    """1-3 shapes placed by every rule, positions redrawn until they hold (shapes that do not fit are redrawn,
    keeping their number, so 1, 2 and 3 objects stay equally likely)."""
    sizes, colours = list(SIZES), list(COLOURS)
    n = int(rng.integers(1, _MAX_OBJECTS + 1))
    while True:
        draws = rng.integers([len(sizes), len(colours), len(SHAPES)], size=(n, 3))  # (n, 3)
        kinds = [(sizes[s], colours[c], SHAPES[k]) for s, c, k in draws.tolist()]
        sides = [SIZES[size] for size, _, _ in kinds]
        lows = [side / 2 + _EDGE for side in sides]  # least centre coordinate inside the border
        for _ in range(_PLACEMENT_TRIES):
            u = rng.random((n, 2)).tolist()  # (n, 2) in [0, 1), stretched over each free range
            placed = [
                (low + ux * (1 - 2 * low), low + uy * (1 - 2 * low), side)
                for (ux, uy), low, side in zip(u, lows, sides)
            ]
            order = sorted(range(n), key=lambda i: placed[i][0])
            if _is_valid([placed[i] for i in order]):
                return tuple(SceneObject(*kinds[i], *placed[i][:2]) for i in order)


def generate_scene(seed: int, split: str, index: int) -> Scene:
    """The scene at ``index`` of ``split``; the same arguments always give the same scene."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if seed < 0 or index < 0:
        raise ValueError(f"seed={seed} and index={index} must be non-negative")
    return sample_scene(np.random.default_rng([seed, SPLITS.index(split), index]))


def render_scene(scene: Scene, img_size: int = 64) -> Image.Image:
    """The scene as an ``img_size`` RGB square, drawn at 2-4x and box-filtered down (antialiased edges)."""
    factor = max(2, min(4, -(-256 // img_size)))  # drawn at >= 256 px where 2-4x allows
    side = img_size * factor
    image = Image.new("RGB", (side, side), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in scene:
        x, y, half = obj.cx * side, obj.cy * side, obj.side * side / 2
        box = (x - half, y - half, x + half, y + half)
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif obj.shape == "square":
            draw.rectangle(box, fill=fill)
        else:  # triangle, apex up, filling the box
            draw.polygon([(x, y - half), (x - half, y + half), (x + half, y + half)], fill=fill)
    return image.reduce(factor)


class ShapesDataset(Dataset):
    """``size`` shape scenes of ``split`` (own random stream; ``seed``) rendered at ``img_size`` on access.

    ``task="caption"`` items are ``{"image", "caption", "references", "image_id"}``, ``classification`` items
    ``(image, label)`` (the left-most shape's class); images are (3, height, width) uint8 after ``transform``.
    """

    class_names = CLASS_NAMES

    def __init__(
        self,
        split: str,
        size: int,
        img_size: int = 64,
        seed: int = 0,
        task: Literal["caption", "classification"] = "caption",
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"task={task!r} must be one of {TASKS}")
        if size < 0:
            raise ValueError(f"size={size} must be non-negative")
        if img_size < 16:
            raise ValueError(f"img_size={img_size} is too small to draw shapes; use 16 or more")
        self.split, self.img_size, self.seed, self.task = split, img_size, seed, task
        self.transform = transform
        self.scenes: list[Scene] = [generate_scene(seed, split, i) for i in range(size)]

    def __len__(self) -> int:
        return len(self.scenes)

    @property
    def captions(self) -> list[str]:
        """Canonical caption of every image, in index order."""
        return [scene_caption(scene) for scene in self.scenes]

    def caption(self, index: int) -> str:
        return scene_caption(self.scenes[index])

    def references(self, index: int) -> list[str]:
        """All valid captions of image ``index``, canonical first."""
        return scene_references(self.scenes[index])

    def label(self, index: int) -> int:
        return scene_label(self.scenes[index])

    def image(self, index: int) -> torch.Tensor:
        """The rendered image as (3, height, width) uint8, before ``transform``."""
        return pil_to_tensor(render_scene(self.scenes[index], self.img_size))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | dict:
        if not 0 <= index < len(self):
            raise IndexError(f"index={index} out of range for {len(self)} images")
        image = self.image(index)  # (3, height, width) uint8
        if self.transform is not None:
            image = self.transform(image)
        if self.task == "classification":
            return image, self.label(index)
        return {
            "image": image,
            "caption": self.caption(index),
            "references": self.references(index),
            "image_id": index,
        }
