"""Captioning from COCO-style caption files as a DataModule."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitattn.data.augment import CAPTION_CROP_SCALE, Augment, CaptionAugment
from vitattn.data.cache import should_cache
from vitattn.data.coco import CocoCaptionDataset
from vitattn.data.datamodules.base import EvalSplit, ImageDataModule, caption_vocab

__all__ = ["CocoCaptionDataModule"]


class CocoCaptionDataModule(ImageDataModule):
    """Captioning from COCO-style caption files (see ``vitattn.data.coco``).

    Training items take one of their image's captions at random each time they are loaded;
    val and test items take the first, and carry all of them as references.

    Args:
        image_dir: folder that the files' ``file_name`` entries are relative to.
        train_annotations, val_annotations: COCO caption JSON files.
        test_annotations: the test file; ``val_annotations`` when not given.
        img_size: side of the square images.
        batch_size, num_workers: DataLoader settings.
        min_word_freq: words seen fewer times in the training captions become ``<unk>``; ``auto``:
            the largest threshold up to 5 that leaves at most 2 % of the tokens as ``<unk>``.
        max_caption_len: longest token sequence, bos and eos included.
        vocab_path: a saved ``Vocabulary`` to use rather than one built from training captions.
    """

    tasks = ("caption",)
    reads_files = True

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
    ) -> None:
        super().__init__(batch_size, num_workers, img_size)
        self.image_dir = image_dir
        self.annotations = (train_annotations, val_annotations, test_annotations or val_annotations)
        self.min_word_freq, self.max_caption_len, self.vocab_path = (
            min_word_freq,
            max_caption_len,
            vocab_path,
        )
        # Captions: the mild crop always; flips and colour jitter only where asked, and only where
        # no caption of the image says left / right or names a colour (CaptionAugment).
        self.augment = Augment.from_config(augment, scale=CAPTION_CROP_SCALE, hflip=0.0)
        self.cache_mode = cache
        should_cache(cache, 0, 0)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        train_file, val_file, test_file = self.annotations
        evaluate = self.eval_transform()
        training = CaptionAugment(self.img_size, self.augment, self.preprocess) if self.augment.enabled else evaluate
        train = CocoCaptionDataset(self.image_dir, train_file, training)
        val = CocoCaptionDataset(self.image_dir, val_file, evaluate)
        test = val if test_file == val_file else CocoCaptionDataset(self.image_dir, test_file, evaluate)
        vocab = caption_vocab(self.vocab, self.vocab_path, lambda: train.captions, self.min_word_freq)
        self._use_captions((train, val, test), vocab, self.max_caption_len, sample_train_caption=True)
        splits = {train, val, test}
        cache = self._cache([str(d.image_dir / im.file_name) for d in splits for im in d.images])
        if cache is not None:
            for dataset in splits:
                dataset.loader = cache.load

    def evaluation_split(self, split: str) -> EvalSplit:
        coco = (self.val_dataset if split == "val" else self.test_dataset).dataset  # TokenizedCaptions -> COCO
        file = self.annotations[1 if split == "val" else 2]
        return EvalSplit(
            str(Path(file).resolve()),
            files=[str(coco.image_dir / im.file_name) for im in coco.images],
            ids=[im.image_id for im in coco.images],
            references={im.image_id: list(im.captions) for im in coco.images},
        )
