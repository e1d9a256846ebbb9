"""LightningDataModules: built-in shapes, an ImageFolder tree, COCO-style captions.

Classification batches are ``(images, labels)``: (B, 3, H, W) float and (B,) long. Caption batches
are dicts from ``collate_captions``: ``images`` (B, 3, H, W), ``tokens`` (B, T) padded
``bos ... eos``, ``image_ids`` (B,) and ``references`` (B lists of strings). Loaders use plain
shuffling so that Lightning can swap in its ``DistributedSampler`` under DDP; ``image_ids`` identify
the samples it repeats to even out the ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder

from vitattn.data.augment import CAPTION_CROP_SCALE, Augment, CaptionAugment, classification_train_transform
from vitattn.data.cache import ImageCache, should_cache
from vitattn.data.captions import TokenizedCaptions, collate_captions
from vitattn.data.coco import CocoCaptionDataset
from vitattn.data.images import IMAGE_EXTENSIONS, read_image
from vitattn.data.preprocess import eval_transform
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset
from vitattn.data.transforms import normalize
from vitattn.data.vocab import Vocabulary

__all__ = [
    "CocoCaptionDataModule",
    "EvalSplit",
    "ImageFolderDataModule",
    "ShapesDataModule",
    "image_folder_split",
    "open_image_folder",
]

SPLITS = ("val", "test")


@dataclass
class EvalSplit:
    """One split of a DataModule as evaluation sees it.

    Attributes:
        source: what the images are, for reports (a folder, a file, a generated split).
        files: image files with ``ids`` (caption image ids, or class labels for classification);
            the caller reads them, so that an unreadable file is counted, not fatal.
        ids: one per file.
        loader: batches ready for the model, when the images are not files (the built-in data).
        references: caption task: image id -> reference captions.
        synthetic: references list every correct caption, so exact match is meaningful.
    """

    source: str
    files: list[str] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    loader: DataLoader | None = None
    references: dict[Any, list[str]] | None = None
    synthetic: bool = False


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

    def eval_transform(self) -> Callable[[Any], torch.Tensor]:
        """The evaluation transform of an image file: ``eval_transform(self.preprocess)``, as inference uses."""
        return eval_transform(self.preprocess)

    cache_mode = "none"
    cache: ImageCache | None = None

    def _cache(self, paths: list[str]) -> ImageCache | None:
        """An ``ImageCache`` of ``paths`` when ``self.cache_mode`` asks for one (``vitattn.data.cache``)."""
        resize = self.eval_transform().transforms[0]  # timm's eval transform starts with its resize
        side = math.floor(self.img_size / float(self.preprocess["crop_pct"]))
        if not should_cache(self.cache_mode, len(set(paths)), side):
            return None
        self.cache = ImageCache(paths, resize)
        return self.cache

    def evaluation_split(self, split: str) -> EvalSplit:
        """The ``val`` or ``test`` split for scoring (after ``setup``); subclasses with files override this."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is unknown; choose one of {list(SPLITS)}")
        loader = self.val_dataloader() if split == "val" else self.test_dataloader()
        return EvalSplit(f"{type(self).__name__} {split} split", loader=loader)

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


def _caption_vocab(
    preset: Vocabulary | None, vocab_path: str | os.PathLike | None, captions: Callable[[], list[str]], min_freq: int
) -> Vocabulary:
    """``preset`` (a trained model's, set before ``setup``), else the one at ``vocab_path``, else one built
    from the training ``captions``."""
    if preset is not None:
        return preset
    if vocab_path is not None:
        return Vocabulary.load(vocab_path)
    return Vocabulary.build(captions(), min_freq=min_freq)


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
        fit = stage in (None, "fit")
        if self.val_dataset is not None and (self.train_dataset is not None or not fit):
            return  # Lightning calls setup once per stage
        # Evaluation (stage validate / test) with the model's vocabulary needs no training scenes.
        num_train = self.num_train if fit or (self.task == "caption" and self.vocab is None) else 0
        splits = tuple(
            ShapesDataset(split, size, self.img_size, self.seed, self.task, transform=normalize())
            for split, size in [("train", num_train), ("val", self.num_val), ("test", self.num_test)]
        )
        if self.task == "classification":
            self.train_dataset, self.val_dataset, self.test_dataset = splits
            return
        vocab = _caption_vocab(self.vocab, self.vocab_path, lambda: splits[0].captions, min_freq=1)
        # canonical caption as the target everywhere: the synthetic captions are unambiguous
        self._use_captions(splits, vocab, self.max_caption_len, sample_train_caption=False)

    def evaluation_split(self, split: str) -> EvalSplit:
        evaluation = super().evaluation_split(split)
        evaluation.source = f"shapes {split} split (seed {self.seed}, {self.img_size} px)"
        if self.task == "caption":
            shapes = evaluation.loader.dataset.dataset  # TokenizedCaptions -> ShapesDataset
            evaluation.references = {i: shapes.references(i) for i in range(len(shapes))}
            evaluation.synthetic = True
        return evaluation


