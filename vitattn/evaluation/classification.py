"""Classification evaluation: top-1 / top-5 accuracy and the confusion matrix of a split, for a trained head or a
``head=coca`` model's zero-shot classifier.

Dimension letters: B batch, K classes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from vitattn.bundle import LoadedModel
from vitattn.data.images import EvalSplit, check_split, image_folder_split, open_image_folder
from vitattn.evaluation.report import EvalReport
from vitattn.evaluation.splits import labelled_split
from vitattn.inference.captioning import file_batches
from vitattn.inference.zero_shot import check_labels, zero_shot_model
from vitattn.precision import precision_autocast

__all__ = ["evaluate_classification", "evaluate_zero_shot", "topk_hits"]


def topk_hits(logits: Tensor, targets: Tensor, k: int = 5) -> Tensor:
    """``(top-1 hits, top-k hits, images)`` of (B, K) ``logits`` against (B,) ``targets``: the counts that top-1
    and top-5 accuracy divide, to be summed over batches (and ranks, as training's validation sums them)."""
    top = logits.topk(min(k, logits.shape[-1])).indices  # (B, k)
    hits = top == targets.to(top.device)[:, None]  # (B, k)
    return torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), torch.tensor(len(targets), device=top.device)])


def evaluate_classification(
    bundle: LoadedModel,
    *,
    split: str = "val",
    run_split: EvalSplit | None = None,
    data_root: str | os.PathLike | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
) -> EvalReport:
    """Top-1 / top-5 accuracy and the confusion matrix of a classifier on ``split`` of ``data_root``
    (``<split>/<class>/<image>``, class folders matched to the model's classes by name), else ``run_split``, the
    run's own (``vitattn.cli.run_split.run_split``).
    Unreadable files are left out and counted in ``num_failed``.
    """
    # heavy: torchmetrics is slow to import (docs/benchmarks.md), and only classification evaluation needs it
    from torchmetrics.classification import MulticlassConfusionMatrix

    check_split(split)
    if bundle.task != "classification":
        raise ValueError(f"this is a {bundle.task} model; accuracy needs a classification model")
    failed: list[str] = []
    data = labelled_split(bundle, split, run_split, data_root)
    source = data.source
    if data.loader is not None:
        batches, total = data.loader, len(data.loader.dataset)
    else:
        batches = file_batches(data.files, data.ids, bundle.transform, batch_size, num_workers, failed)
        total = len(data.files)
    k = len(bundle.class_names)
    counts = torch.zeros(3, dtype=torch.long)  # top-1 hits, top-5 hits, images
    confusion = MulticlassConfusionMatrix(k)
    device = bundle.device
    with (
        torch.inference_mode(),
        precision_autocast(bundle.precision, device),
        tqdm(total=total, unit="img", disable=not progress) as bar,
    ):
        for images, targets in batches:
            logits = bundle.model(images.to(device)).float().cpu()  # (B, K)
            counts += topk_hits(logits, targets)
            confusion.update(logits, targets)
            bar.update(len(targets))
    top1, top5, num_images = counts.tolist()
    if num_images == 0:
        raise ValueError(f"no image of {source} could be read")
    metrics: dict[str, float] = {"top1": top1 / num_images, "top5": top5 / num_images, "num_images": num_images}
    if failed:
        metrics["num_failed"] = len(failed)
    return EvalReport(
        "classification",
        split,
        source,
        metrics,
        confusion=confusion.compute(),
        class_names=list(bundle.class_names),
        merge_tokens=bundle.merge_tokens,
    )


def evaluate_zero_shot(
    bundle: LoadedModel,
    *,
    data_root: str | os.PathLike,
    labels: Sequence[str] | None = None,
    templates: str | os.PathLike | Sequence[str] | None = None,
    scorer: str = "auto",
    split: str = "val",
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
) -> EvalReport:
    """``evaluate_classification`` of a caption model classifying by name (``zero_shot_model``, by ``scorer``) on
    ``split`` of ``data_root``: the classes are ``labels`` (each class folder must be one of them) or the folder
    names; ``templates`` as ``templates_from`` reads them (None: the spellable defaults). The report's ``decoding``
    gives the templates and the scorer used."""
    check_split(split)
    names = check_labels(labels) if labels is not None else None
    if names is None:
        names = open_image_folder(image_folder_split(Path(data_root), split)).classes
    model = zero_shot_model(bundle, names, templates, scorer)
    report = evaluate_classification(
        model, split=split, data_root=data_root, batch_size=batch_size, num_workers=num_workers, progress=progress
    )
    classifier = model.model
    report.task, report.decoding = "zero_shot", {"templates": classifier.templates, "scorer": classifier.scorer}
    return report
