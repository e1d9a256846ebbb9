"""Caption DataModules that read image files: COCO-style caption files and Karpathy-split files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions, load_karpathy
from vitattn.data.images import EvalSplit
from vitattn.data.preprocess import CAPTION_CROP_SCALE, Augment, CaptionAugment
from vitattn.training.datamodules.base import ImageDataModule
from vitattn.training.datamodules.patches import PatchBatches

__all__ = ["CaptionFilesDataModule", "CocoCaptionDataModule", "KarpathyDataModule"]


class CaptionFilesDataModule(PatchBatches, ImageDataModule):
    """Image files under ``image_dir`` with their captions; subclasses say which images each split holds.

    Training items take ``captions_per_image`` of their image's captions (``draw_captions``: at random, ``all``
    every one), teacher-forced on one encoding of the image; val and test items take the first, and carry all of
    them as references. The arguments are the ``data.*`` keys of conf/data/coco.yaml and karpathy.yaml (``settings``:
    ``ImageDataModule``'s). ``max_patches``: each image at its own aspect ratio, at most that many ``patch_size``
    patches (``PatchBatches``); None: squares of ``img_size``. ``batch_patches``: training batches of at most that
    many patches.
    """

    tasks = ("caption",)
    reads_files = True

    def __init__(
        self,
        image_dir: str | os.PathLike,
        augment: bool | Mapping[str, Any] = True,
        max_patches: int | None = None,
        patch_size: int = 16,
        batch_patches: int | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(**{"num_workers": "auto", "cache": "auto", **settings})
        self.image_dir = image_dir
        # the mild crop always; flips and colour jitter only where asked and no caption contradicts them
        self.augment = Augment.from_config(augment, scale=CAPTION_CROP_SCALE, hflip=0.0)
        self.use_budget(max_patches, patch_size, batch_patches)

    def split_images(self) -> tuple[list[CocoImage], list[CocoImage], list[CocoImage]]:
        """The (train, val, test) images; test may be the val list itself, which then is one dataset."""
        raise NotImplementedError

    def split_source(self, split: str) -> str:
        """What the ``val`` or ``test`` images are, for evaluation reports."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        train_images, val_images, test_images = self.split_images()
        training, evaluate = self.transforms(CaptionAugment)
        train = CocoCaptionDataset(self.image_dir, train_images, training)
        val = CocoCaptionDataset(self.image_dir, val_images, evaluate)
        test = val if test_images is val_images else CocoCaptionDataset(self.image_dir, test_images, evaluate)
        vocab = self._caption_tokenizer(lambda: train.captions)
        self._use_captions((train, val, test), vocab, self.captions_per_image)
        self._read_images({train, val, test})

    def image_files(self) -> list[str]:
        if self.train_dataset is None:
            return []
        splits = dict.fromkeys(d.dataset for d in (self.train_dataset, self.val_dataset, self.test_dataset))
        return [str(d.image_dir / im.file_name) for d in splits for im in d.images]

    def train_files(self) -> list[str]:
        images = self.train_dataset.dataset  # TokenizedCaptions -> CocoCaptionDataset
        return [str(images.image_dir / im.file_name) for im in images.images]

    def sample_key(self, index: int) -> str:
        """Training image ``index``'s file name (relative to ``image_dir``)."""
        return self.train_dataset.dataset.images[index].file_name

    def train_references(self) -> list[list[str]]:
        """Each training image's captions (after ``setup``)."""
        return [list(image.captions) for image in self.train_dataset.dataset.images]

    def evaluation_split(self, split: str) -> EvalSplit:
        images = (self.val_dataset if split == "val" else self.test_dataset).dataset  # TokenizedCaptions -> images
        return EvalSplit(
            self.split_source(split),
            files=[str(images.image_dir / im.file_name) for im in images.images],
            ids=[im.image_id for im in images.images],
            references={im.image_id: list(im.captions) for im in images.images},
        )


class CocoCaptionDataModule(CaptionFilesDataModule):
    """Captioning from COCO-style caption files (``vitattn.data.coco``); ``test_annotations`` None tests on
    ``val_annotations``."""

    def __init__(
        self,
        image_dir: str | os.PathLike,
        train_annotations: str | os.PathLike,
        val_annotations: str | os.PathLike,
        test_annotations: str | os.PathLike | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(image_dir, **{"num_workers": 0, **settings})
        self.annotations = (train_annotations, val_annotations, test_annotations or val_annotations)

    def split_images(self) -> tuple[list[CocoImage], list[CocoImage], list[CocoImage]]:
        train_file, val_file, test_file = self.annotations
        train, val = load_coco_captions(train_file), load_coco_captions(val_file)
        return train, val, val if test_file == val_file else load_coco_captions(test_file)

    def split_source(self, split: str) -> str:
        return str(Path(self.annotations[1 if split == "val" else 2]).resolve())


class KarpathyDataModule(CaptionFilesDataModule):
    """The train / val / test splits of a Karpathy-split JSON file (``vitattn.data.coco``): COCO, Flickr8k or
    Flickr30k; ``restval_in_train`` trains on the ``restval`` images too."""

    def __init__(
        self,
        dataset_json: str | os.PathLike,
        image_dir: str | os.PathLike,
        restval_in_train: bool = True,
        **settings: Any,
    ) -> None:
        super().__init__(image_dir, **settings)
        self.dataset_json, self.restval_in_train = dataset_json, restval_in_train

    def split_images(self) -> tuple[list[CocoImage], list[CocoImage], list[CocoImage]]:
        splits = load_karpathy(self.dataset_json)
        train = splits["train"] + (splits["restval"] if self.restval_in_train else [])
        return train, splits["val"], splits["test"]

    def split_source(self, split: str) -> str:
        return f"{Path(self.dataset_json).resolve()} ({split} split)"
