"""Retrieval evaluation of a ``head=coca`` model on a caption split: image->text and text->image recall@1/5/10
and median rank, CLIP_benchmark's convention (an image's query hits when any of its captions is in the top k).

Dimension letters: B images, N texts (every caption of every image), E embedding width.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from vitattn.bundle import LoadedModel
from vitattn.inference.embeddings import embed_pixels, embed_texts, embedding_model
from vitattn.run_dir import RunDir
from vitattn.training.evaluation.classification import file_batches
from vitattn.training.evaluation.report import RECALL, EvalReport
from vitattn.training.evaluation.splits import caption_split, check_split

__all__ = ["evaluate_retrieval", "retrieval_metrics", "retrieval_ranks"]

log = logging.getLogger(__name__)


def retrieval_ranks(similarity: Tensor, text_image: Tensor) -> tuple[Tensor, Tensor]:
    """1-based ranks of the first match: (B,) of each image's best-placed own caption among all N texts, and (N,)
    of each text's image among all B images, from ``similarity`` (B, N) and ``text_image`` (N,), the image of each
    text. A tie with the match counts in the match's favour."""
    B, N = similarity.shape
    own = text_image[None, :] == torch.arange(B, device=similarity.device)[:, None]  # (B, N)
    best = similarity.masked_fill(~own, float("-inf")).amax(dim=1)  # (B,): an image's nearest own caption
    image_ranks = 1 + (similarity > best[:, None]).sum(dim=1)  # (B,)
    matched = similarity[text_image, torch.arange(N, device=similarity.device)]  # (N,)
    text_ranks = 1 + (similarity > matched[None, :]).sum(dim=0)  # (N,)
    return image_ranks, text_ranks


def retrieval_metrics(similarity: Tensor, text_image: Tensor) -> dict[str, float]:
    """``i2t_r1``, ``i2t_r5``, ``i2t_r10`` (the share of images with an own caption in the top k texts),
    ``t2i_r1`` ... (of texts with their image in the top k images), ``i2t_median_rank``, ``t2i_median_rank``
    (the median of ``retrieval_ranks``; the mean of the middle two for an even count)."""
    if (torch.bincount(text_image, minlength=len(similarity)) == 0).any():
        raise ValueError("every image needs at least one caption to be retrieved by")
    metrics: dict[str, float] = {}
    for way, ranks in zip(("i2t", "t2i"), retrieval_ranks(similarity, text_image)):
        for k in RECALL:
            metrics[f"{way}_r{k}"] = float((ranks <= k).float().mean())
        metrics[f"{way}_median_rank"] = float(ranks.double().quantile(0.5))
    return metrics


def evaluate_retrieval(
    bundle: LoadedModel,
    *,
    split: str = "val",
    run_dir: RunDir | str | os.PathLike | None = None,
    references: str | os.PathLike | None = None,
    image_dir: str | os.PathLike | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
) -> EvalReport:
    """Image->text and text->image retrieval on a caption split (``references``, a COCO caption file with its
    images in ``image_dir``, else the run's own ``split``), every caption of every image in the gallery. Unreadable
    images, and their captions, are left out and counted in ``num_failed``; captions cut to the decoder's length
    are counted in ``num_texts_cut``."""
    check_split(split)
    model = embedding_model(bundle, "retrieval")
    data = caption_split(bundle, split, run_dir, references, image_dir, batch_size, num_workers)
    failed: list[str] = []
    if data.loader is not None:
        batches = ((b["images"], b["references"]) for b in data.loader)
    else:
        refs = data.references
        positions = file_batches(bundle, data.files, list(range(len(data.files))), batch_size, num_workers, failed)
        batches = ((images, [refs[data.ids[i]] for i in at.tolist()]) for images, at in positions)
    image_rows: list[Tensor] = []
    captions: list[Sequence[str]] = []
    with tqdm(total=len(data.references), unit="img", disable=not progress) as bar:
        for images, texts in batches:
            image_rows.append(embed_pixels(bundle, images))  # (b, E)
            captions += texts
            bar.update(len(images))
    if not image_rows:
        raise ValueError(f"no image of {data.source} could be read")
    texts = [text for per_image in captions for text in per_image]
    text_image = torch.tensor([i for i, per_image in enumerate(captions) for _ in per_image])  # (N,)
    similarity = torch.cat(image_rows) @ embed_texts(bundle, texts).T  # (B, N)
    metrics = retrieval_metrics(similarity, text_image)
    metrics.update(num_images=len(captions), num_texts=len(texts))
    cut = sum(len(bundle.vocab.encode(text)) > model.decoder.max_len for text in texts)
    if cut:
        metrics["num_texts_cut"] = cut
    if failed:
        metrics["num_failed"] = len(failed)
    return EvalReport("retrieval", split, data.source, metrics)
