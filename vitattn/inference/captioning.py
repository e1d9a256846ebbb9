"""Batched captioning of image files: read, encode, decode, one ``CaptionBatch`` at a time.

Dimension letters: B batch, C channels, T' generated tokens; image sides are written out (height, width).

A bad file never stops a batch: it gets a record ``{"image", "image_id", "error"}`` instead of a caption.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from vitattn.bundle.runtime import LoadedModel
from vitattn.inference.file_dataset import ImageFileDataset, collate_images
from vitattn.inference.file_list import InputImage, InputList
from vitattn.models.search import CaptionSearch
from vitattn.precision import precision_autocast

__all__ = [
    "CaptionBatch",
    "caption_batch",
    "caption_images",
    "caption_loader",
    "generate_tokens",
    "iter_caption_batches",
]


@dataclass
class CaptionBatch:
    """One batch of results.

    Attributes:
        records: one dict per input of the batch, in input order: ``image``, ``image_id`` and
            ``caption`` or ``error``.
        images: (b, C, height, width) the images that were read, on the model's device; None if none were.
        tokens: (b, T') their generated ids (``generate``'s output); None if none were read.
        captioned: for each row of ``images``, its position in ``records``.
    """

    records: list[dict[str, Any]]
    images: Tensor | None
    tokens: Tensor | None
    captioned: list[int]


def generate_tokens(model: CaptionSearch, images: Tensor, precision: str = "auto", **generate_kwargs: Any) -> Tensor:
    """``model.generate(images)`` for inference: no autograd, in ``precision`` on the images' device
    (``vitattn.precision``: ``auto`` is bf16 autocast on GPUs and on CPUs with bf16 matrix units, else fp32;
    a ``LoadedModel`` passes its resolved ``precision``). Returns (B, T') token ids."""
    with torch.inference_mode(), precision_autocast(precision, images.device):
        return model.generate(images, **generate_kwargs)


def caption_batch(
    bundle: LoadedModel,
    inputs: Sequence[InputImage],
    ok: list[int],
    images: Tensor | None,
    errors: list[tuple[int, str]],
    **generate_kwargs: Any,
) -> CaptionBatch:
    """Caption one collated batch (``collate_images``' output, images already on the model's device).

    Args:
        bundle: a caption model from ``load_model`` (its ``model``, ``vocab`` and ``precision``).
        inputs: what the batch's indices point into.
        ok: positions in ``inputs`` of the rows of ``images``.
        images: (b, C, height, width) or None when no file of the batch could be read.
        errors: ``(position, reason)`` of the files that could not be read.
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """
    index = sorted([*ok, *(i for i, _ in errors)])
    pos = {i: p for p, i in enumerate(index)}
    records = []
    for i in index:
        x = inputs[i]
        records.append({"image": x.path, "image_id": x.image_id})
    for i, reason in errors:
        records[pos[i]]["error"] = reason
    tokens = None
    if images is not None:
        tokens = generate_tokens(bundle.model, images, bundle.precision, **generate_kwargs)  # (b, T')
        for i, caption in zip(ok, bundle.vocab.decode_batch(tokens)):
            records[pos[i]]["caption"] = caption
    return CaptionBatch(records, images, tokens, [pos[i] for i in ok])


def caption_loader(
    bundle: LoadedModel,
    inputs: Sequence[InputImage],
    positions: Sequence[int] | None = None,
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """Batches of ``collate_images`` over ``inputs`` (only ``positions`` of them when given), in order."""
    if bundle.task != "caption" or bundle.vocab is None:
        raise ValueError(f"this model is a {bundle.task} bundle; captioning needs a caption bundle")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be non-negative")
    paths = inputs.paths if isinstance(inputs, InputList) else [x.path for x in inputs]
    return DataLoader(
        ImageFileDataset(paths, bundle.transform, positions),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=collate_images,
        pin_memory=pin_memory,
    )


def iter_caption_batches(
    bundle: LoadedModel,
    inputs: Sequence[InputImage],
    *,
    positions: Sequence[int] | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
    **generate_kwargs: Any,
) -> Iterator[CaptionBatch]:
    """Read, caption and decode ``inputs`` batch by batch (a ``DataLoader`` with worker processes).

    Args:
        bundle: a caption model from ``load_model``.
        inputs: the images, e.g. from ``list_inputs``.
        positions: caption only these positions of ``inputs``, in this order; default all.
        batch_size: images per ``generate`` call.
        num_workers: image-reading processes (0 reads in this process).
        progress: show a tqdm progress bar on stderr.
        **generate_kwargs: passed to ``ImageCaptioner.generate`` (``num_beams``, ``max_new_tokens``,
            ``do_sample``, ``generator``, ...).
    """
    device = bundle.device
    loader = caption_loader(
        bundle, inputs, positions, batch_size=batch_size, num_workers=num_workers, pin_memory=device.type == "cuda"
    )
    total = len(inputs) if positions is None else len(positions)
    with tqdm(total=total, unit="img", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        for ok, images, errors in loader:
            if images is not None:
                images = images.to(device, non_blocking=True)
            batch = caption_batch(bundle, inputs, ok, images, errors, **generate_kwargs)
            bar.update(len(batch.records))
            yield batch


def caption_images(
    bundle: LoadedModel,
    paths: Sequence[str | os.PathLike] | Sequence[InputImage],
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
    **generate_kwargs: Any,
) -> list[dict[str, Any]]:
    """Caption image files.

    Args:
        bundle: a caption model from ``load_model``.
        paths: image paths (``image_id`` is the position in this list) or ``InputImage``s.
        batch_size, num_workers, progress: as in ``iter_caption_batches``.
        **generate_kwargs: passed to ``ImageCaptioner.generate``.

    Returns:
        One dict per path, in order: ``{"image", "image_id", "caption"}`` or, for a file that could
        not be read, ``{"image", "image_id", "error"}``.

    Example:
        >>> caption_images(load_model("runs/coco/bundle"), ["cat.jpg"], num_beams=3)
        [{'image': 'cat.jpg', 'image_id': 0, 'caption': 'a cat sitting on a couch'}]
    """
    inputs = [p if isinstance(p, InputImage) else InputImage(str(p), i) for i, p in enumerate(paths)]
    results: list[dict[str, Any]] = []
    for batch in iter_caption_batches(
        bundle, inputs, batch_size=batch_size, num_workers=num_workers, progress=progress, **generate_kwargs
    ):
        results += batch.records
    return results
