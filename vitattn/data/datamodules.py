"""LightningDataModules: built-in shapes, an ImageFolder tree, COCO-style captions.

Classification batches are ``(images, labels)``: (B, 3, H, W) float and (B,) long. Caption batches
are dicts from ``collate_captions``: ``images`` (B, 3, H, W), ``tokens`` (B, T) padded
``bos ... eos``, ``image_ids`` (B,) and ``references`` (B lists of strings). Loaders use plain
shuffling so that Lightning can swap in its ``DistributedSampler`` under DDP; ``image_ids`` identify
the samples it repeats to even out the ranks.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder

from vitattn.data.captions import TokenizedCaptions, collate_captions
from vitattn.data.coco import CocoCaptionDataset
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.transforms import caption_transform, classification_transform, normalize
from vitattn.data.vocab import Vocabulary


class _ImageDataModule(pl.LightningDataModule):
    """Loader settings shared by every DataModule; subclasses fill the datasets in ``setup``.

    ``tasks`` says which heads the data can train; ``preprocess`` describes the evaluation transform
    of an image file (timm's ``create_transform`` arguments) so inference reproduces it.
    """

    tasks: tuple[str, ...] = ()
    crop = {"crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bicubic"}  # whole image, squashed

    def __init__(self, batch_size: int, num_workers: int, img_size: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be non-negative")
        self.batch_size, self.num_workers, self.img_size = batch_size, num_workers, img_size
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.collate_fn = None  # the DataLoader default unless captions set one
        self.vocab: Vocabulary | None = None

    @property
    def preprocess(self) -> dict:
        return {
            "img_size": self.img_size,
            **self.crop,
            "mean": list(IMAGENET_DEFAULT_MEAN),
            "std": list(IMAGENET_DEFAULT_STD),
        }

    def _use_captions(
        self,
        splits: tuple[Dataset, Dataset, Dataset],
        vocab: Vocabulary,
        max_len: int,
        sample_train_caption: bool,
    ) -> None:
        """Wrap (train, val, test) caption datasets to yield tokens and batch them as dicts."""
        train, val, test = splits
        self.vocab = vocab
        self.train_dataset = TokenizedCaptions(train, vocab, max_len, sample_train_caption)
        self.val_dataset = TokenizedCaptions(val, vocab, max_len)
        self.test_dataset = TokenizedCaptions(test, vocab, max_len)
        self.collate_fn = partial(collate_captions, pad_id=vocab.pad_id)

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its dataloaders")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, shuffle=False)


def _caption_vocab(vocab_path: str | os.PathLike | None, captions: list[str], min_freq: int) -> Vocabulary:
    """The vocabulary at ``vocab_path`` (a trained model's), else one built from ``captions``."""
    if vocab_path is not None:
        return Vocabulary.load(vocab_path)
    return Vocabulary.build(captions, min_freq=min_freq)


class ShapesDataModule(_ImageDataModule):
    """The built-in shapes data (``vitattn.data.shapes``) for captioning or classification.

    Images are only normalised: flips or crops would change which shape is left of which.

    Args:
        task: "caption" (dict batches, ``vocab`` after setup) or "classification" (``(images,
            labels)``, label = colour and shape of the left-most object).
        img_size: image side in pixels.
        num_train, num_val, num_test: images per split.
        seed: base seed of all three splits.
        batch_size, num_workers: DataLoader settings.
        max_caption_len: longest token sequence, bos and eos included.
        vocab_path: a saved ``Vocabulary`` to use rather than one built from training captions.
    """

    tasks = ("caption", "classification")

    def __init__(
        self,
        task: Literal["caption", "classification"] = "caption",
        img_size: int = 64,
        num_train: int = 20000,
        num_val: int = 500,
        num_test: int = 500,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        max_caption_len: int = 24,
        vocab_path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, img_size)
        self.task, self.seed = task, seed
        self.num_train, self.num_val, self.num_test = num_train, num_val, num_test
        self.max_caption_len, self.vocab_path = max_caption_len, vocab_path
        self.class_names = list(CLASS_NAMES)
        self.num_classes = len(CLASS_NAMES)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:  # Lightning calls setup once per stage
            return
        splits = tuple(
            ShapesDataset(split, size, self.img_size, self.seed, self.task, transform=normalize())
            for split, size in [
                ("train", self.num_train),
                ("val", self.num_val),
                ("test", self.num_test),
            ]
        )
        if self.task == "classification":
            self.train_dataset, self.val_dataset, self.test_dataset = splits
            return
        vocab = _caption_vocab(self.vocab_path, splits[0].captions, min_freq=1)
        # canonical caption as the target everywhere: the synthetic captions are unambiguous
        self._use_captions(splits, vocab, self.max_caption_len, sample_train_caption=False)


def _image_folder(directory: Path, transform) -> ImageFolder:
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder not found: {directory} (expected {directory}/<class>/<image>)")
    try:
        return ImageFolder(directory, transform=transform)
    except FileNotFoundError as err:  # torchvision's word for "no class folders" or "no images"
        raise ValueError(f"image folder {directory} is empty: {err}") from None


class ImageFolderDataModule(_ImageDataModule):
    """Classification from ``root/train``, ``root/val`` and (if present) ``root/test``, each laid
    out as ``<split>/<class>/<image>``; without ``root/test`` the test loader reuses ``root/val``.

    Args:
        root: folder holding the splits.
        img_size: side of the square crops.
        batch_size, num_workers: DataLoader settings.
        augment: timm's training augmentation (random-resized crop, flip, colour jitter) for
            ``train``; otherwise training images get the evaluation transform.
    """

    tasks = ("classification",)
    crop = {"crop_pct": 0.875, "crop_mode": "center", "interpolation": "bilinear"}  # timm eval default

    def __init__(
        self,
        root: str | os.PathLike,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 0,
        augment: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers, img_size)
        self.root, self.augment = Path(root), augment
        self.class_names: list[str] | None = None
        self.num_classes: int | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        eval_transform = classification_transform(self.img_size, training=False)
        train = _image_folder(
            self.root / "train",
            classification_transform(self.img_size, training=True, augment=self.augment),
        )
        val = _image_folder(self.root / "val", eval_transform)
        test = _image_folder(self.root / "test", eval_transform) if (self.root / "test").exists() else val
        for split in {val, test}:
            if split.classes != train.classes:
                raise ValueError(
                    f"classes of {split.root} {split.classes} differ from those of {train.root} {train.classes}"
                )
        self.train_dataset, self.val_dataset, self.test_dataset = train, val, test
        self.class_names = list(train.classes)
        self.num_classes = len(train.classes)


class CocoCaptionDataModule(_ImageDataModule):
    """Captioning from COCO-style caption files (see ``vitattn.data.coco``).

    Training items take one of their image's captions at random each time they are loaded;
    val and test items take the first, and carry all of them as references.

    Args:
        image_dir: folder that the files' ``file_name`` entries are relative to.
        train_annotations, val_annotations: COCO caption JSON files.
        test_annotations: the test file; ``val_annotations`` when not given.
        img_size: side of the square images.
        batch_size, num_workers: DataLoader settings.
        min_word_freq: words seen fewer times in the training captions become ``<unk>``.
        max_caption_len: longest token sequence, bos and eos included.
        vocab_path: a saved ``Vocabulary`` to use rather than one built from training captions.
    """

    tasks = ("caption",)

    def __init__(
        self,
        image_dir: str | os.PathLike,
        train_annotations: str | os.PathLike,
        val_annotations: str | os.PathLike,
        test_annotations: str | os.PathLike | None = None,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 0,
        min_word_freq: int = 1,
        max_caption_len: int = 32,
        vocab_path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, img_size)
        self.image_dir = image_dir
        self.annotations = (train_annotations, val_annotations, test_annotations or val_annotations)
        self.min_word_freq, self.max_caption_len, self.vocab_path = (
            min_word_freq,
            max_caption_len,
            vocab_path,
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        train_file, val_file, test_file = self.annotations
        eval_transform = caption_transform(self.img_size, training=False)
        train = CocoCaptionDataset(self.image_dir, train_file, caption_transform(self.img_size, training=True))
        val = CocoCaptionDataset(self.image_dir, val_file, eval_transform)
        test = val if test_file == val_file else CocoCaptionDataset(self.image_dir, test_file, eval_transform)
        vocab = _caption_vocab(self.vocab_path, train.captions, self.min_word_freq)
        self._use_captions((train, val, test), vocab, self.max_caption_len, sample_train_caption=True)
