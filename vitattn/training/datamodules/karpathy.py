"""Captioning from a Karpathy-split file (COCO, Flickr8k, Flickr30k) as a DataModule."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitattn.data.coco import CocoImage
from vitattn.data.karpathy import load_karpathy
from vitattn.data.tokenizer import Tokenizer
from vitattn.training.datamodules.caption_files import CaptionFilesDataModule

__all__ = ["KarpathyDataModule"]


class KarpathyDataModule(CaptionFilesDataModule):
    """The train / val / test splits of a Karpathy-split JSON file (see ``vitattn.data.karpathy``).

    Val and test references are all of an image's sentences; the vocabulary comes from the training
    captions only (``restval`` included when it joins training).

    Args:
        dataset_json: ``dataset_coco.json``, ``dataset_flickr8k.json`` or ``dataset_flickr30k.json``.
        image_dir: folder that the file names are relative to: for COCO the one holding
            ``train2014/`` and ``val2014/``, for Flickr the one holding the images.
        restval_in_train: train on the ``restval`` images too (the usual COCO setting); else they are unused.
        img_size, batch_size, num_workers, min_word_freq, max_caption_len, vocab_path, augment, cache:
            as in ``CaptionFilesDataModule``.
        bad_images, verify: unreadable image files, as in ``ImageFolderDataModule``.
        mean, std, interpolation, crop_pct, crop_mode: the preprocessing (None: the pretrained weights', else the
            whole image squashed, bicubic, ImageNet's statistics).
    """

    def __init__(
        self,
        dataset_json: str | os.PathLike,
        image_dir: str | os.PathLike,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int | str = "auto",
        min_word_freq: int | str = "auto",
        max_caption_len: int = 32,
        vocab_path: str | os.PathLike | None = None,
        restval_in_train: bool = True,
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
        self.dataset_json, self.restval_in_train = dataset_json, restval_in_train

    def split_images(self) -> tuple[list[CocoImage], list[CocoImage], list[CocoImage]]:
        splits = load_karpathy(self.dataset_json)
        train = splits["train"] + (splits["restval"] if self.restval_in_train else [])
        return train, splits["val"], splits["test"]

    def split_source(self, split: str) -> str:
        return f"{Path(self.dataset_json).resolve()} ({split} split)"
