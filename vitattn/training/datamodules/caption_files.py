"""What the caption DataModules that read image files share: settings, setup, the evaluation split."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vitattn.data.augment import CAPTION_CROP_SCALE, Augment, CaptionAugment
from vitattn.data.cache import should_cache
from vitattn.data.coco import CocoCaptionDataset, CocoImage
from vitattn.data.eval_split import EvalSplit
from vitattn.data.tokenizer import Tokenizer
from vitattn.training.datamodules.base import ImageDataModule

__all__ = ["CaptionFilesDataModule"]


class CaptionFilesDataModule(ImageDataModule):
    """Image files under ``image_dir`` with their captions; subclasses say which images each split holds.

    Training items take one of their image's captions at random each time they are loaded;
    val and test items take the first, and carry all of them as references.

    Args:
        image_dir: folder that the images' ``file_name`` entries are relative to.
        img_size: side of the square images.
        batch_size, num_workers: DataLoader settings.
        min_word_freq: words seen fewer times in the training captions become ``<unk>``; ``auto``:
            the largest threshold up to 5 that leaves at most 2 % of the tokens as ``<unk>``.
        max_caption_len: longest token sequence, bos and eos included.
        vocab_path: a saved tokenizer (``vocab.json`` or ``tokenizer.json``) to use rather than one built from
            training captions; the ``tokenizer`` group (set by training) says what is built otherwise.
        augment: training augmentation (``vitattn.data.augment.Augment``).
        cache: ``auto``, ``ram`` or ``none`` (``vitattn.data.cache``).
        preprocess: the ``data.*`` preprocessing keys set (``mean``, ``std``, ``interpolation``, ``crop_pct``,
            ``crop_mode``); the rest the whole image squashed (bicubic) and ImageNet's statistics.
        tokenizer, vocab: the ``tokenizer`` group, or a given tokenizer (``ImageDataModule``).

    Subclasses take ``bad_images`` and ``verify`` as ``ImageFolderDataModule`` does, and the preprocessing keys
    one by one.
    """

    tasks = ("caption",)
    reads_files = True

    def __init__(
        self,
        image_dir: str | os.PathLike,
        img_size: int,
        batch_size: int,
        num_workers: int | str,
        min_word_freq: int | str,
        max_caption_len: int,
        vocab_path: str | os.PathLike | None,
        augment: bool | Mapping[str, Any],
        cache: str,
        preprocess: Mapping[str, Any] | None = None,
        tokenizer: Mapping[str, Any] | None = None,
        vocab: Tokenizer | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, img_size, **(preprocess or {}), tokenizer=tokenizer, vocab=vocab)
        self.image_dir = image_dir
        self.min_word_freq, self.max_caption_len, self.vocab_path = min_word_freq, max_caption_len, vocab_path
        # Captions: the mild crop always; flips and colour jitter only where asked, and only where
        # no caption of the image says left / right or names a colour (CaptionAugment).
        self.augment = Augment.from_config(augment, scale=CAPTION_CROP_SCALE, hflip=0.0)
        self.cache_mode = cache
        should_cache(cache, 0, 0)

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
