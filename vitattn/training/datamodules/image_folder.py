"""Classification from an ImageFolder tree: ``ROOT/<split>/<class>/<image>``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitattn.data.images import EvalSplit, image_folder_split, open_image_folder
from vitattn.data.preprocess import Augment, classification_train_transform
from vitattn.training.datamodules.base import ImageDataModule
from vitattn.training.datamodules.patches import PatchBatches, collate_patches

__all__ = ["ImageFolderDataModule"]


class ImageFolderDataModule(PatchBatches, ImageDataModule):
    """Classification from ``root/train``, ``root/val`` and (if present) ``root/test``, each laid out as
    ``<split>/<class>/<image>``; without ``root/test`` the test loader reuses ``root/val``.

    The arguments are the ``data.*`` keys that conf/data/imagefolder.yaml describes (``augment``:
    ``vitattn.data.preprocess.Augment``; ``settings``: ``ImageDataModule``'s). ``max_patches``: each image at its
    own aspect ratio, at most that many ``patch_size`` patches, batches of ``Patches`` (docs/training.md); None:
    squares of ``img_size``. ``batch_patches``: training batches of at most that many patches (``PatchBatches``).
    """

    tasks = ("classification",)
    reads_files = True
    crop = {"crop_pct": 0.875, "crop_mode": "center", "interpolation": "bilinear"}  # timm eval default

    def __init__(
        self,
        root: str | os.PathLike,
        augment: bool | Mapping[str, Any] = True,
        max_patches: int | None = None,
        patch_size: int = 16,
        batch_patches: int | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(**{"cache": "auto", **settings})
        self.root = Path(root)
        self.augment = Augment.from_config(augment)
        self.use_budget(max_patches, patch_size, batch_patches)
        if self.budget is not None:
            self.collate_fn = collate_patches
        self.class_names: list[str] | None = None
        self.num_classes: int | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        training, evaluate = self.transforms(classification_train_transform)
        train = open_image_folder(self.root / "train", training)
        val = open_image_folder(image_folder_split(self.root, "val"), evaluate)
        test_dir = image_folder_split(self.root, "test")
        test = val if test_dir == image_folder_split(self.root, "val") else open_image_folder(test_dir, evaluate)
        for split in {val, test}:
            if split.classes != train.classes:
                raise ValueError(
                    f"classes of {split.root} {split.classes} differ from those of {train.root} {train.classes}"
                )
        self.train_dataset, self.val_dataset, self.test_dataset = train, val, test
        self.class_names = list(train.classes)
        self.num_classes = len(train.classes)
        self._read_images({train, val, test})

    def image_files(self) -> list[str]:
        folders = dict.fromkeys((self.train_dataset, self.val_dataset, self.test_dataset))  # test may be val
        return [path for folder in folders if folder is not None for path, _ in folder.samples]

    def train_files(self) -> list[str]:
        return [path for path, _ in self.train_dataset.samples]

    def sample_key(self, index: int) -> str:
        """Training image ``index``'s path relative to ``root/train``."""
        path, _ = self.train_dataset.samples[index]
        return Path(path).relative_to(self.train_dataset.root).as_posix()

    def evaluation_split(self, split: str) -> EvalSplit:
        folder = self.val_dataset if split == "val" else self.test_dataset
        files, labels = [path for path, _ in folder.samples], [label for _, label in folder.samples]
        return EvalSplit(str(Path(folder.root).resolve()), files=files, ids=labels)
