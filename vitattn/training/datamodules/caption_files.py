"""Caption DataModules that read image files: COCO-style caption files and Karpathy-split files."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitattn.data.coco import CocoCaptionDataset, CocoImage, load_coco_captions, load_karpathy
from vitattn.data.images import EvalSplit, should_cache
from vitattn.data.preprocess import CAPTION_CROP_SCALE, Augment, CaptionAugment
from vitattn.data.tokenizer import Tokenizer
from vitattn.training.datamodules.base import ImageDataModule

__all__ = ["CaptionFilesDataModule", "CocoCaptionDataModule", "KarpathyDataModule"]


class CaptionFilesDataModule(ImageDataModule):
    """Image files under ``image_dir`` with their captions; subclasses say which images each split holds.

    Training items take one of their image's captions at random each time they are loaded; val and test items
    take the first, and carry all of them as references.

    Args:
        image_dir: folder that the images' ``file_name`` entries are relative to.
        min_word_freq: words seen fewer times in the training captions become ``<unk>``; ``auto``:
            the largest threshold up to 5 that leaves at most 2 % of the tokens as ``<unk>``.
        max_caption_len: longest token sequence, bos and eos included.
        vocab_path: a saved tokenizer (``vocab.json`` or ``tokenizer.json``) to use rather than one built from
            training captions; the ``tokenizer`` group (set by training) says what is built otherwise.
        augment, cache, bad_images, verify: as in ``ImageFolderDataModule``.
        mean, std, interpolation, crop_pct, crop_mode: the ``data.*`` preprocessing keys (None: the whole image
            squashed, bicubic, ImageNet's statistics).
        tokenizer, vocab: the ``tokenizer`` group, or a given tokenizer (``ImageDataModule``).
    """

    tasks = ("caption",)
    reads_files = True

    def __init__(
        self,
        image_dir: str | os.PathLike,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int | str = "auto",
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
        super().__init__(
            batch_size, num_workers, img_size, mean, std, interpolation, crop_pct, crop_mode, tokenizer, vocab
        )
        self._bad_image_settings(bad_images, verify)
        self.image_dir = image_dir
        self.min_word_freq, self.max_caption_len, self.vocab_path = min_word_freq, max_caption_len, vocab_path
        # the mild crop always; flips and colour jitter only where asked and no caption contradicts them
        self.augment = Augment.from_config(augment, scale=CAPTION_CROP_SCALE, hflip=0.0)
        self.cache_mode = cache
        should_cache(cache, 0, 0)  # an unknown mode fails here, before any file is read

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
        evaluate = self.eval_transform()
        training = CaptionAugment(self.img_size, self.augment, self.preprocess) if self.augment.enabled else evaluate
        train = CocoCaptionDataset(self.image_dir, train_images, training)
        val = CocoCaptionDataset(self.image_dir, val_images, evaluate)
        test = val if test_images is val_images else CocoCaptionDataset(self.image_dir, test_images, evaluate)
        vocab = self._caption_tokenizer(lambda: train.captions, self.min_word_freq)
        self._use_captions((train, val, test), vocab, self.max_caption_len, sample_train_caption=True)
        self._read_images({train, val, test})

    def image_files(self) -> list[str]:
        if self.train_dataset is None:
            return []
        splits = dict.fromkeys(d.dataset for d in (self.train_dataset, self.val_dataset, self.test_dataset))
        return [str(d.image_dir / im.file_name) for d in splits for im in d.images]

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
    """Captioning from COCO-style caption files (see ``vitattn.data.coco``).

    Args:
        image_dir: folder that the files' ``file_name`` entries are relative to.
        train_annotations, val_annotations: COCO caption JSON files.
        test_annotations: the test file; ``val_annotations`` when not given.
        num_workers, **settings: as ``CaptionFilesDataModule`` takes them.
    """

    def __init__(
        self,
        image_dir: str | os.PathLike,
        train_annotations: str | os.PathLike,
        val_annotations: str | os.PathLike,
        test_annotations: str | os.PathLike | None = None,
        num_workers: int | str = 0,
        **settings: Any,
    ) -> None:
        super().__init__(image_dir, num_workers=num_workers, **settings)
        self.annotations = (train_annotations, val_annotations, test_annotations or val_annotations)

    def split_images(self) -> tuple[list[CocoImage], list[CocoImage], list[CocoImage]]:
        train_file, val_file, test_file = self.annotations
        train, val = load_coco_captions(train_file), load_coco_captions(val_file)
        return train, val, val if test_file == val_file else load_coco_captions(test_file)

    def split_source(self, split: str) -> str:
        return str(Path(self.annotations[1 if split == "val" else 2]).resolve())


class KarpathyDataModule(CaptionFilesDataModule):
    """The train / val / test splits of a Karpathy-split JSON file (see ``vitattn.data.coco``).

    Args:
        dataset_json: ``dataset_coco.json``, ``dataset_flickr8k.json`` or ``dataset_flickr30k.json``.
        image_dir: folder that the file names are relative to: for COCO the one holding
            ``train2014/`` and ``val2014/``, for Flickr the one holding the images.
        restval_in_train: train on the ``restval`` images too (the usual COCO setting); else they are unused.
        **settings: as ``CaptionFilesDataModule`` takes them.
    """

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
