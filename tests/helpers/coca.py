"""A tiny ``head=coca`` model trained, with the contrastive loss, to pair flat colour images with captions that
name their colour: a model whose zero-shot answers and retrieval ranks are known."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.helpers.bundles import CAPTION_PREPROCESS

COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 90, 215), "yellow": (240, 200, 20)}
WORDS = "a an the photo picture image of square".split() + list(COLOURS)
TRAIN_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a {}.", "the {} square")


def colour_image(colour: str, rng: np.random.Generator, size: int = 32) -> Image.Image:
    """A flat ``colour`` square with pixel noise."""
    noise = rng.integers(-30, 30, (size, size, 3))
    return Image.fromarray(np.clip(np.array(COLOURS[colour]) + noise, 0, 255).astype(np.uint8))


def train_colour_coca(folder: Path, steps: int = 300, caption_weight: float = 0.0, head: str = "coca"):
    """Train a tiny ``CocaCaptioner`` (seed 0) for ``steps`` steps, one fresh image per colour a step, each with a
    caption from ``TRAIN_TEMPLATES``, on the CLIP loss plus ``caption_weight`` times the caption cross-entropy
    (``head="caption"``: an ``ImageCaptioner`` on the cross-entropy alone); write its bundle to ``folder`` and
    return the path."""
    import torch
    import torch.nn.functional as F

    from vitattn.bundle import save_bundle
    from vitattn.data.preprocess import eval_transform
    from vitattn.data.tokenizer import Vocabulary
    from vitattn.inference.embeddings import encode_texts
    from vitattn.losses import ClipLoss
    from vitattn.models import CaptionDecoder, CocaCaptioner, ImageCaptioner, VisionTransformer

    torch.manual_seed(0)
    rng, pick = np.random.default_rng(0), random.Random(0)
    vocab = Vocabulary(WORDS)
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0, max_len=8, drop_rate=0.0)
    if head == "coca":
        model = CocaCaptioner(encoder, decoder, embed_dim=16, text_depth=1, text_num_heads=2, text_mlp_ratio=2.0)
    else:
        model, caption_weight = ImageCaptioner(encoder, decoder), 1.0
    transform = eval_transform(CAPTION_PREPROCESS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        images = torch.stack([transform(colour_image(c, rng)) for c in COLOURS])  # (4, 3, 32, 32)
        tokens = encode_texts(vocab, [pick.choice(TRAIN_TEMPLATES).format(c) for c in COLOURS], decoder.max_len)
        loss = torch.zeros(())
        if head == "coca":
            loss = ClipLoss()(model.embed_images(images), model.embed_texts(tokens), model.logit_scale)
        if caption_weight:
            logits = model(images, tokens[:, :-1])  # (4, T - 1, V)
            caption = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=vocab.pad_id)
            loss = loss + caption_weight * caption
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_bundle(folder, model.eval(), task="caption", preprocess=CAPTION_PREPROCESS, vocab=vocab)


def check_colours(bundle: Path, caption_weight: float = 0.0, head: str = "coca") -> None:
    """Assert what ``train_colour_coca``'s model learned, on 2 fresh images per colour (seed 7): a ``head=coca``
    model's embeddings name each image's colour (zero-shot) and rank each colour's caption first for its images
    and its images first for the caption (retrieval); a model trained on the caption cross-entropy names the
    colour by likelihood."""
    from vitattn import Captioner, Classifier

    rng = np.random.default_rng(7)
    truth = [c for c in COLOURS for _ in range(2)]
    images = [colour_image(c, rng) for c in truth]
    scorers = (["contrastive"] if head == "coca" else []) + (["likelihood"] if caption_weight or head != "coca" else [])
    for scorer in scorers:
        predicted = [p.labels[0] for p in Classifier.load(bundle, labels=list(COLOURS), scorer=scorer).predict(images)]
        assert predicted == truth, f"{scorer}: {predicted}"
    if head == "coca":
        similarity = Captioner.load(bundle).similarity(images, [f"a photo of a {c}." for c in COLOURS])  # (8, 4)
        colour = torch.tensor([list(COLOURS).index(c) for c in truth])
        assert torch.equal(similarity.argmax(1), colour), similarity  # each image's caption first
        top = similarity.topk(2, dim=0).indices  # (2, 4): each caption's two best images
        assert torch.equal(colour[top], torch.arange(len(COLOURS)).expand(2, -1)), similarity
