"""``CaptionMetrics``: ``score_captions`` as a ``torchmetrics.Metric``, for any LightningModule or training loop;
``RetrievalMetrics``: retrieval recall of embeddings gathered from every rank.

Corpus metrics (CIDEr-D's document frequencies, BLEU's brevity penalty) are not a mean of per-rank figures: each
rank keeps its captions as strings, ``compute`` gathers every rank's, drops the repeats a ``DistributedSampler``
pads with (by image id) and scores the whole corpus once, so every rank returns the single-process numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from vitattn.metrics.caption import Item, first_per_image, score_captions
from vitattn.metrics.retrieval import retrieval_metrics

__all__ = ["CaptionMetrics", "RetrievalMetrics"]

_STRING_STATES = ("captions", "references", "image_ids")


class CaptionMetrics(Metric):
    """BLEU-1..4, ROUGE-L and CIDEr-D of generated captions over the whole corpus of every rank (docs/captioning.md).

    ``compute()`` returns ``score_captions``' dict: ``bleu1``..``bleu4``, ``rouge_l``, ``cider_d``, ``distinct``
    (distinct captions / captions: near 0 when the model says one thing for every image) and ``num_images``, all
    floats, the same on every rank; with ``synthetic=True`` (references that list every correct caption, as the
    shapes data's do) ``exact_match`` too. An empty dict when no rank was given a caption.

    Under DDP the strings are gathered with ``torch.distributed.all_gather_object`` (torchmetrics gathers only
    tensors), as torchmetrics' own ``MeanAveragePrecision`` gathers its masks; under NCCL each process must have
    its CUDA device set, as Lightning sets it.

    Args:
        synthetic: add ``exact_match``: meaningful only when the references are every right answer.
        kwargs: ``torchmetrics.Metric``'s (``sync_on_compute``, ``process_group``, ...).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, synthetic: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.synthetic = synthetic
        for name in _STRING_STATES:
            self.add_state(name, default=[], dist_reduce_fx=None)
        self.corpus: list[Item] = []  # what the last compute scored: (image_id, caption, references), sorted by id

    def update(
        self,
        captions: Sequence[str],
        references: Sequence[Sequence[str]],
        image_ids: Sequence[Any] | None = None,
    ) -> None:
        """Add a batch: B ``captions``, B lists of ``references``, and optionally B ``image_ids`` (ints or strings)
        so that an image seen twice (a ``DistributedSampler``'s padding) is scored once.

        Raises:
            ValueError: lengths that differ, a caption without references, a str where a list belongs, or image ids
                in some updates but not others.
        """
        for name, value in (("captions", captions), ("references", references), ("image_ids", image_ids)):
            if isinstance(value, str):
                raise ValueError(f"CaptionMetrics.update: {name} must be a list, one item per caption, got a str")
        if len(references) != len(captions):
            raise ValueError(f"CaptionMetrics.update: {len(captions)} captions but {len(references)} reference lists")
        if image_ids is not None and len(image_ids) != len(captions):
            raise ValueError(f"CaptionMetrics.update: {len(captions)} captions but {len(image_ids)} image_ids")
        for i, refs in enumerate(references):
            if isinstance(refs, str) or not refs:
                got = f"the str {refs!r}" if isinstance(refs, str) else "none"
                raise ValueError(f"CaptionMetrics.update: caption {i} needs a list of references, got {got}")
        ids = list(image_ids) if image_ids is not None else [None] * len(captions)
        if self.image_ids and ids and (self.image_ids[0] is None) != (ids[0] is None):
            raise ValueError("CaptionMetrics.update: image_ids given in some updates but not in others")
        self.captions.extend(captions)
        self.references.extend(tuple(refs) for refs in references)  # hashable: Metric.__hash__ hashes the states
        self.image_ids.extend(ids)

    def compute(self) -> dict[str, float]:
        """The metrics of every rank's captions, each image once (its first caption); the same on every rank."""
        ids = self.image_ids
        if None in ids:  # no ids: every caption is an image of its own
            if any(i is not None for i in ids):
                raise ValueError("CaptionMetrics: some ranks gave image_ids and others did not")
            ids = range(len(ids))
        self.corpus = first_per_image(zip(ids, self.captions, map(list, self.references)))
        return score_captions(self.corpus, self.synthetic) if self.corpus else {}

    def reset(self) -> None:
        super().reset()
        self.corpus = []

    def _sync_dist(self, dist_sync_fn: Callable | None = None, process_group: Any | None = None) -> None:
        # Strings cannot go through torchmetrics' tensor gather (which would leave each rank its own part).
        group = process_group or self.process_group
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, [getattr(self, name) for name in _STRING_STATES], group=group)
        for k, name in enumerate(_STRING_STATES):
            setattr(self, name, [item for part in parts for item in part[k]])  # rank 0's first

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> Module:
        return super()._apply(fn, exclude_state=(*exclude_state, *_STRING_STATES))  # .to(device): strings stay

    def _move_list_states_to_cpu(self) -> None:
        pass  # compute_on_cpu: the strings are on the host already


class RetrievalMetrics(Metric):
    """Image->text and text->image recall (``retrieval_metrics``: ``i2t_r1`` ... ``t2i_median_rank``) over every
    rank's images and every caption of each, the gallery ``vitattn-eval task=retrieval`` ranks. The embeddings are
    gathered across ranks (``dist_reduce_fx="cat"``); an image seen twice (a ``DistributedSampler``'s padding) is
    ranked once, by its id."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("images", "image_ids", "texts", "text_ids", "text_numbers"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, images: Tensor, image_ids: Tensor, texts: Tensor, text_image: Tensor) -> None:
        """(B, E) image and (N, E) text embeddings, (B,) the images' ids, (N,) each text's row in ``images``."""
        self.images.append(images.float())
        self.image_ids.append(image_ids)
        self.texts.append(texts.float())
        self.text_ids.append(image_ids[text_image])
        starts = torch.searchsorted(text_image, text_image, right=False)  # text_image is sorted: each image's texts
        self.text_numbers.append(torch.arange(len(text_image), device=text_image.device) - starts)

    def compute(self) -> dict[str, float]:
        images, image_ids, texts, text_ids, numbers = (
            dim_zero_cat(getattr(self, name)) for name in ("images", "image_ids", "texts", "text_ids", "text_numbers")
        )
        ids, first = _first_of_each(image_ids)
        _, kept = _first_of_each(text_ids * (int(numbers.max()) + 1) + numbers)  # each (image, caption k) once
        text_image = torch.searchsorted(ids, text_ids[kept])
        return retrieval_metrics(images[first] @ texts[kept].T, text_image)


def _first_of_each(keys: Tensor) -> tuple[Tensor, Tensor]:
    """The sorted distinct ``keys`` and, for each, the row where it first appears."""
    distinct, inverse = torch.unique(keys, return_inverse=True)
    rows = torch.arange(len(keys), device=keys.device)
    return distinct, torch.full_like(distinct, len(keys)).scatter_reduce(0, inverse, rows, reduce="amin")
