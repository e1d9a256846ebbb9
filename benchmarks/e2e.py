"""Section ``e2e``: JPEG files to captions (``caption_images`` on a saved bundle) against the model alone."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks import workloads
from benchmarks.report import compare
from benchmarks.timing import Env, per_second
from benchmarks.workloads import forced_length
from vitattn.bundle import load_bundle, save_bundle
from vitattn.data import Vocabulary
from vitattn.data.tokenizer import SPECIALS
from vitattn.inference import caption_images


def bench_end_to_end(
    env: Env, n_images: int = 256, batch: int | None = None, tokens: int | None = None
) -> tuple[list[dict], dict[str, Any]]:
    """Row (f): JPEG files -> captions (``caption_images`` on a saved bundle) vs model-only images/s.

    Args:
        env: the run's device and timing knobs.
        n_images: JPEG files to caption per timed call.
        batch: images per ``generate`` call (default ``CAPTION_BATCH``).
        tokens: new tokens per image (default ``CAPTION_TOKENS``).

    Returns:
        ``(rows, details)``: one row, and the samples and rates.
    """
    batch, tokens = batch or workloads.CAPTION_BATCH, tokens or workloads.CAPTION_TOKENS
    name = f"end-to-end {n_images} JPEGs b{batch} greedy"
    ours = workloads.build_ours(env.device)
    img = workloads.ENCODERS["vit_192d6_32px"]["img_size"]
    vocab = Vocabulary([f"w{i}" for i in range(workloads.CAPTION_DECODER["vocab_size"] - len(SPECIALS))])
    preprocess = dict(
        img_size=img, crop_pct=1.0, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], interpolation="bicubic"
    )
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="vitattn-bench-") as tmp:
        paths = []
        for i in range(n_images):  # small noisy photos, twice the model's side so that resizing is real
            pixels = rng.integers(0, 256, (2 * img, 2 * img, 3), dtype=np.uint8)
            paths.append(os.path.join(tmp, f"img{i:04d}.jpg"))
            Image.fromarray(pixels).save(paths[-1], quality=90)
        bundle = load_bundle(
            save_bundle(os.path.join(tmp, "bundle"), ours.cpu(), task="caption", preprocess=preprocess, vocab=vocab),
            device=env.device,
        )
        model = bundle.model
        images = torch.stack([bundle.transform(_read_rgb(p)) for p in paths[:batch]]).to(env.device)
        n_batches = math.ceil(n_images / batch)

        def model_only() -> None:  # the same number of generate calls on tensors already in memory
            with forced_length(model.decoder), env.autocast():
                for _ in range(n_batches):
                    model.generate(images, max_new_tokens=tokens)

        def files() -> None:
            with forced_length(model.decoder), env.autocast():
                records = caption_images(bundle, paths, batch_size=batch, max_new_tokens=tokens)
            if len(records) != n_images or any("error" in r for r in records):
                raise RuntimeError(f"caption_images failed: {[r for r in records if 'error' in r][:3]}")

        t = env.time({"files": files, "model_only": model_only}, repeats=3)
    r = compare(
        name,
        t["files"],
        t["model_only"],
        n_images,
        "img/s",
        "e2e",
        "model only",
        note="caption_images, num_workers=0",
        percent=True,
    )
    return [r], dict(status="measured", n_images=n_images, batch=batch, seconds=t, images_per_s=per_second(t, n_images))


def _read_rgb(path: str) -> Any:
    """The image at ``path`` as an RGB ``PIL.Image``, the file closed."""
    with Image.open(path) as image:
        return image.convert("RGB")
