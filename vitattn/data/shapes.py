"""Shapes: a generated dataset for captioning and classification, a pure function of ``(seed, split, index)``:
one to three shapes named left to right ("a small red circle left of a large blue square"); positions are
fractions of the side, y down. With ``max_aspect`` above 1 (issue 69's variant) each scene is a wide or tall frame
of 1:1 to ``max_aspect``:1, its shapes spaced along the long side and named along it ("left of" or "above");
positions are then in units of the short side."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

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
# The variant at other aspects (``max_aspect`` > 1), in units of the short side: shapes large enough to keep
# 2 patches a side at 4:1 under 64 patches (4 patches across), apart by a gap along the long side.
ASPECT_SIZES: dict[str, float] = {"small": 0.5, "large": 0.8}
ASPECT_STEP = 16  # aspects are 1 + k / 16: a whole number of pixels at any image size that 16 divides
_ASPECT_EDGE = 0.05
_ASPECT_GAP = 0.10


@dataclass(frozen=True)
class SceneObject:
    """One shape: what it is and where its box is centred (fractions of the image side)."""

    size: str
    colour: str
    shape: str
    cx: float
    cy: float

    aspect_sizes: bool = False  # sized by ``ASPECT_SIZES`` (the variant at other aspects)

    @property
    def side(self) -> float:
        return (ASPECT_SIZES if self.aspect_sizes else SIZES)[self.size]

    @property
    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape}"


Scene = tuple[SceneObject, ...]  # sorted left to right by cx (top to bottom by cy in a tall frame)


class Frame(NamedTuple):
    """A scene's image size in units of its short side: ``(aspect, 1)`` wide, ``(1, aspect)`` tall."""

    width: float
    height: float

    @property
    def tall(self) -> bool:
        return self.height > self.width


SQUARE = Frame(1.0, 1.0)


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


def _fits(sides: list[float], length: float) -> bool:
    """Whether shapes of ``sides`` fit in a row along ``length``, with the edges and the gaps between them."""
    return sum(sides) + _ASPECT_GAP * (len(sides) - 1) + 2 * _ASPECT_EDGE <= length + 1e-9


def sample_aspect_scene(rng: np.random.Generator, max_aspect: float) -> tuple[Scene, Frame]:
    """A frame of aspect 1 + k/16 up to ``max_aspect`` (k uniform), wide or tall at even odds, and 1-3 shapes
    (as many as small ones fit in a row along its long side) spaced along it at random, each at a random place
    across it: no overlap (the gap), and neighbours' centres apart along the long side by more than across it."""
    aspect = 1 + int(rng.integers(0, math.floor((max_aspect - 1) * ASPECT_STEP + 1e-9) + 1)) / ASPECT_STEP
    tall = bool(rng.integers(2))
    small = min(ASPECT_SIZES.values())
    most = max(n for n in range(1, _MAX_OBJECTS + 1) if n == 1 or _fits([small] * n, aspect))
    n = int(rng.integers(1, most + 1))
    sizes, colours = list(ASPECT_SIZES), list(COLOURS)
    while True:  # kinds redrawn, keeping their number, until the row fits
        draws = rng.integers([len(sizes), len(colours), len(SHAPES)], size=(n, 3))  # (n, 3)
        kinds = [(sizes[s], colours[c], SHAPES[k]) for s, c, k in draws.tolist()]
        sides = [ASPECT_SIZES[size] for size, _, _ in kinds]
        if _fits(sides, aspect):
            break
    slack = aspect - sum(sides) - _ASPECT_GAP * (n - 1) - 2 * _ASPECT_EDGE  # free length, shared out at random
    cuts = np.sort(rng.random(n)) * slack  # (n,) the free length before each shape, cumulative
    across = rng.random(n)  # (n,) in [0, 1), stretched over each shape's free range across
    objects, start = [], _ASPECT_EDGE
    for side, kind, cut, u in zip(sides, kinds, cuts.tolist(), across.tolist()):
        along = start + cut + side / 2
        low = side / 2 + _ASPECT_EDGE
        cross = low + u * (1 - 2 * low)
        cx, cy = (cross, along) if tall else (along, cross)
        objects.append(SceneObject(*kind, cx, cy, aspect_sizes=True))
        start += side + _ASPECT_GAP
    return tuple(objects), (Frame(1.0, aspect) if tall else Frame(aspect, 1.0))


def _scene_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The random stream of one scene: its own for each ``(seed, split, index)``."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if seed < 0 or index < 0:
        raise ValueError(f"seed={seed} and index={index} must be non-negative")
    return np.random.default_rng([seed, SPLITS.index(split), index])


def generate_scene(seed: int, split: str, index: int) -> Scene:
    """The scene at ``index`` of ``split``; the same arguments always give the same scene."""
    return sample_scene(_scene_rng(seed, split, index))


def check_max_aspect(max_aspect: float) -> float:
    """``max_aspect`` as a float, refused in one line when not a number from 1 (squares) to 16."""
    if isinstance(max_aspect, bool) or not isinstance(max_aspect, numbers.Real) or not 1 <= max_aspect <= 16:
        raise ValueError(f"max_aspect={max_aspect!r} must be a number from 1 (squares) to 16")
    return float(max_aspect)


def generate_aspect_scene(seed: int, split: str, index: int, max_aspect: float = 1.0) -> tuple[Scene, Frame]:
    """The scene at ``index`` of ``split`` and its frame: up to ``max_aspect``:1 (``sample_aspect_scene``); 1 gives
    ``generate_scene``'s square scenes, draw for draw."""
    if check_max_aspect(max_aspect) == 1:
        return generate_scene(seed, split, index), SQUARE
    return sample_aspect_scene(_scene_rng(seed, split, index), max_aspect)


def render_scene(scene: Scene, img_size: int = 64, frame: Frame = SQUARE) -> Image.Image:
    """The scene as an RGB image of ``frame`` whose short side is ``img_size`` (a square by default), drawn at
    2-4x and box-filtered down (antialiased edges)."""
    factor = max(2, min(4, -(-256 // img_size)))  # drawn at >= 256 px where 2-4x allows
    side = img_size * factor  # the short side drawn, the unit of the positions
    size = (round(frame.width * img_size) * factor, round(frame.height * img_size) * factor)
    image = Image.new("RGB", size, BACKGROUND)
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
    ``max_aspect`` above 1: frames of 1:1 up to that, ``img_size`` their short side (``generate_aspect_scene``).
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
        max_aspect: float = 1.0,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"task={task!r} must be one of {TASKS}")
        if size < 0:
            raise ValueError(f"size={size} must be non-negative")
        if img_size < 16:
            raise ValueError(f"img_size={img_size} is too small to draw shapes; use 16 or more")
        self.split, self.img_size, self.seed, self.task = split, img_size, seed, task
        self.transform = transform
        drawn = [generate_aspect_scene(seed, split, i, max_aspect) for i in range(size)]
        self.scenes: list[Scene] = [scene for scene, _ in drawn]
        self.frames: list[Frame] = [frame for _, frame in drawn]

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
        return pil_to_tensor(render_scene(self.scenes[index], self.img_size, self.frames[index]))

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
