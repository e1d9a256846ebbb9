"""The built-in shapes data as a DataModule: generated, deterministic, no download."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from vitattn.data.images import EvalSplit
from vitattn.data.shapes import CLASS_NAMES, ShapesDataset, check_max_aspect
from vitattn.data.tokenizer import Tokenizer
from vitattn.training.datamodules.base import ImageDataModule
from vitattn.training.datamodules.patches import PatchBatches, collate_patches

__all__ = ["ShapesDataModule"]


class ShapesDataModule(PatchBatches, ImageDataModule):
    """The built-in shapes data (``vitattn.data.shapes``) for captioning or classification (label: the colour
    and shape of the left-most object); ``seed`` is the base seed of all three splits.

    Captions: the canonical one (``captions_per_image=1``), or that many of the valid ones (``draw_captions``).
    Images are not augmented: flips or crops would change which shape is left of which. Start weights give only
    their mean and std: the images are drawn at ``img_size``, so no resize or crop of theirs applies.
    ``max_patches``: each drawing resized to the largest grid of at most that many ``patch_size`` patches, its
    aspect kept, batches of ``Patches`` (``PatchBatches``). ``max_aspect`` above 1: issue 69's variant, frames of
    1:1 to that, ``img_size`` their short side; without ``max_patches`` each is brought to an ``img_size`` square by
    the evaluation transform of ``crop_mode`` (``squash``, the default, or ``center``: the central square).
    ``batch_patches``: training batches of at most that many patches.
    """

    tasks = ("caption", "classification")
    weights_keys = ("mean", "std")

    def __init__(
        self,
        task: Literal["caption", "classification"] = "caption",
        img_size: int = 64,
        num_train: int = 20000,
        num_val: int = 500,
        num_test: int = 500,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int | str = 0,
        max_caption_len: int = 24,
        captions_per_image: int | str = 1,
        vocab_path: str | os.PathLike | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        tokenizer: Mapping[str, Any] | None = None,
        vocab: Tokenizer | None = None,
        max_patches: int | None = None,
        patch_size: int = 16,
        batch_patches: int | None = None,
        max_aspect: float = 1.0,
        crop_mode: str | None = None,
    ) -> None:
        captions = dict(max_caption_len=max_caption_len, captions_per_image=captions_per_image, vocab_path=vocab_path)
        settings = dict(batch_size=batch_size, num_workers=num_workers, mean=mean, std=std, tokenizer=tokenizer)
        super().__init__(img_size=img_size, vocab=vocab, min_word_freq=1, crop_mode=crop_mode, **captions, **settings)
        self.task, self.seed, self.max_aspect = task, seed, check_max_aspect(max_aspect)
        self.num_train, self.num_val, self.num_test = num_train, num_val, num_test
        self.class_names = list(CLASS_NAMES)
        self.num_classes = len(CLASS_NAMES)
        self.use_budget(max_patches, patch_size, batch_patches)
        if self.budget is not None and task == "classification":
            self.collate_fn = collate_patches

    def setup(self, stage: str | None = None) -> None:
        fit = stage in (None, "fit")
        if self.val_dataset is not None and (self.train_dataset is not None or not fit):
            return  # Lightning calls setup once per stage
        # Evaluation (stage validate / test) with the model's vocabulary needs no training scenes.
        num_train = self.num_train if fit or (self.task == "caption" and self.vocab is None) else 0
        # squares drawn at img_size are taken as they are; a budget (patches) or other aspects (a square crop) resize
        square = self.budget is None and self.max_aspect == 1
        transform = None if square else self.eval_transform()
        splits = tuple(
            ShapesDataset(split, size, self.img_size, self.seed, self.task, transform, self.max_aspect)
            for split, size in [("train", num_train), ("val", self.num_val), ("test", self.num_test)]
        )
        if self.task == "classification":
            self.train_dataset, self.val_dataset, self.test_dataset = splits
            return
        # one caption: the canonical one, as the target everywhere (the synthetic captions are unambiguous)
        per_image = None if self.captions_per_image == 1 else self.captions_per_image
        train = splits[0]
        every = lambda: [r for i in range(len(train)) for r in train.references(i)]  # noqa: E731
        vocab = self._caption_tokenizer(every if per_image else lambda: train.captions)
        self._use_captions(splits, vocab, per_image)

    def train_references(self) -> list[list[str]]:
        """Each training scene's valid captions (after ``setup``)."""
        if self.task != "caption":
            return []
        shapes = self.train_dataset.dataset  # TokenizedCaptions -> ShapesDataset
        return [shapes.references(i) for i in range(len(shapes))]

    def evaluation_split(self, split: str) -> EvalSplit:
        evaluation = super().evaluation_split(split)
        aspects = "" if self.max_aspect == 1 else f", aspects up to {self.max_aspect:g}:1"
        evaluation.source = f"shapes {split} split (seed {self.seed}, {self.img_size} px{aspects})"
        if self.task == "caption":
            shapes = evaluation.loader.dataset.dataset  # TokenizedCaptions -> ShapesDataset
            evaluation.references = {i: shapes.references(i) for i in range(len(shapes))}
            evaluation.synthetic = True
        return evaluation