def image_folder_split(root: str | os.PathLike, split: str) -> Path:
    """The folder of ``split`` under an ImageFolder ``root``: ``root/<split>``; ``test`` falls back to
    ``root/val`` when ``root/test`` does not exist (training then tests on val)."""
    root = Path(root)
    if split == "test" and not (root / "test").exists():
        return root / "val"
    return root / split


def _is_image_file(path: str) -> bool:
    name = os.path.basename(path)
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def open_image_folder(directory: str | os.PathLike, transform: Callable[[Any], Any] | None = None) -> ImageFolder:
    """``directory/<class>/<image>`` as a torchvision ``ImageFolder`` read with ``read_image``; the same file
    extensions as the captioner (``IMAGE_EXTENSIONS``), hidden files skipped. Listing reads no image."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder not found: {directory} (expected {directory}/<class>/<image>)")
    try:
        return ImageFolder(directory, transform=transform, loader=read_image, is_valid_file=_is_image_file)
    except FileNotFoundError as err:  # torchvision's word for "no class folders" or "no images"
        raise ValueError(f"image folder {directory} is empty: {err}") from None


class ImageFolderDataModule(_ImageDataModule):
    """Classification from ``root/train``, ``root/val`` and (if present) ``root/test``, each laid
    out as ``<split>/<class>/<image>``; without ``root/test`` the test loader reuses ``root/val``.

    Args:
        root: folder holding the splits.
        img_size: side of the square crops.
        batch_size, num_workers: DataLoader settings.
        augment: training augmentation (``vitattn.data.augment.Augment``): ``True`` for the defaults
            that suit ``img_size``, ``False`` for the evaluation transform, or a mapping of its settings.
        cache: ``auto``, ``ram`` or ``none``: decode and resize every image once (``vitattn.data.cache``).
    """

    tasks = ("classification",)
    crop = {"crop_pct": 0.875, "crop_mode": "center", "interpolation": "bilinear"}  # timm eval default

    def __init__(
        self,
        root: str | os.PathLike,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 0,
        augment: bool | Mapping[str, Any] = True,
        cache: str = "auto",
    ) -> None:
        super().__init__(batch_size, num_workers, img_size)
        self.root = Path(root)
        self.augment = Augment.from_config(augment)
        self.cache_mode = cache
        should_cache(cache, 0, 0)  # an unknown mode fails here, before any file is read
        self.class_names: list[str] | None = None
        self.num_classes: int | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        evaluate = self.eval_transform()
        training = (
            classification_train_transform(self.img_size, self.augment, self.preprocess)
            if self.augment.enabled
            else evaluate
        )
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
        cache = self._cache([path for folder in {train, val, test} for path, _ in folder.samples])
        if cache is not None:
            for folder in {train, val, test}:
                folder.loader = cache.load

    def evaluation_split(self, split: str) -> EvalSplit:
        folder = self.val_dataset if split == "val" else self.test_dataset
        files, labels = [path for path, _ in folder.samples], [label for _, label in folder.samples]
        return EvalSplit(str(Path(folder.root).resolve()), files=files, ids=labels)


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
        vocab = _caption_vocab(self.vocab, self.vocab_path, lambda: train.captions, self.min_word_freq)
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
