"""Captioning from COCO-style caption files as a DataModule."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitattn.data.coco import CocoImage, load_coco_captions
from vitattn.data.tokenizer import Tokenizer
from vitattn.training.datamodules.caption_files import CaptionFilesDataModule

__all__ = ["CocoCaptionDataModule"]


class CocoCaptionDataModule(CaptionFilesDataModule):
    """Captioning from COCO-style caption files (see ``vitattn.data.coco``).

    Args:
        image_dir: folder that the files' ``file_name`` entries are relative to.
        train_annotations, val_annotations: COCO caption JSON files.
        test_annotations: the test file; ``val_annotations`` when not given.
        img_size, batch_size, num_workers, min_word_freq, max_caption_len, vocab_path, augment, cache:
            as in ``CaptionFilesDataModule``.
        bad_images, verify: unreadable image files, as in ``ImageFolderDataModule``.
        mean, std, interpolation, crop_pct, crop_mode: the preprocessing (None: the pretrained weights', else the
            whole image squashed, bicubic, ImageNet's statistics).
    """

    def __init__(
        self,
        image_dir: str | os.PathLike,
        train_annotations: str | os.PathLike,
        val_annotations: str | os.PathLike,
        test_annotations: str | os.PathLike | None = None,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int | str = 0,
        min_word_freq: int | str = "auto",
        max_caption_len: int = 32,
        vocab_path: str | os.PathLike | None = None,
        augment: bool | Mapping[str, Any] = True,
        cache: str = "auto",
        bad_images: str = "raise",
        verify: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        interpolation: str | None = None,
        crop_pct: float | None = None,
        crop_mode: str | None = None,
        tokenizer: Mapping[str, Any] | None = None,
        vocab: Tokenizer | None = None,
    ) -> None:
        preprocess = dict(mean=mean, std=std, interpolation=interpolation, crop_pct=crop_pct, crop_mode=crop_mode)
        super().__init__(
            image_dir,
            img_size,
            batch_size,
            num_workers,
            min_word_freq,
            max_caption_len,
            vocab_path,
            augment,
            cache,
            preprocess,
            tokenizer,
            vocab,
        )
        self._bad_image_settings(bad_images, verify)
        self.annotations = (train_annotations, val_annotations, test_annotations or val_annotations)

    def split_images(self) -> tuple[list[CocoImage], list[CocoImage], list[CocoImage]]:
        train_file, val_file, test_file = self.annotations
        train, val = load_coco_captions(train_file), load_coco_captions(val_file)
        return train, val, val if test_file == val_file else load_coco_captions(test_file)

    def split_source(self, split: str) -> str:
        return str(Path(self.annotations[1 if split == "val" else 2]).resolve())
