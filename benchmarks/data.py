"""Section ``data``: training steps/s from image files (cached in memory and not) against tensors in memory.

The same small ViT, optimizer and batch size train on three inputs: an ``ImageFolderDataModule``
over JPEG files four times the model's side with ``data.cache=none`` (decoded and resized every
epoch), the same with ``data.cache=ram`` (decoded and resized once), and the images already as
normalised tensors in memory (the model's speed: no data cost at all).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from benchmarks import workloads
from benchmarks.env import Env
from benchmarks.report import compare
from vitattn.models import VisionTransformer
from vitattn.training.datamodules import ImageFolderDataModule

ENCODER = "vit_192d6_32px"


def _write_images(root: str, n: int, side: int) -> None:
    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("val", 8)):
        for i in range(count):
            folder = os.path.join(root, split, f"class{i % 4}")
            os.makedirs(folder, exist_ok=True)
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def _epoch_fn(model: nn.Module, batches: Any, env: Env, normalize: Any = None) -> Any:
    """One pass over ``batches`` with a training step per batch; ``normalize``: the DataModule's, for its uint8
    images, on the device as in training."""
    normalize = normalize or (lambda images: images)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def epoch() -> None:
        for images, labels in batches():
            with env.autocast():
                loss = loss_fn(model(normalize(images.to(env.device))), labels.to(env.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    return epoch


def bench_data(env: Env, n_images: int = 512) -> tuple[list[dict], dict[str, Any]]:
    """Rows: cached files vs tensors in memory (target ``data``), and uncached files vs the same (info).

    Args:
        env: the run's device and timing knobs.
        n_images: training images (one epoch per timed sample).

    Returns:
        ``(rows, details)``.
    """
    cfg = workloads.ENCODERS[ENCODER]
    batch, side = workloads.ENCODER_BATCH[ENCODER], cfg["img_size"]
    model = VisionTransformer(num_classes=4, **cfg).to(env.device).train()
    with tempfile.TemporaryDirectory(prefix="vitattn-bench-data-") as root:
        _write_images(root, n_images, 4 * side)
        modules = {}
        for mode in ("none", "ram"):
            dm = ImageFolderDataModule(root, img_size=side, batch_size=batch, num_workers=0, cache=mode)
            dm.setup("fit")
            modules[mode] = dm
        images = torch.randn(n_images, 3, side, side)
        labels = torch.randint(0, 4, (n_images,))

        def memory() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            order = torch.randperm(n_images)
            for i in range(0, n_images, batch):
                yield images[order[i : i + batch]], labels[order[i : i + batch]]

        fns = {
            "memory": _epoch_fn(model, memory, env),
            "cached": _epoch_fn(model, modules["ram"].train_dataloader, env, modules["ram"].normalize),
            "files": _epoch_fn(model, modules["none"].train_dataloader, env, modules["none"].normalize),
        }
        t = env.time(fns, repeats=3)
    steps = -(-n_images // batch)
    note = f"{n_images} JPEGs of {4 * side} px -> {side} px, batch {batch}, num_workers=0"
    rows = [
        compare(
            f"cached files vs memory, {ENCODER}", t["cached"], t["memory"], steps, "step/s", "data", "memory", note
        ),
        compare(f"uncached files vs memory, {ENCODER}", t["files"], t["memory"], steps, "step/s", None, "memory", note),
    ]
    return rows, dict(status="measured", n_images=n_images, batch=batch, seconds=t)
