"""What the sections time: the model sizes and batches, the models built from them, the timed calls.

Sections read the sizes through this module (``workloads.ENCODERS``), so that tests can shrink
them in one place. Dimension letters: B batch, N tokens, D width, P patch side, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import Tensor, nn

from benchmarks.timing import Env
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.models.timm_weights import load_timm_weights

# The two encoder shapes of the comparison: ViT-Ti/16 at 224 px and a small-image ViT.
ENCODERS = {
    "vit_ti16_224": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
    "vit_192d6_32px": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
    "vit_b16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
    "vit_s16_224": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
}
ENCODER_BATCH = {"vit_ti16_224": 8, "vit_192d6_32px": 64, "vit_b16_224": 128, "vit_s16_224": 128}
# At batch 128 minutes per step on a 2-core CPU (the merge section times them at small batches there)
GPU_ONLY = ("vit_b16_224", "vit_s16_224")
NUM_CLASSES = 10  # classifier head of the training step

# Captioner: the small-image encoder and the decoder that conf/experiment/coco_vit_small.yaml builds
# on it (width and heads of the encoder, mlp_ratio 2, depth 4, max_len 32), with a vocabulary of
# COCO's size (min_word_freq 5 gives about 10k words).
CAPTION_DECODER = dict(vocab_size=10_000, embed_dim=192, depth=4, num_heads=3, mlp_ratio=2.0, max_len=32)
CAPTION_BATCH, CAPTION_TOKENS = 32, 20


def encoder_names(env: Env, names: Sequence[str] | None = None) -> list[str]:
    """The encoders a section runs: ``names``, or every one in ``ENCODERS`` (``GPU_ONLY`` ones on CUDA only)."""
    return list(names or [n for n in ENCODERS if env.cuda or n not in GPU_ONLY])


def build_pair(cfg: Mapping[str, Any], num_classes: int, device: str) -> tuple[nn.Module, nn.Module, float]:
    """Our ``VisionTransformer`` and timm's, same configuration, ours holding timm's weights.

    Args:
        cfg: keyword arguments of both models (``img_size``, ``patch_size``, ``embed_dim``, ...).
        num_classes: classifier outputs (0: features).
        device: where both models go.

    Returns:
        ``(ours, timm_model, max_abs_diff)`` where the difference is of their eval outputs on noise.
    """
    ref = TimmViT(num_classes=num_classes, global_pool="token", class_token=True, qkv_bias=True, **cfg)
    ours = VisionTransformer(num_classes=num_classes, norm_first=True, activation="gelu", global_pool="cls", **cfg)
    load_timm_weights(ours, ref)
    ours, ref = ours.to(device).eval(), ref.to(device).eval()
    x = torch.randn(2, 3, cfg["img_size"], cfg["img_size"], device=device)
    with torch.inference_mode():
        diff = (ours(x) - ref(x)).abs().max().item()
    return ours, ref, diff


def build_ours(device: str, max_len: int | None = None, encoder: str = "vit_192d6_32px") -> nn.Module:
    """Our ``ImageCaptioner`` of the bench size (``encoder`` of ``ENCODERS`` + ``CAPTION_DECODER``), randomly
    initialised."""
    enc, dec = ENCODERS[encoder], dict(CAPTION_DECODER)
    if max_len is not None:
        dec["max_len"] = max_len
    ours = ImageCaptioner(
        VisionTransformer(num_classes=0, **enc),
        CaptionDecoder(memory_dim=enc["embed_dim"], drop_rate=0.0, norm_first=True, activation="gelu", **dec),
    )
    return ours.to(device).eval()


def train_step_fn(model: nn.Module, images: Tensor, labels: Tensor, env: Env) -> Callable[[], None]:
    """One SGD step: forward, cross-entropy, backward, update (both sides use the same optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with env.autocast():
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()

    return step


def forward_fn(model: nn.Module, images: Tensor, env: Env) -> Callable[[], None]:
    """One inference-mode forward of ``images`` under the run's autocast."""

    def forward() -> None:
        with torch.inference_mode(), env.autocast():
            model(images)

    return forward


@contextlib.contextmanager
def forced_length(decoder: nn.Module) -> Iterator[None]:
    """Make ``<eos>`` unreachable, so that ``generate`` always emits ``max_new_tokens`` tokens.

    ``eos_id`` is set to ``vocab_size``, an id that argmax / top-k over V logits never returns; the
    decoder's weights and the tokens it picks are unchanged. Restored on exit.
    """
    saved = decoder.eos_id
    decoder.eos_id = decoder.vocab_size
    try:
        yield
    finally:
        decoder.eos_id = saved
